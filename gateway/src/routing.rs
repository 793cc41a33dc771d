//! The routing gateway (`cachet router`): a stateless front door for a cluster of
//! `cachet node`s.
//!
//! For each `POST /v1/messages` it authenticates the key and validates and renders the
//! request (so bad requests get their 4xx here, and the prompt's block keys are known),
//! asks the [`conductor`] which node should serve it from the prefix index
//! (kept from the nodes' block events, [`follow_cluster`]) and its count of requests in
//! flight per node, and forwards the request there with the cluster token and the request
//! id it chose. If no node can start answering within the TTFT SLO it answers 529 at once.
//!
//! A node that cannot be reached, fails before its answer is complete, or answers 529 (its
//! engines are saturated; it did no work) is skipped and the request goes to the next node in
//! the conductor's order with the same request id: the ledger keys usage by request id, so a
//! retried request is billed once. Other answers, errors included, are passed through. A
//! streamed answer whose node fails mid-stream is resumed on the next node and spliced after
//! what the client already has (module `relay`); every answer names its node in `x-cachet-node`.
//!
//! What it is not: it runs no engine and holds no KV; it loads the engines only to render
//! and count tokens exactly as the nodes do.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, RwLock};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use axum::{Extension, Router};
use cache_fabric::events::Follower;
use cache_fabric::index::PrefixIndex;
use cache_fabric::kv_events::{EngineFollower, EngineView};
use cache_fabric::membership;
use cachet_common::RequestId;
use serde_json::json;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::auth::Authenticator;
use crate::engines::EnginePool;
use crate::error::{ApiError, ErrorCode};
use crate::metrics;
use crate::state::{CLUSTER_TOKEN_HEADER, REQUEST_ID_HEADER};
use conductor::{Candidate, CostModel, Demand, Estimate, Refusal};

pub mod conductor;
mod relay;

pub use relay::RESUMED_NOTE;

/// The response header naming the node that served a request.
pub const NODE_HEADER: &str = "x-cachet-node";

/// Routing gateway settings.
#[derive(Clone, Debug)]
pub struct RoutingConfig {
    pub max_body_bytes: usize,
    pub auth_cache_ttl: Duration,
    pub cluster_token: Arc<str>,
    pub cost: CostModel,
    /// The bandwidth assumed for a node's pulls from its peers until it has measured its own.
    pub transfer_bytes_per_sec: f64,
    /// The rate assumed for an engine's loads from its own node's store.
    pub load_bytes_per_sec: f64,
    /// How long one forwarded request may take before the node is given up on.
    pub node_timeout: Duration,
}

/// A node requests can be sent to.
#[derive(Clone, Debug)]
struct NodeEntry {
    id: String,
    base: String,
    slot: Option<usize>,
    /// What the node measured: prefill rate per model, pull bandwidth.
    prefill_tokens_per_sec: std::collections::BTreeMap<String, f64>,
    pull_bytes_per_sec: Option<f64>,
    load_bytes_per_sec: Option<f64>,
    /// Its models' stages (vLLM upstreams): prefill and decode instances and their loads.
    stages: std::collections::BTreeMap<String, cachet_common::stages::StageLoad>,
}

#[derive(Default)]
struct Load {
    in_flight: AtomicUsize,
    /// Uncached prompt tokens of the requests sent there whose answers have not started
    /// (a node answers once its first token is out): its prefill queue.
    prefilling: AtomicUsize,
    /// Moving average of service time, in microseconds.
    service_us: AtomicUsize,
}

pub struct RouterInner {
    config: RoutingConfig,
    auth: Arc<Authenticator>,
    /// The membership as last read (kept across a Redis outage, see `follow_cluster`).
    members: RwLock<Vec<membership::NodeRecord>>,
    engines: EnginePool,
    http: reqwest::Client,
    nodes: RwLock<Vec<NodeEntry>>,
    /// The control plane's database: cache objects a request names are read from it.
    pool: PgPool,
    index: Arc<RwLock<PrefixIndex>>,
    /// What the nodes' engines hold in their own KV caches (the KV event stream).
    engine_caches: Arc<RwLock<EngineView>>,
    load: Mutex<HashMap<String, Arc<Load>>>,
    /// Per node, cancelled when it leaves the membership: requests waiting on it move on.
    departures: Mutex<HashMap<String, CancellationToken>>,
    /// The first uncached block of each request being prefilled, and its node: a request
    /// that needs the same block next goes to that node, where it waits for the write
    /// (in-flight coalescing) instead of computing it again elsewhere.
    computing: Mutex<HashMap<cachet_common::BlockHash, String>>,
    turn: AtomicUsize,
}

pub type RouterState = Arc<RouterInner>;

pub fn state(
    config: RoutingConfig,
    pool: PgPool,
    engines: EnginePool,
) -> anyhow::Result<RouterState> {
    let http = reqwest::Client::builder()
        // Below the nodes' idle close (`gateway.header_read_timeout_secs`, 10 s by default):
        // a pooled connection a node has already closed would fail the request sent on it.
        // A gateway stopped for longer (SIGSTOP) finds them expired on its next checkout.
        .pool_idle_timeout(Duration::from_secs(5))
        .connect_timeout(Duration::from_secs(1))
        .build()?;
    Ok(Arc::new(RouterInner {
        auth: Arc::new(Authenticator::new(pool.clone(), config.auth_cache_ttl)),
        pool,
        members: RwLock::new(Vec::new()),
        config,
        engines,
        http,
        nodes: RwLock::new(Vec::new()),
        index: Arc::new(RwLock::new(PrefixIndex::with_capacity(1 << 16))),
        engine_caches: Arc::default(),
        load: Mutex::new(HashMap::new()),
        departures: Mutex::new(HashMap::new()),
        computing: Mutex::new(HashMap::new()),
        turn: AtomicUsize::new(0),
    }))
}

