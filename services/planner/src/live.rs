//! What the cluster tells of its load: the router's counters and histograms (requests received,
//! time to first token, time per output token, prompt and output lengths, queue and KV transfer
//! time), read from its Prometheus endpoint, and their change over a window of time; and the
//! workload the simulator replays for it, drawn from the observed lengths.

use std::time::Instant;

use duet_planner::workload::{Job, Prompt, TokenSource, synthetic_token};
use serde::Serialize;

use crate::exposition::Sample;

/// A Prometheus histogram: cumulative counts by upper bound (`le`, ascending, `+Inf` last),
/// the sum and the count.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Histogram {
    pub buckets: Vec<(f64, f64)>,
    pub sum: f64,
    pub count: f64,
}

impl Histogram {
    /// The histogram `name` among `samples` whose labels include `labels`; `None` when it has
    /// no series there.
    pub fn of(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<Histogram> {
        let selected = |s: &&Sample| {
            labels
                .iter()
                .all(|(k, v)| s.labels.get(*k).is_some_and(|x| x == v))
        };
        let mut h = Histogram::default();
        let mut found = false;
        for s in samples.iter().filter(selected) {
            let Some(suffix) = s.name.strip_prefix(name) else {
                continue;
            };
            match suffix {
                "_bucket" => {
                    let le = s.labels.get("le").and_then(|le| match le.as_str() {
                        "+Inf" => Some(f64::INFINITY),
                        le => le.parse().ok(),
                    });
                    if let Some(le) = le {
                        h.buckets.push((le, s.value));
                    }
                }
                "_sum" => h.sum = s.value,
                "_count" => {
                    h.count = s.value;
                    found = true;
                }
                _ => {}
            }
        }
        h.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        found.then_some(h)
    }

    /// What was observed since `earlier` (the same series scraped before); all of `self` when
    /// the series restarted (a new process) in between.
    pub fn since(&self, earlier: &Histogram) -> Histogram {
        let same_bounds = self.buckets.len() == earlier.buckets.len()
            && self
                .buckets
                .iter()
                .zip(&earlier.buckets)
                .all(|(a, b)| a.0 == b.0);
        if !same_bounds || self.count < earlier.count {
            return self.clone();
        }
        Histogram {
            buckets: self
                .buckets
                .iter()
                .zip(&earlier.buckets)
                .map(|(a, b)| (a.0, (a.1 - b.1).max(0.0)))
                .collect(),
            sum: self.sum - earlier.sum,
            count: self.count - earlier.count,
        }
    }

    pub fn mean(&self) -> Option<f64> {
        (self.count > 0.0).then(|| self.sum / self.count)
    }

    /// The `q` quantile as Prometheus's `histogram_quantile` estimates it: linear within the
    /// bucket it falls in; the highest finite bound when it falls in the `+Inf` bucket.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        self.value_at(q * self.count)
    }

    /// The value below which `rank` of the observations fall (linear within a bucket).
    fn value_at(&self, rank: f64) -> Option<f64> {
        if self.count <= 0.0 {
            return None;
        }
        let mut lower = (0.0, 0.0);
        for &(le, cumulative) in &self.buckets {
            if cumulative >= rank && cumulative > lower.1 {
                if le.is_infinite() {
                    return Some(lower.0);
                }
                let within = (rank - lower.1) / (cumulative - lower.1);
                return Some(lower.0 + (le - lower.0) * within.clamp(0.0, 1.0));
            }
            if le.is_finite() {
                lower = (le, cumulative);
            }
        }
        Some(lower.0)
    }

    /// An observation drawn from the histogram by its inverse distribution at `u` in [0, 1).
    fn draw(&self, u: f64) -> f64 {
        self.value_at(u * self.count).unwrap_or(0.0)
    }
}

/// The router's histograms the planner reads.
#[derive(Clone, Debug, Default)]
pub struct RouterHistograms {
    pub ttft: Histogram,
    pub tpot: Histogram,
    pub prompt_tokens: Histogram,
    pub generation_tokens: Histogram,
    pub queue: Histogram,
    pub kv_transfer: Histogram,
}

impl RouterHistograms {
    /// What was observed since `earlier`.
    fn since(&self, earlier: &RouterHistograms) -> RouterHistograms {
        RouterHistograms {
            ttft: self.ttft.since(&earlier.ttft),
            tpot: self.tpot.since(&earlier.tpot),
            prompt_tokens: self.prompt_tokens.since(&earlier.prompt_tokens),
            generation_tokens: self.generation_tokens.since(&earlier.generation_tokens),
            queue: self.queue.since(&earlier.queue),
            kv_transfer: self.kv_transfer.since(&earlier.kv_transfer),
        }
    }
}

/// One scrape of the router's families for one model.
#[derive(Clone, Debug)]
pub struct RouterSample {
    pub at: Instant,
    /// `duet_requests_received_total`.
    pub received: f64,
    /// Since the router started.
    pub histograms: RouterHistograms,
}

