//! The `sim` engine: a cost model with true KV geometry, for tests and load tests.
//!
//! - Tokenizer: deterministic word-piece splitting, ids from an FNV hash of each piece.
//! - Prefill time: `uncached_tokens × prefill_us + cached_tokens × load_us`, decode time
//!   `decode_us` per token, all scaled by `time_scale` (0 = zero compute cost).
//! - KV bytes of a block are derived from its hash, so the bytes that come back from the
//!   fabric can be checked end to end: an import whose bytes do not match is refused.
//! - Output text is a deterministic function of the prompt tokens (not of what was cached).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cachet_common::BlockHash;

use crate::memo::SegmentMemo;
use crate::{
    EngineError, ExportSpec, GenerateRequest, Generation, KvBlock, KvDtype, KvGeometry, ModelInfo,
    Prompt, Rendered, Role, Token, metrics,
};

const VOCAB: u32 = 32_000;
const FIRST_PIECE_ID: u32 = 1_024;
const TOOLS: u32 = 3;
const SYSTEM: u32 = 4;
const USER: u32 = 5;
const ASSISTANT: u32 = 6;
const END: u32 = 7;
const SEP: u32 = 8;
const WORD_ID_BASE: u32 = 100;
const WORDS: &[&str] = &[
    "the", "cache", "prefix", "block", "token", "model", "answer", "fabric", "request", "tenant",
    "quickly", "result", "is", "ready", "and", "served", "from", "memory", "without", "prefill",
    "again", "every", "time", "which", "saves", "compute", "for", "long", "prompts", "so",
    "latency", "drops",
];

/// Cost and shape of a simulated model.
#[derive(Clone, Debug)]
pub struct SimProfile {
    pub info: ModelInfo,
    pub prefill_us_per_token: f64,
    pub load_us_per_token: f64,
    pub decode_us_per_token: f64,
    /// Every answer this many tokens long (before `max_tokens`), for load and slow-reader
    /// tests; `None`: 12 to 31 tokens, chosen by the prompt.
    pub answer_tokens: Option<usize>,
}

impl SimProfile {
    /// Small KV, fast: for tests and gateway benchmarks.
    pub fn tiny() -> Self {
        Self {
            info: info(
                "sim-tiny",
                "Sim Tiny",
                16,
                32,
                4096,
                32_768,
                KvGeometry {
                    layers: 2,
                    kv_heads: 1,
                    head_dim: 16,
                    dtype: KvDtype::F16,
                },
            ),
            prefill_us_per_token: 20.0,
            load_us_per_token: 0.5,
            decode_us_per_token: 2_000.0,
            answer_tokens: None,
        }
    }
    /// Llama-3-8B-shaped KV (32 layers, 8 KV heads, head dim 128, bf16), H100-like costs.
    pub fn llama_8b() -> Self {
        Self {
            info: info(
                "sim-llama-8b",
                "Sim Llama 8B",
                16,
                1024,
                8192,
                131_072,
                KvGeometry {
                    layers: 32,
                    kv_heads: 8,
                    head_dim: 128,
                    dtype: KvDtype::Bf16,
                },
            ),
            prefill_us_per_token: 60.0,
            load_us_per_token: 2.0,
            decode_us_per_token: 12_000.0,
            answer_tokens: None,
        }
    }
    /// Llama-3-70B-shaped KV (80 layers, 8 KV heads, head dim 128, bf16).
    pub fn llama_70b() -> Self {
        Self {
            info: info(
                "sim-llama-70b",
                "Sim Llama 70B",
                16,
                2048,
                8192,
                131_072,
                KvGeometry {
                    layers: 80,
                    kv_heads: 8,
                    head_dim: 128,
                    dtype: KvDtype::Bf16,
                },
            ),
            prefill_us_per_token: 400.0,
            load_us_per_token: 5.0,
            decode_us_per_token: 30_000.0,
            answer_tokens: None,
        }
    }
    /// The same model storing its KV as `dtype`: blocks take that dtype's bytes, and
    /// loading a cached token costs in proportion (it is a copy of those bytes).
    pub fn with_kv_dtype(mut self, dtype: KvDtype) -> Self {
        let before = self.info.kv.bytes_per_token() as f64;
        self.info.kv.dtype = dtype;
        self.load_us_per_token *= self.info.kv.bytes_per_token() as f64 / before;
        self
    }
    pub fn all() -> Vec<SimProfile> {
        vec![Self::tiny(), Self::llama_8b(), Self::llama_70b()]
    }
}

