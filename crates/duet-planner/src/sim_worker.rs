//! A simulated worker: the engine's real scheduler over a real KV block pool (`duet-engine`'s
//! `Scheduler`, `duet-kv`'s `KvCacheManager`), driven by the simulator's clock instead of a
//! model, plus what its stats report and what the router counts on it; and the machines
//! workers run on, which decide how fast a step goes when workers share cores.

use std::collections::VecDeque;
use std::time::Duration;

use duet_engine::scheduler::{PlannedSeq, Scheduler};
use duet_kv::{KvCacheManager, SeqId};
use duet_worker::stats::PrefillRate;

use crate::profile::StepShape;

/// The model fingerprint every simulated worker's pool hashes with (one model per cluster).
pub const SIM_FINGERPRINT: &str = "duet-simulated-model";

/// How long a planned prompt counts on a worker after a poll that began this long after it
/// (the router's `PLAN_REPORT_GRACE`).
pub const PLAN_REPORT_GRACE_S: f64 = 0.25;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Prefill,
    Decode,
}

/// What a worker's engine thread takes at its next turn (between steps).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    /// A decode worker takes a routed request: reserves KV for it, or prefills it itself.
    Admit(usize),
    /// A decode worker binds the request's reservation to a prefill worker and hands it the
    /// prompt, or prefills it itself (the decode worker's second call on its engine thread).
    Bind(usize),
    /// A prefill worker takes a prompt to compute.
    Submit(usize),
    /// A push's last KV writes land in the decode worker's reservation (the receiver writes at
    /// its engine thread's turn): the push is acknowledged.
    Land(usize),
    /// A decode worker's reservation is filled: the request decodes from its first token.
    Activate(usize),
}

/// A planned step, running or waiting for its machine.
pub struct Step {
    pub plan: Vec<PlannedSeq>,
    /// Milliseconds it takes with the machine to itself.
    pub work_ms: f64,
    /// Milliseconds of `work_ms` still to do (shared machines).
    pub remaining_ms: f64,
    /// How much slower it runs while served workers fill every core
    /// ([`crate::profile::Profile::contended_factor`]).
    pub contended_factor: f64,
    /// When it got the machine.
    pub started: Option<f64>,
    /// Prompt tokens it computes (what the worker's measured prefill rate counts).
    pub prompt_tokens: usize,
}

/// What the worker's last `Stats` said, as the router's snapshot of it reads it.
#[derive(Clone, Copy, Debug, Default)]
pub struct Reported {
    pub free_blocks: u32,
    pub running: u32,
    pub queued_tokens: u64,
    pub prefill_rate: f64,
    /// When the reported rate last changed.
    pub rate_since: f64,
}

pub struct SimWorker {
    pub role: Role,
    pub scheduler: Scheduler,
    pub machine: usize,
    pub inbox: Vec<Command>,
    /// Its engine thread is busy with a turn or a step's end: commands wait in the inbox.
    pub in_turn: bool,
    pub step: Option<Step>,
    /// The last step's plan, whose rows the next plan reuses (see `Scheduler::plan_step_into`).
    pub spare_plan: Vec<PlannedSeq>,
    /// Bumped whenever the step's end moves, so an outdated end event is ignored.
    pub epoch: u64,
    /// Sequences admitted and not yet removed.
    pub sequences: u32,
    /// Prompt tokens admitted and not yet computed.
    pub queued_tokens: u64,
    pub prefill_rate: PrefillRate,
    pub reported: Reported,
    /// The router's view: prompts it planned here not yet reported, `(ticket, at, tokens)`.
    pub planned: VecDeque<(u64, f64, u64)>,
    /// The router's view: requests it has on this worker.
    pub in_flight: u32,
}

