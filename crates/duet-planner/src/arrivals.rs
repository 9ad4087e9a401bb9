//! When requests arrive: an open-loop process (Poisson, gamma with a coefficient of variation,
//! a sinusoidal rate), a trace's own timestamps, or a closed loop (a fixed number of clients,
//! each sending its next request when the last one ends). `duet bench serve` sends at these
//! times and `duet simulate` simulates them, so one seed gives both the same arrivals.

use rand::SeedableRng;
use rand::rngs::SmallRng;
use rand_distr::{Distribution, Exp, Gamma};
use serde::Serialize;

use crate::PlannerError;

/// How requests arrive.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Arrivals {
    /// `concurrency` clients, each sending its next request as soon as its last one ended.
    Closed { concurrency: usize },
    /// A Poisson process of `rate` requests per second.
    Poisson { rate: f64 },
    /// Gamma-distributed gaps of mean 1/`rate` and coefficient of variation `cv` (1: Poisson;
    /// above 1: bursty, as production traces are).
    Gamma { rate: f64, cv: f64 },
    /// A Poisson process whose rate swings as `rate · (1 + amplitude · sin(2πt / period_s))`.
    Sinusoidal {
        rate: f64,
        amplitude: f64,
        period_s: f64,
    },
    /// Each request at its trace timestamp, divided by `speedup`.
    Trace { speedup: f64 },
}

impl Arrivals {
    /// Refuses a rate, CV, amplitude, period or speedup that cannot describe arrivals, naming
    /// the flag.
    pub fn check(&self) -> Result<(), PlannerError> {
        let positive = |v: f64, flag: &str| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(PlannerError::Invalid(format!(
                    "{flag} must be a positive number, not {v}"
                )))
            }
        };
        match *self {
            Arrivals::Closed { concurrency: 0 } => Err(PlannerError::Invalid(
                "--concurrency must be at least 1".into(),
            )),
            Arrivals::Closed { .. } => Ok(()),
            Arrivals::Poisson { rate } => positive(rate, "--rate"),
            Arrivals::Gamma { rate, cv } => {
                positive(rate, "--rate")?;
                positive(cv, "--arrival-cv")
            }
            Arrivals::Sinusoidal {
                rate,
                amplitude,
                period_s,
            } => {
                positive(rate, "--rate")?;
                positive(period_s, "--rate-period-s")?;
                if !(0.0..=1.0).contains(&amplitude) {
                    return Err(PlannerError::Invalid(format!(
                        "--rate-amplitude must be within [0, 1], not {amplitude}"
                    )));
                }
                Ok(())
            }
            Arrivals::Trace { speedup } => positive(speedup, "--trace-speedup"),
        }
    }

    /// The mean offered rate in requests per second (`None`: a closed loop or a trace, whose
    /// rate the requests themselves set).
    pub fn mean_rate(&self) -> Option<f64> {
        match *self {
            Arrivals::Poisson { rate }
            | Arrivals::Gamma { rate, .. }
            | Arrivals::Sinusoidal { rate, .. } => Some(rate),
            Arrivals::Closed { .. } | Arrivals::Trace { .. } => None,
        }
    }

    /// The same process at another mean rate (what a search over rates varies).
    pub fn at_rate(self, new: f64) -> Arrivals {
        match self {
            Arrivals::Poisson { .. } => Arrivals::Poisson { rate: new },
            Arrivals::Gamma { cv, .. } => Arrivals::Gamma { rate: new, cv },
            Arrivals::Sinusoidal {
                amplitude,
                period_s,
                ..
            } => Arrivals::Sinusoidal {
                rate: new,
                amplitude,
                period_s,
            },
            other => other,
        }
    }
}

/// The arrival times of an open-loop process, in seconds from the start, in order.
pub struct ArrivalClock {
    arrivals: Arrivals,
    rng: SmallRng,
    now: f64,
}

impl ArrivalClock {
    /// The clock of `arrivals` (checked), drawn from `seed`.
    pub fn new(arrivals: Arrivals, seed: u64) -> Self {
        Self {
            arrivals,
            rng: SmallRng::seed_from_u64(seed ^ 0xA5A5_A5A5),
            now: 0.0,
        }
    }

