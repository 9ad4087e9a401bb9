//! Chat templates: the model's Jinja template (from GGUF `tokenizer.chat_template` or HF
//! `tokenizer_config.json`), rendered with minijinja the way HF `apply_chat_template` does
//! (trim_blocks, lstrip_blocks, `raise_exception`, and Python's str, dict and list methods through
//! minijinja-contrib's `pycompat`).

use std::path::Path;

use minijinja::value::Value;
use minijinja::{Environment, Error, ErrorKind};
use serde::Serialize;

use crate::gguf::GgufFile;
use crate::tokenizer::{TEXT_SPAN_END, TEXT_SPAN_START, Tokenizer};

const TEMPLATE_NAME: &str = "chat";

/// Used when the model has no template of its own.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

const ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// The calls an assistant turn made (OpenAI's `tool_calls`).
    pub tool_calls: Vec<ChatToolCall>,
    /// The call a `tool` turn answers.
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            ..Self::default()
        }
    }
}

/// A call of a function in an assistant turn of the conversation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChatToolCall {
    pub id: String,
    pub name: String,
    /// The arguments as JSON text.
    pub arguments: String,
}

/// A message as chat templates read it, in the shape HF `apply_chat_template` gives them: a
/// call's `arguments` is an object (templates write it with `tojson`) when its text is one, and
/// fields a turn lacks are undefined rather than empty.
#[derive(Serialize)]
struct TemplateMessage {
    role: String,
    content: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tool_calls: Vec<serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_call_id: Option<String>,
}

impl TemplateMessage {
    /// `m` with every special token in its text kept as text (see [`keep_as_text`]).
    fn new(m: &ChatMessage, special_tokens: &[String]) -> Self {
        let tool_calls = m
            .tool_calls
            .iter()
            .map(|call| {
                // Special tokens can only stand inside the JSON's strings, so the wrapped text
                // parses as the original does.
                let arguments = keep_as_text(&call.arguments, special_tokens);
                let arguments = serde_json::from_str::<serde_json::Value>(&arguments)
                    .ok()
                    .filter(serde_json::Value::is_object)
                    .unwrap_or(serde_json::Value::String(arguments));
                serde_json::json!({
                    "id": keep_as_text(&call.id, special_tokens),
                    "type": "function",
                    "function": {"name": keep_as_text(&call.name, special_tokens), "arguments": arguments},
                })
            })
            .collect();
        Self {
            role: m.role.clone(),
            content: keep_as_text(&m.content, special_tokens),
            tool_calls,
            tool_call_id: m
                .tool_call_id
                .as_deref()
                .map(|id| keep_as_text(id, special_tokens)),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("chat template {origin}: does not compile: {why}")]
    Syntax { origin: String, why: String },
    #[error("chat template {origin}: rendering failed: {why}")]
    Render { origin: String, why: String },
    /// The template itself rejected the conversation (`raise_exception`).
    #[error("chat template {origin}: {message}")]
    Rejected { origin: String, message: String },
    #[error("unknown chat role {role:?} (expected system, user, assistant or tool)")]
    UnknownRole { role: String },
    #[error("{origin}: cannot read chat template: {why}")]
    Load { origin: String, why: String },
    /// `chat_template_kwargs` that are not a JSON object, or set a variable the server sets.
    #[error("chat_template_kwargs: {0}")]
    Variables(String),
}

/// Variables the server gives every chat template; extra variables cannot replace them.
const SERVER_VARIABLES: [&str; 4] = [
    "messages",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
];

/// Extra chat-template variables (`chat_template_kwargs`), parsed from a JSON object's text.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TemplateVariables(serde_json::Map<String, serde_json::Value>);

impl TemplateVariables {
    /// `text`: a JSON object, or empty for none.
    pub fn parse(text: &str) -> Result<Self, ChatError> {
        if text.trim().is_empty() {
            return Ok(Self::default());
        }
        let value: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| ChatError::Variables(format!("not valid JSON: {e}")))?;
        Self::from_value(value)
    }

