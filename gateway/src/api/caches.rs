//! Cache objects on the API-key surface: `POST /v1/caches` computes a prefix once and holds
//! it, `GET /v1/caches` lists a workspace's objects, `GET`, `PATCH` and `DELETE
//! /v1/caches/{id}` read, extend and delete one; a Messages or Chat Completions request
//! names an object in `cached_content` and sends only what follows it (`resolve`).
//!
//! An object is a row (`control::caches`: its content as validated, its expiry) plus a paid
//! entry in the fabric held until it expires. Creating one is a `max_tokens: 0` request with
//! one breakpoint at the content's end, billed as a 1h cache write; using one renders the
//! object's content followed by the request's messages with a breakpoint at the object's end,
//! so the prefix is read from the cache (or computed again, billed as a 1h write, if its KV
//! is gone) exactly as a request sending that content with a breakpoint would read it.

use std::collections::HashMap;
use std::time::Duration;

use axum::Extension;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use cache_fabric::{EntryKind, FabricClient, Holding, PrefixKeys, WriteRefused};
use cachet_common::{BlockHash, RequestId, Scope};
use chrono::{DateTime, Utc};
use control::caches::{self as store, CacheObject, Lifetime, MIN_TTL};
use control::release;
use control::tenants::{Actor, AdminError, Principal};
use serde::Serialize;
use serde_json::{Map, Value, json};
use sqlx::PgPool;
use utoipa::ToSchema;

use crate::api::stages::{self, ObjectUse, Shaped, object_breakpoint};
use crate::error::{ApiError, ErrorCode};
use crate::state::AppState;
use crate::wire::types::{CACHED_CONTENT, ErrorBody};
use crate::wire::validate::{self, BlockRef};

/// How long an object is held when its creation names no TTL.
pub const DEFAULT_TTL: Duration = Duration::from_secs(3600);
/// Objects per page when a list names no limit.
const DEFAULT_PAGE: i64 = 20;

/// `POST /v1/caches` body (documentation: the handler reads the JSON itself, with
/// field-naming errors).
#[derive(Serialize, ToSchema)]
pub struct CreateCacheRequest {
    /// The model the prefix is computed for; requests using the object must name it too.
    pub model: String,
    /// Tool definitions, as in a Messages request.
    #[schema(value_type = Option<Vec<Object>>)]
    pub tools: Option<Value>,
    /// The system prompt, as in a Messages request.
    #[schema(value_type = Option<Object>)]
    pub system: Option<Value>,
    /// Messages that begin every conversation using the object.
    #[schema(value_type = Option<Vec<Object>>)]
    pub messages: Option<Value>,
    /// How long the object is held: `"300s"`, `"30m"`, `"24h"`, `"7d"` or a number of
    /// seconds; from 5 minutes to the organization's maximum (`max_cache_ttl_secs`, a day by
    /// default). Default 1 hour.
    #[schema(value_type = Option<String>)]
    pub ttl: Option<Value>,
    /// Instead of `ttl`: when the object expires (RFC 3339).
    pub expires_at: Option<DateTime<Utc>>,
    pub display_name: Option<String>,
}

/// `PATCH /v1/caches/{id}` body: exactly one of the two.
#[derive(Serialize, ToSchema)]
pub struct UpdateCacheRequest {
    /// A new TTL from now (see `CreateCacheRequest::ttl`).
    #[schema(value_type = Option<String>)]
    pub ttl: Option<Value>,
    /// A new expiry (RFC 3339).
    pub expires_at: Option<DateTime<Utc>>,
}

/// A page of cache objects, newest first.
#[derive(Serialize, ToSchema)]
pub struct CacheObjectList {
    pub data: Vec<CacheObject>,
    pub has_more: bool,
    pub first_id: Option<String>,
    pub last_id: Option<String>,
}

/// `DELETE /v1/caches/{id}` answer.
#[derive(Serialize, ToSchema)]
pub struct DeletedCacheObject {
    pub id: String,
    /// Always `cache_object_deleted`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// Bytes of the object's blocks dropped from every tier of the nodes that have released
    /// it (no other entry of the workspace held them).
    pub bytes_freed: u64,
    /// Bytes of its blocks those nodes still hold for other entries of the workspace (a
    /// request that wrote the same prefix at a breakpoint, another object), now only as long
    /// as those need.
    pub bytes_held: u64,
    /// Live nodes that had not released it when this answer was sent: each does when the
    /// change feed reaches it, or at its next start (empty when every node has).
    pub nodes_pending: Vec<String>,
}

