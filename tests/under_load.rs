//! Under real load, on real processes, Postgres and Redis: memory stays within its configured
//! bounds however long the prompts; an exhausted KV budget answers 529 with its reason and
//! loses no ledger row; the conductor admits a long prompt on an idle cluster and learns a
//! node's prefill rate; one tenant's long generations do not starve another tenant.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::procs::{start_gateway, start_node_with, start_serve, wait_for_nodes, wait_until};
use serde_json::{Value, json};

const MIB: u64 = 1 << 20;

/// A prompt of about `tokens` sim tokens (one short word each), distinct per `salt`.
fn words(tokens: usize, salt: &str) -> String {
    let mut s = format!("{salt} ");
    for i in 0..tokens.saturating_sub(1) {
        s.push_str(["cache", "prefix", "block", "token", "query"][i % 5]);
        s.push(' ');
    }
    s
}

/// A Messages request: a cached system prompt, then a cached user turn.
fn body(model: &str, system: &str, user: &str, max_tokens: u32) -> Value {
    json!({
        "model": model,
        "max_tokens": max_tokens,
        "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": user, "cache_control": {"type": "ephemeral"}}
        ]}],
    })
}

struct Answer {
    status: u16,
    request_id: String,
    retry_after: Option<String>,
    body: Value,
}

async fn post(http: &reqwest::Client, url: &str, key: &str, body: &Value) -> Answer {
    let r = common::messages(http, url, key, body).send().await.unwrap();
    let status = r.status().as_u16();
    let header = |n: &str| {
        r.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let request_id = header("request-id").unwrap_or_default();
    let retry_after = header("retry-after");
    let body = r.json().await.unwrap_or(Value::Null);
    Answer {
        status,
        request_id,
        retry_after,
        body,
    }
}

/// The process's peak resident memory so far (VmHWM), in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap()
        * 1024
}

/// Every answered request has exactly its ledger row, with the usage its client was told;
/// nothing else is in the ledger.
async fn ledger_matches(pool: &sqlx::PgPool, answered: &[&Answer]) {
    let ids: Vec<uuid::Uuid> = answered
        .iter()
        .map(|a| {
            a.request_id
                .parse::<cachet_common::RequestId>()
                .unwrap_or_else(|e| panic!("request id {:?}: {e}", a.request_id))
                .0
        })
        .collect();
    wait_until(
        "every answered request's ledger row",
        Duration::from_secs(30),
        async || {
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM usage_events")
                .fetch_one(pool)
                .await
                .unwrap();
            n as usize >= answered.len()
        },
    )
    .await;
    let rows: Vec<(uuid::Uuid, i64, i64, i64, i64)> = sqlx::query_as(
        "SELECT request_id, input_tokens, cache_write_5m_tokens, cache_read_tokens, output_tokens \
         FROM usage_events",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), answered.len(), "one row per answer, no other");
    let by_id: HashMap<uuid::Uuid, (i64, i64, i64, i64)> = rows
        .into_iter()
        .map(|(id, a, b, c, d)| (id, (a, b, c, d)))
        .collect();
    for (a, id) in answered.iter().zip(&ids) {
        let u = &a.body["usage"];
        let told = (
            u["input_tokens"].as_i64().unwrap(),
            u["cache_creation_input_tokens"].as_i64().unwrap(),
            u["cache_read_input_tokens"].as_i64().unwrap(),
            u["output_tokens"].as_i64().unwrap(),
        );
        assert_eq!(by_id.get(id), Some(&told), "{}", a.request_id);
    }
}

