//! Causal attention over the paged KV cache ([`CpuKvStore`]).
//!
//! A row's context is cut into spans at fixed positions (every [`SPAN_TOKENS`], on block
//! boundaries); each span's attention is computed for the query heads sharing one KV head at once,
//! so each key and value is read once, and a context of several spans is merged by the spans'
//! log-sum-exps, in span order. The arithmetic of a row thus depends on its own context only —
//! never on the other rows of the step, the thread count, or whether it is a prompt or a decode
//! row — so a sequence's tokens are the same alone and in any batch.
//!
//! How the work is dealt to threads is chosen per step. When there are enough rows to keep every
//! thread busy, a piece is a tile of up to [`TILE_ROWS`] consecutive rows of one sequence (a
//! prompt chunk's rows; a decode row alone) with all their spans, and the spans its rows share are
//! one call for all of them, which reads each key and value once. Otherwise — single-stream decode
//! of a long context — every span is a piece of its own and the merge follows. A piece covers all
//! KV heads of its rows, so it reads each cache block of a layer as one contiguous run (the heads
//! are adjacent), unless that leaves too few pieces, when each KV head is a piece of its own.
//! Threads take pieces largest first from a shared counter, so the long rows of a causal prompt do
//! not end up on one thread.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::kv_store::{CpuKvStore, KvData, KvElement, KvView};
use crate::quant::KernelPath;
use duet_engine::backend::AttentionShape;
use duet_engine::batch::ForwardBatch;

use super::vector::exp_approx;
use super::{CpuBackend, CpuTensor, SendPtr};

#[cfg(target_arch = "x86_64")]
mod x86;

/// Pieces per thread a step needs before each row is one piece: enough that threads finishing
/// early find more work.
const PIECES_PER_THREAD: usize = 8;
/// Pieces per thread below which each KV head is a piece of its own.
const MIN_PIECES_PER_THREAD: usize = 2;
/// Positions per span (rounded up to whole cache blocks). Short enough that one long sequence
/// splits into pieces for every thread and its scores stay in L1; long enough that a span's fixed
/// costs (its share of the merge, a block walk) stay small next to streaming its keys and values.
const SPAN_TOKENS: usize = 128;
/// Most rows of one sequence in a tile: a prompt chunk's rows read the keys and values of the
/// spans they share once per tile, not once per row. Their scores take
/// `TILE_ROWS * query heads * SPAN_TOKENS` floats (36 KiB for 9 heads), which stay in L1.
const TILE_ROWS: usize = 8;

pub(super) fn paged_attention(
    backend: &CpuBackend,
    q: &CpuTensor,
    kv: &CpuKvStore,
    layer: usize,
    shape: AttentionShape,
    batch: &ForwardBatch,
    out: &mut CpuTensor,
) {
    let layout = kv.layout;
    match &kv.data {
        KvData::F32(data) => {
            let kv = KvView {
                layout,
                data,
                scales: &[],
            };
            attention_over(backend, q, kv, layer, shape, batch, out)
        }
        KvData::F16(data) => {
            let kv = KvView {
                layout,
                data,
                scales: &[],
            };
            attention_over(backend, q, kv, layer, shape, batch, out)
        }
        KvData::Int8 { values, scales } => {
            let kv = KvView {
                layout,
                data: &values[..],
                scales,
            };
            attention_over(backend, q, kv, layer, shape, batch, out)
        }
    }
}

