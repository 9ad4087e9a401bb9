//! The host side of `kernels/sampling.cu`: a step's rows of [`RowSampling`] packed into the
//! kernel's words, and its output read back as [`Sampled`]. Shared by the backend and the
//! emulator test that compares the kernel with the CPU sampler.

use duet_engine::sampling_steps::RowSampling;
use duet_model::params::{Logprobs, Sampled};

/// Threads of a `sample_rows` block (`SP_THREADS`): the canonical sum's lanes.
pub const THREADS: u32 = 256;
/// Words of one row's parameters (`SP_WORDS`).
pub const PARAM_WORDS: usize = 16;
/// Words of one row's output (`SO_WORDS`).
pub const OUT_WORDS: usize = 3 + 2 * MAX_TOP;
/// Most top log-probabilities a row returns (`SP_MAX_TOP`).
pub const MAX_TOP: usize = duet_model::params::MAX_LOGPROBS as usize;
/// `SP_ALLOWED_WORDS` of a row without a grammar.
const UNCONSTRAINED: u32 = u32::MAX;

/// A step's rows in the kernel's layout.
#[derive(Default)]
pub struct PackedRows {
    pub params: Vec<u32>,
    /// (token, times generated) pairs of every row, one after another.
    pub penalized: Vec<u32>,
    /// The grammars' bitmaps, one after another.
    pub allowed: Vec<u32>,
}

impl PackedRows {
    /// Packs `rows` (cleared first, so a step's buffers are reused).
    pub fn pack(&mut self, rows: &[RowSampling<'_>]) {
        self.params.clear();
        self.penalized.clear();
        self.allowed.clear();
        for row in rows {
            let p = row.params;
            let penalized_at = (self.penalized.len() / 2) as u32;
            for &(t, n) in row.penalized {
                self.penalized.extend([t, n]);
            }
            let (allowed_at, allowed_words) = match row.allowed {
                Some(words) => {
                    let at = self.allowed.len() as u32;
                    self.allowed.extend_from_slice(words);
                    (at, words.len() as u32)
                }
                None => (0, UNCONSTRAINED),
            };
            self.params.extend([
                p.temperature.to_bits(),
                p.top_k,
                p.top_p.to_bits(),
                p.min_p.to_bits(),
                p.repetition_penalty.to_bits(),
                p.presence_penalty.to_bits(),
                p.frequency_penalty.to_bits(),
                p.logprobs.min(MAX_TOP as u32),
                row.seed as u32,
                (row.seed >> 32) as u32,
                row.position as u32,
                (row.position >> 32) as u32,
                penalized_at,
                row.penalized.len() as u32,
                allowed_at,
                allowed_words,
            ]);
        }
    }
}

/// Row `i`'s draw from the kernel's output words.
pub fn unpack(out: &[u32], rows: &[RowSampling<'_>]) -> Vec<Sampled> {
    rows.iter()
        .zip(out.chunks_exact(OUT_WORDS))
        .map(|(row, o)| Sampled {
            token: o[0],
            logprobs: (row.params.logprobs > 0).then(|| {
                let listed = (o[2] as usize).min(MAX_TOP);
                Logprobs {
                    logprob: f32::from_bits(o[1]),
                    top: (0..listed)
                        .map(|j| (o[3 + j], f32::from_bits(o[3 + MAX_TOP + j])))
                        .collect(),
                }
            }),
        })
        .collect()
}

/// Whether two draws are the same: token, log-probability and top-n, bit for bit (NaNs as NaN:
/// the GPU's payloads differ from the host's).
pub fn same_draw(a: &Sampled, b: &Sampled) -> bool {
    let bits = |x: f32, y: f32| (x.is_nan() && y.is_nan()) || x.to_bits() == y.to_bits();
    a.token == b.token
        && match (&a.logprobs, &b.logprobs) {
            (None, None) => true,
            (Some(x), Some(y)) => {
                bits(x.logprob, y.logprob)
                    && x.top.len() == y.top.len()
                    && x.top
                        .iter()
                        .zip(&y.top)
                        .all(|(p, q)| p.0 == q.0 && bits(p.1, q.1))
            }
            _ => false,
        }
}
