//! Reference engine speed vs candle's own `quantized_llama` on the same GGUF file, in one run.
//!
//!     make bench-engine
//!
//! which runs `cargo bench -p engine --bench reference` twice: once for Cachet's engine and
//! candle's `quantized_llama` as shipped (Q4_1), once with `CANDLE_DEQUANTIZE_ALL=1` for candle's
//! f32 configuration (candle reads that variable once per process).
//!
//! Prints prefill tok/s at 512 and 2048 tokens, decode tok/s at a 512-token context, and the
//! time to first token for a 2,048-token prompt fully cached (16 new tokens) vs uncached.
//!
//! With `CACHET_BENCH_KV_DTYPES=1`: only that TTFT, once per KV dtype (f32, f16, bf16, int8,
//! fp8), with the bytes a token and the 2,048-token prefix take in each.

use std::time::Instant;

use cachet_common::BlockHash;
use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama::ModelWeights;
use engine::reference::{ReferenceEngine, default_model_path};
use engine::{Engine, ExportSpec, GenerateRequest, Sampling};

const TEXT: &str = "The history of caching in computing begins with small, fast memories placed \
in front of large, slow ones. Processors keep recently used data close at hand, databases keep \
hot pages in buffer pools, and web servers keep rendered pages ready to send. ";

fn tokens(e: &ReferenceEngine, n: usize) -> Vec<u32> {
    let mut t = Vec::new();
    while t.len() < n {
        t.extend(e.tokenizer().encode(TEXT));
    }
    t.truncate(n);
    t
}

fn ours(e: &ReferenceEngine) {
    let decode_only = std::env::var_os("CACHET_BENCH_DECODE_ONLY").is_some();
    let ttft_only = std::env::var_os("CACHET_BENCH_TTFT_ONLY").is_some();
    for n in [512, 2048] {
        if decode_only || ttft_only {
            break;
        }
        let t = tokens(e, n);
        let start = Instant::now();
        let g = e
            .start(GenerateRequest {
                tokens: t,
                imported: vec![],
                exports: vec![],
                sampling: Sampling::default(),
                max_new_tokens: 1,
                connector: None,
            })
            .unwrap();
        let secs = start.elapsed().as_secs_f64();
        drop(g);
        println!(
            "cachet-reference\tprefill\t{n}\t{:.1} tok/s\t({secs:.2} s)",
            n as f64 / secs
        );
    }
    if !ttft_only {
        decode(e);
    }
    if decode_only {
        return;
    }
    ttft(e);
}

fn decode(e: &ReferenceEngine) {
    let t = tokens(e, 512);
    let mut g = e
        .start(GenerateRequest {
            tokens: t,
            imported: vec![],
            exports: vec![],
            sampling: Sampling::default(),
            max_new_tokens: 64,
            connector: None,
        })
        .unwrap();
    g.next_token().unwrap();
    let steps = std::env::var("CACHET_BENCH_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(32);
    let start = Instant::now();
    for _ in 0..steps {
        // Greedy decode may stop early at end of turn; the text keeps it going in practice.
        if g.next_token().unwrap().is_none() {
            break;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "cachet-reference\tdecode@512\t{steps}\t{:.1} tok/s",
        steps as f64 / secs
    );
}

fn ttft(e: &ReferenceEngine) {
    ttft_as(e, "cachet-reference");
}

fn ttft_as(e: &ReferenceEngine, label: &str) {
    // TTFT: 2,048 cached + 16 new vs all 2,064 computed.
    let t = tokens(e, 2064);
    let specs: Vec<ExportSpec> = (0..128)
        .map(|i| ExportSpec {
            hash: BlockHash([i as u8; 32]),
            start: i * 16,
            end: (i + 1) * 16,
        })
        .collect();
    let start = Instant::now();
    let mut g = e
        .start(GenerateRequest {
            tokens: t.clone(),
            imported: vec![],
            exports: specs,
            sampling: Sampling::default(),
            max_new_tokens: 1,
            connector: None,
        })
        .unwrap();
    g.next_token().unwrap();
    let cold = start.elapsed().as_secs_f64();
    let blocks = g.take_exports();
    // Best of 5 (the cached path is short enough for scheduling noise to matter).
    let runs = std::env::var("CACHET_BENCH_TTFT_RUNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let mut warm = f64::MAX;
    for _ in 0..runs {
        let start = Instant::now();
        let mut g = e
            .start(GenerateRequest {
                tokens: t.clone(),
                imported: blocks.clone(),
                exports: vec![],
                sampling: Sampling::default(),
                max_new_tokens: 1,
                connector: None,
            })
            .unwrap();
        g.next_token().unwrap();
        warm = warm.min(start.elapsed().as_secs_f64());
    }
    let prefix_bytes: usize = blocks.iter().map(|b| b.data.len()).sum();
    println!(
        "{label}\tttft-2048\tuncached {:.0} ms\tcached {:.1} ms\tratio {:.2}%\tkv {} B/token\tprefix {:.1} MiB",
        cold * 1e3,
        warm * 1e3,
        100.0 * warm / cold,
        e.info().kv.bytes_per_token(),
        prefix_bytes as f64 / (1 << 20) as f64
    );
}

fn candle(path: &std::path::Path, label: &str, sizes: &[usize], e: &ReferenceEngine) {
    let mut file = std::fs::File::open(path).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let mut m = ModelWeights::from_gguf(content, &mut file, &Device::Cpu).unwrap();
    for &n in sizes {
        let t = Tensor::new(tokens(e, n).as_slice(), &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        m.clear_kv_cache();
        let start = Instant::now();
        m.forward(&t, 0).unwrap();
        let secs = start.elapsed().as_secs_f64();
        println!(
            "{label}\tprefill\t{n}\t{:.1} tok/s\t({secs:.2} s)",
            n as f64 / secs
        );
    }
    let t = Tensor::new(tokens(e, 512).as_slice(), &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    m.clear_kv_cache();
    m.forward(&t, 0).unwrap();
    let steps = 32;
    let start = Instant::now();
    for i in 0..steps {
        let x = Tensor::new(&[504u32], &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        m.forward(&x, 512 + i).unwrap();
    }
    println!(
        "{label}\tdecode@512\t{steps}\t{:.1} tok/s",
        steps as f64 / start.elapsed().as_secs_f64()
    );
}

fn main() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(default_model_path());
    if !path.exists() {
        eprintln!("model file missing: run `make model`");
        return;
    }
    let threads = candle_core::utils::get_num_threads();
    println!("# {} threads; SmolLM2-135M-Instruct Q4_1 GGUF", threads);
    let e = ReferenceEngine::load(&path).unwrap();
    if std::env::var_os("CACHET_BENCH_KV_DTYPES").is_some() {
        for d in engine::KvDtype::ALL {
            ttft_as(&e.with_kv_dtype(d), &format!("kv-{d}"));
        }
        return;
    }
    if std::env::var_os("CANDLE_DEQUANTIZE_ALL").is_some() {
        candle(&path, "candle-quantized_llama-f32", &[512, 2048], &e);
        return;
    }
    ours(&e);
    if std::env::var_os("CACHET_BENCH_DECODE_ONLY").is_some()
        || std::env::var_os("CACHET_BENCH_TTFT_ONLY").is_some()
    {
        return;
    }
    // candle's quantized_llama as shipped (Q4_1; 512 only: 2,048 takes minutes).
    candle(&path, "candle-quantized_llama-q4_1", &[512], &e);
}
