//! Traces in the Mooncake format, as Mooncake publishes its traces and AIPerf replays them: one
//! JSON object a line, `timestamp` in milliseconds from the trace's start, `input_length` and
//! `output_length` in tokens, and `hash_ids`, one id per [`MOONCAKE_BLOCK_TOKENS`] tokens of the
//! prompt, equal where prompts share that block and everything before it.
//!
//! A prompt is made of tokens drawn from its blocks' ids, so prompts that share leading ids share
//! their leading tokens, and a prefix cache finds them as it would the trace's own.

use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::time::Duration;

use serde::Deserialize;

use crate::PlannerError;
use crate::workload::{Job, Prompt, synthetic_token};

/// Tokens per `hash_ids` block in Mooncake's traces.
pub const MOONCAKE_BLOCK_TOKENS: usize = 512;

/// One line of a trace.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct TraceRecord {
    /// Milliseconds from the trace's start.
    pub timestamp: f64,
    pub input_length: usize,
    pub output_length: usize,
    #[serde(default)]
    pub hash_ids: Vec<u64>,
}

/// Reads a trace line by line into jobs; each problem names the file, the line and the field.
pub struct TraceReader<R> {
    lines: std::io::Lines<R>,
    name: String,
    line: usize,
    last_ms: f64,
    jobs: usize,
}

impl<R: BufRead> TraceReader<R> {
    /// `name` is how errors call the source (its path).
    pub fn new(reader: R, name: impl Into<String>) -> Self {
        Self {
            lines: reader.lines(),
            name: name.into(),
            line: 0,
            last_ms: 0.0,
            jobs: 0,
        }
    }

    fn bad(&self, why: impl std::fmt::Display) -> PlannerError {
        PlannerError::Trace(format!("{}:{}: {why}", self.name, self.line))
    }

    fn job(&mut self, text: &str) -> Result<Job, PlannerError> {
        let r: TraceRecord =
            serde_json::from_str(text).map_err(|e| self.bad(format!("not a trace line: {e}")))?;
        if !(r.timestamp.is_finite() && r.timestamp >= 0.0) {
            return Err(self.bad(format!(
                "`timestamp` is {}: milliseconds from the trace's start, at least 0",
                r.timestamp
            )));
        }
        if r.timestamp < self.last_ms {
            return Err(self.bad(format!(
                "`timestamp` {} comes before the previous line's {} (a trace is in time order)",
                r.timestamp, self.last_ms
            )));
        }
        if r.input_length == 0 {
            return Err(self.bad("`input_length` is 0: a prompt has at least one token"));
        }
        if r.output_length == 0 {
            return Err(self.bad("`output_length` is 0: a request generates at least one token"));
        }
        let blocks = r.input_length.div_ceil(MOONCAKE_BLOCK_TOKENS);
        if r.hash_ids.len() > blocks {
            return Err(self.bad(format!(
                "`hash_ids` has {} ids, but `input_length` {} fills only {blocks} blocks of \
                 {MOONCAKE_BLOCK_TOKENS} tokens",
                r.hash_ids.len(),
                r.input_length
            )));
        }
        let max_tokens = u32::try_from(r.output_length)
            .map_err(|_| self.bad(format!("`output_length` {} is too large", r.output_length)))?;
        self.last_ms = r.timestamp;
        let mut prompt = Vec::with_capacity(r.input_length);
        for b in 0..blocks {
            // A block without an id is this line's own.
            let id = match r.hash_ids.get(b) {
                Some(&id) => block_seed(id),
                None => block_seed(u64::MAX ^ (((self.line as u64) << 20) | b as u64)),
            };
            let n = MOONCAKE_BLOCK_TOKENS.min(r.input_length - b * MOONCAKE_BLOCK_TOKENS);
            prompt.extend(
                (0..n as u64)
                    .map(|j| synthetic_token(mix(id ^ j.wrapping_mul(0x9E37_79B9_7F4A_7C15)))),
            );
        }
        Ok(Job {
            prompt: Prompt::Tokens(prompt),
            max_tokens,
            follow_ups: Vec::new(),
            at: Some(Duration::from_secs_f64(r.timestamp / 1e3)),
        })
    }
}

impl<R: BufRead> Iterator for TraceReader<R> {
    type Item = Result<Job, PlannerError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            self.line += 1;
            let text = match self.lines.next() {
                None if self.jobs == 0 => {
                    self.jobs = 1; // said once
                    return Some(Err(PlannerError::Trace(format!(
                        "{} holds no requests",
                        self.name
                    ))));
                }
                None => return None,
                Some(Err(e)) => return Some(Err(self.bad(e))),
                Some(Ok(t)) => t,
            };
            if text.trim().is_empty() {
                continue;
            }
            self.jobs += 1;
            return Some(self.job(&text));
        }
    }
}

/// A block's seed from its trace id.
fn block_seed(id: u64) -> u64 {
    mix(id.wrapping_add(0xD1B5_4A32_D192_ED03))
}

