//! Exports: ledger rows (usage) and hours of cache objects held (storage), streamed as CSV
//! (RFC 4180), JSON Lines or CloudEvents JSON Lines, each row named (tenant, workspace, key)
//! and rated with its tenant's prices; the filter every export (FOCUS's too) is asked with.

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Body;
use chrono::{DateTime, Utc};
use futures::TryStreamExt;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

use crate::directory::{Directory, TenantNames};
use crate::invoice::BillingError;
use crate::money::TokenCounts;

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

use crate::csv::field as csv_field;

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
    /// The key's tags (its workspace's with its own on top), as they are now; a JSON object
    /// in CSV.
    pub tags: std::collections::BTreeMap<String, String>,
}

/// The CSV columns of [`Named`], last in every export's header.
const NAMED_CSV_COLUMNS: &str =
    "tenant_name,workspace_name,api_key_name,currency,cost_exact_nanos,tags";

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
    named.tags = names.key_tags.get(&key).cloned().unwrap_or_default();
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
            out.push(b',');
            let tags = serde_json::to_string(&n.tags).unwrap_or_default();
            out.extend_from_slice(csv_field(&tags).as_bytes());
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

/// A streamed body's writer: bytes gathered into chunks of about 64 KiB, each sent through a
/// bounded channel (so a slow client slows the query, never grows memory).
pub(crate) struct Chunks {
    buf: Vec<u8>,
    tx: tokio::sync::mpsc::Sender<Result<bytes::Bytes, std::io::Error>>,
}

impl Chunks {
    /// A writer and the body it feeds.
    pub(crate) fn new() -> (Self, Body) {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
        let buf = Vec::with_capacity(80 * 1024);
        (Self { buf, tx }, body)
    }

    /// Where the next bytes go.
    pub(crate) fn buf(&mut self) -> &mut Vec<u8> {
        &mut self.buf
    }

    /// Send what is gathered once it is a chunk; false when the client went away.
    pub(crate) async fn flush_full(&mut self) -> bool {
        if self.buf.len() < 64 * 1024 {
            return true;
        }
        let chunk = std::mem::replace(&mut self.buf, Vec::with_capacity(80 * 1024));
        self.tx.send(Ok(bytes::Bytes::from(chunk))).await.is_ok()
    }

    /// End the body with an error the client sees as a broken download (logged here).
    pub(crate) async fn fail(self, what: &str, e: impl std::fmt::Display + Send) {
        tracing::error!(error = %e, "{what}");
        let _ = self
            .tx
            .send(Err(std::io::Error::other("export failed; retry")))
            .await;
    }

    /// Send the rest.
    pub(crate) async fn finish(self) {
        if !self.buf.is_empty() {
            let _ = self.tx.send(Ok(bytes::Bytes::from(self.buf))).await;
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
    let (mut out, body) = Chunks::new();
    tokio::spawn(async move {
        if format == Format::Csv {
            let header = format!("{},{NAMED_CSV_COLUMNS}\r\n", R::CSV_COLUMNS);
            out.buf().extend_from_slice(header.as_bytes());
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
                                return out.fail("export failed loading prices or names", e).await;
                            }
                        }
                    }
                    if let Some((rater, names)) = tenants.get(&tenant) {
                        name_and_rate(&mut r, rater, names);
                    }
                    encode(format, &mut r, out.buf());
                    if !out.flush_full().await {
                        return; // the client went away
                    }
                }
                Ok(None) => break,
                Err(e) => return out.fail("export failed mid-stream", e).await,
            }
        }
        out.finish().await;
    });
    body
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
