//! One word for rate and spend limits, whatever holds them: a tenant (its policy), each key of
//! a tenant (the policy's `key_*` fields: no budget of their own yet), a workspace. A request
//! is admitted only within every level's limits (the gateway's admission checks each level in
//! turn), and each level is written as one [`Limits`] and changed by one [`LimitsPatch`].
//!
//! A level's limits are flattened into what holds them, so the API's JSON keeps its flat
//! field names (`requests_per_minute`, …).

use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};
use utoipa::ToSchema;

use sqlx::PgConnection;
use uuid::Uuid;

use super::AdminError;

type PgQuery<'q> = sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>;

/// A tenant's limits as `tenant_quotas` names its columns (`workspaces` names its own the same
/// way, and `api_keys` the first three).
pub(crate) const TENANT_COLUMNS: [&str; 4] = [
    "requests_per_minute",
    "input_tokens_per_minute",
    "output_tokens_per_minute",
    "monthly_budget_minor",
];

/// A workspace's limits as read beside other tables' (`workspaces::LIMIT_COLUMNS`).
pub(crate) const WORKSPACE_COLUMNS: [&str; 4] = [
    "ws_requests_per_minute",
    "ws_input_tokens_per_minute",
    "ws_output_tokens_per_minute",
    "ws_monthly_budget_minor",
];

/// Rate and spend limits at one level; `None` is no limit at this level (the levels above
/// still hold).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Limits {
    /// Requests per minute.
    pub requests_per_minute: Option<i64>,
    /// Uncached input tokens per minute (cache reads never count).
    pub input_tokens_per_minute: Option<i64>,
    /// Output tokens per minute.
    pub output_tokens_per_minute: Option<i64>,
    /// Spend per calendar month (UTC) in minor units of the tenant's currency; requests are
    /// refused with 429 once it is reached.
    pub monthly_budget_minor: Option<i64>,
}

impl Limits {
    /// The rules every stored level keeps, with the API's error texts (the fields named with
    /// `prefix`, as the level's JSON names them).
    pub fn validate(&self, prefix: &str) -> Result<(), AdminError> {
        at_least(prefix, "requests_per_minute", self.requests_per_minute, 1)?;
        at_least(
            prefix,
            "input_tokens_per_minute",
            self.input_tokens_per_minute,
            1,
        )?;
        at_least(
            prefix,
            "output_tokens_per_minute",
            self.output_tokens_per_minute,
            1,
        )?;
        at_least(prefix, "monthly_budget_minor", self.monthly_budget_minor, 0)
    }

