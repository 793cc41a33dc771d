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

use std::collections::HashMap;
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
use futures::TryStreamExt;
use serde::{Deserialize, Serialize};
use sqlx::{PgPool, Row};
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

use cachet_common::TenantId;
use cachet_common::error::{ApiError, ErrorBody, ErrorCode};
use identity::{AdminAuth, Claims, Role};

use crate::directory::{Directory, TenantNames};
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

/// Export format.
#[derive(Clone, Copy, Debug, Deserialize, ToSchema, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    Csv,
    Jsonl,
    Cloudevents,
}

/// An export's format (a query parameter beside its [`ExportFilter`]).
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ExportFormat {
    /// `csv` (RFC 4180), `jsonl`, or `cloudevents` (JSON Lines of CloudEvents 1.0).
    pub format: Format,
}

/// Which ledger rows an export holds (its query parameters).
#[derive(Clone, Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ExportFilter {
    /// Start (inclusive), RFC 3339.
    pub from: DateTime<Utc>,
    /// End (exclusive), RFC 3339.
    pub to: DateTime<Utc>,
    pub tenant: Option<Uuid>,
    /// Only this workspace's rows.
    pub workspace: Option<Uuid>,
    /// Only this API key's rows.
    pub api_key: Option<Uuid>,
    /// Only this model's rows.
    pub model: Option<String>,
}

pub use crate::csv::field as csv_field;

/// What every exported row carries after its own columns: the names of its tenant, workspace
/// and key, and its cost: the row rated at its own start time with the tenant's prices, exact
/// (in nano-units, as invoice lines carry it; `null` where no price covered the model).
#[derive(Debug, Default, Serialize)]
pub struct Named {
    pub tenant_name: Option<String>,
    pub workspace_name: Option<String>,
    pub api_key_name: Option<String>,
    pub currency: Option<String>,
    pub cost_exact_nanos: Option<String>,
}

/// The CSV columns of [`Named`], last in every export's header.
const NAMED_CSV_COLUMNS: &str = "tenant_name,workspace_name,api_key_name,currency,cost_exact_nanos";

/// A ledger row for exports.
#[derive(Debug, Serialize, sqlx::FromRow)]
pub struct LedgerRow {
    pub request_id: Uuid,
    pub tenant_id: Uuid,
    pub workspace_id: Uuid,
    pub api_key_id: Uuid,
    pub model: String,
    #[serde(flatten)]
    #[sqlx(flatten)]
    pub tokens: TokenCounts,
    pub status: String,
    pub started_at: DateTime<Utc>,
    pub finished_at: DateTime<Utc>,
    #[serde(flatten)]
    #[sqlx(skip)]
    pub named: Named,
}

/// A row an export streams: its own columns, what it is rated on, and its event; the one
/// writer ([`encode`]) and the one stream ([`stream_rows`]) do the rest.
trait ExportRow:
    Serialize + Send + Unpin + 'static + for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow>
{
    /// The row's own CSV columns ([`NAMED_CSV_COLUMNS`] follow).
    const CSV_COLUMNS: &'static str;
    /// Its CloudEvents type.
    const EVENT_TYPE: &'static str;
    fn named(&mut self) -> &mut Named;
    /// Its tenant, workspace and key.
    fn owners(&self) -> (Uuid, Uuid, Uuid);
    /// What it is rated on: the model, when, and what was metered.
    fn metered(&self) -> (&str, DateTime<Utc>, crate::dashboard::Tokens);
    /// Its own CSV fields, in [`Self::CSV_COLUMNS`]' order, each followed by a comma.
    fn write_csv(&self, out: &mut Vec<u8>);
    /// Its CloudEvents id and time.
    fn event(&self) -> (String, String);
}

