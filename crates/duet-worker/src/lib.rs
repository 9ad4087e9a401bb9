//! The worker runtime that the prefill and decode workers share.
//!
//! The model runs on one dedicated OS thread, never on the async runtime: the [`actor`] owns
//! the engine and processes [`Command`]s between forward steps, so a running batch never waits
//! on the network. The services talk to it through an [`EngineHandle`] (the one way in, cheap to
//! clone) and hear back through each [`Request`]'s own [`Event`] channel. `Stats` is answered
//! from a [`stats::Snapshot`] the actor publishes after every turn, never by waiting behind a
//! forward step; `KvEvents/Subscribe` from the [`kv_events::KvEventLog`] it appends to once per
//! turn.
//!
//! A prefill worker submits requests with a [`KvOut`]: their KV is shipped layer by layer while
//! later layers compute, and they end with their first token. A decode worker reserves KV for
//! prompts prefilled elsewhere, lets a transport write into the reservation
//! ([`duet_transfer::KvSink`]), and activates it with the prefill's first token.

pub mod actor;
pub mod actor_engine;
mod args;
mod error;
pub mod handle;
pub mod kv_events;
pub mod membership;
pub mod metrics;
pub mod peers;
pub mod request;
pub mod role_switch;
mod serve;
pub mod stats;

pub use actor::{Command, ReservationInfo};
pub use args::WorkerArgs;
pub use error::WorkerError;
pub use handle::{CancelOnDrop, EngineHandle, EngineInfo};
pub use peers::KnownPeers;
pub use request::{Event, KvOut, Request, RequestId};
pub use role_switch::{RoleSwitch, WorkerAdminService};
pub use serve::StartedWorker;
pub use stats::Identity;
