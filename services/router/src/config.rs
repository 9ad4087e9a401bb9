//! The router's configuration: command-line flags, each with an environment variable.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use duet_cluster::ClusterArgs;
use duet_model::model_path::ModelArgs;
use duet_proto::{ClusterAuth, TlsArgs};
use duet_telemetry::MetricsArgs;

use crate::door::Timeouts;
use crate::openai::request::ToolCallParser;
use crate::routing::RoutingParams;
use crate::worker::HealthPolicy;
use duet_routing::{PolicyParams, RoutingPolicy};

/// How the router is run: where it listens, which workers it routes to, the model it serves
/// (config, tokenizer and chat template only; never the weights) and its limits.
#[derive(Args, Clone, Debug, PartialEq)]
pub struct RouterConfig {
    /// Address to serve the public `duet.v1.Generation` API on (with health and reflection).
    #[arg(long, env = "DUET_ROUTER_LISTEN", default_value_t = RouterConfig::default().listen)]
    pub listen: SocketAddr,

    /// Address to serve the OpenAI-compatible HTTP API on (`/v1/completions`,
    /// `/v1/chat/completions`, `/v1/models`, `/tokenize`, `/detokenize`, `/health`, `/live`);
    /// HTTPS with --tls-cert.
    /// Unset: no HTTP API.
    #[arg(long, value_name = "ADDR", env = "DUET_HTTP_LISTEN")]
    pub http_listen: Option<SocketAddr>,

    /// A prefill worker's gRPC address (host:port). Repeat the flag, or give a comma-separated
    /// list in the environment variable.
    #[arg(
        long = "prefill",
        value_name = "ADDR",
        env = "DUET_PREFILL_WORKERS",
        value_delimiter = ','
    )]
    pub prefill: Vec<String>,

    /// A decode worker's gRPC address (host:port). Repeat the flag, or give a comma-separated
    /// list in the environment variable.
    #[arg(
        long = "decode",
        value_name = "ADDR",
        env = "DUET_DECODE_WORKERS",
        value_delimiter = ','
    )]
    pub decode: Vec<String>,

    /// Route every request to the decode worker registered in the cluster under this worker id,
    /// and to no other: the router beside one decode worker in its pod, for a gateway that has
    /// already picked that pod (the GIE endpoint picker: the chart's `gie` front). Prefill
    /// workers are still chosen from the cluster. Not with `--decode`.
    #[arg(long, value_name = "WORKER_ID", env = "DUET_ONLY_DECODE_WORKER")]
    pub only_decode_worker: Option<String>,

    /// Where the workers' cards are (with `--prefill`/`--decode` workers routed to as well).
    #[command(flatten)]
    pub cluster: ClusterArgs,

    /// Seconds between two full listings of the workers' cards (anti-entropy: the watch in
    /// between delivers every change).
    #[arg(long, env = "DUET_MEMBERSHIP_RESYNC_S", default_value_t = RouterConfig::default().membership_resync_s)]
    pub membership_resync_s: u64,

    /// The served model (the router reads its config, tokenizer and chat template).
    #[command(flatten)]
    pub model: ModelArgs,

    /// A name the OpenAI API answers to (`model` in requests; `/v1/models` lists them all; the
    /// first also names the model in metrics, traces and `Info`). Repeat the flag for aliases,
    /// or give a comma-separated list in the environment variable. Unset: the model file's stem.
    #[arg(
        long = "served-model-name",
        value_name = "NAME",
        env = "DUET_SERVED_MODEL_NAME",
        value_delimiter = ',',
        value_parser = parse_served_name
    )]
    pub served_model_name: Vec<String>,

    #[command(flatten)]
    pub metrics: MetricsArgs,

    #[command(flatten)]
    pub routing: RoutingOptions,

    /// File of the API keys the public API requires (one key a line; empty lines and lines
    /// starting with `#` skipped): gRPC `Generation` calls carry `authorization: Bearer KEY`
    /// metadata, OpenAI HTTP calls (all but `/health` and `/live`) the same header, or are refused with
    /// UNAUTHENTICATED / HTTP 401. Health, liveness and reflection stay open. Unset: no key
    /// needed.
    #[arg(long, value_name = "PATH", env = "DUET_API_KEYS_FILE")]
    pub api_keys_file: Option<std::path::PathBuf>,

    /// Cluster token the router's calls to the workers carry (see `duet_proto::auth`).
    #[command(flatten)]
    pub auth: ClusterAuth,
    /// TLS on its ports and its calls to peers (see `duet_proto::tls`).
    #[command(flatten)]
    pub tls: TlsArgs,
}

