//! `cachet node`: one member of a Cachet cluster.
//!
//! - Its fabric store (DRAM, and local disk when `fabric.disk_capacity_bytes` is set) is
//!   served to peers over the fabric's TCP transport.
//! - Its membership record (fabric and API addresses, rack, capacity, epoch) is kept alive
//!   in Redis by heartbeats, and its block events are published for gateways' indexes.
//! - It follows the membership, reads and writes blocks through their owners
//!   ([`cache_fabric::cluster`]), and restores `R` copies after every membership change.
//! - With `--api-listen`, it also runs the engines and the API pipeline (auth, admission,
//!   fabric, engine, meter) for requests routed to it by `cachet router`; that port takes
//!   only requests carrying the cluster token, and answers only once the request's ledger
//!   row is durable (a node killed after answering loses no usage).
//!
//! Every internal connection must present the cluster token (`CACHET_CLUSTER_TOKEN`).
//! On SIGTERM the node stops taking requests, finishes those in flight, leaves the
//! membership, hands its blocks to their new owners, then exits.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use cache_fabric::cluster::Cluster;
use cache_fabric::membership::{self, NodeRecord};
use cache_fabric::transport::serve_tcp;
use cache_fabric::{FabricClient, events, kv_events};
use tokio_util::sync::CancellationToken;

use crate::config::Config;

/// Where and as whom the node runs (`cachet node`'s flags).
#[derive(Debug, clap::Args)]
pub struct NodeArgs {
    /// Fabric transport address (port 0 picks one; the chosen address is announced).
    #[arg(long, default_value = "127.0.0.1:7400")]
    pub listen: String,
    /// Internal API address for gateways (omit for a storage-only node).
    #[arg(long)]
    pub api_listen: Option<String>,
    /// Fabric address announced to peers and gateways when it differs from `listen`
    /// (behind NAT, a proxy or a container port mapping); default: the bound address.
    #[arg(long, env = "CACHET_ADVERTISE")]
    pub advertise: Option<String>,
    /// API address announced to gateways when it differs from `api_listen`; default: the
    /// bound address.
    #[arg(long, env = "CACHET_API_ADVERTISE")]
    pub api_advertise: Option<String>,
    /// Node id (unique in the cluster); default: node-PORT (the port of --listen).
    #[arg(long)]
    pub id: Option<String>,
    /// Failure domain, for replica placement.
    #[arg(long)]
    pub rack: Option<String>,
    /// Prefix of the cluster's Redis keys (membership, block events).
    #[arg(long, default_value = "cachet")]
    pub redis_prefix: String,
}

impl NodeArgs {
    /// The node's id: `--id`, else `node-` and the port of `--listen`.
    pub fn node_id(&self) -> String {
        let port = || self.listen.rsplit(':').next().unwrap_or("0");
        self.id
            .clone()
            .unwrap_or_else(|| format!("node-{}", port()))
    }
}

/// How often a node re-reads the membership.
const MEMBERSHIP_POLL: Duration = Duration::from_millis(500);
/// How soon a repair that could not reach an owner is retried.
const REPAIR_RETRY: Duration = Duration::from_secs(2);

