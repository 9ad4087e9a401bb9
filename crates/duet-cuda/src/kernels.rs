//! Our CUDA kernels (`kernels/*.cu`), embedded in the binary and compiled by NVRTC at start-up for
//! the device's architecture.
//!
//! NVRTC is given no CUDA headers, so each program is `common.cuh` (bf16 bit conversions and
//! reductions) followed by one kernel file; there is no `#include`.

/// The shared prelude of every program.
pub const COMMON: &str = include_str!("../../../kernels/common.cuh");

/// One kernel file and the `extern "C"` kernels it defines.
pub struct KernelFile {
    pub name: &'static str,
    pub source: &'static str,
    pub kernels: &'static [&'static str],
}

/// Every kernel file; the backend loads them all.
pub const FILES: &[KernelFile] = &[
    KernelFile {
        name: "embedding.cu",
        source: include_str!("../../../kernels/embedding.cu"),
        kernels: &["embed_rows"],
    },
    KernelFile {
        name: "norm.cu",
        source: include_str!("../../../kernels/norm.cu"),
        kernels: &["rms_norm", "add_rms_norm"],
    },
    KernelFile {
        name: "rope.cu",
        source: include_str!("../../../kernels/rope.cu"),
        kernels: &["rope_rotate_half"],
    },
    KernelFile {
        name: "elementwise.cu",
        source: include_str!("../../../kernels/elementwise.cu"),
        kernels: &[
            "silu_mul",
            "silu_mul_stacked",
            "add_inplace",
            "add_bias_rows",
            "f32_to_bf16_n",
            "copy_cols",
            "gather_rows",
            "scatter_add_rows",
        ],
    },
    KernelFile {
        name: "kv_cache.cu",
        source: include_str!("../../../kernels/kv_cache.cu"),
        kernels: &["write_kv", "pack_kv_chunks", "unpack_kv_chunks"],
    },
    KernelFile {
        name: "paged_attention.cu",
        source: include_str!("../../../kernels/paged_attention.cu"),
        kernels: &["paged_attention_partial", "paged_attention_reduce"],
    },
    KernelFile {
        name: "prefill_attention.cu",
        source: include_str!("../../../kernels/prefill_attention.cu"),
        kernels: &[
            "prefill_attention_hd64",
            "prefill_attention_hd128",
            "prefill_attention_hd256",
        ],
    },
    KernelFile {
        name: "prefill_attention_fa.cu",
        source: include_str!("../../../kernels/prefill_attention_fa.cu"),
        kernels: &[
            "prefill_attention_fa_hd64",
            "prefill_attention_fa_hd128",
            "prefill_attention_fa_hd256",
        ],
    },
    KernelFile {
        name: "sampling.cu",
        source: include_str!("../../../kernels/sampling.cu"),
        kernels: &["argmax_rows", "sample_rows"],
    },
];

/// Context tokens per split of decode attention (`PARTITION_TOKENS` in paged_attention.cu).
pub const PARTITION_TOKENS: usize = 512;
/// Query rows per prefill-attention block (`PREFILL_BLOCK_M` in prefill_attention.cu).
pub const PREFILL_BLOCK_M: usize = 64;
/// Threads of a prefill-attention block (`PF_THREADS` in prefill_attention.cu).
pub const PREFILL_THREADS: u32 = 128;

/// Threads of a FlashAttention-tiled prefill block (`FA_THREADS` in prefill_attention_fa.cu).
pub const FA_THREADS: u32 = 128;

/// One entry point of prefill_attention_fa.cu: the padded head size it serves, its query rows a
/// block (`FA_BLOCK_M_HD<n>`) and its dynamic shared memory (`FA_SMEM_HD<n>`).
pub struct FaEntry {
    pub kernel: &'static str,
    pub head_dim: usize,
    pub block_m: usize,
    pub smem_bytes: u32,
}

/// The entry points of prefill_attention_fa.cu, smallest head size first.
pub const FA_ENTRIES: [FaEntry; 3] = [
    FaEntry {
        kernel: "prefill_attention_fa_hd64",
        head_dim: 64,
        block_m: 128,
        smem_bytes: 55_296,
    },
    FaEntry {
        kernel: "prefill_attention_fa_hd128",
        head_dim: 128,
        block_m: 128,
        smem_bytes: 104_448,
    },
    FaEntry {
        kernel: "prefill_attention_fa_hd256",
        head_dim: 256,
        block_m: 64,
        smem_bytes: 101_376,
    },
];

/// The FlashAttention-tiled entry point for `head_dim` (<= 256): the smallest that holds it.
pub fn fa_entry(head_dim: usize) -> &'static FaEntry {
    FA_ENTRIES
        .iter()
        .find(|e| head_dim <= e.head_dim)
        .unwrap_or(&FA_ENTRIES[FA_ENTRIES.len() - 1])
}

