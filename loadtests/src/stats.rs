//! What a run measured, in bounded memory: latency histograms (HDR, 3 significant digits),
//! one bucket per second (with a coarse TTFT histogram, for TTFT over time), one row per
//! tenant and per node, and the error messages by kind (a few distinct ones each). Fed one
//! finished request at a time.

use std::collections::BTreeMap;

use billing::money::{Exact, Rates, TokenClass};
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::client::Usage;

/// One request, as written to `requests.jsonl`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RequestRecord {
    /// Line of the trace (0-based among its records).
    pub index: u64,
    pub tenant: usize,
    pub session: u64,
    /// When the schedule said to send it, and when it went, ms from the run's start.
    pub scheduled_ms: f64,
    pub sent_ms: f64,
    pub status: u16,
    pub error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_message: Option<String>,
    pub ttft_ms: Option<f64>,
    pub e2e_ms: f64,
    pub tbt: Option<GapSummary>,
    pub node: Option<String>,
    /// For a stream resumed on another node after its first one failed, that first node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed_from: Option<String>,
    /// Why the cluster gateway chose that node (its `x-cachet-route`: the estimate's parts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route: Option<String>,
    pub request_id: Option<String>,
    pub stop_reason: Option<String>,
    /// The prompt's tokens by the trace (before the chat template).
    pub trace_input_tokens: u64,
    pub max_tokens: u64,
    pub usage: Usage,
}

/// Inter-token gaps of one answer.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct GapSummary {
    pub count: usize,
    pub mean_ms: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

impl GapSummary {
    pub fn of(gaps: &mut [f64]) -> Option<Self> {
        if gaps.is_empty() {
            return None;
        }
        gaps.sort_by(f64::total_cmp);
        let at = |p: f64| gaps[((gaps.len() - 1) as f64 * p).round() as usize];
        Some(Self {
            count: gaps.len(),
            mean_ms: gaps.iter().sum::<f64>() / gaps.len() as f64,
            p50_ms: at(0.5),
            p99_ms: at(0.99),
            max_ms: gaps[gaps.len() - 1],
        })
    }
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Bucket {
    pub sent: u64,
    pub done: u64,
    pub errors: u64,
    pub prompt_tokens: u64,
    pub read_tokens: u64,
    pub output_tokens: u64,
    /// TTFTs of the requests answered in this second.
    #[serde(skip)]
    pub ttft: LogHist,
}

/// A coarse latency histogram (buckets 25% apart from 0.05 ms up, 256 bytes): enough for a
/// per-second p50 and p99 at any run length.
#[derive(Clone, Debug, Default)]
pub struct LogHist {
    counts: Vec<u32>,
    n: u64,
}

const LOG_BUCKETS: usize = 64;
const LOG_BASE_MS: f64 = 0.05;
const LOG_FACTOR: f64 = 1.25;

impl LogHist {
    pub fn record(&mut self, ms: f64) {
        if self.counts.is_empty() {
            self.counts = vec![0; LOG_BUCKETS];
        }
        let i = if ms <= LOG_BASE_MS {
            0
        } else {
            ((ms / LOG_BASE_MS).ln() / LOG_FACTOR.ln()).ceil() as usize
        };
        self.counts[i.min(LOG_BUCKETS - 1)] += 1;
        self.n += 1;
    }

    /// The upper bound of the bucket holding quantile `q`, or `None` when empty.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.n == 0 {
            return None;
        }
        let rank = ((self.n as f64 * q).ceil() as u64).max(1);
        let mut seen = 0u64;
        for (i, c) in self.counts.iter().enumerate() {
            seen += u64::from(*c);
            if seen >= rank {
                return Some(LOG_BASE_MS * LOG_FACTOR.powi(i as i32));
            }
        }
        None
    }
}

/// One node's share of a cluster run (by the `x-cachet-node` that answered).
#[derive(Clone, Debug)]
pub struct NodeRow {
    pub requests: u64,
    pub errors: u64,
    pub usage: Usage,
    pub ttft_us: Histogram<u64>,
}

