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
    /// NVRTC options of this file beyond the common ones.
    pub options: &'static [&'static str],
}

/// Every kernel file; the backend loads them all.
pub const FILES: &[KernelFile] = &[
    KernelFile {
        name: "embedding.cu",
        source: include_str!("../../../kernels/embedding.cu"),
        kernels: &["embed_rows"],
        options: &[],
    },
    KernelFile {
        name: "norm.cu",
        source: include_str!("../../../kernels/norm.cu"),
        kernels: &["rms_norm", "add_rms_norm"],
        options: &[],
    },
    KernelFile {
        name: "rope.cu",
        source: include_str!("../../../kernels/rope.cu"),
        kernels: &["rope_rotate_half"],
        options: &[],
    },
    KernelFile {
        name: "qkv_rope_kv.cu",
        source: include_str!("../../../kernels/qkv_rope_kv.cu"),
        kernels: &["qkv_rope_write_kv", "qkv_rope_write_kv_fp8"],
        options: &[],
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
        options: &[],
    },
    KernelFile {
        name: "kv_cache.cu",
        source: include_str!("../../../kernels/kv_cache.cu"),
        kernels: &[
            "write_kv",
            "write_kv_fp8",
            "pack_kv_chunks",
            "unpack_kv_chunks",
        ],
        options: &[],
    },
    KernelFile {
        name: "paged_attention.cu",
        source: include_str!("../../../kernels/paged_attention.cu"),
        kernels: &[
            "paged_attention_partial",
            "paged_attention_partial_fp8",
            "paged_attention_reduce",
        ],
        options: &[],
    },
    KernelFile {
        name: "prefill_attention.cu",
        source: include_str!("../../../kernels/prefill_attention.cu"),
        kernels: &[
            "prefill_attention_hd64",
            "prefill_attention_hd128",
            "prefill_attention_hd256",
            "prefill_attention_fp8_hd64",
            "prefill_attention_fp8_hd128",
            "prefill_attention_fp8_hd256",
        ],
        options: &[],
    },
    KernelFile {
        name: "quant_matvec.cu",
        source: include_str!("../../../kernels/quant_matvec.cu"),
        kernels: &[
            "quant_matvec_q4_0",
            "quant_to_bf16_q4_0",
            "quant_embed_rows_q4_0",
            "quant_matvec_q4_1",
            "quant_to_bf16_q4_1",
            "quant_embed_rows_q4_1",
            "quant_matvec_q8_0",
            "quant_to_bf16_q8_0",
            "quant_embed_rows_q8_0",
            "quant_matvec_q4_k",
            "quant_to_bf16_q4_k",
            "quant_embed_rows_q4_k",
            "quant_matvec_q6_k",
            "quant_to_bf16_q6_k",
            "quant_embed_rows_q6_k",
        ],
        options: &[],
    },
    KernelFile {
        name: "prefill_attention_fa.cu",
        source: include_str!("../../../kernels/prefill_attention_fa.cu"),
        kernels: &[
            "prefill_attention_fa_hd64",
            "prefill_attention_fa_hd128",
            "prefill_attention_fa_hd256",
            "prefill_attention_fa_fp8_hd64",
            "prefill_attention_fa_fp8_hd128",
            "prefill_attention_fa_fp8_hd256",
        ],
        options: &[],
    },
    KernelFile {
        name: "fp8_weights.cu",
        source: include_str!("../../../kernels/fp8_weights.cu"),
        kernels: &["quantize_rows_e4m3", "fp8_scale_output"],
        options: &[],
    },
    KernelFile {
        name: "sampling.cu",
        source: include_str!("../../../kernels/sampling.cu"),
        kernels: &["sample_rows"],
        // Every product and sum rounded on its own, as the CPU sampler computes them.
        options: &["--fmad=false"],
    },
];

/// Context tokens per split of decode attention (`PARTITION_TOKENS` in paged_attention.cu).
pub const PARTITION_TOKENS: usize = 512;
/// Query rows per prefill-attention block (`PREFILL_BLOCK_M` in prefill_attention.cu).
pub const PREFILL_BLOCK_M: usize = 64;
/// Threads of a prefill-attention block (`PF_THREADS` in prefill_attention.cu).
pub const PREFILL_THREADS: u32 = 128;
/// Output columns of a packed matrix-vector block, one warp each (`QMV_WARPS` in
/// quant_matvec.cu).
pub const QMV_WARPS: usize = 4;
/// Activation rows of a packed matrix-vector block (`QMV_ROWS` in quant_matvec.cu).
pub const QMV_ROWS: usize = 8;

