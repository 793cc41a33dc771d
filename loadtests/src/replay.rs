//! `cachet loadtest replay`: a trace (or a synthetic workload) against a running Cachet, open
//! loop, with live progress; per-request records, a summary and an HTML report in `--out`;
//! and, given a finance token, the client-seen usage reconciled with the ledger.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use serde_json::{Value, json};
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;

use crate::client::{Api, BodyOptions, Breakpoints, Outcome, send};
use crate::stats::{GapSummary, RequestRecord, Stats, latency, ratio};
use crate::trace::{self, MOONCAKE_BLOCK_TOKENS, Rng, Shape, TraceRecord};
use crate::workload::{self, Kind, WorkloadArgs};
use crate::{reconcile, report};

#[derive(Args, Clone, Debug)]
pub struct ReplayArgs {
    /// A Mooncake-format trace (JSON Lines: timestamp, input_length, output_length, hash_ids).
    #[arg(
        long,
        conflicts_with = "workload",
        required_unless_present = "workload"
    )]
    pub trace: Option<PathBuf>,
    /// Generate a synthetic workload instead (written to OUT/trace.jsonl, then replayed).
    #[arg(long, value_enum)]
    pub workload: Option<Kind>,
    #[command(flatten)]
    pub workload_args: WorkloadArgs,
    /// Base URL of `cachet serve` or a cluster's `cachet router` (this machine only).
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// API keys; repeat for several tenants (sessions are spread over them).
    #[arg(
        long = "api-key",
        env = "CACHET_API_KEY",
        required = true,
        value_delimiter = ','
    )]
    pub api_keys: Vec<String>,
    /// Directory for requests.jsonl, summary.json and report.html (created).
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long, default_value = "sim-llama-8b")]
    pub model: String,
    #[arg(long, value_enum, default_value = "anthropic")]
    pub api: Api,
    /// `auto` (top-level cache_control), `explicit` (end of the system prompt and of the
    /// last turn) or `none`.
    #[arg(long, value_enum, default_value = "auto")]
    pub breakpoints: Breakpoints,
    /// Send at the trace's timestamps divided by this (2 = twice as fast).
    #[arg(long, default_value_t = 1.0)]
    pub speed: f64,
    /// Ignore the timestamps: Poisson arrivals at this many requests per second.
    #[arg(long, conflicts_with = "concurrency")]
    pub rate: Option<f64>,
    /// Ignore the timestamps: keep this many requests in flight (closed loop).
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// Stop sending after this many requests.
    #[arg(long)]
    pub max_requests: Option<u64>,
    /// Stop sending after this many seconds.
    #[arg(long)]
    pub duration: Option<f64>,
    /// Skip this many records at the trace's start.
    #[arg(long, default_value_t = 0)]
    pub skip: u64,
    /// Tokens of text per hash id (the trace's own block size by default; smaller scales
    /// every prompt down by the same factor).
    #[arg(long, default_value_t = MOONCAKE_BLOCK_TOKENS)]
    pub block_tokens: u64,
    /// The trace's block size.
    #[arg(long, default_value_t = MOONCAKE_BLOCK_TOKENS)]
    pub trace_block_tokens: u64,
    /// Leading blocks of each prompt sent as the system prompt; the block after them names
    /// the session (default 1, or the workload's --prefix-blocks with --workload).
    #[arg(long)]
    pub system_blocks: Option<usize>,
    /// Cap on max_tokens (the trace's output_length otherwise).
    #[arg(long)]
    pub max_output_tokens: Option<u64>,
    /// Let the engine stop before max_tokens (by default every answer is asked to be exactly
    /// the trace's length: the `ignore_eos` request option).
    #[arg(long)]
    pub allow_early_stop: bool,
    /// Trace records whose token counts are checked with count_tokens before the run
    /// (0 skips the check, e.g. against a server without that endpoint).
    #[arg(long, default_value_t = 4)]
    pub check_tokens: usize,
    /// At most this many requests in flight; the sender waits beyond it (and says so).
    #[arg(long, default_value_t = 10_000)]
    pub max_in_flight: usize,
    /// Per-request timeout, seconds.
    #[arg(long, default_value_t = 600)]
    pub timeout_secs: u64,
    /// After the last send, wait this long for answers before cutting them off.
    #[arg(long, default_value_t = 120)]
    pub drain_secs: u64,
    /// A finance (or platform admin) token: reconcile with the ledger and price the run
    /// from the price book.
    #[arg(long, env = "CACHET_FINANCE_TOKEN")]
    pub finance_token: Option<String>,
    /// Where the finance API is (default: --url).
    #[arg(long)]
    pub finance_url: Option<String>,
    /// How long to wait for the ledger to hold every answered request.
    #[arg(long, default_value_t = 120)]
    pub reconcile_wait_secs: u64,
    /// Seed of the Poisson arrivals.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// No progress bar (a line every 10 s instead).
    #[arg(long)]
    pub quiet: bool,
    /// Mark a moment on every plot over time, `SECONDS=LABEL` from the run's start (a fault
    /// injected then, a change of configuration); repeat. SIGUSR1 to the replayer during
    /// the run marks the moment it arrives.
    #[arg(long = "mark", value_parser = parse_mark)]
    pub marks: Vec<Mark>,
    /// Replay the same records through the fabric's eviction code with this much cache
    /// (bytes of the model's KV in its default dtype; on a cluster, the nodes' total) and
    /// show the simulated hit ratio beside the measured one (`256M`, `4GiB`, …).
    #[arg(long, value_parser = crate::simulate::parse_bytes)]
    pub simulate_capacity_bytes: Option<u64>,
    /// Also run the same requests, at the same send times and answer lengths, through
    /// `simulate-fleet` with this engine profile (a built-in name or a JSON file) and show its
    /// TTFT, time between tokens and hit ratio beside the measured ones (not with
    /// --concurrency: a closed loop has no send times to give it).
    #[arg(long)]
    pub simulate_fleet: Option<String>,
    /// The simulated fleet's instances (with --simulate-fleet).
    #[arg(long, default_value_t = 1)]
    pub simulate_fleet_instances: usize,
    /// The simulated fleet's nodes (default: one an instance; 1 for instances beside one
    /// `cachet serve`).
    #[arg(long)]
    pub simulate_fleet_nodes: Option<usize>,
    /// How the simulated fleet routes: pool (a cluster's router) or least-loaded (the
    /// instances beside one node).
    #[arg(long, value_enum, default_value_t = crate::fleet::sim::Routing::LeastLoaded)]
    pub simulate_fleet_routing: crate::fleet::sim::Routing,
    /// The generations the gateway replayed against lets run at once on the model (its
    /// `engine.workers`; with --simulate-fleet): the rest wait there in the simulation as
    /// they do in the gateway. Default: no bound.
    #[arg(long)]
    pub simulate_fleet_gateway_slots: Option<usize>,
    /// Exit non-zero when more than this share of the answered requests failed (refusals
    /// such as 529 included) or when none was answered; 1 fails only a run with no answer.
    /// The report is written either way.
    #[arg(long, default_value_t = 0.05)]
    pub max_error_rate: f64,
}

