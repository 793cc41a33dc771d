//! Prometheus metrics of the control plane (`cachet_control_*`), in the default registry
//! every role's `/metrics` serves.

use std::sync::LazyLock;

use prometheus::{IntCounterVec, Opts};

pub static ADMIN_LOGINS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    let c = IntCounterVec::new(
        Opts::new(
            "cachet_control_admin_logins_total",
            "Admin console logins by outcome (ok, invalid, locked, throttled)",
        ),
        &["outcome"],
    )
    .expect("metric");
    let _ = prometheus::default_registry().register(Box::new(c.clone()));
    c
});

pub static WEBHOOK_ATTEMPTS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    let c = IntCounterVec::new(
        Opts::new(
            "cachet_control_webhook_attempts_total",
            "Webhook delivery attempts by outcome (delivered, retry, failed)",
        ),
        &["outcome"],
    )
    .expect("metric");
    let _ = prometheus::default_registry().register(Box::new(c.clone()));
    c
});

pub static BUDGET_ALERTS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    let c = IntCounterVec::new(
        Opts::new(
            "cachet_control_budget_alerts_total",
            "Budget thresholds crossed (recorded once per tenant or workspace, month and threshold)",
        ),
        &["scope"],
    )
    .expect("metric");
    let _ = prometheus::default_registry().register(Box::new(c.clone()));
    c
});

pub static CACHE_RELEASED_BYTES: LazyLock<IntCounterVec> = LazyLock::new(|| {
    let c = IntCounterVec::new(
        Opts::new(
            "cachet_control_cache_released_bytes_total",
            "Bytes of deleted cache objects' blocks this process's node released: freed (no \
             other entry held them) or held (another entry of the scope still does)",
        ),
        &["outcome"],
    )
    .expect("metric");
    let _ = prometheus::default_registry().register(Box::new(c.clone()));
    c
});
