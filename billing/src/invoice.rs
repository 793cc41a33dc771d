//! Rating and invoices.
//!
//! **Rating.** Every ledger row is priced by the price version in force at its `started_at`:
//! the tenant's custom rates for the model if it has some then, else the model's list price;
//! and the tenant's plan discount in force then. Each of the row's five token classes is
//! priced exactly once. Rows are grouped by (model, price version, discount), so a line's
//! quantity is a sum of ledger tokens and its amount one exact product (see [`crate::money`]).
//! Cache objects held are rated the same way from the storage ledger
//! (`cache_storage_events`, [`crate::storage`]): each hour at the version in force at its
//! start, one `storage` line per group, its quantity in token-seconds.
//!
//! **Invoices.** One per tenant and calendar month (UTC). While the month's invoice is a
//! draft it is recomputed from the ledger on demand ([`refresh_draft`]); [`finalize`] fixes
//! it, and Postgres refuses any later change to it or its lines. A correction after that is
//! an adjustment ([`add_adjustment`]), billed as a line of the tenant's next draft. Every
//! (re-)rating writes a row to `billing_audit`.

use chrono::{DateTime, Datelike, NaiveDate, SubsecRound, TimeZone, Utc};
use serde::Serialize;
use sqlx::{PgPool, Postgres, Row, Transaction};
use utoipa::ToSchema;
use uuid::Uuid;

use crate::money::{Exact, Rates, TokenClass, format_exact, format_minor};

#[derive(Debug, thiserror::Error)]
pub enum BillingError {
    #[error(
        "usage of {models:?} has no price in force: add one (backdated) before finalizing, so it is not billed as free"
    )]
    Unpriced { models: Vec<String> },
    #[error("the invoice of {tenant} for {month} is finalized; corrections are adjustments")]
    Finalized { tenant: Uuid, month: NaiveDate },
    #[error("prices in force for {tenant} use several currencies: {currencies:?}")]
    MixedCurrency {
        tenant: Uuid,
        currencies: Vec<String>,
    },
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    NotFound(String),
    /// A change the object's state does not allow (retiring a price in force, …).
    #[error("{0}")]
    Conflict(String),
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
}

impl cachet_common::error::ServiceError for BillingError {
    fn error_code(&self) -> cachet_common::error::ErrorCode {
        use cachet_common::error::ErrorCode;
        match self {
            BillingError::Db(_) => ErrorCode::Api,
            BillingError::Finalized { .. }
            | BillingError::Unpriced { .. }
            | BillingError::Conflict(_) => ErrorCode::Conflict,
            BillingError::NotFound(_) => ErrorCode::NotFound,
            BillingError::MixedCurrency { .. } | BillingError::Invalid(_) => {
                ErrorCode::InvalidRequest
            }
        }
    }
}

/// What a line bills.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum LineKind {
    Usage,
    /// Cache objects held (token-seconds at a price per token-hour).
    Storage,
    Reserved,
    Adjustment,
}

impl LineKind {
    pub fn as_str(self) -> &'static str {
        match self {
            LineKind::Usage => "usage",
            LineKind::Storage => "storage",
            LineKind::Reserved => "reserved",
            LineKind::Adjustment => "adjustment",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, ToSchema)]
