//! One replayed request on the wire: the body a client would send for a trace record, and
//! what came back, timed token by token (server-sent events parsed as they arrive).

use std::time::Instant;

use futures::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::text::blocks_text;
use crate::trace::{Shape, TraceRecord};

/// Where the breakpoints go.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Breakpoints {
    /// Automatic caching: one top-level `cache_control`.
    Auto,
    /// `cache_control` at the end of the shared prefix (the system prompt) and of the last
    /// turn (the user message).
    Explicit,
    /// No caching asked for (the baseline of "with vs without caching").
    None,
}

/// Which wire the requests use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Api {
    /// `POST /v1/messages`.
    Anthropic,
    /// `POST /v1/chat/completions`.
    Openai,
}

/// How every request of a run is built.
#[derive(Clone, Debug)]
pub struct BodyOptions {
    pub model: String,
    pub api: Api,
    pub breakpoints: Breakpoints,
    /// Cap on `max_tokens` (the trace's `output_length` otherwise).
    pub max_output_tokens: Option<u64>,
    /// Ask the engine for exactly `max_tokens` (`ignore_eos`).
    pub ignore_eos: bool,
    pub shape: Shape,
}

impl BodyOptions {
    pub fn max_tokens(&self, r: &TraceRecord) -> u64 {
        let m = r.output_length.max(1);
        self.max_output_tokens.map_or(m, |c| m.min(c))
    }

    /// The request body for `r`: the system prompt (its first blocks) and one user message
    /// (the rest), streamed.
    pub fn body(&self, r: &TraceRecord) -> Vec<u8> {
        let lens = self.shape.block_lengths(r);
        let split = self.shape.system_len(r);
        let system = blocks_text(&r.hash_ids[..split], &lens[..split]);
        let user = blocks_text(&r.hash_ids[split..], &lens[split..]);
        let explicit = self.breakpoints == Breakpoints::Explicit;
        // Each wire marks a breakpoint its own way.
        let text_block = |text: String| {
            let mut b = json!({"type": "text", "text": text});
            if explicit {
                match self.api {
                    Api::Anthropic => b["cache_control"] = json!({"type": "ephemeral"}),
                    Api::Openai => b["prompt_cache_breakpoint"] = json!({"mode": "explicit"}),
                }
            }
            b
        };
        let mut v = match self.api {
            Api::Anthropic => {
                let mut v = json!({
                    "model": self.model,
                    "max_tokens": self.max_tokens(r),
                    "stream": true,
                    "messages": [{"role": "user", "content": [text_block(user)]}],
                });
                if !system.is_empty() {
                    v["system"] = json!([text_block(system)]);
                }
                v
            }
            Api::Openai => {
                let mut messages = Vec::new();
                if !system.is_empty() {
                    messages.push(json!({"role": "system", "content": [text_block(system)]}));
                }
                messages.push(json!({"role": "user", "content": [text_block(user)]}));
                json!({
                    "model": self.model,
                    "max_completion_tokens": self.max_tokens(r),
                    "stream": true,
                    "stream_options": {"include_usage": true},
                    "messages": messages,
                })
            }
        };
        match (self.api, self.breakpoints) {
            (Api::Anthropic, Breakpoints::Auto) => {
                v["cache_control"] = json!({"type": "ephemeral"})
            }
            // OpenAI caches automatically unless told to write marked parts only (none marked:
            // nothing cached).
            (Api::Openai, Breakpoints::Explicit | Breakpoints::None) => {
                v["prompt_cache_options"] = json!({"mode": "explicit"})
            }
            _ => {}
        }
        if self.ignore_eos {
            v["ignore_eos"] = json!(true);
        }
        serde_json::to_vec(&v).expect("a JSON value serializes")
    }

    pub fn path(&self) -> &'static str {
        match self.api {
            Api::Anthropic => "/v1/messages",
            Api::Openai => "/v1/chat/completions",
        }
    }
}

/// Prompt and output tokens by class, as the client saw them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub input_tokens: u64,
    pub cache_write_5m_tokens: u64,
    pub cache_write_1h_tokens: u64,
    pub cache_read_tokens: u64,
    pub output_tokens: u64,
}

