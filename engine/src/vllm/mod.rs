//! A vLLM server as an engine: SmolLM2 served by vLLM (its CPU build here), with Cachet's KV
//! connector (`connectors/vllm/`) loading and saving its KV in the fabric node beside it.
//!
//! The gateway renders the prompt to token ids with the same tokenizer and chat template as
//! the reference engine ([`crate::reference::ChatRenderer`]; block keys are over token ids),
//! and sends them to vLLM's `/v1/completions` with the block keys, write boundaries, TTLs and
//! a request tag in `kv_transfer_params`, and the tenant's `cache_salt` (a client's own never
//! reaches vLLM: the gateway builds the body). No KV passes through the gateway
//! ([`crate::KvPath::Connector`]). Tokens come back as a stream (`return_token_ids`);
//! [`crate::Engine::start`] returns once the first one has arrived, so the prefill and the
//! connector's loads and saves are done by then.
//!
//! Prefill and decode apart: a model's instances can be given roles ([`Role`]). With a
//! prefill-only instance and one that decodes, a request whose prompt has a full block is
//! prefilled on the prefill instance first (`max_tokens` 1, the request's own tag and writes,
//! plus one short best-effort entry of every full block, [`SPLIT_TTL`]: the hand-over), then
//! sent to a decoding instance, whose connector loads those blocks and computes only the
//! tail; its writes are none (the prefill stage saved them) and its tag is another, so the
//! report the gateway bills by is the prefill stage's, as if colocated. A prefill instance
//! that cannot be reached or fails mid-prefill hands the request, whole, to a decoding
//! instance (decision 0033).
//!
//! Each model's stages are measured ([`load`]): the prefill stage's time and the time
//! between tokens against the decode batch, announced with the in-flight counts per stage
//! ([`crate::Engine::stages`]) so a routing gateway's early rejection covers both stages.

pub mod load;

use std::collections::VecDeque;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use futures::{Stream, StreamExt};
use serde_json::{Value, json};

use cachet_common::stages::StageLoad;

use self::load::StageMeter;
use crate::reference::{ChatRenderer, KV_SHAPE};
use crate::{
    ConnectorParams, EngineError, GenerateRequest, Generation, KvBlock, KvDtype, KvGeometry,
    KvPath, ModelInfo, Prompt, Rendered, Token,
};

/// Where a vLLM upstream is and what it serves.
#[derive(Clone, Debug)]
pub struct VllmConfig {
    /// The model id clients name (`GET /v1/models`).
    pub id: String,
    /// The base URLs of the vLLM servers that serve this model beside one fabric node
    /// (`http://127.0.0.1:8100`; one per GPU, say): each generation goes to the one with
    /// the fewest in flight (turn by turn among equals), and to the next when one cannot be
    /// reached. Their connectors share the node's cache: a prefix one saved, another loads.
    pub urls: Vec<String>,
    /// The model name vLLM serves (`--served-model-name`).
    pub served_model: String,
    /// vLLM's KV block size (`--block-size`; its CPU backend wants multiples of 32).
    pub block_size: usize,
    /// vLLM's context (`--max-model-len`).
    pub context_window: usize,
    /// The SmolLM2 GGUF whose tokenizer and chat template render prompts (the model vLLM
    /// serves was converted from it: scripts/vllm-model.sh).
    pub model_path: PathBuf,
    /// Longest wait for vLLM's next bytes (a long prefill included).
    pub read_timeout: Duration,
    /// Each URL's role, in the order of `urls` (missing ones: [`Role::Both`]).
    pub roles: Vec<Role>,
    /// Prompts shorter than this are prefilled where they are decoded, whatever the roles:
    /// a short prompt's prefill is cheaper than a hand-over and must not queue behind the
    /// long ones on the prefill instances.
    pub split_min_tokens: usize,
}

