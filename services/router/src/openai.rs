//! OpenAI's wire format: the request and response bodies of `/v1/completions`,
//! `/v1/chat/completions` and `/v1/models`, the error envelope, and the conversions between
//! them and `duet.v1` messages. Nothing here serves or routes (that is `http.rs`); a request
//! becomes a `GenerateRequest` and the router core validates it as it validates a gRPC call.

use duet_model::tokenizer::Tokenizer;
use duet_model::tool_calls::{ToolCallFormat, call_schema};
use duet_proto::v1;
use serde::{Deserialize, Serialize};

use crate::tool_stream::{ToolCallChunk, ToolCallStream};

/// A request the OpenAI front refuses before it reaches the router core (the core's own checks
/// cover the rest): answered 400, or 404 for a model this router does not serve.
#[derive(Debug, thiserror::Error)]
pub enum OpenAiError {
    #[error("{message}")]
    Invalid {
        param: &'static str,
        message: String,
    },
    #[error("the model `{asked}` does not exist; this server serves `{served}`")]
    UnknownModel {
        asked: String,
        /// The served names, joined.
        served: String,
    },
}

fn invalid(param: &'static str, message: impl Into<String>) -> OpenAiError {
    OpenAiError::Invalid {
        param,
        message: message.into(),
    }
}

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

/// `response_format.json_schema`. duet always holds the answer to the schema (`strict` or not).
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

/// How a chat answer is returned: as the message's text, or as a call of a tool whose arguments
/// the grammar held to the tool's schema.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum ToolAnswer {
    #[default]
    Text,
    /// `tool_choice` named this function: the text is its arguments.
    Named(String),
    /// `tool_choice: "required"`: the text is `{"name": …, "arguments": {…}}`.
    Required,
    /// `tool_choice: "auto"`: the model answers in text, and may write calls in this markup.
    Auto(ToolCallFormat),
}

/// OpenAI fields duet does not serve. A request setting one to anything but its "off" value is
/// refused, naming it, rather than answered as if the field were absent (free text where JSON
/// or a tool call was asked for).
#[derive(Debug, Default, Deserialize)]
pub struct Unserved {
    logit_bias: Option<serde_json::Map<String, serde_json::Value>>,
    functions: Option<Vec<serde_json::Value>>,
    function_call: Option<serde_json::Value>,
    suffix: Option<String>,
    best_of: Option<u32>,
}

impl Unserved {
    fn check(&self) -> Result<(), OpenAiError> {
        let off = |v: &Option<serde_json::Value>| {
            v.as_ref()
                .is_none_or(|v| v == "none" || v == "auto" || v.is_null())
        };
        let refuse = |param, what| Err(invalid(param, format!("{what} not supported by duet")));
        if self.logit_bias.as_ref().is_some_and(|m| !m.is_empty()) {
            return refuse("logit_bias", "logit_bias is");
        }
        if self.functions.as_ref().is_some_and(|t| !t.is_empty()) {
            return refuse("functions", "function calling (use tools) is");
        }
        if !off(&self.function_call) {
            return refuse("function_call", "function calling is");
        }
        if self.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return refuse("suffix", "suffix is");
        }
        if self.best_of.is_some_and(|n| n != 1) {
            return refuse("best_of", "best_of other than 1 is");
        }
        Ok(())
    }
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

