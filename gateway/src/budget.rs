//! The KV memory budget: the bytes of KV a serving process may hold at once on their way
//! from the engine to the fabric (a prefill's exported blocks, until they are written).
//!
//! Each request reserves the bytes of the blocks it will export before its prefill and gives
//! them back as soon as they are written (before decoding). A request waits for its
//! reservation at most `wait` (a request that gives up waiting, or whose task is cancelled,
//! takes nothing), then is answered 529 with the reason. A request whose blocks alone exceed
//! the whole budget is still answered: only the breakpoints whose blocks fit are written
//! (the others report `not_written`, reason `kv_budget`, and are billed as plain input).
//!
//! Imported blocks count too: a request reserves its whole prompt's KV (at most the budget)
//! before it reads, reads no more than that, and then shrinks the reservation to what it
//! imported and will export. A local read shares the fabric tier's buffers, but the tier may
//! evict a block while the request still holds it (measured: without this, a replay of
//! long prompts held 6.7 GiB over the bounds); a cluster node's pulls land in buffers of their
//! own. The pipeline lets go of imports after the prefill.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::ApiError;
use crate::metrics;

/// Reservations are counted in units of this many bytes (a semaphore counts in `u32`s).
const UNIT: u64 = 64 << 10;

pub struct KvBudget {
    total: u64,
    permits: Arc<Semaphore>,
    wait: Duration,
}

/// Bytes reserved by one request; returned on drop.
#[derive(Debug)]
pub struct KvReservation {
    _permit: Option<OwnedSemaphorePermit>,
    bytes: u64,
}

impl KvReservation {
    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Give back all but `bytes` (rounded up to the budget's unit); never grows.
    pub fn shrink_to(&mut self, bytes: u64) {
        let keep = bytes.div_ceil(UNIT);
        let held = self.bytes / UNIT;
        if keep >= held {
            return;
        }
        if let Some(p) = self._permit.as_mut() {
            drop(p.split((held - keep) as usize));
        }
        let freed = (held - keep) * UNIT;
        self.bytes -= freed;
        metrics::KV_BUDGET_USED.sub(freed as i64);
    }
}

impl Drop for KvReservation {
    fn drop(&mut self) {
        metrics::KV_BUDGET_USED.sub(self.bytes as i64);
    }
}

impl KvBudget {
    /// A budget of `total` bytes; a request waits at most `wait` for its share.
    pub fn new(total: u64, wait: Duration) -> Self {
        let units = (total / UNIT).clamp(1, u64::from(u32::MAX)) as usize;
        metrics::KV_BUDGET_TOTAL.set((units as u64 * UNIT) as i64);
        Self {
            total: units as u64 * UNIT,
            permits: Arc::new(Semaphore::new(units)),
            wait,
        }
    }

    /// The whole budget, in bytes.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Reserve `bytes` (at most the whole budget: callers trim what they export to fit),
    /// waiting at most the configured time; 529 with the reason if it is not had by then.
    pub async fn reserve(&self, bytes: u64) -> Result<KvReservation, ApiError> {
        if bytes == 0 {
            return Ok(KvReservation {
                _permit: None,
                bytes: 0,
            });
        }
        let units = bytes.div_ceil(UNIT).min(self.total / UNIT) as u32;
        let permits = self.permits.clone();
        let got = match permits.clone().try_acquire_many_owned(units) {
            Ok(p) => {
                metrics::KV_BUDGET_WAITS
                    .with_label_values(&["immediate"])
                    .inc();
                Ok(p)
            }
            Err(_) => {
                match tokio::time::timeout(self.wait, permits.acquire_many_owned(units)).await {
                    Ok(Ok(p)) => {
                        metrics::KV_BUDGET_WAITS
                            .with_label_values(&["waited"])
                            .inc();
                        Ok(p)
                    }
                    Ok(Err(_)) => Err(ApiError::overloaded("Overloaded: the KV budget is closed")),
                    Err(_) => {
                        metrics::KV_BUDGET_WAITS
                            .with_label_values(&["refused"])
                            .inc();
                        Err(ApiError::overloaded(format!(
                            "Overloaded: this request's KV ({}) waited {} s for the KV memory budget \
                         ({}, engine.kv_budget_bytes), which requests in flight hold; retry shortly",
                            human(bytes),
                            self.wait.as_secs(),
                            human(self.total)
                        )))
                    }
                }
            }
        }?;
        let bytes = u64::from(units) * UNIT;
        metrics::KV_BUDGET_USED.add(bytes as i64);
        Ok(KvReservation {
            _permit: Some(got),
            bytes,
        })
    }
}

/// `1.5 GiB`, `64.0 MiB`, `12 KiB`.
pub fn human(bytes: u64) -> String {
    const GI: f64 = (1u64 << 30) as f64;
    const MI: f64 = (1u64 << 20) as f64;
    let b = bytes as f64;
    if b >= GI {
        format!("{:.1} GiB", b / GI)
    } else if b >= MI {
        format!("{:.1} MiB", b / MI)
    } else {
        format!("{} KiB", bytes.div_ceil(1024))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn reservations_wait_for_each_other_and_give_up_with_a_reason() {
        let b = KvBudget::new(4 * UNIT, Duration::from_millis(50));
        let first = b.reserve(3 * UNIT).await.unwrap();
        // Two more units are not there: the wait runs out and says why.
        let e = b.reserve(2 * UNIT).await.unwrap_err();
        let msg = e.body().error.message;
        assert!(msg.contains("KV memory budget"), "{msg}");
        drop(first);
        let mut again = b.reserve(2 * UNIT).await.unwrap();
        assert_eq!(again.bytes, 2 * UNIT);
        // Shrinking gives the rest back at once.
        again.shrink_to(UNIT / 2);
        assert_eq!(again.bytes(), UNIT);
        let other = b.reserve(3 * UNIT).await.unwrap();
        assert_eq!(other.bytes(), 3 * UNIT);
        drop(other);
        assert_eq!(b.reserve(0).await.unwrap().bytes, 0);
    }

    #[tokio::test]
    async fn a_request_bigger_than_the_budget_takes_all_of_it() {
        let b = KvBudget::new(4 * UNIT, Duration::from_millis(50));
        let all = b.reserve(100 * UNIT).await.unwrap();
        assert_eq!(all.bytes, 4 * UNIT);
    }
}
