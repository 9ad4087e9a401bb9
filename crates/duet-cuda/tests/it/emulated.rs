//! A kernel file built for the CPU emulator (crates/duet-cuda/emulator) and loaded, so that a
//! test drives its kernels against Rust references. Needs a C++17 compiler and python3 (as
//! `scripts/test-kernels-emulated.sh` does), no GPU.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The emulated `kernels/<name>.cu`, built into a temporary directory.
pub struct Emulated {
    pub lib: libloading::Library,
    _build: tempfile::TempDir,
}

impl Emulated {
    pub fn build(name: &str) -> Self {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let build = tempfile::tempdir().unwrap();
        let script: PathBuf = root.join("crates/duet-cuda/emulator/build-lib.sh");
        let status = Command::new(&script)
            .arg(root.join("kernels"))
            .arg(build.path())
            .arg(name)
            .status()
            .unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
        let log = std::fs::read_to_string(build.path().join(format!("build_{name}.log")))
            .unwrap_or_default();
        assert!(
            status.success(),
            "building the emulated {name}.cu failed:\n{log}"
        );
        // SAFETY: the library is ours, built just now; loading runs no initialisers of note.
        let lib = unsafe { libloading::Library::new(build.path().join(format!("lib_{name}.so"))) }
            .unwrap();
        Self { lib, _build: build }
    }
}
