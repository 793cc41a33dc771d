//! The source tree, checked. `docs/architecture.md` names every source file and only files that
//! exist. Layering inside each crate, checked on its sources: no two files (and, outside the fabric,
//! no two top-level modules) may reach each other through their paths, and the gateway's wire
//! vocabulary sits at the bottom of the gateway. A file's edges are every `crate::…`,
//! `super::…` and `self::…` path in its code: in `use` lines (braces expanded) and inline
//! (`crate::alerts::check_now(…)`), outside comments and outside its `#[cfg(test)]` module.
//! A parent's `mod child;` and its use of the child by bare name are how Rust nests modules
//! and are not edges; a child's `super::…` is.
//!
//! The fabric's modules have an explicit order on top of this
//! (`cache-fabric/tests/layering.rs`); the crates' own order is `tests/layering.rs`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The crates whose files are checked for circles.
const CRATES: &[&str] = &[
    "common",
    "identity",
    "cache-fabric",
    "engine",
    "billing",
    "control",
    "gateway",
    "loadtests",
    ".",
];

/// Crates whose top-level modules may reach each other as long as their files do not: the
/// fabric's RDMA files sit at two layers of its order (`rdma.rs` below the node,
/// `rdma/serve.rs` and `rdma/pull.rs` above it), which its own test spells out.
const FILE_LEVEL_ONLY: &[&str] = &["cache-fabric"];

/// Gateway modules the wire vocabulary may name (everything else is above it).
const WIRE_MAY_NAME: &[&str] = &["wire", "error"];

/// A file's module path from its crate root: `api/stages.rs` → `[api, stages]`,
/// `wire/mod.rs` → `[wire]`, `lib.rs` → `[]`.
fn module_of(rel: &str) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .trim_end_matches(".rs")
        .split('/')
        .map(str::to_string)
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts
}

/// The file that defines the longest prefix of `path` (a module path from the crate root).
fn file_of(src: &Path, path: &[String]) -> Option<String> {
    (1..=path.len()).rev().find_map(|k| {
        let base: PathBuf = path[..k].iter().collect();
        [base.with_extension("rs"), base.join("mod.rs")]
            .into_iter()
            .find(|f| src.join(f).is_file())
            .map(|f| f.to_string_lossy().into_owned())
    })
}

/// A file's code: comments removed, its `#[cfg(test)]` module (at the end, by the crate's
/// habit) cut off.
fn code_of(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("/*") {
        out.push_str(&rest[..i]);
        rest = rest[i..].find("*/").map_or("", |j| &rest[i + j + 2..]);
    }
    out.push_str(rest);
    let mut code = String::with_capacity(out.len());
    let mut lines = out.lines().peekable();
    while let Some(line) = lines.next() {
        if line.trim() == "#[cfg(test)]"
            && lines
                .peek()
                .is_some_and(|next| next.trim_start().starts_with("mod "))
        {
            break;
        }
        code.push_str(line.split("//").next().unwrap_or(""));
        code.push('\n');
    }
    code
}

