//! A tenant's policy: rate limits, monthly spend budget, cache quota and reservation, whether
//! `1h` TTLs may be written, its replication factor, and its share of the engines (weight and
//! concurrency cap under weighted fair queuing).
//!
//! A tenant admin may tighten or loosen the limits that protect the tenant from itself (rate
//! limits, budget, `1h` TTLs); what costs the platform capacity (resident and reserved cache
//! bytes, replication) is the platform admin's. Reserved bytes are part of the tenant's plan
//! (they are billed per GB-hour), so changing them adds a plan version from now on.

use cachet_common::TenantId;

use serde::{Deserialize, Serialize};
use serde_json::json;
use sqlx::{PgPool, Row};
use utoipa::ToSchema;
use uuid::Uuid;

use super::AdminError;
use super::audit::{self, Actor};
pub use super::ceilings::CACHE_TTL_SECS_RANGE;
use super::ceilings::{Ceilings, CeilingsPatch};
use super::limits::{self, Limits, LimitsPatch, NoOtherFields, at_least, present, set};

/// Limits and cache policy of a tenant; `None` is "no limit" (or, for the replication
/// factor, the cluster's default).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, ToSchema)]
pub struct Policy {
    /// The whole tenant's limits (every key and workspace together).
    #[serde(flatten)]
    pub limits: Limits,
    /// The same three rate limits for each key of the tenant ([`Policy::key_limits`]).
    pub key_requests_per_minute: Option<i64>,
    pub key_input_tokens_per_minute: Option<i64>,
    pub key_output_tokens_per_minute: Option<i64>,
    /// Share of the budget (percent) at which an alert is raised.
    pub budget_alert_percent: i32,
    /// Hard cap on KV bytes resident in the cache fabric (one copy of each block).
    pub cache_resident_bytes: Option<i64>,
    /// Bytes no other tenant's writes can take (the plan's reservation, billed).
    pub reserved_cache_bytes: Option<i64>,
    /// Whether breakpoints may ask for a `1h` TTL (refused with 403 otherwise).
    pub allow_1h_ttl: bool,
    /// Fabric nodes holding each block (the cluster's default when unset).
    pub replication_factor: Option<i32>,
    /// The tenant's weight in each model's fair queue for engine workers (1 to 100): while
    /// tenants wait, each gets turns in proportion to its weight.
    pub engine_weight: i32,
    /// Generations of this tenant running at once per model, at most (none: no cap beyond
    /// the model's workers).
    pub max_concurrent: Option<i32>,
    /// The longest a cache object (or OpenAI's 24h retention) may be held, in seconds: from
    /// 300 (5 minutes) to 2,592,000 (30 days).
    pub max_cache_ttl_secs: i32,
    /// The platform's ceilings for this tenant: each value above stays at or below its
    /// ceiling (only a platform admin changes them; decision 0036).
    pub ceilings: Ceilings,
}

/// The default of [`Policy::max_cache_ttl_secs`]: a day.
pub const DEFAULT_MAX_CACHE_TTL_SECS: i32 = 86_400;

impl Policy {
    /// Each key's limits: the policy's `key_*` rate limits (a key has no budget of its own).
    pub fn key_limits(&self) -> Limits {
        Limits {
            requests_per_minute: self.key_requests_per_minute,
            input_tokens_per_minute: self.key_input_tokens_per_minute,
            output_tokens_per_minute: self.key_output_tokens_per_minute,
            monthly_budget_minor: None,
        }
    }

    /// This policy with every value above `ceilings` lowered to them: the rule for existing
    /// values when a ceiling is set or lowered. No limit under a ceiling becomes the ceiling
    /// (at the tenant's level, none is above any ceiling); `1h` TTLs are turned off where the
    /// ceiling forbids them; the per-key defaults stay within the tenant's lowered limits.
    pub fn lowered_to(mut self, c: &Ceilings) -> Policy {
        self.limits = self.limits.lowered_to(&c.limits).or(&c.limits);
        self.allow_1h_ttl &= c.allow_1h_ttl;
        if let Some(cap) = c.max_cache_ttl_secs {
            self.max_cache_ttl_secs = self.max_cache_ttl_secs.min(cap);
        }
        if let Some(cap) = c.max_concurrent {
            self.max_concurrent = Some(self.max_concurrent.map_or(cap, |m| m.min(cap)));
        }
        self.lower_key_defaults()
    }

