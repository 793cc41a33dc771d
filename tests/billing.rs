//! Billing against a real Postgres: a hand-computed invoice matched to the cent, invoice
//! immutability and adjustments, audited price corrections, idempotent rollups and the
//! reconciliation that proves ledger = rollups = invoices.

mod common;

use billing::invoice::{self, BillingError, LineKind};
use billing::money::Rates;
use billing::prices::{self, Plan, PriceVersion};
use billing::rollup;
use chrono::{DateTime, NaiveDate, TimeZone, Utc};
use common::{PG, fresh_db_name};
use sqlx::PgPool;
use uuid::Uuid;

fn at(s: &str) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
}

const OCT: fn() -> NaiveDate = || NaiveDate::from_ymd_opt(2026, 10, 1).unwrap();
/// "Now" for these tests: after October, so October can be finalized.
const NOW: fn() -> DateTime<Utc> = || Utc.with_ymd_and_hms(2026, 11, 22, 12, 0, 0).unwrap();

async fn db() -> (PgPool, Uuid, String) {
    let name = fresh_db_name();
    let pool = cachet::server::connect_and_migrate(&format!("{PG}/{name}"), 4)
        .await
        .unwrap();
    let t = control::tenants::create_tenant(
        &pool,
        &control::tenants::Actor::cli("test"),
        &format!("t-{}", Uuid::new_v4().simple()),
    )
    .await
    .unwrap();
    (pool, t.id.as_uuid(), name)
}

async fn drop_db(pool: PgPool, name: String) {
    pool.close().await;
    let admin = PgPool::connect(&format!("{PG}/postgres")).await.unwrap();
    let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"
    )))
    .execute(&admin)
    .await;
}

/// One ledger row, as the meter writes it.
async fn row(pool: &PgPool, tenant: Uuid, started: &str, t: [i64; 5]) -> Uuid {
    let id = Uuid::now_v7();
    sqlx::query(
        r#"INSERT INTO usage_events (request_id, tenant_id, workspace_id, api_key_id, model,
             input_tokens, cache_write_5m_tokens, cache_write_1h_tokens, cache_read_tokens,
             output_tokens, status, started_at, finished_at)
           VALUES ($1, $2, $3, $4, 'sim-tiny', $5, $6, $7, $8, $9, 'completed', $10, $10)"#,
    )
    .bind(id)
    .bind(tenant)
    .bind(Uuid::nil())
    .bind(Uuid::nil())
    .bind(t[0])
    .bind(t[1])
    .bind(t[2])
    .bind(t[3])
    .bind(t[4])
    .bind(at(started))
    .execute(pool)
    .await
    .unwrap();
    id
}

fn price(from: &str, input: i64, output: i64) -> PriceVersion {
    PriceVersion {
        model: "sim-tiny".into(),
        effective_from: at(from),
        currency: "USD".into(),
        rates: Rates::standard(input, output),
    }
}

/// October 2026 for one tenant: list price $3/$15 per MTok until the 16th, $2/$10 after; a
/// plan with 10% off usage and 2 GB reserved at $0.01 per GB-hour; four requests mixing
/// 5-minute and 1-hour writes and reads; one row each side of the month that must not count.
async fn october(pool: &PgPool, tenant: Uuid) {
    let past = at("2026-01-01T00:00:00Z");
    prices::set_price(
        pool,
        &price("2026-01-01T00:00:00Z", 3_000, 15_000),
        "test",
        true,
        NOW(),
    )
    .await
    .unwrap();
    prices::set_price(
        pool,
        &price("2026-10-16T00:00:00Z", 2_000, 10_000),
        "test",
        true,
        NOW(),
    )
    .await
    .unwrap();
    prices::set_plan(
        pool,
        &Plan {
            tenant_id: tenant,
            effective_from: at("2026-10-01T00:00:00Z"),
            discount_bp: 1_000,
            reserved_cache_bytes: 2_000_000_000,
            reserved_nanos_per_gb_hour: 10_000_000,
        },
        "test",
        true,
        NOW(),
    )
    .await
    .unwrap();
    assert!(past < NOW());
    //                                   input      5m write   1h write   read       output
    row(
        pool,
        tenant,
        "2026-10-05T10:00:00Z",
        [1_000_000, 4_000_000, 0, 0, 500_000],
    )
    .await;
    row(
        pool,
        tenant,
        "2026-10-10T10:00:00Z",
        [200_000, 0, 3_000_000, 4_000_000, 300_000],
    )
    .await;
    row(
        pool,
        tenant,
        "2026-10-20T10:00:00Z",
        [100_000, 0, 0, 7_000_000, 1_000_000],
    )
    .await;
    row(
        pool,
        tenant,
        "2026-10-25T10:00:00Z",
        [50_001, 2_000_000, 1_000_000, 0, 250_000],
    )
    .await;
    row(
        pool,
        tenant,
        "2026-09-30T23:59:59Z",
        [9_999_999, 0, 0, 0, 0],
    )
    .await;
    row(
        pool,
        tenant,
        "2026-11-01T00:00:00Z",
        [9_999_999, 0, 0, 0, 0],
    )
    .await;
}

