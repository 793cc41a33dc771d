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

/// What a generated client relies on, beyond the schema's own validity (`make api-fuzz`
/// runs an OpenAPI validator over the document and calls every operation as it says):
/// operation ids are unique; every path parameter is in its path's template and every
/// template name is a path parameter; every response has a description; every successful answer with a body says
/// its content types.
#[test]
fn parameters_are_where_they_are_sent_and_answers_say_their_content() {
    let doc: serde_json::Value = serde_json::from_str(&gateway::openapi::document()).unwrap();
    let mut wrong = Vec::new();
    let mut ids = std::collections::HashSet::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        let template: Vec<&str> = path
            .split('/')
            .filter_map(|seg| seg.strip_prefix('{')?.strip_suffix('}'))
            .collect();
        for (method, op) in item.as_object().unwrap() {
            // A generated client names its methods by operation id.
            if !ids.insert(op["operationId"].as_str().unwrap_or_default().to_string()) {
                wrong.push(format!("{method} {path}: operation id used twice"));
            }
            let params = op["parameters"].as_array().cloned().unwrap_or_default();
            let in_path: Vec<&str> = params
                .iter()
                .filter(|p| p["in"] == "path")
                .filter_map(|p| p["name"].as_str())
                .collect();
            for p in &in_path {
                if !template.contains(p) {
                    wrong.push(format!("{method} {path}: `{p}` declared in path"));
                }
            }
            for t in &template {
                if !in_path.contains(t) {
                    wrong.push(format!("{method} {path}: `{t}` not declared"));
                }
            }
            for (code, r) in op["responses"].as_object().unwrap() {
                if r["description"].as_str().is_none_or(str::is_empty) {
                    wrong.push(format!("{method} {path} {code}: no description"));
                }
                // 201 and 204 answer without a body here; every other success has one.
                if code.starts_with('2') && code != "201" && code != "204" && r["content"].is_null()
                {
                    wrong.push(format!("{method} {path} {code}: no content type"));
                }
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
