//! Device selection, outside both backends: loading an engine on the device its options name
//! (`--device cpu|cuda[:N]`), and running code that is generic over the backend on it.
//!
//! Services and commands are written once over `Engine<B>`; [`LoadedEngine::run`] hands the
//! loaded engine, whatever its backend, to such code. The CUDA backend is linked only with the
//! `cuda` feature: CPU-only builds do not depend on `duet-cuda` at all.

#[cfg(feature = "cuda")]
pub mod gpu_bench;
pub mod mixed_load;
pub mod row_invariance;

use std::path::Path;

use duet_cpu::CpuBackend;
use duet_engine::EngineError;
use duet_engine::backend::{Backend, KvLayout};
use duet_engine::device::Device;
use duet_engine::engine::{Engine, EngineOptions};
use duet_model::config::ModelConfig;

/// An engine on whichever device was asked for. Made once per process and moved to its thread,
/// so the size difference between variants does not matter.
#[allow(clippy::large_enum_variant)]
pub enum LoadedEngine {
    Cpu(Engine<CpuBackend>),
    #[cfg(feature = "cuda")]
    Cuda(Engine<duet_cuda::backend::CudaBackend>),
}

/// Code generic over the backend, run on a [`LoadedEngine`].
pub trait WithEngine {
    type Output;
    fn run<B: Backend + 'static>(self, engine: Engine<B>) -> Self::Output;
}

/// Runs `$body` with `$e` bound to the engine, whatever its backend.
macro_rules! on_engine {
    ($self:expr, $e:ident => $body:expr) => {
        match $self {
            LoadedEngine::Cpu($e) => $body,
            #[cfg(feature = "cuda")]
            LoadedEngine::Cuda($e) => $body,
        }
    };
}

impl LoadedEngine {
    /// Loads a model (GGUF file or HF directory) on `options.device`.
    pub fn load(path: &Path, options: EngineOptions) -> Result<Self, EngineError> {
        match options.device {
            Device::Cpu => Ok(Self::Cpu(duet_cpu::load_engine(path, options)?)),
            Device::Cuda(ordinal) => load_cuda(path, options, ordinal),
        }
    }

    pub fn run<V: WithEngine>(self, code: V) -> V::Output {
        on_engine!(self, e => code.run(e))
    }

    pub fn config(&self) -> &ModelConfig {
        on_engine!(self, e => e.config())
    }

    pub fn fingerprint(&self) -> &str {
        on_engine!(self, e => e.fingerprint())
    }

    pub fn options(&self) -> &EngineOptions {
        on_engine!(self, e => e.options())
    }

    /// Geometry and element type of the KV cache.
    pub fn kv_layout(&self) -> KvLayout {
        on_engine!(self, e => e.kv_layout())
    }

    /// The backend's name ("cpu", "cuda").
    pub fn backend_name(&self) -> &'static str {
        on_engine!(self, e => e.model().backend().name())
    }
}

#[cfg(feature = "cuda")]
fn load_cuda(
    path: &Path,
    options: EngineOptions,
    ordinal: usize,
) -> Result<LoadedEngine, EngineError> {
    // The device first: a missing GPU is reported before a large model file is read.
    let backend = duet_cuda::backend::CudaBackend::new(
        ordinal,
        options.gpu_memory_fraction,
        gpu_options(&options),
    )?;
    let files = duet_model::model_files::open_model(path)?;
    Ok(LoadedEngine::Cuda(Engine::with_backend(
        backend, files, options,
    )?))
}

/// The GPU path's switches among the engine options.
#[cfg(feature = "cuda")]
pub fn gpu_options(options: &EngineOptions) -> duet_cuda::backend::GpuOptions {
    duet_cuda::backend::GpuOptions {
        cuda_graphs: options.cuda_graphs.is_on(),
        device_sampling: options.device_sampling.is_on(),
        fused_kernels: options.fused_kernels.is_on(),
        packed_weights: options.gpu_weights == duet_engine::device::GpuWeights::Packed,
        prefill_attention: options.prefill_attention,
        load_stream: options.kv_tiers.kv_load_stream.is_on(),
        host_pinned: options.kv_tiers.kv_host_pinned.is_on(),
    }
}

#[cfg(not(feature = "cuda"))]
fn load_cuda(_: &Path, _: EngineOptions, _: usize) -> Result<LoadedEngine, EngineError> {
    Err(EngineError::Device(
        "this build has no CUDA support; rebuild with `cargo build --release --features cuda` to use --device cuda".into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn asking_for_a_gpu_without_one_is_a_clear_error() {
        let options = EngineOptions {
            device: Device::Cuda(0),
            ..Default::default()
        };
        let Err(err) = LoadedEngine::load(Path::new("/nonexistent/model.gguf"), options) else {
            panic!("loaded an engine on a GPU this machine does not have");
        };
        let msg = err.to_string();
        // Without the feature the build says how to get CUDA support; with it, the probe names
        // the missing driver library before the model file is opened.
        #[cfg(not(feature = "cuda"))]
        assert!(msg.contains("--features cuda"), "{msg}");
        #[cfg(feature = "cuda")]
        if !duet_cuda::probe::driver_present() {
            assert!(msg.contains("libcuda"), "{msg}");
        } else {
            assert!(msg.contains("/nonexistent/model.gguf"), "{msg}");
        }
    }
}
