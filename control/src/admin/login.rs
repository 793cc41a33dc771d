//! Admin users and their logins.
//!
//! - Users are created by `cachet admin user create` or by a platform admin through the API;
//!   there is no default user and no default password. Passwords are hashed with argon2id
//!   (the crate's defaults: 19 MiB, 2 passes) and must be at least 12 characters.
//! - A login returns a short-lived access token (a JWT with the user's role, tenant and session
//!   id) and a refresh token (random, stored as SHA-256, replaced at every refresh). Logout,
//!   disabling the user or deleting its tenant ends the session, and with it every access
//!   token of the session.
//! - **Backoff and lockout**: after each failed attempt the next one is refused for
//!   2^(n−1) seconds (at most 30), and after [`LOCK_AFTER`] consecutive failures the account
//!   is locked for [`LOCK_FOR`]; both answer 429 with `retry-after`. Unknown usernames are
//!   throttled the same way (in memory) and take as long to refuse, so the answers do not tell
//!   which usernames exist.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use argon2::Argon2;
use argon2::password_hash::rand_core::OsRng;
use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use identity::Role;
use serde::{Deserialize, Serialize};
use serde_json::json;
use sha2::{Digest, Sha256};
use sqlx::{PgPool, Row};
use utoipa::ToSchema;
use uuid::Uuid;

use super::{Admin, AdminJson, AdminPath, AdminState};
use crate::metrics;
use crate::tenants::AdminError;
use crate::tenants::audit::{self, Actor, Entry};
use cachet_common::error::{ApiError, ErrorCode};

/// Consecutive failures that lock an account.
pub const LOCK_AFTER: i32 = 5;
/// How long a locked account stays locked.
pub const LOCK_FOR: Duration = Duration::from_secs(15 * 60);
/// The longest wait between two attempts before the lock.
const MAX_BACKOFF_SECS: i64 = 30;
/// Shortest password accepted.
pub const MIN_PASSWORD: usize = 12;

/// An admin user as listed (never its password hash).
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct User {
    pub id: Uuid,
    pub username: String,
    pub role: Role,
    pub tenant: Option<Uuid>,
    pub created_at: DateTime<Utc>,
    pub disabled_at: Option<DateTime<Utc>>,
    pub locked_until: Option<DateTime<Utc>>,
    pub last_login_at: Option<DateTime<Utc>>,
    pub failed_logins: i32,
    /// When the password last changed (its creation counts).
    pub password_changed_at: DateTime<Utc>,
}

fn user_row(r: &sqlx::postgres::PgRow) -> User {
    let role: String = r.get("role");
    User {
        id: r.get("id"),
        username: r.get("username"),
        role: Role::parse(&role).unwrap_or(Role::Finance),
        tenant: r.get("tenant_id"),
        created_at: r.get("created_at"),
        disabled_at: r.get("disabled_at"),
        locked_until: r.get("locked_until"),
        last_login_at: r.get("last_login_at"),
        failed_logins: r.get("failed_logins"),
        password_changed_at: r.get("password_changed_at"),
    }
}

const USER_COLUMNS: &str = "id, username, role, tenant_id, created_at, disabled_at, \
    locked_until, last_login_at, failed_logins, password_changed_at";

/// A user to create.
#[derive(Clone, Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewUser {
    pub username: String,
    pub password: String,
    pub role: Role,
    /// The tenant of a `tenant_admin` (none for the other roles).
    #[serde(default)]
    pub tenant: Option<Uuid>,
}

pub(crate) fn check_password(username: &str, password: &str) -> Result<(), AdminError> {
    if password.chars().count() < MIN_PASSWORD {
        return Err(AdminError::Invalid(format!(
            "password: at least {MIN_PASSWORD} characters"
        )));
    }
    if password.len() > 1024 {
        return Err(AdminError::Invalid("password: at most 1024 bytes".into()));
    }
    if password.eq_ignore_ascii_case(username) {
        return Err(AdminError::Invalid(
            "password: must not be the username".into(),
        ));
    }
    Ok(())
}

/// An argon2id PHC string for `password` (CPU work: call it off the async runtime).
pub fn hash_password(password: &str) -> Result<String, AdminError> {
    let salt = SaltString::generate(&mut OsRng);
    Argon2::default()
        .hash_password(password.as_bytes(), &salt)
        .map(|h| h.to_string())
        .map_err(|e| AdminError::Random(format!("hashing a password: {e}")))
}

