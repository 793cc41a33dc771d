//! Our llama forward pass on candle building blocks, with the KV cache in our hands.
//!
//! - Weights are dequantized to f32 at load: exact, and the fastest CPU path measured whose
//!   output equals f32.
//! - Prefill is batched: causal attention over grouped-query heads without repeating K/V
//!   (the query heads of a group are stacked against their shared KV head).
//! - The KV cache is preallocated per layer (`kv_heads × max_ctx × head_dim`) and written in
//!   place; attention reads a view of its first `len` positions. Nothing is concatenated.
//! - KV of any token range can be exported as bytes and imported into a fresh cache; rotary
//!   positions continue from the imported length.
//!
//! Block byte layout (f32 little endian): for each layer, K then V, each `kv_heads × n_tokens ×
//! head_dim`, head-major.

use candle_core::quantized::gguf_file::Content;
use candle_core::{D, DType, Device, Tensor};

use crate::EngineError;

fn ce(e: candle_core::Error) -> EngineError {
    EngineError::Internal(format!("tensor op failed: {e}"))
}

/// Model hyper-parameters from the GGUF.
#[derive(Clone, Copy, Debug)]
pub struct Config {
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub hidden: usize,
    pub context: usize,
    pub rope_base: f32,
    pub eps: f64,
    pub vocab: usize,
}

impl Config {
    /// Bytes of f32 K and V of one token over all layers.
    pub fn kv_bytes_per_token(&self) -> usize {
        2 * self.layers * self.kv_heads * self.head_dim * 4
    }
}

/// One linear map, f32, stored transposed `(in, out)` for `x · W`.
///
/// Also measured (docs/benchmarks.md): Q8_0 for one-token decode changed greedy answers, and
/// f16 decoded 1.3× faster but is no longer the f32 computation; f32 is kept everywhere.
struct Linear {
    w_t: Tensor,
}

