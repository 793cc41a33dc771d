//! The fabric's layering, checked on its sources: node ← transport ← cluster ← client, the
//! tiers below the store, block integrity below both; the shared-memory arena (and the
//! extent allocator it shares with RDMA) below the store, and the same-host server
//! (`local`) beside the transport, above the node; the KV event stream (`kv_events`) below the
//! store, the block events and the node, and the parsing of Redis Stream replies below both.
//! A `use` that points up the stack (or makes a circle) fails here, before it tangles the
//! crate again.

use std::path::Path;

/// Modules a file may not name (`crate::<module>`), outside comments.
const FORBIDDEN: &[(&str, &[&str])] = &[
    (
        "extents.rs",
        &[
            "arena",
            "store",
            "node",
            "transport",
            "local",
            "cluster",
            "client",
            "rdma",
        ],
    ),
    (
        "arena.rs",
        &[
            "store",
            "node",
            "transport",
            "local",
            "cluster",
            "client",
            "rdma",
        ],
    ),
    (
        "store/arena.rs",
        &["node", "transport", "local", "cluster", "client", "rdma"],
    ),
    ("local.rs", &["cluster", "client", "rdma"]),
    (
        "integrity.rs",
        &[
            "store",
            "tier",
            "node",
            "transport",
            "cluster",
            "client",
            "rdma",
        ],
    ),
    (
        "tier.rs",
        &["store", "node", "transport", "cluster", "client", "rdma"],
    ),
    (
        "stats.rs",
        &["store", "node", "transport", "cluster", "client"],
    ),
    (
        "policy.rs",
        &["store", "node", "transport", "cluster", "client"],
    ),
    (
        "store/mod.rs",
        &["node", "transport", "local", "cluster", "client", "rdma"],
    ),
    (
        "node.rs",
        &[
            "transport",
            "local",
            "cluster",
            "client",
            "rdma::pull",
            "rdma::serve",
        ],
    ),
    ("rdma.rs", &["node", "transport", "cluster", "client"]),
    (
        "rdma/serve.rs",
        &["transport", "cluster", "client", "rdma::pull"],
    ),
    (
        "transport.rs",
        &["local", "cluster", "client", "rdma::pull"],
    ),
    ("rdma/pull.rs", &["cluster", "client"]),
    ("cluster.rs", &["client"]),
    // Redis Stream replies: below everything that reads a stream.
    (
        "streams.rs",
        &[
            "events",
            "kv_events",
            "index",
            "store",
            "node",
            "transport",
            "cluster",
            "client",
        ],
    ),
    // The KV event stream: below the store (which reports its media to it), the block
    // events (which hand it the store's events), the node (which holds the engine map) and
    // the transport (which fills it).
    ("kv_events/mod.rs", ABOVE_KV_EVENTS),
    ("kv_events/map.rs", ABOVE_KV_EVENTS),
    ("kv_events/vllm.rs", ABOVE_KV_EVENTS),
    ("kv_events/follow.rs", ABOVE_KV_EVENTS),
];

/// What the KV event stream's files may not name.
const ABOVE_KV_EVENTS: &[&str] = &[
    "events",
    "store",
    "node",
    "transport",
    "local",
    "cluster",
    "client",
];

#[test]
fn imports_point_down_the_stack() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut bad = Vec::new();
    for (file, forbidden) in FORBIDDEN {
        let text = std::fs::read_to_string(src.join(file)).expect("source file");
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            for m in *forbidden {
                let name = format!("crate::{m}");
                let hit = code.match_indices(&name).any(|(i, _)| {
                    // `crate::rdma` must not match `crate::rdma_x`; `::` after is fine.
                    code[i + name.len()..]
                        .chars()
                        .next()
                        .is_none_or(|c| !(c.is_alphanumeric() || c == '_'))
                });
                if hit {
                    bad.push(format!("{file}:{}: {}", n + 1, line.trim()));
                }
            }
        }
    }
    assert!(bad.is_empty(), "imports up the stack:\n{}", bad.join("\n"));
}
