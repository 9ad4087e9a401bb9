//! Cheap checks before expensive work: prompts near the router's byte limit are tokenized off
//! its async threads, so the streams of running requests go on meanwhile, and a prompt past the
//! limit is refused by its length alone, with a message naming the limit.

use std::time::{Duration, Instant};

use duet_proto::v1;
use duet_tests::*;
use futures::StreamExt;

use crate::one_at_a_time;

/// `--max-prompt-bytes` of the test's router: far more than the context (8192 tokens) holds,
/// so that tokenizing a prompt near it takes long enough to see a stall.
const LIMIT: usize = 1 << 20;

/// About `bytes` bytes of words (what a long document tokenizes like).
fn text(bytes: usize, salt: usize) -> String {
    const WORDS: [&str; 8] = [
        "serving", "tokens", "prefill", "decode", "cache", "router", "stream", "worker",
    ];
    let mut s = String::with_capacity(bytes + 16);
    let mut i = salt;
    while s.len() < bytes {
        s.push_str(WORDS[(i * 7919) % WORDS.len()]);
        s.push_str(if i.is_multiple_of(13) { ".\n" } else { " " });
        i += 1;
    }
    s.truncate(bytes);
    s
}

/// On the default model, whose decode steps are slow enough to see a stream's gaps.
#[test]
fn a_near_limit_prompt_does_not_stall_other_streams() {
    let _alone = one_at_a_time();
    let model = checkout_default_model();
    let c = cluster(
        model,
        0,
        1,
        RoutingOptions {
            max_prompt_bytes: Some(LIMIT),
            ..Default::default()
        },
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut req = greedy_request(&[1, 504, 3326, 314, 253, 1524], 4000);
        req.ignore_eos = true;
        let mut stream = client(c.router)
            .await
            .generate(req)
            .await
            .unwrap()
            .into_inner();
        stream.next().await.unwrap().unwrap();
        // The running stream's message times, until the long prompts are answered.
        let (stop_tx, mut stop_rx) = tokio::sync::oneshot::channel::<()>();
        let arrivals = tokio::spawn(async move {
            let mut at = vec![Instant::now()];
            loop {
                tokio::select! {
                    _ = &mut stop_rx => return at,
                    msg = stream.next() => {
                        msg.expect("the stream runs on").expect("the stream runs on");
                        at.push(Instant::now());
                    }
                }
            }
        });
        tokio::time::sleep(Duration::from_millis(500)).await;

        // Twice as many near-limit prompts as tokenizing slots (one per core), and as the
        // cluster runtime's async threads: all of them would be held at once.
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let burst = (2 * cores).max(4);
        let started = Instant::now();
        let answers = futures::future::join_all((0..burst).map(|i| {
            let prompt = text(LIMIT - 64, i);
            async move {
                client(c.router)
                    .await
                    .complete(v1::GenerateRequest {
                        prompt,
                        ..Default::default()
                    })
                    .await
            }
        }))
        .await;
        let tokenizing = started.elapsed();
        stop_tx.send(()).unwrap();
        let at = arrivals.await.unwrap();
        for a in answers {
            let e = a.expect_err("near-limit prompts tokenize past the context");
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
            assert!(e.message().contains("tokens"), "{e:?}");
        }
        let longest_gap = at
            .windows(2)
            .filter(|w| w[1] > started)
            .map(|w| w[1] - w[0])
            .max()
            .expect("the stream sent messages while the prompts were tokenized");
        assert!(
            tokenizing > Duration::from_millis(300),
            "tokenizing {burst} prompts took {tokenizing:?}: too short to see a stall"
        );
        assert!(
            longest_gap < tokenizing / 4,
            "the running stream stalled {longest_gap:?} while {burst} near-limit prompts were \
             tokenized in {tokenizing:?}"
        );
        eprintln!(
            "{burst} prompts tokenized in {tokenizing:?}; longest stream gap {longest_gap:?}"
        );

        // One byte past the limit: refused by its length, without tokenizing.
        let asked = Instant::now();
        let e = client(c.router)
            .await
            .complete(v1::GenerateRequest {
                prompt: text(LIMIT + 1, 0),
                ..Default::default()
            })
            .await
            .expect_err("past the limit");
        let refused_in = asked.elapsed();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        for words in [&format!("{} bytes", LIMIT + 1), "--max-prompt-bytes"] {
            assert!(
                e.message().contains(words),
                "{:?} lacks {words:?}",
                e.message()
            );
        }
        assert!(
            refused_in < tokenizing / (2 * burst as u32),
            "refused in {refused_in:?}, about as long as tokenizing one prompt"
        );
    });
}
