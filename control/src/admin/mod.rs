//! The admin API (`/v1/admin/…`) and the admin console's web UI (`/admin`).
//!
//! Who may do what (the roles of the finance API, carried by the same JWTs):
//!
//! | role | may |
//! |---|---|
//! | `platform_admin` | everything: tenants, users, every tenant's keys, policy, views, audit |
//! | `tenant_admin` | its own tenant: keys, the self-service part of its policy, usage, budget, cache, audit; another tenant answers 404 |
//! | `finance` | reads tenants, usage, budgets and cache of every tenant (and, in `/v1/billing`, invoices and exports); changes nothing but invoice state |
//!
//! - [`login`]: admin users (argon2id), login with backoff and lockout, short-lived access
//!   tokens with rotating refresh tokens, logout;
//! - [`passwords`]: changing one's own password, one-time reset secrets;
//! - [`handlers`]: tenants, keys, policy, audit log;
//! - [`workspaces`]: a tenant's workspaces (create, rename, limits, archive);
//! - [`webhooks`]: a tenant's alert endpoints and their delivery log;
//! - [`views`]: usage and savings over time, budget status, the cache view;
//! - [`overview`]: finance's month across tenants (JSON or CSV);
//! - [`ui`]: the built single-page app from `admin-ui/dist`.
//!
//! Errors are [`ApiError`]s: Anthropic's shape, one vocabulary ([`cachet_common::error`]).

pub mod caches;
pub mod handlers;
pub mod login;
pub mod overview;
pub mod passwords;
pub mod ui;
pub mod views;
pub mod webhooks;
pub mod workspaces;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::routing::{get, post};
use billing::api::FinanceState;
use cache_fabric::FabricClient;
use cache_fabric::transport::TcpTransport;
use cachet_common::{RequestId, TenantId};
use identity::{AdminAuth, Claims, Role};
use serde::de::DeserializeOwned;
use sqlx::PgPool;
use uuid::Uuid;

use crate::tenants::{Actor, AdminError};
use cachet_common::error::{ApiError, ErrorCode};

/// Where the cache view comes from.
pub enum CacheSource {
    /// This process's fabric node (`cachet serve`).
    Local(FabricClient),
    /// Every node of a cluster, asked over the fabric transport (`cachet router`).
    Cluster {
        transport: Arc<TcpTransport>,
        /// The nodes now: (id, fabric address).
        nodes: Arc<dyn Fn() -> Vec<(String, String)> + Send + Sync>,
    },
}

impl CacheSource {
    /// The fabric nodes' addresses.
    pub fn addrs(&self) -> Vec<String> {
        match self {
            CacheSource::Local(_) => Vec::new(),
            CacheSource::Cluster { nodes, .. } => nodes().into_iter().map(|(_, a)| a).collect(),
        }
    }

    /// The live fabric nodes' ids (what a deletion waits on).
    pub fn live_nodes(&self) -> Vec<String> {
        match self {
            CacheSource::Local(f) => f.live_nodes(),
            CacheSource::Cluster { nodes, .. } => nodes().into_iter().map(|(id, _)| id).collect(),
        }
    }
}

/// Admin console settings.
#[derive(Clone, Debug)]
pub struct AdminConfig {
    /// Where the built admin UI is (`admin-ui/dist`).
    pub ui_dir: std::path::PathBuf,
    /// Lifetime of an access token.
    pub access_ttl: Duration,
    /// Lifetime of a login (its refresh tokens).
    pub session_ttl: Duration,
    /// Whether webhook endpoints may be private or loopback addresses.
    pub webhook_allow_private: bool,
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self {
            ui_dir: "admin-ui/dist".into(),
            access_ttl: Duration::from_secs(15 * 60),
            session_ttl: Duration::from_secs(12 * 3600),
            webhook_allow_private: false,
        }
    }
}

pub struct AdminInner {
    pub pool: PgPool,
    /// The token secret and the pool, as the finance API uses them.
    pub finance: FinanceState,
    /// The server's admin secret (rotations derive secrets a retry can show again).
    pub server_key: Option<Arc<[u8]>>,
    pub cache: CacheSource,
    pub config: AdminConfig,
    pub throttle: login::Throttle,
}

/// Shared state of the admin API. Cheap to clone.
pub type AdminState = Arc<AdminInner>;

