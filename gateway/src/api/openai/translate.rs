//! A Chat Completions request, translated: checked field by field (anything Cachet cannot
//! honour is a 400 naming the field, in OpenAI's error shape) and translated into the Messages request that renders the
//! same prompt: system and developer messages at the start become the system prompt, user and
//! assistant turns their messages, assistant `tool_calls` `tool_use` blocks and `tool`
//! messages `tool_result` blocks, `tools` the same tools. So a prompt written through one API
//! is read through the other when the rendered tokens are the same.
//!
//! Caching (docs/operations.md has the table):
//! - default, or `prompt_cache_options.mode: "implicit"`: automatic caching (a top-level
//!   `cache_control`), plus a breakpoint on every content part marked
//!   `prompt_cache_breakpoint`;
//! - `mode: "explicit"`: only the marked parts (none marked: nothing is cached);
//! - TTL: `prompt_cache_retention: "in_memory"` → 5m; `prompt_cache_options.ttl: "30m"` →
//!   1h; `"24h"` → kept 24 hours (a 1h write as billed, held for a day and refreshed by
//!   reads), where the tenant's policy allows long TTLs (else 5m: retention is a maximum, and
//!   the cache is best effort);
//! - `prompt_cache_key` is a routing hint within the tenant only, never part of any key: two
//!   tenants sending the same key share nothing.

use serde_json::{Map, Value, json};

use crate::error::ApiError;

/// What the translation keeps besides the Messages body.
#[derive(Clone, Debug, Default)]
pub struct ChatOptions {
    pub stream: bool,
    pub include_usage: bool,
    pub seed: Option<u64>,
    /// Routing hint within the tenant (never an isolation key).
    pub prompt_cache_key: Option<String>,
    /// `prompt_cache_retention: "24h"` where the tenant allows long TTLs: what this request
    /// writes is kept 24 hours (billed as a 1h write).
    pub hold: Option<std::time::Duration>,
}

/// OpenAI's extended retention.
pub const RETENTION_24H: std::time::Duration = std::time::Duration::from_secs(24 * 3600);

fn bad(param: &str, msg: impl std::fmt::Display) -> ApiError {
    ApiError::invalid(format!("{param}: {msg}"))
}

/// Fields Chat Completions defines that Cachet does not honour: refused unless absent, null
/// or their neutral value.
fn neutral(field: &str, v: &Value) -> bool {
    match field {
        "n" => v.as_u64() == Some(1),
        "frequency_penalty" | "presence_penalty" => v.as_f64() == Some(0.0),
        "logprobs" => v == &Value::Bool(false),
        "logit_bias" => v.as_object().is_some_and(Map::is_empty),
        "modalities" => v
            .as_array()
            .is_some_and(|a| a.iter().all(|m| m.as_str() == Some("text"))),
        "response_format" => v.get("type").and_then(Value::as_str) == Some("text"),
        _ => false,
    }
}

const UNSUPPORTED: &[&str] = &[
    "n",
    "frequency_penalty",
    "presence_penalty",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "modalities",
    "audio",
    "response_format",
    "prediction",
    "web_search_options",
    "functions",
    "function_call",
    "reasoning_effort",
    "verbosity",
];

/// Accepted and not acted on (bookkeeping the service has no use for).
const IGNORED: &[&str] = &[
    "user",
    "store",
    "metadata",
    "parallel_tool_calls",
    "service_tier",
    "safety_identifier",
];

