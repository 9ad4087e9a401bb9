//! What the batched Q4_1 kernels' instruction mix allows one core: `cargo bench -p duet-cpu
//! --bench dot_mix [-- --rounds N]`.
//!
//! The batched-decode target is a fraction of the compute ceiling: the path's dot instruction on
//! registers only (`KernelPath::integer_macs_per_s`). A kernel cannot issue only that. Besides
//! its dots it reads one operand from memory, widens the 4-bit weights, and per token and block
//! runs the scale step (convert the i32 sums, weight scale × activation scale, multiply-add into
//! the f32 sums, and Q4_1's minimum times the activations' scaled sum). The loops below add these
//! to the dots one at a time, as straight-line code with no loop control, address arithmetic or
//! spills (so each is the best the kernel's instructions could do), and print the dot rate of
//! each against the first, for every kernel path this CPU runs:
//!
//! * `avx512` (`q4_avx512` in `quant/x86.rs`; a block is 16 rows x 32 values x 16 tokens, 256
//!   `vpdpwssd`): `registers` (the ceiling loop's instruction on register operands),
//!   `broadcast` (each token's activation pair broadcast from memory, as the kernel reads it),
//!   `widened` (and the block's 4-bit weights loaded and widened to i16 pairs), `scaled` (and
//!   the scale step of the 16 tokens).
//! * `avx2-vnni` and `avx2` (the weight-stationary units, `unit_256`; a block is 32 rows x 32
//!   values x 3 tokens, 192 dots of `vpdpwssd` or `vpmaddwd` + `vpaddd`): `registers`, `units`
//!   (each token's pair broadcast from memory into a register feeding the dots of four widened
//!   weight vectors read from memory), `scaled` (and the scale step of the 3 tokens). The weights'
//!   widening, once per block for every token of a call, is left out.
//!
//! The last loop of a path is the most its Q4_1 matrix products can reach on this core as a
//! fraction of the ceiling; the `matmul` bench prints what the kernels reach.

use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let rounds = args
        .iter()
        .position(|a| a == "--rounds")
        .and_then(|i| args.get(i + 1))
        .map_or(10, |s| s.parse().expect("--rounds N"));
    assert!(rounds > 0, "--rounds N: at least one round");
    #[cfg(target_arch = "x86_64")]
    if mix::run(rounds) {
        return;
    }
    println!("dot_mix measures the x86-64 kernel paths; this CPU runs none of them");
}

#[cfg(target_arch = "x86_64")]
mod mix {
    use super::*;
    use duet_cpu::quant::KernelPath;

    /// Blocks a timed run of a loop computes.
    const BLOCKS: usize = 2_000_000;

    /// Runs `$body` (one block) [`BLOCKS`] times and returns the seconds taken. Every loop gets
    /// the same buffers: activations `{x}` (4 KiB, a different KiB each block), weights `{w}`
    /// (a 2 KiB block of widened pairs, then f32 or f16 scales from byte 2048), per-token
    /// activation scales `{s}` (and their scaled sums from byte 64), f32 sums `{acc}` (1 KiB).
    /// `$regs` are the asm's register operands.
    macro_rules! timed_blocks {
        ($body:expr, $($regs:tt)*) => {{
            let acts = vec![0x0001_0001i32; 1024];
            let weights = vec![0x3C00_1111u32; 1024];
            let scales = vec![1.0f32; 32];
            let mut acc = vec![0.0f32; 256];
            let start = Instant::now();
            for i in 0..BLOCKS {
                // SAFETY: the caller checked the CPU runs the path; every operand lies within
                // the buffers, and the asm names every register it writes.
                unsafe {
                    std::arch::asm!(
                        // Every loop is given every buffer; a comment names them all.
                        "# {x} {w} {s} {acc}",
                        $body,
                        x = in(reg) acts.as_ptr().add((i & 3) * 256),
                        w = in(reg) weights.as_ptr(),
                        s = in(reg) scales.as_ptr(),
                        acc = in(reg) acc.as_mut_ptr(),
                        $($regs)*
                        options(nostack, preserves_flags),
                    );
                }
            }
            std::hint::black_box(&acc);
            start.elapsed().as_secs_f64()
        }};
    }

