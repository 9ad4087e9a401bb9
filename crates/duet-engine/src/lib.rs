//! duet's model engine: weight loaders (GGUF, safetensors), tokenizer and chat templates, the
//! Llama-family forward pass over a paged KV cache, and sampling.

pub mod backend;
pub mod batch;
pub mod chat;
pub mod config;
pub mod cpu;
pub mod device;
pub mod engine;
pub mod error;
pub mod generation;
pub mod gguf;
pub mod llama;
pub mod model_files;
pub mod model_path;
pub mod quant;
pub mod safetensors;
pub mod sampling;
pub mod storage;
pub mod synthetic;
pub mod threadpool;
pub mod tokenizer;

pub use error::EngineError;
