//! The gateway's shared state and settings: what every handler is given ([`AppState`]),
//! how it is built ([`state`]), and the headers a routing gateway and its nodes speak.

use std::sync::Arc;
use std::time::Duration;

use billing::MeterHandle;
use cache_fabric::FabricClient;
use sqlx::PgPool;

use crate::admission::Admission;
use crate::auth::Authenticator;
use crate::engines::EnginePool;
use crate::{budget, coalesce, diagnostics};

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
    /// Cache writes not held, until the change feed's loop records them.
    pub not_held: Arc<crate::not_held::NotHeld>,
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
        not_held: Arc::default(),
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
            not_held: Some(self.not_held.clone()),
        }
    }
}

/// Constant-time comparison (the token is a secret).
pub fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
