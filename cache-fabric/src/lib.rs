//! The Cachet cache fabric: where prompt-prefix KV blocks live.
//!
//! What it exposes:
//! - [`keys`]: the block key scheme (chained, scoped SHA-256 over token blocks, tail keys).
//! - [`FabricClient`]: the client API the gateway and engines use (read the longest cached
//!   prefix, write an entry with a TTL, explain a miss, apply tenant quotas).
//! - [`FabricNode`] ([`node`]): one node's tiers: the DRAM tier ([`store`]) over an optional
//!   local-disk tier ([`tier`]), with eviction and admission decided by [`policy`]; every
//!   block's checksum from [`integrity`]. Layering: node ← transport ← cluster ← client.
//! - [`cluster`]: a node's part in a cluster: reads from and writes to blocks' owners,
//!   re-replication after membership changes, draining.
//! - [`events`]: block stored/removed events from nodes over a Redis Stream into gateways'
//!   indexes.
//! - [`kv_events`]: the documented stream of which instance holds which block on which
//!   medium (engines' own caches from their KV events, the fabric's tiers), for every router.
//! - [`index`]: the gateway's prefix index (block → nodes) kept from node events.
//! - [`membership`]: nodes register and heartbeat in Redis; silent for 3 s = down.
//! - [`placement`]: tenant → shard group → block owners by rendezvous hashing, rack-aware.
//! - [`tier`]: where block bytes live (the `TierStore` trait: DRAM, local-disk segments).
//! - [`transport`]: moving blocks between nodes (the `Transport` trait; TCP with pooled,
//!   authenticated connections and striped large blocks).
//! - `rdma` (feature `rdma`): RDMA probing and the one-sided READ data path (`rdma::pull`):
//!   a node stages blocks in a registered pool, peers READ them; TCP whenever RDMA fails.
//! - `gpu` (feature `cuda`): the GPU-memory tier.
//! - [`reports`]: what an engine's own KV connector (vLLM's) reports about a request's
//!   prefill: tokens loaded from the node, from the engine's own cache, recomputed.
//! - [`stats`]: what a tenant holds (bytes per tier, losses by reason, most-read
//!   prefixes) for its administrators.
//! - [`popularity`]: how often a block was pulled lately (hot-block replication).
//! - [`simulate`]: replays a Mooncake-format trace through the store's own eviction code.
//!
//! What it is not: it never sees prompts or text, only token-block hashes and opaque KV bytes
//! with a checksum; it knows nothing of billing or HTTP.

pub mod arena;
pub mod client;
pub mod cluster;
pub mod events;
pub mod extents;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod index;
pub mod integrity;
pub mod keys;
pub mod kv_events;
pub mod local;
pub mod membership;
pub mod metrics;
pub mod node;
pub mod placement;
pub mod policy;
pub mod popularity;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod reports;
pub mod simulate;
pub mod stats;
pub mod store;
pub mod streams;
pub mod tier;
pub mod transport;
pub mod wire;

pub use client::FabricClient;
pub use integrity::checksum;
pub use keys::{ChainLink, KeySpace, PrefixKeys, TailKey};
pub use node::{DEFAULT_RECEIVE_BYTES, FabricNode, MissReason, NodeConfig, PrefixRead};
pub use policy::EvictionPolicy;
pub use reports::ConnectorReport;
pub use stats::RemovalReason;
pub use store::{ChainRead, EntryKind, FetchedBlock, Holding, PutBlock, Released, WriteRefused};

/// Wall-clock milliseconds since the Unix epoch: expiries that outlive the process (disk
/// tier) and event times compared across processes (block events).
pub(crate) fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
