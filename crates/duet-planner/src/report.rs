//! What a serving run is summarised by, whether it ran (`duet bench serve`) or was simulated
//! (`duet simulate`): latency percentiles, SLO attainment and goodput as DistServe defines them
//! (a request attains only if its TTFT and its TPOT both meet their SLOs), and the time to first
//! token split into queue, prefill and transfer. One struct, serialised into both reports, so
//! their JSON compares key by key.

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// Latency SLOs.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Slo {
    pub ttft_ms: f64,
    pub tpot_ms: f64,
}

impl Slo {
    /// Refuses an SLO that no latency can meet (0, negative, not a number), naming the flag.
    pub fn check(&self) -> Result<(), crate::PlannerError> {
        for (v, flag) in [
            (self.ttft_ms, "--ttft-slo-ms"),
            (self.tpot_ms, "--tpot-slo-ms"),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(crate::PlannerError::Invalid(format!(
                    "{flag} must be a positive number of milliseconds, not {v}"
                )));
            }
        }
        Ok(())
    }

    pub fn attained(&self, ttft_ms: f64, tpot_ms: f64) -> bool {
        ttft_ms <= self.ttft_ms && tpot_ms <= self.tpot_ms
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub mean: f64,
}

/// Where the time to first token went, as the router and workers measured it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TtftBreakdown {
    /// Routing, admission and the prefill queue.
    pub queue_ms: Percentiles,
    pub prefill_ms: Percentiles,
    pub transfer_ms: Percentiles,
    /// The router's TTFT (the client's TTFT less the client-side hops).
    pub ttft_ms: Percentiles,
}

/// The part of a run's report that a measured and a simulated run share.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ServeSummary {
    pub design: String,
    pub requests: usize,
    pub failed: usize,
    pub duration_s: f64,
    pub request_throughput: f64,
    pub output_tokens_per_s: f64,
    pub ttft_ms: Percentiles,
    pub tpot_ms: Percentiles,
    pub itl_ms: Percentiles,
    pub e2e_ms: Percentiles,
    pub server_ttft_ms: TtftBreakdown,
    pub slo_attainment: f64,
    pub goodput_rps: f64,
    /// Refused at once (RESOURCE_EXHAUSTED: the in-flight limit, or a TTFT estimate past the
    /// deadline).
    pub shed: usize,
    /// Requests and those that attained both SLOs, by the window they arrived in (from the
    /// run's start): attainment over time, as a burst moves it.
    #[serde(default)]
    pub timeline: Vec<Window>,
}

/// One window of [`ServeSummary::timeline`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Window {
    pub start_s: f64,
    pub requests: u32,
    pub attained: u32,
}

/// A latency distribution in milliseconds, kept as an HDR histogram (microsecond resolution,
/// 3 significant digits) so that a million requests cost no more memory than ten.
#[derive(Clone)]
pub struct Latencies(Histogram<u64>);

impl Default for Latencies {
    fn default() -> Self {
        Self(Histogram::new(3).expect("3 significant digits is valid"))
    }
}

impl Latencies {
    pub fn record(&mut self, ms: f64) {
        // An auto-resizing histogram takes any value.
        let _ = self.0.record((ms * 1e3).round().max(0.0) as u64);
    }

    /// The value at quantile `q` (0..=1), in milliseconds.
    pub fn quantile(&self, q: f64) -> f64 {
        self.0.value_at_quantile(q) as f64 / 1e3
    }

    pub fn percentiles(&self) -> Percentiles {
        if self.0.is_empty() {
            return Percentiles::default();
        }
        Percentiles {
            p50: self.quantile(0.5),
            p90: self.quantile(0.9),
            p99: self.quantile(0.99),
            mean: self.0.mean() / 1e3,
        }
    }
}

/// The percentiles of `values` (milliseconds).
pub fn percentiles(values: impl IntoIterator<Item = f64>) -> Percentiles {
    let mut l = Latencies::default();
    for v in values {
        l.record(v);
    }
    l.percentiles()
}

/// One request's outcome, as a run's summary counts it, and as `--requests-out` writes it (one
/// JSON line each, the split's fields inline under `server_`): a measured and a simulated run of
/// one workload then compare request by request, not only by percentile.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Outcome {
    /// When it arrived, in seconds from the run's start.
    pub arrival_s: f64,
    pub prompt_tokens: usize,
    /// Prompt tokens found in a prefix cache.
    pub cached_tokens: usize,
    pub ttft_ms: f64,
    pub tpot_ms: f64,
    pub e2e_ms: f64,
    pub output_tokens: usize,
    /// The servers' split of the TTFT, when they reported one (a record's `server_*` fields).
    #[serde(flatten)]
    pub split: Option<TtftSplit>,
}

