//! Workspaces: the cache-isolation scope inside a tenant, and a unit of keys, limits and usage.
//!
//! Every tenant is created with a `default` workspace; keys created without a workspace go
//! there, and it can be neither renamed nor archived. Other workspaces are created, renamed,
//! given limits and archived. Archiving revokes the workspace's keys in the same transaction
//! (running gateways refuse them within about a second, as for any revoked key) and is final;
//! the workspace's usage stays in the ledger and its name stays taken.
//!
//! A workspace's limits apply on top of the tenant's: requests, uncached input tokens and
//! output tokens per minute, and a monthly spend budget, each for the whole workspace (every
//! key in it together). Each is at most the tenant's (when the tenant has one); lowering the
//! tenant's lowers a workspace's above it, and lowering a workspace's lowers its keys' above
//! it (decision 0036). Every block hash carries the workspace, so two workspaces of one tenant
//! never read each other's cache.

use cachet_common::{TenantId, WorkspaceId};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::json;
use sqlx::{PgPool, Row};
use utoipa::ToSchema;
use uuid::Uuid;

use super::AdminError;
use super::audit::{self, Actor};
use super::limits::{Limits, LimitsPatch, NoOtherFields, present};
use super::tags::Tags;

/// The name of the workspace every tenant is created with.
pub const DEFAULT_NAME: &str = "default";

/// A workspace as the admin API shows it.
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct WorkspaceInfo {
    pub id: Uuid,
    pub tenant_id: Uuid,
    pub name: String,
    /// The tenant's `default` workspace (never renamed or archived).
    pub is_default: bool,
    pub created_at: DateTime<Utc>,
    pub archived_at: Option<DateTime<Utc>>,
    /// The workspace's own limits; `None` is no limit beyond the tenant's.
    pub limits: Limits,
    /// Keys that are neither revoked nor expired.
    pub active_keys: i64,
    /// Tags its keys' usage carries (each key's own on top), for chargeback.
    pub tags: Tags,
}

/// A change to a workspace (JSON merge patch: absent = unchanged, `null` = no limit).
#[derive(Clone, Debug, Default, Deserialize, ToSchema)]
pub struct WorkspacePatch {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(flatten)]
    pub limits: LimitsPatch,
    /// The workspace's tags, all of them (`null` or `{}`: none).
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<Tags>)]
    pub tags: Option<Option<Tags>>,
    #[serde(flatten)]
    #[schema(ignore)]
    pub rest: NoOtherFields,
}

impl WorkspacePatch {
    /// Whether the patch changes the workspace's monthly budget.
    pub fn touches_budget(&self) -> bool {
        self.limits.touches_budget()
    }

    /// `limits` with this patch applied, validated.
    pub fn apply(&self, l: Limits) -> Result<Limits, AdminError> {
        let l = self.limits.apply(l);
        l.validate("")?;
        Ok(l)
    }
}

/// The workspace columns, read from `workspaces w`.
pub(crate) const LIMIT_COLUMNS: &str = "w.requests_per_minute AS ws_requests_per_minute, \
    w.input_tokens_per_minute AS ws_input_tokens_per_minute, \
    w.output_tokens_per_minute AS ws_output_tokens_per_minute, \
    w.monthly_budget_minor AS ws_monthly_budget_minor";

pub(crate) fn limits_from_row(r: &sqlx::postgres::PgRow) -> Limits {
    Limits::from_row(r, &super::limits::WORKSPACE_COLUMNS)
}

fn columns() -> String {
    format!(
        "w.id, w.tenant_id, w.name, w.created_at, w.archived_at, w.tags, {LIMIT_COLUMNS}, \
         (SELECT count(*) FROM api_keys k WHERE k.workspace_id = w.id AND k.revoked_at IS NULL \
          AND (k.expires_at IS NULL OR k.expires_at > now())) AS active_keys"
    )
}

fn info(r: &sqlx::postgres::PgRow) -> WorkspaceInfo {
    let name: String = r.get("name");
    WorkspaceInfo {
        id: r.get("id"),
        tenant_id: r.get("tenant_id"),
        is_default: name == DEFAULT_NAME,
        name,
        created_at: r.get("created_at"),
        archived_at: r.get("archived_at"),
        limits: limits_from_row(r),
        active_keys: r.get("active_keys"),
        tags: Tags::from_json(r.get("tags")),
    }
}

/// A tenant's workspaces (archived ones too with `include_archived`), the default first,
/// then by name.
pub async fn list_workspaces(
    pool: &PgPool,
    tenant: TenantId,
    include_archived: bool,
) -> Result<Vec<WorkspaceInfo>, AdminError> {
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {} FROM workspaces w WHERE w.tenant_id = $1 AND ($2 OR w.archived_at IS NULL) \
         ORDER BY w.name <> '{DEFAULT_NAME}', w.name, w.id",
        columns()
    )))
    .bind(tenant.as_uuid())
    .bind(include_archived)
    .fetch_all(pool)
    .await?;
    Ok(rows.iter().map(info).collect())
}

