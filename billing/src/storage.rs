//! Storage of cache objects, metered by the hour (migration 0009).
//!
//! A cache object (`POST /v1/caches`) is held whether it is read or not, so its holding is
//! billed by the token-hour, beside the write that made it. [`record`] turns a span of an
//! object's lifetime into rows of `cache_storage_events`: one per UTC hour of the span, with
//! the seconds of that hour it was held (a whole 3600, or less in the object's first and last
//! hour). The objects and how far each is metered are the control plane's
//! (`control::caches::meter`, which claims the spans that are due and calls [`record`] in
//! its own transaction): an hour is recorded once it has closed, an object's last, partial
//! hour once the object has ended. The row's key (object, hour) makes a second write of an
//! hour a no-op: a crash between the rows and the watermark, or a race, never bills it twice.
//!
//! A row's seconds are computed from the object's creation and end alone, never from when the
//! meter ran, so every run that writes an hour writes the same row. Seconds are whole (the
//! fraction of a second an object lives in its first or last hour is not billed).
//!
//! Rating is [`crate::invoice`]'s (storage lines) and [`crate::dashboard`]'s (the storage
//! cost of each hour); [`crate::rollup::reconcile`] checks invoices against these rows.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::invoice::BillingError;

/// A span of a cache object's lifetime to record: `[from, upto)`, within its life
/// `[created_at, ends_at)`.
#[derive(Clone, Debug, sqlx::FromRow)]
pub struct Held {
    pub object_id: String,
    pub tenant_id: Uuid,
    pub workspace_id: Uuid,
    pub api_key_id: Uuid,
    pub model: String,
    /// The object's tokens (what each of its seconds is billed on).
    pub tokens: i64,
    pub created_at: DateTime<Utc>,
    pub ends_at: DateTime<Utc>,
    /// Where the span starts: how far the object was metered before (its creation at first).
    pub from: DateTime<Utc>,
    /// Where it ends: the object's end once that has passed, else the last whole hour.
    pub upto: DateTime<Utc>,
}

/// Record the hours of each span in `held` (inside the caller's transaction); the rows
/// written (hours already written by another run are not counted).
pub async fn record(tx: &mut sqlx::PgConnection, held: &[Held]) -> Result<u64, BillingError> {
    if held.is_empty() {
        return Ok(0);
    }
    let written: i64 = sqlx::query_scalar(
        r#"
        WITH held AS (
            SELECT * FROM unnest($1::TEXT[], $2::UUID[], $3::UUID[], $4::UUID[], $5::TEXT[],
                                 $6::BIGINT[], $7::TIMESTAMPTZ[], $8::TIMESTAMPTZ[],
                                 $9::TIMESTAMPTZ[], $10::TIMESTAMPTZ[])
                AS d(id, tenant_id, workspace_id, api_key_id, model, tokens, created_at, ends_at,
                     metered, upto)
        ),
        hours AS (
            SELECT d.id, h AS hour_start, d.tenant_id, d.workspace_id, d.api_key_id, d.model,
                   d.tokens,
                   floor(extract(epoch FROM least(h + interval '1 hour', d.ends_at)
                                           - greatest(h, d.created_at)))::INTEGER AS seconds
            FROM held d,
                 generate_series(date_trunc('hour', d.metered, 'UTC'),
                                 d.upto - interval '1 microsecond',
                                 interval '1 hour') AS h
        ),
        written AS (
            INSERT INTO cache_storage_events (object_id, hour_start, tenant_id, workspace_id,
                                              api_key_id, model, tokens, seconds)
            SELECT id, hour_start, tenant_id, workspace_id, api_key_id, model, tokens, seconds
            FROM hours WHERE seconds >= 1
            ON CONFLICT DO NOTHING
            RETURNING 1
        )
        SELECT count(*) FROM written
        "#,
    )
    .bind(
        held.iter()
            .map(|h| h.object_id.as_str())
            .collect::<Vec<_>>(),
    )
    .bind(held.iter().map(|h| h.tenant_id).collect::<Vec<_>>())
    .bind(held.iter().map(|h| h.workspace_id).collect::<Vec<_>>())
    .bind(held.iter().map(|h| h.api_key_id).collect::<Vec<_>>())
    .bind(held.iter().map(|h| h.model.as_str()).collect::<Vec<_>>())
    .bind(held.iter().map(|h| h.tokens).collect::<Vec<_>>())
    .bind(held.iter().map(|h| h.created_at).collect::<Vec<_>>())
    .bind(held.iter().map(|h| h.ends_at).collect::<Vec<_>>())
    .bind(held.iter().map(|h| h.from).collect::<Vec<_>>())
    .bind(held.iter().map(|h| h.upto).collect::<Vec<_>>())
    .fetch_one(&mut *tx)
    .await?;
    crate::metrics::STORAGE_ROWS.inc_by(written as u64);
    Ok(written as u64)
}
