//! A streamed tool call: the answer's text, as the core streams it, turned into the `tool_calls`
//! deltas of OpenAI's chunks. A call's first delta names it (its id, type and function name);
//! the next ones add to its arguments, so a client sees the arguments as they are generated.
//!
//! - A call of a named function streams its text as the arguments from the first token.
//! - A call of `tool_choice: "required"` is the text `{"name": …, "arguments": {…}}` (the
//!   grammar puts the name first): its head is held until the arguments object opens, which
//!   names the call, and the arguments stream until that object closes; the outer object's
//!   closing brace is not theirs.
//! - A named or `required` answer is always a call, even one cut short by `max_tokens` (its
//!   finish reason then says `length`): cut before its arguments opened, it is the call of the
//!   name written so far, with no arguments.
//! - Under `tool_choice: "auto"` the model answers in text and may write calls in its own markup
//!   ([`ToolCallFormat`]): the text streams as content, a call opener ends it, and the call
//!   inside streams as a `required` one does, until its closer; more calls may follow, with the
//!   next index. Text that may be the start of a marker is held until it is known not to be;
//!   whitespace before a call, between calls and after the last is not content.
//!
//! A whole (unstreamed) answer is this stream read in one piece, so the two agree
//! ([`whole_answer`]).

use duet_model::tool_calls::ToolCallFormat;

use super::request::ToolAnswer;
use super::wire::{CalledFunction, FunctionChunk, ToolCall, ToolCallChunk};

/// What a piece of the answer's text adds to the stream.
#[derive(Debug, Default, PartialEq)]
pub struct StreamedPiece {
    pub tool_calls: Vec<ToolCallChunk>,
    /// Text that is the message's content: under `auto`, the text around calls.
    pub content: Option<String>,
}

impl StreamedPiece {
    fn add_content(&mut self, text: &str) {
        if !text.is_empty() {
            self.content.get_or_insert_default().push_str(text);
        }
    }
}

/// Where a call's text `{"name": …, "arguments": {…}}` stands.
enum CallText {
    /// Before the arguments object opens: the text so far.
    Head(String),
    /// Inside the arguments object.
    Arguments(JsonDepth),
    /// The arguments object has closed; what follows closes the call.
    Closed,
}

/// One call as it streams.
struct Call {
    index: u32,
    id: String,
    /// The function, when `tool_choice` named it: then every piece is arguments.
    named: Option<String>,
    text: CallText,
    started: bool,
}

impl Call {
    fn new(request_id: &str, index: u32, named: Option<String>) -> Self {
        Self {
            index,
            id: call_id(request_id, index),
            named,
            text: CallText::Head(String::new()),
            started: false,
        }
    }

    /// The delta the next piece of the call's text adds, if any.
    fn push(&mut self, text: &str) -> Option<ToolCallChunk> {
        if let Some(named) = &self.named {
            if self.started && text.is_empty() {
                return None;
            }
            let name = named.clone();
            return Some(self.delta(name, text.to_string()));
        }
        // The call's name when this piece opens its arguments, and the text read inside them.
        let (name, mut arguments) = match &mut self.text {
            CallText::Head(head) => {
                head.push_str(text);
                match split_head(head) {
                    Some((name, start)) => {
                        // The head from the brace on is the first of the arguments.
                        let opened = head.split_off(start);
                        self.text = CallText::Arguments(JsonDepth::default());
                        (Some(name), opened)
                    }
                    None => (None, String::new()),
                }
            }
            CallText::Arguments(_) => (None, text.to_string()),
            CallText::Closed => (None, String::new()),
        };
        if let CallText::Arguments(depth) = &mut self.text
            && let Some(end) = depth.close_of(&arguments)
        {
            arguments.truncate(end);
            self.text = CallText::Closed;
        }
        match name {
            Some(name) => Some(self.delta(name, arguments)),
            None if self.started && !arguments.is_empty() => {
                Some(self.delta(String::new(), arguments))
            }
            None => None,
        }
    }

