//! The finance API (`/v1/billing/…`): usage, invoices, exports, prices.
//!
//! Auth is a JWT (HS256, `Authorization: Bearer`) whose claims carry a role:
//!
//! | role | may |
//! |---|---|
//! | `platform_admin` | everything |
//! | `finance` | every tenant's usage, invoices and exports; rate and finalize invoices; read prices |
//! | `tenant_admin` | its own tenant's usage and invoices (claim `tenant`); nothing else |
//!
//! Another tenant's invoice answers 404 to a tenant admin (its existence is not disclosed).
//! Exports stream ledger rows (requests, or the storage ledger's hours of cache objects held)
//! as they are read (CSV per RFC 4180, JSON Lines, or CloudEvents
//! in JSON Lines), through a bounded channel: a month of millions of rows costs constant
//! memory. Errors have the gateway's shape: `{"type":"error","error":{"type","message"}}`.

use std::sync::Arc;

use axum::Json;
use axum::body::Body;
use axum::extract::rejection::QueryRejection;
use axum::extract::{FromRequestParts, Path, Query, State};
use axum::http::request::Parts;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use chrono::{DateTime, NaiveDate, Utc};
use serde::{Deserialize, Serialize};
use sqlx::{PgPool, Row};
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

use cachet_common::TenantId;
use cachet_common::error::{ApiError, ErrorBody, ErrorCode};
use identity::{AdminAuth, Claims, Role};

use crate::directory::Directory;
use crate::export::{ExportFilter, ExportFormat, Format, export_stream, storage_export_stream};
use crate::invoice::{self, BillingError, Invoice, InvoiceJson};
use crate::money::{Rates, TokenCounts};
use crate::prices::{self, PriceVersion};

/// State of the finance API.
#[derive(Clone)]
pub struct FinanceState {
    pub pool: PgPool,
    /// Who may call (the admin tokens the control plane's admin API uses too).
    pub auth: AdminAuth,
    /// The names exports and invoices print (the control plane's).
    pub directory: Arc<dyn Directory>,
}

impl From<BillingError> for ApiError {
    fn from(e: BillingError) -> Self {
        ApiError::from_service("finance API database error", &e)
    }
}

fn forbidden(m: &str) -> ApiError {
    ApiError::new(ErrorCode::Permission, m)
}

fn not_found(m: &str) -> ApiError {
    ApiError::new(ErrorCode::NotFound, m)
}

/// The caller, authenticated.
pub struct Caller(pub Claims);

impl FromRequestParts<FinanceState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &FinanceState,
    ) -> Result<Self, Self::Rejection> {
        Ok(Caller(state.auth.authenticate(&parts.headers).await?))
    }
}

impl Caller {
    /// The tenants this caller may read: `None` = all.
    fn scope(&self) -> Option<Uuid> {
        match self.0.role {
            Role::TenantAdmin => self.0.tenant,
            _ => None,
        }
    }

    /// A tenant filter allowed for this caller (a tenant admin is confined to its own).
    /// The request's span names the tenant it reads.
    fn tenant_filter(&self, asked: Option<Uuid>) -> Result<Option<Uuid>, ApiError> {
        let tenant = match (self.scope(), asked) {
            (None, a) => a,
            (Some(own), None) => Some(own),
            (Some(own), Some(a)) if a == own => Some(own),
            (Some(_), Some(_)) => {
                return Err(forbidden("a tenant admin reads only its own tenant"));
            }
        };
        if let Some(t) = tenant {
            cachet_common::span::record_tenant(TenantId(t), None);
        }
        Ok(tenant)
    }

    fn require(&self, roles: &[Role]) -> Result<(), ApiError> {
        if roles.contains(&self.0.role) {
            Ok(())
        } else {
            Err(forbidden("this role may not do that"))
        }
    }
}

/// Usage query.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct UsageQuery {
    /// Start (inclusive), RFC 3339.
    pub from: DateTime<Utc>,
    /// End (exclusive), RFC 3339.
    pub to: DateTime<Utc>,
    pub tenant: Option<Uuid>,
    pub model: Option<String>,
    pub api_key: Option<Uuid>,
    /// Comma-separated dimensions: `tenant`, `model`, `api_key`, and at most one of `hour`
    /// or `day`. Default `tenant,model`.
    pub group_by: Option<String>,
}

