//! How a model's engine instances beside one node divide prefill and decode, and how loaded
//! each stage is: what a vLLM engine measures, a node announces with its heartbeat, and a
//! routing gateway's conductor weighs so that its early rejection covers both stages
//! (Mooncake's Algorithm 1: the prefill queue, the hand-over and the decode batch against
//! the TTFT and TBT targets).
//!
//! A value type only: the engine fills it, the conductor reads it.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// One model's stages on one node.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StageLoad {
    /// Prefill-only instances (0: every instance prefills what it decodes, colocated).
    pub prefill_instances: u32,
    /// Prefill stages running or waiting on them.
    pub prefill_in_flight: u32,
    /// Instances that decode (role decode or both).
    pub decode_instances: u32,
    /// Generations on them, whole or in their decode stage.
    pub decode_in_flight: u32,
    /// Prompts shorter than this are not split (prefilled where they decode).
    pub split_min_tokens: u64,
    /// Time between tokens against the decode batch on one instance: the step model.
    #[serde(default)]
    pub step: Option<StepModel>,
}

/// Time between tokens as a function of the batch decoding on an instance,
/// `base + per_seq × batch`, fitted to what was measured.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepModel {
    pub base_ms: f64,
    pub per_seq_ms: f64,
}

impl StepModel {
    /// The expected time between tokens with `batch` generations decoding together.
    pub fn at(&self, batch: u32) -> Duration {
        let ms = self.base_ms + self.per_seq_ms * f64::from(batch);
        Duration::from_secs_f64(ms.max(0.0) / 1e3)
    }
}

impl StageLoad {
    /// Whether a prompt of `tokens` is prefilled apart on these instances.
    pub fn splits(&self, tokens: usize) -> bool {
        self.prefill_instances > 0 && tokens as u64 >= self.split_min_tokens
    }

    /// The batch one more generation would join on the least loaded decoding instance
    /// (generations spread evenly, the newcomer included).
    pub fn next_decode_batch(&self, decode_in_flight: u32) -> u32 {
        (decode_in_flight + 1).div_ceil(self.decode_instances.max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_step_model_and_the_batch_a_newcomer_joins() {
        let m = StepModel {
            base_ms: 20.0,
            per_seq_ms: 5.0,
        };
        assert_eq!(m.at(1), Duration::from_millis(25));
        assert_eq!(m.at(4), Duration::from_millis(40));
        let s = StageLoad {
            prefill_instances: 1,
            decode_instances: 2,
            split_min_tokens: 1024,
            ..StageLoad::default()
        };
        assert_eq!(s.next_decode_batch(0), 1);
        assert_eq!(s.next_decode_batch(3), 2);
        assert_eq!(s.next_decode_batch(4), 3);
        assert!(s.splits(1024) && !s.splits(1023));
        assert!(!StageLoad::default().splits(1 << 20));
        // Old records (no measurements) still parse.
        let old: StageLoad = serde_json::from_str(
            r#"{"prefill_instances":0,"prefill_in_flight":0,"decode_instances":1,
                "decode_in_flight":0,"split_min_tokens":1024}"#,
        )
        .unwrap();
        assert_eq!(old.step, None);
    }
}
