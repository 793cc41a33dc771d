//! The one way a customer's generation request is served, whatever its wire: the body and
//! headers checked, the caller authenticated, the body shaped by its wire into a Messages
//! generation, the generation started, and the wire's answer (whole or streamed) with the
//! rate-limit headers; every error in the wire's own shape. A wire is one `Wire`
//! (`anthropic`, `openai`): a third is one new module.

use std::future::Future;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, HeaderName, HeaderValue};
use axum::response::Response;
use cachet_common::RequestId;
use chrono::{DateTime, Utc};
use control::tenants::Principal;

use crate::admission::RateHeaders;
use crate::api::stages::{Asked, Shaped, Started, body_bytes, start_generation};
use crate::error::ApiError;
use crate::state::AppState;

/// A customer-facing wire, from its request body to its answer.
pub(crate) trait Wire {
    /// What the answer needs of the request besides the generation (the wire's options).
    type Options: Send + 'static;

    /// Checks on the headers before the caller is authenticated (an API version).
    fn check_headers(_headers: &HeaderMap) -> Result<(), ApiError> {
        Ok(())
    }

    /// The body as a Messages generation rendered for `principal`, what to ask of it, and
    /// the options its answer needs.
    fn shape(
        state: &AppState,
        principal: &Principal,
        headers: &HeaderMap,
        body: Bytes,
    ) -> impl Future<Output = Result<(Shaped, Asked, Self::Options), ApiError>> + Send;

    /// The answer to a started generation: collected whole, or streamed as the wire's events.
    fn respond(
        rid: RequestId,
        started_at: DateTime<Utc>,
        started: Started,
        options: Self::Options,
    ) -> impl Future<Output = Result<Response, ApiError>> + Send;

    /// An error as this wire says it.
    fn error(e: ApiError, rid: RequestId) -> Response;
}

/// Serve one request of wire `W`.
pub(crate) async fn serve<W: Wire>(
    state: AppState,
    rid: RequestId,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let start = tokio::time::Instant::now();
    let started_at = Utc::now();
    let served = async {
        let body = body_bytes(body)?;
        W::check_headers(&headers)?;
        let principal = state.auth.authenticate(&headers).await?;
        let (shaped, asked, options) = W::shape(&state, &principal, &headers, body).await?;
        let started =
            start_generation(&state, rid, principal, shaped, asked, (start, started_at)).await?;
        let rate = started.rate.clone();
        let resp = W::respond(rid, started_at, started, options).await?;
        Ok(with_rate_headers(resp, &rate))
    }
    .await;
    served.unwrap_or_else(|e| W::error(e, rid))
}

/// The caller's remaining capacity, as `anthropic-ratelimit-*` headers.
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
