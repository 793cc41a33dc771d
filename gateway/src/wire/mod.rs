//! The wire vocabulary, at the bottom of the gateway: the Anthropic-compatible request and
//! response types ([`types`], from which the OpenAPI document's schemas are generated) and
//! request validation with Anthropic's error texts ([`validate`]). Every stage of the request
//! path (handlers, rendering, the pipeline, usage) speaks these words; nothing here names a
//! module above it (`tests/layering.rs`).

pub mod types;
pub mod validate;