/// The servers' account of a request's time to first token; in a `--requests-out` record its
/// fields are named `server_*`, beside the client's own TTFT.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct TtftSplit {
    #[serde(rename = "server_queue_ms")]
    pub queue_ms: f64,
    #[serde(rename = "server_prefill_ms")]
    pub prefill_ms: f64,
    #[serde(rename = "server_transfer_ms")]
    pub transfer_ms: f64,
    #[serde(rename = "server_ttft_ms")]
    pub ttft_ms: f64,
    /// The decode worker computed the prompt itself (no prefill worker, no KV transfer).
    #[serde(rename = "server_prefill_local")]
    pub prefill_local: bool,
}

/// Writes the served requests of each run to `out` as JSON lines, each with its run's design,
/// in the order they arrived (`--requests-out`).
pub fn write_outcomes<'a>(
    out: impl std::io::Write,
    runs: impl IntoIterator<Item = (&'a str, &'a [Outcome])>,
) -> std::io::Result<()> {
    use std::io::Write;
    #[derive(Serialize)]
    struct Line<'a> {
        design: &'a str,
        #[serde(flatten)]
        outcome: &'a Outcome,
    }
    let mut out = std::io::BufWriter::new(out);
    for (design, outcomes) in runs {
        let mut in_order: Vec<&Outcome> = outcomes.iter().collect();
        in_order.sort_by(|a, b| a.arrival_s.total_cmp(&b.arrival_s));
        for outcome in in_order {
            serde_json::to_writer(&mut out, &Line { design, outcome })?;
            out.write_all(b"\n")?;
        }
    }
    out.flush()
}

/// Accumulates a run's outcomes into its [`ServeSummary`].
#[derive(Clone, Default)]
pub struct SummaryBuilder {
    /// Width of the timeline's windows, in seconds; none (the default): no timeline.
    window_s: f64,
    timeline: Vec<Window>,
    requests: usize,
    ok: usize,
    shed: usize,
    attained: usize,
    output_tokens: u64,
    ttft: Latencies,
    tpot: Latencies,
    itl: Latencies,
    e2e: Latencies,
    queue: Latencies,
    prefill: Latencies,
    transfer: Latencies,
    server_ttft: Latencies,
    /// Every served request's outcome, when asked to keep them ([`Self::keep_outcomes`]).
    kept: Option<Vec<Outcome>>,
}

impl SummaryBuilder {
    /// A builder whose timeline counts requests by windows of `window_s` seconds (positive).
    pub fn new(window_s: f64) -> Self {
        Self {
            window_s,
            ..Self::default()
        }
    }

    /// Keeps every served request's outcome besides counting it (for `--requests-out`).
    pub fn keep_outcomes(&mut self) {
        self.kept.get_or_insert_with(Vec::new);
    }

    /// The outcomes kept, in the order they ended (none unless [`Self::keep_outcomes`]).
    pub fn take_outcomes(&mut self) -> Vec<Outcome> {
        self.kept.take().unwrap_or_default()
    }

    /// A request that ended with its answer.
    pub fn served(&mut self, o: &Outcome, slo: &Slo) {
        if let Some(kept) = &mut self.kept {
            kept.push(*o);
        }
        self.requests += 1;
        self.ok += 1;
        self.output_tokens += o.output_tokens as u64;
        let attained = slo.attained(o.ttft_ms, o.tpot_ms);
        self.attained += attained as usize;
        self.count_window(o.arrival_s, attained);
        self.ttft.record(o.ttft_ms);
        self.tpot.record(o.tpot_ms);
        self.e2e.record(o.e2e_ms);
        if let Some(s) = o.split {
            self.queue.record(s.queue_ms);
            self.prefill.record(s.prefill_ms);
            self.transfer.record(s.transfer_ms);
            self.server_ttft.record(s.ttft_ms);
        }
    }

    /// A request that arrived `arrival_s` after the start and failed; `shed`: refused at once
    /// for load.
    pub fn failed(&mut self, shed: bool, arrival_s: f64) {
        self.requests += 1;
        self.shed += shed as usize;
        self.count_window(arrival_s, false);
    }

    fn count_window(&mut self, arrival_s: f64, attained: bool) {
        if self.window_s <= 0.0 {
            return;
        }
        let i = (arrival_s.max(0.0) / self.window_s) as usize;
        if self.timeline.len() <= i {
            let width = self.window_s;
            let from = self.timeline.len();
            self.timeline.extend((from..=i).map(|k| Window {
                start_s: k as f64 * width,
                ..Window::default()
            }));
        }
        let window = &mut self.timeline[i];
        window.requests += 1;
        window.attained += attained as u32;
    }

    /// One gap between consecutive token messages of a request.
    pub fn inter_token(&mut self, ms: f64) {
        self.itl.record(ms);
    }

