//! What an engine with its own KV connector (vLLM's, `connectors/vllm/`) tells its node about
//! one request: the tokens it did not prefill because its own prefix cache had them, the
//! tokens it loaded from this node, and those it tried to load and had to recompute. The
//! connector sends it (`REPORT` on the fabric wire) before the request's first forward pass,
//! so the gateway beside the node reads it once the first token arrives and bills the cache
//! read that really happened.
//!
//! Bounded: at most [`MAX_REPORTS`] are kept, each for [`REPORT_TTL`]; a report nobody takes
//! (its request was cancelled) ages out.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// Reports kept at once; the oldest goes first.
pub const MAX_REPORTS: usize = 65_536;
/// How long an untaken report is kept.
pub const REPORT_TTL: Duration = Duration::from_secs(600);

/// One request's prefill, as its engine's connector saw it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConnectorReport {
    /// Leading tokens the engine's own (tenant-salted) prefix cache held.
    pub local_tokens: u32,
    /// Tokens after those loaded from the fabric, checksums verified.
    pub loaded_tokens: u32,
    /// Tokens the connector meant to load but could not (missing, corrupt, unreachable):
    /// the engine recomputed them.
    pub failed_tokens: u32,
    /// The load's bytes and how long it took, when the connector measured it (the node's
    /// load rate, which the routing gateway's estimate uses).
    pub load: Option<(u64, Duration)>,
}

impl ConnectorReport {
    /// A REPORT body (`tag:16 local:u32 loaded:u32 failed:u32`, then optionally
    /// `load_bytes:u64 load_micros:u64`): the request's tag and its report, or `None` when
    /// the body is not exactly that.
    pub fn decode(mut f: impl bytes::Buf) -> Option<(u128, ConnectorReport)> {
        if f.remaining() != 28 && f.remaining() != 44 {
            return None;
        }
        let tag = f.get_u128();
        let mut r = ConnectorReport {
            local_tokens: f.get_u32_le(),
            loaded_tokens: f.get_u32_le(),
            failed_tokens: f.get_u32_le(),
            load: None,
        };
        if f.remaining() == 16 {
            let (bytes, micros) = (f.get_u64_le(), f.get_u64_le());
            r.load = (bytes > 0 && micros > 0).then(|| (bytes, Duration::from_micros(micros)));
        }
        Some((tag, r))
    }

    /// Prompt tokens the engine did not prefill.
    pub fn cached_tokens(&self) -> usize {
        (self.local_tokens + self.loaded_tokens) as usize
    }
}

/// Reports by request tag.
#[derive(Default)]
pub struct Reports {
    inner: Mutex<Inner>,
    arrived: tokio::sync::Notify,
}

#[derive(Default)]
struct Inner {
    by_tag: HashMap<u128, (ConnectorReport, Instant)>,
    order: VecDeque<(u128, Instant)>,
    /// The engines' load rate, bytes per second (a moving average).
    load_rate: Option<f64>,
}

impl Reports {
    pub fn put(&self, tag: u128, report: ConnectorReport) {
        let now = Instant::now();
        {
            let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            while let Some(&(t, at)) = g.order.front() {
                if g.order.len() < MAX_REPORTS && now.duration_since(at) < REPORT_TTL {
                    break;
                }
                g.order.pop_front();
                if g.by_tag.get(&t).is_some_and(|(_, a)| *a == at) {
                    g.by_tag.remove(&t);
                }
            }
            if let Some((bytes, took)) = report.load {
                let rate = bytes as f64 / took.as_secs_f64().max(1e-6);
                // An exponential moving average with weight 1/8 for the newest load.
                g.load_rate = Some(g.load_rate.map_or(rate, |r| r + (rate - r) / 8.0));
            }
            g.by_tag.insert(tag, (report, now));
            g.order.push_back((tag, now));
        }
        self.arrived.notify_waiters();
    }

    /// The report for `tag`, removed; `None` if none arrived.
    pub fn take(&self, tag: u128) -> Option<ConnectorReport> {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        g.by_tag.remove(&tag).map(|(r, _)| r)
    }

    /// The report for `tag`, waiting up to `wait` for it to arrive.
    pub async fn take_within(&self, tag: u128, wait: Duration) -> Option<ConnectorReport> {
        let deadline = Instant::now() + wait;
        loop {
            let arrived = self.arrived.notified();
            if let Some(r) = self.take(tag) {
                return Some(r);
            }
            if tokio::time::timeout_at(deadline, arrived).await.is_err() {
                return self.take(tag);
            }
        }
    }

    /// Bytes per second the engines' connectors measured loading from this node; `None`
    /// until one has.
    pub fn load_bytes_per_sec(&self) -> Option<f64> {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .load_rate
    }

    pub fn len(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .by_tag
            .len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn taken_once() {
        let r = Reports::default();
        let rep = ConnectorReport {
            local_tokens: 32,
            loaded_tokens: 96,
            failed_tokens: 0,
            load: None,
        };
        r.put(7, rep);
        assert_eq!(r.take(8), None);
        assert_eq!(r.take(7), Some(rep));
        assert_eq!(r.take(7), None);
        assert_eq!(rep.cached_tokens(), 128);
    }

    #[test]
    fn measured_loads_make_the_nodes_load_rate() {
        use bytes::BufMut;
        let r = Reports::default();
        assert_eq!(r.load_bytes_per_sec(), None);
        let body = |bytes: u64, micros: u64| {
            let mut b = bytes::BytesMut::new();
            b.put_u128(9);
            b.put_u32_le(0);
            b.put_u32_le(256);
            b.put_u32_le(0);
            b.put_u64_le(bytes);
            b.put_u64_le(micros);
            b.freeze()
        };
        let (tag, rep) = ConnectorReport::decode(body(2_000_000, 1000)).unwrap();
        assert_eq!(
            (tag, rep.load),
            (9, Some((2_000_000, Duration::from_millis(1))))
        );
        r.put(tag, rep);
        assert_eq!(r.load_bytes_per_sec(), Some(2e9));
        r.put(
            10,
            ConnectorReport::decode(body(1_000_000, 1000)).unwrap().1,
        );
        assert_eq!(
            r.load_bytes_per_sec(),
            Some(2e9 - 1e9 / 8.0),
            "a moving average"
        );
        assert!(
            ConnectorReport::decode(body(0, 0))
                .unwrap()
                .1
                .load
                .is_none()
        );
        assert!(ConnectorReport::decode(&b"short"[..]).is_none());
    }

    #[test]
    fn bounded() {
        let r = Reports::default();
        for t in 0..(MAX_REPORTS as u128 + 10) {
            r.put(t, ConnectorReport::default());
        }
        assert!(r.len() <= MAX_REPORTS);
        assert_eq!(r.take(0), None, "the oldest went first");
        assert!(r.take(MAX_REPORTS as u128 + 9).is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn waits_for_a_late_report() {
        let r = std::sync::Arc::new(Reports::default());
        let r2 = r.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            r2.put(
                3,
                ConnectorReport {
                    local_tokens: 0,
                    loaded_tokens: 64,
                    failed_tokens: 0,
                    load: None,
                },
            );
        });
        let got = r.take_within(3, Duration::from_secs(1)).await;
        assert_eq!(got.map(|g| g.loaded_tokens), Some(64));
        assert_eq!(r.take_within(4, Duration::from_millis(50)).await, None);
    }
}
