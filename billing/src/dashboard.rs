//! Usage, cost and cache savings over time, read from the hourly rollups (never the raw
//! ledger), for the admin console's dashboards and budget checks.
//!
//! Each rollup row (tenant × model × key × hour) is rated with the price in force at the start
//! of its hour: the tenant's custom rate for the model if it has one, else the list price, less
//! the plan's discount ([`crate::invoice`] rates each ledger row at its own start time; the two
//! agree whenever prices change on the hour). Amounts are exact until they are shown: each
//! point and each total is rounded once, half away from zero, to the currency's minor unit.
//!
//! **Cost saved by caching** is what the same tokens would have cost with no cache at all (every
//! cache write and read billed as plain input) minus what they cost: the read discount less the
//! write premium. It is negative when writes are never read back.
//!
//! **Cache objects held** (`cache_storage_events`, [`crate::storage`]) are read per hour beside
//! the rollups and rated at the price in force at each hour's start: their token-seconds are
//! in `cache_storage_token_seconds` and their cost in `cost_minor`. They have no cost without
//! the cache, so they count against what caching saved.
//!
//! **Hit ratio** is the share of prompt tokens served from the cache:
//! `cache_read / (input + cache_write_5m + cache_write_1h + cache_read)`.

use std::collections::{BTreeMap, HashMap};

use chrono::{DateTime, Datelike, DurationRound, TimeDelta, TimeZone, Utc};
use serde::{Deserialize, Serialize};
use sqlx::{PgPool, Row};
use utoipa::ToSchema;
use uuid::Uuid;

use crate::invoice::BillingError;
use crate::money::{Exact, Rates, TokenClass, TokenCounts, format_exact};

/// Bucket size of a series.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Granularity {
    Hour,
    Day,
}

/// What a series is split by, besides time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum GroupBy {
    #[default]
    None,
    Model,
    ApiKey,
    Workspace,
    /// By the value of one tag of each key ([`UsageQuery::key_tags`]).
    Tag,
}

/// Token counts by class, requests, and cache objects held.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, ToSchema)]
pub struct Tokens {
    pub requests: i64,
    #[serde(flatten)]
    pub counts: TokenCounts,
    /// Cache objects held: tokens × seconds (÷ 3600 for token-hours).
    pub cache_storage_token_seconds: i64,
}

impl Tokens {
    fn add(&mut self, o: &Tokens) {
        self.requests += o.requests;
        self.counts.add(&o.counts);
        self.cache_storage_token_seconds += o.cache_storage_token_seconds;
    }

    /// Prompt tokens of every class (what a request without any cache would bill as input).
    pub fn prompt_tokens(&self) -> i64 {
        self.counts.prompt()
    }

    /// Share of prompt tokens read from the cache (0 when there were none).
    pub fn hit_ratio(&self) -> f64 {
        let p = self.prompt_tokens();
        if p == 0 {
            0.0
        } else {
            self.counts.cache_read_tokens as f64 / p as f64
        }
    }
}

/// Exact cost of some tokens, and what they would have cost without the cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cost {
    pub actual: Exact,
    pub without_cache: Exact,
    /// Tokens no price covered (rated as zero; shown so a missing price is never silent);
    /// cache objects held count their token-hours, rounded up.
    pub unpriced_tokens: i64,
}

impl Cost {
    fn add(&mut self, o: &Cost) {
        self.actual = self.actual + o.actual;
        self.without_cache = self.without_cache + o.without_cache;
        self.unpriced_tokens += o.unpriced_tokens;
    }
}

/// One point of a series (or the totals).
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct UsagePoint {
    /// Start of the bucket (absent on totals).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bucket_start: Option<DateTime<Utc>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_key: Option<Uuid>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workspace: Option<Uuid>,
    /// The tag's value in a report split by `tag` (absent: keys without that tag).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    #[serde(flatten)]
    pub tokens: Tokens,
    /// Share of prompt tokens served from the cache, 0..1.
    pub hit_ratio: f64,
    /// What was billed, in minor units of `currency`.
    pub cost_minor: i64,
    /// What the same tokens would have cost with no cache.
    pub cost_without_cache_minor: i64,
    /// `cost_without_cache_minor − cost_minor` (rounded once from the exact difference).
    pub saved_minor: i64,
    /// The exact amounts behind the three above, in the currency with every significant
    /// decimal (`0.0000519`): what a console shows where a rounded amount would read 0.
    pub cost: String,
    pub cost_without_cache: String,
    pub saved: String,
    pub unpriced_tokens: i64,
}

