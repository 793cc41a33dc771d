//! The change feed: how a running gateway or node applies administrative changes without a
//! restart.
//!
//! Every change writes an audit row in its own transaction (see [`control::tenants::audit`]).
//! [`run`] polls `admin_audit` about once a second for rows it has not seen and, for each
//! tenant they touch:
//! - drops the tenant's cached API keys (a revoked, expired or rotated key, a suspended
//!   tenant, new limits: the next request reads them again);
//! - applies the tenant's cache policy to this process's fabric node (resident quota,
//!   reservation, replication factor), or purges its blocks from every tier if it was deleted
//!   or its cache was purged (`cache.purge`, the admin API's purge);
//! - releases a deleted cache object's blocks from this process's node
//!   (`cache_object.delete`, [`control::release`]).
//!
//! At start it applies every tenant's policy and purges every deleted tenant's blocks (what a
//! node's disk tier kept from before a restart included), drops what the disk tier kept from
//! before a cache purge of the last 30 days, releases every deleted cache object not yet
//! expired, then follows the feed from its end.
//!
//! Ids of rows that commit late can be lower than ids already seen; each poll re-reads a
//! window of the last [`OVERLAP`] ids and skips those it has applied, so a late row is still
//! applied. Applying a change twice is harmless (it reloads state), so nothing depends on
//! exactly-once.
//!
//! Besides, on the same loop: the month's spend of tenants and workspaces with a budget (for
//! admission, every [`SyncConfig::spend_every`], recording each budget threshold crossed once a
//! month: [`control::alerts`]), counts of refused requests and keys' last use (every
//! [`FLUSH_EVERY`]), and erasing rotation seeds past their replay window.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cache_fabric::FabricClient;
use cachet_common::TenantId;
use chrono::{DateTime, DurationRound, TimeDelta, Utc};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::admission::{Admission, Spend, Spender};
use crate::auth::Authenticator;
use crate::metrics;
use control::tenants::policy::{self, Policy};
use control::tenants::{AdminError, audit, keys, refusals, workspaces};

/// Ids re-read behind the highest seen (rows that committed out of id order).
pub const OVERLAP: i64 = 256;
/// How often refusal counts and key use are written.
pub const FLUSH_EVERY: Duration = Duration::from_secs(5);

/// How often the loop does what.
#[derive(Clone, Copy, Debug)]
pub struct SyncConfig {
    /// Polls of the change feed.
    pub poll: Duration,
    /// Recomputations of budgeted tenants' spend.
    pub spend_every: Duration,
}

impl Default for SyncConfig {
    fn default() -> Self {
        Self {
            poll: Duration::from_secs(1),
            spend_every: Duration::from_secs(15),
        }
    }
}

/// What this process applies changes to.
#[derive(Clone, Default)]
pub struct Targets {
    pub auth: Option<Arc<Authenticator>>,
    pub admission: Option<Arc<Admission>>,
    pub fabric: Option<FabricClient>,
    /// Cache writes not held, recorded with the refusals.
    pub not_held: Option<Arc<crate::not_held::NotHeld>>,
}

/// A tenant's state as the fabric needs it.
struct TenantState {
    deleted: bool,
    policy: Policy,
}

async fn load_states(
    pool: &PgPool,
    only: Option<&[Uuid]>,
) -> Result<HashMap<Uuid, TenantState>, AdminError> {
    Ok(policy::standings(pool, only)
        .await?
        .into_iter()
        .map(|s| {
            (
                s.tenant,
                TenantState {
                    deleted: s.deleted,
                    policy: s.policy,
                },
            )
        })
        .collect())
}

async fn apply_fabric(fabric: &FabricClient, tenant: Uuid, s: &TenantState) {
    let t = TenantId(tenant);
    if s.deleted {
        crate::metrics::forget_tenant(t);
        let n = fabric.purge_tenant(t);
        if n > 0 {
            tracing::info!(tenant_id = %t, blocks = n, "purged the cache of a deleted tenant");
        }
        fabric.set_tenant_replicas(t, None);
        return;
    }
    let bytes = |b: Option<i64>| b.map(|b| b.max(0) as u64);
    fabric
        .set_tenant_quota(t, bytes(s.policy.cache_resident_bytes))
        .await;
    fabric
        .set_tenant_reservation(t, bytes(s.policy.reserved_cache_bytes))
        .await;
    fabric.set_tenant_replicas(t, s.policy.replication_factor.map(|r| r.max(1) as usize));
}

