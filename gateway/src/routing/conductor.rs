//! The conductor: which node should serve a request, or none (529) when no node can start
//! answering within the time-to-first-token SLO.
//!
//! For each live node it estimates the time to first token as
//!
//! ```text
//! prefill(tokens cached nowhere it can reach)
//!   + load(fabric tokens on the node itself) / its load rate
//!   + transfer(fabric tokens only its peers hold) / its pull bandwidth
//!   + queue delay (requests in flight to it × its recent service time)
//! ```
//!
//! where the leading tokens already in the node's engine's own KV cache (vLLM's prefix
//! cache, from the KV event stream) cost nothing at all, from the gateway's prefix index
//! (which blocks are cached, and where), its engine-cache view and its own count of
//! requests in flight per node. [`Estimate`] keeps the parts: the answer names them
//! (`x-cachet-route`). Nodes are tried cheapest first; ties go to the node with
//! fewer requests in flight, then round-robin, so an idle cluster spreads load.
//!
//! The rates are learned, not configured: each node announces the prefill rate its engines
//! measured per model and the bandwidth its peer pulls measured ([`Candidate`] carries
//! them); until a node has measured, the model's profile and the configured bandwidth stand
//! in. Early rejection answers overload: a node with nothing in flight is never refused on
//! its estimate (a long prompt on an idle node is slow, not an overload, and refusing it
//! would relieve nothing).

use std::time::Duration;

/// What the estimate needs to know about the cluster.
#[derive(Clone, Copy, Debug)]
pub struct CostModel {
    pub ttft_slo: Duration,
}

/// One request, as the index sees it.
#[derive(Clone, Copy, Debug)]
pub struct Demand {
    pub prompt_tokens: usize,
    /// Leading tokens cached somewhere in the cluster.
    pub cached_tokens: usize,
    pub bytes_per_token: usize,
}

/// One node that could serve it.
#[derive(Clone, Debug)]
pub struct Candidate {
    pub id: String,
    /// Of the cached prefix, tokens this node's fabric store holds itself.
    pub local_tokens: usize,
    /// Leading tokens of the prompt in the KV cache of this node's engine (no load needed).
    pub engine_tokens: usize,
    pub in_flight: usize,
    /// Recent time to serve one request there (moving average).
    pub service_time: Duration,
    /// Prefill time per uncached token of this request's model there.
    pub prefill_per_token: Duration,
    /// Bandwidth at which it pulls blocks it lacks from its peers.
    pub transfer_bytes_per_sec: f64,
    /// Rate at which its engine loads blocks from its own fabric store.
    pub load_bytes_per_sec: f64,
}

/// What serving a request on one node would take, by part.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Estimate {
    /// Leading tokens in the node's engine cache.
    pub engine_tokens: usize,
    /// Tokens loaded from the node's own fabric store.
    pub local_tokens: usize,
    /// Tokens pulled from its peers.
    pub remote_tokens: usize,
    /// Tokens to prefill.
    pub compute_tokens: usize,
    /// The request's own work there (prefill, load and transfer).
    pub work: Duration,
    /// The wait behind what is in flight there.
    pub queue: Duration,
}

impl Estimate {
    pub fn total(&self) -> Duration {
        self.work + self.queue
    }

    /// The estimate as the `x-cachet-route` header says it.
    pub fn reason(&self) -> String {
        format!(
            "engine_cache={} fabric_local={} fabric_remote={} compute={} queue_ms={} estimate_ms={}",
            self.engine_tokens,
            self.local_tokens,
            self.remote_tokens,
            self.compute_tokens,
            self.queue.as_millis(),
            self.total().as_millis()
        )
    }
}

/// Why no node was chosen.
#[derive(Clone, Debug, PartialEq)]
pub enum Refusal {
    NoNodes,
    /// The best estimate, over the SLO, on a node with requests in flight.
    OverSlo {
        best: Duration,
        /// Of it, the wait behind the requests in flight there.
        queue: Duration,
    },
}

impl CostModel {
    /// Estimated time to first token on `c`.
    pub fn estimate(&self, d: &Demand, c: &Candidate) -> Duration {
        Self::parts(d, c).total()
    }