    /// The per-key defaults lowered to the tenant's own limits where above them.
    fn lower_key_defaults(mut self) -> Policy {
        let keys = self.key_limits().lowered_to(&self.limits);
        self.key_requests_per_minute = keys.requests_per_minute;
        self.key_input_tokens_per_minute = keys.input_tokens_per_minute;
        self.key_output_tokens_per_minute = keys.output_tokens_per_minute;
        self
    }

    /// The first of this policy's values above `ceilings`, as a sentence naming the field and
    /// its ceiling; `None` when the policy is within them.
    pub fn above(&self, c: &Ceilings) -> Option<String> {
        let said = |name: &str, what: String, cap: String| {
            Some(format!(
                "{name}: {what} is above this tenant's ceiling of {cap}, set by the platform's administrators; choose a value up to it"
            ))
        };
        let over = |name: &str, own: Option<i64>, cap: Option<i64>| match (own, cap) {
            (None, Some(c)) => said(name, "no limit".into(), c.to_string()),
            (Some(v), Some(c)) if v > c => said(name, v.to_string(), c.to_string()),
            _ => None,
        };
        let limits = self.limits.fields().into_iter().zip(c.limits.fields());
        if let Some(e) = limits
            .into_iter()
            .find_map(|((name, own), (_, cap))| over(name, own, cap))
        {
            return Some(e);
        }
        if self.allow_1h_ttl && !c.allow_1h_ttl {
            return Some(
                "allow_1h_ttl: the platform's administrators do not allow 1h TTLs for this tenant"
                    .into(),
            );
        }
        over(
            "max_cache_ttl_secs",
            Some(self.max_cache_ttl_secs.into()),
            c.max_cache_ttl_secs.map(i64::from),
        )
        .or_else(|| {
            over(
                "max_concurrent",
                self.max_concurrent.map(i64::from),
                c.max_concurrent.map(i64::from),
            )
        })
    }
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            limits: Limits::default(),
            key_requests_per_minute: None,
            key_input_tokens_per_minute: None,
            key_output_tokens_per_minute: None,
            budget_alert_percent: 80,
            cache_resident_bytes: None,
            reserved_cache_bytes: None,
            allow_1h_ttl: true,
            replication_factor: None,
            engine_weight: 1,
            max_concurrent: None,
            max_cache_ttl_secs: DEFAULT_MAX_CACHE_TTL_SECS,
            ceilings: Ceilings::default(),
        }
    }
}

/// A tenant as the change feed applies it: deleted or not, and its policy.
pub struct Standing {
    pub tenant: Uuid,
    pub deleted: bool,
    pub policy: Policy,
}

/// The standing of every tenant (deleted ones too), or of those in `only`.
pub async fn standings(pool: &PgPool, only: Option<&[Uuid]>) -> Result<Vec<Standing>, AdminError> {
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT t.id, t.deleted_at IS NOT NULL AS deleted, {COLUMNS} FROM tenants t \
         LEFT JOIN tenant_quotas q ON q.tenant_id = t.id WHERE $1::UUID[] IS NULL OR t.id = ANY($1)",
    )))
    .bind(only)
    .fetch_all(pool)
    .await?;
    let reserved = billing::prices::reserved_cache_bytes(pool, only).await?;
    Ok(rows
        .iter()
        .map(|r| {
            let tenant: Uuid = r.get("id");
            Standing {
                tenant,
                deleted: r.get("deleted"),
                policy: Policy {
                    reserved_cache_bytes: reserved.get(&tenant).copied(),
                    ..from_row(r)
                },
            }
        })
        .collect())
}

