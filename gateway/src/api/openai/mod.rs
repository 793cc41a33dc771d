//! OpenAI's Chat Completions wire (`POST /v1/chat/completions`) over the same pipeline and
//! cache as `/v1/messages`, from the body to its answer: the request translated into the
//! Messages request that renders the same prompt (`translate`), then a `chat.completion` or
//! its `chat.completion.chunk` events ending in `[DONE]`, with OpenAI's usage, finish reasons
//! and error shape.

mod translate;

use std::convert::Infallible;

use axum::body::Bytes;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use cachet_common::RequestId;
use chrono::{DateTime, Utc};
use control::tenants::Principal;
use futures::StreamExt;
use serde_json::{Value, json};
use tokio_stream::wrappers::UnboundedReceiverStream;

pub use translate::{ChatOptions, RETENTION_24H, to_messages};

use crate::api::anthropic::prepare_messages;
use crate::api::serve::Wire;
use crate::api::stages::{Asked, Shaped, Started, collect_answer};
use crate::error::{ApiError, ErrorCode};
use crate::pipeline::Event;
use crate::state::AppState;
use crate::wire::types::Usage;

/// The Chat Completions wire.
pub(crate) struct OpenAi;

impl Wire for OpenAi {
    type Options = ChatOptions;

    async fn shape(
        state: &AppState,
        principal: &Principal,
        _headers: &HeaderMap,
        body: Bytes,
    ) -> Result<(Shaped, Asked, ChatOptions), ApiError> {
        let (messages, opts) = to_messages(
            &body,
            |m| state.engines.get(m).map(|e| e.info().max_output_tokens),
            principal.policy.allow_1h_ttl,
        )?;
        drop(body);
        let body = Bytes::from(serde_json::to_vec(&messages).expect("a JSON value serializes"));
        drop(messages);
        let shaped = prepare_messages(&state.engines, &state.pool, principal, body).await?;
        // 24h retention within the tenant's longest TTL.
        let longest =
            std::time::Duration::from_secs(principal.policy.max_cache_ttl_secs.max(0) as u64);
        let asked = Asked {
            seed: opts.seed,
            hold: opts.hold.map(|h| h.min(longest)),
            ..Asked::default()
        };
        Ok((shaped, asked, opts))
    }

    async fn respond(
        rid: RequestId,
        started_at: DateTime<Utc>,
        started: Started,
        opts: ChatOptions,
    ) -> Result<Response, ApiError> {
        let Started {
            req,
            usage,
            report,
            mut rx,
            ..
        } = started;
        let chunks = Chunks {
            id: format!("chatcmpl-{}", rid.0.simple()),
            created: started_at.timestamp(),
            model: req.model,
        };
        if opts.stream {
            return Ok(stream(rid, chunks, usage, report, opts.include_usage, rx));
        }
        let (text, stop, output) = collect_answer(&mut rx).await?;
        let resp = json!({
            "id": chunks.id, "object": "chat.completion", "created": chunks.created, "model": chunks.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": null},
                         "finish_reason": finish_reason(&stop), "logprobs": null}],
            "usage": usage_of(&usage, output),
            "system_fingerprint": null,
            "cachet": report,
        });
        Ok(axum::Json(resp).into_response())
    }

    fn error(e: ApiError, rid: RequestId) -> Response {
        error_response(e, rid)
    }
}

/// What every chunk of an answer repeats.
#[derive(Clone)]
struct Chunks {
    id: String,
    created: i64,
    model: String,
}

impl Chunks {
    fn chunk(&self, delta: Value, finish: Option<&str>) -> Value {
        json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": null}]})
    }
}

fn data(v: Value) -> Result<SseEvent, Infallible> {
    Ok(SseEvent::default().data(v.to_string()))
}

/// The first chunk (the role, and Cachet's cache report), a chunk per delta, the finish
/// chunk, the usage chunk where asked for, then `[DONE]`; an error after the 200 is an
/// error body as a chunk.
fn stream(
    rid: RequestId,
    chunks: Chunks,
    usage: Usage,
    report: crate::wire::types::CacheReport,
    include_usage: bool,
    rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
) -> Response {
    let mut first = chunks.chunk(json!({"role": "assistant", "content": ""}), None);
    first["cachet"] = serde_json::to_value(&report).expect("a report serializes");
    let head = futures::stream::iter(vec![data(first)]);
    let body = UnboundedReceiverStream::new(rx).flat_map(move |ev| {
        let items = match ev {
            Event::Delta(text) => vec![data(chunks.chunk(json!({"content": text}), None))],
            Event::Done {
                stop_reason,
                output_tokens,
            } => {
                let finish = chunks.chunk(json!({}), Some(finish_reason(&stop_reason)));
                let mut v = vec![data(finish)];
                if include_usage {
                    let mut last = chunks.chunk(json!({}), None);
                    last["choices"] = json!([]);
                    last["usage"] = usage_of(&usage, output_tokens);
                    v.push(data(last));
                }
                v.push(Ok(SseEvent::default().data("[DONE]")));
                v
            }
            Event::Error(e) => {
                let (_, b) = error_body(&e.with_request_id(rid));
                vec![data(b)]
            }
            Event::Start { .. } => Vec::new(),
        };
        futures::stream::iter(items)
    });
    Sse::new(head.chain(body)).into_response()
}

