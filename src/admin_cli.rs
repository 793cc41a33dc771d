//! `cachet admin …`: everything the admin API lets a platform admin do, from the command line,
//! on the same functions (so the same checks, and the same audit rows, actor `cli:<user>`).
//! Running servers apply the changes within about a second (they follow the audit log).
//!
//! The cache view lives in the serving processes' memory, so `cachet admin cache` asks the
//! running service's admin API (`--url`), with a platform-admin token signed by
//! `CACHET_ADMIN_JWT_SECRET`.

use std::io::Read;

use anyhow::{Context, bail};
use cachet_common::TenantId;
use chrono::{DateTime, Utc};
use clap::{Args, Subcommand};
use control::tenants::limits::{Limits, LimitsPatch};
use control::tenants::workspaces::{self, WorkspacePatch};
use control::tenants::{self, Actor, keys, policy};
use identity::Role;
use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

use crate::cli_time::{TIME_HELP, parse_duration, parse_time};

#[derive(Subcommand)]
pub enum Command {
    /// Tenants: create, list, show, suspend, resume, delete.
    Tenant {
        #[command(subcommand)]
        command: TenantCommand,
    },
    /// A tenant's workspaces: create, list, rename, set limits, archive.
    Workspace {
        #[command(subcommand)]
        command: WorkspaceCommand,
    },
    /// API keys: create, list, revoke, rotate, expire.
    Key {
        #[command(subcommand)]
        command: KeyCommand,
    },
    /// A tenant's limits and cache policy.
    Policy {
        #[command(subcommand)]
        command: PolicyCommand,
    },
    /// A tenant's usage, cost and savings over time (from the rollups).
    Usage {
        /// Tenant name or id.
        tenant: String,
        #[arg(long, value_parser = parse_time, help = TIME_HELP)]
        from: DateTime<Utc>,
        #[arg(long, value_parser = parse_time, help = TIME_HELP)]
        to: DateTime<Utc>,
        /// hour or day.
        #[arg(long, default_value = "day")]
        granularity: String,
        /// none, model, api_key, workspace, or tag:NAME (the value of one tag of each key).
        #[arg(long, default_value = "none")]
        by: String,
        /// Only this workspace's usage (name or id).
        #[arg(long)]
        workspace: Option<String>,
    },
    /// A tenant's spend this month against its budget.
    Budget {
        /// Tenant name or id.
        tenant: String,
    },
    /// A tenant's cache on the running service (bytes per tier, evictions, top prefixes).
    Cache {
        /// Tenant name or id.
        tenant: String,
        /// The running service's public address.
        #[arg(long, default_value = "http://127.0.0.1:8080")]
        url: String,
    },
    /// The audit log.
    Audit {
        #[command(subcommand)]
        command: AuditCommand,
    },
    /// Admin console users.
    User {
        #[command(subcommand)]
        command: UserCommand,
    },
}

#[derive(Subcommand)]
pub enum TenantCommand {
    /// Create a tenant (with a default workspace and no limits).
    Create { name: String },
    /// List tenants.
    List {
        /// Include deleted tenants.
        #[arg(long)]
        all: bool,
    },
    /// Show a tenant.
    Show { tenant: String },
    /// Suspend a tenant: its keys get 403 until it is resumed.
    Suspend { tenant: String },
    /// Resume a suspended tenant.
    Resume { tenant: String },
    /// Delete a tenant: keys revoked, cache purged; its ledger and invoices are kept.
    Delete {
        tenant: String,
        /// Required: deleting cannot be undone.
        #[arg(long)]
        yes: bool,
    },
}

