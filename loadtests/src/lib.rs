//! Cachet's load-testing tool, behind `cachet loadtest …`: the trace replayer (`replay`,
//! `sweep`, `generate`) that load testers point at a running service, and the benchmarks
//! whose figures are in docs/benchmarks.md. Targets must be on this machine (loopback);
//! every run is bounded and stops by itself.
//!
//! - [`trace`]: Mooncake-format traces, streamed; how records map onto sessions and tenants.
//! - [`text`]: the deterministic text of a trace's blocks.
//! - [`workload`]: synthetic workloads (chat, agent, RAG, scan) written as traces.
//! - [`client`]: one request on the wire (Anthropic or OpenAI), timed token by token.
//! - [`simulate`]: `simulate-cache`, traces and workloads through the fabric's eviction code.
//! - [`fleet`]: `simulate-fleet`, a fleet of instances with continuous batching, its caches
//!   and routing, in simulated time.
//! - [`replay`], [`sweep`]: the runs; [`stats`]: what they measure in bounded memory;
//!   [`report`]: the HTML reports; [`reconcile`]: the run against the price book and ledger.
//! - `http`, `fabric`, `ledger`, `dashboard`: the benchmarks.

mod burst;
pub mod client;
mod dashboard;
mod fabric;
pub mod fleet;
mod http;
mod ledger;
pub mod reconcile;
pub mod replay;
pub mod report;
pub mod simulate;
pub mod stats;
pub mod sweep;
pub mod text;
pub mod trace;
pub mod workload;

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Subcommand;

/// The Postgres server a benchmark makes its scratch database on (and drops it after).
#[derive(clap::Args)]
pub struct Scratch {
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    pub database_url: String,
}

