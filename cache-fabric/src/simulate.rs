//! Replay of a request trace through the store's own eviction and admission code, without an
//! engine: how many prompt blocks would have been read from the cache.
//!
//! The trace format is Mooncake's (`../shared/traces/`): one JSON object per line with
//! `hash_ids`, the prompt's blocks in order, where equal ids mean equal prefixes. Each
//! request reads the longest stored prefix of its chain (those blocks are hits), then writes
//! the whole chain as one best-effort entry (automatic caching), with the policy deciding
//! what is admitted and what is evicted. Capacity is counted in blocks, or in tokens (a
//! block takes its token count: a byte budget divided by a KV dtype's bytes per token, see
//! [`SimCapacity`]); a lower tier (the local disk) can sit under DRAM, taking what DRAM
//! evicts and serving it back. TTLs are long enough never to expire within a trace, so
//! capacity is the only pressure.
//!
//! The prefix hit ratio is hits over all blocks of all requests.

use std::io::BufRead;
use std::time::Duration;

use bytes::Bytes;
use cachet_common::{BlockHash, Scope, TenantId, WorkspaceId};
use sha2::{Digest, Sha256};
use tokio::time::Instant;

use crate::policy::EvictionPolicy;
use crate::store::{EntryKind, PutBlock, Store, StoreLimits, WriteRefused};
use crate::tier::DramTier;

/// The simulated node's size.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimCapacity {
    /// DRAM, in units.
    pub dram: u64,
    /// The tier under DRAM (the local disk), in units; 0: none.
    pub lower: u64,
    /// A unit is a token (each block takes its token count) instead of a block.
    pub per_token: bool,
}

impl SimCapacity {
    /// DRAM only, counted in blocks.
    pub fn blocks(n: u64) -> Self {
        Self {
            dram: n,
            lower: 0,
            per_token: false,
        }
    }
}

/// One request: its blocks' ids, in prompt order.
pub type Request = Vec<u64>;

/// Read a Mooncake-format trace (`{"hash_ids": [...], ...}` per line).
pub fn read_trace(reader: impl BufRead) -> Result<Vec<Request>, String> {
    #[derive(serde::Deserialize)]
    struct Line {
        hash_ids: Vec<u64>,
    }
    let mut out = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let line = line.map_err(|e| format!("line {}: {e}", i + 1))?;
        if line.trim().is_empty() {
            continue;
        }
        let l: Line = serde_json::from_str(&line)
            .map_err(|e| format!("line {}: not a trace record with hash_ids: {e}", i + 1))?;
        out.push(l.hash_ids);
    }
    Ok(out)
}

/// One request with what the service would make of it: whose cache it uses, its blocks'
/// token counts, and whether it is long enough to be cached at all.
#[derive(Clone, Debug, PartialEq)]
pub struct SimRequest {
    pub blocks: Vec<u64>,
    /// Tokens of each block (the prompt's last block is usually partial).
    pub block_tokens: Vec<u32>,
    /// The tenant (cache scope) index: scopes never share blocks.
    pub scope: u32,
    /// Below the model's minimum cacheable length a prompt neither reads nor writes.
    pub cacheable: bool,
}

impl SimRequest {
    /// A request of whole, one-token blocks in scope 0 (the plain trace view).
    pub fn blocks(blocks: Vec<u64>) -> Self {
        let n = blocks.len();
        Self {
            blocks,
            block_tokens: vec![1; n],
            scope: 0,
            cacheable: true,
        }
    }
}

/// What one replay measured.
#[derive(Clone, Debug, PartialEq)]
pub struct SimResult {
    pub policy: String,
    pub capacity_blocks: u64,
    pub requests: u64,
    pub blocks: u64,
    pub hit_blocks: u64,
    /// Prompt tokens, and those read from the cache.
    pub tokens: u64,
    pub hit_tokens: u64,
    /// Entries the policy declined to store.
    pub not_admitted: u64,
    /// Hit blocks the lower tier served.
    pub lower_hit_blocks: u64,
    /// The adaptive policy's step on its ladder at the end, and its moves.
    pub adaptive: Option<(usize, u64)>,
}

impl SimResult {
    pub fn hit_ratio(&self) -> f64 {
        if self.blocks == 0 {
            0.0
        } else {
            self.hit_blocks as f64 / self.blocks as f64
        }
    }

    /// Hits weighted by tokens: what a replay against the service reports as its hit ratio.
    pub fn token_hit_ratio(&self) -> f64 {
        if self.tokens == 0 {
            0.0
        } else {
            self.hit_tokens as f64 / self.tokens as f64
        }
    }
}

