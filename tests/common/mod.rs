//! Test harness: the real service on port 0, a fresh Postgres database per test, the real
//! Redis, and a TCP proxy that can cut Postgres away mid-test.

#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use cachet::config::Config;
use cachet::server::{self, Running};
use serde_json::Value;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

pub const PG: &str = "postgres://postgres@127.0.0.1:5432";
pub const REDIS: &str = "redis://127.0.0.1:6379";
/// The finance API's token secret in tests.
pub const ADMIN_SECRET: &str = "a-test-secret-for-admin-tokens-of-32-bytes-or-more";

pub struct TestApp {
    pub url: String,
    pub db_name: String,
    pub db_url: String,
    pub key: String,
    pub running: Option<Running>,
    pub shutdown: CancellationToken,
    pub client: reqwest::Client,
    pub data_dir: tempdir::Dir,
}

pub mod procs;

pub mod tempdir {
    /// A directory removed on drop.
    pub struct Dir(pub std::path::PathBuf);
    impl Dir {
        pub fn new() -> Self {
            let p =
                std::env::temp_dir().join(format!("cachet-test-{}", uuid::Uuid::new_v4().simple()));
            std::fs::create_dir_all(&p).unwrap();
            Dir(p)
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

pub fn fresh_db_name() -> String {
    format!("cachet_test_{}", uuid::Uuid::new_v4().simple())
}

/// A new, migrated database for a test that runs the service as processes: (name, URL, pool).
/// Drop it with [`drop_db`].
pub async fn fresh_db() -> (String, String, sqlx::PgPool) {
    let db_name = fresh_db_name();
    let db_url = format!("{PG}/{db_name}");
    let pool = server::connect_and_migrate(&db_url, 2).await.unwrap();
    (db_name, db_url, pool)
}

pub struct Options {
    pub sim_time_scale: f64,
    pub redis_url: String,
    /// Database URL the service uses (e.g. through a proxy); defaults to the direct one.
    pub db_url_override: Option<String>,
    pub db_name: Option<String>,
    /// `sim` (fast, the default for these tests) or `reference` (the real model).
    pub engine: &'static str,
    /// Last changes to the config before the service starts.
    pub tweak: fn(&mut Config),
}

impl Default for Options {
    fn default() -> Self {
        Self {
            sim_time_scale: 0.0,
            redis_url: REDIS.into(),
            db_url_override: None,
            db_name: None,
            engine: "sim",
            tweak: |_| {},
        }
    }
}

impl TestApp {
    pub async fn start() -> Self {
        Self::start_with(Options::default()).await
    }

    pub async fn start_with(opts: Options) -> Self {
        let db_name = opts.db_name.clone().unwrap_or_else(fresh_db_name);
        let db_url = format!("{PG}/{db_name}");
        // Create and migrate through the direct URL; keys are made before any proxy matters.
        let pool = server::connect_and_migrate(&db_url, 2)
            .await
            .expect("postgres reachable for tests");
        let key = tenant_with_key(&pool, "test").await;
        pool.close().await;
        let data_dir = tempdir::Dir::new();
        let mut config = Config {
            database_url: opts
                .db_url_override
                .clone()
                .unwrap_or_else(|| db_url.clone()),
            redis_url: opts.redis_url.clone(),
            data_dir: data_dir.0.clone(),
            ..Default::default()
        };
        config.engine.sim_time_scale = opts.sim_time_scale;
        config.engine.kind = opts.engine.into();
        config.engine.model_path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(&config.engine.model_path);
        config.meter.retry_interval_ms = 200;
        config.admin_jwt_secret = ADMIN_SECRET.into();
        // Administrative changes, rollups and budgets are quick here, so tests need not wait.
        config.admin.change_poll_ms = 200;
        config.admin.rollup_interval_secs = 1;
        config.admin.spend_refresh_secs = 1;
        config.admin.webhook_retry_base_ms = 200;
        // The tests' webhook receivers listen on loopback.
        config.admin.webhook_allow_private_addresses = true;
        (opts.tweak)(&mut config);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let shutdown = CancellationToken::new();
        let running = server::start(config, listener, shutdown.clone())
            .await
            .unwrap();
        let url = format!("http://{}", running.addr);
        TestApp {
            url,
            db_name,
            db_url,
            key,
            running: Some(running),
            shutdown,
            client: reqwest::Client::new(),
            data_dir,
        }
    }

    /// The service's `/metrics` text (read from loopback, so no token is needed).
    pub async fn metrics(&self) -> String {
        get_text(&self.client, format!("{}/metrics", self.url)).await
    }

    /// The most time any of `tenant`'s cached prefixes has left here, in milliseconds.
    pub fn longest_ttl_left_ms(&self, tenant: uuid::Uuid) -> u64 {
        let stats = self
            .running()
            .node
            .tenant_stats(cachet_common::TenantId(tenant), 10);
        stats
            .top_prefixes
            .iter()
            .map(|p| p.ttl_left_ms)
            .max()
            .unwrap_or(0)
    }

    pub fn running(&self) -> &Running {
        self.running.as_ref().unwrap()
    }

    /// Another tenant with its own key, in the same database.
    pub async fn new_tenant_key(&self) -> String {
        let pool = sqlx::PgPool::connect(&self.db_url).await.unwrap();
        let k = tenant_with_key(&pool, "second").await;
        pool.close().await;
        k
    }

    pub async fn post_raw(
        &self,
        path: &str,
        key: &str,
        body: impl Into<reqwest::Body>,
    ) -> reqwest::Response {
        self.client
            .post(format!("{}{path}", self.url))
            .header("x-api-key", key)
            .header("anthropic-version", "2023-06-01")
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap()
    }

    /// POST JSON; returns (status, headers, body).
    pub async fn post(
        &self,
        path: &str,
        key: &str,
        body: &Value,
    ) -> (u16, reqwest::header::HeaderMap, Value) {
        let r = self.post_raw(path, key, body.to_string()).await;
        let status = r.status().as_u16();
        let headers = r.headers().clone();
        let text = r.text().await.unwrap();
        let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
        (status, headers, v)
    }

    pub async fn ledger_count(&self) -> i64 {
        let pool = sqlx::PgPool::connect(&self.db_url).await.unwrap();
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM usage_events")
            .fetch_one(&pool)
            .await
            .unwrap();
        pool.close().await;
        n
    }

    /// Wait until every usage event is in Postgres.
    pub async fn settle(&self) {
        assert!(
            self.running().meter.settled(Duration::from_secs(30)).await,
            "meter did not settle"
        );
    }

    pub async fn stop(mut self) {
        self.shutdown.cancel();
        if let Some(r) = self.running.take() {
            r.wait().await.unwrap();
        }
        drop_db(&self.db_name).await;
    }
}

/// A Messages request to the server at `url` with `key` and Anthropic's version header,
/// ready to send.
pub fn messages(
    http: &reqwest::Client,
    url: &str,
    key: &str,
    body: &Value,
) -> reqwest::RequestBuilder {
    http.post(format!("{url}/v1/messages"))
        .header("x-api-key", key)
        .header("anthropic-version", "2023-06-01")
        .json(body)
}

/// A new tenant with one key named `key_name`; the key's secret.
pub async fn tenant_with_key(pool: &sqlx::PgPool, key_name: &str) -> String {
    let actor = control::tenants::Actor::cli("test");
    let t = control::tenants::create_tenant(
        pool,
        &actor,
        &format!("t-{}", uuid::Uuid::new_v4().simple()),
    )
    .await
    .unwrap();
    control::tenants::create_key(pool, &actor, &t, key_name, None)
        .await
        .unwrap()
        .secret
}

pub async fn drop_db(name: &str) {
    if let Ok(pool) = sqlx::PgPool::connect(&format!("{PG}/postgres")).await {
        let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"
        )))
        .execute(&pool)
        .await;
        pool.close().await;
    }
}

