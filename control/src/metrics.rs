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
