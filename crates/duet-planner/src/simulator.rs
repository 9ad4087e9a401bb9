//! The discrete-event simulation of a duet cluster. Its decisions are the real code: the
//! router's policy (`duet_routing::select`) over snapshots of the simulated workers, and each
//! worker's engine scheduler (`duet_engine::scheduler::Scheduler`: admission, chunking,
//! preemption) over a real KV block pool with a real prefix cache. Only time is modelled: a
//! step lasts what the profile's fitted forms say for what the scheduler planned, a KV transfer
//! what the profile's transport fit says beyond the compute it overlapped.
//!
//! A request's path is the real one: the router routes it on snapshots refreshed every stats
//! interval (plus the prompts it planned since, and the prefixes it placed, as the router
//! counts them); the decode worker, at its engine's next turn, reserves the prompt's KV and
//! hands it to the first prefill worker of the plan whose queue takes it (else prefills it
//! itself); the prefill worker computes it in the steps its scheduler plans, and the KV is
//! pushed; the decode worker activates the reservation at its next turn, which streams the first
//! token, and decodes in its scheduler's steps until the request's tokens are out.
//!
//! Workers that share a machine share its time ([`Sharing`]).

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::time::Duration;

use duet_kv::{KvReservation, SeqId};
use duet_routing::{Decision, NoRoute, PolicyParams, PolicyRequest, RoutingPolicy, WorkerSnapshot};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::PlannerError;
use crate::arrivals::{ArrivalClock, Arrivals};
use crate::prefix_index::PrefixIndex;
use crate::profile::{Profile, TransferFit};
use crate::report::{Outcome, ServeSummary, Slo, SummaryBuilder, TtftSplit};
use crate::sim_worker::{
    Command, Machine, Role, SIM_FINGERPRINT, Sharing, SimWorker, Step, step_shape,
};
use crate::workload::{Job, Prompt, synthetic_token};

/// The two designs `duet bench serve` launches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Design {
    /// Router + prefill workers + decode workers.
    Disaggregated,
    /// Router + workers doing both phases (no prefill pool).
    Colocated,
}

/// The cluster simulated.
#[derive(Clone, Debug, PartialEq)]
pub struct SimConfig {
    pub design: Design,
    /// Prefill workers (a colocated cluster has none).
    pub prefill_workers: usize,
    /// Decode workers (a colocated cluster's workers).
    pub decode_workers: usize,
    /// Most tokens a step computes (`--max-step-tokens`).
    pub max_step_tokens: usize,
    /// Each worker's KV cache in tokens (`--kv-cache-tokens`).
    pub kv_cache_tokens: usize,
    pub routing: RouterShape,
    /// A prefill worker's queue limit in prompt tokens (`--prefill-max-queued-tokens`).
    pub prefill_max_queued_tokens: u64,
    pub sharing: Sharing,
    /// The KV transport between prefill and decode workers (a profile's `transfer` entry).
    pub transport: String,
    pub slo: Slo,
    /// Width of the windows of [`ServeSummary::timeline`], in seconds.
    pub timeline_window_s: f64,
    /// Keep every request's outcome ([`SimResult::outcomes`]).
    pub keep_outcomes: bool,
}

/// The router's settings that shape routing (its flags of the same names).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouterShape {
    pub policy: PolicyParams,
    pub stats_interval_s: f64,
    pub pending_prefix_ttl_s: f64,
    pub max_queued_requests: usize,
    pub request_timeout_s: f64,
}

/// A simulated run.
#[derive(Clone, Debug, Serialize)]
pub struct SimResult {
    #[serde(flatten)]
    pub summary: ServeSummary,
    /// Prompt tokens found in a prefix cache ÷ prompt tokens, over served requests.
    pub prefix_hit_rate: f64,
    /// Routing decisions by reason.
    pub decisions: Vec<(String, u64)>,
    /// Prompts a decode worker prefilled itself although its plan named prefill workers (no
    /// room to reserve, or every prefill queue full).
    pub local_prefill_fallbacks: u64,
    /// Sequences preempted (and recomputed) on every worker.
    pub preemptions: u64,
    /// Events processed (what the simulation's own speed is measured in).
    pub events: u64,
    /// Every served request's outcome, when [`SimConfig::keep_outcomes`] asked for them.
    #[serde(skip)]
    pub outcomes: Vec<Outcome>,
}

/// Simulates `jobs` arriving as `arrivals` say on the cluster `config` describes, timed by
/// `profile`. `progress` is told of every 1,024 requests ended.
pub fn simulate(
    profile: &Profile,
    config: &SimConfig,
    jobs: &mut dyn Iterator<Item = Result<Job, PlannerError>>,
    arrivals: Arrivals,
    seed: u64,
    progress: &mut dyn FnMut(u64),
) -> Result<SimResult, PlannerError> {
    check(config)?;
    arrivals.check()?;
    config.slo.check()?;
    let transfer = match config.design {
        Design::Disaggregated if config.prefill_workers > 0 => {
            Some(*profile.transfer(&config.transport)?)
        }
        _ => None,
    };
    let mut sim = Sim::new(profile, config, jobs, arrivals, seed, transfer);
    sim.start()?;
    while let Some(Scheduled { at, event, .. }) = sim.events.pop() {
        sim.now = at;
        sim.processed += 1;
        if !matches!(event, Event::Poll { .. }) {
            sim.pending_changes -= 1;
        }
        match event {
            Event::Arrive => sim.arrive()?,
            Event::StepEnd { worker, epoch } => sim.step_end(worker, epoch)?,
            Event::Transferred { request } => sim.transferred(request),
            Event::Reply { worker, command } => sim.command(worker, command),
            Event::Poll { worker } => sim.poll(worker),
        }
        if sim.ended >= sim.reported + 1024 {
            progress(sim.ended - sim.reported);
            sim.reported = sim.ended;
        }
    }
    progress(sim.ended - sim.reported);
    if sim.live > 0 {
        return Err(PlannerError::Invalid(format!(
            "{} requests never finished: a prompt needs more KV blocks than a worker's cache \
             of {} tokens holds beside the others (raise --kv-cache-tokens)",
            sim.live, config.kv_cache_tokens
        )));
    }
    Ok(sim.result())
}

fn check(c: &SimConfig) -> Result<(), PlannerError> {
    let bad = |why: String| Err(PlannerError::Invalid(why));
    if c.decode_workers == 0 {
        return bad("--decode-workers must be at least 1".into());
    }
    if c.max_step_tokens == 0 {
        return bad("--max-step-tokens must be at least 1".into());
    }
    let positive = |v: f64| v.is_finite() && v > 0.0;
    if !positive(c.routing.stats_interval_s) {
        return bad("--stats-interval-ms must be at least 1".into());
    }
    if !positive(c.timeline_window_s) {
        return bad("--timeline-window-s must be positive".into());
    }
    Ok(())
}

