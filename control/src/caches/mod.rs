//! Cache objects: the rows behind prefixes customers hold by id (`POST /v1/caches`).
//!
//! A row is what the API lists and what a request naming the object renders: the model, the
//! content as validated (tools, system, messages; markers removed), the prompt tokens up to
//! its end, its expiry. The KV lives in the cache fabric as a paid entry held until
//! `expires_at`; the gateway computes it (`gateway::api::caches`). Every read here is scoped:
//! an object of another tenant or workspace is "not found", never "forbidden", so ids leak
//! nothing. An object past its expiry, or deleted, is not found either.

pub mod meter;

use std::collections::HashMap;
use std::time::Duration;

use cache_fabric::Released;
use cachet_common::{ApiKeyId, BlockHash, Scope, TenantId, WorkspaceId};
use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::{Map, Value, json};
use sqlx::{PgPool, Row};
use utoipa::ToSchema;

use crate::tenants::{Actor, AdminError, audit};

/// Whose objects a call reaches: a key's workspace (the API), or a tenant's, in every
/// workspace or one (the admin API).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Owner {
    Workspace(Scope),
    Tenant(TenantId, Option<WorkspaceId>),
}

impl Owner {
    fn tenant(self) -> uuid::Uuid {
        match self {
            Owner::Workspace(s) => s.tenant.as_uuid(),
            Owner::Tenant(t, _) => t.as_uuid(),
        }
    }

    fn workspace(self) -> Option<uuid::Uuid> {
        match self {
            Owner::Workspace(s) => Some(s.workspace.as_uuid()),
            Owner::Tenant(_, w) => w.map(|w| w.as_uuid()),
        }
    }
}

impl From<Scope> for Owner {
    fn from(s: Scope) -> Self {
        Owner::Workspace(s)
    }
}

/// Rows of `o` (`$2` the tenant, `$3` the workspace or null), live ones.
const OWNED_LIVE: &str = "o.tenant_id = $2 AND ($3::UUID IS NULL OR o.workspace_id = $3) \
    AND o.deleted_at IS NULL AND o.expires_at > now()";

/// The prefix of every object id.
pub const ID_PREFIX: &str = "cache_";
/// Random base62 characters after the prefix.
const ID_CHARS: usize = 24;

impl CacheObject {
    pub fn scope(&self) -> Scope {
        Scope {
            tenant: self.tenant,
            workspace: self.workspace,
        }
    }
}

/// A fresh object id: `cache_` and 24 random base62 characters (about 143 bits).
pub fn new_id() -> Result<String, AdminError> {
    crate::tenants::keys::random_id(ID_PREFIX, ID_CHARS)
}

/// Whether `id` has the shape of an object id (anything else is not found without a query).
pub fn is_object_id(id: &str) -> bool {
    id.strip_prefix(ID_PREFIX)
        .is_some_and(|r| r.len() == ID_CHARS && r.bytes().all(|b| b.is_ascii_alphanumeric()))
}

/// The shortest time an object is held.
pub const MIN_TTL: Duration = Duration::from_secs(300);

/// How long an object is held, as asked.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Lifetime {
    Ttl(Duration),
    Until(DateTime<Utc>),
}

impl Lifetime {
    /// From a body's `ttl` or `expires_at` (one of them at most; `default` without either).
    pub fn from_body(
        top: &Map<String, Value>,
        default: Option<Duration>,
    ) -> Result<Self, AdminError> {
        let get = |k: &str| top.get(k).filter(|v| !v.is_null());
        match (get("ttl"), get("expires_at")) {
            (Some(_), Some(_)) => Err(AdminError::Invalid("ttl, expires_at: give one of them, not both".into())),
            (Some(t), None) => parse_ttl(t).map(Lifetime::Ttl),
            (None, Some(e)) => e
                .as_str()
                .and_then(|s| DateTime::parse_from_rfc3339(s).ok())
                .map(|t| Lifetime::Until(t.with_timezone(&Utc)))
                .ok_or_else(|| {
                    AdminError::Invalid("expires_at: must be a date and time in RFC 3339, such as 2026-12-01T00:00:00Z".into())
                }),
            (None, None) => default
                .map(Lifetime::Ttl)
                .ok_or_else(|| AdminError::Invalid("ttl: give a new ttl or expires_at".into())),
        }
    }

