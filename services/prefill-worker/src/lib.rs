//! duet's prefill worker: computes prompts' KV caches in batches (reusing cached prefix blocks,
//! chunking long prompts), pushes the KV layer by layer into a decode worker's reservation while
//! later layers compute, and returns the first sampled token.
//!
//! [`serve`] runs the whole worker on one port: `duet.v1.PrefillWorker`, `duet.v1.WorkerControl`,
//! `duet.v1.KvEvents`, `grpc.health.v1.Health` and server reflection (v1 and v1alpha). The model
//! runs on the
//! engine thread of the shared worker runtime ([`duet_worker`]); the gRPC side never blocks on
//! it, and the KV goes out through the transport seam ([`duet_transfer`]).

pub mod config;
pub mod service;

use std::future::Future;
use std::time::Duration;

use duet_cluster::Role;
use duet_proto::v1::kv_events_server::KvEventsServer;
use duet_proto::v1::prefill_worker_server::PrefillWorkerServer;
use duet_proto::v1::worker_control_server::WorkerControlServer;

pub use config::PrefillConfig;
use duet_worker::{KnownPeers, StartedWorker};
pub use service::PrefillService;

/// Loads the model and serves a prefill worker on `listener`, registered in the cluster, until
/// `shutdown` resolves; then drains (see [`duet_worker::membership`]).
pub async fn serve(
    config: PrefillConfig,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let device = config.worker.engine.device;
    config.worker.kv_transport.for_worker(device)?;
    // A prefill worker holds no KV reservations, so their lease does not matter here.
    let mut worker = StartedWorker::start(
        Role::Prefill,
        &config.worker,
        &listener,
        config.advertise.as_deref(),
        Duration::ZERO,
    )
    .await?;
    let transport = duet_transfer::choice::open_transport(
        config.worker.kv_transport,
        device,
        worker.peer_auth.clone(),
    )?;
    let decode_workers = worker.peers(Role::Decode, &config.decode);
    let ready = ready_while_a_decode_worker_is_known(decode_workers.clone());
    let service = PrefillService::new(
        worker.engine.clone(),
        transport,
        decode_workers,
        worker.worker_id.clone(),
        config.max_queued_tokens,
    );
    let drain = worker.edge.drain_begun();
    let services = |edge: duet_proto::Edge| {
        edge.ready_when(ready)
            .service(
                PrefillWorkerServer::new(service.clone())
                    .max_decoding_message_size(duet_proto::MAX_MESSAGE_BYTES)
                    .max_encoding_message_size(duet_proto::MAX_MESSAGE_BYTES),
            )
            .service(KvEventsServer::new(service.kv_events(drain)))
            .service(WorkerControlServer::new(service))
    };
    worker.serve(services, listener, shutdown).await
}

/// SERVING only while some decode worker is known: a prefill worker that can push KV nowhere
/// would have every remote prefill refused, and the decode workers fall back to prefilling
/// themselves, so it takes no work, and says why.
fn ready_while_a_decode_worker_is_known(
    mut known: KnownPeers,
) -> tokio::sync::watch::Receiver<bool> {
    let (tx, rx) = tokio::sync::watch::channel(known.any());
    tokio::spawn(async move {
        let mut said = None;
        loop {
            let ready = known.any();
            if said != Some(ready) {
                if ready {
                    tracing::info!("a decode worker is known: serving");
                } else {
                    tracing::warn!(
                        "no decode worker is known to push KV to, so this prefill worker is not \
                         ready (health NOT_SERVING): name the decode workers with --decode ADDR \
                         (DUET_DECODE_WORKERS), or follow the cluster's cards with --etcd"
                    );
                }
                said = Some(ready);
            }
            tx.send_replace(ready);
            tokio::select! {
                () = known.changed() => {}
                () = tx.closed() => return,
            }
        }
    });
    rx
}
