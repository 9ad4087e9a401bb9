//! Every kernel compiles through NVRTC for Hopper (sm_90) and for Ampere (sm_80), and defines the
//! entry points the backend loads; for sm_90 down to a CUBIN, with ptxas's registers, spills and
//! shared memory per kernel printed (`--nocapture`). Needs libnvrtc but no GPU (`scripts/test.sh`
//! installs it).
#![cfg(feature = "cuda")]

use duet_cuda::kernels::{self, FA_ENTRIES, FILES, KernelFile};

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

/// Shared memory a block may have on sm_90 (227 KiB, opted into above 48 KiB).
const SM90_SHARED_PER_BLOCK: u32 = 227 * 1024;

#[test]
fn every_kernel_compiles_to_an_sm90_cubin_and_the_fa_kernels_do_not_spill() {
    nvrtc();
    println!(
        "{:<30} {:>9} {:>11} {:>12} {:>12} {:>11} {:>12}",
        "sm_90 kernel",
        "registers",
        "stack bytes",
        "spill stores",
        "spill loads",
        "static smem",
        "dynamic smem"
    );
    for file in FILES {
        let cubin = kernels::compile_cubin(file, "sm_90").unwrap_or_else(|e| panic!("{e}"));
        // An ELF image: the CUBIN itself, not PTX.
        assert_eq!(&cubin.image[..4], b"\x7fELF", "{}", file.name);
        for &k in file.kernels {
            let r = cubin
                .resources
                .iter()
                .find(|r| r.kernel == k)
                .unwrap_or_else(|| panic!("ptxas reported nothing for {k}"));
            let dynamic = FA_ENTRIES
                .iter()
                .find(|e| e.kernel == k)
                .map_or(0, |e| e.smem_bytes);
            println!(
                "{:<30} {:>9} {:>11} {:>12} {:>12} {:>11} {:>12}",
                k,
                r.registers,
                r.stack_frame_bytes,
                r.spill_store_bytes,
                r.spill_load_bytes,
                r.shared_bytes,
                dynamic
            );
            assert!(r.registers > 0 && r.registers <= 255, "{r:?}");
            assert!(r.shared_bytes + dynamic <= SM90_SHARED_PER_BLOCK, "{r:?}");
            if dynamic > 0 {
                // The tiled kernels hold their accumulators in registers: a spill is local memory
                // in the inner loop.
                assert_eq!(
                    (r.stack_frame_bytes, r.spill_store_bytes, r.spill_load_bytes),
                    (0, 0, 0),
                    "{k} spills: {r:?}"
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
