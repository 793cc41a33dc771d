//! `cachet node` as a real process: it announces itself in Redis, serves its store over the
//! fabric transport only to holders of the cluster token, publishes its block events, and
//! leaves the membership when killed (after the heartbeat expiry) or stopped (at once).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use cache_fabric::events::Follower;
use cache_fabric::index::PrefixIndex;
use cache_fabric::membership;
use cache_fabric::transport::{RemoteEntry, TcpTransport, Transport, TransportError};
use cache_fabric::{EntryKind, PutBlock};
use cachet_common::{BlockHash, Scope, TenantId, WorkspaceId};

const TOKEN: &str = "a-cluster-token-for-tests";
const REDIS: &str = "redis://127.0.0.1:6379";

struct Node {
    child: Child,
    addr: String,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_node(id: &str, prefix: &str, data_dir: &std::path::Path) -> Node {
    let mut child = Command::new(env!("CARGO_BIN_EXE_cachet"))
        .args([
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
        .stderr(Stdio::null())
        .spawn()
        .expect("start cachet node");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .rsplit(' ')
        .next()
        .expect("node prints its address")
        .to_string();
    assert!(
        line.starts_with(&format!("node {id} listening on ")),
        "{line:?}"
    );
    Node { child, addr }
}

async fn live_ids(conn: &mut redis::aio::MultiplexedConnection, prefix: &str) -> Vec<String> {
    membership::live_nodes(conn, prefix)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect()
}

/// Poll until `f` holds; `limit` only bounds a hang (it is not a performance target).
async fn wait_until(what: &str, limit: Duration, mut f: impl AsyncFnMut() -> bool) {
    let start = Instant::now();
    while !f().await {
        if start.elapsed() > limit {
            panic!("gave up waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
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