/// OpenAI's usage (from the Anthropic usage): `prompt_tokens` counts every prompt token (read
/// and written ones included), each in exactly one of uncached, `cached_tokens`,
/// `cache_write_tokens`, as the ledger's classes are.
pub fn usage_of(u: &Usage, output_tokens: u64) -> Value {
    let prompt = u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens;
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": output_tokens,
        "total_tokens": prompt + output_tokens,
        "prompt_tokens_details": {
            "cached_tokens": u.cache_read_input_tokens,
            "cache_write_tokens": u.cache_creation_input_tokens,
            "audio_tokens": 0,
        },
        "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
            "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0},
    })
}

/// A Cachet error in OpenAI's shape (the `request-id` header set as on every answer).
pub(crate) fn error_response(e: ApiError, rid: RequestId) -> Response {
    crate::error::observe(e.code, &e.message, Some(rid));
    let (status, body) = error_body(&e);
    let mut resp = (status, axum::Json(body)).into_response();
    for (n, v) in e.headers {
        resp.headers_mut().insert(n, v);
    }
    if let Ok(v) = HeaderValue::from_str(&rid.to_string()) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}

pub fn finish_reason(stop: &engine::StopReason) -> &'static str {
    match stop {
        engine::StopReason::MaxTokens => "length",
        engine::StopReason::EndTurn | engine::StopReason::StopSequence(_) => "stop",
    }
}

/// OpenAI's error body and status for a Cachet error.
pub fn error_body(e: &ApiError) -> (axum::http::StatusCode, Value) {
    use axum::http::StatusCode;
    let (status, kind, code) = match e.code {
        ErrorCode::Authentication => (
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            Some("invalid_api_key"),
        ),
        ErrorCode::Permission => (StatusCode::FORBIDDEN, "permission_error", None),
        ErrorCode::NotFound => (
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            Some("not_found"),
        ),
        ErrorCode::RateLimit => (
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            Some("rate_limit_exceeded"),
        ),
        // OpenAI sheds load with 503; its SDKs retry it.
        ErrorCode::Overloaded => (
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            Some("overloaded"),
        ),
        ErrorCode::Api => (StatusCode::INTERNAL_SERVER_ERROR, "server_error", None),
        ErrorCode::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, "server_error", None),
        k => (
            StatusCode::from_u16(k.status_u16()).unwrap_or(StatusCode::BAD_REQUEST),
            "invalid_request_error",
            None,
        ),
    };
    let param = e
        .message
        .split_once(": ")
        .map(|(p, _)| p)
        .filter(|p| !p.contains(' '));
    (
        status,
        json!({"error": {"message": e.message, "type": kind, "param": param, "code": code}}),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::usage::{TokenUsage, anthropic};
    use proptest::prelude::*;

    proptest! {
        /// Whatever the classes, OpenAI's usage accounts for every prompt token exactly once
        /// and agrees with the ledger's classes.
        #[test]
        fn the_usage_carries_the_ledgers_classes(input in 0u64..1_000_000, w5 in 0u64..1_000_000,
                                                 w1 in 0u64..1_000_000, read in 0u64..1_000_000,
                                                 out in 0u64..100_000) {
            let u = TokenUsage { input, write_5m: w5, write_1h: w1, read };
            let o = usage_of(&anthropic(&u), out);
            let d = &o["prompt_tokens_details"];
            prop_assert_eq!(o["prompt_tokens"].as_u64(), Some(u.prompt_total()));
            prop_assert_eq!(d["cached_tokens"].as_u64(), Some(read));
            prop_assert_eq!(d["cache_write_tokens"].as_u64(), Some(w5 + w1));
            prop_assert_eq!(o["prompt_tokens"].as_u64().unwrap() - read - (w5 + w1), input);
            prop_assert_eq!(o["total_tokens"].as_u64(), Some(u.prompt_total() + out));
        }
    }
}
