//! Wiring: the all-in-one `serve` role (gateway + one fabric node + engines + meter).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use billing::{Meter, MeterHandle};
use cache_fabric::{FabricClient, FabricNode};
use engine::Engine;
use engine::reference::ReferenceEngine;
use engine::sim::{SimEngine, SimProfile};
use gateway::engines::EnginePool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgPool};
use tokio_util::sync::CancellationToken;

use crate::config::Config;

/// Create the configured database if the server does not have it yet.
pub async fn ensure_database(url: &str) -> anyhow::Result<()> {
    let opts: PgConnectOptions = url.parse().context("parsing database_url")?;
    let Some(name) = opts.get_database().map(str::to_string) else {
        return Ok(());
    };
    let mut admin = opts
        .clone()
        .database("postgres")
        .connect()
        .await
        .with_context(|| {
            format!("connecting to postgres at {url} (is it running? `make run` starts one)")
        })?;
    let exists: Option<i32> = sqlx::query_scalar("SELECT 1 FROM pg_database WHERE datname = $1")
        .bind(&name)
        .fetch_optional(&mut admin)
        .await?;
    if exists.is_none() {
        let quoted = name.replace('"', "\"\"");
        if let Err(e) = sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{quoted}\"")))
            .execute(&mut admin)
            .await
        {
            // Another process may have created it meanwhile.
            if e.as_database_error()
                .is_none_or(|d| d.code().as_deref() != Some("42P04"))
            {
                return Err(e).context("creating the database");
            }
        }
        tracing::info!(database = %name, "created database");
    }
    Ok(())
}

/// The Redis connection of a cluster role (membership, heartbeats, block events). It
/// reconnects by itself, retrying every 0.1 to 0.5 s, so a node is back in the membership
/// within about a second of Redis returning: a plain connection stayed broken after a Redis
/// restart, and the node's record expired for good.
pub async fn cluster_redis(url: &str) -> anyhow::Result<redis::aio::ConnectionManager> {
    let client = redis::Client::open(url)?;
    let config = redis::aio::ConnectionManagerConfig::new()
        .set_min_delay(Duration::from_millis(100))
        .set_max_delay(Duration::from_millis(500))
        .set_connection_timeout(Some(Duration::from_secs(2)));
    redis::aio::ConnectionManager::new_with_config(client, config)
        .await
        .with_context(|| format!("connecting to Redis at {url}"))
}

/// Connect (creating the database if needed) and apply migrations.
pub async fn connect_and_migrate(url: &str, max_connections: u32) -> anyhow::Result<PgPool> {
    ensure_database(url).await?;
    let pool = PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(2))
        .connect(url)
        .await
        .with_context(|| format!("connecting to {url}"))?;
    billing::migrate(&pool)
        .await
        .context("applying migrations")?;
    Ok(pool)
}

/// The served models without any list price get the price Cachet ships for them, so a fresh
/// install rates its usage; a price an operator set is never replaced.
async fn seed_list_prices(
    pool: &PgPool,
    engines: &gateway::engines::EnginePool,
) -> anyhow::Result<()> {
    let models: Vec<String> = engines.all().iter().map(|e| e.info().id.clone()).collect();
    let ids: Vec<&str> = models.iter().map(String::as_str).collect();
    for m in billing::prices::ensure_list_defaults(pool, &ids).await? {
        tracing::info!(model = %m, "no list price: seeded the shipped default (edit it with `cachet billing price`)");
    }
    Ok(())
}

/// The public side's admin console (admin and finance APIs, admin UI) with its cache view
/// from `cache`, the rollups its views read kept current (the last two hours, every
/// `admin.rollup_interval_secs`, with cache objects' storage metered on the same tick) and
/// webhook deliveries sent, until `shutdown`.
fn admin_console(
    config: &Config,
    pool: &PgPool,
    shutdown: &CancellationToken,
    cache: control::admin::CacheSource,
) -> anyhow::Result<control::admin::AdminState> {
    let jwt = admin_jwt(config)?.map(Arc::new);
    let server_key: Option<Arc<[u8]>> = (!config.admin_jwt_secret.is_empty())
        .then(|| Arc::from(config.admin_jwt_secret.as_bytes()));
    crate::spawn_loop(
        "rollups",
        billing::rollup::keep_current(
            pool.clone(),
            Duration::from_secs(config.admin.rollup_interval_secs),
            chrono::TimeDelta::hours(2),
            shutdown.clone(),
        ),
    );
    // Cache objects' storage is metered on the same tick (every process of the public side
    // may run it: objects are claimed with SKIP LOCKED and an hour is written once).
    crate::spawn_loop(
        "cache storage meter",
        control::caches::meter::keep_metered(
            pool.clone(),
            Duration::from_secs(config.admin.rollup_interval_secs),
            shutdown.clone(),
        ),
    );
    crate::spawn_loop(
        "webhooks",
        control::webhooks::run(
            pool.clone(),
            control::webhooks::DeliveryConfig {
                retry_base: Duration::from_millis(config.admin.webhook_retry_base_ms),
                max_attempts: config.admin.webhook_max_attempts as i32,
                allow_private: config.admin.webhook_allow_private_addresses,
                ..Default::default()
            },
            shutdown.clone(),
        ),
    );
    Ok(control::admin::state(
        pool.clone(),
        jwt,
        server_key,
        cache,
        config.admin(),
    ))
}

