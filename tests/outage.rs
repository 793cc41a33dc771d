//! A Postgres outage as the API sees it: keys already seen keep working from their last
//! known state without waiting on the pool, a key never seen is refused at once (503, to be
//! retried), and every request answered meanwhile reaches the ledger once Postgres is back.
//! (One test in this binary: it reads process-wide metrics.)

mod common;

use std::time::Duration;

use common::{CutProxy, Options, TestApp, cached_body};

async fn auth_count(app: &TestApp, result: &str) -> u64 {
    let text = app.metrics().await;
    let series = format!("cachet_gateway_auth_total{{result=\"{result}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&series))
        .map(|v| v.trim().parse().unwrap())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn during_a_postgres_outage_known_keys_are_served_at_once_and_unknown_ones_refused_at_once() {
    let proxy = CutProxy::start("127.0.0.1:5432").await;
    let db_name = common::fresh_db_name();
    let app = TestApp::start_with(Options {
        db_name: Some(db_name.clone()),
        db_url_override: Some(format!("postgres://postgres@{}/{db_name}", proxy.addr)),
        tweak: |c| c.gateway.auth_cache_ttl_secs = 1,
        ..Default::default()
    })
    .await;
    let unseen = app.new_tenant_key().await;
    let body = cached_body(50, "hello", 4);
    let (s, _, _) = app.post("/v1/messages", &app.key, &body).await;
    assert_eq!(s, 200);

    proxy.cut();
    // Past the key's cache TTL: before, every request then waited ~2 s for the pool.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let stale_before = auth_count(&app, "stale").await;
    for i in 0..20 {
        let (s, _, v) = app
            .post(
                "/v1/messages",
                &app.key,
                &cached_body(50, &format!("q{i}"), 4),
            )
            .await;
        assert_eq!(s, 200, "a known key keeps working during the outage: {v}");
    }
    assert!(
        auth_count(&app, "stale").await >= stale_before + 20,
        "served from the last known state, not after a lookup"
    );
    let lookups_before = auth_count(&app, "lookup").await;
    for _ in 0..10 {
        let (s, _, v) = app.post("/v1/messages", &unseen, &body).await;
        assert_eq!(s, 503, "{v}");
        assert_eq!(v["error"]["type"], "api_error");
    }
    assert!(
        auth_count(&app, "lookup").await - lookups_before <= 2,
        "an unknown key does not make each request wait for the pool"
    );
    assert!(auth_count(&app, "refused_db_down").await >= 8);

    proxy.restore();
    // The key store is back: the unseen key resolves (after the backoff), and every answered
    // request has its row.
    let mut ok = false;
    for _ in 0..50 {
        let (s, _, _) = app.post("/v1/messages", &unseen, &body).await;
        if s == 200 {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(ok, "the unseen key works once Postgres is back");
    app.settle().await;
    assert_eq!(app.ledger_count().await, 22);
    app.stop().await;
}