impl Message {
    /// The turn as the router core takes it; `index` names it in errors.
    fn to_wire(&self, index: usize) -> Result<v1::ChatMessage, OpenAiError> {
        let calls = self.tool_calls.as_deref().unwrap_or_default();
        if !calls.is_empty() && self.role != "assistant" {
            return Err(invalid(
                "messages",
                format!("messages[{index}]: only assistant turns make tool_calls"),
            ));
        }
        for call in calls {
            only_functions(
                "messages",
                &format!("messages[{index}]: tool calls"),
                &call.kind,
            )?;
        }
        let tool_call_id = match (self.role.as_str(), &self.tool_call_id) {
            ("tool", None) => {
                return Err(invalid(
                    "messages",
                    format!("messages[{index}]: a `tool` turn needs the tool_call_id it answers"),
                ));
            }
            (_, id) => id.clone().unwrap_or_default(),
        };
        Ok(v1::ChatMessage {
            role: self.role.clone(),
            content: text_of(self.content.as_ref())?,
            tool_calls: calls
                .iter()
                .map(|c| v1::ChatToolCall {
                    id: c.id.clone(),
                    name: c.function.name.clone(),
                    arguments: c.function.arguments.clone(),
                })
                .collect(),
            tool_call_id,
        })
    }
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

/// What the HTTP front needs to answer a request once the core accepted it.
#[derive(Clone, Debug)]
pub struct Answer {
    pub stream: bool,
    pub include_usage: bool,
    /// Alternatives to show per token (`None`: no logprobs).
    pub top_logprobs: Option<u32>,
    pub tools: ToolAnswer,
}

impl Common {
    /// Checks what the core does not know about (model, `n`) and fills the shared fields of
    /// `req`.
    fn apply(&self, served: &[String], req: &mut v1::GenerateRequest) -> Result<(), OpenAiError> {
        if !served.contains(&self.model) {
            return Err(OpenAiError::UnknownModel {
                asked: self.model.clone(),
                served: served.join("`, `"),
            });
        }
        if let Some(n) = self.n.filter(|&n| n != 1) {
            return Err(invalid(
                "n",
                format!("n must be 1 (one choice per request), got {n}"),
            ));
        }
        self.unserved.check()?;
        if self.stream_options.is_some() && !self.stream {
            return Err(invalid(
                "stream_options",
                "stream_options is only allowed when stream is true",
            ));
        }
        req.temperature = self.temperature;
        req.top_p = self.top_p;
        // OpenAI's seed is a signed integer; every value names one sampler stream.
        req.seed = self.seed.map(|s| s as u64);
        req.stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        req.presence_penalty = self.presence_penalty;
        req.frequency_penalty = self.frequency_penalty;
        req.top_k = self.top_k.unwrap_or(0);
        req.min_p = self.min_p;
        req.repetition_penalty = self.repetition_penalty;
        req.ignore_eos = self.ignore_eos;
        req.cache_salt = self.cache_salt.clone();
        req.constraint = self.constraint()?;
        req.speculative = self.speculative;
        Ok(())
    }

    /// The grammar `response_format`, `guided_regex` or `guided_grammar` asks for (one at most).
    fn constraint(&self) -> Result<Option<v1::Constraint>, OpenAiError> {
        use v1::constraint::Kind;
        let format = match &self.response_format {
            None | Some(ResponseFormat::Text) => None,
            Some(ResponseFormat::JsonObject) => Some(Kind::JsonObject(true)),
            Some(ResponseFormat::JsonSchema { json_schema }) => {
                let schema = json_schema.schema.as_ref().ok_or_else(|| {
                    invalid(
                        "response_format",
                        "response_format.json_schema.schema is required",
                    )
                })?;
                Some(Kind::JsonSchema(schema.to_string()))
            }
        };
        let kinds: Vec<(&'static str, Kind)> = [
            ("response_format", format),
            ("guided_regex", self.guided_regex.clone().map(Kind::Regex)),
            (
                "guided_grammar",
                self.guided_grammar.clone().map(Kind::Lark),
            ),
        ]
        .into_iter()
        .filter_map(|(param, kind)| Some((param, kind?)))
        .collect();
        match kinds.len() {
            0 => Ok(None),
            1 => Ok(kinds
                .into_iter()
                .next()
                .map(|(_, kind)| v1::Constraint { kind: Some(kind) })),
            _ => Err(invalid(
                kinds[1].0,
                format!(
                    "one constraint per request: {} and {} are both set",
                    kinds[0].0, kinds[1].0
                ),
            )),
        }
    }