/// Long prompts at once against `cachet serve` with a 512 MiB KV budget and a 512 MiB DRAM
/// tier: a 120K-token prompt on sim-llama-8b alone is 15 GiB of KV. Every prompt is answered
/// (the breakpoints whose blocks exceed the budget are not written, and not billed as
/// writes), one over the context window is a 400 naming the limit, the process's peak RSS
/// stays within its bounds, and the ledger holds exactly what the clients were told.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn long_prompts_are_answered_within_the_memory_bounds() {
    let (db_name, db_url, pool) = common::fresh_db().await;
    let key = common::tenant_with_key(&pool, "long").await;
    let dir = common::tempdir::Dir::new();
    let budget = 512 * MIB;
    let dram = 512 * MIB;
    let serve = start_serve(
        &db_url,
        &dir.0,
        &[
            ("CACHET_KV_BUDGET_BYTES", &budget.to_string()),
            ("CACHET_DRAM_CAPACITY_BYTES", &dram.to_string()),
            // No disk tier: every eviction of the 128K-token prompt's 16 GiB of KV would be
            // written to disk, which costs time and says nothing of memory.
            ("CACHET_DISK_CAPACITY_BYTES", "0"),
            ("CACHET_SIM_TIME_SCALE", "0"),
            ("CACHET_ENGINE_WORKERS", "4"),
        ],
    );
    let http = reqwest::Client::new();
    let base = peak_rss(serve.child.id());
    // One shared 2K-token system prompt (256 MiB of KV: it fits), then user turns of 1K to
    // 120K tokens (128 MiB to 15 GiB).
    let system = words(2_000, "system");
    let sizes = [1_000usize, 16_000, 32_000, 64_000, 120_000];
    let sends = sizes.iter().map(|&n| {
        let b = body("sim-llama-8b", &system, &words(n, &format!("user{n}")), 4);
        let (http, url, key) = (http.clone(), serve.url.clone(), key.clone());
        async move { post(&http, &url, &key, &b).await }
    });
    let answers: Vec<Answer> = futures::future::join_all(sends).await;
    for (a, n) in answers.iter().zip(sizes) {
        assert_eq!(a.status, 200, "{n} tokens: {}", a.body);
    }
    let longest = answers.last().unwrap();
    let report = &longest.body["cachet"]["breakpoints"];
    assert_eq!(
        report[1]["reason"], "kv_budget",
        "the 120K-token turn's blocks exceed the whole budget: {report}"
    );
    assert!(
        longest.body["usage"]["cache_creation_input_tokens"]
            .as_u64()
            .unwrap()
            < 3_000,
        "an entry not written is not billed as a write: {}",
        longest.body["usage"]
    );
    // Over the model's context window: a 400 that names the limit.
    let over = post(
        &http,
        &serve.url,
        &key,
        &body("sim-llama-8b", "s", &words(140_000, "over"), 4),
    )
    .await;
    assert_eq!(over.status, 400, "{}", over.body);
    let msg = over.body["error"]["message"].as_str().unwrap();
    assert!(msg.contains("131072"), "{msg}");

    let peak = peak_rss(serve.child.id());
    eprintln!(
        "peak RSS {} MiB (at start {} MiB); bounds: KV budget {} MiB + DRAM tier {} MiB",
        peak / MIB,
        base / MIB,
        budget / MIB,
        dram / MIB
    );
    // The bounded consumers, plus what the process had before the load and room for
    // request bodies, tokens and the allocator's slack.
    assert!(
        peak <= base + budget + dram + 256 * MIB,
        "peak RSS {} MiB over the bounds",
        peak / MIB
    );
    let answered: Vec<&Answer> = answers.iter().collect();
    ledger_matches(&pool, &answered).await;
    drop(serve);
    pool.close().await;
    common::drop_db(&db_name).await;
}

/// A KV budget too small for the requests arriving together: those that cannot get their
/// share within the wait are answered 529 with the reason and a `retry-after`; the rest are
/// served; the server stays up; the ledger has a row for each answer and none for refusals.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_exhausted_kv_budget_answers_529_and_loses_no_row() {
    let (db_name, db_url, pool) = common::fresh_db().await;
    let key = common::tenant_with_key(&pool, "budget").await;
    let dir = common::tempdir::Dir::new();
    let serve = start_serve(
        &db_url,
        &dir.0,
        &[
            ("CACHET_KV_BUDGET_BYTES", &(256 * MIB).to_string()),
            ("CACHET_KV_BUDGET_WAIT_MS", "100"),
            // 60 µs a token: a 1,500-token prefill holds its 187 MiB for about 90 ms.
            ("CACHET_SIM_TIME_SCALE", "1"),
        ],
    );
    let http = reqwest::Client::new();
    let sends = (0..12).map(|i| {
        let b = body(
            "sim-llama-8b",
            &words(1_500, &format!("s{i}")),
            "question",
            2,
        );
        let (http, url, key) = (http.clone(), serve.url.clone(), key.clone());
        async move { post(&http, &url, &key, &b).await }
    });
    let answers: Vec<Answer> = futures::future::join_all(sends).await;
    let refused: Vec<&Answer> = answers.iter().filter(|a| a.status == 529).collect();
    let served: Vec<&Answer> = answers.iter().filter(|a| a.status == 200).collect();
    assert_eq!(
        refused.len() + served.len(),
        answers.len(),
        "only 200s and 529s"
    );
    assert!(!refused.is_empty(), "the budget never ran out");
    assert!(!served.is_empty(), "nothing was served");
    for r in &refused {
        let msg = r.body["error"]["message"].as_str().unwrap();
        assert!(msg.contains("KV memory budget"), "{msg}");
        assert_eq!(r.body["error"]["type"], "overloaded_error");
        assert!(r.retry_after.is_some(), "a 529 says when to retry");
    }
    let health = http
        .get(format!("{}/healthz", serve.url))
        .send()
        .await
        .unwrap();
    assert!(health.status().is_success(), "the server is still up");
    ledger_matches(&pool, &served).await;
    drop(serve);
    pool.close().await;
    common::drop_db(&db_name).await;
}

