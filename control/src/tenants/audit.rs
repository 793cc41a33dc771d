//! The audit log: every administrative change, who made it, the object before and after.
//!
//! Rows are written in the same transaction as the change they describe, so a change without
//! its row (or a row without its change) cannot exist. Never a secret: keys appear by id and
//! visible prefix, passwords not at all. The table is append-only (a trigger refuses UPDATE and
//! DELETE), and it is also the change feed that gateways and nodes follow
//! (`gateway::sync`).

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{PgPool, Postgres, Row, Transaction};
use utoipa::ToSchema;
use uuid::Uuid;

use super::AdminError;

/// Who makes a change.
#[derive(Clone, Debug)]
pub struct Actor {
    /// `user:<name>` for an admin console user, `cli:<login>` for the CLI, `jwt:<sub>` for a
    /// service token.
    pub name: String,
    pub role: Option<String>,
    pub request_id: Option<String>,
}

impl Actor {
    /// The CLI run by `login` (a platform administrator with database access).
    pub fn cli(login: &str) -> Self {
        Self {
            name: format!("cli:{login}"),
            role: Some("platform_admin".into()),
            request_id: None,
        }
    }

    /// A customer's API key, acting on its own workspace's objects (cache objects).
    pub fn api_key(key: cachet_common::ApiKeyId, request_id: String) -> Self {
        Self {
            name: format!("key:{}", key.as_uuid()),
            role: Some("api_key".into()),
            request_id: Some(request_id),
        }
    }

    /// The operating-system user running the CLI.
    pub fn cli_user() -> Self {
        Self::cli(&std::env::var("USER").unwrap_or_else(|_| "unknown".into()))
    }
}

/// One audit entry as written.
pub struct Entry<'a> {
    pub tenant: Option<Uuid>,
    pub action: &'a str,
    pub target: Option<String>,
    pub before: Option<serde_json::Value>,
    pub after: Option<serde_json::Value>,
}

impl<'a> Entry<'a> {
    /// An entry about `target` (any object's id) in `tenant`, with nothing before or after;
    /// [`Entry::before`] and [`Entry::after`] add the object's states.
    pub fn new(action: &'a str, tenant: Option<Uuid>, target: impl ToString) -> Self {
        Self {
            tenant,
            action,
            target: Some(target.to_string()),
            before: None,
            after: None,
        }
    }

    /// The object as it was.
    pub fn before(mut self, state: serde_json::Value) -> Self {
        self.before = Some(state);
        self
    }

    /// The object as it is now.
    pub fn after(mut self, state: serde_json::Value) -> Self {
        self.after = Some(state);
        self
    }

    /// Write this entry in `tx` and commit it: the audited change. The change and its row
    /// land together or not at all.
    pub async fn commit(
        self,
        mut tx: Transaction<'_, Postgres>,
        actor: &Actor,
    ) -> Result<i64, AdminError> {
        let id = record(&mut tx, actor, self).await?;
        tx.commit().await?;
        Ok(id)
    }
}

/// Write `entry` in `tx` (the change's own transaction), for a change that writes more after
/// its audit row; [`Entry::commit`] where the row is the last thing written.
pub async fn record(
    tx: &mut Transaction<'_, Postgres>,
    actor: &Actor,
    entry: Entry<'_>,
) -> Result<i64, AdminError> {
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO admin_audit (actor, actor_role, tenant_id, action, target, before, after, request_id) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8) RETURNING id",
    )
    .bind(&actor.name)
    .bind(&actor.role)
    .bind(entry.tenant)
    .bind(entry.action)
    .bind(entry.target)
    .bind(entry.before)
    .bind(entry.after)
    .bind(&actor.request_id)
    .fetch_one(&mut **tx)
    .await?;
    Ok(id)
}

/// Write one entry on its own (events that change nothing else: logins, lockouts).
pub async fn record_alone(
    pool: &PgPool,
    actor: &Actor,
    entry: Entry<'_>,
) -> Result<(), AdminError> {
    entry.commit(pool.begin().await?, actor).await?;
    Ok(())
}

/// An audit row as listed.
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct AuditRow {
    pub id: i64,
    pub at: DateTime<Utc>,
    pub actor: String,
    pub actor_role: Option<String>,
    pub tenant_id: Option<Uuid>,
    pub action: String,
    pub target: Option<String>,
    pub before: Option<serde_json::Value>,
    pub after: Option<serde_json::Value>,
    pub request_id: Option<String>,
    /// The tenant's name (as it is now), when the row is about a tenant.
    pub tenant_name: Option<String>,
    /// The object by name, where it is a tenant (its name), a console user (username), an
    /// API key (name and visible prefix), a workspace or a webhook endpoint (its URL); absent
    /// for other objects.
    pub target_name: Option<String>,
}

fn row(r: &sqlx::postgres::PgRow) -> AuditRow {
    AuditRow {
        id: r.get("id"),
        at: r.get("at"),
        actor: r.get("actor"),
        actor_role: r.get("actor_role"),
        tenant_id: r.get("tenant_id"),
        action: r.get("action"),
        target: r.get("target"),
        before: r.get("before"),
        after: r.get("after"),
        request_id: r.get("request_id"),
        tenant_name: r.get("tenant_name"),
        target_name: r.get("target_name"),
    }
}

/// What to list.
#[derive(Clone, Debug, Default)]
pub struct Filter {
    pub tenant: Option<Uuid>,
    /// Actions starting with this (`key.` lists every key change).
    pub action: Option<String>,
    pub from: Option<DateTime<Utc>>,
    pub to: Option<DateTime<Utc>>,
    /// Rows with a smaller id (the next page of a newest-first listing).
    pub before_id: Option<i64>,
}