pub struct Line {
    pub kind: LineKind,
    pub model: Option<String>,
    pub token_class: Option<String>,
    pub price_from: Option<DateTime<Utc>>,
    /// Tokens (usage), token-seconds (storage), GB-hours × 10⁹ bytes (reserved: bytes ×
    /// hours), 1 (adjustment).
    pub quantity: i64,
    /// Exact amount in nano-units, as rated.
    pub exact_nanos: String,
    /// The line's share of the total in minor units (the lines' shares add up to
    /// `total_minor`; see [`crate::rounding`]).
    pub amount_minor: i64,
    pub description: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Invoice {
    pub id: Uuid,
    pub tenant_id: Uuid,
    pub period_start: NaiveDate,
    pub currency: String,
    pub status: String,
    pub total_minor: i64,
    pub lines: Vec<Line>,
    /// Models whose usage this month had no price in force: listed at zero, not billed.
    pub unpriced: Vec<String>,
    /// When the lines were rated from the ledger (a draft is re-rated on demand).
    pub rated_at: DateTime<Utc>,
    pub finalized_at: Option<DateTime<Utc>>,
}

/// An invoice as JSON (the finance API's answer; the console's page reads it): its fields,
/// each line with `amount` (its exact amount as every document writes it), `rounding` (what
/// the total's one rounding added, as a line would show it) and `total` (the total written
/// out), by [`crate::rounding`]'s rule.
#[derive(Debug, Serialize, ToSchema)]
pub struct InvoiceJson {
    pub id: Uuid,
    pub tenant_id: Uuid,
    pub period_start: NaiveDate,
    pub currency: String,
    /// `draft` or `finalized`.
    pub status: String,
    /// The lines' exact sum rounded once, in minor units.
    pub total_minor: i64,
    /// The total in the currency (`0.12`).
    pub total: String,
    pub lines: Vec<LineJson>,
    pub rounding: RoundingJson,
    /// Models whose usage this month had no price in force: listed at zero, not billed.
    pub unpriced: Vec<String>,
    pub rated_at: DateTime<Utc>,
    pub finalized_at: Option<DateTime<Utc>>,
}

/// An invoice line as JSON.
#[derive(Debug, Serialize, ToSchema)]
pub struct LineJson {
    #[serde(flatten)]
    pub line: Line,
    /// The exact amount in the currency, every significant decimal kept (`0.0000519`).
    pub amount: String,
}

/// What the total's one rounding added to the lines' exact sum (negative when it took off).
#[derive(Debug, Serialize, ToSchema)]
pub struct RoundingJson {
    pub exact_nanos: String,
    pub amount: String,
    pub description: String,
}

impl From<&Invoice> for InvoiceJson {
    fn from(inv: &Invoice) -> Self {
        let cur = inv.currency.as_str();
        let r = inv.rounding();
        InvoiceJson {
            id: inv.id,
            tenant_id: inv.tenant_id,
            period_start: inv.period_start,
            currency: inv.currency.clone(),
            status: inv.status.clone(),
            total_minor: inv.total_minor,
            total: format_minor(inv.total_minor, cur),
            lines: inv
                .lines
                .iter()
                .map(|line| LineJson {
                    amount: format_exact(line.exact(cur), cur),
                    line: line.clone(),
                })
                .collect(),
            rounding: RoundingJson {
                exact_nanos: r.nanos_decimal(),
                amount: format_exact(r, cur),
                description: ROUNDING_LINE.to_string(),
            },
            unpriced: inv.unpriced.clone(),
            rated_at: inv.rated_at,
            finalized_at: inv.finalized_at,
        }
    }
}

impl Serialize for Invoice {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        InvoiceJson::from(self).serialize(s)
    }
}

/// `YYYY-MM` → the first day of that month.
pub fn parse_month(s: &str) -> Result<NaiveDate, BillingError> {
    NaiveDate::parse_from_str(&format!("{s}-01"), "%Y-%m-%d")
        .map_err(|_| BillingError::Invalid(format!("month {s:?} is not YYYY-MM")))
}

/// The first day of `month`'s month and of the next, as UTC instants.
pub fn month_bounds(month: NaiveDate) -> Result<(DateTime<Utc>, DateTime<Utc>), BillingError> {
    let first = NaiveDate::from_ymd_opt(month.year(), month.month(), 1)
        .ok_or_else(|| BillingError::Invalid(format!("no month {month}")))?;
    let next = if month.month() == 12 {
        NaiveDate::from_ymd_opt(month.year() + 1, 1, 1)
    } else {
        NaiveDate::from_ymd_opt(month.year(), month.month() + 1, 1)
    }
    .ok_or_else(|| BillingError::Invalid(format!("no month after {month}")))?;
    let at = |d: NaiveDate| Utc.from_utc_datetime(&d.and_hms_opt(0, 0, 0).expect("midnight"));
    Ok((at(first), at(next)))
}

/// Rate a tenant's month from the ledger (no writes): its usage lines, its reserved-capacity
/// lines and the adjustments not yet billed elsewhere.
pub async fn compute(
    pool: &PgPool,
    tenant: Uuid,
    month: NaiveDate,
) -> Result<Invoice, BillingError> {
    let (from, to) = month_bounds(month)?;
    let mut conn = pool.acquire().await?;
    let (usage_currency, mut lines) = usage_lines(&mut conn, tenant, from, to).await?;
    let (currency, storage) = storage_lines(
        &mut conn,
        tenant,
        from,
        to,
        usage_currency,
        !lines.is_empty(),
    )
    .await?;
    lines.extend(storage);
    lines.extend(reserved_lines(&mut conn, tenant, from, to, &currency).await?);
    lines.extend(adjustment_lines(&mut conn, tenant, from, &currency).await?);
    let existing: Option<(Uuid, String)> = sqlx::query_as(
        "SELECT id, status FROM invoices WHERE tenant_id = $1 AND period_start = $2",
    )
    .bind(tenant)
    .bind(from.date_naive())
    .fetch_optional(&mut *conn)
    .await?;
    let exact = exacts(&lines, &currency);
    let total_minor = crate::rounding::total_minor(&exact, &currency);
    let shares = crate::rounding::apportion(&exact, total_minor, &currency);
    for (l, share) in lines.iter_mut().zip(shares) {
        l.amount_minor = share;
    }
    Ok(Invoice {
        id: existing.as_ref().map(|e| e.0).unwrap_or_else(Uuid::now_v7),
        tenant_id: tenant,
        period_start: from.date_naive(),
        total_minor,
        currency,
        status: existing.map(|e| e.1).unwrap_or_else(|| "draft".into()),
        unpriced: unpriced_models(&lines),
        // Postgres keeps microseconds: what is stored is what was computed.
        rated_at: Utc::now().trunc_subsecs(6),
        finalized_at: None,
        lines,
    })
}

