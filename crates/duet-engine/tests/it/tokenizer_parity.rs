//! The tokenizer against an independent pure-Python byte-level BPE
//! (tests/reference/bpe_reference.py): digits, unicode, emoji, whitespace runs, special tokens.

use crate::common::*;
use duet_model::model_files::open_model;

#[test]
fn smollm2_encode_decode_parity() {
    let path = checkout_default_model();
    let files = open_model(&path).unwrap();
    let cases = read_json("smollm2-tokenizer-cases.json");
    for c in cases["cases"].as_array().unwrap() {
        let text = c["text"].as_str().unwrap();
        let want = ids(&c["ids"]);
        let got = files.tokenizer.encode(text).unwrap();
        assert_eq!(got, want, "encoding {text:?} ({})", c["name"]);
        assert_eq!(
            files.tokenizer.decode(&want, false).unwrap(),
            text,
            "decoding {text:?}"
        );
    }
}

#[test]
fn tiny_tokenizer_parity() {
    let files = open_model(&fixtures().join("tiny-llama")).unwrap();
    let cases = read_json("tiny-llama-tokenizer-cases.json");
    for c in cases["cases"].as_array().unwrap() {
        let text = c["text"].as_str().unwrap();
        let want = ids(&c["ids"]);
        assert_eq!(
            files.tokenizer.encode(text).unwrap(),
            want,
            "encoding {text:?}"
        );
        assert_eq!(
            files.tokenizer.decode(&want, false).unwrap(),
            text,
            "decoding {text:?}"
        );
    }
}