    // ---------------------------------------------------------------------------------------
    // AVX-512: token tiles of 16 (accumulators zmm16..zmm31, weight pairs zmm2..zmm9).

    /// 16 `vpdpwssd` of weight register `zmm$w` (pair `$m` of a half block), one per token
    /// accumulator, the tokens' activation pairs broadcast from `[{x} + $h + 64 * $m + 4 * t]`.
    macro_rules! tile_pair_mem {
        ($w:literal, $m:literal, $h:literal) => {
            concat!(
                tile_pair_mem!(@ $w, $m, $h, 16, 0), tile_pair_mem!(@ $w, $m, $h, 17, 1),
                tile_pair_mem!(@ $w, $m, $h, 18, 2), tile_pair_mem!(@ $w, $m, $h, 19, 3),
                tile_pair_mem!(@ $w, $m, $h, 20, 4), tile_pair_mem!(@ $w, $m, $h, 21, 5),
                tile_pair_mem!(@ $w, $m, $h, 22, 6), tile_pair_mem!(@ $w, $m, $h, 23, 7),
                tile_pair_mem!(@ $w, $m, $h, 24, 8), tile_pair_mem!(@ $w, $m, $h, 25, 9),
                tile_pair_mem!(@ $w, $m, $h, 26, 10), tile_pair_mem!(@ $w, $m, $h, 27, 11),
                tile_pair_mem!(@ $w, $m, $h, 28, 12), tile_pair_mem!(@ $w, $m, $h, 29, 13),
                tile_pair_mem!(@ $w, $m, $h, 30, 14), tile_pair_mem!(@ $w, $m, $h, 31, 15),
            )
        };
        (@ $w:literal, $m:literal, $h:literal, $a:literal, $t:literal) => {
            concat!(
                "vpdpwssd zmm", $a, ", zmm", $w, ", dword ptr [{x} + ", $h, " + 64 * ", $m,
                " + 4 * ", $t, "]{{1to16}}\n"
            )
        };
    }

    /// As [`tile_pair_mem`] with the activations in register `zmm1`.
    macro_rules! tile_pair_reg {
        ($w:literal) => {
            concat!(
                tile_pair_reg!(@ $w, 16), tile_pair_reg!(@ $w, 17), tile_pair_reg!(@ $w, 18),
                tile_pair_reg!(@ $w, 19), tile_pair_reg!(@ $w, 20), tile_pair_reg!(@ $w, 21),
                tile_pair_reg!(@ $w, 22), tile_pair_reg!(@ $w, 23), tile_pair_reg!(@ $w, 24),
                tile_pair_reg!(@ $w, 25), tile_pair_reg!(@ $w, 26), tile_pair_reg!(@ $w, 27),
                tile_pair_reg!(@ $w, 28), tile_pair_reg!(@ $w, 29), tile_pair_reg!(@ $w, 30),
                tile_pair_reg!(@ $w, 31),
            )
        };
        (@ $w:literal, $a:literal) => {
            concat!("vpdpwssd zmm", $a, ", zmm", $w, ", zmm1\n")
        };
    }

    /// The dots of one half block (16 values: 8 pairs) whose activations start at `[{x} + $h]`,
    /// 64 bytes a pair (16 tokens).
    macro_rules! tile_half_mem {
        ($h:literal) => {
            concat!(
                tile_pair_mem!(2, 0, $h),
                tile_pair_mem!(3, 1, $h),
                tile_pair_mem!(4, 2, $h),
                tile_pair_mem!(5, 3, $h),
                tile_pair_mem!(6, 4, $h),
                tile_pair_mem!(7, 5, $h),
                tile_pair_mem!(8, 6, $h),
                tile_pair_mem!(9, 7, $h),
            )
        };
    }