/// `a::{b, c::{d, self}}` → `a::b`, `a::c::d`, `a::c::self` (whitespace already removed).
fn expand_use(tree: &str) -> Vec<String> {
    let Some(open) = tree.find('{') else {
        return vec![tree.to_string()];
    };
    let (prefix, inner) = (&tree[..open], &tree[open + 1..tree.len() - 1]);
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0, 0);
    for (i, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&inner[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&inner[start..]);
    parts
        .into_iter()
        .filter(|p| !p.is_empty())
        .flat_map(expand_use)
        .map(|p| format!("{prefix}{p}"))
        .collect()
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Every `crate::`/`super::`/`self::` path in `code`: from `use` items and inline.
fn paths_in(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find("use ") {
        let at_start = rest[..i].chars().next_back().is_none_or(|c| !is_ident(c));
        let tail = &rest[i + 4..];
        let end = tail.find(';').unwrap_or(tail.len());
        if at_start {
            let tree: String = tail[..end].chars().filter(|c| !c.is_whitespace()).collect();
            out.extend(expand_use(&tree));
        }
        rest = &tail[end.min(tail.len())..];
    }
    for root in ["crate::", "super::", "self::"] {
        for (i, _) in code.match_indices(root) {
            // Part of a longer name or path (`my_crate::`, `super::super::`): counted once,
            // from where the path starts.
            if code[..i].chars().next_back().is_some_and(is_ident) || code[..i].ends_with("::") {
                continue;
            }
            let len = code[i..]
                .find(|c: char| !(is_ident(c) || c == ':'))
                .unwrap_or(code.len() - i);
            out.push(code[i..i + len].trim_end_matches(':').to_string());
        }
    }
    out
}

/// The files each file of `src` reaches (keys and values relative to `src`).
fn file_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).expect("a source directory") {
            let p = e.expect("a directory entry").path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                files.push(p.strip_prefix(src).unwrap().to_string_lossy().into_owned());
            }
        }
    }
    let mut graph = BTreeMap::new();
    for rel in files {
        let me = module_of(&rel);
        let code = code_of(&std::fs::read_to_string(src.join(&rel)).expect("a source file"));
        let mut to = BTreeSet::new();
        for path in paths_in(&code) {
            let mut segs = path.split("::").map(str::to_string).peekable();
            let mut base = match segs.peek().map(String::as_str) {
                Some("crate") => Vec::new(),
                Some("super" | "self") => me.clone(),
                _ => continue,
            };
            if segs.peek().map(String::as_str) == Some("crate") {
                segs.next();
            }
            while let Some(s) = segs.peek() {
                match s.as_str() {
                    "super" => drop(base.pop()),
                    "self" => {}
                    _ => break,
                }
                segs.next();
            }
            base.extend(segs.filter(|s| s != "*" && s != "self"));
            if let Some(target) = file_of(src, &base).filter(|t| *t != rel) {
                to.insert(target);
            }
        }
        graph.insert(rel, to);
    }
    graph
}

/// The circles of `graph`: each set of nodes that all reach one another (more than one),
/// written as its nodes and the edges between them.
fn circles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    let reach = |from: &String| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.clone()];
        while let Some(n) = todo.pop() {
            for m in graph.get(&n).into_iter().flatten() {
                if seen.insert(m.clone()) {
                    todo.push(m.clone());
                }
            }
        }
        seen
    };
    let reached: BTreeMap<&String, BTreeSet<String>> =
        graph.keys().map(|k| (k, reach(k))).collect();
    let mut done = BTreeSet::new();
    let mut out = Vec::new();
    for (a, ra) in &reached {
        if done.contains(*a) || !ra.contains(*a) {
            continue;
        }
        let ring: Vec<&String> = ra
            .iter()
            .filter(|b| reached.get(b).is_some_and(|rb| rb.contains(*a)))
            .collect();
        let edges: Vec<String> = ring
            .iter()
            .flat_map(|x| {
                graph[*x]
                    .iter()
                    .filter(|y| ring.contains(y))
                    .map(move |y| format!("{x} -> {y}"))
            })
            .collect();
        done.extend(ring.iter().map(|s| s.to_string()));
        out.push(edges.join(", "));
    }
    out
}

/// The graph of a crate's top-level modules (`api/stages.rs` belongs to `api`).
fn top_level(graph: &BTreeMap<String, BTreeSet<String>>) -> BTreeMap<String, BTreeSet<String>> {
    let top = |f: &str| module_of(f).first().cloned().unwrap_or_default();
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (a, bs) in graph {
        let ta = top(a);
        if ta.is_empty() {
            continue; // the crate root declares and re-exports every module
        }
        let entry = out.entry(ta.clone()).or_default();
        entry.extend(
            bs.iter()
                .map(|b| top(b))
                .filter(|tb| *tb != ta && !tb.is_empty()),
        );
    }
    out
}

fn src_of(krate: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(krate)
        .join("src")
}

#[test]
fn no_file_reaches_back_to_a_file_that_reaches_it() {
    let mut bad = Vec::new();
    for krate in CRATES {
        let graph = file_graph(&src_of(krate));
        assert!(!graph.is_empty(), "{krate}: no sources found");
        bad.extend(circles(&graph).into_iter().map(|c| format!("{krate}: {c}")));
        if !FILE_LEVEL_ONLY.contains(krate) {
            let modules = top_level(&graph);
            bad.extend(
                circles(&modules)
                    .into_iter()
                    .map(|c| format!("{krate} (modules): {c}")),
            );
        }
    }
    assert!(bad.is_empty(), "circles:\n{}", bad.join("\n"));
}

