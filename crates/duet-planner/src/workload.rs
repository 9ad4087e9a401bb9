//! What a run sends: jobs (a prompt, the tokens to generate, and a conversation's later
//! questions), drawn from a seed as `duet bench serve` draws them, so that a simulated run and
//! a measured one of the same flags send the same prompts.

use std::time::Duration;

use serde::Serialize;

/// `N` or `A..B` (inclusive) tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Range {
    pub min: usize,
    pub max: usize,
}

impl Range {
    /// The midpoint.
    pub fn mean(&self) -> f64 {
        (self.min + self.max) as f64 / 2.0
    }
}

impl std::str::FromStr for Range {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let parse = |v: &str| {
            v.trim()
                .parse::<usize>()
                .map_err(|_| format!("`{s}` is not N or A..B"))
        };
        let r = match s.split_once("..") {
            Some((a, b)) => Range {
                min: parse(a)?,
                max: parse(b)?,
            },
            None => {
                let n = parse(s)?;
                Range { min: n, max: n }
            }
        };
        if r.min == 0 || r.min > r.max {
            return Err(format!("`{s}`: lengths must be positive and A <= B"));
        }
        Ok(r)
    }
}

impl std::fmt::Display for Range {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.min == self.max {
            true => write!(f, "{}", self.min),
            false => write!(f, "{}..{}", self.min, self.max),
        }
    }
}

/// A prompt: text (the router tokenizes it) or token ids.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// One request of the workload, or the first of a conversation's.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Job {
    pub prompt: Prompt,
    pub max_tokens: u32,
    /// The conversation's later questions: each turn's prompt is the previous turn's prompt, its
    /// answer and the next question.
    pub follow_ups: Vec<Vec<u32>>,
    /// When it is sent, from the run's start, where its source says (a trace).
    pub at: Option<Duration>,
}

/// The seeded generator of synthetic token ids and lengths (xorshift64).
pub struct TokenSource(u64);

impl TokenSource {
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        let x = &mut self.0;
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        *x
    }

    /// A length drawn uniformly from `r`.
    pub fn pick(&mut self, r: &Range) -> usize {
        r.min + (self.next_u64() % (r.max - r.min + 1) as u64) as usize
    }

    /// `n` token ids, drawn for a large vocabulary (a client folds them into its model's).
    pub fn tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| synthetic_token(self.next_u64())).collect()
    }
}

/// A token id from 64 random bits: 300 and up, within a 40,000-token vocabulary.
pub fn synthetic_token(bits: u64) -> u32 {
    300 + (bits % 40_000) as u32
}

/// `requests` distinct random prompts of `prompt` tokens, each generating `output` tokens, in
/// the order `duet bench serve` sends them (no prefix cache can help).
pub fn random_jobs(
    seed: u64,
    requests: usize,
    prompt: Range,
    output: Range,
) -> impl Iterator<Item = Job> {
    let mut source = TokenSource::new(seed);
    (0..requests).map(move |_| {
        let n = source.pick(&prompt);
        let out = source.pick(&output) as u32;
        Job {
            prompt: Prompt::Tokens(source.tokens(n)),
            max_tokens: out,
            follow_ups: Vec::new(),
            at: None,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_parse_and_refuse_what_is_no_length() {
        assert_eq!("64".parse::<Range>(), Ok(Range { min: 64, max: 64 }));
        assert_eq!("8..16".parse::<Range>(), Ok(Range { min: 8, max: 16 }));
        assert!("0".parse::<Range>().is_err());
        assert!("9..3".parse::<Range>().is_err());
        assert_eq!("8..16".parse::<Range>().unwrap().to_string(), "8..16");
    }

    #[test]
    fn random_jobs_are_reproducible_and_within_their_ranges() {
        let r = |a, b| Range { min: a, max: b };
        let a: Vec<Job> = random_jobs(5, 50, r(10, 20), r(3, 4)).collect();
        let b: Vec<Job> = random_jobs(5, 50, r(10, 20), r(3, 4)).collect();
        assert_eq!(a, b);
        for j in &a {
            let Prompt::Tokens(t) = &j.prompt else {
                panic!("token prompts")
            };
            assert!((10..=20).contains(&t.len()) && (3..=4).contains(&j.max_tokens));
            assert!(t.iter().all(|&x| (300..40_300).contains(&x)));
        }
    }
}
