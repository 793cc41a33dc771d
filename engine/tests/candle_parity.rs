//! Our forward pass against an independent implementation: candle's `quantized_llama` with
//! every weight dequantized to f32, on the same file and tokens. One test per binary: the
//! environment variable candle reads is process-wide.

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama::ModelWeights;
use engine::reference::{ReferenceEngine, default_model_path};

#[test]
fn logits_match_candles_f32_llama_within_1e_4() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(default_model_path());
    if !path.exists() {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must have the model at {} (`make model` fetches it)",
            path.display()
        );
        eprintln!("skipping: run `make model` first");
        return;
    }
    // SAFETY: the only test in this binary; set before any thread reads the environment.
    unsafe { std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1") };
    // f32 KV: the comparison is of the forward pass (int8 KV, the default, is measured
    // against f32 KV in tests/kv_dtypes.rs).
    let ours = ReferenceEngine::load(&path)
        .unwrap()
        .with_kv_dtype(engine::KvDtype::F32);
    let tokens = ours
        .tokenizer()
        .encode("The capital of France is Paris, and the capital of Italy is");
    let mine = ours.logits(&tokens, &[]).unwrap();

    let mut file = std::fs::File::open(&path).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let mut theirs = ModelWeights::from_gguf(content, &mut file, &Device::Cpu).unwrap();
    let input = Tensor::new(tokens.as_slice(), &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let reference: Vec<f32> = theirs
        .forward(&input, 0)
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_vec1()
        .unwrap();

    assert_eq!(mine.len(), reference.len());
    let max = mine
        .iter()
        .zip(&reference)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(max < 1e-4, "max |Δlogit| = {max}");
}
