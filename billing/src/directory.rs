//! The names billing prints beside the ids its rows carry.
//!
//! A ledger row names its tenant, workspace and key by id; exports and invoices print their
//! names too. The tables that hold those names (`tenants`, `workspaces`, `api_keys`) are the
//! control plane's, a crate above this one, so billing never reads them: the control plane
//! hands billing a [`Directory`] when it mounts the finance API, and passes the key → workspace
//! map into the usage reports that split by workspace ([`crate::dashboard::UsageQuery`]).

use std::collections::{BTreeMap, HashMap};

use futures::future::BoxFuture;
use uuid::Uuid;

use crate::invoice::BillingError;

/// The names of one tenant and of its workspaces and keys (archived, revoked and deleted ones
/// too: old rows still name them).
#[derive(Clone, Debug, Default)]
pub struct TenantNames {
    /// `None` where the tenant is unknown.
    pub tenant: Option<String>,
    pub workspaces: HashMap<Uuid, String>,
    pub keys: HashMap<Uuid, String>,
    /// Each key's tags: its workspace's with its own on top (none listed: no tags).
    pub key_tags: HashMap<Uuid, BTreeMap<String, String>>,
}

/// Where billing learns names: implemented by the crate that owns them.
pub trait Directory: Send + Sync + 'static {
    /// `tenant`'s names.
    fn names(&self, tenant: Uuid) -> BoxFuture<'_, Result<TenantNames, BillingError>>;
}
