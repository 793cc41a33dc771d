//! Admission: per-key and per-tenant token buckets for requests, uncached input tokens and
//! output tokens per minute, kept in Redis so every gateway shares them.
//!
//! - Input cost is the prompt minus cache reads (reads never count, as on Anthropic).
//! - Output cost is `max_tokens` at admission; the unused part is refunded at the end.
//! - All buckets of a request are checked and taken atomically (one Lua script).
//! - Limits are each key's, its workspace's (every key of the workspace together) and the
//!   whole tenant's; a request must fit all of them.
//! - **Monthly spend budget**: a tenant (or a workspace) whose spend this month (from the rollups, refreshed
//!   by [`crate::sync`] about every 15 s, so up to a minute or so behind) has reached its
//!   budget is refused with 429 until the month ends. Until its spend is first known, a
//!   tenant is admitted.
//! - Every refusal is counted per tenant, key and limit ([`Admission::take_refusals`]) for the
//!   budget view of the admin console.
//! - **Redis unreachable**: admission falls back to the same buckets kept in this process
//!   (see docs/decisions/0004-admission-when-redis-is-down.md). Requests keep flowing; each
//!   gateway enforces the limits on its own share, so a cluster of N gateways admits at most N×
//!   the limit while Redis is away. `cachet_gateway_admission_total{backend="local"}` counts it.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use cachet_common::{ApiKeyId, TenantId, WorkspaceId};
use chrono::{DateTime, Utc};
use redis::aio::ConnectionManager;

use crate::metrics;
use control::tenants::Principal;
use control::tenants::limits::Limits;

const WINDOW_MS: f64 = 60_000.0;

const SCRIPT: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local n = #KEYS
local refund = tonumber(ARGV[1])
local levels = {}
local deny, wait = 0, 0
for i = 1, n do
  local cap = tonumber(ARGV[2 * i])
  local cost = tonumber(ARGV[2 * i + 1])
  local v = redis.call('HMGET', KEYS[i], 'tokens', 'ts')
  local tokens, ts = tonumber(v[1]), tonumber(v[2])
  if tokens == nil then tokens, ts = cap, now end
  tokens = math.min(cap, tokens + math.max(0, now - ts) * cap / 60000)
  levels[i] = tokens
  if refund == 0 and cost > tokens then
    local w = 60000
    if cost <= cap then w = math.ceil((cost - tokens) * 60000 / cap) end
    if w > wait then deny, wait = i, w end
  end
end
local out = {deny, wait}
for i = 1, n do
  local cost = tonumber(ARGV[2 * i + 1])
  local left = levels[i]
  if deny == 0 then
    if refund == 1 then left = math.min(tonumber(ARGV[2 * i]), left + cost) else left = left - cost end
    redis.call('HSET', KEYS[i], 'tokens', tostring(left), 'ts', now)
    redis.call('PEXPIRE', KEYS[i], 120000)
  end
  out[#out + 1] = math.floor(left)
end
return out
"#;

/// Which limit a bucket enforces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    Requests,
    InputTokens,
    OutputTokens,
}

impl Class {
    pub fn describe(self) -> &'static str {
        match self {
            Class::Requests => "requests per minute",
            Class::InputTokens => "input tokens per minute",
            Class::OutputTokens => "output tokens per minute",
        }
    }

    fn header(self) -> &'static str {
        match self {
            Class::Requests => "requests",
            Class::InputTokens => "input-tokens",
            Class::OutputTokens => "output-tokens",
        }
    }
}

/// Whose limit a bucket is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Holder {
    /// Each API key's own.
    Key,
    /// The key's workspace, every key in it together.
    Workspace,
    /// The whole tenant.
    Tenant,
}

impl Holder {
    fn describe(self) -> &'static str {
        match self {
            Holder::Key => "per API key",
            Holder::Workspace => "for this workspace",
            Holder::Tenant => "for your organization",
        }
    }
}

#[derive(Clone, Debug)]
struct Bucket {
    key: String,
    class: Class,
    /// The policy field this bucket enforces (`key_requests_per_minute`, …).
    limit: &'static str,
    holder: Holder,
    capacity: u64,
    cost: u64,
}

/// What a request asks for.
pub struct Ask<'a> {
    pub principal: &'a Principal,
    pub input_tokens: u64,
    pub output_tokens: u64,
}

/// Remaining capacity per class, for `anthropic-ratelimit-*` headers.
#[derive(Clone, Debug, Default)]
pub struct RateHeaders(pub Vec<(String, String)>);

