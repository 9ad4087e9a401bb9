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

use std::io;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};

use memmap2::MmapMut;

/// Element types whose all-zero bit pattern is a valid value (the pages arrive zeroed).
///
/// # Safety
/// Every bit pattern of zeros must be a valid `Self`.
pub(crate) unsafe trait ZeroBits: Copy {}

// SAFETY: zero bits are 0.0 / 0.
unsafe impl ZeroBits for f32 {}
unsafe impl ZeroBits for half::f16 {}
unsafe impl ZeroBits for u8 {}

/// `len` zeroed values of `T` in an anonymous mapping advised onto huge pages (page aligned).
pub(crate) struct HugeBuffer<T> {
    /// `None` for an empty buffer (a mapping cannot be empty).
    map: Option<MmapMut>,
    len: usize,
    _values: PhantomData<T>,
}

impl<T: ZeroBits> HugeBuffer<T> {
    /// Fails when the address space or memory limit refuses the mapping.
    pub(crate) fn zeroed(len: usize) -> io::Result<Self> {
        let bytes = len
            .checked_mul(size_of::<T>())
            .ok_or_else(|| io::Error::new(io::ErrorKind::OutOfMemory, "buffer size overflows"))?;
        let map = if bytes == 0 {
            None
        } else {
            let map = MmapMut::map_anon(bytes)?;
            // Only a hint: a kernel without transparent huge pages keeps 4 KiB pages.
            #[cfg(target_os = "linux")]
            let _ = map.advise(memmap2::Advice::HugePage);
            Some(map)
        };
        Ok(Self {
            map,
            len,
            _values: PhantomData,
        })
    }
}

impl<T: ZeroBits> Deref for HugeBuffer<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match &self.map {
            // SAFETY: the mapping holds `len` values of `T` (page aligned, so aligned for `T`),
            // zero or written through `deref_mut`, and lives as long as `self`.
            Some(map) => unsafe { std::slice::from_raw_parts(map.as_ptr() as *const T, self.len) },
            None => &[],
        }
    }
}

impl<T: ZeroBits> DerefMut for HugeBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.map {
            // SAFETY: as in `deref`, borrowed mutably through `self`.
            Some(map) => unsafe {
                std::slice::from_raw_parts_mut(map.as_mut_ptr() as *mut T, self.len)
            },
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

    #[test]
    fn an_impossible_size_is_an_error_not_a_crash() {
        assert!(HugeBuffer::<f32>::zeroed(usize::MAX / 2).is_err());
        assert!(HugeBuffer::<u8>::zeroed(usize::MAX / 2).is_err());
    }
}
