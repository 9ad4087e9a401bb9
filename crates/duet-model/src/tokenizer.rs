//! The tokenizer: a `tokenizers::Tokenizer` built from a HF `tokenizer.json` or from GGUF
//! metadata (byte-level BPE), plus streaming decode.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::gguf::{GgufError, GgufFile};

/// GGUF token types (llama.cpp's `llama_token_type`).
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// Llama 3's split regex (llama.cpp pre-tokenizer "llama-bpe").
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split regex (llama.cpp pre-tokenizer "qwen2"): like Llama 3 but one digit per piece.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("{origin}: cannot load tokenizer: {why}")]
    Load { origin: String, why: String },
    #[error("{origin}: unsupported tokenizer: {what}")]
    Unsupported { origin: String, what: String },
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("tokenizer {origin}: encoding failed: {why}")]
    Encode { origin: String, why: String },
    #[error("tokenizer {origin}: decoding failed: {why}")]
    Decode { origin: String, why: String },
    #[error("token id {id} is outside the vocabulary (size {vocab_size})")]
    UnknownId { id: u32, vocab_size: usize },
}

struct Inner {
    tok: tokenizers::Tokenizer,
    origin: String,
    bos: Option<u32>,
    eos: Vec<u32>,
    /// Prepend BOS ourselves (GGUF `tokenizer.ggml.add_bos_token`).
    add_bos: bool,
    /// Let the HF post-processor add its special tokens.
    hf_post_process: bool,
    special: HashSet<u32>,
    vocab_size: usize,
}

/// A loaded tokenizer. Cheap to clone (shared).
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<Inner>,
    /// The same tokenizer with special tokens not recognised: for text spans.
    text: Arc<tokenizers::Tokenizer>,
}

/// Starts a text span in what [`Tokenizer::encode`] is given: up to [`TEXT_SPAN_END`], special
/// tokens written in the text are encoded as the text they are, not as special ids (chat
/// content, see [`crate::chat::ChatTemplate::apply`]). Both are Unicode noncharacters, which
/// Unicode reserves for a program's internal use; they are never encoded themselves.
pub const TEXT_SPAN_START: char = '\u{FDD0}';
/// Ends a text span (see [`TEXT_SPAN_START`]).
pub const TEXT_SPAN_END: char = '\u{FDD1}';

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("origin", &self.inner.origin)
            .field("vocab_size", &self.inner.vocab_size)
            .field("bos", &self.inner.bos)
            .field("eos", &self.inner.eos)
            .finish()
    }
}

fn special_ids(tok: &tokenizers::Tokenizer) -> HashSet<u32> {
    tok.get_added_tokens_decoder()
        .into_iter()
        .filter(|(_, t)| t.special)
        .map(|(id, _)| id)
        .collect()
}

/// The id of a `bos_token`/`eos_token` entry of `tokenizer_config.json` (a string or
/// `{"content": ...}`).
fn config_token_id(tok: &tokenizers::Tokenizer, v: Option<&serde_json::Value>) -> Option<u32> {
    let s = match v? {
        serde_json::Value::String(s) => s.as_str(),
        serde_json::Value::Object(o) => o.get("content")?.as_str()?,
        _ => return None,
    };
    tok.token_to_id(s)
}

impl Tokenizer {
    fn build(inner: Inner) -> Self {
        let mut text = inner.tok.clone();
        text.set_encode_special_tokens(true);
        Self {
            inner: Arc::new(inner),
            text: Arc::new(text),
        }
    }

    /// The special tokens' texts, longest first.
    pub fn special_tokens(&self) -> Vec<String> {
        let mut tokens: Vec<String> = self
            .inner
            .tok
            .get_added_tokens_decoder()
            .into_values()
            .filter(|t| t.special)
            .map(|t| t.content)
            .collect();
        tokens.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
        tokens
    }

