//! Prometheus metrics of billing (`cachet_billing_*`).

use std::sync::LazyLock;

use cachet_common::metrics::{histogram, int_counter, int_counter_vec, int_gauge};
use prometheus::{Histogram, IntCounter, IntCounterVec, IntGauge};

pub static EVENTS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_billing_meter_events_total",
        "Usage events by outcome (committed, duplicate, spooled, replayed)",
        &["outcome"],
    )
});

pub static BATCH_SECONDS: LazyLock<Histogram> = LazyLock::new(|| {
    histogram(
        "cachet_billing_meter_commit_seconds",
        "Group commit latency",
        &[0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 2.0],
    )
});

pub static KEPT_ASIDE: LazyLock<IntGauge> = LazyLock::new(|| {
    int_gauge(
        "cachet_billing_meter_kept_aside",
        "Directories of another database's usage files kept aside in the meter's directory, \
         waiting to be recovered into their database (decision 0030)",
    )
});

pub static SPOOL_EVENTS: LazyLock<IntGauge> = LazyLock::new(|| {
    int_gauge(
        "cachet_billing_meter_spooled_events",
        "Events waiting in the local spool",
    )
});

pub static DEFERRED: LazyLock<IntGauge> = LazyLock::new(|| {
    int_gauge(
        "cachet_billing_meter_deferred_events",
        "Usage events of streams a gateway lost, waiting out the resume grace before recording",
    )
});

pub static OPEN_STREAMS: LazyLock<IntGauge> = LazyLock::new(|| {
    int_gauge(
        "cachet_billing_meter_open_streams",
        "Streamed responses journaled as open (their final usage not yet durable)",
    )
});

pub static COMMIT_FAILURES: LazyLock<IntCounter> = LazyLock::new(|| {
    int_counter(
        "cachet_billing_meter_commit_failures_total",
        "Batches Postgres did not take",
    )
});

pub static ROLLUP_SECONDS: LazyLock<Histogram> = LazyLock::new(|| {
    histogram(
        "cachet_billing_rollup_seconds",
        "Time to refresh the usage rollups of the recent window",
        &[0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0],
    )
});

pub static JOURNAL_FSYNC_SECONDS: LazyLock<Histogram> = LazyLock::new(|| {
    histogram(
        "cachet_billing_journal_fsync_seconds",
        "Time to write and fsync one group of usage events to the local journal",
        &[
            0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.5,
        ],
    )
});

pub static JOURNAL_GROUP_EVENTS: LazyLock<Histogram> = LazyLock::new(|| {
    histogram(
        "cachet_billing_journal_group_events",
        "Usage events made durable by one journal fsync",
        &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 256.0, 1024.0],
    )
});

pub static JOURNAL_UNCOMMITTED: LazyLock<IntGauge> = LazyLock::new(|| {
    int_gauge(
        "cachet_billing_journal_uncommitted_events",
        "Usage events fsynced to the local journal and not yet in Postgres or the spool",
    )
});

pub static STORAGE_ROWS: LazyLock<IntCounter> = LazyLock::new(|| {
    int_counter(
        "cachet_billing_storage_rows_total",
        "Hours of cache-object storage written to the storage ledger",
    )
});