    /// The summary of a run of `design` that lasted `duration_s`.
    pub fn build(&self, design: &str, duration_s: f64) -> ServeSummary {
        let per_s = |n: f64| {
            if duration_s > 0.0 {
                n / duration_s
            } else {
                0.0
            }
        };
        ServeSummary {
            design: design.to_string(),
            requests: self.requests,
            failed: self.requests - self.ok,
            duration_s,
            request_throughput: per_s(self.ok as f64),
            output_tokens_per_s: per_s(self.output_tokens as f64),
            ttft_ms: self.ttft.percentiles(),
            tpot_ms: self.tpot.percentiles(),
            itl_ms: self.itl.percentiles(),
            e2e_ms: self.e2e.percentiles(),
            server_ttft_ms: TtftBreakdown {
                queue_ms: self.queue.percentiles(),
                prefill_ms: self.prefill.percentiles(),
                transfer_ms: self.transfer.percentiles(),
                ttft_ms: self.server_ttft.percentiles(),
            },
            slo_attainment: self.attained as f64 / self.requests.max(1) as f64,
            goodput_rps: per_s(self.attained as f64),
            shed: self.shed,
            timeline: self.timeline.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attainment_needs_both_slos_and_goodput_counts_attained_requests_per_second() {
        let slo = Slo {
            ttft_ms: 100.0,
            tpot_ms: 10.0,
        };
        let mut b = SummaryBuilder::new(1.0);
        let o = |ttft_ms, tpot_ms| Outcome {
            arrival_s: 1.5,
            ttft_ms,
            tpot_ms,
            e2e_ms: ttft_ms + 10.0 * tpot_ms,
            output_tokens: 11,
            ..Outcome::default()
        };
        b.served(&o(50.0, 5.0), &slo);
        b.served(&o(150.0, 5.0), &slo);
        b.served(&o(50.0, 15.0), &slo);
        b.failed(true, 0.2);
        let s = b.build("x", 2.0);
        // By the window each arrived in: attainment over time.
        let window = |start_s, requests, attained| Window {
            start_s,
            requests,
            attained,
        };
        assert_eq!(s.timeline, [window(0.0, 1, 0), window(1.0, 3, 1)]);
        assert_eq!((s.requests, s.failed, s.shed), (4, 1, 1));
        assert_eq!(s.slo_attainment, 0.25);
        assert_eq!(s.goodput_rps, 0.5);
        assert_eq!(s.request_throughput, 1.5);
        assert_eq!(s.output_tokens_per_s, 16.5);
        // Within the histogram's 3 significant digits.
        assert!((s.ttft_ms.p50 - 50.0).abs() < 0.05, "{:?}", s.ttft_ms);
        assert!(
            Slo {
                ttft_ms: 0.0,
                tpot_ms: 1.0
            }
            .check()
            .unwrap_err()
            .to_string()
            .contains("--ttft-slo-ms")
        );
    }

    /// `--requests-out`: the requests kept, one JSON line each in the order they arrived, with
    /// the servers' split where there was one, every run's after the one before.
    #[test]
    fn kept_outcomes_are_written_one_line_each_in_arrival_order() {
        let slo = Slo {
            ttft_ms: 100.0,
            tpot_ms: 10.0,
        };
        let outcome = |arrival_s, split| Outcome {
            arrival_s,
            prompt_tokens: 640,
            cached_tokens: 512,
            ttft_ms: 50.0,
            tpot_ms: 5.0,
            e2e_ms: 100.0,
            output_tokens: 11,
            split,
        };
        let split = TtftSplit {
            queue_ms: 1.0,
            prefill_ms: 40.0,
            transfer_ms: 2.0,
            ttft_ms: 45.0,
            prefill_local: false,
        };
        let mut counted = SummaryBuilder::new(1.0);
        counted.served(&outcome(0.5, None), &slo);
        assert!(counted.take_outcomes().is_empty(), "kept only when asked");
        let mut kept = SummaryBuilder::new(1.0);
        kept.keep_outcomes();
        kept.served(&outcome(2.0, Some(split)), &slo);
        kept.served(&outcome(1.0, None), &slo);
        let outcomes = kept.take_outcomes();
        assert_eq!(outcomes.len(), 2);
        let colocated = [outcome(0.25, None)];
        let mut written = Vec::new();
        let runs = [
            ("disaggregated", &outcomes[..]),
            ("colocated", &colocated[..]),
        ];
        write_outcomes(&mut written, runs).unwrap();
        let lines: Vec<serde_json::Value> = String::from_utf8(written)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let field = |i: usize, k: &str| lines[i][k].clone();
        assert_eq!(lines.len(), 3);
        assert_eq!(
            [
                field(0, "arrival_s"),
                field(1, "arrival_s"),
                field(2, "arrival_s")
            ],
            [1.0, 2.0, 0.25].map(|v| serde_json::json!(v))
        );
        assert_eq!(field(0, "design"), "disaggregated");
        assert_eq!(field(2, "design"), "colocated");
        assert_eq!(field(0, "cached_tokens"), 512);
        assert!(field(0, "server_prefill_ms").is_null(), "{}", lines[0]);
        assert_eq!(field(1, "server_prefill_ms"), 40.0);
        assert_eq!(field(1, "server_queue_ms"), 1.0);
        assert_eq!(field(1, "server_transfer_ms"), 2.0);
        assert_eq!(field(1, "server_ttft_ms"), 45.0);
        assert_eq!(field(1, "server_prefill_local"), false);
    }
}