#[derive(Clone, Copy, Debug)]
enum Event {
    Arrive,
    StepEnd {
        worker: usize,
        epoch: u64,
    },
    Transferred {
        request: usize,
    },
    /// An answer reached the task that waited on a worker's engine thread, which sends the
    /// thread its next command: by then the thread has gone on to its next step, if it had one.
    Reply {
        worker: usize,
        command: Command,
    },
    Poll {
        worker: usize,
    },
}

struct Scheduled {
    at: f64,
    /// Tie-break: first scheduled, first processed.
    order: u64,
    event: Event,
}

impl PartialEq for Scheduled {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Scheduled {
    /// Reversed: the heap pops the earliest.
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .at
            .total_cmp(&self.at)
            .then(other.order.cmp(&self.order))
    }
}

/// A request's sequence id in a worker's scheduler: the order it was admitted there, as the
/// engine numbers its sequences (the scheduler plans the oldest first, so admission order is
/// what is fair), above the request's slot (reused, so no order), which the low half keeps.
fn sequence_id(admitted: u64, slot: usize) -> SeqId {
    assert!(
        admitted <= u32::MAX as u64 && slot <= u32::MAX as usize,
        "more than 2^32 sequences admitted or requests in flight: sequence ids would collide"
    );
    admitted << 32 | slot as u64
}

/// The slot of the request a sequence id names.
fn slot_of(seq: SeqId) -> usize {
    (seq & u32::MAX as u64) as usize
}

/// A request in the cluster.
struct Request {
    /// Unique over the run (a slot is reused).
    serial: u64,
    arrival: f64,
    prompt: Vec<u32>,
    max_tokens: u32,
    follow_ups: std::vec::IntoIter<Vec<u32>>,
    decode: usize,
    /// Prefill workers planned (worker indices), best first; empty: local.
    plan: Vec<usize>,
    prefill: Option<usize>,
    reservation: Option<KvReservation>,
    /// The router's planned-tokens ticket, on `planned_on`.
    ticket: u64,
    planned_on: usize,
    /// Its sequence id in the scheduler of the worker computing it now ([`sequence_id`]).
    seq: SeqId,
    /// Prompt tokens still to compute where it is being prefilled.
    prompt_left: usize,
    cached_tokens: usize,
    generated: u32,
    submitted_at: f64,
    scheduled_at: Option<f64>,
    prefilled_at: f64,
    transferred_at: f64,
    first_token: Option<f64>,
    last_token: f64,
}

impl Request {
    /// Its prompt, for the scheduler of the worker that decodes it, with room for its answer
    /// (which the scheduler appends token by token).
    fn decoded_tokens(&self) -> Vec<u32> {
        let mut tokens = Vec::with_capacity(self.prompt.len() + self.max_tokens as usize);
        tokens.extend_from_slice(&self.prompt);
        tokens
    }
}

struct Sim<'a> {
    profile: &'a Profile,
    config: &'a SimConfig,
    jobs: &'a mut dyn Iterator<Item = Result<Job, PlannerError>>,
    clock: ArrivalClock,
    /// A closed loop's clients; `None`: an open loop.
    concurrency: Option<usize>,
    next_job: Option<Job>,
    transfer: Option<TransferFit>,
    now: f64,
    order: u64,
    events: BinaryHeap<Scheduled>,
    /// Events in the queue other than polls: while there are none, nothing can change.
    pending_changes: usize,
    processed: u64,
    workers: Vec<SimWorker>,
    machines: Vec<Machine>,
    /// Worker indices of the prefill pool, then of the decode pool.
    prefill: Vec<usize>,
    decode: Vec<usize>,
    prefill_snapshots: Vec<WorkerSnapshot>,
    decode_snapshots: Vec<WorkerSnapshot>,
    index: PrefixIndex,
    matches: Vec<(u32, usize)>,
    requests: Vec<Option<Request>>,
    free_slots: Vec<usize>,
    serial: u64,
    /// Sequences admitted to the workers' schedulers so far ([`sequence_id`]).
    admitted: u64,
    next_ticket: u64,
    rng: SmallRng,
    block_size: usize,
    hash_seed: u64,
    /// Requests in the cluster (the router's in-flight count).
    in_flight: usize,
    /// Requests and arrivals not yet ended.
    live: u64,
    ended: u64,
    reported: u64,
    last_end: f64,
    summary: SummaryBuilder,
    decisions: [u64; 5],
    fallbacks: u64,
    prompt_tokens: u64,
    cached_tokens: u64,
}

impl<'a> Sim<'a> {
    fn new(
        profile: &'a Profile,
        config: &'a SimConfig,
        jobs: &'a mut dyn Iterator<Item = Result<Job, PlannerError>>,
        arrivals: Arrivals,
        seed: u64,
        transfer: Option<TransferFit>,
    ) -> Self {
        let block_size = profile.kv.block_size;
        let kv_blocks = config.kv_cache_tokens.div_ceil(block_size);
        let prefill_workers = match config.design {
            Design::Disaggregated => config.prefill_workers,
            Design::Colocated => 0,
        };
        let roles = std::iter::repeat_n(Role::Prefill, prefill_workers)
            .chain(std::iter::repeat_n(Role::Decode, config.decode_workers));
        let n = prefill_workers + config.decode_workers;
        let machines: Vec<Machine> = match config.sharing {
            Sharing::Dedicated => (0..n).map(|_| Machine::new(Sharing::Dedicated)).collect(),
            shared => vec![Machine::new(shared)],
        };
        let workers: Vec<SimWorker> = roles
            .enumerate()
            .map(|(i, role)| {
                let machine = i.min(machines.len() - 1);
                SimWorker::new(role, machine, kv_blocks, block_size, config.max_step_tokens)
            })
            .collect();
        let snapshot = |i: usize| WorkerSnapshot {
            id: format!("worker-{i}"),
            address: format!("worker-{i}"),
            healthy: true,
            card: None,
            fingerprint: SIM_FINGERPRINT.into(),
            kv_block_bytes: profile.kv.block_bytes,
            ..Default::default()
        };
        let prefill: Vec<usize> = (0..prefill_workers).collect();
        let decode: Vec<usize> = (prefill_workers..n).collect();
        Self {
            profile,
            config,
            jobs,
            clock: ArrivalClock::new(arrivals, seed),
            concurrency: match arrivals {
                Arrivals::Closed { concurrency } => Some(concurrency),
                _ => None,
            },
            next_job: None,
            transfer,
            now: 0.0,
            order: 0,
            events: BinaryHeap::new(),
            pending_changes: 0,
            processed: 0,
            prefill_snapshots: prefill.iter().map(|&i| snapshot(i)).collect(),
            decode_snapshots: decode.iter().map(|&i| snapshot(i)).collect(),
            workers,
            machines,
            prefill,
            decode,
            index: PrefixIndex::default(),
            matches: Vec::new(),
            requests: Vec::new(),
            free_slots: Vec::new(),
            serial: 0,
            admitted: 0,
            next_ticket: 0,
            rng: SmallRng::seed_from_u64(seed ^ 0x5EED),
            block_size,
            hash_seed: duet_kv::request_hash_seed(SIM_FINGERPRINT, ""),
            in_flight: 0,
            live: 0,
            ended: 0,
            reported: 0,
            last_end: 0.0,
            summary: {
                let mut summary = SummaryBuilder::new(config.timeline_window_s);
                if config.keep_outcomes {
                    summary.keep_outcomes();
                }
                summary
            },
            decisions: [0; 5],
            fallbacks: 0,
            prompt_tokens: 0,
            cached_tokens: 0,
        }
    }

