//! `cachet loadtest simulate-cache`: traces and synthetic workloads through the fabric's own
//! eviction and admission code (`cache_fabric::simulate`), without an engine: the prefix hit
//! ratio of each policy at each capacity, plain LRU always beside, and one table over every
//! workload at the end.

use std::time::Instant;

use anyhow::{Context, bail};
use cache_fabric::EvictionPolicy;
use cache_fabric::simulate::{SimCapacity, SimRequest, replay_sized};
use clap::Args;
use engine::KvDtype;

use crate::trace::{self, Shape, TraceReader, TraceRecord};
use crate::workload::{self, Kind, WorkloadArgs};

#[derive(Args, Clone, Debug)]
pub struct SimulateArgs {
    /// A Mooncake-format trace; repeat for several.
    #[arg(long)]
    pub trace: Vec<std::path::PathBuf>,
    /// A synthetic workload, generated with the --workload-* knobs; repeat for several.
    #[arg(long, value_enum)]
    pub workload: Vec<Kind>,
    #[command(flatten)]
    pub workload_args: WorkloadArgs,
    /// DRAM capacity in blocks; repeat for several.
    #[arg(long = "capacity-blocks")]
    pub capacity_blocks: Vec<u64>,
    /// DRAM capacity in bytes (`236G`, `64GiB`, `1000000`), for each --kv-dtype: a block
    /// takes its tokens × the model's KV bytes per token; repeat for several.
    #[arg(long = "capacity-bytes", value_parser = parse_bytes)]
    pub capacity_bytes: Vec<u64>,
    /// The KV dtype(s) --capacity-bytes is counted in (f32, f16, bf16, int8, fp8); repeat
    /// for several. Default: the model's (int8 for the reference model).
    #[arg(long = "kv-dtype")]
    pub kv_dtype: Vec<String>,
    /// The model whose KV shape sizes --capacity-bytes.
    #[arg(long, default_value = engine::reference::MODEL_ID)]
    pub model: String,
    /// A tier under DRAM (the local disk; oldest-first eviction) of this many blocks, with
    /// --capacity-blocks; hits it serves are counted apart.
    #[arg(long, default_value_t = 0)]
    pub disk_blocks: u64,
    /// The same in bytes, with --capacity-bytes.
    #[arg(long, default_value = "0", value_parser = parse_bytes)]
    pub disk_bytes: u64,
    /// `adaptive` (the default policy), `frequency`, `frequency:<horizon factor>` or `lru`;
    /// repeat for several.
    #[arg(long, default_values_t = vec!["adaptive".to_string()])]
    pub policy: Vec<String>,
    /// The replay's view of the trace, to compare with a replay's hit ratio: sessions
    /// spread over this many tenants (separate caches), as `replay --api-key` × N does.
    #[arg(long, default_value_t = 1)]
    pub tenants: usize,
    /// Tokens per hash id (as `replay --block-tokens`); weights the token hit ratio.
    #[arg(long, default_value_t = trace::MOONCAKE_BLOCK_TOKENS)]
    pub block_tokens: u64,
    /// Leading blocks sent as the system prompt (as `replay --system-blocks`).
    #[arg(long, default_value_t = 1)]
    pub system_blocks: usize,
    /// Prompts shorter than this many tokens neither read nor write the cache (the
    /// model's minimum cacheable length; 0: none).
    #[arg(long, default_value_t = 0)]
    pub min_cacheable_tokens: u64,
    /// Skip this many records, then take at most --max-requests (as replay does).
    #[arg(long, default_value_t = 0)]
    pub skip: u64,
    #[arg(long)]
    pub max_requests: Option<u64>,
}

/// One workload's requests as the service would see them.
fn requests(
    records: impl Iterator<Item = anyhow::Result<TraceRecord>>,
    a: &SimulateArgs,
    shape: &Shape,
) -> anyhow::Result<Vec<SimRequest>> {
    let mut out = Vec::new();
    for rec in records
        .skip(a.skip as usize)
        .take(a.max_requests.map_or(usize::MAX, |m| m as usize))
    {
        let rec = rec?;
        let lens = shape.block_lengths(&rec);
        out.push(SimRequest {
            cacheable: lens.iter().sum::<u64>() >= a.min_cacheable_tokens,
            block_tokens: lens.iter().map(|&n| n as u32).collect(),
            scope: shape.tenant(&rec) as u32,
            blocks: rec.hash_ids,
        });
    }
    Ok(out)
}

