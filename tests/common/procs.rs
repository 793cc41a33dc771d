//! `cachet node` and `cachet router` as child processes, for the cluster and chaos tests.
//! With `CACHET_TEST_NODE_LOGS=<dir>` their logs go to files there.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use std::time::{Duration, Instant};

use cache_fabric::transport::{TcpTransport, Transport};
use cachet_common::{BlockHash, Scope};

use super::REDIS;

/// The cluster token every test node and gateway shares.
pub const TOKEN: &str = "a-cluster-token-for-tests";

/// Where a child's stderr goes: a file under `CACHET_TEST_NODE_LOGS` (appended: a restarted
/// process keeps its first life's log), or nowhere.
pub fn log_to(name: &str) -> Stdio {
    std::env::var("CACHET_TEST_NODE_LOGS")
        .ok()
        .map(|d| {
            let f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(format!("{d}/{name}"))
                .unwrap();
            Stdio::from(f)
        })
        .unwrap_or_else(Stdio::null)
}

/// `cachet serve` as a child process.
pub struct Serve {
    pub child: Child,
    pub url: String,
    _stdout: BufReader<std::process::ChildStdout>,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `cachet serve` (sim engines unless `env` says otherwise) on a free port, on `db_url`.
pub fn start_serve(db_url: &str, data_dir: &std::path::Path, env: &[(&str, &str)]) -> Serve {
    start_serve_logging(db_url, data_dir, env, log_to("serve.log"))
}

/// [`start_serve`] with its log (stderr) going to `log`.
pub fn start_serve_logging(
    db_url: &str,
    data_dir: &std::path::Path,
    env: &[(&str, &str)],
    log: Stdio,
) -> Serve {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cachet"));
    cmd.arg("serve")
        .env("DATABASE_URL", db_url)
        .env("REDIS_URL", REDIS)
        .env("CACHET_DATA_DIR", data_dir)
        .env("CACHET_LISTEN", "127.0.0.1:0")
        .env("CACHET_ENGINE", "sim")
        .stdout(Stdio::piped())
        .stderr(log);
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

pub struct Node {
    pub child: Child,
    pub addr: String,
    /// The internal API address, when the node runs one.
    pub api: Option<String>,
    /// Kept open: a node whose stdout is closed would fail writing to it.
    _stdout: BufReader<std::process::ChildStdout>,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A `cachet node` process; `env` adds to (or overrides) the environment, `api` runs its
/// engines and internal API too.
pub fn start_node_with(
    id: &str,
    prefix: &str,
    data_dir: &std::path::Path,
    env: &[(&str, String)],
    api: bool,
) -> Node {
    start_node_logging(id, prefix, data_dir, env, api, log_to(&format!("{id}.log")))
}

/// [`start_node_with`] with its log (stderr) going to `log`.
pub fn start_node_logging(
    id: &str,
    prefix: &str,
    data_dir: &std::path::Path,
    env: &[(&str, String)],
    api: bool,
    log: Stdio,
) -> Node {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cachet"));
    cmd.args([
        "node",
        "--listen",
        "127.0.0.1:0",
        "--id",
        id,
        "--redis-prefix",
        prefix,
    ])
    .env("CACHET_CLUSTER_TOKEN", TOKEN)
    .env("REDIS_URL", REDIS)
    .env("CACHET_DATA_DIR", data_dir)
    .env("CACHET_DISK_CAPACITY_BYTES", "1048576")
    .stdout(Stdio::piped())
    .stderr(log);
    if api {
        cmd.args(["--api-listen", "127.0.0.1:0"]);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("start cachet node");
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert!(
        line.starts_with(&format!("node {id} listening on ")),
        "{line:?}"
    );
    let addr = line.trim().rsplit(' ').next().unwrap().to_string();
    let api = api.then(|| {
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert!(line.starts_with(&format!("node {id} api on ")), "{line:?}");
        line.trim().rsplit(' ').next().unwrap().to_string()
    });
    Node {
        child,
        addr,
        api,
        _stdout: out,
    }
}

pub struct Gateway {
    pub child: Child,
    pub url: String,
    _stdout: BufReader<std::process::ChildStdout>,
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn start_gateway(prefix: &str, env: &[(&str, String)]) -> Gateway {
    start_gateway_logging(prefix, env, log_to(&format!("gateway-{prefix}.log")))
}

/// [`start_gateway`] with its log (stderr) going to `log`.
pub fn start_gateway_logging(prefix: &str, env: &[(&str, String)], log: Stdio) -> Gateway {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cachet"));
    cmd.args(["router", "--redis-prefix", prefix])
        .env("CACHET_CLUSTER_TOKEN", TOKEN)
        .env("REDIS_URL", REDIS)
        .env("CACHET_LISTEN", "127.0.0.1:0")
        .stdout(Stdio::piped())
        .stderr(log);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("start cachet router");
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert!(line.starts_with("gateway listening on "), "{line:?}");
    Gateway {
        child,
        url: format!("http://{}", line.trim().rsplit(' ').next().unwrap()),
        _stdout: out,
    }
}

/// `cachet billing recover` of a stopped process's data directory (a killed node that will
/// not be started again): its usage journal, cut streams and spool into the ledger.
pub fn recover_data_dir(data_dir: &std::path::Path, db_url: &str) {
    let out = Command::new(env!("CARGO_BIN_EXE_cachet"))
        .args(["billing", "recover", "--data-dir"])
        .arg(data_dir)
        .env("DATABASE_URL", db_url)
        .output()
        .unwrap();
    super::succeeded(&out);
}

/// Poll until `f` holds; `limit` only bounds a hang (it is not a performance target).
pub async fn wait_until(what: &str, limit: Duration, mut f: impl AsyncFnMut() -> bool) {
    let start = Instant::now();
    while !f().await {
        if start.elapsed() > limit {
            panic!("gave up waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Wait until the gateway routes to `n` nodes.
pub async fn wait_for_nodes(http: &reqwest::Client, gw: &Gateway, n: usize) {
    wait_until(
        &format!("the gateway sees {n} nodes"),
        Duration::from_secs(30),
        async || {
            let r: serde_json::Value = match http.get(format!("{}/readyz", gw.url)).send().await {
                Ok(r) => r.json().await.unwrap_or_default(),
                Err(_) => return false,
            };
            r["nodes"].as_array().is_some_and(|nodes| nodes.len() == n)
        },
    )
    .await;
}

/// The full-block hashes of a request's cached prefix, computed as every node does.
pub fn block_hashes(body: &serde_json::Value, scope: Scope) -> Vec<BlockHash> {
    use engine::Engine;
    let engine = engine::sim::SimEngine::new(engine::sim::SimProfile::tiny(), 0.0);
    let bytes = serde_json::to_vec(body).unwrap();
    let (req, bps) = gateway::wire::validate::messages_request(&bytes, |_| {
        Some(gateway::wire::validate::ModelLimits {
            max_output_tokens: engine.info().max_output_tokens,
        })
    })
    .unwrap();
    let p = gateway::render::to_prompt(
        req.tools.as_deref(),
        req.system.as_ref(),
        &req.messages,
        scope,
    );
    let prepared = gateway::render::prepare(&engine, &p, &bps, scope).unwrap();
    prepared.keys.unwrap().blocks
}

/// How many of the nodes at `addrs` hold `hash`.
pub async fn copies(addrs: &[&str], scope: Scope, hash: BlockHash) -> usize {
    let t = TcpTransport::new(TOKEN);
    let mut n = 0;
    for a in addrs {
        if t.has(a, scope, &[hash])
            .await
            .map(|h| h[0])
            .unwrap_or(false)
        {
            n += 1;
        }
    }
    n
}
