//! `cachet billing …`: the price book, rollups, invoices and reconciliation from the CLI.

use anyhow::{Context, bail};
use billing::invoice;
use billing::money::{Rates, format_minor};
use billing::prices::{self, Plan, PriceVersion};
use billing::rollup;
use chrono::{DateTime, NaiveDate, TimeZone, Utc};
use clap::{Args, Subcommand};
use sqlx::PgPool;

use crate::cli_time::{TIME_HELP, parse_time, whole_day};

#[derive(Subcommand)]
pub enum Command {
    /// Add a list-price version of a model (or, with --tenant, that tenant's custom rates).
    Price(PriceArgs),
    /// List the list-price versions (retired ones marked).
    Prices,
    /// Retire a scheduled list-price version before it takes effect (a version in force is
    /// replaced by adding a newer one instead).
    RetirePrice(RetirePriceArgs),
    /// Add a plan version for a tenant: usage discount and reserved cache capacity.
    Plan(PlanArgs),
    /// Recompute the hourly and daily rollups of every bucket touching [from, to).
    Rollup(Period),
    /// Rate a tenant's month into its draft invoice (or finalize it) and print it.
    Invoice(InvoiceArgs),
    /// Record an adjustment (in minor units, negative for a credit), billed on the next draft.
    Adjust(AdjustArgs),
    /// Print a finance API token (signed with CACHET_ADMIN_JWT_SECRET).
    Token(TokenArgs),
    /// Prove ledger totals = rollup totals = invoice totals per tenant and token class over
    /// [from, to) (whole UTC days); exits non-zero with the differences otherwise.
    Reconcile(Period),
    /// Put into the ledger what a stopped process left in its data directory: its usage
    /// journal (answered requests whose rows may not have reached Postgres), cut streams and
    /// spool. For a node that will not be started again; never while a process runs on
    /// that directory. Idempotent.
    Recover(RecoverArgs),
}

// The arguments of `cachet billing retire-price`.
#[derive(Args)]
pub struct RetirePriceArgs {
    #[arg(long)]
    pub model: String,
    /// The version's effective_from, exactly as listed.
    #[arg(long, value_parser = parse_time, help = TIME_HELP)]
    pub from: DateTime<Utc>,
    /// Who retires it (recorded in the billing audit).
    #[arg(long, default_value = "cli")]
    pub actor: String,
}

// The arguments of `cachet billing price` (a plain comment: a doc comment would become its help).
#[derive(Args)]
pub struct PriceArgs {
    #[arg(long)]
    pub model: String,
    /// When it takes effect: RFC 3339 (2026-12-01T00:00:00Z), a date (2026-12-01 =
    /// midnight UTC), or now.
    #[arg(long, value_parser = parse_time)]
    pub from: DateTime<Utc>,
    /// Base input price per token, in nano-units of the currency ($3/MTok = 3000).
    #[arg(long)]
    pub input_nanos: i64,
    #[arg(long)]
    pub output_nanos: i64,
    /// Cache multipliers of the input price, in basis points (1.25× = 12500).
    #[arg(long, default_value_t = 12_500)]
    pub write_5m_bp: i32,
    #[arg(long, default_value_t = 20_000)]
    pub write_1h_bp: i32,
    #[arg(long, default_value_t = 1_000)]
    pub read_bp: i32,
    /// Holding a cache object, per token and hour, as a multiplier of the input price in
    /// basis points (10000 = the input price per token-hour).
    #[arg(long, default_value_t = billing::prices::DEFAULT_STORAGE_HOUR_BP)]
    pub storage_hour_bp: i32,
    #[arg(long, default_value = "USD")]
    pub currency: String,
    /// Custom rates for this tenant (name or id) instead of the list price.
    #[arg(long)]
    pub tenant: Option<String>,
    /// Allow a version dated in the past: a price correction (audited).
    #[arg(long)]
    pub backdate: bool,
    #[arg(long, default_value = "cli")]
    pub actor: String,
}

