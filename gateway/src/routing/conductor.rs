//! The conductor: which node should serve a request, or none (529) when no node can start
//! answering within the time-to-first-token SLO.
//!
//! For each live node it estimates the time to first token as
//!
//! ```text
//! prefill(tokens not cached anywhere) + transfer(cached bytes the node lacks) / bandwidth
//!   + queue delay (requests in flight to it × its recent service time)
//! ```
//!
//! from the gateway's prefix index (which blocks are cached, and where) and its own count of
//! requests in flight per node. Nodes are tried cheapest first; ties go to the node with
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
    /// Of the cached prefix, tokens this node holds itself.
    pub local_tokens: usize,
    pub in_flight: usize,
    /// Recent time to serve one request there (moving average).
    pub service_time: Duration,
    /// Prefill time per uncached token of this request's model there.
    pub prefill_per_token: Duration,
    /// Bandwidth at which it pulls blocks it lacks from its peers.
    pub transfer_bytes_per_sec: f64,
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
        let (own, queue) = Self::parts(d, c);
        own + queue
    }

    /// The estimate's two parts: the request's own work there (prefill and transfer), and
    /// the wait behind what is in flight.
    fn parts(d: &Demand, c: &Candidate) -> (Duration, Duration) {
        let uncached = d.prompt_tokens.saturating_sub(d.cached_tokens);
        let prefill = c.prefill_per_token.mul_f64(uncached as f64);
        let missing = d.cached_tokens.saturating_sub(c.local_tokens) * d.bytes_per_token;
        let transfer = Duration::from_secs_f64(missing as f64 / c.transfer_bytes_per_sec.max(1.0));
        let queue = c.service_time.mul_f64(c.in_flight as f64);
        (prefill + transfer, queue)
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
            let (_, queue) = Self::parts(d, &candidates[best_i]);
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
            in_flight,
            service_time: Duration::from_millis(100),
            prefill_per_token: Duration::from_millis(2),
            transfer_bytes_per_sec: 1e6,
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
        // 200 uncached tokens: 400 ms of prefill everywhere; B lacks 800 KB (0.8 s at 1 MB/s).
        assert_eq!(
            m.estimate(&D, &node("a", 800, 0)),
            Duration::from_millis(400)
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
        // A's queue: 10 × 100 ms = 1 s, over B's 0.8 s transfer.
        let ranked = m
            .rank(&D, &[node("a", 800, 10), node("b", 0, 0)], 0)
            .unwrap();
        assert_eq!(ranked[0].0, 1);
        assert_eq!(ranked[1].1, Duration::from_millis(1400));
    }

    #[test]
    fn nothing_within_the_slo_is_refused_up_front() {
        let m = model(300);
        // 400 ms of its own prefill plus 1 s behind ten requests: over 300 ms.
        assert_eq!(
            m.rank(&D, &[node("a", 800, 10)], 0),
            Err(Refusal::OverSlo {
                best: Duration::from_millis(1400),
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
        // slow: 200 × 20 ms = 4 s; fast: 200 × 2 ms + 800 KB at 1 GB/s = 400.8 ms.
        assert_eq!(m.estimate(&D, &slow), Duration::from_secs(4));
        assert_eq!(m.estimate(&D, &fast_link), Duration::from_micros(400_800));
        assert_eq!(m.rank(&D, &[slow, fast_link], 0).unwrap()[0].0, 1);
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
