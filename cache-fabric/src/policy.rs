//! Which cached blocks to keep: the eviction order and, for best-effort entries, admission.
//!
//! Every block carries an *eviction key*, assigned each time it is used; capacity eviction
//! takes the evictable leaf with the smallest key (chain tails before their ancestors, see
//! [`crate::store`]). The policy decides the key:
//!
//! - [`EvictionPolicy::Lru`]: the use's sequence number — least recently used first.
//! - [`EvictionPolicy::Frequency`]: the sequence number plus `ln(frequency) × horizon`, where
//!   the frequency is the block's estimated number of uses in the recent past, including uses
//!   while it was not stored ([`FrequencySketch`], a TinyLFU-style count-min sketch with
//!   periodic halving). A block used `f` times outranks one used once as if it had been used
//!   `ln(f) × horizon` uses later. This is LRFU-style ranking on TinyLFU's frequency
//!   estimate; `horizon` is `horizon_factor ×` the number of stored blocks.
//!
//! Admission (best-effort entries only, i.e. automatic caching): an entry whose first new
//! block would rank below the block it has to evict is not stored (and so not billed as a
//! write). Most blocks of a conversation trace are used once; without admission each of them
//! pushes out a block that would have been used again.
//!
//! `cachet loadtest simulate-cache` replays a trace through this code (docs/benchmarks.md).

use std::collections::BTreeSet;

use cachet_common::{BlockHash, BlockMap};

/// How blocks are ranked for capacity eviction.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum EvictionPolicy {
    /// Least recently used first; every entry is admitted.
    Lru,
    /// Frequency-aware ranking with admission of best-effort entries.
    Frequency {
        /// Weight of frequency against recency, in multiples of the stored block count.
        horizon_factor: f64,
    },
    /// Frequency-aware ranking whose horizon factor is learned online ([`Climber`]): from
    /// 0 (LRU) up the [`LADDER`], moved towards whichever of two shadow caches at the
    /// neighbouring settings hit more on the requests this node saw.
    Adaptive,
}

impl EvictionPolicy {
    /// The default: adaptive (docs/benchmarks.md compares it with every fixed policy over
    /// several workloads; decision 0018).
    pub const DEFAULT: EvictionPolicy = EvictionPolicy::Adaptive;

    /// The fixed frequency policy that was the default before the adaptive one.
    pub const FREQUENCY: EvictionPolicy = EvictionPolicy::Frequency {
        horizon_factor: 10.0,
    };

    /// `adaptive`, `lru`, `frequency`, or `frequency:<horizon factor>`.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s.split_once(':') {
            None if s == "adaptive" => Ok(EvictionPolicy::Adaptive),
            None if s == "lru" => Ok(EvictionPolicy::Lru),
            None if s == "frequency" => Ok(EvictionPolicy::FREQUENCY),
            Some(("frequency", f)) => match f.parse::<f64>() {
                Ok(v) if v.is_finite() && v >= 0.0 => {
                    Ok(EvictionPolicy::Frequency { horizon_factor: v })
                }
                _ => Err(format!("{f:?} is not a horizon factor (a number >= 0)")),
            },
            _ => Err(format!(
                "{s:?} is not an eviction policy; available: adaptive, lru, frequency, frequency:<factor>"
            )),
        }
    }
}

/// The form [`EvictionPolicy::parse`] reads: `lru` or `frequency:<horizon factor>`.
impl std::fmt::Display for EvictionPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EvictionPolicy::Adaptive => f.write_str("adaptive"),
            EvictionPolicy::Lru => f.write_str("lru"),
            EvictionPolicy::Frequency { horizon_factor } => write!(f, "frequency:{horizon_factor}"),
        }
    }
}

impl Default for EvictionPolicy {
    fn default() -> Self {
        EvictionPolicy::DEFAULT
    }
}

const ROWS: usize = 4;
/// Counters saturate here (4-bit counters, as in TinyLFU).
const MAX_COUNT: u8 = 15;