/// The flags' defaults (the flags take theirs from here).
impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 50051)),
            http_listen: None,
            prefill: Vec::new(),
            decode: Vec::new(),
            only_decode_worker: None,
            cluster: ClusterArgs::default(),
            membership_resync_s: 30,
            model: ModelArgs::default(),
            served_model_name: Vec::new(),
            metrics: MetricsArgs::default(),
            routing: RoutingOptions::default(),
            api_keys_file: None,
            auth: ClusterAuth::default(),
            tls: TlsArgs::default(),
        }
    }
}

impl RouterConfig {
    /// This configuration as the router's command line (without the program name): parsed back,
    /// it gives `self`.
    pub fn to_args(&self) -> Vec<OsString> {
        let Self {
            listen,
            http_listen,
            prefill,
            decode,
            only_decode_worker,
            cluster,
            membership_resync_s,
            model,
            served_model_name,
            metrics,
            routing,
            api_keys_file,
            auth,
            tls,
        } = self;
        let mut args = vec![OsString::from(format!("--listen={listen}"))];
        args.extend(http_listen.map(|a| format!("--http-listen={a}").into()));
        args.extend(prefill.iter().map(|a| format!("--prefill={a}").into()));
        args.extend(decode.iter().map(|a| format!("--decode={a}").into()));
        args.extend(
            only_decode_worker
                .iter()
                .map(|id| format!("--only-decode-worker={id}").into()),
        );
        args.extend(cluster.to_args());
        args.push(format!("--membership-resync-s={membership_resync_s}").into());
        args.extend(model.to_args());
        args.extend(
            served_model_name
                .iter()
                .map(|n| format!("--served-model-name={n}").into()),
        );
        args.extend(metrics.to_args());
        args.extend(routing.to_args());
        args.extend(api_keys_file.iter().map(|p| {
            let mut arg = OsString::from("--api-keys-file=");
            arg.push(p);
            arg
        }));
        args.extend(auth.to_args());
        args.extend(tls.to_args());
        args
    }
}

/// A served model name: what clients put in `model`, so printable and without commas (the
/// environment variable lists names comma-separated).
pub fn parse_served_name(name: &str) -> Result<String, String> {
    let name = name.trim();
    if name.is_empty() || name.len() > 256 || name.chars().any(|c| c.is_control() || c == ',') {
        return Err(format!(
            "{name:?} cannot be a model name: 1 to 256 printable characters, no commas"
        ));
    }
    Ok(name.to_string())
}

/// How requests are routed and limited: the router flags that name no address and no model
/// (`duet up` and `duet bench serve` take them as they are).
#[derive(Args, Clone, Debug, PartialEq)]
pub struct RoutingOptions {
    /// `max_tokens` of requests that do not set it (lowered to fit the context).
    #[arg(long, env = "DUET_DEFAULT_MAX_TOKENS", default_value_t = RoutingOptions::default().default_max_tokens)]
    pub default_max_tokens: u32,

    /// How requests are spread: `cache-aware` (least estimated time to first token, counting
    /// each worker's prefix cache from its KV events), `load` (least loaded, caches ignored) or
    /// `random`.
    #[arg(long, value_enum, env = "DUET_ROUTING", default_value_t = RoutingOptions::default().routing)]
    pub routing: RoutingPolicy,

    /// Prompts whose part not cached on the decode worker is at most this many tokens are
    /// prefilled on the decode worker itself (no KV transfer).
    #[arg(long, env = "DUET_LOCAL_PREFILL_THRESHOLD", default_value_t = RoutingOptions::default().local_prefill_threshold)]
    pub local_prefill_threshold: u32,

    /// The prefill pool counts as saturated, and prompts are prefilled on the decode worker,
    /// when the best prefill worker's estimated time to first token is worse than this many
    /// times the decode worker's own. 0: never.
    #[arg(long, env = "DUET_PREFILL_SATURATION_FACTOR", default_value_t = RoutingOptions::default().prefill_saturation_factor)]
    pub prefill_saturation_factor: f64,