#[derive(Subcommand)]
pub enum KeyCommand {
    /// Create an API key; the secret is printed once and never stored.
    Create {
        /// Tenant name or id.
        #[arg(long)]
        tenant: String,
        #[arg(long, default_value = "default")]
        name: String,
        /// The workspace (name or id) the key belongs to; the tenant's default one if absent.
        #[arg(long)]
        workspace: Option<String>,
        /// When the key stops working.
        #[arg(long, value_parser = parse_time, help = TIME_HELP)]
        expires: Option<DateTime<Utc>>,
    },
    /// List a tenant's keys (never their secrets).
    List {
        /// Tenant name or id.
        #[arg(long)]
        tenant: String,
    },
    /// Revoke a key.
    Revoke { id: Uuid },
    /// Rotate a key: prints the new secret; the old one works for the grace period.
    Rotate {
        id: Uuid,
        /// How long the old secret keeps working (90s, 15m, 24h, 7d).
        #[arg(long, default_value = "24h", value_parser = parse_duration)]
        grace: chrono::Duration,
        /// Retrying with the same idempotency key prints the same new key.
        #[arg(long)]
        idempotency_key: Option<String>,
        /// The new key's expiry.
        #[arg(long, value_parser = parse_time, help = TIME_HELP)]
        expires: Option<DateTime<Utc>>,
    },
    /// Set (or with --never, clear) a key's expiry.
    Expire {
        id: Uuid,
        #[arg(long, value_parser = parse_time, help = TIME_HELP, conflicts_with = "never")]
        at: Option<DateTime<Utc>>,
        #[arg(long)]
        never: bool,
    },
}

#[derive(Subcommand)]
pub enum WorkspaceCommand {
    /// Create a workspace (keys, limits and usage of its own; a cache of its own).
    Create {
        /// Tenant name or id.
        #[arg(long)]
        tenant: String,
        name: String,
        #[command(flatten)]
        limits: LimitArgs,
    },
    /// List a tenant's workspaces.
    List {
        /// Tenant name or id.
        #[arg(long)]
        tenant: String,
        /// Include archived workspaces.
        #[arg(long)]
        all: bool,
    },
    /// Rename a workspace or change its limits: only what is given changes; `none` removes
    /// a limit.
    Set {
        /// Tenant name or id.
        #[arg(long)]
        tenant: String,
        /// Workspace name or id.
        workspace: String,
        #[arg(long)]
        rename: Option<String>,
        #[command(flatten)]
        limits: LimitArgs,
    },
    /// Archive a workspace: its keys are revoked; its usage is kept. Final.
    Archive {
        /// Tenant name or id.
        #[arg(long)]
        tenant: String,
        /// Workspace name or id.
        workspace: String,
        /// Required: archiving cannot be undone.
        #[arg(long)]
        yes: bool,
    },
}

/// Limits on the command line, a tenant's or a workspace's (`none` removes one): the same
/// four flags for both.
#[derive(Args)]
pub struct LimitArgs {
    /// Requests per minute (the whole tenant, or the whole workspace).
    #[arg(long, value_parser = limit)]
    pub rpm: Option<Limit>,
    /// Uncached input tokens per minute (cache reads never count).
    #[arg(long, value_parser = limit)]
    pub input_tpm: Option<Limit>,
    /// Output tokens per minute.
    #[arg(long, value_parser = limit)]
    pub output_tpm: Option<Limit>,
    /// Monthly spend budget in minor units of the tenant's currency (cents).
    #[arg(long, value_parser = limit)]
    pub budget_minor: Option<Limit>,
}

impl LimitArgs {
    /// The flags as a change to one level's limits.
    fn patch(self) -> LimitsPatch {
        LimitsPatch {
            requests_per_minute: given(self.rpm),
            input_tokens_per_minute: given(self.input_tpm),
            output_tokens_per_minute: given(self.output_tpm),
            monthly_budget_minor: given(self.budget_minor),
        }
    }

    /// The flags (and a new name, if any) as a change to a workspace.
    fn workspace(self, name: Option<String>) -> WorkspacePatch {
        WorkspacePatch {
            name,
            limits: self.patch(),
            ..WorkspacePatch::default()
        }
    }
}

#[derive(Subcommand)]
pub enum PolicyCommand {
    /// Show a tenant's policy.
    Show { tenant: String },
    /// Change a tenant's policy: only the fields given change; `none` removes a limit.
    Set(Box<PolicySet>),
}

/// A limit as given on the command line: a number, or `none` (no limit). A type of its own:
/// clap reads a field of `Option<Option<_>>` as a flag whose value may be left out, and
/// panics when its parser yields an `Option`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limit(Option<i64>);

fn limit(s: &str) -> Result<Limit, String> {
    if s == "none" {
        return Ok(Limit(None));
    }
    s.parse::<i64>()
        .map(|n| Limit(Some(n)))
        .map_err(|_| format!("{s:?}: a whole number, or none"))
}

/// A limit flag as a patch field: absent (unchanged), `none` (removed) or a number.
fn given(l: Option<Limit>) -> Option<Option<i64>> {
    l.map(|Limit(v)| v)
}

