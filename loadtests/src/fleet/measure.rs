//! `cachet loadtest profile`: measure an engine's cost profile on a real vLLM server (its
//! OpenAI-compatible `/v1/completions`, prompts as token ids), for the fleet simulator.
//!
//! - **Prefill**: prompts of several lengths, one token out, fresh random token ids each
//!   time (nothing in vLLM's prefix cache): time to first token, fitted to
//!   `c + n / rate + k × n² / 2000` ms (`c`: the fixed cost of an iteration and the request).
//! - **Decode**: batches of concurrent streams at two context lengths: the mean gap between
//!   tokens while all of them decode, fitted to `base + per_seq × batch + per_kctx × the
//!   batch's context in thousands` ms.
//! - **Interference**: two streams decoding while a long prompt arrives: their worst gap
//!   against what the fitted profile predicts for an iteration holding that prefill chunk.
//! - **Neighbours** (`--neighbour`, another instance on the same host): a mid-length prompt's
//!   TTFT and a batch's decode gap, alone and while the neighbour does the same kind of work
//!   (prefills; a batch decoding): how much longer each takes with it busy (the profile's
//!   `neighbour_*_slowdown`). Instances sharing a CPU host share its memory bandwidth,
//!   caches and spare cores; the fit measured with the neighbour idle does not see that.
//!
//! What cannot be measured through the API (the KV bytes per token, the load and link rates,
//! the chunk budget, the batch cap, the prefix cache's size) comes from flags and is named in
//! the profile's `source` as such.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use futures::StreamExt;

use super::profile::CostProfile;
use crate::trace::Rng;

#[derive(Args, Clone, Debug)]
pub struct ProfileArgs {
    /// The vLLM server (its OpenAI-compatible API).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub url: String,
    /// The model name it serves.
    #[arg(long)]
    pub model: String,
    /// The profile's name.
    #[arg(long)]
    pub name: String,
    /// What the engine is and runs on (its version, the model and dtype, the hardware),
    /// for the profile's `source`.
    #[arg(long, default_value = "")]
    pub note: String,
    /// Prompt lengths of the prefill measurements; repeat.
    #[arg(long = "prefill-tokens", default_values_t = vec![128u64, 512, 1024, 2048])]
    pub prefill_tokens: Vec<u64>,
    /// Decode batch sizes; repeat.
    #[arg(long = "batch", default_values_t = vec![1u32, 2, 4, 8])]
    pub batches: Vec<u32>,
    /// Context lengths of the decode measurements; repeat.
    #[arg(long = "context", default_values_t = vec![128u64, 1024])]
    pub contexts: Vec<u64>,
    /// Tokens each decode stream generates.
    #[arg(long, default_value_t = 32)]
    pub decode_tokens: u32,
    /// Measurements of each prefill length.
    #[arg(long, default_value_t = 2)]
    pub repeats: u32,
    /// Token ids are drawn from 1000..this (below the model's vocabulary).
    #[arg(long, default_value_t = 40_000)]
    pub vocab: u64,
    /// Not measurable through the API; named in the profile as given.
    #[arg(long)]
    pub kv_bytes_per_token: u64,
    #[arg(long)]
    pub load_bytes_per_sec: f64,
    #[arg(long)]
    pub transfer_bytes_per_sec: f64,
    #[arg(long, default_value_t = 2048)]
    pub chunk_tokens: u32,
    #[arg(long, default_value_t = 256)]
    pub max_batch: u32,
    #[arg(long)]
    pub engine_cache_tokens: u64,
    /// Another instance of the same engine and model on the same host: measure how much it
    /// slows this one while busy.
    #[arg(long)]
    pub neighbour: Option<String>,
    /// Prompts the neighbour prefills at once while this one's prefill is timed (each a
    /// mid-length prompt, one token out, again and again).
    #[arg(long, default_value_t = 4)]
    pub neighbour_streams: u32,
    /// Where the profile is written (JSON).
    #[arg(long)]
    pub out: std::path::PathBuf,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// One stream's timing: when it was sent, each token's arrival.
struct Timed {
    sent: Instant,
    tokens: Vec<Instant>,
}

impl Timed {
    fn ttft(&self) -> Option<Duration> {
        self.tokens.first().map(|t| *t - self.sent)
    }
}

async fn complete(
    http: &reqwest::Client,
    a: &ProfileArgs,
    prompt: Vec<u64>,
    max_tokens: u32,
) -> anyhow::Result<Timed> {
    complete_at(http, &a.url, &a.model, prompt, max_tokens).await
}

async fn complete_at(
    http: &reqwest::Client,
    url: &str,
    model: &str,
    prompt: Vec<u64>,
    max_tokens: u32,
) -> anyhow::Result<Timed> {
    let body = serde_json::json!({
        "model": model, "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0.0, "ignore_eos": true, "stream": true,
    });
    let sent = Instant::now();
    let resp = http
        .post(format!("{}/v1/completions", url.trim_end_matches('/')))
        .json(&body)
        .send()
        .await
        .with_context(|| format!("{url}: not reachable"))?;
    if !resp.status().is_success() {
        bail!(
            "{url} answered {}: {}",
            resp.status(),
            resp.text().await.unwrap_or_default()
        );
    }
    let mut out = Timed {
        sent,
        tokens: Vec::new(),
    };
    let mut stream = resp.bytes_stream();
    let mut buf = Vec::new();
    while let Some(chunk) = stream.next().await {
        buf.extend_from_slice(&chunk?);
        while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            let text = String::from_utf8_lossy(&event);
            for data in text.lines().filter_map(|l| l.strip_prefix("data:")) {
                let data = data.trim();
                if data == "[DONE]" || data.is_empty() {
                    continue;
                }
                let v: serde_json::Value = serde_json::from_str(data)
                    .with_context(|| format!("an unreadable event: {data}"))?;
                if v["choices"].get(0).is_some() {
                    out.tokens.push(Instant::now());
                }
            }
        }
    }
    Ok(out)
}