/// One group of usage.
#[derive(Debug, Serialize, ToSchema)]
pub struct UsageRow {
    pub tenant: Option<Uuid>,
    pub model: Option<String>,
    pub api_key: Option<Uuid>,
    pub bucket_start: Option<DateTime<Utc>>,
    pub requests: i64,
    #[serde(flatten)]
    pub tokens: TokenCounts,
}

#[derive(Serialize, ToSchema)]
pub struct UsageResponse {
    pub data: Vec<UsageRow>,
}

/// Usage from the rollups (hourly buckets; whole hours of the window).
#[utoipa::path(get, path = "/v1/billing/usage", tag = "billing", operation_id = "billing_usage", params(UsageQuery),
    responses((status = 200, body = UsageResponse), (status = 400, body = ErrorBody),
              (status = 401, body = ErrorBody), (status = 403, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn usage(
    State(s): State<FinanceState>,
    caller: Caller,
    q: Result<Query<UsageQuery>, QueryRejection>,
) -> Result<Json<UsageResponse>, ApiError> {
    let Query(q) = q?;
    if q.to <= q.from {
        return Err(ApiError::invalid("`to` must be after `from`"));
    }
    let tenant = caller.tenant_filter(q.tenant)?;
    let dims = q.group_by.as_deref().unwrap_or("tenant,model");
    let (mut by_tenant, mut by_model, mut by_key, mut bucket) = (false, false, false, None);
    for d in dims.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        match d {
            "tenant" => by_tenant = true,
            "model" => by_model = true,
            "api_key" => by_key = true,
            "hour" | "day" if bucket.is_none() => bucket = Some(d),
            _ => {
                return Err(ApiError::invalid(format!(
                    "group_by: {d:?} is not one of tenant, model, api_key, hour, day (one time bucket at most)"
                )));
            }
        }
    }
    let rows = sqlx::query(
        r#"
        SELECT CASE WHEN $5 THEN tenant_id END AS tenant,
               CASE WHEN $6 THEN model END AS model,
               CASE WHEN $7 THEN api_key_id END AS api_key,
               CASE WHEN $8::TEXT IS NOT NULL THEN date_trunc($8::TEXT, bucket_start, 'UTC') END AS bucket,
               sum(requests)::BIGINT AS requests, sum(input_tokens)::BIGINT AS input_tokens,
               sum(cache_write_5m_tokens)::BIGINT AS w5, sum(cache_write_1h_tokens)::BIGINT AS w1,
               sum(cache_read_tokens)::BIGINT AS rd, sum(output_tokens)::BIGINT AS output_tokens
        FROM usage_rollups
        WHERE granularity = 'hour' AND bucket_start >= $1 AND bucket_start < $2
          AND ($3::UUID IS NULL OR tenant_id = $3)
          AND ($4::TEXT IS NULL OR model = $4)
          AND ($9::UUID IS NULL OR api_key_id = $9)
        GROUP BY 1, 2, 3, 4
        ORDER BY 4 NULLS FIRST, 1 NULLS FIRST, 2 NULLS FIRST, 3 NULLS FIRST
        "#,
    )
    .bind(q.from)
    .bind(q.to)
    .bind(tenant)
    .bind(&q.model)
    .bind(by_tenant)
    .bind(by_model)
    .bind(by_key)
    .bind(bucket)
    .bind(q.api_key)
    .fetch_all(&s.pool)
    .await
    .map_err(BillingError::from)?;
    Ok(Json(UsageResponse {
        data: rows
            .into_iter()
            .map(|r| UsageRow {
                tenant: r.get("tenant"),
                model: r.get("model"),
                api_key: r.get("api_key"),
                bucket_start: r.get("bucket"),
                requests: r.get("requests"),
                tokens: TokenCounts {
                    input_tokens: r.get("input_tokens"),
                    cache_write_5m_tokens: r.get("w5"),
                    cache_write_1h_tokens: r.get("w1"),
                    cache_read_tokens: r.get("rd"),
                    output_tokens: r.get("output_tokens"),
                },
            })
            .collect(),
    }))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct InvoiceQuery {
    pub tenant: Option<Uuid>,
}

#[derive(Serialize, ToSchema)]
pub struct InvoiceSummary {
    pub id: Uuid,
    pub tenant_id: Uuid,
    pub period_start: NaiveDate,
    pub currency: String,
    pub status: String,
    pub total_minor: i64,
}

#[derive(Serialize, ToSchema)]
pub struct InvoiceList {
    pub data: Vec<InvoiceSummary>,
}

/// Stored invoices, newest month first.
#[utoipa::path(get, path = "/v1/billing/invoices", tag = "billing", params(InvoiceQuery),
    responses((status = 200, body = InvoiceList), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn list_invoices(
    State(s): State<FinanceState>,
    caller: Caller,
    q: Result<Query<InvoiceQuery>, QueryRejection>,
) -> Result<Json<InvoiceList>, ApiError> {
    let Query(q) = q?;
    let tenant = caller.tenant_filter(q.tenant)?;
    let rows = sqlx::query(
        r#"SELECT id, tenant_id, period_start, currency, status, total_minor FROM invoices
           WHERE ($1::UUID IS NULL OR tenant_id = $1) ORDER BY period_start DESC, tenant_id"#,
    )
    .bind(tenant)
    .fetch_all(&s.pool)
    .await
    .map_err(BillingError::from)?;
    Ok(Json(InvoiceList {
        data: rows
            .into_iter()
            .map(|r| InvoiceSummary {
                id: r.get("id"),
                tenant_id: r.get("tenant_id"),
                period_start: r.get("period_start"),
                currency: r.get("currency"),
                status: r.get("status"),
                total_minor: r.get("total_minor"),
            })
            .collect(),
    }))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct InvoiceFormat {
    /// `json` (default), `csv` (a download: a row per line, then the total) or `pdf` (the
    /// invoice to send: exact line amounts, the total rounded once).
    pub format: Option<String>,
}

/// One invoice with its lines (JSON, or CSV or PDF to download).
#[utoipa::path(get, path = "/v1/billing/invoices/{id}", tag = "billing",
    params(("id" = Uuid, Path, description = "Invoice id"), InvoiceFormat),
    responses((status = 200, description = "The invoice and its lines: JSON, or with `format` a CSV or a PDF to download",
                 content((InvoiceJson = "application/json"), (String = "text/csv"), ("application/pdf"))),
              (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn get_invoice(
    State(s): State<FinanceState>,
    caller: Caller,
    id: Result<Path<Uuid>, axum::extract::rejection::PathRejection>,
    q: Result<Query<InvoiceFormat>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Path(id) = id?;
    let Query(q) = q?;
    let inv = match invoice::load(&s.pool, id).await? {
        Some(inv) if caller.scope().is_none_or(|t| t == inv.tenant_id) => {
            cachet_common::span::record_tenant(TenantId(inv.tenant_id), None);
            inv
        }
        _ => return Err(not_found("no such invoice")),
    };
    match q.format.as_deref().unwrap_or("json") {
        "json" => Ok(Json(inv).into_response()),
        "csv" => {
            let name = format!(
                "attachment; filename=\"cachet-invoice-{}-{}.csv\"",
                inv.period_start.format("%Y-%m"),
                inv.id
            );
            Ok((
                [
                    (header::CONTENT_TYPE, "text/csv; charset=utf-8".to_string()),
                    (header::CONTENT_DISPOSITION, name),
                ],
                invoice::invoice_csv(&inv),
            )
                .into_response())
        }
        "pdf" => {
            let tenant = s
                .directory
                .names(inv.tenant_id)
                .await?
                .tenant
                .unwrap_or_else(|| inv.tenant_id.to_string());
            let name = format!(
                "attachment; filename=\"cachet-invoice-{}-{}.pdf\"",
                inv.period_start.format("%Y-%m"),
                inv.id
            );
            Ok((
                [
                    (header::CONTENT_TYPE, "application/pdf".to_string()),
                    (header::CONTENT_DISPOSITION, name),
                ],
                crate::pdf::invoice_pdf(&inv, &tenant),
            )
                .into_response())
        }
        other => Err(ApiError::invalid(format!(
            "format: {other:?} is not json, csv or pdf"
        ))),
    }
}

#[derive(Debug, Deserialize, ToSchema)]
pub struct RateRequest {
    pub tenant: Uuid,
    /// The month, `YYYY-MM`.
    pub month: String,
    /// Finalize (the month must be over); otherwise rate the draft.
    #[serde(default)]
    pub finalize: bool,
}

/// Rate a tenant's month into its draft, or finalize it.
#[utoipa::path(post, path = "/v1/billing/invoices", tag = "billing", request_body = RateRequest,
    responses((status = 200, description = "The invoice", body = InvoiceJson), (status = 400, body = ErrorBody),
              (status = 401, body = ErrorBody), (status = 403, body = ErrorBody), (status = 409, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn rate_invoice(
    State(s): State<FinanceState>,
    caller: Caller,
    r: Result<Json<RateRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<Json<Invoice>, ApiError> {
    let Json(r) = r?;
    caller.require(&[Role::PlatformAdmin, Role::Finance])?;
    let month = invoice::parse_month(&r.month)?;
    let actor = format!("jwt:{}", caller.0.sub);
    let inv = if r.finalize {
        invoice::finalize(&s.pool, r.tenant, month, &actor, Utc::now()).await?
    } else {
        invoice::refresh_draft(&s.pool, r.tenant, month, &actor).await?
    };
    Ok(Json(inv))
}

#[derive(Serialize, ToSchema)]
pub struct PriceList {
    pub data: Vec<serde_json::Value>,
}

/// The list-price versions.
#[utoipa::path(get, path = "/v1/billing/prices", tag = "billing",
    responses((status = 200, body = PriceList), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn list_prices(
    State(s): State<FinanceState>,
    caller: Caller,
) -> Result<Json<PriceList>, ApiError> {
    caller.require(&[Role::PlatformAdmin, Role::Finance])?;
    let data = prices::list_prices(&s.pool)
        .await?
        .into_iter()
        .map(|p| serde_json::to_value(p).unwrap_or_default())
        .collect();
    Ok(Json(PriceList { data }))
}

#[derive(Debug, Deserialize, ToSchema)]
pub struct NewPrice {
    pub model: String,
    pub effective_from: DateTime<Utc>,
    #[serde(default = "usd")]
    pub currency: String,
    #[serde(flatten)]
    pub rates: Rates,
    /// A version dated in the past corrects prices in force (audited).
    #[serde(default)]
    pub backdate: bool,
}

fn usd() -> String {
    "USD".into()
}

/// Add a list-price version (platform admins only).
#[utoipa::path(post, path = "/v1/billing/prices", tag = "billing", request_body = NewPrice,
    responses((status = 201, description = "Recorded (no body)"), (status = 400, body = ErrorBody),
              (status = 401, body = ErrorBody), (status = 403, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn add_price(
    State(s): State<FinanceState>,
    caller: Caller,
    p: Result<Json<NewPrice>, axum::extract::rejection::JsonRejection>,
) -> Result<StatusCode, ApiError> {
    let Json(p) = p?;
    caller.require(&[Role::PlatformAdmin])?;
    let v = PriceVersion {
        model: p.model,
        effective_from: p.effective_from,
        currency: p.currency,
        rates: p.rates,
    };
    prices::set_price(
        &s.pool,
        &v,
        &format!("jwt:{}", caller.0.sub),
        p.backdate,
        Utc::now(),
    )
    .await?;
    Ok(StatusCode::CREATED)
}

/// A scheduled list-price version to withdraw.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RetirePrice {
    pub model: String,
    pub effective_from: DateTime<Utc>,
}

/// Retire a scheduled list-price version before it takes effect (platform admins only). A
/// version in force is refused (409): change a price by adding a newer version.
#[utoipa::path(post, path = "/v1/billing/prices/retire", tag = "billing", request_body = RetirePrice,
    responses((status = 204, description = "Retired (or already retired)"), (status = 400, body = ErrorBody),
              (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
              (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn retire_price(
    State(s): State<FinanceState>,
    caller: Caller,
    p: Result<Json<RetirePrice>, axum::extract::rejection::JsonRejection>,
) -> Result<StatusCode, ApiError> {
    let Json(p) = p?;
    caller.require(&[Role::PlatformAdmin])?;
    prices::retire_price(
        &s.pool,
        &p.model,
        p.effective_from,
        &format!("jwt:{}", caller.0.sub),
        Utc::now(),
    )
    .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Ledger rows, streamed (finance and platform admins: any tenant; a tenant admin: its own).
#[utoipa::path(get, path = "/v1/billing/exports/usage", tag = "billing", params(ExportFilter, ExportFormat),
    responses((status = 200, description = "Rows as CSV, JSON Lines or CloudEvents JSON Lines (`format`)",
                 content((String = "text/csv"), (String = "application/jsonl"), (String = "application/cloudevents-batch+jsonl"))),
              (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn export_usage(
    State(s): State<FinanceState>,
    caller: Caller,
    filter: Result<Query<ExportFilter>, QueryRejection>,
    format: Result<Query<ExportFormat>, QueryRejection>,
) -> Result<Response, ApiError> {
    export(s, caller, (filter, format), export_stream)
}

/// Hours of cache objects held (the storage ledger), streamed: one row per object and hour,
/// picked by the hour's start (finance and platform admins: any tenant; a tenant admin: its
/// own).
#[utoipa::path(get, path = "/v1/billing/exports/storage", tag = "billing", params(ExportFilter, ExportFormat),
    responses((status = 200, description = "Rows as CSV, JSON Lines or CloudEvents JSON Lines (`format`)",
                 content((String = "text/csv"), (String = "application/jsonl"), (String = "application/cloudevents-batch+jsonl"))),
              (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn export_storage(
    State(s): State<FinanceState>,
    caller: Caller,
    filter: Result<Query<ExportFilter>, QueryRejection>,
    format: Result<Query<ExportFormat>, QueryRejection>,
) -> Result<Response, ApiError> {
    export(s, caller, (filter, format), storage_export_stream)
}

/// The export's query, as the two extractors read it.
type ExportQuery = (
    Result<Query<ExportFilter>, QueryRejection>,
    Result<Query<ExportFormat>, QueryRejection>,
);

fn export(
    s: FinanceState,
    caller: Caller,
    (filter, format): ExportQuery,
    stream: fn(PgPool, Arc<dyn Directory>, ExportFilter, Format) -> Body,
) -> Result<Response, ApiError> {
    let (filter, Query(ExportFormat { format })) = (filter, format?);
    let filter = caller_filter(&caller, filter)?;
    let content_type = match format {
        Format::Csv => CSV,
        Format::Jsonl => "application/jsonl",
        Format::Cloudevents => "application/cloudevents-batch+jsonl",
    };
    let body = stream(s.pool.clone(), s.directory.clone(), filter, format);
    Ok(([(header::CONTENT_TYPE, content_type)], body).into_response())
}

const CSV: &str = "text/csv; charset=utf-8; header=present";

/// An export's filter as the caller may ask it: a tenant admin its own tenant's rows only
/// (asking for another is refused), a range that ends after it starts.
fn caller_filter(
    caller: &Caller,
    filter: Result<Query<ExportFilter>, QueryRejection>,
) -> Result<ExportFilter, ApiError> {
    let Query(mut filter) = filter?;
    filter.tenant = caller.tenant_filter(filter.tenant)?;
    if filter.to <= filter.from {
        return Err(ApiError::invalid("`to` must be after `from`"));
    }
    Ok(filter)
}

/// Every charge as a FinOps FOCUS 1.2 dataset (CSV): per hour, key, model, price and SKU
/// (each token class, cache objects held), with list, contracted, billed and effective cost
/// (finance and platform admins: any tenant; a tenant admin: its own).
#[utoipa::path(get, path = "/v1/billing/exports/focus", tag = "billing", params(ExportFilter),
    responses((status = 200, description = "A FOCUS 1.2 dataset as CSV (RFC 4180, a header row of FOCUS column names)",
                 content((String = "text/csv"))),
              (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody)),
    security(("admin_jwt" = [])))]
pub async fn export_focus(
    State(s): State<FinanceState>,
    caller: Caller,
    filter: Result<Query<ExportFilter>, QueryRejection>,
) -> Result<Response, ApiError> {
    let filter = caller_filter(&caller, filter)?;
    let body = crate::focus::stream(s.pool.clone(), s.directory.clone(), filter);
    Ok(([(header::CONTENT_TYPE, CSV)], body).into_response())
}

/// The finance API's routes.
pub fn router(state: FinanceState) -> axum::Router {
    axum::Router::new()
        .route("/v1/billing/usage", get(usage))
        .route(
            "/v1/billing/invoices",
            get(list_invoices).post(rate_invoice),
        )
        .route("/v1/billing/invoices/{id}", get(get_invoice))
        .route("/v1/billing/prices", get(list_prices).post(add_price))
        .route(
            "/v1/billing/prices/retire",
            axum::routing::post(retire_price),
        )
        .route("/v1/billing/exports/usage", get(export_usage))
        .route("/v1/billing/exports/storage", get(export_storage))
        .route("/v1/billing/exports/focus", get(export_focus))
        .with_state(state)
}
