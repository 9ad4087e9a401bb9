//! The memory bandwidth a streaming read gets on this machine, measured the way single-stream
//! decode reads its weights and KV: every kernel thread reading its own contiguous part of a
//! buffer far larger than the caches, front to back, with wide loads.

use std::sync::Barrier;
use std::time::Instant;

use serde::Serialize;

/// Words summed per inner iteration: 16 u64 = four 256-bit accumulators, enough independent
/// adds that the loads, not the add chains, set the pace.
const LANES: usize = 16;

#[derive(Serialize, Clone)]
pub struct Bandwidth {
    /// Bytes read per second, all threads together (the best pass).
    pub bytes_per_s: f64,
    pub buffer_bytes: usize,
    pub threads: usize,
    pub passes: usize,
}

/// Best of `passes` timed reads of a `buffer_bytes` buffer split over `threads` threads.
///
/// The buffer is filled with a pattern first, by the threads that later read each part: a
/// buffer left zeroed would be the kernel's shared zero page, read from the cache. The sums are
/// passed through `black_box` so the reads cannot be elided.
pub fn streaming_read(threads: usize, buffer_bytes: usize, passes: usize) -> Bandwidth {
    let threads = threads.max(1);
    let words_per_thread = (buffer_bytes / 8 / threads / LANES).max(1) * LANES;
    let mut buffer = vec![0u64; words_per_thread * threads];
    std::thread::scope(|s| {
        for (t, part) in buffer.chunks_mut(words_per_thread).enumerate() {
            s.spawn(move || {
                for (i, w) in part.iter_mut().enumerate() {
                    *w = (t * words_per_thread + i) as u64;
                }
            });
        }
    });
    let mut best = 0f64;
    for _ in 0..passes.max(1) {
        // Threads are started before the clock and released together, so thread creation is
        // not timed. Each reader takes its own start and end: with as many readers as cores,
        // the releasing thread may not run again until they are done, so a clock it started
        // would miss most of the read (a 64 MiB read once "took" 1 µs that way).
        let start = Barrier::new(threads + 1);
        let spans: Vec<(Instant, Instant)> = std::thread::scope(|s| {
            let readers: Vec<_> = buffer
                .chunks(words_per_thread)
                .map(|part| {
                    let start = &start;
                    s.spawn(move || {
                        start.wait();
                        let began = Instant::now();
                        std::hint::black_box(sum(part));
                        (began, Instant::now())
                    })
                })
                .collect();
            start.wait();
            readers
                .into_iter()
                .map(|r| r.join().expect("a bandwidth reader panicked"))
                .collect()
        });
        let began = spans
            .iter()
            .map(|s| s.0)
            .min()
            .expect("at least one reader");
        let ended = spans
            .iter()
            .map(|s| s.1)
            .max()
            .expect("at least one reader");
        let elapsed = ended - began;
        best = best.max((buffer.len() * 8) as f64 / elapsed.as_secs_f64());
    }
    Bandwidth {
        bytes_per_s: best,
        buffer_bytes: buffer.len() * 8,
        threads,
        passes: passes.max(1),
    }
}

/// Wrapping sum of `words` (a multiple of [`LANES`] long), with 256-bit loads where the CPU has
/// AVX2 and 128-bit SSE2 loads otherwise (the baseline the binary is built for).
fn sum(words: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present (checked above).
        return unsafe { sum_avx2(words) };
    }
    sum_lanes(words)
}

/// [`sum_lanes`] compiled for AVX2: the autovectorizer turns its lanes into `vpaddq` on 256-bit
/// loads.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn sum_avx2(words: &[u64]) -> u64 {
    sum_lanes(words)
}

/// `LANES` independent wrapping sums, folded at the end; inlined into each caller so that it is
/// vectorized for that caller's target features.
#[inline(always)]
fn sum_lanes(words: &[u64]) -> u64 {
    let mut acc = [0u64; LANES];
    for chunk in words.chunks_exact(LANES) {
        for (a, &w) in acc.iter_mut().zip(chunk) {
            *a = a.wrapping_add(w);
        }
    }
    acc.iter().fold(0, |a, &b| a.wrapping_add(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sum_reads_every_word() {
        let words: Vec<u64> = (0..LANES as u64 * 5).collect();
        let n = words.len() as u64;
        assert_eq!(sum(&words), n * (n - 1) / 2);
        assert_eq!(sum_lanes(&words), n * (n - 1) / 2);
    }

    #[test]
    fn a_small_buffer_reports_a_positive_rate() {
        let b = streaming_read(2, 1 << 20, 2);
        assert!(b.bytes_per_s > 0.0);
        assert_eq!(b.buffer_bytes % (2 * LANES * 8), 0);
    }
}
