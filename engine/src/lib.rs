//! Model runners behind one trait.
//!
//! What it exposes:
//! - [`Engine`]: render a [`Prompt`] into tokens (with the offset at the end of every content
//!   block), and start a [`Generation`] that imports cached per-block KV for a prefix, exports
//!   KV for requested blocks, and decodes token by token.
//! - [`TextStream`]: `max_tokens` and `stop_sequences` applied to any generation, the same way
//!   for every engine.
//! - [`reference::ReferenceEngine`]: SmolLM2-135M-Instruct on our own forward pass.
//! - [`sim::SimEngine`]: a cost-model engine with true KV geometry for tests and load tests.
//! - [`vllm::VllmEngine`]: a vLLM server upstream, whose own KV connector
//!   (`connectors/vllm/`) loads and saves its KV with the fabric node beside it
//!   ([`KvPath::Connector`]): the gateway sends it token ids and block keys, never KV.
//!
//! What it is not: it knows nothing about HTTP, tenants or billing; KV blocks come in and go
//! out as bytes keyed by hashes the caller computed.
//!
//! Engine calls are blocking CPU work: callers run them off the async runtime.

pub mod gpu;
pub mod kv;
pub mod memo;
pub mod metrics;
pub mod prompt;
pub mod reference;
pub mod sim;
pub mod stream;
pub mod vllm;

use bytes::Bytes;
use cachet_common::BlockHash;

pub use kv::KvDtype;
pub use prompt::{Prompt, PromptMessage, Rendered, Role};
pub use stream::{Delta, TextStream};

/// The shape of a model's KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvGeometry {
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub dtype: KvDtype,
}

impl KvGeometry {
    /// K and V for every layer and KV head of one token.
    pub fn bytes_per_token(&self) -> usize {
        2 * self.layers * self.kv_heads * self.dtype.vector_bytes(self.head_dim)
    }
}

/// Every model Cachet serves and its KV shape at its default dtype, without loading any
/// (for tools that size a cache: `cachet loadtest simulate-cache --capacity-bytes`).
pub fn kv_geometries() -> Vec<(String, KvGeometry)> {
    std::iter::once((reference::MODEL_ID.to_string(), reference::KV_SHAPE))
        .chain(
            sim::SimProfile::all()
                .into_iter()
                .map(|p| (p.info.id, p.info.kv)),
        )
        .collect()
}

/// The shortest prompt prefix each model caches (breakpoints before it are not written).
pub fn min_cacheable_tokens(model: &str) -> Option<usize> {
    if model == reference::MODEL_ID {
        return Some(reference::MIN_CACHEABLE_TOKENS);
    }
    sim::SimProfile::all()
        .into_iter()
        .find(|p| p.info.id == model)
        .map(|p| p.info.min_cacheable_tokens)
}

/// What the gateway needs to know about a served model.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    pub id: String,
    pub display_name: String,
    /// RFC 3339 release time shown by `GET /v1/models`.
    pub created_at: String,
    /// Tokens per KV block (the fabric's unit).
    pub block_size: usize,
    /// Breakpoints before this many tokens are silently not cached.
    pub min_cacheable_tokens: usize,
    pub max_output_tokens: u32,
    pub context_window: usize,
    /// The most bytes of text one token covers: a prompt of `n` bytes is at least
    /// `n / max_token_bytes` tokens, which refuses a huge prompt before tokenizing it.
    pub max_token_bytes: usize,
    pub kv: KvGeometry,
    /// LoRA adapter id; empty for the base model. Part of every block key.
    pub adapter_id: String,
    /// How the model's KV moves between the fabric and the engine.
    pub kv_path: KvPath,
}

impl ModelInfo {
    /// The `kv_dtype` field of the model's block keys: its KV dtype, or for a connector
    /// engine its whole key space (dtype, layout, block size).
    pub fn key_dtype(&self) -> &str {
        match &self.kv_path {
            KvPath::Gateway => self.kv.dtype.as_str(),
            KvPath::Connector { key_space } => key_space,
        }
    }
}

/// How a model's KV moves between the fabric and the engine.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum KvPath {
    /// Through the gateway: it reads the cached prefix's blocks and hands them to the engine
    /// ([`GenerateRequest::imported`]), and writes the blocks the engine exports.
    #[default]
    Gateway,
    /// The engine's own connector loads and saves blocks with the fabric node beside it
    /// (vLLM's `connectors/vllm/`); the gateway sends block keys ([`ConnectorParams`]) and
    /// reads what was loaded from the node's connector report.
    Connector {
        /// What, besides the tokens, decides a block's bytes in that engine (dtype, layout,
        /// block size): the `kv_dtype` field of every key, checked by the connector.
        key_space: String,
    },
}

/// What an engine's own KV connector needs to load and save a request's blocks.
#[derive(Clone, Debug, Default)]
pub struct ConnectorParams {
    /// The tenant scope as the fabric wire carries it (tenant id, workspace id).
    pub scope: [u8; 32],
    /// One key per full block of the prompt, in order (as far as the prompt may be cached).
    pub keys: Vec<BlockHash>,
    /// Entries to write once their blocks are computed, in order.
    pub writes: Vec<ConnectorWrite>,
    /// Names the request in the connector's report to the node.
    pub tag: u128,
    /// The engine's own prefix-cache namespace (vLLM's `cache_salt`): the tenant's, so its
    /// local cache is never shared across tenants either.
    pub cache_salt: String,
    /// Must equal the engine's [`KvPath::Connector`] key space.
    pub key_space: String,
}

