//! Tenants, keys, policy and the audit log over HTTP. The work is in [`crate::tenants`]; a
//! handler authorizes the caller for the tenant and maps the result.

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use cachet_common::ApiKeyId;
use cachet_common::TenantId;
use chrono::{DateTime, Utc};
use futures::StreamExt;
use identity::Role;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

use super::{Access, Admin, AdminJson, AdminPath, AdminQuery, AdminState};
use crate::tenants::audit::{self, AuditRow};
use crate::tenants::keys::{self, KeyInfo, RotateRequest};
use crate::tenants::limits::{LimitsPatch, NoOtherFields};
use crate::tenants::policy::{self, Policy, PolicyPatch};
use crate::tenants::tags::Tags;
use crate::tenants::{self, AdminError, TenantInfo};
use cachet_common::error::ErrorBody;
use cachet_common::error::{ApiError, ErrorCode};

#[derive(Serialize, ToSchema)]
pub struct TenantList {
    pub data: Vec<TenantInfo>,
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct TenantListQuery {
    /// Include deleted tenants.
    #[serde(default)]
    pub include_deleted: bool,
}

/// Tenants: every one for platform admins and finance, its own for a tenant admin.
#[utoipa::path(get, path = "/v1/admin/tenants", tag = "admin", params(TenantListQuery),
    responses((status = 200, body = TenantList), (status = 401, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn list_tenants(
    State(state): State<AdminState>,
    admin: Admin,
    AdminQuery(q): AdminQuery<TenantListQuery>,
) -> Result<axum::Json<TenantList>, ApiError> {
    let data = match (admin.role(), admin.claims.tenant) {
        (Role::TenantAdmin, Some(t)) => vec![tenants::get_tenant(&state.pool, TenantId(t)).await?],
        _ => tenants::list_tenants(&state.pool, q.include_deleted).await?,
    };
    Ok(axum::Json(TenantList { data }))
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewTenant {
    pub name: String,
}

/// Create a tenant (platform admins).
#[utoipa::path(post, path = "/v1/admin/tenants", tag = "admin", request_body = NewTenant,
    responses((status = 201, body = TenantInfo), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody),
              (status = 409, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn create_tenant(
    State(state): State<AdminState>,
    admin: Admin,
    AdminJson(t): AdminJson<NewTenant>,
) -> Result<(StatusCode, axum::Json<TenantInfo>), ApiError> {
    admin.require(&[Role::PlatformAdmin])?;
    let created = tenants::create_tenant(&state.pool, &admin.actor, &t.name).await?;
    Ok((
        StatusCode::CREATED,
        axum::Json(tenants::get_tenant(&state.pool, created.id).await?),
    ))
}

/// One tenant.
#[utoipa::path(get, path = "/v1/admin/tenants/{id}", tag = "admin",
    params(("id" = Uuid, Path, description = "Tenant id")),
    responses((status = 200, body = TenantInfo), (status = 404, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn get_tenant(
    State(state): State<AdminState>,
    admin: Admin,
    AdminPath(id): AdminPath<Uuid>,
) -> Result<axum::Json<TenantInfo>, ApiError> {
    admin.tenant(id, Access::Read)?;
    Ok(axum::Json(
        tenants::get_tenant(&state.pool, TenantId(id)).await?,
    ))
}

/// Suspend a tenant: its keys are refused with 403 within seconds (platform admins).
#[utoipa::path(post, path = "/v1/admin/tenants/{id}/suspend", tag = "admin",
    params(("id" = Uuid, Path, description = "Tenant id")),
    responses((status = 200, body = TenantInfo), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 409, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn suspend(
    state: State<AdminState>,
    admin: Admin,
    AdminPath(id): AdminPath<Uuid>,
) -> Result<axum::Json<TenantInfo>, ApiError> {
    set_suspended(state, admin, id, tenants::Suspension::Suspend).await
}

/// Resume a suspended tenant (platform admins).
#[utoipa::path(post, path = "/v1/admin/tenants/{id}/resume", tag = "admin",
    params(("id" = Uuid, Path, description = "Tenant id")),
    responses((status = 200, body = TenantInfo), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 409, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn resume(
    state: State<AdminState>,
    admin: Admin,
    AdminPath(id): AdminPath<Uuid>,
) -> Result<axum::Json<TenantInfo>, ApiError> {
    set_suspended(state, admin, id, tenants::Suspension::Resume).await
}

/// Suspend or resume: platform admins only, audited.
async fn set_suspended(
    State(state): State<AdminState>,
    admin: Admin,
    id: Uuid,
    to: tenants::Suspension,
) -> Result<axum::Json<TenantInfo>, ApiError> {
    admin.tenant(id, Access::Platform)?;
    let info = tenants::set_suspended(&state.pool, &admin.actor, TenantId(id), to).await?;
    Ok(axum::Json(info))
}

/// Delete a tenant: keys revoked, tenant admins disabled, its cache purged from every node;
/// its ledger, invoices and audit rows are kept (platform admins).
#[utoipa::path(delete, path = "/v1/admin/tenants/{id}", tag = "admin",
    params(("id" = Uuid, Path, description = "Tenant id")),
    responses((status = 200, body = TenantInfo), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn delete_tenant(
    State(state): State<AdminState>,
    admin: Admin,
    AdminPath(id): AdminPath<Uuid>,
) -> Result<axum::Json<TenantInfo>, ApiError> {
    admin.tenant(id, Access::Platform)?;
    Ok(axum::Json(
        tenants::delete_tenant(&state.pool, &admin.actor, TenantId(id)).await?,
    ))
}

#[derive(Serialize, ToSchema)]
pub struct KeyList {
    pub data: Vec<KeyInfo>,
}

/// A tenant's API keys (never their secrets). Finance reads them too, to filter exports and
/// reports by key.
#[utoipa::path(get, path = "/v1/admin/tenants/{id}/keys", tag = "admin",
    params(("id" = Uuid, Path, description = "Tenant id")),
    responses((status = 200, body = KeyList), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn list_keys(
    State(state): State<AdminState>,
    admin: Admin,
    AdminPath(id): AdminPath<Uuid>,
) -> Result<axum::Json<KeyList>, ApiError> {
    admin.require(&[Role::PlatformAdmin, Role::TenantAdmin, Role::Finance])?;
    admin.tenant(id, Access::Read)?;
    tenants::ensure_tenant(&state.pool, TenantId(id)).await?;
    Ok(axum::Json(KeyList {
        data: keys::list_keys(&state.pool, TenantId(id)).await?,
    }))
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewKeyRequest {
    #[serde(default = "default_key_name")]
    pub name: String,
    /// When the key stops working (RFC 3339); none by default.
    #[serde(default)]
    pub expires_at: Option<DateTime<Utc>>,
    /// The workspace the key belongs to (the tenant's default workspace if absent).
    #[serde(default)]
    pub workspace_id: Option<Uuid>,
    /// The key's own tags, on top of its workspace's (none by default).
    #[serde(default)]
    pub tags: Tags,
}

fn default_key_name() -> String {
    "default".into()
}

/// A key with its secret, shown this once.
#[derive(Serialize, ToSchema)]
pub struct CreatedKey {
    #[serde(flatten)]
    pub key: KeyInfo,
    /// The secret: shown only in this answer, never stored.
    pub secret: Option<String>,
}

/// Create an API key; its secret is in this answer only.
#[utoipa::path(post, path = "/v1/admin/tenants/{id}/keys", tag = "admin",
    params(("id" = Uuid, Path, description = "Tenant id")), request_body = NewKeyRequest,
    responses((status = 201, body = CreatedKey), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody),
              (status = 404, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn create_key(
    State(state): State<AdminState>,
    admin: Admin,
    AdminPath(id): AdminPath<Uuid>,
    AdminJson(req): AdminJson<NewKeyRequest>,
) -> Result<(StatusCode, axum::Json<CreatedKey>), ApiError> {
    admin.tenant(id, Access::Write)?;
    let tenant = tenants::find_tenant(&state.pool, &id.to_string())
        .await?
        .ok_or_else(|| AdminError::TenantNotFound(id.to_string()))?;
    let workspace = req
        .workspace_id
        .map_or(tenant.default_workspace, cachet_common::WorkspaceId);
    req.tags.validate()?;
    let k = keys::create_key_in(
        &state.pool,
        &admin.actor,
        &tenant,
        workspace,
        &req.name,
        req.expires_at,
    )
    .await?;
    if !req.tags.0.is_empty() {
        keys::set_key_tags(
            &state.pool,
            &admin.actor,
            TenantId(id),
            k.id.as_uuid(),
            &req.tags,
        )
        .await?;
    }
    Ok((
        StatusCode::CREATED,
        axum::Json(CreatedKey {
            key: keys::get_key(&state.pool, Some(id), k.id.as_uuid()).await?,
            secret: Some(k.secret),
        }),
    ))
}

/// A key change (JSON merge patch: absent = unchanged).
#[derive(Deserialize, ToSchema)]
pub struct KeyUpdate {
    /// The new expiry (RFC 3339), or `null` for none.
    #[serde(default, deserialize_with = "crate::tenants::limits::present")]
    #[schema(value_type = Option<DateTime<Utc>>)]
    pub expires_at: Option<Option<DateTime<Utc>>>,
    /// The key's own rate limits (`null`: the tenant's per-key default), each within its
    /// workspace's and the tenant's; `monthly_budget_minor` is refused (a key has no budget).
    #[serde(flatten)]
    pub limits: LimitsPatch,
    /// The key's own tags, all of them (`null` or `{}`: none).
    #[serde(default, deserialize_with = "crate::tenants::limits::present")]
    #[schema(value_type = Option<Tags>)]
    pub tags: Option<Option<Tags>>,
    #[serde(flatten)]
    #[schema(ignore)]
    pub rest: NoOtherFields,
}

/// Set or clear a key's expiry, change its own rate limits or its tags.
#[utoipa::path(patch, path = "/v1/admin/tenants/{id}/keys/{key}", tag = "admin",
    params(("id" = Uuid, Path, description = "Tenant id"), ("key" = Uuid, Path, description = "Key id")),
    request_body = KeyUpdate,
    responses((status = 200, body = KeyInfo), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 409, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn update_key(
    State(state): State<AdminState>,
    admin: Admin,
    AdminPath((id, key)): AdminPath<(Uuid, Uuid)>,
    AdminJson(req): AdminJson<KeyUpdate>,
) -> Result<axum::Json<KeyInfo>, ApiError> {
    admin.tenant(id, Access::Write)?;
    let mut info = keys::get_key(&state.pool, Some(id), key).await?;
    if let Some(expires_at) = req.expires_at {
        info = keys::set_key_expiry(&state.pool, &admin.actor, Some(id), key, expires_at).await?;
    }
    if !req.limits.is_empty() {
        info =
            keys::set_key_limits(&state.pool, &admin.actor, TenantId(id), key, &req.limits).await?;
    }
    if let Some(tags) = req.tags {
        let tags = tags.unwrap_or_default();
        info = keys::set_key_tags(&state.pool, &admin.actor, TenantId(id), key, &tags).await?;
    }
    Ok(axum::Json(info))
}

/// Revoke a key: running gateways refuse it within about a second.
#[utoipa::path(post, path = "/v1/admin/tenants/{id}/keys/{key}/revoke", tag = "admin",
    params(("id" = Uuid, Path, description = "Tenant id"), ("key" = Uuid, Path, description = "Key id")),
    responses((status = 200, body = KeyInfo), (status = 404, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn revoke_key(
    State(state): State<AdminState>,
    admin: Admin,
    AdminPath((id, key)): AdminPath<(Uuid, Uuid)>,
) -> Result<axum::Json<KeyInfo>, ApiError> {
    admin.tenant(id, Access::Write)?;
    Ok(axum::Json(
        keys::revoke_key(&state.pool, &admin.actor, Some(id), ApiKeyId(key)).await?,
    ))
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RotateBody {
    /// Seconds the old secret keeps working (0 to 2592000); one day by default.
    #[serde(default = "default_grace")]
    pub grace_seconds: i64,
    /// The new key's expiry, if any.
    #[serde(default)]
    pub expires_at: Option<DateTime<Utc>>,
}

fn default_grace() -> i64 {
    86_400
}

#[derive(Serialize, ToSchema)]
pub struct RotationResult {
    pub old_key: KeyInfo,
    pub new_key: KeyInfo,
    /// The new secret; `null` only for a retry made after the 24-hour replay window.
    pub secret: Option<String>,
    /// Until when the old secret works.
    pub grace_until: DateTime<Utc>,
    /// This answers a retry of an earlier rotation with the same idempotency key.
    pub replayed: bool,
}

/// Rotate a key: a new key (same name) now, the old one ending after a grace period. Send an
/// `Idempotency-Key` header: retrying with it returns the same new key and secret.
#[utoipa::path(post, path = "/v1/admin/tenants/{id}/keys/{key}/rotate", tag = "admin",
    params(("id" = Uuid, Path, description = "Tenant id"), ("key" = Uuid, Path, description = "Key id"),
           ("Idempotency-Key" = Option<String>, Header, description = "Makes retries return the first result")),
    request_body = RotateBody,
    responses((status = 200, body = RotationResult), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 409, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn rotate_key(
    State(state): State<AdminState>,
    admin: Admin,
    AdminPath((id, key)): AdminPath<(Uuid, Uuid)>,
    headers: HeaderMap,
    AdminJson(req): AdminJson<RotateBody>,
) -> Result<axum::Json<RotationResult>, ApiError> {
    admin.tenant(id, Access::Write)?;
    let idem = headers
        .get("idempotency-key")
        .map(|v| {
            v.to_str()
                .map_err(|_| ApiError::invalid("Idempotency-Key: must be visible ASCII"))
        })
        .transpose()?;
    // Out of chrono's range is out of ours too; the range itself is checked with the rest.
    let grace = chrono::Duration::try_seconds(req.grace_seconds)
        .ok_or_else(|| ApiError::invalid("grace_seconds: between 0 and 2592000 (30 days)"))?;
    let r = keys::rotate_key(
        &state.pool,
        &admin.actor,
        &RotateRequest {
            tenant: Some(id),
            key,
            grace,
            idempotency_key: idem,
            expires_at: req.expires_at,
        },
        state.server_key.as_deref(),
    )
    .await?;
    Ok(axum::Json(RotationResult {
        old_key: r.old,
        new_key: r.new,
        secret: r.secret,
        grace_until: r.grace_until,
        replayed: r.replayed,
    }))
}

/// A tenant's limits and cache policy.
#[utoipa::path(get, path = "/v1/admin/tenants/{id}/policy", tag = "admin",
    params(("id" = Uuid, Path, description = "Tenant id")),
    responses((status = 200, body = Policy), (status = 404, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn get_policy(
    State(state): State<AdminState>,
    admin: Admin,
    AdminPath(id): AdminPath<Uuid>,
) -> Result<axum::Json<Policy>, ApiError> {
    admin.tenant(id, Access::Read)?;
    Ok(axum::Json(
        policy::get_policy(&state.pool, TenantId(id)).await?,
    ))
}

/// Change a tenant's policy (JSON merge patch: absent fields unchanged, `null` = no limit).
/// A tenant admin may change rate limits, the budget and `allow_1h_ttl`; cache bytes,
/// reservation and replication are a platform admin's. Running gateways apply it within
/// about a second.
#[utoipa::path(patch, path = "/v1/admin/tenants/{id}/policy", tag = "admin",
    params(("id" = Uuid, Path, description = "Tenant id")), request_body = PolicyPatch,
    responses((status = 200, body = Policy), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody),
              (status = 404, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn patch_policy(
    State(state): State<AdminState>,
    admin: Admin,
    AdminPath(id): AdminPath<Uuid>,
    AdminJson(patch): AdminJson<PolicyPatch>,
) -> Result<axum::Json<Policy>, ApiError> {
    admin.tenant(id, Access::Write)?;
    if tenants::get_tenant(&state.pool, TenantId(id)).await?.state == tenants::TenantState::Deleted
    {
        return Err(AdminError::State("the tenant is deleted".into()).into());
    }
    Ok(axum::Json({
        let by = if admin.is_platform() {
            policy::PatchedBy::Platform
        } else {
            policy::PatchedBy::TenantAdmin
        };
        let p = policy::patch_policy(&state.pool, &admin.actor, TenantId(id), &patch, by).await?;
        if patch.touches_budget() {
            crate::alerts::check_now(&state.pool, id).await;
        }
        p
    }))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct AuditQuery {
    /// One tenant's entries (a tenant admin always sees only its own).
    pub tenant: Option<Uuid>,
    /// Entries whose action starts with this (`key.`, `policy.update`, …).
    pub action: Option<String>,
    /// From (inclusive), RFC 3339.
    pub from: Option<DateTime<Utc>>,
    /// To (exclusive), RFC 3339.
    pub to: Option<DateTime<Utc>>,
    /// Entries older than this id (the next page).
    pub before_id: Option<i64>,
    /// At most this many (1..1000, default 100).
    pub limit: Option<i64>,
}

#[derive(Serialize, ToSchema)]
pub struct AuditPage {
    pub data: Vec<AuditRow>,
    /// Pass as `before_id` for the next page; absent on the last.
    pub next_before_id: Option<i64>,
}

fn audit_filter(admin: &Admin, q: &AuditQuery) -> Result<audit::Filter, ApiError> {
    admin.require(&[Role::PlatformAdmin, Role::TenantAdmin])?;
    let tenant = match (admin.role(), q.tenant) {
        (Role::TenantAdmin, Some(t)) if Some(t) != admin.claims.tenant => {
            return Err(ApiError::new(
                ErrorCode::NotFound,
                format!("tenant {t} not found"),
            ));
        }
        (Role::TenantAdmin, _) => admin.claims.tenant,
        (_, t) => t,
    };
    Ok(audit::Filter {
        tenant,
        action: q.action.clone(),
        from: q.from,
        to: q.to,
        before_id: q.before_id,
    })
}

/// The audit log, newest first (platform admins; a tenant admin sees its own tenant's).
#[utoipa::path(get, path = "/v1/admin/audit", tag = "admin", params(AuditQuery),
    responses((status = 200, body = AuditPage), (status = 403, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn list_audit(
    State(state): State<AdminState>,
    admin: Admin,
    AdminQuery(q): AdminQuery<AuditQuery>,
) -> Result<axum::Json<AuditPage>, ApiError> {
    let f = audit_filter(&admin, &q)?;
    let limit = q.limit.unwrap_or(100).clamp(1, 1000);
    let data = audit::list(&state.pool, &f, limit).await?;
    let next_before_id = (data.len() as i64 == limit)
        .then(|| data.last().map(|r| r.id))
        .flatten();
    Ok(axum::Json(AuditPage {
        data,
        next_before_id,
    }))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct AuditExportQuery {
    pub tenant: Option<Uuid>,
    pub action: Option<String>,
    pub from: Option<DateTime<Utc>>,
    pub to: Option<DateTime<Utc>>,
    /// `csv` or `jsonl`.
    pub format: String,
}

/// The audit log, oldest first, streamed as CSV (RFC 4180) or JSON Lines.
#[utoipa::path(get, path = "/v1/admin/audit/export", tag = "admin", params(AuditExportQuery),
    responses((status = 200, description = "CSV or JSON Lines (`format`)", content((String = "text/csv"), (String = "application/jsonl"))),
              (status = 400, body = ErrorBody), (status = 403, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn export_audit(
    State(state): State<AdminState>,
    admin: Admin,
    AdminQuery(q): AdminQuery<AuditExportQuery>,
) -> Result<Response, ApiError> {
    let csv = match q.format.as_str() {
        "csv" => true,
        "jsonl" => false,
        other => {
            return Err(ApiError::invalid(format!(
                "format: {other:?} is not one of csv, jsonl"
            )));
        }
    };
    let f = audit_filter(
        &admin,
        &AuditQuery {
            tenant: q.tenant,
            action: q.action.clone(),
            from: q.from,
            to: q.to,
            before_id: None,
            limit: None,
        },
    )?;
    let head = csv.then(|| Ok::<_, std::io::Error>(bytes::Bytes::from_static(AUDIT_CSV_HEADER)));
    let rows = audit::stream(&state.pool, f).map(move |r| match r {
        Ok(r) => Ok(bytes::Bytes::from(if csv {
            audit_csv(&r)
        } else {
            let mut v = serde_json::to_vec(&r).unwrap_or_default();
            v.push(b'\n');
            v
        })),
        Err(e) => {
            tracing::error!(error = %e, "audit export failed mid-stream");
            Err(std::io::Error::other("export failed; retry"))
        }
    });
    let body = Body::from_stream(futures::stream::iter(head).chain(rows));
    let content_type = if csv {
        "text/csv; charset=utf-8; header=present"
    } else {
        "application/jsonl"
    };
    Ok(([(header::CONTENT_TYPE, content_type)], body).into_response())
}

/// The header line of an audit CSV export.
pub const AUDIT_CSV_HEADER: &[u8] =
    b"id,at,actor,actor_role,tenant_id,action,target,before,after,request_id\r\n";

/// One audit row as a CSV line (RFC 4180).
pub fn audit_csv(r: &AuditRow) -> Vec<u8> {
    let f = billing::csv::field;
    let json =
        |v: &Option<serde_json::Value>| v.as_ref().map(|v| v.to_string()).unwrap_or_default();
    format!(
        "{},{},{},{},{},{},{},{},{},{}\r\n",
        r.id,
        r.at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
        f(&r.actor),
        f(r.actor_role.as_deref().unwrap_or("")),
        r.tenant_id.map(|t| t.to_string()).unwrap_or_default(),
        f(&r.action),
        f(r.target.as_deref().unwrap_or("")),
        f(&json(&r.before)),
        f(&json(&r.after)),
        f(r.request_id.as_deref().unwrap_or("")),
    )
    .into_bytes()
}