/// A TTL or expiry the client got wrong (a 400 naming the field).
fn lifetime_error(e: AdminError) -> ApiError {
    ApiError::from_service("reading a cache object's lifetime", &e)
}

fn store_error(context: &str, e: AdminError) -> ApiError {
    ApiError::from_service(context, &e)
}

fn scope_of(p: &Principal) -> Scope {
    Scope {
        tenant: p.tenant,
        workspace: p.workspace,
    }
}

/// The longest TTL `p`'s tenant allows.
fn max_ttl(p: &Principal) -> Duration {
    Duration::from_secs(p.policy.max_cache_ttl_secs.max(300) as u64)
}

/// A request body that names a cache object, merged with the object's content; the body
/// unchanged (and `None`) when it names none. Another scope's object, an expired or a
/// deleted one is a 404; `tools` or `system` beside it a 400 naming the field.
pub(crate) async fn resolve(
    pool: &PgPool,
    principal: &Principal,
    body: Bytes,
) -> Result<(Bytes, Option<ObjectUse>), ApiError> {
    if memchr::memmem::find(&body, b"\"cached_content\"").is_none() {
        return Ok((body, None));
    }
    // A body that does not parse gets the validator's own error.
    let Ok(mut v) = serde_json::from_slice::<Value>(&body) else {
        return Ok((body, None));
    };
    let Some(top) = v.as_object_mut() else {
        return Ok((body, None));
    };
    let id = match top.remove(CACHED_CONTENT) {
        None => return Ok((body, None)),
        Some(Value::Null) => return Ok((reserialize(&v), None)),
        Some(Value::String(s)) => s,
        Some(_) => {
            return Err(ApiError::invalid(
                "cached_content: Input should be a valid string (a cache object id)",
            ));
        }
    };
    for f in ["tools", "system"] {
        if top.get(f).is_some_and(|x| !x.is_null()) {
            return Err(ApiError::invalid(format!(
                "{f}: cannot be sent with cached_content; the cache object {id} holds the request's tools and system prompt"
            )));
        }
    }
    let object = store::get(pool, scope_of(principal), &id)
        .await
        .map_err(|e| match e {
            AdminError::NotFound(_) => ApiError::new(
                ErrorCode::NotFound,
                format!(
                    "cached_content: no cache object {id} (it may have expired or been deleted)"
                ),
            ),
            e => store_error("loading a cache object failed", e),
        })?;
    if let Some(m) = top.get("model").and_then(Value::as_str)
        && m != object.model
    {
        return Err(ApiError::invalid(format!(
            "model: the cache object {id} holds a prefix for {}; name that model",
            object.model
        )));
    }
    let end = end_of(&object.content)
        .ok_or_else(|| ApiError::internal("a stored cache object has no content", &id))?;
    merge(top, &object.content);
    crate::metrics::CACHE_OBJECT_OPS
        .with_label_values(&["used"])
        .inc();
    let hold = (object.expires_at - Utc::now())
        .to_std()
        .unwrap_or(MIN_TTL)
        .max(Duration::from_secs(1));
    Ok((
        reserialize(&v),
        Some(ObjectUse {
            id,
            input_tokens: object.input_tokens.max(0) as u64,
            end,
            hold,
        }),
    ))
}

fn reserialize(v: &Value) -> Bytes {
    Bytes::from(serde_json::to_vec(v).expect("a JSON value serializes"))
}

/// Content blocks of a message's `content` (a string is one text block).
fn as_blocks(c: Value) -> Vec<Value> {
    match c {
        Value::String(s) => vec![json!({"type": "text", "text": s})],
        Value::Array(a) => a,
        other => vec![other],
    }
}

