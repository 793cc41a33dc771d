//! The Anthropic-compatible HTTP API (wire types, validation, handlers) and OpenAI's Chat
//! Completions wire over the same pipeline (`openai`), and the cache objects both wires can
//! name (`caches`).

pub mod caches;
pub mod handlers;
pub mod openai;
pub mod types;
pub mod validate;