// The arguments of `cachet billing plan` (a plain comment: a doc comment would become its help).
#[derive(Args)]
pub struct PlanArgs {
    #[arg(long)]
    pub tenant: String,
    /// When it takes effect.
    #[arg(long, value_parser = parse_time, help = TIME_HELP)]
    pub from: DateTime<Utc>,
    #[arg(long, default_value_t = 0)]
    pub discount_bp: i32,
    #[arg(long, default_value_t = 0)]
    pub reserved_bytes: i64,
    #[arg(long, default_value_t = 0)]
    pub reserved_nanos_per_gb_hour: i64,
    #[arg(long)]
    pub backdate: bool,
    #[arg(long, default_value = "cli")]
    pub actor: String,
}

// The window of `cachet billing rollup` and `reconcile`: from `--from` (inclusive) to `--to`
// (exclusive); reconcile wants whole days (a plain comment: a doc comment would become their
// help).
#[derive(Args)]
pub struct Period {
    #[arg(long, value_parser = parse_time, help = TIME_HELP)]
    pub from: DateTime<Utc>,
    #[arg(long, value_parser = parse_time, help = TIME_HELP)]
    pub to: DateTime<Utc>,
}

// The arguments of `cachet billing invoice` (a plain comment: a doc comment would become its help).
#[derive(Args)]
pub struct InvoiceArgs {
    #[arg(long)]
    pub tenant: String,
    /// The month, YYYY-MM.
    #[arg(long)]
    pub month: String,
    #[arg(long)]
    pub finalize: bool,
    #[arg(long, default_value = "cli")]
    pub actor: String,
}

// The arguments of `cachet billing adjust` (a plain comment: a doc comment would become its help).
#[derive(Args)]
pub struct AdjustArgs {
    #[arg(long)]
    pub tenant: String,
    #[arg(long)]
    pub amount_minor: i64,
    #[arg(long)]
    pub reason: String,
    /// The finalized invoice it corrects.
    #[arg(long)]
    pub invoice: Option<uuid::Uuid>,
    #[arg(long, default_value = "cli")]
    pub actor: String,
}

// The arguments of `cachet billing token` (a plain comment: a doc comment would become its help).
#[derive(Args)]
pub struct TokenArgs {
    /// platform_admin, finance or tenant_admin.
    #[arg(long)]
    pub role: String,
    /// The tenant (name or id) of a tenant_admin.
    #[arg(long)]
    pub tenant: Option<String>,
    /// Who it is for (the `sub` claim, recorded as the actor of what it does).
    #[arg(long, default_value = "cli")]
    pub subject: String,
    #[arg(long, default_value_t = 3600)]
    pub ttl_secs: u64,
}

// The arguments of `cachet billing recover` (a plain comment: a doc comment would become its help).
#[derive(Args)]
pub struct RecoverArgs {
    /// The stopped process's data directory (a node's is `<data_dir>/node-<id>`).
    #[arg(long)]
    pub data_dir: std::path::PathBuf,
}

async fn tenant_id(pool: &PgPool, name_or_id: &str) -> anyhow::Result<uuid::Uuid> {
    let t = control::tenants::find_tenant(pool, name_or_id)
        .await?
        .with_context(|| format!("no tenant {name_or_id}"))?;
    Ok(t.id.as_uuid())
}

fn day(d: NaiveDate) -> DateTime<Utc> {
    Utc.from_utc_datetime(&d.and_hms_opt(0, 0, 0).expect("midnight"))
}

pub async fn run(
    pool: &PgPool,
    config: &crate::config::Config,
    command: Command,
) -> anyhow::Result<()> {
    match command {
        Command::Price(args) => set_price(pool, args).await,
        Command::Prices => list_prices(pool).await,
        Command::RetirePrice(a) => {
            prices::retire_price(pool, &a.model, a.from, &a.actor, Utc::now()).await?;
            println!("price of {} from {} retired", a.model, a.from);
            Ok(())
        }
        Command::Plan(args) => set_plan(pool, args).await,
        Command::Rollup(args) => roll_up(pool, args).await,
        Command::Invoice(args) => make_invoice(pool, args).await,
        Command::Adjust(args) => adjust(pool, args).await,
        Command::Token(args) => token(pool, config, args).await,
        Command::Recover(args) => recover(pool, config, args).await,
        Command::Reconcile(args) => reconcile(pool, args).await,
    }
}