/// The object's tools, system prompt and messages before the request's messages. A first
/// request message in the same role as the object's last one continues it (roles alternate),
/// which keeps every token of the object's prefix where it was.
fn merge(top: &mut Map<String, Value>, content: &Value) {
    for f in ["tools", "system"] {
        if let Some(x) = content.get(f) {
            top.insert(f.into(), x.clone());
        }
    }
    let mut msgs: Vec<Value> = content
        .get("messages")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let merged = match top.remove("messages") {
        Some(Value::Array(mut req)) => {
            let role = |m: &Value| m.get("role").and_then(Value::as_str).map(str::to_string);
            if let (Some(last), Some(first)) = (msgs.last_mut(), req.first())
                && role(first).is_some()
                && role(last) == role(first)
                && first.get("content").is_some()
            {
                let mut first = req.remove(0);
                let mut blocks = as_blocks(last["content"].take());
                blocks.extend(as_blocks(first["content"].take()));
                last["content"] = Value::Array(blocks);
            }
            msgs.extend(req);
            Value::Array(msgs)
        }
        // Not an array: the validator names the error.
        Some(other) => other,
        None => Value::Array(msgs),
    };
    top.insert("messages".into(), merged);
}

/// The last content block of an object's content (messages, else system, else tools).
fn end_of(content: &Value) -> Option<BlockRef> {
    if let Some(ms) = content.get("messages").and_then(Value::as_array)
        && let Some(last) = ms.last()
    {
        let n = match last.get("content") {
            Some(Value::Array(a)) => a.len(),
            Some(_) => 1,
            None => 0,
        };
        return n.checked_sub(1).map(|j| BlockRef::Message(ms.len() - 1, j));
    }
    match content.get("system") {
        Some(Value::String(_)) => return Some(BlockRef::System(0)),
        Some(Value::Array(a)) if !a.is_empty() => return Some(BlockRef::System(a.len() - 1)),
        _ => {}
    }
    match content.get("tools") {
        Some(Value::Array(a)) if !a.is_empty() => Some(BlockRef::Tool(a.len() - 1)),
        _ => None,
    }
}

/// Remove every `cache_control` marker: an object is one prefix, held as a whole.
fn strip_markers(content: &mut Map<String, Value>) {
    let unmark = |v: &mut Value| {
        if let Some(o) = v.as_object_mut() {
            o.remove("cache_control");
        }
    };
    if let Some(Value::Array(tools)) = content.get_mut("tools") {
        tools.iter_mut().for_each(unmark);
    }
    if let Some(Value::Array(blocks)) = content.get_mut("system") {
        blocks.iter_mut().for_each(unmark);
    }
    if let Some(Value::Array(msgs)) = content.get_mut("messages") {
        for m in msgs {
            if let Some(Value::Array(blocks)) = m.get_mut("content") {
                blocks.iter_mut().for_each(unmark);
            }
        }
    }
}

/// A creation body, read: the model, the content (markers removed), the lifetime, the name.
struct Asked {
    model: String,
    content: Value,
    lifetime: Lifetime,
    display_name: Option<String>,
}

const CREATE_FIELDS: &[&str] = &[
    "model",
    "tools",
    "system",
    "messages",
    "ttl",
    "expires_at",
    "display_name",
];

fn parse_create(body: &[u8]) -> Result<Asked, ApiError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::invalid(format!(
            "We could not parse the JSON body of your request: {e}"
        ))
    })?;
    let Value::Object(top) = v else {
        return Err(ApiError::invalid("the request body must be a JSON object"));
    };
    if let Some(k) = top.keys().find(|k| !CREATE_FIELDS.contains(&k.as_str())) {
        return Err(ApiError::invalid(format!(
            "{k}: Extra inputs are not permitted"
        )));
    }
    let model = top
        .get("model")
        .ok_or_else(|| ApiError::invalid("model: Field required"))?
        .as_str()
        .ok_or_else(|| ApiError::invalid("model: Input should be a valid string"))?
        .to_string();
    let mut content = Map::new();
    for f in ["tools", "system", "messages"] {
        if let Some(x) = top.get(f).filter(|x| !x.is_null()) {
            content.insert(f.into(), x.clone());
        }
    }
    strip_markers(&mut content);
    let display_name = match top.get("display_name") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s.chars().count() <= 256 => Some(s.clone()),
        Some(Value::String(_)) => {
            return Err(ApiError::invalid("display_name: at most 256 characters"));
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "display_name: Input should be a valid string",
            ));
        }
    };
    Ok(Asked {
        model,
        content: Value::Object(content),
        lifetime: Lifetime::from_body(&top, Some(DEFAULT_TTL)).map_err(lifetime_error)?,
        display_name,
    })
}