#[tokio::test]
async fn a_hand_computed_invoice_matches_to_the_cent() {
    let (pool, tenant, name) = db().await;
    october(&pool, tenant).await;
    let inv = invoice::refresh_draft(&pool, tenant, OCT(), "test")
        .await
        .unwrap();
    let lines: Vec<(&str, Option<&str>, i64, i64)> = inv
        .lines
        .iter()
        .map(|l| {
            (
                l.kind.as_str(),
                l.token_class.as_deref(),
                l.quantity,
                l.amount_minor,
            )
        })
        .collect();
    // By hand (10% off every usage line; $ = tokens × price × multiplier × 0.9):
    //   until the 16th at $3/$15:  1.2M input $3.24 · 4M 5m-write $13.50 · 3M 1h-write $16.20
    //                              · 4M read $1.08 · 0.8M output $10.80
    //   from the 16th at $2/$10:   150,001 input $0.2700018 → $0.27 · 2M 5m-write $4.50
    //                              · 1M 1h-write $3.60 · 7M read $1.26 · 1.25M output $11.25
    //   reserved: 2 GB × 744 h × $0.01 = $14.88
    assert_eq!(
        lines,
        vec![
            ("usage", Some("input"), 1_200_000, 324),
            ("usage", Some("cache_write_5m"), 4_000_000, 1350),
            ("usage", Some("cache_write_1h"), 3_000_000, 1620),
            ("usage", Some("cache_read"), 4_000_000, 108),
            ("usage", Some("output"), 800_000, 1080),
            ("usage", Some("input"), 150_001, 27),
            ("usage", Some("cache_write_5m"), 2_000_000, 450),
            ("usage", Some("cache_write_1h"), 1_000_000, 360),
            ("usage", Some("cache_read"), 7_000_000, 126),
            ("usage", Some("output"), 1_250_000, 1125),
            ("reserved", None, 2_000_000_000 * 744, 1488),
        ]
    );
    assert_eq!(inv.total_minor, 8058);
    assert_eq!(inv.currency, "USD");
    // The exact amount is kept beside each line's share of the total.
    assert_eq!(inv.lines[5].exact_nanos, "270001800.000000000");
    // One rounding rule in every document (billing::rounding): the shares add up to the
    // total, and so do the CSV's exact amounts with its rounding row, in both columns.
    assert_eq!(inv.lines.iter().map(|l| l.amount_minor).sum::<i64>(), 8058);
    let csv = invoice::invoice_csv(&inv);
    let rows: Vec<Vec<&str>> = csv
        .lines()
        .skip(1)
        .map(|r| r.split(',').collect())
        .collect();
    let (body, total) = rows.split_at(rows.len() - 1);
    assert_eq!(body.last().unwrap()[1], "rounding");
    assert_eq!(body.last().unwrap()[7], "-0.0000018", "{csv}");
    assert_eq!(total[0][1], "total");
    assert_eq!(total[0][7], "80.58");
    let exact = |col: usize| -> billing::money::Exact {
        body.iter().map(|r| r[col].parse().unwrap()).sum()
    };
    assert_eq!(exact(6), total[0][6].parse().unwrap(), "{csv}");
    let nanos: i128 = body
        .iter()
        .map(|r| {
            let (w, f) = r[7].trim_start_matches('-').split_once('.').unwrap();
            let v = format!("{w}{f:0<9}").parse::<i128>().unwrap();
            if r[7].starts_with('-') { -v } else { v }
        })
        .sum();
    assert_eq!(nanos, 80_580_000_000, "{csv}");
    let json = serde_json::to_value(&inv).unwrap();
    assert_eq!(json["lines"][5]["amount"], "0.2700018");
    assert_eq!(json["rounding"]["amount"], "-0.0000018");
    assert_eq!(json["total"], "80.58");
    // What was stored is what was computed, and rating again changes nothing.
    let stored = invoice::load(&pool, inv.id).await.unwrap().unwrap();
    assert_eq!(stored, inv);
    let again = invoice::refresh_draft(&pool, tenant, OCT(), "test")
        .await
        .unwrap();
    assert!(again.rated_at >= inv.rated_at, "rating again says when");
    assert_eq!(
        invoice::Invoice {
            rated_at: inv.rated_at,
            ..again
        },
        inv
    );
    drop_db(pool, name).await;
}

#[tokio::test]
async fn a_finalized_invoice_never_changes_and_corrections_are_adjustments() {
    let (pool, tenant, name) = db().await;
    october(&pool, tenant).await;
    // The month must be over.
    assert!(matches!(
        invoice::finalize(&pool, tenant, OCT(), "finance", at("2026-10-31T12:00:00Z")).await,
        Err(BillingError::Invalid(_))
    ));
    let inv = invoice::finalize(&pool, tenant, OCT(), "finance", NOW())
        .await
        .unwrap();
    assert_eq!((inv.status.as_str(), inv.total_minor), ("finalized", 8058));
    // Neither the invoice nor its lines can be edited, not even by hand in SQL.
    assert!(
        sqlx::query("UPDATE invoice_lines SET amount_minor = 0 WHERE invoice_id = $1")
            .bind(inv.id)
            .execute(&pool)
            .await
            .is_err()
    );
    assert!(
        sqlx::query("UPDATE invoices SET total_minor = 0 WHERE id = $1")
            .bind(inv.id)
            .execute(&pool)
            .await
            .is_err()
    );
    assert!(matches!(
        invoice::refresh_draft(&pool, tenant, OCT(), "test").await,
        Err(BillingError::Finalized { .. })
    ));
    // A price correction back-dated into October must be asked for explicitly ...
    let corrected = price("2026-10-20T00:00:00Z", 1_000, 5_000);
    assert!(matches!(
        prices::set_price(&pool, &corrected, "finance", false, NOW()).await,
        Err(BillingError::Invalid(_))
    ));
    prices::set_price(&pool, &corrected, "finance", true, NOW())
        .await
        .unwrap();
    // ... and leaves the finalized invoice as it was.
    assert_eq!(invoice::load(&pool, inv.id).await.unwrap().unwrap(), inv);
    // The correction is an adjustment, billed on November's draft.
    invoice::add_adjustment(
        &pool,
        tenant,
        Some(inv.id),
        -250,
        "October price correction",
        "finance",
    )
    .await
    .unwrap();
    let nov = invoice::refresh_draft(
        &pool,
        tenant,
        NaiveDate::from_ymd_opt(2026, 11, 1).unwrap(),
        "finance",
    )
    .await
    .unwrap();
    let adj: Vec<_> = nov
        .lines
        .iter()
        .filter(|l| l.kind == LineKind::Adjustment)
        .collect();
    assert_eq!(adj.len(), 1);
    assert_eq!(adj[0].amount_minor, -250);
    assert!(adj[0].description.contains(&inv.id.to_string()));
    // Every rating, correction and finalization left an audit row.
    let actions: Vec<String> = sqlx::query_scalar("SELECT action FROM billing_audit ORDER BY id")
        .fetch_all(&pool)
        .await
        .unwrap();
    // (October's prices and plan were entered after the fact, so they are corrections too;
    // the refused attempt left nothing.)
    for a in ["plan_correction", "rate", "finalize", "adjustment"] {
        assert!(actions.iter().any(|x| x == a), "{a} in {actions:?}");
    }
    assert_eq!(
        actions.iter().filter(|a| *a == "price_correction").count(),
        3
    );
    drop_db(pool, name).await;
}

