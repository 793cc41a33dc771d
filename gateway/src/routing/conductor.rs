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
//!
//! A node whose engines batch (vLLM upstreams, which announce their stages, [`StageLoad`])
//! serves its requests in flight together, not one after another: a new request waits only
//! for the prefill work ahead of it (Mooncake's prefill queue: the uncached tokens of the
//! requests sent there whose answers have not started, at the node's prefill rate, spread
//! over the instances that prefill them), and its decode shares the batch, which is what
//! the time-between-tokens target bounds. (The one-at-a-time estimate, service time ×
//! requests in flight, refused a third of a load such a fleet serves within its SLOs, in
//! `cachet loadtest simulate-fleet`.)
//!
//! Prefill and decode apart (Mooncake's Algorithm 1): a node whose model has prefill-only
//! instances prefills a long prompt there and hands its blocks to a decoding instance. Its
//! time to first token is then the prefill queue on the prefill instances, the prefill, and
//! the decoding instance's load of the hand-over; and the request must also meet the
//! time-between-tokens target on the decoding instance it joins: the batch there with it
//! added, on the line the node measured (time between tokens against the batch). A node over
//! either target goes after every node within both; when none is within both (and none is
//! idle) the request is refused at once, naming the stage.

use std::time::Duration;

use cachet_common::stages::StageLoad;

/// What the estimate needs to know about the cluster.
#[derive(Clone, Copy, Debug)]
pub struct CostModel {
    pub ttft_slo: Duration,
    /// Time between tokens a request must be expected to see where it decodes.
    pub tbt_slo: Duration,
}

/// One request, as the index sees it.
#[derive(Clone, Copy, Debug)]
pub struct Demand {
    pub prompt_tokens: usize,
    /// Leading tokens cached somewhere in the cluster.
    pub cached_tokens: usize,
    pub bytes_per_token: usize,
    /// Prompt tokens in full blocks with keys: what a split request hands over.
    pub handoff_tokens: usize,
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
    /// Uncached prompt tokens of the requests in flight there whose answers have not
    /// started: the prefill work ahead of a new request on a batching engine.
    pub prefill_queue_tokens: usize,
    /// Recent time to serve one request there (moving average).
    pub service_time: Duration,
    /// Prefill time per uncached token of this request's model there.
    pub prefill_per_token: Duration,
    /// Bandwidth at which it pulls blocks it lacks from its peers.
    pub transfer_bytes_per_sec: f64,
    /// Rate at which its engine loads blocks from its own fabric store.
    pub load_bytes_per_sec: f64,
    /// The request's model's stages there, when its engine measures them.
    pub stages: Option<StageLoad>,
}

impl Candidate {
    /// Nothing in flight there, by this gateway's count and by the node's own.
    pub fn idle(&self) -> bool {
        self.in_flight == 0
            && self
                .stages
                .as_ref()
                .is_none_or(|s| s.prefill_in_flight + s.decode_in_flight == 0)
    }
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
    /// Tokens a split request's decoding instance loads from the prefill instance's saves
    /// (0 when it is served whole).
    pub handoff_tokens: usize,
    /// The request's own work there (prefill, load, transfer and hand-over).
    pub work: Duration,
    /// The wait behind what is in flight there (on a batching engine, the prefill work
    /// ahead).
    pub queue: Duration,
    /// Time between tokens expected where it decodes, when the node measured its line.
    pub tbt: Option<Duration>,
    /// The batch it would join there.
    pub decode_batch: u32,
}

impl Estimate {
    pub fn total(&self) -> Duration {
        self.work + self.queue
    }