/// A usage report.
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct UsageReport {
    pub tenant: Uuid,
    /// The one workspace the report covers, if it was asked for one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workspace: Option<Uuid>,
    pub from: DateTime<Utc>,
    pub to: DateTime<Utc>,
    pub granularity: Granularity,
    pub group_by: GroupBy,
    pub currency: String,
    pub totals: UsagePoint,
    pub series: Vec<UsagePoint>,
}

/// A tenant's prices over time: list prices, custom rates, plan discounts, each sorted by
/// `effective_from`.
pub struct Rater {
    list: HashMap<String, Vec<(DateTime<Utc>, String, Rates)>>,
    custom: HashMap<String, Vec<(DateTime<Utc>, Rates)>>,
    discounts: Vec<(DateTime<Utc>, i32)>,
}

fn in_force<T>(versions: &[(DateTime<Utc>, T)], at: DateTime<Utc>) -> Option<&T> {
    let i = versions.partition_point(|(from, _)| *from <= at);
    i.checked_sub(1).map(|i| &versions[i].1)
}

fn rates_of(r: &sqlx::postgres::PgRow) -> Rates {
    Rates {
        input_nanos: r.get("input_nanos"),
        output_nanos: r.get("output_nanos"),
        cache_write_5m_bp: r.get("cache_write_5m_bp"),
        cache_write_1h_bp: r.get("cache_write_1h_bp"),
        cache_read_bp: r.get("cache_read_bp"),
        cache_storage_hour_bp: r.get("cache_storage_hour_bp"),
    }
}

impl Rater {
    /// Load every price that can apply to `tenant`.
    pub async fn load(pool: &PgPool, tenant: Uuid) -> Result<Self, BillingError> {
        let mut list: HashMap<String, Vec<(DateTime<Utc>, String, Rates)>> = HashMap::new();
        for r in sqlx::query(
            "SELECT model, effective_from, currency, input_nanos, output_nanos, cache_write_5m_bp, \
             cache_write_1h_bp, cache_read_bp, cache_storage_hour_bp FROM price_book \
             ORDER BY model, effective_from",
        )
        .fetch_all(pool)
        .await?
        {
            list.entry(r.get("model")).or_default().push((
                r.get("effective_from"),
                r.get("currency"),
                rates_of(&r),
            ));
        }
        let mut custom: HashMap<String, Vec<(DateTime<Utc>, Rates)>> = HashMap::new();
        for r in sqlx::query(
            "SELECT model, effective_from, input_nanos, output_nanos, cache_write_5m_bp, \
             cache_write_1h_bp, cache_read_bp, cache_storage_hour_bp FROM tenant_prices \
             WHERE tenant_id = $1 \
             ORDER BY model, effective_from",
        )
        .bind(tenant)
        .fetch_all(pool)
        .await?
        {
            custom
                .entry(r.get("model"))
                .or_default()
                .push((r.get("effective_from"), rates_of(&r)));
        }
        let discounts = sqlx::query(
            "SELECT effective_from, discount_bp FROM tenant_plans WHERE tenant_id = $1 \
             ORDER BY effective_from",
        )
        .bind(tenant)
        .fetch_all(pool)
        .await?
        .into_iter()
        .map(|r| (r.get("effective_from"), r.get("discount_bp")))
        .collect();
        Ok(Self {
            list,
            custom,
            discounts,
        })
    }

