//! How a model writes tool calls into its answer, for `tool_choice: "auto"`: the model decides
//! whether to call a tool, and the server finds the calls in the answer by the model's own
//! markup, which its chat template teaches it.

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
}
