//! `duet bench structured`: what a grammar costs per token. A batch of chat prompts decodes under
//! a nested JSON Schema (or, with `--auto-tools`, the grammar `tool_choice: "auto"` holds an
//! answer to: free text, and Hermes calls of a weather tool), then the same prompts decode
//! unconstrained for exactly as many tokens each (ignoring end-of-sequence), so the two runs step
//! the same batch shapes; the time per output token of each sequence (after its first) is
//! compared. The two runs alternate, repeat after repeat, and the best of each is reported.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, ensure};
use clap::Args;
use duet_cpu::CpuBackend;
use duet_engine::engine::{Engine, EngineOptions, SeqId};
use duet_model::chat::ChatMessage;
use duet_model::model_path::ModelArgs;
use duet_model::params::{Constraint, SamplingParams, StopCriteria};
use duet_model::tool_calls::{ToolCallFormat, call_schema};
use serde::Serialize;

use crate::bench_engine::{Cpu, cpu_info, kernel_threads, print_json};

#[derive(Args, Debug)]
pub struct StructuredBenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineOptions,
    /// Sequences decoding together.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// The JSON Schema (a file); the default is a nested one: a person with an address and a
    /// list of hobbies.
    #[arg(long, value_name = "FILE")]
    pub schema: Option<PathBuf>,
    /// Decode under `tool_choice: "auto"`'s grammar instead of a schema: text free until it
    /// writes `<tool_call>`, then a call of a `get_weather` tool held to its parameters.
    #[arg(long, conflicts_with = "schema")]
    pub auto_tools: bool,
    /// Most tokens per answer.
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// Runs of each kind, taken in turn; the best is reported.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Write the JSON report here too.
    #[arg(long)]
    pub json_out: Option<PathBuf>,
}

const NESTED_SCHEMA: &str = r#"{
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "address": {
      "type": "object",
      "properties": {
        "street": {"type": "string", "maxLength": 60},
        "city": {"type": "string", "maxLength": 40},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}
      },
      "required": ["street", "city", "zip"],
      "additionalProperties": false
    },
    "hobbies": {
      "type": "array",
      "items": {
        "type": "object",
        "properties": {
          "name": {"type": "string", "maxLength": 30},
          "years": {"type": "integer", "minimum": 0, "maximum": 80}
        },
        "required": ["name", "years"],
        "additionalProperties": false
      },
      "maxItems": 3
    }
  },
  "required": ["name", "age", "address", "hobbies"],
  "additionalProperties": false
}"#;

const PEOPLE: [&str; 8] = [
    "a retired sailor",
    "a young violinist",
    "a software engineer",
    "a farmer from Iowa",
    "a marathon runner",
    "a museum curator",
    "a pastry chef",
    "a high school teacher",
];

#[derive(Serialize)]
struct Report {
    model: String,
    cpu: Cpu,
    threads: usize,
    /// The grammar masks were computed while the forward pass ran (a core was free of kernel
    /// threads), not after it.
    masks_overlapped: bool,
    batch: usize,
    /// `json_schema`, or `lark` for `tool_choice: "auto"`'s grammar.
    kind: &'static str,
    /// The JSON Schema, or the Lark grammar.
    grammar: String,
    /// Output tokens per sequence of the constrained run (the unconstrained run matches them).
    tokens: Vec<usize>,
    /// Every constrained answer parsed as JSON (under `--auto-tools`: every answer is text or
    /// calls whose arguments parse).
    all_answers_parse: bool,
    /// Mean over the batch of each sequence's time per output token after its first, ms.
    constrained_tpot_ms: f64,
    unconstrained_tpot_ms: f64,
    /// constrained ÷ unconstrained − 1.
    overhead: f64,
}

/// One run's answers: per sequence (in prompt order) its tokens, text and time per output token.
struct Run {
    tokens: Vec<usize>,
    texts: Vec<String>,
    tpot_ms: Vec<f64>,
}

/// Decodes `prompts` together, each with its own parameters and stop criteria, to the end.
fn run(
    engine: &mut Engine<CpuBackend>,
    prompts: &[Vec<u32>],
    requests: impl Fn(usize) -> (SamplingParams, StopCriteria),
) -> Result<Run> {
    let mut ids: Vec<SeqId> = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let (params, stop) = requests(i);
        ids.push(engine.add_sequence(p.clone(), params, stop)?);
    }
    let index: HashMap<SeqId, usize> = ids.iter().enumerate().map(|(i, &s)| (s, i)).collect();
    let n = prompts.len();
    let (mut first, mut last) = (vec![None; n], vec![None; n]);
    let (mut tokens, mut texts) = (vec![0usize; n], vec![String::new(); n]);
    while engine.has_work() {
        let outputs = engine.step()?;
        let now = Instant::now();
        for o in outputs {
            let i = index[&o.seq];
            first[i].get_or_insert(now);
            last[i] = Some(now);
            tokens[i] += 1;
            texts[i].push_str(&o.text);
        }
    }
    for id in ids {
        engine.remove_sequence(id)?;
    }
    let tpot_ms = (0..n)
        .map(|i| {
            let (f, l) = (
                first[i].context("a sequence without tokens")?,
                last[i].unwrap(),
            );
            Ok((l - f).as_secs_f64() * 1e3 / (tokens[i].max(2) - 1) as f64)
        })
        .collect::<Result<Vec<f64>>>()?;
    Ok(Run {
        tokens,
        texts,
        tpot_ms,
    })
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

