//! The decode worker: owns each request from KV reservation to last token. It reserves KV blocks
//! for the prompt (admission control: KV arrives only where memory is held), has a prefill worker
//! compute the prompt and push its KV into the reservation (or prefills locally), then generates
//! with iteration-level continuous batching and streams tokens back.

mod config;
mod remote_prefill;
mod service;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use duet_proto::v1;
use duet_worker::{EngineHandle, Identity};
use tokio::net::TcpListener;

pub use config::DecodeConfig;

/// Loads the model and serves, registered in the cluster, until `shutdown` completes; then
/// drains (see [`duet_worker::membership`]).
pub async fn serve(
    config: DecodeConfig,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    config.kv_transport.for_worker(config.engine.device)?;
    let token = config.auth.token()?;
    let tls = config.tls.load()?;
    let addr = listener.local_addr()?;
    let model = config.model.resolve()?;
    let engine = EngineHandle::spawn(
        "decode-engine",
        model.clone(),
        config.engine.clone(),
        Duration::from_millis(config.reservation_timeout_ms),
    )
    .await?;
    let (kv_transport, kv_transport_params) = config
        .kv_transport
        .decode_offer(config.engine.device, engine.info().kv_ipc_offer.clone())?;
    tracing::info!(
        transport = duet_transfer::choice::transport_name(kv_transport),
        "KV transport offered to prefill workers"
    );
    let state = Arc::new(service::WorkerState {
        kv_transport,
        kv_transport_params,
        identity: Identity::new(
            config
                .worker_id
                .clone()
                .unwrap_or_else(|| format!("decode-{}", addr.port())),
        ),
        advertise: config.advertise.clone().unwrap_or_else(|| addr.to_string()),
        engine,
        prefill_timeout: Duration::from_millis(config.prefill_timeout_ms),
        channels: duet_proto::Channels::new(duet_proto::PeerAuth {
            token: token.clone(),
            tls: tls.as_ref().map(duet_proto::Tls::client),
        }),
    });

    let card = duet_worker::membership::card(
        duet_cluster::Role::Decode,
        &state.identity.worker_id,
        &state.advertise,
        &state.engine,
        config.engine.device.to_string(),
    );
    let _metrics = duet_worker::metrics::export(
        &state.engine,
        "decode",
        &model,
        &state.identity.worker_id,
        config.metrics,
    )
    .await
    .context("cannot serve metrics")?;
    tracing::info!(%addr, worker = %state.identity.worker_id, "decode worker serving");
    let edge = duet_proto::Edge::new(duet_proto::EdgeOptions {
        default_deadline: Duration::from_millis(config.request_timeout_ms.max(1)),
        max_in_flight: config.max_in_flight,
        cluster_token: token,
        tls: tls
            .as_ref()
            .map(duet_proto::Tls::server_requiring_client_certs),
    });
    let drain = edge.drain_begun();
    let edge = edge
        .service(
            v1::decode_worker_server::DecodeWorkerServer::new(service::DecodeService {
                state: state.clone(),
            })
            .max_decoding_message_size(duet_proto::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(duet_proto::MAX_MESSAGE_BYTES),
        )
        .service(
            v1::kv_transfer_server::KvTransferServer::new(service::TransferService {
                state: state.clone(),
            })
            .max_decoding_message_size(duet_proto::MAX_MESSAGE_BYTES),
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
        ));
    duet_worker::membership::serve_registered(
        edge,
        listener,
        shutdown,
        card,
        &config.cluster,
        &config.lease,
    )
    .await
}
