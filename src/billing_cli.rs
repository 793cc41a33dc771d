//! `cachet billing …`: the price book, rollups, invoices and reconciliation from the CLI.

use anyhow::{Context, bail};
use billing::invoice;
use billing::money::{Rates, format_minor};
use billing::prices::{self, Plan, PriceVersion};
use billing::rollup;
use chrono::{DateTime, NaiveDate, TimeZone, Utc};
use clap::Subcommand;
use sqlx::PgPool;

use crate::cli_time::{TIME_HELP, parse_time, whole_day};

#[derive(Subcommand)]
pub enum Command {
    /// Add a list-price version of a model (or, with --tenant, that tenant's custom rates).
    Price {
        #[arg(long)]
        model: String,
        /// When it takes effect: RFC 3339 (2026-12-01T00:00:00Z), a date (2026-12-01 =
        /// midnight UTC), or now.
        #[arg(long, value_parser = parse_time)]
        from: DateTime<Utc>,
        /// Base input price per token, in nano-units of the currency ($3/MTok = 3000).
        #[arg(long)]
        input_nanos: i64,
        #[arg(long)]
        output_nanos: i64,
        /// Cache multipliers of the input price, in basis points (1.25× = 12500).
        #[arg(long, default_value_t = 12_500)]
        write_5m_bp: i32,
        #[arg(long, default_value_t = 20_000)]
        write_1h_bp: i32,
        #[arg(long, default_value_t = 1_000)]
        read_bp: i32,
        #[arg(long, default_value = "USD")]
        currency: String,
        /// Custom rates for this tenant (name or id) instead of the list price.
        #[arg(long)]
        tenant: Option<String>,
        /// Allow a version dated in the past: a price correction (audited).
        #[arg(long)]
        backdate: bool,
        #[arg(long, default_value = "cli")]
        actor: String,
    },
    /// List the list-price versions.
    Prices,
    /// Add a plan version for a tenant: usage discount and reserved cache capacity.
    Plan {
        #[arg(long)]
        tenant: String,
        /// When it takes effect.
        #[arg(long, value_parser = parse_time, help = TIME_HELP)]
        from: DateTime<Utc>,
        #[arg(long, default_value_t = 0)]
        discount_bp: i32,
        #[arg(long, default_value_t = 0)]
        reserved_bytes: i64,
        #[arg(long, default_value_t = 0)]
        reserved_nanos_per_gb_hour: i64,
        #[arg(long)]
        backdate: bool,
        #[arg(long, default_value = "cli")]
        actor: String,
    },
    /// Recompute the hourly and daily rollups of every bucket touching [from, to).
    Rollup {
        /// Start (inclusive).
        #[arg(long, value_parser = parse_time, help = TIME_HELP)]
        from: DateTime<Utc>,
        /// End (exclusive).
        #[arg(long, value_parser = parse_time, help = TIME_HELP)]
        to: DateTime<Utc>,
    },
    /// Rate a tenant's month into its draft invoice (or finalize it) and print it.
    Invoice {
        #[arg(long)]
        tenant: String,
        /// The month, YYYY-MM.
        #[arg(long)]
        month: String,
        #[arg(long)]
        finalize: bool,
        #[arg(long, default_value = "cli")]
        actor: String,
    },
    /// Record an adjustment (in minor units, negative for a credit), billed on the next draft.
    Adjust {
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        amount_minor: i64,
        #[arg(long)]
        reason: String,
        /// The finalized invoice it corrects.
        #[arg(long)]
        invoice: Option<uuid::Uuid>,
        #[arg(long, default_value = "cli")]
        actor: String,
    },
    /// Print a finance API token (signed with CACHET_ADMIN_JWT_SECRET).
    Token {
        /// platform_admin, finance or tenant_admin.
        #[arg(long)]
        role: String,
        /// The tenant (name or id) of a tenant_admin.
        #[arg(long)]
        tenant: Option<String>,
        /// Who it is for (the `sub` claim, recorded as the actor of what it does).
        #[arg(long, default_value = "cli")]
        subject: String,
        #[arg(long, default_value_t = 3600)]
        ttl_secs: u64,
    },
    /// Prove ledger totals = rollup totals = invoice totals per tenant and token class over
    /// [from, to) (whole UTC days); exits non-zero with the differences otherwise.
    Reconcile {
        /// First day (inclusive): a date, or a time at midnight UTC.
        #[arg(long, value_parser = parse_time, help = TIME_HELP)]
        from: DateTime<Utc>,
        /// Last day (exclusive): a date, or a time at midnight UTC.
        #[arg(long, value_parser = parse_time, help = TIME_HELP)]
        to: DateTime<Utc>,
    },
    /// Put into the ledger what a stopped process left in its data directory: its usage
    /// journal (answered requests whose rows may not have reached Postgres), cut streams and
    /// spool. For a node that will not be started again; never while a process runs on
    /// that directory. Idempotent.
    Recover {
        /// The stopped process's data directory (a node's is `<data_dir>/node-<id>`).
        #[arg(long)]
        data_dir: std::path::PathBuf,
    },
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
    let now = Utc::now();
    match command {
        Command::Price {
            model,
            from,
            input_nanos,
            output_nanos,
            write_5m_bp,
            write_1h_bp,
            read_bp,
            currency,
            tenant,
            backdate,
            actor,
        } => {
            match tenant {
                Some(t) => {
                    let id = tenant_id(pool, &t).await?;
                    let rates = Rates {
                        input_nanos,
                        output_nanos,
                        cache_write_5m_bp: write_5m_bp,
                        cache_write_1h_bp: write_1h_bp,
                        cache_read_bp: read_bp,
                    };
                    prices::set_tenant_price(pool, id, &model, from, rates, &actor, backdate, now)
                        .await?;
                }
                None => {
                    let p = PriceVersion {
                        model: model.clone(),
                        effective_from: from,
                        currency,
                        input_nanos,
                        output_nanos,
                        cache_write_5m_bp: write_5m_bp,
                        cache_write_1h_bp: write_1h_bp,
                        cache_read_bp: read_bp,
                    };
                    prices::set_price(pool, &p, &actor, backdate, now).await?;
                }
            }
            println!("price of {model} from {from} recorded");
        }
        Command::Prices => {
            for p in prices::list_prices(pool).await? {
                println!(
                    "{:<24} from {}  {} input {} output {} nano/token  5m ×{} 1h ×{} read ×{} (bp)",
                    p.model,
                    p.effective_from,
                    p.currency,
                    p.input_nanos,
                    p.output_nanos,
                    p.cache_write_5m_bp,
                    p.cache_write_1h_bp,
                    p.cache_read_bp
                );
            }
        }
        Command::Plan {
            tenant,
            from,
            discount_bp,
            reserved_bytes,
            reserved_nanos_per_gb_hour,
            backdate,
            actor,
        } => {
            let plan = Plan {
                tenant_id: tenant_id(pool, &tenant).await?,
                effective_from: from,
                discount_bp,
                reserved_cache_bytes: reserved_bytes,
                reserved_nanos_per_gb_hour,
            };
            prices::set_plan(pool, &plan, &actor, backdate, now).await?;
            println!("plan of {tenant} from {from} recorded");
        }
        Command::Rollup { from, to } => {
            let r = rollup::rollup(pool, from, to).await?;
            println!(
                "rolled up: {} hourly rows, {} daily rows",
                r.hourly_rows, r.daily_rows
            );
        }
        Command::Invoice {
            tenant,
            month: m,
            finalize,
            actor,
        } => {
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
        }
        Command::Adjust {
            tenant,
            amount_minor,
            reason,
            invoice: corrects,
            actor,
        } => {
            let id = tenant_id(pool, &tenant).await?;
            let adj =
                invoice::add_adjustment(pool, id, corrects, amount_minor, &reason, &actor).await?;
            println!("adjustment {adj} recorded; it is billed on the next draft of {tenant}");
        }
        Command::Token {
            role,
            tenant,
            subject,
            ttl_secs,
        } => {
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
        }
        Command::Recover { data_dir } => {
            let mut meter = config.meter();
            meter.spool_path = data_dir.join(&config.meter.spool_file);
            let stop = tokio_util::sync::CancellationToken::new();
            let (handle, task) = billing::Meter::start(pool.clone(), meter, stop.clone())?;
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
        }
        Command::Reconcile { from, to } => {
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
        }
    }
    Ok(())
}
