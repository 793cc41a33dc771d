//! One request's log lines, followed by its `request_id` through the gateway, the fabric and
//! the meter of a real `cachet serve` (JSON logs): every line of the request carries the
//! request id and its tenant, whichever crate wrote it, and the background loops log in
//! spans of their own.

mod common;

use std::time::Duration;

use common::procs::start_serve_logging;
use serde_json::Value;

/// A field of the spans a JSON log line was written in (`spans` lists the current span and
/// every span above it), once per span that has it.
fn span_field<'a>(line: &'a Value, field: &str) -> Vec<&'a str> {
    match line["spans"].as_array() {
        Some(spans) => spans.iter().filter_map(|s| s[field].as_str()).collect(),
        None => line["span"][field].as_str().into_iter().collect(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_request_is_followed_by_its_id_through_gateway_fabric_and_meter() {
    let (db_name, db_url, pool) = common::fresh_db().await;
    let key = common::tenant_with_key(&pool, "spans").await;
    let dir = common::tempdir::Dir::new();
    let log_path = dir.0.join("serve.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let serve = start_serve_logging(
        &db_url,
        &dir.0.join("data"),
        &[
            ("CACHET_LOG_FORMAT", "json"),
            (
                "RUST_LOG",
                "info,sqlx=warn,gateway=debug,cache_fabric=debug,billing=debug",
            ),
        ],
        log.into(),
    );

    let http = reqwest::Client::new();
    let mut ids = Vec::new();
    // The second request reads what the first wrote: both fabric paths are logged.
    for n in 0..2 {
        let body = common::cached_body(300, &format!("question {n}"), 8);
        let resp = common::messages(&http, &serve.url, &key, &body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        ids.push(resp.headers()["request-id"].to_str().unwrap().to_string());
        let body: Value = resp.json().await.unwrap();
        if n == 1 {
            assert!(body["usage"]["cache_read_input_tokens"].as_u64().unwrap() > 0);
        }
    }
    let tenant: uuid::Uuid = sqlx::query_scalar("SELECT tenant_id FROM api_keys LIMIT 1")
        .fetch_one(&pool)
        .await
        .unwrap();
    let tenant = tenant.to_string();

    // Lines are written as they happen; the meter's line comes before the answer ends.
    let mut lines: Vec<Value> = Vec::new();
    for _ in 0..50 {
        lines = std::fs::read_to_string(&log_path)
            .unwrap()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        let done = ids.iter().all(|id| {
            lines.iter().any(|l| {
                span_field(l, "request_id").contains(&id.as_str())
                    && l["fields"]["message"] == "usage journaled"
            })
        });
        if done {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(serve);

    for (n, id) in ids.iter().enumerate() {
        let mine: Vec<&Value> = lines
            .iter()
            .filter(|l| span_field(l, "request_id").contains(&id.as_str()))
            .collect();
        let targets: Vec<&str> = mine.iter().filter_map(|l| l["target"].as_str()).collect();
        for crate_name in ["gateway", "cache_fabric", "billing"] {
            assert!(
                targets
                    .iter()
                    .any(|t| t.split("::").next() == Some(crate_name)),
                "request {n} ({id}) has no {crate_name} line; its lines came from {targets:?}"
            );
        }
        // The request's span names it, and so does the pipeline's (an exported trace shows
        // each span alone): one tenant, whichever spans carry it.
        for l in &mine {
            let named = span_field(l, "tenant_id");
            assert!(
                !named.is_empty() && named.iter().all(|t| *t == tenant.as_str()),
                "every line of the request names its tenant: {l}"
            );
        }
        let messages: Vec<&str> = mine
            .iter()
            .filter_map(|l| l["fields"]["message"].as_str())
            .collect();
        let expected: &[&str] = if n == 0 {
            &[
                "fabric prefix read",
                "fabric entry written",
                "usage journaled",
                "request finished",
            ]
        } else {
            &["fabric prefix read", "usage journaled", "request finished"]
        };
        for m in expected {
            assert!(
                messages.contains(m),
                "request {n}: no {m:?} in {messages:?}"
            );
        }
    }
    let loops: Vec<&str> = lines.iter().flat_map(|l| span_field(l, "task")).collect();
    eprintln!("background loops that logged: {loops:?}");
    assert!(
        loops.contains(&"rollups"),
        "the rollup loop logs in its own span: {loops:?}"
    );
    assert!(
        lines
            .iter()
            .filter(|l| !span_field(l, "task").is_empty())
            .all(|l| span_field(l, "request_id").is_empty()),
        "a background loop's lines are not attributed to a request"
    );
    common::drop_db(&db_name).await;
}

/// JSON log lines of a file (what a process wrote so far).
fn json_lines(path: &std::path::Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// Lines written in the span of request `rid` that name `tenant` once.
fn lines_of<'a>(lines: &'a [Value], rid: &str, tenant: &str) -> Vec<&'a Value> {
    lines
        .iter()
        .filter(|l| span_field(l, "request_id").contains(&rid))
        .filter(|l| span_field(l, "tenant_id") == vec![tenant])
        .collect()
}

const LOGGING: &str = "info,sqlx=warn,gateway=debug,cache_fabric=debug,control=debug,billing=debug";

/// The span opens at the edge for every kind of request, not only the Messages API: an
/// admin's request and finance's on `serve` (the tenant from the path, from the filter), a
/// request the router forwards (the router's lines and the node's share its id and tenant),
/// and a fabric peer's request between nodes (a replica written to the other owner).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_finance_forwarded_and_peer_requests_log_with_request_id_and_tenant() {
    const SECRET: &str = "a-jwt-secret-for-the-spans-test-0123456789abcdef";
    let (db_name, db_url, pool) = common::fresh_db().await;
    let key = common::tenant_with_key(&pool, "edge").await;
    let tenant: uuid::Uuid = sqlx::query_scalar("SELECT tenant_id FROM api_keys LIMIT 1")
        .fetch_one(&pool)
        .await
        .unwrap();
    let tenant_s = tenant.to_string();
    let dir = common::tempdir::Dir::new();
    let http = reqwest::Client::new();
    let jwt = identity::Jwt::new(SECRET.as_bytes()).unwrap();
    let token = |role| {
        jwt.issue("spans", role, None, Duration::from_secs(300))
            .unwrap()
    };

    // An admin's and finance's request on `serve`.
    let serve_log = dir.0.join("serve.log");
    let serve = start_serve_logging(
        &db_url,
        &dir.0.join("serve-data"),
        &[
            ("CACHET_LOG_FORMAT", "json"),
            ("RUST_LOG", LOGGING),
            ("CACHET_ADMIN_JWT_SECRET", SECRET),
        ],
        std::fs::File::create(&serve_log).unwrap().into(),
    );
    let mut asked = Vec::new();
    for (what, url, role) in [
        (
            "admin",
            format!("{}/v1/admin/tenants/{tenant}/policy", serve.url),
            identity::Role::PlatformAdmin,
        ),
        (
            "finance",
            format!(
                "{}/v1/billing/usage?tenant={tenant}&from=2026-01-01T00:00:00Z&to=2027-01-01T00:00:00Z",
                serve.url
            ),
            identity::Role::Finance,
        ),
    ] {
        let resp = http.get(url).bearer_auth(token(role)).send().await.unwrap();
        assert_eq!(resp.status(), 200, "{what}: {:?}", resp.text().await);
        asked.push((
            what,
            resp.headers()["request-id"].to_str().unwrap().to_string(),
        ));
    }
    common::procs::wait_until(
        "the edge lines of serve",
        Duration::from_secs(10),
        async || {
            let lines = json_lines(&serve_log);
            asked
                .iter()
                .all(|(_, rid)| !lines_of(&lines, rid, &tenant_s).is_empty())
        },
    )
    .await;
    drop(serve);

    // A request through the router to a node, whose write reaches the other owner.
    let prefix = format!("cachet-spans-{}", uuid::Uuid::new_v4().simple());
    let env: Vec<(&str, String)> = vec![
        ("DATABASE_URL", db_url.clone()),
        ("CACHET_ENGINE", "sim".into()),
        ("CACHET_LOG_FORMAT", "json".into()),
        ("RUST_LOG", LOGGING.into()),
    ];
    let logs: Vec<std::path::PathBuf> = ["a", "b", "router"]
        .iter()
        .map(|n| dir.0.join(format!("{n}.log")))
        .collect();
    let log = |i: usize| std::fs::File::create(&logs[i]).unwrap().into();
    let nodes = [
        common::procs::start_node_logging("a", &prefix, &dir.0.join("a"), &env, true, log(0)),
        common::procs::start_node_logging("b", &prefix, &dir.0.join("b"), &env, true, log(1)),
    ];
    let router = common::procs::start_gateway_logging(&prefix, &env, log(2));
    common::procs::wait_for_nodes(&http, &router, 2).await;
    let resp = http
        .post(format!("{}/v1/messages", router.url))
        .header("x-api-key", &key)
        .header("anthropic-version", "2023-06-01")
        .json(&common::cached_body(300, "through the router", 8))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let rid = resp.headers()["request-id"].to_str().unwrap().to_string();
    let peer_put = |lines: &[Value]| {
        lines.iter().any(|l| {
            span_field(l, "op") == vec!["put"]
                && span_field(l, "tenant_id") == vec![tenant_s.as_str()]
                && span_field(l, "request_id")
                    .first()
                    .is_some_and(|r| r.starts_with("req_"))
        })
    };
    common::procs::wait_until(
        "the router's, the node's and the peer's lines",
        Duration::from_secs(10),
        async || {
            let router_lines = json_lines(&logs[2]);
            let node_lines: Vec<Value> = logs[..2].iter().flat_map(|p| json_lines(p)).collect();
            !lines_of(&router_lines, &rid, &tenant_s).is_empty()
                && !lines_of(&node_lines, &rid, &tenant_s).is_empty()
                && peer_put(&node_lines)
        },
    )
    .await;
    drop(router);
    drop(nodes);
    let _: () = redis::cmd("DEL")
        .arg(format!("{prefix}:blocks"))
        .query_async(
            &mut redis::Client::open(common::REDIS)
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap(),
        )
        .await
        .unwrap();
    common::drop_db(&db_name).await;
}
