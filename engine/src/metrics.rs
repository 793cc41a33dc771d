//! Prometheus metrics of the engines (`cachet_engine_*`).

use std::sync::LazyLock;

use cachet_common::metrics::{gauge_vec, int_counter_vec, int_gauge, int_gauge_vec};
use prometheus::{GaugeVec, IntCounterVec, IntGauge, IntGaugeVec};

pub static MEMO: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_engine_segment_memo_total",
        "Segment tokenization memo lookups by result",
        &["result"],
    )
});

pub static TOKENS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_engine_tokens_total",
        "Tokens processed by kind (prefilled, imported, generated)",
        &["model", "kind"],
    )
});

pub static MEMO_BYTES: LazyLock<IntGauge> = LazyLock::new(|| {
    int_gauge(
        "cachet_engine_segment_memo_bytes",
        "Bytes held by the segment tokenization memos (all engines)",
    )
});

pub static SPLIT: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_engine_split_total",
        "Requests of a model with prefill instances: split (prefilled apart, decoded elsewhere), prefill_failed (served whole by a decoding instance)",
        &["model", "outcome"],
    )
});

pub static SPLIT_HANDOFF_TOKENS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_engine_split_handoff_tokens_total",
        "Prompt tokens prefilled on a prefill instance and handed to a decoding one through the fabric (full blocks)",
        &["model"],
    )
});

pub static STAGE_IN_FLIGHT: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    int_gauge_vec(
        "cachet_engine_stage_in_flight",
        "Requests on a model's vLLM instances by stage: prefill (prefill-only instances) and decode (instances that decode, whole requests included)",
        &["model", "stage"],
    )
});

pub static STAGE_PREFILL_SECONDS: LazyLock<GaugeVec> = LazyLock::new(|| {
    gauge_vec(
        "cachet_engine_stage_prefill_seconds",
        "Mean time of a prefill stage on a model's prefill instances (a moving average)",
        &["model"],
    )
});

pub static STAGE_STEP_SECONDS: LazyLock<GaugeVec> = LazyLock::new(|| {
    gauge_vec(
        "cachet_engine_stage_step_seconds",
        "The time-between-tokens line measured on a model's decoding instances: base, and per_seq (added for each generation in the batch)",
        &["model", "part"],
    )
});
