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
/// when Postgres is back reconciles. The cut lands mid-rollup by construction: a row lock on
/// the day rollups holds the run after it rewrote the hours, and the cut comes while it waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_cut_away_mid_rollup_leaves_no_partial_rollup() {
    let name = fresh_db_name();
    let direct = cachet::server::connect_and_migrate(&format!("{PG}/{name}"), 4)
        .await
        .unwrap();
    let ledger = |first: i32, last: i32| {
        let direct = direct.clone();
        async move {
            sqlx::query(
                r#"INSERT INTO usage_events (request_id, tenant_id, workspace_id, api_key_id, model,
                     input_tokens, cache_write_5m_tokens, cache_write_1h_tokens, cache_read_tokens,
                     output_tokens, status, started_at, finished_at)
                   SELECT gen_random_uuid(), ('00000000-0000-0000-0000-00000000000' || (i % 7))::UUID,
                          '00000000-0000-0000-0000-000000000000', ('00000000-0000-0000-0000-0000000000' || (10 + i % 50))::UUID,
                          'sim-tiny', i % 100, i % 13, i % 3, i % 1000, i % 50, 'completed',
                          '2026-10-10T00:00:00Z'::TIMESTAMPTZ + (i % 86400) * INTERVAL '1 second',
                          '2026-10-10T00:00:00Z'::TIMESTAMPTZ + (i % 86400) * INTERVAL '1 second'
                   FROM generate_series($1::INT, $2::INT) AS i"#,
            )
            .bind(first)
            .bind(last)
            .execute(&direct)
            .await
            .unwrap();
        }
    };
    let (from, to) = (
        day(chrono::NaiveDate::from_ymd_opt(2026, 10, 10).unwrap()),
        day(chrono::NaiveDate::from_ymd_opt(2026, 10, 11).unwrap()),
    );
    // Rolled up once, then the ledger grows: a rollup that half-committed would show hours
    // that no longer add up to their day.
    ledger(1, 20_000).await;
    billing::rollup::rollup(&direct, from, to).await.unwrap();
    ledger(20_001, 21_000).await;
    let totals = || {
        let direct = direct.clone();
        async move {
            sqlx::query_as::<_, (String, i64)>(
                "SELECT granularity, sum(requests)::BIGINT FROM usage_rollups GROUP BY 1 ORDER BY 1",
            )
            .fetch_all(&direct)
            .await
            .unwrap()
        }
    };
    let before = totals().await;
    assert_eq!(
        before,
        vec![("day".to_string(), 20_000), ("hour".to_string(), 20_000)]
    );

    let mut holder = direct.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM usage_rollups WHERE granularity = 'day' FOR UPDATE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let proxy = CutProxy::start("127.0.0.1:5432").await;
    let proxied = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(2))
        .connect(&format!("postgres://postgres@{}/{name}", proxy.addr))
        .await
        .unwrap();
    let run = tokio::spawn({
        let p = proxied.clone();
        async move { billing::rollup::rollup(&p, from, to).await }
    });
    // The run waits on the day rows' lock: it has rewritten the hours, uncommitted.
    let waited = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                 AND wait_event_type = 'Lock' AND query LIKE 'DELETE FROM usage_rollups%'",
            )
            .fetch_one(&direct)
            .await
            .unwrap();
            if waiting == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(waited.is_ok(), "the rollup never reached its day rows");
    proxy.cut();
    let outcome = run.await.unwrap();
    holder.rollback().await.unwrap();
    assert!(outcome.is_err(), "the cut landed mid-rollup: {outcome:?}");
    // Postgres ends the cut session's transaction once it sees its client gone.
    let gone = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let left: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                 AND pid <> pg_backend_pid() AND xact_start IS NOT NULL",
            )
            .fetch_one(&direct)
            .await
            .unwrap();
            if left == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(gone.is_ok(), "the cut session's transaction never ended");
    assert_eq!(totals().await, before, "a failed rollup left partial rows");
    proxy.restore();
    billing::rollup::rollup(&direct, from, to).await.unwrap();
    let r = billing::rollup::reconcile(&direct, from, to).await.unwrap();
    assert!(r.mismatches.is_empty(), "{:?}", r.mismatches);
    assert_eq!(r.tenants, 7);
    assert_eq!(
        totals().await,
        vec![("day".to_string(), 21_000), ("hour".to_string(), 21_000)]
    );
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
    .await
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
    .await
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