    /// Every instant at which a price, custom rate or discount of this tenant changes.
    pub fn changes(&self) -> impl Iterator<Item = DateTime<Utc>> + '_ {
        self.list
            .values()
            .flat_map(|v| v.iter().map(|(t, _, _)| *t))
            .chain(self.custom.values().flat_map(|v| v.iter().map(|(t, _)| *t)))
            .chain(self.discounts.iter().map(|(t, _)| *t))
    }

    /// The currency of the list price of `model` in force at `at`.
    pub fn currency(&self, model: &str, at: DateTime<Utc>) -> Option<&str> {
        let v = self.list.get(model)?;
        let i = v.partition_point(|(from, _, _)| *from <= at);
        i.checked_sub(1).map(|i| v[i].1.as_str())
    }

    fn rates(&self, model: &str, at: DateTime<Utc>) -> Option<Rates> {
        if let Some(r) = self.custom.get(model).and_then(|v| in_force(v, at)) {
            return Some(*r);
        }
        let v = self.list.get(model)?;
        let i = v.partition_point(|(from, _, _)| *from <= at);
        i.checked_sub(1).map(|i| v[i].2)
    }

    /// Rate `tokens` of `model` used at `at`.
    pub fn rate(&self, model: &str, at: DateTime<Utc>, tokens: &Tokens) -> Cost {
        let Some(rates) = self.rates(model, at) else {
            return Cost {
                unpriced_tokens: tokens.prompt_tokens()
                    + tokens.counts.output_tokens
                    + (tokens.cache_storage_token_seconds + 3599) / 3600,
                ..Cost::default()
            };
        };
        let discount = in_force(&self.discounts, at).copied().unwrap_or(0);
        let actual = TokenClass::ALL
            .into_iter()
            .map(|c| Exact::usage(tokens.counts.of(c), &rates, c, discount))
            .sum::<Exact>()
            + Exact::storage(tokens.cache_storage_token_seconds, &rates, discount);
        let without_cache =
            Exact::usage(tokens.prompt_tokens(), &rates, TokenClass::Input, discount)
                + Exact::usage(
                    tokens.counts.output_tokens,
                    &rates,
                    TokenClass::Output,
                    discount,
                );
        Cost {
            actual,
            without_cache,
            unpriced_tokens: 0,
        }
    }
}

/// What a point of a series is, besides its bucket: the group it stands for.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
struct Group {
    model: Option<String>,
    api_key: Option<Uuid>,
    workspace: Option<Uuid>,
    tag: Option<String>,
}

fn point(
    bucket_start: Option<DateTime<Utc>>,
    group: Group,
    tokens: Tokens,
    cost: Cost,
    currency: &str,
) -> UsagePoint {
    let saved = Exact(cost.without_cache.0 - cost.actual.0);
    UsagePoint {
        bucket_start,
        model: group.model,
        api_key: group.api_key,
        workspace: group.workspace,
        tag: group.tag,
        hit_ratio: tokens.hit_ratio(),
        tokens,
        cost_minor: cost.actual.to_minor(currency),
        cost_without_cache_minor: cost.without_cache.to_minor(currency),
        saved_minor: saved.to_minor(currency),
        cost: format_exact(cost.actual, currency),
        cost_without_cache: format_exact(cost.without_cache, currency),
        saved: format_exact(saved, currency),
        unpriced_tokens: cost.unpriced_tokens,
    }
}

/// Start of the bucket holding `t`.
fn bucket_of(t: DateTime<Utc>, g: Granularity) -> DateTime<Utc> {
    let step = match g {
        Granularity::Hour => TimeDelta::hours(1),
        Granularity::Day => TimeDelta::days(1),
    };
    t.duration_trunc(step).unwrap_or(t)
}

/// What a usage report covers and how it is split.
#[derive(Clone, Copy, Debug)]
pub struct UsageQuery<'a> {
    pub tenant: Uuid,
    pub from: DateTime<Utc>,
    pub to: DateTime<Utc>,
    pub granularity: Granularity,
    pub group_by: GroupBy,
    /// Only this workspace's keys.
    pub workspace: Option<Uuid>,
    /// The workspace of each of the tenant's keys, `(key, workspace)`: what a report split
    /// or filtered by workspace reads (the rollups carry the key; the keys are the control
    /// plane's, which passes them in), refused without it. A key not listed belongs to no
    /// workspace.
    pub key_workspaces: Option<&'a [(Uuid, Uuid)]>,
    /// The value of the tag a report split by `tag` reads, for each key that has it (keys
    /// not listed go together, untagged); refused without it.
    pub key_tags: Option<&'a HashMap<Uuid, String>>,
}

