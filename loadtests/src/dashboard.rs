//! The admin dashboard's usage API at scale: `rows` ledger rows over `days` days for
//! `tenants` tenants (skewed: the first tenants have most of the traffic), rolled up, then the
//! usage view the dashboard asks for, over HTTP, timed per query shape — beside the same
//! totals computed straight from the raw ledger (what a dashboard without rollups does).
//!
//! The rows are generated inside Postgres (`generate_series`), in batches, on a scratch
//! database dropped at the end.

use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::Utc;
use identity::{Jwt, Role};

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

fn summary(name: &str, mut ms: Vec<f64>) -> (f64, f64) {
    ms.sort_by(f64::total_cmp);
    let (p50, p90, p99, max) = (
        pct(&ms, 0.5),
        pct(&ms, 0.9),
        pct(&ms, 0.99),
        ms.last().copied().unwrap_or(0.0),
    );
    println!(
        "{name}\tn={}\tp50_ms={p50:.1}\tp90_ms={p90:.1}\tp99_ms={p99:.1}\tmax_ms={max:.1}",
        ms.len()
    );
    (p50, p99)
}

pub async fn dashboard(
    url: &str,
    rows: usize,
    tenants: usize,
    days: i64,
    requests: usize,
    concurrency: usize,
) -> anyhow::Result<()> {
    let (pool, name, url) = super::ledger::scratch(url).await?;
    let started = Instant::now();
    let keys = seed(&pool, tenants, days).await?;
    generate_ledger(&pool, &keys, rows, days, started).await?;
    let generate_secs = started.elapsed().as_secs_f64();
    // A bulk load leaves work for autovacuum that would otherwise run during the timing.
    billing::synthetic::analyze_ledger(&pool).await?;
    let now = Utc::now();
    let t0 = Instant::now();
    let r = roll_up(&pool, days, now).await?;
    let rollup_secs = t0.elapsed().as_secs_f64();
    println!(
        "ledger\trows={rows}\ttenants={tenants}\tdays={days}\tgenerate_s={generate_secs:.0}\trollup_s={rollup_secs:.1}\thourly_rows={}\tdaily_rows={}",
        r.hourly_rows, r.daily_rows
    );

    // The admin API in this process, over loopback HTTP.
    let (addr, token, stop, server) = serve_admin(&pool).await?;
    let http = reqwest::Client::new();

    // The busiest tenant and a middling one.
    let busiest = billing::synthetic::busiest_tenant(&pool)
        .await?
        .context("the generated ledger rolled up to no tenant")?;
    let fmt = |t: chrono::DateTime<Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let month = (fmt(now - chrono::Duration::days(days)), fmt(now));
    let day = (fmt(now - chrono::Duration::days(1)), fmt(now));
    let shapes = [
        ("30d_daily", &month, "day", "none"),
        ("30d_daily_by_model", &month, "day", "model"),
        ("30d_daily_by_key", &month, "day", "api_key"),
        ("24h_hourly", &day, "hour", "none"),
    ];
    // Correctness first: the API's totals are the ledger's for the same whole hours.
    let n = check_against_ledger(&pool, &http, addr, &token, busiest, &month, days, now).await?;
    println!("check\ttenant_requests={n}\tapi_totals=ledger_totals");

    let mut worst_p99: f64 = 0.0;
    for (shape, (from, to), gran, by) in shapes {
        let url = format!(
            "http://{addr}/v1/admin/tenants/{busiest}/usage?from={from}&to={to}&granularity={gran}&group_by={by}"
        );
        let all = time_gets(&http, &url, &token, requests, concurrency).await?;
        let (_, p99) = summary(&format!("api_{shape}\tconcurrency={concurrency}"), all);
        worst_p99 = worst_p99.max(p99);
    }

    // The baseline: the same 30-day daily totals straight from the ledger.
    let raw = raw_ledger(&pool, busiest, days, now).await?;
    let (raw_p50, _) = summary("raw_ledger_30d_daily_by_model\tconcurrency=1", raw);
    println!(
        "verdict\tapi_worst_p99_ms={worst_p99:.1}\ttarget_p99_ms=100\t{}\traw_ledger_p50_ms={raw_p50:.0}",
        if worst_p99 <= 100.0 { "met" } else { "missed" }
    );
    stop.cancel();
    let _ = server.await;
    super::ledger::drop_scratch(pool, &name, &url).await
}