impl Linear {
    /// `w` is `(out, in)` as stored in the GGUF.
    fn new(w: Tensor) -> Result<Self, EngineError> {
        Ok(Self {
            w_t: w.t().map_err(ce)?.contiguous().map_err(ce)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor, EngineError> {
        x.matmul(&self.w_t).map_err(ce)
    }
}

struct Layer {
    attn_norm: Tensor,
    wq: Linear,
    wk: Linear,
    wv: Linear,
    wo: Linear,
    ffn_norm: Tensor,
    w_gate: Linear,
    w_up: Linear,
    w_down: Linear,
}

pub struct Weights {
    pub cfg: Config,
    embed: Tensor,
    lm_head: Linear,
    out_norm: Tensor,
    layers: Vec<Layer>,
    cos: Tensor,
    sin: Tensor,
}

fn md_u32(c: &Content, k: &str) -> Result<usize, EngineError> {
    super::tokenizer::metadata_u32(c, k).map(|v| v as usize)
}

fn md_f32(c: &Content, k: &str) -> Result<f32, EngineError> {
    c.metadata
        .get(k)
        .and_then(|v| v.to_f32().ok())
        .ok_or_else(|| EngineError::Internal(format!("model file lacks {k}")))
}

impl Weights {
    pub fn load(content: &Content, file: &mut std::fs::File) -> Result<Self, EngineError> {
        let dev = Device::Cpu;
        let hidden = md_u32(content, "llama.embedding_length")?;
        let heads = md_u32(content, "llama.attention.head_count")?;
        let cfg = Config {
            layers: md_u32(content, "llama.block_count")?,
            heads,
            kv_heads: md_u32(content, "llama.attention.head_count_kv")?,
            head_dim: hidden / heads,
            hidden,
            context: md_u32(content, "llama.context_length")?,
            rope_base: md_f32(content, "llama.rope.freq_base").unwrap_or(10_000.0),
            eps: md_f32(content, "llama.attention.layer_norm_rms_epsilon")? as f64,
            vocab: md_u32(content, "llama.vocab_size")?,
        };
        let mut get = |name: &str| -> Result<Tensor, EngineError> {
            let q = content
                .tensor(file, name, &dev)
                .map_err(|e| EngineError::Internal(format!("tensor {name}: {e}")))?;
            q.dequantize(&dev).map_err(ce)
        };
        let mut lin = |name: &str| -> Result<Linear, EngineError> { Linear::new(get(name)?) };
        let mut layers = Vec::with_capacity(cfg.layers);
        for i in 0..cfg.layers {
            layers.push(Layer {
                wq: lin(&format!("blk.{i}.attn_q.weight"))?,
                wk: lin(&format!("blk.{i}.attn_k.weight"))?,
                wv: lin(&format!("blk.{i}.attn_v.weight"))?,
                wo: lin(&format!("blk.{i}.attn_output.weight"))?,
                w_gate: lin(&format!("blk.{i}.ffn_gate.weight"))?,
                w_up: lin(&format!("blk.{i}.ffn_up.weight"))?,
                w_down: lin(&format!("blk.{i}.ffn_down.weight"))?,
                attn_norm: Tensor::zeros(1, DType::F32, &dev).map_err(ce)?,
                ffn_norm: Tensor::zeros(1, DType::F32, &dev).map_err(ce)?,
            });
        }
        let mut get = |name: &str| -> Result<Tensor, EngineError> {
            let q = content
                .tensor(file, name, &dev)
                .map_err(|e| EngineError::Internal(format!("tensor {name}: {e}")))?;
            q.dequantize(&dev).map_err(ce)
        };
        for (i, l) in layers.iter_mut().enumerate() {
            l.attn_norm = get(&format!("blk.{i}.attn_norm.weight"))?;
            l.ffn_norm = get(&format!("blk.{i}.ffn_norm.weight"))?;
        }
        let embed = get("token_embd.weight")?;
        let lm_head = if content.tensor_infos.contains_key("output.weight") {
            get("output.weight")?
        } else {
            embed.clone()
        };
        let lm_head = Linear::new(lm_head)?;
        let out_norm = get("output_norm.weight")?;
        // Rotary tables for every position.
        let half = cfg.head_dim / 2;
        let inv: Vec<f32> = (0..half)
            .map(|i| 1.0 / cfg.rope_base.powf(2.0 * i as f32 / cfg.head_dim as f32))
            .collect();
        let mut cos = Vec::with_capacity(cfg.context * half);
        let mut sin = Vec::with_capacity(cfg.context * half);
        for p in 0..cfg.context {
            for f in &inv {
                let a = p as f32 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        let cos = Tensor::from_vec(cos, (cfg.context, half), &dev).map_err(ce)?;
        let sin = Tensor::from_vec(sin, (cfg.context, half), &dev).map_err(ce)?;
        Ok(Self {
            cfg,
            embed,
            lm_head,
            out_norm,
            layers,
            cos,
            sin,
        })
    }
}

/// A preallocated KV cache for one sequence.
pub struct KvCache {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    pub len: usize,
    capacity: usize,
}

impl KvCache {
    pub fn new(cfg: &Config, capacity: usize) -> Result<Self, EngineError> {
        let shape = (cfg.kv_heads, capacity, cfg.head_dim);
        let mk = || Tensor::zeros(shape, DType::F32, &Device::Cpu).map_err(ce);
        let mut k = Vec::with_capacity(cfg.layers);
        let mut v = Vec::with_capacity(cfg.layers);
        for _ in 0..cfg.layers {
            k.push(mk()?);
            v.push(mk()?);
        }
        Ok(Self {
            k,
            v,
            len: 0,
            capacity,
        })
    }

    /// Make room for `needed` positions, doubling (capped at the context) and copying.
    pub fn grow_to(&mut self, cfg: &Config, needed: usize) -> Result<(), EngineError> {
        if needed <= self.capacity {
            return Ok(());
        }
        if needed > cfg.context {
            return Err(EngineError::ContextTooLong {
                tokens: needed,
                limit: cfg.context,
            });
        }
        let cap = (self.capacity * 2).max(needed).min(cfg.context);
        let mut bigger = KvCache::new(cfg, cap)?;
        for l in 0..cfg.layers {
            if self.len > 0 {
                bigger.k[l]
                    .slice_set(&self.k[l].narrow(1, 0, self.len).map_err(ce)?, 1, 0)
                    .map_err(ce)?;
                bigger.v[l]
                    .slice_set(&self.v[l].narrow(1, 0, self.len).map_err(ce)?, 1, 0)
                    .map_err(ce)?;
            }
        }
        bigger.len = self.len;
        *self = bigger;
        Ok(())
    }

    /// Append the KV of `n` tokens from block bytes (layout in the module doc).
    pub fn import(&mut self, cfg: &Config, data: &[u8], n: usize) -> Result<(), EngineError> {
        let per = cfg.kv_heads * n * cfg.head_dim;
        if data.len() != 2 * cfg.layers * per * 4 || self.len + n > self.capacity {
            return Err(EngineError::InvalidImport(format!(
                "block of {} bytes does not hold {n} tokens",
                data.len()
            )));
        }
        let floats: Vec<f32> = data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        for l in 0..cfg.layers {
            for (which, cache) in [(0, &self.k[l]), (1, &self.v[l])] {
                let off = (2 * l + which) * per;
                let t = Tensor::from_slice(
                    &floats[off..off + per],
                    (cfg.kv_heads, n, cfg.head_dim),
                    &Device::Cpu,
                )
                .map_err(ce)?;
                cache.slice_set(&t, 1, self.len).map_err(ce)?;
            }
        }
        self.len += n;
        Ok(())
    }

    /// The KV of positions `start..end` as block bytes.
    pub fn export(&self, cfg: &Config, start: usize, end: usize) -> Result<Vec<u8>, EngineError> {
        let n = end - start;
        let mut out = Vec::with_capacity(2 * cfg.layers * cfg.kv_heads * n * cfg.head_dim * 4);
        for l in 0..cfg.layers {
            for cache in [&self.k[l], &self.v[l]] {
                let part = cache
                    .narrow(1, start, n)
                    .map_err(ce)?
                    .flatten_all()
                    .map_err(ce)?
                    .to_vec1::<f32>()
                    .map_err(ce)?;
                for f in part {
                    out.extend_from_slice(&f.to_le_bytes());
                }
            }
        }
        Ok(out)
    }
}

fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor, EngineError> {
    candle_nn::ops::rms_norm(x, w, eps as f32).map_err(ce)
}

impl Weights {
    /// Run `tokens` at positions `cache.len..`, appending their KV to `cache`. Returns the
    /// logits of the last position, shape `(vocab,)`.
    pub fn forward(&self, tokens: &[u32], cache: &mut KvCache) -> Result<Tensor, EngineError> {
        let c = &self.cfg;
        let n = tokens.len();
        let past = cache.len;
        if n == 0 || past + n > cache.capacity {
            return Err(EngineError::ContextTooLong {
                tokens: past + n,
                limit: cache.capacity,
            });
        }
        let dev = Device::Cpu;
        let ids = Tensor::from_slice(tokens, n, &dev).map_err(ce)?;
        let mut x = self.embed.index_select(&ids, 0).map_err(ce)?; // (n, hidden)
        let cos = self.cos.narrow(0, past, n).map_err(ce)?;
        let sin = self.sin.narrow(0, past, n).map_err(ce)?;
        let ctx = past + n;
        let groups = c.heads / c.kv_heads;
        let mask = if n > 1 {
            let m: Vec<f32> = (0..n)
                .flat_map(|i| {
                    (0..ctx).map(move |j| if j > past + i { f32::NEG_INFINITY } else { 0.0 })
                })
                .collect();
            Some(Tensor::from_vec(m, (n, ctx), &dev).map_err(ce)?)
        } else {
            None
        };
        let scale = 1.0 / (c.head_dim as f64).sqrt();
        for (l, w) in self.layers.iter().enumerate() {
            let h = rms_norm(&x, &w.attn_norm, c.eps)?;
            let q = w.wq.forward(&h)?;
            let k = w.wk.forward(&h)?;
            let v = w.wv.forward(&h)?;
            // (n, heads·d) → (1, heads, n, d)
            let q = q
                .reshape((1, n, c.heads, c.head_dim))
                .and_then(|t| t.transpose(1, 2))
                .and_then(|t| t.contiguous())
                .map_err(ce)?;
            let k = k
                .reshape((1, n, c.kv_heads, c.head_dim))
                .and_then(|t| t.transpose(1, 2))
                .and_then(|t| t.contiguous())
                .map_err(ce)?;
            let v = v
                .reshape((n, c.kv_heads, c.head_dim))
                .and_then(|t| t.transpose(0, 1))
                .and_then(|t| t.contiguous())
                .map_err(ce)?;
            let q = candle_nn::rotary_emb::rope_i(&q, &cos, &sin).map_err(ce)?;
            let k = candle_nn::rotary_emb::rope_i(&k, &cos, &sin).map_err(ce)?;
            cache.k[l]
                .slice_set(&k.squeeze(0).map_err(ce)?, 1, past)
                .map_err(ce)?;
            cache.v[l].slice_set(&v, 1, past).map_err(ce)?;
            let k_all = cache.k[l].narrow(1, 0, ctx).map_err(ce)?;
            let v_all = cache.v[l].narrow(1, 0, ctx).map_err(ce)?;
            // Stack each group's query heads against their shared KV head.
            let qg = q
                .reshape((c.kv_heads, groups * n, c.head_dim))
                .map_err(ce)?;
            let scores = qg
                .matmul(&k_all.t().map_err(ce)?)
                .map_err(ce)?
                .affine(scale, 0.0)
                .map_err(ce)?;
            let scores = match &mask {
                Some(m) => scores
                    .reshape((c.kv_heads, groups, n, ctx))
                    .and_then(|s| s.broadcast_add(m))
                    .and_then(|s| s.reshape((c.kv_heads, groups * n, ctx)))
                    .map_err(ce)?,
                None => scores,
            };
            let probs = candle_nn::ops::softmax_last_dim(&scores).map_err(ce)?;
            let attn = probs.matmul(&v_all).map_err(ce)?; // (kv, groups·n, d)
            let attn = attn
                .reshape((c.heads, n, c.head_dim))
                .and_then(|t| t.transpose(0, 1))
                .and_then(|t| t.reshape((n, c.hidden)))
                .map_err(ce)?;
            x = (x + w.wo.forward(&attn)?).map_err(ce)?;
            let h = rms_norm(&x, &w.ffn_norm, c.eps)?;
            let gate = w.w_gate.forward(&h)?.silu().map_err(ce)?;
            let up = w.w_up.forward(&h)?;
            let ff = w.w_down.forward(&(gate * up).map_err(ce)?)?;
            x = (x + ff).map_err(ce)?;
        }
        cache.len = ctx;
        let last = x.narrow(0, n - 1, 1).map_err(ce)?;
        let last = rms_norm(&last, &self.out_norm, c.eps)?;
        self.lm_head.forward(&last)?.squeeze(0).map_err(ce)
    }
}

/// Index of the largest logit.
pub fn argmax(logits: &Tensor) -> Result<u32, EngineError> {
    logits
        .argmax(D::Minus1)
        .and_then(|t| t.to_scalar::<u32>())
        .map_err(ce)
}
