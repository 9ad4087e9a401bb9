//! `kernels/quant_matvec.cu` run in the CPU emulator against duet's CPU reading of the same
//! packed bytes (`duet_model::dequant`, what the CPU backend's kernels compute from): for every
//! GGUF block format kept packed on the GPU, the product of a few rows within f32 rounding of a
//! float64 product over the dequantized values, the bf16 tile and the embedding rows bit for
//! bit. Needs a C++17 compiler and python3, no GPU.

use duet_cuda::backend::bf16_bits;
use duet_cuda::kernels::{QMV_ROWS, QMV_WARPS};
use duet_cuda::packed_weights::{PackedLayout, kernels};
use duet_model::dequant::dequantize_row;
use duet_model::quant_type::QuantType;
use duet_model::synthetic::{Uniform, random_blocks};

use crate::emulated::Emulated;

type LaunchMatvec =
    unsafe extern "C" fn(u32, u32, u32, u32, *const u8, *const f32, *mut f32, i32, i32, i32);
type LaunchToBf16 = unsafe extern "C" fn(u32, u32, u32, u32, *const u8, *mut u16, i32, i32);
type LaunchEmbed = unsafe extern "C" fn(u32, u32, u32, u32, *const u8, *const u32, *mut f32, i32);

/// ‖got − reference‖ / ‖reference‖.
fn relative(got: &[f32], reference: &[f64]) -> f64 {
    let (mut d, mut r) = (0.0, 0.0);
    for (g, e) in got.iter().zip(reference) {
        d += (*g as f64 - e).powi(2);
        r += e * e;
    }
    (d / r).sqrt()
}

#[test]
fn packed_kernels_compute_what_the_cpu_reads_from_the_same_bytes() {
    let emulated = Emulated::build("quant_matvec");
    let mut noise = Uniform::new(11);
    for ty in QuantType::BLOCK_FORMATS {
        let k_names = kernels(ty).unwrap();
        let bl = ty.block_len();
        // Fewer units of 32 than a warp's lanes, and more.
        for (n, cols) in [(13usize, 7 * bl), (6, 1088usize.next_multiple_of(bl))] {
            let w = random_blocks(ty, n, cols, 1.0 / (cols as f32).sqrt(), &mut noise);
            let layout = PackedLayout::of("w", ty, n, cols, w.len())
                .unwrap()
                .unwrap();
            let mut values = vec![0f32; n * cols];
            for (row, out) in w
                .chunks_exact(layout.row_bytes)
                .zip(values.chunks_exact_mut(cols))
            {
                dequantize_row(ty, row, out);
            }
            // SAFETY: the launchers' signatures are gen.py's for these kernels; every array
            // holds what the kernel reads or writes for the shapes passed.
            unsafe {
                let to_bf16: libloading::Symbol<'_, LaunchToBf16> = emulated
                    .lib
                    .get(format!("L_{}", k_names.to_bf16).as_bytes())
                    .unwrap();
                let mut tile = vec![0xffffu16; n * cols];
                to_bf16(
                    5,
                    1,
                    1,
                    64,
                    w.as_ptr(),
                    tile.as_mut_ptr(),
                    n as i32,
                    cols as i32,
                );
                assert_eq!(tile, bf16_bits(&values), "{ty} {n}x{cols}: bf16 tile");

                let embed: libloading::Symbol<'_, LaunchEmbed> = emulated
                    .lib
                    .get(format!("L_{}", k_names.embed_rows).as_bytes())
                    .unwrap();
                let tokens: Vec<u32> = vec![0, (n - 1) as u32, 2, 2];
                let mut rows = vec![f32::NAN; tokens.len() * cols];
                let g = tokens.len() as u32;
                embed(
                    g,
                    1,
                    1,
                    128,
                    w.as_ptr(),
                    tokens.as_ptr(),
                    rows.as_mut_ptr(),
                    cols as i32,
                );
                for (t, row) in tokens.iter().zip(rows.chunks_exact(cols)) {
                    let want = &values[*t as usize * cols..][..cols];
                    assert!(
                        row.iter()
                            .zip(want)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{ty} {n}x{cols}: embedding row {t}"
                    );
                }

                let matvec: libloading::Symbol<'_, LaunchMatvec> = emulated
                    .lib
                    .get(format!("L_{}", k_names.matvec).as_bytes())
                    .unwrap();
                for rows in [1usize, 3, QMV_ROWS, QMV_ROWS + 3] {
                    let x: Vec<f32> = noise.values(rows * cols);
                    let mut out = vec![f32::NAN; rows * n];
                    let ((gx, gy, _), block) = layout.matvec_grid(rows);
                    assert_eq!(block as usize, 32 * QMV_WARPS);
                    matvec(
                        gx,
                        gy,
                        1,
                        block,
                        w.as_ptr(),
                        x.as_ptr(),
                        out.as_mut_ptr(),
                        rows as i32,
                        n as i32,
                        cols as i32,
                    );
                    let reference: Vec<f64> = (0..rows * n)
                        .map(|i| {
                            let (r, j) = (i / n, i % n);
                            x[r * cols..][..cols]
                                .iter()
                                .zip(&values[j * cols..][..cols])
                                .map(|(a, b)| *a as f64 * *b as f64)
                                .sum()
                        })
                        .collect();
                    let rel = relative(&out, &reference);
                    assert!(
                        rel < 1e-6,
                        "{ty} {n}x{cols}, {rows} rows: ‖Δ‖/‖ref‖ = {rel:e}"
                    );
                }
            }
        }
    }
}