fn prompt(rng: &mut Rng, n: u64, vocab: u64) -> Vec<u64> {
    (0..n)
        .map(|_| rng.range(1000, vocab.max(1001) - 1))
        .collect()
}

/// The mean gap between tokens, ms, while `b` streams with `ctx`-token prompts all decode.
async fn decode_gap(
    http: &reqwest::Client,
    a: &ProfileArgs,
    rng: &mut Rng,
    b: u32,
    ctx: u64,
) -> anyhow::Result<f64> {
    let streams = futures::future::try_join_all((0..b).map(|_| {
        let p = prompt(rng, ctx, a.vocab);
        complete(http, a, p, a.decode_tokens)
    }))
    .await?;
    // While every stream decodes: from the last first token to the first last token.
    let from = streams
        .iter()
        .filter_map(|s| s.tokens.first())
        .max()
        .copied();
    let to = streams
        .iter()
        .filter_map(|s| s.tokens.last())
        .min()
        .copied();
    let (Some(from), Some(to)) = (from, to) else {
        bail!("decode: a stream returned no token");
    };
    let gaps: Vec<f64> = streams
        .iter()
        .flat_map(|s| {
            s.tokens
                .windows(2)
                .filter(|w| w[0] >= from && w[1] <= to)
                .map(|w| (w[1] - w[0]).as_secs_f64() * 1e3)
                .collect::<Vec<_>>()
        })
        .collect();
    if gaps.is_empty() {
        bail!("decode: batch {b} never decoded together; raise --decode-tokens");
    }
    Ok(gaps.iter().sum::<f64>() / gaps.len() as f64)
}