/// A uniformly distributed block hash for a trace id in a scope (the store and the frequency
/// sketch expect SHA-256 output; the service puts the scope in every block's hash too).
///
/// The key covers the block's token count, as the service's does (a breakpoint inside a
/// block is a tail entry keyed over its partial tokens): a prompt's partial last block is
/// its own entry, and a later prompt with that block whole does not read it. A trace may give
/// the partial and the whole block one id (the synthetic chat turns do), but only the tokens
/// an earlier request computed can be read.
fn block_hash(scope: u32, id: u64, tokens: u32) -> BlockHash {
    let mut h = Sha256::new();
    h.update(id.to_le_bytes());
    if scope > 0 {
        h.update(scope.to_le_bytes());
    }
    h.update(tokens.to_le_bytes());
    BlockHash(h.finalize().into())
}

/// Replay `trace` through a store holding `capacity_blocks` blocks under `policy`.
pub fn replay(trace: &[Request], capacity_blocks: u64, policy: EvictionPolicy) -> SimResult {
    let reqs: Vec<SimRequest> = trace
        .iter()
        .map(|r| SimRequest::blocks(r.clone()))
        .collect();
    replay_requests(&reqs, capacity_blocks, policy)
}

/// Replay requests with scopes, token counts and the minimum length through a store holding
/// `capacity_blocks` blocks under `policy`.
pub fn replay_requests(
    trace: &[SimRequest],
    capacity_blocks: u64,
    policy: EvictionPolicy,
) -> SimResult {
    replay_sized(trace, SimCapacity::blocks(capacity_blocks), policy)
}

/// One simulated cache (a node's DRAM, or an engine's own prefix cache): the store's own
/// eviction and admission over a request's chain of trace blocks, keyed as
/// [`replay_sized`] keys them. The fleet simulator keeps one per instance or one pool.
pub struct SimCache {
    store: Store,
    per_token: bool,
    /// Block contents by length (a block's bytes are its size in units).
    contents: std::collections::HashMap<u32, Bytes>,
    scopes: Vec<Scope>,
    now: Instant,
}

/// What [`SimCache::put`] did with a chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Put {
    Stored,
    /// The policy declined it.
    NotAdmitted,
    /// Longer than the whole capacity.
    TooLarge,
}

impl SimCache {
    pub fn new(capacity: SimCapacity, policy: EvictionPolicy) -> Self {
        let mut store = Store::new(StoreLimits {
            capacity_bytes: capacity.dram,
            policy,
        });
        if capacity.lower > 0 {
            store = store.with_lower_tier(Box::new(DramTier::new(capacity.lower)));
        }
        Self {
            store,
            per_token: capacity.per_token,
            contents: std::collections::HashMap::new(),
            scopes: Vec::new(),
            now: Instant::now(),
        }
    }

    /// Scope `i`, the same ids in every run (the store's order never depends on chance).
    fn scope(&mut self, i: u32) -> Scope {
        while self.scopes.len() <= i as usize {
            let n = self.scopes.len() as u128 + 1;
            self.scopes.push(Scope {
                tenant: TenantId(uuid::Uuid::from_u128(n)),
                workspace: WorkspaceId(uuid::Uuid::from_u128(n << 64)),
            });
        }
        self.scopes[i as usize]
    }

    fn chain(req: &SimRequest) -> Vec<BlockHash> {
        req.blocks
            .iter()
            .zip(&req.block_tokens)
            .map(|(&id, &tokens)| block_hash(req.scope, id, tokens))
            .collect()
    }

    /// The leading blocks of `req` held (each read, as a hit: refreshed for the policy).
    pub fn read(&mut self, req: &SimRequest) -> usize {
        let scope = self.scope(req.scope);
        self.store
            .get_chain(&scope, &Self::chain(req), self.now)
            .len()
    }

    /// How many leading blocks of `req` are held, without reading them.
    pub fn peek(&mut self, req: &SimRequest) -> usize {
        let scope = self.scope(req.scope);
        self.store
            .leading_present(&scope, &Self::chain(req), self.now)
    }

