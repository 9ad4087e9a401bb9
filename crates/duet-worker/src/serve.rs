//! What starting and serving a worker takes, whichever its role: its engine loaded, its id and
//! advertised address, its metrics endpoint, how it authenticates to peers, and its gRPC edge
//! (cluster token, deadline, in-flight limit, mutual TLS) served registered in the cluster.
//! Each worker's `serve` adds only its own services and role-specific state.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use duet_cluster::{ClusterArgs, Role};
use duet_engine::speculator::SpeculativeMode;
use duet_proto::{Edge, EdgeOptions, PeerAuth, Tls};
use tokio::net::TcpListener;

use crate::peers::MEMBERSHIP_RESYNC;
use crate::{EngineHandle, KnownPeers, RoleSwitch, WorkerArgs, metrics};

/// A worker whose engine is loaded, ready to serve.
pub struct StartedWorker {
    pub role: Role,
    pub worker_id: String,
    /// The address others dial to reach it (and push KV to).
    pub advertise: String,
    pub engine: EngineHandle,
    /// The model file or directory it serves.
    pub model: PathBuf,
    /// How its calls to peers authenticate.
    pub peer_auth: PeerAuth,
    /// Its gRPC edge, to which [`StartedWorker::serve`] adds the worker's services.
    pub edge: Edge,
    /// Its cluster, cards signed and checked with the cluster token when there is one.
    pub cluster: ClusterArgs,
    args: WorkerArgs,
    _metrics: metrics::Exported,
    /// The tasks following the cluster's membership for [`StartedWorker::peers`].
    followers: Vec<tokio::task::JoinHandle<()>>,
    /// Set when the worker's role can change at run time ([`StartedWorker::switchable`]).
    role_switch: Option<Arc<RoleSwitch>>,
}

impl StartedWorker {
    /// Loads the model of `args` on an engine thread of its own and sets up everything else
    /// that does not depend on the role (see the module). `advertise` defaults to the listener's
    /// address; `reservation_timeout` is how long a KV reservation waits for its transfer.
    pub async fn start(
        role: Role,
        args: &WorkerArgs,
        listener: &TcpListener,
        advertise: Option<&str>,
        reservation_timeout: Duration,
    ) -> anyhow::Result<Self> {
        let token = args.auth.token()?;
        let tls = args.tls.load()?;
        let addr = listener
            .local_addr()
            .context("reading the listener's address")?;
        let worker_id = args.worker_id_for(role, addr.port());
        let model = args.model.resolve()?;
        tracing::info!(worker_id, model = %model.display(), "loading the model");
        let mut options = args.engine.clone();
        if role == Role::Prefill {
            // A prefill worker never decodes past the first token: drafting is the decode
            // worker's, and a draft model here would only take memory.
            options.speculative = SpeculativeMode::Off;
        }
        let engine = EngineHandle::spawn(
            &format!("{}-engine", role.as_str()),
            model.clone(),
            options,
            reservation_timeout,
            args.max_constraint_bytes,
        )
        .await?;
        let exported = metrics::export(&engine, role.as_str(), &model, &worker_id, args.metrics)
            .await
            .context("cannot serve metrics")?;
        let edge = Edge::new(EdgeOptions {
            default_deadline: Duration::from_millis(args.request_timeout_ms.max(1)),
            max_in_flight: args.max_in_flight,
            cluster_token: token.clone(),
            tls: tls.as_ref().map(Tls::server_requiring_client_certs),
        });
        let cluster =
            (args.cluster.clone()).signed_with(token.as_ref().map(|t| t.as_str().as_bytes()));
        Ok(Self {
            role,
            cluster,
            worker_id,
            advertise: advertise.map_or_else(|| addr.to_string(), str::to_string),
            engine,
            model,
            peer_auth: PeerAuth {
                token,
                tls: tls.as_ref().map(Tls::client),
            },
            edge,
            args: args.clone(),
            _metrics: exported,
            followers: Vec::new(),
            role_switch: None,
        })
    }

    /// The workers of `role` this one deals with: those at the `listed` addresses (its
    /// `--decode` / `--prefill` flags) and those whose (signed) cards its cluster holds, followed
    /// while it serves.
    pub fn peers(&mut self, role: Role, listed: &[String]) -> KnownPeers {
        let (membership, follower) =
            duet_cluster::membership::follow(self.cluster.clone(), MEMBERSHIP_RESYNC);
        self.followers.push(follower);
        KnownPeers::new(role, listed, membership)
    }

    /// Makes the worker's role switchable at run time, starting as `role`: the card is
    /// registered under the switch's role, and the switch re-registers it (see
    /// [`crate::role_switch`]).
    pub fn switchable(&mut self, role: Role) -> Arc<RoleSwitch> {
        let switch = RoleSwitch::new(role, self.args.lease.drain_timeout());
        self.role = role;
        self.role_switch = Some(switch.clone());
        switch
    }

    /// Serves its edge with the worker's `services` added on `listener`, its card registered,
    /// until `shutdown` resolves; then drains (see [`crate::membership`]).
    pub async fn serve(
        self,
        services: impl FnOnce(Edge) -> Edge,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        let card = crate::membership::card(
            self.role,
            &self.worker_id,
            &self.advertise,
            &self.engine,
            self.args.engine.device.to_string(),
        );
        tracing::info!(
            worker = %self.worker_id,
            advertise = %self.advertise,
            fingerprint = %self.engine.info().wire.fingerprint,
            "{} worker serving",
            self.role.as_str()
        );
        let card = Arc::new(crate::membership::RegisteredCard::register(
            &self.cluster,
            &self.args.lease,
            card,
        )?);
        if let Some(switch) = &self.role_switch {
            switch.attach(card.clone());
        }
        let served = crate::membership::serve_registered(
            services(self.edge),
            listener,
            shutdown,
            card,
            self.args.lease.drain_timeout(),
        )
        .await;
        for follower in &self.followers {
            follower.abort();
        }
        tracing::info!(worker = %self.worker_id, "{} worker stopped", self.role.as_str());
        served
    }
}
