//! Cachet's configuration: a TOML file (all fields optional, see `cachet.sample.toml`), then
//! environment overrides, validated once.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use serde::Deserialize;

/// The token from the environment: required, and long enough not to be guessed.
pub fn cluster_token() -> anyhow::Result<std::sync::Arc<str>> {
    let t = std::env::var("CACHET_CLUSTER_TOKEN").unwrap_or_default();
    if t.len() < 16 {
        bail!(
            "CACHET_CLUSTER_TOKEN must be set to a secret of at least 16 characters shared by \
             every node and gateway of the cluster"
        );
    }
    Ok(t.into())
}

#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Address of the public API.
    pub listen: String,
    pub database_url: String,
    /// Empty: no Redis; rate limits are kept in this process.
    pub redis_url: String,
    /// Where local state lives (usage spool).
    pub data_dir: PathBuf,
    pub fabric: FabricSection,
    pub engine: EngineSection,
    pub gateway: GatewaySection,
    pub meter: MeterSection,
    pub cluster: ClusterSection,
    pub log: LogSection,
    pub admin: AdminSection,
    /// Signs the admin and finance APIs' tokens (≥ 32 bytes). A secret: from the environment
    /// only (`CACHET_ADMIN_JWT_SECRET`), never the file. Empty: both APIs are off.
    #[serde(skip)]
    pub admin_jwt_secret: String,
    /// Bearer token `GET /metrics` requires (`CACHET_METRICS_TOKEN`, environment only).
    /// Empty: `/metrics` answers loopback clients only (its series name tenants).
    #[serde(skip)]
    pub metrics_token: String,
    /// Start even if the configured memory bounds (fabric DRAM, KV budget, engine working
    /// memory, …) add up to more than the machine has (`CACHET_MEMORY_OVERCOMMIT`).
    pub memory_overcommit: bool,
}

/// Cluster roles (`cachet node`, `cachet router`): placement, reads, routing.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterSection {
    /// Nodes in a tenant's shard group (G).
    pub group_size: usize,
    /// Owners of each block (R).
    pub replicas: usize,
    /// Prompt tokens a node prefills per second: the cost of recomputing, which bounds how
    /// long a read waits for remote blocks. (The routing gateway does not use it: it learns
    /// each node's prefill rate per model from what the node measures, seeded from the
    /// model's profile.)
    pub prefill_tokens_per_sec: u64,
    /// Node-to-node bandwidth the gateway assumes for blocks a node must pull, until the
    /// node has measured its own pulls.
    pub transfer_bytes_per_sec: u64,
    /// The rate the gateway assumes for an engine loading blocks from its own node's store,
    /// until the node has measured its engine's loads.
    pub load_bytes_per_sec: u64,
    /// The gateway answers 529 at once when no node is expected to start answering within
    /// this time-to-first-token.
    pub ttft_slo_ms: u64,
    /// ... and when every node whose first token would come in time decodes on instances
    /// so busy that the time between tokens is expected over this (from the line each node
    /// measured: time between tokens against the decode batch; vLLM upstreams only).
    pub tbt_slo_ms: u64,
    /// How long a node waits before recording a stream its gateway lost: the gateway may be
    /// resuming it on another node, whose complete row must be the request's one.
    pub resume_grace_secs: u64,
}

impl Default for ClusterSection {
    fn default() -> Self {
        Self {
            group_size: 4,
            replicas: 2,
            prefill_tokens_per_sec: 400,
            transfer_bytes_per_sec: 1_000_000_000,
            load_bytes_per_sec: 2_000_000_000,
            ttft_slo_ms: 30_000,
            tbt_slo_ms: 1_000,
            resume_grace_secs: 120,
        }
    }
}

