//! The router's Prometheus families (`role="router"`, `model`): requests received and by outcome,
//! the latencies a client sees (time to first token, inter-token latency, time per output token,
//! end to end; vLLM's names and buckets), each finished request's prompt and output lengths and
//! where its first token waited (queue, KV transfer) — what the run-time planner re-plans from —,
//! tokens, failovers, and the routing's own counts
//! ([`Decisions`]: decisions by reason, cached tokens predicted against actual), read at scrape
//! time so that each is counted once and `Info` shows the same numbers.

use std::sync::{Arc, Mutex};

use duet_proto::v1;
use duet_telemetry::metrics::{
    E2E_BUCKETS, KV_TRANSFER_BUCKETS, MODEL, REQUEST_TOKENS_BUCKETS, ROLE, TOKEN_LATENCY_BUCKETS,
    TTFT_BUCKETS,
};
use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, Opts};
use tokio::time::Instant;
use tonic::Code;

use crate::routing::Decisions;
use duet_routing::Decision;

/// The `error_type` label of a request that ended with `code`.
pub fn error_type(code: Code) -> &'static str {
    match code {
        Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition | Code::NotFound => {
            "validation"
        }
        Code::ResourceExhausted => "overload",
        Code::DeadlineExceeded => "deadline",
        Code::Unavailable => "unavailable",
        Code::Cancelled => "cancelled",
        _ => "internal",
    }
}

/// How a request ended, as `duet_requests_total` counts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Success,
    Failed(Code),
    /// The client went away before the last token.
    Cancelled,
}

/// The router's metric families (clones share them).
#[derive(Clone)]
pub struct RouterMetrics {
    received: IntCounter,
    requests: IntCounterVec,
    time_to_first_token: Histogram,
    inter_token_latency: Histogram,
    time_per_output_token: Histogram,
    e2e_latency: Histogram,
    request_prompt_tokens: Histogram,
    request_generation_tokens: Histogram,
    queue_time: Histogram,
    kv_transfer_time: Histogram,
    prompt_tokens: IntCounter,
    generation_tokens: IntCounter,
    routing_decisions: IntCounterVec,
    cached_tokens: IntCounterVec,
    failovers: IntCounter,
    /// What the two routing families mirror, and a lock so that two scrapes add each
    /// difference once.
    decisions: Arc<Decisions>,
    mirrored: Arc<Mutex<()>>,
}

impl RouterMetrics {
    /// The router's families for `model`, the routing ones read from `decisions`.
    pub fn new(model: &str, decisions: Arc<Decisions>) -> Self {
        let opts = |name: &str, help: &str| {
            Opts::new(name, help)
                .const_label(ROLE, "router")
                .const_label(MODEL, model)
        };
        let histogram = |name: &str, help: &str, buckets: &[f64]| {
            Histogram::with_opts(HistogramOpts::from(opts(name, help)).buckets(buckets.to_vec()))
                .expect("valid histogram")
        };
        let counter = |name: &str, help: &str| {
            IntCounter::with_opts(opts(name, help)).expect("valid counter")
        };
        let counter_vec = |name: &str, help: &str, labels: &[&str]| {
            IntCounterVec::new(opts(name, help), labels).expect("valid counter")
        };
        Self {
            received: counter(
                "duet_requests_received_total",
                "Requests received that passed validation, however they end: their rate is the arrival rate the run-time planner sizes the pools for.",
            ),
            requests: counter_vec(
                "duet_requests_total",
                "Requests finished, by status (success or error) and error_type (validation, overload, deadline, unavailable, cancelled, internal; none on success).",
                &["status", "error_type"],
            ),
            time_to_first_token: histogram(
                "duet_time_to_first_token_seconds",
                "Time from a request's arrival to its first token, in seconds.",
                TTFT_BUCKETS,
            ),
            inter_token_latency: histogram(
                "duet_inter_token_latency_seconds",
                "Time between two consecutive token messages of a request, in seconds.",
                TOKEN_LATENCY_BUCKETS,
            ),
            time_per_output_token: histogram(
                "duet_request_time_per_output_token_seconds",
                "A request's mean time per output token after the first, in seconds.",
                TOKEN_LATENCY_BUCKETS,
            ),
            e2e_latency: histogram(
                "duet_e2e_request_latency_seconds",
                "Time from a request's arrival to its last token, in seconds.",
                E2E_BUCKETS,
            ),
            request_prompt_tokens: histogram(
                "duet_request_prompt_tokens",
                "Prompt tokens of each successful request.",
                REQUEST_TOKENS_BUCKETS,
            ),
            request_generation_tokens: histogram(
                "duet_request_generation_tokens",
                "Tokens generated for each successful request.",
                REQUEST_TOKENS_BUCKETS,
            ),
            queue_time: histogram(
                "duet_request_queue_time_seconds",
                "Time from a successful request's arrival until its prefill started (routing, admission and the prefill queue), in seconds.",
                TTFT_BUCKETS,
            ),
            kv_transfer_time: histogram(
                "duet_request_kv_transfer_time_seconds",
                "KV transfer time of each successful request prefilled on a prefill worker, in seconds.",
                KV_TRANSFER_BUCKETS,
            ),
            prompt_tokens: counter(
                "duet_prompt_tokens_total",
                "Prompt tokens of finished requests.",
            ),
            generation_tokens: counter(
                "duet_generation_tokens_total",
                "Tokens generated for finished requests.",
            ),
            routing_decisions: counter_vec(
                "duet_routing_decisions_total",
                "Routing decisions, by reason (remote, local_short_suffix, local_no_prefill_worker, local_prefill_saturated, rejected_ttft).",
                &["reason"],
            ),
            cached_tokens: counter_vec(
                "duet_routing_cached_tokens_total",
                "Prompt tokens of finished requests found in a KV prefix cache, by source (predicted: by the router's index when routing; actual: as the workers reported them).",
                &["source"],
            ),
            failovers: counter(
                "duet_decode_failovers_total",
                "Decode attempts that failed and were re-submitted to another decode worker.",
            ),
            decisions,
            mirrored: Arc::default(),
        }
    }

