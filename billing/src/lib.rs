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
//! What it is not: it does not compute usage (the gateway does) nor talk HTTP.

pub mod meter;
pub mod metrics;

pub use meter::{Meter, MeterConfig, MeterError, MeterHandle, UsageEvent, UsageStatus};

/// The embedded migrations (`migrations/` at the repository root).
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");

/// Apply every pending migration.
pub async fn migrate(pool: &sqlx::PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    MIGRATOR.run(pool).await
}
