//! Prometheus metrics of the engines (`cachet_engine_*`).

use std::sync::LazyLock;

use prometheus::{IntCounterVec, IntGauge, Opts};

fn reg<C: prometheus::core::Collector + Clone + 'static>(c: C) -> C {
    let _ = prometheus::default_registry().register(Box::new(c.clone()));
    c
}

pub static MEMO: LazyLock<IntCounterVec> = LazyLock::new(|| {
    reg(IntCounterVec::new(
        Opts::new(
            "cachet_engine_segment_memo_total",
            "Segment tokenization memo lookups by result",
        ),
        &["result"],
    )
    .expect("metric"))
});

pub static TOKENS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    reg(IntCounterVec::new(
        Opts::new(
            "cachet_engine_tokens_total",
            "Tokens processed by kind (prefilled, imported, generated)",
        ),
        &["model", "kind"],
    )
    .expect("metric"))
});

pub static MEMO_BYTES: LazyLock<IntGauge> = LazyLock::new(|| {
    reg(IntGauge::new(
        "cachet_engine_segment_memo_bytes",
        "Bytes held by the segment tokenization memos (all engines)",
    )
    .expect("metric"))
});