/// Translate a Chat Completions body into the Messages body that renders the same prompt.
/// `default_max_tokens`: the model's output limit, for requests that give none.
pub fn to_messages(
    body: &[u8],
    default_max_tokens: impl Fn(&str) -> Option<u32>,
    allow_1h: bool,
) -> Result<(Value, ChatOptions), ApiError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::invalid(format!(
            "We could not parse the JSON body of your request: {e}"
        ))
    })?;
    let Value::Object(req) = v else {
        return Err(ApiError::invalid("the request body must be a JSON object"));
    };
    check_fields(&req)?;
    let get = |k: &str| req.get(k).filter(|v| !v.is_null());
    let model = get("model")
        .ok_or_else(|| bad("model", "you must provide a model parameter"))?
        .as_str()
        .ok_or_else(|| bad("model", "must be a string"))?
        .to_string();
    let max_tokens = output_limit(&get, &model, default_max_tokens)?;
    let mut out = Map::new();
    out.insert("model".into(), json!(model));
    out.insert("max_tokens".into(), json!(max_tokens));
    sampling(&get, &mut out)?;
    let mut opts = ChatOptions::default();
    if let Some(s) = get("seed") {
        opts.seed = Some(
            s.as_i64()
                .map(|i| i as u64)
                .ok_or_else(|| bad("seed", "must be an integer"))?,
        );
    }
    if let Some(x) = get("ignore_eos") {
        let b = x
            .as_bool()
            .ok_or_else(|| bad("ignore_eos", "must be a boolean"))?;
        out.insert("ignore_eos".into(), json!(b));
    }
    streaming(&get, &mut opts)?;
    out.insert("stream".into(), json!(opts.stream));
    if let Some(k) = get("prompt_cache_key") {
        opts.prompt_cache_key = Some(
            k.as_str()
                .ok_or_else(|| bad("prompt_cache_key", "must be a string"))?
                .to_string(),
        );
    }
    let (explicit, ttl) = cache_mode(
        get("prompt_cache_retention"),
        get("prompt_cache_options"),
        allow_1h,
    )?;
    if ttl == "1h" && get("prompt_cache_retention").and_then(Value::as_str) == Some("24h") {
        opts.hold = Some(RETENTION_24H);
    }
    let ttl_json = |marker: &mut Map<String, Value>| {
        let mut cc = json!({"type": "ephemeral"});
        if ttl == "1h" {
            cc["ttl"] = json!("1h");
        }
        marker.insert("cache_control".into(), cc);
    };
    if !explicit {
        let mut m = Map::new();
        ttl_json(&mut m);
        out.insert("cache_control".into(), m["cache_control"].clone());
    }
    if let Some(t) = get("tools") {
        out.insert("tools".into(), tools(t)?);
    }
    if let Some(tc) = get("tool_choice") {
        out.insert("tool_choice".into(), tool_choice(tc)?);
    }
    let msgs = get("messages")
        .ok_or_else(|| bad("messages", "you must provide a messages parameter"))?
        .as_array()
        .ok_or_else(|| bad("messages", "must be an array"))?;
    let (system, messages) = messages(msgs, &|m: &mut Map<String, Value>| ttl_json(m))?;
    if !system.is_empty() {
        out.insert("system".into(), Value::Array(system));
    }
    out.insert("messages".into(), Value::Array(messages));
    if let Some(c) = get("cached_content") {
        // Resolved with the Messages body it becomes (`api::caches::resolve`); a system
        // message beside it is refused there as `system`.
        out.insert("cached_content".into(), c.clone());
    }
    Ok((Value::Object(out), opts))
}

/// Every field of the body is one Cachet knows, ignores, or refuses as unsupported (unless
/// it is given a value that changes nothing).
fn check_fields(req: &Map<String, Value>) -> Result<(), ApiError> {
    for (k, val) in req {
        if val.is_null() {
            continue;
        }
        if UNSUPPORTED.contains(&k.as_str()) && !neutral(k, val) {
            return Err(bad(k, "is not supported by Cachet"));
        }
        let known = [
            "model",
            "messages",
            "tools",
            "tool_choice",
            "max_tokens",
            "max_completion_tokens",
            "temperature",
            "top_p",
            "stop",
            "seed",
            "stream",
            "stream_options",
            "prompt_cache_key",
            "prompt_cache_retention",
            "prompt_cache_options",
            // A cache object (`POST /v1/caches`) the prompt begins with.
            "cached_content",
            // Cachet extension, as on /v1/messages: exactly max tokens (load tests).
            "ignore_eos",
        ];
        if !known.contains(&k.as_str())
            && !IGNORED.contains(&k.as_str())
            && !UNSUPPORTED.contains(&k.as_str())
        {
            return Err(ApiError::invalid(format!(
                "Unrecognized request argument supplied: {k}"
            )));
        }
    }
    Ok(())
}