    /// The call's text has ended. A head that never opened an object of arguments is parsed
    /// whole (its arguments are another value): `Err` with its text when it is no call.
    fn finish(&mut self) -> Result<Option<ToolCallChunk>, String> {
        let (None, CallText::Head(head)) = (&self.named, &mut self.text) else {
            return Ok(None);
        };
        let head = std::mem::take(head);
        match parse_call(&head) {
            Some((name, arguments)) => Ok(Some(self.delta(name, arguments))),
            None => Err(head),
        }
    }

    /// The call's first delta (with its id and name), or a later one (arguments only).
    fn delta(&mut self, name: String, arguments: String) -> ToolCallChunk {
        let first = !std::mem::replace(&mut self.started, true);
        ToolCallChunk {
            index: self.index,
            id: first.then(|| self.id.clone()),
            kind: first.then_some("function"),
            function: FunctionChunk {
                name: first.then_some(name),
                arguments,
            },
        }
    }
}

/// An `auto` answer: text, and calls in the model's markup.
struct AutoCalls {
    format: ToolCallFormat,
    request_id: String,
    /// Text read but not yet given out: a possible marker's start, trailing whitespace.
    held: String,
    /// The whitespace before the call being read: content if it turns out no call.
    gap: String,
    /// The call being read, between its opener and closer.
    call: Option<Call>,
    /// Calls opened so far.
    calls: u32,
}

impl AutoCalls {
    fn push(&mut self, text: &str, last: bool, piece: &mut StreamedPiece) {
        let (open, close) = self.format.delimiters();
        self.held.push_str(text);
        loop {
            let Some(call) = &mut self.call else {
                if let Some(at) = self.held.find(open) {
                    let body = self.held[..at].trim_end().len();
                    piece.add_content(self.content_after_calls(&self.held[..body]));
                    self.gap = self.held[body..at].to_string();
                    self.held.drain(..at + open.len());
                    self.call = Some(Call::new(&self.request_id, self.calls, None));
                    self.calls += 1;
                    continue;
                }
                // Held back: what may start an opener, and the whitespace before it (no
                // content if a call follows).
                let keep = if last {
                    0
                } else {
                    let body = self.held.len() - marker_start(&self.held, open);
                    self.held.len() - self.held[..body].trim_end().len()
                };
                let give = self.held.len() - keep;
                let given: String = self.held.drain(..give).collect();
                let given = if last && self.calls > 0 {
                    given.trim_end()
                } else {
                    &given
                };
                piece.add_content(self.content_after_calls(given));
                return;
            };
            let (text, closer) = match self.held.find(close) {
                Some(at) => {
                    let text = self.held[..at].to_string();
                    self.held.drain(..at + close.len());
                    (text, close)
                }
                None if last => (std::mem::take(&mut self.held), ""),
                None => {
                    let give = self.held.len() - marker_start(&self.held, close);
                    piece.tool_calls.extend(call.push(&self.held[..give]));
                    self.held.drain(..give);
                    return;
                }
            };
            piece.tool_calls.extend(call.push(&text));
            match call.finish() {
                Ok(chunk) => piece.tool_calls.extend(chunk),
                // Not a call after all: its text is content as it was written.
                Err(head) => piece.add_content(&format!("{}{open}{head}{closer}", self.gap)),
            }
            self.call = None;
            if last && self.held.is_empty() {
                return;
            }
        }
    }

    /// `text` as content: after a call, text that is only whitespace is not.
    fn content_after_calls<'t>(&self, text: &'t str) -> &'t str {
        if self.calls > 0 && text.trim().is_empty() {
            ""
        } else {
            text
        }
    }
}

/// The length of the longest end of `text` that begins `marker` (and may become it).
fn marker_start(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n) && marker.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

enum Mode {
    /// A named function's or a `required` answer's one call.
    One(Call),
    Auto(AutoCalls),
}

/// One answer's tool-call stream.
pub struct ToolCallStream {
    mode: Mode,
    called: bool,
}