/// The policy columns, read from `tenant_quotas q`; the reservation is the plan's (billing's):
/// [`reserved`].
pub(crate) const COLUMNS: &str = "q.requests_per_minute, q.input_tokens_per_minute, \
    q.output_tokens_per_minute, q.key_requests_per_minute, q.key_input_tokens_per_minute, \
    q.key_output_tokens_per_minute, q.cache_resident_bytes, q.monthly_budget_minor, \
    q.budget_alert_percent, q.allow_1h_ttl, q.replication_factor, q.engine_weight, \
    q.max_concurrent, q.max_cache_ttl_secs, q.ceiling_requests_per_minute, \
    q.ceiling_input_tokens_per_minute, q.ceiling_output_tokens_per_minute, \
    q.ceiling_monthly_budget_minor, q.ceiling_allow_1h_ttl, q.ceiling_max_cache_ttl_secs, \
    q.ceiling_max_concurrent";

/// The ceilings as `tenant_quotas` names their columns.
const CEILING_COLUMNS: [&str; 4] = [
    "ceiling_requests_per_minute",
    "ceiling_input_tokens_per_minute",
    "ceiling_output_tokens_per_minute",
    "ceiling_monthly_budget_minor",
];

/// `policy` of `tenant` with the cache capacity its plan in force reserves.
pub(crate) async fn reserved(
    pool: &PgPool,
    tenant: Uuid,
    policy: Policy,
) -> Result<Policy, sqlx::Error> {
    let reserved =
        billing::prices::reserved_cache_bytes(pool, Some(std::slice::from_ref(&tenant))).await?;
    Ok(Policy {
        reserved_cache_bytes: reserved.get(&tenant).copied(),
        ..policy
    })
}

pub(crate) fn from_row(r: &sqlx::postgres::PgRow) -> Policy {
    Policy {
        limits: Limits::from_row(r, &super::limits::TENANT_COLUMNS),
        key_requests_per_minute: r.get("key_requests_per_minute"),
        key_input_tokens_per_minute: r.get("key_input_tokens_per_minute"),
        key_output_tokens_per_minute: r.get("key_output_tokens_per_minute"),
        budget_alert_percent: r
            .get::<Option<i16>, _>("budget_alert_percent")
            .map(i32::from)
            .unwrap_or(80),
        cache_resident_bytes: r.get("cache_resident_bytes"),
        reserved_cache_bytes: None,
        allow_1h_ttl: r.get::<Option<bool>, _>("allow_1h_ttl").unwrap_or(true),
        replication_factor: r.get::<Option<i16>, _>("replication_factor").map(i32::from),
        engine_weight: r
            .get::<Option<i16>, _>("engine_weight")
            .map_or(1, i32::from),
        max_concurrent: r.get("max_concurrent"),
        max_cache_ttl_secs: r
            .get::<Option<i32>, _>("max_cache_ttl_secs")
            .unwrap_or(DEFAULT_MAX_CACHE_TTL_SECS),
        ceilings: Ceilings {
            limits: Limits::from_row(r, &CEILING_COLUMNS),
            // A tenant without a quota row has no ceilings.
            allow_1h_ttl: r
                .get::<Option<bool>, _>("ceiling_allow_1h_ttl")
                .unwrap_or(true),
            max_cache_ttl_secs: r.get("ceiling_max_cache_ttl_secs"),
            max_concurrent: r.get("ceiling_max_concurrent"),
        },
    }
}

/// A change to a policy (JSON merge patch: absent = unchanged, `null` = no limit).
#[derive(Clone, Debug, Default, Deserialize, ToSchema)]
pub struct PolicyPatch {
    /// The whole tenant's limits.
    #[serde(flatten)]
    pub limits: LimitsPatch,
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<i64>)]
    pub key_requests_per_minute: Option<Option<i64>>,
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<i64>)]
    pub key_input_tokens_per_minute: Option<Option<i64>>,
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<i64>)]
    pub key_output_tokens_per_minute: Option<Option<i64>>,
    #[serde(default)]
    pub budget_alert_percent: Option<i32>,
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<i64>)]
    pub cache_resident_bytes: Option<Option<i64>>,
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<i64>)]
    pub reserved_cache_bytes: Option<Option<i64>>,
    #[serde(default)]
    pub allow_1h_ttl: Option<bool>,
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<i32>)]
    pub replication_factor: Option<Option<i32>>,
    #[serde(default)]
    pub engine_weight: Option<i32>,
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<i32>)]
    pub max_concurrent: Option<Option<i32>>,
    #[serde(default)]
    pub max_cache_ttl_secs: Option<i32>,
    /// The platform's ceilings (a platform admin's only): values above a lowered ceiling
    /// are lowered to it.
    #[serde(default)]
    pub ceilings: Option<CeilingsPatch>,
    #[serde(flatten)]
    #[schema(ignore)]
    pub rest: NoOtherFields,
}

