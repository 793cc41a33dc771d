//! One error vocabulary for every Cachet crate.
//!
//! Every domain error (the fabric's, billing's, the control plane's, admin identity's)
//! implements [`ServiceError`]: it says which [`ErrorCode`] it is. The code decides the HTTP
//! status and the Anthropic error type; each wire maps it to its own shape at the edge (the
//! Anthropic body here, OpenAI's in the gateway), so no crate matches on another crate's
//! status numbers.
//!
//! With the `http` feature this module also holds [`ApiError`], the error an HTTP handler
//! answers with, in Anthropic's shape.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// What went wrong, as a caller needs to know it: the HTTP status and the error type follow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorCode {
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
    /// A body that is not of a type the endpoint reads (415, typed as an invalid request).
    UnsupportedMediaType,
    /// Too many header fields, or too many header bytes (431, typed as an invalid request).
    HeadersTooLarge,
    /// A failure of ours (500); its cause is logged, never shown.
    Api,
    /// A part of the service that is switched off (503).
    Unavailable,
    /// The service cannot take this request now (529).
    Overloaded,
}

impl ErrorCode {
    /// The HTTP status.
    pub fn status_u16(self) -> u16 {
        match self {
            ErrorCode::InvalidRequest => 400,
            ErrorCode::Authentication => 401,
            ErrorCode::Permission => 403,
            ErrorCode::NotFound => 404,
            ErrorCode::MethodNotAllowed => 405,
            ErrorCode::RequestTimeout => 408,
            ErrorCode::Conflict => 409,
            ErrorCode::RequestTooLarge => 413,
            ErrorCode::UnsupportedMediaType => 415,
            ErrorCode::UriTooLong => 414,
            ErrorCode::RateLimit => 429,
            ErrorCode::HeadersTooLarge => 431,
            ErrorCode::Api => 500,
            ErrorCode::Unavailable => 503,
            ErrorCode::Overloaded => 529,
        }
    }

    /// The Anthropic error type (`error.type`).
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidRequest
            | ErrorCode::Conflict
            | ErrorCode::RequestTimeout
            | ErrorCode::MethodNotAllowed
            | ErrorCode::UriTooLong
            | ErrorCode::UnsupportedMediaType
            | ErrorCode::HeadersTooLarge => "invalid_request_error",
            ErrorCode::Authentication => "authentication_error",
            ErrorCode::Permission => "permission_error",
            ErrorCode::NotFound => "not_found_error",
            ErrorCode::RequestTooLarge => "request_too_large",
            ErrorCode::RateLimit => "rate_limit_error",
            ErrorCode::Api | ErrorCode::Unavailable => "api_error",
            ErrorCode::Overloaded => "overloaded_error",
        }
    }

    /// Whether the cause is ours (logged, shown to the client as a generic message).
    pub fn is_internal(self) -> bool {
        self == ErrorCode::Api
    }
}

/// A wait as an error message says it: "1 second", "30 seconds", "15 minutes" (a login's
/// backoff, a rate limit's refill).
pub fn wait_text(secs: i64) -> String {
    match secs {
        ..=1 => "1 second".into(),
        2..=119 => format!("{secs} seconds"),
        _ => format!("{} minutes", (secs + 59) / 60),
    }
}

/// A domain error that knows its [`ErrorCode`]. Its `Display` is the message a client sees,
/// except for [`ErrorCode::Api`], whose message is logged and replaced.
pub trait ServiceError: std::fmt::Display {
    fn error_code(&self) -> ErrorCode;
}

// `error` of every error body (no doc comment: it would change the OpenAPI document).
#[derive(Clone, Debug, Deserialize, Serialize, ToSchema)]
pub struct ErrorDetail {
    #[serde(rename = "type")]
    pub kind: String,
    pub message: String,
}

/// Every error: `{"type":"error","error":{"type","message"},"request_id"}`.
#[derive(Clone, Debug, Deserialize, Serialize, ToSchema)]
pub struct ErrorBody {
    #[serde(rename = "type")]
    pub kind: String,
    pub error: ErrorDetail,
    pub request_id: String,
}

#[cfg(feature = "http")]
pub use http_edge::{ApiError, ErrorSeen};