impl SimWorker {
    pub fn new(
        role: Role,
        machine: usize,
        kv_blocks: usize,
        block_size: usize,
        max_step_tokens: usize,
    ) -> Self {
        let kv = KvCacheManager::new(kv_blocks, block_size, SIM_FINGERPRINT);
        Self {
            role,
            // Drafts are not simulated: no step reaches past its decode rows by drafting, so
            // no draft token is checked against a vocabulary.
            scheduler: Scheduler::new(kv, max_step_tokens, 0, usize::MAX).without_block_tables(),
            machine,
            inbox: Vec::new(),
            in_turn: false,
            step: None,
            spare_plan: Vec::new(),
            epoch: 0,
            sequences: 0,
            queued_tokens: 0,
            prefill_rate: PrefillRate::default(),
            reported: Reported::default(),
            planned: VecDeque::new(),
            in_flight: 0,
        }
    }

    /// Prompt tokens the router counts as queued here: reported, plus planned since.
    pub fn router_queued_tokens(&self) -> u64 {
        self.reported.queued_tokens + self.planned.iter().map(|&(_, _, t)| t).sum::<u64>()
    }

    /// Answers a stats poll begun at `now`: the router takes the report, and forgets the
    /// prompts it planned before the poll (less the grace), which the report counts.
    pub fn poll(&mut self, now: f64) {
        let rate = self.prefill_rate.tokens_per_s();
        if rate != self.reported.prefill_rate {
            self.reported.rate_since = now;
        }
        self.reported = Reported {
            free_blocks: self.scheduler.kv_cache().pool().available() as u32,
            running: self.sequences,
            queued_tokens: self.queued_tokens,
            prefill_rate: rate,
            rate_since: self.reported.rate_since,
        };
        let reported = now - PLAN_REPORT_GRACE_S;
        while self
            .planned
            .front()
            .is_some_and(|&(_, at, _)| at < reported)
        {
            self.planned.pop_front();
        }
    }

    /// Drops a planned prompt (its first token came).
    pub fn unplan(&mut self, ticket: u64) {
        self.planned.retain(|&(t, _, _)| t != ticket);
    }

    /// The prompt tokens `record` measured for a step that took `took_s`.
    pub fn measured(&mut self, prompt_tokens: usize, took_s: f64) {
        self.prefill_rate
            .measured(prompt_tokens, Duration::from_secs_f64(took_s.max(0.0)));
    }
}

/// What a step costs: its shape from the plan. A row of one token at the end of a sequence is a
/// decode row; any other planned run of tokens is a prompt chunk (a prompt's last single token
/// costs what a decode row does). `prompt_left(seq)` says how many of a sequence's tokens are
/// still prompt (to count the step's prompt tokens).
pub fn step_shape(
    plan: &[PlannedSeq],
    mut prompt_left: impl FnMut(SeqId) -> usize,
) -> (StepShape, usize) {
    let mut shape = StepShape::default();
    let mut prompt_tokens = 0;
    for p in plan {
        prompt_tokens += p.len.min(prompt_left(p.seq));
        if p.len == 1 {
            shape.row(p.start_pos + 1);
        } else {
            shape.chunk(p.start_pos, p.len);
        }
    }
    (shape, prompt_tokens)
}

/// How the workers of one machine share it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Sharing {
    /// Every worker has a device of its own (a GPU each): a step takes its profiled time.
    Dedicated,
    /// The workers run in one process on one kernel thread pool, which runs one forward step at
    /// a time, first come first served: a step waits for the steps before it.
    TakeTurns,
    /// The workers are processes with `threads` kernel threads each on `cores` cores: while
    /// more threads compute than there are cores, every running step slows down in proportion
    /// (processor sharing; memory bandwidth is taken to share the same way). While two or more
    /// workers' steps fill the cores, each also runs its profiled contention factor slower: the
    /// threads serving them (RPC, KV pushes, token streams) find no idle core.
    Cores { cores: usize, threads: usize },
}

/// A machine and the steps running on it.
pub struct Machine {
    pub sharing: Sharing,
    /// Workers whose step holds (a share of) the machine.
    pub running: Vec<usize>,
    /// Workers whose planned step waits for the machine (take-turns).
    pub waiting: VecDeque<usize>,
    /// When the running steps' remaining work was last brought up to date (processor sharing).
    pub updated: f64,
}

