//! The verbs the fabric's RDMA path needs, over `ibverbs-sys` (the `ibverbs` crate's safe
//! API posts only SENDs and hides its queue pairs' and memory regions' raw handles):
//!
//! - [`Device`]: an opened device with its protection domain, port 1's addressing (LID, and
//!   a GID for RoCE: the first IPv4-mapped one, else the first non-zero one) and limits.
//! - [`Region`]: a buffer registered for local writes and remote READs.
//! - [`QueuePair`]: a reliable-connected queue pair with its own completion queue, connected
//!   to a peer's [`Endpoint`] (exchanged over the TCP control connection), that posts
//!   one-sided `IBV_WR_RDMA_READ`s and polls their completions (a short spin, then sleeps).
//!
//! Every handle is freed in `Drop`, children before parents (a region or queue pair holds an
//! `Arc` of its device). libibverbs is thread-safe; each queue pair is used by one thread at
//! a time (`&mut self`).

use std::ffi::CStr;
use std::io;
use std::ptr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ibverbs_sys as ffi;

/// The port every queue pair uses.
const PORT: u8 = 1;
/// Work requests in flight per queue pair (and completion-queue depth).
const DEPTH: u32 = 128;
/// Empty polls of the completion queue before waiting starts to sleep (8 µs, doubling to
/// about 1 ms).
const SPIN_POLLS: u32 = 2048;

fn other(what: impl Into<String>) -> io::Error {
    io::Error::other(what.into())
}

/// An opened RDMA device: its context, one protection domain, and port 1's addressing.
pub struct Device {
    ctx: *mut ffi::ibv_context,
    pd: *mut ffi::ibv_pd,
    name: String,
    lid: u16,
    gid: [u8; 16],
    gid_index: u8,
    mtu: ffi::ibv_mtu,
    max_msg: u32,
    /// READs a queue pair may have outstanding (as initiator) and accept (as target).
    rd_atomic: u8,
}

// SAFETY: libibverbs objects may be used from any thread; the device's handles are only
// read after construction.
unsafe impl Send for Device {}
unsafe impl Sync for Device {}

