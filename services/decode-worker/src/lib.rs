//! The decode worker: owns each request from KV reservation to last token. It reserves KV blocks
//! for the prompt (admission control: KV arrives only where memory is held), has a prefill worker
//! compute the prompt and push its KV into the reservation (or prefills locally), then generates
//! with iteration-level continuous batching and streams tokens back.

mod config;
mod peer_pull;
mod remote_prefill;
mod service;

use std::sync::Arc;
use std::time::Duration;

use duet_cluster::Role;
use duet_prefill_worker::PrefillService;
use duet_proto::v1;
use duet_worker::{Identity, KnownPeers, RoleSwitch, StartedWorker, WorkerAdminService};
use tokio::net::TcpListener;

pub use config::{DecodeConfig, PeerPullArgs, RoleSwitchArgs};

/// Loads the model and serves, registered in the cluster, until `shutdown` completes; then
/// drains (see [`duet_worker::membership`]).
pub async fn serve(
    config: DecodeConfig,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let device = config.worker.engine.device;
    config.worker.kv_transport.for_worker(device)?;
    let initial_role = config.role_switch.initial_role()?;
    let mut worker = StartedWorker::start(
        Role::Decode,
        &config.worker,
        &listener,
        config.advertise.as_deref(),
        Duration::from_millis(config.reservation_timeout_ms),
    )
    .await?;
    let (kv_transport, kv_transport_params) = config
        .worker
        .kv_transport
        .decode_offer(device, worker.engine.info().kv_ipc_offer.clone())?;
    tracing::info!(
        transport = duet_transfer::choice::transport_name(kv_transport),
        "KV transport offered to prefill workers"
    );
    let decode_peers = worker.peers(Role::Decode, &[]);
    let prefill_surface = match config.role_switch.on() {
        true => Some(prefill_surface(
            &mut worker,
            &config,
            initial_role,
            decode_peers.clone(),
        )?),
        false => None,
    };
    let role = prefill_surface
        .as_ref()
        .map(|(switch, _)| switch.clone())
        .unwrap_or_else(|| RoleSwitch::new(Role::Decode, config.worker.lease.drain_timeout()));
    let prefill_workers = worker.peers(Role::Prefill, &config.prefill);
    let state = Arc::new(service::WorkerState {
        kv_transport,
        kv_transport_params,
        identity: Identity::new(worker.worker_id.clone()),
        advertise: worker.advertise.clone(),
        engine: worker.engine.clone(),
        prefill_timeout: Duration::from_millis(config.prefill_timeout_ms),
        channels: duet_proto::Channels::new(worker.peer_auth.clone()),
        prefill_workers,
        decode_peers,
        peer_pull: config.peer_pull.on(),
        role_switch: config.role_switch.on(),
        peer_pull_cuda_ipc: config.peer_pull.kv_peer_pull_cuda_ipc.is_on(),
        ipc_pulls: Default::default(),
        node: duet_transfer::choice::node_name(),
        role: role.clone(),
    });
    let drain = worker.edge.drain_begun();
    let decode_gate = role.gate(Role::Decode).clone();
    let services = |edge: duet_proto::Edge| {
        let edge = match prefill_surface {
            None => edge,
            Some((switch, prefill)) => edge
                .ready_when(switch.serving())
                .service(
                    switch.gate(Role::Prefill).wrap(
                        v1::prefill_worker_server::PrefillWorkerServer::new(prefill)
                            .max_decoding_message_size(duet_proto::MAX_MESSAGE_BYTES)
                            .max_encoding_message_size(duet_proto::MAX_MESSAGE_BYTES),
                    ),
                )
                .service(v1::worker_admin_server::WorkerAdminServer::new(
                    WorkerAdminService { switch },
                )),
        };
        // A decode worker's own work, behind the decode role's gate (always open when the role
        // cannot switch).
        edge.service(
            decode_gate.wrap(
                v1::decode_worker_server::DecodeWorkerServer::new(service::DecodeService {
                    state: state.clone(),
                })
                .max_decoding_message_size(duet_proto::MAX_MESSAGE_BYTES)
                .max_encoding_message_size(duet_proto::MAX_MESSAGE_BYTES),
            ),
        )
        .service(
            decode_gate.wrap(
                v1::kv_transfer_server::KvTransferServer::new(service::TransferService {
                    state: state.clone(),
                })
                .max_decoding_message_size(duet_proto::MAX_MESSAGE_BYTES)
                .max_encoding_message_size(duet_proto::MAX_MESSAGE_BYTES),
            ),
        )
        .service(v1::kv_events_server::KvEventsServer::new(
            duet_worker::kv_events::KvEventsService::new(
                state.engine.kv_events().clone(),
                state.identity.incarnation,
                duet_worker::kv_events::DEFAULT_DIGEST_INTERVAL,
                drain,
            ),
        ))
        .service(v1::worker_control_server::WorkerControlServer::new(
            service::ControlService { state },
        ))
    };
    worker.serve(services, listener, shutdown).await
}

/// What a worker whose role can switch serves beside a decode worker's services: the prefill
/// worker's `Prefill` on the same engine (pushing KV to the decode cards of its cluster), and
/// the switch itself.
fn prefill_surface(
    worker: &mut StartedWorker,
    config: &DecodeConfig,
    role: Role,
    decode_workers: KnownPeers,
) -> anyhow::Result<(Arc<RoleSwitch>, PrefillService)> {
    let switch = worker.switchable(role);
    let transport = duet_transfer::choice::open_transport(
        config.worker.kv_transport,
        config.worker.engine.device,
        worker.peer_auth.clone(),
    )?;
    let prefill = PrefillService::new(
        worker.engine.clone(),
        transport,
        decode_workers,
        worker.worker_id.clone(),
        config.role_switch.prefill_max_queued_tokens,
    );
    Ok((switch, prefill))
}
