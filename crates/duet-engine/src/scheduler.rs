//! The scheduler: which sequences run in the next step and how many tokens each, within the step
//! token budget (long prompts are computed in chunks), and which sequences give up their KV when
//! the cache is full. It knows sequences only as tokens and counts, and the cache only through
//! the [`KvCacheManager`] it owns, so its decisions are tested without a model.

use std::collections::{BTreeMap, BTreeSet};

use duet_kv::{KvCacheManager, KvError, KvReservation, SeqId};

/// One sequence's share of a step.
#[derive(Clone, Debug)]
pub struct PlannedSeq {
    pub seq: SeqId,
    /// Position of the first token computed.
    pub start_pos: usize,
    /// Tokens of the sequence computed.
    pub len: usize,
    /// Speculated tokens computed after them in the same step (positions `start_pos + len..`),
    /// to be verified against what the model samples; empty unless speculating.
    pub draft: Vec<u32>,
    /// The sequence's blocks (covering at least `start_pos + len + draft.len()` positions).
    pub block_table: Vec<u32>,
}

impl PlannedSeq {
    /// Rows this sequence adds to the step: its tokens and its draft.
    pub fn rows(&self) -> usize {
        self.len + self.draft.len()
    }
}

struct ScheduledSeq {
    /// Prompt and generated tokens.
    tokens: Vec<u32>,
    /// Tokens whose KV is in the cache.
    num_computed: usize,
    finished: bool,
}

impl ScheduledSeq {
    /// Tokens still to compute: 1 while decoding, more while a prompt is computed.
    fn remaining(&self) -> usize {
        self.tokens.len() - self.num_computed
    }
}

/// The running queue (decoding sequences) and the waiting queue (prompts still being computed)
/// are the unfinished sequences split by what they have left, each in admission order.
pub struct Scheduler {
    kv_cache: KvCacheManager,
    max_step_tokens: usize,
    /// Rows (decoding tokens and drafts) a step may reach by drafting.
    max_draft_step_rows: usize,
    /// The model's logits: every token id a step computes is below it.
    vocab_size: usize,
    /// By id, which is admission order: oldest first.
    seqs: BTreeMap<SeqId, ScheduledSeq>,
    /// Sequences whose prefix blocks are still being written from a tier below: no step plans
    /// them (nor preempts them) until [`end_loading`](Self::end_loading).
    loading: BTreeSet<SeqId>,
    preemptions: u64,
    out_of_vocab_drafts: u64,
    /// The planning order and the decoding rows of the step being planned, kept between steps
    /// so that planning allocates nothing.
    order: Vec<SeqId>,
    decoding: Vec<usize>,
    /// Planned rows carry their sequence's block table (see
    /// [`without_block_tables`](Self::without_block_tables)).
    block_tables: bool,
}

impl Scheduler {
    /// Drafts fill a step only up to `max_draft_step_rows` rows in all, and never name a token
    /// id of `vocab_size` or more (see [`plan_step`](Self::plan_step)).
    pub fn new(
        kv_cache: KvCacheManager,
        max_step_tokens: usize,
        max_draft_step_rows: usize,
        vocab_size: usize,
    ) -> Self {
        Self {
            kv_cache,
            max_step_tokens,
            max_draft_step_rows,
            vocab_size,
            seqs: BTreeMap::new(),
            loading: BTreeSet::new(),
            preemptions: 0,
            out_of_vocab_drafts: 0,
            order: Vec::new(),
            decoding: Vec::new(),
            block_tables: true,
        }
    }

    /// Planned rows leave `block_table` empty: for a caller that computes nothing (the
    /// planner's simulator, which plans millions of steps and would only copy the tables).
    pub fn without_block_tables(mut self) -> Self {
        self.block_tables = false;
        self
    }

    pub fn kv_cache(&self) -> &KvCacheManager {
        &self.kv_cache
    }

    /// For what concerns no scheduled sequence: reservations, clearing the prefix cache.
    pub fn kv_cache_mut(&mut self) -> &mut KvCacheManager {
        &mut self.kv_cache
    }

    /// Admits a sequence whose KV is still to compute, reusing cached prefix blocks of its cache
    /// salt's namespace. Returns the number of tokens found in the prefix cache.
    pub fn add_sequence(
        &mut self,
        seq: SeqId,
        tokens: Vec<u32>,
        cache_salt: &str,
    ) -> Result<usize, KvError> {
        let cached = self
            .kv_cache
            .add_sequence(seq, &tokens, cache_salt)?
            .num_cached();
        let num_computed = cached * self.kv_cache.block_size();
        self.seqs.insert(
            seq,
            ScheduledSeq {
                tokens,
                num_computed,
                finished: false,
            },
        );
        Ok(num_computed)
    }

