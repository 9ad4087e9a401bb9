//! A step's shape on the GPU, as plain host logic: which decode steps are padded to which batch
//! bucket (and so which CUDA graph replays them), and the step's inputs packed into one buffer of
//! 32-bit words that a single upload fills. Nothing here touches the device.
//!
//! Inputs layout, in words from the buffer's start: first the arrays whose place depends only on
//! the step's shape (so a captured graph's pointers stay right for every step of its bucket),
//! then the variable-length tail (block tables, the sampling rows' penalties and grammar
//! bitmaps), which kernels reach through offsets held in the arrays themselves.

use duet_engine::batch::ForwardBatch;

use crate::kernels::PARTITION_TOKENS;

/// Decode batch sizes with a graph of their own: 1, 2, 4, 8, then steps of 8 up to 32, 16 up to
/// 64, 32 up to 128, and half the previous power of two beyond; `max` itself ends the list.
pub fn buckets(max: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut b = 1;
    while b < max {
        out.push(b);
        b = if b < 8 {
            b * 2
        } else {
            let pow2 = 1 << (usize::BITS - 1 - b.leading_zeros());
            b + (pow2 / 2).max(8)
        };
    }
    out.push(max.max(1));
    out
}

/// The bucket a decode step of `rows` rows is padded to: the smallest that holds it, or `rows`
/// itself past the largest.
pub fn bucket_for(buckets: &[usize], rows: usize) -> usize {
    buckets.iter().copied().find(|&b| b >= rows).unwrap_or(rows)
}

/// Decode attention's partitions for a context of `max_context` tokens, rounded up to a power of
/// two so that a few graphs cover every context (the kernels read only a row's own partitions, so
/// the count changes no result).
pub fn partition_class(max_context: usize) -> usize {
    max_context
        .div_ceil(PARTITION_TOKENS)
        .max(1)
        .next_power_of_two()
}

/// What a captured graph is specific to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GraphKey {
    /// Rows of the step (its bucket).
    pub rows: usize,
    /// Decode attention's partitions.
    pub partitions: usize,
}

/// Where each array of a step's inputs starts, in words from the buffer's start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InputLayout {
    /// Rows after padding (the batch's rows, or its bucket).
    pub rows: usize,
    /// Rows whose logits are computed (padded decode steps: every row).
    pub logit_rows: usize,
    pub seqs: usize,
    pub decode_rows: usize,
    pub prefill_seqs: usize,
    pub tokens: usize,
    pub positions: usize,
    pub slots: usize,
    pub row_seq: usize,
    pub logit_row_ids: usize,
    /// Word offset of each sequence's block table (from the buffer's start).
    pub table_offsets: usize,
    pub decode_row_ids: usize,
    pub prefill_row_start: usize,
    pub prefill_len: usize,
    pub prefill_start_pos: usize,
    pub prefill_table_offsets: usize,
    /// The start of the variable-length tail (block tables first).
    pub tail: usize,
    /// Words in use after the block tables.
    pub used: usize,
    /// Decode attention's partitions (0 without decode rows).
    pub partitions: usize,
    /// The graph this step may replay (padded decode steps).
    pub graph: Option<GraphKey>,
}