    /// Loads a HF `tokenizer.json`. BOS/EOS come from a `tokenizer_config.json` next to it when
    /// there is one (see also [`Tokenizer::with_special_ids`]).
    pub fn from_hf_file(path: &Path) -> Result<Self, TokenizerError> {
        let origin = path.display().to_string();
        let tok = tokenizers::Tokenizer::from_file(path).map_err(|e| TokenizerError::Load {
            origin: origin.clone(),
            why: e.to_string(),
        })?;
        let (mut bos, mut eos) = (None, Vec::new());
        if let Some(dir) = path.parent() {
            let cfg_path = dir.join("tokenizer_config.json");
            if let Ok(text) = std::fs::read_to_string(&cfg_path) {
                let cfg: serde_json::Value =
                    serde_json::from_str(&text).map_err(|e| TokenizerError::Load {
                        origin: cfg_path.display().to_string(),
                        why: format!("not valid JSON: {e}"),
                    })?;
                bos = config_token_id(&tok, cfg.get("bos_token"));
                eos.extend(config_token_id(&tok, cfg.get("eos_token")));
            }
        }
        Ok(Self::build(Inner {
            special: special_ids(&tok),
            vocab_size: tok.get_vocab_size(true),
            tok,
            origin,
            bos,
            eos,
            add_bos: false,
            hf_post_process: true,
        }))
    }

    /// Builds the tokenizer stored in GGUF metadata (`tokenizer.ggml.*`). Supports the byte-level
    /// BPE model (`gpt2`) with the `smollm`/`gpt2`/`default`-family, `llama-bpe` and `qwen2`
    /// pre-tokenizers.
    pub fn from_gguf(file: &GgufFile) -> Result<Self, TokenizerError> {
        let origin = file.path().display().to_string();
        let o = || origin.clone();
        let unsupported = |what: String| TokenizerError::Unsupported { origin: o(), what };
        let model = file.require("tokenizer.ggml.model", file.get_str("tokenizer.ggml.model"))?;
        match model {
            "gpt2" => {}
            "llama" => {
                return Err(unsupported(
                    "SentencePiece tokenizers (tokenizer.ggml.model = \"llama\") are not supported yet; \
                     use the HF safetensors directory with tokenizer.json"
                        .into(),
                ));
            }
            other => {
                return Err(unsupported(format!(
                    "tokenizer.ggml.model = {other:?} (supported: \"gpt2\")"
                )));
            }
        }
        let pre = file.get_str("tokenizer.ggml.pre")?.unwrap_or("default");
        let byte_level = || ByteLevel::new(false, true, true);
        let split = |re: &str| -> Result<PreTokenizerWrapper, TokenizerError> {
            Ok(Split::new(
                SplitPattern::Regex(re.into()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| TokenizerError::Load {
                origin: o(),
                why: format!("split regex: {e}"),
            })?
            .into())
        };
        let (pre_tokenizer, ignore_merges): (PreTokenizerWrapper, bool) = match pre {
            "smollm" | "starcoder" | "refact" | "codeshell" | "exaone" | "minerva"
            | "command-r" => (
                Sequence::new(vec![Digits::new(true).into(), byte_level().into()]).into(),
                false,
            ),
            "default" | "gpt2" | "gpt-2" | "mpt" | "olmo" | "jais" => (byte_level().into(), false),
            "llama-bpe" | "llama3" => (
                Sequence::new(vec![
                    split(LLAMA3_SPLIT)?,
                    byte_level().use_regex(false).into(),
                ])
                .into(),
                true,
            ),
            "qwen2" | "stablelm2" => (
                Sequence::new(vec![
                    split(QWEN2_SPLIT)?,
                    byte_level().use_regex(false).into(),
                ])
                .into(),
                false,
            ),
            other => {
                return Err(unsupported(format!(
                    "pre-tokenizer tokenizer.ggml.pre = {other:?} (supported: smollm, gpt2, default, llama-bpe, qwen2 and \
                     their aliases)"
                )));
            }
        };

        let tokens = file.require(
            "tokenizer.ggml.tokens",
            file.get_str_array("tokenizer.ggml.tokens"),
        )?;
        if tokens.is_empty() || tokens.len() > u32::MAX as usize {
            return Err(TokenizerError::Load {
                origin: o(),
                why: format!("{} tokens in tokenizer.ggml.tokens", tokens.len()),
            });
        }
        let mut vocab = Vocab::with_capacity(tokens.len());
        for (i, t) in tokens.iter().enumerate() {
            // Keep the first id of a duplicated token (llama.cpp's lookup does the same).
            vocab.entry(t.clone()).or_insert(i as u32);
        }
        let merges = match file.get_str_array("tokenizer.ggml.merges")? {
            Some(m) => m
                .iter()
                .map(|m| {
                    m.split_once(' ')
                        .map(|(a, b)| (a.to_string(), b.to_string()))
                        .ok_or_else(|| TokenizerError::Load {
                            origin: o(),
                            why: format!("merge {m:?} is not two tokens separated by a space"),
                        })
                })
                .collect::<Result<Vec<_>, _>>()?,
            None => {
                return Err(TokenizerError::Load {
                    origin: o(),
                    why: "tokenizer.ggml.merges is missing".into(),
                });
            }
        };
        let types = file.get_int_array("tokenizer.ggml.token_type")?;
        if let Some(t) = &types
            && t.len() != tokens.len()
        {
            return Err(TokenizerError::Load {
                origin: o(),
                why: format!("{} token types for {} tokens", t.len(), tokens.len()),
            });
        }
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .ignore_merges(ignore_merges)
            .build()
            .map_err(|e| TokenizerError::Load {
                origin: o(),
                why: format!("BPE model: {e}"),
            })?;
        let mut tok = tokenizers::Tokenizer::new(bpe);
        tok.with_pre_tokenizer(Some(pre_tokenizer));
        tok.with_decoder(Some(ByteLevelDecoder::default()));
        if let Some(types) = &types {
            let added: Vec<AddedToken> = types
                .iter()
                .zip(tokens)
                .filter(|(ty, t)| {
                    (**ty == TOKEN_TYPE_CONTROL || **ty == TOKEN_TYPE_USER_DEFINED) && !t.is_empty()
                })
                .map(|(_, t)| AddedToken::from(t.clone(), true))
                .collect();
            tok.add_special_tokens(&added);
        }

        let id_in_vocab = |key: &str| -> Result<Option<u32>, TokenizerError> {
            match file.get_u32(key)? {
                Some(id) if (id as usize) < tokens.len() => Ok(Some(id)),
                Some(id) => Err(TokenizerError::Load {
                    origin: o(),
                    why: format!("{key} = {id} is outside the vocabulary of {}", tokens.len()),
                }),
                None => Ok(None),
            }
        };
        let bos = id_in_vocab("tokenizer.ggml.bos_token_id")?;
        let mut eos = Vec::new();
        for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
            if let Some(id) = id_in_vocab(key)?
                && !eos.contains(&id)
            {
                eos.push(id);
            }
        }
        let add_bos = file
            .get_bool("tokenizer.ggml.add_bos_token")?
            .unwrap_or(false);
        if add_bos && bos.is_none() {
            return Err(TokenizerError::Load {
                origin: o(),
                why: "tokenizer.ggml.add_bos_token is set but there is no tokenizer.ggml.bos_token_id".into(),
            });
        }
        Ok(Self::build(Inner {
            special: special_ids(&tok),
            vocab_size: tok.get_vocab_size(true).max(tokens.len()),
            tok,
            origin,
            bos,
            eos,
            add_bos,
            hf_post_process: false,
        }))
    }

