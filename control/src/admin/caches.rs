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

use std::time::Duration;

use cache_fabric::transport::{RemoteEntry, Transport};
use cache_fabric::{EntryKind, Holding};
use serde_json::{Map, Value};

use super::{Access, Admin, AdminJson, AdminPath, AdminQuery, AdminState, CacheSource};
use crate::caches::{self, CacheObject, Lifetime, Owner, Page};
use crate::release;
use crate::tenants::policy;

/// A new lifetime for an object: one of `ttl` (`"30m"`, `"24h"`, `"7d"`, or seconds) and
/// `expires_at` (RFC 3339), counted from now, between 5 minutes and the tenant's
/// `max_cache_ttl_secs`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExtendCacheObject {
    #[schema(value_type = Option<String>)]
    pub ttl: Option<Value>,
    pub expires_at: Option<String>,
}

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
#[into_params(parameter_in = Query)]
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
    responses((status = 200, body = AdminDeletedObject), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn delete_object(
    State(state): State<AdminState>,
    admin: Admin,
    AdminPath((id, object)): AdminPath<(Uuid, String)>,
) -> Result<axum::Json<AdminDeletedObject>, ApiError> {
    admin.tenant(id, Access::Write)?;
    let o = caches::delete(
        &state.pool,
        &admin.actor,
        Owner::Tenant(TenantId(id), None),
        &object,
    )
    .await?;
    let local = match &state.cache {
        CacheSource::Local(f) => Some(f),
        CacheSource::Cluster { .. } => None,
    };
    let outcome =
        release::released_everywhere(&state.pool, local, || state.cache.live_nodes(), &o.id).await;
    Ok(axum::Json(AdminDeletedObject {
        bytes_freed: outcome.released.bytes_freed,
        bytes_held: outcome.released.bytes_held,
        nodes_pending: outcome.pending,
        object: o.into(),
    }))
}

/// A deleted object, with what releasing its blocks did (as the API's deletion answers).
#[derive(Serialize, ToSchema)]
pub struct AdminDeletedObject {
    #[serde(flatten)]
    pub object: AdminCacheObject,
    /// Bytes of its blocks dropped from every tier of the nodes that have released it.
    pub bytes_freed: u64,
    /// Bytes of its blocks those nodes still hold for other entries of its workspace.
    pub bytes_held: u64,
    /// Live nodes that had not released it when this answer was sent (each does from its
    /// change feed, or at its next start).
    pub nodes_pending: Vec<String>,
}

/// Give one of a tenant's cache objects a new expiry (from now, within the tenant's
/// `max_cache_ttl_secs`); the fabric holds its blocks until then on every node that has
/// them.
#[utoipa::path(patch, path = "/v1/admin/tenants/{id}/cache/objects/{object}", tag = "admin",
    params(("id" = Uuid, Path, description = "Tenant id"), ("object" = String, Path, description = "Cache object id")),
    request_body = ExtendCacheObject,
    responses((status = 200, body = AdminCacheObject), (status = 400, body = ErrorBody),
        (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn extend_object(
    State(state): State<AdminState>,
    admin: Admin,
    AdminPath((id, object)): AdminPath<(Uuid, String)>,
    AdminJson(body): AdminJson<ExtendCacheObject>,
) -> Result<axum::Json<AdminCacheObject>, ApiError> {
    admin.tenant(id, Access::Write)?;
    let tenant = TenantId(id);
    let mut top = Map::new();
    if let Some(t) = body.ttl {
        top.insert("ttl".into(), t);
    }
    if let Some(e) = body.expires_at {
        top.insert("expires_at".into(), Value::String(e));
    }
    let max = policy::get_policy(&state.pool, tenant)
        .await?
        .max_cache_ttl_secs;
    let now = Utc::now();
    let expires_at = Lifetime::from_body(&top, None)?
        .expires_at(now, Duration::from_secs(max.max(300) as u64))?;
    let o = caches::set_expiry(
        &state.pool,
        Owner::Tenant(tenant, None),
        &object,
        expires_at,
    )
    .await?;
    let hold = (expires_at - now).to_std().unwrap_or(caches::MIN_TTL);
    hold_object(&state.cache, &o, hold).await;
    Ok(axum::Json(o.into()))
}

/// Hold an extended object's blocks on every node that has them (best effort: a block that
/// is gone is computed again by the next request naming the object).
async fn hold_object(source: &CacheSource, o: &CacheObject, hold: Duration) {
    if o.blocks.is_empty() {
        return;
    }
    let holding = Holding {
        ttl: hold,
        kind: EntryKind::Object,
    };
    match source {
        CacheSource::Local(f) => {
            if let Err(r) = f.hold_blocks(o.scope(), &o.blocks, holding).await {
                tracing::info!(cache_object = %o.id, reason = r.as_str(),
                    "an extended cache object's KV is not held; the next use recomputes it");
            }
        }
        CacheSource::Cluster { transport, .. } => {
            let entry = RemoteEntry {
                scope: o.scope(),
                existing: o.blocks.clone(),
                new: Vec::new(),
                ttl: hold,
                kind: EntryKind::Object,
                replica: true,
                handoff: false,
            };
            let asks = source.addrs().into_iter().map(|addr| {
                let (t, entry) = (transport.clone(), &entry);
                async move {
                    let r = tokio::time::timeout(Duration::from_secs(2), t.put_entry(&addr, entry)).await;
                    if !matches!(r, Ok(Ok(Ok(())))) {
                        tracing::warn!(node = %addr, cache_object = %o.id,
                            "extending a cache object's hold on a node failed; its next use there recomputes it");
                    }
                }
            });
            futures::future::join_all(asks).await;
        }
    }
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
