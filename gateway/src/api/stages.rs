//! The stages every handler shares, below the handlers and the cache objects: reading the
//! body, checking the API version, the limits validation checks, rendering a validated
//! request for a principal's scope, and starting and collecting a generation (the one path
//! both wires and cache objects' creation take).

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, StatusCode};
use cachet_common::{RequestId, Scope, Ttl};
use engine::Sampling;

use crate::admission::RateHeaders;
use crate::error::{ApiError, ErrorCode};
use crate::pipeline::{self, Event, Job};
use crate::render;
use crate::state::AppState;
use crate::wire::types::*;
use crate::wire::validate::{self, BlockRef, Breakpoint, ModelLimits};

/// Bodies up to this size are rendered on the async worker; larger ones on the blocking pool.
pub(crate) const INLINE_RENDER_BYTES: usize = 256 * 1024;

/// API versions accepted in `anthropic-version`.
pub const API_VERSIONS: &[&str] = &["2023-06-01", "2023-01-01", "2026-10-21"];

pub(crate) fn check_version(headers: &HeaderMap) -> Result<(), ApiError> {
    match headers
        .get("anthropic-version")
        .map(|v| v.to_str().unwrap_or(""))
    {
        None => Err(ApiError::invalid("anthropic-version: header is required")),
        Some(v) if API_VERSIONS.contains(&v.trim()) => Ok(()),
        Some(v) => Err(ApiError::invalid(format!(
            "anthropic-version: '{v}' is not a supported version; use one of {}",
            API_VERSIONS.join(", ")
        ))),
    }
}

/// Whether reading the body failed on the server's body read timeout.
fn is_body_timeout(r: &BytesRejection) -> bool {
    let mut e: Option<&(dyn std::error::Error + 'static)> = Some(r);
    while let Some(x) = e {
        if x.is::<tower_http::timeout::TimeoutError>() {
            return true;
        }
        e = x.source();
    }
    false
}

pub(crate) fn body_bytes(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|r| {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                ErrorCode::RequestTooLarge,
                "Request exceeds the maximum allowed number of bytes (32 MB).",
            )
        } else if is_body_timeout(&r) {
            crate::metrics::CONNECTION_TIMEOUTS
                .with_label_values(&["body_read"])
                .inc();
            ApiError::new(
                ErrorCode::RequestTimeout,
                "the request body stopped arriving: the server waits at most its body read timeout between pieces",
            )
        } else {
            ApiError::invalid(format!("could not read the request body: {r}"))
        }
    })
}

/// A generation under way: the validated request, its usage and cache report (known before
/// the first token), the rate-limit headers, and the pipeline's events.
pub(crate) struct Started {
    pub req: MessagesRequest,
    pub usage: Usage,
    pub report: CacheReport,
    pub rate: RateHeaders,
    pub diagnostics: Option<serde_json::Value>,
    pub rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
}

/// What a wire asks of a generation besides its Messages body.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Asked {
    /// The client's sampling seed (default: one derived from the request id, so a request
    /// resumed on another node, or retried under its id, generates the same text).
    pub seed: Option<u64>,
    /// Cache diagnostics (the beta header).
    pub diagnose: bool,
    /// Keep what the long-TTL breakpoints write this long (OpenAI's 24h retention).
    pub hold: Option<std::time::Duration>,
}

/// Start generating a validated, rendered request for `principal`: the one path both wires
/// (and cache objects' creation) take.
pub(crate) async fn start_generation(
    state: &AppState,
    rid: RequestId,
    principal: Arc<control::tenants::Principal>,
    shaped: Shaped,
    asked: Asked,
    (start, started_at): (tokio::time::Instant, chrono::DateTime<chrono::Utc>),
) -> Result<Started, ApiError> {
    let Asked {
        seed,
        diagnose,
        hold,
    } = asked;
    let Shaped {
        req,
        engine,
        mut prepared,
        object,
    } = shaped;
    if let Some(h) = hold {
        for pl in &mut prepared.placed {
            if pl.bp.ttl == cachet_common::Ttl::OneHour {
                // An object's own breakpoint keeps its hold: until the object expires.
                pl.bp.hold.get_or_insert(h);
            }
        }
    }
    let diagnose = diagnose.then(|| pipeline::Diagnose {
        message_id: rid.message_id(),
        previous: req
            .diagnostics
            .as_ref()
            .and_then(|d| d.get("previous_message_id"))
            .and_then(|p| p.as_str())
            .map(str::to_string),
    });
    // Generation never runs past the context window: it ends as `max_tokens` there.
    let room = engine
        .info()
        .context_window
        .saturating_sub(prepared.rendered.tokens.len());
    let max_tokens = req.max_tokens.min(u32::try_from(room).unwrap_or(u32::MAX));
    let job = Job {
        request_id: rid,
        started_at,
        start,
        principal,
        engine,
        prepared,
        max_tokens,
        stream: req.stream,
        stop_sequences: req.stop_sequences.clone().unwrap_or_default(),
        sampling: Sampling {
            temperature: req.temperature,
            top_p: req.top_p,
            top_k: req.top_k,
            seed: Some(seed.unwrap_or(rid.0.as_u64_pair().1)),
            ignore_eos: req.ignore_eos,
        },
        diagnose,
    };
    let mut rx = pipeline::spawn(state.clone(), job);
    match rx.recv().await {
        Some(Event::Start {
            usage,
            mut report,
            rate,
            diagnostics,
        }) => Ok(Started {
            report: {
                report.cached_content = object.map(|o| CachedContentReport {
                    status: report
                        .breakpoints
                        .iter()
                        .find(|b| b.location == CACHED_CONTENT)
                        .map(|b| b.status.clone())
                        .unwrap_or_default(),
                    id: o.id,
                    input_tokens: o.input_tokens,
                });
                report
            },
            req,
            usage,
            rate,
            diagnostics,
            rx,
        }),
        Some(Event::Error(e)) => Err(e),
        _ => Err(ApiError::internal("pipeline ended early", "no start event")),
    }
}