/// A moment of the run to show on its plots.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Mark {
    /// Seconds from the run's start.
    pub at_secs: f64,
    pub label: String,
}

fn parse_mark(s: &str) -> Result<Mark, String> {
    let (at, label) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?}: SECONDS=LABEL, like 30=node-1 killed"))?;
    let at_secs: f64 = at
        .trim()
        .parse()
        .ok()
        .filter(|v: &f64| v.is_finite() && *v >= 0.0)
        .ok_or_else(|| format!("{at:?}: a number of seconds from the run's start"))?;
    let label = label.trim();
    if label.is_empty() {
        return Err("a mark needs a label".into());
    }
    Ok(Mark {
        at_secs,
        label: label.to_string(),
    })
}

impl ReplayArgs {
    fn shape(&self) -> Shape {
        Shape {
            block_tokens: self.block_tokens,
            trace_block_tokens: self.trace_block_tokens,
            system_blocks: self.system_blocks.unwrap_or_else(|| match self.workload {
                Some(kind) => workload::prefix_blocks(kind, &self.workload_args) as usize,
                None => 1,
            }),
            tenants: self.api_keys.len(),
        }
    }

    fn body_options(&self) -> BodyOptions {
        BodyOptions {
            model: self.model.clone(),
            api: self.api,
            breakpoints: self.breakpoints,
            max_output_tokens: self.max_output_tokens,
            ignore_eos: !self.allow_early_stop,
            shape: self.shape(),
        }
    }

    fn validate(&self) -> anyhow::Result<()> {
        crate::http::check_loopback(&self.url)?;
        if let Some(f) = &self.finance_url {
            crate::http::check_loopback(f)?;
        }
        if self.api_keys.iter().any(|k| k.trim().is_empty()) {
            bail!("--api-key must not be empty");
        }
        if !(self.speed.is_finite() && self.speed > 0.0) {
            bail!("--speed must be a positive number");
        }
        if self.rate.is_some_and(|r| !(r.is_finite() && r > 0.0)) {
            bail!("--rate must be a positive number");
        }
        if self.concurrency == Some(0) || self.max_in_flight == 0 {
            bail!("--concurrency and --max-in-flight must be positive");
        }
        if self.block_tokens == 0 || self.trace_block_tokens == 0 {
            bail!("--block-tokens and --trace-block-tokens must be positive");
        }
        if self.duration.is_some_and(|d| !(d.is_finite() && d > 0.0)) {
            bail!("--duration must be a positive number of seconds");
        }
        crate::check_rate_arg(self.max_error_rate)?;
        Ok(())
    }
}

/// What `run` found, for callers (the sweep) and the exit status.
pub struct RunResult {
    pub summary: Value,
    pub ok: bool,
}

/// The run's trace: the file given, or the workload generated into `out`.
fn trace_path(a: &ReplayArgs) -> anyhow::Result<PathBuf> {
    match (&a.trace, a.workload) {
        (Some(t), _) => Ok(t.clone()),
        (None, Some(kind)) => {
            let p = a.out.join("trace.jsonl");
            let f =
                std::fs::File::create(&p).with_context(|| format!("creating {}", p.display()))?;
            let mut w = std::io::BufWriter::new(f);
            workload::generate(kind, &a.workload_args, &mut w)?;
            w.flush()?;
            Ok(p)
        }
        (None, None) => bail!("give --trace FILE or --workload KIND"),
    }
}