impl Device {
    /// Open `name` (or the first device if `None`), check that port 1 is active, and
    /// allocate a protection domain.
    pub fn open(name: Option<&str>) -> io::Result<Arc<Device>> {
        let mut n = 0i32;
        // SAFETY: plain FFI; the list is freed below, after the device is opened.
        let list = unsafe { ffi::ibv_get_device_list(&mut n) };
        if list.is_null() {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the list holds `n` device pointers.
        let devices = unsafe { std::slice::from_raw_parts(list, n.max(0) as usize) };
        let mut chosen = None;
        let mut names = Vec::new();
        for &d in devices {
            // SAFETY: a listed device has a NUL-terminated name.
            let dn = unsafe { CStr::from_ptr(ffi::ibv_get_device_name(d)) }
                .to_string_lossy()
                .into_owned();
            if chosen.is_none() && name.is_none_or(|want| want == dn) {
                chosen = Some((d, dn.clone()));
            }
            names.push(dn);
        }
        let opened = chosen.map(|(d, dn)| {
            // SAFETY: `d` comes from the live list.
            (unsafe { ffi::ibv_open_device(d) }, dn)
        });
        // SAFETY: the list came from ibv_get_device_list; an opened context outlives it.
        unsafe { ffi::ibv_free_device_list(list) };
        let Some((ctx, dn)) = opened else {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("no RDMA device {name:?} (devices: {names:?})"),
            ));
        };
        if ctx.is_null() {
            return Err(io::Error::last_os_error());
        }
        let mut dev = Device {
            ctx,
            pd: ptr::null_mut(),
            name: dn,
            lid: 0,
            gid: [0; 16],
            gid_index: 0,
            mtu: ffi::IBV_MTU_1024,
            max_msg: 1 << 30,
            rd_atomic: 1,
        };
        // SAFETY: zeroed attribute structs are valid out-parameters.
        let mut port: ffi::ibv_port_attr = unsafe { std::mem::zeroed() };
        let rc = unsafe { ffi::ibv_query_port(ctx, PORT, &mut port as *mut _ as *mut _) };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        if port.state != ffi::ibv_port_state::IBV_PORT_ACTIVE {
            return Err(other(format!(
                "port {PORT} of RDMA device {} is not active (state {})",
                dev.name, port.state
            )));
        }
        dev.lid = port.lid;
        dev.mtu = port.active_mtu;
        dev.max_msg = port.max_msg_sz;
        let mut fallback = None;
        for i in 0..port.gid_tbl_len.max(0) {
            // SAFETY: `gid` is a valid out-parameter; an index past the table fails cleanly.
            let mut gid: ffi::ibv_gid = unsafe { std::mem::zeroed() };
            if unsafe { ffi::ibv_query_gid(ctx, PORT, i, &mut gid) } != 0 {
                continue;
            }
            // SAFETY: every bit pattern of the union is a valid byte array.
            let raw = unsafe { gid.raw };
            if raw == [0; 16] {
                continue;
            }
            if raw[..10] == [0; 10] && raw[10..12] == [0xff, 0xff] {
                fallback = Some((i, raw));
                break;
            }
            fallback.get_or_insert((i, raw));
        }
        if let Some((i, raw)) = fallback {
            dev.gid_index = i as u8;
            dev.gid = raw;
        }
        let mut attr: ffi::ibv_device_attr = unsafe { std::mem::zeroed() };
        let rc = unsafe { ffi::ibv_query_device(ctx, &mut attr) };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        dev.rd_atomic = attr
            .max_qp_rd_atom
            .min(attr.max_qp_init_rd_atom)
            .clamp(1, 16) as u8;
        // SAFETY: `ctx` is open.
        dev.pd = unsafe { ffi::ibv_alloc_pd(ctx) };
        if dev.pd.is_null() {
            return Err(io::Error::last_os_error());
        }
        Ok(Arc::new(dev))
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The largest single READ the port allows.
    pub fn max_message(&self) -> u32 {
        self.max_msg
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: children (regions, queue pairs) hold an `Arc` of this device, so they are
        // gone; the handles were created by this struct.
        unsafe {
            if !self.pd.is_null() {
                ffi::ibv_dealloc_pd(self.pd);
            }
            ffi::ibv_close_device(self.ctx);
        }
    }
}

/// A buffer registered with a device for local writes and remote READs.
pub struct Region {
    _dev: Arc<Device>,
    mr: *mut ffi::ibv_mr,
    buf: *mut u8,
    len: usize,
}

// SAFETY: the buffer is only reached through the methods below, whose callers keep
// concurrent users on disjoint ranges (see `write` and `slice`).
unsafe impl Send for Region {}
unsafe impl Sync for Region {}

impl Region {
    /// `len` bytes (at least one), zeroed, registered with `dev`.
    pub fn new(dev: &Arc<Device>, len: usize) -> io::Result<Region> {
        let len = len.max(1);
        let buf = Box::into_raw(vec![0u8; len].into_boxed_slice()) as *mut u8;
        let access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ;
        // SAFETY: `buf` is `len` bytes that live until `Drop` deregisters them.
        let mr = unsafe { ffi::ibv_reg_mr(dev.pd, buf as *mut _, len, access.0 as i32) };
        if mr.is_null() {
            let e = io::Error::last_os_error();
            // SAFETY: reclaim the box made above.
            drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(buf, len)) });
            return Err(e);
        }
        Ok(Region {
            _dev: dev.clone(),
            mr,
            buf,
            len,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address peers READ from (the buffer's virtual address).
    pub fn addr(&self) -> u64 {
        self.buf as u64
    }

    pub fn rkey(&self) -> u32 {
        // SAFETY: `mr` is registered until `Drop`.
        unsafe { (*self.mr).rkey }
    }

    fn lkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.mr).lkey }
    }

    /// Copy `data` to `offset`.
    ///
    /// # Safety
    /// No thread and no device operation may touch `offset..offset + data.len()` meanwhile.
    pub unsafe fn write(&self, offset: usize, data: &[u8]) {
        assert!(offset + data.len() <= self.len, "write past the region");
        // SAFETY: in bounds; exclusivity is the caller's promise.
        unsafe { ptr::copy_nonoverlapping(data.as_ptr(), self.buf.add(offset), data.len()) };
    }

    /// The bytes at `offset..offset + len`.
    ///
    /// # Safety
    /// Nothing may write that range while the slice lives.
    pub unsafe fn slice(&self, offset: usize, len: usize) -> &[u8] {
        assert!(offset + len <= self.len, "read past the region");
        // SAFETY: in bounds; no writer is the caller's promise.
        unsafe { std::slice::from_raw_parts(self.buf.add(offset), len) }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: deregister first, so the device no longer touches the buffer, then free it.
        unsafe {
            ffi::ibv_dereg_mr(self.mr);
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.buf, self.len,
            )));
        }
    }
}

