//! A worker's registration: its card kept in the registry on a lease, from a thread of its own
//! (with its own runtime and its own registry connection), so a busy engine or a busy async
//! runtime cannot starve the keep-alives.
//!
//! A lost lease (expired while the registry was unreachable, revoked, or etcd restarted) is
//! never fatal: the worker grants a new lease and registers again with a new incarnation, while
//! it goes on serving what it holds.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{oneshot, watch};

use crate::args::ClusterArgs;
use crate::backoff::Backoff;
use crate::card::{CardKey, CardState, WorkerCard, validate_name};
use crate::error::ClusterError;
use crate::registry::{LeaseId, Registry};

/// What the registry holds of this worker now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Registered {
    pub incarnation: u64,
    pub lease: LeaseId,
    pub state: CardState,
}

/// Keeps a worker's card registered while it lives; [`Registration::deregister`] revokes it.
pub struct Registration {
    key: String,
    state: watch::Sender<CardState>,
    registered: watch::Receiver<Option<Registered>>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Registration {
    /// Starts keeping `card` in `cluster`'s registry on a lease of `ttl`. Fails only for a
    /// worker id that cannot be a key; an unreachable registry is retried in the background.
    pub fn start(
        cluster: ClusterArgs,
        ttl: Duration,
        card: WorkerCard,
    ) -> Result<Self, ClusterError> {
        validate_name("worker id", &card.worker_id)?;
        validate_name("cluster", &cluster.cluster)?;
        let key = card.key(&cluster.cluster);
        let (state, state_rx) = watch::channel(card.state);
        let (registered_tx, registered) = watch::channel(None);
        let (stop, stop_rx) = oneshot::channel();
        let thread_key = key.clone();
        let thread = std::thread::Builder::new()
            .name("duet-lease".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a current-thread runtime");
                rt.block_on(run(
                    cluster,
                    thread_key,
                    card,
                    ttl,
                    state_rx,
                    registered_tx,
                    stop_rx,
                ));
            })
            .expect("spawning the lease thread");
        Ok(Self {
            key,
            state,
            registered,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// The card's key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// What the registry holds now (`None` until the first registration, and after a loss
    /// until the next).
    pub fn registered(&self) -> Option<Registered> {
        *self.registered.borrow()
    }

    /// A receiver that sees every registration and state change.
    pub fn watch(&self) -> watch::Receiver<Option<Registered>> {
        self.registered.clone()
    }

    /// Sets the card's state (written now, or as soon as the registry answers).
    pub fn set_state(&self, state: CardState) {
        self.state.send_replace(state);
    }

    /// Waits until the registry holds the card in `state`: `false` if it did not within
    /// `timeout`.
    pub async fn wait_for_state(&self, state: CardState, timeout: Duration) -> bool {
        let mut rx = self.registered.clone();
        tokio::time::timeout(
            timeout,
            rx.wait_for(|r| r.is_some_and(|r| r.state == state)),
        )
        .await
        .is_ok_and(|r| r.is_ok())
    }

    /// Stops keeping the card and revokes its lease (best effort: an unreachable registry lets
    /// it expire instead).
    pub async fn deregister(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// The lease thread: connect, keep registered until told to stop, then revoke.
async fn run(
    cluster: ClusterArgs,
    key: String,
    card: WorkerCard,
    ttl: Duration,
    state: watch::Receiver<CardState>,
    registered: watch::Sender<Option<Registered>>,
    stop: oneshot::Receiver<()>,
) {
    let mut lease: Option<(Arc<dyn Registry>, LeaseId)> = None;
    tokio::select! {
        () = keep_registered(&cluster, &key, card, ttl, state, &registered, &mut lease) => {}
        _ = stop => {}
    }
    if let Some((registry, id)) = lease {
        match registry.revoke(id).await {
            Ok(()) => tracing::info!(key, "lease revoked; card removed"),
            Err(e) => {
                tracing::warn!(key, error = %e, "revoking the lease failed; the card expires with it")
            }
        }
    }
}

async fn keep_registered(
    cluster: &ClusterArgs,
    key: &str,
    mut card: WorkerCard,
    ttl: Duration,
    mut state: watch::Receiver<CardState>,
    registered: &watch::Sender<Option<Registered>>,
    lease: &mut Option<(Arc<dyn Registry>, LeaseId)>,
) {
    let registry = cluster.connect_retrying().await;
    let card_key = cluster.card_key.as_ref();
    let mut backoff = Backoff::new();
    let interval = ttl / 3;
    loop {
        card.incarnation = next_incarnation(card.incarnation);
        card.state = *state.borrow_and_update();
        let id = match register(registry.as_ref(), key, &card, card_key, ttl).await {
            Ok(id) => id,
            Err(e) => {
                tracing::warn!(key, error = %e, "registering failed; retrying");
                backoff.wait().await;
                continue;
            }
        };
        backoff = Backoff::new();
        *lease = Some((registry.clone(), id));
        let mut written = card.to_stored(card_key);
        registered.send_replace(Some(Registered {
            incarnation: card.incarnation,
            lease: id,
            state: card.state,
        }));
        tracing::info!(key, incarnation = card.incarnation, lease = id, state = ?card.state, "registered");
        let mut last_alive = Instant::now();
        let mut unwritten = false;
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let lost = loop {
            tokio::select! {
                _ = tick.tick() => match registry.keep_alive(id).await {
                    Ok(true) => last_alive = Instant::now(),
                    Ok(false) => break "the lease is gone (expired or revoked)",
                    Err(e) => tracing::warn!(
                        key,
                        error = %e,
                        since_last_keep_alive = ?last_alive.elapsed(),
                        "keep-alive failed; still serving, retrying"
                    ),
                },
                changed = state.changed() => {
                    if changed.is_err() {
                        // The Registration is gone; `run` revokes.
                        std::future::pending::<()>().await;
                    }
                    unwritten = true;
                }
            }
            if unwritten {
                let mut next = card.clone();
                next.state = *state.borrow_and_update();
                let value = next.to_stored(card_key);
                match registry.put_if(key, Some(&written), &value, id).await {
                    Ok(true) => {
                        (card, written, unwritten) = (next, value, false);
                        registered.send_replace(Some(Registered {
                            incarnation: card.incarnation,
                            lease: id,
                            state: card.state,
                        }));
                        tracing::info!(key, state = ?card.state, "card updated");
                    }
                    Ok(false) => break "the card was removed or replaced",
                    Err(e) => tracing::warn!(key, error = %e, "updating the card failed; retrying"),
                }
            }
        };
        tracing::warn!(
            key,
            incarnation = card.incarnation,
            why = lost,
            "registration lost; registering again with a new incarnation"
        );
        registered.send_replace(None);
        *lease = None;
    }
}

/// Grants a lease and writes the card on it if no card is there. A card left at the key by an
/// earlier start of this worker (same address, lease not yet expired) is replaced; a card of
/// another address is a conflict, retried until it goes away.
async fn register(
    registry: &dyn Registry,
    key: &str,
    card: &WorkerCard,
    card_key: Option<&CardKey>,
    ttl: Duration,
) -> Result<LeaseId, ClusterError> {
    let id = registry.grant(ttl).await?;
    let value = card.to_stored(card_key);
    let written = async {
        if registry.put_if(key, None, &value, id).await? {
            return Ok(());
        }
        let listing = registry.list(key).await?;
        let Some(old) = listing.entries.iter().find(|e| e.key == key) else {
            return Err(ClusterError::Interrupted(format!(
                "{key} vanished while registering"
            )));
        };
        let same_worker = serde_json::from_slice::<WorkerCard>(&old.value)
            .is_ok_and(|c| c.grpc_address == card.grpc_address);
        if !same_worker {
            return Err(ClusterError::IdTaken {
                key: key.to_string(),
                holder: String::from_utf8_lossy(&old.value).into_owned(),
            });
        }
        if registry.put_if(key, Some(&old.value), &value, id).await? {
            Ok(())
        } else {
            Err(ClusterError::Interrupted(format!(
                "{key} changed while registering"
            )))
        }
    }
    .await;
    match written {
        Ok(()) => Ok(id),
        Err(e) => {
            let _ = registry.revoke(id).await;
            Err(e)
        }
    }
}

/// A new incarnation: the time in nanoseconds, and always past the previous one.
fn next_incarnation(previous: u64) -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    now.max(previous + 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::card::Role;
    use crate::embedded::EmbeddedRegistry;
    use crate::membership::follow;

    fn card(id: &str, address: &str) -> WorkerCard {
        WorkerCard {
            worker_id: id.into(),
            role: Role::Prefill,
            grpc_address: address.into(),
            kv_address: address.into(),
            node: "host".into(),
            device: "cpu".into(),
            model_fingerprint: "fp".into(),
            block_size: 16,
            kv_capacity_blocks: 10,
            incarnation: 0,
            state: CardState::Joining,
        }
    }

    fn cluster(name: &str) -> ClusterArgs {
        ClusterArgs {
            etcd: vec![],
            cluster: name.into(),
            ..Default::default()
        }
    }

    async fn until<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
        for _ in 0..500 {
            if let Some(t) = f() {
                return t;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("timed out waiting for {what}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_revoked_lease_gives_a_new_incarnation_and_the_follower_sees_every_step() {
        let (members, follower) = follow(cluster("reg-revoke"), Duration::from_secs(60));
        let r = Registration::start(
            cluster("reg-revoke"),
            Duration::from_secs(3),
            card("p-1", "127.0.0.1:1"),
        )
        .unwrap();
        assert_eq!(r.key(), "/duet/reg-revoke/workers/prefill/p-1");
        let first = until("registration", || r.registered()).await;
        assert_eq!(first.state, CardState::Joining);
        r.set_state(CardState::Ready);
        assert!(
            r.wait_for_state(CardState::Ready, Duration::from_secs(5))
                .await
        );
        until("the follower sees it ready", || {
            let m = members.borrow().clone();
            let c = m.cards.get(r.key())?;
            (c.state == CardState::Ready).then_some(())
        })
        .await;

        EmbeddedRegistry::shared()
            .revoke(first.lease)
            .await
            .unwrap();
        let second = until("re-registration", || {
            r.registered().filter(|s| s.lease != first.lease)
        })
        .await;
        assert!(second.incarnation > first.incarnation);
        assert_eq!(
            second.state,
            CardState::Ready,
            "the state survives the new lease"
        );
        until("the follower sees the new incarnation", || {
            let m = members.borrow().clone();
            (m.cards.get(r.key())?.incarnation == second.incarnation).then_some(())
        })
        .await;

        r.deregister().await;
        until("the card is gone", || {
            members.borrow().cards.is_empty().then_some(())
        })
        .await;
        follower.abort();
    }

    #[tokio::test]
    async fn a_restart_at_the_same_address_replaces_the_old_card_and_another_address_waits() {
        let c = cluster("reg-restart");
        let old =
            Registration::start(c.clone(), Duration::from_secs(30), card("p-1", "a:1")).unwrap();
        let before = until("first", || old.registered()).await;
        // The old process dies without revoking: its card stays until the lease expires.
        std::mem::forget(old);
        let new =
            Registration::start(c.clone(), Duration::from_secs(30), card("p-1", "a:1")).unwrap();
        let after = until("takeover", || new.registered()).await;
        assert!(after.incarnation > before.incarnation);
        // Another address with the same id does not take it.
        let other = Registration::start(c, Duration::from_secs(30), card("p-1", "b:2")).unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(other.registered(), None);
        assert_eq!(new.registered(), Some(after));
    }

    #[test]
    fn worker_ids_that_cannot_be_keys_are_refused() {
        let e = Registration::start(cluster("c"), Duration::from_secs(1), card("a/b", "x:1"))
            .err()
            .unwrap();
        assert!(e.to_string().contains("worker id"), "{e}");
    }
}
