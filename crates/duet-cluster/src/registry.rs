//! The `Registry` seam: the few key-value operations membership needs, so that registration
//! (lease, card, re-registration) and the router's list-and-watch are written once over etcd and
//! over the embedded registry alike.

use std::time::Duration;

use futures::stream::BoxStream;

use crate::error::ClusterError;

/// A lease id, as etcd numbers them.
pub type LeaseId = i64;

/// A key and its value.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    pub key: String,
    pub value: Vec<u8>,
}

/// Every entry under a prefix, and the store's revision it was read at.
#[derive(Clone, Debug, Default)]
pub struct Listing {
    pub entries: Vec<Entry>,
    pub revision: i64,
}

/// One change under a watched prefix.
#[derive(Clone, Debug, PartialEq)]
pub enum Change {
    Put(Entry),
    Delete(String),
}

/// Batches of changes, in revision order; an error ends the watch.
pub type Changes = BoxStream<'static, Result<Vec<Change>, ClusterError>>;

/// A store of keys with leases and watches: etcd, or the embedded one.
#[async_trait::async_trait]
pub trait Registry: Send + Sync + std::fmt::Debug {
    /// Grants a lease that expires after `ttl` without a keep-alive.
    async fn grant(&self, ttl: Duration) -> Result<LeaseId, ClusterError>;
    /// Refreshes a lease: `false` when it no longer exists (expired or revoked).
    async fn keep_alive(&self, lease: LeaseId) -> Result<bool, ClusterError>;
    /// Revokes a lease, deleting its keys.
    async fn revoke(&self, lease: LeaseId) -> Result<(), ClusterError>;
    /// Writes `value` at `key` on `lease`, only if the key's current value is `expected`
    /// (`None`: the key does not exist): `false` when it is not.
    async fn put_if(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        value: &[u8],
        lease: LeaseId,
    ) -> Result<bool, ClusterError>;
    /// Every entry under `prefix`.
    async fn list(&self, prefix: &str) -> Result<Listing, ClusterError>;
    /// The changes under `prefix` from revision `from` on.
    async fn watch(&self, prefix: &str, from: i64) -> Result<Changes, ClusterError>;
}