    /// Store `req`'s chain from block `from` on (the first `from` are held), as one
    /// best-effort entry.
    pub fn put(&mut self, req: &SimRequest, from: usize) -> Put {
        let chain = Self::chain(req);
        if from >= chain.len() {
            return Put::Stored;
        }
        let scope = self.scope(req.scope);
        let new: Vec<PutBlock> = (from..chain.len())
            .map(|i| {
                let parent = i.checked_sub(1).map(|p| chain[p]);
                let units = if self.per_token {
                    req.block_tokens.get(i).copied().unwrap_or(1).max(1)
                } else {
                    1
                };
                let data = self
                    .contents
                    .entry(units)
                    .or_insert_with(|| Bytes::from(vec![0u8; units as usize]))
                    .clone();
                PutBlock::new(chain[i], parent, units, data)
            })
            .collect();
        let ttl = Duration::from_secs(365 * 24 * 3600);
        match self.store.put_entry(
            &scope,
            &chain[..from],
            new,
            ttl,
            self.now,
            EntryKind::BestEffort,
        ) {
            Ok(()) => Put::Stored,
            Err(WriteRefused::NotAdmitted) => Put::NotAdmitted,
            Err(_) => Put::TooLarge,
        }
    }

    /// Hits the tier under DRAM has served so far.
    pub fn lower_tier_reads(&self) -> u64 {
        self.store.lower_tier_reads()
    }

    pub fn adaptive_state(&self) -> Option<(usize, u64)> {
        self.store.adaptive_state()
    }
}