/// A count-min sketch of block uses: `ROWS` rows of small saturating counters indexed by
/// independent words of the block hash (already uniformly distributed). All counters are
/// halved every `reset_after` recorded uses, so the estimate follows the recent past.
pub struct FrequencySketch {
    rows: Vec<Vec<u8>>,
    mask: usize,
    samples: u64,
}

impl FrequencySketch {
    /// `width` counters per row, rounded up to a power of two.
    pub fn new(width: usize) -> Self {
        let width = width.max(64).next_power_of_two();
        Self {
            rows: vec![vec![0; width]; ROWS],
            mask: width - 1,
            samples: 0,
        }
    }

    fn index(&self, hash: &BlockHash, row: usize) -> usize {
        let w = &hash.0[row * 8..row * 8 + 8];
        u64::from_le_bytes(w.try_into().expect("8 bytes")) as usize & self.mask
    }

    /// Record one use and return the new estimate; halves every counter once `reset_after`
    /// uses have been recorded.
    pub fn record(&mut self, hash: &BlockHash, reset_after: u64) -> u8 {
        let mut min = MAX_COUNT;
        for r in 0..ROWS {
            let i = self.index(hash, r);
            let c = &mut self.rows[r][i];
            *c = (*c + 1).min(MAX_COUNT);
            min = min.min(*c);
        }
        self.samples += 1;
        if self.samples >= reset_after {
            self.samples = 0;
            for row in &mut self.rows {
                for c in row.iter_mut() {
                    *c /= 2;
                }
            }
            return self.estimate(hash);
        }
        min
    }

    /// Estimated recent uses (never below 1).
    pub fn estimate(&self, hash: &BlockHash) -> u8 {
        (0..ROWS)
            .map(|r| self.rows[r][self.index(hash, r)])
            .min()
            .unwrap_or(0)
            .max(1)
    }
}

/// Eviction keys for one store.
pub struct Ranking {
    policy: EvictionPolicy,
    sketch: Option<FrequencySketch>,
    climber: Option<Climber>,
}

/// Sketch width: 4 × 2^18 counters (1 MiB), enough that blocks seen once rarely collide
/// with hot ones at the block counts one node holds.
const SKETCH_WIDTH: usize = 1 << 18;

impl Ranking {
    pub fn new(policy: EvictionPolicy) -> Self {
        let sketch = match policy {
            EvictionPolicy::Lru => None,
            _ => Some(FrequencySketch::new(SKETCH_WIDTH)),
        };
        let climber = (policy == EvictionPolicy::Adaptive).then(Climber::new);
        Self {
            policy,
            sketch,
            climber,
        }
    }

    pub fn policy(&self) -> EvictionPolicy {
        self.policy
    }

    /// The horizon factor in force: fixed, or the adaptive policy's current setting.
    pub fn horizon_factor(&self) -> f64 {
        match (self.policy, &self.climber) {
            (EvictionPolicy::Frequency { horizon_factor }, _) => horizon_factor,
            (_, Some(c)) => c.horizon_factor(),
            _ => 0.0,
        }
    }

    /// Show the adaptive policy a prefix read of `chain` (before the store serves it) on a
    /// node holding about `capacity_blocks` blocks; `true` when its setting moved (stored
    /// blocks' keys are then stale: see [`Ranking::rekey`]). A no-op for fixed policies.
    pub fn observe_chain(&mut self, chain: &[BlockHash], capacity_blocks: usize) -> bool {
        match (&mut self.climber, &self.sketch) {
            (Some(c), Some(s)) => c.observe(chain, s, capacity_blocks.max(1)),
            _ => false,
        }
    }

    /// The key of a stored block last used at `tick`, under the current setting.
    pub fn rekey(&self, hash: &BlockHash, tick: u64, stored: usize) -> u64 {
        let f = self.sketch.as_ref().map_or(1, |s| s.estimate(hash));
        self.key(f, tick, stored)
    }

    /// Record a use of `hash` at sequence number `tick` (with `stored` blocks resident) and
    /// return its eviction key.
    pub fn use_key(&mut self, hash: &BlockHash, tick: u64, stored: usize) -> u64 {
        let f = self.record(hash, stored);
        self.key(f, tick, stored)
    }

