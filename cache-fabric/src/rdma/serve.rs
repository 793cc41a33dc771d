//! The serving side of the one-sided READ data path: a node's answers to a peer's RDMA
//! control ops on its TCP connection (protocol in [`super::pull`]). `RGET` reads the blocks
//! from the node's store, stages them in the node's registered pool ([`super::Export`]) and
//! leases the extents to the peer until `RDONE` or the connection's end.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use cachet_common::BlockHash;

use super::Export;
use super::verbs::{Endpoint, QueuePair};
use crate::integrity::checksum;
use crate::metrics;
use crate::node::FabricNode;
use crate::wire::{OP_RDMA_CONNECT, OP_RDMA_DONE, OP_RDMA_GET, bad, get_hash, get_scope};

pub(crate) const OK: u8 = 0;
pub(crate) const UNSUPPORTED: u8 = 3;
pub(crate) const MODE_CHAIN: u8 = 0;
pub(crate) const MODE_BLOCK: u8 = 1;
/// One staged block in an `RGET` answer.
pub(crate) const STAGED_LEN: usize = 32 + 4 + 4 + 8 + 8;

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

    /// Answer one RDMA control op (`op` read off `f` already; `RDONE` has no answer); `Err`
    /// closes the connection.
    pub(crate) async fn handle(
        &mut self,
        op: u8,
        mut f: Bytes,
        node: &FabricNode,
    ) -> std::io::Result<BytesMut> {
        let mut out = BytesMut::new();
        match op {
            OP_RDMA_CONNECT => self.connect(&f, &mut out).await?,
            OP_RDMA_GET => self.stage(f, node, &mut out)?,
            OP_RDMA_DONE => {
                if f.remaining() != 8 {
                    return Err(bad("RDONE length"));
                }
                if let Some(extents) = self.leases.remove(&f.get_u64_le()) {
                    self.export.free(&extents);
                }
            }
            _ => return Err(bad("unknown RDMA op")),
        }
        Ok(out)
    }

    /// `RCONNECT`: a queue pair to the peer's endpoint in `f`, and the pool's address, length
    /// and key; or why there is none.
    async fn connect(&mut self, f: &[u8], out: &mut BytesMut) -> std::io::Result<()> {
        let remote = Endpoint::decode(f).ok_or_else(|| bad("RCONNECT endpoint"))?;
        // Verbs setup blocks: off the async workers.
        let device = self.export.device.clone();
        let connected = tokio::task::spawn_blocking(move || {
            let mut qp = QueuePair::new(&device)?;
            qp.connect(&remote)?;
            Ok::<_, std::io::Error>(qp)
        })
        .await
        .map_err(|e| std::io::Error::other(e.to_string()))?;
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
        Ok(())
    }

    /// `RGET`: the blocks asked for, staged in the exported pool under a new lease (as many
    /// as it holds), and where each lies.
    fn stage(
        &mut self,
        mut f: Bytes,
        node: &FabricNode,
        out: &mut BytesMut,
    ) -> std::io::Result<()> {
        if self.qp.is_none() {
            return Err(bad("RGET before RCONNECT"));
        }
        if f.remaining() < 37 {
            return Err(bad("short RGET"));
        }
        let scope = get_scope(&mut f);
        let mode = f.get_u8();
        let n = f.get_u32_le() as usize;
        if f.remaining() != n * 32 || !(mode == MODE_CHAIN || (mode == MODE_BLOCK && n == 1)) {
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
        Ok(())
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