#[tokio::test]
async fn usage_without_a_price_is_listed_and_flagged_but_never_finalized_as_free() {
    let (pool, tenant, name) = db().await;
    row(&pool, tenant, "2026-10-05T10:00:00Z", [10, 0, 0, 0, 10]).await;
    // Rating does not stop: the usage is listed at zero, and the invoice names the model.
    let draft = invoice::refresh_draft(&pool, tenant, OCT(), "test")
        .await
        .unwrap();
    assert_eq!(draft.unpriced, vec!["sim-tiny".to_string()]);
    assert_eq!(draft.total_minor, 0);
    assert_eq!(draft.lines.len(), 2, "input and output: {:?}", draft.lines);
    for l in &draft.lines {
        assert!(l.price_from.is_none() && l.amount_minor == 0);
        assert!(
            l.description.contains("no price in force"),
            "{}",
            l.description
        );
    }
    // The stored draft says so too, and finalizing refuses to bill it as free.
    let loaded = invoice::load(&pool, draft.id).await.unwrap().unwrap();
    assert_eq!(loaded.unpriced, vec!["sim-tiny".to_string()]);
    match invoice::finalize(&pool, tenant, OCT(), "test", NOW()).await {
        Err(BillingError::Unpriced { models }) => assert_eq!(models, vec!["sim-tiny"]),
        other => panic!("expected Unpriced, got {other:?}"),
    }
    // A tenant's custom rate prices it even without a list price.
    let rates = Rates::standard(1_000_000, 1_000_000);
    let price = prices::TenantPrice {
        tenant,
        model: "sim-tiny".into(),
        effective_from: at("2026-01-01T00:00:00Z"),
        rates,
    };
    prices::set_tenant_price(&pool, &price, "test", true, NOW())
        .await
        .unwrap();
    let inv = invoice::refresh_draft(&pool, tenant, OCT(), "test")
        .await
        .unwrap();
    // 20 tokens × $0.001 = $0.02.
    assert_eq!(inv.total_minor, 2);
    assert!(inv.unpriced.is_empty());
    assert!(inv.lines[0].description.contains("custom rate"));
    drop_db(pool, name).await;
}

#[tokio::test]
async fn shipped_list_prices_are_seeded_once_and_never_over_an_operators_price() {
    let (pool, tenant, name) = db().await;
    // The operator priced the 8B profile before the defaults were ever seeded.
    let own = PriceVersion {
        model: "sim-llama-8b".into(),
        effective_from: at("2026-06-01T00:00:00Z"),
        currency: "USD".into(),
        rates: Rates::standard(7, 9),
    };
    prices::set_price(&pool, &own, "ops", true, NOW())
        .await
        .unwrap();
    let models = ["sim-tiny", "sim-llama-8b", "a-model-cachet-does-not-ship"];
    let seeded = prices::ensure_list_defaults(&pool, &models).await.unwrap();
    assert_eq!(seeded, vec!["sim-tiny".to_string()]);
    assert!(
        prices::ensure_list_defaults(&pool, &models)
            .await
            .unwrap()
            .is_empty(),
        "seeding is idempotent"
    );
    let book = prices::list_prices(&pool).await.unwrap();
    let of = |m: &str| {
        book.iter()
            .map(|p| p.version.clone())
            .filter(|p| p.model == m)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        of("sim-llama-8b"),
        vec![own],
        "the operator's price stays alone"
    );
    let tiny = of("sim-tiny");
    assert_eq!(tiny.len(), 1);
    assert_eq!(tiny[0].effective_from, at("1970-01-01T00:00:00Z"));
    assert_eq!(
        Some(tiny[0].rates),
        prices::list_default("sim-tiny"),
        "the seeded version is the shipped one"
    );
    assert!(of("a-model-cachet-does-not-ship").is_empty());
    // Usage of a seeded model is priced on a fresh draft; the seeding was audited.
    row(&pool, tenant, "2026-10-05T10:00:00Z", [1_500, 0, 0, 0, 300]).await;
    let inv = invoice::refresh_draft(&pool, tenant, OCT(), "test")
        .await
        .unwrap();
    assert!(inv.unpriced.is_empty());
    // 1,500 input tokens × $3/MTok = $0.0045 and 300 output × $15/MTok = $0.0045: each line
    // alone would round to $0.00, but the total is their exact sum ($0.009) rounded once,
    // $0.01, as the dashboards round; the lines' shares add up to it (the cent goes to the
    // first of two lines rounded down alike) and the rounding row says what it added.
    let exact: Vec<&str> = inv.lines.iter().map(|l| l.exact_nanos.as_str()).collect();
    assert_eq!(
        exact,
        vec!["4500000.000000000", "4500000.000000000"],
        "{:?}",
        inv.lines
    );
    let shares: Vec<i64> = inv.lines.iter().map(|l| l.amount_minor).collect();
    assert_eq!(shares, vec![1, 0]);
    assert_eq!(inv.total_minor, 1);
    let json = serde_json::to_value(&inv).unwrap();
    assert_eq!(json["lines"][0]["amount"], "0.0045");
    assert_eq!(json["rounding"]["amount"], "0.001");
    assert_eq!(json["total"], "0.01");
    let stored = invoice::load(&pool, inv.id).await.unwrap().unwrap();
    assert_eq!(stored.total_minor, 1);
    let audited: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM billing_audit WHERE action = 'price_default' AND actor = 'cachet-defaults'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(audited, 1);
    drop_db(pool, name).await;
}