/// Run until `stop`. Prints `node <id> listening on <addr>` once the fabric port serves,
/// then `node <id> api on <addr>` if it runs the API.
pub async fn run(
    mut config: Config,
    args: NodeArgs,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    let token = crate::config::cluster_token()?;
    let id = args.node_id();
    if config.redis_url.is_empty() {
        bail!("a cluster node needs redis_url (membership and block events live in Redis)");
    }
    if args.api_listen.is_none() {
        // With the API, start_api checks the engines' bounds too.
        crate::memory::check(&config, false)?;
    }
    // Each node keeps its own disk tier and usage spool, even when nodes share a data_dir.
    config.data_dir = config.data_dir.join(format!("node-{}", id));
    // One owner per directory (its disk tier, socket and usage files), until this returns.
    let _held = crate::dirlock::hold_all(
        &crate::dirlock::meter_dirs(&config.data_dir, &config.spool_path()),
        &format!("node {}", id),
    )?;
    let ports = Ports::bind(&args).await?;
    let node = config.fabric.node(&config.data_dir.join("fabric-disk"))?;
    // The engine beside this node (vLLM's connector) loads and saves through shared memory;
    // the socket goes when this function returns.
    let _local = crate::server::open_local(&config, &node, &token)?;
    let cluster = Cluster::new(
        id.clone(),
        node.clone(),
        token.clone(),
        config.cluster.fabric(),
    );
    rdma(&config.fabric, &node, &cluster)?;
    let conn = crate::server::cluster_redis(&config.redis_url).await?;
    // Tombstones first: what the disk tier kept of a purged cache or a deleted cache object
    // goes before the node announces or serves anything.
    apply_tombstones(
        &config,
        FabricClient::clustered(node.clone(), cluster.clone()),
    )
    .await;
    let publisher = publish_events(&conn, &args, &node, &config).await?;
    let record = record(&config, &args, &ports)?;
    announce(&conn, &args.redis_prefix, &record, &cluster).await?;
    let loops = Loops::spawn(&conn, &args.redis_prefix, &node, &cluster, record);
    let serving = crate::spawn_loop(
        "fabric_serve",
        serve_tcp(ports.fabric, node.clone(), token.clone()),
    );
    println!("node {} listening on {}", id, ports.addr);
    let api_stop = CancellationToken::new();
    let api = match ports.api {
        Some(l) => {
            let fabric = FabricClient::clustered(node.clone(), cluster.clone());
            let running = start_api_half(&config, &token, l, &api_stop, &node, fabric).await?;
            println!("node {} api on {}", id, running.addr);
            let _ = loops.measured.set(Measured {
                inflight: running.inflight.clone(),
                engines: running.engines.clone(),
            });
            Some(running)
        }
        None => {
            let fabric = FabricClient::clustered(node.clone(), cluster.clone());
            follow_changes_alone(&config, fabric, &loops.background).await?;
            None
        }
    };
    stop.cancelled().await;
    // 1. No new requests; those in flight finish and their usage is committed.
    api_stop.cancel();
    if let Some(api) = api
        && let Err(e) = api.wait().await
    {
        tracing::error!(error = %e, "the node's API stopped with an error");
    }
    loops.leave_and_drain(&cluster).await;
    serving.abort();
    let _ = tokio::time::timeout(Duration::from_millis(500), publisher).await;
    Ok(())
}

/// The node's ports, bound before anything else starts: the fabric's, and the API's when it
/// runs one, with the addresses they got.
struct Ports {
    fabric: tokio::net::TcpListener,
    addr: String,
    api: Option<tokio::net::TcpListener>,
    api_addr: Option<String>,
}

impl Ports {
    async fn bind(args: &NodeArgs) -> anyhow::Result<Self> {
        let fabric = tokio::net::TcpListener::bind(&args.listen)
            .await
            .with_context(|| format!("binding the fabric port {}", args.listen))?;
        let addr = fabric.local_addr()?.to_string();
        let api = match &args.api_listen {
            Some(a) => Some(
                tokio::net::TcpListener::bind(a)
                    .await
                    .with_context(|| format!("binding the API port {a}"))?,
            ),
            None => None,
        };
        let api_addr = api
            .as_ref()
            .map(|l| l.local_addr().map(|a| a.to_string()))
            .transpose()?;
        Ok(Self {
            fabric,
            addr,
            api,
            api_addr,
        })
    }
}