/// A prompt body with a cached system block of about `words` tokens.
pub fn cached_body(system_words: usize, user: &str, max_tokens: u32) -> Value {
    let system: String = (0..system_words).map(|i| format!("w{i} ")).collect();
    serde_json::json!({
        "model": "sim-tiny",
        "max_tokens": max_tokens,
        "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": user}],
    })
}

/// A USD price for sim-tiny in force since `days_ago` days: `input` and `output` nano-units a
/// token, the standard multipliers for the cache classes.
pub async fn price_sim_tiny(pool: &sqlx::PgPool, days_ago: i64, (input, output): (i64, i64)) {
    let now = chrono::Utc::now();
    let price = billing::prices::PriceVersion {
        model: "sim-tiny".into(),
        effective_from: now - chrono::Duration::days(days_ago),
        currency: "USD".into(),
        rates: billing::money::Rates::standard(input, output),
    };
    billing::prices::set_price(pool, &price, "test", true, now)
        .await
        .unwrap();
}

/// `GET url`'s JSON body (the test fails if the request does).
pub async fn get_json(http: &reqwest::Client, url: String) -> Value {
    let r = http.get(url).send().await.unwrap();
    r.json().await.unwrap()
}

/// `GET url`'s text body (the test fails if the request does).
pub async fn get_text(http: &reqwest::Client, url: String) -> String {
    let r = http.get(url).send().await.unwrap();
    r.text().await.unwrap()
}