    /// The four limits by name, in the order of the fields.
    pub fn fields(&self) -> [(&'static str, Option<i64>); 4] {
        [
            ("requests_per_minute", self.requests_per_minute),
            ("input_tokens_per_minute", self.input_tokens_per_minute),
            ("output_tokens_per_minute", self.output_tokens_per_minute),
            ("monthly_budget_minor", self.monthly_budget_minor),
        ]
    }

    /// The first limit set here and above `parent`'s (both set): its name, its value and the
    /// parent's. A limit with no value here is within any parent's (the parent's still holds).
    pub fn above(&self, parent: &Limits) -> Option<(&'static str, i64, i64)> {
        self.fields()
            .into_iter()
            .zip(parent.fields())
            .find_map(|((name, own), (_, cap))| match (own, cap) {
                (Some(v), Some(c)) if v > c => Some((name, v, c)),
                _ => None,
            })
    }

    /// Refuse limits above `parent`'s, naming the field as `prefix` does and the parent as
    /// `whose` (`the tenant's`, `its workspace's`).
    pub fn within(&self, parent: &Limits, prefix: &str, whose: &str) -> Result<(), AdminError> {
        match self.above(parent) {
            Some((name, v, cap)) => Err(AdminError::Invalid(format!(
                "{prefix}{name}: {v} is above {whose} limit of {cap}; lower it, or raise {whose} first"
            ))),
            None => Ok(()),
        }
    }

    /// These limits lowered to `parent`'s where they are above them; a limit with no value
    /// here stays without one (the parent's holds).
    pub fn lowered_to(&self, parent: &Limits) -> Limits {
        let low = |own: Option<i64>, cap: Option<i64>| match (own, cap) {
            (Some(v), Some(c)) => Some(v.min(c)),
            (own, _) => own,
        };
        Limits {
            requests_per_minute: low(self.requests_per_minute, parent.requests_per_minute),
            input_tokens_per_minute: low(
                self.input_tokens_per_minute,
                parent.input_tokens_per_minute,
            ),
            output_tokens_per_minute: low(
                self.output_tokens_per_minute,
                parent.output_tokens_per_minute,
            ),
            monthly_budget_minor: low(self.monthly_budget_minor, parent.monthly_budget_minor),
        }
    }

    /// These limits where set, `fallback`'s where not.
    pub fn or(&self, fallback: &Limits) -> Limits {
        Limits {
            requests_per_minute: self.requests_per_minute.or(fallback.requests_per_minute),
            input_tokens_per_minute: self
                .input_tokens_per_minute
                .or(fallback.input_tokens_per_minute),
            output_tokens_per_minute: self
                .output_tokens_per_minute
                .or(fallback.output_tokens_per_minute),
            monthly_budget_minor: self.monthly_budget_minor.or(fallback.monthly_budget_minor),
        }
    }

    /// `q` with the four limits bound next, in the order of the fields (the SQL names
    /// `requests_per_minute`, `input_tokens_per_minute`, `output_tokens_per_minute` and
    /// `monthly_budget_minor` as four consecutive parameters).
    pub(crate) fn bind<'q>(&self, q: PgQuery<'q>) -> PgQuery<'q> {
        q.bind(self.requests_per_minute)
            .bind(self.input_tokens_per_minute)
            .bind(self.output_tokens_per_minute)
            .bind(self.monthly_budget_minor)
    }

    /// Read from a row whose columns `names` are the fields, in their order ([`TENANT_COLUMNS`],
    /// [`WORKSPACE_COLUMNS`]).
    pub(crate) fn from_row(r: &sqlx::postgres::PgRow, names: &[&str; 4]) -> Self {
        use sqlx::Row;
        let get = |i: usize| r.get::<Option<i64>, _>(names[i]);
        Self {
            requests_per_minute: get(0),
            input_tokens_per_minute: get(1),
            output_tokens_per_minute: get(2),
            monthly_budget_minor: get(3),
        }
    }
}

/// A change to one level's limits (JSON merge patch: absent = unchanged, `null` = no limit).
#[derive(Clone, Copy, Debug, Default, Deserialize, ToSchema)]
pub struct LimitsPatch {
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<i64>)]
    pub requests_per_minute: Option<Option<i64>>,
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<i64>)]
    pub input_tokens_per_minute: Option<Option<i64>>,
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<i64>)]
    pub output_tokens_per_minute: Option<Option<i64>>,
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<i64>)]
    pub monthly_budget_minor: Option<Option<i64>>,
}

impl LimitsPatch {
    /// Whether the patch changes nothing.
    pub fn is_empty(&self) -> bool {
        self.requests_per_minute.is_none()
            && self.input_tokens_per_minute.is_none()
            && self.output_tokens_per_minute.is_none()
            && self.monthly_budget_minor.is_none()
    }

    /// Whether the patch changes the monthly budget.
    pub fn touches_budget(&self) -> bool {
        self.monthly_budget_minor.is_some()
    }

    /// `limits` with this patch applied (not validated: the holder validates the whole).
    pub fn apply(&self, mut l: Limits) -> Limits {
        set(&mut l.requests_per_minute, self.requests_per_minute);
        set(&mut l.input_tokens_per_minute, self.input_tokens_per_minute);
        set(
            &mut l.output_tokens_per_minute,
            self.output_tokens_per_minute,
        );
        set(&mut l.monthly_budget_minor, self.monthly_budget_minor);
        l
    }
}

