//! The `cachet` binary's library half: configuration and the wiring of the roles, callable
//! from tests. `main.rs` only parses arguments, loads config, starts logging and traces
//! ([`telemetry`]) and calls in.

pub mod admin_cli;
pub mod billing_cli;
pub mod cli_time;
pub mod config;
pub mod dirlock;
pub mod memory;
pub mod node;
pub mod server;
pub mod telemetry;

/// Spawn a background loop in a span of its own (`background{task=…}`), so each of its log
/// lines says which loop wrote it.
pub fn spawn_loop<F>(task: &'static str, fut: F) -> tokio::task::JoinHandle<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    tokio::spawn(tracing::Instrument::instrument(
        fut,
        tracing::info_span!("background", task),
    ))
}
