//! The one place where errors become HTTP responses in Anthropic's error format.

use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use cachet_common::RequestId;

use crate::api::types::{ErrorBody, ErrorDetail};

/// Error kinds of the Anthropic API, with their status codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    InvalidRequest,
    Authentication,
    Permission,
    NotFound,
    RequestTooLarge,
    RateLimit,
    /// A change that conflicts with the object's state (409, typed as an invalid request).
    Conflict,
    /// The client stopped sending its request (408, typed as an invalid request).
    RequestTimeout,
    /// The path exists, the method does not (405, typed as an invalid request).
    MethodNotAllowed,
    /// The request target is longer than the server reads (414, typed as an invalid request).
    UriTooLong,
    /// Too many header fields, or too many header bytes (431, typed as an invalid request).
    HeadersTooLarge,
    Api,
    /// A part of the service that is switched off (503).
    Unavailable,
    Overloaded,
}

impl ErrorKind {
    pub fn status(self) -> StatusCode {
        match self {
            ErrorKind::InvalidRequest => StatusCode::BAD_REQUEST,
            ErrorKind::Authentication => StatusCode::UNAUTHORIZED,
            ErrorKind::Permission => StatusCode::FORBIDDEN,
            ErrorKind::NotFound => StatusCode::NOT_FOUND,
            ErrorKind::RequestTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorKind::RateLimit => StatusCode::TOO_MANY_REQUESTS,
            ErrorKind::Conflict => StatusCode::CONFLICT,
            ErrorKind::RequestTimeout => StatusCode::REQUEST_TIMEOUT,
            ErrorKind::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ErrorKind::UriTooLong => StatusCode::URI_TOO_LONG,
            ErrorKind::HeadersTooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            ErrorKind::Api => StatusCode::INTERNAL_SERVER_ERROR,
            ErrorKind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            ErrorKind::Overloaded => StatusCode::from_u16(529).expect("529 is a valid status"),
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::InvalidRequest
            | ErrorKind::Conflict
            | ErrorKind::RequestTimeout
            | ErrorKind::MethodNotAllowed
            | ErrorKind::UriTooLong
            | ErrorKind::HeadersTooLarge => "invalid_request_error",
            ErrorKind::Authentication => "authentication_error",
            ErrorKind::Permission => "permission_error",
            ErrorKind::NotFound => "not_found_error",
            ErrorKind::RequestTooLarge => "request_too_large",
            ErrorKind::RateLimit => "rate_limit_error",
            ErrorKind::Api | ErrorKind::Unavailable => "api_error",
            ErrorKind::Overloaded => "overloaded_error",
        }
    }
}

/// An error on its way to the client. Internal causes are logged once, here, and never
/// shown to the client.
#[derive(Debug)]
pub struct ApiError {
    pub kind: ErrorKind,
    pub message: String,
    pub request_id: Option<RequestId>,
    /// Extra response headers (`retry-after`, rate-limit state).
    pub headers: Vec<(HeaderName, HeaderValue)>,
}

impl ApiError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            request_id: None,
            headers: Vec::new(),
        }
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidRequest, message)
    }
    /// 529: the service cannot take this request now. The message says why (it reaches
    /// the client, the log and the load tester's records); `retry-after` says when to try
    /// again (1 s unless the caller knows better).
    pub fn overloaded(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Overloaded, message).with_header("retry-after", "1")
    }
    /// A failure of ours: logged with its cause, shown to the client as a generic message.
    pub fn internal(context: &str, cause: impl std::fmt::Display) -> Self {
        tracing::error!(error = %cause, "{context}");
        Self::new(ErrorKind::Api, "Internal server error")
    }
    pub fn with_request_id(mut self, id: RequestId) -> Self {
        self.request_id = Some(id);
        self
    }
    /// Set a response header (replacing one of the same name set before).
    pub fn with_header(mut self, name: &str, value: &str) -> Self {
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(value),
        ) {
            self.headers.retain(|(old, _)| *old != n);
            self.headers.push((n, v));
        }
        self
    }

    /// Count the error and log what an operator must see: every 529 with its reason (a
    /// refusal is the service's decision, not the client's mistake). Called once, where the
    /// error becomes a response on either wire.
    pub fn observe(&self) {
        crate::metrics::ERRORS
            .with_label_values(&[self.kind.as_str()])
            .inc();
        if self.kind == ErrorKind::Overloaded {
            tracing::warn!(
                request_id = self.request_id.map(|r| r.to_string()).unwrap_or_default(),
                reason = %self.message,
                "answered 529 overloaded"
            );
        }
    }
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            kind: "error".into(),
            error: ErrorDetail {
                kind: self.kind.as_str().into(),
                message: self.message.clone(),
            },
            request_id: self.request_id.map(|r| r.to_string()).unwrap_or_default(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.observe();
        let body = self.body();
        let pending = self
            .request_id
            .is_none()
            .then_some(cachet_common::RequestIdPending);
        let mut resp = (self.kind.status(), axum::Json(body)).into_response();
        if let Some(p) = pending {
            // Made where the request id is not at hand: the request middleware fills it in.
            resp.extensions_mut().insert(p);
        }
        if let Some(id) = self.request_id
            && let Ok(v) = HeaderValue::from_str(&id.to_string())
        {
            // Also when no middleware runs (a request refused by the HTTP server itself).
            resp.headers_mut().insert("request-id", v);
        }
        for (n, v) in self.headers {
            resp.headers_mut().insert(n, v);
        }
        resp
    }
}