pub enum Decision {
    Allowed(RateHeaders),
    Denied {
        retry_after_secs: u64,
        /// The policy field that refused it.
        limit: &'static str,
        /// What to tell the client: which limit, and its value.
        message: String,
        headers: RateHeaders,
    },
}

/// A tenant's spend this month, as last computed.
#[derive(Clone, Debug)]
pub struct Spend {
    pub currency: String,
    pub spent_minor: i64,
    /// When the month (and so the budget) resets.
    pub resets_at: DateTime<Utc>,
}

/// Who has a monthly budget: a tenant, or one of its workspaces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Spender {
    Tenant(TenantId),
    Workspace(WorkspaceId),
}

/// A granted admission, to refund unused output tokens against.
pub struct Ticket {
    buckets: Vec<Bucket>,
}

struct Local {
    tokens: f64,
    at: Instant,
}

pub struct Admission {
    client: Option<redis::Client>,
    conn: tokio::sync::Mutex<(Option<ConnectionManager>, Option<Instant>)>,
    timeout: Duration,
    script: redis::Script,
    local: Mutex<HashMap<String, Local>>,
    spend: Mutex<HashMap<Spender, Spend>>,
    refusals: Mutex<HashMap<(TenantId, ApiKeyId, &'static str), u64>>,
}

fn buckets(ask: &Ask<'_>) -> Vec<Bucket> {
    let p = ask.principal;
    let (input, output) = (ask.input_tokens, ask.output_tokens);
    use Class::{InputTokens, OutputTokens, Requests};
    use Holder::{Key, Tenant, Workspace};
    // Each level's limits, narrowest first; a refusal names the limit as the level's JSON does.
    let levels = [
        (Key, p.key_limits()),
        (Workspace, p.workspace_limits),
        (Tenant, p.policy.limits),
    ];
    type Of = fn(&Limits) -> Option<i64>;
    let classes: [(Class, [&'static str; 3], Of, u64); 3] = [
        (
            Requests,
            [
                "key_requests_per_minute",
                "workspace_requests_per_minute",
                "requests_per_minute",
            ],
            |l| l.requests_per_minute,
            1,
        ),
        (
            InputTokens,
            [
                "key_input_tokens_per_minute",
                "workspace_input_tokens_per_minute",
                "input_tokens_per_minute",
            ],
            |l| l.input_tokens_per_minute,
            input,
        ),
        (
            OutputTokens,
            [
                "key_output_tokens_per_minute",
                "workspace_output_tokens_per_minute",
                "output_tokens_per_minute",
            ],
            |l| l.output_tokens_per_minute,
            output,
        ),
    ];
    let spec = classes.into_iter().flat_map(|(class, names, of, cost)| {
        levels
            .iter()
            .zip(names)
            .map(move |((holder, limits), name)| (*holder, class, name, of(limits), cost))
    });
    spec.into_iter()
        .filter_map(|(holder, class, name, limit, cost)| {
            let cap = u64::try_from(limit?).ok().filter(|&c| c > 0)?;
            let k = match holder {
                Key => format!("cachet:rl:k:{}", p.key_id),
                Workspace => format!("cachet:rl:w:{}", p.workspace),
                Tenant => format!("cachet:rl:t:{}", p.tenant),
            };
            Some(Bucket {
                key: format!("{k}:{}", class.header()),
                class,
                limit: name,
                holder,
                capacity: cap,
                cost,
            })
        })
        .collect()
}

fn headers(bs: &[Bucket], remaining: &[u64]) -> RateHeaders {
    let mut out = Vec::new();
    for class in [Class::Requests, Class::InputTokens, Class::OutputTokens] {
        // The tightest bucket of the class is what the client can use.
        let tightest = bs
            .iter()
            .zip(remaining)
            .filter(|(b, _)| b.class == class)
            .min_by(|(a, ra), (b, rb)| {
                (**ra as f64 / a.capacity as f64).total_cmp(&(**rb as f64 / b.capacity as f64))
            });
        if let Some((b, &rem)) = tightest {
            let to_full_ms =
                (b.capacity.saturating_sub(rem)) as f64 * WINDOW_MS / b.capacity as f64;
            let reset = Utc::now() + chrono::Duration::milliseconds(to_full_ms as i64);
            let h = class.header();
            out.push((
                format!("anthropic-ratelimit-{h}-limit"),
                b.capacity.to_string(),
            ));
            out.push((
                format!("anthropic-ratelimit-{h}-remaining"),
                rem.to_string(),
            ));
            out.push((
                format!("anthropic-ratelimit-{h}-reset"),
                reset.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            ));
        }
    }
    RateHeaders(out)
}

impl Admission {
    /// `redis_url` `None` means no Redis at all: limits are kept in this process.
    pub fn new(redis_url: Option<&str>, timeout: Duration) -> Result<Self, redis::RedisError> {
        let client = redis_url.map(redis::Client::open).transpose()?;
        Ok(Self {
            client,
            conn: tokio::sync::Mutex::new((None, None)),
            timeout,
            script: redis::Script::new(SCRIPT),
            local: Mutex::new(HashMap::new()),
            spend: Mutex::new(HashMap::new()),
            refusals: Mutex::new(HashMap::new()),
        })
    }

    /// Record what a tenant (or a workspace) has spent this month (see the module docs).
    pub fn set_spend(&self, who: Spender, spend: Spend) {
        self.spend
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(who, spend);
    }

    /// What a tenant (or a workspace) had spent this month when last computed.
    pub fn spend(&self, who: Spender) -> Option<Spend> {
        self.spend
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&who)
            .cloned()
    }

    /// Refusals since the last call: (tenant, key, limit) → count.
    pub fn take_refusals(&self) -> Vec<(TenantId, ApiKeyId, &'static str, u64)> {
        std::mem::take(&mut *self.refusals.lock().unwrap_or_else(|p| p.into_inner()))
            .into_iter()
            .map(|((t, k, l), n)| (t, k, l, n))
            .collect()
    }

    fn refused(&self, p: &Principal, limit: &'static str) {
        metrics::ADMISSION_REFUSALS
            .with_label_values(&[limit])
            .inc();
        *self
            .refusals
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry((p.tenant, p.key_id, limit))
            .or_default() += 1;
    }

    /// A refusal for the monthly budget, if the tenant (or the key's workspace) has one and
    /// has spent it: the refused limit and the decision.
    fn over_budget(&self, p: &Principal, now: DateTime<Utc>) -> Option<(&'static str, Decision)> {
        let spent = |budget: Option<i64>, who: Spender| {
            let budget = budget?;
            let spend = self.spend(who)?;
            (spend.spent_minor >= budget && spend.resets_at > now).then_some((budget, spend))
        };
        let (limit, whose, (budget, spend)) = match spent(
            p.policy.limits.monthly_budget_minor,
            Spender::Tenant(p.tenant),
        ) {
            Some(s) => ("monthly_budget", "your organization's", s),
            None => (
                "workspace_monthly_budget",
                "this workspace's",
                spent(
                    p.workspace_limits.monthly_budget_minor,
                    Spender::Workspace(p.workspace),
                )?,
            ),
        };
        let money = |m: i64| {
            format!(
                "{} {}",
                billing::money::format_minor(m, &spend.currency),
                spend.currency
            )
        };
        Some((
            limit,
            Decision::Denied {
                retry_after_secs: (spend.resets_at - now).num_seconds().max(1) as u64,
                limit,
                message: format!(
                    "This request would exceed {whose} monthly spend budget of {} ({} spent this month). The budget resets at {}.",
                    money(budget),
                    money(spend.spent_minor),
                    spend
                        .resets_at
                        .to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
                ),
                headers: RateHeaders::default(),
            },
        ))
    }

    async fn connection(&self) -> Option<ConnectionManager> {
        let client = self.client.as_ref()?;
        let mut slot = self.conn.lock().await;
        if let Some(c) = &slot.0 {
            return Some(c.clone());
        }
        // Reconnect at most once a second while Redis is away.
        if slot.1.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
            return None;
        }
        slot.1 = Some(Instant::now());
        match tokio::time::timeout(self.timeout, ConnectionManager::new(client.clone())).await {
            Ok(Ok(c)) => {
                slot.0 = Some(c.clone());
                Some(c)
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "redis unavailable; admission uses local limits");
                None
            }
            Err(_) => {
                tracing::warn!("redis connect timed out; admission uses local limits");
                None
            }
        }
    }