/// At start: cache purges of the longest TTL's span (30 days) — what a disk tier kept from
/// before one (this node was down when it was applied) is dropped; what was written after it
/// stays.
async fn apply_missed_purges(pool: &PgPool, fabric: &FabricClient) -> Result<(), AdminError> {
    let purges =
        audit::last_taken(pool, control::caches::PURGE_ACTION, TimeDelta::days(30)).await?;
    for (tenant, at) in purges {
        let tenant = TenantId(tenant);
        let n = fabric.purge_tenant_written_before(tenant, at.timestamp_millis().max(0) as u64);
        if n > 0 {
            tracing::info!(tenant_id = %tenant, blocks = n, purged_at = %at,
                "dropped blocks a cache purge missed while this node was down");
        }
    }
    Ok(())
}

/// At start: what this node's tiers kept of a cache purge or a deleted cache object it
/// missed while it was down goes (a node applies this before it announces or serves what
/// its disk tier kept; the feed's first step applies it again, which changes nothing).
pub async fn apply_tombstones(pool: &PgPool, fabric: &FabricClient) -> Result<(), AdminError> {
    apply_missed_purges(pool, fabric).await?;
    let n = control::release::release_missed(pool, fabric).await?;
    if n > 0 {
        tracing::info!(
            objects = n,
            "released deleted cache objects' blocks at start"
        );
    }
    Ok(())
}

/// Follow the change feed until `stop`.
pub async fn run(
    mut follower: Follower,
    pool: PgPool,
    targets: Targets,
    config: SyncConfig,
    stop: CancellationToken,
) {
    let mut last_spend: Option<Instant> = None;
    let mut last_flush = Instant::now();
    let mut last_seed_sweep: Option<Instant> = None;
    let mut tick = cachet_common::tick::Ticker::new(config.poll, stop);
    while tick.next().await {
        if let Err(e) = follower.step(&pool, &targets).await {
            tracing::warn!(error = %e, "following administrative changes failed; retrying");
        }
        if last_spend.is_none_or(|t| t.elapsed() >= config.spend_every)
            && let (Some(auth), Some(adm)) = (&targets.auth, &targets.admission)
        {
            last_spend = Some(Instant::now());
            if let Err(e) = refresh_spend(&pool, auth, adm).await {
                tracing::warn!(error = %e, "refreshing budget spend failed");
            }
        }
        if last_flush.elapsed() >= FLUSH_EVERY {
            last_flush = Instant::now();
            flush(&pool, &targets).await;
        }
        if last_seed_sweep.is_none_or(|t| t.elapsed() >= Duration::from_secs(600)) {
            last_seed_sweep = Some(Instant::now());
            if let Err(e) = keys::expire_rotation_seeds(&pool).await {
                tracing::warn!(error = %e, "erasing old rotation seeds failed");
            }
        }
    }
    // What is counted but not yet written goes now.
    flush(&pool, &targets).await;
}

/// The feed's position.
#[derive(Default)]
pub struct Follower {
    started: bool,
    high: i64,
    /// Ids applied within the overlap window.
    seen: BTreeSet<i64>,
    /// Deleted cache objects seen on the feed and not yet released here.
    unreleased: Vec<String>,
}

