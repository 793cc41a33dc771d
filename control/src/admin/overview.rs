//! Finance's month across tenants: for each tenant with usage in the month (or a budget), its
//! name, requests, tokens by class, cost, savings and budget state, from the rollups and the
//! same rating as each tenant's dashboard (cache objects held included), so the rows are the dashboards' totals and their
//! sum is the sum of the dashboards (per currency). As JSON, or CSV to download.

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use billing::dashboard;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::Row;
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

use super::views::{BudgetState, budget_state};
use super::{Admin, AdminQuery, AdminState};
use crate::tenants::AdminError;
use cachet_common::error::{ApiError, ErrorBody};
use identity::Role;

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct OverviewQuery {
    /// The month, `YYYY-MM` (UTC).
    pub month: String,
    /// `json` (default) or `csv`.
    #[serde(default)]
    pub format: Option<String>,
}

/// One tenant's month.
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct TenantMonth {
    pub tenant: Uuid,
    pub name: String,
    /// `active`, `suspended` or `deleted` (now).
    pub state: String,
    /// Requests, tokens by class, and cache objects held (their cost is in `cost_minor`).
    #[serde(flatten)]
    pub tokens: dashboard::Tokens,
    pub hit_ratio: f64,
    pub currency: String,
    pub cost_minor: i64,
    pub saved_minor: i64,
    /// Tokens no price covered (counted at zero).
    pub unpriced_tokens: i64,
    pub budget_minor: Option<i64>,
    pub budget_state: BudgetState,
}

/// The month's sums in one currency.
#[derive(Clone, Debug, Default, Serialize, ToSchema)]
pub struct CurrencyTotal {
    pub currency: String,
    pub tenants: i64,
    pub requests: i64,
    pub cost_minor: i64,
    pub saved_minor: i64,
}

#[derive(Serialize, ToSchema)]
pub struct MonthOverview {
    pub month: String,
    pub from: DateTime<Utc>,
    pub to: DateTime<Utc>,
    /// Tenants by name.
    pub data: Vec<TenantMonth>,
    /// Sums of the rows per currency.
    pub totals: Vec<CurrencyTotal>,
}

/// The month of every tenant with usage or a budget.
pub async fn month_overview(pool: &sqlx::PgPool, month: &str) -> Result<MonthOverview, AdminError> {
    let first = billing::invoice::parse_month(month)?;
    let (from, to) = billing::invoice::month_bounds(first)?;
    let used = dashboard::tenants_with_usage(pool, from, to).await?;
    let tenants = sqlx::query(
        "SELECT t.id, t.name, CASE WHEN t.deleted_at IS NOT NULL THEN 'deleted' \
                WHEN t.suspended_at IS NOT NULL THEN 'suspended' ELSE 'active' END AS state, \
                q.monthly_budget_minor, COALESCE(q.budget_alert_percent, 80)::INTEGER AS alert \
         FROM tenants t LEFT JOIN tenant_quotas q ON q.tenant_id = t.id \
         WHERE t.id = ANY($1) OR (q.monthly_budget_minor IS NOT NULL AND t.deleted_at IS NULL) \
         ORDER BY t.name, t.id",
    )
    .bind(&used)
    .fetch_all(pool)
    .await?;
    let mut data = Vec::with_capacity(tenants.len());
    for t in tenants {
        let id: Uuid = t.get("id");
        let r = dashboard::usage(pool, &dashboard::UsageQuery::tenant(id, from, to)).await?;
        let budget: Option<i64> = t.get("monthly_budget_minor");
        let p = r.totals;
        data.push(TenantMonth {
            tenant: id,
            name: t.get("name"),
            state: t.get("state"),
            tokens: p.tokens,
            hit_ratio: p.hit_ratio,
            currency: r.currency,
            cost_minor: p.cost_minor,
            saved_minor: p.saved_minor,
            unpriced_tokens: p.unpriced_tokens,
            budget_minor: budget,
            budget_state: budget_state(budget, t.get("alert"), p.cost_minor),
        });
    }
    let mut totals: Vec<CurrencyTotal> = Vec::new();
    for row in &data {
        let i = match totals.iter().position(|c| c.currency == row.currency) {
            Some(i) => i,
            None => {
                totals.push(CurrencyTotal {
                    currency: row.currency.clone(),
                    ..CurrencyTotal::default()
                });
                totals.len() - 1
            }
        };
        let c = &mut totals[i];
        c.tenants += 1;
        c.requests += row.tokens.requests;
        c.cost_minor += row.cost_minor;
        c.saved_minor += row.saved_minor;
    }
    Ok(MonthOverview {
        month: first.format("%Y-%m").to_string(),
        from,
        to,
        data,
        totals,
    })
}

/// The header of the overview's CSV.
pub const OVERVIEW_CSV_HEADER: &str = "tenant_id,tenant,state,requests,input_tokens,\
cache_write_5m_tokens,cache_write_1h_tokens,cache_read_tokens,output_tokens,hit_ratio,currency,\
cost,saved,unpriced_tokens,budget,budget_state,cache_storage_token_seconds\r\n";

/// The overview as CSV (RFC 4180): a row per tenant, amounts in major units.
pub fn overview_csv(o: &MonthOverview) -> String {
    let mut out = String::from(OVERVIEW_CSV_HEADER);
    for r in &o.data {
        let money = |m: i64| billing::money::format_minor(m, &r.currency);
        out.push_str(&format!(
            "{},{},{},{},{},{},{},{},{},{:.4},{},{},{},{},{},{},{}\r\n",
            r.tenant,
            billing::csv::field(&r.name),
            r.state,
            r.tokens.requests,
            r.tokens.counts.input_tokens,
            r.tokens.counts.cache_write_5m_tokens,
            r.tokens.counts.cache_write_1h_tokens,
            r.tokens.counts.cache_read_tokens,
            r.tokens.counts.output_tokens,
            r.hit_ratio,
            r.currency,
            money(r.cost_minor),
            money(r.saved_minor),
            r.unpriced_tokens,
            r.budget_minor.map(money).unwrap_or_default(),
            r.budget_state.as_str(),
            r.tokens.cache_storage_token_seconds,
        ));
    }
    out
}

/// A month across tenants (platform admins and finance): requests, tokens, cost, savings and
/// budget state per tenant, with sums per currency. `format=csv` downloads it.
#[utoipa::path(get, path = "/v1/admin/overview", tag = "admin", params(OverviewQuery),
    responses((status = 200, body = MonthOverview), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn overview(
    State(state): State<AdminState>,
    admin: Admin,
    AdminQuery(q): AdminQuery<OverviewQuery>,
) -> Result<Response, ApiError> {
    admin.require(&[Role::PlatformAdmin, Role::Finance])?;
    let o = month_overview(&state.pool, q.month.trim()).await?;
    match q.format.as_deref().unwrap_or("json") {
        "json" => Ok(axum::Json(o).into_response()),
        "csv" => {
            let name = format!("attachment; filename=\"cachet-{}.csv\"", o.month);
            Ok((
                [
                    (header::CONTENT_TYPE, "text/csv; charset=utf-8".to_string()),
                    (header::CONTENT_DISPOSITION, name),
                ],
                overview_csv(&o),
            )
                .into_response())
        }
        other => Err(ApiError::invalid(format!(
            "format: {other:?} is not json or csv"
        ))),
    }
}
