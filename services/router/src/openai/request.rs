//! A request of the OpenAI front as the core takes it: a `/v1/completions` or
//! `/v1/chat/completions` body becomes a `GenerateRequest`, which the core validates as it
//! validates a gRPC call, and an [`Answer`] that says how the front writes the answer. Tools
//! become a constraint here: a named function or `required` hold the call to the tools'
//! schemas; `auto` lets the model write calls in its own markup (read back in
//! [`super::tool_stream`]).

use duet_model::chat::ChatTemplate;
use duet_model::json_schema;
use duet_model::tokenizer::Tokenizer;
use duet_model::tool_calls::{ToolCallFormat, call_schema};
use duet_proto::v1;
use v1::constraint::Kind;

use super::wire::{
    ChatRequest, Common, CompletionRequest, Content, DetokenizeRequest, FunctionTool, Message,
    Prompt, ResponseFormat, Stop, TokenizeRequest, Tool, Unserved,
};

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

pub(super) fn invalid(param: &'static str, message: impl Into<String>) -> OpenAiError {
    OpenAiError::Invalid {
        param,
        message: message.into(),
    }
}

/// `--tool-call-parser`: how `tool_choice: "auto"` finds the model's calls in its answer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum ToolCallParser {
    /// The markup the chat template teaches, if duet reads it.
    #[default]
    Detect,
    /// `<tool_call>{"name": …, "arguments": …}</tool_call>` (Hermes, Qwen 2.5 and 3).
    Hermes,
    /// No parser: `tool_choice: "auto"` is refused.
    None,
}

impl std::fmt::Display for ToolCallParser {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let value = clap::ValueEnum::to_possible_value(self).expect("no variant is skipped");
        f.write_str(value.get_name())
    }
}

