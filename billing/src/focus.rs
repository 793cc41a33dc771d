//! The FOCUS export: Cachet's charges as a FinOps Open Cost and Usage Specification (FOCUS)
//! 1.2 dataset, the format cloud cost tools read (decision 0037).
//!
//! One row per hour × tenant × workspace × key × model × price in force × SKU: a token class
//! of the usage ledger (`input`, `cache_write_5m`, `cache_write_1h`, `cache_read`, `output`,
//! in tokens) or cache objects held (`cache_storage`, in token-hours). Every row is rated as
//! the invoice rates it: at the price, custom rate and discount in force at each request's
//! start (each storage hour's), so a month's `BilledCost` adds up to the invoice's usage and
//! storage lines. Reserved capacity and credits are invoice lines of their own, not here.
//!
//! Columns: every one of FOCUS 1.2's mandatory columns ([`MANDATORY`]), the conditional and
//! recommended ones Cachet has (SKU, resource, sub-account, quantities, unit prices, charge
//! frequency, service subcategory, `Tags`: the key's tags, its workspace's under its own),
//! then Cachet's own (`x_Model`, `x_TokenClass`).
//! - account: `BillingAccountId`/`Name` the tenant, `SubAccountId`/`Name` its workspace,
//!   `ResourceId`/`Name` the API key (`ResourceType` `API Key`);
//! - cost: `ListCost` at the list price, `ContractedCost` at the tenant's rate (its custom
//!   rate where it has one), `BilledCost` and `EffectiveCost` after its plan's discount (no
//!   commitments to amortize: they are equal);
//! - `ChargeCategory` `Usage`, `ChargeClass` null (no corrections), `ChargeFrequency`
//!   `Usage-Based`, `ServiceCategory` `AI and Machine Learning` / `Generative AI`;
//! - `SkuId` `<model>/<token class>`, `SkuPriceId` adds the price version (and `custom`);
//! - amounts exact (every significant decimal), times `YYYY-MM-DDTHH:mm:ssZ`, CSV (RFC 4180).

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Body;
use chrono::{DateTime, Utc};
use futures::TryStreamExt;
use sqlx::{PgPool, Row};
use uuid::Uuid;

use crate::csv::field;
use crate::directory::{Directory, TenantNames};
use crate::export::{Chunks, ExportFilter};
use crate::invoice::{PRICED_GROUP, STORAGE_CLASS, prices_in_force};
use crate::money::{Exact, Rates, TokenClass, format_exact};

/// The FOCUS version the dataset conforms to.
pub const VERSION: &str = "1.2";

/// FOCUS 1.2's mandatory columns (its column library, feature level "Mandatory").
pub const MANDATORY: [&str; 21] = [
    "BilledCost",
    "BillingAccountId",
    "BillingAccountName",
    "BillingCurrency",
    "BillingPeriodEnd",
    "BillingPeriodStart",
    "ChargeCategory",
    "ChargeClass",
    "ChargeDescription",
    "ChargePeriodEnd",
    "ChargePeriodStart",
    "ContractedCost",
    "EffectiveCost",
    "InvoiceIssuerName",
    "ListCost",
    "PricingQuantity",
    "PricingUnit",
    "ProviderName",
    "PublisherName",
    "ServiceCategory",
    "ServiceName",
];

/// The columns written, in order.
pub const COLUMNS: [&str; 39] = [
    "BilledCost",
    "BillingAccountId",
    "BillingAccountName",
    "BillingCurrency",
    "BillingPeriodEnd",
    "BillingPeriodStart",
    "ChargeCategory",
    "ChargeClass",
    "ChargeDescription",
    "ChargeFrequency",
    "ChargePeriodEnd",
    "ChargePeriodStart",
    "ConsumedQuantity",
    "ConsumedUnit",
    "ContractedCost",
    "ContractedUnitPrice",
    "EffectiveCost",
    "InvoiceIssuerName",
    "ListCost",
    "ListUnitPrice",
    "PricingCategory",
    "PricingQuantity",
    "PricingUnit",
    "ProviderName",
    "PublisherName",
    "ResourceId",
    "ResourceName",
    "ResourceType",
    "ServiceCategory",
    "ServiceName",
    "ServiceSubcategory",
    "SkuId",
    "SkuMeter",
    "SkuPriceId",
    "SubAccountId",
    "SubAccountName",
    "Tags",
    "x_Model",
    "x_TokenClass",
];

