//! Tags: names and values on workspaces and keys (`team` = `search`) that usage is grouped
//! and exported by, for chargeback. A key's usage carries its workspace's tags with the key's
//! own on top ([`Tags::over`]). Tags are read as they are now, not as they were when a
//! request ran.
//!
//! At most [`MAX_TAGS`] per workspace or key; a name is 1 to 64 of `A-Z a-z 0-9 _ . : / -`
//! (not starting with `cachet`, kept for Cachet's own), a value at most 256 characters with
//! no control characters.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::AdminError;

/// The most tags a workspace or a key may have.
pub const MAX_TAGS: usize = 20;

/// A workspace's or a key's tags, by name.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[schema(value_type = Object, example = json!({"team": "search", "project": "atlas"}))]
pub struct Tags(pub BTreeMap<String, String>);

impl Tags {
    /// The rules every stored set keeps, with the API's error texts naming the tag.
    pub fn validate(&self) -> Result<(), AdminError> {
        if self.0.len() > MAX_TAGS {
            return Err(AdminError::Invalid(format!(
                "tags: at most {MAX_TAGS} ({} given)",
                self.0.len()
            )));
        }
        for (name, value) in &self.0 {
            let ok = (1..=64).contains(&name.len())
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_.:/-".contains(c));
            if !ok {
                return Err(AdminError::Invalid(format!(
                    "tags: {name:?} is not a tag name (1 to 64 of letters, digits and _ . : / -)"
                )));
            }
            if name.to_ascii_lowercase().starts_with("cachet") {
                return Err(AdminError::Invalid(format!(
                    "tags: {name:?}: names starting with \"cachet\" are Cachet's own"
                )));
            }
            if value.chars().count() > 256 || value.chars().any(char::is_control) {
                return Err(AdminError::Invalid(format!(
                    "tags.{name}: at most 256 characters, none of them control characters"
                )));
            }
        }
        Ok(())
    }

    /// These tags with `own` on top (a key's over its workspace's).
    pub fn over(&self, own: &Tags) -> Tags {
        let mut all = self.0.clone();
        all.extend(own.0.iter().map(|(k, v)| (k.clone(), v.clone())));
        Tags(all)
    }

    /// From a `tags` JSONB column (an object of strings; anything else is no tag).
    pub fn from_json(v: serde_json::Value) -> Tags {
        serde_json::from_value(v).unwrap_or_default()
    }

    /// As a JSONB value.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!(self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tags(pairs: &[(&str, &str)]) -> Tags {
        Tags(
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    #[test]
    fn a_keys_tags_win_over_its_workspaces() {
        let ws = tags(&[("team", "search"), ("cost-center", "42")]);
        let key = tags(&[("team", "ads"), ("env", "prod")]);
        assert_eq!(
            ws.over(&key),
            tags(&[("cost-center", "42"), ("env", "prod"), ("team", "ads")])
        );
        assert_eq!(ws.over(&Tags::default()), ws);
    }

    #[test]
    fn names_values_and_counts_are_checked_with_the_tag_named() {
        assert!(
            tags(&[("team", "search"), ("k8s.io/app", "x"), ("a", "")])
                .validate()
                .is_ok()
        );
        for (bad, says) in [
            (tags(&[("", "x")]), "not a tag name"),
            (tags(&[("has space", "x")]), "not a tag name"),
            (tags(&[(&"n".repeat(65), "x")]), "not a tag name"),
            (tags(&[("cachet:tier", "x")]), "Cachet's own"),
            (tags(&[("team", "a\nb")]), "tags.team"),
            (tags(&[("team", &"v".repeat(257))]), "tags.team"),
        ] {
            let e = bad.validate().unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
        }
        let many = Tags((0..21).map(|i| (format!("t{i}"), String::new())).collect());
        assert!(
            many.validate()
                .unwrap_err()
                .to_string()
                .contains("at most 20")
        );
        assert_eq!(
            Tags::from_json(serde_json::json!({"a": 1})),
            Tags::default()
        );
        assert_eq!(
            Tags::from_json(serde_json::json!({"a": "b"})),
            tags(&[("a", "b")])
        );
    }
}
