//! Request validation with Anthropic's error texts, in Anthropic's order:
//! 1. structure and types (pydantic-style `path: message` texts), including the shape of
//!    every `cache_control`;
//! 2. at most 4 breakpoints, counting the automatic one;
//! 3. a `1h` breakpoint never after a `5m` one, in tools → system → messages order;
//! 4. no marker on thinking blocks or empty text blocks;
//! 5. everything else (model, roles, `max_tokens` range, content the model cannot take).
//!
//! Only then is the JSON deserialized into the typed request.

use cachet_common::Ttl;
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::wire::types::{CountTokensRequest, MessagesRequest};

/// Which content block a breakpoint marks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockRef {
    Tool(usize),
    System(usize),
    Message(usize, usize),
}

/// A validated cache breakpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Breakpoint {
    pub location: String,
    pub block: BlockRef,
    /// The TTL class: what the write is billed as, and how long it is kept unless `hold`
    /// says longer.
    pub ttl: Ttl,
    pub automatic: bool,
    /// Kept this long instead of the TTL class's duration (OpenAI's 24-hour retention, billed
    /// as a 1h write); `None` for every Messages breakpoint.
    pub hold: Option<std::time::Duration>,
    /// A cache object's own breakpoint: its write is the object's hold, released when the
    /// object is deleted ([`cache_fabric::EntryKind::Object`]).
    pub object: bool,
}

impl Breakpoint {
    /// How long the cache keeps what this breakpoint writes (refreshed by reads).
    pub fn held_for(&self) -> std::time::Duration {
        self.hold.unwrap_or(self.ttl.duration())
    }

    /// The TTL as the cache report names it: `5m`, `1h`, or the hold (`24h`).
    pub fn ttl_label(&self) -> String {
        match self.hold {
            Some(h) if h.as_secs() % 3600 == 0 => format!("{}h", h.as_secs() / 3600),
            Some(h) => format!("{}s", h.as_secs()),
            None => self.ttl.as_str().to_string(),
        }
    }
}

/// Limits of the model the request names.
pub struct ModelLimits {
    pub max_output_tokens: u32,
}

const MESSAGES_FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "messages",
    "system",
    "tools",
    "tool_choice",
    "cache_control",
    "stop_sequences",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "metadata",
    "thinking",
    "service_tier",
    "container",
    "diagnostics",
    "inference_geo",
    "output_config",
    "speed",
    "user_profile_id",
    // Cachet extension: generate exactly `max_tokens` (load tests).
    "ignore_eos",
    "workspace_id",
    "mcp_servers",
    "context_management",
];
const COUNT_FIELDS: &[&str] = &[
    "model",
    "messages",
    "system",
    "tools",
    "tool_choice",
    "cache_control",
    "thinking",
    "output_config",
    "mcp_servers",
    "context_management",
    "speed",
];

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

fn err(path: &str, msg: &str) -> ApiError {
    ApiError::invalid(if path.is_empty() {
        msg.to_string()
    } else {
        format!("{path}: {msg}")
    })
}

fn as_obj<'a>(v: &'a Value, path: &str) -> Result<&'a Map<String, Value>, ApiError> {
    v.as_object()
        .ok_or_else(|| err(path, "Input should be a valid dictionary"))
}

fn no_extra(m: &Map<String, Value>, allowed: &[&str], path: &str) -> Result<(), ApiError> {
    match m.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(k) => Err(err(&join(path, k), "Extra inputs are not permitted")),
        None => Ok(()),
    }
}

fn required<'a>(m: &'a Map<String, Value>, key: &str, path: &str) -> Result<&'a Value, ApiError> {
    m.get(key)
        .ok_or_else(|| err(&join(path, key), "Field required"))
}

fn as_str<'a>(v: &'a Value, path: &str) -> Result<&'a str, ApiError> {
    v.as_str()
        .ok_or_else(|| err(path, "Input should be a valid string"))
}

fn as_array<'a>(v: &'a Value, path: &str) -> Result<&'a Vec<Value>, ApiError> {
    v.as_array()
        .ok_or_else(|| err(path, "Input should be a valid list"))
}

fn opt<'a>(m: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    m.get(key).filter(|v| !v.is_null())
}

fn check_u32(v: &Value, path: &str) -> Result<u32, ApiError> {
    match v.as_u64() {
        Some(n) => u32::try_from(n)
            .map_err(|_| err(path, "Input should be less than or equal to 4294967295")),
        None if v.as_i64().is_some() => {
            Err(err(path, "Input should be greater than or equal to 0"))
        }
        None => Err(err(path, "Input should be a valid integer")),
    }
}