impl ExportRow for LedgerRow {
    const CSV_COLUMNS: &'static str = "request_id,tenant_id,workspace_id,api_key_id,model,input_tokens,cache_write_5m_tokens,cache_write_1h_tokens,cache_read_tokens,output_tokens,status,started_at,finished_at";
    const EVENT_TYPE: &'static str = "dev.cachet.usage.v1";
    fn named(&mut self) -> &mut Named {
        &mut self.named
    }
    fn owners(&self) -> (Uuid, Uuid, Uuid) {
        (self.tenant_id, self.workspace_id, self.api_key_id)
    }
    fn metered(&self) -> (&str, DateTime<Utc>, crate::dashboard::Tokens) {
        let tokens = crate::dashboard::Tokens {
            requests: 1,
            counts: self.tokens,
            cache_storage_token_seconds: 0,
        };
        (&self.model, self.started_at, tokens)
    }
    fn write_csv(&self, out: &mut Vec<u8>) {
        use std::io::Write;
        let _ = write!(
            out,
            "{},{},{},{},{},{},{},{},{},{},{},{},{},",
            self.request_id,
            self.tenant_id,
            self.workspace_id,
            self.api_key_id,
            csv_field(&self.model),
            self.tokens.input_tokens,
            self.tokens.cache_write_5m_tokens,
            self.tokens.cache_write_1h_tokens,
            self.tokens.cache_read_tokens,
            self.tokens.output_tokens,
            self.status,
            micros(self.started_at),
            micros(self.finished_at),
        );
    }
    fn event(&self) -> (String, String) {
        (self.request_id.to_string(), micros(self.started_at))
    }
}

fn micros(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
}

/// Fill in a row's names and its cost from its tenant's names and prices.
fn name_and_rate<R: ExportRow>(r: &mut R, rater: &crate::dashboard::Rater, names: &TenantNames) {
    let (model, at, metered) = r.metered();
    let cost = rater.rate(model, at, &metered);
    let currency = rater.currency(model, at).map(str::to_string);
    let (_, workspace, key) = r.owners();
    let named = r.named();
    named.tenant_name = names.tenant.clone();
    named.workspace_name = names.workspaces.get(&workspace).cloned();
    named.api_key_name = names.keys.get(&key).cloned();
    named.currency = currency;
    named.cost_exact_nanos = (cost.unpriced_tokens == 0).then(|| cost.actual.nanos_decimal());
}

/// The export writer: one row in `format` appended to `out`.
fn encode<R: ExportRow>(format: Format, r: &mut R, out: &mut Vec<u8>) {
    match format {
        Format::Csv => {
            r.write_csv(out);
            let n = r.named();
            let fields = [
                &n.tenant_name,
                &n.workspace_name,
                &n.api_key_name,
                &n.currency,
                &n.cost_exact_nanos,
            ];
            for (i, v) in fields.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                out.extend_from_slice(csv_field(v.as_deref().unwrap_or("")).as_bytes());
            }
            out.extend_from_slice(b"\r\n");
        }
        Format::Jsonl => {
            let _ = serde_json::to_writer(&mut *out, r);
            out.push(b'\n');
        }
        Format::Cloudevents => {
            let (id, time) = r.event();
            let ev = serde_json::json!({
                "specversion": "1.0",
                "type": R::EVENT_TYPE,
                "source": "cachet/billing",
                "id": id,
                "subject": r.owners().0,
                "time": time,
                "datacontenttype": "application/json",
                "data": r,
            });
            let _ = serde_json::to_writer(&mut *out, &ev);
            out.push(b'\n');
        }
    }
}