    /// The expiry, from `now`, within 5 minutes and `max`.
    pub fn expires_at(
        self,
        now: DateTime<Utc>,
        max: Duration,
    ) -> Result<DateTime<Utc>, AdminError> {
        let (field, at) = match self {
            Lifetime::Ttl(d) => (
                "ttl",
                chrono::Duration::from_std(d)
                    .ok()
                    .and_then(|d| now.checked_add_signed(d))
                    // Past any maximum: refused below.
                    .unwrap_or(DateTime::<Utc>::MAX_UTC),
            ),
            Lifetime::Until(t) => ("expires_at", t),
        };
        let held = (at - now).to_std().unwrap_or(Duration::ZERO);
        if held < MIN_TTL {
            return Err(AdminError::Invalid(format!(
                "{field}: a cache object is held for at least 5 minutes (300s)"
            )));
        }
        if held > max + Duration::from_secs(1) {
            return Err(AdminError::Invalid(format!(
                "{field}: a cache object is held for at most {}s, this organization's maximum (its policy's max_cache_ttl_secs)",
                max.as_secs()
            )));
        }
        Ok(at)
    }
}

/// `"300s"`, `"2.5s"`, `"30m"`, `"24h"`, `"7d"`, or a whole number of seconds.
pub fn parse_ttl(v: &Value) -> Result<Duration, AdminError> {
    let bad = || {
        AdminError::Invalid(
            "ttl: must be a duration such as \"300s\", \"30m\", \"24h\" or \"7d\", or a whole number of seconds"
                .into(),
        )
    };
    if let Some(n) = v.as_u64() {
        return Ok(Duration::from_secs(n));
    }
    let s = v.as_str().ok_or_else(bad)?.trim();
    let unit = match s.chars().last() {
        Some('s') => 1.0,
        Some('m') => 60.0,
        Some('h') => 3600.0,
        Some('d') => 86_400.0,
        _ => return Err(bad()),
    };
    let n = &s[..s.len() - 1];
    if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return Err(bad());
    }
    let n: f64 = n.parse().map_err(|_| bad())?;
    let secs = n * unit;
    if !secs.is_finite() || secs > 1e10 {
        return Err(bad());
    }
    Ok(Duration::from_secs_f64(secs))
}

/// A live cache object.
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct CacheObject {
    pub id: String,
    /// Always `cache_object`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub model: String,
    pub display_name: Option<String>,
    /// Prompt tokens up to the object's end: what a request naming it reads from the cache.
    pub input_tokens: i64,
    pub created_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    #[serde(skip)]
    pub tenant: TenantId,
    #[serde(skip)]
    pub workspace: WorkspaceId,
    #[serde(skip)]
    pub workspace_name: String,
    /// `{"tools": …, "system": …, "messages": …}` as validated (absent parts omitted); `null`
    /// in a [`list`], which never reads it (an object's content can be megabytes).
    #[serde(skip)]
    pub content: Value,
    /// The hashes of its blocks (empty in a [`list`], and for objects made before they were
    /// kept).
    #[serde(skip)]
    pub blocks: Vec<BlockHash>,
}

/// An object's columns, its content included (one object: get, extend, delete).
const COLUMNS: &str = "o.id, o.tenant_id, o.workspace_id, o.model, o.content, o.input_tokens, \
    o.display_name, o.created_at, o.expires_at, o.block_hashes, \
    (SELECT w.name FROM workspaces w WHERE w.id = o.workspace_id) AS workspace_name";
/// The same without the content (lists).
const LISTED: &str = "o.id, o.tenant_id, o.workspace_id, o.model, NULL::JSONB AS content, \
    o.input_tokens, o.display_name, o.created_at, o.expires_at, NULL::BYTEA AS block_hashes, \
    (SELECT w.name FROM workspaces w WHERE w.id = o.workspace_id) AS workspace_name";

fn from_row(r: &sqlx::postgres::PgRow) -> CacheObject {
    CacheObject {
        id: r.get("id"),
        kind: "cache_object",
        model: r.get("model"),
        display_name: r.get("display_name"),
        input_tokens: r.get("input_tokens"),
        created_at: r.get("created_at"),
        expires_at: r.get("expires_at"),
        tenant: TenantId(r.get("tenant_id")),
        workspace: WorkspaceId(r.get("workspace_id")),
        workspace_name: r
            .get::<Option<String>, _>("workspace_name")
            .unwrap_or_default(),
        content: r.get::<Option<Value>, _>("content").unwrap_or(Value::Null),
        blocks: r
            .get::<Option<Vec<u8>>, _>("block_hashes")
            .map(|b| hashes_from_bytes(&b))
            .unwrap_or_default(),
    }
}