pub fn run(a: &SimulateArgs) -> anyhow::Result<()> {
    let mut policies = vec![EvictionPolicy::Lru];
    for p in &a.policy {
        let p = EvictionPolicy::parse(p).map_err(|e| anyhow::anyhow!("--policy: {e}"))?;
        if !policies.contains(&p) {
            policies.push(p);
        }
    }
    let capacities = capacities(a)?;
    if a.trace.is_empty() && a.workload.is_empty() {
        bail!("give --trace FILE or --workload KIND (each may repeat)");
    }
    let shape = Shape {
        block_tokens: a.block_tokens,
        trace_block_tokens: trace::MOONCAKE_BLOCK_TOKENS,
        system_blocks: a.system_blocks,
        tenants: a.tenants.max(1),
    };
    let mut workloads: Vec<(String, Vec<SimRequest>)> = Vec::new();
    for path in &a.trace {
        let name = path.file_stem().map_or_else(
            || path.display().to_string(),
            |s| s.to_string_lossy().into(),
        );
        let reqs =
            requests(trace::open(path)?, a, &shape).with_context(|| path.display().to_string())?;
        workloads.push((name, reqs));
    }
    for &kind in &a.workload {
        let mut buf = Vec::new();
        workload::generate(kind, &a.workload_args, &mut buf)?;
        // A generated workload's session is named after its shared prefix.
        let shape = Shape {
            system_blocks: workload::prefix_blocks(kind, &a.workload_args) as usize,
            ..shape
        };
        let reqs = requests(TraceReader::new(&buf[..]), a, &shape)?;
        workloads.push((format!("{kind:?}").to_lowercase(), reqs));
    }
    // Every (workload, capacity, policy) replay is independent: run them on all cores.
    let jobs: Vec<(usize, usize, EvictionPolicy)> = (0..workloads.len())
        .flat_map(|w| {
            let policies = &policies;
            (0..capacities.len()).flat_map(move |c| policies.iter().map(move |&p| (w, c, p)))
        })
        .collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: std::sync::Mutex<Vec<Option<f64>>> = std::sync::Mutex::new(vec![None; jobs.len()]);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    std::thread::scope(|s| {
        for _ in 0..threads.min(jobs.len()) {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(&(w, c, p)) = jobs.get(i) else {
                        break;
                    };
                    let (name, reqs) = &workloads[w];
                    let (label, cap) = &capacities[c];
                    let started = Instant::now();
                    let r = replay_sized(reqs, *cap, p);
                    println!(
                        "policy={}\tcapacity={label}\trequests={}\tblocks={}\thit_blocks={}\thit_ratio={:.4}\ttoken_hit_ratio={:.4}\tdisk_hit_blocks={}\tnot_admitted={}\tadaptive_step={}\tseconds={:.1}\tworkload={name}",
                        r.policy,
                        r.requests,
                        r.blocks,
                        r.hit_blocks,
                        r.hit_ratio(),
                        r.token_hit_ratio(),
                        r.lower_hit_blocks,
                        r.not_admitted,
                        r.adaptive.map_or("-".into(), |(step, moves)| format!("{step} ({moves} moves)")),
                        started.elapsed().as_secs_f64()
                    );
                    results.lock().expect("not poisoned")[i] = Some(r.hit_ratio());
                }
            });
        }
    });
    let results = results.into_inner().expect("not poisoned");
    // (workload, capacity) → hit ratio per policy, for the closing table.
    let table: Vec<(String, String, Vec<f64>)> = jobs
        .chunks(policies.len())
        .zip(results.chunks(policies.len()))
        .map(|(js, rs)| {
            let (w, c, _) = js[0];
            (
                workloads[w].0.clone(),
                capacities[c].0.clone(),
                rs.iter().map(|r| r.unwrap_or(f64::NAN)).collect(),
            )
        })
        .collect();
    println!();
    let names: Vec<String> = policies.iter().map(|p| p.to_string()).collect();
    let w = table
        .iter()
        .map(|(n, _, _)| n.len())
        .max()
        .unwrap_or(8)
        .max(8);
    let cw = table
        .iter()
        .map(|(_, c, _)| c.len())
        .max()
        .unwrap_or(8)
        .max(8);
    println!(
        "prefix hit ratio\n{:<w$}  {:>cw$}  {}",
        "workload",
        "capacity",
        names
            .iter()
            .map(|n| format!("{n:>cw$}", cw = n.len().max(6)))
            .collect::<Vec<_>>()
            .join("  ")
    );
    for (name, cap, row) in &table {
        let cells: Vec<String> = row
            .iter()
            .zip(&names)
            .map(|(r, n)| format!("{r:>cw$.4}", cw = n.len().max(6)))
            .collect();
        println!("{name:<w$}  {cap:>cw$}  {}", cells.join("  "));
    }
    Ok(())
}

