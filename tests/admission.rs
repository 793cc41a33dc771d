//! Rate limits from the quotas table, enforced in Redis, with a local fallback when Redis
//! is unreachable.

mod common;

use common::*;
use serde_json::Value;

async fn set_quotas(app: &TestApp, patch: control::tenants::policy::PolicyPatch) {
    let pool = sqlx::PgPool::connect(&app.db_url).await.unwrap();
    let tenant: uuid::Uuid = sqlx::query_scalar("SELECT tenant_id FROM api_keys LIMIT 1")
        .fetch_one(&pool)
        .await
        .unwrap();
    control::tenants::policy::patch_policy(
        &pool,
        &control::tenants::Actor::cli("test"),
        cachet_common::TenantId(tenant),
        &patch,
        control::tenants::policy::PatchedBy::Platform,
    )
    .await
    .unwrap();
    pool.close().await;
}

async fn statuses(
    app: &TestApp,
    body: &Value,
    n: usize,
) -> Vec<(u16, reqwest::header::HeaderMap, Value)> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(app.post("/v1/messages", &app.key, body).await);
    }
    out
}

#[tokio::test]
async fn requests_per_minute_limit_answers_429_with_retry_after_and_headers() {
    let app = TestApp::start().await;
    set_quotas(
        &app,
        control::tenants::policy::PolicyPatch {
            key_requests_per_minute: Some(Some(3)),
            ..Default::default()
        },
    )
    .await;
    let r = statuses(&app, &cached_body(10, "hi", 4), 4).await;
    assert_eq!(
        r.iter().map(|x| x.0).collect::<Vec<_>>(),
        vec![200, 200, 200, 429]
    );
    assert_eq!(r[0].1["anthropic-ratelimit-requests-limit"], "3");
    assert_eq!(r[2].1["anthropic-ratelimit-requests-remaining"], "0");
    let (_, h, v) = &r[3];
    assert_eq!(v["error"]["type"], "rate_limit_error");
    assert!(h["retry-after"].to_str().unwrap().parse::<u64>().unwrap() >= 1);
    assert!(h.contains_key("anthropic-ratelimit-requests-reset"));
    app.settle().await;
    assert_eq!(
        app.ledger_count().await,
        3,
        "a rejected request is not metered"
    );
    app.stop().await;
}

#[tokio::test]
async fn cache_reads_do_not_count_toward_input_tokens_per_minute() {
    let app = TestApp::start().await;
    let body = cached_body(300, "hello", 4);
    // Enough for one uncached prompt (~310 tokens) plus many cached ones (~10 each).
    set_quotas(
        &app,
        control::tenants::policy::PolicyPatch {
            limits: control::tenants::limits::LimitsPatch {
                input_tokens_per_minute: Some(Some(400)),
                ..Default::default()
            },
            ..Default::default()
        },
    )
    .await;
    let r = statuses(&app, &body, 6).await;
    assert!(
        r.iter().all(|x| x.0 == 200),
        "{:?}",
        r.iter().map(|x| (x.0, x.2.clone())).collect::<Vec<_>>()
    );
    assert!(r[5].2["usage"]["cache_read_input_tokens"].as_u64().unwrap() >= 300);
    // A different uncached prompt of the same size no longer fits.
    let other = cached_body(320, "other prompt", 4)
        .to_string()
        .replace("\"w", "\"z")
        .replace(" w", " z");
    let (s, _, v) = app
        .post(
            "/v1/messages",
            &app.key,
            &serde_json::from_str(&other).unwrap(),
        )
        .await;
    assert_eq!(s, 429, "{v}");
    assert!(common::error_message(&v).contains("input tokens per minute"));
    app.stop().await;
}

#[tokio::test]
async fn redis_unreachable_falls_back_to_local_limits() {
    // Nothing listens on port 1: every Redis call fails at once.
    let app = TestApp::start_with(Options {
        redis_url: "redis://127.0.0.1:1".into(),
        ..Default::default()
    })
    .await;
    set_quotas(
        &app,
        control::tenants::policy::PolicyPatch {
            key_requests_per_minute: Some(Some(2)),
            ..Default::default()
        },
    )
    .await;
    let r = statuses(&app, &cached_body(10, "hi", 4), 3).await;
    assert_eq!(
        r.iter().map(|x| x.0).collect::<Vec<_>>(),
        vec![200, 200, 429],
        "served, and still limited"
    );
    let local = gateway::metrics::ADMISSION
        .with_label_values(&["local"])
        .get();
    assert!(local >= 3);
    app.stop().await;
}
