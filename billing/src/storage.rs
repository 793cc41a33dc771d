//! Storage of cache objects, metered by the hour (migration 0009).
//!
//! A cache object (`POST /v1/caches`) is held whether it is read or not, so its holding is
//! billed by the token-hour, beside the write that made it. [`meter`] turns each object's
//! lifetime into rows of `cache_storage_events`: one per UTC hour it was held, with the
//! seconds of that hour (a whole 3600, or less in its first and last hour). An hour is
//! written once it has closed; an object's last, partial hour once the object has ended
//! (deleted, purged, its tenant deleted, or expired). Each object carries how far it is
//! metered (`storage_metered_until`), so a run reads only what is due, and rows of one
//! object are claimed with `FOR UPDATE SKIP LOCKED`, so several processes metering at once
//! never wait on each other. The row's key (object, hour) makes a second write of an hour a
//! no-op: a crash between the insert and the watermark, or a race, never bills it twice.
//!
//! A row's seconds are computed from the object's creation and end alone, never from when the
//! meter ran, so every run that writes an hour writes the same row. Seconds are whole (the
//! fraction of a second an object lives in its first or last hour is not billed).
//!
//! Rating is [`crate::invoice`]'s (storage lines) and [`crate::dashboard`]'s (the storage
//! cost of each hour); [`crate::rollup::reconcile`] checks invoices against these rows.

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use crate::invoice::BillingError;

/// What one [`meter`] run did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MeterReport {
    /// Objects whose metering moved forward.
    pub objects: u64,
    /// Rows written (hours already written by another run are not counted).
    pub rows: u64,
}

/// Objects claimed by one statement: bounds a run's transaction.
const BATCH: i64 = 500;

/// Meter the storage of every object up to `now`: every hour that has closed by `now`, and
/// the last hour of each object that has ended by then.
pub async fn meter(pool: &PgPool, now: DateTime<Utc>) -> Result<MeterReport, BillingError> {
    let mut report = MeterReport::default();
    loop {
        // An object's end: its expiry, or its deletion if that came first. It is metered up
        // to its end once that has passed, else to the last whole hour before `now`.
        let (objects, rows): (i64, i64) = sqlx::query_as(
            r#"
            WITH due AS (
                SELECT id, tenant_id, workspace_id, api_key_id, model, input_tokens, created_at,
                       least(expires_at, coalesce(deleted_at, 'infinity')) AS ends_at,
                       coalesce(storage_metered_until, created_at) AS metered,
                       CASE WHEN least(expires_at, coalesce(deleted_at, 'infinity')) <= $1
                            THEN least(expires_at, coalesce(deleted_at, 'infinity'))
                            ELSE date_trunc('hour', $1, 'UTC') END AS upto
                FROM cache_objects
                WHERE (storage_metered_until IS NULL
                       OR storage_metered_until < least(expires_at, coalesce(deleted_at, 'infinity')))
                  AND coalesce(storage_metered_until, created_at) <
                      CASE WHEN least(expires_at, coalesce(deleted_at, 'infinity')) <= $1
                           THEN least(expires_at, coalesce(deleted_at, 'infinity'))
                           ELSE date_trunc('hour', $1, 'UTC') END
                ORDER BY coalesce(storage_metered_until, created_at)
                LIMIT $2
                FOR UPDATE SKIP LOCKED
            ),
            hours AS (
                SELECT d.id, h AS hour_start, d.tenant_id, d.workspace_id, d.api_key_id, d.model,
                       d.input_tokens,
                       floor(extract(epoch FROM least(h + interval '1 hour', d.ends_at)
                                               - greatest(h, d.created_at)))::INTEGER AS seconds
                FROM due d,
                     generate_series(date_trunc('hour', d.metered, 'UTC'),
                                     d.upto - interval '1 microsecond',
                                     interval '1 hour') AS h
            ),
            written AS (
                INSERT INTO cache_storage_events (object_id, hour_start, tenant_id, workspace_id,
                                                  api_key_id, model, tokens, seconds)
                SELECT id, hour_start, tenant_id, workspace_id, api_key_id, model, input_tokens,
                       seconds
                FROM hours WHERE seconds >= 1
                ON CONFLICT DO NOTHING
                RETURNING 1
            ),
            moved AS (
                UPDATE cache_objects o SET storage_metered_until = d.upto
                FROM due d WHERE o.id = d.id
                RETURNING 1
            )
            SELECT (SELECT count(*) FROM moved), (SELECT count(*) FROM written)
            "#,
        )
        .bind(now)
        .bind(BATCH)
        .fetch_one(pool)
        .await?;
        report.objects += objects as u64;
        report.rows += rows as u64;
        crate::metrics::STORAGE_ROWS.inc_by(rows as u64);
        if objects < BATCH {
            return Ok(report);
        }
    }
}

/// Keep the storage ledger current: meter every `every` until `stop`. A failed run changes
/// nothing (one statement per batch) and is retried at the next tick.
pub async fn keep_metered(
    pool: PgPool,
    every: std::time::Duration,
    stop: tokio_util::sync::CancellationToken,
) {
    crate::each_tick(every, stop, || async {
        match meter(&pool, Utc::now()).await {
            Ok(r) if r.rows > 0 => {
                tracing::debug!(objects = r.objects, rows = r.rows, "cache storage metered")
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e, "metering cache storage failed; retrying at the next tick")
            }
        }
    })
    .await
}
