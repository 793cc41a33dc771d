//! Memoized segment tokenization: the same block text (a system prompt, a tool list, an
//! earlier turn) is tokenized once per tenant, not on every request.
//!
//! Entries are keyed by SHA-256 of the memo scope (the tenant) and the text, so one tenant's
//! text never makes another tenant's render faster: a memo hit is a timing signal, and it
//! stays inside the tenant that paid for it. The memo is bounded by the bytes it holds, not
//! by its entry count, so a few huge segments cannot grow it without limit.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};

use crate::metrics;

/// Bytes of tokens each model's tokenization memo keeps (the sim engines', the chat
/// renderer's of the reference engine and of every vLLM upstream): a bound the serving
/// process counts among its memory bounds.
pub const MODEL_MEMO_BYTES: usize = 64 << 20;

/// Segments shorter than this are cheaper to tokenize than to look up.
const MIN_MEMO_BYTES: usize = 256;

/// What one entry costs besides its tokens: the key, the `Arc` header, the map slot.
const ENTRY_OVERHEAD: usize = 32 + 16 + 48;

/// A bounded map from SHA-256(scope ‖ segment text) to its tokens.
pub struct SegmentMemo {
    inner: Mutex<Inner>,
    max_bytes: usize,
}

#[derive(Default)]
struct Inner {
    map: HashMap<[u8; 32], Arc<[u32]>>,
    bytes: usize,
}

fn entry_bytes(tokens: usize) -> usize {
    tokens * std::mem::size_of::<u32>() + ENTRY_OVERHEAD
}

impl SegmentMemo {
    /// A memo holding at most `max_bytes` of tokens (and per-entry overhead).
    pub fn new(max_bytes: usize) -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            max_bytes,
        }
    }

    /// Bytes the memo holds now.
    pub fn bytes(&self) -> usize {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).bytes
    }

    /// Tokens of `text` in `scope`, from the memo or from `tokenize`.
    pub fn tokens(
        &self,
        scope: u128,
        text: &str,
        tokenize: impl FnOnce(&str) -> Vec<u32>,
    ) -> Arc<[u32]> {
        if text.len() < MIN_MEMO_BYTES {
            return tokenize(text).into();
        }
        let mut h = Sha256::new();
        h.update(scope.to_le_bytes());
        h.update(text.as_bytes());
        let key: [u8; 32] = h.finalize().into();
        if let Some(t) = self
            .inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .map
            .get(&key)
        {
            metrics::MEMO.with_label_values(&["hit"]).inc();
            return t.clone();
        }
        metrics::MEMO.with_label_values(&["miss"]).inc();
        let toks: Arc<[u32]> = tokenize(text).into();
        let cost = entry_bytes(toks.len());
        // A segment worth more than an eighth of the memo would evict everything for one entry.
        if cost > self.max_bytes / 8 {
            return toks;
        }
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if inner.bytes + cost > self.max_bytes {
            // Coarse but bounded: start over rather than track recency on the hot path.
            inner.map.clear();
            metrics::MEMO_BYTES.sub(inner.bytes as i64);
            inner.bytes = 0;
        }
        if inner.map.insert(key, toks.clone()).is_none() {
            inner.bytes += cost;
            metrics::MEMO_BYTES.add(cost as i64);
        }
        toks
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count(calls: &std::cell::Cell<u32>) -> impl FnOnce(&str) -> Vec<u32> + '_ {
        move |s: &str| {
            calls.set(calls.get() + 1);
            s.bytes().map(u32::from).collect()
        }
    }

    #[test]
    fn a_hit_never_crosses_scopes() {
        let memo = SegmentMemo::new(1 << 20);
        let text = "x".repeat(1000);
        let calls = std::cell::Cell::new(0);
        memo.tokens(1, &text, count(&calls));
        memo.tokens(1, &text, count(&calls));
        assert_eq!(calls.get(), 1, "same scope: memoized");
        memo.tokens(2, &text, count(&calls));
        assert_eq!(calls.get(), 2, "another scope tokenizes afresh");
    }

    #[test]
    fn bounded_by_bytes_not_entries() {
        let max = 64 * 1024;
        let memo = SegmentMemo::new(max);
        for i in 0..500 {
            let text = format!("{i:04}{}", "y".repeat(2000));
            memo.tokens(7, &text, |s| s.bytes().map(u32::from).collect());
            assert!(memo.bytes() <= max, "{} > {max}", memo.bytes());
        }
        // One segment larger than an eighth of the memo is returned, not kept.
        let huge = "z".repeat(max);
        let toks = memo.tokens(7, &huge, |s| s.bytes().map(u32::from).collect());
        assert_eq!(toks.len(), max);
        assert!(memo.bytes() <= max);
    }
}