/// What the fabric's default policy would hit on `trace` (records `skip..skip + max`, seen
/// through the replay's `shape`) with `capacity_bytes` of `model`'s KV in its default dtype,
/// prompts under the model's minimum cacheable length neither reading nor writing: the token
/// hit ratio a replay's measured one is compared with.
pub fn hit_ratio_at(
    trace: &std::path::Path,
    shape: &Shape,
    skip: u64,
    max: Option<u64>,
    model: &str,
    capacity_bytes: u64,
) -> anyhow::Result<f64> {
    let geometry = engine::kv_geometries()
        .into_iter()
        .find(|(id, _)| id == model)
        .map(|(_, g)| g)
        .with_context(|| format!("no KV geometry for the model {model:?}"))?;
    let per_token = geometry.bytes_per_token() as u64;
    let min_cacheable = engine::min_cacheable_tokens(model).unwrap_or(0) as u64;
    let mut reqs = Vec::new();
    for rec in trace::open(trace)?
        .skip(skip as usize)
        .take(max.map_or(usize::MAX, |m| m as usize))
    {
        let rec = rec?;
        let lens = shape.block_lengths(&rec);
        reqs.push(SimRequest {
            cacheable: lens.iter().sum::<u64>() >= min_cacheable,
            block_tokens: lens.iter().map(|&n| n as u32).collect(),
            scope: shape.tenant(&rec) as u32,
            blocks: rec.hash_ids,
        });
    }
    let capacity = SimCapacity {
        dram: capacity_bytes / per_token.max(1),
        lower: 0,
        per_token: true,
    };
    Ok(replay_sized(&reqs, capacity, EvictionPolicy::DEFAULT).token_hit_ratio())
}

/// The capacities to replay at, each with its label: every --capacity-blocks, then every
/// --capacity-bytes in every --kv-dtype (counted in tokens of the model's KV).
fn capacities(a: &SimulateArgs) -> anyhow::Result<Vec<(String, SimCapacity)>> {
    if a.capacity_blocks.is_empty() && a.capacity_bytes.is_empty() {
        bail!("give --capacity-blocks N or --capacity-bytes B (each may repeat)");
    }
    if let Some(c) = a.capacity_blocks.iter().find(|c| **c == 0) {
        bail!("--capacity-blocks must be positive, got {c}");
    }
    let mut out: Vec<(String, SimCapacity)> = a
        .capacity_blocks
        .iter()
        .map(|&n| {
            (
                n.to_string(),
                SimCapacity {
                    dram: n,
                    lower: a.disk_blocks,
                    per_token: false,
                },
            )
        })
        .collect();
    if a.capacity_bytes.is_empty() {
        return Ok(out);
    }
    let geometry = engine::kv_geometries()
        .into_iter()
        .find(|(id, _)| *id == a.model)
        .map(|(_, g)| g)
        .ok_or_else(|| {
            let ids: Vec<String> = engine::kv_geometries()
                .into_iter()
                .map(|(id, _)| id)
                .collect();
            anyhow::anyhow!(
                "--model {:?} is not a model; available: {}",
                a.model,
                ids.join(", ")
            )
        })?;
    let dtypes: Vec<KvDtype> = if a.kv_dtype.is_empty() {
        vec![geometry.dtype]
    } else {
        a.kv_dtype
            .iter()
            .map(|d| KvDtype::parse(d).map_err(|e| anyhow::anyhow!("--kv-dtype: {e}")))
            .collect::<anyhow::Result<_>>()?
    };
    for dtype in dtypes {
        let per_token = engine::KvGeometry { dtype, ..geometry }.bytes_per_token() as u64;
        for &bytes in &a.capacity_bytes {
            let tokens = bytes / per_token;
            if tokens < a.block_tokens {
                bail!(
                    "--capacity-bytes {bytes} holds less than one block in {dtype} ({per_token} bytes a token)"
                );
            }
            out.push((
                format!(
                    "{} {dtype} ({} blocks)",
                    human_bytes(bytes),
                    tokens / a.block_tokens
                ),
                SimCapacity {
                    dram: tokens,
                    lower: a.disk_bytes / per_token,
                    per_token: true,
                },
            ));
        }
    }
    Ok(out)
}

