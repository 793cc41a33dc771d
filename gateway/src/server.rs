//! The HTTP server: the accept loop with the limits a public endpoint needs.
//!
//! `axum::serve` has none: a client that opens connections and sends nothing, declares a
//! body it never sends, or stops reading a response holds a file descriptor (and, for a
//! response, its buffers) for as long as it likes. Here:
//!
//! - **Header read timeout** (hyper's): the whole request head must arrive within it, and a
//!   kept-alive connection idle that long between requests is closed.
//! - **Body read timeout**: at most this long between two pieces of a request body.
//! - **Write-stall timeout**: a connection whose client takes no bytes for this long is
//!   closed (a slow reader that still reads keeps it; generation never waits on it anyway,
//!   see [`crate::pipeline::spawn`]).
//! - **Connection limits**: at most `max_connections` open at once and at most
//!   `max_connections_per_client` from one IP address (0: no per-client limit, for a
//!   server behind a proxy); past either, a new connection is closed at once and counted.
//!   The server keeps answering everyone else, `/healthz` included.

use std::collections::HashMap;
use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tower_service::Service;

use crate::metrics;

/// The server's limits; see the module docs.
#[derive(Clone, Debug)]
pub struct ServeLimits {
    pub header_read_timeout: Duration,
    pub body_read_timeout: Duration,
    pub write_stall_timeout: Duration,
    pub max_connections: usize,
    /// 0: unlimited (behind a proxy every client has the proxy's address).
    pub max_connections_per_client: usize,
    /// A request declaring a longer body gets 413 before any of it is read.
    pub max_body_bytes: usize,
    /// What `GET /metrics` requires: this bearer token, or (none set) a loopback client.
    pub metrics_token: Option<Arc<str>>,
}

/// Who asks, for the endpoints that only operators may read (`GET /metrics`).
#[derive(Clone, Debug)]
pub struct Caller {
    pub peer: std::net::SocketAddr,
    pub metrics_token: Option<Arc<str>>,
}

impl Caller {
    /// Whether this request may read `/metrics`.
    pub fn may_read_metrics(&self, headers: &hyper::HeaderMap) -> bool {
        match &self.metrics_token {
            Some(t) => headers
                .get(hyper::header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .is_some_and(|v| crate::state::same_secret(v.trim().as_bytes(), t.as_bytes())),
            None => self.peer.ip().is_loopback(),
        }
    }
}

impl Default for ServeLimits {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(30),
            write_stall_timeout: Duration::from_secs(60),
            max_connections: 16_384,
            max_connections_per_client: 1024,
            max_body_bytes: 32 * 1024 * 1024,
            metrics_token: None,
        }
    }
}

