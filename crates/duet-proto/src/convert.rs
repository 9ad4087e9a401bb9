//! Conversions between the worker protocol's messages and the model's request types, in one
//! place: chat messages, sampling parameters and stop criteria, sampled tokens with their
//! log-probabilities, and finish reasons.

use duet_model::chat::{ChatMessage, ChatToolCall};
use duet_model::params::{
    Constraint, FinishReason, Logprobs, Sampled, SamplingParams, StopCriteria,
};

use crate::v1;

/// A receiver treats the protocol's 0 as "off" for the parameters whose off value is 1.
fn zero_means_one(v: f32) -> f32 {
    if v == 0.0 { 1.0 } else { v }
}

impl From<&v1::ChatMessage> for ChatMessage {
    fn from(m: &v1::ChatMessage) -> Self {
        Self {
            role: m.role.clone(),
            content: m.content.clone(),
            tool_calls: m
                .tool_calls
                .iter()
                .map(|c| ChatToolCall {
                    id: c.id.clone(),
                    name: c.name.clone(),
                    arguments: c.arguments.clone(),
                })
                .collect(),
            tool_call_id: Some(&m.tool_call_id).filter(|id| !id.is_empty()).cloned(),
        }
    }
}

impl From<&v1::SamplingParams> for SamplingParams {
    fn from(p: &v1::SamplingParams) -> Self {
        SamplingParams {
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: zero_means_one(p.top_p),
            min_p: p.min_p,
            repetition_penalty: zero_means_one(p.repetition_penalty),
            presence_penalty: p.presence_penalty,
            frequency_penalty: p.frequency_penalty,
            seed: p.seed,
            logprobs: p.logprobs,
            constraint: p.constraint.as_ref().and_then(constraint_from_wire),
            speculative: p.speculative,
        }
    }
}

/// The constraint a message names; `None` for a message with no kind set.
pub fn constraint_from_wire(c: &v1::Constraint) -> Option<Constraint> {
    use v1::constraint::Kind;
    Some(match c.kind.as_ref()? {
        Kind::JsonSchema(s) => Constraint::JsonSchema(s.clone()),
        Kind::JsonObject(_) => Constraint::JsonObject,
        Kind::Regex(r) => Constraint::Regex(r.clone()),
        Kind::Lark(l) => Constraint::Lark(l.clone()),
    })
}

impl From<&Constraint> for v1::Constraint {
    fn from(c: &Constraint) -> Self {
        use v1::constraint::Kind;
        let kind = match c {
            Constraint::JsonSchema(s) => Kind::JsonSchema(s.clone()),
            Constraint::JsonObject => Kind::JsonObject(true),
            Constraint::Regex(r) => Kind::Regex(r.clone()),
            Constraint::Lark(l) => Kind::Lark(l.clone()),
        };
        v1::Constraint { kind: Some(kind) }
    }
}

impl From<&v1::SamplingParams> for StopCriteria {
    fn from(p: &v1::SamplingParams) -> Self {
        StopCriteria {
            max_tokens: p.max_tokens as usize,
            stop_token_ids: p.stop_token_ids.clone(),
            stop_strings: p.stop.clone(),
            ignore_eos: p.ignore_eos,
        }
    }
}

/// The protocol's parameters of a validated request: every field resolved, the seed included.
impl From<(&SamplingParams, &StopCriteria, u64)> for v1::SamplingParams {
    fn from((p, stop, seed): (&SamplingParams, &StopCriteria, u64)) -> Self {
        v1::SamplingParams {
            temperature: p.temperature,
            top_p: p.top_p,
            top_k: p.top_k,
            min_p: p.min_p,
            repetition_penalty: p.repetition_penalty,
            presence_penalty: p.presence_penalty,
            frequency_penalty: p.frequency_penalty,
            seed: Some(seed),
            logprobs: p.logprobs,
            max_tokens: stop.max_tokens as u32,
            stop: stop.stop_strings.clone(),
            stop_token_ids: stop.stop_token_ids.clone(),
            ignore_eos: stop.ignore_eos,
            constraint: p.constraint.as_ref().map(v1::Constraint::from),
            speculative: p.speculative,
        }
    }
}

