//! duet's model engine: weight loaders (GGUF, safetensors), tokenizer and chat templates, the
//! Llama-family forward pass over a paged KV cache, and sampling.

pub mod storage;
pub mod threadpool;
