//! The Messages API end to end against the real service, Postgres and Redis.

mod common;

use common::*;
use futures::StreamExt;
use serde_json::{Value, json};
use std::time::Duration;

#[tokio::test]
async fn second_identical_request_reads_what_the_first_wrote_and_tenants_are_isolated() {
    let app = TestApp::start().await;
    let body = cached_body(300, "What is in the system prompt?", 16);
    let (s1, h1, r1) = app.post("/v1/messages", &app.key, &body).await;
    assert_eq!(s1, 200, "{r1}");
    assert!(
        h1.get("request-id")
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("req_")
    );
    let u1 = &r1["usage"];
    assert_eq!(u1["cache_read_input_tokens"], 0);
    assert!(u1["cache_creation_input_tokens"].as_u64().unwrap() >= 300);
    assert_eq!(
        u1["cache_creation"]["ephemeral_5m_input_tokens"],
        u1["cache_creation_input_tokens"]
    );
    assert_eq!(r1["cachet"]["breakpoints"][0]["status"], "written");
    assert_eq!(r1["cachet"]["breakpoints"][0]["reason"], "not_cached");

    let (_, _, r2) = app.post("/v1/messages", &app.key, &body).await;
    let u2 = &r2["usage"];
    assert_eq!(
        u2["cache_read_input_tokens"],
        u1["cache_creation_input_tokens"]
    );
    assert_eq!(u2["cache_creation_input_tokens"], 0);
    assert_eq!(usage_total(u1), usage_total(u2));
    assert_eq!(
        usage_total(u1),
        r1["cachet"]["prompt_tokens"].as_u64().unwrap()
    );
    assert_eq!(
        r1["content"], r2["content"],
        "a cached prefix never changes the answer"
    );

    // Another tenant, same prompt: nothing to read.
    let other = app.new_tenant_key().await;
    let (_, _, r3) = app.post("/v1/messages", &other, &body).await;
    assert_eq!(r3["usage"]["cache_read_input_tokens"], 0);
    assert!(r3["usage"]["cache_creation_input_tokens"].as_u64().unwrap() > 0);

    app.settle().await;
    assert_eq!(app.ledger_count().await, 3);
    app.stop().await;
}

#[tokio::test]
async fn mixed_ttls_split_writes_and_a_moved_marker_still_hits() {
    let app = TestApp::start().await;
    let tools = json!([{"name": "lookup", "description": (0..80).map(|i| format!("d{i} ")).collect::<String>(), "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]);
    let system: String = (0..120).map(|i| format!("s{i} ")).collect();
    let body = json!({
        "model": "sim-tiny", "max_tokens": 8, "tools": tools,
        "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "first question here", "cache_control": {"type": "ephemeral"}}]}]
    });
    let (s, _, r) = app.post("/v1/messages", &app.key, &body).await;
    assert_eq!(s, 200, "{r}");
    let u = &r["usage"];
    let bps = r["cachet"]["breakpoints"].as_array().unwrap();
    assert_eq!(bps.len(), 3);
    let o: Vec<u64> = bps
        .iter()
        .map(|b| b["token_offset"].as_u64().unwrap())
        .collect();
    assert_eq!(
        u["cache_creation"]["ephemeral_1h_input_tokens"]
            .as_u64()
            .unwrap(),
        o[0]
    );
    assert_eq!(
        u["cache_creation"]["ephemeral_5m_input_tokens"]
            .as_u64()
            .unwrap(),
        o[2] - o[0]
    );
    assert_eq!(
        u["input_tokens"].as_u64().unwrap(),
        r["cachet"]["prompt_tokens"].as_u64().unwrap() - o[2]
    );

    // Next turn: the marker moves to the new last message; the earlier prefix is read.
    let body2 = json!({
        "model": "sim-tiny", "max_tokens": 8, "tools": tools,
        "system": [{"type": "text", "text": system}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "first question here"}]},
            {"role": "assistant", "content": "an answer"},
            {"role": "user", "content": [{"type": "text", "text": "second question", "cache_control": {"type": "ephemeral"}}]}
        ]
    });
    let (_, _, r2) = app.post("/v1/messages", &app.key, &body2).await;
    let u2 = &r2["usage"];
    assert_eq!(
        u2["cache_read_input_tokens"].as_u64().unwrap(),
        o[2],
        "read up to the old marker: {r2}"
    );
    assert!(u2["cache_creation_input_tokens"].as_u64().unwrap() > 0);
    app.stop().await;
}

