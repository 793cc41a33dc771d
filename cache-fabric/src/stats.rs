//! What a tenant has in the fabric, for its administrators: bytes per tier, why blocks left,
//! and its most-read prefixes (by hash and size: the fabric never sees prompt text).
//!
//! A node answers for itself ([`crate::FabricNode::tenant_stats`]); a cluster's answer is the
//! [`TenantCacheStats::merge`] of its nodes'.

use std::time::Duration;

use cachet_common::BlockHash;
use serde::{Deserialize, Serialize};

/// Why a block that once was stored is gone (kept for a while to explain misses).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RemovalReason {
    Expired,
    Capacity,
    Quota,
    Corrupt,
    /// Its tenant was deleted.
    Purged,
}

impl RemovalReason {
    pub fn as_str(self) -> &'static str {
        match self {
            RemovalReason::Expired => "expired",
            RemovalReason::Capacity => "evicted",
            RemovalReason::Quota => "evicted_quota",
            RemovalReason::Corrupt => "corrupt",
            RemovalReason::Purged => "purged",
        }
    }
}

/// Bytes and blocks of a tenant in one tier.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TierUsage {
    /// `dram`, `disk` or `gpu`.
    pub tier: String,
    pub blocks: u64,
    pub bytes: u64,
}

/// Blocks a tenant lost, by reason, since the node started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Evictions {
    /// Their TTL ran out.
    pub expired: u64,
    /// Taken for node capacity (dropped; demotions to a lower tier are counted apart).
    pub evicted: u64,
    /// Taken because the tenant was over its own quota.
    pub evicted_quota: u64,
    /// Dropped because their bytes failed the checksum.
    pub corrupt: u64,
    /// Moved from DRAM to a lower tier under pressure (still cached).
    pub demoted: u64,
    /// Purged with the tenant.
    pub purged: u64,
}

impl Evictions {
    pub(crate) fn count(&mut self, reason: RemovalReason, demoted: bool) {
        match reason {
            RemovalReason::Capacity if demoted => self.demoted += 1,
            RemovalReason::Capacity => self.evicted += 1,
            RemovalReason::Expired => self.expired += 1,
            RemovalReason::Quota => self.evicted_quota += 1,
            RemovalReason::Corrupt => self.corrupt += 1,
            RemovalReason::Purged => self.purged += 1,
        }
    }

    fn add(&mut self, o: &Evictions) {
        self.expired += o.expired;
        self.evicted += o.evicted;
        self.evicted_quota += o.evicted_quota;
        self.corrupt += o.corrupt;
        self.demoted += o.demoted;
        self.purged += o.purged;
    }
}

/// A cached prefix that was read: the block it ends with.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PrefixStat {
    /// The hash of the prefix's last block (hex).
    pub hash: String,
    /// Tokens from the start of the prompt to the end of this block (as far as this node
    /// holds the chain).
    pub tokens: u64,
    /// KV bytes of the chain this node holds.
    pub bytes: u64,
    /// Reads that ended at this block.
    pub reads: u64,
    /// What is left of its TTL, in milliseconds.
    pub ttl_left_ms: u64,
    /// Its TTL class, in seconds (300 or 3600).
    pub ttl_secs: u64,
    /// Written at an explicit breakpoint (held for its TTL).
    pub paid: bool,
}

impl PrefixStat {
    pub(crate) fn new(
        hash: &BlockHash,
        tokens: u64,
        bytes: u64,
        reads: u64,
        ttl_left: Duration,
        ttl: Duration,
        paid: bool,
    ) -> Self {
        Self {
            hash: hash.to_hex(),
            tokens,
            bytes,
            reads,
            ttl_left_ms: ttl_left.as_millis() as u64,
            ttl_secs: ttl.as_secs(),
            paid,
        }
    }
}

/// A tenant's cache on one node or a whole cluster.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TenantCacheStats {
    pub tiers: Vec<TierUsage>,
    pub evictions: Evictions,
    /// Most-read first.
    pub top_prefixes: Vec<PrefixStat>,
    /// Nodes that answered.
    pub nodes: u32,
    /// Bytes of distinct blocks, summed over the nodes: a block in several tiers of a node
    /// (a long hold written through to disk) counts once; copies on several nodes each
    /// count (replicas).
    #[serde(default)]
    pub distinct_bytes: u64,
}

impl TenantCacheStats {
    /// Add another node's stats, keeping the `top` most-read prefixes (a prefix held by
    /// several nodes is listed once, with its reads summed).
    pub fn merge(&mut self, other: TenantCacheStats, top: usize) {
        for t in other.tiers {
            match self.tiers.iter_mut().find(|x| x.tier == t.tier) {
                Some(x) => {
                    x.blocks += t.blocks;
                    x.bytes += t.bytes;
                }
                None => self.tiers.push(t),
            }
        }
        self.evictions.add(&other.evictions);
        for p in other.top_prefixes {
            match self.top_prefixes.iter_mut().find(|x| x.hash == p.hash) {
                Some(x) => {
                    x.reads += p.reads;
                    x.tokens = x.tokens.max(p.tokens);
                    x.bytes = x.bytes.max(p.bytes);
                    x.ttl_left_ms = x.ttl_left_ms.max(p.ttl_left_ms);
                }
                None => self.top_prefixes.push(p),
            }
        }
        self.top_prefixes
            .sort_by(|a, b| b.reads.cmp(&a.reads).then_with(|| a.hash.cmp(&b.hash)));
        self.top_prefixes.truncate(top);
        self.nodes += other.nodes;
        self.distinct_bytes += other.distinct_bytes;
    }

    /// Bytes in every tier.
    pub fn total_bytes(&self) -> u64 {
        self.tiers.iter().map(|t| t.bytes).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prefix(hash: &str, reads: u64) -> PrefixStat {
        PrefixStat {
            hash: hash.into(),
            tokens: 64,
            bytes: 1024,
            reads,
            ttl_left_ms: 1000,
            ttl_secs: 300,
            paid: true,
        }
    }

    #[test]
    fn merging_sums_tiers_and_reads_and_keeps_the_top() {
        let mut a = TenantCacheStats {
            tiers: vec![TierUsage {
                tier: "dram".into(),
                blocks: 2,
                bytes: 20,
            }],
            evictions: Evictions {
                expired: 1,
                ..Default::default()
            },
            top_prefixes: vec![prefix("aa", 5), prefix("bb", 1)],
            nodes: 1,
            distinct_bytes: 20,
        };
        let b = TenantCacheStats {
            tiers: vec![
                TierUsage {
                    tier: "dram".into(),
                    blocks: 1,
                    bytes: 10,
                },
                TierUsage {
                    tier: "disk".into(),
                    blocks: 3,
                    bytes: 30,
                },
            ],
            evictions: Evictions {
                expired: 2,
                demoted: 1,
                ..Default::default()
            },
            top_prefixes: vec![prefix("bb", 7), prefix("cc", 2)],
            nodes: 1,
            distinct_bytes: 35,
        };
        a.merge(b, 2);
        assert_eq!(a.total_bytes(), 60);
        assert_eq!(a.tiers[0].blocks, 3);
        assert_eq!(a.evictions.expired, 3);
        assert_eq!(a.evictions.demoted, 1);
        let top: Vec<(&str, u64)> = a
            .top_prefixes
            .iter()
            .map(|p| (p.hash.as_str(), p.reads))
            .collect();
        assert_eq!(top, vec![("bb", 8), ("aa", 5)]);
        assert_eq!(a.nodes, 2);
        assert_eq!(a.distinct_bytes, 55);
    }
}
