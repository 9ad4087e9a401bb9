//! The paged KV store in host memory.
//!
//! Layout: `[layer][block][K|V][kv_head]`, then per head keys `[head_dim][slot]` and values
//! `[slot][head_dim]`. One layer's blocks are contiguous (a transfer can ship a layer as soon as it
//! is computed), one block's heads too (attention streams through them), and keys are stored
//! transposed: one dimension of a block's keys is a run of slots, so a query's scores for a run of
//! slots are one multiply-add per dimension across vector lanes, with no sums across lanes. The
//! bytes a transfer moves are in the wire order of [`CpuKvStore::read_layer_block`] (keys
//! `[slot][head_dim]` too), converted here. Values are f32, f16 or int8 ([`KvElement`]); the
//! kernels widen them to f32 as they read.
//!
//! An int8 cache keeps f32 scales in a buffer of its own, per (layer, block) keys'
//! `[kv_head][key group][slot]` then values' `[kv_head][slot]`: each token's key has one scale per
//! group of [`KvLayout::key_scale_group`] dimensions (a key's few large channels, which RoPE'd keys
//! have, then coarsen only their own group), its value one. A token is quantized alone (absolute
//! maximum to 127), so what it stores never depends on the tokens written before it in its block,
//! nor on how a prompt was cut into chunks, and a block reused from the prefix cache holds what a
//! fresh prefill would. The kernels fold a key group's scale into its part of the score and a
//! value's into its softmax weight.

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::huge_pages::HugeBuffer;
use duet_engine::EngineError;
use duet_engine::backend::{KvDtype, KvLayout};

pub struct CpuKvStore {
    pub(crate) layout: KvLayout,
    pub(crate) data: KvData,
}

/// The cache's values, in the element type of its layout.
pub(crate) enum KvData {
    F32(HugeBuffer<f32>),
    F16(HugeBuffer<f16>),
    Int8 {
        values: HugeBuffer<i8>,
        /// `[layer][block][K|V][kv_head][slot]`.
        scales: HugeBuffer<f32>,
    },
}

/// How the vector kernels widen an element to f32.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Widening {
    None,
    /// `vcvtph2ps`.
    F16,
    /// Sign extension to 32 bits, then `vcvtdq2ps`.
    I8,
}

/// An element type the CPU cache stores: values are rounded to it when written and widened to
/// f32 when read.
pub(crate) trait KvElement: Copy + Send + Sync + 'static {
    const WIDENING: Widening;
    /// Each token's K (and V) of a head carries a scale: its values are `element * scale`.
    const SCALED: bool;
    const ZERO: Self;
    fn to_f32(self) -> f32;
    /// `dst[i] = src[i] / scale`, rounded to nearest even; returns the scale (1 for the float
    /// types).
    fn store(dst: &mut [Self], src: &[f32]) -> f32;
    fn write_le(src: &[Self], out: &mut [u8]);
    fn read_le(dst: &mut [Self], data: &[u8]);
}

impl KvElement for f32 {
    const WIDENING: Widening = Widening::None;
    const SCALED: bool = false;
    const ZERO: f32 = 0.0;

    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }

    fn store(dst: &mut [f32], src: &[f32]) -> f32 {
        dst.copy_from_slice(src);
        1.0
    }

    fn write_le(src: &[f32], out: &mut [u8]) {
        for (o, v) in out.chunks_exact_mut(4).zip(src) {
            o.copy_from_slice(&v.to_le_bytes());
        }
    }

    fn read_le(dst: &mut [f32], data: &[u8]) {
        for (v, b) in dst.iter_mut().zip(data.chunks_exact(4)) {
            *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
    }
}

impl KvElement for f16 {
    const WIDENING: Widening = Widening::F16;
    const SCALED: bool = false;
    const ZERO: f16 = f16::ZERO;

    /// Branch-free so that the portable kernels vectorise: the magnitude bits shifted into f32
    /// position and scaled by 2^112 rebias the exponent (subnormals included); infinities and
    /// NaNs get the f32 all-ones exponent.
    #[inline(always)]
    fn to_f32(self) -> f32 {
        let h = self.to_bits() as u32;
        let mag = (h & 0x7fff) << 13;
        let scaled = (f32::from_bits(mag) * f32::from_bits(0x7780_0000)).to_bits();
        let bits = if h & 0x7c00 == 0x7c00 {
            mag | 0x7f80_0000
        } else {
            scaled
        };
        f32::from_bits(bits | ((h & 0x8000) << 16))
    }