    /// The next arrival: `trace_at` is the request's trace timestamp in seconds (used by
    /// [`Arrivals::Trace`]). `None` for a closed loop, whose requests wait for each other.
    pub fn next(&mut self, trace_at: Option<f64>) -> Option<f64> {
        self.now = match self.arrivals {
            Arrivals::Closed { .. } => return None,
            Arrivals::Trace { speedup } => trace_at.unwrap_or(self.now * speedup) / speedup,
            Arrivals::Poisson { rate } => {
                let exp = Exp::new(rate).expect("a checked rate");
                self.now + exp.sample(&mut self.rng)
            }
            Arrivals::Gamma { rate, cv } => {
                // Shape 1/cv² and scale cv²/rate: mean 1/rate, standard deviation cv/rate.
                let shape = 1.0 / (cv * cv);
                let gamma = Gamma::new(shape, 1.0 / (rate * shape)).expect("a checked cv");
                self.now + gamma.sample(&mut self.rng)
            }
            Arrivals::Sinusoidal {
                rate,
                amplitude,
                period_s,
            } => {
                // Thinning (Lewis and Shedler): candidates at the peak rate, each kept with
                // the rate at its time over the peak.
                let peak = rate * (1.0 + amplitude);
                let exp = Exp::new(peak).expect("a checked rate");
                let mut t = self.now;
                loop {
                    t += exp.sample(&mut self.rng);
                    let at =
                        rate * (1.0 + amplitude * (std::f64::consts::TAU * t / period_s).sin());
                    if rand::Rng::random::<f64>(&mut self.rng) * peak <= at {
                        break t;
                    }
                }
            }
        };
        Some(self.now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gaps(arrivals: Arrivals, n: usize) -> Vec<f64> {
        let mut clock = ArrivalClock::new(arrivals, 7);
        let times: Vec<f64> = (0..n).map(|_| clock.next(None).unwrap()).collect();
        times.windows(2).map(|w| w[1] - w[0]).collect()
    }

    fn mean_and_cv(v: &[f64]) -> (f64, f64) {
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v.len() as f64;
        (mean, var.sqrt() / mean)
    }

    #[test]
    fn poisson_and_gamma_gaps_have_their_mean_and_cv() {
        let (mean, cv) = mean_and_cv(&gaps(Arrivals::Poisson { rate: 4.0 }, 40_000));
        assert!(
            (mean - 0.25).abs() < 0.01 && (cv - 1.0).abs() < 0.03,
            "{mean} {cv}"
        );
        let (mean, cv) = mean_and_cv(&gaps(Arrivals::Gamma { rate: 4.0, cv: 3.0 }, 40_000));
        assert!(
            (mean - 0.25).abs() < 0.02 && (cv - 3.0).abs() < 0.2,
            "{mean} {cv}"
        );
    }

    #[test]
    fn a_sinusoidal_rate_peaks_and_troughs_where_it_should() {
        let period = 100.0;
        let arrivals = Arrivals::Sinusoidal {
            rate: 20.0,
            amplitude: 0.9,
            period_s: period,
        };
        let mut clock = ArrivalClock::new(arrivals, 3);
        // Counts in the quarter around the peak (t ≈ 25 s) and the trough (t ≈ 75 s).
        let (mut peak, mut trough) = (0, 0);
        loop {
            let t = clock.next(None).unwrap();
            if t > 10.0 * period {
                break;
            }
            match t % period {
                x if (12.5..37.5).contains(&x) => peak += 1,
                x if (62.5..87.5).contains(&x) => trough += 1,
                _ => {}
            }
        }
        // ∫ over each quarter: 25·20·(1 ± 0.9·0.9) per period.
        assert!((peak as f64 / 10.0 - 905.0).abs() < 60.0, "{peak}");
        assert!((trough as f64 / 10.0 - 95.0).abs() < 25.0, "{trough}");
    }

    #[test]
    fn a_trace_keeps_its_timestamps_sped_up_and_bad_settings_name_their_flag() {
        let mut clock = ArrivalClock::new(Arrivals::Trace { speedup: 2.0 }, 0);
        assert_eq!(clock.next(Some(3.0)), Some(1.5));
        let mut closed = ArrivalClock::new(Arrivals::Closed { concurrency: 2 }, 0);
        assert_eq!(closed.next(None), None);
        let err = Arrivals::Gamma { rate: 1.0, cv: 0.0 }.check().unwrap_err();
        assert!(err.to_string().contains("--arrival-cv"), "{err}");
        let err = Arrivals::Poisson { rate: f64::NAN }.check().unwrap_err();
        assert!(err.to_string().contains("--rate"), "{err}");
    }
}
