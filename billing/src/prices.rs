//! The price book: versioned list prices per model, tenant custom rates, tenant plans.
//!
//! Versions are append-only (Postgres refuses edits): a new version takes effect at its
//! `effective_from`. A version dated in the past *corrects* prices already in force; that
//! is refused unless asked for explicitly (`backdate`), and audited as a price correction.
//! Open drafts pick it up when next rated; finalized invoices never change (the difference is
//! billed as an adjustment).

use chrono::{DateTime, DurationRound, TimeDelta, Utc};
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

use crate::invoice::BillingError;
use crate::money::Rates;

/// One list-price version of a model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct PriceVersion {
    pub model: String,
    pub effective_from: DateTime<Utc>,
    pub currency: String,
    #[serde(flatten)]
    #[sqlx(flatten)]
    pub rates: Rates,
}

/// Who seeds the shipped list prices (the `created_by` of their versions).
pub const DEFAULTS_ACTOR: &str = "cachet-defaults";

/// The list price Cachet ships for a model it serves: (input, output) in nano-units of USD
/// per token, with the standard multipliers (1.25× 5m write, 2× 1h write, 0.1× read, and
/// holding a cache object 1× per token-hour: [`DEFAULT_STORAGE_HOUR_BP`]).
/// Seeded by [`ensure_list_defaults`] where a model has no list price at all; an operator's
/// own price is never replaced, and a changed default here never reaches an install that
/// already has a price for the model.
pub fn list_default(model: &str) -> Option<Rates> {
    let (input_nanos, output_nanos) = match model {
        // The reference engine (SmolLM2-135M), embedded or behind vLLM: $0.10 / $0.20 per MTok.
        "smollm2-135m-instruct" | "smollm2-135m-instruct-vllm" => (100, 200),
        // The load-test profiles, priced like models of their size.
        "sim-llama-8b" => (300, 600),
        "sim-llama-70b" => (1_000, 3_000),
        // The tiny test model: $3 / $15 per MTok, the replayer's list rates too.
        "sim-tiny" => (3_000, 15_000),
        _ => return None,
    };
    Some(Rates::standard(input_nanos, output_nanos))
}

/// The storage price of a cache object, per token-hour, as a multiplier of the input price:
/// an hour held costs what the token cost as input (the migration's column default too, so
/// every version in the book has it). A day-long object of a model at $3/MTok costs $72 per
/// MTok held, against $6 to write it for an hour.
pub const DEFAULT_STORAGE_HOUR_BP: i32 = crate::money::standard::storage_hour();

/// Give each of `models` that has no list-price version at all its shipped default
/// ([`list_default`]), in force from the epoch so no usage of it is ever unpriced. Returns
/// the models seeded now. Idempotent and safe to run from several processes at once.
pub async fn ensure_list_defaults(
    pool: &PgPool,
    models: &[&str],
) -> Result<Vec<String>, BillingError> {
    let mut seeded = Vec::new();
    for model in models {
        let Some(r) = list_default(model) else {
            continue;
        };
        let done = sqlx::query(
            "INSERT INTO prices (model, effective_from, currency, input_nanos, output_nanos, \
             cache_write_5m_bp, cache_write_1h_bp, cache_read_bp, cache_storage_hour_bp, created_by) \
             SELECT $1, 'epoch', 'USD', $2, $3, $4, $5, $6, $8, $7 \
             WHERE NOT EXISTS (SELECT 1 FROM prices WHERE model = $1) \
             ON CONFLICT DO NOTHING",
        )
        .bind(model)
        .bind(r.input_nanos)
        .bind(r.output_nanos)
        .bind(r.cache_write_5m_bp)
        .bind(r.cache_write_1h_bp)
        .bind(r.cache_read_bp)
        .bind(DEFAULTS_ACTOR)
        .bind(r.cache_storage_hour_bp)
        .execute(pool)
        .await?;
        if done.rows_affected() == 1 {
            audit(
                pool,
                DEFAULTS_ACTOR,
                "price_default",
                serde_json::json!({"model": model, "input_nanos": r.input_nanos,
                    "output_nanos": r.output_nanos, "currency": "USD"}),
            )
            .await?;
            seeded.push(model.to_string());
        }
    }
    Ok(seeded)
}