/// Stream the rows `query` yields in `format`, named from `directory` and rated with each
/// tenant's prices, in chunks of about 64 KiB through a bounded channel.
fn stream_rows<R: ExportRow>(
    pool: PgPool,
    directory: Arc<dyn Directory>,
    format: Format,
    query: impl FnOnce(&PgPool) -> futures::stream::BoxStream<'_, Result<R, sqlx::Error>>
    + Send
    + 'static,
) -> Body {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<bytes::Bytes, std::io::Error>>(4);
    tokio::spawn(async move {
        let mut buf: Vec<u8> = Vec::with_capacity(80 * 1024);
        if format == Format::Csv {
            buf.extend_from_slice(format!("{},{NAMED_CSV_COLUMNS}\r\n", R::CSV_COLUMNS).as_bytes());
        }
        // Each tenant's prices and names, loaded once (an export spans few tenants next to
        // its rows).
        let mut tenants: HashMap<Uuid, (crate::dashboard::Rater, TenantNames)> = HashMap::new();
        let mut rows = query(&pool);
        loop {
            match rows.try_next().await {
                Ok(Some(mut r)) => {
                    let tenant = r.owners().0;
                    if let std::collections::hash_map::Entry::Vacant(slot) = tenants.entry(tenant) {
                        let loaded = async {
                            let rater = crate::dashboard::Rater::load(&pool, tenant).await?;
                            Ok::<_, BillingError>((rater, directory.names(tenant).await?))
                        };
                        match loaded.await {
                            Ok(t) => {
                                slot.insert(t);
                            }
                            Err(e) => {
                                tracing::error!(error = %e, "export failed loading prices or names");
                                let _ = tx
                                    .send(Err(std::io::Error::other("export failed; retry")))
                                    .await;
                                return;
                            }
                        }
                    }
                    if let Some((rater, names)) = tenants.get(&tenant) {
                        name_and_rate(&mut r, rater, names);
                    }
                    encode(format, &mut r, &mut buf);
                    if buf.len() >= 64 * 1024 {
                        let chunk = bytes::Bytes::from(std::mem::replace(
                            &mut buf,
                            Vec::with_capacity(80 * 1024),
                        ));
                        if tx.send(Ok(chunk)).await.is_err() {
                            return; // the client went away
                        }
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    tracing::error!(error = %e, "export failed mid-stream");
                    let _ = tx
                        .send(Err(std::io::Error::other("export failed; retry")))
                        .await;
                    return;
                }
            }
        }
        if !buf.is_empty() {
            let _ = tx.send(Ok(bytes::Bytes::from(buf))).await;
        }
    });
    Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
}

/// Stream the ledger rows `filter` picks in `format`, named from `directory`.
pub fn export_stream(
    pool: PgPool,
    directory: Arc<dyn Directory>,
    filter: ExportFilter,
    format: Format,
) -> Body {
    let sql = export_sql(
        "e.request_id, e.tenant_id, e.workspace_id, e.api_key_id, e.model, e.input_tokens, \
         e.cache_write_5m_tokens, e.cache_write_1h_tokens, e.cache_read_tokens, \
         e.output_tokens, e.status, e.started_at, e.finished_at",
        "usage_events",
        "started_at",
        "e.started_at, e.request_id",
    );
    stream_rows::<LedgerRow>(pool, directory, format, move |pool| {
        fetch_filtered(pool, sql, filter)
    })
}

/// The rows of `table` (as `e`) an export picks: `columns`, by `at` within the filter's window
/// and its other filters (binds [`fetch_filtered`] makes), in `order`.
fn export_sql(columns: &str, table: &str, at: &str, order: &str) -> sqlx::AssertSqlSafe<String> {
    sqlx::AssertSqlSafe(format!(
        "SELECT {columns}
         FROM {table} e
         WHERE e.{at} >= $1 AND e.{at} < $2
           AND ($3::UUID IS NULL OR e.tenant_id = $3)
           AND ($4::UUID IS NULL OR e.workspace_id = $4)
           AND ($5::UUID IS NULL OR e.api_key_id = $5)
           AND ($6::TEXT IS NULL OR e.model = $6)
         ORDER BY {order}"
    ))
}

/// The rows of an [`export_sql`] query with `filter` bound.
fn fetch_filtered<R: ExportRow>(
    pool: &PgPool,
    sql: sqlx::AssertSqlSafe<String>,
    filter: ExportFilter,
) -> futures::stream::BoxStream<'_, Result<R, sqlx::Error>> {
    sqlx::query_as::<_, R>(sql)
        .bind(filter.from)
        .bind(filter.to)
        .bind(filter.tenant)
        .bind(filter.workspace)
        .bind(filter.api_key)
        .bind(filter.model)
        .fetch(pool)
}

