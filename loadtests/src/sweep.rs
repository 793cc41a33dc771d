//! `cachet loadtest sweep`: the replay at increasing Poisson rates, each for a fixed time,
//! and the highest rate at which TTFT p90 and TBT p90 meet their SLOs with no errors
//! (Mooncake's effective request capacity), with the curve in `sweep.html`.

use anyhow::bail;
use clap::Args;
use serde_json::{Value, json};

use crate::replay::{self, ReplayArgs};

#[derive(Args, Clone, Debug)]
pub struct SweepArgs {
    #[command(flatten)]
    pub replay: ReplayArgs,
    /// Offered rates, requests per second, in increasing order.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1.0, 2.0, 4.0, 8.0, 16.0])]
    pub rates: Vec<f64>,
    /// Seconds each rate is offered.
    #[arg(long, default_value_t = 60.0)]
    pub step_secs: f64,
    /// TTFT SLO on the 90th percentile, ms.
    #[arg(long, default_value_t = 2_000.0)]
    pub ttft_p90_ms: f64,
    /// TBT SLO on the 90th percentile, ms.
    #[arg(long, default_value_t = 100.0)]
    pub tbt_p90_ms: f64,
    /// Stop after this many rates in a row miss the SLOs.
    #[arg(long, default_value_t = 2)]
    pub stop_after_misses: usize,
}

/// Whether a step met the SLOs: no errors, both p90s within bounds.
fn meets(s: &Value, ttft: f64, tbt: f64) -> bool {
    let f = |v: &Value| v.as_f64().unwrap_or(f64::INFINITY);
    s["errors"].as_u64() == Some(0)
        && s["ok"].as_u64().unwrap_or(0) > 0
        && f(&s["ttft"]["p90_ms"]) <= ttft
        && (s["tbt"]["count"].as_u64() == Some(0) || f(&s["tbt"]["p90_ms"]) <= tbt)
}

/// Whether the simulator's prediction for a step (`--simulate-fleet`) met the SLOs: requests
/// simulated, none rejected, both p90s within bounds.
fn predicted_meets(sim: &Value, ttft: f64, tbt: f64) -> bool {
    let f = |v: &Value| v.as_f64().unwrap_or(f64::INFINITY);
    sim["rejected"].as_u64() == Some(0)
        && sim["requests"].as_u64().unwrap_or(0) > 0
        && f(&sim["ttft_p90_ms"]) <= ttft
        && f(&sim["tbt_p90_ms"]) <= tbt
}

/// The capacity a sweep reports: the highest rate that met the SLOs with no miss at a lower
/// rate still standing (a miss followed by a met rate does not count the met one; the sweep
/// stops after enough misses in a row). `met`: each step's verdict, in rate order.
fn capacity(rates: &[f64], met: &[bool]) -> Option<f64> {
    let (mut capacity, mut misses) = (None, 0usize);
    for (&rate, &ok) in rates.iter().zip(met) {
        if ok && misses == 0 {
            capacity = Some(rate);
        }
        misses = if ok { 0 } else { misses + 1 };
    }
    capacity
}