fn info(
    id: &str,
    name: &str,
    block: usize,
    min: usize,
    max_out: u32,
    ctx: usize,
    kv: KvGeometry,
) -> ModelInfo {
    ModelInfo {
        id: id.into(),
        display_name: name.into(),
        created_at: "2026-11-01T00:00:00Z".into(),
        block_size: block,
        min_cacheable_tokens: min,
        max_output_tokens: max_out,
        context_window: ctx,
        max_token_bytes: MAX_TOKEN_BYTES,
        kv,
        adapter_id: String::new(),
        kv_path: crate::KvPath::Gateway,
    }
}

pub struct SimEngine {
    profile: SimProfile,
    time_scale: f64,
    memo: SegmentMemo,
}

impl SimEngine {
    /// `time_scale` multiplies every modelled delay; 0 makes compute free.
    pub fn new(profile: SimProfile, time_scale: f64) -> Self {
        Self {
            profile,
            time_scale: time_scale.max(0.0),
            memo: SegmentMemo::new(crate::memo::MODEL_MEMO_BYTES),
        }
    }

    fn delay(&self, micros: f64) {
        let us = micros * self.time_scale;
        if us >= 1.0 {
            std::thread::sleep(Duration::from_micros(us as u64));
        }
    }

    /// The deterministic KV bytes of a block.
    pub fn block_bytes(&self, hash: &BlockHash, n_tokens: usize) -> Bytes {
        kv_bytes(hash, n_tokens * self.profile.info.kv.bytes_per_token())
    }
}

/// Tokenize text: alphanumeric runs (with one leading space, split every 6 chars),
/// whitespace runs and single other characters each become one token.
/// The longest text one sim token covers (a whitespace run; a word piece is at most 7 bytes).
pub const MAX_TOKEN_BYTES: usize = 16;

pub fn tokenize(text: &str) -> Vec<u32> {
    let mut out = Vec::with_capacity(text.len() / 4 + 1);
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let start = i;
        let c = bytes[i];
        if c == b' ' && i + 1 < bytes.len() && bytes[i + 1].is_ascii_alphanumeric() {
            i += 1;
        }
        if bytes[i].is_ascii_alphanumeric() {
            let word_start = i;
            while i < bytes.len() && bytes[i].is_ascii_alphanumeric() && i - word_start < 6 {
                i += 1;
            }
        } else if bytes[i].is_ascii_whitespace() {
            // Runs are cut at MAX_TOKEN_BYTES, like any real tokenizer's longest token.
            while i < bytes.len() && bytes[i].is_ascii_whitespace() && i - start < MAX_TOKEN_BYTES {
                i += 1;
            }
        } else {
            // One char (whole UTF-8 sequence).
            let len = match bytes[i] {
                0x00..=0x7f => 1,
                0xc0..=0xdf => 2,
                0xe0..=0xef => 3,
                _ => 4,
            };
            i = (i + len).min(bytes.len());
        }
        out.push(piece_id(&bytes[start..i]));
    }
    out
}

fn piece_id(piece: &[u8]) -> u32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in piece {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    FIRST_PIECE_ID + (h % (VOCAB - FIRST_PIECE_ID) as u64) as u32
}

