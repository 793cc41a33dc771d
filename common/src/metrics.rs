//! Prometheus metrics made and registered in the default registry (the one every role's
//! `/metrics` serves) in one call: each crate's `metrics.rs` declares its metrics as
//! `LazyLock`s of these. A metric registered twice (several nodes in one test process)
//! keeps the first registration; the second's values are simply not exported.

use prometheus::core::Collector;
use prometheus::{
    CounterVec, Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec,
    IntGauge, IntGaugeVec, Opts,
};

/// Register `made` (a metric's name, help and labels are constants of the code: a bad one is a
/// bug, found by the first test that touches it).
fn registered<C: Collector + Clone + 'static>(made: prometheus::Result<C>) -> C {
    let c = made.expect("a metric's name, help and labels are valid");
    let _ = prometheus::default_registry().register(Box::new(c.clone()));
    c
}

pub fn int_counter(name: &str, help: &str) -> IntCounter {
    registered(IntCounter::new(name, help))
}

pub fn int_counter_vec(name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    registered(IntCounterVec::new(Opts::new(name, help), labels))
}

pub fn int_gauge(name: &str, help: &str) -> IntGauge {
    registered(IntGauge::new(name, help))
}

pub fn int_gauge_vec(name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    registered(IntGaugeVec::new(Opts::new(name, help), labels))
}

pub fn gauge(name: &str, help: &str) -> Gauge {
    registered(Gauge::new(name, help))
}

pub fn gauge_vec(name: &str, help: &str, labels: &[&str]) -> GaugeVec {
    registered(GaugeVec::new(Opts::new(name, help), labels))
}

pub fn counter_vec(name: &str, help: &str, labels: &[&str]) -> CounterVec {
    registered(CounterVec::new(Opts::new(name, help), labels))
}

pub fn histogram(name: &str, help: &str, buckets: &[f64]) -> Histogram {
    let opts = HistogramOpts::new(name, help).buckets(buckets.to_vec());
    registered(Histogram::with_opts(opts))
}

pub fn histogram_vec(name: &str, help: &str, labels: &[&str], buckets: &[f64]) -> HistogramVec {
    let opts = HistogramOpts::new(name, help).buckets(buckets.to_vec());
    registered(HistogramVec::new(opts, labels))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_metric_is_registered_once_and_exported() {
        let c = int_counter_vec("cachet_test_things_total", "Things by kind", &["kind"]);
        c.with_label_values(&["a"]).inc();
        let again = int_counter_vec("cachet_test_things_total", "Things by kind", &["kind"]);
        again.with_label_values(&["a"]).inc_by(5);
        let text = prometheus::TextEncoder::new()
            .encode_to_string(&prometheus::default_registry().gather())
            .unwrap();
        assert!(
            text.contains("cachet_test_things_total{kind=\"a\"} 1"),
            "{text}"
        );
        let h = histogram("cachet_test_seconds", "Seconds", &[0.1, 1.0]);
        h.observe(0.5);
        let text = prometheus::TextEncoder::new()
            .encode_to_string(&prometheus::default_registry().gather())
            .unwrap();
        assert!(
            text.contains("cachet_test_seconds_bucket{le=\"1\"} 1"),
            "{text}"
        );
    }
}