/// Every model with a shipped default.
pub const DEFAULT_MODELS: &[&str] = &[
    "smollm2-135m-instruct",
    "smollm2-135m-instruct-vllm",
    "sim-tiny",
    "sim-llama-8b",
    "sim-llama-70b",
];

/// A tenant's plan version.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct Plan {
    pub tenant_id: Uuid,
    pub effective_from: DateTime<Utc>,
    pub discount_bp: i32,
    pub reserved_cache_bytes: i64,
    pub reserved_nanos_per_gb_hour: i64,
}

fn check_rates(r: &Rates) -> Result<(), BillingError> {
    if r.input_nanos < 0
        || r.output_nanos < 0
        || r.cache_write_5m_bp < 0
        || r.cache_write_1h_bp < 0
        || r.cache_read_bp < 0
        || r.cache_storage_hour_bp < 0
    {
        return Err(BillingError::Invalid("prices cannot be negative".into()));
    }
    Ok(())
}

fn check_backdate(
    from: DateTime<Utc>,
    now: DateTime<Utc>,
    backdate: bool,
) -> Result<bool, BillingError> {
    let past = from < now;
    if past && !backdate {
        return Err(BillingError::Invalid(format!(
            "{from} is in the past: a version dated before now corrects prices already billed \
             on open drafts; say so explicitly (--backdate) to do it"
        )));
    }
    Ok(past)
}

async fn audit(
    pool: &PgPool,
    actor: &str,
    action: &str,
    details: serde_json::Value,
) -> Result<(), BillingError> {
    sqlx::query("INSERT INTO billing_audit (actor, action, details) VALUES ($1, $2, $3)")
        .bind(actor)
        .bind(action)
        .bind(details)
        .execute(pool)
        .await?;
    Ok(())
}

fn duplicate(e: sqlx::Error, what: &str) -> BillingError {
    match e.as_database_error().and_then(|d| d.code()) {
        Some(c) if c == "23505" => {
            BillingError::Invalid(format!("{what} already has a version at that time"))
        }
        Some(c) if c == "23503" => BillingError::Invalid(format!("{what}: no such tenant")),
        _ => BillingError::Db(e),
    }
}

/// Add a list-price version.
pub async fn set_price(
    pool: &PgPool,
    p: &PriceVersion,
    actor: &str,
    backdate: bool,
    now: DateTime<Utc>,
) -> Result<(), BillingError> {
    check_rates(&p.rates)?;
    if p.currency.len() != 3 || !p.currency.bytes().all(|b| b.is_ascii_uppercase()) {
        return Err(BillingError::Invalid(format!(
            "currency {:?} is not an ISO 4217 code",
            p.currency
        )));
    }
    let corrects = check_backdate(p.effective_from, now, backdate)?;
    sqlx::query(
        r#"INSERT INTO prices (model, effective_from, currency, input_nanos, output_nanos,
               cache_write_5m_bp, cache_write_1h_bp, cache_read_bp, cache_storage_hour_bp,
               created_by)
           VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $10, $9)"#,
    )
    .bind(&p.model)
    .bind(p.effective_from)
    .bind(&p.currency)
    .bind(p.rates.input_nanos)
    .bind(p.rates.output_nanos)
    .bind(p.rates.cache_write_5m_bp)
    .bind(p.rates.cache_write_1h_bp)
    .bind(p.rates.cache_read_bp)
    .bind(actor)
    .bind(p.rates.cache_storage_hour_bp)
    .execute(pool)
    .await
    .map_err(|e| duplicate(e, &format!("model {}", p.model)))?;
    audit(
        pool,
        actor,
        if corrects {
            "price_correction"
        } else {
            "price"
        },
        serde_json::to_value(p).unwrap_or_default(),
    )
    .await
}

/// A tenant's custom rates for one model, from a moment on.
#[derive(Clone, Debug)]
pub struct TenantPrice {
    pub tenant: Uuid,
    pub model: String,
    pub effective_from: DateTime<Utc>,
    pub rates: Rates,
}

