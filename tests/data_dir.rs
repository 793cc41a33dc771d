//! One owner per data directory, and usage files that know their database (decision 0030):
//! a second `serve` or `node` on a held directory refuses and names the holder, kill -9 frees
//! the directory, and a journal a server of another database left behind is kept aside, never
//! replayed into this database's ledger, and recovered into its own.

mod common;

use std::process::Command;
use std::time::Duration;

use common::procs::{TOKEN, log_to, start_node_with, start_serve, start_serve_logging};
use common::*;

/// `cachet <args>` with `CACHET_DATA_DIR=dir` that must fail at start: its stderr.
fn refused(args: &[&str], dir: &std::path::Path, db_url: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_cachet"))
        .args(args)
        .env("DATABASE_URL", db_url)
        .env("REDIS_URL", REDIS)
        .env("CACHET_DATA_DIR", dir)
        .env("CACHET_LISTEN", "127.0.0.1:0")
        .env("CACHET_ENGINE", "sim")
        .env("CACHET_CLUSTER_TOKEN", TOKEN)
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "{args:?} started on a held directory"
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_serve_or_node_on_a_held_directory_refuses_naming_the_holder() {
    let (db_name, db_url, _pool) = fresh_db().await;
    let dir = tempdir::Dir::new();

    let mut first = start_serve(&db_url, &dir.0, &[]);
    let pid = first.child.id();
    let err = refused(&["serve"], &dir.0, &db_url);
    assert!(
        err.contains("in use by another Cachet process")
            && err.contains(&format!("pid {pid}, cachet serve, since ")),
        "{err}"
    );
    // kill -9: the kernel drops the lock with the process.
    first.child.kill().unwrap();
    first.child.wait().unwrap();
    let again = start_serve(&db_url, &dir.0, &[]);
    drop(again);

    // Nodes: the same id on the same directory is one owner too (its disk tier, its spool).
    let prefix = format!("dirlock-{}", uuid::Uuid::new_v4().simple());
    let env: [(&str, String); 0] = [];
    let mut node = start_node_with("n1", &prefix, &dir.0, &env, false);
    let pid = node.child.id();
    let err = refused(
        &[
            "node",
            "--listen",
            "127.0.0.1:0",
            "--id",
            "n1",
            "--redis-prefix",
            &prefix,
        ],
        &dir.0,
        &db_url,
    );
    assert!(
        err.contains(&format!("pid {pid}, cachet node n1, since ")),
        "{err}"
    );
    // Another id keeps a directory of its own under the same data_dir.
    let other = start_node_with("n2", &prefix, &dir.0, &env, false);
    node.child.kill().unwrap();
    node.child.wait().unwrap();
    let node = start_node_with("n1", &prefix, &dir.0, &env, false);
    drop((node, other));
    drop_db(&db_name).await;
}

async fn ledger_ids(pool: &sqlx::PgPool) -> Vec<String> {
    let rows: Vec<uuid::Uuid> = sqlx::query_scalar("SELECT request_id FROM usage_events")
        .fetch_all(pool)
        .await
        .unwrap();
    rows.iter().map(|u| format!("req_{}", u.simple())).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journal_of_another_database_is_kept_aside_and_recovered_only_into_its_own() {
    let (a_name, a_url, a_pool) = fresh_db().await;
    let (b_name, b_url, b_pool) = fresh_db().await;
    let a_id = billing::database::identity(&a_pool).await.unwrap();
    let b_id = billing::database::identity(&b_pool).await.unwrap();
    assert_ne!(a_id, b_id, "every database has its own identity");
    let dir = tempdir::Dir::new();

    // A server of database A answers 5 requests and is killed at once: their events are in
    // its usage journal (the ledger insert follows asynchronously).
    let key = tenant_with_key(&a_pool, "a").await;
    let mut a = start_serve(&a_url, &dir.0, &[]);
    let client = reqwest::Client::new();
    let mut ids = Vec::new();
    for i in 0..5 {
        let body = cached_body(40, &format!("journal {i}"), 4);
        let r = messages(&client, &a.url, &key, &body).send().await.unwrap();
        assert_eq!(r.status(), 200);
        ids.push(r.headers()["request-id"].to_str().unwrap().to_string());
    }
    a.child.kill().unwrap();
    a.child.wait().unwrap();
    let journal: Vec<_> = std::fs::read_dir(&dir.0)
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().contains(".journal."))
        .collect();
    assert!(!journal.is_empty(), "A left its journal");

    // A server of database B on the same directory keeps A's files aside and says so.
    let log = dir.0.with_extension("b.log");
    let b = start_serve_logging(
        &b_url,
        &dir.0,
        &[],
        std::process::Stdio::from(std::fs::File::create(&log).unwrap()),
    );
    let metrics = common::get_text(&client, format!("{}/metrics", b.url)).await;
    assert!(
        metrics.contains("cachet_billing_meter_kept_aside 1"),
        "the kept-aside directory is counted"
    );
    // Long enough for a spool replay (every 0.5 s) to have put anything into B's ledger.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    drop(b);
    let text = std::fs::read_to_string(&log).unwrap();
    let _ = std::fs::remove_file(&log);
    assert!(
        text.contains("usage files of another database found") && text.contains(&a_id.to_string()),
        "{text}"
    );
    assert!(ledger_ids(&b_pool).await.is_empty(), "B's ledger untouched");
    let kept = common::kept_aside(&dir.0);
    assert_eq!(kept.len(), 1);
    assert!(
        kept[0]
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with(&a_id.to_string())
    );
    assert_eq!(
        std::fs::read_to_string(dir.0.join(billing::database::IDENTITY_FILE))
            .unwrap()
            .trim(),
        b_id.to_string(),
        "the directory is B's now"
    );

    // Recovering the kept-aside files into B is refused; into A, every answered request is
    // in A's ledger once.
    let out = Command::new(env!("CARGO_BIN_EXE_cachet"))
        .args(["billing", "recover", "--data-dir"])
        .arg(&kept[0])
        .env("DATABASE_URL", &b_url)
        .stderr(log_to("recover.log"))
        .output()
        .unwrap();
    assert!(!out.status.success(), "recovered into the wrong database");
    assert!(ledger_ids(&b_pool).await.is_empty());
    common::procs::recover_data_dir(&kept[0], &a_url);
    let in_a = ledger_ids(&a_pool).await;
    for id in &ids {
        assert_eq!(
            in_a.iter().filter(|r| *r == id).count(),
            1,
            "{id} once in A"
        );
    }
    assert_eq!(in_a.len(), ids.len());
    a_pool.close().await;
    b_pool.close().await;
    drop_db(&a_name).await;
    drop_db(&b_name).await;
}