impl PolicyPatch {
    /// Whether the patch changes the monthly budget or its alert threshold.
    pub fn touches_budget(&self) -> bool {
        self.limits.touches_budget() || self.budget_alert_percent.is_some()
    }
}

impl PolicyPatch {
    /// Fields only a platform admin may change, named if this patch touches one.
    pub fn platform_fields(&self) -> Vec<&'static str> {
        let mut out = Vec::new();
        if self.cache_resident_bytes.is_some() {
            out.push("cache_resident_bytes");
        }
        if self.reserved_cache_bytes.is_some() {
            out.push("reserved_cache_bytes");
        }
        if self.replication_factor.is_some() {
            out.push("replication_factor");
        }
        if self.engine_weight.is_some() {
            out.push("engine_weight");
        }
        if self.ceilings.is_some() {
            out.push("ceilings");
        }
        out
    }

    /// `policy` with this patch applied, validated: new ceilings first (what is above them
    /// is lowered to them), then the values the patch sets, which must be within them (a
    /// tenant admin asking for more is refused as forbidden, a platform admin as invalid).
    pub fn apply(&self, mut p: Policy, by: PatchedBy) -> Result<Policy, AdminError> {
        if let Some(c) = &self.ceilings {
            p.ceilings = c.apply(p.ceilings)?;
            let ceilings = p.ceilings;
            p = p.lowered_to(&ceilings);
        }
        // Lowered tenant limits lower the per-key defaults this patch leaves alone; one it
        // sets above them is refused below.
        p.limits = self.limits.apply(p.limits);
        p = p.lower_key_defaults();
        set(&mut p.key_requests_per_minute, self.key_requests_per_minute);
        set(
            &mut p.key_input_tokens_per_minute,
            self.key_input_tokens_per_minute,
        );
        set(
            &mut p.key_output_tokens_per_minute,
            self.key_output_tokens_per_minute,
        );
        set(&mut p.budget_alert_percent, self.budget_alert_percent);
        set(&mut p.cache_resident_bytes, self.cache_resident_bytes);
        set(&mut p.reserved_cache_bytes, self.reserved_cache_bytes);
        set(&mut p.allow_1h_ttl, self.allow_1h_ttl);
        set(&mut p.replication_factor, self.replication_factor);
        set(&mut p.engine_weight, self.engine_weight);
        set(&mut p.max_concurrent, self.max_concurrent);
        set(&mut p.max_cache_ttl_secs, self.max_cache_ttl_secs);
        validate(&p)?;
        if let Some(e) = p.above(&p.ceilings) {
            return Err(match by {
                PatchedBy::TenantAdmin => AdminError::Forbidden(e),
                PatchedBy::Platform => AdminError::Invalid(e),
            });
        }
        p.key_limits().within(&p.limits, "key_", "the tenant's")?;
        Ok(p)
    }
}

