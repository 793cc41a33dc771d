//! In-flight coalescing through the API: identical cold requests sent at once cost one
//! prefill and one cache write; the others wait for it and are billed reads.

mod common;

use common::{TestApp, cached_body};
use futures::future::join_all;
use serde_json::{Value, json};

/// A prompt of about 4,000 sim tokens with automatic caching, unique to `tag`.
fn cold_body(tag: &str) -> Value {
    let mut b = cached_body(4000, &format!("question about {tag}"), 12);
    b["system"][0]["text"] = json!(format!(
        "{tag} {}",
        b["system"][0]["text"].as_str().unwrap()
    ));
    b
}

/// The engine metrics are process-wide: these tests run one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Coalescing waits that ended with `outcome`, so far in this process.
async fn waits(app: &TestApp, outcome: &str) -> f64 {
    let series = format!("cachet_gateway_coalesced_waits_total{{outcome=\"{outcome}\"}}");
    app.metrics()
        .await
        .lines()
        .find_map(|l| l.strip_prefix(&series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

async fn prefilled_tokens(app: &TestApp) -> f64 {
    app.metrics()
        .await
        .lines()
        .filter(|l| {
            l.starts_with("cachet_engine_tokens_total")
                && l.contains("sim-tiny")
                && l.contains("prefilled")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_identical_cold_requests_cost_one_prefill_and_one_write() {
    let _serial = SERIAL.lock().await;
    // Real prefill time (sim-tiny: 20 µs a token, ~80 ms for this prompt), so the 16 overlap.
    let app = TestApp::start_with(common::Options {
        sim_time_scale: 1.0,
        ..Default::default()
    })
    .await;
    let body = cold_body("sixteen");
    let before = prefilled_tokens(&app).await;
    let answers: Vec<Value> = join_all((0..16).map(|_| async {
        let (s, _, r) = app.post("/v1/messages", &app.key, &body).await;
        assert_eq!(s, 200, "{r}");
        r
    }))
    .await;
    let writers: Vec<&Value> = answers
        .iter()
        .filter(|r| r["usage"]["cache_creation_input_tokens"].as_u64().unwrap() > 0)
        .collect();
    assert_eq!(writers.len(), 1, "exactly one request writes");
    let written = writers[0]["usage"]["cache_creation_input_tokens"]
        .as_u64()
        .unwrap();
    let prompt = common::usage_total(&writers[0]["usage"]);
    let text = &writers[0]["content"][0]["text"];
    let mut coalesced = 0;
    for r in &answers {
        if std::ptr::eq(r, writers[0]) {
            continue;
        }
        assert_eq!(r["usage"]["cache_read_input_tokens"], written, "{r}");
        assert_eq!(r["usage"]["cache_creation_input_tokens"], 0);
        assert_eq!(common::usage_total(&r["usage"]), prompt);
        // Greedy decoding: the same answer as the first.
        assert_eq!(&r["content"][0]["text"], text);
        let status = &r["cachet"]["breakpoints"][0]["status"];
        assert!(status == "coalesced" || status == "read", "{r}");
        coalesced += usize::from(status == "coalesced");
    }
    assert!(
        coalesced > 0,
        "no request waited for the first one's prefill"
    );
    // One prefill: the engine computed the prompt once, plus each reader's uncached tail.
    let tail = prompt - written;
    let computed = prefilled_tokens(&app).await - before;
    assert!(
        computed <= (prompt + 15 * tail) as f64,
        "{computed} tokens prefilled for a {prompt}-token prompt"
    );
    // The ledger: one write, fifteen reads.
    app.settle().await;
    let pool = sqlx::PgPool::connect(&app.db_url).await.unwrap();
    let (writes, reads): (i64, i64) = sqlx::query_as(
        "SELECT COALESCE(sum(cache_write_5m_tokens), 0)::BIGINT, count(*) FILTER (WHERE cache_read_tokens > 0) FROM usage_events",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((writes, reads), (written as i64, 15));
    pool.close().await;
    assert!(
        app.metrics()
            .await
            .contains("cachet_gateway_coalesced_waits_total{outcome=\"landed\"}")
    );
    app.stop().await;
}

/// The first request's client goes away while it prefills: its prefill and write go on, so
/// the requests waiting on it still read it; nobody waits past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cancelled_first_request_leaves_nobody_waiting() {
    let _serial = SERIAL.lock().await;
    let app = TestApp::start_with(common::Options {
        sim_time_scale: 5.0, // ~400 ms of prefill
        ..Default::default()
    })
    .await;
    let mut body = cold_body("cancelled");
    body["stream"] = json!(true);
    let first = {
        let (url, key, b) = (app.url.clone(), app.key.clone(), body.to_string());
        let client = app.client.clone();
        tokio::spawn(async move {
            // Sends, then is dropped (aborted) before any answer: the client is gone.
            let _ = client
                .post(format!("{url}/v1/messages"))
                .header("x-api-key", key)
                .header("anthropic-version", "2023-06-01")
                .header("content-type", "application/json")
                .body(b)
                .send()
                .await;
        })
    };
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    first.abort();
    body["stream"] = json!(false);
    let timed_out = waits(&app, "timed_out").await;
    let answers: Vec<Value> = join_all((0..4).map(|_| async {
        let (s, _, r) = app.post("/v1/messages", &app.key, &body).await;
        assert_eq!(s, 200, "{r}");
        r
    }))
    .await;
    // Every wait ended with the first's write, none at the deadline.
    assert_eq!(waits(&app, "timed_out").await, timed_out);
    for r in &answers {
        assert_eq!(r["usage"]["cache_creation_input_tokens"], 0, "{r}");
        assert!(r["usage"]["cache_read_input_tokens"].as_u64().unwrap() > 0);
    }
    app.stop().await;
}

/// Sends Messages bodies through a gateway: (status, serving node, body).
fn sender(
    http: &reqwest::Client,
    url: &str,
    key: &str,
) -> impl Fn(Value) -> futures::future::BoxFuture<'static, (u16, Option<String>, Value)> + use<> {
    let (http, url, key) = (http.clone(), url.to_string(), key.to_string());
    move |body: Value| {
        let (http, url, key) = (http.clone(), url.clone(), key.clone());
        Box::pin(async move {
            let r = common::messages(&http, &url, &key, &body)
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            let node = r
                .headers()
                .get("x-cachet-node")
                .map(|v| v.to_str().unwrap().to_string());
            (status, node, r.json().await.unwrap_or(Value::Null))
        })
    }
}

struct Cluster {
    prefix: String,
    dir: std::path::PathBuf,
    db_name: String,
    db_url: String,
    pool: sqlx::PgPool,
    key: String,
}

impl Cluster {
    async fn new(name: &str) -> Self {
        let prefix = format!("cachet-test-{}", uuid::Uuid::new_v4().simple());
        let dir = std::env::temp_dir().join(&prefix);
        let (db_name, db_url, pool) = common::fresh_db().await;
        let key = common::tenant_with_key(&pool, name).await;
        Self {
            prefix,
            dir,
            db_name,
            db_url,
            pool,
            key,
        }
    }

    fn env(&self, time_scale: &str) -> Vec<(&'static str, String)> {
        vec![
            ("DATABASE_URL", self.db_url.clone()),
            ("CACHET_ENGINE", "sim".into()),
            ("CACHET_SIM_TIME_SCALE", time_scale.into()),
        ]
    }

    async fn stop(self) {
        self.pool.close().await;
        common::drop_db(&self.db_name).await;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Three nodes behind a gateway: identical cold requests sent at once all go to the node
/// computing their prefix, which writes it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn in_a_cluster_identical_requests_go_to_the_node_computing_them() {
    use common::procs::{start_gateway, start_node_with, wait_for_nodes};
    let _serial = SERIAL.lock().await;
    let c = Cluster::new("cluster-coalesce").await;
    let env = c.env("5"); // ~0.4 s of prefill for this prompt
    let nodes: Vec<_> = ["a", "b", "c"]
        .iter()
        .map(|id| start_node_with(id, &c.prefix, &c.dir, &env, true))
        .collect();
    let gw = start_gateway(&c.prefix, &env);
    let http = reqwest::Client::new();
    wait_for_nodes(&http, &gw, 3).await;
    let send = sender(&http, &gw.url, &c.key);
    let answers = join_all((0..8).map(|_| send(cold_body("cluster")))).await;
    assert!(answers.iter().all(|(s, _, _)| *s == 200), "{answers:?}");
    let writers = answers
        .iter()
        .filter(|(_, _, v)| v["usage"]["cache_creation_input_tokens"].as_u64().unwrap() > 0)
        .count();
    assert_eq!(writers, 1, "{answers:?}");
    let served: std::collections::HashSet<_> = answers.iter().map(|(_, n, _)| n.clone()).collect();
    assert_eq!(served.len(), 1, "all went to one node: {served:?}");

    // OpenAI's wire through the gateway: the same prompt, routed to the same prefix, read.
    let b = cold_body("cluster");
    let chat = json!({
        "model": "sim-tiny", "max_completion_tokens": 12,
        "messages": [{"role": "system", "content": b["system"][0]["text"]},
                     {"role": "user", "content": b["messages"][0]["content"]}],
    });
    let written = answers
        .iter()
        .find_map(|(_, _, v)| {
            v["usage"]["cache_creation_input_tokens"]
                .as_u64()
                .filter(|n| *n > 0)
        })
        .unwrap();
    let oai = |stream: bool| {
        let mut body = chat.clone();
        if stream {
            body["stream"] = json!(true);
            body["stream_options"] = json!({"include_usage": true});
        }
        http.post(format!("{}/v1/chat/completions", gw.url))
            .bearer_auth(&c.key)
            .json(&body)
            .send()
    };
    let r = oai(false).await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"], written,
        "{v}"
    );
    let text = oai(true).await.unwrap().text().await.unwrap();
    assert!(
        text.contains("chat.completion.chunk") && text.trim_end().ends_with("data: [DONE]"),
        "{text}"
    );
    // Everything the first chat request left (its prompt to the end) is read now.
    assert!(text.contains("\"cache_write_tokens\":0"), "{text}");
    // prompt_cache_key: new prefixes with one key land on one node (a hint within the tenant).
    let mut nodes_for_key = std::collections::HashSet::new();
    for i in 0..4 {
        let mut body = chat.clone();
        body["messages"][0]["content"] = json!(format!(
            "fresh {i} {}",
            b["system"][0]["text"].as_str().unwrap()
        ));
        body["prompt_cache_key"] = json!("team-a");
        let r = http
            .post(format!("{}/v1/chat/completions", gw.url))
            .bearer_auth(&c.key)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        nodes_for_key.insert(r.headers()["x-cachet-node"].to_str().unwrap().to_string());
    }
    assert_eq!(nodes_for_key.len(), 1, "{nodes_for_key:?}");
    // Its errors keep OpenAI's shape on the gateway too.
    let mut bad = chat.clone();
    bad["n"] = json!(3);
    let r = http
        .post(format!("{}/v1/chat/completions", gw.url))
        .bearer_auth(&c.key)
        .json(&bad)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["param"], "n", "{v}");
    drop(gw);
    drop(nodes);
    c.stop().await;
}

/// The node computing a prefix is killed while requests wait on it: the gateway moves each
/// of them to another node, which serves them; nobody waits past the death.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn in_a_cluster_the_death_of_the_computing_node_strands_nobody() {
    use common::procs::{start_gateway, start_node_with, wait_for_nodes};
    let _serial = SERIAL.lock().await;
    let c = Cluster::new("cluster-kill").await;
    let env = c.env("100"); // ~8 s of prefill: time to add a node and kill the first
    let mut a = Some(start_node_with("a", &c.prefix, &c.dir, &env, true));
    let gw = start_gateway(&c.prefix, &env);
    let http = reqwest::Client::new();
    wait_for_nodes(&http, &gw, 1).await;
    let send = sender(&http, &gw.url, &c.key);
    let body = cold_body("killed");
    // The first request can only go to a, which starts computing the prefix.
    let first = tokio::spawn(send(body.clone()));
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let b = start_node_with("b", &c.prefix, &c.dir, &env, true);
    wait_for_nodes(&http, &gw, 2).await;
    // These follow the first onto a, and wait there.
    let rest = tokio::spawn(join_all((0..4).map(|_| send(body.clone()))));
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    drop(a.take());
    let mut all = vec![first.await.unwrap()];
    all.extend(rest.await.unwrap());
    for (s, node, v) in &all {
        assert_eq!(*s, 200, "{v}");
        assert_eq!(node.as_deref(), Some("b"), "served by the survivor");
    }
    // b computed the prefix once for all of them.
    let writers = all
        .iter()
        .filter(|(_, _, v)| v["usage"]["cache_creation_input_tokens"].as_u64().unwrap() > 0)
        .count();
    assert!(writers >= 1);
    drop(gw);
    drop(b);
    c.stop().await;
}
