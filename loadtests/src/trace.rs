//! Mooncake-format traces: one JSON object per line with `timestamp` (ms from the start),
//! `input_length` and `output_length` (tokens) and `hash_ids`, the prompt's blocks in order
//! (512 tokens each in Mooncake's traces), where equal ids mean equal prefixes.
//!
//! Traces are read as a stream, one record at a time, so a trace of any length replays in
//! constant memory. How a record maps onto a session and a tenant lives here too, so the
//! replay and `simulate-cache` split a trace the same way.

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};

/// One request of a trace.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceRecord {
    /// Arrival, in milliseconds from the trace's start (fractions allowed).
    pub timestamp: f64,
    #[serde(default)]
    pub input_length: u64,
    #[serde(default)]
    pub output_length: u64,
    pub hash_ids: Vec<u64>,
}

/// Mooncake's block size, in tokens.
pub const MOONCAKE_BLOCK_TOKENS: u64 = 512;

/// Records of a trace, read lazily; an unreadable line is an error naming its number.
pub struct TraceReader<R> {
    reader: R,
    line_no: usize,
    buf: String,
}

impl<R: BufRead> TraceReader<R> {
    pub fn new(reader: R) -> Self {
        Self {
            reader,
            line_no: 0,
            buf: String::new(),
        }
    }
}

impl<R: BufRead> Iterator for TraceReader<R> {
    type Item = anyhow::Result<TraceRecord>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            self.buf.clear();
            self.line_no += 1;
            match self.reader.read_line(&mut self.buf) {
                Ok(0) => return None,
                Ok(_) => {}
                Err(e) => return Some(Err(anyhow::anyhow!("line {}: {e}", self.line_no))),
            }
            let line = self.buf.trim();
            if line.is_empty() {
                continue;
            }
            return Some(parse_line(line).with_context(|| format!("line {}", self.line_no)));
        }
    }
}

fn parse_line(line: &str) -> anyhow::Result<TraceRecord> {
    let r: TraceRecord = serde_json::from_str(line).context(
        "not a Mooncake trace record (timestamp, input_length, output_length, hash_ids)",
    )?;
    if !r.timestamp.is_finite() || r.timestamp < 0.0 {
        bail!(
            "timestamp must be a finite number >= 0, got {}",
            r.timestamp
        );
    }
    Ok(r)
}

/// Open a trace file for streaming.
pub fn open(path: &Path) -> anyhow::Result<TraceReader<BufReader<File>>> {
    let f = File::open(path).with_context(|| format!("opening the trace {}", path.display()))?;
    Ok(TraceReader::new(BufReader::with_capacity(1 << 20, f)))
}

/// Write one record as a trace line (integral timestamps without a fraction).
pub fn write_record(out: &mut impl Write, r: &TraceRecord) -> std::io::Result<()> {
    let ts = if r.timestamp.fract() == 0.0 {
        serde_json::json!(r.timestamp as u64)
    } else {
        serde_json::json!(r.timestamp)
    };
    let v = serde_json::json!({
        "timestamp": ts,
        "input_length": r.input_length,
        "output_length": r.output_length,
        "hash_ids": r.hash_ids,
    });
    serde_json::to_writer(&mut *out, &v)?;
    out.write_all(b"\n")
}

/// How a trace's requests are shaped into sessions, tenants and token counts.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    /// Tokens the replay gives each hash id (the trace's own block size, scaled).
    pub block_tokens: u64,
    /// The trace's block size (`input_length` is scaled by `block_tokens / trace_block_tokens`).
    pub trace_block_tokens: u64,
    /// Leading blocks that form the system prompt (shared by sessions).
    pub system_blocks: usize,
    /// Tenants (API keys) the sessions are spread over.
    pub tenants: usize,
}

impl Shape {
    /// Prompt tokens of each block of `r`: full blocks, then the remainder of
    /// `input_length` (scaled) in the last one (at least one token; at most a full block).
    pub fn block_lengths(&self, r: &TraceRecord) -> Vec<u64> {
        let n = r.hash_ids.len() as u64;
        if n == 0 {
            return Vec::new();
        }
        let scaled = (r.input_length as u128 * self.block_tokens as u128
            / self.trace_block_tokens.max(1) as u128) as u64;
        let last = scaled
            .saturating_sub((n - 1) * self.block_tokens)
            .clamp(1, self.block_tokens);
        let mut v = vec![self.block_tokens; n as usize];
        v[n as usize - 1] = last;
        v
    }

    /// Prompt tokens of `r` (the text's, before the chat template).
    pub fn input_tokens(&self, r: &TraceRecord) -> u64 {
        self.block_lengths(r).iter().sum()
    }

    /// The blocks that go into the system prompt: the first `system_blocks`, always leaving
    /// at least one for the user turn.
    pub fn system_len(&self, r: &TraceRecord) -> usize {
        self.system_blocks.min(r.hash_ids.len().saturating_sub(1))
    }