/// The conductor's prefill estimate for a node at one point of its gauge.
async fn conductor_rate(http: &reqwest::Client, gw: &str, node: &str, model: &str) -> Option<f64> {
    let text = http
        .get(format!("{gw}/metrics"))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    let want = format!(
        "cachet_gateway_conductor_prefill_tokens_per_second{{model=\"{model}\",node=\"{node}\"}}"
    );
    text.lines()
        .find_map(|l| l.strip_prefix(&want))
        .and_then(|v| v.trim().parse().ok())
}

/// An idle cluster admits a 32K-token prompt at the defaults (no configured rate refuses it),
/// and when the node's engine becomes 10× slower the gateway's estimate follows what the node
/// measures within a few requests. No figure of this machine's speed is assumed: the slower
/// estimate is judged against the first one, measured in the same run.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_conductor_admits_an_idle_cluster_and_learns_the_prefill_rate() {
    let prefix = format!("cachet-test-{}", uuid::Uuid::new_v4().simple());
    let dir = std::env::temp_dir().join(&prefix);
    let (db_name, db_url, pool) = common::fresh_db().await;
    let key = common::tenant_with_key(&pool, "learn").await;
    let env = |scale: &str| -> Vec<(&'static str, String)> {
        vec![
            ("DATABASE_URL", db_url.clone()),
            ("CACHET_ENGINE", "sim".into()),
            ("CACHET_SIM_TIME_SCALE", scale.into()),
        ]
    };
    let node = start_node_with("n1", &prefix, &dir, &env("1"), true);
    let gw = start_gateway(&prefix, &env("1"));
    let http = reqwest::Client::new();
    wait_for_nodes(&http, &gw, 1).await;
    let uncached = |i: usize, tokens: usize| {
        json!({"model": "sim-llama-8b", "max_tokens": 2,
               "messages": [{"role": "user", "content": words(tokens, &format!("q{i}"))}]})
    };
    // 32K tokens at the profile's 60 µs a token: about 2 s of prefill, admitted at once.
    let a = post(&http, &gw.url, &key, &uncached(0, 32_000)).await;
    assert_eq!(a.status, 200, "{}", a.body);
    // The node measured its rate and announced it; the gateway's estimate is that rate.
    let mut fast = 0.0;
    wait_until(
        "the gateway's estimate of n1's measured rate",
        Duration::from_secs(20),
        async || {
            fast = conductor_rate(&http, &gw.url, "n1", "sim-llama-8b")
                .await
                .unwrap_or(0.0);
            // Probe a request so the gauge is refreshed with what the node announced.
            let _ = post(&http, &gw.url, &key, &uncached(1, 200)).await;
            // Learned, whatever this machine's speed: what follows is judged against it.
            fast > 0.0
        },
    )
    .await;
    // The same node, its engine 10× slower (time scale 10): a few requests later the
    // estimate has followed.
    drop(node);
    let _slow = start_node_with("n1", &prefix, &dir, &env("10"), true);
    wait_for_nodes(&http, &gw, 1).await;
    let mut i = 2;
    let mut slow = fast;
    wait_until(
        "the estimate following the slower engine",
        Duration::from_secs(60),
        async || {
            i += 1;
            let r = post(&http, &gw.url, &key, &uncached(i, 1_000)).await;
            if r.status != 200 {
                // The gateway still knows the stopped process's address for a moment.
                assert_eq!(r.status, 529, "{}", r.body);
                return false;
            }
            slow = conductor_rate(&http, &gw.url, "n1", "sim-llama-8b")
                .await
                .unwrap_or(fast);
            slow < fast / 5.0
        },
    )
    .await;
    eprintln!(
        "estimate {fast:.0} tokens/s, then {slow:.0} tokens/s after {} requests",
        i - 2
    );
    assert!(slow > fast / 20.0, "{slow} vs {fast}: about 10× slower");
    pool.close().await;
    common::drop_db(&db_name).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// While tenant A keeps 12 long streams open on the reference engine (two workers, so ten of