/// `max_completion_tokens` or `max_tokens` (not both), else the model's output limit.
fn output_limit<'a>(
    get: &impl Fn(&str) -> Option<&'a Value>,
    model: &str,
    default_max_tokens: impl Fn(&str) -> Option<u32>,
) -> Result<u64, ApiError> {
    let max_tokens = match (get("max_completion_tokens"), get("max_tokens")) {
        (Some(_), Some(_)) => {
            return Err(bad(
                "max_tokens",
                "give max_completion_tokens or max_tokens, not both",
            ));
        }
        (Some(m), None) => Some(("max_completion_tokens", m)),
        (None, Some(m)) => Some(("max_tokens", m)),
        (None, None) => None,
    };
    Ok(match max_tokens {
        Some((name, m)) => m
            .as_u64()
            .filter(|&n| n <= u32::MAX as u64)
            .ok_or_else(|| bad(name, "must be a non-negative integer"))?,
        // An unknown model falls through to the Messages validation's own error.
        None => default_max_tokens(model).unwrap_or(4096) as u64,
    })
}

/// `temperature`, `top_p` and `stop`, as the Messages body says them.
fn sampling<'a>(
    get: &impl Fn(&str) -> Option<&'a Value>,
    out: &mut Map<String, Value>,
) -> Result<(), ApiError> {
    for k in ["temperature", "top_p"] {
        if let Some(x) = get(k) {
            let f = x.as_f64().ok_or_else(|| bad(k, "must be a number"))?;
            // OpenAI's temperature runs to 2, the engines' sampling to any positive value.
            if !(0.0..=2.0).contains(&f) {
                return Err(bad(k, "must be between 0 and 2"));
            }
            out.insert(k.into(), json!(f));
        }
    }
    if let Some(s) = get("stop") {
        let stops: Vec<Value> = match s {
            Value::String(_) => vec![s.clone()],
            Value::Array(a) if a.len() <= 4 && a.iter().all(Value::is_string) => a.clone(),
            _ => return Err(bad("stop", "must be a string or up to 4 strings")),
        };
        out.insert("stop_sequences".into(), Value::Array(stops));
    }
    Ok(())
}

/// `stream` and its `stream_options`.
fn streaming<'a>(
    get: &impl Fn(&str) -> Option<&'a Value>,
    opts: &mut ChatOptions,
) -> Result<(), ApiError> {
    if let Some(s) = get("stream") {
        opts.stream = s
            .as_bool()
            .ok_or_else(|| bad("stream", "must be a boolean"))?;
    }
    if let Some(so) = get("stream_options") {
        if !opts.stream {
            return Err(bad("stream_options", "is only allowed when stream is true"));
        }
        let o = so
            .as_object()
            .ok_or_else(|| bad("stream_options", "must be an object"))?;
        for (k, v) in o {
            match k.as_str() {
                "include_usage" => {
                    opts.include_usage = v
                        .as_bool()
                        .ok_or_else(|| bad("stream_options.include_usage", "must be a boolean"))?
                }
                "include_obfuscation" => {}
                _ => return Err(bad(&format!("stream_options.{k}"), "is not supported")),
            }
        }
    }
    Ok(())
}