pub fn state(
    pool: PgPool,
    jwt: Option<Arc<identity::Jwt>>,
    server_key: Option<Arc<[u8]>>,
    cache: CacheSource,
    config: AdminConfig,
) -> AdminState {
    Arc::new(AdminInner {
        finance: FinanceState {
            pool: pool.clone(),
            auth: AdminAuth {
                sessions: Arc::new(login::SessionStore(pool.clone())),
                jwt,
            },
            directory: Arc::new(crate::tenants::directory::Directory(pool.clone())),
        },
        pool,
        server_key,
        cache,
        config,
        throttle: login::Throttle::default(),
    })
}

impl From<AdminError> for ApiError {
    fn from(e: AdminError) -> Self {
        ApiError::from_service("admin", &e)
    }
}

/// An authenticated admin request: its claims, and the actor its changes are recorded as.
pub struct Admin {
    pub claims: Claims,
    pub actor: Actor,
}

impl FromRequestParts<AdminState> for Admin {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AdminState,
    ) -> Result<Self, Self::Rejection> {
        let claims = state.finance.auth.authenticate(&parts.headers).await?;
        let actor = Actor {
            name: if claims.sid.is_some() {
                format!("user:{}", claims.sub)
            } else {
                format!("jwt:{}", claims.sub)
            },
            role: Some(claims.role.as_str().to_string()),
            request_id: parts.extensions.get::<RequestId>().map(|r| r.to_string()),
        };
        Ok(Admin { claims, actor })
    }
}

/// How a handler uses a tenant.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Read,
    /// A change a tenant admin may make to its own tenant.
    Write,
    /// A change only a platform admin may make.
    Platform,
}

impl Admin {
    pub fn role(&self) -> Role {
        self.claims.role
    }

    pub fn is_platform(&self) -> bool {
        self.claims.role == Role::PlatformAdmin
    }

    /// Refuse unless the caller's role is one of `roles`.
    pub fn require(&self, roles: &[Role]) -> Result<(), ApiError> {
        if roles.contains(&self.claims.role) {
            Ok(())
        } else {
            Err(ApiError::new(
                ErrorCode::Permission,
                format!("the {} role may not do this", self.claims.role.as_str()),
            ))
        }
    }

    /// Whether the caller may use `tenant` as `access` says (the request's span then names
    /// it). A tenant admin asking about another tenant is told it does not exist.
    pub fn tenant(&self, tenant: Uuid, access: Access) -> Result<(), ApiError> {
        let allowed = self.may_use(tenant, access);
        if allowed.is_ok() {
            cachet_common::span::record_tenant(TenantId(tenant), None);
        }
        allowed
    }

    fn may_use(&self, tenant: Uuid, access: Access) -> Result<(), ApiError> {
        match (self.claims.role, access) {
            (Role::PlatformAdmin, _) => Ok(()),
            (Role::TenantAdmin, Access::Read | Access::Write)
                if self.claims.tenant == Some(tenant) =>
            {
                Ok(())
            }
            (Role::TenantAdmin, _) if self.claims.tenant != Some(tenant) => Err(ApiError::new(
                ErrorCode::NotFound,
                format!("tenant {tenant} not found"),
            )),
            (Role::Finance, Access::Read) => Ok(()),
            _ => Err(ApiError::new(
                ErrorCode::Permission,
                format!("the {} role may not do this", self.claims.role.as_str()),
            )),
        }
    }
}

/// `Json<T>` whose rejections are API errors.
pub struct AdminJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for AdminJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        match axum::Json::<T>::from_request(req, state).await {
            Ok(axum::Json(v)) => Ok(AdminJson(v)),
            Err(r) => Err(json_rejection(r)),
        }
    }
}

fn json_rejection(r: JsonRejection) -> ApiError {
    match r {
        JsonRejection::MissingJsonContentType(_) => {
            ApiError::invalid("content-type: must be application/json")
        }
        other => ApiError::invalid(cachet_common::error::readable_rejection(&other.body_text())),
    }
}

/// `Query<T>` whose rejections are API errors.
pub struct AdminQuery<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for AdminQuery<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(v)) => Ok(AdminQuery(v)),
            Err(r) => Err(query_rejection(r)),
        }
    }
}

