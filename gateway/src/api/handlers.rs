//! Handlers of `/v1/messages` and `/v1/chat/completions` (each served by its wire: `serve`),
//! `/v1/messages/count_tokens` and `/v1/models`.

use std::sync::Arc;

use axum::Extension;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use cachet_common::{RequestId, Scope};

use crate::api::anthropic::Anthropic;
use crate::api::caches;
use crate::api::openai::OpenAi;
use crate::api::serve::serve;
use crate::api::stages::{body_bytes, check_version};
use crate::error::{ApiError, ErrorCode};
use crate::render;
use crate::state::AppState;
use crate::wire::types::*;
use crate::wire::validate;

#[utoipa::path(
    post, path = "/v1/messages", tag = "messages",
    request_body = MessagesRequest,
    responses(
        (status = 200, description = "A message (or, with `stream: true`, an SSE stream of message events)",
         content((MessageResponse = "application/json"), (String = "text/event-stream"))),
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
    serve::<Anthropic>(state, rid, headers, body).await
}

#[utoipa::path(
    post, path = "/v1/chat/completions", tag = "chat",
    request_body(content = Object, description = "OpenAI Chat Completions request (text content; see docs/operations.md for what is supported)"),
    responses(
        (status = 200, description = "A chat.completion (or, with `stream: true`, SSE chat.completion.chunk events ending in [DONE])",
         content((Object = "application/json"), (String = "text/event-stream"))),
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
    serve::<OpenAi>(state, rid, headers, body).await
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