/// Add a list-price version of a model (or, with --tenant, that tenant's custom rates).
async fn set_price(pool: &PgPool, args: PriceArgs) -> anyhow::Result<()> {
    let PriceArgs {
        model,
        from,
        input_nanos,
        output_nanos,
        write_5m_bp,
        write_1h_bp,
        read_bp,
        storage_hour_bp,
        currency,
        tenant,
        backdate,
        actor,
    } = args;
    let now = Utc::now();
    let rates = Rates {
        input_nanos,
        output_nanos,
        cache_write_5m_bp: write_5m_bp,
        cache_write_1h_bp: write_1h_bp,
        cache_read_bp: read_bp,
        cache_storage_hour_bp: storage_hour_bp,
    };
    match tenant {
        Some(t) => {
            let id = tenant_id(pool, &t).await?;
            let price = prices::TenantPrice {
                tenant: id,
                model: model.clone(),
                effective_from: from,
                rates,
            };
            prices::set_tenant_price(pool, &price, &actor, backdate, now).await?;
        }
        None => {
            let p = PriceVersion {
                model: model.clone(),
                effective_from: from,
                currency,
                rates,
            };
            prices::set_price(pool, &p, &actor, backdate, now).await?;
        }
    }
    println!("price of {model} from {from} recorded");
    Ok(())
}

/// List the list-price versions.
async fn list_prices(pool: &PgPool) -> anyhow::Result<()> {
    for listed in prices::list_prices(pool).await? {
        let p = &listed.version;
        println!(
            "{:<24} from {}  {} input {} output {} nano/token  5m ×{} 1h ×{} read ×{} storage ×{}/h (bp){}",
            p.model,
            p.effective_from,
            p.currency,
            p.rates.input_nanos,
            p.rates.output_nanos,
            p.rates.cache_write_5m_bp,
            p.rates.cache_write_1h_bp,
            p.rates.cache_read_bp,
            p.rates.cache_storage_hour_bp,
            listed
                .retired_at
                .map(|t| format!("  retired {t}"))
                .unwrap_or_default()
        );
    }
    Ok(())
}

/// Add a plan version for a tenant: usage discount and reserved cache capacity.
async fn set_plan(pool: &PgPool, args: PlanArgs) -> anyhow::Result<()> {
    let PlanArgs {
        tenant,
        from,
        discount_bp,
        reserved_bytes,
        reserved_nanos_per_gb_hour,
        backdate,
        actor,
    } = args;
    let now = Utc::now();
    let plan = Plan {
        tenant_id: tenant_id(pool, &tenant).await?,
        effective_from: from,
        discount_bp,
        reserved_cache_bytes: reserved_bytes,
        reserved_nanos_per_gb_hour,
    };
    prices::set_plan(pool, &plan, &actor, backdate, now).await?;
    println!("plan of {tenant} from {from} recorded");
    Ok(())
}

/// Recompute the hourly and daily rollups of every bucket touching [from, to).
async fn roll_up(pool: &PgPool, args: Period) -> anyhow::Result<()> {
    let Period { from, to } = args;
    let r = rollup::rollup(pool, from, to).await?;
    println!(
        "rolled up: {} hourly rows, {} daily rows",
        r.hourly_rows, r.daily_rows
    );
    Ok(())
}

/// Rate a tenant's month into its draft invoice (or finalize it) and print it.
async fn make_invoice(pool: &PgPool, args: InvoiceArgs) -> anyhow::Result<()> {
    let InvoiceArgs {
        tenant,
        month: m,
        finalize,
        actor,
    } = args;
    let now = Utc::now();
    let id = tenant_id(pool, &tenant).await?;
    let m = invoice::parse_month(&m)?;
    let inv = if finalize {
        invoice::finalize(pool, id, m, &actor, now).await?
    } else {
        invoice::refresh_draft(pool, id, m, &actor).await?
    };
    println!(
        "invoice {} for {} {} ({}), {}",
        inv.id,
        tenant,
        inv.period_start.format("%Y-%m"),
        inv.status,
        inv.currency
    );
    for l in &inv.lines {
        println!(
            "  {:>12}  {}",
            format_minor(l.amount_minor, &inv.currency),
            l.description
        );
    }
    println!(
        "  {:>12}  total",
        format_minor(inv.total_minor, &inv.currency)
    );
    Ok(())
}

