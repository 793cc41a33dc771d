//! Billing benchmarks: ledger ingest through the meter vs `COPY`, and a streamed export of a
//! large ledger with the process's peak memory.

use std::time::{Duration, Instant};

use anyhow::Context;
use billing::{Meter, MeterConfig, UsageEvent, UsageStatus};
use cachet_common::{ApiKeyId, RequestId, TenantId, WorkspaceId};
use futures::StreamExt;
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, PgPool};

/// A scratch database on the server of `url`, dropped by [`drop_scratch`].
pub(super) async fn scratch(url: &str) -> anyhow::Result<(PgPool, String, String)> {
    let opts: PgConnectOptions = url.parse().context("parsing the database URL")?;
    let name = format!("cachet_bench_{}", uuid::Uuid::new_v4().simple());
    let scratch_url = opts.clone().database(&name).to_url_lossy().to_string();
    let mut admin = opts.clone().database("postgres").connect().await?;
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{name}\"")))
        .execute(&mut admin)
        .await
        .context("creating the scratch database")?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect(&scratch_url)
        .await
        .with_context(|| format!("connecting to {scratch_url}"))?;
    billing::migrate(&pool)
        .await
        .context("applying migrations")?;
    Ok((pool, name, url.to_string()))
}

pub(super) async fn drop_scratch(pool: PgPool, name: &str, url: &str) -> anyhow::Result<()> {
    pool.close().await;
    let opts: PgConnectOptions = url.parse()?;
    let mut admin = opts.database("postgres").connect().await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"
    )))
    .execute(&mut admin)
    .await?;
    Ok(())
}

fn events(n: usize) -> Vec<UsageEvent> {
    let tenants: Vec<TenantId> = (0..50).map(|_| TenantId::new()).collect();
    let keys: Vec<ApiKeyId> = (0..200).map(|_| ApiKeyId::new()).collect();
    let ws = WorkspaceId::new();
    let now = chrono::Utc::now();
    (0..n)
        .map(|i| UsageEvent {
            request_id: RequestId::new(),
            tenant_id: tenants[i % tenants.len()],
            workspace_id: ws,
            api_key_id: keys[i % keys.len()],
            model: "sim-llama-8b".into(),
            input_tokens: (i % 4000) as u64,
            cache_write_5m_tokens: (i % 7 * 100) as u64,
            cache_write_1h_tokens: (i % 3 * 50) as u64,
            cache_read_tokens: (i % 11 * 1000) as u64,
            output_tokens: (i % 500) as u64,
            status: UsageStatus::Completed,
            started_at: now,
            finished_at: now,
        })
        .collect()
}