/// What a vLLM instance of a model does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Role {
    /// Prefills prompts and hands their KV over through the fabric; never decodes.
    Prefill,
    /// Decodes (and prefills what the prefill instances did not).
    Decode,
    /// Both, colocated: what every instance is unless told otherwise.
    #[default]
    Both,
}

impl Role {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "prefill" => Some(Role::Prefill),
            "decode" => Some(Role::Decode),
            "both" => Some(Role::Both),
            _ => None,
        }
    }

    fn decodes(self) -> bool {
        self != Role::Prefill
    }
}

/// How long the prefill stage's hand-over entry is held: long enough for the decode stage to
/// load it (it starts as soon as the prefill ends), short enough not to crowd the tenant's
/// cache; best effort, so capacity evicts it before anything paid.
pub const SPLIT_TTL: Duration = Duration::from_secs(30);

/// The decode stage's tag: another than the request's, so the gateway bills the prefill
/// stage's report (what was cached before this request) and not the hand-over's load.
fn decode_tag(tag: u128) -> u128 {
    tag ^ (1 << 127)
}

/// The key space a vLLM CPU server with its defaults stores (f32 weights, `auto` cache
/// dtype, the CPU backend's LBHNC layout) at `block_size`: the connector computes the same
/// string from its own configuration and refuses keys made for another.
pub fn default_key_space(block_size: usize) -> String {
    format!("vllm/float32/auto/LBHNC/{block_size}")
}

pub struct VllmEngine {
    info: ModelInfo,
    chat: ChatRenderer,
    client: reqwest::Client,
    instances: Vec<Instance>,
    /// Where the next choice among equally busy instances starts (turn by turn).
    turn: AtomicUsize,
    served_model: String,
    split_min_tokens: usize,
    /// The stages' measured times, shared with the generations.
    meter: Arc<StageMeter>,
    eos_id: u32,
    rt: tokio::runtime::Handle,
}

/// One vLLM server of a model, and the generations it is serving.
struct Instance {
    completions: String,
    in_flight: Arc<AtomicUsize>,
    role: Role,
}

/// A generation's count on its instance (and in its stage's gauge), given back when the
/// generation ends.
struct InFlight(Arc<AtomicUsize>, Option<prometheus::IntGauge>);

impl InFlight {
    fn hold(count: &Arc<AtomicUsize>, gauge: prometheus::IntGauge) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        gauge.inc();
        Self(count.clone(), Some(gauge))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
        if let Some(g) = &self.1 {
            g.dec();
        }
    }
}

impl VllmEngine {
    /// `rt` drives the HTTP calls the engine's blocking methods make.
    pub fn new(config: VllmConfig, rt: tokio::runtime::Handle) -> Result<Self, EngineError> {
        if config.urls.is_empty() {
            return Err(EngineError::Internal(
                "a vLLM model needs a server URL".into(),
            ));
        }
        if config.block_size == 0 || !config.block_size.is_multiple_of(32) {
            return Err(EngineError::Internal(format!(
                "vLLM block size {} is not a positive multiple of 32",
                config.block_size
            )));
        }
        if !config
            .urls
            .iter()
            .enumerate()
            .any(|(i, _)| config.roles.get(i).copied().unwrap_or_default().decodes())
        {
            return Err(EngineError::Internal(
                "a vLLM model needs an instance that decodes (role decode or both)".into(),
            ));
        }
        let chat = ChatRenderer::load(&config.model_path)?;
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(2))
            .read_timeout(config.read_timeout)
            .build()
            .map_err(|e| EngineError::Internal(format!("http client: {e}")))?;
        let info = ModelInfo {
            id: config.id.clone(),
            display_name: format!("SmolLM2 135M Instruct on vLLM ({})", config.served_model),
            created_at: "2024-11-01T00:00:00Z".into(),
            block_size: config.block_size,
            min_cacheable_tokens: config.block_size,
            max_output_tokens: 2048,
            context_window: config.context_window,
            max_token_bytes: chat.tokenizer().max_token_bytes,
            kv: KvGeometry {
                dtype: KvDtype::F32,
                ..KV_SHAPE
            },
            adapter_id: String::new(),
            kv_path: KvPath::Connector {
                key_space: default_key_space(config.block_size),
            },
        };
        Ok(Self {
            eos_id: chat.tokenizer().eos_id,
            info,
            chat,
            client,
            instances: config
                .urls
                .iter()
                .enumerate()
                .map(|(i, u)| Instance {
                    completions: format!("{}/v1/completions", u.trim_end_matches('/')),
                    in_flight: Arc::default(),
                    role: config.roles.get(i).copied().unwrap_or_default(),
                })
                .collect(),
            turn: AtomicUsize::new(0),
            split_min_tokens: config.split_min_tokens,
            meter: Arc::new(StageMeter::for_model(&config.id)),
            served_model: config.served_model,
            rt,
        })
    }

    fn body(&self, req: &GenerateRequest) -> Value {
        completion_body(&self.served_model, req)
    }
}

