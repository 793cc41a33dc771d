//! Synthetic workloads, written as Mooncake-format traces so every run can be replayed
//! again exactly (`cachet loadtest generate`, or `replay --workload`, which writes the trace
//! into its output directory first).
//!
//! - `chat`: conversations. Each session has a system prompt (shared by `prefix_share` of
//!   the sessions, private otherwise), then turns: every turn's prompt is the whole history
//!   plus new user blocks, and the answer joins the history.
//! - `agent`: tool-using tasks. A large shared prefix (tools + instructions), then many
//!   short steps in quick succession, each appending a tool result; short outputs.
//! - `rag`: single questions over retrieved documents: a shared system prompt, `docs`
//!   documents drawn from a corpus by Zipf popularity (rank order matters to the prefix),
//!   then the question.
//! - `scan`: the adversarial case for a cache: a few hot prompts among a stream of long
//!   one-off prompts that are never seen again.
//!
//! Block ids follow Mooncake's meaning (equal ids, equal prefixes): a block's id hashes its
//! parent's id with its content, so the same document after a different prefix is a
//! different block, as it is for a KV cache.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::io::Write;

use anyhow::bail;
use clap::{Args, ValueEnum};

use crate::trace::{MOONCAKE_BLOCK_TOKENS, Rng, TraceRecord, mix64, write_record};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Kind {
    Chat,
    Agent,
    Rag,
    Scan,
    /// One-off questions over long documents (4K–16K tokens by default), the popular
    /// documents asked about again: prefill dominates (Mooncake's long-context traffic).
    Long,
}

/// The knobs of a synthetic workload (defaults per kind where a flag is left out).
#[derive(Args, Clone, Debug)]
pub struct WorkloadArgs {
    /// Requests to generate.
    #[arg(
        long = "workload-requests",
        id = "workload_requests",
        default_value_t = 2_000
    )]
    pub requests: u64,
    /// Mean arrival rate of requests per second (sessions start as a Poisson process).
    #[arg(long = "workload-rate", id = "workload_rate", default_value_t = 4.0)]
    pub rate: f64,
    #[arg(long = "workload-seed", id = "workload_seed", default_value_t = 1)]
    pub seed: u64,
    /// Blocks (512 tokens) of the shared prefix: system prompt, or tools + instructions.
    #[arg(long)]
    pub prefix_blocks: Option<u64>,
    /// Share of sessions that use the shared prefix (the rest get a private one).
    #[arg(long, default_value_t = 1.0)]
    pub prefix_share: f64,
    /// Most turns (chat) or steps (agent) a session has; each session draws 1..=turns.
    #[arg(long)]
    pub turns: Option<u64>,
    /// Most new user blocks per turn (chat), documents per question (rag), blocks per one-off
    /// prompt (scan).
    #[arg(long)]
    pub turn_blocks: Option<u64>,
    /// Mean seconds between a session's turns.
    #[arg(long)]
    pub think_secs: Option<f64>,
    /// Mean output tokens.
    #[arg(long)]
    pub output_tokens: Option<u64>,
    /// Documents in the corpus (rag) or hot prompts (scan).
    #[arg(long)]
    pub corpus: Option<u64>,
}

impl Default for WorkloadArgs {
    fn default() -> Self {
        Self {
            requests: 2_000,
            rate: 4.0,
            seed: 1,
            prefix_blocks: None,
            prefix_share: 1.0,
            turns: None,
            turn_blocks: None,
            think_secs: None,
            output_tokens: None,
            corpus: None,
        }
    }
}

/// The knobs resolved for one kind.
struct Knobs {
    prefix_blocks: u64,
    turns: u64,
    turn_blocks: u64,
    think_secs: f64,
    output_tokens: u64,
    corpus: u64,
}

