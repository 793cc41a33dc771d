//! The real model through the whole service: for every prompt, the answer with a cached
//! prefix equals the answer without it, token for token; and a prefix computed by one engine
//! instance, stored in the fabric and read back, is used by a freshly loaded instance.

mod common;

use std::time::Duration;

use cache_fabric::{
    EntryKind, EvictionPolicy, FabricClient, FabricNode, Holding, KeySpace, NodeConfig, PutBlock,
};
use cachet_common::{Scope, TenantId, WorkspaceId};
use common::*;
use engine::reference::{ReferenceEngine, default_model_path};
use engine::{
    Engine, ExportSpec, GenerateRequest, KvBlock, Prompt, PromptMessage, Role, Sampling, TextStream,
};
use serde_json::{Value, json};

const MODEL: &str = "smollm2-135m-instruct";

fn model_path() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(default_model_path())
}

/// Whether the model file is here; outside CI a missing one skips the test with a message, in
/// CI it fails it (`make test` fetches the model first).
fn have_model() -> bool {
    let path = model_path();
    if path.exists() {
        return true;
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "CI must have the model at {} (`make model` fetches it)",
        path.display()
    );
    eprintln!(
        "skipping: {} not found (run `make model` first)",
        path.display()
    );
    false
}

fn cc() -> Value {
    json!({"type": "ephemeral"})
}

fn text(t: &str, marked: bool) -> Value {
    if marked {
        json!({"type": "text", "text": t, "cache_control": cc()})
    } else {
        json!({"type": "text", "text": t})
    }
}

const LONG: &str = "Cachet keeps the key-value cache of prompt prefixes so that later requests with the same prefix skip their prefill. ";