    fn at(&mut self, at: f64, event: Event) {
        self.order += 1;
        if !matches!(event, Event::Poll { .. }) {
            self.pending_changes += 1;
        }
        self.events.push(Scheduled {
            at,
            order: self.order,
            event,
        });
    }

    fn start(&mut self) -> Result<(), PlannerError> {
        // Polls spread over the interval, as independent pollers drift apart.
        let interval = self.config.routing.stats_interval_s;
        let n = self.workers.len();
        for w in 0..n {
            self.workers[w].poll(0.0);
            self.at(
                interval * (w + 1) as f64 / n as f64,
                Event::Poll { worker: w },
            );
        }
        match self.concurrency {
            Some(clients) => {
                for _ in 0..clients {
                    self.live += 1;
                    self.at(0.0, Event::Arrive);
                }
            }
            None => self.schedule_next_arrival()?,
        }
        Ok(())
    }

    /// Open loop: draws the next job and schedules its arrival.
    fn schedule_next_arrival(&mut self) -> Result<(), PlannerError> {
        let Some(job) = self.jobs.next().transpose()? else {
            return Ok(());
        };
        let at = self
            .clock
            .next(job.at.map(|d| d.as_secs_f64()))
            .expect("an open loop's clock gives times");
        self.next_job = Some(job);
        self.live += 1;
        self.at(at, Event::Arrive);
        Ok(())
    }

    fn arrive(&mut self) -> Result<(), PlannerError> {
        let job = match self.concurrency {
            Some(_) => self.jobs.next().transpose()?,
            None => {
                let job = self.next_job.take();
                self.schedule_next_arrival()?;
                job
            }
        };
        let Some(job) = job else {
            // A closed-loop client with no job left.
            self.live -= 1;
            return Ok(());
        };
        let Prompt::Tokens(prompt) = job.prompt else {
            return Err(PlannerError::Invalid(
                "a text prompt cannot be simulated (its tokens are not known): give the dataset \
                 `prompt_tokens` instead of `prompt`"
                    .into(),
            ));
        };
        self.issue(prompt, job.max_tokens, job.follow_ups.into_iter());
        Ok(())
    }

    /// A request (a job's turn) reaches the router now.
    fn issue(
        &mut self,
        prompt: Vec<u32>,
        max_tokens: u32,
        follow_ups: std::vec::IntoIter<Vec<u32>>,
    ) {
        self.serial += 1;
        let request = Request {
            serial: self.serial,
            arrival: self.now,
            prompt,
            max_tokens: max_tokens.max(1),
            follow_ups,
            decode: 0,
            plan: Vec::new(),
            prefill: None,
            reservation: None,
            ticket: 0,
            planned_on: 0,
            seq: 0,
            prompt_left: 0,
            cached_tokens: 0,
            generated: 0,
            submitted_at: 0.0,
            scheduled_at: None,
            prefilled_at: 0.0,
            transferred_at: 0.0,
            first_token: None,
            last_token: 0.0,
        };
        let slot = match self.free_slots.pop() {
            Some(s) => {
                self.requests[s] = Some(request);
                s
            }
            None => {
                self.requests.push(Some(request));
                self.requests.len() - 1
            }
        };
        self.route(slot);
    }

    fn request(&mut self, slot: usize) -> &mut Request {
        self.requests[slot].as_mut().expect("a live request")
    }

    /// The router: admission, the policy over the workers' snapshots, the prompt planned and its
    /// prefix placed on the prefilling worker, and `Decode` sent to the decode worker.
    fn route(&mut self, slot: usize) {
        let routing = self.config.routing;
        if self.in_flight >= routing.max_queued_requests {
            return self.fail(slot, true);
        }
        let now = self.now;
        self.index.expire(now);
        let bs = self.block_size;
        let (hashes, n) = {
            let r = self.requests[slot].as_ref().expect("a live request");
            let hashes = duet_kv::block_hashes(self.hash_seed, &r.prompt, bs);
            (hashes, r.prompt.len())
        };
        let usable = n.saturating_sub(1) / bs;
        let workers = &self.workers;
        self.index.prefix_matches(
            &hashes[..hashes.len().min(usable)],
            now,
            workers.len() as u32,
            |w, hashes| {
                let pool = workers[w as usize].scheduler.kv_cache().pool();
                pool.cached_prefix_len(hashes)
            },
            &mut self.matches,
        );
        self.refresh_snapshots();
        // Workers are numbered prefill pool first, then decode pool.
        let prefill_workers = self.prefill.len();
        for &(w, blocks) in &self.matches {
            let w = w as usize;
            let snapshot = match w < prefill_workers {
                true => &mut self.prefill_snapshots[w],
                false => &mut self.decode_snapshots[w - prefill_workers],
            };
            snapshot.cached_tokens = blocks * bs;
        }
        let ask = PolicyRequest {
            tokens: n,
            block_size: bs,
            fingerprint: Some(SIM_FINGERPRINT),
            exclude: &[],
            deadline_left: Duration::from_secs_f64(routing.request_timeout_s),
            random: self.rng.random(),
        };
        let placed = duet_routing::select(
            &routing.policy,
            &ask,
            &self.decode_snapshots,
            &self.prefill_snapshots,
        );
        let placed = match placed {
            Ok(p) => p,
            Err(e) => {
                if !matches!(e, NoRoute::NoDecodeWorker) {
                    self.decisions[decision_index(Decision::RejectedTtft)] += 1;
                }
                return self.fail(slot, true);
            }
        };
        self.decisions[decision_index(placed.decision)] += 1;
        let decode = self.decode[placed.decode];
        let plan: Vec<usize> = placed.prefill.iter().map(|&i| self.prefill[i]).collect();
        let prefilling = plan.first().copied().unwrap_or(decode);
        self.next_ticket += 1;
        let ticket = self.next_ticket;
        let tokens = (n - placed.predicted_cached_tokens) as u64;
        self.workers[prefilling]
            .planned
            .push_back((ticket, now, tokens));
        if routing.policy.policy == RoutingPolicy::CacheAware && !hashes.is_empty() {
            self.index.record_pending(
                prefilling as u32,
                &hashes,
                now + routing.pending_prefix_ttl_s,
            );
        }
        self.in_flight += 1;
        self.workers[decode].in_flight += 1;
        let r = self.request(slot);
        r.decode = decode;
        r.plan = plan;
        r.ticket = ticket;
        r.planned_on = prefilling;
        self.command(decode, Command::Admit(slot));
    }

