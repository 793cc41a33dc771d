//! Anthropic's Messages wire (`POST /v1/messages`), from the body to its answer: validated
//! and rendered (`prepare_messages`, which the routing gateway and OpenAI's wire use too, so
//! all see the same keys), then a `message` or its SSE events.

use std::convert::Infallible;

use axum::body::Bytes;
use axum::http::HeaderMap;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use cachet_common::RequestId;
use chrono::{DateTime, Utc};
use control::tenants::Principal;
use futures::StreamExt;
use serde_json::json;
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::api::caches;
use crate::api::serve::Wire;
use crate::api::stages::{
    Asked, INLINE_RENDER_BYTES, Shaped, Started, check_version, collect_answer, model_limits,
    render_for,
};
use crate::error::{ApiError, ErrorCode};
use crate::pipeline::Event;
use crate::state::AppState;
use crate::wire::types::*;
use crate::wire::validate;

/// The Messages wire.
pub(crate) struct Anthropic;

impl Wire for Anthropic {
    type Options = ();

    fn check_headers(headers: &HeaderMap) -> Result<(), ApiError> {
        check_version(headers)
    }

    async fn shape(
        state: &AppState,
        principal: &Principal,
        headers: &HeaderMap,
        body: Bytes,
    ) -> Result<(Shaped, Asked, ()), ApiError> {
        let shaped = prepare_messages(&state.engines, &state.pool, principal, body).await?;
        let asked = Asked {
            diagnose: crate::diagnostics::requested(headers),
            ..Asked::default()
        };
        Ok((shaped, asked, ()))
    }

    async fn respond(
        rid: RequestId,
        _started_at: DateTime<Utc>,
        started: Started,
        (): (),
    ) -> Result<Response, ApiError> {
        let Started {
            req,
            mut usage,
            report,
            diagnostics,
            mut rx,
            ..
        } = started;
        if req.stream {
            return Ok(stream(rid, req.model, usage, report, diagnostics, rx));
        }
        let (text, stop, output) = collect_answer(&mut rx).await?;
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
            model: req.model,
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
        Ok(axum::Json(resp).into_response())
    }

    fn error(e: ApiError, rid: RequestId) -> Response {
        e.with_request_id(rid).into_response()
    }
}

/// Validate a Messages body and render it for `principal`'s scope (with the content of the
/// cache object it names, if any). Shared by both wires and the routing gateway, so all see
/// the same keys.
pub(crate) async fn prepare_messages(
    engines: &crate::engines::EnginePool,
    pool: &sqlx::PgPool,
    principal: &Principal,
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
fn stream(
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
