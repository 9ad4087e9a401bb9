//! duet's planner at run time: a control loop beside the router that re-plans the cluster's
//! prefill:decode split from the live load and acts on it.
//!
//! Each period (`--period-s`), and at once on a burst, it reads the live arrival rate, prompt
//! and output lengths, queue and KV transfer times from the router's Prometheus endpoint
//! ([`live`]) and the workers' `Stats` (cluster token and mTLS, membership from the registry);
//! simulates every split of the live workers, and of more or fewer, on that load
//! ([`replan`]: `duet_planner`'s simulator, timed by a profile); decides ([`decide`]: pure
//! functions); publishes the desired replicas per role for the chart's autoscalers
//! ([`metrics`]); switches one worker's role toward the best split through
//! `WorkerAdmin/SwitchRole` (drained first); and logs every decision with its reason, its
//! predicted latencies and, a period later, the observed ones ([`decisions`]).
//!
//! The loop is [`service::serve`]; `duet planner` is its entry point (the image's `duet`
//! binary already links the planner and the engine's scheduler its simulator runs).

pub mod config;
pub mod decide;
pub mod decisions;
pub mod exposition;
pub mod live;
pub mod metrics;
pub mod replan;
pub mod service;

pub use config::PlannerConfig;
pub use replan::Model;
pub use service::serve;

/// What stops the planner, each naming the flag at fault.
#[derive(Debug, thiserror::Error)]
pub enum PlannerServiceError {
    #[error("{0}")]
    Flag(String),
    #[error(transparent)]
    Planner(#[from] duet_planner::PlannerError),
    #[error("--router-metrics: {0}")]
    Router(String),
    #[error("--profile: {0}")]
    Profile(String),
    #[error(transparent)]
    Auth(#[from] duet_proto::auth::AuthError),
    #[error(transparent)]
    Tls(#[from] duet_proto::tls::TlsError),
    #[error(transparent)]
    DecisionLog(#[from] decisions::DecisionLogError),
    #[error("--metrics-listen {addr}: {source}")]
    Listen {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
}