/// Who provides, publishes and invoices: Cachet.
const ISSUER: &str = "Cachet";
const SERVICE: &str = "Cachet Prompt Caching";

/// One priced group of ledger rows: an hour of one key's use of one model at one price.
struct Group {
    hour: DateTime<Utc>,
    tenant: Uuid,
    workspace: Uuid,
    key: Uuid,
    model: String,
    currency: String,
    /// The price version in force (none: unpriced, billed at zero) and whether it is the
    /// tenant's custom rate.
    price_from: Option<DateTime<Utc>>,
    custom: bool,
    discount_bp: i32,
    rates: Option<Rates>,
    list: Option<Rates>,
}

/// A row's quantity: tokens of a class, or token-seconds of cache objects held.
#[derive(Clone, Copy)]
enum Sku {
    Tokens(TokenClass, i64),
    Storage(i64),
}

impl Sku {
    fn class(self) -> &'static str {
        match self {
            Sku::Tokens(c, _) => c.as_str(),
            Sku::Storage(_) => STORAGE_CLASS,
        }
    }

    fn meter(self) -> &'static str {
        match self {
            Sku::Tokens(TokenClass::Input, _) => "Input Tokens",
            Sku::Tokens(TokenClass::CacheWrite5m, _) => "Cache Write 5m Tokens",
            Sku::Tokens(TokenClass::CacheWrite1h, _) => "Cache Write 1h Tokens",
            Sku::Tokens(TokenClass::CacheRead, _) => "Cache Read Tokens",
            Sku::Tokens(TokenClass::Output, _) => "Output Tokens",
            Sku::Storage(_) => "Cache Storage Token-Hours",
        }
    }

    fn unit(self) -> &'static str {
        match self {
            Sku::Tokens(..) => "Tokens",
            Sku::Storage(_) => "Token-Hours",
        }
    }

    fn quantity(self) -> String {
        match self {
            Sku::Tokens(_, n) => n.to_string(),
            Sku::Storage(ts) => token_hours(ts),
        }
    }

    /// What `n` of this SKU costs at `rates`, less `discount_bp`; its unit price with none.
    fn cost(self, rates: &Rates, discount_bp: i32) -> (Exact, Exact) {
        match self {
            Sku::Tokens(c, n) => (
                Exact::usage(n, rates, c, discount_bp),
                Exact::usage(1, rates, c, 0),
            ),
            Sku::Storage(ts) => (
                Exact::storage(ts, rates, discount_bp),
                Exact::storage(3600, rates, 0),
            ),
        }
    }
}

/// Token-seconds as token-hours, exact where it divides, else to nine decimals.
fn token_hours(ts: i64) -> String {
    let nano = (ts as i128 * 1_000_000_000 + 1800) / 3600;
    let (whole, frac) = (nano / 1_000_000_000, nano % 1_000_000_000);
    let frac = format!("{frac:09}");
    let frac = frac.trim_end_matches('0');
    if frac.is_empty() {
        whole.to_string()
    } else {
        format!("{whole}.{frac}")
    }
}

fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

/// The rates of a group's row, `prefix`ed (`list_`) or as [`PRICED_GROUP`] names them.
fn rates_of(r: &sqlx::postgres::PgRow, prefix: &str) -> Option<Rates> {
    let nanos: Option<i64> = r.get(format!("{prefix}input_nanos").as_str());
    let get = |c: &str| r.get::<Option<i32>, _>(format!("{prefix}{c}").as_str());
    Some(Rates {
        input_nanos: nanos?,
        output_nanos: r.get::<Option<i64>, _>(format!("{prefix}output_nanos").as_str())?,
        cache_write_5m_bp: get("cache_write_5m_bp")?,
        cache_write_1h_bp: get("cache_write_1h_bp")?,
        cache_read_bp: get("cache_read_bp")?,
        cache_storage_hour_bp: get("cache_storage_hour_bp")?,
    })
}