/// A lone prompt's TTFT, ms.
async fn prefill_ms(
    http: &reqwest::Client,
    a: &ProfileArgs,
    rng: &mut Rng,
    n: u64,
) -> anyhow::Result<f64> {
    let t = complete(http, a, prompt(rng, n, a.vocab), 1).await?;
    Ok(t.ttft().context("no token came back")?.as_secs_f64() * 1e3)
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

/// The neighbour kept busy: `streams` tasks each sending a prompt of `prompt_len` fresh tokens
/// for `out` tokens, again and again, until [`Busy::stop`].
struct Busy {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl Busy {
    fn start(
        http: &reqwest::Client,
        a: &ProfileArgs,
        url: &str,
        streams: u32,
        prompt_len: u64,
        out: u32,
        seed: u64,
    ) -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let tasks = (0..streams.max(1))
            .map(|k| {
                let (http, url, model, stop) =
                    (http.clone(), url.to_string(), a.model.clone(), stop.clone());
                let vocab = a.vocab;
                let mut rng = Rng::new(seed.wrapping_add(u64::from(k)));
                tokio::spawn(async move {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let p = prompt(&mut rng, prompt_len, vocab);
                        complete_at(&http, &url, &model, p, out).await?;
                    }
                    anyhow::Ok(())
                })
            })
            .collect();
        Busy { stop, tasks }
    }

    /// Lets each stream finish the request it is on.
    async fn stop(self) -> anyhow::Result<()> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for task in self.tasks {
            task.await.context("a neighbour stream panicked")??;
        }
        Ok(())
    }
}

/// How much longer a prefill of `n` tokens and a lone decode step take on this
/// instance while the instance at `neighbour` does the same kind of work: `(prefill, step)`
/// as fractions (at least 0). Like beside like: the prefill beside `a.neighbour_streams`
/// streams of `n`-token prompts; a lone decode step, which is nearly all the iteration's
/// fixed part (reading the weights), beside one stream decoding. A batch's own work (its
/// sequences' arithmetic and KV reads) is not stretched: measured beside a batch of 8, the
/// whole step read +96% where the fleet check's loads wanted about +30% on the fixed part
/// and nothing on the rest (docs/benchmarks.md). The medians of `max(repeats, 3)`
/// measurements alone and busy, taken alone, busy, alone, busy (so a machine drifting over
/// the minute does not read as the neighbour).
async fn neighbour_slowdown(
    http: &reqwest::Client,
    a: &ProfileArgs,
    rng: &mut Rng,
    neighbour: &str,
    n: u64,
) -> anyhow::Result<(f64, f64)> {
    const CTX: u64 = 128;
    // One sequence decoding: the step is nearly all the iteration's fixed part.
    let b = 1;
    let (mut alone, mut busy) = ((Vec::new(), Vec::new()), (Vec::new(), Vec::new()));
    let rounds = a.repeats.max(3);
    for round in 0..u64::from(rounds) * 2 {
        let seed = a.seed ^ (0x6e65_6967 + 1000 * round);
        if round % 2 == 0 {
            alone.0.push(prefill_ms(http, a, rng, n).await?);
            alone.1.push(decode_gap(http, a, rng, b, CTX).await?);
            continue;
        }
        // Time for the neighbour's streams to get going (their prompts prefilled).
        let settle = |tokens: u64| {
            Duration::from_secs_f64(
                1.5 * median(alone.0.clone()) / 1e3 * (tokens as f64 / n as f64).max(1.0),
            )
        };
        let load = Busy::start(http, a, neighbour, a.neighbour_streams, n, 1, seed);
        tokio::time::sleep(settle(n)).await;
        busy.0.push(prefill_ms(http, a, rng, n).await?);
        load.stop().await?;
        let load = Busy::start(http, a, neighbour, b, CTX, a.decode_tokens * 4, seed + 500);
        tokio::time::sleep(settle(u64::from(b) * CTX)).await;
        busy.1.push(decode_gap(http, a, rng, b, CTX).await?);
        load.stop().await?;
    }
    let prefill = median(busy.0) / median(alone.0) - 1.0;
    let step = median(busy.1) / median(alone.1) - 1.0;
    Ok((prefill.max(0.0), step.max(0.0)))
}

