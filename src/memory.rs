//! Memory as a budget: every large consumer of a serving process has a configured bound, and
//! start-up refuses a configuration whose bounds add up to more than the machine (or its
//! cgroup) has, naming the settings — unless the operator says they know better
//! (`memory_overcommit = true`, `CACHET_MEMORY_OVERCOMMIT=1`). Freed memory goes back to the
//! operating system once the KV budget is idle ([`return_idle_memory`]).

use std::time::Duration;

use anyhow::bail;
use tokio_util::sync::CancellationToken;

use crate::config::{Config, machine_bytes};

/// One bounded consumer: the setting(s) that bound it, and its bound in bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bound {
    /// The setting that bounds it (the `setting` label of `cachet_memory_bound_bytes`).
    pub setting: &'static str,
    pub what: String,
    pub bytes: u64,
}

/// SmolLM2-135M's context window (its GGUF's `llama.context_length`).
const REFERENCE_CONTEXT: u64 = 8192;

/// What a process may use of the machine's memory for its bounded consumers; the rest is
/// for the code, stacks, sockets and the allocator's own overhead.
const USABLE_SHARE: f64 = 0.9;

/// The bounded consumers of a process with this configuration (`engines`: whether it runs
/// engines and the API, as `serve` and a node with `--api-listen` do).
pub fn bounds(config: &Config, engines: bool) -> Vec<Bound> {
    let mut out = vec![
        Bound {
            setting: "fabric.dram_capacity_bytes",
            what: "fabric.dram_capacity_bytes (the fabric's DRAM tier)".into(),
            bytes: config.fabric.dram_capacity_bytes,
        },
        Bound {
            setting: "fabric.receive_budget_bytes",
            what: "fabric.receive_budget_bytes (peers' writes being received)".into(),
            bytes: config.fabric.receive_budget_bytes,
        },
    ];
    if !engines {
        return out;
    }
    out.push(Bound {
        setting: "engine.kv_budget_bytes",
        what: "engine.kv_budget_bytes (KV between engine and fabric)".into(),
        bytes: config.kv_budget_bytes(),
    });
    if config.engine.kind == "reference" {
        // Each reference generation keeps its whole context's KV in f32 while it runs
        // (30 layers × 3 KV heads × 64 × K and V): one per worker, plus the generations
        // waiting mid-way for their next turn (gateway::engines::parked_max), and the
        // weights once.
        let per_generation = 30 * 3 * 64 * 2 * 4 * REFERENCE_CONTEXT;
        let workers = config.engine.workers;
        let generations = workers + gateway::engines::parked_max(workers);
        out.push(Bound {
            setting: "engine.workers",
            what: format!(
                "engine.workers × the reference model's working KV (({workers} + {} waiting \
                 for their turn) × {} MiB)",
                generations - workers,
                per_generation >> 20
            ),
            bytes: generations as u64 * per_generation,
        });
        out.push(Bound {
            setting: "engine.model",
            what: "the reference model's weights (f32)".into(),
            bytes: 600 << 20,
        });
    }
    // Every served model keeps a tokenization memo: the sims always, the reference engine
    // and each vLLM upstream (its chat renderer) when configured.
    let models = engine::sim::SimProfile::all().len()
        + usize::from(config.engine.kind == "reference")
        + config.engine.vllm.len();
    out.push(Bound {
        setting: "engine.memo",
        what: format!(
            "the tokenization memos ({models} models × {} MiB)",
            engine::memo::MODEL_MEMO_BYTES >> 20
        ),
        bytes: (models * engine::memo::MODEL_MEMO_BYTES) as u64,
    });
    out.push(Bound {
        setting: "meter.queue_capacity",
        what: "meter.queue_capacity (usage events waiting for Postgres)".into(),
        bytes: config.meter.queue_capacity as u64 * 512,
    });
    out
}

/// Refuse a configuration whose bounds exceed what the machine can give, unless overcommit
/// is allowed; say what they are (the log at start, `cachet_memory_bound_bytes`).
pub fn check(config: &Config, engines: bool) -> anyhow::Result<()> {
    let bounds = bounds(config, engines);
    for b in &bounds {
        gateway::metrics::MEMORY_BOUND_BYTES
            .with_label_values(&[b.setting])
            .set(b.bytes as i64);
    }
    let sum: u64 = bounds.iter().map(|b| b.bytes).sum();
    tracing::info!(
        total = %gateway::budget::human(sum),
        bounds = %bounds
            .iter()
            .map(|b| format!("{} {}", b.setting, gateway::budget::human(b.bytes)))
            .collect::<Vec<_>>()
            .join(", "),
        "memory bounds"
    );
    let Some(machine) = machine_bytes() else {
        tracing::warn!("cannot read the machine's memory; memory bounds not checked");
        return Ok(());
    };
    check_against(&bounds, machine, config.memory_overcommit)
}