/// Add a custom-rate version for one tenant and model.
pub async fn set_tenant_price(
    pool: &PgPool,
    price: &TenantPrice,
    actor: &str,
    backdate: bool,
    now: DateTime<Utc>,
) -> Result<(), BillingError> {
    let TenantPrice {
        tenant,
        model,
        effective_from,
        rates,
    } = price;
    let (tenant, effective_from) = (*tenant, *effective_from);
    check_rates(rates)?;
    let corrects = check_backdate(effective_from, now, backdate)?;
    sqlx::query(
        r#"INSERT INTO tenant_prices (tenant_id, model, effective_from, input_nanos, output_nanos,
               cache_write_5m_bp, cache_write_1h_bp, cache_read_bp, cache_storage_hour_bp,
               created_by)
           VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $10, $9)"#,
    )
    .bind(tenant)
    .bind(model)
    .bind(effective_from)
    .bind(rates.input_nanos)
    .bind(rates.output_nanos)
    .bind(rates.cache_write_5m_bp)
    .bind(rates.cache_write_1h_bp)
    .bind(rates.cache_read_bp)
    .bind(actor)
    .bind(rates.cache_storage_hour_bp)
    .execute(pool)
    .await
    .map_err(|e| duplicate(e, &format!("tenant {tenant} model {model}")))?;
    audit(
        pool,
        actor,
        if corrects {
            "tenant_price_correction"
        } else {
            "tenant_price"
        },
        serde_json::json!({"tenant": tenant, "model": model, "effective_from": effective_from,
            "input_nanos": rates.input_nanos, "output_nanos": rates.output_nanos,
            "cache_write_5m_bp": rates.cache_write_5m_bp, "cache_write_1h_bp": rates.cache_write_1h_bp,
            "cache_read_bp": rates.cache_read_bp,
            "cache_storage_hour_bp": rates.cache_storage_hour_bp}),
    )
    .await
}

/// Add a plan version. Plans change on the hour (reserved capacity is billed per hour).
pub async fn set_plan(
    pool: &PgPool,
    plan: &Plan,
    actor: &str,
    backdate: bool,
    now: DateTime<Utc>,
) -> Result<(), BillingError> {
    if !(0..=10_000).contains(&plan.discount_bp) {
        return Err(BillingError::Invalid(
            "discount_bp must be between 0 and 10000".into(),
        ));
    }
    if plan.reserved_cache_bytes < 0 || plan.reserved_nanos_per_gb_hour < 0 {
        return Err(BillingError::Invalid(
            "reserved capacity and its price cannot be negative".into(),
        ));
    }
    if plan.effective_from.duration_trunc(TimeDelta::hours(1)).ok() != Some(plan.effective_from) {
        return Err(BillingError::Invalid(
            "a plan takes effect on the hour (e.g. 2026-12-01T00:00:00Z)".into(),
        ));
    }
    let corrects = check_backdate(plan.effective_from, now, backdate)?;
    sqlx::query(
        r#"INSERT INTO tenant_plans (tenant_id, effective_from, discount_bp, reserved_cache_bytes,
               reserved_nanos_per_gb_hour, created_by)
           VALUES ($1, $2, $3, $4, $5, $6)"#,
    )
    .bind(plan.tenant_id)
    .bind(plan.effective_from)
    .bind(plan.discount_bp)
    .bind(plan.reserved_cache_bytes)
    .bind(plan.reserved_nanos_per_gb_hour)
    .bind(actor)
    .execute(pool)
    .await
    .map_err(|e| duplicate(e, &format!("the plan of tenant {}", plan.tenant_id)))?;
    audit(
        pool,
        actor,
        if corrects { "plan_correction" } else { "plan" },
        serde_json::to_value(plan).unwrap_or_default(),
    )
    .await
}