    /// The estimate as the `x-cachet-route` header says it.
    pub fn reason(&self) -> String {
        let mut r = format!(
            "engine_cache={} fabric_local={} fabric_remote={} compute={} queue_ms={} estimate_ms={}",
            self.engine_tokens,
            self.local_tokens,
            self.remote_tokens,
            self.compute_tokens,
            self.queue.as_millis(),
            self.total().as_millis()
        );
        if self.handoff_tokens > 0 {
            r.push_str(&format!(" handoff={}", self.handoff_tokens));
        }
        if let Some(t) = self.tbt {
            r.push_str(&format!(" tbt_ms={}", t.as_millis()));
        }
        r
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
    /// First tokens within the SLO somewhere, but every such node's decoding instances are
    /// so busy that the time between tokens would be over its target.
    OverTbt {
        /// The best expected time between tokens among them.
        tbt: Duration,
        /// The batch it would join there.
        batch: u32,
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
        let split = c
            .stages
            .as_ref()
            .filter(|s| s.splits(d.prompt_tokens) && d.handoff_tokens > 0);
        let engine = c.engine_tokens.min(d.prompt_tokens);
        let cached = d.cached_tokens.max(engine).min(d.prompt_tokens);
        let loaded = cached - engine;
        let remote = d.cached_tokens.saturating_sub(c.local_tokens).min(loaded);
        let local = loaded - remote;
        let compute = d.prompt_tokens - cached;
        let secs = |tokens: usize, rate: f64| {
            Duration::from_secs_f64((tokens * d.bytes_per_token) as f64 / rate.max(1.0))
        };
        let handoff = split.map_or(0, |_| d.handoff_tokens.min(d.prompt_tokens));
        let queue = match &c.stages {
            // A batching engine: the prefill work ahead, over the instances that prefill
            // this request (the prefill-only ones for a split request).
            Some(s) => {
                let instances = if split.is_some() {
                    s.prefill_instances
                } else {
                    s.decode_instances
                };
                c.prefill_per_token
                    .mul_f64(c.prefill_queue_tokens as f64 / f64::from(instances.max(1)))
            }
            // One request at a time.
            None => c.service_time.mul_f64(c.in_flight as f64),
        };
        let (tbt, decode_batch) = match &c.stages {
            Some(s) => {
                let batch = s.next_decode_batch(s.decode_in_flight);
                (s.step.map(|m| m.at(batch)), batch)
            }
            None => (None, 0),
        };
        Estimate {
            engine_tokens: engine,
            local_tokens: local,
            remote_tokens: remote,
            compute_tokens: compute,
            handoff_tokens: handoff,
            work: c.prefill_per_token.mul_f64(compute as f64)
                + secs(local, c.load_bytes_per_sec)
                + secs(remote, c.transfer_bytes_per_sec)
                + secs(handoff, c.load_bytes_per_sec),
            queue,
            tbt,
            decode_batch,
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
        let parts: Vec<Estimate> = candidates.iter().map(|c| Self::parts(d, c)).collect();
        let over_tbt = |i: usize| parts[i].tbt.is_some_and(|t| t > self.tbt_slo);
        let mut ranked: Vec<(usize, Duration)> = parts
            .iter()
            .enumerate()
            .map(|(i, e)| (i, e.total()))
            .collect();
        // Nodes within the TBT target first; among them the cheapest.
        ranked.sort_by_key(|&(i, cost)| {
            (
                over_tbt(i),
                cost,
                candidates[i].in_flight,
                (i + n - turn % n) % n,
            )
        });
        let (best_i, best) = ranked[0];
        if best > self.ttft_slo || over_tbt(best_i) {
            // Only waiting can be refused: an idle node takes the request whatever it costs.
            if let Some(pos) = ranked.iter().position(|(i, _)| candidates[*i].idle()) {
                let idle = ranked.remove(pos);
                ranked.insert(0, idle);
                return Ok(ranked);
            }
            // The cheapest first token, whatever its TBT: is even that over the SLO?
            let (cheapest, first) = ranked
                .iter()
                .copied()
                .min_by_key(|&(_, cost)| cost)
                .expect("candidates are not empty");
            if first > self.ttft_slo {
                return Err(Refusal::OverSlo {
                    best: first,
                    queue: parts[cheapest].queue,
                });
            }
            let e = ranked
                .iter()
                .filter(|(_, cost)| *cost <= self.ttft_slo)
                .filter_map(|&(i, _)| parts[i].tbt.map(|t| (t, parts[i].decode_batch)))
                .min()
                .expect("the best is over the TBT target, so it has a TBT estimate");
            return Err(Refusal::OverTbt {
                tbt: e.0,
                batch: e.1,
            });
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
            tbt_slo: Duration::from_millis(100),
        }
    }

    fn node(id: &str, local: usize, in_flight: usize) -> Candidate {
        Candidate {
            id: id.into(),
            local_tokens: local,
            engine_tokens: 0,
            in_flight,
            prefill_queue_tokens: 0,
            service_time: Duration::from_millis(100),
            prefill_per_token: Duration::from_millis(2),
            transfer_bytes_per_sec: 1e6,
            // Loads from the node's own store: 10× its pulls.
            load_bytes_per_sec: 1e7,
            stages: None,
        }
    }

    const D: Demand = Demand {
        prompt_tokens: 1000,
        cached_tokens: 800,
        bytes_per_token: 1000,
        handoff_tokens: 960,
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

    fn split(prefill_in_flight: u32, decode_in_flight: u32) -> StageLoad {
        StageLoad {
            prefill_instances: 1,
            prefill_in_flight,
            decode_instances: 1,
            decode_in_flight,
            split_min_tokens: 500,
            step: Some(cachet_common::stages::StepModel {
                base_ms: 20.0,
                per_seq_ms: 10.0,
            }),
        }
    }

    #[test]
    fn a_batching_node_waits_for_the_prefill_work_ahead_not_for_every_request() {
        // Ten requests in flight at 100 ms each: one at a time, a second of waiting; on a
        // batching engine only the 300 tokens still to prefill there (600 ms at 2 ms).
        let serial = node("a", 800, 10);
        assert_eq!(
            CostModel::parts(&D, &serial).queue,
            Duration::from_millis(1000)
        );
        let batching = Candidate {
            prefill_queue_tokens: 300,
            stages: Some(StageLoad {
                prefill_instances: 0,
                ..split(0, 9)
            }),
            ..serial.clone()
        };
        assert_eq!(
            CostModel::parts(&D, &batching).queue,
            Duration::from_millis(600)
        );
        // Two instances prefill it: half.
        let two = Candidate {
            stages: Some(StageLoad {
                prefill_instances: 0,
                decode_instances: 2,
                ..split(0, 9)
            }),
            ..batching.clone()
        };
        assert_eq!(CostModel::parts(&D, &two).queue, Duration::from_millis(300));
    }

    #[test]
    fn a_split_request_waits_for_the_prefill_queue_and_adds_the_hand_over() {
        let m = model(10_000);
        let c = Candidate {
            prefill_queue_tokens: 300,
            stages: Some(split(2, 1)),
            ..node("a", 800, 0)
        };
        let e = CostModel::parts(&D, &c);
        // 200 computed (400 ms), 800 loaded (80 ms), the decoding instance loads the 960
        // handed over (96 ms); behind 300 tokens of prefill (600 ms); decoding with one
        // other.
        assert_eq!(e.handoff_tokens, 960);
        assert_eq!(e.work, Duration::from_millis(576));
        assert_eq!(e.queue, Duration::from_millis(600));
        assert_eq!(
            (e.tbt, e.decode_batch),
            (Some(Duration::from_millis(40)), 2)
        );
        assert!(
            e.reason().ends_with(" handoff=960 tbt_ms=40"),
            "{}",
            e.reason()
        );
        // Two prefill instances halve the wait.
        let two = StageLoad {
            prefill_instances: 2,
            ..split(2, 1)
        };
        let e = CostModel::parts(
            &D,
            &Candidate {
                stages: Some(two),
                ..c.clone()
            },
        );
        assert_eq!(e.queue, Duration::from_millis(300));
        // A prompt under split_min_tokens is served whole: no hand-over; its queue is over
        // the decoding instances.
        let short = Demand {
            prompt_tokens: 400,
            cached_tokens: 0,
            handoff_tokens: 384,
            ..D
        };
        let e = CostModel::parts(&short, &c);
        assert_eq!((e.handoff_tokens, e.queue), (0, Duration::from_millis(600)));
        // Colocated stages (no prefill instance): whole, with a TBT estimate all the same.
        let both = Candidate {
            stages: Some(StageLoad {
                prefill_instances: 0,
                ..split(0, 3)
            }),
            ..node("b", 800, 0)
        };
        let e = CostModel::parts(&D, &both);
        assert_eq!(
            (e.handoff_tokens, e.tbt),
            (0, Some(Duration::from_millis(60)))
        );
        assert!(m.rank(&D, &[c, both], 0).is_ok());
    }

    #[test]
    fn a_node_over_the_tbt_target_goes_last_and_alone_is_refused() {
        let m = model(10_000);
        // Nine decoding: the tenth waits 20 + 10 × 10 = 120 ms between tokens, over 100 ms.
        let busy = Candidate {
            stages: Some(split(0, 9)),
            ..node("busy", 800, 0)
        };
        let free = Candidate {
            stages: Some(split(0, 1)),
            ..node("free", 0, 4)
        };
        // The busy node is cheaper to first token (it holds the prefix) but over TBT.
        assert!(m.estimate(&D, &busy) < m.estimate(&D, &free));
        let ranked = m.rank(&D, &[busy.clone(), free.clone()], 0).unwrap();
        assert_eq!(ranked.iter().map(|r| r.0).collect::<Vec<_>>(), vec![1, 0]);
        assert_eq!(
            m.rank(&D, std::slice::from_ref(&busy), 0),
            Err(Refusal::OverTbt {
                tbt: Duration::from_millis(120),
                batch: 10,
            })
        );
        // An idle node takes it whatever its line says; a first token over the SLO is
        // named before the TBT.
        let idle = Candidate {
            stages: Some(StageLoad {
                step: Some(cachet_common::stages::StepModel {
                    base_ms: 500.0,
                    per_seq_ms: 0.0,
                }),
                ..split(0, 0)
            }),
            ..node("idle", 0, 0)
        };
        assert_eq!(m.rank(&D, &[busy.clone(), idle], 0).unwrap()[0].0, 1);
        assert!(matches!(
            model(300).rank(&D, &[busy], 0),
            Err(Refusal::OverSlo { .. })
        ));
        // Unmeasured lines never refuse.
        let unmeasured = Candidate {
            stages: Some(StageLoad {
                step: None,
                ..split(0, 50)
            }),
            ..node("u", 800, 0)
        };
        assert!(m.rank(&D, &[unmeasured], 0).is_ok());
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
