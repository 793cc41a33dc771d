//! Releasing deleted cache objects' blocks: what makes `DELETE /v1/caches/{id}` free the
//! object's KV on every node and tier (decision 0027, (d)).
//!
//! A deleted object's row keeps the hashes of its blocks; that row is the tombstone. Every
//! process with a fabric node releases it from its own node ([`release`]): each block goes
//! from every tier unless another entry of the scope still holds it — the entries written at
//! breakpoints and reads, which the store keeps apart from objects' holds, and the other live
//! objects, whose hashes Postgres has — and then keeps only what those need. Each release is
//! recorded per node (`cache_object_releases`), which is how the deletion's answer knows when
//! every live node has done it ([`await_releases`]).
//!
//! A node learns of a deletion from the change feed (`cache_object.delete` audit rows,
//! `gateway::sync`); the process that answers the `DELETE` (the API's, or the admin API's)
//! releases at once when it has a node. A node that was
//! down applies every deleted, unexpired object at start, before it serves or re-announces
//! what its disk tier kept ([`release_missed`]). Releasing twice changes nothing more.

use std::time::Duration;

use cache_fabric::{FabricClient, Released};
use cachet_common::BlockHash;
use sqlx::PgPool;

use crate::caches::{self as store, Deleted};
use crate::metrics;
use crate::tenants::AdminError;

/// How long a deletion waits for every live node to release the object before answering
/// with those still pending (they release it from the change feed, or at their next start).
pub const RELEASE_WAIT: Duration = Duration::from_secs(10);

/// Release `d` from this process's node and record it.
pub async fn release(
    pool: &PgPool,
    fabric: &FabricClient,
    d: &Deleted,
) -> Result<Released, AdminError> {
    let held = store::held_by_others(pool, d).await?;
    let blocks: Vec<(BlockHash, Option<u64>)> = d
        .blocks
        .iter()
        .map(|h| {
            let until = held.get(h).map(|t| t.timestamp_millis().max(0) as u64);
            (*h, until)
        })
        .collect();
    // Under the store's lock, reading the tier below: off the async threads.
    let (f, scope) = (fabric.clone(), d.scope);
    let r = tokio::task::spawn_blocking(move || f.release(scope, &blocks))
        .await
        .unwrap_or_else(|e| {
            tracing::error!(error = %e, "releasing blocks panicked");
            Released::default()
        });
    store::record_release(pool, &d.id, &fabric.node_id(), r).await?;
    metrics::CACHE_RELEASED_BYTES
        .with_label_values(&["freed"])
        .inc_by(r.bytes_freed);
    metrics::CACHE_RELEASED_BYTES
        .with_label_values(&["held"])
        .inc_by(r.bytes_held);
    tracing::info!(tenant_id = %d.scope.tenant, cache_object = %d.id, bytes_freed = r.bytes_freed,
        bytes_held = r.bytes_held, "released a deleted cache object's blocks");
    Ok(r)
}

/// Release the deleted objects among `ids` (the change feed's deletions).
pub async fn release_ids(
    pool: &PgPool,
    fabric: &FabricClient,
    ids: &[String],
) -> Result<(), AdminError> {
    for d in store::deleted(pool, ids).await? {
        release(pool, fabric, &d).await?;
    }
    Ok(())
}

/// At start: release every deleted object not yet expired (this node may have been down
/// when it was deleted, and its disk tier keeps what it held then).
pub async fn release_missed(pool: &PgPool, fabric: &FabricClient) -> Result<usize, AdminError> {
    let missed = store::deleted_unexpired(pool).await?;
    for d in &missed {
        release(pool, fabric, d).await?;
    }
    Ok(missed.len())
}

/// What a deletion's answer reports: the sum over the nodes that released the object.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    pub released: Released,
    /// Live nodes that had not released it yet.
    pub pending: Vec<String>,
}

/// Wait (up to `wait`) until every node `live` names has released object `id`.
pub async fn await_releases(
    pool: &PgPool,
    live: impl Fn() -> Vec<String>,
    id: &str,
    wait: Duration,
) -> Result<Outcome, AdminError> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let done = store::releases(pool, id).await?;
        let pending: Vec<String> = live()
            .into_iter()
            .filter(|n| !done.iter().any(|(d, _)| d == n))
            .collect();
        if pending.is_empty() || tokio::time::Instant::now() >= deadline {
            let mut released = Released::default();
            for (_, r) in done {
                released += r;
            }
            return Ok(Outcome { released, pending });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A just-deleted object, released here at once (`fabric`: this process's node, if it has
/// one), then waited for on every node `live` names (the change feed tells the others). The
/// deletion is committed whatever happens here: a failure is logged and shows as nodes
/// pending.
pub async fn released_everywhere(
    pool: &PgPool,
    fabric: Option<&FabricClient>,
    live: impl Fn() -> Vec<String>,
    id: &str,
) -> Outcome {
    let ids = [id.to_string()];
    let attempt = async {
        if let Some(f) = fabric {
            for d in store::deleted(pool, &ids).await? {
                release(pool, f, &d).await?;
            }
        }
        await_releases(pool, &live, id, RELEASE_WAIT).await
    };
    match attempt.await {
        Ok(o) => o,
        Err(e) => {
            tracing::warn!(cache_object = %id, error = %e,
                "releasing a deleted cache object's blocks failed here; the change feed retries it");
            Outcome {
                pending: live(),
                ..Default::default()
            }
        }
    }
}