/// The program NVRTC compiles for `file`.
pub fn program(file: &KernelFile) -> String {
    format!("{COMMON}\n#line 1 \"{}\"\n{}", file.name, file.source)
}

/// What ptxas reported for one kernel of a CUBIN (`--ptxas-options=-v`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelResources {
    pub kernel: String,
    pub registers: u32,
    pub stack_frame_bytes: u32,
    pub spill_store_bytes: u32,
    pub spill_load_bytes: u32,
    /// Static shared memory; dynamic shared memory is sized at launch.
    pub shared_bytes: u32,
}

/// The kernels of ptxas's verbose report, in its order. Its lines per kernel:
/// `Compiling entry function 'NAME' for 'sm_90'`,
/// `N bytes stack frame, N bytes spill stores, N bytes spill loads` and
/// `Used N registers, used N barriers[, N bytes cumulative stack size][, N bytes smem]`.
pub fn ptxas_resources(log: &str) -> Vec<KernelResources> {
    // The number just before `unit` in `line`, if the line has it.
    fn count(line: &str, unit: &str) -> Option<u32> {
        let head = &line[..line.find(unit)?];
        head.rsplit(|c: char| !c.is_ascii_digit())
            .next()?
            .parse()
            .ok()
    }
    let mut out: Vec<KernelResources> = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let kernel = rest.split('\'').next().unwrap_or_default().to_string();
            out.push(KernelResources {
                kernel,
                ..Default::default()
            });
            continue;
        }
        let Some(k) = out.last_mut() else { continue };
        if line.contains("stack frame") {
            k.stack_frame_bytes = count(line, " bytes stack frame").unwrap_or(0);
            k.spill_store_bytes = count(line, " bytes spill stores").unwrap_or(0);
            k.spill_load_bytes = count(line, " bytes spill loads").unwrap_or(0);
        } else if let Some(registers) = count(line, " registers") {
            k.registers = registers;
            k.shared_bytes = count(line, " bytes smem").unwrap_or(0);
        }
    }
    out
}

/// NVRTC's architecture option for compute capability `major.minor` (sm_90 on Hopper).
pub fn arch_option(major: i32, minor: i32) -> String {
    format!("--gpu-architecture=sm_{major}{minor}")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of `#define name` in `file`.
    fn define(file: &str, name: &str) -> usize {
        let source = FILES.iter().find(|f| f.name == file).unwrap().source;
        source
            .lines()
            .find_map(|l| l.strip_prefix(&format!("#define {name} ")))
            .unwrap_or_else(|| panic!("{file} defines no {name}"))
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap()
    }

    #[test]
    fn host_constants_match_the_kernels() {
        assert_eq!(
            define("paged_attention.cu", "PARTITION_TOKENS"),
            PARTITION_TOKENS
        );
        assert_eq!(
            define("prefill_attention.cu", "PREFILL_BLOCK_M"),
            PREFILL_BLOCK_M
        );
        assert_eq!(
            define("prefill_attention.cu", "PF_THREADS"),
            PREFILL_THREADS as usize
        );
        let fa = "prefill_attention_fa.cu";
        assert_eq!(define(fa, "FA_THREADS"), FA_THREADS as usize);
        for e in &FA_ENTRIES {
            let hd = e.head_dim;
            assert_eq!(define(fa, &format!("FA_BLOCK_M_HD{hd}")), e.block_m, "{hd}");
            assert_eq!(
                define(fa, &format!("FA_SMEM_HD{hd}")),
                e.smem_bytes as usize,
                "{hd}"
            );
            assert_eq!(e.kernel, format!("prefill_attention_fa_hd{hd}"));
        }
    }

    #[test]
    fn ptxas_reports_are_read_per_kernel() {
        let log = "ptxas info    : 48 bytes gmem
ptxas info    : Compiling entry function 'big' for 'sm_90'
ptxas info    : Function properties for big
ptxas         .     1048 bytes stack frame, 1288 bytes spill stores, 1292 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 1048 bytes cumulative stack size, 37376 bytes smem
ptxas info    : Compile time = 810.155 ms
ptxas info    : Compiling entry function 'small' for 'sm_90'
ptxas info    : Function properties for small
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 20 registers, used 1 barriers
";
        assert_eq!(
            ptxas_resources(log),
            vec![
                KernelResources {
                    kernel: "big".into(),
                    registers: 255,
                    stack_frame_bytes: 1048,
                    spill_store_bytes: 1288,
                    spill_load_bytes: 1292,
                    shared_bytes: 37376,
                },
                KernelResources {
                    kernel: "small".into(),
                    registers: 20,
                    ..Default::default()
                },
            ]
        );
    }

    #[test]
    fn each_head_size_takes_the_smallest_fa_entry_that_holds_it() {
        let kernel = |hd| fa_entry(hd).kernel;
        assert_eq!(kernel(32), "prefill_attention_fa_hd64");
        assert_eq!(kernel(64), "prefill_attention_fa_hd64");
        assert_eq!(kernel(96), "prefill_attention_fa_hd128");
        assert_eq!(kernel(128), "prefill_attention_fa_hd128");
        assert_eq!(kernel(256), "prefill_attention_fa_hd256");
    }

    #[test]
    fn every_listed_kernel_is_defined_extern_c_in_its_file() {
        for file in FILES {
            for kernel in file.kernels {
                let defined = file.source.lines().any(|l| {
                    l.starts_with("extern \"C\" __global__") && l.contains(&format!(" {kernel}("))
                });
                assert!(defined, "{} does not define kernel {kernel}", file.name);
            }
        }
    }
}

