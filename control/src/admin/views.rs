//! What a tenant's administrators look at: usage and savings over time (from the rollups,
//! never the raw ledger), budget status, and the cache.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::extract::State;
use billing::dashboard::{self, Granularity, GroupBy, UsageReport};
use cache_fabric::stats::TenantCacheStats;
use cachet_common::TenantId;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::Row;
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

use super::{Access, Admin, AdminPath, AdminQuery, AdminState, CacheSource};
use crate::tenants::{self, AdminError, policy};
use cachet_common::error::ApiError;
use cachet_common::error::ErrorBody;

/// Prefixes the cache view lists.
const TOP_PREFIXES: usize = 20;

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct UsageQuery {
    /// Start (inclusive), RFC 3339; rounded down to the hour.
    pub from: DateTime<Utc>,
    /// End (exclusive), RFC 3339; rounded up to the hour.
    pub to: DateTime<Utc>,
    /// `hour` or `day`; by default `hour` for windows up to three days, else `day`.
    pub granularity: Option<Granularity>,
    /// `none` (default), `model`, `api_key`, `workspace` or `tag` (with `tag`).
    #[serde(default)]
    pub group_by: GroupBy,
    /// Only the usage of this workspace's keys.
    pub workspace: Option<Uuid>,
    /// The tag a report split by `tag` reads (`team`): each key's value, its workspace's
    /// under its own.
    pub tag: Option<String>,
}

#[derive(Serialize, ToSchema)]
pub struct UsageView {
    #[serde(flatten)]
    pub report: UsageReport,
    /// Names of the keys in a series grouped by `api_key`.
    pub key_names: BTreeMap<Uuid, String>,
    /// Names of the workspaces in a series grouped by `workspace`.
    pub workspace_names: BTreeMap<Uuid, String>,
    /// The tag names the tenant's keys and workspaces carry (what a report can split by).
    pub tag_names: Vec<String>,
    /// Cache writes the fabric did not hold in the range's hours, by reason (none when all
    /// were held): why the usage may show fewer cache writes than breakpoints asked for.
    pub cache_writes_not_held: Vec<crate::tenants::refusals::NotHeldCount>,
}

/// Tokens by class, requests, hit ratio, cost and cost saved by caching (net of the write
/// premium) over time, from the hourly rollups (kept current every minute).
#[utoipa::path(get, path = "/v1/admin/tenants/{id}/usage", tag = "admin", operation_id = "tenant_usage",
    params(("id" = Uuid, Path, description = "Tenant id"), UsageQuery),
    responses((status = 200, body = UsageView), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn usage(
    State(state): State<AdminState>,
    admin: Admin,
    AdminPath(id): AdminPath<Uuid>,
    AdminQuery(q): AdminQuery<UsageQuery>,
) -> Result<axum::Json<UsageView>, ApiError> {
    admin.tenant(id, Access::Read)?;
    tenants::ensure_tenant(&state.pool, TenantId(id)).await?;
    let granularity = q
        .granularity
        .unwrap_or(if q.to - q.from <= chrono::Duration::days(3) {
            Granularity::Hour
        } else {
            Granularity::Day
        });
    let key_workspaces = if q.group_by == GroupBy::Workspace || q.workspace.is_some() {
        tenants::directory::key_workspaces(&state.pool, id)
            .await
            .map_err(AdminError::from)?
    } else {
        Vec::new()
    };
    let key_tags = tenants::directory::key_tags(&state.pool, id)
        .await
        .map_err(AdminError::from)?;
    let tag_names: Vec<String> = key_tags
        .values()
        .flat_map(|t| t.keys().cloned())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    let by_tag: Option<std::collections::HashMap<Uuid, String>> = match (q.group_by, &q.tag) {
        (GroupBy::Tag, None) => {
            return Err(ApiError::invalid("tag: required when group_by is tag"));
        }
        (GroupBy::Tag, Some(tag)) => Some(
            key_tags
                .iter()
                .filter_map(|(k, t)| t.get(tag).map(|v| (*k, v.clone())))
                .collect(),
        ),
        _ => None,
    };
    let report = dashboard::usage(
        &state.pool,
        &dashboard::UsageQuery {
            tenant: id,
            from: q.from,
            to: q.to,
            granularity,
            group_by: q.group_by,
            workspace: q.workspace,
            key_workspaces: Some(&key_workspaces),
            key_tags: by_tag.as_ref(),
        },
    )
    .await?;
    let mut key_names = BTreeMap::new();
    let mut workspace_names = BTreeMap::new();
    if q.group_by == GroupBy::Workspace {
        let ids: Vec<Uuid> = report.series.iter().filter_map(|p| p.workspace).collect();
        for r in
            sqlx::query("SELECT id, name FROM workspaces WHERE id = ANY($1) AND tenant_id = $2")
                .bind(&ids)
                .bind(id)
                .fetch_all(&state.pool)
                .await
                .map_err(AdminError::from)?
        {
            workspace_names.insert(r.get("id"), r.get("name"));
        }
    }
    if q.group_by == GroupBy::ApiKey {
        let ids: Vec<Uuid> = report.series.iter().filter_map(|p| p.api_key).collect();
        for r in sqlx::query("SELECT id, name, visible_prefix FROM api_keys WHERE id = ANY($1)")
            .bind(&ids)
            .fetch_all(&state.pool)
            .await
            .map_err(AdminError::from)?
        {
            let (name, prefix): (String, String) = (r.get("name"), r.get("visible_prefix"));
            key_names.insert(r.get("id"), format!("{name} ({prefix}…)"));
        }
    }
    let cache_writes_not_held =
        crate::tenants::refusals::not_held(&state.pool, id, q.from, q.to).await?;
    Ok(axum::Json(UsageView {
        report,
        key_names,
        workspace_names,
        tag_names,
        cache_writes_not_held,
    }))
}

/// How a budget stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum BudgetState {
    /// No budget set.
    None,
    Ok,
    /// Spend passed the alert threshold.
    Alert,
    /// Spend reached the budget: requests are refused until it resets.
    Exhausted,
}