    /// The key a block would get if used now, without recording the use.
    pub fn prospective_key(&self, hash: &BlockHash, tick: u64, stored: usize) -> u64 {
        let f = match &self.sketch {
            Some(s) => s.estimate(hash).saturating_add(1).min(MAX_COUNT),
            None => 1,
        };
        self.key(f, tick, stored)
    }

    /// Record a use that stores nothing (a refused entry's blocks still count as seen).
    pub fn record(&mut self, hash: &BlockHash, stored: usize) -> u8 {
        match &mut self.sketch {
            Some(s) => s.record(hash, reset_after(stored)).max(1),
            None => 1,
        }
    }

    fn key(&self, frequency: u8, tick: u64, stored: usize) -> u64 {
        frequency_key(self.horizon_factor(), frequency, tick, stored)
    }

    /// A block's estimated recent uses (`None` under LRU, which does not count them).
    pub fn estimate(&self, hash: &BlockHash) -> Option<u8> {
        self.sketch.as_ref().map(|s| s.estimate(hash))
    }

    /// The adaptive policy's step on [`LADDER`] and its moves so far (`None` for a fixed
    /// policy).
    pub fn adaptive_state(&self) -> Option<(usize, u64)> {
        self.climber.as_ref().map(|c| (c.step, c.moves))
    }

    /// Test hook: put the adaptive policy at `step` (clamped to the ladder).
    #[doc(hidden)]
    pub fn set_adaptive_step_for_test(&mut self, step: usize) {
        if let Some(c) = &mut self.climber {
            c.step = step.min(LADDER.len() - 1);
        }
    }

    /// Whether admission applies to best-effort entries.
    pub fn admits_selectively(&self) -> bool {
        self.horizon_factor() > 0.0 || self.climber.is_some()
    }
}

/// Halve the sketch after ten uses per stored block (at least 4,096 blocks' worth).
fn reset_after(stored: usize) -> u64 {
    10 * stored.max(4096) as u64
}

/// The eviction key of a use at `tick` of a block used `frequency` times recently.
fn frequency_key(horizon_factor: f64, frequency: u8, tick: u64, stored: usize) -> u64 {
    if horizon_factor <= 0.0 {
        return tick;
    }
    let horizon = horizon_factor * stored.max(1) as f64;
    tick + ((frequency.max(1) as f64).ln() * horizon) as u64
}

/// The horizon factors the adaptive policy chooses between: 0 is LRU (every entry admitted,
/// since a new use always outranks an old one), each step up weighs frequency twice as
/// much, and the top is six times the old fixed policy's.
pub const LADDER: [f64; 10] = [0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0];

/// The adaptive policy's learner. Caffeine's adaptive W-TinyLFU climbs by comparing the hit
/// ratio of one period with the last, so a workload that changes between periods looks like
/// a good or a bad move. This one instead runs a *shadow* cache of block hashes only at every
/// step of the [`LADDER`] — same capacity, same frequency sketch, same admission rule — over
/// the same reads, and at the end of each period puts the live store at the step whose
/// shadow has hit most recently (an exponentially decayed count, half-life one period),
/// when it leads the live step's shadow by a margin.
///
/// A shadow counts hits as the store does (the leading blocks of a chain it holds) and
/// stores a chain tail-first (its blocks used leaf to root, so the root is the last to go).
/// On a node of more than [`SAMPLED_BLOCKS`] blocks the shadows see a spatial sample of the
/// blocks (by hash, a power-of-two rate, as SHARDS samples a miss-ratio curve), with their
/// capacity scaled by the same rate: per block read and per block stored they cost at most
/// `LADDER.len() × SAMPLED_BLOCKS / capacity` map updates and entries.
pub struct Climber {
    step: usize,
    shadows: Vec<Shadow>,
    /// The shadows see blocks whose hash's top 16 bits fall below `65536 >> sample_shift`.
    sample_shift: u32,
    /// Blocks read in this period (a period is one capacity's worth, at least
    /// [`MIN_PERIOD`]).
    seen: u64,
    /// Moves made (for tests and metrics).
    moves: u64,
}