pub async fn run(a: ReplayArgs) -> anyhow::Result<RunResult> {
    a.validate()?;
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let trace = trace_path(&a)?;
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(a.max_in_flight.min(1024))
        .tcp_nodelay(true)
        .timeout(Duration::from_secs(a.timeout_secs))
        .build()?;
    let opts = Arc::new(a.body_options());
    if a.check_tokens > 0 {
        check_token_counts(&client, &a, &opts, &trace).await?;
    }
    let prices = list_prices(&client, &a).await?;

    let started_wall = chrono::Utc::now();
    let start = Instant::now();
    let (tx, rx) = mpsc::channel::<(RequestRecord, Vec<f64>)>(4096);
    let (stop, cut) = (CancellationToken::new(), CancellationToken::new());
    // Ctrl-C: stop sending, wait for answers, write the report; a second Ctrl-C cuts them.
    let interrupts = tokio::spawn(on_interrupt(stop.clone(), cut.clone()));
    // SIGUSR1: mark this moment on the report's plots (a fault injected by hand).
    let marks = Arc::new(std::sync::Mutex::new(a.marks.clone()));
    let marker = tokio::spawn(mark_on_usr1(marks.clone(), start));
    let permits = Arc::new(Semaphore::new(a.max_in_flight.min(Semaphore::MAX_PERMITS)));
    let collector = tokio::spawn(collect(
        rx,
        a.out.join("requests.jsonl"),
        a.api_keys.len(),
        a.max_requests,
        a.quiet,
    ));
    let clock = Clock {
        start,
        stop: &stop,
        cut: &cut,
    };
    let sender = send_all(
        &a,
        &trace,
        &client,
        opts.clone(),
        tx,
        permits.clone(),
        clock,
    );
    let (sent, cap_waits) = sender.await?;
    // Drain: answers still coming get `drain_secs` (or until a second Ctrl-C), then are cut.
    let all = a.max_in_flight.min(Semaphore::MAX_PERMITS) as u32;
    tokio::select! {
        r = tokio::time::timeout(Duration::from_secs(a.drain_secs), permits.acquire_many(all)) => {
            if r.is_err() {
                cut.cancel();
            }
        }
        _ = cut.cancelled() => {}
    }
    interrupts.abort();
    marker.abort();
    let stats = collector.await.context("the collector stopped")??;
    let mut marks = marks.lock().unwrap_or_else(|p| p.into_inner()).clone();
    marks.sort_by(|x, y| x.at_secs.total_cmp(&y.at_secs));
    let simulated = simulate(&a, &trace, sent).await?;
    let fleet = simulate_fleet(&a, &trace, sent).await?;
    let elapsed = start.elapsed().as_secs_f64();
    let ended_wall = chrono::Utc::now();

    let reconciliation = reconcile_ledger(&client, &a, started_wall, ended_wall).await?;
    let ran = Ran {
        started: started_wall,
        elapsed,
        sent,
        cap_waits,
    };
    let mut summary = summarize(
        &a,
        &trace,
        &stats,
        &ran,
        prices.as_ref(),
        reconciliation.as_ref(),
    );
    summary["marks"] = json!(marks);
    summary["simulated"] = simulated.unwrap_or(Value::Null);
    summary["simulated_fleet"] = fleet.unwrap_or(Value::Null);
    std::fs::write(
        a.out.join("summary.json"),
        serde_json::to_vec_pretty(&summary)?,
    )?;
    std::fs::write(a.out.join("report.html"), report::replay_html(&summary))?;
    print_summary(&summary, &a.out);
    let ok = reconciliation.as_ref().is_none_or(|r| r.exact());
    if let Some(r) = &reconciliation {
        r.print();
    }
    Ok(RunResult { summary, ok })
}

/// The tenant's prices from the finance API, where the run has a finance token (list rates
/// where the price book has none for the model).
async fn list_prices(
    client: &reqwest::Client,
    a: &ReplayArgs,
) -> anyhow::Result<Option<reconcile::Prices>> {
    Ok(match &a.finance_token {
        Some(tok) => {
            let url = a.finance_url.as_deref().unwrap_or(&a.url);
            Some(
                reconcile::price_book(client, url, tok, &a.model)
                    .await?
                    .unwrap_or_else(|| reconcile::Prices {
                        source: format!(
                            "default list rates (the price book has no price for {})",
                            a.model
                        ),
                        ..reconcile::Prices::list_default(&a.model)
                    }),
            )
        }
        None => None,
    })
}

/// Ctrl-C: `stop` sending, wait for answers, write the report; a second Ctrl-C `cut`s them.
async fn on_interrupt(stop: CancellationToken, cut: CancellationToken) {
    if tokio::signal::ctrl_c().await.is_ok() {
        eprintln!("interrupted: sending stopped; waiting for answers (Ctrl-C again to cut them)");
        stop.cancel();
        if tokio::signal::ctrl_c().await.is_ok() {
            cut.cancel();
        }
    }
}

