//! The admin API (and the finance API beside it) on the real service, Postgres and Redis.
//!
//! - One table: every admin and billing endpoint × every role (logged in through
//!   `/v1/admin/login`), allowed and refused, plus no token, a forged token and an expired one.
//! - Logins: backoff, lockout, unlock, refresh (the old refresh token stops working), logout.
//! - Changes reach running gateways within seconds: suspension, resumption, deletion (keys
//!   revoked, cache purged, ledger kept), revocation.
//! - Rotation: the same idempotency key gives the same new key and secret; the old secret
//!   works until its grace period ends.
//! - Policy: a 1h TTL refused when the tenant does not allow it; the monthly budget refuses
//!   requests once spent (and raises its alert), with the refusals counted.
//! - Views: usage totals equal the ledger's; the cache view shows the tenant's bytes and reads.
//! - Workspaces: two workspaces of one tenant never read each other's cache; limits apply per
//!   workspace; usage and exports split by workspace; archiving revokes a workspace's keys.
//! - Budget alerts: a webhook receiver gets exactly one signed alert per crossed threshold,
//!   including one that failed first and was retried; a lowered budget alerts at once.

mod common;

use std::time::{Duration, Instant};

use common::*;
use identity::{Jwt, Role};
use serde_json::{Value, json};
use uuid::Uuid;

struct Admin {
    app: TestApp,
    pool: sqlx::PgPool,
    /// The app's tenant (its key is `app.key`).
    tenant: Uuid,
}

async fn setup() -> Admin {
    let app = TestApp::start().await;
    let pool = sqlx::PgPool::connect(&app.db_url).await.unwrap();
    let tenant: Uuid = sqlx::query_scalar("SELECT tenant_id FROM api_keys LIMIT 1")
        .fetch_one(&pool)
        .await
        .unwrap();
    Admin { app, pool, tenant }
}