impl UsageQuery<'static> {
    /// The whole tenant over `[from, to)` in daily buckets, not split.
    pub fn tenant(tenant: Uuid, from: DateTime<Utc>, to: DateTime<Utc>) -> Self {
        Self {
            tenant,
            from,
            to,
            granularity: Granularity::Day,
            group_by: GroupBy::None,
            workspace: None,
            key_workspaces: None,
            key_tags: None,
        }
    }
}

/// Usage of a tenant (or one of its workspaces) over the whole hours covering `[from, to)`
/// (the rollups' resolution; the report says which), per bucket of `granularity`, split by
/// `group_by`, with totals. Empty buckets are left out. A workspace is its keys' usage (a key
/// never changes workspace).
pub async fn usage(pool: &PgPool, q: &UsageQuery<'_>) -> Result<UsageReport, BillingError> {
    let UsageQuery {
        tenant,
        from,
        to,
        granularity,
        group_by,
        workspace,
        ..
    } = *q;
    let (from, to) = whole_hours(from, to)?;
    if group_by == GroupBy::Tag && q.key_tags.is_none() {
        return Err(BillingError::Invalid(
            "a usage report by tag needs the keys' tags".into(),
        ));
    }
    let rater = Rater::load(pool, tenant).await?;
    let rows = rolled_up(pool, q, &rater, from, to).await?;
    let storage = storage_held(pool, q, from, to).await?;

    type Key = (DateTime<Utc>, Group);
    let mut buckets: BTreeMap<Key, (Tokens, Cost)> = BTreeMap::new();
    let mut totals = (Tokens::default(), Cost::default());
    let mut currencies: Vec<String> = Vec::new();
    let usage = rows.into_iter().map(|r| {
        let tokens = Tokens {
            requests: r.get("requests"),
            counts: TokenCounts {
                input_tokens: r.get("input_tokens"),
                cache_write_5m_tokens: r.get("w5"),
                cache_write_1h_tokens: r.get("w1"),
                cache_read_tokens: r.get("rd"),
                output_tokens: r.get("output_tokens"),
            },
            cache_storage_token_seconds: 0,
        };
        (r, tokens)
    });
    let held = storage.into_iter().map(|r| {
        let tokens = Tokens {
            cache_storage_token_seconds: r.get("token_seconds"),
            ..Tokens::default()
        };
        (r, tokens)
    });
    for (r, tokens) in usage.chain(held) {
        let hour: DateTime<Utc> = r.get("bucket_start");
        let model: String = r.get("model");
        let cost = rater.rate(&model, hour, &tokens);
        if let Some(c) = rater.currency(&model, hour)
            && !currencies.iter().any(|x| x == c)
        {
            currencies.push(c.to_string());
        }
        let api_key: Option<Uuid> = r.get("api_key");
        let group = match (group_by, q.key_tags) {
            // Split by a tag: the keys' usage goes to their tag's value.
            (GroupBy::Tag, Some(tags)) => Group {
                tag: api_key.and_then(|k| tags.get(&k).cloned()),
                ..Group::default()
            },
            _ => Group {
                model: (group_by == GroupBy::Model).then(|| model.clone()),
                api_key,
                workspace: r.get("workspace"),
                tag: None,
            },
        };
        let key = (bucket_of(hour, granularity), group);
        let e = buckets.entry(key).or_default();
        e.0.add(&tokens);
        e.1.add(&cost);
        totals.0.add(&tokens);
        totals.1.add(&cost);
    }
    if currencies.len() > 1 {
        return Err(BillingError::MixedCurrency { tenant, currencies });
    }
    let currency = currencies.pop().unwrap_or_else(|| "USD".to_string());
    let series = buckets
        .into_iter()
        .map(|((at, group), (t, c))| point(Some(at), group, t, c, &currency))
        .collect();
    Ok(UsageReport {
        tenant,
        workspace,
        from,
        to,
        granularity,
        group_by,
        totals: point(None, Group::default(), totals.0, totals.1, &currency),
        currency,
        series,
    })
}

