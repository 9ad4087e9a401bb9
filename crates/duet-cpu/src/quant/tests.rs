use super::*;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn byte(&mut self) -> u8 {
        (self.next() >> 32) as u8
    }
    /// Uniform in [-1, 1).
    fn f(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

fn f16b(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

/// Random but sane raw blocks: random quants, scales of magnitude ~0.01..0.1.
fn random_row(ty: QuantType, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let mut out = Vec::new();
    match ty {
        QuantType::F32 => (0..cols).for_each(|_| out.extend_from_slice(&rng.f().to_le_bytes())),
        QuantType::F16 => (0..cols).for_each(|_| out.extend_from_slice(&f16b(rng.f()))),
        QuantType::BF16 => (0..cols).for_each(|_| {
            let b = (rng.f().to_bits() >> 16) as u16;
            out.extend_from_slice(&b.to_le_bytes())
        }),
        _ => {
            for _ in 0..cols / ty.block_len() {
                let mut blk: Vec<u8> = (0..ty.block_bytes()).map(|_| rng.byte()).collect();
                let scale = 0.01 + 0.09 * rng.f().abs();
                match ty {
                    QuantType::Q4_0 | QuantType::Q8_0 => blk[0..2].copy_from_slice(&f16b(scale)),
                    QuantType::Q4_1 => {
                        blk[0..2].copy_from_slice(&f16b(scale));
                        blk[2..4].copy_from_slice(&f16b(-8.0 * scale * (1.0 + 0.2 * rng.f())));
                    }
                    QuantType::Q4_K => {
                        blk[0..2].copy_from_slice(&f16b(scale / 32.0));
                        blk[2..4].copy_from_slice(&f16b(scale / 8.0));
                    }
                    QuantType::Q6_K => blk[208..210].copy_from_slice(&f16b(scale / 64.0)),
                    _ => unreachable!(),
                }
                out.extend_from_slice(&blk);
            }
        }
    }
    out
}

fn random_matrix(ty: QuantType, rows: usize, cols: usize, seed: u64) -> (QMatrix, Vec<u8>) {
    let mut rng = Rng(seed);
    let raw: Vec<u8> = (0..rows)
        .flat_map(|_| random_row(ty, cols, &mut rng))
        .collect();
    (
        QMatrix::new(ty, rows, cols, WeightBytes::from_vec(raw.clone())).unwrap(),
        raw,
    )
}

/// Element `j` of a block, read straight from the GGML definitions (independent of `dequant.rs`).
fn ref_elem(ty: QuantType, b: &[u8], j: usize) -> f32 {
    let h = |i: usize| half::f16::from_le_bytes([b[i], b[i + 1]]).to_f32();
    let nib = |byte: u8, hi: bool| if hi { byte >> 4 } else { byte & 15 };
    match ty {
        QuantType::F32 => f32::from_le_bytes(b[0..4].try_into().unwrap()),
        QuantType::F16 => h(0),
        QuantType::BF16 => f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16),
        QuantType::Q4_0 => h(0) * (nib(b[2 + j % 16], j >= 16) as f32 - 8.0),
        QuantType::Q4_1 => h(0) * nib(b[4 + j % 16], j >= 16) as f32 + h(2),
        QuantType::Q8_0 => h(0) * (b[2 + j] as i8) as f32,
        QuantType::Q4_K => {
            let sub = j / 32; // sub-block 0..8, 64-element chunks share 32 qs bytes
            let sc = &b[4..16];
            let (s, m) = if sub < 4 {
                (sc[sub] & 63, sc[sub + 4] & 63)
            } else {
                (
                    (sc[sub + 4] & 15) | ((sc[sub - 4] >> 6) << 4),
                    (sc[sub + 4] >> 4) | ((sc[sub] >> 6) << 4),
                )
            };
            let q = nib(b[16 + 32 * (sub / 2) + j % 32], sub % 2 == 1);
            h(0) * s as f32 * q as f32 - h(2) * m as f32
        }
        QuantType::Q6_K => {
            let half_ = j / 128; // 0..2
            let jj = j % 128;
            let quarter = jj / 32; // 0..4
            let l = jj % 32;
            let ql = &b[64 * half_..];
            let qh = b[128 + 32 * half_ + l];
            let low = match quarter {
                0 => ql[l] & 15,
                1 => ql[l + 32] & 15,
                2 => ql[l] >> 4,
                _ => ql[l + 32] >> 4,
            };
            let q = (low | (((qh >> (2 * quarter)) & 3) << 4)) as i32 - 32;
            let scale = b[192 + 8 * half_ + l / 16 + 2 * quarter] as i8;
            h(208) * scale as f32 * q as f32
        }
    }
}

fn ref_dequant(ty: QuantType, raw: &[u8], n: usize) -> Vec<f32> {
    (0..n)
        .map(|j| {
            let (bl, bb) = (ty.block_len(), ty.block_bytes());
            ref_elem(ty, &raw[(j / bl) * bb..(j / bl + 1) * bb], j % bl)
        })
        .collect()
}

fn cols_for(ty: QuantType) -> usize {
    if ty.block_len() == 256 { 512 } else { 96 }
}

fn is_packed(ty: QuantType) -> bool {
    matches!(
        ty,
        QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q8_0 | QuantType::Q4_K | QuantType::Q6_K
    )
}

fn paths() -> Vec<KernelPath> {
    KernelPath::all_supported()
}

#[test]
fn type_table() {
    assert_eq!(QuantType::from_ggml(0), Some(QuantType::F32));
    assert_eq!(QuantType::from_ggml(1), Some(QuantType::F16));
    assert_eq!(QuantType::from_ggml(2), Some(QuantType::Q4_0));
    assert_eq!(QuantType::from_ggml(3), Some(QuantType::Q4_1));
    assert_eq!(QuantType::from_ggml(8), Some(QuantType::Q8_0));
    assert_eq!(QuantType::from_ggml(12), Some(QuantType::Q4_K));
    assert_eq!(QuantType::from_ggml(14), Some(QuantType::Q6_K));
    assert_eq!(QuantType::from_ggml(30), Some(QuantType::BF16));
    assert_eq!(QuantType::from_ggml(6), None);
    assert_eq!(QuantType::Q4_1.name(), "Q4_1");
    assert_eq!(QuantType::Q4_1.row_bytes(576), Some(360));
    assert_eq!(QuantType::Q8_0.row_bytes(576), Some(612));
    assert_eq!(QuantType::Q4_K.row_bytes(512), Some(288));
    assert_eq!(QuantType::Q6_K.row_bytes(256), Some(210));
    assert_eq!(QuantType::Q4_0.row_bytes(33), None);
    assert_eq!(QuantType::BF16.row_bytes(3), Some(6));
}

#[test]
fn constructor_checks_sizes() {
    let e = QMatrix::new(QuantType::Q4_1, 2, 48, WeightBytes::from_vec(vec![0; 60])).unwrap_err();
    assert!(matches!(e, QuantError::BadCols { .. }));
    let e = QMatrix::new(QuantType::Q4_1, 2, 64, WeightBytes::from_vec(vec![0; 79])).unwrap_err();
    assert!(matches!(
        e,
        QuantError::BadSize {
            expected: 80,
            got: 79,
            ..
        }
    ));
    assert!(QMatrix::new(QuantType::Q4_1, 2, 64, WeightBytes::from_vec(vec![0; 80])).is_ok());
}

#[test]
fn dequantize_matches_reference_reading() {
    for ty in QuantType::ALL {
        let cols = cols_for(ty);
        let mut rng = Rng(0x1234 + ty as u64);
        let raw = random_row(ty, cols, &mut rng);
        let mut out = vec![0.0; cols];
        dequantize_row(ty, &raw, &mut out);
        let want = ref_dequant(ty, &raw, cols);
        assert_eq!(out, want, "{ty}");
    }
}

#[test]
fn row_f32_and_permute_rows() {
    for ty in QuantType::ALL {
        let (rows, cols) = (37, cols_for(ty));
        let (m, raw) = random_matrix(ty, rows, cols, 99 + ty as u64);
        let rb = ty.row_bytes(cols).unwrap();
        assert_eq!(m.size_bytes(), rows * rb);
        let mut out = vec![0.0; cols];
        for r in [0, 1, 15, 16, 36] {
            m.row_f32(r, &mut out);
            assert_eq!(
                out,
                ref_dequant(ty, &raw[r * rb..(r + 1) * rb], cols),
                "{ty} row {r}"
            );
            assert_eq!(m.row_bytes_ggml(r), raw[r * rb..(r + 1) * rb].to_vec());
        }
        let perm: Vec<usize> = (0..rows).map(|i| (i * 7 + 3) % rows).collect();
        let p = m.permute_rows(&perm);
        assert_eq!((p.rows(), p.cols(), p.ty()), (rows, cols, ty));
        for (i, &src) in perm.iter().enumerate() {
            p.row_f32(i, &mut out);
            assert_eq!(
                out,
                ref_dequant(ty, &raw[src * rb..(src + 1) * rb], cols),
                "{ty} permuted row {i}"
            );
        }
        // and the permuted matrix multiplies like the permuted rows
        let pool = ThreadPool::new(2);
        let x: Vec<f32> = {
            let mut rng = Rng(5);
            (0..cols).map(|_| rng.f()).collect()
        };
        let (mut y, mut yp) = (vec![0.0; rows], vec![0.0; rows]);
        m.matmul(&x, 1, &mut y, &pool);
        p.matmul(&x, 1, &mut yp, &pool);
        for (i, &src) in perm.iter().enumerate() {
            assert_eq!(yp[i], y[src]);
        }
    }
}

/// Per-matmul relative error bound vs the f32-input reference for the block-quantized types
/// (16-bit activations give ~1e-5; 8-bit activations gave ~4e-3 and must not pass).
const PACKED_REL_ERR: f64 = 1e-4;

/// Test-side activation quantization (i16 blocks of 32, `d = amax / 32767`, ties to even).
fn quantize_x(x: &[f32]) -> Vec<f32> {
    x.chunks(32)
        .flat_map(|b| {
            let amax = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let d = amax / 32767.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            b.iter()
                .map(move |v| (v * id).round_ties_even() * d)
                .collect::<Vec<_>>()
        })
        .collect()
}

fn ref_matmul(w: &[f32], rows: usize, cols: usize, x: &[f32], n_tokens: usize) -> Vec<f64> {
    let mut out = vec![0.0f64; n_tokens * rows];
    for t in 0..n_tokens {
        for r in 0..rows {
            out[t * rows + r] = (0..cols)
                .map(|c| w[r * cols + c] as f64 * x[t * cols + c] as f64)
                .sum::<f64>();
        }
    }
    out
}

fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - w).powi(2))
        .sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    (num / den.max(1e-30)).sqrt()
}

