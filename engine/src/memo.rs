//! Memoized segment tokenization: the same block text (a system prompt, a tool list, an
//! earlier turn) is tokenized once, not on every request.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};

use crate::metrics;

/// Segments shorter than this are cheaper to tokenize than to look up.
const MIN_MEMO_BYTES: usize = 256;

/// A bounded map from SHA-256(segment text) to its tokens.
pub struct SegmentMemo {
    map: Mutex<HashMap<[u8; 32], Arc<[u32]>>>,
    max_entries: usize,
}

impl SegmentMemo {
    pub fn new(max_entries: usize) -> Self {
        Self {
            map: Mutex::new(HashMap::new()),
            max_entries,
        }
    }

    /// Tokens of `text`, from the memo or from `tokenize`.
    pub fn tokens(&self, text: &str, tokenize: impl FnOnce(&str) -> Vec<u32>) -> Arc<[u32]> {
        if text.len() < MIN_MEMO_BYTES {
            return tokenize(text).into();
        }
        let key: [u8; 32] = Sha256::digest(text.as_bytes()).into();
        if let Some(t) = self.map.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
            metrics::MEMO.with_label_values(&["hit"]).inc();
            return t.clone();
        }
        metrics::MEMO.with_label_values(&["miss"]).inc();
        let toks: Arc<[u32]> = tokenize(text).into();
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        if map.len() >= self.max_entries {
            // Coarse but bounded: start over rather than track recency on the hot path.
            map.clear();
        }
        map.insert(key, toks.clone());
        toks
    }
}