/// (explicit mode, TTL "5m" | "1h").
fn cache_mode(
    retention: Option<&Value>,
    options: Option<&Value>,
    allow_1h: bool,
) -> Result<(bool, &'static str), ApiError> {
    let long = if allow_1h { "1h" } else { "5m" };
    let mut ttl = "5m";
    if let Some(r) = retention {
        ttl = match r.as_str() {
            Some("in_memory") => "5m",
            Some("24h") => long,
            _ => {
                return Err(bad(
                    "prompt_cache_retention",
                    "must be \"in_memory\" or \"24h\"",
                ));
            }
        };
    }
    let mut explicit = false;
    if let Some(o) = options {
        let o = o
            .as_object()
            .ok_or_else(|| bad("prompt_cache_options", "must be an object"))?;
        for (k, v) in o {
            match k.as_str() {
                "mode" => {
                    explicit = match v.as_str() {
                        Some("implicit") => false,
                        Some("explicit") => true,
                        _ => {
                            return Err(bad(
                                "prompt_cache_options.mode",
                                "must be \"implicit\" or \"explicit\"",
                            ));
                        }
                    }
                }
                "ttl" => {
                    if retention.is_some() {
                        return Err(bad(
                            "prompt_cache_options.ttl",
                            "cannot be given with prompt_cache_retention",
                        ));
                    }
                    if v.as_str() != Some("30m") {
                        return Err(bad("prompt_cache_options.ttl", "must be \"30m\""));
                    }
                    ttl = long;
                }
                _ => {
                    return Err(bad(
                        &format!("prompt_cache_options.{k}"),
                        "is not supported",
                    ));
                }
            }
        }
    }
    Ok((explicit, ttl))
}

fn tools(t: &Value) -> Result<Value, ApiError> {
    let arr = t
        .as_array()
        .ok_or_else(|| bad("tools", "must be an array"))?;
    let mut out = Vec::new();
    for (i, tool) in arr.iter().enumerate() {
        let p = format!("tools[{i}]");
        if tool.get("type").and_then(Value::as_str) != Some("function") {
            return Err(bad(
                &format!("{p}.type"),
                "only \"function\" tools are supported",
            ));
        }
        let f = tool
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| bad(&format!("{p}.function"), "is required"))?;
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(&format!("{p}.function.name"), "is required"))?;
        let mut a = json!({
            "name": name,
            "input_schema": f.get("parameters").cloned().unwrap_or_else(|| json!({"type": "object", "properties": {}})),
        });
        if let Some(d) = f.get("description").and_then(Value::as_str) {
            a["description"] = json!(d);
        }
        out.push(a);
    }
    Ok(Value::Array(out))
}

fn tool_choice(tc: &Value) -> Result<Value, ApiError> {
    Ok(match tc {
        Value::String(s) => match s.as_str() {
            "auto" => json!({"type": "auto"}),
            "none" => json!({"type": "none"}),
            "required" => json!({"type": "any"}),
            _ => {
                return Err(bad(
                    "tool_choice",
                    "must be \"auto\", \"none\", \"required\" or a function",
                ));
            }
        },
        Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("function") => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| bad("tool_choice.function.name", "is required"))?;
            json!({"type": "tool", "name": name})
        }
        _ => {
            return Err(bad(
                "tool_choice",
                "must be \"auto\", \"none\", \"required\" or a function",
            ));
        }
    })
}

