//! The paged KV store in host memory.
//!
//! Layout: `[layer][block][K|V][kv_head]`, then per head keys `[head_dim][slot]` and values
//! `[slot][head_dim]`. One layer's blocks are contiguous (a transfer can ship a layer as soon as it
//! is computed), one block's heads too (attention streams through them), and keys are stored
//! transposed: one dimension of a block's keys is a run of slots, so a query's scores for a run of
//! slots are one multiply-add per dimension across vector lanes, with no sums across lanes. The
//! bytes a transfer moves are in the wire order of [`CpuKvStore::read_layer_block`] (keys
//! `[slot][head_dim]` too), converted here. Values are f32 or f16 ([`KvElement`]); the kernels
//! widen them to f32 as they read.

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
}

/// An element type the CPU cache stores: values are rounded to it when written and widened to
/// f32 when read.
pub(crate) trait KvElement: Copy + Send + Sync + 'static {
    /// The element is an IEEE half (the vector kernels widen it with `vcvtph2ps`).
    const IS_F16: bool;
    const ZERO: Self;
    fn to_f32(self) -> f32;
    /// `dst[i] = src[i]`, rounded to nearest even.
    fn store(dst: &mut [Self], src: &[f32]);
    fn write_le(src: &[Self], out: &mut [u8]);
    fn read_le(dst: &mut [Self], data: &[u8]);
}

impl KvElement for f32 {
    const IS_F16: bool = false;
    const ZERO: f32 = 0.0;

    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }

    fn store(dst: &mut [f32], src: &[f32]) {
        dst.copy_from_slice(src);
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
    const IS_F16: bool = true;
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

    fn store(dst: &mut [f16], src: &[f32]) {
        dst.convert_from_f32_slice(src);
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
            KvDtype::Bf16 => {
                return Err(EngineError::Config(
                    "the CPU KV cache stores f32 or f16, not bf16".into(),
                ));
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
        block_len(&self.layout) * self.layout.dtype.bytes()
    }

    /// The KV of one layer of one block, little-endian, in wire order: K then V, each
    /// `[kv_head][slot][head_dim]`.
    pub fn read_layer_block(&self, layer: usize, block: usize, out: &mut [u8]) {
        let range = layer_block_range(&self.layout, layer, block);
        match &self.data {
            KvData::F32(d) => f32::write_le(&to_wire(&self.layout, &d[range]), out),
            KvData::F16(d) => f16::write_le(&to_wire(&self.layout, &d[range]), out),
        }
    }

    /// Stores one layer of one block given in the wire order of [`Self::read_layer_block`].
    pub fn write_layer_block(&mut self, layer: usize, block: usize, data: &[u8]) {
        let range = layer_block_range(&self.layout, layer, block);
        match &mut self.data {
            KvData::F32(d) => from_wire(&self.layout, data, &mut d[range]),
            KvData::F16(d) => from_wire(&self.layout, data, &mut d[range]),
        }
    }

    /// Writes rows of K and V (`[row][kv_head * head_dim]`) into their slots.
    pub fn write(&mut self, layer: usize, k: &[f32], v: &[f32], slots: &[u32]) {
        match &mut self.data {
            KvData::F32(d) => write_rows(&self.layout, d, layer, k, v, slots),
            KvData::F16(d) => write_rows(&self.layout, d, layer, k, v, slots),
        }
    }
}

fn write_rows<E: KvElement>(
    l: &KvLayout,
    data: &mut [E],
    layer: usize,
    k: &[f32],
    v: &[f32],
    slots: &[u32],
) {
    let (hd, bs) = (l.head_dim, l.block_size);
    let width = l.num_kv_heads * hd;
    let mut key = vec![E::ZERO; hd];
    for (row, &slot) in slots.iter().enumerate() {
        let (block, offset) = (slot as usize / bs, slot as usize % bs);
        let base = layer_block_range(l, layer, block).start;
        for h in 0..l.num_kv_heads {
            let src = row * width + h * hd;
            // Keys `[head_dim][slot]`: the token's dimensions are `block_size` apart.
            E::store(&mut key, &k[src..src + hd]);
            let keys = base + h * bs * hd;
            for (d, &x) in key.iter().enumerate() {
                data[keys + d * bs + offset] = x;
            }
            let dst = base + ((l.num_kv_heads + h) * bs + offset) * hd;
            E::store(&mut data[dst..dst + hd], &v[src..src + hd]);
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

/// The cache's values seen as one element type.
#[derive(Clone, Copy)]
pub(crate) struct KvView<'a, E> {
    pub(crate) layout: KvLayout,
    pub(crate) data: &'a [E],
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

    /// A layer block read as bytes and written back is unchanged, in both element types.
    #[test]
    fn layer_blocks_round_trip_through_bytes() {
        for dtype in [KvDtype::F32, KvDtype::F16] {
            let layout = KvLayout {
                num_layers: 2,
                num_kv_heads: 2,
                head_dim: 8,
                block_size: 4,
                num_blocks: 3,
                dtype,
            };
            let mut kv = CpuKvStore::new(layout).unwrap();
            let k: Vec<f32> = (0..16).map(|i| i as f32 * 0.25 - 1.0).collect();
            let v: Vec<f32> = k.iter().map(|x| -x).collect();
            kv.write(1, &k, &v, &[9]);
            let mut bytes = vec![0u8; kv.layer_block_bytes()];
            assert_eq!(bytes.len(), 2 * 2 * 4 * 8 * dtype.bytes());
            kv.read_layer_block(1, 2, &mut bytes);
            let mut copy = CpuKvStore::new(layout).unwrap();
            copy.write_layer_block(1, 2, &bytes);
            let mut again = vec![0u8; bytes.len()];
            copy.read_layer_block(1, 2, &mut again);
            assert_eq!(bytes, again, "{dtype}");
            // slot 9 = block 2, offset 1: in wire order, K of head 1 holds k[8..16] at slot 1 and
            // V of head 0 holds v[0..8] (both exactly representable); as stored, the key's
            // dimensions are a block size apart.
            let wire = |i: usize| match dtype {
                KvDtype::F32 => f32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap()),
                _ => f16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32(),
            };
            let (bs, hd) = (4, 8);
            let key: Vec<f32> = (0..hd).map(|d| wire((bs + 1) * hd + d)).collect();
            assert_eq!(key, &k[8..16], "{dtype}");
            let value: Vec<f32> = (0..hd).map(|d| wire((2 * bs + 1) * hd + d)).collect();
            assert_eq!(value, &v[0..8], "{dtype}");
            let stored: Vec<f32> = match &copy.data {
                KvData::F32(d) => d.iter().map(|x| x.to_f32()).collect(),
                KvData::F16(d) => d.iter().map(|x| KvElement::to_f32(*x)).collect(),
            };
            let keys = KvView {
                layout,
                data: &stored[..],
            }
            .head_block(1, 2, 0, 1);
            let key: Vec<f32> = (0..hd).map(|d| keys[d * bs + 1]).collect();
            assert_eq!(key, &k[8..16], "{dtype}");
        }
    }
}