/// An object about to be stored (its KV is already held by the fabric).
pub struct NewObject<'a> {
    pub id: &'a str,
    pub scope: Scope,
    pub key: ApiKeyId,
    pub model: &'a str,
    pub content: &'a Value,
    pub input_tokens: i64,
    pub display_name: Option<&'a str>,
    pub request_id: uuid::Uuid,
    pub created_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    /// The hashes of its prefix's blocks, in chain order (the tail of a partial last block
    /// included): what a deletion releases on every node.
    pub blocks: &'a [BlockHash],
}

fn hashes_to_bytes(blocks: &[BlockHash]) -> Option<Vec<u8>> {
    (!blocks.is_empty()).then(|| blocks.iter().flat_map(|h| h.0).collect())
}

fn hashes_from_bytes(b: &[u8]) -> Vec<BlockHash> {
    b.chunks_exact(32)
        .map(|c| BlockHash(c.try_into().expect("32-byte chunks")))
        .collect()
}

/// Store a new object.
pub async fn insert(pool: &PgPool, o: NewObject<'_>) -> Result<CacheObject, AdminError> {
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO cache_objects AS o (id, tenant_id, workspace_id, api_key_id, model, content, \
         input_tokens, display_name, request_id, created_at, expires_at, block_hashes) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12) RETURNING {COLUMNS}"
    )))
    .bind(o.id)
    .bind(o.scope.tenant.as_uuid())
    .bind(o.scope.workspace.as_uuid())
    .bind(o.key.as_uuid())
    .bind(o.model)
    .bind(o.content)
    .bind(o.input_tokens)
    .bind(o.display_name)
    .bind(o.request_id)
    .bind(o.created_at)
    .bind(o.expires_at)
    .bind(hashes_to_bytes(o.blocks))
    .fetch_one(pool)
    .await?;
    Ok(from_row(&row))
}

fn not_found(id: &str) -> AdminError {
    AdminError::NotFound(format!("cache object {id}"))
}

/// An id that cannot name an object names none: 404, as for an unknown one.
fn well_formed(id: &str) -> Result<(), AdminError> {
    if is_object_id(id) {
        Ok(())
    } else {
        Err(not_found(id))
    }
}

/// The live object `id` of `owner`.
pub async fn get(
    pool: &PgPool,
    owner: impl Into<Owner>,
    id: &str,
) -> Result<CacheObject, AdminError> {
    let owner = owner.into();
    well_formed(id)?;
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM cache_objects o WHERE o.id = $1 AND {OWNED_LIVE}"
    )))
    .bind(id)
    .bind(owner.tenant())
    .bind(owner.workspace())
    .fetch_optional(pool)
    .await?;
    row.map(|r| from_row(&r)).ok_or_else(|| not_found(id))
}

/// Which page of a list: newest first, `limit` objects after (older than) `after_id` or
/// before (newer than) `before_id`, as Anthropic's list endpoints page.
#[derive(Clone, Debug, Default)]
pub struct Page {
    pub before_id: Option<String>,
    pub after_id: Option<String>,
    pub limit: i64,
}

/// One page of a list.
pub struct Listed {
    pub data: Vec<CacheObject>,
    pub has_more: bool,
}

