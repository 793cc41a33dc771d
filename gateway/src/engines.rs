//! The served models and a bounded pool of engine workers.
//!
//! Generations run on blocking threads. At most `workers` run at once; at most `queue`
//! more may wait. Past that a request is answered 529 `overloaded_error` at once instead of
//! queueing without bound.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use engine::Engine;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::ApiError;

pub struct EnginePool {
    engines: Vec<Arc<dyn Engine>>,
    by_id: HashMap<String, usize>,
    permits: Arc<Semaphore>,
    waiting: AtomicUsize,
    queue: usize,
}

impl EnginePool {
    pub fn new(engines: Vec<Arc<dyn Engine>>, workers: usize, queue: usize) -> Self {
        let by_id = engines
            .iter()
            .enumerate()
            .map(|(i, e)| (e.info().id.clone(), i))
            .collect();
        Self {
            engines,
            by_id,
            permits: Arc::new(Semaphore::new(workers.max(1))),
            waiting: AtomicUsize::new(0),
            queue,
        }
    }

    pub fn get(&self, model: &str) -> Option<&Arc<dyn Engine>> {
        self.by_id.get(model).map(|&i| &self.engines[i])
    }

    pub fn all(&self) -> &[Arc<dyn Engine>] {
        &self.engines
    }

    /// A worker slot, or 529 if too many requests already wait for one.
    pub async fn acquire(&self) -> Result<OwnedSemaphorePermit, ApiError> {
        if let Ok(p) = self.permits.clone().try_acquire_owned() {
            return Ok(p);
        }
        if self.waiting.fetch_add(1, Ordering::SeqCst) >= self.queue {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(ApiError::overloaded("Overloaded"));
        }
        let p = self.permits.clone().acquire_owned().await;
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        p.map_err(|e| ApiError::internal("engine pool closed", e))
    }
}
