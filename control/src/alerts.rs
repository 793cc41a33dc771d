//! Budget alerts: a tenant's (or a workspace's) monthly spend crossing a threshold of its
//! budget — the tenant's alert percentage, and 100% (requests are refused from there).
//!
//! Each crossing is recorded once per tenant or workspace, month and threshold (the
//! `budget_alerts` row's id is the event's, so however many processes notice it, and however
//! often, it is recorded once), and in the same transaction written to the audit log
//! (`budget.alert`) and queued as a `budget.threshold_crossed` webhook to each of the tenant's
//! endpoints ([`crate::webhooks`]).
//!
//! Spend is checked by every serving process for the tenants it serves (about every
//! `admin.spend_refresh_secs`), and at once when a budget or its alert percentage changes, so
//! a budget lowered below what was already spent alerts without waiting for traffic.

use chrono::{DateTime, Datelike, Utc};
use serde_json::json;
use sqlx::{PgPool, Row};
use uuid::Uuid;

use crate::metrics;
use crate::tenants::AdminError;
use crate::tenants::audit::{self, Actor};
use crate::webhooks;

/// The webhook event type of a crossing.
pub const EVENT_TYPE: &str = "budget.threshold_crossed";

/// A budget and what has been spent against it this month.
#[derive(Clone, Debug)]
pub struct Standing {
    pub tenant: Uuid,
    /// The workspace whose budget this is (the whole tenant's if `None`).
    pub workspace: Option<Uuid>,
    pub limit_minor: i64,
    pub alert_percent: i32,
    pub spent_minor: i64,
    pub currency: String,
}

impl Standing {
    /// Thresholds (percent) the spend has reached: the alert percentage and 100, each once.
    pub fn crossed(&self) -> Vec<i32> {
        let mut out = Vec::new();
        for pct in [self.alert_percent, 100] {
            let reached = i128::from(self.spent_minor) * 100
                >= i128::from(self.limit_minor) * i128::from(pct);
            if (1..=100).contains(&pct) && reached && !out.contains(&pct) {
                out.push(pct);
            }
        }
        out
    }
}

/// The event id of a crossing: the same wherever and however often it is noticed.
pub fn event_id(s: &Standing, now: DateTime<Utc>, percent: i32) -> String {
    format!(
        "budget:{}:{}:{:04}-{:02}:{percent}",
        s.tenant,
        s.workspace
            .map_or_else(|| "tenant".to_string(), |w| w.to_string()),
        now.year(),
        now.month()
    )
}

/// Record the thresholds `s` has crossed this month that were not recorded yet (audit row and
/// webhooks in the same transaction). Returns the newly recorded ones.
pub async fn record(
    pool: &PgPool,
    s: &Standing,
    now: DateTime<Utc>,
) -> Result<Vec<i32>, AdminError> {
    let (month_start, _) = billing::dashboard::month_of(now);
    let mut fired = Vec::new();
    for percent in s.crossed() {
        let id = event_id(s, now, percent);
        let mut tx = pool.begin().await?;
        let inserted = sqlx::query(
            "INSERT INTO budget_alerts (event_id, tenant_id, workspace_id, period_start, percent, \
             spent_minor, limit_minor, currency) VALUES ($1, $2, $3, $4, $5, $6, $7, $8) \
             ON CONFLICT (event_id) DO NOTHING",
        )
        .bind(&id)
        .bind(s.tenant)
        .bind(s.workspace)
        .bind(month_start.date_naive())
        .bind(percent)
        .bind(s.spent_minor)
        .bind(s.limit_minor)
        .bind(&s.currency)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if inserted == 0 {
            continue;
        }
        let money = |m: i64| billing::money::format_minor(m, &s.currency);
        let data = json!({
            "tenant_id": s.tenant,
            "workspace_id": s.workspace,
            "period": format!("{:04}-{:02}", now.year(), now.month()),
            "threshold_percent": percent,
            "spent_minor": s.spent_minor,
            "limit_minor": s.limit_minor,
            "currency": s.currency,
            "spent": money(s.spent_minor),
            "limit": money(s.limit_minor),
            "requests_refused": percent >= 100,
        });
        let event = json!({
            "id": id,
            "type": EVENT_TYPE,
            "created_at": now.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            "data": data,
        });
        audit::record(
            &mut tx,
            &Actor {
                name: "system".into(),
                role: None,
                request_id: None,
            },
            audit::Entry::new(
                "budget.alert",
                Some(s.tenant),
                s.workspace.unwrap_or(s.tenant),
            )
            .after(data),
        )
        .await?;
        webhooks::enqueue(&mut tx, s.tenant, &id, EVENT_TYPE, &event).await?;
        tx.commit().await?;
        metrics::BUDGET_ALERTS
            .with_label_values(&[if s.workspace.is_some() {
                "workspace"
            } else {
                "tenant"
            }])
            .inc();
        tracing::info!(tenant_id = %s.tenant, workspace_id = ?s.workspace, percent,
            spent_minor = s.spent_minor, limit_minor = s.limit_minor, "budget threshold crossed");
        fired.push(percent);
    }
    Ok(fired)
}

