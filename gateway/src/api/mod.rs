//! The Anthropic-compatible HTTP API's handlers and OpenAI's Chat Completions wire over the
//! same pipeline (`openai`), the cache objects both wires can name (`caches`), and the stages
//! every handler shares (`stages`: body, version, render, start and collect a generation).
//! The words they speak are the [`wire`](crate::wire) module's.

pub mod caches;
pub mod handlers;
pub mod openai;
pub mod stages;
