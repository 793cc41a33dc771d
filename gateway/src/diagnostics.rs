//! Cache-miss diagnostics in the shape of Anthropic's beta (`anthropic-beta:
//! cache-diagnosis-2026-04-07`, request `diagnostics.previous_message_id`, response
//! `diagnostics.cache_miss_reason`): why this request did not read what the previous one left
//! in the cache.
//!
//! Requests that carry the beta header leave a fingerprint under their message id: scope,
//! model, rendered tokens, where tools and system end, and how far the cache held their
//! prompt. A later request naming that id is compared with it: the first token where the two
//! prompts differ falls in the tools, the system prompt or the messages (`tools_changed`,
//! `system_changed`, `messages_changed`), or the model differs (`model_changed`);
//! `cache_missed_input_tokens` counts the tokens the previous request had cached that this
//! one could not read. When the prompts agree that far but the entry is gone, Cachet names
//! the cause the fabric knows (`evicted`, `expired`: Cachet's own types). Fingerprints live in
//! this process's memory, bounded by bytes (oldest dropped first); one that is gone, or
//! belongs to another scope, is `previous_message_not_found`.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use cachet_common::Scope;
use serde_json::{Value, json};

/// The beta that turns diagnostics on.
pub const BETA: &str = "cache-diagnosis-2026-04-07";

/// Fingerprints kept, in bytes of their tokens.
const BUDGET_BYTES: usize = 64 << 20;

/// What a later request is compared with.
#[derive(Clone, Debug)]
pub struct Fingerprint {
    pub scope: Scope,
    pub model: String,
    pub tokens: Arc<[u32]>,
    pub tools_end: usize,
    pub system_end: usize,
    /// How far the cache held this prompt once it was answered (read or written).
    pub cached_end: usize,
}

#[derive(Default)]
struct Store {
    by_id: HashMap<String, Fingerprint>,
    order: VecDeque<String>,
    bytes: usize,
}

/// The fingerprints of one serving process.
#[derive(Clone, Default)]
pub struct Fingerprints {
    inner: Arc<Mutex<Store>>,
}

impl Fingerprints {
    pub fn get(&self, id: &str) -> Option<Fingerprint> {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .by_id
            .get(id)
            .cloned()
    }

    pub fn put(&self, id: String, f: Fingerprint) {
        let mut s = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        s.bytes += f.tokens.len() * 4;
        if let Some(old) = s.by_id.insert(id.clone(), f) {
            s.bytes -= old.tokens.len() * 4;
        } else {
            s.order.push_back(id);
        }
        while s.bytes > BUDGET_BYTES {
            let Some(oldest) = s.order.pop_front() else {
                break;
            };
            if let Some(gone) = s.by_id.remove(&oldest) {
                s.bytes -= gone.tokens.len() * 4;
            }
        }
    }
}

/// Why `cur` (which read `read` tokens from the cache) missed what `prev` left, or `None`
/// when it read all of that. `gone`: the fabric's reason for an entry that is no longer
/// there (`evicted`, `expired`, …).
pub fn cache_miss_reason(
    prev: Option<&Fingerprint>,
    cur: &Fingerprint,
    read: usize,
    gone: Option<&str>,
) -> Value {
    let Some(prev) = prev.filter(|p| p.scope == cur.scope) else {
        return json!({"type": "previous_message_not_found"});
    };
    if prev.model != cur.model {
        return json!({"type": "model_changed", "cache_missed_input_tokens": prev.cached_end.saturating_sub(read)});
    }
    let same = prev
        .tokens
        .iter()
        .zip(cur.tokens.iter())
        .take_while(|(a, b)| a == b)
        .count();
    let reusable = prev.cached_end.min(cur.tokens.len());
    if read >= reusable {
        return Value::Null;
    }
    let missed = (reusable - read) as u64;
    if same >= reusable {
        // The prompts agree as far as the cache held the previous one: the entry is gone.
        return json!({"type": gone.unwrap_or("unavailable"), "cache_missed_input_tokens": missed});
    }
    let kind = if same < prev.tools_end {
        "tools_changed"
    } else if same < prev.system_end {
        "system_changed"
    } else {
        "messages_changed"
    };
    json!({"type": kind, "cache_missed_input_tokens": missed})
}

/// Whether the beta header asks for diagnostics.
pub fn requested(headers: &axum::http::HeaderMap) -> bool {
    headers
        .get_all("anthropic-beta")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|b| b.trim() == BETA)
}

#[cfg(test)]
mod tests {
    use super::*;
    use cachet_common::{TenantId, WorkspaceId};

    fn fp(scope: Scope, model: &str, tokens: &[u32], cached_end: usize) -> Fingerprint {
        Fingerprint {
            scope,
            model: model.into(),
            tokens: tokens.into(),
            tools_end: 10,
            system_end: 20,
            cached_end,
        }
    }

    fn scope() -> Scope {
        Scope {
            tenant: TenantId::new(),
            workspace: WorkspaceId::new(),
        }
    }

    #[test]
    fn the_first_difference_names_the_section_and_the_missed_tokens() {
        let s = scope();
        let prev: Vec<u32> = (0..40).collect();
        let p = fp(s, "m", &prev, 30);
        let mut cur = prev.clone();
        cur[15] = 999; // in the system prompt
        let r = cache_miss_reason(Some(&p), &fp(s, "m", &cur, 0), 0, None);
        assert_eq!(r["type"], "system_changed");
        assert_eq!(r["cache_missed_input_tokens"], 30);
        cur = prev.clone();
        cur[5] = 999;
        assert_eq!(
            cache_miss_reason(Some(&p), &fp(s, "m", &cur, 0), 0, None)["type"],
            "tools_changed"
        );
        cur = prev.clone();
        cur[25] = 999;
        let r = cache_miss_reason(Some(&p), &fp(s, "m", &cur, 0), 16, None);
        assert_eq!(r["type"], "messages_changed");
        assert_eq!(r["cache_missed_input_tokens"], 14);
        // Everything the previous one left was read: no miss.
        assert!(cache_miss_reason(Some(&p), &fp(s, "m", &prev, 0), 30, None).is_null());
        // Same prompt, nothing read: the entry is gone, and the fabric says why.
        let r = cache_miss_reason(Some(&p), &fp(s, "m", &prev, 0), 0, Some("evicted"));
        assert_eq!(
            (r["type"].as_str(), r["cache_missed_input_tokens"].as_u64()),
            (Some("evicted"), Some(30))
        );
        assert_eq!(
            cache_miss_reason(Some(&p), &fp(s, "other", &prev, 0), 0, None)["type"],
            "model_changed"
        );
    }

    #[test]
    fn another_scopes_message_is_not_found_and_the_store_is_bounded() {
        let p = fp(scope(), "m", &[1, 2, 3], 3);
        let r = cache_miss_reason(Some(&p), &fp(scope(), "m", &[1, 2, 3], 0), 0, None);
        assert_eq!(r["type"], "previous_message_not_found");
        assert_eq!(
            cache_miss_reason(None, &p, 0, None)["type"],
            "previous_message_not_found"
        );
        let store = Fingerprints::default();
        let big: Vec<u32> = vec![7; 4 << 20]; // 16 MiB of tokens
        for i in 0..6 {
            store.put(format!("msg_{i}"), fp(scope(), "m", &big, 1));
        }
        assert!(store.get("msg_0").is_none() && store.get("msg_1").is_none());
        assert!(store.get("msg_5").is_some());
    }
}