#[tokio::test]
async fn the_month_overview_is_the_sum_of_the_dashboards_and_the_invoices_to_the_cent() {
    let (pool, first, name) = db().await;
    let actor = control::tenants::Actor::cli("test");
    let mut tenants = vec![first];
    for n in ["beta", "gamma, inc."] {
        let t = control::tenants::create_tenant(&pool, &actor, n)
            .await
            .unwrap();
        tenants.push(t.id.as_uuid());
    }
    // Awkward rates: nothing divides evenly, a price change on the hour mid-month, and a
    // discount for one tenant.
    let awkward = |from: &str, input, output| PriceVersion {
        rates: Rates {
            cache_write_5m_bp: 12_345,
            cache_write_1h_bp: 19_999,
            cache_read_bp: 1_111,
            cache_storage_hour_bp: 10_000,
            ..Rates::standard(input, output)
        },
        ..price(from, input, output)
    };
    for p in [
        awkward("2026-01-01T00:00:00Z", 3_333, 15_007),
        awkward("2026-10-17T13:00:00Z", 2_917, 11_113),
    ] {
        prices::set_price(&pool, &p, "test", true, NOW())
            .await
            .unwrap();
    }
    let plan = Plan {
        tenant_id: tenants[1],
        effective_from: at("2026-10-01T00:00:00Z"),
        discount_bp: 737,
        reserved_cache_bytes: 0,
        reserved_nanos_per_gb_hour: 0,
    };
    prices::set_plan(&pool, &plan, "test", true, NOW())
        .await
        .unwrap();
    // A generated month: a few hundred rows of odd sizes over every day of October.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = |m: u64| {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((x >> 33) % m) as i64
    };
    for i in 0..300 {
        let t = tenants[i % 3];
        let started = format!(
            "2026-10-{:02}T{:02}:{:02}:{:02}Z",
            1 + next(31),
            next(24),
            next(60),
            next(60)
        );
        let tokens = [
            next(9_973),
            next(4_001),
            next(1_009),
            next(50_021),
            next(997),
        ];
        row(&pool, t, &started, tokens).await;
    }
    rollup::rollup(
        &pool,
        at("2026-10-01T00:00:00Z"),
        at("2026-11-01T00:00:00Z"),
    )
    .await
    .unwrap();

    let o = control::admin::overview::month_overview(&pool, "2026-10")
        .await
        .unwrap();
    assert_eq!(o.data.len(), 3);
    let names: Vec<&str> = o.data.iter().map(|r| r.name.as_str()).collect();
    assert!(names.contains(&"gamma, inc."), "{names:?}");
    let mut sum = 0;
    for row in &o.data {
        let q = billing::dashboard::UsageQuery {
            granularity: billing::dashboard::Granularity::Hour,
            ..billing::dashboard::UsageQuery::tenant(
                row.tenant,
                at("2026-10-01T00:00:00Z"),
                at("2026-11-01T00:00:00Z"),
            )
        };
        let dash = billing::dashboard::usage(&pool, &q).await.unwrap();
        let inv = invoice::refresh_draft(&pool, row.tenant, OCT(), "test")
            .await
            .unwrap();
        assert_eq!(
            (row.cost_minor, dash.totals.cost_minor, inv.total_minor),
            (inv.total_minor, inv.total_minor, inv.total_minor),
            "{}: overview, dashboard and invoice agree to the cent",
            row.name
        );
        assert_eq!(row.tokens.requests, dash.totals.tokens.requests);
        assert!(row.cost_minor > 0 && row.unpriced_tokens == 0);
        sum += row.cost_minor;
        // The export's per-row costs add up to the invoice: exact, then rounded once.
        let filter = billing::export::ExportFilter {
            from: at("2026-10-01T00:00:00Z"),
            to: at("2026-11-01T00:00:00Z"),
            tenant: Some(row.tenant),
            workspace: None,
            api_key: None,
            model: None,
        };
        let body = billing::export::export_stream(
            pool.clone(),
            std::sync::Arc::new(control::tenants::directory::Directory(pool.clone())),
            filter,
            billing::export::Format::Jsonl,
        );
        let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap();
        let rows: Vec<serde_json::Value> = std::str::from_utf8(&bytes)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(rows.len() as i64, row.tokens.requests);
        let exact: billing::money::Exact = rows
            .iter()
            .map(|r| {
                assert_eq!(r["tenant_name"], row.name.as_str());
                r["cost_exact_nanos"]
                    .as_str()
                    .unwrap()
                    .parse::<billing::money::Exact>()
                    .unwrap()
            })
            .sum();
        assert_eq!(
            exact.to_minor("USD"),
            inv.total_minor,
            "{}: the export's rows cost what the invoice bills",
            row.name
        );
    }
    assert_eq!(o.totals.len(), 1);
    assert_eq!(
        (o.totals[0].currency.as_str(), o.totals[0].cost_minor),
        ("USD", sum)
    );
    assert_eq!(o.totals[0].requests, 300);
    // The CSV carries names (quoted where needed) and the same amounts.
    let csv = control::admin::overview::overview_csv(&o);
    let lines: Vec<&str> = csv.split("\r\n").filter(|l| !l.is_empty()).collect();
    assert_eq!(lines.len(), 4);
    assert!(lines.iter().any(|l| l.contains("\"gamma, inc.\"")), "{csv}");
    // A month that does not parse is the caller's mistake.
    assert!(matches!(
        control::admin::overview::month_overview(&pool, "October").await,
        Err(control::tenants::AdminError::Billing(_))
    ));
    drop_db(pool, name).await;
}

#[tokio::test]
async fn rollups_are_idempotent_and_reconcile_proves_ledger_rollups_and_invoices_agree() {
    let (pool, tenant, name) = db().await;
    october(&pool, tenant).await;
    let (from, to) = (at("2026-10-01T00:00:00Z"), at("2026-11-01T00:00:00Z"));
    // Before any rollup, reconciliation fails and says where.
    let r = rollup::reconcile(&pool, from, to).await.unwrap();
    assert!(!r.mismatches.is_empty());
    let first = rollup::rollup(&pool, from, to).await.unwrap();
    let snapshot = || async {
        sqlx::query_as::<_, (String, DateTime<Utc>, i64, i64, i64)>(
            "SELECT granularity, bucket_start, requests, input_tokens, cache_read_tokens FROM usage_rollups ORDER BY 1, 2",
        )
        .fetch_all(&pool)
        .await
        .unwrap()
    };
    let rows = snapshot().await;
    // The same window again, and an overlapping one: the same rows.
    assert_eq!(rollup::rollup(&pool, from, to).await.unwrap(), first);
    rollup::rollup(
        &pool,
        at("2026-10-05T10:30:00Z"),
        at("2026-10-21T00:00:00Z"),
    )
    .await
    .unwrap();
    assert_eq!(snapshot().await, rows);
    assert_eq!(first.daily_rows, 4);
    invoice::finalize(&pool, tenant, OCT(), "finance", NOW())
        .await
        .unwrap();
    let r = rollup::reconcile(&pool, from, to).await.unwrap();
    assert!(r.mismatches.is_empty(), "{:?}", r.mismatches);
    assert_eq!((r.tenants, r.invoices), (1, 1));

    // A row reaching the ledger late (spool replay) shows up as a difference until the
    // window is rolled up again; the finalized invoice then disagrees, visibly.
    row(&pool, tenant, "2026-10-07T08:00:00Z", [1, 2, 3, 4, 5]).await;
    let r = rollup::reconcile(&pool, from, to).await.unwrap();
    assert!(
        r.mismatches
            .iter()
            .any(|m| m.source == "hourly rollups" && m.found - m.ledger == -1)
    );
    rollup::rollup(&pool, from, to).await.unwrap();
    let r = rollup::reconcile(&pool, from, to).await.unwrap();
    assert!(
        r.mismatches.iter().all(|m| m.source == "invoice 2026-10"),
        "{:?}",
        r.mismatches
    );
    assert_eq!(r.mismatches.len(), 5);
    drop_db(pool, name).await;
}

