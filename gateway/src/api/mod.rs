//! The Anthropic-compatible HTTP API: wire types, validation, handlers.

pub mod handlers;
pub mod types;
pub mod validate;
