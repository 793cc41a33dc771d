//! `cachet loadtest simulate-cache`: traces and synthetic workloads through the fabric's own
//! eviction and admission code (`cache_fabric::simulate`), without an engine: the prefix hit
//! ratio of each policy at each capacity, plain LRU always beside, and one table over every
//! workload at the end.

use std::time::Instant;

use anyhow::{Context, bail};
use cache_fabric::EvictionPolicy;
use cache_fabric::simulate::{SimRequest, replay_requests};
use clap::Args;

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
    /// Capacity in blocks; repeat for several.
    #[arg(long = "capacity-blocks", required = true)]
    pub capacity_blocks: Vec<u64>,
    /// `frequency` (default), `frequency:<horizon factor>` or `lru`; repeat for several.
    #[arg(long, default_values_t = vec!["frequency".to_string()])]
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
    if let Some(c) = a.capacity_blocks.iter().find(|c| **c == 0) {
        bail!("--capacity-blocks must be positive, got {c}");
    }
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
    // (workload, capacity) → hit ratio per policy, for the closing table.
    let mut table: Vec<(String, u64, Vec<f64>)> = Vec::new();
    for (name, reqs) in &workloads {
        for &cap in &a.capacity_blocks {
            let mut row = Vec::new();
            for &p in &policies {
                let started = Instant::now();
                let r = replay_requests(reqs, cap, p);
                println!(
                    "policy={}\tcapacity_blocks={cap}\trequests={}\tblocks={}\thit_blocks={}\thit_ratio={:.4}\ttoken_hit_ratio={:.4}\tnot_admitted={}\tseconds={:.1}\tworkload={name}",
                    r.policy,
                    r.requests,
                    r.blocks,
                    r.hit_blocks,
                    r.hit_ratio(),
                    r.token_hit_ratio(),
                    r.not_admitted,
                    started.elapsed().as_secs_f64()
                );
                row.push(r.hit_ratio());
            }
            table.push((name.clone(), cap, row));
        }
    }
    println!();
    let names: Vec<String> = policies.iter().map(|p| p.to_string()).collect();
    let w = table
        .iter()
        .map(|(n, _, _)| n.len())
        .max()
        .unwrap_or(8)
        .max(8);
    println!(
        "prefix hit ratio\n{:<w$}  {:>9}  {}",
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
        println!("{name:<w$}  {cap:>9}  {}", cells.join("  "));
    }
    Ok(())
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
            policy: vec!["frequency".into()],
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
