//! Speculative decoding's proposer: n-gram (prompt-lookup) drafts, and how many tokens to draft
//! for a sequence given how its drafts have fared.
//!
//! A decoding sequence's last `n` tokens are looked up among its earlier tokens (prompt and
//! output); the tokens that followed the most recent earlier occurrence are the draft. The engine
//! computes the draft alongside the sequence's next token in one forward step and keeps the
//! drafted tokens the model itself samples (see `Engine::step_with`): output is what decoding one
//! token per step gives, and a step yields from 1 to `draft + 1` tokens.
//!
//! Drafting costs rows in the step whether or not they are accepted, so each sequence's draft
//! length follows its acceptance ([`DraftLength`]): it grows while drafts are accepted whole,
//! shrinks to what was accepted, and after drafts rejected at their first token, drafting pauses
//! for a number of steps that doubles with each such miss. Text with nothing to copy (free chat)
//! then costs almost nothing, and text that copies spans (code edits, summaries, RAG answers)
//! drafts at full length.

/// Which drafts the decode steps compute: `off`, `ngram` or `draft:<model>` (a GGUF file or HF
/// directory).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum SpeculativeMode {
    /// One token per sequence per step.
    #[default]
    Off,
    /// Drafts copied from earlier occurrences of the sequence's last tokens (prompt lookup).
    Ngram,
    /// Drafts are the greedy continuation of a smaller model of the same tokenizer, run beside
    /// the target (see `draft_model`).
    Draft(std::path::PathBuf),
}

impl std::fmt::Display for SpeculativeMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SpeculativeMode::Off => f.write_str("off"),
            SpeculativeMode::Ngram => f.write_str("ngram"),
            SpeculativeMode::Draft(path) => write!(f, "draft:{}", path.display()),
        }
    }
}

impl std::str::FromStr for SpeculativeMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "off" => Ok(SpeculativeMode::Off),
            "ngram" => Ok(SpeculativeMode::Ngram),
            _ => match s.strip_prefix("draft:") {
                Some("") => Err(
                    "draft: needs the draft model's path, as in draft:/models/small.gguf".into(),
                ),
                Some(path) => Ok(SpeculativeMode::Draft(path.into())),
                None => Err(format!(
                    "{s:?} is not a speculative mode: off, ngram or draft:<model path>"
                )),
            },
        }
    }
}

/// Proposes drafts by prompt lookup: the longest suffix of `max_ngram` down to `min_ngram`
/// tokens that occurred earlier, continued as it was the last time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NgramSpeculator {
    pub min_ngram: usize,
    pub max_ngram: usize,
}

impl Default for NgramSpeculator {
    /// Suffixes of 4 down to 2 tokens: one token matches too often by chance (a draft that is
    /// then rejected costs its rows), and longer suffixes rarely match where shorter ones fail.
    fn default() -> Self {
        Self {
            min_ngram: 2,
            max_ngram: 4,
        }
    }
}

impl NgramSpeculator {
    /// Up to `max_len` tokens that followed the most recent earlier occurrence of `tokens`' last
    /// n-gram (the longest that occurred); empty when none did.
    pub fn propose(&self, tokens: &[u32], max_len: usize) -> Vec<u32> {
        if max_len == 0 {
            return Vec::new();
        }
        for n in (self.min_ngram.max(1)..=self.max_ngram).rev() {
            if tokens.len() <= n {
                continue;
            }
            let suffix_start = tokens.len() - n;
            let suffix = &tokens[suffix_start..];
            // The most recent earlier occurrence: starts before the suffix itself.
            if let Some(start) = (0..suffix_start)
                .rev()
                .find(|&i| &tokens[i..i + n] == suffix)
            {
                let from = start + n;
                let to = (from + max_len).min(tokens.len());
                return tokens[from..to].to_vec();
            }
        }
        Vec::new()
    }
}

/// How many tokens to draft for one sequence, adapted to how its drafts fare.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DraftLength {
    max: usize,
    current: usize,
    /// Steps left without drafting.
    paused: u32,
    /// Drafts rejected at their first token in a row.
    misses: u32,
}

/// The longest pause after drafts rejected at their first token, in steps.
const MAX_PAUSE_STEPS: u32 = 64;

impl DraftLength {
    /// Starts at `max` (a sequence that copies should not have to earn its draft length).
    pub fn new(max: usize) -> Self {
        Self {
            max,
            current: max,
            paused: 0,
            misses: 0,
        }
    }

    /// Tokens to draft this step (0: none); called once per decode step.
    pub fn for_step(&mut self) -> usize {
        if self.paused > 0 {
            self.paused -= 1;
            return 0;
        }
        self.current
    }