/// Packs `batch` into `words` (cleared first). A decode-only step (every sequence one new token,
/// every row's logits wanted) is padded to its bucket, whether or not graphs replay it, so that
/// its matrix products have the same shapes either way; the padded rows read and write the
/// scratch block `scratch_block` (token 0 at position 0).
pub fn pack_inputs(
    batch: &ForwardBatch,
    buckets: &[usize],
    scratch_block: u32,
    words: &mut Vec<u32>,
) -> InputLayout {
    let n = batch.num_rows();
    let decode_only = n > 0
        && batch.seqs.iter().all(|s| s.len == 1)
        && batch.logit_rows.len() == n
        && batch.logit_rows.iter().enumerate().all(|(i, &r)| i == r);
    let rows = if decode_only {
        bucket_for(buckets, n)
    } else {
        n
    };
    let padding = rows - n;
    let seqs = batch.seqs.len() + padding;
    let logit_rows = if padding > 0 {
        rows
    } else {
        batch.logit_rows.len()
    };
    let decode: Vec<usize> = batch
        .seqs
        .iter()
        .filter(|s| s.len == 1)
        .map(|s| s.row_start)
        .chain(n..rows)
        .collect();
    let prefill: Vec<usize> = (0..batch.seqs.len())
        .filter(|&i| batch.seqs[i].len > 1)
        .collect();
    let mut at = 0;
    let mut take = |len: usize| {
        let start = at;
        at += len;
        start
    };
    let mut layout = InputLayout {
        rows,
        logit_rows,
        seqs,
        decode_rows: decode.len(),
        prefill_seqs: prefill.len(),
        tokens: take(rows),
        positions: take(rows),
        slots: take(rows),
        row_seq: take(rows),
        logit_row_ids: take(logit_rows),
        table_offsets: take(seqs),
        decode_row_ids: take(decode.len()),
        prefill_row_start: take(prefill.len()),
        prefill_len: take(prefill.len()),
        prefill_start_pos: take(prefill.len()),
        prefill_table_offsets: take(prefill.len()),
        ..Default::default()
    };
    layout.tail = at;
    words.clear();
    words.resize(layout.tail, 0);
    let scratch_slot = scratch_block * batch.block_size as u32;
    let fill = |words: &mut Vec<u32>, start: usize, values: &mut dyn Iterator<Item = u32>| {
        for (w, v) in words[start..].iter_mut().zip(values) {
            *w = v;
        }
    };
    fill(
        words,
        layout.tokens,
        &mut batch
            .tokens
            .iter()
            .copied()
            .chain(std::iter::repeat_n(0, padding)),
    );
    fill(
        words,
        layout.positions,
        &mut batch
            .positions
            .iter()
            .copied()
            .chain(std::iter::repeat_n(0, padding)),
    );
    fill(
        words,
        layout.slots,
        &mut batch
            .slots
            .iter()
            .copied()
            .chain(std::iter::repeat_n(scratch_slot, padding)),
    );
    let real_seqs = batch.seqs.len() as u32;
    fill(
        words,
        layout.row_seq,
        &mut batch
            .row_seq
            .iter()
            .copied()
            .chain(real_seqs..real_seqs + padding as u32),
    );
    let logit_ids: Vec<u32> = if padding > 0 {
        (0..rows as u32).collect()
    } else {
        batch.logit_rows.iter().map(|&r| r as u32).collect()
    };
    fill(words, layout.logit_row_ids, &mut logit_ids.into_iter());
    fill(
        words,
        layout.decode_row_ids,
        &mut decode.iter().map(|&r| r as u32),
    );
    // Block tables in the tail; each sequence's offset points at its own.
    let mut table_at = Vec::with_capacity(seqs);
    for s in &batch.seqs {
        table_at.push(words.len() as u32);
        words.extend_from_slice(&s.block_table);
    }
    if padding > 0 {
        let scratch_table = words.len() as u32;
        words.push(scratch_block);
        table_at.extend(std::iter::repeat_n(scratch_table, padding));
    }
    fill(words, layout.table_offsets, &mut table_at.iter().copied());
    fill(
        words,
        layout.prefill_row_start,
        &mut prefill.iter().map(|&i| batch.seqs[i].row_start as u32),
    );
    fill(
        words,
        layout.prefill_len,
        &mut prefill.iter().map(|&i| batch.seqs[i].len as u32),
    );
    fill(
        words,
        layout.prefill_start_pos,
        &mut prefill.iter().map(|&i| batch.seqs[i].start_pos as u32),
    );
    fill(
        words,
        layout.prefill_table_offsets,
        &mut prefill.iter().map(|&i| table_at[i]),
    );
    layout.used = words.len();
    let max_context = batch
        .seqs
        .iter()
        .filter(|s| s.len == 1)
        .map(|s| s.context_len())
        .max();
    layout.partitions = match max_context {
        None => 0,
        // A decode step's partitions are its graph's class; others take what they need.
        Some(c) if decode_only => partition_class(c),
        Some(c) => c.div_ceil(PARTITION_TOKENS),
    };
    layout.graph = (decode_only && buckets.contains(&rows)).then_some(GraphKey {
        rows,
        partitions: layout.partitions,
    });
    layout
}