    /// Replaces BOS and adds EOS ids (e.g. from `config.json` / `generation_config.json`).
    pub fn with_special_ids(self, bos: Option<u32>, extra_eos: &[u32]) -> Self {
        let mut inner = Arc::try_unwrap(self.inner).unwrap_or_else(|arc| Inner {
            tok: arc.tok.clone(),
            origin: arc.origin.clone(),
            bos: arc.bos,
            eos: arc.eos.clone(),
            add_bos: arc.add_bos,
            hf_post_process: arc.hf_post_process,
            special: arc.special.clone(),
            vocab_size: arc.vocab_size,
        });
        if bos.is_some() {
            inner.bos = bos;
        }
        for &id in extra_eos {
            if !inner.eos.contains(&id) {
                inner.eos.push(id);
            }
        }
        Self::build(inner)
    }

    /// The tokenizer serialized as a HF `tokenizer.json`.
    pub fn to_hf_json(&self) -> Result<String, TokenizerError> {
        self.inner
            .tok
            .to_string(false)
            .map_err(|e| TokenizerError::Load {
                origin: self.inner.origin.clone(),
                why: format!("serialize: {e}"),
            })
    }

    /// Where the tokenizer was loaded from.
    pub fn origin(&self) -> &str {
        &self.inner.origin
    }