/// SIGUSR1: mark this moment on the report's plots (a fault injected by hand).
async fn mark_on_usr1(marks: Arc<std::sync::Mutex<Vec<Mark>>>, start: Instant) {
    let Ok(mut usr1) =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::user_defined1())
    else {
        return;
    };
    let mut n = 0;
    while usr1.recv().await.is_some() {
        n += 1;
        let at_secs = start.elapsed().as_secs_f64();
        eprintln!("marked {at_secs:.1}s (SIGUSR1 #{n})");
        marks.lock().unwrap_or_else(|p| p.into_inner()).push(Mark {
            at_secs,
            label: format!("SIGUSR1 #{n}"),
        });
    }
}

/// The hit ratio the simulator predicts for the requests sent at `--simulate-capacity-bytes`.
async fn simulate(a: &ReplayArgs, trace: &Path, sent: u64) -> anyhow::Result<Option<Value>> {
    Ok(match a.simulate_capacity_bytes {
        Some(bytes) => {
            let (trace, shape, model) = (trace.to_path_buf(), a.shape(), a.model.clone());
            let (skip, max) = (a.skip, Some(sent));
            let ratio = tokio::task::spawn_blocking(move || {
                crate::simulate::hit_ratio_at(&trace, &shape, skip, max, &model, bytes)
            })
            .await
            .context("the simulation stopped")??;
            Some(json!({
                "capacity_bytes": bytes,
                "policy": cache_fabric::EvictionPolicy::DEFAULT.to_string(),
                "token_hit_ratio": ratio,
            }))
        }
        None => None,
    })
}

/// The run's requests against the ledger, where it has a finance token.
async fn reconcile_ledger(
    client: &reqwest::Client,
    a: &ReplayArgs,
    started_wall: chrono::DateTime<chrono::Utc>,
    ended_wall: chrono::DateTime<chrono::Utc>,
) -> anyhow::Result<Option<reconcile::Reconciliation>> {
    Ok(match &a.finance_token {
        Some(tok) => {
            let url = a.finance_url.as_deref().unwrap_or(&a.url);
            Some(
                reconcile::reconcile(
                    client,
                    url,
                    tok,
                    &a.out.join("requests.jsonl"),
                    started_wall,
                    ended_wall,
                    Duration::from_secs(a.reconcile_wait_secs),
                )
                .await?,
            )
        }
        None => None,
    })
}

/// `simulate-fleet`'s prediction for the requests sent (`--simulate-fleet`): their send
/// times from the run's own schedule, their blocks and tenants as the replay shaped them,
/// their answers as long as they were asked to be.
async fn simulate_fleet(a: &ReplayArgs, trace: &Path, sent: u64) -> anyhow::Result<Option<Value>> {
    let Some(profile) = a.simulate_fleet.clone() else {
        return Ok(None);
    };
    if a.concurrency.is_some() && a.rate.is_none() {
        bail!("--simulate-fleet needs send times: not with --concurrency");
    }
    let profile = crate::fleet::profile::CostProfile::load(&profile)?;
    let (a, trace) = (a.clone(), trace.to_path_buf());
    tokio::task::spawn_blocking(move || {
        let shape = a.shape();
        let min_cacheable = engine::min_cacheable_tokens(&a.model).unwrap_or(0) as u64;
        let mut schedule = schedule_of(&a);
        let mut reqs = Vec::new();
        for rec in trace::open(&trace)?
            .skip(a.skip as usize)
            .take(sent as usize)
        {
            let rec = rec?;
            let out = a
                .max_output_tokens
                .map_or(rec.output_length, |m| rec.output_length.min(m));
            let arrival = schedule.at(&rec).unwrap_or(0.0);
            reqs.push(crate::fleet::request_of(
                rec,
                &shape,
                min_cacheable,
                arrival,
                out,
            ));
        }
        let instances = a.simulate_fleet_instances.max(1);
        let dram_tokens = a.simulate_capacity_bytes.map_or(2_000_000, |b| {
            b / profile.kv_bytes_per_token.max(1) / instances as u64
        });
        let cfg = crate::fleet::sim::FleetConfig {
            instances,
            nodes: a
                .simulate_fleet_nodes
                .unwrap_or(instances)
                .clamp(1, instances),
            replicas: 1,
            routing: a.simulate_fleet_routing,
            prefill_instances: 0,
            split_min_tokens: 1024,
            dram_tokens,
            policy: cache_fabric::EvictionPolicy::DEFAULT,
            ttft_slo: Duration::from_secs(86_400),
            tbt_slo: Duration::from_secs(86_400),
            early_rejection: false,
            balance: None,
            // The capacity is simulate-cache's (no room set aside for extra replicas).
            hot_reads: 0,
            hot_window: Duration::from_secs(60),
            gateway_slots: a.simulate_fleet_gateway_slots,
            warm_up: 0,
            seed: a.seed,
        };
        let r = crate::fleet::sim::run(&cfg, &profile, &reqs);
        let ms = |h: &hdrhistogram::Histogram<u64>, q: f64| {
            if h.is_empty() {
                0.0
            } else {
                h.value_at_quantile(q) as f64 / 1e3
            }
        };
        Ok::<_, anyhow::Error>(Some(json!({
            "profile": profile.name,
            "instances": cfg.instances,
            "nodes": cfg.nodes,
            "routing": format!("{:?}", cfg.routing).to_lowercase(),
            "requests": r.requests,
            "ttft_p50_ms": ms(&r.ttft, 0.5),
            "ttft_p90_ms": ms(&r.ttft, 0.9),
            "ttft_p99_ms": ms(&r.ttft, 0.99),
            "tbt_p50_ms": ms(&r.tbt, 0.5),
            "tbt_p90_ms": ms(&r.tbt, 0.9),
            "tbt_p99_ms": ms(&r.tbt, 0.99),
            "rejected": r.rejected,
            "token_hit_ratio": r.hit_ratio(),
        })))
    })
    .await
    .context("the fleet simulation stopped")?
}