/// A bump allocator over one workspace: a step's activations, handed out in the order the
/// forward pass asks for them, so a step of the same shape gets the same addresses (what a
/// replayed graph relies on). Offsets are aligned to 256 bytes.
#[derive(Debug, Default)]
pub struct Arena {
    /// Bytes of the workspace.
    pub capacity: usize,
    /// Bytes handed out in the current step.
    pub used: usize,
    /// The most one step has asked for, past the capacity too.
    pub high_water: usize,
}

pub const ARENA_ALIGN: usize = 256;

impl Arena {
    /// Starts a step.
    pub fn reset(&mut self) {
        self.used = 0;
    }

    /// The offset of `bytes` more, or `None` when the workspace is full (the step then allocates
    /// on its own, and the workspace grows to the high-water mark before the next step).
    pub fn take(&mut self, bytes: usize) -> Option<usize> {
        let start = self.used;
        self.used += bytes.div_ceil(ARENA_ALIGN).max(1) * ARENA_ALIGN;
        self.high_water = self.high_water.max(self.used);
        (self.used <= self.capacity).then_some(start)
    }

    /// Bytes the workspace should have before the next step, if it must grow.
    pub fn wanted(&self) -> Option<usize> {
        (self.high_water > self.capacity).then_some(self.high_water)
    }
}