#[derive(Subcommand)]
pub enum Command {
    /// Replay a Mooncake-format trace (or a synthetic workload) against a running Cachet
    /// (`cachet serve` or a cluster's gateway): open loop on the trace's timestamps, a
    /// Poisson rate or a concurrency; per-request records, summary.json and report.html in
    /// --out; with a finance token, the usage every client saw checked against the ledger
    /// (exit status 1 on any difference).
    Replay(Box<replay::ReplayArgs>),
    /// The replay at increasing rates: the highest rate whose TTFT p90 and TBT p90 meet the
    /// SLOs (sweep.json, sweep.html, one replay report per rate).
    Sweep(Box<sweep::SweepArgs>),
    /// Write a synthetic workload as a Mooncake-format trace.
    Generate {
        #[arg(long, value_enum)]
        workload: workload::Kind,
        #[command(flatten)]
        args: workload::WorkloadArgs,
        /// The trace file to write.
        #[arg(long)]
        out: std::path::PathBuf,
    },
    /// Cache-hit requests against `/v1/messages`: one fixed prompt with a breakpoint, so every
    /// request after the first reads it from the cache. Prints requests/s and p50/p99.
    Http {
        /// Base URL (loopback only).
        #[arg(long, default_value = "http://127.0.0.1:8080")]
        url: String,
        #[arg(long, env = "CACHET_API_KEY", default_value = "")]
        api_key: String,
        #[arg(long, default_value = "sim-tiny")]
        model: String,
        /// Concurrent connections; repeat for several runs (e.g. --concurrency 1 --concurrency 32).
        #[arg(long, default_values_t = vec![1usize, 32])]
        concurrency: Vec<usize>,
        #[arg(long, default_value_t = 10)]
        seconds: u64,
        /// Approximate prompt length in tokens.
        #[arg(long, default_value_t = 4096)]
        prompt_tokens: usize,
        #[arg(long, default_value_t = 8)]
        max_tokens: u32,
        /// A name for the target in the output.
        #[arg(long, default_value = "cachet")]
        label: String,
        /// Exit non-zero when more than this share of a run's requests failed (or none
        /// succeeded).
        #[arg(long, default_value_t = 0.01)]
        max_error_rate: f64,
    },
    /// Replay a Mooncake-format trace (`{"hash_ids": [...]}` per line) through the fabric's
    /// own eviction and admission code, without an engine, and print the prefix hit ratio of
    /// each policy and capacity (plain LRU always printed beside).
    SimulateCache(Box<simulate::SimulateArgs>),
    /// A fleet of engine instances with continuous batching, its caches and routing, in
    /// simulated time: goodput within TTFT and TBT SLOs, latencies, hit ratio, load balance
    /// and KV moved, per routing policy and prefill/decode split, for traces and workloads.
    SimulateFleet(Box<fleet::FleetArgs>),
    /// Measure an engine's cost profile for simulate-fleet on a running vLLM server:
    /// prefill against prompt length, the decode step against batch and context, and a
    /// prefill's interference with the decodes beside it; writes the profile as JSON.
    Profile(Box<fleet::measure::ProfileArgs>),
    /// Node→node transfer of one large block over loopback: the fabric's TCP transport vs a
    /// plain tokio socket copy of the same bytes (the limit) vs Redis SET/GET.
    Transfer {
        #[arg(long, default_value_t = 32)]
        size_mib: usize,
        #[arg(long, default_value_t = 20)]
        iterations: usize,
        /// Parallel connections per block pull; repeat for several rows.
        #[arg(long, default_values_t = vec![1usize, 2, 4])]
        stripes: Vec<usize>,
        /// Redis for the SET/GET rows; empty to skip them.
        #[arg(long, env = "REDIS_URL", default_value = "redis://127.0.0.1:6379")]
        redis_url: String,
        /// Also pull the block over RDMA READ with this device (a build with the rdma
        /// feature, on a host with RDMA).
        #[arg(long)]
        rdma_device: Option<String>,
    },
    /// The gateway's prefix index at scale: lookup time of a long prompt's prefix among
    /// millions of indexed blocks, and memory per indexed block.
    Index {
        #[arg(long, default_value_t = 10_000_000)]
        blocks: usize,
        #[arg(long, default_value_t = 131_072)]
        prompt_tokens: usize,
        #[arg(long, default_value_t = 16)]
        block_tokens: usize,
        #[arg(long, default_value_t = 2000)]
        lookups: usize,
    },
    /// A fabric node alone (no Redis, no Postgres): its TCP wire on --listen and, unless
    /// --socket is empty, the same-host path (Unix socket and shared-memory arena) there;
    /// the cluster token from CACHET_CLUSTER_TOKEN. Prints its addresses, serves until
    /// stopped. For the KV data-path benchmark (loadtests/kv_data_path.py) and the vLLM
    /// connector's transfer tests.
    FabricNode {
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: String,
        #[arg(long, default_value = "")]
        socket: String,
        /// The DRAM tier's capacity (and the arena's size).
        #[arg(long, default_value_t = 1 << 30)]
        dram_bytes: u64,
    },
    /// Block events from a node's store through a Redis Stream into a follower's prefix
    /// index: events/s and index staleness (event time → applied).
    Events {
        /// Blocks written (each is one stored event).
        #[arg(long, default_value_t = 200_000)]
        blocks: usize,
        /// Offered load: blocks stored per second.
        #[arg(long, default_value_t = 20_000)]
        rate: usize,
        #[arg(long, env = "REDIS_URL", default_value = "redis://127.0.0.1:6379")]
        redis_url: String,
    },
    /// Ledger ingest through the meter (group commit, idempotent) vs `COPY` of the same rows
    /// into an index-free table on the same Postgres (a scratch database, dropped after).
    Ingest {
        #[arg(long, default_value_t = 300_000)]
        events: usize,
        /// Tasks handing events to the meter at once.
        #[arg(long, default_value_t = 16)]
        producers: usize,
        /// Share of events delivered twice (retries, spool replays), in percent.
        #[arg(long, default_value_t = 10)]
        duplicates: usize,
        #[command(flatten)]
        db: Scratch,
    },
    /// A streamed CSV export of a large ledger through the finance API, with the process's
    /// peak RSS (a scratch database, dropped after).
    Export {
        #[arg(long, default_value_t = 1_000_000)]
        rows: usize,
        #[command(flatten)]
        db: Scratch,
    },
    /// The admin dashboard's usage API over a large ledger (generated in a scratch database,
    /// rolled up): latency per query shape over HTTP, beside the same totals read from the
    /// raw ledger.
    Dashboard {
        #[arg(long, default_value_t = 10_000_000)]
        rows: usize,
        #[arg(long, default_value_t = 100)]
        tenants: usize,
        #[arg(long, default_value_t = 30)]
        days: i64,
        /// Timed requests per query shape.
        #[arg(long, default_value_t = 400)]
        requests: usize,
        #[arg(long, default_value_t = 4)]
        concurrency: usize,
        #[command(flatten)]
        db: Scratch,
    },
    /// N identical cold requests at once: writers, readers, the engine's prefill time for the
    /// burst and TTFT (in-flight coalescing on vs off: run against a server started with
    /// CACHET_COALESCE=false for the baseline).
    Burst(burst::BurstArgs),
    /// A bare axum server answering every POST with a fixed Messages-shaped body: the limit
    /// of HTTP on this machine, for side-by-side comparison.
    BareServer {
        #[arg(long, default_value = "127.0.0.1:8090")]
        listen: SocketAddr,
        /// Stop after this many seconds.
        #[arg(long, default_value_t = 600)]
        seconds: u64,
    },
}

