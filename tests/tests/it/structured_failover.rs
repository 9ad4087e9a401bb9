//! A structured-output stream and a seeded sampled stream survive a decode worker that hangs
//! mid-stream (SIGSTOP, so separate processes): each goes on on the other worker with exactly
//! the tokens an uninterrupted run of the same request gives. The constrained one's grammar is
//! rebuilt there by replaying the tokens already streamed, and its text validates. The seeded
//! stream does the same on decode workers that speculate (`--speculative ngram`, and a draft model), whose steps
//! yield several tokens at a time.

use std::time::Duration;

use duet_engine::speculator::SpeculativeMode;
use duet_proto::v1;
use duet_tests::*;
use futures::StreamExt;

/// A long required field keeps the stream going well past the moment the test stops its worker.
const SCHEMA: &str = r#"{"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "biography": {"type": "string", "minLength": 300, "maxLength": 400}},
    "required": ["name", "age", "biography"], "additionalProperties": false}"#;

fn request(constraint: Option<v1::constraint::Kind>, seed: u64) -> v1::GenerateRequest {
    v1::GenerateRequest {
        messages: vec![v1::ChatMessage {
            role: "user".into(),
            content: "Describe a fictional person as JSON.".into(),
            ..Default::default()
        }],
        max_tokens: Some(200),
        temperature: Some(0.8),
        seed: Some(seed),
        // Without a grammar to end it, the stream runs to max_tokens.
        ignore_eos: constraint.is_none(),
        constraint: constraint.map(|kind| v1::Constraint { kind: Some(kind) }),
        ..Default::default()
    }
}

/// The stream of `req` with the decode worker running it stopped after its first message:
/// the token ids, the text and the decode failovers the final message reports.
async fn interrupted(
    c: &Cluster,
    req: v1::GenerateRequest,
) -> (Vec<u32>, String, v1::GenerateResponse) {
    let mut client = client(c.router).await;
    let mut stream = client.generate(req).await.unwrap().into_inner();
    let first = stream.next().await.unwrap().unwrap();
    let (mut ids, mut text) = (first.token_ids, first.text);
    // Stop whichever decode worker runs the request (no prefill workers: process index = i).
    let mut stopped = None;
    for (i, &addr) in c.decode.iter().enumerate() {
        if worker_stats(c, addr).await.running_sequences > 0 {
            c.signal_process(i, "STOP").unwrap();
            stopped = Some(i);
            break;
        }
    }
    let stopped = stopped.expect("a decode worker runs the request");
    let mut last = None;
    let rest = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(msg) = stream.next().await {
            let msg = msg.unwrap();
            ids.extend(&msg.token_ids);
            text.push_str(&msg.text);
            last = Some(msg);
        }
    })
    .await;
    c.signal_process(stopped, "CONT").unwrap();
    rest.expect("the stream went on without its hung worker");
    (ids, text, last.unwrap())
}

#[test]
fn constrained_and_seeded_streams_continue_exactly_after_a_hung_decode_worker() {
    let model = checkout_default_model();
    let cases = [
        (
            "a JSON Schema, sampled with a seed",
            // Room for a biography of short tokens to reach its minimum and close.
            v1::GenerateRequest {
                max_tokens: Some(320),
                ..request(Some(v1::constraint::Kind::JsonSchema(SCHEMA.into())), 7)
            },
            SpeculativeMode::Off,
        ),
        (
            "sampled with a seed",
            request(None, 11),
            SpeculativeMode::Off,
        ),
        (
            "sampled with a seed, the decode workers speculating",
            request(None, 11),
            SpeculativeMode::Ngram,
        ),
        (
            // No smaller model of its tokenizer is at hand: the model drafts for itself.
            "sampled with a seed, the decode workers speculating with a draft model",
            v1::GenerateRequest {
                max_tokens: Some(60),
                ..request(None, 11)
            },
            SpeculativeMode::Draft(model.clone()),
        ),
    ];
    for (what, req, speculative) in cases {
        // A model drafting for itself in this unoptimised build takes seconds a step (a forward
        // pass of the whole model per drafted token, the prompt caught up first): the router
        // waits longer before it calls a worker hung, and drafts are short.
        let drafting_model = matches!(speculative, SpeculativeMode::Draft(_));
        let mut spec = spec(
            model.clone(),
            0,
            2,
            RoutingOptions {
                local_prefill_threshold: 10_000,
                decode_idle_timeout_ms: if drafting_model { 10_000 } else { 2000 },
                ..Default::default()
            },
        );
        spec.decode.worker.engine.speculative = speculative.clone();
        if drafting_model {
            spec.decode.worker.engine.num_speculative_tokens = 3;
        }
        let c = Cluster::start(&ClusterSpec {
            processes: true,
            bin_dir: Some(bin_dir()),
            ..spec
        })
        .unwrap();
        let rt = tokio::runtime::Runtime::new().unwrap();
        let (want, want_text, _) = rt.block_on(generate(c.router, req.clone())).unwrap();
        let (got, got_text, last) = rt.block_on(interrupted(&c, req.clone()));
        assert_eq!(last.timings.unwrap().decode_failovers, 1, "{what}");
        let usage = last.usage.unwrap();
        if speculative != SpeculativeMode::Off {
            assert!(
                usage.accepted_draft_tokens > 0 && usage.decode_steps > 0,
                "{what}: the resuming worker speculated: {usage:?}"
            );
        } else {
            assert_eq!(usage.draft_tokens, 0, "{what}");
        }
        assert_eq!(
            got, want,
            "{what}: tokens differ from the uninterrupted run"
        );
        assert_eq!(got_text, want_text, "{what}");
        if req.constraint.is_some() {
            let v: serde_json::Value = serde_json::from_str(&got_text)
                .unwrap_or_else(|e| panic!("{what}: {got_text:?} is not JSON: {e}"));
            let bio = v["biography"].as_str().unwrap().chars().count();
            assert!((300..=400).contains(&bio), "{what}: {got_text}");
            assert!(
                v["name"].is_string() && v["age"].is_u64(),
                "{what}: {got_text}"
            );
        } else {
            assert_eq!(Some(got.len() as u32), req.max_tokens, "{what}");
        }
    }
}