/// The CLI: `cachet billing reconcile` exits non-zero with a readable diff, and zero once the
/// rollups are recomputed.
#[tokio::test]
async fn reconcile_cli_exits_non_zero_with_the_differences() {
    let (pool, tenant, name) = db().await;
    october(&pool, tenant).await;
    let cli = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_cachet"))
            .arg("billing")
            .args(args)
            .env("DATABASE_URL", format!("{PG}/{name}"))
            .env("CACHET_ENGINE", "sim")
            .output()
            .unwrap()
    };
    let out = cli(&["reconcile", "--from", "2026-10-01", "--to", "2026-11-01"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("hourly rollups") && err.contains(&tenant.to_string()),
        "{err}"
    );
    let out = cli(&[
        "rollup",
        "--from",
        "2026-10-01T00:00:00Z",
        "--to",
        "2026-11-01T00:00:00Z",
    ]);
    common::succeeded(&out);
    let out = cli(&["reconcile", "--from", "2026-10-01", "--to", "2026-11-01"]);
    common::succeeded(&out);
    assert!(String::from_utf8_lossy(&out.stdout).contains("ledger = rollups = invoices"));
    drop_db(pool, name).await;
}

/// The plan's reserved cache bytes reach the fabric with the tenant's key.
#[tokio::test]
async fn a_plans_reserved_bytes_come_with_the_tenants_key() {
    let (pool, tenant, name) = db().await;
    let t = control::tenants::find_tenant(&pool, &tenant.to_string())
        .await
        .unwrap()
        .unwrap();
    let key =
        control::tenants::create_key(&pool, &control::tenants::Actor::cli("test"), &t, "k", None)
            .await
            .unwrap();
    let lookup = || async {
        control::tenants::lookup_key(&pool, &control::tenants::hash_secret(&key.secret))
            .await
            .unwrap()
            .unwrap()
            .policy
            .reserved_cache_bytes
    };
    assert_eq!(lookup().await, None);
    prices::set_plan(
        &pool,
        &Plan {
            tenant_id: tenant,
            effective_from: at("2026-01-01T00:00:00Z"),
            discount_bp: 0,
            reserved_cache_bytes: 5_000_000_000,
            reserved_nanos_per_gb_hour: 1,
        },
        "test",
        true,
        NOW(),
    )
    .await
    .unwrap();
    assert_eq!(lookup().await, Some(5_000_000_000));
    drop_db(pool, name).await;
}

/// The dashboard's usage view: daily buckets read the daily rollups, except on a day whose
/// price changes during it, which is rated hour by hour; either way it costs exactly what the
/// invoice bills for the same rows, and its tokens are the ledger's.
#[tokio::test]
async fn the_usage_view_rates_a_mid_day_price_change_like_the_invoice() {
    let (pool, tenant, name) = db().await;
    prices::set_price(
        &pool,
        &price("2026-01-01T00:00:00Z", 3_000, 15_000),
        "test",
        true,
        NOW(),
    )
    .await
    .unwrap();
    // The price triples at noon on 10 October.
    prices::set_price(
        &pool,
        &price("2026-10-10T12:00:00Z", 9_000, 45_000),
        "test",
        true,
        NOW(),
    )
    .await
    .unwrap();
    for (when, t) in [
        ("2026-10-09T08:00:00Z", [1_000, 200, 0, 5_000, 100]),
        ("2026-10-10T09:30:00Z", [2_000, 0, 300, 1_000, 50]),
        ("2026-10-10T15:30:00Z", [2_000, 0, 300, 1_000, 50]),
        ("2026-10-11T23:59:00Z", [777, 11, 0, 3, 9]),
    ] {
        row(&pool, tenant, when, t).await;
    }
    rollup::rollup(
        &pool,
        at("2026-10-01T00:00:00Z"),
        at("2026-11-01T00:00:00Z"),
    )
    .await
    .unwrap();
    let (from, to) = (at("2026-10-01T00:00:00Z"), at("2026-11-01T00:00:00Z"));
    use billing::dashboard::{Granularity, UsageQuery, usage};
    let daily = usage(&pool, &UsageQuery::tenant(tenant, from, to))
        .await
        .unwrap();
    let hourly = usage(
        &pool,
        &UsageQuery {
            granularity: Granularity::Hour,
            ..UsageQuery::tenant(tenant, from, to)
        },
    )
    .await
    .unwrap();
    assert_eq!(daily.totals.tokens, hourly.totals.tokens);
    assert_eq!(daily.totals.tokens.requests, 4);
    assert_eq!(daily.totals.cost_minor, hourly.totals.cost_minor);
    assert_eq!(daily.series.len(), 3);
    let inv = invoice::compute(&pool, tenant, OCT()).await.unwrap();
    let usage_lines: i64 = inv
        .lines
        .iter()
        .filter(|l| l.kind == LineKind::Usage)
        .map(|l| l.amount_minor)
        .sum();
    // The invoice rounds each line; the view rounds the exact total once.
    assert!(
        (usage_lines - daily.totals.cost_minor).abs() <= inv.lines.len() as i64,
        "{usage_lines} vs {}",
        daily.totals.cost_minor
    );
    // A window that starts and ends mid-day is still whole hours of exact rows.
    let part = usage(
        &pool,
        &UsageQuery::tenant(
            tenant,
            at("2026-10-10T09:10:00Z"),
            at("2026-10-11T23:00:00Z"),
        ),
    )
    .await
    .unwrap();
    assert_eq!(part.totals.tokens.requests, 2);
    assert_eq!(part.from, at("2026-10-10T09:00:00Z"));
    drop_db(pool, name).await;
}

