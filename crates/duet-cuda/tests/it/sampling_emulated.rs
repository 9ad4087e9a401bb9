//! `kernels/sampling.cu` run in the CPU emulator (crates/duet-cuda/emulator) against the CPU
//! sampler on the same logits: every token, log-probability and top-n entry, and the masked and
//! penalised logits the kernel leaves, bit for bit. Needs a C++17 compiler and python3 (as
//! `scripts/test-kernels-emulated.sh` does), no GPU.

use duet_cuda::sampling::{OUT_WORDS, PackedRows, THREADS, same_draw, unpack};
use duet_engine::sampling_steps::{RowSampling, sample_row};
use duet_model::params::{Sampled, SamplingParams};
use duet_model::synthetic::Uniform;

type LaunchSampleRows = unsafe extern "C" fn(
    u32,
    u32,
    u32,
    u32,
    *mut f32,
    *mut f32,
    i32,
    *const u32,
    *const u32,
    *const u32,
    *mut u32,
);

/// The emulated `sampling.cu`.
struct Emulated(crate::emulated::Emulated);

impl Emulated {
    fn build() -> Self {
        Self(crate::emulated::Emulated::build("sampling"))
    }

    /// Runs `sample_rows` over `logits` (`rows.len()` rows of `vocab`), modified in place.
    fn sample(&self, logits: &mut [f32], vocab: usize, rows: &[RowSampling<'_>]) -> Vec<Sampled> {
        let mut packed = PackedRows::default();
        packed.pack(rows);
        // Empty arrays still need a valid pointer.
        let nonempty = |v: &mut Vec<u32>| {
            if v.is_empty() {
                v.push(0);
            }
        };
        nonempty(&mut packed.penalized);
        nonempty(&mut packed.allowed);
        let mut work = vec![f32::NAN; logits.len()];
        let mut out = vec![u32::MAX; rows.len() * OUT_WORDS];
        // SAFETY: the launcher's signature is gen.py's for sample_rows; every array holds what
        // the kernel reads or writes for `rows.len()` rows of `vocab`.
        unsafe {
            let launch: libloading::Symbol<'_, LaunchSampleRows> =
                self.0.lib.get(b"L_sample_rows").unwrap();
            launch(
                rows.len() as u32,
                1,
                1,
                THREADS,
                logits.as_mut_ptr(),
                work.as_mut_ptr(),
                vocab as i32,
                packed.params.as_ptr(),
                packed.penalized.as_ptr(),
                packed.allowed.as_ptr(),
                out.as_mut_ptr(),
            );
        }
        unpack(&out, rows)
    }
}

/// Bits of a float, NaNs compared as NaN (the GPU's and the host's NaN payloads differ).
fn same(a: f32, b: f32) -> bool {
    (a.is_nan() && b.is_nan()) || a.to_bits() == b.to_bits()
}

/// One case: logits and what a row asks for.
struct Case {
    name: String,
    logits: Vec<f32>,
    params: SamplingParams,
    position: u64,
    penalized: Vec<(u32, u32)>,
    allowed: Option<Vec<u32>>,
}

fn cases(vocab: usize, seed: u64) -> Vec<Case> {
    let mut noise = Uniform::new(seed);
    let mut logits =
        |scale: f32| -> Vec<f32> { noise.values(vocab).iter().map(|v| v * scale).collect() };
    let p = |f: &dyn Fn(&mut SamplingParams)| {
        let mut params = SamplingParams {
            temperature: 1.0,
            seed: Some(seed),
            ..Default::default()
        };
        f(&mut params);
        params
    };
    let mut out = Vec::new();
    let mut case = |name: &str, logits: Vec<f32>, params: SamplingParams| {
        out.push(Case {
            name: format!("{name}, vocab {vocab}"),
            logits,
            params,
            position: 7 + out.len() as u64 * 1_000_003,
            penalized: Vec::new(),
            allowed: None,
        });
    };
    case("greedy", logits(8.0), SamplingParams::greedy());
    case("temperature 1", logits(8.0), p(&|_| {}));
    case("temperature 0.3", logits(8.0), p(&|q| q.temperature = 0.3));
    case(
        "temperature 2 with logprobs",
        logits(8.0),
        p(&|q| {
            q.temperature = 2.0;
            q.logprobs = 20;
        }),
    );
    // Few distinct values: ties at every cut.
    let ties: Vec<f32> = logits(3.0).iter().map(|v| v.round()).collect();
    case("top-k 5, ties", ties.clone(), p(&|q| q.top_k = 5));
    case(
        "top-k 40, ties, logprobs",
        ties.clone(),
        p(&|q| {
            q.top_k = 40;
            q.logprobs = 7;
        }),
    );
    case("top-p 0.9, ties", ties.clone(), p(&|q| q.top_p = 0.9));
    // The same tied rows at many positions: a cut that kept one token too many or too few
    // would be drawn from at some of them.
    for i in 0..24 {
        case(
            &format!("top-k 5, ties, draw {i}"),
            ties.clone(),
            p(&|q| q.top_k = 5),
        );
        case(
            &format!("top-p 0.6, ties, draw {i}"),
            ties.clone(),
            p(&|q| q.top_p = 0.6),
        );
    }
    case("top-p 0.3", logits(8.0), p(&|q| q.top_p = 0.3));
    case("min-p 0.1", logits(8.0), p(&|q| q.min_p = 0.1));
    case(
        "top-k, min-p and top-p",
        logits(8.0),
        p(&|q| {
            q.top_k = 100;
            q.min_p = 0.01;
            q.top_p = 0.8;
            q.temperature = 0.8;
        }),
    );
    case(
        "greedy, tied maxima",
        {
            let mut l = ties.clone();
            let top = l.iter().copied().fold(f32::MIN, f32::max);
            l[vocab / 2] = top;
            l[vocab / 3] = top;
            l
        },
        SamplingParams::greedy(),
    );
    case(
        "greedy, NaN first",
        {
            let mut l = logits(8.0);
            l[0] = f32::NAN;
            l
        },
        SamplingParams::greedy(),
    );
    case(
        "NaNs and infinities",
        {
            let mut l = logits(8.0);
            l[3] = f32::NAN;
            l[vocab - 1] = f32::NEG_INFINITY;
            l[vocab / 2] = f32::NAN;
            l
        },
        p(&|q| q.logprobs = 3),
    );
    let mut cases = out;
    // Penalties: a prompt token generated too, prompt-only tokens, generated-only tokens.
    let mut penalties = Case {
        name: format!("penalties, vocab {vocab}"),
        logits: logits(8.0),
        params: p(&|q| {
            q.repetition_penalty = 1.3;
            q.presence_penalty = 0.7;
            q.frequency_penalty = 0.35;
            q.logprobs = 5;
        }),
        position: 12345,
        penalized: (0..vocab as u32).step_by(7).map(|t| (t, t % 4)).collect(),
        allowed: None,
    };
    penalties.penalized.push((vocab as u32 + 3, 1)); // past the vocabulary: ignored
    cases.push(penalties);
    // A grammar's bitmap: sparse words, a full word, and a bitmap shorter than the vocabulary.
    let words = vocab.div_ceil(32);
    let bitmap: Vec<u32> = (0..words.saturating_sub(1))
        .map(|w| match w % 5 {
            0 => u32::MAX,
            1 => 0,
            _ => (w as u32).wrapping_mul(0x9E37_79B9) | 1,
        })
        .collect();
    for (name, temperature) in [("grammar, greedy", 0.0), ("grammar, temperature 1", 1.0)] {
        cases.push(Case {
            name: format!("{name}, vocab {vocab}"),
            logits: logits(8.0),
            params: p(&|q| {
                q.temperature = temperature;
                q.logprobs = 20;
                q.top_k = 50;
            }),
            position: 99,
            penalized: vec![(5, 1), (6, 0)],
            allowed: Some(bitmap.clone()),
        });
    }
    cases
}

#[test]
fn the_kernel_samples_as_the_cpu_sampler_bit_for_bit() {
    let emulated = Emulated::build();
    for (vocab, seed) in [(1000usize, 1u64), (4099, 2), (33, 3)] {
        let cases = cases(vocab, seed);
        let rows: Vec<RowSampling<'_>> = cases
            .iter()
            .map(|c| RowSampling {
                params: &c.params,
                seed: c.params.seed.unwrap_or(0),
                position: c.position,
                penalized: &c.penalized,
                allowed: c.allowed.as_deref(),
            })
            .collect();
        // The CPU sampler, row by row.
        let mut cpu_logits: Vec<Vec<f32>> = cases.iter().map(|c| c.logits.clone()).collect();
        let cpu: Vec<Sampled> = cpu_logits
            .iter_mut()
            .zip(&rows)
            .map(|(l, row)| sample_row(l, row))
            .collect();
        // The kernel, every row in one launch.
        let mut gpu_logits: Vec<f32> = cases.iter().flat_map(|c| c.logits.clone()).collect();
        let gpu = emulated.sample(&mut gpu_logits, vocab, &rows);
        for (i, c) in cases.iter().enumerate() {
            assert!(
                same_draw(&cpu[i], &gpu[i]),
                "{}: cpu {:?} / kernel {:?}",
                c.name,
                cpu[i],
                gpu[i]
            );
            let left = &gpu_logits[i * vocab..(i + 1) * vocab];
            let differ = cpu_logits[i]
                .iter()
                .zip(left)
                .position(|(a, b)| !same(*a, *b));
            assert_eq!(
                differ, None,
                "{}: masked and penalised logits differ",
                c.name
            );
        }
    }
}

/// The kernel draws tokens as a function of (seed, position) only: a row sampled beside others
/// and alone gives the same token.
#[test]
fn a_row_draws_the_same_token_whatever_its_companions() {
    let emulated = Emulated::build();
    let vocab = 500;
    let cases = cases(vocab, 11);
    fn row(c: &Case) -> RowSampling<'_> {
        RowSampling {
            params: &c.params,
            seed: 11,
            position: c.position,
            penalized: &c.penalized,
            allowed: c.allowed.as_deref(),
        }
    }
    let together: Vec<Sampled> = {
        let rows: Vec<RowSampling<'_>> = cases.iter().map(row).collect();
        let mut logits: Vec<f32> = cases.iter().flat_map(|c| c.logits.clone()).collect();
        emulated.sample(&mut logits, vocab, &rows)
    };
    for (c, t) in cases.iter().zip(&together) {
        let alone = emulated.sample(&mut c.logits.clone(), vocab, &[row(c)]);
        assert!(same_draw(&alone[0], t), "{}", c.name);
    }
}