/// Follow the administrative change feed for `targets` until `shutdown`. The feed's position
/// is fixed before this returns (and so before the process serves): a key cached before it
/// would miss a change committed in between until the key cache's TTL. With Postgres down
/// (5 s at most) the loop takes it from there.
pub async fn follow_changes(
    config: &Config,
    pool: PgPool,
    targets: gateway::sync::Targets,
    shutdown: &CancellationToken,
) {
    let mut follower = gateway::sync::Follower::default();
    match tokio::time::timeout(Duration::from_secs(5), follower.step(&pool, &targets)).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "the change feed's start failed; retrying in the background")
        }
        Err(_) => tracing::warn!("the change feed's start timed out; retrying in the background"),
    }
    crate::spawn_loop(
        "change_feed",
        gateway::sync::run(
            follower,
            pool,
            targets,
            gateway::sync::SyncConfig {
                poll: Duration::from_millis(config.admin.change_poll_ms),
                spend_every: Duration::from_secs(config.admin.spend_refresh_secs),
            },
            shutdown.clone(),
        ),
    );
}

/// The admin and finance APIs' token signer (none without a secret: they then answer 503
/// saying how to turn them on).
pub fn admin_jwt(config: &Config) -> anyhow::Result<Option<identity::Jwt>> {
    if config.admin_jwt_secret.is_empty() {
        return Ok(None);
    }
    Ok(Some(
        identity::Jwt::new(config.admin_jwt_secret.as_bytes())
            .context("CACHET_ADMIN_JWT_SECRET")?,
    ))
}

/// The engines a config serves: SmolLM2 first when the reference engine is on, then the sims.
pub async fn engines(config: &Config) -> anyhow::Result<EnginePool> {
    let mut list: Vec<Arc<dyn Engine>> = Vec::new();
    let kv_dtype = config.engine.kv_dtype()?;
    for v in &config.engine.vllm {
        let e = engine::vllm::VllmEngine::new(
            v.engine_config(&config.engine.model_path),
            tokio::runtime::Handle::current(),
        )
        .with_context(|| format!("engine.vllm model {}", v.model))?;
        tracing::info!(model = %v.model, url = %v.url, "vLLM upstream");
        list.push(Arc::new(e));
    }
    if config.engine.kind == "reference" {
        let path = config.engine.model_path.clone();
        let started = std::time::Instant::now();
        let e = tokio::task::spawn_blocking(move || ReferenceEngine::load(&path)).await??;
        let e = match kv_dtype {
            Some(d) => e.with_kv_dtype(d),
            None => e,
        };
        tracing::info!(model = %e.info().id, seconds = started.elapsed().as_secs_f32(), "reference engine loaded");
        list.push(Arc::new(e));
    }
    list.extend(
        SimProfile::all()
            .into_iter()
            .map(|p| SimProfile {
                answer_tokens: (config.engine.sim_answer_tokens > 0)
                    .then_some(config.engine.sim_answer_tokens),
                ..p
            })
            .map(|p| match kv_dtype {
                Some(d) => p.with_kv_dtype(d),
                None => p,
            })
            .map(|p| Arc::new(SimEngine::new(p, config.engine.sim_time_scale)) as Arc<dyn Engine>),
    );
    Ok(EnginePool::new(
        list,
        config.engine.workers,
        config.engine.queue,
    ))
}