#[cfg(feature = "cuda")]
pub use compile::{CompiledFile, Cubin, compile_all, compile_cubin, compile_file};

#[cfg(feature = "cuda")]
mod compile {
    use super::{FILES, KernelFile, KernelResources, program, ptxas_resources};
    use crate::CudaError;
    use cudarc::nvrtc::{CompileOptions, Ptx};
    use std::ffi::{CStr, CString};

    pub struct CompiledFile {
        pub file: &'static KernelFile,
        pub ptx: Ptx,
    }

    /// Compiles every kernel file for `arch` (e.g. "sm_90"). Needs libnvrtc (probe first).
    pub fn compile_all(arch: &str) -> Result<Vec<CompiledFile>, CudaError> {
        FILES
            .iter()
            .map(|file| {
                Ok(CompiledFile {
                    file,
                    ptx: compile_file(file, arch)?,
                })
            })
            .collect()
    }

    /// NVRTC's options for every kernel file.
    fn options(arch: &str) -> Vec<String> {
        vec![
            format!("--gpu-architecture={arch}"),
            "--std=c++17".into(),
            "-default-device".into(),
            "-lineinfo".into(),
        ]
    }

    pub fn compile_file(file: &KernelFile, arch: &str) -> Result<Ptx, CudaError> {
        let options = CompileOptions {
            options: options(arch),
            ..Default::default()
        };
        cudarc::nvrtc::compile_ptx_with_opts(program(file), options).map_err(|e| {
            CudaError::Compile {
                file: file.name,
                arch: arch.to_string(),
                log: compile_log(e),
            }
        })
    }

    /// A kernel file compiled to machine code for one real architecture, and ptxas's report of
    /// each kernel's registers, spills and static shared memory.
    pub struct Cubin {
        pub file: &'static KernelFile,
        pub image: Vec<u8>,
        pub resources: Vec<KernelResources>,
    }

    /// Compiles `file` to a CUBIN for `arch` (a real architecture, e.g. "sm_90") through NVRTC,
    /// with ptxas's verbose report. Needs libnvrtc, no GPU.
    pub fn compile_cubin(file: &'static KernelFile, arch: &str) -> Result<Cubin, CudaError> {
        use cudarc::nvrtc::{result, sys};
        let fail = |log: String| CudaError::Compile {
            file: file.name,
            arch: arch.to_string(),
            log,
        };
        let source = CString::new(program(file)).map_err(|e| fail(e.to_string()))?;
        let prog = result::create_program(&source, None).map_err(|e| fail(format!("{e:?}")))?;
        let mut opts = options(arch);
        opts.push("--ptxas-options=-v".into());
        // SAFETY: `prog` was created above and is destroyed once, below; the buffers are sized
        // by NVRTC's own size queries.
        let compiled = unsafe {
            let compiled = result::compile_program(prog, &opts);
            let log = result::get_program_log(prog)
                .map(|raw| CStr::from_ptr(raw.as_ptr()).to_string_lossy().into_owned())
                .unwrap_or_default();
            let image = compiled.and_then(|()| {
                let mut size = 0usize;
                sys::nvrtcGetCUBINSize(prog, &mut size).result()?;
                let mut image = vec![0u8; size];
                sys::nvrtcGetCUBIN(prog, image.as_mut_ptr().cast()).result()?;
                Ok(image)
            });
            let _ = result::destroy_program(prog);
            image
                .map(|image| (image, log.clone()))
                .map_err(|e| fail(format!("{e:?}\n{log}")))
        };
        let (image, log) = compiled?;
        Ok(Cubin {
            file,
            image,
            resources: ptxas_resources(&log),
        })
    }

    fn compile_log(e: cudarc::nvrtc::CompileError) -> String {
        match e {
            cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                log.to_string_lossy().into_owned()
            }
            other => format!("{other:?}"),
        }
    }
}