/// One workspace of `tenant`.
pub async fn get_workspace(
    pool: &PgPool,
    tenant: TenantId,
    workspace: WorkspaceId,
) -> Result<WorkspaceInfo, AdminError> {
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {} FROM workspaces w WHERE w.id = $1 AND w.tenant_id = $2",
        columns()
    )))
    .bind(workspace.as_uuid())
    .bind(tenant.as_uuid())
    .fetch_optional(pool)
    .await?;
    row.map(|r| info(&r))
        .ok_or_else(|| AdminError::NotFound(format!("workspace {workspace}")))
}

/// The workspace of `tenant` named or numbered `name_or_id` (for the CLI).
pub async fn find_workspace(
    pool: &PgPool,
    tenant: TenantId,
    name_or_id: &str,
) -> Result<WorkspaceInfo, AdminError> {
    let id = name_or_id.parse::<Uuid>().ok();
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {} FROM workspaces w WHERE w.tenant_id = $1 AND (w.name = $2 OR w.id = $3)",
        columns()
    )))
    .bind(tenant.as_uuid())
    .bind(name_or_id)
    .bind(id)
    .fetch_optional(pool)
    .await?;
    row.map(|r| info(&r))
        .ok_or_else(|| AdminError::NotFound(format!("workspace {name_or_id}")))
}

/// A workspace of `tenant` that keys may be created in: it exists and is not archived.
pub async fn live_workspace(
    pool: &PgPool,
    tenant: TenantId,
    workspace: WorkspaceId,
) -> Result<WorkspaceInfo, AdminError> {
    let ws = get_workspace(pool, tenant, workspace).await?;
    if ws.archived_at.is_some() {
        return Err(AdminError::State(format!(
            "workspace {} is archived",
            ws.name
        )));
    }
    Ok(ws)
}

fn conflict(e: AdminError, name: &str) -> AdminError {
    match e {
        AdminError::Conflict(_) => {
            AdminError::Conflict(format!("a workspace named {name} in this tenant"))
        }
        e => e,
    }
}

/// Create a workspace under `tenant`.
pub async fn create_workspace(
    pool: &PgPool,
    actor: &Actor,
    tenant: TenantId,
    name: &str,
    limits: Limits,
    tags: &Tags,
) -> Result<WorkspaceInfo, AdminError> {
    let name = super::check_name(name)?;
    limits.validate("")?;
    tags.validate()?;
    let tenant_limits = super::policy::get_policy(pool, tenant).await?.limits;
    limits.within(&tenant_limits, "", "the tenant's")?;
    let id = WorkspaceId::new();
    let mut tx = pool.begin().await?;
    let insert = sqlx::query(
        "INSERT INTO workspaces (id, tenant_id, name, requests_per_minute, input_tokens_per_minute, \
         output_tokens_per_minute, monthly_budget_minor, tags) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
    )
    .bind(id.as_uuid())
    .bind(tenant.as_uuid())
    .bind(name);
    limits
        .bind(insert)
        .bind(tags.json())
        .execute(&mut *tx)
        .await
        .map_err(|e| conflict(e.into(), name))?;
    audit::Entry::new("workspace.create", Some(tenant.as_uuid()), id)
        .after(json!({"name": name, "limits": limits, "tags": tags}))
        .commit(tx, actor)
        .await?;
    get_workspace(pool, tenant, id).await
}

/// Rename a workspace or change its limits.
pub async fn update_workspace(
    pool: &PgPool,
    actor: &Actor,
    tenant: TenantId,
    workspace: WorkspaceId,
    patch: &WorkspacePatch,
) -> Result<WorkspaceInfo, AdminError> {
    let before = get_workspace(pool, tenant, workspace).await?;
    if before.archived_at.is_some() {
        return Err(AdminError::State(format!(
            "workspace {} is archived",
            before.name
        )));
    }
    let name = match &patch.name {
        Some(n) => super::check_name(n)?,
        None => before.name.as_str(),
    };
    if before.is_default && name != before.name {
        return Err(AdminError::State(
            "the default workspace cannot be renamed".into(),
        ));
    }
    if !before.is_default && name == DEFAULT_NAME {
        return Err(AdminError::Invalid(format!(
            "name: {DEFAULT_NAME} is the name of the tenant's default workspace"
        )));
    }
    let limits = patch.apply(before.limits)?;
    let tags = match &patch.tags {
        Some(t) => t.clone().unwrap_or_default(),
        None => before.tags.clone(),
    };
    tags.validate()?;
    let tenant_limits = super::policy::get_policy(pool, tenant).await?.limits;
    limits.within(&tenant_limits, "", "the tenant's")?;
    let mut tx = pool.begin().await?;
    let update = sqlx::query(
        "UPDATE workspaces SET name = $2, requests_per_minute = $3, input_tokens_per_minute = $4, \
         output_tokens_per_minute = $5, monthly_budget_minor = $6, tags = $7 WHERE id = $1",
    )
    .bind(workspace.as_uuid())
    .bind(name);
    limits
        .bind(update)
        .bind(tags.json())
        .execute(&mut *tx)
        .await
        .map_err(|e| conflict(e.into(), name))?;
    // Its keys' limits above the workspace's new ones are lowered to them.
    let (_, keys) = super::limits::lower_below(&mut tx, tenant.as_uuid()).await?;
    let mut after = json!({"name": name, "limits": limits, "tags": tags});
    if keys > 0 {
        after["lowered_to_fit"] = json!({"keys": keys});
    }
    audit::Entry::new("workspace.update", Some(tenant.as_uuid()), workspace)
        .before(json!({"name": before.name, "limits": before.limits, "tags": before.tags}))
        .after(after)
        .commit(tx, actor)
        .await?;
    get_workspace(pool, tenant, workspace).await
}