/// Blocks each shadow holds at most (beyond it, blocks are sampled).
pub const SAMPLED_BLOCKS: usize = 16_384;

/// The shortest period between two moves, in blocks read.
const MIN_PERIOD: u64 = 2048;

/// A move needs the best shadow ahead of the live step's by at least this share of the
/// blocks read in a period (and at least [`MIN_LEAD`] blocks): a near tie stays put.
const MIN_LEAD_SHARE: f64 = 0.002;
const MIN_LEAD: f64 = 8.0;

impl Climber {
    fn new() -> Self {
        Self {
            step: 0,
            shadows: LADDER.iter().map(|&h| Shadow::new(h)).collect(),
            sample_shift: 0,
            seen: 0,
            moves: 0,
        }
    }

    pub fn horizon_factor(&self) -> f64 {
        LADDER[self.step]
    }

    /// Show the shadows a read of `chain`; `true` when the live setting moved.
    fn observe(&mut self, chain: &[BlockHash], sketch: &FrequencySketch, capacity: usize) -> bool {
        // Sample rate 2^-shift so that a shadow holds at most SAMPLED_BLOCKS; a change of
        // rate (the node's capacity in blocks changed twofold) starts the shadows afresh.
        let shift = (capacity / SAMPLED_BLOCKS).max(1).ilog2();
        if shift != self.sample_shift {
            self.sample_shift = shift;
            self.shadows = LADDER.iter().map(|&h| Shadow::new(h)).collect();
        }
        let sampled: Vec<BlockHash>;
        let chain = if shift == 0 {
            chain
        } else {
            let limit = 65_536u64 >> shift;
            sampled = chain
                .iter()
                .filter(|h| {
                    (u64::from_le_bytes(h.0[24..32].try_into().expect("8 bytes")) >> 48) < limit
                })
                .copied()
                .collect();
            &sampled[..]
        };
        let shadow_capacity = (capacity >> shift).max(1);
        for s in &mut self.shadows {
            s.observe(chain, sketch, shadow_capacity);
        }
        self.seen += chain.len() as u64;
        let period = (shadow_capacity as u64).max(MIN_PERIOD >> shift);
        if self.seen < period {
            return false;
        }
        for s in &mut self.shadows {
            s.score = s.score / 2.0 + s.hits as f64;
            s.hits = 0;
        }
        let (best, top) =
            self.shadows
                .iter()
                .enumerate()
                .fold((self.step, f64::MIN), |(bi, bs), (i, s)| {
                    if s.score > bs { (i, s.score) } else { (bi, bs) }
                });
        let lead = (MIN_LEAD_SHARE * self.seen as f64).max(MIN_LEAD);
        self.seen = 0;
        if best != self.step && top > self.shadows[self.step].score + lead {
            self.moves += 1;
            self.step = best;
            crate::metrics::EVICTION_MOVES.inc();
            crate::metrics::EVICTION_STEP.set(best as i64);
            return true;
        }
        false
    }
}

/// A cache of block hashes only, ranked like the store at a fixed horizon factor.
struct Shadow {
    horizon_factor: f64,
    keys: BlockMap<u64>,
    order: BTreeSet<(u64, BlockHash)>,
    clock: u64,
    /// Hits in this period, and the decayed score of past periods.
    hits: u64,
    score: f64,
}

impl Shadow {
    fn new(horizon_factor: f64) -> Self {
        Self {
            horizon_factor,
            keys: BlockMap::default(),
            order: BTreeSet::new(),
            clock: 0,
            hits: 0,
            score: 0.0,
        }
    }

    fn key(&mut self, hash: &BlockHash, sketch: &FrequencySketch) -> u64 {
        self.clock += 1;
        let f = sketch.estimate(hash).saturating_add(1).min(MAX_COUNT);
        frequency_key(self.horizon_factor, f, self.clock, self.keys.len())
    }

