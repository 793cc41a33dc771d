//! Prometheus metrics of the engines (`cachet_engine_*`).

use std::sync::LazyLock;

use cachet_common::metrics::{int_counter_vec, int_gauge};
use prometheus::{IntCounterVec, IntGauge};

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
