//! The one-sided READ data path (KVDirect-style pull) and the transport that uses it.
//!
//! Control stays on the node's authenticated TCP connection; bytes move by RDMA READ:
//!
//! ```text
//! request                                   response
//! RCONNECT 6 = endpoint:26                  ok endpoint:26 pool_addr:u64 pool_len:u64 rkey:u32
//!                                           | unsupported(3) reason_len:u16 reason
//! RGET     7 = scope:32 mode:u8 n:u32       ok lease:u64 count:u32
//!              hash:32 × n                     count × (hash:32 n_tokens:u32 crc:u32 len:u64 offset:u64)
//! RDONE    8 = lease:u64                    ok
//! ```
//!
//! A serving node with an [`Export`] answers `RGET` by reading the blocks from its store
//! (mode 0: the longest prefix of a chain; mode 1: one block by hash), checksums verified,
//! and staging them in its registered pool ([`PoolAllocator`]); the reader posts one READ
//! per run of adjacent blocks ([`coalesce`]), split at the port's message limit, into its
//! own registered region, verifies each block's crc32c, and releases the lease with `RDONE`.
//! Leases die with their connection: the queue pair is destroyed first, then the extents
//! go back to the pool. Staging is one copy on the serving node (the store's blocks are not
//! in registered memory); the pool bounds what is staged at once, and a chain that does not
//! fit is served up to where the pool ran out (the reader recomputes or re-reads the rest).
//!
//! [`RdmaTransport`] is a [`Transport`]: reads go over RDMA to peers that export a pool and
//! over TCP otherwise; writes (`PUT`) and `HAS` stay on TCP. Any RDMA failure falls back to
//! TCP for that call and keeps the peer on TCP for [`RdmaTransport::retry_after`]: a fault
//! costs bandwidth, never a read.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use cachet_common::{BlockHash, Scope};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

use super::verbs::{Device, Endpoint, QueuePair, ReadOp, Region};
use super::{PoolAllocator, Wanted, coalesce};
use crate::client::FabricNode;
use crate::metrics;
use crate::store::{FetchedBlock, WriteRefused, checksum};
use crate::transport::{
    OP_RDMA_CONNECT, OP_RDMA_DONE, OP_RDMA_GET, RemoteEntry, TcpTransport, Transport,
    TransportError,
};
use crate::wire::{get_hash, get_scope, put_scope};

const OK: u8 = 0;
const UNSUPPORTED: u8 = 3;
const MODE_CHAIN: u8 = 0;
const MODE_BLOCK: u8 = 1;
/// One staged block in an `RGET` answer.
const STAGED_LEN: usize = 32 + 4 + 4 + 8 + 8;

/// A node's registered pool that peers READ staged blocks from.
pub struct Export {
    device: Arc<Device>,
    pool: Region,
    alloc: Mutex<PoolAllocator>,
}

impl Export {
    /// Register a pool of `bytes` with `device`.
    pub fn new(device: Arc<Device>, bytes: usize) -> std::io::Result<Arc<Export>> {
        let pool = Region::new(&device, bytes)?;
        Ok(Arc::new(Export {
            alloc: Mutex::new(PoolAllocator::new(pool.len() as u64)),
            device,
            pool,
        }))
    }

    /// Bytes staged right now (leases not yet released).
    pub fn staged_bytes(&self) -> u64 {
        self.alloc.lock().unwrap_or_else(|p| p.into_inner()).used()
    }

    fn free(&self, extents: &[(u64, u64)]) {
        let mut a = self.alloc.lock().unwrap_or_else(|p| p.into_inner());
        for &(off, len) in extents {
            a.free(off, len);
        }
    }
}

/// One TCP connection's RDMA state on the serving side.
pub(crate) struct ServerConn {
    export: Arc<Export>,
    qp: Option<QueuePair>,
    leases: HashMap<u64, Vec<(u64, u64)>>,
    next_lease: u64,
}

impl ServerConn {
    pub(crate) fn new(export: Arc<Export>) -> Self {
        Self {
            export,
            qp: None,
            leases: HashMap::new(),
            next_lease: 1,
        }
    }

