//! A fixed pool of worker threads for data-parallel kernels.
//!
//! Matrix kernels split their output rows over every thread of the machine many thousand times a
//! second (30 layers × 5 jobs per forward step), so a dispatch must cost well under a microsecond:
//! the workers spin briefly on an epoch counter before parking, a dispatch publishes its job
//! without a lock and makes a system call only when a worker is parked, and the caller takes a
//! share of the work itself instead of sleeping.

use std::cell::UnsafeCell;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

type Job = dyn Fn(usize, usize) + Sync;

struct Shared {
    /// Bumped once per dispatched job (after `job` is written); workers run the job when they see
    /// a new value.
    epoch: AtomicUsize,
    /// Workers still running the current job.
    pending: AtomicUsize,
    /// The current job (erased lifetime, see `run`): written only by the dispatching caller while
    /// no worker runs a job, read by workers between seeing a new epoch and decrementing
    /// `pending`.
    job: UnsafeCell<Option<&'static Job>>,
    /// Workers parked on `wake` or about to be; a dispatch locks `parking` and notifies only when
    /// this is not zero.
    parked: AtomicUsize,
    parking: Mutex<()>,
    wake: Condvar,
    shutdown: AtomicBool,
}

// SAFETY: `job` is accessed as described on the field: the epoch's release/acquire orders the
// caller's write before the workers' reads, and `pending` reaching zero orders their reads before
// the next write.
unsafe impl Sync for Shared {}

/// A pool of `n - 1` worker threads plus the calling thread.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    n_threads: usize,
    /// Serialises `run` calls from different threads; a pool runs one job at a time.
    dispatch: Mutex<()>,
    /// Turns of callers running sequences of jobs that others must not interleave with.
    turns: Turns,
}

const SPIN_ITERS: usize = 2_000;

impl ThreadPool {
    /// A pool with `n_threads` participants (at least 1); `0` means one per available core.
    pub fn new(n_threads: usize) -> Self {
        let n_threads = if n_threads == 0 {
            default_threads()
        } else {
            n_threads
        };
        let shared = Arc::new(Shared {
            epoch: AtomicUsize::new(0),
            pending: AtomicUsize::new(0),
            job: UnsafeCell::new(None),
            parked: AtomicUsize::new(0),
            parking: Mutex::new(()),
            wake: Condvar::new(),
            shutdown: AtomicBool::new(false),
        });
        let workers = (1..n_threads)
            .map(|idx| {
                let shared = shared.clone();
                std::thread::Builder::new()
                    .name(format!("duet-kernel-{idx}"))
                    .spawn(move || worker_loop(shared, idx, n_threads))
                    .expect("spawning a kernel thread")
            })
            .collect();
        Self {
            shared,
            workers,
            n_threads,
            dispatch: Mutex::new(()),
            turns: Turns::default(),
        }
    }

    pub fn n_threads(&self) -> usize {
        self.n_threads
    }