/// `Some(None)` for an explicit `null`, `Some(Some(v))` for a value, `None` when absent.
pub fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> Result<Option<Option<T>>, D::Error> {
    Ok(Some(Option::deserialize(d)?))
}

/// A merge patch's field applied: `Some` replaces the value, `None` keeps it.
pub(crate) fn set<T: Copy>(slot: &mut T, v: Option<T>) {
    if let Some(v) = v {
        *slot = v;
    }
}

/// A limit is absent (none) or at least `min`, with the API's error text naming the field.
pub(crate) fn at_least(
    prefix: &str,
    name: &str,
    v: Option<i64>,
    min: i64,
) -> Result<(), AdminError> {
    match v {
        Some(v) if v < min => Err(AdminError::Invalid(format!(
            "{prefix}{name}: must be a whole number of at least {min}, or null for no limit"
        ))),
        _ => Ok(()),
    }
}

/// The last field of a request body that flattens a [`LimitsPatch`] or [`Limits`]: refuses
/// any field nothing else took, as `#[serde(deny_unknown_fields)]` does for a body that
/// flattens nothing (serde cannot combine the two).
#[derive(Clone, Copy, Debug, Default)]
pub struct NoOtherFields;

impl<'de> Deserialize<'de> for NoOtherFields {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Rest;
        impl<'de> Visitor<'de> for Rest {
            type Value = NoOtherFields;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("no other field")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<NoOtherFields, A::Error> {
                match map.next_key::<String>()? {
                    Some(k) => Err(de::Error::custom(format_args!("unknown field `{k}`"))),
                    None => Ok(NoOtherFields),
                }
            }
        }
        d.deserialize_map(Rest)
    }
}