#[test]
fn the_wire_vocabulary_names_nothing_above_it() {
    let graph = file_graph(&src_of("gateway"));
    let mut bad = Vec::new();
    for (file, to) in graph.iter().filter(|(f, _)| f.starts_with("wire/")) {
        for t in to {
            let top = module_of(t).first().cloned().unwrap_or_default();
            if !WIRE_MAY_NAME.contains(&top.as_str()) {
                bad.push(format!("{file} -> {t}"));
            }
        }
    }
    assert!(bad.is_empty(), "the wire module reaches up: {bad:?}");
}

/// The tracked files the architecture document must name one by one: every crate's sources
/// and benches, the scripts, the benchmark scripts and the vLLM connector's modules (tests,
/// fuzz targets, migrations and the admin UI are named by their directories).
fn must_be_named(path: &str) -> bool {
    let in_crate = |dir: &str| path.ends_with(".rs") && path.split('/').any(|p| p == dir);
    let top = path.split('/').next().unwrap_or("");
    (!matches!(top, "fuzz" | "tests") && (in_crate("src") || in_crate("benches")))
        || path.starts_with("scripts/")
        || (top == "loadtests" && (path.ends_with(".sh") || path.ends_with(".py")))
        || path.starts_with("connectors/vllm/cachet_vllm/")
}

/// Whether `doc` names `path` as a whole word (not as the tail of a longer path).
fn names(doc: &str, path: &str) -> bool {
    doc.match_indices(path).any(|(i, _)| {
        let before = doc[..i].chars().next_back();
        let after = doc[i + path.len()..].chars().next();
        before.is_none_or(|c| c.is_whitespace() || "`(".contains(c))
            && after.is_none_or(|c| c.is_whitespace() || "`),:;.".contains(c))
    })
}

#[test]
fn the_architecture_document_names_every_source_file_and_only_real_ones() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = std::process::Command::new("git")
        .args(["ls-files", "-z"])
        .current_dir(root)
        .output()
        .expect("git runs");
    assert!(out.status.success(), "git ls-files failed");
    let tracked: Vec<String> = String::from_utf8(out.stdout)
        .unwrap()
        .split('\0')
        .filter(|p| !p.is_empty() && root.join(p).exists())
        .map(str::to_string)
        .collect();
    let doc = std::fs::read_to_string(root.join("docs/architecture.md")).unwrap();
    let unnamed: Vec<&String> = tracked
        .iter()
        .filter(|p| must_be_named(p) && !names(&doc, p))
        .collect();
    // The source tree block: each line starts with a path, which must exist.
    let block = doc
        .split("## Source tree")
        .nth(1)
        .and_then(|s| s.split("```").nth(1))
        .expect("a source tree block");
    let missing: Vec<&str> = block
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|p| p.contains('/') || p.ends_with(".toml"))
        .filter(|p| !root.join(p).exists())
        .collect();
    assert!(
        unnamed.is_empty() && missing.is_empty(),
        "docs/architecture.md does not name {unnamed:?}, and names files that do not exist: {missing:?}"
    );
}

