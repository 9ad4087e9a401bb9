//! A worker in the cluster: its card (built from the loaded engine), registered while it serves,
//! and the graceful drain on SIGTERM that rolling updates rely on: health goes NOT_SERVING and
//! the card `draining` (the router sends nothing new), requests in flight finish within the drain timeout, the lease is
//! revoked, and the worker returns (exit 0). A role switch drains the same way for a while and
//! registers the card again under the new role ([`RegisteredCard`]).

use std::time::Duration;

use anyhow::Context;
use duet_cluster::{CardState, ClusterArgs, LeaseArgs, Registration, Role, WorkerCard};
use tokio::net::TcpListener;

use crate::EngineHandle;

/// Longest wait for the registry to hold the `draining` card before draining goes on anyway.
const DRAINING_WRITE_TIMEOUT: Duration = Duration::from_secs(2);

/// After the `draining` card is written, new calls are still taken this long: the router may
/// have routed one before it heard of the card.
const DRAINING_NOTICE: Duration = Duration::from_millis(500);

/// The card of a worker of `role` running `engine`, reachable at `advertise`.
pub fn card(
    role: Role,
    worker_id: &str,
    advertise: &str,
    engine: &EngineHandle,
    device: String,
) -> WorkerCard {
    let info = engine.info();
    WorkerCard {
        worker_id: worker_id.to_string(),
        role,
        grpc_address: advertise.to_string(),
        kv_address: advertise.to_string(),
        node: node_name(),
        device,
        model_fingerprint: info.wire.fingerprint.clone(),
        block_size: info.wire.layout.block_size as u32,
        kv_capacity_blocks: info.wire.layout.num_blocks as u32,
        incarnation: 0,
        state: CardState::Joining,
    }
}

use duet_transfer::choice::node_name;

/// The worker's card in the registry while it serves: `ready`, then `draining` (for good on
/// SIGTERM, for a while during a role switch), and registered again under a new role by a role
/// switch ([`crate::role_switch`]).
pub struct RegisteredCard {
    cluster: ClusterArgs,
    ttl: Duration,
    /// The card registered now.
    card: std::sync::Mutex<WorkerCard>,
    registration: tokio::sync::Mutex<Option<Registration>>,
    /// Set once the worker drains to stop: the card is never made `ready` again.
    stopping: std::sync::atomic::AtomicBool,
}

impl RegisteredCard {
    /// Starts keeping `card` in `cluster`'s registry, `ready` (an unreachable registry is
    /// retried in the background).
    pub fn register(
        cluster: &ClusterArgs,
        lease: &LeaseArgs,
        card: WorkerCard,
    ) -> anyhow::Result<Self> {
        let registration = start_ready(cluster, lease.ttl(), card.clone())?;
        Ok(Self {
            cluster: cluster.clone(),
            ttl: lease.ttl(),
            card: std::sync::Mutex::new(card),
            registration: tokio::sync::Mutex::new(Some(registration)),
            stopping: Default::default(),
        })
    }

    /// The role the card is registered under.
    pub fn role(&self) -> Role {
        self.card().role
    }

    /// The card registered now.
    pub fn card(&self) -> WorkerCard {
        self.card.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Marks the card `draining` (for good when `stopping`), waits for the registry to hold it,
    /// then gives the router [`DRAINING_NOTICE`] to hear of it.
    pub async fn drain(&self, stopping: bool) {
        if stopping {
            self.stopping
                .store(true, std::sync::atomic::Ordering::SeqCst);
        }
        let registration = self.registration.lock().await;
        let Some(registration) = registration.as_ref() else {
            return;
        };
        registration.set_state(CardState::Draining);
        if !registration
            .wait_for_state(CardState::Draining, DRAINING_WRITE_TIMEOUT)
            .await
        {
            tracing::warn!(
                key = registration.key(),
                "the registry did not take the draining card in time; draining anyway"
            );
        }
        tokio::time::sleep(DRAINING_NOTICE).await;
    }

    /// Makes the card `ready` again under its role (a role switch given up).
    pub async fn ready(&self) -> Result<(), Stopping> {
        self.check_not_stopping()?;
        if let Some(registration) = self.registration.lock().await.as_ref() {
            registration.set_state(CardState::Ready);
        }
        Ok(())
    }

    /// Registers `card` (a new role's) `ready` in place of the card registered now, whose lease
    /// is revoked.
    pub async fn replace(&self, card: WorkerCard) -> anyhow::Result<()> {
        self.check_not_stopping()?;
        let mut registration = self.registration.lock().await;
        let old = registration.replace(start_ready(&self.cluster, self.ttl, card.clone())?);
        *self.card.lock().unwrap_or_else(|e| e.into_inner()) = card;
        if let Some(old) = old {
            old.deregister().await;
        }
        Ok(())
    }

    /// Stops keeping the card and revokes its lease.
    pub async fn deregister(&self) {
        if let Some(registration) = self.registration.lock().await.take() {
            registration.deregister().await;
        }
    }

    fn check_not_stopping(&self) -> Result<(), Stopping> {
        match self.stopping.load(std::sync::atomic::Ordering::SeqCst) {
            true => Err(Stopping),
            false => Ok(()),
        }
    }
}

/// The worker is draining to stop: its card stays `draining`.
#[derive(Clone, Copy, Debug, thiserror::Error)]
#[error("the worker is shutting down")]
pub struct Stopping;

fn start_ready(
    cluster: &ClusterArgs,
    ttl: Duration,
    card: WorkerCard,
) -> anyhow::Result<Registration> {
    let key_id = card.worker_id.clone();
    let registration = Registration::start(cluster.clone(), ttl, card)
        .with_context(|| format!("registering worker {key_id}"))?;
    registration.set_state(CardState::Ready);
    Ok(registration)
}

/// Serves `edge` on `listener` with `card` registered; once `shutdown` resolves, drains (see
/// the module), at most `drain_timeout`, and deregisters.
pub async fn serve_registered(
    edge: duet_proto::Edge,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
    card: std::sync::Arc<RegisteredCard>,
    drain_timeout: Duration,
) -> anyhow::Result<()> {
    let draining = std::sync::Arc::new(tokio::sync::Notify::new());
    let drain = {
        let card = card.clone();
        let draining = draining.clone();
        let health = edge.draining();
        async move {
            shutdown.await;
            tracing::info!(
                role = card.role().as_str(),
                "draining: no new work, finishing requests in flight"
            );
            health.begin().await;
            card.drain(true).await;
            draining.notify_one();
        }
    };
    let mut server = Box::pin(edge.serve(listener, drain));
    let result = tokio::select! {
        r = &mut server => r.context("serving gRPC"),
        () = async { draining.notified().await; tokio::time::sleep(drain_timeout).await } => {
            tracing::warn!(?drain_timeout, "requests still in flight after the drain timeout; stopping");
            Ok(())
        }
    };
    drop(server);
    card.deregister().await;
    result
}
