//! Ceilings: the limits a platform admin sets for a tenant, which its tenant admins may lower
//! within but never raise (decision 0036).
//!
//! A ceiling bounds the tenant's own value of the same limit: its rate limits and monthly
//! budget, whether `1h` TTLs may be allowed, the longest cache-object TTL and the generations
//! it may run at once. `None` is no ceiling. The tenant's stored value is always the one in
//! force: lowering a ceiling lowers the tenant's value to it (a value of none, no limit,
//! becomes the ceiling), and a tenant admin asking for more than a ceiling, or for no limit
//! under one, is refused with the ceiling named.
//!
//! How a policy is lowered to its ceilings and checked against them is the policy's
//! ([`super::policy::Policy::lowered_to`], [`super::policy::Policy::above`]); below the tenant
//! the same rule holds one level at a time (`limits::lower_below`): a workspace's
//! limits within the tenant's, a key's within its workspace's and the tenant's.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::AdminError;
use super::limits::{Limits, LimitsPatch, NoOtherFields, present, set};

/// The bounds of a cache-object TTL, a tenant's or its ceiling: 5 minutes to 30 days.
pub const CACHE_TTL_SECS_RANGE: std::ops::RangeInclusive<i32> = 300..=2_592_000;

/// The platform's ceilings for one tenant; `None` is no ceiling.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Ceilings {
    /// Ceilings of the tenant's rate limits and monthly budget.
    #[serde(flatten)]
    pub limits: Limits,
    /// Whether the tenant may allow `1h` TTLs at all.
    pub allow_1h_ttl: bool,
    /// The longest cache-object TTL the tenant may choose, in seconds.
    pub max_cache_ttl_secs: Option<i32>,
    /// The most generations at once per model the tenant may choose.
    pub max_concurrent: Option<i32>,
}

impl Default for Ceilings {
    fn default() -> Self {
        Self {
            limits: Limits::default(),
            allow_1h_ttl: true,
            max_cache_ttl_secs: None,
            max_concurrent: None,
        }
    }
}

/// A change to a tenant's ceilings (JSON merge patch: absent = unchanged, `null` = none).
#[derive(Clone, Debug, Default, Deserialize, ToSchema)]
pub struct CeilingsPatch {
    #[serde(flatten)]
    pub limits: LimitsPatch,
    #[serde(default)]
    pub allow_1h_ttl: Option<bool>,
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<i32>)]
    pub max_cache_ttl_secs: Option<Option<i32>>,
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<i32>)]
    pub max_concurrent: Option<Option<i32>>,
    #[serde(flatten)]
    #[schema(ignore)]
    pub rest: NoOtherFields,
}

impl CeilingsPatch {
    /// `ceilings` with this patch applied, validated.
    pub fn apply(&self, mut c: Ceilings) -> Result<Ceilings, AdminError> {
        c.limits = self.limits.apply(c.limits);
        set(&mut c.allow_1h_ttl, self.allow_1h_ttl);
        set(&mut c.max_cache_ttl_secs, self.max_cache_ttl_secs);
        set(&mut c.max_concurrent, self.max_concurrent);
        c.validate()?;
        Ok(c)
    }
}

impl Ceilings {
    /// The rules every stored ceiling keeps, with the API's error texts.
    pub fn validate(&self) -> Result<(), AdminError> {
        self.limits.validate("ceilings.")?;
        if let Some(t) = self.max_cache_ttl_secs
            && !CACHE_TTL_SECS_RANGE.contains(&t)
        {
            return Err(AdminError::Invalid(
                "ceilings.max_cache_ttl_secs: must be between 300 (5 minutes) and 2592000 (30 days), or null for none".into(),
            ));
        }
        if self.max_concurrent.is_some_and(|m| m < 1) {
            return Err(AdminError::Invalid(
                "ceilings.max_concurrent: must be a whole number of at least 1, or null for none"
                    .into(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_patch_sets_and_clears_ceilings_and_bad_ones_are_refused() {
        let c = serde_json::from_value::<CeilingsPatch>(json!({
            "requests_per_minute": 100, "allow_1h_ttl": false, "max_concurrent": 4
        }))
        .unwrap()
        .apply(Ceilings::default())
        .unwrap();
        assert_eq!(c.limits.requests_per_minute, Some(100));
        assert!(!c.allow_1h_ttl);
        assert_eq!(c.max_concurrent, Some(4));
        let c = serde_json::from_value::<CeilingsPatch>(json!({"max_concurrent": null}))
            .unwrap()
            .apply(c)
            .unwrap();
        assert_eq!(c.max_concurrent, None, "null clears");
        assert_eq!(c.limits.requests_per_minute, Some(100), "absent keeps");
        for (v, field) in [
            (
                json!({"requests_per_minute": 0}),
                "ceilings.requests_per_minute",
            ),
            (
                json!({"monthly_budget_minor": -1}),
                "ceilings.monthly_budget_minor",
            ),
            (
                json!({"max_cache_ttl_secs": 60}),
                "ceilings.max_cache_ttl_secs",
            ),
            (json!({"max_concurrent": 0}), "ceilings.max_concurrent"),
        ] {
            let e = serde_json::from_value::<CeilingsPatch>(v)
                .unwrap()
                .apply(Ceilings::default())
                .unwrap_err()
                .to_string();
            assert!(e.starts_with(field), "{e}");
        }
        assert!(serde_json::from_value::<CeilingsPatch>(json!({"rpm": 1})).is_err());
    }
}
