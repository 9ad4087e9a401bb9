//! Re-planning by simulation: the live workload (requests drawn from the observed lengths,
//! arriving as a Poisson process at the planned rate, after the requests waiting now) replayed
//! on the simulator (`duet_planner::simulator`: the router's real policy and the engine's real
//! scheduler, timed by the profile) for each prefill:decode split.

use duet_planner::PlannerError;
use duet_planner::arrivals::{ArrivalClock, Arrivals};
use duet_planner::profile::Profile;
use duet_planner::search::{self, RatePoint};
use duet_planner::simulator::{Design, SimConfig, simulate};
use duet_planner::workload::Job;

use crate::decide::{Prediction, Split};

/// What times the simulated cluster: the profile, and the cluster's settings (engine, router,
/// sharing, transport and SLOs; the pools are each split's).
#[derive(Clone, Debug)]
pub struct Model {
    pub profile: Profile,
    pub sim: SimConfig,
}

/// The load to plan for.
#[derive(Clone, Debug)]
pub struct LiveLoad {
    /// Requests per second.
    pub rate: f64,
    /// The requests replayed (lengths drawn from the live ones).
    pub jobs: Vec<Job>,
    /// Requests waiting in the workers' queues now: they arrive at the simulation's start.
    pub backlog: usize,
    pub seed: u64,
}

impl LiveLoad {
    /// The same requests at `rate`.
    pub fn at_rate(&self, rate: f64) -> LiveLoad {
        LiveLoad {
            rate,
            ..self.clone()
        }
    }
}

impl Model {
    /// The simulated outcome of `split` serving `load`.
    pub fn predict(&self, split: Split, load: &LiveLoad) -> Result<Prediction, PlannerError> {
        let config = SimConfig {
            design: Design::Disaggregated,
            prefill_workers: split.prefill,
            decode_workers: split.decode,
            ..self.sim.clone()
        };
        let mut clock = ArrivalClock::new(Arrivals::Poisson { rate: load.rate }, load.seed);
        let mut jobs = load.jobs.iter().enumerate().map(|(i, job)| {
            let at = match i < load.backlog {
                true => 0.0,
                false => clock.next(None).expect("an open loop's clock gives times"),
            };
            Ok::<_, PlannerError>(Job {
                at: Some(std::time::Duration::from_secs_f64(at)),
                ..job.clone()
            })
        });
        let result = simulate(
            &self.profile,
            &config,
            &mut jobs,
            Arrivals::Trace { speedup: 1.0 },
            load.seed,
            &mut |_| {},
        )?;
        let s = &result.summary;
        Ok(Prediction {
            split,
            attainment: s.slo_attainment,
            max_rate: None,
            ttft_p90_ms: s.ttft_ms.p90,
            tpot_p90_ms: s.tpot_ms.p90,
            queue_p90_ms: s.server_ttft_ms.queue_ms.p90,
            kv_transfer_mean_ms: s.server_ttft_ms.transfer_ms.mean,
        })
    }

    /// Every split of `workers` workers with a prefill count in `prefill` (and a decode
    /// worker), simulated at `load`.
    pub fn predict_splits(
        &self,
        workers: usize,
        prefill: impl Iterator<Item = usize>,
        load: &LiveLoad,
    ) -> Result<Vec<Prediction>, PlannerError> {
        prefill
            .filter(|&p| p < workers)
            .map(|p| {
                let split = Split {
                    prefill: p,
                    decode: workers - p,
                };
                self.predict(split, load)
            })
            .collect()
    }

    /// Fills in the goodput of every prediction of `load` meeting `target`: the highest rate of
    /// the same requests at which the split still does (doubled from the load's rate, then
    /// bisected: within 1/16 of the bracket). A search that cannot end (too few requests to
    /// load the split) leaves it unknown.
    pub fn with_goodput(
        &self,
        predictions: &mut [Prediction],
        load: &LiveLoad,
        target: f64,
    ) -> Result<(), PlannerError> {
        for p in predictions.iter_mut().filter(|p| p.attainment >= target) {
            let mut eval = |rate: f64| {
                let at = self.predict(p.split, &load.at_rate(rate))?;
                Ok(RatePoint {
                    rate,
                    attainment: at.attainment,
                    ttft_p90_ms: at.ttft_p90_ms,
                    tpot_p90_ms: at.tpot_p90_ms,
                })
            };
            p.max_rate = match search::max_rate(&mut eval, target, load.rate, 4) {
                Ok((rate, _)) => Some(rate),
                Err(PlannerError::Invalid(_)) => None,
                Err(e) => return Err(e),
            };
        }
        Ok(())
    }

