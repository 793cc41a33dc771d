//! What the request path refused or could not keep, counted per tenant and hour for the
//! console: requests refused at admission (per key and limit), and cache writes the fabric did
//! not hold (per reason). Gateways add their counts every few seconds (the change feed's loop).

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{PgPool, Row};
use utoipa::ToSchema;
use uuid::Uuid;

use super::AdminError;

/// One hour's refusals by the request path's admission, per tenant, key and limit.
pub struct Refusal {
    pub tenant: Uuid,
    pub key: Uuid,
    pub limit: &'static str,
    pub count: u64,
}

/// Add `refusals` to the counts of the hour starting at `hour` (what the admin views show as
/// refusals by limit).
pub async fn record_refusals(
    pool: &PgPool,
    hour: DateTime<Utc>,
    refusals: &[Refusal],
) -> Result<(), AdminError> {
    let tenants: Vec<Uuid> = refusals.iter().map(|r| r.tenant).collect();
    let keys: Vec<Uuid> = refusals.iter().map(|r| r.key).collect();
    let limits: Vec<&str> = refusals.iter().map(|r| r.limit).collect();
    let counts: Vec<i64> = refusals
        .iter()
        .map(|r| i64::try_from(r.count).unwrap_or(i64::MAX))
        .collect();
    sqlx::query(
        "INSERT INTO admission_refusals (tenant_id, bucket_start, api_key_id, limit_name, refusals) \
         SELECT t, $1, k, l, n FROM UNNEST($2::UUID[], $3::UUID[], $4::TEXT[], $5::BIGINT[]) AS u(t, k, l, n) \
         ON CONFLICT (tenant_id, bucket_start, limit_name, api_key_id) \
         DO UPDATE SET refusals = admission_refusals.refusals + EXCLUDED.refusals",
    )
    .bind(hour)
    .bind(&tenants)
    .bind(&keys)
    .bind(&limits)
    .bind(&counts)
    .execute(pool)
    .await?;
    Ok(())
}

/// One hour's cache writes the fabric did not hold, per tenant and reason.
pub struct NotHeld {
    pub tenant: Uuid,
    /// `quota`, `capacity`, `not_admitted`, `unavailable`, `kv_budget`, …
    pub reason: &'static str,
    pub breakpoints: u64,
    /// The prompt tokens those breakpoints would have written (billed at the next written
    /// breakpoint's rate instead, or as plain input).
    pub tokens: u64,
}

/// Add `not_held` to the counts of the hour starting at `hour`.
pub async fn record_not_held(
    pool: &PgPool,
    hour: DateTime<Utc>,
    not_held: &[NotHeld],
) -> Result<(), AdminError> {
    let big = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    let tenants: Vec<Uuid> = not_held.iter().map(|r| r.tenant).collect();
    let reasons: Vec<&str> = not_held.iter().map(|r| r.reason).collect();
    let breakpoints: Vec<i64> = not_held.iter().map(|r| big(r.breakpoints)).collect();
    let tokens: Vec<i64> = not_held.iter().map(|r| big(r.tokens)).collect();
    sqlx::query(
        "INSERT INTO cache_writes_not_held (tenant_id, bucket_start, reason, breakpoints, tokens) \
         SELECT t, $1, r, b, n FROM UNNEST($2::UUID[], $3::TEXT[], $4::BIGINT[], $5::BIGINT[]) AS u(t, r, b, n) \
         ON CONFLICT (tenant_id, bucket_start, reason) DO UPDATE SET \
         breakpoints = cache_writes_not_held.breakpoints + EXCLUDED.breakpoints, \
         tokens = cache_writes_not_held.tokens + EXCLUDED.tokens",
    )
    .bind(hour)
    .bind(&tenants)
    .bind(&reasons)
    .bind(&breakpoints)
    .bind(&tokens)
    .execute(pool)
    .await?;
    Ok(())
}

/// Cache writes not held for one reason over a range.
#[derive(Clone, Debug, Serialize, ToSchema, PartialEq, Eq)]
pub struct NotHeldCount {
    /// `quota` (the tenant's resident-bytes quota could not hold the entry), `capacity`
    /// (the nodes were full), `not_admitted` (best-effort automatic caching ranked it below
    /// what it would displace), `unavailable` (no owner reachable), `kv_budget`, …
    pub reason: String,
    pub breakpoints: i64,
    /// Prompt tokens these breakpoints would have written (billed at the next written
    /// breakpoint's rate instead, or as plain input).
    pub tokens: i64,
}

/// A tenant's cache writes not held in the hours from `from` to `to`, most breakpoints first.
pub async fn not_held(
    pool: &PgPool,
    tenant: Uuid,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> Result<Vec<NotHeldCount>, AdminError> {
    let rows = sqlx::query(
        "SELECT reason, sum(breakpoints)::BIGINT AS b, sum(tokens)::BIGINT AS n \
         FROM cache_writes_not_held WHERE tenant_id = $1 AND bucket_start >= date_trunc('hour', $2::TIMESTAMPTZ) \
         AND bucket_start < $3 GROUP BY reason ORDER BY b DESC, reason",
    )
    .bind(tenant)
    .bind(from)
    .bind(to)
    .fetch_all(pool)
    .await?;
    Ok(rows
        .iter()
        .map(|r| NotHeldCount {
            reason: r.get("reason"),
            breakpoints: r.get("b"),
            tokens: r.get("n"),
        })
        .collect())
}