    /// Admits a sequence whose every token's KV was written into `reservation`.
    pub fn add_prefilled(
        &mut self,
        seq: SeqId,
        tokens: Vec<u32>,
        reservation: KvReservation,
    ) -> Result<(), KvError> {
        self.kv_cache.add_reserved(seq, &tokens, reservation)?;
        self.seqs.insert(
            seq,
            ScheduledSeq {
                num_computed: tokens.len(),
                tokens,
                finished: false,
            },
        );
        Ok(())
    }

    /// All tokens (prompt and generated) of a sequence.
    pub fn tokens(&self, seq: SeqId) -> Option<&[u32]> {
        self.seqs.get(&seq).map(|s| s.tokens.as_slice())
    }

    /// Whether any sequence is unfinished.
    pub fn has_work(&self) -> bool {
        self.seqs.values().any(|s| !s.finished)
    }

    /// Keeps `seq` out of the steps until [`end_loading`](Self::end_loading): its prefix blocks
    /// are being written from a tier below, and no step may read them before that completes.
    pub fn hold_loading(&mut self, seq: SeqId) {
        if self.seqs.contains_key(&seq) {
            self.loading.insert(seq);
        }
    }

    /// Whether any sequence waits for its blocks' loads.
    pub fn is_loading(&self) -> bool {
        !self.loading.is_empty()
    }

    /// Whether an unfinished sequence could join a step now (none waits for loads).
    pub fn has_runnable(&self) -> bool {
        self.seqs
            .iter()
            .any(|(id, s)| !s.finished && !self.loading.contains(id))
    }

    /// Every load written so far has completed: the sequences held for them join the steps.
    pub fn end_loading(&mut self) {
        self.loading.clear();
    }

    /// Sequences preempted (and recomputed) since the scheduler started.
    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    /// Drafts cut before a token outside the model's vocabulary since the scheduler started.
    pub fn out_of_vocab_drafts(&self) -> u64 {
        self.out_of_vocab_drafts
    }

    /// Chooses the sequences and token counts of the next step and gives them their blocks:
    /// decoding sequences first (oldest first), then prompt chunks (oldest first), within the
    /// step token budget. When the cache cannot hold a decoding sequence's next token, the newest
    /// sequences are preempted: their blocks are released (full ones stay in the prefix cache)
    /// and they are recomputed later. A prompt that does not fit waits.
    ///
    /// `propose` gives a decoding sequence's draft (speculated tokens, from its tokens so far;
    /// empty: none). Drafts are planned last, oldest sequence first: they take only the budget
    /// every decoding token and prompt chunk leaves, up to `max_draft_step_rows` rows of decoding
    /// tokens and drafts in all (a large batch's step is already compute-bound, and rows drafted
    /// there cost as much as the tokens they may save), and only free blocks, never evicting a
    /// cached prefix block: a draft never preempts or holds back anyone, it is cut or dropped.
    /// A draft is also cut before its first token outside the model's vocabulary (counted in
    /// [`out_of_vocab_drafts`](Self::out_of_vocab_drafts)): no proposer's bad id can fail the
    /// step, and with it every sequence in it.
    pub fn plan_step(
        &mut self,
        propose: &mut dyn FnMut(SeqId, &[u32]) -> Vec<u32>,
    ) -> Result<Vec<PlannedSeq>, KvError> {
        let mut plan = Vec::new();
        self.plan_step_into(&mut plan, propose)?;
        Ok(plan)
    }

    /// Plans the next step as [`plan_step`](Self::plan_step) does, into `plan`, whose rows'
    /// allocations it reuses: a caller planning step after step (the planner's simulator, which
    /// plans millions) copies block tables without allocating. `plan` is empty after an error.
    pub fn plan_step_into(
        &mut self,
        plan: &mut Vec<PlannedSeq>,
        propose: &mut dyn FnMut(SeqId, &[u32]) -> Vec<u32>,
    ) -> Result<(), KvError> {
        let mut order = std::mem::take(&mut self.order);
        let mut decoding = std::mem::take(&mut self.decoding);
        let planned = self.plan_rows(plan, &mut order, &mut decoding, propose);
        self.order = order;
        self.decoding = decoding;
        if planned.is_err() {
            plan.clear();
        }
        planned
    }

