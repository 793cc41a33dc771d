//! The customer API's rooms, bottom up: the stages every handler shares (`stages`: body,
//! version, render, start and collect a generation), the cache objects both wires can name
//! (`caches`), each wire from its body to its answer (`anthropic`, `openai`) behind one trait
//! (`serve`), and the handlers on top. The words they speak are the [`wire`](crate::wire)
//! module's.

pub mod anthropic;
pub mod caches;
pub mod handlers;
pub mod openai;
pub mod serve;
pub mod stages;
