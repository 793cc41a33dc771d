//! Passwords after creation: a user changes its own (with the current one), and a platform
//! admin issues a one-time reset secret for a user who lost theirs.
//!
//! - Changing needs the current password and is throttled like a login (a wrong current
//!   password counts as a failed login, so it cannot be used to guess). The caller's other
//!   sessions end; the one it changed from stays.
//! - A reset secret (`cachet-reset-…`) is shown once, stored as SHA-256 only, valid for
//!   [`RESET_TTL`] and for one use; a newer one retires the older. Redeeming it (no login
//!   needed) sets the new password, ends every session of the user and clears its lockout.
//!   A wrong, used or expired secret gets one answer.
//!
//! Every step writes an audit row (never a secret or a password).

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use cachet_common::error::{ApiError, ErrorCode};
use chrono::{DateTime, Utc};
use identity::Role;
use serde::{Deserialize, Serialize};
use serde_json::json;
use sqlx::{PgPool, Row};
use utoipa::ToSchema;
use uuid::Uuid;

use super::login::{
    blocking, check_password, check_throttle, get_user, hash_password, record_failure, sha256,
    verify_password,
};
use super::{Admin, AdminJson, AdminPath, AdminState};
use crate::tenants::AdminError;
use crate::tenants::audit::{Actor, Entry};

/// How long a reset secret can be redeemed.
pub const RESET_TTL: std::time::Duration = std::time::Duration::from_secs(24 * 3600);

/// Set user `id`'s password to `new_password` (already checked) in `tx`: its lockout is
/// cleared and its sessions end, except `keep`.
async fn store_password(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    id: Uuid,
    new_password: String,
    keep: Option<Uuid>,
) -> Result<(), AdminError> {
    let phc = blocking(move || hash_password(&new_password)).await??;
    sqlx::query(
        "UPDATE admin_users SET password_hash = $2, password_changed_at = now(), \
         failed_logins = 0, last_failed_at = NULL, locked_until = NULL WHERE id = $1",
    )
    .bind(id)
    .bind(&phc)
    .execute(&mut **tx)
    .await?;
    sqlx::query(
        "UPDATE admin_sessions SET revoked_at = now() \
         WHERE user_id = $1 AND revoked_at IS NULL AND ($2::UUID IS NULL OR id <> $2)",
    )
    .bind(id)
    .bind(keep)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Set a user's password (an operator at the CLI): its sessions end and its lockout clears.
pub async fn set_password(
    pool: &PgPool,
    actor: &Actor,
    id: Uuid,
    new_password: String,
) -> Result<(), AdminError> {
    let user = get_user(pool, id).await?;
    check_password(&user.username, &new_password)?;
    let mut tx = pool.begin().await?;
    store_password(&mut tx, id, new_password, None).await?;
    Entry::new("user.password_set", user.tenant, id)
        .commit(tx, actor)
        .await?;
    Ok(())
}

/// A one-time reset secret, shown once.
#[derive(Debug, Serialize, ToSchema)]
pub struct ResetSecret {
    pub user: Uuid,
    pub username: String,
    /// Give this to the user; it sets a new password once at `POST /v1/admin/password-reset`.
    pub reset_secret: String,
    pub expires_at: DateTime<Utc>,
}

fn reset_secret() -> Result<String, AdminError> {
    let mut raw = [0u8; 32];
    getrandom::fill(&mut raw).map_err(|e| AdminError::Random(e.to_string()))?;
    Ok(format!("cachet-reset-{}", hex::encode(raw)))
}

/// Issue a reset secret for user `id` (retiring its unused earlier ones).
pub async fn issue_reset(
    pool: &PgPool,
    actor: &Actor,
    id: Uuid,
) -> Result<ResetSecret, AdminError> {
    let user = get_user(pool, id).await?;
    if user.disabled_at.is_some() {
        return Err(AdminError::State(format!(
            "user {} is disabled: a reset cannot bring it back",
            user.username
        )));
    }
    let secret = reset_secret()?;
    let expires_at = Utc::now() + chrono::Duration::from_std(RESET_TTL).unwrap_or_default();
    let reset_id = Uuid::now_v7();
    let mut tx = pool.begin().await?;
    sqlx::query(
        "UPDATE admin_password_resets SET used_at = now() WHERE user_id = $1 AND used_at IS NULL",
    )
    .bind(id)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "INSERT INTO admin_password_resets (id, user_id, secret_sha256, created_by, expires_at) \
         VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(reset_id)
    .bind(id)
    .bind(sha256(&secret))
    .bind(&actor.name)
    .bind(expires_at)
    .execute(&mut *tx)
    .await?;
    Entry::new("user.password_reset_issued", user.tenant, id)
        .after(json!({"reset": reset_id, "expires_at": expires_at}))
        .commit(tx, actor)
        .await?;
    Ok(ResetSecret {
        user: id,
        username: user.username,
        reset_secret: secret,
        expires_at,
    })
}

/// Redeem a reset secret: the user's new password, every session ended, the lock cleared.
/// Returns the username.
pub async fn redeem_reset(
    pool: &PgPool,
    secret: &str,
    new_password: String,
) -> Result<String, AdminError> {
    let refused =
        || AdminError::Invalid("reset_secret: not valid (used, replaced or expired)".into());
    let mut tx = pool.begin().await?;
    let row = sqlx::query(
        "SELECT r.id, r.user_id, u.username, u.tenant_id FROM admin_password_resets r \
         JOIN admin_users u ON u.id = r.user_id \
         WHERE r.secret_sha256 = $1 AND r.used_at IS NULL AND r.expires_at > now() \
         AND u.disabled_at IS NULL FOR UPDATE OF r",
    )
    .bind(sha256(secret.trim()))
    .fetch_optional(&mut *tx)
    .await?
    .ok_or_else(refused)?;
    let (reset_id, id, username): (Uuid, Uuid, String) =
        (row.get("id"), row.get("user_id"), row.get("username"));
    check_password(&username, &new_password)?;
    sqlx::query("UPDATE admin_password_resets SET used_at = now() WHERE id = $1")
        .bind(reset_id)
        .execute(&mut *tx)
        .await?;
    store_password(&mut tx, id, new_password, None).await?;
    Entry::new("user.password_reset", row.get("tenant_id"), id)
        .after(json!({"reset": reset_id}))
        .commit(
            tx,
            &Actor {
                name: format!("user:{username}"),
                role: None,
                request_id: None,
            },
        )
        .await?;
    Ok(username)
}

/// A password change.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PasswordChange {
    pub current_password: String,
    pub new_password: String,
}