    fn families(&self) -> [&dyn Collector; 15] {
        [
            &self.received,
            &self.requests,
            &self.time_to_first_token,
            &self.inter_token_latency,
            &self.time_per_output_token,
            &self.e2e_latency,
            &self.request_prompt_tokens,
            &self.request_generation_tokens,
            &self.queue_time,
            &self.kv_transfer_time,
            &self.prompt_tokens,
            &self.generation_tokens,
            &self.routing_decisions,
            &self.cached_tokens,
            &self.failovers,
        ]
    }

    /// A valid request arrived.
    pub fn received(&self) {
        self.received.inc();
    }

    /// A request ended this way.
    pub fn finished(&self, outcome: Outcome) {
        let (status, error) = match outcome {
            Outcome::Success => ("success", "none"),
            Outcome::Failed(code) => ("error", error_type(code)),
            Outcome::Cancelled => ("error", "cancelled"),
        };
        self.requests.with_label_values(&[status, error]).inc();
    }

    /// A successful request's latencies, tokens and `timings` (the final message's).
    pub fn completed(
        &self,
        start: Instant,
        first_token_at: Option<Instant>,
        prompt_tokens: usize,
        generated: usize,
        timings: Option<&v1::Timings>,
    ) {
        let now = Instant::now();
        let e2e = (now - start).as_secs_f64();
        self.e2e_latency.observe(e2e);
        self.prompt_tokens.inc_by(prompt_tokens as u64);
        self.generation_tokens.inc_by(generated as u64);
        self.request_prompt_tokens.observe(prompt_tokens as f64);
        self.request_generation_tokens.observe(generated as f64);
        if let Some(t) = timings {
            self.queue_time.observe(t.queue_ms / 1e3);
            if !t.prefill_local {
                self.kv_transfer_time.observe(t.transfer_ms / 1e3);
            }
        }
        if let Some(first) = first_token_at
            && generated > 1
        {
            let decoding = (now - first).as_secs_f64();
            self.time_per_output_token
                .observe(decoding / (generated - 1) as f64);
        }
    }

    pub fn first_token(&self, after: std::time::Duration) {
        self.time_to_first_token.observe(after.as_secs_f64());
    }

    pub fn next_token(&self, after: std::time::Duration) {
        self.inter_token_latency.observe(after.as_secs_f64());
    }

    /// Brings the routing families up to the routing's own counts.
    fn mirror_decisions(&self) {
        let _one_scrape = self.mirrored.lock().unwrap_or_else(|e| e.into_inner());
        let top_up = |counter: prometheus::IntCounter, to: u64| {
            counter.inc_by(to.saturating_sub(counter.get()));
        };
        for d in Decision::ALL {
            let counter = self.routing_decisions.with_label_values(&[d.name()]);
            top_up(counter, self.decisions.of(d));
        }
        let load = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
        for (source, tokens) in [
            ("predicted", &self.decisions.predicted_cached_tokens),
            ("actual", &self.decisions.actual_cached_tokens),
        ] {
            top_up(
                self.cached_tokens.with_label_values(&[source]),
                load(tokens),
            );
        }
    }

    pub fn failed_over(&self) {
        self.failovers.inc();
    }
}

impl std::fmt::Debug for RouterMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterMetrics").finish_non_exhaustive()
    }
}