    /// Widens chunk `$c` (64 bytes at `[{w} + 64 * $c]`) of the block's 4-bit quants into the
    /// i16 pairs `zmm$lo`, `zmm$hi`, as `nibble_pairs` does, after `$shift`: nothing for the low
    /// nibbles, a shift by 4 for the high ones (the mask 0x000F000F is in `zmm15`).
    macro_rules! widen_chunk {
        ($c:literal, $shift:expr, $lo:literal, $hi:literal) => {
            concat!(
                "vmovdqu64 zmm0, zmmword ptr [{w} + 64 * ",
                $c,
                "]\n",
                $shift,
                "vpsrld zmm1, zmm0, 8\n",
                "vpandq zmm",
                $lo,
                ", zmm0, zmm15\n",
                "vpandq zmm",
                $hi,
                ", zmm1, zmm15\n",
            )
        };
    }

    macro_rules! widen_half {
        ($shift:expr) => {
            concat!(
                widen_chunk!(0, $shift, 2, 3),
                widen_chunk!(1, $shift, 4, 5),
                widen_chunk!(2, $shift, 6, 7),
                widen_chunk!(3, $shift, 8, 9),
            )
        };
    }

    /// Q4_1's scale step for token `$t` (i32 sums in `zmm$a`, weight scales and minimums in
    /// `zmm14` and `zmm13`, the token's activation scale and scaled sum at `[{s} + 4 * $t]` and
    /// `[{s} + 64 + 4 * $t]`, its f32 sums at `[{acc} + 64 * $t]`), then its i32 sums zeroed
    /// for the next block.
    macro_rules! tile_scale_token {
        ($a:literal, $t:literal) => {
            concat!(
                "vcvtdq2ps zmm0, zmm",
                $a,
                "\n",
                "vmulps zmm1, zmm14, dword ptr [{s} + 4 * ",
                $t,
                "]{{1to16}}\n",
                "vfmadd213ps zmm1, zmm0, zmmword ptr [{acc} + 64 * ",
                $t,
                "]\n",
                "vfmadd231ps zmm1, zmm13, dword ptr [{s} + 64 + 4 * ",
                $t,
                "]{{1to16}}\n",
                "vmovups zmmword ptr [{acc} + 64 * ",
                $t,
                "], zmm1\n",
                "vpxord zmm",
                $a,
                ", zmm",
                $a,
                ", zmm",
                $a,
                "\n",
            )
        };
    }

    macro_rules! tile_scale {
        () => {
            concat!(
                "vcvtph2ps zmm14, ymmword ptr [{w} + 2048]\n",
                "vcvtph2ps zmm13, ymmword ptr [{w} + 2080]\n",
                tile_scale_token!(16, 0),
                tile_scale_token!(17, 1),
                tile_scale_token!(18, 2),
                tile_scale_token!(19, 3),
                tile_scale_token!(20, 4),
                tile_scale_token!(21, 5),
                tile_scale_token!(22, 6),
                tile_scale_token!(23, 7),
                tile_scale_token!(24, 8),
                tile_scale_token!(25, 9),
                tile_scale_token!(26, 10),
                tile_scale_token!(27, 11),
                tile_scale_token!(28, 12),
                tile_scale_token!(29, 13),
                tile_scale_token!(30, 14),
                tile_scale_token!(31, 15),
            )
        };
    }

