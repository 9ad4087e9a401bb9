//! The control loop: reads the router every `--poll-interval-s`, re-plans every `--period-s`
//! or at once on a burst, publishes and logs each decision, and makes the one role switch it
//! calls for. An input that cannot be read, or a switch that fails, is logged and counted and
//! tried again later; only bad flags, an unreachable router at start, or a profile that does
//! not match the cluster stop it.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use duet_cluster::membership::Membership;
use duet_cluster::{CardState, Role};
use duet_proto::{Channels, PeerAuth, v1};
use tokio::sync::watch;

use crate::PlannerServiceError;
use crate::config::PlannerConfig;
use crate::decide::{self, Split, SplitChoice, WorkerView};
use crate::decisions::{Decision, DecisionLog};
use crate::exposition::{MetricsUrl, scrape};
use crate::live::{RouterSample, Window, live_jobs};
use crate::metrics::PlannerMetrics;
use crate::replan::{LiveLoad, Model};

/// How long one scrape or one `Stats` call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// Runs the planner until `shutdown` resolves.
pub async fn serve(
    config: PlannerConfig,
    mut model: Model,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), PlannerServiceError> {
    config.check()?;
    model.sim.slo = config.slo()?;
    let url = config.router_url()?;
    let served = config
        .served_model_name
        .clone()
        .unwrap_or_else(|| model.profile.model.name.clone());
    let token = config.auth.token()?;
    let tls = config.tls.load()?;
    let channels = Channels::new(PeerAuth {
        token: token.clone(),
        tls: tls.as_ref().map(duet_proto::Tls::client),
    });
    let log = Arc::new(DecisionLog::open(config.decisions_out.as_deref())?);
    // The router must answer, and serve the profile's model, before anything is planned.
    let first = read_router(&url, &served)
        .await
        .map_err(PlannerServiceError::Router)?;
    let cluster = config
        .cluster
        .clone()
        .signed_with(token.as_ref().map(|t| t.as_str().as_bytes()));
    let (membership, follower) = duet_cluster::membership::follow(
        cluster,
        Duration::from_secs(config.membership_resync_s.max(1)),
    );
    let metrics = PlannerMetrics::new(&served);
    let _registration = duet_telemetry::metrics::Registration::new(&metrics);
    let (stop, stopped) = watch::channel(false);
    let endpoint = match config.metrics.metrics_listen {
        None => None,
        Some(addr) => {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| PlannerServiceError::Listen { addr, source })?;
            tracing::info!(%addr, "planner serving /metrics and /decisions");
            let app = duet_telemetry::metrics::routes().route(
                "/decisions",
                axum::routing::get({
                    let log = log.clone();
                    move || {
                        let log = log.clone();
                        async move { axum::Json(log.recent()) }
                    }
                }),
            );
            let mut stopped = stopped.clone();
            Some(tokio::spawn(async move {
                axum::serve(listener, app)
                    .with_graceful_shutdown(async move {
                        let _ = stopped.wait_for(|s| *s).await;
                    })
                    .await
            }))
        }
    };
    let mut planner = Planner {
        config,
        model,
        url,
        served,
        channels,
        membership,
        metrics,
        log,
        sized_for: None,
        pending: None,
        decisions: 0,
    };
    let result = tokio::select! {
        r = planner.run(first) => r,
        () = shutdown => Ok(()),
    };
    if let Some(d) = planner.pending.take() {
        planner.log.record(&d);
    }
    follower.abort();
    stop.send_replace(true);
    if let Some(endpoint) = endpoint {
        let _ = endpoint.await;
    }
    result
}

/// The router's families for `model`, or why not (naming the endpoint).
async fn read_router(url: &MetricsUrl, model: &str) -> Result<RouterSample, String> {
    let samples = scrape(url, CALL_TIMEOUT).await.map_err(|e| e.to_string())?;
    RouterSample::from_samples(&samples, model, Instant::now()).map_err(|e| format!("{url}: {e}"))
}

struct Planner {
    config: PlannerConfig,
    model: Model,
    url: MetricsUrl,
    served: String,
    channels: Channels,
    membership: watch::Receiver<Arc<Membership>>,
    metrics: PlannerMetrics,
    log: Arc<DecisionLog>,
    /// The rate the last plan was sized for.
    sized_for: Option<f64>,
    /// The last decision, until the period after it is observed.
    pending: Option<Decision>,
    decisions: u64,
}