    /// [`plan_step_into`](Self::plan_step_into) with its scratch lists.
    fn plan_rows(
        &mut self,
        plan: &mut Vec<PlannedSeq>,
        order: &mut Vec<SeqId>,
        decoding: &mut Vec<usize>,
        propose: &mut dyn FnMut(SeqId, &[u32]) -> Vec<u32>,
    ) -> Result<(), KvError> {
        let mut budget = self.max_step_tokens;
        let unfinished = || {
            self.seqs
                .iter()
                .filter(|(id, s)| !s.finished && !self.loading.contains(id))
        };
        order.clear();
        order.extend(
            unfinished()
                .filter(|(_, s)| s.remaining() <= 1)
                .map(|(&id, _)| id),
        );
        order.extend(
            unfinished()
                .filter(|(_, s)| s.remaining() > 1)
                .map(|(&id, _)| id),
        );
        // Rows of `plan` filled, and where the decoding sequences are among them.
        let mut rows = 0;
        decoding.clear();
        let mut preempted = Vec::new();
        for (i, &id) in order.iter().enumerate() {
            if budget == 0 {
                break;
            }
            if preempted.contains(&id) {
                continue; // recomputed in a later step
            }
            let seq = &self.seqs[&id];
            let start_pos = seq.num_computed;
            let is_decoding = seq.remaining() == 1;
            let len = seq.remaining().min(budget);
            let mut victims = order[i + 1..].iter().rev();
            let planned = loop {
                match self.kv_cache.allocate_slots(id, start_pos + len) {
                    Ok(blocks) => {
                        let row = PlannedSeq {
                            seq: id,
                            start_pos,
                            len,
                            draft: Vec::new(),
                            block_table: Vec::new(),
                        };
                        match plan.get_mut(rows) {
                            Some(p) => {
                                let mut block_table = std::mem::take(&mut p.block_table);
                                block_table.clear();
                                if self.block_tables {
                                    block_table.extend_from_slice(blocks.ids());
                                }
                                *p = PlannedSeq { block_table, ..row };
                            }
                            None => plan.push(PlannedSeq {
                                block_table: match self.block_tables {
                                    true => blocks.ids().to_vec(),
                                    false => Vec::new(),
                                },
                                ..row
                            }),
                        }
                        break true;
                    }
                    Err(KvError::Exhausted { .. }) if is_decoding => {
                        // Make room by preempting the newest sequences not already in this step.
                        match victims.find(|v| !preempted.contains(*v)) {
                            Some(&victim) => {
                                self.preempt(victim)?;
                                preempted.push(victim);
                            }
                            None => break false,
                        }
                    }
                    Err(KvError::Exhausted { .. }) => break false, // a prompt waits for room
                    Err(e) => return Err(e),
                }
            };
            if !planned {
                continue;
            }
            budget -= len;
            if is_decoding {
                decoding.push(rows);
            }
            rows += 1;
        }
        plan.truncate(rows);
        let draft_rows = self.max_draft_step_rows.saturating_sub(decoding.len());
        self.plan_drafts(plan, decoding, budget.min(draft_rows), propose)?;
        if plan.is_empty() && self.has_runnable() {
            return Err(KvError::Exhausted {
                requested: 1,
                available: self.kv_cache.pool().available(),
            });
        }
        Ok(())
    }

    /// Gives the decoding sequences at `decoding` in `plan`, in order, the drafts `propose`
    /// makes, `budget` rows in all, in the slots their blocks have left and in free blocks.
    fn plan_drafts(
        &mut self,
        plan: &mut [PlannedSeq],
        decoding: &[usize],
        mut budget: usize,
        propose: &mut dyn FnMut(SeqId, &[u32]) -> Vec<u32>,
    ) -> Result<(), KvError> {
        for &i in decoding {
            if budget == 0 {
                break;
            }
            let p = &mut plan[i];
            let mut draft = propose(p.seq, &self.seqs[&p.seq].tokens);
            if let Some(bad) = draft.iter().position(|&t| t as usize >= self.vocab_size) {
                draft.truncate(bad);
                self.out_of_vocab_drafts += 1;
            }
            draft.truncate(budget);
            if draft.is_empty() {
                continue;
            }
            let end = p.start_pos + p.len;
            let room = self
                .kv_cache
                .allocate_free_slots(p.seq, end + draft.len())?;
            draft.truncate(room - end);
            if draft.is_empty() {
                continue;
            }
            budget -= draft.len();
            p.block_table = self
                .kv_cache
                .blocks(p.seq)
                .ok_or(KvError::UnknownSequence(p.seq))?
                .ids()
                .to_vec();
            p.draft = draft;
        }
        Ok(())
    }

    /// Releases a sequence's blocks so it is recomputed from its tokens later.
    fn preempt(&mut self, seq: SeqId) -> Result<(), KvError> {
        self.kv_cache.free(seq)?;
        tracked(&mut self.seqs, seq)?.num_computed = 0;
        self.preemptions += 1;
        Ok(())
    }

    /// Records that a step computed `planned`, registering the blocks it filled in the prefix
    /// cache. Returns whether every token of the sequence is now computed (it needs its next
    /// token) rather than part of a prompt.
    pub fn record_computed(&mut self, planned: &PlannedSeq) -> Result<bool, KvError> {
        let seq = tracked(&mut self.seqs, planned.seq)?;
        seq.num_computed += planned.len;
        self.kv_cache
            .cache_full_blocks(planned.seq, &seq.tokens, seq.num_computed)?;
        Ok(seq.num_computed == seq.tokens.len())
    }