/// Replay requests through a node of `capacity` under `policy`.
pub fn replay_sized(
    trace: &[SimRequest],
    capacity: SimCapacity,
    policy: EvictionPolicy,
) -> SimResult {
    let mut cache = SimCache::new(capacity, policy);
    let mut r = SimResult {
        policy: policy.to_string(),
        capacity_blocks: capacity.dram,
        requests: trace.len() as u64,
        blocks: 0,
        hit_blocks: 0,
        tokens: 0,
        hit_tokens: 0,
        not_admitted: 0,
        lower_hit_blocks: 0,
        adaptive: None,
    };
    for req in trace {
        r.blocks += req.blocks.len() as u64;
        r.tokens += req.block_tokens.iter().map(|&t| t as u64).sum::<u64>();
        if !req.cacheable {
            continue;
        }
        let lower_before = cache.lower_tier_reads();
        let hits = cache.read(req);
        r.hit_blocks += hits as u64;
        r.lower_hit_blocks += cache.lower_tier_reads() - lower_before;
        r.hit_tokens += req.block_tokens[..hits]
            .iter()
            .map(|&t| t as u64)
            .sum::<u64>();
        if cache.put(req, hits) == Put::NotAdmitted {
            r.not_admitted += 1;
        }
    }
    r.adaptive = cache.adaptive_state();
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_mooncake_lines_and_reports_bad_ones() {
        let t = "{\"timestamp\": 0, \"input_length\": 9, \"hash_ids\": [0, 1, 2]}\n\n{\"hash_ids\": [0, 3]}\n";
        assert_eq!(
            read_trace(t.as_bytes()).unwrap(),
            vec![vec![0, 1, 2], vec![0, 3]]
        );
        let err = read_trace("{\"hash_ids\": [0]}\nnot json\n".as_bytes()).unwrap_err();
        assert!(err.starts_with("line 2:"), "{err}");
    }

    #[test]
    fn prefix_hits_are_counted_from_the_start_of_each_chain() {
        // Request 2 shares [0, 1] with request 1; request 3 shares only [0] (its second
        // block differs, so its third block is no hit though id 2 is stored).
        let trace = vec![vec![0, 1, 2], vec![0, 1, 5], vec![0, 9, 2]];
        for policy in [EvictionPolicy::Lru, EvictionPolicy::DEFAULT] {
            let r = replay(&trace, 100, policy);
            assert_eq!((r.blocks, r.hit_blocks), (9, 3), "{policy:?}");
        }
    }

    #[test]
    fn scopes_share_nothing_and_short_prompts_neither_read_nor_write() {
        let req = |blocks: Vec<u64>, scope, cacheable| SimRequest {
            block_tokens: vec![10; blocks.len()],
            blocks,
            scope,
            cacheable,
        };
        let trace = vec![
            req(vec![0, 1], 0, true),
            req(vec![0, 1, 2], 1, true), // another tenant: no hit
            req(vec![0, 1, 3], 0, true), // hits [0, 1]
            req(vec![0], 0, false),      // too short to use the cache
            req(vec![0, 1, 2], 1, true), // hits all three
        ];
        let r = replay_requests(&trace, 100, EvictionPolicy::Lru);
        assert_eq!((r.blocks, r.hit_blocks), (12, 5));
        assert_eq!((r.tokens, r.hit_tokens), (120, 50));
        assert!((r.token_hit_ratio() - 50.0 / 120.0).abs() < 1e-12);
    }

    #[test]
    fn a_partial_block_is_read_only_by_a_prompt_that_ends_there_too() {
        let req = |blocks: Vec<u64>, block_tokens: Vec<u32>| SimRequest {
            blocks,
            block_tokens,
            scope: 0,
            cacheable: true,
        };
        let trace = vec![
            // A turn ends 30 tokens into block 2.
            req(vec![0, 1, 2], vec![64, 64, 30]),
            // The next turn has block 2 whole: [0, 1] are hits, block 2's 34 more tokens were
            // never computed, so it is no hit (nor is anything after it).
            req(vec![0, 1, 2, 3], vec![64, 64, 64, 10]),
            // The first prompt again: all three, its partial block included.
            req(vec![0, 1, 2], vec![64, 64, 30]),
            // The second again: all four.
            req(vec![0, 1, 2, 3], vec![64, 64, 64, 10]),
        ];
        let r = replay_requests(&trace, 100, EvictionPolicy::Lru);
        assert_eq!(r.hit_blocks, 2 + 3 + 4, "{r:?}");
        assert_eq!(r.hit_tokens, 128 + 158 + 202, "{r:?}");
    }

    #[test]
    fn one_off_scans_push_hot_blocks_out_of_lru_but_not_out_of_frequency() {
        // Three hot prompts, then five prompts seen once, over and over, with room for
        // four blocks: under LRU every scan flushes the hot blocks; the frequency policy
        // keeps them, and the one-off blocks only ever displace each other.
        let trace = scans(50);
        let lru = replay(&trace, 4, EvictionPolicy::Lru);
        let freq = replay(&trace, 4, EvictionPolicy::FREQUENCY);
        assert_eq!(lru.hit_blocks, 0, "{lru:?}");
        assert!(freq.hit_blocks >= 3 * 45, "{freq:?}");
    }

    fn scans(rounds: u64) -> Vec<Request> {
        let mut trace: Vec<Request> = Vec::new();
        for round in 0..rounds {
            trace.extend((0..3).map(|h| vec![h]));
            trace.extend((0..5).map(|i| vec![1000 + round * 5 + i]));
        }
        trace
    }

    /// Conversations: each turn reads the whole conversation so far and adds a block; eight
    /// sessions at a time, their turns interleaved, a new one starting when one ends. A
    /// finished session is never read again, so what counts is recency.
    fn sessions(n: u64, turns: u64) -> Vec<Request> {
        let mut rng = 7u64;
        let mut active: Vec<(u64, u64)> = (0..8).map(|s| (s, 0)).collect();
        let mut next = 8;
        let mut trace = Vec::new();
        while !active.is_empty() {
            rng = rng
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let i = ((rng >> 33) % active.len() as u64) as usize;
            let (s, t) = &mut active[i];
            *t += 1;
            let s = *s;
            trace.push(
                std::iter::once(0)
                    .chain((1..=*t).map(|k| 1_000_000 + s * 1000 + k))
                    .collect(),
            );
            if *t == turns {
                if next < n {
                    active[i] = (next, 0);
                    next += 1;
                } else {
                    active.swap_remove(i);
                }
            }
        }
        trace
    }

    #[test]
    fn the_adaptive_policy_learns_frequency_under_scans_and_recency_in_conversations() {
        // Scans: it climbs to where the hot blocks stay.
        let trace = scans(4000);
        let freq = replay(&trace, 4, EvictionPolicy::FREQUENCY);
        let lru = replay(&trace, 4, EvictionPolicy::Lru);
        let adaptive = replay(&trace, 4, EvictionPolicy::Adaptive);
        assert!(lru.hit_blocks < freq.hit_blocks / 10, "{lru:?} {freq:?}");
        assert!(
            adaptive.hit_blocks * 100 >= freq.hit_blocks * 90,
            "{adaptive:?} vs {freq:?}"
        );
        assert!(adaptive.adaptive.is_some_and(|(step, _)| step > 0));
        // Conversations: it stays with recency, where frequency loses.
        let trace = sessions(120, 30);
        let cap = 200;
        let freq = replay(&trace, cap, EvictionPolicy::FREQUENCY);
        let lru = replay(&trace, cap, EvictionPolicy::Lru);
        let adaptive = replay(&trace, cap, EvictionPolicy::Adaptive);
        assert!(
            freq.hit_ratio() < lru.hit_ratio() - 0.05,
            "the workload tells them apart: {freq:?} {lru:?}"
        );
        assert!(
            adaptive.hit_ratio() >= lru.hit_ratio() - 0.005,
            "{adaptive:?} vs {lru:?}"
        );
    }
}
