//! Handlers of `/v1/messages`, `/v1/messages/count_tokens` and `/v1/models`.

use std::convert::Infallible;
use std::sync::Arc;

use axum::Extension;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use cachet_common::{RequestId, Scope};
use futures::StreamExt;
use serde_json::json;
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::admission::RateHeaders;
use crate::api::caches;
use crate::api::openai;
use crate::api::stages::{
    Asked, INLINE_RENDER_BYTES, Shaped, Started, body_bytes, check_version, collect_answer,
    model_limits, render_for, start_generation,
};
use crate::error::{ApiError, ErrorCode};
use crate::pipeline::Event;
use crate::render;
use crate::state::AppState;
use crate::wire::types::*;
use crate::wire::validate;

fn with_rate_headers(mut resp: Response, rate: &RateHeaders) -> Response {
    for (k, v) in &rate.0 {
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(k.as_bytes()),
            HeaderValue::from_str(v),
        ) {
            resp.headers_mut().insert(n, v);
        }
    }
    resp
}

#[utoipa::path(
    post, path = "/v1/messages", tag = "messages",
    request_body = MessagesRequest,
    responses(
        (status = 200, description = "A message (or, with `stream: true`, an SSE stream of message events)", body = MessageResponse),
        (status = 400, description = "Invalid request", body = ErrorBody),
        (status = 401, description = "Missing or invalid API key", body = ErrorBody),
        (status = 413, description = "Body over 32 MB", body = ErrorBody),
        (status = 429, description = "Rate limited", body = ErrorBody),
        (status = 529, description = "Overloaded", body = ErrorBody),
    ),
    security(("api_key" = []), ("bearer" = []))
)]
pub async fn create_message(
    State(state): State<AppState>,
    Extension(rid): Extension<RequestId>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match create_message_inner(state, rid, headers, body).await {
        Ok(r) => r,
        Err(e) => e.with_request_id(rid).into_response(),
    }
}

async fn create_message_inner(
    state: AppState,
    rid: RequestId,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let start = tokio::time::Instant::now();
    let started_at = chrono::Utc::now();
    let body = body_bytes(body)?;
    check_version(&headers)?;
    let principal = state.auth.authenticate(&headers).await?;
    let shaped = prepare_messages(&state.engines, &state.pool, &principal, body).await?;
    let Started {
        req,
        usage,
        report,
        rate,
        diagnostics,
        mut rx,
    } = start_generation(
        &state,
        rid,
        principal,
        shaped,
        Asked {
            diagnose: crate::diagnostics::requested(&headers),
            ..Asked::default()
        },
        (start, started_at),
    )
    .await?;
    let model = req.model.clone();
    if req.stream {
        Ok(with_rate_headers(
            stream_response(rid, model, usage, report, diagnostics, rx),
            &rate,
        ))
    } else {
        let (text, stop, output) = collect_answer(&mut rx).await?;
        let mut usage = usage;
        usage.output_tokens = output;
        let content = if req.max_tokens == 0 {
            Vec::new()
        } else {
            vec![ResponseBlock::Text { text }]
        };
        let resp = MessageResponse {
            id: rid.message_id(),
            kind: "message".into(),
            role: "assistant".into(),
            model,
            content,
            stop_reason: Some(stop.as_str().into()),
            stop_sequence: match stop {
                engine::StopReason::StopSequence(s) => Some(s),
                _ => None,
            },
            usage,
            cachet: report,
            diagnostics,
        };
        Ok(with_rate_headers(axum::Json(resp).into_response(), &rate))
    }
}

