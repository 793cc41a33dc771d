//! Tenants, API keys, tenant policy and the audit log, in Postgres: what the admin API and
//! the `cachet admin` CLI change, and what authentication reads.
//!
//! - this module: tenants and their lifecycle (create, list, suspend, resume, delete), and
//!   [`lookup_key`], which resolves a presented key to a [`Principal`];
//! - [`keys`]: API keys (secrets shown once, expiry, rotation with a grace period);
//! - [`policy`]: a tenant's limits and cache policy;
//! - [`audit`]: the append-only audit log every change writes in its own transaction;
//! - [`directory`]: the names and key workspaces billing asks for (it owns no such table).
//!
//! Every change takes an [`Actor`] and writes its audit row in the same transaction; the
//! audit log is also the change feed running gateways and nodes follow.

pub mod audit;
pub mod ceilings;
pub mod directory;
pub mod keys;
pub mod limits;
pub mod policy;
pub mod refusals;
pub mod tags;
pub mod workspaces;

use cachet_common::{ApiKeyId, TenantId, WorkspaceId};
use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::json;
use sqlx::{PgPool, Row};
use utoipa::ToSchema;
use uuid::Uuid;

pub use audit::Actor;
pub use keys::{NewKey, create_key, hash_secret, key_is_live, revoke_key};
pub use policy::Policy;

#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("tenant {0} not found")]
    TenantNotFound(String),
    #[error("{0} not found")]
    NotFound(String),
    #[error("{0} already exists")]
    Conflict(String),
    /// A change that contradicts the object's state (rotating a revoked key, …).
    #[error("{0}")]
    State(String),
    #[error("{0}")]
    Invalid(String),
    /// The caller's role may not change this.
    #[error("{0}")]
    Forbidden(String),
    #[error("random number generator failed: {0}")]
    Random(String),
    #[error(transparent)]
    Billing(#[from] billing::invoice::BillingError),
    #[error(transparent)]
    Db(sqlx::Error),
}

impl cachet_common::error::ServiceError for AdminError {
    fn error_code(&self) -> cachet_common::error::ErrorCode {
        use cachet_common::error::ErrorCode;
        match self {
            AdminError::TenantNotFound(_) | AdminError::NotFound(_) => ErrorCode::NotFound,
            AdminError::Conflict(_) | AdminError::State(_) => ErrorCode::Conflict,
            AdminError::Invalid(_) => ErrorCode::InvalidRequest,
            AdminError::Forbidden(_) => ErrorCode::Permission,
            AdminError::Billing(billing::invoice::BillingError::Db(_))
            | AdminError::Db(_)
            | AdminError::Random(_) => ErrorCode::Api,
            // A price or invoice the change needs is missing or wrong: the caller's to fix.
            AdminError::Billing(_) => ErrorCode::InvalidRequest,
        }
    }
}

impl From<sqlx::Error> for AdminError {
    fn from(e: sqlx::Error) -> Self {
        match &e {
            sqlx::Error::Database(db) if db.code().as_deref() == Some("23505") => {
                AdminError::Conflict(match db.constraint() {
                    Some("tenants_live_name") => "a tenant with this name".to_string(),
                    Some("admin_users_username_key") => "a user with this name".to_string(),
                    Some(c) => c.to_string(),
                    None => "row".to_string(),
                })
            }
            _ => AdminError::Db(e),
        }
    }
}

/// Who is calling: resolved from an API key.
#[derive(Clone, Debug)]
pub struct Principal {
    pub key_id: ApiKeyId,
    pub tenant: TenantId,
    pub workspace: WorkspaceId,
    pub policy: Policy,
    /// The limits of the key's workspace, on top of the tenant's.
    pub workspace_limits: limits::Limits,
    /// The key's own rate limits (`None`: the tenant's per-key default).
    pub own_key_limits: limits::Limits,
    /// When the key stops working (its own expiry, or the end of a rotation's grace period).
    pub key_expires_at: Option<DateTime<Utc>>,
    pub tenant_suspended: bool,
}

impl Principal {
    /// The limits of this key: its own where set, the tenant's per-key default where not.
    pub fn key_limits(&self) -> limits::Limits {
        self.own_key_limits.or(&self.policy.key_limits())
    }
}

#[derive(Clone, Debug)]
pub struct Tenant {
    pub id: TenantId,
    pub name: String,
    pub default_workspace: WorkspaceId,
}

/// A tenant's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum TenantState {
    Active,
    Suspended,
    Deleted,
}

/// A tenant as the admin API shows it.
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct TenantInfo {
    pub id: Uuid,
    pub name: String,
    pub state: TenantState,
    pub created_at: DateTime<Utc>,
    pub suspended_at: Option<DateTime<Utc>>,
    pub deleted_at: Option<DateTime<Utc>>,
    /// Keys that are neither revoked nor expired.
    pub active_keys: i64,
}