#[cfg(feature = "http")]
mod http_edge {
    use axum::http::{HeaderName, HeaderValue, StatusCode};
    use axum::response::{IntoResponse, Response};

    use super::{ErrorBody, ErrorCode, ErrorDetail, ServiceError};
    use crate::{RequestId, RequestIdPending};

    /// An error on its way to an HTTP client. Internal causes are logged once, where the
    /// error is made ([`ApiError::internal`]), and never shown to the client.
    #[derive(Debug)]
    pub struct ApiError {
        pub code: ErrorCode,
        pub message: String,
        pub request_id: Option<RequestId>,
        /// Extra response headers (`retry-after`, rate-limit state).
        pub headers: Vec<(HeaderName, HeaderValue)>,
    }

    /// Left in an error response's extensions by [`ApiError`]'s `IntoResponse`, for the
    /// server's middleware to count (and to log a 529 with its reason) in one place.
    #[derive(Clone, Debug)]
    pub struct ErrorSeen {
        pub code: ErrorCode,
        pub message: String,
    }

    impl ApiError {
        pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
            Self {
                code,
                message: message.into(),
                request_id: None,
                headers: Vec::new(),
            }
        }
        pub fn invalid(message: impl Into<String>) -> Self {
            Self::new(ErrorCode::InvalidRequest, message)
        }
        /// 529: the service cannot take this request now. The message says why (it reaches
        /// the client, the log and the load tester's records); `retry-after` says when to
        /// try again (1 s unless the caller knows better).
        pub fn overloaded(message: impl Into<String>) -> Self {
            Self::new(ErrorCode::Overloaded, message).with_header("retry-after", "1")
        }
        /// A failure of ours: logged with its cause, shown to the client as a generic message.
        pub fn internal(context: &str, cause: impl std::fmt::Display) -> Self {
            tracing::error!(error = %cause, "{context}");
            Self::new(ErrorCode::Api, "Internal server error")
        }
        /// Any domain error, by its code; an internal one is logged under `context`.
        pub fn from_service(context: &str, e: &(impl ServiceError + ?Sized)) -> Self {
            match e.error_code() {
                ErrorCode::Api => Self::internal(context, e),
                code => Self::new(code, e.to_string()),
            }
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
        pub fn status(&self) -> StatusCode {
            StatusCode::from_u16(self.code.status_u16())
                .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
        }
        /// The body in Anthropic's shape.
        pub fn body(&self) -> ErrorBody {
            ErrorBody {
                kind: "error".into(),
                error: ErrorDetail {
                    kind: self.code.as_str().into(),
                    message: self.message.clone(),
                },
                request_id: self.request_id.map(|r| r.to_string()).unwrap_or_default(),
            }
        }
    }

    impl IntoResponse for ApiError {
        fn into_response(self) -> Response {
            let body = self.body();
            let mut resp = (self.status(), axum::Json(body)).into_response();
            if self.request_id.is_none() {
                // Made where the request id is not at hand: the request middleware fills it in.
                resp.extensions_mut().insert(RequestIdPending);
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
            resp.extensions_mut().insert(ErrorSeen {
                code: self.code,
                message: self.message,
            });
            resp
        }
    }

    /// A query string, path or JSON body that does not parse: 400 (413 for a body too
    /// large, 415 for a body that is not JSON), saying what was wrong.
    impl From<axum::extract::rejection::QueryRejection> for ApiError {
        fn from(r: axum::extract::rejection::QueryRejection) -> Self {
            ApiError::invalid(super::readable_rejection(&r.body_text()))
        }
    }

    impl From<axum::extract::rejection::PathRejection> for ApiError {
        fn from(r: axum::extract::rejection::PathRejection) -> Self {
            ApiError::invalid(super::readable_path_rejection(&r.body_text()))
        }
    }

