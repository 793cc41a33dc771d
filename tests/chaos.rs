//! Faults against `cachet serve` as a real process, with a checker over the ledger: the
//! short slice of the chaos suite that runs in `make test` (`make chaos` runs the long one).
//!
//! `kill -9` mid-load: every request a client saw answered has exactly one ledger row once
//! the server is back on the same data directory, including the streams the kill cut after
//! their `200` (recorded `failed` with the prompt usage they were told, from the open-stream
//! journal), and no row for a request no client was given unless its client was waiting for
//! headers when the kill came.

mod common;

use std::collections::HashMap;
use std::process::{Child, Command};
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cachet_common::RequestId;
use common::procs::start_serve;
use futures::StreamExt;

/// What one client saw of one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Seen {
    /// A whole answer: a 200 body, or a stream through `message_stop`.
    Complete,
    /// A stream that answered 200 and was cut before `message_stop`.
    Cut,
    /// Anything else (refused, connection error before the headers).
    NotAnswered,
}

/// Token counts a client was told: (uncached input, cache writes, cache reads, output).
type Usage = [i64; 4];

/// One request as its client saw it.
#[derive(Clone, Debug)]
struct Answer {
    id: RequestId,
    seen: Seen,
    /// The HTTP status (200 for every answered request).
    status: u16,
    usage: Option<Usage>,
    /// When the client had the whole answer (or gave up on it).
    at: Instant,
    /// From sending the request to `at`.
    took: Duration,
}

fn usage_of(u: &serde_json::Value, output: &serde_json::Value) -> Option<Usage> {
    Some([
        u["input_tokens"].as_i64()?,
        u["cache_creation_input_tokens"].as_i64()?,
        u["cache_read_input_tokens"].as_i64()?,
        output.as_i64()?,
    ])
}

async fn one_request(
    http: &reqwest::Client,
    url: &str,
    key: &str,
    stream: bool,
    n: usize,
) -> Option<Answer> {
    let mut body = common::cached_body(300, &format!("question {n}"), 300);
    body["stream"] = stream.into();
    let sent = Instant::now();
    let resp = common::messages(http, url, key, &body).send().await.ok()?;
    let id = RequestId::from_str(resp.headers().get("request-id")?.to_str().ok()?).ok()?;
    let status = resp.status().as_u16();
    let answer = |seen, usage| {
        Some(Answer {
            id,
            seen,
            status,
            usage,
            at: Instant::now(),
            took: sent.elapsed(),
        })
    };
    if status != 200 {
        static SHOWN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        if SHOWN.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < 3 {
            let body = resp.text().await.unwrap_or_default();
            eprintln!("{id}: {status} {}", &body[..body.len().min(300)]);
        }
        return answer(Seen::NotAnswered, None);
    }
    if !stream {
        return match resp.bytes().await {
            Ok(b) => match serde_json::from_slice::<serde_json::Value>(&b) {
                Ok(v) => answer(
                    Seen::Complete,
                    usage_of(&v["usage"], &v["usage"]["output_tokens"]),
                ),
                Err(_) => answer(Seen::NotAnswered, None),
            },
            Err(_) => answer(Seen::NotAnswered, None),
        };
    }
    let mut text = String::new();
    let mut chunks = resp.bytes_stream();
    while let Some(c) = chunks.next().await {
        match c {
            Ok(c) => text.push_str(&String::from_utf8_lossy(&c)),
            Err(_) => break,
        }
    }
    let events: Vec<serde_json::Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str(d).ok())
        .collect();
    let start = events.iter().find(|e| e["type"] == "message_start");
    if !text.contains("event: message_stop") {
        // What the stream's start told the client: its prompt usage, no output yet.
        let usage = start.and_then(|s| usage_of(&s["message"]["usage"], &0.into()));
        return answer(Seen::Cut, usage);
    }
    // Input counts come in `message_start`, the output count in `message_delta`.
    let delta = events.iter().find(|e| e["type"] == "message_delta");
    let usage = start
        .zip(delta)
        .and_then(|(s, d)| usage_of(&s["message"]["usage"], &d["usage"]["output_tokens"]));
    answer(Seen::Complete, usage)
}

/// The ledger's rows by request id, with their status.
async fn ledger(pool: &sqlx::PgPool) -> HashMap<RequestId, String> {
    sqlx::query_as::<_, (uuid::Uuid, String)>("SELECT request_id, status FROM usage_events")
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .map(|(id, s)| (RequestId(id), s))
        .collect()
}