#[test]
fn matmul_matches_reference_on_every_path() {
    let pools = [ThreadPool::new(1), ThreadPool::new(2), ThreadPool::new(3)];
    // 53 rows: 4 row groups, the last one 5 rows; 40 rows: 3 groups, so the AVX2 kernel's
    // two-group units end in a unit of one group of 8 rows; 45 rows: the last group 13 rows, so
    // the AVX2 kernels store part of a group's second half. 12 tokens and more take those
    // units, in chunks of at most 48 (64 = 2 x 32, 100 = 34 + 33 + 33).
    for (ty, rows) in QuantType::ALL
        .into_iter()
        .flat_map(|ty| [(ty, 53), (ty, 40), (ty, 45)])
    {
        let cols = cols_for(ty);
        let (m, raw) = random_matrix(ty, rows, cols, 7 + ty as u64 + rows as u64);
        let w = ref_dequant(ty, &raw, rows * cols);
        for n_tokens in [1usize, 3, 12, 17, 29, 64, 100] {
            let mut rng = Rng(1000 + n_tokens as u64);
            let x: Vec<f32> = (0..n_tokens * cols).map(|_| rng.f() * 2.0).collect();
            let want = ref_matmul(&w, rows, cols, &x, n_tokens);
            let want_q = ref_matmul(&w, rows, cols, &quantize_x(&x), n_tokens);
            let mut scalar_out: Option<Vec<f32>> = None;
            for path in paths() {
                for (pi, pool) in pools.iter().enumerate() {
                    let mut out = vec![f32::NAN; n_tokens * rows];
                    m.matmul_with(path, &x, n_tokens, &mut out, pool);
                    let ctx = format!(
                        "{ty} {rows} rows {path:?} n_tokens={n_tokens} threads={}",
                        pi + 1
                    );
                    let err = rel_err(&out, &want);
                    if is_packed(ty) {
                        // 16-bit activations: error vs the f32 input is the activation rounding,
                        assert!(err <= PACKED_REL_ERR, "{ctx}: rel err {err}");
                        // and vs the same rounded activations only f32 accumulation error.
                        let err_q = rel_err(&out, &want_q);
                        assert!(err_q <= 1e-5, "{ctx}: rel err vs quantized x {err_q}");
                        // every path is bit-identical to the scalar one
                        match &scalar_out {
                            None => scalar_out = Some(out.clone()),
                            Some(s) => assert!(s == &out, "{ctx}: differs from the scalar path"),
                        }
                    } else {
                        assert!(err <= 1e-5, "{ctx}: rel err {err}");
                    }
                }
            }
        }
    }
}

