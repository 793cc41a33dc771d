//! The `cachet` binary's library half: configuration and the wiring of the roles, callable
//! from tests. `main.rs` only parses arguments, loads config, starts tracing and calls in.

pub mod admin_cli;
pub mod billing_cli;
pub mod cli_time;
pub mod config;
pub mod memory;

pub mod node;
pub mod server;