/// The row's columns, and its tenant and object by name (looked up by primary key: a target
/// that is a UUID is a tenant, a console user or an API key).
const COLUMNS: &str = "a.id, a.at, a.actor, a.actor_role, a.tenant_id, a.action, a.target, \
    a.before, a.after, a.request_id, \
    (SELECT t.name FROM tenants t WHERE t.id = a.tenant_id) AS tenant_name, \
    COALESCE((SELECT t.name FROM tenants t WHERE t.id = x.uid), \
             (SELECT u.username FROM admin_users u WHERE u.id = x.uid), \
             (SELECT k.name || ' (' || k.visible_prefix || '…)' FROM api_keys k WHERE k.id = x.uid), \
             (SELECT 'workspace ' || w.name FROM workspaces w WHERE w.id = x.uid), \
             (SELECT 'webhook ' || e.url FROM webhook_endpoints e WHERE e.id = x.uid)) \
        AS target_name";

/// `admin_audit a` with `x.uid`, its target as a UUID where it is one.
const FROM: &str = "admin_audit a LEFT JOIN LATERAL (SELECT CASE WHEN a.target ~* \
    '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$' THEN a.target::UUID END AS uid) x ON true";

/// Newest first, at most `limit` rows.
pub async fn list(pool: &PgPool, f: &Filter, limit: i64) -> Result<Vec<AuditRow>, AdminError> {
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM {FROM} \
         WHERE ($1::UUID IS NULL OR a.tenant_id = $1) AND ($2::TEXT IS NULL OR starts_with(a.action, $2)) \
         AND ($3::TIMESTAMPTZ IS NULL OR a.at >= $3) AND ($4::TIMESTAMPTZ IS NULL OR a.at < $4) \
         AND ($5::BIGINT IS NULL OR a.id < $5) ORDER BY a.id DESC LIMIT $6"
    )))
    .bind(f.tenant)
    .bind(&f.action)
    .bind(f.from)
    .bind(f.to)
    .bind(f.before_id)
    .bind(limit.clamp(1, 1000))
    .fetch_all(pool)
    .await?;
    Ok(rows.iter().map(row).collect())
}

/// Oldest first, as a stream (exports of any length at constant memory).
pub fn stream(
    pool: &PgPool,
    f: Filter,
) -> impl futures::Stream<Item = Result<AuditRow, sqlx::Error>> + Send + 'static {
    use futures::StreamExt;
    let pool = pool.clone();
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<AuditRow, sqlx::Error>>(256);
    tokio::spawn(async move {
        let mut rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM {FROM} \
             WHERE ($1::UUID IS NULL OR a.tenant_id = $1) AND ($2::TEXT IS NULL OR starts_with(a.action, $2)) \
             AND ($3::TIMESTAMPTZ IS NULL OR a.at >= $3) AND ($4::TIMESTAMPTZ IS NULL OR a.at < $4) \
             ORDER BY a.id"
        )))
        .bind(f.tenant)
        .bind(f.action)
        .bind(f.from)
        .bind(f.to)
        .fetch(&pool);
        while let Some(r) = rows.next().await {
            let failed = r.is_err();
            if tx.send(r.map(|r| row(&r))).await.is_err() || failed {
                return;
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}
/// One change as the change feed reads it: every process applies the audit log's new rows
/// to what it holds (cached keys, the fabric's policy, purges, released objects).
#[derive(Debug, Clone)]
pub struct FeedRow {
    pub id: i64,
    pub at: DateTime<Utc>,
    pub tenant: Option<Uuid>,
    pub action: String,
    pub target: Option<String>,
}

/// The feed's end: the highest id written so far (0 on an empty log).
pub async fn feed_end(pool: &PgPool) -> Result<i64, AdminError> {
    Ok(
        sqlx::query_scalar("SELECT COALESCE(max(id), 0) FROM admin_audit")
            .fetch_one(pool)
            .await?,
    )
}

/// The ids in `(after, upto]` already written.
pub async fn feed_ids(pool: &PgPool, after: i64, upto: i64) -> Result<Vec<i64>, AdminError> {
    Ok(
        sqlx::query_scalar("SELECT id FROM admin_audit WHERE id > $1 AND id <= $2")
            .bind(after)
            .bind(upto)
            .fetch_all(pool)
            .await?,
    )
}

/// Every row after `after`, in id order.
pub async fn feed_after(pool: &PgPool, after: i64) -> Result<Vec<FeedRow>, AdminError> {
    let rows = sqlx::query(
        "SELECT id, at, tenant_id, action, target FROM admin_audit WHERE id > $1 ORDER BY id",
    )
    .bind(after)
    .fetch_all(pool)
    .await?;
    Ok(rows
        .iter()
        .map(|r| FeedRow {
            id: r.get("id"),
            at: r.get("at"),
            tenant: r.get("tenant_id"),
            action: r.get("action"),
            target: r.get("target"),
        })
        .collect())
}

/// For each tenant, the last time within `within` that `action` was taken on it.
pub async fn last_taken(
    pool: &PgPool,
    action: &str,
    within: chrono::TimeDelta,
) -> Result<Vec<(Uuid, DateTime<Utc>)>, AdminError> {
    let rows = sqlx::query(
        "SELECT tenant_id, max(at) AS at FROM admin_audit WHERE action = $1 \
         AND tenant_id IS NOT NULL AND at > now() - $2 * interval '1 second' GROUP BY tenant_id",
    )
    .bind(action)
    .bind(within.num_seconds() as f64)
    .fetch_all(pool)
    .await?;
    Ok(rows
        .iter()
        .map(|r| (r.get("tenant_id"), r.get("at")))
        .collect())
}