pub(crate) fn verify_password(password: &str, phc: &str) -> bool {
    PasswordHash::new(phc).is_ok_and(|h| {
        Argon2::default()
            .verify_password(password.as_bytes(), &h)
            .is_ok()
    })
}

/// A hash of no one's password, verified against when the username is unknown so that an
/// unknown user takes as long to refuse as a wrong password.
fn decoy_hash() -> &'static str {
    static DECOY: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    DECOY.get_or_init(|| hash_password("decoy password nobody has").unwrap_or_default())
}

pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, AdminError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| AdminError::Random(format!("password task: {e}")))
}

/// Create an admin user.
pub async fn create_user(pool: &PgPool, actor: &Actor, u: NewUser) -> Result<User, AdminError> {
    let username = u.username.trim().to_string();
    if username.is_empty()
        || username.len() > 128
        || !username
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "._@+-".contains(c))
    {
        return Err(AdminError::Invalid(
            "username: 1 to 128 of letters, digits and . _ @ + -".into(),
        ));
    }
    check_password(&username, &u.password)?;
    if (u.role == Role::TenantAdmin) != u.tenant.is_some() {
        return Err(AdminError::Invalid(
            "tenant: a tenant_admin names exactly one tenant; other roles name none".into(),
        ));
    }
    if let Some(t) = u.tenant {
        let live: Option<bool> =
            sqlx::query_scalar("SELECT deleted_at IS NULL FROM tenants WHERE id = $1")
                .bind(t)
                .fetch_optional(pool)
                .await?;
        if live != Some(true) {
            return Err(AdminError::TenantNotFound(t.to_string()));
        }
    }
    let password = u.password;
    let phc = blocking(move || hash_password(&password)).await??;
    let id = Uuid::now_v7();
    let mut tx = pool.begin().await?;
    sqlx::query(
        "INSERT INTO admin_users (id, username, password_hash, role, tenant_id, created_by) \
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(id)
    .bind(&username)
    .bind(&phc)
    .bind(u.role.as_str())
    .bind(u.tenant)
    .bind(&actor.name)
    .execute(&mut *tx)
    .await?;
    Entry::new("user.create", u.tenant, id)
        .after(json!({"username": username, "role": u.role, "tenant": u.tenant}))
        .commit(tx, actor)
        .await?;
    get_user(pool, id).await
}

pub async fn get_user(pool: &PgPool, id: Uuid) -> Result<User, AdminError> {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {USER_COLUMNS} FROM admin_users WHERE id = $1"
    )))
    .bind(id)
    .fetch_optional(pool)
    .await?
    .map(|r| user_row(&r))
    .ok_or_else(|| AdminError::NotFound(format!("user {id}")))
}

/// The admin sessions in Postgres, as [`identity::AdminAuth`] asks about them: live while not
/// logged out, not expired, and their user not disabled.
pub struct SessionStore(pub PgPool);

impl identity::Sessions for SessionStore {
    fn live(
        &self,
        sid: Uuid,
    ) -> std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<bool, identity::IdentityError>> + Send + '_>,
    > {
        Box::pin(async move {
            let live: Option<bool> = sqlx::query_scalar(
                "SELECT s.revoked_at IS NULL AND s.expires_at > now() AND u.disabled_at IS NULL \
                 FROM admin_sessions s JOIN admin_users u ON u.id = s.user_id WHERE s.id = $1",
            )
            .bind(sid)
            .fetch_optional(&self.0)
            .await
            .map_err(|e| identity::IdentityError::Db(e.to_string()))?;
            Ok(live == Some(true))
        })
    }
}

/// The user named `username`, if any.
pub async fn find_user(pool: &PgPool, username: &str) -> Result<Option<User>, AdminError> {
    Ok(sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {USER_COLUMNS} FROM admin_users WHERE username = $1"
    )))
    .bind(username)
    .fetch_optional(pool)
    .await?
    .map(|r| user_row(&r)))
}

/// Users, of one tenant or all.
pub async fn users(pool: &PgPool, tenant: Option<Uuid>) -> Result<Vec<User>, AdminError> {
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {USER_COLUMNS} FROM admin_users WHERE $1::UUID IS NULL OR tenant_id = $1 ORDER BY username"
    )))
    .bind(tenant)
    .fetch_all(pool)
    .await?;
    Ok(rows.iter().map(user_row).collect())
}