/// Least squares for `y = Σ x_j × c_j` (`N` unknowns), by the normal equations.
fn fit<const N: usize>(rows: &[([f64; N], f64)]) -> Option<[f64; N]> {
    let mut m = [[0.0f64; N]; N];
    let mut v = [0.0f64; N];
    for (x, y) in rows {
        for i in 0..N {
            for j in 0..N {
                m[i][j] += x[i] * x[j];
            }
            v[i] += x[i] * y;
        }
    }
    // Gaussian elimination with partial pivoting.
    for col in 0..N {
        let pivot = (col..N).max_by(|&a, &b| m[a][col].abs().total_cmp(&m[b][col].abs()))?;
        if m[pivot][col].abs() < 1e-12 {
            return None;
        }
        m.swap(col, pivot);
        v.swap(col, pivot);
        let (pivot_row, pivot_v) = (m[col], v[col]);
        for r in 0..N {
            if r != col {
                let f = m[r][col] / pivot_row[col];
                for (x, p) in m[r].iter_mut().zip(pivot_row).skip(col) {
                    *x -= f * p;
                }
                v[r] -= f * pivot_v;
            }
        }
    }
    Some(std::array::from_fn(|i| v[i] / m[i][i]))
}

/// The prefill line from lone prompts' TTFTs (`rows`: `[1, n, n²/2000]` against ms), given
/// an iteration's fixed cost: `step_base + overhead + n × per_token + n²/2000 × kctx`, with
/// the overhead (the server's own time per request) at least zero. Returns `(overhead,
/// per_token, kctx)` in ms.
fn prefill_line(rows: &[([f64; 3], f64)], step_base: f64) -> Option<(f64, f64, f64)> {
    let [c0, per_token, kctx] = fit(rows)?;
    if c0 >= step_base && kctx >= 0.0 {
        return Some((c0 - step_base, per_token, kctx));
    }
    // The free fit puts less than one iteration before the first token (or bends the
    // wrong way): fix the intercept at the iteration's cost and fit the rest.
    let shifted: Vec<([f64; 2], f64)> = rows
        .iter()
        .map(|(x, y)| ([x[1], x[2]], y - step_base))
        .collect();
    let [per_token, kctx] = fit(&shifted)?;
    if kctx >= 0.0 {
        return Some((0.0, per_token, kctx));
    }
    let linear: Vec<([f64; 1], f64)> = rows.iter().map(|(x, y)| ([x[1]], y - step_base)).collect();
    let [per_token] = fit(&linear)?;
    Some((0.0, per_token, 0.0))
}

