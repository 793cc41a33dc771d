//! The block key scheme: chained, scoped SHA-256 hashes over fixed-size token blocks.
//!
//! `block_hash = SHA-256("cachet-kv-v1" ‖ scope ‖ lp(model_id) ‖ lp(adapter_id) ‖ lp(kv_dtype)
//!               ‖ parent_hash ‖ lp(tokens as u32 LE))`
//!
//! `lp(x)` is `x` preceded by its length as a u32 LE, so no two different field lists share a
//! preimage. The scope (tenant and workspace ids, 16 bytes each) is in every preimage: a
//! tenant can never compute, and so never address, another tenant's block. The first block's
//! parent is all zeros.
//!
//! A breakpoint (or any content-block boundary) that ends inside a block gets a *tail* key: the
//! same formula over the partial tokens after the last full block. The token count is part of
//! the preimage, so a tail never collides with a full block.

use cachet_common::{BlockHash, Scope};
use sha2::{Digest, Sha256};

const DOMAIN: &[u8] = b"cachet-kv-v1";

/// Everything that, besides the tokens, decides what a block's KV is.
#[derive(Clone)]
pub struct KeySpace {
    block_size: usize,
    /// SHA-256 state after absorbing the fixed part of every preimage.
    seed: Sha256,
}

fn put_lp(h: &mut Sha256, bytes: &[u8]) {
    let len = u32::try_from(bytes.len()).expect("key field shorter than 4 GiB");
    h.update(len.to_le_bytes());
    h.update(bytes);
}

impl KeySpace {
    pub fn new(
        scope: Scope,
        model_id: &str,
        adapter_id: &str,
        kv_dtype: &str,
        block_size: usize,
    ) -> Self {
        assert!(block_size > 0, "block size must be positive");
        let mut seed = Sha256::new();
        put_lp(&mut seed, DOMAIN);
        seed.update(scope.tenant.as_uuid().as_bytes());
        seed.update(scope.workspace.as_uuid().as_bytes());
        put_lp(&mut seed, model_id.as_bytes());
        put_lp(&mut seed, adapter_id.as_bytes());
        put_lp(&mut seed, kv_dtype.as_bytes());
        Self { block_size, seed }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The hash of one (full or tail) block given its parent.
    pub fn block_hash(&self, parent: &BlockHash, tokens: &[u32]) -> BlockHash {
        let mut h = self.seed.clone();
        h.update(parent.0);
        let len = u32::try_from(tokens.len()).expect("block shorter than 4G tokens");
        h.update(len.to_le_bytes());
        // Tokens as u32 LE; fed in one slice to keep SHA-NI busy.
        let mut buf = Vec::with_capacity(tokens.len() * 4);
        for t in tokens {
            buf.extend_from_slice(&t.to_le_bytes());
        }
        h.update(&buf);
        let mut out = [0u8; 32];
        out.copy_from_slice(&h.finalize());
        BlockHash(out)
    }

    /// Keys for `tokens[..upto]`: every full block, plus a tail key at each offset of
    /// `boundaries` (sorted or not) that ends inside a block and lies in `1..=upto`.
    pub fn prefix_keys(&self, tokens: &[u32], upto: usize, boundaries: &[usize]) -> PrefixKeys {
        let upto = upto.min(tokens.len());
        let b = self.block_size;
        let n_full = upto / b;
        let mut blocks = Vec::with_capacity(n_full);
        let mut parent = BlockHash::ZERO;
        for i in 0..n_full {
            parent = self.block_hash(&parent, &tokens[i * b..(i + 1) * b]);
            blocks.push(parent);
        }
        let mut offsets: Vec<usize> = boundaries
            .iter()
            .copied()
            .filter(|&o| o > 0 && o <= upto && o % b != 0)
            .collect();
        offsets.sort_unstable();
        offsets.dedup();
        let tails = offsets
            .into_iter()
            .map(|offset| {
                let full = offset / b;
                let parent = if full == 0 {
                    BlockHash::ZERO
                } else {
                    blocks[full - 1]
                };
                TailKey {
                    offset,
                    hash: self.block_hash(&parent, &tokens[full * b..offset]),
                }
            })
            .collect();
        PrefixKeys {
            block_size: b,
            blocks,
            tails,
        }
    }
}

/// A key for the partial block that ends at `offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TailKey {
    pub offset: usize,
    pub hash: BlockHash,
}

/// The keys of one prompt prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefixKeys {
    pub block_size: usize,
    /// Full blocks, in order; block `i` covers tokens `i*B .. (i+1)*B`.
    pub blocks: Vec<BlockHash>,
    /// Tail keys sorted by offset.
    pub tails: Vec<TailKey>,
}

impl PrefixKeys {
    /// The parent of block or tail starting at token `start` (a multiple of the block size).
    pub fn parent_of(&self, start: usize) -> Option<BlockHash> {
        let i = start / self.block_size;
        if i == 0 {
            None
        } else {
            Some(self.blocks[i - 1])
        }
    }
    pub fn tail_at(&self, offset: usize) -> Option<&TailKey> {
        self.tails.iter().find(|t| t.offset == offset)
    }
    /// Every key (blocks and tails) needed to read the prefix `0..offset`, in chain order.
    /// `None` if `offset` is neither a block boundary nor a tail offset.
    pub fn chain_to(&self, offset: usize) -> Option<Vec<ChainLink>> {
        let b = self.block_size;
        let full = offset / b;
        if full > self.blocks.len() {
            return None;
        }
        let mut out: Vec<ChainLink> = (0..full)
            .map(|i| ChainLink {
                hash: self.blocks[i],
                parent: if i == 0 {
                    None
                } else {
                    Some(self.blocks[i - 1])
                },
                start: i * b,
                end: (i + 1) * b,
            })
            .collect();
        if !offset.is_multiple_of(b) {
            let tail = self.tail_at(offset)?;
            out.push(ChainLink {
                hash: tail.hash,
                parent: self.parent_of(full * b),
                start: full * b,
                end: offset,
            });
        }
        Some(out)
    }
}

