//! API keys: created with a secret shown once, listed by id and visible prefix, revoked,
//! given an expiry, and rotated with a grace period.
//!
//! Secrets are `sk-cachet-` + 40 base62 characters (about 238 random bits). Only the SHA-256 of
//! a secret is stored, with its first 16 characters as a visible prefix.
//!
//! **Rotation** makes a new key (same name and workspace) and ends the old one at the end of a
//! grace period, during which both secrets work. A rotation carries an idempotency key: the
//! same request again returns the same new key, secret included, for 24 hours. No secret is
//! stored for that: the new secret is derived (HMAC-SHA-256 under the server's admin secret)
//! from a random seed kept with the rotation and erased after the replay window; a retry
//! derives it again and checks it against the stored hash.

use cachet_common::{ApiKeyId, TenantId, WorkspaceId};
use chrono::{DateTime, Duration, Utc};
use hmac::{Hmac, KeyInit, Mac};
use serde::Serialize;
use serde_json::json;
use sha2::{Digest, Sha256};
use sqlx::{PgPool, Row};
use utoipa::ToSchema;
use uuid::Uuid;

use super::audit::{self, Actor};
use super::limits::{Limits, LimitsPatch};
use super::tags::Tags;
use super::{AdminError, Tenant};

const SECRET_PREFIX: &str = "sk-cachet-";
const BASE62: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
/// How long a rotation's secret can be shown again to a retry with its idempotency key.
pub const ROTATION_REPLAY: Duration = Duration::hours(24);
/// The longest grace period a rotation may give the old key.
pub const MAX_GRACE: Duration = Duration::days(30);

/// A key as created: the secret is shown once and never stored.
#[derive(Clone, Debug)]
pub struct NewKey {
    pub id: ApiKeyId,
    pub secret: String,
    pub visible_prefix: String,
}

/// A key's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum KeyState {
    Active,
    /// Rotated: it works until its grace period ends (`expires_at`).
    Rotating,
    Expired,
    Revoked,
}

/// A key as the admin API lists it (never its secret).
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct KeyInfo {
    pub id: Uuid,
    pub tenant_id: Uuid,
    /// The workspace the key belongs to (for good: a key never moves).
    pub workspace_id: Uuid,
    pub name: String,
    /// The secret's first 16 characters.
    pub prefix: String,
    pub state: KeyState,
    pub created_at: DateTime<Utc>,
    /// Last request authenticated with it (recorded to within a minute).
    pub last_used_at: Option<DateTime<Utc>>,
    pub expires_at: Option<DateTime<Utc>>,
    pub revoked_at: Option<DateTime<Utc>>,
    /// The key a rotation replaced it with.
    pub rotated_to: Option<Uuid>,
    /// The key's own rate limits (`None`: the tenant's per-key default, its `key_*` policy);
    /// within its workspace's and the tenant's. A key has no budget of its own
    /// (`monthly_budget_minor` is always null).
    pub limits: Limits,
    /// The key's own tags, on top of its workspace's, for chargeback.
    pub tags: Tags,
}

pub fn hash_secret(secret: &str) -> [u8; 32] {
    Sha256::digest(secret.as_bytes()).into()
}

/// A secret from a source of 32-byte chunks: [`SECRET_PREFIX`] and 40 base62 characters.
fn secret_from(
    chunk: impl FnMut(u32) -> Result<[u8; 32], AdminError>,
) -> Result<String, AdminError> {
    base62_from(SECRET_PREFIX, 40, chunk)
}

/// `prefix` and `len` base62 characters from a source of 32-byte chunks (rejection sampling:
/// bytes ≥ 248 = 4 × 62 are skipped, so every character is uniform).
fn base62_from(
    prefix: &str,
    len: usize,
    mut chunk: impl FnMut(u32) -> Result<[u8; 32], AdminError>,
) -> Result<String, AdminError> {
    let mut out = String::from(prefix);
    let mut counter = 0u32;
    while out.len() < prefix.len() + len {
        for b in chunk(counter)? {
            if b < 248 && out.len() < prefix.len() + len {
                out.push(BASE62[(b % 62) as usize] as char);
            }
        }
        counter += 1;
    }
    Ok(out)
}