impl Admin {
    /// An admin user's id, by username.
    async fn user_id(&self, name: &str) -> Uuid {
        sqlx::query_scalar("SELECT id FROM admin_users WHERE username = $1")
            .bind(name)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    async fn user(&self, name: &str, role: Role, tenant: Option<Uuid>) -> String {
        let password = format!("{name}-password-long-enough");
        control::admin::login::create_user(
            &self.pool,
            &control::tenants::Actor::cli("test"),
            control::admin::login::NewUser {
                username: name.into(),
                password: password.clone(),
                role,
                tenant,
            },
        )
        .await
        .unwrap();
        password
    }

    async fn login(&self, name: &str, password: &str) -> (u16, Value) {
        self.call(
            "POST",
            "/v1/admin/login",
            None,
            Some(json!({"username": name, "password": password})),
        )
        .await
    }

    async fn token(&self, name: &str, password: &str) -> String {
        let (s, v) = self.login(name, password).await;
        assert_eq!(s, 200, "{v}");
        v["access_token"].as_str().unwrap().to_string()
    }

    async fn call(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<Value>,
    ) -> (u16, Value) {
        self.call_with(method, path, token, body, &[]).await
    }

    async fn call_with(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<Value>,
        headers: &[(&str, &str)],
    ) -> (u16, Value) {
        let mut req = self
            .app
            .client
            .request(method.parse().unwrap(), format!("{}{path}", self.app.url));
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        if let Some(b) = body {
            req = req.json(&b);
        }
        let r = req.send().await.unwrap();
        let status = r.status().as_u16();
        let text = r.text().await.unwrap();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    /// A `/v1/messages` call with `key`; its status.
    async fn message(&self, key: &str) -> (u16, Value) {
        let (s, _, v) = self
            .app
            .post("/v1/messages", key, &cached_body(120, "hello", 4))
            .await;
        (s, v)
    }

    async fn new_key(&self, tenant: Uuid, token: &str, name: &str) -> (Uuid, String) {
        let (s, v) = self
            .call(
                "POST",
                &format!("/v1/admin/tenants/{tenant}/keys"),
                Some(token),
                Some(json!({"name": name})),
            )
            .await;
        assert_eq!(s, 201, "{v}");
        (
            v["id"].as_str().unwrap().parse().unwrap(),
            v["secret"].as_str().unwrap().to_string(),
        )
    }

    async fn stop(self) {
        self.pool.close().await;
        self.app.stop().await;
    }
}

/// `from=…&to=…` for a query: from `back` ago to an hour from now (RFC 3339, URL-safe).
fn query_range(back: chrono::Duration) -> String {
    let now = chrono::Utc::now();
    let t = |t: chrono::DateTime<chrono::Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    format!(
        "from={}&to={}",
        t(now - back),
        t(now + chrono::Duration::hours(1))
    )
    .replace('+', "%2B")
}

/// Poll until `f` is true, at most `within`.
async fn within<F, Fut>(what: &str, within: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    loop {
        if f().await {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn every_admin_and_billing_endpoint_answers_every_role_as_documented() {
    let a = setup().await;
    let t = a.tenant;
    // Traffic, a price and a draft invoice for the billing rows.
    for _ in 0..2 {
        assert_eq!(a.message(&a.app.key).await.0, 200);
    }
    a.app.settle().await;
    let now = chrono::Utc::now();
    common::price_sim_tiny(&a.pool, 400, (3_000, 15_000)).await;
    let invoice = billing::invoice::refresh_draft(&a.pool, t, now.date_naive(), "test")
        .await
        .unwrap()
        .id;

    let root_pw = a.user("root", Role::PlatformAdmin, None).await;
    let fin_pw = a.user("fin", Role::Finance, None).await;
    let ta_pw = a.user("ta", Role::TenantAdmin, Some(t)).await;
    let root = a.token("root", &root_pw).await;
    let fin = a.token("fin", &fin_pw).await;
    let ta = a.token("ta", &ta_pw).await;
    let tokens = [&root, &fin, &ta];

    // Another tenant, a tenant to suspend and delete, keys to act on, users to disable.
    let (_, o) = a
        .call(
            "POST",
            "/v1/admin/tenants",
            Some(&root),
            Some(json!({"name": "other"})),
        )
        .await;
    let o: Uuid = o["id"].as_str().unwrap().parse().unwrap();
    let (_, z) = a
        .call(
            "POST",
            "/v1/admin/tenants",
            Some(&root),
            Some(json!({"name": "doomed"})),
        )
        .await;
    let z: Uuid = z["id"].as_str().unwrap().parse().unwrap();
    let mut keys = Vec::new();
    for i in 0..6 {
        keys.push(a.new_key(t, &root, &format!("k{i}")).await.0);
    }
    // A workspace and a webhook endpoint of each tenant to read, change and disable.
    let made = |tenant: Uuid, what: &'static str, body: Value| {
        let (a, root) = (&a, root.clone());
        async move {
            let (s, v) = a
                .call(
                    "POST",
                    &format!("/v1/admin/tenants/{tenant}/{what}"),
                    Some(&root),
                    Some(body),
                )
                .await;
            assert_eq!(s, 201, "{v}");
            v["id"].as_str().unwrap().parse::<Uuid>().unwrap()
        }
    };
    let ws_t = made(t, "workspaces", json!({"name": "table"})).await;
    let ws_o = made(o, "workspaces", json!({"name": "table"})).await;
    let hook_t = made(t, "webhooks", json!({"url": "http://127.0.0.1:9/t"})).await;
    let hook_o = made(o, "webhooks", json!({"url": "http://127.0.0.1:9/o"})).await;
    let victim = control::admin::login::create_user(
        &a.pool,
        &control::tenants::Actor::cli("test"),
        control::admin::login::NewUser {
            username: "victim".into(),
            password: "victim-password-long".into(),
            role: Role::Finance,
            tenant: None,
        },
    )
    .await
    .unwrap()
    .id;

    let from = (now - chrono::Duration::days(1)).to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let to = (now + chrono::Duration::hours(1)).to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let range = format!("from={from}&to={to}").replace('+', "%2B");
    let month = now.format("%Y-%m").to_string();

    // (method, path, body, [platform_admin, finance, tenant_admin of t]); `{role}` in a path
    // is 0, 1, 2 for the caller (each acts on its own object where an action is one-shot).
    let k = |i: usize| keys[i];
    let rows: Vec<(&str, String, Option<Value>, [u16; 3])> = vec![
        ("GET", "/v1/admin/me".into(), None, [200, 200, 200]),
        ("GET", "/v1/admin/users".into(), None, [200, 403, 403]),
        (
            "POST",
            "/v1/admin/users".into(),
            Some(
                json!({"username": "new-{role}", "password": "a-long-new-password", "role": "finance"}),
            ),
            [201, 403, 403],
        ),
        (
            "POST",
            format!("/v1/admin/users/{victim}/unlock"),
            None,
            [200, 403, 403],
        ),
        (
            "POST",
            format!("/v1/admin/users/{victim}/password-reset"),
            None,
            [201, 403, 403],
        ),
        (
            "POST",
            "/v1/admin/me/password".into(),
            Some(json!({"current_password": "not it", "new_password": "a-long-new-password"})),
            [400, 400, 400],
        ),
        (
            "DELETE",
            format!("/v1/admin/users/{victim}"),
            None,
            [200, 403, 403],
        ),
        ("GET", "/v1/admin/tenants".into(), None, [200, 200, 200]),
        (
            "POST",
            "/v1/admin/tenants".into(),
            Some(json!({"name": "made-by-{role}"})),
            [201, 403, 403],
        ),
        (
            "GET",
            format!("/v1/admin/tenants/{t}"),
            None,
            [200, 200, 200],
        ),
        (
            "GET",
            format!("/v1/admin/tenants/{o}"),
            None,
            [200, 200, 404],
        ),
        (
            "POST",
            format!("/v1/admin/tenants/{z}/suspend"),
            None,
            [200, 403, 404],
        ),
        (
            "POST",
            format!("/v1/admin/tenants/{t}/suspend"),
            None,
            [200, 403, 403],
        ),
        (
            "POST",
            format!("/v1/admin/tenants/{t}/resume"),
            None,
            [200, 403, 403],
        ),
        (
            "POST",
            format!("/v1/admin/tenants/{z}/resume"),
            None,
            [200, 403, 404],
        ),
        (
            "DELETE",
            format!("/v1/admin/tenants/{z}"),
            None,
            [200, 403, 404],
        ),
        (
            "GET",
            format!("/v1/admin/tenants/{t}/keys"),
            None,
            [200, 200, 200],
        ),
        (
            "GET",
            format!("/v1/admin/tenants/{o}/keys"),
            None,
            [200, 200, 404],
        ),
        (
            "POST",
            format!("/v1/admin/tenants/{t}/keys"),
            Some(json!({"name": "x"})),
            [201, 403, 201],
        ),
        (
            "POST",
            format!("/v1/admin/tenants/{o}/keys"),
            Some(json!({"name": "x"})),
            [201, 403, 404],
        ),
        (
            "PATCH",
            format!("/v1/admin/tenants/{t}/keys/{}", k(0)),
            Some(json!({"expires_at": "2099-01-01T00:00:00Z"})),
            [200, 403, 200],
        ),
        (
            "POST",
            format!("/v1/admin/tenants/{t}/keys/KEY{{role}}/rotate"),
            Some(json!({"grace_seconds": 60})),
            [200, 403, 200],
        ),
        (
            "POST",
            format!("/v1/admin/tenants/{t}/keys/KEY{{role+3}}/revoke"),
            None,
            [200, 403, 200],
        ),
        (
            "POST",
            format!("/v1/admin/tenants/{o}/keys/{}/revoke", k(5)),
            None,
            [404, 403, 404],
        ),
        (
            "GET",
            format!("/v1/admin/tenants/{t}/policy"),
            None,
            [200, 200, 200],
        ),
        (
            "GET",
            format!("/v1/admin/tenants/{o}/policy"),
            None,
            [200, 200, 404],
        ),
        (
            "PATCH",
            format!("/v1/admin/tenants/{t}/policy"),
            Some(json!({"requests_per_minute": 100000})),
            [200, 403, 200],
        ),
        (
            "PATCH",
            format!("/v1/admin/tenants/{t}/policy"),
            Some(json!({"cache_resident_bytes": 1000000000})),
            [200, 403, 403],
        ),
        (
            "PATCH",
            format!("/v1/admin/tenants/{o}/policy"),
            Some(json!({"requests_per_minute": 100000})),
            [200, 403, 404],
        ),
        (
            "GET",
            format!("/v1/admin/tenants/{t}/usage?{range}"),
            None,
            [200, 200, 200],
        ),
        (
            "GET",
            format!("/v1/admin/tenants/{o}/usage?{range}"),
            None,
            [200, 200, 404],
        ),
        (
            "GET",
            format!("/v1/admin/tenants/{t}/budget"),
            None,
            [200, 200, 200],
        ),
        (
            "GET",
            format!("/v1/admin/tenants/{o}/budget"),
            None,
            [200, 200, 404],
        ),
        (
            "GET",
            format!("/v1/admin/tenants/{t}/cache"),
            None,
            [200, 200, 200],
        ),
        (
            "GET",
            format!("/v1/admin/tenants/{o}/cache"),
            None,
            [200, 200, 404],
        ),
        (
            "GET",
            format!("/v1/admin/tenants/{t}/cache/objects"),
            None,
            [200, 200, 200],
        ),
        (
            "GET",
            format!("/v1/admin/tenants/{o}/cache/objects"),
            None,
            [200, 200, 404],
        ),
        (
            "DELETE",
            format!("/v1/admin/tenants/{t}/cache/objects/cache_000000000000000000000000"),
            None,
            [404, 403, 404],
        ),
        (
            "PATCH",
            format!("/v1/admin/tenants/{t}/cache/objects/cache_000000000000000000000000"),
            Some(json!({"ttl": "2h"})),
            [404, 403, 404],
        ),
        (
            "POST",
            format!("/v1/admin/tenants/{t}/cache/purge"),
            None,
            [200, 403, 200],
        ),
        (
            "POST",
            format!("/v1/admin/tenants/{o}/cache/purge"),
            None,
            [200, 403, 404],
        ),
        ("GET", "/v1/admin/audit".into(), None, [200, 403, 200]),
        (
            "GET",
            format!("/v1/admin/audit?tenant={o}"),
            None,
            [200, 403, 404],
        ),
        (
            "GET",
            "/v1/admin/audit/export?format=csv".into(),
            None,
            [200, 403, 200],
        ),
        // The finance API.
        (
            "GET",
            format!("/v1/billing/usage?{range}"),
            None,
            [200, 200, 200],
        ),
        (
            "GET",
            format!("/v1/billing/usage?{range}&tenant={o}"),
            None,
            [200, 200, 403],
        ),
        ("GET", "/v1/billing/invoices".into(), None, [200, 200, 200]),
        (
            "GET",
            format!("/v1/billing/invoices?tenant={o}"),
            None,
            [200, 200, 403],
        ),
        (
            "GET",
            format!("/v1/billing/invoices/{invoice}"),
            None,
            [200, 200, 200],
        ),
        (
            "POST",
            "/v1/billing/invoices".into(),
            Some(json!({"tenant": t, "month": month})),
            [200, 200, 403],
        ),
        ("GET", "/v1/billing/prices".into(), None, [200, 200, 403]),
        (
            "GET",
            format!("/v1/admin/overview?month={month}"),
            None,
            [200, 200, 403],
        ),
        (
            "GET",
            format!("/v1/admin/overview?month={month}&format=csv"),
            None,
            [200, 200, 403],
        ),
        (
            "POST",
            "/v1/billing/prices".into(),
            Some(
                json!({"model": "sim-llama-8b", "effective_from": "2099-01-0{role+1}T00:00:00Z", "input_nanos": 1, "output_nanos": 2}),
            ),
            [201, 403, 403],
        ),
        (
            "POST",
            "/v1/billing/prices/retire".into(),
            Some(json!({"model": "sim-llama-8b", "effective_from": "2099-01-01T00:00:00Z"})),
            [204, 403, 403],
        ),
        (
            "GET",
            format!("/v1/admin/tenants/{t}/workspaces"),
            None,
            [200, 200, 200],
        ),
        (
            "GET",
            format!("/v1/admin/tenants/{o}/workspaces"),
            None,
            [200, 200, 404],
        ),
        (
            "POST",
            format!("/v1/admin/tenants/{t}/workspaces"),
            Some(json!({"name": "ws{role}"})),
            [201, 403, 201],
        ),
        (
            "POST",
            format!("/v1/admin/tenants/{o}/workspaces"),
            Some(json!({"name": "ws{role}"})),
            [201, 403, 404],
        ),
        (
            "GET",
            format!("/v1/admin/tenants/{t}/webhooks"),
            None,
            [200, 200, 200],
        ),
        (
            "GET",
            format!("/v1/admin/tenants/{t}/workspaces/{ws_t}"),
            None,
            [200, 200, 200],
        ),
        (
            "GET",
            format!("/v1/admin/tenants/{o}/workspaces/{ws_o}"),
            None,
            [200, 200, 404],
        ),
        (
            "PATCH",
            format!("/v1/admin/tenants/{t}/workspaces/{ws_t}"),
            Some(json!({"requests_per_minute": 5})),
            [200, 403, 200],
        ),
        (
            "PATCH",
            format!("/v1/admin/tenants/{o}/workspaces/{ws_o}"),
            Some(json!({"requests_per_minute": 5})),
            [200, 403, 404],
        ),
        (
            "POST",
            format!("/v1/admin/tenants/{t}/webhooks/{hook_t}/disable"),
            None,
            [200, 403, 200],
        ),
        (
            "POST",
            format!("/v1/admin/tenants/{o}/webhooks/{hook_o}/disable"),
            None,
            [200, 403, 404],
        ),
        (
            "POST",
            format!("/v1/admin/tenants/{o}/workspaces/{ws_o}/archive"),
            None,
            [200, 403, 404],
        ),
        (
            "GET",
            format!("/v1/admin/tenants/{o}/webhooks/deliveries"),
            None,
            [200, 200, 404],
        ),
        (
            "POST",
            format!("/v1/admin/tenants/{t}/webhooks"),
            Some(json!({"url": "http://127.0.0.1:9/hook"})),
            [201, 403, 201],
        ),
        (
            "GET",
            format!("/v1/billing/exports/usage?{range}&format=csv"),
            None,
            [200, 200, 200],
        ),
        (
            "GET",
            format!("/v1/billing/exports/usage?{range}&format=csv&tenant={o}"),
            None,
            [200, 200, 403],
        ),
        (
            "GET",
            format!("/v1/billing/exports/storage?{range}&format=csv"),
            None,
            [200, 200, 200],
        ),
        (
            "GET",
            format!("/v1/billing/exports/storage?{range}&format=jsonl&tenant={o}"),
            None,
            [200, 200, 403],
        ),
        (
            "GET",
            format!("/v1/billing/exports/focus?{range}"),
            None,
            [200, 200, 200],
        ),
        (
            "GET",
            format!("/v1/billing/exports/focus?{range}&tenant={o}"),
            None,
            [200, 200, 403],
        ),
    ];
    let forged = Jwt::new(&[9u8; 40])
        .unwrap()
        .issue("x", Role::PlatformAdmin, None, Duration::from_secs(300))
        .unwrap();
    let expired = Jwt::new(ADMIN_SECRET.as_bytes())
        .unwrap()
        .issue("x", Role::PlatformAdmin, None, Duration::ZERO)
        .unwrap();
    // Tokens a forger would try: no signature at all (`alg: none`), the right secret under
    // another algorithm, and a valid signature on a token not valid for an hour yet.
    let claims = |nbf: i64| {
        let now = chrono::Utc::now().timestamp();
        json!({"sub": "x", "role": "platform_admin", "exp": now + 3600, "nbf": now + nbf})
    };
    let b64 = |v: &serde_json::Value| base64url(v.to_string().as_bytes());
    let alg_none = format!(
        "{}.{}.",
        b64(&json!({"alg": "none", "typ": "JWT"})),
        b64(&claims(0))
    );
    let key = jsonwebtoken::EncodingKey::from_secret(ADMIN_SECRET.as_bytes());
    let other_alg = jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS512),
        &claims(0),
        &key,
    )
    .unwrap();
    let not_yet =
        jsonwebtoken::encode(&jsonwebtoken::Header::default(), &claims(3600), &key).unwrap();
    tokio::time::sleep(Duration::from_secs(6)).await; // past the 5 s leeway
    let fill = |s: &str, role: usize| {
        s.replace("KEY{role+3}", &k(role + 3).to_string())
            .replace("KEY{role}", &k(role).to_string())
            .replace("{role+1}", &(role + 1).to_string())
            .replace("{role}", &role.to_string())
    };
    for (method, path, body, expected) in &rows {
        for (role, (tok, want)) in tokens.iter().zip(expected).enumerate() {
            let path = fill(path, role);
            let body = body
                .as_ref()
                .map(|b| serde_json::from_str(&fill(&b.to_string(), role)).unwrap());
            let (status, v) = a.call(method, &path, Some(tok), body).await;
            assert_eq!(
                status,
                *want,
                "{} {method} {path}: {v}",
                ["platform_admin", "finance", "tenant_admin"][role]
            );
            if status >= 400 {
                assert_eq!(v["type"], "error", "{method} {path}: {v}");
                assert!(v["error"]["message"].is_string(), "{method} {path}: {v}");
            }
        }
        for (who, tok) in [
            ("no token", None),
            ("forged", Some(forged.as_str())),
            ("expired", Some(expired.as_str())),
            ("alg none", Some(alg_none.as_str())),
            ("HS512", Some(other_alg.as_str())),
            ("not yet valid", Some(not_yet.as_str())),
        ] {
            let path = fill(path, 0);
            let (status, v) = a.call(method, &path, tok, body.clone()).await;
            assert_eq!(status, 401, "{who} {method} {path}: {v}");
            assert_eq!(v["error"]["type"], "authentication_error");
        }
    }
    // Bad input is a 400 in the API's shape, naming what is wrong.
    for (method, path, body, needle) in [
        (
            "PATCH",
            format!("/v1/admin/tenants/{t}/policy"),
            json!({"requests_per_minute": 0}),
            "requests_per_minute",
        ),
        (
            "PATCH",
            format!("/v1/admin/tenants/{t}/policy"),
            json!({"requests_per_minit": 5}),
            "requests_per_minit",
        ),
        (
            "PATCH",
            format!("/v1/admin/tenants/{t}/policy"),
            json!({"key_output_tokens_per_minute": 0}),
            "key_output_tokens_per_minute",
        ),
        (
            "POST",
            format!("/v1/admin/tenants/{t}/workspaces"),
            json!({"name": "typo", "rpm": 5}),
            "rpm",
        ),
        (
            "POST",
            format!("/v1/admin/tenants/{t}/workspaces"),
            json!({"name": "zero", "output_tokens_per_minute": 0}),
            "output_tokens_per_minute",
        ),
        (
            "POST",
            format!("/v1/admin/tenants/{t}/keys"),
            json!({"name": "x", "expires_at": "2001-01-01T00:00:00Z"}),
            "expires_at",
        ),
        (
            "POST",
            "/v1/admin/users".into(),
            json!({"username": "shorty", "password": "short", "role": "finance"}),
            "password",
        ),
    ] {
        let (s, v) = a.call(method, &path, Some(&root), Some(body)).await;
        assert_eq!(s, 400, "{method} {path}: {v}");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(needle),
            "{v}"
        );
    }
    // A price in force priced usage: it is replaced by a newer version, never retired.
    let (s, v) = a
        .call(
            "POST",
            "/v1/billing/prices/retire",
            Some(&root),
            Some(json!({"model": "sim-tiny", "effective_from": "1970-01-01T00:00:00Z"})),
        )
        .await;
    assert_eq!(
        (s, v["error"]["type"].as_str()),
        (409, Some("invalid_request_error")),
        "{v}"
    );
    let (_, book) = a.call("GET", "/v1/billing/prices", Some(&root), None).await;
    let retired: Vec<&Value> = book["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| !p["retired_at"].is_null())
        .collect();
    assert_eq!(retired.len(), 1, "{book}");
    assert_eq!(retired[0]["effective_from"], "2099-01-01T00:00:00Z");
    let (s, v) = a
        .call("GET", "/v1/admin/tenants/not-a-uuid", Some(&root), None)
        .await;
    assert_eq!(s, 400, "{v}");
    assert_eq!(v["type"], "error");
    a.stop().await;
}

#[tokio::test]
async fn logins_back_off_lock_refresh_and_log_out() {
    let a = setup().await;
    let pw = a.user("ana", Role::PlatformAdmin, None).await;
    // A wrong password, then an immediate retry: refused without checking (backoff).
    let (s, v) = a.login("ana", "wrong password here").await;
    assert_eq!(s, 401, "{v}");
    assert_eq!(v["error"]["message"], "invalid username or password");
    let (s, v) = a.login("ana", &pw).await;
    assert_eq!(s, 429, "{v}");
    // An unknown user is answered the same way.
    let (s, v) = a.login("nobody", "whatever password").await;
    assert_eq!(
        (s, v["error"]["message"].as_str()),
        (401, Some("invalid username or password"))
    );
    assert_eq!(a.login("nobody", "whatever password").await.0, 429);
    // The fifth failure in a row locks the account, even for the right password.
    sqlx::query("UPDATE admin_users SET failed_logins = 4, last_failed_at = now() - interval '1 hour' WHERE username = 'ana'")
        .execute(&a.pool)
        .await
        .unwrap();
    assert_eq!(a.login("ana", "wrong password here").await.0, 401);
    let (s, v) = a.login("ana", &pw).await;
    assert_eq!(s, 429, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("minutes"),
        "{v}"
    );
    let locked: Option<chrono::DateTime<chrono::Utc>> =
        sqlx::query_scalar("SELECT locked_until FROM admin_users WHERE username = 'ana'")
            .fetch_one(&a.pool)
            .await
            .unwrap();
    assert!(locked.unwrap() > chrono::Utc::now() + chrono::Duration::minutes(14));
    // A platform admin unlocks it.
    let root_pw = a.user("root", Role::PlatformAdmin, None).await;
    let root = a.token("root", &root_pw).await;
    let ana = a.user_id("ana").await;
    let (s, _) = a
        .call(
            "POST",
            &format!("/v1/admin/users/{ana}/unlock"),
            Some(&root),
            None,
        )
        .await;
    assert_eq!(s, 200);
    let (s, login) = a.login("ana", &pw).await;
    assert_eq!(s, 200, "{login}");
    assert_eq!(login["user"]["role"], "platform_admin");
    let access = login["access_token"].as_str().unwrap().to_string();
    let refresh = login["refresh_token"].as_str().unwrap().to_string();
    // Refreshing gives new tokens; the old refresh token is spent.
    let (s, next) = a
        .call(
            "POST",
            "/v1/admin/refresh",
            None,
            Some(json!({"refresh_token": refresh})),
        )
        .await;
    assert_eq!(s, 200, "{next}");
    let (s, _) = a
        .call(
            "POST",
            "/v1/admin/refresh",
            None,
            Some(json!({"refresh_token": refresh})),
        )
        .await;
    assert_eq!(s, 401, "a refresh token works once");
    let access2 = next["access_token"].as_str().unwrap().to_string();
    assert_eq!(
        a.call("GET", "/v1/admin/me", Some(&access2), None).await.0,
        200
    );
    // Logout ends the session: its access tokens (old and new) and its refresh token.
    assert_eq!(
        a.call("POST", "/v1/admin/logout", Some(&access2), None)
            .await
            .0,
        204
    );
    for tok in [&access, &access2] {
        let (s, v) = a.call("GET", "/v1/admin/me", Some(tok), None).await;
        assert_eq!(s, 401, "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("session"));
    }
    let (s, _) = a
        .call(
            "POST",
            "/v1/admin/refresh",
            None,
            Some(json!({"refresh_token": next["refresh_token"]})),
        )
        .await;
    assert_eq!(s, 401);
    // Disabling a user ends its sessions too.
    let (_, l) = a.login("ana", &pw).await;
    let tok = l["access_token"].as_str().unwrap().to_string();
    assert_eq!(
        a.call(
            "DELETE",
            &format!("/v1/admin/users/{ana}"),
            Some(&root),
            None
        )
        .await
        .0,
        200
    );
    assert_eq!(a.call("GET", "/v1/admin/me", Some(&tok), None).await.0, 401);
    assert_eq!(a.login("ana", &pw).await.0, 401);
    // The last active platform admin cannot be disabled (the console would have no one left).
    sqlx::query("UPDATE admin_users SET disabled_at = now() WHERE role = 'platform_admin' AND username <> 'root'")
        .execute(&a.pool)
        .await
        .unwrap();
    let root_id = a.user_id("root").await;
    let (s, v) = a
        .call(
            "DELETE",
            &format!("/v1/admin/users/{root_id}"),
            Some(&root),
            None,
        )
        .await;
    assert_eq!(s, 409, "{v}");
    assert!(common::error_message(&v).contains("last active platform_admin"));
    // Every login, failure, lockout and logout is in the audit log; no password is.
    let actions: Vec<String> = sqlx::query_scalar("SELECT action FROM admin_audit ORDER BY id")
        .fetch_all(&a.pool)
        .await
        .unwrap();
    for want in [
        "login.failure",
        "login.lockout",
        "user.unlock",
        "login.success",
        "logout",
        "user.disable",
    ] {
        assert!(actions.iter().any(|x| x == want), "{want} in {actions:?}");
    }
    let dump: String = sqlx::query_scalar("SELECT string_agg(coalesce(before::text,'') || coalesce(after::text,''), ' ') FROM admin_audit")
        .fetch_one(&a.pool)
        .await
        .unwrap();
    assert!(!dump.contains(&pw), "a password leaked into the audit log");
    a.stop().await;
}

/// A login's answer as an attacker sees it: status, `retry-after`, and the body without its
/// `request_id` (which differs on every answer by design).
async fn login_answer(a: &Admin, name: &str, password: &str) -> (u16, Option<String>, String) {
    let r = a
        .app
        .client
        .post(format!("{}/v1/admin/login", a.app.url))
        .json(&json!({"username": name, "password": password}))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let retry = r
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_string());
    let mut body: Value = r.json().await.unwrap();
    body.as_object_mut().unwrap().remove("request_id");
    (status, retry, body.to_string())
}

#[tokio::test]
async fn unknown_and_existing_usernames_get_byte_identical_failures_and_lockouts() {
    let a = setup().await;
    a.user("alice", Role::Finance, None).await;
    // Round k: a wrong password for each, then an immediate retry (refused for 2^k s), until
    // the fifth failure locks both.
    for k in 0..control::admin::login::LOCK_AFTER {
        let known = login_answer(&a, "alice", "not her password").await;
        let unknown = login_answer(&a, "mallory", "not her password").await;
        assert_eq!(known.0, 401, "{known:?}");
        assert_eq!(
            known, unknown,
            "failure {k}: the answers tell the usernames apart"
        );
        let known = login_answer(&a, "alice", "not her password").await;
        let unknown = login_answer(&a, "mallory", "not her password").await;
        assert_eq!(known.0, 429, "{known:?}");
        assert_eq!(
            known, unknown,
            "retry {k}: the answers tell the usernames apart"
        );
        let wanted = if k + 1 == control::admin::login::LOCK_AFTER {
            "try again in 15 minutes".to_string()
        } else if k == 0 {
            "try again in 1 second".to_string()
        } else {
            format!("try again in {} seconds", 1 << k)
        };
        assert!(known.2.contains(&wanted), "{wanted:?} in {}", known.2);
        if k + 1 < control::admin::login::LOCK_AFTER {
            tokio::time::sleep(Duration::from_millis((1000 << k) + 150)).await;
        }
    }
    a.stop().await;
}

#[tokio::test]
async fn passwords_change_with_the_current_one_and_reset_with_a_one_time_secret() {
    let a = setup().await;
    let root_pw = a.user("root", Role::PlatformAdmin, None).await;
    let root = a.token("root", &root_pw).await;
    let pw = a.user("bob", Role::Finance, None).await;
    let bob = a.user_id("bob").await;
    let here = a.token("bob", &pw).await;
    let elsewhere = a.token("bob", &pw).await;
    let change =
        |current: &str, new: &str| json!({"current_password": current, "new_password": new});

    // The wrong current password is refused and counts as a failed login.
    let (s, v) = a
        .call(
            "POST",
            "/v1/admin/me/password",
            Some(&here),
            Some(change("guess", "bob-new-password-1")),
        )
        .await;
    assert_eq!(s, 400, "{v}");
    assert!(common::error_message(&v).starts_with("current_password:"));
    let (s, v) = a
        .call(
            "POST",
            "/v1/admin/me/password",
            Some(&here),
            Some(change(&pw, "bob-new-password-1")),
        )
        .await;
    assert_eq!(s, 429, "the backoff applies here too: {v}");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    // Too short: refused, nothing changed.
    let (s, v) = a
        .call(
            "POST",
            "/v1/admin/me/password",
            Some(&here),
            Some(change(&pw, "short")),
        )
        .await;
    assert_eq!(
        (s, v["error"]["message"].as_str()),
        (400, Some("password: at least 12 characters"))
    );
    let (s, v) = a
        .call(
            "POST",
            "/v1/admin/me/password",
            Some(&here),
            Some(change(&pw, "bob-new-password-1")),
        )
        .await;
    assert_eq!(s, 204, "{v}");
    // This session stays; the other ends; the old password no longer logs in.
    assert_eq!(
        a.call("GET", "/v1/admin/me", Some(&here), None).await.0,
        200
    );
    assert_eq!(
        a.call("GET", "/v1/admin/me", Some(&elsewhere), None)
            .await
            .0,
        401
    );
    assert_eq!(a.login("bob", &pw).await.0, 401);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(a.login("bob", "bob-new-password-1").await.0, 200);
    // A token made by `cachet billing token` belongs to no user: it cannot change one.
    let jwt = Jwt::new(ADMIN_SECRET.as_bytes()).unwrap();
    let cli = jwt
        .issue("ops", Role::PlatformAdmin, None, Duration::from_secs(60))
        .unwrap();
    let (s, v) = a
        .call(
            "POST",
            "/v1/admin/me/password",
            Some(&cli),
            Some(change("x", "y-long-password")),
        )
        .await;
    assert_eq!(s, 400, "{v}");

    // Only a platform admin issues reset secrets; a newer one retires the older.
    let fin = a.token("bob", "bob-new-password-1").await;
    let path = format!("/v1/admin/users/{bob}/password-reset");
    assert_eq!(a.call("POST", &path, Some(&fin), None).await.0, 403);
    let (s, first) = a.call("POST", &path, Some(&root), None).await;
    assert_eq!(s, 201, "{first}");
    let (_, second) = a.call("POST", &path, Some(&root), None).await;
    let secret = second["reset_secret"].as_str().unwrap().to_string();
    assert!(secret.starts_with("cachet-reset-"));
    let redeem = |secret: &str, new: &str| json!({"reset_secret": secret, "new_password": new});
    for bad in [first["reset_secret"].as_str().unwrap(), "cachet-reset-00"] {
        let (s, v) = a
            .call(
                "POST",
                "/v1/admin/password-reset",
                None,
                Some(redeem(bad, "bob-reset-password")),
            )
            .await;
        assert_eq!(s, 400, "{v}");
        assert_eq!(
            v["error"]["message"],
            "reset_secret: not valid (used, replaced or expired)"
        );
    }
    // Redeemed once: the password is set, every session ends, and the secret is spent.
    let (s, v) = a
        .call(
            "POST",
            "/v1/admin/password-reset",
            None,
            Some(redeem(&secret, "bob-reset-password")),
        )
        .await;
    assert_eq!(s, 204, "{v}");
    for t in [&here, &fin] {
        assert_eq!(a.call("GET", "/v1/admin/me", Some(t), None).await.0, 401);
    }
    let (s, _) = a
        .call(
            "POST",
            "/v1/admin/password-reset",
            None,
            Some(redeem(&secret, "bob-other-password")),
        )
        .await;
    assert_eq!(s, 400, "a reset secret works once");
    assert_eq!(a.login("bob", "bob-reset-password").await.0, 200);

    // The CLI sets a password too; a disabled user gets no reset.
    let file = std::env::temp_dir().join(format!("cachet-pw-{}", Uuid::new_v4()));
    std::fs::write(&file, "bob-cli-password-1\n").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_cachet"))
        .args(["admin", "user", "passwd", "bob", "--password-file"])
        .arg(&file)
        .env("DATABASE_URL", &a.app.db_url)
        .output()
        .unwrap();
    std::fs::remove_file(&file).ok();
    common::succeeded(&out);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(a.login("bob", "bob-cli-password-1").await.0, 200);
    assert_eq!(
        a.call(
            "DELETE",
            &format!("/v1/admin/users/{bob}"),
            Some(&root),
            None
        )
        .await
        .0,
        200
    );
    assert_eq!(a.call("POST", &path, Some(&root), None).await.0, 409);

    // Audited, and no secret or password in the log.
    let actions: Vec<String> = sqlx::query_scalar("SELECT action FROM admin_audit ORDER BY id")
        .fetch_all(&a.pool)
        .await
        .unwrap();
    for want in [
        "user.password_change",
        "user.password_reset_issued",
        "user.password_reset",
        "user.password_set",
    ] {
        assert!(actions.iter().any(|x| x == want), "{want} in {actions:?}");
    }
    let dump: String = sqlx::query_scalar("SELECT string_agg(coalesce(before::text,'') || coalesce(after::text,''), ' ') FROM admin_audit")
        .fetch_one(&a.pool)
        .await
        .unwrap();
    for secret_text in [
        &secret,
        "bob-new-password-1",
        "bob-reset-password",
        "bob-cli-password-1",
    ] {
        assert!(
            !dump.contains(secret_text),
            "{secret_text} leaked into the audit log"
        );
    }
    a.stop().await;
}

#[tokio::test]
async fn suspension_deletion_and_revocation_reach_the_gateway_within_seconds() {
    let a = setup().await;
    let root_pw = a.user("root", Role::PlatformAdmin, None).await;
    let root = a.token("root", &root_pw).await;
    let t = a.tenant;
    let key = a.app.key.clone();
    assert_eq!(
        a.message(&key).await.0,
        200,
        "cached as valid before each change"
    );
    a.call(
        "POST",
        &format!("/v1/admin/tenants/{t}/suspend"),
        Some(&root),
        None,
    )
    .await;
    within(
        "a suspended tenant's key gets 403",
        Duration::from_secs(5),
        || async {
            let (s, v) = a.message(&key).await;
            s == 403 && v["error"]["type"] == "permission_error"
        },
    )
    .await;
    a.call(
        "POST",
        &format!("/v1/admin/tenants/{t}/resume"),
        Some(&root),
        None,
    )
    .await;
    within(
        "a resumed tenant's key works",
        Duration::from_secs(5),
        || async { a.message(&key).await.0 == 200 },
    )
    .await;
    // Revocation of one key.
    let (kid, secret) = a.new_key(t, &root, "short-lived").await;
    assert_eq!(a.message(&secret).await.0, 200);
    a.call(
        "POST",
        &format!("/v1/admin/tenants/{t}/keys/{kid}/revoke"),
        Some(&root),
        None,
    )
    .await;
    within("a revoked key gets 401", Duration::from_secs(5), || async {
        a.message(&secret).await.0 == 401
    })
    .await;
    // Deletion: keys refused, the cache purged, the ledger kept, the name free again.
    a.app.settle().await;
    let ledger = a.app.ledger_count().await;
    let node = a.app.running().node.clone();
    let tid = cachet_common::TenantId(t);
    assert!(node.tenant_stats(tid, 5).tiers[0].bytes > 0);
    let name: String = sqlx::query_scalar("SELECT name FROM tenants WHERE id = $1")
        .bind(t)
        .fetch_one(&a.pool)
        .await
        .unwrap();
    let (s, v) = a
        .call(
            "DELETE",
            &format!("/v1/admin/tenants/{t}"),
            Some(&root),
            None,
        )
        .await;
    assert_eq!((s, v["state"].as_str()), (200, Some("deleted")), "{v}");
    within(
        "a deleted tenant's key gets 401",
        Duration::from_secs(5),
        || async { a.message(&key).await.0 == 401 },
    )
    .await;
    within(
        "a deleted tenant's cache is purged",
        Duration::from_secs(5),
        || async { node.tenant_stats(tid, 5).tiers.iter().all(|t| t.bytes == 0) },
    )
    .await;
    assert_eq!(a.app.ledger_count().await, ledger, "the ledger is kept");
    let (s, v) = a
        .call(
            "POST",
            "/v1/admin/tenants",
            Some(&root),
            Some(json!({"name": name})),
        )
        .await;
    assert_eq!(s, 201, "a deleted tenant's name can be used again: {v}");
    a.stop().await;
}

#[tokio::test]
async fn rotation_is_idempotent_and_the_old_secret_works_until_its_grace_ends() {
    let a = setup().await;
    let root_pw = a.user("root", Role::PlatformAdmin, None).await;
    let root = a.token("root", &root_pw).await;
    let t = a.tenant;
    let (kid, old) = a.new_key(t, &root, "svc").await;
    let path = format!("/v1/admin/tenants/{t}/keys/{kid}/rotate");
    let rotate = |idem: &'static str, grace: i64| {
        let (a, path, root) = (&a, path.clone(), root.clone());
        async move {
            a.call_with(
                "POST",
                &path,
                Some(&root),
                Some(json!({"grace_seconds": grace})),
                &[("idempotency-key", idem)],
            )
            .await
        }
    };
    // A grace beyond any duration is a 400 (schemathesis found it panicking), as is a negative one.
    for bad in [i64::MAX, -1] {
        let (s, v) = rotate("rot-bad", bad).await;
        assert_eq!(s, 400, "{bad}: {v}");
        assert!(common::error_message(&v).contains("grace_seconds"));
    }
    let (s, first) = rotate("rot-1", 3).await;
    assert_eq!(s, 200, "{first}");
    assert_eq!(first["replayed"], false);
    let new = first["secret"].as_str().unwrap().to_string();
    assert_ne!(new, old);
    // A retry (say the answer was lost) gets the same key and secret.
    let (s, again) = rotate("rot-1", 3).await;
    assert_eq!(s, 200, "{again}");
    assert_eq!(again["replayed"], true);
    assert_eq!(again["new_key"]["id"], first["new_key"]["id"]);
    assert_eq!(again["secret"].as_str(), Some(new.as_str()));
    // Another rotation of the same key is a conflict.
    let (s, v) = rotate("rot-2", 3).await;
    assert_eq!(s, 409, "{v}");
    assert!(common::error_message(&v).contains("already rotated"));
    // Both work during the grace period; then only the new one.
    assert_eq!(a.message(&old).await.0, 200);
    assert_eq!(a.message(&new).await.0, 200);
    within(
        "the old secret stops at the end of its grace",
        Duration::from_secs(8),
        || async {
            let (s, v) = a.message(&old).await;
            s == 401 && v["error"]["message"].as_str().unwrap().contains("expired")
        },
    )
    .await;
    assert_eq!(a.message(&new).await.0, 200);
    // After the replay window the secret can no longer be shown.
    sqlx::query("UPDATE api_key_rotations SET created_at = now() - interval '25 hours'")
        .execute(&a.pool)
        .await
        .unwrap();
    assert_eq!(
        control::tenants::keys::expire_rotation_seeds(&a.pool)
            .await
            .unwrap(),
        1
    );
    let (s, late) = rotate("rot-1", 3).await;
    assert_eq!(s, 200, "{late}");
    assert_eq!(late["new_key"]["id"], first["new_key"]["id"]);
    assert!(late["secret"].is_null(), "{late}");
    // The audit log holds the rotation, never a secret.
    let dump: String =
        sqlx::query_scalar("SELECT string_agg(coalesce(after::text,''), ' ') FROM admin_audit")
            .fetch_one(&a.pool)
            .await
            .unwrap();
    assert!(dump.contains("rotated_to") && !dump.contains(&new) && !dump.contains(&old));
    a.stop().await;
}

#[tokio::test]
async fn policy_refuses_1h_ttls_and_spent_budgets() {
    let a = setup().await;
    let root_pw = a.user("root", Role::PlatformAdmin, None).await;
    let root = a.token("root", &root_pw).await;
    let t = a.tenant;
    let policy = format!("/v1/admin/tenants/{t}/policy");
    let mut body = cached_body(120, "hi", 4);
    body["system"][0]["cache_control"]["ttl"] = json!("1h");
    let (s, _, _) = a.app.post("/v1/messages", &a.app.key, &body).await;
    assert_eq!(s, 200);
    let (s, v) = a
        .call(
            "PATCH",
            &policy,
            Some(&root),
            Some(json!({"allow_1h_ttl": false})),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    within("a 1h TTL is refused", Duration::from_secs(5), || async {
        let (s, _, v) = a.app.post("/v1/messages", &a.app.key, &body).await;
        s == 403 && v["error"]["message"].as_str().unwrap().contains("1h")
    })
    .await;

    // A price that makes one request cost cents, and a budget of one cent.
    common::price_sim_tiny(&a.pool, 40, (100_000, 100_000)).await;
    let (s, v) = a
        .call(
            "PATCH",
            &policy,
            Some(&root),
            Some(json!({"monthly_budget_minor": 1, "budget_alert_percent": 50})),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    within(
        "a spent budget refuses requests",
        Duration::from_secs(30),
        || async {
            let (s, v) = a.message(&a.app.key).await;
            s == 429
                && v["error"]["type"] == "rate_limit_error"
                && common::error_message(&v).contains("monthly spend budget")
        },
    )
    .await;
    within(
        "the budget view shows it and the refusals",
        Duration::from_secs(15),
        || async {
            let (_, b) = a
                .call(
                    "GET",
                    &format!("/v1/admin/tenants/{t}/budget"),
                    Some(&root),
                    None,
                )
                .await;
            b["state"] == "exhausted"
                && b["refusals"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|r| r["limit"] == "monthly_budget" && r["count"].as_i64().unwrap() >= 1)
        },
    )
    .await;
    let alerts: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM admin_audit WHERE action = 'budget.alert' AND tenant_id = $1",
    )
    .bind(t)
    .fetch_one(&a.pool)
    .await
    .unwrap();
    assert_eq!(
        alerts, 2,
        "the alert percentage and the budget itself are each raised once a month"
    );
    // Raising the budget lets requests through again.
    a.call(
        "PATCH",
        &policy,
        Some(&root),
        Some(json!({"monthly_budget_minor": null})),
    )
    .await;
    within("no budget, no refusal", Duration::from_secs(5), || async {
        a.message(&a.app.key).await.0 == 200
    })
    .await;
    a.stop().await;
}

#[tokio::test]
async fn usage_and_cache_views_agree_with_the_ledger_and_the_fabric() {
    let a = setup().await;
    let root_pw = a.user("root", Role::PlatformAdmin, None).await;
    let root = a.token("root", &root_pw).await;
    let t = a.tenant;
    for q in ["one", "two", "three"] {
        let (s, _, _) = a
            .app
            .post("/v1/messages", &a.app.key, &cached_body(200, q, 4))
            .await;
        assert_eq!(s, 200);
    }
    a.app.settle().await;
    let sums: (i64, i64, i64, i64, i64) = sqlx::query_as(
        "SELECT sum(input_tokens)::BIGINT, sum(cache_write_5m_tokens)::BIGINT, sum(cache_read_tokens)::BIGINT, \
         sum(output_tokens)::BIGINT, count(*) FROM usage_events WHERE tenant_id = $1",
    )
    .bind(t)
    .fetch_one(&a.pool)
    .await
    .unwrap();
    let range = query_range(chrono::Duration::hours(2));
    within(
        "the usage view matches the ledger",
        Duration::from_secs(10),
        || async {
            let (_, v) = a
                .call(
                    "GET",
                    &format!("/v1/admin/tenants/{t}/usage?{range}&group_by=api_key"),
                    Some(&root),
                    None,
                )
                .await;
            let tot = &v["totals"];
            tot["requests"] == sums.4
                && tot["input_tokens"] == sums.0
                && tot["cache_write_5m_tokens"] == sums.1
                && tot["cache_read_tokens"] == sums.2
                && tot["output_tokens"] == sums.3
                && v["key_names"].as_object().unwrap().len() == 1
        },
    )
    .await;
    let (_, v) = a
        .call(
            "GET",
            &format!("/v1/admin/tenants/{t}/usage?{range}"),
            Some(&root),
            None,
        )
        .await;
    let ratio = v["totals"]["hit_ratio"].as_f64().unwrap();
    let want = sums.2 as f64 / (sums.0 + sums.1 + sums.2) as f64;
    assert!((ratio - want).abs() < 1e-9, "{ratio} vs {want}");
    assert_eq!(v["granularity"], "hour");
    // The cache view: the tenant's bytes, and its prefix read twice.
    let (s, c) = a
        .call(
            "GET",
            &format!("/v1/admin/tenants/{t}/cache"),
            Some(&root),
            None,
        )
        .await;
    assert_eq!(s, 200, "{c}");
    assert!(c["total_bytes"].as_u64().unwrap() > 0, "{c}");
    assert_eq!(c["tiers"][0]["tier"], "dram");
    let top = &c["top_prefixes"][0];
    assert_eq!(top["reads"], 2, "{c}");
    assert_eq!(top["hash"].as_str().unwrap().len(), 64);
    assert!(top["ttl_left_ms"].as_u64().unwrap() > 0);
    assert!(
        !c.to_string().contains("w0 w1"),
        "no prompt text in the cache view"
    );
    a.stop().await;
}

/// The change feed applies changes made after it starts, once: the changes before it (the
/// full state covers them) do not drop cached keys on its first poll, which during a
/// Postgres outage would refuse every key of the tenants changed last.
#[tokio::test]
async fn the_change_feed_starts_at_its_end_and_drops_cached_keys_only_for_new_changes() {
    use gateway::sync::{Follower, Targets};
    let name = fresh_db_name();
    let pool = cachet::server::connect_and_migrate(&format!("{PG}/{name}"), 2)
        .await
        .unwrap();
    let key = tenant_with_key(&pool, "feed").await;
    let auth = std::sync::Arc::new(gateway::auth::Authenticator::new(
        pool.clone(),
        Duration::from_secs(30),
    ));
    let mut headers = axum::http::HeaderMap::new();
    headers.insert("x-api-key", key.parse().unwrap());
    let p = auth.authenticate(&headers).await.unwrap();
    let targets = Targets {
        auth: Some(auth.clone()),
        ..Default::default()
    };
    let mut feed = Follower::default();
    feed.step(&pool, &targets).await.unwrap(); // start
    assert_eq!(
        feed.step(&pool, &targets).await.unwrap(),
        0,
        "no new change"
    );
    assert_eq!(
        auth.cached_tenants(),
        vec![p.tenant],
        "the key stays cached"
    );
    // A change made now is applied, and drops the tenant's cached keys.
    control::tenants::set_suspended(
        &pool,
        &control::tenants::Actor::cli("test"),
        p.tenant,
        control::tenants::Suspension::Suspend,
    )
    .await
    .unwrap();
    assert_eq!(feed.step(&pool, &targets).await.unwrap(), 1);
    assert!(auth.cached_tenants().is_empty());
    pool.close().await;
    drop_db(&name).await;
}

/// Unpadded base64url (RFC 4648 §5), as JWTs use it.
fn base64url(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk.iter().fold(0u32, |n, b| (n << 8) | *b as u32) << (8 * (3 - chunk.len()));
        for i in 0..=chunk.len() {
            out.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
        }
    }
    out
}

/// A `/v1/messages` call with `key` and `body`; status and JSON.
async fn send(a: &Admin, key: &str, body: &Value) -> (u16, Value) {
    let (s, _, v) = a.app.post("/v1/messages", key, body).await;
    (s, v)
}

#[tokio::test]
async fn workspaces_isolate_caches_apply_their_own_limits_and_split_usage() {
    let a = setup().await;
    let root_pw = a.user("root", Role::PlatformAdmin, None).await;
    let root = a.token("root", &root_pw).await;
    let t = a.tenant;
    let ws_path = format!("/v1/admin/tenants/{t}/workspaces");
    let (s, alpha) = a
        .call(
            "POST",
            &ws_path,
            Some(&root),
            Some(json!({"name": "alpha", "requests_per_minute": 2})),
        )
        .await;
    assert_eq!(s, 201, "{alpha}");
    assert_eq!(alpha["limits"]["requests_per_minute"], 2);
    let alpha: Uuid = alpha["id"].as_str().unwrap().parse().unwrap();
    let (s, beta) = a
        .call("POST", &ws_path, Some(&root), Some(json!({"name": "beta"})))
        .await;
    assert_eq!(s, 201, "{beta}");
    let beta: Uuid = beta["id"].as_str().unwrap().parse().unwrap();
    let (s, v) = a
        .call("POST", &ws_path, Some(&root), Some(json!({"name": "beta"})))
        .await;
    assert_eq!(
        (s, v["error"]["type"].as_str()),
        (409, Some("invalid_request_error")),
        "{v}"
    );
    let (_, list) = a.call("GET", &ws_path, Some(&root), None).await;
    let names: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["default", "alpha", "beta"], "the default first");