fn attention_over<E: KvElement>(
    backend: &CpuBackend,
    q: &CpuTensor,
    kv: KvView<'_, E>,
    layer: usize,
    shape: AttentionShape,
    batch: &ForwardBatch,
    out: &mut CpuTensor,
) {
    let (pool, path) = (&backend.pool, backend.kernels);
    let (hd, kvh, rows) = (shape.head_dim, shape.num_kv_heads, q.rows);
    let group = shape.num_heads / kvh;
    let ctx = |row: usize| batch.positions[row] as usize + 1;
    let max_ctx = (0..rows).map(ctx).max().unwrap_or(0);
    let plan = SpanPlan::new(kv.layout.block_size);
    let max_spans = plan.spans(max_ctx);
    let threads = pool.n_threads();
    let split = rows < PIECES_PER_THREAD * threads && max_spans > 1;
    // Consecutive rows of one sequence (a prompt chunk) share their context's leading spans,
    // which a tile of them reads once; when spans are pieces of their own, every row is a tile.
    let tiles = RowTiles::new(batch, if split { 1 } else { TILE_ROWS });
    let tile_rows = tiles.max_rows();
    let tile_pieces = if split {
        tiles.len() * max_spans
    } else {
        tiles.len()
    };
    // KV heads per piece, and the query heads they serve: `unit` = (tile, set of KV heads).
    let heads = if tile_pieces < MIN_PIECES_PER_THREAD * threads {
        1
    } else {
        kvh
    };
    let (head_sets, q_heads) = (kvh / heads, heads * group);
    let units = tiles.len() * head_sets;
    let kernel = span_kernel::<E>(path, hd);
    // Pieces that are single spans of a context write to `partials`, merged once all have run.
    let mut partials = SpanResults::new(if split { units * max_spans } else { 0 }, q_heads, hd);
    let partial_ptrs = (
        SendPtr(partials.out.as_mut_ptr()),
        SendPtr(partials.lse.as_mut_ptr()),
    );
    let out_ptr = SendPtr(out.data.as_mut_ptr());
    let (out_cols, q_cols) = (out.cols, q.cols);
    let pieces = if split { units * max_spans } else { units };
    let taken = AtomicUsize::new(0);
    pool.run(|_, _| {
        let kept_spans = if split { 0 } else { max_spans };
        let mut scratch = Scratch::new(q_heads, plan.span_tokens, hd, tile_rows, kept_spans);
        loop {
            let i = taken.fetch_add(1, Ordering::Relaxed);
            if i >= pieces {
                break;
            }
            // Largest first: later rows of a batch have the longer contexts.
            let piece = pieces - 1 - i;
            let (unit, span) = if split {
                (piece / max_spans, Some(piece % max_spans))
            } else {
                (piece, None)
            };
            let (tile, first_kvh) = (tiles.get(unit / head_sets), unit % head_sets * heads);
            let last = tile.end - 1;
            let spans = plan.spans(ctx(last));
            if span.is_some_and(|s| s >= spans) {
                continue;
            }
            let seq = &batch.seqs[batch.row_seq[tile.start] as usize];
            let first_head = first_kvh * group;
            // Span `s` for the tile's rows `rows` (all of them end it at the same position).
            let span_of = |s: usize, rows: std::ops::Range<usize>| {
                let (start, end) = plan.span(s, ctx(rows.end - 1));
                Span {
                    kv,
                    layer,
                    kvh: first_kvh,
                    heads,
                    block_table: &seq.block_table,
                    start,
                    end,
                    rows: rows.len(),
                    q: &q.data[rows.start * q_cols + first_head * hd..],
                    q_stride: q_cols,
                    group,
                    head_dim: hd,
                }
            };
            // SAFETY (both): each piece owns its outputs: a unit (or the only span of its
            // context) the outputs of its rows' query heads of its KV heads, a span of a context
            // of several its slot in `partials`.
            let out_of_row = |row: usize| unsafe {
                out_ptr.slice(row * out_cols + first_head * hd, q_heads * hd)
            };
            match span {
                _ if spans == 1 && tile.len() == 1 => kernel(
                    &span_of(0, tile.clone()),
                    &mut scratch.work,
                    out_of_row(tile.start),
                    &mut scratch.lse,
                ),
                Some(s) => unsafe {
                    let at = unit * max_spans + s;
                    kernel(
                        &span_of(s, tile.clone()),
                        &mut scratch.work,
                        partial_ptrs.0.slice(at * q_heads * hd, q_heads * hd),
                        partial_ptrs.1.slice(at * q_heads, q_heads),
                    )
                },
                None => {
                    // Results `[span][row of the tile]`: a span the rows share is one call for
                    // all of them, the spans where their contexts end one call per row.
                    let (parts, n) = (&mut scratch.spans, tile.len());
                    for s in 0..spans {
                        if plan.span(s, ctx(tile.start)) == plan.span(s, ctx(last)) {
                            let (po, pl) = parts.slots_mut(s * n, n);
                            kernel(&span_of(s, tile.clone()), &mut scratch.work, po, pl);
                            continue;
                        }
                        for row in tile.clone().filter(|&row| s < plan.spans(ctx(row))) {
                            let (po, pl) = parts.slots_mut(s * n + row - tile.start, 1);
                            kernel(&span_of(s, row..row + 1), &mut scratch.work, po, pl);
                        }
                    }
                    for row in tile.clone() {
                        let r = row - tile.start;
                        parts.merge(r, plan.spans(ctx(row)), n, out_of_row(row));
                    }
                }
            }
        }
    });
    if split {
        for unit in 0..units {
            let (row, first_kvh) = (tiles.get(unit / head_sets).start, unit % head_sets * heads);
            let spans = plan.spans(ctx(row));
            if spans > 1 {
                let o = &mut out.data[row * out_cols + first_kvh * group * hd..][..q_heads * hd];
                partials.merge(unit * max_spans, spans, 1, o);
            }
        }
    }
}

/// The step's rows in tiles: runs of at most `max_rows` consecutive rows of one sequence, in
/// row order.
struct RowTiles {
    starts: Vec<usize>,
}

impl RowTiles {
    fn new(batch: &ForwardBatch, max_rows: usize) -> Self {
        let rows = batch.row_seq.len();
        let mut starts = Vec::with_capacity(rows + 1);
        for row in 0..rows {
            let new_seq = row == 0 || batch.row_seq[row] != batch.row_seq[row - 1];
            if new_seq || row - starts.last().copied().unwrap_or(0) == max_rows {
                starts.push(row);
            }
        }
        starts.push(rows);
        Self { starts }
    }

    fn len(&self) -> usize {
        self.starts.len() - 1
    }

    /// The most rows a tile has.
    fn max_rows(&self) -> usize {
        self.starts
            .windows(2)
            .map(|w| w[1] - w[0])
            .max()
            .unwrap_or(0)
    }

    /// The rows of tile `i`.
    fn get(&self, i: usize) -> std::ops::Range<usize> {
        self.starts[i]..self.starts[i + 1]
    }
}

/// Where every context is cut: at every `span_tokens` positions, a whole number of cache blocks.
#[derive(Clone, Copy, Debug, PartialEq)]
struct SpanPlan {
    span_tokens: usize,
}

