#!/usr/bin/env python3
"""Independent pure-Python byte-level BPE tokenizer (GPT-2 / SmolLM2 style).

Regenerates ``tests/fixtures/smollm2-tokenizer-cases.json``:

    python3 tests/reference/bpe_reference.py            # from the repo root

The tokenizer is built ONLY from the GGUF metadata of
``models/SmolLM2-135M-Instruct.Q4_1.gguf`` (tokens, token types, merges), read
with ``gguf.GGUFReader``.  Nothing from the Rust engine is used.

Encoding pipeline (mirrors SmolLM2's HF ``tokenizer.json``, whose pre-tokenizer
is ``Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False,
use_regex=True)]`` and whose special tokens are ``added_tokens``):

1. Special tokens (token type 3 = control, 4 = user-defined) are matched
   literally in the raw text, longest first, and emitted as their id.  The text
   between them goes through steps 2-5.
2. ``Digits(individual_digits=True)``: every *numeric* character becomes its
   own pre-token ("Isolated" split).  HF uses Rust's ``char::is_numeric`` which
   is Unicode general category N (Nd, Nl, No) -- i.e. ``\\p{N}``, not only
   ASCII 0-9 (checked empirically with the Python ``tokenizers`` binding:
   ``"²٣४"`` is split into three pre-tokens).
3. Each resulting piece is split again with the GPT-2 regex
   ``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+``
   (``regex`` module).  Note that because digits were already isolated in step
   2, a space before a digit can never join it (" 12" -> " ", "1", "2").
4. Each pre-token's UTF-8 bytes are mapped through GPT-2's ``bytes_to_unicode``.
5. Rank-based BPE: repeatedly merge the adjacent pair with the lowest merge rank
   (leftmost first on ties), until no mergeable pair is left; look up ids.

``decode`` concatenates the token strings (special tokens verbatim), maps the
byte-level characters back to bytes and decodes UTF-8.

If the Python ``tokenizers`` package is installed, the script additionally
builds an HF tokenizer from the same GGUF metadata and asserts that it produces
the same ids (a cross-check of this implementation; it is not the source of the
fixture).
"""

from __future__ import annotations

import json
import os
import sys
from functools import lru_cache

