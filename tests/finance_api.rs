//! The finance API end to end on the real service and Postgres: a tenant admin's view, and
//! the content of the three export formats. Every endpoint × every role is in
//! tests/admin_api.rs, in one table with the admin API.

mod common;

use std::time::Duration;

use common::*;
use identity::{Jwt, Role};
use serde_json::{Value, json};
use uuid::Uuid;

struct Fixture {
    app: TestApp,
    tenant: Uuid,
    other: Uuid,
    invoice: Uuid,
    other_invoice: Uuid,
}

async fn fixture() -> Fixture {
    let app = TestApp::start().await;
    // Traffic from the app's tenant, then a second tenant.
    let body = cached_body(120, "hello", 4);
    for _ in 0..3 {
        let (s, _, r) = app.post("/v1/messages", &app.key, &body).await;
        assert_eq!(s, 200, "{r}");
    }
    let other_key = app.new_tenant_key().await;
    let (s, _, _) = app.post("/v1/messages", &other_key, &body).await;
    assert_eq!(s, 200);
    app.settle().await;
    let pool = sqlx::PgPool::connect(&app.db_url).await.unwrap();
    let tenants: Vec<Uuid> = sqlx::query_scalar(
        "SELECT tenant_id FROM usage_events GROUP BY tenant_id ORDER BY min(recorded_at)",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let (tenant, other) = (tenants[0], tenants[1]);
    let now = chrono::Utc::now();
    common::price_sim_tiny(&pool, 400, (3_000, 15_000)).await;
    let month = now.date_naive();
    billing::rollup::rollup(
        &pool,
        now - chrono::Duration::days(1),
        now + chrono::Duration::hours(1),
    )
    .await
    .unwrap();
    let invoice = billing::invoice::refresh_draft(&pool, tenant, month, "test")
        .await
        .unwrap()
        .id;
    let other_invoice = billing::invoice::refresh_draft(&pool, other, month, "test")
        .await
        .unwrap()
        .id;
    pool.close().await;
    Fixture {
        app,
        tenant,
        other,
        invoice,
        other_invoice,
    }
}

fn token(role: Role, tenant: Option<Uuid>) -> String {
    Jwt::new(ADMIN_SECRET.as_bytes())
        .unwrap()
        .issue("tester", role, tenant, Duration::from_secs(300))
        .unwrap()
}

async fn call(
    f: &Fixture,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<Value>,
) -> (u16, String) {
    let mut req = f
        .app
        .client
        .request(method.parse().unwrap(), format!("{}{path}", f.app.url));
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    if let Some(b) = body {
        req = req.json(&b);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.text().await.unwrap())
}

#[tokio::test]
async fn a_tenant_admin_sees_its_own_tenant_only_and_bad_input_is_a_400() {
    // Every endpoint × every role is in tests/admin_api.rs (one table with the admin API).
    let f = fixture().await;
    let now = chrono::Utc::now();
    let from = (now - chrono::Duration::days(1)).to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let to = (now + chrono::Duration::hours(1)).to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let q = |extra: &str| format!("from={from}&to={to}{extra}").replace('+', "%2B");
    let t = f.tenant;
    let finance = token(Role::Finance, None);
    let tenant_admin = token(Role::TenantAdmin, Some(t));
    // A tenant admin's view is its own tenant only: another tenant's invoice does not exist.
    let (s, _) = call(
        &f,
        "GET",
        &format!("/v1/billing/invoices/{}", f.invoice),
        Some(&tenant_admin),
        None,
    )
    .await;
    assert_eq!(s, 200);
    let (s, _) = call(
        &f,
        "GET",
        &format!("/v1/billing/invoices/{}", f.other_invoice),
        Some(&tenant_admin),
        None,
    )
    .await;
    assert_eq!(s, 404);
    let (_, text) = call(&f, "GET", "/v1/billing/invoices", Some(&tenant_admin), None).await;
    let list: Value = serde_json::from_str(&text).unwrap();
    assert!(
        list["data"]
            .as_array()
            .unwrap()
            .iter()
            .all(|i| i["tenant_id"] == json!(t))
    );
    let (_, text) = call(
        &f,
        "GET",
        &format!("/v1/billing/usage?{}", q("&group_by=tenant")),
        Some(&tenant_admin),
        None,
    )
    .await;
    let usage: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(usage["data"].as_array().unwrap().len(), 1);
    assert_eq!(usage["data"][0]["tenant"], json!(t));
    assert_eq!(usage["data"][0]["requests"], 3);
    // A tenant admin exports its own ledger rows, and only those (finance sees more).
    let export = |tok: String| {
        let path = format!("/v1/billing/exports/usage?{}", q("&format=jsonl"));
        let f = &f;
        async move { call(f, "GET", &path, Some(&tok), None).await }
    };
    let (s, own) = export(tenant_admin.clone()).await;
    assert_eq!(s, 200, "{own}");
    let own: Vec<Value> = own
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(own.len(), 3);
    assert!(own.iter().all(|r| r["tenant_id"] == json!(t)));
    let (_, all) = export(finance.clone()).await;
    assert!(
        all.lines().count() > own.len(),
        "finance's export holds every tenant"
    );
    // Bad input is a 400 in the API's shape.
    let (status, text) = call(
        &f,
        "GET",
        &format!("/v1/billing/usage?{}", q("&group_by=planet")),
        Some(&finance),
        None,
    )
    .await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("group_by"));
    // Every parse failure (query, path, JSON body) is a 4xx in the API's error shape, with
    // the request id; a body that is not JSON at all is a 415.
    let admin = token(Role::PlatformAdmin, None);
    for (method, path, body, want) in [
        (
            "GET",
            "/v1/billing/usage?from=yesterday&to=1".to_string(),
            None,
            400,
        ),
        (
            "GET",
            "/v1/billing/invoices?tenant=not-a-uuid".into(),
            None,
            400,
        ),
        ("GET", "/v1/billing/invoices/not-a-uuid".into(), None, 400),
        (
            "GET",
            "/v1/billing/exports/usage?format=csv".into(),
            None,
            400,
        ),
        (
            "POST",
            "/v1/billing/invoices".into(),
            Some(json!({"tenant": 5})),
            400,
        ),
        (
            "POST",
            "/v1/billing/prices".into(),
            Some(json!([1, 2])),
            400,
        ),
        ("POST", "/v1/billing/invoices".into(), None, 415),
    ] {
        let (status, text) = call(&f, method, &path, Some(&admin), body).await;
        assert_eq!(status, want, "{method} {path}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("{path}: {text}"));
        assert_eq!(v["type"], "error", "{path}: {text}");
        assert!(
            v["error"]["type"].is_string() && v["error"]["message"].is_string(),
            "{text}"
        );
        assert!(
            v["request_id"]
                .as_str()
                .is_some_and(|r| r.starts_with("req_")),
            "{text}"
        );
    }
    f.app.stop().await;
}

#[tokio::test]
async fn exports_stream_csv_jsonl_and_cloudevents() {
    let f = fixture().await;
    let now = chrono::Utc::now();
    let from = (now - chrono::Duration::days(1)).to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let to = (now + chrono::Duration::hours(1)).to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let finance = token(Role::Finance, None);
    let get = |format: &str| {
        let path = format!("/v1/billing/exports/usage?from={from}&to={to}&format={format}")
            .replace('+', "%2B");
        let finance = finance.clone();
        let f = &f;
        async move { call(f, "GET", &path, Some(&finance), None).await }
    };
    let (s, csv) = get("csv").await;
    assert_eq!(s, 200);
    let lines: Vec<&str> = csv.split("\r\n").filter(|l| !l.is_empty()).collect();
    assert_eq!(lines.len(), 1 + 4, "header + 4 rows: {csv}");
    assert!(lines[0].starts_with("request_id,tenant_id,"));
    assert!(
        lines[1..].iter().all(|l| l.split(',').count() == 19),
        "{csv}"
    );
    let (s, jsonl) = get("jsonl").await;
    assert_eq!(s, 200);
    let rows: Vec<Value> = jsonl
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 4);
    assert!(rows.iter().any(|r| r["tenant_id"] == json!(f.other)));
    let (s, ce) = get("cloudevents").await;
    assert_eq!(s, 200);
    for (line, row) in ce.lines().zip(&rows) {
        let ev: Value = serde_json::from_str(line).unwrap();
        assert_eq!(ev["specversion"], "1.0");
        assert_eq!(ev["type"], "dev.cachet.usage.v1");
        assert_eq!(ev["id"], row["request_id"], "id is the request id");
        assert_eq!(ev["subject"], row["tenant_id"], "subject is the tenant");
        assert!(ev["time"].as_str().unwrap().ends_with('Z'));
        assert_eq!(ev["data"], *row);
    }
    f.app.stop().await;
}