/// The rules every stored policy keeps, with the API's error texts.
pub fn validate(p: &Policy) -> Result<(), AdminError> {
    p.limits.validate("")?;
    p.key_limits().validate("key_")?;
    at_least("", "cache_resident_bytes", p.cache_resident_bytes, 0)?;
    at_least("", "reserved_cache_bytes", p.reserved_cache_bytes, 0)?;
    if !(1..=100).contains(&p.budget_alert_percent) {
        return Err(AdminError::Invalid(
            "budget_alert_percent: must be between 1 and 100".into(),
        ));
    }
    if let Some(r) = p.replication_factor
        && !(1..=16).contains(&r)
    {
        return Err(AdminError::Invalid(
            "replication_factor: must be between 1 and 16, or null for the cluster's default"
                .into(),
        ));
    }
    if !(1..=100).contains(&p.engine_weight) {
        return Err(AdminError::Invalid(
            "engine_weight: must be between 1 and 100".into(),
        ));
    }
    if p.max_concurrent.is_some_and(|m| m < 1) {
        return Err(AdminError::Invalid(
            "max_concurrent: must be a whole number of at least 1, or null for no limit".into(),
        ));
    }
    if !CACHE_TTL_SECS_RANGE.contains(&p.max_cache_ttl_secs) {
        return Err(AdminError::Invalid(
            "max_cache_ttl_secs: must be between 300 (5 minutes) and 2592000 (30 days)".into(),
        ));
    }
    if let (Some(reserved), Some(cap)) = (p.reserved_cache_bytes, p.cache_resident_bytes)
        && reserved > cap
    {
        return Err(AdminError::Invalid(format!(
            "reserved_cache_bytes: {reserved} is more than cache_resident_bytes ({cap}); a tenant cannot reserve more than it may hold"
        )));
    }
    Ok(())
}

/// A tenant's policy.
pub async fn get_policy(pool: &PgPool, tenant: TenantId) -> Result<Policy, AdminError> {
    let tenant = tenant.as_uuid();
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM tenant_quotas q JOIN tenants t ON t.id = q.tenant_id WHERE q.tenant_id = $1"
    )))
    .bind(tenant)
    .fetch_optional(pool)
    .await?;
    let policy = row
        .map(|r| from_row(&r))
        .ok_or_else(|| AdminError::TenantNotFound(tenant.to_string()))?;
    Ok(reserved(pool, tenant, policy).await?)
}

/// Who patches a policy: the platform may change every field, a tenant admin only the
/// self-service ones (not [`PolicyPatch::platform_fields`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PatchedBy {
    Platform,
    TenantAdmin,
}

/// Apply `patch` to a tenant's policy. When [`PolicyPatch::touches_budget`], the caller
/// checks the tenant's budget alerts next (`alerts::check_now`, a layer above the tenants),
/// so a budget lowered below what was spent alerts now, not at the next request.
pub async fn patch_policy(
    pool: &PgPool,
    actor: &Actor,
    tenant_id: TenantId,
    patch: &PolicyPatch,
    by: PatchedBy,
) -> Result<Policy, AdminError> {
    let tenant = tenant_id.as_uuid();
    let forbidden = patch.platform_fields();
    if by == PatchedBy::TenantAdmin && !forbidden.is_empty() {
        return Err(AdminError::Forbidden(format!(
            "{}: only a platform admin may change this",
            forbidden.join(", ")
        )));
    }
    let before = get_policy(pool, tenant_id).await?;
    let after = patch.apply(before.clone(), by)?;
    if after.reserved_cache_bytes != before.reserved_cache_bytes {
        set_reservation(pool, actor, tenant, after.reserved_cache_bytes).await?;
    }
    let mut tx = pool.begin().await?;
    let update = sqlx::query(
        "UPDATE tenant_quotas SET requests_per_minute = $2, input_tokens_per_minute = $3, \
         output_tokens_per_minute = $4, monthly_budget_minor = $5, key_requests_per_minute = $6, \
         key_input_tokens_per_minute = $7, key_output_tokens_per_minute = $8, cache_resident_bytes = $9, \
         budget_alert_percent = $10, allow_1h_ttl = $11, replication_factor = $12, \
         engine_weight = $13, max_concurrent = $14, max_cache_ttl_secs = $15, \
         ceiling_requests_per_minute = $16, ceiling_input_tokens_per_minute = $17, \
         ceiling_output_tokens_per_minute = $18, ceiling_monthly_budget_minor = $19, \
         ceiling_allow_1h_ttl = $20, ceiling_max_cache_ttl_secs = $21, ceiling_max_concurrent = $22, \
         updated_at = now() WHERE tenant_id = $1",
    )
    .bind(tenant);
    let update = after
        .limits
        .bind(update)
        .bind(after.key_requests_per_minute)
        .bind(after.key_input_tokens_per_minute)
        .bind(after.key_output_tokens_per_minute)
        .bind(after.cache_resident_bytes)
        .bind(after.budget_alert_percent as i16)
        .bind(after.allow_1h_ttl)
        .bind(after.replication_factor.map(|r| r as i16))
        .bind(after.engine_weight as i16)
        .bind(after.max_concurrent)
        .bind(after.max_cache_ttl_secs);
    after
        .ceilings
        .limits
        .bind(update)
        .bind(after.ceilings.allow_1h_ttl)
        .bind(after.ceilings.max_cache_ttl_secs)
        .bind(after.ceilings.max_concurrent)
        .execute(&mut *tx)
        .await?;
    // The workspaces' and keys' limits above the tenant's new ones are lowered to them.
    let (workspaces, keys) = limits::lower_below(&mut tx, tenant).await?;
    let mut change = json!(after);
    if workspaces + keys > 0 {
        change["lowered_to_fit"] = json!({"workspaces": workspaces, "keys": keys});
    }
    audit::Entry::new("policy.update", Some(tenant), tenant)
        .before(json!(before))
        .after(change)
        .commit(tx, actor)
        .await?;
    Ok(after)
}

