//! A request's constraint is compiled off the engine thread: the sequences already decoding go on
//! while a slow grammar compiles.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use duet_engine::engine::EngineOptions;
use duet_model::grammar::Grammar;
use duet_model::params::{Constraint, SamplingParams, StopCriteria};
use duet_worker::{EngineHandle, Event, Request, RequestId};
use tokio::sync::mpsc::{UnboundedSender, unbounded_channel};

fn tiny() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-llama")
}

/// A Lark grammar of `n` distinct words: compiling it (its lexer, and the first mask over the
/// vocabulary) takes many steps of the tiny model.
fn many_words(n: usize) -> Constraint {
    let words: Vec<String> = (0..n).map(|i| format!("\"{}\"", word(i))).collect();
    Constraint::Lark(format!("start: {}", words.join(" | ")))
}

/// The `i`th of many distinct lowercase words of 6 to 11 letters.
fn word(i: usize) -> String {
    let mut x = i as u64 * 0x9E37_79B9_7F4A_7C15 + 1;
    let len = 6 + i % 6;
    (0..len)
        .map(|_| {
            x ^= x >> 29;
            x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
            (b'a' + (x % 26) as u8) as char
        })
        .collect()
}

fn request(
    id: RequestId,
    params: SamplingParams,
    grammar: Option<Grammar>,
    max_tokens: usize,
    events: &UnboundedSender<Event>,
) -> Request {
    Request {
        id,
        prompt: (0..8).map(|i| 3 + i * 41).collect(),
        resumed: Default::default(),
        cache_salt: String::new(),
        params,
        grammar,
        stop: StopCriteria {
            max_tokens,
            ignore_eos: true,
            ..Default::default()
        },
        kv_out: None,
        events: events.clone(),
        received: Instant::now(),
    }
}

/// While a constrained request's grammar compiles, a request already decoding keeps producing
/// tokens: between the moment the compile starts and the constrained request's admission, the
/// running one yields several. Both requests report on one channel, so the order of its events
/// is the order the engine thread produced them (a compile on the engine thread would leave at
/// most the one step in flight between the two).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_compile_does_not_stall_running_sequences() {
    let options = EngineOptions {
        threads: 1,
        block_size: 4,
        kv_cache_tokens: 1024,
        max_step_tokens: 64,
        ..Default::default()
    };
    let engine = EngineHandle::spawn("engine", tiny(), options, Duration::from_secs(30), 1 << 20)
        .await
        .unwrap();
    let (events, mut rx) = unbounded_channel();
    let running = request(1, SamplingParams::greedy(), None, 240, &events);
    engine.submit(running, u64::MAX).unwrap();
    loop {
        match rx.recv().await.unwrap() {
            Event::Output(_) => break,
            Event::Failed(e) => panic!("{e}"),
            _ => {}
        }
    }
    // A marker: everything the engine sent before the compile started is ahead of it.
    let marker = Instant::now();
    events.send(Event::Scheduled(marker)).unwrap();
    let constrained = SamplingParams {
        constraint: Some(many_words(3000)),
        ..SamplingParams::greedy()
    };
    let grammar = engine.compile(&constrained).await.unwrap();
    assert!(grammar.is_some());
    engine
        .submit(request(2, constrained, grammar, 4, &events), u64::MAX)
        .unwrap();
    while !matches!(rx.recv().await, Some(Event::Scheduled(at)) if at == marker) {}
    let mut decoded_meanwhile = 0;
    loop {
        match rx.recv().await.unwrap() {
            Event::Admitted { .. } => break,
            Event::Output(_) => decoded_meanwhile += 1,
            Event::Scheduled(_) => {}
            Event::Failed(e) => panic!("{e}"),
        }
    }
    assert!(
        decoded_meanwhile >= 3,
        "the running request decoded {decoded_meanwhile} tokens while the grammar compiled"
    );
}

/// A worker holds `--max-constraint-bytes` itself: a longer constraint is refused before it is
/// compiled, naming the flag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_constraint_past_the_workers_limit_is_refused() {
    let options = EngineOptions {
        threads: 1,
        block_size: 4,
        kv_cache_tokens: 256,
        ..Default::default()
    };
    let engine = EngineHandle::spawn("engine", tiny(), options, Duration::from_secs(30), 12)
        .await
        .unwrap();
    let params = |regex: &str| SamplingParams {
        constraint: Some(Constraint::Regex(regex.into())),
        ..SamplingParams::greedy()
    };
    assert!(
        engine
            .compile(&params("[0-9]{1,15}"))
            .await
            .unwrap()
            .is_some()
    );
    let e = engine
        .compile(&params("[0-9]{1,15}[a-z]"))
        .await
        .err()
        .expect("refused");
    let message = e.to_string();
    assert!(
        message.contains("16 bytes") && message.contains("--max-constraint-bytes"),
        "{message}"
    );
    assert_eq!(tonic::Status::from(e).code(), tonic::Code::InvalidArgument);
}