/// The node's block events, from its store to the cluster's stream in Redis (what survived a
/// restart in the disk tier is announced again), and the documented KV event stream: the
/// store's blocks by medium and, translated into Cachet's keys, what the KV caches of the
/// engines beside it hold (`cache_fabric::kv_events`). The KV event loops run until the
/// process ends.
async fn publish_events(
    conn: &redis::aio::ConnectionManager,
    args: &NodeArgs,
    node: &Arc<cache_fabric::FabricNode>,
    config: &Config,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let id = args.node_id();
    let (kv, source) = kv_events::channel(65_536);
    let engines: Vec<_> = config
        .engine
        .vllm
        .iter()
        .flat_map(|v| v.kv_event_publishers(&id))
        .collect();
    let instances: Vec<String> = engines.iter().map(|e| e.instance.clone()).collect();
    let stop = CancellationToken::new();
    for e in engines {
        crate::spawn_loop(
            "engine_kv_events",
            kv_events::vllm::follow(e, node.engine_map().clone(), kv.clone(), stop.clone()),
        );
    }
    let resync = Arc::new(tokio::sync::Notify::new());
    // Its own connection: its reads block.
    let watching = crate::server::cluster_redis(&config.redis_url).await?;
    crate::spawn_loop(
        "kv_resyncs",
        kv_events::watch_resyncs(
            watching,
            args.redis_prefix.clone(),
            id.clone(),
            resync.clone(),
            stop.clone(),
        ),
    );
    let n = node.clone();
    let snapshot_of = id.clone();
    let publisher = kv_events::Publisher {
        prefix: args.redis_prefix.clone(),
        node: id.clone(),
        max_len: 100_000,
        snapshot: Box::new(move || {
            let mut held: Vec<kv_events::KvEvent> = n
                .with_store(|s| s.held_by_medium())
                .into_iter()
                .flat_map(|(m, hashes)| kv_events::KvEvent::stored_chunks(&snapshot_of, m, &hashes))
                .collect();
            held.extend(n.engine_map().snapshot(&instances));
            held
        }),
        resync_every: Duration::from_secs(2),
    };
    crate::spawn_loop(
        "kv_events",
        publisher.run(conn.clone(), source, resync, stop),
    );
    let (sink, rx) = events::channel(65_536);
    node.set_event_sink(sink);
    node.with_store(|s| s.announce_held());
    Ok(crate::spawn_loop(
        "block_events",
        events::publish(
            conn.clone(),
            format!("{}:blocks", args.redis_prefix),
            id,
            rx,
            1_000_000,
            Some(kv),
        ),
    ))
}

/// The node's membership record: its addresses (announced or bound), rack, capacities, and
/// this life's epoch.
fn record(config: &Config, args: &NodeArgs, ports: &Ports) -> anyhow::Result<NodeRecord> {
    let epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis() as u64;
    Ok(NodeRecord {
        id: args.node_id(),
        addr: args.advertise.clone().unwrap_or_else(|| ports.addr.clone()),
        rack: args.rack.clone(),
        dram_capacity_bytes: config.fabric.dram_capacity_bytes,
        disk_capacity_bytes: config
            .fabric
            .disk_bytes(&config.data_dir.join("fabric-disk")),
        epoch,
        dram_used_bytes: 0,
        api_addr: args
            .api_advertise
            .clone()
            .or_else(|| ports.api_addr.clone()),
        ..Default::default()
    })
}

/// Announced and with a first view before it serves anything: its first writes already go to
/// their owners.
async fn announce(
    conn: &redis::aio::ConnectionManager,
    prefix: &str,
    record: &NodeRecord,
    cluster: &Cluster,
) -> anyhow::Result<()> {
    let mut c = conn.clone();
    membership::announce(&mut c, prefix, record)
        .await
        .context("announcing the node in Redis")?;
    cluster
        .refresh(&mut c, prefix)
        .await
        .context("reading the cluster membership")?;
    Ok(())
}

/// The node's loops and the tokens that stop them in order at shutdown: the heartbeat
/// (`leave`) before the rest (`background`).
struct Loops {
    heartbeat: tokio::task::JoinHandle<()>,
    leave: CancellationToken,
    background: CancellationToken,
    /// What the node's API measures (its prefill rates), once it runs: sent with every
    /// heartbeat, with the pull bandwidth, as the routing gateway's learned estimates.
    measured: Arc<std::sync::OnceLock<Measured>>,
}

/// What the node's API half measures, announced with each heartbeat once it runs.
struct Measured {
    inflight: gateway::coalesce::Inflight,
    engines: Vec<Arc<dyn engine::Engine>>,
}

impl Measured {
    /// The stages of the engines that measure them, by model.
    fn stages(&self) -> std::collections::BTreeMap<String, cachet_common::stages::StageLoad> {
        self.engines
            .iter()
            .filter_map(|e| Some((e.info().id.clone(), e.stages()?)))
            .collect()
    }
}