fn check_against(bounds: &[Bound], machine: u64, overcommit: bool) -> anyhow::Result<()> {
    let sum: u64 = bounds.iter().map(|b| b.bytes).sum();
    let usable = (machine as f64 * USABLE_SHARE) as u64;
    if sum <= usable {
        return Ok(());
    }
    let lines: Vec<String> = bounds
        .iter()
        .map(|b| format!("  {}: {}", b.what, gateway::budget::human(b.bytes)))
        .collect();
    if overcommit {
        tracing::warn!(
            bounds = %gateway::budget::human(sum),
            machine = %gateway::budget::human(machine),
            "memory bounds exceed the machine's memory; starting anyway (memory_overcommit)"
        );
        return Ok(());
    }
    bail!(
        "the configured memory bounds add up to {} but this machine has {} ({} usable at {:.0}%):\n{}\n\
         lower these settings, or set memory_overcommit = true (CACHET_MEMORY_OVERCOMMIT=1) to start anyway",
        gateway::budget::human(sum),
        gateway::budget::human(machine),
        gateway::budget::human(usable),
        USABLE_SHARE * 100.0,
        lines.join("\n")
    )
}

/// While the service runs: once the KV budget has been idle for a moment after being used,
/// hand the allocator's free memory back to the operating system (glibc keeps freed chunks of
/// large prompts' KV in its arenas otherwise, and an idle process would stay at its peak).
pub async fn return_idle_memory(stop: CancellationToken) {
    let mut was_busy = false;
    let mut tick = tokio::time::interval(Duration::from_secs(2));
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let busy = gateway::metrics::KV_BUDGET_USED.get() > 0;
        if was_busy && !busy {
            trim();
        }
        was_busy = busy;
    }
}

/// Allocations of at least this many bytes get pages of their own from the OS, given back
/// when freed.
const MMAP_THRESHOLD: i32 = 512 << 10;

/// KV blocks (hundreds of KiB to MiBs each) come and go with every request. glibc's default
/// raises its mmap threshold after the first large free, after which such blocks come from
/// per-thread arenas whose freed space other threads cannot reuse: measured, a long-prompt
/// replay peaked 4.6 GiB above its live bounds. A fixed threshold keeps every block in pages
/// of its own, returned to the OS when the block is dropped.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn tune_allocator() {
    // SAFETY: mallopt only sets the allocator's tunables under its own lock; it takes no
    // pointers and is safe to call at any time from any thread.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn tune_allocator() {}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn trim() {
    // SAFETY: malloc_trim only walks the allocator's own free lists under its locks; it
    // takes no pointers from us and is safe to call from any thread at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim() {}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(bytes: u64) -> Bound {
        Bound {
            setting: "test",
            what: format!("setting.{bytes}"),
            bytes,
        }
    }

    #[test]
    fn bounds_over_the_machine_are_refused_naming_every_setting() {
        let gib = 1u64 << 30;
        assert!(check_against(&[b(4 * gib), b(4 * gib)], 24 * gib, false).is_ok());
        let e = check_against(&[b(16 * gib), b(8 * gib)], 24 * gib, false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("setting.17179869184") && e.contains("setting.8589934592"),
            "{e}"
        );
        assert!(e.contains("CACHET_MEMORY_OVERCOMMIT"), "{e}");
        assert!(check_against(&[b(16 * gib), b(8 * gib)], 24 * gib, true).is_ok());
    }

    #[test]
    fn the_default_configuration_fits_this_kind_of_machine() {
        let c = Config::default();
        let sum: u64 = bounds(&c, true).iter().map(|b| b.bytes).sum();
        // A 24 GiB machine (this project's): the defaults leave room.
        assert!(
            check_against(&bounds(&c, true), 24 << 30, false).is_ok(),
            "{sum}"
        );
        assert!(machine_bytes().is_some_and(|m| m > 0));
    }
}