/// Serve `app` on `listener` under `limits` until `shutdown`, then finish the requests in
/// flight (idle connections close at once).
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    shutdown: CancellationToken,
    limits: ServeLimits,
) -> std::io::Result<()> {
    let open = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let clients: Arc<Mutex<HashMap<IpAddr, usize>>> = Arc::default();
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    loop {
        let (stream, peer) = tokio::select! {
            _ = shutdown.cancelled() => break,
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // Out of descriptors (EMFILE) or a connection reset before accept: back
                    // off briefly instead of spinning; timeouts free descriptors meanwhile.
                    metrics::CONNECTIONS_REFUSED.with_label_values(&["accept_error"]).inc();
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            metrics::CONNECTIONS_REFUSED
                .with_label_values(&["server_full"])
                .inc();
            continue;
        };
        let Some(slot) = ClientSlot::take(&clients, peer.ip(), limits.max_connections_per_client)
        else {
            metrics::CONNECTIONS_REFUSED
                .with_label_values(&["client_limit"])
                .inc();
            continue;
        };
        let _ = stream.set_nodelay(true);
        let io = TokioIo::new(StallGuard::new(stream, limits.write_stall_timeout));
        let (body_timeout, max_body) = (limits.body_read_timeout, limits.max_body_bytes);
        let caller = Caller {
            peer,
            metrics_token: limits.metrics_token.clone(),
        };
        let app = app.clone();
        let svc = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
            let mut app = app.clone();
            req.extensions_mut().insert(caller.clone());
            async move {
                if declared_length(&req).is_some_and(|n| n > max_body as u64) {
                    return Ok(body_too_large(max_body));
                }
                if let Some(refused) = head_too_large(&req) {
                    return Ok(refused);
                }
                let req = req.map(|b| tower_http::timeout::TimeoutBody::new(body_timeout, b));
                app.call(req).await
            }
        });
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            // Above what `head_too_large` allows, so that it (in the API's error shape) and
            // not hyper (a bare 431) refuses most oversized heads; hyper's buffer limit
            // (about 400 KB) still bounds what one connection can make the server hold.
            .max_headers(4 * MAX_HEADERS)
            .header_read_timeout(limits.header_read_timeout)
            .serve_connection(io, svc);
        let conn = graceful.watch(conn);
        metrics::CONNECTIONS_OPEN.inc();
        tokio::spawn(async move {
            let _ = conn.await;
            metrics::CONNECTIONS_OPEN.dec();
            drop((permit, slot));
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

fn declared_length<B>(req: &hyper::Request<B>) -> Option<u64> {
    req.headers()
        .get(hyper::header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

/// The longest request target (path and query) read.
pub const MAX_URI_BYTES: usize = 16 * 1024;
/// The most header fields a request may have.
pub const MAX_HEADERS: usize = 100;
/// The most bytes of header names and values a request may have.
pub const MAX_HEADER_BYTES: usize = 64 * 1024;

/// 414 or 431, in the API's error shape, for a request head past the limits above.
fn head_too_large<B>(req: &hyper::Request<B>) -> Option<axum::response::Response> {
    use crate::error::{ApiError, ErrorCode};
    let uri = req.uri().path_and_query().map_or(0, |p| p.as_str().len());
    let refusal = if uri > MAX_URI_BYTES {
        ApiError::new(
            ErrorCode::UriTooLong,
            format!("The request target is {uri} bytes; the limit is {MAX_URI_BYTES}."),
        )
    } else if req.headers().len() > MAX_HEADERS {
        ApiError::new(
            ErrorCode::HeadersTooLarge,
            format!(
                "The request has {} header fields; the limit is {MAX_HEADERS}.",
                req.headers().len()
            ),
        )
    } else {
        let bytes: usize = req
            .headers()
            .iter()
            .map(|(n, v)| n.as_str().len() + v.len())
            .sum();
        if bytes <= MAX_HEADER_BYTES {
            return None;
        }
        ApiError::new(
            ErrorCode::HeadersTooLarge,
            format!("The request's headers are {bytes} bytes; the limit is {MAX_HEADER_BYTES}."),
        )
    };
    Some(crate::error::unrouted(
        refusal.with_request_id(cachet_common::RequestId::new()),
    ))
}

/// 413 from the declared length alone: nobody waits for a body that will be refused.
fn body_too_large(max: usize) -> axum::response::Response {
    crate::error::unrouted(
        crate::error::ApiError::new(
            crate::error::ErrorCode::RequestTooLarge,
            format!(
                "Request exceeds the maximum allowed number of bytes ({} MB).",
                max / (1024 * 1024)
            ),
        )
        .with_request_id(cachet_common::RequestId::new()),
    )
}

/// One connection counted against its client's address; released on drop.
struct ClientSlot {
    clients: Arc<Mutex<HashMap<IpAddr, usize>>>,
    ip: IpAddr,
}

impl ClientSlot {
    fn take(clients: &Arc<Mutex<HashMap<IpAddr, usize>>>, ip: IpAddr, max: usize) -> Option<Self> {
        let mut m = clients.lock().unwrap_or_else(|p| p.into_inner());
        let n = m.entry(ip).or_insert(0);
        if max > 0 && *n >= max {
            return None;
        }
        *n += 1;
        Some(Self {
            clients: clients.clone(),
            ip,
        })
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut m = self.clients.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = m.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.ip);
            }
        }
    }
}

/// A connection that fails its writes once the peer has taken no bytes for `timeout`.
struct StallGuard<T> {
    inner: T,
    timeout: Duration,
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<T> StallGuard<T> {
    fn new(inner: T, timeout: Duration) -> Self {
        Self {
            inner,
            timeout,
            stalled: None,
        }
    }

    /// The write is pending: start (or check) the stall clock.
    fn pending<R>(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<R>> {
        let timeout = self.timeout;
        let sleep = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        if sleep.as_mut().poll(cx).is_ready() {
            metrics::CONNECTION_TIMEOUTS
                .with_label_values(&["write_stall"])
                .inc();
            return Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the client took no bytes for the write-stall timeout",
            )));
        }
        Poll::Pending
    }

    fn progress<R>(
        &mut self,
        r: Poll<std::io::Result<R>>,
        cx: &mut Context<'_>,
    ) -> Poll<std::io::Result<R>> {
        match r {
            Poll::Pending => self.pending(cx),
            ready => {
                self.stalled = None;
                ready
            }
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for StallGuard<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for StallGuard<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.progress(r, cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.progress(r, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_flush(cx);
        self.progress(r, cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Raise this process's open-file limit to its hard limit (connections are descriptors).
pub fn raise_fd_limit() {
    #[cfg(unix)]
    // SAFETY: getrlimit/setrlimit only read and write the struct passed by pointer.
    unsafe {
        let mut l = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) == 0 && l.rlim_cur < l.rlim_max {
            l.rlim_cur = l.rlim_max;
            let _ = libc::setrlimit(libc::RLIMIT_NOFILE, &l);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_write_the_peer_never_takes_fails_after_the_stall_timeout() {
        use tokio::io::AsyncWriteExt;
        let (a, mut b) = tokio::io::duplex(64);
        let mut w = StallGuard::new(a, Duration::from_secs(60));
        // A peer that reads keeps the connection, however slowly.
        for _ in 0..4 {
            w.write_all(&[7u8; 64]).await.unwrap();
            tokio::time::sleep(Duration::from_secs(50)).await;
            let mut buf = [0u8; 64];
            tokio::io::AsyncReadExt::read_exact(&mut b, &mut buf)
                .await
                .unwrap();
        }
        // One that stops reading: the write fails once the timeout passes, not before.
        w.write_all(&[7u8; 64]).await.unwrap();
        let started = tokio::time::Instant::now();
        let err = w.write_all(&[7u8; 64]).await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), Duration::from_secs(60));
    }

    #[test]
    fn metrics_need_the_token_or_a_loopback_client() {
        let caller = |peer: &str, token: Option<&str>| Caller {
            peer: peer.parse().unwrap(),
            metrics_token: token.map(Arc::from),
        };
        let none = hyper::HeaderMap::new();
        let mut bearer = hyper::HeaderMap::new();
        bearer.insert("authorization", "Bearer m-secret".parse().unwrap());
        assert!(caller("127.0.0.1:5000", None).may_read_metrics(&none));
        assert!(caller("[::1]:5000", None).may_read_metrics(&none));
        assert!(!caller("203.0.113.9:5000", None).may_read_metrics(&none));
        assert!(!caller("203.0.113.9:5000", None).may_read_metrics(&bearer));
        let t = Some("m-secret");
        assert!(caller("203.0.113.9:5000", t).may_read_metrics(&bearer));
        assert!(
            !caller("127.0.0.1:5000", t).may_read_metrics(&none),
            "a token binds loopback too"
        );
        let mut wrong = hyper::HeaderMap::new();
        wrong.insert("authorization", "Bearer m-secreT".parse().unwrap());
        assert!(!caller("203.0.113.9:5000", t).may_read_metrics(&wrong));
    }

    #[test]
    fn client_slots_count_per_address_and_free_on_drop() {
        let m: Arc<Mutex<HashMap<IpAddr, usize>>> = Arc::default();
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let s1 = ClientSlot::take(&m, a, 2).unwrap();
        let _s2 = ClientSlot::take(&m, a, 2).unwrap();
        assert!(
            ClientSlot::take(&m, a, 2).is_none(),
            "third from one address"
        );
        assert!(
            ClientSlot::take(&m, b, 2).is_some(),
            "another address is not affected"
        );
        drop(s1);
        assert!(
            ClientSlot::take(&m, a, 2).is_some(),
            "a freed slot is reused"
        );
        assert!(ClientSlot::take(&m, a, 0).is_some(), "0 means no limit");
    }
}
