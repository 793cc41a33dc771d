//! Cache objects (`/v1/caches`) on one `serve`: create, use by id on both wires, list, extend,
//! delete; scoping; the paid hold in the fabric; the ledger rows they make.

mod common;

use common::TestApp;
use serde_json::{Value, json};

fn words(prefix: &str, n: usize) -> String {
    (0..n).map(|i| format!("{prefix}{i} ")).collect()
}

/// (status, body) of a request to the API with `key`.
async fn call(
    app: &TestApp,
    method: reqwest::Method,
    path: &str,
    key: &str,
    body: Option<&Value>,
) -> (u16, Value) {
    let mut r = app
        .client
        .request(method, format!("{}{path}", app.url))
        .header("x-api-key", key)
        .header("anthropic-version", "2023-06-01");
    if let Some(b) = body {
        r = r.json(b);
    }
    let r = r.send().await.unwrap();
    let s = r.status().as_u16();
    let text = r.text().await.unwrap();
    (
        s,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

#[tokio::test]
async fn an_object_is_created_used_by_id_on_both_wires_listed_extended_and_deleted() {
    let app = TestApp::start().await;
    let key = app.key.clone();
    let pool = &app.running().pool;
    let tenant: uuid::Uuid = sqlx::query_scalar("SELECT tenant_id FROM api_keys LIMIT 1")
        .fetch_one(pool)
        .await
        .unwrap();
    let system = words("s", 200);
    let doc = words("d", 150);
    let create = json!({
        "model": "sim-tiny", "ttl": "2h", "display_name": "handbook",
        "system": system,
        "messages": [{"role": "user", "content": [{"type": "text", "text": doc,
            "cache_control": {"type": "ephemeral"}}]}],
    });
    let (s, obj) = call(
        &app,
        reqwest::Method::POST,
        "/v1/caches",
        &key,
        Some(&create),
    )
    .await;
    assert_eq!(s, 200, "{obj}");
    let id = obj["id"].as_str().unwrap().to_string();
    assert!(id.starts_with("cache_") && id.len() == 30, "{id}");
    assert_eq!(obj["type"], "cache_object");
    assert_eq!(obj["display_name"], "handbook");
    let tokens = obj["input_tokens"].as_u64().unwrap();
    assert!(tokens > 300, "{obj}");
    let created: chrono::DateTime<chrono::Utc> =
        obj["created_at"].as_str().unwrap().parse().unwrap();
    let expires: chrono::DateTime<chrono::Utc> =
        obj["expires_at"].as_str().unwrap().parse().unwrap();
    assert_eq!((expires - created).num_seconds(), 7200);

    // Use by id on the Messages wire, and the same content sent with a breakpoint.
    let by_id = json!({
        "model": "sim-tiny", "max_tokens": 8, "temperature": 0, "cached_content": id,
        "messages": [{"role": "user", "content": "what does it say?"}],
    });
    let (s, _, a) = app.post("/v1/messages", &key, &by_id).await;
    assert_eq!(s, 200, "{a}");
    assert_eq!(a["usage"]["cache_read_input_tokens"], tokens, "{a}");
    assert_eq!(a["usage"]["cache_creation_input_tokens"], 0, "{a}");
    assert_eq!(a["cachet"]["cached_content"]["id"], id.as_str());
    assert_eq!(a["cachet"]["cached_content"]["status"], "read");
    // Held in the fabric for the object's TTL (beyond the 1h class it is billed as); the
    // cache view lists prefixes that were read.
    let left = app.longest_ttl_left_ms(tenant);
    assert!(left > 7100 * 1000 && left <= 7200 * 1000, "{left} ms left");
    let sent = json!({
        "model": "sim-tiny", "max_tokens": 8, "temperature": 0, "system": system,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": doc, "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "what does it say?"}]}],
    });
    let (s, _, b) = app.post("/v1/messages", &key, &sent).await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["usage"]["cache_read_input_tokens"], tokens, "{b}");
    assert_eq!(
        a["content"], b["content"],
        "by id and by content answer alike"
    );
    assert_eq!(
        common::usage_total(&a["usage"]),
        common::usage_total(&b["usage"])
    );

    // Counted with the object's content, as the request renders it.
    let (s, _, counted) = app
        .post(
            "/v1/messages/count_tokens",
            &key,
            &json!({"model": "sim-tiny", "cached_content": id,
                    "messages": [{"role": "user", "content": "what does it say?"}]}),
        )
        .await;
    assert_eq!(s, 200, "{counted}");
    assert_eq!(
        counted["input_tokens"].as_u64().unwrap(),
        common::usage_total(&a["usage"])
    );

    // Streamed: the object's use is in `message_start`'s report.
    let mut streamed = by_id.clone();
    streamed["stream"] = json!(true);
    let text = app
        .post_raw("/v1/messages", &key, streamed.to_string())
        .await
        .text()
        .await
        .unwrap();
    let start: Value = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|d| serde_json::from_str::<Value>(d).unwrap())
        .find(|e| e["type"] == "message_start")
        .expect("a message_start event");
    assert_eq!(
        start["message"]["cachet"]["cached_content"]["id"],
        id.as_str(),
        "{text}"
    );
    assert_eq!(start["message"]["usage"]["cache_read_input_tokens"], tokens);

    // The OpenAI wire names it the same way.
    let chat = json!({
        "model": "sim-tiny", "max_completion_tokens": 8, "temperature": 0, "cached_content": id,
        "messages": [{"role": "user", "content": "what does it say?"}],
    });
    let (s, _, c) = app.post("/v1/chat/completions", &key, &chat).await;
    assert_eq!(s, 200, "{c}");
    assert_eq!(
        c["usage"]["prompt_tokens_details"]["cached_tokens"], tokens,
        "{c}"
    );
    assert_eq!(
        c["choices"][0]["message"]["content"],
        a["content"][0]["text"]
    );
    // A system prompt or tools beside it: 400 naming the field, on both wires.
    let mut with_system = chat.clone();
    with_system["messages"] =
        json!([{"role": "system", "content": "x"}, {"role": "user", "content": "q"}]);
    let (s, _, e) = app.post("/v1/chat/completions", &key, &with_system).await;
    assert_eq!(s, 400, "{e}");
    assert!(common::error_message(&e).starts_with("system:"), "{e}");
    let mut with_tools = by_id.clone();
    with_tools["tools"] = json!([{"name": "t", "input_schema": {"type": "object"}}]);
    let (s, _, e) = app.post("/v1/messages", &key, &with_tools).await;
    assert_eq!(s, 400, "{e}");
    assert!(common::error_message(&e).starts_with("tools:"), "{e}");
    let mut other_model = by_id.clone();
    other_model["model"] = json!("sim-llama-8b");
    let (s, _, e) = app.post("/v1/messages", &key, &other_model).await;
    assert_eq!(s, 400, "{e}");

    // Listed (paged newest first), read, extended within the tenant's maximum.
    let (s, second) = call(
        &app,
        reqwest::Method::POST,
        "/v1/caches",
        &key,
        Some(&json!({"model": "sim-tiny", "system": words("t", 300), "ttl": 600})),
    )
    .await;
    assert_eq!(s, 200, "{second}");
    let (s, page) = call(&app, reqwest::Method::GET, "/v1/caches?limit=1", &key, None).await;
    assert_eq!(s, 200, "{page}");
    assert_eq!(page["data"][0]["id"], second["id"]);
    assert_eq!(page["has_more"], true);
    let last = page["last_id"].as_str().unwrap();
    let (_, next) = call(
        &app,
        reqwest::Method::GET,
        &format!("/v1/caches?limit=1&after_id={last}"),
        &key,
        None,
    )
    .await;
    assert_eq!(next["data"][0]["id"], id.as_str(), "{next}");
    assert_eq!(next["has_more"], false);
    let (_, back) = call(
        &app,
        reqwest::Method::GET,
        &format!("/v1/caches?before_id={id}"),
        &key,
        None,
    )
    .await;
    assert_eq!(back["data"].as_array().unwrap().len(), 1, "{back}");
    assert_eq!(back["data"][0]["id"], second["id"]);
    let (s, e) = call(&app, reqwest::Method::GET, "/v1/caches?limit=0", &key, None).await;
    assert_eq!(s, 400, "{e}");
    let (s, got) = call(
        &app,
        reqwest::Method::GET,
        &format!("/v1/caches/{id}"),
        &key,
        None,
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(got["input_tokens"], tokens);
    let (s, ext) = call(
        &app,
        reqwest::Method::PATCH,
        &format!("/v1/caches/{id}"),
        &key,
        Some(&json!({"ttl": "20h"})),
    )
    .await;
    assert_eq!(s, 200, "{ext}");
    let new_exp: chrono::DateTime<chrono::Utc> =
        ext["expires_at"].as_str().unwrap().parse().unwrap();
    assert!(new_exp > expires + chrono::Duration::hours(17), "{ext}");
    let left = app.longest_ttl_left_ms(tenant);
    assert!(
        left > 19 * 3600 * 1000,
        "extended in the fabric too: {left} ms left"
    );
    let (s, e) = call(
        &app,
        reqwest::Method::PATCH,
        &format!("/v1/caches/{id}"),
        &key,
        Some(&json!({"ttl": "25h"})),
    )
    .await;
    assert_eq!(s, 400, "over the default 24h maximum: {e}");
    assert!(
        common::error_message(&e).contains("max_cache_ttl_secs"),
        "{e}"
    );
    let (s, e) = call(
        &app,
        reqwest::Method::PATCH,
        &format!("/v1/caches/{id}"),
        &key,
        Some(&json!({"model": "x"})),
    )
    .await;
    assert_eq!(s, 400, "{e}");

    // Another tenant neither sees nor uses it.
    let other = app.new_tenant_key().await;
    let (s, _) = call(
        &app,
        reqwest::Method::GET,
        &format!("/v1/caches/{id}"),
        &other,
        None,
    )
    .await;
    assert_eq!(s, 404);
    let (s, _, e) = app.post("/v1/messages", &other, &by_id).await;
    assert_eq!(s, 404, "{e}");
    assert_eq!(e["error"]["type"], "not_found_error");
    let (_, list) = call(&app, reqwest::Method::GET, "/v1/caches", &other, None).await;
    assert_eq!(list["data"], json!([]));
    let (s, _) = call(
        &app,
        reqwest::Method::DELETE,
        &format!("/v1/caches/{id}"),
        &other,
        None,
    )
    .await;
    assert_eq!(s, 404);

    // Deleted: gone from the API, a 404 to use, audited.
    let (s, d) = call(
        &app,
        reqwest::Method::DELETE,
        &format!("/v1/caches/{id}"),
        &key,
        None,
    )
    .await;
    assert_eq!(s, 200, "{d}");
    assert_eq!(d["id"], id.as_str());
    assert_eq!(d["type"], "cache_object_deleted");
    // Every byte of it accounted for on the one node there is (128 bytes of KV a token):
    // freed, or still held by the entries the requests above wrote (automatic caching
    // covered the object's blocks with the rest of their prompts).
    let (freed, held) = (
        d["bytes_freed"].as_u64().unwrap(),
        d["bytes_held"].as_u64().unwrap(),
    );
    assert_eq!(freed + held, tokens * 128, "{d}");
    assert!(freed > 0, "the object's own last partial block: {d}");
    assert_eq!(d["nodes_pending"], json!([]), "{d}");
    let (s, _) = call(
        &app,
        reqwest::Method::GET,
        &format!("/v1/caches/{id}"),
        &key,
        None,
    )
    .await;
    assert_eq!(s, 404);
    let (s, _, e) = app.post("/v1/messages", &key, &by_id).await;
    assert_eq!(s, 404, "{e}");
    assert!(e["error"]["message"].as_str().unwrap().contains(&id), "{e}");
    let (s, _) = call(
        &app,
        reqwest::Method::DELETE,
        &format!("/v1/caches/{id}"),
        &key,
        None,
    )
    .await;
    assert_eq!(s, 404, "deleting twice");
    let audited: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM admin_audit WHERE action = 'cache_object.delete' AND target = $1",
    )
    .bind(&id)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(audited, 1);

    let metrics = app.metrics().await;
    for op in ["created", "used", "extended", "deleted"] {
        assert!(
            metrics.contains(&format!(
                "cachet_gateway_cache_objects_total{{op=\"{op}\"}}"
            )),
            "{op}"
        );
    }

    // The creation is billed as a 1h write of the object's tokens; the uses as reads.
    app.settle().await;
    let (w1, reads): (i64, i64) = sqlx::query_as(
        "SELECT sum(cache_write_1h_tokens)::BIGINT, sum(cache_read_tokens)::BIGINT FROM usage_events",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert!(w1 >= tokens as i64, "{w1}");
    assert!(reads >= 3 * tokens as i64, "{reads}");
    app.stop().await;
}

