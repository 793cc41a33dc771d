//! What a peer holding the cluster token can send a node's fabric port: any bytes after the
//! handshake. The node answers or closes the connection; it never panics, and its store
//! stays usable.

#![no_main]

use std::sync::OnceLock;

use cache_fabric::transport::serve_stream;
use cache_fabric::{EvictionPolicy, FabricNode, NodeConfig};
use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const TOKEN: &str = "a-cluster-token-for-fuzzing";

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap()
    })
}

fuzz_target!(|data: &[u8]| {
    // A small store, fresh per input: what one input writes cannot hide a later one's bug.
    let node = FabricNode::new(NodeConfig {
        dram_capacity_bytes: 1 << 20,
        eviction: EvictionPolicy::DEFAULT,
    });
    let mut hello = Vec::new();
    hello.extend_from_slice(&(3 + TOKEN.len() as u32).to_le_bytes());
    hello.push(1); // HELLO
    hello.extend_from_slice(&(TOKEN.len() as u16).to_le_bytes());
    hello.extend_from_slice(TOKEN.as_bytes());
    runtime().block_on(async {
        let (client, server) = tokio::io::duplex(64 << 10);
        let (mut rx, mut tx) = tokio::io::split(client);
        let send = async move {
            let _ = tx.write_all(&hello).await;
            let _ = tx.write_all(data).await;
            let _ = tx.shutdown().await;
        };
        let drain = async move {
            let mut sink = Vec::new();
            let _ = rx.read_to_end(&mut sink).await;
        };
        let (_, served, _) = tokio::join!(send, serve_stream(server, &node, TOKEN), drain);
        // Whatever ended the connection, it was not the node: an error or a clean close.
        let _ = served;
    });
    assert!(node.with_store(|s| s.used_bytes()) <= 1 << 20);
});