/// A run's schedule from its arguments: Poisson at --rate, a closed loop at --concurrency,
/// else the trace's timestamps at --speed.
fn schedule_of(a: &ReplayArgs) -> Schedule {
    match (a.rate, a.concurrency) {
        (Some(rate), _) => Schedule::Poisson {
            rng: Rng::new(a.seed),
            mean_gap: 1.0 / rate,
            at: 0.0,
        },
        (None, Some(_)) => Schedule::Closed,
        (None, None) => Schedule::Trace {
            speed: a.speed,
            first: None,
        },
    }
}

/// The send times of a run: the trace's, scaled; Poisson; or none (closed loop).
enum Schedule {
    Trace { speed: f64, first: Option<f64> },
    Poisson { rng: Rng, mean_gap: f64, at: f64 },
    Closed,
}

impl Schedule {
    /// Seconds from the run's start at which `r` goes.
    fn at(&mut self, r: &TraceRecord) -> Option<f64> {
        match self {
            Schedule::Trace { speed, first } => {
                let t0 = *first.get_or_insert(r.timestamp);
                Some((r.timestamp - t0).max(0.0) / 1000.0 / *speed)
            }
            Schedule::Poisson { rng, mean_gap, at } => {
                let t = *at;
                *at += rng.exp(*mean_gap);
                Some(t)
            }
            Schedule::Closed => None,
        }
    }
}

/// When the run started, and the tokens that end it: `stop` ends sending, `cut` ends the
/// answers still coming.
struct Clock<'a> {
    start: Instant,
    stop: &'a CancellationToken,
    cut: &'a CancellationToken,
}

/// Send every request of the trace on schedule, each in its own task; returns how many were
/// sent and how often the in-flight cap held the sender back.
async fn send_all(
    a: &ReplayArgs,
    trace_path: &Path,
    client: &reqwest::Client,
    opts: Arc<BodyOptions>,
    tx: mpsc::Sender<(RequestRecord, Vec<f64>)>,
    permits: Arc<Semaphore>,
    clock: Clock<'_>,
) -> anyhow::Result<(u64, u64)> {
    let Clock { start, stop, cut } = clock;
    let mut schedule = schedule_of(a);
    let closed = a.concurrency.map(|n| Arc::new(Semaphore::new(n)));
    let shape = a.shape();
    let url: Arc<str> = a.url.trim_end_matches('/').into();
    let keys: Arc<Vec<String>> = Arc::new(a.api_keys.clone());
    let (mut sent, mut cap_waits) = (0u64, 0u64);
    let reader = trace::open(trace_path)?;
    for (index, rec) in reader.enumerate().skip(a.skip as usize) {
        let rec = rec.with_context(|| trace_path.display().to_string())?;
        if a.max_requests.is_some_and(|m| sent >= m) {
            break;
        }
        let scheduled = schedule.at(&rec);
        if let Some(at) = scheduled {
            if a.duration.is_some_and(|d| at >= d) {
                break;
            }
            let due = tokio::time::sleep_until((start + Duration::from_secs_f64(at)).into());
            tokio::select! {
                _ = due => {}
                _ = stop.cancelled() => break,
            }
        } else if a
            .duration
            .is_some_and(|d| start.elapsed().as_secs_f64() >= d)
        {
            break;
        }
        if stop.is_cancelled() {
            break;
        }
        let closed_permit = match &closed {
            Some(s) => tokio::select! {
                p = s.clone().acquire_owned() => Some(p?),
                _ = stop.cancelled() => break,
            },
            None => None,
        };
        let permit = match permits.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                cap_waits += 1;
                tokio::select! {
                    p = permits.clone().acquire_owned() => p?,
                    _ = stop.cancelled() => break,
                }
            }
        };
        let sent_ms = start.elapsed().as_secs_f64() * 1000.0;
        let scheduled_ms = scheduled.map_or(sent_ms, |s| s * 1000.0);
        let tenant = shape.tenant(&rec);
        let (client, opts, url, keys, tx, cut) = (
            client.clone(),
            opts.clone(),
            url.clone(),
            keys.clone(),
            tx.clone(),
            cut.clone(),
        );
        sent += 1;
        tokio::spawn(async move {
            let body = opts.body(&rec);
            let outcome = tokio::select! {
                o = send(&client, &url, &keys[tenant], &opts, body) => o,
                _ = cut.cancelled() => Outcome {
                    error: Some("cut: the run ended before the answer".into()),
                    e2e_ms: start.elapsed().as_secs_f64() * 1000.0 - sent_ms,
                    ..Default::default()
                },
            };
            let mut gaps = outcome.gaps_ms;
            let record = RequestRecord {
                index: index as u64,
                tenant,
                session: opts.shape.session(&rec),
                scheduled_ms,
                sent_ms,
                status: outcome.status,
                error: outcome.error,
                error_message: outcome.error_message,
                ttft_ms: outcome.ttft_ms,
                e2e_ms: outcome.e2e_ms,
                tbt: GapSummary::of(&mut gaps),
                node: outcome.node,
                resumed_from: outcome.resumed_from,
                route: outcome.route,
                request_id: outcome.request_id,
                stop_reason: outcome.stop_reason,
                trace_input_tokens: opts.shape.input_tokens(&rec),
                max_tokens: opts.max_tokens(&rec),
                usage: outcome.usage,
            };
            let _ = tx.send((record, gaps)).await;
            drop(permit);
            drop(closed_permit);
        });
    }
    Ok((sent, cap_waits))
}