    fn store(dst: &mut [f16], src: &[f32]) -> f32 {
        dst.convert_from_f32_slice(src);
        1.0
    }

    fn write_le(src: &[f16], out: &mut [u8]) {
        for (o, v) in out.chunks_exact_mut(2).zip(src) {
            o.copy_from_slice(&v.to_bits().to_le_bytes());
        }
    }

    fn read_le(dst: &mut [f16], data: &[u8]) {
        for (v, b) in dst.iter_mut().zip(data.chunks_exact(2)) {
            *v = f16::from_bits(u16::from_le_bytes([b[0], b[1]]));
        }
    }
}

impl KvElement for i8 {
    const WIDENING: Widening = Widening::I8;
    const SCALED: bool = true;
    const ZERO: i8 = 0;

    #[inline(always)]
    fn to_f32(self) -> f32 {
        self as f32
    }

    /// Symmetric: the largest magnitude becomes 127 (-128 is never stored), all zeros a zero
    /// scale.
    fn store(dst: &mut [i8], src: &[f32]) -> f32 {
        let max = src.iter().fold(0f32, |m, x| m.max(x.abs()));
        let inv = if max > 0.0 { 127.0 / max } else { 0.0 };
        for (d, &x) in dst.iter_mut().zip(src) {
            *d = (x * inv).round_ties_even() as i8;
        }
        max / 127.0
    }

    fn write_le(src: &[i8], out: &mut [u8]) {
        for (o, &v) in out.iter_mut().zip(src) {
            *o = v as u8;
        }
    }

    fn read_le(dst: &mut [i8], data: &[u8]) {
        for (v, &b) in dst.iter_mut().zip(data) {
            *v = b as i8;
        }
    }
}

impl CpuKvStore {
    pub fn new(layout: KvLayout) -> Result<Self, EngineError> {
        let len = layout
            .num_blocks
            .checked_mul(layout.block_size)
            .and_then(|n| n.checked_mul(layout.values_per_token()))
            .ok_or_else(|| EngineError::Config("KV cache size overflows".into()))?;
        // Zeroed memory that becomes resident only as blocks are first written, so an idle pool
        // costs nothing.
        let data = match layout.dtype {
            KvDtype::F32 => HugeBuffer::zeroed(len).map(KvData::F32),
            KvDtype::F16 => HugeBuffer::zeroed(len).map(KvData::F16),
            KvDtype::Int8 => HugeBuffer::zeroed(len).and_then(|values| {
                Ok(KvData::Int8 {
                    values,
                    scales: HugeBuffer::zeroed(
                        layout.num_layers * layout.num_blocks * layout.layer_block_scales(),
                    )?,
                })
            }),
            KvDtype::Bf16 | KvDtype::Fp8E4m3 => {
                return Err(EngineError::Config(format!(
                    "the CPU KV cache stores f32, f16 or int8, not {}",
                    layout.dtype
                )));
            }
        };
        let data = data.map_err(|e| {
            EngineError::Config(format!(
                "cannot allocate a KV cache of {} MiB ({} blocks): {e}",
                layout.bytes() >> 20,
                layout.num_blocks
            ))
        })?;
        Ok(Self { layout, data })
    }

    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// Bytes of one (layer, block) pair as stored and transferred.
    pub fn layer_block_bytes(&self) -> usize {
        self.layout.layer_block_bytes()
    }

    /// The KV of one layer of one block, little-endian, in wire order: K then V, each
    /// `[kv_head][slot][head_dim]`, then an int8 cache's scales as stored: K
    /// `[kv_head][key group][slot]`, V `[kv_head][slot]`.
    pub fn read_layer_block(&self, layer: usize, block: usize, out: &mut [u8]) {
        let range = layer_block_range(&self.layout, layer, block);
        match &self.data {
            KvData::F32(d) => f32::write_le(&to_wire(&self.layout, &d[range]), out),
            KvData::F16(d) => f16::write_le(&to_wire(&self.layout, &d[range]), out),
            KvData::Int8 { values, scales } => {
                let (v, s) = out.split_at_mut(range.len());
                i8::write_le(&to_wire(&self.layout, &values[range]), v);
                f32::write_le(&scales[scale_range(&self.layout, layer, block)], s);
            }
        }
    }

