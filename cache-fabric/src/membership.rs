//! Cluster membership in Redis: each `cachet node` registers itself and heartbeats; a node
//! whose record is older than [`DOWN_AFTER`] is down.
//!
//! Keys (under a prefix, `cachet` by default): `<prefix>:node:<id>` holds the node's record as
//! JSON with a [`DOWN_AFTER`] expiry, refreshed every [`HEARTBEAT`]; `<prefix>:nodes` is the set
//! of ids ever seen (pruned lazily by readers). A graceful stop deletes the record at once.
//! The record's `epoch` (start time in ms) tells a restarted node from the one before it.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

/// How often a node refreshes its record.
pub const HEARTBEAT: Duration = Duration::from_secs(1);
/// A node silent this long is down.
pub const DOWN_AFTER: Duration = Duration::from_secs(3);

/// What a node announces.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub id: String,
    /// Fabric transport address (host:port).
    pub addr: String,
    pub rack: Option<String>,
    pub dram_capacity_bytes: u64,
    pub disk_capacity_bytes: u64,
    /// Start time (ms since the Unix epoch): a restart is a new epoch.
    pub epoch: u64,
    /// Bytes resident in DRAM at the last heartbeat (for placement and routing).
    pub dram_used_bytes: u64,
    /// The node's internal API address (host:port) where gateways send requests; `None`
    /// for a storage-only node.
    #[serde(default)]
    pub api_addr: Option<String>,
    /// Prompt tokens per second this node's engines measured prefilling, per model (a moving
    /// average): the routing gateway's prefill estimate. Empty until it has prefilled.
    #[serde(default)]
    pub prefill_tokens_per_sec: BTreeMap<String, f64>,
    /// Bytes per second this node measured pulling blocks from its peers (a moving
    /// average): the routing gateway's transfer estimate. `None` until it has pulled.
    #[serde(default)]
    pub pull_bytes_per_sec: Option<f64>,
    /// Bytes per second its engines' connectors measured loading from its store (a moving
    /// average): the routing gateway's load estimate. `None` until one has loaded.
    #[serde(default)]
    pub load_bytes_per_sec: Option<f64>,
    /// Per model whose engine measures them (vLLM upstreams): how its instances divide
    /// prefill and decode and how loaded each stage is, for the routing gateway's early
    /// rejection. Empty for in-process engines.
    #[serde(default)]
    pub stages: BTreeMap<String, cachet_common::stages::StageLoad>,
}

fn node_key(prefix: &str, id: &str) -> String {
    format!("{prefix}:node:{id}")
}

fn set_key(prefix: &str) -> String {
    format!("{prefix}:nodes")
}

/// Write (or refresh) a node's record.
pub async fn announce(
    conn: &mut (impl redis::aio::ConnectionLike + Send),
    prefix: &str,
    rec: &NodeRecord,
) -> redis::RedisResult<()> {
    let json = serde_json::to_string(rec).expect("a node record serializes");
    redis::pipe()
        .cmd("SET")
        .arg(node_key(prefix, &rec.id))
        .arg(json)
        .arg("PX")
        .arg(DOWN_AFTER.as_millis() as u64)
        .ignore()
        .cmd("SADD")
        .arg(set_key(prefix))
        .arg(&rec.id)
        .ignore()
        .query_async(conn)
        .await
}

/// Remove a node's record (graceful stop).
pub async fn leave(
    conn: &mut (impl redis::aio::ConnectionLike + Send),
    prefix: &str,
    id: &str,
) -> redis::RedisResult<()> {
    redis::pipe()
        .cmd("DEL")
        .arg(node_key(prefix, id))
        .ignore()
        .cmd("SREM")
        .arg(set_key(prefix))
        .arg(id)
        .ignore()
        .query_async(conn)
        .await
}

/// Heartbeat until `stop`, then leave. `current` gives the record to announce each time
/// (its load figures change). Redis errors are logged and retried at the next beat; the node
/// keeps serving.
pub async fn heartbeat(
    mut conn: impl redis::aio::ConnectionLike + Send,
    prefix: String,
    current: impl Fn() -> NodeRecord + Send,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(HEARTBEAT);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                if let Err(e) = announce(&mut conn, &prefix, &current()).await {
                    tracing::warn!(error = %e, "node heartbeat failed");
                }
            }
            _ = stop.cancelled() => break,
        }
    }
    if let Err(e) = leave(&mut conn, &prefix, &current().id).await {
        tracing::warn!(error = %e, "leaving the cluster failed; the record expires by itself");
    }
}

/// The nodes that are up, ordered by id. Ids whose record expired are pruned from the set.
pub async fn live_nodes(
    conn: &mut (impl redis::aio::ConnectionLike + Send),
    prefix: &str,
) -> redis::RedisResult<Vec<NodeRecord>> {
    let mut ids: Vec<String> = redis::cmd("SMEMBERS")
        .arg(set_key(prefix))
        .query_async(conn)
        .await?;
    ids.sort();
    if ids.is_empty() {
        return Ok(vec![]);
    }
    let keys: Vec<String> = ids.iter().map(|id| node_key(prefix, id)).collect();
    let values: Vec<Option<String>> = redis::cmd("MGET").arg(&keys).query_async(conn).await?;
    let mut live = Vec::new();
    let mut gone = Vec::new();
    for (id, v) in ids.iter().zip(values) {
        match v.and_then(|j| serde_json::from_str::<NodeRecord>(&j).ok()) {
            Some(rec) => live.push(rec),
            None => gone.push(id.clone()),
        }
    }
    if !gone.is_empty() {
        // Best effort: a failed prune is retried by the next reader.
        let _: redis::RedisResult<()> = redis::cmd("SREM")
            .arg(set_key(prefix))
            .arg(&gone)
            .query_async(conn)
            .await;
    }
    Ok(live)
}
