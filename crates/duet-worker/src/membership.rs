//! A worker in the cluster: its card (built from the loaded engine), registered while it serves,
//! and the graceful drain on SIGTERM that rolling updates rely on: health goes NOT_SERVING and
//! the card `draining` (the router sends nothing new), requests in flight finish within the drain timeout, the lease is
//! revoked, and the worker returns (exit 0).

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

/// Serves `edge` on `listener` with `card` registered: `ready` while serving; once `shutdown`
/// resolves, drains (see the module) and deregisters.
pub async fn serve_registered(
    edge: duet_proto::Edge,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
    card: WorkerCard,
    cluster: &ClusterArgs,
    lease: &LeaseArgs,
) -> anyhow::Result<()> {
    let key_id = card.worker_id.clone();
    let registration = std::sync::Arc::new(
        Registration::start(cluster.clone(), lease.ttl(), card)
            .with_context(|| format!("registering worker {key_id}"))?,
    );
    registration.set_state(CardState::Ready);
    let draining = std::sync::Arc::new(tokio::sync::Notify::new());
    let drain = {
        let registration = registration.clone();
        let draining = draining.clone();
        let health = edge.draining();
        async move {
            shutdown.await;
            tracing::info!(
                key = registration.key(),
                "draining: no new work, finishing requests in flight"
            );
            health.begin().await;
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
            draining.notify_one();
        }
    };
    let drain_timeout = lease.drain_timeout();
    let mut server = Box::pin(edge.serve(listener, drain));
    let result = tokio::select! {
        r = &mut server => r.context("serving gRPC"),
        () = async { draining.notified().await; tokio::time::sleep(drain_timeout).await } => {
            tracing::warn!(?drain_timeout, "requests still in flight after the drain timeout; stopping");
            Ok(())
        }
    };
    // The server future holds the drain's handle on the registration.
    drop(server);
    if let Ok(registration) = std::sync::Arc::try_unwrap(registration) {
        registration.deregister().await;
    }
    result
}
