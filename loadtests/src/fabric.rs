//! Fabric baselines: node-to-node transfer, the prefix index at scale, block events
//! through Redis.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// A fabric node with no cluster around it: TCP on `listen`, the same-host path at `socket`
/// (none if empty), until the process is stopped.
pub async fn standalone_node(listen: &str, socket: &str, dram_bytes: u64) -> anyhow::Result<()> {
    use cache_fabric::{EvictionPolicy, FabricNode, NodeConfig};
    let token = std::env::var("CACHET_CLUSTER_TOKEN")
        .ok()
        .filter(|t| !t.is_empty())
        .context("CACHET_CLUSTER_TOKEN must be set")?;
    if dram_bytes == 0 {
        bail!("--dram-bytes must be positive");
    }
    let node = FabricNode::new(NodeConfig {
        dram_capacity_bytes: dram_bytes,
        eviction: EvictionPolicy::Lru,
    });
    let token: std::sync::Arc<str> = token.into();
    let _local = if socket.is_empty() {
        None
    } else {
        let server =
            cache_fabric::local::serve_local(socket.as_ref(), node.clone(), token.clone())?;
        println!("socket {}", server.path().display());
        Some(server)
    };
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding {listen}"))?;
    println!("listening on {}", listener.local_addr()?);
    use std::io::Write;
    std::io::stdout().flush()?;
    tokio::select! {
        _ = cache_fabric::transport::serve_tcp(listener, node, token) => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    Ok(())
}

/// Node→node transfer of one large block over loopback: the fabric's TCP transport (pull,
/// checksum verified) vs a plain tokio socket copy of the same bytes vs Redis SET/GET.
pub async fn transfer_bench(
    size_mib: usize,
    iterations: usize,
    stripes: &[usize],
    redis_url: &str,
    rdma_device: Option<&str>,
) -> anyhow::Result<()> {
    use cache_fabric::transport::{RemoteEntry, TcpTransport, Transport, serve_tcp};
    use cache_fabric::{EntryKind, EvictionPolicy, FabricNode, NodeConfig, PutBlock};
    use cachet_common::{BlockHash, Scope, TenantId, WorkspaceId};

    if size_mib == 0 || iterations == 0 {
        bail!("--size-mib and --iterations must be positive");
    }
    #[cfg(not(feature = "rdma"))]
    if rdma_device.is_some() {
        bail!("--rdma-device needs a build with the rdma feature (cargo build --features rdma)");
    }
    let size = size_mib << 20;
    let payload: bytes::Bytes = (0..size)
        .map(|i| (i * 131 % 251) as u8)
        .collect::<Vec<u8>>()
        .into();
    let gib = |secs: f64| (size * iterations) as f64 / secs / (1u64 << 30) as f64;
    let mut rows: Vec<(String, f64)> = Vec::new();

    // 1. Plain tokio socket copy: one connection, a one-byte request, the payload back into a
    //    buffer allocated once. The limit for moving these bytes over loopback TCP here.
    rows.push((
        "plain tokio socket copy".into(),
        gib(plain_copy(&payload, iterations).await?),
    ));

    // 2. The fabric: a node serving its store, pulled through the TCP transport.
    let node = FabricNode::new(NodeConfig {
        dram_capacity_bytes: (4 * size) as u64,
        eviction: EvictionPolicy::Lru,
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?.to_string();
    let token: std::sync::Arc<str> = "bench-token".into();
    let serving = tokio::spawn(serve_tcp(listener, node.clone(), token.clone()));
    let scope = Scope {
        tenant: TenantId::new(),
        workspace: WorkspaceId::new(),
    };
    let hash = BlockHash([7; 32]);
    let block = PutBlock::new(hash, None, 16, payload.clone());
    let entry = RemoteEntry {
        scope,
        existing: vec![],
        new: vec![block],
        ttl: Duration::from_secs(3600),
        kind: EntryKind::Paid,
        replica: false,
        handoff: false,
    };
    for &n in stripes {
        let mut t = TcpTransport::new(token.clone());
        t.stripes = n.max(1);
        t.put_entry(&addr, &entry)
            .await?
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let secs = timed_pulls(&t, &addr, scope, hash, size, iterations).await?;
        rows.push((
            format!(
                "cachet fabric pull, {} connection(s), crc32c verified",
                t.stripes
            ),
            gib(secs),
        ));
        let start = Instant::now();
        for _ in 0..iterations {
            t.put_entry(&addr, &entry)
                .await?
                .map_err(|e| anyhow::anyhow!("{e}"))?;
        }
        rows.push((
            "cachet fabric push (PUT), 1 connection".into(),
            gib(start.elapsed().as_secs_f64()),
        ));
    }
    // The same pull by RDMA READ from the node's registered pool.
    #[cfg(feature = "rdma")]
    if let Some(name) = rdma_device {
        use cache_fabric::rdma::{Export, pull::RdmaTransport, verbs::Device};
        let device = Device::open(Some(name)).with_context(|| format!("opening {name}"))?;
        node.export_rdma(Export::new(device.clone(), 2 * size)?);
        let mut t = RdmaTransport::new(token.clone());
        t.set_region_bytes(size.next_power_of_two());
        t.enable(device);
        t.connect_now(&addr)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let before = t.rdma_bytes();
        let secs = timed_pulls(&t, &addr, scope, hash, size, iterations).await?;
        anyhow::ensure!(
            t.rdma_bytes() - before == (size * (iterations + 2)) as u64,
            "some pulls went over TCP ({} fallbacks)",
            t.fallbacks()
        );
        rows.push((
            format!("cachet fabric pull, RDMA READ ({name}), crc32c verified"),
            gib(secs),
        ));
    }
    serving.abort();

    // 3. Redis: SET then GET of the same payload.
    if !redis_url.is_empty() {
        for (name, secs) in redis_set_get(redis_url, &payload, iterations).await? {
            rows.push((name.into(), gib(secs)));
        }
    }
    let limit = rows[0].1;
    for (name, rate) in &rows {
        println!(
            "{name}\t{size_mib} MiB × {iterations}\t{rate:.2} GiB/s\t{:.0}% of plain copy",
            100.0 * rate / limit
        );
    }
    Ok(())
}

/// Seconds that `iterations` round trips of `payload` take over one plain tokio socket
/// (after two warm-ups): a one-byte request, the payload back into a buffer allocated once.
async fn plain_copy(payload: &bytes::Bytes, iterations: usize) -> anyhow::Result<f64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let p = payload.clone();
    let server = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await?;
        s.set_nodelay(true)?;
        while s.read_u8().await.is_ok() {
            s.write_all(&p).await?;
        }
        anyhow::Ok(())
    });
    let mut c = tokio::net::TcpStream::connect(addr).await?;
    c.set_nodelay(true)?;
    let mut buf = vec![0u8; payload.len()];
    for _ in 0..2 {
        c.write_u8(1).await?;
        c.read_exact(&mut buf).await?;
    }
    let t = Instant::now();
    for _ in 0..iterations {
        c.write_u8(1).await?;
        c.read_exact(&mut buf).await?;
    }
    let secs = t.elapsed().as_secs_f64();
    anyhow::ensure!(buf[..] == payload[..], "plain copy corrupted the payload");
    drop(c);
    server.await??;
    Ok(secs)
}