#[derive(Args)]
pub struct PolicySet {
    /// Tenant name or id.
    pub tenant: String,
    #[command(flatten)]
    pub limits: LimitArgs,
    /// The same limits for each key.
    #[arg(long, value_parser = limit)]
    pub key_rpm: Option<Limit>,
    #[arg(long, value_parser = limit)]
    pub key_input_tpm: Option<Limit>,
    #[arg(long, value_parser = limit)]
    pub key_output_tpm: Option<Limit>,
    /// Percent of the budget at which an alert is raised.
    #[arg(long)]
    pub budget_alert_percent: Option<i32>,
    /// Resident cache bytes (one copy of each block).
    #[arg(long, value_parser = limit)]
    pub cache_bytes: Option<Limit>,
    /// Reserved cache bytes (a plan change, billed).
    #[arg(long, value_parser = limit)]
    pub reserved_bytes: Option<Limit>,
    /// Whether 1h TTL breakpoints are allowed.
    #[arg(long)]
    pub allow_1h_ttl: Option<bool>,
    /// Nodes holding each block (none = the cluster's default).
    #[arg(long, value_parser = limit)]
    pub replication: Option<Limit>,
    /// Weight in each model's fair queue for engine workers (1 to 100).
    #[arg(long)]
    pub engine_weight: Option<i32>,
    /// Generations running at once per model, at most (none = no cap).
    #[arg(long, value_parser = limit)]
    pub max_concurrent: Option<Limit>,
    /// The longest a cache object may be held, in seconds (300 to 2592000).
    #[arg(long)]
    pub max_cache_ttl_secs: Option<i32>,
    /// The tenant's ceilings as a JSON merge patch, e.g. `{"requests_per_minute": 600,
    /// "allow_1h_ttl": false, "max_concurrent": null}`: a tenant admin may lower within them,
    /// never raise; values above a lowered ceiling are lowered to it.
    #[arg(long, value_parser = parse_ceilings)]
    pub ceilings: Option<control::tenants::ceilings::CeilingsPatch>,
}

fn parse_ceilings(s: &str) -> Result<control::tenants::ceilings::CeilingsPatch, String> {
    serde_json::from_str(s).map_err(|e| format!("not a ceilings patch: {e}"))
}

#[derive(Subcommand)]
pub enum AuditCommand {
    /// The newest entries.
    List {
        /// Only this tenant's (name or id).
        #[arg(long)]
        tenant: Option<String>,
        /// Only actions starting with this (key., policy.update, …).
        #[arg(long)]
        action: Option<String>,
        #[arg(long, default_value_t = 50)]
        limit: i64,
    },
    /// Every entry in a window, oldest first, as JSON Lines or CSV on standard output.
    Export {
        #[arg(long, value_parser = parse_time, help = TIME_HELP)]
        from: Option<DateTime<Utc>>,
        #[arg(long, value_parser = parse_time, help = TIME_HELP)]
        to: Option<DateTime<Utc>>,
        #[arg(long)]
        tenant: Option<String>,
        /// jsonl or csv.
        #[arg(long, default_value = "jsonl")]
        format: String,
    },
}

#[derive(Subcommand)]
pub enum UserCommand {
    /// Create a user of the admin console. The password is read from --password-file (`-`:
    /// standard input); without it a random one is generated and printed once.
    Create {
        #[arg(long)]
        username: String,
        /// platform_admin, tenant_admin or finance.
        #[arg(long)]
        role: String,
        /// The tenant (name or id) of a tenant_admin.
        #[arg(long)]
        tenant: Option<String>,
        #[arg(long)]
        password_file: Option<std::path::PathBuf>,
    },
    /// List users.
    List,
    /// Disable a user and end its sessions.
    Disable { username: String },
    /// Clear a user's failed logins and lock.
    Unlock { username: String },
    /// Set a user's password (read from --password-file, `-`: standard input; without it a
    /// random one is generated and printed once). Its sessions end and its lock clears.
    Passwd {
        username: String,
        #[arg(long)]
        password_file: Option<std::path::PathBuf>,
    },
    /// Print a one-time reset secret for a user (valid a day, one use): they set a new
    /// password with it at the console's login page.
    Reset { username: String },
}

async fn tenant_id(pool: &PgPool, name_or_id: &str) -> anyhow::Result<Uuid> {
    Ok(tenants::find_tenant(pool, name_or_id)
        .await?
        .with_context(|| format!("no tenant {name_or_id}"))?
        .id
        .as_uuid())
}