    fn answer(&self, top_logprobs: Option<u32>) -> Answer {
        Answer {
            stream: self.stream,
            include_usage: self.stream_options.is_some_and(|o| o.include_usage),
            top_logprobs,
            tools: ToolAnswer::Text,
        }
    }
}

impl CompletionRequest {
    /// The request as the router core takes it.
    pub fn to_generate(
        &self,
        served: &[String],
    ) -> Result<(v1::GenerateRequest, Answer), OpenAiError> {
        let mut req = v1::GenerateRequest::default();
        self.common.apply(served, &mut req)?;
        if self.echo {
            return Err(invalid("echo", "echo is not supported"));
        }
        let one = |n: usize| {
            if n == 1 {
                Ok(())
            } else {
                Err(invalid(
                    "prompt",
                    format!("exactly one prompt per request is supported, got {n}"),
                ))
            }
        };
        match &self.prompt {
            Prompt::Text(t) => req.prompt = t.clone(),
            Prompt::Texts(v) => {
                one(v.len())?;
                req.prompt = v[0].clone();
            }
            Prompt::Tokens(ids) => req.token_ids = ids.clone(),
            Prompt::TokenLists(v) => {
                one(v.len())?;
                req.token_ids = v[0].clone();
            }
        }
        req.max_tokens = self.common.max_tokens;
        req.logprobs = self.logprobs.unwrap_or(0);
        let top = self.logprobs.filter(|&n| n > 0);
        Ok((req, self.common.answer(top)))
    }
}

impl ChatRequest {
    /// The request as the router core takes it. `auto_tool_calls`: the markup the model's
    /// calls are read in under `tool_choice: "auto"`, or why `auto` is not served.
    pub fn to_generate(
        &self,
        served: &[String],
        auto_tool_calls: Result<ToolCallFormat, &str>,
    ) -> Result<(v1::GenerateRequest, Answer), OpenAiError> {
        let mut req = v1::GenerateRequest::default();
        self.common.apply(served, &mut req)?;
        if self.messages.is_empty() {
            return Err(invalid("messages", "messages must not be empty"));
        }
        req.messages = self
            .messages
            .iter()
            .enumerate()
            .map(|(i, m)| m.to_wire(i))
            .collect::<Result<_, OpenAiError>>()?;
        if let Some(vars) = self.chat_template_kwargs.as_ref().filter(|v| !v.is_null()) {
            req.chat_template_kwargs = vars.to_string();
        }
        req.max_tokens = self.max_completion_tokens.or(self.common.max_tokens);
        let top = match (self.logprobs, self.top_logprobs) {
            (false, Some(_)) => {
                return Err(invalid(
                    "top_logprobs",
                    "top_logprobs requires logprobs to be true",
                ));
            }
            (false, None) => None,
            (true, n) => Some(n.unwrap_or(0)),
        };
        // The core reports a token's own logprob only with at least one alternative; extra
        // alternatives are dropped when answering.
        req.logprobs = top.map_or(0, |n| n.max(1));
        let mut answer = self.common.answer(top);
        answer.tools = self.tool_call(&mut req, auto_tool_calls)?;
        Ok((req, answer))
    }