impl Usage {
    pub fn prompt(&self) -> u64 {
        self.input_tokens
            + self.cache_write_5m_tokens
            + self.cache_write_1h_tokens
            + self.cache_read_tokens
    }

    /// From an Anthropic `usage` object (body, `message_start` or `message_delta`): fields
    /// present overwrite, absent ones are kept (`message_delta` is cumulative).
    fn merge_anthropic(&mut self, u: &Value) {
        let get = |k: &str| u.get(k).and_then(Value::as_u64);
        if let Some(n) = get("input_tokens") {
            self.input_tokens = n;
        }
        if let Some(n) = get("cache_read_input_tokens") {
            self.cache_read_tokens = n;
        }
        if let Some(n) = get("output_tokens") {
            self.output_tokens = n;
        }
        let split = u.get("cache_creation");
        match split {
            Some(c) if c.is_object() => {
                self.cache_write_5m_tokens = c
                    .get("ephemeral_5m_input_tokens")
                    .and_then(Value::as_u64)
                    .unwrap_or(0);
                self.cache_write_1h_tokens = c
                    .get("ephemeral_1h_input_tokens")
                    .and_then(Value::as_u64)
                    .unwrap_or(0);
            }
            _ => {
                if let Some(n) = get("cache_creation_input_tokens") {
                    self.cache_write_5m_tokens = n;
                }
            }
        }
    }

    /// From an OpenAI `usage` object: `prompt_tokens` includes cached reads and writes.
    fn from_openai(u: &Value) -> Self {
        let get = |v: Option<&Value>, k: &str| v.and_then(|v| v.get(k)).and_then(Value::as_u64);
        let details = u.get("prompt_tokens_details");
        let read = get(details, "cached_tokens").unwrap_or(0);
        let write = get(details, "cache_write_tokens").unwrap_or(0);
        let prompt = get(Some(u), "prompt_tokens").unwrap_or(0);
        Self {
            input_tokens: prompt.saturating_sub(read + write),
            cache_write_5m_tokens: write,
            cache_write_1h_tokens: 0,
            cache_read_tokens: read,
            output_tokens: get(Some(u), "completion_tokens").unwrap_or(0),
        }
    }
}

/// Timing and outcome of one request.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    /// HTTP status; 0 when no response came (connection refused, timed out).
    pub status: u16,
    /// Why it failed (`None`: a complete answer): status and error type.
    pub error: Option<String>,
    /// The server's error message, when it sent one.
    pub error_message: Option<String>,
    pub ttft_ms: Option<f64>,
    pub e2e_ms: f64,
    /// Gaps between consecutive output tokens, ms.
    pub gaps_ms: Vec<f64>,
    pub usage: Usage,
    pub request_id: Option<String>,
    /// The node that answered (a cluster gateway's `x-cachet-node`); for a stream resumed
    /// after its node failed, the node that finished it.
    pub node: Option<String>,
    /// For a resumed stream, the node it started on.
    pub resumed_from: Option<String>,
    /// Why a cluster gateway chose the node (`x-cachet-route`).
    pub route: Option<String>,
    pub stop_reason: Option<String>,
}

/// Send `req` and read its body: the text of a success, else an error naming `what`, the
/// status and the body (a load test stops at a setup step the server refuses).
pub async fn text_of(req: reqwest::RequestBuilder, what: &str) -> anyhow::Result<String> {
    use anyhow::Context;
    let resp = req.send().await.with_context(|| what.to_string())?;
    let status = resp.status();
    let text = resp.text().await?;
    anyhow::ensure!(status.is_success(), "{what} answered {status}: {text}");
    Ok(text)
}

