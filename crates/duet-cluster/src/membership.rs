//! Following a cluster's membership (the router's side): list every card, watch from the
//! listed revision + 1, and list again — then publish the whole new set, which the router diffs
//! against what it has — when the watch is cancelled for compaction, when it breaks (etcd
//! restarted or unreachable), and every anti-entropy interval. While the registry cannot be
//! reached the last membership stays published (the router checks those workers by health).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::watch;

use crate::args::ClusterArgs;
use crate::backoff::Backoff;
use crate::card::{CardKey, WorkerCard, workers_prefix};
use crate::error::ClusterError;
use crate::registry::{Change, Listing, Registry};

/// The cards of a cluster, by key, and how they were learnt.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Membership {
    pub cards: BTreeMap<String, WorkerCard>,
    /// Times the whole prefix was listed (the first time, and every re-list).
    pub lists: u64,
    /// The registry's revision the cards are as of.
    pub revision: i64,
}

/// Follows `cluster`'s cards until the task is aborted, re-listing at least every `resync`.
pub fn follow(
    cluster: ClusterArgs,
    resync: Duration,
) -> (
    watch::Receiver<Arc<Membership>>,
    tokio::task::JoinHandle<()>,
) {
    let (tx, rx) = watch::channel(Arc::new(Membership::default()));
    let task = tokio::spawn(async move {
        let registry = cluster.connect_retrying().await;
        let cards = CardRules {
            cluster: cluster.cluster.clone(),
            key: cluster.card_key.clone(),
        };
        follow_registry(registry, cards, resync, tx).await;
    });
    (rx, task)
}

/// Which stored cards are members: those of `cluster`, signed with `key` when there is one.
#[derive(Clone, Debug)]
pub struct CardRules {
    pub cluster: String,
    pub key: Option<CardKey>,
}

/// The loop of [`follow`] on a connected registry.
pub async fn follow_registry(
    registry: Arc<dyn Registry>,
    cards: CardRules,
    resync: Duration,
    tx: watch::Sender<Arc<Membership>>,
) {
    let prefix = workers_prefix(&cards.cluster);
    let mut backoff = Backoff::new();
    let mut lists = 0;
    loop {
        let listing = match registry.list(&prefix).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "listing workers failed; keeping the last-known membership");
                backoff.wait().await;
                continue;
            }
        };
        lists += 1;
        let mut current = Membership {
            cards: parse_listing(&cards, &listing),
            lists,
            revision: listing.revision,
        };
        tracing::debug!(
            workers = current.cards.len(),
            revision = listing.revision,
            "listed workers"
        );
        tx.send_replace(Arc::new(current.clone()));
        let mut changes = match registry.watch(&prefix, listing.revision + 1).await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "watching workers failed; listing again");
                backoff.wait().await;
                continue;
            }
        };
        backoff = Backoff::new();
        let resync_at = tokio::time::sleep(resync);
        tokio::pin!(resync_at);
        loop {
            tokio::select! {
                batch = changes.next() => match batch {
                    Some(Ok(batch)) => {
                        for change in batch {
                            apply(&cards, &mut current.cards, change);
                        }
                        tx.send_replace(Arc::new(current.clone()));
                    }
                    Some(Err(e @ ClusterError::Compacted { .. })) => {
                        tracing::info!(error = %e, "listing workers again");
                        break;
                    }
                    Some(Err(e)) => {
                        tracing::warn!(error = %e, "the watch broke; listing workers again");
                        backoff.wait().await;
                        break;
                    }
                    None => break,
                },
                () = &mut resync_at => {
                    tracing::debug!("anti-entropy: listing workers again");
                    break;
                }
            }
        }
    }
}

fn parse_listing(rules: &CardRules, listing: &Listing) -> BTreeMap<String, WorkerCard> {
    listing
        .entries
        .iter()
        .filter_map(|e| parse(rules, &e.key, &e.value).map(|c| (e.key.clone(), c)))
        .collect()
}

fn parse(rules: &CardRules, key: &str, value: &[u8]) -> Option<WorkerCard> {
    WorkerCard::parse(&rules.cluster, key, value, rules.key.as_ref())
        .inspect_err(|e| tracing::warn!(key, error = %e, "skipping a worker card"))
        .ok()
}

fn apply(rules: &CardRules, cards: &mut BTreeMap<String, WorkerCard>, change: Change) {
    match change {
        Change::Put(e) => match parse(rules, &e.key, &e.value) {
            Some(card) => {
                cards.insert(e.key, card);
            }
            None => {
                cards.remove(&e.key);
            }
        },
        Change::Delete(key) => {
            cards.remove(&key);
        }
    }
}