#[tokio::test]
async fn the_storage_ledger_exports_in_the_three_formats_and_a_tenant_admin_gets_its_own() {
    let f = fixture().await;
    let pool = sqlx::PgPool::connect(&f.app.db_url).await.unwrap();
    let now = chrono::Utc::now();
    let hour = chrono::DurationRound::duration_trunc(now, chrono::TimeDelta::hours(1)).unwrap();
    // One object per tenant, held from 10 minutes past the hour three hours ago.
    let created = hour - chrono::TimeDelta::minutes(170);
    let mut objects = Vec::new();
    for (tenant, tokens) in [(f.tenant, 1_000_i64), (f.other, 250)] {
        let (key, workspace): (Uuid, Uuid) = sqlx::query_as(
            "SELECT id, workspace_id FROM api_keys WHERE tenant_id = $1 ORDER BY created_at LIMIT 1",
        )
        .bind(tenant)
        .fetch_one(&pool)
        .await
        .unwrap();
        let id = control::caches::new_id().unwrap();
        control::caches::insert(
            &pool,
            control::caches::NewObject {
                id: &id,
                scope: cachet_common::Scope {
                    tenant: cachet_common::TenantId(tenant),
                    workspace: cachet_common::WorkspaceId(workspace),
                },
                key: cachet_common::ApiKeyId(key),
                model: "sim-tiny",
                content: &json!({"messages": []}),
                input_tokens: tokens,
                display_name: None,
                request_id: Uuid::now_v7(),
                created_at: created,
                expires_at: now + chrono::TimeDelta::hours(20),
                blocks: &[],
            },
        )
        .await
        .unwrap();
        objects.push(id);
    }
    control::caches::meter::meter(&pool, now).await.unwrap();
    pool.close().await;
    let from = (now - chrono::Duration::days(1)).to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let to = (now + chrono::Duration::hours(1)).to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let finance = token(Role::Finance, None);
    let get = |format: &str, who: &str, extra: &str| {
        let path =
            format!("/v1/billing/exports/storage?from={from}&to={to}&format={format}{extra}")
                .replace('+', "%2B");
        let who = who.to_string();
        let f = &f;
        async move { call(f, "GET", &path, Some(&who), None).await }
    };
    // Three hours each: 50 minutes, then two whole hours.
    let (s, csv) = get("csv", &finance, "").await;
    assert_eq!(s, 200, "{csv}");
    let lines: Vec<&str> = csv.split("\r\n").filter(|l| !l.is_empty()).collect();
    assert!(
        lines[0].starts_with("object_id,hour_start,tenant_id,"),
        "{csv}"
    );
    assert_eq!(lines.len(), 1 + 6, "{csv}");
    let seconds: Vec<&str> = lines[1..]
        .iter()
        .map(|l| l.split(',').nth(7).unwrap())
        .collect();
    assert_eq!(
        seconds,
        ["3000", "3000", "3600", "3600", "3600", "3600"],
        "{csv}"
    );
    assert!(
        lines[1..].iter().all(|l| l.split(',').count() == 15),
        "{csv}"
    );
    let (s, jsonl) = get("jsonl", &finance, "").await;
    assert_eq!(s, 200);
    let rows: Vec<Value> = jsonl
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 6);
    for r in &rows {
        let (t, s) = (
            r["tokens"].as_i64().unwrap(),
            r["seconds"].as_i64().unwrap(),
        );
        assert_eq!(r["token_seconds"].as_i64(), Some(t * s));
        assert_eq!(r["currency"], "USD");
        // $3/MTok × 1.0 per hour: a token-second costs 3000/3600 nano.
        let cost: f64 = r["cost_exact_nanos"].as_str().unwrap().parse().unwrap();
        assert!(
            (cost - (t * s) as f64 * 3_000.0 / 3_600.0).abs() < 1e-3,
            "{r}"
        );
    }
    let (s, ce) = get("cloudevents", &finance, "").await;
    assert_eq!(s, 200);
    for (line, row) in ce.lines().zip(&rows) {
        let ev: Value = serde_json::from_str(line).unwrap();
        assert_eq!(ev["type"], "dev.cachet.cache_storage.v1");
        assert_eq!(
            ev["id"],
            json!(format!(
                "{}/{}",
                row["object_id"].as_str().unwrap(),
                ev["time"].as_str().unwrap()
            ))
        );
        assert_eq!(ev["data"], *row);
    }
    // A tenant admin exports its own tenant's hours only.
    let own = token(Role::TenantAdmin, Some(f.tenant));
    let (s, jsonl) = get("jsonl", &own, "").await;
    assert_eq!(s, 200);
    let mine: Vec<Value> = jsonl
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(mine.len(), 3);
    assert!(mine.iter().all(|r| r["object_id"] == json!(objects[0])));
    let (s, _) = get("jsonl", &own, &format!("&tenant={}", f.other)).await;
    assert_eq!(s, 403);
    f.app.stop().await;
}