    /// `value` must be a JSON object.
    pub fn from_value(value: serde_json::Value) -> Result<Self, ChatError> {
        let serde_json::Value::Object(map) = value else {
            return Err(ChatError::Variables(format!(
                "must be a JSON object, got {value}"
            )));
        };
        if let Some(name) = SERVER_VARIABLES.iter().find(|n| map.contains_key(**n)) {
            return Err(ChatError::Variables(format!(
                "`{name}` is set by the server and cannot be given"
            )));
        }
        Ok(Self(map))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// `content` with every occurrence of a special token wrapped in a text span (see
/// [`TEXT_SPAN_START`]); `special_tokens` longest first, so the longest one matching wins.
fn keep_as_text(content: &str, special_tokens: &[String]) -> String {
    let mut out = String::with_capacity(content.len());
    let mut rest = content;
    'scan: while let Some(c) = rest.chars().next() {
        for special in special_tokens.iter().filter(|s| !s.is_empty()) {
            if let Some(after) = rest.strip_prefix(special.as_str()) {
                out.push(TEXT_SPAN_START);
                out.push_str(special);
                out.push(TEXT_SPAN_END);
                rest = after;
                continue 'scan;
            }
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    out
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    origin: String,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .field("len", &self.source.len())
            .finish()
    }
}

/// Marker put in front of `raise_exception` messages so they can be told apart from other
/// render errors.
const RAISE_MARKER: &str = "\u{1}raise_exception:";

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(
        ErrorKind::InvalidOperation,
        format!("{RAISE_MARKER}{msg}"),
    ))
}

/// Python's `json.dumps` spacing, which HF's `tojson` uses: `", "` between items and `": "`
/// after keys (serde_json's compact form has no spaces).
struct PythonSpacing;

impl PythonSpacing {
    fn item<W: ?Sized + std::io::Write>(writer: &mut W, first: bool) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }
}

impl serde_json::ser::Formatter for PythonSpacing {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        Self::item(writer, first)
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        Self::item(writer, first)
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
    ) -> std::io::Result<()> {
        writer.write_all(b": ")
    }
}

/// HF's `tojson`: `json.dumps(value, ensure_ascii=False, indent=indent)`, keys in their order.
fn tojson(value: Value, indent: Option<usize>) -> Result<Value, Error> {
    let mut out = Vec::new();
    let written = match indent {
        Some(n) => {
            let ind = vec![b' '; n];
            let fmt = serde_json::ser::PrettyFormatter::with_indent(&ind);
            value.serialize(&mut serde_json::Serializer::with_formatter(&mut out, fmt))
        }
        None => value.serialize(&mut serde_json::Serializer::with_formatter(
            &mut out,
            PythonSpacing,
        )),
    };
    written
        .map(|_| Value::from_safe_string(String::from_utf8(out).unwrap_or_default()))
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))
}

impl ChatTemplate {
    /// Compiles `source`.
    pub fn new(source: &str) -> Result<Self, ChatError> {
        Self::with_origin(source, "(inline)")
    }

