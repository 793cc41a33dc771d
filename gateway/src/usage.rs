//! Breakpoint placement, write planning and usage arithmetic: pure functions, property-tested.
//!
//! Rules (Anthropic semantics):
//! - tokens `0..read` were served from the cache;
//! - walking the breakpoints that were *written* in order, the tokens from the end of the
//!   previous read or written breakpoint up to each one are charged at that breakpoint's
//!   write rate (its TTL);
//! - everything after the last read or written breakpoint is uncached `input_tokens`.
//!
//! A breakpoint below the model's minimum cacheable length, or one the fabric could not hold,
//! is not written; its tokens fall to the next written breakpoint or to plain input.

use cache_fabric::{ChainLink, PrefixKeys};
use cachet_common::Ttl;
use engine::Rendered;

use crate::wire::types::{CacheCreation, Usage};
use crate::wire::validate::{BlockRef, Breakpoint};

/// A breakpoint at its token offset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placed {
    pub bp: Breakpoint,
    pub offset: usize,
    /// At or above the model's minimum cacheable length.
    pub cacheable: bool,
}

/// Token offset at the end of the marked block.
pub fn block_end(r: &Rendered, b: BlockRef) -> usize {
    match b {
        BlockRef::Tool(i) => r.tool_ends[i],
        BlockRef::System(i) => r.system_ends[i],
        BlockRef::Message(m, j) => r.message_ends[m][j],
    }
}

pub fn place(bps: &[Breakpoint], r: &Rendered, min_cacheable: usize) -> Vec<Placed> {
    bps.iter()
        .map(|bp| {
            let offset = block_end(r, bp.block);
            Placed {
                bp: bp.clone(),
                offset,
                cacheable: offset >= min_cacheable,
            }
        })
        .collect()
}

/// Every content-block end up to `upto`: where earlier requests may have left tail entries.
pub fn boundaries(r: &Rendered, upto: usize) -> Vec<usize> {
    r.tool_ends
        .iter()
        .chain(&r.system_ends)
        .chain(r.message_ends.iter().flatten())
        .copied()
        .filter(|&o| o <= upto)
        .collect()
}

/// The blocks a generation must export so that every breakpoint in `targets` (offsets past
/// `cached`) can be written: every link of their chains that is not entirely inside the
/// cached prefix, each once, in chain order.
pub fn export_links(keys: &PrefixKeys, cached: usize, targets: &[usize]) -> Vec<ChainLink> {
    let mut out: Vec<ChainLink> = Vec::new();
    for &t in targets {
        for l in keys.chain_to(t).unwrap_or_default() {
            if l.end > cached && !out.iter().any(|o| o.hash == l.hash) {
                out.push(l);
            }
        }
    }
    out.sort_by_key(|l| (l.start, l.end));
    out
}

/// Prompt tokens by billing class.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TokenUsage {
    pub input: u64,
    pub write_5m: u64,
    pub write_1h: u64,
    pub read: u64,
}

impl TokenUsage {
    pub fn prompt_total(&self) -> u64 {
        self.input + self.write_5m + self.write_1h + self.read
    }
    pub fn writes(&self) -> u64 {
        self.write_5m + self.write_1h
    }
}

/// The one mapping from the ledger's token classes to the wires' usage fields.
///
/// Anthropic: `input_tokens` is the uncached remainder; writes in
/// `cache_creation_input_tokens` (split by TTL in `cache_creation`), reads in
/// `cache_read_input_tokens`. Output tokens are filled in as they are generated.
pub fn anthropic(u: &TokenUsage) -> Usage {
    Usage {
        input_tokens: u.input,
        cache_creation_input_tokens: u.writes(),
        cache_read_input_tokens: u.read,
        cache_creation: CacheCreation {
            ephemeral_5m_input_tokens: u.write_5m,
            ephemeral_1h_input_tokens: u.write_1h,
        },
        output_tokens: 0,
        service_tier: "standard".into(),
    }
}

