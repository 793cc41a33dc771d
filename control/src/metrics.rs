//! Prometheus metrics of the control plane (`cachet_control_*`), in the default registry
//! every role's `/metrics` serves.

use std::sync::LazyLock;

use cachet_common::metrics::int_counter_vec;
use prometheus::IntCounterVec;

pub static ADMIN_LOGINS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_control_admin_logins_total",
        "Admin console logins by outcome (ok, invalid, locked, throttled)",
        &["outcome"],
    )
});

pub static WEBHOOK_ATTEMPTS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_control_webhook_attempts_total",
        "Webhook delivery attempts by outcome (delivered, retry, failed)",
        &["outcome"],
    )
});

pub static BUDGET_ALERTS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_control_budget_alerts_total",
        "Budget thresholds crossed (recorded once per tenant or workspace, month and threshold)",
        &["scope"],
    )
});

pub static CACHE_RELEASED_BYTES: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_control_cache_released_bytes_total",
        "Bytes of deleted cache objects' blocks this process's node released: freed (no \
             other entry held them) or held (another entry of the scope still does)",
        &["outcome"],
    )
});