/// Disable a user and end its sessions.
pub async fn disable(pool: &PgPool, actor: &Actor, id: Uuid) -> Result<User, AdminError> {
    let before = get_user(pool, id).await?;
    let mut tx = pool.begin().await?;
    // The console must keep someone who can administer it: the last active platform admin
    // stays (rows locked so two concurrent disables cannot both pass).
    let active: Vec<Uuid> = sqlx::query_scalar(
        "SELECT id FROM admin_users WHERE role = 'platform_admin' AND disabled_at IS NULL FOR UPDATE",
    )
    .fetch_all(&mut *tx)
    .await?;
    if active == [id] {
        return Err(AdminError::Conflict(
            "the last active platform_admin cannot be disabled: create another one first".into(),
        ));
    }
    sqlx::query("UPDATE admin_users SET disabled_at = COALESCE(disabled_at, now()) WHERE id = $1")
        .bind(id)
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "UPDATE admin_sessions SET revoked_at = now() WHERE user_id = $1 AND revoked_at IS NULL",
    )
    .bind(id)
    .execute(&mut *tx)
    .await?;
    Entry::new("user.disable", before.tenant, id)
        .before(json!({"username": before.username}))
        .after(json!({"disabled": true}))
        .commit(tx, actor)
        .await?;
    get_user(pool, id).await
}

/// Clear a user's failed attempts and lock.
pub async fn unlock(pool: &PgPool, actor: &Actor, id: Uuid) -> Result<User, AdminError> {
    let before = get_user(pool, id).await?;
    let mut tx = pool.begin().await?;
    sqlx::query(
        "UPDATE admin_users SET failed_logins = 0, locked_until = NULL, last_failed_at = NULL WHERE id = $1",
    )
    .bind(id)
    .execute(&mut *tx)
    .await?;
    Entry::new("user.unlock", before.tenant, id)
        .before(json!({"failed_logins": before.failed_logins, "locked_until": before.locked_until}))
        .after(json!({"failed_logins": 0}))
        .commit(tx, actor)
        .await?;
    get_user(pool, id).await
}

/// When the next attempt is allowed after `failures` consecutive failures, the last at `last`.
fn next_allowed(failures: i32, last: Option<DateTime<Utc>>) -> Option<DateTime<Utc>> {
    let last = last?;
    if failures <= 0 {
        return None;
    }
    let wait = (1i64 << (failures - 1).min(10)).min(MAX_BACKOFF_SECS);
    Some(last + chrono::Duration::seconds(wait))
}

/// Failed attempts on one unknown username.
struct Attempts {
    failures: i32,
    last: DateTime<Utc>,
    locked_until: Option<DateTime<Utc>>,
}

/// Attempts on usernames that do not exist, throttled like real accounts.
#[derive(Default)]
pub struct Throttle {
    unknown: Mutex<HashMap<String, Attempts>>,
}

impl Throttle {
    /// Until when an attempt on `username` is refused, and whether that is a lock.
    fn wait_until(&self, username: &str) -> Option<(DateTime<Utc>, bool)> {
        let m = self.unknown.lock().unwrap_or_else(|p| p.into_inner());
        let a = m.get(username)?;
        a.locked_until
            .map(|l| (l, true))
            .or_else(|| next_allowed(a.failures, Some(a.last)).map(|n| (n, false)))
    }

    fn failed(&self, username: &str, now: DateTime<Utc>) {
        let mut m = self.unknown.lock().unwrap_or_else(|p| p.into_inner());
        if m.len() >= 10_000 {
            m.clear();
        }
        let a = m.entry(username.to_string()).or_insert(Attempts {
            failures: 0,
            last: now,
            locked_until: None,
        });
        a.failures += 1;
        a.last = now;
        if a.failures >= LOCK_AFTER {
            a.locked_until = Some(now + chrono::Duration::from_std(LOCK_FOR).unwrap_or_default());
            a.failures = 0;
        } else if a.locked_until.is_some_and(|l| l <= now) {
            a.locked_until = None;
        }
    }
}

/// Login credentials.
#[derive(Deserialize, ToSchema)]
pub struct LoginRequest {
    pub username: String,
    pub password: String,
}