/// Archive a workspace: its keys are revoked with it. Archiving an archived workspace changes
/// nothing.
pub async fn archive_workspace(
    pool: &PgPool,
    actor: &Actor,
    tenant: TenantId,
    workspace: WorkspaceId,
) -> Result<WorkspaceInfo, AdminError> {
    let before = get_workspace(pool, tenant, workspace).await?;
    if before.archived_at.is_some() {
        return Ok(before);
    }
    if before.is_default {
        return Err(AdminError::State(
            "the default workspace cannot be archived".into(),
        ));
    }
    let mut tx = pool.begin().await?;
    sqlx::query("UPDATE workspaces SET archived_at = now() WHERE id = $1 AND archived_at IS NULL")
        .bind(workspace.as_uuid())
        .execute(&mut *tx)
        .await?;
    let revoked = sqlx::query(
        "UPDATE api_keys SET revoked_at = now() WHERE workspace_id = $1 AND revoked_at IS NULL",
    )
    .bind(workspace.as_uuid())
    .execute(&mut *tx)
    .await?
    .rows_affected();
    audit::Entry::new("workspace.archive", Some(tenant.as_uuid()), workspace)
        .before(json!({"name": before.name, "active_keys": before.active_keys}))
        .after(json!({"state": "archived", "keys_revoked": revoked}))
        .commit(tx, actor)
        .await?;
    get_workspace(pool, tenant, workspace).await
}

/// Which of `among` have a monthly budget: their own or one of their live workspaces'.
pub async fn with_budgets(pool: &PgPool, among: &[Uuid]) -> Result<Vec<Uuid>, AdminError> {
    Ok(sqlx::query_scalar(
        "SELECT tenant_id FROM tenant_quotas WHERE monthly_budget_minor IS NOT NULL \
         AND tenant_id = ANY($1) UNION SELECT tenant_id FROM workspaces \
         WHERE monthly_budget_minor IS NOT NULL AND archived_at IS NULL AND tenant_id = ANY($1)",
    )
    .bind(among)
    .fetch_all(pool)
    .await?)
}

/// The workspaces of `tenant` with a monthly budget (for the budget check of admission).
pub async fn budgeted(
    pool: &PgPool,
    tenants: &[Uuid],
) -> Result<Vec<(Uuid, Uuid, i64)>, AdminError> {
    let rows = sqlx::query(
        "SELECT tenant_id, id, monthly_budget_minor FROM workspaces \
         WHERE monthly_budget_minor IS NOT NULL AND archived_at IS NULL AND tenant_id = ANY($1)",
    )
    .bind(tenants)
    .fetch_all(pool)
    .await?;
    Ok(rows
        .iter()
        .map(|r| {
            (
                r.get("tenant_id"),
                r.get("id"),
                r.get("monthly_budget_minor"),
            )
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_patch_sets_clears_and_keeps_limits() {
        let before = Limits {
            requests_per_minute: Some(10),
            input_tokens_per_minute: Some(1000),
            ..Default::default()
        };
        let p: WorkspacePatch =
            serde_json::from_str(r#"{"requests_per_minute": null, "output_tokens_per_minute": 5}"#)
                .unwrap();
        let after = p.apply(before).unwrap();
        assert_eq!(after.requests_per_minute, None);
        assert_eq!(after.input_tokens_per_minute, Some(1000));
        assert_eq!(after.output_tokens_per_minute, Some(5));
    }

    #[test]
    fn limits_below_their_minimum_are_refused_by_name() {
        let p: WorkspacePatch = serde_json::from_str(r#"{"requests_per_minute": 0}"#).unwrap();
        let e = p.apply(Limits::default()).unwrap_err().to_string();
        assert!(e.starts_with("requests_per_minute:"), "{e}");
        let p: WorkspacePatch = serde_json::from_str(r#"{"monthly_budget_minor": -1}"#).unwrap();
        assert!(p.apply(Limits::default()).is_err());
        assert!(serde_json::from_str::<WorkspacePatch>(r#"{"colour": 1}"#).is_err());
    }
}