#[tokio::test]
async fn creation_is_refused_with_errors_that_name_the_field() {
    let app = TestApp::start().await;
    let key = app.key.clone();
    let system = words("s", 200);
    for (body, field) in [
        (
            json!({"model": "sim-tiny", "system": system, "ttl": "4m"}),
            "ttl:",
        ),
        (
            json!({"model": "sim-tiny", "system": system, "ttl": "2d"}),
            "ttl:",
        ),
        (
            json!({"model": "sim-tiny", "system": system, "ttl": "soon"}),
            "ttl:",
        ),
        (
            json!({"model": "sim-tiny", "system": system, "expires_at": "2020-01-01T00:00:00Z"}),
            "expires_at:",
        ),
        (
            json!({"model": "sim-tiny", "system": system, "ttl": "1h", "expires_at": "2099-01-01T00:00:00Z"}),
            "ttl, expires_at:",
        ),
        (
            json!({"model": "sim-tiny", "system": "too short"}),
            "messages:",
        ),
        (json!({"model": "sim-tiny"}), "messages:"),
        (
            json!({"model": "no-such-model", "system": system}),
            "model:",
        ),
        (
            json!({"model": "sim-tiny", "system": system, "max_tokens": 3}),
            "max_tokens:",
        ),
        (
            json!({"model": "sim-tiny", "messages": [{"role": "assistant", "content": system}]}),
            "messages:",
        ),
    ] {
        let (s, e) = call(&app, reqwest::Method::POST, "/v1/caches", &key, Some(&body)).await;
        assert_eq!(s, 400, "{body}: {e}");
        let msg = e["error"]["message"].as_str().unwrap();
        assert!(msg.starts_with(field), "{body}: {msg}");
    }
    // Nothing was stored, and only the refused below-minimum content could have run.
    let (_, list) = call(&app, reqwest::Method::GET, "/v1/caches", &key, None).await;
    assert_eq!(list["data"], json!([]));
    // A tenant whose longest TTL is raised may hold an object longer.
    let pool = &app.running().pool;
    let tenant: uuid::Uuid = sqlx::query_scalar("SELECT tenant_id FROM api_keys LIMIT 1")
        .fetch_one(pool)
        .await
        .unwrap();
    use control::tenants::policy;
    policy::patch_policy(
        pool,
        &control::tenants::Actor::cli("test"),
        cachet_common::TenantId(tenant),
        &policy::PolicyPatch {
            max_cache_ttl_secs: Some(604_800),
            ..Default::default()
        },
        policy::PatchedBy::TenantAdmin,
    )
    .await
    .unwrap();
    let week = json!({"model": "sim-tiny", "tools": [{"name": "lookup", "description": system, "input_schema": {"type": "object"}}], "ttl": "7d"});
    // The change feed brings the new policy within a poll or two.
    let mut o = Value::Null;
    for _ in 0..100 {
        let (s, v) = call(&app, reqwest::Method::POST, "/v1/caches", &key, Some(&week)).await;
        o = v;
        if s == 200 {
            break;
        }
        assert_eq!(s, 400, "{o}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(o["type"], "cache_object", "{o}");
    let bad = policy::patch_policy(
        pool,
        &control::tenants::Actor::cli("test"),
        cachet_common::TenantId(tenant),
        &policy::PolicyPatch {
            max_cache_ttl_secs: Some(31 * 86_400),
            ..Default::default()
        },
        policy::PatchedBy::TenantAdmin,
    )
    .await;
    assert!(bad.is_err(), "at most 30 days");
    // A tool-only object is used by id with messages alone.
    let (s, _, r) = app
        .post(
            "/v1/messages",
            &key,
            &json!({"model": "sim-tiny", "max_tokens": 4, "cached_content": o["id"],
                    "messages": [{"role": "user", "content": "use the tool"}]}),
        )
        .await;
    assert_eq!(s, 200, "{r}");
    assert_eq!(
        r["usage"]["cache_read_input_tokens"], o["input_tokens"],
        "{r}"
    );
    // A malformed id is simply not found.
    let (s, _) = call(
        &app,
        reqwest::Method::GET,
        "/v1/caches/cache_nope",
        &key,
        None,
    )
    .await;
    assert_eq!(s, 404);
    app.stop().await;
}

/// A purge while the node was down: at its restart, what its disk tier kept of the tenant
/// goes before the tenant's prefixes can be read again.
#[tokio::test]
async fn a_purge_missed_while_down_is_applied_to_the_disk_tier_at_restart() {
    let app = TestApp::start_with(common::Options {
        // A small DRAM tier over a disk tier: the object's blocks are demoted to disk.
        tweak: |c| {
            c.fabric.dram_capacity_bytes = 256 << 10;
            c.fabric.disk_capacity_bytes = Some(64 << 20);
        },
        ..Default::default()
    })
    .await;
    let pool = app.running().pool.clone();
    let tenant: uuid::Uuid = sqlx::query_scalar("SELECT tenant_id FROM api_keys LIMIT 1")
        .fetch_one(&pool)
        .await
        .unwrap();
    let t = cachet_common::TenantId(tenant);
    // Two objects, each within DRAM, together past it: the older one's blocks go to disk.
    for prefix in ["k", "m", "n"] {
        let (s, obj) = call(
            &app,
            reqwest::Method::POST,
            "/v1/caches",
            &app.key,
            Some(&json!({"model": "sim-tiny", "system": words(prefix, 700), "ttl": "6h"})),
        )
        .await;
        assert_eq!(s, 200, "{obj}");
    }
    let on_disk = |node: &cache_fabric::FabricNode| {
        node.tenant_stats(t, 1)
            .tiers
            .iter()
            .filter(|x| x.tier == "disk")
            .map(|x| x.bytes)
            .sum::<u64>()
    };
    // Demotion runs beside the writes (the tier below is written off the store's lock).
    let mut demoted = 0;
    for _ in 0..50 {
        demoted = on_disk(&app.running().node);
        if demoted > 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let st = app.running().node.tenant_stats(t, 1);
    assert!(
        demoted > 0,
        "demoted to disk: {:?} {:?}",
        st.tiers
            .iter()
            .map(|x| (x.tier.clone(), x.bytes))
            .collect::<Vec<_>>(),
        st.evictions
    );

    // Down: the purge is written while nothing applies it.
    let mut app = app;
    app.shutdown.cancel();
    app.running.take().unwrap().wait().await.unwrap();
    let n = control::caches::purge(&pool, &control::tenants::Actor::cli("test"), t)
        .await
        .unwrap();
    assert_eq!(n, 3);

    // Up again on the same data directory: the disk tier reloads its segments, and the
    // missed purge drops them.
    let mut config = cachet::config::Config {
        database_url: app.db_url.clone(),
        redis_url: common::REDIS.into(),
        data_dir: app.data_dir.0.clone(),
        ..Default::default()
    };
    config.engine.kind = "sim".into();
    config.engine.sim_time_scale = 0.0;
    config.admin.change_poll_ms = 200;
    config.fabric.dram_capacity_bytes = 256 << 10;
    config.fabric.disk_capacity_bytes = Some(64 << 20);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let running = cachet::server::start(config, listener, shutdown.clone())
        .await
        .unwrap();
    let mut left = on_disk(&running.node);
    for _ in 0..50 {
        if left == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        left = on_disk(&running.node);
    }
    assert_eq!(left, 0, "the purged blocks came back from disk");
    shutdown.cancel();
    running.wait().await.unwrap();
    app.stop().await;
}

/// A deleted object's blocks that a request's own breakpoint also wrote stay, for that
/// entry's TTL: the deletion says how many bytes it freed and how many are still held, and
/// the request's prefix is still read from the cache.
#[tokio::test]
async fn deleting_an_object_keeps_what_another_entry_holds() {
    let app = TestApp::start().await;
    let key = app.key.clone();
    let system = words("h", 200);
    let (s, obj) = call(
        &app,
        reqwest::Method::POST,
        "/v1/caches",
        &key,
        Some(&json!({"model": "sim-tiny", "ttl": "1h", "system": system})),
    )
    .await;
    assert_eq!(s, 200, "{obj}");
    let id = obj["id"].as_str().unwrap().to_string();
    let tokens = obj["input_tokens"].as_u64().unwrap();
    // A request continues the object's content and writes its own 5m breakpoint further on:
    // the object's blocks are part of that entry too.
    let longer = json!({
        "model": "sim-tiny", "max_tokens": 1, "system": system,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": words("q", 80), "cache_control": {"type": "ephemeral"}}]}],
    });
    let (s, _, r) = app.post("/v1/messages", &key, &longer).await;
    assert_eq!(s, 200, "{r}");
    assert!(
        r["usage"]["cache_read_input_tokens"].as_u64().unwrap() > 0,
        "{r}"
    );
    assert!(
        r["usage"]["cache_creation_input_tokens"].as_u64().unwrap() > 0,
        "{r}"
    );

    let (s, d) = call(
        &app,
        reqwest::Method::DELETE,
        &format!("/v1/caches/{id}"),
        &key,
        None,
    )
    .await;
    assert_eq!(s, 200, "{d}");
    let held = d["bytes_held"].as_u64().unwrap();
    let freed = d["bytes_freed"].as_u64().unwrap();
    // sim-tiny: 128 bytes of KV a token; only a partial last block (the object's own tail)
    // can be freed.
    assert_eq!(held + freed, tokens * 128, "{d}");
    assert!(held >= (tokens / 16) * 16 * 128, "{d}");
    let (s, _, r) = app.post("/v1/messages", &key, &longer).await;
    assert_eq!(s, 200, "{r}");
    assert!(
        r["usage"]["cache_read_input_tokens"].as_u64().unwrap() >= (tokens / 16) * 16,
        "the request's own entry still reads: {r}"
    );
    app.stop().await;
}

/// Stop `app`'s server and start it again on the same database and data directory (its disk
/// tier reloaded), `tweak` applied to the config as at the first start.
async fn restart(app: &mut TestApp, tweak: fn(&mut cachet::config::Config)) {
    app.shutdown.cancel();
    app.running.take().unwrap().wait().await.unwrap();
    let mut config = cachet::config::Config {
        database_url: app.db_url.clone(),
        redis_url: common::REDIS.into(),
        data_dir: app.data_dir.0.clone(),
        ..Default::default()
    };
    config.engine.kind = "sim".into();
    config.engine.sim_time_scale = 0.0;
    config.admin.change_poll_ms = 200;
    tweak(&mut config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let running = cachet::server::start(config, listener, shutdown.clone())
        .await
        .unwrap();
    app.url = format!("http://{}", running.addr);
    app.running = Some(running);
    app.shutdown = shutdown;
}

/// Issue 27: "the 24h retention survives a node restart on the disk tier". A cache object and
/// a Chat Completions prefix kept with `prompt_cache_retention: "24h"` are written through to
/// the disk tier as they are written (DRAM here is large: nothing is evicted), so after a
/// restart, whose DRAM starts empty, both are read from the cache, not computed again.
#[tokio::test]
async fn long_retention_survives_a_restart_on_the_disk_tier() {
    fn disk(c: &mut cachet::config::Config) {
        c.fabric.disk_capacity_bytes = Some(64 << 20);
    }
    let mut app = TestApp::start_with(common::Options {
        tweak: disk,
        ..Default::default()
    })
    .await;
    let key = app.key.clone();
    let (s, obj) = call(
        &app,
        reqwest::Method::POST,
        "/v1/caches",
        &key,
        Some(&json!({"model": "sim-tiny", "system": words("r", 300), "ttl": "24h"})),
    )
    .await;
    assert_eq!(s, 200, "{obj}");
    let tokens = obj["input_tokens"].as_u64().unwrap();
    let chat = json!({
        "model": "sim-tiny", "max_tokens": 1, "prompt_cache_retention": "24h",
        "messages": [{"role": "system", "content": words("c", 300)},
                     {"role": "user", "content": "hello"}],
    });
    let (s, _, r) = app.post("/v1/chat/completions", &key, &chat).await;
    assert_eq!(s, 200, "{r}");
    assert_eq!(
        r["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
        "{r}"
    );
    // The node's writer copies them within moments.
    let mut backlog = usize::MAX;
    for _ in 0..100 {
        backlog = app
            .running()
            .node
            .with_store(|st| st.write_through_backlog());
        if backlog == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(backlog, 0);

    restart(&mut app, disk).await;
    assert_eq!(
        app.running().node.with_store(|st| st.len()),
        0,
        "DRAM starts empty"
    );
    let by_id = json!({"model": "sim-tiny", "max_tokens": 1, "cached_content": obj["id"],
        "messages": [{"role": "user", "content": "and now?"}]});
    let (s, _, a) = app.post("/v1/messages", &key, &by_id).await;
    assert_eq!(s, 200, "{a}");
    assert_eq!(a["usage"]["cache_read_input_tokens"], tokens, "{a}");
    assert_eq!(a["cachet"]["cached_content"]["status"], "read", "{a}");
    let (s, _, r) = app.post("/v1/chat/completions", &key, &chat).await;
    assert_eq!(s, 200, "{r}");
    assert!(common::cached_tokens(&r) > 0, "{r}");
    app.stop().await;
}
