//! API key authentication with a short-lived in-memory cache.
//!
//! Keys come in `x-api-key` or `Authorization: Bearer`. A resolved key is cached for `ttl`;
//! an unknown key is cached as unknown for a few seconds so a flood of bad keys does not reach
//! Postgres. Administrative changes (a revoked or rotated key, a suspended tenant, new limits)
//! do not wait for the cache: the change feed ([`crate::admin::sync`]) drops the entries they
//! touch within about a second. If Postgres cannot be reached, a cached (even expired)
//! principal keeps working: an outage should not log customers out.
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

use crate::error::{ApiError, ErrorKind};
use crate::tenants::{self, Principal};

const NEGATIVE_TTL: Duration = Duration::from_secs(5);
const MAX_ENTRIES: usize = 100_000;

struct Entry {
    principal: Option<Arc<Principal>>,
    fetched: Instant,
}

pub struct Authenticator {
    pool: PgPool,
    ttl: Duration,
    cache: Mutex<HashMap<[u8; 32], Entry>>,
    /// When each key was last used, since the last [`Authenticator::take_used`].
    used: Mutex<HashMap<ApiKeyId, DateTime<Utc>>>,
}

/// The key a request presents, if any.
pub fn presented_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
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
            ErrorKind::Authentication,
            format!(
                "this API key expired at {}",
                at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
            ),
        ));
    }
    if p.tenant_suspended {
        return Err(ApiError::new(
            ErrorKind::Permission,
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
            cache: Mutex::new(HashMap::new()),
            used: Mutex::new(HashMap::new()),
        }
    }

    pub async fn authenticate(&self, headers: &HeaderMap) -> Result<Arc<Principal>, ApiError> {
        let Some(secret) = presented_key(headers)? else {
            return Err(ApiError::new(
                ErrorKind::Authentication,
                "x-api-key header is required",
            ));
        };
        let p = self.resolve(&tenants::hash_secret(&secret)).await?;
        let now = Utc::now();
        let p = usable(p, now)?;
        self.used
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(p.key_id, now);
        Ok(p)
    }

    async fn resolve(&self, hash: &[u8; 32]) -> Result<Arc<Principal>, ApiError> {
        let stale = {
            let cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
            match cache.get(hash) {
                Some(e) => {
                    let fresh_for = if e.principal.is_some() {
                        self.ttl
                    } else {
                        NEGATIVE_TTL
                    };
                    if e.fetched.elapsed() < fresh_for {
                        return e.principal.clone().ok_or_else(invalid_key);
                    }
                    e.principal.clone()
                }
                None => None,
            }
        };
        match tenants::lookup_key(&self.pool, hash).await {
            Ok(found) => {
                let principal = found.map(Arc::new);
                let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
                if cache.len() >= MAX_ENTRIES {
                    cache.clear();
                }
                cache.insert(
                    *hash,
                    Entry {
                        principal: principal.clone(),
                        fetched: Instant::now(),
                    },
                );
                principal.ok_or_else(invalid_key)
            }
            Err(e) => match stale {
                Some(p) => {
                    tracing::warn!(error = %e, "postgres unavailable; using cached api key");
                    Ok(p)
                }
                None => Err(ApiError::internal("api key lookup failed", e)),
            },
        }
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

fn invalid_key() -> ApiError {
    ApiError::new(ErrorKind::Authentication, "invalid x-api-key")
}