/// The list price's columns beside [`PRICED_GROUP`]'s (the price book's, `p`).
const LIST: &str = "p.input_nanos AS list_input_nanos, p.output_nanos AS list_output_nanos, \
    p.cache_write_5m_bp AS list_cache_write_5m_bp, p.cache_write_1h_bp AS list_cache_write_1h_bp, \
    p.cache_read_bp AS list_cache_read_bp, p.cache_storage_hour_bp AS list_cache_storage_hour_bp";

/// The query of one ledger (`table`, its instant `at`, its hour `hour`), grouped as
/// [`Group`] with `sums`, picked by an [`ExportFilter`] ($1–$6).
fn grouped(table: &str, at: &str, hour: &str, sums: &str) -> sqlx::AssertSqlSafe<String> {
    sqlx::AssertSqlSafe(format!(
        "SELECT {hour} AS hour, e.tenant_id, e.workspace_id, e.api_key_id, {PRICED_GROUP}, {LIST}, {sums}
         FROM {table} e {prices}
         WHERE e.{at} >= $1 AND e.{at} < $2
           AND ($3::UUID IS NULL OR e.tenant_id = $3)
           AND ($4::UUID IS NULL OR e.workspace_id = $4)
           AND ($5::UUID IS NULL OR e.api_key_id = $5)
           AND ($6::TEXT IS NULL OR e.model = $6)
         GROUP BY 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21
         ORDER BY 1, 2, 3, 4, 5, 6",
        prices = prices_in_force(at),
    ))
}

fn group_of(r: &sqlx::postgres::PgRow) -> Group {
    Group {
        hour: r.get("hour"),
        tenant: r.get("tenant_id"),
        workspace: r.get("workspace_id"),
        key: r.get("api_key_id"),
        model: r.get("model"),
        currency: r.get("currency"),
        price_from: r.get("price_from"),
        custom: r.get("custom"),
        discount_bp: r.get("discount_bp"),
        rates: rates_of(r, ""),
        list: rates_of(r, "list_"),
    }
}

/// The rows of one group and SKU, as CSV in [`COLUMNS`]' order, appended to `out`.
fn write_row(out: &mut Vec<u8>, g: &Group, sku: Sku, names: &TenantNames) {
    let (billed, contracted, list, contracted_unit, list_unit) = match &g.rates {
        Some(rates) => {
            let (billed, _) = sku.cost(rates, g.discount_bp);
            let (contracted, contracted_unit) = sku.cost(rates, 0);
            // Without a list price (a custom rate only), the contracted rate is the list.
            let (list, list_unit) = sku.cost(g.list.as_ref().unwrap_or(rates), 0);
            let f = |e| format_exact(e, &g.currency);
            (
                f(billed),
                f(contracted),
                f(list),
                f(contracted_unit),
                f(list_unit),
            )
        }
        None => {
            let zero = format_exact(Exact::ZERO, &g.currency);
            (
                zero.clone(),
                zero.clone(),
                zero,
                String::new(),
                String::new(),
            )
        }
    };
    let (period_start, period_end) = crate::dashboard::month_of(g.hour);
    let class = sku.class();
    let description = match g.price_from {
        Some(_) => format!("{} {}", g.model, sku.meter()),
        None => format!(
            "{} {} (no price in force: not billed)",
            g.model,
            sku.meter()
        ),
    };
    let price_id = g.price_from.map(|from| {
        format!(
            "{}/{class}/{}{}",
            g.model,
            rfc3339(from),
            if g.custom { "/custom" } else { "" }
        )
    });
    let name = |m: &HashMap<Uuid, String>, id: &Uuid| m.get(id).cloned().unwrap_or_default();
    let tags = names.key_tags.get(&g.key).cloned().unwrap_or_default();
    let cells: [String; 39] = [
        billed.clone(),
        g.tenant.to_string(),
        names.tenant.clone().unwrap_or_default(),
        g.currency.clone(),
        rfc3339(period_end),
        rfc3339(period_start),
        "Usage".into(),
        String::new(),
        description,
        "Usage-Based".into(),
        rfc3339(g.hour + chrono::TimeDelta::hours(1)),
        rfc3339(g.hour),
        sku.quantity(),
        sku.unit().into(),
        contracted,
        contracted_unit,
        billed,
        ISSUER.into(),
        list,
        list_unit,
        "Standard".into(),
        sku.quantity(),
        sku.unit().into(),
        ISSUER.into(),
        ISSUER.into(),
        g.key.to_string(),
        name(&names.keys, &g.key),
        "API Key".into(),
        "AI and Machine Learning".into(),
        SERVICE.into(),
        "Generative AI".into(),
        format!("{}/{class}", g.model),
        sku.meter().into(),
        price_id.unwrap_or_default(),
        g.workspace.to_string(),
        name(&names.workspaces, &g.workspace),
        serde_json::to_string(&tags).unwrap_or_default(),
        g.model.clone(),
        class.into(),
    ];
    for (i, c) in cells.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(field(c).as_bytes());
    }
    out.extend_from_slice(b"\r\n");
}

