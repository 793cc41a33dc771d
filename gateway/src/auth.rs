//! API key authentication with a short-lived in-memory cache.
//!
//! Keys come in `x-api-key` or `Authorization: Bearer`. A resolved key is cached for `ttl`;
//! an unknown key is cached as unknown for a few seconds so a flood of bad keys does not reach
//! Postgres. Administrative changes (a revoked or rotated key, a suspended tenant, new limits)
//! do not wait for the cache: the change feed ([`crate::sync`]) drops the entries they
//! touch within about a second.
//!
//! A cached principal past its `ttl` is served at once and refreshed in the background
//! (one refresh per key at a time), so no request waits on Postgres for a key it has seen:
//! when Postgres is away, the last known state of every cached key keeps working (an outage
//! should not log customers out) and the refresh simply fails. A key never seen (or known
//! unknown and expired) needs Postgres: after a lookup fails, such keys are answered 503 at
//! once for [`DOWN_BACKOFF`] instead of each waiting for the pool.
//!
//! A key past its expiry (its own, or the end of a rotation's grace period) is refused with
//! 401 at once, cached or not; a suspended tenant's keys get 403.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use cachet_common::{ApiKeyId, TenantId};
use chrono::{DateTime, Utc};
use sqlx::PgPool;

use crate::error::{ApiError, ErrorCode};
use control::tenants::{self, Principal};

const NEGATIVE_TTL: Duration = Duration::from_secs(5);
const MAX_ENTRIES: usize = 100_000;
/// After a failed lookup, keys that need Postgres are refused at once for this long.
pub const DOWN_BACKOFF: Duration = Duration::from_secs(1);

type Cache = Arc<Mutex<HashMap<[u8; 32], Entry>>>;

struct Entry {
    principal: Option<Arc<Principal>>,
    fetched: Instant,
}

pub struct Authenticator {
    pool: PgPool,
    ttl: Duration,
    cache: Cache,
    /// Keys being refreshed in the background now.
    refreshing: Arc<Mutex<std::collections::HashSet<[u8; 32]>>>,
    /// Until when lookups of uncached keys are refused without trying Postgres.
    down_until: Arc<Mutex<Option<Instant>>>,
    /// When each key was last used, since the last [`Authenticator::take_used`].
    used: Mutex<HashMap<ApiKeyId, DateTime<Utc>>>,
}

/// The key a request presents, if any.
pub fn presented_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    for name in ["x-api-key", "authorization"] {
        if headers.get_all(name).iter().nth(1).is_some() {
            return Err(ApiError::invalid(format!(
                "the {name} header was sent more than once; send one API key"
            )));
        }
    }
    let x = headers
        .get("x-api-key")
        .map(|v| v.to_str().unwrap_or_default().trim().to_string());
    let bearer = headers.get("authorization").and_then(|v| {
        let s = v.to_str().ok()?.trim();
        s.strip_prefix("Bearer ")
            .or_else(|| s.strip_prefix("bearer "))
            .map(|t| t.trim().to_string())
    });
    match (x, bearer) {
        (Some(a), Some(b)) if a != b => Err(ApiError::invalid(
            "send the API key in either the x-api-key header or the Authorization header, not both",
        )),
        (Some(a), _) => Ok(Some(a)),
        (None, b) => Ok(b),
    }
}

/// Refuse a key that expired or whose tenant is suspended.
fn usable(p: Arc<Principal>, now: DateTime<Utc>) -> Result<Arc<Principal>, ApiError> {
    if let Some(at) = p.key_expires_at
        && at <= now
    {
        return Err(ApiError::new(
            ErrorCode::Authentication,
            format!(
                "this API key expired at {}",
                at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
            ),
        ));
    }
    if p.tenant_suspended {
        return Err(ApiError::new(
            ErrorCode::Permission,
            "this API key's organization is suspended; contact your administrator",
        ));
    }
    Ok(p)
}

impl Authenticator {
    pub fn new(pool: PgPool, ttl: Duration) -> Self {
        Self {
            pool,
            ttl,
            cache: Arc::default(),
            refreshing: Arc::default(),
            down_until: Arc::default(),
            used: Mutex::new(HashMap::new()),
        }
    }

    pub async fn authenticate(&self, headers: &HeaderMap) -> Result<Arc<Principal>, ApiError> {
        let Some(secret) = presented_key(headers)? else {
            return Err(ApiError::new(
                ErrorCode::Authentication,
                "x-api-key header is required",
            ));
        };
        let p = self.resolve(&tenants::hash_secret(&secret)).await?;
        cachet_common::span::record_tenant(p.tenant, Some(p.workspace));
        let now = Utc::now();
        let p = usable(p, now)?;
        self.used
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(p.key_id, now);
        Ok(p)
    }