import regex

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DEFAULT_GGUF = os.path.join(REPO, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
OUT = os.path.join(REPO, "tests", "fixtures", "smollm2-tokenizer-cases.json")

GPT2_PATTERN = (
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


BYTE_ENCODER = bytes_to_unicode()
BYTE_DECODER = {c: b for b, c in BYTE_ENCODER.items()}


class ByteLevelBPE:
    """Byte-level BPE with optional individual-digit splitting."""

    def __init__(self, tokens, token_types, merges, split_digits=True,
                 pattern=GPT2_PATTERN):
        self.tokens = list(tokens)
        self.vocab = {t: i for i, t in enumerate(self.tokens)}
        assert len(self.vocab) == len(self.tokens), "duplicate token strings"
        self.ranks = {}
        for rank, m in enumerate(merges):
            a, b = m.split(" ")
            self.ranks[(a, b)] = rank
        # control (3) and user-defined (4) tokens are matched literally
        self.specials = {t: i for i, (t, ty) in enumerate(zip(self.tokens, token_types))
                         if ty in (3, 4)}
        self.special_ids = set(self.specials.values())
        if self.specials:
            alts = sorted(self.specials, key=len, reverse=True)
            self.special_re = regex.compile("|".join(regex.escape(s) for s in alts))
        else:
            self.special_re = None
        self.split_digits = split_digits
        self.pat = regex.compile(pattern)
        self.digit_re = regex.compile(r"\p{N}")
        self._bpe = lru_cache(maxsize=65536)(self._bpe_uncached)

    # -- pre-tokenization ---------------------------------------------------
    def pre_tokenize(self, text: str) -> list[str]:
        pieces = [text]
        if self.split_digits:
            out = []
            for p in pieces:
                last = 0
                for m in self.digit_re.finditer(p):
                    if m.start() > last:
                        out.append(p[last:m.start()])
                    out.append(m.group())
                    last = m.end()
                if last < len(p):
                    out.append(p[last:])
            pieces = out
        words = []
        for p in pieces:
            words.extend(self.pat.findall(p))
        return words

    # -- BPE on one pre-token ----------------------------------------------
    def _bpe_uncached(self, word: str) -> tuple[str, ...]:
        syms = list(word)
        while len(syms) > 1:
            best, best_i = None, -1
            for i in range(len(syms) - 1):
                r = self.ranks.get((syms[i], syms[i + 1]))
                if r is not None and (best is None or r < best):
                    best, best_i = r, i
            if best is None:
                break
            # merge every occurrence of this pair, left to right, non-overlapping
            a, b = syms[best_i], syms[best_i + 1]
            merged, i = [], 0
            while i < len(syms):
                if i < len(syms) - 1 and syms[i] == a and syms[i + 1] == b:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(syms[i])
                    i += 1
            syms = merged
        return tuple(syms)

    def encode_ordinary(self, text: str) -> list[int]:
        ids = []
        for w in self.pre_tokenize(text):
            mapped = "".join(BYTE_ENCODER[b] for b in w.encode("utf-8"))
            for s in self._bpe(mapped):
                ids.append(self.vocab[s])  # KeyError would mean an inconsistent vocab
        return ids

    def encode(self, text: str) -> list[int]:
        if self.special_re is None:
            return self.encode_ordinary(text)
        ids, last = [], 0
        for m in self.special_re.finditer(text):
            if m.start() > last:
                ids.extend(self.encode_ordinary(text[last:m.start()]))
            ids.append(self.specials[m.group()])
            last = m.end()
        if last < len(text):
            ids.extend(self.encode_ordinary(text[last:]))
        return ids

    def decode(self, ids) -> str:
        out = bytearray()
        for i in ids:
            t = self.tokens[i]
            if i in self.special_ids:
                out.extend(t.encode("utf-8"))
            else:
                out.extend(BYTE_DECODER[c] for c in t)
        return out.decode("utf-8", errors="replace")


def _field_strings(reader, key):
    f = reader.fields[key]
    return [bytes(f.parts[i]).decode("utf-8") for i in f.data]


def _field_ints(reader, key):
    f = reader.fields[key]
    return [int(f.parts[i][0]) for i in f.data]


def load_from_gguf(path: str = DEFAULT_GGUF) -> ByteLevelBPE:
    import gguf
    r = gguf.GGUFReader(path)
    tokens = _field_strings(r, "tokenizer.ggml.tokens")
    types = _field_ints(r, "tokenizer.ggml.token_type")
    merges = _field_strings(r, "tokenizer.ggml.merges")
    return ByteLevelBPE(tokens, types, merges, split_digits=True)


CASES = [
    ("plain", "The capital of France is"),
    ("plain_sentence", "Hello, world! This is a test of the tokenizer."),
    ("digits_only", "1234567890"),
    ("digits_pi", "pi is 3.14159"),
    ("digits_mixed", "I have 23 apples and 1,024 pears in 2024."),
    ("digits_unicode", "x² + y³ = ٣४"),
    ("unicode_latin", "naïve café, Straße, 東京, Привет"),
    ("emoji", "👋🏽 hello 🚀🚀"),
    ("whitespace_runs", "a  b   c\t\td\n\n\ne"),
    ("leading_spaces", "   leading"),
    ("trailing_spaces", "trailing   "),
    ("only_spaces", "    "),
    ("newlines", "line one\nline two\r\n\r\nline three\n"),
    ("contractions", "I'm sure it's what they've said, we'll see, I'd've done it. DON'T"),
    ("special_chat", "<|im_start|>user\nHi<|im_end|>\n"),
    ("special_chat_full",
     "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
     "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
     "<|im_start|>assistant\n"),
    ("special_adjacent", "<|endoftext|><|endoftext|>text<|im_end|>"),
    ("special_lookalike", "<|im_start |> and <|im_end| are not specials"),
    ("code_python", "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"),
    ("code_rust", "fn main() {\n\tlet x: Vec<u32> = vec![1, 2, 3];\n\tprintln!(\"{:?}\", x);\n}"),
    ("mixed", "Email: john.doe@example.com; URL: https://hf.co/HuggingFaceTB?x=1&y=2 #tag $9.99 (50%)"),
    ("punctuation", "...!!!???---___***"),
    ("count", "1, 2, 3, 4, 5,"),
    ("empty", ""),
]


def hf_crosscheck(tok: ByteLevelBPE, cases):
    """Optional: compare with HF `tokenizers` built from the same GGUF data."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        print("tokenizers not installed; skipping HF cross-check")
        return
    spec = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [
            {"id": i, "content": t, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}
            for t, i in sorted(tok.specials.items(), key=lambda kv: kv[1])],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
             "use_regex": True}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True,
                    "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": tok.vocab,
                  "merges": [f"{a} {b}" for (a, b), _ in
                             sorted(tok.ranks.items(), key=lambda kv: kv[1])]},
    }
    hf = Tokenizer.from_str(json.dumps(spec))
    for name, text in cases:
        a = tok.encode(text)
        b = hf.encode(text, add_special_tokens=False).ids
        assert a == b, (name, text, a, b)
    print(f"HF tokenizers cross-check: {len(cases)} cases identical")


def main():
    tok = load_from_gguf(DEFAULT_GGUF)
    out_cases = []
    for name, text in CASES:
        ids = tok.encode(text)
        dec = tok.decode(ids)
        assert dec == text, (name, text, dec)
        out_cases.append({"name": name, "text": text, "ids": ids})
    hf_crosscheck(tok, CASES)
    doc = {
        "source": "models/SmolLM2-135M-Instruct.Q4_1.gguf tokenizer metadata",
        "generator": "tests/reference/bpe_reference.py (independent pure-Python BPE)",
        "add_bos": False,
        "notes": "ids are the encoding of text without any BOS/EOS; specials "
                 "(token types 3/4) are matched literally; decode(ids) == text",
        "cases": out_cases,
    }
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {OUT} ({len(out_cases)} cases)")


if __name__ == "__main__":
    sys.exit(main())