fn check_number(v: &Value, path: &str, lo: f64, hi: f64) -> Result<(), ApiError> {
    let x = v
        .as_f64()
        .ok_or_else(|| err(path, "Input should be a valid number"))?;
    if x < lo {
        return Err(err(
            path,
            &format!("Input should be greater than or equal to {lo}"),
        ));
    }
    if x > hi {
        return Err(err(
            path,
            &format!("Input should be less than or equal to {hi}"),
        ));
    }
    Ok(())
}

/// Shape of a `cache_control` value at `path` (the path of the field itself).
fn cache_control(v: Option<&Value>, path: &str) -> Result<Option<Ttl>, ApiError> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let m = as_obj(v, path)?;
    no_extra(m, &["type", "ttl"], path)?;
    let t = required(m, "type", path)?;
    if t.as_str() != Some("ephemeral") {
        return Err(err(&join(path, "type"), "Input should be 'ephemeral'"));
    }
    match opt(m, "ttl") {
        None => Ok(Some(Ttl::FiveMinutes)),
        Some(t) => match t.as_str() {
            Some("5m") => Ok(Some(Ttl::FiveMinutes)),
            Some("1h") => Ok(Some(Ttl::OneHour)),
            _ => Err(err(&join(path, "ttl"), "Input should be '5m' or '1h'")),
        },
    }
}

/// One content block as the walker sees it.
struct BlockInfo {
    path: String,
    block: BlockRef,
    kind: &'static str,
    /// Thinking blocks and empty text blocks cannot carry a marker.
    cacheable: bool,
    marker: Option<Ttl>,
}

struct Walk {
    blocks: Vec<BlockInfo>,
    roles: Vec<String>,
    /// Content types the model cannot take, with their path.
    unsupported: Option<(String, String)>,
    empty_text: Option<String>,
    misplaced: Option<(String, String, String)>,
}

fn text_block(
    m: &Map<String, Value>,
    path: &str,
    allow_cc: bool,
) -> Result<(bool, Option<Ttl>), ApiError> {
    let allowed: &[&str] = if allow_cc {
        &["type", "text", "cache_control", "citations"]
    } else {
        &["type", "text", "citations"]
    };
    no_extra(m, allowed, path)?;
    let text = as_str(required(m, "text", path)?, &join(path, "text"))?;
    let cc = cache_control(m.get("cache_control"), &join(path, "cache_control"))?;
    Ok((!text.is_empty(), cc))
}

fn walk_content_block(
    v: &Value,
    path: &str,
    block: BlockRef,
    role: &str,
    w: &mut Walk,
) -> Result<(), ApiError> {
    let m = as_obj(v, path)?;
    let kind = as_str(required(m, "type", path)?, &join(path, "type"))?;
    let cc_path = join(path, "cache_control");
    let (kind, cacheable, marker): (&'static str, bool, Option<Ttl>) = match kind {
        "text" => {
            let (non_empty, cc) = text_block(m, path, true)?;
            if !non_empty && w.empty_text.is_none() {
                w.empty_text = Some(join(path, "text"));
            }
            ("text", non_empty, cc)
        }
        "tool_use" => {
            no_extra(
                m,
                &["type", "id", "name", "input", "cache_control", "caller"],
                path,
            )?;
            as_str(required(m, "id", path)?, &join(path, "id"))?;
            as_str(required(m, "name", path)?, &join(path, "name"))?;
            as_obj(required(m, "input", path)?, &join(path, "input"))?;
            (
                "tool_use",
                true,
                cache_control(m.get("cache_control"), &cc_path)?,
            )
        }
        "tool_result" => ("tool_result", true, tool_result(m, path, &cc_path, w)?),
        "thinking" | "redacted_thinking" => thinking(m, path, kind)?,
        "image"
        | "document"
        | "search_result"
        | "container_upload"
        | "server_tool_use"
        | "web_search_tool_result" => {
            w.unsupported
                .get_or_insert((join(path, "type"), kind.to_string()));
            ("unsupported", false, None)
        }
        other => {
            return Err(err(
                &join(path, "type"),
                &format!(
                    "Input tag '{other}' found using 'type' does not match any of the expected tags: 'text', 'image', \
                     'document', 'search_result', 'tool_use', 'tool_result', 'thinking', 'redacted_thinking'"
                ),
            ));
        }
    };
    let wrong_role = match kind {
        "tool_use" | "thinking" | "redacted_thinking" => role != "assistant",
        "tool_result" => role != "user",
        _ => false,
    };
    if wrong_role && w.misplaced.is_none() {
        w.misplaced = Some((path.to_string(), kind.to_string(), role.to_string()));
    }
    w.blocks.push(BlockInfo {
        path: path.to_string(),
        block,
        kind,
        cacheable,
        marker,
    });
    Ok(())
}