/// The columns of a group of ledger rows rated alike (after [`prices_in_force`]): the model,
/// the price version in force (`price_from`, custom or not, its currency), the plan's discount
/// and the rates, named as [`Rates`]' fields.
pub(crate) const PRICED_GROUP: &str = "e.model,
               COALESCE(tp.effective_from, p.effective_from) AS price_from,
               (tp.tenant_id IS NOT NULL) AS custom,
               COALESCE(p.currency, 'USD') AS currency,
               COALESCE(pl.discount_bp, 0) AS discount_bp,
               COALESCE(tp.input_nanos, p.input_nanos) AS input_nanos,
               COALESCE(tp.output_nanos, p.output_nanos) AS output_nanos,
               COALESCE(tp.cache_write_5m_bp, p.cache_write_5m_bp) AS cache_write_5m_bp,
               COALESCE(tp.cache_write_1h_bp, p.cache_write_1h_bp) AS cache_write_1h_bp,
               COALESCE(tp.cache_read_bp, p.cache_read_bp) AS cache_read_bp,
               COALESCE(tp.cache_storage_hour_bp, p.cache_storage_hour_bp) AS cache_storage_hour_bp";
/// Its GROUP BY (every column of [`PRICED_GROUP`]) and ORDER BY (model, version, discount).
const PRICED_GROUP_BY: &str = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11";
const PRICED_GROUP_ORDER: &str = "1, 2, 5";

/// The joins that find, for each ledger row `e` at its instant `e.<at>`, the tenant's custom
/// rate (`tp`), the list price (`p`, from `price_book`) and the plan (`pl`) in force then.
pub(crate) fn prices_in_force(at: &str) -> String {
    format!(
        "LEFT JOIN LATERAL (
            SELECT * FROM tenant_prices t
            WHERE t.tenant_id = e.tenant_id AND t.model = e.model AND t.effective_from <= e.{at}
            ORDER BY t.effective_from DESC LIMIT 1) tp ON true
        LEFT JOIN LATERAL (
            SELECT * FROM price_book q
            WHERE q.model = e.model AND q.effective_from <= e.{at}
            ORDER BY q.effective_from DESC LIMIT 1) p ON true
        LEFT JOIN LATERAL (
            SELECT * FROM tenant_plans x
            WHERE x.tenant_id = e.tenant_id AND x.effective_from <= e.{at}
            ORDER BY x.effective_from DESC LIMIT 1) pl ON true"
    )
}

/// A tenant's rows of `table` in `[from, to)` by `at` (their hour or start), grouped by
/// model × price version × discount in force at that instant, with `sums` beside each group's
/// [`PRICED_GROUP`] columns and its earliest instant (`first_at`).
async fn priced_groups(
    conn: &mut sqlx::PgConnection,
    table: &str,
    at: &str,
    sums: &str,
    (tenant, from, to): (Uuid, DateTime<Utc>, DateTime<Utc>),
) -> Result<Vec<sqlx::postgres::PgRow>, BillingError> {
    let sql = format!(
        r#"
        SELECT {PRICED_GROUP}, min(e.{at}) AS first_at, {sums}
        FROM {table} e
        {PRICES_IN_FORCE}
        WHERE e.tenant_id = $1 AND e.{at} >= $2 AND e.{at} < $3
        GROUP BY {PRICED_GROUP_BY}
        ORDER BY {PRICED_GROUP_ORDER}
        "#,
        PRICES_IN_FORCE = prices_in_force(at),
    );
    let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(tenant)
        .bind(from)
        .bind(to)
        .fetch_all(conn)
        .await?;
    Ok(rows)
}