impl SpanPlan {
    fn new(block_size: usize) -> Self {
        Self {
            span_tokens: SPAN_TOKENS.div_ceil(block_size).max(1) * block_size,
        }
    }

    /// How many spans a `ctx`-token context is cut into.
    fn spans(self, ctx: usize) -> usize {
        ctx.div_ceil(self.span_tokens).max(1)
    }

    /// Positions `[start, end)` of span `i` of a `ctx`-token context (`i < self.spans(ctx)`).
    fn span(self, i: usize, ctx: usize) -> (usize, usize) {
        let start = i * self.span_tokens;
        (start, ctx.min(start + self.span_tokens))
    }
}

/// Spans' results: each span's attention output normalised over the span,
/// `[span][head][head_dim]`, and its log-sum-exp of scores, `[span][head]`.
struct SpanResults {
    q_heads: usize,
    head_dim: usize,
    out: Vec<f32>,
    lse: Vec<f32>,
}

impl SpanResults {
    fn new(spans: usize, q_heads: usize, head_dim: usize) -> Self {
        Self {
            q_heads,
            head_dim,
            out: vec![0.0; spans * q_heads * head_dim],
            lse: vec![0.0; spans * q_heads],
        }
    }

    /// Results `first..first + count`' outputs and log-sum-exps, for a kernel to write.
    fn slots_mut(&mut self, first: usize, count: usize) -> (&mut [f32], &mut [f32]) {
        let (g, hd) = (self.q_heads, self.head_dim);
        (
            &mut self.out[first * g * hd..][..count * g * hd],
            &mut self.lse[first * g..][..count * g],
        )
    }

    /// `out` (`[head][head_dim]`) from the `spans` spans of one context, span `s` at result
    /// `first + s * stride`: every span's output weighted by its share of the softmax,
    /// `exp(lse_span - lse_all)`, summed in span order — the one merge, whichever thread ran the
    /// spans. A context of one span is its output as it is.
    fn merge(&self, first: usize, spans: usize, stride: usize, out: &mut [f32]) {
        let (g, hd) = (self.q_heads, self.head_dim);
        let at = |s: usize| first + s * stride;
        if spans == 1 {
            out.copy_from_slice(&self.out[at(0) * g * hd..][..g * hd]);
            return;
        }
        for h in 0..g {
            let lse = |s: usize| self.lse[at(s) * g + h];
            let max = (0..spans).map(lse).fold(f32::NEG_INFINITY, f32::max);
            let weight = |s: usize| exp_approx(lse(s) - max);
            let inv = 1.0 / (0..spans).map(weight).sum::<f32>();
            let o = &mut out[h * hd..][..hd];
            o.fill(0.0);
            for s in 0..spans {
                let w = weight(s);
                let part = &self.out[(at(s) * g + h) * hd..][..hd];
                for (oi, &pi) in o.iter_mut().zip(part) {
                    *oi += w * inv * pi;
                }
            }
        }
    }
}

/// One piece: for each of `rows` rows of a sequence, the `group` query heads of each of KV heads
/// `kvh..kvh + heads` attending positions `start..end` (`start` on a block boundary).
pub(crate) struct Span<'a, E> {
    kv: KvView<'a, E>,
    layer: usize,
    kvh: usize,
    heads: usize,
    block_table: &'a [u32],
    start: usize,
    end: usize,
    rows: usize,
    /// Row `r`'s query heads, `[heads * group][head_dim]`, at `r * q_stride`.
    q: &'a [f32],
    q_stride: usize,
    group: usize,
    head_dim: usize,
}

impl<E> Span<'_, E> {
    fn len(&self) -> usize {
        self.end - self.start
    }

    /// Query heads of the span: `group` for each of its KV heads.
    fn q_heads(&self) -> usize {
        self.heads * self.group
    }

    /// Row `r`'s query heads.
    fn q_row(&self, r: usize) -> &[f32] {
        &self.q[r * self.q_stride..][..self.q_heads() * self.head_dim]
    }

    /// `(first position, block id)` of every cache block holding positions of the span.
    fn blocks(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        let bs = self.kv.layout.block_size;
        self.block_table[self.start / bs..]
            .iter()
            .enumerate()
            .map(move |(i, &block)| (self.start + i * bs, block as usize))
            .take_while(|&(first, _)| first < self.end)
    }
}

/// A kernel thread's working memory, reused across the pieces it runs.
struct Scratch {
    work: KernelScratch,
    /// Log-sum-exps of a context of one span, which nobody reads.
    lse: Vec<f32>,
    /// The spans of a context of several, merged by this thread.
    spans: SpanResults,
}

impl Scratch {
    /// For pieces of spans of at most `span_tokens` positions over tiles of up to `tile_rows`
    /// rows, keeping `spans` spans' results per row (0 when each span is a piece of its own).
    fn new(
        q_heads: usize,
        span_tokens: usize,
        head_dim: usize,
        tile_rows: usize,
        spans: usize,
    ) -> Self {
        Self {
            work: KernelScratch::new(tile_rows * q_heads, span_tokens, head_dim),
            lse: vec![0.0; q_heads],
            spans: SpanResults::new(spans * tile_rows, q_heads, head_dim),
        }
    }
}