/// Why a scrape holds no router to plan for.
#[derive(Debug, thiserror::Error)]
pub enum RouterSampleError {
    #[error(
        "it exports no router metrics for model `{model}` (routers there serve: {served}): the \
         profile (--profile) was measured on another model, or the router names it otherwise \
         (--served-model-name)"
    )]
    NoSuchModel { model: String, served: String },
}

impl RouterSample {
    /// The router's families for `model` among `samples`, scraped at `at`.
    pub fn from_samples(
        samples: &[Sample],
        model: &str,
        at: Instant,
    ) -> Result<RouterSample, RouterSampleError> {
        let labels = [("role", "router"), ("model", model)];
        let received = samples
            .iter()
            .find(|s| {
                s.name == "duet_requests_received_total"
                    && labels
                        .iter()
                        .all(|(k, v)| s.labels.get(*k).is_some_and(|x| x == v))
            })
            .map(|s| s.value);
        let Some(received) = received else {
            let mut served: Vec<&str> = samples
                .iter()
                .filter(|s| s.name == "duet_requests_received_total")
                .filter_map(|s| s.labels.get("model").map(String::as_str))
                .collect();
            served.dedup();
            return Err(RouterSampleError::NoSuchModel {
                model: model.into(),
                served: if served.is_empty() {
                    "none".into()
                } else {
                    served.join(", ")
                },
            });
        };
        let h = |name| Histogram::of(samples, name, &labels).unwrap_or_default();
        Ok(RouterSample {
            at,
            received,
            histograms: RouterHistograms {
                ttft: h("duet_time_to_first_token_seconds"),
                tpot: h("duet_request_time_per_output_token_seconds"),
                prompt_tokens: h("duet_request_prompt_tokens"),
                generation_tokens: h("duet_request_generation_tokens"),
                queue: h("duet_request_queue_time_seconds"),
                kv_transfer: h("duet_request_kv_transfer_time_seconds"),
            },
        })
    }

    /// What happened between `earlier` and this sample.
    pub fn since(&self, earlier: &RouterSample) -> Window {
        let seconds = self.at.duration_since(earlier.at).as_secs_f64();
        let received = match self.received >= earlier.received {
            true => self.received - earlier.received,
            false => self.received,
        };
        Window {
            seconds,
            received,
            histograms: self.histograms.since(&earlier.histograms),
        }
    }
}

/// The router's load over a window of time.
#[derive(Clone, Debug, Default)]
pub struct Window {
    pub seconds: f64,
    pub received: f64,
    pub histograms: RouterHistograms,
}

impl Window {
    /// Requests received per second.
    pub fn rate(&self) -> f64 {
        match self.seconds > 0.0 {
            true => self.received / self.seconds,
            false => 0.0,
        }
    }

    /// What was observed, as a decision reports it.
    pub fn observed(&self) -> Observed {
        let ms = |h: &Histogram, q: f64| h.quantile(q).map(|s| s * 1e3);
        let h = &self.histograms;
        Observed {
            seconds: self.seconds,
            rate: self.rate(),
            requests: h.ttft.count,
            ttft_p90_ms: ms(&h.ttft, 0.9),
            tpot_p90_ms: ms(&h.tpot, 0.9),
            queue_p90_ms: ms(&h.queue, 0.9),
            kv_transfer_mean_ms: h.kv_transfer.mean().map(|s| s * 1e3),
        }
    }
}

/// The live latencies over a window (from the router's histograms: percentiles are estimated
/// within their buckets, as Prometheus estimates them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Observed {
    pub seconds: f64,
    /// Requests received per second.
    pub rate: f64,
    /// Requests that got a first token.
    pub requests: f64,
    pub ttft_p90_ms: Option<f64>,
    pub tpot_p90_ms: Option<f64>,
    pub queue_p90_ms: Option<f64>,
    pub kv_transfer_mean_ms: Option<f64>,
}

/// `n` requests whose prompt and output lengths are drawn from the observed ones, their mean
/// kept exact (the histograms' buckets are coarse: a draw is linear within its bucket, then
/// every draw is scaled so that the mean is the observed sum over the count). Prompts are
/// distinct (no prefix shared: the live prefix hits are not modelled). `None` when no request
/// has finished to draw from.
pub fn live_jobs(prompt: &Histogram, output: &Histogram, n: usize, seed: u64) -> Option<Vec<Job>> {
    let prompts = lengths(prompt, n, seed)?;
    let outputs = lengths(output, n, seed ^ 0x5EED)?;
    let mut tokens = TokenSource::new(seed);
    Some(
        prompts
            .into_iter()
            .zip(outputs)
            .map(|(p, o)| Job {
                prompt: Prompt::Tokens(
                    (0..p).map(|_| synthetic_token(tokens.next_u64())).collect(),
                ),
                max_tokens: o as u32,
                follow_ups: Vec::new(),
                at: None,
            })
            .collect(),
    )
}

