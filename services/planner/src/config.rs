//! The run-time planner's flags, each with an environment variable.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use duet_cluster::ClusterArgs;
use duet_engine::device::Switch;
use duet_planner::report::Slo;
use duet_proto::{ClusterAuth, TlsArgs};
use duet_telemetry::MetricsArgs;

use crate::PlannerServiceError;
use crate::exposition::MetricsUrl;

#[derive(Args, Clone, Debug)]
pub struct PlannerConfig {
    /// The router's Prometheus endpoint (`http://HOST:PORT[/PATH]`, the router's
    /// --metrics-listen; path /metrics by default): the live arrival rate, prompt and output
    /// lengths, queue and KV transfer times, and the latencies observed, are read from it.
    #[arg(long, value_name = "URL", env = "DUET_PLANNER_ROUTER_METRICS")]
    pub router_metrics: String,
    /// The name the router's metrics give the model (its first --served-model-name). Unset:
    /// the profile's model name (the model file's stem, as the router names it by default).
    #[arg(long, value_name = "NAME", env = "DUET_PLANNER_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    /// Seconds between two re-plans (a burst re-plans at once in between).
    #[arg(long, env = "DUET_PLANNER_PERIOD_S", default_value_t = 60.0)]
    pub period_s: f64,
    /// Seconds between two reads of the router's metrics (how soon a burst is seen).
    #[arg(long, env = "DUET_PLANNER_POLL_INTERVAL_S", default_value_t = 5.0)]
    pub poll_interval_s: f64,
    /// The burst trigger's window, in seconds: the live arrival rate is the requests received
    /// over the last window.
    #[arg(long, env = "DUET_PLANNER_BURST_WINDOW_S", default_value_t = 15.0)]
    pub burst_window_s: f64,
    /// A burst: the window's rate above this many times the rate the current plan was sized
    /// for (more than 1).
    #[arg(long, env = "DUET_PLANNER_BURST_FACTOR", default_value_t = 1.5)]
    pub burst_factor: f64,
    /// Fewest requests in the window for a burst (fewer are noise).
    #[arg(long, env = "DUET_PLANNER_BURST_MIN_REQUESTS", default_value_t = 10)]
    pub burst_min_requests: u32,
    /// Time-to-first-token SLO in milliseconds.
    #[arg(long, env = "DUET_TTFT_SLO_MS", default_value_t = 1000.0)]
    pub ttft_slo_ms: f64,
    /// Time-per-output-token SLO in milliseconds.
    #[arg(long, env = "DUET_TPOT_SLO_MS", default_value_t = 100.0)]
    pub tpot_slo_ms: f64,
    /// Share of requests that must meet both SLOs (DistServe's 90%).
    #[arg(long, env = "DUET_PLANNER_ATTAINMENT", default_value_t = 0.9)]
    pub attainment: f64,
    /// The live split and the desired replicas are chosen for the live rate × (1 + headroom): a
    /// margin for a rate still rising and for the simulation's optimism near saturation.
    #[arg(long, env = "DUET_PLANNER_HEADROOM", default_value_t = 0.2)]
    pub headroom: f64,
    /// Fewest workers the desired replicas ask for.
    #[arg(long, env = "DUET_PLANNER_MIN_WORKERS", default_value_t = 1)]
    pub min_workers: usize,
    /// Most workers the desired replicas ask for.
    #[arg(long, env = "DUET_PLANNER_MAX_WORKERS", default_value_t = 16)]
    pub max_workers: usize,
    /// A split is switched to only when its simulated attainment beats the live split's by
    /// this much (0-1: hysteresis); where both meet the SLOs, only when its goodput is this
    /// share more.
    #[arg(long, env = "DUET_PLANNER_SWITCH_MARGIN", default_value_t = 0.05)]
    pub switch_margin: f64,
    /// Switch workers' roles (those started with --role-switch on) toward the best split;
    /// off: publish the desired replicas only.
    #[arg(long, env = "DUET_PLANNER_SWITCH_ROLES", value_enum, default_value_t = Switch::On)]
    pub switch_roles: Switch,
    /// Longest wait for one role switch (its drain included), in seconds.
    #[arg(long, env = "DUET_PLANNER_SWITCH_TIMEOUT_S", default_value_t = 120)]
    pub switch_timeout_s: u64,
    /// Requests each simulation replays.
    #[arg(long, env = "DUET_PLANNER_SIM_REQUESTS", default_value_t = 400)]
    pub sim_requests: usize,
    /// Seed of the simulated requests' lengths and arrival times.
    #[arg(long, env = "DUET_PLANNER_SEED", default_value_t = 1)]
    pub seed: u64,
    /// Append every decision (JSON, one a line) to this file: written when made, and again
    /// with the latencies observed after it at the next re-plan. They are also served as JSON
    /// on /decisions of --metrics-listen.
    #[arg(long, value_name = "FILE", env = "DUET_PLANNER_DECISIONS_OUT")]
    pub decisions_out: Option<PathBuf>,
    /// Seconds between two full listings of the workers' cards.
    #[arg(long, env = "DUET_MEMBERSHIP_RESYNC_S", default_value_t = 30)]
    pub membership_resync_s: u64,
    /// Where /metrics (duet_planner_desired_replicas, ...) and /decisions are served.
    #[command(flatten)]
    pub metrics: MetricsArgs,
    /// Where the workers' cards are.
    #[command(flatten)]
    pub cluster: ClusterArgs,
    /// The cluster token the planner's Stats and SwitchRole calls carry.
    #[command(flatten)]
    pub auth: ClusterAuth,
    /// TLS of its calls to the workers (their CA, and its own certificate for mTLS).
    #[command(flatten)]
    pub tls: TlsArgs,
}