fn knobs(kind: Kind, a: &WorkloadArgs) -> Knobs {
    let (prefix, turns, turn_blocks, think, out, corpus) = match kind {
        Kind::Chat => (2, 8, 2, 30.0, 300, 0),
        Kind::Agent => (8, 16, 1, 2.0, 80, 0),
        Kind::Rag => (1, 1, 4, 0.0, 200, 500),
        Kind::Scan => (1, 1, 16, 0.0, 50, 8),
        Kind::Long => (1, 1, 16, 0.0, 200, 200),
    };
    Knobs {
        prefix_blocks: a.prefix_blocks.unwrap_or(prefix),
        turns: a.turns.unwrap_or(turns).max(1),
        turn_blocks: a.turn_blocks.unwrap_or(turn_blocks).max(1),
        think_secs: a.think_secs.unwrap_or(think).max(0.0),
        output_tokens: a.output_tokens.unwrap_or(out),
        corpus: a.corpus.unwrap_or(corpus).max(1),
    }
}

/// The shared prefix's length in blocks for `kind` under `args` (the replay's system prompt).
pub fn prefix_blocks(kind: Kind, args: &WorkloadArgs) -> u64 {
    knobs(kind, args).prefix_blocks
}

/// A block's id: its parent's id mixed with its content (63 bits, so any JSON reader keeps it).
fn child(parent: u64, content: u64) -> u64 {
    mix64(parent ^ mix64(content).rotate_left(17)) >> 1
}

/// Append `n` blocks of fresh content to `chain`.
fn extend_fresh(chain: &mut Vec<u64>, n: u64, rng: &mut Rng) {
    for _ in 0..n {
        let parent = chain.last().copied().unwrap_or(0);
        chain.push(child(parent, rng.next_u64()));
    }
}

/// Append `n` blocks of the named content (equal `key`, equal text after an equal prefix).
fn extend_named(chain: &mut Vec<u64>, key: u64, n: u64) {
    for i in 0..n {
        let parent = chain.last().copied().unwrap_or(0);
        chain.push(child(parent, mix64(key).wrapping_add(i)));
    }
}

/// A prompt of `chain` whose last block is partly filled.
fn record(ts_secs: f64, chain: &[u64], output: u64, rng: &mut Rng) -> TraceRecord {
    let n = chain.len() as u64;
    let last = rng.range(MOONCAKE_BLOCK_TOKENS / 8, MOONCAKE_BLOCK_TOKENS);
    TraceRecord {
        timestamp: (ts_secs * 1000.0).round(),
        input_length: (n - 1) * MOONCAKE_BLOCK_TOKENS + last,
        output_length: output,
        hash_ids: chain.to_vec(),
    }
}

struct Session {
    chain: Vec<u64>,
    turns_left: u64,
}