/// The plan in force for `tenant` now, if it has one.
pub async fn plan_in_force(pool: &PgPool, tenant: Uuid) -> Result<Option<Plan>, sqlx::Error> {
    sqlx::query_as(
        "SELECT tenant_id, effective_from, discount_bp, reserved_cache_bytes, \
         reserved_nanos_per_gb_hour FROM tenant_plans WHERE tenant_id = $1 \
         AND effective_from <= now() ORDER BY effective_from DESC LIMIT 1",
    )
    .bind(tenant)
    .fetch_optional(pool)
    .await
}

/// The cache capacity each of `tenants` (every tenant: `None`) reserves under its plan in
/// force now; tenants without a reservation are absent.
pub async fn reserved_cache_bytes(
    pool: &PgPool,
    tenants: Option<&[Uuid]>,
) -> Result<std::collections::HashMap<Uuid, i64>, sqlx::Error> {
    let rows: Vec<(Uuid, i64)> = sqlx::query_as(
        "SELECT DISTINCT ON (tenant_id) tenant_id, reserved_cache_bytes FROM tenant_plans \
         WHERE ($1::UUID[] IS NULL OR tenant_id = ANY($1)) AND effective_from <= now() \
         ORDER BY tenant_id, effective_from DESC",
    )
    .bind(tenants)
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().filter(|(_, b)| *b > 0).collect())
}

/// A list-price version as the price book lists it: retired ones too, marked.
///
/// Rating reads the view `price_book` (migration 0007: the versions not retired). A view's
/// column list is fixed when it is created, so a migration that adds a column to `prices`
/// recreates `price_book` (`CREATE OR REPLACE VIEW`) to carry it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct ListedPrice {
    #[serde(flatten)]
    #[sqlx(flatten)]
    pub version: PriceVersion,
    /// When it was withdrawn before taking effect (it never priced anything).
    pub retired_at: Option<DateTime<Utc>>,
    pub retired_by: Option<String>,
    /// Who added it.
    pub created_by: String,
}

/// Every list-price version (retired ones included), by model then time.
pub async fn list_prices(pool: &PgPool) -> Result<Vec<ListedPrice>, BillingError> {
    Ok(sqlx::query_as::<_, ListedPrice>(
        r#"SELECT p.model, p.effective_from, p.currency, p.input_nanos, p.output_nanos,
                  p.cache_write_5m_bp, p.cache_write_1h_bp, p.cache_read_bp,
                  p.cache_storage_hour_bp, p.created_by,
                  r.retired_at, r.retired_by
           FROM prices p LEFT JOIN price_retirements r
             ON r.model = p.model AND r.effective_from = p.effective_from
           ORDER BY p.model, p.effective_from"#,
    )
    .fetch_all(pool)
    .await?)
}

/// Retire a scheduled list-price version: it is withdrawn and never takes effect. A version
/// already in force (or past) is refused: it priced usage, so it is replaced by a newer version
/// instead, which keeps every rated line reproducible.
pub async fn retire_price(
    pool: &PgPool,
    model: &str,
    effective_from: DateTime<Utc>,
    actor: &str,
    now: DateTime<Utc>,
) -> Result<(), BillingError> {
    let found: Option<bool> = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM price_retirements r WHERE r.model = p.model AND r.effective_from = p.effective_from) FROM prices p WHERE p.model = $1 AND p.effective_from = $2",
    )
    .bind(model)
    .bind(effective_from)
    .fetch_optional(pool)
    .await?;
    match found {
        None => {
            return Err(BillingError::NotFound(format!(
                "no price of model {model} from {effective_from}"
            )));
        }
        Some(true) => return Ok(()),
        Some(false) => {}
    }
    if effective_from <= now {
        return Err(BillingError::Conflict(format!(
            "the price of {model} from {effective_from} is in force or past: it priced usage, so it cannot be retired; add a new version to change the price from a date on"
        )));
    }
    sqlx::query(
        "INSERT INTO price_retirements (model, effective_from, retired_by) VALUES ($1, $2, $3)          ON CONFLICT DO NOTHING",
    )
    .bind(model)
    .bind(effective_from)
    .bind(actor)
    .execute(pool)
    .await?;
    audit(
        pool,
        actor,
        "price_retired",
        serde_json::json!({"model": model, "effective_from": effective_from}),
    )
    .await
}