/// Send one request and time it until its last byte.
pub async fn send(
    client: &reqwest::Client,
    url: &str,
    key: &str,
    opts: &BodyOptions,
    body: Vec<u8>,
) -> Outcome {
    let start = Instant::now();
    let mut out = Outcome::default();
    let mut req = client
        .post(format!("{url}{}", opts.path()))
        .header("content-type", "application/json")
        .body(body);
    req = match opts.api {
        Api::Anthropic => req
            .header("x-api-key", key)
            .header("anthropic-version", "2023-06-01"),
        Api::Openai => req.bearer_auth(key),
    };
    let resp = match req.send().await {
        Ok(r) => r,
        Err(e) => {
            out.error = Some(format!("connection: {}", error_kind(&e)));
            out.e2e_ms = ms(start);
            return out;
        }
    };
    out.status = resp.status().as_u16();
    let header = |k: &str| {
        resp.headers()
            .get(k)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    out.request_id = header("request-id").or_else(|| header("x-request-id"));
    out.node = header("x-cachet-node");
    out.route = header("x-cachet-route");
    let sse = header("content-type").is_some_and(|c| c.starts_with("text/event-stream"));
    if !resp.status().is_success() {
        let text = resp.text().await.unwrap_or_default();
        let v = serde_json::from_str::<Value>(&text).ok();
        let field = |k: &str| {
            v.as_ref()
                .and_then(|v| v["error"][k].as_str())
                .map(str::to_string)
        };
        let kind = field("type").unwrap_or_else(|| "http".into());
        out.error = Some(format!("{} {kind}", out.status));
        out.error_message = field("message").map(|m| m.chars().take(300).collect());
        out.e2e_ms = ms(start);
        return out;
    }
    if !sse {
        // A plain JSON answer: the first token is the whole answer.
        match resp.bytes().await {
            Ok(b) => {
                out.ttft_ms = Some(ms(start));
                match serde_json::from_slice::<Value>(&b) {
                    Ok(v) => read_json_answer(&v, opts.api, &mut out),
                    Err(_) => out.error = Some("body: not JSON".into()),
                }
            }
            Err(e) => out.error = Some(format!("body: {}", error_kind(&e))),
        }
        out.e2e_ms = ms(start);
        return out;
    }
    let mut stream = resp.bytes_stream();
    let mut buf: Vec<u8> = Vec::with_capacity(4096);
    let mut last_token: Option<Instant> = None;
    let mut finished = false;
    'read: while let Some(chunk) = stream.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => {
                out.error = Some(format!("stream: {}", error_kind(&e)));
                break;
            }
        };
        buf.extend_from_slice(&chunk);
        while let Some(end) = find_event_end(&buf) {
            let event: Vec<u8> = buf.drain(..end.1).collect();
            let now = Instant::now();
            match on_event(&event[..end.0], opts.api, &mut out) {
                Seen::Token => {
                    if let Some(prev) = last_token {
                        out.gaps_ms.push((now - prev).as_secs_f64() * 1000.0);
                    } else {
                        out.ttft_ms = Some((now - start).as_secs_f64() * 1000.0);
                    }
                    last_token = Some(now);
                }
                Seen::End => {
                    finished = true;
                    break 'read;
                }
                Seen::Error(e) => {
                    out.error = Some(e);
                    break 'read;
                }
                Seen::Other => {}
            }
        }
    }
    out.e2e_ms = ms(start);
    if out.ttft_ms.is_none() && finished {
        // No tokens at all (max_tokens reached at once): the answer's end is its first byte.
        out.ttft_ms = Some(out.e2e_ms);
    }
    if !finished && out.error.is_none() {
        out.error = Some("stream: ended before its last event".into());
    }
    out
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1000.0
}

fn error_kind(e: &reqwest::Error) -> &'static str {
    if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "refused"
    } else if e.is_body() || e.is_decode() {
        "cut"
    } else {
        "failed"
    }
}