/// A `tool_result` block's fields (its text parts; other parts noted as unsupported); its
/// marker.
fn tool_result(
    m: &Map<String, Value>,
    path: &str,
    cc_path: &str,
    w: &mut Walk,
) -> Result<Option<Ttl>, ApiError> {
    no_extra(
        m,
        &[
            "type",
            "tool_use_id",
            "content",
            "is_error",
            "cache_control",
        ],
        path,
    )?;
    as_str(
        required(m, "tool_use_id", path)?,
        &join(path, "tool_use_id"),
    )?;
    if let Some(c) = opt(m, "content") {
        let cpath = join(path, "content");
        if !c.is_string() {
            for (j, item) in as_array(c, &cpath)?.iter().enumerate() {
                let ipath = format!("{cpath}.{j}");
                let im = as_obj(item, &ipath)?;
                let ik = as_str(required(im, "type", &ipath)?, &join(&ipath, "type"))?;
                if ik != "text" {
                    w.unsupported
                        .get_or_insert((join(&ipath, "type"), ik.to_string()));
                    continue;
                }
                text_block(im, &ipath, true)?;
            }
        }
    }
    if let Some(e) = opt(m, "is_error") {
        e.as_bool()
            .ok_or_else(|| err(&join(path, "is_error"), "Input should be a valid boolean"))?;
    }
    cache_control(m.get("cache_control"), cc_path)
}

/// A `thinking` or `redacted_thinking` block: never cacheable; a marker on it is reported in
/// phase 4 (noted with a placeholder TTL).
fn thinking(
    m: &Map<String, Value>,
    path: &str,
    kind: &str,
) -> Result<(&'static str, bool, Option<Ttl>), ApiError> {
    let is_thinking = kind == "thinking";
    let field = if is_thinking { "thinking" } else { "data" };
    let marker = m.contains_key("cache_control");
    let allowed: &[&str] = if is_thinking {
        &["type", "thinking", "signature", "cache_control"]
    } else {
        &["type", "data", "cache_control"]
    };
    no_extra(m, allowed, path)?;
    as_str(required(m, field, path)?, &join(path, field))?;
    // A marker here is reported in phase 4; note it with a placeholder TTL.
    let k = if is_thinking {
        "thinking"
    } else {
        "redacted_thinking"
    };
    Ok((k, false, if marker { Some(Ttl::FiveMinutes) } else { None }))
}

fn walk_common(top: &Map<String, Value>) -> Result<Walk, ApiError> {
    let mut w = Walk {
        blocks: Vec::new(),
        roles: Vec::new(),
        unsupported: None,
        empty_text: None,
        misplaced: None,
    };
    as_str(required(top, "model", "")?, "model")?;
    if let Some(tools) = opt(top, "tools") {
        for (i, t) in as_array(tools, "tools")?.iter().enumerate() {
            w.blocks.push(tool(t, i)?);
        }
    }
    if let Some(system) = opt(top, "system")
        && !system.is_string()
    {
        for (i, b) in as_array(system, "system")?.iter().enumerate() {
            let path = format!("system.{i}");
            let m = as_obj(b, &path)?;
            let kind = as_str(required(m, "type", &path)?, &join(&path, "type"))?;
            if kind != "text" {
                return Err(err(&join(&path, "type"), "Input should be 'text'"));
            }
            let (non_empty, marker) = text_block(m, &path, true)?;
            if !non_empty && w.empty_text.is_none() {
                w.empty_text = Some(join(&path, "text"));
            }
            w.blocks.push(BlockInfo {
                path,
                block: BlockRef::System(i),
                kind: "text",
                cacheable: non_empty,
                marker,
            });
        }
    }
    let messages = as_array(required(top, "messages", "")?, "messages")?;
    for (i, msg) in messages.iter().enumerate() {
        let path = format!("messages.{i}");
        let m = as_obj(msg, &path)?;
        no_extra(m, &["role", "content"], &path)?;
        let role = required(m, "role", &path)?;
        let role = match role.as_str() {
            Some(r @ ("user" | "assistant")) => r,
            _ => {
                return Err(err(
                    &join(&path, "role"),
                    "Input should be 'user' or 'assistant'",
                ));
            }
        };
        w.roles.push(role.to_string());
        walk_message_content(required(m, "content", &path)?, &path, i, role, &mut w)?;
    }
    Ok(w)
}

/// Tool `i`'s definition, as a block of the prompt.
fn tool(t: &Value, i: usize) -> Result<BlockInfo, ApiError> {
    let path = format!("tools.{i}");
    let m = as_obj(t, &path)?;
    no_extra(
        m,
        &[
            "name",
            "description",
            "input_schema",
            "cache_control",
            "type",
            "strict",
            "input_examples",
        ],
        &path,
    )?;
    if let Some(k) = opt(m, "type") {
        let k = as_str(k, &join(&path, "type"))?;
        if k != "custom" {
            return Err(err(
                &join(&path, "type"),
                &format!("tool type '{k}' is not supported by Cachet models"),
            ));
        }
    }
    as_str(required(m, "name", &path)?, &join(&path, "name"))?;
    if let Some(d) = opt(m, "description") {
        as_str(d, &join(&path, "description"))?;
    }
    as_obj(
        required(m, "input_schema", &path)?,
        &join(&path, "input_schema"),
    )?;
    let marker = cache_control(m.get("cache_control"), &join(&path, "cache_control"))?;
    Ok(BlockInfo {
        path,
        block: BlockRef::Tool(i),
        kind: "tool",
        cacheable: true,
        marker,
    })
}