pub fn run_bench(args: StructuredBenchArgs) -> Result<()> {
    ensure!(
        args.batch > 0 && args.repeats > 0 && args.max_tokens > 1,
        "--batch and --repeats must be positive, --max-tokens above 1"
    );
    let path = args.model.resolve()?;
    let constraint = if args.auto_tools {
        let weather = serde_json::json!({"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 40},
            "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": false});
        Constraint::Lark(ToolCallFormat::Hermes.grammar(&call_schema([("get_weather", weather)])))
    } else {
        Constraint::JsonSchema(match &args.schema {
            Some(p) => {
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?
            }
            None => NESTED_SCHEMA.to_string(),
        })
    };
    // What an answer must be to count as parsed.
    let json = |text: &str| serde_json::from_str::<serde_json::Value>(text.trim()).is_ok();
    let parses = |text: &str| {
        if !args.auto_tools {
            return json(text);
        }
        let (open, close) = ToolCallFormat::Hermes.delimiters();
        text.split(open)
            .skip(1)
            .all(|block| block.split_once(close).is_some_and(|(call, _)| json(call)))
    };
    let mut engine = duet_cpu::load_engine(&path, args.engine.clone())?;
    let prompts = (0..args.batch)
        .map(|i| {
            let who = PEOPLE[i % PEOPLE.len()];
            let ask = if args.auto_tools {
                format!("Tell me about the weather where {who} lives.")
            } else {
                format!("Describe {who} as a JSON object with an address and hobbies.")
            };
            let text = engine.apply_chat_template(&[ChatMessage::new("user", ask)])?;
            Ok(engine.encode(&text)?)
        })
        .collect::<Result<Vec<_>>>()?;
    let greedy = |constraint| SamplingParams {
        constraint,
        ..SamplingParams::greedy()
    };
    let (mut best_constrained, mut best_free) = (f64::MAX, f64::MAX);
    let mut tokens = Vec::new();
    let mut all_parse = true;
    for r in 0..args.repeats {
        let constrained = run(&mut engine, &prompts, |_| {
            let stop = StopCriteria {
                max_tokens: args.max_tokens,
                ..Default::default()
            };
            (greedy(Some(constraint.clone())), stop)
        })?;
        all_parse &= constrained.texts.iter().all(|t| parses(t));
        let free = run(&mut engine, &prompts, |i| {
            let stop = StopCriteria {
                max_tokens: constrained.tokens[i],
                ignore_eos: true,
                ..Default::default()
            };
            (greedy(None), stop)
        })?;
        ensure!(
            free.tokens == constrained.tokens,
            "the unconstrained run made {:?} tokens, not the constrained run's {:?}",
            free.tokens,
            constrained.tokens
        );
        let (c, f) = (mean(&constrained.tpot_ms), mean(&free.tpot_ms));
        eprintln!(
            "[{}/{}] TPOT constrained {c:.2} ms, unconstrained {f:.2} ms ({:+.1}%); tokens {:?}",
            r + 1,
            args.repeats,
            100.0 * (c / f - 1.0),
            constrained.tokens
        );
        best_constrained = best_constrained.min(c);
        best_free = best_free.min(f);
        tokens = constrained.tokens;
    }
    let threads = kernel_threads(&args.engine);
    let report = Report {
        model: path.display().to_string(),
        cpu: cpu_info(),
        threads,
        masks_overlapped: engine.overlaps_grammar_masks(),
        batch: args.batch,
        kind: constraint.kind(),
        grammar: match constraint {
            Constraint::JsonSchema(text) | Constraint::Lark(text) => text,
            other => format!("{other:?}"),
        },
        tokens,
        all_answers_parse: all_parse,
        constrained_tpot_ms: best_constrained,
        unconstrained_tpot_ms: best_free,
        overhead: best_constrained / best_free - 1.0,
    };
    println!(
        "structured outputs, batch {}: TPOT {:.2} ms under the grammar ({}), {:.2} ms without ({:+.1}%), best of {}; every answer parses: {}",
        report.batch,
        report.constrained_tpot_ms,
        report.kind,
        report.unconstrained_tpot_ms,
        100.0 * report.overhead,
        args.repeats,
        report.all_answers_parse
    );
    print_json(&report, args.json_out.as_deref())
}
