//! A tenant's webhook endpoints and their delivery log over HTTP. The work is in
//! [`crate::webhooks`]; tenant admins manage their own tenant's, finance reads.

use axum::extract::State;
use axum::http::StatusCode;
use cachet_common::TenantId;
use cachet_common::error::{ApiError, ErrorBody};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

use super::{Access, Admin, AdminJson, AdminPath, AdminQuery, AdminState};
use crate::webhooks::{self, DeliveryInfo, EndpointInfo};

#[derive(Serialize, ToSchema)]
pub struct EndpointList {
    pub data: Vec<EndpointInfo>,
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewEndpoint {
    /// Where events are POSTed: an absolute `http://` or `https://` URL.
    pub url: String,
}

/// An endpoint with its signing secret, shown this once.
#[derive(Serialize, ToSchema)]
pub struct CreatedEndpoint {
    #[serde(flatten)]
    pub endpoint: EndpointInfo,
    /// Verify `cachet-signature` with it: HMAC-SHA-256 of `"<t>.<body>"`.
    pub secret: String,
}

/// A tenant's webhook endpoints.
#[utoipa::path(get, path = "/v1/admin/tenants/{id}/webhooks", tag = "admin",
    params(("id" = Uuid, Path, description = "Tenant id")),
    responses((status = 200, body = EndpointList), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn list_endpoints(
    State(state): State<AdminState>,
    admin: Admin,
    AdminPath(id): AdminPath<Uuid>,
) -> Result<axum::Json<EndpointList>, ApiError> {
    admin.tenant(id, Access::Read)?;
    crate::tenants::ensure_tenant(&state.pool, TenantId(id)).await?;
    Ok(axum::Json(EndpointList {
        data: webhooks::list_endpoints(&state.pool, TenantId(id)).await?,
    }))
}

/// Register an endpoint for the tenant's alerts; its signing secret is in this answer only.
#[utoipa::path(post, path = "/v1/admin/tenants/{id}/webhooks", tag = "admin",
    params(("id" = Uuid, Path, description = "Tenant id")), request_body = NewEndpoint,
    responses((status = 201, body = CreatedEndpoint), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody),
              (status = 404, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn create_endpoint(
    State(state): State<AdminState>,
    admin: Admin,
    AdminPath(id): AdminPath<Uuid>,
    AdminJson(req): AdminJson<NewEndpoint>,
) -> Result<(StatusCode, axum::Json<CreatedEndpoint>), ApiError> {
    admin.tenant(id, Access::Write)?;
    let (endpoint, secret) = webhooks::create_endpoint(
        &state.pool,
        &admin.actor,
        TenantId(id),
        &req.url,
        state.config.webhook_allow_private,
    )
    .await?;
    Ok((
        StatusCode::CREATED,
        axum::Json(CreatedEndpoint { endpoint, secret }),
    ))
}

/// Disable an endpoint: nothing more is sent to it.
#[utoipa::path(post, path = "/v1/admin/tenants/{id}/webhooks/{endpoint}/disable", tag = "admin",
    params(("id" = Uuid, Path, description = "Tenant id"), ("endpoint" = Uuid, Path, description = "Endpoint id")),
    responses((status = 200, body = EndpointInfo), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn disable_endpoint(
    State(state): State<AdminState>,
    admin: Admin,
    AdminPath((id, endpoint)): AdminPath<(Uuid, Uuid)>,
) -> Result<axum::Json<EndpointInfo>, ApiError> {
    admin.tenant(id, Access::Write)?;
    Ok(axum::Json(
        webhooks::disable_endpoint(&state.pool, &admin.actor, TenantId(id), endpoint).await?,
    ))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct DeliveryQuery {
    /// At most this many, newest first (default 100, at most 1000).
    pub limit: Option<i64>,
}

#[derive(Serialize, ToSchema)]
pub struct DeliveryList {
    pub data: Vec<DeliveryInfo>,
}

/// The delivery log: each event sent to each endpoint, its attempts and outcome.
#[utoipa::path(get, path = "/v1/admin/tenants/{id}/webhooks/deliveries", tag = "admin",
    params(("id" = Uuid, Path, description = "Tenant id"), DeliveryQuery),
    responses((status = 200, body = DeliveryList), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn list_deliveries(
    State(state): State<AdminState>,
    admin: Admin,
    AdminPath(id): AdminPath<Uuid>,
    AdminQuery(q): AdminQuery<DeliveryQuery>,
) -> Result<axum::Json<DeliveryList>, ApiError> {
    admin.tenant(id, Access::Read)?;
    crate::tenants::ensure_tenant(&state.pool, TenantId(id)).await?;
    Ok(axum::Json(DeliveryList {
        data: webhooks::list_deliveries(&state.pool, TenantId(id), q.limit.unwrap_or(100)).await?,
    }))
}