    /// Records that the token just appended to a sequence was its planned draft's next one, whose
    /// KV the step computed (the model sampled what was speculated), registering the block it
    /// filled in the prefix cache.
    pub fn record_draft_accepted(&mut self, seq: SeqId) -> Result<(), KvError> {
        let id = seq;
        let seq = tracked(&mut self.seqs, id)?;
        assert!(
            seq.num_computed < seq.tokens.len(),
            "an accepted draft token was appended first"
        );
        seq.num_computed += 1;
        self.kv_cache
            .cache_full_blocks(id, &seq.tokens, seq.num_computed)
    }

    /// Ends the verification of a sequence's draft: the blocks that only held rejected tokens'
    /// slots go back to the pool (the slots left in its last block are overwritten as it grows).
    pub fn end_draft(&mut self, seq: SeqId) -> Result<(), KvError> {
        let s = tracked(&mut self.seqs, seq)?;
        if s.finished {
            return Ok(()); // its blocks are already back
        }
        let len = s.tokens.len();
        self.kv_cache.shrink(seq, len)
    }

    /// Appends a sequence's next token (its KV is computed in the next step). Returns the
    /// sequence's length.
    pub fn append_token(&mut self, seq: SeqId, token: u32) -> Result<usize, KvError> {
        let seq = tracked(&mut self.seqs, seq)?;
        seq.tokens.push(token);
        Ok(seq.tokens.len())
    }

    /// Stops scheduling a sequence and gives its blocks back at once (full ones stay cached); its
    /// tokens stay until it is removed.
    pub fn finish(&mut self, seq: SeqId) -> Result<(), KvError> {
        tracked(&mut self.seqs, seq)?.finished = true;
        self.kv_cache.free(seq)
    }

    /// Forgets a sequence (finished or not) and releases its blocks (the caller waits for its
    /// loads first: see [`is_loading`](Self::is_loading)).
    pub fn remove(&mut self, seq: SeqId) -> Result<(), KvError> {
        self.kv_cache.remove(seq)?;
        self.seqs.remove(&seq);
        self.loading.remove(&seq);
        Ok(())
    }
}

fn tracked(
    seqs: &mut BTreeMap<SeqId, ScheduledSeq>,
    seq: SeqId,
) -> Result<&mut ScheduledSeq, KvError> {
    seqs.get_mut(&seq).ok_or(KvError::UnknownSequence(seq))
}

#[cfg(test)]
mod tests {
    use super::*;

    const BLOCK_SIZE: usize = 4;

    /// Token ids of the tests' model are below this.
    const VOCAB_SIZE: usize = 1000;

    fn scheduler(num_blocks: usize, max_step_tokens: usize) -> Scheduler {
        Scheduler::new(
            KvCacheManager::new(num_blocks, BLOCK_SIZE, "model"),
            max_step_tokens,
            usize::MAX,
            VOCAB_SIZE,
        )
    }

    fn tokens(first: u32, n: usize) -> Vec<u32> {
        (first..first + n as u32).collect()
    }

    /// (sequence, first position, tokens) of each planned sequence.
    fn shape(plan: &[PlannedSeq]) -> Vec<(SeqId, usize, usize)> {
        plan.iter().map(|p| (p.seq, p.start_pos, p.len)).collect()
    }

    /// Plans a step and completes it as a model would: every sequence whose tokens are all
    /// computed gets a next token.
    fn step(s: &mut Scheduler) -> Vec<(SeqId, usize, usize)> {
        let plan = s.plan_step(&mut no_drafts).unwrap();
        for p in &plan {
            if s.record_computed(p).unwrap() {
                s.append_token(p.seq, 1).unwrap();
            }
        }
        shape(&plan)
    }

    fn no_drafts(_: SeqId, _: &[u32]) -> Vec<u32> {
        Vec::new()
    }

    fn blocks_in_use(s: &Scheduler) -> usize {
        s.kv_cache().pool().stats().in_use
    }

    #[test]
    fn long_prompts_are_chunked_within_the_step_budget() {
        let mut s = scheduler(16, 8);
        s.add_sequence(0, tokens(0, 19), "").unwrap();
        s.add_sequence(1, tokens(100, 5), "").unwrap();
        assert_eq!(step(&mut s), [(0, 0, 8)]);
        assert_eq!(step(&mut s), [(0, 8, 8)]);
        assert_eq!(step(&mut s), [(0, 16, 3), (1, 0, 5)]);
        // Both now decode: one token each.
        assert_eq!(step(&mut s), [(0, 19, 1), (1, 5, 1)]);
        assert_eq!(s.tokens(0).unwrap().len(), 21);
    }

