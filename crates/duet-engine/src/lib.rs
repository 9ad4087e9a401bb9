//! duet's model engine over any device: the [`backend::Backend`] trait a device implements, the
//! Llama-family forward pass written once over it, batches of sequences over a paged KV cache
//! (planned by the [`scheduler`], run by the [`model_runner`]), sampling and stop handling. The devices themselves are peers in their own crates (`duet-cpu`,
//! `duet-cuda`); `duet-device` picks one.

pub mod backend;
pub mod batch;
pub mod device;
pub mod draft_model;
pub mod engine;
pub mod error;
pub mod generation;
pub mod grammars;
pub mod llama;
pub mod model_runner;
pub mod moe;
pub mod sampling;
pub mod sampling_steps;
pub mod scheduler;
pub mod speculator;

pub use error::EngineError;
