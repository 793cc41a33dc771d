//! Our llama forward pass on candle building blocks, with the KV cache in our hands.
//!
//! - Weights are dequantized to f32 for batched prefill; passes of up to
//!   [`kernels::SMALL_M`] tokens (decode, the tail after a cached prefix) read the shipped
//!   Q4_1/Q8_0 blocks ([`super::q4`]) with weights bit-identical to the f32 ones.
//! - Prefill is batched (in chunks, by the caller): causal attention over grouped-query heads
//!   without repeating K/V (the query heads of a group are stacked against their shared KV
//!   head). One-token decode computes attention directly on the cache memory.
//! - The KV cache is preallocated per layer (`kv_heads × max_ctx × head_dim`) and written in
//!   place; attention reads a view of its first `len` positions. Nothing is concatenated.
//! - KV of any token range can be exported as bytes, and a fresh cache can be built from
//!   block bytes ([`KvCache::with_prefix`]); rotary positions continue from the imported length.
//!
//! Block byte layout: for each layer, K then V, each `kv_heads × n_tokens` vectors of `head_dim`
//! elements, head-major, every vector in the cache's [`KvDtype`] (f32 little endian by default;
//! see [`crate::kv`]). With a dtype other than f32, every token's K and V are rounded to that
//! dtype as they are computed, so attention sees the same values whether a token was computed
//! now or imported from a stored block.

use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::{GgmlDType, QTensor};

use super::kernels;
use super::q4::{Format, Q4Matrix};
use candle_core::{D, DType, Device, Tensor};
use rayon::prelude::*;

use crate::{EngineError, KvDtype};

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

/// One linear map: f32 `(in, out)` for batched prefill (compute-bound), and for passes of a
/// few tokens (memory-bound) the shipped Q4_1 blocks read directly ([`super::q4`]), with
/// weights bit-identical to the f32 ones (or, without them, [`kernels::matmul_small`]).
struct Linear {
    w_t: Tensor,
    q4: Option<Q4Matrix>,
}