    async fn resolve(&self, hash: &[u8; 32]) -> Result<Arc<Principal>, ApiError> {
        {
            let cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
            match cache.get(hash) {
                Some(e) if e.principal.is_some() => {
                    if e.fetched.elapsed() >= self.ttl {
                        self.refresh_in_background(*hash);
                        auth_metric("stale");
                    } else {
                        auth_metric("cached");
                    }
                    return e.principal.clone().ok_or_else(invalid_key);
                }
                Some(e) if e.fetched.elapsed() < NEGATIVE_TTL => {
                    auth_metric("cached");
                    return Err(invalid_key());
                }
                _ => {}
            }
        }
        if is_down(&self.down_until) {
            auth_metric("refused_db_down");
            return Err(db_down());
        }
        auth_metric("lookup");
        match lookup(&self.pool, &self.cache, &self.down_until, *hash).await {
            Ok(principal) => principal.ok_or_else(invalid_key),
            Err(e) => {
                tracing::warn!(error = %e, "api key lookup failed: postgres unavailable");
                Err(db_down())
            }
        }
    }

    /// Refresh a stale entry without making anyone wait for it.
    fn refresh_in_background(&self, hash: [u8; 32]) {
        if !self
            .refreshing
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(hash)
        {
            return;
        }
        let (pool, cache, down, refreshing) = (
            self.pool.clone(),
            self.cache.clone(),
            self.down_until.clone(),
            self.refreshing.clone(),
        );
        tokio::spawn(async move {
            if !is_down(&down)
                && let Err(e) = lookup(&pool, &cache, &down, hash).await
            {
                tracing::warn!(error = %e, "postgres unavailable; serving the last known api key state");
            }
            refreshing
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&hash);
        });
    }

    /// Forget every cached key of `tenant` (its keys or policy changed).
    pub fn invalidate_tenant(&self, tenant: TenantId) {
        self.cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|_, e| e.principal.as_ref().is_none_or(|p| p.tenant != tenant));
    }

    /// The keys used since the last call, with when each was last used.
    pub fn take_used(&self) -> Vec<(ApiKeyId, DateTime<Utc>)> {
        std::mem::take(&mut *self.used.lock().unwrap_or_else(|p| p.into_inner()))
            .into_iter()
            .collect()
    }

    /// Tenants with a cached key (those whose budgets this gateway checks).
    pub fn cached_tenants(&self) -> Vec<TenantId> {
        let mut t: Vec<TenantId> = self
            .cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter_map(|e| e.principal.as_ref().map(|p| p.tenant))
            .collect();
        t.sort_unstable();
        t.dedup();
        t
    }
}

/// Look `hash` up in Postgres and cache the answer; a failure marks Postgres down for a while.
async fn lookup(
    pool: &PgPool,
    cache: &Cache,
    down_until: &Mutex<Option<Instant>>,
    hash: [u8; 32],
) -> Result<Option<Arc<Principal>>, sqlx::Error> {
    match tenants::lookup_key(pool, &hash).await {
        Ok(found) => {
            *down_until.lock().unwrap_or_else(|p| p.into_inner()) = None;
            let principal = found.map(Arc::new);
            let mut cache = cache.lock().unwrap_or_else(|p| p.into_inner());
            if cache.len() >= MAX_ENTRIES {
                cache.clear();
            }
            cache.insert(
                hash,
                Entry {
                    principal: principal.clone(),
                    fetched: Instant::now(),
                },
            );
            Ok(principal)
        }
        Err(e) => {
            *down_until.lock().unwrap_or_else(|p| p.into_inner()) =
                Some(Instant::now() + DOWN_BACKOFF);
            Err(e)
        }
    }
}

fn is_down(down_until: &Mutex<Option<Instant>>) -> bool {
    down_until
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .is_some_and(|t| Instant::now() < t)
}

fn auth_metric(result: &str) {
    crate::metrics::AUTH_LOOKUPS
        .with_label_values(&[result])
        .inc();
}

fn db_down() -> ApiError {
    ApiError::new(
        ErrorCode::Unavailable,
        "API keys cannot be checked right now (the key store is unreachable); retry shortly",
    )
    .with_header("retry-after", "1")
}

fn invalid_key() -> ApiError {
    ApiError::new(ErrorCode::Authentication, "invalid x-api-key")
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn one_key_per_request_in_one_header() {
        let mut h = HeaderMap::new();
        h.append("x-api-key", HeaderValue::from_static("sk-a"));
        assert_eq!(presented_key(&h).unwrap().as_deref(), Some("sk-a"));
        h.append("x-api-key", HeaderValue::from_static("sk-b"));
        let e = presented_key(&h).unwrap_err();
        assert_eq!(e.code, ErrorCode::InvalidRequest);
        let mut h = HeaderMap::new();
        h.append("authorization", HeaderValue::from_static("Bearer sk-a"));
        h.append("authorization", HeaderValue::from_static("Bearer sk-a"));
        assert!(presented_key(&h).is_err(), "twice, even the same key");
        let mut h = HeaderMap::new();
        h.append("x-api-key", HeaderValue::from_static("sk-a"));
        h.append("authorization", HeaderValue::from_static("Bearer sk-b"));
        assert!(presented_key(&h).is_err(), "two different keys");
    }
}