/// Write each finished request to `path` and add it up; show progress as it goes.
async fn collect(
    mut rx: mpsc::Receiver<(RequestRecord, Vec<f64>)>,
    path: PathBuf,
    tenants: usize,
    expected: Option<u64>,
    quiet: bool,
) -> anyhow::Result<Stats> {
    use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
    let f = std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
    let mut stats = Stats::new(tenants);
    let bar = match expected {
        Some(n) => ProgressBar::new(n),
        None => ProgressBar::no_length(),
    };
    let live = !quiet && std::io::IsTerminal::is_terminal(&std::io::stderr());
    bar.set_draw_target(if live {
        ProgressDrawTarget::stderr_with_hz(4)
    } else {
        ProgressDrawTarget::hidden()
    });
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} done  {msg}")
            .expect("a valid template")
            .progress_chars("=> "),
    );
    let started = Instant::now();
    let mut last_msg = Instant::now();
    let mut last_line = Instant::now();
    while let Some((r, gaps)) = rx.recv().await {
        serde_json::to_writer(&mut w, &r)?;
        w.write_all(b"\n")?;
        stats.add(&r, &gaps);
        bar.inc(1);
        if last_msg.elapsed() >= Duration::from_millis(250) {
            last_msg = Instant::now();
            let line = progress_line(&stats);
            bar.set_message(line.clone());
            if !live && last_line.elapsed() >= Duration::from_secs(10) {
                last_line = Instant::now();
                eprintln!("[{:>6.1}s] {line}", started.elapsed().as_secs_f64());
            }
        }
    }
    bar.finish_and_clear();
    w.flush()?;
    Ok(stats)
}

fn progress_line(s: &Stats) -> String {
    let p50 = if s.ttft_us.is_empty() {
        0.0
    } else {
        s.ttft_us.value_at_quantile(0.5) as f64 / 1000.0
    };
    format!(
        "errors {}  hit {:.1}%  TTFT p50 {:.0} ms",
        s.error_count(),
        s.hit_ratio() * 100.0,
        p50
    )
}

/// Check that the text the replay makes has the token counts the trace says, on the
/// server's own tokenizer: the template's overhead is measured on two probes (and must not
/// depend on the text's length), then each of the first `check_tokens` records must count
/// exactly its trace tokens plus that overhead.
async fn check_token_counts(
    client: &reqwest::Client,
    a: &ReplayArgs,
    opts: &BodyOptions,
    trace_path: &Path,
) -> anyhow::Result<()> {
    let url = format!("{}/v1/messages/count_tokens", a.url.trim_end_matches('/'));
    let count = |body: Vec<u8>| {
        let url = url.clone();
        async move {
            let mut v: Value = serde_json::from_slice(&body)?;
            let o = v.as_object_mut().expect("a body is an object");
            for k in ["max_tokens", "stream", "ignore_eos", "cache_control"] {
                o.remove(k);
            }
            let req = client
                .post(&url)
                .header("x-api-key", &a.api_keys[0])
                .header("anthropic-version", "2023-06-01")
                .json(&v);
            let text =
                crate::client::text_of(req, "count_tokens (--check-tokens 0 skips the check)")
                    .await?;
            let v: Value = serde_json::from_str(&text)?;
            v["input_tokens"]
                .as_u64()
                .with_context(|| format!("count_tokens gave no input_tokens: {text}"))
        }
    };
    let mut anthropic = opts.clone();
    anthropic.api = Api::Anthropic;
    let probe = |blocks: u64, last: u64| TraceRecord {
        timestamp: 0.0,
        input_length: ((blocks - 1) * a.block_tokens + last) * a.trace_block_tokens
            / a.block_tokens,
        output_length: 1,
        hash_ids: (0..blocks).map(|i| u64::MAX - 7 - i).collect(),
    };
    let mut overhead = [0i64; 2];
    for (with_system, blocks) in [(false, 1u64), (true, 2)] {
        let mut seen = Vec::new();
        for last in [a.block_tokens.min(3), a.block_tokens] {
            let r = probe(blocks, last);
            let want = opts.shape.input_tokens(&r) as i64;
            let got = count(anthropic.body(&r)).await? as i64;
            seen.push((want, got));
        }
        let ((w0, g0), (w1, g1)) = (seen[0], seen[1]);
        if g1 - g0 != w1 - w0 {
            bail!(
                "the model {} does not tokenize the replay's text one token per word: a \
                 prompt {} words longer counted {} tokens more, so token counts would not \
                 match the trace's",
                a.model,
                w1 - w0,
                g1 - g0
            );
        }
        overhead[usize::from(with_system)] = g0 - w0;
    }
    for rec in trace::open(trace_path)?
        .skip(a.skip as usize)
        .take(a.check_tokens)
    {
        let rec = rec?;
        if rec.hash_ids.is_empty() {
            continue;
        }
        let sys = opts.shape.system_len(&rec) > 0;
        let want = opts.shape.input_tokens(&rec) as i64 + overhead[usize::from(sys)];
        let got = count(anthropic.body(&rec)).await? as i64;
        if got != want {
            bail!(
                "count_tokens says {got} tokens for a trace record of {} (+{} template): the \
                 replay's text does not tokenize as the trace says on {}",
                opts.shape.input_tokens(&rec),
                overhead[usize::from(sys)],
                a.model
            );
        }
    }
    Ok(())
}