/// Node `id`'s entry of a per-node map, made on first use.
fn per_node<T: Clone + Default>(map: &Mutex<HashMap<String, T>>, id: &str) -> T {
    let mut map = map.lock().unwrap_or_else(|p| p.into_inner());
    map.entry(id.to_string()).or_default().clone()
}

impl RouterInner {
    fn load(&self, id: &str) -> Arc<Load> {
        per_node(&self.load, id)
    }

    /// Cancelled when node `id` leaves the membership (a node that stopped or is cut off
    /// holds its requests until then; they then move to the next node, like a failure).
    fn departure(&self, id: &str) -> CancellationToken {
        per_node(&self.departures, id)
    }

    /// The nodes that are not among `ids` (those that joined since they were ranked).
    fn newcomers(&self, ids: &[String]) -> Vec<String> {
        self.nodes
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|n| n.id.clone())
            .filter(|n| !ids.contains(n))
            .collect()
    }

    /// A routable node's base URL.
    fn base_of(&self, id: &str) -> Option<String> {
        self.nodes
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|n| n.id == id)
            .map(|n| n.base.clone())
    }

    /// The request to send to a node: the cluster token, the request id, the trace context,
    /// and the client's headers that matter to the API.
    fn node_request(
        &self,
        base: &str,
        method: axum::http::Method,
        path: &str,
        headers: &HeaderMap,
        rid: RequestId,
        body: Bytes,
    ) -> reqwest::RequestBuilder {
        let mut req = self
            .http
            .request(method, format!("{base}{path}"))
            .timeout(self.config.node_timeout)
            .header(CLUSTER_TOKEN_HEADER, &*self.config.cluster_token)
            .header(REQUEST_ID_HEADER, rid.to_string())
            .body(body);
        // The node's span joins this request's trace (when traces are exported).
        if let Some(tp) = cachet_common::trace::traceparent() {
            req = req.header(cachet_common::trace::TRACEPARENT, tp);
        }
        for (name, value) in headers {
            let n = name.as_str();
            if n == "x-api-key"
                || n == "authorization"
                || n == "content-type"
                || n == "anthropic-version"
                || n == "anthropic-beta"
            {
                req = req.header(name, value);
            }
        }
        req
    }

    /// What the change feed ([`crate::sync`]) applies changes to here: the key cache.
    pub fn sync_targets(&self) -> crate::sync::Targets {
        crate::sync::Targets {
            auth: Some(self.auth.clone()),
            ..Default::default()
        }
    }

    /// The fabric addresses of the cluster's live members.
    pub fn fabric_addrs(&self) -> Vec<String> {
        self.fabric_members().into_iter().map(|(_, a)| a).collect()
    }

    /// The members' ids and fabric addresses.
    pub fn fabric_members(&self) -> Vec<(String, String)> {
        self.members
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|r| (r.id.clone(), r.addr.clone()))
            .collect()
    }

    /// Nodes currently routable.
    pub fn node_ids(&self) -> Vec<String> {
        self.nodes
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|n| n.id.clone())
            .collect()
    }
}