#[test]
fn token_results_do_not_depend_on_batch() {
    // Greedy determinism: a token's output is the same alone or inside any batch.
    let pool = ThreadPool::new(2);
    for ty in QuantType::ALL {
        let (rows, cols) = (40, cols_for(ty) + if ty.block_len() == 1 { 5 } else { 0 });
        let (m, _) = random_matrix(ty, rows, cols, 3);
        let mut rng = Rng(77);
        let n = 13;
        let x: Vec<f32> = (0..n * cols).map(|_| rng.f()).collect();
        let mut all = vec![0.0; n * rows];
        m.matmul(&x, n, &mut all, &pool);
        for t in 0..n {
            let mut one = vec![0.0; rows];
            m.matmul(&x[t * cols..(t + 1) * cols], 1, &mut one, &pool);
            assert_eq!(&all[t * rows..(t + 1) * rows], &one[..], "{ty} token {t}");
        }
    }
}

#[test]
fn exact_for_f32_weights() {
    // Small integers: every product and partial sum is exact in f32.
    let (rows, cols) = (19, 40);
    let w: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 37) % 11) as f32 - 5.0)
        .collect();
    let x: Vec<f32> = (0..2 * cols).map(|i| ((i * 13) % 7) as f32 - 3.0).collect();
    let raw: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
    let m = QMatrix::new(QuantType::F32, rows, cols, WeightBytes::from_vec(raw)).unwrap();
    let want = ref_matmul(&w, rows, cols, &x, 2);
    for path in paths() {
        let mut out = vec![0.0; 2 * rows];
        m.matmul_with(path, &x, 2, &mut out, &ThreadPool::new(2));
        assert!(
            out.iter().zip(&want).all(|(a, b)| *a as f64 == *b),
            "{path:?}"
        );
    }
}