/// A refresh.
#[derive(Deserialize, ToSchema)]
pub struct RefreshRequest {
    pub refresh_token: String,
}

/// Tokens of a login.
#[derive(Serialize, ToSchema)]
pub struct LoginTokens {
    pub access_token: String,
    pub token_type: &'static str,
    /// Seconds the access token is valid for.
    pub expires_in: u64,
    pub refresh_token: String,
    /// When the login ends (refreshing does not extend it).
    pub session_expires_at: DateTime<Utc>,
    pub user: Me,
}

/// Who is logged in.
#[derive(Clone, Serialize, ToSchema)]
pub struct Me {
    pub username: String,
    pub role: Role,
    pub tenant: Option<Uuid>,
    /// The tenant's name, for a tenant admin.
    pub tenant_name: Option<String>,
}

/// How long until `until`, in whole seconds rounded up (at least 1).
fn secs_until(until: DateTime<Utc>, now: DateTime<Utc>) -> i64 {
    ((until - now).num_milliseconds() + 999)
        .div_euclid(1000)
        .max(1)
}

/// 429 for an attempt that comes too soon (backoff) or on a locked account. The answer
/// depends only on how long the wait is, never on whether the username exists: an unknown
/// username is throttled and locked on the same schedule, and answered in the same bytes.
pub(crate) fn too_many(until: DateTime<Utc>, now: DateTime<Utc>, locked: bool) -> ApiError {
    let secs = secs_until(until, now);
    metrics::ADMIN_LOGINS
        .with_label_values(&[if locked { "locked" } else { "throttled" }])
        .inc();
    ApiError::new(
        ErrorCode::RateLimit,
        format!(
            "too many failed logins: try again in {}",
            cachet_common::error::wait_text(secs)
        ),
    )
    .with_header("retry-after", &secs.to_string())
}

fn invalid_login() -> ApiError {
    metrics::ADMIN_LOGINS.with_label_values(&["invalid"]).inc();
    ApiError::new(ErrorCode::Authentication, "invalid username or password")
}

fn refresh_token() -> Result<String, AdminError> {
    let mut raw = [0u8; 32];
    getrandom::fill(&mut raw).map_err(|e| AdminError::Random(e.to_string()))?;
    Ok(format!("cachet-refresh-{}", hex::encode(raw)))
}

pub(crate) fn sha256(s: &str) -> Vec<u8> {
    Sha256::digest(s.as_bytes()).to_vec()
}

async fn me_of(
    pool: &PgPool,
    role: Role,
    tenant: Option<Uuid>,
    username: &str,
) -> Result<Me, AdminError> {
    let tenant_name = match tenant {
        Some(t) => {
            sqlx::query_scalar("SELECT name FROM tenants WHERE id = $1")
                .bind(t)
                .fetch_optional(pool)
                .await?
        }
        None => None,
    };
    Ok(Me {
        username: username.to_string(),
        role,
        tenant,
        tenant_name,
    })
}

/// Issue an access token for session `sid`.
fn access_token(state: &AdminState, me: &Me, sid: Uuid) -> Result<String, ApiError> {
    let jwt = state.finance.auth.jwt.as_ref().ok_or_else(|| {
        ApiError::new(
            ErrorCode::Unavailable,
            "the admin API is off: set CACHET_ADMIN_JWT_SECRET",
        )
    })?;
    jwt.issue_for_session(
        &me.username,
        me.role,
        me.tenant,
        Some(sid),
        state.config.access_ttl,
    )
    .map_err(ApiError::from)
}

/// Count a failed attempt on user `id` (a login, or a password change with the wrong current
/// password): the next attempt waits, and the [`LOCK_AFTER`]th in a row locks the account.
pub(crate) async fn record_failure(
    pool: &PgPool,
    actor: &Actor,
    id: Uuid,
    tenant: Option<Uuid>,
    failures: i32,
) -> Result<(), AdminError> {
    let locked: Option<DateTime<Utc>> = sqlx::query_scalar(
        "UPDATE admin_users SET failed_logins = CASE WHEN failed_logins + 1 >= $2 THEN 0 ELSE failed_logins + 1 END, \
         last_failed_at = now(), \
         locked_until = CASE WHEN failed_logins + 1 >= $2 THEN now() + make_interval(secs => $3) END \
         WHERE id = $1 RETURNING locked_until",
    )
    .bind(id)
    .bind(LOCK_AFTER)
    .bind(LOCK_FOR.as_secs() as f64)
    .fetch_one(pool)
    .await?;
    let action = if locked.is_some() {
        "login.lockout"
    } else {
        "login.failure"
    };
    audit::record_alone(
        pool,
        actor,
        Entry::new(action, tenant, id).after(json!({"failed_logins": failures + 1})),
    )
    .await
}