/// A reset secret's redemption.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PasswordReset {
    pub reset_secret: String,
    pub new_password: String,
}

/// Change the caller's own password. The caller's other sessions end.
#[utoipa::path(post, path = "/v1/admin/me/password", tag = "admin", request_body = PasswordChange,
    responses((status = 204, description = "Changed"), (status = 400, body = cachet_common::error::ErrorBody),
              (status = 401, body = cachet_common::error::ErrorBody), (status = 429, body = cachet_common::error::ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn change_own_password(
    State(state): State<AdminState>,
    admin: Admin,
    AdminJson(req): AdminJson<PasswordChange>,
) -> Result<Response, ApiError> {
    let Some(sid) = admin.claims.sid else {
        return Err(ApiError::invalid(
            "this token belongs to no console user (it was made by `cachet billing token`): log in to change a password",
        ));
    };
    let row = sqlx::query(
        "SELECT u.id, u.username, u.password_hash, u.tenant_id, u.failed_logins, \
         u.last_failed_at, u.locked_until FROM admin_sessions s \
         JOIN admin_users u ON u.id = s.user_id WHERE s.id = $1",
    )
    .bind(sid)
    .fetch_optional(&state.pool)
    .await
    .map_err(AdminError::from)?
    .ok_or_else(|| {
        ApiError::new(
            ErrorCode::Authentication,
            "this admin session has ended: log in again",
        )
    })?;
    let (id, username, tenant): (Uuid, String, Option<Uuid>) =
        (row.get("id"), row.get("username"), row.get("tenant_id"));
    let failures: i32 = row.get("failed_logins");
    check_throttle(
        failures,
        row.get("last_failed_at"),
        row.get("locked_until"),
        Utc::now(),
    )?;
    let phc: String = row.get("password_hash");
    let current = req.current_password;
    if !blocking(move || verify_password(&current, &phc)).await? {
        record_failure(&state.pool, &admin.actor, id, tenant, failures).await?;
        return Err(ApiError::invalid(
            "current_password: that is not your current password",
        ));
    }
    check_password(&username, &req.new_password)?;
    let mut tx = state.pool.begin().await.map_err(AdminError::from)?;
    store_password(&mut tx, id, req.new_password, Some(sid)).await?;
    Entry::new("user.password_change", tenant, id)
        .commit(tx, &admin.actor)
        .await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// Issue a one-time reset secret for a user (platform admins). Shown once.
#[utoipa::path(post, path = "/v1/admin/users/{id}/password-reset", tag = "admin",
    params(("id" = Uuid, Path, description = "User id")),
    responses((status = 201, body = ResetSecret), (status = 403, body = cachet_common::error::ErrorBody),
              (status = 404, body = cachet_common::error::ErrorBody), (status = 409, body = cachet_common::error::ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn reset_user_password(
    State(state): State<AdminState>,
    admin: Admin,
    AdminPath(id): AdminPath<Uuid>,
) -> Result<(StatusCode, axum::Json<ResetSecret>), ApiError> {
    admin.require(&[Role::PlatformAdmin])?;
    let secret = issue_reset(&state.pool, &admin.actor, id).await?;
    Ok((StatusCode::CREATED, axum::Json(secret)))
}

/// Set a new password with a reset secret (no login needed). Every session of the user ends.
#[utoipa::path(post, path = "/v1/admin/password-reset", tag = "admin", request_body = PasswordReset,
    responses((status = 204, description = "Password set"), (status = 400, body = cachet_common::error::ErrorBody)))]
pub async fn redeem_password_reset(
    State(state): State<AdminState>,
    AdminJson(req): AdminJson<PasswordReset>,
) -> Result<Response, ApiError> {
    if state.finance.auth.jwt.is_none() {
        return Err(ApiError::new(
            ErrorCode::Unavailable,
            "the admin API is off: set CACHET_ADMIN_JWT_SECRET",
        ));
    }
    redeem_reset(&state.pool, &req.reset_secret, req.new_password).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}