/// Validate a Messages body and render it for `principal`'s scope (with the content of the
/// cache object it names, if any). Shared by the serving pipeline and the routing gateway,
/// so both see the same keys.
pub(crate) async fn prepare_messages(
    engines: &crate::engines::EnginePool,
    pool: &sqlx::PgPool,
    principal: &control::tenants::Principal,
    body: Bytes,
) -> Result<Shaped, ApiError> {
    let (body, object) = caches::resolve(pool, principal, body).await?;
    let (req, mut bps) = validate::messages_request(&body, |m| model_limits(engines, m))?;
    if !principal.policy.allow_1h_ttl
        && let Some(bp) = bps.iter().find(|b| b.ttl == cachet_common::Ttl::OneHour)
    {
        return Err(ApiError::new(
            ErrorCode::Permission,
            format!(
                "{}: a 1h cache TTL is not allowed for this organization by its administrator; use \"5m\"",
                bp.location
            ),
        ));
    }
    if let Some(o) = &object {
        // The object's end comes before every block the request sent.
        bps.insert(0, o.breakpoint());
    }
    let large = body.len() > INLINE_RENDER_BYTES;
    drop(body);
    let (engine, prepared) = render_for(engines, principal, &req, bps, large).await?;
    Ok(Shaped {
        req,
        engine,
        prepared,
        object,
    })
}

fn sse(name: &str, data: serde_json::Value) -> Result<SseEvent, Infallible> {
    Ok(SseEvent::default().event(name).data(data.to_string()))
}

/// message_start, content_block_start, ping, content_block_delta…, content_block_stop,
/// message_delta (cumulative usage), message_stop. An error after the 200 is an `error` event.
fn stream_response(
    rid: RequestId,
    model: String,
    usage: Usage,
    report: CacheReport,
    diagnostics: Option<serde_json::Value>,
    rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
) -> Response {
    let mut start = json!({
        "type": "message_start",
        "message": {
            "id": rid.message_id(), "type": "message", "role": "assistant", "content": [], "model": model,
            "stop_reason": null, "stop_sequence": null, "usage": usage, "cachet": report,
        }
    });
    if let Some(d) = diagnostics {
        start["message"]["diagnostics"] = d;
    }
    let head = futures::stream::iter(vec![
        sse("message_start", start),
        sse(
            "content_block_start",
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        ),
        sse("ping", json!({"type": "ping"})),
    ]);
    let body = UnboundedReceiverStream::new(rx).flat_map(move |ev| {
        let items: Vec<Result<SseEvent, Infallible>> = match ev {
            Event::Delta(text) => vec![sse(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}),
            )],
            Event::Done { stop_reason, output_tokens } => {
                let stop_sequence = match &stop_reason {
                    engine::StopReason::StopSequence(s) => Some(s.clone()),
                    _ => None,
                };
                let delta_usage = DeltaUsage {
                    input_tokens: usage.input_tokens,
                    cache_creation_input_tokens: usage.cache_creation_input_tokens,
                    cache_read_input_tokens: usage.cache_read_input_tokens,
                    output_tokens,
                };
                vec![
                    sse("content_block_stop", json!({"type": "content_block_stop", "index": 0})),
                    sse(
                        "message_delta",
                        json!({"type": "message_delta", "delta": {"stop_reason": stop_reason.as_str(), "stop_sequence": stop_sequence}, "usage": delta_usage}),
                    ),
                    sse("message_stop", json!({"type": "message_stop"})),
                ]
            }
            Event::Error(e) => {
                let b = e.with_request_id(rid).body();
                vec![sse("error", json!({"type": "error", "error": b.error, "request_id": b.request_id}))]
            }
            Event::Start { .. } => Vec::new(),
        };
        futures::stream::iter(items)
    });
    Sse::new(head.chain(body)).into_response()
}

#[utoipa::path(
    post, path = "/v1/chat/completions", tag = "chat",
    request_body(content = Object, description = "OpenAI Chat Completions request (text content; see docs/operations.md for what is supported)"),
    responses(
        (status = 200, description = "A chat.completion (or, with `stream: true`, SSE chat.completion.chunk events ending in [DONE])"),
        (status = 400, description = "Invalid or unsupported request (OpenAI error shape, `param` names the field)"),
        (status = 401, description = "Missing or invalid API key"),
        (status = 429, description = "Rate limited"),
        (status = 503, description = "Overloaded"),
    ),
    security(("bearer" = []), ("api_key" = []))
)]
pub async fn create_chat_completion(
    State(state): State<AppState>,
    Extension(rid): Extension<RequestId>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match chat_inner(state, rid, headers, body).await {
        Ok(r) => r,
        Err(e) => openai_error(e, rid),
    }
}