    /// Records that `accepted` of `drafted` (> 0) tokens were accepted.
    pub fn verified(&mut self, drafted: usize, accepted: usize) {
        if accepted >= drafted {
            self.misses = 0;
            self.current = (self.current * 2).clamp(1, self.max);
        } else if accepted > 0 {
            self.misses = 0;
            self.current = (accepted + 1).min(self.max);
        } else {
            self.misses += 1;
            self.current = 1.min(self.max);
            self.paused = (1u32 << self.misses.min(6)).min(MAX_PAUSE_STEPS) - 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_from_the_flag_and_print_back() {
        for text in ["off", "ngram", "draft:/models/small model.gguf"] {
            let mode: SpeculativeMode = text.parse().unwrap();
            assert_eq!(mode.to_string(), text);
        }
        assert_eq!(
            "draft:m.gguf".parse(),
            Ok(SpeculativeMode::Draft("m.gguf".into()))
        );
        let err = "draft:".parse::<SpeculativeMode>().unwrap_err();
        assert!(err.contains("path"), "{err}");
        let err = "eagle".parse::<SpeculativeMode>().unwrap_err();
        assert!(err.contains("off, ngram or draft:"), "{err}");
    }

    #[test]
    fn a_repeated_span_is_continued_from_its_most_recent_occurrence() {
        let s = NgramSpeculator::default();
        // "1 2 3 4 5 ... 1 2 3" → the continuation after the earlier "1 2 3" is "4 5".
        let tokens = [9, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3];
        assert_eq!(s.propose(&tokens, 3), [4, 5, 6]);
        assert_eq!(s.propose(&tokens, 10), [4, 5, 6, 7, 1, 2, 3]);
        // The most recent occurrence wins.
        let tokens = [1, 2, 8, 8, 1, 2, 9, 9, 1, 2];
        assert_eq!(s.propose(&tokens, 2), [9, 9]);
    }

    #[test]
    fn the_longest_matching_suffix_is_used() {
        let s = NgramSpeculator::default();
        // The bigram "5 6" last occurred before 7, but the trigram "4 5 6" before 1.
        let tokens = [4, 5, 6, 1, 0, 5, 6, 7, 0, 4, 5, 6];
        assert_eq!(s.propose(&tokens, 1), [1]);
    }

    #[test]
    fn nothing_to_copy_proposes_nothing() {
        let s = NgramSpeculator::default();
        assert!(s.propose(&[1, 2, 3, 4, 5, 6], 4).is_empty());
        // A single repeated token is below the minimum n-gram.
        assert!(s.propose(&[1, 2, 3, 1], 4).is_empty());
        assert!(s.propose(&[], 4).is_empty());
        assert!(s.propose(&[1, 2, 1, 2], 0).is_empty());
        // An overlapping occurrence: "7 7" is continued by the run itself.
        assert_eq!(s.propose(&[7, 7, 7], 4), [7]);
    }

    #[test]
    fn draft_length_grows_on_acceptance_and_shrinks_to_it() {
        let mut d = DraftLength::new(8);
        assert_eq!(d.for_step(), 8);
        d.verified(8, 3);
        assert_eq!(d.for_step(), 4);
        d.verified(4, 4);
        assert_eq!(d.for_step(), 8);
        d.verified(8, 8);
        assert_eq!(d.for_step(), 8, "capped at the maximum");
    }

    #[test]
    fn drafts_rejected_at_once_pause_drafting_longer_each_time() {
        let mut d = DraftLength::new(4);
        // The steps skipped before drafting again, and the length drafted then.
        let resume = |d: &mut DraftLength| {
            let mut skipped = 0;
            loop {
                match d.for_step() {
                    0 => skipped += 1,
                    len => return (skipped, len),
                }
            }
        };
        assert_eq!(d.for_step(), 4);
        d.verified(4, 0);
        let mut pauses = Vec::new();
        for _ in 0..8 {
            let (skipped, len) = resume(&mut d);
            assert_eq!(len, 1, "after a miss, one token is drafted");
            pauses.push(skipped);
            d.verified(1, 0);
        }
        assert_eq!(pauses, [1, 3, 7, 15, 31, 63, 63, 63]);
        // One accepted draft ends the streak.
        assert_eq!(resume(&mut d), (63, 1));
        d.verified(1, 1);
        assert_eq!(d.for_step(), 2);
        d.verified(2, 0);
        assert_eq!(resume(&mut d), (1, 1), "paused as after a first miss");
    }
}
