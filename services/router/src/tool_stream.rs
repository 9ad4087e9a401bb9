//! A streamed tool call: the answer's text, as the core streams it, turned into the `tool_calls`
//! deltas of OpenAI's chunks. The first delta names the call (its id, type and function name);
//! the next ones add to its arguments, so a client sees the arguments as they are generated.
//!
//! A call of a named function streams its text as the arguments from the first token. A call of
//! `tool_choice: "required"` is the text `{"name": …, "arguments": {…}}` (the grammar puts the
//! name first): its head is held until the arguments object opens, which names the call, and the
//! arguments stream until that object closes; the outer object's closing brace is not theirs.

use serde::Serialize;

use crate::openai::{ToolAnswer, ToolCall, call_id};

/// One entry of a chunk's `delta.tool_calls`.
#[derive(Debug, PartialEq, Serialize)]
pub struct ToolCallChunk {
    /// Which call of the answer it belongs to (duet answers with one).
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

impl From<ToolCall> for ToolCallChunk {
    fn from(call: ToolCall) -> Self {
        Self {
            index: 0,
            id: Some(call.id),
            kind: Some(call.kind),
            function: FunctionChunk {
                name: Some(call.function.name),
                arguments: call.function.arguments,
            },
        }
    }
}

/// What a piece of the answer's text adds to the stream.
#[derive(Debug, Default, PartialEq)]
pub struct StreamedPiece {
    pub tool_call: Option<ToolCallChunk>,
    /// Text that is the message's content: a `required` answer whose text never became a call
    /// (cut short by `max_tokens` before its arguments), sent when the answer ends.
    pub content: Option<String>,
}

/// Where a `required` answer's text stands.
enum Required {
    /// Before the arguments object opens: the text so far.
    Head(String),
    /// Inside the arguments object.
    Arguments(JsonDepth),
    /// The arguments object has closed; what follows closes the call.
    Closed,
}

/// One answer's tool-call stream.
pub struct ToolCallStream {
    id: String,
    /// The function named by `tool_choice`; `None` for `required`.
    named: Option<String>,
    required: Required,
    started: bool,
}

impl ToolCallStream {
    /// For an answer that calls a tool; `None` for one in text.
    pub fn new(answer: &ToolAnswer, request_id: &str) -> Option<Self> {
        let named = match answer {
            ToolAnswer::Text => return None,
            ToolAnswer::Named(name) => Some(name.clone()),
            ToolAnswer::Required => None,
        };
        Some(Self {
            id: call_id(request_id),
            named,
            required: Required::Head(String::new()),
            started: false,
        })
    }

    /// Whether a call has been streamed (the answer's finish is then `tool_calls`).
    pub fn called(&self) -> bool {
        self.started
    }

    /// The next piece of the answer's text; `last` when the answer ends with it.
    pub fn push(&mut self, text: &str, last: bool) -> StreamedPiece {
        if let Some(named) = &self.named {
            if self.started && text.is_empty() {
                return StreamedPiece::default();
            }
            // Only the first delta names the call.
            let name = if self.started {
                String::new()
            } else {
                named.clone()
            };
            return StreamedPiece {
                tool_call: Some(self.delta(name, text.to_string())),
                content: None,
            };
        }
        // The call's name when this piece opens its arguments, and the text read inside them.
        let (name, inside) = match &mut self.required {
            Required::Head(head) => {
                head.push_str(text);
                match split_head(head) {
                    Some((name, start)) => {
                        // The head from the brace on is the first of the arguments.
                        let opened = head.split_off(start);
                        self.required = Required::Arguments(JsonDepth::default());
                        (Some(name), opened)
                    }
                    None => (None, String::new()),
                }
            }
            Required::Arguments(_) => (None, text.to_string()),
            Required::Closed => (None, String::new()),
        };
        let mut arguments = inside;
        if let Required::Arguments(depth) = &mut self.required
            && let Some(end) = depth.close_of(&arguments)
        {
            arguments.truncate(end);
            self.required = Required::Closed;
        }
        let mut piece = StreamedPiece::default();
        if let Some(name) = name {
            piece.tool_call = Some(self.delta(name, arguments));
        } else if self.started && !arguments.is_empty() {
            piece.tool_call = Some(self.delta(String::new(), arguments));
        }
        // At the end, a head that never opened an object of arguments is parsed whole (its
        // arguments are another value), or given back as content.
        if let (true, Required::Head(head)) = (last, &mut self.required) {
            let head = std::mem::take(head);
            match ToolAnswer::Required.call(&head, "") {
                Some(call) => {
                    self.started = true;
                    piece.tool_call = Some(ToolCallChunk {
                        id: Some(self.id.clone()),
                        ..call.into()
                    });
                }
                None => piece.content = Some(head),
            }
        }
        piece
    }