/// An object's content validated and rendered with its one breakpoint at its end.
async fn shape(
    engines: &crate::engines::EnginePool,
    principal: &Principal,
    model: &str,
    content: &Value,
    hold: Duration,
) -> Result<Shaped, ApiError> {
    let mut body = content.as_object().cloned().unwrap_or_default();
    body.insert("model".into(), json!(model));
    body.insert("max_tokens".into(), json!(0));
    body.entry("messages").or_insert_with(|| json!([]));
    let bytes = serde_json::to_vec(&body).expect("a JSON value serializes");
    let (req, _) = validate::object_content(&bytes, |m| stages::model_limits(engines, m))?;
    let end = end_of(content).ok_or_else(|| {
        ApiError::invalid(
            "messages: a cache object needs content: tools, a system prompt or messages, ending in a content block",
        )
    })?;
    let large = bytes.len() > stages::INLINE_RENDER_BYTES;
    let bp = object_breakpoint("content", end, hold);
    let (engine, prepared) = stages::render_for(engines, principal, &req, vec![bp], large).await?;
    Ok(Shaped {
        req,
        engine,
        prepared,
        object: None,
    })
}

/// Hold the entry ending at `offset` as paid for `hold` (blocks already held longer keep
/// their time).
async fn hold_entry(
    fabric: &FabricClient,
    scope: Scope,
    keys: &PrefixKeys,
    offset: usize,
    hold: Duration,
) -> Result<(), WriteRefused> {
    let holding = Holding {
        ttl: hold,
        kind: EntryKind::Object,
    };
    fabric
        .write_entry(
            scope,
            keys,
            offset,
            &[],
            holding,
            tokio::time::Instant::now(),
        )
        .await
}

/// Why the cache could not hold an object's write, as the client's error.
fn refusal(reason: Option<&str>) -> ApiError {
    match reason {
        Some("quota") => ApiError::new(
            ErrorCode::RateLimit,
            "the cache object does not fit in this organization's cache quota (cache_resident_bytes); delete objects or ask its administrator for more",
        ),
        r => ApiError::overloaded(format!(
            "the cache cannot hold the object now ({}); try again later",
            r.unwrap_or("capacity")
        )),
    }
}

#[utoipa::path(
    post, path = "/v1/caches", tag = "caches",
    request_body = CreateCacheRequest,
    responses(
        (status = 200, description = "The object, held", body = CacheObject),
        (status = 400, description = "Invalid content, TTL out of range, or content below the model's minimum cacheable length", body = ErrorBody),
        (status = 401, description = "Missing or invalid API key", body = ErrorBody),
        (status = 403, description = "The organization does not allow 1h cache writes", body = ErrorBody),
        (status = 429, description = "Rate limited, or over the organization's cache quota", body = ErrorBody),
        (status = 529, description = "The cache cannot hold it now", body = ErrorBody),
    ),
    security(("api_key" = []), ("bearer" = []))
)]
pub async fn create_cache(
    State(state): State<AppState>,
    Extension(rid): Extension<RequestId>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match create_inner(&state, rid, &headers, body).await {
        Ok(o) => axum::Json(o).into_response(),
        Err(e) => e.with_request_id(rid).into_response(),
    }
}

