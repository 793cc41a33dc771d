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
//! RDONE    8 = lease:u64                    (no answer: the connection's next request follows it)
//! ```
//!
//! A serving node with an [`Export`](super::Export) answers ([`super::serve`]) `RGET` by reading the blocks from its store
//! (mode 0: the longest prefix of a chain; mode 1: one block by hash), checksums verified,
//! and staging them in its registered pool ([`ExtentAllocator`](crate::extents::ExtentAllocator)); the reader posts one READ
//! per run of adjacent blocks ([`coalesce`]), split at the port's message limit, into its
//! own registered region, verifies each block's crc32c, and releases the lease with `RDONE`.
//! Leases die with their connection: the queue pair is destroyed first, then the extents
//! go back to the pool. Staging is one copy on the serving node (the store's blocks are not
//! in registered memory); the pool bounds what is staged at once, and a chain that does not
//! fit is served up to where the pool ran out (the reader recomputes or re-reads the rest).
//!
//! [`RdmaTransport`] is a [`Transport`]: reads go over RDMA to peers that export a pool and
//! over TCP otherwise; writes (`PUT`) and `HAS` stay on TCP. Connections are opened in the
//! background ([`RdmaTransport::warm`]), never on a read's critical path: a read with no idle
//! connection goes over TCP. Any RDMA failure falls back to TCP for that call and keeps the
//! peer on TCP for 30 s: a fault costs bandwidth, never a read.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use cachet_common::{BlockHash, Scope};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

use super::serve::{MODE_BLOCK, MODE_CHAIN, OK, STAGED_LEN, UNSUPPORTED};
use super::verbs::{Device, Endpoint, QueuePair, ReadOp, Region};
use super::{Wanted, coalesce};
use crate::integrity::checksum;
use crate::metrics;
use crate::store::{FetchedBlock, WriteRefused};
use crate::transport::{RemoteEntry, TcpTransport, Transport, TransportError};
use crate::wire::{OP_RDMA_CONNECT, OP_RDMA_DONE, OP_RDMA_GET};
use crate::wire::{get_hash, put_scope};

/// A connection's first receive region; it doubles (re-registered) when a block needs more.
const FIRST_REGION: usize = 4 << 20;

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
///
/// RDMA connections are set up off the read path: [`RdmaTransport::warm`] (called by the
/// cluster for every peer in a new view) opens them in the background, and a read with no
/// idle connection to its peer goes over TCP meanwhile and asks for one more.
pub struct RdmaTransport {
    inner: Arc<Inner>,
}

struct Inner {
    tcp: TcpTransport,
    device: OnceLock<Arc<Device>>,
    peers: Mutex<HashMap<String, PeerState>>,
    read_bytes: AtomicU64,
    fallbacks: AtomicU64,
    /// The most a connection's registered (pinned) receive region grows to; a block larger
    /// than this goes over TCP. Regions start at [`FIRST_REGION`] and double as needed.
    region_bytes: usize,
    /// How long a batch of READs may take before the peer is treated as failed.
    read_timeout: Duration,
    /// How long a peer stays on TCP after an RDMA failure.
    retry_after: Duration,
    /// RDMA connections per peer at most (each pins `region_bytes`).
    conns_per_peer: usize,
}

#[derive(Default)]
struct PeerState {
    idle: Vec<PeerConn>,
    /// Connections open or being opened (idle ones included).
    open: usize,
    /// One is being opened in the background: no other starts meanwhile.
    warming: bool,
    /// After a failure: TCP until then.
    off_until: Option<std::time::Instant>,
}

impl RdmaTransport {
    /// A transport that moves everything over TCP until [`RdmaTransport::enable`].
    pub fn new(token: impl Into<Arc<str>>) -> Self {
        Self {
            inner: Arc::new(Inner {
                tcp: TcpTransport::new(token),
                device: OnceLock::new(),
                peers: Mutex::new(HashMap::new()),
                read_bytes: AtomicU64::new(0),
                fallbacks: AtomicU64::new(0),
                region_bytes: 64 << 20,
                read_timeout: Duration::from_secs(5),
                retry_after: Duration::from_secs(30),
                conns_per_peer: 4,
            }),
        }
    }

    fn inner_mut(&mut self) -> &mut Inner {
        Arc::get_mut(&mut self.inner).expect("configured before first use")
    }

    /// The most a connection's receive region grows to (before first use); larger blocks
    /// go over TCP.
    pub fn set_region_bytes(&mut self, bytes: usize) {
        self.inner_mut().region_bytes = bytes;
    }

    /// The TCP transport under it (tuning before first use; the path for everything but
    /// reads).
    pub fn tcp_mut(&mut self) -> &mut TcpTransport {
        &mut self.inner_mut().tcp
    }

    /// Pull blocks over RDMA with `device` from now on (once; later calls are ignored).
    pub fn enable(&self, device: Arc<Device>) {
        let _ = self.inner.device.set(device);
    }

    /// Block bytes that arrived by RDMA READ so far.
    pub fn rdma_bytes(&self) -> u64 {
        self.inner.read_bytes.load(Ordering::Relaxed)
    }

