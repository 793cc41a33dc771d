//! Tenants, workspaces, API keys and quotas in Postgres.
//!
//! Key secrets are `sk-cachet-` + 40 base62 characters (about 238 random bits). Only the
//! SHA-256 of a secret is stored, with its first 16 characters as a visible prefix.

use cachet_common::{ApiKeyId, TenantId, WorkspaceId};
use sha2::{Digest, Sha256};
use sqlx::{PgPool, Row};

const SECRET_PREFIX: &str = "sk-cachet-";
const BASE62: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";

#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("tenant {0} not found")]
    TenantNotFound(String),
    #[error("{0} already exists")]
    Conflict(String),
    #[error("random number generator failed: {0}")]
    Random(String),
    #[error(transparent)]
    Db(sqlx::Error),
}

impl From<sqlx::Error> for AdminError {
    fn from(e: sqlx::Error) -> Self {
        match &e {
            sqlx::Error::Database(db) if db.code().as_deref() == Some("23505") => {
                AdminError::Conflict(db.constraint().unwrap_or("row").to_string())
            }
            _ => AdminError::Db(e),
        }
    }
}

/// Limits of a tenant; `None` is unlimited.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Quotas {
    pub requests_per_minute: Option<i64>,
    pub input_tokens_per_minute: Option<i64>,
    pub output_tokens_per_minute: Option<i64>,
    pub key_requests_per_minute: Option<i64>,
    pub key_input_tokens_per_minute: Option<i64>,
    pub key_output_tokens_per_minute: Option<i64>,
    pub cache_resident_bytes: Option<i64>,
}

/// Who is calling: resolved from an API key.
#[derive(Clone, Debug)]
pub struct Principal {
    pub key_id: ApiKeyId,
    pub tenant: TenantId,
    pub workspace: WorkspaceId,
    pub quotas: Quotas,
    /// Fabric bytes reserved for the tenant by its plan in force (billed per GB-hour).
    pub cache_reserved_bytes: Option<i64>,
}

#[derive(Clone, Debug)]
pub struct Tenant {
    pub id: TenantId,
    pub name: String,
    pub default_workspace: WorkspaceId,
}

/// A key as created: the secret is shown once and never stored.
#[derive(Clone, Debug)]
pub struct NewKey {
    pub id: ApiKeyId,
    pub secret: String,
    pub visible_prefix: String,
}

pub fn hash_secret(secret: &str) -> [u8; 32] {
    Sha256::digest(secret.as_bytes()).into()
}

fn new_secret() -> Result<String, AdminError> {
    let mut raw = [0u8; 40];
    getrandom::fill(&mut raw).map_err(|e| AdminError::Random(e.to_string()))?;
    // 248 = 4 × 62: bytes below it map uniformly onto base62; the rest are redrawn.
    let mut out = String::from(SECRET_PREFIX);
    let mut pool = raw.to_vec();
    while out.len() < SECRET_PREFIX.len() + 40 {
        if pool.is_empty() {
            let mut more = [0u8; 40];
            getrandom::fill(&mut more).map_err(|e| AdminError::Random(e.to_string()))?;
            pool.extend_from_slice(&more);
        }
        let b = pool.pop().expect("non-empty");
        if b < 248 {
            out.push(BASE62[(b % 62) as usize] as char);
        }
    }
    Ok(out)
}

/// Create a tenant with a `default` workspace and an (unlimited) quotas row.
pub async fn create_tenant(pool: &PgPool, name: &str) -> Result<Tenant, AdminError> {
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
    tx.commit().await?;
    Ok(Tenant {
        id,
        name: name.to_string(),
        default_workspace: ws,
    })
}

/// Find a tenant by name or id.
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