    /// Brings every snapshot up to what the router knows now (no prefix overlap yet).
    fn refresh_snapshots(&mut self) {
        let now = self.now;
        let fill = |s: &mut WorkerSnapshot, w: &SimWorker| {
            s.free_blocks = w.reported.free_blocks;
            s.running = w.reported.running;
            s.in_flight = w.in_flight;
            s.queued_tokens = w.router_queued_tokens();
            s.prefill_rate = Some(w.reported.prefill_rate).filter(|&r| r > 0.0);
            s.prefill_rate_age = Duration::from_secs_f64((now - w.reported.rate_since).max(0.0));
            s.cached_tokens = 0;
        };
        for (s, &w) in self.prefill_snapshots.iter_mut().zip(&self.prefill) {
            fill(s, &self.workers[w]);
        }
        for (s, &w) in self.decode_snapshots.iter_mut().zip(&self.decode) {
            fill(s, &self.workers[w]);
        }
    }

    /// Hands `command` to worker `w`'s engine thread: taken at once when it is idle, else at its
    /// next turn.
    fn command(&mut self, w: usize, command: Command) {
        self.workers[w].inbox.push(command);
        if self.workers[w].step.is_none() && !self.workers[w].in_turn {
            self.turn(w);
        }
    }

    /// One turn of worker `w`'s engine thread: every command that arrived, then the next step.
    fn turn(&mut self, w: usize) {
        self.workers[w].in_turn = true;
        self.take_commands(w);
        self.workers[w].in_turn = false;
        self.next_step(w);
    }

    /// Every command in worker `w`'s inbox, including those that taking them sends it.
    fn take_commands(&mut self, w: usize) {
        while !self.workers[w].inbox.is_empty() {
            let commands = std::mem::take(&mut self.workers[w].inbox);
            for c in commands {
                match c {
                    Command::Admit(slot) => self.admit(w, slot),
                    Command::Bind(slot) => self.bind(w, slot),
                    Command::Submit(slot) => self.submit(w, slot),
                    Command::Land(slot) => self.land(w, slot),
                    Command::Activate(slot) => self.activate(w, slot),
                }
            }
        }
    }

    /// Plans worker `w`'s next step, if it has work and is not stepping, and runs it.
    fn next_step(&mut self, w: usize) {
        if self.workers[w].step.is_some() || !self.workers[w].scheduler.has_work() {
            return;
        }
        let worker = &mut self.workers[w];
        let mut plan = std::mem::take(&mut worker.spare_plan);
        // An error leaves the plan empty: everything waits for room that a transfer or a finish
        // will make.
        let _ = worker
            .scheduler
            .plan_step_into(&mut plan, &mut |_, _| Vec::new());
        if plan.is_empty() {
            self.workers[w].spare_plan = plan;
            return;
        }
        let now = self.now;
        for p in &plan {
            let r = self.requests[slot_of(p.seq)]
                .as_mut()
                .expect("a planned request");
            if r.scheduled_at.is_none() && r.prompt_left > 0 {
                r.scheduled_at = Some(now);
            }
        }
        let requests = &self.requests;
        let (mut shape, prompt_tokens) = step_shape(&plan, |seq| {
            requests[slot_of(seq)].as_ref().map_or(0, |r| r.prompt_left)
        });
        shape.kv_pushed = self.workers[w].role == Role::Prefill;
        let work_ms = self.profile.step_ms(&shape);
        self.workers[w].step = Some(Step {
            plan,
            work_ms,
            remaining_ms: work_ms,
            contended_factor: self.profile.contended_factor(&shape),
            started: None,
            prompt_tokens,
        });
        self.run_on_machine(w);
    }

    /// Gives worker `w`'s planned step its machine (or a place in its queue).
    fn run_on_machine(&mut self, w: usize) {
        let m = self.workers[w].machine;
        match self.machines[m].sharing {
            Sharing::Dedicated => self.begin_step(w),
            Sharing::TakeTurns => match self.machines[m].running.is_empty() {
                true => {
                    self.machines[m].running.push(w);
                    self.begin_step(w);
                }
                false => self.machines[m].waiting.push_back(w),
            },
            Sharing::Cores { .. } => {
                self.advance(m);
                self.machines[m].running.push(w);
                let now = self.now;
                self.workers[w]
                    .step
                    .as_mut()
                    .expect("a planned step")
                    .started = Some(now);
                self.reschedule(m);
            }
        }
    }

    /// Starts `w`'s step now at full speed.
    fn begin_step(&mut self, w: usize) {
        let now = self.now;
        let worker = &mut self.workers[w];
        let step = worker.step.as_mut().expect("a planned step");
        step.started = Some(now);
        worker.epoch += 1;
        let (at, epoch) = (now + step.work_ms / 1e3, worker.epoch);
        self.at(at, Event::StepEnd { worker: w, epoch });
    }

    /// Processor sharing: takes the work done since the last change off every running step.
    fn advance(&mut self, m: usize) {
        let machine = &mut self.machines[m];
        let elapsed_ms = (self.now - machine.updated) * 1e3;
        machine.updated = self.now;
        for &w in &machine.running {
            if let Some(step) = self.workers[w].step.as_mut() {
                let done_ms = elapsed_ms * machine.step_speed(step);
                step.remaining_ms = (step.remaining_ms - done_ms).max(0.0);
            }
        }
    }

    /// Processor sharing: schedules every running step's end at its speed now.
    fn reschedule(&mut self, m: usize) {
        let running = self.machines[m].running.clone();
        for w in running {
            let worker = &mut self.workers[w];
            worker.epoch += 1;
            let step = worker.step.as_ref().expect("a running step");
            let speed = self.machines[m].step_speed(step);
            let (at, epoch) = (self.now + step.remaining_ms / 1e3 / speed, worker.epoch);
            self.at(at, Event::StepEnd { worker: w, epoch });
        }
    }