/// An hour of a cache object held (the storage ledger, `cache_storage_events`), for exports.
#[derive(Debug, Serialize, sqlx::FromRow)]
pub struct StorageRow {
    pub object_id: String,
    pub hour_start: DateTime<Utc>,
    pub tenant_id: Uuid,
    pub workspace_id: Uuid,
    pub api_key_id: Uuid,
    pub model: String,
    pub tokens: i64,
    pub seconds: i32,
    pub token_seconds: i64,
    #[serde(flatten)]
    #[sqlx(skip)]
    pub named: Named,
}

impl StorageRow {
    fn hour(&self) -> String {
        self.hour_start
            .to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
    }
}

impl ExportRow for StorageRow {
    const CSV_COLUMNS: &'static str =
        "object_id,hour_start,tenant_id,workspace_id,api_key_id,model,tokens,seconds,token_seconds";
    const EVENT_TYPE: &'static str = "dev.cachet.cache_storage.v1";
    fn named(&mut self) -> &mut Named {
        &mut self.named
    }
    fn owners(&self) -> (Uuid, Uuid, Uuid) {
        (self.tenant_id, self.workspace_id, self.api_key_id)
    }
    fn metered(&self) -> (&str, DateTime<Utc>, crate::dashboard::Tokens) {
        let held = crate::dashboard::Tokens {
            cache_storage_token_seconds: self.token_seconds,
            ..Default::default()
        };
        (&self.model, self.hour_start, held)
    }
    fn write_csv(&self, out: &mut Vec<u8>) {
        use std::io::Write;
        let _ = write!(
            out,
            "{},{},{},{},{},{},{},{},{},",
            self.object_id,
            self.hour(),
            self.tenant_id,
            self.workspace_id,
            self.api_key_id,
            csv_field(&self.model),
            self.tokens,
            self.seconds,
            self.token_seconds,
        );
    }
    fn event(&self) -> (String, String) {
        // The ledger's key: one event per object and hour.
        let hour = self.hour();
        (format!("{}/{hour}", self.object_id), hour)
    }
}

/// Stream the storage rows `filter` picks (by the hour they cover) in `format`, named from
/// `directory`.
pub fn storage_export_stream(
    pool: PgPool,
    directory: Arc<dyn Directory>,
    filter: ExportFilter,
    format: Format,
) -> Body {
    let sql = export_sql(
        "e.object_id, e.hour_start, e.tenant_id, e.workspace_id, e.api_key_id, e.model, \
         e.tokens, e.seconds, e.tokens * e.seconds AS token_seconds",
        "cache_storage_events",
        "hour_start",
        "e.hour_start, e.object_id",
    );
    stream_rows::<StorageRow>(pool, directory, format, move |pool| {
        fetch_filtered(pool, sql, filter)
    })
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
    let (Query(mut filter), Query(ExportFormat { format })) = (filter?, format?);
    // A tenant admin exports its own tenant's rows only (asking for another is refused).
    filter.tenant = caller.tenant_filter(filter.tenant)?;
    if filter.to <= filter.from {
        return Err(ApiError::invalid("`to` must be after `from`"));
    }
    let content_type = match format {
        Format::Csv => "text/csv; charset=utf-8; header=present",
        Format::Jsonl => "application/jsonl",
        Format::Cloudevents => "application/cloudevents-batch+jsonl",
    };
    let body = stream(s.pool.clone(), s.directory.clone(), filter, format);
    Ok(([(header::CONTENT_TYPE, content_type)], body).into_response())
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
        .with_state(state)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_fields_follow_rfc_4180() {
        assert_eq!(csv_field("plain"), "plain");
        assert_eq!(csv_field("a,b"), "\"a,b\"");
        assert_eq!(csv_field("say \"hi\""), "\"say \"\"hi\"\"\"");
        assert_eq!(csv_field("two\r\nlines"), "\"two\r\nlines\"");
    }
}