/// A new plan version from now with `bytes` reserved, keeping the plan's discount and
/// reservation price.
async fn set_reservation(
    pool: &PgPool,
    actor: &Actor,
    tenant: Uuid,
    bytes: Option<i64>,
) -> Result<(), AdminError> {
    let (discount_bp, price) = billing::prices::plan_in_force(pool, tenant)
        .await?
        .map_or((0, 0), |p| (p.discount_bp, p.reserved_nanos_per_gb_hour));
    let now = chrono::Utc::now();
    billing::prices::set_plan(
        pool,
        &billing::prices::Plan {
            tenant_id: tenant,
            effective_from: now,
            discount_bp,
            reserved_cache_bytes: bytes.unwrap_or(0),
            reserved_nanos_per_gb_hour: price,
        },
        &actor.name,
        false,
        now,
    )
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_merge_patch_sets_clears_and_keeps_fields() {
        let p = Policy {
            limits: Limits {
                requests_per_minute: Some(10),
                output_tokens_per_minute: Some(500),
                ..Limits::default()
            },
            ..Policy::default()
        };
        let patch: PolicyPatch = serde_json::from_value(
            json!({"requests_per_minute": 2, "output_tokens_per_minute": null, "allow_1h_ttl": false}),
        )
        .unwrap();
        let q = patch.apply(p, PatchedBy::TenantAdmin).unwrap();
        assert_eq!(q.limits.requests_per_minute, Some(2));
        assert_eq!(
            q.limits.output_tokens_per_minute, None,
            "null clears the limit"
        );
        assert!(!q.allow_1h_ttl);
        assert_eq!(q.budget_alert_percent, 80, "absent fields keep their value");
        assert!(patch.platform_fields().is_empty());
    }

    #[test]
    fn invalid_values_are_refused_with_the_field_named() {
        for (patch, field) in [
            (json!({"requests_per_minute": 0}), "requests_per_minute"),
            (json!({"monthly_budget_minor": -1}), "monthly_budget_minor"),
            (
                json!({"key_output_tokens_per_minute": 0}),
                "key_output_tokens_per_minute",
            ),
            (json!({"budget_alert_percent": 101}), "budget_alert_percent"),
            (json!({"replication_factor": 0}), "replication_factor"),
            (json!({"engine_weight": 0}), "engine_weight"),
            (json!({"engine_weight": 101}), "engine_weight"),
            (json!({"max_concurrent": 0}), "max_concurrent"),
            (
                json!({"cache_resident_bytes": 10, "reserved_cache_bytes": 11}),
                "reserved_cache_bytes",
            ),
        ] {
            let patch: PolicyPatch = serde_json::from_value(patch).unwrap();
            let err = patch
                .apply(Policy::default(), PatchedBy::Platform)
                .unwrap_err()
                .to_string();
            assert!(err.starts_with(field), "{err}");
        }
        assert!(
            serde_json::from_value::<PolicyPatch>(json!({"requests_per_minit": 3})).is_err(),
            "a misspelt field is refused, not ignored"
        );
    }

    #[test]
    fn the_json_keeps_its_flat_field_names() {
        let v = json!(Policy::default());
        let keys: Vec<&str> = v.as_object().unwrap().keys().map(|k| k.as_str()).collect();
        for k in [
            "requests_per_minute",
            "input_tokens_per_minute",
            "output_tokens_per_minute",
            "monthly_budget_minor",
            "key_requests_per_minute",
            "budget_alert_percent",
        ] {
            assert!(keys.contains(&k), "{k} in {v}");
        }
        assert!(!keys.contains(&"limits"), "{v}");
    }

    #[test]
    fn capacity_fields_are_the_platforms() {
        let patch: PolicyPatch = serde_json::from_value(
            json!({"cache_resident_bytes": 1, "replication_factor": 3, "engine_weight": 2}),
        )
        .unwrap();
        assert_eq!(
            patch.platform_fields(),
            vec![
                "cache_resident_bytes",
                "replication_factor",
                "engine_weight"
            ]
        );
        // A tenant may cap its own concurrency.
        let own: PolicyPatch = serde_json::from_value(json!({"max_concurrent": 2})).unwrap();
        assert!(own.platform_fields().is_empty());
    }

    fn ceilings(v: serde_json::Value) -> Ceilings {
        serde_json::from_value::<CeilingsPatch>(v)
            .unwrap()
            .apply(Ceilings::default())
            .unwrap()
    }

    #[test]
    fn a_lowered_ceiling_lowers_every_value_above_it_and_caps_no_limit() {
        let c = ceilings(json!({
            "requests_per_minute": 100, "input_tokens_per_minute": 5000,
            "monthly_budget_minor": 2000, "allow_1h_ttl": false,
            "max_cache_ttl_secs": 3600, "max_concurrent": 4
        }));
        let p = Policy {
            limits: Limits {
                requests_per_minute: Some(500),
                input_tokens_per_minute: Some(1000),
                output_tokens_per_minute: None,
                monthly_budget_minor: None,
            },
            key_requests_per_minute: Some(300),
            key_input_tokens_per_minute: Some(800),
            allow_1h_ttl: true,
            max_cache_ttl_secs: 86_400,
            max_concurrent: None,
            ..Policy::default()
        };
        assert!(p.above(&c).is_some());
        let low = p.lowered_to(&c);
        assert_eq!(low.limits.requests_per_minute, Some(100), "lowered");
        assert_eq!(low.limits.input_tokens_per_minute, Some(1000), "kept");
        assert_eq!(low.limits.output_tokens_per_minute, None, "no ceiling");
        assert_eq!(low.limits.monthly_budget_minor, Some(2000), "none capped");
        assert!(!low.allow_1h_ttl);
        assert_eq!(low.max_cache_ttl_secs, 3600);
        assert_eq!(low.max_concurrent, Some(4));
        assert_eq!(
            low.key_requests_per_minute,
            Some(100),
            "the per-key default stays within the tenant's"
        );
        assert_eq!(low.key_input_tokens_per_minute, Some(800));
        assert_eq!(low.above(&c), None, "what was lowered fits");
    }

    #[test]
    fn each_value_above_its_ceiling_is_named_with_the_ceiling() {
        let c = ceilings(json!({
            "requests_per_minute": 100, "input_tokens_per_minute": 100,
            "output_tokens_per_minute": 100, "monthly_budget_minor": 100,
            "allow_1h_ttl": false, "max_cache_ttl_secs": 3600, "max_concurrent": 2
        }));
        let within = Policy::default().lowered_to(&c);
        assert_eq!(within.above(&c), None);
        type Change = fn(&mut Policy);
        let cases: [(&str, Change); 9] = [
            ("requests_per_minute: 101", |p| {
                p.limits.requests_per_minute = Some(101)
            }),
            ("input_tokens_per_minute: no limit", |p| {
                p.limits.input_tokens_per_minute = None
            }),
            ("output_tokens_per_minute: 1000", |p| {
                p.limits.output_tokens_per_minute = Some(1000)
            }),
            ("monthly_budget_minor: 101", |p| {
                p.limits.monthly_budget_minor = Some(101)
            }),
            ("monthly_budget_minor: no limit", |p| {
                p.limits.monthly_budget_minor = None
            }),
            ("allow_1h_ttl", |p| p.allow_1h_ttl = true),
            ("max_cache_ttl_secs: 3601", |p| p.max_cache_ttl_secs = 3601),
            ("max_concurrent: 3", |p| p.max_concurrent = Some(3)),
            ("max_concurrent: no limit", |p| p.max_concurrent = None),
        ];
        for (said, change) in cases {
            let mut p = within.clone();
            change(&mut p);
            let e = p.above(&c).expect(said);
            assert!(e.starts_with(said), "{e}");
        }
        let mut lower = within.clone();
        lower.limits.requests_per_minute = Some(1);
        lower.max_concurrent = Some(1);
        lower.max_cache_ttl_secs = 300;
        assert_eq!(lower.above(&c), None, "lower is always within");
        let unbounded = Policy {
            limits: Limits {
                requests_per_minute: Some(i64::MAX),
                ..Limits::default()
            },
            max_cache_ttl_secs: 2_592_000,
            ..Policy::default()
        };
        assert_eq!(unbounded.above(&Ceilings::default()), None);
        assert_eq!(
            unbounded.clone().lowered_to(&Ceilings::default()),
            unbounded
        );
    }

    #[test]
    fn a_patch_within_ceilings_passes_and_one_above_is_refused_by_role() {
        let c = ceilings(json!({"requests_per_minute": 100}));
        let p = Policy {
            ceilings: c,
            ..Policy::default()
        }
        .lowered_to(&c);
        let raise: PolicyPatch =
            serde_json::from_value(json!({"requests_per_minute": 200})).unwrap();
        match raise.apply(p.clone(), PatchedBy::TenantAdmin) {
            Err(AdminError::Forbidden(e)) => assert!(e.contains("ceiling of 100"), "{e}"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            raise.apply(p.clone(), PatchedBy::Platform),
            Err(AdminError::Invalid(_))
        ));
        let unlimited: PolicyPatch =
            serde_json::from_value(json!({"requests_per_minute": null})).unwrap();
        assert!(unlimited.apply(p.clone(), PatchedBy::TenantAdmin).is_err());
        let lower: PolicyPatch =
            serde_json::from_value(json!({"requests_per_minute": 50})).unwrap();
        assert_eq!(
            lower
                .apply(p.clone(), PatchedBy::TenantAdmin)
                .unwrap()
                .limits
                .requests_per_minute,
            Some(50)
        );
        // The platform raises the ceiling and the value in one patch.
        let both: PolicyPatch = serde_json::from_value(
            json!({"ceilings": {"requests_per_minute": 300}, "requests_per_minute": 300}),
        )
        .unwrap();
        assert_eq!(
            both.apply(p.clone(), PatchedBy::Platform)
                .unwrap()
                .limits
                .requests_per_minute,
            Some(300)
        );
        assert_eq!(both.platform_fields(), vec!["ceilings"]);
    }

    #[test]
    fn per_key_defaults_stay_within_the_tenants_limits() {
        let p = Policy {
            key_requests_per_minute: Some(300),
            ..Policy::default()
        };
        let lower: PolicyPatch =
            serde_json::from_value(json!({"requests_per_minute": 100})).unwrap();
        let q = lower.apply(p.clone(), PatchedBy::TenantAdmin).unwrap();
        assert_eq!(
            q.key_requests_per_minute,
            Some(100),
            "lowered with the tenant's"
        );
        let above: PolicyPatch = serde_json::from_value(
            json!({"requests_per_minute": 100, "key_requests_per_minute": 150}),
        )
        .unwrap();
        let e = above
            .apply(p, PatchedBy::TenantAdmin)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("key_requests_per_minute: 150 is above the tenant's limit of 100"),
            "{e}"
        );
    }
}
