//! In-flight coalescing: a request whose next uncached blocks are being prefilled by another
//! request waits for that prefill's cache write and reads it, instead of computing the same
//! blocks again (and paying a second cache write).
//!
//! A request that misses claims the chain links it is about to compute. Claims are keyed by
//! block hash, and block hashes carry the scope (tenant, workspace), so only requests of the
//! same scope ever meet here. Whoever finds the first link it needs already claimed follows
//! that flight: it waits, bounded, until the leader has written its entries, then reads the
//! prefix again. The wait ends early when the leader fails, is refused or is cancelled (its
//! claim is dropped), and at a deadline derived from the leader's prefill estimate; either way
//! the follower then computes for itself. Nothing waits forever.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cache_fabric::ChainLink;
use cachet_common::BlockHash;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::metrics;

/// Prefill time per token assumed before any prefill of the model was measured: generous (a
/// CPU model on a busy 2-core machine measures ~6 ms), because a deadline that is too short
/// turns a burst into as many prefills as requests, all competing for the same cores; a leader
/// that fails releases its followers at once anyway, so only a hung one costs the full wait.
const DEFAULT_PREFILL_PER_TOKEN: Duration = Duration::from_millis(10);
/// Added to every deadline: scheduling, the fabric write, the follower's own read.
const DEADLINE_SLACK: Duration = Duration::from_millis(500);

/// How a flight ended, as its followers see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Landing {
    /// Still prefilling.
    Flying,
    /// Its entries are written: read them.
    Written,
    /// It failed, was refused or cancelled: compute for yourself.
    Aborted,
}

struct Flight {
    landing: watch::Sender<Landing>,
    started: Instant,
    /// How long its prefill is expected to take.
    estimate: Duration,
}

#[derive(Default)]
struct Registry {
    flights: HashMap<BlockHash, Arc<Flight>>,
    /// Observed prefill time per token, per model (an exponential moving average).
    per_token: HashMap<String, Duration>,
}

fn tokens_per_sec(per_token: Duration) -> f64 {
    1.0 / per_token.as_secs_f64().max(1e-9)
}

/// The in-flight prefills of one serving process.
#[derive(Clone, Default)]
pub struct Inflight {
    inner: Arc<Mutex<Registry>>,
}

/// What a request should do about its uncached blocks.
pub enum Claim {
    /// Compute them; followers wait on this guard until it is finished or dropped.
    Lead(Leader),
    /// Another request is computing the first of them: wait on this.
    Follow(Follower),
    /// Nothing to compute.
    None,
}

/// A claim on chain links; dropping it unfinished releases the followers to compute.
pub struct Leader {
    registry: Inflight,
    hashes: Vec<BlockHash>,
    flight: Arc<Flight>,
}

pub struct Follower {
    landing: watch::Receiver<Landing>,
    deadline: Instant,
}

impl Inflight {
    /// Expected prefill time of `tokens` uncached tokens of `model`.
    fn estimate(reg: &Registry, model: &str, tokens: usize) -> Duration {
        let per = reg
            .per_token
            .get(model)
            .copied()
            .unwrap_or(DEFAULT_PREFILL_PER_TOKEN);
        per.saturating_mul(tokens.min(u32::MAX as usize) as u32)
    }

    /// Claim `links` (the links this request would compute, in chain order), or follow the
    /// flight already computing the first of them.
    pub fn claim(&self, model: &str, links: &[ChainLink], uncached_tokens: usize) -> Claim {
        let Some(first) = links.first() else {
            return Claim::None;
        };
        let mut reg = self
            .inner
            .lock()
            .expect("the registry lock is never poisoned");
        if let Some(f) = reg.flights.get(&first.hash) {
            // Twice the estimate from the leader's start: a slow prefill still lands in time,
            // a stuck one costs its followers at most that.
            let deadline = f.started + f.estimate.saturating_mul(2) + DEADLINE_SLACK;
            return Claim::Follow(Follower {
                landing: f.landing.subscribe(),
                deadline,
            });
        }
        let (landing, _) = watch::channel(Landing::Flying);
        let flight = Arc::new(Flight {
            landing,
            started: Instant::now(),
            estimate: Self::estimate(&reg, model, uncached_tokens),
        });
        let mut hashes = Vec::with_capacity(links.len());
        for l in links {
            // A link another flight already computes stays theirs (a longer prompt sharing
            // a shorter one's tail blocks still computes them itself).
            if let std::collections::hash_map::Entry::Vacant(v) = reg.flights.entry(l.hash) {
                v.insert(flight.clone());
                hashes.push(l.hash);
            }
        }
        drop(reg);
        Claim::Lead(Leader {
            registry: self.clone(),
            hashes,
            flight,
        })
    }

    /// Record a measured prefill (`tokens` computed in `took`) of `model`.
    pub fn observe(&self, model: &str, tokens: usize, took: Duration) {
        if tokens < 64 {
            return; // too short to say anything about the per-token cost
        }
        let sample = took / tokens as u32;
        let mut reg = self
            .inner
            .lock()
            .expect("the registry lock is never poisoned");
        let e = reg.per_token.entry(model.to_string()).or_insert(sample);
        *e = (*e * 3 + sample) / 4;
        metrics::PREFILL_RATE
            .with_label_values(&[model])
            .set(tokens_per_sec(*e));
    }

