//! Synthetic ledgers and raw ledger reads, for the benchmarks (`cachet loadtest ledger …`)
//! on their scratch databases.
//!
//! The ledger's tables are this crate's, so what a benchmark writes into them in bulk, and the
//! raw reads it compares the product's answers against, are written here, beside the schema
//! they depend on, not in the benchmark.

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use uuid::Uuid;

use crate::invoice::BillingError;

/// A key a synthetic ledger charges: its tenant's index, its own index within the tenant, and
/// its ids.
#[derive(Clone, Copy, Debug)]
pub struct SyntheticKey {
    pub tenant_index: i32,
    pub key_index: i32,
    pub tenant: Uuid,
    pub workspace: Uuid,
    pub key: Uuid,
}

/// `rows` ledger rows over the last `days` days, generated in Postgres: the tenants of `keys`
/// (by index) get a share ∝ the square of a uniform draw (the lowest indexes most); each
/// tenant's keys (as many for every tenant) and the two `sim-llama` models (80/20) uniformly.
pub async fn ledger(
    pool: &PgPool,
    keys: &[SyntheticKey],
    rows: i64,
    days: i32,
) -> Result<u64, BillingError> {
    let tenants = keys.iter().map(|k| k.tenant_index + 1).max().unwrap_or(0);
    let keys_per_tenant = keys.iter().map(|k| k.key_index + 1).max().unwrap_or(0);
    let done = sqlx::query(
        "INSERT INTO usage_events (request_id, tenant_id, workspace_id, api_key_id, model, input_tokens, \
         cache_write_5m_tokens, cache_write_1h_tokens, cache_read_tokens, output_tokens, status, started_at, finished_at) \
         SELECT gen_random_uuid(), k.tenant, k.ws, k.key, \
                CASE WHEN r.m < 0.8 THEN 'sim-llama-8b' ELSE 'sim-llama-70b' END, \
                (r.a * 2000)::BIGINT, (r.b * 800)::BIGINT, CASE WHEN r.b > 0.9 THEN 500 ELSE 0 END, \
                (r.c * 6000)::BIGINT, (r.a * 400)::BIGINT, 'completed', r.at, r.at + interval '2 seconds' \
         FROM (SELECT floor(power(random(), 2) * $2)::INT AS ti, floor(random() * $4)::INT AS ki, \
                      random() AS m, random() AS a, random() AS b, random() AS c, \
                      now() - random() * make_interval(days => $3) AS at \
               FROM generate_series(1, $1)) r \
         JOIN unnest($5::INT[], $6::INT[], $7::UUID[], $8::UUID[], $9::UUID[]) AS k(ti, ki, tenant, ws, key) \
           ON k.ti = r.ti AND k.ki = r.ki",
    )
    .bind(rows)
    .bind(tenants)
    .bind(days)
    .bind(keys_per_tenant)
    .bind(keys.iter().map(|k| k.tenant_index).collect::<Vec<_>>())
    .bind(keys.iter().map(|k| k.key_index).collect::<Vec<_>>())
    .bind(keys.iter().map(|k| k.tenant).collect::<Vec<_>>())
    .bind(keys.iter().map(|k| k.workspace).collect::<Vec<_>>())
    .bind(keys.iter().map(|k| k.key).collect::<Vec<_>>())
    .execute(pool)
    .await?;
    Ok(done.rows_affected())
}

/// `rows` ledger rows in October 2026 (one a second, wrapping), over 50 tenants with no other
/// rows: what an export of a month streams.
pub async fn export_month(pool: &PgPool, rows: i64) -> Result<u64, BillingError> {
    let done = sqlx::query(
        r#"INSERT INTO usage_events (request_id, tenant_id, workspace_id, api_key_id, model,
             input_tokens, cache_write_5m_tokens, cache_write_1h_tokens, cache_read_tokens,
             output_tokens, status, started_at, finished_at)
           SELECT gen_random_uuid(), md5('tenant' || i % 50)::UUID, md5('ws' || i % 50)::UUID,
                  md5('key' || i % 250)::UUID,
                  'sim-llama-8b', i % 4000, i % 700, i % 150, i % 11000, i % 500, 'completed',
                  '2026-10-01T00:00:00Z'::TIMESTAMPTZ + (i % 2592000) * INTERVAL '1 second',
                  '2026-10-01T00:00:00Z'::TIMESTAMPTZ + (i % 2592000) * INTERVAL '1 second'
           FROM generate_series(1, $1) AS i"#,
    )
    .bind(rows)
    .execute(pool)
    .await?;
    Ok(done.rows_affected())
}

