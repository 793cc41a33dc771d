//! A tenant's workspaces over HTTP: list, create, rename or change limits, archive. The work
//! is in [`crate::tenants::workspaces`]; tenant admins manage their own tenant's, finance reads.

use axum::extract::State;
use axum::http::StatusCode;
use cachet_common::error::{ApiError, ErrorBody};
use cachet_common::{TenantId, WorkspaceId};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

use super::{Access, Admin, AdminJson, AdminPath, AdminQuery, AdminState};
use crate::tenants::limits::{Limits, NoOtherFields};
use crate::tenants::tags::Tags;
use crate::tenants::workspaces::{self, WorkspaceInfo, WorkspacePatch};

#[derive(Serialize, ToSchema)]
pub struct WorkspaceList {
    pub data: Vec<WorkspaceInfo>,
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct WorkspaceListQuery {
    /// Include archived workspaces.
    #[serde(default)]
    pub include_archived: bool,
}

/// A tenant's workspaces, the default first.
#[utoipa::path(get, path = "/v1/admin/tenants/{id}/workspaces", tag = "admin",
    params(("id" = Uuid, Path, description = "Tenant id"), WorkspaceListQuery),
    responses((status = 200, body = WorkspaceList), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn list_workspaces(
    State(state): State<AdminState>,
    admin: Admin,
    AdminPath(id): AdminPath<Uuid>,
    AdminQuery(q): AdminQuery<WorkspaceListQuery>,
) -> Result<axum::Json<WorkspaceList>, ApiError> {
    admin.tenant(id, Access::Read)?;
    crate::tenants::ensure_tenant(&state.pool, TenantId(id)).await?;
    Ok(axum::Json(WorkspaceList {
        data: workspaces::list_workspaces(&state.pool, TenantId(id), q.include_archived).await?,
    }))
}

#[derive(Deserialize, ToSchema)]
pub struct NewWorkspace {
    pub name: String,
    /// Its own limits (none by default: the tenant's alone).
    #[serde(flatten)]
    pub limits: Limits,
    /// Tags its keys' usage carries, for chargeback (none by default).
    #[serde(default)]
    pub tags: Tags,
    #[serde(flatten)]
    #[schema(ignore)]
    pub rest: NoOtherFields,
}

/// Create a workspace.
#[utoipa::path(post, path = "/v1/admin/tenants/{id}/workspaces", tag = "admin",
    params(("id" = Uuid, Path, description = "Tenant id")), request_body = NewWorkspace,
    responses((status = 201, body = WorkspaceInfo), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody),
              (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn create_workspace(
    State(state): State<AdminState>,
    admin: Admin,
    AdminPath(id): AdminPath<Uuid>,
    AdminJson(req): AdminJson<NewWorkspace>,
) -> Result<(StatusCode, axum::Json<WorkspaceInfo>), ApiError> {
    admin.tenant(id, Access::Write)?;
    let ws = workspaces::create_workspace(
        &state.pool,
        &admin.actor,
        TenantId(id),
        &req.name,
        req.limits,
        &req.tags,
    )
    .await?;
    Ok((StatusCode::CREATED, axum::Json(ws)))
}

/// One workspace.
#[utoipa::path(get, path = "/v1/admin/tenants/{id}/workspaces/{workspace}", tag = "admin",
    params(("id" = Uuid, Path, description = "Tenant id"), ("workspace" = Uuid, Path, description = "Workspace id")),
    responses((status = 200, body = WorkspaceInfo), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn get_workspace(
    State(state): State<AdminState>,
    admin: Admin,
    AdminPath((id, ws)): AdminPath<(Uuid, Uuid)>,
) -> Result<axum::Json<WorkspaceInfo>, ApiError> {
    admin.tenant(id, Access::Read)?;
    Ok(axum::Json(
        workspaces::get_workspace(&state.pool, TenantId(id), WorkspaceId(ws)).await?,
    ))
}

/// Rename a workspace or change its limits (a JSON merge patch: `null` clears a limit).
#[utoipa::path(patch, path = "/v1/admin/tenants/{id}/workspaces/{workspace}", tag = "admin",
    params(("id" = Uuid, Path, description = "Tenant id"), ("workspace" = Uuid, Path, description = "Workspace id")),
    request_body = WorkspacePatch,
    responses((status = 200, body = WorkspaceInfo), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody),
              (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn update_workspace(
    State(state): State<AdminState>,
    admin: Admin,
    AdminPath((id, ws)): AdminPath<(Uuid, Uuid)>,
    AdminJson(patch): AdminJson<WorkspacePatch>,
) -> Result<axum::Json<WorkspaceInfo>, ApiError> {
    admin.tenant(id, Access::Write)?;
    let w = workspaces::update_workspace(
        &state.pool,
        &admin.actor,
        TenantId(id),
        WorkspaceId(ws),
        &patch,
    )
    .await?;
    if patch.touches_budget() {
        crate::alerts::check_now(&state.pool, id).await;
    }
    Ok(axum::Json(w))
}

/// Archive a workspace: its keys are revoked, its usage stays. Final.
#[utoipa::path(post, path = "/v1/admin/tenants/{id}/workspaces/{workspace}/archive", tag = "admin",
    params(("id" = Uuid, Path, description = "Tenant id"), ("workspace" = Uuid, Path, description = "Workspace id")),
    responses((status = 200, body = WorkspaceInfo), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 409, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn archive_workspace(
    State(state): State<AdminState>,
    admin: Admin,
    AdminPath((id, ws)): AdminPath<(Uuid, Uuid)>,
) -> Result<axum::Json<WorkspaceInfo>, ApiError> {
    admin.tenant(id, Access::Write)?;
    Ok(axum::Json(
        workspaces::archive_workspace(&state.pool, &admin.actor, TenantId(id), WorkspaceId(ws))
            .await?,
    ))
}