#[tokio::test]
async fn automatic_caching_and_below_minimum() {
    let app = TestApp::start().await;
    let mut body = cached_body(
        0,
        &(0..200).map(|i| format!("u{i} ")).collect::<String>(),
        8,
    );
    body.as_object_mut().unwrap().remove("system");
    body["cache_control"] = json!({"type": "ephemeral"});
    let (_, _, r1) = app.post("/v1/messages", &app.key, &body).await;
    assert_eq!(r1["cachet"]["breakpoints"][0]["automatic"], true);
    assert_eq!(
        r1["cachet"]["breakpoints"][0]["location"],
        "messages.0.content.0"
    );
    let (_, _, r2) = app.post("/v1/messages", &app.key, &body).await;
    assert!(r2["usage"]["cache_read_input_tokens"].as_u64().unwrap() >= 200);

    // Below the minimum (32 tokens for sim-tiny): no error, nothing cached.
    let short = cached_body(3, "hi", 8);
    for _ in 0..2 {
        let (s, _, r) = app.post("/v1/messages", &app.key, &short).await;
        assert_eq!(s, 200);
        assert_eq!(r["usage"]["cache_creation_input_tokens"], 0);
        assert_eq!(r["usage"]["cache_read_input_tokens"], 0);
        assert_eq!(r["cachet"]["breakpoints"][0]["status"], "below_minimum");
    }
    app.stop().await;
}

#[tokio::test]
async fn streaming_reports_the_same_usage_in_message_start_and_message_delta() {
    let app = TestApp::start().await;
    let mut body = cached_body(200, "stream please", 12);
    app.post("/v1/messages", &app.key, &body).await;
    body["stream"] = json!(true);
    let resp = app
        .post_raw("/v1/messages", &app.key, body.to_string())
        .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let text = resp.text().await.unwrap();
    let events: Vec<(String, Value)> = text
        .split("\n\n")
        .filter(|c| !c.trim().is_empty())
        .map(|chunk| {
            let name = chunk
                .lines()
                .find_map(|l| l.strip_prefix("event: "))
                .unwrap()
                .to_string();
            let data = chunk
                .lines()
                .find_map(|l| l.strip_prefix("data: "))
                .unwrap();
            (name, serde_json::from_str(data).unwrap())
        })
        .collect();
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        &names[..3],
        &["message_start", "content_block_start", "ping"]
    );
    assert_eq!(
        &names[names.len() - 3..],
        &["content_block_stop", "message_delta", "message_stop"]
    );
    assert!(
        names[3..names.len() - 3]
            .iter()
            .all(|n| *n == "content_block_delta")
    );
    let start = &events[0].1["message"]["usage"];
    let delta = &events[names.len() - 2].1["usage"];
    for k in [
        "input_tokens",
        "cache_creation_input_tokens",
        "cache_read_input_tokens",
    ] {
        assert_eq!(start[k], delta[k], "{k}");
    }
    assert!(start["cache_read_input_tokens"].as_u64().unwrap() >= 200);
    let n_deltas = names
        .iter()
        .filter(|n| **n == "content_block_delta")
        .count() as u64;
    assert!(delta["output_tokens"].as_u64().unwrap() >= n_deltas);
    app.stop().await;
}

