//! HTTP baselines: cache-hit requests against `/v1/messages` and a bare axum server that
//! answers like it, for side-by-side comparison.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::json;

pub(crate) fn check_loopback(url: &str) -> anyhow::Result<()> {
    let u = reqwest::Url::parse(url).context("parsing --url")?;
    match u.host_str() {
        Some("127.0.0.1" | "localhost" | "[::1]" | "::1") => Ok(()),
        other => bail!("load tests only target this machine (127.0.0.1, localhost); got {other:?}"),
    }
}

/// A prompt of about `tokens` sim tokens in a cached system block.
pub fn hit_body(model: &str, tokens: usize, max_tokens: u32) -> bytes::Bytes {
    let words: Vec<String> = (0..tokens.saturating_sub(16))
        .map(|i| format!("w{}", i % 997))
        .collect();
    let system = words.join(" ");
    let v = json!({
        "model": model,
        "max_tokens": max_tokens,
        "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": "Summarize the system prompt."}],
    });
    bytes::Bytes::from(v.to_string())
}

pub(crate) fn request(
    client: &reqwest::Client,
    url: &str,
    key: &str,
    body: &bytes::Bytes,
) -> reqwest::RequestBuilder {
    client
        .post(format!("{url}/v1/messages"))
        .header("x-api-key", key)
        .header("anthropic-version", "2023-06-01")
        .header("content-type", "application/json")
        .body(body.clone())
}

pub(crate) async fn warm_up(
    client: &reqwest::Client,
    url: &str,
    key: &str,
    body: &bytes::Bytes,
) -> anyhow::Result<()> {
    for _ in 0..2 {
        crate::client::text_of(request(client, url, key, body), "a warm-up request").await?;
    }
    Ok(())
}

pub(crate) struct Report {
    pub ok: u64,
    pub errors: u64,
    pub rps: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

pub(crate) async fn measure(
    client: &reqwest::Client,
    url: &str,
    key: &str,
    body: &bytes::Bytes,
    concurrency: usize,
    dur: Duration,
) -> anyhow::Result<Report> {
    let start = Instant::now();
    let deadline = start + dur;
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (client, url, key, body) = (
            client.clone(),
            url.to_string(),
            key.to_string(),
            body.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut errors = 0u64;
            while Instant::now() < deadline {
                let t = Instant::now();
                match request(&client, &url, &key, &body).send().await {
                    Ok(r) if r.status().is_success() => {
                        let _ = r.bytes().await;
                        lat.push(t.elapsed().as_micros() as u64);
                    }
                    Ok(r) => {
                        let _ = r.bytes().await;
                        errors += 1;
                    }
                    Err(_) => errors += 1,
                }
            }
            (lat, errors)
        }));
    }
    let mut all = Vec::new();
    let mut errors = 0;
    for t in tasks {
        let (l, e) = t.await?;
        all.extend(l);
        errors += e;
    }
    let elapsed = start.elapsed().as_secs_f64();
    all.sort_unstable();
    let pct = |p: f64| -> f64 {
        if all.is_empty() {
            0.0
        } else {
            all[((all.len() - 1) as f64 * p).round() as usize] as f64 / 1000.0
        }
    };
    Ok(Report {
        ok: all.len() as u64,
        errors,
        rps: all.len() as f64 / elapsed,
        p50_ms: pct(0.50),
        p99_ms: pct(0.99),
    })
}

pub(crate) async fn bare_server(listen: SocketAddr, dur: Duration) -> anyhow::Result<()> {
    use axum::routing::post;
    const BODY: &str = r#"{"id":"msg_0","type":"message","role":"assistant","model":"sim-tiny","content":[{"type":"text","text":"The cache is ready."}],"stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":5,"cache_creation_input_tokens":0,"cache_read_input_tokens":4080,"cache_creation":{"ephemeral_5m_input_tokens":0,"ephemeral_1h_input_tokens":0},"output_tokens":5,"service_tier":"standard"}}"#;
    let app = axum::Router::new().route(
        "/v1/messages",
        post(|_body: axum::body::Bytes| async { ([("content-type", "application/json")], BODY) }),
    );
    let listener = tokio::net::TcpListener::bind(listen).await?;
    eprintln!("bare server on {listen} for {}s", dur.as_secs());
    axum::serve(listener, app)
        .with_graceful_shutdown(tokio::time::sleep(dur))
        .await?;
    Ok(())
}