/// Threads of a FlashAttention-tiled prefill block (`FA_THREADS` in prefill_attention_fa.cu).
pub const FA_THREADS: u32 = 128;

/// One entry point of prefill_attention_fa.cu (and its twin over an FP8 KV cache, launched the
/// same way): the padded head size it serves, its query rows a block (`FA_BLOCK_M_HD<n>`) and its
/// dynamic shared memory (`FA_SMEM_HD<n>`).
pub struct FaEntry {
    pub kernel: &'static str,
    pub kernel_fp8: &'static str,
    pub head_dim: usize,
    pub block_m: usize,
    pub smem_bytes: u32,
}

/// The entry points of prefill_attention_fa.cu, smallest head size first.
pub const FA_ENTRIES: [FaEntry; 3] = [
    FaEntry {
        kernel: "prefill_attention_fa_hd64",
        kernel_fp8: "prefill_attention_fa_fp8_hd64",
        head_dim: 64,
        block_m: 128,
        smem_bytes: 55_296,
    },
    FaEntry {
        kernel: "prefill_attention_fa_hd128",
        kernel_fp8: "prefill_attention_fa_fp8_hd128",
        head_dim: 128,
        block_m: 128,
        smem_bytes: 104_448,
    },
    FaEntry {
        kernel: "prefill_attention_fa_hd256",
        kernel_fp8: "prefill_attention_fa_fp8_hd256",
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
        assert_eq!(define("quant_matvec.cu", "QMV_WARPS"), QMV_WARPS);
        assert_eq!(define("quant_matvec.cu", "QMV_ROWS"), QMV_ROWS);
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
            assert_eq!(e.kernel_fp8, format!("prefill_attention_fa_fp8_hd{hd}"));
        }
        use crate::sampling;
        assert_eq!(
            define("sampling.cu", "SP_THREADS"),
            sampling::THREADS as usize
        );
        assert_eq!(
            define("sampling.cu", "SP_THREADS"),
            duet_engine::sampling_steps::LANES
        );
        assert_eq!(define("sampling.cu", "SP_WORDS"), sampling::PARAM_WORDS);
        assert_eq!(define("sampling.cu", "SP_MAX_TOP"), sampling::MAX_TOP);
        // SO_WORDS = 3 + 2 * SP_MAX_TOP, spelled as sums in the kernel file.
        assert_eq!(sampling::OUT_WORDS, 3 + 2 * sampling::MAX_TOP);
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

/// What ptxas reports of one kernel (`--ptxas-options=-v`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelResources {
    pub kernel: String,
    pub registers: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
    pub stack_bytes: u32,
    pub shared_bytes: u32,
}

/// The per-kernel lines of a ptxas `-v` log:
///
/// ```text
/// ptxas info    : Compiling entry function 'rms_norm' for 'sm_90'
/// ptxas info    : Function properties for rms_norm
///     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
/// ptxas info    : Used 18 registers, used 1 barriers, 2048 bytes smem, 384 bytes cmem[0]
/// ```
pub fn parse_ptxas_info(log: &str) -> Vec<KernelResources> {
    // The number before `unit` in a comma-separated list, 0 if absent.
    let field = |line: &str, unit: &str| -> u32 {
        line.split(',')
            .find_map(|part| {
                let part = part.trim().trim_start_matches("ptxas info    : ");
                let rest = part.strip_suffix(unit)?.trim();
                rest.rsplit(' ').next()?.parse().ok()
            })
            .unwrap_or(0)
    };
    let mut out: Vec<KernelResources> = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let kernel = rest.split('\'').next().unwrap_or_default().to_string();
            out.push(KernelResources {
                kernel,
                ..Default::default()
            });
        } else if let Some(k) = out.last_mut() {
            if line.contains("bytes stack frame") {
                k.stack_bytes = field(line, "bytes stack frame");
                k.spill_stores = field(line, "bytes spill stores");
                k.spill_loads = field(line, "bytes spill loads");
            } else if line.contains("registers") {
                k.registers = field(line, "registers");
                k.shared_bytes = field(line, "bytes smem");
            }
        }
    }
    out
}

