//! The decode worker: owns each request from KV reservation to last token. It reserves KV blocks
//! for the prompt (admission control: KV arrives only where memory is held), has a prefill worker
//! compute the prompt and push its KV into the reservation (or prefills locally), then generates
//! with iteration-level continuous batching and streams tokens back.

mod config;
mod error;
mod scheduler;
mod service;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use duet_device::LoadedEngine;
use duet_proto::v1;
use tokio::net::TcpListener;

pub use config::DecodeConfig;
pub use error::DecodeError;

/// Loads the model and serves until `shutdown` completes.
pub async fn serve(
    config: DecodeConfig,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    config.kv_transport.for_worker(config.engine.device)?;
    let addr = listener.local_addr()?;
    let path = config.model.resolve()?;
    let options = config.engine.clone();
    let engine = tokio::task::spawn_blocking(move || LoadedEngine::load(&path, options))
        .await?
        .context("loading the model")?;
    let state = Arc::new(service::WorkerState::new(
        config
            .worker_id
            .clone()
            .unwrap_or_else(|| format!("decode-{}", addr.port())),
        config.advertise.clone().unwrap_or_else(|| addr.to_string()),
        engine.fingerprint().to_string(),
        engine.kv_layout(),
        scheduler::SchedulerHandle::spawn(
            engine,
            Duration::from_millis(config.reservation_timeout_ms),
        ),
        Duration::from_millis(config.prefill_timeout_ms),
    ));

    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_serving::<v1::decode_worker_server::DecodeWorkerServer<service::DecodeService>>()
        .await;
    health
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
    let (reflection_v1, reflection_v1alpha) = duet_proto::reflection_services();
    const MAX_MESSAGE: usize = 64 << 20;
    tracing::info!(%addr, worker = %state.worker_id, "decode worker serving");
    tonic::transport::Server::builder()
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(
            v1::decode_worker_server::DecodeWorkerServer::new(service::DecodeService {
                state: state.clone(),
            })
            .max_decoding_message_size(MAX_MESSAGE),
        )
        .add_service(
            v1::kv_transfer_server::KvTransferServer::new(service::TransferService {
                state: state.clone(),
            })
            .max_decoding_message_size(MAX_MESSAGE),
        )
        .add_service(v1::worker_control_server::WorkerControlServer::new(
            service::ControlService { state },
        ))
        .serve_with_incoming_shutdown(duet_proto::incoming(listener), shutdown)
        .await?;
    Ok(())
}
