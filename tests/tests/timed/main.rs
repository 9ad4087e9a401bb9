//! Integration tests that time a cluster against deadlines and measured rates (hung workers, a
//! long tokenization beside running streams). Two of them at once on a machine of two cores, or
//! one beside the concurrent tests of the `it` binary, would measure each other: this binary runs
//! after `it` (cargo runs test binaries one after another) and each test holds
//! [`one_at_a_time`] for its whole run.

mod hangs;
mod long_prompts;

use std::sync::{Mutex, MutexGuard};

/// Held for a whole test: no other test of this binary runs meanwhile.
fn one_at_a_time() -> MutexGuard<'static, ()> {
    static TIMED: Mutex<()> = Mutex::new(());
    TIMED.lock().unwrap_or_else(|e| e.into_inner())
}