/// them wait), tenant B's sim-tiny request is answered at once (another model's lane) and
/// B's own reference request goes before A's waiting streams (weighted fair queuing), so
/// both are answered before A's streams end. Order, not timing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_tenant_s_long_streams_do_not_starve_another_tenant() {
    let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(engine::reference::default_model_path());
    if !model.exists() {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must have the model (make model fetches it)"
        );
        eprintln!(
            "skipping: no model at {} (run `make model`)",
            model.display()
        );
        return;
    }
    let app = common::TestApp::start_with(common::Options {
        engine: "reference",
        tweak: |c| c.engine.workers = 2,
        ..Default::default()
    })
    .await;
    let a_key = app.key.clone();
    let b_key = app.new_tenant_key().await;
    let a_done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut streams = Vec::new();
    for i in 0..12 {
        let (client, url, key, done) = (
            app.client.clone(),
            app.url.clone(),
            a_key.clone(),
            a_done.clone(),
        );
        streams.push(tokio::spawn(async move {
            let body = json!({
                "model": "smollm2-135m-instruct", "max_tokens": 48, "stream": true,
                "ignore_eos": true,
                "messages": [{"role": "user", "content": format!("Tell a long story number {i}.")}],
            });
            let r = common::messages(&client, &url, &key, &body)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            let text = r.text().await.unwrap();
            assert!(text.contains("message_stop"), "{text}");
            done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }));
    }
    // Two of A's streams run, ten wait for the model's workers.
    let depth = |m: String| {
        m.lines()
            .filter(|l| {
                l.starts_with("cachet_gateway_engine_queue_depth{")
                    && l.contains("smollm2-135m-instruct")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<i64>().ok())
            .sum::<i64>()
    };
    wait_until(
        "ten of A's streams waiting",
        Duration::from_secs(60),
        async || depth(app.metrics().await) == 10,
    )
    .await;
    // B's sim-tiny request: another model, answered at once.
    let tiny = json!({"model": "sim-tiny", "max_tokens": 4,
                      "messages": [{"role": "user", "content": "hello"}]});
    let (s, _, r) = app.post("/v1/messages", &b_key, &tiny).await;
    assert_eq!(s, 200, "{r}");
    let a_before_tiny = a_done.load(std::sync::atomic::Ordering::SeqCst);
    // B's reference request: its turn comes before A's waiting streams.
    let ours = json!({"model": "smollm2-135m-instruct", "max_tokens": 8,
                      "messages": [{"role": "user", "content": "What is the capital of France?"}]});
    let (s, _, r) = app.post("/v1/messages", &b_key, &ours).await;
    assert_eq!(s, 200, "{r}");
    let a_before_ref = a_done.load(std::sync::atomic::Ordering::SeqCst);
    for s in streams {
        s.await.unwrap();
    }
    eprintln!(
        "A's streams finished before B's answers: {a_before_tiny} (sim-tiny), {a_before_ref} (reference)"
    );
    assert_eq!(
        a_before_tiny, 0,
        "B's sim-tiny waited behind A's generations"
    );
    // At most the two running when B asked: B took a worker from one of them between two
    // tokens (or when one ended), before any of the ten waiting started, and its 8 tokens end
    // before a 48-token stream could.
    eprintln!(
        "turns given: {}",
        app.metrics()
            .await
            .lines()
            .filter(|l| l.starts_with("cachet_gateway_engine_turns_given_total"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    assert!(
        a_before_ref <= 2,
        "{a_before_ref} of A's streams ended before B's reference request was answered"
    );
    app.settle().await;
    app.stop().await;
}

/// The same on a 3-node cluster behind a gateway, each node with a 256 MiB KV budget and a
/// 256 MiB DRAM tier, while one node is killed: every request is answered, or refused with a
/// 529 that says why; the survivors' peak RSS stays within their bounds; the ledger holds
/// exactly one row per answer (the killed node's journal recovered from its data directory).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn long_prompts_on_a_cluster_stay_within_bounds_through_a_node_kill() {
    let prefix = format!("cachet-test-{}", uuid::Uuid::new_v4().simple());
    let dir = std::env::temp_dir().join(&prefix);
    let (db_name, db_url, pool) = common::fresh_db().await;
    let key = common::tenant_with_key(&pool, "cluster-long").await;
    let (budget, dram) = (256 * MIB, 256 * MIB);
    let env: Vec<(&'static str, String)> = vec![
        ("DATABASE_URL", db_url.clone()),
        ("CACHET_ENGINE", "sim".into()),
        ("CACHET_SIM_TIME_SCALE", "0".into()),
        ("CACHET_KV_BUDGET_BYTES", budget.to_string()),
        ("CACHET_DRAM_CAPACITY_BYTES", dram.to_string()),
    ];
    let mut nodes: Vec<Option<common::procs::Node>> = ["n1", "n2", "n3"]
        .iter()
        .map(|id| Some(start_node_with(id, &prefix, &dir, &env, true)))
        .collect();
    let gw = start_gateway(&prefix, &env);
    let http = reqwest::Client::new();
    wait_for_nodes(&http, &gw, 3).await;
    let base: Vec<u64> = nodes
        .iter()
        .map(|n| peak_rss(n.as_ref().unwrap().child.id()))
        .collect();
    // 1,500 tokens of shared system prompt (188 MiB of KV: it fits the budget), then turns
    // of 2K to 32K tokens (250 MiB to 4 GiB: trimmed).
    let system = words(1_500, "shared");
    let send = |i: usize| {
        let tokens = [2_000usize, 8_000, 16_000, 32_000][i % 4];
        let b = body(
            "sim-llama-8b",
            &system,
            &words(tokens, &format!("turn{i}")),
            2,
        );
        let (http, url, key) = (http.clone(), gw.url.clone(), key.clone());
        async move { post(&http, &url, &key, &b).await }
    };
    // A first wave, then n1 is killed with SIGKILL while a second wave is in flight.
    let mut answers: Vec<Answer> = futures::future::join_all((0..4).map(send)).await;
    let second = tokio::spawn(futures::future::join_all((4..12).map(send)));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let n1_peak = peak_rss(nodes[0].as_ref().unwrap().child.id());
    {
        let n1 = nodes[0].as_mut().unwrap();
        n1.child.kill().unwrap();
        n1.child.wait().unwrap();
    }
    nodes[0] = None;
    answers.extend(second.await.unwrap());
    answers.extend(futures::future::join_all((12..16).map(send)).await);

    for a in &answers {
        match a.status {
            200 => {}
            529 => {
                let msg = a.body["error"]["message"].as_str().unwrap_or("");
                assert!(
                    msg.starts_with("Overloaded") || msg.contains("no node"),
                    "{msg}"
                );
            }
            s => panic!("{s}: {}", a.body),
        }
    }
    let served: Vec<&Answer> = answers.iter().filter(|a| a.status == 200).collect();
    assert!(
        served.len() >= answers.len() / 2,
        "{} of {} served",
        served.len(),
        answers.len()
    );
    let limit = |b: u64| b + budget + dram + 256 * MIB;
    assert!(
        n1_peak <= limit(base[0]),
        "n1 peak RSS {} MiB",
        n1_peak / MIB
    );
    for (i, n) in nodes.iter().enumerate().skip(1) {
        let peak = peak_rss(n.as_ref().unwrap().child.id());
        eprintln!("n{} peak RSS {} MiB", i + 1, peak / MIB);
        assert!(
            peak <= limit(base[i]),
            "n{} peak RSS {} MiB",
            i + 1,
            peak / MIB
        );
    }
    eprintln!(
        "n1 peak RSS {} MiB before its kill; {} of {} answered",
        n1_peak / MIB,
        served.len(),
        answers.len()
    );
    // n1 will not come back: what it journaled goes to the ledger from its data directory.
    common::procs::recover_data_dir(&dir.join("node-n1"), &db_url);
    ledger_matches(&pool, &served).await;
    drop((nodes, gw));
    pool.close().await;
    common::drop_db(&db_name).await;
    let _ = std::fs::remove_dir_all(&dir);
}