    let key_in = |ws: Uuid, name: &'static str| {
        let a = &a;
        let root = root.clone();
        async move {
            let (s, v) = a
                .call(
                    "POST",
                    &format!("/v1/admin/tenants/{t}/keys"),
                    Some(&root),
                    Some(json!({"name": name, "workspace_id": ws})),
                )
                .await;
            assert_eq!(s, 201, "{v}");
            assert_eq!(v["workspace_id"], json!(ws));
            (
                v["id"].as_str().unwrap().parse::<Uuid>().unwrap(),
                v["secret"].as_str().unwrap().to_string(),
            )
        }
    };
    let (alpha_key_id, alpha_key) = key_in(alpha, "alpha-key").await;
    let (_, beta_key) = key_in(beta, "beta-key").await;

    // The same prompt: alpha writes then reads its cache; beta, same tenant, reads nothing.
    let body = cached_body(300, "which workspace?", 4);
    let (s, v) = send(&a, &alpha_key, &body).await;
    assert_eq!(s, 200, "{v}");
    assert!(v["usage"]["cache_creation_input_tokens"].as_u64().unwrap() > 0);
    let (s, v) = send(&a, &alpha_key, &body).await;
    assert_eq!(s, 200, "{v}");
    assert!(
        v["usage"]["cache_read_input_tokens"].as_u64().unwrap() > 0,
        "{v}"
    );
    let (s, v) = send(&a, &beta_key, &body).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["usage"]["cache_read_input_tokens"], 0, "{v}");
    assert!(v["usage"]["cache_creation_input_tokens"].as_u64().unwrap() > 0);

    // Alpha's limit of 2 requests a minute is spent; beta and the default workspace are not.
    let (s, v) = send(&a, &alpha_key, &body).await;
    assert_eq!(s, 429, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("2 requests per minute") && msg.contains("workspace"),
        "{msg}"
    );
    assert_eq!(send(&a, &beta_key, &body).await.0, 200);
    assert_eq!(send(&a, &a.app.key, &body).await.0, 200);

    // Usage split by workspace: the dashboard and the export agree with what was sent.
    a.app.settle().await;
    let range = query_range(chrono::Duration::hours(1));
    within(
        "usage is split by workspace",
        Duration::from_secs(20),
        || async {
            let (_, u) = a
                .call(
                    "GET",
                    &format!("/v1/admin/tenants/{t}/usage?{range}&group_by=workspace"),
                    Some(&root),
                    None,
                )
                .await;
            let requests = |ws: Uuid| -> i64 {
                u["series"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .filter(|p| p["workspace"] == json!(ws))
                    .map(|p| p["requests"].as_i64().unwrap())
                    .sum()
            };
            requests(alpha) == 2
                && requests(beta) == 2
                && u["workspace_names"][alpha.to_string()] == "alpha"
        },
    )
    .await;
    let (_, only) = a
        .call(
            "GET",
            &format!("/v1/admin/tenants/{t}/usage?{range}&workspace={beta}"),
            Some(&root),
            None,
        )
        .await;
    assert_eq!(only["totals"]["requests"], 2, "{only}");
    let export = |filter: String| {
        let a = &a;
        let root = root.clone();
        let range = range.clone();
        async move {
            let (s, v) = a
                .call(
                    "GET",
                    &format!("/v1/billing/exports/usage?{range}&format=jsonl&{filter}"),
                    Some(&root),
                    None,
                )
                .await;
            assert_eq!(s, 200, "{v}");
            let text = match v {
                Value::String(s) => s,
                other => other.to_string(),
            };
            text.lines()
                .map(|l| serde_json::from_str::<Value>(l).unwrap())
                .collect::<Vec<_>>()
        }
    };
    let rows = export(format!("workspace={alpha}")).await;
    assert_eq!(rows.len(), 2, "{rows:?}");
    for r in &rows {
        assert_eq!(r["workspace_name"], "alpha");
        assert_eq!(r["api_key_name"], "alpha-key");
        assert!(r["tenant_name"].is_string());
        assert_eq!(r["currency"], "USD", "the shipped price rates it: {r}");
        let cost: f64 = r["cost_exact_nanos"].as_str().unwrap().parse().unwrap();
        assert!(cost > 0.0, "{r}");
    }
    assert_eq!(export(format!("api_key={alpha_key_id}")).await.len(), 2);
    assert_eq!(export("model=sim-tiny".into()).await.len(), 5);
    assert!(export("model=no-such-model".into()).await.is_empty());

    // Rename; the default workspace is neither renamed nor archived.
    let (s, v) = a
        .call(
            "PATCH",
            &format!("{ws_path}/{alpha}"),
            Some(&root),
            Some(json!({"name": "alpha-2", "requests_per_minute": null})),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        (v["name"].as_str(), &v["limits"]["requests_per_minute"]),
        (Some("alpha-2"), &Value::Null)
    );
    let default: Uuid = list["data"][0]["id"].as_str().unwrap().parse().unwrap();
    let (s, _) = a
        .call(
            "PATCH",
            &format!("{ws_path}/{default}"),
            Some(&root),
            Some(json!({"name": "x"})),
        )
        .await;
    assert_eq!(s, 409);
    let (s, _) = a
        .call(
            "POST",
            &format!("{ws_path}/{default}/archive"),
            Some(&root),
            None,
        )
        .await;
    assert_eq!(s, 409);
    // Archiving revokes the workspace's keys; no key can be made in it any more.
    let (s, v) = a
        .call(
            "POST",
            &format!("{ws_path}/{alpha}/archive"),
            Some(&root),
            None,
        )
        .await;
    assert_eq!(s, 200, "{v}");
    assert!(v["archived_at"].is_string());
    within(
        "an archived workspace's key is refused",
        Duration::from_secs(10),
        || async { send(&a, &alpha_key, &body).await.0 == 401 },
    )
    .await;
    let (s, v) = a
        .call(
            "POST",
            &format!("/v1/admin/tenants/{t}/keys"),
            Some(&root),
            Some(json!({"name": "late", "workspace_id": alpha})),
        )
        .await;
    assert_eq!(s, 409, "{v}");
    assert_eq!(send(&a, &beta_key, &body).await.0, 200, "beta is untouched");
    // The audit log names the workspace.
    let (_, log) = a
        .call(
            "GET",
            &format!("/v1/admin/audit?tenant={t}&action=workspace.archive"),
            Some(&root),
            None,
        )
        .await;
    assert_eq!(log["data"][0]["target_name"], "workspace alpha-2", "{log}");
    assert_eq!(log["data"][0]["after"]["keys_revoked"], 1, "{log}");
    a.stop().await;
}

