//! `cachet loadtest replay` against a real `cachet serve` (sim engine, llama-8B profile) on
//! real Postgres and Redis: a slice of the conversation trace over two tenants, with the
//! ledger reconciled and the hit ratio checked against `simulate-cache` at the same fabric
//! capacity; then the report drawn in headless Chromium.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use serde_json::Value;

/// The first 200 records of the Mooncake conversation trace (`../shared/traces/mooncake/
/// conversation_trace.jsonl`), kept in the repository so a clean clone runs this test.
const TRACE: &str = "tests/data/conversation_trace_head200.jsonl";
/// Tokens per hash id: an eighth of Mooncake's 512, so a slice fits this machine's memory
/// (llama-8B KV is 128 KiB a token: 8 MiB a trace block here).
const BLOCK_TOKENS: u64 = 64;
/// Fabric DRAM in trace blocks: small enough that eviction decides the hit ratio.
const CAPACITY_BLOCKS: u64 = 128;
const REQUESTS: u64 = 200;
/// sim-llama-8b's minimum cacheable length.
const MIN_CACHEABLE: u64 = 1024;
const JWT_SECRET: &str = "replay-test-secret-0123456789abcdef";

struct Serve(Child);

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn cachet() -> Command {
    Command::new(env!("CARGO_BIN_EXE_cachet"))
}

fn trace_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(TRACE)
}

fn start_serve(db_url: &str, data_dir: &Path) -> (Serve, String) {
    start_serve_with(db_url, data_dir, "0.05")
}

fn start_serve_with(db_url: &str, data_dir: &Path, time_scale: &str) -> (Serve, String) {
    let mut child = cachet()
        .arg("serve")
        .env("DATABASE_URL", db_url)
        .env("REDIS_URL", common::REDIS)
        .env("CACHET_DATA_DIR", data_dir)
        .env("CACHET_LISTEN", "127.0.0.1:0")
        .env("CACHET_ENGINE", "sim")
        .env("CACHET_SIM_TIME_SCALE", time_scale)
        .env(
            "CACHET_DRAM_CAPACITY_BYTES",
            (CAPACITY_BLOCKS * BLOCK_TOKENS * 131_072).to_string(),
        )
        // DRAM only: the simulated ratio beside it is of one cache of this capacity.
        .env("CACHET_DISK_CAPACITY_BYTES", "0")
        .env("CACHET_ADMIN_JWT_SECRET", JWT_SECRET)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start cachet serve");
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert!(line.starts_with("serving on "), "{line:?}");
    let url = format!("http://{}", line.trim().rsplit(' ').next().unwrap());
    std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
    (Serve(child), url)
}

