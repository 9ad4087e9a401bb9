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
        assert_eq!(
            define("prefill_attention.cu", "PF_THREADS"),
            PREFILL_THREADS as usize
        );
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
pub use compile::{CompiledFile, compile_all, compile_file};

#[cfg(feature = "cuda")]
mod compile {
    use super::{FILES, KernelFile, program};
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

    pub fn compile_file(file: &KernelFile, arch: &str) -> Result<Ptx, CudaError> {
        let options = CompileOptions {
            options: vec![
                format!("--gpu-architecture={arch}"),
                "--std=c++17".into(),
                "-default-device".into(),
                "-lineinfo".into(),
            ],
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
}