#[test]
fn zero_activations_and_large_matrix_split() {
    // Many row groups over threads, plus an all-zero activation block (scale 0).
    let pool = ThreadPool::new(2);
    let (rows, cols) = (16 * 21 + 1, 64);
    let (m, raw) = random_matrix(QuantType::Q4_1, rows, cols, 11);
    let w = ref_dequant(QuantType::Q4_1, &raw, rows * cols);
    let mut x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.37).sin()).collect();
    x[..32].fill(0.0);
    let mut out = vec![0.0; rows];
    m.matmul(&x, 1, &mut out, &pool);
    assert!(rel_err(&out, &ref_matmul(&w, rows, cols, &x, 1)) < PACKED_REL_ERR);
}

#[test]
fn activation_quantization_is_identical_on_every_path() {
    let mut rng = Rng(31);
    let mut x: Vec<f32> = (0..32 * 40).map(|_| rng.f() * 3.0).collect();
    x[..32].fill(0.0); // zero block
    // d = (32767 / 1024) / 32767 = 1 / 1024 exactly: elements 0..31 are exact ties (n + 0.5)
    x[32..64]
        .iter_mut()
        .enumerate()
        .for_each(|(i, v)| *v = (i as f32 * 3.0 - 40.5) / 1024.0);
    x[63] = 32767.0 / 1024.0;
    x[64] = 1e30;
    x[96..128]
        .iter_mut()
        .enumerate()
        .for_each(|(i, v)| *v = (i as f32 - 16.0) * 127.0 / 16.0);
    let nb = x.len() / 32;
    let run = |path| {
        let (mut q, mut d, mut sd, mut s) = (
            vec![0i16; x.len()],
            vec![0.0; nb],
            vec![0.0; nb],
            vec![0; nb],
        );
        let mut lo = vec![0; nb];
        packed::quantize_acts(
            path,
            &x,
            packed::ActBlocks {
                qs: &mut q,
                d: &mut d,
                sd: &mut sd,
                isum: &mut s,
                isum_lo: &mut lo,
            },
        );
        // independent reading: element e of block b is stored at position PAIR_POS order
        for b in 0..nb {
            let xb = &x[32 * b..32 * b + 32];
            let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert_eq!(d[b], amax / 32767.0);
            let id = if d[b] != 0.0 { 1.0 / d[b] } else { 0.0 };
            let want: Vec<i32> = xb
                .iter()
                .map(|v| ((v * id).round_ties_even() as i32).clamp(-32767, 32767))
                .collect();
            let got: Vec<i32> = (0..32)
                .map(|e| q[32 * b + (e & !3) + [0, 2, 1, 3][e & 3]] as i32)
                .collect();
            assert_eq!(got, want, "{path:?} block {b}");
            assert_eq!(s[b], want.iter().sum::<i32>());
            assert_eq!(lo[b], want[..16].iter().sum::<i32>());
            assert_eq!(sd[b], d[b] * s[b] as f32);
        }
        (q, d, sd, s, lo)
    };
    let want = run(KernelPath::Scalar);
    assert!(want.0[..32].iter().all(|&q| q == 0));
    // block 1: ties to even (-40.5 -> -40, -37.5 -> -38, stored at positions 0 and 2)
    assert_eq!((want.0[32], want.0[34], want.0[33]), (-40, -38, -34));
    assert_eq!(want.0[63], 32767);
    assert_eq!(want.0[64], 32767); // the huge value; the rest of its block rounds to 0
    assert!(want.0[65..96].iter().all(|&q| q == 0));
    assert_eq!(want.0[127], 30719); // 15 * 32767 / 16 = 30719.06
    for path in paths() {
        assert!(run(path) == want, "{path:?}");
    }
}

