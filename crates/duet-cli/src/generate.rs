//! `duet generate`: one prompt through the engine in this process, streamed to stdout.

use std::io::Write;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use duet_device::{LoadedEngine, WithEngine};
use duet_engine::backend::Backend;
use duet_engine::engine::{Engine, EngineOptions};
use duet_model::chat::ChatMessage;
use duet_model::params::StopCriteria;
use duet_model::params::{Constraint, SamplingParams};
use serde::Serialize;

use duet_model::model_path::ModelArgs;

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
    /// Structured output: the text is JSON valid against the JSON Schema in this file.
    #[arg(long, value_name = "FILE", group = "constraint")]
    pub json_schema: Option<std::path::PathBuf>,
    /// Structured output: the text is a JSON object.
    #[arg(long, group = "constraint")]
    pub json_object: bool,
    /// Structured output: the whole text matches this regular expression.
    #[arg(long, value_name = "REGEX", group = "constraint")]
    pub regex: Option<String>,
    /// Structured output: the text follows the Lark grammar in this file (llguidance's dialect).
    #[arg(long, value_name = "FILE", group = "constraint")]
    pub grammar: Option<std::path::PathBuf>,
    /// Opt this request out of speculative decoding (the engine's --speculative, or the
    /// cluster's); the output is the same either way.
    #[arg(long)]
    pub no_speculative: bool,
    /// Print one JSON object (ids, text, finish reason, timings, speculation) instead of
    /// streaming text.
    #[arg(long)]
    pub json: bool,
    /// Generate through a running cluster (the router's address, e.g. 127.0.0.1:50051) instead of
    /// loading the model in this process.
    #[arg(long, env = "DUET_SERVER")]
    pub server: Option<String>,
    /// PEM certificate of the CA that signed the router's certificate: --server is called over
    /// TLS (the router runs with --tls-cert).
    #[arg(long, env = "DUET_TLS_CA", requires = "server")]
    pub tls_ca: Option<std::path::PathBuf>,
    /// A router API keys file (one key a line, as --api-keys-file takes it): --server is called
    /// with its first key (`authorization: Bearer KEY`).
    #[arg(long, env = "DUET_API_KEY_FILE", requires = "server")]
    pub api_key_file: Option<std::path::PathBuf>,
}

#[derive(Serialize)]
struct Timings {
    prefill_ms: f64,
    decode_ms: f64,
    prefill_tokens_per_s: f64,
    decode_tokens_per_s: f64,
}

/// Speculative decoding's work on the request (the `Usage` fields of the same names).
#[derive(Serialize, Default)]
struct Speculation {
    decode_steps: u32,
    draft_tokens: u32,
    accepted_draft_tokens: u32,
}

#[derive(Serialize)]
struct JsonOutput {
    prompt_token_ids: Vec<u32>,
    token_ids: Vec<u32>,
    text: String,
    finish_reason: String,
    timings: Timings,
    speculation: Speculation,
}

pub fn run(args: GenerateArgs) -> Result<()> {
    if let Some(server) = args.server.clone() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        return runtime.block_on(run_remote(args, server));
    }
    let path = args.model.resolve()?;
    let engine = LoadedEngine::load(&path, args.engine.clone())
        .with_context(|| format!("loading {}", path.display()))?;
    engine.run(LocalGenerate(args))
}

/// Generation in this process, on whichever backend the engine runs.
struct LocalGenerate(GenerateArgs);

impl WithEngine for LocalGenerate {
    type Output = Result<()>;

    fn run<B: Backend + 'static>(self, engine: Engine<B>) -> Result<()> {
        generate_local(self.0, engine)
    }
}