    /// RDMA failures that sent a peer to TCP so far.
    pub fn fallbacks(&self) -> u64 {
        self.inner.fallbacks.load(Ordering::Relaxed)
    }

    /// Open an RDMA connection to `addr` in the background, unless it has its share or is
    /// on TCP after a failure. Needs a Tokio runtime (does nothing without one).
    pub fn warm(&self, addr: &str) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let Some(device) = self.inner.reserve(addr, true) else {
            return;
        };
        let (inner, addr) = (self.inner.clone(), addr.to_string());
        rt.spawn(async move {
            inner.open(&addr, &device).await;
            inner.warmed(&addr);
        });
    }

    /// Close the connections (and forget the state) of every peer not in `addrs`: a peer
    /// that left the cluster keeps no pinned region here.
    pub fn retain_peers(&self, addrs: &[&str]) {
        let mut peers = self.inner.peers.lock().unwrap_or_else(|p| p.into_inner());
        peers.retain(|addr, _| addrs.contains(&addr.as_str()));
    }

    /// Peers with RDMA state (connections open, being opened, or a recent failure).
    pub fn peers(&self) -> usize {
        self.inner
            .peers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .len()
    }

    /// Open an RDMA connection to `addr` now; why not, if it could not.
    pub async fn connect_now(&self, addr: &str) -> Result<(), String> {
        let device = self
            .inner
            .reserve(addr, false)
            .ok_or_else(|| format!("no RDMA to {addr} now (no device, on TCP, or at its share)"))?;
        if self.inner.open(addr, &device).await {
            Ok(())
        } else {
            Err(format!("RDMA connection to {addr} failed"))
        }
    }

    /// RDMA if an idle connection to the peer is ready, else `None` (TCP, and one more
    /// connection is warmed).
    async fn read_via(
        &self,
        addr: &str,
        scope: Scope,
        mode: u8,
        hashes: &[BlockHash],
    ) -> Option<Result<Vec<FetchedBlock>, TransportError>> {
        let device = self.inner.device.get()?.clone();
        let Some(conn) = self.inner.take_idle(addr) else {
            self.warm(addr);
            return None;
        };
        match self
            .inner
            .pull(conn, addr, &device, scope, mode, hashes)
            .await
        {
            Ok((blocks, conn)) => {
                self.inner.give_back(addr, conn);
                Some(Ok(blocks))
            }
            Err((PullError::TooLarge, Some(conn))) => {
                metrics::RDMA.with_label_values(&["too_large"]).inc();
                self.inner.give_back(addr, conn);
                None
            }
            Err((PullError::Corrupt(e), conn)) => {
                match conn {
                    Some(c) => self.inner.give_back(addr, c),
                    None => self.inner.closed(addr),
                }
                Some(Err(e))
            }
            Err((e, _)) => {
                self.inner.closed(addr);
                let why = match e {
                    PullError::Fallback(why) => why,
                    _ => "connection lost".into(),
                };
                self.inner.fall_back(addr, &why);
                None
            }
        }
    }
}

impl Inner {
    /// Count one more connection to `addr` about to be opened, if it may be (`warm`: in the
    /// background, one at a time per peer, so a burst of reads does not set up many).
    fn reserve(&self, addr: &str, warm: bool) -> Option<Arc<Device>> {
        let device = self.device.get()?.clone();
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        let p = peers.entry(addr.to_string()).or_default();
        if p.off_until.is_some_and(|t| t > std::time::Instant::now())
            || p.open >= self.conns_per_peer
            || (warm && p.warming)
        {
            return None;
        }
        p.off_until = None;
        p.open += 1;
        p.warming |= warm;
        Some(device)
    }

    /// The background opening of a connection to `addr` is over.
    fn warmed(&self, addr: &str) {
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = peers.get_mut(addr) {
            p.warming = false;
        }
    }

    /// Open a reserved connection and make it idle; whether that worked.
    async fn open(&self, addr: &str, device: &Arc<Device>) -> bool {
        match self.connect(addr, device).await {
            Ok(conn) => {
                self.give_back(addr, conn);
                true
            }
            Err(why) => {
                self.closed(addr);
                let why = match why {
                    PullError::Fallback(w) => w,
                    _ => "connection failed".into(),
                };
                self.fall_back(addr, &why);
                false
            }
        }
    }

    fn take_idle(&self, addr: &str) -> Option<PeerConn> {
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        let p = peers.get_mut(addr)?;
        if p.off_until.is_some_and(|t| t > std::time::Instant::now()) {
            return None;
        }
        p.idle.pop()
    }

    fn give_back(&self, addr: &str, conn: PeerConn) {
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        peers.entry(addr.to_string()).or_default().idle.push(conn);
    }

    /// A connection to `addr` is gone.
    fn closed(&self, addr: &str) {
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = peers.get_mut(addr) {
            p.open = p.open.saturating_sub(1);
        }
    }