#[cfg(test)]
mod ptxas_tests {
    use super::*;

    #[test]
    fn ptxas_reports_are_read_per_kernel() {
        let log = "ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'rms_norm' for 'sm_90'
ptxas info    : Function properties for rms_norm
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 18 registers, used 1 barriers, 128 bytes smem, 384 bytes cmem[0]
ptxas info    : Compiling entry function 'big' for 'sm_90'
ptxas info    : Function properties for big
    40 bytes stack frame, 36 bytes spill stores, 28 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 384 bytes cmem[0]
";
        let r = parse_ptxas_info(log);
        assert_eq!(
            r,
            vec![
                KernelResources {
                    kernel: "rms_norm".into(),
                    registers: 18,
                    shared_bytes: 128,
                    ..Default::default()
                },
                KernelResources {
                    kernel: "big".into(),
                    registers: 255,
                    spill_stores: 36,
                    spill_loads: 28,
                    stack_bytes: 40,
                    shared_bytes: 0,
                },
            ]
        );
    }
}

#[cfg(feature = "cuda")]
pub use compile::{CompiledFile, Cubin, compile_all, compile_cubin, compile_file};

#[cfg(feature = "cuda")]
mod compile {
    use std::ffi::{CStr, CString};

    use super::{FILES, KernelFile, KernelResources, parse_ptxas_info, program};
    use crate::CudaError;
    use cudarc::nvrtc::{CompileOptions, Ptx};

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

    fn options(file: &KernelFile, arch: &str) -> Vec<String> {
        let mut options = vec![
            format!("--gpu-architecture={arch}"),
            "--std=c++17".into(),
            "-default-device".into(),
            "-lineinfo".into(),
        ];
        options.extend(file.options.iter().map(|o| o.to_string()));
        options
    }

    pub fn compile_file(file: &KernelFile, arch: &str) -> Result<Ptx, CudaError> {
        let options = CompileOptions {
            options: options(file, arch),
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

    fn compile_log(e: cudarc::nvrtc::CompileError) -> String {
        match e {
            cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                log.to_string_lossy().into_owned()
            }
            other => format!("{other:?}"),
        }
    }

    /// A kernel file compiled to machine code for one GPU (`sm_90`, `sm_80`), with what ptxas
    /// reported of each kernel.
    pub struct Cubin {
        pub image: Vec<u8>,
        pub resources: Vec<KernelResources>,
    }

    /// Compiles `file` through NVRTC and ptxas to a CUBIN for `arch`, as the driver would at
    /// load: ptxas errors, and its register and spill report, without a GPU.
    pub fn compile_cubin(file: &KernelFile, arch: &str) -> Result<Cubin, CudaError> {
        use cudarc::nvrtc::{result, sys};
        let fail = |log: String| CudaError::Compile {
            file: file.name,
            arch: arch.to_string(),
            log,
        };
        let source = CString::new(program(file)).map_err(|e| fail(e.to_string()))?;
        let prog = result::create_program(&source, None).map_err(|e| fail(format!("{e:?}")))?;
        let mut options = options(file, arch);
        options.push("--ptxas-options=-v".into());
        // SAFETY: `prog` is live until destroyed below; the buffers are sized by NVRTC.
        unsafe {
            let compiled = result::compile_program(prog, &options);
            let log = result::get_program_log(prog)
                .map(|l| CStr::from_ptr(l.as_ptr()).to_string_lossy().into_owned())
                .unwrap_or_default();
            let image = compiled
                .map_err(|e| format!("{e:?}: {log}"))
                .and_then(|()| {
                    let mut size = 0usize;
                    sys::nvrtcGetCUBINSize(prog, &mut size)
                        .result()
                        .map_err(|e| format!("{e:?}"))?;
                    let mut image = vec![0u8; size];
                    sys::nvrtcGetCUBIN(prog, image.as_mut_ptr().cast())
                        .result()
                        .map_err(|e| format!("{e:?}"))?;
                    Ok(image)
                });
            let _ = result::destroy_program(prog);
            Ok(Cubin {
                image: image.map_err(fail)?,
                resources: parse_ptxas_info(&log),
            })
        }
    }
}