    /// Stores one layer of one block given in the wire order of [`Self::read_layer_block`].
    pub fn write_layer_block(&mut self, layer: usize, block: usize, data: &[u8]) {
        let range = layer_block_range(&self.layout, layer, block);
        match &mut self.data {
            KvData::F32(d) => from_wire(&self.layout, data, &mut d[range]),
            KvData::F16(d) => from_wire(&self.layout, data, &mut d[range]),
            KvData::Int8 { values, scales } => {
                let (v, s) = data.split_at(range.len());
                from_wire(&self.layout, v, &mut values[range]);
                f32::read_le(&mut scales[scale_range(&self.layout, layer, block)], s);
            }
        }
    }

    /// Every layer of one block as stored (keys `[head_dim][slot]`), layer after layer, each as
    /// [`Self::read_layer_block`] lays it out otherwise: what a tier below the pool keeps, so
    /// that bringing a block back is a copy. Never leaves the worker: a transfer's bytes are in
    /// wire order.
    pub fn read_stored_block(&self, block: usize, out: &mut [u8]) {
        let layer_bytes = self.layer_block_bytes();
        for (layer, out) in out.chunks_exact_mut(layer_bytes).enumerate() {
            let range = layer_block_range(&self.layout, layer, block);
            match &self.data {
                KvData::F32(d) => f32::write_le(&d[range], out),
                KvData::F16(d) => f16::write_le(&d[range], out),
                KvData::Int8 { values, scales } => {
                    let (v, s) = out.split_at_mut(range.len());
                    i8::write_le(&values[range], v);
                    f32::write_le(&scales[scale_range(&self.layout, layer, block)], s);
                }
            }
        }
    }

    /// Stores every layer of one block from what [`Self::read_stored_block`] gave.
    pub fn write_stored_block(&mut self, block: usize, data: &[u8]) {
        let layer_bytes = self.layer_block_bytes();
        for (layer, data) in data.chunks_exact(layer_bytes).enumerate() {
            let range = layer_block_range(&self.layout, layer, block);
            match &mut self.data {
                KvData::F32(d) => f32::read_le(&mut d[range], data),
                KvData::F16(d) => f16::read_le(&mut d[range], data),
                KvData::Int8 { values, scales } => {
                    let (v, s) = data.split_at(range.len());
                    i8::read_le(&mut values[range], v);
                    f32::read_le(&mut scales[scale_range(&self.layout, layer, block)], s);
                }
            }
        }
    }

    /// Writes rows of K and V (`[row][kv_head * head_dim]`) into their slots.
    pub fn write(&mut self, layer: usize, k: &[f32], v: &[f32], slots: &[u32]) {
        let rows = Rows { k, v, slots };
        match &mut self.data {
            KvData::F32(d) => rows.write(&self.layout, d, &mut [], layer),
            KvData::F16(d) => rows.write(&self.layout, d, &mut [], layer),
            KvData::Int8 { values, scales } => rows.write(&self.layout, values, scales, layer),
        }
    }
}

/// Rows of K and V (`[row][kv_head * head_dim]`) and the slot each goes to.
struct Rows<'a> {
    k: &'a [f32],
    v: &'a [f32],
    slots: &'a [u32],
}

impl Rows<'_> {
    /// Into `data` and, for a scaled element type, each token's scales into `scales`.
    fn write<E: KvElement>(&self, l: &KvLayout, data: &mut [E], scales: &mut [f32], layer: usize) {
        let (hd, bs, kvh) = (l.head_dim, l.block_size, l.num_kv_heads);
        let (width, group) = (kvh * hd, l.key_scale_group());
        let groups = hd / group;
        let mut key = vec![E::ZERO; hd];
        for (row, &slot) in self.slots.iter().enumerate() {
            let (block, offset) = (slot as usize / bs, slot as usize % bs);
            let base = layer_block_range(l, layer, block).start;
            let scale_base = scale_range(l, layer, block).start;
            for h in 0..kvh {
                let src = row * width + h * hd;
                // Keys `[head_dim][slot]`: the token's dimensions are `block_size` apart.
                let key_src = &self.k[src..src + hd];
                for (g, (q, x)) in key.chunks_mut(group).zip(key_src.chunks(group)).enumerate() {
                    let key_scale = E::store(q, x);
                    if E::SCALED {
                        scales[scale_base + (h * groups + g) * bs + offset] = key_scale;
                    }
                }
                let keys = base + h * bs * hd;
                for (d, &x) in key.iter().enumerate() {
                    data[keys + d * bs + offset] = x;
                }
                let dst = base + ((kvh + h) * bs + offset) * hd;
                let value_scale = E::store(&mut data[dst..dst + hd], &self.v[src..src + hd]);
                if E::SCALED {
                    scales[scale_base + (kvh * groups + h) * bs + offset] = value_scale;
                }
            }
        }
    }
}