    /// Exclusive use of the pool for a sequence of jobs (a forward step) by one caller among
    /// several sharing it, until the guard drops. Turns are granted in the order they were asked
    /// for, so a caller looping over steps cannot starve another waiting for its turn.
    pub fn turn(&self) -> Turn<'_> {
        self.turns.take()
    }

    /// Runs `f(thread_index, n_threads)` on every participant and returns when all are done.
    pub fn run<F: Fn(usize, usize) + Sync>(&self, f: F) {
        if self.n_threads == 1 {
            f(0, 1);
            return;
        }
        let _guard = self.dispatch.lock().unwrap_or_else(|e| e.into_inner());
        let job: &(dyn Fn(usize, usize) + Sync + '_) = &f;
        // SAFETY: the reference is only used by workers between the epoch bump below and the
        // moment `pending` reaches zero, and we do not return (or unwind) before that.
        let job: &'static Job = unsafe {
            std::mem::transmute::<&(dyn Fn(usize, usize) + Sync + '_), &'static Job>(job)
        };
        // SAFETY: no worker runs a job (the last dispatch waited for `pending` to reach zero,
        // and `dispatch` keeps other callers out), so none reads `job` now.
        unsafe { *self.shared.job.get() = Some(job) };
        self.shared
            .pending
            .store(self.n_threads - 1, Ordering::SeqCst);
        self.shared.epoch.fetch_add(1, Ordering::SeqCst);
        // A worker counts itself parked before its last look at the epoch (both SeqCst), so
        // either it sees the new epoch or we see it counted and wake it under the lock.
        if self.shared.parked.load(Ordering::SeqCst) != 0 {
            let _g = self
                .shared
                .parking
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        // A panic in our share must not free `f` while workers still use it.
        let result =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(0, self.n_threads)));
        let mut spins = 0usize;
        while self.shared.pending.load(Ordering::Acquire) != 0 {
            spins += 1;
            if spins < SPIN_ITERS {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        // SAFETY: every worker is done with the job (`pending` is zero).
        unsafe { *self.shared.job.get() = None };
        if let Err(panic) = result {
            std::panic::resume_unwind(panic);
        }
    }

    /// Runs `f(range)` over disjoint contiguous ranges covering `0..n`, taken by the
    /// participants as they go (see [`Shares`]), so threads running at different speeds finish
    /// together.
    pub fn for_each_range<F: Fn(Range<usize>) + Sync>(&self, n: usize, f: F) {
        let shares = Shares::new(n, self.n_threads);
        self.run(|me, _| {
            while let Some(r) = shares.take(me) {
                f(r)
            }
        });
    }
}

/// The parts of `0..n` for [`ThreadPool::for_each_range`]. Each participant owns one contiguous
/// share and takes it front to back, a quarter of what is left at a time, so what it reads stays
/// one forward run the hardware prefetcher follows: a decode step's rows are its weights, streamed
/// from memory, and every run started anew costs a memory latency and the prefetcher's warm-up
/// (one shared counter handing out pieces made each thread start ~7 runs a matrix). A participant
/// whose share is done moves the back half of the largest share left into its own, so a thread
/// slowed down (a busy sibling hyperthread, a preempted vCPU) holds up the others for little more
/// than one piece.
struct Shares {
    by_participant: Vec<Share>,
}

/// One participant's share, `start` in the low and `end` in the high 32 bits, on a cache line of
/// its own: its owner updates it for every piece.
#[repr(align(64))]
struct Share(AtomicU64);

fn pack(start: usize, end: usize) -> u64 {
    start as u64 | (end as u64) << 32
}

fn unpack(share: u64) -> (usize, usize) {
    ((share & u32::MAX as u64) as usize, (share >> 32) as usize)
}

impl Shares {
    fn new(n: usize, participants: usize) -> Self {
        assert!(
            u32::try_from(n).is_ok(),
            "for_each_range over {n} items: at most 2^32 - 1"
        );
        let bound = |i: usize| n * i / participants;
        Self {
            by_participant: (0..participants)
                .map(|i| Share(AtomicU64::new(pack(bound(i), bound(i + 1)))))
                .collect(),
        }
    }

    /// The next piece for participant `me`: from its own share, else from one it takes over.
    fn take(&self, me: usize) -> Option<Range<usize>> {
        loop {
            if let Some(piece) = self.take_front(me) {
                return Some(piece);
            }
            if !self.take_over(me) {
                return None;
            }
        }
    }

    /// A quarter of what is left of `me`'s share (at least one item), from its front.
    fn take_front(&self, me: usize) -> Option<Range<usize>> {
        let share = &self.by_participant[me].0;
        let mut now = share.load(Ordering::Acquire);
        loop {
            let (start, end) = unpack(now);
            if start >= end {
                return None;
            }
            let len = ((end - start) / 4).max(1);
            match share.compare_exchange_weak(
                now,
                pack(start + len, end),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some(start..start + len),
                Err(seen) => now = seen,
            }
        }
    }

    /// Moves the back half of the largest other share into `me`'s (empty) one; false when every
    /// share is empty. Ranges only ever move to disjoint places, so a share never holds the same
    /// value twice and a compare-and-swap cannot mistake a new range for an old one.
    fn take_over(&self, me: usize) -> bool {
        loop {
            let largest = (0..self.by_participant.len())
                .filter(|&i| i != me)
                .map(|i| (i, self.by_participant[i].0.load(Ordering::Acquire)))
                .max_by_key(|&(_, share)| {
                    let (start, end) = unpack(share);
                    end.saturating_sub(start)
                });
            let Some((victim, share)) = largest else {
                return false;
            };
            let (start, end) = unpack(share);
            if start >= end {
                return false;
            }
            let cut = end - (end - start).div_ceil(2);
            if self.by_participant[victim]
                .0
                .compare_exchange(share, pack(start, cut), Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                self.by_participant[me]
                    .0
                    .store(pack(cut, end), Ordering::Release);
                return true;
            }
        }
    }
}

/// A ticket lock: each caller draws the next ticket and waits until it is served.
#[derive(Default)]
struct Turns {
    /// (next ticket to draw, ticket being served).
    tickets: Mutex<(u64, u64)>,
    served: Condvar,
}

impl Turns {
    fn take(&self) -> Turn<'_> {
        let mut t = self.tickets.lock().unwrap_or_else(|e| e.into_inner());
        let ticket = t.0;
        t.0 += 1;
        while t.1 != ticket {
            t = self.served.wait(t).unwrap_or_else(|e| e.into_inner());
        }
        Turn { turns: self }
    }
}