/// The `/v1/completions` body of a request.
fn completion_body(served_model: &str, req: &GenerateRequest) -> Value {
    let s = &req.sampling;
    let mut body = json!({
        "model": served_model,
        "prompt": req.tokens,
        "max_tokens": req.max_new_tokens.max(1),
        "temperature": s.temperature.unwrap_or(0.0),
        "stream": true,
        "return_token_ids": true,
        "ignore_eos": s.ignore_eos,
    });
    if let Some(p) = s.top_p {
        body["top_p"] = json!(p);
    }
    if let Some(k) = s.top_k {
        body["top_k"] = json!(k);
    }
    // Greedy decoding needs no seed; vLLM takes a signed 64-bit one.
    if let (Some(seed), Some(t)) = (s.seed, s.temperature)
        && t > 0.0
    {
        body["seed"] = json!(seed & i64::MAX as u64);
    }
    if let Some(c) = &req.connector {
        body["cache_salt"] = json!(c.cache_salt);
        body["kv_transfer_params"] = transfer_params(c);
    }
    body
}

/// Whether a request is prefilled apart: a prefill-only instance exists among `roles`, the
/// prompt has at least `min_tokens` tokens, a connector and a full block to hand over.
fn splits(mut roles: impl Iterator<Item = Role>, min_tokens: usize, req: &GenerateRequest) -> bool {
    req.tokens.len() >= min_tokens
        && req.connector.as_ref().is_some_and(|c| !c.keys.is_empty())
        && roles.any(|r| r == Role::Prefill)
}

/// A split request's two bodies: the prefill (one token, the request's tag and writes plus
/// the hand-over of every full block) and the decode (the request as sent, loading them).
fn split_bodies(served_model: &str, req: &GenerateRequest) -> (Value, Value) {
    let c = req
        .connector
        .as_ref()
        .expect("a split request has a connector");
    let mut prefill = completion_body(served_model, req);
    prefill["max_tokens"] = json!(1);
    prefill["temperature"] = json!(0.0);
    let mut writes = c.writes.clone();
    writes.push(crate::ConnectorWrite {
        end_block: c.keys.len(),
        ttl: SPLIT_TTL,
        paid: false,
    });
    prefill["kv_transfer_params"] = transfer_params(&ConnectorParams {
        writes,
        ..c.clone()
    });
    let mut decode = completion_body(served_model, req);
    decode["kv_transfer_params"] = transfer_params(&ConnectorParams {
        writes: Vec::new(),
        tag: decode_tag(c.tag),
        ..c.clone()
    });
    (prefill, decode)
}

impl VllmEngine {
    /// The prefill stage, on a prefill instance, to its end.
    async fn prefill_stage(&self, body: &Value) -> Result<(), EngineError> {
        let began = Instant::now();
        let (resp, in_flight) = self.send(body, Stage::Prefill).await?;
        let mut g = VllmGeneration::open(resp, in_flight, None, None, self.rt.clone()).await?;
        while !g.done {
            g.pending.clear();
            g.fill().await?;
        }
        self.meter.prefilled(began.elapsed());
        Ok(())
    }
}