/// One line per model × price version × discount × token class, rated at the version in
/// force at each row's start; the invoice's currency (one per tenant).
async fn usage_lines(
    conn: &mut sqlx::PgConnection,
    tenant: Uuid,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> Result<(String, Vec<Line>), BillingError> {
    // One group per model × price version × discount in force at each row's start.
    let sums = "sum(e.input_tokens)::BIGINT AS input_tokens, \
                sum(e.cache_write_5m_tokens)::BIGINT AS w5_tokens, \
                sum(e.cache_write_1h_tokens)::BIGINT AS w1_tokens, \
                sum(e.cache_read_tokens)::BIGINT AS read_tokens, \
                sum(e.output_tokens)::BIGINT AS output_tokens";
    let groups =
        priced_groups(conn, "usage_events", "started_at", sums, (tenant, from, to)).await?;

    let (currency, lines) =
        rate_groups(tenant, LineKind::Usage, &groups, Vec::new(), |g, priced| {
            // Usage lines price no storage ([`storage_lines`] do).
            TokenClass::ALL
                .into_iter()
                .map(|class| (class, class_tokens(g, class)))
                .filter(|(_, tokens)| *tokens != 0)
                .map(|(class, tokens)| {
                    let ((nanos, bp), exact) = match &priced {
                        Some((r, d)) => (r.of(class), Exact::usage(tokens, r, class, *d)),
                        None => ((0, 0), Exact::ZERO),
                    };
                    Charge {
                        token_class: class.as_str(),
                        label: class.to_string(),
                        quantity: tokens,
                        amount: format!("{tokens} tokens"),
                        nanos,
                        bp,
                        per: "",
                        exact,
                    }
                })
                .collect()
        })?;
    Ok((currency.unwrap_or_else(|| "USD".to_string()), lines))
}

/// One charge of a group of ledger rows: a token class's quantity and what it costs.
struct Charge {
    token_class: &'static str,
    /// The charge as a line's description names it (`input`, `cache storage`).
    label: String,
    quantity: i64,
    /// The quantity as the description says it (`12 tokens`, `1.5 token-hours`).
    amount: String,
    /// The rate: nano-units per token, its multiplier in basis points, and what it is per.
    nanos: i64,
    bp: i32,
    per: &'static str,
    /// Zero where no price is in force.
    exact: Exact,
}

/// The rating loop, for every kind of metered line: each group (one model × price version ×
/// discount in force at its rows' start, in `groups`' columns `model`, `price_from`, `custom`,
/// `currency`, `discount_bp`, the rates, `first_at`: [`PRICED_GROUP`]) as a line per charge
/// that `charges` reads off it, given the group's rates and discount (`None` where no price
/// is in force). Rating never stops for a
/// missing price: such usage is listed, billed at zero, and the invoice names the model
/// (`Invoice::unpriced`) so finance is told. Returns the one currency the priced lines (and
/// `currencies`, those already in the invoice) are in.
fn rate_groups(
    tenant: Uuid,
    kind: LineKind,
    groups: &[sqlx::postgres::PgRow],
    mut currencies: Vec<String>,
    charges: impl Fn(&sqlx::postgres::PgRow, Option<(Rates, i32)>) -> Vec<Charge>,
) -> Result<(Option<String>, Vec<Line>), BillingError> {
    let mut lines = Vec::new();
    for g in groups {
        let model: String = g.get("model");
        let line = |c: &Charge, price_from, exact: Exact, currency: &str, description| Line {
            kind,
            model: Some(model.clone()),
            token_class: Some(c.token_class.to_string()),
            price_from,
            quantity: c.quantity,
            exact_nanos: exact.nanos_decimal(),
            amount_minor: exact.to_minor(currency),
            description,
        };
        let Some(price_from) = g.get::<Option<DateTime<Utc>>, _>("price_from") else {
            let first_at: DateTime<Utc> = g.get("first_at");
            for c in charges(g, None) {
                let description = format!(
                    "{model} {}: {} with no price in force (from {}): not billed; add a price for {model}",
                    c.label,
                    c.amount,
                    first_at.format("%Y-%m-%d %H:%M UTC")
                );
                lines.push(line(&c, None, Exact::ZERO, "USD", description));
            }
            continue;
        };
        let currency: String = g.get("currency");
        if !currencies.contains(&currency) {
            currencies.push(currency.clone());
        }
        let discount: i32 = g.get("discount_bp");
        let custom: bool = g.get("custom");
        let rates = <Rates as sqlx::FromRow<_>>::from_row(g)?;
        for c in charges(g, Some((rates, discount))) {
            let mut description = format!(
                "{model} {}: {} at {} nano/token × {}.{:04}{}{}",
                c.label,
                c.amount,
                c.nanos,
                c.bp / 10_000,
                c.bp % 10_000,
                c.per,
                if custom { " (custom rate)" } else { "" }
            );
            if discount > 0 {
                description.push_str(&format!(", {}.{:02}% off", discount / 100, discount % 100));
            }
            lines.push(line(&c, Some(price_from), c.exact, &currency, description));
        }
    }
    if currencies.len() > 1 {
        return Err(BillingError::MixedCurrency { tenant, currencies });
    }
    Ok((currencies.pop(), lines))
}

/// The token class columns of a usage group.
fn class_tokens(g: &sqlx::postgres::PgRow, class: TokenClass) -> i64 {
    g.get(match class {
        TokenClass::Input => "input_tokens",
        TokenClass::CacheWrite5m => "w5_tokens",
        TokenClass::CacheWrite1h => "w1_tokens",
        TokenClass::CacheRead => "read_tokens",
        TokenClass::Output => "output_tokens",
    })
}

/// An invoice's total: its lines' exact amounts summed, then rounded once, as the dashboards
/// round their costs (so the two agree to the cent); see [`crate::rounding`].
pub fn total_of(lines: &[Line], currency: &str) -> i64 {
    crate::rounding::total_minor(&exacts(lines, currency), currency)
}

/// The lines' exact amounts, in order.
fn exacts(lines: &[Line], currency: &str) -> Vec<Exact> {
    lines.iter().map(|l| l.exact(currency)).collect()
}

impl Line {
    /// The line's exact amount (`exact_nanos`; a line stored without one is its minor units).
    pub fn exact(&self, currency: &str) -> Exact {
        self.exact_nanos
            .parse::<Exact>()
            .unwrap_or_else(|_| Exact::from_minor(self.amount_minor, currency))
    }
}

impl Invoice {
    /// What the total's one rounding added to the lines' exact sum, the rounding row of every
    /// document ([`crate::rounding`]).
    pub fn rounding(&self) -> Exact {
        crate::rounding::rounding(
            &exacts(&self.lines, &self.currency),
            self.total_minor,
            &self.currency,
        )
    }
}

/// The header of an invoice's CSV.
pub const INVOICE_CSV_HEADER: &str =
    "line,kind,model,token_class,price_from,quantity,exact_nanos,amount,description\r\n";

/// An invoice as CSV (RFC 4180): a row per line with its exact amount (nano-units, and in
/// the currency as every document writes it), the rounding row, then the total (the exact
/// sum, rounded once): both amount columns add up to the total ([`crate::rounding`]).
pub fn invoice_csv(inv: &Invoice) -> String {
    use crate::csv::field;
    let cur = &inv.currency;
    let mut out = String::from(INVOICE_CSV_HEADER);
    for (i, l) in inv.lines.iter().enumerate() {
        let exact = l.exact(cur);
        out.push_str(&format!(
            "{},{},{},{},{},{},{},{},{}\r\n",
            i + 1,
            l.kind.as_str(),
            field(l.model.as_deref().unwrap_or("")),
            l.token_class.as_deref().unwrap_or(""),
            l.price_from.map(|t| t.to_rfc3339()).unwrap_or_default(),
            l.quantity,
            exact.nanos_decimal(),
            format_exact(exact, cur),
            field(&l.description),
        ));
    }
    let r = inv.rounding();
    out.push_str(&format!(
        ",rounding,,,,,{},{},{}\r\n",
        r.nanos_decimal(),
        format_exact(r, cur),
        field(ROUNDING_LINE),
    ));
    out.push_str(&format!(
        ",total,,,,,{},{},{}\r\n",
        Exact::from_minor(inv.total_minor, cur).nanos_decimal(),
        format_minor(inv.total_minor, cur),
        field(&format!(
            "{} {} {} ({})",
            inv.period_start.format("%Y-%m"),
            inv.currency,
            inv.status,
            inv.id
        ))
    ));
    out
}

/// The rounding line's description, in every document.
pub const ROUNDING_LINE: &str = "Rounding: the total is the lines' exact sum, rounded once";

/// The models whose usage no price covered (usage lines without a price version).
pub fn unpriced_models(lines: &[Line]) -> Vec<String> {
    let mut models: Vec<String> = lines
        .iter()
        .filter(|l| matches!(l.kind, LineKind::Usage | LineKind::Storage) && l.price_from.is_none())
        .filter_map(|l| l.model.clone())
        .collect();
    models.sort();
    models.dedup();
    models
}

/// The token class of storage lines (and of the storage ledger in exports and reconciliation).
pub const STORAGE_CLASS: &str = "cache_storage";

/// Cache objects held: one line per model × price version × discount in force at each
/// storage hour's start, its quantity in token-seconds. Returns the invoice's currency: the
/// usage lines' (`currency`, when there are any: `priced`), else the storage prices'.
async fn storage_lines(
    conn: &mut sqlx::PgConnection,
    tenant: Uuid,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    currency: String,
    priced: bool,
) -> Result<(String, Vec<Line>), BillingError> {
    let sums = "sum(e.tokens * e.seconds)::BIGINT AS token_seconds";
    let groups = priced_groups(
        conn,
        "cache_storage_events",
        "hour_start",
        sums,
        (tenant, from, to),
    )
    .await?;
    let currencies = if priced {
        vec![currency.clone()]
    } else {
        Vec::new()
    };
    let (in_force, lines) = rate_groups(
        tenant,
        LineKind::Storage,
        &groups,
        currencies,
        |g, rated| {
            let token_seconds: i64 = g.get("token_seconds");
            // Storage reads only the input price and its storage multiplier.
            let (nanos, bp, exact) = match rated {
                Some((rates, d)) => {
                    let exact = Exact::storage(token_seconds, &rates, d);
                    (rates.input_nanos, rates.cache_storage_hour_bp, exact)
                }
                None => (0, 0, Exact::ZERO),
            };
            vec![Charge {
                token_class: STORAGE_CLASS,
                label: "cache storage".into(),
                quantity: token_seconds,
                amount: format!("{} token-hours", format_token_hours(token_seconds)),
                nanos,
                bp,
                per: " per hour",
                exact,
            }]
        },
    )?;
    Ok((in_force.unwrap_or(currency), lines))
}

/// Token-seconds as token-hours, to three decimals at most (`7200` → `2`, `5400` → `1.5`).
pub fn format_token_hours(token_seconds: i64) -> String {
    let milli = (token_seconds as i128 * 1000 + 1800) / 3600;
    let (whole, frac) = (milli / 1000, milli % 1000);
    if frac == 0 {
        whole.to_string()
    } else {
        format!("{whole}.{frac:03}")
            .trim_end_matches('0')
            .to_string()
    }
}

/// Reserved cache capacity: every whole hour of the month under each plan version.
async fn reserved_lines(
    conn: &mut sqlx::PgConnection,
    tenant: Uuid,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    currency: &str,
) -> Result<Vec<Line>, BillingError> {
    let plans = sqlx::query(
        r#"
        SELECT effective_from, reserved_cache_bytes, reserved_nanos_per_gb_hour,
               lead(effective_from) OVER (ORDER BY effective_from) AS until
        FROM tenant_plans WHERE tenant_id = $1 ORDER BY effective_from
        "#,
    )
    .bind(tenant)
    .fetch_all(&mut *conn)
    .await?;
    let mut lines = Vec::new();
    for p in plans {
        let start: DateTime<Utc> = p.get("effective_from");
        let until: Option<DateTime<Utc>> = p.get("until");
        let (bytes, rate): (i64, i64) = (
            p.get("reserved_cache_bytes"),
            p.get("reserved_nanos_per_gb_hour"),
        );
        let lo = start.max(from);
        let hi = until.unwrap_or(to).min(to);
        if bytes == 0 || rate == 0 || hi <= lo {
            continue;
        }
        let hours = (hi - lo).num_hours();
        let exact = Exact::reserved(bytes, hours, rate);
        lines.push(Line {
            kind: LineKind::Reserved,
            model: None,
            token_class: None,
            price_from: Some(start),
            quantity: bytes.saturating_mul(hours),
            exact_nanos: exact.nanos_decimal(),
            amount_minor: exact.to_minor(currency),
            description: format!(
                "reserved cache: {bytes} bytes × {hours} h at {rate} nano per GB-hour"
            ),
        });
    }

    Ok(lines)
}

/// Adjustments not yet billed elsewhere (or billed on this month's draft).
async fn adjustment_lines(
    conn: &mut sqlx::PgConnection,
    tenant: Uuid,
    from: DateTime<Utc>,
    currency: &str,
) -> Result<Vec<Line>, BillingError> {
    let adjustments = sqlx::query(
        r#"
        SELECT a.id, a.amount_minor, a.reason, a.corrects_invoice
        FROM adjustments a
        LEFT JOIN invoices i ON i.id = a.billed_on
        WHERE a.tenant_id = $1
          AND (a.billed_on IS NULL OR (i.period_start = $2 AND i.status = 'draft'))
        ORDER BY a.created_at, a.id
        "#,
    )
    .bind(tenant)
    .bind(from.date_naive())
    .fetch_all(&mut *conn)
    .await?;
    let mut lines = Vec::new();
    for a in adjustments {
        let minor: i64 = a.get("amount_minor");
        let corrects: Option<Uuid> = a.get("corrects_invoice");
        lines.push(Line {
            kind: LineKind::Adjustment,
            model: None,
            token_class: None,
            price_from: None,
            quantity: 1,
            exact_nanos: Exact::from_minor(minor, currency).nanos_decimal(),
            amount_minor: minor,
            description: match corrects {
                Some(inv) => format!(
                    "adjustment to invoice {inv}: {}",
                    a.get::<String, _>("reason")
                ),
                None => format!("adjustment: {}", a.get::<String, _>("reason")),
            },
        });
    }

    Ok(lines)
}

async fn write_draft(
    tx: &mut Transaction<'_, Postgres>,
    inv: &Invoice,
    actor: &str,
) -> Result<(), BillingError> {
    sqlx::query(
        r#"
        INSERT INTO invoices (id, tenant_id, period_start, currency, status, total_minor, computed_at)
        VALUES ($1, $2, $3, $4, 'draft', $5, $6)
        ON CONFLICT (tenant_id, period_start)
        DO UPDATE SET currency = EXCLUDED.currency, total_minor = EXCLUDED.total_minor,
                      computed_at = EXCLUDED.computed_at
        "#,
    )
    .bind(inv.id)
    .bind(inv.tenant_id)
    .bind(inv.period_start)
    .bind(&inv.currency)
    .bind(inv.total_minor)
    .bind(inv.rated_at)
    .execute(&mut **tx)
    .await?;
    sqlx::query("DELETE FROM invoice_lines WHERE invoice_id = $1")
        .bind(inv.id)
        .execute(&mut **tx)
        .await?;
    for (i, l) in inv.lines.iter().enumerate() {
        sqlx::query(
            r#"
            INSERT INTO invoice_lines (invoice_id, line_no, kind, model, token_class, price_from,
                                       quantity, exact_nanos, amount_minor, description)
            VALUES ($1, $2, $3, $4, $5, $6, $7, $8::NUMERIC, $9, $10)
            "#,
        )
        .bind(inv.id)
        .bind(i as i32 + 1)
        .bind(l.kind.as_str())
        .bind(&l.model)
        .bind(&l.token_class)
        .bind(l.price_from)
        .bind(l.quantity)
        .bind(&l.exact_nanos)
        .bind(l.amount_minor)
        .bind(&l.description)
        .execute(&mut **tx)
        .await?;
    }
    // The draft takes in the adjustments it bills.
    sqlx::query(
        r#"
        UPDATE adjustments SET billed_on = $2
        WHERE tenant_id = $1 AND billed_on IS NULL
        "#,
    )
    .bind(inv.tenant_id)
    .bind(inv.id)
    .execute(&mut **tx)
    .await?;
    sqlx::query("INSERT INTO billing_audit (actor, action, details) VALUES ($1, 'rate', $2)")
        .bind(actor)
        .bind(serde_json::json!({
            "invoice": inv.id, "tenant": inv.tenant_id, "period_start": inv.period_start,
            "total_minor": inv.total_minor, "total": format_minor(inv.total_minor, &inv.currency),
            "currency": inv.currency, "lines": inv.lines.len(),
        }))
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Lock the tenant's month so two raters never interleave.
async fn lock(
    tx: &mut Transaction<'_, Postgres>,
    tenant: Uuid,
    month: NaiveDate,
) -> Result<Option<String>, BillingError> {
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))")
        .bind(format!("invoice:{tenant}:{month}"))
        .execute(&mut **tx)
        .await?;
    let status: Option<String> = sqlx::query_scalar(
        "SELECT status FROM invoices WHERE tenant_id = $1 AND period_start = $2",
    )
    .bind(tenant)
    .bind(month)
    .fetch_optional(&mut **tx)
    .await?;
    Ok(status)
}