/// The text of a message's `content`: a string, or text parts (each may carry a breakpoint).
fn text_parts(
    content: &Value,
    p: &str,
    mark: &dyn Fn(&mut Map<String, Value>),
) -> Result<Vec<Value>, ApiError> {
    match content {
        Value::String(s) => Ok(vec![json!({"type": "text", "text": s})]),
        Value::Array(parts) => {
            let mut out = Vec::new();
            for (j, part) in parts.iter().enumerate() {
                let pp = format!("{p}.content[{j}]");
                let kind = part.get("type").and_then(Value::as_str).unwrap_or("");
                if kind != "text" {
                    return Err(bad(
                        &format!("{pp}.type"),
                        format!("\"{kind}\" content is not supported (text only)"),
                    ));
                }
                let text = part
                    .get("text")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad(&format!("{pp}.text"), "is required"))?;
                let mut block = Map::new();
                block.insert("type".into(), json!("text"));
                block.insert("text".into(), json!(text));
                if let Some(b) = part.get("prompt_cache_breakpoint").filter(|b| !b.is_null()) {
                    if b.get("mode").and_then(Value::as_str) != Some("explicit") {
                        return Err(bad(
                            &format!("{pp}.prompt_cache_breakpoint.mode"),
                            "must be \"explicit\"",
                        ));
                    }
                    mark(&mut block);
                }
                out.push(Value::Object(block));
            }
            Ok(out)
        }
        _ => Err(bad(
            &format!("{p}.content"),
            "must be a string or an array of parts",
        )),
    }
}

/// System prompt blocks and Messages turns. Tool results join the user turn that follows.
#[allow(clippy::type_complexity)]
fn messages(
    msgs: &[Value],
    mark: &dyn Fn(&mut Map<String, Value>),
) -> Result<(Vec<Value>, Vec<Value>), ApiError> {
    let mut system = Vec::new();
    let mut out: Vec<Value> = Vec::new();
    let push = |out: &mut Vec<Value>, role: &str, mut blocks: Vec<Value>| {
        if let Some(last) = out.last_mut()
            && last["role"] == role
        {
            last["content"]
                .as_array_mut()
                .expect("content is an array")
                .append(&mut blocks);
            return;
        }
        out.push(json!({"role": role, "content": blocks}));
    };
    for (i, m) in msgs.iter().enumerate() {
        let p = format!("messages[{i}]");
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(&format!("{p}.role"), "is required"))?;
        let content = m.get("content").filter(|c| !c.is_null());
        match role {
            "system" | "developer" => {
                if !out.is_empty() {
                    return Err(bad(
                        &format!("{p}.role"),
                        "system and developer messages must come before the conversation",
                    ));
                }
                let c = content.ok_or_else(|| bad(&format!("{p}.content"), "is required"))?;
                system.extend(text_parts(c, &p, mark)?);
            }
            "user" => {
                let c = content.ok_or_else(|| bad(&format!("{p}.content"), "is required"))?;
                let blocks = text_parts(c, &p, mark)?;
                push(&mut out, "user", blocks);
            }
            "assistant" => {
                let mut blocks = match content {
                    Some(c) => text_parts(c, &p, mark)?,
                    None => Vec::new(),
                };
                if let Some(calls) = m.get("tool_calls").filter(|c| !c.is_null()) {
                    blocks.extend(tool_calls(calls, &p)?);
                }
                if blocks.is_empty() {
                    return Err(bad(
                        &format!("{p}.content"),
                        "an assistant message needs content or tool_calls",
                    ));
                }
                push(&mut out, "assistant", blocks);
            }
            "tool" => {
                let id = m
                    .get("tool_call_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad(&format!("{p}.tool_call_id"), "is required"))?;
                let c = content.ok_or_else(|| bad(&format!("{p}.content"), "is required"))?;
                let text = text_parts(c, &p, mark)?;
                push(
                    &mut out,
                    "user",
                    vec![json!({"type": "tool_result", "tool_use_id": id, "content": text})],
                );
            }
            "function" => {
                return Err(bad(
                    &format!("{p}.role"),
                    "\"function\" messages are not supported; use tool",
                ));
            }
            other => {
                return Err(bad(
                    &format!("{p}.role"),
                    format!("unknown role \"{other}\""),
                ));
            }
        }
    }
    if out.is_empty() {
        return Err(bad("messages", "must contain at least one user message"));
    }
    Ok((system, out))
}