/// Write `args.requests` requests of workload `kind` to `out`, in time order. Memory holds
/// only the sessions in progress.
pub fn generate(kind: Kind, args: &WorkloadArgs, out: &mut impl Write) -> anyhow::Result<u64> {
    if !(args.rate.is_finite() && args.rate > 0.0) {
        bail!("--workload-rate must be a positive number");
    }
    if !(0.0..=1.0).contains(&args.prefix_share) {
        bail!("--prefix-share must be between 0 and 1");
    }
    let k = knobs(kind, args);
    let mut rng = Rng::new(args.seed ^ (kind as u64) << 56);
    let out_len = |rng: &mut Rng| rng.range(1, (2 * k.output_tokens).max(1));
    // Sessions (or single requests) start as a Poisson process at rate / mean requests each.
    let per_session = match kind {
        Kind::Chat | Kind::Agent => (k.turns as f64 + 1.0) / 2.0,
        Kind::Rag | Kind::Scan | Kind::Long => 1.0,
    };
    let start_gap = per_session / args.rate;
    let mut next_start = 0.0f64;
    // Sessions waiting for their next turn, by time (ms as integer for ordering).
    let mut waiting: BinaryHeap<Reverse<(u64, u64)>> = BinaryHeap::new();
    let mut sessions: std::collections::HashMap<u64, Session> = Default::default();
    let mut next_id = 0u64;
    let mut written = 0u64;
    let shared_key = 0x7368_6172_6564u64; // the shared prefix's content
    while written < args.requests {
        let resume = waiting.peek().map(|Reverse((t, _))| *t as f64 / 1000.0);
        if let Some(t) = resume.filter(|&t| t <= next_start) {
            let Reverse((_, id)) = waiting.pop().expect("peeked");
            let mut s = sessions.remove(&id).expect("a waiting session exists");
            // A turn: the user's new blocks (chat) or a tool result (agent).
            let add = match kind {
                Kind::Agent => 1,
                _ => rng.range(1, k.turn_blocks),
            };
            extend_fresh(&mut s.chain, add, &mut rng);
            let output = out_len(&mut rng);
            write_record(out, &record(t, &s.chain, output, &mut rng))?;
            written += 1;
            s.turns_left -= 1;
            if s.turns_left > 0 {
                // The answer joins the history of the next turn.
                extend_fresh(
                    &mut s.chain,
                    output.div_ceil(MOONCAKE_BLOCK_TOKENS),
                    &mut rng,
                );
                let at = t + rng.exp(k.think_secs).max(0.001);
                waiting.push(Reverse(((at * 1000.0) as u64, id)));
                sessions.insert(id, s);
            }
            continue;
        }
        let t = next_start;
        next_start += rng.exp(start_gap);
        let mut chain = Vec::new();
        let shared = rng.f64() < args.prefix_share;
        let prefix_key = if shared { shared_key } else { rng.next_u64() };
        extend_named(&mut chain, prefix_key, k.prefix_blocks);
        match kind {
            Kind::Chat | Kind::Agent => {
                let s = Session {
                    chain,
                    turns_left: rng.range(1, k.turns),
                };
                // The first turn at once.
                waiting.push(Reverse(((t * 1000.0) as u64, next_id)));
                sessions.insert(next_id, s);
                next_id += 1;
            }
            Kind::Rag => {
                for _ in 0..rng.range(1, k.turn_blocks) {
                    let doc = zipf(&mut rng, k.corpus);
                    extend_named(&mut chain, 0xd0c0_0000 + doc, 2);
                }
                extend_fresh(&mut chain, 1, &mut rng);
                let output = out_len(&mut rng);
                write_record(out, &record(t, &chain, output, &mut rng))?;
                written += 1;
            }
            Kind::Long => {
                // A document of its own length (half to twice --turn-blocks), by popularity.
                let doc = zipf(&mut rng, k.corpus);
                let len = (k.turn_blocks / 2).max(1) + mix64(doc) % (k.turn_blocks * 3 / 2 + 1);
                extend_named(&mut chain, 0x1046_0000 + doc, len);
                extend_fresh(&mut chain, 1, &mut rng);
                let output = out_len(&mut rng);
                write_record(out, &record(t, &chain, output, &mut rng))?;
                written += 1;
            }
            Kind::Scan => {
                if rng.f64() < 0.3 {
                    let hot = rng.range(0, k.corpus - 1);
                    extend_named(&mut chain, 0x4000_0000 + hot, k.turn_blocks);
                } else {
                    extend_fresh(&mut chain, k.turn_blocks, &mut rng);
                }
                let output = out_len(&mut rng);
                write_record(out, &record(t, &chain, output, &mut rng))?;
                written += 1;
            }
        }
    }
    Ok(written)
}