/// How the run went, as the sender saw it.
struct Ran {
    started: chrono::DateTime<chrono::Utc>,
    elapsed: f64,
    sent: u64,
    /// How often the in-flight cap held the sender back.
    cap_waits: u64,
}

fn summarize(
    a: &ReplayArgs,
    trace: &Path,
    s: &Stats,
    ran: &Ran,
    prices: Option<&reconcile::Prices>,
    rec: Option<&reconcile::Reconciliation>,
) -> Value {
    let Ran {
        started,
        elapsed,
        sent,
        cap_waits,
    } = *ran;
    let rates = prices.map_or_else(|| reconcile::Prices::list_default(&a.model), Clone::clone);
    let (with, without) = crate::stats::cost(&s.totals, &rates.rates);
    let tenants: Vec<Value> = s
        .tenants
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let (w, wo) = crate::stats::cost(&t.usage, &rates.rates);
            json!({
                "tenant": i,
                "key": redact(&a.api_keys[i]),
                "requests": t.requests,
                "errors": t.errors,
                "hit_ratio": t.hit_ratio(),
                "usage": t.usage,
                "cost_nanos": w,
                "cost_without_cache_nanos": wo,
            })
        })
        .collect();
    let done_secs = elapsed.max(1e-9);
    let nodes: Vec<Value> = s
        .nodes
        .iter()
        .map(|(id, n)| {
            let ttft = latency(&n.ttft_us);
            json!({
                "node": id,
                "requests": n.requests,
                "errors": n.errors,
                "hit_ratio": ratio(n.usage.cache_read_tokens, n.usage.prompt()),
                "ttft_p50_ms": ttft["p50_ms"],
                "ttft_p99_ms": ttft["p99_ms"],
                "usage": n.usage,
            })
        })
        .collect();
    let per_second =
        |q: f64| -> Vec<Option<f64>> { s.buckets.iter().map(|b| b.ttft.quantile(q)).collect() };
    json!({
        "kind": "replay",
        "started_at": started.to_rfc3339(),
        "trace": trace.display().to_string(),
        "config": {
            "url": a.url,
            "model": a.model,
            "api": a.api,
            "breakpoints": a.breakpoints,
            "tenants": a.api_keys.len(),
            "arrivals": match (a.rate, a.concurrency) {
                (Some(r), _) => format!("poisson {r}/s"),
                (None, Some(c)) => format!("concurrency {c}"),
                (None, None) => format!("trace timestamps x{}", a.speed),
            },
            "block_tokens": a.block_tokens,
            "system_blocks": a.shape().system_blocks,
            "max_output_tokens": a.max_output_tokens,
            "ignore_eos": !a.allow_early_stop,
            "max_requests": a.max_requests,
            "duration_secs": a.duration,
        },
        "sent": sent,
        "done": s.done,
        "ok": s.ok,
        "errors": s.error_count(),
        "error_kinds": s.errors,
        "error_messages": s.error_messages,
        "nodes": nodes,
        "statuses": s.statuses,
        "elapsed_secs": elapsed,
        "throughput": {
            "requests_per_sec": s.ok as f64 / done_secs,
            "output_tokens_per_sec": s.totals.output_tokens as f64 / done_secs,
            "prompt_tokens_per_sec": s.totals.prompt() as f64 / done_secs,
        },
        "sender": {
            "max_lag_ms": s.max_lag_ms,
            "in_flight_cap": a.max_in_flight,
            "waits_at_cap": cap_waits,
        },
        "ttft": latency(&s.ttft_us),
        "tbt": latency(&s.tbt_us),
        "e2e": latency(&s.e2e_us),
        "hit_ratio": s.hit_ratio(),
        "tokens": s.totals,
        "tenants": tenants,
        "cost": {
            "currency": rates.currency,
            "source": rates.source,
            "with_cache_nanos": with,
            "without_cache_nanos": without,
            "saved_ratio": if without > 0 { 1.0 - with as f64 / without as f64 } else { 0.0 },
        },
        "series": {
            "seconds": (0..s.buckets.len()).collect::<Vec<_>>(),
            "sent": s.buckets.iter().map(|b| b.sent).collect::<Vec<_>>(),
            "done": s.buckets.iter().map(|b| b.done).collect::<Vec<_>>(),
            "errors": s.buckets.iter().map(|b| b.errors).collect::<Vec<_>>(),
            "output_tokens": s.buckets.iter().map(|b| b.output_tokens).collect::<Vec<_>>(),
            "hit_ratio": s.buckets.iter().map(|b| ratio(b.read_tokens, b.prompt_tokens)).collect::<Vec<_>>(),
            "ttft_p50_ms": per_second(0.5),
            "ttft_p99_ms": per_second(0.99),
            "errors_by_kind": s.error_series,
        },
        "reconciliation": rec.map(reconcile::Reconciliation::to_json),
    })
}

