//! GGUF weights kept packed on the GPU (`--gpu-weights packed`): which formats the kernels of
//! `kernels/quant_matvec.cu` read, what a packed matrix takes in memory, and how a product over
//! one is split. The file's bytes are uploaded as they are (rows of whole blocks, back to back),
//! so a model's weight memory on the GPU is its file's tensor bytes.

use duet_model::quant_type::QuantType;

use crate::CudaError;
use crate::kernels::{QMV_ROWS, QMV_WARPS};

/// Most activation rows a product reads the packed blocks for directly (decode and small
/// batches); more rows (prefill, large decode batches) dequantize the matrix to bf16 a tile at a
/// time for cuBLAS, where the tensor cores pay for the extra pass.
pub const MATVEC_MAX_ROWS: usize = 16;

/// Values of one dequantized tile (32 MiB of bf16): the scratch buffer prefill's products
/// dequantize into.
pub const TILE_VALUES: usize = 16 << 20;

/// Device allocations start on this boundary (cudaMalloc's is 256 bytes).
pub const ALLOCATION_ALIGN: usize = 256;

/// The kernels of `kernels/quant_matvec.cu` reading one format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantKernels {
    /// The product of a few activation rows, dequantizing in registers.
    pub matvec: &'static str,
    /// Rows dequantized to bf16 (a tile of prefill's product).
    pub to_bf16: &'static str,
    /// The embedding's row gather.
    pub embed_rows: &'static str,
}

/// The kernels of a format kept packed; `None` for the float types, which the GPU keeps in bf16
/// either way. Every block format duet reads has kernels (the GGUF loader refuses other types,
/// naming the tensor).
pub fn kernels(ty: QuantType) -> Option<QuantKernels> {
    let k = |matvec, to_bf16, embed_rows| {
        Some(QuantKernels {
            matvec,
            to_bf16,
            embed_rows,
        })
    };
    match ty {
        QuantType::Q4_0 => k(
            "quant_matvec_q4_0",
            "quant_to_bf16_q4_0",
            "quant_embed_rows_q4_0",
        ),
        QuantType::Q4_1 => k(
            "quant_matvec_q4_1",
            "quant_to_bf16_q4_1",
            "quant_embed_rows_q4_1",
        ),
        QuantType::Q8_0 => k(
            "quant_matvec_q8_0",
            "quant_to_bf16_q8_0",
            "quant_embed_rows_q8_0",
        ),
        QuantType::Q4_K => k(
            "quant_matvec_q4_k",
            "quant_to_bf16_q4_k",
            "quant_embed_rows_q4_k",
        ),
        QuantType::Q6_K => k(
            "quant_matvec_q6_k",
            "quant_to_bf16_q6_k",
            "quant_embed_rows_q6_k",
        ),
        QuantType::F32 | QuantType::F16 | QuantType::BF16 => None,
    }
}

/// A matrix `[rows][cols]` of GGML blocks of type `ty`, as stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackedLayout {
    pub ty: QuantType,
    pub rows: usize,
    pub cols: usize,
    /// Bytes of one row: `cols / block length` blocks.
    pub row_bytes: usize,
}

impl PackedLayout {
    /// The layout of tensor `name`, checked against its `bytes`; `None` for a float type.
    pub fn of(
        name: &str,
        ty: QuantType,
        rows: usize,
        cols: usize,
        bytes: usize,
    ) -> Result<Option<Self>, CudaError> {
        if kernels(ty).is_none() {
            return Ok(None);
        }
        let row_bytes = ty.row_bytes(cols).ok_or_else(|| {
            CudaError::Unsupported(format!(
                "tensor {name}: {ty} rows of {cols} values are not whole blocks of {} \
                 (--gpu-weights packed)",
                ty.block_len()
            ))
        })?;
        if rows * row_bytes != bytes {
            return Err(CudaError::Unsupported(format!(
                "tensor {name}: {ty} [{rows} x {cols}] is {} bytes, not {bytes}",
                rows * row_bytes
            )));
        }
        Ok(Some(Self {
            ty,
            rows,
            cols,
            row_bytes,
        }))
    }

    /// Bytes of the matrix.
    pub fn bytes(&self) -> usize {
        self.rows * self.row_bytes
    }

    /// Bytes its allocation takes on the device.
    pub fn device_bytes(&self) -> usize {
        self.bytes().next_multiple_of(ALLOCATION_ALIGN)
    }

    /// The kernels reading this format.
    pub fn kernels(&self) -> QuantKernels {
        kernels(self.ty).expect("a packed layout's type has kernels")
    }

    /// The matrix-vector launch for `rows` activation rows: (grid, block).
    pub fn matvec_grid(&self, rows: usize) -> ((u32, u32, u32), u32) {
        (
            (
                self.rows.div_ceil(QMV_WARPS) as u32,
                rows.div_ceil(QMV_ROWS) as u32,
                1,
            ),
            (32 * QMV_WARPS) as u32,
        )
    }

    /// Weight rows dequantized per tile (at least one).
    pub fn tile_rows(&self) -> usize {
        (TILE_VALUES / self.cols).clamp(1, self.rows)
    }

