//! The one place where errors become HTTP responses: the Anthropic shape is
//! [`cachet_common::error::ApiError`]'s own; here are the OpenAI shape's edge
//! ([`crate::api::openai::error_body`] uses it), and [`observed`], the middleware that
//! counts every error response and logs every 529 with its reason, whichever crate's handler
//! made it.

use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;
use cachet_common::RequestId;
pub use cachet_common::error::{ApiError, ErrorCode, ErrorSeen};

/// Count an error and log what an operator must see: every 529 with its reason (a refusal
/// is the service's decision, not the client's mistake).
pub fn observe(code: ErrorCode, message: &str, request_id: Option<RequestId>) {
    crate::metrics::ERRORS
        .with_label_values(&[code.as_str()])
        .inc();
    if code == ErrorCode::Overloaded {
        tracing::warn!(
            request_id = request_id.map(|r| r.to_string()).unwrap_or_default(),
            reason = %message,
            "answered 529 overloaded"
        );
    }
}

/// Middleware: observes each error response an [`ApiError`] made (see [`observe`]).
pub async fn observed(req: Request, next: Next) -> Response {
    let rid = req.extensions().get::<RequestId>().copied();
    let mut resp = next.run(req).await;
    if let Some(seen) = resp.extensions_mut().remove::<ErrorSeen>() {
        let rid = rid.or_else(|| {
            resp.headers()
                .get("request-id")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse().ok())
        });
        observe(seen.code, &seen.message, rid);
    }
    resp
}

/// An error answered outside the routers (by the HTTP server itself, before any middleware):
/// observed here, then made a response.
pub fn unrouted(e: ApiError) -> Response {
    use axum::response::IntoResponse;
    observe(e.code, &e.message, e.request_id);
    let mut resp = e.into_response();
    resp.extensions_mut().remove::<ErrorSeen>();
    resp
}