/// Message `i`'s content (at `path`): a string, or its blocks walked.
fn walk_message_content(
    content: &Value,
    path: &str,
    i: usize,
    role: &str,
    w: &mut Walk,
) -> Result<(), ApiError> {
    let cpath = join(path, "content");
    match content {
        Value::String(s) => {
            if s.is_empty() && w.empty_text.is_none() {
                w.empty_text = Some(cpath.clone());
            }
            w.blocks.push(BlockInfo {
                path: format!("{cpath}.0"),
                block: BlockRef::Message(i, 0),
                kind: "text",
                cacheable: !s.is_empty(),
                marker: None,
            });
        }
        Value::Array(items) => {
            for (j, b) in items.iter().enumerate() {
                walk_content_block(b, &format!("{cpath}.{j}"), BlockRef::Message(i, j), role, w)?;
            }
        }
        _ => {
            return Err(err(
                &cpath,
                "Input should be a valid string or a valid list",
            ));
        }
    }
    Ok(())
}

/// Phases 2–4: breakpoints counted, ordered and placed; the automatic one added.
fn breakpoints(w: &Walk, top: &Map<String, Value>) -> Result<Vec<Breakpoint>, ApiError> {
    let automatic = cache_control(top.get("cache_control"), "cache_control")?;
    let explicit = w.blocks.iter().filter(|b| b.marker.is_some()).count();
    let mut auto_at: Option<usize> = None;
    if let Some(ttl) = automatic
        && let Some(idx) = w.blocks.iter().rposition(|b| b.cacheable)
    {
        match w.blocks[idx].marker {
            None => auto_at = Some(idx),
            Some(t) if t == ttl => {}
            Some(t) => {
                return Err(ApiError::invalid(format!(
                    "cache_control.ttl: the top-level cache_control ttl '{}' differs from the ttl '{}' of the \
                         cache_control already on the last cacheable block ({})",
                    ttl.as_str(),
                    t.as_str(),
                    w.blocks[idx].path
                )));
            }
        }
    }
    let total = explicit + usize::from(auto_at.is_some());
    if total > 4 {
        return Err(ApiError::invalid(format!(
            "A maximum of 4 blocks with cache_control may be provided. Found {total}."
        )));
    }
    let mut seen_5m = false;
    for (i, b) in w.blocks.iter().enumerate() {
        let ttl = if auto_at == Some(i) {
            automatic
        } else {
            b.marker
        };
        match ttl {
            Some(Ttl::FiveMinutes) => seen_5m = true,
            Some(Ttl::OneHour) if seen_5m => {
                let p = if auto_at == Some(i) {
                    "cache_control".to_string()
                } else {
                    join(&b.path, "cache_control")
                };
                return Err(ApiError::invalid(format!(
                    "{p}.ttl: a ttl='1h' cache_control block must not come after a ttl='5m' cache_control block. \
                     Note that blocks are processed in the following order: `tools`, `system`, `messages`."
                )));
            }
            _ => {}
        }
    }
    for b in &w.blocks {
        if b.marker.is_some() && !b.cacheable {
            return Err(match b.kind {
                "thinking" => err(
                    &format!("{}.thinking.cache_control", b.path),
                    "Extra inputs are not permitted",
                ),
                "redacted_thinking" => err(
                    &format!("{}.redacted_thinking.cache_control", b.path),
                    "Extra inputs are not permitted",
                ),
                _ => err(
                    &join(&b.path, "text"),
                    "cache_control cannot be set for empty text blocks",
                ),
            });
        }
    }
    Ok(w.blocks
        .iter()
        .enumerate()
        .filter_map(|(i, b)| {
            let (ttl, automatic) = if auto_at == Some(i) {
                (automatic?, true)
            } else {
                (b.marker?, false)
            };
            Some(Breakpoint {
                location: b.path.clone(),
                block: b.block,
                ttl,
                automatic,
                hold: None,
                object: false,
            })
        })
        .collect())
}

/// Whether a body must hold at least one message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Messages {
    /// A request: something for the model to answer.
    Required,
    /// A cache object's content: tools or a system prompt alone are a prefix too.
    Optional,
}