/// A key as the report shows it: its last four characters only.
fn redact(k: &str) -> String {
    let n = k.chars().count();
    let tail: String = k.chars().skip(n.saturating_sub(4)).collect();
    format!("…{tail}")
}

fn print_summary(s: &Value, out: &Path) {
    let f = |v: &Value| v.as_f64().unwrap_or(0.0);
    println!(
        "requests sent={} ok={} errors={}  elapsed {:.1}s  {:.1} req/s  {:.0} output tok/s",
        s["sent"],
        s["ok"],
        s["errors"],
        f(&s["elapsed_secs"]),
        f(&s["throughput"]["requests_per_sec"]),
        f(&s["throughput"]["output_tokens_per_sec"]),
    );
    println!(
        "TTFT ms p50={:.1} p90={:.1} p99={:.1}   TBT ms p50={:.2} p90={:.2} p99={:.2}",
        f(&s["ttft"]["p50_ms"]),
        f(&s["ttft"]["p90_ms"]),
        f(&s["ttft"]["p99_ms"]),
        f(&s["tbt"]["p50_ms"]),
        f(&s["tbt"]["p90_ms"]),
        f(&s["tbt"]["p99_ms"]),
    );
    if let Some(sim) = s["simulated_fleet"].as_object() {
        println!(
            "simulate-fleet ({}, {} instance(s), {}): TTFT p50 {:.1} ms vs {:.1} measured, TBT p50 {:.2} ms vs {:.2}, hit ratio {:.4} vs {:.4}",
            sim["profile"].as_str().unwrap_or(""),
            sim["instances"],
            sim["routing"].as_str().unwrap_or(""),
            sim["ttft_p50_ms"].as_f64().unwrap_or(0.0),
            f(&s["ttft"]["p50_ms"]),
            sim["tbt_p50_ms"].as_f64().unwrap_or(0.0),
            f(&s["tbt"]["p50_ms"]),
            sim["token_hit_ratio"].as_f64().unwrap_or(0.0),
            f(&s["hit_ratio"]),
        );
    }
    if let Some(sim) = s["simulated"].as_object() {
        println!(
            "hit ratio {:.4} measured vs {:.4} simulated ({} policy, {} bytes of cache)",
            f(&s["hit_ratio"]),
            sim["token_hit_ratio"].as_f64().unwrap_or(0.0),
            sim["policy"].as_str().unwrap_or(""),
            sim["capacity_bytes"],
        );
    }
    for n in s["nodes"].as_array().into_iter().flatten() {
        println!(
            "  node {}: {} requests, {} errors, hit ratio {:.4}, TTFT p50 {:.1} ms p99 {:.1} ms",
            n["node"].as_str().unwrap_or(""),
            n["requests"],
            n["errors"],
            f(&n["hit_ratio"]),
            f(&n["ttft_p50_ms"]),
            f(&n["ttft_p99_ms"]),
        );
    }
    println!(
        "hit ratio {:.4}  cost {} {:.6} with caching vs {:.6} without ({:.1}% saved; {})",
        f(&s["hit_ratio"]),
        s["cost"]["currency"].as_str().unwrap_or(""),
        f(&s["cost"]["with_cache_nanos"]) / 1e9,
        f(&s["cost"]["without_cache_nanos"]) / 1e9,
        f(&s["cost"]["saved_ratio"]) * 100.0,
        s["cost"]["source"].as_str().unwrap_or(""),
    );
    for t in s["tenants"].as_array().into_iter().flatten() {
        println!(
            "  tenant {} ({}): {} requests, {} errors, hit ratio {:.4}",
            t["tenant"],
            t["key"].as_str().unwrap_or(""),
            t["requests"],
            t["errors"],
            f(&t["hit_ratio"])
        );
    }
    if let Some(kinds) = s["error_kinds"].as_object() {
        for (k, n) in kinds {
            println!("  error {k}: {n}");
            for (m, c) in s["error_messages"][k].as_object().into_iter().flatten() {
                println!("    {c} × {m}");
            }
        }
    }
    println!("report: {}", out.join("report.html").display());
}