    fn observe(&mut self, chain: &[BlockHash], sketch: &FrequencySketch, capacity: usize) {
        let hits = chain
            .iter()
            .take_while(|h| self.keys.contains_key(*h))
            .count();
        self.hits += hits as u64;
        let missing = chain[hits..]
            .iter()
            .filter(|h| !self.keys.contains_key(*h))
            .count();
        // Admission, as the store decides it: the entry's first new block against the
        // block it would displace.
        let admit = missing == 0
            || self.keys.len() + missing <= capacity
            || self.horizon_factor <= 0.0
            || {
                let f = sketch
                    .estimate(&chain[hits])
                    .saturating_add(1)
                    .min(MAX_COUNT);
                let candidate =
                    frequency_key(self.horizon_factor, f, self.clock + 1, self.keys.len());
                self.order.first().is_none_or(|(k, _)| *k <= candidate)
            };
        for h in chain.iter().rev() {
            let present = self.keys.contains_key(h);
            if !present && !admit {
                continue;
            }
            let key = self.key(h, sketch);
            if let Some(old) = self.keys.insert(*h, key) {
                self.order.remove(&(old, *h));
            }
            self.order.insert((key, *h));
        }
        while self.keys.len() > capacity {
            let Some((_, h)) = self.order.pop_first() else {
                break;
            };
            self.keys.remove(&h);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(i: u64) -> BlockHash {
        let mut b = [0u8; 32];
        for r in 0..4 {
            b[r * 8..r * 8 + 8].copy_from_slice(
                &(i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (r as u64)).to_le_bytes(),
            );
        }
        BlockHash(b)
    }

    #[test]
    fn parse_names_and_factors() {
        assert_eq!(EvictionPolicy::parse("lru"), Ok(EvictionPolicy::Lru));
        assert_eq!(
            EvictionPolicy::parse("frequency"),
            Ok(EvictionPolicy::FREQUENCY)
        );
        assert_eq!(
            EvictionPolicy::parse("adaptive"),
            Ok(EvictionPolicy::DEFAULT)
        );
        assert_eq!(
            EvictionPolicy::parse("frequency:2.5"),
            Ok(EvictionPolicy::Frequency {
                horizon_factor: 2.5
            })
        );
        assert!(EvictionPolicy::parse("frequency:-1").is_err());
        assert!(EvictionPolicy::parse("lfu").is_err());
        for p in [
            EvictionPolicy::Lru,
            EvictionPolicy::FREQUENCY,
            EvictionPolicy::DEFAULT,
        ] {
            assert_eq!(EvictionPolicy::parse(&p.to_string()), Ok(p));
        }
    }

    #[test]
    fn sketch_counts_saturate_and_halve() {
        let mut s = FrequencySketch::new(1024);
        for _ in 0..20 {
            s.record(&h(1), u64::MAX);
        }
        assert_eq!(s.estimate(&h(1)), MAX_COUNT);
        assert_eq!(s.estimate(&h(2)), 1, "unseen blocks estimate as 1");
        s.record(&h(2), 1); // the reset point: every counter halves
        assert_eq!(s.estimate(&h(1)), MAX_COUNT / 2);
    }

    #[test]
    fn frequent_blocks_outrank_recent_ones_by_the_horizon() {
        let mut r = Ranking::new(EvictionPolicy::Frequency {
            horizon_factor: 1.0,
        });
        for t in 0..7 {
            r.use_key(&h(1), t, 1000);
        }
        let hot = r.use_key(&h(1), 10, 1000); // 8 uses
        let cold = r.use_key(&h(2), 11, 1000); // 1 use
        assert!(hot > cold, "8 uses outrank a single later use");
        assert_eq!(cold, 11);
        assert_eq!(hot, 10 + (8f64.ln() * 1000.0) as u64);
        let mut lru = Ranking::new(EvictionPolicy::Lru);
        assert_eq!(lru.use_key(&h(1), 5, 1000), 5);
        assert!(!lru.admits_selectively());
    }
}