    /// The tiles of a product: (first row, rows).
    pub fn tiles(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        let t = self.tile_rows();
        (0..self.rows)
            .step_by(t)
            .map(move |r| (r, t.min(self.rows - r)))
    }

    /// Bytes of the bf16 scratch buffer a tile takes.
    pub fn tile_bytes(&self) -> usize {
        self.tile_rows() * self.cols * 2
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::FILES;

    #[test]
    fn block_formats_are_packed_and_float_types_are_not() {
        for ty in QuantType::ALL {
            let packed = PackedLayout::of("t", ty, 2, 256, 2 * ty.row_bytes(256).unwrap())
                .unwrap()
                .is_some();
            assert_eq!(packed, ty.block_len() > 1, "{ty}");
        }
    }

    #[test]
    fn every_format_s_kernels_are_in_quant_matvec_cu() {
        let file = FILES.iter().find(|f| f.name == "quant_matvec.cu").unwrap();
        let mut named: Vec<&str> = QuantType::ALL
            .into_iter()
            .filter_map(kernels)
            .flat_map(|k| [k.matvec, k.to_bf16, k.embed_rows])
            .collect();
        let mut listed = file.kernels.to_vec();
        named.sort_unstable();
        listed.sort_unstable();
        assert_eq!(named, listed);
    }

    #[test]
    fn rows_bytes_and_tiles_of_each_format() {
        // (type, bytes of a 4096-value row): 128 blocks of 18, 20, 34 bytes; 16 of 144, 210.
        for (ty, row) in [
            (QuantType::Q4_0, 2304),
            (QuantType::Q4_1, 2560),
            (QuantType::Q8_0, 4352),
            (QuantType::Q4_K, 2304),
            (QuantType::Q6_K, 3360),
        ] {
            let l = PackedLayout::of("w", ty, 14336, 4096, 14336 * row)
                .unwrap()
                .unwrap();
            assert_eq!(l.row_bytes, row, "{ty}");
            assert_eq!(l.bytes(), 14336 * row);
            assert_eq!(l.device_bytes() % ALLOCATION_ALIGN, 0);
            assert!(l.device_bytes() - l.bytes() < ALLOCATION_ALIGN);
            // 4096 rows a tile: 32 MiB of bf16; the tiles cover every row once.
            assert_eq!(l.tile_rows(), 4096);
            assert_eq!(l.tile_bytes(), 32 << 20);
            let tiles: Vec<_> = l.tiles().collect();
            assert_eq!(
                tiles,
                vec![(0, 4096), (4096, 4096), (8192, 4096), (12288, 2048)]
            );
            assert_eq!(l.matvec_grid(1), ((3584, 1, 1), 128));
            assert_eq!(l.matvec_grid(9).0.1, 2);
        }
    }

    #[test]
    fn a_tensor_that_is_not_whole_blocks_is_named() {
        let e = PackedLayout::of("blk.3.ffn_down.weight", QuantType::Q4_K, 8, 300, 0)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("blk.3.ffn_down.weight") && e.contains("Q4_K") && e.contains("256"),
            "{e}"
        );
        let e = PackedLayout::of("token_embd.weight", QuantType::Q8_0, 8, 64, 100)
            .unwrap_err()
            .to_string();
        assert!(e.contains("token_embd.weight") && e.contains("544"), "{e}");
    }

    /// The Llama-3-8B shape in each format: the GPU holds the file's bytes, to within the
    /// allocations' alignment (GGUF aligns each tensor to 32 bytes; here to 256).
    #[test]
    fn weight_memory_on_the_gpu_is_the_file_s_size() {
        let (h, q, kv, f, vocab) = (4096, 4096, 1024, 14336, 128256);
        let mut matrices = vec![(vocab, h), (vocab, h)]; // embedding, output
        for _ in 0..32 {
            // Stacked QKV and gate/up as the backend uploads them, attention output, down.
            matrices.extend([(q + 2 * kv, h), (h, q), (2 * f, h), (h, f)]);
        }
        for ty in QuantType::BLOCK_FORMATS {
            let file: usize = matrices
                .iter()
                .map(|&(r, cols)| (r * ty.row_bytes(cols).unwrap()).next_multiple_of(32))
                .sum();
            let gpu: usize = matrices
                .iter()
                .map(|&(r, cols)| {
                    PackedLayout::of("w", ty, r, cols, r * ty.row_bytes(cols).unwrap())
                        .unwrap()
                        .unwrap()
                        .device_bytes()
                })
                .sum();
            let ratio = gpu as f64 / file as f64;
            assert!((1.0..1.0001).contains(&ratio), "{ty}: {gpu} / {file}");
            // Against bf16: the 4-bit formats a quarter and some, Q8_0 a little over half.
            let bf16: usize = matrices.iter().map(|&(r, cols)| r * cols * 2).sum();
            let share = gpu as f64 / bf16 as f64;
            let expected = ty.block_bytes() as f64 / (2 * ty.block_len()) as f64;
            assert!((share - expected).abs() < 1e-3, "{ty}: {share}");
        }
    }
}