    macro_rules! timed_tiles {
        ($body:expr) => {
            timed_blocks!(
                $body,
                out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _,
                out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _,
                out("zmm8") _, out("zmm9") _, out("zmm13") _, out("zmm14") _,
                out("zmm16") _, out("zmm17") _, out("zmm18") _, out("zmm19") _,
                out("zmm20") _, out("zmm21") _, out("zmm22") _, out("zmm23") _,
                out("zmm24") _, out("zmm25") _, out("zmm26") _, out("zmm27") _,
                out("zmm28") _, out("zmm29") _, out("zmm30") _, out("zmm31") _,
                in("zmm15") std::arch::x86_64::_mm512_set1_epi32(0x000F_000F),
            )
        };
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")]
    fn tile_registers() -> f64 {
        timed_tiles!(concat!(
            tile_pair_reg!(2),
            tile_pair_reg!(3),
            tile_pair_reg!(4),
            tile_pair_reg!(5),
            tile_pair_reg!(6),
            tile_pair_reg!(7),
            tile_pair_reg!(8),
            tile_pair_reg!(9),
            tile_pair_reg!(2),
            tile_pair_reg!(3),
            tile_pair_reg!(4),
            tile_pair_reg!(5),
            tile_pair_reg!(6),
            tile_pair_reg!(7),
            tile_pair_reg!(8),
            tile_pair_reg!(9),
        ))
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")]
    fn tile_broadcast() -> f64 {
        timed_tiles!(concat!(tile_half_mem!(0), tile_half_mem!(512)))
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")]
    fn tile_widened() -> f64 {
        timed_tiles!(concat!(
            widen_half!(""),
            tile_half_mem!(0),
            widen_half!("vpsrld zmm0, zmm0, 4\n"),
            tile_half_mem!(512),
        ))
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")]
    fn tile_scaled() -> f64 {
        timed_tiles!(concat!(
            widen_half!(""),
            tile_half_mem!(0),
            widen_half!("vpsrld zmm0, zmm0, 4\n"),
            tile_half_mem!(512),
            tile_scale!(),
        ))
    }

    // ---------------------------------------------------------------------------------------
    // 256-bit units: 3 tokens x 4 weight vectors (accumulators ymm0..ymm11, token t's in
    // ymm(4t)..ymm(4t+3)), the broadcast in ymm12, a product in ymm13.

    /// Token accumulator `ymm$a` plus the dot of the broadcast pair with weight vector `$r` of
    /// pair `$m`, read from memory: one AVX-VNNI `vpdpwssd`.
    macro_rules! dot_vnni {
        ($a:literal, $m:literal, $r:literal) => {
            concat!(
                "{{vex}} vpdpwssd ymm",
                $a,
                ", ymm12, ymmword ptr [{w} + 128 * ",
                $m,
                " + 32 * ",
                $r,
                "]\n"
            )
        };
    }

    /// As [`dot_vnni`] with AVX2's `vpmaddwd` + `vpaddd`.
    macro_rules! dot_avx2 {
        ($a:literal, $m:literal, $r:literal) => {
            concat!(
                "vpmaddwd ymm13, ymm12, ymmword ptr [{w} + 128 * ",
                $m,
                " + 32 * ",
                $r,
                "]\n",
                "vpaddd ymm",
                $a,
                ", ymm",
                $a,
                ", ymm13\n"
            )
        };
    }

    /// The ceiling loop's form of [`dot_vnni`]: register operands only.
    macro_rules! reg_vnni {
        ($a:literal, $m:literal, $r:literal) => {
            concat!("{{vex}} vpdpwssd ymm", $a, ", ymm14, ymm15\n")
        };
    }

    /// The ceiling loop's form of [`dot_avx2`].
    macro_rules! reg_avx2 {
        ($a:literal, $m:literal, $r:literal) => {
            concat!(
                "vpmaddwd ymm13, ymm14, ymm15\n",
                "vpaddd ymm",
                $a,
                ", ymm",
                $a,
                ", ymm13\n"
            )
        };
    }

    /// Pair `$m` of token `$t` (accumulators `ymm$a0..`): its broadcast and four `$dot`s.
    macro_rules! unit_token {
        ($dot:ident, $m:literal, $t:literal, $a0:literal, $a1:literal, $a2:literal, $a3:literal) => {
            concat!(
                "vpbroadcastd ymm12, dword ptr [{x} + 64 * ",
                $t,
                " + 4 * ",
                $m,
                "]\n",
                $dot!($a0, $m, 0),
                $dot!($a1, $m, 1),
                $dot!($a2, $m, 2),
                $dot!($a3, $m, 3),
            )
        };
    }

    /// As [`unit_token`] for the ceiling loop's form: no broadcast.
    macro_rules! reg_token {
        ($dot:ident, $m:literal, $t:literal, $a0:literal, $a1:literal, $a2:literal, $a3:literal) => {
            concat!(
                $dot!($a0, $m, 0),
                $dot!($a1, $m, 1),
                $dot!($a2, $m, 2),
                $dot!($a3, $m, 3)
            )
        };
    }

    /// A block's dots: every pair, each token's in turn, each token's through `$token`.
    macro_rules! unit_dots {
        ($token:ident, $dot:ident) => {
            unit_dots!(@ $token, $dot, [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15])
        };
        (@ $token:ident, $dot:ident, [$($m:literal)*]) => {
            concat!($(
                $token!($dot, $m, 0, 0, 1, 2, 3),
                $token!($dot, $m, 1, 4, 5, 6, 7),
                $token!($dot, $m, 2, 8, 9, 10, 11),
            )*)
        };
    }

    /// Q4_1's scale step of token `$t`'s vector `$r` (i32 sums in `ymm$a`; the token's
    /// activation scale broadcast in `ymm15`, its scaled sum in `ymm12`; the unit's f32 weight
    /// scales and minimums at `[{w} + 2048]` and `[{w} + 2176]`, 32 bytes a vector), then the
    /// sums zeroed.
    macro_rules! unit_scale_vector {
        ($t:literal, $r:literal, $a:literal) => {
            concat!(
                "vcvtdq2ps ymm13, ymm",
                $a,
                "\n",
                "vmulps ymm14, ymm15, ymmword ptr [{w} + 2048 + 32 * ",
                $r,
                "]\n",
                "vfmadd213ps ymm14, ymm13, ymmword ptr [{acc} + 128 * ",
                $t,
                " + 32 * ",
                $r,
                "]\n",
                "vfmadd231ps ymm14, ymm12, ymmword ptr [{w} + 2176 + 32 * ",
                $r,
                "]\n",
                "vmovups ymmword ptr [{acc} + 128 * ",
                $t,
                " + 32 * ",
                $r,
                "], ymm14\n",
                "vpxor ymm",
                $a,
                ", ymm",
                $a,
                ", ymm",
                $a,
                "\n",
            )
        };
    }

    macro_rules! unit_scale_token {
        ($t:literal, $a0:literal, $a1:literal, $a2:literal, $a3:literal) => {
            concat!(
                "vbroadcastss ymm15, dword ptr [{s} + 4 * ",
                $t,
                "]\n",
                "vbroadcastss ymm12, dword ptr [{s} + 64 + 4 * ",
                $t,
                "]\n",
                unit_scale_vector!($t, 0, $a0),
                unit_scale_vector!($t, 1, $a1),
                unit_scale_vector!($t, 2, $a2),
                unit_scale_vector!($t, 3, $a3),
            )
        };
    }

    macro_rules! unit_scale {
        () => {
            concat!(
                unit_scale_token!(0, 0, 1, 2, 3),
                unit_scale_token!(1, 4, 5, 6, 7),
                unit_scale_token!(2, 8, 9, 10, 11),
            )
        };
    }

    macro_rules! timed_units {
        ($body:expr) => {
            timed_blocks!(
                $body,
                out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _,
                out("ymm4") _, out("ymm5") _, out("ymm6") _, out("ymm7") _,
                out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
                out("ymm12") _, out("ymm13") _, out("ymm14") _, out("ymm15") _,
            )
        };
    }

    /// The three unit loops of one path (`$reg`, `$dot`: its dot in the two forms), in module
    /// `$path` under the path's target features.
    macro_rules! unit_loops {
        ($path:ident, $features:literal, $reg:ident, $dot:ident) => {
            mod $path {
                use super::*;

                #[target_feature(enable = $features)]
                pub(super) fn registers() -> f64 {
                    timed_units!(unit_dots!(reg_token, $reg))
                }

                #[target_feature(enable = $features)]
                pub(super) fn units() -> f64 {
                    timed_units!(unit_dots!(unit_token, $dot))
                }

                #[target_feature(enable = $features)]
                pub(super) fn scaled() -> f64 {
                    timed_units!(concat!(unit_dots!(unit_token, $dot), unit_scale!()))
                }

                // SAFETY: `run` measures them only where the CPU runs the path.
                pub(super) const LOOPS: [(&str, Loop); 3] = [
                    ("registers", || unsafe { registers() }),
                    ("units", || unsafe { units() }),
                    ("scaled", || unsafe { scaled() }),
                ];
            }
        };
    }

    unit_loops!(vnni, "avx2,avxvnni,f16c,fma", reg_vnni, dot_vnni);
    unit_loops!(avx2, "avx2,f16c,fma", reg_avx2, dot_avx2);

    // ---------------------------------------------------------------------------------------

    /// One timed run of a loop: seconds for [`BLOCKS`] blocks.
    type Loop = fn() -> f64;

    /// A block of a loop family: its dot instructions, and the multiply-accumulates each does
    /// (how the path's ceiling, counted in those, becomes a rate of dots).
    struct Block {
        dots: usize,
        macs_per_dot: usize,
    }

    /// AVX-512 tiles: 16 rows x 32 values x 16 tokens, `vpdpwssd` zmm (16 lanes x 2).
    const TILE_BLOCK: Block = Block {
        dots: 256,
        macs_per_dot: 32,
    };
    /// 256-bit units: 32 rows x 32 values x 3 tokens, a ymm dot (8 lanes x 2).
    const UNIT_BLOCK: Block = Block {
        dots: 192,
        macs_per_dot: 16,
    };

    /// Times `loops` (the first on registers only) round after round, best of `rounds`, and
    /// prints each one's dot rate against the first and the path's own ceiling loop.
    fn measure(path: KernelPath, block: Block, rounds: usize, loops: &[(&str, Loop)]) {
        let dots_per_block = block.dots;
        println!(
            "\n== {}: one core, {BLOCKS} blocks of {dots_per_block} dots, best of {rounds} runs ==",
            path.name()
        );
        // Each round runs every loop once, so a slow phase of the host touches them alike.
        let mut best = vec![f64::INFINITY; loops.len()];
        let mut ceiling = 0.0f64;
        for _ in 0..rounds {
            for (b, (_, f)) in best.iter_mut().zip(loops) {
                *b = b.min(f());
            }
            let macs = path.integer_macs_per_s().unwrap_or(0.0);
            ceiling = ceiling.max(macs / block.macs_per_dot as f64);
        }
        println!(
            "the compute ceiling's own loop (KernelPath::integer_macs_per_s): {:.2} G dots/s",
            ceiling / 1e9
        );
        let rate = |s: f64| (BLOCKS * dots_per_block) as f64 / s / 1e9;
        for ((name, _), &s) in loops.iter().zip(&best) {
            println!(
                "{name:<10} {:>6.2} G dots/s  {:>5.1}% of registers",
                rate(s),
                100.0 * rate(s) / rate(best[0])
            );
        }
    }

    /// Measures every path this CPU runs; false when it runs none of them.
    pub(super) fn run(rounds: usize) -> bool {
        if KernelPath::Avx512.supported() {
            // SAFETY (all four): measured only where the CPU runs the path.
            let loops: [(&str, Loop); 4] = [
                ("registers", || unsafe { tile_registers() }),
                ("broadcast", || unsafe { tile_broadcast() }),
                ("widened", || unsafe { tile_widened() }),
                ("scaled", || unsafe { tile_scaled() }),
            ];
            measure(KernelPath::Avx512, TILE_BLOCK, rounds, &loops);
        }
        if KernelPath::Avx2Vnni.supported() {
            measure(KernelPath::Avx2Vnni, UNIT_BLOCK, rounds, &vnni::LOOPS);
        }
        if KernelPath::Avx2.supported() {
            measure(KernelPath::Avx2, UNIT_BLOCK, rounds, &avx2::LOOPS);
        }
        KernelPath::Avx2.supported()
    }
}
