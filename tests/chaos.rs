//! Faults against `cachet serve` as a real process, with a checker over the ledger: the
//! short slice of the chaos suite that runs in `make test` (`make chaos` runs the long one).
//!
//! `kill -9` mid-load: every request a client saw answered has exactly one ledger row once
//! the server is back on the same data directory, including the streams the kill cut after
//! their `200` (recorded `failed`, from the open-stream journal).

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cachet_common::RequestId;
use futures::StreamExt;

/// `cachet serve` as a child process.
struct Serve {
    child: Child,
    url: String,
    _stdout: BufReader<std::process::ChildStdout>,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_serve(db_url: &str, data_dir: &std::path::Path, env: &[(&str, &str)]) -> Serve {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cachet"));
    cmd.arg("serve")
        .env("DATABASE_URL", db_url)
        .env("REDIS_URL", common::REDIS)
        .env("CACHET_DATA_DIR", data_dir)
        .env("CACHET_LISTEN", "127.0.0.1:0")
        .env("CACHET_ENGINE", "sim")
        .stdout(Stdio::piped())
        .stderr(
            std::env::var("CACHET_TEST_NODE_LOGS")
                .ok()
                .map(|d| Stdio::from(std::fs::File::create(format!("{d}/serve.log")).unwrap()))
                .unwrap_or_else(Stdio::null),
        );
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("start cachet serve");
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert!(line.starts_with("serving on "), "{line:?}");
    Serve {
        child,
        url: format!("http://{}", line.trim().rsplit(' ').next().unwrap()),
        _stdout: out,
    }
}

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

async fn one_request(
    http: &reqwest::Client,
    url: &str,
    key: &str,
    stream: bool,
    n: usize,
) -> Option<(RequestId, Seen)> {
    let mut body = common::cached_body(300, &format!("question {n}"), 300);
    body["stream"] = stream.into();
    let resp = http
        .post(format!("{url}/v1/messages"))
        .header("x-api-key", key)
        .header("anthropic-version", "2023-06-01")
        .json(&body)
        .send()
        .await
        .ok()?;
    let rid = RequestId::from_str(resp.headers().get("request-id")?.to_str().ok()?).ok()?;
    if resp.status() != 200 {
        static SHOWN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let status = resp.status();
        if SHOWN.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < 3 {
            let body = resp.text().await.unwrap_or_default();
            eprintln!("{rid}: {status} {}", &body[..body.len().min(300)]);
        }
        return Some((rid, Seen::NotAnswered));
    }
    if !stream {
        return Some(match resp.bytes().await {
            Ok(b) if serde_json::from_slice::<serde_json::Value>(&b).is_ok() => {
                (rid, Seen::Complete)
            }
            _ => (rid, Seen::NotAnswered),
        });
    }
    let mut text = String::new();
    let mut chunks = resp.bytes_stream();
    while let Some(c) = chunks.next().await {
        match c {
            Ok(c) => text.push_str(&String::from_utf8_lossy(&c)),
            Err(_) => break,
        }
    }
    Some((
        rid,
        if text.contains("event: message_stop") {
            Seen::Complete
        } else {
            Seen::Cut
        },
    ))
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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_of_serve_mid_load_loses_no_ledger_row() {
    let db_name = common::fresh_db_name();
    let db_url = format!("{}/{db_name}", common::PG);
    let pool = cachet::server::connect_and_migrate(&db_url, 2)
        .await
        .unwrap();
    let key = common::tenant_with_key(&pool, "chaos").await;
    let dir = common::tempdir::Dir::new();
    // Real decode time (2 ms a token), so streams are in flight when the kill lands.
    let env = [("CACHET_SIM_TIME_SCALE", "1")];
    let serve = start_serve(&db_url, &dir.0, &env);

    let seen: Arc<Mutex<Vec<(RequestId, Seen)>>> = Arc::default();
    let stop_at = Instant::now() + Duration::from_millis(2500);
    let mut clients = Vec::new();
    for c in 0..10 {
        let (url, key, seen) = (serve.url.clone(), key.clone(), seen.clone());
        clients.push(tokio::spawn(async move {
            let http = reqwest::Client::new();
            let mut n = 0;
            while Instant::now() < stop_at {
                n += 1;
                // Two clients in ten ask for a whole body, the rest stream.
                match one_request(&http, &url, &key, c >= 2, c * 1000 + n).await {
                    Some(s) => seen.lock().unwrap().push(s),
                    None => break, // the server is gone
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(2000)).await;
    let mut serve = serve;
    serve.child.kill().unwrap(); // SIGKILL: no drain, no shutdown hook
    serve.child.wait().unwrap();
    for c in clients {
        c.await.unwrap();
    }
    let seen = seen.lock().unwrap().clone();
    let complete = seen.iter().filter(|(_, s)| *s == Seen::Complete).count();
    let cut = seen.iter().filter(|(_, s)| *s == Seen::Cut).count();
    eprintln!("before the kill: {complete} complete answers, {cut} streams cut by it");
    assert!(complete >= 10, "the load ran ({complete} answers)");
    assert!(
        cut >= 1,
        "the kill landed mid-stream (else this checks nothing new)"
    );

    // Back on the same data directory: the spool and the open-stream journal replay.
    let again = start_serve(&db_url, &dir.0, &env);
    let rows = ledger_settled(&pool, &seen).await;
    drop(again);
    for (id, s) in &seen {
        match s {
            Seen::Complete => assert_eq!(
                rows.get(id).map(String::as_str),
                Some("completed"),
                "{id}: answered in full, so its row is there and completed"
            ),
            Seen::Cut => assert!(
                rows.contains_key(id),
                "{id}: a stream answered 200 and cut by the kill has its row"
            ),
            Seen::NotAnswered => {}
        }
    }
    // One row per request by the ledger's key; no row for an id no client was given.
    let given: std::collections::HashSet<_> = seen.iter().map(|(id, _)| *id).collect();
    let unknown = rows.keys().filter(|id| !given.contains(id)).count();
    eprintln!(
        "ledger: {} rows; {unknown} for requests whose headers never reached a client",
        rows.len()
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
    seen: Arc<Mutex<Vec<(RequestId, Seen)>>>,
    /// Requests refused or without any response.
    errors: Arc<Mutex<Vec<String>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    clients: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    fn start(url: &str, key: &str, clients: usize, streaming: usize) -> Self {
        let load = Load {
            seen: Arc::default(),
            errors: Arc::default(),
            stop: Arc::default(),
            clients: Vec::new(),
        };
        let clients = (0..clients)
            .map(|c| {
                let (url, key) = (url.to_string(), key.to_string());
                let (seen, errors, stop) =
                    (load.seen.clone(), load.errors.clone(), load.stop.clone());
                tokio::spawn(async move {
                    let http = reqwest::Client::new();
                    let mut n = 0;
                    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                        n += 1;
                        match one_request(&http, &url, &key, c < streaming, c * 100_000 + n).await {
                            Some((id, Seen::NotAnswered)) => {
                                errors.lock().unwrap().push(id.to_string())
                            }
                            Some(s) => seen.lock().unwrap().push(s),
                            None => errors.lock().unwrap().push("no response".into()),
                        }
                    }
                })
            })
            .collect();
        Load { clients, ..load }
    }

    /// Requests answered so far.
    fn answered(&self) -> usize {
        self.seen.lock().unwrap().len()
    }

    /// Stop the clients: what they saw, and what failed.
    async fn finish(self) -> (Vec<(RequestId, Seen)>, Vec<String>) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        for c in self.clients {
            c.await.unwrap();
        }
        let seen = self.seen.lock().unwrap().clone();
        let errors = self.errors.lock().unwrap().clone();
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

/// Postgres, then Redis, cut away from a loaded `cachet serve` and restored: no request a
/// known key sends fails, and every answered request has exactly one ledger row once the
/// spool has replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_and_redis_outages_under_load_fail_nothing_and_lose_no_row() {
    let db_name = common::fresh_db_name();
    let db_url = format!("{}/{db_name}", common::PG);
    let pool = cachet::server::connect_and_migrate(&db_url, 2)
        .await
        .unwrap();
    let key = common::tenant_with_key(&pool, "chaos").await;
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
    let phase = |name: &str| {
        let n = load.answered();
        eprintln!("{name}: {n} answered so far");
        n
    };
    // Past the change feed's first poll (1 s): it once replayed the tenant's own creation as
    // a change and dropped its cached key, so the outage then refused the key.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = phase("before");
    pg.cut();
    tokio::time::sleep(outage()).await;
    pg.restore();
    let during_pg = phase("after the Postgres outage");
    redis.cut();
    tokio::time::sleep(outage()).await;
    redis.restore();
    let during_redis = phase("after the Redis outage");
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

    // Every answered request has exactly one row (the ledger's key), once the spool replays.
    let rows = ledger_settled(&pool, &seen).await;
    for (id, s) in &seen {
        assert!(rows.contains_key(id), "{id} ({s:?}) has no ledger row");
    }
    assert_eq!(
        rows.len(),
        seen.len(),
        "a row for a request no client saw answered"
    );
    drop(serve);
    pool.close().await;
    common::drop_db(&db_name).await;
}

/// `SIGSTOP` of a loaded `cachet serve` for the outage length, then `SIGCONT`: requests wait,
/// none fails, and every answered one has exactly one row.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigstop_of_serve_delays_requests_and_fails_none() {
    let db_name = common::fresh_db_name();
    let db_url = format!("{}/{db_name}", common::PG);
    let pool = cachet::server::connect_and_migrate(&db_url, 2)
        .await
        .unwrap();
    let key = common::tenant_with_key(&pool, "chaos").await;
    let dir = common::tempdir::Dir::new();
    let serve = start_serve(&db_url, &dir.0, &[("CACHET_SIM_TIME_SCALE", "0.2")]);
    let load = Load::start(&serve.url, &key, 6, 4);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let pid = serve.child.id().to_string();
    let signal = |s: &str| {
        assert!(
            Command::new("kill")
                .args([s, &pid])
                .status()
                .unwrap()
                .success()
        )
    };
    let before = load.answered();
    signal("-STOP");
    tokio::time::sleep(outage()).await;
    let during = load.answered() - before;
    signal("-CONT");
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
    let rows = ledger_settled(&pool, &seen).await;
    assert!(
        seen.iter().all(|(id, _)| rows.contains_key(id)),
        "answered without a row"
    );
    assert_eq!(rows.len(), seen.len());
    drop(serve);
    pool.close().await;
    common::drop_db(&db_name).await;
}