pub async fn run(cmd: Command) -> anyhow::Result<()> {
    match cmd {
        Command::Http {
            url,
            api_key,
            model,
            concurrency,
            seconds,
            prompt_tokens,
            max_tokens,
            label,
            max_error_rate,
        } => {
            http::check_loopback(&url)?;
            check_rate_arg(max_error_rate)?;
            let body = http::hit_body(&model, prompt_tokens, max_tokens);
            let client = reqwest::Client::builder()
                .pool_max_idle_per_host(256)
                .build()?;
            http::warm_up(&client, &url, &api_key, &body).await?;
            for c in concurrency {
                let r = http::measure(
                    &client,
                    &url,
                    &api_key,
                    &body,
                    c,
                    Duration::from_secs(seconds),
                )
                .await?;
                println!(
                    "{label}\tconcurrency={c}\trequests={}\terrors={}\trps={:.0}\tp50_ms={:.3}\tp99_ms={:.3}",
                    r.ok, r.errors, r.rps, r.p50_ms, r.p99_ms
                );
                within_error_rate(
                    r.ok + r.errors,
                    r.errors,
                    max_error_rate,
                    &format!("{label} at concurrency {c}"),
                )?;
            }
            Ok(())
        }
        Command::Burst(args) => burst::run(args).await,
        Command::BareServer { listen, seconds } => {
            http::bare_server(listen, Duration::from_secs(seconds)).await
        }
        Command::Transfer {
            size_mib,
            iterations,
            stripes,
            redis_url,
            rdma_device,
        } => {
            fabric::transfer_bench(
                size_mib,
                iterations,
                &stripes,
                &redis_url,
                rdma_device.as_deref(),
            )
            .await
        }
        Command::Index {
            blocks,
            prompt_tokens,
            block_tokens,
            lookups,
        } => fabric::index_bench(blocks, prompt_tokens, block_tokens, lookups),
        Command::Events {
            blocks,
            rate,
            redis_url,
        } => fabric::events_bench(blocks, rate, &redis_url).await,
        Command::FabricNode {
            listen,
            socket,
            dram_bytes,
        } => fabric::standalone_node(&listen, &socket, dram_bytes).await,
        Command::SimulateCache(a) => simulate::run(&a),
        Command::SimulateFleet(a) => fleet::run(&a),
        Command::Profile(a) => fleet::measure::run(&a).await,
        Command::Replay(a) => replay_checked(*a).await,
        Command::Sweep(a) => {
            if !sweep::run(*a).await? {
                bail!("the ledger does not match what the clients saw (see above)");
            }
            Ok(())
        }
        Command::Generate {
            workload: kind,
            args,
            out,
        } => generate_to(kind, &args, &out),
        Command::Ingest {
            events,
            producers,
            duplicates,
            db,
        } => ledger::ingest(&db.database_url, events, producers, duplicates).await,
        Command::Export { rows, db } => ledger::export(&db.database_url, rows).await,
        Command::Dashboard {
            rows,
            tenants,
            days,
            requests,
            concurrency,
            db,
        } => {
            dashboard::dashboard(&db.database_url, rows, tenants, days, requests, concurrency).await
        }
    }
}