/// A running all-in-one service.
pub struct Running {
    pub addr: SocketAddr,
    pub pool: PgPool,
    pub node: Arc<FabricNode>,
    pub meter: MeterHandle,
    /// Prefills in flight and the prefill rates measured here (a node announces them).
    pub inflight: gateway::coalesce::Inflight,
    /// Its engines (a node announces their stages' loads).
    pub engines: Vec<Arc<dyn engine::Engine>>,
    /// The node's Unix socket for an engine beside it, if open (removed when dropped).
    local: Option<cache_fabric::local::LocalServer>,
    /// The data directory and spool directory held (`crate::dirlock`) until the service ends.
    held: Vec<crate::dirlock::DirLock>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Running {
    /// Wait for the service to stop (after its shutdown token fires).
    pub async fn wait(self) -> anyhow::Result<()> {
        self.task.await.context("serve task panicked")?
    }
}

/// The TTFT target in `/metrics`, for the alert that compares the measured p99 with it.
fn publish_slo(config: &Config) {
    gateway::metrics::TTFT_SLO
        .with_label_values::<&str>(&[])
        .set(config.cluster.ttft_slo_ms as f64 / 1e3);
}

/// Start everything on `listener`; stops when `shutdown` fires, after in-flight requests
/// finish and the meter has committed or spooled every usage event.
pub async fn start(
    config: Config,
    listener: tokio::net::TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<Running> {
    publish_slo(&config);
    // One owner per directory: before anything in it is read or written.
    let held = crate::dirlock::hold_all(
        &crate::dirlock::meter_dirs(&config.data_dir, &config.spool_path()),
        "serve",
    )?;
    let node = config.fabric.node(&config.data_dir.join("fabric-disk"))?;
    crate::spawn_loop(
        "write_through",
        node.clone()
            .run_write_through(WRITE_THROUGH_EVERY, shutdown.clone()),
    );
    let mut local = None;
    if !config.fabric.listen.is_empty() {
        // For an engine's own KV connector beside this process (vLLM's).
        let token = crate::config::cluster_token()?;
        local = open_local(&config, &node, &token)?;
        let l = tokio::net::TcpListener::bind(&config.fabric.listen)
            .await
            .with_context(|| format!("binding fabric.listen {}", config.fabric.listen))?;
        tracing::info!(addr = %l.local_addr()?, "fabric node open to engine connectors");
        crate::spawn_loop(
            "fabric_serve",
            cache_fabric::transport::serve_tcp(l, node.clone(), token),
        );
    }
    let fabric = FabricClient::local(node.clone());
    let gateway_config = config.gateway();
    let mut running = start_api(config, gateway_config, listener, shutdown, node, fabric).await?;
    running.local = local;
    running.held = held;
    Ok(running)
}

/// The node's Unix socket and shared-memory arena for an engine on this host
/// (`fabric.local_socket`), unless turned off. Open it before the node stores anything.
pub fn open_local(
    config: &Config,
    node: &Arc<FabricNode>,
    token: &Arc<str>,
) -> anyhow::Result<Option<cache_fabric::local::LocalServer>> {
    let Some(path) = config.fabric.local_socket_path(&config.data_dir) else {
        tracing::info!("the same-host path is off (fabric.local_socket); engines use TCP");
        return Ok(None);
    };
    let server = cache_fabric::local::serve_local(&path, node.clone(), token.clone())
        .with_context(|| format!("opening fabric.local_socket {}", path.display()))?;
    Ok(Some(server))
}

/// How often a node copies the long holds written since to the tier below.
pub const WRITE_THROUGH_EVERY: Duration = Duration::from_millis(50);

/// Start the API (engines, meter, gateway) on `listener` over a given fabric node and
/// client: the all-in-one service's, or a cluster node's.
pub async fn start_api(
    config: Config,
    gateway_config: gateway::GatewayConfig,
    listener: tokio::net::TcpListener,
    shutdown: CancellationToken,
    node: Arc<FabricNode>,
    fabric: FabricClient,
) -> anyhow::Result<Running> {
    let addr = listener.local_addr()?;
    crate::memory::check(&config, true)?;
    let gateway_config_internal = gateway_config.internal_token.is_some();
    // Load the engines first: a missing model file is reported before anything starts.
    let engine_pool = engines(&config).await?;
    let pool = connect_and_migrate(&config.database_url, 16).await?;
    seed_list_prices(&pool, &engine_pool).await?;
    let meter_pool = PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy(&config.database_url)?;
    let meter_stop = CancellationToken::new();
    let (meter, meter_task) = Meter::start(meter_pool, config.meter(), meter_stop.clone()).await?;
    let redis = (!config.redis_url.is_empty()).then_some(config.redis_url.as_str());
    // A cluster node's API is internal (cluster token only): the admin console and the
    // rollups belong to the public side, `serve` or the cluster's gateway.
    let admin = if gateway_config_internal {
        None
    } else {
        Some(admin_console(
            &config,
            &pool,
            &shutdown,
            control::admin::CacheSource::Local(fabric.clone()),
        )?)
    };
    let state = gateway::state(
        gateway_config,
        pool.clone(),
        fabric,
        engine_pool,
        meter.clone(),
        redis,
        admin,
    )?;
    follow_changes(&config, pool.clone(), state.sync_targets(), &shutdown).await;
    let inflight = state.inflight.clone();
    let engines = state.engines.all().to_vec();
    let app = gateway::router(state);
    crate::spawn_loop(
        "return_idle_memory",
        crate::memory::return_idle_memory(shutdown.clone()),
    );
    let limits = config.serve_limits();
    let meter_handle = meter.clone();
    let task = tokio::spawn(async move {
        let served = gateway::serve(listener, app, shutdown, limits).await;
        // Requests still finishing in their own tasks get a moment to hand over usage.
        let _ = meter_handle.settled(Duration::from_secs(5)).await;
        meter_stop.cancel();
        meter_task.await.context("meter task panicked")?;
        served.context("http server failed")
    });
    tracing::info!(%addr, "cachet serving");
    Ok(Running {
        local: None,
        held: Vec::new(),
        addr,
        pool,
        node,
        meter,
        inflight,
        engines,
        task,
    })
}

/// Start the routing gateway of a cluster (`cachet router`) on `listener`: auth, validation
/// and routing here, requests served by the nodes announced under `redis_prefix`.
pub async fn start_router(
    config: Config,
    listener: tokio::net::TcpListener,
    shutdown: CancellationToken,
    redis_prefix: String,
) -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<anyhow::Result<()>>)> {
    let token = crate::config::cluster_token()?;
    if config.redis_url.is_empty() {
        anyhow::bail!("the routing gateway needs redis_url (it finds nodes and blocks there)");
    }
    publish_slo(&config);
    let addr = listener.local_addr()?;
    let engine_pool = engines(&config).await?;
    let pool = connect_and_migrate(&config.database_url, 8).await?;
    let conn = cluster_redis(&config.redis_url).await?;
    let c = &config.cluster;
    let routing = gateway::routing::RoutingConfig {
        max_body_bytes: config.gateway.max_body_bytes,
        auth_cache_ttl: Duration::from_secs(config.gateway.auth_cache_ttl_secs),
        cluster_token: token.clone(),
        cost: gateway::routing::conductor::CostModel {
            ttft_slo: Duration::from_millis(c.ttft_slo_ms),
            tbt_slo: Duration::from_millis(c.tbt_slo_ms),
        },
        transfer_bytes_per_sec: c.transfer_bytes_per_sec as f64,
        load_bytes_per_sec: c.load_bytes_per_sec as f64,
        node_timeout: Duration::from_secs(600),
    };
    let state = gateway::routing::state(routing, pool.clone(), engine_pool)?;
    // Its own connection: the KV event follower's reads block.
    let kv_conn = cluster_redis(&config.redis_url).await?;
    crate::spawn_loop(
        "follow_engine_caches",
        gateway::routing::follow_engine_caches(
            state.clone(),
            kv_conn,
            redis_prefix.clone(),
            shutdown.clone(),
        ),
    );
    crate::spawn_loop(
        "follow_cluster",
        gateway::routing::follow_cluster(
            state.clone(),
            conn,
            redis_prefix,
            Duration::from_millis(500),
            shutdown.clone(),
        ),
    );
    follow_changes(&config, pool.clone(), state.sync_targets(), &shutdown).await;
    let nodes = state.clone();
    let admin = admin_console(
        &config,
        &pool,
        &shutdown,
        control::admin::CacheSource::Cluster {
            transport: Arc::new(cache_fabric::transport::TcpTransport::new(token)),
            nodes: Arc::new(move || nodes.fabric_members()),
        },
    )?;
    let app = gateway::routing::router(state, Some(admin));
    let limits = config.serve_limits();
    let task = tokio::spawn(async move {
        gateway::serve(listener, app, shutdown, limits)
            .await
            .context("http server failed")
    });
    tracing::info!(%addr, "cachet router routing");
    Ok((addr, task))
}