/// One layer block as stored (keys `[head_dim][slot]`) in wire order (keys `[slot][head_dim]`).
fn to_wire<E: KvElement>(l: &KvLayout, stored: &[E]) -> Vec<E> {
    let mut wire = stored.to_vec();
    let (hd, bs) = (l.head_dim, l.block_size);
    for h in 0..l.num_kv_heads {
        let keys = h * bs * hd..(h + 1) * bs * hd;
        transpose(&stored[keys.clone()], hd, bs, &mut wire[keys]);
    }
    wire
}

/// The inverse of [`to_wire`], from little-endian bytes.
fn from_wire<E: KvElement>(l: &KvLayout, bytes: &[u8], stored: &mut [E]) {
    let mut wire = vec![E::ZERO; stored.len()];
    E::read_le(&mut wire, bytes);
    stored.copy_from_slice(&wire);
    let (hd, bs) = (l.head_dim, l.block_size);
    for h in 0..l.num_kv_heads {
        let keys = h * bs * hd..(h + 1) * bs * hd;
        transpose(&wire[keys.clone()], bs, hd, &mut stored[keys]);
    }
}

/// `to[c * rows + r] = from[r * cols + c]`: a `rows` x `cols` matrix transposed.
fn transpose<E: Copy>(from: &[E], rows: usize, cols: usize, to: &mut [E]) {
    for (i, &x) in from[..rows * cols].iter().enumerate() {
        to[(i % cols) * rows + i / cols] = x;
    }
}

/// Values of one (layer, block) pair: K then V, each `kv_head` × `slot` × `head_dim`.
fn block_len(l: &KvLayout) -> usize {
    2 * l.num_kv_heads * l.block_size * l.head_dim
}

fn layer_block_range(l: &KvLayout, layer: usize, block: usize) -> std::ops::Range<usize> {
    let start = (layer * l.num_blocks + block) * block_len(l);
    start..start + block_len(l)
}

/// The scales of one (layer, block) pair in an int8 cache: K `[kv_head][key group][slot]`, then
/// V `[kv_head][slot]`.
fn scale_range(l: &KvLayout, layer: usize, block: usize) -> std::ops::Range<usize> {
    let per_block = l.layer_block_scales();
    let start = (layer * l.num_blocks + block) * per_block;
    start..start + per_block
}

/// The cache's values seen as one element type.
#[derive(Clone, Copy)]
pub(crate) struct KvView<'a, E> {
    pub(crate) layout: KvLayout,
    pub(crate) data: &'a [E],
    /// The tokens' scales (per layer and block, see [`scale_range`]) when `E` is scaled, else
    /// empty.
    pub(crate) scales: &'a [f32],
}