    /// The call's first delta (with its id and name), or a later one (arguments only).
    fn delta(&mut self, name: String, arguments: String) -> ToolCallChunk {
        let first = !std::mem::replace(&mut self.started, true);
        ToolCallChunk {
            index: 0,
            id: first.then(|| self.id.clone()),
            kind: first.then_some("function"),
            function: FunctionChunk {
                name: first.then_some(name),
                arguments,
            },
        }
    }
}

/// The function's name and where its arguments object opens, once the head of a `required`
/// answer has reached that brace (`{"name": "f", "arguments": {`).
fn split_head(head: &str) -> Option<(String, usize)> {
    let mut depth = JsonDepth::default();
    let start = head.char_indices().find_map(|(i, c)| {
        let outer = depth.depth == 1 && !depth.in_string;
        depth.step(c);
        (outer && c == '{').then_some(i)
    })?;
    // The head with a placeholder value closed is the call without its arguments.
    let call: serde_json::Value =
        serde_json::from_str(&format!("{}null}}", &head[..start])).ok()?;
    Some((call["name"].as_str()?.to_string(), start))
}

/// How deep a JSON text is nested, and whether it is inside a string, as it is read.
#[derive(Clone, Debug, Default)]
struct JsonDepth {
    depth: usize,
    in_string: bool,
    escaped: bool,
}

impl JsonDepth {
    fn step(&mut self, c: char) {
        if self.in_string {
            match (self.escaped, c) {
                (true, _) => self.escaped = false,
                (false, '\\') => self.escaped = true,
                (false, '"') => self.in_string = false,
                _ => {}
            }
            return;
        }
        match c {
            '"' => self.in_string = true,
            '{' | '[' => self.depth += 1,
            '}' | ']' => self.depth = self.depth.saturating_sub(1),
            _ => {}
        }
    }

    /// Reads `text` (a value that opened at depth 0); the byte just past the character that
    /// closes it, if `text` holds it.
    fn close_of(&mut self, text: &str) -> Option<usize> {
        text.char_indices().find_map(|(i, c)| {
            self.step(c);
            (self.depth == 0 && !self.in_string).then_some(i + c.len_utf8())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Streams `pieces` and returns the deltas' ids, names and arguments joined, and any content.
    fn stream(answer: ToolAnswer, pieces: &[&str]) -> (Vec<ToolCallChunk>, Option<String>) {
        let mut s = ToolCallStream::new(&answer, "9").unwrap();
        let mut chunks = Vec::new();
        let mut content = None;
        for (i, p) in pieces.iter().enumerate() {
            let piece = s.push(p, i + 1 == pieces.len());
            chunks.extend(piece.tool_call);
            content = content.or(piece.content);
        }
        assert_eq!(s.called(), !chunks.is_empty());
        (chunks, content)
    }

    fn arguments(chunks: &[ToolCallChunk]) -> String {
        chunks
            .iter()
            .map(|c| c.function.arguments.as_str())
            .collect()
    }

    /// The first delta carries the id, type and name, the others only arguments, whatever the
    /// pieces' boundaries; the arguments joined are the call's, without the outer object.
    #[test]
    fn a_required_call_streams_its_name_first_then_its_arguments() {
        let text = r#"{"name": "get_weather", "arguments": {"city": "Paris {\"x\"}", "n": [1, {"a": 2}]} }"#;
        let whole = r#"{"city": "Paris {\"x\"}", "n": [1, {"a": 2}]}"#;
        for split in [1, 2, 3, 7, 40, text.len()] {
            let pieces: Vec<String> = text
                .as_bytes()
                .chunks(split)
                .map(|c| String::from_utf8(c.to_vec()).unwrap())
                .collect();
            let pieces: Vec<&str> = pieces.iter().map(String::as_str).collect();
            let (chunks, content) = stream(ToolAnswer::Required, &pieces);
            assert_eq!(content, None, "split {split}");
            assert_eq!(arguments(&chunks), whole, "split {split}");
            assert_eq!(chunks[0].id.as_deref(), Some("call_9"));
            assert_eq!(chunks[0].kind, Some("function"));
            assert_eq!(chunks[0].function.name.as_deref(), Some("get_weather"));
            assert!(
                chunks[1..]
                    .iter()
                    .all(|c| c.id.is_none() && c.kind.is_none() && c.function.name.is_none()),
                "split {split}: {chunks:?}"
            );
            assert!(chunks.iter().all(|c| c.index == 0));
        }
    }

    /// A named function's text is its arguments from the first piece.
    #[test]
    fn a_named_call_streams_every_piece_as_arguments() {
        let (chunks, content) = stream(ToolAnswer::Named("f".into()), &["{\"a\"", ": 1}"]);
        assert_eq!(content, None);
        assert_eq!(chunks.len(), 2);
        assert_eq!(chunks[0].function.name.as_deref(), Some("f"));
        assert_eq!(chunks[1].id, None);
        assert_eq!(arguments(&chunks), "{\"a\": 1}");
    }

    /// A `required` answer cut short before its arguments open is no call: its text comes back
    /// as content at the end. One whose arguments are not an object is parsed whole at the end.
    #[test]
    fn a_head_that_never_opens_its_arguments_ends_as_content_or_one_whole_call() {
        let (chunks, content) = stream(ToolAnswer::Required, &["{\"name\": \"g", "et_ti"]);
        assert!(chunks.is_empty());
        assert_eq!(content.as_deref(), Some("{\"name\": \"get_ti"));
        let (chunks, content) = stream(
            ToolAnswer::Required,
            &["{\"name\": \"f\", ", "\"arguments\": 3}"],
        );
        assert_eq!(content, None);
        assert_eq!(chunks.len(), 1);
        assert_eq!(chunks[0].function.name.as_deref(), Some("f"));
        assert_eq!(chunks[0].function.arguments, "3");
        assert_eq!(chunks[0].id.as_deref(), Some("call_9"));
    }

    #[test]
    fn an_answer_in_text_has_no_tool_stream() {
        assert!(ToolCallStream::new(&ToolAnswer::Text, "1").is_none());
    }
}