    /// Answer one RDMA control op (`op` read off `f` already); `Err` closes the connection.
    pub(crate) fn handle(
        &mut self,
        op: u8,
        mut f: Bytes,
        node: &FabricNode,
    ) -> std::io::Result<BytesMut> {
        let bad =
            |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string());
        let mut out = BytesMut::new();
        match op {
            OP_RDMA_CONNECT => {
                let remote = Endpoint::decode(&f).ok_or_else(|| bad("RCONNECT endpoint"))?;
                let connected = QueuePair::new(&self.export.device).and_then(|mut qp| {
                    qp.connect(&remote)?;
                    Ok(qp)
                });
                match connected {
                    Ok(qp) => {
                        out.put_u8(OK);
                        out.put_slice(&qp.endpoint().encode());
                        out.put_u64_le(self.export.pool.addr());
                        out.put_u64_le(self.export.pool.len() as u64);
                        out.put_u32_le(self.export.pool.rkey());
                        // A new queue pair replaces the old one, and with it its leases.
                        self.release_all();
                        self.qp = Some(qp);
                    }
                    Err(e) => {
                        let reason = format!("queue pair: {e}");
                        out.put_u8(UNSUPPORTED);
                        out.put_u16_le(reason.len() as u16);
                        out.put_slice(reason.as_bytes());
                    }
                }
            }
            OP_RDMA_GET => {
                if self.qp.is_none() {
                    return Err(bad("RGET before RCONNECT"));
                }
                if f.remaining() < 37 {
                    return Err(bad("short RGET"));
                }
                let scope = get_scope(&mut f);
                let mode = f.get_u8();
                let n = f.get_u32_le() as usize;
                if f.remaining() != n * 32
                    || !(mode == MODE_CHAIN || (mode == MODE_BLOCK && n == 1))
                {
                    return Err(bad("RGET body"));
                }
                let hashes: Vec<BlockHash> = (0..n).map(|_| get_hash(&mut f)).collect();
                let now = tokio::time::Instant::now();
                let blocks = node.with_store(|st| match mode {
                    MODE_CHAIN => st.get_chain(&scope, &hashes, now),
                    _ => st.get_block(&scope, &hashes[0], now).into_iter().collect(),
                });
                let mut staged = Vec::with_capacity(blocks.len());
                let mut extents = Vec::with_capacity(blocks.len());
                {
                    let mut alloc = self.export.alloc.lock().unwrap_or_else(|p| p.into_inner());
                    for b in &blocks {
                        let len = b.data.len() as u64;
                        // An empty block needs no room; anything else stops where the pool is full.
                        let off = if len == 0 {
                            0
                        } else {
                            match alloc.alloc(len) {
                                Some(off) => off,
                                None => break,
                            }
                        };
                        if len > 0 {
                            extents.push((off, len));
                        }
                        staged.push((b, off));
                    }
                }
                for (b, off) in &staged {
                    // SAFETY: the extent was just allocated to this lease; no peer knows
                    // it before the answer below.
                    unsafe { self.export.pool.write(*off as usize, &b.data) };
                }
                let lease = self.next_lease;
                self.next_lease += 1;
                self.leases.insert(lease, extents);
                out.reserve(13 + staged.len() * STAGED_LEN);
                out.put_u8(OK);
                out.put_u64_le(lease);
                out.put_u32_le(staged.len() as u32);
                for (b, off) in &staged {
                    out.put_slice(&b.hash.0);
                    out.put_u32_le(b.n_tokens);
                    out.put_u32_le(checksum(&b.data));
                    out.put_u64_le(b.data.len() as u64);
                    out.put_u64_le(*off);
                }
                if staged.len() < blocks.len() {
                    metrics::RDMA.with_label_values(&["pool_full"]).inc();
                }
            }
            OP_RDMA_DONE => {
                if f.remaining() != 8 {
                    return Err(bad("RDONE length"));
                }
                if let Some(extents) = self.leases.remove(&f.get_u64_le()) {
                    self.export.free(&extents);
                }
                out.put_u8(OK);
            }
            _ => return Err(bad("unknown RDMA op")),
        }
        Ok(out)
    }

    fn release_all(&mut self) {
        // The queue pair goes first: once it is destroyed no READ can reach the extents.
        self.qp = None;
        for (_, extents) in self.leases.drain() {
            self.export.free(&extents);
        }
    }
}

impl Drop for ServerConn {
    fn drop(&mut self) {
        self.release_all();
    }
}

/// A reader's RDMA connection to one peer: the control stream, a connected queue pair and
/// a registered region READs land in.
struct PeerConn {
    stream: TcpStream,
    qp: QueuePair,
    region: Region,
    pool_addr: u64,
    pool_len: u64,
    rkey: u32,
}

