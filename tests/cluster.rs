//! `cachet node` as a real process: it announces itself in Redis, serves its store over the
//! fabric transport only to holders of the cluster token, publishes its block events, and
//! leaves the membership when killed (after the heartbeat expiry) or stopped (at once).

use std::process::Command;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use cache_fabric::events::Follower;
use cache_fabric::index::PrefixIndex;
use cache_fabric::membership;
use cache_fabric::transport::{RemoteEntry, TcpTransport, Transport, TransportError};
use cache_fabric::{EntryKind, PutBlock};
use cachet_common::{BlockHash, Scope, TenantId, WorkspaceId};

mod common;

use common::procs::{
    Gateway, Node, TOKEN, block_hashes, copies, start_gateway, start_node_with, wait_for_nodes,
    wait_until,
};
const REDIS: &str = common::REDIS;

fn start_node(id: &str, prefix: &str, data_dir: &std::path::Path) -> Node {
    start_node_with(id, prefix, data_dir, &[], false)
}

async fn live_ids(conn: &mut redis::aio::MultiplexedConnection, prefix: &str) -> Vec<String> {
    membership::live_nodes(conn, prefix)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect()
}

#[tokio::test]
async fn a_node_process_serves_announces_publishes_and_leaves() {
    let prefix = format!("cachet-test-{}", uuid::Uuid::new_v4().simple());
    let dir = std::env::temp_dir().join(&prefix);
    let client = redis::Client::open(REDIS).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();

    let a = start_node("node-a", &prefix, &dir);
    let b = start_node("node-b", &prefix, &dir);
    wait_until(
        "both nodes announced",
        Duration::from_secs(15),
        async || live_ids(&mut conn, &prefix).await == ["node-a", "node-b"],
    )
    .await;
    let records = membership::live_nodes(&mut conn, &prefix).await.unwrap();
    assert_eq!(records[0].addr, a.addr);
    assert!(records[0].epoch > 0);

    // Its store, through the transport, with the token; nothing without it.
    let scope = Scope {
        tenant: TenantId::new(),
        workspace: WorkspaceId::new(),
    };
    let h = |i: u8| BlockHash([i; 32]);
    let blocks = vec![
        PutBlock::new(h(1), None, 16, Bytes::from(vec![1u8; 4096])),
        PutBlock::new(h(2), Some(h(1)), 16, Bytes::from(vec![2u8; 4096])),
    ];
    let t = TcpTransport::new(TOKEN);
    t.put_entry(
        &a.addr,
        &RemoteEntry {
            scope,
            existing: vec![],
            new: blocks.clone(),
            ttl: Duration::from_secs(300),
            kind: EntryKind::Paid,
            replica: false,
            handoff: false,
        },
    )
    .await
    .unwrap()
    .unwrap();
    let got = t.get_chain(&a.addr, scope, &[h(1), h(2)]).await.unwrap();
    assert_eq!(got.len(), 2);
    assert_eq!(got[1].data, blocks[1].data);
    assert!(
        t.get_chain(&b.addr, scope, &[h(1)])
            .await
            .unwrap()
            .is_empty()
    );
    let intruder = TcpTransport::new("not-the-cluster-token");
    assert!(matches!(
        intruder.get_chain(&a.addr, scope, &[h(1)]).await,
        Err(TransportError::Unauthorized { .. })
    ));

    // The block events reach an index following the cluster's stream.
    let index = Arc::new(RwLock::new(PrefixIndex::default()));
    let mut follower = Follower::new(format!("{prefix}:blocks"), "0-0", index.clone());
    let mut fconn = client.get_multiplexed_async_connection().await.unwrap();
    wait_until("events indexed", Duration::from_secs(15), async || {
        follower
            .poll(&mut fconn, Duration::from_millis(100))
            .await
            .unwrap();
        index.read().unwrap().longest_prefix(&[h(1), h(2)]) == 2
    })
    .await;

    // kill -9: nobody removes the record; the node is down once it expires (3 s after its
    // last heartbeat).
    let mut a = a;
    a.child.kill().unwrap();
    a.child.wait().unwrap();
    wait_until(
        "killed node seen down",
        Duration::from_secs(15),
        async || live_ids(&mut conn, &prefix).await == ["node-b"],
    )
    .await;

    // A graceful stop (SIGTERM) removes the record itself before the process exits, so it
    // is gone the moment the process is (an expiry would leave it for up to 3 s more).
    let mut b = b;
    let pid = b.child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    assert!(b.child.wait().unwrap().success(), "clean exit on SIGTERM");
    let key_left: bool = redis::cmd("EXISTS")
        .arg(format!("{prefix}:node:node-b"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(!key_left, "the record was removed on the way out");
    assert!(live_ids(&mut conn, &prefix).await.is_empty());
    drop(b);
    let _: () = redis::cmd("DEL")
        .arg(format!("{prefix}:blocks"))
        .query_async(&mut conn)
        .await
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

/// POST a Messages request; `internal` sends it straight to a node's API with the token.
async fn post(
    http: &reqwest::Client,
    base: &str,
    key: &str,
    body: &serde_json::Value,
    internal: bool,
) -> (u16, String, serde_json::Value) {
    let mut req = http
        .post(format!("{base}/v1/messages"))
        .header("x-api-key", key)
        .header("anthropic-version", "2023-06-01")
        .json(body);
    if internal {
        req = req.header("x-cachet-cluster-token", TOKEN);
    }
    let resp = req.send().await.expect("request reaches the service");
    let status = resp.status().as_u16();
    let rid = resp
        .headers()
        .get("request-id")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    let json = resp.json().await.unwrap_or(serde_json::Value::Null);
    (status, rid, json)
}

/// A request with automatic caching (best-effort entries, which DRAM pressure demotes to
/// disk) of a system prompt of `words` words.
fn prompt(words: usize, tag: &str, user: &str) -> serde_json::Value {
    let system: String = (0..words).map(|i| format!("{tag}{i} ")).collect();
    serde_json::json!({
        "model": "sim-tiny",
        "max_tokens": 8,
        "cache_control": {"type": "ephemeral"},
        "system": system,
        "messages": [{"role": "user", "content": user}],
    })
}

/// A fresh database with one tenant and its API key: (pool, URL, tenant, key secret).
async fn tenant_db(name: &str) -> (sqlx::PgPool, String, control::tenants::Tenant, String) {
    let db_url = format!(
        "postgres://postgres@127.0.0.1:5432/cachet_test_{}",
        uuid::Uuid::new_v4().simple()
    );
    let pool = cachet::server::connect_and_migrate(&db_url, 2)
        .await
        .unwrap();
    let tenant =
        control::tenants::create_tenant(&pool, &control::tenants::Actor::cli("test"), name)
            .await
            .unwrap();
    let key = control::tenants::create_key(
        &pool,
        &control::tenants::Actor::cli("test"),
        &tenant,
        "k",
        None,
    )
    .await
    .unwrap()
    .secret;
    (pool, db_url, tenant, key)
}

/// The ledger rows of `ids`, once there are `expect` of them (a row follows its answer by the
/// meter's commit, decision 0020) or the wait gave up.
async fn ledger_rows(pool: &sqlx::PgPool, ids: &[uuid::Uuid], expect: usize) -> i64 {
    let count = async || -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM usage_events WHERE request_id = ANY($1)")
            .bind(ids)
            .fetch_one(pool)
            .await
            .unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let n = count().await;
        if n as usize >= expect || Instant::now() > deadline {
            return n;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The gateway's Prometheus metrics text.
async fn gateway_metrics(http: &reqwest::Client, gw: &Gateway) -> String {
    common::get_text(http, format!("{}/metrics", gw.url)).await
}

/// Issue 4's acceptance, on real processes, Postgres and Redis: three `cachet node`s and a
/// `cachet router`. Blocks land on R = 2 distinct owners; a prefix written through one
/// node is read by another; a bit flipped on disk is caught and never served; `kill -9` of
/// a node under load fails no request and loses no ledger row, and R is restored.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_nodes_and_a_gateway_replicate_share_prefixes_and_survive_kill_9() {
    let prefix = format!("cachet-test-{}", uuid::Uuid::new_v4().simple());
    let dir = std::env::temp_dir().join(&prefix);
    let (pool, db_url, tenant, key) = tenant_db("cluster-tenant").await;
    let scope = Scope {
        tenant: tenant.id,
        workspace: tenant.default_workspace,
    };
    let env = |extra: &[(&'static str, String)]| {
        let mut v: Vec<(&'static str, String)> = vec![
            ("DATABASE_URL", db_url.clone()),
            ("CACHET_ENGINE", "sim".into()),
            ("CACHET_SIM_TIME_SCALE", "0.2".into()),
        ];
        v.extend_from_slice(extra);
        v
    };
    let n1 = start_node_with("n1", &prefix, &dir, &env(&[]), true);
    let n2 = start_node_with("n2", &prefix, &dir, &env(&[]), true);
    // n3 keeps almost nothing in DRAM: its blocks live in its disk tier.
    let n3 = start_node_with(
        "n3",
        &prefix,
        &dir,
        &env(&[
            ("CACHET_DRAM_CAPACITY_BYTES", "4096".into()),
            ("CACHET_FABRIC_EVICTION", "lru".into()),
            ("CACHET_DISK_CAPACITY_BYTES", (64u64 << 20).to_string()),
        ]),
        true,
    );
    let gw = start_gateway(&prefix, &env(&[]));
    let http = reqwest::Client::new();
    wait_for_nodes(&http, &gw, 3).await;
    let mut sent: Vec<String> = Vec::new();

    // A prefix written through n1 is read through n2.
    let shared = prompt(200, "p", "first question");
    let n1_api = format!("http://{}", n1.api.as_ref().unwrap());
    let n2_api = format!("http://{}", n2.api.as_ref().unwrap());
    let (s, rid, r) = post(&http, &n1_api, &key, &shared, true).await;
    assert_eq!(s, 200, "{r}");
    sent.push(rid);
    let written = r["usage"]["cache_creation_input_tokens"].as_u64().unwrap();
    assert!(written >= 200, "{r}");
    let (s, rid, r2) = post(&http, &n2_api, &key, &shared, true).await;
    assert_eq!(s, 200, "{r2}");
    sent.push(rid);
    assert_eq!(
        r2["usage"]["cache_read_input_tokens"].as_u64(),
        Some(written)
    );
    assert_eq!(r["content"], r2["content"]);
    // The internal port takes nothing without the cluster token.
    let (s, _, _) = post(&http, &n2_api, &key, &shared, false).await;
    assert_eq!(s, 401);

    // Each block is on its R = 2 owners, distinct nodes.
    let mut conn = redis::Client::open(REDIS)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let records = membership::live_nodes(&mut conn, &prefix).await.unwrap();
    let view = cache_fabric::cluster::View::from_records(&records);
    let hashes = block_hashes(&shared, scope);
    assert!(hashes.len() >= 10);
    let t = TcpTransport::new(TOKEN);
    // Replication follows membership: a node that joined after a write receives the blocks
    // it owns from the repair its arrival triggers.
    wait_until(
        "each block on its R owners",
        Duration::from_secs(15),
        async || {
            for h in &hashes {
                let owners = view.membership.owners(scope.tenant, h, 4, 2);
                assert_eq!(owners.len(), 2);
                assert_ne!(owners[0].id, owners[1].id);
                for o in owners {
                    let addr = view.addr(&o.id).unwrap();
                    if !t.has(addr, scope, &[*h]).await.unwrap()[0] {
                        return false;
                    }
                }
            }
            true
        },
    )
    .await;

    // A bit flipped in n3's disk tier: the block is detected and never served, and the
    // request still gets the right answer.
    let n3_blocks: Vec<BlockHash> = hashes
        .iter()
        .copied()
        .filter(|h| {
            view.membership
                .owners(scope.tenant, h, 4, 2)
                .iter()
                .any(|m| m.id == "n3")
        })
        .collect();
    assert!(!n3_blocks.is_empty());
    // Bits flipped all through n3's disk segments (every 256th byte): whatever is on disk
    // now is corrupt, headers included. (Blocks n3 holds in DRAM are untouched.)
    let disk = dir.join("node-n3").join("fabric-disk");
    let mut flipped = 0;
    for seg in std::fs::read_dir(&disk).unwrap() {
        let path = seg.unwrap().path();
        let mut bytes = std::fs::read(&path).unwrap();
        for b in bytes.iter_mut().step_by(256) {
            *b ^= 0x01;
            flipped += 1;
        }
        std::fs::write(&path, &bytes).unwrap();
    }
    assert!(flipped > 0, "n3 demoted blocks to disk");
    let mut dropped = 0;
    for h in &n3_blocks {
        match t.get_block(&n3.addr, scope, *h).await.unwrap() {
            None => dropped += 1,
            Some(b) => {
                let other = t.get_block(&n2.addr, scope, *h).await.unwrap();
                let other = match other {
                    Some(o) => o,
                    None => t.get_block(&n1.addr, scope, *h).await.unwrap().unwrap(),
                };
                assert_eq!(b.data, other.data, "n3 served wrong bytes");
            }
        }
    }
    assert!(dropped >= 1, "no flipped block was detected");
    let (s, rid, r3) = post(&http, &gw.url, &key, &shared, false).await;
    assert_eq!(s, 200, "{r3}");
    sent.push(rid);
    assert_eq!(r3["content"], r["content"]);

    // Load through the gateway; n1 is killed with SIGKILL a second in.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut workers = Vec::new();
    for w in 0..6 {
        let (http, url, key, stop) = (http.clone(), gw.url.clone(), key.clone(), stop.clone());
        workers.push(tokio::spawn(async move {
            let mut done = Vec::new();
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let body = prompt(120, &format!("load{}-", i % 3), &format!("q {w} {i}"));
                let (s, rid, r) = post(&http, &url, &key, &body, false).await;
                assert_eq!(s, 200, "request failed during the node failure: {r}");
                done.push((Instant::now(), rid));
                i += 1;
            }
            done
        }));
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut n1 = n1;
    n1.child.kill().unwrap();
    n1.child.wait().unwrap();
    let killed = Instant::now();
    tokio::time::sleep(Duration::from_secs(5)).await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let (mut before, mut after) = (0, 0);
    for w in workers {
        for (at, rid) in w.await.expect("no request failed") {
            if at < killed {
                before += 1;
            } else {
                after += 1;
            }
            sent.push(rid);
        }
    }
    eprintln!("requests answered: {before} before the kill, {after} after");
    assert!(before > 0 && after > 0);

    // n1's last answers may be only in its usage journal (their rows are durable there before
    // the answer, decision 0020): a node that will not be started again has its data
    // directory recovered into the ledger.
    common::procs::recover_data_dir(&dir.join("node-n1"), &db_url);
    // Every answered request has exactly one ledger row, and nothing else was billed.
    let ids: Vec<uuid::Uuid> = sent
        .iter()
        .map(|r| r.parse::<cachet_common::RequestId>().unwrap().0)
        .collect();
    let rows = ledger_rows(&pool, &ids, ids.len()).await;
    assert_eq!(rows as usize, ids.len());
    let all: i64 = sqlx::query_scalar("SELECT count(*) FROM usage_events")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(all as usize, ids.len());

    // The dead node left the gateway's view, and R is back: every block of the prefix
    // is on both surviving nodes (n3's corrupt copy included).
    let ready: serde_json::Value = common::get_json(&http, format!("{}/readyz", gw.url)).await;
    assert_eq!(ready["nodes"], serde_json::json!(["n2", "n3"]));
    // The block dropped as corrupt on n3 had its other copy on n1: gone with it, so the
    // next request recomputes it and writes it again.
    let (s, rid, r4) = post(&http, &gw.url, &key, &shared, false).await;
    assert_eq!(s, 200, "{r4}");
    assert_eq!(r4["content"], r["content"]);
    let ids_after: Vec<uuid::Uuid> = vec![rid.parse::<cachet_common::RequestId>().unwrap().0];
    assert_eq!(ledger_rows(&pool, &ids_after, 1).await, 1);
    wait_until(
        "R = 2 restored on the survivors",
        Duration::from_secs(30),
        async || {
            for h in &hashes {
                if copies(&[&n2.addr, &n3.addr], scope, *h).await < 2 {
                    return false;
                }
            }
            true
        },
    )
    .await;

    drop((n2, n3, gw));
    pool.close().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// A node whose engines are all busy answers 529 without doing or billing anything; the
/// gateway then serves the request on another node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saturated_node_is_skipped_not_surfaced() {
    let prefix = format!("cachet-test-{}", uuid::Uuid::new_v4().simple());
    let dir = std::env::temp_dir().join(&prefix);
    let (pool, db_url, _, key) = tenant_db("busy").await;
    let secret = "a-finance-secret-for-the-cluster-test-0123456789";
    let base: Vec<(&'static str, String)> = vec![
        ("DATABASE_URL", db_url.clone()),
        ("CACHET_ENGINE", "sim".into()),
        ("CACHET_SIM_TIME_SCALE", "1".into()),
        ("CACHET_ADMIN_JWT_SECRET", secret.into()),
    ];
    // One engine worker, no queue, and slow: 2 ms × 100 = 0.2 s a token.
    let mut busy_env = base.clone();
    busy_env.push(("CACHET_ENGINE_WORKERS", "1".into()));
    busy_env.push(("CACHET_ENGINE_QUEUE", "0".into()));
    busy_env.push(("CACHET_SIM_TIME_SCALE", "100".into()));
    let busy = start_node_with("busy", &prefix, &dir, &busy_env, true);
    let _idle = start_node_with("idle", &prefix, &dir, &base, true);
    let gw = start_gateway(&prefix, &base);
    let http = reqwest::Client::new();
    wait_for_nodes(&http, &gw, 2).await;
    // Occupy the busy node's only engine worker with a generation of at least 12 tokens
    // (the sim answers 12 to 31 words): at 0.2 s a token it stays busy through the requests
    // below, which the idle node answers in milliseconds.
    let long = serde_json::json!({
        "model": "sim-tiny", "max_tokens": 64,
        "messages": [{"role": "user", "content": "a long answer please"}],
    });
    let busy_api = format!("http://{}", busy.api.as_ref().unwrap());
    let hog = {
        let (http, key) = (http.clone(), key.clone());
        tokio::spawn(async move { post(&http, &busy_api, &key, &long, true).await })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Round-robin among equally good nodes (nothing cached: a new prompt each) sends some of
    // these to the busy node first.
    for i in 0..4 {
        let body = prompt(40, &format!("busy{i}-"), "question");
        let (s, _, r) = post(&http, &gw.url, &key, &body, false).await;
        assert_eq!(s, 200, "{r}");
    }
    let metrics = gateway_metrics(&http, &gw).await;
    let retried: f64 = metrics
        .lines()
        .find(|l| l.starts_with("cachet_gateway_routed_total{outcome=\"retried\"}"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    assert!(retried >= 1.0, "no request met the busy node:\n{metrics}");
    let (s, _, _) = hog.await.unwrap();
    assert_eq!(s, 200);

    // The finance API is on the cluster's public side (the gateway), not on nodes' internal
    // ports.
    let prices = |base: String, token: Option<String>| {
        let http = http.clone();
        async move {
            let mut req = http.get(format!("{base}/v1/billing/prices"));
            if let Some(t) = token {
                req = req.bearer_auth(t);
            }
            req.send().await.unwrap().status().as_u16()
        }
    };
    let finance = identity::Jwt::new(secret.as_bytes())
        .unwrap()
        .issue("t", identity::Role::Finance, None, Duration::from_secs(60))
        .unwrap();
    assert_eq!(prices(gw.url.clone(), None).await, 401);
    assert_eq!(prices(gw.url.clone(), Some(finance.clone())).await, 200);
    let node_api = format!("http://{}", busy.api.as_ref().unwrap());
    assert_eq!(
        prices(node_api, Some(finance)).await,
        401,
        "internal port, no cluster token"
    );
    pool.close().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// The conductor's early rejection covers the decode stage: a node whose record (as a node
/// beside vLLM announces it) says its decoding instances are so busy that a new request's
/// time between tokens would be over `cluster.tbt_slo_ms` is refused at once with a 529
/// naming the stage; once its announced batch is smaller, the request is sent there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_decoding_is_over_the_tbt_target_is_refused_at_once() {
    use cachet_common::stages::{StageLoad, StepModel};
    let prefix = format!("cachet-test-{}", uuid::Uuid::new_v4().simple());
    let (pool, db_url, _, key) = tenant_db("tbt").await;
    let env: Vec<(&'static str, String)> = vec![
        ("DATABASE_URL", db_url.clone()),
        ("CACHET_ENGINE", "sim".into()),
    ];
    let gw = start_gateway(&prefix, &env);
    let http = reqwest::Client::new();
    // Nothing listens on its API port: a request sent there fails and is answered as such.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let api_addr = closed.local_addr().unwrap().to_string();
    drop(closed);
    let record = move |decoding: u32| membership::NodeRecord {
        id: "decoding".into(),
        addr: "127.0.0.1:9".into(),
        dram_capacity_bytes: 1 << 30,
        epoch: 1,
        api_addr: Some(api_addr.clone()),
        stages: [(
            "sim-tiny".to_string(),
            StageLoad {
                decode_instances: 1,
                decode_in_flight: decoding,
                split_min_tokens: 1024,
                // 200 ms + 100 ms a generation in the batch.
                step: Some(StepModel {
                    base_ms: 200.0,
                    per_seq_ms: 100.0,
                }),
                ..StageLoad::default()
            },
        )]
        .into(),
        ..Default::default()
    };
    // Its heartbeat, as a node's: the record expires without one.
    let decoding = Arc::new(std::sync::atomic::AtomicU32::new(8));
    let client = redis::Client::open(REDIS).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let heartbeat = {
        let (mut conn, prefix, decoding) = (conn.clone(), prefix.clone(), decoding.clone());
        tokio::spawn(async move {
            loop {
                let n = decoding.load(std::sync::atomic::Ordering::Relaxed);
                membership::announce(&mut conn, &prefix, &record(n))
                    .await
                    .unwrap();
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        })
    };
    wait_for_nodes(&http, &gw, 1).await;
    // Eight decoding: the ninth would see 200 + 9 × 100 = 1100 ms between tokens, over the
    // default 1000 ms.
    let (s, _, r) = post(&http, &gw.url, &key, &prompt(20, "tbt-", "q"), false).await;
    assert_eq!(s, 529, "{r}");
    let msg = r["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("time between tokens is 1100 ms (in a batch of 9), over the 1000 ms target"),
        "{msg}"
    );
    let metrics = gateway_metrics(&http, &gw).await;
    assert!(
        metrics.contains("cachet_gateway_routed_total{outcome=\"over_tbt\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains(
            "cachet_gateway_conductor_tbt_seconds{model=\"sim-tiny\",node=\"decoding\"} 1.1"
        ),
        "{metrics}"
    );
    // Two decoding: 500 ms, within the target; the request goes to the node (whose port is
    // closed: "no node could serve" is a forward that was tried, not a refusal up front).
    decoding.store(2, std::sync::atomic::Ordering::Relaxed);
    wait_until(
        "the gateway sees the smaller batch",
        Duration::from_secs(10),
        async || {
            let (s, _, r) = post(&http, &gw.url, &key, &prompt(20, "tbt-", "q"), false).await;
            assert_eq!(s, 529, "{r}");
            !r.to_string().contains("time between tokens")
        },
    )
    .await;
    let metrics = gateway_metrics(&http, &gw).await;
    assert!(
        metrics.contains(
            "cachet_gateway_conductor_tbt_seconds{model=\"sim-tiny\",node=\"decoding\"} 0.5"
        ),
        "{metrics}"
    );
    assert!(
        metrics.contains("cachet_gateway_routed_total{outcome=\"failed\"}"),
        "{metrics}"
    );
    heartbeat.abort();
    membership::leave(&mut conn, &prefix, "decoding")
        .await
        .unwrap();
    pool.close().await;
}

/// The text and event kinds of an SSE body.
fn sse_text(body: &str) -> (String, Vec<String>) {
    let mut text = String::new();
    let mut kinds = Vec::new();
    for event in body.split("\n\n").filter(|e| !e.trim().is_empty()) {
        let Some(data) = event.lines().find_map(|l| l.strip_prefix("data: ")) else {
            continue;
        };
        let v: serde_json::Value = serde_json::from_str(data).unwrap();
        kinds.push(v["type"].as_str().unwrap_or_default().to_string());
        if let Some(t) = v["delta"]["text"].as_str() {
            text.push_str(t);
        }
    }
    (text, kinds)
}

/// A streamed answer survives its node: `kill -9` of the node serving a stream, after the
/// client has part of the text, and the gateway resumes the request on the other node under
/// the same request id and splices that node's stream after what the client has. The client
/// gets one well-formed stream whose text is exactly what the request generates (sampling is
/// seeded by the request id), and the ledger holds one row for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_node_dies_is_resumed_on_another() {
    use futures::StreamExt;
    let prefix = format!("cachet-test-{}", uuid::Uuid::new_v4().simple());
    let dir = std::env::temp_dir().join(&prefix);
    let (pool, db_url, _, key) = tenant_db("stream").await;
    // The sim engine at 0.2 s a token: an answer of 12 to 31 words streams for seconds.
    let env: Vec<(&'static str, String)> = vec![
        ("DATABASE_URL", db_url.clone()),
        ("CACHET_ENGINE", "sim".into()),
        ("CACHET_SIM_TIME_SCALE", "100".into()),
    ];
    let mut nodes = [
        Some(start_node_with("a", &prefix, &dir, &env, true)),
        Some(start_node_with("b", &prefix, &dir, &env, true)),
    ];
    let gw = start_gateway(&prefix, &env);
    let http = reqwest::Client::new();
    wait_for_nodes(&http, &gw, 2).await;

    let body = serde_json::json!({
        "model": "sim-tiny", "max_tokens": 64, "stream": true, "temperature": 1.0,
        "messages": [{"role": "user", "content": "tell me a long story"}],
    });
    let resp = http
        .post(format!("{}/v1/messages", gw.url))
        .header("x-api-key", &key)
        .header("anthropic-version", "2023-06-01")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let rid = resp.headers()["request-id"].to_str().unwrap().to_string();
    let serving = resp.headers()["x-cachet-node"]
        .to_str()
        .unwrap()
        .to_string();
    let (victim, survivor) = if serving == "a" { (0, 1) } else { (1, 0) };
    let mut stream = resp.bytes_stream();
    let mut got = String::new();
    // Kill the serving node once the client holds two text deltas.
    while sse_text(&got)
        .1
        .iter()
        .filter(|k| *k == "content_block_delta")
        .count()
        < 2
    {
        let chunk = stream.next().await.expect("stream open").unwrap();
        got.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    let before = sse_text(&got).0;
    drop(nodes[victim].take());
    while let Some(chunk) = stream.next().await {
        got.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
    }
    let (text, kinds) = sse_text(&got);
    assert!(
        text.starts_with(&before) && text.len() > before.len(),
        "{got}"
    );
    let survivor_id = ["a", "b"][survivor];
    assert!(
        got.contains(&format!("\n: cachet-node {survivor_id}\n")),
        "the stream names the node that finished it: {got}"
    );
    let count = |k: &str| kinds.iter().filter(|x| *x == k).count();
    assert_eq!(
        (count("message_start"), count("content_block_start")),
        (1, 1),
        "{got}"
    );
    assert_eq!(
        (
            count("content_block_stop"),
            count("message_delta"),
            count("message_stop")
        ),
        (1, 1, 1),
        "{got}"
    );
    assert_eq!(count("error"), 0, "{got}");
    assert_eq!(kinds.last().map(String::as_str), Some("message_stop"));

    // The same request (same id) generates exactly that text, as a whole answer.
    let api = format!(
        "http://{}",
        nodes[survivor].as_ref().unwrap().api.as_ref().unwrap()
    );
    let whole: serde_json::Value = http
        .post(format!("{api}/v1/messages"))
        .header("x-api-key", &key)
        .header("anthropic-version", "2023-06-01")
        .header("x-cachet-cluster-token", TOKEN)
        .header("x-cachet-request-id", &rid)
        .json(&serde_json::json!({
            "model": "sim-tiny", "max_tokens": 64, "temperature": 1.0,
            "messages": [{"role": "user", "content": "tell me a long story"}],
        }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(whole["content"][0]["text"].as_str(), Some(text.as_str()));

    // Billed once.
    let id = rid.parse::<cachet_common::RequestId>().unwrap().0;
    assert_eq!(ledger_rows(&pool, &[id], 1).await, 1);
    let metrics = gateway_metrics(&http, &gw).await;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("cachet_gateway_routed_total{outcome=\"resumed\"} 1")),
        "{metrics}"
    );
    pool.close().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// Administrative changes in a cluster, on real processes: the gateway serves the admin API;
/// its cache view sums every node (storage-only ones too) over the fabric transport; a
/// tenant's replication factor reaches every node (blocks get that many owners); a suspended
/// tenant is refused and a deleted one's blocks are purged from every node, all within
/// seconds and without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn admin_changes_reach_every_node_of_a_cluster() {
    const SECRET: &str = "cluster-admin-secret-of-at-least-32-bytes";
    let prefix = format!("cachet-test-{}", uuid::Uuid::new_v4().simple());
    let dir = std::env::temp_dir().join(&prefix);
    let (pool, db_url, tenant, key) = tenant_db("cluster-admin").await;
    let scope = Scope {
        tenant: tenant.id,
        workspace: tenant.default_workspace,
    };
    let env = vec![
        ("DATABASE_URL", db_url.clone()),
        ("CACHET_ENGINE", "sim".into()),
        ("CACHET_SIM_TIME_SCALE", "0".into()),
        ("CACHET_ADMIN_JWT_SECRET", SECRET.to_string()),
    ];
    let n1 = start_node_with("n1", &prefix, &dir, &env, true);
    let n2 = start_node_with("n2", &prefix, &dir, &env, true);
    let n3 = start_node_with("n3", &prefix, &dir, &env, false);
    let gw = start_gateway(&prefix, &env);
    let http = reqwest::Client::new();
    wait_for_nodes(&http, &gw, 2).await;
    let admin = identity::Jwt::new(SECRET.as_bytes())
        .unwrap()
        .issue(
            "test",
            identity::Role::PlatformAdmin,
            None,
            Duration::from_secs(600),
        )
        .unwrap();
    let call = async |method: &str, path: &str, body: Option<serde_json::Value>| {
        let mut r = http
            .request(method.parse().unwrap(), format!("{}{path}", gw.url))
            .bearer_auth(&admin);
        if let Some(b) = body {
            r = r.json(&b);
        }
        let r = r.send().await.unwrap();
        let s = r.status().as_u16();
        (s, r.json::<serde_json::Value>().await.unwrap_or_default())
    };
    let t = tenant.id;

    // Every block on all three nodes once the tenant's replication factor is 3.
    let (s, v) = call(
        "PATCH",
        &format!("/v1/admin/tenants/{t}/policy"),
        Some(serde_json::json!({"replication_factor": 3})),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let body = prompt(120, "adm", "hello");
    let (s, _, r) = post(&http, &gw.url, &key, &body, false).await;
    assert_eq!(s, 200, "{r}");
    let hashes = block_hashes(&body, scope);
    let addrs = [n1.addr.as_str(), n2.addr.as_str(), n3.addr.as_str()];
    wait_until(
        "every block on the 3 nodes",
        Duration::from_secs(20),
        async || {
            for h in &hashes {
                if copies(&addrs, scope, *h).await < 3 {
                    return false;
                }
            }
            true
        },
    )
    .await;

    // The cache view counts every node, the storage-only one included.
    let (s, c) = call("GET", &format!("/v1/admin/tenants/{t}/cache"), None).await;
    assert_eq!(s, 200, "{c}");
    assert_eq!(c["nodes"], 3, "{c}");
    assert_eq!(c["unreachable_nodes"], 0, "{c}");
    assert!(c["total_bytes"].as_u64().unwrap() > 0, "{c}");

    // Suspension reaches the nodes that serve requests.
    call("POST", &format!("/v1/admin/tenants/{t}/suspend"), None).await;
    wait_until(
        "a suspended tenant gets 403",
        Duration::from_secs(5),
        async || post(&http, &gw.url, &key, &body, false).await.0 == 403,
    )
    .await;

    // Deletion purges its blocks from every node.
    let (s, v) = call("DELETE", &format!("/v1/admin/tenants/{t}"), None).await;
    assert_eq!(s, 200, "{v}");
    wait_until(
        "every node purged the tenant",
        Duration::from_secs(5),
        async || {
            for h in &hashes {
                if copies(&addrs, scope, *h).await > 0 {
                    return false;
                }
            }
            true
        },
    )
    .await;
    let (_, c) = call("GET", &format!("/v1/admin/tenants/{t}/cache"), None).await;
    assert_eq!(c["total_bytes"], 0, "{c}");
    assert_eq!(post(&http, &gw.url, &key, &body, false).await.0, 401);
    drop((n1, n2, n3, gw));
    pool.close().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// Nodes n1, n2 and n3 (each with its API) and a routing gateway, all seen live.
async fn three_nodes_and_a_gateway(
    prefix: &str,
    dir: &std::path::Path,
    env: &[(&'static str, String)],
) -> (
    std::collections::HashMap<String, Node>,
    Gateway,
    reqwest::Client,
) {
    let nodes = ["n1", "n2", "n3"]
        .iter()
        .map(|id| (id.to_string(), start_node_with(id, prefix, dir, env, true)))
        .collect();
    let gw = start_gateway(prefix, env);
    let http = reqwest::Client::new();
    wait_for_nodes(&http, &gw, 3).await;
    (nodes, gw, http)
}

/// Issue 27's cluster acceptance, first half: a cache object created through the routing
/// gateway is held on its owners, and after the node that computed it is killed (`kill -9`)
/// a request naming it through the gateway still reads every token of it from the replicas.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cache_object_outlives_the_node_that_computed_it() {
    let prefix = format!("cachet-test-{}", uuid::Uuid::new_v4().simple());
    let dir = std::env::temp_dir().join(&prefix);
    let (pool, db_url, tenant, key) = tenant_db("objects-tenant").await;
    const SECRET: &str = "cluster-objects-secret-of-at-least-32-bytes";
    let env: Vec<(&'static str, String)> = vec![
        ("DATABASE_URL", db_url.clone()),
        ("CACHET_ENGINE", "sim".into()),
        ("CACHET_SIM_TIME_SCALE", "0".into()),
        ("CACHET_ADMIN_JWT_SECRET", SECRET.to_string()),
    ];
    let (mut nodes, gw, http) = three_nodes_and_a_gateway(&prefix, &dir, &env).await;

    let system: String = (0..300).map(|i| format!("o{i} ")).collect();
    let resp = http
        .post(format!("{}/v1/caches", gw.url))
        .header("x-api-key", &key)
        .json(&serde_json::json!({"model": "sim-tiny", "system": system, "ttl": "2h"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let maker = resp
        .headers()
        .get("x-cachet-node")
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    let obj: serde_json::Value = resp.json().await.unwrap();
    let tokens = obj["input_tokens"].as_u64().unwrap();
    let scope = Scope {
        tenant: tenant.id,
        workspace: tenant.default_workspace,
    };
    // Every block of the object on its R = 2 owners before the node goes.
    let as_request = serde_json::json!({"model": "sim-tiny", "max_tokens": 1,
        "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": "q"}]});
    let hashes = block_hashes(&as_request, scope);
    let addrs: Vec<String> = nodes.values().map(|n| n.addr.clone()).collect();
    let addr_refs: Vec<&str> = addrs.iter().map(String::as_str).collect();
    wait_until(
        "the object's blocks on two nodes each",
        Duration::from_secs(20),
        async || {
            for h in &hashes {
                if copies(&addr_refs, scope, *h).await < 2 {
                    return false;
                }
            }
            true
        },
    )
    .await;

    let mut gone = nodes.remove(&maker).expect("the maker is a node");
    gone.child.kill().unwrap();
    gone.child.wait().unwrap();
    wait_for_nodes(&http, &gw, 2).await;
    let use_it = serde_json::json!({"model": "sim-tiny", "max_tokens": 4, "cached_content": obj["id"],
        "messages": [{"role": "user", "content": "what does it say?"}]});
    let (s, _, r) = post(&http, &gw.url, &key, &use_it, false).await;
    assert_eq!(s, 200, "{r}");
    assert_eq!(
        r["usage"]["cache_read_input_tokens"].as_u64(),
        Some(tokens),
        "{r}"
    );
    assert_eq!(r["cachet"]["cached_content"]["status"], "read", "{r}");

    // A tenant admin, through the routing gateway's admin API: extended to 20 hours (held on
    // every node by its block hashes; tests/admin_api.rs checks the hold on one node), then
    // deleted, every live node releasing it before the answer.
    let admin = identity::Jwt::new(SECRET.as_bytes())
        .unwrap()
        .issue(
            "test",
            identity::Role::TenantAdmin,
            Some(tenant.id.as_uuid()),
            Duration::from_secs(600),
        )
        .unwrap();
    let object = format!(
        "{}/v1/admin/tenants/{}/cache/objects/{}",
        gw.url,
        tenant.id,
        obj["id"].as_str().unwrap()
    );
    let r = http
        .patch(&object)
        .bearer_auth(&admin)
        .json(&serde_json::json!({"ttl": "20h"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let e: serde_json::Value = r.json().await.unwrap();
    let left = common::expires_in(&e);
    assert!(left > chrono::TimeDelta::hours(19), "{e}");
    let r = http
        .delete(&object)
        .bearer_auth(&admin)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let d: serde_json::Value = r.json().await.unwrap();
    assert!(d["bytes_freed"].as_u64().unwrap() > 0, "{d}");
    assert_eq!(d["nodes_pending"], serde_json::json!([]), "{d}");
    let live = addrs_of(&nodes);
    for h in &hashes {
        assert_eq!(copies(&live, scope, *h).await, 0, "block {h} still held");
    }
    drop(nodes);
    drop(gw);
    pool.close().await;
    common::drop_db(db_url.rsplit('/').next().unwrap()).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// The stored block hashes of object `id` (the chain its deletion releases).
async fn object_blocks(pool: &sqlx::PgPool, id: &str) -> Vec<BlockHash> {
    let bytes: Vec<u8> = sqlx::query_scalar("SELECT block_hashes FROM cache_objects WHERE id = $1")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap();
    bytes
        .chunks_exact(32)
        .map(|c| BlockHash(c.try_into().unwrap()))
        .collect()
}

/// Issue 27's cluster acceptance, second half: deleting an object whose content nothing
/// else holds leaves none of its blocks on any node or tier — the nodes' DRAM is kept small,
/// so most of the object's replicas live on their disk tiers — and a node that was killed
/// (`kill -9`) before the delete, whose disk tier still has its blocks, drops them when it
/// restarts, before it serves them (its release, recorded at start, freed them).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deleted_object_leaves_no_block_on_any_node_even_one_down_during_the_delete() {
    let prefix = format!("cachet-test-{}", uuid::Uuid::new_v4().simple());
    let dir = std::env::temp_dir().join(&prefix);
    let (pool, db_url, tenant, key) = tenant_db("release-tenant").await;
    let env: Vec<(&'static str, String)> = vec![
        ("DATABASE_URL", db_url.clone()),
        ("CACHET_ENGINE", "sim".into()),
        ("CACHET_SIM_TIME_SCALE", "0".into()),
        // Eight blocks of sim-tiny's KV: the object's replicas go to the disk tier.
        ("CACHET_DRAM_CAPACITY_BYTES", "16384".into()),
    ];
    let (mut nodes, gw, http) = three_nodes_and_a_gateway(&prefix, &dir, &env).await;

    let system: String = (0..300).map(|i| format!("d{i} ")).collect();
    let resp = http
        .post(format!("{}/v1/caches", gw.url))
        .header("x-api-key", &key)
        .json(&serde_json::json!({"model": "sim-tiny", "system": system, "ttl": "2h"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let obj: serde_json::Value = resp.json().await.unwrap();
    let id = obj["id"].as_str().unwrap().to_string();
    let scope = Scope {
        tenant: tenant.id,
        workspace: tenant.default_workspace,
    };
    let hashes = object_blocks(&pool, &id).await;
    // The stored chain is the one a request sending the same content computes.
    let as_request = serde_json::json!({"model": "sim-tiny", "max_tokens": 1,
        "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": "q"}]});
    let computed = block_hashes(&as_request, scope);
    assert!(hashes.len() > 10, "{} blocks", hashes.len());
    assert_eq!(hashes[..hashes.len() - 1], computed[..hashes.len() - 1]);
    let all: Vec<(String, String)> = nodes
        .iter()
        .map(|(id, n)| (id.clone(), n.addr.clone()))
        .collect();
    let addrs: Vec<&str> = all.iter().map(|(_, a)| a.as_str()).collect();
    wait_until(
        "the object's blocks on two nodes each",
        Duration::from_secs(20),
        async || {
            for h in &hashes {
                if copies(&addrs, scope, *h).await < 2 {
                    return false;
                }
            }
            true
        },
    )
    .await;

    // The node holding the most of it goes down.
    let mut held = Vec::new();
    for (id, a) in &all {
        let mut n = 0;
        for h in &hashes {
            n += copies(&[a.as_str()], scope, *h).await;
        }
        held.push((n, id.clone()));
    }
    held.sort();
    let (n_victim, victim) = held.pop().unwrap();
    assert!(n_victim > 0);
    let mut gone = nodes.remove(&victim).unwrap();
    gone.child.kill().unwrap();
    gone.child.wait().unwrap();
    wait_for_nodes(&http, &gw, 2).await;

    let resp = http
        .delete(format!("{}/v1/caches/{id}", gw.url))
        .header("x-api-key", &key)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let deleted: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(deleted["type"], "cache_object_deleted", "{deleted}");
    assert!(deleted["bytes_freed"].as_u64().unwrap() > 0, "{deleted}");
    assert_eq!(deleted["bytes_held"], 0, "{deleted}");
    assert_eq!(deleted["nodes_pending"], serde_json::json!([]), "{deleted}");
    let live: Vec<&str> = all
        .iter()
        .filter(|(id, _)| *id != victim)
        .map(|(_, a)| a.as_str())
        .collect();
    for h in &hashes {
        assert_eq!(copies(&live, scope, *h).await, 0, "block {h} still held");
    }
    let released_by = |node: String| {
        let pool = pool.clone();
        let id = id.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT bytes_freed FROM cache_object_releases WHERE object_id = $1 AND node = $2",
            )
            .bind(id)
            .bind(node)
            .fetch_optional(&pool)
            .await
            .unwrap()
        }
    };
    assert_eq!(
        released_by(victim.clone()).await,
        None,
        "the victim was down"
    );

    // Back with its disk tier: the tombstone is applied before it serves.
    let back = start_node_with(&victim, &prefix, &dir, &env, true);
    let freed = released_by(victim.clone()).await;
    assert!(
        freed.is_some_and(|b| b > 0),
        "the restarted node freed what its disk kept: {freed:?}"
    );
    for h in &hashes {
        assert_eq!(
            copies(&[back.addr.as_str()], scope, *h).await,
            0,
            "block {h} on the restarted node"
        );
    }
    nodes.insert(victim, back);
    wait_for_nodes(&http, &gw, 3).await;
    for h in &hashes {
        assert_eq!(copies(&addrs_of(&nodes), scope, *h).await, 0);
    }
    // Using it is a 404; the same content sent with a breakpoint is computed again.
    let use_it = serde_json::json!({"model": "sim-tiny", "max_tokens": 1, "cached_content": id,
        "messages": [{"role": "user", "content": "q"}]});
    let (s, _, r) = post(&http, &gw.url, &key, &use_it, false).await;
    assert_eq!(s, 404, "{r}");
    let (s, _, r) = post(&http, &gw.url, &key, &as_request, false).await;
    assert_eq!(s, 200, "{r}");
    assert_eq!(r["usage"]["cache_read_input_tokens"], 0, "{r}");
    drop(nodes);
    drop(gw);
    pool.close().await;
    common::drop_db(db_url.rsplit('/').next().unwrap()).await;
    let _ = std::fs::remove_dir_all(&dir);
}

fn addrs_of(nodes: &std::collections::HashMap<String, Node>) -> Vec<&str> {
    nodes.values().map(|n| n.addr.as_str()).collect()
}
