//! Logs and traces out. Logs go to stderr (text or JSON lines, `RUST_LOG` filters them). The
//! request spans also go out over OTLP (HTTP, protobuf) when the standard variables ask for it:
//! `OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, with the SDK's own
//! `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_EXPORTER_OTLP_HEADERS`,
//! `OTEL_TRACES_SAMPLER`, `OTEL_BSP_*` and `OTEL_SDK_DISABLED` honoured as the
//! specification says. Only Cachet's own spans are exported (the request at each process's
//! edge, its pipeline, a peer's fabric request), not the background loops', and of events only
//! warnings and errors, as span events.
//!
//! The trace crosses processes in `traceparent`: the router's HTTP request to a node and the
//! fabric wire's TRACE frame ([`cachet_common::trace`]). The exporter sends with Cachet's own
//! HTTP client (reqwest, on the process's Tokio runtime), so no second HTTP stack is built in
//! (decision 0035).

use std::time::Duration;

use anyhow::Context;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_http::{Bytes, HttpClient, HttpError, Request, Response};
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::Level;
use tracing::Subscriber;
use tracing_subscriber::Layer;
use tracing_subscriber::layer::{Context as LayerContext, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;

/// The crates whose spans are Cachet's (what an exported trace is made of).
const OWN_TARGETS: [&str; 9] = [
    "cachet",
    "gateway",
    "cache_fabric",
    "billing",
    "control",
    "identity",
    "engine",
    "loadtests",
    "cachet_common",
];

/// Which process this is, for the traces' resource (`service.name` unless
/// `OTEL_SERVICE_NAME` says otherwise; `service.instance.id` for a node).
pub struct Role<'a> {
    pub name: &'static str,
    pub instance: Option<&'a str>,
}

/// What must happen before the process exits: the spans still queued sent.
#[must_use = "call shutdown before exiting, or queued spans are lost"]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Send what is queued and stop the exporter (waits up to its timeout).
    pub async fn shutdown(self) {
        if let Some(p) = self.provider {
            let done = tokio::task::spawn_blocking(move || p.shutdown()).await;
            if let Ok(Err(e)) = done {
                tracing::warn!(error = %e, "trace exporter did not shut down cleanly");
            }
        }
    }
}

/// Start logging (JSON lines when `json`) and, for a serving `role` whose environment names an
/// OTLP endpoint, trace export. Call from within the Tokio runtime.
pub fn init(json: bool, role: Option<Role<'_>>) -> anyhow::Result<Telemetry> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,sqlx=warn"));
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let fmt = if json {
        fmt.json().boxed()
    } else {
        fmt.boxed()
    };
    let provider = match role {
        Some(role) if exporting_asked() => Some(provider(&role)?),
        _ => None,
    };
    let otel = provider.as_ref().map(|p| {
        opentelemetry::global::set_text_map_propagator(
            opentelemetry_sdk::propagation::TraceContextPropagator::new(),
        );
        OwnSpans(tracing_opentelemetry::layer().with_tracer(p.tracer("cachet")))
    });
    // One filter for the whole stack (`RUST_LOG`): the traces see the spans the logs do.
    tracing_subscriber::registry()
        .with(filter)
        .with(fmt)
        .with(otel)
        .try_init()
        .context("starting logging")?;
    if provider.is_some() {
        tracing::info!("exporting traces over OTLP");
    }
    Ok(Telemetry { provider })
}

/// Whether the environment asks for traces: an OTLP endpoint named, the SDK not disabled, the
/// traces exporter not `none`.
fn exporting_asked() -> bool {
    let set = |k: &str| std::env::var(k).is_ok_and(|v| !v.trim().is_empty());
    let disabled = std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.eq_ignore_ascii_case("true"));
    let none = std::env::var("OTEL_TRACES_EXPORTER").is_ok_and(|v| v.trim() == "none");
    (set("OTEL_EXPORTER_OTLP_ENDPOINT") || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
        && !disabled
        && !none
}

/// The OpenTelemetry layer, shown only what [`exported`] lets out. A wrapper rather than a
/// per-layer filter (`Layer::with_filter`): a per-layer filter keeps its verdict in a
/// thread-local between `enabled` and the span or event it was asked about, and the `log`
/// bridge asks without logging, so the next span on that thread went missing for every layer
/// (a node's request spans were never logged nor exported). Spans it never sees carry no
/// OpenTelemetry data, which the layer's other callbacks skip.
struct OwnSpans<L>(L);

impl<S, L> Layer<S> for OwnSpans<L>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    L: Layer<S>,
{
    fn on_register_dispatch(&self, subscriber: &tracing::Dispatch) {
        self.0.on_register_dispatch(subscriber);
    }