    /// Planning into the last step's plan (rows reused, a longer plan cut) gives what a fresh
    /// plan gives.
    #[test]
    fn a_plan_into_a_used_plan_is_a_fresh_plan() {
        let rows = |plan: &[PlannedSeq]| {
            plan.iter()
                .map(|p| (p.seq, p.start_pos, p.len, p.block_table.clone()))
                .collect::<Vec<_>>()
        };
        let (mut fresh, mut reusing) = (scheduler(64, 12), scheduler(64, 12));
        let mut plan = Vec::new();
        for s in [&mut fresh, &mut reusing] {
            for id in 0..4 {
                s.add_sequence(id, tokens(10 * id as u32, 3 + 2 * id as usize), "")
                    .unwrap();
            }
        }
        for round in 0..8 {
            if round == 4 {
                fresh.finish(1).unwrap();
                reusing.finish(1).unwrap();
            }
            let expected = fresh.plan_step(&mut no_drafts).unwrap();
            reusing.plan_step_into(&mut plan, &mut no_drafts).unwrap();
            assert_eq!(rows(&plan), rows(&expected), "round {round}");
            for (s, plan) in [(&mut fresh, &expected), (&mut reusing, &plan)] {
                for p in plan {
                    if s.record_computed(p).unwrap() {
                        s.append_token(p.seq, 1).unwrap();
                    }
                }
            }
        }
    }

    #[test]
    fn decoding_sequences_go_before_prompts_and_the_oldest_first() {
        let mut s = scheduler(32, 6);
        s.add_sequence(0, tokens(0, 3), "").unwrap();
        s.add_sequence(1, tokens(10, 2), "").unwrap();
        assert_eq!(step(&mut s), [(0, 0, 3), (1, 0, 2)]);
        s.add_sequence(2, tokens(20, 9), "").unwrap();
        s.add_sequence(3, tokens(40, 9), "").unwrap();
        assert_eq!(step(&mut s), [(0, 3, 1), (1, 2, 1), (2, 0, 4)]);
        assert_eq!(step(&mut s), [(0, 4, 1), (1, 3, 1), (2, 4, 4)]);
        // Sequence 2 needs one more token; 3 gets the rest of the budget.
        assert_eq!(step(&mut s), [(0, 5, 1), (1, 4, 1), (2, 8, 1), (3, 0, 3)]);
        assert_eq!(step(&mut s), [(0, 6, 1), (1, 5, 1), (2, 9, 1), (3, 3, 3)]);
    }

    #[test]
    fn a_planned_sequence_holds_blocks_for_its_tokens() {
        let mut s = scheduler(16, 16);
        s.add_sequence(0, tokens(0, 9), "").unwrap();
        let plan = s.plan_step(&mut no_drafts).unwrap();
        assert_eq!(plan[0].block_table.len(), 3);
        assert_eq!(
            s.kv_cache().blocks(0).unwrap().ids(),
            plan[0].block_table.as_slice()
        );
        // Without block tables: the same rows and blocks held, no table copied.
        let mut bare = scheduler(16, 16).without_block_tables();
        bare.add_sequence(0, tokens(0, 9), "").unwrap();
        let rows = bare.plan_step(&mut no_drafts).unwrap();
        assert_eq!(
            (rows[0].start_pos, rows[0].len),
            (plan[0].start_pos, plan[0].len)
        );
        assert!(rows[0].block_table.is_empty());
        assert_eq!(bare.kv_cache().blocks(0).unwrap().ids().len(), 3);
    }

    #[test]
    fn a_prompt_that_does_not_fit_waits_and_preempts_nobody() {
        // 4 blocks: sequence 0 holds 2 (8 tokens), the 12-token prompt needs 3.
        let mut s = scheduler(4, 64);
        s.add_sequence(0, tokens(0, 7), "").unwrap();
        assert_eq!(step(&mut s), [(0, 0, 7)]);
        s.add_sequence(1, tokens(50, 12), "").unwrap();
        assert_eq!(step(&mut s), [(0, 7, 1)]);
        assert_eq!(s.preemptions(), 0);
        s.finish(0).unwrap();
        assert_eq!(step(&mut s), [(1, 0, 12)]);
    }

