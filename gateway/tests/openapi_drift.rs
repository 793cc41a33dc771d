//! `openapi/openapi.json` is generated from the code; this fails on any difference.
//! Regenerate with `make openapi`.

#[test]
fn committed_openapi_matches_the_code() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../openapi/openapi.json");
    let committed = std::fs::read_to_string(path).unwrap_or_default();
    let generated = gateway::openapi::document();
    if committed != generated {
        if std::env::var_os("CACHET_UPDATE_OPENAPI").is_some() {
            std::fs::write(path, &generated).expect("write openapi.json");
            return;
        }
        panic!(
            "openapi/openapi.json is out of date with the code: run `make openapi` and commit the result"
        );
    }
}