fn generate_local<B: Backend>(args: GenerateArgs, mut engine: Engine<B>) -> Result<()> {
    let prompt_text = if args.chat {
        engine.apply_chat_template(&[ChatMessage::new("user", args.prompt.clone())])?
    } else {
        args.prompt.clone()
    };
    let prompt = engine.encode(&prompt_text)?;
    let params = sampling_params(&args)?;
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
    let mut speculation;
    let finish = 'steps: loop {
        // A speculating step may yield several tokens.
        for out in engine.step()?.into_iter().filter(|o| o.seq == id) {
            first_token_at.get_or_insert_with(Instant::now);
            token_ids.push(out.token.token);
            emit(&args, &mut stdout, &mut text, &out.text)?;
            let s = out.speculation;
            let count = |n: u64| n.try_into().unwrap_or(u32::MAX);
            speculation = Speculation {
                // The first step sampled the prefill's token.
                decode_steps: count(s.steps.saturating_sub(1)),
                draft_tokens: count(s.draft_tokens),
                accepted_draft_tokens: count(s.accepted_draft_tokens),
            };
            if let Some(error) = out.error {
                anyhow::bail!("the generation failed: {error}");
            }
            if let Some(reason) = out.finish {
                break 'steps reason;
            }
        }
    };
    let end = Instant::now();
    engine.remove_sequence(id)?;
    let first = first_token_at.unwrap_or(end);
    finish_output(
        &args,
        &mut stdout,
        prompt,
        token_ids,
        text,
        finish.as_str(),
        (first - start).as_secs_f64(),
        (end - first).as_secs_f64(),
        speculation,
    )
}

/// The grammar the flags ask for, if any.
fn constraint(args: &GenerateArgs) -> Result<Option<Constraint>> {
    let read = |path: &std::path::Path| {
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
    };
    Ok(if let Some(path) = &args.json_schema {
        Some(Constraint::JsonSchema(read(path)?))
    } else if let Some(path) = &args.grammar {
        Some(Constraint::Lark(read(path)?))
    } else if let Some(rx) = &args.regex {
        Some(Constraint::Regex(rx.clone()))
    } else {
        args.json_object.then_some(Constraint::JsonObject)
    })
}

fn sampling_params(args: &GenerateArgs) -> Result<SamplingParams> {
    Ok(SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repetition_penalty: args.repetition_penalty,
        presence_penalty: args.presence_penalty,
        frequency_penalty: args.frequency_penalty,
        seed: args.seed,
        logprobs: 0,
        constraint: constraint(args)?,
        speculative: !args.no_speculative,
    })
}

fn emit(args: &GenerateArgs, out: &mut impl Write, text: &mut String, piece: &str) -> Result<()> {
    if !args.json && !piece.is_empty() {
        out.write_all(piece.as_bytes())?;
        out.flush()?;
    }
    text.push_str(piece);
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn finish_output(
    args: &GenerateArgs,
    stdout: &mut impl Write,
    prompt: Vec<u32>,
    token_ids: Vec<u32>,
    text: String,
    finish_reason: &str,
    prefill_s: f64,
    decode_s: f64,
    speculation: Speculation,
) -> Result<()> {
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
            finish_reason: finish_reason.to_string(),
            timings,
            speculation,
        };
        serde_json::to_writer(&mut *stdout, &out)?;
        writeln!(stdout)?;
    } else {
        writeln!(stdout)?;
        eprintln!(
            "[{} prompt tokens in {:.0} ms ({:.0} tok/s); {} tokens in {:.0} ms ({:.1} tok/s); finish: {finish_reason}]",
            prompt.len(),
            timings.prefill_ms,
            timings.prefill_tokens_per_s,
            token_ids.len(),
            timings.decode_ms,
            timings.decode_tokens_per_s,
        );
        if speculation.draft_tokens > 0 {
            eprintln!(
                "[speculation: {} of {} drafted tokens accepted; {:.2} tokens per decode step]",
                speculation.accepted_draft_tokens,
                speculation.draft_tokens,
                decode_tokens as f64 / speculation.decode_steps.max(1) as f64,
            );
        }
    }
    Ok(())
}