impl ClusterSection {
    pub fn fabric(&self) -> cache_fabric::cluster::ClusterConfig {
        cache_fabric::cluster::ClusterConfig {
            group_size: self.group_size,
            replicas: self.replicas,
            recompute_per_token: Duration::from_secs_f64(
                1.0 / self.prefill_tokens_per_sec.max(1) as f64,
            ),
            ..Default::default()
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FabricSection {
    pub dram_capacity_bytes: u64,
    /// Capacity eviction and admission of automatic-caching entries: `adaptive` (default),
    /// `frequency`, `frequency:<horizon factor>` or `lru`. Explicit-breakpoint entries are never evicted
    /// for capacity.
    pub eviction: String,
    /// Bytes of the local-disk tier under `data_dir/fabric-disk`; 0 turns it off; unset
    /// (the default): a quarter of the free space there, at most 16 GiB, none under 64 MiB,
    /// and none when `gpu_capacity_bytes` is set ([`FabricSection::disk_bytes`]). DRAM
    /// evictions are demoted there and promoted back on a read; long holds (cache objects,
    /// retention past an hour) are written through so a restart keeps them.
    pub disk_capacity_bytes: Option<u64>,
    /// Bytes of GPU memory (device 0) used as the tier under DRAM instead of the disk; 0
    /// turns it off. Needs a build with the `cuda` feature and a GPU.
    pub gpu_capacity_bytes: u64,
    /// A cluster node's RDMA (builds with the `rdma` feature): `auto` (default) uses the
    /// first RDMA device if the host has one, `off` never does, anything else names the
    /// device to use (the node refuses to start if it cannot open it). Without RDMA the
    /// fabric moves blocks over TCP.
    pub rdma_device: String,
    /// Bytes of the registered pool a node stages blocks in for peers' RDMA READs.
    pub rdma_pool_bytes: u64,
    /// Bytes of peers' writes (replicas, repairs, hand-overs) a cluster node receives at
    /// once; a write waits for room before it is read (`CACHET_RECEIVE_BUDGET_BYTES`).
    pub receive_budget_bytes: u64,
    /// Where `cachet serve` opens its fabric node to an engine's own KV connector beside it
    /// (vLLM's, `connectors/vllm/`), on the fabric's wire with `CACHET_CLUSTER_TOKEN`; empty
    /// (default): not opened (`CACHET_FABRIC_LISTEN`). A cluster node always serves its
    /// fabric port (`cachet node --listen`).
    pub listen: String,
    /// The Unix socket an engine on this host (vLLM's KV connector) reaches the node on,
    /// and with it the node's shared-memory arena, where its blocks are loaded and saved in
    /// place (decision 0029): empty (default) is `data_dir/fabric.sock`, `off` turns the
    /// same-host path off (connectors use the TCP port). `cachet serve` opens it when
    /// `listen` is set; a cluster node always (`CACHET_FABRIC_SOCKET`).
    pub local_socket: String,
}

impl FabricSection {
    /// Where the node's Unix socket for engines on its host is (`None`: turned off).
    pub fn local_socket_path(&self, data_dir: &std::path::Path) -> Option<std::path::PathBuf> {
        match self.local_socket.as_str() {
            "off" => None,
            "" => Some(data_dir.join("fabric.sock")),
            p => Some(p.into()),
        }
    }

    pub fn eviction(&self) -> anyhow::Result<cache_fabric::EvictionPolicy> {
        cache_fabric::EvictionPolicy::parse(&self.eviction)
            .map_err(|e| anyhow::anyhow!("fabric.eviction: {e}"))
    }

    /// The disk tier's capacity in `disk_dir`: `disk_capacity_bytes` where set (0: none).
    /// Unset, none when the GPU tier is the one under DRAM; else a quarter of the space
    /// free there (counting what the tier already holds as free), at most
    /// [`DEFAULT_DISK_MAX`], and none when that is under [`DEFAULT_DISK_MIN`] (or the free
    /// space cannot be read).
    pub fn disk_bytes(&self, disk_dir: &std::path::Path) -> u64 {
        match self.disk_capacity_bytes {
            Some(b) => b,
            None if self.gpu_capacity_bytes > 0 => 0,
            None => {
                let free = free_bytes(disk_dir).unwrap_or(0) + dir_bytes(disk_dir);
                let quarter = (free / 4).min(DEFAULT_DISK_MAX);
                if quarter < DEFAULT_DISK_MIN {
                    0
                } else {
                    quarter
                }
            }
        }
    }

    /// This process's fabric node: DRAM, plus the disk tier in `disk_dir`
    /// ([`FabricSection::disk_bytes`]) or GPU memory.
    pub fn node(
        &self,
        disk_dir: &std::path::Path,
    ) -> anyhow::Result<std::sync::Arc<cache_fabric::FabricNode>> {
        let config = cache_fabric::NodeConfig {
            dram_capacity_bytes: self.dram_capacity_bytes,
            eviction: self.eviction()?,
        };
        let node = if self.gpu_capacity_bytes > 0 {
            gpu_node(config, self.gpu_capacity_bytes)?
        } else {
            let disk = self.disk_bytes(disk_dir);
            tracing::info!(
                dir = %disk_dir.display(),
                bytes = disk,
                configured = self.disk_capacity_bytes.is_some(),
                "fabric disk tier"
            );
            match disk {
                0 => cache_fabric::FabricNode::new(config),
                cap => cache_fabric::FabricNode::with_disk(config, disk_dir, cap)
                    .with_context(|| format!("opening the disk tier in {}", disk_dir.display()))?,
            }
        };
        node.set_receive_budget(self.receive_budget_bytes);
        Ok(node)
    }
}

/// The most the disk tier takes by default (`fabric.disk_capacity_bytes` unset).
pub const DEFAULT_DISK_MAX: u64 = 16 << 30;

/// Below this, the default is no disk tier: too little room to hold long retention.
pub const DEFAULT_DISK_MIN: u64 = 64 << 20;

/// Bytes free to an unprivileged writer on the filesystem holding `path` (or its nearest
/// existing ancestor: the tier's directory is made when it opens).
fn free_bytes(path: &std::path::Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let existing = path.ancestors().find(|p| p.exists())?;
    let c = std::ffi::CString::new(existing.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: `c` is a NUL-terminated path and `st` points to writable memory of the size
    // statvfs fills; it is read only when the call succeeds.
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so it filled the struct.
    let st = unsafe { st.assume_init() };
    // fsblkcnt_t and c_ulong are u64 on 64-bit Linux, narrower elsewhere.
    #[allow(clippy::unnecessary_cast)]
    Some((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// Bytes of the files directly in `dir` (what the disk tier holds already; 0 if none).
fn dir_bytes(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok()?.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

#[cfg(feature = "cuda")]
fn gpu_node(
    config: cache_fabric::NodeConfig,
    capacity: u64,
) -> anyhow::Result<std::sync::Arc<cache_fabric::FabricNode>> {
    let tier = cache_fabric::gpu::GpuTier::open(0, capacity)
        .context("fabric.gpu_capacity_bytes is set, but GPU memory cannot be used")?;
    Ok(cache_fabric::FabricNode::with_lower_tier(
        config,
        Box::new(tier),
    ))
}

#[cfg(not(feature = "cuda"))]
fn gpu_node(
    _config: cache_fabric::NodeConfig,
    _capacity: u64,
) -> anyhow::Result<std::sync::Arc<cache_fabric::FabricNode>> {
    bail!(
        "fabric.gpu_capacity_bytes needs a build with the cuda feature (cargo build --features cuda)"
    )
}

#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineSection {
    /// `reference` (SmolLM2 on our forward pass, plus the sim engines) or `sim` (only the
    /// cost-model engines).
    pub kind: String,
    /// The SmolLM2 GGUF (`make model` fetches it here).
    pub model_path: PathBuf,
    /// Multiplies the sim engines' modelled compute time; 0 = free.
    pub sim_time_scale: f64,
    /// Every sim answer this many tokens long (0: 12 to 31, by prompt); for load tests.
    pub sim_answer_tokens: usize,
    /// The element type every served model stores its KV in (`f32`, `f16`, `bf16`, `int8`,
    /// `fp8`); empty: each model's default (decision 0019).
    pub kv_dtype: String,
    /// Generations running at once, per model and per server of it (each model has its own
    /// workers; a vLLM upstream with two instances gets twice as many).
    pub workers: usize,
    /// Generations allowed to wait for a model's worker (per model) before 529; tenants
    /// share the wait by weighted fair queuing (their policy's `engine_weight`).
    pub queue: usize,
    /// Bytes of KV the requests in flight may hold at once on their way from engine to
    /// fabric; 0: a quarter of the machine's memory (`CACHET_KV_BUDGET_BYTES`).
    pub kv_budget_bytes: u64,
    /// How long a request waits for its share of the KV budget before 529.
    pub kv_budget_wait_ms: u64,
    /// Models served by a vLLM server whose KV connector keeps its KV in this process's
    /// fabric node (`[[engine.vllm]]`; `CACHET_VLLM_URL` adds one with the defaults).
    pub vllm: Vec<VllmUpstream>,
}

/// A model served by a vLLM server with Cachet's KV connector (connectors/vllm/).
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct VllmUpstream {
    /// The model id clients name.
    pub model: String,
    /// The vLLM server's base URL.
    pub url: String,
    /// More vLLM servers of the same model beside this node (one per GPU, say): a request
    /// goes to the least busy of `url` and these, and a prefix one of them saved, the others
    /// load from the node's shared memory. `CACHET_VLLM_URL` takes them comma-separated.
    pub instances: Vec<String>,
    /// The name vLLM serves the model under (`--served-model-name`).
    pub served_model: String,
    /// vLLM's KV block size (`--block-size`, a multiple of 32 on its CPU backend).
    pub block_size: usize,
    /// vLLM's `--max-model-len`.
    pub max_model_len: usize,
    /// Longest wait for vLLM's next bytes, a long prefill included.
    pub read_timeout_secs: u64,
    /// The KV event publishers of `url` and `instances`, in that order (vLLM's
    /// `--kv-events-config` endpoints, `tcp://host:port`, each optionally followed by `|`
    /// and its replay endpoint): a `cachet node` follows them and publishes which blocks
    /// each engine's own cache holds (docs/kv-events.md). Empty: not followed.
    /// `CACHET_VLLM_KV_EVENTS` takes them comma-separated.
    pub kv_events: Vec<String>,
    /// The role of `url` and `instances`, in that order: `prefill` (prefills and hands the
    /// KV over through the fabric, never decodes), `decode` or `both` (the default for any
    /// not listed). With a prefill instance, requests are prefilled there and decoded on the
    /// others (docs/operations.md, "Prefill and decode apart"). `CACHET_VLLM_ROLES` takes
    /// them comma-separated.
    pub roles: Vec<String>,
    /// With prefill instances, prompts shorter than this many tokens are prefilled where
    /// they are decoded (a short prefill costs less than a hand-over and must not queue
    /// behind long ones on the prefill instances).
    pub split_min_tokens: usize,
}

impl Default for VllmUpstream {
    fn default() -> Self {
        Self {
            model: "smollm2-135m-instruct-vllm".into(),
            url: String::new(),
            instances: Vec::new(),
            served_model: "smollm2".into(),
            block_size: 128,
            max_model_len: 8192,
            read_timeout_secs: 120,
            kv_events: Vec::new(),
            roles: Vec::new(),
            split_min_tokens: 1024,
        }
    }
}

impl VllmUpstream {
    /// The KV event publishers a node follows, named `{node}/{instance index}`.
    pub fn kv_event_publishers(
        &self,
        node: &str,
    ) -> Vec<cache_fabric::kv_events::vllm::VllmEvents> {
        self.kv_events
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let mut parts = e.splitn(2, '|');
                cache_fabric::kv_events::vllm::VllmEvents {
                    instance: format!("{node}/{i}"),
                    endpoint: parts.next().unwrap_or_default().trim().to_string(),
                    replay: parts.next().map(|r| r.trim().to_string()),
                }
            })
            .collect()
    }

    pub fn engine_config(&self, model_path: &Path) -> engine::vllm::VllmConfig {
        engine::vllm::VllmConfig {
            id: self.model.clone(),
            urls: std::iter::once(&self.url)
                .chain(&self.instances)
                .cloned()
                .collect(),
            served_model: self.served_model.clone(),
            block_size: self.block_size,
            context_window: self.max_model_len,
            model_path: model_path.to_path_buf(),
            read_timeout: Duration::from_secs(self.read_timeout_secs),
            roles: self
                .roles
                .iter()
                .map(|r| engine::vllm::Role::parse(r).unwrap_or_default())
                .collect(),
            split_min_tokens: self.split_min_tokens,
        }
    }
}

impl EngineSection {
    /// The configured KV dtype (`None`: each model's default).
    pub fn kv_dtype(&self) -> anyhow::Result<Option<engine::KvDtype>> {
        if self.kv_dtype.is_empty() {
            return Ok(None);
        }
        engine::KvDtype::parse(&self.kv_dtype)
            .map(Some)
            .map_err(|e| anyhow::anyhow!("engine.kv_dtype: {e}"))
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GatewaySection {
    pub max_body_bytes: usize,
    pub auth_cache_ttl_secs: u64,
    pub redis_timeout_ms: u64,
    /// The whole request head must arrive within this; also the keep-alive idle limit.
    pub header_read_timeout_secs: u64,
    /// The longest wait between two pieces of a request body.
    pub body_read_timeout_secs: u64,
    /// Close a connection whose client takes no response bytes for this long.
    pub write_stall_timeout_secs: u64,
    pub max_connections: usize,
    /// Per client IP address; 0 for none (behind a proxy every client shares its address).
    pub max_connections_per_client: usize,
    /// In-flight coalescing: a request whose prefix another request of its scope is
    /// prefilling waits for that write and reads it (off: every request computes its own).
    pub coalesce: bool,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MeterSection {
    pub batch_max: usize,
    pub queue_capacity: usize,
    pub retry_interval_ms: u64,
    /// Wait this long after the first event of a batch for more (group commit).
    pub linger_ms: u64,
    /// Relative paths are under `data_dir`.
    pub spool_file: PathBuf,
}

/// The admin console (`/admin`, `/v1/admin`) and what keeps its views current.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdminSection {
    /// The built admin UI (`make admin-ui` writes it).
    pub ui_dir: PathBuf,
    /// Lifetime of an access token issued at login.
    pub access_token_ttl_secs: u64,
    /// Lifetime of a login (refreshing does not extend it).
    pub session_ttl_secs: u64,
    /// How often the usage rollups (what dashboards and budgets read) are brought up to date,
    /// and cache objects' storage metered.
    pub rollup_interval_secs: u64,
    /// How often a process looks for administrative changes to apply.
    pub change_poll_ms: u64,
    /// How often budgeted tenants' spend this month is recomputed (admission refuses a tenant
    /// over its budget from then on).
    pub spend_refresh_secs: u64,
    /// The wait after a webhook delivery's first failed attempt; each later wait doubles.
    pub webhook_retry_base_ms: u64,
    /// Attempts before a webhook delivery is given up as failed.
    pub webhook_max_attempts: u32,
    /// Whether webhook endpoints may be private or loopback addresses (off: a tenant cannot
    /// aim the service's requests at the operator's network).
    pub webhook_allow_private_addresses: bool,
}

impl Default for AdminSection {
    fn default() -> Self {
        Self {
            ui_dir: "admin-ui/dist".into(),
            access_token_ttl_secs: 900,
            session_ttl_secs: 12 * 3600,
            rollup_interval_secs: 60,
            change_poll_ms: 1000,
            spend_refresh_secs: 15,
            webhook_retry_base_ms: 5000,
            webhook_max_attempts: 8,
            webhook_allow_private_addresses: false,
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogSection {
    /// `text` or `json`.
    pub format: String,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8080".into(),
            database_url: "postgres://postgres@127.0.0.1:5432/cachet".into(),
            redis_url: "redis://127.0.0.1:6379".into(),
            data_dir: ".cachet".into(),
            fabric: FabricSection::default(),
            engine: EngineSection::default(),
            gateway: GatewaySection::default(),
            meter: MeterSection::default(),
            cluster: ClusterSection::default(),
            log: LogSection::default(),
            admin: AdminSection::default(),
            admin_jwt_secret: String::new(),
            metrics_token: String::new(),
            memory_overcommit: false,
        }
    }
}
impl Default for FabricSection {
    fn default() -> Self {
        Self {
            dram_capacity_bytes: 1 << 30,
            eviction: "adaptive".into(),
            disk_capacity_bytes: None,
            gpu_capacity_bytes: 0,
            rdma_device: "auto".into(),
            rdma_pool_bytes: 256 << 20,
            receive_budget_bytes: cache_fabric::DEFAULT_RECEIVE_BYTES,
            listen: String::new(),
            local_socket: String::new(),
        }
    }
}
impl Default for EngineSection {
    fn default() -> Self {
        Self {
            kind: "reference".into(),
            model_path: engine::reference::default_model_path(),
            sim_time_scale: 1.0,
            sim_answer_tokens: 0,
            kv_dtype: String::new(),
            workers: 8,
            queue: 256,
            kv_budget_bytes: 0,
            kv_budget_wait_ms: 30_000,
            vllm: Vec::new(),
        }
    }
}
impl Default for GatewaySection {
    fn default() -> Self {
        Self {
            max_body_bytes: 32 * 1024 * 1024,
            auth_cache_ttl_secs: 30,
            redis_timeout_ms: 250,
            header_read_timeout_secs: 10,
            body_read_timeout_secs: 30,
            write_stall_timeout_secs: 60,
            max_connections: 16_384,
            max_connections_per_client: 1024,
            coalesce: true,
        }
    }
}
impl Default for MeterSection {
    fn default() -> Self {
        Self {
            batch_max: 2048,
            queue_capacity: 65_536,
            retry_interval_ms: 500,
            linger_ms: 2,
            spool_file: "usage-spool.jsonl".into(),
        }
    }
}
impl Default for LogSection {
    fn default() -> Self {
        Self {
            format: "text".into(),
        }
    }
}

fn env_parse<T: std::str::FromStr>(name: &str, into: &mut T) -> anyhow::Result<()>
where
    T::Err: std::fmt::Display,
{
    if let Ok(v) = std::env::var(name) {
        *into = v
            .parse()
            .map_err(|e| anyhow::anyhow!("environment variable {name}={v:?}: {e}"))?;
    }
    Ok(())
}

/// [`env_parse`] for a setting that may be left unset: `auto` (or empty) unsets it.
fn env_parse_optional<T: std::str::FromStr>(name: &str, into: &mut Option<T>) -> anyhow::Result<()>
where
    T::Err: std::fmt::Display,
{
    if let Ok(v) = std::env::var(name) {
        *into = match v.trim() {
            "" | "auto" => None,
            v => Some(
                v.parse()
                    .map_err(|e| anyhow::anyhow!("environment variable {name}={v:?}: {e}"))?,
            ),
        };
    }
    Ok(())
}

impl Config {
    /// Defaults, then the file (if any), then the environment; validated.
    pub fn load(file: Option<&Path>) -> anyhow::Result<Self> {
        let mut c = match file {
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .with_context(|| format!("reading config file {}", p.display()))?;
                toml::from_str(&text)
                    .with_context(|| format!("parsing config file {}", p.display()))?
            }
            None => Config::default(),
        };
        c.apply_env()?;
        c.validate()?;
        Ok(c)
    }

    fn apply_env(&mut self) -> anyhow::Result<()> {
        env_parse("CACHET_LISTEN", &mut self.listen)?;
        env_parse("DATABASE_URL", &mut self.database_url)?;
        env_parse("REDIS_URL", &mut self.redis_url)?;
        env_parse("CACHET_DATA_DIR", &mut self.data_dir)?;
        env_parse(
            "CACHET_DRAM_CAPACITY_BYTES",
            &mut self.fabric.dram_capacity_bytes,
        )?;
        env_parse("CACHET_FABRIC_EVICTION", &mut self.fabric.eviction)?;
        env_parse_optional(
            "CACHET_DISK_CAPACITY_BYTES",
            &mut self.fabric.disk_capacity_bytes,
        )?;
        env_parse(
            "CACHET_GPU_CAPACITY_BYTES",
            &mut self.fabric.gpu_capacity_bytes,
        )?;
        env_parse("CACHET_RDMA_DEVICE", &mut self.fabric.rdma_device)?;
        env_parse("CACHET_RDMA_POOL_BYTES", &mut self.fabric.rdma_pool_bytes)?;
        env_parse(
            "CACHET_RECEIVE_BUDGET_BYTES",
            &mut self.fabric.receive_budget_bytes,
        )?;
        env_parse("CACHET_FABRIC_LISTEN", &mut self.fabric.listen)?;
        env_parse("CACHET_FABRIC_SOCKET", &mut self.fabric.local_socket)?;
        if let Ok(urls) = std::env::var("CACHET_VLLM_URL")
            && !urls.is_empty()
        {
            let mut urls = urls.split(',').map(|u| u.trim().to_string());
            let up = VllmUpstream {
                url: urls.next().unwrap_or_default(),
                instances: urls.collect(),
                ..VllmUpstream::default()
            };
            match self.engine.vllm.iter_mut().find(|v| v.model == up.model) {
                Some(v) => (v.url, v.instances) = (up.url, up.instances),
                None => self.engine.vllm.push(up),
            }
        }
        if let Ok(eps) = std::env::var("CACHET_VLLM_KV_EVENTS")
            && !eps.is_empty()
            && let Some(v) = self.engine.vllm.first_mut()
        {
            v.kv_events = eps.split(',').map(|e| e.trim().to_string()).collect();
        }
        if let Ok(roles) = std::env::var("CACHET_VLLM_ROLES")
            && !roles.is_empty()
            && let Some(v) = self.engine.vllm.first_mut()
        {
            v.roles = roles.split(',').map(|r| r.trim().to_string()).collect();
        }
        env_parse("CACHET_ENGINE", &mut self.engine.kind)?;
        env_parse("CACHET_MODEL_PATH", &mut self.engine.model_path)?;
        env_parse("CACHET_SIM_TIME_SCALE", &mut self.engine.sim_time_scale)?;
        env_parse(
            "CACHET_SIM_ANSWER_TOKENS",
            &mut self.engine.sim_answer_tokens,
        )?;
        env_parse("CACHET_KV_DTYPE", &mut self.engine.kv_dtype)?;
        env_parse("CACHET_ENGINE_WORKERS", &mut self.engine.workers)?;
        env_parse(
            "CACHET_RESUME_GRACE_SECS",
            &mut self.cluster.resume_grace_secs,
        )?;
        env_parse("CACHET_ENGINE_QUEUE", &mut self.engine.queue)?;
        env_parse("CACHET_KV_BUDGET_BYTES", &mut self.engine.kv_budget_bytes)?;
        env_parse(
            "CACHET_KV_BUDGET_WAIT_MS",
            &mut self.engine.kv_budget_wait_ms,
        )?;
        env_parse("CACHET_MEMORY_OVERCOMMIT", &mut self.memory_overcommit)?;
        env_parse("CACHET_COALESCE", &mut self.gateway.coalesce)?;
        env_parse("CACHET_LOG_FORMAT", &mut self.log.format)?;
        env_parse("CACHET_ADMIN_JWT_SECRET", &mut self.admin_jwt_secret)?;
        env_parse("CACHET_METRICS_TOKEN", &mut self.metrics_token)?;
        env_parse("CACHET_ADMIN_UI_DIR", &mut self.admin.ui_dir)?;
        env_parse(
            "CACHET_ROLLUP_INTERVAL_SECS",
            &mut self.admin.rollup_interval_secs,
        )?;
        Ok(())
    }

    /// Every field is looked at, so none is silently ignored.
    pub fn validate(&self) -> anyhow::Result<()> {
        let Config {
            listen,
            database_url,
            redis_url,
            data_dir,
            fabric,
            engine,
            gateway,
            meter,
            cluster,
            log,
            admin,
            admin_jwt_secret,
            metrics_token: _,
            memory_overcommit: _,
        } = self;
        if !admin_jwt_secret.is_empty() && admin_jwt_secret.len() < 32 {
            bail!("CACHET_ADMIN_JWT_SECRET must be at least 32 bytes");
        }
        listen
            .parse::<std::net::SocketAddr>()
            .with_context(|| format!("listen: {listen:?} is not host:port"))?;
        if !database_url.starts_with("postgres://") && !database_url.starts_with("postgresql://") {
            bail!("database_url must be a postgres:// URL");
        }
        if !redis_url.is_empty() && !redis_url.starts_with("redis://") {
            bail!("redis_url must be a redis:// URL or empty");
        }
        if data_dir.as_os_str().is_empty() {
            bail!("data_dir must not be empty");
        }
        fabric.validate(data_dir)?;
        engine.validate()?;
        gateway.validate()?;
        meter.validate()?;
        cluster.validate()?;
        log.validate()?;
        admin.validate()?;
        Ok(())
    }

    pub fn admin(&self) -> control::admin::AdminConfig {
        control::admin::AdminConfig {
            ui_dir: self.admin.ui_dir.clone(),
            access_ttl: Duration::from_secs(self.admin.access_token_ttl_secs),
            session_ttl: Duration::from_secs(self.admin.session_ttl_secs),
            webhook_allow_private: self.admin.webhook_allow_private_addresses,
        }
    }

    pub fn spool_path(&self) -> PathBuf {
        self.data_dir.join(&self.meter.spool_file)
    }

    /// The HTTP server's timeouts and connection limits.
    pub fn serve_limits(&self) -> gateway::server::ServeLimits {
        let g = &self.gateway;
        gateway::server::ServeLimits {
            header_read_timeout: Duration::from_secs(g.header_read_timeout_secs),
            body_read_timeout: Duration::from_secs(g.body_read_timeout_secs),
            write_stall_timeout: Duration::from_secs(g.write_stall_timeout_secs),
            max_connections: g.max_connections,
            max_connections_per_client: g.max_connections_per_client,
            max_body_bytes: g.max_body_bytes,
            metrics_token: (!self.metrics_token.is_empty())
                .then(|| std::sync::Arc::from(self.metrics_token.as_str())),
        }
    }

    pub fn gateway(&self) -> gateway::GatewayConfig {
        gateway::GatewayConfig {
            max_body_bytes: self.gateway.max_body_bytes,
            auth_cache_ttl: Duration::from_secs(self.gateway.auth_cache_ttl_secs),
            redis_timeout: Duration::from_millis(self.gateway.redis_timeout_ms),
            internal_token: None,
            resume_grace: Duration::from_secs(self.cluster.resume_grace_secs),
            coalesce: self.gateway.coalesce,
            kv_budget_bytes: self.kv_budget_bytes(),
            kv_budget_wait: Duration::from_millis(self.engine.kv_budget_wait_ms),
        }
    }

    pub fn meter(&self) -> billing::MeterConfig {
        billing::MeterConfig {
            batch_max: self.meter.batch_max,
            queue_capacity: self.meter.queue_capacity,
            spool_path: self.spool_path(),
            retry_interval: Duration::from_millis(self.meter.retry_interval_ms),
            linger: Duration::from_millis(self.meter.linger_ms),
            foreign: billing::database::Foreign::KeepAside,
        }
    }
}

impl FabricSection {
    /// The fabric's settings, with the data directory its socket path derives from.
    fn validate(&self, data_dir: &std::path::Path) -> anyhow::Result<()> {
        let FabricSection {
            dram_capacity_bytes,
            eviction: _,
            disk_capacity_bytes,
            gpu_capacity_bytes,
            rdma_device,
            rdma_pool_bytes,
            receive_budget_bytes,
            listen: _,
            local_socket: _,
        } = self;
        if let Some(path) = self.local_socket_path(data_dir) {
            // sun_path holds 108 bytes with its NUL.
            let len = path.as_os_str().len();
            if len > 107 {
                bail!(
                    "fabric.local_socket {} is {len} bytes long; a Unix socket's path holds at most 107 (set a shorter fabric.local_socket, or \"off\")",
                    path.display()
                );
            }
        }
        if *receive_budget_bytes == 0 {
            bail!("fabric.receive_budget_bytes must be positive");
        }
        if rdma_device.is_empty() {
            bail!("fabric.rdma_device must be auto, off, or a device name");
        }
        if *rdma_pool_bytes == 0 {
            bail!(
                "fabric.rdma_pool_bytes must be positive (fabric.rdma_device = \"off\" turns RDMA off)"
            );
        }
        if disk_capacity_bytes.is_some_and(|d| d > 0) && *gpu_capacity_bytes > 0 {
            bail!(
                "fabric.disk_capacity_bytes and fabric.gpu_capacity_bytes are both set: a node has one tier under DRAM"
            );
        }
        if *dram_capacity_bytes == 0 {
            bail!("fabric.dram_capacity_bytes must be positive");
        }
        self.eviction()?;
        Ok(())
    }
}

impl EngineSection {
    /// The engines' settings: the kind, the model, the workers, every vLLM upstream.
    fn validate(&self) -> anyhow::Result<()> {
        let EngineSection {
            kind,
            model_path,
            sim_time_scale,
            sim_answer_tokens: _,
            kv_dtype: _,
            workers,
            queue: _,
            kv_budget_bytes: _,
            kv_budget_wait_ms,
            vllm,
        } = self;
        for (i, v) in vllm.iter().enumerate() {
            let VllmUpstream {
                model,
                url,
                instances,
                served_model,
                block_size,
                max_model_len,
                read_timeout_secs,
                kv_events,
                roles,
                split_min_tokens: _,
            } = v;
            if model.is_empty() || served_model.is_empty() {
                bail!("engine.vllm[{i}]: model and served_model must be set");
            }
            if let Some(bad) = std::iter::once(url)
                .chain(instances)
                .find(|u| !u.starts_with("http://"))
            {
                bail!("engine.vllm[{i}]: url and instances must be http:// URLs (got {bad:?})");
            }
            if *block_size == 0 || !block_size.is_multiple_of(32) {
                bail!("engine.vllm[{i}].block_size must be a positive multiple of 32");
            }
            if *max_model_len == 0 || *read_timeout_secs == 0 {
                bail!("engine.vllm[{i}]: max_model_len and read_timeout_secs must be positive");
            }
            if kv_events.len() > 1 + instances.len() {
                bail!(
                    "engine.vllm[{i}].kv_events: one publisher per instance at most ({} given for {} instances)",
                    kv_events.len(),
                    1 + instances.len()
                );
            }
            if let Some(bad) = kv_events
                .iter()
                .flat_map(|e| e.split('|'))
                .find(|e| !e.starts_with("tcp://"))
            {
                bail!("engine.vllm[{i}].kv_events: endpoints are tcp://host:port (got {bad:?})");
            }
            if roles.len() > 1 + instances.len() {
                bail!(
                    "engine.vllm[{i}].roles: one role per instance at most ({} given for {} instances)",
                    roles.len(),
                    1 + instances.len()
                );
            }
            if let Some(bad) = roles
                .iter()
                .find(|r| engine::vllm::Role::parse(r).is_none())
            {
                bail!(
                    "engine.vllm[{i}].roles: {bad:?} is not a role; roles are prefill, decode, both"
                );
            }
            let role = |k: usize| roles.get(k).map_or("both", String::as_str);
            if (0..=instances.len()).all(|k| role(k) == "prefill") {
                bail!("engine.vllm[{i}].roles: an instance must decode (decode or both)");
            }
            if vllm[..i].iter().any(|o| o.model == *model) {
                bail!("engine.vllm[{i}]: model {model:?} is listed twice");
            }
        }
        if !vllm.is_empty() && model_path.as_os_str().is_empty() {
            bail!("engine.model_path must be set: vLLM models render prompts with its tokenizer");
        }
        self.kv_dtype()?;
        if kind != "sim" && kind != "reference" {
            bail!("engine.kind: {kind:?} is not an engine; available: reference, sim");
        }
        if kind == "reference" && model_path.as_os_str().is_empty() {
            bail!("engine.model_path must be set for the reference engine");
        }
        if !(sim_time_scale.is_finite() && *sim_time_scale >= 0.0) {
            bail!("engine.sim_time_scale must be a finite number >= 0");
        }
        if *workers == 0 {
            bail!("engine.workers must be positive");
        }
        if *kv_budget_wait_ms == 0 {
            bail!("engine.kv_budget_wait_ms must be positive");
        }
        Ok(())
    }
}

impl GatewaySection {
    /// The HTTP edge's settings: timeouts, connections, body size.
    fn validate(&self) -> anyhow::Result<()> {
        let GatewaySection {
            max_body_bytes,
            auth_cache_ttl_secs: _,
            redis_timeout_ms,
            header_read_timeout_secs,
            body_read_timeout_secs,
            write_stall_timeout_secs,
            max_connections,
            max_connections_per_client: _,
            coalesce: _,
        } = self;
        if *header_read_timeout_secs == 0
            || *body_read_timeout_secs == 0
            || *write_stall_timeout_secs == 0
        {
            bail!("gateway.*_timeout_secs must be positive");
        }
        if *max_connections == 0 {
            bail!("gateway.max_connections must be positive");
        }
        if *max_body_bytes < 1024 {
            bail!("gateway.max_body_bytes must be at least 1024");
        }
        if *redis_timeout_ms == 0 {
            bail!("gateway.redis_timeout_ms must be positive");
        }
        Ok(())
    }
}

impl MeterSection {
    /// The meter's settings: batches, queue, retries, the spool.
    fn validate(&self) -> anyhow::Result<()> {
        let MeterSection {
            batch_max,
            queue_capacity,
            retry_interval_ms,
            linger_ms,
            spool_file,
        } = self;
        if *linger_ms > 1000 {
            bail!("meter.linger_ms must be at most 1000");
        }
        if *batch_max == 0 || *queue_capacity == 0 || *retry_interval_ms == 0 {
            bail!(
                "meter.batch_max, meter.queue_capacity and meter.retry_interval_ms must be positive"
            );
        }
        if spool_file.as_os_str().is_empty() {
            bail!("meter.spool_file must not be empty");
        }
        Ok(())
    }
}

impl ClusterSection {
    /// The cluster's settings: shard groups, replicas, the conductor's rates and SLO.
    fn validate(&self) -> anyhow::Result<()> {
        let ClusterSection {
            group_size,
            replicas,
            prefill_tokens_per_sec,
            transfer_bytes_per_sec,
            load_bytes_per_sec,
            ttft_slo_ms,
            tbt_slo_ms,
            resume_grace_secs: _,
        } = self;
        if *group_size == 0 || *replicas == 0 || replicas > group_size {
            bail!("cluster.replicas must be between 1 and cluster.group_size");
        }
        if *prefill_tokens_per_sec == 0
            || *transfer_bytes_per_sec == 0
            || *load_bytes_per_sec == 0
            || *ttft_slo_ms == 0
            || *tbt_slo_ms == 0
        {
            bail!(
                "cluster.prefill_tokens_per_sec, cluster.transfer_bytes_per_sec, \
                 cluster.load_bytes_per_sec, cluster.ttft_slo_ms and cluster.tbt_slo_ms must \
                 be positive"
            );
        }
        Ok(())
    }
}

impl LogSection {
    /// The log's settings.
    fn validate(&self) -> anyhow::Result<()> {
        let LogSection { format } = self;
        if format != "text" && format != "json" {
            bail!("log.format must be text or json");
        }
        Ok(())
    }
}

impl AdminSection {
    /// The admin console's settings: token and session lifetimes, loops, webhooks.
    fn validate(&self) -> anyhow::Result<()> {
        let AdminSection {
            ui_dir: _,
            access_token_ttl_secs,
            session_ttl_secs,
            rollup_interval_secs,
            change_poll_ms,
            spend_refresh_secs,
            webhook_retry_base_ms,
            webhook_max_attempts,
            webhook_allow_private_addresses: _,
        } = self;
        if !(60..=86_400).contains(access_token_ttl_secs) {
            bail!("admin.access_token_ttl_secs must be between 60 and 86400");
        }
        if session_ttl_secs < access_token_ttl_secs {
            bail!("admin.session_ttl_secs must be at least admin.access_token_ttl_secs");
        }
        if *rollup_interval_secs == 0 || *rollup_interval_secs > 3600 {
            bail!("admin.rollup_interval_secs must be between 1 and 3600");
        }
        if !(50..=5000).contains(change_poll_ms) {
            bail!(
                "admin.change_poll_ms must be between 50 and 5000 (changes must apply within seconds)"
            );
        }
        if *spend_refresh_secs == 0 || *spend_refresh_secs > 3600 {
            bail!("admin.spend_refresh_secs must be between 1 and 3600");
        }
        if !(100..=3_600_000).contains(webhook_retry_base_ms) {
            bail!("admin.webhook_retry_base_ms must be between 100 and 3600000");
        }
        if !(1..=30).contains(webhook_max_attempts) {
            bail!("admin.webhook_max_attempts must be between 1 and 30");
        }
        Ok(())
    }
}

/// The machine's memory: the lesser of physical memory and this process's cgroup limit.
pub fn machine_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let total = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())?
        * 1024;
    let cgroup = std::fs::read_to_string("/sys/fs/cgroup/memory.max")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok());
    Some(cgroup.map_or(total, |c| c.min(total)))
}

impl Config {
    /// The KV budget this configuration asks for: `engine.kv_budget_bytes`, or a quarter of
    /// the machine's memory when it is 0 (1 GiB if the machine's memory cannot be read).
    pub fn kv_budget_bytes(&self) -> u64 {
        match self.engine.kv_budget_bytes {
            0 => machine_bytes().map_or(1 << 30, |m| m / 4),
            b => b,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sample_config_parses_and_validates() {
        let text =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/cachet.sample.toml"))
                .unwrap();
        let c: Config = toml::from_str(&text).unwrap();
        c.validate().unwrap();
    }

    #[test]
    fn the_local_socket_defaults_to_the_data_dir_and_can_be_turned_off() {
        let dir = std::path::Path::new("/var/lib/cachet");
        let c = Config::default();
        assert_eq!(
            c.fabric.local_socket_path(dir),
            Some(dir.join("fabric.sock"))
        );
        let c: Config = toml::from_str("[fabric]\nlocal_socket = \"off\"").unwrap();
        assert_eq!(c.fabric.local_socket_path(dir), None);
        let c: Config = toml::from_str("[fabric]\nlocal_socket = \"/run/c.sock\"").unwrap();
        assert_eq!(c.fabric.local_socket_path(dir), Some("/run/c.sock".into()));
        let long = format!("[fabric]\nlocal_socket = \"/{}\"", "x".repeat(120));
        let c: Config = toml::from_str(&long).unwrap();
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("at most 107")
        );
    }

    #[test]
    fn a_vllm_model_may_have_several_instances() {
        let c: Config = toml::from_str(
            "[engine]\nmodel_path = \"m.gguf\"\n[[engine.vllm]]\nurl = \"http://a:1\"\ninstances = [\"http://b:2\"]",
        )
        .unwrap();
        c.validate().unwrap();
        let e = c.engine.vllm[0].engine_config(std::path::Path::new("m.gguf"));
        assert_eq!(e.urls, vec!["http://a:1", "http://b:2"]);
        assert_eq!(e.roles, vec![], "both, colocated, unless told");
        let roles = |r: &str| {
            toml::from_str::<Config>(&format!(
                "[engine]\nmodel_path = \"m.gguf\"\n[[engine.vllm]]\nurl = \"http://a:1\"\ninstances = [\"http://b:2\"]\nroles = {r}"
            ))
            .unwrap()
        };
        let c = roles("[\"prefill\", \"decode\"]");
        c.validate().unwrap();
        assert_eq!(
            c.engine.vllm[0]
                .engine_config(std::path::Path::new("m.gguf"))
                .roles,
            vec![engine::vllm::Role::Prefill, engine::vllm::Role::Decode]
        );
        for (bad, says) in [
            ("[\"prefill\", \"prefill\"]", "must decode"),
            ("[\"prefil\"]", "not a role"),
            ("[\"both\", \"both\", \"both\"]", "one role per instance"),
        ] {
            let e = roles(bad).validate().unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
        let c: Config = toml::from_str(
            "[engine]\nmodel_path = \"m.gguf\"\n[[engine.vllm]]\nurl = \"http://a:1\"\ninstances = [\"b:2\"]",
        )
        .unwrap();
        assert!(c.validate().unwrap_err().to_string().contains("http://"));
    }

    #[test]
    fn unknown_fields_and_bad_values_are_rejected() {
        assert!(toml::from_str::<Config>("lisen = \"x\"").is_err());
        let c: Config = toml::from_str("[engine]\nkind = \"gpt\"").unwrap();
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("engine.kind")
        );
    }

    #[test]
    fn rdma_settings_are_checked() {
        let c: Config = toml::from_str("[fabric]\nrdma_device = \"\"").unwrap();
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("rdma_device")
        );
        let c: Config = toml::from_str("[fabric]\nrdma_pool_bytes = 0").unwrap();
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("rdma_pool_bytes")
        );
        let c: Config = toml::from_str("[fabric]\nrdma_device = \"mlx5_0\"").unwrap();
        c.validate().unwrap();
        assert_eq!(Config::default().fabric.rdma_device, "auto");
    }

    /// Unset, the disk tier is on by default (a quarter of the free space, within bounds),
    /// off where the GPU tier is the one under DRAM; set, it is what it says (0: off).
    #[test]
    fn the_disk_tier_is_on_by_default_and_explicit_when_set() {
        let dir = std::env::temp_dir();
        let c = Config::default();
        assert_eq!(c.fabric.disk_capacity_bytes, None);
        let free = free_bytes(&dir).expect("the temp dir's free space");
        let auto = c
            .fabric
            .disk_bytes(&dir.join("no-such-dir").join("fabric-disk"));
        let expect = (free / 4).min(DEFAULT_DISK_MAX);
        if expect >= DEFAULT_DISK_MIN {
            // Free space moves while other processes write: within 1%.
            assert!(
                auto.abs_diff(expect) <= expect / 100 + (1 << 20),
                "{auto} vs {expect}"
            );
        } else {
            assert_eq!(auto, 0);
        }
        let c: Config = toml::from_str("[fabric]\ndisk_capacity_bytes = 0").unwrap();
        assert_eq!(c.fabric.disk_bytes(&dir), 0);
        let c: Config = toml::from_str("[fabric]\ndisk_capacity_bytes = 12345").unwrap();
        assert_eq!(c.fabric.disk_bytes(&dir), 12345);
        // The GPU tier set and the disk left unset: no disk, and no conflict.
        let c: Config = toml::from_str("[fabric]\ngpu_capacity_bytes = 1048576").unwrap();
        c.validate().unwrap();
        assert_eq!(c.fabric.disk_bytes(&dir), 0);
        // Both set explicitly: refused (below).
        let c: Config =
            toml::from_str("[fabric]\ndisk_capacity_bytes = 0\ngpu_capacity_bytes = 1").unwrap();
        c.validate().unwrap();
    }

    #[test]
    fn one_tier_under_dram_and_gpu_memory_only_where_it_exists() {
        let c: Config =
            toml::from_str("[fabric]\ndisk_capacity_bytes = 1\ngpu_capacity_bytes = 1").unwrap();
        assert!(c.validate().unwrap_err().to_string().contains("one tier"));
        let c: Config = toml::from_str("[fabric]\ngpu_capacity_bytes = 1048576").unwrap();
        c.validate().unwrap();
        // Without the feature, or without a GPU, the node refuses to start and says why.
        let refused = c
            .fabric
            .node(std::path::Path::new("/nonexistent"))
            .err()
            .map(|e| format!("{e:#}"));
        #[cfg(not(feature = "cuda"))]
        assert!(refused.unwrap().contains("cuda feature"));
        #[cfg(feature = "cuda")]
        if let Some(msg) = refused {
            assert!(msg.contains("gpu_capacity_bytes"), "{msg}");
        }
    }
}