    /// Keep `addr` on TCP for a while; its idle connections are closed.
    fn fall_back(&self, addr: &str, why: &str) {
        self.fallbacks.fetch_add(1, Ordering::Relaxed);
        metrics::RDMA.with_label_values(&["fallback"]).inc();
        tracing::warn!(
            peer = addr,
            reason = why,
            "RDMA to this peer failed; using TCP for a while"
        );
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        let p = peers.entry(addr.to_string()).or_default();
        p.off_until = Some(std::time::Instant::now() + self.retry_after);
        p.open = p.open.saturating_sub(p.idle.len());
        p.idle.clear();
    }

    async fn connect(&self, addr: &str, device: &Arc<Device>) -> Result<PeerConn, PullError> {
        let mut stream = self.tcp.connect(addr).await?;
        // Verbs setup blocks (registration pins pages): off the async workers.
        let (dev, first) = (device.clone(), FIRST_REGION.min(self.region_bytes));
        let (mut qp, region) = tokio::task::spawn_blocking(move || {
            Ok::<_, std::io::Error>((QueuePair::new(&dev)?, Region::new(&dev, first)?))
        })
        .await
        .map_err(|e| PullError::Fallback(format!("the setup thread failed: {e}")))??;
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

    /// `RGET`: the blocks of `hashes` the peer staged in its pool, and the lease that holds
    /// them there until `RDMA_DONE`.
    async fn ask_staged(
        conn: &mut PeerConn,
        addr: &str,
        scope: Scope,
        mode: u8,
        hashes: &[BlockHash],
    ) -> Result<(u64, Vec<Staged>), PullError> {
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
        Ok((lease, staged))
    }

    /// `RGET` then READ everything staged, verify, release. The connection comes back
    /// unless it broke.
    #[allow(clippy::type_complexity)]
    async fn pull(
        &self,
        mut conn: PeerConn,
        addr: &str,
        device: &Arc<Device>,
        scope: Scope,
        mode: u8,
        hashes: &[BlockHash],
    ) -> Result<(Vec<FetchedBlock>, PeerConn), (PullError, Option<PeerConn>)> {
        let lost = |e: PullError| (e, None);
        let (lease, staged) = Self::ask_staged(&mut conn, addr, scope, mode, hashes)
            .await
            .map_err(lost)?;
        let max_read = device.max_message().clamp(4096, 8 << 20) as u64;
        let mut out = Vec::with_capacity(staged.len());
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
                // One block larger than the region: grow it, up to the limit.
                let need = staged[i].3 as usize;
                if need > self.region_bytes {
                    result = Err(PullError::TooLarge);
                    break;
                }
                let (dev, size) = (
                    device.clone(),
                    need.next_power_of_two().min(self.region_bytes),
                );
                let region = tokio::task::spawn_blocking(move || Region::new(&dev, size))
                    .await
                    .map_err(|e| {
                        lost(PullError::Fallback(format!("the setup thread failed: {e}")))
                    })?
                    .map_err(|e| lost(e.into()))?;
                conn.region = region;
                continue;
            }
            let (ops, local_of) = read_plan(&staged[i..j], conn.pool_addr, max_read);
            let timeout = self.read_timeout;
            let (c, read) = tokio::task::spawn_blocking(move || {
                let r = conn.qp.read(&conn.region, &ops, conn.rkey, timeout);
                (conn, r)
            })
            .await
            .map_err(|e| lost(PullError::Fallback(format!("the READ thread failed: {e}"))))?;
            conn = c;
            read.map_err(|e| lost(e.into()))?;
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
        TcpTransport::send(&mut conn.stream, addr, &done)
            .await
            .map_err(|e| lost(e.into()))?;
        match result {
            Ok(()) => {
                metrics::RDMA.with_label_values(&["read"]).inc();
                Ok((out, conn))
            }
            Err(e) => Err((e, Some(conn))),
        }
    }
}

/// A staged block: its hash, tokens, crc32c, length and offset in the peer's pool.
type Staged = (BlockHash, u32, u32, u64, u64);

/// The READs that bring the non-empty blocks of `staged` (in a pool at `pool_addr`) into a
/// region: each coalesced run lands contiguously, split at the port's limit `max_read`; and
/// where each block lands.
fn read_plan(
    staged: &[Staged],
    pool_addr: u64,
    max_read: u64,
) -> (Vec<ReadOp>, HashMap<BlockHash, u64>) {
    let wanted: Vec<Wanted> = staged
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
                remote_addr: pool_addr + r.offset + done,
                len: len as u32,
            });
            done += len;
        }
        cursor += r.len;
    }
    (ops, local_of)
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
            None => self.inner.tcp.get_chain(addr, scope, chain).await,
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
            None => self.inner.tcp.get_block(addr, scope, hash).await,
        }
    }

    async fn has(
        &self,
        addr: &str,
        scope: Scope,
        hashes: &[BlockHash],
    ) -> Result<Vec<bool>, TransportError> {
        self.inner.tcp.has(addr, scope, hashes).await
    }

    async fn put_entry(
        &self,
        addr: &str,
        entry: &RemoteEntry,
    ) -> Result<Result<(), WriteRefused>, TransportError> {
        self.inner.tcp.put_entry(addr, entry).await
    }
}