/// Refuse an attempt on a user that is locked or inside its backoff.
pub(crate) fn check_throttle(
    failures: i32,
    last_failed: Option<DateTime<Utc>>,
    locked_until: Option<DateTime<Utc>>,
    now: DateTime<Utc>,
) -> Result<(), ApiError> {
    if let Some(locked) = locked_until.filter(|l| *l > now) {
        return Err(too_many(locked, now, true));
    }
    if let Some(next) = next_allowed(failures, last_failed).filter(|n| *n > now) {
        return Err(too_many(next, now, false));
    }
    Ok(())
}

/// Log in.
#[utoipa::path(post, path = "/v1/admin/login", tag = "admin", request_body = LoginRequest,
    responses((status = 200, body = LoginTokens), (status = 400, body = cachet_common::error::ErrorBody),
              (status = 401, body = cachet_common::error::ErrorBody), (status = 429, body = cachet_common::error::ErrorBody)))]
pub async fn login(
    State(state): State<AdminState>,
    AdminJson(req): AdminJson<LoginRequest>,
) -> Result<axum::Json<LoginTokens>, ApiError> {
    if state.finance.auth.jwt.is_none() {
        return Err(ApiError::new(
            ErrorCode::Unavailable,
            "the admin API is off: set CACHET_ADMIN_JWT_SECRET",
        ));
    }
    let username = req.username.trim().to_string();
    let now = Utc::now();
    let row = sqlx::query(
        "SELECT id, password_hash, role, tenant_id, disabled_at, failed_logins, last_failed_at, locked_until \
         FROM admin_users WHERE username = $1",
    )
    .bind(&username)
    .fetch_optional(&state.pool)
    .await
    .map_err(AdminError::from)?;
    let Some(row) = row.filter(|r| r.get::<Option<DateTime<Utc>>, _>("disabled_at").is_none())
    else {
        if let Some((until, locked)) = state.throttle.wait_until(&username).filter(|u| u.0 > now) {
            return Err(too_many(until, now, locked));
        }
        let password = req.password;
        blocking(move || verify_password(&password, decoy_hash())).await?;
        state.throttle.failed(&username, now);
        return Err(invalid_login());
    };
    let id: Uuid = row.get("id");
    let failures: i32 = row.get("failed_logins");
    check_throttle(
        failures,
        row.get("last_failed_at"),
        row.get("locked_until"),
        now,
    )?;
    let phc: String = row.get("password_hash");
    let password = req.password;
    let ok = blocking(move || verify_password(&password, &phc)).await?;
    let actor = Actor {
        name: format!("user:{username}"),
        role: row.get("role"),
        request_id: None,
    };
    let tenant: Option<Uuid> = row.get("tenant_id");
    if !ok {
        record_failure(&state.pool, &actor, id, tenant, failures).await?;
        return Err(invalid_login());
    }
    let role = Role::parse(row.get::<&str, _>("role")).unwrap_or(Role::Finance);
    let me = me_of(&state.pool, role, tenant, &username).await?;
    let sid = Uuid::now_v7();
    let refresh = refresh_token()?;
    let expires = now + chrono::Duration::from_std(state.config.session_ttl).unwrap_or_default();
    let mut tx = state.pool.begin().await.map_err(AdminError::from)?;
    sqlx::query(
        "UPDATE admin_users SET failed_logins = 0, last_failed_at = NULL, locked_until = NULL, \
         last_login_at = now() WHERE id = $1",
    )
    .bind(id)
    .execute(&mut *tx)
    .await
    .map_err(AdminError::from)?;
    sqlx::query(
        "INSERT INTO admin_sessions (id, user_id, refresh_sha256, expires_at) VALUES ($1, $2, $3, $4)",
    )
    .bind(sid)
    .bind(id)
    .bind(sha256(&refresh))
    .bind(expires)
    .execute(&mut *tx)
    .await
    .map_err(AdminError::from)?;
    Entry::new("login.success", tenant, id)
        .after(json!({"session": sid}))
        .commit(tx, &actor)
        .await?;
    metrics::ADMIN_LOGINS.with_label_values(&["ok"]).inc();
    Ok(axum::Json(LoginTokens {
        access_token: access_token(&state, &me, sid)?,
        token_type: "Bearer",
        expires_in: state.config.access_ttl.as_secs(),
        refresh_token: refresh,
        session_expires_at: expires,
        user: me,
    }))
}