    /// How long a prompt the router just placed counts as cached on the worker that prefills
    /// it, before that worker's KV events confirm it, in milliseconds: a follow-up or a burst
    /// sharing a fresh prompt goes where it is being computed. 0: only the events count.
    #[arg(long, env = "DUET_PENDING_PREFIX_TTL_MS", default_value_t = RoutingOptions::default().pending_prefix_ttl_ms)]
    pub pending_prefix_ttl_ms: u64,

    /// Bandwidth of the KV transport between prefill and decode workers, in MiB/s: what
    /// moving a prompt's KV to a decode worker is estimated to cost.
    #[arg(long, env = "DUET_KV_LINK_MIB_PER_S", default_value_t = RoutingOptions::default().kv_link_mib_per_s)]
    pub kv_link_mib_per_s: u64,

    /// Requests in flight past which `Generate` and `Complete` answer RESOURCE_EXHAUSTED at once.
    #[arg(long, env = "DUET_MAX_QUEUED_REQUESTS", default_value_t = RoutingOptions::default().max_queued_requests)]
    pub max_queued_requests: usize,

    /// Prompt text past this many bytes (a `prompt`, or the `messages`' contents together) is
    /// refused with INVALID_ARGUMENT before it is tokenized. Unset: the context length times
    /// the most bytes one token of the model stands for, which no prompt that fits the context
    /// exceeds.
    #[arg(long, value_name = "BYTES", env = "DUET_MAX_PROMPT_BYTES")]
    pub max_prompt_bytes: Option<usize>,

    /// A structured-output constraint (JSON Schema, regex, Lark grammar) past this many bytes is
    /// refused with INVALID_ARGUMENT before it is compiled.
    #[arg(long, value_name = "BYTES", env = "DUET_MAX_CONSTRAINT_BYTES", default_value_t = RoutingOptions::default().max_constraint_bytes)]
    pub max_constraint_bytes: usize,

    /// Largest request message accepted, in bytes.
    #[arg(long, env = "DUET_MAX_REQUEST_BYTES", default_value_t = RoutingOptions::default().max_request_bytes)]
    pub max_request_bytes: usize,

    /// How often each worker's health and stats are polled, in milliseconds.
    #[arg(long, env = "DUET_STATS_INTERVAL_MS", default_value_t = RoutingOptions::default().stats_interval_ms)]
    pub stats_interval_ms: u64,

    /// Consecutive failed (timed-out or erroring) health checks that take a worker out of
    /// rotation; a refused connection or a NOT_SERVING answer takes it out at once, and a slow
    /// stats answer never does.
    #[arg(long, env = "DUET_UNHEALTHY_AFTER_FAILURES", default_value_t = RoutingOptions::default().unhealthy_after_failures)]
    pub unhealthy_after_failures: u32,

    /// How long a request that finds no routable decode worker waits (within its deadline) for
    /// one to come back before UNAVAILABLE, in milliseconds.
    #[arg(long, env = "DUET_WAIT_FOR_WORKER_MS", default_value_t = RoutingOptions::default().wait_for_worker_ms)]
    pub wait_for_worker_ms: u64,

    /// How long a running decode stream may go without a message (after its first) before the
    /// router fails it over to another decode worker, in milliseconds.
    #[arg(long, env = "DUET_DECODE_IDLE_TIMEOUT_MS", default_value_t = RoutingOptions::default().decode_idle_timeout_ms)]
    pub decode_idle_timeout_ms: u64,

    /// Deadline of requests whose client sets none (no `grpc-timeout`), in milliseconds.
    #[arg(long, env = "DUET_REQUEST_TIMEOUT_MS", default_value_t = RoutingOptions::default().request_timeout_ms)]
    pub request_timeout_ms: u64,

    /// A Jinja chat template file that renders chat prompts in place of the model's own (as HF
    /// `apply_chat_template` renders it): for a model whose template does not show tools, or to
    /// pin a template. Unset: the model's template, or ChatML when it has none.
    #[arg(long, value_name = "FILE", env = "DUET_CHAT_TEMPLATE")]
    pub chat_template: Option<PathBuf>,