async fn user_id(pool: &PgPool, username: &str) -> anyhow::Result<Uuid> {
    Ok(control::admin::login::find_user(pool, username)
        .await?
        .with_context(|| format!("no user {username}"))?
        .id)
}

fn print_json(v: &impl serde::Serialize) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

fn time(t: Option<DateTime<Utc>>) -> String {
    t.map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
        .unwrap_or_else(|| "-".into())
}

/// A password of 24 random base62 characters (about 143 bits).
fn random_password() -> anyhow::Result<String> {
    const A: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
    let mut out = String::new();
    while out.len() < 24 {
        let mut b = [0u8; 32];
        getrandom::fill(&mut b).map_err(|e| anyhow::anyhow!("random: {e}"))?;
        out.extend(
            b.iter()
                .filter(|x| **x < 248)
                .map(|x| A[(*x % 62) as usize] as char),
        );
    }
    out.truncate(24);
    Ok(out)
}

pub async fn run(
    pool: &PgPool,
    config: &crate::config::Config,
    command: Command,
) -> anyhow::Result<()> {
    let actor = Actor::cli_user();
    match command {
        Command::Tenant { command } => tenant(pool, &actor, command).await,
        Command::Workspace { command } => workspace(pool, &actor, command).await,
        Command::Key { command } => key(pool, &actor, config, command).await,
        Command::Policy { command } => policy_cmd(pool, &actor, command).await,
        Command::Usage {
            tenant,
            from,
            to,
            granularity,
            by,
            workspace,
        } => {
            let window = UsageArgs {
                tenant,
                from,
                to,
                granularity,
                by,
                workspace,
            };
            usage(pool, window).await
        }
        Command::Budget { tenant } => budget(pool, tenant).await,
        Command::Cache { tenant, url } => cache(pool, config, tenant, url).await,
        Command::Audit { command } => audit(pool, command).await,
        Command::User { command } => user(pool, &actor, command).await,
    }
}

/// `cachet admin tenant …`: tenants: create, list, show, suspend, resume, delete.
async fn tenant(pool: &PgPool, actor: &Actor, command: TenantCommand) -> anyhow::Result<()> {
    match command {
        TenantCommand::Create { name } => {
            let t = tenants::create_tenant(pool, actor, &name).await?;
            println!("tenant {} created: id {}", t.name, t.id);
        }
        TenantCommand::List { all } => {
            println!("{:<36}  {:<10}  {:>4}  name", "id", "state", "keys");
            for t in tenants::list_tenants(pool, all).await? {
                println!(
                    "{}  {:<10}  {:>4}  {}",
                    t.id,
                    format!("{:?}", t.state).to_lowercase(),
                    t.active_keys,
                    t.name
                );
            }
        }
        TenantCommand::Show { tenant } => {
            let id = tenant_id(pool, &tenant).await?;
            print_json(&tenants::get_tenant(pool, TenantId(id)).await?)?;
        }
        TenantCommand::Suspend { tenant } => {
            let id = tenant_id(pool, &tenant).await?;
            tenants::set_suspended(pool, actor, TenantId(id), tenants::Suspension::Suspend).await?;
            println!("tenant {tenant} suspended: its keys are refused within seconds");
        }
        TenantCommand::Resume { tenant } => {
            let id = tenant_id(pool, &tenant).await?;
            tenants::set_suspended(pool, actor, TenantId(id), tenants::Suspension::Resume).await?;
            println!("tenant {tenant} resumed");
        }
        TenantCommand::Delete { tenant, yes } => {
            if !yes {
                bail!(
                    "deleting {tenant} revokes its keys and purges its cache; add --yes to do it"
                );
            }
            let id = tenant_id(pool, &tenant).await?;
            tenants::delete_tenant(pool, actor, TenantId(id)).await?;
            println!("tenant {tenant} deleted; its ledger and invoices are kept");
        }
    }
    Ok(())
}

