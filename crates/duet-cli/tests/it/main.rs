//! The `duet` command as a user runs it, one test binary: every module is a former test file.

mod cli;
mod planner;

use std::process::Command;

/// The `duet` binary this test build made.
fn duet() -> Command {
    Command::new(env!("CARGO_BIN_EXE_duet"))
}
