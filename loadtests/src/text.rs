//! The text of a trace's blocks: each hash id becomes a fixed, seeded run of words, so
//! equal ids give identical text and equal hash prefixes give equal token prefixes.
//!
//! Every word is a common English word of at most six letters preceded by one space. The
//! sim engine's tokenizer makes each such word one token, and byte-pair tokenizers with a
//! space-prefixed vocabulary (SmolLM2's among them) split on the spaces first and hold these
//! words whole, so a block of `n` words is `n` tokens and blocks concatenate without
//! merging. The replay checks this against the server's `count_tokens` before it starts.

use crate::trace::mix64;

/// 256 words: one byte of a mixed hash picks one.
const WORDS: [&str; 256] = [
    "the", "of", "and", "to", "in", "is", "you", "that", "it", "he", "was", "for", "on", "are",
    "as", "with", "his", "they", "at", "be", "this", "have", "from", "or", "one", "had", "by",
    "word", "but", "not", "what", "all", "were", "we", "when", "your", "can", "said", "there",
    "use", "an", "each", "which", "she", "do", "how", "their", "if", "will", "up", "other",
    "about", "out", "many", "then", "them", "these", "so", "some", "her", "would", "make", "like",
    "him", "into", "time", "has", "look", "two", "more", "write", "go", "see", "number", "no",
    "way", "could", "people", "my", "than", "first", "water", "been", "call", "who", "oil", "its",
    "now", "find", "long", "down", "day", "did", "get", "come", "made", "may", "part", "over",
    "new", "sound", "take", "only", "little", "work", "know", "place", "year", "live", "me",
    "back", "give", "most", "very", "after", "thing", "our", "just", "name", "good", "man",
    "think", "say", "great", "where", "help", "gold", "much", "before", "line", "right", "too",
    "mean", "old", "any", "same", "tell", "boy", "follow", "came", "want", "show", "also",
    "around", "form", "three", "small", "set", "put", "end", "does", "rain", "well", "large",
    "must", "big", "even", "such", "sky", "turn", "here", "why", "ask", "went", "men", "read",
    "need", "land", "home", "us", "move", "try", "kind", "hand", "song", "again", "change", "off",
    "play", "spell", "air", "away", "animal", "house", "point", "page", "letter", "mother",
    "answer", "found", "study", "still", "learn", "should", "world", "high", "every", "near",
    "add", "food", "star", "own", "below", "ship", "plant", "last", "school", "father", "keep",
    "tree", "never", "start", "city", "earth", "eye", "light", "road", "head", "under", "story",
    "saw", "left", "few", "while", "along", "might", "close", "hill", "real", "life", "open",
    "seem", "lake", "next", "white", "begin", "got", "walk", "stone", "ease", "paper", "group",
    "always", "music", "those", "both", "mark", "often", "until", "mile", "river", "car", "feet",
    "care", "second", "book",
];

/// Append the first `n` words of block `id`'s text to `out` (each `" word"`). The first
/// `m < n` words are the same for any `n`, so a partial block is a prefix of the full one.
pub fn push_block(out: &mut String, id: u64, n: u64) {
    let mut state = mix64(id ^ 0x6361_6368_6574_2d74); // "cachet-t"
    let mut i = 0;
    while i < n {
        state = mix64(state.wrapping_add(i));
        // Eight words from each 64-bit draw.
        for b in state.to_le_bytes() {
            if i == n {
                break;
            }
            out.push(' ');
            out.push_str(WORDS[b as usize]);
            i += 1;
        }
    }
}

/// The text of blocks `ids` with token counts `lens` (one `" word"` per token).
pub fn blocks_text(ids: &[u64], lens: &[u64]) -> String {
    let mut out = String::with_capacity(lens.iter().sum::<u64>() as usize * 6);
    for (&id, &n) in ids.iter().zip(lens) {
        push_block(&mut out, id, n);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_word_is_one_sim_token_and_blocks_concatenate() {
        assert!(WORDS.iter().all(|w| (1..=6).contains(&w.len())));
        let distinct: std::collections::HashSet<_> = WORDS.iter().collect();
        assert_eq!(distinct.len(), 256);
        let ids = [0u64, 17, 99];
        let lens = [64u64, 64, 10];
        let text = blocks_text(&ids, &lens);
        assert_eq!(text.split(' ').skip(1).count(), 138);
        let mut first = String::new();
        push_block(&mut first, 0, 64);
        assert!(text.starts_with(&first));
    }

    #[test]
    fn equal_ids_equal_text_and_a_partial_block_is_a_prefix() {
        let mut a = String::new();
        push_block(&mut a, 5, 100);
        let mut b = String::new();
        push_block(&mut b, 5, 37);
        assert!(a.starts_with(&b));
        let mut c = String::new();
        push_block(&mut c, 6, 100);
        assert_ne!(a, c);
        let mut again = String::new();
        push_block(&mut again, 5, 100);
        assert_eq!(a, again);
    }
}
