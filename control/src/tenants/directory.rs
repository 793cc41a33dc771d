//! The names of tenants, workspaces and keys, and the workspace of each key, for billing: a
//! ledger row carries ids, and billing (a crate below this one) asks for what its exports,
//! invoices and reports print or split by through [`billing::directory::Directory`], which
//! [`Directory`] implements over this crate's tables.

use std::collections::{BTreeMap, HashMap};

use billing::directory::TenantNames;
use billing::invoice::BillingError;
use futures::future::BoxFuture;
use sqlx::PgPool;
use uuid::Uuid;

use super::tags::Tags;

/// `tenant`'s name and the names of its workspaces and keys (archived, revoked and deleted
/// ones too: old rows still name them).
pub async fn names(pool: &PgPool, tenant: Uuid) -> Result<TenantNames, sqlx::Error> {
    let name: Option<String> = sqlx::query_scalar("SELECT name FROM tenants WHERE id = $1")
        .bind(tenant)
        .fetch_optional(pool)
        .await?;
    let named = |table: &'static str| {
        sqlx::query_as::<_, (Uuid, String)>(sqlx::AssertSqlSafe(format!(
            "SELECT id, name FROM {table} WHERE tenant_id = $1"
        )))
        .bind(tenant)
        .fetch_all(pool)
    };
    let workspaces: HashMap<Uuid, String> = named("workspaces").await?.into_iter().collect();
    let keys: HashMap<Uuid, String> = named("api_keys").await?.into_iter().collect();
    Ok(TenantNames {
        tenant: name,
        workspaces,
        keys,
        key_tags: key_tags(pool, tenant).await?,
    })
}

/// Each of `tenant`'s keys' tags: its workspace's with its own on top (keys with none left
/// out).
pub async fn key_tags(
    pool: &PgPool,
    tenant: Uuid,
) -> Result<HashMap<Uuid, BTreeMap<String, String>>, sqlx::Error> {
    let rows: Vec<(Uuid, serde_json::Value, serde_json::Value)> = sqlx::query_as(
        "SELECT k.id, w.tags, k.tags FROM api_keys k JOIN workspaces w ON w.id = k.workspace_id \
         WHERE k.tenant_id = $1",
    )
    .bind(tenant)
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(k, ws, own)| (k, Tags::from_json(ws).over(&Tags::from_json(own)).0))
        .filter(|(_, t)| !t.is_empty())
        .collect())
}

/// The workspace of each of `tenant`'s keys, `(key, workspace)`: what a usage report split or
/// filtered by workspace needs ([`billing::dashboard::UsageQuery::key_workspaces`]).
pub async fn key_workspaces(pool: &PgPool, tenant: Uuid) -> Result<Vec<(Uuid, Uuid)>, sqlx::Error> {
    sqlx::query_as("SELECT id, workspace_id FROM api_keys WHERE tenant_id = $1")
        .bind(tenant)
        .fetch_all(pool)
        .await
}

/// Billing's directory, read from this crate's tables.
pub struct Directory(pub PgPool);

impl billing::directory::Directory for Directory {
    fn names(&self, tenant: Uuid) -> BoxFuture<'_, Result<TenantNames, BillingError>> {
        Box::pin(async move { Ok(names(&self.0, tenant).await?) })
    }
}