    /// How `tool_choice: "auto"` (the default when a chat request gives tools) finds the
    /// model's tool calls in its answer: `detect` reads the markup off the chat template
    /// (`hermes` where it teaches `<tool_call>` blocks), `hermes` names it, `none` refuses
    /// `auto` with 400. `auto` is also refused for a template that does not show the tools.
    #[arg(long, value_enum, env = "DUET_TOOL_CALL_PARSER", default_value_t = RoutingOptions::default().tool_call_parser)]
    pub tool_call_parser: ToolCallParser,
}

/// The flags' defaults (the flags take theirs from here).
impl Default for RoutingOptions {
    fn default() -> Self {
        Self {
            default_max_tokens: 256,
            routing: RoutingPolicy::CacheAware,
            local_prefill_threshold: 32,
            prefill_saturation_factor: 2.0,
            pending_prefix_ttl_ms: 10_000,
            kv_link_mib_per_s: 1024,
            max_queued_requests: 256,
            max_prompt_bytes: None,
            max_constraint_bytes: duet_model::params::DEFAULT_MAX_CONSTRAINT_BYTES,
            max_request_bytes: 4 * 1024 * 1024,
            stats_interval_ms: 500,
            unhealthy_after_failures: 3,
            wait_for_worker_ms: 5_000,
            decode_idle_timeout_ms: 30_000,
            request_timeout_ms: 600_000,
            chat_template: None,
            tool_call_parser: ToolCallParser::Detect,
        }
    }
}

impl RoutingOptions {
    /// What the pools route by.
    pub fn params(&self) -> RoutingParams {
        RoutingParams {
            policy: PolicyParams {
                policy: self.routing,
                local_prefill_threshold: self.local_prefill_threshold,
                kv_link_bytes_per_s: self.kv_link_mib_per_s as f64 * 1024.0 * 1024.0,
                prefill_saturation_factor: self.prefill_saturation_factor,
            },
            health: HealthPolicy {
                unhealthy_after: self.unhealthy_after_failures,
            },
            pending_prefix_ttl: Duration::from_millis(self.pending_prefix_ttl_ms),
        }
    }

    /// How long the core waits on workers.
    pub fn timeouts(&self) -> Timeouts {
        Timeouts {
            wait_for_worker: Duration::from_millis(self.wait_for_worker_ms),
            decode_idle: Duration::from_millis(self.decode_idle_timeout_ms.max(1)),
        }
    }

