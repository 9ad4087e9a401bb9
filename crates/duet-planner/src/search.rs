//! DistServe's placement search: for each candidate placement, the highest request rate at which
//! the simulated cluster still meets both SLOs for the target share of requests (a binary search
//! on the rate), and from it the goodput per device; the winner is the placement with the most.
//!
//! Like DistServe, the search simulates a unit of up to a few devices and replicates the best
//! unit over the devices given: the router spreads load over replicas as over one pool, and a
//! unit's simulation is what keeps the search to minutes for 64 devices.

use serde::Serialize;

use crate::PlannerError;
use crate::arrivals::Arrivals;
use crate::profile::Profile;
use crate::simulator::{Design, SimConfig, SimResult, simulate};
use crate::workload::Job;

/// One placement: a design, its pools, and its engines' step budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Candidate {
    pub design: Design,
    pub prefill: usize,
    pub decode: usize,
    /// `--max-step-tokens`: the prefill chunk, and (a decode row taking one token of it) the
    /// batch cap.
    pub max_step_tokens: usize,
}

impl Candidate {
    pub fn devices(&self) -> usize {
        self.prefill + self.decode
    }

    pub fn name(&self) -> String {
        match self.design {
            Design::Colocated => {
                format!("colocated ×{}, step {}", self.decode, self.max_step_tokens)
            }
            Design::Disaggregated => format!(
                "{}P+{}D, step {}",
                self.prefill, self.decode, self.max_step_tokens
            ),
        }
    }
}

/// Every placement of `1..=max_unit` devices: colocated, and every prefill:decode split, with
/// each step budget.
pub fn candidates(max_unit: usize, step_options: &[usize]) -> Vec<Candidate> {
    let mut out = Vec::new();
    for &max_step_tokens in step_options {
        for devices in 1..=max_unit {
            out.push(Candidate {
                design: Design::Colocated,
                prefill: 0,
                decode: devices,
                max_step_tokens,
            });
            for prefill in 1..devices {
                out.push(Candidate {
                    design: Design::Disaggregated,
                    prefill,
                    decode: devices - prefill,
                    max_step_tokens,
                });
            }
        }
    }
    out
}

/// What the search settles for.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct SearchSettings {
    /// Share of requests that must meet both SLOs (DistServe: 0.9).
    pub attainment: f64,
    /// Bisection steps after the rate is bracketed.
    pub iterations: usize,
    /// The rate the search starts from (requests per second).
    pub start_rate: f64,
    /// Devices the winner is replicated over.
    pub devices: usize,
    /// Seed of the arrival times.
    pub seed: u64,
}

/// One simulated rate of a candidate.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct RatePoint {
    pub rate: f64,
    pub attainment: f64,
    pub ttft_p90_ms: f64,
    pub tpot_p90_ms: f64,
}

/// The highest rate whose attainment reaches `target`: doubled from `start` until it fails, then
/// bisected `iterations` times (attainment falls as the rate rises, as a queue grows). Returns
/// it (0 when even `start`'s half-millionth fails) and every rate tried, in order.
pub fn max_rate(
    eval: &mut dyn FnMut(f64) -> Result<RatePoint, PlannerError>,
    target: f64,
    start: f64,
    iterations: usize,
) -> Result<(f64, Vec<RatePoint>), PlannerError> {
    let mut tried = Vec::new();
    let mut probe = |rate: f64, tried: &mut Vec<RatePoint>| -> Result<bool, PlannerError> {
        let p = eval(rate)?;
        tried.push(p);
        Ok(p.attainment >= target)
    };
    let (mut good, mut bad);
    if probe(start, &mut tried)? {
        good = start;
        bad = start * 2.0;
        while probe(bad, &mut tried)? {
            good = bad;
            bad *= 2.0;
            if bad > start * 1e9 {
                return Err(PlannerError::Invalid(
                    "the attainment never fell as the rate rose: the workload is too small to \
                     load the cluster (raise --requests)"
                        .into(),
                ));
            }
        }
    } else {
        // Halved until one rate passes.
        bad = start;
        loop {
            let lower = bad / 2.0;
            if lower < start * 1e-6 {
                return Ok((0.0, tried));
            }
            if probe(lower, &mut tried)? {
                good = lower;
                break;
            }
            bad = lower;
        }
    }
    for _ in 0..iterations {
        let mid = (good + bad) / 2.0;
        match probe(mid, &mut tried)? {
            true => good = mid,
            false => bad = mid,
        }
    }
    Ok((good, tried))
}