impl BudgetState {
    /// The state as the API names it.
    pub fn as_str(self) -> &'static str {
        match self {
            BudgetState::None => "none",
            BudgetState::Ok => "ok",
            BudgetState::Alert => "alert",
            BudgetState::Exhausted => "exhausted",
        }
    }
}

/// Requests refused this month by one limit.
#[derive(Serialize, ToSchema)]
pub struct Refusals {
    /// The policy field (`requests_per_minute`, `key_input_tokens_per_minute`,
    /// `monthly_budget`, …).
    pub limit: String,
    pub count: i64,
}

#[derive(Serialize, ToSchema)]
pub struct BudgetView {
    pub currency: String,
    pub limit_minor: Option<i64>,
    pub alert_percent: i32,
    /// Spend this month, from the rollups (up to a minute or so behind).
    pub spent_minor: i64,
    pub month_start: DateTime<Utc>,
    pub resets_at: DateTime<Utc>,
    pub state: BudgetState,
    /// Refusals this month by the limit that refused them, most first.
    pub refusals: Vec<Refusals>,
}

/// The month's spend against the budget, and which limits refused requests (and how many).
#[utoipa::path(get, path = "/v1/admin/tenants/{id}/budget", tag = "admin",
    params(("id" = Uuid, Path, description = "Tenant id")),
    responses((status = 200, body = BudgetView), (status = 404, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn budget(
    State(state): State<AdminState>,
    admin: Admin,
    AdminPath(id): AdminPath<Uuid>,
) -> Result<axum::Json<BudgetView>, ApiError> {
    admin.tenant(id, Access::Read)?;
    let p = policy::get_policy(&state.pool, TenantId(id)).await?;
    let now = Utc::now();
    let (month_start, resets_at) = dashboard::month_of(now);
    let (currency, spent_minor) = dashboard::month_spend(&state.pool, id, None, now).await?;
    let refusals = sqlx::query(
        "SELECT limit_name, sum(refusals)::BIGINT AS n FROM admission_refusals \
         WHERE tenant_id = $1 AND bucket_start >= $2 GROUP BY 1 ORDER BY 2 DESC, 1",
    )
    .bind(id)
    .bind(month_start)
    .fetch_all(&state.pool)
    .await
    .map_err(AdminError::from)?
    .into_iter()
    .map(|r| Refusals {
        limit: r.get("limit_name"),
        count: r.get("n"),
    })
    .collect();
    Ok(axum::Json(BudgetView {
        state: budget_state(
            p.limits.monthly_budget_minor,
            p.budget_alert_percent,
            spent_minor,
        ),
        currency,
        limit_minor: p.limits.monthly_budget_minor,
        alert_percent: p.budget_alert_percent,
        spent_minor,
        month_start,
        resets_at,
        refusals,
    }))
}

/// Where `spent` stands against a budget of `limit` with an alert at `alert_percent`.
pub fn budget_state(limit: Option<i64>, alert_percent: i32, spent: i64) -> BudgetState {
    match limit {
        None => BudgetState::None,
        Some(l) if spent >= l => BudgetState::Exhausted,
        Some(l) if i128::from(spent) * 100 >= i128::from(l) * i128::from(alert_percent) => {
            BudgetState::Alert
        }
        Some(_) => BudgetState::Ok,
    }
}

#[derive(Serialize, ToSchema)]
pub struct CacheView {
    /// The tenant's resident-bytes quota (one copy of each block), if any.
    pub quota_bytes: Option<i64>,
    pub reserved_bytes: Option<i64>,
    /// Bytes held, every node together: each block once per node (a block in DRAM and on
    /// disk counts once); a block's replicas on several nodes each count.
    pub total_bytes: u64,
    #[serde(flatten)]
    pub stats: TenantCacheStats,
    /// Nodes that did not answer (their share is missing).
    pub unreachable_nodes: u32,
}

/// A tenant's cache: bytes per tier against its quota, blocks lost by reason, and its most
/// read prefixes (hashes, sizes and TTL left; never prompt text).
#[utoipa::path(get, path = "/v1/admin/tenants/{id}/cache", tag = "admin",
    params(("id" = Uuid, Path, description = "Tenant id")),
    responses((status = 200, body = CacheView), (status = 404, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn cache(
    State(state): State<AdminState>,
    admin: Admin,
    AdminPath(id): AdminPath<Uuid>,
) -> Result<axum::Json<CacheView>, ApiError> {
    admin.tenant(id, Access::Read)?;
    let p = policy::get_policy(&state.pool, TenantId(id)).await?;
    let (stats, unreachable_nodes) = tenant_cache(&state.cache, TenantId(id)).await;
    Ok(axum::Json(CacheView {
        quota_bytes: p.cache_resident_bytes,
        reserved_bytes: p.reserved_cache_bytes,
        total_bytes: stats.distinct_bytes,
        stats,
        unreachable_nodes,
    }))
}

/// A tenant's cache from `source`: the local node, or every node of the cluster that
/// answers within two seconds (and how many did not).
pub async fn tenant_cache(source: &CacheSource, tenant: TenantId) -> (TenantCacheStats, u32) {
    match source {
        CacheSource::Local(f) => (f.tenant_stats(tenant, TOP_PREFIXES), 0),
        CacheSource::Cluster { transport, .. } => {
            let asks = source.addrs().into_iter().map(|addr| {
                let t = transport.clone();
                async move {
                    let r = tokio::time::timeout(
                        Duration::from_secs(2),
                        t.tenant_stats(&addr, tenant, TOP_PREFIXES),
                    )
                    .await;
                    match r {
                        Ok(Ok(s)) => Some(s),
                        Ok(Err(e)) => {
                            tracing::warn!(node = %addr, error = %e, "cache stats: node failed");
                            None
                        }
                        Err(_) => {
                            tracing::warn!(node = %addr, "cache stats: node timed out");
                            None
                        }
                    }
                }
            });
            let mut out = TenantCacheStats::default();
            let mut missing = 0;
            for r in futures::future::join_all(asks).await {
                match r {
                    Some(s) => out.merge(s, TOP_PREFIXES),
                    None => missing += 1,
                }
            }
            (out, missing)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_states_are_named_as_the_api_serializes_them() {
        for b in [
            BudgetState::None,
            BudgetState::Ok,
            BudgetState::Alert,
            BudgetState::Exhausted,
        ] {
            assert_eq!(serde_json::to_value(b).unwrap(), b.as_str());
        }
    }

    #[test]
    fn budget_states_follow_the_alert_and_the_limit() {
        assert_eq!(budget_state(None, 80, 10), BudgetState::None);
        assert_eq!(budget_state(Some(1000), 80, 799), BudgetState::Ok);
        assert_eq!(budget_state(Some(1000), 80, 800), BudgetState::Alert);
        assert_eq!(budget_state(Some(1000), 80, 1000), BudgetState::Exhausted);
        assert_eq!(budget_state(Some(0), 80, 0), BudgetState::Exhausted);
    }
}
