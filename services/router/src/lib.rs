//! duet's router: the public `duet.v1.Generation` API in front of the prefill and decode pools.
//!
//! It validates and tokenizes requests (loading only the model's config, tokenizer and chat
//! template), knows its workers from flags and from the cluster's worker cards (etcd, or the
//! embedded registry of its process), picks a decode worker and a prefill plan from the
//! workers' cards, polled health and stats, relays the decode worker's token stream to the client, and fails over to another
//! decode worker when one dies mid-stream. Health (`grpc.health.v1`) and server reflection
//! (v1 and v1alpha) are served on the same port; the OpenAI-compatible HTTP API ([`openai`]) on
//! its own (`--http-listen`). Both fronts enter the core through one door ([`door`]).
//!
//! [`serve`] runs it on a listener until a shutdown future resolves, so `duet up` and tests can
//! run it in-process; `main.rs` is a thin command around it.

pub mod api_keys;
pub mod config;
pub mod door;
pub mod error;
pub mod grpc;
pub mod https;
pub mod ids;
pub mod kv_feed;
pub mod kv_index;
pub mod metrics;
pub mod openai;
mod relay;
pub mod routing;
pub mod validate;
pub mod worker;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use duet_model::chat::ChatTemplate;
use duet_model::model_files::open_model;
use duet_proto::v1::generation_server::GenerationServer;

use crate::api_keys::{ApiKeys, RequireApiKey};
use crate::openai::server::{HttpFront, ServedModel};

pub use config::{RouterConfig, RoutingOptions};
pub use door::RouterState;
pub use error::RouterError;
pub use grpc::GenerationService;
pub use routing::Pools;
pub use validate::{PromptModel, ValidationError};

/// Loads what the router needs of a model: tokenizer, chat template (`--chat-template`, else
/// the model's, else ChatML), context length and vocabulary size; text to tokenize is limited
/// to `--max-prompt-bytes`, by default
/// [`validate::max_prompt_bytes_for`] the context, and constraints to `--max-constraint-bytes`.
/// Weights are memory-mapped by the loader for its fingerprint digest but never read whole;
/// they are unmapped before this returns.
pub fn load_prompt_model(path: &Path, options: &RoutingOptions) -> anyhow::Result<PromptModel> {
    let files = open_model(path).with_context(|| format!("loading model {}", path.display()))?;
    let context_length = u32::try_from(files.config.max_position_embeddings)
        .context("the model's context length does not fit in 32 bits")?;
    let vocab_size = u32::try_from(files.config.vocab_size)
        .context("the model's vocabulary size does not fit in 32 bits")?;
    let chat = match &options.chat_template {
        Some(file) => ChatTemplate::from_file(file, &files.tokenizer)?,
        None => files.chat_template.unwrap_or_else(ChatTemplate::chatml),
    };
    Ok(PromptModel {
        max_prompt_bytes: options
            .max_prompt_bytes
            .unwrap_or_else(|| validate::max_prompt_bytes_for(&files.tokenizer, context_length)),
        tokenizer: files.tokenizer,
        chat: Arc::new(chat),
        context_length,
        vocab_size,
        default_max_tokens: options.default_max_tokens,
        max_constraint_bytes: options.max_constraint_bytes,
        grammars: Default::default(),
    })
}

pub use duet_model::model_path::model_name;