pub async fn run(a: &ProfileArgs) -> anyhow::Result<()> {
    let http = reqwest::Client::new();
    let mut rng = Rng::new(a.seed);
    // A warm-up: the first request pays for compilation and allocation.
    complete(&http, a, prompt(&mut rng, 64, a.vocab), 4).await?;

    println!("prefill (one token out):\n| prompt tokens | TTFT ms |\n|---:|---:|");
    let mut rows = Vec::new();
    for &n in &a.prefill_tokens {
        for _ in 0..a.repeats.max(1) {
            let ms = prefill_ms(&http, a, &mut rng, n).await?;
            println!("| {n} | {ms:.1} |");
            let nf = n as f64;
            rows.push(([1.0, nf, nf * nf / 2000.0], ms));
        }
    }
    let prefill_rows = rows;

    println!(
        "decode ({} tokens a stream, all streams at once):\n| batch | context | mean gap ms |\n|---:|---:|---:|",
        a.decode_tokens
    );
    let mut rows = Vec::new();
    for &ctx in &a.contexts {
        for &b in &a.batches {
            let mean = decode_gap(&http, a, &mut rng, b, ctx).await?;
            println!("| {b} | {ctx} | {mean:.2} |");
            let batch_ctx = f64::from(b) * (ctx as f64 + f64::from(a.decode_tokens) / 2.0);
            rows.push(([1.0, f64::from(b), batch_ctx / 1e3], mean));
        }
    }
    let [base, per_seq, per_kctx] =
        fit(&rows).context("decode: give at least two batch sizes and two contexts")?;
    let (base, per_seq, per_kctx) = (base.max(0.0), per_seq.max(0.0), per_kctx.max(0.0));
    println!(
        "fit: {base:.2} ms + {per_seq:.3} ms a sequence + {per_kctx:.4} ms per thousand context tokens\n"
    );
    let (overhead, per_token_ms, kctx) =
        prefill_line(&prefill_rows, base).context("prefill: give at least three lengths")?;
    let per_token_ms = per_token_ms.max(1e-6);
    println!(
        "prefill fit: {overhead:.1} ms outside the engine + one iteration ({base:.1} ms) + n × \
         {per_token_ms:.4} ms + n²/2000 × {kctx:.5} ms ({:.0} tokens/s)\n",
        1e3 / per_token_ms
    );

    let (neighbour_prefill, neighbour_step, neighbour_note) = match &a.neighbour {
        None => (0.0, 0.0, "no neighbour measured".to_string()),
        Some(url) => {
            let mut sizes = a.prefill_tokens.clone();
            sizes.sort_unstable();
            let n = sizes[sizes.len() / 2];
            let (p, s) = neighbour_slowdown(&http, a, &mut rng, url, n).await?;
            println!(
                "neighbour ({url}; {} streams of {n}-token prompts, then one decoding): a \
                 {n}-token prefill beside them {:+.0}%, a lone decode step (the iteration's \
                 fixed part) {:+.0}%\n",
                a.neighbour_streams,
                p * 1e2,
                s * 1e2
            );
            (
                p,
                s,
                format!(
                    "with a neighbour on the host doing the same ({} streams of {n}-token \
                     prompts; one stream decoding), a {n}-token prefill took {:.0}% longer and \
                     a lone decode step {:.0}%",
                    a.neighbour_streams,
                    p * 1e2,
                    s * 1e2
                ),
            )
        }
    };

    let profile = CostProfile {
        name: a.name.clone(),
        source: format!(
            "Measured by `cachet loadtest profile` against {} ({}{}) on {}: prefill at {:?} tokens \
             ({} each; fitted {:.0} tokens/s, {:.5} ms per token per thousand before it, {:.1} ms \
             a request outside the engine), decode of {} tokens at batches {:?} and contexts {:?}; {}. Given, not measured: \
             {} bytes of KV a token, loads at {:.2e} B/s, the link at {:.2e} B/s, chunks of {} \
             tokens, batches up to {}, {} tokens of prefix cache.",
            a.url,
            a.model,
            if a.note.is_empty() {
                String::new()
            } else {
                format!("; {}", a.note)
            },
            chrono::Utc::now().format("%Y-%m-%d"),
            a.prefill_tokens,
            a.repeats,
            1e3 / per_token_ms,
            kctx,
            overhead,
            a.decode_tokens,
            a.batches,
            a.contexts,
            neighbour_note,
            a.kv_bytes_per_token,
            a.load_bytes_per_sec,
            a.transfer_bytes_per_sec,
            a.chunk_tokens,
            a.max_batch,
            a.engine_cache_tokens
        ),
        prefill_tokens_per_sec: 1e3 / per_token_ms,
        prefill_per_kctx_ms: kctx,
        step_base_ms: base,
        request_overhead_ms: overhead,
        step_per_seq_ms: per_seq,
        step_per_kctx_ms: per_kctx,
        chunk_tokens: a.chunk_tokens,
        max_batch: a.max_batch,
        kv_bytes_per_token: a.kv_bytes_per_token,
        load_bytes_per_sec: a.load_bytes_per_sec,
        transfer_bytes_per_sec: a.transfer_bytes_per_sec,
        engine_cache_tokens: a.engine_cache_tokens,
        neighbour_prefill_slowdown: neighbour_prefill,
        neighbour_step_slowdown: neighbour_step,
    };

    // Interference: two streams decoding, then a long prompt: their worst gap against the
    // profile's iteration with that prefill chunk beside them.
    let long = *a.prefill_tokens.iter().max().unwrap_or(&1024);
    let (d1, d2) = (
        prompt(&mut rng, 128, a.vocab),
        prompt(&mut rng, 128, a.vocab),
    );
    let decoders = futures::future::try_join(
        complete(&http, a, d1, a.decode_tokens * 4),
        complete(&http, a, d2, a.decode_tokens * 4),
    );
    let intruder = async {
        tokio::time::sleep(Duration::from_millis(
            (3.0 * (base + 2.0 * per_seq).max(1.0)) as u64 * 4,
        ))
        .await;
        complete(&http, a, prompt(&mut rng, long, a.vocab), 1).await
    };
    let ((s1, s2), _) = tokio::try_join!(decoders, intruder)?;
    let worst = [s1, s2]
        .iter()
        .flat_map(|s| s.tokens.windows(2).map(|w| w[1] - w[0]).collect::<Vec<_>>())
        .max()
        .unwrap_or_default();
    let chunk = long.min(u64::from(a.chunk_tokens));
    let predicted = profile.step_secs(2, 256) + profile.prefill_secs(0, chunk);
    println!(
        "interference: two streams decoding beside a {long}-token prompt: worst gap {:.0} ms, \
         the profile's iteration with a {chunk}-token chunk {:.0} ms",
        worst.as_secs_f64() * 1e3,
        predicted * 1e3
    );

    let mut json = serde_json::to_vec_pretty(&profile)?;
    json.push(b'\n');
    std::fs::write(&a.out, json).with_context(|| a.out.display().to_string())?;
    println!("profile written to {}", a.out.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fit_recovers_a_known_line() {
        // y = 5 + 2 x + 0.5 z, exactly.
        let rows: Vec<([f64; 3], f64)> = [(1.0, 0.0), (2.0, 1.0), (4.0, 3.0), (8.0, 2.0)]
            .iter()
            .map(|&(x, z)| ([1.0, x, z], 5.0 + 2.0 * x + 0.5 * z))
            .collect();
        let c = fit(&rows).unwrap();
        for (got, want) in c.iter().zip([5.0, 2.0, 0.5]) {
            assert!((got - want).abs() < 1e-9, "{c:?}");
        }
        // Two points cannot fix three unknowns.
        assert!(fit(&rows[..1]).is_none());
    }

    #[test]
    fn the_median_is_the_middle_or_the_mean_of_the_two_middles() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(Vec::new()).is_nan());
    }

    fn lone_prompts(overhead: f64, per_token: f64, kctx: f64, step: f64) -> Vec<([f64; 3], f64)> {
        [128.0, 512.0, 1024.0, 2048.0]
            .iter()
            .map(|&n| {
                let q = n * n / 2000.0;
                ([1.0, n, q], step + overhead + per_token * n + kctx * q)
            })
            .collect()
    }

    #[test]
    fn the_prefill_line_keeps_an_iteration_before_the_first_token() {
        // A server spending 30 ms a request outside the engine: recovered.
        let (o, t, k) = prefill_line(&lone_prompts(30.0, 2.5, 0.4, 60.0), 60.0).unwrap();
        assert!((o - 30.0).abs() < 1e-6 && (t - 2.5).abs() < 1e-9 && (k - 0.4).abs() < 1e-9);
        // Prompts that bend so that a free fit starts below zero (a steeper middle, as on a
        // CPU whose caches a longer prompt outgrows): the intercept is held at one
        // iteration, never below, and the slope stays that of the prompts measured.
        let mut rows = lone_prompts(0.0, 2.5, 0.4, 60.0);
        rows[0].1 -= 80.0;
        rows[1].1 -= 120.0;
        let [c0, ..] = fit(&rows).unwrap();
        assert!(c0 < 60.0, "{c0}");
        let (o, t, k) = prefill_line(&rows, 60.0).unwrap();
        assert_eq!(o, 0.0);
        assert!(t > 2.0 && t < 2.6 && k >= 0.0, "{t} {k}");
        for (x, y) in &rows {
            let predicted = 60.0 + t * x[1] + k * x[2];
            assert!(
                (predicted - y).abs() / y < 0.25,
                "{} tokens: {predicted} against {y}",
                x[1]
            );
        }
    }
}