    /// The session a request belongs to: its first block after the system prompt (a
    /// conversation's later turns repeat its earlier ones), so a session's requests, and the
    /// prefixes they share, stay on one tenant.
    pub fn session(&self, r: &TraceRecord) -> u64 {
        r.hash_ids
            .get(self.system_len(r))
            .copied()
            .unwrap_or(u64::MAX)
    }

    /// The tenant (index into the API keys) of a request.
    pub fn tenant(&self, r: &TraceRecord) -> usize {
        (mix64(self.session(r)) % self.tenants.max(1) as u64) as usize
    }
}

/// SplitMix64's finalizer: a bijective mix of a 64-bit value.
pub fn mix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A small seeded generator (SplitMix64) for workloads and arrivals: reproducible from its
/// seed on every platform.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix64(self.0)
    }
    /// Uniform in [0, 1).
    pub fn f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi.saturating_sub(lo) + 1)
    }
    /// Exponentially distributed with mean `mean`.
    pub fn exp(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.f64()).ln()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(block: u64) -> Shape {
        Shape {
            block_tokens: block,
            trace_block_tokens: 512,
            system_blocks: 1,
            tenants: 3,
        }
    }

    #[test]
    fn reads_lines_lazily_and_names_the_bad_one() {
        let t = "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [0, 1]}\n\n{\"timestamp\": 12.5, \"hash_ids\": [0]}\nnope\n";
        let mut r = TraceReader::new(t.as_bytes());
        assert_eq!(r.next().unwrap().unwrap().hash_ids, vec![0, 1]);
        let second = r.next().unwrap().unwrap();
        assert_eq!((second.timestamp, second.input_length), (12.5, 0));
        let err = r.next().unwrap().unwrap_err();
        assert!(format!("{err:#}").starts_with("line 4"), "{err:#}");
        let neg = "{\"timestamp\": -1, \"hash_ids\": []}";
        assert!(TraceReader::new(neg.as_bytes()).next().unwrap().is_err());
    }

    #[test]
    fn records_round_trip_through_the_writer() {
        let r = TraceRecord {
            timestamp: 1500.0,
            input_length: 700,
            output_length: 20,
            hash_ids: vec![3, 4],
        };
        let mut out = Vec::new();
        write_record(&mut out, &r).unwrap();
        assert!(String::from_utf8_lossy(&out).starts_with("{\"timestamp\":1500,"));
        let back = TraceReader::new(&out[..]).next().unwrap().unwrap();
        assert_eq!(back, r);
    }

    #[test]
    fn block_lengths_scale_and_put_the_remainder_last() {
        let r = TraceRecord {
            timestamp: 0.0,
            input_length: 6758, // 13 full blocks + 102
            output_length: 1,
            hash_ids: (0..14).collect(),
        };
        let full = shape(512).block_lengths(&r);
        assert_eq!((full[0], full[13], full.len()), (512, 102, 14));
        assert_eq!(shape(512).input_tokens(&r), 6758);
        // At 64 tokens a block, the same shape at 1/8 the size.
        assert_eq!(shape(64).input_tokens(&r), 13 * 64 + 12);
        // An input longer than its blocks is capped; an empty remainder still gets a token.
        let mut long = r.clone();
        long.input_length = 99_999;
        assert_eq!(shape(512).input_tokens(&long), 14 * 512);
        long.input_length = 13 * 512;
        assert_eq!(*shape(512).block_lengths(&long).last().unwrap(), 1);
    }

    #[test]
    fn a_conversation_stays_on_one_tenant_and_tenants_all_get_sessions() {
        let s = shape(512);
        let turn1 = TraceRecord {
            timestamp: 0.0,
            input_length: 1000,
            output_length: 1,
            hash_ids: vec![0, 7, 8],
        };
        let mut turn2 = turn1.clone();
        turn2.hash_ids.extend([9, 10]);
        assert_eq!(s.session(&turn1), 7);
        assert_eq!(s.tenant(&turn1), s.tenant(&turn2));
        let mut seen = [0usize; 3];
        for sess in 0..300u64 {
            let r = TraceRecord {
                hash_ids: vec![0, sess],
                ..turn1.clone()
            };
            seen[s.tenant(&r)] += 1;
        }
        assert!(seen.iter().all(|&n| n > 60), "{seen:?}");
        // A one-block request is its own session (no system part).
        let one = TraceRecord {
            hash_ids: vec![42],
            ..turn1
        };
        assert_eq!((s.system_len(&one), s.session(&one)), (0, 42));
    }

    #[test]
    fn the_generator_is_reproducible_and_exponential_has_its_mean() {
        let mut a = Rng::new(9);
        let mut b = Rng::new(9);
        assert_eq!(a.next_u64(), b.next_u64());
        let n = 100_000;
        let mean = (0..n).map(|_| a.exp(2.0)).sum::<f64>() / n as f64;
        assert!((mean - 2.0).abs() < 0.05, "{mean}");
        assert!((0..1000).all(|_| (3..=5).contains(&a.range(3, 5))));
    }
}