/// Distinct messages kept per error kind; the rest are counted together.
const MESSAGES_PER_KIND: usize = 8;
/// Characters kept of one error message.
const MESSAGE_CHARS: usize = 240;
/// The label the messages past the first few of a kind are counted under.
pub const OTHER_MESSAGES: &str = "(other messages)";

#[derive(Clone, Debug, Default, Serialize)]
pub struct TenantRow {
    pub requests: u64,
    pub errors: u64,
    pub usage: Usage,
}

impl TenantRow {
    pub fn hit_ratio(&self) -> f64 {
        ratio(self.usage.cache_read_tokens, self.usage.prompt())
    }
}

pub fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

/// The run so far.
pub struct Stats {
    pub ttft_us: Histogram<u64>,
    pub tbt_us: Histogram<u64>,
    pub e2e_us: Histogram<u64>,
    pub buckets: Vec<Bucket>,
    pub tenants: Vec<TenantRow>,
    pub totals: Usage,
    pub done: u64,
    pub ok: u64,
    pub errors: BTreeMap<String, u64>,
    /// Per error kind, its messages (the first few distinct ones) and their counts.
    pub error_messages: BTreeMap<String, BTreeMap<String, u64>>,
    /// Errors per second of the run, by kind (for the plot).
    pub error_series: BTreeMap<String, Vec<u64>>,
    /// Per node that answered (requests without a node header are not counted here).
    pub nodes: BTreeMap<String, NodeRow>,
    pub max_lag_ms: f64,
    pub statuses: BTreeMap<u16, u64>,
}

fn hist() -> Histogram<u64> {
    Histogram::new(3).expect("3 significant digits is valid")
}

impl Stats {
    pub fn new(tenants: usize) -> Self {
        Self {
            ttft_us: hist(),
            tbt_us: hist(),
            e2e_us: hist(),
            buckets: Vec::new(),
            tenants: vec![TenantRow::default(); tenants],
            totals: Usage::default(),
            done: 0,
            ok: 0,
            errors: BTreeMap::new(),
            error_messages: BTreeMap::new(),
            error_series: BTreeMap::new(),
            nodes: BTreeMap::new(),
            max_lag_ms: 0.0,
            statuses: BTreeMap::new(),
        }
    }

    fn bucket(&mut self, ms: f64) -> &mut Bucket {
        let s = (ms.max(0.0) / 1000.0) as usize;
        if self.buckets.len() <= s {
            self.buckets.resize(s + 1, Bucket::default());
        }
        &mut self.buckets[s]
    }

    /// Add a finished request (with its inter-token gaps, which the record only summarizes).
    pub fn add(&mut self, r: &RequestRecord, gaps_ms: &[f64]) {
        self.done += 1;
        self.max_lag_ms = self.max_lag_ms.max(r.sent_ms - r.scheduled_ms);
        *self.statuses.entry(r.status).or_default() += 1;
        self.bucket(r.sent_ms).sent += 1;
        let end = r.sent_ms + r.e2e_ms;
        let node = r.node.as_ref().map(|n| {
            self.nodes.entry(n.clone()).or_insert_with(|| NodeRow {
                requests: 0,
                errors: 0,
                usage: Usage::default(),
                ttft_us: hist(),
            })
        });
        if let Some(n) = node {
            n.requests += 1;
            if r.error.is_some() {
                n.errors += 1;
            } else {
                add_usage(&mut n.usage, &r.usage);
                if let Some(t) = r.ttft_ms {
                    let _ = n.ttft_us.record((t * 1000.0) as u64);
                }
            }
        }
        let t = &mut self.tenants[r.tenant];
        t.requests += 1;
        if let Some(e) = &r.error {
            t.errors += 1;
            *self.errors.entry(e.clone()).or_default() += 1;
            let messages = self.error_messages.entry(e.clone()).or_default();
            let m: String = r
                .error_message
                .as_deref()
                .unwrap_or("(no message)")
                .chars()
                .take(MESSAGE_CHARS)
                .collect();
            let key = if messages.contains_key(&m) || messages.len() < MESSAGES_PER_KIND {
                m
            } else {
                OTHER_MESSAGES.to_string()
            };
            *messages.entry(key).or_default() += 1;
            let sec = (end / 1000.0) as usize;
            let series = self.error_series.entry(e.clone()).or_default();
            if series.len() <= sec {
                series.resize(sec + 1, 0);
            }
            series[sec] += 1;
            self.bucket(end).errors += 1;
            return;
        }
        self.ok += 1;
        add_usage(&mut t.usage, &r.usage);
        add_usage(&mut self.totals, &r.usage);
        let b = self.bucket(end);
        b.done += 1;
        b.prompt_tokens += r.usage.prompt();
        b.read_tokens += r.usage.cache_read_tokens;
        b.output_tokens += r.usage.output_tokens;
        if let Some(t) = r.ttft_ms {
            b.ttft.record(t);
            let _ = self.ttft_us.record((t * 1000.0) as u64);
        }
        let _ = self.e2e_us.record((r.e2e_ms * 1000.0) as u64);
        for g in gaps_ms {
            let _ = self.tbt_us.record((g * 1000.0) as u64);
        }
    }