fn query_rejection(r: QueryRejection) -> ApiError {
    ApiError::invalid(cachet_common::error::readable_rejection(&r.body_text()))
}

/// `Path<T>` whose rejections are API errors.
pub struct AdminPath<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for AdminPath<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(v)) => Ok(AdminPath(v)),
            Err(r) => Err(ApiError::invalid(
                cachet_common::error::readable_path_rejection(&r.body_text()),
            )),
        }
    }
}

/// The admin API's routes, the finance API's, and the admin UI.
pub fn routes(state: AdminState) -> Router {
    use axum::routing::delete;
    let admin = Router::new()
        .route("/v1/admin/login", post(login::login))
        .route("/v1/admin/refresh", post(login::refresh))
        .route("/v1/admin/logout", post(login::logout))
        .route("/v1/admin/me", get(login::me))
        .route(
            "/v1/admin/me/password",
            post(passwords::change_own_password),
        )
        .route(
            "/v1/admin/password-reset",
            post(passwords::redeem_password_reset),
        )
        .route(
            "/v1/admin/users/{id}/password-reset",
            post(passwords::reset_user_password),
        )
        .route(
            "/v1/admin/users",
            get(login::list_users).post(login::create_user_handler),
        )
        .route("/v1/admin/users/{id}", delete(login::disable_user))
        .route("/v1/admin/users/{id}/unlock", post(login::unlock_user))
        .route(
            "/v1/admin/tenants",
            get(handlers::list_tenants).post(handlers::create_tenant),
        )
        .route(
            "/v1/admin/tenants/{id}",
            get(handlers::get_tenant).delete(handlers::delete_tenant),
        )
        .route("/v1/admin/tenants/{id}/suspend", post(handlers::suspend))
        .route("/v1/admin/tenants/{id}/resume", post(handlers::resume))
        .route(
            "/v1/admin/tenants/{id}/keys",
            get(handlers::list_keys).post(handlers::create_key),
        )
        .route(
            "/v1/admin/tenants/{id}/keys/{key}",
            axum::routing::patch(handlers::update_key),
        )
        .route(
            "/v1/admin/tenants/{id}/keys/{key}/revoke",
            post(handlers::revoke_key),
        )
        .route(
            "/v1/admin/tenants/{id}/keys/{key}/rotate",
            post(handlers::rotate_key),
        )
        .route(
            "/v1/admin/tenants/{id}/workspaces",
            get(workspaces::list_workspaces).post(workspaces::create_workspace),
        )
        .route(
            "/v1/admin/tenants/{id}/workspaces/{workspace}",
            get(workspaces::get_workspace).patch(workspaces::update_workspace),
        )
        .route(
            "/v1/admin/tenants/{id}/workspaces/{workspace}/archive",
            post(workspaces::archive_workspace),
        )
        .route(
            "/v1/admin/tenants/{id}/webhooks",
            get(webhooks::list_endpoints).post(webhooks::create_endpoint),
        )
        .route(
            "/v1/admin/tenants/{id}/webhooks/deliveries",
            get(webhooks::list_deliveries),
        )
        .route(
            "/v1/admin/tenants/{id}/webhooks/{endpoint}/disable",
            post(webhooks::disable_endpoint),
        )
        .route(
            "/v1/admin/tenants/{id}/policy",
            get(handlers::get_policy).patch(handlers::patch_policy),
        )
        .route("/v1/admin/tenants/{id}/usage", get(views::usage))
        .route("/v1/admin/tenants/{id}/budget", get(views::budget))
        .route("/v1/admin/tenants/{id}/cache", get(views::cache))
        .route(
            "/v1/admin/tenants/{id}/cache/objects",
            get(caches::list_objects),
        )
        .route(
            "/v1/admin/tenants/{id}/cache/objects/{object}",
            delete(caches::delete_object).patch(caches::extend_object),
        )
        .route("/v1/admin/tenants/{id}/cache/purge", post(caches::purge))
        .route("/v1/admin/overview", get(overview::overview))
        .route("/v1/admin/audit", get(handlers::list_audit))
        .route("/v1/admin/audit/export", get(handlers::export_audit))
        .with_state(state.clone());
    admin
        .merge(billing::api::router(state.finance.clone()))
        .merge(ui::routes(&state.config.ui_dir))
}