    /// Frees `w`'s share of its machine, starting the next waiting step.
    fn release_machine(&mut self, w: usize) {
        let m = self.workers[w].machine;
        match self.machines[m].sharing {
            Sharing::Dedicated => {}
            Sharing::TakeTurns => {
                self.machines[m].running.retain(|&x| x != w);
                if let Some(next) = self.machines[m].waiting.pop_front() {
                    self.machines[m].running.push(next);
                    self.begin_step(next);
                }
            }
            Sharing::Cores { .. } => {
                self.advance(m);
                self.machines[m].running.retain(|&x| x != w);
                self.reschedule(m);
            }
        }
    }

    fn step_end(&mut self, w: usize, epoch: u64) -> Result<(), PlannerError> {
        if self.workers[w].epoch != epoch {
            return Ok(()); // rescheduled
        }
        self.release_machine(w);
        let step = self.workers[w].step.take().expect("an ending step");
        let took = self.now - step.started.unwrap_or(self.now);
        self.workers[w].measured(step.prompt_tokens, took);
        let role = self.workers[w].role;
        // Commands the step's outcomes send this worker wait for its next turn.
        self.workers[w].in_turn = true;
        for p in &step.plan {
            let slot = slot_of(p.seq);
            let r = self.requests[slot].as_mut().expect("a planned request");
            let computed = p.len.min(r.prompt_left);
            r.prompt_left -= computed;
            self.workers[w].queued_tokens -= computed as u64;
            let complete = self.workers[w]
                .scheduler
                .record_computed(p)
                .map_err(|e| PlannerError::Invalid(format!("the scheduler refused a step: {e}")))?;
            if !complete {
                continue; // a prompt chunk
            }
            match role {
                Role::Prefill => self.prefilled(w, slot),
                Role::Decode => self.sampled(w, slot),
            }
        }
        self.workers[w].in_turn = false;
        self.workers[w].spare_plan = step.plan;
        self.turn(w);
        Ok(())
    }

    /// A decode worker takes a routed request (at its engine's turn).
    fn admit(&mut self, w: usize, slot: usize) {
        let (local, tokens) = {
            let r = self.requests[slot].as_ref().expect("a live request");
            (r.plan.is_empty(), r.prompt.clone())
        };
        if local {
            return self.prefill_here(w, slot);
        }
        let reservation = match self.workers[w]
            .scheduler
            .kv_cache_mut()
            .reserve(&tokens, "")
        {
            Ok(r) => r,
            Err(_) => {
                self.fallbacks += 1;
                return self.prefill_here(w, slot);
            }
        };
        self.request(slot).reservation = Some(reservation);
        self.reply(w, Command::Bind(slot));
    }

    /// Sends worker `w` `command` once the engine thread's answer to the current one is back.
    fn reply(&mut self, w: usize, command: Command) {
        let now = self.now;
        self.at(now, Event::Reply { worker: w, command });
    }

    /// A decode worker binds a request's reservation to the first prefill worker of its plan
    /// whose queue takes the prompt (at its engine's turn), or prefills it itself.
    fn bind(&mut self, w: usize, slot: usize) {
        let now = self.now;
        let plan = std::mem::take(&mut self.request(slot).plan);
        let n = self.request(slot).prompt.len() as u64;
        let limit = self.config.prefill_max_queued_tokens;
        // A prefill worker's queue takes a prompt while it stays within the limit, and always
        // when empty.
        let Some(p) = plan.into_iter().find(|&p| {
            let q = self.workers[p].queued_tokens;
            q == 0 || q + n <= limit
        }) else {
            let reservation = self.request(slot).reservation.take();
            let _ = self.workers[w]
                .scheduler
                .kv_cache_mut()
                .release(reservation.expect("a reserved request"));
            self.fallbacks += 1;
            return self.prefill_here(w, slot);
        };
        self.workers[p].queued_tokens += n;
        let r = self.request(slot);
        r.prefill = Some(p);
        r.submitted_at = now;
        self.command(p, Command::Submit(slot));
    }

    /// The decode worker prefills the request itself.
    fn prefill_here(&mut self, w: usize, slot: usize) {
        let now = self.now;
        let tokens = self.request(slot).decoded_tokens();
        let n = tokens.len();
        self.workers[w].queued_tokens += n as u64;
        self.admit_sequence(w, slot, tokens);
        self.request(slot).submitted_at = now;
    }

    /// A worker's scheduler takes the request's prompt, reusing its cached prefix.
    fn admit_sequence(&mut self, w: usize, slot: usize, tokens: Vec<u32>) {
        let n = tokens.len();
        let seq = self.admitted_sequence(slot);
        let cached = self.workers[w]
            .scheduler
            .add_sequence(seq, tokens, "")
            .expect("a fresh sequence id");
        self.workers[w].sequences += 1;
        self.workers[w].queued_tokens -= cached as u64;
        let r = self.request(slot);
        r.prompt_left = n - cached;
        r.cached_tokens = r.cached_tokens.max(cached);
        r.scheduled_at = None;
    }

    /// The request's next sequence id, for the worker's scheduler admitting it now.
    fn admitted_sequence(&mut self, slot: usize) -> SeqId {
        self.admitted += 1;
        let seq = sequence_id(self.admitted, slot);
        self.request(slot).seq = seq;
        seq
    }

    /// A prefill worker takes a prompt (at its engine's turn).
    fn submit(&mut self, w: usize, slot: usize) {
        let (tokens, reserved_cached) = {
            let r = self.requests[slot].as_ref().expect("a live request");
            let cached = r
                .reservation
                .as_ref()
                .map_or(0, |k| k.cached_blocks * self.block_size);
            (r.prompt.clone(), cached)
        };
        self.admit_sequence(w, slot, tokens);
        let r = self.request(slot);
        r.cached_tokens = r.cached_tokens.max(reserved_cached);
    }

    /// A prefill worker computed the request's whole prompt: its KV goes to the decode worker.
    fn prefilled(&mut self, w: usize, slot: usize) {
        let now = self.now;
        let seq = self.request(slot).seq;
        let _ = self.workers[w].scheduler.remove(seq);
        self.workers[w].sequences -= 1;
        let profile = self.profile;
        let fit = self.transfer.expect("a disaggregated cluster's transport");
        let r = self.request(slot);
        r.prefilled_at = now;
        let compute_ms = (now - r.scheduled_at.unwrap_or(now)) * 1e3;
        let blocks = r
            .reservation
            .as_ref()
            .map_or(0, |k| k.blocks.len() - k.cached_blocks);
        let bytes = blocks as u64 * profile.kv.block_bytes;
        let at = now + profile.exposed_transfer_ms(&fit, bytes, compute_ms) / 1e3;
        self.at(at, Event::Transferred { request: slot });
    }

    /// The push's last KV is on the decode worker, which writes it at its next turn.
    fn transferred(&mut self, slot: usize) {
        let decode = self.request(slot).decode;
        self.command(decode, Command::Land(slot));
    }