/// A caller's turn on a [`ThreadPool`]; the next caller's turn starts when it drops.
pub struct Turn<'a> {
    turns: &'a Turns,
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        let mut t = self.turns.tickets.lock().unwrap_or_else(|e| e.into_inner());
        t.1 += 1;
        self.turns.served.notify_all();
    }
}

/// One thread per core the process may use.
pub fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

fn worker_loop(shared: Arc<Shared>, idx: usize, n_threads: usize) {
    let mut seen = 0usize;
    loop {
        let mut spins = 0usize;
        let epoch = loop {
            let e = shared.epoch.load(Ordering::Acquire);
            if e != seen {
                break e;
            }
            if shared.shutdown.load(Ordering::Acquire) {
                return;
            }
            spins += 1;
            if spins < SPIN_ITERS {
                std::hint::spin_loop();
            } else {
                let guard = shared.parking.lock().unwrap_or_else(|e| e.into_inner());
                shared.parked.fetch_add(1, Ordering::SeqCst);
                if shared.epoch.load(Ordering::SeqCst) == seen
                    && !shared.shutdown.load(Ordering::SeqCst)
                {
                    drop(shared.wake.wait(guard).unwrap_or_else(|e| e.into_inner()));
                }
                shared.parked.fetch_sub(1, Ordering::SeqCst);
            }
        };
        seen = epoch;
        // SAFETY: the job was written before the epoch we acquired, and stays until we
        // decrement `pending`.
        let job = unsafe { *shared.job.get() };
        if let Some(job) = job {
            // A panicking kernel is a bug; keep the pool consistent and let the caller's own share
            // (or the next debug run) surface it.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(idx, n_threads)));
        }
        shared.pending.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        {
            let _g = self
                .shared
                .parking
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            self.shared.shutdown.store(true, Ordering::SeqCst);
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_participant_runs_once_per_job() {
        let pool = ThreadPool::new(3);
        for _ in 0..1000 {
            let hits = AtomicUsize::new(0);
            pool.run(|_, n| {
                assert_eq!(n, 3);
                hits.fetch_add(1, Ordering::Relaxed);
            });
            assert_eq!(hits.load(Ordering::Relaxed), 3);
        }
    }

    /// Between jobs further apart than the spin, workers park; the next dispatch must wake every
    /// one of them (a lost wake-up hangs the caller), and dropping the pool must end parked ones.
    #[test]
    fn parked_workers_wake_for_the_next_job_and_on_drop() {
        let pool = ThreadPool::new(3);
        let all_parked = || {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while pool.shared.parked.load(Ordering::SeqCst) != 2 {
                assert!(std::time::Instant::now() < deadline, "workers never parked");
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        };
        for _ in 0..20 {
            all_parked();
            let hits = AtomicUsize::new(0);
            pool.run(|_, _| {
                hits.fetch_add(1, Ordering::Relaxed);
            });
            assert_eq!(hits.load(Ordering::Relaxed), 3);
        }
        all_parked();
        drop(pool);
    }

    /// Callers taking turns never overlap, and a caller that asks again at once waits behind one
    /// already waiting.
    #[test]
    fn turns_are_exclusive_and_first_come_first_served() {
        let pool = ThreadPool::new(2);
        let inside = AtomicUsize::new(0);
        let order = Mutex::new(Vec::new());
        let first = pool.turn();
        std::thread::scope(|s| {
            s.spawn(|| {
                let _t = pool.turn();
                assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0);
                order.lock().unwrap().push("waiting");
                inside.fetch_sub(1, Ordering::SeqCst);
            });
            // Let the other thread draw its ticket, then end our turn and ask for another.
            while pool.turns.tickets.lock().unwrap().0 < 2 {
                std::thread::yield_now();
            }
            drop(first);
            let _again = pool.turn();
            assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0);
            order.lock().unwrap().push("again");
            inside.fetch_sub(1, Ordering::SeqCst);
        });
        assert_eq!(*order.lock().unwrap(), ["waiting", "again"]);
    }

    #[test]
    fn ranges_cover_everything_once() {
        for threads in [1, 2, 3] {
            let pool = ThreadPool::new(threads);
            for n in [0, 1, 2, 101, 1000] {
                let seen: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                pool.for_each_range(n, |r| {
                    assert!(!r.is_empty());
                    for i in r {
                        seen[i].fetch_add(1, Ordering::Relaxed);
                    }
                });
                assert!(seen.iter().all(|c| c.load(Ordering::Relaxed) == 1), "n {n}");
            }
        }
    }

    /// A participant that runs slowly keeps little more than its first pieces: the others take
    /// over the rest of its share, and every item still runs exactly once.
    #[test]
    fn a_slow_participant_is_taken_over() {
        let pool = ThreadPool::new(3);
        let n = 3000;
        let seen: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
        let slow_items = AtomicUsize::new(0);
        pool.for_each_range(n, |r| {
            if std::thread::current().name() == Some("duet-kernel-1") {
                slow_items.fetch_add(r.len(), Ordering::Relaxed);
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            for i in r {
                seen[i].fetch_add(1, Ordering::Relaxed);
            }
        });
        assert!(seen.iter().all(|c| c.load(Ordering::Relaxed) == 1));
        assert!(
            slow_items.load(Ordering::Relaxed) < n / 3,
            "the slow share was not taken over"
        );
    }

    /// Alone, a participant takes its share as one forward run of shrinking pieces; with its own
    /// share done it takes over the back half of the largest share left.
    #[test]
    fn shares_run_forward_then_take_over_the_largest_back_half() {
        let shares = Shares::new(100, 2);
        let first: Vec<Range<usize>> = (0..4).map(|_| shares.take(0).unwrap()).collect();
        assert_eq!(first, [0..12, 12..21, 21..28, 28..33]);
        // Participant 1 has not started: once 0 is through its own 50, it takes 75..100.
        while shares.take_front(0).is_some() {}
        assert!(shares.take_over(0));
        assert_eq!(
            unpack(shares.by_participant[1].0.load(Ordering::Relaxed)),
            (50, 75)
        );
        assert_eq!(shares.take(0), Some(75..81));
        // Participant 1's own share now ends where 0 took over.
        let mut own = Vec::new();
        while let Some(r) = shares.take_front(1) {
            own.push(r);
        }
        assert_eq!(own.first().unwrap().start, 50);
        assert_eq!(own.last().unwrap().end, 75);
        assert!(own.windows(2).all(|w| w[0].end == w[1].start));
    }
}
