//! Every kernel compiles through NVRTC for Hopper (sm_90) and for Ampere (sm_80), and defines the
//! entry points the backend loads. Needs libnvrtc but no GPU (`scripts/test.sh` installs it).
#![cfg(feature = "cuda")]

use duet_cuda::kernels::{self, FILES, KernelFile};

fn nvrtc() {
    duet_cuda::probe::require_nvrtc()
        .unwrap_or_else(|e| panic!("{e} (scripts/test.sh installs it under .tools/)"));
}

#[test]
fn every_kernel_compiles_through_nvrtc_with_its_entry_points() {
    nvrtc();
    for arch in ["sm_90", "sm_80"] {
        let compiled = kernels::compile_all(arch).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(compiled.len(), FILES.len());
        for c in compiled {
            let ptx = c.ptx.to_src();
            assert!(
                ptx.contains(&format!(".target {arch}")),
                "{}: {arch}",
                c.file.name
            );
            for k in c.file.kernels {
                assert!(
                    ptx.contains(&format!(".entry {k}(")),
                    "{} ({arch}) has no entry point {k}",
                    c.file.name
                );
            }
        }
    }
}

#[test]
fn a_kernel_that_does_not_compile_is_reported_with_its_file_and_log() {
    nvrtc();
    let broken = KernelFile {
        name: "broken.cu",
        source: "extern \"C\" __global__ void k(float* x) { x[0] = undefined_name; }",
        kernels: &["k"],
    };
    let err = kernels::compile_file(&broken, "sm_90")
        .unwrap_err()
        .to_string();
    assert!(err.contains("broken.cu"), "{err}");
    assert!(err.contains("undefined_name"), "{err}");
}
