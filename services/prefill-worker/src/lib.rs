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
pub mod decode_workers;
pub mod service;

use std::future::Future;

use anyhow::Context;
use duet_proto::v1::kv_events_server::KvEventsServer;
use duet_proto::v1::prefill_worker_server::PrefillWorkerServer;
use duet_proto::v1::worker_control_server::WorkerControlServer;

pub use config::PrefillConfig;
use decode_workers::KnownDecodeWorkers;
pub use service::PrefillService;

/// Loads the model and serves a prefill worker on `listener`, registered in the cluster, until
/// `shutdown` resolves; then drains (see [`duet_worker::membership`]).
pub async fn serve(
    config: PrefillConfig,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let token = config.auth.token()?;
    let tls = config.tls.load()?;
    let transport = duet_transfer::choice::open_transport(
        config.kv_transport,
        config.engine.device,
        duet_proto::PeerAuth {
            token: token.clone(),
            tls: tls.as_ref().map(duet_proto::Tls::client),
        },
    )?;
    let addr = listener
        .local_addr()
        .context("reading the listener's address")?;
    let worker_id = config.worker_id_for(addr.port());
    let model = config.model.resolve()?;
    tracing::info!(worker_id, model = %model.display(), "loading the model");
    // A prefill worker holds no KV reservations, so their lease does not matter here.
    let engine = duet_worker::EngineHandle::spawn(
        "prefill-engine",
        model.clone(),
        config.engine.clone(),
        std::time::Duration::ZERO,
    )
    .await?;
    let _metrics =
        duet_worker::metrics::export(&engine, "prefill", &model, &worker_id, config.metrics)
            .await
            .context("cannot serve metrics")?;
    let advertise = config.advertise.clone().unwrap_or_else(|| addr.to_string());
    let card = duet_worker::membership::card(
        duet_cluster::Role::Prefill,
        &worker_id,
        &advertise,
        &engine,
        config.engine.device.to_string(),
    );
    let (membership, follower) =
        duet_cluster::membership::follow(config.cluster.clone(), decode_workers::MEMBERSHIP_RESYNC);
    let decode_workers = KnownDecodeWorkers::new(&config.decode, membership);
    let service = PrefillService::new(
        engine,
        transport,
        decode_workers,
        worker_id.clone(),
        config.max_queued_tokens,
    );
    tracing::info!(
        worker_id,
        %addr,
        fingerprint = service.fingerprint(),
        "prefill worker serving"
    );

    let edge = duet_proto::Edge::new(duet_proto::EdgeOptions {
        default_deadline: std::time::Duration::from_millis(config.request_timeout_ms.max(1)),
        max_in_flight: config.max_in_flight,
        cluster_token: token,
        tls: tls
            .as_ref()
            .map(duet_proto::Tls::server_requiring_client_certs),
    });
    let drain = edge.drain_begun();
    let edge = edge
        .service(
            PrefillWorkerServer::new(service.clone())
                .max_decoding_message_size(duet_proto::MAX_MESSAGE_BYTES)
                .max_encoding_message_size(duet_proto::MAX_MESSAGE_BYTES),
        )
        .service(KvEventsServer::new(service.kv_events(drain)))
        .service(WorkerControlServer::new(service));
    let served = duet_worker::membership::serve_registered(
        edge,
        listener,
        shutdown,
        card,
        &config.cluster,
        &config.lease,
    )
    .await;
    follower.abort();
    served?;
    tracing::info!(worker_id, "prefill worker stopped");
    Ok(())
}