/// Keys each generated tenant has.
const KEYS_PER_TENANT: i32 = 5;

/// `tenants` tenants with [`KEYS_PER_TENANT`] keys each (numbered for the generator), and list
/// prices for the models from before the ledger's first day.
async fn seed(
    pool: &sqlx::PgPool,
    tenants: usize,
    days: i64,
) -> anyhow::Result<Vec<billing::synthetic::SyntheticKey>> {
    let actor = control::tenants::Actor::cli("bench");
    let mut keys = Vec::with_capacity(tenants * KEYS_PER_TENANT as usize);
    for i in 0..tenants {
        let t = control::tenants::create_tenant(pool, &actor, &format!("bench-{i:05}")).await?;
        for k in 0..KEYS_PER_TENANT {
            let key =
                control::tenants::create_key(pool, &actor, &t, &format!("k{k}"), None).await?;
            keys.push(billing::synthetic::SyntheticKey {
                tenant_index: i as i32,
                key_index: k,
                tenant: t.id.as_uuid(),
                workspace: t.default_workspace.as_uuid(),
                key: key.id.as_uuid(),
            });
        }
    }
    for model in ["sim-llama-8b", "sim-llama-70b"] {
        billing::prices::set_price(
            pool,
            &billing::prices::PriceVersion {
                model: model.into(),
                effective_from: Utc::now() - chrono::Duration::days(days + 30),
                currency: "USD".into(),
                rates: billing::money::Rates::standard(
                    if model.ends_with("8b") { 300 } else { 3_000 },
                    if model.ends_with("8b") { 1_500 } else { 15_000 },
                ),
            },
            "bench",
            true,
            Utc::now(),
        )
        .await?;
    }
    Ok(keys)
}