impl Machine {
    pub fn new(sharing: Sharing) -> Self {
        Self {
            sharing,
            running: Vec::new(),
            waiting: VecDeque::new(),
            updated: 0.0,
        }
    }

    /// How fast each running step goes, as a share of its speed alone, before contention.
    pub fn speed(&self) -> f64 {
        match self.sharing {
            Sharing::Cores { cores, threads } => {
                let demand = (threads * self.running.len()).max(1);
                (cores as f64 / demand as f64).min(1.0)
            }
            Sharing::Dedicated | Sharing::TakeTurns => 1.0,
        }
    }

    /// Whether the running steps are served workers' that fill every core, so that each runs
    /// its [`Step::contended_factor`] slower.
    pub fn contended(&self) -> bool {
        match self.sharing {
            Sharing::Cores { cores, threads } => {
                self.running.len() >= 2 && threads * self.running.len() >= cores
            }
            Sharing::Dedicated | Sharing::TakeTurns => false,
        }
    }

    /// How fast `step` goes now, as a share of its speed alone.
    pub fn step_speed(&self, step: &Step) -> f64 {
        match self.contended() {
            true => self.speed() / step.contended_factor,
            false => self.speed(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_is_costed_as_chunks_and_rows() {
        let mut s = Scheduler::new(
            KvCacheManager::new(64, 16, SIM_FINGERPRINT),
            64,
            0,
            usize::MAX,
        );
        s.add_sequence(0, (0..40).collect(), "").unwrap();
        s.add_sequence(1, (100..104).collect(), "").unwrap();
        let plan = s.plan_step(&mut |_, _| Vec::new()).unwrap();
        let (shape, prompt) = step_shape(&plan, |_| usize::MAX);
        assert_eq!(prompt, 44);
        assert_eq!((shape.prefill_tokens, shape.decode_rows), (44.0, 0));
        assert_eq!(shape.prefill_attention, 40.0 * 40.0 + 4.0 * 4.0);
        for p in &plan {
            s.record_computed(p).unwrap();
            s.append_token(p.seq, 1).unwrap();
        }
        let plan = s.plan_step(&mut |_, _| Vec::new()).unwrap();
        let (shape, prompt) = step_shape(&plan, |_| 0);
        assert_eq!(
            (shape.decode_rows, shape.decode_context, prompt),
            (2, 41.0 + 5.0, 0)
        );
    }

    #[test]
    fn shared_cores_slow_steps_only_past_the_cores() {
        let mut m = Machine::new(Sharing::Cores {
            cores: 2,
            threads: 1,
        });
        m.running = vec![0, 1];
        assert_eq!(m.speed(), 1.0);
        m.running.push(2);
        assert!((m.speed() - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!(Machine::new(Sharing::TakeTurns).speed(), 1.0);
    }

    #[test]
    fn steps_slow_by_their_contention_only_while_workers_fill_the_cores() {
        let step = Step {
            plan: Vec::new(),
            work_ms: 10.0,
            remaining_ms: 10.0,
            contended_factor: 1.25,
            started: None,
            prompt_tokens: 0,
        };
        let mut m = Machine::new(Sharing::Cores {
            cores: 4,
            threads: 1,
        });
        // One worker alone, or two on four cores: a core is left for what serves them.
        m.running = vec![0];
        assert_eq!(m.step_speed(&step), 1.0);
        m.running = vec![0, 1];
        assert_eq!(m.step_speed(&step), 1.0);
        // Two workers of two threads on four cores fill them.
        m.sharing = Sharing::Cores {
            cores: 4,
            threads: 2,
        };
        assert!((m.step_speed(&step) - 0.8).abs() < 1e-12);
        // Past the cores, the share and the contention both.
        m.running.push(2);
        assert!((m.step_speed(&step) - 4.0 / 6.0 / 1.25).abs() < 1e-12);
        // A single worker whose threads fill the cores is the profile's own case.
        m.running = vec![0];
        assert_eq!(m.step_speed(&step), 1.0);
        m.sharing = Sharing::TakeTurns;
        m.running = vec![0, 1];
        assert_eq!(m.step_speed(&step), 1.0);
    }
}
