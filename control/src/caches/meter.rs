//! The storage meter of cache objects: how far each object's holding is billed.
//!
//! Each object carries how far it is metered (`storage_metered_until`), so a run reads only
//! what is due: every hour that has closed, and an object's last, partial hour once it has
//! ended (deleted, purged, its tenant deleted, or expired). A run claims due objects with
//! `FOR UPDATE SKIP LOCKED` (several processes metering at once never wait on each other),
//! hands their spans to billing ([`billing::storage::record`], which owns the storage ledger
//! and the rule that turns a span into hourly rows) and moves their watermarks, in one
//! transaction per batch: a failed run changes nothing and is retried at the next tick.

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use crate::tenants::AdminError;

/// What one [`meter`] run did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MeterReport {
    /// Objects whose metering moved forward.
    pub objects: u64,
    /// Rows written (hours already written by another run are not counted).
    pub rows: u64,
}

/// Objects claimed by one transaction: bounds a run's transaction.
const BATCH: i64 = 500;

/// Meter the storage of every object up to `now`: every hour that has closed by `now`, and
/// the last hour of each object that has ended by then.
pub async fn meter(pool: &PgPool, now: DateTime<Utc>) -> Result<MeterReport, AdminError> {
    let mut report = MeterReport::default();
    loop {
        let mut tx = pool.begin().await?;
        // An object's end: its expiry, or its deletion if that came first. It is metered up
        // to its end once that has passed, else to the last whole hour before `now`.
        let due: Vec<billing::storage::Held> = sqlx::query_as(
            r#"
            SELECT id AS object_id, tenant_id, workspace_id, api_key_id, model,
                   input_tokens AS tokens, created_at, ends_at, metered AS "from", upto
            FROM (
                SELECT *, least(expires_at, coalesce(deleted_at, 'infinity')) AS ends_at,
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
            ) o
            "#,
        )
        .bind(now)
        .bind(BATCH)
        .fetch_all(&mut *tx)
        .await?;
        let rows = billing::storage::record(&mut tx, &due).await?;
        let ids: Vec<&str> = due.iter().map(|d| d.object_id.as_str()).collect();
        let upto: Vec<DateTime<Utc>> = due.iter().map(|d| d.upto).collect();
        sqlx::query(
            "UPDATE cache_objects o SET storage_metered_until = d.upto \
             FROM unnest($1::TEXT[], $2::TIMESTAMPTZ[]) AS d(id, upto) WHERE o.id = d.id",
        )
        .bind(&ids)
        .bind(&upto)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        report.objects += due.len() as u64;
        report.rows += rows;
        if (due.len() as i64) < BATCH {
            return Ok(report);
        }
    }
}

/// Keep the storage ledger current: meter every `every` until `stop`. A failed run changes
/// nothing (one transaction per batch) and is retried at the next tick.
pub async fn keep_metered(
    pool: PgPool,
    every: std::time::Duration,
    stop: tokio_util::sync::CancellationToken,
) {
    let mut tick = cachet_common::tick::Ticker::new(every, stop);
    while tick.next().await {
        match meter(&pool, Utc::now()).await {
            Ok(r) if r.rows > 0 => {
                tracing::debug!(objects = r.objects, rows = r.rows, "cache storage metered")
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e, "metering cache storage failed; retrying at the next tick")
            }
        }
    }
}