/// A random identifier: `prefix` and `len` uniform base62 characters.
pub(crate) fn random_id(prefix: &str, len: usize) -> Result<String, AdminError> {
    base62_from(prefix, len, |_| random_bytes())
}

fn random_bytes() -> Result<[u8; 32], AdminError> {
    let mut b = [0u8; 32];
    getrandom::fill(&mut b).map_err(|e| AdminError::Random(e.to_string()))?;
    Ok(b)
}

fn new_secret() -> Result<String, AdminError> {
    secret_from(|_| random_bytes())
}

/// The secret of a rotation with `seed`, under the server's secret `server_key`.
fn derived_secret(server_key: &[u8], seed: &[u8]) -> Result<String, AdminError> {
    secret_from(|counter| {
        let mut mac = Hmac::<Sha256>::new_from_slice(server_key)
            .map_err(|e| AdminError::Random(e.to_string()))?;
        mac.update(b"cachet-key-rotation-v1");
        mac.update(seed);
        mac.update(&counter.to_be_bytes());
        Ok(mac.finalize().into_bytes().into())
    })
}

fn check_expiry(expires_at: Option<DateTime<Utc>>) -> Result<(), AdminError> {
    match expires_at {
        Some(t) if t <= Utc::now() => Err(AdminError::Invalid(
            "expires_at: must be in the future".into(),
        )),
        _ => Ok(()),
    }
}

async fn insert_key(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    id: ApiKeyId,
    tenant: TenantId,
    workspace: WorkspaceId,
    name: &str,
    secret: &str,
    expires_at: Option<DateTime<Utc>>,
) -> Result<String, AdminError> {
    let visible_prefix = secret[..SECRET_PREFIX.len() + 6].to_string();
    sqlx::query(
        "INSERT INTO api_keys (id, tenant_id, workspace_id, name, secret_sha256, visible_prefix, expires_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(id.as_uuid())
    .bind(tenant.as_uuid())
    .bind(workspace.as_uuid())
    .bind(name)
    .bind(&hash_secret(secret)[..])
    .bind(&visible_prefix)
    .bind(expires_at)
    .execute(&mut **tx)
    .await?;
    Ok(visible_prefix)
}

/// Create an API key for a tenant's default workspace.
pub async fn create_key(
    pool: &PgPool,
    actor: &Actor,
    tenant: &Tenant,
    name: &str,
    expires_at: Option<DateTime<Utc>>,
) -> Result<NewKey, AdminError> {
    create_key_in(
        pool,
        actor,
        tenant,
        tenant.default_workspace,
        name,
        expires_at,
    )
    .await
}

/// Create an API key in one of a tenant's workspaces (not an archived one).
pub async fn create_key_in(
    pool: &PgPool,
    actor: &Actor,
    tenant: &Tenant,
    workspace: WorkspaceId,
    name: &str,
    expires_at: Option<DateTime<Utc>>,
) -> Result<NewKey, AdminError> {
    let name = super::check_name(name)?;
    check_expiry(expires_at)?;
    if workspace != tenant.default_workspace {
        super::workspaces::live_workspace(pool, tenant.id, workspace).await?;
    }
    let id = ApiKeyId::new();
    let secret = new_secret()?;
    let mut tx = pool.begin().await?;
    let visible_prefix =
        insert_key(&mut tx, id, tenant.id, workspace, name, &secret, expires_at).await?;
    let created = json!({
        "name": name, "prefix": visible_prefix, "expires_at": expires_at, "workspace_id": workspace,
    });
    let entry = audit::Entry::new("key.create", Some(tenant.id.as_uuid()), id).after(created);
    entry.commit(tx, actor).await?;
    Ok(NewKey {
        id,
        secret,
        visible_prefix,
    })
}

const KEY_COLUMNS: &str = "id, tenant_id, workspace_id, name, visible_prefix, created_at, last_used_at, \
    expires_at, revoked_at, rotated_to, requests_per_minute, input_tokens_per_minute, \
    output_tokens_per_minute, NULL::BIGINT AS monthly_budget_minor, tags";

fn key_info(r: &sqlx::postgres::PgRow, now: DateTime<Utc>) -> KeyInfo {
    let expires_at: Option<DateTime<Utc>> = r.get("expires_at");
    let revoked_at: Option<DateTime<Utc>> = r.get("revoked_at");
    let rotated_to: Option<Uuid> = r.get("rotated_to");
    let state = if revoked_at.is_some() {
        KeyState::Revoked
    } else if expires_at.is_some_and(|e| e <= now) {
        KeyState::Expired
    } else if rotated_to.is_some() {
        KeyState::Rotating
    } else {
        KeyState::Active
    };
    KeyInfo {
        id: r.get("id"),
        tenant_id: r.get("tenant_id"),
        workspace_id: r.get("workspace_id"),
        name: r.get("name"),
        prefix: r.get("visible_prefix"),
        state,
        created_at: r.get("created_at"),
        last_used_at: r.get("last_used_at"),
        expires_at,
        revoked_at,
        rotated_to,
        limits: Limits::from_row(r, &super::limits::TENANT_COLUMNS),
        tags: Tags::from_json(r.get("tags")),
    }
}

/// Every key of a tenant, newest first.
/// Whether `secret` is a key of this database that still authenticates (not revoked, not
/// expired): `cachet demo` reuses its stored key only then.
pub async fn key_is_live(pool: &PgPool, secret: &str) -> Result<bool, AdminError> {
    Ok(sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM api_keys WHERE secret_sha256 = $1 AND revoked_at IS NULL \
         AND (expires_at IS NULL OR expires_at > now()))",
    )
    .bind(&hash_secret(secret)[..])
    .fetch_one(pool)
    .await?)
}

