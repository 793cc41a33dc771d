//! Wire types of the Anthropic-compatible API. Requests are validated as JSON first
//! (`wire::validate`, for exact error texts) and then deserialized into these types; responses
//! are serialized from them. The OpenAPI spec is generated from them.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

/// The request field naming a cache object, and the location its breakpoint reports.
pub const CACHED_CONTENT: &str = "cached_content";

/// `{"type":"ephemeral","ttl":"5m"|"1h"}`.
#[derive(Clone, Debug, Deserialize, Serialize, ToSchema, PartialEq, Eq)]
pub struct CacheControl {
    /// Always `ephemeral`.
    #[serde(rename = "type")]
    pub kind: String,
    /// `5m` (default) or `1h`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl: Option<String>,
}

/// A request content block.
#[derive(Clone, Debug, Deserialize, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentBlock {
    Text {
        text: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cache_control: Option<CacheControl>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        #[schema(value_type = Option<Object>)]
        citations: Option<Value>,
    },
    ToolUse {
        id: String,
        name: String,
        #[schema(value_type = Object)]
        input: Value,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cache_control: Option<CacheControl>,
    },
    ToolResult {
        tool_use_id: String,
        /// A string or a list of text blocks.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        #[schema(value_type = Option<Object>)]
        content: Option<Value>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        is_error: Option<bool>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cache_control: Option<CacheControl>,
    },
    Thinking {
        thinking: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        signature: Option<String>,
    },
    RedactedThinking {
        data: String,
    },
}

/// Message content: a string or a list of blocks.
#[derive(Clone, Debug, Deserialize, Serialize, ToSchema)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Blocks(Vec<ContentBlock>),
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize, ToSchema, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum MessageRole {
    User,
    Assistant,
}

#[derive(Clone, Debug, Deserialize, Serialize, ToSchema)]
pub struct InputMessage {
    pub role: MessageRole,
    pub content: MessageContent,
}

/// A system text block.
#[derive(Clone, Debug, Deserialize, Serialize, ToSchema)]
pub struct SystemBlock {
    /// Always `text`.
    #[serde(rename = "type")]
    pub kind: String,
    pub text: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_control: Option<CacheControl>,
}

/// The system prompt: a string or a list of text blocks.
#[derive(Clone, Debug, Deserialize, Serialize, ToSchema)]
#[serde(untagged)]
pub enum SystemPrompt {
    Text(String),
    Blocks(Vec<SystemBlock>),
}

/// A client tool definition.
#[derive(Clone, Debug, Deserialize, Serialize, ToSchema)]
pub struct Tool {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[schema(value_type = Object)]
    pub input_schema: Value,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_control: Option<CacheControl>,
    /// `custom` or absent.
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
}

/// `POST /v1/messages` body.
#[derive(Clone, Debug, Deserialize, Serialize, ToSchema)]
pub struct MessagesRequest {
    pub model: String,
    pub max_tokens: u32,
    pub messages: Vec<InputMessage>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system: Option<SystemPrompt>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<Tool>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<Value>,
    /// Automatic caching: a breakpoint on the last cacheable block.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_control: Option<CacheControl>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub thinking: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_tier: Option<String>,
    /// Cachet extension (vLLM's name): generate exactly `max_tokens` tokens, not stopping at
    /// the model's end of sequence (stop sequences still stop). Load tests use it to replay a
    /// trace's output lengths; billed like any output.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ignore_eos: bool,
    /// With `anthropic-beta: cache-diagnosis-2026-04-07`: `{"previous_message_id": "msg_…"}`
    /// asks why this request did not read what that one left in the cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub diagnostics: Option<Value>,
}

/// `POST /v1/messages/count_tokens` body.
#[derive(Clone, Debug, Deserialize, Serialize, ToSchema)]
pub struct CountTokensRequest {
    pub model: String,
    pub messages: Vec<InputMessage>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system: Option<SystemPrompt>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<Tool>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_control: Option<CacheControl>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub thinking: Option<Value>,
}

#[derive(Clone, Debug, Deserialize, Serialize, ToSchema)]
pub struct CountTokensResponse {
    pub input_tokens: u64,
}

/// Cache writes by TTL.
#[derive(Clone, Debug, Default, Deserialize, Serialize, ToSchema, PartialEq, Eq)]
pub struct CacheCreation {
    pub ephemeral_5m_input_tokens: u64,
    pub ephemeral_1h_input_tokens: u64,
}