    /// These options as the flags above: parsed back, they give `self`.
    pub fn to_args(&self) -> Vec<OsString> {
        let Self {
            default_max_tokens,
            routing,
            local_prefill_threshold,
            prefill_saturation_factor,
            pending_prefix_ttl_ms,
            kv_link_mib_per_s,
            max_queued_requests,
            max_prompt_bytes,
            max_constraint_bytes,
            max_request_bytes,
            stats_interval_ms,
            unhealthy_after_failures,
            wait_for_worker_ms,
            decode_idle_timeout_ms,
            request_timeout_ms,
            chat_template,
            tool_call_parser,
        } = self;
        let mut args: Vec<OsString> = [
            format!("--default-max-tokens={default_max_tokens}"),
            format!("--routing={routing}"),
            format!("--local-prefill-threshold={local_prefill_threshold}"),
            format!("--prefill-saturation-factor={prefill_saturation_factor}"),
            format!("--pending-prefix-ttl-ms={pending_prefix_ttl_ms}"),
            format!("--kv-link-mib-per-s={kv_link_mib_per_s}"),
            format!("--max-queued-requests={max_queued_requests}"),
            format!("--max-constraint-bytes={max_constraint_bytes}"),
            format!("--max-request-bytes={max_request_bytes}"),
            format!("--stats-interval-ms={stats_interval_ms}"),
            format!("--unhealthy-after-failures={unhealthy_after_failures}"),
            format!("--wait-for-worker-ms={wait_for_worker_ms}"),
            format!("--decode-idle-timeout-ms={decode_idle_timeout_ms}"),
            format!("--request-timeout-ms={request_timeout_ms}"),
            format!("--tool-call-parser={tool_call_parser}"),
        ]
        .into_iter()
        .map(Into::into)
        .collect();
        args.extend(max_prompt_bytes.map(|b| format!("--max-prompt-bytes={b}").into()));
        args.extend(chat_template.iter().map(|p| {
            let mut arg = OsString::from("--chat-template=");
            arg.push(p);
            arg
        }));
        args
    }
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::*;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        config: RouterConfig,
    }

    #[test]
    fn flags_and_defaults() {
        Cli::command().debug_assert();
        let c = Cli::try_parse_from([
            "duet-router",
            "--decode",
            "a:1",
            "--decode",
            "b:2,c:3",
            "--prefill",
            "p:1",
            "--model",
            "m.gguf",
        ])
        .unwrap()
        .config;
        assert_eq!(c.decode, ["a:1", "b:2", "c:3"]);
        assert_eq!(c.prefill, ["p:1"]);
        assert_eq!(c.listen.to_string(), "127.0.0.1:50051");
        assert_eq!(c.http_listen, None);
        assert_eq!(
            c.model.model.as_deref(),
            Some(std::path::Path::new("m.gguf"))
        );
        let r = &c.routing;
        assert_eq!((r.default_max_tokens, r.local_prefill_threshold), (256, 32));
        assert_eq!(r.routing, RoutingPolicy::CacheAware);
        assert_eq!(
            (r.prefill_saturation_factor, r.kv_link_mib_per_s),
            (2.0, 1024)
        );
        assert_eq!((r.max_queued_requests, r.max_request_bytes), (256, 4 << 20));
        assert_eq!((r.stats_interval_ms, r.request_timeout_ms), (500, 600_000));
        assert_eq!(
            (r.unhealthy_after_failures, r.wait_for_worker_ms),
            (3, 5_000)
        );
        assert_eq!(r.decode_idle_timeout_ms, 30_000);
        assert_eq!(r.max_prompt_bytes, None);
        assert_eq!(
            (&r.chat_template, r.tool_call_parser),
            (&None, ToolCallParser::Detect)
        );
    }

    #[test]
    fn no_flags_give_the_default() {
        let c = Cli::try_parse_from(["duet-router"]).unwrap().config;
        assert_eq!(c, RouterConfig::default());
    }

    /// Every field differs from its default, so a flag `to_args` leaves out fails the test.
    #[test]
    fn to_args_parses_back_to_the_same_config() {
        let c = RouterConfig {
            listen: "0.0.0.0:7001".parse().unwrap(),
            http_listen: Some("0.0.0.0:7002".parse().unwrap()),
            prefill: vec!["p:1".into(), "p:2".into()],
            decode: vec!["d:1".into()],
            only_decode_worker: Some("decode-7f9c".into()),
            cluster: ClusterArgs {
                etcd: vec!["etcd:2379".into()],
                cluster: "prod".into(),
                ..Default::default()
            },
            membership_resync_s: 5,
            model: ModelArgs {
                model: Some("some dir/m.gguf".into()),
                models_dir: "elsewhere".into(),
            },
            served_model_name: vec!["SmolLM2-135M-Instruct".into(), "smol/alias v2".into()],
            metrics: MetricsArgs {
                metrics_listen: Some("0.0.0.0:7003".parse().unwrap()),
            },
            routing: RoutingOptions {
                default_max_tokens: 7,
                routing: RoutingPolicy::Random,
                local_prefill_threshold: 0,
                prefill_saturation_factor: 0.5,
                pending_prefix_ttl_ms: 29,
                kv_link_mib_per_s: 3,
                max_queued_requests: 9,
                max_prompt_bytes: Some(4321),
                max_constraint_bytes: 5678,
                max_request_bytes: 1234,
                stats_interval_ms: 11,
                unhealthy_after_failures: 17,
                wait_for_worker_ms: 19,
                decode_idle_timeout_ms: 23,
                request_timeout_ms: 13,
                chat_template: Some("templates dir/chat.jinja".into()),
                tool_call_parser: ToolCallParser::Hermes,
            },
            api_keys_file: Some("key dir/keys".into()),
            auth: ClusterAuth {
                cluster_token: None,
                cluster_token_file: Some("secret dir/token".into()),
            },
            tls: TlsArgs::new(
                "certs dir/cert.pem".into(),
                "key.pem".into(),
                "ca.pem".into(),
            ),
        };
        let argv = std::iter::once("duet-router".into()).chain(c.to_args());
        assert_eq!(Cli::try_parse_from(argv).unwrap().config, c);
    }
}