/// `cachet admin workspace …`: a tenant's workspaces.
async fn workspace(pool: &PgPool, actor: &Actor, command: WorkspaceCommand) -> anyhow::Result<()> {
    let limit = |l: Option<i64>| l.map_or_else(|| "-".to_string(), |v| v.to_string());
    match command {
        WorkspaceCommand::Create {
            tenant,
            name,
            limits,
        } => {
            let id = TenantId(tenant_id(pool, &tenant).await?);
            let l = limits.workspace(None).apply(Limits::default())?;
            let w = workspaces::create_workspace(pool, actor, id, &name, l, &Default::default())
                .await?;
            println!(
                "workspace {} created in tenant {tenant}: id {}",
                w.name, w.id
            );
        }
        WorkspaceCommand::List { tenant, all } => {
            let id = TenantId(tenant_id(pool, &tenant).await?);
            println!(
                "{:<36}  {:<8}  {:>4}  {:>8}  {:>10}  {:>10}  {:>12}  name",
                "id", "state", "keys", "rpm", "input tpm", "output tpm", "budget minor"
            );
            for w in workspaces::list_workspaces(pool, id, all).await? {
                println!(
                    "{}  {:<8}  {:>4}  {:>8}  {:>10}  {:>10}  {:>12}  {}",
                    w.id,
                    if w.archived_at.is_some() {
                        "archived"
                    } else {
                        "active"
                    },
                    w.active_keys,
                    limit(w.limits.requests_per_minute),
                    limit(w.limits.input_tokens_per_minute),
                    limit(w.limits.output_tokens_per_minute),
                    limit(w.limits.monthly_budget_minor),
                    w.name
                );
            }
        }
        WorkspaceCommand::Set {
            tenant,
            workspace,
            rename,
            limits,
        } => {
            let id = TenantId(tenant_id(pool, &tenant).await?);
            let w = workspaces::find_workspace(pool, id, &workspace).await?;
            let patch = limits.workspace(rename);
            let w = workspaces::update_workspace(
                pool,
                actor,
                id,
                cachet_common::WorkspaceId(w.id),
                &patch,
            )
            .await?;
            if patch.touches_budget() {
                control::alerts::check_now(pool, id.as_uuid()).await;
            }
            print_json(&w)?;
        }
        WorkspaceCommand::Archive {
            tenant,
            workspace,
            yes,
        } => {
            if !yes {
                bail!("archiving {workspace} revokes its keys for good; add --yes to do it");
            }
            let id = TenantId(tenant_id(pool, &tenant).await?);
            let w = workspaces::find_workspace(pool, id, &workspace).await?;
            workspaces::archive_workspace(pool, actor, id, cachet_common::WorkspaceId(w.id))
                .await?;
            println!("workspace {} archived; its keys are revoked", w.name);
        }
    }
    Ok(())
}

/// `cachet admin key …`: API keys.
async fn key(
    pool: &PgPool,
    actor: &Actor,
    config: &crate::config::Config,
    command: KeyCommand,
) -> anyhow::Result<()> {
    match command {
        KeyCommand::Create {
            tenant,
            name,
            workspace,
            expires,
        } => {
            let t = tenants::find_tenant(pool, &tenant)
                .await?
                .with_context(|| format!("no tenant {tenant}"))?;
            let ws = match workspace {
                Some(w) => {
                    cachet_common::WorkspaceId(workspaces::find_workspace(pool, t.id, &w).await?.id)
                }
                None => t.default_workspace,
            };
            let k = keys::create_key_in(pool, actor, &t, ws, &name, expires).await?;
            eprintln!(
                "key {} created for tenant {}; the secret is shown once:",
                k.id, t.name
            );
            println!("{}", k.secret);
        }
        KeyCommand::List { tenant } => {
            let id = tenant_id(pool, &tenant).await?;
            println!(
                "{:<36}  {:<8}  {:<16}  {:<20}  {:<20}  name",
                "id", "state", "prefix", "last used", "expires"
            );
            for k in keys::list_keys(pool, TenantId(id)).await? {
                println!(
                    "{}  {:<8}  {:<16}  {:<20}  {:<20}  {}",
                    k.id,
                    format!("{:?}", k.state).to_lowercase(),
                    k.prefix,
                    time(k.last_used_at),
                    time(k.expires_at),
                    k.name
                );
            }
        }
        KeyCommand::Revoke { id } => {
            keys::revoke_key(pool, actor, None, id.into()).await?;
            println!("revoked: refused by running gateways within seconds");
        }
        KeyCommand::Rotate {
            id,
            grace,
            idempotency_key,
            expires,
        } => {
            let server_key =
                (!config.admin_jwt_secret.is_empty()).then_some(config.admin_jwt_secret.as_bytes());
            let r = keys::rotate_key(
                pool,
                actor,
                &keys::RotateRequest {
                    tenant: None,
                    key: id,
                    grace,
                    idempotency_key: idempotency_key.as_deref(),
                    expires_at: expires,
                },
                server_key,
            )
            .await?;
            eprintln!(
                "key {} replaces {}; the old secret works until {}{}",
                r.new.id,
                r.old.id,
                time(Some(r.grace_until)),
                if r.replayed {
                    " (a retry of an earlier rotation)"
                } else {
                    ""
                }
            );
            match r.secret {
                Some(s) => println!("{s}"),
                None => bail!(
                    "the new key's secret can no longer be shown (its replay window has passed)"
                ),
            }
        }
        KeyCommand::Expire { id, at, never } => {
            if at.is_none() && !never {
                bail!("give --at TIME or --never");
            }
            let k = keys::set_key_expiry(pool, actor, None, id, at).await?;
            println!("key {} expires {}", k.id, time(k.expires_at));
        }
    }
    Ok(())
}