/// One block of a chain with the token range it covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChainLink {
    pub hash: BlockHash,
    pub parent: Option<BlockHash>,
    pub start: usize,
    pub end: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use cachet_common::{TenantId, WorkspaceId};
    use proptest::prelude::*;

    fn scope(n: u128) -> Scope {
        Scope {
            tenant: TenantId(uuid::Uuid::from_u128(n)),
            workspace: WorkspaceId(uuid::Uuid::from_u128(n + 1)),
        }
    }

    #[test]
    fn first_block_hash_is_stable() {
        // Pins the preimage layout: changing it silently would orphan every stored block.
        let ks = KeySpace::new(scope(1), "m", "", "f16", 4);
        let h = ks.block_hash(&BlockHash::ZERO, &[1, 2, 3, 4]);
        let mut pre = Vec::new();
        pre.extend_from_slice(&12u32.to_le_bytes());
        pre.extend_from_slice(b"cachet-kv-v1");
        pre.extend_from_slice(uuid::Uuid::from_u128(1).as_bytes());
        pre.extend_from_slice(uuid::Uuid::from_u128(2).as_bytes());
        pre.extend_from_slice(&1u32.to_le_bytes());
        pre.extend_from_slice(b"m");
        pre.extend_from_slice(&0u32.to_le_bytes());
        pre.extend_from_slice(&3u32.to_le_bytes());
        pre.extend_from_slice(b"f16");
        pre.extend_from_slice(&[0u8; 32]);
        pre.extend_from_slice(&4u32.to_le_bytes());
        for t in [1u32, 2, 3, 4] {
            pre.extend_from_slice(&t.to_le_bytes());
        }
        let want: [u8; 32] = Sha256::digest(&pre).into();
        assert_eq!(h.0, want);
    }

    #[test]
    fn fields_are_length_prefixed_so_shifting_bytes_between_them_changes_the_hash() {
        let a = KeySpace::new(scope(1), "ab", "c", "f16", 4).block_hash(&BlockHash::ZERO, &[1]);
        let b = KeySpace::new(scope(1), "a", "bc", "f16", 4).block_hash(&BlockHash::ZERO, &[1]);
        assert_ne!(a, b);
    }

    #[test]
    fn tails_and_chains_cover_the_right_ranges() {
        let ks = KeySpace::new(scope(1), "m", "", "f16", 4);
        let toks: Vec<u32> = (0..11).collect();
        let keys = ks.prefix_keys(&toks, 10, &[3, 8, 10, 11, 0]);
        assert_eq!(keys.blocks.len(), 2);
        assert_eq!(
            keys.tails.iter().map(|t| t.offset).collect::<Vec<_>>(),
            vec![3, 10]
        );
        let chain = keys.chain_to(10).unwrap();
        assert_eq!(
            chain.iter().map(|c| (c.start, c.end)).collect::<Vec<_>>(),
            vec![(0, 4), (4, 8), (8, 10)]
        );
        assert_eq!(chain[2].parent, Some(keys.blocks[1]));
        assert!(keys.chain_to(9).is_none(), "no tail key at 9");
        assert_eq!(keys.chain_to(8).unwrap().len(), 2);
    }

    proptest! {
        #[test]
        fn any_change_to_scope_model_or_a_token_changes_every_later_hash(
            toks in proptest::collection::vec(0u32..50_000, 8..64),
            pos in 0usize..64,
            delta in 1u32..1000,
            which in 0u8..3,
        ) {
            let pos = pos % toks.len();
            let base = KeySpace::new(scope(7), "sim-tiny", "", "f16", 4);
            let a = base.prefix_keys(&toks, toks.len(), &[toks.len()]);
            let (b, first_changed) = match which {
                0 => {
                    let mut t2 = toks.clone();
                    t2[pos] = t2[pos].wrapping_add(delta);
                    (base.prefix_keys(&t2, t2.len(), &[t2.len()]), pos / 4)
                }
                1 => (KeySpace::new(scope(9), "sim-tiny", "", "f16", 4).prefix_keys(&toks, toks.len(), &[toks.len()]), 0),
                _ => (KeySpace::new(scope(7), "sim-tinz", "", "f16", 4).prefix_keys(&toks, toks.len(), &[toks.len()]), 0),
            };
            for i in 0..a.blocks.len() {
                if i < first_changed { prop_assert_eq!(a.blocks[i], b.blocks[i]); }
                else { prop_assert_ne!(a.blocks[i], b.blocks[i]); }
            }
            for (ta, tb) in a.tails.iter().zip(&b.tails) {
                prop_assert_ne!(ta.hash, tb.hash);
            }
        }

        #[test]
        fn extra_boundaries_never_change_block_hashes(
            toks in proptest::collection::vec(0u32..50_000, 1..80),
            marks in proptest::collection::vec(0usize..80, 0..6),
        ) {
            let ks = KeySpace::new(scope(3), "m", "", "f16", 8);
            let plain = ks.prefix_keys(&toks, toks.len(), &[]);
            let marked = ks.prefix_keys(&toks, toks.len(), &marks);
            prop_assert_eq!(plain.blocks, marked.blocks);
        }
    }
}