/// A sampled token; its log-probabilities are zero when none were asked for.
impl From<&Sampled> for v1::TokenLogprobs {
    fn from(s: &Sampled) -> Self {
        match &s.logprobs {
            Some(Logprobs { logprob, top }) => v1::TokenLogprobs {
                token_id: s.token,
                logprob: *logprob,
                top: top
                    .iter()
                    .map(|&(token_id, logprob)| v1::TokenLogprob { token_id, logprob })
                    .collect(),
            },
            None => v1::TokenLogprobs {
                token_id: s.token,
                ..Default::default()
            },
        }
    }
}

/// A token sampled elsewhere (the prefill worker's first token), with its log-probabilities when
/// `with_logprobs` (the message cannot tell "none asked for" from zeros).
pub fn sampled(t: &v1::TokenLogprobs, with_logprobs: bool) -> Sampled {
    Sampled {
        token: t.token_id,
        logprobs: with_logprobs.then(|| Logprobs {
            logprob: t.logprob,
            top: t.top.iter().map(|a| (a.token_id, a.logprob)).collect(),
        }),
    }
}

impl From<FinishReason> for v1::FinishReason {
    fn from(r: FinishReason) -> Self {
        match r {
            FinishReason::Stop => v1::FinishReason::Stop,
            FinishReason::Length => v1::FinishReason::Length,
            FinishReason::Error => v1::FinishReason::Error,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_means_off_for_top_p_and_repetition_penalty() {
        let p = SamplingParams::from(&v1::SamplingParams {
            temperature: 0.0,
            seed: Some(7),
            max_tokens: 3,
            ..Default::default()
        });
        assert_eq!((p.top_p, p.repetition_penalty), (1.0, 1.0));
        assert_eq!(p.seed, Some(7));
        assert!(p.validate().is_ok());
    }

    #[test]
    fn parameters_round_trip() {
        let p = SamplingParams {
            temperature: 0.7,
            top_k: 5,
            top_p: 0.9,
            min_p: 0.1,
            repetition_penalty: 1.2,
            presence_penalty: -1.0,
            frequency_penalty: 0.5,
            seed: Some(11),
            logprobs: 3,
            constraint: Some(Constraint::Regex("[a-z]+".into())),
            speculative: false,
        };
        let stop = StopCriteria {
            max_tokens: 9,
            stop_token_ids: vec![2, 3],
            stop_strings: vec!["\n\n".into()],
            ignore_eos: true,
        };
        let wire = v1::SamplingParams::from((&p, &stop, 11));
        assert_eq!(SamplingParams::from(&wire), p);
        assert_eq!(StopCriteria::from(&wire), stop);
        for c in [
            Constraint::JsonSchema("{}".into()),
            Constraint::JsonObject,
            Constraint::Lark("start: \"a\"".into()),
        ] {
            let p = SamplingParams {
                constraint: Some(c),
                ..p.clone()
            };
            let wire = v1::SamplingParams::from((&p, &stop, 11));
            assert_eq!(SamplingParams::from(&wire), p);
        }
    }

    #[test]
    fn sampled_tokens_round_trip() {
        let s = Sampled {
            token: 42,
            logprobs: Some(Logprobs {
                logprob: -0.5,
                top: vec![(42, -0.5), (7, -1.5)],
            }),
        };
        let wire = v1::TokenLogprobs::from(&s);
        assert_eq!(sampled(&wire, true), s);
        let bare = sampled(&wire, false);
        assert_eq!((bare.token, bare.logprobs), (42, None));
        assert_eq!(
            v1::FinishReason::from(FinishReason::Length),
            v1::FinishReason::Length
        );
    }
}