/// The end of the first complete event in `buf`: (end of its text, end including the blank
/// line).
fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf
        .windows(2)
        .position(|w| w == b"\n\n")
        .map(|i| (i, i + 2));
    let crlf = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| (i, i + 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

enum Seen {
    Token,
    End,
    Error(String),
    Other,
}

fn on_event(event: &[u8], api: Api, out: &mut Outcome) -> Seen {
    let text = String::from_utf8_lossy(event);
    let mut data = String::new();
    for line in text.lines() {
        if let Some(d) = line.strip_prefix("data:") {
            data.push_str(d.trim_start());
        } else if let Some(node) = line
            .strip_prefix(':')
            .map(str::trim_start)
            .and_then(|c| c.strip_prefix(gateway::routing::RESUMED_NOTE))
        {
            // The gateway resumed the stream on another node after its first one failed.
            out.resumed_from = out.node.take();
            out.node = Some(node.trim().to_string());
        }
    }
    if data.is_empty() {
        return Seen::Other;
    }
    if data == "[DONE]" {
        return Seen::End;
    }
    let Ok(v) = serde_json::from_str::<Value>(&data) else {
        return Seen::Error("stream: an event that is not JSON".into());
    };
    match api {
        Api::Anthropic => match v["type"].as_str().unwrap_or("") {
            "message_start" => {
                out.usage.merge_anthropic(&v["message"]["usage"]);
                Seen::Other
            }
            "content_block_delta" => Seen::Token,
            "message_delta" => {
                out.usage.merge_anthropic(&v["usage"]);
                out.stop_reason = v["delta"]["stop_reason"].as_str().map(str::to_string);
                Seen::Other
            }
            "message_stop" => Seen::End,
            "error" => Seen::Error(format!(
                "stream: {}",
                v["error"]["type"].as_str().unwrap_or("error")
            )),
            _ => Seen::Other,
        },
        Api::Openai => {
            if let Some(e) = v.get("error") {
                return Seen::Error(format!("stream: {}", e["type"].as_str().unwrap_or("error")));
            }
            if v.get("usage").is_some_and(Value::is_object) {
                out.usage = Usage::from_openai(&v["usage"]);
            }
            let choice = &v["choices"][0];
            if let Some(r) = choice["finish_reason"].as_str() {
                out.stop_reason = Some(r.to_string());
            }
            if choice["delta"]["content"]
                .as_str()
                .is_some_and(|c| !c.is_empty())
            {
                Seen::Token
            } else {
                Seen::Other
            }
        }
    }
}

fn read_json_answer(v: &Value, api: Api, out: &mut Outcome) {
    match api {
        Api::Anthropic => {
            out.usage.merge_anthropic(&v["usage"]);
            out.stop_reason = v["stop_reason"].as_str().map(str::to_string);
        }
        Api::Openai => {
            out.usage = Usage::from_openai(&v["usage"]);
            out.stop_reason = v["choices"][0]["finish_reason"]
                .as_str()
                .map(str::to_string);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(api: Api, breakpoints: Breakpoints) -> BodyOptions {
        BodyOptions {
            model: "sim-llama-8b".into(),
            api,
            breakpoints,
            max_output_tokens: Some(16),
            ignore_eos: true,
            shape: Shape {
                block_tokens: 8,
                trace_block_tokens: 512,
                system_blocks: 1,
                tenants: 1,
            },
        }
    }

    fn rec() -> TraceRecord {
        TraceRecord {
            timestamp: 0.0,
            input_length: 2 * 512 + 256,
            output_length: 300,
            hash_ids: vec![0, 1, 2],
        }
    }

    #[test]
    fn bodies_put_the_first_blocks_in_the_system_prompt_and_mark_breakpoints() {
        let b: Value =
            serde_json::from_slice(&opts(Api::Anthropic, Breakpoints::Auto).body(&rec())).unwrap();
        assert_eq!(b["cache_control"]["type"], "ephemeral");
        assert_eq!(b["max_tokens"], 16);
        assert_eq!(b["ignore_eos"], true);
        let sys = b["system"][0]["text"].as_str().unwrap();
        let user = b["messages"][0]["content"][0]["text"].as_str().unwrap();
        assert_eq!(sys.split(' ').skip(1).count(), 8);
        assert_eq!(user.split(' ').skip(1).count(), 8 + 4);
        assert!(b["system"][0].get("cache_control").is_none());

        let e: Value =
            serde_json::from_slice(&opts(Api::Anthropic, Breakpoints::Explicit).body(&rec()))
                .unwrap();
        assert!(e.get("cache_control").is_none());
        assert_eq!(e["system"][0]["cache_control"]["type"], "ephemeral");
        assert_eq!(
            e["messages"][0]["content"][0]["cache_control"]["type"],
            "ephemeral"
        );
        // The text is the same whatever the breakpoints.
        assert_eq!(e["system"][0]["text"], b["system"][0]["text"]);

        let o: Value =
            serde_json::from_slice(&opts(Api::Openai, Breakpoints::Auto).body(&rec())).unwrap();
        assert_eq!(o["messages"][0]["role"], "system");
        assert_eq!(o["max_completion_tokens"], 16);
        assert_eq!(o["stream_options"]["include_usage"], true);
        assert!(o.get("prompt_cache_options").is_none() && o.get("cache_control").is_none());
        // OpenAI's own markers: explicit mode and prompt_cache_breakpoint parts.
        let oe: Value =
            serde_json::from_slice(&opts(Api::Openai, Breakpoints::Explicit).body(&rec())).unwrap();
        assert_eq!(oe["prompt_cache_options"]["mode"], "explicit");
        assert_eq!(
            oe["messages"][0]["content"][0]["prompt_cache_breakpoint"]["mode"],
            "explicit"
        );
        assert!(
            oe["messages"][1]["content"][0]
                .get("cache_control")
                .is_none()
        );
        let on: Value =
            serde_json::from_slice(&opts(Api::Openai, Breakpoints::None).body(&rec())).unwrap();
        assert_eq!(on["prompt_cache_options"]["mode"], "explicit");
        assert!(
            on["messages"][1]["content"][0]
                .get("prompt_cache_breakpoint")
                .is_none()
        );
    }

    #[test]
    fn a_resumed_stream_names_the_node_that_finished_it() {
        let mut out = Outcome {
            node: Some("n1".into()),
            ..Default::default()
        };
        // What the gateway sends where another node took over (an SSE comment).
        let note = format!(": {}n2", gateway::routing::RESUMED_NOTE);
        assert!(matches!(
            on_event(note.as_bytes(), Api::Anthropic, &mut out),
            Seen::Other
        ));
        assert_eq!(out.node.as_deref(), Some("n2"));
        assert_eq!(out.resumed_from.as_deref(), Some("n1"));
    }

    #[test]
    fn anthropic_events_fill_usage_and_mark_tokens() {
        let mut out = Outcome::default();
        let start = br#"event: message_start
data: {"type":"message_start","message":{"usage":{"input_tokens":5,"cache_creation_input_tokens":100,"cache_read_input_tokens":2000,"cache_creation":{"ephemeral_5m_input_tokens":60,"ephemeral_1h_input_tokens":40},"output_tokens":1}}}"#;
        assert!(matches!(
            on_event(start, Api::Anthropic, &mut out),
            Seen::Other
        ));
        let delta = br#"event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hi"}}"#;
        assert!(matches!(
            on_event(delta, Api::Anthropic, &mut out),
            Seen::Token
        ));
        let md = br#"event: message_delta
data: {"type":"message_delta","delta":{"stop_reason":"max_tokens"},"usage":{"output_tokens":16}}"#;
        on_event(md, Api::Anthropic, &mut out);
        assert_eq!(
            out.usage,
            Usage {
                input_tokens: 5,
                cache_write_5m_tokens: 60,
                cache_write_1h_tokens: 40,
                cache_read_tokens: 2000,
                output_tokens: 16
            }
        );
        assert_eq!(out.stop_reason.as_deref(), Some("max_tokens"));
        let err = br#"event: error
data: {"type":"error","error":{"type":"overloaded_error","message":"x"}}"#;
        assert!(
            matches!(on_event(err, Api::Anthropic, &mut out), Seen::Error(e) if e == "stream: overloaded_error")
        );
        assert!(matches!(
            on_event(
                b"event: message_stop\ndata: {\"type\":\"message_stop\"}",
                Api::Anthropic,
                &mut out
            ),
            Seen::End
        ));
    }

    #[test]
    fn openai_usage_splits_cached_and_written_out_of_prompt_tokens() {
        let u = Usage::from_openai(&json!({
            "prompt_tokens": 3000, "completion_tokens": 7, "total_tokens": 3007,
            "prompt_tokens_details": {"cached_tokens": 2048, "cache_write_tokens": 900}
        }));
        assert_eq!(
            (
                u.input_tokens,
                u.cache_read_tokens,
                u.cache_write_5m_tokens,
                u.output_tokens
            ),
            (52, 2048, 900, 7)
        );
        assert_eq!(u.prompt(), 3000);
    }

    #[test]
    fn events_split_on_blank_lines_of_either_kind() {
        assert_eq!(find_event_end(b"data: 1\n\ndata: 2"), Some((7, 9)));
        assert_eq!(find_event_end(b"data: 1\r\n\r\n"), Some((7, 11)));
        assert_eq!(find_event_end(b"data: 1\n"), None);
    }
}