/// A tenant with a key and cache objects, as `POST /v1/caches` stores them.
async fn objects_tenant(pool: &PgPool) -> (control::tenants::Tenant, cachet_common::ApiKeyId) {
    let actor = control::tenants::Actor::cli("test");
    let t = control::tenants::create_tenant(
        pool,
        &actor,
        &format!("objects-{}", Uuid::new_v4().simple()),
    )
    .await
    .unwrap();
    let key = control::tenants::keys::create_key(pool, &actor, &t, "k", None)
        .await
        .unwrap();
    (t, key.id)
}

async fn object(
    pool: &PgPool,
    t: &control::tenants::Tenant,
    key: cachet_common::ApiKeyId,
    tokens: i64,
    created: &str,
    expires: &str,
) -> String {
    let id = control::caches::new_id().unwrap();
    control::caches::insert(
        pool,
        control::caches::NewObject {
            id: &id,
            scope: cachet_common::Scope {
                tenant: t.id,
                workspace: t.default_workspace,
            },
            key,
            model: "sim-tiny",
            content: &serde_json::json!({"messages": []}),
            input_tokens: tokens,
            display_name: None,
            request_id: Uuid::now_v7(),
            created_at: at(created),
            expires_at: at(expires),
            blocks: &[],
        },
    )
    .await
    .unwrap();
    id
}