/// A finished command succeeded (else the test fails with its stderr).
pub fn succeeded(out: &std::process::Output) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}: {stderr}", out.status);
}

/// The prompt tokens an OpenAI-wire answer read from the cache.
pub fn cached_tokens(v: &Value) -> u64 {
    let details = &v["usage"]["prompt_tokens_details"];
    details["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached_tokens in {v}"))
}

/// How long until an object's `expires_at` (RFC 3339).
pub fn expires_in(v: &Value) -> chrono::TimeDelta {
    let at = v["expires_at"]
        .as_str()
        .unwrap_or_else(|| panic!("no expires_at in {v}"));
    at.parse::<chrono::DateTime<chrono::Utc>>().unwrap() - chrono::Utc::now()
}

/// The journals the meter kept aside under `data_dir` (never replayed into this database).
pub fn kept_aside(data_dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let dir = std::fs::read_dir(data_dir.join(billing::database::KEPT_ASIDE)).unwrap();
    dir.filter_map(Result::ok).map(|e| e.path()).collect()
}

/// The `message` of an error answer in either wire's shape (`{"error": {"message": …}}`).
pub fn error_message(v: &Value) -> &str {
    v["error"]["message"]
        .as_str()
        .unwrap_or_else(|| panic!("no error message in {v}"))
}

pub fn usage_total(u: &Value) -> u64 {
    u["input_tokens"].as_u64().unwrap()
        + u["cache_creation_input_tokens"].as_u64().unwrap()
        + u["cache_read_input_tokens"].as_u64().unwrap()
}

/// A TCP proxy to a target that can be cut (all connections closed, new ones refused).
pub struct CutProxy {
    pub addr: std::net::SocketAddr,
    cut: Arc<AtomicBool>,
    generation: Arc<tokio::sync::watch::Sender<u64>>,
    target: Arc<std::sync::Mutex<String>>,
}

impl CutProxy {
    pub async fn start(target: impl Into<String>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let cut = Arc::new(AtomicBool::new(false));
        let (gen_tx, _) = tokio::sync::watch::channel(0u64);
        let generation = Arc::new(gen_tx);
        let target = Arc::new(std::sync::Mutex::new(target.into()));
        let (c2, g2, t2) = (cut.clone(), generation.clone(), target.clone());
        tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    return;
                };
                if c2.load(Ordering::SeqCst) {
                    drop(inbound);
                    continue;
                }
                let mut rx = g2.subscribe();
                let target = t2.lock().unwrap().clone();
                tokio::spawn(async move {
                    let Ok(mut outbound) = TcpStream::connect(target).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = rx.changed() => {}
                    }
                });
            }
        });
        CutProxy {
            addr,
            cut,
            generation,
            target,
        }
    }

    /// Send new connections to `target` from now on.
    pub fn retarget(&self, target: impl Into<String>) {
        *self.target.lock().unwrap() = target.into();
    }

    /// Close every proxied connection and refuse new ones.
    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        self.generation.send_modify(|g| *g += 1);
    }

    pub fn restore(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }
}
