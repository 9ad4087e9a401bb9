//! The shared-prefix workload of `duet bench serve --workload shared-prefix`: G groups × U users,
//! each group with one long system prompt, each user a conversation of T turns (a short question
//! per turn, appended to the previous turn's prompt and answer), and the prefix hit rate an ideal
//! cache would reach on it: one worker holding every prefix ever computed.

use std::collections::HashSet;
use std::hash::{DefaultHasher, Hash, Hasher};

use clap::Args;
use serde::Serialize;

/// The shape of the shared-prefix workload.
#[derive(Args, Clone, Debug, Serialize)]
pub struct SharedPrefixArgs {
    /// Groups, each with its own system prompt.
    #[arg(long, default_value_t = 4)]
    pub groups: usize,
    /// Users (conversations) per group.
    #[arg(long, default_value_t = 4)]
    pub users: usize,
    /// Turns per conversation: each turn's prompt is the previous turn's prompt, its answer and
    /// a new question.
    #[arg(long, default_value_t = 2)]
    pub turns: usize,
    /// Tokens of each group's system prompt.
    #[arg(long, default_value_t = 1024)]
    pub system_tokens: usize,
    /// Tokens of each question.
    #[arg(long, default_value_t = 32)]
    pub question_tokens: usize,
    /// Users take turns (closed loop): every conversation's first turn is queued, and a
    /// conversation's next turn joins the back of the queue when its answer arrives, so the other
    /// users' turns come between, as with users who read and think before they answer. Without
    /// it each client runs one conversation's turns back to back.
    #[arg(long)]
    pub interleave: bool,
}

/// One user's conversation: the first prompt (system prompt and first question), then a question
/// per later turn.
#[derive(Clone, Debug)]
pub struct Conversation {
    pub first: Vec<u32>,
    pub follow_ups: Vec<Vec<u32>>,
}

impl SharedPrefixArgs {
    /// The conversations, users of different groups interleaved (user 0 of every group, then user
    /// 1, ...) so that a group's prompts arrive spread over the run. `token` draws a token id.
    pub fn conversations(&self, token: &mut dyn FnMut() -> u32) -> Vec<Conversation> {
        let mut draw = |n: usize| (0..n).map(|_| token()).collect::<Vec<u32>>();
        let systems: Vec<Vec<u32>> = (0..self.groups).map(|_| draw(self.system_tokens)).collect();
        let mut out = Vec::with_capacity(self.groups * self.users);
        for _ in 0..self.users {
            for system in &systems {
                let mut first = system.clone();
                first.extend(draw(self.question_tokens));
                let follow_ups = (1..self.turns.max(1))
                    .map(|_| draw(self.question_tokens))
                    .collect();
                out.push(Conversation { first, follow_ups });
            }
        }
        out
    }
}

/// One request as the ideal cache sees it.
pub struct Seen<'a> {
    /// The prompt's tokens.
    pub prompt: &'a [u32],
    /// The tokens generated for it.
    pub output: &'a [u32],
}

/// Prompt tokens an ideal cache finds for each request, taken in the order they were sent: the
/// longest run of full `block_size` blocks that starts the prompt and was part of an earlier
/// request's prompt or answer, leaving at least the prompt's last token to compute (as every
/// engine must, to produce the first token).
pub fn ideal_cached_tokens(requests: &[Seen<'_>], block_size: usize) -> Vec<usize> {
    let block_size = block_size.max(1);
    let mut held: HashSet<u64> = HashSet::new();
    requests
        .iter()
        .map(|r| {
            let usable = r.prompt.len().saturating_sub(1) / block_size;
            let hit = block_hashes_of(r.prompt, block_size)
                .take(usable)
                .take_while(|h| held.contains(h))
                .count();
            let mut whole = r.prompt.to_vec();
            whole.extend_from_slice(r.output);
            held.extend(block_hashes_of(&whole, block_size));
            hit * block_size
        })
        .collect()
}

/// Chained hashes of the full blocks of `tokens`: each names its block and everything before it.
fn block_hashes_of(tokens: &[u32], block_size: usize) -> impl Iterator<Item = u64> + '_ {
    let mut chain = 0u64;
    tokens.chunks_exact(block_size).map(move |block| {
        let mut h = DefaultHasher::new();
        (chain, block).hash(&mut h);
        chain = h.finish();
        chain
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversations_share_their_group_system_prompt_and_interleave_groups() {
        let args = SharedPrefixArgs {
            groups: 3,
            users: 2,
            turns: 3,
            system_tokens: 10,
            question_tokens: 4,
            interleave: false,
        };
        let mut n = 0;
        let c = args.conversations(&mut || {
            n += 1;
            n
        });
        assert_eq!(c.len(), 6);
        for (i, conv) in c.iter().enumerate() {
            assert_eq!(conv.first.len(), 14);
            assert_eq!(conv.follow_ups.len(), 2);
            assert!(conv.follow_ups.iter().all(|q| q.len() == 4));
            // User 1 of group g shares user 0's system prompt, not its question.
            if i >= 3 {
                assert_eq!(conv.first[..10], c[i - 3].first[..10]);
                assert_ne!(conv.first[10..], c[i - 3].first[10..]);
            } else if i > 0 {
                assert_ne!(conv.first[..10], c[i - 1].first[..10]);
            }
        }
    }

    #[test]
    fn the_ideal_cache_finds_full_earlier_blocks_and_leaves_the_last_token() {
        let a: Vec<u32> = (0..40).collect();
        let answer: Vec<u32> = (100..108).collect();
        // Shares a's first 36 tokens: two full blocks of 16.
        let mut b: Vec<u32> = (0..36).collect();
        b.extend([7, 7, 7]);
        // a, its answer and more: a's 40 tokens and the answer hold three full blocks.
        let mut c = a.clone();
        c.extend(&answer);
        c.extend([1, 2, 3]);
        // Exactly a's first 32 tokens: the last token is computed, so only one block is found.
        let d: Vec<u32> = (0..32).collect();
        let seen = [
            Seen {
                prompt: &a,
                output: &answer,
            },
            Seen {
                prompt: &b,
                output: &[],
            },
            Seen {
                prompt: &c,
                output: &[],
            },
            Seen {
                prompt: &d,
                output: &[],
            },
        ];
        assert_eq!(ideal_cached_tokens(&seen, 16), [0, 32, 48, 16]);
    }
}