    #[test]
    fn a_decoding_sequence_out_of_blocks_preempts_the_newest() {
        // 5 blocks; three sequences of 4 tokens decode, each at a block boundary in turn.
        let mut s = scheduler(5, 64);
        for id in 0..3 {
            s.add_sequence(id, tokens(10 * id as u32, 4 - id as usize), "")
                .unwrap();
        }
        assert_eq!(step(&mut s), [(0, 0, 4), (1, 0, 3), (2, 0, 2)]);
        assert_eq!(blocks_in_use(&s), 3);
        // Sequence 0 needs a second block, 1 and 2 fit in theirs.
        assert_eq!(step(&mut s), [(0, 4, 1), (1, 3, 1), (2, 2, 1)]);
        assert_eq!(blocks_in_use(&s), 4);
        // Now 1 needs a block: one is free.
        assert_eq!(step(&mut s), [(0, 5, 1), (1, 4, 1), (2, 3, 1)]);
        assert_eq!(blocks_in_use(&s), 5);
        assert_eq!(s.preemptions(), 0);
        // 2 needs a block and none is free: only newer sequences are preempted, and 2 is the
        // newest, so it waits.
        assert_eq!(step(&mut s), [(0, 6, 1), (1, 5, 1)]);
        assert_eq!(s.preemptions(), 0);
        // 0 and 1 decode on until 0 crosses into its third block: 2, the newest, is preempted.
        assert_eq!(step(&mut s), [(0, 7, 1), (1, 6, 1)]);
        assert_eq!(step(&mut s), [(0, 8, 1), (1, 7, 1)]);
        assert_eq!(s.preemptions(), 1);
        assert!(s.kv_cache().blocks(2).unwrap().ids().is_empty());
        // Once room is back, 2 is recomputed from its first token.
        s.finish(1).unwrap();
        assert_eq!(step(&mut s), [(0, 9, 1), (2, 0, 5)]);
    }

    /// A sequence whose blocks are loading from a tier below is in no step, and is never a
    /// preemption victim (its blocks are being written), until its loads complete.
    #[test]
    fn a_sequence_loading_its_blocks_joins_the_step_after_its_loads() {
        let mut s = scheduler(4, 64);
        for id in 0..3 {
            s.add_sequence(id, tokens(10 * id as u32, 4), "").unwrap();
        }
        assert_eq!(step(&mut s), [(0, 0, 4), (1, 0, 4), (2, 0, 4)]);
        s.hold_loading(2);
        assert!(s.is_loading() && s.has_runnable());
        // 0 and 1 need a second block: one is free, then 2 (the newest) would be the victim.
        assert_eq!(step(&mut s), [(0, 4, 1)], "1 waits, 2 keeps its block");
        assert_eq!(s.preemptions(), 0);
        assert_eq!(s.kv_cache().blocks(2).unwrap().ids().len(), 1);
        s.end_loading();
        s.finish(0).unwrap();
        assert_eq!(step(&mut s), [(1, 4, 1), (2, 4, 1)]);
        // Only loading sequences left: an empty step, not an exhausted cache.
        let mut s = scheduler(4, 64);
        s.add_sequence(7, tokens(0, 4), "").unwrap();
        s.hold_loading(7);
        assert!(!s.has_runnable());
        assert!(s.plan_step(&mut no_drafts).unwrap().is_empty());
    }

    #[test]
    fn preemption_picks_the_newest_sequences_first() {
        let mut s = scheduler(4, 64);
        for id in 0..4 {
            s.add_sequence(id, tokens(10 * id as u32, 4), "").unwrap();
        }
        assert_eq!(step(&mut s), [(0, 0, 4), (1, 0, 4), (2, 0, 4), (3, 0, 4)]);
        // Every sequence needs a second block: 0 takes 3's, 1 takes 2's.
        assert_eq!(step(&mut s), [(0, 4, 1), (1, 4, 1)]);
        assert_eq!(s.preemptions(), 2);
        assert!(s.kv_cache().blocks(3).unwrap().ids().is_empty());
        assert!(s.kv_cache().blocks(2).unwrap().ids().is_empty());
        assert_eq!(blocks_in_use(&s), 4);
    }

    #[test]
    fn nothing_runnable_is_an_exhausted_cache() {
        let mut s = scheduler(2, 64);
        s.add_sequence(0, tokens(0, 12), "").unwrap();
        assert_eq!(
            s.plan_step(&mut no_drafts).unwrap_err(),
            KvError::Exhausted {
                requested: 1,
                available: 2
            }
        );
        s.finish(0).unwrap();
        assert!(
            s.plan_step(&mut no_drafts).unwrap().is_empty(),
            "no work, no plan"
        );
    }

    #[test]
    fn prefix_cache_hits_skip_computed_tokens_within_one_salt() {
        let mut s = scheduler(16, 64);
        let prompt = tokens(0, 10);
        assert_eq!(s.add_sequence(0, prompt.clone(), "a").unwrap(), 0);
        assert_eq!(step(&mut s), [(0, 0, 10)]);
        s.remove(0).unwrap();
        assert_eq!(blocks_in_use(&s), 0);
        // 2 full blocks cached; the rest is computed.
        assert_eq!(s.add_sequence(1, prompt.clone(), "a").unwrap(), 8);
        assert_eq!(s.add_sequence(2, prompt.clone(), "b").unwrap(), 0);
        assert_eq!(s.add_sequence(3, prompt[..8].to_vec(), "a").unwrap(), 4);
        assert_eq!(step(&mut s), [(1, 8, 2), (2, 0, 10), (3, 4, 4)]);
    }