pub async fn list_keys(pool: &PgPool, tenant: TenantId) -> Result<Vec<KeyInfo>, AdminError> {
    let tenant = tenant.as_uuid();
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {KEY_COLUMNS} FROM api_keys WHERE tenant_id = $1 ORDER BY created_at DESC, id"
    )))
    .bind(tenant)
    .fetch_all(pool)
    .await?;
    let now = Utc::now();
    Ok(rows.iter().map(|r| key_info(r, now)).collect())
}

/// One key, if it belongs to `tenant` (any tenant with `None`).
pub async fn get_key(
    pool: &PgPool,
    tenant: Option<Uuid>,
    key: Uuid,
) -> Result<KeyInfo, AdminError> {
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {KEY_COLUMNS} FROM api_keys WHERE id = $1 AND ($2::UUID IS NULL OR tenant_id = $2)"
    )))
    .bind(key)
    .bind(tenant)
    .fetch_optional(pool)
    .await?;
    row.map(|r| key_info(&r, Utc::now()))
        .ok_or_else(|| AdminError::NotFound(format!("key {key}")))
}

/// Revoke a key (of `tenant`, when given); running gateways refuse it within about a second.
/// Revoking a revoked key changes nothing.
pub async fn revoke_key(
    pool: &PgPool,
    actor: &Actor,
    tenant: Option<Uuid>,
    key: ApiKeyId,
) -> Result<KeyInfo, AdminError> {
    let before = get_key(pool, tenant, key.as_uuid()).await?;
    if before.state == KeyState::Revoked {
        return Ok(before);
    }
    let mut tx = pool.begin().await?;
    sqlx::query("UPDATE api_keys SET revoked_at = now() WHERE id = $1 AND revoked_at IS NULL")
        .bind(key.as_uuid())
        .execute(&mut *tx)
        .await?;
    audit::Entry::new("key.revoke", Some(before.tenant_id), key)
        .before(json!({"state": before.state, "prefix": before.prefix}))
        .after(json!({"state": "revoked"}))
        .commit(tx, actor)
        .await?;
    get_key(pool, tenant, key.as_uuid()).await
}