/// Seconds that `iterations` Redis SETs, then GETs, of `payload` take.
async fn redis_set_get(
    redis_url: &str,
    payload: &bytes::Bytes,
    iterations: usize,
) -> anyhow::Result<[(&'static str, f64); 2]> {
    let client = redis::Client::open(redis_url)?;
    let mut con = client
        .get_multiplexed_async_connection()
        .await
        .with_context(|| format!("connecting to {redis_url}"))?;
    let key = "cachet:bench:transfer";
    let _: () = redis::cmd("SET")
        .arg(key)
        .arg(&payload[..])
        .query_async(&mut con)
        .await?;
    let start = Instant::now();
    for _ in 0..iterations {
        let _: () = redis::cmd("SET")
            .arg(key)
            .arg(&payload[..])
            .query_async(&mut con)
            .await?;
    }
    let set = start.elapsed().as_secs_f64();
    let start = Instant::now();
    for _ in 0..iterations {
        let v: Vec<u8> = redis::cmd("GET").arg(key).query_async(&mut con).await?;
        anyhow::ensure!(v.len() == payload.len());
    }
    let get = start.elapsed().as_secs_f64();
    let _: () = redis::cmd("DEL").arg(key).query_async(&mut con).await?;
    Ok([("redis SET", set), ("redis GET", get)])
}

/// Seconds that `iterations` pulls of the block take through `t`, after two warm-up pulls;
/// each must arrive whole.
async fn timed_pulls(
    t: &impl cache_fabric::transport::Transport,
    addr: &str,
    scope: cachet_common::Scope,
    hash: cachet_common::BlockHash,
    size: usize,
    iterations: usize,
) -> anyhow::Result<f64> {
    for _ in 0..2 {
        t.get_block(addr, scope, hash).await?;
    }
    let start = Instant::now();
    for _ in 0..iterations {
        let b = t
            .get_block(addr, scope, hash)
            .await?
            .context("the block vanished")?;
        anyhow::ensure!(b.data.len() == size);
    }
    Ok(start.elapsed().as_secs_f64())
}

pub(crate) fn index_bench(
    blocks: usize,
    prompt_tokens: usize,
    block_tokens: usize,
    lookups: usize,
) -> anyhow::Result<()> {
    use cache_fabric::index::{BlockEvent, PrefixIndex};
    use cachet_common::BlockHash;
    if block_tokens == 0 || prompt_tokens < block_tokens || lookups == 0 {
        bail!("--prompt-tokens must be at least --block-tokens (> 0), --lookups > 0");
    }
    let chain_len = prompt_tokens / block_tokens;
    let chains = (blocks / chain_len).max(1);
    // Pseudo-random block hashes (only their uniformity matters here), laid out as `chains`
    // prompts of `chain_len` blocks each, spread over 8 nodes.
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let hash_of = |seed: u64| {
        let mut b = [0u8; 32];
        b[..8].copy_from_slice(&seed.to_le_bytes());
        BlockHash(b)
    };
    let keys: Vec<u64> = (0..chains * chain_len).map(|_| next()).collect();
    let before = crate::rss_bytes()?;
    let started = Instant::now();
    let mut idx = PrefixIndex::with_capacity(keys.len());
    for (i, k) in keys.iter().enumerate() {
        idx.apply(BlockEvent::Stored {
            hash: hash_of(*k),
            slot: i % 8,
        });
    }
    let build = started.elapsed();
    let per_block = (crate::rss_bytes()? - before) as f64 / idx.len() as f64;
    // Look up whole prompts, each a different chain, in a scattered order (a warm cache
    // would flatter the figures).
    let mut times = Vec::with_capacity(lookups);
    let mut found = 0usize;
    let mut chain = Vec::with_capacity(chain_len);
    // Chain `c`'s block hashes into `chain`.
    let fill = |chain: &mut Vec<_>, c: usize| {
        chain.clear();
        let blocks = &keys[c * chain_len..(c + 1) * chain_len];
        chain.extend(blocks.iter().map(|k| hash_of(*k)));
    };
    for l in 0..lookups {
        fill(&mut chain, (l * 7919) % chains);
        let t = Instant::now();
        found += idx.longest_prefix(&chain);
        times.push(t.elapsed().as_secs_f64() * 1e6);
    }
    anyhow::ensure!(found == lookups * chain_len, "a prefix was not found whole");
    times.sort_by(f64::total_cmp);
    let pct = |p: f64| times[((times.len() - 1) as f64 * p) as usize];
    println!(
        "indexed_blocks={}\tbuild_s={:.1}\tbytes_per_block={per_block:.1}\tprompt_blocks={chain_len}\tlookup_p50_us={:.2}\tlookup_p99_us={:.2}",
        idx.len(),
        build.as_secs_f64(),
        pct(0.5),
        pct(0.99)
    );
    // The per-node local share for routing, estimated from 128 blocks of the prefix.
    let t = Instant::now();
    let mut total = 0u64;
    for l in 0..lookups {
        fill(&mut chain, (l * 104_729) % chains);
        total += idx
            .local_share(&chain, 128)
            .1
            .iter()
            .map(|v| *v as u64)
            .sum::<u64>();
    }
    println!(
        "local_share_us={:.1}\t(longest prefix + 128 sampled blocks; {} blocks attributed)",
        t.elapsed().as_secs_f64() * 1e6 / lookups as f64,
        total
    );
    Ok(())
}

pub(crate) async fn events_bench(
    blocks: usize,
    rate: usize,
    redis_url: &str,
) -> anyhow::Result<()> {
    use cache_fabric::events::{self, Follower};
    use cache_fabric::index::PrefixIndex;
    use cache_fabric::{EntryKind, EvictionPolicy, FabricNode, NodeConfig, PutBlock};
    use cachet_common::{BlockHash, Scope, TenantId, WorkspaceId};
    use std::sync::{Arc, RwLock};

    if blocks == 0 || rate == 0 {
        bail!("--blocks and --rate must be positive");
    }
    let client = redis::Client::open(redis_url)?;
    let publish_conn = client
        .get_multiplexed_async_connection()
        .await
        .with_context(|| format!("connecting to {redis_url}"))?;
    let mut follow_conn = client.get_multiplexed_async_connection().await?;
    let stream = format!("cachet:bench:events:{}", uuid::Uuid::new_v4().simple());
    let node = FabricNode::new(NodeConfig {
        dram_capacity_bytes: blocks as u64 * 64,
        eviction: EvictionPolicy::Lru,
    });
    let (sink, rx) = events::channel(65_536);
    node.set_event_sink(sink);
    let publisher = tokio::spawn(events::publish(
        publish_conn,
        stream.clone(),
        "bench-node".into(),
        rx,
        blocks * 2,
        None,
    ));
    let index = Arc::new(RwLock::new(PrefixIndex::with_capacity(blocks)));
    let mut follower = Follower::new(&stream, "0-0", index.clone());
    let scope = Scope {
        tenant: TenantId::new(),
        workspace: WorkspaceId::new(),
    };
    let staleness_before = cache_fabric::metrics::INDEX_STALENESS.get_sample_sum();
    let count_before = cache_fabric::metrics::INDEX_STALENESS.get_sample_count();
    let started = Instant::now();
    // The writer: chains of 8 blocks at the offered rate, in 10 ms steps.
    let writer_node = node.clone();
    let writer = tokio::spawn(async move {
        let now = tokio::time::Instant::now();
        let chains = blocks.div_ceil(8);
        let per_step = (rate / 100 / 8).max(1);
        let mut tick = tokio::time::interval(Duration::from_millis(10));
        let mut c = 0;
        while c < chains {
            tick.tick().await;
            for _ in 0..per_step {
                if c == chains {
                    break;
                }
                let mut parent = None;
                let mut new = Vec::with_capacity(8);
                for i in 0..8usize.min(blocks - c * 8) {
                    let mut h = [0u8; 32];
                    h[..8].copy_from_slice(&((c * 8 + i) as u64).to_le_bytes());
                    h[8] = 1;
                    let b = PutBlock::new(
                        BlockHash(h),
                        parent,
                        16,
                        bytes::Bytes::from_static(&[0; 64]),
                    );
                    parent = Some(b.hash);
                    new.push(b);
                }
                writer_node.with_store(|st| {
                    st.put_entry(
                        &scope,
                        &[],
                        new,
                        Duration::from_secs(3600),
                        now,
                        EntryKind::BestEffort,
                    )
                })?;
                c += 1;
            }
        }
        anyhow::Ok(())
    });
    let mut applied = 0usize;
    let mut idle_since = None;
    // Until everything is applied, or nothing more arrives for 2 s after the writer is done
    // (events dropped on a full channel never arrive; they are counted below).
    while applied < blocks {
        let got = follower
            .poll(&mut follow_conn, Duration::from_millis(100))
            .await?;
        applied += got;
        if got == 0 && writer.is_finished() {
            let since = *idle_since.get_or_insert_with(Instant::now);
            if since.elapsed() > Duration::from_secs(2) {
                break;
            }
        } else {
            idle_since = None;
        }
    }
    writer.await??;
    let secs = started.elapsed().as_secs_f64();
    let n = cache_fabric::metrics::INDEX_STALENESS.get_sample_count() - count_before;
    let mean = (cache_fabric::metrics::INDEX_STALENESS.get_sample_sum() - staleness_before)
        / n.max(1) as f64;
    let dropped = cache_fabric::metrics::EVENTS
        .with_label_values(&["dropped"])
        .get();
    println!(
        "offered_per_s={rate}\tevents={blocks}\tapplied={applied}\tdropped={dropped}\tindexed={}\tapplied_per_s={:.0}\tmean_staleness_ms={:.1}",
        index.read().map(|i| i.len()).unwrap_or(0),
        applied as f64 / secs,
        mean * 1e3
    );
    drop(node);
    let _ = tokio::time::timeout(Duration::from_secs(5), publisher).await;
    let _: () = redis::cmd("DEL")
        .arg(&stream)
        .query_async(&mut follow_conn)
        .await?;
    Ok(())
}
