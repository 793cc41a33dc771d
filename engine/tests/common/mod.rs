//! What the model tests share: the reference engine, loaded once per test binary.

use std::sync::OnceLock;

use engine::reference::{ReferenceEngine, default_model_path};

/// The SmolLM2 file: `CACHET_MODEL_PATH`, or where `make model` puts it.
pub fn model_path() -> std::path::PathBuf {
    std::env::var("CACHET_MODEL_PATH")
        .map(Into::into)
        .unwrap_or_else(|_| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("..")
                .join(default_model_path())
        })
}

/// The reference engine on the real SmolLM2 file ([`model_path`]), or `None`, with a
/// message, when the file is absent outside CI. In CI (`CI` set, as `.ci/run` does) a missing
/// file fails the test: `make test` fetches it first, so a broken fetch must not pass unseen.
pub fn engine() -> Option<&'static ReferenceEngine> {
    static E: OnceLock<Option<ReferenceEngine>> = OnceLock::new();
    E.get_or_init(|| {
        let path = model_path();
        if !path.exists() {
            assert!(
                std::env::var_os("CI").is_none(),
                "CI must have the model at {} (`make model` fetches it)",
                path.display()
            );
            eprintln!("skipping: {} not found (run `make model`)", path.display());
            return None;
        }
        Some(ReferenceEngine::load(&path).expect("model loads"))
    })
    .as_ref()
}
