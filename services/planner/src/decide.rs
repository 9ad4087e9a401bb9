//! The planner's decisions, as pure functions of what it observed and what it simulated (no
//! clocks, channels or tasks; the loop in [`crate::service`] gathers their inputs and acts on
//! their answers):
//!
//! - [`burst`]: whether the live arrival rate jumped past what the plan was sized for, so that
//!   the planner re-plans at once rather than at the end of its period;
//! - [`reachable`] and [`choose_split`]: which prefill:decode split of the live workers to move
//!   to (the one serving the most within the SLOs; where several meet them, the one with the
//!   most goodput, ready for more load), with hysteresis;
//! - [`next_switch`]: which worker to switch (one at a time, never the last of a role that has
//!   traffic);
//! - [`desired_replicas`]: how many workers of each role the load needs.

use std::ops::RangeInclusive;

use duet_cluster::Role;
use serde::Serialize;

/// Workers serving each role.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Split {
    pub prefill: usize,
    pub decode: usize,
}

impl Split {
    pub fn workers(&self) -> usize {
        self.prefill + self.decode
    }
}

impl std::fmt::Display for Split {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}P+{}D", self.prefill, self.decode)
    }
}

/// A live worker, as its card and its `Stats` tell.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct WorkerView {
    pub id: String,
    pub address: String,
    pub role: Role,
    /// Whether its role can switch (`--role-switch on`).
    pub role_switch: bool,
    /// Requests it holds: running and waiting (what a switch waits for when it drains).
    pub load: u32,
}

/// The split the workers serve now.
pub fn live_split(workers: &[WorkerView]) -> Split {
    let prefill = workers.iter().filter(|w| w.role == Role::Prefill).count();
    Split {
        prefill,
        decode: workers.len() - prefill,
    }
}

/// A split's simulated outcome at the planned load.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Prediction {
    pub split: Split,
    /// Share of requests within both SLOs.
    pub attainment: f64,
    /// Its goodput: the highest rate of the same requests at which it still meets the
    /// attainment target (DistServe's search); simulated only for splits that meet it at the
    /// planned load.
    pub max_rate: Option<f64>,
    pub ttft_p90_ms: f64,
    pub tpot_p90_ms: f64,
    /// The time to first token's queue part (routing, reservation and the prefill queue).
    pub queue_p90_ms: f64,
    pub kv_transfer_mean_ms: f64,
}

/// Whether the arrival rate over the burst window (`rate`, from `requests` requests) is a
/// burst: at least `min_requests` requests (a few requests in a short window are noise), and
/// more than `factor` times the rate the plan was sized for (`sized_for`; none yet: any load
/// is a burst, so the first plan comes as soon as requests do).
pub fn burst(
    sized_for: Option<f64>,
    rate: f64,
    requests: f64,
    factor: f64,
    min_requests: f64,
) -> bool {
    requests >= min_requests && sized_for.is_none_or(|sized| rate > factor * sized)
}

/// The prefill counts the live workers can reach by switching roles: workers whose role
/// cannot switch keep theirs, and one decode worker always stays.
pub fn reachable(workers: &[WorkerView]) -> RangeInclusive<usize> {
    let fixed = |role| {
        workers
            .iter()
            .filter(|w| !w.role_switch && w.role == role)
            .count()
    };
    let (fixed_prefill, fixed_decode) = (fixed(Role::Prefill), fixed(Role::Decode));
    let switchable = workers.iter().filter(|w| w.role_switch).count();
    let keep_one_decode = usize::from(fixed_decode == 0);
    fixed_prefill..=(fixed_prefill + switchable).saturating_sub(keep_one_decode)
}

/// What to do with the live split.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum SplitChoice {
    /// Keep the live split: `reason` says why.
    Stay { reason: String },
    /// Move toward `target`.
    Move { target: Split, reason: String },
}

/// Chooses among `predictions` (the live split's and every reachable one's, at the planned load)
/// the split with the highest attainment, the closest to `current` among equals; moves to it
/// only when its attainment beats the live split's by at least `margin` (hysteresis: a split
/// barely better in one simulation is not worth a drain). Where the live split meets the
/// attainment `target` and its goodput is known, goodput decides ([`choose_by_goodput`]).
pub fn choose_split(
    current: Split,
    predictions: &[Prediction],
    target: f64,
    margin: f64,
) -> SplitChoice {
    let Some(now) = predictions.iter().find(|p| p.split == current) else {
        return SplitChoice::Stay {
            reason: format!("the live split {current} was not simulated"),
        };
    };
    if let Some(live_rate) = now.max_rate.filter(|_| now.attainment >= target) {
        return choose_by_goodput(
            current,
            now.attainment,
            live_rate,
            predictions,
            target,
            margin,
        );
    }
    let best = nearest_best(current, predictions.iter().map(|p| (p, p.attainment)))
        .expect("the live split is among them")
        .0;
    if best.split == current {
        return SplitChoice::Stay {
            reason: format!(
                "{current} is the best split simulated ({:.1}% within the SLOs)",
                now.attainment * 100.0
            ),
        };
    }
    let gain = best.attainment - now.attainment;
    if gain < margin {
        return SplitChoice::Stay {
            reason: format!(
                "{} would serve {:.1}% within the SLOs against {:.1}% now: less than the \
                 switch margin of {:.1} points",
                best.split,
                best.attainment * 100.0,
                now.attainment * 100.0,
                margin * 100.0
            ),
        };
    }
    SplitChoice::Move {
        target: best.split,
        reason: format!(
            "{} would serve {:.1}% within the SLOs against {:.1}% for {current}",
            best.split,
            best.attainment * 100.0,
            now.attainment * 100.0
        ),
    }
}