/// Bytes an arena needs for activations of these `[rows][cols]` f32 shapes.
pub fn arena_bytes(shapes: &[(usize, usize)]) -> usize {
    shapes
        .iter()
        .map(|&(r, c)| (r * c * 4).div_ceil(ARENA_ALIGN).max(1) * ARENA_ALIGN)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use duet_engine::batch::{LogitsWanted, SeqInput};

    #[test]
    fn buckets_follow_the_issue_s_list_up_to_the_maximum() {
        assert_eq!(
            buckets(256),
            vec![1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256]
        );
        assert_eq!(buckets(50), vec![1, 2, 4, 8, 16, 24, 32, 48, 50]);
        assert_eq!(buckets(1), vec![1]);
        let b = buckets(64);
        assert_eq!(bucket_for(&b, 1), 1);
        assert_eq!(bucket_for(&b, 3), 4);
        assert_eq!(bucket_for(&b, 17), 24);
        assert_eq!(bucket_for(&b, 64), 64);
        assert_eq!(bucket_for(&b, 65), 65, "past the largest: not padded");
    }

    #[test]
    fn partition_classes_are_powers_of_two() {
        assert_eq!(partition_class(1), 1);
        assert_eq!(partition_class(512), 1);
        assert_eq!(partition_class(513), 2);
        assert_eq!(partition_class(1500), 4);
        assert_eq!(partition_class(4097), 16);
    }

    fn decode_batch(contexts: &[usize]) -> ForwardBatch {
        let tables: Vec<Vec<u32>> = contexts
            .iter()
            .enumerate()
            .map(|(s, &c)| {
                (0..c.div_ceil(4) as u32)
                    .map(|b| b * 10 + s as u32)
                    .collect()
            })
            .collect();
        let tokens: Vec<[u32; 1]> = (0..contexts.len() as u32).map(|t| [t + 5]).collect();
        let inputs: Vec<SeqInput<'_>> = contexts
            .iter()
            .zip(&tables)
            .zip(&tokens)
            .map(|((&c, table), t)| SeqInput {
                tokens: t,
                start_pos: c - 1,
                block_table: table,
                logits: LogitsWanted::Last,
            })
            .collect();
        ForwardBatch::new(&inputs, 4, 10_000, 100, 10_000).unwrap()
    }

    #[test]
    fn a_decode_step_is_padded_to_its_bucket_with_rows_on_the_scratch_block() {
        let batch = decode_batch(&[3, 9, 600]);
        let b = buckets(16);
        let mut words = Vec::new();
        let l = pack_inputs(&batch, &b, 999, &mut words);
        assert_eq!((l.rows, l.logit_rows, l.seqs, l.decode_rows), (4, 4, 4, 4));
        assert_eq!(
            l.graph,
            Some(GraphKey {
                rows: 4,
                partitions: 2
            })
        );
        let at = |start: usize, len: usize| words[start..start + len].to_vec();
        assert_eq!(at(l.tokens, 4), vec![5, 6, 7, 0]);
        assert_eq!(at(l.positions, 4), vec![2, 8, 599, 0]);
        assert_eq!(
            words[l.slots + 3],
            999 * 4,
            "the padded row writes the scratch block"
        );
        assert_eq!(at(l.row_seq, 4), vec![0, 1, 2, 3]);
        assert_eq!(at(l.logit_row_ids, 4), vec![0, 1, 2, 3]);
        assert_eq!(at(l.decode_row_ids, 4), vec![0, 1, 2, 3]);
        // Each table where its offset says; the padded sequence's is the scratch block.
        let table = |s: usize, len: usize| at(words[l.table_offsets + s] as usize, len);
        assert_eq!(table(1, 3), vec![1, 11, 21]);
        assert_eq!(table(2, 150)[149], 1492);
        assert_eq!(table(3, 1), vec![999]);
        assert_eq!(l.used, words.len());
        // The shape's arrays sit where they sit for any step of the bucket.
        let other = decode_batch(&[70, 1, 2000, 5]);
        let mut w2 = Vec::new();
        let l2 = pack_inputs(&other, &b, 999, &mut w2);
        assert_eq!(
            (l2.tokens, l2.slots, l2.table_offsets, l2.tail),
            (l.tokens, l.slots, l.table_offsets, l.tail)
        );
        assert_eq!(
            l2.graph,
            Some(GraphKey {
                rows: 4,
                partitions: 4
            })
        );
    }

    #[test]
    fn mixed_steps_and_steps_past_the_buckets_are_not_padded() {
        let tokens = [1u32, 2, 3];
        let table = [4u32, 5];
        let decode_table = [6u32];
        let inputs = [
            SeqInput {
                tokens: &tokens,
                start_pos: 2,
                block_table: &table,
                logits: LogitsWanted::Last,
            },
            SeqInput {
                tokens: &tokens[..1],
                start_pos: 0,
                block_table: &decode_table,
                logits: LogitsWanted::Last,
            },
        ];
        let batch = ForwardBatch::new(&inputs, 4, 10, 10, 100).unwrap();
        let mut words = Vec::new();
        let l = pack_inputs(&batch, &buckets(8), 9, &mut words);
        assert_eq!(
            (l.rows, l.logit_rows, l.decode_rows, l.prefill_seqs, l.graph),
            (4, 2, 1, 1, None)
        );
        assert_eq!(words[l.logit_row_ids..l.logit_row_ids + 2], [2, 3]);
        assert_eq!(words[l.prefill_start_pos], 2);
        assert_eq!(words[l.decode_row_ids], 3);
        assert_eq!(l.partitions, 1);
        let l = pack_inputs(&decode_batch(&[3, 4, 5, 6, 7]), &buckets(4), 9, &mut words);
        assert_eq!(
            (l.rows, l.graph),
            (5, None),
            "past the buckets: neither padded nor graphed"
        );
    }

    #[test]
    fn the_arena_hands_out_aligned_repeatable_offsets_and_asks_to_grow() {
        let mut a = Arena {
            capacity: 1024,
            ..Default::default()
        };
        assert_eq!(a.take(4), Some(0));
        assert_eq!(a.take(300), Some(256));
        assert_eq!(a.take(256), Some(768));
        assert_eq!(a.wanted(), None);
        a.reset();
        assert_eq!(a.take(4), Some(0), "the same order, the same offsets");
        assert_eq!(a.take(2000), None);
        assert_eq!(a.wanted(), Some(256 + 2048));
        assert_eq!(arena_bytes(&[(1, 1), (2, 100)]), 256 + 1024);
    }
}