/// What a peer needs to connect its queue pair to ours.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub qpn: u32,
    pub psn: u32,
    pub lid: u16,
    pub gid: [u8; 16],
}

impl Endpoint {
    pub const LEN: usize = 26;

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut out = [0u8; Self::LEN];
        out[..4].copy_from_slice(&self.qpn.to_le_bytes());
        out[4..8].copy_from_slice(&self.psn.to_le_bytes());
        out[8..10].copy_from_slice(&self.lid.to_le_bytes());
        out[10..].copy_from_slice(&self.gid);
        out
    }

    pub fn decode(b: &[u8]) -> Option<Endpoint> {
        if b.len() != Self::LEN {
            return None;
        }
        Some(Endpoint {
            qpn: u32::from_le_bytes(b[..4].try_into().ok()?),
            psn: u32::from_le_bytes(b[4..8].try_into().ok()?),
            lid: u16::from_le_bytes(b[8..10].try_into().ok()?),
            gid: b[10..].try_into().ok()?,
        })
    }
}

/// One READ: `len` bytes at the peer's `remote_addr` into our region at `local_offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadOp {
    pub local_offset: u64,
    pub remote_addr: u64,
    pub len: u32,
}

/// A reliable-connected queue pair with its own completion queue.
pub struct QueuePair {
    dev: Arc<Device>,
    cq: *mut ffi::ibv_cq,
    qp: *mut ffi::ibv_qp,
    psn: u32,
}

// SAFETY: used by one thread at a time (`&mut self` for posting and polling).
unsafe impl Send for QueuePair {}

impl QueuePair {
    /// A queue pair in the INIT state that lets its peer READ this device's regions.
    pub fn new(dev: &Arc<Device>) -> io::Result<QueuePair> {
        // SAFETY: plain FFI on an open context.
        let cq = unsafe {
            ffi::ibv_create_cq(dev.ctx, DEPTH as i32, ptr::null_mut(), ptr::null_mut(), 0)
        };
        if cq.is_null() {
            return Err(io::Error::last_os_error());
        }
        let mut init: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = cq;
        init.recv_cq = cq;
        init.cap.max_send_wr = DEPTH;
        init.cap.max_recv_wr = 1;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        init.qp_type = ffi::ibv_qp_type::IBV_QPT_RC;
        init.sq_sig_all = 0;
        // SAFETY: `init` is filled in; `pd` is live.
        let qp = unsafe { ffi::ibv_create_qp(dev.pd, &mut init) };
        if qp.is_null() {
            let e = io::Error::last_os_error();
            unsafe { ffi::ibv_destroy_cq(cq) };
            return Err(e);
        }
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let q = QueuePair {
            dev: dev.clone(),
            cq,
            qp,
            // SAFETY: `qp` is live.
            psn: (seed ^ unsafe { (*qp).qp_num }.rotate_left(7)) & 0x00ff_ffff,
        };
        let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ffi::ibv_qp_state::IBV_QPS_INIT;
        attr.pkey_index = 0;
        attr.port_num = PORT;
        attr.qp_access_flags = ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
        let mask = ffi::ibv_qp_attr_mask::IBV_QP_STATE
            | ffi::ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
            | ffi::ibv_qp_attr_mask::IBV_QP_PORT
            | ffi::ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS;
        q.modify(&mut attr, mask, "INIT")?;
        Ok(q)
    }

