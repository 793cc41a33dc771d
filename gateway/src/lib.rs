//! The Cachet gateway: the Anthropic-compatible HTTP API.
//!
//! What it exposes: [`serve`] (serve a router on a listener until a shutdown token fires,
//! under the timeouts and connection limits of [`server`]),
//! [`routing`] (the routing gateway of a cluster, `cachet router`, with the
//! [`routing::conductor`]'s choice of node),
//! [`router`], [`AppState`] (built from the fabric client, the engine pool, the meter handle,
//! Postgres and Redis), [`sync`] (the change feed that applies the control plane's changes
//! here), and the OpenAPI document ([`openapi::document`]). Tenants, keys, policy and the
//! admin API are the control plane's (`control`); the gateway serves its routes.
//!
//! The request path lives in [`api::handlers`] (HTTP) → [`wire::validate`] (Anthropic's rules
//! and texts) → [`render`] (tokens, breakpoints, block keys) → [`pipeline`] (fabric, admission,
//! engine, usage, meter).
//!
//! What it is not: it stores no KV (the fabric does) and writes no ledger rows itself (the
//! meter does).

pub mod admission;
pub mod api;
pub mod auth;
pub mod budget;
pub mod coalesce;
pub mod diagnostics;
pub mod engines;
pub mod error;
pub mod metrics;
pub mod not_held;
pub mod openapi;
pub mod pipeline;
pub mod render;
pub mod routing;
pub mod server;
pub mod state;
pub mod sync;
pub mod usage;
pub mod wire;

use std::time::{Duration, Instant};

use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use cachet_common::RequestId;
use serde_json::json;
use tokio_util::sync::CancellationToken;

pub use crate::state::{
    App, AppState, CLUSTER_TOKEN_HEADER, GatewayConfig, REQUEST_ID_HEADER, same_secret, state,
};

/// Every response gets a `request-id`; every request its span (`cachet_common::span`: the
/// request id now, the tenant once auth resolves it) and metrics. Behind a routing gateway,
/// a request without the cluster token is refused here.
async fn request_context(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let (mut rid, mut parent) = (None, None);
    if let Some(token) = &state.config.internal_token
        && req.uri().path() != "/healthz"
    {
        let presented = req
            .headers()
            .get(CLUSTER_TOKEN_HEADER)
            .map(|v| v.as_bytes())
            .unwrap_or_default();
        if !same_secret(presented, token.as_bytes()) {
            return error::ApiError::new(
                error::ErrorCode::Authentication,
                "this is an internal node port: requests must come through a gateway",
            )
            .into_response();
        }
        rid = req
            .headers()
            .get(REQUEST_ID_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<RequestId>().ok());
        // Only a gateway's trace context is joined, as only its request id is kept.
        parent = req
            .headers()
            .get(cachet_common::trace::TRACEPARENT)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
    }
    let rid = rid.unwrap_or_default();
    let route = route_of(&req);
    let started = Instant::now();
    let mut resp = in_request_span(rid, parent.as_deref(), &route, req, next).await;
    metrics::HTTP_SECONDS
        .with_label_values(&[&route])
        .observe(started.elapsed().as_secs_f64());
    metrics::HTTP_REQUESTS
        .with_label_values(&[&route, resp.status().as_str()])
        .inc();
    if resp
        .extensions_mut()
        .remove::<cachet_common::RequestIdPending>()
        .is_some()
    {
        resp = with_request_id(resp, rid).await;
    }
    if let Ok(v) = HeaderValue::from_str(&rid.to_string()) {
        resp.headers_mut().insert("request-id", v);
    }
    resp
}

/// A request's route as its router matched it (`unmatched`: a fallback answers it).
fn route_of(req: &Request) -> String {
    req.extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", |m| m.as_str())
        .to_string()
}

/// The rest of the stack, run in the request's span (`cachet_common::span`) with `rid` in the
/// request's extensions; what it answered is said in the span (debug). The edge of every
/// process that serves HTTP: `serve`, a node's API, the router. `parent`: the gateway's
/// trace context (`traceparent`) for a request it sent, which the span joins.
pub(crate) async fn in_request_span(
    rid: RequestId,
    parent: Option<&str>,
    route: &str,
    mut req: Request,
    next: Next,
) -> Response {
    req.extensions_mut().insert(rid);
    let span = cachet_common::span::request(rid, req.method().as_str(), route);
    if let Some(p) = parent {
        cachet_common::trace::adopt(&span, p);
    }
    let resp = tracing::Instrument::instrument(next.run(req), span.clone()).await;
    cachet_common::span::record_status(&span, resp.status().as_u16());
    span.in_scope(|| tracing::debug!(status = resp.status().as_u16(), "http request answered"));
    resp
}