/// A candidate's result.
#[derive(Clone, Debug, Serialize)]
pub struct Searched {
    pub candidate: Candidate,
    pub name: String,
    /// The highest rate meeting the attainment target, for this unit.
    pub max_rate: f64,
    /// `max_rate` ÷ the unit's devices.
    pub goodput_per_device: f64,
    /// Units of this placement the devices given hold, and their rate together.
    pub replicas: usize,
    pub total_rate: f64,
    /// Every rate simulated, in the order tried.
    pub curve: Vec<RatePoint>,
}

/// Simulates `jobs` arriving as `arrivals` on every candidate, searching each one's highest
/// rate; `config` gives everything else (the router, the KV cache, sharing, SLOs). Results in
/// the candidates' order; `progress` hears each candidate's name as it starts.
pub fn search(
    profile: &Profile,
    config: &SimConfig,
    candidates: &[Candidate],
    jobs: &[Job],
    arrivals: Arrivals,
    settings: &SearchSettings,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<Searched>, PlannerError> {
    let (devices, seed) = (settings.devices, settings.seed);
    if !(settings.attainment > 0.0 && settings.attainment <= 1.0) {
        return Err(PlannerError::Invalid(format!(
            "--attainment must be in (0, 1], not {}",
            settings.attainment
        )));
    }
    let mut results = Vec::with_capacity(candidates.len());
    for &candidate in candidates {
        progress(&candidate.name());
        let mut routing = config.routing;
        if candidate.design == Design::Colocated {
            // A colocated worker prefills every prompt itself (as `duet bench serve` runs one).
            routing.policy.local_prefill_threshold = u32::MAX;
        }
        let config = SimConfig {
            design: candidate.design,
            routing,
            prefill_workers: candidate.prefill,
            decode_workers: candidate.decode,
            max_step_tokens: candidate.max_step_tokens,
            ..config.clone()
        };
        let mut eval = |rate: f64| -> Result<RatePoint, PlannerError> {
            let r = run_at(profile, &config, jobs, arrivals, rate, seed)?;
            Ok(RatePoint {
                rate,
                attainment: r.summary.slo_attainment,
                ttft_p90_ms: r.summary.ttft_ms.p90,
                tpot_p90_ms: r.summary.tpot_ms.p90,
            })
        };
        let (max_rate, curve) = max_rate(
            &mut eval,
            settings.attainment,
            settings.start_rate,
            settings.iterations,
        )?;
        let replicas = devices / candidate.devices();
        results.push(Searched {
            candidate,
            name: candidate.name(),
            max_rate,
            goodput_per_device: max_rate / candidate.devices() as f64,
            replicas,
            total_rate: max_rate * replicas as f64,
            curve,
        });
    }
    Ok(results)
}

/// One simulation of `jobs` at `rate` (a trace is sped up to it).
pub fn run_at(
    profile: &Profile,
    config: &SimConfig,
    jobs: &[Job],
    arrivals: Arrivals,
    rate: f64,
    seed: u64,
) -> Result<SimResult, PlannerError> {
    let arrivals = match arrivals {
        Arrivals::Trace { .. } => Arrivals::Trace {
            speedup: rate / trace_rate(jobs)?,
        },
        Arrivals::Closed { .. } => {
            return Err(PlannerError::Invalid(
                "a search over rates needs an open loop (--rate, with the arrival process) or a \
                 trace, not --concurrency"
                    .into(),
            ));
        }
        open => open.at_rate(rate),
    };
    let mut source = jobs.iter().cloned().map(Ok);
    simulate(profile, config, &mut source, arrivals, seed, &mut |_| {})
}

/// A trace's own mean rate: its requests over its span.
pub fn trace_rate(jobs: &[Job]) -> Result<f64, PlannerError> {
    let span = jobs
        .last()
        .and_then(|j| j.at)
        .map_or(0.0, |d| d.as_secs_f64());
    if span <= 0.0 {
        return Err(PlannerError::Trace(
            "the trace spans no time: its timestamps give no rate to scale".into(),
        ));
    }
    Ok(jobs.len() as f64 / span)
}

/// The best result by `objective`.
pub fn best(results: &[Searched], objective: Objective) -> Option<&Searched> {
    let key = |s: &Searched| match objective {
        Objective::PerDevice => s.goodput_per_device,
        Objective::Total => s.total_rate,
    };
    results.iter().max_by(|a, b| key(a).total_cmp(&key(b)))
}

/// What the winner maximises.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Objective {
    /// Goodput per device (DistServe's): the placement to replicate over many devices.
    PerDevice,
    /// Goodput of the devices given together: for one machine whose workers share its cores.
    Total,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::Slo;
    use crate::testing::synthetic;
    use crate::workload::{Range, random_jobs};

    #[test]
    fn the_rate_search_brackets_then_bisects() {
        let knee = 7.3;
        let mut eval = |rate: f64| {
            Ok(RatePoint {
                rate,
                attainment: if rate <= knee { 0.95 } else { 0.5 },
                ttft_p90_ms: 0.0,
                tpot_p90_ms: 0.0,
            })
        };
        let (found, tried) = max_rate(&mut eval, 0.9, 1.0, 10).unwrap();
        assert!(
            found <= knee && knee - found < 8.0 / 1024.0 * 2.0,
            "{found}"
        );
        assert_eq!(
            tried[..4].iter().map(|p| p.rate).collect::<Vec<_>>(),
            [1.0, 2.0, 4.0, 8.0]
        );
        // From above the knee: halved until one passes.
        let (found, _) = max_rate(&mut eval, 0.9, 100.0, 10).unwrap();
        assert!(found <= knee && knee - found < 0.1, "{found}");
        let mut never = |rate: f64| {
            Ok(RatePoint {
                rate,
                attainment: 0.0,
                ttft_p90_ms: 0.0,
                tpot_p90_ms: 0.0,
            })
        };
        assert_eq!(max_rate(&mut never, 0.9, 1.0, 4).unwrap().0, 0.0);
    }

    #[test]
    fn placements_cover_every_split_of_every_unit() {
        let c = candidates(3, &[128]);
        let names: Vec<String> = c.iter().map(Candidate::name).collect();
        assert_eq!(
            names,
            [
                "colocated ×1, step 128",
                "colocated ×2, step 128",
                "1P+1D, step 128",
                "colocated ×3, step 128",
                "1P+2D, step 128",
                "2P+1D, step 128"
            ]
        );
    }

    /// Long prompts and short answers under a tight TTFT: a prefill worker beside a decode
    /// worker serves more per device than two colocated workers whose prompt chunks stall
    /// their decoding, or the reverse; whichever wins, the search ranks by its own simulations
    /// and the winner's goodput per device is the highest found.
    #[test]
    fn the_search_picks_the_placement_with_the_most_goodput_per_device() {
        let config = SimConfig {
            max_step_tokens: 256,
            kv_cache_tokens: 32 * 1024,
            slo: Slo {
                ttft_ms: 400.0,
                tpot_ms: 30.0,
            },
            ..crate::testing::config(Design::Disaggregated, 1, 1)
        };
        let jobs: Vec<Job> = random_jobs(
            1,
            300,
            Range { min: 400, max: 800 },
            Range { min: 8, max: 16 },
        )
        .collect();
        let settings = SearchSettings {
            attainment: 0.9,
            iterations: 5,
            start_rate: 1.0,
            devices: 4,
            seed: 1,
        };
        let profile = synthetic();
        let results = search(
            &profile,
            &config,
            &candidates(2, &[256]),
            &jobs,
            Arrivals::Poisson { rate: 1.0 },
            &settings,
            &mut |_| {},
        )
        .unwrap();
        assert_eq!(results.len(), 3);
        for r in &results {
            assert!(r.max_rate > 0.0, "{r:?}");
            assert_eq!(r.replicas, 4 / r.candidate.devices());
            // The rate found meets the target; the next one tried above it does not.
            let at = r.curve.iter().find(|p| p.rate == r.max_rate).unwrap();
            assert!(at.attainment >= 0.9);
        }
        let winner = best(&results, Objective::PerDevice).unwrap();
        let top = results
            .iter()
            .map(|r| r.goodput_per_device)
            .fold(0.0, f64::max);
        assert_eq!(winner.goodput_per_device, top);
        let err = run_at(
            &profile,
            &config,
            &jobs,
            Arrivals::Closed { concurrency: 1 },
            1.0,
            1,
        )
        .unwrap_err();
        assert!(err.to_string().contains("--rate"), "{err}");
    }
}