/// What a ledger's group is charged for.
type SkusOf = fn(&sqlx::postgres::PgRow) -> Vec<Sku>;

/// The usage ledger's groups' SKUs: each token class used.
fn token_skus(r: &sqlx::postgres::PgRow) -> Vec<Sku> {
    [
        (TokenClass::Input, "input_tokens"),
        (TokenClass::CacheWrite5m, "w5_tokens"),
        (TokenClass::CacheWrite1h, "w1_tokens"),
        (TokenClass::CacheRead, "read_tokens"),
        (TokenClass::Output, "output_tokens"),
    ]
    .into_iter()
    .map(|(c, col)| Sku::Tokens(c, r.get(col)))
    .filter(|s| matches!(s, Sku::Tokens(_, n) if *n != 0))
    .collect()
}

/// Stream the FOCUS dataset of what `filter` picks: the usage ledger's rows by their start,
/// then the storage ledger's hours by theirs.
pub fn stream(pool: PgPool, directory: Arc<dyn Directory>, filter: ExportFilter) -> Body {
    let (mut out, body) = Chunks::new();
    tokio::spawn(async move {
        out.buf().extend_from_slice(COLUMNS.join(",").as_bytes());
        out.buf().extend_from_slice(b"\r\n");
        let usage_sums = "sum(e.input_tokens)::BIGINT AS input_tokens, \
            sum(e.cache_write_5m_tokens)::BIGINT AS w5_tokens, \
            sum(e.cache_write_1h_tokens)::BIGINT AS w1_tokens, \
            sum(e.cache_read_tokens)::BIGINT AS read_tokens, \
            sum(e.output_tokens)::BIGINT AS output_tokens";
        let ledgers: [(sqlx::AssertSqlSafe<String>, SkusOf); 2] = [
            (
                grouped(
                    "usage_events",
                    "started_at",
                    "date_trunc('hour', e.started_at, 'UTC')",
                    usage_sums,
                ),
                token_skus,
            ),
            (
                grouped(
                    "cache_storage_events",
                    "hour_start",
                    "e.hour_start",
                    "sum(e.tokens * e.seconds)::BIGINT AS token_seconds",
                ),
                |r| vec![Sku::Storage(r.get("token_seconds"))],
            ),
        ];
        let mut names: HashMap<Uuid, TenantNames> = HashMap::new();
        for (sql, skus) in ledgers {
            let mut rows = sqlx::query(sql)
                .bind(filter.from)
                .bind(filter.to)
                .bind(filter.tenant)
                .bind(filter.workspace)
                .bind(filter.api_key)
                .bind(filter.model.clone())
                .fetch(&pool);
            loop {
                let r = match rows.try_next().await {
                    Ok(Some(r)) => r,
                    Ok(None) => break,
                    Err(e) => return out.fail("FOCUS export failed mid-stream", e).await,
                };
                let g = group_of(&r);
                let n = match names.entry(g.tenant) {
                    std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
                    std::collections::hash_map::Entry::Vacant(v) => {
                        match directory.names(g.tenant).await {
                            Ok(n) => v.insert(n),
                            Err(e) => {
                                return out.fail("FOCUS export failed loading names", e).await;
                            }
                        }
                    }
                };
                for sku in skus(&r) {
                    write_row(out.buf(), &g, sku, n);
                }
                if !out.flush_full().await {
                    return; // the client went away
                }
            }
        }
        out.finish().await;
    });
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_mandatory_column_is_written_once_in_the_specifications_spelling() {
        for m in MANDATORY {
            assert_eq!(COLUMNS.iter().filter(|c| **c == m).count(), 1, "{m}");
        }
        let mut seen = std::collections::HashSet::new();
        assert!(COLUMNS.iter().all(|c| seen.insert(*c)), "no column twice");
        // Cachet's own columns carry FOCUS's prefix for custom columns.
        let spec: std::collections::HashSet<&str> = MANDATORY.into_iter().collect();
        for c in COLUMNS.iter().filter(|c| !spec.contains(*c)) {
            assert!(
                c.starts_with("x_") || c.chars().next().is_some_and(|c| c.is_ascii_uppercase()),
                "{c}"
            );
        }
    }

    #[test]
    fn token_hours_are_exact_where_they_divide() {
        assert_eq!(token_hours(7200), "2");
        assert_eq!(token_hours(5400), "1.5");
        assert_eq!(token_hours(1), "0.000277778");
        assert_eq!(token_hours(0), "0");
    }

    #[test]
    fn a_row_rates_list_contracted_and_billed_apart() {
        let list = Rates {
            input_nanos: 3_000,
            output_nanos: 15_000,
            cache_write_5m_bp: 12_500,
            cache_write_1h_bp: 20_000,
            cache_read_bp: 1_000,
            cache_storage_hour_bp: 100,
        };
        let custom = Rates {
            input_nanos: 2_000,
            ..list
        };
        let hour: DateTime<Utc> = "2026-10-31T23:00:00Z".parse().unwrap();
        let g = Group {
            hour,
            tenant: Uuid::nil(),
            workspace: Uuid::nil(),
            key: Uuid::nil(),
            model: "sim-tiny".into(),
            currency: "USD".into(),
            price_from: Some("2026-01-01T00:00:00Z".parse().unwrap()),
            custom: true,
            discount_bp: 1_000,
            rates: Some(custom),
            list: Some(list),
        };
        let names = TenantNames {
            tenant: Some("acme".into()),
            ..Default::default()
        };
        let mut out = Vec::new();
        write_row(
            &mut out,
            &g,
            Sku::Tokens(TokenClass::CacheRead, 1_000_000),
            &names,
        );
        let line = String::from_utf8(out).unwrap();
        let cells: Vec<&str> = line.trim_end().split(',').collect();
        assert_eq!(cells.len(), COLUMNS.len());
        let at = |c: &str| cells[COLUMNS.iter().position(|x| *x == c).unwrap()];
        // 1M reads × 2,000 nano × 0.1 = 0.2; list 3,000 nano → 0.3; 10% off → 0.18.
        assert_eq!(at("ListCost"), "0.30");
        assert_eq!(at("ContractedCost"), "0.20");
        assert_eq!(at("BilledCost"), "0.18");
        assert_eq!(at("EffectiveCost"), "0.18");
        assert_eq!(at("ListUnitPrice"), "0.0000003");
        assert_eq!(at("ContractedUnitPrice"), "0.0000002");
        assert_eq!(at("ChargePeriodStart"), "2026-10-31T23:00:00Z");
        assert_eq!(at("ChargePeriodEnd"), "2026-11-01T00:00:00Z");
        assert_eq!(at("BillingPeriodStart"), "2026-10-01T00:00:00Z");
        assert_eq!(at("BillingPeriodEnd"), "2026-11-01T00:00:00Z");
        assert_eq!(at("ChargeClass"), "");
        assert_eq!(at("PricingQuantity"), "1000000");
        assert_eq!(at("PricingUnit"), "Tokens");
        assert_eq!(at("SkuMeter"), "Cache Read Tokens");
        assert_eq!(at("BillingAccountName"), "acme");
        assert_eq!(
            at("SkuPriceId"),
            "sim-tiny/cache_read/2026-01-01T00:00:00Z/custom"
        );
        assert_eq!(at("SkuId"), "sim-tiny/cache_read");
    }
}
