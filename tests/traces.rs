//! Traces out: a `cachet router` and two `cachet node`s export their spans over OTLP (HTTP,
//! protobuf) to a receiver this test runs, decoding what arrives with the OpenTelemetry
//! protocol's own message definitions (`opentelemetry-proto`). One request through the router
//! is one trace: the router's span, the node's request and pipeline spans, and the fabric
//! span of the peer node its blocks were replicated to, each the child of the one before, in
//! three processes, every one naming the tenant.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use common::procs::{start_gateway, start_node_with, wait_for_nodes, wait_until};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use prost::Message;

/// A span as received, with its process's resource attributes.
#[derive(Clone, Debug)]
struct Got {
    service: String,
    instance: Option<String>,
    trace: Vec<u8>,
    id: Vec<u8>,
    parent: Vec<u8>,
    name: String,
    attrs: Vec<(String, String)>,
}

impl Got {
    fn attr(&self, key: &str) -> Option<&str> {
        self.attrs
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

fn text(v: &Option<AnyValue>) -> String {
    match v.as_ref().and_then(|v| v.value.as_ref()) {
        Some(any_value::Value::StringValue(s)) => s.clone(),
        Some(any_value::Value::IntValue(i)) => i.to_string(),
        Some(any_value::Value::BoolValue(b)) => b.to_string(),
        Some(any_value::Value::DoubleValue(d)) => d.to_string(),
        other => format!("{other:?}"),
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn pairs(kv: &[KeyValue]) -> Vec<(String, String)> {
    kv.iter()
        .map(|kv| (kv.key.clone(), text(&kv.value)))
        .collect()
}

/// An OTLP/HTTP trace receiver on a port of its own: every span posted to `/v1/traces`.
async fn receiver() -> (String, Arc<Mutex<Vec<Got>>>) {
    let got: Arc<Mutex<Vec<Got>>> = Arc::default();
    let sink = got.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |headers: axum::http::HeaderMap, body: Bytes| {
            let sink = sink.clone();
            async move {
                assert_eq!(headers["content-type"], "application/x-protobuf");
                let req = ExportTraceServiceRequest::decode(body).expect("an OTLP trace export");
                let mut sink = sink.lock().unwrap();
                for rs in req.resource_spans {
                    let res = pairs(&rs.resource.map(|r| r.attributes).unwrap_or_default());
                    let find = |k: &str| res.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
                    for ss in rs.scope_spans {
                        for s in ss.spans {
                            sink.push(Got {
                                service: find("service.name").unwrap_or_default(),
                                instance: find("service.instance.id"),
                                trace: s.trace_id,
                                id: s.span_id,
                                parent: s.parent_span_id,
                                name: s.name,
                                attrs: pairs(&s.attributes),
                            });
                        }
                    }
                }
                (
                    [("content-type", "application/x-protobuf")],
                    ExportTraceServiceResponse::default().encode_to_vec(),
                )
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), got)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_request_is_one_trace_from_router_to_node_to_fabric_with_its_tenant() {
    let (endpoint, got) = receiver().await;
    let (db_name, db_url, pool) = common::fresh_db().await;
    let key = common::tenant_with_key(&pool, "traces").await;
    let tenant: uuid::Uuid = sqlx::query_scalar("SELECT tenant_id FROM api_keys LIMIT 1")
        .fetch_one(&pool)
        .await
        .unwrap();
    let prefix = format!("cachet-test-{}", uuid::Uuid::new_v4().simple());
    let dir = common::tempdir::Dir::new();
    let env: Vec<(&str, String)> = vec![
        ("DATABASE_URL", db_url.clone()),
        ("CACHET_ENGINE", "sim".into()),
        ("CACHET_SIM_TIME_SCALE", "0.2".into()),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.clone()),
        // Spans go out a fifth of a second after they end, not the default 5 s.
        ("OTEL_BSP_SCHEDULE_DELAY", "200".into()),
    ];
    // Two nodes: with two copies of every block, whichever node serves the request pushes
    // its blocks to the other over the fabric wire.
    let _n1 = start_node_with("n1", &prefix, &dir.0, &env, true);
    let _n2 = start_node_with("n2", &prefix, &dir.0, &env, true);
    let gw = start_gateway(&prefix, &env);
    let http = reqwest::Client::new();
    wait_for_nodes(&http, &gw, 2).await;
    // The nodes read the membership every 0.5 s: let each see the other, so the write below
    // goes to its second owner at once (not later, by a background repair).
    tokio::time::sleep(Duration::from_secs(2)).await;

    let body = common::cached_body(300, "a traced question", 8);
    let resp = common::messages(&http, &gw.url, &key, &body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let rid = resp.headers()["request-id"].to_str().unwrap().to_string();
    let answer: serde_json::Value = resp.json().await.unwrap();
    let written = answer["usage"]["cache_creation_input_tokens"]
        .as_u64()
        .unwrap();
    assert!(written >= 300, "{answer}");

    // The trace of this request: the router's span (its request id) is the root.
    let trace = |spans: &[Got]| -> Option<Vec<Got>> {
        let root = spans.iter().find(|s| {
            s.service == "cachet-router"
                && s.name == "request"
                && s.attr("request_id") == Some(rid.as_str())
        })?;
        Some(
            spans
                .iter()
                .filter(|s| s.trace == root.trace)
                .cloned()
                .collect(),
        )
    };
    let complete = |t: &[Got]| {
        ["request", "pipeline", "peer_request"]
            .iter()
            .all(|n| t.iter().any(|s| s.name == *n && s.service == "cachet-node"))
    };
    let waited = tokio::time::timeout(
        Duration::from_secs(20),
        wait_until(
            "the request's spans from the router, the node and its peer",
            Duration::from_secs(30),
            async || trace(&got.lock().unwrap()).is_some_and(|t| complete(&t)),
        ),
    )
    .await;
    if waited.is_err() {
        let got = got.lock().unwrap();
        let seen: Vec<_> = got
            .iter()
            .map(|s| (&s.service, &s.name, hex(&s.trace), s.attr("request_id")))
            .collect();
        panic!("the request's trace never completed; spans received: {seen:#?}");
    }
    let spans = trace(&got.lock().unwrap()).unwrap();

    // Every span of the trace names the tenant.
    let tenant = tenant.to_string();
    for s in &spans {
        assert_eq!(s.attr("tenant_id"), Some(tenant.as_str()), "{s:?}");
    }
    // Router → node → pipeline → the peer's fabric request, parent by parent.
    let one = |service: &str, name: &str| -> &Got {
        spans
            .iter()
            .find(|s| s.service == service && s.name == name)
            .unwrap_or_else(|| panic!("no {name} span of {service}"))
    };
    let root = one("cachet-router", "request");
    assert!(root.parent.is_empty(), "the router's span starts the trace");
    assert_eq!(root.attr("route"), Some("/v1/messages"));
    assert_eq!(root.attr("status"), Some("200"));
    let node = spans
        .iter()
        .find(|s| s.service == "cachet-node" && s.name == "request")
        .unwrap();
    assert_eq!(
        node.parent, root.id,
        "the node's span is the router's child"
    );
    assert_eq!(node.attr("request_id"), Some(rid.as_str()));
    assert!(node.attr("workspace_id").is_some(), "{node:?}");
    let served_by = node.instance.clone().expect("a node names itself");
    let pipeline = spans
        .iter()
        .find(|s| s.name == "pipeline")
        .expect("the pipeline's span");
    assert_eq!(pipeline.parent, node.id);
    assert_eq!(pipeline.instance.as_deref(), Some(served_by.as_str()));
    assert_eq!(pipeline.attr("model"), Some("sim-tiny"));
    assert_eq!(
        pipeline.attr("cache_creation_input_tokens"),
        Some(written.to_string().as_str())
    );
    assert_eq!(pipeline.attr("cache_read_input_tokens"), Some("0"));
    assert_eq!(pipeline.attr("output_tokens"), Some("8"), "{pipeline:?}");
    let fabric = spans
        .iter()
        .find(|s| s.name == "peer_request" && s.attr("op") == Some("put"))
        .expect("the replica push's span on the peer");
    assert_eq!(
        fabric.parent, pipeline.id,
        "the peer's span is the pipeline's child"
    );
    assert_ne!(
        fabric.instance.as_deref(),
        Some(served_by.as_str()),
        "the fabric span is the other node's"
    );
    // The background loops' spans are not exported.
    assert!(
        !got.lock().unwrap().iter().any(|s| s.name == "background"),
        "background spans were exported"
    );

    // A second request reads the prefix: its pipeline span says so.
    let body = common::cached_body(300, "a second traced question", 8);
    let resp = common::messages(&http, &gw.url, &key, &body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let rid2 = resp.headers()["request-id"].to_str().unwrap().to_string();
    wait_until(
        "the second request's pipeline span",
        Duration::from_secs(20),
        async || {
            got.lock()
                .unwrap()
                .iter()
                .any(|s| s.name == "request" && s.attr("request_id") == Some(rid2.as_str()))
                && got.lock().unwrap().iter().any(|s| {
                    s.name == "pipeline"
                        && s.attr("cache_read_input_tokens") == Some(&*written.to_string())
                })
        },
    )
    .await;
    drop(gw);
    common::drop_db(&db_name).await;
}