/// Record an adjustment (in minor units, negative for a credit), billed on the next draft.
async fn adjust(pool: &PgPool, args: AdjustArgs) -> anyhow::Result<()> {
    let AdjustArgs {
        tenant,
        amount_minor,
        reason,
        invoice: corrects,
        actor,
    } = args;
    let id = tenant_id(pool, &tenant).await?;
    let adj = invoice::add_adjustment(pool, id, corrects, amount_minor, &reason, &actor).await?;
    println!("adjustment {adj} recorded; it is billed on the next draft of {tenant}");
    Ok(())
}

/// Print a finance API token (signed with CACHET_ADMIN_JWT_SECRET).
async fn token(
    pool: &PgPool,
    config: &crate::config::Config,
    args: TokenArgs,
) -> anyhow::Result<()> {
    let TokenArgs {
        role,
        tenant,
        subject,
        ttl_secs,
    } = args;
    let jwt = crate::server::admin_jwt(config)?
        .context("set CACHET_ADMIN_JWT_SECRET (at least 32 bytes) to issue tokens")?;
    let role: identity::Role = serde_json::from_value(serde_json::json!(role))
        .context("role must be platform_admin, finance or tenant_admin")?;
    let tenant = match tenant {
        Some(t) => Some(tenant_id(pool, &t).await?),
        None => None,
    };
    println!(
        "{}",
        jwt.issue(
            &subject,
            role,
            tenant,
            std::time::Duration::from_secs(ttl_secs)
        )?
    );
    Ok(())
}

/// Put into the ledger what a stopped process left in its data directory: its usage
/// journal (answered requests whose rows may not have reached Postgres), cut streams and
/// spool. For a node that will not be started again; never while a process runs on
/// that directory. Idempotent.
async fn recover(
    pool: &PgPool,
    config: &crate::config::Config,
    args: RecoverArgs,
) -> anyhow::Result<()> {
    let RecoverArgs { data_dir } = args;
    let mut meter = config.meter();
    meter.spool_path = data_dir.join(&config.meter.spool_file);
    // Into the database the files belong to, never another (decision 0030), and never while
    // a process still runs on that directory.
    meter.foreign = billing::database::Foreign::Refuse;
    let _held = crate::dirlock::hold_all(
        &crate::dirlock::meter_dirs(&data_dir, &meter.spool_path),
        "billing recover",
    )?;
    let stop = tokio_util::sync::CancellationToken::new();
    let (handle, task) = billing::Meter::start(pool.clone(), meter, stop.clone()).await?;
    let settled = handle.settled(std::time::Duration::from_secs(60)).await;
    stop.cancel();
    task.await.context("the meter stopped")?;
    if !settled {
        bail!(
            "Postgres did not take every recovered event within 60 s; they stay in the spool (run again)"
        );
    }
    println!(
        "recovered {}: every event is in the ledger",
        data_dir.display()
    );
    Ok(())
}

/// Prove ledger totals = rollup totals = invoice totals per tenant and token class over
/// [from, to) (whole UTC days); exits non-zero with the differences otherwise.
async fn reconcile(pool: &PgPool, args: Period) -> anyhow::Result<()> {
    let Period { from, to } = args;
    let from = whole_day(from, "--from").map_err(anyhow::Error::msg)?;
    let to = whole_day(to, "--to").map_err(anyhow::Error::msg)?;
    let r = rollup::reconcile(pool, day(from), day(to)).await?;
    if r.mismatches.is_empty() {
        println!(
            "reconciled {from} .. {to}: {} tenants, {} invoices; ledger = rollups = invoices for every token class",
            r.tenants, r.invoices
        );
    } else {
        eprintln!(
            "{} differences between the ledger and what was derived from it:",
            r.mismatches.len()
        );
        for m in &r.mismatches {
            eprintln!("  {m}");
        }
        bail!("reconciliation failed");
    }
    Ok(())
}
