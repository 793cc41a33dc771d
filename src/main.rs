//! `cachet`: the one binary. Subcommands per role and for administration.

use std::path::PathBuf;

use anyhow::Context;
use cachet::config::Config;
use cachet::server;
use cachet::telemetry::{self, Role};
use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(
    name = "cachet",
    version,
    about = "Managed prompt caching for LLM inference"
)]
struct Cli {
    /// Configuration file (TOML); see cachet.sample.toml. Environment variables override it.
    #[arg(long, global = true, env = "CACHET_CONFIG")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run gateway + fabric node + engines + meter in one process.
    Serve,
    /// Run one node of a cluster: its fabric store served over the fabric transport,
    /// announced in Redis with heartbeats, block events published, blocks replicated to
    /// their owners; with --api-listen also engines and the API for a gateway
    /// (CACHET_CLUSTER_TOKEN).
    Node(cachet::node::NodeArgs),
    /// Run the router of a cluster: the public API on `listen`, each request sent to the node
    /// the conductor picks (CACHET_CLUSTER_TOKEN). `cachet gateway` is its former name, still
    /// accepted.
    #[command(alias = "gateway")]
    Router {
        /// Prefix of the cluster's Redis keys.
        #[arg(long, default_value = "cachet")]
        redis_prefix: String,
    },
    /// Create the database if needed and apply migrations.
    Migrate,
    /// Billing: price book, plans, rollups, invoices, reconciliation.
    Billing {
        #[command(subcommand)]
        command: cachet::billing_cli::Command,
    },
    /// Administration: tenants, keys, policy, usage, budget, cache, audit log, console users.
    Admin {
        #[command(subcommand)]
        command: cachet::admin_cli::Command,
    },
    /// Create a demo tenant and key unless one exists; print the key (make run uses this).
    Demo {
        /// Where the demo key is kept so later runs can print it again.
        #[arg(long, default_value = ".cachet/demo-api-key")]
        key_file: PathBuf,
    },
    /// Print the OpenAPI document.
    Openapi,
    /// Load tests and benchmarks.
    Loadtest {
        #[command(subcommand)]
        command: loadtests::Command,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    cachet::memory::tune_allocator();
    let cli = Cli::parse();
    if let Command::Loadtest { command } = cli.command {
        let _logs = telemetry::init(false, None)?;
        return loadtests::run(command).await;
    }
    let config = Config::load(cli.config.as_deref())?;
    // The serving roles export traces when the OTLP variables ask for it.
    let role = match &cli.command {
        Command::Serve => Some(Role {
            name: "serve",
            instance: None,
        }),
        Command::Node(args) => Some(Role {
            name: "node",
            instance: args.id.as_deref(),
        }),
        Command::Router { .. } => Some(Role {
            name: "router",
            instance: None,
        }),
        _ => None,
    };
    let telemetry = telemetry::init(config.log.format == "json", role)?;
    // Every client connection is a descriptor; the soft limit is often far below the hard one.
    gateway::server::raise_fd_limit();
    let done = run(cli.command, config).await;
    telemetry.shutdown().await;
    done
}

/// The subcommand, run.
async fn run(command: Command, config: Config) -> anyhow::Result<()> {
    match command {
        Command::Node(args) => {
            let stop = CancellationToken::new();
            cancel_on_signal(stop.clone());
            cachet::node::run(config, args, stop).await
        }
        Command::Router { redis_prefix } => {
            let listener = tokio::net::TcpListener::bind(&config.listen)
                .await
                .with_context(|| format!("binding {}", config.listen))?;
            let shutdown = CancellationToken::new();
            let (addr, task) =
                server::start_router(config, listener, shutdown.clone(), redis_prefix).await?;
            println!("gateway listening on {addr}");
            cancel_on_signal(shutdown);
            task.await.context("gateway task panicked")?
        }
        Command::Serve => {
            let listener = tokio::net::TcpListener::bind(&config.listen)
                .await
                .with_context(|| format!("binding {}", config.listen))?;
            let shutdown = CancellationToken::new();
            let running = server::start(config, listener, shutdown.clone()).await?;
            println!("serving on {}", running.addr);
            cancel_on_signal(shutdown);
            running.wait().await
        }
        Command::Billing { command } => {
            let pool = server::connect_and_migrate(&config.database_url, 2).await?;
            cachet::billing_cli::run(&pool, &config, command).await
        }
        Command::Migrate => {
            let pool = server::connect_and_migrate(&config.database_url, 2).await?;
            migrate(&pool).await
        }
        Command::Admin { command } => {
            let pool = server::connect_and_migrate(&config.database_url, 2).await?;
            cachet::admin_cli::run(&pool, &config, command).await
        }
        Command::Demo { key_file } => {
            let pool = server::connect_and_migrate(&config.database_url, 2).await?;
            println!("{}", demo_key(&pool, &key_file).await?);
            Ok(())
        }
        Command::Openapi => {
            print!("{}", gateway::openapi::document());
            Ok(())
        }
        Command::Loadtest { .. } => unreachable!("handled above"),
    }
}

/// `cachet migrate`: the schema applied (by the caller's connect), then the list prices Cachet
/// ships seeded where none is set.
async fn migrate(pool: &sqlx::PgPool) -> anyhow::Result<()> {
    println!("migrations applied");
    let seeded =
        billing::prices::ensure_list_defaults(pool, billing::prices::DEFAULT_MODELS).await?;
    if !seeded.is_empty() {
        println!(
            "list prices seeded (shipped defaults): {}",
            seeded.join(", ")
        );
    }
    Ok(())
}

/// `cachet demo`: the demo tenant's API key, kept in `key_file` (mode 600). A stored key is
/// reused only if this database still knows it (the file outlives a dropped database or
/// another DATABASE_URL).
async fn demo_key(pool: &sqlx::PgPool, key_file: &std::path::Path) -> anyhow::Result<String> {
    let stored = std::fs::read_to_string(key_file)
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty());
    if let Some(s) = stored
        && control::tenants::key_is_live(pool, &s).await?
    {
        return Ok(s);
    }
    let actor = control::tenants::Actor::cli_user();
    let t = match control::tenants::find_tenant(pool, "demo").await? {
        Some(t) => t,
        None => control::tenants::create_tenant(pool, &actor, "demo").await?,
    };
    let k = control::tenants::create_key(pool, &actor, &t, "demo", None).await?;
    if let Some(dir) = key_file.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(key_file, format!("{}\n", k.secret))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(key_file, std::fs::Permissions::from_mode(0o600))?;
    }
    Ok(k.secret)
}

/// Cancel `token` on SIGINT or SIGTERM.
fn cancel_on_signal(token: CancellationToken) {
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("shutting down");
        token.cancel();
    });
}

/// SIGINT or SIGTERM.
async fn wait_for_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
    }
}