/// `rows` ledger rows generated in Postgres in batches: tenant i gets a share ∝ (1 − x²)'
/// skew (the square of a uniform draw), keys and models uniformly.
async fn generate_ledger(
    pool: &sqlx::PgPool,
    keys: &[billing::synthetic::SyntheticKey],
    rows: usize,
    days: i64,
    started: Instant,
) -> anyhow::Result<()> {
    let batch = 1_000_000usize;
    let mut done = 0usize;
    while done < rows {
        let n = batch.min(rows - done);
        billing::synthetic::ledger(pool, keys, n as i64, days as i32)
            .await
            .context("generating ledger rows")?;
        done += n;
        eprintln!(
            "ledger rows: {done}/{rows} ({:.0} s)",
            started.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

/// The rollups over the generated ledger, analyzed after their bulk load.
async fn roll_up(
    pool: &sqlx::PgPool,
    days: i64,
    now: chrono::DateTime<Utc>,
) -> anyhow::Result<billing::rollup::RollupReport> {
    let r = billing::rollup::rollup(
        pool,
        now - chrono::Duration::days(days) - chrono::Duration::hours(1),
        now + chrono::Duration::hours(1),
    )
    .await?;
    billing::synthetic::analyze_rollups(pool).await?;
    Ok(r)
}

/// The admin API on a loopback port in this process, and a platform admin's token for it.
async fn serve_admin(
    pool: &sqlx::PgPool,
) -> anyhow::Result<(
    std::net::SocketAddr,
    String,
    tokio_util::sync::CancellationToken,
    tokio::task::JoinHandle<std::io::Result<()>>,
)> {
    let secret = "bench-admin-secret-of-at-least-32-bytes!";
    let jwt = std::sync::Arc::new(Jwt::new(secret.as_bytes())?);
    let token = jwt.issue(
        "bench",
        Role::PlatformAdmin,
        None,
        Duration::from_secs(3600),
    )?;
    let node = cache_fabric::FabricNode::new(cache_fabric::NodeConfig {
        dram_capacity_bytes: 1 << 20,
        eviction: cache_fabric::EvictionPolicy::DEFAULT,
    });
    let admin = control::admin::state(
        pool.clone(),
        Some(jwt),
        None,
        control::admin::CacheSource::Local(cache_fabric::FabricClient::local(node)),
        control::admin::AdminConfig::default(),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let stop = tokio_util::sync::CancellationToken::new();
    let server = tokio::spawn(gateway::serve(
        listener,
        control::admin::routes(admin),
        stop.clone(),
        gateway::server::ServeLimits::default(),
    ));
    Ok((addr, token, stop, server))
}

/// The usage API's 30-day totals for `tenant` against the same whole hours of the ledger;
/// the tenant's request count where they agree.
#[allow(clippy::too_many_arguments)]
async fn check_against_ledger(
    pool: &sqlx::PgPool,
    http: &reqwest::Client,
    addr: std::net::SocketAddr,
    token: &str,
    busiest: uuid::Uuid,
    month: &(String, String),
    days: i64,
    now: chrono::DateTime<Utc>,
) -> anyhow::Result<i64> {
    let check: serde_json::Value = http
        .get(format!(
            "http://{addr}/v1/admin/tenants/{busiest}/usage?from={}&to={}&granularity=day",
            month.0, month.1
        ))
        .bearer_auth(token)
        .send()
        .await?
        .json()
        .await?;
    let (n, i, rd) =
        billing::synthetic::ledger_totals(pool, busiest, now - chrono::Duration::days(days), now)
            .await?;
    let tot = &check["totals"];
    anyhow::ensure!(
        tot["requests"] == n && tot["input_tokens"] == i && tot["cache_read_tokens"] == rd,
        "the usage view differs from the ledger: {tot} vs requests {n}, input {i}, read {rd}"
    );
    Ok(n)
}

/// Warm-up, then `requests` timed GETs of `url` from `concurrency` clients: each one's
/// milliseconds.
async fn time_gets(
    http: &reqwest::Client,
    url: &str,
    token: &str,
    requests: usize,
    concurrency: usize,
) -> anyhow::Result<Vec<f64>> {
    // Warm-up, then `requests` timed calls from `concurrency` clients.
    for _ in 0..3 {
        http.get(url)
            .bearer_auth(token)
            .send()
            .await?
            .error_for_status()?;
    }
    let per = requests.div_ceil(concurrency.max(1));
    let mut tasks = Vec::new();
    for _ in 0..concurrency.max(1) {
        let (http, url, token) = (http.clone(), url.to_string(), token.to_string());
        tasks.push(tokio::spawn(async move {
            let mut ms = Vec::with_capacity(per);
            for _ in 0..per {
                let t = Instant::now();
                http.get(&url)
                    .bearer_auth(&token)
                    .send()
                    .await?
                    .error_for_status()?
                    .bytes()
                    .await?;
                ms.push(t.elapsed().as_secs_f64() * 1e3);
            }
            anyhow::Ok(ms)
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await??);
    }
    Ok(all)
}

/// The baseline: 30 days' daily totals by model straight from the ledger, ten times.
async fn raw_ledger(
    pool: &sqlx::PgPool,
    busiest: uuid::Uuid,
    days: i64,
    now: chrono::DateTime<Utc>,
) -> anyhow::Result<Vec<f64>> {
    let mut raw = Vec::new();
    for _ in 0..10 {
        let t = Instant::now();
        billing::synthetic::daily_by_model(pool, busiest, now - chrono::Duration::days(days), now)
            .await?;
        raw.push(t.elapsed().as_secs_f64() * 1e3);
    }
    Ok(raw)
}
