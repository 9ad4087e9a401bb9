//! What can go wrong with membership.

/// A membership error.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// A cluster or worker name that cannot be a segment of a key.
    #[error("invalid {what} name {name:?}: use 1 to 63 ASCII letters, digits, '-', '_' or '.'")]
    BadName { what: String, name: String },
    /// A card that does not parse or does not belong to its key (it is skipped).
    #[error("skipping the worker card at {key}: {why}")]
    BadCard { key: String, why: String },
    /// The etcd security flags cannot be used (a file that cannot be read, a user without a
    /// password, TLS with an http:// endpoint).
    #[error("etcd configuration: {0}")]
    EtcdConfig(String),
    /// etcd did not answer, or answered with an error.
    #[error("etcd at {endpoints}: {message}")]
    Etcd { endpoints: String, message: String },
    /// Another worker (another address) holds this worker's key.
    #[error("{key} is held by another worker ({holder}); give this one its own --worker-id")]
    IdTaken { key: String, holder: String },
    /// The watch cannot resume from the asked revision: it was compacted away.
    #[error("the watch was cancelled: revision {revision} is compacted")]
    Compacted { revision: i64 },
    /// The watch ended (the registry went away or cancelled it), or a key changed under a
    /// conditional write.
    #[error("{0}")]
    Interrupted(String),
}
