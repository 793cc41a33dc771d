//! Usage rollups and reconciliation.
//!
//! [`rollup`] derives hourly and daily totals per tenant × model × API key from the ledger.
//! It recomputes whole buckets: every hour and day touching the window is deleted and
//! re-inserted from `usage_events` in one transaction, so running it twice, or after a crash
//! halfway, gives the same rows.
//!
//! [`reconcile`] proves, per tenant and token class, that the ledger, the hourly rollups,
//! the daily rollups and the usage lines of stored invoices agree over a window of whole
//! days, and that the storage ledger of cache objects (token-seconds, [`crate::storage`])
//! agrees with the invoices' storage lines; anything else is a [`Mismatch`].

use std::collections::BTreeMap;
use std::fmt;

use chrono::{DateTime, DurationRound, TimeDelta, Utc};
use sqlx::{PgPool, Row};
use uuid::Uuid;

use crate::invoice::{BillingError, STORAGE_CLASS, month_bounds};
use crate::money::TokenClass;

/// A half-open interval of time.
type Window = (DateTime<Utc>, DateTime<Utc>);

/// Hours and days (UTC) covering `[from, to)`: the buckets a recomputation replaces.
fn covering(from: DateTime<Utc>, to: DateTime<Utc>) -> Result<[Window; 2], BillingError> {
    let trunc = |t: DateTime<Utc>, d: TimeDelta| {
        t.duration_trunc(d)
            .map_err(|e| BillingError::Invalid(format!("time {t}: {e}")))
    };
    let (h, d) = (TimeDelta::hours(1), TimeDelta::days(1));
    let up = |t: DateTime<Utc>, step: TimeDelta| -> Result<DateTime<Utc>, BillingError> {
        let f = trunc(t, step)?;
        Ok(if f == t { t } else { f + step })
    };
    Ok([(trunc(from, h)?, up(to, h)?), (trunc(from, d)?, up(to, d)?)])
}

/// Rows written by a rollup run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RollupReport {
    pub hourly_rows: u64,
    pub daily_rows: u64,
}

/// Recompute the hourly and daily rollups of every bucket touching `[from, to)`.
pub async fn rollup(
    pool: &PgPool,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> Result<RollupReport, BillingError> {
    if to <= from {
        return Err(BillingError::Invalid(format!(
            "empty window {from} .. {to}"
        )));
    }
    let [(h0, h1), (d0, d1)] = covering(from, to)?;
    let mut tx = pool.begin().await?;
    // Two runs over overlapping windows serialize instead of interleaving.
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('usage_rollups', 0))")
        .execute(&mut *tx)
        .await?;
    let mut report = RollupReport::default();
    for (granularity, lo, hi) in [("hour", h0, h1), ("day", d0, d1)] {
        sqlx::query(
            "DELETE FROM usage_rollups WHERE granularity = $1 AND bucket_start >= $2 AND bucket_start < $3",
        )
        .bind(granularity)
        .bind(lo)
        .bind(hi)
        .execute(&mut *tx)
        .await?;
        let n = sqlx::query(
            r#"
            INSERT INTO usage_rollups (granularity, bucket_start, tenant_id, model, api_key_id,
                requests, input_tokens, cache_write_5m_tokens, cache_write_1h_tokens,
                cache_read_tokens, output_tokens)
            SELECT $1, date_trunc($1, started_at, 'UTC'), tenant_id, model, api_key_id,
                   count(*), sum(input_tokens), sum(cache_write_5m_tokens),
                   sum(cache_write_1h_tokens), sum(cache_read_tokens), sum(output_tokens)
            FROM usage_events
            WHERE started_at >= $2 AND started_at < $3
            GROUP BY 2, 3, 4, 5
            "#,
        )
        .bind(granularity)
        .bind(lo)
        .bind(hi)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if granularity == "hour" {
            report.hourly_rows = n;
        } else {
            report.daily_rows = n;
        }
    }
    tx.commit().await?;
    Ok(report)
}

