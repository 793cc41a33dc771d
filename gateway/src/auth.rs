//! API key authentication with a short-lived in-memory cache.
//!
//! Keys come in `x-api-key` or `Authorization: Bearer`. A resolved key is cached for
//! `ttl` (revocation takes effect within it); an unknown key is cached as unknown for a few
//! seconds so a flood of bad keys does not reach Postgres. If Postgres cannot be reached, a
//! cached (even expired) principal keeps working: an outage should not log customers out.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use cache_fabric::FabricClient;
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
    /// Where tenants' cache quotas are applied (none for a routing-only gateway).
    fabric: Option<FabricClient>,
    ttl: Duration,
    cache: Mutex<HashMap<[u8; 32], Entry>>,
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

impl Authenticator {
    pub fn new(pool: PgPool, fabric: Option<FabricClient>, ttl: Duration) -> Self {
        Self {
            pool,
            fabric,
            ttl,
            cache: Mutex::new(HashMap::new()),
        }
    }

    pub async fn authenticate(&self, headers: &HeaderMap) -> Result<Arc<Principal>, ApiError> {
        let Some(secret) = presented_key(headers)? else {
            return Err(ApiError::new(
                ErrorKind::Authentication,
                "x-api-key header is required",
            ));
        };
        let hash = tenants::hash_secret(&secret);
        let stale = {
            let cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
            match cache.get(&hash) {
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
        match tenants::lookup_key(&self.pool, &hash).await {
            Ok(found) => {
                let principal = found.map(Arc::new);
                if let Some(p) = &principal {
                    let q = p.quotas.cache_resident_bytes.map(|b| b.max(0) as u64);
                    if let Some(f) = &self.fabric {
                        f.set_tenant_quota(p.tenant, q).await;
                        let reserved = p.cache_reserved_bytes.map(|b| b.max(0) as u64);
                        f.set_tenant_reservation(p.tenant, reserved).await;
                    }
                }
                let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
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
}

fn invalid_key() -> ApiError {
    ApiError::new(ErrorKind::Authentication, "invalid x-api-key")
}
