//! What a model is, without running it: its configuration, weight files (GGUF, safetensors) and
//! their tensor types, tokenizer, chat template, the request parameters generation takes, and the
//! grammars that constrain it (compiled here so the router refuses a bad one before queueing).
//! The router reads a model through this crate alone; no kernel is linked.

pub mod chat;
pub mod config;
pub mod dequant;
pub mod fp8;
pub mod gguf;
pub mod grammar;
pub mod json_schema;
pub mod model_files;
pub mod model_path;
pub mod params;
pub mod quant_type;
pub mod rope;
pub mod safetensors;
pub mod storage;
pub mod synthetic;
pub mod tokenizer;
pub mod tool_calls;