/// `cachet admin policy …`: a tenant's limits and cache policy.
async fn policy_cmd(pool: &PgPool, actor: &Actor, command: PolicyCommand) -> anyhow::Result<()> {
    match command {
        PolicyCommand::Show { tenant } => {
            let id = tenant_id(pool, &tenant).await?;
            print_json(&policy::get_policy(pool, TenantId(id)).await?)?;
        }
        PolicyCommand::Set(s) => {
            let id = tenant_id(pool, &s.tenant).await?;
            let patch = policy::PolicyPatch {
                limits: s.limits.patch(),
                key_requests_per_minute: given(s.key_rpm),
                key_input_tokens_per_minute: given(s.key_input_tpm),
                key_output_tokens_per_minute: given(s.key_output_tpm),
                budget_alert_percent: s.budget_alert_percent,
                cache_resident_bytes: given(s.cache_bytes),
                reserved_cache_bytes: given(s.reserved_bytes),
                allow_1h_ttl: s.allow_1h_ttl,
                replication_factor: given(s.replication)
                    .map(|r| r.map(|r| i32::try_from(r).unwrap_or(i32::MAX))),
                engine_weight: s.engine_weight,
                max_concurrent: given(s.max_concurrent)
                    .map(|r| r.map(|r| i32::try_from(r).unwrap_or(i32::MAX))),
                max_cache_ttl_secs: s.max_cache_ttl_secs,
                ceilings: s.ceilings,
                rest: Default::default(),
            };
            let p = policy::patch_policy(
                pool,
                actor,
                TenantId(id),
                &patch,
                policy::PatchedBy::Platform,
            )
            .await?;
            if patch.touches_budget() {
                control::alerts::check_now(pool, id).await;
            }
            print_json(&p)?;
        }
    }
    Ok(())
}

/// What `cachet admin usage` asks for.
struct UsageArgs {
    tenant: String,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    granularity: String,
    by: String,
    workspace: Option<String>,
}

/// `cachet admin usage`: a tenant's usage, cost and savings over time.
async fn usage(pool: &PgPool, a: UsageArgs) -> anyhow::Result<()> {
    let id = tenant_id(pool, &a.tenant).await?;
    let granularity =
        serde_json::from_value(json!(a.granularity)).context("--granularity: hour or day")?;
    // `tag:NAME` splits by the value of one tag of each key.
    let (by, tag) = match a.by.strip_prefix("tag:") {
        Some(t) => ("tag", Some(t.to_string())),
        None => (a.by.as_str(), None),
    };
    let group_by = serde_json::from_value(json!(by))
        .context("--by: none, model, api_key, workspace or tag:NAME")?;
    let key_tags: Option<std::collections::HashMap<uuid::Uuid, String>> = match &tag {
        Some(t) => Some(
            control::tenants::directory::key_tags(pool, id)
                .await?
                .into_iter()
                .filter_map(|(k, tags)| tags.get(t).map(|v| (k, v.clone())))
                .collect(),
        ),
        None => None,
    };
    let workspace = match &a.workspace {
        Some(w) => Some(workspaces::find_workspace(pool, TenantId(id), w).await?.id),
        None => None,
    };
    let key_workspaces = control::tenants::directory::key_workspaces(pool, id).await?;
    let q = billing::dashboard::UsageQuery {
        tenant: id,
        from: a.from,
        to: a.to,
        granularity,
        group_by,
        workspace,
        key_workspaces: Some(&key_workspaces),
        key_tags: key_tags.as_ref(),
    };
    let r = billing::dashboard::usage(pool, &q).await?;
    print_json(&r)?;
    Ok(())
}