/// Exchange a refresh token for a new access token and a new refresh token (the old one
/// stops working).
#[utoipa::path(post, path = "/v1/admin/refresh", tag = "admin", request_body = RefreshRequest,
    responses((status = 200, body = LoginTokens), (status = 401, body = cachet_common::error::ErrorBody)))]
pub async fn refresh(
    State(state): State<AdminState>,
    AdminJson(req): AdminJson<RefreshRequest>,
) -> Result<axum::Json<LoginTokens>, ApiError> {
    let next = refresh_token()?;
    let row = sqlx::query(
        "UPDATE admin_sessions s SET refresh_sha256 = $2, refreshed_at = now() FROM admin_users u \
         WHERE s.refresh_sha256 = $1 AND u.id = s.user_id AND s.revoked_at IS NULL AND s.expires_at > now() \
         AND u.disabled_at IS NULL \
         RETURNING s.id, s.expires_at, u.username, u.role, u.tenant_id",
    )
    .bind(sha256(req.refresh_token.trim()))
    .bind(sha256(&next))
    .fetch_optional(&state.pool)
    .await
    .map_err(AdminError::from)?
    .ok_or_else(|| {
        ApiError::new(
            ErrorCode::Authentication,
            "this refresh token is not valid (used already, logged out or expired): log in again",
        )
    })?;
    let role = Role::parse(row.get::<&str, _>("role")).unwrap_or(Role::Finance);
    let username: String = row.get("username");
    let me = me_of(&state.pool, role, row.get("tenant_id"), &username).await?;
    let sid: Uuid = row.get("id");
    Ok(axum::Json(LoginTokens {
        access_token: access_token(&state, &me, sid)?,
        token_type: "Bearer",
        expires_in: state.config.access_ttl.as_secs(),
        refresh_token: next,
        session_expires_at: row.get("expires_at"),
        user: me,
    }))
}

