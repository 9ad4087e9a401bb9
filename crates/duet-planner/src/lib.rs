//! DistServe's planner for duet: choose how many prefill and decode workers to run, and with
//! what settings, so that the most requests per device meet both latency targets.
//!
//! - [`profile`]: what `duet profile` measured of the engine on a device, and DistServe's
//!   latency forms fitted to it ([`fit`]);
//! - [`simulator`]: a discrete-event simulation of a cluster whose decisions are the real code,
//!   the router's policy (`duet-routing`) and the engine's scheduler over a real KV pool, with
//!   only time modelled from the profile;
//! - [`workload`], [`arrivals`], [`trace`]: what a run sends and when, shared with
//!   `duet bench serve` so that one workload runs in reality and in simulation;
//! - [`search`]: DistServe's search for the placement with the most goodput per device;
//! - [`report`]: the summary both write.

pub mod arrivals;
pub mod fit;
pub mod prefix_index;
pub mod profile;
pub mod report;
pub mod search;
pub mod sim_worker;
pub mod simulator;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod trace;
pub mod workload;

/// What the planner refuses, each naming the flag, field or line at fault.
#[derive(Debug, thiserror::Error)]
pub enum PlannerError {
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    Profile(String),
    #[error("{0}")]
    Trace(String),
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}
