//! `duet bench gpu`: the GPU checks and timings of `duet_device::gpu_bench`, as a table and JSON; HF
//! transformers on the same shapes in the same run with `--compare-hf` (one HF time against duet's
//! with each prefill attention kernel).

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use duet_model::model_path::ModelArgs;

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
    /// Also time HF transformers on the same shapes (bench/hf_gpu.py, needs torch + transformers).
    #[arg(long)]
    pub compare_hf: bool,
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
    if models.is_empty() {
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
    })?;
    print!("{}", report.table());
    let mut json = serde_json::to_value(&report)?;
    if args.compare_hf {
        let out = std::process::Command::new("python3")
            .arg("bench/hf_gpu.py")
            .output()
            .context("running python3 bench/hf_gpu.py")?;
        if !out.status.success() {
            bail!(
                "bench/hf_gpu.py failed:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let hf: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        println!("\nHF transformers, same shapes, same run:");
        for t in &report.timings {
            if let Some(v) = hf.get(&t.name).and_then(|v| v.as_f64()) {
                let ratio = if t.unit == "ms" {
                    v / t.value
                } else {
                    t.value / v
                };
                println!(
                    "{:<58} {:>8.1} {:<4}  duet/HF = {ratio:.2}x",
                    t.label(),
                    v,
                    t.unit
                );
            }
        }
        json["hf_transformers"] = hf;
    }
    let text = serde_json::to_string_pretty(&json)?;
    if let Some(path) = &args.json_out {
        std::fs::write(path, &text).with_context(|| format!("writing {}", path.display()))?;
    }
    if !report.all_passed() {
        bail!("a GPU check failed (see the table)");
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
pub fn run(_: GpuBenchArgs) -> Result<()> {
    anyhow::bail!(
        "this build has no CUDA support; rebuild with `cargo build --release --features cuda` to use the GPU"
    )
}