/// What a webhook receiver saw: (event id header, signature header, body).
type Received = std::sync::Arc<std::sync::Mutex<Vec<(String, String, bytes::Bytes, u16)>>>;

/// A webhook receiver on loopback that fails its first request with 500 and accepts the rest.
async fn receiver() -> (String, Received) {
    let seen: Received = Default::default();
    let s2 = seen.clone();
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post(move |headers: axum::http::HeaderMap, body: bytes::Bytes| {
            let seen = s2.clone();
            async move {
                let mut seen = seen.lock().unwrap();
                let status = if seen.is_empty() { 500 } else { 200 };
                let h = |n: &str| {
                    headers
                        .get(n)
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default()
                        .to_string()
                };
                seen.push((h("cachet-event-id"), h("cachet-signature"), body, status));
                axum::http::StatusCode::from_u16(status).unwrap()
            }
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    (url, seen)
}

#[tokio::test]
async fn budget_thresholds_reach_a_signed_webhook_once_each_even_after_a_retry() {
    let a = setup().await;
    let root_pw = a.user("root", Role::PlatformAdmin, None).await;
    let root = a.token("root", &root_pw).await;
    let t = a.tenant;
    let (url, seen) = receiver().await;
    let (s, ep) = a
        .call(
            "POST",
            &format!("/v1/admin/tenants/{t}/webhooks"),
            Some(&root),
            Some(json!({"url": url})),
        )
        .await;
    assert_eq!(s, 201, "{ep}");
    let secret = ep["secret"].as_str().unwrap().to_string();
    assert!(secret.starts_with("whsec_"));
    let (s, v) = a
        .call(
            "POST",
            &format!("/v1/admin/tenants/{t}/webhooks"),
            Some(&root),
            Some(json!({"url": "ftp://example.com"})),
        )
        .await;
    assert_eq!(s, 400, "{v}");

    // A price that makes a request cost cents, and some spend.
    common::price_sim_tiny(&a.pool, 40, (100_000, 100_000)).await;
    for _ in 0..2 {
        assert_eq!(a.message(&a.app.key).await.0, 200);
    }
    a.app.settle().await;
    let budget = format!("/v1/admin/tenants/{t}/budget");
    within("the spend shows", Duration::from_secs(20), || async {
        let (_, b) = a.call("GET", &budget, Some(&root), None).await;
        b["spent_minor"].as_i64().unwrap_or(0) >= 2
    })
    .await;
    let (_, b) = a.call("GET", &budget, Some(&root), None).await;
    let spent = b["spent_minor"].as_i64().unwrap();
    let policy = format!("/v1/admin/tenants/{t}/policy");
    // A budget of twice the spend, alerting at 50%: that threshold is crossed at once.
    let (s, v) = a
        .call(
            "PATCH",
            &policy,
            Some(&root),
            Some(json!({"monthly_budget_minor": spent * 2, "budget_alert_percent": 50})),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    within(
        "the 50% alert is delivered after a retry",
        Duration::from_secs(20),
        || async { seen.lock().unwrap().iter().any(|r| r.3 == 200) },
    )
    .await;
    // Lowered to what was spent: the 100% threshold, at once.
    let (s, _) = a
        .call(
            "PATCH",
            &policy,
            Some(&root),
            Some(json!({"monthly_budget_minor": spent})),
        )
        .await;
    assert_eq!(s, 200);
    within(
        "the 100% alert is delivered",
        Duration::from_secs(20),
        || async { seen.lock().unwrap().iter().filter(|r| r.3 == 200).count() == 2 },
    )
    .await;
    // Later checks (every second) and more traffic fire nothing again.
    let _ = a.message(&a.app.key).await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    let seen = seen.lock().unwrap().clone();
    assert_eq!(
        seen.len(),
        3,
        "one failed attempt, two deliveries: {seen:?}"
    );
    let accepted: Vec<&(String, String, bytes::Bytes, u16)> =
        seen.iter().filter(|r| r.3 == 200).collect();
    assert_eq!(
        seen[0].0, accepted[0].0,
        "the retry carries the same event id"
    );
    let month = chrono::Utc::now().format("%Y-%m").to_string();
    for (i, pct) in [50, 100].into_iter().enumerate() {
        let (id, sig, body, _) = accepted[i];
        assert!(
            control::webhooks::verify(&secret, sig, body),
            "signed with the endpoint's secret"
        );
        assert!(!control::webhooks::verify("whsec_other", sig, body));
        let ev: Value = serde_json::from_slice(body).unwrap();
        assert_eq!(ev["id"], json!(id));
        assert_eq!(ev["id"], json!(format!("budget:{t}:tenant:{month}:{pct}")));
        assert_eq!(ev["type"], "budget.threshold_crossed");
        assert_eq!(ev["data"]["threshold_percent"], pct);
        assert_eq!(ev["data"]["spent_minor"], spent);
    }
    // The delivery log says the same.
    let (s, log) = a
        .call(
            "GET",
            &format!("/v1/admin/tenants/{t}/webhooks/deliveries"),
            Some(&root),
            None,
        )
        .await;
    assert_eq!(s, 200, "{log}");
    let log = log["data"].as_array().unwrap();
    assert_eq!(log.len(), 2, "{log:?}");
    assert!(
        log.iter()
            .all(|d| d["state"] == "delivered" && d["last_status"] == 200)
    );
    let attempts: Vec<i64> = log
        .iter()
        .map(|d| d["attempts"].as_i64().unwrap())
        .collect();
    assert_eq!(
        attempts,
        [1, 2],
        "newest first: the 100% alert once, the 50% one twice"
    );
    a.stop().await;
}

#[tokio::test]
async fn a_workspace_budget_refuses_only_that_workspace_and_alerts_once_per_threshold() {
    let a = setup().await;
    let root_pw = a.user("root", Role::PlatformAdmin, None).await;
    let root = a.token("root", &root_pw).await;
    let t = a.tenant;
    // A price that makes a request cost cents.
    common::price_sim_tiny(&a.pool, 40, (100_000, 100_000)).await;
    let ws_path = format!("/v1/admin/tenants/{t}/workspaces");
    let (s, ws) = a
        .call(
            "POST",
            &ws_path,
            Some(&root),
            Some(json!({"name": "capped", "monthly_budget_minor": 1})),
        )
        .await;
    assert_eq!(s, 201, "{ws}");
    let ws: Uuid = ws["id"].as_str().unwrap().parse().unwrap();
    let (s, k) = a
        .call(
            "POST",
            &format!("/v1/admin/tenants/{t}/keys"),
            Some(&root),
            Some(json!({"name": "capped-key", "workspace_id": ws})),
        )
        .await;
    assert_eq!(s, 201, "{k}");
    let capped = k["secret"].as_str().unwrap().to_string();
    // Spend past the workspace's one cent.
    for _ in 0..2 {
        assert_eq!(a.message(&capped).await.0, 200);
    }
    a.app.settle().await;
    within(
        "the spent workspace budget refuses the workspace's keys",
        Duration::from_secs(30),
        || async {
            let (s, v) = a.message(&capped).await;
            s == 429 && common::error_message(&v).contains("this workspace's monthly spend budget")
        },
    )
    .await;
    // The default workspace (the same tenant) is not refused.
    assert_eq!(a.message(&a.app.key).await.0, 200);
    // Both thresholds (the tenant's alert percentage, 80, and 100) fire once for the workspace.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let alerts: Vec<(String, i32)> = sqlx::query_as(
        "SELECT event_id, percent FROM budget_alerts WHERE tenant_id = $1 ORDER BY percent",
    )
    .bind(t)
    .fetch_all(&a.pool)
    .await
    .unwrap();
    let month = chrono::Utc::now().format("%Y-%m").to_string();
    assert_eq!(
        alerts,
        vec![
            (format!("budget:{t}:{ws}:{month}:80"), 80),
            (format!("budget:{t}:{ws}:{month}:100"), 100)
        ]
    );
    within(
        "the refusal is counted by its limit",
        Duration::from_secs(15),
        || async {
            let (_, b) = a
                .call(
                    "GET",
                    &format!("/v1/admin/tenants/{t}/budget"),
                    Some(&root),
                    None,
                )
                .await;
            b["refusals"]
                .as_array()
                .unwrap()
                .iter()
                .any(|r| r["limit"] == "workspace_monthly_budget")
        },
    )
    .await;
    a.stop().await;
}

#[tokio::test]
async fn a_delivery_that_never_succeeds_is_retried_then_marked_failed_and_a_disabled_endpoint_gets_nothing()
 {
    let (name, _, pool) = fresh_db().await;
    let actor = control::tenants::Actor::cli("test");
    let t = control::tenants::create_tenant(&pool, &actor, "hooked")
        .await
        .unwrap()
        .id;
    // Nothing listens on port 9 of loopback: every attempt fails to connect.
    let (dead, _) =
        control::webhooks::create_endpoint(&pool, &actor, t, "http://127.0.0.1:9/x", true)
            .await
            .unwrap();
    assert!(
        control::webhooks::create_endpoint(&pool, &actor, t, "http://127.0.0.1:9/x", false)
            .await
            .is_err(),
        "a loopback endpoint is refused unless allowed"
    );
    let standing = control::alerts::Standing {
        tenant: t.as_uuid(),
        workspace: None,
        limit_minor: 100,
        alert_percent: 80,
        spent_minor: 90,
        currency: "USD".into(),
    };
    let now = chrono::Utc::now();
    assert_eq!(
        control::alerts::record(&pool, &standing, now)
            .await
            .unwrap(),
        [80]
    );
    assert!(
        control::alerts::record(&pool, &standing, now)
            .await
            .unwrap()
            .is_empty(),
        "recorded once"
    );
    let config = control::webhooks::DeliveryConfig {
        retry_base: Duration::from_millis(20),
        max_attempts: 3,
        timeout: Duration::from_secs(2),
        poll: Duration::from_millis(10),
        allow_private: true,
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        control::webhooks::deliver_one(&pool, &config)
            .await
            .unwrap();
        let log = control::webhooks::list_deliveries(&pool, t, 10)
            .await
            .unwrap();
        if log[0].state == "failed" || Instant::now() > deadline {
            assert_eq!(log.len(), 1);
            assert_eq!(log[0].state, "failed", "{log:?}");
            assert_eq!(log[0].attempts, 3);
            assert_eq!(log[0].last_error.as_deref(), Some("could not connect"));
            assert_eq!(log[0].endpoint_id, dead.id);
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    // A disabled endpoint is sent nothing more: the next threshold queues nothing for it.
    control::webhooks::disable_endpoint(&pool, &actor, t, dead.id)
        .await
        .unwrap();
    let spent = control::alerts::Standing {
        spent_minor: 100,
        ..standing
    };
    assert_eq!(
        control::alerts::record(&pool, &spent, now).await.unwrap(),
        [100]
    );
    assert_eq!(
        control::webhooks::list_deliveries(&pool, t, 10)
            .await
            .unwrap()
            .len(),
        1
    );
    pool.close().await;
    drop_db(&name).await;
}

/// A tenant admin lists its cache objects (every workspace), deletes one, and purges the whole
/// cache: objects deleted, every block of the tenant dropped, the next request recomputes.
#[tokio::test]
async fn a_tenant_admin_lists_deletes_and_purges_cache_objects() {
    let a = setup().await;
    let t = a.tenant;
    let pw = a.user("cache-admin", Role::TenantAdmin, Some(t)).await;
    let ta = a.token("cache-admin", &pw).await;
    let system: String = (0..200).map(|i| format!("p{i} ")).collect();
    let mut ids = Vec::new();
    for name in ["one", "two"] {
        let (s, _, o) = a
            .app
            .post(
                "/v1/caches",
                &a.app.key,
                &json!({"model": "sim-tiny", "display_name": name,
                        "system": format!("{name} {system}")}),
            )
            .await;
        assert_eq!(s, 200, "{o}");
        ids.push(o["id"].as_str().unwrap().to_string());
    }
    let (s, list) = a
        .call(
            "GET",
            &format!("/v1/admin/tenants/{t}/cache/objects"),
            Some(&ta),
            None,
        )
        .await;
    assert_eq!(s, 200, "{list}");
    let listed: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["id"].as_str().unwrap())
        .collect();
    assert_eq!(
        listed,
        vec![ids[1].as_str(), ids[0].as_str()],
        "newest first"
    );
    assert_eq!(list["data"][0]["workspace_name"], "default");
    assert_eq!(list["data"][0]["display_name"], "two");

    // Extended from its hour to 20 hours: the row and the fabric's hold follow; past the
    // tenant's maximum (a day by default), or without a lifetime, it is a 400.
    let patch = |body: Value| {
        let (a, ta, id) = (&a, &ta, &ids[1]);
        async move {
            a.call(
                "PATCH",
                &format!("/v1/admin/tenants/{t}/cache/objects/{id}"),
                Some(ta.as_str()),
                Some(body),
            )
            .await
        }
    };
    let (s, e) = patch(json!({"ttl": "20h"})).await;
    assert_eq!(s, 200, "{e}");
    let left = common::expires_in(&e);
    assert!(left > chrono::TimeDelta::hours(19), "{e}");
    let (s, e) = patch(json!({"ttl": "30d"})).await;
    assert_eq!(s, 400, "{e}");
    assert!(
        common::error_message(&e).contains("max_cache_ttl_secs"),
        "{e}"
    );
    let (s, e) = patch(json!({})).await;
    assert_eq!(s, 400, "{e}");
    let (s, e) = patch(json!({"ttl": "1h", "model": "x"})).await;
    assert_eq!(s, 400, "{e}");

    let (s, d) = a
        .call(
            "DELETE",
            &format!("/v1/admin/tenants/{t}/cache/objects/{}", ids[0]),
            Some(&ta),
            None,
        )
        .await;
    assert_eq!(s, 200, "{d}");
    // Released on the one node there is before the answer: what it freed or still holds.
    assert_eq!(d["id"], ids[0].as_str(), "{d}");
    assert!(
        d["bytes_freed"].as_u64().unwrap() + d["bytes_held"].as_u64().unwrap() > 0,
        "{d}"
    );
    assert_eq!(d["nodes_pending"], json!([]), "{d}");
    let use_it = |id: &str| {
        json!({"model": "sim-tiny", "max_tokens": 2, "cached_content": id,
               "messages": [{"role": "user", "content": "hi"}]})
    };
    let (s, _, _) = a
        .app
        .post("/v1/messages", &a.app.key, &use_it(&ids[0]))
        .await;
    assert_eq!(s, 404);
    let (s, _, r) = a
        .app
        .post("/v1/messages", &a.app.key, &use_it(&ids[1]))
        .await;
    assert_eq!(s, 200, "{r}");
    assert!(
        r["usage"]["cache_read_input_tokens"].as_u64().unwrap() > 0,
        "{r}"
    );
    // The extension reached the fabric: the object's prefix is held for its 20 hours.
    let ttl_left = a.app.longest_ttl_left_ms(t);
    assert!(ttl_left > 19 * 3600 * 1000, "{ttl_left} ms left");
    let held = |a: &Admin| {
        a.app
            .running()
            .node
            .tenant_stats(cachet_common::TenantId(t), 10)
            .tiers
            .iter()
            .map(|x| x.bytes)
            .sum::<u64>()
    };
    assert!(held(&a) > 0);

    let (s, p) = a
        .call(
            "POST",
            &format!("/v1/admin/tenants/{t}/cache/purge"),
            Some(&ta),
            None,
        )
        .await;
    assert_eq!(s, 200, "{p}");
    assert_eq!(
        p,
        json!({"type": "cache_purged", "cache_objects_deleted": 1})
    );
    // Every process drops the tenant's blocks when the change feed brings the purge.
    let mut left = held(&a);
    for _ in 0..100 {
        if left == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        left = held(&a);
    }
    assert_eq!(left, 0, "blocks left after the purge");
    let (s, _, _) = a
        .app
        .post("/v1/messages", &a.app.key, &use_it(&ids[1]))
        .await;
    assert_eq!(s, 404, "the purge deleted the objects");
    let (s, list) = a
        .call(
            "GET",
            &format!("/v1/admin/tenants/{t}/cache/objects"),
            Some(&ta),
            None,
        )
        .await;
    assert_eq!(s, 200);
    assert_eq!(list["data"], json!([]));
    // The content sent again is computed again (written, not read).
    let (s, _, r) = a
        .app
        .post(
            "/v1/messages",
            &a.app.key,
            &json!({"model": "sim-tiny", "max_tokens": 2,
                    "system": [{"type": "text", "text": format!("two {system}"),
                                "cache_control": {"type": "ephemeral"}}],
                    "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    assert_eq!(s, 200, "{r}");
    assert_eq!(r["usage"]["cache_read_input_tokens"], 0, "{r}");
    let actions: Vec<String> = sqlx::query_scalar(
        "SELECT action FROM admin_audit WHERE action IN ('cache_object.delete', 'cache.purge') ORDER BY id",
    )
    .fetch_all(&a.pool)
    .await
    .unwrap();
    assert_eq!(actions, vec!["cache_object.delete", "cache.purge"]);
    a.app.stop().await;
}

#[tokio::test]
async fn ceilings_bound_tenant_admins_and_limits_nest_from_tenant_to_workspace_to_key() {
    let a = setup().await;
    let root_pw = a.user("root", Role::PlatformAdmin, None).await;
    let root = a.token("root", &root_pw).await;
    let t = a.tenant;
    let ta_pw = a.user("owner", Role::TenantAdmin, Some(t)).await;
    let ta = a.token("owner", &ta_pw).await;
    let policy = format!("/v1/admin/tenants/{t}/policy");
    let patch = |token: String, body: Value| {
        let (a, policy) = (&a, policy.clone());
        async move { a.call("PATCH", &policy, Some(&token), Some(body)).await }
    };

    // The platform sets a ceiling on every limit a tenant admin may change: each value of
    // none (no limit) becomes the ceiling, 1h TTLs are turned off.
    let (s, p) = patch(
        root.clone(),
        json!({"ceilings": {
            "requests_per_minute": 100, "input_tokens_per_minute": 50000,
            "output_tokens_per_minute": 5000, "monthly_budget_minor": 10000,
            "allow_1h_ttl": false, "max_cache_ttl_secs": 3600, "max_concurrent": 4
        }}),
    )
    .await;
    assert_eq!(s, 200, "{p}");
    for (field, v) in [
        ("requests_per_minute", json!(100)),
        ("input_tokens_per_minute", json!(50000)),
        ("output_tokens_per_minute", json!(5000)),
        ("monthly_budget_minor", json!(10000)),
        ("allow_1h_ttl", json!(false)),
        ("max_cache_ttl_secs", json!(3600)),
        ("max_concurrent", json!(4)),
    ] {
        assert_eq!(p[field], v, "{field}: {p}");
        assert_eq!(p["ceilings"][field], v, "{field}: {p}");
    }

    // A tenant admin may lower each one, never raise it nor lift it to no limit.
    for (field, above, lower) in [
        ("requests_per_minute", json!(101), json!(50)),
        ("input_tokens_per_minute", json!(50001), json!(40000)),
        ("output_tokens_per_minute", json!(5001), json!(4000)),
        ("monthly_budget_minor", json!(10001), json!(9000)),
        ("max_cache_ttl_secs", json!(3601), json!(1800)),
        ("max_concurrent", json!(5), json!(2)),
        ("allow_1h_ttl", json!(true), json!(false)),
    ] {
        let (s, v) = patch(ta.clone(), json!({ field: above })).await;
        assert_eq!(s, 403, "{field} raised: {v}");
        assert_eq!(v["error"]["type"], "permission_error", "{v}");
        assert!(
            error_message(&v).starts_with(field)
                && (error_message(&v).contains("ceiling")
                    || error_message(&v).contains("do not allow")),
            "{v}"
        );
        if field != "allow_1h_ttl" && field != "max_cache_ttl_secs" {
            let (s, v) = patch(ta.clone(), json!({ field: null })).await;
            assert_eq!(s, 403, "{field} lifted: {v}");
            assert!(error_message(&v).contains("no limit is above"), "{v}");
        }
        let (s, v) = patch(ta.clone(), json!({ field: lower })).await;
        assert_eq!((s, &v[field]), (200, &lower), "{field} lowered: {v}");
    }
    let (s, v) = patch(
        ta.clone(),
        json!({"ceilings": {"requests_per_minute": 1000}}),
    )
    .await;
    assert_eq!(s, 403, "a tenant admin cannot move a ceiling: {v}");
    // A platform admin asking for a value above the ceiling it keeps gets a 400.
    let (s, v) = patch(root.clone(), json!({"requests_per_minute": 200})).await;
    assert_eq!(s, 400, "{v}");

    // Workspaces stay within the tenant's limits (now 50 a minute), keys within both.
    let ws_path = format!("/v1/admin/tenants/{t}/workspaces");
    let (s, v) = a
        .call(
            "POST",
            &ws_path,
            Some(&ta),
            Some(json!({"name": "batch", "requests_per_minute": 80})),
        )
        .await;
    assert_eq!(s, 400, "{v}");
    assert!(
        error_message(&v).contains("above the tenant's limit of 50"),
        "{v}"
    );
    let (s, ws) = a
        .call(
            "POST",
            &ws_path,
            Some(&ta),
            Some(json!({"name": "batch", "requests_per_minute": 40, "monthly_budget_minor": 5000})),
        )
        .await;
    assert_eq!(s, 201, "{ws}");
    let ws_id = ws["id"].as_str().unwrap().to_string();
    let (s, v) = a
        .call(
            "PATCH",
            &format!("{ws_path}/{ws_id}"),
            Some(&ta),
            Some(json!({"monthly_budget_minor": 9500})),
        )
        .await;
    assert_eq!(s, 400, "a workspace's budget above the tenant's: {v}");
    let (s, key) = a
        .call(
            "POST",
            &format!("/v1/admin/tenants/{t}/keys"),
            Some(&ta),
            Some(json!({"name": "batch-key", "workspace_id": ws_id})),
        )
        .await;
    assert_eq!(s, 201, "{key}");
    assert_eq!(key["limits"]["requests_per_minute"], Value::Null);
    let key_path = format!("/v1/admin/tenants/{t}/keys/{}", key["id"].as_str().unwrap());
    let key_secret = key["secret"].as_str().unwrap().to_string();
    for (body, says) in [
        (
            json!({"requests_per_minute": 45}),
            "above its workspace's limit of 40",
        ),
        (
            json!({"input_tokens_per_minute": 40001}),
            "above the tenant's limit of 40000",
        ),
        (json!({"output_tokens_per_minute": 0}), "at least 1"),
        (json!({"monthly_budget_minor": 10}), "no budget of its own"),
    ] {
        let (s, v) = a.call("PATCH", &key_path, Some(&ta), Some(body)).await;
        assert_eq!(s, 400, "{v}");
        assert!(error_message(&v).contains(says), "{says}: {v}");
    }
    let (s, v) = a
        .call(
            "PATCH",
            &key_path,
            Some(&ta),
            Some(json!({"requests_per_minute": 30, "output_tokens_per_minute": 3000})),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["limits"]["requests_per_minute"], 30);
    assert_eq!(
        v["expires_at"],
        Value::Null,
        "an absent expiry is left alone"
    );

    // Lowering the ceiling lowers everything above it, down the levels, in one change.
    let (s, p) = patch(
        root.clone(),
        json!({"ceilings": {"requests_per_minute": 20, "output_tokens_per_minute": 2000}}),
    )
    .await;
    assert_eq!(s, 200, "{p}");
    assert_eq!(p["requests_per_minute"], 20);
    assert_eq!(p["output_tokens_per_minute"], 2000);
    assert_eq!(
        p["input_tokens_per_minute"], 40000,
        "below its ceiling: kept"
    );
    let (_, ws) = a
        .call("GET", &format!("{ws_path}/{ws_id}"), Some(&ta), None)
        .await;
    assert_eq!(ws["limits"]["requests_per_minute"], 20, "{ws}");
    assert_eq!(
        ws["limits"]["output_tokens_per_minute"],
        Value::Null,
        "none stays none"
    );
    let (_, keys) = a
        .call(
            "GET",
            &format!("/v1/admin/tenants/{t}/keys"),
            Some(&ta),
            None,
        )
        .await;
    let k = keys["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|k| k["name"] == "batch-key")
        .unwrap()
        .clone();
    assert_eq!(k["limits"]["requests_per_minute"], 20, "{k}");
    assert_eq!(k["limits"]["output_tokens_per_minute"], 2000, "{k}");
    let lowered: Value = sqlx::query_scalar(
        "SELECT after->'lowered_to_fit' FROM admin_audit WHERE action = 'policy.update' \
         AND tenant_id = $1 ORDER BY id DESC LIMIT 1",
    )
    .bind(t)
    .fetch_one(&a.pool)
    .await
    .unwrap();
    assert_eq!(lowered, json!({"workspaces": 1, "keys": 1}));
    // Raising the ceiling again does not raise the values back.
    let (_, p) = patch(
        root.clone(),
        json!({"ceilings": {"requests_per_minute": 100}}),
    )
    .await;
    assert_eq!(p["requests_per_minute"], 20);

    // A key's own limit holds at admission, for that key only.
    let (s, v) = a
        .call(
            "PATCH",
            &key_path,
            Some(&ta),
            Some(json!({"requests_per_minute": 1})),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    within(
        "the key's own limit refuses its second request",
        Duration::from_secs(10),
        || async {
            let (s, v) = a.message(&key_secret).await;
            s == 429 && error_message(&v).contains("per API key")
        },
    )
    .await;
    assert_eq!(
        a.message(&a.app.key).await.0,
        200,
        "another key is not limited"
    );
    // A rotation's new key keeps the old key's own limits.
    let (s, r) = a
        .call(
            "POST",
            &format!("{key_path}/rotate"),
            Some(&ta),
            Some(json!({"grace_seconds": 60})),
        )
        .await;
    assert_eq!(s, 200, "{r}");
    assert_eq!(r["new_key"]["limits"]["requests_per_minute"], 1, "{r}");
    a.stop().await;
}

#[tokio::test]
async fn a_cache_write_refused_for_quota_is_shown_beside_usage_with_its_reason() {
    let a = setup().await;
    let root_pw = a.user("root", Role::PlatformAdmin, None).await;
    let root = a.token("root", &root_pw).await;
    let t = a.tenant;
    let (s, v) = a
        .call(
            "PATCH",
            &format!("/v1/admin/tenants/{t}/policy"),
            Some(&root),
            Some(json!({"cache_resident_bytes": 1})),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    // The next request's breakpoint cannot be held: the response says why, and it is not
    // billed as a write.
    let attempt = std::sync::atomic::AtomicUsize::new(300);
    within(
        "the quota refuses the write",
        Duration::from_secs(10),
        || async {
            // A prefix of its own each time, so that no earlier write is read instead.
            let words = attempt.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let (s, _, v) = a
                .app
                .post(
                    "/v1/messages",
                    &a.app.key,
                    &cached_body(words, "too big to hold", 4),
                )
                .await;
            s == 200
                && v["cachet"]["breakpoints"][0]["reason"] == "quota"
                && v["usage"]["cache_creation_input_tokens"] == 0
        },
    )
    .await;
    let range = query_range(chrono::Duration::hours(1));
    within(
        "the usage view says how many writes the quota refused",
        Duration::from_secs(20),
        || async {
            let (s, u) = a
                .call(
                    "GET",
                    &format!("/v1/admin/tenants/{t}/usage?{range}"),
                    Some(&root),
                    None,
                )
                .await;
            assert_eq!(s, 200, "{u}");
            u["cache_writes_not_held"]
                .as_array()
                .unwrap()
                .iter()
                .any(|r| {
                    r["reason"] == "quota"
                        && r["breakpoints"].as_i64().unwrap() >= 1
                        && r["tokens"].as_i64().unwrap() >= 300
                })
        },
    )
    .await;
    a.stop().await;
}

#[tokio::test]
async fn tags_on_workspaces_and_keys_split_usage_and_ride_on_every_export() {
    let a = setup().await;
    let root_pw = a.user("root", Role::PlatformAdmin, None).await;
    let root = a.token("root", &root_pw).await;
    let t = a.tenant;
    let (s, ws) = a
        .call(
            "POST",
            &format!("/v1/admin/tenants/{t}/workspaces"),
            Some(&root),
            Some(json!({"name": "search", "tags": {"team": "search", "cost-center": "42"}})),
        )
        .await;
    assert_eq!(s, 201, "{ws}");
    assert_eq!(ws["tags"]["team"], "search");
    let ws_id = ws["id"].as_str().unwrap().to_string();
    let key_in = |body: Value| {
        let (a, root) = (&a, root.clone());
        async move {
            let (s, v) = a
                .call(
                    "POST",
                    &format!("/v1/admin/tenants/{t}/keys"),
                    Some(&root),
                    Some(body),
                )
                .await;
            assert_eq!(s, 201, "{v}");
            v
        }
    };
    // One key inherits its workspace's team; another, elsewhere, says its own.
    let search =
        key_in(json!({"name": "indexer", "workspace_id": ws_id, "tags": {"env": "prod"}})).await;
    let ads = key_in(json!({"name": "bidder", "tags": {"team": "ads"}})).await;
    assert_eq!(search["tags"], json!({"env": "prod"}));
    for (body, says) in [
        (
            json!({"name": "x", "tags": {"bad name": "v"}}),
            "not a tag name",
        ),
        (
            json!({"name": "x", "tags": {"cachet:x": "v"}}),
            "Cachet's own",
        ),
        (json!({"name": "x", "tags": {"team": 3}}), "tags"),
    ] {
        let (s, v) = a
            .call(
                "POST",
                &format!("/v1/admin/tenants/{t}/keys"),
                Some(&root),
                Some(body),
            )
            .await;
        assert_eq!(s, 400, "{v}");
        assert!(error_message(&v).contains(says), "{says}: {v}");
    }
    // Tags change with a merge patch of the whole set.
    let ads_path = format!("/v1/admin/tenants/{t}/keys/{}", ads["id"].as_str().unwrap());
    let (s, v) = a
        .call(
            "PATCH",
            &ads_path,
            Some(&root),
            Some(json!({"tags": {"team": "ads", "env": "dev"}})),
        )
        .await;
    assert_eq!((s, &v["tags"]["env"]), (200, &json!("dev")), "{v}");

    let body = cached_body(120, "tagged", 4);
    for key in [&search, &search, &ads] {
        let (s, _, v) = a
            .app
            .post("/v1/messages", key["secret"].as_str().unwrap(), &body)
            .await;
        assert_eq!(s, 200, "{v}");
    }
    a.app.settle().await;
    let range = query_range(chrono::Duration::hours(1));
    // The dashboard splits by a tag: two requests for search, one for ads.
    within("usage splits by team", Duration::from_secs(30), || async {
        let (s, u) = a
            .call(
                "GET",
                &format!("/v1/admin/tenants/{t}/usage?{range}&group_by=tag&tag=team"),
                Some(&root),
                None,
            )
            .await;
        assert_eq!(s, 200, "{u}");
        let requests = |team: &str| -> i64 {
            u["series"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|p| p["tag"] == team)
                .map(|p| p["requests"].as_i64().unwrap())
                .sum()
        };
        assert!(
            u["tag_names"]
                .as_array()
                .unwrap()
                .contains(&json!("cost-center")),
            "{u}"
        );
        requests("search") == 2 && requests("ads") == 1
    })
    .await;
    let (s, v) = a
        .call(
            "GET",
            &format!("/v1/admin/tenants/{t}/usage?{range}&group_by=tag"),
            Some(&root),
            None,
        )
        .await;
    assert_eq!(s, 400, "{v}");
    assert!(error_message(&v).contains("tag: required"), "{v}");
    // The ledger export carries each row's tags: the workspace's under the key's own.
    let (s, rows) = a
        .call(
            "GET",
            &format!("/v1/billing/exports/usage?{range}&format=jsonl&tenant={t}"),
            Some(&root),
            None,
        )
        .await;
    assert_eq!(s, 200);
    let rows: Vec<Value> = rows
        .as_str()
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let of = |key: &Value| -> Vec<Value> {
        rows.iter()
            .filter(|r| r["api_key_id"] == key["id"])
            .map(|r| r["tags"].clone())
            .collect()
    };
    assert_eq!(
        of(&search),
        vec![json!({"cost-center": "42", "env": "prod", "team": "search"}); 2]
    );
    assert_eq!(of(&ads), vec![json!({"env": "dev", "team": "ads"})]);
    // So does the FOCUS dataset, in its Tags column.
    let (s, csv) = a
        .call(
            "GET",
            &format!(
                "/v1/billing/exports/focus?{range}&tenant={t}&api_key={}",
                ads["id"].as_str().unwrap()
            ),
            Some(&root),
            None,
        )
        .await;
    assert_eq!(s, 200);
    let csv = csv.as_str().unwrap();
    assert!(csv.lines().next().unwrap().contains(",Tags,"), "{csv}");
    assert!(
        csv.contains(r#""{""env"":""dev"",""team"":""ads""}""#),
        "{csv}"
    );
    a.stop().await;
}