pub async fn run(a: SweepArgs) -> anyhow::Result<bool> {
    if a.rates.is_empty() || a.rates.iter().any(|r| !(r.is_finite() && *r > 0.0)) {
        bail!("--rates must be positive numbers");
    }
    if a.rates.windows(2).any(|w| w[0] >= w[1]) {
        bail!("--rates must increase");
    }
    if !(a.step_secs.is_finite() && a.step_secs > 0.0) {
        bail!("--step-secs must be positive");
    }
    std::fs::create_dir_all(&a.replay.out)?;
    let mut steps = Vec::new();
    let (mut met, mut predicted) = (Vec::new(), Vec::new());
    let (mut misses, mut all_ok) = (0usize, true);
    let mut simulated_fleet = Value::Null;
    for (i, &rate) in a.rates.iter().enumerate() {
        let dir = format!("rate-{rate}");
        let mut r = a.replay.clone();
        r.rate = Some(rate);
        r.concurrency = None;
        r.duration = Some(a.step_secs);
        r.out = a.replay.out.join(&dir);
        if i > 0 {
            r.check_tokens = 0; // checked on the first step
        }
        println!("== rate {rate}/s for {}s", a.step_secs);
        let res = replay::run(r).await?;
        all_ok &= res.ok;
        let s = &res.summary;
        let ok = meets(s, a.ttft_p90_ms, a.tbt_p90_ms);
        met.push(ok);
        misses = if ok { 0 } else { misses + 1 };
        // The simulator's prediction for the same requests at the same send times.
        let simulated = s["simulated_fleet"].as_object().map(|sim| {
            let sim = Value::Object(sim.clone());
            let meets = predicted_meets(&sim, a.ttft_p90_ms, a.tbt_p90_ms);
            predicted.push(meets);
            if simulated_fleet.is_null() {
                simulated_fleet = json!({
                    "profile": sim["profile"],
                    "instances": sim["instances"],
                    "nodes": sim["nodes"],
                    "routing": sim["routing"],
                });
            }
            json!({
                "ttft_p90_ms": sim["ttft_p90_ms"].as_f64().unwrap_or(0.0),
                "tbt_p90_ms": sim["tbt_p90_ms"].as_f64().unwrap_or(0.0),
                "hit_ratio": sim["token_hit_ratio"],
                "rejected": sim["rejected"],
                "meets": meets,
            })
        });
        steps.push(json!({
            "rate": rate,
            "dir": dir,
            "ok": s["ok"],
            "errors": s["errors"],
            "ttft_p90_ms": s["ttft"]["p90_ms"].as_f64().unwrap_or(0.0),
            "tbt_p90_ms": s["tbt"]["p90_ms"].as_f64().unwrap_or(0.0),
            "hit_ratio": s["hit_ratio"],
            "achieved_rps": s["throughput"]["requests_per_sec"],
            "meets": ok,
            "simulated": simulated,
        }));
        if misses >= a.stop_after_misses {
            break;
        }
    }
    let capacity = capacity(&a.rates, &met);
    let simulated_capacity = if predicted.is_empty() {
        None
    } else {
        self::capacity(&a.rates, &predicted)
    };
    let sweep = json!({
        "kind": "sweep",
        "trace": a.replay.trace.as_ref().map(|t| t.display().to_string())
            .unwrap_or_else(|| format!("workload {:?}", a.replay.workload)),
        "slo": {"ttft_p90_ms": a.ttft_p90_ms, "tbt_p90_ms": a.tbt_p90_ms},
        "step_secs": a.step_secs,
        "steps": steps,
        "capacity_rps": capacity,
        "simulated_fleet": simulated_fleet,
        "simulated_capacity_rps": simulated_capacity,
    });
    std::fs::write(
        a.replay.out.join("sweep.json"),
        serde_json::to_vec_pretty(&sweep)?,
    )?;
    std::fs::write(
        a.replay.out.join("sweep.html"),
        crate::report::sweep_html(&sweep),
    )?;
    match capacity {
        Some(c) => println!(
            "capacity: {c} requests/s (TTFT p90 <= {} ms, TBT p90 <= {} ms, no errors)",
            a.ttft_p90_ms, a.tbt_p90_ms
        ),
        None => println!("capacity: no rate met the SLOs"),
    }
    if !predicted.is_empty() {
        match simulated_capacity {
            Some(c) => println!("simulate-fleet predicted capacity: {c} requests/s"),
            None => println!("simulate-fleet predicted capacity: no rate meets the SLOs"),
        }
    }
    println!("report: {}", a.replay.out.join("sweep.html").display());
    Ok(all_ok)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_meets_the_slos_only_without_errors_and_within_both() {
        let s = |errors: u64, ttft: f64, tbt: f64| json!({"errors": errors, "ok": 10, "ttft": {"p90_ms": ttft}, "tbt": {"count": 5, "p90_ms": tbt}});
        assert!(meets(&s(0, 900.0, 50.0), 1000.0, 60.0));
        assert!(!meets(&s(1, 900.0, 50.0), 1000.0, 60.0));
        assert!(!meets(&s(0, 1100.0, 50.0), 1000.0, 60.0));
        assert!(!meets(&s(0, 900.0, 70.0), 1000.0, 60.0));
    }

    #[test]
    fn a_prediction_meets_the_slos_only_with_nothing_rejected_and_within_both() {
        let p = |rejected: u64, ttft: f64, tbt: f64| json!({"requests": 10, "rejected": rejected, "ttft_p90_ms": ttft, "tbt_p90_ms": tbt});
        assert!(predicted_meets(&p(0, 900.0, 50.0), 1000.0, 60.0));
        assert!(!predicted_meets(&p(1, 900.0, 50.0), 1000.0, 60.0));
        assert!(!predicted_meets(&p(0, 1100.0, 50.0), 1000.0, 60.0));
        assert!(!predicted_meets(&p(0, 900.0, 70.0), 1000.0, 60.0));
        assert!(!predicted_meets(
            &json!({"requests": 0, "rejected": 0}),
            1e9,
            1e9
        ));
    }

    #[test]
    fn capacity_is_the_highest_rate_met_before_a_miss_stands() {
        let r = [1.0, 2.0, 4.0, 8.0];
        assert_eq!(capacity(&r, &[true, true, true, true]), Some(8.0));
        assert_eq!(capacity(&r, &[true, true, false, false]), Some(2.0));
        // A met rate right after a miss does not count; one after that does.
        assert_eq!(capacity(&r, &[true, false, true, true]), Some(8.0));
        assert_eq!(capacity(&r, &[true, false, true, false]), Some(1.0));
        assert_eq!(capacity(&r, &[false, false]), None);
    }
}
