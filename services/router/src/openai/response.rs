//! An answer of the OpenAI front: the core's messages written as OpenAI's bodies, whole or as
//! the chunks of a stream (text, a tool call's deltas, logprobs, usage, finish reason).

use std::time::{SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use duet_model::tokenizer::Tokenizer;
use duet_proto::v1;

use super::request::Answer;
use super::tool_stream::{ToolCallStream, whole_answer};
use super::wire::{
    ChatChoice, ChatCompletion, ChatLogprobs, ChatMessageOut, Completion, CompletionChoice,
    CompletionLogprobs, CompletionTokensDetails, PromptTokensDetails, TokenLogprob, ToolCalls,
    Usage,
};
use crate::door::finish_reason;

pub(super) fn json_event(value: &impl serde::Serialize) -> Event {
    Event::default()
        .json_data(value)
        .unwrap_or_else(|e| Event::default().data(format!("{{\"error\":\"{e}\"}}")))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Endpoint {
    Completions,
    Chat,
}

/// How one call's answer is written.
pub(super) struct Reply {
    endpoint: Endpoint,
    pub(super) answer: Answer,
    /// The core's request id (known once it answered).
    pub(super) id: String,
    created: u64,
    model: String,
    /// A streamed answer that calls a tool: its text becomes `tool_calls` deltas.
    pub(super) tool_stream: Option<ToolCallStream>,
}

impl Reply {
    pub(super) fn new(endpoint: Endpoint, answer: Answer, model: &str) -> Self {
        Self {
            endpoint,
            answer,
            model: model.to_string(),
            id: String::new(),
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            tool_stream: None,
        }
    }

    fn object_id(&self) -> String {
        match self.endpoint {
            Endpoint::Completions => format!("cmpl-{}", self.id),
            Endpoint::Chat => format!("chatcmpl-{}", self.id),
        }
    }

    /// The whole answer of a non-streaming call.
    pub(super) fn whole(&self, tokenizer: &Tokenizer, m: &v1::GenerateResponse) -> Response {
        let usage = m.usage.as_ref().map(Usage::from);
        match self.endpoint {
            Endpoint::Completions => {
                Json(self.completion(tokenizer, m, "text_completion", usage)).into_response()
            }
            Endpoint::Chat => {
                let (content, calls) = whole_answer(&self.answer.tools, &m.text, &self.id);
                let called = !calls.is_empty();
                let message = ChatMessageOut {
                    role: Some("assistant"),
                    content,
                    tool_calls: called.then_some(ToolCalls::Whole(calls)),
                };
                let answer = self.chat(tokenizer, m, "chat.completion", Some(message), None, usage);
                Json(answer.calling(called)).into_response()
            }
        }
    }

    /// One chunk of a stream: a message's text (or what it adds to a tool call), tokens'
    /// logprobs and finish reason.
    pub(super) fn chunk(&mut self, tokenizer: &Tokenizer, m: &v1::GenerateResponse) -> Event {
        match (self.endpoint, &mut self.tool_stream) {
            (Endpoint::Completions, _) => {
                json_event(&self.completion(tokenizer, m, "text_completion", None))
            }
            (Endpoint::Chat, None) => {
                let delta = ChatMessageOut {
                    role: None,
                    content: Some(m.text.clone()),
                    tool_calls: None,
                };
                json_event(&self.chat(
                    tokenizer,
                    m,
                    "chat.completion.chunk",
                    None,
                    Some(delta),
                    None,
                ))
            }
            (Endpoint::Chat, Some(tools)) => {
                let piece = tools.push(&m.text, finish_reason(m).is_some());
                let called = tools.called();
                let delta = ChatMessageOut {
                    role: None,
                    content: piece.content,
                    tool_calls: (!piece.tool_calls.is_empty())
                        .then_some(ToolCalls::Chunk(piece.tool_calls)),
                };
                let chunk = self.chat(
                    tokenizer,
                    m,
                    "chat.completion.chunk",
                    None,
                    Some(delta),
                    None,
                );
                json_event(&chunk.calling(called))
            }
        }
    }

    /// The chat stream's first chunk: the assistant's role.
    pub(super) fn role_chunk(&self) -> Option<Event> {
        (self.endpoint == Endpoint::Chat).then(|| {
            json_event(&ChatCompletion {
                id: self.object_id(),
                object: "chat.completion.chunk",
                created: self.created,
                model: self.model.clone(),
                choices: vec![ChatChoice {
                    index: 0,
                    message: None,
                    delta: Some(ChatMessageOut {
                        role: Some("assistant"),
                        // A tool call's message has no content.
                        content: self.tool_stream.is_none().then(String::new),
                        tool_calls: None,
                    }),
                    finish_reason: None,
                    logprobs: None,
                }],
                usage: None,
            })
        })
    }

    /// The chunk `stream_options.include_usage` adds before `[DONE]`: usage, no choices.
    pub(super) fn usage_chunk(&self, usage: &v1::Usage) -> Event {
        let usage = Some(Usage::from(usage));
        match self.endpoint {
            Endpoint::Completions => json_event(&Completion {
                id: self.object_id(),
                object: "text_completion",
                created: self.created,
                model: self.model.clone(),
                choices: Vec::new(),
                usage,
            }),
            Endpoint::Chat => json_event(&ChatCompletion {
                id: self.object_id(),
                object: "chat.completion.chunk",
                created: self.created,
                model: self.model.clone(),
                choices: Vec::new(),
                usage,
            }),
        }
    }

    fn completion(
        &self,
        tokenizer: &Tokenizer,
        m: &v1::GenerateResponse,
        object: &'static str,
        usage: Option<Usage>,
    ) -> Completion {
        Completion {
            id: self.object_id(),
            object,
            created: self.created,
            model: self.model.clone(),
            choices: vec![CompletionChoice {
                index: 0,
                text: m.text.clone(),
                finish_reason: finish_reason(m),
                logprobs: self
                    .answer
                    .top_logprobs
                    .map(|top| CompletionLogprobs::new(tokenizer, &m.logprobs, top)),
            }],
            usage,
        }
    }

    fn chat(
        &self,
        tokenizer: &Tokenizer,
        m: &v1::GenerateResponse,
        object: &'static str,
        message: Option<ChatMessageOut>,
        delta: Option<ChatMessageOut>,
        usage: Option<Usage>,
    ) -> ChatCompletion {
        ChatCompletion {
            id: self.object_id(),
            object,
            created: self.created,
            model: self.model.clone(),
            choices: vec![ChatChoice {
                index: 0,
                message,
                delta,
                finish_reason: finish_reason(m),
                logprobs: self
                    .answer
                    .top_logprobs
                    .map(|top| ChatLogprobs::new(tokenizer, &m.logprobs, top)),
            }],
            usage,
        }
    }
}

impl From<&v1::Usage> for Usage {
    fn from(u: &v1::Usage) -> Self {
        Usage {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            total_tokens: u.prompt_tokens + u.completion_tokens,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: u.cached_prompt_tokens,
            },
            completion_tokens_details: CompletionTokensDetails {
                accepted_prediction_tokens: u.accepted_draft_tokens,
                rejected_prediction_tokens: u.draft_tokens.saturating_sub(u.accepted_draft_tokens),
                decode_steps: u.decode_steps,
            },
        }
    }
}

impl CompletionLogprobs {
    pub fn new(tokenizer: &Tokenizer, logprobs: &[v1::TokenLogprobs], top: u32) -> Self {
        let mut out = Self::default();
        for l in logprobs {
            out.tokens.push(token_text(tokenizer, l.token_id));
            out.token_logprobs.push(l.logprob);
            out.top_logprobs.push(
                l.top
                    .iter()
                    .take(top as usize)
                    .map(|t| (token_text(tokenizer, t.token_id), t.logprob.into()))
                    .collect(),
            );
        }
        out
    }
}

impl ChatLogprobs {
    pub fn new(tokenizer: &Tokenizer, logprobs: &[v1::TokenLogprobs], top: u32) -> Self {
        let entry = |id: u32, logprob: f32, top_logprobs| TokenLogprob {
            token: token_text(tokenizer, id),
            bytes: tokenizer.token_bytes(id).unwrap_or_default(),
            logprob,
            top_logprobs,
        };
        ChatLogprobs {
            content: logprobs
                .iter()
                .map(|l| {
                    let alternatives = l
                        .top
                        .iter()
                        .take(top as usize)
                        .map(|t| entry(t.token_id, t.logprob, None))
                        .collect();
                    entry(l.token_id, l.logprob, Some(alternatives))
                })
                .collect(),
        }
    }
}

/// A token's text on its own (special tokens included, as OpenAI shows them).
fn token_text(tokenizer: &Tokenizer, id: u32) -> String {
    tokenizer.decode(&[id], false).unwrap_or_default()
}

impl ChatCompletion {
    /// An answer that `called` a tool finishes with `tool_calls` where it would have stopped.
    pub fn calling(mut self, called: bool) -> Self {
        for choice in &mut self.choices {
            if called && choice.finish_reason == Some("stop") {
                choice.finish_reason = Some("tool_calls");
            }
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The usage reports speculative decoding's drafts in OpenAI's predicted-output fields.
    #[test]
    fn usage_reports_the_drafts() {
        let usage = Usage::from(&v1::Usage {
            prompt_tokens: 5,
            completion_tokens: 9,
            decode_steps: 4,
            draft_tokens: 8,
            accepted_draft_tokens: 5,
            ..Default::default()
        });
        let json = serde_json::to_value(&usage).unwrap();
        assert_eq!(
            json["completion_tokens_details"],
            serde_json::json!({
                "accepted_prediction_tokens": 5,
                "rejected_prediction_tokens": 3,
                "decode_steps": 4
            })
        );
    }
}