#[test]
fn circles_are_caught_in_use_lines_and_inline_paths() {
    let dir = std::env::temp_dir().join(format!("cachet-circles-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("room")).unwrap();
    let write = |f: &str, text: &str| std::fs::write(dir.join(f), text).unwrap();
    write(
        "lib.rs",
        "pub mod a;\npub mod b;\npub mod c;\npub mod room;\n",
    );
    // a → b by a grouped use line, b → a by an inline path: one circle.
    write("a.rs", "use crate::{c::X, b::{self, Y}};\n");
    write(
        "b.rs",
        "fn f() { crate::a::g(); }\n// crate::c::h() in a comment is no edge\n",
    );
    // c reaches nothing; its test module may name anything.
    write(
        "c.rs",
        "pub struct X;\n#[cfg(test)]\nmod tests {\n    use crate::a;\n}\n",
    );
    // A child's `super::` is an edge; its parent's bare use of it is not.
    write("room/mod.rs", "mod inner;\nuse inner::Z;\n");
    write("room/inner.rs", "use super::super::c::X;\npub struct Z;\n");
    let graph = file_graph(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(circles(&graph), vec!["a.rs -> b.rs, b.rs -> a.rs"]);
    assert_eq!(
        graph["room/inner.rs"].iter().collect::<Vec<_>>(),
        vec!["c.rs"]
    );
    assert!(graph["c.rs"].is_empty(), "{graph:?}");
    assert_eq!(
        circles(&top_level(&graph)),
        vec!["a -> b, b -> a"],
        "{graph:?}"
    );
}

/// Each table's owner: the one crate whose code writes SQL on it. Another crate reaches it
/// through the owner's functions (`tests/layering.rs` keeps the crates' order; an owner sits
/// at or below every crate that needs the table, or hands a lower crate what it needs).
const OWNERS: &[(&str, &str)] = &[
    ("usage_events", "billing"),
    ("prices", "billing"),
    ("tenant_prices", "billing"),
    ("tenant_plans", "billing"),
    ("usage_rollups", "billing"),
    ("invoices", "billing"),
    ("invoice_lines", "billing"),
    ("adjustments", "billing"),
    ("billing_audit", "billing"),
    ("price_retirements", "billing"),
    ("cache_storage_events", "billing"),
    ("database_identity", "billing"),
    ("tenants", "control"),
    ("workspaces", "control"),
    ("api_keys", "control"),
    ("api_key_rotations", "control"),
    ("tenant_quotas", "control"),
    ("admin_users", "control"),
    ("admin_sessions", "control"),
    ("admin_password_resets", "control"),
    ("admin_audit", "control"),
    ("admission_refusals", "control"),
    ("cache_writes_not_held", "control"),
    ("budget_alerts", "control"),
    ("webhook_endpoints", "control"),
    ("webhook_deliveries", "control"),
    ("cache_objects", "control"),
    ("cache_object_releases", "control"),
];

/// The tables every migration creates.
fn migrated_tables(root: &Path) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for e in std::fs::read_dir(root.join("migrations")).unwrap() {
        let text = std::fs::read_to_string(e.unwrap().path()).unwrap();
        for (i, _) in text.match_indices("CREATE TABLE ") {
            let rest = text[i + 13..].trim_start_matches("IF NOT EXISTS ");
            let name: String = rest.chars().take_while(|c| is_ident(*c)).collect();
            out.insert(name);
        }
    }
    out
}

/// The tables of `known` a piece of code names after FROM, JOIN, INTO, UPDATE or TABLE.
fn tables_named(code: &str, known: &BTreeSet<String>) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for kw in ["FROM", "JOIN", "INTO", "UPDATE", "TABLE"] {
        for (i, _) in code.match_indices(kw) {
            if code[..i].chars().next_back().is_some_and(is_ident) {
                continue;
            }
            let rest = &code[i + kw.len()..];
            if !rest.starts_with(|c: char| c.is_whitespace()) {
                continue;
            }
            let name: String = rest
                .trim_start()
                .chars()
                .take_while(|c| is_ident(*c))
                .collect();
            if known.contains(&name) {
                out.insert(name);
            }
        }
    }
    out
}

#[test]
fn each_table_is_written_on_by_its_owner_only() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let tables = migrated_tables(root);
    let owner: BTreeMap<&str, &str> = OWNERS.iter().copied().collect();
    let unowned: Vec<&String> = tables
        .iter()
        .filter(|t| !owner.contains_key(t.as_str()))
        .collect();
    assert!(
        unowned.is_empty(),
        "tables with no owner in OWNERS: {unowned:?}"
    );
    let mut crossing = BTreeSet::new();
    for krate in CRATES {
        let src = src_of(krate);
        let name = if *krate == "." { "cachet" } else { krate };
        for file in file_graph(&src).keys() {
            let code = code_of(&std::fs::read_to_string(src.join(file)).unwrap());
            for t in tables_named(&code, &tables) {
                if owner[t.as_str()] != name {
                    crossing.insert((name.to_string(), t));
                }
            }
        }
    }
    assert!(
        crossing.is_empty(),
        "SQL on another crate's table (crate, table): {crossing:?}; call the owner's functions \
         instead, or hand the lower crate what it needs from above (billing::directory)"
    );
}

#[test]
fn tables_are_read_from_sql_keywords_only() {
    let known: BTreeSet<String> = ["tenants", "usage_events"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let code = r#"sqlx::query("SELECT t.name FROM tenants t JOIN usage_events u ON ...")
        let from_tenants = 1; // FROMtenants is no keyword
        INTO_tenants(); UPDATEusage_events"#;
    assert_eq!(
        tables_named(code, &known),
        known,
        "both tables after a keyword"
    );
    assert!(tables_named("let tenants = usage_events;", &known).is_empty());
}
