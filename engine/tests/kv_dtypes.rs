//! Compressed KV on the real SmolLM2 model: quality against f32 KV on a fixed set of 50
//! prompts (16 in the suite; `CACHET_KV_QUALITY_PROMPTS=50` for all), and identical answers with and without a cached prefix for every dtype.
//! Skipped with a message when the model file is absent outside CI; in CI that fails.
//!
//! The figures (agreement and log-prob difference per dtype) print with `--nocapture`;
//! docs/benchmarks.md quotes them.

mod common;

use cachet_common::BlockHash;
use common::engine;
use engine::reference::ReferenceEngine;
use engine::{
    Engine, ExportSpec, GenerateRequest, KvBlock, KvDtype, Prompt, PromptMessage, Role, Sampling,
};

/// Fifty short, varied questions (facts, how-to, code, arithmetic, writing).
const QUESTIONS: [&str; 50] = [
    "What is the capital of France?",
    "Why is the sky blue?",
    "Name three rivers in Europe.",
    "How do plants make their food?",
    "What is the boiling point of water at sea level?",
    "Write a haiku about autumn leaves.",
    "Explain what a prime number is.",
    "What is 17 times 3?",
    "Give me a tip for sleeping better.",
    "Who wrote Romeo and Juliet?",
    "What does a compiler do?",
    "Write a Python function that adds two numbers.",
    "How many continents are there?",
    "What causes the seasons on Earth?",
    "Suggest a name for a pet goldfish.",
    "What is the largest planet in our solar system?",
    "Describe a cat in one sentence.",
    "How do I boil an egg?",
    "What is photosynthesis?",
    "Translate 'good morning' into Spanish.",
    "What is the speed of light?",
    "List three primary colors.",
    "Why do we need sleep?",
    "What is a noun?",
    "Explain gravity to a child.",
    "What is the square root of 81?",
    "Write a short greeting for a birthday card.",
    "What language is spoken in Brazil?",
    "How does a rainbow form?",
    "What is the main ingredient of bread?",
    "Give an example of a mammal that lives in the sea.",
    "What is the difference between weather and climate?",
    "How many days are in a leap year?",
    "What is a verb? Give an example.",
    "Write a SQL query that counts the rows of a table named users.",
    "What do bees make?",
    "Explain what an atom is.",
    "Which ocean is the largest?",
    "How can I save water at home?",
    "What is the freezing point of water in Fahrenheit?",
    "Tell me a fun fact about octopuses.",
    "What is the tallest mountain in the world?",
    "What does HTML stand for?",
    "Describe the color green without naming it.",
    "Why do leaves change color in the fall?",
    "What is 100 divided by 4?",
    "Name a famous painting by Leonardo da Vinci.",
    "What is the chemical symbol for gold?",
    "How do airplanes stay in the air?",
    "Write one sentence about the moon.",
];

/// Tokens of each answer.
const CONTINUATION: usize = 8;