/// Refresh the planner's statistics of the ledger after a bulk load (which would otherwise
/// leave autovacuum work to run during a timing).
pub async fn analyze_ledger(pool: &PgPool) -> Result<(), BillingError> {
    sqlx::query("VACUUM (ANALYZE) usage_events")
        .execute(pool)
        .await?;
    Ok(())
}

/// The same for the rollups, after rolling a bulk load up.
pub async fn analyze_rollups(pool: &PgPool) -> Result<(), BillingError> {
    sqlx::query("VACUUM (ANALYZE) usage_rollups")
        .execute(pool)
        .await?;
    Ok(())
}

/// The tenant with the most requests in the daily rollups.
pub async fn busiest_tenant(pool: &PgPool) -> Result<Option<Uuid>, BillingError> {
    Ok(sqlx::query_scalar(
        "SELECT tenant_id FROM usage_rollups WHERE granularity = 'day' GROUP BY 1 \
         ORDER BY sum(requests) DESC LIMIT 1",
    )
    .fetch_optional(pool)
    .await?)
}

/// Rows in the ledger.
pub async fn rows(pool: &PgPool) -> Result<i64, BillingError> {
    Ok(sqlx::query_scalar("SELECT count(*) FROM usage_events")
        .fetch_one(pool)
        .await?)
}

/// `tenant`'s requests, uncached input tokens and cache reads straight from the ledger, over
/// the whole hours covering `[from, to]`.
pub async fn ledger_totals(
    pool: &PgPool,
    tenant: Uuid,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> Result<(i64, i64, i64), BillingError> {
    Ok(sqlx::query_as(
        "SELECT count(*)::BIGINT, coalesce(sum(input_tokens), 0)::BIGINT, \
                coalesce(sum(cache_read_tokens), 0)::BIGINT \
         FROM usage_events WHERE tenant_id = $1 AND started_at >= date_trunc('hour', $2::TIMESTAMPTZ) \
         AND started_at < date_trunc('hour', $3::TIMESTAMPTZ) + interval '1 hour'",
    )
    .bind(tenant)
    .bind(from)
    .bind(to)
    .fetch_one(pool)
    .await?)
}

/// `tenant`'s daily totals by model over `[from, to)` straight from the ledger (the baseline a
/// usage report from the rollups is timed against): the groups read.
pub async fn daily_by_model(
    pool: &PgPool,
    tenant: Uuid,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> Result<usize, BillingError> {
    Ok(sqlx::query(
        "SELECT date_trunc('day', started_at, 'UTC') AS d, model, count(*), sum(input_tokens), \
         sum(cache_write_5m_tokens), sum(cache_write_1h_tokens), sum(cache_read_tokens), \
         sum(output_tokens) FROM usage_events \
         WHERE tenant_id = $1 AND started_at >= $2 AND started_at < $3 GROUP BY 1, 2",
    )
    .bind(tenant)
    .bind(from)
    .bind(to)
    .fetch_all(pool)
    .await?
    .len())
}

/// The limit an ingest is compared with: `events` written as CSV and `COPY`ed into a new table
/// shaped like the ledger with no index or key (`bench_copy`). Returns the rows copied and how
/// long the `COPY` alone took.
pub async fn copy_baseline(
    pool: &PgPool,
    events: &[crate::UsageEvent],
) -> Result<(u64, std::time::Duration), BillingError> {
    use std::io::Write;
    sqlx::query("CREATE TABLE bench_copy (LIKE usage_events INCLUDING DEFAULTS)")
        .execute(pool)
        .await?;
    let mut csv = Vec::with_capacity(events.len() * 200);
    for e in events {
        let _ = writeln!(
            csv,
            "{},{},{},{},{},{},{},{},{},{},{},{},{}",
            e.request_id.0,
            e.tenant_id.as_uuid(),
            e.workspace_id.as_uuid(),
            e.api_key_id.as_uuid(),
            crate::csv::field(&e.model),
            e.input_tokens,
            e.cache_write_5m_tokens,
            e.cache_write_1h_tokens,
            e.cache_read_tokens,
            e.output_tokens,
            e.status.as_str(),
            e.started_at.to_rfc3339(),
            e.finished_at.to_rfc3339()
        );
    }
    let mut conn = pool.acquire().await?;
    let started = std::time::Instant::now();
    let mut copy = conn
        .copy_in_raw(
            "COPY bench_copy (request_id, tenant_id, workspace_id, api_key_id, model, input_tokens, \
             cache_write_5m_tokens, cache_write_1h_tokens, cache_read_tokens, output_tokens, status, \
             started_at, finished_at) FROM STDIN WITH (FORMAT csv)",
        )
        .await?;
    for chunk in csv.chunks(1 << 20) {
        copy.send(chunk).await?;
    }
    let rows = copy.finish().await?;
    Ok((rows, started.elapsed()))
}
