//! How a model writes tool calls into its answer, for `tool_choice: "auto"`: the model decides
//! whether to call a tool, and the server finds the calls in the answer by the model's own
//! markup, which its chat template teaches it.

/// The JSON Schema of one call of one of `tools` (each a function's name and its parameters'
/// schema): `{"name": the function, "arguments": its parameters}`, the name first.
pub fn call_schema<'t>(
    tools: impl IntoIterator<Item = (&'t str, serde_json::Value)>,
) -> serde_json::Value {
    let calls: Vec<serde_json::Value> = tools
        .into_iter()
        .map(|(name, parameters)| {
            serde_json::json!({
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": parameters},
                "required": ["name", "arguments"],
                "additionalProperties": false,
            })
        })
        .collect();
    serde_json::json!({"anyOf": calls})
}

/// A model's markup for tool calls in its answer text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolCallFormat {
    /// `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`, one block per call, after
    /// any text (Hermes 2 Pro and 3, Qwen 2.5 and 3, SmolLM3).
    Hermes,
}

impl ToolCallFormat {
    /// The format a chat template teaches its model, if duet reads it.
    pub fn detect(template: &str) -> Option<Self> {
        // Qwen3-Coder's template also says `<tool_call>`, around XML `<function=…>` calls.
        (template.contains("<tool_call>") && !template.contains("<function="))
            .then_some(Self::Hermes)
    }

    /// The text that opens a call and the text that closes it; between them is the JSON object
    /// `{"name": …, "arguments": …}`.
    pub fn delimiters(self) -> (&'static str, &'static str) {
        match self {
            Self::Hermes => ("<tool_call>", "</tool_call>"),
        }
    }

    /// A Lark grammar (llguidance's dialect) of an answer in this markup whose calls are held
    /// to `call_schema`, the JSON Schema of one call's `{"name": …, "arguments": …}` (held as
    /// every JSON Schema is: [`crate::json_schema::with_defaults`]): any text,
    /// until the text opens a call; then a call that validates, and its closer; then any text
    /// again, and more calls. The text before an opener is one lazy lexeme that ends at the
    /// opener's first occurrence, so an opener always starts a call.
    pub fn grammar(self, call_schema: &serde_json::Value) -> String {
        let (open, close) = self.delimiters();
        let call_schema = crate::json_schema::with_defaults(call_schema.clone());
        format!(
            "start: call* TEXT\n\
             call: call_head WS %json {call_schema} WS {close:?}\n\
             call_head[lazy]: TEXT {open:?}\n\
             TEXT: /(.|\\n)*/\n\
             WS: /[ \\t\\n]*/\n"
        )
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Hermes => "hermes",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Templates that teach `<tool_call>` JSON blocks are Hermes; XML calls inside the same tag
    /// (Qwen3-Coder) and templates without calls are not read.
    #[test]
    fn the_format_is_read_off_the_chat_template() {
        let hermes = "{%- if tools %}For each function call, return a json object with function \
                      name and arguments within <tool_call></tool_call> XML tags{%- endif %}";
        assert_eq!(ToolCallFormat::detect(hermes), Some(ToolCallFormat::Hermes));
        let xml = "<tool_call>\n<function=example_function_name>\n</function>\n</tool_call>";
        assert_eq!(ToolCallFormat::detect(xml), None);
        assert_eq!(ToolCallFormat::detect("{{ messages[0]['content'] }}"), None);
    }

    /// Under the grammar the text is free until it opens a call; then only a call of the
    /// schema may follow (here the one tool `f` with an integer `n`), and its closer; then text
    /// again. An answer in text alone may end anywhere; one inside a call may not.
    #[test]
    fn the_grammar_frees_the_text_and_holds_the_calls() {
        use crate::params::Constraint;

        let (compiler, _) = crate::grammar::tests::compiler();
        let schema = call_schema([(
            "f",
            serde_json::json!({"type": "object", "properties": {"n": {"type": "integer"}},
                               "required": ["n"], "additionalProperties": false}),
        )]);
        let grammar = Constraint::Lark(ToolCallFormat::Hermes.grammar(&schema));
        // The tiny tokenizer's single bytes are ids 3 + byte; `</s>` (2) ends the answer.
        let byte = |b: u8| 3 + b as u32;
        let allowed = |g: &mut crate::grammar::Grammar, b: u8| {
            let mut logits = vec![0.0f32; 384];
            g.mask(&mut logits);
            logits[byte(b) as usize].is_finite()
        };
        let ends = |g: &mut crate::grammar::Grammar| {
            let mut logits = vec![0.0f32; 384];
            g.mask(&mut logits);
            logits[2].is_finite()
        };
        let mut g = compiler.compile(&grammar).unwrap();
        let feed = |g: &mut crate::grammar::Grammar, text: &str| {
            for b in text.bytes() {
                assert!(allowed(g, b), "{:?} refused before {text:?}", b as char);
                g.accept(byte(b));
            }
        };
        feed(&mut g, "Any <b>text</b>, even <tool and {\"name\": 1}\n");
        assert!(ends(&mut g), "an answer in text may end");
        feed(&mut g, "<tool_call>\n");
        assert!(
            !allowed(&mut g, b'x') && !ends(&mut g),
            "a call must follow its opener"
        );
        feed(&mut g, "{\"name\":\"f\",\"arguments\":{\"n\":");
        assert!(!allowed(&mut g, b'"'), "n is an integer");
        feed(&mut g, "42}}\n");
        assert!(
            !allowed(&mut g, b'x') && !ends(&mut g),
            "the closer must follow the call"
        );
        feed(&mut g, "</tool_call>\nDone.");
        assert!(ends(&mut g));
        let mut wrong_name = compiler.compile(&grammar).unwrap();
        feed(&mut wrong_name, "<tool_call>{\"name\":\"");
        assert!(!allowed(&mut wrong_name, b'g'), "only the tools' names");
    }
}