/// `cachet admin budget`: a tenant's spend this month against its budget.
async fn budget(pool: &PgPool, tenant: String) -> anyhow::Result<()> {
    let id = tenant_id(pool, &tenant).await?;
    let p = policy::get_policy(pool, TenantId(id)).await?;
    let now = Utc::now();
    let (currency, spent) = billing::dashboard::month_spend(pool, id, None, now).await?;
    let (_, resets) = billing::dashboard::month_of(now);
    let money = |m: i64| format!("{} {currency}", billing::money::format_minor(m, &currency));
    println!(
        "spent this month: {}; budget: {}; alert at {}%; resets {}",
        money(spent),
        p.limits
            .monthly_budget_minor
            .map(money)
            .unwrap_or_else(|| "none".into()),
        p.budget_alert_percent,
        time(Some(resets))
    );
    Ok(())
}

/// `cachet admin cache`: a tenant's cache on the running service.
async fn cache(
    pool: &PgPool,
    config: &crate::config::Config,
    tenant: String,
    url: String,
) -> anyhow::Result<()> {
    let id = tenant_id(pool, &tenant).await?;
    let jwt = crate::server::admin_jwt(config)?.context(
        "set CACHET_ADMIN_JWT_SECRET: the cache view is read from the running service's admin API",
    )?;
    let token = jwt.issue(
        &format!("cli:{}", std::env::var("USER").unwrap_or_default()),
        Role::PlatformAdmin,
        None,
        std::time::Duration::from_secs(60),
    )?;
    let resp = reqwest::Client::new()
        .get(format!(
            "{}/v1/admin/tenants/{id}/cache",
            url.trim_end_matches('/')
        ))
        .bearer_auth(token)
        .send()
        .await
        .with_context(|| format!("asking {url}"))?;
    let status = resp.status();
    let body: serde_json::Value = resp.json().await?;
    if !status.is_success() {
        bail!("{url} answered {status}: {body}");
    }
    print_json(&body)?;
    Ok(())
}

/// `cachet admin audit …`: the audit log.
async fn audit(pool: &PgPool, command: AuditCommand) -> anyhow::Result<()> {
    match command {
        AuditCommand::List {
            tenant,
            action,
            limit,
        } => {
            let tenant = match tenant {
                Some(t) => Some(tenant_id(pool, &t).await?),
                None => None,
            };
            let f = tenants::audit::Filter {
                tenant,
                action,
                ..Default::default()
            };
            for r in tenants::audit::list(pool, &f, limit).await? {
                println!(
                    "{:>6}  {}  {:<24}  {:<18}  {}",
                    r.id,
                    time(Some(r.at)),
                    r.actor,
                    r.action,
                    r.target.unwrap_or_default()
                );
            }
        }
        AuditCommand::Export {
            from,
            to,
            tenant,
            format,
        } => {
            use futures::StreamExt;
            use std::io::Write;
            if format != "jsonl" && format != "csv" {
                bail!("--format: jsonl or csv");
            }
            let tenant = match tenant {
                Some(t) => Some(tenant_id(pool, &t).await?),
                None => None,
            };
            let f = tenants::audit::Filter {
                tenant,
                from,
                to,
                ..Default::default()
            };
            let mut out = std::io::BufWriter::new(std::io::stdout().lock());
            if format == "csv" {
                out.write_all(control::admin::handlers::AUDIT_CSV_HEADER)?;
            }
            let mut rows = std::pin::pin!(tenants::audit::stream(pool, f));
            while let Some(r) = rows.next().await {
                let r = r?;
                if format == "csv" {
                    out.write_all(&control::admin::handlers::audit_csv(&r))?;
                } else {
                    serde_json::to_writer(&mut out, &r)?;
                    out.write_all(b"\n")?;
                }
            }
            out.flush()?;
        }
    }
    Ok(())
}