/// The budgets of `tenant` (its own and its workspaces') with this month's spend.
pub async fn standings(
    pool: &PgPool,
    tenant: Uuid,
    now: DateTime<Utc>,
) -> Result<Vec<Standing>, AdminError> {
    let Some(r) = sqlx::query(
        "SELECT monthly_budget_minor, budget_alert_percent FROM tenant_quotas WHERE tenant_id = $1",
    )
    .bind(tenant)
    .fetch_optional(pool)
    .await?
    else {
        return Ok(Vec::new());
    };
    let alert_percent = r
        .get::<Option<i16>, _>("budget_alert_percent")
        .map_or(80, i32::from);
    let mut out = Vec::new();
    if let Some(limit_minor) = r.get::<Option<i64>, _>("monthly_budget_minor") {
        let (currency, spent_minor) =
            billing::dashboard::month_spend(pool, tenant, None, now).await?;
        out.push(Standing {
            tenant,
            workspace: None,
            limit_minor,
            alert_percent,
            spent_minor,
            currency,
        });
    }
    let budgeted = crate::tenants::workspaces::budgeted(pool, &[tenant]).await?;
    let key_workspaces = if budgeted.is_empty() {
        Vec::new()
    } else {
        crate::tenants::directory::key_workspaces(pool, tenant).await?
    };
    for (_, ws, limit_minor) in budgeted {
        let (currency, spent_minor) =
            billing::dashboard::month_spend(pool, tenant, Some((ws, &key_workspaces)), now).await?;
        out.push(Standing {
            tenant,
            workspace: Some(ws),
            limit_minor,
            alert_percent,
            spent_minor,
            currency,
        });
    }
    Ok(out)
}

/// Check every budget of `tenant` now and record what was crossed (after a budget change).
/// A failure is logged, never returned: the change it follows has been made.
pub async fn check_now(pool: &PgPool, tenant: Uuid) {
    let now = Utc::now();
    let result = async {
        for s in standings(pool, tenant, now).await? {
            record(pool, &s, now).await?;
        }
        Ok::<_, AdminError>(())
    }
    .await;
    if let Err(e) = result {
        tracing::warn!(tenant_id = %tenant, error = %e, "checking budget alerts failed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn standing(spent: i64, limit: i64, alert: i32) -> Standing {
        Standing {
            tenant: Uuid::nil(),
            workspace: None,
            limit_minor: limit,
            alert_percent: alert,
            spent_minor: spent,
            currency: "USD".into(),
        }
    }

    #[test]
    fn thresholds_are_the_alert_percentage_and_the_budget_each_once() {
        assert_eq!(standing(79, 100, 80).crossed(), Vec::<i32>::new());
        assert_eq!(standing(80, 100, 80).crossed(), vec![80]);
        assert_eq!(standing(100, 100, 80).crossed(), vec![80, 100]);
        assert_eq!(standing(500, 100, 100).crossed(), vec![100]);
        // A zero budget is spent at once.
        assert_eq!(standing(0, 0, 80).crossed(), vec![80, 100]);
    }

    #[test]
    fn event_ids_name_the_scope_month_and_threshold() {
        let now: DateTime<Utc> = "2026-11-26T10:00:00Z".parse().unwrap();
        let mut s = standing(1, 1, 80);
        assert_eq!(
            event_id(&s, now, 80),
            format!("budget:{}:tenant:2026-11:80", Uuid::nil())
        );
        s.workspace = Some(Uuid::nil());
        assert!(event_id(&s, now, 100).contains(&format!(":{}:2026-11:100", Uuid::nil())));
    }
}