/// Keep the node list and the prefix index current until `stop`: membership from Redis
/// every `every` (a node that left or went silent leaves the index at once), block events
/// from the cluster's stream, replayed from its start so a new gateway catches up.
pub async fn follow_cluster(
    state: RouterState,
    mut conn: impl redis::aio::ConnectionLike + Send,
    prefix: String,
    every: Duration,
    stop: CancellationToken,
) {
    tokio::spawn(watch_pauses(stop.clone()));
    let mut follower = Follower::new(format!("{prefix}:blocks"), "0-0", state.index.clone());
    let mut refreshed: Option<Instant> = None;
    // When a membership read last failed: for a while after Redis is back, nodes' records
    // may have expired during the outage before their heartbeats renew them, so nodes
    // missing from a read then are kept rather than dropped (no 529 for want of nodes).
    let mut last_unreadable: Option<Instant> = None;
    while !stop.is_cancelled() {
        if refreshed.is_none_or(|t| t.elapsed() >= every) {
            refreshed = Some(Instant::now());
            match membership::live_nodes(&mut conn, &prefix).await {
                Ok(mut records) => {
                    let mut members = state.members.write().unwrap_or_else(|p| p.into_inner());
                    if last_unreadable.is_some_and(|t| {
                        t.elapsed() < membership::DOWN_AFTER + membership::HEARTBEAT
                    }) {
                        for r in members.iter() {
                            if !records.iter().any(|f| f.id == r.id) {
                                records.push(r.clone());
                            }
                        }
                    } else {
                        last_unreadable = None;
                    }
                    *members = records.clone();
                    drop(members);
                    let fresh: Vec<NodeEntry> = records
                        .iter()
                        .filter_map(|r| {
                            Some(NodeEntry {
                                id: r.id.clone(),
                                base: format!("http://{}", r.api_addr.as_ref()?),
                                slot: follower.slot(&r.id),
                                prefill_tokens_per_sec: r.prefill_tokens_per_sec.clone(),
                                pull_bytes_per_sec: r.pull_bytes_per_sec,
                                load_bytes_per_sec: r.load_bytes_per_sec,
                                stages: r.stages.clone(),
                            })
                        })
                        .collect();
                    let mut nodes = state.nodes.write().unwrap_or_else(|p| p.into_inner());
                    for gone in nodes.iter().filter(|n| !fresh.iter().any(|f| f.id == n.id)) {
                        tracing::warn!(node = %gone.id, "node left the cluster; its blocks leave the index and its requests move on");
                        if let Some(t) = state
                            .departures
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .remove(&gone.id)
                        {
                            t.cancel();
                        }
                        if let Some(slot) = gone.slot {
                            state
                                .index
                                .write()
                                .unwrap_or_else(|p| p.into_inner())
                                .remove_node(slot);
                        }
                        state
                            .engine_caches
                            .write()
                            .unwrap_or_else(|p| p.into_inner())
                            .forget_node(&gone.id);
                    }
                    *nodes = fresh;
                    metrics::ROUTABLE_NODES.set(nodes.len() as i64);
                }
                Err(e) => {
                    last_unreadable = Some(Instant::now());
                    tracing::warn!(error = %e, "reading cluster membership failed")
                }
            }
        }
        if let Err(e) = follower.poll(&mut conn, Duration::from_millis(200)).await {
            tracing::warn!(error = %e, "reading block events failed");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// Keep the engine-cache view from the cluster's KV event stream until `stop` (on a
/// connection of its own: its reads block).
pub async fn follow_engine_caches(
    state: RouterState,
    mut conn: impl redis::aio::ConnectionLike + Send,
    prefix: String,
    stop: CancellationToken,
) {
    let mut follower = EngineFollower::new(prefix, state.engine_caches.clone());
    while !stop.is_cancelled() {
        match follower.poll(&mut conn, Duration::from_millis(200)).await {
            Ok(_) => {
                let held = state
                    .engine_caches
                    .read()
                    .unwrap_or_else(|p| p.into_inner())
                    .len();
                metrics::ENGINE_CACHE_BLOCKS.set(held as i64);
            }
            Err(e) => {
                tracing::warn!(error = %e, "reading KV events failed");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
}

/// Where a request stands: its demand on the cluster, where its prefix is cached (tokens
/// per node), and the first block it would compute (none when all of it is cached).
struct Standing {
    demand: Demand,
    /// Every node, with what it holds of the prefix and its rates for this model (load is
    /// filled in by `rank`).
    candidates: Vec<Candidate>,
    next: Option<cachet_common::BlockHash>,
}

/// The demand a messages request puts on the cluster and where its prefix is cached.
async fn demand(
    state: &RouterState,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<Standing, ApiError> {
    let principal = state.auth.authenticate(headers).await?;
    let crate::api::stages::Shaped {
        engine, prepared, ..
    } = crate::api::anthropic::prepare_messages(
        &state.engines,
        &state.pool,
        &principal,
        body.clone(),
    )
    .await?;
    let info = engine.info();
    let b = info.block_size;
    let nodes = state
        .nodes
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let next = prepared.keys.as_ref().and_then(|k| {
        let index = state.index.read().unwrap_or_else(|p| p.into_inner());
        k.blocks.get(index.longest_prefix(&k.blocks)).copied()
    });
    let (cached_blocks, local, in_engine) = match &prepared.keys {
        Some(k) => {
            let index = state.index.read().unwrap_or_else(|p| p.into_inner());
            let n = index.longest_prefix(&k.blocks);
            let local: Vec<usize> = nodes
                .iter()
                .map(|node| {
                    let held = node.slot.map_or(0, |s| {
                        k.blocks[..n]
                            .iter()
                            .filter(|h| index.nodes(h).contains(s))
                            .count()
                    });
                    held * b
                })
                .collect();
            let view = state
                .engine_caches
                .read()
                .unwrap_or_else(|p| p.into_inner());
            let in_engine = nodes
                .iter()
                .map(|node| view.leading(&node.id, &k.blocks) * b)
                .collect();
            (n, local, in_engine)
        }
        None => (0, vec![0; nodes.len()], vec![0; nodes.len()]),
    };
    // A node that has not measured this model yet is estimated at the rate the nodes that
    // have measured it (the same model, usually the same hardware), else at the model's
    // profile: a measured node must not lose to an unmeasured one's optimistic profile.
    let measured: Vec<f64> = nodes
        .iter()
        .filter_map(|n| n.prefill_tokens_per_sec.get(&info.id).copied())
        .filter(|r| r.is_finite() && *r > 0.0)
        .collect();
    let seed = if measured.is_empty() {
        engine.nominal_prefill_per_token()
    } else {
        Duration::from_secs_f64(measured.len() as f64 / measured.iter().sum::<f64>())
    };
    let candidates = nodes
        .iter()
        .zip(local)
        .zip(in_engine)
        .map(|((node, local_tokens), engine_tokens)| {
            let prefill = node
                .prefill_tokens_per_sec
                .get(&info.id)
                .filter(|r| r.is_finite() && **r > 0.0)
                .map_or(seed, |r| Duration::from_secs_f64(1.0 / r));
            let transfer = node
                .pull_bytes_per_sec
                .filter(|r| r.is_finite() && *r > 0.0)
                .unwrap_or(state.config.transfer_bytes_per_sec);
            metrics::CONDUCTOR_PREFILL_RATE
                .with_label_values(&[node.id.as_str(), info.id.as_str()])
                .set(1.0 / prefill.as_secs_f64().max(1e-9));
            metrics::CONDUCTOR_TRANSFER_RATE
                .with_label_values(&[node.id.as_str()])
                .set(transfer);
            let stages = node.stages.get(&info.id).cloned();
            if let Some((s, line)) = stages.as_ref().and_then(|s| Some((s, s.step?))) {
                metrics::CONDUCTOR_TBT
                    .with_label_values(&[node.id.as_str(), info.id.as_str()])
                    .set(
                        line.at(s.next_decode_batch(s.decode_in_flight))
                            .as_secs_f64(),
                    );
            }
            Candidate {
                id: node.id.clone(),
                local_tokens,
                engine_tokens,
                in_flight: 0,
                prefill_queue_tokens: 0,
                service_time: Duration::ZERO,
                prefill_per_token: prefill,
                transfer_bytes_per_sec: transfer,
                load_bytes_per_sec: node
                    .load_bytes_per_sec
                    .filter(|r| r.is_finite() && *r > 0.0)
                    .unwrap_or(state.config.load_bytes_per_sec),
                stages,
            }
        })
        .collect();
    Ok(Standing {
        demand: Demand {
            prompt_tokens: prepared.rendered.tokens.len(),
            cached_tokens: cached_blocks * b,
            bytes_per_token: info.kv.bytes_per_token(),
            handoff_tokens: prepared.keys.as_ref().map_or(0, |k| k.blocks.len() * b),
        },
        candidates,
        next,
    })
}

/// While a request is being prefilled on a node, requests needing the same next block go
/// there; dropped when its answer starts (the node has written the blocks by then).
struct Computing<'a> {
    state: &'a RouterInner,
    block: cachet_common::BlockHash,
}

impl Drop for Computing<'_> {
    fn drop(&mut self) {
        self.state
            .computing
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.block);
    }
}

async fn messages(
    State(state): State<RouterState>,
    Extension(rid): Extension<RequestId>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match crate::api::stages::body_bytes(body) {
        Ok(b) => b,
        Err(e) => return e.with_request_id(rid).into_response(),
    };
    let standing = match crate::api::stages::check_version(&headers) {
        Ok(()) => demand(&state, &headers, &body).await,
        Err(e) => Err(e),
    };
    let (routed, _computing) = match standing.and_then(|s| rank(&state, s, None)) {
        Ok(r) => r,
        Err(e) => return e.with_request_id(rid).into_response(),
    };
    let req = Forward::post(rid, "/v1/messages", &headers, body, Wire::Anthropic);
    forward(&state, req, &routed).await
}

/// `POST /v1/chat/completions` on a cluster: routed by the Messages request it translates to
/// (the same prefix, the same nodes), forwarded as sent to the node's own endpoint.
async fn chat(
    State(state): State<RouterState>,
    Extension(rid): Extension<RequestId>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let routed = async {
        let body = crate::api::stages::body_bytes(body)?;
        let principal = state.auth.authenticate(&headers).await?;
        let (messages, opts) = crate::api::openai::to_messages(
            &body,
            |m| state.engines.get(m).map(|e| e.info().max_output_tokens),
            principal.policy.allow_1h_ttl,
        )?;
        let translated =
            Bytes::from(serde_json::to_vec(&messages).expect("a JSON value serializes"));
        let standing = demand(&state, &headers, &translated).await?;
        let hint = opts
            .prompt_cache_key
            .map(|k| (principal.tenant, principal.workspace, k));
        let (routed, computing) = rank(&state, standing, hint)?;
        Ok::<_, ApiError>((body, routed, computing))
    }
    .await;
    match routed {
        Ok((body, routed, _computing)) => {
            let req = Forward::post(rid, "/v1/chat/completions", &headers, body, Wire::OpenAi);
            forward(&state, req, &routed).await
        }
        Err(e) => crate::api::openai::error_response(e, rid),
    }
}

/// The nodes to try for a request, best first, each with the reason (its estimate's parts),
/// and (when it is the first to compute its next block) its claim on that block. `hint`: a client's `prompt_cache_key` in its scope, which
/// picks the node for a prefix cached nowhere yet (a routing hint only: it never enters a key).
#[allow(clippy::type_complexity)]
fn rank<'a>(
    state: &'a RouterState,
    standing: Standing,
    hint: Option<(cachet_common::TenantId, cachet_common::WorkspaceId, String)>,
) -> Result<(Routed, Option<Computing<'a>>), ApiError> {
    let Standing {
        demand,
        candidates,
        next,
    } = standing;
    let candidates: Vec<Candidate> = candidates
        .into_iter()
        .map(|c| {
            let l = state.load(&c.id);
            Candidate {
                in_flight: l.in_flight.load(Ordering::Relaxed),
                prefill_queue_tokens: l.prefilling.load(Ordering::Relaxed),
                service_time: Duration::from_micros(l.service_us.load(Ordering::Relaxed) as u64),
                ..c
            }
        })
        .collect();
    let turn = state.turn.fetch_add(1, Ordering::Relaxed);
    let order = match state.config.cost.rank(&demand, &candidates, turn) {
        Ok(o) => o,
        Err(Refusal::NoNodes) => {
            metrics::ROUTED.with_label_values(&["no_nodes"]).inc();
            return Err(ApiError::overloaded(
                "no node is available to serve this request",
            ));
        }
        Err(Refusal::OverSlo { best, queue }) => {
            metrics::ROUTED.with_label_values(&["over_slo"]).inc();
            return Err(ApiError::overloaded(format!(
                "Overloaded: every node is busy; the earliest estimated first token is {} ms away \
                 ({} ms of it waiting behind requests in flight), over the {} ms target",
                best.as_millis(),
                queue.as_millis(),
                state.config.cost.ttft_slo.as_millis()
            )));
        }
        Err(Refusal::OverTbt { tbt, batch }) => {
            metrics::ROUTED.with_label_values(&["over_tbt"]).inc();
            return Err(ApiError::overloaded(format!(
                "Overloaded: every node's decoding instances are busy; the shortest expected \
                 time between tokens is {} ms (in a batch of {batch}), over the {} ms target",
                tbt.as_millis(),
                state.config.cost.tbt_slo.as_millis()
            )));
        }
    };
    let mut ids: Vec<String> = order
        .iter()
        .map(|(i, _)| candidates[*i].id.clone())
        .collect();
    let estimates: HashMap<String, Estimate> = candidates
        .iter()
        .map(|c| (c.id.clone(), CostModel::parts(&demand, c)))
        .collect();
    let reasons = estimates
        .iter()
        .map(|(id, e)| (id.clone(), e.reason()))
        .collect();
    let prefill = estimates
        .into_iter()
        .map(|(id, e)| (id, e.compute_tokens))
        .collect();
    // In-flight coalescing across the cluster: the node already computing our next block
    // goes first (when it is among those that can meet the SLO); else we are the one
    // computing it, on the first node, until our answer starts.
    let mut claim = None;
    if let Some(block) = next {
        let mut computing = state.computing.lock().unwrap_or_else(|p| p.into_inner());
        match computing.get(&block) {
            Some(node) => {
                if let Some(pos) = ids.iter().position(|i| i == node) {
                    let n = ids.remove(pos);
                    ids.insert(0, n);
                    metrics::ROUTED.with_label_values(&["coalesced"]).inc();
                }
            }
            None => {
                if let Some((tenant, workspace, key)) = hint.filter(|_| demand.cached_tokens == 0) {
                    // Nothing cached anywhere: the key's node, the same one every time.
                    let score = |id: &String| {
                        use sha2::Digest;
                        let mut h = sha2::Sha256::new();
                        h.update(tenant.0.as_bytes());
                        h.update(workspace.0.as_bytes());
                        h.update((key.len() as u64).to_le_bytes());
                        h.update(key.as_bytes());
                        h.update(id.as_bytes());
                        h.finalize()
                    };
                    if let Some(best) = ids.iter().max_by_key(|id| score(id)).cloned() {
                        ids.retain(|i| *i != best);
                        ids.insert(0, best);
                    }
                }
                if let Some(first) = ids.first() {
                    computing.insert(block, first.clone());
                    claim = Some(Computing {
                        state: state.as_ref(),
                        block,
                    });
                }
            }
        }
    }
    Ok((
        Routed {
            ids,
            reasons,
            prefill,
        },
        claim,
    ))
}

/// Where a request may go, best first, and why each node (its estimate's parts, answered in
/// `x-cachet-route`).
#[derive(Default)]
struct Routed {
    ids: Vec<String>,
    reasons: HashMap<String, String>,
    /// Tokens each node would prefill (its prefill queue grows by them until it answers).
    prefill: HashMap<String, usize>,
}

/// The response header saying why the gateway chose the node that answered.
pub const ROUTE_HEADER: &str = "x-cachet-route";

/// Requests that need no routing decision (token counting, model listing) go to the least
/// busy node.
async fn passthrough(State(state): State<RouterState>, req: Request) -> Response {
    let rid = req
        .extensions()
        .get::<RequestId>()
        .copied()
        .unwrap_or_default();
    let path = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_default();
    let (parts, body) = req.into_parts();
    let body = match axum::body::to_bytes(body, state.config.max_body_bytes).await {
        Ok(b) => b,
        Err(_) => {
            return ApiError::new(ErrorCode::RequestTooLarge, "request body is too large")
                .with_request_id(rid)
                .into_response();
        }
    };
    let mut ids = state.node_ids();
    ids.sort_by_key(|id| state.load(id).in_flight.load(Ordering::Relaxed));
    let routed = Routed {
        ids,
        ..Routed::default()
    };
    let req = Forward {
        rid,
        method: parts.method.clone(),
        path: &path,
        headers: &parts.headers,
        body,
        wire: Wire::Anthropic,
    };
    forward(&state, req, &routed).await
}

/// The API a forwarded request speaks: its stream can be resumed on another node
/// (Anthropic's events are spliced), and a failure is answered in its error shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wire {
    Anthropic,
    /// Chat Completions: streams are not resumed (a node lost mid-stream ends it with an
    /// error); errors in OpenAI's shape.
    OpenAi,
}

/// A request on its way to a node.
struct Forward<'a> {
    rid: RequestId,
    method: axum::http::Method,
    path: &'a str,
    headers: &'a HeaderMap,
    body: Bytes,
    wire: Wire,
}

impl<'a> Forward<'a> {
    fn post(
        rid: RequestId,
        path: &'a str,
        headers: &'a HeaderMap,
        body: Bytes,
        wire: Wire,
    ) -> Self {
        Forward {
            rid,
            method: axum::http::Method::POST,
            path,
            headers,
            body,
            wire,
        }
    }
}

/// Headers a node's answer keeps on its way back.
fn keep_response_header(name: &str) -> bool {
    name == "content-type"
        || name == "request-id"
        || name == "retry-after"
        || name.starts_with("anthropic-ratelimit-")
}

/// Send `req` to the first of the routed nodes that answers (then to nodes that joined
/// since), relaying a stream event by event; a node that fails or is overloaded is skipped.
async fn forward(state: &RouterState, req: Forward<'_>, routed: &Routed) -> Response {
    let Forward {
        rid,
        method,
        path,
        headers,
        body,
        wire,
    } = req;
    let mut ids = routed.ids.clone();
    let mut joined_checked = false;
    for attempt in 0.. {
        if attempt == ids.len() {
            // Every node ranked for this request failed: nodes that joined since (a
            // replacement for the one that died) get their turn before we give up.
            if joined_checked {
                break;
            }
            joined_checked = true;
            let newcomers = state.newcomers(&ids);
            if newcomers.is_empty() {
                break;
            }
            ids.extend(newcomers);
        }
        let id = &ids[attempt];
        let Some(base) = state.base_of(id) else {
            continue;
        };
        let load = state.load(id);
        load.in_flight.fetch_add(1, Ordering::Relaxed);
        let prefill = routed.prefill.get(id).copied().unwrap_or(0);
        load.prefilling.fetch_add(prefill, Ordering::Relaxed);
        let started = Instant::now();
        let req = state.node_request(&base, method.clone(), path, headers, rid, body.clone());
        let left = state.departure(id);
        let result = unless_left(&left, req.send()).await;
        // Answered (its first token is out) or failed: its prefill is no longer ahead.
        load.prefilling.fetch_sub(prefill, Ordering::Relaxed);
        let outcome = match result {
            Ok(resp) if resp.status().as_u16() == 529 && attempt + 1 < ids.len() => {
                // That node's engines are saturated; it did no work and billed nothing, so
                // the next node may serve the request under the same id.
                finish(&load, started);
                metrics::ROUTED.with_label_values(&["retried"]).inc();
                tracing::info!(node = %id, request_id = %rid, "node overloaded; trying the next one");
                continue;
            }
            Ok(resp) => {
                let status = resp.status();
                let streamed = resp
                    .headers()
                    .get("content-type")
                    .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
                let mut out = Response::builder()
                    .status(status.as_u16())
                    .header(NODE_HEADER, id.as_str());
                if let Some(why) = routed.reasons.get(id) {
                    out = out.header(ROUTE_HEADER, why.as_str());
                }
                for (name, value) in resp.headers() {
                    if keep_response_header(name.as_str()) {
                        out = out.header(name.as_str(), value.as_bytes());
                    }
                }
                if streamed && status.is_success() {
                    // Relayed event by event; resumed on the next node if this one fails.
                    let rest = match wire {
                        Wire::Anthropic => ids[attempt + 1..].iter().cloned().collect(),
                        Wire::OpenAi => Default::default(),
                    };
                    let relay = Relay::new(state, rid, path, headers, &body, rest);
                    let inflight = InFlight {
                        load: load.clone(),
                        started,
                        left,
                    };
                    let body = relay.stream(resp, inflight);
                    metrics::ROUTED.with_label_values(&["forwarded"]).inc();
                    return out.body(body).unwrap_or_else(|e| {
                        ApiError::internal("building the response", e).into_response()
                    });
                }
                match unless_left(&left, resp.bytes()).await {
                    Ok(bytes) => {
                        finish(&load, started);
                        metrics::ROUTED.with_label_values(&["forwarded"]).inc();
                        return out.body(Body::from(bytes)).unwrap_or_else(|e| {
                            ApiError::internal("building the response", e).into_response()
                        });
                    }
                    Err(e) => e,
                }
            }
            Err(e) => e,
        };
        load.in_flight.fetch_sub(1, Ordering::Relaxed);
        metrics::ROUTED.with_label_values(&["retried"]).inc();
        tracing::warn!(node = %id, request_id = %rid, error = %outcome, "node failed; trying the next one");
    }
    metrics::ROUTED.with_label_values(&["failed"]).inc();
    let e = ApiError::overloaded("no node could serve this request; retry shortly");
    match wire {
        Wire::Anthropic => e.with_request_id(rid).into_response(),
        Wire::OpenAi => crate::api::openai::error_response(e, rid),
    }
}

/// `work`'s outcome, or an error as soon as the node it waits on leaves the membership.
async fn unless_left<T>(
    left: &CancellationToken,
    work: impl std::future::Future<Output = Result<T, reqwest::Error>>,
) -> Result<T, String> {
    tokio::select! {
        r = work => r.map_err(|e| e.to_string()),
        _ = left.cancelled() => Err("the node left the membership".to_string()),
    }
}

/// The gateway's own clock, for [`watch_pauses`]: microseconds since the first use.
static CLOCK: LazyLock<Instant> = LazyLock::new(Instant::now);
/// When [`watch_pauses`] last ticked, and when it last found this process had been paused.
static LAST_TICK_US: AtomicU64 = AtomicU64::new(0);
static LAST_PAUSE_US: AtomicU64 = AtomicU64::new(0);
const PAUSE_TICK: Duration = Duration::from_millis(100);
/// A tick this much later than due means the process did not run (SIGSTOP, a frozen VM, a
/// starved runtime).
const PAUSE_SLACK: Duration = Duration::from_millis(500);

fn clock_us() -> u64 {
    CLOCK.elapsed().as_micros() as u64
}

/// Notice when this gateway was not running: a request that spanned such a pause says
/// nothing about its node, and counting it made every node look 20 s slow after a 20 s
/// SIGSTOP, so the conductor refused traffic (529) the nodes could serve.
async fn watch_pauses(stop: CancellationToken) {
    LAST_TICK_US.store(clock_us(), Ordering::Relaxed);
    while !stop.is_cancelled() {
        let t = Instant::now();
        tokio::time::sleep(PAUSE_TICK).await;
        let now = clock_us();
        if t.elapsed() > PAUSE_TICK + PAUSE_SLACK {
            LAST_PAUSE_US.store(now, Ordering::Relaxed);
            tracing::warn!(
                paused_ms = t.elapsed().as_millis() as u64,
                "this gateway did not run for a while; requests that spanned it are left out of node service times"
            );
        }
        LAST_TICK_US.store(now, Ordering::Relaxed);
    }
}

/// Whether a request started at `started` may have spanned a pause of this process: one
/// detected since it started, or one in progress (the watcher has not ticked for too long,
/// as when the process has just been continued and the watcher has not run yet).
fn spanned_a_pause(started: Instant) -> bool {
    let now = clock_us();
    let started_us = now.saturating_sub(started.elapsed().as_micros() as u64);
    let (last_tick, last_pause) = (
        LAST_TICK_US.load(Ordering::Relaxed),
        LAST_PAUSE_US.load(Ordering::Relaxed),
    );
    (last_pause > 0 && last_pause >= started_us)
        || (last_tick > 0
            && now.saturating_sub(last_tick) > (PAUSE_TICK + PAUSE_SLACK).as_micros() as u64)
}

fn finish(load: &Load, started: Instant) {
    load.in_flight.fetch_sub(1, Ordering::Relaxed);
    if spanned_a_pause(started) {
        return;
    }
    let took = started.elapsed().as_micros() as usize;
    let old = load.service_us.load(Ordering::Relaxed);
    // An exponential moving average with weight 1/8 for the newest sample.
    let new = if old == 0 {
        took
    } else {
        old - old / 8 + took / 8
    };
    load.service_us.store(new, Ordering::Relaxed);
}

type Upstream =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<bytes::Bytes, reqwest::Error>> + Send>>;

/// A streamed answer on its way to the client (see [`relay`]).
struct Relay {
    state: RouterState,
    rid: RequestId,
    path: String,
    headers: HeaderMap,
    body: Bytes,
    /// Nodes to resume on, in the conductor's order.
    rest: std::collections::VecDeque<String>,
    upstream: Option<(Upstream, InFlight)>,
    buf: Vec<u8>,
    splice: relay::Splice,
    done: bool,
    /// Bytes to send before reading on (the note naming the node a stream resumed on).
    note: Option<Bytes>,
}

impl Relay {
    fn new(
        state: &RouterState,
        rid: RequestId,
        path: &str,
        headers: &HeaderMap,
        body: &Bytes,
        rest: std::collections::VecDeque<String>,
    ) -> Self {
        Relay {
            state: state.clone(),
            rid,
            path: path.to_string(),
            headers: headers.clone(),
            body: body.clone(),
            rest,
            upstream: None,
            buf: Vec::new(),
            splice: relay::Splice::default(),
            done: false,
            note: None,
        }
    }

    /// The client's body: `resp`'s events relayed one by one (and resumed elsewhere if its
    /// node fails).
    fn stream(mut self, resp: reqwest::Response, inflight: InFlight) -> Body {
        self.upstream = Some((Box::pin(resp.bytes_stream()), inflight));
        let stream = futures::stream::unfold(self, |mut r| async move {
            r.next_event()
                .await
                .map(|b| (Ok::<_, std::io::Error>(b), r))
        });
        Body::from_stream(stream)
    }

    /// The next bytes for the client, or `None` at the end.
    async fn next_event(&mut self) -> Option<Bytes> {
        use futures::StreamExt;
        loop {
            if self.done {
                return None;
            }
            if let Some(note) = self.note.take() {
                return Some(note);
            }
            if let Some(end) = relay::event_end(&self.buf) {
                let raw = Bytes::from(self.buf.drain(..end).collect::<Vec<u8>>());
                match self.splice.event(raw) {
                    relay::Step::Emit(b) => return Some(b),
                    relay::Step::Skip => continue,
                    relay::Step::End(b) => {
                        self.done = true;
                        self.upstream = None;
                        return Some(b);
                    }
                    relay::Step::Diverged(why) => {
                        self.done = true;
                        self.upstream = None;
                        metrics::ROUTED.with_label_values(&["resume_failed"]).inc();
                        tracing::error!(request_id = %self.rid, reason = %why, "a resumed stream differs from what was sent; ending it");
                        return Some(relay::error_event(
                            "api_error",
                            "the node serving this stream failed and its answer could not be resumed",
                        ));
                    }
                }
            }
            let next = match self.upstream.as_mut() {
                Some((s, inflight)) => {
                    match unless_left(&inflight.left, async { s.next().await.transpose() }).await {
                        Ok(chunk) => chunk.map(Ok),
                        Err(e) => Some(Err(e)),
                    }
                }
                None => None,
            };
            match next {
                Some(Ok(chunk)) => self.buf.extend_from_slice(&chunk),
                other => {
                    let why = match other {
                        Some(Err(e)) => e,
                        _ => "the stream ended before message_stop".into(),
                    };
                    if self.splice.complete() {
                        self.done = true;
                        continue;
                    }
                    tracing::warn!(request_id = %self.rid, error = %why, "a node failed mid-stream; resuming on the next");
                    if !self.failover().await {
                        self.done = true;
                        metrics::ROUTED.with_label_values(&["resume_failed"]).inc();
                        return Some(relay::error_event(
                            "overloaded_error",
                            "the node serving this stream failed and no other could resume it; retry shortly",
                        ));
                    }
                }
            }
        }
    }

    /// Send the request to the next node that answers with a stream; whether one did.
    async fn failover(&mut self) -> bool {
        self.upstream = None;
        self.buf.clear();
        self.splice.restart();
        while let Some(id) = self.rest.pop_front() {
            let Some(base) = self.state.base_of(&id) else {
                continue;
            };
            let load = self.state.load(&id);
            load.in_flight.fetch_add(1, Ordering::Relaxed);
            let started = Instant::now();
            let req = self.state.node_request(
                &base,
                axum::http::Method::POST,
                &self.path,
                &self.headers,
                self.rid,
                self.body.clone(),
            );
            let left = self.state.departure(&id);
            match unless_left(&left, req.send()).await {
                Ok(resp)
                    if resp.status().is_success()
                        && resp
                            .headers()
                            .get("content-type")
                            .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream")) =>
                {
                    metrics::ROUTED.with_label_values(&["resumed"]).inc();
                    tracing::info!(node = %id, request_id = %self.rid, "stream resumed");
                    // An SSE comment (every client's parser skips it): the node serving the
                    // rest, for the load tester's records.
                    self.note = Some(relay::resumed_note(&id));
                    self.upstream = Some((
                        Box::pin(resp.bytes_stream()),
                        InFlight {
                            load,
                            started,
                            left,
                        },
                    ));
                    return true;
                }
                Ok(resp) => {
                    finish(&load, started);
                    tracing::warn!(node = %id, request_id = %self.rid, status = resp.status().as_u16(), "node could not resume the stream");
                }
                Err(e) => {
                    load.in_flight.fetch_sub(1, Ordering::Relaxed);
                    tracing::warn!(node = %id, request_id = %self.rid, error = %e, "node could not resume the stream");
                }
            }
        }
        false
    }
}

/// Counts a streamed request as in flight until its body is dropped.
struct InFlight {
    load: Arc<Load>,
    started: Instant,
    /// Cancelled when the node leaves the membership.
    left: CancellationToken,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        finish(&self.load, self.started);
    }
}

