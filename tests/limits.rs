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