/// `1000`, `64K`/`64KB` (10^3), `64KiB` (2^10), likewise M, G, T.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a byte count (like 236G or 64GiB)"))?;
    let scale: f64 = match unit.trim() {
        "" | "B" => 1.0,
        "K" | "KB" => 1e3,
        "M" | "MB" => 1e6,
        "G" | "GB" => 1e9,
        "T" | "TB" => 1e12,
        "KiB" => 1024.0,
        "MiB" => 1024f64.powi(2),
        "GiB" => 1024f64.powi(3),
        "TiB" => 1024f64.powi(4),
        u => {
            return Err(format!(
                "{u:?} is not a byte unit (B, K, M, G, T, KiB, MiB, GiB, TiB)"
            ));
        }
    };
    let v = n * scale;
    if !v.is_finite() || v >= u64::MAX as f64 {
        return Err(format!("{s:?} is too large"));
    }
    Ok(v as u64)
}

fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KB", "MB", "GB", "TB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1000.0 && u + 1 < UNITS.len() {
        v /= 1000.0;
        u += 1;
    }
    if u == 0 {
        format!("{b}B")
    } else {
        format!("{v:.1}{}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(workload: Vec<Kind>) -> SimulateArgs {
        SimulateArgs {
            trace: Vec::new(),
            workload,
            workload_args: WorkloadArgs {
                requests: 300,
                ..Default::default()
            },
            capacity_blocks: vec![50],
            capacity_bytes: vec![],
            kv_dtype: vec![],
            model: engine::reference::MODEL_ID.into(),
            disk_blocks: 0,
            disk_bytes: 0,
            policy: vec!["frequency".into(), "adaptive".into()],
            tenants: 1,
            block_tokens: 512,
            system_blocks: 1,
            min_cacheable_tokens: 0,
            skip: 0,
            max_requests: None,
        }
    }

    #[test]
    fn workloads_run_and_bad_arguments_are_refused() {
        run(&args(vec![Kind::Chat, Kind::Scan])).unwrap();
        assert!(run(&args(Vec::new())).is_err());
        let mut zero = args(vec![Kind::Rag]);
        zero.capacity_blocks = vec![0];
        assert!(run(&zero).is_err());
        let mut none = args(vec![Kind::Rag]);
        none.capacity_blocks = vec![];
        assert!(run(&none).is_err());
        let mut bytes = args(vec![Kind::Agent]);
        bytes.capacity_bytes = vec![50 * 512 * 46_080];
        bytes.kv_dtype = vec!["f32".into(), "int8".into()];
        bytes.disk_bytes = 20 * 512 * 46_080;
        run(&bytes).unwrap();
        bytes.kv_dtype = vec!["int4".into()];
        assert!(run(&bytes).is_err());
        bytes.kv_dtype = vec!["f32".into()];
        bytes.model = "gpt-9".into();
        assert!(run(&bytes).is_err());
    }

    #[test]
    fn byte_capacities_count_tokens_of_the_dtype() {
        let mut a = args(vec![]);
        a.capacity_blocks = vec![];
        // 10,000 f32 blocks of 512 tokens of SmolLM2 (46,080 bytes a token).
        a.capacity_bytes = vec![10_000 * 512 * 46_080];
        a.kv_dtype = vec!["f32".into(), "bf16".into(), "int8".into()];
        let caps = capacities(&a).unwrap();
        let blocks: Vec<u64> = caps.iter().map(|(_, c)| c.dram / 512).collect();
        // int8 keeps 66 bytes a 64-element vector (a half scale): 256/66 × as many.
        assert_eq!(blocks, vec![10_000, 20_000, 38_787]);
        assert!(caps.iter().all(|(_, c)| c.per_token && c.lower == 0));
        assert!(caps[2].0.contains("int8"), "{}", caps[2].0);
        assert_eq!(parse_bytes("236G"), Ok(236_000_000_000));
        assert_eq!(parse_bytes("2GiB"), Ok(2 << 30));
        assert_eq!(parse_bytes("1.5K"), Ok(1500));
        assert!(parse_bytes("12 parsecs").is_err());
        assert!(parse_bytes("").is_err());
    }

    #[test]
    fn requests_below_the_minimum_are_marked_and_tenants_split() {
        let mut a = args(Vec::new());
        a.min_cacheable_tokens = 1000;
        let shape = Shape {
            block_tokens: 512,
            trace_block_tokens: 512,
            system_blocks: 1,
            tenants: 4,
        };
        let recs = (0..40u64).map(|i| {
            Ok(TraceRecord {
                timestamp: 0.0,
                input_length: if i % 2 == 0 { 700 } else { 1500 },
                output_length: 1,
                hash_ids: vec![0, 100 + i],
            })
        });
        let reqs = requests(recs, &a, &shape).unwrap();
        assert_eq!(reqs.iter().filter(|r| r.cacheable).count(), 20);
        let scopes: std::collections::HashSet<u32> = reqs.iter().map(|r| r.scope).collect();
        assert!(scopes.len() > 1);
    }
}