/// `cachet admin user …`: admin console users.
async fn user(pool: &PgPool, actor: &Actor, command: UserCommand) -> anyhow::Result<()> {
    match command {
        UserCommand::Create {
            username,
            role,
            tenant,
            password_file,
        } => {
            let role =
                Role::parse(&role).context("--role: platform_admin, tenant_admin or finance")?;
            let tenant = match tenant {
                Some(t) => Some(tenant_id(pool, &t).await?),
                None => None,
            };
            let (password, generated) = read_password(password_file)?;
            let u = control::admin::login::create_user(
                pool,
                actor,
                control::admin::login::NewUser {
                    username,
                    password: password.clone(),
                    role,
                    tenant,
                },
            )
            .await?;
            eprintln!("user {} ({}) created", u.username, role.as_str());
            if generated {
                eprintln!("its password, shown once:");
                println!("{password}");
            }
        }
        UserCommand::List => {
            for u in control::admin::login::users(pool, None).await? {
                println!(
                    "{:<24}  {:<15}  {:<36}  last login {}  {}",
                    u.username,
                    u.role.as_str(),
                    u.tenant
                        .map(|t| t.to_string())
                        .unwrap_or_else(|| "-".into()),
                    time(u.last_login_at),
                    if u.disabled_at.is_some() {
                        "disabled"
                    } else if u.locked_until.is_some_and(|l| l > Utc::now()) {
                        "locked"
                    } else {
                        ""
                    }
                );
            }
        }
        UserCommand::Disable { username } => {
            let id = user_id(pool, &username).await?;
            control::admin::login::disable(pool, actor, id).await?;
            println!("user {username} disabled; its sessions are ended");
        }
        UserCommand::Unlock { username } => {
            let id = user_id(pool, &username).await?;
            control::admin::login::unlock(pool, actor, id).await?;
            println!("user {username} unlocked");
        }
        UserCommand::Passwd {
            username,
            password_file,
        } => {
            let id = user_id(pool, &username).await?;
            let (password, generated) = read_password(password_file)?;
            control::admin::passwords::set_password(pool, actor, id, password.clone()).await?;
            eprintln!("password of {username} set; its sessions have ended");
            if generated {
                println!("{password}");
            }
        }
        UserCommand::Reset { username } => {
            let id = user_id(pool, &username).await?;
            let r = control::admin::passwords::issue_reset(pool, actor, id).await?;
            eprintln!(
                "one-time reset secret for {username}, valid until {} (shown once):",
                r.expires_at
                    .to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
            );
            println!("{}", r.reset_secret);
        }
    }
    Ok(())
}

/// A password from `file` (`-`: standard input), or a random one (and whether it was made).
fn read_password(file: Option<std::path::PathBuf>) -> anyhow::Result<(String, bool)> {
    let text = match file {
        Some(p) if p.as_os_str() == "-" => {
            let mut s = String::new();
            std::io::stdin().read_to_string(&mut s)?;
            s
        }
        Some(p) => {
            std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?
        }
        None => return Ok((random_password()?, true)),
    };
    Ok((text.trim_end_matches(['\r', '\n']).to_string(), false))
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Admin {
        #[command(subcommand)]
        command: Command,
    }

    #[test]
    fn a_tenant_and_a_workspace_take_the_same_limit_flags() {
        let flags = [
            "--rpm",
            "600",
            "--input-tpm",
            "none",
            "--budget-minor",
            "5000",
        ];
        let parse =
            |args: &[&str]| Admin::try_parse_from(["admin"].iter().chain(args).chain(&flags));
        let Command::Policy {
            command: PolicyCommand::Set(set),
        } = parse(&["policy", "set", "acme", "--key-rpm", "5"])
            .unwrap()
            .command
        else {
            panic!("not a policy set");
        };
        let LimitArgs {
            rpm,
            input_tpm,
            output_tpm,
            budget_minor,
        } = set.limits;
        assert_eq!(
            [rpm, input_tpm, output_tpm, budget_minor].map(given),
            [Some(Some(600)), Some(None), None, Some(Some(5000))]
        );
        assert_eq!(given(set.key_rpm), Some(Some(5)));
        let Command::Workspace {
            command: WorkspaceCommand::Create { limits, .. },
        } = parse(&["workspace", "create", "--tenant", "acme", "research"])
            .unwrap()
            .command
        else {
            panic!("not a workspace create");
        };
        let p = limits.patch();
        assert_eq!(p.requests_per_minute, Some(Some(600)));
        assert_eq!(p.input_tokens_per_minute, Some(None));
        assert_eq!(p.monthly_budget_minor, Some(Some(5000)));
        assert!(parse(&["policy", "set", "acme", "--rpm", "many"]).is_err());
    }
}