/// The whole hours covering `[from, to)` (the rollups' resolution), for a window of at most
/// 400 days.
fn whole_hours(
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> Result<(DateTime<Utc>, DateTime<Utc>), BillingError> {
    if to <= from {
        return Err(BillingError::Invalid("`to` must be after `from`".into()));
    }
    if (to - from) > TimeDelta::days(400) {
        return Err(BillingError::Invalid(
            "a usage window may span at most 400 days".into(),
        ));
    }
    let hour = TimeDelta::hours(1);
    let from = bucket_of(from, Granularity::Hour);
    let to = match bucket_of(to, Granularity::Hour) {
        t if t == to => t,
        t => t + hour,
    };
    Ok((from, to))
}

/// The rollup rows of the usage `q` asks for over the whole hours `[from, to)`, summed per
/// hour or day, model, and key or workspace where it splits by them.
async fn rolled_up(
    pool: &PgPool,
    q: &UsageQuery<'_>,
    rater: &Rater,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> Result<Vec<sqlx::postgres::PgRow>, BillingError> {
    let UsageQuery {
        tenant,
        granularity,
        group_by,
        workspace,
        key_workspaces,
        ..
    } = *q;
    // Daily buckets read the daily rollups (24× fewer rows) for every whole day in the window
    // whose prices do not change during it; the window's partial days and days with a price
    // change inside them read the hourly ones, so every row is still rated at its own hour.
    let day = TimeDelta::days(1);
    let (whole_from, whole_to) = match granularity {
        Granularity::Day => {
            let f = bucket_of(from, Granularity::Day);
            let f = if f == from { f } else { f + day };
            (f, bucket_of(to, Granularity::Day).max(f))
        }
        Granularity::Hour => (from, from),
    };
    let dirty: Vec<DateTime<Utc>> = rater
        .changes()
        .filter(|t| *t > whole_from && *t < whole_to)
        .filter(|t| *t != bucket_of(*t, Granularity::Day))
        .map(|t| bucket_of(t, Granularity::Day))
        .collect();
    // A key's workspace is where its usage goes: the keys' workspaces are joined only when a
    // report splits or filters by workspace.
    let by_workspace = group_by == GroupBy::Workspace || workspace.is_some();
    let (ws, ws_join) = if by_workspace {
        (
            "k.workspace_id",
            "LEFT JOIN unnest($10::UUID[], $11::UUID[]) AS k(id, workspace_id) ON k.id = r.api_key_id",
        )
    } else {
        ("NULL::UUID", "")
    };
    let query = sqlx::query(sqlx::AssertSqlSafe(format!(
        r#"
        SELECT bucket_start, model, CASE WHEN $4 THEN api_key_id END AS api_key,
               CASE WHEN $8 THEN {ws} END AS workspace,
               sum(requests)::BIGINT AS requests, sum(input_tokens)::BIGINT AS input_tokens,
               sum(cache_write_5m_tokens)::BIGINT AS w5, sum(cache_write_1h_tokens)::BIGINT AS w1,
               sum(cache_read_tokens)::BIGINT AS rd, sum(output_tokens)::BIGINT AS output_tokens
        FROM usage_rollups r {ws_join}
        WHERE r.tenant_id = $1 AND ($9::UUID IS NULL OR {ws} = $9) AND (
              (granularity = 'day' AND bucket_start >= $5 AND bucket_start < $6
               AND NOT (bucket_start = ANY($7)))
           OR (granularity = 'hour' AND bucket_start >= $2 AND bucket_start < $3
               AND (bucket_start < $5 OR bucket_start >= $6
                    OR date_trunc('day', bucket_start, 'UTC') = ANY($7))))
        GROUP BY 1, 2, 3, 4
        "#
    )))
    .bind(tenant)
    .bind(from)
    .bind(to)
    .bind(matches!(group_by, GroupBy::ApiKey | GroupBy::Tag))
    .bind(whole_from)
    .bind(whole_to)
    .bind(&dirty)
    .bind(group_by == GroupBy::Workspace)
    .bind(workspace);
    let query = if by_workspace {
        let Some(key_workspaces) = key_workspaces else {
            return Err(BillingError::Invalid(
                "a usage report by workspace needs the keys' workspaces".into(),
            ));
        };
        let (keys, workspaces): (Vec<Uuid>, Vec<Uuid>) = key_workspaces.iter().copied().unzip();
        query.bind(keys).bind(workspaces)
    } else {
        query
    };
    Ok(query.fetch_all(pool).await?)
}

/// Cache objects held over `[from, to)`, per hour (the storage ledger is hourly already).
async fn storage_held(
    pool: &PgPool,
    q: &UsageQuery<'_>,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> Result<Vec<sqlx::postgres::PgRow>, BillingError> {
    Ok(sqlx::query(
        r#"
        SELECT hour_start AS bucket_start, model, CASE WHEN $4 THEN api_key_id END AS api_key,
               CASE WHEN $5 THEN workspace_id END AS workspace,
               sum(tokens * seconds)::BIGINT AS token_seconds
        FROM cache_storage_events
        WHERE tenant_id = $1 AND hour_start >= $2 AND hour_start < $3
          AND ($6::UUID IS NULL OR workspace_id = $6)
        GROUP BY 1, 2, 3, 4
        "#,
    )
    .bind(q.tenant)
    .bind(from)
    .bind(to)
    .bind(matches!(q.group_by, GroupBy::ApiKey | GroupBy::Tag))
    .bind(q.group_by == GroupBy::Workspace)
    .bind(q.workspace)
    .fetch_all(pool)
    .await?)
}

/// The tenants with usage or cache objects held in `[from, to)` (whole hours).
pub async fn tenants_with_usage(
    pool: &PgPool,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> Result<Vec<Uuid>, BillingError> {
    Ok(sqlx::query_scalar(
        "SELECT DISTINCT tenant_id FROM usage_rollups \
         WHERE granularity = 'hour' AND bucket_start >= $1 AND bucket_start < $2 \
         UNION SELECT DISTINCT tenant_id FROM cache_storage_events \
         WHERE hour_start >= $1 AND hour_start < $2",
    )
    .bind(from)
    .bind(to)
    .fetch_all(pool)
    .await?)
}

/// The calendar month (UTC) holding `now`: its start and the start of the next.
pub fn month_of(now: DateTime<Utc>) -> (DateTime<Utc>, DateTime<Utc>) {
    let start = Utc
        .with_ymd_and_hms(now.year(), now.month(), 1, 0, 0, 0)
        .single()
        .unwrap_or(now);
    let (y, m) = if now.month() == 12 {
        (now.year() + 1, 1)
    } else {
        (now.year(), now.month() + 1)
    };
    let next = Utc
        .with_ymd_and_hms(y, m, 1, 0, 0, 0)
        .single()
        .unwrap_or(now);
    (start, next)
}

/// What `tenant` (or one of its workspaces) has spent this month so far (from the rollups, so
/// up to a minute behind), in minor units of its currency.
pub async fn month_spend(
    pool: &PgPool,
    tenant: Uuid,
    workspace: Option<(Uuid, &[(Uuid, Uuid)])>,
    now: DateTime<Utc>,
) -> Result<(String, i64), BillingError> {
    let (start, next) = month_of(now);
    let q = UsageQuery {
        workspace: workspace.map(|(w, _)| w),
        key_workspaces: workspace.map(|(_, keys)| keys),
        ..UsageQuery::tenant(tenant, start, next)
    };
    let r = usage(pool, &q).await?;
    Ok((r.currency, r.totals.cost_minor))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> DateTime<Utc> {
        s.parse().unwrap()
    }

    fn rater() -> Rater {
        let list_rates = Rates::standard(3_000, 15_000);
        let mut list = HashMap::new();
        list.insert(
            "m".to_string(),
            vec![(t("2026-01-01T00:00:00Z"), "USD".to_string(), list_rates)],
        );
        let mut custom = HashMap::new();
        custom.insert(
            "m".to_string(),
            vec![(
                t("2026-06-01T00:00:00Z"),
                Rates {
                    input_nanos: 1_000,
                    ..list_rates
                },
            )],
        );
        Rater {
            list,
            custom,
            discounts: vec![(t("2026-09-01T00:00:00Z"), 5_000)],
        }
    }

    /// One million tokens of each class at $3/$15 per MTok with the default multipliers.
    fn mtok() -> Tokens {
        let each = 1_000_000;
        Tokens {
            requests: 1,
            counts: TokenCounts {
                input_tokens: each,
                cache_write_5m_tokens: each,
                cache_write_1h_tokens: each,
                cache_read_tokens: each,
                output_tokens: each,
            },
            cache_storage_token_seconds: 0,
        }
    }

    #[test]
    fn objects_held_cost_what_they_are_held_and_save_nothing() {
        // 1M tokens held two hours at $3/MTok × 1.0 an hour: $6, all of it against savings.
        let held = Tokens {
            cache_storage_token_seconds: 1_000_000 * 7_200,
            ..Tokens::default()
        };
        let c = rater().rate("m", t("2026-02-01T00:00:00Z"), &held);
        assert_eq!(c.actual.to_minor("USD"), 600);
        assert_eq!(c.without_cache, Exact::ZERO);
        assert_eq!(held.hit_ratio(), 0.0);
        let none = rater().rate("other", t("2026-02-01T00:00:00Z"), &held);
        assert_eq!(
            (none.actual, none.unpriced_tokens),
            (Exact::ZERO, 2_000_000)
        );
    }

    #[test]
    fn savings_are_the_read_discount_less_the_write_premium() {
        let c = rater().rate("m", t("2026-02-01T00:00:00Z"), &mtok());
        // input 3 + 5m 3.75 + 1h 6 + read 0.30 + output 15 = $28.05
        assert_eq!(c.actual.to_minor("USD"), 2_805);
        // without a cache every prompt token is input: 4 × 3 + 15 = $27
        assert_eq!(c.without_cache.to_minor("USD"), 2_700);
        // saved: read 2.70 − premiums (0.75 + 3) = −1.05: writes that were not read back cost more
        assert_eq!(Exact(c.without_cache.0 - c.actual.0).to_minor("USD"), -105);
    }

    #[test]
    fn custom_rates_and_discounts_apply_from_their_time() {
        let r = rater();
        let before = r.rate("m", t("2026-05-31T23:00:00Z"), &mtok());
        let custom = r.rate("m", t("2026-06-01T00:00:00Z"), &mtok());
        let discounted = r.rate("m", t("2026-09-01T00:00:00Z"), &mtok());
        assert!(custom.actual < before.actual);
        assert_eq!(discounted.actual.0 * 2, custom.actual.0);
        let none = r.rate("other", t("2026-06-01T00:00:00Z"), &mtok());
        assert_eq!(none.actual, Exact::ZERO);
        assert_eq!(none.unpriced_tokens, 5_000_000);
        let early = r.rate("m", t("2025-12-31T23:00:00Z"), &mtok());
        assert_eq!(
            early.unpriced_tokens, 5_000_000,
            "no price before the first version"
        );
    }

    #[test]
    fn hit_ratio_counts_reads_over_every_prompt_token() {
        let tok = Tokens {
            counts: TokenCounts {
                input_tokens: 10,
                cache_write_5m_tokens: 20,
                cache_read_tokens: 70,
                ..TokenCounts::default()
            },
            ..Tokens::default()
        };
        assert!((tok.hit_ratio() - 0.7).abs() < 1e-12);
        assert_eq!(Tokens::default().hit_ratio(), 0.0);
    }

    #[test]
    fn months_roll_over_at_december() {
        let (s, n) = month_of(t("2026-12-15T10:00:00Z"));
        assert_eq!(s, t("2026-12-01T00:00:00Z"));
        assert_eq!(n, t("2027-01-01T00:00:00Z"));
    }
}
