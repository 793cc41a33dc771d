//! The fleet's discrete-event model: N engine instances (instance `i` on node `i mod
//! nodes`) doing continuous batching, their caches, the fabric between them and a routing
//! policy.
//!
//! Each instance runs iterations back to back while it has work: an iteration steps every
//! decoding sequence by one token and prefills up to the profile's chunk budget (less the
//! decode tokens) from its waiting queue, first come first served, and takes
//! [`CostProfile::step_secs`] + [`CostProfile::prefill_secs`] of its pieces. So a long
//! prefill slows the decode steps batched beside it, which is what prefill and decode apart
//! removes. Instances on one node share its host: an iteration that starts while others
//! there are busy takes longer for each, its prefill by the profile's prefill share and its
//! fixed part (not its sequences' own work) by the step share (measured by `profile
//! --neighbour`; 0 in profiles without it). A sequence's first token comes at the
//! end of the iteration that finishes its prefill; each later one at the end of each
//! iteration it decodes in (time between tokens).
//!
//! Caches are Cachet's own store ([`SimCache`]): each instance's engine prefix cache (hits
//! cost nothing), and under it either each instance's own DRAM (`local`: the baseline where
//! each instance keeps only its own KV) or one pool over every node's DRAM (`pool`: a block
//! lives on one home node; a hit there is loaded at the local rate, elsewhere pulled at the
//! link's). Loads and hand-overs are serialized on the receiving instance's link and delay
//! only their own sequence. Routing with the pool is Cachet's conductor
//! ([`gateway::routing::conductor::CostModel`]), with its early rejection when asked.
//!
//! Prefill and decode apart (`prefill_instances` > 0): a prompt of `split_min_tokens` or more
//! is prefilled on a prefill instance (its first token thrown away, its full blocks saved to
//! the pool), handed to the decoding instance with the fewest sequences, which loads them
//! and computes the tail and the first token; shorter prompts go whole to a decoding
//! instance, as in the service.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::time::Duration;

use cache_fabric::EvictionPolicy;
use cache_fabric::popularity::Popularity;
use cache_fabric::simulate::{Put, SimCache, SimCapacity, SimRequest};
use cachet_common::stages::{StageLoad, StepModel};
use gateway::routing::conductor::{Candidate, CostModel, Demand};
use hdrhistogram::Histogram;

use super::profile::CostProfile;
use crate::trace::{Rng, mix64};

/// One request of the workload.
#[derive(Clone, Debug)]
pub struct FleetRequest {
    /// Seconds from the workload's start.
    pub arrival: f64,
    pub sim: SimRequest,
    pub output_tokens: u32,
}

impl FleetRequest {
    pub fn prompt_tokens(&self) -> u64 {
        self.sim.block_tokens.iter().map(|&t| u64::from(t)).sum()
    }

    /// Tokens in the prompt's full blocks (what a split request hands over): every block
    /// but a partial last one.
    fn full_block_tokens(&self) -> u64 {
        let t = &self.sim.block_tokens;
        let full = t.first().copied().unwrap_or(0);
        t.iter()
            .take_while(|&&n| n == full)
            .map(|&n| u64::from(n))
            .sum()
    }
}

/// How requests find an instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Routing {
    /// Any instance, at random.
    Random,
    /// The one with the fewest requests in flight.
    LeastLoaded,
    /// The cheapest estimate over each instance's own caches (each keeps only its own KV):
    /// the baseline both papers beat.
    CacheAware,
    /// Cachet: the pool over every node's DRAM and the conductor's estimate.
    Pool,
}

/// The fleet and its targets.
#[derive(Clone, Debug)]
pub struct FleetConfig {
    pub instances: usize,
    /// Nodes the instances sit on (instance `i` on node `i % nodes`); a node's instances
    /// share its DRAM and load from it at the local rate.
    pub nodes: usize,
    pub routing: Routing,
    /// Of the instances, prefill-only ones (with `Routing::Pool` only; 0: colocated).
    pub prefill_instances: usize,
    /// Prompts shorter than this are not split.
    pub split_min_tokens: u64,
    /// Each node's DRAM for KV, in tokens.
    pub dram_tokens: u64,
    /// Copies of each block in the pool (its capacity is the nodes' DRAM over this).
    pub replicas: u64,
    pub policy: EvictionPolicy,
    pub ttft_slo: Duration,
    pub tbt_slo: Duration,
    /// The conductor refuses what it expects over either SLO (pool routing).
    pub early_rejection: bool,
    /// With cache-aware or pool routing: an instance takes a request only while its requests
    /// in flight are within this many times the candidates' mean (none: no bound).
    pub balance: Option<f64>,
    /// Hot-block replication in the pool, by the cluster's rule: a node that pulls a block
    /// this many times within `hot_window` keeps an extra replica of it (0: off). Extra
    /// replicas get an eighth of each node's DRAM, taken from the pool.
    pub hot_reads: u32,
    pub hot_window: Duration,
    /// Generations the gateway in front of the fleet lets run at once on the model
    /// (Cachet's `engine.workers` lane, `gateway::engines`); the rest wait there, first come
    /// first served, and are routed when one ends. None: no gateway bound (a router sends
    /// every request on at once).
    pub gateway_slots: Option<usize>,
    /// The first this many requests warm the caches: they run like the rest, but their
    /// TTFT, gaps and SLO are left out of the figures (a measured run's warm-up, or the
    /// loads before the one being compared).
    pub warm_up: usize,
    pub seed: u64,
}

/// Each node's DRAM over this is kept for extra replicas of hot blocks (when on).
const HOT_SHARE: u64 = 8;

/// What a run measured.
#[derive(Clone, Debug)]
pub struct FleetResult {
    pub requests: u64,
    pub served: u64,
    pub rejected: u64,
    /// Served with TTFT and mean time between tokens within the SLOs.
    pub within_slo: u64,
    /// First arrival to last completion, seconds.
    pub makespan: f64,
    /// Microseconds.
    pub ttft: Histogram<u64>,
    /// Every gap between two tokens of a sequence, microseconds.
    pub tbt: Histogram<u64>,
    pub prompt_tokens: u64,
    /// Prompt tokens of served requests found in an engine's own cache / the fabric.
    pub engine_hit_tokens: u64,
    pub fabric_hit_tokens: u64,
    /// Prompt tokens prefilled (a split request's decode tail included).
    pub computed_tokens: u64,
    /// Of those, the tails decoding instances recomputed after a hand-over.
    pub tail_tokens: u64,
    pub output_tokens: u64,
    pub bytes_loaded: u64,
    pub bytes_pulled: u64,
    pub bytes_handed_over: u64,
    /// Tokens each instance processed (prefilled and decoded).
    pub instance_tokens: Vec<u64>,
    /// Requests that waited for another's prefill of their next block (in-flight
    /// coalescing, pool routing) instead of computing it.
    pub coalesced: u64,
    /// Extra replicas of hot blocks kept, in blocks.
    pub hot_replicas: u64,
    /// Of the pulled bytes, the time requests waited for a busy sender (seconds, summed).
    pub egress_wait_secs: f64,
    /// Requests that waited at the gateway for a slot, and their waits (seconds, summed).
    pub gateway_queued: u64,
    pub gateway_wait_secs: f64,
    /// Of the engine hits, tokens found when the prompt was scheduled, not when it was
    /// routed (another sequence on the instance computed them meanwhile).
    pub late_engine_hit_tokens: u64,
    /// Each served request, in the order they ended.
    pub outcomes: Vec<Outcome>,
}

/// What became of one served request (times in seconds from the trace's start).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Outcome {
    /// Its index in the requests run.
    pub request: usize,
    pub arrival: f64,
    /// When it was routed (after any wait at the gateway).
    pub routed: f64,
    /// The instance that produced its tokens (a split request's decoding one).
    pub instance: usize,
    pub first_token: f64,
    pub done: f64,
}