/// Set (or clear, with `None`) a key's expiry.
pub async fn set_key_expiry(
    pool: &PgPool,
    actor: &Actor,
    tenant: Option<Uuid>,
    key: Uuid,
    expires_at: Option<DateTime<Utc>>,
) -> Result<KeyInfo, AdminError> {
    check_expiry(expires_at)?;
    let before = get_key(pool, tenant, key).await?;
    if matches!(before.state, KeyState::Revoked | KeyState::Expired) {
        return Err(AdminError::State(format!(
            "the key is {}; create a new one instead",
            if before.state == KeyState::Revoked {
                "revoked"
            } else {
                "expired"
            }
        )));
    }
    if before.state == KeyState::Rotating {
        return Err(AdminError::State(
            "the key was rotated: it ends with its grace period; set the new key's expiry instead"
                .into(),
        ));
    }
    let mut tx = pool.begin().await?;
    sqlx::query("UPDATE api_keys SET expires_at = $2 WHERE id = $1")
        .bind(key)
        .bind(expires_at)
        .execute(&mut *tx)
        .await?;
    audit::Entry::new("key.expiry", Some(before.tenant_id), key)
        .before(json!({"expires_at": before.expires_at}))
        .after(json!({"expires_at": expires_at}))
        .commit(tx, actor)
        .await?;
    get_key(pool, tenant, key).await
}

/// Change a key's own rate limits: each within its workspace's and the tenant's (the
/// tightest of those set). A key has no budget of its own.
pub async fn set_key_limits(
    pool: &PgPool,
    actor: &Actor,
    tenant: TenantId,
    key: Uuid,
    patch: &LimitsPatch,
) -> Result<KeyInfo, AdminError> {
    if patch.monthly_budget_minor.is_some() {
        return Err(AdminError::Invalid(
            "monthly_budget_minor: a key has no budget of its own; set one on its workspace or the tenant".into(),
        ));
    }
    let before = get_key(pool, Some(tenant.as_uuid()), key).await?;
    if matches!(before.state, KeyState::Revoked | KeyState::Expired) {
        return Err(AdminError::State(
            "the key no longer works; its limits cannot change".into(),
        ));
    }
    let limits = patch.apply(before.limits);
    limits.validate("")?;
    let workspace =
        super::workspaces::get_workspace(pool, tenant, WorkspaceId(before.workspace_id)).await?;
    limits.within(&workspace.limits, "", "its workspace's")?;
    let tenant_limits = super::policy::get_policy(pool, tenant).await?.limits;
    limits.within(&tenant_limits, "", "the tenant's")?;
    let mut tx = pool.begin().await?;
    sqlx::query(
        "UPDATE api_keys SET requests_per_minute = $2, input_tokens_per_minute = $3, \
         output_tokens_per_minute = $4 WHERE id = $1",
    )
    .bind(key)
    .bind(limits.requests_per_minute)
    .bind(limits.input_tokens_per_minute)
    .bind(limits.output_tokens_per_minute)
    .execute(&mut *tx)
    .await?;
    audit::Entry::new("key.limits", Some(tenant.as_uuid()), key)
        .before(json!({"limits": before.limits}))
        .after(json!({"limits": limits}))
        .commit(tx, actor)
        .await?;
    get_key(pool, Some(tenant.as_uuid()), key).await
}

/// Replace a key's own tags.
pub async fn set_key_tags(
    pool: &PgPool,
    actor: &Actor,
    tenant: TenantId,
    key: Uuid,
    tags: &Tags,
) -> Result<KeyInfo, AdminError> {
    tags.validate()?;
    let before = get_key(pool, Some(tenant.as_uuid()), key).await?;
    let mut tx = pool.begin().await?;
    sqlx::query("UPDATE api_keys SET tags = $2 WHERE id = $1")
        .bind(key)
        .bind(tags.json())
        .execute(&mut *tx)
        .await?;
    audit::Entry::new("key.tags", Some(tenant.as_uuid()), key)
        .before(json!({"tags": before.tags}))
        .after(json!({"tags": tags}))
        .commit(tx, actor)
        .await?;
    get_key(pool, Some(tenant.as_uuid()), key).await
}

/// What a rotation did.
#[derive(Clone, Debug)]
pub struct Rotation {
    pub old: KeyInfo,
    pub new: KeyInfo,
    /// The new key's secret: `None` when a retry comes after the replay window.
    pub secret: Option<String>,
    pub grace_until: DateTime<Utc>,
    /// Whether this answers a retry of an earlier rotation.
    pub replayed: bool,
}