    /// (sequence, first position, tokens, drafted) of each planned sequence.
    fn shape_with_drafts(plan: &[PlannedSeq]) -> Vec<(SeqId, usize, usize, usize)> {
        plan.iter()
            .map(|p| (p.seq, p.start_pos, p.len, p.draft.len()))
            .collect()
    }

    #[test]
    fn drafts_take_only_the_budget_decoding_tokens_and_prompts_leave() {
        let mut s = scheduler(32, 10);
        s.add_sequence(0, tokens(0, 3), "").unwrap();
        s.add_sequence(1, tokens(10, 3), "").unwrap();
        step(&mut s);
        s.add_sequence(2, tokens(20, 5), "").unwrap();
        let mut propose = |_: SeqId, _: &[u32]| vec![7; 8];
        let plan = s.plan_step(&mut propose).unwrap();
        // Two decoding tokens and the 5-token prompt leave 3 of the budget: the oldest sequence
        // drafts them all, the other decodes one token.
        assert_eq!(
            shape_with_drafts(&plan),
            [(0, 3, 1, 3), (1, 3, 1, 0), (2, 0, 5, 0)]
        );
        assert_eq!(plan[0].rows(), 4);
        assert_eq!(plan[0].draft, [7; 3]);
        assert!(plan[0].block_table.len() * BLOCK_SIZE >= 3 + 4);
        assert_eq!(
            s.kv_cache().blocks(0).unwrap().ids(),
            plan[0].block_table.as_slice()
        );
        // With a smaller budget the prompt takes what the decoding tokens leave: no draft.
        let mut s = scheduler(32, 6);
        s.add_sequence(0, tokens(0, 3), "").unwrap();
        s.add_sequence(1, tokens(10, 3), "").unwrap();
        step(&mut s);
        s.add_sequence(2, tokens(20, 5), "").unwrap();
        let plan = s.plan_step(&mut propose).unwrap();
        assert_eq!(
            shape_with_drafts(&plan),
            [(0, 3, 1, 0), (1, 3, 1, 0), (2, 0, 4, 0)]
        );
    }

    #[test]
    fn drafts_fill_a_step_up_to_the_draft_row_limit_only() {
        let mut s = Scheduler::new(
            KvCacheManager::new(32, BLOCK_SIZE, "model"),
            64,
            5,
            VOCAB_SIZE,
        );
        for id in 0..3 {
            s.add_sequence(id, tokens(10 * id as u32, 3), "").unwrap();
        }
        step(&mut s);
        let mut propose = |_: SeqId, _: &[u32]| vec![7; 8];
        let plan = s.plan_step(&mut propose).unwrap();
        // 3 decoding tokens, and 2 drafted rows to reach 5.
        assert_eq!(
            shape_with_drafts(&plan),
            [(0, 3, 1, 2), (1, 3, 1, 0), (2, 3, 1, 0)]
        );
        s.add_sequence(3, tokens(40, 3), "").unwrap();
        s.add_sequence(4, tokens(50, 3), "").unwrap();
        s.add_sequence(5, tokens(60, 3), "").unwrap();
        for p in &plan {
            s.record_computed(p).unwrap();
            s.append_token(p.seq, 1).unwrap();
        }
        step(&mut s);
        // Six decoding sequences: past the limit, nobody drafts.
        let plan = s.plan_step(&mut propose).unwrap();
        assert!(plan.iter().all(|p| p.draft.is_empty()), "{plan:?}");
    }

    #[test]
    fn a_draft_is_cut_to_the_slots_left_rather_than_preempt_anyone() {
        let mut s = scheduler(3, 64);
        s.add_sequence(0, tokens(0, 4), "").unwrap();
        s.add_sequence(1, tokens(10, 4), "").unwrap();
        step(&mut s);
        // One block is free: sequence 0's next token takes it (sequence 1, the newest, waits),
        // and its draft of 8 gets the 3 slots left in that block.
        let mut propose = |seq: SeqId, _: &[u32]| if seq == 0 { vec![7; 8] } else { Vec::new() };
        let plan = s.plan_step(&mut propose).unwrap();
        assert_eq!(shape_with_drafts(&plan), [(0, 4, 1, 3)]);
        assert_eq!(s.preemptions(), 0);
    }