/// Serves the router on `listener` until `shutdown` resolves (then drains open calls).
pub async fn serve(
    config: RouterConfig,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    if config.only_decode_worker.is_some() && !config.decode.is_empty() {
        anyhow::bail!(
            "--only-decode-worker takes its decode worker from the cluster's cards: it cannot be combined with --decode"
        );
    }
    let path = config.model.resolve()?;
    let (load_path, options) = (path.clone(), config.routing.clone());
    let model = tokio::task::spawn_blocking(move || load_prompt_model(&load_path, &options))
        .await
        .context("model loading panicked")??;
    let token = config.auth.token()?;
    let tls = config.tls.load()?;
    let pools = Pools::new(
        &config.decode,
        &config.prefill,
        duet_proto::PeerAuth {
            token: token.clone(),
            tls: tls.as_ref().map(duet_proto::Tls::client),
        },
        config.routing.params(),
    )?
    .only_decode_worker(config.only_decode_worker.clone());
    pools.start_polling(Duration::from_millis(
        config.routing.stats_interval_ms.max(1),
    ));
    let served_names = match config.served_model_name.as_slice() {
        [] => vec![model_name(&path)],
        names => names.to_vec(),
    };
    let state = Arc::new(RouterState::new(
        model,
        served_names,
        pools,
        config.routing.timeouts(),
    ));
    let api_keys = match &config.api_keys_file {
        Some(path) => Some(Arc::new(ApiKeys::load(path)?)),
        None => None,
    };
    let generation = GenerationServer::new(GenerationService::new(state.clone()))
        .max_decoding_message_size(config.routing.max_request_bytes)
        .max_encoding_message_size(duet_proto::MAX_MESSAGE_BYTES);
    let generation = RequireApiKey {
        inner: generation,
        keys: api_keys.clone(),
    };
    // With a cluster token, only cards signed with it are workers.
    let cluster =
        (config.cluster.clone()).signed_with(token.as_ref().map(|t| t.as_str().as_bytes()));
    let (membership, follower) = duet_cluster::membership::follow(
        cluster,
        Duration::from_secs(config.membership_resync_s.max(1)),
    );
    let syncer = tokio::spawn(sync_pools(state.clone(), membership));
    let refusals = {
        let state = state.clone();
        tokio::spawn(async move { state.pools().warn_of_refused_prefill().await })
    };
    let _metrics = duet_telemetry::metrics::Registration::new(state.metrics());
    let local = listener.local_addr().ok();
    tracing::info!(
        addr = ?local,
        model = %state.model_name,
        static_decode_workers = config.decode.len(),
        static_prefill_workers = config.prefill.len(),
        only_decode_worker = ?config.only_decode_worker,
        etcd = ?config.cluster.etcd,
        routing = %config.routing.routing,
        cluster = config.cluster.cluster,
        "router serving"
    );
    let request_timeout = Duration::from_millis(config.routing.request_timeout_ms.max(1));
    let refused = state.metrics().clone();
    let edge = duet_proto::Edge::new(duet_proto::EdgeOptions {
        default_deadline: request_timeout,
        max_in_flight: config.routing.max_queued_requests,
        cluster_token: token,
        // The public port: TLS without client certificates (clients present API keys).
        tls: tls.as_ref().map(duet_proto::Tls::server),
    })
    .on_refused(move || refused.finished(metrics::Outcome::Failed(tonic::Code::ResourceExhausted)));
    let shutdown = futures::FutureExt::shared(Box::pin(shutdown));
    let metrics_endpoint = config
        .metrics
        .serve(shutdown.clone())
        .await
        .context("cannot serve metrics")?;
    let http = match config.http_listen {
        Some(addr) => {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot listen for HTTP on {addr}"))?;
            tracing::info!(addr = %addr, tls = tls.is_some(), "OpenAI-compatible HTTP API serving");
            let front = Arc::new(HttpFront {
                core: state.clone(),
                model: ServedModel::new(
                    state.served_names.clone(),
                    &state.model,
                    config.routing.tool_call_parser,
                ),
                limit: edge.in_flight_limit(),
                request_timeout,
            });
            let app = openai::server::app(front, config.routing.max_request_bytes, api_keys);
            Some(tokio::spawn(openai::server::serve(
                app,
                listener,
                tls.as_ref().map(duet_proto::Tls::https),
                shutdown.clone(),
            )))
        }
        None => None,
    };
    let result = edge.service(generation).serve(listener, shutdown).await;
    follower.abort();
    syncer.abort();
    refusals.abort();
    if let Some(http) = http {
        http.await
            .context("the HTTP front panicked")?
            .context("HTTP server failed")?;
    }
    if let Some(endpoint) = metrics_endpoint {
        endpoint
            .await
            .context("the metrics endpoint panicked")?
            .context("metrics endpoint failed")?;
    }
    result.context("router server failed")
}

/// Applies every new membership to the pools.
async fn sync_pools(
    state: Arc<RouterState>,
    mut membership: tokio::sync::watch::Receiver<Arc<duet_cluster::Membership>>,
) {
    loop {
        let current = membership.borrow_and_update().clone();
        state.pools().sync(&current);
        if membership.changed().await.is_err() {
            return;
        }
    }
}
