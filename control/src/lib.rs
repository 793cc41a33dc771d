//! The control plane: tenants, workspaces, API keys, tenant policy, admin users and logins,
//! the audit log, and the admin API (`/v1/admin/…`) with the admin console it serves.
//!
//! - [`tenants`], the Postgres side — tenants and their lifecycle, keys, policy, audit; what
//!   the admin API and the `cachet admin` CLI change, and what the request path's
//!   authentication reads ([`tenants::lookup_key`]);
//! - [`admin`], the admin API's handlers, logins, the usage/budget/cache views, the UI;
//! - [`caches`], the rows behind the cache objects customers hold by id (`/v1/caches`);
//! - [`alerts`], budget thresholds crossed (once a month each), and [`webhooks`], the signed,
//!   retried deliveries that tell the tenant;
//! - [`metrics`], the `cachet_control_*` series.
//!
//! It depends on billing (invoices, usage views) and on admin identity (roles and tokens),
//! never the reverse, and knows nothing of the request path: the change feed that applies
//! its changes to running gateways and nodes lives with them (`gateway::sync`). Its tables
//! are created by the one migrator (`billing::MIGRATOR`, over `migrations/`), so deployed
//! databases see one migration history.

pub mod admin;
pub mod alerts;
pub mod caches;
pub mod metrics;
pub mod release;
pub mod tenants;
pub mod webhooks;