/// What a rotation asks for.
pub struct RotateRequest<'a> {
    pub tenant: Option<Uuid>,
    pub key: Uuid,
    /// How long the old secret keeps working.
    pub grace: Duration,
    pub idempotency_key: Option<&'a str>,
    /// The new key's expiry.
    pub expires_at: Option<DateTime<Utc>>,
}

/// Rotate a key (see the module docs). `server_key` is the server's admin secret: with it,
/// a retry under the same idempotency key gets the same secret back.
pub async fn rotate_key(
    pool: &PgPool,
    actor: &Actor,
    req: &RotateRequest<'_>,
    server_key: Option<&[u8]>,
) -> Result<Rotation, AdminError> {
    if req.grace < Duration::zero() || req.grace > MAX_GRACE {
        return Err(AdminError::Invalid(
            "grace_seconds: between 0 and 2592000 (30 days)".into(),
        ));
    }
    if let Some(k) = req.idempotency_key
        && (k.is_empty() || k.len() > 255)
    {
        return Err(AdminError::Invalid(
            "Idempotency-Key: 1 to 255 characters".into(),
        ));
    }
    check_expiry(req.expires_at)?;
    let mut tx = pool.begin().await?;
    // One rotation of a key at a time: a concurrent retry waits here, then finds the first's
    // result below.
    let old = sqlx::query(
        "SELECT tenant_id, workspace_id, name, revoked_at, expires_at, rotated_to FROM api_keys \
         WHERE id = $1 AND ($2::UUID IS NULL OR tenant_id = $2) FOR UPDATE",
    )
    .bind(req.key)
    .bind(req.tenant)
    .fetch_optional(&mut *tx)
    .await?
    .ok_or_else(|| AdminError::NotFound(format!("key {}", req.key)))?;
    if let Some(idem) = req.idempotency_key
        && let Some(prior) = sqlx::query(
            "SELECT new_key_id, grace_until, secret_seed FROM api_key_rotations \
             WHERE old_key_id = $1 AND idempotency_key = $2",
        )
        .bind(req.key)
        .bind(idem)
        .fetch_optional(&mut *tx)
        .await?
    {
        tx.commit().await?;
        let new_id: Uuid = prior.get("new_key_id");
        let seed: Option<Vec<u8>> = prior.get("secret_seed");
        let hash: Vec<u8> = sqlx::query_scalar("SELECT secret_sha256 FROM api_keys WHERE id = $1")
            .bind(new_id)
            .fetch_one(pool)
            .await?;
        let secret = match (seed, server_key) {
            (Some(seed), Some(k)) => {
                Some(derived_secret(k, &seed)?).filter(|s| hash_secret(s)[..] == hash[..])
            }
            _ => None,
        };
        return Ok(Rotation {
            old: get_key(pool, req.tenant, req.key).await?,
            new: get_key(pool, req.tenant, new_id).await?,
            secret,
            grace_until: prior.get("grace_until"),
            replayed: true,
        });
    }
    let now = Utc::now();
    let revoked: Option<DateTime<Utc>> = old.get("revoked_at");
    let expires: Option<DateTime<Utc>> = old.get("expires_at");
    let rotated_to: Option<Uuid> = old.get("rotated_to");
    if revoked.is_some() || expires.is_some_and(|e| e <= now) {
        return Err(AdminError::State(
            "the key is revoked or expired; create a new one instead".into(),
        ));
    }
    if let Some(to) = rotated_to {
        return Err(AdminError::State(format!(
            "the key was already rotated to {to}; rotate that key instead"
        )));
    }
    let tenant_id: Uuid = old.get("tenant_id");
    let workspace: Uuid = old.get("workspace_id");
    let name: String = old.get("name");
    // With an idempotency key and the server's secret, the new secret can be derived again
    // by a retry; otherwise it is plain random.
    let seed = match (req.idempotency_key, server_key) {
        (Some(_), Some(_)) => Some(random_bytes()?),
        _ => None,
    };
    let secret = match (&seed, server_key) {
        (Some(seed), Some(k)) => derived_secret(k, seed)?,
        _ => new_secret()?,
    };
    let new_id = ApiKeyId::new();
    let prefix = insert_key(
        &mut tx,
        new_id,
        TenantId(tenant_id),
        WorkspaceId(workspace),
        &name,
        &secret,
        req.expires_at,
    )
    .await?;
    // The new key keeps the old one's own limits and tags.
    sqlx::query(
        "UPDATE api_keys n SET requests_per_minute = o.requests_per_minute, \
         input_tokens_per_minute = o.input_tokens_per_minute, \
         output_tokens_per_minute = o.output_tokens_per_minute, tags = o.tags FROM api_keys o \
         WHERE n.id = $1 AND o.id = $2",
    )
    .bind(new_id.as_uuid())
    .bind(req.key)
    .execute(&mut *tx)
    .await?;
    let grace_until = expires.map_or(now + req.grace, |e| e.min(now + req.grace));
    sqlx::query("UPDATE api_keys SET expires_at = $2, rotated_to = $3 WHERE id = $1")
        .bind(req.key)
        .bind(grace_until)
        .bind(new_id.as_uuid())
        .execute(&mut *tx)
        .await?;
    if let Some(idem) = req.idempotency_key {
        sqlx::query(
            "INSERT INTO api_key_rotations (old_key_id, idempotency_key, new_key_id, grace_until, secret_seed, created_by) \
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(req.key)
        .bind(idem)
        .bind(new_id.as_uuid())
        .bind(grace_until)
        .bind(seed.as_ref().map(|s| &s[..]))
        .bind(&actor.name)
        .execute(&mut *tx)
        .await?;
    }
    audit::Entry::new("key.rotate", Some(tenant_id), req.key)
        .before(json!({"expires_at": expires}))
        .after(json!({"expires_at": grace_until, "rotated_to": new_id, "new_prefix": prefix}))
        .commit(tx, actor)
        .await?;
    Ok(Rotation {
        old: get_key(pool, req.tenant, req.key).await?,
        new: get_key(pool, req.tenant, new_id.as_uuid()).await?,
        secret: Some(secret),
        grace_until,
        replayed: false,
    })
}

/// Erase rotation seeds older than the replay window: after it, a retry can no longer show
/// the secret. Returns how many were erased.
pub async fn expire_rotation_seeds(pool: &PgPool) -> Result<u64, AdminError> {
    let r = sqlx::query(
        "UPDATE api_key_rotations SET secret_seed = NULL WHERE secret_seed IS NOT NULL \
         AND created_at < now() - make_interval(secs => $1)",
    )
    .bind(ROTATION_REPLAY.num_seconds() as f64)
    .execute(pool)
    .await?;
    Ok(r.rows_affected())
}

/// Record that keys were used (the latest time of each), in one statement.
pub async fn touch_keys(pool: &PgPool, used: &[(Uuid, DateTime<Utc>)]) -> Result<(), AdminError> {
    if used.is_empty() {
        return Ok(());
    }
    let (ids, at): (Vec<Uuid>, Vec<DateTime<Utc>>) = used.iter().copied().unzip();
    sqlx::query(
        "UPDATE api_keys k SET last_used_at = u.at FROM UNNEST($1::UUID[], $2::TIMESTAMPTZ[]) AS u(id, at) \
         WHERE k.id = u.id AND (k.last_used_at IS NULL OR k.last_used_at < u.at)",
    )
    .bind(ids)
    .bind(at)
    .execute(pool)
    .await?;
    Ok(())
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

    #[test]
    fn derived_secrets_depend_on_the_seed_and_the_server_key() {
        let a = derived_secret(b"server-key-one", &[1; 32]).unwrap();
        assert_eq!(a, derived_secret(b"server-key-one", &[1; 32]).unwrap());
        assert_ne!(a, derived_secret(b"server-key-one", &[2; 32]).unwrap());
        assert_ne!(a, derived_secret(b"server-key-two", &[1; 32]).unwrap());
        assert_eq!(a.len(), SECRET_PREFIX.len() + 40);
    }
}