/// [`choose_split`] where the live split meets the attainment target: a split meeting it too and
/// serving more than `margin` (a share) more at most moves the live workers, so that the next
/// burst finds the split that takes it (a switch at a calm rate drains in moments; one in a burst
/// drains under load).
fn choose_by_goodput(
    current: Split,
    attainment: f64,
    live_rate: f64,
    predictions: &[Prediction],
    target: f64,
    margin: f64,
) -> SplitChoice {
    let meeting = predictions.iter().filter(|p| p.attainment >= target);
    let best = nearest_best(current, meeting.filter_map(|p| Some((p, p.max_rate?))))
        .map(|(p, rate)| (p.split, rate))
        .filter(|&(split, rate)| split != current && rate > live_rate * (1.0 + margin));
    match best {
        Some((split, rate)) => SplitChoice::Move {
            target: split,
            reason: format!(
                "{current} meets the SLOs ({:.1}% within them) up to {live_rate:.2} req/s; {split} \
                 meets them too, up to {rate:.2} req/s",
                attainment * 100.0
            ),
        },
        None => SplitChoice::Stay {
            reason: format!(
                "{current} meets the SLOs ({:.1}% within them) up to {live_rate:.2} req/s, and no \
                 split serves {:.0}% more",
                attainment * 100.0,
                margin * 100.0
            ),
        },
    }
}

/// The prediction with the highest score, the fewest switches from `current` among equals.
fn nearest_best<'a>(
    current: Split,
    scored: impl Iterator<Item = (&'a Prediction, f64)>,
) -> Option<(&'a Prediction, f64)> {
    let distance = |s: Split| s.prefill.abs_diff(current.prefill);
    scored.max_by(|a, b| {
        a.1.total_cmp(&b.1)
            .then(distance(b.0.split).cmp(&distance(a.0.split)))
    })
}

/// One role switch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SwitchStep {
    pub worker: String,
    pub address: String,
    pub from: Role,
    pub to: Role,
}

