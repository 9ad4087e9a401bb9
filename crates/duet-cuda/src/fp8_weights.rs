//! FP8 weight matrices on the GPU (an FP8 checkpoint, or `--quantization fp8`): the E4M3 values
//! as the checkpoint or the quantizer wrote them, then a scale per row, in one allocation; their
//! products run through cuBLASLt's FP8 GEMM (GPUs of compute capability 8.9 and later), the
//! input quantized to E4M3 a row at a time and the scales applied to the output by the kernels of
//! `kernels/fp8_weights.cu`.

use duet_model::fp8::Fp8Matrix;

use crate::CudaError;
use crate::backend::FP8_MIN_COMPUTE_CAPABILITY;

/// cuBLASLt's FP8 kernels take operands on 16-byte boundaries whose leading dimensions are
/// multiples of 16: both dimensions of an FP8 matrix must be.
pub const DIM_MULTIPLE: usize = 16;

/// Threads of a `quantize_rows_e4m3` block (one block a row).
pub const QUANTIZE_THREADS: u32 = 256;

/// Where an FP8 matrix's parts lie in its allocation, and its input scale.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fp8Layout {
    pub rows: usize,
    pub cols: usize,
    /// The static scale of the product's input (a checkpoint's `input_scale`); `None`: each
    /// input row gets its own.
    pub input_scale: Option<f32>,
}

impl Fp8Layout {
    /// The layout of `m`; an error naming it when cuBLASLt cannot take its shape.
    pub fn of(m: &Fp8Matrix) -> Result<Self, CudaError> {
        if !m.rows.is_multiple_of(DIM_MULTIPLE) || !m.cols.is_multiple_of(DIM_MULTIPLE) {
            return Err(CudaError::Unsupported(format!(
                "tensor {}: FP8 products (cuBLASLt) need both dimensions multiples of {DIM_MULTIPLE}, \
                 and it is [{}, {}] (rows, cols)",
                m.name, m.rows, m.cols
            )));
        }
        Ok(Self {
            rows: m.rows,
            cols: m.cols,
            input_scale: m.input_scale,
        })
    }

    /// Where the row scales (f32) start: after the E4M3 values, on a 16-byte boundary.
    pub fn scales_offset(&self) -> usize {
        (self.rows * self.cols).next_multiple_of(16)
    }

    /// Bytes of device memory the matrix takes: one byte a weight, four a row.
    pub fn bytes(&self) -> usize {
        self.scales_offset() + self.rows * 4
    }

    /// The matrix as uploaded: the E4M3 bytes, padding, then the scales.
    pub fn image(&self, m: &Fp8Matrix) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.bytes());
        out.extend_from_slice(&m.weights);
        out.resize(self.scales_offset(), 0);
        out.extend(m.scales.iter().flat_map(|s| s.to_le_bytes()));
        out
    }

    /// The `quantize_rows_e4m3` argument: the static input scale, or 0 for a scale per row.
    pub fn static_input_scale(&self) -> f32 {
        self.input_scale.unwrap_or(0.0)
    }
}

/// Bytes of the scratch a product's input takes quantized: `rows × cols` E4M3 values, then a
/// scale per row on a 16-byte boundary.
pub fn input_bytes(rows: usize, cols: usize) -> usize {
    input_scales_offset(rows, cols) + rows * 4
}

/// Where the input's row scales start in that scratch.
pub fn input_scales_offset(rows: usize, cols: usize) -> usize {
    (rows * cols).next_multiple_of(16)
}

/// An error naming `what` and the compute capability when a GPU of `cc` has no FP8 products.
pub fn require_fp8(cc: (i32, i32), what: &str) -> Result<(), CudaError> {
    if cc >= FP8_MIN_COMPUTE_CAPABILITY {
        return Ok(());
    }
    let (major, minor) = FP8_MIN_COMPUTE_CAPABILITY;
    Err(CudaError::Unsupported(format!(
        "FP8 weights ({what}) need a GPU of compute capability {major}.{minor} or later \
         (Ada, Hopper), and this one is {}.{}: serve the model with --device cpu, or with \
         --quantization none from a BF16/F16/F32 checkpoint",
        cc.0, cc.1
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use duet_model::storage::WeightBytes;

    fn matrix(name: &str, rows: usize, cols: usize) -> Fp8Matrix {
        Fp8Matrix::new(
            name,
            rows,
            cols,
            WeightBytes::from_vec(vec![0x38; rows * cols]),
            (0..rows).map(|r| r as f32).collect(),
            None,
        )
        .unwrap()
    }

    #[test]
    fn an_fp8_matrix_takes_a_byte_a_weight_and_four_a_row() {
        // Llama-3-8B's projections: q, k and v stacked, o, gate and up stacked, down.
        let (h, kv, ffn) = (4096, 1024, 14336);
        let shapes = [(h + 2 * kv, h), (h, h), (2 * ffn, h), (h, ffn)];
        let weights: usize = shapes.iter().map(|(r, c)| r * c).sum();
        let bytes: usize = shapes
            .iter()
            .map(|&(r, c)| Fp8Layout::of(&matrix("w", r, c)).unwrap().bytes())
            .sum();
        let rows: usize = shapes.iter().map(|(r, _)| r).sum();
        assert_eq!(bytes, weights + 4 * rows);
        // Half of bf16's, within a tenth of a percent.
        assert!((bytes as f64 / (2 * weights) as f64 - 0.5).abs() < 1e-3);

        let m = matrix("w", 16, 48);
        let layout = Fp8Layout::of(&m).unwrap();
        assert_eq!((layout.scales_offset(), layout.bytes()), (768, 832));
        let image = layout.image(&m);
        assert_eq!(image.len(), layout.bytes());
        assert_eq!(image[764..768], [0x38; 4]);
        assert_eq!(image[768..772], 0f32.to_le_bytes());
        assert_eq!(image[828..832], 15f32.to_le_bytes());
        // The input scratch: E4M3 rows, then scales on a 16-byte boundary.
        assert_eq!((input_scales_offset(3, 17), input_bytes(3, 17)), (64, 76));
    }

    #[test]
    fn gpus_without_fp8_and_shapes_cublaslt_cannot_take_are_named() {
        let e = require_fp8((8, 6), "blk.0.attn_q.weight")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("blk.0.attn_q.weight") && e.contains("8.9") && e.contains("is 8.6"),
            "{e}"
        );
        for cc in [(8, 9), (9, 0), (10, 0), (12, 0)] {
            require_fp8(cc, "w").unwrap();
        }
        assert!(Fp8Layout::of(&matrix("w", 16, 16)).is_ok());
        let e = Fp8Layout::of(&matrix("blk.1.ffn_down.weight", 16, 24))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("blk.1.ffn_down.weight") && e.contains("[16, 24]"),
            "{e}"
        );
    }
}