#[tokio::test]
async fn a_client_that_disconnects_mid_stream_is_still_metered() {
    // Real decode delays (sim-llama-8b: 12 ms a token) so the disconnect lands mid-stream.
    let app = TestApp::start_with(Options {
        sim_time_scale: 1.0,
        ..Default::default()
    })
    .await;
    let mut body = cached_body(10, "tell me a long story", 4000);
    body["model"] = json!("sim-llama-8b");
    body["stream"] = json!(true);
    let resp = app
        .post_raw("/v1/messages", &app.key, body.to_string())
        .await;
    let rid = resp.headers()["request-id"].to_str().unwrap().to_string();
    let mut stream = resp.bytes_stream();
    let mut seen = String::new();
    while let Some(chunk) = stream.next().await {
        seen.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
        if seen.contains("content_block_delta") {
            break;
        }
    }
    drop(stream);
    // The pipeline notices at its next write and meters what was produced.
    let pool = sqlx::PgPool::connect(&app.db_url).await.unwrap();
    let id: uuid::Uuid = rid.trim_start_matches("req_").parse().unwrap();
    let mut row: Option<(String, i64)> = None;
    for _ in 0..100 {
        row =
            sqlx::query_as("SELECT status, output_tokens FROM usage_events WHERE request_id = $1")
                .bind(id)
                .fetch_optional(&pool)
                .await
                .unwrap();
        if row.is_some() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let (status, output) = row.expect("a ledger row for the disconnected request");
    assert_eq!(status, "client_disconnected");
    assert!(output >= 1);
    pool.close().await;
    app.stop().await;
}

#[tokio::test]
async fn errors_use_anthropic_shapes_and_codes() {
    let app = TestApp::start().await;
    let body = cached_body(10, "hi", 8);
    // No key.
    let r = app
        .client
        .post(format!("{}/v1/messages", app.url))
        .header("anthropic-version", "2023-06-01")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let rid = r.headers()["request-id"].to_str().unwrap().to_string();
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "authentication_error");
    assert_eq!(v["error"]["message"], "x-api-key header is required");
    assert_eq!(v["request_id"], rid);
    // Wrong key.
    let (s, _, v) = app.post("/v1/messages", "sk-cachet-nope", &body).await;
    assert_eq!(
        (s, v["error"]["message"].as_str()),
        (401, Some("invalid x-api-key"))
    );
    // Bearer works like x-api-key.
    let r = app
        .client
        .post(format!("{}/v1/messages", app.url))
        .bearer_auth(&app.key)
        .header("anthropic-version", "2026-10-21")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // Missing version header.
    let r = app
        .client
        .post(format!("{}/v1/messages", app.url))
        .header("x-api-key", &app.key)
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(
        r.json::<Value>().await.unwrap()["error"]["message"],
        "anthropic-version: header is required"
    );
    // Bad JSON, bad field.
    let r = app.post_raw("/v1/messages", &app.key, "{oops").await;
    assert_eq!(r.status(), 400);
    let (s, _, v) = app.post("/v1/messages", &app.key, &json!({"model": "sim-tiny", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {"type": "forever"}}]}]})).await;
    assert_eq!(s, 400);
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert_eq!(
        v["error"]["message"],
        "messages.0.content.0.cache_control.type: Input should be 'ephemeral'"
    );
    // Over 32 MB.
    let huge = format!(
        "{{\"model\":\"sim-tiny\",\"pad\":\"{}\"}}",
        "x".repeat(33 * 1024 * 1024)
    );
    let r = app.post_raw("/v1/messages", &app.key, huge).await;
    assert_eq!(r.status(), 413);
    assert_eq!(
        r.json::<Value>().await.unwrap()["error"]["type"],
        "request_too_large"
    );
    // Unknown route.
    let r = app
        .client
        .get(format!("{}/v1/nothing", app.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(
        r.json::<Value>().await.unwrap()["error"]["type"],
        "not_found_error"
    );
    app.settle().await;
    assert_eq!(
        app.ledger_count().await,
        1,
        "only the served request is in the ledger"
    );
    app.stop().await;
}

#[tokio::test]
async fn count_tokens_models_and_health() {
    let app = TestApp::start().await;
    let body = cached_body(100, "count me", 8);
    let (_, _, served) = app.post("/v1/messages", &app.key, &body).await;
    let mut count_body = body.clone();
    count_body.as_object_mut().unwrap().remove("max_tokens");
    let (s, _, c) = app
        .post("/v1/messages/count_tokens", &app.key, &count_body)
        .await;
    assert_eq!(s, 200, "{c}");
    assert_eq!(
        c["input_tokens"].as_u64().unwrap(),
        usage_total(&served["usage"])
    );

    let r = app
        .client
        .get(format!("{}/v1/models", app.url))
        .header("x-api-key", &app.key)
        .send()
        .await
        .unwrap();
    let m: Value = r.json().await.unwrap();
    let ids: Vec<&str> = m["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec!["sim-tiny", "sim-llama-8b", "sim-llama-70b"]);
    let r = app
        .client
        .get(format!("{}/v1/models/nope", app.url))
        .header("x-api-key", &app.key)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);

    for path in ["/healthz", "/readyz"] {
        let r = app
            .client
            .get(format!("{}{path}", app.url))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    // The meter's counters move when the usage row is in Postgres, after the answer.
    app.settle().await;
    let metrics = app.metrics().await;
    for name in [
        "cachet_fabric_block_reads_total",
        "cachet_fabric_tenant_resident_bytes",
        "cachet_gateway_http_requests_total",
        "cachet_billing_meter_events_total",
    ] {
        assert!(metrics.contains(name), "{name} missing from /metrics");
    }
    let spec: Value = common::get_json(&app.client, format!("{}/openapi.json", app.url)).await;
    assert!(spec["paths"]["/v1/messages"]["post"].is_object());
    app.stop().await;
}

#[tokio::test]
async fn pre_warm_with_max_tokens_zero_writes_the_cache_and_returns_no_content() {
    let app = TestApp::start().await;
    let body = cached_body(150, "warm", 0);
    let (s, _, r) = app.post("/v1/messages", &app.key, &body).await;
    assert_eq!(s, 200, "{r}");
    assert_eq!(r["content"], json!([]));
    assert_eq!(r["stop_reason"], "max_tokens");
    assert_eq!(r["usage"]["output_tokens"], 0);
    let (_, _, r2) = app
        .post("/v1/messages", &app.key, &cached_body(150, "warm", 8))
        .await;
    assert!(r2["usage"]["cache_read_input_tokens"].as_u64().unwrap() >= 150);
    app.stop().await;
}

/// `ignore_eos` (the load tester's "don't stop early"): exactly `max_tokens` tokens, in the
/// body and in the stream, and billed as such; without it the sim answers in under 32.
#[tokio::test]
async fn ignore_eos_generates_exactly_max_tokens() {
    let app = TestApp::start().await;
    let mut body = cached_body(150, "eos", 120);
    let (_, _, plain) = app.post("/v1/messages", &app.key, &body).await;
    assert!(
        plain["usage"]["output_tokens"].as_u64().unwrap() < 32,
        "{plain}"
    );
    assert_eq!(plain["stop_reason"], "end_turn");
    body["ignore_eos"] = json!(true);
    let (s, _, r) = app.post("/v1/messages", &app.key, &body).await;
    assert_eq!(s, 200, "{r}");
    assert_eq!(r["usage"]["output_tokens"], 120);
    assert_eq!(r["stop_reason"], "max_tokens");
    body["stream"] = json!(true);
    let resp = app
        .post_raw("/v1/messages", &app.key, body.to_string())
        .await;
    let text = resp.text().await.unwrap();
    assert_eq!(text.matches("event: content_block_delta").count(), 120);
    assert!(text.contains("\"output_tokens\":120"), "{text}");
    body["ignore_eos"] = json!("yes");
    let (s, _, r) = app.post("/v1/messages", &app.key, &body).await;
    assert_eq!(s, 400, "{r}");
    assert_eq!(r["error"]["type"], "invalid_request_error");
    app.stop().await;
}

#[tokio::test]
async fn generation_stops_at_the_context_window_as_max_tokens() {
    let app = TestApp::start().await;
    // sim-tiny has a 32,768-token window: leave room for exactly 3 more tokens.
    let probe = cached_body(0, "x", 8);
    let mut count_body = probe.clone();
    count_body.as_object_mut().unwrap().remove("max_tokens");
    count_body.as_object_mut().unwrap().remove("system");
    let (_, _, c) = app
        .post("/v1/messages/count_tokens", &app.key, &count_body)
        .await;
    let overhead = c["input_tokens"].as_u64().unwrap() as usize - 1;
    let words: String = (0..32_768 - 3 - overhead)
        .map(|i| format!("w{} ", i % 10))
        .collect::<String>();
    let body = json!({"model": "sim-tiny", "max_tokens": 4000, "messages": [{"role": "user", "content": words.trim_end()}]});
    let (s, _, r) = app.post("/v1/messages", &app.key, &body).await;
    assert_eq!(s, 200, "{r}");
    let prompt = usage_total(&r["usage"]);
    assert!(prompt <= 32_768);
    assert!(r["usage"]["output_tokens"].as_u64().unwrap() <= 32_768 - prompt);
    assert_eq!(r["stop_reason"], "max_tokens");
    app.stop().await;
}

/// A prompt whose text alone exceeds the context window is refused from its size, before
/// any tokenizing (a 4 MB message used to cost seconds of CPU and gigabytes of memory on
/// the reference model): the same 400 on both endpoints, and the service answers at once.
#[tokio::test]
async fn a_prompt_too_large_for_any_tokenization_is_refused_before_tokenizing() {
    let app = TestApp::start().await;
    let huge = "lorem ipsum dolor sit amet ".repeat(150_000); // ~4 MB
    let mut body = cached_body(10, &huge, 8);
    for path in ["/v1/messages", "/v1/messages/count_tokens"] {
        if path.ends_with("count_tokens") {
            body.as_object_mut().unwrap().remove("max_tokens");
        }
        let (s, _, e) = app.post(path, &app.key, &body).await;
        assert_eq!(s, 400, "{path}: {e}");
        assert_eq!(e["error"]["type"], "invalid_request_error");
        let msg = e["error"]["message"].as_str().unwrap();
        assert!(
            msg.starts_with("prompt is too long:") && msg.contains("at least"),
            "{path}: {msg}"
        );
    }
    // Nothing was metered for the refused request.
    app.settle().await;
    assert_eq!(app.ledger_count().await, 0);
    app.stop().await;
}

/// A known path with the wrong method, a duplicated key header: the API's own error shape.
#[tokio::test]
async fn wrong_method_and_duplicate_key_headers_get_api_errors() {
    let app = TestApp::start().await;
    let r = app
        .client
        .get(format!("{}/v1/messages", app.url))
        .header("x-api-key", &app.key)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 405);
    assert!(r.headers().contains_key("request-id"));
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert_eq!(v["error"]["message"], "GET is not allowed for /v1/messages");

    let r = app
        .client
        .post(format!("{}/v1/messages", app.url))
        .header("x-api-key", &app.key)
        .header("x-api-key", "sk-someone-else")
        .header("anthropic-version", "2023-06-01")
        .json(&cached_body(10, "hi", 4))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert!(common::error_message(&v).contains("more than once"), "{v}");
    app.stop().await;
}

/// Time to `message_start` (the prompt is prefilled, or read from the cache, before it).
async fn ttft(app: &TestApp, key: &str, body: &serde_json::Value) -> Duration {
    let mut body = body.clone();
    body["stream"] = true.into();
    let t = std::time::Instant::now();
    let mut resp = app.post_raw("/v1/messages", key, body.to_string()).await;
    assert_eq!(resp.status(), 200);
    let mut seen = String::new();
    while !seen.contains("message_start") {
        let c = resp.chunk().await.unwrap().expect("a message_start");
        seen.push_str(&String::from_utf8_lossy(&c));
    }
    let took = t.elapsed();
    while resp.chunk().await.unwrap().is_some() {}
    took
}

/// Isolation, measured as an attacker would: tenant B times its first token on a prompt
/// tenant A has just cached against a never-seen prompt of the same size, over 200 pairs in
/// alternating order. B's read of A's prefix is a miss like any other (no signal: about
/// half the pairs each way), while A's own repeat (the control) is visibly faster, so the
/// test does see a cache hit when there is one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_tenants_cached_prefix_gives_no_time_to_first_token_signal() {
    let app = TestApp::start_with(Options {
        // The sim at real speed: a miss prefills 20 µs a token, a hit loads 0.5 µs a token.
        sim_time_scale: 1.0,
        ..Default::default()
    })
    .await;
    let (a, b) = (app.key.clone(), app.new_tenant_key().await);
    let pairs = 200;
    let (mut cross, mut control) = (0, 0);
    for i in 0..pairs {
        let body = |tag: &str| {
            let system: String = (0..400).map(|w| format!("{tag}{i}w{w} ")).collect();
            json!({
                "model": "sim-tiny",
                "max_tokens": 1,
                "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
                "messages": [{"role": "user", "content": "q"}],
            })
        };
        // Tags of one length: the three prompts tokenize to the same count.
        let (cached, fresh, fresh_a) = (body("s"), body("f"), body("o"));
        let (s, _, r) = app.post("/v1/messages", &a, &cached).await;
        assert_eq!(s, 200, "{r}");
        let (t_cached, t_fresh) = if i % 2 == 0 {
            let c = ttft(&app, &b, &cached).await;
            (c, ttft(&app, &b, &fresh).await)
        } else {
            let f = ttft(&app, &b, &fresh).await;
            (ttft(&app, &b, &cached).await, f)
        };
        cross += usize::from(t_cached < t_fresh);
        let (t_own, t_new) = if i % 2 == 0 {
            let c = ttft(&app, &a, &cached).await;
            (c, ttft(&app, &a, &fresh_a).await)
        } else {
            let f = ttft(&app, &a, &fresh_a).await;
            (ttft(&app, &a, &cached).await, f)
        };
        control += usize::from(t_own < t_new);
    }
    let pct = |n: usize| 100.0 * n as f64 / pairs as f64;
    eprintln!(
        "B's first token on A's cached prompt came sooner than on a fresh one in {:.1}% of {pairs} pairs; A's own repeat in {:.1}%",
        pct(cross),
        pct(control)
    );
    assert!(
        pct(control) >= 90.0,
        "the control sees no hit: the test measures nothing"
    );
    assert!(
        (30.0..=70.0).contains(&pct(cross)),
        "another tenant's cached prefix is measurable: {:.1}%",
        pct(cross)
    );
    app.stop().await;
}