    impl From<axum::extract::rejection::JsonRejection> for ApiError {
        fn from(r: axum::extract::rejection::JsonRejection) -> Self {
            let code = match r.status() {
                StatusCode::PAYLOAD_TOO_LARGE => ErrorCode::RequestTooLarge,
                StatusCode::UNSUPPORTED_MEDIA_TYPE => ErrorCode::UnsupportedMediaType,
                _ => ErrorCode::InvalidRequest,
            };
            ApiError::new(code, super::readable_rejection(&r.body_text()))
        }
    }
}

/// A path's parse error as a sentence: naming the parameter where the framework does
/// (`id: not an id …`), else said of the path (`path: not an id …`).
pub fn readable_path_rejection(text: &str) -> String {
    let said = readable_rejection(text);
    let names_it = text
        .trim()
        .trim_start_matches("Invalid URL: ")
        .starts_with("Cannot parse `");
    if names_it {
        said
    } else {
        format!("path: {said}")
    }
}

/// serde_path_to_error's "field: detail" split, where the part before the colon is a field
/// path (`tenant`, `messages[0].content`); otherwise no field.
fn field_and_detail(t: &str) -> (Option<&str>, &str) {
    match t.split_once(": ") {
        Some((f, d))
            if !f.is_empty()
                && f.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"_.[]".contains(&b)) =>
        {
            (Some(f), d)
        }
        _ => (None, t),
    }
}

