//! Membership: how duet's workers find each other.
//!
//! Each worker keeps a [`WorkerCard`] at `/duet/<cluster>/workers/<role>/<worker-id>`, written
//! create-if-absent on a lease that a thread of its own keeps alive ([`Registration`]); the
//! router follows the cards ([`membership::follow`]). Both go through the [`Registry`] seam:
//! etcd ([`EtcdRegistry`]), or the embedded registry of one process ([`EmbeddedRegistry`],
//! `duet up`'s default).

pub mod args;
mod backoff;
pub mod card;
pub mod embedded;
pub mod error;
pub mod etcd;
pub mod membership;
pub mod registration;
pub mod registry;

pub use args::{ClusterArgs, EtcdAuthArgs, LeaseArgs};
pub use card::{CardKey, CardState, Role, WorkerCard};
pub use embedded::EmbeddedRegistry;
pub use error::ClusterError;
pub use etcd::EtcdRegistry;
pub use membership::Membership;
pub use registration::{Registered, Registration};
pub use registry::Registry;