/// A meter's directory holding another database's spool and open-stream journal (a process
/// of database A stopped with events waiting) keeps them aside when a meter of database B
/// starts there: B's ledger gets nothing; they are recovered into A alone (decision 0030).
#[tokio::test]
async fn a_spool_and_open_streams_of_another_database_are_kept_aside_not_replayed() {
    let (a_name, _, a) = fresh_db().await;
    let (b_name, _, b) = fresh_db().await;
    let dir = tempdir::Dir::new();
    let spool = dir.0.join("usage-spool.jsonl");
    let a_id = billing::database::identity(&a).await.unwrap();
    std::fs::write(
        dir.0.join(billing::database::IDENTITY_FILE),
        format!("{a_id}\n"),
    )
    .unwrap();
    let (spooled, open) = (event(RequestId::new()), event(RequestId::new()));
    let line = |e: &UsageEvent| format!("{}\n", serde_json::to_string(e).unwrap());
    std::fs::write(&spool, line(&spooled)).unwrap();
    std::fs::write(spool.with_extension("open"), line(&open)).unwrap();
    let count = |pool: &sqlx::PgPool| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM usage_events")
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };

    run_meter(b.clone(), MeterConfig::with_spool(spool.clone()))
        .await
        .unwrap();
    assert_eq!(count(&b).await, 0, "B's ledger untouched");
    // What B's meter left in the directory is its own: none of A's events.
    for f in std::fs::read_dir(&dir.0).unwrap().filter_map(Result::ok) {
        if f.path().is_file() {
            let text = String::from_utf8_lossy(&std::fs::read(f.path()).unwrap()).into_owned();
            for e in [&spooled, &open] {
                let id = serde_json::to_value(e.request_id).unwrap();
                assert!(
                    !text.contains(id.as_str().unwrap()),
                    "{:?} still holds A's event",
                    f.path()
                );
            }
        }
    }
    let kept = common::kept_aside(&dir.0);
    assert_eq!(kept.len(), 1);
    let kept_spool = kept[0].join("usage-spool.jsonl");

    // Recovery refuses B, and puts both events into A (the cut stream as `failed`).
    let mut into = MeterConfig::with_spool(kept_spool.clone());
    into.foreign = billing::database::Foreign::Refuse;
    let err = run_meter(b.clone(), into.clone()).await.unwrap_err();
    assert!(err.to_string().contains(&a_id.to_string()), "{err}");
    assert_eq!(count(&b).await, 0);
    run_meter(a.clone(), into).await.unwrap();
    let rows: Vec<(uuid::Uuid, String)> =
        sqlx::query_as("SELECT request_id, status::TEXT FROM usage_events ORDER BY status")
            .fetch_all(&a)
            .await
            .unwrap();
    let mut want = vec![
        (spooled.request_id.0, "completed".to_string()),
        (open.request_id.0, "failed".to_string()),
    ];
    want.sort_by(|x, y| x.1.cmp(&y.1));
    assert_eq!(rows, want);
    a.close().await;
    b.close().await;
    drop_db(&a_name).await;
    drop_db(&b_name).await;
}

/// A meter started on `pool`, run until everything it took is in the ledger, then stopped.
async fn run_meter(pool: sqlx::PgPool, config: MeterConfig) -> Result<(), billing::MeterError> {
    let stop = CancellationToken::new();
    let (meter, task) = Meter::start(pool, config, stop.clone()).await?;
    assert!(meter.settled(Duration::from_secs(10)).await);
    stop.cancel();
    task.await.unwrap();
    Ok(())
}