impl Loops {
    /// Heartbeats, the membership followed, write-through, repairs, and healing (blocks
    /// dropped as corrupt fetched again from another owner).
    fn spawn(
        conn: &redis::aio::ConnectionManager,
        prefix: &str,
        node: &Arc<cache_fabric::FabricNode>,
        cluster: &Arc<Cluster>,
        record: NodeRecord,
    ) -> Self {
        let (leave, background) = (CancellationToken::new(), CancellationToken::new());
        let measured: Arc<std::sync::OnceLock<Measured>> = Arc::default();
        let (n, m, cl) = (node.clone(), measured.clone(), cluster.clone());
        let heartbeat = crate::spawn_loop(
            "heartbeat",
            membership::heartbeat(
                conn.clone(),
                prefix.to_string(),
                move || NodeRecord {
                    dram_used_bytes: n.with_store(|s| s.used_bytes()),
                    prefill_tokens_per_sec: m
                        .get()
                        .map(|m| m.inflight.prefill_tokens_per_sec())
                        .unwrap_or_default(),
                    stages: m.get().map(Measured::stages).unwrap_or_default(),
                    pull_bytes_per_sec: cl.pull_bytes_per_sec(),
                    load_bytes_per_sec: n.reports().load_bytes_per_sec(),
                    ..record.clone()
                },
                leave.clone(),
            ),
        );
        crate::spawn_loop(
            "membership",
            cluster.clone().follow_membership(
                conn.clone(),
                prefix.to_string(),
                MEMBERSHIP_POLL,
                background.clone(),
            ),
        );
        crate::spawn_loop(
            "write_through",
            node.clone()
                .run_write_through(crate::server::WRITE_THROUGH_EVERY, background.clone()),
        );
        crate::spawn_loop(
            "repairs",
            cluster
                .clone()
                .run_repairs(REPAIR_RETRY, background.clone()),
        );
        crate::spawn_loop(
            "healing",
            cluster
                .clone()
                .run_healing(Duration::from_secs(1), background.clone()),
        );
        Self {
            heartbeat,
            leave,
            background,
            measured,
        }
    }

    /// Leave the membership, so readers and gateways stop counting on this node; then hand
    /// every block to its owners in the cluster without it, and stop the rest.
    async fn leave_and_drain(self, cluster: &Cluster) {
        self.leave.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(2), self.heartbeat).await;
        let report = cluster.drain().await;
        tracing::info!(
            missing = report.missing,
            pushed = report.pushed,
            failed = report.failed,
            "drained"
        );
        self.background.cancel();
    }
}

/// The node's API: the engines and the pipeline for requests a gateway routes here (cluster
/// token required).
async fn start_api_half(
    config: &Config,
    token: &Arc<str>,
    listener: tokio::net::TcpListener,
    stop: &CancellationToken,
    node: &Arc<cache_fabric::FabricNode>,
    fabric: FabricClient,
) -> anyhow::Result<crate::server::Running> {
    let mut gw = config.gateway();
    gw.internal_token = Some(token.clone());
    crate::server::start_api(
        config.clone(),
        gw,
        listener,
        stop.clone(),
        node.clone(),
        fabric,
    )
    .await
}

/// A storage-only node still applies tenants' cache policy and purges deleted tenants (the
/// API half does it for a node that has one).
async fn follow_changes_alone(
    config: &Config,
    fabric: FabricClient,
    background: &CancellationToken,
) -> anyhow::Result<()> {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy(&config.database_url)
        .context("database_url")?;
    crate::server::follow_changes(
        config,
        pool,
        gateway::sync::Targets {
            fabric: Some(fabric),
            ..Default::default()
        },
        background,
    )
    .await;
    Ok(())
}