/// The live objects of `owner`, newest first.
pub async fn list(
    pool: &PgPool,
    owner: impl Into<Owner>,
    page: &Page,
) -> Result<Listed, AdminError> {
    let owner = owner.into();
    let (cursor, newer) = match (&page.before_id, &page.after_id) {
        (Some(_), Some(_)) => {
            return Err(AdminError::Invalid(
                "before_id, after_id: give one of them, not both".into(),
            ));
        }
        (Some(b), None) => (Some(b.as_str()), true),
        (None, Some(a)) => (Some(a.as_str()), false),
        (None, None) => (None, false),
    };
    let anchor: Option<(DateTime<Utc>, String)> = match cursor {
        None => None,
        Some(id) => {
            // A cursor may have expired or been deleted since the last page: page from where
            // it stood.
            let at: Option<DateTime<Utc>> = sqlx::query_scalar(
                "SELECT created_at FROM cache_objects o WHERE o.id = $1 AND o.tenant_id = $2 \
                 AND ($3::UUID IS NULL OR o.workspace_id = $3)",
            )
            .bind(id)
            .bind(owner.tenant())
            .bind(owner.workspace())
            .fetch_optional(pool)
            .await?;
            let at = at.ok_or_else(|| {
                AdminError::Invalid(format!(
                    "{}: no cache object {id}",
                    if newer { "before_id" } else { "after_id" }
                ))
            })?;
            Some((at, id.to_string()))
        }
    };
    let limit = page.limit.clamp(1, 1000);
    // Older pages walk down the (created_at, id) order; newer ones walk up and are reversed.
    let (cmp, order) = if newer {
        ("(o.created_at, o.id) > ($5, $6)", "ASC")
    } else {
        ("(o.created_at, o.id) < ($5, $6)", "DESC")
    };
    let cond = if anchor.is_some() { cmp } else { "TRUE" };
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {LISTED} FROM cache_objects o WHERE $1::BOOL AND {OWNED_LIVE} AND {cond} \
         ORDER BY o.created_at {order}, o.id {order} LIMIT $4"
    )))
    .bind(true)
    .bind(owner.tenant())
    .bind(owner.workspace())
    .bind(limit + 1)
    .bind(anchor.as_ref().map(|a| a.0))
    .bind(anchor.as_ref().map(|a| a.1.clone()))
    .fetch_all(pool)
    .await?;
    let mut data: Vec<CacheObject> = rows.iter().map(from_row).collect();
    let has_more = data.len() as i64 > limit;
    data.truncate(limit as usize);
    if newer {
        data.reverse();
    }
    Ok(Listed { data, has_more })
}

/// Move the expiry of the live object `id` of `owner` to `expires_at`.
pub async fn set_expiry(
    pool: &PgPool,
    owner: impl Into<Owner>,
    id: &str,
    expires_at: DateTime<Utc>,
) -> Result<CacheObject, AdminError> {
    let owner = owner.into();
    well_formed(id)?;
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE cache_objects o SET expires_at = $4 WHERE o.id = $1 AND {OWNED_LIVE} \
         RETURNING {COLUMNS}"
    )))
    .bind(id)
    .bind(owner.tenant())
    .bind(owner.workspace())
    .bind(expires_at)
    .fetch_optional(pool)
    .await?;
    row.map(|r| from_row(&r)).ok_or_else(|| not_found(id))
}

/// Delete the live object `id` of `owner`, with an audit entry ([`DELETE_ACTION`]): every
/// process then releases its blocks (the row, with its block hashes, is the tombstone).
pub async fn delete(
    pool: &PgPool,
    actor: &Actor,
    owner: impl Into<Owner>,
    id: &str,
) -> Result<CacheObject, AdminError> {
    let owner = owner.into();
    well_formed(id)?;
    let mut tx = pool.begin().await?;
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE cache_objects o SET deleted_at = now() WHERE o.id = $1 AND {OWNED_LIVE} \
         RETURNING {COLUMNS}"
    )))
    .bind(id)
    .bind(owner.tenant())
    .bind(owner.workspace())
    .fetch_optional(&mut *tx)
    .await?;
    let o = row.map(|r| from_row(&r)).ok_or_else(|| not_found(id))?;
    let was = json!({
        "id": o.id, "model": o.model, "workspace_id": o.workspace.as_uuid(),
        "input_tokens": o.input_tokens, "expires_at": o.expires_at,
    });
    let entry = audit::Entry::new(DELETE_ACTION, Some(owner.tenant()), o.id.clone()).before(was);
    entry.commit(tx, actor).await?;
    Ok(o)
}

/// The audit action of an object's deletion: every process releases the object's blocks
/// from its node when it sees it (`gateway::release`).
pub const DELETE_ACTION: &str = "cache_object.delete";

/// A deleted object whose blocks may still be held: what a node releases.
#[derive(Clone, Debug)]
pub struct Deleted {
    pub id: String,
    pub scope: Scope,
    pub model: String,
    pub blocks: Vec<BlockHash>,
    pub expires_at: DateTime<Utc>,
}

const DELETED_COLUMNS: &str =
    "id, tenant_id, workspace_id, model, block_hashes, expires_at FROM cache_objects";