    /// The push's last writes landed and it is acknowledged: the prefill worker answers the
    /// decode worker, which then activates the reservation (at a turn after this one).
    fn land(&mut self, w: usize, slot: usize) {
        let now = self.now;
        self.request(slot).transferred_at = now;
        self.reply(w, Command::Activate(slot));
    }

    /// The decode worker takes the prefilled request into its batch; its first token streams.
    fn activate(&mut self, w: usize, slot: usize) {
        let (tokens, reservation) = {
            let r = self.request(slot);
            (
                r.decoded_tokens(),
                r.reservation.take().expect("a reserved request"),
            )
        };
        let seq = self.admitted_sequence(slot);
        self.workers[w]
            .scheduler
            .add_prefilled(seq, tokens, reservation)
            .expect("a fresh sequence id and its reservation");
        self.workers[w].sequences += 1;
        self.request(slot).prompt_left = 0;
        self.sampled(w, slot);
    }

    /// A decode worker sampled the request's next token.
    fn sampled(&mut self, w: usize, slot: usize) {
        let now = self.now;
        let r = self.requests[slot].as_mut().expect("a live request");
        match r.first_token {
            None => {
                r.first_token = Some(now);
                let (on, ticket) = (r.planned_on, r.ticket);
                self.workers[on].unplan(ticket);
            }
            Some(_) => self.summary.inter_token((now - r.last_token) * 1e3),
        }
        let r = self.requests[slot].as_mut().expect("a live request");
        r.generated += 1;
        r.last_token = now;
        if r.generated >= r.max_tokens {
            return self.finish(w, slot);
        }
        let (seq, token) = (r.seq, answer_token(r.serial, r.generated));
        self.workers[w]
            .scheduler
            .append_token(seq, token)
            .expect("a scheduled sequence");
    }

    /// The request's last token is out.
    fn finish(&mut self, w: usize, slot: usize) {
        let now = self.now;
        let seq = self.request(slot).seq;
        let _ = self.workers[w].scheduler.remove(seq);
        self.workers[w].sequences -= 1;
        self.workers[w].in_flight -= 1;
        let r = self.requests[slot].take().expect("a live request");
        self.free_slots.push(slot);
        self.in_flight -= 1;
        let first = r.first_token.expect("a finished request streamed");
        let ttft_ms = (first - r.arrival) * 1e3;
        let tpot_ms = match r.generated {
            0 | 1 => 0.0,
            n => (now - first) * 1e3 / (n - 1) as f64,
        };
        let split = match r.prefill {
            Some(_) => TtftSplit {
                queue_ms: (r.scheduled_at.unwrap_or(r.submitted_at) - r.arrival) * 1e3,
                prefill_ms: (r.prefilled_at - r.scheduled_at.unwrap_or(r.prefilled_at)) * 1e3,
                transfer_ms: (r.transferred_at - r.prefilled_at) * 1e3,
                ttft_ms,
                prefill_local: false,
            },
            None => TtftSplit {
                queue_ms: (r.scheduled_at.unwrap_or(first) - r.arrival) * 1e3,
                prefill_ms: (first - r.scheduled_at.unwrap_or(first)) * 1e3,
                transfer_ms: 0.0,
                ttft_ms,
                prefill_local: true,
            },
        };
        let outcome = Outcome {
            arrival_s: r.arrival,
            prompt_tokens: r.prompt.len(),
            cached_tokens: r.cached_tokens,
            ttft_ms,
            tpot_ms,
            e2e_ms: (now - r.arrival) * 1e3,
            output_tokens: r.generated as usize,
            split: Some(split),
        };
        self.summary.served(&outcome, &self.config.slo);
        self.prompt_tokens += r.prompt.len() as u64;
        self.cached_tokens += r.cached_tokens as u64;
        self.last_end = now;
        self.ended += 1;
        // The conversation's next turn: this prompt, its answer and the next question.
        let mut follow_ups = r.follow_ups;
        match follow_ups.next() {
            Some(question) => {
                let mut prompt = r.prompt;
                prompt.extend((1..=r.generated).map(|g| answer_token(r.serial, g)));
                prompt.extend_from_slice(&question);
                self.issue(prompt, r.max_tokens, follow_ups);
            }
            None => self.conversation_ended(),
        }
    }

    /// A request failed; `shed`: refused at once for load (RESOURCE_EXHAUSTED).
    fn fail(&mut self, slot: usize, shed: bool) {
        let r = self.requests[slot].take().expect("a live request");
        self.free_slots.push(slot);
        self.summary.failed(shed, r.arrival);
        self.last_end = self.now;
        self.ended += 1;
        self.conversation_ended();
    }

    /// A job (all its turns) is over: a closed-loop client sends its next one.
    fn conversation_ended(&mut self) {
        self.live -= 1;
        if self.concurrency.is_some() {
            self.live += 1;
            let now = self.now;
            self.at(now, Event::Arrive);
        }
    }

    fn poll(&mut self, w: usize) {
        let now = self.now;
        self.workers[w].poll(now);
        if self.pending_changes > 0 {
            let at = now + self.config.routing.stats_interval_s;
            self.at(at, Event::Poll { worker: w });
        }
    }

    fn result(mut self) -> SimResult {
        let preemptions = self.workers.iter().map(|w| w.scheduler.preemptions()).sum();
        let design = match self.config.design {
            Design::Disaggregated => "disaggregated",
            Design::Colocated => "colocated",
        };
        SimResult {
            summary: self.summary.build(design, self.last_end),
            prefix_hit_rate: match self.prompt_tokens {
                0 => 0.0,
                n => self.cached_tokens as f64 / n as f64,
            },
            decisions: Decision::ALL
                .iter()
                .map(|&d| (d.name().to_string(), self.decisions[decision_index(d)]))
                .collect(),
            local_prefill_fallbacks: self.fallbacks,
            preemptions,
            events: self.processed,
            outcomes: self.summary.take_outcomes(),
        }
    }
}