async fn create_inner(
    state: &AppState,
    rid: RequestId,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<CacheObject, ApiError> {
    let start = tokio::time::Instant::now();
    let started_at = Utc::now();
    let body = stages::body_bytes(body)?;
    let principal = state.auth.authenticate(headers).await?;
    let asked = parse_create(&body)?;
    drop(body);
    let expires_at = asked
        .lifetime
        .expires_at(started_at, max_ttl(&principal))
        .map_err(lifetime_error)?;
    if !principal.policy.allow_1h_ttl {
        return Err(ApiError::new(
            ErrorCode::Permission,
            "a cache object is written as a 1h cache write, which this organization's administrator does not allow",
        ));
    }
    let hold = (expires_at - started_at).to_std().unwrap_or(MIN_TTL);
    let shaped = shape(
        &state.engines,
        &principal,
        &asked.model,
        &asked.content,
        hold,
    )
    .await?;
    let end = &shaped.prepared.placed[0];
    if !end.cacheable {
        return Err(ApiError::invalid(format!(
            "messages: the content is {} tokens, below {}'s minimum cacheable length of {} tokens",
            end.offset,
            asked.model,
            shaped.engine.info().min_cacheable_tokens
        )));
    }
    let offset = end.offset;
    let keys = shaped.prepared.keys.clone();
    let started = stages::start_generation(
        state,
        rid,
        principal.clone(),
        shaped,
        stages::Asked::default(),
        (start, started_at),
    )
    .await?;
    let mut rx = started.rx;
    stages::collect_answer(&mut rx).await?;
    let bp = started.report.breakpoints.first();
    if !bp.is_some_and(|b| matches!(b.status.as_str(), "written" | "read" | "coalesced")) {
        crate::metrics::CACHE_OBJECT_OPS
            .with_label_values(&["refused"])
            .inc();
        return Err(refusal(bp.and_then(|b| b.reason.as_deref())));
    }
    let scope = scope_of(&principal);
    if let Some(keys) = &keys {
        // Held for the object's life even where the prefix was already cached for less.
        hold_entry(&state.fabric, scope, keys, offset, hold)
            .await
            .map_err(|r| refusal(Some(r.as_str())))?;
    }
    let blocks: Vec<BlockHash> = keys
        .as_ref()
        .and_then(|k| k.chain_to(offset))
        .map(|links| links.iter().map(|l| l.hash).collect())
        .unwrap_or_default();
    let id = store::new_id().map_err(|e| store_error("making a cache object id failed", e))?;
    crate::metrics::CACHE_OBJECT_OPS
        .with_label_values(&["created"])
        .inc();
    store::insert(
        &state.pool,
        store::NewObject {
            id: &id,
            scope,
            key: principal.key_id,
            model: &asked.model,
            content: &asked.content,
            input_tokens: offset as i64,
            display_name: asked.display_name.as_deref(),
            request_id: rid.0,
            created_at: started_at,
            expires_at,
            blocks: &blocks,
        },
    )
    .await
    .map_err(|e| store_error("storing a cache object failed", e))
}

#[utoipa::path(
    get, path = "/v1/caches", tag = "caches",
    params(
        ("limit" = Option<i64>, Query, description = "Objects per page, 1 to 1000 (default 20)"),
        ("after_id" = Option<String>, Query, description = "The page after (older than) this object"),
        ("before_id" = Option<String>, Query, description = "The page before (newer than) this object"),
    ),
    responses(
        (status = 200, description = "The workspace's live objects, newest first", body = CacheObjectList),
        (status = 400, description = "Bad paging parameters", body = ErrorBody),
        (status = 401, description = "Missing or invalid API key", body = ErrorBody),
    ),
    security(("api_key" = []), ("bearer" = []))
)]
pub async fn list_caches(
    State(state): State<AppState>,
    Extension(rid): Extension<RequestId>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let r: Result<Response, ApiError> = async {
        let principal = state.auth.authenticate(&headers).await?;
        if let Some(k) = q
            .keys()
            .find(|k| !["limit", "after_id", "before_id"].contains(&k.as_str()))
        {
            return Err(ApiError::invalid(format!(
                "{k}: not a parameter of this list (limit, after_id, before_id)"
            )));
        }
        let limit = match q.get("limit") {
            None => DEFAULT_PAGE,
            Some(l) => l
                .parse::<i64>()
                .ok()
                .filter(|l| (1..=1000).contains(l))
                .ok_or_else(|| ApiError::invalid("limit: must be a whole number from 1 to 1000"))?,
        };
        let page = store::Page {
            before_id: q.get("before_id").cloned(),
            after_id: q.get("after_id").cloned(),
            limit,
        };
        let listed = store::list(&state.pool, scope_of(&principal), &page)
            .await
            .map_err(|e| store_error("listing cache objects failed", e))?;
        Ok(axum::Json(CacheObjectList {
            first_id: listed.data.first().map(|o| o.id.clone()),
            last_id: listed.data.last().map(|o| o.id.clone()),
            has_more: listed.has_more,
            data: listed.data,
        })
        .into_response())
    }
    .await;
    r.unwrap_or_else(|e| e.with_request_id(rid).into_response())
}