/// End the caller's session: its access and refresh tokens stop working.
#[utoipa::path(post, path = "/v1/admin/logout", tag = "admin",
    responses((status = 204, description = "Logged out"), (status = 401, body = cachet_common::error::ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn logout(State(state): State<AdminState>, admin: Admin) -> Result<Response, ApiError> {
    if let Some(sid) = admin.claims.sid {
        let mut tx = state.pool.begin().await.map_err(AdminError::from)?;
        sqlx::query(
            "UPDATE admin_sessions SET revoked_at = now() WHERE id = $1 AND revoked_at IS NULL",
        )
        .bind(sid)
        .execute(&mut *tx)
        .await
        .map_err(AdminError::from)?;
        Entry::new("logout", admin.claims.tenant, sid)
            .commit(tx, &admin.actor)
            .await?;
    }
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// Who the token belongs to.
#[utoipa::path(get, path = "/v1/admin/me", tag = "admin",
    responses((status = 200, body = Me), (status = 401, body = cachet_common::error::ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn me(State(state): State<AdminState>, admin: Admin) -> Result<axum::Json<Me>, ApiError> {
    Ok(axum::Json(
        me_of(
            &state.pool,
            admin.claims.role,
            admin.claims.tenant,
            &admin.claims.sub,
        )
        .await?,
    ))
}

#[derive(Serialize, ToSchema)]
pub struct UserList {
    pub data: Vec<User>,
}

/// Admin users (platform admins).
#[utoipa::path(get, path = "/v1/admin/users", tag = "admin",
    responses((status = 200, body = UserList), (status = 401, body = cachet_common::error::ErrorBody), (status = 403, body = cachet_common::error::ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn list_users(
    State(state): State<AdminState>,
    admin: Admin,
) -> Result<axum::Json<UserList>, ApiError> {
    admin.require(&[Role::PlatformAdmin])?;
    Ok(axum::Json(UserList {
        data: users(&state.pool, None).await?,
    }))
}

/// Create an admin user (platform admins).
#[utoipa::path(post, path = "/v1/admin/users", tag = "admin", request_body = NewUser,
    responses((status = 201, body = User), (status = 400, body = cachet_common::error::ErrorBody),
              (status = 403, body = cachet_common::error::ErrorBody), (status = 409, body = cachet_common::error::ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn create_user_handler(
    State(state): State<AdminState>,
    admin: Admin,
    AdminJson(u): AdminJson<NewUser>,
) -> Result<(StatusCode, axum::Json<User>), ApiError> {
    admin.require(&[Role::PlatformAdmin])?;
    let user = create_user(&state.pool, &admin.actor, u).await?;
    Ok((StatusCode::CREATED, axum::Json(user)))
}

/// Disable an admin user and end its sessions (platform admins).
#[utoipa::path(delete, path = "/v1/admin/users/{id}", tag = "admin",
    params(("id" = Uuid, Path, description = "User id")),
    responses((status = 200, body = User), (status = 403, body = cachet_common::error::ErrorBody), (status = 404, body = cachet_common::error::ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn disable_user(
    State(state): State<AdminState>,
    admin: Admin,
    AdminPath(id): AdminPath<Uuid>,
) -> Result<axum::Json<User>, ApiError> {
    admin.require(&[Role::PlatformAdmin])?;
    Ok(axum::Json(disable(&state.pool, &admin.actor, id).await?))
}

/// Clear a user's failed logins and lock (platform admins).
#[utoipa::path(post, path = "/v1/admin/users/{id}/unlock", tag = "admin",
    params(("id" = Uuid, Path, description = "User id")),
    responses((status = 200, body = User), (status = 403, body = cachet_common::error::ErrorBody), (status = 404, body = cachet_common::error::ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn unlock_user(
    State(state): State<AdminState>,
    admin: Admin,
    AdminPath(id): AdminPath<Uuid>,
) -> Result<axum::Json<User>, ApiError> {
    admin.require(&[Role::PlatformAdmin])?;
    Ok(axum::Json(unlock(&state.pool, &admin.actor, id).await?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_thirty_seconds() {
        let t: DateTime<Utc> = "2026-11-24T00:00:00Z".parse().unwrap();
        let wait = |n| (next_allowed(n, Some(t)).unwrap() - t).num_seconds();
        assert_eq!(next_allowed(0, Some(t)), None);
        assert_eq!(wait(1), 1);
        assert_eq!(wait(2), 2);
        assert_eq!(wait(4), 8);
        assert_eq!(wait(9), 30);
    }

    #[test]
    fn passwords_are_checked_and_hashed_with_argon2id() {
        assert!(check_password("ana", "short").is_err());
        assert!(check_password("ana-the-admin", "ANA-THE-ADMIN").is_err());
        check_password("ana", "a long enough passphrase").unwrap();
        let h = hash_password("a long enough passphrase").unwrap();
        assert!(h.starts_with("$argon2id$"), "{h}");
        assert!(verify_password("a long enough passphrase", &h));
        assert!(!verify_password("a long enough passphrasE", &h));
    }

    #[test]
    fn unknown_usernames_are_throttled_and_locked_like_accounts() {
        let th = Throttle::default();
        let t: DateTime<Utc> = "2026-11-24T00:00:00Z".parse().unwrap();
        assert!(th.wait_until("ghost").is_none());
        th.failed("ghost", t);
        assert_eq!(
            th.wait_until("ghost"),
            Some((t + chrono::Duration::seconds(1), false))
        );
        for _ in 1..LOCK_AFTER {
            th.failed("ghost", t);
        }
        let (until, locked) = th.wait_until("ghost").unwrap();
        assert!(
            locked && until >= t + chrono::Duration::minutes(14),
            "{until}"
        );
    }

    #[test]
    fn waits_are_rounded_up_to_whole_seconds() {
        let t: DateTime<Utc> = "2026-11-24T00:00:00Z".parse().unwrap();
        // Rounded up: 1.2 s left is 2 seconds, never "0 seconds".
        assert_eq!(secs_until(t + chrono::Duration::milliseconds(1200), t), 2);
        assert_eq!(secs_until(t - chrono::Duration::seconds(3), t), 1);
    }
}