impl Linear {
    /// `q` is `(out, in)` as stored in the GGUF.
    fn new(q: QTensor, q4_decode: bool) -> Result<Self, EngineError> {
        let w = q.dequantize(&Device::Cpu).map_err(ce)?;
        let format = match q.dtype() {
            GgmlDType::Q4_1 => Some(Format::Q4_1),
            GgmlDType::Q8_0 => Some(Format::Q8_0),
            _ => None,
        };
        let q4 = match format.filter(|_| q4_decode) {
            Some(f) => {
                let (rows, cols) = w.dims2().map_err(ce)?;
                Q4Matrix::new(f, &q.data().map_err(ce)?, rows, cols)
            }
            None => None,
        };
        Ok(Self {
            w_t: w.t().map_err(ce)?.contiguous().map_err(ce)?,
            q4,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor, EngineError> {
        match &self.q4 {
            Some(q) if x.dim(0).map_err(ce)? <= kernels::SMALL_M => {
                let m = x.dim(0).map_err(ce)?;
                let xv = x
                    .flatten_all()
                    .and_then(|t| t.to_vec1::<f32>())
                    .map_err(ce)?;
                if m > 1 {
                    let y = q.matmul_rows(&xv, m);
                    return Tensor::from_vec(y, (m, q.rows), &Device::Cpu).map_err(ce);
                }
                let mut y = vec![0f32; q.rows];
                q.matvec(&xv, &mut y);
                Tensor::from_vec(y, (1, q.rows), &Device::Cpu).map_err(ce)
            }
            _ => {
                let (m, k) = x.dims2().map_err(ce)?;
                if m > kernels::SMALL_M {
                    return x.matmul(&self.w_t).map_err(ce);
                }
                let n = self.w_t.dim(1).map_err(ce)?;
                let xv = x
                    .flatten_all()
                    .and_then(|t| t.to_vec1::<f32>())
                    .map_err(ce)?;
                let (st, _) = self.w_t.storage_and_layout();
                let y = kernels::matmul_small(&xv, as_f32(&st)?, m, k, n);
                Tensor::from_vec(y, (m, n), &Device::Cpu).map_err(ce)
            }
        }
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
    /// `q4_decode`: decode one token at a time from the Q4_1 blocks (see [`super::q4`]).
    pub fn load(
        content: &Content,
        file: &mut std::fs::File,
        q4_decode: bool,
    ) -> Result<Self, EngineError> {
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
        let mut raw = |name: &str| -> Result<QTensor, EngineError> {
            content
                .tensor(file, name, &dev)
                .map_err(|e| EngineError::Internal(format!("tensor {name}: {e}")))
        };
        let mut layers = Vec::with_capacity(cfg.layers);
        for i in 0..cfg.layers {
            let mut lin = |n: &str| Linear::new(raw(&format!("blk.{i}.{n}.weight"))?, q4_decode);
            let wq = lin("attn_q")?;
            let wk = lin("attn_k")?;
            let wv = lin("attn_v")?;
            let wo = lin("attn_output")?;
            let w_gate = lin("ffn_gate")?;
            let w_up = lin("ffn_up")?;
            let w_down = lin("ffn_down")?;
            let mut norm = |n: &str| {
                raw(&format!("blk.{i}.{n}.weight"))?
                    .dequantize(&dev)
                    .map_err(ce)
            };
            let attn_norm = norm("attn_norm")?;
            let ffn_norm = norm("ffn_norm")?;
            layers.push(Layer {
                attn_norm,
                wq,
                wk,
                wv,
                wo,
                ffn_norm,
                w_gate,
                w_up,
                w_down,
            });
        }
        let embed_q = raw("token_embd.weight")?;
        let embed = embed_q.dequantize(&dev).map_err(ce)?;
        let lm_head = if content.tensor_infos.contains_key("output.weight") {
            Linear::new(raw("output.weight")?, q4_decode)?
        } else {
            Linear::new(embed_q, q4_decode)?
        };
        let out_norm = raw("output_norm.weight")?.dequantize(&dev).map_err(ce)?;
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
    dtype: KvDtype,
}

impl KvCache {
    pub fn new(cfg: &Config, capacity: usize, dtype: KvDtype) -> Result<Self, EngineError> {
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
            dtype,
        })
    }

    /// A cache holding `blocks` (contiguous from position 0) with room for `capacity`
    /// positions, built in one pass per layer straight from the block bytes.
    pub fn with_prefix(
        cfg: &Config,
        capacity: usize,
        blocks: &[crate::KvBlock],
        dtype: KvDtype,
    ) -> Result<Self, EngineError> {
        let (h, d) = (cfg.kv_heads, cfg.head_dim);
        let vb = dtype.vector_bytes(d);
        let mut len = 0;
        for b in blocks {
            let n = b.end - b.start;
            if b.start != len || b.data.len() != 2 * cfg.layers * h * n * vb {
                return Err(EngineError::InvalidImport(format!(
                    "block {}..{} does not continue the prefix at {len}",
                    b.start, b.end
                )));
            }
            len = b.end;
        }
        if len > capacity {
            return Err(EngineError::InvalidImport(format!(
                "prefix of {len} tokens exceeds the cache ({capacity})"
            )));
        }
        // One task per layer and K/V: the copy is memory-bound and both cores help.
        let mut kv = (0..2 * cfg.layers)
            .into_par_iter()
            .map(|i| {
                let (l, which) = (i / 2, i % 2);
                // Head by head: the prefix's rows from the blocks, then zeros for the rest
                // (the prefix is written once, not zeroed first).
                let mut buf: Vec<f32> = Vec::with_capacity(h * capacity * d);
                for head in 0..h {
                    for b in blocks {
                        let n = b.end - b.start;
                        let per = h * n * vb;
                        let src = &b.data[(2 * l + which) * per..(2 * l + which + 1) * per];
                        let rows = &src[head * n * vb..(head + 1) * n * vb];
                        if dtype == KvDtype::F32 {
                            extend_le_f32(&mut buf, rows);
                        } else {
                            rows.chunks_exact(vb)
                                .for_each(|r| dtype.decode(r, &mut buf));
                        }
                    }
                    buf.resize((head + 1) * capacity * d, 0.0);
                }
                Tensor::from_vec(buf, (h, capacity, d), &Device::Cpu).map_err(ce)
            })
            .collect::<Result<Vec<_>, _>>()?
            .into_iter();
        let (mut k, mut v) = (
            Vec::with_capacity(cfg.layers),
            Vec::with_capacity(cfg.layers),
        );
        while let (Some(kt), Some(vt)) = (kv.next(), kv.next()) {
            k.push(kt);
            v.push(vt);
        }
        Ok(Self {
            k,
            v,
            len,
            capacity,
            dtype,
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
        let mut bigger = KvCache::new(cfg, cap, self.dtype)?;
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

    /// The KV of positions `start..end` as block bytes.
    pub fn export(&self, cfg: &Config, start: usize, end: usize) -> Result<Vec<u8>, EngineError> {
        let n = end - start;
        let d = cfg.head_dim;
        let mut out =
            Vec::with_capacity(2 * cfg.layers * cfg.kv_heads * n * self.dtype.vector_bytes(d));
        for l in 0..cfg.layers {
            for cache in [&self.k[l], &self.v[l]] {
                let part = cache
                    .narrow(1, start, n)
                    .map_err(ce)?
                    .flatten_all()
                    .map_err(ce)?
                    .to_vec1::<f32>()
                    .map_err(ce)?;
                part.chunks_exact(d)
                    .for_each(|v| self.dtype.encode(v, &mut out));
            }
        }
        Ok(out)
    }

    /// The dtype this cache stores (and rounds fresh K/V to).
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }
}

/// Append little-endian f32 bytes as floats (a plain copy where the target is little-endian).
fn extend_le_f32(dst: &mut Vec<f32>, src: &[u8]) {
    assert!(src.len().is_multiple_of(4));
    let n = src.len() / 4;
    dst.reserve(n);
    #[cfg(target_endian = "little")]
    // SAFETY: `reserve` made room for `n` more floats past `len`; exactly `src.len()` bytes
    // are copied there (the regions cannot overlap: `dst` is borrowed mutably), every bit
    // pattern is a valid f32, and only then is the length extended over them.
    unsafe {
        std::ptr::copy_nonoverlapping(
            src.as_ptr(),
            dst.as_mut_ptr().add(dst.len()).cast::<u8>(),
            src.len(),
        );
        dst.set_len(dst.len() + n);
    }
    #[cfg(not(target_endian = "little"))]
    dst.extend(
        src.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
    );
}

fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor, EngineError> {
    candle_nn::ops::rms_norm(x, w, eps as f32).map_err(ce)
}

impl Weights {
    /// Run `tokens` at positions `cache.len..`, appending their KV to `cache`. Returns the
    /// logits of the last position, shape `(vocab,)`.
    pub fn forward(&self, tokens: &[u32], cache: &mut KvCache) -> Result<Tensor, EngineError> {
        let x = self.forward_hidden(tokens, cache)?;
        let last = x.narrow(0, tokens.len() - 1, 1).map_err(ce)?;
        let last = rms_norm(&last, &self.out_norm, self.cfg.eps)?;
        self.lm_head.forward(&last)?.squeeze(0).map_err(ce)
    }

    /// Like [`Weights::forward`], with the logits of every position, shape `(n, vocab)`
    /// (teacher-forced scoring).
    pub fn forward_all(&self, tokens: &[u32], cache: &mut KvCache) -> Result<Tensor, EngineError> {
        let x = self.forward_hidden(tokens, cache)?;
        let x = rms_norm(&x, &self.out_norm, self.cfg.eps)?;
        self.lm_head.forward(&x)
    }

    /// The final hidden states `(n, hidden)` of `tokens` at positions `cache.len..`.
    fn forward_hidden(&self, tokens: &[u32], cache: &mut KvCache) -> Result<Tensor, EngineError> {
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
            let (k, v) = (
                round_to(cache.dtype, k, c.head_dim)?,
                round_to(cache.dtype, v, c.head_dim)?,
            );
            cache.k[l]
                .slice_set(&k.squeeze(0).map_err(ce)?, 1, past)
                .map_err(ce)?;
            cache.v[l].slice_set(&v, 1, past).map_err(ce)?;
            let attn = if n == 1 {
                decode_attention(
                    &q,
                    &cache.k[l],
                    &cache.v[l],
                    c,
                    ctx,
                    cache.capacity,
                    scale as f32,
                )?
            } else {
                let k_all = cache.k[l].narrow(1, 0, ctx).map_err(ce)?;
                let v_all = cache.v[l].narrow(1, 0, ctx).map_err(ce)?;
                // Stack each group's query heads against their shared KV head.
                let qg = q
                    .reshape((c.kv_heads, groups * n, c.head_dim))
                    .map_err(ce)?;
                let mut scores = qg
                    .matmul(&k_all.t().map_err(ce)?)
                    .and_then(|s| s.flatten_all())
                    .and_then(|s| s.to_vec1::<f32>())
                    .map_err(ce)?;
                kernels::causal_softmax_rows(&mut scores, ctx, n, past, scale as f32);
                let probs =
                    Tensor::from_vec(scores, (c.kv_heads, groups * n, ctx), &dev).map_err(ce)?;
                probs
                    .matmul(&v_all)
                    .and_then(|a| a.reshape((c.heads, n, c.head_dim)))
                    .and_then(|t| t.transpose(0, 1))
                    .and_then(|t| t.reshape((n, c.hidden)))
                    .map_err(ce)?
            };
            x = (x + w.wo.forward(&attn)?).map_err(ce)?;
            let h = rms_norm(&x, &w.ffn_norm, c.eps)?;
            let gate = w.w_gate.forward(&h)?.silu().map_err(ce)?;
            let up = w.w_up.forward(&h)?;
            let ff = w.w_down.forward(&(gate * up).map_err(ce)?)?;
            x = (x + ff).map_err(ce)?;
        }
        cache.len = ctx;
        Ok(x)
    }
}

/// `t` (contiguous, its last dimension `head_dim`) with every vector rounded to `dtype`.
fn round_to(dtype: KvDtype, t: Tensor, head_dim: usize) -> Result<Tensor, EngineError> {
    if dtype == KvDtype::F32 {
        return Ok(t);
    }
    let shape = t.shape().clone();
    let mut data = t
        .flatten_all()
        .and_then(|f| f.to_vec1::<f32>())
        .map_err(ce)?;
    if data.len() >= 1 << 15 {
        data.par_chunks_mut(head_dim)
            .for_each(|v| dtype.round_trip(v));
    } else {
        data.chunks_mut(head_dim).for_each(|v| dtype.round_trip(v));
    }
    Tensor::from_vec(data, shape, &Device::Cpu).map_err(ce)
}

fn f32_data(t: &Tensor) -> Result<candle_core::StorageRef<'_>, EngineError> {
    let (st, layout) = t.storage_and_layout();
    if layout.start_offset() != 0 || !layout.is_contiguous() {
        return Err(EngineError::Internal(
            "kv cache is not a contiguous buffer".into(),
        ));
    }
    Ok(st)
}

fn as_f32(st: &candle_core::Storage) -> Result<&[f32], EngineError> {
    match st {
        candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) => Ok(v),
        _ => Err(EngineError::Internal(
            "kv cache is not f32 on the cpu".into(),
        )),
    }
}

/// Dot product with 8 independent lanes (vectorizes without reassociating a single sum).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    for (x, y) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        for i in 0..8 {
            lanes[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = lanes.iter().sum();
    for (x, y) in a
        .chunks_exact(8)
        .remainder()
        .iter()
        .zip(b.chunks_exact(8).remainder())
    {
        s += x * y;
    }
    s
}

/// Attention of one new token over the first `ctx` cached positions, read in place.
fn decode_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    c: &Config,
    ctx: usize,
    capacity: usize,
    scale: f32,
) -> Result<Tensor, EngineError> {
    let q = q
        .flatten_all()
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(ce)?; // heads × d
    let (kst, vst) = (f32_data(k)?, f32_data(v)?);
    let (kd, vd) = (as_f32(&kst)?, as_f32(&vst)?);
    let d = c.head_dim;
    let groups = c.heads / c.kv_heads;
    let mut out = vec![0f32; c.heads * d];
    let mut scores = vec![0f32; ctx];
    for h in 0..c.heads {
        let base = (h / groups) * capacity * d;
        let qh = &q[h * d..(h + 1) * d];
        let mut max = f32::NEG_INFINITY;
        for (j, s) in scores.iter_mut().enumerate() {
            *s = dot(qh, &kd[base + j * d..base + (j + 1) * d]) * scale;
            max = max.max(*s);
        }
        let mut sum = 0.0;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        let o = &mut out[h * d..(h + 1) * d];
        for (j, p) in scores.iter().enumerate() {
            let w = p / sum;
            let vj = &vd[base + j * d..base + (j + 1) * d];
            for (oi, vi) in o.iter_mut().zip(vj) {
                *oi += w * vi;
            }
        }
    }
    Tensor::from_vec(out, (1, c.hidden), &Device::Cpu).map_err(ce)
}

/// Index of the largest logit.
pub fn argmax(logits: &Tensor) -> Result<u32, EngineError> {
    logits
        .argmax(D::Minus1)
        .and_then(|t| t.to_scalar::<u32>())
        .map_err(ce)
}