impl Collector for RouterMetrics {
    fn desc(&self) -> Vec<&Desc> {
        self.families().into_iter().flat_map(|c| c.desc()).collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.mirror_decisions();
        self.families()
            .into_iter()
            .flat_map(|c| c.collect())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_types_follow_the_status_codes() {
        assert_eq!(error_type(Code::InvalidArgument), "validation");
        assert_eq!(error_type(Code::NotFound), "validation");
        assert_eq!(error_type(Code::ResourceExhausted), "overload");
        assert_eq!(error_type(Code::DeadlineExceeded), "deadline");
        assert_eq!(error_type(Code::Unavailable), "unavailable");
        assert_eq!(error_type(Code::Cancelled), "cancelled");
        assert_eq!(error_type(Code::Internal), "internal");
        assert_eq!(error_type(Code::Unknown), "internal");
    }

    fn value(m: &RouterMetrics, name: &str, labels: &[(&str, &str)]) -> f64 {
        let family = m
            .collect()
            .into_iter()
            .find(|f| f.name() == name)
            .unwrap_or_else(|| panic!("no family {name}"));
        let metric = family
            .get_metric()
            .iter()
            .find(|m| {
                labels.iter().all(|(k, v)| {
                    m.get_label()
                        .iter()
                        .any(|l| l.name() == *k && l.value() == *v)
                })
            })
            .unwrap_or_else(|| panic!("no {name} with {labels:?}"));
        match family.get_field_type() {
            prometheus::proto::MetricType::HISTOGRAM => {
                metric.get_histogram().get_sample_count() as f64
            }
            _ => metric.get_counter().get_value(),
        }
    }

    #[test]
    fn outcomes_and_latencies_are_counted_with_role_and_model() {
        let decisions = Arc::new(Decisions::default());
        let m = RouterMetrics::new("tiny", decisions.clone());
        m.finished(Outcome::Success);
        m.finished(Outcome::Failed(Code::InvalidArgument));
        m.finished(Outcome::Cancelled);
        m.finished(Outcome::Success);
        let base = [("role", "router"), ("model", "tiny")];
        let requests = |status, error| {
            let mut l = base.to_vec();
            l.extend([("status", status), ("error_type", error)]);
            value(&m, "duet_requests_total", &l)
        };
        assert_eq!(requests("success", "none"), 2.0);
        assert_eq!(requests("error", "validation"), 1.0);
        assert_eq!(requests("error", "cancelled"), 1.0);

        let start = Instant::now();
        m.first_token(std::time::Duration::from_millis(3));
        m.received();
        let remote = v1::Timings {
            queue_ms: 2.0,
            transfer_ms: 1.0,
            ..Default::default()
        };
        m.completed(start, Some(start), 5, 4, Some(&remote));
        let local = v1::Timings {
            prefill_local: true,
            ..remote
        };
        m.completed(start, None, 5, 0, Some(&local));
        assert_eq!(value(&m, "duet_requests_received_total", &base), 1.0);
        assert_eq!(value(&m, "duet_request_prompt_tokens", &base), 2.0);
        assert_eq!(value(&m, "duet_request_generation_tokens", &base), 2.0);
        assert_eq!(value(&m, "duet_request_queue_time_seconds", &base), 2.0);
        // A prompt prefilled on its decode worker moved no KV.
        assert_eq!(
            value(&m, "duet_request_kv_transfer_time_seconds", &base),
            1.0
        );
        assert_eq!(value(&m, "duet_time_to_first_token_seconds", &base), 1.0);
        assert_eq!(value(&m, "duet_e2e_request_latency_seconds", &base), 2.0);
        // Only a request with a first token and more after it has a time per output token.
        assert_eq!(
            value(&m, "duet_request_time_per_output_token_seconds", &base),
            1.0
        );
        assert_eq!(value(&m, "duet_generation_tokens_total", &base), 4.0);
        assert_eq!(value(&m, "duet_prompt_tokens_total", &base), 10.0);

        // The routing families show the routing's own counts, each once however often scraped.
        decisions.count(Decision::Remote);
        decisions.finished(100, 48, 32);
        for _ in 0..2 {
            let mut l = base.to_vec();
            l.push(("reason", "remote"));
            assert_eq!(value(&m, "duet_routing_decisions_total", &l), 1.0);
            let mut l = base.to_vec();
            l.push(("source", "actual"));
            assert_eq!(value(&m, "duet_routing_cached_tokens_total", &l), 32.0);
            let mut l = base.to_vec();
            l.push(("source", "predicted"));
            assert_eq!(value(&m, "duet_routing_cached_tokens_total", &l), 48.0);
        }
        decisions.count(Decision::Remote);
        let mut l = base.to_vec();
        l.push(("reason", "remote"));
        assert_eq!(value(&m, "duet_routing_decisions_total", &l), 2.0);
    }
}
