//! The OpenAI-compatible HTTP API, a front of its own over the router's core:
//! - [`server`]: the HTTP front (routes, admission, errors as OpenAI's envelope), its API-key
//!   layer, and how `tool_choice: "auto"` is served;
//! - [`wire`]: OpenAI's bodies (serde types only);
//! - [`request`]: a request read into the core's `GenerateRequest` (tools become constraints);
//! - [`response`]: the core's messages written as OpenAI's answers and chunks;
//! - [`tool_stream`]: tool calls read back out of an answer's text, streamed or whole.
//!
//! It reaches the core only through [`crate::door`]; nothing below this module imports it.

pub mod request;
pub mod response;
pub mod server;
pub mod tool_stream;
pub mod wire;