    fn modify(
        &self,
        attr: &mut ffi::ibv_qp_attr,
        mask: ffi::ibv_qp_attr_mask,
        state: &str,
    ) -> io::Result<()> {
        // SAFETY: `qp` is live and `attr` filled in for `mask`.
        let rc = unsafe { ffi::ibv_modify_qp(self.qp, attr, mask.0 as i32) };
        if rc != 0 {
            return Err(other(format!(
                "moving the queue pair to {state}: {}",
                io::Error::from_raw_os_error(rc)
            )));
        }
        Ok(())
    }

    /// What the peer connects to.
    pub fn endpoint(&self) -> Endpoint {
        Endpoint {
            // SAFETY: `qp` is live.
            qpn: unsafe { (*self.qp).qp_num },
            psn: self.psn,
            lid: self.dev.lid,
            gid: self.dev.gid,
        }
    }

    /// Connect to the peer's queue pair: ready to receive, then ready to send.
    pub fn connect(&mut self, remote: &Endpoint) -> io::Result<()> {
        let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ffi::ibv_qp_state::IBV_QPS_RTR;
        attr.path_mtu = self.dev.mtu;
        attr.dest_qp_num = remote.qpn;
        attr.rq_psn = remote.psn;
        attr.max_dest_rd_atomic = self.dev.rd_atomic;
        attr.min_rnr_timer = 12;
        attr.ah_attr.dlid = remote.lid;
        attr.ah_attr.sl = 0;
        attr.ah_attr.src_path_bits = 0;
        attr.ah_attr.port_num = PORT;
        if remote.gid != [0; 16] {
            attr.ah_attr.is_global = 1;
            attr.ah_attr.grh.dgid.raw = remote.gid;
            attr.ah_attr.grh.sgid_index = self.dev.gid_index;
            attr.ah_attr.grh.hop_limit = 64;
        }
        self.modify(
            &mut attr,
            ffi::ibv_qp_attr_mask::IBV_QP_STATE
                | ffi::ibv_qp_attr_mask::IBV_QP_AV
                | ffi::ibv_qp_attr_mask::IBV_QP_PATH_MTU
                | ffi::ibv_qp_attr_mask::IBV_QP_DEST_QPN
                | ffi::ibv_qp_attr_mask::IBV_QP_RQ_PSN
                | ffi::ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
                | ffi::ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER,
            "RTR",
        )?;
        let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ffi::ibv_qp_state::IBV_QPS_RTS;
        attr.timeout = 14;
        attr.retry_cnt = 7;
        attr.rnr_retry = 7;
        attr.sq_psn = self.psn;
        attr.max_rd_atomic = self.dev.rd_atomic;
        self.modify(
            &mut attr,
            ffi::ibv_qp_attr_mask::IBV_QP_STATE
                | ffi::ibv_qp_attr_mask::IBV_QP_TIMEOUT
                | ffi::ibv_qp_attr_mask::IBV_QP_RETRY_CNT
                | ffi::ibv_qp_attr_mask::IBV_QP_RNR_RETRY
                | ffi::ibv_qp_attr_mask::IBV_QP_SQ_PSN
                | ffi::ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC,
            "RTS",
        )
    }

