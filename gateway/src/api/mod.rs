//! The Anthropic-compatible HTTP API (wire types, validation, handlers) and OpenAI's Chat
//! Completions wire over the same pipeline (`openai`).

pub mod handlers;
pub mod openai;
pub mod types;
pub mod validate;