/// Why an RDMA pull did not deliver.
enum PullError {
    /// The bytes arrived and failed their checksum: reported, not retried over TCP.
    Corrupt(TransportError),
    /// A block larger than the receive region: this call goes over TCP, the peer stays on
    /// RDMA.
    TooLarge,
    /// Anything else: the call goes over TCP, and the peer stays on TCP for a while.
    Fallback(String),
}

impl From<TransportError> for PullError {
    fn from(e: TransportError) -> Self {
        PullError::Fallback(e.to_string())
    }
}

impl From<std::io::Error> for PullError {
    fn from(e: std::io::Error) -> Self {
        PullError::Fallback(e.to_string())
    }
}

/// Reads over RDMA where the peer exports a pool, TCP for everything else.
pub struct RdmaTransport {
    tcp: TcpTransport,
    device: OnceLock<Arc<Device>>,
    idle: Mutex<HashMap<String, Vec<PeerConn>>>,
    /// Peers whose RDMA path failed, and when to try it again.
    off: Mutex<HashMap<String, std::time::Instant>>,
    read_bytes: AtomicU64,
    fallbacks: AtomicU64,
    /// Registered (pinned) receive buffer per connection; a block larger than this goes
    /// over TCP. A reader pins up to `(pool_per_node + in-flight reads) × region_bytes` per
    /// peer.
    pub region_bytes: usize,
    /// How long a batch of READs may take before the peer is treated as failed.
    pub read_timeout: Duration,
    /// How long a peer stays on TCP after an RDMA failure.
    pub retry_after: Duration,
    /// Idle RDMA connections kept per peer.
    pub pool_per_node: usize,
}

impl RdmaTransport {
    /// A transport that moves everything over TCP until [`RdmaTransport::enable`].
    pub fn new(token: impl Into<Arc<str>>) -> Self {
        Self {
            tcp: TcpTransport::new(token),
            device: OnceLock::new(),
            idle: Mutex::new(HashMap::new()),
            off: Mutex::new(HashMap::new()),
            read_bytes: AtomicU64::new(0),
            fallbacks: AtomicU64::new(0),
            region_bytes: 32 << 20,
            read_timeout: Duration::from_secs(5),
            retry_after: Duration::from_secs(30),
            pool_per_node: 2,
        }
    }

    /// Pull blocks over RDMA with `device` from now on (once; later calls are ignored).
    pub fn enable(&self, device: Arc<Device>) {
        let _ = self.device.set(device);
    }

    /// The TCP transport under it (tuning, and the path for everything but reads).
    pub fn tcp_mut(&mut self) -> &mut TcpTransport {
        &mut self.tcp
    }

    /// Block bytes that arrived by RDMA READ so far.
    pub fn rdma_bytes(&self) -> u64 {
        self.read_bytes.load(Ordering::Relaxed)
    }

    /// Reads that fell back to TCP so far.
    pub fn fallbacks(&self) -> u64 {
        self.fallbacks.load(Ordering::Relaxed)
    }

    fn device_for(&self, addr: &str) -> Option<Arc<Device>> {
        let dev = self.device.get()?;
        let mut off = self.off.lock().unwrap_or_else(|p| p.into_inner());
        match off.get(addr) {
            Some(until) if *until > std::time::Instant::now() => None,
            Some(_) => {
                off.remove(addr);
                Some(dev.clone())
            }
            None => Some(dev.clone()),
        }
    }

    fn fall_back(&self, addr: &str, why: &str) {
        self.fallbacks.fetch_add(1, Ordering::Relaxed);
        metrics::RDMA.with_label_values(&["fallback"]).inc();
        tracing::warn!(
            peer = addr,
            reason = why,
            "RDMA read failed; using TCP for this peer for a while"
        );
        self.off.lock().unwrap_or_else(|p| p.into_inner()).insert(
            addr.to_string(),
            std::time::Instant::now() + self.retry_after,
        );
        self.idle
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(addr);
    }