/// A replay, failing where the ledger disagrees with the clients or errors pass the limit.
async fn replay_checked(a: replay::ReplayArgs) -> anyhow::Result<()> {
    let max_error_rate = a.max_error_rate;
    let r = replay::run(a).await?;
    if !r.ok {
        bail!("the ledger does not match what the clients saw (see above)");
    }
    let count = |k: &str| r.summary[k].as_u64().unwrap_or(0);
    within_error_rate(
        count("done"),
        count("errors"),
        max_error_rate,
        &r.summary["error_kinds"].to_string(),
    )
}

/// A generated workload written to `out` as a trace.
fn generate_to(
    kind: workload::Kind,
    args: &workload::WorkloadArgs,
    out: &std::path::Path,
) -> anyhow::Result<()> {
    let f = std::fs::File::create(out).with_context(|| format!("creating {}", out.display()))?;
    let mut w = std::io::BufWriter::new(f);
    let n = workload::generate(kind, args, &mut w)?;
    std::io::Write::flush(&mut w)?;
    println!("{n} requests written to {}", out.display());
    Ok(())
}

/// Resident set size of this process, from `/proc/self/statm` (Linux).
pub fn rss_bytes() -> anyhow::Result<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").context("reading /proc/self/statm")?;
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .context("statm has no RSS field")?
        .parse()?;
    Ok(pages * 4096)
}

#[cfg(test)]
mod tests {
    #[derive(clap::Parser)]
    struct Cli {
        #[command(subcommand)]
        command: super::Command,
    }

    #[test]
    fn the_command_line_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}

/// `--max-error-rate` is a share of requests.
pub(crate) fn check_rate_arg(rate: f64) -> anyhow::Result<()> {
    if !(0.0..=1.0).contains(&rate) {
        bail!("--max-error-rate must be between 0 and 1 (a share of the requests)");
    }
    Ok(())
}

/// A run whose share of failed requests is past `max` (or that answered nothing) fails, so
/// a benchmark against a broken server cannot pass for a fast one.
fn within_error_rate(done: u64, errors: u64, max: f64, what: &str) -> anyhow::Result<()> {
    if done == errors {
        bail!("no request succeeded ({errors} failed): {what}");
    }
    let rate = errors as f64 / done as f64;
    if rate > max {
        bail!(
            "{errors} of {done} requests failed ({:.1}%), over --max-error-rate {max}: {what}",
            rate * 100.0
        );
    }
    Ok(())
}

#[cfg(test)]
mod error_rate_tests {
    use super::*;

    #[test]
    fn a_run_fails_past_its_error_rate_or_with_no_success() {
        assert!(within_error_rate(100, 5, 0.05, "").is_ok());
        assert!(within_error_rate(100, 6, 0.05, "").is_err());
        assert!(
            within_error_rate(0, 0, 1.0, "").is_err(),
            "nothing answered"
        );
        assert!(
            within_error_rate(10, 10, 1.0, "").is_err(),
            "every request failed"
        );
        assert!(within_error_rate(10, 9, 1.0, "").is_ok());
        assert!(check_rate_arg(1.5).is_err() && check_rate_arg(-0.1).is_err());
    }
}
