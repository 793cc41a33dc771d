//! The workspace's layering, checked on its manifests: each crate may depend only on crates
//! below it. Ids and the error vocabulary at the bottom, then admin identity, then the
//! subsystems that need only those (fabric, engines), billing, the control plane, the
//! request path, the load tests, and the `cachet` binary on top. A dependency that points up
//! the stack (billing on the control plane, the control plane on the gateway, …) fails here
//! before it tangles the house again. The fabric's own modules have their own test
//! (`cache-fabric/tests/layering.rs`).

use std::collections::BTreeMap;
use std::path::Path;

/// Each workspace crate (its package name) with its layer: a crate may depend on crates of
/// lower layers only (crates of one layer do not know each other).
const LAYERS: &[(&str, &str, u32)] = &[
    ("common", "cachet-common", 0),
    ("identity", "identity", 1),
    ("cache-fabric", "cache-fabric", 2),
    ("engine", "engine", 2),
    ("billing", "billing", 3),
    ("control", "control", 4),
    ("gateway", "gateway", 5),
    ("loadtests", "loadtests", 6),
    (".", "cachet", 7),
];

/// The workspace crates each manifest depends on (normal, dev and build dependencies).
fn workspace_deps(manifest: &str, known: &[&str]) -> Vec<String> {
    let doc: toml::Table = manifest.parse().expect("a manifest parses");
    let mut out = Vec::new();
    for section in ["dependencies", "dev-dependencies", "build-dependencies"] {
        if let Some(t) = doc.get(section).and_then(|v| v.as_table()) {
            out.extend(t.keys().filter(|k| known.contains(&k.as_str())).cloned());
        }
    }
    out
}

/// Every dependency that does not point down the stack, as "crate -> dependency".
fn violations(manifests: &BTreeMap<&str, String>) -> Vec<String> {
    let layer: BTreeMap<&str, u32> = LAYERS.iter().map(|(_, n, l)| (*n, *l)).collect();
    let known: Vec<&str> = layer.keys().copied().collect();
    let mut bad = Vec::new();
    for (name, manifest) in manifests {
        let own = layer[name];
        for dep in workspace_deps(manifest, &known) {
            if layer[dep.as_str()] >= own {
                bad.push(format!("{name} -> {dep}"));
            }
        }
    }
    bad
}

#[test]
fn crates_depend_only_on_crates_below_them() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let workspace: toml::Table = std::fs::read_to_string(root.join("Cargo.toml"))
        .unwrap()
        .parse()
        .unwrap();
    let members: Vec<&str> = workspace["workspace"]["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m.as_str().unwrap())
        .collect();
    let mut manifests = BTreeMap::new();
    for (dir, name, _) in LAYERS {
        assert!(
            *dir == "." || members.contains(dir),
            "{dir} is in the layer table but not a workspace member"
        );
        let text = std::fs::read_to_string(root.join(dir).join("Cargo.toml")).unwrap();
        manifests.insert(*name, text);
    }
    for m in &members {
        assert!(
            LAYERS.iter().any(|(d, _, _)| d == m),
            "workspace member {m} has no layer: add it to LAYERS"
        );
    }
    let bad = violations(&manifests);
    assert!(bad.is_empty(), "dependencies up the stack: {bad:?}");
}

#[test]
fn an_import_up_the_stack_is_caught() {
    let mut manifests = BTreeMap::new();
    manifests.insert(
        "billing",
        "[package]\nname = \"billing\"\n[dependencies]\ncachet-common.workspace = true\n\
         control.workspace = true\n"
            .to_string(),
    );
    manifests.insert(
        "engine",
        "[package]\nname = \"engine\"\n[dev-dependencies]\ncache-fabric.workspace = true\n"
            .to_string(),
    );
    manifests.insert(
        "control",
        "[package]\nname = \"control\"\n[dependencies]\nbilling = { workspace = true }\n"
            .to_string(),
    );
    assert_eq!(
        violations(&manifests),
        vec!["billing -> control", "engine -> cache-fabric"],
        "an upward dependency and one between peers are caught; a downward one is not"
    );
}