    async fn peer(&self, addr: &str, device: &Arc<Device>) -> Result<PeerConn, PullError> {
        let pooled = self
            .idle
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(addr)
            .and_then(|v| v.pop());
        if let Some(c) = pooled {
            return Ok(c);
        }
        let mut stream = self.tcp.connect(addr).await?;
        let mut qp = QueuePair::new(device)?;
        let region = Region::new(device, self.region_bytes)?;
        let mut req = BytesMut::with_capacity(1 + Endpoint::LEN);
        req.put_u8(OP_RDMA_CONNECT);
        req.put_slice(&qp.endpoint().encode());
        TcpTransport::send(&mut stream, addr, &req).await?;
        match stream.read_u8().await? {
            OK => {}
            UNSUPPORTED => {
                let n = stream.read_u16_le().await? as usize;
                let mut reason = vec![0u8; n];
                stream.read_exact(&mut reason).await?;
                return Err(PullError::Fallback(format!(
                    "the peer cannot serve RDMA: {}",
                    String::from_utf8_lossy(&reason)
                )));
            }
            s => return Err(PullError::Fallback(format!("RCONNECT status {s}"))),
        }
        let mut head = [0u8; Endpoint::LEN + 20];
        stream.read_exact(&mut head).await?;
        let remote = Endpoint::decode(&head[..Endpoint::LEN])
            .ok_or_else(|| PullError::Fallback("RCONNECT answer".into()))?;
        let mut rest = &head[Endpoint::LEN..];
        let (pool_addr, pool_len, rkey) = (rest.get_u64_le(), rest.get_u64_le(), rest.get_u32_le());
        qp.connect(&remote)?;
        Ok(PeerConn {
            stream,
            qp,
            region,
            pool_addr,
            pool_len,
            rkey,
        })
    }

    fn give_back(&self, addr: &str, conn: PeerConn) {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let v = idle.entry(addr.to_string()).or_default();
        if v.len() < self.pool_per_node {
            v.push(conn);
        }
    }

    /// `RGET` then READ everything staged, verify, release.
    async fn pull(
        &self,
        addr: &str,
        device: &Arc<Device>,
        scope: Scope,
        mode: u8,
        hashes: &[BlockHash],
    ) -> Result<Vec<FetchedBlock>, PullError> {
        let mut conn = self.peer(addr, device).await?;
        let mut req = BytesMut::with_capacity(38 + hashes.len() * 32);
        req.put_u8(OP_RDMA_GET);
        put_scope(&mut req, &scope);
        req.put_u8(mode);
        req.put_u32_le(hashes.len() as u32);
        for h in hashes {
            req.put_slice(&h.0);
        }
        TcpTransport::send(&mut conn.stream, addr, &req).await?;
        if conn.stream.read_u8().await? != OK {
            return Err(PullError::Fallback("RGET status".into()));
        }
        let lease = conn.stream.read_u64_le().await?;
        let count = conn.stream.read_u32_le().await? as usize;
        if count > hashes.len() {
            return Err(PullError::Fallback(
                "RGET answered more blocks than asked".into(),
            ));
        }
        let mut body = vec![0u8; count * STAGED_LEN];
        conn.stream.read_exact(&mut body).await?;
        let mut b = Bytes::from(body);
        let mut staged = Vec::with_capacity(count);
        for _ in 0..count {
            let hash = get_hash(&mut b);
            let (n_tokens, crc, len, offset) = (
                b.get_u32_le(),
                b.get_u32_le(),
                b.get_u64_le(),
                b.get_u64_le(),
            );
            if offset
                .checked_add(len)
                .is_none_or(|end| end > conn.pool_len)
            {
                return Err(PullError::Fallback(
                    "a staged block lies outside the pool".into(),
                ));
            }
            staged.push((hash, n_tokens, crc, len, offset));
        }
        let max_read = device.max_message().clamp(4096, 8 << 20) as u64;
        let mut out = Vec::with_capacity(count);
        let mut i = 0;
        let mut result = Ok(());
        while i < staged.len() && result.is_ok() {
            // As many blocks as the region holds at once.
            let (mut j, mut total) = (i, 0u64);
            while j < staged.len() && total + staged[j].3 <= conn.region.len() as u64 {
                total += staged[j].3;
                j += 1;
            }
            if j == i {
                result = Err(PullError::TooLarge);
                break;
            }
            let wanted: Vec<Wanted> = staged[i..j]
                .iter()
                .filter(|s| s.3 > 0)
                .map(|s| Wanted {
                    hash: s.0,
                    offset: s.4,
                    len: s.3,
                })
                .collect();
            // Each coalesced run lands contiguously in the region, split at the port's limit.
            let mut ops = Vec::new();
            let mut local_of: HashMap<BlockHash, u64> = HashMap::new();
            let mut cursor = 0u64;
            for r in coalesce(&wanted, max_read) {
                for (h, part_off, _) in &r.parts {
                    local_of.insert(*h, cursor + part_off);
                }
                let mut done = 0u64;
                while done < r.len {
                    let len = (r.len - done).min(max_read);
                    ops.push(ReadOp {
                        local_offset: cursor + done,
                        remote_addr: conn.pool_addr + r.offset + done,
                        len: len as u32,
                    });
                    done += len;
                }
                cursor += r.len;
            }
            let timeout = self.read_timeout;
            let (c, read) = tokio::task::spawn_blocking(move || {
                let r = conn.qp.read(&conn.region, &ops, conn.rkey, timeout);
                (conn, r)
            })
            .await
            .map_err(|e| PullError::Fallback(format!("the READ thread failed: {e}")))?;
            conn = c;
            read?;
            for &(hash, n_tokens, crc, len, _) in &staged[i..j] {
                let data = match local_of.get(&hash) {
                    // SAFETY: the READs into this range completed; nothing writes it until
                    // the next batch, after this copy.
                    Some(&at) => Bytes::copy_from_slice(unsafe {
                        conn.region.slice(at as usize, len as usize)
                    }),
                    None => Bytes::new(),
                };
                if checksum(&data) != crc {
                    result = Err(PullError::Corrupt(TransportError::Corrupt {
                        addr: addr.to_string(),
                        hash,
                    }));
                    break;
                }
                self.read_bytes.fetch_add(len, Ordering::Relaxed);
                metrics::RDMA_BYTES.inc_by(len);
                out.push(FetchedBlock {
                    hash,
                    n_tokens,
                    data,
                });
            }
            i = j;
        }
        let mut done = BytesMut::with_capacity(9);
        done.put_u8(OP_RDMA_DONE);
        done.put_u64_le(lease);
        TcpTransport::send(&mut conn.stream, addr, &done).await?;
        if conn.stream.read_u8().await? != OK {
            return Err(PullError::Fallback("RDONE status".into()));
        }
        if let Err(e) = result {
            if matches!(e, PullError::TooLarge) {
                self.give_back(addr, conn);
            }
            return Err(e);
        }
        metrics::RDMA.with_label_values(&["read"]).inc();
        self.give_back(addr, conn);
        Ok(out)
    }