/// (hour, seconds) rows of an object's storage, in order.
async fn held(pool: &PgPool, object: &str) -> Vec<(DateTime<Utc>, i32)> {
    sqlx::query_as(
        "SELECT hour_start, seconds FROM cache_storage_events WHERE object_id = $1 ORDER BY hour_start",
    )
    .bind(object)
    .fetch_all(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn cache_objects_are_billed_by_the_hour_they_are_held_once_and_to_the_cent() {
    use control::caches::meter::meter;
    let (pool, _, name) = db().await;
    prices::set_price(
        &pool,
        &price("2026-01-01T00:00:00Z", 3_000, 15_000),
        "test",
        true,
        NOW(),
    )
    .await
    .unwrap();
    let (t, key) = objects_tenant(&pool).await;
    let tenant = t.id.as_uuid();
    // A day-long object of 1M tokens from 10:20; one of 200K tokens deleted after 90 minutes.
    let day = object(
        &pool,
        &t,
        key,
        1_000_000,
        "2026-10-03T10:20:00Z",
        "2026-10-04T10:20:00Z",
    )
    .await;
    let short = object(
        &pool,
        &t,
        key,
        200_000,
        "2026-10-05T08:00:00Z",
        "2026-10-06T08:00:00Z",
    )
    .await;
    sqlx::query("UPDATE cache_objects SET deleted_at = $2 WHERE id = $1")
        .bind(&short)
        .bind(at("2026-10-05T09:30:00Z"))
        .execute(&pool)
        .await
        .unwrap();

    // Before its first hour closes nothing is written; then every closed hour, once.
    let r = meter(&pool, at("2026-10-03T10:59:00Z")).await.unwrap();
    assert_eq!(r.rows, 0);
    let r = meter(&pool, at("2026-10-03T12:00:30Z")).await.unwrap();
    assert_eq!(r.rows, 2, "{r:?}");
    assert_eq!(
        held(&pool, &day).await,
        vec![
            (at("2026-10-03T10:00:00Z"), 2_400),
            (at("2026-10-03T11:00:00Z"), 3_600)
        ]
    );
    assert_eq!(
        meter(&pool, at("2026-10-03T12:00:30Z")).await.unwrap().rows,
        0
    );
    // Two meters racing (two processes) write each hour once.
    let (a, b) = tokio::join!(
        meter(&pool, at("2026-10-04T09:00:00Z")),
        meter(&pool, at("2026-10-04T09:00:00Z"))
    );
    assert_eq!(a.unwrap().rows + b.unwrap().rows, 21);
    // A watermark lost (a crash between the insert and its update) writes nothing twice.
    sqlx::query("UPDATE cache_objects SET storage_metered_until = NULL WHERE id = $1")
        .bind(&day)
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(
        meter(&pool, at("2026-10-04T09:00:00Z")).await.unwrap().rows,
        0
    );
    // After both ended: the expired one's last 20 minutes, the deleted one's 90 minutes.
    meter(&pool, at("2026-11-01T00:00:00Z")).await.unwrap();
    let rows = held(&pool, &day).await;
    assert_eq!(rows.len(), 25);
    assert_eq!(rows.last(), Some(&(at("2026-10-04T10:00:00Z"), 1_200)));
    assert_eq!(rows.iter().map(|r| r.1 as i64).sum::<i64>(), 86_400);
    assert_eq!(
        held(&pool, &short).await,
        vec![
            (at("2026-10-05T08:00:00Z"), 3_600),
            (at("2026-10-05T09:00:00Z"), 1_800)
        ]
    );
    let m = meter(&pool, at("2026-11-02T00:00:00Z")).await.unwrap();
    assert_eq!((m.objects, m.rows), (0, 0), "ended objects are done");

    // The invoice, by hand: 1M × 24 h = 24M token-hours, 200K × 1.5 h = 0.3M, at $3/MTok
    // × 1.0 an hour: $72 + $0.90.
    let inv = invoice::refresh_draft(&pool, tenant, OCT(), "test")
        .await
        .unwrap();
    let lines: Vec<(&str, Option<&str>, i64, i64)> = inv
        .lines
        .iter()
        .map(|l| {
            (
                l.kind.as_str(),
                l.token_class.as_deref(),
                l.quantity,
                l.amount_minor,
            )
        })
        .collect();
    assert_eq!(
        lines,
        vec![("storage", Some("cache_storage"), 24_300_000 * 3_600, 7_290)]
    );
    assert_eq!(inv.total_minor, 7_290);
    assert!(
        inv.lines[0].description.contains("24300000 token-hours"),
        "{}",
        inv.lines[0].description
    );
    let csv = invoice::invoice_csv(&inv);
    assert!(csv.contains(",storage,sim-tiny,cache_storage,"), "{csv}");
    // The dashboards rate the same hours to the same cent, and count them against savings.
    let report = billing::dashboard::usage(
        &pool,
        &billing::dashboard::UsageQuery::tenant(
            tenant,
            at("2026-10-01T00:00:00Z"),
            at("2026-11-01T00:00:00Z"),
        ),
    )
    .await
    .unwrap();
    assert_eq!(
        report.totals.tokens.cache_storage_token_seconds,
        24_300_000 * 3_600
    );
    assert_eq!(report.totals.cost_minor, 7_290);
    assert_eq!(report.totals.saved_minor, -7_290);
    assert_eq!(report.series.len(), 3, "three days with objects held");
    let (_, spent) =
        billing::dashboard::month_spend(&pool, tenant, None, at("2026-10-20T00:00:00Z"))
            .await
            .unwrap();
    assert_eq!(spent, 7_290, "budgets count storage");

    // A custom storage rate from the 5th halves the second object's hours.
    prices::set_tenant_price(
        &pool,
        &prices::TenantPrice {
            tenant,
            model: "sim-tiny".into(),
            effective_from: at("2026-10-05T00:00:00Z"),
            rates: Rates {
                input_nanos: 3_000,
                output_nanos: 15_000,
                cache_write_5m_bp: 12_500,
                cache_write_1h_bp: 20_000,
                cache_read_bp: 1_000,
                cache_storage_hour_bp: 5_000,
            },
        },
        "test",
        true,
        NOW(),
    )
    .await
    .unwrap();
    let inv = invoice::refresh_draft(&pool, tenant, OCT(), "test")
        .await
        .unwrap();
    let amounts: Vec<(i64, i64)> = inv
        .lines
        .iter()
        .map(|l| (l.quantity, l.amount_minor))
        .collect();
    assert_eq!(
        amounts,
        vec![(24_000_000 * 3_600, 7_200), (300_000 * 3_600, 45)]
    );
    assert!(inv.lines[1].description.contains("custom rate"));
    // The FOCUS dataset bills the same storage, in token-hours, at the list price and the
    // custom rate apart.
    let (header, rows) = focus_october(&pool, tenant).await;
    let col = |r: &Vec<String>, c: &str| r[header.iter().position(|h| h == c).unwrap()].clone();
    assert!(!rows.is_empty());
    assert!(rows.iter().all(
        |r| col(r, "x_TokenClass") == "cache_storage" && col(r, "PricingUnit") == "Token-Hours"
    ));
    let billed: i128 = rows
        .iter()
        .map(|r| focus_decimal(&col(r, "BilledCost")))
        .sum();
    let storage: i128 = inv.lines.iter().map(|l| l.exact("USD").0).sum();
    assert_eq!(billed, storage, "the dataset bills what the invoice does");
    assert!(
        rows.iter()
            .any(|r| col(r, "ListCost") != col(r, "ContractedCost")),
        "a custom rate"
    );

    // Reconciliation covers storage: the rows agree with the invoice, until an hour is
    // written that the invoice does not bill.
    let (from, to) = (at("2026-10-01T00:00:00Z"), at("2026-11-01T00:00:00Z"));
    rollup::rollup(&pool, from, to).await.unwrap();
    let r = rollup::reconcile(&pool, from, to).await.unwrap();
    assert!(r.mismatches.is_empty(), "{:?}", r.mismatches);
    let late = object(
        &pool,
        &t,
        key,
        10,
        "2026-10-30T00:00:00Z",
        "2026-10-30T00:10:00Z",
    )
    .await;
    meter(&pool, at("2026-11-01T00:00:00Z")).await.unwrap();
    assert_eq!(
        held(&pool, &late).await,
        vec![(at("2026-10-30T00:00:00Z"), 600)]
    );
    let r = rollup::reconcile(&pool, from, to).await.unwrap();
    assert_eq!(r.mismatches.len(), 1, "{:?}", r.mismatches);
    assert_eq!(
        (
            r.mismatches[0].class,
            r.mismatches[0].ledger - r.mismatches[0].found
        ),
        ("cache_storage", 6_000)
    );
    // The ledger is append-only.
    assert!(
        sqlx::query("DELETE FROM cache_storage_events")
            .execute(&pool)
            .await
            .is_err()
    );
    drop_db(pool, name).await;
}

#[tokio::test]
async fn deleting_a_tenant_ends_its_objects_storage() {
    let (pool, _, name) = db().await;
    let (t, key) = objects_tenant(&pool).await;
    let now = Utc::now();
    let created = (now - chrono::TimeDelta::hours(3)).to_rfc3339();
    let expires = (now + chrono::TimeDelta::hours(20)).to_rfc3339();
    let id = object(&pool, &t, key, 1_000, &created, &expires).await;
    control::tenants::delete_tenant(&pool, &control::tenants::Actor::cli("test"), t.id)
        .await
        .unwrap();
    control::caches::meter::meter(&pool, Utc::now() + chrono::TimeDelta::seconds(1))
        .await
        .unwrap();
    let total: i64 = held(&pool, &id).await.iter().map(|r| r.1 as i64).sum();
    assert!((3 * 3_600 - 3..=3 * 3_600 + 1).contains(&total), "{total}");
    drop_db(pool, name).await;
}

#[tokio::test]
async fn an_extended_object_is_billed_to_its_new_expiry() {
    use control::caches::meter::meter;
    let (pool, _, name) = db().await;
    let (t, key) = objects_tenant(&pool).await;
    // Created at 00:30 for two hours; at 01:10 (its first hour metered) extended to 04:45.
    let id = object(
        &pool,
        &t,
        key,
        4_000,
        "2026-10-07T00:30:00Z",
        "2026-10-07T02:30:00Z",
    )
    .await;
    assert_eq!(
        meter(&pool, at("2026-10-07T01:10:00Z")).await.unwrap().rows,
        1
    );
    sqlx::query("UPDATE cache_objects SET expires_at = $2 WHERE id = $1")
        .bind(&id)
        .bind(at("2026-10-07T04:45:00Z"))
        .execute(&pool)
        .await
        .unwrap();
    // Past its old expiry the meter follows the new one.
    assert_eq!(
        meter(&pool, at("2026-10-07T03:00:00Z")).await.unwrap().rows,
        2
    );
    meter(&pool, at("2026-10-08T00:00:00Z")).await.unwrap();
    assert_eq!(
        held(&pool, &id).await,
        vec![
            (at("2026-10-07T00:00:00Z"), 1_800),
            (at("2026-10-07T01:00:00Z"), 3_600),
            (at("2026-10-07T02:00:00Z"), 3_600),
            (at("2026-10-07T03:00:00Z"), 3_600),
            (at("2026-10-07T04:00:00Z"), 2_700),
        ]
    );
    drop_db(pool, name).await;
}

/// FOCUS 1.2's mandatory columns, as its column library names them (feature level
/// "Mandatory"), and those of them that must never be null in a usage charge.
const FOCUS_MANDATORY: [&str; 21] = [
    "BilledCost",
    "BillingAccountId",
    "BillingAccountName",
    "BillingCurrency",
    "BillingPeriodEnd",
    "BillingPeriodStart",
    "ChargeCategory",
    "ChargeClass",
    "ChargeDescription",
    "ChargePeriodEnd",
    "ChargePeriodStart",
    "ContractedCost",
    "EffectiveCost",
    "InvoiceIssuerName",
    "ListCost",
    "PricingQuantity",
    "PricingUnit",
    "ProviderName",
    "PublisherName",
    "ServiceCategory",
    "ServiceName",
];

/// October's FOCUS dataset of `tenant`: its header and rows (cells split on commas: the
/// fixtures' cells hold none).
async fn focus_october(pool: &PgPool, tenant: Uuid) -> (Vec<String>, Vec<Vec<String>>) {
    let filter = billing::export::ExportFilter {
        from: at("2026-10-01T00:00:00Z"),
        to: at("2026-11-01T00:00:00Z"),
        tenant: Some(tenant),
        workspace: None,
        api_key: None,
        model: None,
    };
    let directory = std::sync::Arc::new(control::tenants::directory::Directory(pool.clone()));
    let body = billing::focus::stream(pool.clone(), directory, filter);
    let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap();
    let text = std::str::from_utf8(&bytes).unwrap();
    let mut lines = text
        .split("\r\n")
        .filter(|l| !l.is_empty())
        .map(|l| l.split(',').map(str::to_string).collect::<Vec<_>>());
    (lines.next().unwrap(), lines.collect())
}

/// A FOCUS decimal (`12.5`, `-0.0000519`) in atto-units, exactly.
fn focus_decimal(s: &str) -> i128 {
    let (neg, s) = s.strip_prefix('-').map_or((false, s), |r| (true, r));
    let (whole, frac) = s.split_once('.').unwrap_or((s, ""));
    assert!(frac.len() <= 18 && !s.contains(['e', 'E', ',']), "{s}");
    let v = whole.parse::<i128>().unwrap() * 10i128.pow(18)
        + format!("{frac:0<18}").parse::<i128>().unwrap();
    if neg { -v } else { v }
}

#[tokio::test]
async fn the_focus_export_has_the_mandatory_columns_and_bills_what_the_invoice_does() {
    let (pool, tenant, name) = db().await;
    october(&pool, tenant).await;
    let inv = invoice::refresh_draft(&pool, tenant, OCT(), "test")
        .await
        .unwrap();
    let (header, rows) = focus_october(&pool, tenant).await;
    for m in FOCUS_MANDATORY {
        assert!(header.iter().any(|h| h == m), "{m} missing from {header:?}");
    }
    let col = |r: &Vec<String>, c: &str| r[header.iter().position(|h| h == c).unwrap()].clone();
    // One row per hour and token class used: the four requests used 3, 4, 3 and 4 classes.
    assert_eq!(rows.len(), 14, "one row per request hour and class used");
    for r in &rows {
        assert_eq!(r.len(), header.len());
        for c in FOCUS_MANDATORY.iter().filter(|c| **c != "ChargeClass") {
            assert!(!col(r, c).is_empty(), "{c} is null in {r:?}");
        }
        assert_eq!(col(r, "ChargeCategory"), "Usage");
        assert_eq!(col(r, "BillingCurrency"), "USD");
        assert_eq!(col(r, "BillingPeriodStart"), "2026-10-01T00:00:00Z");
        assert_eq!(col(r, "BillingPeriodEnd"), "2026-11-01T00:00:00Z");
        assert_eq!(col(r, "ServiceCategory"), "AI and Machine Learning");
        assert_eq!(col(r, "PricingUnit"), "Tokens");
        // 10% off: billed is nine tenths of contracted; no commitments: effective = billed.
        let (billed, contracted) = (
            focus_decimal(&col(r, "BilledCost")),
            focus_decimal(&col(r, "ContractedCost")),
        );
        assert_eq!(billed * 10, contracted * 9, "{r:?}");
        assert_eq!(col(r, "EffectiveCost"), col(r, "BilledCost"));
        assert_eq!(
            col(r, "ListCost"),
            col(r, "ContractedCost"),
            "no custom rate"
        );
        let start: DateTime<Utc> = col(r, "ChargePeriodStart").parse().unwrap();
        let end: DateTime<Utc> = col(r, "ChargePeriodEnd").parse().unwrap();
        assert_eq!(end - start, chrono::TimeDelta::hours(1));
    }
    // The rows bill exactly what the invoice's usage lines do.
    let billed: i128 = rows
        .iter()
        .map(|r| focus_decimal(&col(r, "BilledCost")))
        .sum();
    let usage: i128 = inv
        .lines
        .iter()
        .filter(|l| l.kind == invoice::LineKind::Usage)
        .map(|l| l.exact("USD").0)
        .sum();
    assert_eq!(billed, usage);
    let quantity = |class: &str| -> i64 {
        rows.iter()
            .filter(|r| col(r, "x_TokenClass") == class)
            .map(|r| col(r, "PricingQuantity").parse::<i64>().unwrap())
            .sum()
    };
    assert_eq!(quantity("input"), 1_200_000 + 150_001);
    assert_eq!(quantity("cache_read"), 11_000_000);
    drop_db(pool, name).await;
}