    /// Encodes `text`. Special tokens written in the text (e.g. `<|im_start|>`) are recognised
    /// as single ids, except inside text spans ([`TEXT_SPAN_START`]). BOS is prepended only
    /// when the model says so.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let i = &self.inner;
        let failed = |e: tokenizers::Error| TokenizerError::Encode {
            origin: i.origin.clone(),
            why: e.to_string(),
        };
        let enc = if text.contains([TEXT_SPAN_START, TEXT_SPAN_END]) {
            // Each piece alone, then the post-processor once over them all.
            let mut pieces = Vec::new();
            let mut in_span = false;
            let mut rest = text;
            loop {
                let (piece, marker) = match rest.find([TEXT_SPAN_START, TEXT_SPAN_END]) {
                    Some(at) => (&rest[..at], rest[at..].chars().next()),
                    None => (rest, None),
                };
                if !piece.is_empty() {
                    let tok = if in_span { &*self.text } else { &i.tok };
                    pieces.push(tok.encode(piece, false).map_err(failed)?);
                }
                let Some(marker) = marker else { break };
                in_span = marker == TEXT_SPAN_START;
                rest = &rest[piece.len() + marker.len_utf8()..];
            }
            let merged = tokenizers::Encoding::merge(pieces, false);
            i.tok
                .post_process(merged, None, i.hf_post_process)
                .map_err(failed)?
        } else {
            i.tok.encode(text, i.hf_post_process).map_err(failed)?
        };
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if i.add_bos
            && let Some(bos) = i.bos
        {
            ids.push(bos);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Decodes `ids`; with `skip_special`, special tokens are left out.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        let i = &self.inner;
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= i.vocab_size) {
            return Err(TokenizerError::UnknownId {
                id,
                vocab_size: i.vocab_size,
            });
        }
        i.tok
            .decode(ids, skip_special)
            .map_err(|e| TokenizerError::Decode {
                origin: i.origin.clone(),
                why: e.to_string(),
            })
    }

    /// The most bytes of text one token stands for, over the whole vocabulary (added tokens
    /// included): a text of `n` bytes encodes to at least `n / longest_token_bytes()` tokens.
    /// Measured as each token's spelling in UTF-8, which is never shorter than the text it
    /// stands for (a byte-level BPE character, `▁` or a `<0xAB>` byte token each stand for
    /// one byte), so the bound holds for every tokenizer whose normalizer does not shorten
    /// text.
    pub fn longest_token_bytes(&self) -> usize {
        self.inner
            .tok
            .get_vocab(true)
            .keys()
            .map(String::len)
            .max()
            .unwrap_or(1)
            .max(1)
    }

    /// The bytes token `id` stands for (what OpenAI's logprobs report as `bytes`). A token that
    /// holds part of a multi-byte character decodes to U+FFFD on its own, so its bytes come from
    /// its spelling: one byte per byte-level BPE character, or a `<0xAB>` byte token's byte.
    pub fn token_bytes(&self, id: u32) -> Result<Vec<u8>, TokenizerError> {
        let text = self.decode(&[id], false)?;
        if !text.contains('\u{FFFD}') {
            return Ok(text.into_bytes());
        }
        let spelling = self.id_to_token(id).unwrap_or_default();
        if let Some(b) = spelling
            .strip_prefix("<0x")
            .and_then(|h| h.strip_suffix('>'))
            .and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            return Ok(vec![b]);
        }
        Ok(spelling
            .chars()
            .map(byte_of_level_char)
            .collect::<Option<Vec<u8>>>()
            .unwrap_or_else(|| text.into_bytes()))
    }

    /// Number of ids (including added tokens).
    pub fn vocab_size(&self) -> usize {
        self.inner.vocab_size
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.inner.bos
    }

    /// Ids that end generation (EOS, and end-of-turn where the model has one).
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.inner.eos
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.tok.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.tok.id_to_token(id)
    }

    /// Whether `id` is a special (control) token.
    pub fn is_special(&self, id: u32) -> bool {
        self.inner.special.contains(&id)
    }

    /// An incremental decoder (special tokens are decoded as their text).
    pub fn stream_decoder(&self) -> StreamDecoder {
        StreamDecoder::new(self.clone(), false)
    }

    /// An incremental decoder that leaves special tokens out.
    pub fn stream_decoder_skip_special(&self) -> StreamDecoder {
        StreamDecoder::new(self.clone(), true)
    }
}

/// Decodes a stream of ids piece by piece. Text is returned once it is complete: an incomplete
/// UTF-8 sequence (a character split across byte tokens) is held back until the ids that
/// complete it arrive. The concatenation of every `push` and `finish` equals
/// `decode(all ids)` for byte-level tokenizers.
#[derive(Debug)]
pub struct StreamDecoder {
    tok: Tokenizer,
    skip_special: bool,
    /// Ids from the start of the current context window.
    ids: Vec<u32>,
    /// `ids[..read]` have been emitted already (they are context for the rest).
    read: usize,
}

