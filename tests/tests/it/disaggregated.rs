//! A whole cluster (router + prefill + decode workers) on loopback: greedy tokens through the
//! disaggregated path equal one engine's in one process — remote prefill, local prefill, many
//! concurrent requests, prefix-cache hits — and `Complete` equals the `Generate` stream.

use duet_proto::v1;
use duet_tests::*;

fn prompts(n: usize) -> Vec<Vec<u32>> {
    (0..n)
        .map(|i| {
            (0..(40 + 7 * i) as u32)
                .map(|j| 3 + (j * 31 + i as u32 * 101) % 370)
                .collect()
        })
        .collect()
}

/// With the eos token possibly at the end: the stream includes the stop token; so does the
/// reference (reported, then not part of the context).
fn check(got: &[Vec<u32>], want: &[Vec<u32>]) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(
            g, w,
            "request {i}: cluster tokens differ from the in-process engine"
        );
    }
}

#[test]
fn remote_prefill_gives_the_engines_tokens() {
    let c = cluster(tiny_model(), 1, 1, local_prefill_threshold(0));
    let ps = prompts(3);
    let want = reference(&tiny_model(), &ps, 12);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let got: Vec<Vec<u32>> = ps
        .iter()
        .map(|p| {
            let (ids, _, last) = rt
                .block_on(generate(c.router, greedy_request(p, 12)))
                .unwrap();
            let t = last.timings.unwrap();
            assert!(
                !t.prefill_local,
                "the plan must have used the prefill worker"
            );
            ids
        })
        .collect();
    check(&got, &want);
}

#[test]
fn local_prefill_gives_the_engines_tokens() {
    let c = cluster(tiny_model(), 1, 1, local_prefill_threshold(100_000));
    let ps = prompts(2);
    let want = reference(&tiny_model(), &ps, 10);
    let rt = tokio::runtime::Runtime::new().unwrap();
    for (p, w) in ps.iter().zip(&want) {
        let (ids, _, last) = rt
            .block_on(generate(c.router, greedy_request(p, 10)))
            .unwrap();
        assert!(last.timings.unwrap().prefill_local);
        assert_eq!(&ids, w);
    }
}

#[test]
fn sixty_four_concurrent_requests_each_equal_their_solo_run() {
    let c = cluster(tiny_model(), 1, 1, local_prefill_threshold(0));
    let ps: Vec<Vec<u32>> = (0..64)
        .map(|i| {
            (0..(17 + (i * 13) % 90) as u32)
                .map(|j| 3 + (j * 17 + i as u32 * 29) % 370)
                .collect()
        })
        .collect();
    let lens: Vec<u32> = (0..64).map(|i| 4 + (i % 9) as u32).collect();
    let want: Vec<Vec<u32>> = ps
        .iter()
        .zip(&lens)
        .map(|(p, &n)| reference(&tiny_model(), std::slice::from_ref(p), n as usize).remove(0))
        .collect();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let got: Vec<Vec<u32>> = rt.block_on(async {
        let calls = ps
            .iter()
            .zip(&lens)
            .map(|(p, &n)| generate(c.router, greedy_request(p, n)));
        futures::future::join_all(calls)
            .await
            .into_iter()
            .map(|r| r.unwrap().0)
            .collect()
    });
    check(&got, &want);
}

#[test]
fn complete_equals_the_concatenated_stream_and_prefix_hits_are_reported() {
    let c = cluster(tiny_model(), 1, 1, local_prefill_threshold(0));
    let p = prompts(1).remove(0);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (ids, text, first) = rt
        .block_on(generate(c.router, greedy_request(&p, 9)))
        .unwrap();
    let whole = rt
        .block_on(async { client(c.router).await.complete(greedy_request(&p, 9)).await })
        .unwrap()
        .into_inner();
    assert_eq!(whole.token_ids, ids);
    assert_eq!(whole.text, text);
    assert_eq!(whole.finish_reason, first.finish_reason);
    // The second identical prompt found its prefix cached and still gave the same tokens.
    let usage = whole.usage.unwrap();
    assert!(usage.cached_prompt_tokens > 0, "usage {usage:?}");
    assert_eq!(usage.prompt_tokens as usize, p.len());
    assert_eq!(first.finish_reason, v1::FinishReason::Length as i32);
}

#[test]
fn default_model_through_the_cluster_equals_in_process() {
    let model = checkout_default_model();
    let c = cluster(model.clone(), 1, 1, local_prefill_threshold(16));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let engine = duet_cpu::load_engine(&model, engine_options()).unwrap();
    let texts = [
        "The capital of France is",
        "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, computed iteratively so it stays fast even for large n.\"\"\"\n",
    ];
    let ps: Vec<Vec<u32>> = texts.iter().map(|t| engine.encode(t).unwrap()).collect();
    drop(engine);
    let want = reference(&model, &ps, 24);
    for (p, w) in ps.iter().zip(&want) {
        let (ids, _, _) = rt
            .block_on(generate(c.router, greedy_request(p, 24)))
            .unwrap();
        assert_eq!(&ids, w);
    }
}

/// `cache_salt` isolates tenants' prefix caches on both workers: the same prompt under another
/// salt finds nothing cached, under its own salt it finds its prefix, through remote and local
/// prefill alike.
#[test]
fn cache_salt_separates_tenants_prefix_caches() {
    for threshold in [0, 100_000] {
        let c = cluster(tiny_model(), 1, 1, local_prefill_threshold(threshold));
        let p = &prompts(1)[0];
        let rt = tokio::runtime::Runtime::new().unwrap();
        let cached = |salt: &str| {
            let req = v1::GenerateRequest {
                cache_salt: salt.into(),
                ..greedy_request(p, 4)
            };
            let (ids, _, last) = rt.block_on(generate(c.router, req)).unwrap();
            (last.usage.unwrap().cached_prompt_tokens, ids)
        };
        let (first, tokens) = cached("tenant-a");
        assert_eq!(first, 0, "{threshold}: nothing is cached yet");
        let (other, other_tokens) = cached("tenant-b");
        assert_eq!(other, 0, "{threshold}: another tenant's prefix was reused");
        assert_eq!(other_tokens, tokens);
        let (again, again_tokens) = cached("tenant-a");
        assert!(
            again > 0,
            "{threshold}: the tenant's own prefix was not reused"
        );
        assert_eq!(again_tokens, tokens);
        // A salt longer than 256 bytes is refused, and nothing else is disturbed.
        let req = v1::GenerateRequest {
            cache_salt: "s".repeat(257),
            ..greedy_request(p, 4)
        };
        let err = rt.block_on(generate(c.router, req)).unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
        assert!(err.message().contains("cache_salt"), "{}", err.message());
        assert_eq!(cached("tenant-a").1, tokens);
    }
}
