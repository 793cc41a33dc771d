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

use std::collections::VecDeque;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures::{Stream, StreamExt};
use serde_json::{Value, json};

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
    eos_id: u32,
    rt: tokio::runtime::Handle,
}

/// One vLLM server of a model, and the generations it is serving.
struct Instance {
    completions: String,
    in_flight: Arc<AtomicUsize>,
}

/// A generation's count on its instance, given back when the generation ends.
struct InFlight(Arc<AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
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
                .map(|u| Instance {
                    completions: format!("{}/v1/completions", u.trim_end_matches('/')),
                    in_flight: Arc::default(),
                })
                .collect(),
            turn: AtomicUsize::new(0),
            served_model: config.served_model,
            rt,
        })
    }

    fn body(&self, req: &GenerateRequest) -> Value {
        let s = &req.sampling;
        let mut body = json!({
            "model": self.served_model,
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
    /// The instances in the order to try them: fewest generations in flight first, equals
    /// taken turn by turn.
    fn order(&self) -> Vec<usize> {
        let busy: Vec<usize> = self
            .instances
            .iter()
            .map(|i| i.in_flight.load(Ordering::Relaxed))
            .collect();
        try_order(&busy, self.turn.fetch_add(1, Ordering::Relaxed))
    }

    /// Send a completion to the least busy instance that can be reached (the next one when
    /// a connection fails: nothing was computed there).
    async fn send(&self, body: &Value) -> Result<(reqwest::Response, InFlight), EngineError> {
        let mut last = None;
        for i in self.order() {
            let inst = &self.instances[i];
            inst.in_flight.fetch_add(1, Ordering::Relaxed);
            let held = InFlight(inst.in_flight.clone());
            match self.client.post(&inst.completions).json(body).send().await {
                Ok(resp) => return Ok((resp, held)),
                Err(e) if e.is_connect() => last = Some(e),
                Err(e) => return Err(unavailable(e)),
            }
        }
        Err(unavailable(last.expect("at least one instance")))
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
        let body = self.body(&req);
        let rt = self.rt.clone();
        let eos = (!req.sampling.ignore_eos).then_some(self.eos_id);
        self.rt.block_on(async {
            let (resp, in_flight) = self.send(&body).await?;
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
            let mut g = VllmGeneration {
                _in_flight: in_flight,
                stream: Box::pin(resp.bytes_stream()),
                buf: BytesMut::new(),
                pending: VecDeque::new(),
                done: false,
                eos,
                rt,
            };
            // The first token: prefill (and the connector's loads and saves) are done.
            g.fill().await?;
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
    rt: tokio::runtime::Handle,
}

impl VllmGeneration {
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
        let chunks: Vec<reqwest::Result<Bytes>> = events
            .as_bytes()
            .chunks(7)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        VllmGeneration {
            _in_flight: InFlight(Arc::new(AtomicUsize::new(1))),
            stream: Box::pin(futures::stream::iter(chunks)),
            buf: BytesMut::new(),
            pending: VecDeque::new(),
            done: false,
            eos: Some(2),
            rt: tokio::runtime::Handle::current(),
        }
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