impl PlannerConfig {
    /// The SLOs (checked).
    pub fn slo(&self) -> Result<Slo, PlannerServiceError> {
        let slo = Slo {
            ttft_ms: self.ttft_slo_ms,
            tpot_ms: self.tpot_slo_ms,
        };
        slo.check()?;
        Ok(slo)
    }

    /// The router's endpoint (checked).
    pub fn router_url(&self) -> Result<MetricsUrl, PlannerServiceError> {
        self.router_metrics
            .parse()
            .map_err(|e| flag(format!("--router-metrics: {e}")))
    }

    /// Refuses settings no loop can run with, naming the flag.
    pub fn check(&self) -> Result<(), PlannerServiceError> {
        self.slo()?;
        self.router_url()?;
        let positive = |v: f64, name: &str| match v.is_finite() && v > 0.0 {
            true => Ok(()),
            false => Err(flag(format!("{name} must be a positive number, not {v}"))),
        };
        positive(self.period_s, "--period-s")?;
        positive(self.poll_interval_s, "--poll-interval-s")?;
        positive(self.burst_window_s, "--burst-window-s")?;
        if !(self.burst_factor.is_finite() && self.burst_factor > 1.0) {
            return Err(flag(format!(
                "--burst-factor must be more than 1, not {}",
                self.burst_factor
            )));
        }
        if !(self.attainment > 0.0 && self.attainment <= 1.0) {
            return Err(flag(format!(
                "--attainment must be in (0, 1], not {}",
                self.attainment
            )));
        }
        if !(self.headroom.is_finite() && self.headroom >= 0.0) {
            return Err(flag(format!(
                "--headroom must be at least 0, not {}",
                self.headroom
            )));
        }
        if !(0.0..1.0).contains(&self.switch_margin) {
            return Err(flag(format!(
                "--switch-margin must be in [0, 1), not {}",
                self.switch_margin
            )));
        }
        if self.min_workers == 0 || self.min_workers > self.max_workers {
            return Err(flag(format!(
                "--min-workers ({}) must be at least 1 and at most --max-workers ({})",
                self.min_workers, self.max_workers
            )));
        }
        if self.sim_requests < 10 {
            return Err(flag(format!(
                "--sim-requests must be at least 10, not {}",
                self.sim_requests
            )));
        }
        Ok(())
    }

    pub fn period(&self) -> Duration {
        Duration::from_secs_f64(self.period_s)
    }

    pub fn poll_interval(&self) -> Duration {
        Duration::from_secs_f64(self.poll_interval_s)
    }

    pub fn burst_window(&self) -> Duration {
        Duration::from_secs_f64(self.burst_window_s)
    }
}

fn flag(message: String) -> PlannerServiceError {
    PlannerServiceError::Flag(message)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        planner: PlannerConfig,
    }

    fn parse(args: &[&str]) -> PlannerConfig {
        let argv = ["duet-planner", "--router-metrics=http://r:9090"]
            .iter()
            .chain(args);
        Cli::try_parse_from(argv).unwrap().planner
    }

    #[test]
    fn the_defaults_are_sane_and_bad_values_name_their_flag() {
        let c = parse(&[]);
        assert!(c.check().is_ok());
        assert_eq!((c.period_s, c.burst_factor), (60.0, 1.5));
        for (args, named) in [
            (&["--ttft-slo-ms=0"][..], "--ttft-slo-ms"),
            (&["--tpot-slo-ms=-1"], "--tpot-slo-ms"),
            (&["--period-s=0"], "--period-s"),
            (&["--burst-factor=1"], "--burst-factor"),
            (&["--attainment=1.5"], "--attainment"),
            (&["--min-workers=4", "--max-workers=2"], "--min-workers"),
        ] {
            let err = parse(args).check().unwrap_err().to_string();
            assert!(err.contains(named), "{args:?}: {err}");
        }
        let https = PlannerConfig {
            router_metrics: "https://r:1".into(),
            ..parse(&[])
        };
        let err = https.check().unwrap_err().to_string();
        assert!(err.contains("--router-metrics"), "{err}");
    }
}