/// Recompute and store the month's draft (an audited rating run). A finalized month is
/// refused.
pub async fn refresh_draft(
    pool: &PgPool,
    tenant: Uuid,
    month: NaiveDate,
    actor: &str,
) -> Result<Invoice, BillingError> {
    let (from, _) = month_bounds(month)?;
    let month = from.date_naive();
    let mut tx = pool.begin().await?;
    if lock(&mut tx, tenant, month).await?.as_deref() == Some("finalized") {
        return Err(BillingError::Finalized { tenant, month });
    }
    let inv = compute(pool, tenant, month).await?;
    write_draft(&mut tx, &inv, actor).await?;
    tx.commit().await?;
    Ok(inv)
}

/// Rate the month one last time and finalize it. Only a month that has ended can be
/// finalized.
pub async fn finalize(
    pool: &PgPool,
    tenant: Uuid,
    month: NaiveDate,
    actor: &str,
    now: DateTime<Utc>,
) -> Result<Invoice, BillingError> {
    let (from, to) = month_bounds(month)?;
    if now < to {
        return Err(BillingError::Invalid(format!(
            "the month of {} is still open until {to}",
            from.date_naive()
        )));
    }
    let month = from.date_naive();
    let mut tx = pool.begin().await?;
    if lock(&mut tx, tenant, month).await?.as_deref() == Some("finalized") {
        return Err(BillingError::Finalized { tenant, month });
    }
    let mut inv = compute(pool, tenant, month).await?;
    if !inv.unpriced.is_empty() {
        // A draft lists unpriced usage at zero; a final invoice must not bill it as free.
        return Err(BillingError::Unpriced {
            models: inv.unpriced,
        });
    }
    write_draft(&mut tx, &inv, actor).await?;
    let finalized_at: DateTime<Utc> = sqlx::query_scalar(
        "UPDATE invoices SET status = 'finalized', finalized_at = now(), finalized_by = $2 \
         WHERE id = $1 RETURNING finalized_at",
    )
    .bind(inv.id)
    .bind(actor)
    .fetch_one(&mut *tx)
    .await?;
    sqlx::query("INSERT INTO billing_audit (actor, action, details) VALUES ($1, 'finalize', $2)")
        .bind(actor)
        .bind(serde_json::json!({"invoice": inv.id, "tenant": tenant, "total_minor": inv.total_minor}))
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    inv.status = "finalized".into();
    inv.finalized_at = Some(finalized_at);
    Ok(inv)
}