/// Why no worker can be switched toward the target.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, thiserror::Error)]
pub enum Blocked {
    #[error("no {0} worker's role can switch (start workers with --role-switch on)")]
    NoSwitchable(&'static str),
    #[error("the last {0} worker is not switched while its role has traffic")]
    LastOfRole(&'static str),
}

/// The one switch that moves `workers` (serving `current`) a step toward `target`: from the
/// role with too many workers, the least loaded whose role can switch (its drain is the
/// shortest; ties by id). Never the last decode worker (no request is served without one), nor
/// the last prefill worker while prompts are prefilled remotely (`prefill_traffic`). `None`
/// when the split is the target.
pub fn next_switch(
    workers: &[WorkerView],
    current: Split,
    target: Split,
    prefill_traffic: bool,
) -> Result<Option<SwitchStep>, Blocked> {
    let (from, to) = match target.prefill.cmp(&current.prefill) {
        std::cmp::Ordering::Equal => return Ok(None),
        std::cmp::Ordering::Greater => (Role::Decode, Role::Prefill),
        std::cmp::Ordering::Less => (Role::Prefill, Role::Decode),
    };
    let serving = workers.iter().filter(|w| w.role == from).count();
    let traffic = match from {
        Role::Decode => true,
        Role::Prefill => prefill_traffic,
    };
    if serving <= 1 && traffic {
        return Err(Blocked::LastOfRole(from.as_str()));
    }
    let worker = workers
        .iter()
        .filter(|w| w.role == from && w.role_switch)
        .min_by(|a, b| a.load.cmp(&b.load).then_with(|| a.id.cmp(&b.id)))
        .ok_or(Blocked::NoSwitchable(from.as_str()))?;
    Ok(Some(SwitchStep {
        worker: worker.id.clone(),
        address: worker.address.clone(),
        from,
        to,
    }))
}

/// How many workers the load needs, and the split that serves it best.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Desired {
    pub split: Split,
    /// Whether that split meets the attainment target (false: none within `--max-workers`
    /// does, and the most workers allowed are asked for).
    pub meets: bool,
}

/// The fewest workers within `min..=max` whose best split (`best(n)`, simulated at the rate
/// the pools are sized for) meets `target` attainment, searched from the `live` count: up as
/// far as needed, down one worker at a time (a scale-down a period at a time, each one
/// simulated first).
pub fn desired_replicas<E>(
    live: usize,
    min: usize,
    max: usize,
    target: f64,
    best: &mut dyn FnMut(usize) -> Result<Prediction, E>,
) -> Result<Desired, E> {
    let live = live.clamp(min, max);
    let here = best(live)?;
    if here.attainment >= target {
        if live > min {
            let fewer = best(live - 1)?;
            if fewer.attainment >= target {
                return Ok(Desired {
                    split: fewer.split,
                    meets: true,
                });
            }
        }
        return Ok(Desired {
            split: here.split,
            meets: true,
        });
    }
    let mut last = here;
    for n in live + 1..=max {
        last = best(n)?;
        if last.attainment >= target {
            return Ok(Desired {
                split: last.split,
                meets: true,
            });
        }
    }
    Ok(Desired {
        split: last.split,
        meets: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(id: &str, role: Role, role_switch: bool, load: u32) -> WorkerView {
        WorkerView {
            id: id.into(),
            address: format!("{id}:1"),
            role,
            role_switch,
            load,
        }
    }

    fn split(prefill: usize, decode: usize) -> Split {
        Split { prefill, decode }
    }

    fn predicted(prefill: usize, decode: usize, attainment: f64) -> Prediction {
        Prediction {
            split: split(prefill, decode),
            attainment,
            max_rate: None,
            ttft_p90_ms: 0.0,
            tpot_p90_ms: 0.0,
            queue_p90_ms: 0.0,
            kv_transfer_mean_ms: 0.0,
        }
    }

    #[test]
    fn a_burst_is_a_jump_past_the_sized_rate_with_enough_requests() {
        // No plan yet: the first requests trigger one.
        assert!(burst(None, 0.5, 10.0, 1.5, 10.0));
        assert!(!burst(None, 0.5, 9.0, 1.5, 10.0));
        // Sized for 4 req/s: 6 is not past 1.5×, 6.1 is.
        assert!(!burst(Some(4.0), 6.0, 90.0, 1.5, 10.0));
        assert!(burst(Some(4.0), 6.1, 90.0, 1.5, 10.0));
        // A fast window of few requests is noise.
        assert!(!burst(Some(0.1), 100.0, 3.0, 1.5, 10.0));
    }

    #[test]
    fn switchable_workers_reach_every_split_that_keeps_a_decode_worker() {
        let all_switchable = [
            worker("a", Role::Decode, true, 0),
            worker("b", Role::Decode, true, 0),
            worker("c", Role::Prefill, true, 0),
        ];
        assert_eq!(reachable(&all_switchable), 0..=2);
        let mixed = [
            worker("p", Role::Prefill, false, 0),
            worker("d", Role::Decode, false, 0),
            worker("s", Role::Decode, true, 0),
        ];
        assert_eq!(reachable(&mixed), 1..=2);
        let fixed = [
            worker("p", Role::Prefill, false, 0),
            worker("d", Role::Decode, false, 0),
        ];
        assert_eq!(reachable(&fixed), 1..=1);
    }

    #[test]
    fn the_split_moves_only_past_the_margin_and_to_the_nearest_best() {
        let now = split(0, 4);
        let preds = [
            predicted(0, 4, 0.70),
            predicted(1, 3, 0.95),
            predicted(2, 2, 0.95),
            predicted(3, 1, 0.40),
        ];
        // Two splits tie for the best: the one fewer switches away.
        let SplitChoice::Move { target, reason } = choose_split(now, &preds, 0.9, 0.05) else {
            panic!("should move")
        };
        assert_eq!(target, split(1, 3));
        assert!(
            reason.contains("1P+3D") && reason.contains("70.0%"),
            "{reason}"
        );
        // Hysteresis: 0.72 → 0.75 is within a 5-point margin.
        let close = [predicted(0, 4, 0.72), predicted(1, 3, 0.75)];
        assert!(matches!(
            choose_split(now, &close, 0.9, 0.05),
            SplitChoice::Stay { reason } if reason.contains("margin")
        ));
        // Equal to the best: stay.
        let equal = [predicted(0, 4, 1.0), predicted(1, 3, 1.0)];
        assert!(matches!(
            choose_split(now, &equal, 0.9, 0.05),
            SplitChoice::Stay { .. }
        ));
    }

    #[test]
    fn where_splits_meet_the_slos_the_one_with_the_most_goodput_wins_past_the_margin() {
        let now = split(0, 2);
        let with_rate = |prefill, decode, attainment, rate| Prediction {
            max_rate: Some(rate),
            ..predicted(prefill, decode, attainment)
        };
        // Both meet the SLOs at a calm rate; 1P+1D serves 15% more: ready for the burst.
        let calm = [with_rate(0, 2, 1.0, 4.7), with_rate(1, 1, 1.0, 5.4)];
        let SplitChoice::Move { target, reason } = choose_split(now, &calm, 0.9, 0.05) else {
            panic!("should move")
        };
        assert_eq!(target, split(1, 1));
        assert!(
            reason.contains("4.70") && reason.contains("5.40"),
            "{reason}"
        );
        // 3% more is within the margin; a split missing the SLOs is no candidate, whatever
        // its goodput at a rate it would be sized for.
        let close = [with_rate(0, 2, 1.0, 5.25), with_rate(1, 1, 1.0, 5.4)];
        assert!(matches!(
            choose_split(now, &close, 0.9, 0.05),
            SplitChoice::Stay { reason } if reason.contains("no split serves 5% more")
        ));
        let missing = [with_rate(0, 2, 0.95, 4.7), with_rate(1, 1, 0.85, 9.0)];
        assert!(matches!(
            choose_split(now, &missing, 0.9, 0.05),
            SplitChoice::Stay { .. }
        ));
        // The live split missing the SLOs: attainment decides, as before.
        let burst = [with_rate(0, 2, 0.6, 4.7), with_rate(1, 1, 0.8, 5.4)];
        assert!(matches!(
            choose_split(now, &burst, 0.9, 0.05),
            SplitChoice::Move { target, .. } if target == split(1, 1)
        ));
    }

    #[test]
    fn the_least_loaded_switchable_worker_moves_and_never_the_last_of_a_busy_role() {
        let workers = [
            worker("busy", Role::Decode, true, 5),
            worker("idle", Role::Decode, true, 1),
            worker("fixed", Role::Decode, false, 0),
        ];
        let now = live_split(&workers);
        assert_eq!(now, split(0, 3));
        let step = next_switch(&workers, now, split(1, 2), true)
            .unwrap()
            .unwrap();
        assert_eq!(
            (step.worker.as_str(), step.from, step.to),
            ("idle", Role::Decode, Role::Prefill)
        );
        assert_eq!(next_switch(&workers, now, now, true), Ok(None));

        // The last decode worker: never.
        let one = [
            worker("p", Role::Prefill, true, 0),
            worker("d", Role::Decode, true, 0),
        ];
        assert_eq!(
            next_switch(&one, split(1, 1), split(2, 0), false),
            Err(Blocked::LastOfRole("decode"))
        );
        // The last prefill worker: not while prompts are prefilled remotely; once idle, yes.
        assert_eq!(
            next_switch(&one, split(1, 1), split(0, 2), true),
            Err(Blocked::LastOfRole("prefill"))
        );
        assert_eq!(
            next_switch(&one, split(1, 1), split(0, 2), false)
                .unwrap()
                .map(|s| s.worker),
            Some("p".into())
        );
        // Only workers whose role can switch are switched.
        let fixed = [
            worker("d1", Role::Decode, false, 0),
            worker("d2", Role::Decode, false, 0),
        ];
        assert_eq!(
            next_switch(&fixed, split(0, 2), split(1, 1), true),
            Err(Blocked::NoSwitchable("decode"))
        );
    }

    #[test]
    fn desired_replicas_scale_up_as_far_as_needed_and_down_one_at_a_time() {
        // n workers attain n/4 at the sized rate (best split n/2 prefill): 3 meet 0.75.
        let mut sim = |n: usize| -> Result<Prediction, ()> {
            Ok(predicted(n / 2, n - n / 2, (n as f64 / 4.0).min(1.0)))
        };
        let up = desired_replicas(1, 1, 8, 0.75, &mut sim).unwrap();
        assert_eq!((up.split, up.meets), (split(1, 2), true));
        let down = desired_replicas(6, 1, 8, 0.75, &mut sim).unwrap();
        assert_eq!(down.split.workers(), 5);
        let stay = desired_replicas(3, 1, 8, 0.75, &mut sim).unwrap();
        assert_eq!(stay.split.workers(), 3);
        // Capped: the most allowed, flagged as short of the target.
        let capped = desired_replicas(1, 1, 2, 0.75, &mut sim).unwrap();
        assert_eq!((capped.split.workers(), capped.meets), (2, false));
        // The live count outside the bounds starts from the nearest bound.
        let clamped = desired_replicas(20, 1, 8, 0.75, &mut sim).unwrap();
        assert_eq!(clamped.split.workers(), 7);
    }
}