/// A Cachet error in OpenAI's shape (the `request-id` header set as on every answer).
pub(crate) fn openai_error(e: ApiError, rid: RequestId) -> Response {
    crate::error::observe(e.code, &e.message, Some(rid));
    let (status, body) = openai::error_body(&e);
    let mut resp = (status, axum::Json(body)).into_response();
    for (n, v) in e.headers {
        resp.headers_mut().insert(n, v);
    }
    if let Ok(v) = HeaderValue::from_str(&rid.to_string()) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}

async fn chat_inner(
    state: AppState,
    rid: RequestId,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let start = tokio::time::Instant::now();
    let started_at = chrono::Utc::now();
    let body = body_bytes(body)?;
    let principal = state.auth.authenticate(&headers).await?;
    let (messages, opts) = openai::to_messages(
        &body,
        |m| state.engines.get(m).map(|e| e.info().max_output_tokens),
        principal.policy.allow_1h_ttl,
    )?;
    drop(body);
    let body = Bytes::from(serde_json::to_vec(&messages).expect("a JSON value serializes"));
    let shaped = prepare_messages(&state.engines, &state.pool, &principal, body).await?;
    // 24h retention within the tenant's longest TTL.
    let longest = std::time::Duration::from_secs(principal.policy.max_cache_ttl_secs.max(0) as u64);
    let Started {
        req,
        usage,
        report,
        rate,
        mut rx,
        ..
    } = start_generation(
        &state,
        rid,
        principal,
        shaped,
        Asked {
            seed: opts.seed,
            hold: opts.hold.map(|h| h.min(longest)),
            ..Asked::default()
        },
        (start, started_at),
    )
    .await?;
    let id = format!("chatcmpl-{}", rid.0.simple());
    let created = started_at.timestamp();
    let model = req.model.clone();
    if !opts.stream {
        let (text, stop, output) = collect_answer(&mut rx).await?;
        let resp = json!({
            "id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": null},
                         "finish_reason": openai::finish_reason(&stop), "logprobs": null}],
            "usage": crate::usage::openai(&usage, output),
            "system_fingerprint": null,
            "cachet": report,
        });
        return Ok(with_rate_headers(axum::Json(resp).into_response(), &rate));
    }
    let chunk = move |delta: serde_json::Value, finish: Option<&str>| {
        json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": null}]})
    };
    let data = |v: serde_json::Value| Ok::<_, Infallible>(SseEvent::default().data(v.to_string()));
    let mut first = chunk(json!({"role": "assistant", "content": ""}), None);
    first["cachet"] = serde_json::to_value(&report).expect("a report serializes");
    let head = futures::stream::iter(vec![data(first)]);
    let include_usage = opts.include_usage;
    let chunk2 = chunk.clone();
    let body = UnboundedReceiverStream::new(rx).flat_map(move |ev| {
        let items = match ev {
            Event::Delta(text) => vec![data(chunk2(json!({"content": text}), None))],
            Event::Done {
                stop_reason,
                output_tokens,
            } => {
                let mut v = vec![data(chunk2(
                    json!({}),
                    Some(openai::finish_reason(&stop_reason)),
                ))];
                if include_usage {
                    let mut last = chunk2(json!({}), None);
                    last["choices"] = json!([]);
                    last["usage"] = crate::usage::openai(&usage, output_tokens);
                    v.push(data(last));
                }
                v.push(Ok(SseEvent::default().data("[DONE]")));
                v
            }
            Event::Error(e) => {
                let (_, b) = openai::error_body(&e.with_request_id(rid));
                vec![data(b)]
            }
            Event::Start { .. } => Vec::new(),
        };
        futures::stream::iter(items)
    });
    Ok(with_rate_headers(
        Sse::new(head.chain(body)).into_response(),
        &rate,
    ))
}

