//! The Cachet gateway: the Anthropic-compatible HTTP API.
//!
//! What it exposes: [`serve`] (serve a router on a listener until a shutdown token fires,
//! under the timeouts and connection limits of [`server`]),
//! [`routing`] (the routing gateway of a cluster, `cachet router`, with the
//! [`conductor`]'s choice of node),
//! [`router`], [`AppState`] (built from the fabric client, the engine pool, the meter handle,
//! Postgres and Redis), [`sync`] (the change feed that applies the control plane's changes
//! here), and the OpenAPI document ([`openapi::document`]). Tenants, keys, policy and the
//! admin API are the control plane's (`control`); the gateway serves its routes.
//!
//! The request path lives in [`api::handlers`] (HTTP) → [`api::validate`] (Anthropic's rules
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
pub mod conductor;
pub mod diagnostics;
pub mod engines;
pub mod error;
pub mod metrics;
pub mod openapi;
pub mod pipeline;
pub mod render;
pub mod routing;
pub mod server;
pub mod sync;
pub mod usage;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use billing::MeterHandle;
use cache_fabric::FabricClient;
use cachet_common::RequestId;
use serde_json::json;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::admission::Admission;
use crate::auth::Authenticator;
use crate::engines::EnginePool;

/// Gateway settings.
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    pub max_body_bytes: usize,
    pub auth_cache_ttl: Duration,
    pub redis_timeout: Duration,
    /// Serving behind a routing gateway (`cachet node`): every request must carry this
    /// cluster token in [`CLUSTER_TOKEN_HEADER`], and may name its request id in
    /// [`REQUEST_ID_HEADER`] (a retry on another node keeps the id, so the ledger counts it
    /// once).
    pub internal_token: Option<Arc<str>>,
    /// Behind a gateway, how long a stream cut on the gateway's side waits before its row is
    /// recorded: the gateway may resume it on another node, whose complete row then wins
    /// (the ledger keeps a request's first row).
    pub resume_grace: Duration,
    /// In-flight coalescing on (`coalesce`).
    pub coalesce: bool,
    /// Bytes of KV requests may hold at once between engine and fabric ([`budget`]).
    pub kv_budget_bytes: u64,
    /// How long a request waits for its share of that budget before 529.
    pub kv_budget_wait: Duration,
}

/// Header carrying the cluster token on internal requests.
pub const CLUSTER_TOKEN_HEADER: &str = "x-cachet-cluster-token";
/// Header carrying the request id chosen by the routing gateway.
pub const REQUEST_ID_HEADER: &str = "x-cachet-request-id";

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            max_body_bytes: 32 * 1024 * 1024,
            auth_cache_ttl: Duration::from_secs(30),
            redis_timeout: Duration::from_millis(250),
            internal_token: None,
            resume_grace: Duration::from_secs(120),
            coalesce: true,
            kv_budget_bytes: 2 << 30,
            kv_budget_wait: Duration::from_secs(30),
        }
    }
}

/// The gateway's shared state: its config, fabric client, engines, meter, admission, caches.
pub struct App {
    pub config: GatewayConfig,
    pub pool: PgPool,
    pub fabric: FabricClient,
    pub engines: EnginePool,
    pub meter: MeterHandle,
    pub auth: Arc<Authenticator>,
    pub admission: Arc<Admission>,
    /// Prefills in progress, for in-flight coalescing.
    pub inflight: coalesce::Inflight,
    /// The KV memory budget of this process.
    pub kv_budget: budget::KvBudget,
    /// Prompts of requests that asked for cache diagnostics, for later comparison.
    pub fingerprints: diagnostics::Fingerprints,
    /// The admin and finance APIs and the admin UI (on the public side only).
    pub admin: Option<control::admin::AdminState>,
}

/// Shared state of every handler. Cheap to clone.
pub type AppState = Arc<App>;

/// Build the state. `redis_url` `None` keeps rate limits in process only.
pub fn state(
    config: GatewayConfig,
    pool: PgPool,
    fabric: FabricClient,
    engines: EnginePool,
    meter: MeterHandle,
    redis_url: Option<&str>,
    admin: Option<control::admin::AdminState>,
) -> anyhow::Result<AppState> {
    let auth = Arc::new(Authenticator::new(pool.clone(), config.auth_cache_ttl));
    let admission = Arc::new(Admission::new(redis_url, config.redis_timeout)?);
    let kv_budget = budget::KvBudget::new(config.kv_budget_bytes, config.kv_budget_wait);
    Ok(Arc::new(App {
        config,
        pool,
        fabric,
        engines,
        meter,
        auth,
        admission,
        inflight: coalesce::Inflight::default(),
        kv_budget,
        fingerprints: diagnostics::Fingerprints::default(),
        admin,
    }))
}

impl App {
    /// What the change feed ([`crate::sync`]) applies changes to in this process.
    pub fn sync_targets(&self) -> crate::sync::Targets {
        crate::sync::Targets {
            auth: Some(self.auth.clone()),
            admission: Some(self.admission.clone()),
            fabric: Some(self.fabric.clone()),
        }
    }
}

/// Constant-time comparison (the token is a secret).
pub fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Every response gets a `request-id`; every request a span and metrics. Behind a routing
/// gateway, a request without the cluster token is refused here.
async fn request_context(State(state): State<AppState>, mut req: Request, next: Next) -> Response {
    let mut rid = None;
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
    }
    let rid = rid.unwrap_or_default();
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|m| m.as_str().to_string())
        .unwrap_or_else(|| "unmatched".into());
    req.extensions_mut().insert(rid);
    let started = Instant::now();
    let mut resp = next.run(req).await;
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
