//! When a sequence stops, and its text as it grows: max tokens, stop token ids, stop strings
//! (never streamed partially: text that may still become a stop string is held back), and
//! incremental detokenization that never splits a UTF-8 character.

use crate::EngineError;
use duet_model::tokenizer::Tokenizer;

/// The text of a sequence's generated tokens, released in pieces that are final: whole UTF-8
/// characters, and never a piece of a (possible) stop string.
#[derive(Clone, Debug, Default)]
pub struct TextStream {
    ids: Vec<u32>,
    /// Tokens before `prefix_offset` are decoded and released; `prefix_offset..read_offset` is
    /// decoded again each time as left context (byte-level BPE tokens can join into one char).
    prefix_offset: usize,
    read_offset: usize,
    /// Decoded text not yet released because it could be the start of a stop string.
    held: String,
    stop_strings: Vec<String>,
    /// Bytes at the start of the text that were already delivered elsewhere (a resumed request).
    skip_bytes: usize,
}

impl TextStream {
    pub fn new(stop_strings: Vec<String>) -> Self {
        Self {
            stop_strings,
            ..Self::default()
        }
    }

    /// A stream that continues after `generated` tokens whose text was delivered up to
    /// `sent_bytes` (by another worker, before a failover): text is released only past it.
    pub fn resumed(
        tokenizer: &Tokenizer,
        stop_strings: Vec<String>,
        generated: &[u32],
        sent_bytes: usize,
    ) -> Result<Self, EngineError> {
        let mut s = Self {
            stop_strings,
            skip_bytes: sent_bytes,
            ..Self::default()
        };
        for &t in generated {
            s.push(tokenizer, t)?;
        }
        Ok(s)
    }

    /// Adds a token; returns the newly final text and whether a stop string was completed (the
    /// stop string and anything after it are dropped).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<(String, bool), EngineError> {
        self.ids.push(id);
        let prefix = tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset], true)?;
        let full = tokenizer.decode(&self.ids[self.prefix_offset..], true)?;
        if full.len() > prefix.len()
            && !full.ends_with('\u{FFFD}')
            && full.is_char_boundary(prefix.len())
        {
            self.held.push_str(&full[prefix.len()..]);
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
        }
        Ok(self.release())
    }

    /// Everything still held, at the end of the sequence (the final token may have been an
    /// incomplete character).
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> Result<String, EngineError> {
        let prefix = tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset], true)?;
        let full = tokenizer.decode(&self.ids[self.prefix_offset..], true)?;
        if full.len() > prefix.len() && full.is_char_boundary(prefix.len()) {
            self.held.push_str(&full[prefix.len()..]);
        }
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        let out = std::mem::take(&mut self.held);
        Ok(self.skip_delivered(out))
    }

    fn release(&mut self) -> (String, bool) {
        let (out, stopped) = self.release_final();
        (self.skip_delivered(out), stopped)
    }

    /// Drops the part of `out` that was already delivered before a resume.
    fn skip_delivered(&mut self, mut out: String) -> String {
        if self.skip_bytes > 0 {
            let mut cut = self.skip_bytes.min(out.len());
            while !out.is_char_boundary(cut) {
                cut -= 1;
            }
            out.drain(..cut);
            self.skip_bytes -= cut;
        }
        out
    }

    /// Text that is final now (not part of a possible stop string), and whether a stop string
    /// completed.
    fn release_final(&mut self) -> (String, bool) {
        if let Some(pos) = self
            .stop_strings
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
        {
            let out = self.held[..pos].to_string();
            self.held.clear();
            return (out, true);
        }
        // Hold back the longest tail that is a proper prefix of some stop string.
        let mut keep = 0;
        for s in &self.stop_strings {
            for (i, _) in s.char_indices().skip(1) {
                if i > keep && self.held.ends_with(&s[..i]) {
                    keep = i;
                }
            }
        }
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        (out, false)
    }
}