async fn healthz() -> Response {
    axum::Json(json!({"status": "ok"})).into_response()
}

async fn readyz(State(state): State<RouterState>) -> Response {
    let nodes = state.node_ids();
    let status = if nodes.is_empty() {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    };
    let indexed = state.index.read().unwrap_or_else(|p| p.into_inner()).len();
    (
        status,
        axum::Json(json!({
            "status": if nodes.is_empty() { "no_nodes" } else { "ready" },
            "nodes": nodes,
            "indexed_blocks": indexed,
        })),
    )
        .into_response()
}

/// Every request on the router gets its id here and runs in its span
/// (`cachet_common::span`); the id is the one forwarded to the node, so both processes'
/// lines carry it.
async fn edge(req: Request, next: axum::middleware::Next) -> Response {
    let route = crate::route_of(&req);
    crate::in_request_span(RequestId::new(), None, &route, req, next).await
}

/// The routing gateway's routes, with the admin and finance APIs and the admin UI when
/// `admin` is given.
pub fn router(state: RouterState, admin: Option<control::admin::AdminState>) -> Router {
    let limit = state.config.max_body_bytes;
    let mut app = Router::new()
        .route("/v1/messages", axum::routing::post(messages))
        .route("/v1/chat/completions", axum::routing::post(chat))
        .route("/v1/messages/count_tokens", any(passthrough))
        .route("/v1/models", any(passthrough))
        .route("/v1/models/{model_id}", any(passthrough))
        .route("/v1/caches", any(passthrough))
        .route("/v1/caches/{cache_id}", any(passthrough))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(crate::metrics_text))
        .route("/openapi.json", get(crate::openapi_json))
        .with_state(state);
    if let Some(a) = admin {
        app = app.merge(control::admin::routes(a));
    }
    app.method_not_allowed_fallback(crate::method_not_allowed)
        .fallback(crate::not_found)
        .layer(DefaultBodyLimit::max(limit))
        .layer(axum::middleware::from_fn(crate::error::observed))
        .layer(axum::middleware::from_fn(edge))
}

/// Serve until `shutdown`, then finish in-flight requests.
pub async fn run(
    listener: tokio::net::TcpListener,
    state: RouterState,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    axum::serve(listener, router(state, None))
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
}
