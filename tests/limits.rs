//! The HTTP server's limits against hostile clients: connections that send nothing, a body
//! declared and never sent, idle keep-alives, one client opening too many connections.
//! Through all of it the service keeps answering everyone else.

mod common;

use std::time::{Duration, Instant};

use common::{Options, TestApp};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn short_limits(c: &mut cachet::config::Config) {
    c.gateway.header_read_timeout_secs = 1;
    c.gateway.body_read_timeout_secs = 1;
    c.gateway.max_connections_per_client = 40;
}

async fn app() -> TestApp {
    TestApp::start_with(Options {
        tweak: short_limits,
        ..Default::default()
    })
    .await
}

fn addr(app: &TestApp) -> String {
    app.url.trim_start_matches("http://").to_string()
}

/// Read until the server closes the connection (or `within` passes); what it sent.
async fn read_to_close(s: &mut TcpStream, within: Duration) -> Option<String> {
    let mut out = Vec::new();
    match tokio::time::timeout(within, s.read_to_end(&mut out)).await {
        Ok(_) => Some(String::from_utf8_lossy(&out).into_owned()),
        Err(_) => None,
    }
}

async fn healthy(app: &TestApp) -> bool {
    matches!(
        tokio::time::timeout(
            Duration::from_secs(5),
            app.client.get(format!("{}/healthz", app.url)).send()
        )
        .await,
        Ok(Ok(r)) if r.status() == 200
    )
}

#[tokio::test]
async fn a_connection_that_sends_nothing_or_idles_is_closed() {
    let app = app().await;
    // Nothing at all: closed after the header read timeout.
    let mut silent = TcpStream::connect(addr(&app)).await.unwrap();
    let t = Instant::now();
    assert!(
        read_to_close(&mut silent, Duration::from_secs(5))
            .await
            .is_some(),
        "a silent connection is closed"
    );
    eprintln!("silent connection closed after {:?}", t.elapsed());
    // Half a request head: the same.
    let mut slow = TcpStream::connect(addr(&app)).await.unwrap();
    slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    assert!(
        read_to_close(&mut slow, Duration::from_secs(5))
            .await
            .is_some()
    );
    // A kept-alive connection idle after one answered request.
    let mut idle = TcpStream::connect(addr(&app)).await.unwrap();
    idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let text = read_to_close(&mut idle, Duration::from_secs(5))
        .await
        .expect("idle keep-alive closed");
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    app.stop().await;
}

