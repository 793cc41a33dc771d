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

use cachet_common::BlockHash;

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
}

impl EvictionPolicy {
    /// The default: frequency-aware, with the horizon measured best on the Mooncake trace.
    pub const DEFAULT: EvictionPolicy = EvictionPolicy::Frequency {
        horizon_factor: 10.0,
    };

    /// `lru`, `frequency`, or `frequency:<horizon factor>`.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s.split_once(':') {
            None if s == "lru" => Ok(EvictionPolicy::Lru),
            None if s == "frequency" => Ok(EvictionPolicy::DEFAULT),
            Some(("frequency", f)) => match f.parse::<f64>() {
                Ok(v) if v.is_finite() && v >= 0.0 => {
                    Ok(EvictionPolicy::Frequency { horizon_factor: v })
                }
                _ => Err(format!("{f:?} is not a horizon factor (a number >= 0)")),
            },
            _ => Err(format!(
                "{s:?} is not an eviction policy; available: lru, frequency, frequency:<factor>"
            )),
        }
    }
}

/// The form [`EvictionPolicy::parse`] reads: `lru` or `frequency:<horizon factor>`.
impl std::fmt::Display for EvictionPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
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
}

/// Sketch width: 4 × 2^18 counters (1 MiB), enough that blocks seen once rarely collide
/// with hot ones at the block counts one node holds.
const SKETCH_WIDTH: usize = 1 << 18;

impl Ranking {
    pub fn new(policy: EvictionPolicy) -> Self {
        let sketch = match policy {
            EvictionPolicy::Lru => None,
            EvictionPolicy::Frequency { .. } => Some(FrequencySketch::new(SKETCH_WIDTH)),
        };
        Self { policy, sketch }
    }

    pub fn policy(&self) -> EvictionPolicy {
        self.policy
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
            // Halve after ten uses per stored block (at least 4,096 blocks' worth).
            Some(s) => s.record(hash, 10 * stored.max(4096) as u64).max(1),
            None => 1,
        }
    }

    fn key(&self, frequency: u8, tick: u64, stored: usize) -> u64 {
        match self.policy {
            EvictionPolicy::Lru => tick,
            EvictionPolicy::Frequency { horizon_factor } => {
                let horizon = horizon_factor * stored.max(1) as f64;
                tick + ((frequency.max(1) as f64).ln() * horizon) as u64
            }
        }
    }

    /// A block's estimated recent uses (`None` under LRU, which does not count them).
    pub fn estimate(&self, hash: &BlockHash) -> Option<u8> {
        self.sketch.as_ref().map(|s| s.estimate(hash))
    }

    /// Whether admission applies to best-effort entries.
    pub fn admits_selectively(&self) -> bool {
        self.sketch.is_some()
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
        for p in [EvictionPolicy::Lru, EvictionPolicy::DEFAULT] {
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