fn tenant_info(r: &sqlx::postgres::PgRow) -> TenantInfo {
    let suspended_at: Option<DateTime<Utc>> = r.get("suspended_at");
    let deleted_at: Option<DateTime<Utc>> = r.get("deleted_at");
    TenantInfo {
        id: r.get("id"),
        name: r.get("name"),
        state: if deleted_at.is_some() {
            TenantState::Deleted
        } else if suspended_at.is_some() {
            TenantState::Suspended
        } else {
            TenantState::Active
        },
        created_at: r.get("created_at"),
        suspended_at,
        deleted_at,
        active_keys: r.get("active_keys"),
    }
}

const TENANT_COLUMNS: &str = "t.id, t.name, t.created_at, t.suspended_at, t.deleted_at, \
     (SELECT count(*) FROM api_keys k WHERE k.tenant_id = t.id AND k.revoked_at IS NULL \
      AND (k.expires_at IS NULL OR k.expires_at > now())) AS active_keys";

/// A tenant's or key's name: trimmed, 1 to 200 characters, no control characters.
pub(crate) fn check_name(name: &str) -> Result<&str, AdminError> {
    let name = name.trim();
    if name.is_empty() || name.chars().count() > 200 || name.chars().any(char::is_control) {
        return Err(AdminError::Invalid(
            "name: 1 to 200 characters, no control characters".into(),
        ));
    }
    Ok(name)
}

/// Create a tenant with a `default` workspace and a policy row (no limits).
pub async fn create_tenant(pool: &PgPool, actor: &Actor, name: &str) -> Result<Tenant, AdminError> {
    let name = check_name(name)?;
    let id = TenantId::new();
    let ws = WorkspaceId::new();
    let mut tx = pool.begin().await?;
    sqlx::query("INSERT INTO tenants (id, name) VALUES ($1, $2)")
        .bind(id.as_uuid())
        .bind(name)
        .execute(&mut *tx)
        .await?;
    sqlx::query("INSERT INTO workspaces (id, tenant_id, name) VALUES ($1, $2, 'default')")
        .bind(ws.as_uuid())
        .bind(id.as_uuid())
        .execute(&mut *tx)
        .await?;
    sqlx::query("INSERT INTO tenant_quotas (tenant_id) VALUES ($1)")
        .bind(id.as_uuid())
        .execute(&mut *tx)
        .await?;
    audit::Entry::new("tenant.create", Some(id.as_uuid()), id)
        .after(json!({"name": name}))
        .commit(tx, actor)
        .await?;
    Ok(Tenant {
        id,
        name: name.to_string(),
        default_workspace: ws,
    })
}

/// Find a live (not deleted) tenant by name or id.
pub async fn find_tenant(pool: &PgPool, name_or_id: &str) -> Result<Option<Tenant>, AdminError> {
    let id = name_or_id.parse::<uuid::Uuid>().ok();
    let row = sqlx::query(
        "SELECT t.id, t.name, w.id AS ws FROM tenants t JOIN workspaces w ON w.tenant_id = t.id AND w.name = 'default' \
         WHERE (t.name = $1 OR t.id = $2) AND t.deleted_at IS NULL",
    )
    .bind(name_or_id)
    .bind(id)
    .fetch_optional(pool)
    .await?;
    Ok(row.map(|r| Tenant {
        id: TenantId(r.get("id")),
        name: r.get("name"),
        default_workspace: WorkspaceId(r.get("ws")),
    }))
}

/// Every tenant (deleted ones too with `include_deleted`), by name.
pub async fn list_tenants(
    pool: &PgPool,
    include_deleted: bool,
) -> Result<Vec<TenantInfo>, AdminError> {
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {TENANT_COLUMNS} FROM tenants t WHERE $1 OR t.deleted_at IS NULL ORDER BY t.name, t.id"
    )))
    .bind(include_deleted)
    .fetch_all(pool)
    .await?;
    Ok(rows.iter().map(tenant_info).collect())
}

/// One tenant (deleted or not).
pub async fn get_tenant(pool: &PgPool, id: TenantId) -> Result<TenantInfo, AdminError> {
    let id = id.as_uuid();
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {TENANT_COLUMNS} FROM tenants t WHERE t.id = $1"
    )))
    .bind(id)
    .fetch_optional(pool)
    .await?;
    row.map(|r| tenant_info(&r))
        .ok_or_else(|| AdminError::TenantNotFound(id.to_string()))
}

/// Fail with `TenantNotFound` unless the tenant exists (deleted or not); cheaper than
/// [`get_tenant`] where only existence matters.
pub async fn ensure_tenant(pool: &PgPool, id: TenantId) -> Result<(), AdminError> {
    let id = id.as_uuid();
    let found: Option<i32> = sqlx::query_scalar("SELECT 1 FROM tenants WHERE id = $1")
        .bind(id)
        .fetch_optional(pool)
        .await?;
    found
        .map(|_| ())
        .ok_or_else(|| AdminError::TenantNotFound(id.to_string()))
}

/// Whether a tenant is to be suspended or resumed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Suspension {
    Suspend,
    Resume,
}

