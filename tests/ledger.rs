//! The ledger never loses or doubles a row: Postgres cut away mid-load, duplicate delivery,
//! spool replay after a restart.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use billing::{Meter, MeterConfig, UsageEvent, UsageStatus};
use cachet_common::{ApiKeyId, RequestId, TenantId, WorkspaceId};
use common::*;
use tokio_util::sync::CancellationToken;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_cut_away_mid_load_loses_and_doubles_nothing() {
    let proxy = CutProxy::start("127.0.0.1:5432").await;
    let db_name = fresh_db_name();
    let app = TestApp::start_with(Options {
        db_url_override: Some(format!("postgres://postgres@{}/{db_name}", proxy.addr)),
        db_name: Some(db_name),
        ..Default::default()
    })
    .await;
    let body = cached_body(60, "ledger", 4);
    // Warm the auth cache so requests keep being served while Postgres is away.
    let (s, _, _) = app.post("/v1/messages", &app.key, &body).await;
    assert_eq!(s, 200);

    let mut ids = HashSet::new();
    let total_rounds = 30;
    for round in 0..total_rounds {
        if round == 8 {
            proxy.cut();
        }
        if round == 20 {
            proxy.restore();
        }
        let mut batch = Vec::new();
        for _ in 0..8 {
            let (app_url, key, client, b) = (
                app.url.clone(),
                app.key.clone(),
                app.client.clone(),
                body.to_string(),
            );
            batch.push(tokio::spawn(async move {
                let r = client
                    .post(format!("{app_url}/v1/messages"))
                    .header("x-api-key", key)
                    .header("anthropic-version", "2023-06-01")
                    .body(b)
                    .send()
                    .await
                    .unwrap();
                assert_eq!(
                    r.status(),
                    200,
                    "requests are served while postgres is away"
                );
                r.headers()["request-id"].to_str().unwrap().to_string()
            }));
        }
        for t in batch {
            ids.insert(t.await.unwrap());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    app.settle().await;
    let pool = sqlx::PgPool::connect(&app.db_url).await.unwrap();
    let rows: Vec<uuid::Uuid> = sqlx::query_scalar("SELECT request_id FROM usage_events")
        .fetch_all(&pool)
        .await
        .unwrap();
    pool.close().await;
    assert_eq!(
        rows.len(),
        ids.len() + 1,
        "every request exactly once (plus the warm-up)"
    );
    let stored: HashSet<String> = rows.iter().map(|u| format!("req_{}", u.simple())).collect();
    for id in &ids {
        assert!(stored.contains(id), "{id} lost");
    }
    let spooled = billing::metrics::EVENTS
        .with_label_values(&["spooled"])
        .get();
    assert!(
        spooled > 0,
        "the cut must have forced events through the spool"
    );
    // What billing derives from the ledger agrees with it after the fault.
    let pool = sqlx::PgPool::connect(&app.db_url).await.unwrap();
    let today = chrono::Utc::now().date_naive();
    let (from, to) = (day(today), day(today.succ_opt().unwrap()));
    billing::rollup::rollup(&pool, from, to).await.unwrap();
    let r = billing::rollup::reconcile(&pool, from, to).await.unwrap();
    assert!(r.mismatches.is_empty(), "{:?}", r.mismatches);
    let requests: i64 = sqlx::query_scalar(
        "SELECT sum(requests)::BIGINT FROM usage_rollups WHERE granularity = 'day'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(requests as usize, ids.len() + 1);
    pool.close().await;
    app.stop().await;
}

fn day(d: chrono::NaiveDate) -> chrono::DateTime<chrono::Utc> {
    d.and_hms_opt(0, 0, 0).unwrap().and_utc()
}

/// Postgres going away in the middle of a rollup (connections dropped, as in a restart)
/// leaves the rollups as they were (the recomputation is one transaction); running it again
/// when Postgres is back reconciles.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_cut_away_mid_rollup_leaves_no_partial_rollup() {
    let name = fresh_db_name();
    let direct = cachet::server::connect_and_migrate(&format!("{PG}/{name}"), 4)
        .await
        .unwrap();
    // 300,000 ledger rows over a day, for a rollup that takes a while.
    sqlx::query(
        r#"INSERT INTO usage_events (request_id, tenant_id, workspace_id, api_key_id, model,
             input_tokens, cache_write_5m_tokens, cache_write_1h_tokens, cache_read_tokens,
             output_tokens, status, started_at, finished_at)
           SELECT gen_random_uuid(), ('00000000-0000-0000-0000-00000000000' || (i % 7))::UUID,
                  '00000000-0000-0000-0000-000000000000', ('00000000-0000-0000-0000-0000000000' || (10 + i % 50))::UUID,
                  'sim-tiny', i % 100, i % 13, i % 3, i % 1000, i % 50, 'completed',
                  '2026-10-10T00:00:00Z'::TIMESTAMPTZ + (i % 86400) * INTERVAL '1 second',
                  '2026-10-10T00:00:00Z'::TIMESTAMPTZ + (i % 86400) * INTERVAL '1 second'
           FROM generate_series(1, 300000) AS i"#,
    )
    .execute(&direct)
    .await
    .unwrap();
    let proxy = CutProxy::start("127.0.0.1:5432").await;
    let proxied = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(2))
        .connect(&format!("postgres://postgres@{}/{name}", proxy.addr))
        .await
        .unwrap();
    let (from, to) = (
        day(chrono::NaiveDate::from_ymd_opt(2026, 10, 10).unwrap()),
        day(chrono::NaiveDate::from_ymd_opt(2026, 10, 11).unwrap()),
    );
    let run = tokio::spawn({
        let p = proxied.clone();
        async move { billing::rollup::rollup(&p, from, to).await }
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    proxy.cut();
    let outcome = run.await.unwrap();
    eprintln!("rollup under the cut: {outcome:?}");
    let rolled: i64 = sqlx::query_scalar("SELECT count(*) FROM usage_rollups")
        .fetch_one(&direct)
        .await
        .unwrap();
    match &outcome {
        // All or nothing: a failed run left no rows at all.
        Err(_) => assert_eq!(rolled, 0, "a failed rollup left partial rows"),
        Ok(r) => assert_eq!(rolled as u64, r.hourly_rows + r.daily_rows),
    }
    proxy.restore();
    billing::rollup::rollup(&direct, from, to).await.unwrap();
    let r = billing::rollup::reconcile(&direct, from, to).await.unwrap();
    assert!(r.mismatches.is_empty(), "{:?}", r.mismatches);
    assert_eq!(r.tenants, 7);
    proxied.close().await;
    direct.close().await;
    drop_db(&name).await;
}

fn event(id: RequestId) -> UsageEvent {
    UsageEvent {
        request_id: id,
        tenant_id: TenantId::new(),
        workspace_id: WorkspaceId::new(),
        api_key_id: ApiKeyId::new(),
        model: "sim-tiny".into(),
        input_tokens: 10,
        cache_write_5m_tokens: 100,
        cache_write_1h_tokens: 0,
        cache_read_tokens: 50,
        output_tokens: 7,
        status: UsageStatus::Completed,
        started_at: chrono::Utc::now(),
        finished_at: chrono::Utc::now(),
    }
}

#[tokio::test]
async fn the_same_event_delivered_twice_is_one_row_and_a_spool_survives_a_restart() {
    let name = fresh_db_name();
    let url = format!("{PG}/{name}");
    let pool = cachet::server::connect_and_migrate(&url, 4).await.unwrap();
    let dir = tempdir::Dir::new();
    let spool = dir.0.join("spool.jsonl");

    let stop = CancellationToken::new();
    let (meter, task) = Meter::start(
        pool.clone(),
        MeterConfig::with_spool(spool.clone()),
        stop.clone(),
    )
    .unwrap();
    let e = event(RequestId::new());
    meter.record(e.clone()).await.unwrap();
    meter.record(e.clone()).await.unwrap();
    assert!(meter.settled(Duration::from_secs(10)).await);
    stop.cancel();
    task.await.unwrap();

    // A spool left by a previous process (with a duplicate of a committed event and a torn
    // last line) is replayed on start.
    let fresh = event(RequestId::new());
    let mut text = String::new();
    for ev in [&e, &fresh, &fresh] {
        text.push_str(&serde_json::to_string(ev).unwrap());
        text.push('\n');
    }
    text.push_str("{\"request_id\": \"torn");
    std::fs::write(&spool, text).unwrap();
    let stop = CancellationToken::new();
    let (meter, task) = Meter::start(
        pool.clone(),
        MeterConfig::with_spool(spool.clone()),
        stop.clone(),
    )
    .unwrap();
    assert!(
        meter.settled(Duration::from_secs(10)).await,
        "spool replayed"
    );
    stop.cancel();
    task.await.unwrap();

    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM usage_events")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(n, 2);
    let row: (i64, i64, i64) = sqlx::query_as(
        "SELECT input_tokens, cache_write_5m_tokens, cache_read_tokens FROM usage_events WHERE request_id = $1",
    )
    .bind(fresh.request_id.0)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(row, (10, 100, 50));
    // Billed once: the rollups count each request once and reconcile with the ledger.
    let today = chrono::Utc::now().date_naive();
    let (from, to) = (day(today), day(today.succ_opt().unwrap()));
    billing::rollup::rollup(&pool, from, to).await.unwrap();
    let requests: i64 = sqlx::query_scalar(
        "SELECT sum(requests)::BIGINT FROM usage_rollups WHERE granularity = 'day'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(requests, 2);
    let r = billing::rollup::reconcile(&pool, from, to).await.unwrap();
    assert!(r.mismatches.is_empty(), "{:?}", r.mismatches);
    // The ledger is append-only.
    let err = sqlx::query("UPDATE usage_events SET output_tokens = 0")
        .execute(&pool)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("append-only"));
    pool.close().await;
    drop_db(&name).await;
}
