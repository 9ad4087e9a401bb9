//! Zeroed buffers on transparent huge pages, for the data every forward step streams: the packed
//! weights and the KV cache.
//!
//! With 4 KiB pages every 4 KiB read is a TLB lookup that mostly misses (a step reads ~100 MB),
//! and a miss is a page walk — two-dimensional in a virtual machine. Linux backs anonymous memory
//! with 2 MiB pages only where asked (`madvise(MADV_HUGEPAGE)`) under its default `madvise`
//! policy, so the buffers ask. Measured on an AMD EPYC (Zen 4) VM with `duet bench engine`
//! (4 alternated runs): single-stream decode at context 64 259 -> 298 tok/s, prefill of 200 tokens
//! 943 -> 1169. Memory is still committed only as it is first written, but
//! 2 MiB at a time.
//!
//! A huge page backs only a 2 MiB-aligned range lying wholly inside one mapping, and only if the
//! mapping already spans it at the first write. A model's layer matrices are 0.2–1.1 MB each: in
//! mappings of their own they never got a huge page (the kernel merges neighbouring mappings,
//! but only after each was written on 4 KiB pages), so only the output matrix and the KV cache
//! were on huge pages. Now buffers up to [`OWN_MAPPING_ABOVE`] are carved one after another from
//! shared 2 MiB-aligned chunks, and larger ones get a 2 MiB-aligned mapping of their own. Same
//! host and bench, two sets of alternated runs (6 and 5), medians: single-stream decode at
//! context 512 292 -> 300 and 275 -> 300 tok/s, at context 64 +6% and +0.5%, batch 32 at
//! context 512 +2% and +3%.

use std::io;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, Weak};

use memmap2::MmapMut;

/// The huge page size of x86-64 and of most arm64 kernels.
const HUGE_PAGE: usize = 2 << 20;
/// Size of the mappings small buffers are carved from.
const CHUNK: usize = 32 << 20;
/// Buffers above this get a mapping of their own; smaller ones share chunks.
const OWN_MAPPING_ABOVE: usize = CHUNK / 8;
/// Alignment of every buffer (a shared chunk's buffers start on page boundaries).
const PAGE: usize = 4096;

/// Element types whose all-zero bit pattern is a valid value (the pages arrive zeroed).
///
/// # Safety
/// Every bit pattern of zeros must be a valid `Self`.
pub(crate) unsafe trait ZeroBits: Copy {}

// SAFETY: zero bits are 0.0 / 0.
unsafe impl ZeroBits for f32 {}
unsafe impl ZeroBits for half::f16 {}
unsafe impl ZeroBits for u8 {}
unsafe impl ZeroBits for i8 {}

/// `len` zeroed values of `T` on transparent huge pages, page aligned.
pub(crate) struct HugeBuffer<T> {
    /// `None` for an empty buffer (a mapping cannot be empty).
    region: Option<Region>,
    len: usize,
    _values: PhantomData<T>,
}

/// Where a buffer's bytes are: `len` bytes at `ptr`, inside a mapping that lives as long as the
/// region and that no other region overlaps.
struct Region {
    ptr: *mut u8,
    _mapping: Arc<Mapping>,
}

// SAFETY: a region is the only handle to its bytes; its mapping is shared only to be unmapped
// when the last region carved from it drops.
unsafe impl Send for Region {}
unsafe impl Sync for Region {}

/// An anonymous mapping advised onto huge pages, reserved with one huge page to spare so that
/// its usable part starts 2 MiB aligned (the spare part is never written, so never committed).
struct Mapping {
    /// Unmapped when the last region carved from it drops.
    _map: MmapMut,
    aligned: *mut u8,
    usable: usize,
}

// SAFETY: the mapping itself is never accessed through this struct after creation; regions
// write through their own disjoint pointers.
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

impl Mapping {
    fn new(usable: usize) -> io::Result<Self> {
        let reserve = usable.checked_add(HUGE_PAGE).ok_or_else(too_large)?;
        let mut map = MmapMut::map_anon(reserve)?;
        // Only a hint: a kernel without transparent huge pages keeps 4 KiB pages.
        #[cfg(target_os = "linux")]
        let _ = map.advise(memmap2::Advice::HugePage);
        let base = map.as_mut_ptr();
        // SAFETY: the offset is below `HUGE_PAGE`, so `aligned + usable` stays in the mapping.
        let aligned = unsafe { base.add(base.align_offset(HUGE_PAGE)) };
        Ok(Self {
            _map: map,
            aligned,
            usable,
        })
    }
}

/// The chunk small buffers are being carved from, and how much of it is taken. Held weakly: a
/// chunk whose buffers have all dropped is unmapped, and the next buffer starts a new one.
struct Chunks {
    current: Weak<Mapping>,
    taken: usize,
}

static CHUNKS: Mutex<Chunks> = Mutex::new(Chunks::new());

impl Chunks {
    const fn new() -> Self {
        Self {
            current: Weak::new(),
            taken: 0,
        }
    }