impl StreamDecoder {
    fn new(tok: Tokenizer, skip_special: bool) -> Self {
        Self {
            tok,
            skip_special,
            ids: Vec::new(),
            read: 0,
        }
    }

    /// Adds one id; returns the newly completed text, if any.
    pub fn push(&mut self, id: u32) -> Result<Option<String>, TokenizerError> {
        let vocab_size = self.tok.vocab_size();
        if id as usize >= vocab_size {
            return Err(TokenizerError::UnknownId { id, vocab_size });
        }
        self.ids.push(id);
        let prefix = self.tok.decode(&self.ids[..self.read], self.skip_special)?;
        let text = self.tok.decode(&self.ids, self.skip_special)?;
        if text.len() > prefix.len() && !text.ends_with('\u{FFFD}') {
            let new = delta(&prefix, &text);
            self.ids.drain(..self.read);
            self.read = self.ids.len();
            Ok(Some(new))
        } else {
            Ok(None)
        }
    }

    /// Flushes whatever is held back (an incomplete sequence decodes to U+FFFD) and resets.
    pub fn finish(&mut self) -> Result<Option<String>, TokenizerError> {
        let prefix = self.tok.decode(&self.ids[..self.read], self.skip_special)?;
        let text = self.tok.decode(&self.ids, self.skip_special)?;
        self.ids.clear();
        self.read = 0;
        if text.len() > prefix.len() {
            Ok(Some(delta(&prefix, &text)))
        } else {
            Ok(None)
        }
    }
}

/// Bytes that byte-level BPE spells as themselves; the other 68 (controls, space, DEL, …)
/// are spelled U+0100 onwards, in byte order (GPT-2's table).
fn spelled_as_itself(b: u8) -> bool {
    matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF)
}

/// The byte a byte-level BPE character spells, if it is one.
fn byte_of_level_char(c: char) -> Option<u8> {
    match u32::from(c) {
        u @ 0..=255 if spelled_as_itself(u as u8) => Some(u as u8),
        u @ 256..=323 => (0..=255u8)
            .filter(|&b| !spelled_as_itself(b))
            .nth(u as usize - 256),
        _ => None,
    }
}