    fn on_layer(&mut self, subscriber: &mut S) {
        self.0.on_layer(subscriber);
    }

    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        id: &tracing::span::Id,
        ctx: LayerContext<'_, S>,
    ) {
        if exported(attrs.metadata()) {
            self.0.on_new_span(attrs, id, ctx);
        }
    }

    fn on_record(
        &self,
        span: &tracing::span::Id,
        values: &tracing::span::Record<'_>,
        ctx: LayerContext<'_, S>,
    ) {
        self.0.on_record(span, values, ctx);
    }

    fn on_follows_from(
        &self,
        span: &tracing::span::Id,
        follows: &tracing::span::Id,
        ctx: LayerContext<'_, S>,
    ) {
        self.0.on_follows_from(span, follows, ctx);
    }

    fn on_event(&self, event: &tracing::Event<'_>, ctx: LayerContext<'_, S>) {
        if exported(event.metadata()) {
            self.0.on_event(event, ctx);
        }
    }

    fn on_enter(&self, id: &tracing::span::Id, ctx: LayerContext<'_, S>) {
        self.0.on_enter(id, ctx);
    }

    fn on_exit(&self, id: &tracing::span::Id, ctx: LayerContext<'_, S>) {
        self.0.on_exit(id, ctx);
    }

    fn on_close(&self, id: tracing::span::Id, ctx: LayerContext<'_, S>) {
        self.0.on_close(id, ctx);
    }

    fn on_id_change(
        &self,
        old: &tracing::span::Id,
        new: &tracing::span::Id,
        ctx: LayerContext<'_, S>,
    ) {
        self.0.on_id_change(old, new, ctx);
    }

    // SAFETY: the pointer returned for `Self` is to `self`, of that type; any other type is
    // answered by the wrapped layer, whose own `downcast_raw` upholds the same contract
    // (`OpenTelemetrySpanExt` finds the layer's context getter this way).
    unsafe fn downcast_raw(&self, id: std::any::TypeId) -> Option<*const ()> {
        if id == std::any::TypeId::of::<Self>() {
            Some(self as *const Self as *const ())
        } else {
            // SAFETY: as above.
            unsafe { self.0.downcast_raw(id) }
        }
    }
}

/// What goes out: Cachet's spans at info and above but the background loops', and warnings
/// and errors inside them.
fn exported(m: &tracing::Metadata<'_>) -> bool {
    exports(m.target(), m.name(), *m.level(), m.is_span())
}

fn exports(target: &str, name: &str, level: Level, span: bool) -> bool {
    let own = OWN_TARGETS.iter().any(|t| {
        target
            .strip_prefix(t)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with("::"))
    });
    if !own {
        false
    } else if span {
        level <= Level::INFO && name != "background"
    } else {
        level <= Level::WARN
    }
}

/// The tracer provider: a batch of spans at a time to the OTLP endpoint.
fn provider(role: &Role<'_>) -> anyhow::Result<SdkTracerProvider> {
    let timeout = otlp_timeout();
    let http = OtlpHttp {
        client: reqwest::Client::builder()
            .timeout(timeout)
            .build()
            .context("building the OTLP HTTP client")?,
        rt: tokio::runtime::Handle::current(),
    };
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(http)
        .with_timeout(timeout)
        .build()
        .context(
            "starting the OTLP trace exporter (Cachet sends OTLP over HTTP: \
             OTEL_EXPORTER_OTLP_PROTOCOL must be http/protobuf or unset)",
        )?;
    let mut resource = Resource::builder();
    if std::env::var("OTEL_SERVICE_NAME").is_err() {
        resource = resource.with_service_name(format!("cachet-{}", role.name));
    }
    let mut attrs = vec![
        opentelemetry::KeyValue::new("cachet.role", role.name),
        opentelemetry::KeyValue::new("service.version", env!("CARGO_PKG_VERSION")),
    ];
    if let Some(id) = role.instance {
        attrs.push(opentelemetry::KeyValue::new(
            "service.instance.id",
            id.to_string(),
        ));
    }
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.with_attributes(attrs).build())
        .build())
}

/// The export timeout the specification's variables give (milliseconds), 10 s by default.
fn otlp_timeout() -> Duration {
    [
        "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
        "OTEL_EXPORTER_OTLP_TIMEOUT",
    ]
    .iter()
    .find_map(|k| std::env::var(k).ok()?.trim().parse::<u64>().ok())
    .map_or(Duration::from_secs(10), Duration::from_millis)
}

/// The exporter's HTTP client: reqwest on the process's runtime. The SDK exports from a
/// thread of its own, outside the runtime, so each request is spawned onto the runtime and
/// awaited from there.
#[derive(Debug)]
struct OtlpHttp {
    client: reqwest::Client,
    rt: tokio::runtime::Handle,
}

#[async_trait::async_trait]
impl HttpClient for OtlpHttp {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let request = reqwest::Request::try_from(request.map(reqwest::Body::from))?;
        let client = self.client.clone();
        let sent = self.rt.spawn(async move {
            let resp = client.execute(request).await?;
            let mut out = Response::builder().status(resp.status());
            if let Some(h) = out.headers_mut() {
                *h = resp.headers().clone();
            }
            Ok::<_, HttpError>(out.body(resp.bytes().await?)?)
        });
        sent.await?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_own_request_spans_and_warnings_are_exported() {
        assert!(exports("cachet_common::span", "request", Level::INFO, true));
        assert!(exports(
            "cache_fabric::transport",
            "peer_request",
            Level::INFO,
            true
        ));
        assert!(exports("gateway::pipeline", "pipeline", Level::INFO, true));
        assert!(!exports("cachet", "background", Level::INFO, true));
        assert!(!exports("gateway::x", "detail", Level::DEBUG, true));
        assert!(!exports("sqlx::query", "query", Level::INFO, true));
        assert!(!exports("cachetx", "request", Level::INFO, true));
        assert!(!exports("gateway::pipeline", "event", Level::INFO, false));
        assert!(exports("gateway::pipeline", "event", Level::WARN, false));
    }
}
