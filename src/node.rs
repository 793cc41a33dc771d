//! `cachet node`: one fabric node as its own process — its store (DRAM, and local disk when
//! `fabric.disk_capacity_bytes` is set) served to peers and gateways over the fabric's TCP
//! transport, its block events published to Redis, and its membership record kept alive by
//! heartbeats. Every connection must present the cluster token (`CACHET_CLUSTER_TOKEN`).
//!
//! Not here yet: the node's own engine, replication to owners, re-replication after a
//! failure, draining on shutdown (issue 4's remaining scope; see docs/architecture.md).

use std::sync::Arc;

use anyhow::{Context, bail};
use cache_fabric::events;
use cache_fabric::membership::{self, NodeRecord};
use cache_fabric::transport::serve_tcp;
use tokio_util::sync::CancellationToken;

use crate::config::Config;

/// Where and as whom the node runs.
pub struct NodeArgs {
    /// Fabric transport address (port 0 picks one; the chosen address is announced).
    pub listen: String,
    pub id: String,
    pub rack: Option<String>,
    /// Prefix of the cluster's Redis keys (membership, block events).
    pub redis_prefix: String,
}

/// The token from the environment: required, and long enough not to be guessed.
pub fn cluster_token() -> anyhow::Result<Arc<str>> {
    let t = std::env::var("CACHET_CLUSTER_TOKEN").unwrap_or_default();
    if t.len() < 16 {
        bail!(
            "CACHET_CLUSTER_TOKEN must be set to a secret of at least 16 characters shared by \
             every node and gateway of the cluster"
        );
    }
    Ok(t.into())
}

/// Run until `stop`; prints `node <id> listening on <addr>` once serving.
pub async fn run(config: Config, args: NodeArgs, stop: CancellationToken) -> anyhow::Result<()> {
    let token = cluster_token()?;
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .with_context(|| format!("binding the fabric port {}", args.listen))?;
    let addr = listener.local_addr()?.to_string();
    let node = config
        .fabric
        .node(&config.data_dir.join(format!("fabric-disk-{}", args.id)))?;
    let epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis() as u64;
    let mut tasks = Vec::new();
    if config.redis_url.is_empty() {
        tracing::warn!("no redis_url: this node is not announced and publishes no block events");
    } else {
        let client = redis::Client::open(config.redis_url.as_str())?;
        let conn = client
            .get_multiplexed_async_connection()
            .await
            .with_context(|| format!("connecting to Redis at {}", config.redis_url))?;
        let (sink, rx) = events::channel(65_536);
        node.set_event_sink(sink);
        tasks.push(tokio::spawn(events::publish(
            conn.clone(),
            format!("{}:blocks", args.redis_prefix),
            args.id.clone(),
            rx,
            1_000_000,
        )));
        let record = NodeRecord {
            id: args.id.clone(),
            addr: addr.clone(),
            rack: args.rack.clone(),
            dram_capacity_bytes: config.fabric.dram_capacity_bytes,
            disk_capacity_bytes: config.fabric.disk_capacity_bytes,
            epoch,
            dram_used_bytes: 0,
        };
        let n = node.clone();
        tasks.push(tokio::spawn(membership::heartbeat(
            conn,
            args.redis_prefix.clone(),
            move || NodeRecord {
                dram_used_bytes: n.with_store(|s| s.used_bytes()),
                ..record.clone()
            },
            stop.clone(),
        )));
    }
    let serving = tokio::spawn(serve_tcp(listener, node.clone(), token));
    println!("node {} listening on {addr}", args.id);
    stop.cancelled().await;
    serving.abort();
    // The heartbeat task leaves the cluster on `stop`; give it a moment to say so.
    for t in tasks.into_iter().rev() {
        let _ = tokio::time::timeout(std::time::Duration::from_secs(2), t).await;
    }
    Ok(())
}