/// The part of `text` after `prefix` (after their common prefix, should a decoder ever rewrite
/// earlier text).
fn delta(prefix: &str, text: &str) -> String {
    if let Some(rest) = text.strip_prefix(prefix) {
        return rest.to_string();
    }
    let common = prefix
        .char_indices()
        .zip(text.chars())
        .find(|((_, a), b)| a != b)
        .map(|((i, _), _)| i)
        .unwrap_or(prefix.len().min(text.len()));
    text[common..].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::test_writer::GgufWriter;
    use crate::gguf::{GgufArray, GgufValue};

    /// The character byte-level BPE spells byte `b` with.
    fn byte_level_char(b: u8) -> char {
        if spelled_as_itself(b) {
            return char::from(b);
        }
        let n = (0..b).filter(|&x| !spelled_as_itself(x)).count() as u32;
        char::from_u32(256 + n).unwrap()
    }

    /// The byte-level alphabet: the 256 single-byte tokens, in GPT-2's byte→char mapping.
    fn byte_chars() -> Vec<String> {
        (0..=255u8)
            .map(|b| byte_level_char(b).to_string())
            .collect()
    }

    /// A tiny byte-level BPE in GGUF: `<|end|>` (control), the 256 bytes, merges "h e", "he l".
    fn tiny(pre: &str, add_bos: bool) -> (tempfile::TempDir, GgufFile) {
        let mut tokens = vec!["<|end|>".to_string(), "<s>".to_string()];
        tokens.extend(byte_chars());
        tokens.push("he".into());
        tokens.push("hel".into());
        let mut types = vec![3i32, 3];
        types.extend(std::iter::repeat_n(1, tokens.len() - 2));
        let dir = tempfile::tempdir().unwrap();
        let p = GgufWriter::new()
            .kv("tokenizer.ggml.model", GgufValue::String("gpt2".into()))
            .kv("tokenizer.ggml.pre", GgufValue::String(pre.into()))
            .kv(
                "tokenizer.ggml.tokens",
                GgufValue::Array(GgufArray::String(tokens)),
            )
            .kv(
                "tokenizer.ggml.token_type",
                GgufValue::Array(GgufArray::I32(types)),
            )
            .kv(
                "tokenizer.ggml.merges",
                GgufValue::Array(GgufArray::String(vec!["h e".into(), "he l".into()])),
            )
            .kv("tokenizer.ggml.bos_token_id", GgufValue::U32(1))
            .kv("tokenizer.ggml.eos_token_id", GgufValue::U32(0))
            .kv("tokenizer.ggml.add_bos_token", GgufValue::Bool(add_bos))
            .write(dir.path(), "tok.gguf");
        let f = GgufFile::open(&p).unwrap();
        (dir, f)
    }

    fn byte_id(b: u8) -> u32 {
        2 + b as u32
    }

    #[test]
    fn tiny_gguf_bpe() {
        let (_d, f) = tiny("smollm", false);
        let t = Tokenizer::from_gguf(&f).unwrap();
        assert_eq!(t.vocab_size(), 2 + 256 + 2);
        assert_eq!(t.eos_token_ids(), &[0]);
        assert_eq!(t.bos_token_id(), Some(1));
        assert!(t.is_special(0) && !t.is_special(5));
        let hel = t.token_to_id("hel").unwrap();
        let ids = t.encode("help12<|end|>").unwrap();
        assert_eq!(
            ids,
            vec![hel, byte_id(b'p'), byte_id(b'1'), byte_id(b'2'), 0]
        );
        assert_eq!(t.decode(&ids, false).unwrap(), "help12<|end|>");
        assert_eq!(t.decode(&ids, true).unwrap(), "help12");
        assert!(matches!(
            t.decode(&[9999], false).unwrap_err(),
            TokenizerError::UnknownId { id: 9999, .. }
        ));

        let (_d, f) = tiny("smollm", true);
        let t = Tokenizer::from_gguf(&f).unwrap();
        assert_eq!(
            t.encode("he").unwrap(),
            vec![1, t.token_to_id("he").unwrap()]
        );
    }

    #[test]
    fn unsupported_models_are_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        let p = GgufWriter::new()
            .kv("tokenizer.ggml.model", GgufValue::String("llama".into()))
            .write(dir.path(), "sp.gguf");
        let e = Tokenizer::from_gguf(&GgufFile::open(&p).unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("SentencePiece") && e.contains("sp.gguf"), "{e}");
        let (_d, f) = tiny("weird-pre", false);
        let e = Tokenizer::from_gguf(&f).unwrap_err().to_string();
        assert!(e.contains("weird-pre"), "{e}");
        // The other supported pre-tokenizers build.
        for pre in ["gpt2", "default", "llama-bpe", "qwen2"] {
            let (_d, f) = tiny(pre, false);
            let t = Tokenizer::from_gguf(&f).unwrap();
            let s = "Hello  world 12345 ünïcödé 👋\n\n x";
            assert_eq!(t.decode(&t.encode(s).unwrap(), false).unwrap(), s, "{pre}");
        }
    }

    #[test]
    fn stream_decoder_holds_incomplete_utf8() {
        let (_d, f) = tiny("smollm", false);
        let t = Tokenizer::from_gguf(&f).unwrap();
        let s = "a👋é<|end|>b";
        let ids = t.encode(s).unwrap();
        let mut d = t.stream_decoder();
        let mut out = String::new();
        let mut pieces = Vec::new();
        for &id in &ids {
            if let Some(p) = d.push(id).unwrap() {
                assert!(!p.contains('\u{FFFD}'));
                out.push_str(&p);
                pieces.push(p);
            }
        }
        out.push_str(&d.finish().unwrap().unwrap_or_default());
        assert_eq!(out, s);
        assert!(pieces.contains(&"👋".to_string()), "{pieces:?}");
        // A dangling partial character is flushed by finish() as U+FFFD, as decode does.
        let partial = &t.encode("👋").unwrap()[..2];
        let mut d = t.stream_decoder();
        for &id in partial {
            assert_eq!(d.push(id).unwrap(), None);
        }
        assert_eq!(
            d.finish().unwrap().unwrap(),
            t.decode(partial, false).unwrap()
        );
    }

    /// The bytes of a text's tokens, one token at a time, add up to the text's UTF-8 bytes, also
    /// where a token holds part of a character (OpenAI clients join logprobs' `bytes` so).
    #[test]
    fn token_bytes_rebuild_the_text_where_tokens_split_characters() {
        let (_d, f) = tiny("smollm", false);
        let t = Tokenizer::from_gguf(&f).unwrap();
        let s = "a👋 é\u{1}\u{7f}";
        let ids = t.encode(s).unwrap();
        assert!(
            ids.iter()
                .any(|&id| t.decode(&[id], false).unwrap().contains('\u{FFFD}')),
            "no token splits a character in {ids:?}"
        );
        let bytes: Vec<u8> = ids
            .iter()
            .flat_map(|&id| t.token_bytes(id).unwrap())
            .collect();
        assert_eq!(bytes, s.as_bytes());
        for b in 0..=255u8 {
            assert_eq!(byte_of_level_char(byte_level_char(b)), Some(b));
        }
        assert_eq!(byte_of_level_char('👋'), None);
    }

    #[test]
    fn hf_tokenizer_json() {
        // Build a tokenizer.json from the tiny GGUF one and load it back the HF way.
        let (dir, f) = tiny("smollm", false);
        let t = Tokenizer::from_gguf(&f).unwrap();
        let json = t.to_hf_json().unwrap();
        let p = dir.path().join("tokenizer.json");
        std::fs::write(&p, json).unwrap();
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"bos_token": "<s>", "eos_token": {"content": "<|end|>"}}"#,
        )
        .unwrap();
        let h = Tokenizer::from_hf_file(&p).unwrap();
        assert_eq!(h.bos_token_id(), Some(1));
        assert_eq!(h.eos_token_ids(), &[0]);
        let s = "help 42 <|end|>";
        assert_eq!(h.encode(s).unwrap(), t.encode(s).unwrap());
        let h = h.with_special_ids(None, &[5, 0]);
        assert_eq!(h.eos_token_ids(), &[0, 5]);
        let e = Tokenizer::from_hf_file(&dir.path().join("nope.json"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("nope.json"), "{e}");
    }

    #[test]
    fn smollm2_real_tokenizer() {
        let p = crate::model_path::checkout_default_model();
        let f = GgufFile::open(&p).unwrap();
        let t = Tokenizer::from_gguf(&f).unwrap();
        assert_eq!(t.vocab_size(), 49152);
        assert_eq!(t.bos_token_id(), Some(1));
        assert_eq!(t.eos_token_ids(), &[2]);
        assert_eq!(t.token_to_id("<|im_start|>"), Some(1));
        assert!(t.is_special(1) && t.is_special(2) && !t.is_special(100));

        let s = "<|im_start|>user\nHi 12345 👋  \t\n done<|im_end|>";
        let ids = t.encode(s).unwrap();
        let pieces: Vec<String> = ids.iter().map(|&i| t.id_to_token(i).unwrap()).collect();
        eprintln!("{s:?} -> {ids:?} {pieces:?}");
        assert_eq!(ids[0], 1, "{ids:?}");
        assert_eq!(*ids.last().unwrap(), 2, "{ids:?}");
        // Digits one per token.
        let digit_ids: Vec<u32> = "12345"
            .chars()
            .map(|c| t.token_to_id(&c.to_string()).unwrap())
            .collect();
        assert!(ids.windows(5).any(|w| w == digit_ids.as_slice()), "{ids:?}");
        assert_eq!(t.decode(&ids, false).unwrap(), s);
        assert_eq!(
            t.decode(&ids, true).unwrap(),
            "user\nHi 12345 👋  \t\n done"
        );

        for s in [
            "",
            "Hello, world!",
            "  leading and trailing spaces   ",
            "tabs\tand\nnewlines\r\n\n\n",
            "数字 123 and ünïcödé, emoji 🤖👍🏽 and 🇫🇷",
            "code: fn main() { println!(\"{}\", 3.14159); }",
            "<|im_start|><|im_end|><|endoftext|>",
            "it's we'll they've I'm",
        ] {
            let ids = t.encode(s).unwrap();
            assert_eq!(t.decode(&ids, false).unwrap(), s);
            let mut d = t.stream_decoder();
            let mut out = String::new();
            for &id in &ids {
                out.push_str(&d.push(id).unwrap().unwrap_or_default());
            }
            out.push_str(&d.finish().unwrap().unwrap_or_default());
            assert_eq!(out, s);
        }
        // Known ids from the SmolLM2 vocabulary: "Hello" is a single token.
        let hello = t.encode("Hello").unwrap();
        assert_eq!(hello.len(), 1, "{hello:?}");
    }
}
