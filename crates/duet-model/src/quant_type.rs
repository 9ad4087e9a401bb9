//! GGML tensor types: block lengths and sizes of every format the loaders accept.

/// GGML tensor types we support.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum QuantType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4_1,
    Q4_K,
    Q6_K,
}

impl QuantType {
    pub const ALL: [QuantType; 8] = [
        QuantType::F32,
        QuantType::F16,
        QuantType::BF16,
        QuantType::Q8_0,
        QuantType::Q4_0,
        QuantType::Q4_1,
        QuantType::Q4_K,
        QuantType::Q6_K,
    ];

    /// The block formats (quants with per-block scales).
    pub const BLOCK_FORMATS: [QuantType; 5] = [
        QuantType::Q4_0,
        QuantType::Q4_1,
        QuantType::Q8_0,
        QuantType::Q4_K,
        QuantType::Q6_K,
    ];

    /// The type of a GGML type id (`ggml_type`), if we support it.
    pub fn from_ggml(id: u32) -> Option<QuantType> {
        Some(match id {
            0 => QuantType::F32,
            1 => QuantType::F16,
            2 => QuantType::Q4_0,
            3 => QuantType::Q4_1,
            8 => QuantType::Q8_0,
            12 => QuantType::Q4_K,
            14 => QuantType::Q6_K,
            30 => QuantType::BF16,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            QuantType::F32 => "F32",
            QuantType::F16 => "F16",
            QuantType::BF16 => "BF16",
            QuantType::Q8_0 => "Q8_0",
            QuantType::Q4_0 => "Q4_0",
            QuantType::Q4_1 => "Q4_1",
            QuantType::Q4_K => "Q4_K",
            QuantType::Q6_K => "Q6_K",
        }
    }

    /// Elements per block (1 for float types).
    pub fn block_len(self) -> usize {
        match self {
            QuantType::F32 | QuantType::F16 | QuantType::BF16 => 1,
            QuantType::Q8_0 | QuantType::Q4_0 | QuantType::Q4_1 => 32,
            QuantType::Q4_K | QuantType::Q6_K => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            QuantType::F32 => 4,
            QuantType::F16 | QuantType::BF16 => 2,
            QuantType::Q8_0 => 34,
            QuantType::Q4_0 => 18,
            QuantType::Q4_1 => 20,
            QuantType::Q4_K => 144,
            QuantType::Q6_K => 210,
        }
    }

    /// Bytes of a row of `cols` values; `None` if `cols` is not a multiple of the block length.
    pub fn row_bytes(self, cols: usize) -> Option<usize> {
        let blocks = cols / self.block_len();
        (blocks * self.block_len() == cols).then_some(blocks * self.block_bytes())
    }
}

impl std::fmt::Display for QuantType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