/// Eight prompts: 1–4 breakpoints, prefixes ending mid-block, tools + system + multi-turn.
fn prompts() -> Vec<Value> {
    let long = LONG.repeat(3);
    let tool = json!({"name": "get_weather", "description": "Get the weather for a city. ".repeat(4), "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}, "cache_control": cc()});
    vec![
        // 1 breakpoint on the system prompt.
        json!({"system": [text(&long, true)], "messages": [{"role": "user", "content": "What does Cachet keep?"}]}),
        // 1 breakpoint on a user message (ends mid-block).
        json!({"messages": [{"role": "user", "content": [text(&format!("{long} Summarize that in five words."), true)]}]}),
        // 2 breakpoints: system and the first user block.
        json!({"system": [text(&long, true)], "messages": [{"role": "user", "content": [text("Explain prefill in one sentence.", true), text("Be brief.", false)]}]}),
        // 3 breakpoints: tools, system, message.
        json!({"tools": [tool.clone()], "system": [text(&long, true)], "messages": [{"role": "user", "content": [text("Is it raining in Paris?", true)]}]}),
        // 4 breakpoints over a multi-turn conversation.
        json!({"tools": [tool], "system": [text(&long, true)], "messages": [
            {"role": "user", "content": [text("Hello! Who are you?", true)]},
            {"role": "assistant", "content": "I am a helpful assistant."},
            {"role": "user", "content": [text("What is a prompt cache?", true)]}]}),
        // Multi-turn, automatic caching.
        json!({"cache_control": cc(), "system": long.clone(), "messages": [
            {"role": "user", "content": "Name a color."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Name another one."}]}),
        // 1h TTL, then a 5m breakpoint.
        json!({"system": [{"type": "text", "text": long.clone(), "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
               "messages": [{"role": "user", "content": [text("What is 2 + 2?", true)]}]}),
        // An assistant prefill continued after a cached prefix.
        json!({"system": [text(&long, true)], "messages": [
            {"role": "user", "content": "Write one sentence about caches."},
            {"role": "assistant", "content": "A cache"}]}),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_prompt_answers_the_same_with_and_without_its_cached_prefix() {
    if !have_model() {
        return;
    }
    let app = TestApp::start_with(Options {
        engine: "reference",
        ..Default::default()
    })
    .await;
    for (i, p) in prompts().into_iter().enumerate() {
        // Each prompt its own text, so its first call is cold.
        let mut body: Value = serde_json::from_str(
            &p.to_string()
                .replace("Cachet keeps", &format!("In case {i}, Cachet keeps")),
        )
        .unwrap();
        body["model"] = json!(MODEL);
        body["max_tokens"] = json!(24);
        let (s1, _, cold) = app.post("/v1/messages", &app.key, &body).await;
        assert_eq!(s1, 200, "prompt {i}: {cold}");
        let (_, _, warm) = app.post("/v1/messages", &app.key, &body).await;
        let (cu, wu) = (&cold["usage"], &warm["usage"]);
        assert!(
            cu["cache_creation_input_tokens"].as_u64().unwrap() > 0,
            "prompt {i} wrote nothing: {cold}"
        );
        assert!(
            wu["cache_read_input_tokens"].as_u64().unwrap() > 0,
            "prompt {i} read nothing: {warm}"
        );
        assert_eq!(usage_total(cu), usage_total(wu));
        assert_eq!(
            cold["content"], warm["content"],
            "prompt {i}: cached prefix changed the answer"
        );
        assert_eq!(cu["output_tokens"], wu["output_tokens"], "prompt {i}");
        assert_eq!(cold["stop_reason"], warm["stop_reason"]);
    }
    app.settle().await;
    app.stop().await;
}

fn generate(
    e: &ReferenceEngine,
    tokens: &[u32],
    imported: Vec<KvBlock>,
    exports: Vec<ExportSpec>,
) -> (String, u32, Vec<KvBlock>) {
    let mut g = e
        .start(GenerateRequest {
            tokens: tokens.to_vec(),
            imported,
            exports,
            sampling: Sampling::default(),
            max_new_tokens: 20,
            connector: None,
        })
        .unwrap();
    let exported = g.take_exports();
    let mut s = TextStream::new(g, 20, vec![]);
    let mut out = String::new();
    while let Some(d) = s.next_delta().unwrap() {
        out.push_str(&d.text);
    }
    (out, s.output_tokens(), exported)
}

#[tokio::test]
async fn a_fresh_engine_instance_uses_a_prefix_read_back_from_the_fabric() {
    if !have_model() {
        return;
    }
    // f32 KV, so the logits can be compared to 1e-4 below: with int8 KV (the default) a
    // suffix token computed in a different batch can land one quantization step away in a
    // few elements (engine/tests/kv_dtypes.rs checks that answers still agree).
    let first = ReferenceEngine::load(&model_path())
        .unwrap()
        .with_kv_dtype(engine::KvDtype::F32);
    let prompt = Prompt {
        tools: vec!["{\"name\":\"lookup\",\"description\":\"Look a word up.\"}".into()],
        system: vec![LONG.repeat(2)],
        messages: vec![
            PromptMessage {
                role: Role::User,
                blocks: vec!["Define cache.".into()],
            },
            PromptMessage {
                role: Role::Assistant,
                blocks: vec!["A store of copies.".into()],
            },
            PromptMessage {
                role: Role::User,
                blocks: vec!["And prefill?".into()],
            },
        ],
        memo_scope: 0,
    };
    let r = first.render(&prompt).unwrap();
    let bp = r.message_ends[1][0]; // mid-block, after the assistant turn
    assert_ne!(bp % 16, 0);
    let scope = Scope {
        tenant: TenantId::new(),
        workspace: WorkspaceId::new(),
    };
    let info = first.info().clone();
    let keys = KeySpace::new(scope, &info.id, "", info.kv.dtype.as_str(), info.block_size)
        .prefix_keys(&r.tokens, bp, &[bp]);
    let links = keys.chain_to(bp).unwrap();
    let specs: Vec<ExportSpec> = links
        .iter()
        .map(|l| ExportSpec {
            hash: l.hash,
            start: l.start,
            end: l.end,
        })
        .collect();
    let (cold_text, cold_n, exported) = generate(&first, &r.tokens, vec![], specs);
    drop(first);

    // Store the blocks in a fabric node and read them back.
    let fabric = FabricClient::local(FabricNode::new(NodeConfig {
        dram_capacity_bytes: 1 << 30,
        eviction: EvictionPolicy::DEFAULT,
    }));
    let now = tokio::time::Instant::now();
    let puts: Vec<PutBlock> = exported
        .iter()
        .zip(&links)
        .map(|(b, l)| PutBlock::new(b.hash, l.parent, (b.end - b.start) as u32, b.data.clone()))
        .collect();
    fabric
        .write_entry(
            scope,
            &keys,
            bp,
            &puts,
            Holding {
                ttl: Duration::from_secs(300),
                kind: EntryKind::Paid,
            },
            now,
        )
        .await
        .unwrap();
    let read = fabric.read_prefix(scope, &keys, bp, now).await;
    assert_eq!(read.tokens, bp);
    let imported = gateway::pipeline::imported_kv(&read);

    let fresh = ReferenceEngine::load(&model_path())
        .unwrap()
        .with_kv_dtype(engine::KvDtype::F32);
    let (warm_text, warm_n, _) = generate(&fresh, &r.tokens, imported.clone(), vec![]);
    assert_eq!((cold_text, cold_n), (warm_text, warm_n));

    // f32 logits with the imported prefix match a full recomputation within 1e-4.
    let full = fresh.logits(&r.tokens, &[]).unwrap();
    let cached = fresh.logits(&r.tokens, &imported).unwrap();
    let max = full
        .iter()
        .zip(&cached)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(max < 1e-4, "max |Δlogit| = {max}");
}