    /// How the answer may call one of `tools`, as `tool_choice` asks: `required` or a named
    /// function hold the call (its name and arguments) to the tools' schemas; `auto` (the
    /// default with tools) lets the model choose, and reads its calls in `auto_tool_calls`'
    /// markup. The tools reach the chat template as its `tools` variable. `none` (or no tools)
    /// answers in text.
    fn tool_call(
        &self,
        req: &mut v1::GenerateRequest,
        auto_tool_calls: Result<ToolCallFormat, &str>,
    ) -> Result<ToolAnswer, OpenAiError> {
        let tools = self.tools.as_deref().unwrap_or_default();
        let choice = self.tool_choice.as_ref().filter(|c| !c.is_null());
        if tools.is_empty() || choice.is_some_and(|c| c == "none") {
            return match choice {
                Some(c) if c != "none" && c != "auto" => Err(invalid(
                    "tool_choice",
                    "tool_choice names a tool but no tools are given",
                )),
                _ => Ok(ToolAnswer::Text),
            };
        }
        for t in tools {
            only_functions("tools", "tools", &t.kind)?;
        }
        if req.constraint.is_some() {
            return Err(invalid(
                "tools",
                "one constraint per request: tools and a response format are both set",
            ));
        }
        let parameters = |f: &FunctionTool| {
            f.parameters
                .clone()
                .unwrap_or_else(|| serde_json::json!({"type": "object", "properties": {}}))
        };
        let call = || {
            call_schema(
                tools
                    .iter()
                    .map(|t| (t.function.name.as_str(), parameters(&t.function))),
            )
        };
        let (constraint, answer) = match choice {
            Some(c) if c == "required" => (
                v1::constraint::Kind::JsonSchema(call().to_string()),
                ToolAnswer::Required,
            ),
            Some(c) if c["type"] == "function" => {
                let name = c["function"]["name"].as_str().unwrap_or_default();
                let tool = tools
                    .iter()
                    .find(|t| t.function.name == name)
                    .ok_or_else(|| {
                        invalid(
                            "tool_choice",
                            format!("tool_choice names `{name}`, which is not among the tools"),
                        )
                    })?;
                (
                    v1::constraint::Kind::JsonSchema(parameters(&tool.function).to_string()),
                    ToolAnswer::Named(name.to_string()),
                )
            }
            // Free text, and calls in the model's markup held to the tools' schemas.
            None => auto(auto_tool_calls, call)?,
            Some(c) if c == "auto" => auto(auto_tool_calls, call)?,
            Some(c) => {
                return Err(invalid(
                    "tool_choice",
                    format!(
                        "tool_choice must be `none`, `auto`, `required` or \
                         {{\"type\": \"function\", \"function\": {{\"name\": …}}}}, got {c}"
                    ),
                ));
            }
        };
        req.constraint = Some(v1::Constraint {
            kind: Some(constraint),
        });
        let mut variables = match self.chat_template_kwargs.as_ref() {
            Some(serde_json::Value::Object(m)) => m.clone(),
            _ => serde_json::Map::new(),
        };
        let functions: Vec<serde_json::Value> = tools
            .iter()
            .map(|t| serde_json::json!({"type": "function", "function": t.function}))
            .collect();
        variables.insert("tools".into(), functions.into());
        req.chat_template_kwargs = serde_json::Value::Object(variables).to_string();
        Ok(answer)
    }
}

/// Refuses `what` of a `kind` other than `function`, the only one served.
fn only_functions(param: &'static str, what: &str, kind: &str) -> Result<(), OpenAiError> {
    if kind == "function" {
        return Ok(());
    }
    Err(invalid(
        param,
        format!("{what} of type `{kind}` are not supported (function only)"),
    ))
}

/// `tool_choice: "auto"`: free text, with calls in `format`'s markup held to `call`'s schema and
/// read back; or refused with why it is not served.
fn auto(
    format: Result<ToolCallFormat, &str>,
    call: impl FnOnce() -> serde_json::Value,
) -> Result<(v1::constraint::Kind, ToolAnswer), OpenAiError> {
    let format = format.map_err(|why| {
        invalid(
            "tool_choice",
            format!(
                "tool_choice `auto` (the default with tools) is not served for this model: {why}; \
                 ask for `required` or name a function, whose calls duet holds to the tools' schemas"
            ),
        )
    })?;
    Ok((
        v1::constraint::Kind::Lark(format.grammar(&call())),
        ToolAnswer::Auto(format),
    ))
}

/// The id of a tool call a request's answer makes: the `index`th (0 for the first).
pub fn call_id(request_id: &str, index: u32) -> String {
    match index {
        0 => format!("call_{request_id}"),
        n => format!("call_{request_id}_{n}"),
    }
}

/// The function's name and its arguments' JSON text of a call written as
/// `{"name": …, "arguments": …}` (missing arguments: none, `{}`).
pub fn parse_call(text: &str) -> Option<(String, String)> {
    let v: serde_json::Value = serde_json::from_str(text).ok()?;
    let arguments = v
        .get("arguments")
        .map_or_else(|| "{}".into(), |a| a.to_string());
    Some((v.get("name")?.as_str()?.to_string(), arguments))
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

impl ToolAnswer {
    /// A finished answer's content and calls. A named or `required` call whose text is not a
    /// whole call (generation stopped by `max_tokens`) answers in text.
    pub fn answer(&self, text: &str, request_id: &str) -> (Option<String>, Vec<ToolCall>) {
        let call = match self {
            ToolAnswer::Text => None,
            ToolAnswer::Named(name) => serde_json::from_str::<serde_json::Value>(text)
                .ok()
                .map(|_| (name.clone(), text.to_string())),
            ToolAnswer::Required => parse_call(text),
            ToolAnswer::Auto(_) => {
                if let Some(stream) = ToolCallStream::new(self, request_id) {
                    return stream.read_whole(text);
                }
                None
            }
        };
        match call {
            Some((name, arguments)) => (
                None,
                vec![ToolCall {
                    id: call_id(request_id, 0),
                    kind: "function",
                    function: CalledFunction { name, arguments },
                }],
            ),
            None => (Some(text.to_string()), Vec::new()),
        }
    }
}

fn text_of(content: Option<&Content>) -> Result<String, OpenAiError> {
    match content {
        None => Ok(String::new()),
        Some(Content::Text(t)) => Ok(t.clone()),
        Some(Content::Parts(parts)) => parts
            .iter()
            .map(|p| match (p.kind.as_str(), &p.text) {
                ("text", Some(t)) => Ok(t.as_str()),
                (kind, _) => Err(invalid(
                    "messages",
                    format!("content parts of type `{kind}` are not supported (text only)"),
                )),
            })
            .collect(),
    }
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

/// `finish_reason` of a message: `None` until the last one.
pub fn finish_reason(m: &v1::GenerateResponse) -> Option<&'static str> {
    match v1::FinishReason::try_from(m.finish_reason).unwrap_or_default() {
        v1::FinishReason::Unspecified => None,
        v1::FinishReason::Stop => Some("stop"),
        v1::FinishReason::Length => Some("length"),
        v1::FinishReason::Aborted => Some("abort"),
        v1::FinishReason::Error => Some("error"),
    }
}

/// `logprobs` of a `/v1/completions` choice.
#[derive(Debug, Default, Serialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    pub top_logprobs: Vec<serde_json::Map<String, serde_json::Value>>,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A chat request to a router whose model writes Hermes tool calls.
    fn chat(json: &str) -> Result<(v1::GenerateRequest, Answer), OpenAiError> {
        chat_for(json, Ok(ToolCallFormat::Hermes))
    }

    fn chat_for(
        json: &str,
        auto_tool_calls: Result<ToolCallFormat, &str>,
    ) -> Result<(v1::GenerateRequest, Answer), OpenAiError> {
        serde_json::from_str::<ChatRequest>(json)
            .unwrap()
            .to_generate(&["m".to_string(), "alias".to_string()], auto_tool_calls)
    }

    fn completion(json: &str) -> Result<(v1::GenerateRequest, Answer), OpenAiError> {
        serde_json::from_str::<CompletionRequest>(json)
            .unwrap()
            .to_generate(&["m".to_string(), "alias".to_string()])
    }

    #[test]
    fn chat_fields_become_the_generate_request() {
        let (r, a) = chat(
            r#"{"model":"m","messages":[{"role":"system","content":"be brief"},
                {"role":"user","content":[{"type":"text","text":"Hi"},{"type":"text","text":"!"}]}],
                "max_tokens":5,"max_completion_tokens":7,"temperature":0,"top_p":0.5,"seed":-1,
                "stop":"x","n":1,"logprobs":true,"top_logprobs":0,"stream":true,
                "stream_options":{"include_usage":true},"user":"ignored"}"#,
        )
        .unwrap();
        assert_eq!(r.messages.len(), 2);
        assert_eq!(r.messages[1].content, "Hi!");
        assert_eq!(r.max_tokens, Some(7));
        assert_eq!((r.temperature, r.top_p), (Some(0.0), Some(0.5)));
        assert_eq!(r.seed, Some(u64::MAX));
        assert_eq!(r.stop, ["x"]);
        // The token's own logprob needs one alternative from the core; none is shown.
        assert_eq!(r.logprobs, 1);
        assert!(a.stream && a.include_usage);
        assert_eq!(a.top_logprobs, Some(0));
    }

    #[test]
    fn chat_template_kwargs_travel_as_json_text() {
        let (r, _) = chat(
            r#"{"model":"m","messages":[{"role":"user","content":"Hi"}],
                "chat_template_kwargs":{"enable_thinking":false}}"#,
        )
        .unwrap();
        assert_eq!(r.chat_template_kwargs, r#"{"enable_thinking":false}"#);
        let (r, _) = chat(r#"{"model":"m","messages":[{"role":"user","content":"Hi"}]}"#).unwrap();
        assert_eq!(r.chat_template_kwargs, "");
    }

    #[test]
    fn completion_prompts_in_every_form() {
        let (r, a) = completion(r#"{"model":"m","prompt":"Hello","stop":["a","b"]}"#).unwrap();
        assert_eq!((r.prompt.as_str(), r.stop.len()), ("Hello", 2));
        assert!(!a.stream && a.top_logprobs.is_none());
        let (r, _) = completion(r#"{"model":"m","prompt":["Hey"]}"#).unwrap();
        assert_eq!(r.prompt, "Hey");
        let (r, _) = completion(r#"{"model":"m","prompt":[1,2,3],"logprobs":2}"#).unwrap();
        assert_eq!((r.token_ids, r.logprobs), (vec![1, 2, 3], 2));
        let (r, _) = completion(r#"{"model":"m","prompt":[[4,5]]}"#).unwrap();
        assert_eq!(r.token_ids, [4, 5]);
    }

    #[test]
    fn what_the_front_refuses_names_the_field() {
        let param = |r: Result<_, OpenAiError>| match r {
            Err(OpenAiError::Invalid { param, .. }) => param,
            other => panic!("{other:?}"),
        };
        assert_eq!(param(chat(r#"{"model":"m","messages":[],"n":2}"#)), "n");
        assert_eq!(param(chat(r#"{"model":"m","messages":[]}"#)), "messages");
        assert_eq!(
            param(chat(
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"top_logprobs":2}"#
            )),
            "top_logprobs"
        );
        assert_eq!(
            param(chat(
                r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#
            )),
            "messages"
        );
        assert_eq!(
            param(completion(r#"{"model":"m","prompt":["a","b"]}"#)),
            "prompt"
        );
        assert_eq!(
            param(completion(r#"{"model":"m","prompt":"a","echo":true}"#)),
            "echo"
        );
        assert_eq!(
            param(completion(
                r#"{"model":"m","prompt":"a","stream_options":{"include_usage":true}}"#
            )),
            "stream_options"
        );
        let unknown = completion(r#"{"model":"other","prompt":"a"}"#).unwrap_err();
        assert!(
            matches!(unknown, OpenAiError::UnknownModel { .. })
                && unknown.to_string().contains("`m`, `alias`"),
            "{unknown}"
        );
        // Every served name (an alias too) is the model.
        assert!(completion(r#"{"model":"alias","prompt":"a"}"#).is_ok());
    }

    /// Fields duet does not serve are refused when they ask for something, and accepted at
    /// their "off" values (which clients send by default).
    #[test]
    fn unserved_openai_fields_are_refused_unless_off() {
        let chat_with = |field: &str| {
            chat(&format!(
                r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}],{field}}}"#
            ))
        };
        for (field, param) in [
            (r#""logit_bias":{"50256":-100}"#, "logit_bias"),
            (r#""functions":[{"name":"f"}]"#, "functions"),
            (r#""function_call":{"name":"f"}"#, "function_call"),
        ] {
            match chat_with(field) {
                Err(OpenAiError::Invalid { param: p, message }) => {
                    assert_eq!(p, param);
                    assert!(message.contains("not supported"), "{message}");
                }
                other => panic!("{field}: {other:?}"),
            }
        }
        for field in [
            r#""logit_bias":{}"#,
            r#""response_format":{"type":"text"}"#,
            r#""tools":[]"#,
            r#""tool_choice":"none""#,
            r#""tool_choice":"auto""#,
            r#""function_call":null"#,
        ] {
            assert!(chat_with(field).is_ok(), "{field}");
        }
        for (field, param) in [(r#""suffix":"}""#, "suffix"), (r#""best_of":3"#, "best_of")] {
            let r = completion(&format!(r#"{{"model":"m","prompt":"a",{field}}}"#));
            assert!(
                matches!(&r, Err(OpenAiError::Invalid { param: p, .. }) if *p == param),
                "{field}: {r:?}"
            );
        }
        assert!(completion(r#"{"model":"m","prompt":"a","suffix":"","best_of":1}"#).is_ok());
    }

    fn kind(r: &v1::GenerateRequest) -> Option<v1::constraint::Kind> {
        r.constraint.as_ref().and_then(|c| c.kind.clone())
    }

    /// `speculative: false` opts out; the usage reports the drafts in OpenAI's fields.
    #[test]
    fn speculation_is_asked_for_and_reported() {
        let (r, _) = completion(r#"{"model":"m","prompt":"a","speculative":false}"#).unwrap();
        assert_eq!(r.speculative, Some(false));
        let (r, _) = completion(r#"{"model":"m","prompt":"a"}"#).unwrap();
        assert_eq!(r.speculative, None);
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

    /// `response_format`, `guided_regex` and `guided_grammar` become the request's constraint,
    /// one at most.
    #[test]
    fn structured_output_fields_become_the_constraint() {
        use v1::constraint::Kind;
        let chat_with = |fields: &str| {
            chat(&format!(
                r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}],{fields}}}"#
            ))
        };
        let (r, _) = chat_with(r#""response_format":{"type":"json_object"}"#).unwrap();
        assert_eq!(kind(&r), Some(Kind::JsonObject(true)));
        let (r, _) = chat_with(
            r#""response_format":{"type":"json_schema","json_schema":{"name":"p","strict":true,
                "schema":{"type":"object","properties":{"a":{"type":"integer"}}}}}"#,
        )
        .unwrap();
        let Some(Kind::JsonSchema(text)) = kind(&r) else {
            panic!("{r:?}")
        };
        let schema: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(schema["properties"]["a"]["type"], "integer");
        let (r, _) = completion(r#"{"model":"m","prompt":"a","guided_regex":"[0-9]+"}"#).unwrap();
        assert_eq!(kind(&r), Some(Kind::Regex("[0-9]+".into())));
        let (r, _) = chat_with(r#""guided_grammar":"start: \"x\"""#).unwrap();
        assert_eq!(kind(&r), Some(Kind::Lark(r#"start: "x""#.into())));
        let (r, _) = chat_with(r#""response_format":{"type":"text"}"#).unwrap();
        assert_eq!(r.constraint, None);
        for (fields, param) in [
            (
                r#""response_format":{"type":"json_schema","json_schema":{"name":"p"}}"#,
                "response_format",
            ),
            (
                r#""response_format":{"type":"json_object"},"guided_regex":"a""#,
                "guided_regex",
            ),
        ] {
            match chat_with(fields) {
                Err(OpenAiError::Invalid { param: p, .. }) => assert_eq!(p, param, "{fields}"),
                other => panic!("{fields}: {other:?}"),
            }
        }
    }

    /// `tools` with `tool_choice` naming a function or `required` hold the answer to the
    /// arguments' schema (the tools reach the chat template), streamed or not; `auto`, and no
    /// `tool_choice`, read the model's own calls, or are refused where the model has none;
    /// unknown names are refused; `none` answers in text.
    #[test]
    fn tool_calls_become_constraints_and_answers() {
        use v1::constraint::Kind;
        let tools = r#""tools":[
            {"type":"function","function":{"name":"weather","parameters":{"type":"object",
             "properties":{"city":{"type":"string"}},"required":["city"]}}},
            {"type":"function","function":{"name":"time"}}]"#;
        let chat_with = |fields: &str| {
            chat(&format!(
                r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}],{tools},{fields}}}"#
            ))
        };
        let (r, a) =
            chat_with(r#""tool_choice":{"type":"function","function":{"name":"weather"}}"#)
                .unwrap();
        assert_eq!(a.tools, ToolAnswer::Named("weather".into()));
        let Some(Kind::JsonSchema(text)) = kind(&r) else {
            panic!("{r:?}")
        };
        assert!(text.contains("city"), "{text}");
        let vars: serde_json::Value = serde_json::from_str(&r.chat_template_kwargs).unwrap();
        assert_eq!(vars["tools"][1]["function"]["name"], "time");
        let (r, a) = chat_with(r#""tool_choice":"required""#).unwrap();
        assert_eq!(a.tools, ToolAnswer::Required);
        let Some(Kind::JsonSchema(text)) = kind(&r) else {
            panic!("{r:?}")
        };
        let schema: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(schema["anyOf"].as_array().unwrap().len(), 2);
        let (_, a) = chat_with(r#""tool_choice":"required","stream":true"#).unwrap();
        assert!(a.stream && a.tools == ToolAnswer::Required);
        let (r, a) = chat_with(r#""tool_choice":"none""#).unwrap();
        assert_eq!((a.tools, r.constraint), (ToolAnswer::Text, None));
        for choice in [r#""tool_choice":"auto""#, r#""stream":true"#] {
            let (r, a) = chat_with(choice).unwrap();
            assert_eq!(a.tools, ToolAnswer::Auto(ToolCallFormat::Hermes));
            // Free text, and Hermes calls held to the tools' schemas.
            let Some(Kind::Lark(grammar)) = kind(&r) else {
                panic!("{r:?}")
            };
            assert!(
                grammar.contains(r#""<tool_call>""#)
                    && grammar.contains(r#"{"const":"weather"}"#)
                    && grammar.contains(r#""required":["city"]"#),
                "{grammar}"
            );
            let vars: serde_json::Value = serde_json::from_str(&r.chat_template_kwargs).unwrap();
            assert_eq!(vars["tools"][0]["function"]["name"], "weather");
            let refused = chat_for(
                &format!(
                    r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}],{tools},{choice}}}"#
                ),
                Err("its chat template does not show the model the tools"),
            );
            match refused {
                Err(OpenAiError::Invalid { param, message }) => {
                    assert_eq!(param, "tool_choice");
                    assert!(
                        message.contains("does not show the model the tools"),
                        "{message}"
                    );
                }
                other => panic!("{other:?}"),
            }
        }
        for (fields, param) in [
            (r#""tool_choice":"sometimes""#, "tool_choice"),
            (
                r#""tool_choice":{"type":"function","function":{"name":"nope"}}"#,
                "tool_choice",
            ),
            (
                r#""tool_choice":"required","response_format":{"type":"json_object"}"#,
                "tools",
            ),
        ] {
            match chat_with(fields) {
                Err(OpenAiError::Invalid { param: p, .. }) => assert_eq!(p, param, "{fields}"),
                other => panic!("{fields}: {other:?}"),
            }
        }
        let (content, calls) =
            ToolAnswer::Named("weather".into()).answer(r#"{"city":"Paris"}"#, "7");
        let call = &calls[0];
        assert_eq!(
            (content, call.id.as_str(), call.function.name.as_str()),
            (None, "call_7", "weather")
        );
        assert_eq!(call.function.arguments, r#"{"city":"Paris"}"#);
        let (_, calls) = ToolAnswer::Required.answer(r#"{"name":"time","arguments":{}}"#, "8");
        assert_eq!(
            (
                calls[0].function.name.as_str(),
                calls[0].function.arguments.as_str()
            ),
            ("time", "{}")
        );
        let cut = r#"{"name":"time","argu"#;
        let (content, calls) = ToolAnswer::Required.answer(cut, "9");
        assert_eq!((content.as_deref(), calls.len()), (Some(cut), 0));
        let (content, calls) = ToolAnswer::Text.answer("{}", "9");
        assert_eq!((content.as_deref(), calls.len()), (Some("{}"), 0));
        let (content, calls) = ToolAnswer::Auto(ToolCallFormat::Hermes).answer(
            "Looking.\n<tool_call>\n{\"name\": \"time\", \"arguments\": {}}\n</tool_call>",
            "9",
        );
        assert_eq!(content.as_deref(), Some("Looking."));
        assert_eq!(
            (
                calls[0].id.as_str(),
                calls[0].function.name.as_str(),
                calls[0].function.arguments.as_str()
            ),
            ("call_9", "time", "{}")
        );
    }

    /// An assistant turn's `tool_calls` and a tool turn's `tool_call_id` reach the core; a
    /// tool turn without the id it answers, and calls on a turn that is not the assistant's,
    /// are refused naming the turn.
    #[test]
    fn tool_turns_of_the_conversation_reach_the_core() {
        let (r, _) = chat(
            r#"{"model":"m","messages":[{"role":"user","content":"weather?"},
                {"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function",
                 "function":{"name":"weather","arguments":"{\"city\":\"Oslo\"}"}}]},
                {"role":"tool","tool_call_id":"call_1","content":"cold"}]}"#,
        )
        .unwrap();
        assert_eq!(
            r.messages[1].tool_calls,
            [v1::ChatToolCall {
                id: "call_1".into(),
                name: "weather".into(),
                arguments: r#"{"city":"Oslo"}"#.into(),
            }]
        );
        assert_eq!(r.messages[1].content, "");
        assert_eq!(
            (
                r.messages[2].role.as_str(),
                r.messages[2].tool_call_id.as_str()
            ),
            ("tool", "call_1")
        );
        for (messages, words) in [
            (
                r#"[{"role":"tool","content":"cold"}]"#,
                "messages[0]: a `tool` turn needs the tool_call_id",
            ),
            (
                r#"[{"role":"user","content":"x","tool_calls":[{"id":"c","function":{"name":"f","arguments":"{}"}}]}]"#,
                "messages[0]: only assistant turns make tool_calls",
            ),
        ] {
            match chat(&format!(r#"{{"model":"m","messages":{messages}}}"#)) {
                Err(OpenAiError::Invalid { param, message }) => {
                    assert_eq!(param, "messages");
                    assert!(message.contains(words), "{message}");
                }
                other => panic!("{messages}: {other:?}"),
            }
        }
    }
}
