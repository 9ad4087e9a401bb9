//! Every kernel compiles through NVRTC for Hopper (sm_90) and for Ampere (sm_80), and defines the
//! entry points the backend loads; and through ptxas to machine code (CUBIN) for both, so that
//! ptxas errors, register spills and shared-memory overruns fail here rather than on a GPU. Needs
//! libnvrtc but no GPU (`scripts/test.sh` installs it). Run with `--nocapture` for the registers,
//! spills and shared memory (static, and the dynamic the tiled prefill kernels launch with) of
//! every kernel.
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
            // An FP8 KV cache is read with the hardware conversion where there is one (sm_89
            // on), with common.cuh's integer decoder (the emulated one) elsewhere.
            if c.file.name == "paged_attention.cu" {
                assert_eq!(
                    ptx.contains("cvt.rn.f16x2.e4m3x2"),
                    arch == "sm_90",
                    "{arch}"
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
        options: &[],
    };
    let err = kernels::compile_file(&broken, "sm_90")
        .unwrap_err()
        .to_string();
    assert!(err.contains("broken.cu"), "{err}");
    assert!(err.contains("undefined_name"), "{err}");
}

/// Shared memory a block may use without opting in (48 KiB on every architecture since sm_70).
const STATIC_SHARED_LIMIT: u32 = 48 * 1024;

/// Shared memory a block may opt into, per architecture (the tiled prefill kernels' dynamic
/// shared memory is raised to theirs at load): 227 KiB on sm_90, 163 KiB on sm_80.
fn opt_in_shared_limit(arch: &str) -> u32 {
    match arch {
        "sm_90" => 227 * 1024,
        "sm_80" => 163 * 1024,
        _ => STATIC_SHARED_LIMIT,
    }
}

/// Spills known when this check came (2026-12, NVRTC 13.0.88): prefill attention at head sizes
/// 128 and 256 keeps more fragments than 255 registers hold (the hd128 kernel ran at 50% of the
/// matrix rate on an H100 with them). Bytes of spill stores allowed, per (kernel, arch); any other
/// spill, or more than these, fails: the FlashAttention-tiled kernels (prefill_attention_fa.cu)
/// hold their accumulators in registers, where a spill is local memory in the inner loop.
/// Their twins over an FP8 KV cache (2026-12, the same NVRTC) spill as much, within a few bytes.
const KNOWN_SPILLS: &[(&str, &str, u32)] = &[
    ("prefill_attention_hd128", "sm_90", 68),
    ("prefill_attention_hd128", "sm_80", 24),
    ("prefill_attention_hd256", "sm_90", 1288),
    ("prefill_attention_hd256", "sm_80", 1048),
    ("prefill_attention_fp8_hd128", "sm_90", 72),
    ("prefill_attention_fp8_hd128", "sm_80", 24),
    ("prefill_attention_fp8_hd256", "sm_90", 1288),
    ("prefill_attention_fp8_hd256", "sm_80", 1052),
];

#[test]
fn every_kernel_assembles_for_sm_90_and_sm_80_without_new_spills() {
    nvrtc();
    let mut problems = Vec::new();
    println!(
        "{:<6} {:<26} {:>9} {:>12} {:>11} {:>6} {:>7} {:>8}",
        "arch", "kernel", "registers", "spill stores", "spill loads", "stack", "shared", "dynamic"
    );
    for arch in ["sm_90", "sm_80"] {
        for file in FILES {
            let cubin = kernels::compile_cubin(file, arch).unwrap_or_else(|e| panic!("{e}"));
            assert!(
                cubin.image.starts_with(b"\x7fELF"),
                "{}: not an ELF image",
                file.name
            );
            let mut reported: Vec<&str> =
                cubin.resources.iter().map(|r| r.kernel.as_str()).collect();
            reported.sort_unstable();
            let mut listed = file.kernels.to_vec();
            listed.sort_unstable();
            assert_eq!(
                reported, listed,
                "{} ({arch}): ptxas reported other kernels",
                file.name
            );
            for r in &cubin.resources {
                let dynamic = FA_ENTRIES
                    .iter()
                    .find(|e| e.kernel == r.kernel || e.kernel_fp8 == r.kernel)
                    .map_or(0, |e| e.smem_bytes);
                println!(
                    "{arch:<6} {:<26} {:>9} {:>12} {:>11} {:>6} {:>7} {:>8}",
                    r.kernel,
                    r.registers,
                    r.spill_stores,
                    r.spill_loads,
                    r.stack_bytes,
                    r.shared_bytes,
                    dynamic
                );
                let allowed = KNOWN_SPILLS
                    .iter()
                    .find(|(k, a, _)| *k == r.kernel && *a == arch)
                    .map_or(0, |&(_, _, bytes)| bytes);
                if r.spill_stores > allowed || (allowed == 0 && r.spill_loads > 0) {
                    problems.push(format!(
                        "{} ({arch}) spills {} bytes and reloads {}",
                        r.kernel, r.spill_stores, r.spill_loads
                    ));
                }
                if r.shared_bytes > STATIC_SHARED_LIMIT
                    || r.shared_bytes + dynamic > opt_in_shared_limit(arch)
                {
                    problems.push(format!(
                        "{} ({arch}) uses {} bytes of static and {dynamic} of dynamic shared memory",
                        r.kernel, r.shared_bytes
                    ));
                }
            }
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");
}