/// `n` lengths (at least 1) drawn from `h`, scaled to its mean.
fn lengths(h: &Histogram, n: usize, seed: u64) -> Option<Vec<usize>> {
    let mean = h.mean()?;
    let mut source = TokenSource::new(seed);
    let drawn: Vec<f64> = (0..n)
        .map(|_| h.draw((source.next_u64() >> 11) as f64 / (1u64 << 53) as f64))
        .collect();
    let drawn_mean = drawn.iter().sum::<f64>() / n.max(1) as f64;
    let scale = if drawn_mean > 0.0 {
        mean / drawn_mean
    } else {
        1.0
    };
    Some(
        drawn
            .into_iter()
            .map(|d| (d * scale).round().max(1.0) as usize)
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exposition::parse;

    fn histogram(buckets: &[(f64, f64)], sum: f64) -> Histogram {
        Histogram {
            buckets: buckets.to_vec(),
            sum,
            count: buckets.last().unwrap().1,
        }
    }

    #[test]
    fn quantiles_interpolate_within_buckets_as_prometheus_does() {
        let h = histogram(
            &[(1.0, 0.0), (2.0, 10.0), (4.0, 20.0), (f64::INFINITY, 20.0)],
            50.0,
        );
        assert_eq!(h.quantile(0.5), Some(2.0));
        assert_eq!(h.quantile(0.25), Some(1.5));
        assert_eq!(h.quantile(0.75), Some(3.0));
        assert_eq!(h.mean(), Some(2.5));
        // Past the highest finite bound: that bound.
        let tail = histogram(&[(1.0, 1.0), (f64::INFINITY, 10.0)], 50.0);
        assert_eq!(tail.quantile(0.9), Some(1.0));
        assert_eq!(Histogram::default().quantile(0.9), None);
    }

    #[test]
    fn a_window_is_the_difference_of_two_scrapes() {
        let scrape = |received: u32, le1: u32, count: u32, sum: f64| {
            let text = format!(
                "duet_requests_received_total{{role=\"router\",model=\"m\"}} {received}\n\
                 duet_requests_received_total{{role=\"router\",model=\"other\"}} 99\n\
                 duet_request_prompt_tokens_bucket{{role=\"router\",model=\"m\",le=\"50\"}} {le1}\n\
                 duet_request_prompt_tokens_bucket{{role=\"router\",model=\"m\",le=\"+Inf\"}} {count}\n\
                 duet_request_prompt_tokens_sum{{role=\"router\",model=\"m\"}} {sum}\n\
                 duet_request_prompt_tokens_count{{role=\"router\",model=\"m\"}} {count}\n"
            );
            parse(&text).unwrap()
        };
        let t0 = Instant::now();
        let a = RouterSample::from_samples(&scrape(10, 4, 5, 300.0), "m", t0).unwrap();
        let b = RouterSample::from_samples(
            &scrape(30, 14, 15, 800.0),
            "m",
            t0 + std::time::Duration::from_secs(4),
        )
        .unwrap();
        let w = b.since(&a);
        assert_eq!(w.rate(), 5.0);
        let prompt = &w.histograms.prompt_tokens;
        assert_eq!(prompt.count, 10.0);
        assert_eq!(prompt.mean(), Some(50.0));
        assert_eq!(prompt.buckets, vec![(50.0, 10.0), (f64::INFINITY, 10.0)]);
        // A router restarted in between: its counts start again.
        let restarted = RouterSample::from_samples(&scrape(3, 1, 1, 20.0), "m", t0).unwrap();
        assert_eq!(restarted.since(&b).received, 3.0);
        // A model no router there serves: named, with those served.
        let err = RouterSample::from_samples(&scrape(1, 1, 1, 1.0), "x", t0).unwrap_err();
        let err = err.to_string();
        assert!(
            err.contains("`x`") && err.contains("m, other") && err.contains("--profile"),
            "{err}"
        );
    }

    #[test]
    fn live_jobs_keep_the_observed_mean_and_range() {
        // 48-token prompts and 32-token answers land in the (20, 50] bucket.
        let prompt = histogram(
            &[(20.0, 0.0), (50.0, 100.0), (f64::INFINITY, 100.0)],
            4800.0,
        );
        let output = histogram(
            &[(20.0, 0.0), (50.0, 100.0), (f64::INFINITY, 100.0)],
            3200.0,
        );
        let jobs = live_jobs(&prompt, &output, 400, 3).unwrap();
        assert_eq!(jobs.len(), 400);
        let mean = |f: &dyn Fn(&Job) -> usize| {
            jobs.iter().map(f).sum::<usize>() as f64 / jobs.len() as f64
        };
        let prompt_len = |j: &Job| match &j.prompt {
            Prompt::Tokens(t) => t.len(),
            Prompt::Text(_) => unreachable!("token prompts"),
        };
        assert!(
            (mean(&prompt_len) - 48.0).abs() < 1.0,
            "{}",
            mean(&prompt_len)
        );
        assert!((mean(&|j: &Job| j.max_tokens as usize) - 32.0).abs() < 1.0);
        assert!(live_jobs(&Histogram::default(), &output, 4, 1).is_none());
    }
}