fn deleted_from_row(r: &sqlx::postgres::PgRow) -> Deleted {
    Deleted {
        id: r.get("id"),
        scope: Scope {
            tenant: TenantId(r.get("tenant_id")),
            workspace: WorkspaceId(r.get("workspace_id")),
        },
        model: r.get("model"),
        blocks: hashes_from_bytes(&r.get::<Vec<u8>, _>("block_hashes")),
        expires_at: r.get("expires_at"),
    }
}

/// The objects among `ids` that are deleted, not yet expired, and know their blocks.
pub async fn deleted(pool: &PgPool, ids: &[String]) -> Result<Vec<Deleted>, AdminError> {
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {DELETED_COLUMNS} WHERE id = ANY($1) AND deleted_at IS NOT NULL \
         AND expires_at > now() AND block_hashes IS NOT NULL"
    )))
    .bind(ids)
    .fetch_all(pool)
    .await?;
    Ok(rows.iter().map(deleted_from_row).collect())
}

/// Every deleted object not yet expired that knows its blocks: the tombstones a node that
/// was down applies at start (its disk tier may have kept their blocks).
pub async fn deleted_unexpired(pool: &PgPool) -> Result<Vec<Deleted>, AdminError> {
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {DELETED_COLUMNS} WHERE deleted_at IS NOT NULL AND expires_at > now() \
         AND block_hashes IS NOT NULL ORDER BY deleted_at"
    )))
    .fetch_all(pool)
    .await?;
    Ok(rows.iter().map(deleted_from_row).collect())
}

/// Until when the other live objects of `d`'s scope and model hold each of `d`'s blocks
/// (blocks none holds are absent). An object made before objects kept their blocks'
/// hashes is taken to hold them all.
pub async fn held_by_others(
    pool: &PgPool,
    d: &Deleted,
) -> Result<HashMap<BlockHash, DateTime<Utc>>, AdminError> {
    let rows = sqlx::query(
        "SELECT block_hashes, expires_at FROM cache_objects WHERE tenant_id = $1 \
         AND workspace_id = $2 AND model = $3 AND id <> $4 AND deleted_at IS NULL \
         AND expires_at > now()",
    )
    .bind(d.scope.tenant.as_uuid())
    .bind(d.scope.workspace.as_uuid())
    .bind(&d.model)
    .bind(&d.id)
    .fetch_all(pool)
    .await?;
    let mine: std::collections::HashSet<BlockHash> = d.blocks.iter().copied().collect();
    let mut held: HashMap<BlockHash, DateTime<Utc>> = HashMap::new();
    for r in rows {
        let until: DateTime<Utc> = r.get("expires_at");
        let theirs = match r.get::<Option<Vec<u8>>, _>("block_hashes") {
            Some(b) => hashes_from_bytes(&b),
            None => d.blocks.clone(),
        };
        for h in theirs.into_iter().filter(|h| mine.contains(h)) {
            let e = held.entry(h).or_insert(until);
            *e = (*e).max(until);
        }
    }
    Ok(held)
}

fn as_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// Record that `node` released object `id` (a second release adds what it freed then).
pub async fn record_release(
    pool: &PgPool,
    id: &str,
    node: &str,
    r: Released,
) -> Result<(), AdminError> {
    sqlx::query(
        "INSERT INTO cache_object_releases (object_id, node, blocks_freed, bytes_freed, \
         blocks_held, bytes_held) VALUES ($1, $2, $3, $4, $5, $6) \
         ON CONFLICT (object_id, node) DO UPDATE SET \
         blocks_freed = cache_object_releases.blocks_freed + EXCLUDED.blocks_freed, \
         bytes_freed = cache_object_releases.bytes_freed + EXCLUDED.bytes_freed, \
         blocks_held = EXCLUDED.blocks_held, bytes_held = EXCLUDED.bytes_held, \
         released_at = now()",
    )
    .bind(id)
    .bind(node)
    .bind(as_i64(r.blocks_freed))
    .bind(as_i64(r.bytes_freed))
    .bind(as_i64(r.blocks_held))
    .bind(as_i64(r.bytes_held))
    .execute(pool)
    .await?;
    Ok(())
}