/// Slots of the AVX2 kernel's chunks of keys (its 8 lanes).
const TILE_SLOTS: usize = 8;

pub(crate) struct KernelScratch {
    /// `[row][q_heads][span]`: the scores, then the normalised softmax weights.
    scores: Vec<f32>,
    /// A chunk of fewer than [`TILE_SLOTS`] keys widened to f32, `[head_dim][TILE_SLOTS]`, zero
    /// past the slots in use (the AVX2 kernel's partial chunks).
    tile: Vec<f32>,
}

impl KernelScratch {
    /// For `queries` query heads (over all rows) of spans of at most `span_tokens` positions.
    fn new(queries: usize, span_tokens: usize, head_dim: usize) -> Self {
        Self {
            scores: vec![0.0; queries * span_tokens],
            tile: vec![0.0; TILE_SLOTS * head_dim],
        }
    }
}

/// Attention over one span: writes its rows' query heads' outputs normalised over the span to
/// `out` (`[row][q_heads][head_dim]`) and each one's log-sum-exp of scaled scores to `lse`
/// (`[row][q_heads]`). A row's results are the same bits whatever rows it shares the call with.
type SpanKernel<E> = fn(&Span<'_, E>, &mut KernelScratch, &mut [f32], &mut [f32]);

/// The kernel of `path` for this head size: AVX-512 for head sizes that are a multiple of 16,
/// AVX2 for multiples of 8, otherwise the portable code (compiled a second time with AVX2 and FMA
/// on the vector paths, so its fixed-width loops become vector instructions).
fn span_kernel<E: KvElement>(path: KernelPath, head_dim: usize) -> SpanKernel<E> {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY (all three): `path` is only ever a path this CPU supports.
        if path == KernelPath::Avx512 && head_dim.is_multiple_of(16) {
            return |s, w, o, l| unsafe { x86::attend_avx512(s, w, o, l) };
        }
        if path != KernelPath::Scalar && head_dim.is_multiple_of(8) {
            return |s, w, o, l| unsafe { x86::attend_avx2(s, w, o, l) };
        }
        if path != KernelPath::Scalar {
            return |s, w, o, l| unsafe { attend_autovectorized(s, w, o, l) };
        }
    }
    let _ = (path, head_dim);
    attend_portable::<E>
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_autovectorized<E: KvElement>(
    s: &Span<'_, E>,
    work: &mut KernelScratch,
    out: &mut [f32],
    lse: &mut [f32],
) {
    attend(s, work, out, lse)
}

fn attend_portable<E: KvElement>(
    s: &Span<'_, E>,
    work: &mut KernelScratch,
    out: &mut [f32],
    lse: &mut [f32],
) {
    attend(s, work, out, lse)
}

#[inline(always)]
fn attend<E: KvElement>(
    u: &Span<'_, E>,
    work: &mut KernelScratch,
    out: &mut [f32],
    lse: &mut [f32],
) {
    let (hd, n, g, qh) = (u.head_dim, u.len(), u.group, u.q_heads());
    let (bs, key_group) = (u.kv.layout.block_size, u.kv.layout.key_scale_group());
    let scale = 1.0 / (hd as f32).sqrt();
    let scores = &mut work.scores[..u.rows * qh * n];
    // Scores: a block's keys (`[head_dim][slot]`) taken one dimension at a time across its
    // slots, for every query head of the group of every row.
    for (first, block) in u.blocks() {
        let cnt = bs.min(u.end - first);
        for head in 0..u.heads {
            let keys = u.kv.head_block(u.layer, block, 0, u.kvh + head);
            let key_scales = u.kv.head_block_scales(u.layer, block, 0, u.kvh + head);
            for r in 0..u.rows {
                let q = u.q_row(r);
                for h in head * g..(head + 1) * g {
                    let row = &mut scores[(r * qh + h) * n + first - u.start..][..cnt];
                    row.fill(0.0);
                    for (d, &qd) in q[h * hd..(h + 1) * hd].iter().enumerate() {
                        let k = &keys[d * bs..d * bs + cnt];
                        if E::SCALED {
                            let ks = &key_scales[d / key_group * bs..][..cnt];
                            for ((x, ki), si) in row.iter_mut().zip(k).zip(ks) {
                                *x += qd * si * ki.to_f32();
                            }
                        } else {
                            axpy(qd, k, row);
                        }
                    }
                    for x in row.iter_mut() {
                        *x *= scale;
                    }
                }
            }
        }
    }
    for (row, l) in scores.chunks_exact_mut(n).zip(lse.iter_mut()) {
        *l = softmax_from(row, row_max(row));
    }
    out.fill(0.0);
    for (first, block) in u.blocks() {
        for head in 0..u.heads {
            let values = u.kv.head_block(u.layer, block, 1, u.kvh + head);
            let value_scales = u.kv.head_block_scales(u.layer, block, 1, u.kvh + head);
            for s in 0..bs.min(u.end - first) {
                let v = &values[s * hd..(s + 1) * hd];
                for h in
                    (0..u.rows).flat_map(|r| (head * g..(head + 1) * g).map(move |h| r * qh + h))
                {
                    let weight = scores[h * n + first - u.start + s];
                    axpy(
                        slot_scale::<E>(weight, value_scales, s),
                        v,
                        &mut out[h * hd..(h + 1) * hd],
                    );
                }
            }
        }
    }
}

/// `x` times slot `s`'s scale, for an element type whose tokens carry one (`scales` is the
/// block's, of one key group or of the values), else `x`.
#[inline(always)]
fn slot_scale<E: KvElement>(x: f32, scales: &[f32], s: usize) -> f32 {
    if E::SCALED { x * scales[s] } else { x }
}

#[inline(always)]
fn axpy<E: KvElement>(alpha: f32, x: &[E], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += alpha * xi.to_f32();
    }
}