#[tokio::test]
async fn a_body_declared_and_not_sent_is_refused_not_waited_for() {
    let app = app().await;
    // Declared larger than the limit: 413 at once, in the API's error shape.
    let mut huge = TcpStream::connect(addr(&app)).await.unwrap();
    huge.write_all(
        format!(
            "POST /v1/messages HTTP/1.1\r\nHost: x\r\nx-api-key: {}\r\ncontent-type: application/json\r\ncontent-length: 1073741824\r\n\r\n{{}}",
            app.key
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(5), huge.read(&mut buf))
        .await
        .expect("answered without waiting for the body")
        .unwrap();
    let text = String::from_utf8_lossy(&buf[..n]);
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    assert!(text.contains("\"type\":\"request_too_large\""), "{text}");
    // Declared within the limit, then stalled: 408 after the body read timeout.
    let mut stalled = TcpStream::connect(addr(&app)).await.unwrap();
    stalled
        .write_all(
            format!(
                "POST /v1/messages HTTP/1.1\r\nHost: x\r\nx-api-key: {}\r\nanthropic-version: 2023-06-01\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{{\"model\"",
                app.key
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    let text = read_to_close(&mut stalled, Duration::from_secs(10))
        .await
        .expect("a stalled body is given up on");
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(
        text.contains("\"type\":\"invalid_request_error\""),
        "{text}"
    );
    app.stop().await;
}

#[tokio::test]
async fn one_client_cannot_take_every_connection() {
    let app = app().await;
    // Far more than the per-client limit (40), all silent.
    let mut held = Vec::new();
    for _ in 0..200 {
        if let Ok(s) = TcpStream::connect(addr(&app)).await {
            held.push(s);
        }
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    // The ones over the limit were closed at once.
    let mut closed = 0;
    for s in &mut held {
        let mut b = [0u8; 1];
        if let Ok(Ok(0)) = tokio::time::timeout(Duration::from_millis(20), s.read(&mut b)).await {
            closed += 1;
        }
    }
    assert!(closed >= 150, "{closed} of 200 closed at accept");
    // Once the held ones go, the same address is served again.
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !healthy(&app).await {
        assert!(Instant::now() < deadline, "service answers again");
    }
    let text = app.metrics().await;
    assert!(
        text.contains("cachet_gateway_connections_refused_total{reason=\"client_limit\"}"),
        "refusals are counted"
    );
    app.stop().await;
}

#[tokio::test]
async fn metrics_are_for_operators_only() {
    let app = TestApp::start_with(Options {
        tweak: |c| c.metrics_token = "an-operator-metrics-token".into(),
        ..Default::default()
    })
    .await;
    let get = |auth: Option<&str>| {
        let mut r = app.client.get(format!("{}/metrics", app.url));
        if let Some(a) = auth {
            r = r.bearer_auth(a);
        }
        r.send()
    };
    let r = get(None).await.unwrap();
    assert_eq!(r.status(), 403);
    let header = r.headers()["request-id"].to_str().unwrap().to_string();
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error"]["type"], "permission_error");
    // An error made away from the request id still carries it, as the header does.
    assert_eq!(v["request_id"], header.as_str());
    assert_eq!(
        get(Some(&app.key)).await.unwrap().status(),
        403,
        "an API key is not enough"
    );
    let r = get(Some("an-operator-metrics-token")).await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(
        r.text()
            .await
            .unwrap()
            .contains("cachet_gateway_connections_open")
    );
    app.stop().await;
}

/// An oversized request head (target, header count, header bytes) is refused with 414 or
/// 431 in the API's error shape, with a request id, before any route runs.
#[tokio::test]
async fn an_oversized_request_head_gets_414_or_431_in_the_error_shape() {
    let app = app().await;
    let check = |resp: reqwest::Response, status: u16| async move {
        assert_eq!(resp.status(), status);
        assert!(resp.headers().contains_key("request-id"));
        let body: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(body["type"], "error", "{body}");
        assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
        assert!(
            body["request_id"]
                .as_str()
                .is_some_and(|r| r.starts_with("req_")),
            "{body}"
        );
    };
    let long = "a".repeat(gateway::server::MAX_URI_BYTES + 1);
    let r = app
        .client
        .get(format!("{}/v1/models?x={long}", app.url))
        .send()
        .await
        .unwrap();
    check(r, 414).await;
    let mut req = app.client.get(format!("{}/v1/models", app.url));
    for i in 0..150 {
        req = req.header(format!("x-h{i}"), "v");
    }
    check(req.send().await.unwrap(), 431).await;
    let r = app
        .client
        .get(format!("{}/v1/models", app.url))
        .header("x-big", "b".repeat(70 * 1024))
        .send()
        .await
        .unwrap();
    check(r, 431).await;
    assert!(healthy(&app).await);
    app.stop().await;
}

/// A gauge's value in the service's metrics text (`None` until it is first set).
fn try_gauge(metrics: &str, name: &str) -> Option<i64> {
    metrics
        .lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as i64)
}

fn gauge(metrics: &str, name: &str) -> i64 {
    try_gauge(metrics, name).unwrap_or_else(|| panic!("no gauge {name} in the metrics"))
}

/// Many streams cancelled mid-way by their clients: every engine slot and journal entry
/// they held is released, each has its ledger row (`client_disconnected`), and the service
/// answers the next request as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn streams_cancelled_mid_way_release_everything_they_held() {
    let app = TestApp::start_with(Options {
        // Real decode speed (2 ms a token) and answers of the whole max_tokens (0.8 s): the
        // streams are mid-answer when dropped, however late a loaded machine runs the client
        // (a sim answer of its own length, 12 to 31 words, could end before the hang-up).
        sim_time_scale: 1.0,
        tweak: |c| {
            c.engine.sim_answer_tokens = 400;
        },
        ..Default::default()
    })
    .await;
    let n = 48;
    let mut tasks = Vec::new();
    for i in 0..n {
        let (client, url, key) = (app.client.clone(), app.url.clone(), app.key.clone());
        tasks.push(tokio::spawn(async move {
            let mut body = common::cached_body(200, &format!("cancel me {i}"), 400);
            body["stream"] = true.into();
            let mut resp = common::messages(&client, &url, &key, &body)
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200);
            // Read until the first text arrives, then hang up.
            let mut seen = String::new();
            while !seen.contains("content_block_delta") {
                match resp.chunk().await.unwrap() {
                    Some(c) => seen.push_str(&String::from_utf8_lossy(&c)),
                    None => panic!("the stream ended before any text: {seen}"),
                }
            }
            assert!(!seen.contains("message_stop"), "cancelled after the end");
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let t = Instant::now();
    loop {
        let m = app.metrics().await;
        let (inflight, open) = (
            gauge(&m, "cachet_gateway_engine_inflight"),
            gauge(&m, "cachet_billing_meter_open_streams"),
        );
        if inflight == 0 && open == 0 {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "still held after the clients left: {inflight} engine slots, {open} open streams"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("{n} cancelled streams released in {:?}", t.elapsed());
    app.settle().await;
    let pool = sqlx::PgPool::connect(&app.db_url).await.unwrap();
    let by_status: Vec<(String, i64)> =
        sqlx::query_as("SELECT status, count(*) FROM usage_events GROUP BY status")
            .fetch_all(&pool)
            .await
            .unwrap();
    pool.close().await;
    assert_eq!(
        by_status,
        vec![("client_disconnected".to_string(), n)],
        "one row per cancelled stream"
    );
    let (s, _, r) = app
        .post(
            "/v1/messages",
            &app.key,
            &common::cached_body(200, "after", 8),
        )
        .await;
    assert_eq!(s, 200, "{r}");
    app.stop().await;
}

/// Clients that open long streams and then read nothing (a 4 KB receive buffer, never
/// drained): generation finishes and frees its engine worker regardless, another tenant is
/// served meanwhile, and each stream has its row (its answer was generated in full).
/// Loopback's send buffers absorb a whole 4096-token answer here, so the server's
/// write-stall timeout is not reached: that timeout is tested on a 64-byte pipe
/// (`gateway/src/server.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn clients_that_stop_reading_hold_no_engine_worker() {
    let app = TestApp::start_with(Options {
        tweak: |c| {
            c.engine.sim_answer_tokens = 4096;
        },
        ..Default::default()
    })
    .await;
    let body = {
        let mut b = common::cached_body(50, "tell me everything", 4096);
        b["stream"] = true.into();
        b.to_string()
    };
    let head = format!(
        "POST /v1/messages HTTP/1.1\r\nhost: x\r\nx-api-key: {}\r\nanthropic-version: 2023-06-01\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n",
        app.key,
        body.len()
    );
    let slow = 12;
    let mut held = Vec::new();
    for _ in 0..slow {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.set_recv_buffer_size(4096).unwrap();
        let mut s = sock.connect(addr(&app).parse().unwrap()).await.unwrap();
        s.write_all(head.as_bytes()).await.unwrap();
        s.write_all(body.as_bytes()).await.unwrap();
        held.push(s); // never read
    }
    // Every generation ends, though no client has read its answer.
    let t = Instant::now();
    loop {
        let inflight = try_gauge(&app.metrics().await, "cachet_gateway_engine_inflight");
        if inflight == Some(0) && t.elapsed() > Duration::from_millis(300) {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "{inflight:?} engine workers held by clients that do not read"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!(
        "{slow} unread 4096-token streams: workers free after {:?}",
        t.elapsed()
    );
    // Another tenant is served while the unread streams are still open.
    let other = app.new_tenant_key().await;
    let mut quick = common::cached_body(50, "hi", 8);
    quick["model"] = "sim-tiny".into();
    let (s, _, r) = app.post("/v1/messages", &other, &quick).await;
    assert_eq!(s, 200, "{r}");
    // Each stream has its row: its answer was generated (and billed) in full.
    app.settle().await;
    assert_eq!(app.ledger_count().await, slow as i64 + 1);
    drop(held);
    app.stop().await;
}
