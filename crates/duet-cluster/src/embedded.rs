//! The embedded registry: the same operations as etcd, in this process's memory. `duet up`
//! runs a whole cluster in one process with it; leases expire as etcd's do (checked at each
//! operation), and watches replay from a revision out of a bounded history.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use futures::StreamExt;
use tokio::sync::broadcast;

use crate::error::ClusterError;
use crate::registry::{Change, Changes, Entry, LeaseId, Listing, Registry};

/// Changes kept for watches that resume from an earlier revision; older ones are compacted.
const HISTORY: usize = 4096;

#[derive(Debug, Default)]
struct Store {
    revision: i64,
    next_lease: LeaseId,
    /// key → (value, lease)
    entries: BTreeMap<String, (Vec<u8>, LeaseId)>,
    /// lease → (ttl, expiry)
    leases: HashMap<LeaseId, (Duration, Instant)>,
    /// (revision, change), oldest first.
    history: VecDeque<(i64, Change)>,
}

/// The in-process registry.
#[derive(Debug)]
pub struct EmbeddedRegistry {
    store: Mutex<Store>,
    changes: broadcast::Sender<(i64, Change)>,
}

impl Default for EmbeddedRegistry {
    fn default() -> Self {
        Self {
            store: Mutex::new(Store::default()),
            changes: broadcast::channel(HISTORY).0,
        }
    }
}

impl EmbeddedRegistry {
    /// The registry every service of this process shares (clusters are kept apart by name).
    pub fn shared() -> Arc<EmbeddedRegistry> {
        static SHARED: OnceLock<Arc<EmbeddedRegistry>> = OnceLock::new();
        SHARED.get_or_init(Default::default).clone()
    }

    fn store(&self) -> std::sync::MutexGuard<'_, Store> {
        let mut s = self.store.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let expired: Vec<LeaseId> = s
            .leases
            .iter()
            .filter(|(_, (_, at))| *at <= now)
            .map(|(&id, _)| id)
            .collect();
        for id in expired {
            self.drop_lease(&mut s, id);
        }
        s
    }

    fn record(&self, s: &mut Store, change: Change) {
        s.revision += 1;
        if s.history.len() == HISTORY {
            s.history.pop_front();
        }
        s.history.push_back((s.revision, change.clone()));
        // No receiver is fine: nobody watches.
        let _ = self.changes.send((s.revision, change));
    }

    fn drop_lease(&self, s: &mut Store, lease: LeaseId) {
        s.leases.remove(&lease);
        let keys: Vec<String> = s
            .entries
            .iter()
            .filter(|(_, (_, l))| *l == lease)
            .map(|(k, _)| k.clone())
            .collect();
        for key in keys {
            s.entries.remove(&key);
            self.record(s, Change::Delete(key));
        }
    }

    fn put(&self, s: &mut Store, key: &str, value: &[u8], lease: LeaseId) {
        s.entries.insert(key.to_string(), (value.to_vec(), lease));
        self.record(
            s,
            Change::Put(Entry {
                key: key.to_string(),
                value: value.to_vec(),
            }),
        );
    }
}

#[async_trait::async_trait]
impl Registry for EmbeddedRegistry {
    async fn grant(&self, ttl: Duration) -> Result<LeaseId, ClusterError> {
        let mut s = self.store();
        s.next_lease += 1;
        let id = s.next_lease;
        s.leases.insert(id, (ttl, Instant::now() + ttl));
        Ok(id)
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<bool, ClusterError> {
        let mut s = self.store();
        Ok(match s.leases.get_mut(&lease) {
            Some((ttl, at)) => {
                *at = Instant::now() + *ttl;
                true
            }
            None => false,
        })
    }

    async fn revoke(&self, lease: LeaseId) -> Result<(), ClusterError> {
        let mut s = self.store();
        self.drop_lease(&mut s, lease);
        Ok(())
    }

    async fn put_if(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        value: &[u8],
        lease: LeaseId,
    ) -> Result<bool, ClusterError> {
        let mut s = self.store();
        let current = s.entries.get(key).map(|(v, _)| v.as_slice());
        if current != expected || !s.leases.contains_key(&lease) {
            return Ok(false);
        }
        self.put(&mut s, key, value, lease);
        Ok(true)
    }

    async fn list(&self, prefix: &str) -> Result<Listing, ClusterError> {
        let s = self.store();
        Ok(Listing {
            entries: s
                .entries
                .range(prefix.to_string()..)
                .take_while(|(k, _)| k.starts_with(prefix))
                .map(|(k, (v, _))| Entry {
                    key: k.clone(),
                    value: v.clone(),
                })
                .collect(),
            revision: s.revision,
        })
    }

    async fn watch(&self, prefix: &str, from: i64) -> Result<Changes, ClusterError> {
        let s = self.store();
        let oldest = s.history.front().map_or(s.revision + 1, |(r, _)| *r);
        if from < oldest && from <= s.revision {
            return Err(ClusterError::Compacted { revision: from });
        }
        // Subscribed under the lock: nothing recorded after the replay is missed.
        let live = self.changes.subscribe();
        let replay: Vec<(i64, Change)> = s
            .history
            .iter()
            .filter(|(r, _)| *r >= from)
            .cloned()
            .collect();
        drop(s);
        let prefix = prefix.to_string();
        let under = move |(rev, c): (i64, Change)| {
            let key = match &c {
                Change::Put(e) => &e.key,
                Change::Delete(k) => k,
            };
            (rev >= from && key.starts_with(&prefix)).then_some(c)
        };
        let replayed = futures::stream::iter(replay.into_iter().filter_map(under.clone()))
            .map(|c| Ok(vec![c]));
        let live = broadcast_changes(live).filter_map(move |r| {
            futures::future::ready(match r {
                Ok(rc) => under(rc).map(|c| Ok(vec![c])),
                Err(e) => Some(Err(e)),
            })
        });
        Ok(replayed.chain(live).boxed())
    }
}

/// A broadcast receiver as a stream; falling behind ends it with an error (the watcher lists
/// again).
fn broadcast_changes(
    rx: broadcast::Receiver<(i64, Change)>,
) -> impl futures::Stream<Item = Result<(i64, Change), ClusterError>> {
    futures::stream::unfold(Some(rx), |rx| async move {
        let mut rx = rx?;
        match rx.recv().await {
            Ok(rc) => Some((Ok(rc), Some(rx))),
            Err(e) => Some((Err(ClusterError::Interrupted(e.to_string())), None)),
        }
    })
}