/// How many of [`QUESTIONS`] the quality check scores: `CACHET_KV_QUALITY_PROMPTS` (all 50
/// for the figures in docs/benchmarks.md), else the first 16 — the suite's slice, since each
/// prompt is scored seven times on the real model.
fn quality_prompts() -> usize {
    std::env::var("CACHET_KV_QUALITY_PROMPTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16)
        .clamp(1, QUESTIONS.len())
}

fn render(e: &ReferenceEngine, q: &str, system: &str) -> engine::Rendered {
    e.render(&Prompt {
        tools: vec![],
        system: vec![system.into()],
        messages: vec![PromptMessage {
            role: Role::User,
            blocks: vec![q.into()],
        }],
        memo_scope: 0,
    })
    .unwrap()
}

/// Top-1 agreement with f32 KV and the mean absolute difference of the next token's
/// log-probability, over every position from each question's first token to the end of
/// f32's greedy answer (8 tokens), teacher-forced: each dtype reads the same text, and at
/// each position its most likely next token is compared with f32's.
#[test]
fn compressed_kv_agrees_with_f32_on_fifty_prompts() {
    let Some(base) = engine() else { return };
    let e = &base.with_kv_dtype(KvDtype::F32);
    // Each prompt with f32's greedy answer appended, and where scoring starts.
    let prompts = quality_prompts();
    let texts: Vec<(Vec<u32>, usize)> = QUESTIONS[..prompts]
        .iter()
        .map(|q| {
            let r = render(e, q, "You are a helpful assistant.");
            let answer: Vec<u32> = e
                .score(&r.tokens, &[], CONTINUATION)
                .unwrap()
                .iter()
                .map(|s| s.greedy)
                .collect();
            let start = r.system_ends[0];
            (r.tokens.iter().chain(&answer).copied().collect(), start)
        })
        .collect();
    let scores = |e: &ReferenceEngine| -> Vec<Vec<engine::reference::TokenScore>> {
        texts
            .iter()
            .map(|(t, start)| e.score(&t[..*start], &t[*start..], 0).unwrap())
            .collect()
    };
    let reference = scores(e);
    println!("dtype\tbytes/token\ttop-1 agreement\tmean |Δ log p|\tmax |Δ log p|");
    for d in KvDtype::ALL {
        let ed = e.with_kv_dtype(d);
        let (mut agree, mut total, mut sum, mut max) = (0usize, 0usize, 0f64, 0f64);
        for (got, want) in scores(&ed).iter().zip(&reference) {
            for (g, w) in got.iter().zip(want) {
                total += 1;
                agree += usize::from(g.greedy == w.greedy);
                let diff = (g.logprob - w.logprob).abs() as f64;
                sum += diff;
                max = max.max(diff);
            }
        }
        let agreement = agree as f64 / total as f64;
        let mean = sum / total as f64;
        println!(
            "{d}\t{}\t{agreement:.4} ({agree}/{total})\t{mean:.4}\t{max:.4}",
            ed.info().kv.bytes_per_token()
        );
        assert!(total >= prompts * CONTINUATION, "{total} positions");
        // Acceptance: 99% for 16-bit, 97% for 8-bit (int8). FP8 E4M3 keeps 3 mantissa bits,
        // whatever its scale: on this small model it stays above 93% and is offered for
        // larger ones (decision 0019); its floor here guards against regressions.
        let floor = match d {
            KvDtype::F32 | KvDtype::F16 | KvDtype::Bf16 => 0.99,
            KvDtype::Int8 => 0.97,
            KvDtype::Fp8 => 0.93,
        };
        assert!(
            agreement >= floor,
            "{d}: top-1 agreement {agreement:.4} below {floor}"
        );
        assert!(mean < 0.1, "{d}: mean log-prob difference {mean:.4}");
        if d == KvDtype::F32 {
            assert_eq!((agree, mean), (total, 0.0), "f32 scores itself exactly");
        }
    }
}

fn greedy(e: &ReferenceEngine, tokens: &[u32], imported: Vec<KvBlock>) -> Vec<u32> {
    greedy_exporting(e, tokens, imported, vec![]).0
}

/// The greedy continuation of `tokens`, and the blocks `exports` asked for.
fn greedy_exporting(
    e: &ReferenceEngine,
    tokens: &[u32],
    imported: Vec<KvBlock>,
    exports: Vec<ExportSpec>,
) -> (Vec<u32>, Vec<KvBlock>) {
    let mut g = e
        .start(GenerateRequest {
            tokens: tokens.to_vec(),
            imported,
            exports,
            sampling: Sampling {
                ignore_eos: true,
                ..Sampling::default()
            },
            max_new_tokens: CONTINUATION as u32,
            connector: None,
        })
        .unwrap();
    let blocks = g.take_exports();
    let answer = (0..CONTINUATION)
        .map_while(|_| g.next_token().unwrap().map(|t| t.id))
        .collect();
    (answer, blocks)
}

/// For every dtype: a prefix exported as a whole block plus a breakpoint's partial tail by a
/// generation that computed it from nothing, and imported into a fresh generation, gives that
/// first generation's answer, token for token;
/// blocks take the dtype's bytes; another dtype's blocks are refused, never misread.
#[test]
fn cached_prefix_gives_identical_answers_for_every_dtype() {
    let Some(base) = engine() else { return };
    let system = "You are a concise assistant who answers questions about geography, \
                  history and the natural world in one or two sentences.";
    for d in KvDtype::ALL {
        let e = base.with_kv_dtype(d);
        for q in ["Name three rivers in Europe.", "Why is the sky blue?"] {
            let r = render(&e, q, system);
            let cut = r.system_ends[0];
            let block = e.info().block_size;
            assert!(cut > block, "the system prompt spans a whole block");
            let whole = cut / block * block;
            // The request that computes the prompt from nothing and writes the prefix.
            let (cold, blocks) = greedy_exporting(
                &e,
                &r.tokens,
                vec![],
                vec![
                    ExportSpec {
                        hash: BlockHash([1; 32]),
                        start: 0,
                        end: whole,
                    },
                    ExportSpec {
                        hash: BlockHash([2; 32]),
                        start: whole,
                        end: cut,
                    },
                ],
            );
            assert_eq!(blocks[0].data.len(), whole * e.info().kv.bytes_per_token());
            assert_eq!(
                blocks[1].data.len(),
                (cut - whole) * e.info().kv.bytes_per_token()
            );
            // The one that reads it back.
            let warm = greedy(&e, &r.tokens, blocks.clone());
            assert_eq!(cold.len(), CONTINUATION, "{d}");
            assert_eq!(cold, warm, "{d}: {q}");
            let other = if d == KvDtype::F32 {
                KvDtype::Int8
            } else {
                KvDtype::F32
            };
            let err = base
                .with_kv_dtype(other)
                .start(GenerateRequest {
                    tokens: r.tokens.clone(),
                    imported: blocks,
                    exports: vec![],
                    sampling: Sampling::default(),
                    max_new_tokens: 1,
                    connector: None,
                })
                .err()
                .expect("another dtype's blocks are refused");
            assert!(
                matches!(err, engine::EngineError::InvalidImport(_)),
                "{d} read as {other}: {err}"
            );
        }
    }
}