/// A channel to the router at `server`, over TLS trusting `tls_ca` when given.
pub(crate) async fn router_channel(
    server: &str,
    tls_ca: Option<&std::path::Path>,
) -> Result<tonic::transport::Channel> {
    let tls = tls_ca.map(duet_proto::tls::client_trusting).transpose()?;
    duet_proto::channels::endpoint(server, tls.as_ref())?
        .connect()
        .await
        .with_context(|| format!("connecting to {server} (is `duet up` running?)"))
}

/// The same request through a running cluster's router.
async fn run_remote(args: GenerateArgs, server: String) -> Result<()> {
    use duet_proto::v1;
    use futures::StreamExt;
    let channel = router_channel(&server, args.tls_ca.as_deref()).await?;
    let mut client = v1::generation_client::GenerationClient::new(channel);
    let key = match &args.api_key_file {
        Some(path) => Some(
            duet_router::api_keys::ApiKeys::load(path)?
                .first()
                .to_string(),
        ),
        None => None,
    };

    let mut request = v1::GenerateRequest {
        max_tokens: Some(args.max_tokens as u32),
        temperature: Some(args.temperature),
        top_p: Some(args.top_p),
        top_k: args.top_k as i32,
        min_p: Some(args.min_p),
        repetition_penalty: Some(args.repetition_penalty),
        presence_penalty: Some(args.presence_penalty),
        frequency_penalty: Some(args.frequency_penalty),
        seed: args.seed,
        stop: args.stop.clone(),
        ignore_eos: args.ignore_eos,
        constraint: constraint(&args)?.as_ref().map(v1::Constraint::from),
        speculative: args.no_speculative.then_some(false),
        ..Default::default()
    };
    if args.chat {
        request.messages = vec![v1::ChatMessage {
            role: "user".into(),
            content: args.prompt.clone(),
            ..Default::default()
        }];
    } else {
        request.prompt = args.prompt.clone();
    }
    let prompt = client
        .tokenize(duet_cli::cluster::with_api_key(
            v1::TokenizeRequest {
                text: request.prompt.clone(),
                messages: request.messages.clone(),
                chat_template_kwargs: request.chat_template_kwargs.clone(),
            },
            key.as_deref(),
        )?)
        .await?
        .into_inner()
        .token_ids;
    let start = Instant::now();
    let mut stream = client
        .generate(duet_cli::cluster::with_api_key(request, key.as_deref())?)
        .await?
        .into_inner();
    let mut stdout = std::io::stdout().lock();
    let (mut token_ids, mut text, mut first_at, mut finish) =
        (Vec::new(), String::new(), None, String::from("length"));
    let mut speculation = Speculation::default();
    while let Some(msg) = stream.next().await {
        let msg = msg?;
        if let Some(u) = &msg.usage {
            speculation = Speculation {
                decode_steps: u.decode_steps,
                draft_tokens: u.draft_tokens,
                accepted_draft_tokens: u.accepted_draft_tokens,
            };
        }
        if !msg.token_ids.is_empty() {
            first_at.get_or_insert_with(Instant::now);
        }
        token_ids.extend(&msg.token_ids);
        emit(&args, &mut stdout, &mut text, &msg.text)?;
        match v1::FinishReason::try_from(msg.finish_reason) {
            Ok(v1::FinishReason::Stop) => finish = "stop".into(),
            Ok(v1::FinishReason::Length) => finish = "length".into(),
            Ok(v1::FinishReason::Error) => anyhow::bail!("the generation failed: {}", msg.error),
            _ => {}
        }
    }
    // A generation always brings at least one token (a stop token is reported too), so a stream
    // that ends cleanly without one is a broken server: `helm test` relies on this failing.
    anyhow::ensure!(
        !token_ids.is_empty(),
        "{server} ended the Generate stream without a token"
    );
    let end = Instant::now();
    let first = first_at.unwrap_or(end);
    finish_output(
        &args,
        &mut stdout,
        prompt,
        token_ids,
        text,
        &finish,
        (first - start).as_secs_f64(),
        (end - first).as_secs_f64(),
        speculation,
    )
}

fn rate(n: usize, secs: f64) -> f64 {
    if secs > 0.0 { n as f64 / secs } else { 0.0 }
}