impl FleetResult {
    /// Hit tokens over prompt tokens of served requests.
    pub fn hit_ratio(&self) -> f64 {
        let hits = self.engine_hit_tokens + self.fabric_hit_tokens;
        let total = hits + self.computed_tokens - self.tail_tokens;
        if total == 0 {
            0.0
        } else {
            hits as f64 / total as f64
        }
    }

    /// Requests within SLO a second.
    pub fn goodput(&self) -> f64 {
        if self.makespan <= 0.0 {
            0.0
        } else {
            self.within_slo as f64 / self.makespan
        }
    }

    /// The busiest instance's tokens over the mean.
    pub fn load_imbalance(&self) -> f64 {
        let n = self.instance_tokens.len().max(1) as f64;
        let mean = self.instance_tokens.iter().sum::<u64>() as f64 / n;
        let max = self.instance_tokens.iter().copied().max().unwrap_or(0) as f64;
        if mean == 0.0 { 1.0 } else { max / mean }
    }

    pub fn bytes_moved(&self) -> u64 {
        self.bytes_loaded + self.bytes_pulled + self.bytes_handed_over
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// Prefilled and decoded on one instance.
    Whole,
    /// A split request's prefill, on a prefill instance.
    Prefill,
    /// A split request's decode, after the hand-over.
    Decode,
}

struct Seq {
    req: usize,
    inst: usize,
    stage: Stage,
    /// Prompt positions in the KV so far, and where the prefill ends.
    prefilled: u64,
    target: u64,
    out_left: u32,
    context: u64,
    assigned_at: f64,
    last_token: f64,
    gaps: f64,
    gap_count: u32,
    ttft: f64,
    /// The block this sequence is computing for others to follow (pool routing).
    claim: Option<BlockKey>,
    /// Its prefill has had an iteration (its engine-cache hits are settled).
    begun: bool,
}

/// A block of the workload: its scope and trace id.
type BlockKey = (u32, u64);

/// A request waiting for another's prefill: the request, its instance and stage.
type Follower = (usize, usize, Stage);

/// What a request reads from the fabric: tokens loaded from its own node, tokens pulled
/// from each other node, the position its prefill starts from and the blocks it holds.
struct Reads {
    local: u64,
    pulls: Vec<(usize, u64)>,
    start: u64,
    blocks: usize,
}

struct Instance {
    prefill_only: bool,
    engine: SimCache,
    waiting: VecDeque<usize>,
    running: Vec<usize>,
    /// The running iteration.
    plan: Option<Plan>,
    link_free: f64,
    in_flight: usize,
    /// A request's time here (a moving average).
    service: f64,
    /// Prompt tokens still to prefill of the sequences assigned here (loading or waiting).
    pending_prefill: u64,
    tokens: u64,
}

/// One iteration: the sequences it steps, and the prefill pieces it runs (sequence, from
/// position, to position).
struct Plan {
    decoding: Vec<usize>,
    pieces: Vec<(usize, u64, u64)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    Arrive(usize),
    /// A request that waited at the gateway got a slot: it is routed now.
    Admitted(usize),
    /// A sequence's loads are done: it joins its instance's queue.
    Ready(usize),
    IterationEnd(usize),
}

/// Event times as ordered integers (nanoseconds), ties in the order scheduled.
type Key = Reverse<(u64, u64, Ev)>;

struct Fleet<'a> {
    cfg: &'a FleetConfig,
    p: &'a CostProfile,
    reqs: &'a [FleetRequest],
    inst: Vec<Instance>,
    /// Each node's own DRAM (local caches; empty with the pool).
    drams: Vec<SimCache>,
    pool: Option<SimCache>,
    seqs: Vec<Seq>,
    /// Hot-block replication: each node's extra replicas and pull counts.
    extras: Vec<SimCache>,
    popularity: Vec<Popularity<BlockKey, Duration>>,
    /// When each node's outgoing link is free (pulls from it are serialized).
    egress_free: Vec<f64>,
    /// In-flight coalescing: the sequence computing each claimed block, and who waits on it.
    claims: HashMap<BlockKey, usize>,
    followers: HashMap<usize, Vec<Follower>>,
    /// The gateway's slots held (requests routed and not yet done) and its queue.
    slots_held: usize,
    gate: VecDeque<usize>,
    /// When each request was routed.
    routed: Vec<f64>,
    events: BinaryHeap<Key>,
    order: u64,
    rng: Rng,
    turn: usize,
    r: FleetResult,
    first_arrival: f64,
    last_done: f64,
}

const ALPHA: f64 = 0.2;

/// The pool's capacity in tokens: the nodes' DRAM (less what hot-block replication keeps
/// aside) over the copies of each block.
fn pool_tokens(cfg: &FleetConfig, nodes: usize) -> u64 {
    let per_node = if cfg.hot_reads > 0 {
        cfg.dram_tokens - cfg.dram_tokens / HOT_SHARE
    } else {
        cfg.dram_tokens
    };
    per_node * nodes as u64 / cfg.replicas.max(1)
}

/// A request's first `blocks` blocks, to store as an entry of their own.
fn leading(req: &SimRequest, blocks: usize) -> SimRequest {
    SimRequest {
        blocks: req.blocks[..blocks].to_vec(),
        block_tokens: req.block_tokens[..blocks].to_vec(),
        ..req.clone()
    }
}

fn ns(t: f64) -> u64 {
    (t.max(0.0) * 1e9).round() as u64
}

/// Run `reqs` (sorted by arrival) through the fleet.
pub fn run(cfg: &FleetConfig, p: &CostProfile, reqs: &[FleetRequest]) -> FleetResult {
    assert!(cfg.instances > 0, "a fleet has an instance");
    assert!(
        cfg.prefill_instances < cfg.instances,
        "a fleet needs an instance that decodes"
    );
    let pooled = cfg.routing == Routing::Pool;
    let nodes = cfg.nodes.clamp(1, cfg.instances);
    let cache = |tokens: u64| {
        SimCache::new(
            SimCapacity {
                dram: tokens,
                lower: 0,
                per_token: true,
            },
            cfg.policy,
        )
    };
    let inst = (0..cfg.instances)
        .map(|i| Instance {
            prefill_only: pooled && i < cfg.prefill_instances,
            engine: cache(p.engine_cache_tokens),
            waiting: VecDeque::new(),
            running: Vec::new(),
            plan: None,
            link_free: 0.0,
            in_flight: 0,
            service: 0.0,
            pending_prefill: 0,
            tokens: 0,
        })
        .collect();
    let mut f = Fleet {
        cfg,
        p,
        reqs,
        inst,
        drams: if pooled {
            Vec::new()
        } else {
            (0..nodes).map(|_| cache(cfg.dram_tokens)).collect()
        },
        pool: pooled.then(|| cache(pool_tokens(cfg, nodes))),
        seqs: Vec::new(),
        extras: if pooled && cfg.hot_reads > 0 {
            (0..nodes)
                .map(|_| cache(cfg.dram_tokens / HOT_SHARE))
                .collect()
        } else {
            Vec::new()
        },
        popularity: (0..nodes).map(|_| Popularity::default()).collect(),
        egress_free: vec![0.0; nodes],
        claims: HashMap::new(),
        followers: HashMap::new(),
        slots_held: 0,
        gate: VecDeque::new(),
        routed: vec![0.0; reqs.len()],
        events: BinaryHeap::new(),
        order: 0,
        rng: Rng::new(cfg.seed),
        turn: 0,
        r: FleetResult {
            requests: reqs.len() as u64,
            served: 0,
            rejected: 0,
            within_slo: 0,
            makespan: 0.0,
            ttft: Histogram::new_with_bounds(1, 24 * 3_600_000_000, 3).expect("bounds"),
            tbt: Histogram::new_with_bounds(1, 24 * 3_600_000_000, 3).expect("bounds"),
            prompt_tokens: 0,
            engine_hit_tokens: 0,
            fabric_hit_tokens: 0,
            computed_tokens: 0,
            tail_tokens: 0,
            output_tokens: 0,
            bytes_loaded: 0,
            bytes_pulled: 0,
            bytes_handed_over: 0,
            instance_tokens: vec![0; cfg.instances],
            coalesced: 0,
            hot_replicas: 0,
            egress_wait_secs: 0.0,
            gateway_queued: 0,
            gateway_wait_secs: 0.0,
            late_engine_hit_tokens: 0,
            outcomes: Vec::new(),
        },
        first_arrival: reqs.first().map_or(0.0, |r| r.arrival),
        last_done: 0.0,
    };
    for (i, r) in reqs.iter().enumerate() {
        f.at(r.arrival, Ev::Arrive(i));
    }
    while let Some(Reverse((t, _, ev))) = f.events.pop() {
        let now = t as f64 / 1e9;
        match ev {
            Ev::Arrive(i) => f.gateway(now, i),
            Ev::Admitted(i) => {
                f.r.gateway_wait_secs += now - f.reqs[i].arrival;
                f.arrive(now, i);
            }
            Ev::Ready(s) => {
                let i = f.seqs[s].inst;
                f.inst[i].waiting.push_back(s);
                f.kick(now, i);
            }
            Ev::IterationEnd(i) => f.iteration_end(now, i),
        }
    }
    f.r.makespan = (f.last_done - f.first_arrival).max(0.0);
    f.r.instance_tokens = f.inst.iter().map(|i| i.tokens).collect();
    f.r
}