/// A Zipf(1)-distributed rank in `0..n` (inverse transform over the harmonic weights).
fn zipf(rng: &mut Rng, n: u64) -> u64 {
    let h: f64 = (1..=n).map(|i| 1.0 / i as f64).sum();
    let mut u = rng.f64() * h;
    for i in 1..=n {
        u -= 1.0 / i as f64;
        if u <= 0.0 {
            return i - 1;
        }
    }
    n - 1
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::TraceReader;

    fn make(kind: Kind, requests: u64) -> Vec<TraceRecord> {
        let mut buf = Vec::new();
        let args = WorkloadArgs {
            requests,
            ..Default::default()
        };
        assert_eq!(generate(kind, &args, &mut buf).unwrap(), requests);
        TraceReader::new(&buf[..]).map(|r| r.unwrap()).collect()
    }

    /// Share of blocks whose prefix (the chain up to and including them) was seen before.
    fn reuse(t: &[TraceRecord]) -> f64 {
        let mut seen = std::collections::HashSet::new();
        let (mut hit, mut all) = (0u64, 0u64);
        for r in t {
            for &h in &r.hash_ids {
                all += 1;
                hit += u64::from(!seen.insert(h));
            }
        }
        hit as f64 / all as f64
    }

    #[test]
    fn every_kind_is_time_ordered_reproducible_and_consistent() {
        for kind in [Kind::Chat, Kind::Agent, Kind::Rag, Kind::Scan, Kind::Long] {
            let t = make(kind, 3_000);
            assert!(
                t.windows(2).all(|w| w[0].timestamp <= w[1].timestamp),
                "{kind:?}"
            );
            assert_eq!(t, make(kind, 3_000), "{kind:?} is not reproducible");
            for r in &t {
                let n = r.hash_ids.len() as u64;
                assert!(r.input_length > (n - 1) * 512 && r.input_length <= n * 512);
                assert!(r.output_length >= 1);
            }
            // About the requested rate (4/s): 3,000 requests in roughly 750 s.
            let secs = t.last().unwrap().timestamp / 1000.0;
            assert!((350.0..1500.0).contains(&secs), "{kind:?}: {secs}");
        }
    }

    #[test]
    fn the_kinds_have_their_shapes() {
        let chat = make(Kind::Chat, 3_000);
        let agent = make(Kind::Agent, 3_000);
        let rag = make(Kind::Rag, 3_000);
        let scan = make(Kind::Scan, 3_000);
        // Long prompts: a block of system prompt, a document of 8 to 32 blocks (4K–16K
        // tokens) and a question; popular documents
        // asked about again.
        let long = make(Kind::Long, 3_000);
        assert!(long.iter().all(|r| (10..=34).contains(&r.hash_ids.len())));
        let mean = long.iter().map(|r| r.input_length).sum::<u64>() / 3_000;
        assert!((4_000..16_000).contains(&mean), "{mean}");
        assert!(reuse(&long) > 0.3, "{}", reuse(&long));
        // Agents reuse the most (long shared prefix, many steps); scans the least.
        let (c, a, r, s) = (reuse(&chat), reuse(&agent), reuse(&rag), reuse(&scan));
        assert!(
            a > c && c > s && r > s,
            "chat {c} agent {a} rag {r} scan {s}"
        );
        // A chat turn extends an earlier turn of its session: its prompt minus the last
        // blocks was a whole earlier prompt's prefix.
        let firsts: std::collections::HashSet<u64> =
            chat.iter().map(|r| *r.hash_ids.last().unwrap()).collect();
        let continued = chat
            .iter()
            .filter(|r| r.hash_ids.iter().rev().skip(1).any(|h| firsts.contains(h)))
            .count();
        assert!(continued > 1_000, "{continued}");
        // With no prefix share every session's first block is its own.
        let mut buf = Vec::new();
        let args = WorkloadArgs {
            requests: 500,
            prefix_share: 0.0,
            ..Default::default()
        };
        generate(Kind::Rag, &args, &mut buf).unwrap();
        let firsts: std::collections::HashSet<u64> = TraceReader::new(&buf[..])
            .map(|r| r.unwrap().hash_ids[0])
            .collect();
        assert_eq!(firsts.len(), 500);
    }

    #[test]
    fn zipf_favours_the_first_ranks() {
        let mut rng = Rng::new(3);
        let mut counts = [0u32; 10];
        for _ in 0..10_000 {
            counts[zipf(&mut rng, 10) as usize] += 1;
        }
        assert!(counts[0] > counts[1] && counts[1] > counts[9], "{counts:?}");
    }
}