/// `written`: the breakpoints actually written, as (offset, ttl), in any order.
pub fn compute(total: usize, read: usize, written: &[(usize, Ttl)]) -> TokenUsage {
    let mut w: Vec<(usize, Ttl)> = written
        .iter()
        .copied()
        .filter(|&(o, _)| o > read && o <= total)
        .collect();
    w.sort_by_key(|&(o, _)| o);
    let mut u = TokenUsage {
        read: read.min(total) as u64,
        ..Default::default()
    };
    let mut pos = read.min(total);
    for (o, ttl) in w {
        let n = (o - pos) as u64;
        match ttl {
            Ttl::FiveMinutes => u.write_5m += n,
            Ttl::OneHour => u.write_1h += n,
        }
        pos = o;
    }
    u.input = (total - pos) as u64;
    u
}

#[cfg(test)]
mod tests {
    use super::*;
    use cache_fabric::KeySpace;
    use cachet_common::{Scope, TenantId, WorkspaceId};
    use proptest::prelude::*;

    proptest! {
        /// Whatever the classes, the Messages usage accounts for every prompt token exactly
        /// once and agrees with the ledger's classes (OpenAI's: `api::openai`'s test).
        #[test]
        fn the_messages_usage_carries_the_ledgers_classes(input in 0u64..1_000_000, w5 in 0u64..1_000_000,
                                                w1 in 0u64..1_000_000, read in 0u64..1_000_000) {
            let u = TokenUsage { input, write_5m: w5, write_1h: w1, read };
            let a = anthropic(&u);
            prop_assert_eq!(a.input_tokens + a.cache_creation_input_tokens + a.cache_read_input_tokens, u.prompt_total());
            prop_assert_eq!(a.cache_creation.ephemeral_5m_input_tokens, w5);
            prop_assert_eq!(a.cache_creation.ephemeral_1h_input_tokens, w1);
        }
    }

    #[test]
    fn segments_are_charged_at_the_closing_breakpoints_rate() {
        // 1h breakpoint at 100, 5m at 250, prompt 300, nothing cached.
        let u = compute(300, 0, &[(100, Ttl::OneHour), (250, Ttl::FiveMinutes)]);
        assert_eq!(
            u,
            TokenUsage {
                input: 50,
                write_5m: 150,
                write_1h: 100,
                read: 0
            }
        );
        // Cached through 100: the 1h segment is a read now.
        let u = compute(300, 100, &[(250, Ttl::FiveMinutes)]);
        assert_eq!(
            u,
            TokenUsage {
                input: 50,
                write_5m: 150,
                write_1h: 0,
                read: 100
            }
        );
        // Nothing written: all plain input.
        assert_eq!(
            compute(300, 0, &[]),
            TokenUsage {
                input: 300,
                ..Default::default()
            }
        );
    }

    proptest! {
        #[test]
        fn every_prompt_token_is_counted_exactly_once(
            total in 0usize..5000,
            read_frac in 0.0f64..1.0,
            marks in proptest::collection::vec((0usize..5000, any::<bool>()), 0..4),
        ) {
            let read = (total as f64 * read_frac) as usize;
            let written: Vec<(usize, Ttl)> = marks.iter().map(|&(o, h)| (o, if h { Ttl::OneHour } else { Ttl::FiveMinutes })).collect();
            let u = compute(total, read, &written);
            prop_assert_eq!(u.prompt_total(), total as u64);
            prop_assert_eq!(u.read, read as u64);
            // Writes never exceed what lies between the read prefix and the last breakpoint.
            let last = written.iter().map(|w| w.0).filter(|&o| o <= total).max().unwrap_or(0);
            prop_assert!(u.writes() <= last.saturating_sub(read) as u64);
        }

        #[test]
        fn exports_cover_exactly_the_uncached_part_of_each_target_chain(
            len in 1usize..200, cached_frac in 0.0f64..1.0, t in proptest::collection::vec(1usize..200, 1..4),
        ) {
            let scope = Scope { tenant: TenantId::new(), workspace: WorkspaceId::new() };
            let toks: Vec<u32> = (0..len as u32).collect();
            let targets: Vec<usize> = t.into_iter().map(|x| x.min(len)).collect();
            let ks = KeySpace::new(scope, "m", "", "f16", 16);
            let keys = ks.prefix_keys(&toks, len, &targets);
            let cached = ((len as f64 * cached_frac) as usize / 16) * 16;
            let ex = export_links(&keys, cached, &targets);
            for &tg in &targets {
                for l in keys.chain_to(tg).unwrap() {
                    prop_assert_eq!(ex.iter().any(|e| e.hash == l.hash), l.end > cached);
                }
            }
        }
    }
}