    pub fn hit_ratio(&self) -> f64 {
        ratio(self.totals.cache_read_tokens, self.totals.prompt())
    }

    pub fn error_count(&self) -> u64 {
        self.done - self.ok
    }
}

fn add_usage(a: &mut Usage, b: &Usage) {
    a.input_tokens += b.input_tokens;
    a.cache_write_5m_tokens += b.cache_write_5m_tokens;
    a.cache_write_1h_tokens += b.cache_write_1h_tokens;
    a.cache_read_tokens += b.cache_read_tokens;
    a.output_tokens += b.output_tokens;
}

/// Percentiles and a CDF (101 points) of a histogram, in ms.
pub fn latency(h: &Histogram<u64>) -> Value {
    let ms = |us: u64| us as f64 / 1000.0;
    if h.is_empty() {
        return json!({"count": 0});
    }
    let cdf: Vec<[f64; 2]> = (0..=100)
        .map(|i| {
            let q = i as f64 / 100.0;
            [ms(h.value_at_quantile(q)), q]
        })
        .collect();
    json!({
        "count": h.len(),
        "mean_ms": h.mean() / 1000.0,
        "p50_ms": ms(h.value_at_quantile(0.5)),
        "p90_ms": ms(h.value_at_quantile(0.9)),
        "p99_ms": ms(h.value_at_quantile(0.99)),
        "max_ms": ms(h.max()),
        "cdf": cdf,
    })
}