/// An assistant message's `tool_calls` (at `p`) as `tool_use` blocks.
fn tool_calls(calls: &Value, p: &str) -> Result<Vec<Value>, ApiError> {
    let mut blocks = Vec::new();
    let calls = calls
        .as_array()
        .ok_or_else(|| bad(&format!("{p}.tool_calls"), "must be an array"))?;
    for (j, c) in calls.iter().enumerate() {
        let cp = format!("{p}.tool_calls[{j}]");
        let id = c
            .get("id")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(&format!("{cp}.id"), "is required"))?;
        let f = c
            .get("function")
            .ok_or_else(|| bad(&format!("{cp}.function"), "is required"))?;
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(&format!("{cp}.function.name"), "is required"))?;
        let args = f.get("arguments").and_then(Value::as_str).unwrap_or("{}");
        let input: Value = serde_json::from_str(args).map_err(|_| {
            bad(
                &format!("{cp}.function.arguments"),
                "must be a JSON object encoded as a string",
            )
        })?;
        if !input.is_object() {
            return Err(bad(
                &format!("{cp}.function.arguments"),
                "must be a JSON object encoded as a string",
            ));
        }
        blocks.push(json!({"type": "tool_use", "id": id, "name": name, "input": input}));
    }
    Ok(blocks)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::openai::error_body;
    use crate::error::ErrorCode;

    fn conv(v: Value) -> Result<(Value, ChatOptions), ApiError> {
        to_messages(v.to_string().as_bytes(), |_| Some(8192), true)
    }

    #[test]
    fn a_plain_chat_becomes_the_messages_body_with_automatic_caching() {
        let (m, o) = conv(json!({
            "model": "sim-tiny",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "developer", "content": [{"type": "text", "text": "Cite."}]},
                {"role": "user", "content": "Hi"},
            ],
            "max_completion_tokens": 20, "temperature": 0.5, "stop": "END", "seed": 7,
            "stream": true, "stream_options": {"include_usage": true}, "user": "u1",
        }))
        .unwrap();
        assert_eq!(m["max_tokens"], 20);
        assert_eq!(m["cache_control"], json!({"type": "ephemeral"}));
        assert_eq!(
            m["system"],
            json!([{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Cite."}])
        );
        assert_eq!(
            m["messages"],
            json!([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
        );
        assert_eq!(m["stop_sequences"], json!(["END"]));
        assert!(o.stream && o.include_usage);
        assert_eq!(o.seed, Some(7));
        let (m, _) = conv(json!({"model": "x", "ignore_eos": true, "messages": [{"role": "user", "content": "Hi"}]})).unwrap();
        assert_eq!(m["ignore_eos"], true);
        // No max tokens: the model's limit.
        let (m, _) =
            conv(json!({"model": "x", "messages": [{"role": "user", "content": "Hi"}]})).unwrap();
        assert_eq!(m["max_tokens"], 8192);
    }

    #[test]
    fn tools_calls_and_results_map_onto_tool_use_and_tool_result() {
        let (m, _) = conv(json!({
            "model": "x",
            "tools": [{"type": "function", "function": {"name": "get", "description": "d", "parameters": {"type": "object"}}}],
            "tool_choice": "required",
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{\"city\":\"Oslo\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "rain"},
                {"role": "user", "content": "thanks"},
            ],
        }))
        .unwrap();
        assert_eq!(m["tools"][0]["input_schema"], json!({"type": "object"}));
        assert_eq!(m["tool_choice"], json!({"type": "any"}));
        assert_eq!(
            m["messages"][1]["content"][0]["input"],
            json!({"city": "Oslo"})
        );
        // The tool result and the next user text form one user turn.
        assert_eq!(m["messages"][2]["content"][0]["type"], "tool_result");
        assert_eq!(m["messages"][2]["content"][1]["text"], "thanks");
        assert_eq!(m["messages"].as_array().unwrap().len(), 3);
    }

    #[test]
    fn cache_options_map_onto_breakpoints_and_ttls() {
        let marked = json!([{"type": "text", "text": "doc", "prompt_cache_breakpoint": {"mode": "explicit"}}]);
        let (m, _) = conv(
            json!({"model": "x", "prompt_cache_options": {"mode": "explicit", "ttl": "30m"},
            "messages": [{"role": "system", "content": marked}, {"role": "user", "content": "q"}]}),
        )
        .unwrap();
        assert!(m.get("cache_control").is_none());
        assert_eq!(
            m["system"][0]["cache_control"],
            json!({"type": "ephemeral", "ttl": "1h"})
        );
        let (m, _) = conv(json!({"model": "x", "prompt_cache_retention": "in_memory",
            "messages": [{"role": "user", "content": "q"}]}))
        .unwrap();
        assert_eq!(m["cache_control"], json!({"type": "ephemeral"}));
        // A tenant without 1h gets 5m for 24h retention.
        let body = json!({"model": "x", "prompt_cache_retention": "24h", "messages": [{"role": "user", "content": "q"}]});
        let (m, o) = to_messages(body.to_string().as_bytes(), |_| Some(1), false).unwrap();
        assert_eq!(m["cache_control"], json!({"type": "ephemeral"}));
        assert_eq!(o.hold, None, "no long TTLs: no 24h hold");
        let (m, o) = to_messages(body.to_string().as_bytes(), |_| Some(1), true).unwrap();
        assert_eq!(
            m["cache_control"],
            json!({"type": "ephemeral", "ttl": "1h"})
        );
        assert_eq!(o.hold, Some(RETENTION_24H), "kept a day, billed as 1h");
        let thirty = json!({"model": "x", "prompt_cache_options": {"ttl": "30m"},
            "messages": [{"role": "user", "content": "q"}]});
        assert_eq!(conv(thirty).unwrap().1.hold, None);
    }

    #[test]
    fn what_cachet_cannot_honour_is_a_400_naming_the_field() {
        let base = |extra: Value| {
            let mut v = json!({"model": "x", "messages": [{"role": "user", "content": "q"}]});
            for (k, x) in extra.as_object().unwrap() {
                v[k] = x.clone();
            }
            conv(v).unwrap_err()
        };
        for (extra, param) in [
            (json!({"n": 2}), "n"),
            (json!({"logprobs": true}), "logprobs"),
            (
                json!({"response_format": {"type": "json_object"}}),
                "response_format",
            ),
            (json!({"frequency_penalty": 0.5}), "frequency_penalty"),
            (
                json!({"prompt_cache_retention": "7d"}),
                "prompt_cache_retention",
            ),
            (
                json!({"prompt_cache_retention": "24h", "prompt_cache_options": {"ttl": "30m"}}),
                "prompt_cache_options.ttl",
            ),
            (
                json!({"stream_options": {"include_usage": true}}),
                "stream_options",
            ),
            (
                json!({"max_tokens": 5, "max_completion_tokens": 5}),
                "max_tokens",
            ),
            (json!({"temperature": 3}), "temperature"),
        ] {
            let e = base(extra.clone());
            assert_eq!(e.code, ErrorCode::InvalidRequest, "{extra}");
            let (_, body) = error_body(&e);
            assert_eq!(body["error"]["param"], param, "{extra}: {}", e.message);
            assert_eq!(body["error"]["type"], "invalid_request_error");
        }
        let e = base(json!({"bogus": 1}));
        assert_eq!(e.message, "Unrecognized request argument supplied: bogus");
        // Neutral values of unsupported fields pass.
        conv(json!({"model": "x", "n": 1, "frequency_penalty": 0, "logprobs": false, "messages": [{"role": "user", "content": "q"}]})).unwrap();
        let img = conv(json!({"model": "x", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]})).unwrap_err();
        assert!(
            img.message.starts_with("messages[0].content[0].type:"),
            "{}",
            img.message
        );
        let late = conv(json!({"model": "x", "messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "s"}]})).unwrap_err();
        assert!(late.message.starts_with("messages[1].role:"));
    }
}