    async fn drop_connection(&self) {
        let mut slot = self.conn.lock().await;
        slot.0 = None;
        slot.1 = Some(Instant::now());
    }

    /// Run the buckets in Redis; `None` if Redis could not answer in time.
    async fn remote(&self, bs: &[Bucket], refund: bool) -> Option<Vec<i64>> {
        let mut conn = self.connection().await?;
        let mut inv = self.script.prepare_invoke();
        inv.arg(u8::from(refund));
        for b in bs {
            inv.key(&b.key).arg(b.capacity).arg(b.cost);
        }
        match tokio::time::timeout(self.timeout, inv.invoke_async::<Vec<i64>>(&mut conn)).await {
            Ok(Ok(v)) => Some(v),
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "redis admission failed; using local limits");
                self.drop_connection().await;
                None
            }
            Err(_) => {
                tracing::warn!("redis admission timed out; using local limits");
                self.drop_connection().await;
                None
            }
        }
    }

    /// The same algorithm as the Lua script, in process.
    fn local(&self, bs: &[Bucket], refund: bool) -> Vec<i64> {
        let mut map = self.local.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let mut levels = Vec::with_capacity(bs.len());
        let (mut deny, mut wait) = (0i64, 0i64);
        for (i, b) in bs.iter().enumerate() {
            let cap = b.capacity as f64;
            let e = map.entry(b.key.clone()).or_insert(Local {
                tokens: cap,
                at: now,
            });
            let level = (e.tokens
                + now.duration_since(e.at).as_secs_f64() * 1000.0 * cap / WINDOW_MS)
                .min(cap);
            levels.push(level);
            if !refund && b.cost as f64 > level {
                let w = if b.cost as f64 <= cap {
                    ((b.cost as f64 - level) * WINDOW_MS / cap).ceil() as i64
                } else {
                    60_000
                };
                if w > wait {
                    deny = i as i64 + 1;
                    wait = w;
                }
            }
        }
        let mut out = vec![deny, wait];
        for (b, level) in bs.iter().zip(levels) {
            let left = if deny != 0 {
                level
            } else if refund {
                (level + b.cost as f64).min(b.capacity as f64)
            } else {
                level - b.cost as f64
            };
            if deny == 0 {
                map.insert(
                    b.key.clone(),
                    Local {
                        tokens: left,
                        at: now,
                    },
                );
            }
            out.push(left.floor() as i64);
        }
        out
    }

    async fn run(&self, bs: &[Bucket], refund: bool) -> Vec<i64> {
        if let Some(v) = self
            .remote(bs, refund)
            .await
            .filter(|v| v.len() == bs.len() + 2)
        {
            metrics::ADMISSION.with_label_values(&["redis"]).inc();
            return v;
        }
        metrics::ADMISSION.with_label_values(&["local"]).inc();
        self.local(bs, refund)
    }

    pub async fn admit(&self, ask: &Ask<'_>) -> (Decision, Ticket) {
        if let Some((limit, refusal)) = self.over_budget(ask.principal, Utc::now()) {
            self.refused(ask.principal, limit);
            return (
                refusal,
                Ticket {
                    buckets: Vec::new(),
                },
            );
        }
        let bs = buckets(ask);
        if bs.is_empty() {
            return (
                Decision::Allowed(RateHeaders::default()),
                Ticket { buckets: bs },
            );
        }
        let v = self.run(&bs, false).await;
        let remaining: Vec<u64> = v[2..].iter().map(|&x| x.max(0) as u64).collect();
        let h = headers(&bs, &remaining);
        if v[0] > 0 {
            let b = &bs[(v[0] - 1) as usize];
            let retry_after_secs = ((v[1] as u64).div_ceil(1000)).max(1);
            self.refused(ask.principal, b.limit);
            return (
                Decision::Denied {
                    retry_after_secs,
                    limit: b.limit,
                    message: format!(
                        "This request would exceed your rate limit of {} {} ({}). Please retry after {}.",
                        b.capacity,
                        b.class.describe(),
                        b.holder.describe(),
                        cachet_common::error::wait_text(retry_after_secs as i64),
                    ),
                    headers: h,
                },
                Ticket {
                    buckets: Vec::new(),
                },
            );
        }
        (Decision::Allowed(h), Ticket { buckets: bs })
    }

    /// Give back output tokens that were reserved but not generated.
    pub async fn refund_output(&self, ticket: Ticket, unused_output: u64) {
        let bs: Vec<Bucket> = ticket
            .buckets
            .into_iter()
            .filter(|b| b.class == Class::OutputTokens)
            .map(|mut b| {
                b.cost = unused_output.min(b.cost);
                b
            })
            .filter(|b| b.cost > 0)
            .collect();
        if !bs.is_empty() {
            self.run(&bs, true).await;
        }
    }
}
