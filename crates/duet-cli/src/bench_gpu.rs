//! `duet bench gpu`: the GPU checks and timings of `duet_device::gpu_bench`, as a table and JSON;
//! peers on the same shapes in the same run: HF transformers with `--compare-hf` (its 2048- and
//! 8192-token prefills against duet's with each prefill attention kernel), a lean PyTorch decoder
//! replayed as a CUDA graph (`bench/torch_decode.py`) with `--compare-torch`.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use duet_engine::device::GpuWeights;
use duet_model::fp8::Quantization;
use duet_model::model_path::ModelArgs;
use duet_model::quant_type::QuantType;

#[derive(Args, Debug)]
pub struct GpuBenchArgs {
    /// GPU ordinal.
    #[arg(long, default_value_t = 0)]
    pub gpu: usize,
    /// Models whose CUDA logits and greedy tokens are checked against the CPU backend (default:
    /// tests/fixtures/tiny-llama when present, and the default model).
    #[arg(long = "check-model")]
    pub check_models: Vec<PathBuf>,
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompts of the greedy check.
    #[arg(long = "prompt", default_values_t = [
        "The capital of France is".to_string(),
        "def fibonacci(n):".to_string(),
        "1, 2, 3, 4,".to_string(),
    ])]
    pub prompts: Vec<String>,
    /// Checks only, no Llama-3-8B-shaped timings.
    #[arg(long)]
    pub skip_speed: bool,
    /// Timings only, no checks (scripts/gpu-verify.sh runs the checks in a step of their own).
    #[arg(long, conflicts_with = "skip_speed")]
    pub skip_checks: bool,
    /// Also time HF transformers on the same shapes (bench/hf_gpu.py, needs torch + transformers).
    #[arg(long)]
    pub compare_hf: bool,
    /// Also time a lean PyTorch Llama on the same shapes (cuBLAS products, SDPA over a static KV
    /// cache, the decode step replayed as a CUDA graph: bench/torch_decode.py, needs torch), and
    /// print duet ÷ it.
    #[arg(long)]
    pub compare_torch: bool,
    /// `packed`: also time decode of the Llama-3-8B shape with its weights in each of
    /// `--weight-types` kept packed on the GPU (random blocks of realistic scales), against the
    /// bf16 weights' decode of the same run, and report the memory each takes. The checks always
    /// check a model holding block formats with its weights packed too.
    #[arg(long, value_enum, default_value_t = GpuWeights::Bf16)]
    pub gpu_weights: GpuWeights,
    /// Also check an FP8 KV cache against bf16 (each checked model's logits, ‖Δ‖/‖ref‖ ≤ 5e-2)
    /// and time it (decode of the Llama-3-8B shape at batch 64 with 4096-token contexts over each
    /// cache; the target is 1.4× bf16). Needs a GPU of compute capability 8.9 or later.
    #[arg(long)]
    pub fp8_kv: bool,
    /// The GGUF block formats timed with `--gpu-weights packed`.
    #[arg(long, value_delimiter = ',', value_parser = block_format,
        default_value = "Q4_0,Q4_1,Q8_0,Q4_K,Q6_K")]
    pub weight_types: Vec<QuantType>,
    /// `fp8`: in place of the bf16 timings, the Llama-3-8B shape's random weights in bf16 and
    /// quantized to FP8 at load: decode at batch 1, a 2048-token prefill and the memory of each,
    /// and the FP8 logits against bf16's (a check, ‖Δ‖/‖ref‖ ≤ 5e-2). Needs compute capability
    /// 8.9 or later.
    #[arg(long, value_enum, default_value_t = Quantization::None)]
    pub quantization: Quantization,
    /// Write the JSON report here too.
    #[arg(long)]
    pub json_out: Option<PathBuf>,
}

#[cfg(feature = "cuda")]
pub fn run(args: GpuBenchArgs) -> Result<()> {
    use anyhow::{Context, bail};
    use duet_device::gpu_bench::{GpuBenchOptions, run};

    // The device first: without one, say so before looking for models.
    duet_cuda::probe::open_device(args.gpu)?;
    let mut models = args.check_models.clone();
    if models.is_empty() && !args.skip_checks {
        let tiny = PathBuf::from("tests/fixtures/tiny-llama");
        if tiny.exists() {
            models.push(tiny);
        }
        models.push(args.model.resolve()?);
    }
    let report = run(&GpuBenchOptions {
        ordinal: args.gpu,
        models,
        prompts: args.prompts.clone(),
        skip_speed: args.skip_speed,
        skip_checks: args.skip_checks,
        gpu_weights: args.gpu_weights,
        weight_types: args.weight_types.clone(),
        fp8_kv: args.fp8_kv,
        quantization: args.quantization,
    })?;
    print!("{}", report.table());
    let mut json = serde_json::to_value(&report)?;
    let peers = [
        (
            args.compare_hf,
            "bench/hf_gpu.py",
            "HF transformers",
            "hf_transformers",
        ),
        (
            args.compare_torch,
            "bench/torch_decode.py",
            "PyTorch + CUDA graphs",
            "torch_decode",
        ),
    ];
    let mut peer_failures = Vec::new();
    for (_, script, label, key) in peers.into_iter().filter(|p| p.0) {
        // A peer that fails is reported, and the report still written.
        match peer(script) {
            Ok(values) => {
                println!("\n{label}, same shapes, same run ({script}):");
                for t in &report.timings {
                    if let Some(v) = values.get(&t.name).and_then(|v| v.as_f64()) {
                        let ratio = if t.unit == "ms" {
                            v / t.value
                        } else {
                            t.value / v
                        };
                        println!(
                            "{:<44} {:<62} {:>8.1} {:<4}  duet/peer = {ratio:.2}x",
                            t.name, t.switches, v, t.unit
                        );
                    }
                }
                json[key] = values;
            }
            Err(e) => {
                println!("\n{label}: {e:#}");
                peer_failures.push(format!("{script}: {e:#}"));
            }
        }
    }
    let text = serde_json::to_string_pretty(&json)?;
    if let Some(path) = &args.json_out {
        std::fs::write(path, &text).with_context(|| format!("writing {}", path.display()))?;
    }
    if !report.all_passed() {
        bail!("a GPU check failed (see the table)");
    }
    if !peer_failures.is_empty() {
        bail!("a peer failed: {}", peer_failures.join("; "));
    }
    Ok(())
}

/// A GGUF block format by name (`Q4_K`, `q4_k`).
fn block_format(name: &str) -> Result<QuantType, String> {
    QuantType::BLOCK_FORMATS
        .into_iter()
        .find(|t| t.name().eq_ignore_ascii_case(name))
        .ok_or_else(|| {
            let names: Vec<&str> = QuantType::BLOCK_FORMATS.iter().map(|t| t.name()).collect();
            format!("{name} is not a block format ({})", names.join(", "))
        })
}

/// A peer script's JSON object of timings under `duet bench gpu`'s timing names.
#[cfg(feature = "cuda")]
fn peer(script: &str) -> Result<serde_json::Value> {
    use anyhow::{Context, bail};
    let out = std::process::Command::new("python3")
        .arg(script)
        .output()
        .with_context(|| format!("running python3 {script}"))?;
    if !out.status.success() {
        bail!("{script} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    }
    serde_json::from_slice(&out.stdout).with_context(|| format!("reading {script}'s JSON"))
}

#[cfg(not(feature = "cuda"))]
pub fn run(_: GpuBenchArgs) -> Result<()> {
    anyhow::bail!(
        "this build has no CUDA support; rebuild with `cargo build --release --features cuda` to use the GPU"
    )
}
