//! Billing: the usage ledger and everything that reads it.
//!
//! What it exposes:
//! - [`migrate`]: applies the Postgres schema in `migrations/` (the ledger is this crate's
//!   reason to exist, so the schema lives with it).
//! - [`Meter`] / [`MeterHandle`]: the meter. Every finished request hands one
//!   [`UsageEvent`] to the handle; a background task group-commits batches into
//!   `usage_events` with `ON CONFLICT DO NOTHING` on the request id, and appends batches to a
//!   local spool file while Postgres is unreachable, replaying it when Postgres returns.
//!
//! - [`database`]: the database's identity, and the meter's directory marked with it: files
//!   of another database are kept aside, never replayed here (decision 0030).
//!
//! - [`event`]: the usage event and its JSON Lines form in every local file of events (below
//!   the meter, its journal and its open-stream intents, which all read it).
//!
//! - [`money`]: exact amounts and the one rounding rule; [`prices`]: the versioned price
//!   book, tenant custom rates and plans; [`invoice`]: rating the ledger into monthly
//!   invoices (draft, finalized, adjustments); [`rollup`]: hourly/daily rollups and the
//!   reconciliation of ledger, rollups and invoices (decision 0010); [`storage`]: the hourly
//!   ledger of cache objects held (`cache_storage_events`, billed per token-hour; the
//!   control plane meters its objects into it).
//!
//! - [`dashboard`]: usage, cost and savings by cache over time from the rollups, and a
//!   tenant's spend this month (the admin console and budget checks).
//!
//! - [`directory`]: the names of tenants, workspaces and keys, asked of the control plane
//!   (which owns them) through a trait it implements.
//!
//! - [`synthetic`]: synthetic ledgers and raw ledger reads for the benchmarks.
//!
//! - [`csv`]: the one CSV field rule every export uses; [`pdf`]: an invoice as a PDF to send;
//!   [`rounding`]: the one rounding rule of every invoice document (exact lines, a rounding
//!   line, the total rounded once).
//!
//! - [`api`]: the finance API (`/v1/billing/…`, JWT roles), served by `cachet serve` with
//!   the gateway's routes; usage, invoices, prices, streamed exports.
//!
//! What it is not: it does not compute usage (the gateway does).

pub mod api;
pub mod csv;
pub mod dashboard;
pub mod database;
pub mod directory;
pub mod event;
pub mod export;
pub mod focus;
mod intents;
pub mod invoice;
pub mod journal;
pub mod meter;
pub mod metrics;
pub mod money;
pub mod pdf;
pub mod prices;
pub mod rollup;
pub mod rounding;
pub mod storage;
pub mod synthetic;

pub use meter::{Meter, MeterConfig, MeterError, MeterHandle, UsageEvent, UsageStatus};

/// The embedded migrations (`migrations/` at the repository root).
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");

/// Apply every pending migration.
pub async fn migrate(pool: &sqlx::PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    MIGRATOR.run(pool).await
}
