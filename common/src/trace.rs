//! The trace context a request carries from one process to the next: the router to a node
//! (HTTP, the W3C `traceparent` header), a node to its peers (the fabric wire's TRACE frame).
//!
//! Spans are `tracing` spans; when the binary exports traces (OTLP, `OTEL_EXPORTER_OTLP_*`
//! set, see the `cachet` crate's `telemetry`) each also has an OpenTelemetry context and the
//! global propagator is W3C trace context. When nothing is exported the current span has no
//! valid context and the propagator is a no-op: [`traceparent`] is `None`, so nothing extra
//! goes on any wire, and [`adopt`] does nothing.

use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::TraceContextExt;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The W3C header a trace context travels in.
pub const TRACEPARENT: &str = "traceparent";

/// The current span's trace context as a `traceparent` value, when traces are exported and
/// the span is part of one.
pub fn traceparent() -> Option<String> {
    let cx = tracing::Span::current().context();
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut out = One(None);
    opentelemetry::global::get_text_map_propagator(|p| p.inject_context(&cx, &mut out));
    out.0
}

/// Make `span` a child of the span `traceparent` names (the caller's, in another process).
/// A malformed value is ignored: the span starts a trace of its own.
pub fn adopt(span: &tracing::Span, traceparent: &str) {
    let carrier = One(Some(traceparent.to_string()));
    let cx = opentelemetry::global::get_text_map_propagator(|p| p.extract(&carrier));
    if cx.span().span_context().is_valid() {
        let _ = span.set_parent(cx);
    }
}

/// A carrier of the one header Cachet propagates.
struct One(Option<String>);

impl Injector for One {
    fn set(&mut self, key: &str, value: String) {
        if key == TRACEPARENT {
            self.0 = Some(value);
        }
    }
}

impl Extractor for One {
    fn get(&self, key: &str) -> Option<&str> {
        (key == TRACEPARENT).then_some(self.0.as_deref()).flatten()
    }

    fn keys(&self) -> Vec<&str> {
        vec![TRACEPARENT]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_an_exporter_nothing_is_propagated() {
        // No OpenTelemetry layer and no global propagator: no context to carry, and a
        // peer's is ignored without harm.
        let span = tracing::info_span!("request");
        let _g = span.enter();
        assert_eq!(traceparent(), None);
        adopt(
            &span,
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        );
        adopt(&span, "not a traceparent");
        assert_eq!(traceparent(), None);
    }
}