    /// The estimate by part: the leading tokens the engine has need nothing; the rest of
    /// the cached prefix is loaded from the node's own store or pulled from its peers; what
    /// is cached nowhere is prefilled; then the wait behind what is in flight.
    pub fn parts(d: &Demand, c: &Candidate) -> Estimate {
        let engine = c.engine_tokens.min(d.prompt_tokens);
        let cached = d.cached_tokens.max(engine).min(d.prompt_tokens);
        let loaded = cached - engine;
        let remote = d.cached_tokens.saturating_sub(c.local_tokens).min(loaded);
        let local = loaded - remote;
        let compute = d.prompt_tokens - cached;
        let secs = |tokens: usize, rate: f64| {
            Duration::from_secs_f64((tokens * d.bytes_per_token) as f64 / rate.max(1.0))
        };
        Estimate {
            engine_tokens: engine,
            local_tokens: local,
            remote_tokens: remote,
            compute_tokens: compute,
            work: c.prefill_per_token.mul_f64(compute as f64)
                + secs(local, c.load_bytes_per_sec)
                + secs(remote, c.transfer_bytes_per_sec),
            queue: c.service_time.mul_f64(c.in_flight as f64),
        }
    }

    /// Candidates' indexes in the order to try them (best first), or why none qualifies.
    /// `turn` breaks exact ties round-robin.
    pub fn rank(
        &self,
        d: &Demand,
        candidates: &[Candidate],
        turn: usize,
    ) -> Result<Vec<(usize, Duration)>, Refusal> {
        if candidates.is_empty() {
            return Err(Refusal::NoNodes);
        }
        let n = candidates.len();
        let mut ranked: Vec<(usize, Duration)> = candidates
            .iter()
            .enumerate()
            .map(|(i, c)| (i, self.estimate(d, c)))
            .collect();
        ranked.sort_by_key(|&(i, cost)| (cost, candidates[i].in_flight, (i + n - turn % n) % n));
        let (best_i, best) = ranked[0];
        if best > self.ttft_slo {
            // Only waiting can be refused: an idle node takes the request whatever it costs.
            if let Some(&(i, _)) = ranked.iter().find(|(i, _)| candidates[*i].in_flight == 0) {
                let pos = ranked.iter().position(|(j, _)| *j == i).unwrap_or(0);
                let idle = ranked.remove(pos);
                ranked.insert(0, idle);
                return Ok(ranked);
            }
            let queue = Self::parts(d, &candidates[best_i]).queue;
            return Err(Refusal::OverSlo { best, queue });
        }
        Ok(ranked)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(slo_ms: u64) -> CostModel {
        CostModel {
            ttft_slo: Duration::from_millis(slo_ms),
        }
    }

    fn node(id: &str, local: usize, in_flight: usize) -> Candidate {
        Candidate {
            id: id.into(),
            local_tokens: local,
            engine_tokens: 0,
            in_flight,
            service_time: Duration::from_millis(100),
            prefill_per_token: Duration::from_millis(2),
            transfer_bytes_per_sec: 1e6,
            // Loads from the node's own store: 10× its pulls.
            load_bytes_per_sec: 1e7,
        }
    }

    const D: Demand = Demand {
        prompt_tokens: 1000,
        cached_tokens: 800,
        bytes_per_token: 1000,
    };

    #[test]
    fn the_node_holding_the_prefix_wins_when_idle() {
        let m = model(10_000);
        // 200 uncached tokens: 400 ms of prefill everywhere; A loads its own 800 KB (80 ms at
        // 10 MB/s), B lacks them (0.8 s at 1 MB/s).
        assert_eq!(
            m.estimate(&D, &node("a", 800, 0)),
            Duration::from_millis(480)
        );
        assert_eq!(
            m.estimate(&D, &node("b", 0, 0)),
            Duration::from_millis(1200)
        );
        let ranked = m
            .rank(&D, &[node("b", 0, 0), node("a", 800, 0)], 0)
            .unwrap();
        assert_eq!(ranked[0].0, 1);
    }

    #[test]
    fn a_busy_holder_loses_to_an_idle_node_when_its_queue_costs_more_than_the_transfer() {
        let m = model(10_000);
        // A's queue: 10 × 100 ms = 1 s, over B's 0.8 s transfer less A's 80 ms load.
        let ranked = m
            .rank(&D, &[node("a", 800, 10), node("b", 0, 0)], 0)
            .unwrap();
        assert_eq!(ranked[0].0, 1);
        assert_eq!(ranked[1].1, Duration::from_millis(1480));
    }

    #[test]
    fn nothing_within_the_slo_is_refused_up_front() {
        let m = model(300);
        // 480 ms of its own work plus 1 s behind ten requests: over 300 ms.
        assert_eq!(
            m.rank(&D, &[node("a", 800, 10)], 0),
            Err(Refusal::OverSlo {
                best: Duration::from_millis(1480),
                queue: Duration::from_millis(1000),
            })
        );
        assert_eq!(m.rank(&D, &[], 0), Err(Refusal::NoNodes));
    }

    #[test]
    fn an_idle_node_takes_a_request_over_the_slo_rather_than_refuse_it() {
        let m = model(300);
        // Its own 400 ms prefill is over the SLO, but nothing waits there: refusing would
        // relieve nothing.
        let ranked = m
            .rank(&D, &[node("busy", 800, 3), node("idle", 0, 0)], 0)
            .unwrap();
        assert_eq!(
            ranked[0].0, 1,
            "the idle node first, though it lacks the prefix"
        );
        assert_eq!(m.rank(&D, &[node("a", 800, 0)], 0).unwrap()[0].0, 0);
    }

    #[test]
    fn each_node_is_estimated_at_its_own_measured_rates() {
        let m = model(10_000);
        let slow = Candidate {
            prefill_per_token: Duration::from_millis(20),
            ..node("slow", 800, 0)
        };
        let fast_link = Candidate {
            transfer_bytes_per_sec: 1e9,
            ..node("fast", 0, 0)
        };
        // slow: 200 × 20 ms + 800 KB at 10 MB/s = 4.08 s; fast: 200 × 2 ms + 800 KB at 1 GB/s
        // = 400.8 ms.
        assert_eq!(m.estimate(&D, &slow), Duration::from_millis(4080));
        assert_eq!(m.estimate(&D, &fast_link), Duration::from_micros(400_800));
        assert_eq!(m.rank(&D, &[slow, fast_link], 0).unwrap()[0].0, 1);
    }

    #[test]
    fn the_engine_holding_the_prefix_in_its_own_cache_wins_over_fabric_copies() {
        let m = model(10_000);
        // Both nodes hold the 800 cached tokens in their stores (replicas); only A's engine
        // has them in its own cache: A computes 200 tokens, B loads 800 first.
        let a = Candidate {
            engine_tokens: 800,
            ..node("a", 800, 0)
        };
        let b = node("b", 800, 0);
        let e = CostModel::parts(&D, &a);
        assert_eq!(
            (
                e.engine_tokens,
                e.local_tokens,
                e.remote_tokens,
                e.compute_tokens
            ),
            (800, 0, 0, 200)
        );
        assert_eq!(e.work, Duration::from_millis(400));
        let e = CostModel::parts(&D, &b);
        assert_eq!((e.engine_tokens, e.local_tokens), (0, 800));
        for turn in 0..4 {
            assert_eq!(m.rank(&D, &[b.clone(), a.clone()], turn).unwrap()[0].0, 1);
        }
        // Only B's store holds the prefix: A's engine cache still wins; without it, B wins.
        let a_far = Candidate {
            engine_tokens: 800,
            ..node("a", 0, 0)
        };
        assert_eq!(m.rank(&D, &[b.clone(), a_far], 0).unwrap()[0].0, 1);
        assert_eq!(
            m.rank(&D, &[b.clone(), node("a", 0, 0)], 0).unwrap()[0].0,
            0
        );
        // An engine cache longer than the fabric's prefix counts whole: 900 cached there.
        let longer = Candidate {
            engine_tokens: 900,
            ..node("a", 0, 0)
        };
        let e = CostModel::parts(&D, &longer);
        assert_eq!((e.compute_tokens, e.remote_tokens), (100, 0));
        assert!(
            e.reason()
                .starts_with("engine_cache=900 fabric_local=0 fabric_remote=0 compute=100")
        );
    }

    #[test]
    fn ties_rotate_so_an_idle_cluster_spreads_load() {
        let m = model(10_000);
        let nodes = [node("a", 0, 0), node("b", 0, 0), node("c", 0, 0)];
        let cold = Demand {
            cached_tokens: 0,
            ..D
        };
        let firsts: Vec<usize> = (0..3)
            .map(|t| m.rank(&cold, &nodes, t).unwrap()[0].0)
            .collect();
        assert_eq!(firsts, vec![0, 1, 2]);
    }
}
