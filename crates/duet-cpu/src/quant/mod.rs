//! Quantized weight matrices (GGML block formats) and the CPU matrix kernels over them.
//!
//! * Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K matrices are repacked once at construction into 16-row
//!   interleaved groups (the file's byte count; Q4_K +2.8% for unpacked 6-bit scales, see
//!   `packed.rs`); a call quantizes the activations once to 16-bit blocks of 32
//!   (`d = amax / 32767`, so the activation rounding costs ~1e-5 relative error per matmul) and
//!   runs integer dot products of the weight quants widened to i16 against them (AVX-512 VNNI
//!   `vpdpwssd`, AVX2 `vpmaddwd`, or portable code — all give bit-identical results, exact i32
//!   sums per 32-value block scaled in f32 in the same order), each weight block being read once
//!   per call and reused for a tile of tokens held in registers (on the AVX2 path, from 12 tokens
//!   on, widened once into a buffer that every token of the call reads). A token's outputs do not
//!   depend on the batch it is in, the thread count or the path.
//! * F32 / F16 / BF16 matrices stay in their layout (used in place); a call converts four rows at
//!   a time to f32 and runs f32 FMA dots against every token (4 rows x 4 tokens register tiles
//!   on AVX-512).
//!
//! Output rows are split over the thread pool (each participant a contiguous range of row
//! groups). The kernel path is chosen once by runtime CPU feature detection.

mod packed;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod x86;

use std::cell::RefCell;
use std::sync::{Arc, OnceLock};

use crate::threadpool::ThreadPool;
use duet_engine::EngineError;
use duet_engine::backend::CpuKernels;
pub use duet_model::dequant::dequantize_row;
pub use duet_model::quant_type::QuantType;
use duet_model::storage::WeightBytes;
use packed::{GROUP, Packed, QActs, Tile};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    #[error("{ty} matrix: {cols} columns is not a multiple of the block length {block}")]
    BadCols {
        ty: QuantType,
        cols: usize,
        block: usize,
    },
    #[error("{ty} matrix [{rows} x {cols}]: expected {expected} bytes, got {got}")]
    BadSize {
        ty: QuantType,
        rows: usize,
        cols: usize,
        expected: usize,
        got: usize,
    },
    #[error("{ty} matrix [{rows} x {cols}]: cannot map memory for its weights: {reason}")]
    OutOfMemory {
        ty: QuantType,
        rows: usize,
        cols: usize,
        reason: String,
    },
}

/// Which kernel implementation runs a matmul.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelPath {
    /// Portable Rust, any architecture.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
    /// [`KernelPath::Avx2`] whose matrix kernels multiply-accumulate with AVX-VNNI `vpdpwssd`
    /// (one instruction where AVX2 needs `vpmaddwd` + `vpaddd`): Intel cores from Alder Lake on,
    /// which have it without AVX-512.
    Avx2Vnni,
    /// x86-64 AVX-512 F/BW/VL + VNNI (+ FMA, F16C).
    Avx512,
}

impl KernelPath {
    /// Every path, the portable one first and the fastest last.
    pub const ALL: [KernelPath; 4] = [
        KernelPath::Scalar,
        KernelPath::Avx2,
        KernelPath::Avx2Vnni,
        KernelPath::Avx512,
    ];

    /// The paths this CPU can run, the portable one first.
    pub fn all_supported() -> Vec<KernelPath> {
        KernelPath::ALL
            .into_iter()
            .filter(|p| p.supported())
            .collect()
    }