/// Create an API key for a tenant's default workspace.
pub async fn create_key(pool: &PgPool, tenant: &Tenant, name: &str) -> Result<NewKey, AdminError> {
    let id = ApiKeyId::new();
    let secret = new_secret()?;
    let visible_prefix = secret[..SECRET_PREFIX.len() + 6].to_string();
    sqlx::query(
        "INSERT INTO api_keys (id, tenant_id, workspace_id, name, secret_sha256, visible_prefix) \
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(id.as_uuid())
    .bind(tenant.id.as_uuid())
    .bind(tenant.default_workspace.as_uuid())
    .bind(name)
    .bind(&hash_secret(&secret)[..])
    .bind(&visible_prefix)
    .execute(pool)
    .await?;
    Ok(NewKey {
        id,
        secret,
        visible_prefix,
    })
}

/// Revoke a key; it stops working once gateways' auth caches expire (seconds).
pub async fn revoke_key(pool: &PgPool, key: ApiKeyId) -> Result<bool, AdminError> {
    let r =
        sqlx::query("UPDATE api_keys SET revoked_at = now() WHERE id = $1 AND revoked_at IS NULL")
            .bind(key.as_uuid())
            .execute(pool)
            .await?;
    Ok(r.rows_affected() == 1)
}

/// Replace a tenant's quotas.
pub async fn set_quotas(pool: &PgPool, tenant: TenantId, q: &Quotas) -> Result<(), AdminError> {
    let r = sqlx::query(
        "UPDATE tenant_quotas SET requests_per_minute = $2, input_tokens_per_minute = $3, output_tokens_per_minute = $4, \
         key_requests_per_minute = $5, key_input_tokens_per_minute = $6, key_output_tokens_per_minute = $7, \
         cache_resident_bytes = $8, updated_at = now() WHERE tenant_id = $1",
    )
    .bind(tenant.as_uuid())
    .bind(q.requests_per_minute)
    .bind(q.input_tokens_per_minute)
    .bind(q.output_tokens_per_minute)
    .bind(q.key_requests_per_minute)
    .bind(q.key_input_tokens_per_minute)
    .bind(q.key_output_tokens_per_minute)
    .bind(q.cache_resident_bytes)
    .execute(pool)
    .await?;
    if r.rows_affected() == 0 {
        return Err(AdminError::TenantNotFound(tenant.to_string()));
    }
    Ok(())
}

/// The live (not revoked, tenant not deleted) key with this secret hash.
pub async fn lookup_key(
    pool: &PgPool,
    secret_sha256: &[u8; 32],
) -> Result<Option<Principal>, sqlx::Error> {
    let row = sqlx::query(
        "SELECT k.id, k.tenant_id, k.workspace_id, q.requests_per_minute, q.input_tokens_per_minute, \
         q.output_tokens_per_minute, q.key_requests_per_minute, q.key_input_tokens_per_minute, \
         q.key_output_tokens_per_minute, q.cache_resident_bytes, \
         (SELECT p.reserved_cache_bytes FROM tenant_plans p WHERE p.tenant_id = k.tenant_id \
          AND p.effective_from <= now() ORDER BY p.effective_from DESC LIMIT 1) AS cache_reserved_bytes \
         FROM api_keys k JOIN tenants t ON t.id = k.tenant_id LEFT JOIN tenant_quotas q ON q.tenant_id = k.tenant_id \
         WHERE k.secret_sha256 = $1 AND k.revoked_at IS NULL AND t.deleted_at IS NULL",
    )
    .bind(&secret_sha256[..])
    .fetch_optional(pool)
    .await?;
    Ok(row.map(|r| Principal {
        key_id: ApiKeyId(r.get("id")),
        tenant: TenantId(r.get("tenant_id")),
        workspace: WorkspaceId(r.get("workspace_id")),
        quotas: Quotas {
            requests_per_minute: r.get("requests_per_minute"),
            input_tokens_per_minute: r.get("input_tokens_per_minute"),
            output_tokens_per_minute: r.get("output_tokens_per_minute"),
            key_requests_per_minute: r.get("key_requests_per_minute"),
            key_input_tokens_per_minute: r.get("key_input_tokens_per_minute"),
            key_output_tokens_per_minute: r.get("key_output_tokens_per_minute"),
            cache_resident_bytes: r.get("cache_resident_bytes"),
        },
        cache_reserved_bytes: r.get("cache_reserved_bytes"),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_long_random_base62_with_the_prefix() {
        let a = new_secret().unwrap();
        let b = new_secret().unwrap();
        assert_ne!(a, b);
        assert!(a.starts_with(SECRET_PREFIX));
        assert_eq!(a.len(), SECRET_PREFIX.len() + 40);
        assert!(
            a[SECRET_PREFIX.len()..]
                .bytes()
                .all(|c| c.is_ascii_alphanumeric())
        );
    }
}