/// Lower the workspaces and keys of `tenant` to fit the levels above them, after the tenant's
/// (or a workspace's) limits were set in this transaction: each workspace's limits to the
/// tenant's, each key's to its workspace's and the tenant's (the tightest of those set). A
/// limit with no value at a level stays so (the levels above hold). Returns how many
/// workspaces and keys were lowered.
pub(crate) async fn lower_below(
    tx: &mut PgConnection,
    tenant: Uuid,
) -> Result<(u64, u64), sqlx::Error> {
    // `col > bound` is NULL (so false) when either is NULL: none at this level stays none, and
    // no bound above leaves the value.
    let fit = |cols: &[&str], table: &str, bound: &dyn Fn(&str) -> String| {
        let sets: Vec<String> = cols
            .iter()
            .map(|c| {
                let b = bound(c);
                format!("{c} = CASE WHEN {table}.{c} > {b} THEN {b} ELSE {table}.{c} END")
            })
            .collect();
        let any: Vec<String> = cols
            .iter()
            .map(|c| format!("{table}.{c} > {}", bound(c)))
            .collect();
        (sets.join(", "), any.join(" OR "))
    };
    let (sets, any) = fit(&TENANT_COLUMNS, "w", &|c| format!("q.{c}"));
    let workspaces = sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE workspaces w SET {sets} FROM tenant_quotas q \
         WHERE q.tenant_id = w.tenant_id AND w.tenant_id = $1 AND ({any})"
    )))
    .bind(tenant)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    // LEAST skips NULLs: the tightest of the workspace's and the tenant's that are set.
    let (sets, any) = fit(&TENANT_COLUMNS[..3], "k", &|c| {
        format!("LEAST(w.{c}, q.{c})")
    });
    let keys = sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE api_keys k SET {sets} FROM workspaces w, tenant_quotas q \
         WHERE w.id = k.workspace_id AND q.tenant_id = k.tenant_id AND k.tenant_id = $1 AND ({any})"
    )))
    .bind(tenant)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    Ok((workspaces, keys))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Deserialize)]
    struct Body {
        name: Option<String>,
        #[serde(flatten)]
        limits: LimitsPatch,
        #[serde(flatten)]
        _rest: NoOtherFields,
    }

    #[test]
    fn a_patch_tells_absent_from_null_and_refuses_other_fields() {
        let b: Body = serde_json::from_str(
            r#"{"name": "a", "requests_per_minute": 5, "monthly_budget_minor": null}"#,
        )
        .unwrap();
        assert_eq!(b.name.as_deref(), Some("a"));
        assert_eq!(b.limits.requests_per_minute, Some(Some(5)));
        assert_eq!(b.limits.monthly_budget_minor, Some(None));
        assert_eq!(b.limits.input_tokens_per_minute, None);
        assert!(b.limits.touches_budget());
        let before = Limits {
            input_tokens_per_minute: Some(7),
            monthly_budget_minor: Some(100),
            ..Limits::default()
        };
        let after = b.limits.apply(before);
        assert_eq!(
            after,
            Limits {
                requests_per_minute: Some(5),
                input_tokens_per_minute: Some(7),
                output_tokens_per_minute: None,
                monthly_budget_minor: None,
            }
        );
        let e = serde_json::from_str::<Body>(r#"{"requests_per_minute": 5, "rpm": 5}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown field `rpm`"), "{e}");
        let e = serde_json::from_str::<Body>(r#"{"requests_per_minute": "5"}"#).unwrap_err();
        assert!(e.to_string().contains("invalid type"), "{e}");
    }

    #[test]
    fn validation_names_the_field_as_its_level_does() {
        let l = Limits {
            output_tokens_per_minute: Some(0),
            ..Limits::default()
        };
        let e = l.validate("key_").unwrap_err().to_string();
        assert!(e.contains("key_output_tokens_per_minute"), "{e}");
        assert!(Limits::default().validate("").is_ok());
        let budget = Limits {
            monthly_budget_minor: Some(0),
            ..Limits::default()
        };
        assert!(
            budget.validate("").is_ok(),
            "a zero budget refuses all spend"
        );
    }

    #[test]
    fn each_limit_is_held_within_the_level_above_and_lowered_to_it() {
        let parent = Limits {
            requests_per_minute: Some(10),
            input_tokens_per_minute: Some(1_000),
            output_tokens_per_minute: Some(500),
            monthly_budget_minor: Some(2_000),
        };
        type Set = fn(&mut Limits, Option<i64>);
        let fields: [(&str, Set); 4] = [
            ("requests_per_minute", |l, v| l.requests_per_minute = v),
            ("input_tokens_per_minute", |l, v| {
                l.input_tokens_per_minute = v
            }),
            ("output_tokens_per_minute", |l, v| {
                l.output_tokens_per_minute = v
            }),
            ("monthly_budget_minor", |l, v| l.monthly_budget_minor = v),
        ];
        for ((name, set), (_, cap)) in fields.into_iter().zip(parent.fields()) {
            let cap = cap.unwrap();
            let mut child = Limits::default();
            set(&mut child, Some(cap + 1));
            assert_eq!(child.above(&parent), Some((name, cap + 1, cap)));
            let e = child
                .within(&parent, "", "the tenant's")
                .unwrap_err()
                .to_string();
            assert!(
                e.starts_with(&format!(
                    "{name}: {} is above the tenant's limit of {cap}",
                    cap + 1
                )),
                "{e}"
            );
            let mut lowered = Limits::default();
            set(&mut lowered, Some(cap));
            assert_eq!(child.lowered_to(&parent), lowered, "{name}");
            set(&mut child, Some(cap));
            assert!(
                child.within(&parent, "", "the tenant's").is_ok(),
                "equal is within"
            );
            set(&mut child, None);
            assert!(
                child.within(&parent, "", "x").is_ok(),
                "none: the level above holds"
            );
            assert_eq!(
                child.lowered_to(&parent),
                Limits::default(),
                "none stays none"
            );
        }
        // No limit above bounds nothing; `or` fills what a level leaves open.
        let own = Limits {
            requests_per_minute: Some(i64::MAX),
            ..Limits::default()
        };
        assert!(own.within(&Limits::default(), "", "x").is_ok());
        assert_eq!(own.or(&parent).input_tokens_per_minute, Some(1_000));
        assert_eq!(own.or(&parent).requests_per_minute, Some(i64::MAX));
    }
}