/// Which instances a request is sent to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// The prefill-only instances.
    Prefill,
    /// Those that decode (a whole request, or a split one's decode stage).
    Decode,
}

impl Stage {
    fn takes(self, role: Role) -> bool {
        match self {
            Stage::Prefill => role == Role::Prefill,
            Stage::Decode => role.decodes(),
        }
    }
}

/// The `kv_transfer_params` the connector reads (connectors/vllm/cachet_vllm/connector.py).
pub fn transfer_params(c: &ConnectorParams) -> Value {
    json!({
        "cachet": {
            "scope": hex_of(&c.scope),
            "keys": c.keys.iter().map(|k| hex_of(&k.0)).collect::<Vec<_>>(),
            "writes": c.writes.iter().map(|w| json!({
                "end_block": w.end_block,
                "ttl_ms": w.ttl.as_millis() as u64,
                "kind": if w.paid { "paid" } else { "best_effort" },
            })).collect::<Vec<_>>(),
            "tag": format!("{:032x}", c.tag),
            "kv_space": c.key_space,
        }
    })
}

fn hex_of(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unavailable(e: reqwest::Error) -> EngineError {
    EngineError::Unavailable(format!("vLLM: {e}"))
}

/// Instances in the order to try them, given how many generations each has in flight: the
/// least busy first, equals from `turn` on (so they take turns).
fn try_order(in_flight: &[usize], turn: usize) -> Vec<usize> {
    let n = in_flight.len();
    let mut order: Vec<usize> = (0..n).map(|i| (turn + i) % n).collect();
    order.sort_by_key(|&i| in_flight[i]);
    order
}

impl VllmEngine {
    /// The instances of `stage` in the order to try them: fewest generations in flight
    /// first, equals taken turn by turn.
    fn order(&self, stage: Stage) -> Vec<usize> {
        let busy: Vec<usize> = self
            .instances
            .iter()
            .map(|i| i.in_flight.load(Ordering::Relaxed))
            .collect();
        try_order(&busy, self.turn.fetch_add(1, Ordering::Relaxed))
            .into_iter()
            .filter(|&i| stage.takes(self.instances[i].role))
            .collect()
    }

    /// Send a completion to the least busy instance of `stage` that can be reached (the next
    /// one when a connection fails: nothing was computed there) and check its status.
    async fn send(
        &self,
        body: &Value,
        stage: Stage,
    ) -> Result<(reqwest::Response, InFlight), EngineError> {
        let (resp, held) = self.connect(body, stage).await?;
        let status = resp.status();
        if !status.is_success() {
            let text = resp.text().await.unwrap_or_default();
            let msg = format!("vLLM answered {status}: {}", text.trim());
            return Err(if status.is_server_error() {
                EngineError::Unavailable(msg)
            } else {
                EngineError::Internal(msg)
            });
        }
        Ok((resp, held))
    }

    async fn connect(
        &self,
        body: &Value,
        stage: Stage,
    ) -> Result<(reqwest::Response, InFlight), EngineError> {
        let mut last = None;
        for i in self.order(stage) {
            let inst = &self.instances[i];
            let gauge = crate::metrics::STAGE_IN_FLIGHT.with_label_values(&[
                self.info.id.as_str(),
                if inst.role == Role::Prefill {
                    "prefill"
                } else {
                    "decode"
                },
            ]);
            let held = InFlight::hold(&inst.in_flight, gauge);
            match self.client.post(&inst.completions).json(body).send().await {
                Ok(resp) => return Ok((resp, held)),
                Err(e) if e.is_connect() => last = Some(e),
                Err(e) => return Err(unavailable(e)),
            }
        }
        Err(match last {
            Some(e) => unavailable(e),
            None => EngineError::Unavailable("vLLM: no instance for this stage".into()),
        })
    }
}

impl crate::Engine for VllmEngine {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// vLLM's CPU build on two cores prefills SmolLM2 at about 400 tokens a second
    /// (docs/benchmarks.md); measurements replace it.
    fn nominal_prefill_per_token(&self) -> Duration {
        Duration::from_micros(2_500)
    }

    fn instances(&self) -> usize {
        self.instances.len()
    }

    fn stages(&self) -> Option<StageLoad> {
        let mut load = StageLoad {
            split_min_tokens: self.split_min_tokens as u64,
            step: self.meter.step(),
            ..StageLoad::default()
        };
        for i in &self.instances {
            let n = i.in_flight.load(Ordering::Relaxed) as u32;
            if i.role == Role::Prefill {
                load.prefill_instances += 1;
                load.prefill_in_flight += n;
            } else {
                load.decode_instances += 1;
                load.decode_in_flight += n;
            }
        }
        Some(load)
    }

    fn render(&self, prompt: &Prompt) -> Result<Rendered, EngineError> {
        self.chat.render(prompt, &self.info)
    }

    fn start(&self, req: GenerateRequest) -> Result<Box<dyn Generation>, EngineError> {
        if !req.imported.is_empty() || !req.exports.is_empty() {
            return Err(EngineError::InvalidImport(
                "a vLLM engine loads and saves its KV through its connector".into(),
            ));
        }
        if req.tokens.is_empty() {
            return Err(EngineError::InvalidImport("empty prompt".into()));
        }
        let eos = (!req.sampling.ignore_eos).then_some(self.eos_id);
        self.rt.block_on(async {
            let body = if splits(
                self.instances.iter().map(|i| i.role),
                self.split_min_tokens,
                &req,
            ) {
                let (prefill, decode) = split_bodies(&self.served_model, &req);
                match self.prefill_stage(&prefill).await {
                    Ok(()) => {
                        crate::metrics::SPLIT
                            .with_label_values(&[&self.info.id, "split"])
                            .inc();
                        crate::metrics::SPLIT_HANDOFF_TOKENS
                            .with_label_values(&[&self.info.id])
                            .inc_by((req.connector.as_ref().map_or(0, |c| c.keys.len())
                                * self.info.block_size) as u64);
                        decode
                    }
                    Err(e) => {
                        // Whole on a decoding instance: its connector loads what the
                        // fabric holds (whatever the prefill saved before it failed).
                        tracing::warn!(model = %self.info.id, error = %e, "the prefill instance failed; the request is served whole by a decoding instance");
                        crate::metrics::SPLIT
                            .with_label_values(&[&self.info.id, "prefill_failed"])
                            .inc();
                        self.body(&req)
                    }
                }
            } else {
                self.body(&req)
            };
            let (resp, in_flight) = self.send(&body, Stage::Decode).await?;
            let clock = DecodeClock::new(self.meter.clone(), in_flight.0.load(Ordering::Relaxed));
            // The first token: prefill (and the connector's loads and saves) are done.
            let g = VllmGeneration::open(resp, in_flight, eos, Some(clock), self.rt.clone())
                .await?;
            Ok(Box::new(g) as Box<dyn Generation>)
        })
    }
}

type ByteStream = Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>;

struct VllmGeneration {
    _in_flight: InFlight,
    stream: ByteStream,
    buf: BytesMut,
    pending: VecDeque<Token>,
    done: bool,
    /// End of turn (not passed on as a token) unless the request ignores it.
    eos: Option<u32>,
    /// Times its tokens for the stage meter (a decoding generation's).
    clock: Option<DecodeClock>,
    rt: tokio::runtime::Handle,
}

/// When a generation's tokens arrived: its mean time between tokens, measured against the
/// batch on its instance when it started, goes to the stage meter when it ends.
struct DecodeClock {
    meter: Arc<StageMeter>,
    batch: u32,
    first: Option<Instant>,
    last: Option<Instant>,
    /// Tokens after the first.
    later: u32,
}

impl DecodeClock {
    fn new(meter: Arc<StageMeter>, batch: usize) -> Self {
        Self {
            meter,
            batch: batch.max(1) as u32,
            first: None,
            last: None,
            later: 0,
        }
    }

    /// `n` tokens arrived now.
    fn tokens(&mut self, n: u32) {
        let now = Instant::now();
        match self.first {
            None => {
                self.first = Some(now);
                self.later += n.saturating_sub(1);
            }
            Some(_) => self.later += n,
        }
        self.last = Some(now);
    }

    /// The mean gap, from two gaps on (one gap says little).
    fn mean_gap(&self) -> Option<Duration> {
        let (first, last) = (self.first?, self.last?);
        (self.later >= 2).then(|| (last - first) / self.later)
    }
}

impl Drop for DecodeClock {
    fn drop(&mut self) {
        if let Some(gap) = self.mean_gap() {
            self.meter.decoded(self.batch, gap);
        }
    }
}

impl VllmGeneration {
    /// A completion's stream, read up to its first token.
    async fn open(
        resp: reqwest::Response,
        in_flight: InFlight,
        eos: Option<u32>,
        clock: Option<DecodeClock>,
        rt: tokio::runtime::Handle,
    ) -> Result<Self, EngineError> {
        let mut g = VllmGeneration {
            _in_flight: in_flight,
            stream: Box::pin(resp.bytes_stream()),
            buf: BytesMut::new(),
            pending: VecDeque::new(),
            done: false,
            eos,
            clock,
            rt,
        };
        g.fill().await?;
        Ok(g)
    }

    /// Read events until at least one token is pending or the stream has ended.
    async fn fill(&mut self) -> Result<(), EngineError> {
        while self.pending.is_empty() && !self.done {
            if let Some(event) = self.next_event() {
                self.take_event(&event)?;
                continue;
            }
            match self.stream.next().await {
                Some(Ok(chunk)) => self.buf.extend_from_slice(&chunk),
                Some(Err(e)) => return Err(unavailable(e)),
                None => {
                    return Err(EngineError::Unavailable(
                        "vLLM closed the stream before it finished".into(),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The next complete server-sent event's data, if the buffer holds one.
    fn next_event(&mut self) -> Option<String> {
        let end = self.buf.windows(2).position(|w| w == b"\n\n")?;
        let raw = self.buf.split_to(end + 2);
        let text = String::from_utf8_lossy(&raw[..end]);
        let data: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .map(str::trim_start)
            .collect();
        Some(data.join("\n"))
    }

    fn take_event(&mut self, data: &str) -> Result<(), EngineError> {
        if data.is_empty() {
            return Ok(());
        }
        if data == "[DONE]" {
            self.done = true;
            return Ok(());
        }
        let v: Value = serde_json::from_str(data)
            .map_err(|e| EngineError::Internal(format!("vLLM sent an unreadable event: {e}")))?;
        if let Some(err) = v.get("error") {
            return Err(EngineError::Unavailable(format!("vLLM: {err}")));
        }
        let Some(choice) = v["choices"].get(0) else {
            return Ok(());
        };
        let mut text = choice["text"].as_str().unwrap_or_default().to_string();
        if let Some(ids) = choice["token_ids"].as_array() {
            if let Some(c) = self.clock.as_mut().filter(|_| !ids.is_empty()) {
                c.tokens(ids.len() as u32);
            }
            for id in ids.iter().filter_map(Value::as_u64) {
                let id = id as u32;
                if Some(id) == self.eos {
                    self.done = true;
                    break;
                }
                self.pending.push_back(Token {
                    id,
                    text: std::mem::take(&mut text),
                });
            }
        }
        if !choice["finish_reason"].is_null() {
            self.done = true;
        }
        Ok(())
    }
}

impl Generation for VllmGeneration {
    fn take_exports(&mut self) -> Vec<KvBlock> {
        Vec::new()
    }

    fn next_token(&mut self) -> Result<Option<Token>, EngineError> {
        if self.pending.is_empty() && !self.done {
            let rt = self.rt.clone();
            rt.block_on(self.fill())?;
        }
        Ok(self.pending.pop_front())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn generation(events: &str) -> VllmGeneration {
        generation_timed(events, None)
    }

    fn generation_timed(events: &str, clock: Option<DecodeClock>) -> VllmGeneration {
        let chunks: Vec<reqwest::Result<Bytes>> = events
            .as_bytes()
            .chunks(7)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        VllmGeneration {
            _in_flight: InFlight(Arc::new(AtomicUsize::new(1)), None),
            stream: Box::pin(futures::stream::iter(chunks)),
            buf: BytesMut::new(),
            pending: VecDeque::new(),
            done: false,
            eos: Some(2),
            clock,
            rt: tokio::runtime::Handle::current(),
        }
    }

    #[tokio::test]
    async fn a_decoding_generation_reports_its_gaps_at_its_batch_when_it_ends() {
        let meter = Arc::new(StageMeter::default());
        let event =
            "data: {\"choices\":[{\"text\":\"a\",\"token_ids\":[64],\"finish_reason\":null}]}\n\n";
        for batch in [1, 3, 1, 3] {
            let mut g = generation_timed(
                &format!("{}data: [DONE]\n\n", event.repeat(4)),
                Some(DecodeClock::new(meter.clone(), batch)),
            );
            while !g.done {
                g.pending.clear();
                g.fill().await.unwrap();
            }
            assert_eq!(g.clock.as_ref().unwrap().later, 3);
        }
        // Four generations measured: a line (flat or rising), announced.
        let step = meter.step().expect("measured");
        assert!(step.per_seq_ms >= 0.0 && step.base_ms >= 0.0);
        // Two tokens give one gap: not measured.
        let meter = Arc::new(StageMeter::default());
        for _ in 0..5 {
            let mut g = generation_timed(
                &format!("{}data: [DONE]\n\n", event.repeat(2)),
                Some(DecodeClock::new(meter.clone(), 1)),
            );
            while !g.done {
                g.pending.clear();
                g.fill().await.unwrap();
            }
        }
        assert_eq!(meter.step(), None);
    }

    #[test]
    fn the_least_busy_instance_goes_first_and_equals_take_turns() {
        assert_eq!(try_order(&[2, 0, 1], 0), vec![1, 2, 0]);
        assert_eq!(try_order(&[0, 0], 0), vec![0, 1]);
        assert_eq!(try_order(&[0, 0], 1), vec![1, 0]);
        assert_eq!(try_order(&[0, 0, 0], 5), vec![2, 0, 1]);
        assert_eq!(try_order(&[3], 7), vec![0]);
    }

    #[tokio::test]
    async fn tokens_from_the_stream_until_end_of_turn() {
        let mut g = generation(concat!(
            "data: {\"choices\":[{\"text\":\" Paris\",\"token_ids\":[7042],\"finish_reason\":null}]}\n\n",
            "data: {\"choices\":[{\"text\":\".\",\"token_ids\":[30],\"finish_reason\":null}]}\n\n",
            "data: {\"choices\":[{\"text\":\"\",\"token_ids\":[2],\"finish_reason\":\"stop\"}]}\n\n",
            "data: [DONE]\n\n",
        ));
        let mut got = Vec::new();
        loop {
            g.fill().await.unwrap();
            match g.pending.pop_front() {
                Some(t) => got.push((t.id, t.text)),
                None => break,
            }
        }
        assert_eq!(got, vec![(7042, " Paris".into()), (30, ".".into())]);
    }

    #[tokio::test]
    async fn a_stream_cut_short_is_an_unavailable_engine() {
        let mut g = generation(
            "data: {\"choices\":[{\"text\":\"a\",\"token_ids\":[64],\"finish_reason\":null}]}\n\n",
        );
        g.fill().await.unwrap();
        assert_eq!(g.pending.pop_front().map(|t| t.id), Some(64));
        assert!(matches!(g.fill().await, Err(EngineError::Unavailable(_))));
    }

    #[test]
    fn a_split_request_hands_every_full_block_over_and_is_billed_by_its_prefill() {
        let req = GenerateRequest {
            tokens: (0..300).collect(),
            imported: Vec::new(),
            exports: Vec::new(),
            sampling: Default::default(),
            max_new_tokens: 40,
            connector: Some(ConnectorParams {
                scope: [1; 32],
                keys: vec![cachet_common::BlockHash([2; 32]); 2],
                writes: vec![crate::ConnectorWrite {
                    end_block: 1,
                    ttl: Duration::from_secs(300),
                    paid: true,
                }],
                tag: 7,
                cache_salt: "s".into(),
                key_space: default_key_space(128),
            }),
        };
        let both = [Role::Both, Role::Both];
        assert!(!splits(both.into_iter(), 0, &req), "colocated unless told");
        let roles = [Role::Prefill, Role::Decode];
        assert!(splits(roles.into_iter(), 300, &req));
        assert!(
            !splits(roles.into_iter(), 301, &req),
            "a short prompt stays"
        );
        assert!(
            !splits(
                roles.into_iter(),
                0,
                &GenerateRequest {
                    connector: None,
                    ..req.clone()
                }
            ),
            "nothing to hand over"
        );
        let (prefill, decode) = split_bodies("m", &req);
        assert_eq!(prefill["max_tokens"], 1);
        let w = &prefill["kv_transfer_params"]["cachet"]["writes"];
        assert_eq!(w[0]["kind"], "paid", "the customer's own write");
        assert_eq!(w[1]["end_block"], 2, "the hand-over: every full block");
        assert_eq!(w[1]["kind"], "best_effort");
        assert_eq!(w[1]["ttl_ms"], SPLIT_TTL.as_millis() as u64);
        assert_eq!(
            prefill["kv_transfer_params"]["cachet"]["tag"],
            format!("{:032x}", 7)
        );
        let d = &decode["kv_transfer_params"]["cachet"];
        assert_eq!(d["writes"].as_array().unwrap().len(), 0);
        assert_ne!(
            d["tag"], prefill["kv_transfer_params"]["cachet"]["tag"],
            "the decode stage's report is not billed"
        );
        assert_eq!(decode["max_tokens"], 40);
        assert!(Stage::Prefill.takes(Role::Prefill) && !Stage::Prefill.takes(Role::Both));
        assert!(Stage::Decode.takes(Role::Both) && Stage::Decode.takes(Role::Decode));
        assert!(!Stage::Decode.takes(Role::Prefill));
    }

    #[test]
    fn transfer_params_carry_keys_and_writes() {
        let p = ConnectorParams {
            scope: [1; 32],
            keys: vec![cachet_common::BlockHash([2; 32])],
            writes: vec![crate::ConnectorWrite {
                end_block: 1,
                ttl: Duration::from_secs(300),
                paid: true,
            }],
            tag: 0xabc,
            cache_salt: "s".into(),
            key_space: default_key_space(128),
        };
        let v = transfer_params(&p);
        let c = &v["cachet"];
        assert_eq!(c["scope"].as_str().unwrap().len(), 64);
        assert_eq!(c["keys"][0].as_str().unwrap(), "02".repeat(32));
        assert_eq!(c["writes"][0]["ttl_ms"], 300_000);
        assert_eq!(c["writes"][0]["kind"], "paid");
        assert_eq!(c["tag"].as_str().unwrap(), format!("{:032x}", 0xabc));
        assert_eq!(c["kv_space"], "vllm/float32/auto/LBHNC/128");
    }
}