/// Record a correction to a finalized invoice: billed on the tenant's next draft.
pub async fn add_adjustment(
    pool: &PgPool,
    tenant: Uuid,
    corrects: Option<Uuid>,
    amount_minor: i64,
    reason: &str,
    actor: &str,
) -> Result<Uuid, BillingError> {
    if reason.trim().is_empty() {
        return Err(BillingError::Invalid("an adjustment needs a reason".into()));
    }
    let id = Uuid::now_v7();
    let mut tx = pool.begin().await?;
    sqlx::query(
        "INSERT INTO adjustments (id, tenant_id, corrects_invoice, amount_minor, reason, created_by) VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(id)
    .bind(tenant)
    .bind(corrects)
    .bind(amount_minor)
    .bind(reason)
    .bind(actor)
    .execute(&mut *tx)
    .await?;
    sqlx::query("INSERT INTO billing_audit (actor, action, details) VALUES ($1, 'adjustment', $2)")
        .bind(actor)
        .bind(serde_json::json!({"adjustment": id, "tenant": tenant, "corrects": corrects, "amount_minor": amount_minor, "reason": reason}))
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(id)
}

/// A stored invoice with its lines.
pub async fn load(pool: &PgPool, id: Uuid) -> Result<Option<Invoice>, BillingError> {
    let Some(h) = sqlx::query(
        "SELECT id, tenant_id, period_start, currency, status, total_minor, computed_at, finalized_at \
         FROM invoices WHERE id = $1",
    )
    .bind(id)
    .fetch_optional(pool)
    .await?
    else {
        return Ok(None);
    };
    let lines: Vec<Line> = sqlx::query(
        r#"SELECT kind, model, token_class, price_from, quantity, exact_nanos::TEXT AS exact,
                  amount_minor, description
           FROM invoice_lines WHERE invoice_id = $1 ORDER BY line_no"#,
    )
    .bind(id)
    .fetch_all(pool)
    .await?
    .into_iter()
    .map(|r| Line {
        kind: match r.get::<String, _>("kind").as_str() {
            "usage" => LineKind::Usage,
            "storage" => LineKind::Storage,
            "reserved" => LineKind::Reserved,
            _ => LineKind::Adjustment,
        },
        model: r.get("model"),
        token_class: r.get("token_class"),
        price_from: r.get("price_from"),
        quantity: r.get("quantity"),
        exact_nanos: r.get("exact"),
        amount_minor: r.get("amount_minor"),
        description: r.get("description"),
    })
    .collect();
    Ok(Some(Invoice {
        id: h.get("id"),
        tenant_id: h.get("tenant_id"),
        period_start: h.get("period_start"),
        currency: h.get("currency"),
        status: h.get("status"),
        total_minor: h.get("total_minor"),
        unpriced: unpriced_models(&lines),
        rated_at: h.get("computed_at"),
        finalized_at: h.get("finalized_at"),
        lines,
    }))
}