    /// Compiles `source`; `origin` names it in errors.
    pub fn with_origin(source: &str, origin: &str) -> Result<Self, ChatError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.add_function("strftime_now", |fmt: String| -> Result<Value, Error> {
            // No clock dependence in templates: a fixed, plausible date keeps output deterministic.
            let _ = fmt;
            Ok(Value::from("26 Jul 2024"))
        });
        // Python's str / dict / list methods (`strip`, `startswith`, `items`, ...), which HF chat
        // templates call as if they ran under Jinja2 in Python.
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| ChatError::Syntax {
                origin: origin.into(),
                why: format!("{e:#}"),
            })?;
        Ok(Self {
            env,
            source: source.to_string(),
            origin: origin.to_string(),
            bos_token: String::new(),
            eos_token: String::new(),
        })
    }

    /// The fallback ChatML template.
    pub fn chatml() -> Self {
        Self::with_origin(CHATML_TEMPLATE, "(built-in ChatML)")
            .expect("the built-in template compiles")
    }

    /// Sets the `bos_token` / `eos_token` strings the template may refer to.
    pub fn with_special_tokens(mut self, bos_token: &str, eos_token: &str) -> Self {
        self.bos_token = bos_token.to_string();
        self.eos_token = eos_token.to_string();
        self
    }

    /// A template file (a model's `chat_template.jinja`, `--chat-template`); `bos_token` and
    /// `eos_token` are `tokenizer`'s BOS and first EOS.
    pub fn from_file(path: &Path, tokenizer: &Tokenizer) -> Result<Self, ChatError> {
        let origin = path.display().to_string();
        let src = std::fs::read_to_string(path).map_err(|e| ChatError::Load {
            origin: origin.clone(),
            why: e.to_string(),
        })?;
        let text = |id: Option<u32>| {
            id.and_then(|id| tokenizer.id_to_token(id))
                .unwrap_or_default()
        };
        let (bos, eos) = (
            text(tokenizer.bos_token_id()),
            text(tokenizer.eos_token_ids().first().copied()),
        );
        Ok(Self::with_origin(&src, &origin)?.with_special_tokens(&bos, &eos))
    }

    /// `tokenizer.chat_template` of a GGUF file, if it has one; `bos_token`/`eos_token` are set
    /// from the GGUF token list.
    pub fn from_gguf(file: &GgufFile) -> Result<Option<Self>, ChatError> {
        let origin = format!("{} (tokenizer.chat_template)", file.path().display());
        let load = |e: crate::gguf::GgufError| ChatError::Load {
            origin: origin.clone(),
            why: e.to_string(),
        };
        let Some(src) = file.get_str("tokenizer.chat_template").map_err(load)? else {
            return Ok(None);
        };
        let tokens = file
            .get_str_array("tokenizer.ggml.tokens")
            .map_err(load)?
            .unwrap_or(&[]);
        let token = |key: &str| -> Result<String, ChatError> {
            Ok(file
                .get_u32(key)
                .map_err(load)?
                .and_then(|id| tokens.get(id as usize))
                .cloned()
                .unwrap_or_default())
        };
        let (bos, eos) = (
            token("tokenizer.ggml.bos_token_id")?,
            token("tokenizer.ggml.eos_token_id")?,
        );
        Ok(Some(
            Self::with_origin(src, &origin)?.with_special_tokens(&bos, &eos),
        ))
    }

    /// `chat_template` of a HF `tokenizer_config.json`, if it has one. A list of named templates
    /// uses the one named "default".
    pub fn from_hf_tokenizer_config(path: &Path) -> Result<Option<Self>, ChatError> {
        let origin = path.display().to_string();
        let load = |why: String| ChatError::Load {
            origin: origin.clone(),
            why,
        };
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(load(e.to_string())),
        };
        let cfg: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| load(format!("not valid JSON: {e}")))?;
        let src = match cfg.get("chat_template") {
            None | Some(serde_json::Value::Null) => return Ok(None),
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Array(list)) => {
                let named = list
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"));
                match named
                    .and_then(|t| t.get("template"))
                    .and_then(|t| t.as_str())
                {
                    Some(s) => s.to_string(),
                    None => {
                        return Err(load(
                            "chat_template is a list without a \"default\" entry".into(),
                        ));
                    }
                }
            }
            Some(other) => return Err(load(format!("chat_template is not a string: {other}"))),
        };
        let special = |k: &str| -> String {
            match cfg.get(k) {
                Some(serde_json::Value::String(s)) => s.clone(),
                Some(serde_json::Value::Object(o)) => o
                    .get("content")
                    .and_then(|c| c.as_str())
                    .unwrap_or_default()
                    .to_string(),
                _ => String::new(),
            }
        };
        let origin = format!("{origin} (chat_template)");
        Ok(Some(Self::with_origin(&src, &origin)?.with_special_tokens(
            &special("bos_token"),
            &special("eos_token"),
        )))
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether the template shows the model the tools a request offers (its `tools` variable):
    /// a one-turn conversation rendered with a tool names it. Templates that ignore `tools`, or
    /// refuse the probe, do not.
    pub fn shows_tools(&self) -> bool {
        const PROBE: &str = "duet_probe_tool";
        let tools = serde_json::json!({"tools": [{"type": "function", "function": {
            "name": PROBE,
            "description": "Checks that the chat template shows tools.",
            "parameters": {"type": "object", "properties": {}},
        }}]});
        TemplateVariables::from_value(tools)
            .and_then(|tools| self.apply_with(&[ChatMessage::new("user", "Hi")], true, &[], &tools))
            .is_ok_and(|text| text.contains(PROBE))
    }

    /// Renders the conversation; with `add_generation_prompt` the assistant turn is opened.
    /// Every occurrence of `special_tokens` (the tokenizer's, [`Tokenizer::special_tokens`]) in
    /// a message's content is wrapped in a text span, so that [`Tokenizer::encode`] keeps it as
    /// text: only the template's own markup becomes special tokens, and content cannot forge a
    /// turn. Only the special tokens are wrapped, so filters applied to the content (`| trim`)
    /// work as before.
    pub fn apply(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        special_tokens: &[String],
    ) -> Result<String, ChatError> {
        self.apply_with(
            messages,
            add_generation_prompt,
            special_tokens,
            &TemplateVariables::default(),
        )
    }

    /// [`Self::apply`] with extra template variables (`chat_template_kwargs`), for example
    /// Qwen3's `enable_thinking`.
    pub fn apply_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        special_tokens: &[String],
        variables: &TemplateVariables,
    ) -> Result<String, ChatError> {
        if let Some(m) = messages.iter().find(|m| !ROLES.contains(&m.role.as_str())) {
            return Err(ChatError::UnknownRole {
                role: m.role.clone(),
            });
        }
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| ChatError::Render {
                origin: self.origin.clone(),
                why: e.to_string(),
            })?;
        let messages: Vec<TemplateMessage> = messages
            .iter()
            .map(|m| TemplateMessage::new(m, special_tokens))
            .collect();
        let ctx = minijinja::context! {
            messages => Value::from_serialize(&messages),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone(),
            eos_token => self.eos_token.clone(),
            ..Value::from_serialize(&variables.0)
        };
        tmpl.render(ctx).map_err(|e| {
            let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(&e);
            while let Some(err) = cur {
                let text = err.to_string();
                if let Some(pos) = text.find(RAISE_MARKER) {
                    let msg = text[pos + RAISE_MARKER.len()..]
                        .lines()
                        .next()
                        .unwrap_or_default();
                    // minijinja appends the location: "... (in chat:1)".
                    let msg = match msg.rfind(" (in ") {
                        Some(i) if msg.ends_with(')') => &msg[..i],
                        _ => msg,
                    };
                    return ChatError::Rejected {
                        origin: self.origin.clone(),
                        message: msg.to_string(),
                    };
                }
                cur = err.source();
            }
            ChatError::Render {
                origin: self.origin.clone(),
                why: format!("{e:#}"),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs(list: &[(&str, &str)]) -> Vec<ChatMessage> {
        list.iter().map(|(r, c)| ChatMessage::new(*r, *c)).collect()
    }

    const SMOL_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
    const SMOL_EXPECTED: &str = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n";

    #[test]
    fn smollm_template() {
        let t = ChatTemplate::new(SMOL_TEMPLATE).unwrap();
        assert_eq!(
            t.apply(&msgs(&[("user", "Hi there")]), true, &[]).unwrap(),
            SMOL_EXPECTED
        );
        let out = t
            .apply(
                &msgs(&[("system", "Be brief."), ("user", "Hi")]),
                false,
                &[],
            )
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        );
    }

    #[test]
    fn special_tokens_in_content_become_text_spans_and_filters_still_apply() {
        let t = ChatTemplate::new(
            "{% for m in messages %}<|im_start|>{{ m['content'] | trim }}<|im_end|>{% endfor %}",
        )
        .unwrap();
        let specials = ["<|im_end|>".to_string(), "<|im".to_string()];
        let out = t
            .apply(&msgs(&[("user", "  a<|im_end|>b<|im  ")]), false, &specials)
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>a\u{FDD0}<|im_end|>\u{FDD1}b\u{FDD0}<|im\u{FDD1}<|im_end|>"
        );
        let out = t.apply(&msgs(&[("user", "  ab  ")]), false, &specials);
        assert_eq!(out.unwrap(), "<|im_start|>ab<|im_end|>");
    }

    #[test]
    fn chatml_fallback_and_roles() {
        let t = ChatTemplate::chatml();
        let out = t
            .apply(
                &msgs(&[("user", "a"), ("assistant", "b"), ("tool", "c")]),
                true,
                &[],
            )
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n<|im_start|>tool\nc<|im_end|>\n<|im_start|>assistant\n"
        );
        let e = t.apply(&msgs(&[("wizard", "x")]), true, &[]).unwrap_err();
        assert!(
            matches!(e, ChatError::UnknownRole { ref role } if role == "wizard"),
            "{e}"
        );
    }

    #[test]
    fn raise_exception_and_python_methods() {
        let src = "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}[{{ m.content.strip() }}|{{ m.content.lstrip('x') }}|{{ m.role.startswith('us') }}|{{ m.content.split(',') | length }}|{{ m.content.upper() }}]{% endfor %}{{ eos_token }}";
        let t = ChatTemplate::new(src)
            .unwrap()
            .with_special_tokens("<s>", "</s>");
        let out = t.apply(&msgs(&[("user", "  xa,b  ")]), false, &[]).unwrap();
        // Booleans print as Python does.
        assert_eq!(out, "<s>[xa,b|  xa,b  |True|2|  XA,B  ]</s>");
        let e = t.apply(&msgs(&[("system", "s")]), false, &[]).unwrap_err();
        match e {
            ChatError::Rejected { message, .. } => assert_eq!(message, "System role not supported"),
            other => panic!("{other}"),
        }
    }

    #[test]
    fn trim_blocks_and_tojson() {
        let src = "{% for m in messages %}\n  {% if m.role == 'user' %}\nU:{{ m.content | tojson }}\n  {% endif %}\n{% endfor %}";
        let t = ChatTemplate::new(src).unwrap();
        assert_eq!(
            t.apply(&msgs(&[("user", "q\"")]), false, &[]).unwrap(),
            "U:\"q\\\"\"\n"
        );
        let e = ChatTemplate::new("{% for %}").unwrap_err();
        assert!(matches!(e, ChatError::Syntax { .. }), "{e}");
    }

    #[test]
    fn hf_tokenizer_config() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("tokenizer_config.json");
        assert!(
            ChatTemplate::from_hf_tokenizer_config(&p)
                .unwrap()
                .is_none()
        );
        let cfg = serde_json::json!({"chat_template": "{{ bos_token }}{{ messages[0].content }}", "bos_token": {"content": "<s>"}});
        std::fs::write(&p, cfg.to_string()).unwrap();
        let t = ChatTemplate::from_hf_tokenizer_config(&p).unwrap().unwrap();
        assert_eq!(
            t.apply(&msgs(&[("user", "x")]), false, &[]).unwrap(),
            "<s>x"
        );
    }

    #[test]
    fn real_model_template() {
        let p = crate::model_path::checkout_default_model();
        let f = GgufFile::open(&p).unwrap();
        let t = ChatTemplate::from_gguf(&f)
            .unwrap()
            .expect("SmolLM2 has a chat template");
        assert_eq!(
            t.apply(&msgs(&[("user", "Hi there")]), true, &[]).unwrap(),
            SMOL_EXPECTED
        );
    }

    /// `chat_template_kwargs` reach the template as variables (Qwen3's `enable_thinking`);
    /// anything but a JSON object, or a variable the server sets, is refused by name.
    #[test]
    fn extra_variables_reach_the_template() {
        let t = ChatTemplate::new(concat!(
            "{%- for message in messages %}{{- message.role + ':' + message.content + ';' }}",
            "{%- endfor %}{%- if add_generation_prompt %}{{- 'assistant:' }}",
            "{%- if enable_thinking is defined and enable_thinking is false %}",
            "{{- '<think></think>' }}{%- endif %}{%- endif %}"
        ))
        .unwrap();
        let m = msgs(&[("user", "hi")]);
        let with = |json: &str| {
            let vars = TemplateVariables::parse(json).unwrap();
            t.apply_with(&m, true, &[], &vars).unwrap()
        };
        assert_eq!(with(""), "user:hi;assistant:");
        assert_eq!(with(r#"{"enable_thinking": true}"#), "user:hi;assistant:");
        assert_eq!(
            with(r#"{"enable_thinking": false}"#),
            "user:hi;assistant:<think></think>"
        );
        for (bad, why) in [
            ("[1]", "must be a JSON object, got [1]"),
            ("{", "not valid JSON"),
            (
                r#"{"messages": []}"#,
                "`messages` is set by the server and cannot be given",
            ),
            (
                r#"{"add_generation_prompt": false}"#,
                "`add_generation_prompt` is set by the server",
            ),
        ] {
            let e = TemplateVariables::parse(bad).unwrap_err().to_string();
            assert!(
                e.starts_with("chat_template_kwargs: ") && e.contains(why),
                "{bad}: {e}"
            );
        }
    }

    /// The constructs Qwen3's template is made of (written here, not copied): a `namespace`
    /// found by walking the conversation backwards (`messages[::-1]`), an earlier assistant
    /// turn's reasoning dropped by splitting on `</think>` and stripping newlines, and the
    /// generation prompt's empty think block when `enable_thinking` is false (undefined: none).
    #[test]
    fn qwen3_style_templates_render_their_think_handling() {
        let src = concat!(
            "{%- set ns = namespace(searching=true, last_query_index=messages|length - 1) %}",
            "{%- for message in messages[::-1] %}",
            "{%- set index = (messages|length - 1) - loop.index0 %}",
            "{%- if ns.searching and message.role == 'user' %}",
            "{%- set ns.searching = false %}{%- set ns.last_query_index = index %}",
            "{%- endif %}{%- endfor %}",
            "{%- for message in messages %}",
            "{%- set content = message.content %}",
            "{%- if message.role == 'assistant' and '</think>' in content %}",
            "{%- set content = content.split('</think>')[-1].lstrip('\n') %}{%- endif %}",
            "{{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}",
            "{%- endfor %}",
            "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}",
            "{%- if enable_thinking is defined and enable_thinking is false %}",
            "{{- '<think>\n\n</think>\n\n' }}{%- endif %}{%- endif %}",
            "{{- '[last query ' ~ ns.last_query_index ~ ']' }}"
        );
        let t = ChatTemplate::new(src).unwrap();
        let out = t
            .apply(
                &msgs(&[
                    ("user", "2+2?"),
                    ("assistant", "<think>\nadd them\n</think>\n\n4"),
                    ("user", "and 3+3?"),
                ]),
                true,
                &[],
            )
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n\
             <|im_start|>user\nand 3+3?<|im_end|>\n<|im_start|>assistant\n[last query 2]"
        );
    }

    /// A conversation with tools, an assistant's calls (arguments as the JSON text OpenAI
    /// clients send) and tool results renders exactly as HF `apply_chat_template` renders it
    /// (Python jinja2; `tests/fixtures/chat-templates/render.py` wrote the expected text): the
    /// arguments reach the template as objects, `tojson` spaces JSON as Python does and keeps
    /// keys in order, and `tool_call_id` is defined on tool turns alone.
    #[test]
    fn a_tool_conversation_renders_as_hf_renders_it() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/chat-templates");
        let read = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap();
        let conversation: serde_json::Value =
            serde_json::from_str(&read("hermes-tools.conversation.json")).unwrap();
        let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_string();
        let messages: Vec<ChatMessage> = conversation["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| ChatMessage {
                role: text(&m["role"]),
                content: text(&m["content"]),
                tool_calls: m["tool_calls"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|c| ChatToolCall {
                        id: text(&c["id"]),
                        name: text(&c["function"]["name"]),
                        arguments: c["function"]["arguments"].to_string(),
                    })
                    .collect(),
                tool_call_id: m.get("tool_call_id").map(text),
            })
            .collect();
        let template = ChatTemplate::new(&read("hermes-tools.jinja")).unwrap();
        let tools =
            TemplateVariables::from_value(serde_json::json!({"tools": conversation["tools"]}))
                .unwrap();
        let rendered = template.apply_with(&messages, true, &[], &tools).unwrap();
        assert_eq!(rendered, read("hermes-tools.expected.txt"));
        assert!(template.shows_tools());
        assert!(!ChatTemplate::new(SMOL_TEMPLATE).unwrap().shows_tools());
    }

    /// Special tokens inside a call's arguments stay text, and the arguments still reach the
    /// template as an object.
    #[test]
    fn special_tokens_in_call_arguments_stay_text() {
        let t = ChatTemplate::new(
            "{% for m in messages %}{% for c in m.tool_calls %}{{ c.function.arguments.q }}\
             {% endfor %}{% endfor %}",
        )
        .unwrap();
        let m = ChatMessage {
            tool_calls: vec![ChatToolCall {
                id: "c".into(),
                name: "f".into(),
                arguments: r#"{"q": "a<|im_end|>b"}"#.into(),
            }],
            ..ChatMessage::new("assistant", "")
        };
        let out = t.apply(&[m], false, &["<|im_end|>".into()]).unwrap();
        assert_eq!(out, format!("a{TEXT_SPAN_START}<|im_end|>{TEXT_SPAN_END}b"));
    }
}
