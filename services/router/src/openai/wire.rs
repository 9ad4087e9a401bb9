//! OpenAI's wire format: the request and response bodies of `/v1/completions`,
//! `/v1/chat/completions`, `/v1/models`, and vLLM's `/tokenize` and `/detokenize`, and the error
//! envelope.
//! Serde types only: what a request asks of the core is read in [`super::request`], answers
//! are written in [`super::response`].

use serde::{Deserialize, Serialize};

/// `stream_options`.
#[derive(Clone, Copy, Debug, Default, Deserialize)]
pub struct StreamOptions {
    /// Send one more chunk before `[DONE]` with the request's `usage` (and no choices).
    #[serde(default)]
    pub include_usage: bool,
}

/// `stop`: one string or a list.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// `prompt` of `/v1/completions`: text or token ids, alone or in a batch (a batch must hold
/// exactly one prompt: `n` and batches are 1 here).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

/// What both endpoints share: sampling, limits, stop conditions, streaming. duet's own
/// sampling fields (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`) are accepted as vLLM
/// accepts them.
#[derive(Debug, Default, Deserialize)]
pub struct Common {
    pub model: String,
    pub max_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    pub n: Option<u32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub top_k: Option<i32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    #[serde(default)]
    pub ignore_eos: bool,
    /// Tenant isolation of the prefix cache (duet's `cache_salt`).
    #[serde(default)]
    pub cache_salt: String,
    /// Structured outputs: `text`, `json_object` or `json_schema`.
    pub response_format: Option<ResponseFormat>,
    /// A regular expression the whole answer matches (vLLM's field).
    pub guided_regex: Option<String>,
    /// A Lark grammar the answer follows (vLLM's field; llguidance's Lark dialect).
    pub guided_grammar: Option<String>,
    /// `false` opts the request out of the decode worker's speculative decoding (duet's
    /// `speculative`; the answer is the same either way).
    pub speculative: Option<bool>,
    /// A JSON answer (`response_format`, tools) may have any whitespace between its tokens
    /// (llguidance's option of that name); by default it has none.
    #[serde(default)]
    pub whitespace_flexible: bool,
    #[serde(flatten)]
    pub unserved: Unserved,
}

/// `response_format`.
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseFormat {
    Text,
    JsonObject,
    JsonSchema { json_schema: JsonSchemaFormat },
}

/// `response_format.json_schema`. duet always holds the answer to the schema; `strict` also
/// closes its objects (only the listed properties, unless the schema allows more).
#[derive(Debug, Deserialize)]
pub struct JsonSchemaFormat {
    pub name: Option<String>,
    pub schema: Option<serde_json::Value>,
    pub strict: Option<bool>,
}

/// One of a chat request's `tools`.
#[derive(Debug, Deserialize)]
pub struct Tool {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionTool,
}

#[derive(Debug, Deserialize, Serialize)]
pub struct FunctionTool {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// The arguments' JSON Schema; absent: an object with no properties.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<serde_json::Value>,
}

/// OpenAI fields duet does not serve. A request setting one to anything but its "off" value is
/// refused, naming it, rather than answered as if the field were absent (free text where JSON
/// or a tool call was asked for).
#[derive(Debug, Default, Deserialize)]
pub struct Unserved {
    pub logit_bias: Option<serde_json::Map<String, serde_json::Value>>,
    pub functions: Option<Vec<serde_json::Value>>,
    pub function_call: Option<serde_json::Value>,
    pub suffix: Option<String>,
    pub best_of: Option<u32>,
}

/// `POST /v1/completions`.
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    /// Alternatives per generated token (0..=20 here; OpenAI allows 5).
    pub logprobs: Option<u32>,
    #[serde(default)]
    pub echo: bool,
    #[serde(flatten)]
    pub common: Common,
}

/// One part of a message's content; only text parts are served.
#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: Option<Content>,
    /// The calls an assistant turn made.
    pub tool_calls: Option<Vec<MessageToolCall>>,
    /// On a `tool` turn: the call it answers.
    pub tool_call_id: Option<String>,
}

/// A call in an assistant turn of the conversation, as the answer that made it returned it.
#[derive(Debug, Deserialize)]
pub struct MessageToolCall {
    pub id: String,
    #[serde(rename = "type", default = "function_kind")]
    pub kind: String,
    pub function: MessageFunction,
}

fn function_kind() -> String {
    "function".into()
}

#[derive(Debug, Deserialize)]
pub struct MessageFunction {
    pub name: String,
    /// The arguments as JSON text.
    pub arguments: String,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    /// Newer name of `max_tokens`; wins when both are set.
    pub max_completion_tokens: Option<u32>,
    #[serde(default)]
    pub logprobs: bool,
    pub top_logprobs: Option<u32>,
    /// Extra variables for the chat template (vLLM's field; e.g. `{"enable_thinking": false}`).
    pub chat_template_kwargs: Option<serde_json::Value>,
    pub tools: Option<Vec<Tool>>,
    /// `none`, `auto`, `required` or `{"type": "function", "function": {"name": …}}`.
    pub tool_choice: Option<serde_json::Value>,
    #[serde(flatten)]
    pub common: Common,
}