    /// Under a full pool, every sequence's next token is planned before any draft: a draft
    /// takes only free blocks, so it never makes another sequence preempt (or wait), and never
    /// evicts a cached prefix block (no `Removed` event reaches the router).
    #[test]
    fn a_draft_never_preempts_holds_back_or_evicts() {
        // 7 blocks: one cached (a finished prompt's), three decoding sequences at a block
        // boundary, three free.
        let mut s = scheduler(7, 64);
        s.kv_cache_mut().record_events();
        s.add_sequence(0, tokens(90, 4), "").unwrap();
        step(&mut s);
        s.finish(0).unwrap();
        for id in 1..4 {
            s.add_sequence(id, tokens(10 * id as u32, 4), "").unwrap();
        }
        step(&mut s);
        let pool = s.kv_cache().pool().stats();
        assert_eq!((pool.in_use, pool.cached, pool.free), (3, 1, 3));
        s.kv_cache_mut().take_events();
        // Sequence 1 drafts 12 tokens (4 more blocks); each next token needs a block.
        let mut propose = |seq: SeqId, _: &[u32]| if seq == 1 { vec![7; 12] } else { Vec::new() };
        let plan = s.plan_step(&mut propose).unwrap();
        // The three next tokens take the three free blocks; the draft gets the slots left in
        // sequence 1's new block.
        assert_eq!(
            shape_with_drafts(&plan),
            [(1, 4, 1, 3), (2, 4, 1, 0), (3, 4, 1, 0)]
        );
        assert_eq!(s.preemptions(), 0);
        let (events, _) = s.kv_cache_mut().take_events();
        assert!(
            !events
                .iter()
                .any(|e| matches!(e, duet_kv::KvEvent::Removed { .. })),
            "{events:?}"
        );
        assert_eq!(s.kv_cache().pool().stats().cached, 1);
    }

    /// A proposer's id outside the vocabulary (a draft model with padding rows) would fail the
    /// whole step: the draft is cut before it and counted, and the step goes on.
    #[test]
    fn a_draft_is_cut_before_a_token_outside_the_vocabulary() {
        let mut s = scheduler(32, 64);
        s.add_sequence(0, tokens(0, 3), "").unwrap();
        s.add_sequence(1, tokens(10, 3), "").unwrap();
        step(&mut s);
        let bad = VOCAB_SIZE as u32;
        let mut propose = |seq: SeqId, _: &[u32]| match seq {
            0 => vec![7, 8, bad, 9],
            _ => vec![bad, 5],
        };
        let plan = s.plan_step(&mut propose).unwrap();
        assert_eq!(shape_with_drafts(&plan), [(0, 3, 1, 2), (1, 3, 1, 0)]);
        assert_eq!(plan[0].draft, [7, 8]);
        assert_eq!(s.out_of_vocab_drafts(), 2);
    }

    #[test]
    fn accepted_drafts_are_computed_and_rejected_slots_given_back() {
        let mut s = scheduler(8, 64);
        s.add_sequence(0, tokens(0, 3), "").unwrap();
        step(&mut s);
        // Tokens 0 1 2 | 1 (sampled, to compute): the draft of 8 spans positions 4..12.
        let mut propose = |_: SeqId, _: &[u32]| (50..58).collect();
        let plan = s.plan_step(&mut propose).unwrap();
        assert_eq!(shape_with_drafts(&plan), [(0, 3, 1, 8)]);
        assert_eq!(blocks_in_use(&s), 3);
        assert!(s.record_computed(&plan[0]).unwrap());
        // The model samples 50 and 51 (accepted), then 99 instead of 52.
        for t in [50, 51] {
            s.append_token(0, t).unwrap();
            s.record_draft_accepted(0).unwrap();
        }
        s.append_token(0, 99).unwrap();
        s.end_draft(0).unwrap();
        assert_eq!(s.tokens(0).unwrap(), [0, 1, 2, 1, 50, 51, 99]);
        // 7 tokens need 2 blocks: the third, holding only rejected slots, is back.
        assert_eq!(blocks_in_use(&s), 2);
        let blocks = s.kv_cache().blocks(0).unwrap().ids().to_vec();
        let pool = s.kv_cache().pool();
        assert!(pool.hash_of(blocks[0]).is_some(), "full of accepted tokens");
        assert!(
            pool.hash_of(blocks[1]).is_none(),
            "holds 2 computed tokens of 4"
        );
        // The next step computes the correction token alone.
        assert_eq!(step(&mut s), [(0, 6, 1)]);
    }

    #[test]
    fn removing_and_finishing_free_blocks() {
        let mut s = scheduler(8, 64);
        s.add_sequence(0, tokens(0, 9), "").unwrap();
        s.add_sequence(1, tokens(20, 9), "").unwrap();
        step(&mut s);
        assert_eq!(blocks_in_use(&s), 6);
        s.finish(0).unwrap();
        assert!(s.has_work());
        assert_eq!(s.tokens(0).unwrap().len(), 10, "tokens stay until removed");
        s.remove(1).unwrap();
        assert!(!s.has_work());
        assert_eq!(blocks_in_use(&s), 0);
        assert_eq!(s.remove(1), Err(KvError::UnknownSequence(1)));
    }
}