impl Fleet<'_> {
    fn at(&mut self, t: f64, ev: Ev) {
        self.order += 1;
        self.events.push(Reverse((ns(t), self.order, ev)));
    }

    fn nodes(&self) -> usize {
        self.cfg.nodes.clamp(1, self.cfg.instances)
    }

    /// The node instance `i` sits on.
    fn node_of(&self, i: usize) -> usize {
        i % self.nodes()
    }

    /// The nodes a block's pool copies live on (`replicas` distinct ones, by rendezvous
    /// hashing as the cluster places them).
    fn homes(&self, scope: u32, id: u64) -> Vec<usize> {
        let key = id ^ (u64::from(scope) << 48);
        let mut ranked: Vec<usize> = (0..self.nodes()).collect();
        ranked.sort_by_key(|&n| Reverse(mix64(key ^ mix64(n as u64 + 1))));
        ranked.truncate(self.cfg.replicas.max(1) as usize);
        ranked
    }

    /// Tokens of blocks `from..to` of `req` that instance `i` loads from its own node: all of
    /// them from its node's DRAM, those with a copy there from the pool.
    fn local_tokens(&self, req: &FleetRequest, from: usize, to: usize, i: usize) -> u64 {
        let node = self.node_of(i);
        (from..to)
            .filter(|&k| {
                self.pool.is_none() || self.homes(req.sim.scope, req.sim.blocks[k]).contains(&node)
            })
            .map(|k| u64::from(req.sim.block_tokens[k]))
            .sum()
    }

    /// The fabric's cache instance `i` reads: its node's DRAM, or the pool.
    fn fabric(&mut self, i: usize) -> Option<&mut SimCache> {
        let node = self.node_of(i);
        match self.pool.as_mut() {
            Some(p) => Some(p),
            None => self.drams.get_mut(node),
        }
    }

    fn tokens_of(req: &FleetRequest, blocks: usize) -> u64 {
        req.sim.block_tokens[..blocks]
            .iter()
            .map(|&t| u64::from(t))
            .sum()
    }

    /// Whether a request is prefilled apart.
    fn splits(&self, req: &FleetRequest) -> bool {
        self.cfg.prefill_instances > 0
            && req.sim.cacheable
            && req.prompt_tokens() >= self.cfg.split_min_tokens
            && req.full_block_tokens() > 0
    }

    fn decode_load(&self) -> (u32, u32) {
        let d: Vec<&Instance> = self.inst.iter().filter(|i| !i.prefill_only).collect();
        let n = d
            .iter()
            .map(|i| (i.running.len() + i.waiting.len()) as u32)
            .sum();
        (d.len() as u32, n)
    }

    /// The line of time between tokens at the fleet's mean context.
    fn step_line(&self) -> StepModel {
        let (mut ctx, mut n) = (0u64, 0u64);
        for i in &self.inst {
            for &s in &i.running {
                ctx += self.seqs[s].context;
                n += 1;
            }
        }
        let mean_k = if n == 0 {
            0.0
        } else {
            ctx as f64 / n as f64 / 1e3
        };
        StepModel {
            base_ms: self.p.step_base_ms,
            per_seq_ms: self.p.step_per_seq_ms + self.p.step_per_kctx_ms * mean_k,
        }
    }

    /// A request at the gateway: routed now if a slot is free, else queued for one.
    fn gateway(&mut self, now: f64, ri: usize) {
        match self.cfg.gateway_slots {
            Some(slots) if self.slots_held >= slots.max(1) => {
                self.r.gateway_queued += 1;
                self.gate.push_back(ri);
            }
            _ => {
                self.slots_held += 1;
                self.arrive(now, ri);
            }
        }
    }

    /// A request is done (served or refused): its slot goes to the first one waiting.
    fn release(&mut self, now: f64) {
        self.slots_held -= 1;
        if let Some(next) = self.gate.pop_front() {
            self.slots_held += 1;
            self.at(now, Ev::Admitted(next));
        }
    }

    fn arrive(&mut self, now: f64, ri: usize) {
        self.routed[ri] = now;
        let reqs = self.reqs;
        let req = &reqs[ri];
        let split = self.splits(req);
        let candidates: Vec<usize> = (0..self.inst.len())
            .filter(|&i| self.inst[i].prefill_only == split)
            .collect();
        let candidates = self.balanced(candidates);
        let ranked = self.route(req, split, &candidates);
        let stage = if split { Stage::Prefill } else { Stage::Whole };
        // In-flight coalescing (the pool, as the router and gateway do it): a request whose
        // next block another is computing goes to that one's instance, when it qualifies,
        // and waits for its prefill.
        if let Some(leader) = self.leader_of(req) {
            let at = self.seqs[leader].inst;
            if ranked.contains(&at) {
                self.r.coalesced += 1;
                self.followers
                    .entry(leader)
                    .or_default()
                    .push((ri, at, stage));
                return;
            }
        }
        let Some(&chosen) = ranked.first() else {
            self.r.rejected += 1;
            self.release(now);
            return;
        };
        self.assign(now, ri, chosen, stage, 0);
    }

    /// The sequence computing `req`'s next uncached block in the pool, if any.
    fn leader_of(&mut self, req: &FleetRequest) -> Option<usize> {
        if !req.sim.cacheable {
            return None;
        }
        let held = self.pool.as_mut()?.peek(&req.sim);
        let next = *req.sim.blocks.get(held)?;
        self.claims.get(&(req.sim.scope, next)).copied()
    }

    /// The candidates the balance bound leaves: those with requests in flight within
    /// `balance` times the mean (cache-aware and pool routing).
    fn balanced(&self, candidates: Vec<usize>) -> Vec<usize> {
        let Some(bound) = self.cfg.balance else {
            return candidates;
        };
        if !matches!(self.cfg.routing, Routing::CacheAware | Routing::Pool) {
            return candidates;
        }
        let total: usize = candidates.iter().map(|&i| self.inst[i].in_flight).sum();
        let mean = total as f64 / candidates.len().max(1) as f64;
        candidates
            .into_iter()
            .filter(|&i| self.inst[i].in_flight as f64 <= bound * mean)
            .collect()
    }

    /// The instances to send a request to, best first; none: refused up front.
    fn route(&mut self, req: &FleetRequest, split: bool, candidates: &[usize]) -> Vec<usize> {
        self.turn += 1;
        let n = candidates.len();
        match self.cfg.routing {
            Routing::Random => vec![candidates[self.rng.range(0, n as u64 - 1) as usize]],
            Routing::LeastLoaded => candidates
                .iter()
                .enumerate()
                .min_by_key(|&(k, &i)| (self.inst[i].in_flight, (k + n - self.turn % n) % n))
                .map(|(_, &i)| i)
                .into_iter()
                .collect(),
            Routing::CacheAware | Routing::Pool => self.conduct(req, split, candidates),
        }
    }

    /// Cachet's conductor over the candidates: each estimated by its own caches (cache-aware)
    /// or the pool's (pool), ranked (with the pool: those that qualify, best first), none
    /// when early rejection is on and none qualifies.
    fn conduct(&mut self, req: &FleetRequest, split: bool, candidates: &[usize]) -> Vec<usize> {
        let prompt = req.prompt_tokens();
        let pooled = self.pool.is_some();
        let pool_blocks = match (&mut self.pool, req.sim.cacheable) {
            (Some(pool), true) => pool.peek(&req.sim),
            _ => 0,
        };
        let (decoders, decoding) = self.decode_load();
        let line = self.step_line();
        let per_token =
            Duration::from_secs_f64(self.p.prefill_secs(0, prompt.max(1)) / prompt.max(1) as f64);
        let off = Duration::from_secs(1 << 30);
        let model = CostModel {
            ttft_slo: if self.cfg.early_rejection && pooled {
                self.cfg.ttft_slo
            } else {
                off
            },
            tbt_slo: if self.cfg.early_rejection && pooled {
                self.cfg.tbt_slo
            } else {
                off
            },
        };
        let mut demands = Vec::with_capacity(candidates.len());
        let mut cands = Vec::with_capacity(candidates.len());
        for &i in candidates {
            let engine_blocks = if req.sim.cacheable {
                self.inst[i].engine.peek(&req.sim)
            } else {
                0
            };
            let cached_blocks = match (pooled, req.sim.cacheable) {
                (true, _) => pool_blocks,
                (false, true) => self.fabric(i).map_or(0, |d| d.peek(&req.sim)),
                (false, false) => 0,
            };
            let local_tokens = self.local_tokens(req, 0, cached_blocks, i);
            let inst = &self.inst[i];
            let stages = if split {
                Some(StageLoad {
                    prefill_instances: 1,
                    prefill_in_flight: inst.in_flight as u32,
                    decode_instances: decoders,
                    decode_in_flight: decoding,
                    split_min_tokens: self.cfg.split_min_tokens,
                    step: Some(line),
                })
            } else {
                Some(StageLoad {
                    decode_instances: 1,
                    decode_in_flight: (inst.running.len() + inst.waiting.len()) as u32,
                    split_min_tokens: u64::MAX,
                    step: Some(line),
                    ..StageLoad::default()
                })
            };
            demands.push(Demand {
                prompt_tokens: prompt as usize,
                cached_tokens: Self::tokens_of(req, cached_blocks) as usize,
                bytes_per_token: self.p.kv_bytes_per_token as usize,
                handoff_tokens: req.full_block_tokens() as usize,
            });
            cands.push(Candidate {
                id: i.to_string(),
                local_tokens: local_tokens as usize,
                engine_tokens: Self::tokens_of(req, engine_blocks) as usize,
                // With the instance's own count (the split's prefill queue is in `stages`).
                in_flight: inst.in_flight,
                prefill_queue_tokens: inst.pending_prefill as usize,
                service_time: Duration::from_secs_f64(inst.service),
                prefill_per_token: per_token,
                transfer_bytes_per_sec: self.p.transfer_bytes_per_sec,
                load_bytes_per_sec: self.p.load_bytes_per_sec,
                stages,
            });
        }
        if pooled {
            // One view of the pool: every candidate's demand is the same.
            model
                .rank(&demands[0], &cands, self.turn)
                .map(|ranked| ranked.iter().map(|r| candidates[r.0]).collect())
                .unwrap_or_default()
        } else {
            // Each instance has its own cached prefix: the cheapest estimate, ties to the
            // least busy, then in turn.
            let n = cands.len();
            (0..n)
                .min_by_key(|&k| {
                    (
                        CostModel::parts(&demands[k], &cands[k]).total(),
                        cands[k].in_flight,
                        (k + n - self.turn % n) % n,
                    )
                })
                .map(|k| candidates[k])
                .into_iter()
                .collect()
        }
    }

    /// Start a sequence of request `ri` on instance `i`: read its caches, load what the
    /// fabric holds (or, for a decode stage, the `handoff` tokens), then queue it.
    fn assign(&mut self, now: f64, ri: usize, i: usize, stage: Stage, handoff: u64) {
        let reqs = self.reqs;
        let req = &reqs[ri];
        let prompt = req.prompt_tokens();
        // At least one position is computed (the first token's).
        let limit = prompt.saturating_sub(1);
        let reads = if stage == Stage::Decode {
            // The hand-over through the node's pool, less what this instance's own cache
            // already holds of it.
            let have = Self::tokens_of(req, self.inst[i].engine.read(&req.sim)).min(limit);
            let target = handoff.min(limit);
            let moved = target.saturating_sub(have);
            self.r.bytes_handed_over += moved * self.p.kv_bytes_per_token;
            Reads {
                local: moved,
                pulls: Vec::new(),
                start: have.max(target),
                blocks: 0,
            }
        } else {
            self.read_caches(now, req, i, limit)
        };
        // The engine's server reads the request first (outside its iterations).
        let ready = self.transfer(now + self.p.request_overhead_ms / 1e3, i, &reads);
        let s = self.seqs.len();
        let claim = (stage != Stage::Decode && req.sim.cacheable && self.pool.is_some())
            .then(|| {
                req.sim
                    .blocks
                    .get(reads.blocks)
                    .map(|&b| (req.sim.scope, b))
            })
            .flatten()
            .filter(|key| !self.claims.contains_key(key));
        if let Some(key) = claim {
            self.claims.insert(key, s);
        }
        self.seqs.push(Seq {
            req: ri,
            inst: i,
            stage,
            prefilled: reads.start,
            target: prompt,
            out_left: req.output_tokens.max(1),
            context: reads.start,
            assigned_at: now,
            last_token: now,
            gaps: 0.0,
            gap_count: 0,
            ttft: 0.0,
            claim,
            begun: false,
        });
        self.inst[i].in_flight += 1;
        self.inst[i].pending_prefill += prompt - reads.start;
        self.at(ready, Ev::Ready(s));
    }

    /// When instance `i` has what it reads: its loads and pulls in turn on its own link, each
    /// pull also waiting for its sender's link.
    fn transfer(&mut self, now: f64, i: usize, reads: &Reads) -> f64 {
        let pulled: u64 = reads.pulls.iter().map(|&(_, t)| t).sum();
        if reads.local + pulled == 0 {
            return now;
        }
        let start = now.max(self.inst[i].link_free);
        let mut ready = start + self.p.load_secs(reads.local) + self.p.transfer_secs(pulled);
        for &(node, tokens) in &reads.pulls {
            let from = now.max(self.egress_free[node]);
            self.r.egress_wait_secs += from - now;
            self.egress_free[node] = from + self.p.transfer_secs(tokens);
            ready = ready.max(self.egress_free[node]);
        }
        self.inst[i].link_free = ready;
        ready
    }

    /// A request's reads on instance `i`: its engine cache (free), then its own DRAM or the
    /// pool (loaded from its node, or from a hot block's extra replica there; pulled from
    /// another, the copy on the least busy sender); where its prefill starts.
    fn read_caches(&mut self, now: f64, req: &FleetRequest, i: usize, limit: u64) -> Reads {
        self.r.prompt_tokens += req.prompt_tokens();
        if !req.sim.cacheable {
            return Reads {
                local: 0,
                pulls: Vec::new(),
                start: 0,
                blocks: 0,
            };
        }
        let node = self.node_of(i);
        let engine_blocks = self.inst[i].engine.read(&req.sim);
        let held = self.fabric(i).map_or(0, |c| c.read(&req.sim));
        let extra = self.extras.get_mut(node).map_or(0, |c| c.read(&req.sim));
        let engine_t = Self::tokens_of(req, engine_blocks).min(limit);
        let mut left = limit - engine_t;
        let (mut local, mut pulls) = (0u64, Vec::<(usize, u64)>::new());
        // The leading blocks this node has or now finds hot, and whether any became hot.
        let (mut run, mut became_hot) = (engine_blocks, false);
        for k in engine_blocks..held {
            let take = u64::from(req.sim.block_tokens[k]).min(left);
            left -= take;
            let homes = if self.pool.is_some() {
                self.homes(req.sim.scope, req.sim.blocks[k])
            } else {
                vec![node]
            };
            if k < extra || homes.contains(&node) {
                local += take;
                if run == k {
                    run = k + 1;
                }
                continue;
            }
            let from = *homes
                .iter()
                .min_by(|&&a, &&b| self.egress_free[a].total_cmp(&self.egress_free[b]))
                .expect("a block has a home");
            match pulls.last_mut() {
                Some((n, t)) if *n == from => *t += take,
                _ => pulls.push((from, take)),
            }
            if self.is_hot(node, req.sim.scope, req.sim.blocks[k], now) {
                became_hot = true;
                if run == k {
                    run = k + 1;
                }
            }
        }
        let fabric_t = local + pulls.iter().map(|&(_, t)| t).sum::<u64>();
        self.r.engine_hit_tokens += engine_t;
        self.r.fabric_hit_tokens += fabric_t;
        self.r.bytes_loaded += local * self.p.kv_bytes_per_token;
        self.r.bytes_pulled += (fabric_t - local) * self.p.kv_bytes_per_token;
        if became_hot {
            self.keep_hot(node, req, extra, run);
        }
        Reads {
            local,
            pulls,
            start: engine_t + fabric_t,
            blocks: engine_blocks.max(held),
        }
    }

    /// Count a pull of a block by `node`; whether it is now hot there.
    fn is_hot(&mut self, node: usize, scope: u32, id: u64, now: f64) -> bool {
        if self.cfg.hot_reads == 0 {
            return false;
        }
        let at = Duration::from_secs_f64(now.max(0.0));
        self.popularity[node].record((scope, id), at, self.cfg.hot_window)
            >= f64::from(self.cfg.hot_reads)
    }

    /// Keep extra replicas on `node` of `req`'s leading blocks up to `hot` (those before
    /// `have` it holds already).
    fn keep_hot(&mut self, node: usize, req: &FleetRequest, have: usize, hot: usize) {
        if hot <= have {
            return;
        }
        let Some(extras) = self.extras.get_mut(node) else {
            return;
        };
        if extras.put(&leading(&req.sim, hot), have) == Put::Stored {
            self.r.hot_replicas += (hot - have) as u64;
        }
    }

    /// Start an iteration on an idle instance with work.
    fn kick(&mut self, now: f64, i: usize) {
        if self.inst[i].plan.is_some()
            || (self.inst[i].waiting.is_empty() && self.inst[i].running.is_empty())
        {
            return;
        }
        // Instances on this node busy as the iteration starts: each slows it by the profile's
        // share (they share the host).
        let node = self.node_of(i);
        let busy = (0..self.cfg.instances)
            .filter(|&j| j != i && self.node_of(j) == node && self.inst[j].plan.is_some())
            .count() as f64;
        let inst = &mut self.inst[i];
        let decoding: Vec<usize> = inst
            .running
            .iter()
            .copied()
            .take(self.p.max_batch as usize)
            .collect();
        // A prompt not begun looks in the engine's own cache again when it is scheduled (as
        // vLLM's scheduler does): blocks another sequence computed since it was routed here
        // are hits, not work.
        let reqs = self.reqs;
        for &s in inst.waiting.iter().take(self.p.max_batch as usize) {
            let q = &mut self.seqs[s];
            let req = &reqs[q.req];
            if q.begun || !req.sim.cacheable {
                continue;
            }
            let held = inst.engine.peek(&req.sim);
            let cached = Self::tokens_of(req, held).min(q.target.saturating_sub(1));
            if cached > q.prefilled {
                let gained = cached - q.prefilled;
                q.prefilled = cached;
                q.context = cached;
                inst.pending_prefill -= gained;
                self.r.engine_hit_tokens += gained;
                self.r.late_engine_hit_tokens += gained;
            }
        }
        let mut budget = u64::from(self.p.chunk_tokens).saturating_sub(decoding.len() as u64);
        let mut room = (self.p.max_batch as usize).saturating_sub(inst.running.len());
        let mut pieces = Vec::new();
        let mut prefill = 0.0;
        for &s in &inst.waiting {
            if budget == 0 || room == 0 {
                break;
            }
            let q = &mut self.seqs[s];
            q.begun = true;
            let to = q.target.min(q.prefilled + budget);
            prefill += self.p.prefill_secs(q.prefilled, to);
            budget -= to - q.prefilled;
            pieces.push((s, q.prefilled, to));
            room -= 1;
        }
        let ctx: u64 = decoding.iter().map(|&s| self.seqs[s].context).sum();
        let secs = self
            .p
            .iteration_secs(prefill, decoding.len() as u32, ctx, busy);
        inst.plan = Some(Plan { decoding, pieces });
        self.at(now + secs, Ev::IterationEnd(i));
    }

    fn iteration_end(&mut self, now: f64, i: usize) {
        let Plan { decoding, pieces } = self.inst[i].plan.take().expect("an iteration was running");
        for s in decoding {
            self.inst[i].tokens += 1;
            self.token(now, s);
        }
        for (s, from, to) in pieces {
            self.inst[i].tokens += to - from;
            self.inst[i].pending_prefill -= to - from;
            self.r.computed_tokens += to - from;
            if self.seqs[s].stage == Stage::Decode {
                self.r.tail_tokens += to - from;
            }
            self.seqs[s].prefilled = to;
            self.seqs[s].context = to;
            if to < self.seqs[s].target {
                self.cache_computed(i, s, to);
            }
            if to == self.seqs[s].target {
                self.inst[i].waiting.retain(|&w| w != s);
                self.prefilled(now, s);
            }
        }
        self.kick(now, i);
    }

    /// A prefill part-way at `to`: the engine's own cache keeps the full blocks computed so
    /// far (vLLM caches each block as it is computed, so a prompt scheduled next finds them).
    fn cache_computed(&mut self, i: usize, s: usize, to: u64) {
        let req = &self.reqs[self.seqs[s].req];
        if !req.sim.cacheable || self.p.engine_cache_tokens == 0 {
            return;
        }
        let mut done = 0;
        let mut tokens = 0u64;
        for &t in &req.sim.block_tokens {
            tokens += u64::from(t);
            if tokens > to {
                break;
            }
            done += 1;
        }
        let engine = &mut self.inst[i].engine;
        let held = engine.peek(&req.sim);
        if done <= held {
            return;
        }
        engine.put(&leading(&req.sim, done), held);
    }

    /// A sequence's prefill is done: its caches learn the prompt; then its first token, or
    /// (a split's prefill stage) the hand-over to a decoding instance.
    fn prefilled(&mut self, now: f64, s: usize) {
        let (ri, i, stage) = (self.seqs[s].req, self.seqs[s].inst, self.seqs[s].stage);
        let reqs = self.reqs;
        let req = &reqs[ri];
        if req.sim.cacheable {
            let inst = &mut self.inst[i];
            let held = inst.engine.peek(&req.sim);
            inst.engine.put(&req.sim, held);
            if let Some(c) = self.fabric(i) {
                let held = c.peek(&req.sim);
                c.put(&req.sim, held);
            }
        }
        // Its claim is written (or not, if the pool declined it): its followers read now.
        if let Some(key) = self.seqs[s].claim.take()
            && self.claims.get(&key) == Some(&s)
        {
            self.claims.remove(&key);
        }
        for (fr, fi, fstage) in self.followers.remove(&s).unwrap_or_default() {
            self.assign(now, fr, fi, fstage, 0);
        }
        if stage == Stage::Prefill {
            self.inst[i].in_flight -= 1;
            let decode = (0..self.inst.len())
                .filter(|&d| !self.inst[d].prefill_only)
                .min_by_key(|&d| (self.inst[d].running.len() + self.inst[d].waiting.len(), d))
                .expect("a decoding instance");
            let handoff = req.full_block_tokens();
            self.assign(now, ri, decode, Stage::Decode, handoff);
            return;
        }
        self.seqs[s].ttft = now - self.reqs[ri].arrival;
        if ri >= self.cfg.warm_up {
            self.r
                .ttft
                .saturating_record((self.seqs[s].ttft * 1e6).round().max(1.0) as u64);
        }
        self.seqs[s].last_token = now;
        self.r.output_tokens += 1;
        self.seqs[s].out_left -= 1;
        if self.seqs[s].out_left == 0 {
            self.finish(now, s);
        } else {
            self.inst[i].running.push(s);
        }
    }

    fn token(&mut self, now: f64, s: usize) {
        let q = &mut self.seqs[s];
        let gap = now - q.last_token;
        if q.req >= self.cfg.warm_up {
            self.r
                .tbt
                .saturating_record((gap * 1e6).round().max(1.0) as u64);
        }
        q.gaps += gap;
        q.gap_count += 1;
        q.last_token = now;
        q.context += 1;
        q.out_left -= 1;
        self.r.output_tokens += 1;
        if q.out_left == 0 {
            let i = q.inst;
            self.inst[i].running.retain(|&r| r != s);
            self.finish(now, s);
        }
    }

    fn finish(&mut self, now: f64, s: usize) {
        let q = &self.seqs[s];
        let inst = &mut self.inst[q.inst];
        inst.in_flight -= 1;
        let took = now - q.assigned_at;
        inst.service = if inst.service == 0.0 {
            took
        } else {
            inst.service + ALPHA * (took - inst.service)
        };
        self.r.served += 1;
        let arrival = self.reqs[q.req].arrival;
        self.r.outcomes.push(Outcome {
            request: q.req,
            arrival,
            routed: self.routed[q.req],
            instance: q.inst,
            first_token: arrival + q.ttft,
            done: now,
        });
        let mean_gap = if q.gap_count == 0 {
            0.0
        } else {
            q.gaps / f64::from(q.gap_count)
        };
        if q.req >= self.cfg.warm_up
            && q.ttft <= self.cfg.ttft_slo.as_secs_f64()
            && mean_gap <= self.cfg.tbt_slo.as_secs_f64()
        {
            self.r.within_slo += 1;
        }
        self.last_done = self.last_done.max(now);
        self.release(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile() -> CostProfile {
        CostProfile {
            name: "test".into(),
            source: "a test's round numbers".into(),
            prefill_tokens_per_sec: 10_000.0,
            prefill_per_kctx_ms: 0.0,
            request_overhead_ms: 0.0,
            step_base_ms: 10.0,
            step_per_seq_ms: 1.0,
            step_per_kctx_ms: 0.0,
            chunk_tokens: 4096,
            max_batch: 64,
            kv_bytes_per_token: 1000,
            load_bytes_per_sec: 1e9,
            transfer_bytes_per_sec: 1e8,
            engine_cache_tokens: 0,
            neighbour_prefill_slowdown: 0.0,
            neighbour_step_slowdown: 0.0,
        }
    }

    fn config(instances: usize, routing: Routing) -> FleetConfig {
        FleetConfig {
            instances,
            nodes: instances,
            replicas: 1,
            routing,
            prefill_instances: 0,
            split_min_tokens: 1024,
            dram_tokens: 1 << 20,
            policy: EvictionPolicy::Lru,
            ttft_slo: Duration::from_secs(2),
            tbt_slo: Duration::from_millis(100),
            early_rejection: false,
            balance: None,
            hot_reads: 0,
            hot_window: Duration::from_secs(60),
            gateway_slots: None,
            warm_up: 0,
            seed: 7,
        }
    }

    /// `n` requests: `prefixes` shared prefixes of `prefix_blocks` blocks of 256 tokens,
    /// each followed by a private block, one every `gap` seconds.
    fn workload(
        n: usize,
        prefixes: u64,
        prefix_blocks: u64,
        gap: f64,
        out: u32,
    ) -> Vec<FleetRequest> {
        let mut rng = Rng::new(3);
        (0..n)
            .map(|k| {
                let p = rng.range(0, prefixes - 1);
                let mut blocks: Vec<u64> = (0..prefix_blocks).map(|b| p * 1000 + b).collect();
                blocks.push(1_000_000 + k as u64);
                let mut block_tokens = vec![256; blocks.len()];
                *block_tokens.last_mut().unwrap() = 100;
                FleetRequest {
                    arrival: k as f64 * gap,
                    sim: SimRequest {
                        blocks,
                        block_tokens,
                        scope: 0,
                        cacheable: true,
                    },
                    output_tokens: out,
                }
            })
            .collect()
    }

    fn summary(r: &FleetResult) -> Vec<u64> {
        vec![
            r.served,
            r.rejected,
            r.within_slo,
            r.engine_hit_tokens,
            r.fabric_hit_tokens,
            r.computed_tokens,
            r.bytes_moved(),
            r.ttft.value_at_quantile(0.5),
            r.ttft.value_at_quantile(0.99),
            r.tbt.value_at_quantile(0.5),
            r.tbt.value_at_quantile(0.99),
            r.makespan.to_bits(),
        ]
    }

    #[test]
    fn a_run_is_deterministic_and_conserves_requests_tokens_and_bytes() {
        let p = profile();
        let reqs = workload(300, 12, 6, 0.02, 20);
        for (routing, split, hot) in [
            (Routing::Random, 0, 0),
            (Routing::LeastLoaded, 0, 0),
            (Routing::CacheAware, 0, 0),
            (Routing::Pool, 0, 0),
            (Routing::Pool, 0, 2),
            (Routing::Pool, 1, 0),
        ] {
            let cfg = FleetConfig {
                prefill_instances: split,
                early_rejection: true,
                hot_reads: hot,
                balance: Some(1.25),
                ..config(4, routing)
            };
            let a = run(&cfg, &p, &reqs);
            assert_eq!(
                summary(&a),
                summary(&run(&cfg, &p, &reqs)),
                "{routing:?} {split}"
            );
            // Every request is answered or refused.
            assert_eq!(a.served + a.rejected, a.requests, "{routing:?}");
            let served_out: u64 = 20 * a.served;
            assert_eq!(a.output_tokens, served_out);
            // Every prompt token was found in a cache or computed (a split's tail is
            // computed again after the hand-over).
            assert_eq!(
                a.engine_hit_tokens + a.fabric_hit_tokens + a.computed_tokens - a.tail_tokens,
                a.prompt_tokens,
                "{routing:?} {split}"
            );
            // Loads move the fabric's hits; hand-overs the split's full blocks.
            assert_eq!(
                a.bytes_loaded + a.bytes_pulled,
                a.fabric_hit_tokens * p.kv_bytes_per_token
            );
            if split == 0 {
                assert_eq!((a.bytes_handed_over, a.tail_tokens), (0, 0));
            } else {
                assert!(a.bytes_handed_over > 0 && a.tail_tokens > 0);
            }
            // Instances processed every computed token and every token after the first.
            assert_eq!(
                a.instance_tokens.iter().sum::<u64>(),
                a.computed_tokens + a.output_tokens - a.served,
                "{routing:?} {split}"
            );
            assert_eq!(a.ttft.len(), a.served);
            assert_eq!(a.tbt.len(), a.output_tokens - a.served);
        }
        // Another seed changes random routing, nothing else's answers.
        let random = config(4, Routing::Random);
        let other = FleetConfig {
            seed: 8,
            ..random.clone()
        };
        assert_ne!(
            summary(&run(&random, &p, &reqs)),
            summary(&run(&other, &p, &reqs))
        );
    }

    #[test]
    fn a_long_prefill_slows_the_decodes_batched_beside_it_and_a_split_removes_that() {
        let p = profile();
        // A chat decoding 100 tokens, and 50 ms in a 16,000-token prompt (four chunks of
        // 4,096 tokens: ~0.4 s each at 10,000 tokens/s).
        let chat = FleetRequest {
            arrival: 0.0,
            sim: SimRequest {
                blocks: vec![1],
                block_tokens: vec![200],
                scope: 0,
                cacheable: true,
            },
            output_tokens: 100,
        };
        let long = FleetRequest {
            arrival: 0.05,
            sim: SimRequest {
                blocks: (10..26).collect(),
                block_tokens: vec![1000; 16],
                scope: 0,
                cacheable: true,
            },
            output_tokens: 2,
        };
        let reqs = vec![chat, long];
        let one = run(&config(1, Routing::Pool), &p, &reqs);
        // The chat's worst gap is an iteration with a 4,095-token chunk beside it.
        let worst = one.tbt.max() as f64 / 1e6;
        assert!(worst > 0.4, "{worst}");
        // Alone, a step of a batch of one: 11 ms.
        let alone = run(&config(1, Routing::Pool), &p, &reqs[..1]);
        assert!((alone.tbt.max() as f64 / 1e6 - 0.011).abs() < 1e-3);
        // Apart: the long prompt prefills on its own instance; the chat's gaps stay small
        // but for the long request's own tail beside it.
        let split = FleetConfig {
            prefill_instances: 1,
            ..config(2, Routing::Pool)
        };
        let apart = run(&split, &p, &reqs);
        assert_eq!(apart.served, 2);
        assert!(apart.tbt.max() as f64 / 1e6 < 0.05, "{}", apart.tbt.max());
        assert!(apart.bytes_handed_over >= 15 * 1000 * 1000);
    }

    #[test]
    fn the_pool_holds_what_every_instance_would_hold_a_copy_of() {
        let p = profile();
        // 32 prefixes of 4 blocks (1,024 tokens each) over 4 instances, each node's DRAM a
        // quarter of them and a half: the pool holds them all, each instance's own DRAM only
        // 3/8 of them (routing spreads each prefix over every instance).
        let reqs = workload(1000, 32, 4, 0.05, 4);
        let dram_tokens = 32 * 1024 * 3 / 8 + 512;
        let local = run(
            &FleetConfig {
                dram_tokens,
                ..config(4, Routing::LeastLoaded)
            },
            &p,
            &reqs,
        );
        let pool = run(
            &FleetConfig {
                dram_tokens,
                ..config(4, Routing::Pool)
            },
            &p,
            &reqs,
        );
        assert!(
            pool.hit_ratio() > 1.5 * local.hit_ratio(),
            "pool {} local {}",
            pool.hit_ratio(),
            local.hit_ratio()
        );
        // Many of the pool's hits live on another node: pulled, not loaded (the conductor
        // prefers the node holding a prefix, so not all of them).
        assert!(
            pool.bytes_pulled * 4 > pool.bytes_loaded + pool.bytes_pulled,
            "pulled {} loaded {}",
            pool.bytes_pulled,
            pool.bytes_loaded
        );
    }

    /// Requests at `arrivals` with one prefix of `blocks` blocks of 1,000 tokens and a
    /// private block each.
    fn same_prefix(arrivals: &[f64], blocks: u64) -> Vec<FleetRequest> {
        arrivals
            .iter()
            .enumerate()
            .map(|(k, &arrival)| {
                let mut ids: Vec<u64> = (0..blocks).collect();
                ids.push(1_000 + k as u64);
                FleetRequest {
                    arrival,
                    sim: SimRequest {
                        block_tokens: vec![1000; ids.len()],
                        blocks: ids,
                        scope: 0,
                        cacheable: true,
                    },
                    output_tokens: 2,
                }
            })
            .collect()
    }

    #[test]
    fn a_gateway_bound_queues_requests_first_come_first_served() {
        let p = profile();
        // Six requests at once (nothing shared: each its own 1,000 tokens) on two
        // instances behind a gateway of two slots.
        let reqs = same_prefix(&[0.0, 0.001, 0.002, 0.003, 0.004, 0.005], 0);
        let mut cfg = config(2, Routing::LeastLoaded);
        cfg.gateway_slots = Some(2);
        let r = run(&cfg, &p, &reqs);
        assert_eq!((r.served, r.gateway_queued), (6, 4));
        assert!(r.gateway_wait_secs > 0.0);
        // Never more than two in flight: each routed when one before it was done, in
        // arrival order.
        let mut by_request = r.outcomes.clone();
        by_request.sort_by_key(|o| o.request);
        let mut dones: Vec<f64> = r.outcomes.iter().map(|o| o.done).collect();
        dones.sort_by(f64::total_cmp);
        for (k, o) in by_request.iter().enumerate() {
            assert!(o.routed >= o.arrival && o.first_token > o.routed && o.done >= o.first_token);
            if k >= 2 {
                assert_eq!(o.routed, dones[k - 2], "request {k}");
            }
            if k > 0 {
                assert!(o.routed >= by_request[k - 1].routed);
            }
        }
        // Without the bound, every request is routed as it arrives, and they end sooner (the
        // engines batch them; with a shared prefix, the bound's later requests would find
        // it in the fabric instead).
        cfg.gateway_slots = None;
        let free = run(&cfg, &p, &reqs);
        assert_eq!((free.served, free.gateway_queued), (6, 0));
        assert!(free.outcomes.iter().all(|o| o.routed == o.arrival));
        assert!(
            free.makespan < r.makespan,
            "{} {}",
            free.makespan,
            r.makespan
        );
    }

    #[test]
    fn a_prompt_finds_in_the_engine_what_was_computed_after_it_was_routed() {
        let mut p = profile();
        p.engine_cache_tokens = 100_000;
        // One instance, two prompts with the same 4,000-token prefix 1 ms apart: the second
        // arrives while the first prefills and is scheduled after it, by when the engine's
        // own cache holds the prefix (as vLLM's scheduler finds it).
        let reqs = same_prefix(&[0.0, 0.001], 4);
        let r = run(&config(1, Routing::LeastLoaded), &p, &reqs);
        assert_eq!(r.served, 2);
        assert_eq!(r.late_engine_hit_tokens, 4000);
        assert_eq!(r.engine_hit_tokens, 4000);
        assert_eq!(r.computed_tokens, 4000 + 2 * 1000);
        // Conserved: every prompt token a hit or computed.
        assert_eq!(
            r.engine_hit_tokens + r.fabric_hit_tokens + r.computed_tokens,
            r.prompt_tokens
        );
    }

    #[test]
    fn warm_up_requests_run_but_are_left_out_of_the_figures() {
        let p = profile();
        let reqs = workload(40, 2, 4, 0.05, 8);
        let cold = run(&config(2, Routing::LeastLoaded), &p, &reqs);
        let mut cfg = config(2, Routing::LeastLoaded);
        cfg.warm_up = 10;
        let warm = run(&cfg, &p, &reqs);
        // The same run: the same work done, the same requests served.
        assert_eq!(warm.served, cold.served);
        assert_eq!(warm.computed_tokens, cold.computed_tokens);
        assert_eq!(warm.outcomes, cold.outcomes);
        // Only the last 30 in the latency figures.
        assert_eq!(warm.ttft.len(), 30);
        assert_eq!(warm.tbt.len(), 30 * 7);
        assert!(warm.within_slo <= 30);
    }

    #[test]
    fn a_servers_own_time_delays_the_first_token_without_occupying_the_engine() {
        let mut p = profile();
        let reqs = same_prefix(&[0.0], 1);
        let plain = run(&config(1, Routing::LeastLoaded), &p, &reqs);
        p.request_overhead_ms = 30.0;
        let slow = run(&config(1, Routing::LeastLoaded), &p, &reqs);
        let (a, b) = (&plain.outcomes[0], &slow.outcomes[0]);
        assert!(((b.first_token - a.first_token) - 0.030).abs() < 1e-6);
        // The decode after it is unchanged.
        assert!(((b.done - b.first_token) - (a.done - a.first_token)).abs() < 1e-9);
    }

    #[test]
    fn a_busy_neighbour_on_the_same_node_slows_an_iteration_by_the_profiles_share() {
        let mut p = profile();
        // Two requests 10 ms apart, 2,000 tokens each (0.2 s of prefill), on two instances.
        let reqs = same_prefix(&[0.0, 0.01], 1);
        let mut one_node = config(2, Routing::LeastLoaded);
        one_node.nodes = 1;
        let plain = run(&one_node, &p, &reqs);
        p.neighbour_prefill_slowdown = 0.5;
        p.neighbour_step_slowdown = 0.2;
        let shared = run(&one_node, &p, &reqs);
        let apart = run(&config(2, Routing::LeastLoaded), &p, &reqs);
        let ttft = |r: &FleetResult, k: usize| r.outcomes[k].first_token - r.outcomes[k].arrival;
        assert_ne!(shared.outcomes[0].instance, shared.outcomes[1].instance);
        // The first started alone; the second started while the first prefilled, so its
        // prefill took half as long again and its iteration's fixed part a fifth longer.
        assert!((ttft(&shared, 0) - ttft(&plain, 0)).abs() < 1e-9);
        let want = ttft(&plain, 1) + 0.5 * 0.2 + 0.2 * p.step_base_ms / 1e3;
        assert!(
            (ttft(&shared, 1) - want).abs() < 1e-6,
            "{} {want}",
            ttft(&shared, 1)
        );
        // On nodes of their own, nothing is shared.
        assert_eq!(apart.outcomes, plain.outcomes);
    }

    #[test]
    fn a_request_whose_prefix_is_being_computed_waits_for_it_with_the_pool() {
        let p = profile();
        // Two requests 10 ms apart with the same 8,000-token prefix (0.8 s to prefill).
        let reqs = same_prefix(&[0.0, 0.01], 8);
        let pool = run(&config(2, Routing::Pool), &p, &reqs);
        assert_eq!((pool.served, pool.coalesced), (2, 1));
        // The second read the whole prefix the first computed (after it was written).
        assert_eq!(pool.fabric_hit_tokens + pool.engine_hit_tokens, 8000);
        assert_eq!(pool.computed_tokens, 8000 + 2 * 1000);
        // Each instance keeping its own KV computes it twice.
        let own = run(&config(2, Routing::CacheAware), &p, &reqs);
        assert_eq!((own.coalesced, own.computed_tokens), (0, 2 * 9000));
    }

    #[test]
    fn a_block_pulled_often_gets_a_replica_where_it_is_read() {
        let mut p = profile();
        p.engine_cache_tokens = 0;
        // One instance on each of two nodes, the second's requests all pulling a prefix
        // whose home is the first node... or the second: count what moves either way.
        let reqs = same_prefix(&(0..12).map(|k| f64::from(k) * 2.0).collect::<Vec<_>>(), 4);
        let cfg = |hot_reads| FleetConfig {
            hot_reads,
            routing: Routing::Pool,
            ..config(2, Routing::Pool)
        };
        let off = run(&cfg(0), &p, &reqs);
        let on = run(&cfg(3), &p, &reqs);
        assert_eq!(off.hot_replicas, 0);
        assert!(on.hot_replicas > 0, "{}", on.hot_replicas);
        // Same hits; fewer of them pulled from the other node.
        assert_eq!(on.fabric_hit_tokens, off.fabric_hit_tokens);
        assert!(
            on.bytes_pulled < off.bytes_pulled,
            "on {} off {}",
            on.bytes_pulled,
            off.bytes_pulled
        );
    }

    #[test]
    fn a_pull_waits_for_its_senders_link() {
        let mut p = profile();
        p.engine_cache_tokens = 0;
        // Many instances (a node each) reading one prefix at once: the node holding it
        // sends to one at a time.
        let mut reqs = same_prefix(&[0.0], 8);
        reqs.extend(
            same_prefix(&[10.0; 6], 8)
                .into_iter()
                .enumerate()
                .map(|(k, mut r)| {
                    r.sim.blocks[8] = 5_000 + k as u64;
                    r
                }),
        );
        let cfg = FleetConfig {
            balance: Some(1.0),
            ..config(8, Routing::Pool)
        };
        let r = run(&cfg, &p, &reqs);
        assert_eq!(r.served, 7);
        assert!(r.bytes_pulled > 0);
        assert!(r.egress_wait_secs > 0.0, "{}", r.egress_wait_secs);
    }

    #[test]
    fn a_balance_bound_spreads_a_hot_prefix_and_costs_each_instance_its_own_copy() {
        let mut p = profile();
        p.engine_cache_tokens = 0;
        // Four prefixes, one of them in most requests, at a rate that queues on one instance.
        let mut rng = Rng::new(5);
        let reqs: Vec<FleetRequest> = (0..600)
            .map(|k| {
                let prefix = if rng.range(0, 9) < 7 {
                    0
                } else {
                    rng.range(1, 3)
                };
                let mut ids: Vec<u64> = (0..6).map(|b| prefix * 100 + b).collect();
                ids.push(10_000 + k);
                FleetRequest {
                    arrival: k as f64 * 0.01,
                    sim: SimRequest {
                        block_tokens: vec![256; ids.len()],
                        blocks: ids,
                        scope: 0,
                        cacheable: true,
                    },
                    output_tokens: 8,
                }
            })
            .collect();
        let cfg = |routing, balance| FleetConfig {
            balance,
            dram_tokens: 6 * 256 * 2,
            ..config(4, routing)
        };
        let free = run(&cfg(Routing::CacheAware, None), &p, &reqs);
        let bound = run(&cfg(Routing::CacheAware, Some(1.25)), &p, &reqs);
        let pool = run(&cfg(Routing::Pool, Some(1.25)), &p, &reqs);
        assert!(
            bound.load_imbalance() < free.load_imbalance(),
            "bound {} free {}",
            bound.load_imbalance(),
            free.load_imbalance()
        );
        // The pool keeps its hits at the same balance.
        assert!(
            pool.hit_ratio() > bound.hit_ratio(),
            "pool {} cache-aware {}",
            pool.hit_ratio(),
            bound.hit_ratio()
        );
    }

    #[test]
    fn spaced_out_requests_hit_as_simulate_cache_says() {
        use cache_fabric::simulate::replay_sized;
        let mut p = profile();
        p.engine_cache_tokens = 0;
        // Requests far apart (every write lands before the next read), in a pool smaller
        // than the working set.
        let reqs: Vec<FleetRequest> = workload(400, 24, 5, 100.0, 2);
        let dram_tokens = 24 * 5 * 256 / 3;
        let cfg = FleetConfig {
            instances: 3,
            nodes: 3,
            replicas: 1,
            routing: Routing::Pool,
            prefill_instances: 0,
            split_min_tokens: 1024,
            dram_tokens,
            policy: EvictionPolicy::DEFAULT,
            ttft_slo: Duration::from_secs(3600),
            tbt_slo: Duration::from_secs(3600),
            early_rejection: false,
            balance: None,
            hot_reads: 0,
            hot_window: Duration::from_secs(60),
            gateway_slots: None,
            warm_up: 0,
            seed: 1,
        };
        let fleet = run(&cfg, &p, &reqs);
        let sims: Vec<SimRequest> = reqs.iter().map(|r| r.sim.clone()).collect();
        let cache = replay_sized(
            &sims,
            SimCapacity {
                dram: dram_tokens * 3,
                lower: 0,
                per_token: true,
            },
            EvictionPolicy::DEFAULT,
        );
        assert!(
            (fleet.hit_ratio() - cache.token_hit_ratio()).abs() < 0.01,
            "fleet {} simulate-cache {}",
            fleet.hit_ratio(),
            cache.token_hit_ratio()
        );
    }
}