/// Token totals per tenant and class, from one source.
pub type Totals = BTreeMap<(Uuid, TokenClass), i64>;

/// A disagreement found by [`reconcile`]: `source` (hourly rollups, daily rollups, or one
/// month's invoice) says `found` tokens of a class (a [`TokenClass`], or
/// [`STORAGE_CLASS`]'s token-seconds) where the ledger says `ledger`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mismatch {
    pub tenant: Uuid,
    pub class: &'static str,
    pub source: String,
    pub ledger: i64,
    pub found: i64,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "tenant {} {:<15} {:<20} ledger {:>14}  found {:>14}  diff {:>+14}",
            self.tenant,
            self.class,
            self.source,
            self.ledger,
            self.found,
            self.found - self.ledger
        )
    }
}

/// The outcome of a reconciliation.
#[derive(Clone, Debug, Default)]
pub struct Reconciliation {
    pub tenants: usize,
    pub invoices: usize,
    pub ledger: Totals,
    pub mismatches: Vec<Mismatch>,
}

/// The five token sums, in [`TokenClass::ALL`] order.
macro_rules! sums {
    () => {
        "sum(input_tokens)::BIGINT, sum(cache_write_5m_tokens)::BIGINT, \
         sum(cache_write_1h_tokens)::BIGINT, sum(cache_read_tokens)::BIGINT, \
         sum(output_tokens)::BIGINT"
    };
}

/// Rows of (tenant, five sums) → totals.
fn totals(rows: Vec<sqlx::postgres::PgRow>) -> Totals {
    let mut t = Totals::new();
    for r in rows {
        let tenant: Uuid = r.get(0);
        for (i, class) in TokenClass::ALL.into_iter().enumerate() {
            let v: Option<i64> = r.get(i + 1);
            *t.entry((tenant, class)).or_default() += v.unwrap_or(0);
        }
    }
    t
}