/// Cache diagnostics in the shape of Anthropic's beta: why a request missed what an earlier
/// one (named by its message id) left in the cache.
#[tokio::test]
async fn cache_miss_reasons_compare_with_the_previous_message() {
    let app = TestApp::start().await;
    let post = async |body: &serde_json::Value, beta: bool| -> (u16, serde_json::Value) {
        let mut req = app
            .client
            .post(format!("{}/v1/messages", app.url))
            .header("x-api-key", &app.key)
            .header("anthropic-version", "2023-06-01")
            .json(body);
        if beta {
            req = req.header(
                "anthropic-beta",
                "some-other-beta, cache-diagnosis-2026-04-07",
            );
        }
        let r = req.send().await.unwrap();
        (r.status().as_u16(), r.json().await.unwrap())
    };
    let first = cached_body(300, "diag", 4);
    let (s, a) = post(&first, true).await;
    assert_eq!(s, 200, "{a}");
    assert_eq!(
        a["diagnostics"]["cache_miss_reason"],
        serde_json::Value::Null
    );
    let prev = a["id"].as_str().unwrap().to_string();
    let written = a["usage"]["cache_creation_input_tokens"].as_u64().unwrap();
    assert!(written > 0);
    let with_prev = |mut b: serde_json::Value, id: &str| {
        b["diagnostics"] = json!({"previous_message_id": id});
        b
    };
    // The same prompt reads everything: nothing missed.
    let (_, b) = post(&with_prev(first.clone(), &prev), true).await;
    assert_eq!(
        b["diagnostics"]["cache_miss_reason"],
        serde_json::Value::Null,
        "{b}"
    );
    // A changed system prompt misses what the first one wrote.
    let mut changed = first.clone();
    changed["system"][0]["text"] = json!(format!(
        "changed {}",
        first["system"][0]["text"].as_str().unwrap()
    ));
    let (_, c) = post(&with_prev(changed, &prev), true).await;
    let r = &c["diagnostics"]["cache_miss_reason"];
    assert_eq!(r["type"], "system_changed", "{c}");
    assert_eq!(r["cache_missed_input_tokens"], written);
    // Unknown ids, and ids of another tenant, are not found.
    let (_, d) = post(&with_prev(first.clone(), "msg_nope"), true).await;
    assert_eq!(
        d["diagnostics"]["cache_miss_reason"]["type"],
        "previous_message_not_found"
    );
    // Without the beta header: no diagnostics at all.
    let (_, e) = post(&with_prev(first.clone(), &prev), false).await;
    assert!(e.get("diagnostics").is_none(), "{e}");
    // A malformed request is a 400.
    let mut bad = first.clone();
    bad["diagnostics"] = json!({"previous_message_id": 5});
    let (s, f) = post(&bad, true).await;
    assert_eq!(s, 400, "{f}");
    app.stop().await;
}