#[utoipa::path(
    post, path = "/v1/messages/count_tokens", tag = "messages",
    request_body = CountTokensRequest,
    responses(
        (status = 200, description = "Prompt token count", body = CountTokensResponse),
        (status = 400, description = "Invalid request", body = ErrorBody),
        (status = 401, description = "Missing or invalid API key", body = ErrorBody),
    ),
    security(("api_key" = []), ("bearer" = []))
)]
pub async fn count_tokens(
    State(state): State<AppState>,
    Extension(rid): Extension<RequestId>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r: Result<Response, ApiError> = async {
        let body = body_bytes(body)?;
        check_version(&headers)?;
        let principal = state.auth.authenticate(&headers).await?;
        let scope = Scope {
            tenant: principal.tenant,
            workspace: principal.workspace,
        };
        // A cache object named in the body counts with its content.
        let (body, _) = caches::resolve(&state.pool, &principal, body).await?;
        let (req, _) = validate::count_tokens_request(&body, |m| state.engines.get(m).is_some())?;
        let engine = state
            .engines
            .get(&req.model)
            .cloned()
            .ok_or_else(|| ApiError::invalid("model: unknown model"))?;
        let prompt = render::to_prompt(
            req.tools.as_deref(),
            req.system.as_ref(),
            &req.messages,
            scope,
        );
        let rendered = tokio::task::spawn_blocking(move || engine.render(&prompt))
            .await
            .map_err(|e| ApiError::internal("render task failed", e))?
            .map_err(render::render_error)?;
        Ok(axum::Json(CountTokensResponse {
            input_tokens: rendered.tokens.len() as u64,
        })
        .into_response())
    }
    .await;
    r.unwrap_or_else(|e| e.with_request_id(rid).into_response())
}

fn model_object(e: &Arc<dyn engine::Engine>) -> ModelObject {
    let i = e.info();
    ModelObject {
        kind: "model".into(),
        id: i.id.clone(),
        display_name: i.display_name.clone(),
        created_at: i.created_at.clone(),
    }
}

#[utoipa::path(
    get, path = "/v1/models", tag = "models",
    responses((status = 200, description = "Served models", body = ModelList), (status = 401, description = "Missing or invalid API key", body = ErrorBody)),
    security(("api_key" = []), ("bearer" = []))
)]
pub async fn list_models(
    State(state): State<AppState>,
    Extension(rid): Extension<RequestId>,
    headers: HeaderMap,
) -> Response {
    if let Err(e) = state.auth.authenticate(&headers).await {
        return e.with_request_id(rid).into_response();
    }
    let data: Vec<ModelObject> = state.engines.all().iter().map(model_object).collect();
    let first_id = data.first().map(|m| m.id.clone());
    let last_id = data.last().map(|m| m.id.clone());
    axum::Json(ModelList {
        data,
        has_more: false,
        first_id,
        last_id,
    })
    .into_response()
}

#[utoipa::path(
    get, path = "/v1/models/{model_id}", tag = "models",
    params(("model_id" = String, Path, description = "Model id")),
    responses((status = 200, description = "One model", body = ModelObject), (status = 404, description = "Unknown model", body = ErrorBody)),
    security(("api_key" = []), ("bearer" = []))
)]
pub async fn get_model(
    State(state): State<AppState>,
    Extension(rid): Extension<RequestId>,
    Path(model_id): Path<String>,
    headers: HeaderMap,
) -> Response {
    if let Err(e) = state.auth.authenticate(&headers).await {
        return e.with_request_id(rid).into_response();
    }
    match state.engines.get(&model_id) {
        Some(e) => axum::Json(model_object(e)).into_response(),
        None => ApiError::new(ErrorCode::NotFound, format!("model: {model_id}"))
            .with_request_id(rid)
            .into_response(),
    }
}