async fn ledger_totals(
    pool: &PgPool,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> Result<Totals, BillingError> {
    Ok(totals(
        sqlx::query(concat!(
            "SELECT tenant_id, ",
            sums!(),
            " FROM usage_events WHERE started_at >= $1 AND started_at < $2 GROUP BY 1"
        ))
        .bind(from)
        .bind(to)
        .fetch_all(pool)
        .await?,
    ))
}

fn compare(
    out: &mut Vec<Mismatch>,
    source: &str,
    ledger: &Totals,
    other: &Totals,
    tenants: &[Uuid],
) {
    for &tenant in tenants {
        for class in TokenClass::ALL {
            let l = ledger.get(&(tenant, class)).copied().unwrap_or(0);
            let o = other.get(&(tenant, class)).copied().unwrap_or(0);
            if l != o {
                out.push(Mismatch {
                    tenant,
                    class: class.as_str(),
                    source: source.to_string(),
                    ledger: l,
                    found: o,
                });
            }
        }
    }
}

/// Compare the ledger with the hourly and daily rollups over `[from, to)` (whole UTC days),
/// and each stored invoice of a month wholly inside the window with the ledger over that
/// month.
pub async fn reconcile(
    pool: &PgPool,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> Result<Reconciliation, BillingError> {
    let [_, (d0, d1)] = covering(from, to)?;
    if d0 != from || d1 != to || to <= from {
        return Err(BillingError::Invalid(
            "reconcile a non-empty window of whole UTC days (YYYY-MM-DD .. YYYY-MM-DD)".into(),
        ));
    }
    let ledger = ledger_totals(pool, from, to).await?;
    let rollups = |g: &'static str| {
        sqlx::query(concat!(
            "SELECT tenant_id, ",
            sums!(),
            " FROM usage_rollups WHERE granularity = $3 AND bucket_start >= $1 AND bucket_start < $2 GROUP BY 1"
        ))
        .bind(from)
        .bind(to)
        .bind(g)
        .fetch_all(pool)
    };
    let hourly = totals(rollups("hour").await?);
    let daily = totals(rollups("day").await?);
    let mut tenants: Vec<Uuid> = ledger
        .keys()
        .chain(hourly.keys())
        .chain(daily.keys())
        .map(|k| k.0)
        .collect();
    tenants.sort();
    tenants.dedup();
    let mut mismatches = Vec::new();
    compare(
        &mut mismatches,
        "hourly rollups",
        &ledger,
        &hourly,
        &tenants,
    );
    compare(&mut mismatches, "daily rollups", &ledger, &daily, &tenants);

    let invoices: Vec<(Uuid, Uuid, chrono::NaiveDate)> = sqlx::query_as(
        "SELECT id, tenant_id, period_start FROM invoices WHERE period_start >= $1::DATE AND period_start < $2::DATE ORDER BY period_start, tenant_id",
    )
    .bind(from.date_naive())
    .bind(to.date_naive())
    .fetch_all(pool)
    .await?;
    let mut checked = 0;
    for (id, tenant, month) in invoices {
        let (m0, m1) = month_bounds(month)?;
        if m1 > to {
            continue;
        }
        checked += 1;
        let month_ledger = ledger_totals(pool, m0, m1).await?;
        let mut lines = Totals::new();
        for r in sqlx::query(
            "SELECT token_class, sum(quantity)::BIGINT AS q FROM invoice_lines WHERE invoice_id = $1 AND kind = 'usage' GROUP BY 1",
        )
        .bind(id)
        .fetch_all(pool)
        .await?
        {
            if let Some(class) = TokenClass::parse(&r.get::<String, _>("token_class")) {
                lines.insert((tenant, class), r.get("q"));
            }
        }
        let source = format!("invoice {}", month.format("%Y-%m"));
        compare(&mut mismatches, &source, &month_ledger, &lines, &[tenant]);
        // Storage: the ledger's token-seconds of the month against the storage lines.
        let (held, billed): (i64, i64) = sqlx::query_as(
            "SELECT (SELECT coalesce(sum(tokens * seconds), 0)::BIGINT FROM cache_storage_events \
                     WHERE tenant_id = $2 AND hour_start >= $3 AND hour_start < $4), \
                    (SELECT coalesce(sum(quantity), 0)::BIGINT FROM invoice_lines \
                     WHERE invoice_id = $1 AND kind = 'storage')",
        )
        .bind(id)
        .bind(tenant)
        .bind(m0)
        .bind(m1)
        .fetch_one(pool)
        .await?;
        if held != billed {
            mismatches.push(Mismatch {
                tenant,
                class: STORAGE_CLASS,
                source,
                ledger: held,
                found: billed,
            });
        }
    }
    Ok(Reconciliation {
        tenants: tenants.len(),
        invoices: checked,
        ledger,
        mismatches,
    })
}

/// Keep the rollups current: every `every`, recompute the buckets of the last `lookback`
/// (late rows from a spool replay land inside it), until `stop`. Failures are logged and
/// retried at the next tick; a failed run changes nothing (one transaction).
pub async fn keep_current(
    pool: PgPool,
    every: std::time::Duration,
    lookback: TimeDelta,
    stop: tokio_util::sync::CancellationToken,
) {
    let mut tick = cachet_common::tick::Ticker::new(every, stop);
    while tick.next().await {
        let now = Utc::now();
        let started = std::time::Instant::now();
        match rollup(&pool, now - lookback, now).await {
            Ok(r) => {
                crate::metrics::ROLLUP_SECONDS.observe(started.elapsed().as_secs_f64());
                tracing::debug!(
                    hourly = r.hourly_rows,
                    daily = r.daily_rows,
                    "rollups refreshed"
                );
            }
            Err(e) => {
                tracing::warn!(error = %e, "refreshing the rollups failed; retrying at the next tick")
            }
        }
    }
}