/// OpenAI's `prompt_cache_retention: "24h"` keeps the prefix a day, billed as a 1h write.
#[tokio::test]
async fn openai_24h_retention_keeps_the_prefix_a_day() {
    let app = TestApp::start().await;
    let system: String = (0..300).map(|i| format!("w{i} ")).collect();
    let ask = |question: &str| {
        serde_json::json!({
            "model": "sim-tiny",
            "max_tokens": 4,
            "prompt_cache_retention": "24h",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ],
        })
    };
    let pool = &app.running().pool;
    let tenant: uuid::Uuid = sqlx::query_scalar("SELECT tenant_id FROM api_keys LIMIT 1")
        .fetch_one(pool)
        .await
        .unwrap();
    let (s, _, v) = app.post("/v1/chat/completions", &app.key, &ask("q")).await;
    assert_eq!(s, 200, "{v}");
    assert!(
        v["cachet"]["breakpoints"]
            .as_array()
            .unwrap()
            .iter()
            .any(|b| b["ttl"] == "24h" && b["status"] == "written"),
        "{v}"
    );
    // Read back; the cache view lists read prefixes with what is left of their TTL.
    let (s, _, v) = app
        .post("/v1/chat/completions", &app.key, &ask("again"))
        .await;
    assert_eq!(s, 200, "{v}");
    assert!(common::cached_tokens(&v) > 0, "{v}");
    let left = app.longest_ttl_left_ms(tenant);
    assert!(
        left > 23 * 3600 * 1000 && left <= 24 * 3600 * 1000,
        "a 24h prefix has about a day left: {left} ms"
    );
    // Billed as a 1h write (the first request wrote it).
    app.settle().await;
    let w1: i64 = sqlx::query_scalar("SELECT sum(cache_write_1h_tokens)::BIGINT FROM usage_events")
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(w1 > 0);
    app.stop().await;
}