#[utoipa::path(
    get, path = "/v1/caches/{cache_id}", tag = "caches",
    params(("cache_id" = String, Path, description = "Object id")),
    responses(
        (status = 200, description = "The object", body = CacheObject),
        (status = 404, description = "No live object of this workspace has this id", body = ErrorBody),
    ),
    security(("api_key" = []), ("bearer" = []))
)]
pub async fn get_cache(
    State(state): State<AppState>,
    Extension(rid): Extension<RequestId>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let r: Result<CacheObject, ApiError> = async {
        let principal = state.auth.authenticate(&headers).await?;
        store::get(&state.pool, scope_of(&principal), &id)
            .await
            .map_err(|e| store_error("reading a cache object failed", e))
    }
    .await;
    match r {
        Ok(o) => axum::Json(o).into_response(),
        Err(e) => e.with_request_id(rid).into_response(),
    }
}

#[utoipa::path(
    patch, path = "/v1/caches/{cache_id}", tag = "caches",
    params(("cache_id" = String, Path, description = "Object id")),
    request_body = UpdateCacheRequest,
    responses(
        (status = 200, description = "The object with its new expiry", body = CacheObject),
        (status = 400, description = "TTL out of range", body = ErrorBody),
        (status = 404, description = "No live object of this workspace has this id", body = ErrorBody),
    ),
    security(("api_key" = []), ("bearer" = []))
)]
pub async fn update_cache(
    State(state): State<AppState>,
    Extension(rid): Extension<RequestId>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match update_inner(&state, &id, &headers, body).await {
        Ok(o) => axum::Json(o).into_response(),
        Err(e) => e.with_request_id(rid).into_response(),
    }
}