/// The `n`th token generated for request `serial` (made up: only its sharing matters).
fn answer_token(serial: u64, n: u32) -> u32 {
    synthetic_token((serial << 20 ^ n as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

fn decision_index(d: Decision) -> usize {
    Decision::ALL.iter().position(|&x| x == d).expect("listed")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::{Contention, ServingProfile};
    use crate::testing::{config, synthetic};

    fn job(prompt: Vec<u32>, max_tokens: u32, at_ms: u64) -> Result<Job, PlannerError> {
        Ok(Job {
            prompt: Prompt::Tokens(prompt),
            max_tokens,
            follow_ups: Vec::new(),
            at: Some(Duration::from_millis(at_ms)),
        })
    }

    fn run(
        config: &SimConfig,
        jobs: Vec<Result<Job, PlannerError>>,
        arrivals: Arrivals,
    ) -> SimResult {
        simulate(
            &synthetic(),
            config,
            &mut jobs.into_iter(),
            arrivals,
            1,
            &mut |_| {},
        )
        .unwrap()
    }

    const TRACE: Arrivals = Arrivals::Trace { speedup: 1.0 };

    /// Equal within the latency histograms' 3 significant digits.
    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 2e-3 * b.abs().max(1.0)
    }

    /// One 100-token prompt, 5 tokens out, on an idle 1P+1D cluster: one 12 ms prefill step
    /// (2 + 0.1·100), 7 blocks of 64 KiB pushed (1 ms + the last of 4 layers' 0.22 ms, the rest
    /// hidden by compute), then 4 decode steps of 5 + 0.2 + 0.001·ctx ms at ctx 101..104.
    #[test]
    fn one_request_takes_the_profiles_time_through_the_real_path() {
        let r = run(
            &config(Design::Disaggregated, 1, 1),
            vec![job((0..100).collect(), 5, 0)],
            TRACE,
        );
        let s = &r.summary;
        assert_eq!((s.requests, s.failed), (1, 0));
        assert!(close(s.ttft_ms.mean, 13.219), "{s:?}");
        assert!(close(s.tpot_ms.mean, 5.3025), "{s:?}");
        let b = &s.server_ttft_ms;
        assert!(
            close(b.prefill_ms.mean, 12.0) && close(b.transfer_ms.mean, 1.219),
            "{b:?}"
        );
        assert_eq!(b.queue_ms.mean, 0.0);
        assert_eq!(r.decisions[0], ("remote".to_string(), 1));
        // Colocated: the prompt is prefilled on the decode worker, nothing moves.
        let r = run(
            &config(Design::Colocated, 0, 1),
            vec![job((0..100).collect(), 5, 0)],
            TRACE,
        );
        assert!(close(r.summary.ttft_ms.mean, 12.0), "{:?}", r.summary);
    }

    /// The decode worker's engine thread answers between its steps, as the real one does: a
    /// request for a busy decode worker waits one step to be bound to the prefill worker after
    /// its reservation (the second call comes back after the thread moved on), its push's last
    /// KV lands at the end of the running step, and it is activated a step after that.
    #[test]
    fn a_busy_decode_worker_binds_lands_and_activates_at_its_turns() {
        let mut c = config(Design::Disaggregated, 1, 1);
        c.routing.policy.local_prefill_threshold = 20;
        // A short prompt prefilled on the decode worker keeps it stepping (about 5.2 ms a step)
        // while the second request, 48 ms later, goes through the prefill worker.
        let jobs = vec![
            job((0..10).collect(), 400, 0),
            job((100..200).collect(), 2, 48),
        ];
        let r = run(&c, jobs, TRACE);
        assert_eq!(r.decisions[0], ("remote".to_string(), 1));
        let b = &r.summary.server_ttft_ms;
        let step = 5.0;
        // The second request's split is each part's highest value: the first's queue and
        // transfer are 0 and its prefill is one step.
        let (queue, prefill, transfer) = (b.queue_ms.p99, b.prefill_ms.p99, b.transfer_ms.p99);
        // Admitted at the end of the step it arrived in (2 ms later), bound a step after.
        assert!((step + 1.5..step + 2.5).contains(&queue), "{b:?}");
        assert!(close(prefill, 12.0), "{b:?}");
        // The wire's 1.219 ms, then the rest of the step running when it ended.
        assert!(
            (1.219 + 0.5..1.219 + 1.1 * step).contains(&transfer),
            "{b:?}"
        );
        let activation = r.summary.ttft_ms.p99 - (queue + prefill + transfer);
        assert!((0.99 * step..1.1 * step).contains(&activation), "{b:?}");
    }

    #[test]
    fn workers_sharing_a_machine_share_its_time() {
        let two = || {
            vec![
                job((0..100).collect(), 1, 0),
                job((200..300).collect(), 1, 0),
            ]
        };
        let mut c = config(Design::Colocated, 0, 2);
        // Each on its own device: both first tokens after one 12 ms step.
        let r = run(&c, two(), TRACE);
        assert!(
            close(r.summary.ttft_ms.p99, 12.0),
            "{:?}",
            r.summary.ttft_ms
        );
        // One kernel pool: the second step waits for the first.
        c.sharing = Sharing::TakeTurns;
        let r = run(&c, two(), TRACE);
        assert!(
            close(r.summary.ttft_ms.p50, 12.0) && close(r.summary.ttft_ms.p99, 24.0),
            "{:?}",
            r.summary.ttft_ms
        );
        // One core for two single-threaded processes: both at half speed.
        c.sharing = Sharing::Cores {
            cores: 1,
            threads: 1,
        };
        let r = run(&c, two(), TRACE);
        assert!(
            close(r.summary.ttft_ms.p50, 24.0) && close(r.summary.ttft_ms.p99, 24.0),
            "{:?}",
            r.summary.ttft_ms
        );
        // Two cores, filled: each at full speed, slowed by the contention the profile measured.
        c.sharing = Sharing::Cores {
            cores: 2,
            threads: 1,
        };
        let r = run(&c, two(), TRACE);
        assert!(
            close(r.summary.ttft_ms.p99, 12.0),
            "{:?}",
            r.summary.ttft_ms
        );
        let mut profile = synthetic();
        profile.serving = Some(ServingProfile {
            decode: Vec::new(),
            prefill: Vec::new(),
            prefill_push_factor: 1.0,
            // Colocated workers push no KV: their steps, prompts too, take the decode factor.
            contention: Some(Contention {
                prefill_factor: 1.1,
                decode_factor: 1.5,
            }),
        });
        let r = simulate(&profile, &c, &mut two().into_iter(), TRACE, 1, &mut |_| {}).unwrap();
        assert!(
            close(r.summary.ttft_ms.p50, 18.0) && close(r.summary.ttft_ms.p99, 18.0),
            "{:?}",
            r.summary.ttft_ms
        );
        // One of them alone leaves a core free: no contention.
        let one = two().into_iter().take(1).collect::<Vec<_>>();
        let r = simulate(&profile, &c, &mut one.into_iter(), TRACE, 1, &mut |_| {}).unwrap();
        assert!(
            close(r.summary.ttft_ms.p99, 12.0),
            "{:?}",
            r.summary.ttft_ms
        );
    }

    #[test]
    fn a_repeated_prompt_hits_the_prefix_cache_where_the_router_sent_it() {
        let prompt: Vec<u32> = (0..320).collect();
        let jobs = vec![job(prompt.clone(), 2, 0), job(prompt, 2, 1000)];
        let r = run(&config(Design::Disaggregated, 2, 2), jobs, TRACE);
        // The second prompt is planned where it is cached: its decode worker reserves all 20 of
        // its blocks from its own cache (the prefill worker still computes the last token).
        assert!(
            close(r.prefix_hit_rate, 320.0 / 640.0),
            "{}",
            r.prefix_hit_rate
        );
        assert_eq!(r.decisions[0], ("remote".to_string(), 2));
    }

    #[test]
    fn a_small_cache_preempts_and_every_request_still_finishes() {
        let mut c = config(Design::Colocated, 0, 1);
        c.kv_cache_tokens = 16 * 24;
        let jobs: Vec<_> = (0..8)
            .map(|i| job((i * 1000..i * 1000 + 40).collect(), 60, 0))
            .collect();
        let r = run(&c, jobs, TRACE);
        assert_eq!((r.summary.requests, r.summary.failed), (8, 0));
        assert!(r.preemptions > 0);
    }

    #[test]
    fn an_open_loop_past_the_in_flight_limit_sheds_and_a_closed_loop_never_does() {
        let mut c = config(Design::Disaggregated, 1, 1);
        c.routing.max_queued_requests = 4;
        let jobs = || {
            crate::workload::random_jobs(
                3,
                200,
                crate::workload::Range { min: 200, max: 400 },
                crate::workload::Range { min: 20, max: 40 },
            )
            .map(Ok)
        };
        let open = simulate(
            &synthetic(),
            &c,
            &mut jobs(),
            Arrivals::Poisson { rate: 400.0 },
            1,
            &mut |_| {},
        )
        .unwrap();
        assert!(
            open.summary.shed > 0 && open.summary.shed == open.summary.failed,
            "{:?}",
            open.summary
        );
        let decided: u64 = open.decisions.iter().map(|(_, n)| n).sum();
        assert_eq!(decided as usize, open.summary.requests - open.summary.shed);
        let closed = simulate(
            &synthetic(),
            &c,
            &mut jobs(),
            Arrivals::Closed { concurrency: 4 },
            1,
            &mut |_| {},
        )
        .unwrap();
        assert_eq!((closed.summary.requests, closed.summary.failed), (200, 0));
        let windows: u32 = closed.summary.timeline.iter().map(|w| w.requests).sum();
        assert_eq!(windows, 200);
    }

    /// Conversations over four shared system prompts (prefix hits, follow-up turns), on caches
    /// small enough to evict and preempt: every decision path of the simulation.
    fn pinned_jobs() -> Vec<Result<Job, PlannerError>> {
        let mut source = crate::workload::TokenSource::new(7);
        let systems: Vec<Vec<u32>> = (0..4).map(|i| source.tokens(64 + 48 * i)).collect();
        (0..300)
            .map(|i| {
                let mut prompt = systems[i % systems.len()].clone();
                let n = 8 + (source.next_u64() % 200) as usize;
                prompt.extend(source.tokens(n));
                let turns = (source.next_u64() % 3) as usize;
                Ok(Job {
                    prompt: Prompt::Tokens(prompt),
                    max_tokens: 4 + (source.next_u64() % 60) as u32,
                    follow_ups: (0..turns).map(|_| source.tokens(12)).collect(),
                    at: None,
                })
            })
            .collect()
    }

    /// The scheduler plans the oldest prompt first, as the engine's does: a request that takes a
    /// finished request's slot still waits behind the prompts admitted before it.
    #[test]
    fn prompts_are_computed_in_admission_order_whatever_slot_they_reuse() {
        let mut c = config(Design::Colocated, 0, 1);
        // A 64-token prompt takes 4 steps of 16 tokens: the later ones queue.
        c.max_step_tokens = 16;
        c.keep_outcomes = true;
        let prompt = |i: u32| (i * 1000..i * 1000 + 64).collect::<Vec<u32>>();
        let jobs = vec![
            // Done in one step, it frees its slot before the last request arrives.
            job((0..16).collect(), 1, 0),
            job(prompt(1), 2, 1),
            job(prompt(2), 2, 2),
            job(prompt(3), 2, 3),
            job(prompt(4), 2, 10),
        ];
        let r = run(&c, jobs, TRACE);
        let mut first_tokens: Vec<(f64, f64)> = r
            .outcomes
            .iter()
            .map(|o| (o.arrival_s, o.arrival_s + o.ttft_ms / 1e3))
            .collect();
        first_tokens.sort_by(|a, b| a.0.total_cmp(&b.0));
        assert_eq!(first_tokens.len(), 5);
        assert!(
            first_tokens.windows(2).all(|w| w[0].1 < w[1].1),
            "first tokens out of arrival order: {first_tokens:?}"
        );
    }

    /// The simulation is deterministic for a seed, and its speed-ups change nothing: the reports
    /// of a disaggregated and a colocated run are pinned (`tests/golden/simulated-reports.json`:
    /// the colocated one written before the hot paths were optimised, the disaggregated one
    /// rewritten when the decode worker's bind and the push's landing began to wait for its
    /// turns, and both when sequences began to be numbered in admission order instead of by
    /// their reused slots: changes of the model, not of its speed).
    #[test]
    fn a_fixed_seed_gives_the_pinned_reports() {
        let mut disaggregated = config(Design::Disaggregated, 2, 3);
        disaggregated.kv_cache_tokens = 16 * 160;
        disaggregated.prefill_max_queued_tokens = 2048;
        let mut colocated = config(Design::Colocated, 0, 3);
        colocated.kv_cache_tokens = 16 * 96;
        colocated.sharing = Sharing::Cores {
            cores: 2,
            threads: 1,
        };
        let reports: Vec<serde_json::Value> = [
            (disaggregated, Arrivals::Poisson { rate: 60.0 }),
            (
                colocated,
                Arrivals::Gamma {
                    rate: 25.0,
                    cv: 2.0,
                },
            ),
        ]
        .iter()
        .map(|(c, arrivals)| {
            let r = simulate(
                &synthetic(),
                c,
                &mut pinned_jobs().into_iter(),
                *arrivals,
                3,
                &mut |_| {},
            )
            .unwrap();
            assert!(r.preemptions > 0 && r.prefix_hit_rate > 0.0, "{r:?}");
            serde_json::to_value(&r).unwrap()
        })
        .collect();
        // Compared as text: serde_json's float parsing is not exact, its printing is.
        assert_eq!(
            serde_json::to_string_pretty(&reports).unwrap(),
            include_str!("../tests/golden/simulated-reports.json")
        );
    }

    #[test]
    fn a_prompt_larger_than_a_cache_is_an_error_not_a_hang() {
        let mut c = config(Design::Colocated, 0, 1);
        c.kv_cache_tokens = 64;
        let err = simulate(
            &synthetic(),
            &c,
            &mut vec![job((0..500).collect(), 2, 0)].into_iter(),
            TRACE,
            1,
            &mut |_| {},
        )
        .unwrap_err();
        assert!(err.to_string().contains("--kv-cache-tokens"), "{err}");
    }
}