    /// The best split of `workers` at `load` (the most attainment; the fewest prefill workers
    /// among equals).
    pub fn best_split(&self, workers: usize, load: &LiveLoad) -> Result<Prediction, PlannerError> {
        let all = self.predict_splits(workers, 0..workers, load)?;
        Ok(all
            .into_iter()
            .reduce(|best, p| {
                if p.attainment > best.attainment {
                    p
                } else {
                    best
                }
            })
            .expect("a worker count of at least 1"))
    }

    /// This model with the KV transport's times scaled so that the simulation of the live
    /// split shows the KV transfer time the router observed (`observed_ms` against the
    /// simulated `predicted_ms`, both means per transferred request); unchanged when they
    /// agree within 20% or either is unknown. The factor is kept within [0.1, 10]: beyond,
    /// the profile is not for this cluster.
    pub fn calibrated_transfer(&self, observed_ms: Option<f64>, predicted_ms: f64) -> (Model, f64) {
        let factor = match observed_ms {
            Some(o) if o > 0.0 && predicted_ms > 0.0 => (o / predicted_ms).clamp(0.1, 10.0),
            _ => 1.0,
        };
        if (factor - 1.0).abs() <= 0.2 {
            return (self.clone(), 1.0);
        }
        let mut model = self.clone();
        for t in &mut model.profile.transfer {
            if t.transport == model.sim.transport {
                t.fit.a_ms *= factor;
                t.fit.ms_per_mib *= factor;
            }
        }
        (model, factor)
    }
}

#[cfg(test)]
mod tests {
    use duet_planner::report::Slo;
    use duet_planner::testing::{config, synthetic};
    use duet_planner::workload::{Range, random_jobs};

    use super::*;

    pub(crate) fn model(ttft_ms: f64, tpot_ms: f64) -> Model {
        Model {
            profile: synthetic(),
            sim: SimConfig {
                kv_cache_tokens: 64 * 1024,
                slo: Slo { ttft_ms, tpot_ms },
                ..config(Design::Disaggregated, 1, 1)
            },
        }
    }

    /// Long prompts, short answers, a tight TPOT: prompt chunks on a decode worker stall its
    /// decoding, so a prefill worker beside one decode worker serves better than two decode
    /// workers prefilling their own prompts; and more load needs more workers.
    #[test]
    fn long_prompts_under_a_tight_tpot_want_a_prefill_worker() {
        let m = model(5000.0, 8.0);
        let jobs: Vec<Job> = random_jobs(
            1,
            300,
            Range { min: 600, max: 800 },
            Range { min: 16, max: 24 },
        )
        .collect();
        let load = LiveLoad {
            rate: 6.0,
            jobs,
            backlog: 0,
            seed: 1,
        };
        let splits = m.predict_splits(2, 0..2, &load).unwrap();
        assert_eq!(splits.len(), 2);
        let (colocated, disaggregated) = (splits[0], splits[1]);
        assert_eq!(
            disaggregated.split,
            Split {
                prefill: 1,
                decode: 1
            }
        );
        assert!(
            disaggregated.attainment > colocated.attainment + 0.1,
            "{colocated:?} {disaggregated:?}"
        );
        assert_eq!(m.best_split(2, &load).unwrap().split, disaggregated.split);
        // A backlog waiting now is served first: it raises the queue wait.
        let backlog = LiveLoad {
            backlog: 100,
            ..load.clone()
        };
        let later = m.predict(disaggregated.split, &backlog).unwrap();
        assert!(later.queue_p90_ms > disaggregated.queue_p90_ms, "{later:?}");
    }

    #[test]
    fn the_transfer_fit_is_scaled_to_the_observed_transfer_time() {
        let m = model(1000.0, 100.0);
        let (same, factor) = m.calibrated_transfer(Some(1.1), 1.0);
        assert_eq!((factor, &same.profile), (1.0, &m.profile));
        let (slower, factor) = m.calibrated_transfer(Some(3.0), 1.0);
        assert_eq!(factor, 3.0);
        let fit = slower.profile.transfer("grpc").unwrap();
        assert_eq!((fit.a_ms, fit.ms_per_mib), (3.0, 6.0));
        assert_eq!(m.calibrated_transfer(None, 1.0).1, 1.0);
        assert_eq!(m.calibrated_transfer(Some(500.0), 1.0).1, 10.0);
    }
}