/// An error response's JSON body with `request_id` set (any crate's error body: the gateway's,
/// the finance API's); a body that is not a JSON object passes unchanged.
async fn with_request_id(resp: Response, rid: RequestId) -> Response {
    let (mut parts, body) = resp.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, 1 << 20).await else {
        return Response::from_parts(parts, axum::body::Body::empty());
    };
    let body = match serde_json::from_slice::<serde_json::Value>(&bytes) {
        Ok(serde_json::Value::Object(mut o)) => {
            o.insert("request_id".into(), rid.to_string().into());
            parts.headers.remove(axum::http::header::CONTENT_LENGTH);
            serde_json::to_vec(&o).unwrap_or_default().into()
        }
        _ => bytes,
    };
    Response::from_parts(parts, axum::body::Body::from(body))
}

async fn healthz() -> Json<serde_json::Value> {
    Json(json!({"status": "ok"}))
}

/// Ready when the engines are loaded. Postgres and Redis are reported, not required: auth
/// falls back to cached keys, usage to the spool, admission to local limits.
async fn readyz(State(state): State<AppState>) -> Response {
    let pg = tokio::time::timeout(
        Duration::from_secs(1),
        sqlx::query("SELECT 1").execute(&state.pool),
    )
    .await;
    let pg = matches!(pg, Ok(Ok(_)));
    let body = json!({
        "status": "ready",
        "models": state.engines.all().iter().map(|e| e.info().id.clone()).collect::<Vec<_>>(),
        "postgres": if pg { "ok" } else { "unavailable" },
        "usage_spooled": state.meter.spooled(),
    });
    (StatusCode::OK, Json(body)).into_response()
}

/// Prometheus text, for operators only: its series name tenants. Behind [`server::serve`]
/// that means the metrics token or a loopback client.
pub(crate) async fn metrics_text(req: Request) -> Response {
    if let Some(c) = req.extensions().get::<server::Caller>()
        && !c.may_read_metrics(req.headers())
    {
        return error::ApiError::new(
            error::ErrorCode::Permission,
            "/metrics is for operators: send the metrics token (CACHET_METRICS_TOKEN) as a bearer token",
        )
        .into_response();
    }
    let families = prometheus::gather();
    match prometheus::TextEncoder::new().encode_to_string(&families) {
        Ok(s) => ([("content-type", "text/plain; version=0.0.4")], s).into_response(),
        Err(e) => error::ApiError::internal("metrics encoding failed", e).into_response(),
    }
}

pub(crate) async fn openapi_json() -> Response {
    ([("content-type", "application/json")], openapi::document()).into_response()
}

/// An error about the route itself, with the request's id (a fresh one where no middleware
/// gave it one).
fn route_error(req: &Request, kind: error::ErrorCode, message: String) -> Response {
    let rid = req
        .extensions()
        .get::<RequestId>()
        .copied()
        .unwrap_or_default();
    error::ApiError::new(kind, message)
        .with_request_id(rid)
        .into_response()
}

/// A known path asked with a method it does not take: 405 in the API's error shape.
pub(crate) async fn method_not_allowed(req: Request) -> Response {
    let msg = format!("{} is not allowed for {}", req.method(), req.uri().path());
    route_error(&req, error::ErrorCode::MethodNotAllowed, msg)
}

/// No such path: 404 in the API's error shape.
pub(crate) async fn not_found(req: Request) -> Response {
    let msg = format!("no route for {} {}", req.method(), req.uri().path());
    route_error(&req, error::ErrorCode::NotFound, msg)
}

pub fn router(state: AppState) -> Router {
    let limit = state.config.max_body_bytes;
    let mut app = Router::new()
        .route("/v1/messages", post(api::handlers::create_message))
        .route(
            "/v1/chat/completions",
            post(api::handlers::create_chat_completion),
        )
        .route(
            "/v1/messages/count_tokens",
            post(api::handlers::count_tokens),
        )
        .route("/v1/models", get(api::handlers::list_models))
        .route("/v1/models/{model_id}", get(api::handlers::get_model))
        .route(
            "/v1/caches",
            get(api::caches::list_caches).post(api::caches::create_cache),
        )
        .route(
            "/v1/caches/{cache_id}",
            get(api::caches::get_cache)
                .patch(api::caches::update_cache)
                .delete(api::caches::delete_cache),
        )
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .route("/openapi.json", get(openapi_json))
        .with_state(state.clone());
    if let Some(a) = &state.admin {
        app = app.merge(control::admin::routes(a.clone()));
    }
    app.method_not_allowed_fallback(method_not_allowed)
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(limit))
        .layer(middleware::from_fn(error::observed))
        .layer(middleware::from_fn_with_state(state, request_context))
}

/// Serve `app` (the gateway's router, possibly merged with others) under `limits` until
/// `shutdown`, then finish in-flight requests.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    shutdown: CancellationToken,
    limits: server::ServeLimits,
) -> std::io::Result<()> {
    server::serve(listener, app, shutdown, limits).await
}