    /// The measured prefill rate of every model that has prefilled here (tokens per second,
    /// the moving average above): what a cluster node announces to routing gateways.
    pub fn prefill_tokens_per_sec(&self) -> std::collections::BTreeMap<String, f64> {
        let reg = self
            .inner
            .lock()
            .expect("the registry lock is never poisoned");
        reg.per_token
            .iter()
            .map(|(m, per)| (m.clone(), tokens_per_sec(*per)))
            .collect()
    }

    /// Whether no claim is held (a landed or dropped flight leaves none).
    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.inner
            .lock()
            .expect("the registry lock is never poisoned")
            .flights
            .is_empty()
    }
}

impl Leader {
    /// The entries are written (or the write was attempted): followers read now.
    pub fn land(self) {
        let _ = self.flight.landing.send(Landing::Written);
        // Drop removes the claims.
    }
}

impl Drop for Leader {
    fn drop(&mut self) {
        if *self.flight.landing.borrow() == Landing::Flying {
            let _ = self.flight.landing.send(Landing::Aborted);
        }
        let mut reg = self
            .registry
            .inner
            .lock()
            .expect("the registry lock is never poisoned");
        for h in &self.hashes {
            if reg
                .flights
                .get(h)
                .is_some_and(|f| Arc::ptr_eq(f, &self.flight))
            {
                reg.flights.remove(h);
            }
        }
    }
}

/// How a follower's wait ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Waited {
    /// The leader wrote: read again.
    Landed,
    /// The leader gave up: compute.
    Aborted,
    /// The deadline passed: compute.
    TimedOut,
}

impl Waited {
    pub fn as_str(self) -> &'static str {
        match self {
            Waited::Landed => "landed",
            Waited::Aborted => "leader_aborted",
            Waited::TimedOut => "timed_out",
        }
    }
}

impl Follower {
    pub async fn wait(mut self) -> Waited {
        let outcome = tokio::time::timeout_at(self.deadline, async {
            loop {
                match *self.landing.borrow_and_update() {
                    Landing::Written => return Waited::Landed,
                    Landing::Aborted => return Waited::Aborted,
                    Landing::Flying => {}
                }
                if self.landing.changed().await.is_err() {
                    // The leader's flight is gone without a landing.
                    return Waited::Aborted;
                }
            }
        })
        .await
        .unwrap_or(Waited::TimedOut);
        metrics::COALESCED
            .with_label_values(&[outcome.as_str()])
            .inc();
        outcome
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn links(ids: &[u8]) -> Vec<ChainLink> {
        ids.iter()
            .enumerate()
            .map(|(i, &b)| ChainLink {
                hash: BlockHash([b; 32]),
                parent: None,
                start: i * 16,
                end: (i + 1) * 16,
            })
            .collect()
    }

    #[tokio::test]
    async fn the_first_leads_the_rest_follow_and_read_when_it_lands() {
        let inf = Inflight::default();
        let Claim::Lead(leader) = inf.claim("m", &links(&[1, 2, 3]), 48) else {
            panic!("the first claim leads");
        };
        let followers: Vec<_> = (0..15)
            .map(|_| match inf.claim("m", &links(&[1, 2, 3]), 48) {
                Claim::Follow(f) => tokio::spawn(f.wait()),
                _ => panic!("later claims follow"),
            })
            .collect();
        leader.land();
        for f in followers {
            assert_eq!(f.await.unwrap(), Waited::Landed);
        }
        assert!(inf.is_empty(), "a landed flight leaves no claims");
    }

    #[tokio::test]
    async fn a_leader_dropped_unfinished_releases_its_followers_at_once() {
        let inf = Inflight::default();
        let leader = inf.claim("m", &links(&[7]), 5_000_000);
        let Claim::Follow(f) = inf.claim("m", &links(&[7]), 16) else {
            panic!()
        };
        let waiting = tokio::spawn(f.wait());
        drop(leader);
        assert_eq!(waiting.await.unwrap(), Waited::Aborted);
        // The next request leads again.
        assert!(matches!(inf.claim("m", &links(&[7]), 16), Claim::Lead(_)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_stuck_leader_costs_its_followers_twice_its_estimate() {
        let inf = Inflight::default();
        inf.observe("m", 1000, Duration::from_millis(100)); // 100 µs a token
        let _leader = inf.claim("m", &links(&[9]), 1000); // 100 ms expected
        let Claim::Follow(f) = inf.claim("m", &links(&[9]), 1000) else {
            panic!()
        };
        let t = Instant::now();
        assert_eq!(f.wait().await, Waited::TimedOut);
        let waited = t.elapsed();
        assert!(
            waited >= Duration::from_millis(700) && waited < Duration::from_millis(800),
            "{waited:?}"
        );
    }

    #[tokio::test]
    async fn different_first_links_never_meet_and_shared_tails_stay_with_their_leader() {
        let inf = Inflight::default();
        let a = inf.claim("m", &links(&[1, 2]), 32);
        // Another scope's blocks hash differently: a different first link leads on its own.
        assert!(matches!(
            inf.claim("m", &links(&[3, 2]), 32),
            Claim::Lead(_)
        ));
        drop(a);
        assert!(matches!(inf.claim("m", &[], 0), Claim::None));
    }
}
