//! duet's prefill worker: computes prompts' KV caches in batches (reusing cached prefix blocks,
//! chunking long prompts), pushes the KV layer by layer into a decode worker's reservation while
//! later layers compute, and returns the first sampled token.
//!
//! [`serve`] runs the whole worker on one port: `duet.v1.PrefillWorker`, `duet.v1.WorkerControl`,
//! `grpc.health.v1.Health` and server reflection (v1 and v1alpha). The model runs on one
//! dedicated engine thread ([`scheduler`]); the gRPC side never blocks on it.

pub mod config;
pub mod error;
pub mod kv_push;
pub mod scheduler;
pub mod service;

use std::future::Future;

use anyhow::Context;
use duet_proto::v1::prefill_worker_server::PrefillWorkerServer;
use duet_proto::v1::worker_control_server::WorkerControlServer;

pub use config::PrefillConfig;
pub use error::PrefillError;
pub use service::PrefillService;

use kv_push::MAX_MESSAGE_BYTES;

/// Loads the model and serves a prefill worker on `listener` until `shutdown` resolves.
pub async fn serve(
    config: PrefillConfig,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    config.kv_transport.for_worker(config.engine.device)?;
    let addr = listener
        .local_addr()
        .context("reading the listener's address")?;
    let worker_id = config.worker_id_for(addr.port());
    let model = config.model.resolve()?;
    tracing::info!(worker_id, model = %model.display(), "loading the model");
    let scheduler = scheduler::spawn(model, config.engine.clone()).await?;
    let service = PrefillService::new(scheduler, worker_id.clone(), config.max_queued_tokens);
    tracing::info!(
        worker_id,
        %addr,
        fingerprint = service.fingerprint(),
        "prefill worker serving"
    );

    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_serving::<PrefillWorkerServer<PrefillService>>()
        .await;
    health
        .set_serving::<WorkerControlServer<PrefillService>>()
        .await;
    health
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
    let (reflection_v1, reflection_v1alpha) = duet_proto::reflection_services();

    tonic::transport::Server::builder()
        .add_service(
            PrefillWorkerServer::new(service.clone())
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
        )
        .add_service(
            WorkerControlServer::new(service)
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
        )
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .serve_with_incoming_shutdown(duet_proto::incoming(listener), shutdown)
        .await
        .context("serving gRPC")?;
    tracing::info!(worker_id, "prefill worker stopped");
    Ok(())
}
