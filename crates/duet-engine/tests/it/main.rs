//! The engine's integration tests, one binary: golden tests against independent references and
//! the engine behaviour the services build on. Every module is a former test file; they share
//! `common` and run concurrently (each test builds its own engine and backend).

mod common;
mod engine_sequences;
mod golden_families;
mod golden_rope_scaling;
mod golden_smollm2;
mod golden_tiny;
mod speculative;
mod tokenizer_parity;
