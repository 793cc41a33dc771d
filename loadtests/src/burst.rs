//! `cachet loadtest burst`: N identical cold requests at once (an agent fanning out, a batch
//! starting), streamed: how many wrote and read the cache, the engine's prefill time for the
//! burst (from the server's `/metrics`), and TTFT percentiles. Run it against a server with
//! in-flight coalescing on and off (`CACHET_COALESCE=false`) for the comparison.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures::future::join_all;
use serde_json::json;

use crate::client::{Api, BodyOptions, Breakpoints, send};
use crate::trace::Shape;

#[derive(Debug, clap::Args)]
pub struct BurstArgs {
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub url: String,
    #[arg(long, env = "CACHET_API_KEY")]
    pub api_key: String,
    #[arg(long, default_value = "smollm2-135m-instruct")]
    pub model: String,
    #[arg(long, default_value_t = 16)]
    pub requests: usize,
    /// Approximate prompt length in tokens.
    #[arg(long, default_value_t = 4096)]
    pub prompt_tokens: u64,
    #[arg(long, default_value_t = 8)]
    pub max_tokens: u64,
    /// Bursts, each with a new prompt.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Bearer token for /metrics (CACHET_METRICS_TOKEN), when the server has one.
    #[arg(long, env = "CACHET_METRICS_TOKEN")]
    pub metrics_token: Option<String>,
}

/// The server's total prefill seconds for `model` (`cachet_gateway_prefill_seconds_total`).
async fn prefill_seconds(
    client: &reqwest::Client,
    url: &str,
    token: Option<&str>,
    model: &str,
) -> anyhow::Result<f64> {
    let mut req = client.get(format!("{url}/metrics"));
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let text = req.send().await?.error_for_status()?.text().await?;
    Ok(text
        .lines()
        .filter(|l| {
            l.starts_with("cachet_gateway_prefill_seconds_total")
                && l.contains(&format!("model=\"{model}\""))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum())
}

pub async fn run(a: BurstArgs) -> anyhow::Result<()> {
    crate::http::check_loopback(&a.url)?;
    if a.requests == 0 || a.prompt_tokens == 0 || a.rounds == 0 {
        bail!("--requests, --prompt-tokens and --rounds must be positive");
    }
    let url = a.url.trim_end_matches('/').to_string();
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(a.requests)
        .timeout(Duration::from_secs(600))
        .build()?;
    let opts = BodyOptions {
        model: a.model.clone(),
        api: Api::Anthropic,
        breakpoints: Breakpoints::Auto,
        max_output_tokens: Some(a.max_tokens),
        ignore_eos: false,
        shape: Shape {
            block_tokens: 512,
            trace_block_tokens: 512,
            system_blocks: 1,
            tenants: 1,
        },
    };
    println!(
        "round\trequests\twriters\treaders\tprefill_s\twall_s\tttft_p50_ms\tttft_p99_ms\tttft_max_ms"
    );
    for round in 0..a.rounds {
        // A prompt no earlier round (or run) has sent: cold for the whole burst.
        let mut system = format!("burst {} round {round}.", uuid::Uuid::new_v4().simple());
        crate::text::push_block(&mut system, rand_id(), a.prompt_tokens.saturating_sub(16));
        let body = serde_json::to_vec(&json!({
            "model": a.model,
            "max_tokens": a.max_tokens,
            "stream": true,
            "cache_control": {"type": "ephemeral"},
            "system": [{"type": "text", "text": system}],
            "messages": [{"role": "user", "content": "Summarize the system prompt."}],
        }))?;
        let before = prefill_seconds(&client, &url, a.metrics_token.as_deref(), &a.model)
            .await
            .context("reading /metrics (give --metrics-token if the server has one)")?;
        let started = Instant::now();
        let outcomes =
            join_all((0..a.requests).map(|_| send(&client, &url, &a.api_key, &opts, body.clone())))
                .await;
        let wall = started.elapsed().as_secs_f64();
        // The prefill counter moves when each prefill ends; all have ended with the answers.
        let after = prefill_seconds(&client, &url, a.metrics_token.as_deref(), &a.model).await?;
        if let Some(e) = outcomes.iter().find_map(|o| o.error.as_ref()) {
            bail!("a request failed: {e}");
        }
        let writers = outcomes
            .iter()
            .filter(|o| o.usage.cache_write_5m_tokens + o.usage.cache_write_1h_tokens > 0)
            .count();
        let readers = outcomes
            .iter()
            .filter(|o| o.usage.cache_read_tokens > 0)
            .count();
        let mut ttft: Vec<f64> = outcomes.iter().filter_map(|o| o.ttft_ms).collect();
        ttft.sort_by(f64::total_cmp);
        let at = |q: f64| ttft[((ttft.len() - 1) as f64 * q).round() as usize];
        println!(
            "{round}\t{}\t{writers}\t{readers}\t{:.2}\t{wall:.2}\t{:.0}\t{:.0}\t{:.0}",
            a.requests,
            after - before,
            at(0.5),
            at(0.99),
            ttft[ttft.len() - 1]
        );
    }
    Ok(())
}

fn rand_id() -> u64 {
    uuid::Uuid::new_v4().as_u64_pair().0
}