/// The answer's text, stop reason and output tokens, from the events after the start.
pub(crate) async fn collect_answer(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<Event>,
) -> Result<(String, engine::StopReason, u64), ApiError> {
    let mut text = String::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Delta(t) => text.push_str(&t),
            Event::Done {
                stop_reason,
                output_tokens,
            } => return Ok((text, stop_reason, output_tokens)),
            Event::Error(e) => return Err(e),
            Event::Start { .. } => {}
        }
    }
    Err(ApiError::internal("pipeline ended early", "no done event"))
}

/// The limits validation checks for `model` (none: an unknown model).
pub(crate) fn model_limits(
    engines: &crate::engines::EnginePool,
    model: &str,
) -> Option<ModelLimits> {
    engines.get(model).map(|e| ModelLimits {
        max_output_tokens: e.info().max_output_tokens,
    })
}

/// Render a validated request with its breakpoints `bps` for `principal`'s scope (`large`:
/// on the blocking pool).
pub(crate) async fn render_for(
    engines: &crate::engines::EnginePool,
    principal: &control::tenants::Principal,
    req: &MessagesRequest,
    bps: Vec<validate::Breakpoint>,
    large: bool,
) -> Result<(Arc<dyn engine::Engine>, render::Prepared), ApiError> {
    let engine = engines
        .get(&req.model)
        .cloned()
        .ok_or_else(|| ApiError::invalid("model: unknown model"))?;
    let scope = Scope {
        tenant: principal.tenant,
        workspace: principal.workspace,
    };
    let prompt = render::to_prompt(
        req.tools.as_deref(),
        req.system.as_ref(),
        &req.messages,
        scope,
    );
    let prepared = if large {
        let e2 = engine.clone();
        tokio::task::spawn_blocking(move || render::prepare(e2.as_ref(), &prompt, &bps, scope))
            .await
            .map_err(|e| ApiError::internal("render task failed", e))??
    } else {
        // Small prompts render (memoized) in tens of microseconds: cheaper than a thread hop.
        render::prepare(engine.as_ref(), &prompt, &bps, scope)?
    };
    Ok((engine, prepared))
}

/// A Messages request validated and rendered for a principal's scope.
pub(crate) struct Shaped {
    pub req: MessagesRequest,
    /// The engine of its model.
    pub engine: Arc<dyn engine::Engine>,
    /// The prompt's tokens, breakpoints and block keys.
    pub prepared: render::Prepared,
    /// The cache object it names in `cached_content`.
    pub object: Option<ObjectUse>,
}

/// A request's use of a cache object: the breakpoint at the object's end.
#[derive(Clone, Debug)]
pub(crate) struct ObjectUse {
    pub id: String,
    pub input_tokens: u64,
    pub end: BlockRef,
    /// Until the object expires: how long a rewrite of its prefix is held.
    pub hold: Duration,
}

impl ObjectUse {
    /// The breakpoint at the object's end: a read when its KV is cached, else a 1h-class
    /// write held until the object expires.
    pub fn breakpoint(&self) -> Breakpoint {
        object_breakpoint(CACHED_CONTENT, self.end, self.hold)
    }
}

/// The breakpoint at a cache object's end (`location`: where it reports), held `hold`.
pub(crate) fn object_breakpoint(location: &str, end: BlockRef, hold: Duration) -> Breakpoint {
    Breakpoint {
        location: location.into(),
        block: end,
        ttl: Ttl::OneHour,
        automatic: false,
        hold: Some(hold),
        object: true,
    }
}
