//! The planner's Prometheus families, served on its `--metrics-listen` endpoint. They carry the
//! `model` label, and no `role` label naming the service as the others' do: `role` names the
//! workers' role here (`duet_planner_desired_replicas{role="prefill"}`), as the chart's
//! autoscalers select it.

use duet_telemetry::metrics::MODEL;
use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{Gauge, GaugeVec, IntCounterVec, Opts};

use crate::decide::{Prediction, Split};

/// The planner's metric families (clones share them).
#[derive(Clone)]
pub struct PlannerMetrics {
    desired: GaugeVec,
    live: GaugeVec,
    planned_rate: Gauge,
    predicted_ttft: Gauge,
    predicted_tpot: Gauge,
    predicted_attainment: Gauge,
    decisions: IntCounterVec,
    switches: IntCounterVec,
    errors: IntCounterVec,
}

impl PlannerMetrics {
    pub fn new(model: &str) -> Self {
        let opts = |name: &str, help: &str| Opts::new(name, help).const_label(MODEL, model);
        let gauge =
            |name: &str, help: &str| Gauge::with_opts(opts(name, help)).expect("valid gauge");
        let gauge_vec = |name: &str, help: &str, labels: &[&str]| {
            GaugeVec::new(opts(name, help), labels).expect("valid gauge")
        };
        let counter_vec = |name: &str, help: &str, labels: &[&str]| {
            IntCounterVec::new(opts(name, help), labels).expect("valid counter")
        };
        Self {
            desired: gauge_vec(
                "duet_planner_desired_replicas",
                "Workers of each role (prefill, decode) the live load needs: the fewest whose best split meets the SLOs in simulation at the planned rate. The chart's autoscalers scale each pool to it.",
                &["role"],
            ),
            live: gauge_vec(
                "duet_planner_live_replicas",
                "Workers serving each role (prefill, decode) at the last re-plan.",
                &["role"],
            ),
            planned_rate: gauge(
                "duet_planner_planned_rate",
                "Requests per second the last re-plan sized the pools for (the live rate × (1 + --headroom)).",
            ),
            predicted_ttft: gauge(
                "duet_planner_predicted_ttft_p90_seconds",
                "Simulated p90 time to first token of the split chosen at the last re-plan, at the planned rate.",
            ),
            predicted_tpot: gauge(
                "duet_planner_predicted_tpot_p90_seconds",
                "Simulated p90 time per output token of the split chosen at the last re-plan, at the planned rate.",
            ),
            predicted_attainment: gauge(
                "duet_planner_predicted_attainment",
                "Simulated share of requests within both SLOs for the split chosen at the last re-plan, at the planned rate.",
            ),
            decisions: counter_vec(
                "duet_planner_decisions_total",
                "Re-plans, by trigger (period, burst) and action (stay, switch, blocked, idle).",
                &["trigger", "action"],
            ),
            switches: counter_vec(
                "duet_planner_role_switches_total",
                "Role switches asked of workers, by the role switched to and outcome (ok, failed; a failed one is tried again at the next re-plan).",
                &["to", "outcome"],
            ),
            errors: counter_vec(
                "duet_planner_errors_total",
                "Inputs the planner could not read, by source (router: its metrics endpoint; worker: a worker's Stats; simulation).",
                &["source"],
            ),
        }
    }

    fn families(&self) -> [&dyn Collector; 9] {
        [
            &self.desired,
            &self.live,
            &self.planned_rate,
            &self.predicted_ttft,
            &self.predicted_tpot,
            &self.predicted_attainment,
            &self.decisions,
            &self.switches,
            &self.errors,
        ]
    }

    pub fn desired(&self, split: Split) {
        self.set_split(&self.desired, split);
    }

    pub fn live(&self, split: Split) {
        self.set_split(&self.live, split);
    }

    fn set_split(&self, gauge: &GaugeVec, split: Split) {
        gauge
            .with_label_values(&["prefill"])
            .set(split.prefill as f64);
        gauge
            .with_label_values(&["decode"])
            .set(split.decode as f64);
    }

    pub fn planned(&self, rate: f64, chosen: &Prediction) {
        self.planned_rate.set(rate);
        self.predicted_ttft.set(chosen.ttft_p90_ms / 1e3);
        self.predicted_tpot.set(chosen.tpot_p90_ms / 1e3);
        self.predicted_attainment.set(chosen.attainment);
    }

    pub fn decided(&self, trigger: &str, action: &str) {
        self.decisions.with_label_values(&[trigger, action]).inc();
    }

    pub fn switched(&self, to: &str, ok: bool) {
        let outcome = if ok { "ok" } else { "failed" };
        self.switches.with_label_values(&[to, outcome]).inc();
    }

    pub fn error(&self, source: &str) {
        self.errors.with_label_values(&[source]).inc();
    }
}

impl std::fmt::Debug for PlannerMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlannerMetrics").finish_non_exhaustive()
    }
}

impl Collector for PlannerMetrics {
    fn desc(&self) -> Vec<&Desc> {
        self.families().into_iter().flat_map(|c| c.desc()).collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.families()
            .into_iter()
            .flat_map(|c| c.collect())
            .collect()
    }
}