impl ToolCallStream {
    /// For an answer that calls or may call a tool; `None` for one in text.
    pub fn new(answer: &ToolAnswer, request_id: &str) -> Option<Self> {
        let mode = match answer {
            ToolAnswer::Text => return None,
            ToolAnswer::Named(name) => Mode::One(Call::new(request_id, 0, Some(name.clone()))),
            ToolAnswer::Required => Mode::One(Call::new(request_id, 0, None)),
            ToolAnswer::Auto(format) => Mode::Auto(AutoCalls {
                format: *format,
                request_id: request_id.to_string(),
                held: String::new(),
                gap: String::new(),
                call: None,
                calls: 0,
            }),
        };
        Some(Self {
            mode,
            called: false,
        })
    }

    /// Whether a call has been streamed (the answer's finish is then `tool_calls`).
    pub fn called(&self) -> bool {
        self.called
    }

    /// The next piece of the answer's text; `last` when the answer ends with it.
    pub fn push(&mut self, text: &str, last: bool) -> StreamedPiece {
        let mut piece = StreamedPiece::default();
        match &mut self.mode {
            Mode::One(call) => {
                piece.tool_calls.extend(call.push(text));
                if last {
                    match call.finish() {
                        Ok(chunk) => piece.tool_calls.extend(chunk),
                        // Cut short before its arguments opened: still the call asked for.
                        Err(head) => piece
                            .tool_calls
                            .push(call.delta(name_so_far(&head), String::new())),
                    }
                }
            }
            Mode::Auto(auto) => auto.push(text, last, &mut piece),
        }
        self.called |= !piece.tool_calls.is_empty();
        piece
    }

    /// A whole answer's content and calls: its text read as one piece.
    pub fn read_whole(mut self, text: &str) -> (Option<String>, Vec<ToolCall>) {
        let piece = self.push(text, true);
        let mut calls: Vec<ToolCall> = Vec::new();
        for chunk in piece.tool_calls {
            match calls.get_mut(chunk.index as usize) {
                Some(call) => call.function.arguments.push_str(&chunk.function.arguments),
                None => calls.push(ToolCall {
                    id: chunk.id.unwrap_or_default(),
                    kind: "function",
                    function: CalledFunction {
                        name: chunk.function.name.unwrap_or_default(),
                        arguments: chunk.function.arguments,
                    },
                }),
            }
        }
        (piece.content, calls)
    }
}

/// The id of a tool call a request's answer makes: the `index`th (0 for the first).
fn call_id(request_id: &str, index: u32) -> String {
    match index {
        0 => format!("call_{request_id}"),
        n => format!("call_{request_id}_{n}"),
    }
}

/// The function's name and its arguments' JSON text of a call written as
/// `{"name": …, "arguments": …}` (missing arguments: none, `{}`).
fn parse_call(text: &str) -> Option<(String, String)> {
    let v: serde_json::Value = serde_json::from_str(text).ok()?;
    let arguments = v
        .get("arguments")
        .map_or_else(|| "{}".into(), |a| a.to_string());
    Some((v.get("name")?.as_str()?.to_string(), arguments))
}

/// A finished answer's content and calls: its text read as the stream reads it, in one piece.
pub fn whole_answer(
    answer: &ToolAnswer,
    text: &str,
    request_id: &str,
) -> (Option<String>, Vec<ToolCall>) {
    match ToolCallStream::new(answer, request_id) {
        Some(stream) => stream.read_whole(text),
        None => (Some(text.to_string()), Vec::new()),
    }
}