    /// RDMA where possible, else (or after an RDMA failure) TCP.
    async fn read_via(
        &self,
        addr: &str,
        scope: Scope,
        mode: u8,
        hashes: &[BlockHash],
    ) -> Option<Result<Vec<FetchedBlock>, TransportError>> {
        let device = self.device_for(addr)?;
        match self.pull(addr, &device, scope, mode, hashes).await {
            Ok(blocks) => Some(Ok(blocks)),
            Err(PullError::Corrupt(e)) => Some(Err(e)),
            Err(PullError::TooLarge) => {
                metrics::RDMA.with_label_values(&["too_large"]).inc();
                None
            }
            Err(PullError::Fallback(why)) => {
                self.fall_back(addr, &why);
                None
            }
        }
    }
}

impl Transport for RdmaTransport {
    async fn get_chain(
        &self,
        addr: &str,
        scope: Scope,
        chain: &[BlockHash],
    ) -> Result<Vec<FetchedBlock>, TransportError> {
        match self.read_via(addr, scope, MODE_CHAIN, chain).await {
            Some(r) => r,
            None => self.tcp.get_chain(addr, scope, chain).await,
        }
    }

    async fn get_block(
        &self,
        addr: &str,
        scope: Scope,
        hash: BlockHash,
    ) -> Result<Option<FetchedBlock>, TransportError> {
        match self.read_via(addr, scope, MODE_BLOCK, &[hash]).await {
            Some(r) => r.map(|v| v.into_iter().next()),
            None => self.tcp.get_block(addr, scope, hash).await,
        }
    }

    async fn has(
        &self,
        addr: &str,
        scope: Scope,
        hashes: &[BlockHash],
    ) -> Result<Vec<bool>, TransportError> {
        self.tcp.has(addr, scope, hashes).await
    }

    async fn put_entry(
        &self,
        addr: &str,
        entry: &RemoteEntry,
    ) -> Result<Result<(), WriteRefused>, TransportError> {
        self.tcp.put_entry(addr, entry).await
    }
}