    /// Whether this CPU can run the path.
    pub fn supported(self) -> bool {
        match self {
            KernelPath::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            KernelPath::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            KernelPath::Avx2Vnni => {
                KernelPath::Avx2.supported() && is_x86_feature_detected!("avxvnni")
            }
            #[cfg(target_arch = "x86_64")]
            KernelPath::Avx512 => {
                KernelPath::Avx2.supported()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Integer multiply-accumulates per second one thread sustains in this path's dot
    /// instruction on register operands (`vpdpwssd` zmm or ymm, `vpmaddwd` + `vpaddd` ymm): the compute
    /// ceiling of a quantized matmul, for benchmarks. `None` for the portable path.
    pub fn integer_macs_per_s(self) -> Option<f64> {
        const ITERATIONS: usize = 20_000_000;
        let t = std::time::Instant::now();
        let macs = match self {
            KernelPath::Scalar => return None,
            // SAFETY: the path is only chosen when the CPU supports it.
            #[cfg(target_arch = "x86_64")]
            KernelPath::Avx512 => unsafe { x86::dot_throughput_avx512(ITERATIONS) },
            #[cfg(target_arch = "x86_64")]
            KernelPath::Avx2 => unsafe { x86::dot_throughput_avx2(ITERATIONS) },
            #[cfg(target_arch = "x86_64")]
            KernelPath::Avx2Vnni => unsafe { x86::dot_throughput_avx2_vnni(ITERATIONS) },
            #[cfg(not(target_arch = "x86_64"))]
            _ => return None,
        };
        Some(macs as f64 / t.elapsed().as_secs_f64())
    }

    /// [`KernelPath::integer_macs_per_s`] on `threads` threads at once, summed, best of a few
    /// rounds: a round in which the machine took a core away would understate the ceiling and
    /// so overstate every fraction printed against it. `None` for the portable path.
    pub fn integer_macs_per_s_on(self, threads: usize) -> Option<f64> {
        const ROUNDS: usize = 3;
        let round = || {
            let per_thread: Vec<Option<f64>> = std::thread::scope(|s| {
                let runs: Vec<_> = (0..threads)
                    .map(|_| s.spawn(move || self.integer_macs_per_s()))
                    .collect();
                runs.into_iter().map(|r| r.join().ok().flatten()).collect()
            });
            per_thread.into_iter().sum::<Option<f64>>()
        };
        let rounds = (0..ROUNDS).map(|_| round()).collect::<Option<Vec<f64>>>()?;
        Some(rounds.into_iter().fold(0.0, f64::max))
    }

    /// The path `choice` asks for: the best this CPU supports for `auto`, else the one named, if
    /// this CPU can run it.
    pub fn choose(choice: CpuKernels) -> Result<KernelPath, EngineError> {
        let path = match choice {
            CpuKernels::Auto => return Ok(KernelPath::detect()),
            CpuKernels::Portable => KernelPath::Scalar,
            CpuKernels::Avx2 => KernelPath::Avx2,
            CpuKernels::Avx2Vnni => KernelPath::Avx2Vnni,
            CpuKernels::Avx512 => KernelPath::Avx512,
        };
        if path.supported() {
            Ok(path)
        } else {
            Err(EngineError::Config(format!(
                "--cpu-kernels {choice}: this CPU cannot run them (the best it supports is {})",
                KernelPath::detect().name()
            )))
        }
    }

    /// The name `--cpu-kernels` gives the path.
    pub fn name(self) -> &'static str {
        match self {
            KernelPath::Scalar => "portable",
            KernelPath::Avx2 => "avx2",
            KernelPath::Avx2Vnni => "avx2-vnni",
            KernelPath::Avx512 => "avx512",
        }
    }

    /// The best path this CPU supports (detected once).
    pub fn detect() -> KernelPath {
        static PATH: OnceLock<KernelPath> = OnceLock::new();
        *PATH.get_or_init(|| {
            KernelPath::ALL
                .into_iter()
                .rev()
                .find(|p| p.supported())
                .unwrap_or(KernelPath::Scalar)
        })
    }
}

/// A weight matrix `[rows, cols]`, row-major, each row stored in `ty` (rows = output features).
#[derive(Clone, Debug)]
pub struct QMatrix {
    ty: QuantType,
    rows: usize,
    cols: usize,
    data: Data,
}

#[derive(Clone, Debug)]
enum Data {
    /// GGML layout, used in place.
    Raw(WeightBytes),
    /// Block-quantized types repacked into row groups.
    Packed(Arc<Packed>),
}

/// A raw pointer that may cross to the pool's threads (each writes disjoint elements).
#[derive(Clone, Copy)]
struct SyncPtr<T>(*mut T);
unsafe impl<T> Send for SyncPtr<T> {}
unsafe impl<T> Sync for SyncPtr<T> {}
impl<T> SyncPtr<T> {
    fn get(self) -> *mut T {
        self.0
    }

    /// Tokens `tokens` of a token-major buffer of `per_token` values each.
    ///
    /// # Safety
    /// The buffer holds those tokens, and no one else touches them while the slice lives.
    unsafe fn tokens<'a>(self, tokens: &std::ops::Range<usize>, per_token: usize) -> &'a mut [T] {
        unsafe {
            std::slice::from_raw_parts_mut(
                self.0.add(tokens.start * per_token),
                tokens.len() * per_token,
            )
        }
    }
}

thread_local! {
    static ACTS: RefCell<QActs> = RefCell::new(QActs::default());
    static ROWS_F32: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Rows dequantized at once by the f32 path.
const F32_ROWS: usize = 4;

impl QMatrix {
    /// A matrix over `bytes` (GGML layout, `rows * ty.row_bytes(cols)` bytes). Block-quantized
    /// matrices are repacked into an owned buffer of the same size (and `bytes` is dropped);
    /// other types keep `bytes` and use it in place.
    pub fn new(
        ty: QuantType,
        rows: usize,
        cols: usize,
        bytes: WeightBytes,
    ) -> Result<QMatrix, QuantError> {
        let rb = ty.row_bytes(cols).ok_or(QuantError::BadCols {
            ty,
            cols,
            block: ty.block_len(),
        })?;
        let expected = rows * rb;
        if bytes.len() != expected {
            return Err(QuantError::BadSize {
                ty,
                rows,
                cols,
                expected,
                got: bytes.len(),
            });
        }
        let data = if packed::packable(ty) {
            let packed =
                Packed::pack(ty, rows, cols, &bytes).map_err(|e| QuantError::OutOfMemory {
                    ty,
                    rows,
                    cols,
                    reason: e.to_string(),
                })?;
            Data::Packed(Arc::new(packed))
        } else {
            Data::Raw(bytes)
        };
        Ok(QMatrix {
            ty,
            rows,
            cols,
            data,
        })
    }

    pub fn ty(&self) -> QuantType {
        self.ty
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes of the weights in GGML layout (`rows * row_bytes(cols)`); the memory held is the
    /// same, plus at most 15 zero rows of padding for repacked types (and 2.8% for Q4_K).
    pub fn size_bytes(&self) -> usize {
        self.rows * self.row_bytes()
    }

    fn row_bytes(&self) -> usize {
        self.ty
            .row_bytes(self.cols)
            .expect("checked at construction")
    }

    /// `out[t * rows + r] = sum_c W[r, c] * x[t * cols + c]` for `t in 0..n_tokens`.
    pub fn matmul(&self, x: &[f32], n_tokens: usize, out: &mut [f32], pool: &ThreadPool) {
        self.matmul_with(KernelPath::detect(), x, n_tokens, out, pool)
    }

    /// [`QMatrix::matmul`] on an explicit kernel path (tests, benchmarks). Panics if the CPU
    /// does not support `path`.
    pub fn matmul_with(
        &self,
        path: KernelPath,
        x: &[f32],
        n_tokens: usize,
        out: &mut [f32],
        pool: &ThreadPool,
    ) {
        assert!(
            path.supported(),
            "kernel path {path:?} is not supported by this CPU"
        );
        assert_eq!(
            x.len(),
            n_tokens * self.cols,
            "matmul: x has the wrong length"
        );
        assert_eq!(
            out.len(),
            n_tokens * self.rows,
            "matmul: out has the wrong length"
        );
        if n_tokens == 0 || self.rows == 0 {
            return;
        }
        if self.cols == 0 {
            out.fill(0.0);
            return;
        }
        match &self.data {
            Data::Packed(p) => self.matmul_packed(p, path, x, n_tokens, out, pool),
            Data::Raw(bytes) => self.matmul_f32(bytes, path, x, n_tokens, out, pool),
        }
    }

    fn matmul_packed(
        &self,
        p: &Packed,
        path: KernelPath,
        x: &[f32],
        n_tokens: usize,
        out: &mut [f32],
        pool: &ThreadPool,
    ) {
        ACTS.with(|cell| {
            let mut fresh = QActs::default();
            let mut borrowed = cell.try_borrow_mut();
            let acts: &mut QActs = match borrowed.as_mut() {
                Ok(a) => a,
                Err(_) => &mut fresh,
            };
            let cols = self.cols;
            let rows = self.rows;
            acts.resize(n_tokens, cols);
            // The AVX-512 kernels read each token tile's activations interleaved by token
            // (`x86::interleave_tiles`); one token's row already is its tile.
            let tiled = cfg!(target_arch = "x86_64") && path == KernelPath::Avx512 && n_tokens > 1;
            if tiled {
                acts.tiled.resize(n_tokens * cols / 2, 0);
            }
            let kernel = TileKernel::for_call(path, self.ty, n_tokens);
            let nb = acts.nb;
            let qs = SyncPtr(acts.qs.as_mut_ptr());
            let d = SyncPtr(acts.d.as_mut_ptr());
            let sd = SyncPtr(acts.sd.as_mut_ptr());
            let isum = SyncPtr(acts.isum.as_mut_ptr());
            let isum_lo = SyncPtr(acts.isum_lo.as_mut_ptr());
            #[cfg(target_arch = "x86_64")]
            let tiled_ptr = SyncPtr(acts.tiled.as_mut_ptr());
            let nt_max = match path {
                #[cfg(target_arch = "x86_64")]
                KernelPath::Avx512 => x86::NT_512,
                #[cfg(target_arch = "x86_64")]
                KernelPath::Avx2 | KernelPath::Avx2Vnni => x86::NT_256,
                _ => 8,
            };
            // Token tiles, each quantized (and interleaved) by one participant: tiles own whole
            // cache lines of `tiled`, where participants sharing a tile wrote into the same ones.
            let quantize = |tiles: std::ops::Range<usize>| {
                let tr = tiles.start * nt_max..(tiles.end * nt_max).min(n_tokens);
                // SAFETY: participants get disjoint token ranges of buffers sized above.
                unsafe {
                    packed::quantize_acts(
                        path,
                        &x[tr.start * cols..tr.end * cols],
                        packed::ActBlocks {
                            qs: qs.tokens(&tr, cols),
                            d: d.tokens(&tr, nb),
                            sd: sd.tokens(&tr, nb),
                            isum: isum.tokens(&tr, nb),
                            isum_lo: isum_lo.tokens(&tr, nb),
                        },
                    );
                    #[cfg(target_arch = "x86_64")]
                    if tiled {
                        x86::interleave_tiles(
                            qs.tokens(&tr, cols),
                            cols,
                            n_tokens,
                            tr,
                            tiled_ptr.get(),
                        );
                    }
                }
            };
            let n_tiles = n_tokens.div_ceil(nt_max);
            if n_tiles > 1 && pool.n_threads() > 1 {
                pool.for_each_range(n_tiles, quantize);
            } else {
                quantize(0..n_tiles);
            }
            #[cfg(target_arch = "x86_64")]
            if kernel == TileKernel::SplitBytes {
                acts.hi.resize(cols, 0);
                acts.lo.resize(cols, 0);
                acts.hi_corr.resize(nb, 0);
                // SAFETY: the split-byte paths have AVX2.
                unsafe {
                    x86::split_bytes(&acts.qs, &mut acts.hi, &mut acts.lo, &mut acts.hi_corr)
                };
            }
            let acts: &QActs = acts;
            let ty = self.ty;
            let outp = SyncPtr(out.as_mut_ptr());
            let w = p.bytes().as_ptr() as usize;
            let (wnb, gb) = (p.nb, p.gb);
            let (span, token_step) = if kernel == TileKernel::Units {
                // Even chunks, so that no short chunk is left at the end.
                let chunks = n_tokens.div_ceil(x86::UNIT_MAX_TOKENS);
                (x86::UNIT_GROUPS, n_tokens.div_ceil(chunks))
            } else {
                (1, nt_max)
            };
            pool.for_each_range(p.n_groups.div_ceil(span), |items| {
                for g in items.map(|i| i * span) {
                    let mut t0 = 0;
                    while t0 < n_tokens {
                        let nt = token_step.min(n_tokens - t0);
                        // SAFETY: all offsets are within the buffers (sizes fixed above); each
                        // participant writes only its own rows of `out`.
                        unsafe {
                            let tile = Tile {
                                w: (w as *const u8).add(g * wnb * gb),
                                nb: wnb,
                                anb: nb,
                                gb,
                                xq: if tiled {
                                    acts.tiled.as_ptr().add(t0 * cols / 2) as *const i16
                                } else {
                                    acts.qs.as_ptr().add(t0 * cols)
                                },
                                xd: acts.d.as_ptr().add(t0 * nb),
                                xsd: acts.sd.as_ptr().add(t0 * nb),
                                xi: acts.isum.as_ptr().add(t0 * nb),
                                xilo: acts.isum_lo.as_ptr().add(t0 * nb),
                                xhi: acts.hi.as_ptr(),
                                xlo: acts.lo.as_ptr(),
                                xhc: acts.hi_corr.as_ptr(),
                                xs: cols,
                                out: outp.get().add(t0 * rows + g * GROUP),
                                os: rows,
                                nvalid: (span * GROUP).min(rows - g * GROUP),
                            };
                            run_tile(path, ty, &tile, nt, kernel);
                        }
                        t0 += nt;
                    }
                }
            });
        });
    }

    fn matmul_f32(
        &self,
        bytes: &[u8],
        path: KernelPath,
        x: &[f32],
        n_tokens: usize,
        out: &mut [f32],
        pool: &ThreadPool,
    ) {
        let (rows, cols, ty) = (self.rows, self.cols, self.ty);
        let rb = self.row_bytes();
        let outp = SyncPtr(out.as_mut_ptr());
        let n_chunks = rows.div_ceil(F32_ROWS);
        pool.for_each_range(n_chunks, |chunks| {
            ROWS_F32.with(|cell| {
                let mut fresh = Vec::new();
                let mut borrowed = cell.try_borrow_mut();
                let buf: &mut Vec<f32> = match borrowed.as_mut() {
                    Ok(b) => b,
                    Err(_) => &mut fresh,
                };
                buf.resize(F32_ROWS * cols, 0.0);
                for ch in chunks {
                    let r0 = ch * F32_ROWS;
                    let nr = F32_ROWS.min(rows - r0);
                    for i in 0..nr {
                        dequantize_row_on(
                            path,
                            ty,
                            &bytes[(r0 + i) * rb..(r0 + i + 1) * rb],
                            &mut buf[i * cols..(i + 1) * cols],
                        );
                    }
                    let mut t = 0;
                    #[cfg(target_arch = "x86_64")]
                    if path == KernelPath::Avx512 {
                        // 4 rows x 4 tokens register tile; same per-(row, token) arithmetic as
                        // `dot4`, so results do not depend on the batch.
                        while t + 4 <= n_tokens {
                            // SAFETY: the path is supported; lengths are checked inside.
                            let d = unsafe {
                                x86::dot4x4_avx512(buf, nr, cols, &x[t * cols..(t + 4) * cols])
                            };
                            for (j, dj) in d.iter().enumerate() {
                                for (i, v) in dj.iter().enumerate().take(nr) {
                                    // SAFETY: rows r0..r0+nr belong to this participant only.
                                    unsafe { *outp.get().add((t + j) * rows + r0 + i) = *v };
                                }
                            }
                            t += 4;
                        }
                    }
                    while t < n_tokens {
                        let d = dot4(path, buf, nr, cols, &x[t * cols..(t + 1) * cols]);
                        for (i, v) in d.iter().enumerate().take(nr) {
                            // SAFETY: rows r0..r0+nr belong to this participant only.
                            unsafe { *outp.get().add(t * rows + r0 + i) = *v };
                        }
                        t += 1;
                    }
                }
            });
        });
    }

    /// Dequantized row `r` into `out` (`out.len() == cols`).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        assert!(r < self.rows, "row {r} out of {} rows", self.rows);
        assert_eq!(out.len(), self.cols, "row_f32: out has the wrong length");
        let rb = self.row_bytes();
        match &self.data {
            Data::Raw(bytes) => dequantize_row(self.ty, &bytes[r * rb..(r + 1) * rb], out),
            Data::Packed(p) => {
                let mut raw = vec![0u8; rb];
                p.unpack_row(self.ty, r, &mut raw);
                dequantize_row(self.ty, &raw, out);
            }
        }
    }

    /// The bytes of row `r` in GGML layout.
    pub fn row_bytes_ggml(&self, r: usize) -> Vec<u8> {
        let rb = self.row_bytes();
        match &self.data {
            Data::Raw(bytes) => bytes[r * rb..(r + 1) * rb].to_vec(),
            Data::Packed(p) => {
                let mut raw = vec![0u8; rb];
                p.unpack_row(self.ty, r, &mut raw);
                raw
            }
        }
    }

    /// A new owned matrix whose row `i` is row `perm[i]` of `self` (whole rows move, no
    /// requantization). The result has `perm.len()` rows.
    pub fn permute_rows(&self, perm: &[usize]) -> QMatrix {
        let rb = self.row_bytes();
        let mut raw = vec![0u8; perm.len() * rb];
        for (i, &src) in perm.iter().enumerate() {
            assert!(
                src < self.rows,
                "permute_rows: row {src} out of {} rows",
                self.rows
            );
            let dst = &mut raw[i * rb..(i + 1) * rb];
            match &self.data {
                Data::Raw(bytes) => dst.copy_from_slice(&bytes[src * rb..(src + 1) * rb]),
                Data::Packed(p) => p.unpack_row(self.ty, src, dst),
            }
        }
        QMatrix::new(self.ty, perm.len(), self.cols, WeightBytes::from_vec(raw))
            .expect("same geometry")
    }
}

/// Which kernels a matrix product runs on its path.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum TileKernel {
    /// Token tiles of one row group (every path and type).
    Tiles,
    /// Weight-stationary units of two row groups over chunks of up to 48 tokens
    /// (`x86::unit_avx2`): the 256-bit paths' Q4_0, Q4_1 and Q8_0 from 12 tokens on.
    Units,
    /// One token by byte dots (`x86::split_bytes`): the VNNI paths' Q4_0, Q4_1 and Q8_0.
    SplitBytes,
}

impl TileKernel {
    fn for_call(path: KernelPath, ty: QuantType, n_tokens: usize) -> Self {
        let byte_types = matches!(ty, QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q8_0);
        match path {
            #[cfg(target_arch = "x86_64")]
            KernelPath::Avx512 | KernelPath::Avx2Vnni if byte_types && n_tokens == 1 => {
                Self::SplitBytes
            }
            #[cfg(target_arch = "x86_64")]
            KernelPath::Avx2 | KernelPath::Avx2Vnni
                if byte_types && n_tokens >= x86::UNIT_MIN_TOKENS =>
            {
                Self::Units
            }
            _ => Self::Tiles,
        }
    }
}

/// Runs one token tile of one row group on `path` with `kernel` (a unit: up to two groups).
///
/// # Safety
/// `t` must describe valid buffers for `nt` tokens (see [`Tile`]), and `path` must be supported.
unsafe fn run_tile(path: KernelPath, ty: QuantType, t: &Tile, nt: usize, kernel: TileKernel) {
    unsafe {
        match (path, kernel) {
            #[cfg(target_arch = "x86_64")]
            (KernelPath::Avx2, TileKernel::Units) => x86::unit_avx2(ty, t, nt),
            #[cfg(target_arch = "x86_64")]
            (KernelPath::Avx2Vnni, TileKernel::Units) => x86::unit_avx2_vnni(ty, t, nt),
            #[cfg(target_arch = "x86_64")]
            (KernelPath::Avx2Vnni, TileKernel::SplitBytes) => x86::bytes_avx2_vnni(ty, t),
            #[cfg(target_arch = "x86_64")]
            (KernelPath::Avx512, TileKernel::SplitBytes) => x86::bytes_avx512(ty, t),
            #[cfg(target_arch = "x86_64")]
            (KernelPath::Avx512, _) => x86::tile_avx512(ty, t, nt),
            #[cfg(target_arch = "x86_64")]
            (KernelPath::Avx2, _) => x86::tile_avx2(ty, t, nt),
            #[cfg(target_arch = "x86_64")]
            (KernelPath::Avx2Vnni, _) => x86::tile_avx2_vnni(ty, t, nt),
            _ => packed::tile_scalar(ty, t, nt),
        }
    }
}

/// [`dequantize_row`] compiled for `path`.
fn dequantize_row_on(path: KernelPath, ty: QuantType, bytes: &[u8], out: &mut [f32]) {
    match path {
        // SAFETY: the path was checked to be supported by the caller.
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx512 => unsafe { x86::dequantize_row_avx512(ty, bytes, out) },
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx2 | KernelPath::Avx2Vnni => unsafe {
            x86::dequantize_row_avx2(ty, bytes, out)
        },
        _ => dequantize_row(ty, bytes, out),
    }
}

/// Dots of the first `nr` rows of `w` (row stride `cols`) with `x`.
fn dot4(path: KernelPath, w: &[f32], nr: usize, cols: usize, x: &[f32]) -> [f32; 4] {
    match path {
        // SAFETY: the path was checked to be supported by the caller.
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx512 => unsafe { x86::dot4_avx512(w, nr, cols, x) },
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx2 | KernelPath::Avx2Vnni => unsafe { x86::dot4_avx2(w, nr, cols, x) },
        _ => dot4_scalar(w, nr, cols, x),
    }
}

fn dot4_scalar(w: &[f32], nr: usize, cols: usize, x: &[f32]) -> [f32; 4] {
    let mut res = [0.0f32; 4];
    for (r, res) in res.iter_mut().enumerate().take(nr) {
        let row = &w[r * cols..(r + 1) * cols];
        let mut lanes = [0.0f32; 8];
        let mut rc = row.chunks_exact(8);
        let mut xc = x.chunks_exact(8);
        for (a, b) in (&mut rc).zip(&mut xc) {
            for i in 0..8 {
                lanes[i] += a[i] * b[i];
            }
        }
        let mut s = lanes.iter().sum::<f32>();
        for (a, b) in rc.remainder().iter().zip(xc.remainder()) {
            s += a * b;
        }
        *res = s;
    }
    res
}
