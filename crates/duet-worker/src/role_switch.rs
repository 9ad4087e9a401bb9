//! A worker whose role changes at run time, on the same engine and weights (SGLang switches a
//! worker between prefill and decode the same way): both roles' services are served, each
//! behind a [`Gate`], and the role's gate alone is open. `WorkerAdmin/SwitchRole` drains the
//! current role as SIGTERM does (card `draining`, health NOT_SERVING, the router given notice),
//! then closes its gate and waits for the calls it admitted to finish, so no request is lost;
//! then it opens the other gate and registers the card again under the new role.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use duet_cluster::Role;
use duet_proto::Gate;
use duet_proto::v1;
use tokio::sync::watch;
use tonic::{Response, Status};

use crate::membership::{RegisteredCard, Stopping};

/// See the module. Shared by the services it gates and the admin service.
pub struct RoleSwitch {
    role: watch::Sender<Role>,
    prefill: Gate,
    decode: Gate,
    /// False while a switch drains: the edge's health follows it.
    serving: watch::Sender<bool>,
    /// The card, once the worker serves.
    card: OnceLock<Arc<RegisteredCard>>,
    /// One switch at a time.
    switching: tokio::sync::Mutex<()>,
    /// Longest wait for the calls in flight (`--drain-timeout-s`).
    drain_timeout: Duration,
}

/// Why a switch did not happen.
#[derive(Debug, thiserror::Error)]
pub enum SwitchError {
    #[error("the role to switch to is unspecified: name prefill or decode")]
    NoRole,
    #[error("the worker is not registered yet")]
    NotServing,
    #[error(transparent)]
    Stopping(#[from] Stopping),
    #[error(
        "{calls} {role} calls were still in flight after the drain timeout ({timeout:?}); the \
         switch is given up and the worker serves as a {role} worker again"
    )]
    StillInFlight {
        role: &'static str,
        calls: usize,
        timeout: Duration,
    },
    #[error("registering the card under the new role: {0:#}")]
    Register(anyhow::Error),
}

impl From<SwitchError> for Status {
    fn from(e: SwitchError) -> Self {
        let message = e.to_string();
        match e {
            SwitchError::NoRole => Status::invalid_argument(message),
            SwitchError::NotServing => Status::unavailable(message),
            SwitchError::Stopping(_) => Status::failed_precondition(message),
            SwitchError::StillInFlight { .. } => Status::aborted(message),
            SwitchError::Register(_) => Status::internal(message),
        }
    }
}

/// A switch done.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Switched {
    pub previous: Role,
    pub role: Role,
    /// Calls of the previous role in flight when its gate closed (all finished).
    pub drained_calls: usize,
}

impl RoleSwitch {
    /// A worker serving as `role`; a switch waits at most `drain_timeout` for calls in flight.
    pub fn new(role: Role, drain_timeout: Duration) -> Arc<Self> {
        Arc::new(Self {
            role: watch::Sender::new(role),
            prefill: Gate::new("prefill", role == Role::Prefill),
            decode: Gate::new("decode", role == Role::Decode),
            serving: watch::Sender::new(true),
            card: OnceLock::new(),
            switching: tokio::sync::Mutex::new(()),
            drain_timeout,
        })
    }

    /// The role now.
    pub fn role(&self) -> Role {
        *self.role.borrow()
    }

    /// The gate of `role`'s services.
    pub fn gate(&self, role: Role) -> &Gate {
        match role {
            Role::Prefill => &self.prefill,
            Role::Decode => &self.decode,
        }
    }

    /// True except while a switch drains (the edge's health: `Edge::ready_when`).
    pub fn serving(&self) -> watch::Receiver<bool> {
        self.serving.subscribe()
    }

    /// The card the switch registers again (set once, when the worker starts serving).
    pub(crate) fn attach(&self, card: Arc<RegisteredCard>) {
        let _ = self.card.set(card);
    }

    /// Switches to `to` (see the module).
    pub async fn switch(&self, to: Role) -> Result<Switched, SwitchError> {
        let _one = self.switching.lock().await;
        let card = self.card.get().ok_or(SwitchError::NotServing)?;
        let previous = self.role();
        if previous == to {
            return Ok(Switched {
                previous,
                role: to,
                drained_calls: 0,
            });
        }
        tracing::info!(
            from = previous.as_str(),
            to = to.as_str(),
            "role switch: draining"
        );
        self.serving.send_replace(false);
        card.drain(false).await;
        let gate = self.gate(previous);
        gate.close();
        let drained_calls = gate.in_flight();
        if !gate.drained(self.drain_timeout).await {
            let calls = gate.in_flight();
            gate.open();
            card.ready().await?;
            self.serving.send_replace(true);
            let e = SwitchError::StillInFlight {
                role: previous.as_str(),
                calls,
                timeout: self.drain_timeout,
            };
            tracing::warn!("role switch given up: {e}");
            return Err(e);
        }
        let mut new_card = card.card();
        new_card.role = to;
        self.role.send_replace(to);
        self.gate(to).open();
        card.replace(new_card)
            .await
            .map_err(SwitchError::Register)?;
        self.serving.send_replace(true);
        tracing::info!(
            from = previous.as_str(),
            to = to.as_str(),
            drained_calls,
            "role switch: serving as a {} worker",
            to.as_str()
        );
        Ok(Switched {
            previous,
            role: to,
            drained_calls,
        })
    }
}

/// `WorkerAdmin`: the role switch as an RPC (under the cluster token, like every worker RPC).
#[derive(Clone)]
pub struct WorkerAdminService {
    pub switch: Arc<RoleSwitch>,
}

fn role_of(role: v1::WorkerRole) -> Option<Role> {
    match role {
        v1::WorkerRole::Prefill => Some(Role::Prefill),
        v1::WorkerRole::Decode => Some(Role::Decode),
        v1::WorkerRole::Unspecified => None,
    }
}

/// The protocol's name of `role`.
pub fn worker_role(role: Role) -> v1::WorkerRole {
    match role {
        Role::Prefill => v1::WorkerRole::Prefill,
        Role::Decode => v1::WorkerRole::Decode,
    }
}

#[tonic::async_trait]
impl v1::worker_admin_server::WorkerAdmin for WorkerAdminService {
    async fn switch_role(
        &self,
        request: tonic::Request<v1::SwitchRoleRequest>,
    ) -> Result<Response<v1::SwitchRoleResponse>, Status> {
        let started = Instant::now();
        let to = role_of(request.into_inner().role()).ok_or(SwitchError::NoRole)?;
        let done = self.switch.switch(to).await?;
        Ok(Response::new(v1::SwitchRoleResponse {
            previous: worker_role(done.previous).into(),
            role: worker_role(done.role).into(),
            drained_calls: u32::try_from(done.drained_calls).unwrap_or(u32::MAX),
            switch_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
        }))
    }
}