/// The nodes that released object `id` so far, with what each did.
pub async fn releases(pool: &PgPool, id: &str) -> Result<Vec<(String, Released)>, AdminError> {
    let rows = sqlx::query(
        "SELECT node, blocks_freed, bytes_freed, blocks_held, bytes_held \
         FROM cache_object_releases WHERE object_id = $1 ORDER BY node",
    )
    .bind(id)
    .fetch_all(pool)
    .await?;
    let n = |r: &sqlx::postgres::PgRow, c: &str| r.get::<i64, _>(c).max(0) as u64;
    Ok(rows
        .iter()
        .map(|r| {
            (
                r.get("node"),
                Released {
                    blocks_freed: n(r, "blocks_freed"),
                    bytes_freed: n(r, "bytes_freed"),
                    blocks_held: n(r, "blocks_held"),
                    bytes_held: n(r, "bytes_held"),
                },
            )
        })
        .collect())
}

/// The audit action of a purge: every process of the cluster drops the tenant's blocks from
/// each tier when it sees it (`gateway::sync`).
pub const PURGE_ACTION: &str = "cache.purge";

/// Purge `tenant`'s whole cache without deleting the tenant: its live objects are deleted
/// and an audit entry ([`PURGE_ACTION`]) tells every process to drop its blocks. Returns the
/// number of objects deleted.
pub async fn purge(pool: &PgPool, actor: &Actor, tenant: TenantId) -> Result<u64, AdminError> {
    crate::tenants::ensure_tenant(pool, tenant).await?;
    let mut tx = pool.begin().await?;
    let deleted = sqlx::query(
        "UPDATE cache_objects SET deleted_at = now() WHERE tenant_id = $1 \
         AND deleted_at IS NULL AND expires_at > now()",
    )
    .bind(tenant.as_uuid())
    .execute(&mut *tx)
    .await?
    .rows_affected();
    audit::Entry::new(PURGE_ACTION, Some(tenant.as_uuid()), tenant.as_uuid())
        .after(json!({"cache_objects_deleted": deleted}))
        .commit(tx, actor)
        .await?;
    Ok(deleted)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttls_read_as_durations_or_seconds() {
        for (v, secs) in [
            (json!("300s"), 300.0),
            (json!("2.5s"), 2.5),
            (json!("30m"), 1800.0),
            (json!("24h"), 86_400.0),
            (json!("7d"), 604_800.0),
            (json!(600), 600.0),
        ] {
            assert_eq!(parse_ttl(&v).unwrap().as_secs_f64(), secs, "{v}");
        }
        for v in [
            json!("5"),
            json!("h"),
            json!("-5m"),
            json!("1e9d"),
            json!(-3),
            json!(true),
            json!("5 m"),
        ] {
            assert!(parse_ttl(&v).is_err(), "{v}");
        }
    }

    #[test]
    fn lifetimes_stay_between_five_minutes_and_the_tenants_maximum() {
        let now = Utc::now();
        let day = Duration::from_secs(86_400);
        assert!(
            Lifetime::Ttl(Duration::from_secs(299))
                .expires_at(now, day)
                .is_err()
        );
        assert!(
            Lifetime::Ttl(Duration::from_secs(300))
                .expires_at(now, day)
                .is_ok()
        );
        assert!(Lifetime::Ttl(day).expires_at(now, day).is_ok());
        let e = Lifetime::Ttl(day * 2).expires_at(now, day).unwrap_err();
        assert!(
            Lifetime::Ttl(Duration::from_secs(u64::MAX))
                .expires_at(now, day)
                .is_err()
        );
        assert!(e.to_string().contains("max_cache_ttl_secs"), "{e}");
        let past = now - chrono::Duration::minutes(1);
        assert!(Lifetime::Until(past).expires_at(now, day).is_err());
        let e = Lifetime::from_body(
            json!({"ttl": "1h", "expires_at": "2030-01-01T00:00:00Z"})
                .as_object()
                .unwrap(),
            None,
        )
        .unwrap_err();
        assert!(e.to_string().starts_with("ttl, expires_at"), "{e}");
    }

    #[test]
    fn ids_are_prefixed_base62_and_checked_by_shape() {
        let a = new_id().unwrap();
        let b = new_id().unwrap();
        assert_ne!(a, b);
        assert!(is_object_id(&a), "{a}");
        assert_eq!(a.len(), ID_PREFIX.len() + ID_CHARS);
        for bad in [
            "",
            "cache_",
            "cache_short",
            "msg_0123456789abcdefghijklmn",
            "cache_0123456789abcdefghijklm!",
            "cache_0123456789abcdefghijklmno",
        ] {
            assert!(!is_object_id(bad), "{bad}");
        }
    }
}