/// Ledger ingest: `n` events through the meter (group commit, `ON CONFLICT DO NOTHING`),
/// `dup_percent` of them delivered a second time, vs `COPY` of the same rows into a table
/// without indexes or keys (the limit), on the same Postgres.
pub async fn ingest(
    url: &str,
    n: usize,
    producers: usize,
    dup_percent: usize,
) -> anyhow::Result<()> {
    let (pool, name, url) = scratch(url).await?;
    let evs = events(n);
    let dir = std::env::temp_dir().join(format!("cachet-bench-{}", uuid::Uuid::new_v4().simple()));
    let stop = tokio_util::sync::CancellationToken::new();
    let (meter, task) = Meter::start(
        pool.clone(),
        MeterConfig::with_spool(dir.join("spool.jsonl")),
        stop.clone(),
    )
    .await?;
    let dups = n * dup_percent / 100;
    let started = Instant::now();
    let per = n.div_ceil(producers.max(1));
    let mut tasks = Vec::new();
    for (p, chunk) in evs.chunks(per).enumerate() {
        let (m, mut chunk) = (meter.clone(), chunk.to_vec());
        // Duplicates (retries, spool replays) interleaved with first deliveries.
        let again: Vec<UsageEvent> = chunk
            .iter()
            .take(dups / producers.max(1))
            .cloned()
            .collect();
        chunk.extend(again);
        tasks.push(tokio::spawn(async move {
            for e in chunk {
                m.record(e)
                    .await
                    .map_err(|e| anyhow::anyhow!("producer {p}: {e}"))?;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    anyhow::ensure!(
        meter.settled(Duration::from_secs(600)).await,
        "the meter did not settle"
    );
    let meter_secs = started.elapsed().as_secs_f64();
    stop.cancel();
    task.await?;
    let rows = billing::synthetic::rows(&pool).await?;
    anyhow::ensure!(
        rows as usize == n,
        "ledger holds {rows} rows for {n} events"
    );

    // Rolling the ingested rows up (hourly and daily) keeps pace with ingest.
    let now = chrono::Utc::now();
    let started = Instant::now();
    let r = billing::rollup::rollup(
        &pool,
        now - chrono::TimeDelta::hours(2),
        now + chrono::TimeDelta::hours(1),
    )
    .await?;
    let rollup_secs = started.elapsed().as_secs_f64();

    // The same rows as CSV, COPYed into a table with no index or key.
    let (copied, copy_time) = billing::synthetic::copy_baseline(&pool, &evs).await?;
    let copy_secs = copy_time.as_secs_f64();
    anyhow::ensure!(copied as usize == n, "COPY took {copied} of {n} rows");

    let meter_rate = n as f64 / meter_secs;
    let copy_rate = n as f64 / copy_secs;
    println!(
        "meter\tevents={n}\tduplicates={dups}\tproducers={producers}\tseconds={meter_secs:.2}\tevents_per_s={meter_rate:.0}"
    );
    println!("copy\trows={n}\tseconds={copy_secs:.2}\trows_per_s={copy_rate:.0}");
    println!("meter/copy\t{:.1}%", 100.0 * meter_rate / copy_rate);
    println!(
        "rollup\trows={n}\tseconds={rollup_secs:.2}\trows_per_s={:.0}\thourly_rows={}\tdaily_rows={}",
        n as f64 / rollup_secs,
        r.hourly_rows,
        r.daily_rows
    );
    let _ = std::fs::remove_dir_all(&dir);
    drop_scratch(pool, &name, &url).await
}

/// A streamed CSV export of `rows` ledger rows through the finance API, read by a client in
/// the same process that counts the bytes and drops them; prints the process's peak RSS
/// during the export against its RSS before.
pub async fn export(url: &str, rows: usize) -> anyhow::Result<()> {
    let (pool, name, url) = scratch(url).await?;
    billing::synthetic::export_month(&pool, rows as i64).await?;
    let secret = "bench-secret-for-the-finance-api-token-0123456789";
    let jwt = identity::Jwt::new(secret.as_bytes())?;
    let token = jwt.issue(
        "bench",
        identity::Role::Finance,
        None,
        Duration::from_secs(3600),
    )?;
    let app = billing::api::router(billing::api::FinanceState {
        pool: pool.clone(),
        auth: identity::AdminAuth {
            sessions: std::sync::Arc::new(control::admin::login::SessionStore(pool.clone())),
            jwt: Some(std::sync::Arc::new(jwt)),
        },
        directory: std::sync::Arc::new(control::tenants::directory::Directory(pool.clone())),
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    let before = crate::rss_bytes()?;
    let peak = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(before));
    let sampler = {
        let peak = peak.clone();
        tokio::spawn(async move {
            loop {
                if let Ok(r) = crate::rss_bytes() {
                    peak.fetch_max(r, std::sync::atomic::Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let started = Instant::now();
    let resp = reqwest::Client::new()
        .get(format!(
            "http://{addr}/v1/billing/exports/usage?from=2026-10-01T00:00:00Z&to=2026-11-01T00:00:00Z&format=csv"
        ))
        .bearer_auth(token)
        .send()
        .await?;
    anyhow::ensure!(
        resp.status().is_success(),
        "export answered {}",
        resp.status()
    );
    let mut body = resp.bytes_stream();
    let (mut bytes, mut lines) = (0u64, 0u64);
    while let Some(chunk) = body.next().await {
        let chunk = chunk?;
        bytes += chunk.len() as u64;
        lines += chunk.iter().filter(|b| **b == b'\n').count() as u64;
    }
    let secs = started.elapsed().as_secs_f64();
    sampler.abort();
    server.abort();
    anyhow::ensure!(
        lines as usize == rows + 1,
        "{lines} lines for {rows} rows and a header"
    );
    let mb = |b: u64| b as f64 / (1 << 20) as f64;
    let peak = peak.load(std::sync::atomic::Ordering::Relaxed);
    println!(
        "export\trows={rows}\tbytes={bytes}\tseconds={secs:.2}\trows_per_s={:.0}\trss_before_mib={:.1}\trss_peak_mib={:.1}\trss_growth_mib={:.1}",
        rows as f64 / secs,
        mb(before),
        mb(peak),
        mb(peak.saturating_sub(before))
    );
    drop_scratch(pool, &name, &url).await
}