/// A live worker and its `Stats`.
struct LiveWorker {
    view: WorkerView,
    stats: v1::StatsResponse,
}

impl Planner {
    async fn run(&mut self, first: RouterSample) -> Result<(), PlannerServiceError> {
        self.check_profile().await?;
        let mut period_start = first.clone();
        let mut recent = VecDeque::from([first]);
        let mut ticker = tokio::time::interval(self.config.poll_interval());
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticker.tick().await;
        loop {
            ticker.tick().await;
            let sample = match read_router(&self.url, &self.served).await {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read the router's metrics; trying again");
                    self.metrics.error("router");
                    continue;
                }
            };
            // The burst window: from the newest sample at least a window old.
            let window_start = sample.at.checked_sub(self.config.burst_window());
            while recent.len() > 1 && window_start.is_some_and(|start| recent[1].at <= start) {
                recent.pop_front();
            }
            let burst_window = sample.since(&recent[0]);
            recent.push_back(sample.clone());
            let due = sample.at.duration_since(period_start.at) >= self.config.period();
            let burst = decide::burst(
                self.sized_for,
                burst_window.rate(),
                burst_window.received,
                self.config.burst_factor,
                f64::from(self.config.burst_min_requests),
            );
            if !(due || burst) {
                continue;
            }
            let trigger = if due { "period" } else { "burst" };
            let period = sample.since(&period_start);
            self.replan(trigger, &period, &burst_window, &sample).await;
            // A new period, and a new burst window: the plan was sized for what came before.
            period_start = sample.clone();
            recent = VecDeque::from([sample]);
        }
    }

    /// Refuses a profile measured on another model or block size than the workers' (once the
    /// first workers are known; a worker that joins later with another model is left out of
    /// the plan, with a warning).
    async fn check_profile(&mut self) -> Result<(), PlannerServiceError> {
        let deadline = Instant::now() + self.config.period().max(Duration::from_secs(30));
        let workers = loop {
            let workers = self.workers(false).await;
            if !workers.is_empty() || Instant::now() >= deadline {
                break workers;
            }
            tokio::time::sleep(self.config.poll_interval().min(Duration::from_secs(1))).await;
        };
        for w in &workers {
            if let Some(why) = self.mismatch(&w.stats) {
                return Err(PlannerServiceError::Profile(format!(
                    "worker {} ({}): {why}",
                    w.view.id, w.view.address
                )));
            }
        }
        Ok(())
    }

    /// How a worker's `Stats` contradict the profile, if they do.
    fn mismatch(&self, stats: &v1::StatsResponse) -> Option<String> {
        let profile = &self.model.profile;
        if stats.model_fingerprint != profile.model.fingerprint {
            return Some(format!(
                "it serves a model of fingerprint {}, the profile was measured on `{}` of \
                 fingerprint {}: measure a profile of the served model (`duet profile`)",
                stats.model_fingerprint, profile.model.name, profile.model.fingerprint
            ));
        }
        if stats.block_size as usize != profile.kv.block_size {
            return Some(format!(
                "its KV blocks hold {} tokens, the profile's {} (`kv.block_size`)",
                stats.block_size, profile.kv.block_size
            ));
        }
        None
    }

    /// The ready workers of the cluster and their `Stats` (those that do not answer are left
    /// out and counted; with `matching`, those whose model is not the profile's too).
    async fn workers(&self, matching: bool) -> Vec<LiveWorker> {
        let membership = self.membership.borrow().clone();
        let mut addresses: Vec<(String, String)> = membership
            .cards
            .values()
            .filter(|c| c.state == CardState::Ready)
            .map(|c| (c.worker_id.clone(), c.grpc_address.clone()))
            .collect();
        addresses.sort();
        addresses.dedup_by(|a, b| a.1 == b.1);
        let mut workers = Vec::new();
        for (id, address) in addresses {
            let stats = match self.stats(&address).await {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(worker = %id, %address, error = %e, "no stats from a worker; left out of this plan");
                    self.metrics.error("worker");
                    continue;
                }
            };
            if matching && let Some(why) = self.mismatch(&stats) {
                tracing::warn!(worker = %id, %address, "{why}; left out of the plan");
                continue;
            }
            let role = match stats.role() {
                v1::WorkerRole::Prefill => Role::Prefill,
                _ => Role::Decode,
            };
            workers.push(LiveWorker {
                view: WorkerView {
                    id,
                    address,
                    role,
                    role_switch: stats.role_switch,
                    load: stats.running_sequences + stats.waiting_requests,
                },
                stats,
            });
        }
        workers
    }

    async fn stats(&self, address: &str) -> Result<v1::StatsResponse, String> {
        let channel = self.channels.get(address).map_err(|e| e.to_string())?;
        let mut client = v1::worker_control_client::WorkerControlClient::new(channel);
        let call = client.stats(v1::StatsRequest {});
        match tokio::time::timeout(CALL_TIMEOUT, call).await {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(status)) => Err(status.to_string()),
            Err(_) => Err(format!("no answer within {CALL_TIMEOUT:?}")),
        }
    }

    /// One re-plan: observe, simulate, decide, act, publish, log.
    async fn replan(
        &mut self,
        trigger: &'static str,
        period: &Window,
        burst_window: &Window,
        latest: &RouterSample,
    ) {
        let workers = self.workers(true).await;
        let views: Vec<WorkerView> = workers.iter().map(|w| w.view.clone()).collect();
        let live = decide::live_split(&views);
        self.metrics.live(live);
        if let Some(mut last) = self.pending.take() {
            last.observed = Some(period.observed());
            self.log.record(&last);
        }
        self.decisions += 1;
        let rate = period.rate().max(burst_window.rate());
        let backlog: usize = workers
            .iter()
            .map(|w| w.stats.waiting_requests as usize)
            .sum();
        let mut decision = Decision::new(
            self.decisions,
            trigger,
            rate,
            live,
            period.observed(),
            backlog,
        );
        // Lengths over the period; before any request finished in it, over the router's life.
        let lengths = match period.histograms.prompt_tokens.count > 0.0 {
            true => &period.histograms,
            false => &latest.histograms,
        };
        let jobs = live_jobs(
            &lengths.prompt_tokens,
            &lengths.generation_tokens,
            self.config.sim_requests,
            self.config.seed,
        );
        match (live.decode, jobs) {
            (0, _) => decision.reason = "no ready decode worker to plan for".into(),
            (_, None) => decision.reason = "no request has finished: no lengths to simulate".into(),
            (_, Some(_)) if rate <= 0.0 => {
                decision.reason = "no request received this period: nothing to plan".into()
            }
            (_, Some(jobs)) => {
                let load = LiveLoad {
                    rate,
                    jobs,
                    backlog: decision.backlog,
                    seed: self.config.seed,
                };
                let observed_transfer = period.histograms.kv_transfer.mean().map(|s| s * 1e3);
                if let Err(e) = self
                    .plan(&mut decision, &views, load, observed_transfer, period)
                    .await
                {
                    tracing::warn!(error = %e, "re-planning failed; trying again next period");
                    self.metrics.error("simulation");
                    decision.reason = format!("the simulation failed: {e}");
                }
            }
        }
        self.metrics.decided(trigger, decision.action);
        tracing::info!(
            id = decision.id,
            trigger,
            action = decision.action,
            rate = format!("{rate:.3}"),
            live = %live,
            desired = ?decision.desired.map(|d| d.split.to_string()),
            predicted_ttft_p90_ms = ?decision.chosen.map(|c| c.ttft_p90_ms),
            predicted_tpot_p90_ms = ?decision.chosen.map(|c| c.tpot_p90_ms),
            switch = ?decision.switch.as_ref().map(|s| format!("{} {}→{}", s.worker, s.from.as_str(), s.to.as_str())),
            switch_error = ?decision.switch_error,
            "planner decision: {}",
            decision.reason
        );
        self.log.record(&decision);
        self.pending = Some(decision);
    }

    /// Simulates the live load, fills `decision` in, and makes its switch.
    async fn plan(
        &mut self,
        decision: &mut Decision,
        views: &[WorkerView],
        load: LiveLoad,
        observed_transfer_ms: Option<f64>,
        period: &Window,
    ) -> Result<(), duet_planner::PlannerError> {
        let live = decision.live;
        let (model, config) = (self.model.clone(), self.config.clone());
        let reachable = decide::reachable(views);
        // The split, like the replicas, is chosen for the live rate with headroom: a margin for a
        // rate still rising and for the simulation's optimism near saturation.
        let sized = load.at_rate(load.rate * (1.0 + config.headroom));
        decision.planned_rate = sized.rate;
        let simulated = tokio::task::spawn_blocking(move || {
            let now = model.predict(live, &load)?;
            let (model, scale) =
                model.calibrated_transfer(observed_transfer_ms, now.kv_transfer_mean_ms);
            let mut predictions =
                model.predict_splits(live.workers(), reachable.clone(), &sized)?;
            if !reachable.contains(&live.prefill) {
                predictions.push(model.predict(live, &sized)?);
            }
            model.with_goodput(&mut predictions, &sized, config.attainment)?;
            let desired = decide::desired_replicas(
                live.workers(),
                config.min_workers,
                config.max_workers,
                config.attainment,
                &mut |n| model.best_split(n, &sized),
            )?;
            Ok::<_, duet_planner::PlannerError>((predictions, desired, scale))
        })
        .await
        .expect("the simulation does not panic")?;
        let (predictions, desired, scale) = simulated;
        decision.transfer_scale = scale;
        decision.desired = Some(desired);
        self.metrics.desired(desired.split);
        self.sized_for = Some(decision.rate);
        let prediction_of = |split: Split| predictions.iter().find(|p| p.split == split).copied();
        let choice = decide::choose_split(
            live,
            &predictions,
            self.config.attainment,
            self.config.switch_margin,
        );
        decision.action = Decision::action_of(&choice);
        decision.chosen = prediction_of(live);
        match choice {
            SplitChoice::Stay { reason } => decision.reason = reason,
            SplitChoice::Move { target, reason } => {
                decision.reason = reason;
                self.switch_toward(decision, views, target, period).await;
                if decision.switch.is_some() && decision.switch_error.is_none() {
                    let one_step = step_toward(live, target);
                    decision.chosen = prediction_of(one_step).or(decision.chosen);
                }
            }
        }
        if let Some(chosen) = &decision.chosen {
            self.metrics.planned(decision.planned_rate, chosen);
        }
        decision.predictions = predictions;
        Ok(())
    }

    /// Makes the one switch that moves the live split toward `target`.
    async fn switch_toward(
        &self,
        decision: &mut Decision,
        views: &[WorkerView],
        target: Split,
        period: &Window,
    ) {
        if !self.config.switch_roles.is_on() {
            decision.action = "stay";
            decision.reason += " (role switching is off: --switch-roles)";
            return;
        }
        // Prompts are prefilled remotely while KV moves.
        let prefill_traffic = period.histograms.kv_transfer.count > 0.0;
        let step = match decide::next_switch(views, decision.live, target, prefill_traffic) {
            Ok(Some(step)) => step,
            Ok(None) => return,
            Err(blocked) => {
                decision.action = "blocked";
                decision.reason = format!("{}; but {blocked}", decision.reason);
                return;
            }
        };
        let to = match step.to {
            Role::Prefill => v1::WorkerRole::Prefill,
            Role::Decode => v1::WorkerRole::Decode,
        };
        tracing::info!(worker = %step.worker, address = %step.address, from = step.from.as_str(), to = step.to.as_str(), "switching a worker's role (it drains first)");
        let result = match self.channels.get(&step.address) {
            Err(e) => Err(e.to_string()),
            Ok(channel) => {
                let mut client = v1::worker_admin_client::WorkerAdminClient::new(channel);
                let call = client.switch_role(v1::SwitchRoleRequest { role: to.into() });
                let limit = Duration::from_secs(self.config.switch_timeout_s);
                match tokio::time::timeout(limit, call).await {
                    Ok(Ok(_)) => Ok(()),
                    Ok(Err(status)) => Err(status.to_string()),
                    Err(_) => Err(format!("no answer within {limit:?}")),
                }
            }
        };
        self.metrics.switched(step.to.as_str(), result.is_ok());
        if let Err(e) = result {
            tracing::warn!(worker = %step.worker, error = %e, "the role switch failed; it is tried again at the next re-plan");
            decision.switch_error = Some(e);
        }
        decision.switch = Some(step);
    }
}

/// The split one switch from `live` toward `target`.
fn step_toward(live: Split, target: Split) -> Split {
    match target.prefill.cmp(&live.prefill) {
        std::cmp::Ordering::Greater => Split {
            prefill: live.prefill + 1,
            decode: live.decode - 1,
        },
        std::cmp::Ordering::Less => Split {
            prefill: live.prefill - 1,
            decode: live.decode + 1,
        },
        std::cmp::Ordering::Equal => live,
    }
}