impl Follower {
    /// One poll: at first, apply every tenant's state; then apply what is new.
    pub async fn step(&mut self, pool: &PgPool, targets: &Targets) -> Result<usize, AdminError> {
        if !self.started {
            // The feed's end first, then the full state: a change between the two is
            // applied twice, never missed.
            self.high = audit::feed_end(pool).await?;
            // Rows already in the overlap window are the past the full state below covers:
            // seen, so the first poll does not re-apply them (it used to drop every cached key
            // of the tenants changed last, which during a Postgres outage refused them).
            // Rows that commit later with lower ids are not among these and still apply.
            self.seen = audit::feed_ids(pool, self.high - OVERLAP, self.high)
                .await?
                .into_iter()
                .collect();
            if let Some(f) = &targets.fabric {
                for (id, s) in load_states(pool, None).await? {
                    apply_fabric(f, id, &s).await;
                }
                apply_tombstones(pool, f).await?;
            }
            self.started = true;
            return Ok(0);
        }
        let rows = audit::feed_after(pool, self.high - OVERLAP).await?;
        let mut tenants: BTreeSet<Uuid> = BTreeSet::new();
        let mut purged: BTreeSet<Uuid> = BTreeSet::new();
        let mut deleted_objects: Vec<String> = Vec::new();
        let now = Utc::now();
        for r in rows {
            let (id, action) = (r.id, r.action);
            if id <= self.high - OVERLAP || !self.seen.insert(id) {
                continue;
            }
            self.high = self.high.max(id);
            metrics::ADMIN_CHANGE_LAG.observe((now - r.at).num_milliseconds().max(0) as f64 / 1e3);
            metrics::ADMIN_CHANGES_APPLIED
                .with_label_values(&[action.split('.').next().unwrap_or("other")])
                .inc();
            if let Some(t) = r.tenant {
                tenants.insert(t);
                if action == control::caches::PURGE_ACTION {
                    purged.insert(t);
                }
                if action == control::caches::DELETE_ACTION
                    && let Some(id) = r.target
                {
                    deleted_objects.push(id);
                }
            }
        }
        let floor = self.high - OVERLAP;
        self.seen = self.seen.split_off(&(floor + 1));
        if let Some(auth) = &targets.auth {
            for t in &tenants {
                auth.invalidate_tenant(TenantId(*t));
            }
        }
        if let Some(f) = &targets.fabric {
            for t in &purged {
                let n = f.purge_tenant(TenantId(*t));
                tracing::info!(tenant_id = %t, blocks = n, "purged a tenant's cache");
            }
        }
        // Kept until released: a poll that fails here (Postgres away) retries them.
        self.unreleased.extend(deleted_objects);
        if let Some(f) = &targets.fabric
            && !self.unreleased.is_empty()
        {
            control::release::release_ids(pool, f, &self.unreleased).await?;
            self.unreleased.clear();
        }
        if let Some(f) = &targets.fabric
            && !tenants.is_empty()
        {
            let ids: Vec<Uuid> = tenants.iter().copied().collect();
            for (id, s) in load_states(pool, Some(&ids)).await? {
                apply_fabric(f, id, &s).await;
            }
        }
        Ok(tenants.len())
    }
}

/// Recompute this month's spend of the tenants (and workspaces) with a budget that this
/// process serves, and record the budget thresholds they crossed ([`control::alerts`]).
async fn refresh_spend(
    pool: &PgPool,
    auth: &Authenticator,
    admission: &Admission,
) -> Result<(), AdminError> {
    let served: Vec<Uuid> = auth.cached_tenants().iter().map(|t| t.as_uuid()).collect();
    if served.is_empty() {
        return Ok(());
    }
    let budgeted = workspaces::with_budgets(pool, &served).await?;
    let now = Utc::now();
    let (_, resets_at) = billing::dashboard::month_of(now);
    for tenant in budgeted {
        for s in control::alerts::standings(pool, tenant, now).await? {
            if let Err(e) = control::alerts::record(pool, &s, now).await {
                tracing::warn!(tenant_id = %tenant, error = %e, "recording a budget alert failed");
            }
            let who = match s.workspace {
                Some(w) => Spender::Workspace(cachet_common::WorkspaceId(w)),
                None => Spender::Tenant(TenantId(tenant)),
            };
            admission.set_spend(
                who,
                Spend {
                    currency: s.currency,
                    spent_minor: s.spent_minor,
                    resets_at,
                },
            );
        }
    }
    Ok(())
}

/// The start of this hour (UTC), the bucket counts are added to.
fn hour_now() -> DateTime<Utc> {
    Utc::now()
        .duration_trunc(TimeDelta::hours(1))
        .unwrap_or_else(|_| Utc::now())
}

/// Write refusal counts and cache writes not held (per hour) and keys' last use.
async fn flush(pool: &PgPool, targets: &Targets) {
    if let Some(adm) = &targets.admission {
        let taken = adm.take_refusals();
        if !taken.is_empty() {
            let taken: Vec<refusals::Refusal> = taken
                .into_iter()
                .map(|(t, k, limit, count)| refusals::Refusal {
                    tenant: t.as_uuid(),
                    key: k.as_uuid(),
                    limit,
                    count,
                })
                .collect();
            if let Err(e) = refusals::record_refusals(pool, hour_now(), &taken).await {
                tracing::warn!(error = %e, "recording refusal counts failed; they are dropped");
            }
        }
    }
    if let Some(counts) = &targets.not_held {
        let not_held = counts.take();
        if !not_held.is_empty()
            && let Err(e) = refusals::record_not_held(pool, hour_now(), &not_held).await
        {
            tracing::warn!(error = %e, "recording cache writes not held failed; they are dropped");
        }
    }
    if let Some(auth) = &targets.auth {
        let used: Vec<(Uuid, DateTime<Utc>)> = auth
            .take_used()
            .into_iter()
            .map(|(k, t)| (k.as_uuid(), t))
            .collect();
        if let Err(e) = keys::touch_keys(pool, &used).await {
            tracing::warn!(error = %e, "recording keys' last use failed");
        }
    }
}