/// Phase 5 checks shared by both endpoints.
fn semantics(w: &Walk, model: &str, messages: Messages) -> Result<(), ApiError> {
    if w.roles.is_empty() && messages == Messages::Optional {
        return semantics_of_content(w, model);
    }
    if w.roles.is_empty() {
        return Err(err(
            "messages",
            "List should have at least 1 item after validation, not 0",
        ));
    }
    if w.roles[0] != "user" {
        return Err(err("messages", "first message must use the \"user\" role"));
    }
    for pair in w.roles.windows(2) {
        if pair[0] == pair[1] {
            return Err(err(
                "messages",
                &format!(
                    "roles must alternate between \"user\" and \"assistant\", but found multiple \"{}\" roles in a row",
                    pair[0]
                ),
            ));
        }
    }
    semantics_of_content(w, model)
}

/// Phase 5 checks of the content blocks themselves.
fn semantics_of_content(w: &Walk, model: &str) -> Result<(), ApiError> {
    if let Some((path, role_kind, role)) = &w.misplaced {
        return Err(err(
            path,
            &format!("'{role_kind}' blocks are not allowed in a \"{role}\" message"),
        ));
    }
    if let Some(p) = &w.empty_text {
        return Err(err(p, "text content blocks must be non-empty"));
    }
    if let Some((path, kind)) = &w.unsupported {
        return Err(err(
            path,
            &format!("model '{model}' does not accept '{kind}' content; only text is supported"),
        ));
    }
    Ok(())
}

fn parse_body(body: &[u8]) -> Result<Value, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("request body is not valid JSON: {e}")))
}

fn typed<T: serde::de::DeserializeOwned>(v: Value) -> Result<T, ApiError> {
    serde_json::from_value(v).map_err(|e| ApiError::invalid(format!("invalid request: {e}")))
}