impl ToolCallParser {
    /// How `tool_choice: "auto"` is served for a chat template: the markup calls are read in
    /// (this parser's, or the one the template teaches). Refused, with why, when the template
    /// does not show the model its tools (it could not call them), teaches no markup duet
    /// reads, or the markup's delimiters are special tokens of `tokenizer` (answers' text
    /// leaves those out, so no call could be read).
    pub fn auto_tool_calls(
        self,
        chat: &ChatTemplate,
        tokenizer: &Tokenizer,
    ) -> Result<ToolCallFormat, String> {
        if self == ToolCallParser::None {
            return Err("the router runs with --tool-call-parser=none".into());
        }
        if !chat.shows_tools() {
            return Err(
                "its chat template does not show the model the tools (give one that does with \
                 --chat-template)"
                    .into(),
            );
        }
        let format = match self {
            ToolCallParser::Hermes => ToolCallFormat::Hermes,
            _ => ToolCallFormat::detect(chat.source()).ok_or_else(|| {
                "its chat template teaches no tool-call markup duet reads (Hermes `<tool_call>`); \
                 name one with --tool-call-parser"
                    .to_string()
            })?,
        };
        let special = tokenizer.special_tokens();
        let (open, close) = format.delimiters();
        if let Some(token) = [open, close]
            .into_iter()
            .find(|d| special.iter().any(|s| s == d))
        {
            return Err(format!(
                "`{token}` is a special token of its tokenizer, which answers' text leaves out"
            ));
        }
        Ok(format)
    }
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
        check_model(&self.model, served)?;
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
        let format = match &self.response_format {
            None | Some(ResponseFormat::Text) => None,
            Some(ResponseFormat::JsonObject) if self.whitespace_flexible => {
                Some(self.json(serde_json::json!({"type": "object"})))
            }
            Some(ResponseFormat::JsonObject) => Some(Kind::JsonObject(true)),
            Some(ResponseFormat::JsonSchema {
                json_schema: format,
            }) => {
                let mut schema = format.schema.clone().ok_or_else(|| {
                    invalid(
                        "response_format",
                        "response_format.json_schema.schema is required",
                    )
                })?;
                // OpenAI's strict mode: only the listed properties.
                if format.strict == Some(true) {
                    json_schema::close_objects(&mut schema);
                }
                Some(self.json(schema))
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

    /// A JSON Schema constraint, its whitespace flexible where the request asks.
    fn json(&self, mut schema: serde_json::Value) -> Kind {
        if self.whitespace_flexible {
            json_schema::flexible_whitespace(&mut schema);
        }
        Kind::JsonSchema(schema.to_string())
    }

    /// Refuses `whitespace_flexible` on a request whose answer is not held to a JSON Schema.
    fn check_whitespace(
        &self,
        req: &v1::GenerateRequest,
        tools: &ToolAnswer,
    ) -> Result<(), OpenAiError> {
        let json = matches!(
            req.constraint.as_ref().and_then(|c| c.kind.as_ref()),
            Some(Kind::JsonSchema(_) | Kind::JsonObject(_))
        ) || matches!(tools, ToolAnswer::Auto(_));
        if self.whitespace_flexible && !json {
            return Err(invalid(
                "whitespace_flexible",
                "whitespace_flexible applies to JSON answers only (response_format json_object or \
                 json_schema, or tools)",
            ));
        }
        Ok(())
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
    /// Token ids past `vocab_size` are refused here, naming `prompt`.
    pub fn to_generate(
        &self,
        served: &[String],
        vocab_size: u32,
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
        check_token_ids("prompt", &req.token_ids, vocab_size)?;
        req.max_tokens = self.common.max_tokens;
        req.logprobs = self.logprobs.unwrap_or(0);
        let top = self.logprobs.filter(|&n| n > 0);
        let answer = self.common.answer(top);
        self.common.check_whitespace(&req, &answer.tools)?;
        Ok((req, answer))
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
        self.common.check_whitespace(&req, &answer.tools)?;
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
        // A call's arguments hold only the properties its schema lists (unless it allows more).
        let parameters = |f: &FunctionTool| {
            let mut schema = f
                .parameters
                .clone()
                .unwrap_or_else(|| serde_json::json!({"type": "object", "properties": {}}));
            json_schema::close_objects(&mut schema);
            schema
        };
        let call = || {
            call_schema(
                tools
                    .iter()
                    .map(|t| (t.function.name.as_str(), parameters(&t.function))),
            )
        };
        let (constraint, answer) = match choice {
            Some(c) if c == "required" => (self.common.json(call()), ToolAnswer::Required),
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
                    self.common.json(parameters(&tool.function)),
                    ToolAnswer::Named(name.to_string()),
                )
            }
            // Free text, and calls in the model's markup held to the tools' schemas.
            None => auto(auto_tool_calls, call, self.common.whitespace_flexible)?,
            Some(c) if c == "auto" => auto(auto_tool_calls, call, self.common.whitespace_flexible)?,
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
        req.chat_template_kwargs = with_tools(self.chat_template_kwargs.as_ref(), tools);
        Ok(answer)
    }
}

/// The chat template's variables: `chat_template_kwargs` (an object), with `tools` the tools'
/// functions as HF's templates take them.
fn with_tools(kwargs: Option<&serde_json::Value>, tools: &[Tool]) -> String {
    let mut variables = match kwargs {
        Some(serde_json::Value::Object(m)) => m.clone(),
        _ => serde_json::Map::new(),
    };
    let functions: Vec<serde_json::Value> = tools
        .iter()
        .map(|t| serde_json::json!({"type": "function", "function": t.function}))
        .collect();
    variables.insert("tools".into(), functions.into());
    serde_json::Value::Object(variables).to_string()
}

/// Refuses a `model` this router does not serve (any of its names).
fn check_model(asked: &str, served: &[String]) -> Result<(), OpenAiError> {
    if served.iter().any(|s| s == asked) {
        return Ok(());
    }
    Err(OpenAiError::UnknownModel {
        asked: asked.to_string(),
        served: served.join("`, `"),
    })
}

/// Refuses token ids outside the vocabulary, naming `param` and the first bad one.
pub fn check_token_ids(
    param: &'static str,
    ids: &[u32],
    vocab_size: u32,
) -> Result<(), OpenAiError> {
    match ids.iter().enumerate().find(|&(_, &id)| id >= vocab_size) {
        Some((i, id)) => Err(invalid(
            param,
            format!(
                "{param}[{i}] = {id} is outside the vocabulary (valid ids are 0..{vocab_size})"
            ),
        )),
        None => Ok(()),
    }
}

impl DetokenizeRequest {
    /// Refuses a model this router does not serve and ids outside the vocabulary.
    pub fn check(&self, served: &[String], vocab_size: u32) -> Result<(), OpenAiError> {
        if let Some(model) = &self.model {
            check_model(model, served)?;
        }
        check_token_ids("tokens", &self.tokens, vocab_size)
    }
}

impl TokenizeRequest {
    /// The request as the core's Tokenize takes it: a prompt, or messages rendered as a chat
    /// request's are (with its `chat_template_kwargs` and `tools`). duet tokenizes as it
    /// generates: options asking for anything else are refused, naming them.
    pub fn to_core(&self, served: &[String]) -> Result<v1::TokenizeRequest, OpenAiError> {
        if let Some(model) = &self.model {
            check_model(model, served)?;
        }
        if self.add_special_tokens == Some(false) {
            return Err(invalid(
                "add_special_tokens",
                "add_special_tokens=false is not supported: duet tokenizes as it generates, with \
                 the special tokens the model adds",
            ));
        }
        if self.continue_final_message {
            return Err(invalid(
                "continue_final_message",
                "continue_final_message is not supported",
            ));
        }
        let tools = self.tools.as_deref().unwrap_or_default();
        for t in tools {
            only_functions("tools", "tools", &t.kind)?;
        }
        let kwargs = self.chat_template_kwargs.as_ref().filter(|v| !v.is_null());
        match (&self.prompt, &self.messages) {
            (Some(prompt), None) => {
                for (param, set) in [
                    ("chat_template_kwargs", kwargs.is_some()),
                    ("tools", !tools.is_empty()),
                    (
                        "add_generation_prompt",
                        self.add_generation_prompt.is_some(),
                    ),
                ] {
                    if set {
                        return Err(invalid(param, format!("{param} applies to messages only")));
                    }
                }
                Ok(v1::TokenizeRequest {
                    text: prompt.clone(),
                    ..Default::default()
                })
            }
            (None, Some(messages)) => {
                if messages.is_empty() {
                    return Err(invalid("messages", "messages must not be empty"));
                }
                if self.add_generation_prompt == Some(false) {
                    return Err(invalid(
                        "add_generation_prompt",
                        "add_generation_prompt=false is not supported: messages are rendered as \
                         a chat request's, with the generation prompt",
                    ));
                }
                Ok(v1::TokenizeRequest {
                    messages: messages
                        .iter()
                        .enumerate()
                        .map(|(i, m)| m.to_wire(i))
                        .collect::<Result<_, OpenAiError>>()?,
                    chat_template_kwargs: match (kwargs, tools.is_empty()) {
                        (_, false) => with_tools(kwargs, tools),
                        (Some(vars), true) => vars.to_string(),
                        (None, true) => String::new(),
                    },
                    ..Default::default()
                })
            }
            (Some(_), Some(_)) => Err(invalid(
                "messages",
                "give either a prompt or messages, not both",
            )),
            (None, None) => Err(invalid("prompt", "give a prompt or messages to tokenize")),
        }
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
    whitespace_flexible: bool,
) -> Result<(Kind, ToolAnswer), OpenAiError> {
    let format = format.map_err(|why| {
        invalid(
            "tool_choice",
            format!(
                "tool_choice `auto` (the default with tools) is not served for this model: {why}; \
                 ask for `required` or name a function, whose calls duet holds to the tools' schemas"
            ),
        )
    })?;
    let mut call = call();
    if whitespace_flexible {
        json_schema::flexible_whitespace(&mut call);
    }
    Ok((Kind::Lark(format.grammar(&call)), ToolAnswer::Auto(format)))
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

#[cfg(test)]
mod tests {
    use std::path::Path;

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
            .to_generate(&["m".to_string(), "alias".to_string()], 384)
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

    /// `speculative: false` opts out.
    #[test]
    fn speculation_is_asked_for() {
        let (r, _) = completion(r#"{"model":"m","prompt":"a","speculative":false}"#).unwrap();
        assert_eq!(r.speculative, Some(false));
        let (r, _) = completion(r#"{"model":"m","prompt":"a"}"#).unwrap();
        assert_eq!(r.speculative, None);
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
    }

    /// Tool arguments and `strict` schemas hold only the properties they list (plain JSON
    /// Schema allows any others); `whitespace_flexible` lets any JSON answer have whitespace,
    /// and is refused where the answer is not JSON.
    #[test]
    fn tool_arguments_and_strict_schemas_are_closed_and_whitespace_is_asked_for() {
        let schema_of = |r: &v1::GenerateRequest| -> serde_json::Value {
            match kind(r) {
                Some(Kind::JsonSchema(text)) => serde_json::from_str(&text).unwrap(),
                other => panic!("{other:?}"),
            }
        };
        let weather = r#"{"type":"function","function":{"name":"weather","parameters":{
            "type":"object","properties":{"city":{"type":"string"},
            "at":{"type":"object","properties":{"day":{"type":"integer"}}}}}}}"#;
        let ask = |fields: &str| {
            chat(&format!(
                r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}],{fields}}}"#
            ))
        };
        let (r, _) = ask(&format!(
            r#""tools":[{weather}],"tool_choice":{{"type":"function","function":{{"name":"weather"}}}}"#
        ))
        .unwrap();
        let named = schema_of(&r);
        assert_eq!(named["additionalProperties"], false, "{named}");
        assert_eq!(named["properties"]["at"]["additionalProperties"], false);
        assert!(
            named.get("x-guidance").is_none(),
            "compact is the compiler's default"
        );
        let (r, _) = ask(&format!(r#""tools":[{weather}],"tool_choice":"required""#)).unwrap();
        let required = schema_of(&r);
        assert_eq!(
            required["anyOf"][0]["properties"]["arguments"]["additionalProperties"],
            false
        );
        let (r, _) = ask(&format!(r#""tools":[{weather}]"#)).unwrap();
        let Some(Kind::Lark(grammar)) = kind(&r) else {
            panic!("{r:?}")
        };
        // The call's object, and both of its arguments' objects.
        assert_eq!(
            grammar.matches(r#""additionalProperties":false"#).count(),
            3,
            "{grammar}"
        );
        let format = |strict: bool| {
            format!(
                r#""response_format":{{"type":"json_schema","json_schema":{{"name":"p",
                "strict":{strict},"schema":{{"type":"object","properties":{{"a":{{}}}}}}}}}}"#
            )
        };
        let (r, _) = ask(&format(true)).unwrap();
        assert_eq!(schema_of(&r)["additionalProperties"], false);
        let (r, _) = ask(&format(false)).unwrap();
        assert!(schema_of(&r).get("additionalProperties").is_none());
        // Flexible whitespace where asked, for every kind of JSON answer.
        let flexible =
            |r: &v1::GenerateRequest| schema_of(r)["x-guidance"]["whitespace_flexible"] == true;
        let (r, _) = ask(&format!(r#"{},"whitespace_flexible":true"#, format(false))).unwrap();
        assert!(flexible(&r));
        let (r, _) =
            ask(r#""response_format":{"type":"json_object"},"whitespace_flexible":true"#).unwrap();
        assert!(flexible(&r) && schema_of(&r)["type"] == "object");
        let (r, _) = ask(&format!(
            r#""tools":[{weather}],"tool_choice":"required","whitespace_flexible":true"#
        ))
        .unwrap();
        assert!(flexible(&r));
        let (r, _) = ask(&format!(
            r#""tools":[{weather}],"whitespace_flexible":true"#
        ))
        .unwrap();
        let Some(Kind::Lark(grammar)) = kind(&r) else {
            panic!("{r:?}")
        };
        assert!(
            grammar.contains(r#""whitespace_flexible":true"#),
            "{grammar}"
        );
        for fields in [
            r#""whitespace_flexible":true"#,
            r#""guided_regex":"a+","whitespace_flexible":true"#,
        ] {
            match ask(fields) {
                Err(OpenAiError::Invalid { param, .. }) => assert_eq!(param, "whitespace_flexible"),
                other => panic!("{fields}: {other:?}"),
            }
        }
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

    /// `auto` is served where the chat template shows the tools and its markup is read (by
    /// `--tool-call-parser`, or read off the template), and refused with why everywhere else.
    #[test]
    fn auto_tool_calls_need_a_template_that_shows_tools_and_a_markup() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/chat-templates");
        let hermes =
            ChatTemplate::new(&std::fs::read_to_string(dir.join("hermes-tools.jinja")).unwrap())
                .unwrap();
        let blind = ChatTemplate::chatml();
        let json_calls = ChatTemplate::new(
            "{% for t in tools %}{{ t | tojson }}{% endfor %}{% for m in messages %}\
             {{ m.content }}{% endfor %}",
        )
        .unwrap();
        let tokenizer = crate::openai::server::tests::tiny_tokenizer();
        assert_eq!(
            ToolCallParser::Detect.auto_tool_calls(&hermes, &tokenizer),
            Ok(ToolCallFormat::Hermes)
        );
        assert_eq!(
            ToolCallParser::Hermes.auto_tool_calls(&json_calls, &tokenizer),
            Ok(ToolCallFormat::Hermes)
        );
        for (chat, parser, why) in [
            (&hermes, ToolCallParser::None, "--tool-call-parser=none"),
            (
                &json_calls,
                ToolCallParser::Detect,
                "teaches no tool-call markup",
            ),
            (
                &blind,
                ToolCallParser::Detect,
                "does not show the model the tools",
            ),
            (
                &blind,
                ToolCallParser::Hermes,
                "does not show the model the tools",
            ),
        ] {
            let e = parser.auto_tool_calls(chat, &tokenizer).unwrap_err();
            assert!(e.contains(why), "{parser:?}: {e}");
        }
        // A tokenizer whose `<tool_call>` is a special token: answers' text would lack it.
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-llama");
        let mut json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer.json")).unwrap())
                .unwrap();
        json["added_tokens"]
            .as_array_mut()
            .unwrap()
            .push(serde_json::json!({
            "id": 384, "content": "<tool_call>", "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true}));
        let file = std::env::temp_dir().join(format!(
            "duet-special-tool-call-{}.json",
            std::process::id()
        ));
        std::fs::write(&file, json.to_string()).unwrap();
        let special = Tokenizer::from_hf_file(&file).unwrap();
        std::fs::remove_file(&file).unwrap();
        let e = ToolCallParser::Detect
            .auto_tool_calls(&hermes, &special)
            .unwrap_err();
        assert!(e.contains("`<tool_call>` is a special token"), "{e}");
    }
}