/// Independent lanes of the softmax's maximum and sum: one AVX-512 vector (two AVX2 ones), the
/// same order on every kernel path so a row's weights are the same bits on each.
const SOFTMAX_LANES: usize = 16;

/// The largest value of `row`, [`SOFTMAX_LANES`] at a time so it vectorises.
#[inline(always)]
fn row_max(row: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; SOFTMAX_LANES];
    let chunks = row.chunks_exact(SOFTMAX_LANES);
    let tail = chunks
        .remainder()
        .iter()
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    for c in chunks {
        for j in 0..SOFTMAX_LANES {
            acc[j] = acc[j].max(c[j]);
        }
    }
    acc.into_iter().fold(tail, f32::max)
}

/// `row` becomes the softmax of `row` (whose largest value is `max`): `exp(x - max)` by a
/// Cody-Waite range reduction and a degree-6 polynomial (relative error below 2e-7), written
/// branch-free so it vectorises, then divided by the sum. Returns the log-sum-exp of `row`.
#[inline(always)]
fn softmax_from(row: &mut [f32], max: f32) -> f32 {
    let mut acc = [0f32; SOFTMAX_LANES];
    let mut chunks = row.chunks_exact_mut(SOFTMAX_LANES);
    for c in &mut chunks {
        for j in 0..SOFTMAX_LANES {
            c[j] = exp_approx(c[j] - max);
            acc[j] += c[j];
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for v in chunks.into_remainder() {
        *v = exp_approx(*v - max);
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in row.iter_mut() {
        *v *= inv;
    }
    max + sum.ln()
}

#[cfg(test)]
mod tests {
    use super::*;
    use duet_engine::backend::{KvDtype, KvLayout};
    use duet_engine::batch::{LogitsWanted, SeqInput};
    use half::f16;

    fn layout(hd: usize, bs: usize, num_blocks: usize, dtype: KvDtype) -> KvLayout {
        KvLayout {
            num_layers: 2,
            num_kv_heads: 2,
            head_dim: hd,
            block_size: bs,
            num_blocks,
            dtype,
        }
    }

    /// The kernel paths this CPU can run, the portable one first.
    fn paths() -> Vec<KernelPath> {
        KernelPath::all_supported()
    }

    /// Every kernel this CPU can run agrees with a float64 reference (over the values as stored),
    /// for every element type (int8 with each token's own scales), over head sizes that take each vector chunk width and the portable
    /// fallback, GQA groups, blocks whose chunks of keys are taken in pairs, and spans starting
    /// at the context's start or a later block and ending inside and on block boundaries, through
    /// a scattered block table.
    #[test]
    fn kernels_match_a_float64_reference() {
        let mut rng = duet_model::synthetic::Uniform::new(7);
        for (hd, group, bs) in [
            (16, 1, 16),
            (64, 3, 16),
            (80, 4, 7),
            (128, 2, 16),
            (24, 3, 4),
            (8, 2, 5),
            (20, 2, 4),
            (32, 4, 32),
        ] {
            let values = rng.values(layout(hd, bs, 12, KvDtype::F32).bytes() / 4);
            // Both KV heads of the layout: one head a span, and both in one span.
            let q: Vec<f32> = rng.values(2 * group * hd).iter().map(|x| 2.0 * x).collect();
            let q2: Vec<f32> = rng.values(2 * group * hd).iter().map(|x| 2.0 * x).collect();
            let mut f16_data = vec![f16::ZERO; values.len()];
            KvElement::store(&mut f16_data, &values);
            let int8_data: Vec<i8> = values.iter().map(|x| (x * 127.0) as i8).collect();
            let int8_layout = layout(hd, bs, 12, KvDtype::Int8);
            let scales: Vec<f32> = rng
                .values(2 * 12 * int8_layout.layer_block_scales())
                .iter()
                .map(|x| 0.02 + 0.01 * x)
                .collect();
            let f32_layout = layout(hd, bs, 12, KvDtype::F32);
            check_kernels(f32_layout, &values, &[], &q, &q2, group);
            let f16_layout = layout(hd, bs, 12, KvDtype::F16);
            check_kernels(f16_layout, &f16_data, &[], &q, &q2, group);
            check_kernels(int8_layout, &int8_data, &scales, &q, &q2, group);
        }
    }

    fn check_kernels<E: KvElement>(
        layout: KvLayout,
        data: &[E],
        scales: &[f32],
        q: &[f32],
        q2: &[f32],
        group: usize,
    ) {
        let (hd, bs) = (layout.head_dim, layout.block_size);
        let block_table = [5u32, 0, 11, 3, 8, 1, 9];
        let ends = [1, bs - 1, bs, bs + 1, 3 * bs + 2, 7 * bs];
        let spans = ends.iter().map(|&e| (0, e)).chain([
            (bs, bs + 1),
            (2 * bs, 3 * bs + 2),
            (3 * bs, 7 * bs),
        ]);
        for ((start, end), (kvh, heads)) in spans.flat_map(|s| [(s, (1, 1)), (s, (0, 2))]) {
            let q_heads = heads * group;
            let span = Span {
                kv: KvView {
                    layout,
                    data,
                    scales,
                },
                layer: 1,
                kvh,
                heads,
                block_table: &block_table,
                start,
                end,
                rows: 1,
                q: &q[kvh * group * hd..],
                q_stride: 0,
                group,
                head_dim: hd,
            };
            let (want, want_lse) = reference(&span);
            // Three rows sharing the span, the first with the single row's queries.
            let tile_q: Vec<f32> = [&q[kvh * group * hd..][..q_heads * hd], q2, q]
                .iter()
                .flat_map(|x| x[..q_heads * hd].to_vec())
                .collect();
            let tile = Span {
                rows: 3,
                q: &tile_q,
                q_stride: q_heads * hd,
                ..span
            };
            let (tile_want, tile_want_lse) = reference(&tile);
            for path in paths() {
                let kernel = span_kernel::<E>(path, hd);
                let mut work = KernelScratch::new(3 * q_heads, end - start, hd);
                let mut out = vec![f32::NAN; q_heads * hd];
                let mut lse = vec![f32::NAN; q_heads];
                kernel(&span, &mut work, &mut out, &mut lse);
                let what = format!(
                    "{path:?} {}: head_dim {hd} group {group} KV heads {kvh}..{} span {}..{}",
                    layout.dtype,
                    kvh + heads,
                    start,
                    end
                );
                assert_close(&out, &want, &what);
                assert_close(&lse, &want_lse, &format!("{what} lse"));
                let mut tile_out = vec![f32::NAN; 3 * q_heads * hd];
                let mut tile_lse = vec![f32::NAN; 3 * q_heads];
                kernel(&tile, &mut work, &mut tile_out, &mut tile_lse);
                assert_close(&tile_out, &tile_want, &format!("{what}, 3 rows"));
                assert_close(&tile_lse, &tile_want_lse, &format!("{what}, 3 rows, lse"));
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&tile_out[..q_heads * hd]),
                    bits(&out),
                    "{what}: a row's outputs differ in a tile"
                );
                assert_eq!(
                    bits(&tile_lse[..q_heads]),
                    bits(&lse),
                    "{what}: a row's log-sum-exps differ in a tile"
                );
            }
        }
    }

    fn assert_close(got: &[f32], want: &[f64], what: &str) {
        assert_eq!(got.len(), want.len());
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g as f64 - w).abs() <= 1e-5 * (1.0 + w.abs()),
                "{what}: [{i}] = {g}, want {w}"
            );
        }
    }

    /// The span's attention outputs and log-sum-exps of the scaled scores per row and head, in
    /// f64.
    fn reference<E: KvElement>(u: &Span<'_, E>) -> (Vec<f64>, Vec<f64>) {
        let (hd, bs) = (u.head_dim, u.kv.layout.block_size);
        // Keys are stored `[head_dim][slot]`, values `[slot][head_dim]`.
        let slot = |pos: usize, kv: usize, head: usize| {
            let block = u.block_table[pos / bs] as usize;
            let s = pos % bs;
            let data = u.kv.head_block(u.layer, block, kv, u.kvh + head);
            let scales = u.kv.head_block_scales(u.layer, block, kv, u.kvh + head);
            // Keys' scales are `[key group][slot]`, values' `[slot]`.
            let group = if kv == 0 {
                u.kv.layout.key_scale_group()
            } else {
                hd
            };
            let scale = |d: usize| scales.get(d / group * bs + s).map_or(1.0, |&x| x as f64);
            (0..hd)
                .map(|d| {
                    let x = data[if kv == 0 { d * bs + s } else { s * hd + d }];
                    x.to_f32() as f64 * scale(d)
                })
                .collect::<Vec<f64>>()
        };
        let qh = u.q_heads();
        let mut out = vec![0f64; u.rows * qh * hd];
        let mut lse = vec![0f64; u.rows * qh];
        for h in 0..u.rows * qh {
            let head = h % qh / u.group;
            let q = &u.q_row(h / qh)[h % qh * hd..][..hd];
            let logits: Vec<f64> = (u.start..u.end)
                .map(|p| {
                    let d: f64 = q
                        .iter()
                        .zip(slot(p, 0, head))
                        .map(|(&a, b)| a as f64 * b)
                        .sum();
                    d / (hd as f64).sqrt()
                })
                .collect();
            let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
            let sum: f64 = e.iter().sum();
            lse[h] = max + sum.ln();
            for (p, w) in (u.start..u.end).zip(&e) {
                for (o, v) in out[h * hd..(h + 1) * hd].iter_mut().zip(slot(p, 1, head)) {
                    *o += w / sum * v;
                }
            }
        }
        (out, lse)
    }

    /// A cache of `blocks` 16-token blocks of `dtype` whose layer 1 holds random keys and
    /// values, for 2 KV heads of 64 serving 3 query heads each, and that attention shape.
    fn random_cache(
        rng: &mut duet_model::synthetic::Uniform,
        blocks: usize,
        dtype: KvDtype,
    ) -> (CpuKvStore, AttentionShape) {
        let (hd, group, bs, kv_heads) = (64, 3, 16, 2);
        let layout = KvLayout {
            num_kv_heads: kv_heads,
            ..layout(hd, bs, blocks, dtype)
        };
        let mut store = CpuKvStore::new(layout).unwrap();
        let slots: Vec<u32> = (0..(blocks * bs) as u32).collect();
        let width = kv_heads * hd;
        let (k, v) = (
            rng.values(slots.len() * width),
            rng.values(slots.len() * width),
        );
        store.write(1, &k, &v, &slots);
        let shape = AttentionShape {
            num_heads: kv_heads * group,
            num_kv_heads: kv_heads,
            head_dim: hd,
        };
        (store, shape)
    }

    /// The reference outputs of one row's query heads (`q`, `[head][head_dim]`) over positions
    /// `0..ctx` of layer 1 of `store`.
    fn whole_context_reference(
        store: &CpuKvStore,
        shape: AttentionShape,
        block_table: &[u32],
        ctx: usize,
        q: &[f32],
    ) -> Vec<f64> {
        let layout = store.layout;
        match &store.data {
            KvData::F32(data) => {
                let kv = KvView {
                    layout,
                    data,
                    scales: &[],
                };
                context_reference(kv, shape, block_table, ctx, q)
            }
            KvData::F16(data) => {
                let kv = KvView {
                    layout,
                    data,
                    scales: &[],
                };
                context_reference(kv, shape, block_table, ctx, q)
            }
            KvData::Int8 { values, scales } => {
                let kv = KvView {
                    layout,
                    data: &values[..],
                    scales,
                };
                context_reference(kv, shape, block_table, ctx, q)
            }
        }
    }

    fn context_reference<E: KvElement>(
        kv: KvView<'_, E>,
        shape: AttentionShape,
        block_table: &[u32],
        ctx: usize,
        q: &[f32],
    ) -> Vec<f64> {
        let (hd, group) = (shape.head_dim, shape.num_heads / shape.num_kv_heads);
        (0..shape.num_kv_heads)
            .flat_map(|kvh| {
                reference(&Span {
                    kv,
                    layer: 1,
                    kvh,
                    heads: 1,
                    block_table,
                    start: 0,
                    end: ctx,
                    rows: 1,
                    q: &q[kvh * group * hd..],
                    q_stride: 0,
                    group,
                    head_dim: hd,
                })
                .0
            })
            .collect()
    }

    /// The step's attention over layer 1 of `store`, into outputs that start as NaN.
    fn step_attention(
        backend: &CpuBackend,
        q: &CpuTensor,
        store: &CpuKvStore,
        shape: AttentionShape,
        batch: &ForwardBatch,
    ) -> CpuTensor {
        let mut out = CpuTensor {
            data: vec![f32::NAN; q.data.len()],
            rows: q.rows,
            cols: q.cols,
        };
        paged_attention(backend, q, store, 1, shape, batch, &mut out);
        out
    }

    /// Attention for a whole step equals the reference over each row's whole context on every
    /// path and thread count: a long single sequence (every span a piece of its own), with two
    /// short companions (still split), and in a batch of 32 rows (a row's spans merged by one
    /// thread). The long row's outputs are the same bits in every batch and on every thread count:
    /// what a sequence generates does not depend on its companions. For an f16 and an int8 cache.
    #[test]
    fn a_step_equals_whole_contexts_and_a_row_is_independent_of_its_batch() {
        for dtype in [KvDtype::F16, KvDtype::Int8] {
            step_equals_whole_contexts(dtype);
        }
    }

    fn step_equals_whole_contexts(dtype: KvDtype) {
        let mut rng = duet_model::synthetic::Uniform::new(11);
        let (store, shape) = random_cache(&mut rng, 64, dtype);
        let (bs, cols) = (store.layout.block_size, shape.num_heads * shape.head_dim);
        // Sequence A: 700 tokens over blocks 63, 62, ... (scattered, decreasing), always row 0
        // with the same query; B spans two cuts, C and the rest are short.
        let table_a: Vec<u32> = (0..44).map(|b| 63 - b).collect();
        let table_b: Vec<u32> = (4..14).collect();
        let table_c = [3u32];
        let q_a = rng.values(cols);
        let many: Vec<(&[u32], usize)> = [(&table_a[..], 700), (&table_b[..], 150)]
            .into_iter()
            .chain((0..30).map(|i| (&table_c[..], 1 + i % 16)))
            .collect();
        let cases: [&[(&[u32], usize)]; 3] = [
            &[(&table_a, 700)],
            &[(&table_a, 700), (&table_b, 20), (&table_c, 5)],
            &many,
        ];
        let mut row_a: Vec<(KernelPath, Vec<f32>)> = Vec::new();
        for seqs in cases {
            let tokens = [7u32];
            let inputs: Vec<SeqInput> = seqs
                .iter()
                .map(|&(table, ctx)| SeqInput {
                    tokens: &tokens,
                    start_pos: ctx - 1,
                    block_table: table,
                    logits: LogitsWanted::Last,
                })
                .collect();
            let batch = ForwardBatch::new(&inputs, bs, 64, 100, 4096).unwrap();
            let rows = seqs.len();
            let mut q_data = q_a.clone();
            q_data.extend(rng.values((rows - 1) * cols));
            let q = CpuTensor {
                data: q_data.clone(),
                rows,
                cols,
            };
            let want: Vec<f64> = seqs
                .iter()
                .enumerate()
                .flat_map(|(row, &(table, ctx))| {
                    whole_context_reference(&store, shape, table, ctx, &q_data[row * cols..])
                })
                .collect();
            for threads in [1, 2, 3] {
                for path in paths() {
                    let backend = CpuBackend::with_kernels(threads, path);
                    let out = step_attention(&backend, &q, &store, shape, &batch);
                    let what = format!("{path:?} {dtype}, {rows} rows, {threads} threads");
                    assert_close(&out.data, &want, &what);
                    let got_a = out.data[..cols].to_vec();
                    match row_a.iter().find(|(p, _)| *p == path) {
                        Some((_, first)) => assert!(
                            first
                                .iter()
                                .zip(&got_a)
                                .all(|(x, y)| x.to_bits() == y.to_bits()),
                            "{what}: sequence A's attention differs from its first run"
                        ),
                        None => row_a.push((path, got_a)),
                    }
                }
            }
        }
    }

    /// A prompt chunk's rows, which attention takes in tiles sharing their leading spans, are
    /// the same bits as each row computed alone (as a decode row, its spans split among threads),
    /// on every path and thread count: around span cuts, a row whose context ends exactly on one,
    /// and tiles that do not start at a multiple of the tile size.
    #[test]
    fn a_prompt_row_is_the_same_bits_as_the_row_alone() {
        for dtype in [KvDtype::F16, KvDtype::Int8] {
            prompt_row_is_the_row_alone(dtype);
        }
    }

    fn prompt_row_is_the_row_alone(dtype: KvDtype) {
        let mut rng = duet_model::synthetic::Uniform::new(12);
        let (store, shape) = random_cache(&mut rng, 40, dtype);
        let (bs, cols) = (store.layout.block_size, shape.num_heads * shape.head_dim);
        // A 3-row chunk of another sequence first, then positions 100..300 of a prompt.
        let (table_b, table_a): (Vec<u32>, Vec<u32>) =
            ((0..4).collect(), (39..40).chain(4..23).collect());
        let (rows_b, first_a, rows_a) = (3, 100, 200);
        let tokens = vec![7u32; rows_a];
        let inputs = [
            SeqInput {
                tokens: &tokens[..rows_b],
                start_pos: 40,
                block_table: &table_b,
                logits: LogitsWanted::None,
            },
            SeqInput {
                tokens: &tokens,
                start_pos: first_a,
                block_table: &table_a,
                logits: LogitsWanted::None,
            },
        ];
        let batch = ForwardBatch::new(&inputs, bs, 40, 100, 4096).unwrap();
        let rows = rows_b + rows_a;
        let q = CpuTensor {
            data: rng.values(rows * cols),
            rows,
            cols,
        };
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for threads in [1, 2] {
            for path in paths() {
                let backend = CpuBackend::with_kernels(threads, path);
                let out = step_attention(&backend, &q, &store, shape, &batch);
                for pos in [100, 101, 126, 127, 128, 129, 135, 200, 255, 256, 257, 299] {
                    let row = rows_b + pos - first_a;
                    let alone = [SeqInput {
                        tokens: &tokens[..1],
                        start_pos: pos,
                        block_table: &table_a,
                        logits: LogitsWanted::None,
                    }];
                    let alone = ForwardBatch::new(&alone, bs, 40, 100, 4096).unwrap();
                    let q_row = CpuTensor {
                        data: q.data[row * cols..][..cols].to_vec(),
                        rows: 1,
                        cols,
                    };
                    let out_row = step_attention(&backend, &q_row, &store, shape, &alone);
                    let what = format!("{path:?} {dtype}, {threads} threads, position {pos}");
                    assert_eq!(
                        bits(&out.data[row * cols..][..cols]),
                        bits(&out_row.data),
                        "{what}: the prompt row differs from the row alone"
                    );
                    let want =
                        whole_context_reference(&store, shape, &table_a, pos + 1, &q_row.data);
                    assert_close(&out_row.data, &want, &what);
                }
            }
        }
    }

    /// Contexts are cut at the same block-aligned positions whatever their length, and the
    /// spans cover a context exactly once.
    #[test]
    fn span_plans_cover_contexts_exactly() {
        assert_eq!(SpanPlan::new(16).span_tokens, 128);
        assert_eq!(SpanPlan::new(7).span_tokens, 133);
        assert_eq!(SpanPlan::new(256).span_tokens, 256);
        for (ctx, bs, spans) in [
            (2048, 16, 16),
            (100, 16, 1),
            (129, 16, 2),
            (1, 16, 1),
            (1000, 7, 8),
        ] {
            let plan = SpanPlan::new(bs);
            assert_eq!(plan.spans(ctx), spans, "ctx {ctx} block size {bs}");
            let mut covered = 0;
            for i in 0..spans {
                let (start, end) = plan.span(i, ctx);
                assert_eq!(start, covered, "ctx {ctx} block size {bs}");
                assert_eq!(start % bs, 0);
                assert!(end > start && end - start <= plan.span_tokens);
                covered = end;
            }
            assert_eq!(covered, ctx, "ctx {ctx} block size {bs}");
        }
    }
}