impl<'a, E> KvView<'a, E> {
    /// K (`kv = 0`, `[head_dim][slot]`) or V (`kv = 1`, `[slot][head_dim]`) of one head in one
    /// block.
    pub(crate) fn head_block(&self, layer: usize, block: usize, kv: usize, head: usize) -> &'a [E] {
        let l = self.layout;
        let per_head = l.block_size * l.head_dim;
        let start =
            layer_block_range(&l, layer, block).start + (kv * l.num_kv_heads + head) * per_head;
        &self.data[start..start + per_head]
    }

    /// The slots' scales of [`Self::head_block`], empty when `E` is not scaled: for keys
    /// `[key group][slot]`, for values `[slot]`.
    pub(crate) fn head_block_scales(
        &self,
        layer: usize,
        block: usize,
        kv: usize,
        head: usize,
    ) -> &'a [f32] {
        if self.scales.is_empty() {
            return &[];
        }
        let l = self.layout;
        let groups = l.head_dim / l.key_scale_group();
        let (first, len) = match kv {
            0 => (head * groups, groups),
            _ => (l.num_kv_heads * groups + head, 1),
        };
        let start = scale_range(&l, layer, block).start + first * l.block_size;
        &self.scales[start..start + len * l.block_size]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The branch-free widening agrees with `half` on every f16 bit pattern (NaNs stay NaN).
    #[test]
    fn f16_widening_is_exact() {
        for bits in 0..=u16::MAX {
            let h = f16::from_bits(bits);
            let (got, want) = (KvElement::to_f32(h), h.to_f32());
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{bits:#06x}: {got} != {want}"
            );
        }
    }

    /// A layer block read as bytes and written back is unchanged, in every element type, and
    /// holds the values written in wire order (keys `[slot][head_dim]`) and as stored (keys
    /// `[head_dim][slot]`).
    #[test]
    fn layer_blocks_round_trip_through_bytes() {
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Int8] {
            let layout = KvLayout {
                num_layers: 2,
                num_kv_heads: 2,
                head_dim: 8,
                block_size: 4,
                num_blocks: 3,
                dtype,
            };
            let mut kv = CpuKvStore::new(layout).unwrap();
            // Multiples of 1/32 up to 127/32 in magnitude, each head's largest exactly that: f16
            // and int8 (scale 1/32) hold them exactly.
            let mut k: Vec<f32> = (0..16).map(|i| i as f32 * 0.25 - 1.0).collect();
            (k[7], k[15]) = (-127.0 / 32.0, 127.0 / 32.0);
            let v: Vec<f32> = k.iter().map(|x| -x).collect();
            kv.write(1, &k, &v, &[9]);
            let (bs, hd, kvh) = (4, 8, 2);
            let mut bytes = vec![0u8; kv.layer_block_bytes()];
            let values = 2 * kvh * bs * hd;
            assert_eq!(
                bytes.len(),
                values * dtype.bytes() + 4 * layout.layer_block_scales()
            );
            kv.read_layer_block(1, 2, &mut bytes);
            let mut copy = CpuKvStore::new(layout).unwrap();
            copy.write_layer_block(1, 2, &bytes);
            let mut again = vec![0u8; bytes.len()];
            copy.read_layer_block(1, 2, &mut again);
            assert_eq!(bytes, again, "{dtype}");
            // slot 9 = block 2, offset 1: in wire order, K of head 1 holds k[8..16] at slot 1 and
            // V of head 0 holds v[0..8]; an int8 value's scale is its (K|V, head, slot)'s.
            let f32_at = |at: usize| f32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
            let wire = |i: usize| match dtype {
                KvDtype::F32 => f32_at(4 * i),
                KvDtype::F16 => f16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32(),
                _ => bytes[i] as i8 as f32 * f32_at(values + 4 * (i / hd)),
            };
            let key: Vec<f32> = (0..hd).map(|d| wire((bs + 1) * hd + d)).collect();
            assert_eq!(key, &k[8..16], "{dtype}");
            let value: Vec<f32> = (0..hd).map(|d| wire((2 * bs + 1) * hd + d)).collect();
            assert_eq!(value, &v[0..8], "{dtype}");
            // Key of head 1 at offset 1 of block 2 in layer 1, as stored.
            fn stored_key<E: KvElement>(kv: KvView<'_, E>) -> Vec<f32> {
                let (keys, scales) = (kv.head_block(1, 2, 0, 1), kv.head_block_scales(1, 2, 0, 1));
                let (hd, bs) = (kv.layout.head_dim, kv.layout.block_size);
                (0..hd)
                    .map(|d| keys[d * bs + 1].to_f32() * scales.get(1).unwrap_or(&1.0))
                    .collect()
            }
            let key = match &copy.data {
                KvData::F32(data) => stored_key(KvView {
                    layout,
                    data,
                    scales: &[],
                }),
                KvData::F16(data) => stored_key(KvView {
                    layout,
                    data,
                    scales: &[],
                }),
                KvData::Int8 { values, scales } => stored_key(KvView {
                    layout,
                    data: &values[..],
                    scales,
                }),
            };
            assert_eq!(key, &k[8..16], "{dtype}");
        }
    }

    /// A block copied out as stored and into another block of another store (a tier's round
    /// trip) holds what the original held, every layer, in every element type: read in wire
    /// order, both give the same bytes.
    #[test]
    fn stored_blocks_restore_what_was_written() {
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Int8] {
            let layout = KvLayout {
                num_layers: 2,
                num_kv_heads: 2,
                head_dim: 32,
                block_size: 4,
                num_blocks: 3,
                dtype,
            };
            let mut rng = duet_model::synthetic::Uniform::new(7);
            let mut kv = CpuKvStore::new(layout).unwrap();
            for layer in 0..2 {
                // Slots 4..8: every slot of block 1.
                let (k, v) = (rng.values(4 * 64), rng.values(4 * 64));
                kv.write(layer, &k, &v, &[4, 5, 6, 7]);
            }
            let block_bytes = 2 * kv.layer_block_bytes();
            let mut stored = vec![0u8; block_bytes];
            kv.read_stored_block(1, &mut stored);
            let mut wire = vec![0u8; kv.layer_block_bytes()];
            kv.read_layer_block(0, 1, &mut wire);
            assert_ne!(
                stored[..wire.len()],
                wire[..],
                "{dtype}: keys stay transposed"
            );
            let mut restored = CpuKvStore::new(layout).unwrap();
            restored.write_stored_block(2, &stored);
            for layer in 0..2 {
                let (mut want, mut got) = (wire.clone(), wire.clone());
                kv.read_layer_block(layer, 1, &mut want);
                restored.read_layer_block(layer, 2, &mut got);
                assert_eq!(got, want, "{dtype} layer {layer}");
            }
            let mut again = vec![0u8; block_bytes];
            restored.read_stored_block(2, &mut again);
            assert_eq!(again, stored, "{dtype}");
        }
    }

    /// An int8 key keeps a scale per group of 32 dimensions: a group of small values keeps its
    /// precision beside a group of large ones (what one scale per key would lose), read back in
    /// wire order; a value has one scale.
    #[test]
    fn int8_keys_have_a_scale_per_group_of_32_dimensions() {
        let layout = KvLayout {
            num_layers: 1,
            num_kv_heads: 2,
            head_dim: 64,
            block_size: 4,
            num_blocks: 2,
            dtype: KvDtype::Int8,
        };
        assert_eq!(layout.key_scale_group(), 32);
        let mut rng = duet_model::synthetic::Uniform::new(5);
        // Head 0: dims 0..32 small, 32..64 large; head 1 the other way round.
        let k: Vec<f32> = rng
            .values(128)
            .iter()
            .enumerate()
            .map(|(i, x)| x * if (i / 32) % 3 == 0 { 0.01 } else { 10.0 })
            .collect();
        let v = k.clone();
        let mut kv = CpuKvStore::new(layout).unwrap();
        kv.write(0, &k, &v, &[6]);
        let mut bytes = vec![0u8; kv.layer_block_bytes()];
        kv.read_layer_block(0, 1, &mut bytes);
        let values = 2 * 2 * 4 * 64;
        assert_eq!(bytes.len(), values + 4 * (2 * 4 * (2 + 1)));
        let scale = |i: usize| f32::from_le_bytes(bytes[values + 4 * i..][..4].try_into().unwrap());
        let (bs, hd, slot) = (4, 64, 2);
        for h in 0..2 {
            for d in 0..hd {
                let want = k[h * hd + d];
                let group_scale = scale((h * 2 + d / 32) * bs + slot);
                let got = bytes[(h * bs + slot) * hd + d] as i8 as f32 * group_scale;
                let group = &k[h * hd + d / 32 * 32..][..32];
                let max = group.iter().fold(0f32, |m, x| m.max(x.abs()));
                assert_eq!(group_scale, max / 127.0, "head {h} dim {d}");
                assert!(
                    (got - want).abs() <= 0.5001 * group_scale,
                    "head {h} dim {d}"
                );
            }
            let value_scale = scale(2 * 2 * bs + h * bs + slot);
            let max = k[h * hd..][..hd].iter().fold(0f32, |m, x| m.max(x.abs()));
            assert_eq!(value_scale, max / 127.0, "head {h}");
        }
    }

    /// An int8 token keeps every value within half a step of its scale (its largest magnitude
    /// over 127), whatever its magnitude; an all-zero token stores zeros.
    #[test]
    fn int8_rounds_each_value_within_half_a_step() {
        let mut rng = duet_model::synthetic::Uniform::new(3);
        for magnitude in [1e-6f32, 0.1, 3.0, 1e4] {
            let x: Vec<f32> = rng.values(64).iter().map(|v| v * magnitude).collect();
            let mut q = vec![0i8; 64];
            let scale = i8::store(&mut q, &x);
            let max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(scale, max / 127.0);
            assert!(q.iter().all(|&v| v != -128));
            for (&v, &xi) in q.iter().zip(&x) {
                assert!(
                    (v as f32 * scale - xi).abs() <= 0.5001 * scale,
                    "{xi} -> {v} * {scale}"
                );
            }
        }
        let mut q = vec![5i8; 8];
        assert_eq!(i8::store(&mut q, &[0.0; 8]), 0.0);
        assert_eq!(q, [0; 8]);
    }
}