/// A finance token, from the CLI pointed at the test's own database (never the machine's
/// default one, which a CLI run would migrate).
fn finance_token(db_url: &str) -> String {
    let out = cachet()
        .env("DATABASE_URL", db_url)
        .args([
            "billing",
            "token",
            "--role",
            "finance",
            "--subject",
            "replay-test",
        ])
        .env("CACHET_ADMIN_JWT_SECRET", JWT_SECRET)
        .output()
        .unwrap();
    common::succeeded(&out);
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// `simulate-cache`'s token hit ratio for the same slice, split and cut the same way.
fn simulated_hit_ratio() -> f64 {
    let out = cachet()
        .args(["loadtest", "simulate-cache", "--trace"])
        .arg(trace_path())
        .args([
            "--capacity-blocks",
            &CAPACITY_BLOCKS.to_string(),
            "--tenants",
            "2",
            "--block-tokens",
            &BLOCK_TOKENS.to_string(),
            "--min-cacheable-tokens",
            &MIN_CACHEABLE.to_string(),
            "--max-requests",
            &REQUESTS.to_string(),
        ])
        .output()
        .unwrap();
    common::succeeded(&out);
    let text = String::from_utf8(out.stdout).unwrap();
    // The service's default policy (the line after plain LRU's).
    let line = text
        .lines()
        .find(|l| l.starts_with("policy=adaptive"))
        .unwrap_or_else(|| panic!("no adaptive line in {text}"));
    line.split('\t')
        .find_map(|f| f.strip_prefix("token_hit_ratio="))
        .unwrap()
        .parse()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trace_slice_replays_without_errors_reconciles_exactly_and_matches_the_simulation() {
    let (db_name, db_url, pool) = common::fresh_db().await;
    let keys = [
        common::tenant_with_key(&pool, "replay-a").await,
        common::tenant_with_key(&pool, "replay-b").await,
    ];
    let data = common::tempdir::Dir::new();
    let (serve, url) = start_serve(&db_url, &data.0);
    let out_dir = common::tempdir::Dir::new();
    let out = out_dir.0.join("run");
    let token = finance_token(&db_url);
    let run = tokio::task::spawn_blocking({
        let (out, url) = (out.clone(), url.clone());
        move || {
            cachet()
                .args(["loadtest", "replay", "--trace"])
                .arg(trace_path())
                .args(["--url", &url, "--api-key", &keys.join(",")])
                .arg("--out")
                .arg(&out)
                .args([
                    "--model",
                    "sim-llama-8b",
                    "--block-tokens",
                    &BLOCK_TOKENS.to_string(),
                    "--max-requests",
                    &REQUESTS.to_string(),
                    "--speed",
                    "4",
                    "--max-output-tokens",
                    "16",
                    "--simulate-fleet",
                    "h200-llama3-8b",
                    "--quiet",
                ])
                .env("CACHET_FINANCE_TOKEN", token)
                .output()
                .unwrap()
        }
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "replay failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let s: Value =
        serde_json::from_slice(&std::fs::read(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(s["sent"], REQUESTS, "{stdout}");
    assert_eq!(s["errors"], 0, "{stdout}");
    assert_eq!(s["ok"], REQUESTS);
    // Every answer was exactly its trace's length (capped): ignore_eos honoured.
    let records = std::fs::read_to_string(out.join("requests.jsonl")).unwrap();
    let mut lines = 0;
    for l in records.lines() {
        let r: Value = serde_json::from_str(l).unwrap();
        assert_eq!(r["usage"]["output_tokens"], r["max_tokens"], "{r}");
        assert!(r["request_id"].as_str().unwrap().starts_with("req_"));
        assert!(r["ttft_ms"].as_f64().unwrap() > 0.0);
        lines += 1;
    }
    assert_eq!(lines, REQUESTS);
    // The ledger holds every answered request with exactly the usage its client saw.
    let rec = &s["reconciliation"];
    assert_eq!(rec["exact"], true, "{rec}");
    assert_eq!(rec["checked"], REQUESTS);
    assert_eq!(rec["matched"], REQUESTS);
    // Both tenants got sessions; their hit ratios add up to the run's.
    let tenants = s["tenants"].as_array().unwrap();
    assert_eq!(tenants.len(), 2);
    assert!(
        tenants.iter().all(|t| t["requests"].as_u64().unwrap() > 40),
        "{tenants:?}"
    );
    let hit = s["hit_ratio"].as_f64().unwrap();
    let sim = simulated_hit_ratio();
    assert!(hit > 0.0, "no hits at all: {stdout}");
    assert!(
        (hit - sim).abs() <= 0.02,
        "replay hit ratio {hit:.4} vs simulate-cache {sim:.4}"
    );
    // simulate-fleet's prediction for the same requests sits beside the measured run: every
    // request, answers of the asked length (16 tokens: gaps to time), hits from the same store.
    let fleet = &s["simulated_fleet"];
    assert_eq!(fleet["requests"], REQUESTS, "{fleet}");
    assert!(fleet["ttft_p50_ms"].as_f64().unwrap() > 0.0, "{fleet}");
    assert!(fleet["tbt_p50_ms"].as_f64().unwrap() > 0.0, "{fleet}");
    assert!(fleet["token_hit_ratio"].as_f64().unwrap() > 0.0, "{fleet}");
    assert!(
        stdout.contains("simulate-fleet (h200-llama3-8b, 1 instance(s), leastloaded)"),
        "{stdout}"
    );
    // Priced at the list default (no sim-llama-8b price in a fresh book), with and without.
    assert!(s["cost"]["without_cache_nanos"].as_i64().unwrap() > 0);
    drop(serve);

    renders_every_plot(&out.join("report.html"), &loadtests::report::REPLAY_PLOTS);
    pool.close().await;
    common::drop_db(&db_name).await;
}

/// A sweep of a generated chat workload: one replay per rate, the capacity under the SLOs, and
/// its report drawn; then a replay interrupted with Ctrl-C still writes its summary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_finds_a_capacity_and_an_interrupted_replay_still_reports() {
    let (db_name, db_url, pool) = common::fresh_db().await;
    let key = common::tenant_with_key(&pool, "sweep").await;
    let data = common::tempdir::Dir::new();
    let (serve, url) = start_serve_with(&db_url, &data.0, "0.01");
    let dir = common::tempdir::Dir::new();
    let out = dir.0.join("sweep");
    let loadtest = |sub: &str, out: &Path| {
        let mut c = cachet();
        c.args(["loadtest", sub])
            .args(["--url", &url, "--api-key", &key, "--model", "sim-tiny"])
            .args(["--workload", "chat", "--workload-requests", "400"])
            .args([
                "--block-tokens",
                "32",
                "--max-output-tokens",
                "8",
                "--quiet",
            ])
            .arg("--out")
            .arg(out);
        c
    };
    let run = loadtest("sweep", &out)
        .args([
            "--rates",
            "2,4",
            "--step-secs",
            "3",
            "--ttft-p90-ms",
            "5000",
            "--tbt-p90-ms",
            "1000",
            // Each step's prediction beside it: the same requests at the same send times.
            "--simulate-fleet",
            "h200-llama3-8b",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let s: Value = serde_json::from_slice(&std::fs::read(out.join("sweep.json")).unwrap()).unwrap();
    let steps = s["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 2, "{s}");
    assert!(
        steps
            .iter()
            .all(|st| st["errors"] == 0 && st["meets"] == true),
        "{s}"
    );
    assert_eq!(s["capacity_rps"], 4.0);
    // One instance of the H200 profile answers 2 and 4 short chats a second well inside both
    // SLOs: the prediction meets them at every step.
    for st in steps {
        let sim = &st["simulated"];
        assert!(sim["ttft_p90_ms"].as_f64().unwrap() > 0.0, "{st}");
        assert_eq!(sim["meets"], true, "{st}");
    }
    assert_eq!(s["simulated_capacity_rps"], 4.0, "{s}");
    assert_eq!(s["simulated_fleet"]["profile"], "h200-llama3-8b");
    assert!(
        stdout.contains("simulate-fleet predicted capacity: 4 requests/s"),
        "{stdout}"
    );
    for st in steps {
        let dir = out.join(st["dir"].as_str().unwrap());
        assert!(dir.join("report.html").exists() && dir.join("trace.jsonl").exists());
    }
    assert!(stdout.contains("capacity: 4 requests/s"), "{stdout}");
    renders_every_plot(&out.join("sweep.html"), &loadtests::report::SWEEP_PLOTS);

    // The same workload over OpenAI's wire, reconciled with the ledger.
    let out3 = dir.0.join("openai");
    let run = loadtest("replay", &out3)
        .args(["--api", "openai", "--rate", "40", "--max-requests", "60"])
        .env("CACHET_FINANCE_TOKEN", finance_token(&db_url))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{stdout}");
    let s: Value =
        serde_json::from_slice(&std::fs::read(out3.join("summary.json")).unwrap()).unwrap();
    assert_eq!(
        (s["ok"].as_u64(), s["errors"].as_u64()),
        (Some(60), Some(0)),
        "{stdout}"
    );
    assert_eq!(s["reconciliation"]["exact"], true);
    assert!(s["hit_ratio"].as_f64().unwrap() > 0.0);

    // Ctrl-C (SIGINT) a long replay: it stops sending, waits for answers, writes the summary.
    let out2 = dir.0.join("interrupted");
    let mut child = loadtest("replay", &out2)
        .args(["--rate", "20", "--duration", "120"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let k = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(k.success());
    // It drains and exits by itself, well before its --duration (a hang guard, not a target).
    let mut status = None;
    common::procs::wait_until(
        "the interrupted replay exits",
        std::time::Duration::from_secs(60),
        async || {
            status = child.try_wait().unwrap();
            status.is_some()
        },
    )
    .await;
    assert!(status.unwrap().success(), "{status:?}");
    let s: Value =
        serde_json::from_slice(&std::fs::read(out2.join("summary.json")).unwrap()).unwrap();
    let sent = s["sent"].as_u64().unwrap();
    assert!(sent > 10 && sent < 400, "{s}");
    assert_eq!(s["done"], sent);
    drop(serve);
    pool.close().await;
    common::drop_db(&db_name).await;
}

/// The report in headless Chromium: every plot drawn (a canvas in each), and a screenshot
/// (kept where CACHET_REPORT_SCREENSHOT says, for the docs).
fn renders_every_plot(report: &Path, plots: &[&str]) {
    let Some(chromium) = ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find(|b| Command::new(b).arg("--version").output().is_ok())
    else {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must have chromium (.ci/run installs it)"
        );
        eprintln!("no chromium here: the report's browser check is skipped");
        return;
    };
    let url = format!("file://{}", report.display());
    let common_args = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--virtual-time-budget=10000",
        "--window-size=1240,2200",
    ];
    let dom = Command::new(chromium)
        .args(common_args)
        .arg("--dump-dom")
        .arg(&url)
        .stderr(Stdio::null())
        .output()
        .unwrap();
    let dom = String::from_utf8_lossy(&dom.stdout);
    for name in plots {
        let tag = format!("data-plot=\"{name}\" data-rendered=\"1\"");
        let at = dom.find(&tag).unwrap_or_else(|| {
            panic!(
                "plot {name} was not drawn:\n{}",
                &dom[..dom.len().min(3000)]
            )
        });
        let rest = &dom[at..];
        let end = rest.find("</div></div>").unwrap_or(rest.len());
        assert!(rest[..end].contains("<canvas"), "plot {name} has no canvas");
    }
    let shot = std::env::var("CACHET_REPORT_SCREENSHOT")
        .map(PathBuf::from)
        .unwrap_or_else(|_| report.with_extension("png"));
    let ok = Command::new(chromium)
        .args(common_args)
        .arg(format!("--screenshot={}", shot.display()))
        .arg(&url)
        .stderr(Stdio::null())
        .output()
        .unwrap();
    assert!(ok.status.success());
    let png = std::fs::read(&shot).unwrap();
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 20_000,
        "{} bytes",
        png.len()
    );
}