/// What a run's tokens cost at `rates`, with caching as it happened and without any (every
/// prompt token plain input), in nano-units of the price book's currency.
pub fn cost(u: &Usage, rates: &Rates) -> (i128, i128) {
    let at = |n: u64, c: TokenClass| Exact::usage(n as i64, rates, c, 0).0;
    let with = at(u.input_tokens, TokenClass::Input)
        + at(u.cache_write_5m_tokens, TokenClass::CacheWrite5m)
        + at(u.cache_write_1h_tokens, TokenClass::CacheWrite1h)
        + at(u.cache_read_tokens, TokenClass::CacheRead)
        + at(u.output_tokens, TokenClass::Output);
    let without = at(u.prompt(), TokenClass::Input) + at(u.output_tokens, TokenClass::Output);
    let nanos = 1_000_000_000i128;
    (with / nanos, without / nanos)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(tenant: usize, sent: f64, err: Option<&str>, read: u64) -> RequestRecord {
        RequestRecord {
            index: 0,
            tenant,
            session: 0,
            scheduled_ms: sent - 2.0,
            sent_ms: sent,
            status: if err.is_some() { 529 } else { 200 },
            error: err.map(str::to_string),
            error_message: err.map(|_| "Overloaded: why".to_string()),
            ttft_ms: Some(40.0),
            e2e_ms: 500.0,
            tbt: None,
            node: None,
            resumed_from: None,
            route: None,
            request_id: None,
            stop_reason: None,
            trace_input_tokens: 1000,
            max_tokens: 10,
            usage: Usage {
                input_tokens: 1000 - read,
                cache_read_tokens: read,
                output_tokens: 10,
                ..Default::default()
            },
        }
    }

    #[test]
    fn totals_tenants_buckets_and_errors_add_up() {
        let mut s = Stats::new(2);
        s.add(&rec(0, 100.0, None, 0), &[10.0, 12.0]);
        s.add(&rec(1, 1_200.0, None, 800), &[11.0]);
        s.add(&rec(1, 1_300.0, Some("529 overloaded_error"), 0), &[]);
        assert_eq!((s.done, s.ok, s.error_count()), (3, 2, 1));
        assert!((s.hit_ratio() - 0.4).abs() < 1e-9);
        assert_eq!(s.tenants[1].errors, 1);
        assert!((s.tenants[1].hit_ratio() - 0.8).abs() < 1e-9);
        assert_eq!(s.buckets[0].done, 1);
        assert_eq!(s.buckets[1].sent, 2);
        assert_eq!(s.error_series["529 overloaded_error"], vec![0, 1]);
        assert_eq!(
            s.error_messages["529 overloaded_error"]["Overloaded: why"], 1,
            "the message is kept with its kind"
        );
        assert_eq!(
            s.buckets[0].ttft.quantile(0.99).map(|v| v.round()),
            Some(40.0)
        );
        assert_eq!(s.tbt_us.len(), 3);
        assert!((s.max_lag_ms - 2.0).abs() < 1e-9);
        let l = latency(&s.ttft_us);
        assert!((l["p50_ms"].as_f64().unwrap() - 40.0).abs() < 0.1, "{l}");
        assert_eq!(l["cdf"].as_array().unwrap().len(), 101);
    }

    #[test]
    fn nodes_and_messages_stay_bounded_and_per_node() {
        let mut s = Stats::new(1);
        for i in 0..100 {
            let mut r = rec(0, 10.0 * i as f64, Some("529 overloaded_error"), 0);
            r.error_message = Some(format!("Overloaded: estimate {i} ms"));
            r.node = Some(format!("n{}", i % 2));
            s.add(&r, &[]);
        }
        let msgs = &s.error_messages["529 overloaded_error"];
        assert_eq!(msgs.len(), MESSAGES_PER_KIND + 1);
        assert_eq!(msgs[OTHER_MESSAGES], 100 - MESSAGES_PER_KIND as u64);
        assert_eq!(s.nodes.len(), 2);
        assert_eq!(s.nodes["n1"].errors, 50);
        let mut h = LogHist::default();
        for ms in [1.0, 2.0, 3.0, 1000.0] {
            h.record(ms);
        }
        // Buckets are 25% wide: quantiles land within that of the value.
        let p50 = h.quantile(0.5).unwrap();
        assert!((2.0..2.5).contains(&p50), "{p50}");
        let p99 = h.quantile(0.99).unwrap();
        assert!((1000.0..1250.0).contains(&p99), "{p99}");
    }

    #[test]
    fn caching_costs_less_when_reads_outweigh_writes() {
        let rates = Rates::standard(3_000, 15_000);
        let u = Usage {
            input_tokens: 100,
            cache_write_5m_tokens: 1_000,
            cache_write_1h_tokens: 0,
            cache_read_tokens: 9_000,
            output_tokens: 10,
        };
        let (with, without) = cost(&u, &rates);
        // 100·3000 + 1000·3750 + 9000·300 + 10·15000 = 6,900,000 nanos.
        assert_eq!(with, 6_900_000);
        assert_eq!(without, 10_100 * 3_000 + 150_000);
        assert_eq!(GapSummary::of(&mut [3.0, 1.0, 2.0]).unwrap().p50_ms, 2.0);
    }
}