/// Apply the purges and cache-object deletions this node missed while it was down to what
/// its disk tier kept (5 s at most with Postgres away: the change feed's first step applies
/// them again once it can).
async fn apply_tombstones(config: &Config, fabric: FabricClient) {
    let pool = match sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy(&config.database_url)
    {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!(error = %e, "database_url; tombstones wait for the change feed");
            return;
        }
    };
    let applied = gateway::sync::apply_tombstones(&pool, &fabric);
    match tokio::time::timeout(Duration::from_secs(5), applied).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "applying tombstones at start failed; the change feed retries")
        }
        Err(_) => tracing::warn!("applying tombstones at start timed out; the change feed retries"),
    }
    pool.close().await;
}

/// Turn on RDMA as `fabric.rdma_device` says: export a registered pool for peers' READs and
/// pull from peers by READ. `auto` without a device is TCP (logged); a named device that
/// cannot be opened stops the node.
#[cfg(feature = "rdma")]
fn rdma(
    fabric: &crate::config::FabricSection,
    node: &std::sync::Arc<cache_fabric::FabricNode>,
    cluster: &Cluster,
) -> anyhow::Result<()> {
    use cache_fabric::rdma::{Availability, Export, probe, verbs::Device};
    let wanted = match fabric.rdma_device.as_str() {
        "off" => {
            tracing::info!("RDMA off (fabric.rdma_device); the fabric transport is TCP");
            return Ok(());
        }
        "auto" => match probe() {
            Availability::Available { devices } => devices.into_iter().next(),
            Availability::Unavailable { reason } => {
                tracing::info!(%reason, "RDMA unavailable; the fabric transport is TCP");
                return Ok(());
            }
        },
        name => Some(name.to_string()),
    };
    let opened = Device::open(wanted.as_deref()).and_then(|device| {
        let export = Export::new(device.clone(), fabric.rdma_pool_bytes as usize)?;
        Ok((device, export))
    });
    match opened {
        Ok((device, export)) => {
            tracing::info!(
                device = device.name(),
                pool_bytes = fabric.rdma_pool_bytes,
                "RDMA on: peers READ blocks from this node's pool, and reads from peers use RDMA READ"
            );
            node.export_rdma(export);
            cluster.enable_rdma(device);
            Ok(())
        }
        Err(e) if fabric.rdma_device == "auto" => {
            tracing::warn!(error = %e, "RDMA device found but not usable; the fabric transport is TCP");
            Ok(())
        }
        Err(e) => Err(anyhow::anyhow!(
            "fabric.rdma_device = {:?}: {e}",
            fabric.rdma_device
        )),
    }
}

/// Without the `rdma` feature the fabric transport is TCP; naming a device is an error.
#[cfg(not(feature = "rdma"))]
fn rdma(
    fabric: &crate::config::FabricSection,
    _node: &std::sync::Arc<cache_fabric::FabricNode>,
    _cluster: &Cluster,
) -> anyhow::Result<()> {
    match fabric.rdma_device.as_str() {
        "auto" | "off" => Ok(()),
        name => anyhow::bail!(
            "fabric.rdma_device = {name:?} needs a build with the rdma feature (cargo build --features rdma)"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node_and_cluster() -> (Arc<cache_fabric::FabricNode>, Arc<Cluster>) {
        let node = cache_fabric::FabricNode::new(cache_fabric::NodeConfig {
            dram_capacity_bytes: 1 << 20,
            eviction: cache_fabric::EvictionPolicy::DEFAULT,
        });
        let cluster = Cluster::new("n1", node.clone(), "token", Default::default());
        (node, cluster)
    }

    /// `auto` and `off` always start (TCP where there is no RDMA: these machines have
    /// none); a named device that cannot be used stops the node with the reason.
    #[test]
    fn rdma_auto_falls_back_to_tcp_and_a_named_device_must_exist() {
        let (node, cluster) = node_and_cluster();
        let mut fabric = crate::config::FabricSection::default();
        for setting in ["auto", "off"] {
            fabric.rdma_device = setting.into();
            rdma(&fabric, &node, &cluster).unwrap();
        }
        fabric.rdma_device = "no-such-device".into();
        let err = rdma(&fabric, &node, &cluster).unwrap_err().to_string();
        assert!(err.contains("no-such-device"), "{err}");
        #[cfg(not(feature = "rdma"))]
        assert!(err.contains("rdma feature"), "{err}");
    }
}