/// SplitMix64's finaliser: 64 well-mixed bits from any 64.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Writes requests as a trace: `(sent at, prompt, output tokens)` in time order. Each block of
/// [`MOONCAKE_BLOCK_TOKENS`] prompt tokens gets the id of its content and of everything before
/// it, so prompts sharing a prefix share its ids.
pub struct TraceWriter<W> {
    out: W,
    ids: HashMap<u64, u64>,
}

impl<W: Write> TraceWriter<W> {
    pub fn new(out: W) -> Self {
        Self {
            out,
            ids: HashMap::new(),
        }
    }

    pub fn write(
        &mut self,
        at: Duration,
        prompt: &[u32],
        output_tokens: u32,
    ) -> std::io::Result<()> {
        let mut chain = 0u64;
        let hash_ids: Vec<u64> = prompt
            .chunks(MOONCAKE_BLOCK_TOKENS)
            .map(|block| {
                chain =
                    block.iter().fold(
                        mix(chain ^ 0x5851_F42D_4C95_7F2D),
                        |h, &t| mix(h ^ t as u64),
                    );
                let next = self.ids.len() as u64;
                *self.ids.entry(chain).or_insert(next)
            })
            .collect();
        // Whole milliseconds, as Mooncake's traces have them.
        let record = serde_json::json!({
            "timestamp": at.as_millis() as u64,
            "input_length": prompt.len(),
            "output_length": output_tokens,
            "hash_ids": hash_ids,
        });
        serde_json::to_writer(&mut self.out, &record)?;
        self.out.write_all(b"\n")
    }

    pub fn finish(mut self) -> std::io::Result<W> {
        self.out.flush()?;
        Ok(self.out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(text: &str) -> Vec<Result<Job, PlannerError>> {
        TraceReader::new(text.as_bytes(), "t.jsonl").collect()
    }

    fn tokens(job: &Job) -> &[u32] {
        match &job.prompt {
            Prompt::Tokens(t) => t,
            Prompt::Text(_) => panic!("token prompts"),
        }
    }

    #[test]
    fn shared_hash_ids_are_shared_tokens_and_timestamps_are_seconds() {
        let jobs: Vec<Job> = read(concat!(
            r#"{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]}"#,
            "\n\n",
            r#"{"timestamp": 1500, "input_length": 700, "output_length": 9, "hash_ids": [1, 7]}"#,
            "\n",
        ))
        .into_iter()
        .map(Result::unwrap)
        .collect();
        assert_eq!(jobs.len(), 2);
        let (a, b) = (tokens(&jobs[0]), tokens(&jobs[1]));
        assert_eq!((a.len(), b.len()), (1100, 700));
        assert_eq!(a[..512], b[..512], "block 1 is shared");
        assert_ne!(a[512..700], b[512..700], "blocks 2 and 7 differ");
        assert_eq!(jobs[1].at, Some(Duration::from_millis(1500)));
        assert_eq!(jobs[1].max_tokens, 9);
    }

    #[test]
    fn a_bad_line_is_named_with_its_field() {
        let cases = [
            (
                r#"{"timestamp": 0, "output_length": 5}"#,
                "t.jsonl:1: not a trace line: missing field `input_length`",
            ),
            (
                r#"{"timestamp": 0, "input_length": 0, "output_length": 5}"#,
                "t.jsonl:1: `input_length` is 0",
            ),
            (
                r#"{"timestamp": -3, "input_length": 9, "output_length": 5}"#,
                "t.jsonl:1: `timestamp` is -3",
            ),
            (
                r#"{"timestamp": 0, "input_length": 9, "output_length": 5, "hash_ids": [1, 2]}"#,
                "t.jsonl:1: `hash_ids` has 2 ids",
            ),
            ("not json", "t.jsonl:1: not a trace line"),
        ];
        for (line, want) in cases {
            let err = read(line).remove(0).unwrap_err().to_string();
            assert!(err.contains(want), "{err} does not say {want}");
        }
        let out_of_order = concat!(
            r#"{"timestamp": 9, "input_length": 9, "output_length": 5}"#,
            "\n",
            r#"{"timestamp": 3, "input_length": 9, "output_length": 5}"#
        );
        let err = read(out_of_order).remove(1).unwrap_err().to_string();
        assert!(
            err.contains("t.jsonl:2: `timestamp` 3 comes before"),
            "{err}"
        );
        let err = read("\n").remove(0).unwrap_err().to_string();
        assert!(err.contains("holds no requests"), "{err}");
    }

    #[test]
    fn a_written_trace_reads_back_with_its_sharing() {
        let shared: Vec<u32> = (0..600).collect();
        let mut other = shared.clone();
        other[520] = 7;
        let mut w = TraceWriter::new(Vec::new());
        w.write(Duration::from_millis(10), &shared, 4).unwrap();
        w.write(Duration::from_millis(20), &other, 4).unwrap();
        let text = String::from_utf8(w.finish().unwrap()).unwrap();
        let records: Vec<TraceRecord> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(records[0].hash_ids, [0, 1]);
        assert_eq!(records[1].hash_ids, [0, 2]);
        let jobs: Vec<Job> = read(&text).into_iter().map(Result::unwrap).collect();
        assert_eq!(tokens(&jobs[0])[..512], tokens(&jobs[1])[..512]);
    }
}