/// A fresh database with one tenant and its key: (name, URL, pool, key secret).
async fn chaos_db() -> (String, String, sqlx::PgPool, String) {
    let (db_name, db_url, pool) = common::fresh_db().await;
    let key = common::tenant_with_key(&pool, "chaos").await;
    (db_name, db_url, pool, key)
}

/// The ledger's token counts of some requests: (uncached input, cache writes, cache reads,
/// output) by request id.
async fn ledger_tokens(pool: &sqlx::PgPool, ids: &[RequestId]) -> HashMap<RequestId, Usage> {
    let ids: Vec<uuid::Uuid> = ids.iter().map(|id| id.0).collect();
    sqlx::query_as::<_, (uuid::Uuid, i64, i64, i64, i64)>(
        "SELECT request_id, input_tokens, cache_write_5m_tokens + cache_write_1h_tokens, \
                cache_read_tokens, output_tokens \
         FROM usage_events WHERE request_id = ANY($1)",
    )
    .bind(&ids)
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .map(|(id, i, w, r, o)| (RequestId(id), [i, w, r, o]))
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_of_serve_mid_load_loses_no_ledger_row() {
    let (db_name, db_url, pool, key) = chaos_db().await;
    let dir = common::tempdir::Dir::new();
    // Real decode time (2 ms a token) and answers of 150 tokens (0.3 s), so streams are
    // mid-generation when the kill lands (a sim answer of its own length, 12 to 31 words, is
    // over in ~60 ms: one run's three cut streams had all finished).
    let env = [
        ("CACHET_SIM_TIME_SCALE", "1"),
        ("CACHET_SIM_ANSWER_TOKENS", "150"),
    ];
    let serve = start_serve(&db_url, &dir.0, &env);

    let seen: Arc<Mutex<Vec<Answer>>> = Arc::default();
    // When each client sent its last request, the one that got no headers.
    let headless: Arc<Mutex<Vec<Instant>>> = Arc::default();
    let stop_at = Instant::now() + Duration::from_millis(2500);
    let clients = 10;
    let mut tasks = Vec::new();
    for c in 0..clients {
        let (url, key, seen, headless) = (
            serve.url.clone(),
            key.clone(),
            seen.clone(),
            headless.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let http = reqwest::Client::new();
            let mut n = 0;
            while Instant::now() < stop_at {
                n += 1;
                // Two clients in ten ask for a whole body, the rest stream.
                let sent = Instant::now();
                match one_request(&http, &url, &key, c >= 2, c * 1000 + n).await {
                    Some(a) => seen.lock().unwrap().push(a),
                    None => {
                        // The server is gone.
                        headless.lock().unwrap().push(sent);
                        break;
                    }
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(2000)).await;
    let mut serve = serve;
    serve.child.kill().unwrap(); // SIGKILL: no drain, no shutdown hook
    serve.child.wait().unwrap();
    let killed = Instant::now();
    for t in tasks {
        t.await.unwrap();
    }
    let seen = seen.lock().unwrap().clone();
    // Requests in flight without their headers when the kill came (those sent after it found
    // no server and cannot have a row).
    let headless = headless
        .lock()
        .unwrap()
        .iter()
        .filter(|sent| **sent < killed)
        .count();
    let complete = seen.iter().filter(|a| a.seen == Seen::Complete).count();
    let cut: Vec<&Answer> = seen.iter().filter(|a| a.seen == Seen::Cut).collect();
    eprintln!(
        "before the kill: {complete} complete answers, {} streams cut by it, {headless} requests in flight without headers",
        cut.len()
    );
    assert!(complete >= 10, "the load ran ({complete} answers)");
    assert!(
        !cut.is_empty(),
        "the kill landed mid-stream (else this checks nothing new)"
    );

    // Back on the same data directory: the spool and the open-stream journal replay.
    let again = start_serve(&db_url, &dir.0, &env);
    let answered: Vec<(RequestId, Seen)> = seen.iter().map(|a| (a.id, a.seen)).collect();
    let rows = ledger_settled(&pool, &answered).await;
    drop(again);
    for (id, s) in &answered {
        if *s == Seen::Complete {
            assert_eq!(
                rows.get(id).map(String::as_str),
                Some("completed"),
                "{id}: answered in full, so its row is there and completed"
            );
        }
    }
    // A cut stream's row is `failed`, with the prompt usage its `message_start` told the
    // client and no output (what the open-stream journal held), unless the kill came after
    // its end was durable and before its last bytes reached the client: then `completed`.
    let tokens = ledger_tokens(&pool, &cut.iter().map(|a| a.id).collect::<Vec<_>>()).await;
    let mut finished_unseen = 0;
    for a in &cut {
        let told = a
            .usage
            .expect("a cut stream's message_start arrived with its 200");
        let row = tokens.get(&a.id).unwrap_or_else(|| {
            panic!(
                "{}: a stream answered 200 and cut by the kill has its row",
                a.id
            )
        });
        match rows[&a.id].as_str() {
            "failed" => assert_eq!(
                *row, told,
                "{}: the cut stream's row is its prompt usage",
                a.id
            ),
            "completed" => {
                finished_unseen += 1;
                assert_eq!(
                    row[..3],
                    told[..3],
                    "{}: the prompt usage it was told",
                    a.id
                );
                assert!(row[3] > 0, "{}: a finished stream has its output", a.id);
            }
            other => panic!("{}: a cut stream recorded {other}", a.id),
        }
    }
    // One row per request by the ledger's key. A row for an id no client was given is only
    // possible for a request in flight without its headers when the kill came (its usage
    // durable, its answer not sent): at most one per client that saw no headers.
    let given: std::collections::HashSet<_> = seen.iter().map(|a| a.id).collect();
    let unknown = rows.keys().filter(|id| !given.contains(id)).count();
    eprintln!(
        "ledger: {} rows; {finished_unseen} cut streams had finished; {unknown} rows for requests whose headers never reached a client",
        rows.len()
    );
    assert!(
        unknown <= headless,
        "{unknown} rows for ids no client was given, but only {headless} requests were in flight without headers at the kill"
    );
    assert!(
        finished_unseen < cut.len(),
        "every cut stream had finished: the kill never cut one mid-generation"
    );
    pool.close().await;
    common::drop_db(&db_name).await;
}

/// Seconds each outage lasts: a short slice in `make test`, 20 s in `make chaos`.
fn outage() -> Duration {
    Duration::from_secs(
        std::env::var("CACHET_CHAOS_OUTAGE_SECS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(2),
    )
}

/// Clients sending requests to a server until stopped (`streaming` of them stream), each
/// request recorded as the client saw it.
struct Load {
    answers: Arc<Mutex<Vec<Answer>>>,
    /// Requests without any response (connection refused or reset before the headers).
    unanswered: Arc<Mutex<Vec<Instant>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    clients: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    fn start(url: &str, key: &str, clients: usize, streaming: usize) -> Self {
        let load = Load {
            answers: Arc::default(),
            unanswered: Arc::default(),
            stop: Arc::default(),
            clients: Vec::new(),
        };
        let clients = (0..clients)
            .map(|c| {
                let (url, key) = (url.to_string(), key.to_string());
                let (answers, unanswered, stop) = (
                    load.answers.clone(),
                    load.unanswered.clone(),
                    load.stop.clone(),
                );
                tokio::spawn(async move {
                    let http = reqwest::Client::new();
                    let mut n = 0;
                    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                        n += 1;
                        match one_request(&http, &url, &key, c < streaming, c * 100_000 + n).await {
                            Some(a) => answers.lock().unwrap().push(a),
                            None => {
                                unanswered.lock().unwrap().push(Instant::now());
                                // Nothing listening: don't spin.
                                tokio::time::sleep(Duration::from_millis(50)).await;
                            }
                        }
                    }
                })
            })
            .collect();
        Load { clients, ..load }
    }

    /// Requests answered so far.
    fn answered(&self) -> usize {
        self.answers
            .lock()
            .unwrap()
            .iter()
            .filter(|a| a.seen != Seen::NotAnswered)
            .count()
    }

    /// Stop the clients: every answer they had, and when a request got no response at all.
    async fn finish_detailed(self) -> (Vec<Answer>, Vec<Instant>) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        for c in self.clients {
            c.await.unwrap();
        }
        let answers = self.answers.lock().unwrap().clone();
        let unanswered = self.unanswered.lock().unwrap().clone();
        (answers, unanswered)
    }

    /// Stop the clients: the requests answered (200), and those that failed.
    async fn finish(self) -> (Vec<(RequestId, Seen)>, Vec<String>) {
        let (answers, unanswered) = self.finish_detailed().await;
        let mut errors: Vec<String> = unanswered.iter().map(|_| "no response".into()).collect();
        let mut seen = Vec::new();
        for a in answers {
            match a.seen {
                Seen::NotAnswered => errors.push(format!("{} {}", a.status, a.id)),
                s => seen.push((a.id, s)),
            }
        }
        (seen, errors)
    }
}

fn assert_none_failed(errors: &[String]) {
    assert!(
        errors.is_empty(),
        "{} requests failed, the first: {:?}",
        errors.len(),
        errors.iter().take(3).collect::<Vec<_>>()
    );
}

/// The ledger once it holds a row for every request of `answered` (or after 20 s).
async fn ledger_settled(
    pool: &sqlx::PgPool,
    answered: &[(RequestId, Seen)],
) -> HashMap<RequestId, String> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let rows = ledger(pool).await;
        let missing = answered
            .iter()
            .filter(|(id, s)| *s != Seen::NotAnswered && !rows.contains_key(id))
            .count();
        if missing == 0 || Instant::now() > deadline {
            return rows;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Past the change feed's first poll (1 s), Postgres then Redis cut away for the outage
/// each and restored: the answers counted before, after Postgres and after Redis. (The feed's
/// first poll once replayed the tenant's own creation as a change and dropped its cached
/// key, so an outage just after it refused the key.)
async fn cut_postgres_then_redis(
    load: &Load,
    pg: &common::CutProxy,
    redis: &common::CutProxy,
) -> (usize, usize, usize) {
    let phase = |name: &str| {
        let n = load.answered();
        eprintln!("{name}: {n} answered so far");
        n
    };
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = phase("before");
    pg.cut();
    tokio::time::sleep(outage()).await;
    pg.restore();
    let after_pg = phase("after the Postgres outage");
    redis.cut();
    tokio::time::sleep(outage()).await;
    redis.restore();
    let after_redis = phase("after the Redis outage");
    (before, after_pg, after_redis)
}

/// Every answered request has exactly one ledger row (the ledger's key), and the ledger has
/// no other, once every spool has replayed.
async fn assert_one_row_per_answer(pool: &sqlx::PgPool, seen: &[(RequestId, Seen)]) {
    let rows = ledger_settled(pool, seen).await;
    for (id, s) in seen {
        assert!(rows.contains_key(id), "{id} ({s:?}) has no ledger row");
    }
    assert_eq!(
        rows.len(),
        seen.len(),
        "a row for a request no client saw answered"
    );
}

/// Postgres, then Redis, cut away from a loaded `cachet serve` and restored: no request a
/// known key sends fails, and every answered request has exactly one ledger row once the
/// spool has replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_and_redis_outages_under_load_fail_nothing_and_lose_no_row() {
    let (db_name, _, pool, key) = chaos_db().await;
    let pg = common::CutProxy::start("127.0.0.1:5432").await;
    let redis = common::CutProxy::start("127.0.0.1:6379").await;
    let dir = common::tempdir::Dir::new();
    let proxied_db = format!("postgres://postgres@{}/{db_name}", pg.addr);
    let proxied_redis = format!("redis://{}", redis.addr);
    let env = [
        ("CACHET_SIM_TIME_SCALE", "0.2"),
        ("REDIS_URL", proxied_redis.as_str()),
    ];
    let serve = start_serve(&proxied_db, &dir.0, &env);

    let load = Load::start(&serve.url, &key, 8, 6);
    let (before, during_pg, during_redis) = cut_postgres_then_redis(&load, &pg, &redis).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (seen, errors) = load.finish().await;
    eprintln!(
        "answered {} ({} before, {} during Postgres, {} during Redis), failed {}",
        seen.len(),
        before,
        during_pg - before,
        during_redis - during_pg,
        errors.len()
    );
    assert_none_failed(&errors);
    assert!(
        during_pg > before && during_redis > during_pg,
        "served through both outages"
    );
    assert_one_row_per_answer(&pool, &seen).await;
    drop(serve);
    pool.close().await;
    common::drop_db(&db_name).await;
}

/// `SIGSTOP` of a loaded `cachet serve` for the outage length, then `SIGCONT`: requests wait,
/// none fails, and every answered one has exactly one row.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigstop_of_serve_delays_requests_and_fails_none() {
    let (db_name, db_url, pool, key) = chaos_db().await;
    let dir = common::tempdir::Dir::new();
    let serve = start_serve(&db_url, &dir.0, &[("CACHET_SIM_TIME_SCALE", "0.2")]);
    let load = Load::start(&serve.url, &key, 6, 4);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let before = load.answered();
    signal(&serve.child, "-STOP");
    tokio::time::sleep(outage()).await;
    let during = load.answered() - before;
    signal(&serve.child, "-CONT");
    let resumed = Instant::now();
    let at_cont = before + during;
    while load.answered() == at_cont && resumed.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let recovery = resumed.elapsed();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (all, mut errors) = load.finish().await;
    // A stream the stop cut is a failure here too.
    let (seen, cut): (Vec<_>, Vec<_>) = all.into_iter().partition(|(_, s)| *s != Seen::Cut);
    errors.extend(cut.iter().map(|(id, _)| id.to_string()));
    eprintln!(
        "SIGSTOP for {:?}: {before} answered before, {during} while stopped, {} in all; {} failed; first answer {:?} after SIGCONT",
        outage(),
        seen.len(),
        errors.len(),
        recovery
    );
    // Only what was already on the wire when it stopped (at most one per client).
    assert!(during <= 6, "a stopped server answered {during}");
    assert_none_failed(&errors);
    assert_one_row_per_answer(&pool, &seen).await;
    drop(serve);
    pool.close().await;
    common::drop_db(&db_name).await;
}

/// A ledger row's status and token counts, by request id.
async fn ledger_usage(pool: &sqlx::PgPool) -> HashMap<RequestId, (String, Usage)> {
    sqlx::query_as::<_, (uuid::Uuid, String, i64, i64, i64, i64)>(
        "SELECT request_id, status, input_tokens, cache_write_5m_tokens + cache_write_1h_tokens, \
         cache_read_tokens, output_tokens FROM usage_events",
    )
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .map(|(id, s, i, w, r, o)| (RequestId(id), (s, [i, w, r, o])))
    .collect()
}

/// Cache reads over all prompt tokens of the complete answers in `[from, to)`.
fn hit_ratio(answers: &[Answer], from: Instant, to: Instant) -> Option<f64> {
    let (mut read, mut all) = (0i64, 0i64);
    for a in answers.iter().filter(|a| a.at >= from && a.at < to) {
        if let Some([i, w, r, _]) = a.usage {
            read += r;
            all += i + w + r;
        }
    }
    (all > 0).then(|| read as f64 / all as f64)
}

/// One fault of the cluster run: when it began, ended (healed), and the cluster was whole
/// again (every node routable and a request answered through the gateway).
struct Fault {
    name: &'static str,
    start: Instant,
    healed: Instant,
    recovered: Instant,
}

/// A free port on the loopback interface (for a process restarted on the same address).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn signal(child: &Child, s: &str) {
    assert!(
        Command::new("kill")
            .args([s, &child.id().to_string()])
            .status()
            .unwrap()
            .success()
    );
}

/// The cluster half of the suite: three `cachet node`s and a `cachet router` on Postgres
/// and Redis under 16 clients, while each of these faults is injected in turn: `kill -9` of
/// a node (restarted on its data directory), `SIGSTOP`/`SIGCONT` of a node, a node cut off
/// from its peers and the gateway (its fabric and API ports behind proxies the test cuts),
/// `kill -9` of the gateway (restarted on the same port), `SIGSTOP`/`SIGCONT` of the gateway.
///
/// The checker: no request fails while a node is faulty (recomputing serves it); every
/// complete answer has exactly one ledger row, `completed`, with the usage its client saw;
/// every stream cut by a fault has its row; no refused request has one; the rollups
/// reconcile with the ledger; every block of the shared prefix is back on its R = 2 owners.
/// It prints, per fault, failed requests by status, the time to recovery and the hit ratio
/// before, during and after.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn faults_in_a_cluster_under_load_fail_nothing_recomputing_serves_and_lose_no_row() {
    use common::procs::{Node, start_gateway, start_node_with, wait_for_nodes};
    let (db_name, db_url, pool, key) = chaos_db().await;
    let (tenant, workspace): (uuid::Uuid, uuid::Uuid) =
        sqlx::query_as("SELECT tenant_id, id FROM workspaces")
            .fetch_one(&pool)
            .await
            .unwrap();
    let scope = cachet_common::Scope {
        tenant: cachet_common::TenantId(tenant),
        workspace: cachet_common::WorkspaceId(workspace),
    };
    let prefix = format!("cachet-chaos-{}", uuid::Uuid::new_v4().simple());
    let dir = common::tempdir::Dir::new();
    let env = |extra: &[(&'static str, String)]| {
        let mut v: Vec<(&'static str, String)> = vec![
            ("DATABASE_URL", db_url.clone()),
            ("CACHET_ENGINE", "sim".into()),
            ("CACHET_SIM_TIME_SCALE", "0.2".into()),
            // A resumed stream finishes in well under this; the rows of streams the
            // gateway's own death cut land this long after it.
            ("CACHET_RESUME_GRACE_SECS", "5".into()),
        ];
        v.extend_from_slice(extra);
        v
    };
    let start = |id: &str, extra: &[(&'static str, String)]| {
        start_node_with(id, &prefix, &dir.0, &env(extra), true)
    };
    // n3 is reached, by peers and the gateway alike, only through two proxies the test cuts.
    let n3_fabric = common::CutProxy::start("127.0.0.1:1").await;
    let n3_api = common::CutProxy::start("127.0.0.1:1").await;
    let mut nodes: Vec<Node> = vec![
        start("n1", &[]),
        start("n2", &[]),
        start(
            "n3",
            &[
                ("CACHET_ADVERTISE", n3_fabric.addr.to_string()),
                ("CACHET_API_ADVERTISE", n3_api.addr.to_string()),
            ],
        ),
    ];
    n3_fabric.retarget(nodes[2].addr.clone());
    n3_api.retarget(nodes[2].api.clone().unwrap());
    let gw_env = env(&[("CACHET_LISTEN", format!("127.0.0.1:{}", free_port()))]);
    let mut gw = start_gateway(&prefix, &gw_env);
    let http = reqwest::Client::new();
    wait_for_nodes(&http, &gw, 3).await;
    // Whole again: every node routable and a request answered.
    let whole = async |gw: &common::procs::Gateway| {
        let t = Instant::now();
        wait_for_nodes(&http, gw, 3).await;
        while one_request(&http, &gw.url, &key, false, 0)
            .await
            .is_none_or(|a| a.seen != Seen::Complete)
        {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "the cluster never recovered"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Instant::now()
    };

    let load = Load::start(&gw.url, &key, 16, 12);
    let settle = Duration::from_millis(1500);
    tokio::time::sleep(settle).await;
    let mut faults = Vec::new();

    // kill -9 of a node, restarted on the same data directory after the outage.
    let t = Instant::now();
    nodes[0].child.kill().unwrap();
    nodes[0].child.wait().unwrap();
    tokio::time::sleep(outage()).await;
    nodes[0] = start("n1", &[]);
    let healed = Instant::now();
    faults.push(Fault {
        name: "kill -9 of node n1, restarted",
        start: t,
        healed,
        recovered: whole(&gw).await,
    });
    tokio::time::sleep(settle).await;

    // SIGSTOP of a node for the outage, then SIGCONT.
    let t = Instant::now();
    signal(&nodes[1].child, "-STOP");
    tokio::time::sleep(outage()).await;
    signal(&nodes[1].child, "-CONT");
    let healed = Instant::now();
    faults.push(Fault {
        name: "SIGSTOP of node n2, then SIGCONT",
        start: t,
        healed,
        recovered: whole(&gw).await,
    });
    tokio::time::sleep(settle).await;

    // n3 cut off from its peers and the gateway (it still reaches Redis and Postgres).
    let t = Instant::now();
    n3_fabric.cut();
    n3_api.cut();
    tokio::time::sleep(outage()).await;
    n3_fabric.restore();
    n3_api.restore();
    let healed = Instant::now();
    faults.push(Fault {
        name: "node n3 cut off from peers and gateway, healed",
        start: t,
        healed,
        recovered: whole(&gw).await,
    });
    tokio::time::sleep(settle).await;

    // kill -9 of the gateway, restarted on the same port.
    let t = Instant::now();
    gw.child.kill().unwrap();
    gw.child.wait().unwrap();
    tokio::time::sleep(outage()).await;
    gw = start_gateway(&prefix, &gw_env);
    let healed = Instant::now();
    faults.push(Fault {
        name: "kill -9 of the gateway, restarted",
        start: t,
        healed,
        recovered: whole(&gw).await,
    });
    tokio::time::sleep(settle).await;

    // SIGSTOP of the gateway, then SIGCONT.
    let t = Instant::now();
    signal(&gw.child, "-STOP");
    tokio::time::sleep(outage()).await;
    signal(&gw.child, "-CONT");
    let healed = Instant::now();
    faults.push(Fault {
        name: "SIGSTOP of the gateway, then SIGCONT",
        start: t,
        healed,
        recovered: whole(&gw).await,
    });
    tokio::time::sleep(settle).await;
    let (answers, unanswered) = load.finish_detailed().await;
    let end = Instant::now();

    // The report: per fault, what failed and how the hit ratio moved.
    let pct = |r: Option<f64>| r.map_or("-".into(), |r| format!("{:.1}%", r * 100.0));
    eprintln!(
        "cluster chaos: 16 clients (12 streaming), outages of {:?}; {} requests",
        outage(),
        answers.len() + unanswered.len()
    );
    let mut node_fault_failures = Vec::new();
    for (i, f) in faults.iter().enumerate() {
        let until = faults.get(i + 1).map_or(end, |n| n.start);
        let in_fault = |at: Instant| at >= f.start && at < f.recovered;
        let mut failed: HashMap<String, usize> = HashMap::new();
        for a in answers.iter().filter(|a| in_fault(a.at)) {
            match a.seen {
                Seen::Complete => {}
                Seen::Cut => *failed.entry("200, stream cut".into()).or_default() += 1,
                Seen::NotAnswered => *failed.entry(a.status.to_string()).or_default() += 1,
            }
        }
        let mut took: Vec<Duration> = answers
            .iter()
            .filter(|a| in_fault(a.at) && a.seen == Seen::Complete)
            .map(|a| a.took)
            .collect();
        took.sort();
        let slowest = took.last().copied().unwrap_or_default();
        let p99 = took.get(took.len() * 99 / 100).copied().unwrap_or(slowest);
        let none = unanswered.iter().filter(|at| in_fault(**at)).count();
        if none > 0 {
            failed.insert("no response (attempts)".into(), none);
        }
        let before_from = if i == 0 {
            f.start - settle
        } else {
            faults[i - 1].recovered
        };
        eprintln!(
            "  {}: failed {:?}; latency p99 {p99:?}, max {slowest:?}; recovered {:?} after healing; hit ratio {} before, {} during, {} after",
            f.name,
            failed,
            f.recovered - f.healed,
            pct(hit_ratio(&answers, before_from, f.start)),
            pct(hit_ratio(&answers, f.start, f.healed)),
            pct(hit_ratio(&answers, f.recovered, until)),
        );
        if f.name.contains("node") {
            node_fault_failures.extend(failed.into_iter().map(|(k, v)| format!("{k}: {v}")));
        } else if f.name.starts_with("SIGSTOP") {
            // A stopped gateway delays requests; once it runs again it refuses none (it
            // once took its own pause for slow nodes and answered 529).
            node_fault_failures.extend(
                failed
                    .into_iter()
                    .filter(|(k, _)| k.parse::<u16>().is_ok())
                    .map(|(k, v)| format!("{k} after the gateway's SIGSTOP: {v}")),
            );
        }
    }
    assert!(
        node_fault_failures.is_empty(),
        "requests failed that the cluster could serve: {node_fault_failures:?}"
    );
    let complete = answers.iter().filter(|a| a.seen == Seen::Complete).count();
    assert!(complete > 100, "the load ran ({complete} complete answers)");

    // The ledger: once the nodes' spools and journals have replayed.
    let seen: Vec<(RequestId, Seen)> = answers.iter().map(|a| (a.id, a.seen)).collect();
    ledger_settled(&pool, &seen).await;
    let rows = ledger_usage(&pool).await;
    let mut mismatched = Vec::new();
    for a in &answers {
        let row = rows.get(&a.id);
        match a.seen {
            Seen::Complete => {
                let (status, usage) = row.unwrap_or_else(|| panic!("{}: answered, no row", a.id));
                assert_eq!(status, "completed", "{}", a.id);
                if a.usage.as_ref() != Some(usage) {
                    mismatched.push(format!("{}: client {:?}, ledger {usage:?}", a.id, a.usage));
                }
            }
            Seen::Cut => assert!(
                row.is_some(),
                "{}: a stream cut after its 200 has no row",
                a.id
            ),
            Seen::NotAnswered => assert!(
                row.is_none(),
                "{}: refused ({}), yet billed",
                a.id,
                a.status
            ),
        }
    }
    assert!(
        mismatched.is_empty(),
        "usage seen by clients differs from the ledger: {mismatched:?}"
    );
    let given: std::collections::HashSet<_> = answers.iter().map(|a| a.id).collect();
    let unknown = rows.keys().filter(|id| !given.contains(id)).count();
    eprintln!(
        "  ledger: {} rows, one per request; {unknown} for requests whose answer never reached a client (cut before the headers)",
        rows.len()
    );

    // What billing derives from the ledger agrees with it.
    let today = chrono::Utc::now().date_naive();
    let day = |d: chrono::NaiveDate| d.and_hms_opt(0, 0, 0).unwrap().and_utc();
    let (from, to) = (
        day(today.pred_opt().unwrap()),
        day(today.succ_opt().unwrap()),
    );
    billing::rollup::rollup(&pool, from, to).await.unwrap();
    let r = billing::rollup::reconcile(&pool, from, to).await.unwrap();
    assert!(r.mismatches.is_empty(), "{:?}", r.mismatches);

    // R = 2 restored: every block of the shared prefix on its two owners.
    let mut conn = redis::Client::open(common::REDIS)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let records = cache_fabric::membership::live_nodes(&mut conn, &prefix)
        .await
        .unwrap();
    let view = cache_fabric::cluster::View::from_records(&records);
    let hashes = common::procs::block_hashes(&common::cached_body(300, "question 1", 300), scope);
    assert!(!hashes.is_empty());
    let t = Instant::now();
    common::procs::wait_until("R = 2 restored", Duration::from_secs(30), async || {
        for h in &hashes {
            for o in view.membership.owners(scope.tenant, h, 4, 2) {
                let addr = view.addr(&o.id).unwrap();
                if common::procs::copies(&[addr], scope, *h).await < 1 {
                    return false;
                }
            }
        }
        true
    })
    .await;
    eprintln!(
        "  R = 2 held for every block of the shared prefix ({:?} after the last fault)",
        t.elapsed()
    );
    drop((nodes, gw));
    pool.close().await;
    common::drop_db(&db_name).await;
}

/// The cluster half of the Postgres and Redis outages: three nodes and a gateway reach both
/// through proxies the test cuts, under 8 clients. Postgres away: usage is spooled on each
/// node, keys are served from their last known state. Redis away: membership heartbeats and
/// block events fail, and every process must find Redis again when it returns (the nodes
/// must stay routable). The checker: no request fails, one ledger row per answer, and the
/// gateway routes to all three nodes afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_and_redis_outages_in_a_cluster_fail_nothing_and_lose_no_row() {
    use common::procs::{start_gateway, start_node_with, wait_for_nodes};
    let (db_name, _, pool, key) = chaos_db().await;
    let pg = common::CutProxy::start("127.0.0.1:5432").await;
    let redis = common::CutProxy::start("127.0.0.1:6379").await;
    let prefix = format!("cachet-chaos-{}", uuid::Uuid::new_v4().simple());
    let dir = common::tempdir::Dir::new();
    let env: Vec<(&'static str, String)> = vec![
        (
            "DATABASE_URL",
            format!("postgres://postgres@{}/{db_name}", pg.addr),
        ),
        ("REDIS_URL", format!("redis://{}", redis.addr)),
        ("CACHET_ENGINE", "sim".into()),
        ("CACHET_SIM_TIME_SCALE", "0.2".into()),
    ];
    let nodes: Vec<_> = ["n1", "n2", "n3"]
        .iter()
        .map(|id| start_node_with(id, &prefix, &dir.0, &env, true))
        .collect();
    let gw = start_gateway(&prefix, &env);
    let http = reqwest::Client::new();
    wait_for_nodes(&http, &gw, 3).await;
    let load = Load::start(&gw.url, &key, 8, 6);
    let (before, during_pg, during_redis) = cut_postgres_then_redis(&load, &pg, &redis).await;
    // Whole again: every node heartbeats into Redis again (past the outage, their records
    // had expired) and the gateway routes to all three.
    let healed = Instant::now();
    let mut conn = ::redis::Client::open(common::REDIS)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    common::procs::wait_until(
        "every node back in the membership",
        Duration::from_secs(20),
        async || {
            cache_fabric::membership::live_nodes(&mut conn, &prefix)
                .await
                .is_ok_and(|n| n.len() == 3)
        },
    )
    .await;
    wait_for_nodes(&http, &gw, 3).await;
    let rejoined = healed.elapsed();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (seen, errors) = load.finish().await;
    eprintln!(
        "cluster, outages of {:?}: {} answered ({} before, {} during Postgres, {} during Redis), {} failed; all nodes routable {rejoined:?} after Redis returned",
        outage(),
        seen.len(),
        before,
        during_pg - before,
        during_redis - during_pg,
        errors.len()
    );
    assert_none_failed(&errors);
    assert!(
        during_pg > before && during_redis > during_pg,
        "served through both outages"
    );
    assert_one_row_per_answer(&pool, &seen).await;
    drop((nodes, gw));
    pool.close().await;
    common::drop_db(&db_name).await;
}