/// Suspend or resume a tenant: a suspended tenant's keys are refused with 403 once running
/// gateways see the change (about a second).
pub async fn set_suspended(
    pool: &PgPool,
    actor: &Actor,
    tenant: TenantId,
    change: Suspension,
) -> Result<TenantInfo, AdminError> {
    let (id, suspended) = (tenant.as_uuid(), change == Suspension::Suspend);
    let before = get_tenant(pool, tenant).await?;
    if before.state == TenantState::Deleted {
        return Err(AdminError::State("the tenant is deleted".into()));
    }
    let mut tx = pool.begin().await?;
    sqlx::query(
        "UPDATE tenants SET suspended_at = CASE WHEN $2 THEN COALESCE(suspended_at, now()) END \
         WHERE id = $1 AND deleted_at IS NULL",
    )
    .bind(id)
    .bind(suspended)
    .execute(&mut *tx)
    .await?;
    audit::Entry::new(
        if suspended {
            "tenant.suspend"
        } else {
            "tenant.resume"
        },
        Some(id),
        id,
    )
    .before(json!({"state": before.state}))
    .after(json!({"state": if suspended { "suspended" } else { "active" }}))
    .commit(tx, actor)
    .await?;
    get_tenant(pool, tenant).await
}

/// Delete a tenant: its keys are revoked, its tenant admins disabled (and logged out), its
/// cache objects deleted (their storage stops being billed), and every node purges its cache
/// on seeing the change; its ledger rows, invoices and audit rows stay. Its name may be used
/// again.
pub async fn delete_tenant(
    pool: &PgPool,
    actor: &Actor,
    tenant: TenantId,
) -> Result<TenantInfo, AdminError> {
    let id = tenant.as_uuid();
    let before = get_tenant(pool, tenant).await?;
    if before.state == TenantState::Deleted {
        return Ok(before);
    }
    let mut tx = pool.begin().await?;
    sqlx::query("UPDATE tenants SET deleted_at = now() WHERE id = $1 AND deleted_at IS NULL")
        .bind(id)
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "UPDATE cache_objects SET deleted_at = now() WHERE tenant_id = $1 \
         AND deleted_at IS NULL AND expires_at > now()",
    )
    .bind(id)
    .execute(&mut *tx)
    .await?;
    let revoked = sqlx::query(
        "UPDATE api_keys SET revoked_at = now() WHERE tenant_id = $1 AND revoked_at IS NULL",
    )
    .bind(id)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    sqlx::query(
        "UPDATE admin_sessions SET revoked_at = now() WHERE revoked_at IS NULL AND user_id IN \
         (SELECT id FROM admin_users WHERE tenant_id = $1)",
    )
    .bind(id)
    .execute(&mut *tx)
    .await?;
    let users = sqlx::query(
        "UPDATE admin_users SET disabled_at = now() WHERE tenant_id = $1 AND disabled_at IS NULL",
    )
    .bind(id)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    audit::Entry::new("tenant.delete", Some(id), id)
        .before(json!({"name": before.name, "state": before.state}))
        .after(json!({"state": "deleted", "keys_revoked": revoked, "admins_disabled": users}))
        .commit(tx, actor)
        .await?;
    get_tenant(pool, tenant).await
}

/// The key (not revoked, tenant not deleted) with this secret hash. Expired keys and keys of
/// suspended tenants are returned too, so the caller can say why they are refused.
pub async fn lookup_key(
    pool: &PgPool,
    secret_sha256: &[u8; 32],
) -> Result<Option<Principal>, sqlx::Error> {
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT k.id, k.tenant_id, k.workspace_id, k.expires_at, t.suspended_at, {}, {}, \
         k.requests_per_minute AS own_requests_per_minute, \
         k.input_tokens_per_minute AS own_input_tokens_per_minute, \
         k.output_tokens_per_minute AS own_output_tokens_per_minute, \
         NULL::BIGINT AS own_monthly_budget_minor \
         FROM api_keys k JOIN tenants t ON t.id = k.tenant_id \
         JOIN workspaces w ON w.id = k.workspace_id \
         LEFT JOIN tenant_quotas q ON q.tenant_id = k.tenant_id \
         WHERE k.secret_sha256 = $1 AND k.revoked_at IS NULL AND t.deleted_at IS NULL \
         AND w.archived_at IS NULL",
        policy::COLUMNS,
        workspaces::LIMIT_COLUMNS
    )))
    .bind(&secret_sha256[..])
    .fetch_optional(pool)
    .await?;
    let Some(r) = row else {
        return Ok(None);
    };
    let tenant: uuid::Uuid = r.get("tenant_id");
    let policy = policy::reserved(pool, tenant, policy::from_row(&r)).await?;
    Ok(Some(Principal {
        key_id: ApiKeyId(r.get("id")),
        tenant: TenantId(tenant),
        workspace: WorkspaceId(r.get("workspace_id")),
        policy,
        workspace_limits: workspaces::limits_from_row(&r),
        own_key_limits: limits::Limits::from_row(
            &r,
            &[
                "own_requests_per_minute",
                "own_input_tokens_per_minute",
                "own_output_tokens_per_minute",
                "own_monthly_budget_minor",
            ],
        ),
        key_expires_at: r.get("expires_at"),
        tenant_suspended: r.get::<Option<DateTime<Utc>>, _>("suspended_at").is_some(),
    }))
}