async fn update_inner(
    state: &AppState,
    id: &str,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<CacheObject, ApiError> {
    let now = Utc::now();
    let body = stages::body_bytes(body)?;
    let principal = state.auth.authenticate(headers).await?;
    let v: Value = serde_json::from_slice(&body).map_err(|e| {
        ApiError::invalid(format!(
            "We could not parse the JSON body of your request: {e}"
        ))
    })?;
    let top = v
        .as_object()
        .ok_or_else(|| ApiError::invalid("the request body must be a JSON object"))?;
    if let Some(k) = top
        .keys()
        .find(|k| !["ttl", "expires_at"].contains(&k.as_str()))
    {
        return Err(ApiError::invalid(format!(
            "{k}: Extra inputs are not permitted (an object's content cannot change; create another)"
        )));
    }
    let expires_at = Lifetime::from_body(top, None)
        .and_then(|l| l.expires_at(now, max_ttl(&principal)))
        .map_err(lifetime_error)?;
    let scope = scope_of(&principal);
    let current = store::get(&state.pool, scope, id)
        .await
        .map_err(|e| store_error("reading a cache object failed", e))?;
    let hold = (expires_at - now).to_std().unwrap_or(MIN_TTL);
    let shaped = shape(
        &state.engines,
        &principal,
        &current.model,
        &current.content,
        hold,
    )
    .await?;
    let o = store::set_expiry(&state.pool, scope, id, expires_at)
        .await
        .map_err(|e| store_error("extending a cache object failed", e))?;
    crate::metrics::CACHE_OBJECT_OPS
        .with_label_values(&["extended"])
        .inc();
    if let Some(keys) = &shaped.prepared.keys {
        let offset = shaped.prepared.placed[0].offset;
        if let Err(r) = hold_entry(&state.fabric, scope, keys, offset, hold).await {
            // The KV is gone (expired under the old TTL, or a node lost it): the next
            // request naming the object computes it again and holds it until `expires_at`.
            tracing::info!(tenant_id = %scope.tenant, cache_object = %o.id, reason = r.as_str(),
                "an extended cache object's KV is not held; the next use recomputes it");
        }
    }
    Ok(o)
}

#[utoipa::path(
    delete, path = "/v1/caches/{cache_id}", tag = "caches",
    params(("cache_id" = String, Path, description = "Object id")),
    responses(
        (status = 200, description = "Deleted: requests naming it now get 404", body = DeletedCacheObject),
        (status = 404, description = "No live object of this workspace has this id", body = ErrorBody),
    ),
    security(("api_key" = []), ("bearer" = []))
)]
pub async fn delete_cache(
    State(state): State<AppState>,
    Extension(rid): Extension<RequestId>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let r: Result<DeletedCacheObject, ApiError> = async {
        let principal = state.auth.authenticate(&headers).await?;
        let actor = Actor::api_key(principal.key_id, rid.to_string());
        let o = store::delete(&state.pool, &actor, scope_of(&principal), &id)
            .await
            .map_err(|e| store_error("deleting a cache object failed", e))?;
        crate::metrics::CACHE_OBJECT_OPS
            .with_label_values(&["deleted"])
            .inc();
        let fabric = state.fabric.clone();
        let outcome = release::released_everywhere(
            &state.pool,
            Some(&state.fabric),
            move || fabric.live_nodes(),
            &o.id,
        )
        .await;
        Ok(DeletedCacheObject {
            id: o.id,
            kind: "cache_object_deleted",
            bytes_freed: outcome.released.bytes_freed,
            bytes_held: outcome.released.bytes_held,
            nodes_pending: outcome.pending,
        })
    }
    .await;
    match r {
        Ok(d) => axum::Json(d).into_response(),
        Err(e) => e.with_request_id(rid).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_objects_end_is_its_last_content_block() {
        let c = json!({"tools": [{}, {}], "system": "s", "messages": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": [{"type": "text", "text": "b"}, {"type": "text", "text": "c"}]}
        ]});
        assert_eq!(end_of(&c), Some(BlockRef::Message(1, 1)));
        assert_eq!(
            end_of(&json!({"tools": [{}], "system": [{"type": "text", "text": "x"}]})),
            Some(BlockRef::System(0))
        );
        assert_eq!(end_of(&json!({"tools": [{}, {}]})), Some(BlockRef::Tool(1)));
        assert_eq!(end_of(&json!({})), None);
        assert_eq!(
            end_of(&json!({"messages": [{"role": "user", "content": []}]})),
            None
        );
    }

    #[test]
    fn a_request_continues_the_objects_last_message_in_the_same_role() {
        let content = json!({"system": "s", "messages": [{"role": "user", "content": "doc"}]});
        let mut top = json!({"model": "m", "messages": [
            {"role": "user", "content": [{"type": "text", "text": "q", "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": "a"}
        ]});
        merge(top.as_object_mut().unwrap(), &content);
        assert_eq!(top["system"], json!("s"));
        assert_eq!(
            top["messages"],
            json!([
                {"role": "user", "content": [{"type": "text", "text": "doc"},
                    {"type": "text", "text": "q", "cache_control": {"type": "ephemeral"}}]},
                {"role": "assistant", "content": "a"}
            ])
        );
        // The object's end is where it was.
        assert_eq!(end_of(&content), Some(BlockRef::Message(0, 0)));
        let mut other = json!({"messages": [{"role": "assistant", "content": "x"}]});
        merge(other.as_object_mut().unwrap(), &content);
        assert_eq!(other["messages"].as_array().unwrap().len(), 2);
    }

    #[test]
    fn markers_in_an_objects_content_are_removed() {
        let body = json!({"model": "m", "system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}],
            "tools": [{"name": "t", "input_schema": {}, "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "d", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}]});
        let asked = parse_create(body.to_string().as_bytes()).unwrap();
        assert!(
            !asked.content.to_string().contains("cache_control"),
            "{}",
            asked.content
        );
        assert_eq!(asked.lifetime, Lifetime::Ttl(DEFAULT_TTL));
        let e = parse_create(br#"{"model": "m", "cache_control": {"type": "ephemeral"}}"#)
            .err()
            .unwrap();
        assert!(
            e.message.starts_with("cache_control: Extra inputs"),
            "{}",
            e.message
        );
    }
}