/// The function name a call's head has written so far: `get_wea` of `{"name": "get_wea`.
fn name_so_far(head: &str) -> String {
    let Some((_, rest)) = head.split_once("\"name\"") else {
        return String::new();
    };
    let Some(rest) = rest.trim_start().strip_prefix(':') else {
        return String::new();
    };
    let Some(rest) = rest.trim_start().strip_prefix('"') else {
        return String::new();
    };
    let mut escaped = false;
    let end = rest
        .char_indices()
        .find_map(|(i, c)| {
            let closes = !escaped && c == '"';
            escaped = !escaped && c == '\\';
            closes.then_some(i)
        })
        .unwrap_or(rest.len());
    // The string's text, less an escape sequence cut in the middle.
    let mut raw = &rest[..end];
    loop {
        if let Ok(name) = serde_json::from_str::<String>(&format!("\"{raw}\"")) {
            return name;
        }
        match raw.char_indices().last() {
            Some((i, _)) => raw = &raw[..i],
            None => return String::new(),
        }
    }
}

/// The function's name and where its arguments object opens, once the head of a call has
/// reached that brace (`{"name": "f", "arguments": {`).
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
            chunks.extend(piece.tool_calls);
            if let Some(text) = piece.content {
                content.get_or_insert_with(String::new).push_str(&text);
            }
        }
        assert_eq!(s.called(), !chunks.is_empty());
        (chunks, content)
    }

    /// `text` in pieces of `size` bytes (at character boundaries).
    fn split(text: &str, size: usize) -> Vec<&str> {
        let mut pieces = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            let mut end = size.min(rest.len());
            while !rest.is_char_boundary(end) {
                end += 1;
            }
            let (piece, after) = rest.split_at(end);
            pieces.push(piece);
            rest = after;
        }
        pieces
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

    /// A `required` answer cut short before its arguments open is still a call: the name written
    /// so far, no arguments. One whose arguments are not an object is parsed whole at the end.
    #[test]
    fn a_head_that_never_opens_its_arguments_is_still_one_call() {
        for (pieces, name) in [
            (&["{\"name\": \"g", "et_ti"][..], "get_ti"),
            (&["{\"name\":\"get_time\",\"argu"], "get_time"),
            (&["{\"name\":\"a\\u00e9\\u0"], "aé"),
            (&["{\"na"], ""),
        ] {
            let (chunks, content) = stream(ToolAnswer::Required, pieces);
            assert_eq!(content, None, "{pieces:?}");
            assert_eq!(chunks.len(), 1, "{pieces:?}");
            assert_eq!(chunks[0].function.name.as_deref(), Some(name));
            assert_eq!(chunks[0].function.arguments, "");
            assert_eq!(chunks[0].id.as_deref(), Some("call_9"));
        }
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

    const HERMES: ToolAnswer = ToolAnswer::Auto(ToolCallFormat::Hermes);

    /// Under `auto`, text before the calls streams as content, each `<tool_call>` block becomes
    /// a call with the next index (its first delta names it, the rest add arguments), the
    /// whitespace around the blocks is dropped, and all of it whatever the pieces' boundaries
    /// (one byte to whole) and equal to the unstreamed answer.
    #[test]
    fn auto_streams_text_then_each_call_in_the_models_markup() {
        let text = "Let me check < both.\n\n<tool_call>\n{\"name\": \"get_weather\", \
                    \"arguments\": {\"city\": \"Zürich </tool\", \"days\": [2]}}\n</tool_call>\n\
                    <tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>\n";
        let expected = [
            (
                "call_9",
                "get_weather",
                r#"{"city": "Zürich </tool", "days": [2]}"#,
            ),
            ("call_9_1", "get_time", "{}"),
        ];
        for size in 1..=text.len() {
            let (chunks, content) = stream(HERMES, &split(text, size));
            assert_eq!(
                content.as_deref(),
                Some("Let me check < both."),
                "size {size}"
            );
            for (index, (id, name, args)) in expected.iter().enumerate() {
                let call: Vec<&ToolCallChunk> =
                    chunks.iter().filter(|c| c.index == index as u32).collect();
                assert_eq!(call[0].id.as_deref(), Some(*id), "size {size}");
                assert_eq!(call[0].function.name.as_deref(), Some(*name));
                assert!(
                    call[1..]
                        .iter()
                        .all(|c| c.id.is_none() && c.function.name.is_none())
                );
                let joined: String = call.iter().map(|c| c.function.arguments.as_str()).collect();
                assert_eq!(joined, *args, "size {size}");
            }
        }
        let (content, calls) = ToolCallStream::new(&HERMES, "9").unwrap().read_whole(text);
        assert_eq!(content.as_deref(), Some("Let me check < both."));
        let calls: Vec<(&str, &str, &str)> = calls
            .iter()
            .map(|c| {
                (
                    c.id.as_str(),
                    c.function.name.as_str(),
                    c.function.arguments.as_str(),
                )
            })
            .collect();
        assert_eq!(calls, expected);
    }

    /// An `auto` answer in text is its text exactly, markup-like pieces and trailing whitespace
    /// included, and makes no call; a block that is no call (not JSON, no name) stays content,
    /// markers and all; a call the answer ends inside, before its closer, is still a call.
    #[test]
    fn auto_text_and_broken_blocks_stay_content() {
        for text in ["Use <tool> or <tool_cal, not <b>.\n", "a <", "plain"] {
            for size in 1..=text.len() {
                let (chunks, content) = stream(HERMES, &split(text, size));
                assert!(chunks.is_empty(), "{text:?} size {size}");
                assert_eq!(content.as_deref(), Some(text), "size {size}");
            }
        }
        let broken = "Try:\n<tool_call>\nnot json\n</tool_call>";
        for size in 1..=broken.len() {
            let (chunks, content) = stream(HERMES, &split(broken, size));
            assert!(chunks.is_empty(), "size {size}");
            assert_eq!(content.as_deref(), Some(broken), "size {size}");
        }
        let unclosed = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}";
        let (chunks, content) = stream(HERMES, &split(unclosed, 5));
        assert_eq!(content, None);
        assert_eq!(chunks[0].function.name.as_deref(), Some("f"));
        assert_eq!(arguments(&chunks), r#"{"a": 1}"#);
        let (chunks, _) = stream(HERMES, &["<tool_call>{\"name\": \"g\"}</tool_call>"]);
        assert_eq!(
            (
                chunks[0].function.name.as_deref(),
                chunks[0].function.arguments.as_str()
            ),
            (Some("g"), "{}")
        );
    }

    /// A finished answer's calls: a named function's text is its arguments, a `required`
    /// answer's text names the call, whole or cut short; `auto` reads the markup; a plain
    /// answer is content.
    #[test]
    fn whole_answers_are_read_into_calls() {
        let (content, calls) = whole_answer(
            &ToolAnswer::Named("weather".into()),
            r#"{"city":"Paris"}"#,
            "7",
        );
        let call = &calls[0];
        assert_eq!(
            (content, call.id.as_str(), call.function.name.as_str()),
            (None, "call_7", "weather")
        );
        assert_eq!(call.function.arguments, r#"{"city":"Paris"}"#);
        let (_, calls) = whole_answer(
            &ToolAnswer::Required,
            r#"{"name":"time","arguments":{}}"#,
            "8",
        );
        assert_eq!(
            (
                calls[0].function.name.as_str(),
                calls[0].function.arguments.as_str()
            ),
            ("time", "{}")
        );
        // Cut short by max_tokens: still the call, with what was written of it.
        let (content, calls) = whole_answer(&ToolAnswer::Required, r#"{"name":"time","argu"#, "9");
        assert_eq!(content, None);
        assert_eq!(
            (
                calls[0].function.name.as_str(),
                calls[0].function.arguments.as_str()
            ),
            ("time", "")
        );
        let (content, calls) =
            whole_answer(&ToolAnswer::Named("weather".into()), r#"{"city":"Par"#, "9");
        assert_eq!(content, None);
        assert_eq!(calls[0].function.arguments, r#"{"city":"Par"#);
        let (content, calls) = whole_answer(&ToolAnswer::Text, "{}", "9");
        assert_eq!((content.as_deref(), calls.len()), (Some("{}"), 0));
        let (content, calls) = whole_answer(
            &HERMES,
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
}