/// The `i`-th 8-byte word of a block's KV: a position-dependent mix of the block hash.
/// `seed + i·K` (K odd) is distinct for every position and the xorshift mix is a bijection,
/// so every word of a block differs and a changed byte anywhere is caught. Only adds, shifts
/// and xors: it vectorizes on baseline x86-64.
#[inline(always)]
fn kv_word(seed: u64, salt: u64, i: u64) -> u64 {
    let a = seed.wrapping_add(i.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    a ^ (a >> 29) ^ (a << 17) ^ salt
}

fn kv_seed(hash: &BlockHash) -> (u64, u64) {
    (
        hash.prefix_u64(),
        u64::from_le_bytes(hash.0[8..16].try_into().expect("8 bytes")),
    )
}

/// Deterministic KV bytes of a block, derived from its hash.
pub fn kv_bytes(hash: &BlockHash, len: usize) -> Bytes {
    let (seed, salt) = kv_seed(hash);
    let mut out = Vec::with_capacity(len.div_ceil(8) * 8);
    for i in 0..len.div_ceil(8) as u64 {
        out.extend_from_slice(&kv_word(seed, salt, i).to_le_bytes());
    }
    out.truncate(len);
    Bytes::from(out)
}

/// Whether `data` is exactly the KV [`kv_bytes`] derives from `hash`, without allocating.
pub fn kv_matches(hash: &BlockHash, data: &[u8]) -> bool {
    let (seed, salt) = kv_seed(hash);
    let mut chunks = data.chunks_exact(8);
    let mut diff = 0u64;
    for (i, c) in (&mut chunks).enumerate() {
        diff |= u64::from_le_bytes(c.try_into().expect("8 bytes")) ^ kv_word(seed, salt, i as u64);
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let w = kv_word(seed, salt, (data.len() / 8) as u64).to_le_bytes();
        diff |= u64::from(rest != &w[..rest.len()]);
    }
    diff == 0
}

impl crate::Engine for SimEngine {
    fn info(&self) -> &ModelInfo {
        &self.profile.info
    }

    /// The profile's prefill cost at time scale 1: what the modelled GPU would take.
    fn nominal_prefill_per_token(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.profile.prefill_us_per_token / 1e6)
    }

    fn render(&self, prompt: &Prompt) -> Result<Rendered, EngineError> {
        prompt.check_fits(&self.profile.info)?;
        let mut r = Rendered::default();
        let push_block = |r: &mut Rendered, text: &str| {
            let toks = self.memo.tokens(prompt.memo_scope, text, tokenize);
            r.tokens.extend_from_slice(&toks);
        };
        if !prompt.tools.is_empty() {
            r.tokens.push(TOOLS);
            for t in &prompt.tools {
                push_block(&mut r, t);
                r.tool_ends.push(r.tokens.len());
                r.tokens.push(SEP);
            }
        }
        if !prompt.system.is_empty() {
            r.tokens.push(SYSTEM);
            for s in &prompt.system {
                push_block(&mut r, s);
                r.system_ends.push(r.tokens.len());
                r.tokens.push(SEP);
            }
        }
        let last = prompt.messages.len().saturating_sub(1);
        for (i, m) in prompt.messages.iter().enumerate() {
            r.tokens.push(if m.role == Role::User {
                USER
            } else {
                ASSISTANT
            });
            let mut ends = Vec::with_capacity(m.blocks.len());
            for b in &m.blocks {
                push_block(&mut r, b);
                ends.push(r.tokens.len());
            }
            r.message_ends.push(ends);
            // A final assistant message is a prefill: the reply continues it.
            if !(i == last && m.role == Role::Assistant) {
                r.tokens.push(END);
            }
        }
        if prompt.messages.last().is_none_or(|m| m.role == Role::User) {
            r.tokens.push(ASSISTANT);
        }
        let limit = self.profile.info.context_window;
        if r.tokens.len() > limit {
            return Err(EngineError::ContextTooLong {
                tokens: r.tokens.len(),
                limit,
            });
        }
        Ok(r)
    }

    fn start(&self, req: GenerateRequest) -> Result<Box<dyn Generation>, EngineError> {
        let bpt = self.profile.info.kv.bytes_per_token();
        let mut cached = 0usize;
        for b in &req.imported {
            if b.start != cached || b.end <= b.start || b.end > req.tokens.len() {
                return Err(EngineError::InvalidImport(format!(
                    "block {}..{} does not continue the prefix at {cached}",
                    b.start, b.end
                )));
            }
            if b.data.len() != (b.end - b.start) * bpt || !kv_matches(&b.hash, &b.data) {
                return Err(EngineError::KvIntegrity { block: b.hash });
            }
            cached = b.end;
        }
        let uncached = req.tokens.len() - cached;
        let model = self.profile.info.id.as_str();
        metrics::TOKENS
            .with_label_values(&[model, "imported"])
            .inc_by(cached as u64);
        metrics::TOKENS
            .with_label_values(&[model, "prefilled"])
            .inc_by(uncached as u64);
        self.delay(
            uncached as f64 * self.profile.prefill_us_per_token
                + cached as f64 * self.profile.load_us_per_token,
        );
        let exports = req
            .exports
            .iter()
            .map(|&ExportSpec { hash, start, end }| {
                if end > req.tokens.len() || start >= end {
                    return Err(EngineError::InvalidImport(format!(
                        "export range {start}..{end} is outside the prompt"
                    )));
                }
                Ok(KvBlock {
                    hash,
                    start,
                    end,
                    data: self.block_bytes(&hash, end - start),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        // Output depends only on the prompt (and seed), never on what was cached.
        let seed = req
            .sampling
            .seed
            .filter(|_| req.sampling.temperature.is_some_and(|t| t > 0.0))
            .unwrap_or(0);
        let mut x: u64 = 0xcbf2_9ce4_8422_2325 ^ seed;
        for &t in &req.tokens {
            x = (x ^ t as u64)
                .wrapping_mul(0x0000_0100_0000_01b3)
                .rotate_left(5);
        }
        let mut digest = [0u8; 32];
        for (k, chunk) in digest.chunks_exact_mut(8).enumerate() {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            chunk.copy_from_slice(&kv_word(x, k as u64, k as u64).to_le_bytes());
        }
        let n_words = if req.sampling.ignore_eos {
            req.max_new_tokens as usize
        } else {
            self.profile
                .answer_tokens
                .unwrap_or(12 + (digest[0] as usize % 20))
        };
        let words: Vec<u32> = (0..n_words)
            .map(|i| digest[(i + 1) % 32] as u32 ^ (i as u32 * 7))
            .collect();
        Ok(Box::new(SimGeneration {
            words: Arc::new(words),
            next: 0,
            exports,
            decode_us: self.profile.decode_us_per_token * self.time_scale,
            model: self.profile.info.id.clone(),
        }))
    }
}

struct SimGeneration {
    words: Arc<Vec<u32>>,
    next: usize,
    exports: Vec<KvBlock>,
    decode_us: f64,
    model: String,
}

impl Generation for SimGeneration {
    fn take_exports(&mut self) -> Vec<KvBlock> {
        std::mem::take(&mut self.exports)
    }

    fn next_token(&mut self) -> Result<Option<Token>, EngineError> {
        if self.next >= self.words.len() {
            return Ok(None);
        }
        if self.decode_us >= 1.0 {
            std::thread::sleep(Duration::from_micros(self.decode_us as u64));
        }
        let w = self.words[self.next] as usize % WORDS.len();
        let last = self.next + 1 == self.words.len();
        let mut text = if self.next == 0 {
            capitalize(WORDS[w])
        } else {
            format!(" {}", WORDS[w])
        };
        if last {
            text.push('.');
        }
        self.next += 1;
        metrics::TOKENS
            .with_label_values(&[self.model.as_str(), "generated"])
            .inc();
        Ok(Some(Token {
            id: WORD_ID_BASE + w as u32,
            text,
        }))
    }
}

fn capitalize(w: &str) -> String {
    let mut c = w.chars();
    c.next()
        .map(|f| f.to_uppercase().collect::<String>() + c.as_str())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Engine, PromptMessage, Sampling};

    fn engine() -> SimEngine {
        SimEngine::new(SimProfile::tiny(), 0.0)
    }

    fn prompt(text: &str) -> Prompt {
        Prompt {
            tools: vec!["{\"name\":\"get_weather\"}".into()],
            system: vec!["You are terse.".into(), "Answer in English.".into()],
            messages: vec![PromptMessage {
                role: Role::User,
                blocks: vec![text.into(), "Thanks!".into()],
            }],
            memo_scope: 0,
        }
    }

    #[test]
    fn block_ends_are_recorded_in_render_order() {
        let r = engine().render(&prompt("What is a KV cache?")).unwrap();
        let all: Vec<usize> = r
            .tool_ends
            .iter()
            .chain(&r.system_ends)
            .chain(r.message_ends.iter().flatten())
            .copied()
            .collect();
        assert_eq!(all.len(), 5);
        assert!(all.windows(2).all(|w| w[0] < w[1]));
        assert!(*all.last().unwrap() < r.tokens.len());
        assert_eq!(r.tokens.last(), Some(&ASSISTANT));
    }

    #[test]
    fn same_text_gives_same_tokens_and_a_change_changes_them() {
        assert_eq!(
            tokenize("hello world, again"),
            tokenize("hello world, again")
        );
        assert_ne!(tokenize("hello world"), tokenize("hello worle"));
        assert_eq!(tokenize("héllo").len(), 3, "h, é, llo");
        let long = "lorem ipsum ".repeat(100);
        let e = engine();
        let p = Prompt {
            messages: vec![PromptMessage {
                role: Role::User,
                blocks: vec![long],
            }],
            ..Default::default()
        };
        assert_eq!(
            e.render(&p).unwrap(),
            e.render(&p).unwrap(),
            "memoized render equals fresh render"
        );
    }

    #[test]
    fn a_prompt_too_large_for_any_tokenization_is_refused_before_tokenizing() {
        let e = engine();
        let limit = e.info().context_window;
        // Each sim token covers at most MAX_TOKEN_BYTES, so this cannot fit however it splits.
        let huge = "a".repeat((limit + 1) * MAX_TOKEN_BYTES + 5);
        match e.render(&prompt(&huge)) {
            Err(EngineError::PromptTooLarge {
                bytes, min_tokens, ..
            }) => {
                assert!(bytes >= huge.len());
                assert_eq!(
                    min_tokens,
                    bytes / MAX_TOKEN_BYTES,
                    "the bound, not a count"
                );
            }
            other => panic!("expected PromptTooLarge, got {other:?}"),
        }
        // Just inside the bound it is tokenized and refused on its real count (or fits).
        let inside = "a".repeat(limit * MAX_TOKEN_BYTES / 2);
        assert!(matches!(
            e.render(&prompt(&inside)),
            Err(EngineError::ContextTooLong { .. }) | Ok(_)
        ));
    }

    #[test]
    fn no_sim_token_covers_more_than_max_token_bytes() {
        let text = format!("{}x{}\u{1F600}word", " ".repeat(100), "\n".repeat(40));
        let toks = tokenize(&text);
        // Every token id comes from at most MAX_TOKEN_BYTES bytes, so the count is bounded below.
        assert!(
            toks.len() >= text.len() / MAX_TOKEN_BYTES,
            "{} tokens",
            toks.len()
        );
    }

    #[test]
    fn kv_check_catches_any_single_changed_byte() {
        let h = BlockHash([9; 32]);
        let data = kv_bytes(&h, 100);
        assert!(kv_matches(&h, &data));
        assert!(!kv_matches(&BlockHash([8; 32]), &data));
        for i in [0, 7, 8, 63, 99] {
            let mut d = data.to_vec();
            d[i] ^= 0x01;
            assert!(!kv_matches(&h, &d), "byte {i}");
        }
    }

    #[test]
    fn imported_kv_is_checked_and_output_does_not_depend_on_it() {
        let e = engine();
        let r = e.render(&prompt("Tell me about caches.")).unwrap();
        let h = BlockHash([7; 32]);
        let data = e.block_bytes(&h, 16);
        let run = |imported: Vec<KvBlock>| -> Result<Vec<u32>, EngineError> {
            let mut g = e.start(GenerateRequest {
                tokens: r.tokens.clone(),
                imported,
                exports: vec![ExportSpec {
                    hash: h,
                    start: 0,
                    end: 16,
                }],
                sampling: Sampling::default(),
                max_new_tokens: 64,
                connector: None,
            })?;
            assert_eq!(g.take_exports()[0].data, data);
            let mut out = Vec::new();
            while let Some(t) = g.next_token()? {
                out.push(t.id);
            }
            Ok(out)
        };
        let cold = run(vec![]).unwrap();
        let warm = run(vec![KvBlock {
            hash: h,
            start: 0,
            end: 16,
            data: data.clone(),
        }])
        .unwrap();
        assert_eq!(cold, warm);
        let mut bad = data.to_vec();
        bad[3] ^= 0x10;
        let err = run(vec![KvBlock {
            hash: h,
            start: 0,
            end: 16,
            data: Bytes::from(bad),
        }])
        .unwrap_err();
        assert!(matches!(err, EngineError::KvIntegrity { .. }));
    }
}