/// One call in a chat answer's `tool_calls`.
#[derive(Debug, Serialize)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: CalledFunction,
}

#[derive(Debug, Serialize)]
pub struct CalledFunction {
    pub name: String,
    /// The arguments as JSON text.
    pub arguments: String,
}

/// `usage`, with the prompt tokens served from the prefix cache and what speculative decoding
/// did.
#[derive(Clone, Debug, Serialize)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    pub prompt_tokens_details: PromptTokensDetails,
    pub completion_tokens_details: CompletionTokensDetails,
}

/// Speculative decoding's drafts in OpenAI's predicted-output fields (drafted tokens the model
/// also sampled, and the others), and duet's `decode_steps` (the decode worker's steps that
/// generated the answer).
#[derive(Clone, Debug, Serialize)]
pub struct CompletionTokensDetails {
    pub accepted_prediction_tokens: u32,
    pub rejected_prediction_tokens: u32,
    pub decode_steps: u32,
}

#[derive(Clone, Debug, Serialize)]
pub struct PromptTokensDetails {
    pub cached_tokens: u32,
}

/// `logprobs` of a `/v1/completions` choice.
#[derive(Debug, Default, Serialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    pub top_logprobs: Vec<serde_json::Map<String, serde_json::Value>>,
}

/// One token as `/v1/chat/completions` reports its logprob.
#[derive(Debug, Serialize)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_logprobs: Option<Vec<TokenLogprob>>,
}

/// `logprobs` of a chat choice.
#[derive(Debug, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<TokenLogprob>,
}

#[derive(Debug, Serialize)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    pub finish_reason: Option<&'static str>,
    pub logprobs: Option<CompletionLogprobs>,
}

/// A `/v1/completions` answer, or one chunk of its stream (`object` says which).
#[derive(Debug, Serialize)]
pub struct Completion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Debug, Default, Serialize)]
pub struct ChatMessageOut {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<ToolCalls>,
}

/// A message's `tool_calls`: the whole calls of an answer, or what a chunk of a stream adds.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum ToolCalls {
    Whole(Vec<ToolCall>),
    Chunk(Vec<ToolCallChunk>),
}

#[derive(Debug, Serialize)]
pub struct ChatChoice {
    pub index: u32,
    /// The whole answer (`chat.completion`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<ChatMessageOut>,
    /// What this chunk adds (`chat.completion.chunk`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delta: Option<ChatMessageOut>,
    pub finish_reason: Option<&'static str>,
    pub logprobs: Option<ChatLogprobs>,
}

/// A `/v1/chat/completions` answer, or one chunk of its stream.
#[derive(Debug, Serialize)]
pub struct ChatCompletion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// `GET /v1/models`.
#[derive(Debug, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}

#[derive(Debug, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
}

/// OpenAI's error envelope: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Serialize)]
pub struct ErrorEnvelope {
    pub error: ErrorBody,
}

#[derive(Debug, Serialize)]
pub struct ErrorBody {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub param: Option<&'static str>,
    pub code: Option<&'static str>,
}

/// One entry of a chunk's `delta.tool_calls`.
#[derive(Debug, PartialEq, Serialize)]
pub struct ToolCallChunk {
    /// Which call of the answer it belongs to.
    pub index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionChunk,
}

#[derive(Debug, PartialEq, Serialize)]
pub struct FunctionChunk {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The next piece of the arguments' JSON text.
    pub arguments: String,
}

/// `POST /tokenize` (vLLM's and SGLang's): a prompt, or a conversation through the chat
/// template.
#[derive(Debug, Deserialize)]
pub struct TokenizeRequest {
    /// When given, one of the served names.
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<Message>>,
    pub add_generation_prompt: Option<bool>,
    pub add_special_tokens: Option<bool>,
    #[serde(default)]
    pub continue_final_message: bool,
    pub chat_template_kwargs: Option<serde_json::Value>,
    pub tools: Option<Vec<Tool>>,
    /// Also answer each token's string (special tokens by their names).
    #[serde(default)]
    pub return_token_strs: bool,
}

#[derive(Debug, Serialize)]
pub struct TokenizeResponse {
    pub count: usize,
    /// The model's context length.
    pub max_model_len: u32,
    pub tokens: Vec<u32>,
    pub token_strs: Option<Vec<String>>,
}

/// `POST /detokenize`.
#[derive(Debug, Deserialize)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}

#[derive(Debug, Serialize)]
pub struct DetokenizeResponse {
    /// The tokens' text, special tokens included.
    pub prompt: String,
}