/// Worst-case blocks (largest quant magnitudes, every activation at +-32767): no i32 overflow,
/// the same bits on every path and batch, and the 1e-4 accuracy.
#[test]
fn extreme_blocks_do_not_overflow() {
    let pool = ThreadPool::new(2);
    for ty in QuantType::ALL.into_iter().filter(|t| is_packed(*t)) {
        let (rows, cols) = (20, 2 * cols_for(ty));
        let n_blocks = rows * cols / ty.block_len();
        let mut raw = Vec::new();
        for i in 0..n_blocks {
            let mut blk = vec![0u8; ty.block_bytes()];
            let scale = f16b(0.05 + 0.01 * (i % 3) as f32);
            match ty {
                QuantType::Q8_0 => {
                    blk[2..].fill(0x80); // -128
                    blk[0..2].copy_from_slice(&scale);
                }
                QuantType::Q4_0 => {
                    blk[2..].fill(if i % 2 == 0 { 0xFF } else { 0x00 }); // +7 / -8
                    blk[0..2].copy_from_slice(&scale);
                }
                QuantType::Q4_1 => {
                    blk[4..].fill(0xFF);
                    blk[0..2].copy_from_slice(&scale);
                    blk[2..4].copy_from_slice(&f16b(-0.4));
                }
                QuantType::Q4_K => {
                    blk[4..16].fill(0xFF); // all 6-bit scales and mins 63
                    blk[16..].fill(0xFF);
                    blk[0..2].copy_from_slice(&f16b(0.001));
                    blk[2..4].copy_from_slice(&f16b(0.0005));
                }
                QuantType::Q6_K => {
                    // ql = qh = 0: every quant is -32; every scale -128
                    blk[192..208].fill(0x80);
                    blk[208..210].copy_from_slice(&f16b(0.0001));
                }
                _ => unreachable!(),
            }
            raw.extend_from_slice(&blk);
        }
        let w = ref_dequant(ty, &raw, rows * cols);
        let m = QMatrix::new(ty, rows, cols, WeightBytes::from_vec(raw)).unwrap();
        let n = 9;
        // token 0: all +1, token 1: all -1, others alternate signs per block
        let x: Vec<f32> = (0..n * cols)
            .map(|i| {
                let (t, c) = (i / cols, i % cols);
                match t {
                    0 => 1.0,
                    1 => -1.0,
                    _ => {
                        if (c / 32 + t) % 2 == 0 {
                            1.0
                        } else {
                            -1.0
                        }
                    }
                }
            })
            .collect();
        let want = ref_matmul(&w, rows, cols, &x, n);
        let mut first: Option<Vec<f32>> = None;
        for path in paths() {
            let mut out = vec![f32::NAN; n * rows];
            m.matmul_with(path, &x, n, &mut out, &pool);
            let err = rel_err(&out, &want);
            assert!(err <= PACKED_REL_ERR, "{ty} {path:?}: rel err {err}");
            for t in 0..n {
                let mut one = vec![f32::NAN; rows];
                m.matmul_with(path, &x[t * cols..(t + 1) * cols], 1, &mut one, &pool);
                assert_eq!(
                    &out[t * rows..(t + 1) * rows],
                    &one[..],
                    "{ty} {path:?} {t}"
                );
            }
            match &first {
                None => first = Some(out),
                Some(f) => assert!(f == &out, "{ty} {path:?} differs from the scalar path"),
            }
        }
    }
}

#[test]
fn simd_dequantization_is_identical() {
    for ty in QuantType::ALL {
        let cols = 3 * cols_for(ty) + if ty.block_len() == 1 { 7 } else { 0 };
        let raw = random_row(ty, cols, &mut Rng(17 + ty as u64));
        let mut want = vec![0.0; cols];
        dequantize_row(ty, &raw, &mut want);
        for path in paths() {
            let mut got = vec![f32::NAN; cols];
            dequantize_row_on(path, ty, &raw, &mut got);
            assert!(got == want, "{ty} {path:?}");
        }
    }
}

#[test]
fn qmatrix_is_send_sync() {
    fn check<T: Send + Sync + Clone>() {}
    check::<QMatrix>();
}