/// Token usage, Anthropic semantics: `input_tokens` is the uncached remainder, and
/// `input_tokens + cache_creation_input_tokens + cache_read_input_tokens` is the prompt.
#[derive(Clone, Debug, Default, Deserialize, Serialize, ToSchema, PartialEq, Eq)]
pub struct Usage {
    pub input_tokens: u64,
    pub cache_creation_input_tokens: u64,
    pub cache_read_input_tokens: u64,
    pub cache_creation: CacheCreation,
    pub output_tokens: u64,
    pub service_tier: String,
}

/// Cumulative usage in a streaming `message_delta`.
#[derive(Clone, Debug, Default, Deserialize, Serialize, ToSchema, PartialEq, Eq)]
pub struct DeltaUsage {
    pub input_tokens: u64,
    pub cache_creation_input_tokens: u64,
    pub cache_read_input_tokens: u64,
    pub output_tokens: u64,
}

/// What happened at one breakpoint (a Cachet extension; SDKs ignore it).
#[derive(Clone, Debug, Deserialize, Serialize, ToSchema, PartialEq, Eq)]
pub struct BreakpointReport {
    /// Where the marker is, e.g. `system.1` or `messages.2.content.0`.
    pub location: String,
    /// Placed by top-level (automatic) `cache_control`.
    pub automatic: bool,
    pub ttl: String,
    /// Prompt tokens up to and including the marked block.
    pub token_offset: u64,
    /// `read`: served from the cache; `coalesced`: served from the cache after waiting for
    /// another request that was computing it (billed as a read); `written`: written now;
    /// `below_minimum`: too short to cache; `not_written`: the cache could not hold it (see
    /// `reason`).
    pub status: String,
    /// For a breakpoint that was not read: why there was no entry (`not_cached`,
    /// `expired`, `evicted`, `evicted_quota`, `corrupt`), or why a write failed (`quota`,
    /// `capacity`, `kv_budget`: its blocks alone exceed the server's KV memory budget).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// Per-request cache report.
#[derive(Clone, Debug, Default, Deserialize, Serialize, ToSchema, PartialEq, Eq)]
pub struct CacheReport {
    pub block_size: u64,
    pub prompt_tokens: u64,
    pub breakpoints: Vec<BreakpointReport>,
    /// The cache object the request named in `cached_content`, and what became of it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_content: Option<CachedContentReport>,
}

/// A request's use of a cache object.
#[derive(Clone, Debug, Default, Deserialize, Serialize, ToSchema, PartialEq, Eq)]
pub struct CachedContentReport {
    pub id: String,
    /// The object's prompt tokens (the request's first ones).
    pub input_tokens: u64,
    /// `read` (served from the cache), `coalesced`, or `written` (its KV was gone and was
    /// computed again, billed as a 1h cache write).
    pub status: String,
}

/// A response content block.
#[derive(Clone, Debug, Deserialize, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseBlock {
    Text { text: String },
}

/// `POST /v1/messages` response.
#[derive(Clone, Debug, Deserialize, Serialize, ToSchema)]
pub struct MessageResponse {
    pub id: String,
    /// Always `message`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Always `assistant`.
    pub role: String,
    pub model: String,
    pub content: Vec<ResponseBlock>,
    pub stop_reason: Option<String>,
    pub stop_sequence: Option<String>,
    pub usage: Usage,
    pub cachet: CacheReport,
    /// With the cache-diagnosis beta: `{"cache_miss_reason": …}` (null: nothing missed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub diagnostics: Option<Value>,
}

#[derive(Clone, Debug, Deserialize, Serialize, ToSchema)]
pub struct ModelObject {
    /// Always `model`.
    #[serde(rename = "type")]
    pub kind: String,
    pub id: String,
    pub display_name: String,
    pub created_at: String,
}

#[derive(Clone, Debug, Deserialize, Serialize, ToSchema)]
pub struct ModelList {
    pub data: Vec<ModelObject>,
    pub has_more: bool,
    pub first_id: Option<String>,
    pub last_id: Option<String>,
}

/// The error body every crate answers with (one shape, defined with the error vocabulary).
pub use cachet_common::error::{ErrorBody, ErrorDetail};