    /// A region of `bytes` (> 0) zeroed bytes, from the current chunk or a mapping of its own.
    fn region(&mut self, bytes: usize) -> io::Result<Region> {
        if bytes > OWN_MAPPING_ABOVE {
            let mapping = Arc::new(Mapping::new(bytes)?);
            return Ok(Region {
                ptr: mapping.aligned,
                _mapping: mapping,
            });
        }
        let chunk = match self.current.upgrade() {
            Some(c) if c.usable - self.taken >= bytes => c,
            _ => {
                let c = Arc::new(Mapping::new(CHUNK)?);
                self.current = Arc::downgrade(&c);
                self.taken = 0;
                c
            }
        };
        // SAFETY: `taken + bytes <= usable`, and the bytes from `taken` on were never handed
        // out, so they are zero and no other region overlaps them.
        let ptr = unsafe { chunk.aligned.add(self.taken) };
        self.taken = (self.taken + bytes)
            .next_multiple_of(PAGE)
            .min(chunk.usable);
        Ok(Region {
            ptr,
            _mapping: chunk,
        })
    }
}

fn too_large() -> io::Error {
    io::Error::new(io::ErrorKind::OutOfMemory, "buffer size overflows")
}

impl<T: ZeroBits> HugeBuffer<T> {
    /// Fails when the address space or memory limit refuses the mapping.
    pub(crate) fn zeroed(len: usize) -> io::Result<Self> {
        let bytes = len.checked_mul(size_of::<T>()).ok_or_else(too_large)?;
        let region = if bytes == 0 {
            None
        } else {
            Some(
                CHUNKS
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .region(bytes)?,
            )
        };
        Ok(Self {
            region,
            len,
            _values: PhantomData,
        })
    }
}

impl<T: ZeroBits> Deref for HugeBuffer<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match &self.region {
            // SAFETY: the region holds `len` values of `T` (page aligned, so aligned for `T`),
            // zero or written through `deref_mut`, and lives as long as `self`.
            Some(r) => unsafe { std::slice::from_raw_parts(r.ptr as *const T, self.len) },
            None => &[],
        }
    }
}

impl<T: ZeroBits> DerefMut for HugeBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.region {
            // SAFETY: as in `deref`, borrowed mutably through `self`, the region's only handle.
            Some(r) => unsafe { std::slice::from_raw_parts_mut(r.ptr as *mut T, self.len) },
            None => &mut [],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_zeroed_writable_and_may_be_empty() {
        let mut b = HugeBuffer::<f32>::zeroed(3 << 20).unwrap();
        assert_eq!(b.len(), 3 << 20);
        assert!(b.iter().all(|&x| x == 0.0));
        b[(3 << 20) - 1] = 2.5;
        assert_eq!(b[(3 << 20) - 1], 2.5);
        assert_eq!((b.as_ptr() as usize) % 4096, 0);
        let e = HugeBuffer::<u8>::zeroed(0).unwrap();
        assert!(e.is_empty());
    }

    /// Small buffers follow each other in 2 MiB-aligned chunks, so their huge pages are shared;
    /// a chunk is unmapped once its buffers are gone, and large buffers start on a huge page.
    #[test]
    fn small_buffers_share_aligned_chunks_and_large_ones_are_aligned() {
        let mut chunks = Chunks::new();
        let a = chunks.region(300_000).unwrap();
        let b = chunks.region(5000).unwrap();
        let c = chunks.region(OWN_MAPPING_ABOVE).unwrap();
        assert_eq!(a.ptr as usize % HUGE_PAGE, 0);
        assert_eq!(
            b.ptr as usize - a.ptr as usize,
            300_000usize.next_multiple_of(PAGE)
        );
        assert_eq!(c.ptr as usize - b.ptr as usize, 2 * PAGE);
        // What does not fit in the rest of the chunk starts a new one.
        let d = chunks.region(CHUNK - OWN_MAPPING_ABOVE).unwrap();
        assert!(!Arc::ptr_eq(&d._mapping, &a._mapping));
        assert_eq!(d.ptr as usize % HUGE_PAGE, 0);
        let large = chunks.region(OWN_MAPPING_ABOVE + 1).unwrap();
        assert_eq!(large.ptr as usize % HUGE_PAGE, 0);
        assert!(!Arc::ptr_eq(&large._mapping, &d._mapping));
        let first = Arc::downgrade(&a._mapping);
        drop((a, b, c));
        assert!(first.upgrade().is_none(), "an unused chunk stays mapped");
        let second = Arc::downgrade(&d._mapping);
        drop(d);
        assert!(second.upgrade().is_none());
        let e = chunks.region(PAGE).unwrap();
        assert_eq!(e.ptr as usize % HUGE_PAGE, 0);
    }

    #[test]
    fn an_impossible_size_is_an_error_not_a_crash() {
        assert!(HugeBuffer::<f32>::zeroed(usize::MAX / 2).is_err());
        assert!(HugeBuffer::<u8>::zeroed(usize::MAX / 2).is_err());
    }
}