/// One entry the connector writes: the blocks before `end_block`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectorWrite {
    pub end_block: usize,
    pub ttl: std::time::Duration,
    /// Paid (an explicit breakpoint) or best effort (automatic caching).
    pub paid: bool,
}

/// KV of the tokens `start..end`, as stored in the fabric.
#[derive(Clone, Debug)]
pub struct KvBlock {
    pub hash: BlockHash,
    pub start: usize,
    pub end: usize,
    pub data: Bytes,
}

/// A block whose KV the generation must hand back after prefill.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExportSpec {
    pub hash: BlockHash,
    pub start: usize,
    pub end: usize,
}

/// Sampling parameters. Without a temperature, decoding is greedy.
#[derive(Clone, Debug, Default)]
pub struct Sampling {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
    pub seed: Option<u64>,
    /// Generate exactly `max_new_tokens` tokens: the end-of-sequence token does not stop
    /// decoding (stop sequences still do). For load tests that replay a trace's output
    /// lengths (`cachet loadtest replay`).
    pub ignore_eos: bool,
}

/// One generation: the full prompt, the cached prefix's KV, the blocks to export.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub tokens: Vec<u32>,
    /// Contiguous blocks covering `0..n` for some `n <= tokens.len()`, in order.
    pub imported: Vec<KvBlock>,
    pub exports: Vec<ExportSpec>,
    pub sampling: Sampling,
    /// Upper bound on tokens to generate (sizes the KV cache).
    pub max_new_tokens: u32,
    /// For a [`KvPath::Connector`] engine: the keys its connector loads and saves.
    pub connector: Option<ConnectorParams>,
}

/// Why decoding stopped, as the Messages API reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopReason {
    EndTurn,
    MaxTokens,
    StopSequence(String),
}

impl StopReason {
    pub fn as_str(&self) -> &'static str {
        match self {
            StopReason::EndTurn => "end_turn",
            StopReason::MaxTokens => "max_tokens",
            StopReason::StopSequence(_) => "stop_sequence",
        }
    }
}

/// One generated token.
#[derive(Clone, Debug)]
pub struct Token {
    pub id: u32,
    pub text: String,
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("prompt is too long: {tokens} tokens > {limit} maximum")]
    ContextTooLong { tokens: usize, limit: usize },
    /// Refused before tokenizing: the text alone is more than the context could hold.
    #[error(
        "prompt is too long: {bytes} bytes of text are at least {min_tokens} tokens > {limit} maximum"
    )]
    PromptTooLarge {
        bytes: usize,
        min_tokens: usize,
        limit: usize,
    },
    #[error("imported KV for block {block} failed its integrity check")]
    KvIntegrity { block: BlockHash },
    #[error("invalid KV import: {0}")]
    InvalidImport(String),
    #[error("engine failure: {0}")]
    Internal(String),
    /// The engine (a remote server) cannot be reached or stopped answering: the request
    /// may succeed elsewhere or later.
    #[error("engine unavailable: {0}")]
    Unavailable(String),
}

impl cachet_common::error::ServiceError for EngineError {
    fn error_code(&self) -> cachet_common::error::ErrorCode {
        use cachet_common::error::ErrorCode;
        match self {
            EngineError::ContextTooLong { .. } | EngineError::PromptTooLarge { .. } => {
                ErrorCode::InvalidRequest
            }
            // Another engine, or the same one later, can serve it.
            EngineError::Unavailable(_) => ErrorCode::Overloaded,
            EngineError::KvIntegrity { .. }
            | EngineError::InvalidImport(_)
            | EngineError::Internal(_) => ErrorCode::Api,
        }
    }
}

/// A model runner. Implementations are shared across threads; every method blocks.
pub trait Engine: Send + Sync + 'static {
    fn info(&self) -> &ModelInfo;
    /// Render tools → system → messages through the model's chat template.
    fn render(&self, prompt: &Prompt) -> Result<Rendered, EngineError>;
    /// Prefill (from the imported prefix on) and get ready to decode.
    fn start(&self, req: GenerateRequest) -> Result<Box<dyn Generation>, EngineError>;
    /// Prefill time per uncached token expected from the model's profile, before anything
    /// has been measured: the seed of the routing gateway's learned estimate.
    fn nominal_prefill_per_token(&self) -> std::time::Duration;
    /// How its instances divide prefill and decode and how loaded each stage is, for an
    /// engine that measures it (vLLM upstreams); `None` for one that runs in this process.
    fn stages(&self) -> Option<cachet_common::stages::StageLoad> {
        None
    }
    /// The servers that run its generations (a vLLM upstream's instances; 1 for an engine
    /// in this process): the gateway gives the model `engine.workers` slots for each.
    fn instances(&self) -> usize {
        1
    }
}

/// A generation in progress.
pub trait Generation: Send {
    /// KV of the blocks asked for in [`GenerateRequest::exports`]; empty on later calls.
    fn take_exports(&mut self) -> Vec<KvBlock>;
    /// The next token, or `None` at end of turn.
    fn next_token(&mut self) -> Result<Option<Token>, EngineError>;
}
