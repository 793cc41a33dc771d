//! Prometheus metrics of billing (`cachet_billing_*`).

use std::sync::LazyLock;

use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts};

fn reg<C: prometheus::core::Collector + Clone + 'static>(c: C) -> C {
    let _ = prometheus::default_registry().register(Box::new(c.clone()));
    c
}

pub static EVENTS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    reg(IntCounterVec::new(
        Opts::new(
            "cachet_billing_meter_events_total",
            "Usage events by outcome (committed, duplicate, spooled, replayed)",
        ),
        &["outcome"],
    )
    .expect("metric"))
});
pub static BATCH_SECONDS: LazyLock<Histogram> = LazyLock::new(|| {
    reg(Histogram::with_opts(
        HistogramOpts::new(
            "cachet_billing_meter_commit_seconds",
            "Group commit latency",
        )
        .buckets(vec![
            0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 2.0,
        ]),
    )
    .expect("metric"))
});
pub static KEPT_ASIDE: LazyLock<IntGauge> = LazyLock::new(|| {
    reg(IntGauge::new(
        "cachet_billing_meter_kept_aside",
        "Directories of another database's usage files kept aside in the meter's directory, \
         waiting to be recovered into their database (decision 0030)",
    )
    .expect("metric"))
});
pub static SPOOL_EVENTS: LazyLock<IntGauge> = LazyLock::new(|| {
    reg(IntGauge::new(
        "cachet_billing_meter_spooled_events",
        "Events waiting in the local spool",
    )
    .expect("metric"))
});
pub static DEFERRED: LazyLock<IntGauge> = LazyLock::new(|| {
    reg(IntGauge::new(
        "cachet_billing_meter_deferred_events",
        "Usage events of streams a gateway lost, waiting out the resume grace before recording",
    )
    .expect("metric"))
});
pub static OPEN_STREAMS: LazyLock<IntGauge> = LazyLock::new(|| {
    reg(IntGauge::new(
        "cachet_billing_meter_open_streams",
        "Streamed responses journaled as open (their final usage not yet durable)",
    )
    .expect("metric"))
});
pub static COMMIT_FAILURES: LazyLock<IntCounter> = LazyLock::new(|| {
    reg(IntCounter::new(
        "cachet_billing_meter_commit_failures_total",
        "Batches Postgres did not take",
    )
    .expect("metric"))
});
pub static ROLLUP_SECONDS: LazyLock<Histogram> = LazyLock::new(|| {
    reg(Histogram::with_opts(
        HistogramOpts::new(
            "cachet_billing_rollup_seconds",
            "Time to refresh the usage rollups of the recent window",
        )
        .buckets(vec![0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]),
    )
    .expect("metric"))
});
pub static JOURNAL_FSYNC_SECONDS: LazyLock<Histogram> = LazyLock::new(|| {
    reg(Histogram::with_opts(
        HistogramOpts::new(
            "cachet_billing_journal_fsync_seconds",
            "Time to write and fsync one group of usage events to the local journal",
        )
        .buckets(vec![
            0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.5,
        ]),
    )
    .expect("metric"))
});
pub static JOURNAL_GROUP_EVENTS: LazyLock<Histogram> = LazyLock::new(|| {
    reg(Histogram::with_opts(
        HistogramOpts::new(
            "cachet_billing_journal_group_events",
            "Usage events made durable by one journal fsync",
        )
        .buckets(vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 256.0, 1024.0]),
    )
    .expect("metric"))
});
pub static JOURNAL_UNCOMMITTED: LazyLock<IntGauge> = LazyLock::new(|| {
    reg(IntGauge::new(
        "cachet_billing_journal_uncommitted_events",
        "Usage events fsynced to the local journal and not yet in Postgres or the spool",
    )
    .expect("metric"))
});
pub static STORAGE_ROWS: LazyLock<IntCounter> = LazyLock::new(|| {
    reg(IntCounter::new(
        "cachet_billing_storage_rows_total",
        "Hours of cache-object storage written to the storage ledger",
    )
    .expect("metric"))
});