/// A query string's, a path's or a body's parse error as a sentence that names the field, in
/// place of the parser's own words: `missing field \`format\`` → `format: required`,
/// `tenant: UUID parsing failed: invalid character…` → `tenant: not an id (a UUID such as
/// 0192b7e4-8c3a-7cde-9f01-23456789abcd)`, `format: unknown variant \`xml\`, expected one of
/// \`csv\`, \`jsonl\`` → `format: "xml" is not one of csv, jsonl`. What it does not
/// recognise passes as it came, without the framework's "Failed to deserialize…" preamble.
pub fn readable_rejection(text: &str) -> String {
    let mut t = text.trim();
    for preamble in [
        "Failed to deserialize query string: ",
        "Failed to deserialize the JSON body into the target type: ",
        "Failed to parse the request body as JSON: ",
        "Invalid URL: ",
    ] {
        if let Some(rest) = t.strip_prefix(preamble) {
            t = rest;
        }
    }
    // serde_path_to_error's "field: detail"; a body's "… at line 1 column 7" is dropped.
    let t = t.split(" at line ").next().unwrap_or(t);
    // A path's "Cannot parse `id` with value `x`: detail" names its parameter the same way.
    let path_param = t
        .strip_prefix("Cannot parse `")
        .and_then(|rest| rest.split_once('`'))
        .and_then(|(name, rest)| Some((name, rest.split_once("`: ")?.1)));
    let (field, detail) = match path_param {
        Some((name, detail)) => (Some(name), detail),
        None => field_and_detail(t),
    };
    let say = |what: &str| match field {
        Some(f) => format!("{f}: {what}"),
        None => what.to_string(),
    };
    let ticked = |s: &str| -> Vec<String> {
        s.split('`')
            .enumerate()
            .filter(|(i, _)| i % 2 == 1)
            .map(|(_, w)| w.to_string())
            .collect()
    };
    if let Some(rest) = detail.strip_prefix("missing field `") {
        let name = rest.split('`').next().unwrap_or(rest);
        return match field {
            Some(f) => format!("{f}.{name}: required"),
            None => format!("{name}: required"),
        };
    }
    if detail.starts_with("UUID parsing failed") || detail.contains("to a `uuid::Uuid`") {
        return say("not an id (a UUID such as 0192b7e4-8c3a-7cde-9f01-23456789abcd)");
    }
    if let Some(rest) = detail.strip_prefix("unknown variant `") {
        let got = rest.split('`').next().unwrap_or("");
        let expected = rest
            .split_once("expected")
            .map_or(vec![], |(_, e)| ticked(e));
        return say(&format!("\"{got}\" is not one of {}", expected.join(", ")));
    }
    if let Some(rest) = detail.strip_prefix("unknown field `") {
        let got = rest.split('`').next().unwrap_or("");
        return format!("{got}: not a field of this request");
    }
    if detail.contains("invalid digit") || detail.contains("cannot parse integer") {
        return say("not a whole number");
    }
    if detail.contains("number too large") || detail.contains("number too small") {
        return say("out of range");
    }
    if [
        "input contains invalid characters",
        "premature end of input",
        "trailing input",
        "input is out of range",
        "input is not enough",
        "no possible date and time",
    ]
    .iter()
    .any(|m| detail.contains(m))
    {
        return say("not a time in RFC 3339 (such as 2026-11-01T00:00:00Z)");
    }
    if detail.contains("provided string was not `true` or `false`") {
        return say("not true or false");
    }
    say(detail)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_errors_read_as_sentences_that_name_the_field() {
        let r = readable_rejection;
        assert_eq!(
            r("Failed to deserialize query string: missing field `format`"),
            "format: required"
        );
        assert_eq!(
            r(
                "Failed to deserialize query string: tenant: UUID parsing failed: invalid character: expected an optional prefix of `urn:uuid:` followed by [0-9a-fA-F-], found `x` at 1"
            ),
            "tenant: not an id (a UUID such as 0192b7e4-8c3a-7cde-9f01-23456789abcd)"
        );
        assert_eq!(
            r(
                "Invalid URL: UUID parsing failed: invalid length: expected length 32 for simple format, found 3"
            ),
            "not an id (a UUID such as 0192b7e4-8c3a-7cde-9f01-23456789abcd)"
        );
        assert_eq!(
            r(
                "Invalid URL: Cannot parse `id` with value `not-a-tenant`: UUID parsing failed: invalid character: found `n` at 0"
            ),
            "id: not an id (a UUID such as 0192b7e4-8c3a-7cde-9f01-23456789abcd)"
        );
        assert_eq!(
            super::readable_path_rejection(
                "Invalid URL: Cannot parse `id` with value `x`: UUID parsing failed: invalid length"
            ),
            "id: not an id (a UUID such as 0192b7e4-8c3a-7cde-9f01-23456789abcd)"
        );
        assert_eq!(
            super::readable_path_rejection("Invalid URL: UUID parsing failed: invalid length"),
            "path: not an id (a UUID such as 0192b7e4-8c3a-7cde-9f01-23456789abcd)"
        );
        assert_eq!(
            r(
                "Failed to deserialize query string: format: unknown variant `xml`, expected one of `csv`, `jsonl`, `cloudevents`"
            ),
            "format: \"xml\" is not one of csv, jsonl, cloudevents"
        );
        assert_eq!(
            r("Failed to deserialize query string: limit: invalid digit found in string"),
            "limit: not a whole number"
        );
        assert_eq!(
            r("Failed to deserialize query string: from: input contains invalid characters"),
            "from: not a time in RFC 3339 (such as 2026-11-01T00:00:00Z)"
        );
        assert_eq!(
            r(
                "Failed to deserialize the JSON body into the target type: unknown field `nme`, expected one of `name` at line 1 column 7"
            ),
            "nme: not a field of this request"
        );
        assert_eq!(
            r(
                "Failed to deserialize the JSON body into the target type: limits: missing field `rpm` at line 1 column 2"
            ),
            "limits.rpm: required"
        );
        // What it does not know passes, without the preamble.
        assert_eq!(
            r("Failed to deserialize query string: something else went wrong"),
            "something else went wrong"
        );
    }

    #[test]
    fn waits_read_as_people_say_them() {
        assert_eq!(wait_text(0), "1 second");
        assert_eq!(wait_text(1), "1 second");
        assert_eq!(wait_text(2), "2 seconds");
        assert_eq!(wait_text(119), "119 seconds");
        assert_eq!(wait_text(120), "2 minutes");
        assert_eq!(wait_text(900), "15 minutes");
        assert_eq!(wait_text(882), "15 minutes");
    }

    #[test]
    fn every_code_has_a_status_and_a_wire_type() {
        for (code, status, kind) in [
            (ErrorCode::Conflict, 409, "invalid_request_error"),
            (ErrorCode::NotFound, 404, "not_found_error"),
            (ErrorCode::Overloaded, 529, "overloaded_error"),
            (ErrorCode::Unavailable, 503, "api_error"),
        ] {
            assert_eq!(code.status_u16(), status);
            assert_eq!(code.as_str(), kind);
        }
    }
}
