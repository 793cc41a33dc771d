//! A tenant's cache objects and a purge of its whole cache, over HTTP: tenant admins manage
//! their own tenant's, finance reads. The rows are [`crate::caches`]'; the blocks of a purged
//! cache are dropped by every process when the change feed brings the purge
//! (`gateway::sync`).

use axum::extract::State;
use cachet_common::error::{ApiError, ErrorBody};
use cachet_common::{TenantId, WorkspaceId};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

use super::{Access, Admin, AdminPath, AdminQuery, AdminState};
use crate::caches::{self, CacheObject, Owner, Page};

/// A cache object as a tenant admin sees it: with its workspace.
#[derive(Serialize, ToSchema)]
pub struct AdminCacheObject {
    pub id: String,
    pub model: String,
    pub display_name: Option<String>,
    pub input_tokens: i64,
    pub workspace_id: Uuid,
    pub workspace_name: String,
    pub created_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
}

impl From<CacheObject> for AdminCacheObject {
    fn from(o: CacheObject) -> Self {
        Self {
            id: o.id,
            model: o.model,
            display_name: o.display_name,
            input_tokens: o.input_tokens,
            workspace_id: o.workspace.as_uuid(),
            workspace_name: o.workspace_name,
            created_at: o.created_at,
            expires_at: o.expires_at,
        }
    }
}

#[derive(Serialize, ToSchema)]
pub struct AdminCacheObjectList {
    pub data: Vec<AdminCacheObject>,
    pub has_more: bool,
    pub last_id: Option<String>,
}

#[derive(Debug, Deserialize, IntoParams)]
pub struct ObjectListQuery {
    /// Only this workspace's objects.
    pub workspace: Option<Uuid>,
    /// Objects per page, 1 to 1000 (default 100).
    pub limit: Option<i64>,
    /// The page after (older than) this object.
    pub after_id: Option<String>,
}

/// A tenant's live cache objects, newest first.
#[utoipa::path(get, path = "/v1/admin/tenants/{id}/cache/objects", tag = "admin",
    params(("id" = Uuid, Path, description = "Tenant id"), ObjectListQuery),
    responses((status = 200, body = AdminCacheObjectList), (status = 400, body = ErrorBody),
              (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn list_objects(
    State(state): State<AdminState>,
    admin: Admin,
    AdminPath(id): AdminPath<Uuid>,
    AdminQuery(q): AdminQuery<ObjectListQuery>,
) -> Result<axum::Json<AdminCacheObjectList>, ApiError> {
    admin.tenant(id, Access::Read)?;
    crate::tenants::ensure_tenant(&state.pool, TenantId(id)).await?;
    let limit = q.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(ApiError::invalid("limit: must be from 1 to 1000"));
    }
    let page = Page {
        before_id: None,
        after_id: q.after_id,
        limit,
    };
    let owner = Owner::Tenant(TenantId(id), q.workspace.map(WorkspaceId));
    let listed = caches::list(&state.pool, owner, &page).await?;
    Ok(axum::Json(AdminCacheObjectList {
        last_id: listed.data.last().map(|o| o.id.clone()),
        has_more: listed.has_more,
        data: listed
            .data
            .into_iter()
            .map(AdminCacheObject::from)
            .collect(),
    }))
}

/// Delete one of a tenant's cache objects: requests naming it get 404 from then on.
#[utoipa::path(delete, path = "/v1/admin/tenants/{id}/cache/objects/{object}", tag = "admin",
    params(("id" = Uuid, Path, description = "Tenant id"), ("object" = String, Path, description = "Cache object id")),
    responses((status = 200, body = AdminCacheObject), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn delete_object(
    State(state): State<AdminState>,
    admin: Admin,
    AdminPath((id, object)): AdminPath<(Uuid, String)>,
) -> Result<axum::Json<AdminCacheObject>, ApiError> {
    admin.tenant(id, Access::Write)?;
    let o = caches::delete(
        &state.pool,
        &admin.actor,
        Owner::Tenant(TenantId(id), None),
        &object,
    )
    .await?;
    Ok(axum::Json(o.into()))
}

#[derive(Serialize, ToSchema)]
pub struct CachePurged {
    /// Always `cache_purged`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// Live cache objects the purge deleted.
    pub cache_objects_deleted: u64,
}

/// Purge a tenant's whole cache (objects and every cached prefix, on every node and tier)
/// without deleting the tenant. Every process drops the blocks within its change-feed poll.
#[utoipa::path(post, path = "/v1/admin/tenants/{id}/cache/purge", tag = "admin",
    params(("id" = Uuid, Path, description = "Tenant id")),
    responses((status = 200, body = CachePurged), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn purge(
    State(state): State<AdminState>,
    admin: Admin,
    AdminPath(id): AdminPath<Uuid>,
) -> Result<axum::Json<CachePurged>, ApiError> {
    admin.tenant(id, Access::Write)?;
    let n = caches::purge(&state.pool, &admin.actor, TenantId(id)).await?;
    Ok(axum::Json(CachePurged {
        kind: "cache_purged",
        cache_objects_deleted: n,
    }))
}