/// `tool_choice` and `thinking` as Anthropic checks them, and tool blocks that need `tools`.
/// `max_tokens` is the request's (none for `count_tokens`).
fn tools_and_thinking(
    top: &Map<String, Value>,
    w: &Walk,
    max_tokens: Option<u32>,
) -> Result<(), ApiError> {
    let tool_names: Vec<&str> = opt(top, "tools")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(|t| t.get("name")?.as_str()).collect())
        .unwrap_or_default();
    if tool_names.is_empty()
        && let Some(b) = w
            .blocks
            .iter()
            .find(|b| matches!(b.kind, "tool_use" | "tool_result"))
    {
        return Err(err(
            &b.path,
            "Requests which include `tool_use` or `tool_result` blocks must define tools.",
        ));
    }
    if let Some(tc) = opt(top, "tool_choice") {
        let m = as_obj(tc, "tool_choice")?;
        let kind = as_str(required(m, "type", "tool_choice")?, "tool_choice.type")?;
        let allowed: &[&str] = match kind {
            "auto" | "any" => &["type", "disable_parallel_tool_use"],
            "tool" => &["type", "name", "disable_parallel_tool_use"],
            "none" => &["type"],
            other => {
                return Err(err(
                    "tool_choice.type",
                    &format!(
                        "Input tag '{other}' found using 'type' does not match any of the expected tags: 'auto', 'any', 'tool', 'none'"
                    ),
                ));
            }
        };
        no_extra(m, allowed, "tool_choice")?;
        if let Some(d) = opt(m, "disable_parallel_tool_use")
            && !d.is_boolean()
        {
            return Err(err(
                "tool_choice.disable_parallel_tool_use",
                "Input should be a valid boolean",
            ));
        }
        if matches!(kind, "any" | "tool") && tool_names.is_empty() {
            return Err(err(
                "tool_choice",
                "tool_choice may only be specified while providing tools",
            ));
        }
        if kind == "tool" {
            let name = as_str(required(m, "name", "tool_choice")?, "tool_choice.name")?;
            if !tool_names.contains(&name) {
                return Err(err(
                    "tool_choice.name",
                    &format!("no tool named '{name}' is among the request's tools"),
                ));
            }
        }
    }
    if let Some(t) = opt(top, "thinking") {
        let m = as_obj(t, "thinking")?;
        match as_str(required(m, "type", "thinking")?, "thinking.type")? {
            "disabled" | "adaptive" => no_extra(m, &["type"], "thinking")?,
            "enabled" => {
                no_extra(m, &["type", "budget_tokens"], "thinking")?;
                let path = "thinking.enabled.budget_tokens";
                let b = required(m, "budget_tokens", "thinking.enabled")?;
                let Some(n) = b.as_i64().filter(|_| b.is_i64() || b.is_u64()) else {
                    return Err(err(path, "Input should be a valid integer"));
                };
                if n < 1024 {
                    return Err(err(path, "Input should be greater than or equal to 1024"));
                }
                if let Some(mt) = max_tokens
                    && n >= i64::from(mt)
                {
                    return Err(err(
                        "max_tokens",
                        "`max_tokens` must be greater than `thinking.budget_tokens`",
                    ));
                }
            }
            other => {
                return Err(err(
                    "thinking.type",
                    &format!(
                        "Input tag '{other}' found using 'type' does not match any of the expected tags: 'enabled', 'disabled', 'adaptive'"
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Validate a `POST /v1/messages` body. `limits` looks up a model by id.
pub fn messages_request(
    body: &[u8],
    limits: impl Fn(&str) -> Option<ModelLimits>,
) -> Result<(MessagesRequest, Vec<Breakpoint>), ApiError> {
    messages_body(body, limits, Messages::Required)
}

/// Validate a cache object's content, given as a Messages body (`max_tokens` 0): as a
/// request, except that tools or a system prompt alone are content too.
pub fn object_content(
    body: &[u8],
    limits: impl Fn(&str) -> Option<ModelLimits>,
) -> Result<(MessagesRequest, Vec<Breakpoint>), ApiError> {
    messages_body(body, limits, Messages::Optional)
}

fn messages_body(
    body: &[u8],
    limits: impl Fn(&str) -> Option<ModelLimits>,
    messages: Messages,
) -> Result<(MessagesRequest, Vec<Breakpoint>), ApiError> {
    let v = parse_body(body)?;
    let top = as_obj(&v, "")?;
    no_extra(top, MESSAGES_FIELDS, "")?;
    let max_tokens = check_u32(required(top, "max_tokens", "")?, "max_tokens")?;
    let w = walk_common(top)?;
    if let Some(s) = opt(top, "stop_sequences") {
        for (i, x) in as_array(s, "stop_sequences")?.iter().enumerate() {
            as_str(x, &format!("stop_sequences.{i}"))?;
        }
    }
    let stream = match opt(top, "stream") {
        Some(s) => s
            .as_bool()
            .ok_or_else(|| err("stream", "Input should be a valid boolean"))?,
        None => false,
    };
    if let Some(t) = opt(top, "temperature") {
        check_number(t, "temperature", 0.0, 1.0)?;
    }
    if let Some(t) = opt(top, "top_p") {
        check_number(t, "top_p", 0.0, 1.0)?;
    }
    if let Some(t) = opt(top, "top_k") {
        check_u32(t, "top_k")?;
    }
    if let Some(x) = opt(top, "metadata") {
        as_obj(x, "metadata")?;
    }
    if let Some(x) = opt(top, "diagnostics") {
        let d = as_obj(x, "diagnostics")?;
        if let Some(p) = d.get("previous_message_id").filter(|p| !p.is_null())
            && !p.is_string()
        {
            return Err(err(
                "diagnostics.previous_message_id",
                "Input should be a valid string",
            ));
        }
    }
    tools_and_thinking(top, &w, Some(max_tokens))?;
    let bps = breakpoints(&w, top)?;
    let model = top["model"].as_str().unwrap_or_default();
    let Some(lim) = limits(model) else {
        return Err(err(
            "model",
            &format!("unknown model '{model}'; GET /v1/models lists the available models"),
        ));
    };
    if max_tokens > lim.max_output_tokens {
        return Err(err(
            "max_tokens",
            &format!(
                "{max_tokens} > {}, which is the maximum allowed number of output tokens for {model}",
                lim.max_output_tokens
            ),
        ));
    }
    if max_tokens == 0 && stream {
        return Err(err(
            "max_tokens",
            "max_tokens: 0 (cache pre-warming) cannot be used with stream: true",
        ));
    }
    semantics(&w, model, messages)?;
    Ok((typed(v)?, bps))
}

/// Validate a `POST /v1/messages/count_tokens` body.
pub fn count_tokens_request(
    body: &[u8],
    known: impl Fn(&str) -> bool,
) -> Result<(CountTokensRequest, Vec<Breakpoint>), ApiError> {
    let v = parse_body(body)?;
    let top = as_obj(&v, "")?;
    no_extra(top, COUNT_FIELDS, "")?;
    let w = walk_common(top)?;
    tools_and_thinking(top, &w, None)?;
    let bps = breakpoints(&w, top)?;
    let model = top["model"].as_str().unwrap_or_default();
    if !known(model) {
        return Err(err(
            "model",
            &format!("unknown model '{model}'; GET /v1/models lists the available models"),
        ));
    }
    semantics(&w, model, Messages::Required)?;
    Ok((typed(v)?, bps))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn check(body: Value) -> Result<Vec<Breakpoint>, String> {
        messages_request(body.to_string().as_bytes(), |m| {
            (m == "sim-tiny").then_some(ModelLimits {
                max_output_tokens: 4096,
            })
        })
        .map(|(_, b)| b)
        .map_err(|e| e.message)
    }

    fn base() -> Value {
        json!({"model": "sim-tiny", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]})
    }

    fn cc(ttl: &str) -> Value {
        json!({"type": "ephemeral", "ttl": ttl})
    }

    #[test]
    fn tool_choice_thinking_and_tool_blocks_are_checked_like_anthropic() {
        let tools = json!([{"name": "lookup", "input_schema": {"type": "object"}}]);
        let refused = |patch: Value, want: &str| {
            let mut b = base();
            for (k, v) in patch.as_object().unwrap() {
                b[k] = v.clone();
            }
            let e = check(b).expect_err(want);
            assert!(e.contains(want), "{e} lacks {want}");
        };
        refused(
            json!({"tool_choice": {"type": "weird"}}),
            "does not match any of the expected tags",
        );
        refused(
            json!({"tool_choice": {"type": "tool", "name": "nope"}, "tools": tools}),
            "no tool named 'nope'",
        );
        refused(
            json!({"tool_choice": {"type": "any"}}),
            "only be specified while providing tools",
        );
        refused(
            json!({"tool_choice": {"type": "auto", "x": 1}}),
            "tool_choice.x: Extra inputs",
        );
        refused(
            json!({"thinking": {"type": "enabled", "budget_tokens": -5}}),
            "greater than or equal to 1024",
        );
        refused(
            json!({"thinking": {"type": "enabled", "budget_tokens": "x"}}),
            "valid integer",
        );
        refused(
            json!({"thinking": {"type": "enabled", "budget_tokens": 2048}}),
            "`max_tokens` must be greater",
        );
        refused(
            json!({"thinking": {"type": "sometimes"}}),
            "does not match any of the expected tags",
        );
        refused(
            json!({"messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "42"}]}
            ]}),
            "must define tools",
        );
        // And what Anthropic accepts still passes.
        let mut ok = base();
        ok["tools"] = tools.clone();
        ok["tool_choice"] =
            json!({"type": "tool", "name": "lookup", "disable_parallel_tool_use": true});
        ok["max_tokens"] = json!(4000);
        ok["thinking"] = json!({"type": "enabled", "budget_tokens": 1024});
        check(ok).unwrap();
        let mut ok = base();
        ok["tool_choice"] = json!({"type": "auto"});
        ok["thinking"] = json!({"type": "disabled"});
        check(ok).unwrap();
    }

    #[test]
    fn breakpoints_are_listed_in_tools_system_messages_order() {
        let mut b = base();
        b["tools"] =
            json!([{"name": "t", "input_schema": {"type": "object"}, "cache_control": cc("1h")}]);
        b["system"] =
            json!([{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}]);
        b["messages"] = json!([{"role": "user", "content": [{"type": "text", "text": "q", "cache_control": cc("5m")}]}]);
        let bps = check(b).unwrap();
        let locs: Vec<_> = bps.iter().map(|b| (b.location.as_str(), b.ttl)).collect();
        assert_eq!(
            locs,
            vec![
                ("tools.0", Ttl::OneHour),
                ("system.0", Ttl::FiveMinutes),
                ("messages.0.content.0", Ttl::FiveMinutes)
            ]
        );
    }

    #[test]
    fn exact_texts_for_cache_control_errors() {
        let mut b = base();
        b["system"] =
            json!([{"type": "text", "text": "s", "cache_control": {"type": "persistent"}}]);
        assert_eq!(
            check(b).unwrap_err(),
            "system.0.cache_control.type: Input should be 'ephemeral'"
        );

        let mut b = base();
        b["system"] = json!([{"type": "text", "text": "s", "cache_control": {"type": "ephemeral", "ttl": "10m"}}]);
        assert_eq!(
            check(b).unwrap_err(),
            "system.0.cache_control.ttl: Input should be '5m' or '1h'"
        );

        let mut b = base();
        b["system"] = json!([{"type": "text", "text": "s", "cache_control": {"type": "ephemeral", "scope": "x"}}]);
        assert_eq!(
            check(b).unwrap_err(),
            "system.0.cache_control.scope: Extra inputs are not permitted"
        );

        let mut b = base();
        b["cache_control"] = json!({"type": "ephemeral"});
        b["system"] = json!([
            {"type": "text", "text": "a", "cache_control": cc("5m")},
            {"type": "text", "text": "b", "cache_control": cc("5m")},
            {"type": "text", "text": "c", "cache_control": cc("5m")},
            {"type": "text", "text": "d", "cache_control": cc("5m")}
        ]);
        assert_eq!(
            check(b).unwrap_err(),
            "A maximum of 4 blocks with cache_control may be provided. Found 5."
        );

        let mut b = base();
        b["system"] = json!([{"type": "text", "text": "a", "cache_control": cc("5m")}]);
        b["messages"] = json!([{"role": "user", "content": [
            {"type": "text", "text": "x"},
            {"type": "text", "text": "y", "cache_control": cc("1h")}
        ]}]);
        assert_eq!(
            check(b).unwrap_err(),
            "messages.0.content.1.cache_control.ttl: a ttl='1h' cache_control block must not come after a ttl='5m' \
             cache_control block. Note that blocks are processed in the following order: `tools`, `system`, `messages`."
        );

        let mut b = base();
        b["messages"] = json!([
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s", "cache_control": cc("5m")}]},
            {"role": "user", "content": "r"}
        ]);
        assert_eq!(
            check(b).unwrap_err(),
            "messages.1.content.0.thinking.cache_control: Extra inputs are not permitted"
        );

        let mut b = base();
        b["messages"] = json!([{"role": "user", "content": [{"type": "text", "text": "", "cache_control": cc("5m")}]}]);
        assert_eq!(
            check(b).unwrap_err(),
            "messages.0.content.0.text: cache_control cannot be set for empty text blocks"
        );
    }

    #[test]
    fn automatic_marker_goes_on_the_last_cacheable_block_and_counts() {
        let mut b = base();
        b["cache_control"] = json!({"type": "ephemeral", "ttl": "1h"});
        b["messages"] = json!([
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "thinking", "thinking": "t", "signature": "s"}]},
        ]);
        let bps = check(b).unwrap();
        assert_eq!(bps.len(), 1);
        assert_eq!(bps[0].location, "messages.1.content.0");
        assert!(bps[0].automatic);
        // Same TTL as an explicit marker on the last block: a no-op, not a second breakpoint.
        let mut b = base();
        b["cache_control"] = json!({"type": "ephemeral"});
        b["messages"] = json!([{"role": "user", "content": [{"type": "text", "text": "q", "cache_control": {"type": "ephemeral"}}]}]);
        assert_eq!(check(b).unwrap().len(), 1);
    }

    #[test]
    fn malformed_requests_name_the_field() {
        let cases: Vec<(Value, &str)> = vec![
            (
                json!({"max_tokens": 1, "messages": []}),
                "model: Field required",
            ),
            (
                json!({"model": "sim-tiny", "messages": []}),
                "max_tokens: Field required",
            ),
            (
                json!({"model": 5, "max_tokens": 1, "messages": []}),
                "model: Input should be a valid string",
            ),
            (
                json!({"model": "sim-tiny", "max_tokens": "x", "messages": []}),
                "max_tokens: Input should be a valid integer",
            ),
            (
                json!({"model": "sim-tiny", "max_tokens": -1, "messages": []}),
                "max_tokens: Input should be greater than or equal to 0",
            ),
            (
                json!({"model": "sim-tiny", "max_tokens": 1, "messages": []}),
                "messages: List should have at least 1 item after validation, not 0",
            ),
            (
                json!({"model": "nope", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}),
                "model: unknown model 'nope'; GET /v1/models lists the available models",
            ),
            (
                json!({"model": "sim-tiny", "max_tokens": 99999, "messages": [{"role": "user", "content": "x"}]}),
                "max_tokens: 99999 > 4096, which is the maximum allowed number of output tokens for sim-tiny",
            ),
            (
                json!({"model": "sim-tiny", "max_tokens": 1, "messages": [{"role": "assistant", "content": "x"}]}),
                "messages: first message must use the \"user\" role",
            ),
            (
                json!({"model": "sim-tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]}),
                "messages: roles must alternate between \"user\" and \"assistant\", but found multiple \"user\" roles in a row",
            ),
            (
                json!({"model": "sim-tiny", "max_tokens": 1, "messages": [{"role": "system", "content": "x"}]}),
                "messages.0.role: Input should be 'user' or 'assistant'",
            ),
            (
                json!({"model": "sim-tiny", "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
                "messages.0.content.0.type: model 'sim-tiny' does not accept 'image' content; only text is supported",
            ),
            (
                json!({"model": "sim-tiny", "max_tokens": 1, "messages": [{"role": "user", "content": 7}]}),
                "messages.0.content: Input should be a valid string or a valid list",
            ),
            (
                json!({"model": "sim-tiny", "max_tokens": 1, "bogus": 1, "messages": [{"role": "user", "content": "x"}]}),
                "bogus: Extra inputs are not permitted",
            ),
            (
                json!({"model": "sim-tiny", "max_tokens": 0, "stream": true, "messages": [{"role": "user", "content": "x"}]}),
                "max_tokens: max_tokens: 0 (cache pre-warming) cannot be used with stream: true",
            ),
            (
                json!({"model": "sim-tiny", "max_tokens": 1, "temperature": 2, "messages": [{"role": "user", "content": "x"}]}),
                "temperature: Input should be less than or equal to 1",
            ),
            (json!([1, 2]), "Input should be a valid dictionary"),
        ];
        for (body, want) in cases {
            assert_eq!(check(body.clone()).unwrap_err(), want, "body: {body}");
        }
        let e = messages_request(b"{not json", |_| None).unwrap_err();
        assert!(e.message.starts_with("request body is not valid JSON"));
    }
}
