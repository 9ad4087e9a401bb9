//! `duet generate`: one prompt through the engine in this process, streamed to stdout.

use std::io::Write;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use duet_engine::chat::ChatMessage;
use duet_engine::engine::{Engine, EngineOptions};
use duet_engine::generation::{FinishReason, StopCriteria};
use duet_engine::sampling::SamplingParams;
use serde::Serialize;

use duet_engine::model_path::ModelArgs;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineOptions,
    /// The prompt text (special tokens such as <|im_start|> are recognised).
    #[arg(long)]
    pub prompt: String,
    /// Treat the prompt as a user message and format it with the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Nucleus sampling: keep the most likely tokens up to this total probability (0, 1].
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub top_p: f32,
    /// Keep only the K most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    pub top_k: u32,
    /// Drop tokens less likely than this fraction of the most likely one.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub min_p: f32,
    /// Penalise tokens already in the prompt or output (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    /// Subtracted from the logits of tokens already generated.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    /// Subtracted per occurrence from the logits of tokens already generated.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    /// Random seed: the same seed gives the same tokens.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop when this text appears (not included in the output); repeatable.
    #[arg(long)]
    pub stop: Vec<String>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print one JSON object (ids, text, finish reason, timings) instead of streaming text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct Timings {
    prefill_ms: f64,
    decode_ms: f64,
    prefill_tokens_per_s: f64,
    decode_tokens_per_s: f64,
}

#[derive(Serialize)]
struct JsonOutput {
    prompt_token_ids: Vec<u32>,
    token_ids: Vec<u32>,
    text: String,
    finish_reason: FinishReason,
    timings: Timings,
}

pub fn run(args: GenerateArgs) -> Result<()> {
    let path = args.model.resolve()?;
    let mut engine = Engine::load(&path, args.engine.clone())
        .with_context(|| format!("loading {}", path.display()))?;
    let prompt_text = if args.chat {
        engine.apply_chat_template(&[ChatMessage {
            role: "user".into(),
            content: args.prompt.clone(),
        }])?
    } else {
        args.prompt.clone()
    };
    let prompt = engine.encode(&prompt_text)?;
    let params = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repetition_penalty: args.repetition_penalty,
        presence_penalty: args.presence_penalty,
        frequency_penalty: args.frequency_penalty,
        seed: args.seed,
        logprobs: 0,
    };
    let stop = StopCriteria {
        max_tokens: args.max_tokens,
        stop_token_ids: Vec::new(),
        stop_strings: args.stop.clone(),
        ignore_eos: args.ignore_eos,
    };
    let id = engine.add_sequence(prompt.clone(), params, stop)?;

    let mut stdout = std::io::stdout().lock();
    let mut token_ids = Vec::new();
    let mut text = String::new();
    let start = Instant::now();
    let mut first_token_at = None;
    let finish = loop {
        let outputs = engine.step()?;
        let Some(out) = outputs.into_iter().find(|o| o.seq == id) else {
            continue;
        };
        first_token_at.get_or_insert_with(Instant::now);
        token_ids.push(out.token.token);
        if !args.json && !out.text.is_empty() {
            stdout.write_all(out.text.as_bytes())?;
            stdout.flush()?;
        }
        text.push_str(&out.text);
        if let Some(reason) = out.finish {
            break reason;
        }
    };
    let end = Instant::now();
    engine.remove_sequence(id)?;

    let first = first_token_at.unwrap_or(end);
    let prefill_s = (first - start).as_secs_f64();
    let decode_s = (end - first).as_secs_f64();
    // The first token comes out of the prefill step; the rest are decode steps.
    let decode_tokens = token_ids.len().saturating_sub(1);
    let timings = Timings {
        prefill_ms: prefill_s * 1e3,
        decode_ms: decode_s * 1e3,
        prefill_tokens_per_s: rate(prompt.len(), prefill_s),
        decode_tokens_per_s: rate(decode_tokens, decode_s),
    };
    if args.json {
        let out = JsonOutput {
            prompt_token_ids: prompt,
            token_ids,
            text,
            finish_reason: finish,
            timings,
        };
        serde_json::to_writer(&mut stdout, &out)?;
        writeln!(stdout)?;
    } else {
        writeln!(stdout)?;
        eprintln!(
            "[{} prompt tokens in {:.0} ms ({:.0} tok/s); {} tokens in {:.0} ms ({:.1} tok/s); finish: {}]",
            prompt.len(),
            timings.prefill_ms,
            timings.prefill_tokens_per_s,
            token_ids.len(),
            timings.decode_ms,
            timings.decode_tokens_per_s,
            finish.as_str()
        );
    }
    Ok(())
}

fn rate(n: usize, secs: f64) -> f64 {
    if secs > 0.0 { n as f64 / secs } else { 0.0 }
}