    /// Post every READ of `ops` into `local` (keeping at most the device's READ limit in
    /// flight) with the peer's `rkey`, and poll until all complete (spinning, then sleeping
    /// in growing steps). Any failed
    /// completion, or `timeout` passing, is an error; the queue pair is then unusable (the
    /// caller drops it).
    pub fn read(
        &mut self,
        local: &Region,
        ops: &[ReadOp],
        rkey: u32,
        timeout: Duration,
    ) -> io::Result<()> {
        for op in ops {
            if op.local_offset + op.len as u64 > local.len() as u64 {
                return Err(other("READ past the local region"));
            }
        }
        let deadline = Instant::now() + timeout;
        let window = (self.dev.rd_atomic as usize).min(DEPTH as usize).max(1);
        let (mut posted, mut done) = (0usize, 0usize);
        // SAFETY: zeroed completions are valid out-parameters.
        let mut wcs: [ffi::ibv_wc; 16] = unsafe { std::mem::zeroed() };
        let mut idle_polls = 0u32;
        while done < ops.len() {
            while posted < ops.len() && posted - done < window {
                self.post_read(local, &ops[posted], rkey, posted as u64)?;
                posted += 1;
            }
            // SAFETY: `cq` is live; `wcs` has room for 16 completions.
            let n = unsafe {
                let ctx = (*self.cq).context;
                let poll = (*ctx)
                    .ops
                    .poll_cq
                    .ok_or_else(|| other("the device has no poll_cq"))?;
                poll(self.cq, wcs.len() as i32, wcs.as_mut_ptr())
            };
            if n < 0 {
                return Err(other("polling the completion queue failed"));
            }
            for wc in &wcs[..n as usize] {
                if let Some((status, vendor)) = wc.error() {
                    return Err(other(format!(
                        "RDMA READ {} failed: status {status}, vendor error {vendor}",
                        wc.wr_id()
                    )));
                }
            }
            done += n as usize;
            if n > 0 {
                idle_polls = 0;
            }
            if n == 0 {
                if Instant::now() >= deadline {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!(
                            "{} of {} RDMA READs incomplete",
                            ops.len() - done,
                            ops.len()
                        ),
                    ));
                }
                // Spin briefly (a READ on hardware completes in microseconds), then back off
                // with growing sleeps so that many waiting readers do not starve the CPUs
                // the device (or soft-RoCE) needs to complete them.
                idle_polls += 1;
                if idle_polls < SPIN_POLLS {
                    std::hint::spin_loop();
                } else {
                    let step = (idle_polls - SPIN_POLLS).min(7);
                    std::thread::sleep(Duration::from_micros(8 << step));
                }
            }
        }
        Ok(())
    }

    fn post_read(&mut self, local: &Region, op: &ReadOp, rkey: u32, wr_id: u64) -> io::Result<()> {
        let mut sge = ffi::ibv_sge {
            addr: local.addr() + op.local_offset,
            length: op.len,
            lkey: local.lkey(),
        };
        // SAFETY: a zeroed work request is valid; the fields READ uses are set below.
        let mut wr: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.next = ptr::null_mut();
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_READ;
        wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.wr.rdma.remote_addr = op.remote_addr;
        wr.wr.rdma.rkey = rkey;
        let mut bad: *mut ffi::ibv_send_wr = ptr::null_mut();
        // SAFETY: `qp` is live; `wr` and `sge` outlive the call (the device copies them);
        // the local range is in bounds (checked by `read`) and stays untouched until the
        // completion is polled.
        let rc = unsafe {
            let ctx = (*self.qp).context;
            let post = (*ctx)
                .ops
                .post_send
                .ok_or_else(|| other("the device has no post_send"))?;
            post(self.qp, &mut wr, &mut bad)
        };
        if rc != 0 {
            return Err(other(format!(
                "posting an RDMA READ: {}",
                io::Error::from_raw_os_error(rc)
            )));
        }
        Ok(())
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: destroying a queue pair flushes its outstanding work; the completion queue
        // goes after the queue pair that uses it.
        unsafe {
            ffi::ibv_destroy_qp(self.qp);
            ffi::ibv_destroy_cq(self.cq);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_round_trip_and_reject_wrong_lengths() {
        let e = Endpoint {
            qpn: 0x0012_3456,
            psn: 0x00ab_cdef,
            lid: 7,
            gid: [9; 16],
        };
        assert_eq!(Endpoint::decode(&e.encode()), Some(e));
        assert_eq!(Endpoint::decode(&e.encode()[..25]), None);
    }
}
