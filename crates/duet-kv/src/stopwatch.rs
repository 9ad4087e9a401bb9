//! Wall and CPU time of work done on one thread. Loading a block is timed both ways: the wall
//! time is what a prompt waits (and what the cost model weighs), the thread's CPU time what the
//! copy itself cost, apart from the time the thread waited for a core on a busy machine.

use std::ops::AddAssign;
use std::time::Instant;

/// Seconds of wall time and of the thread's CPU time.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Elapsed {
    pub wall_seconds: f64,
    pub cpu_seconds: f64,
}

impl AddAssign for Elapsed {
    fn add_assign(&mut self, other: Elapsed) {
        self.wall_seconds += other.wall_seconds;
        self.cpu_seconds += other.cpu_seconds;
    }
}

/// Started on the thread whose CPU time it counts; read it on that thread.
pub struct Stopwatch {
    wall: Instant,
    cpu: f64,
}

impl Stopwatch {
    pub fn start() -> Self {
        Self {
            wall: Instant::now(),
            cpu: thread_cpu_seconds(),
        }
    }

    pub fn elapsed(&self) -> Elapsed {
        Elapsed {
            wall_seconds: self.wall.elapsed().as_secs_f64(),
            cpu_seconds: (thread_cpu_seconds() - self.cpu).max(0.0),
        }
    }
}

/// CPU time this thread has run, in seconds (0 where the clock is unavailable).
fn thread_cpu_seconds() -> f64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into `t`, which outlives the call.
    let r = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    if r != 0 {
        return 0.0;
    }
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_time_counts_work_and_not_sleep() {
        let watch = Stopwatch::start();
        std::thread::sleep(std::time::Duration::from_millis(30));
        let slept = watch.elapsed();
        assert!(slept.wall_seconds >= 0.03);
        assert!(slept.cpu_seconds < 0.02, "{slept:?}");
        let watch = Stopwatch::start();
        let mut x = 0u64;
        while watch.elapsed().wall_seconds < 0.03 {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
        }
        assert!(
            watch.elapsed().cpu_seconds > 0.0,
            "busy for 30 ms of wall time"
        );
    }
}
