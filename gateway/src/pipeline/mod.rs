//! One request after validation, as named stages (`drive` reads as their list): `plan` →
//! `reserve_prompt` (the KV budget) → `lookup` (the fabric's longest cached prefix) →
//! `coalesce` (wait for another request's prefill of the same blocks) → `miss_reasons` →
//! `diagnosis` → `admit` → `budget_exports` → `take_worker` (the model's lane, the tenant's
//! fair turn) → `generate_off_runtime` (`generate`: prefill, fabric writes, usage,
//! decode) → `record_finished` (the meter).
//!
//! - `generate`: the blocking part, on one thread;
//! - `connector`: engines with their own KV connector (vLLM).
//!
//! It runs in its own task, so a client that disconnects still gets its usage metered (with
//! `client_disconnected` and the tokens produced so far); the HTTP handler only turns
//! [`Event`]s into a JSON body or SSE.

use std::sync::Arc;

use billing::{UsageEvent, UsageStatus};
use cache_fabric::{ChainLink, EntryKind, Holding, PrefixKeys, PrefixRead, PutBlock};
use cachet_common::{RequestId, Scope, Ttl};
use chrono::{DateTime, Utc};
use engine::{
    ConnectorParams, ConnectorWrite, Engine, EngineError, GenerateRequest, Generation, KvBlock,
    KvPath, Sampling, StopReason, TextStream,
};
use tokio::sync::mpsc;

use crate::admission::{Ask, Decision, RateHeaders};
use crate::coalesce::{Claim, Leader, Waited};
use crate::diagnostics;
use crate::error::{ApiError, ErrorCode};
use crate::metrics;
use crate::render::Prepared;
use crate::state::AppState;
use crate::usage::{self, TokenUsage};
use crate::wire::types::{BreakpointReport, CacheReport, Usage};
use control::tenants::Principal;
pub use generate::imported_kv;
use generate::{Finished, generate};
use work::{Answer, Entries, Held, Prompt, Work};

mod connector;
mod generate;
mod work;

pub struct Job {
    pub request_id: RequestId,
    pub started_at: DateTime<Utc>,
    pub start: tokio::time::Instant,
    pub principal: Arc<Principal>,
    pub engine: Arc<dyn Engine>,
    pub prepared: Prepared,
    pub max_tokens: u32,
    /// Streamed responses get a delta per token; others one delta with the whole text.
    pub stream: bool,
    pub stop_sequences: Vec<String>,
    pub sampling: Sampling,
    /// Cache diagnostics asked for (the beta header): this request's message id, and the
    /// message to compare with.
    pub diagnose: Option<Diagnose>,
}

pub struct Diagnose {
    pub message_id: String,
    pub previous: Option<String>,
}

pub enum Event {
    Start {
        usage: Usage,
        report: CacheReport,
        rate: RateHeaders,
        /// `{"cache_miss_reason": …}` when diagnostics were asked for.
        diagnostics: Option<serde_json::Value>,
    },
    Delta(String),
    Done {
        stop_reason: StopReason,
        output_tokens: u64,
    },
    Error(ApiError),
}

/// Start a job; its events arrive on the returned channel.
///
/// The channel is unbounded on purpose: generation never waits for the client. A slow
/// reader (or one that stops reading) would otherwise hold an engine worker for as long as
/// it liked; instead its events queue here, bounded by `max_tokens` deltas, and the worker
/// goes back to the pool as soon as decoding ends. The server's write-stall timeout closes
/// a connection that stops taking bytes altogether.
pub fn spawn(state: AppState, job: Job) -> mpsc::UnboundedReceiver<Event> {
    let (tx, rx) = mpsc::unbounded_channel();
    // A child of the request's span (request id, tenant, workspace), which the task
    // outlives when the client goes away.
    // It names its tenant itself: in an exported trace each span stands on its own.
    let scope = &job.principal;
    let span = tracing::info_span!(
        "pipeline",
        model = %job.engine.info().id,
        tenant_id = %scope.tenant,
        workspace_id = %scope.workspace,
        input_tokens = tracing::field::Empty,
        cache_read_input_tokens = tracing::field::Empty,
        cache_creation_input_tokens = tracing::field::Empty,
        output_tokens = tracing::field::Empty,
    );
    tokio::spawn(tracing::Instrument::instrument(drive(state, job, tx), span));
    rx
}

/// Bytes of KV a prefill from `cached` exports to write `targets`.
fn export_bytes(keys: &PrefixKeys, cached: usize, targets: &[usize], bytes_per_token: u64) -> u64 {
    usage::export_links(keys, cached, targets)
        .iter()
        .map(|l| (l.end - l.start) as u64 * bytes_per_token)
        .sum()
}

/// The breakpoint targets whose exported blocks fit in `budget` bytes (the nearest first),
/// and those left out.
fn fit_budget(
    keys: Option<&PrefixKeys>,
    cached: usize,
    mut targets: Vec<usize>,
    bytes_per_token: u64,
    budget: u64,
) -> (Vec<usize>, Vec<usize>) {
    let Some(k) = keys else {
        return (targets, Vec::new());
    };
    if export_bytes(k, cached, &targets, bytes_per_token) <= budget {
        return (targets, Vec::new());
    }
    targets.sort_unstable();
    let mut kept = Vec::with_capacity(targets.len());
    let mut left = Vec::new();
    for t in targets {
        kept.push(t);
        if !left.is_empty() || export_bytes(k, cached, &kept, bytes_per_token) > budget {
            kept.pop();
            left.push(t);
        }
    }
    (kept, left)
}

/// One request, as the list of its stages. A stage that refuses ends the request with its
/// error (nothing was generated, so nothing is metered); once a worker is held, the request
/// is generated and metered whatever happens.
async fn drive(state: AppState, mut job: Job, tx: mpsc::UnboundedSender<Event>) {
    let plan = plan(
        &job.principal,
        job.engine.info(),
        job.prepared.keys.take(),
        &job.prepared.placed,
        job.prepared.rendered.tokens.len(),
    );
    let ready = match get_ready(&state, &plan, &job).await {
        Ok(ready) => ready,
        Err(e) => {
            let _ = tx.send(Event::Error(e));
            return;
        }
    };
    let meter = Meter {
        request_id: job.request_id,
        principal: job.principal.clone(),
        model: plan.info.id.clone(),
        started_at: job.started_at,
    };
    let max_tokens = job.max_tokens;
    let (work, ticket) = work(&state, job, plan, ready, &meter, &tx);
    let done = generate_off_runtime(work, meter).await;
    if let Some(last) = done.last {
        let _ = tx.send(last);
    }
    state
        .admission
        .refund_output(ticket, (max_tokens as u64).saturating_sub(done.output))
        .await;
}

/// The stages that may refuse a request, in order: its KV reserved, the prefix looked up (or
/// joined in flight), why breakpoints missed, admission, the export budget, and a worker.
async fn get_ready(state: &AppState, plan: &Plan, job: &Job) -> Result<Ready, ApiError> {
    let Prepared {
        rendered,
        placed,
        upto,
        ..
    } = &job.prepared;
    let (start, max_tokens) = (job.start, job.max_tokens);
    let reserved = reserve_prompt(state, plan, *upto).await?;
    let found = lookup(state, plan, reserved.upto, start).await;
    let found = coalesce(state, plan, found, reserved.upto, start).await;
    let miss_reason = miss_reasons(state, plan, placed, found.read.tokens, start).await;
    let diagnosis = job
        .diagnose
        .as_ref()
        .map(|d| diagnosis(state, plan, d, rendered, &found, &miss_reason));
    let admitted = admit(state, &job.principal, plan, found.read.tokens, max_tokens).await?;
    let budgeted = budget_exports(state, plan, reserved.kv, found.read.tokens).await;
    let (kv, permit) = match take_worker(state, &job.principal, plan, budgeted.kv).await {
        Ok(held) => held,
        Err(e) => {
            state
                .admission
                .refund_output(admitted.ticket, max_tokens as u64)
                .await;
            return Err(e);
        }
    };
    Ok(Ready {
        found,
        miss_reason,
        diagnosis,
        admitted,
        targets: budgeted.targets,
        trimmed: budgeted.trimmed,
        kv,
        permit,
    })
}

/// What the blocking part of a ready request works from, and its admission to refund.
fn work(
    state: &AppState,
    job: Job,
    plan: Plan,
    ready: Ready,
    meter: &Meter,
    tx: &mpsc::UnboundedSender<Event>,
) -> (Work, crate::admission::Ticket) {
    let Job {
        request_id,
        start,
        engine,
        prepared,
        max_tokens,
        stream,
        stop_sequences,
        sampling,
        ..
    } = job;
    let Ready {
        found,
        miss_reason,
        diagnosis,
        admitted,
        targets,
        trimmed,
        kv,
        permit,
    } = ready;
    let prompt = Prompt {
        engine,
        model: plan.info.id.clone(),
        tokens: prepared.rendered.tokens,
        keys: plan.keys.clone(),
        read: found.read,
        targets,
        block_size: plan.info.block_size,
        sampling,
        max_tokens,
        connector: plan.connector.clone(),
    };
    let entries = Entries {
        scope: plan.scope,
        placed: prepared.placed,
        miss_reason,
        trimmed,
        coalesced_from: found.coalesced_from,
        start,
        request_id,
    };
    let held = Held {
        kv: Some(kv),
        flight: found.flight,
        permit,
    };
    let answer = Answer {
        tx: tx.clone(),
        rate: admitted.rate,
        stops: stop_sequences,
        streaming: stream,
        intent: stream.then(|| meter.event(TokenUsage::default(), 0, UsageStatus::Failed)),
        diagnosis,
    };
    let work = Work {
        state: state.clone(),
        prompt,
        entries,
        held,
        answer,
    };
    (work, admitted.ticket)
}

/// A request past every refusal: what it found, what it was admitted and given.
struct Ready {
    found: Found,
    miss_reason: Vec<Option<String>>,
    diagnosis: Option<(String, diagnostics::Fingerprint, serde_json::Value)>,
    admitted: Admitted,
    targets: Vec<usize>,
    trimmed: Vec<usize>,
    kv: crate::budget::KvReservation,
    permit: crate::engines::EnginePermit,
}

/// What every stage reads: the scope, the model, the prompt's keys and breakpoint targets.
struct Plan {
    scope: Scope,
    info: engine::ModelInfo,
    /// The key space of an engine with its own KV connector (vLLM), which loads and saves its
    /// KV with the node beside it: no KV passes through here, so none is reserved, read or
    /// coalesced on.
    connector: Option<String>,
    keys: Option<Arc<PrefixKeys>>,
    /// Token offsets of the cacheable breakpoints.
    targets: Vec<usize>,
    /// Prompt tokens.
    total: usize,
    /// KV bytes per token.
    bpt: u64,
}

fn plan(
    p: &Principal,
    info: &engine::ModelInfo,
    keys: Option<PrefixKeys>,
    placed: &[usage::Placed],
    total: usize,
) -> Plan {
    Plan {
        scope: Scope {
            tenant: p.tenant,
            workspace: p.workspace,
        },
        connector: match &info.kv_path {
            KvPath::Connector { key_space } => Some(key_space.clone()),
            KvPath::Gateway => None,
        },
        keys: keys.map(Arc::new),
        targets: placed
            .iter()
            .filter(|p| p.cacheable)
            .map(|p| p.offset)
            .collect(),
        total,
        bpt: info.kv.bytes_per_token() as u64,
        info: info.clone(),
    }
}

/// The prompt's KV reservation, and how far the prefix may be read under it.
struct Reserved {
    kv: Option<crate::budget::KvReservation>,
    upto: usize,
}

/// The prompt's KV (at most the whole budget) is reserved before reading, and no more is
/// read: imported blocks live until the prefill ends (a cluster node's pulls in buffers of
/// their own; a local read's blocks may be evicted from the tier meanwhile).
async fn reserve_prompt(state: &AppState, plan: &Plan, upto: usize) -> Result<Reserved, ApiError> {
    if plan.keys.is_none() || plan.connector.is_some() {
        return Ok(Reserved { kv: None, upto });
    }
    // Imports and exports cover the prompt once, plus a partial tail block per breakpoint
    // that ends inside a block (written as an entry of its own).
    let most = (plan.total + plan.targets.len() * plan.info.block_size) as u64 * plan.bpt;
    let kv = state
        .kv_budget
        .reserve(most.min(state.kv_budget.total()))
        .await?;
    Ok(Reserved {
        kv: Some(kv),
        upto: upto.min((state.kv_budget.total() / plan.bpt.max(1)) as usize),
    })
}

/// What the fabric holds of the prompt, after waiting on another request's prefill.
struct Found {
    read: PrefixRead,
    /// This request's claim on the blocks it will compute.
    flight: Option<Leader>,
    /// The cached prefix before the wait, if the wait added to it.
    coalesced_from: Option<usize>,
}

/// The longest cached prefix (staged on the node beside a connector engine).
async fn lookup(state: &AppState, plan: &Plan, upto: usize, start: tokio::time::Instant) -> Found {
    let read = match &plan.keys {
        Some(k) if plan.connector.is_some() => PrefixRead {
            tokens: state.fabric.stage_prefix(plan.scope, k, upto, start).await,
            ..PrefixRead::default()
        },
        Some(k) => state.fabric.read_prefix(plan.scope, k, upto, start).await,
        None => PrefixRead::default(),
    };
    Found {
        read,
        flight: None,
        coalesced_from: None,
    }
}

/// In-flight coalescing: if another request of this scope is computing our next blocks,
/// wait for its write and read them (bounded); else claim them ourselves.
async fn coalesce(
    state: &AppState,
    plan: &Plan,
    mut found: Found,
    upto: usize,
    start: tokio::time::Instant,
) -> Found {
    let Some(k) = plan
        .keys
        .as_ref()
        .filter(|_| state.config.coalesce && plan.connector.is_none())
    else {
        return found;
    };
    for _ in 0..3 {
        let links = usage::export_links(k, found.read.tokens, &plan.targets);
        match state
            .inflight
            .claim(&plan.info.id, &links, plan.total - found.read.tokens)
        {
            Claim::Lead(l) => {
                found.flight = Some(l);
                break;
            }
            Claim::None => break,
            Claim::Follow(f) => {
                if f.wait().await == Waited::Landed {
                    let again = state.fabric.read_prefix(plan.scope, k, upto, start).await;
                    if again.tokens > found.read.tokens {
                        found.coalesced_from.get_or_insert(found.read.tokens);
                        found.read = again;
                    }
                }
            }
        }
    }
    found
}

/// Why each breakpoint past the cached prefix had no entry.
async fn miss_reasons(
    state: &AppState,
    plan: &Plan,
    placed: &[usage::Placed],
    cached: usize,
    start: tokio::time::Instant,
) -> Vec<Option<String>> {
    let mut reasons = vec![None; placed.len()];
    if let Some(k) = &plan.keys {
        for (i, pl) in placed.iter().enumerate() {
            if pl.cacheable && pl.offset > cached {
                let why = state
                    .fabric
                    .miss_reason(plan.scope, k, pl.offset, start)
                    .await;
                reasons[i] = Some(why.as_str().to_string());
            }
        }
    }
    reasons
}

/// Cache diagnostics (the beta): this prompt compared with the named earlier message's
/// fingerprint.
fn diagnosis(
    state: &AppState,
    plan: &Plan,
    d: &Diagnose,
    r: &engine::Rendered,
    found: &Found,
    miss_reason: &[Option<String>],
) -> (String, diagnostics::Fingerprint, serde_json::Value) {
    let fp = diagnostics::Fingerprint {
        scope: plan.scope,
        model: plan.info.id.clone(),
        tokens: r.tokens.as_slice().into(),
        tools_end: r.tool_ends.last().copied().unwrap_or(0),
        system_end: r.system_ends.last().copied().unwrap_or(0),
        cached_end: 0,
    };
    let reason = match &d.previous {
        Some(id) => {
            let prev = state.fingerprints.get(id);
            let gone = miss_reason.iter().flatten().next().cloned();
            diagnostics::cache_miss_reason(prev.as_ref(), &fp, found.read.tokens, gone.as_deref())
        }
        None => serde_json::Value::Null,
    };
    (d.message_id.clone(), fp, reason)
}

/// Admitted: the rate-limit headers to answer with, and the ticket that refunds unused output.
struct Admitted {
    rate: RateHeaders,
    ticket: crate::admission::Ticket,
}

/// Admission on uncached input (reads never count) and reserved output; 429 when refused.
async fn admit(
    state: &AppState,
    principal: &Principal,
    plan: &Plan,
    cached: usize,
    max_tokens: u32,
) -> Result<Admitted, ApiError> {
    let ask = Ask {
        principal,
        input_tokens: (plan.total - cached) as u64,
        output_tokens: max_tokens as u64,
    };
    match state.admission.admit(&ask).await {
        (Decision::Allowed(rate), ticket) => Ok(Admitted { rate, ticket }),
        (
            Decision::Denied {
                retry_after_secs,
                message,
                headers,
                ..
            },
            _,
        ) => {
            let mut e = ApiError::new(ErrorCode::RateLimit, message)
                .with_header("retry-after", &retry_after_secs.to_string());
            for (k, v) in &headers.0 {
                e = e.with_header(k, v);
            }
            Err(e)
        }
    }
}

/// The breakpoints to write and the KV reserved for the request's imports and exports.
struct Budgeted {
    kv: Result<crate::budget::KvReservation, ApiError>,
    targets: Vec<usize>,
    /// Breakpoints left unwritten because their blocks alone exceed the KV budget.
    trimmed: Vec<usize>,
}

/// The KV this request exports must fit the KV memory budget: breakpoints whose blocks alone
/// exceed all of it are not written; the rest is reserved (a bounded wait, or 529). The
/// prompt's reservation already holds the imports.
async fn budget_exports(
    state: &AppState,
    plan: &Plan,
    kv: Option<crate::budget::KvReservation>,
    cached: usize,
) -> Budgeted {
    let imported = if kv.is_some() {
        cached as u64 * plan.bpt
    } else {
        0
    };
    let (targets, trimmed) = fit_budget(
        plan.keys.as_deref(),
        cached,
        plan.targets.clone(),
        plan.bpt,
        kv.as_ref()
            .map_or(state.kv_budget.total(), |r| r.bytes())
            .saturating_sub(imported),
    );
    if !trimmed.is_empty() {
        metrics::KV_BUDGET_TRIMMED
            .with_label_values(&[plan.info.id.as_str()])
            .inc_by(trimmed.len() as u64);
    }
    let need = plan
        .keys
        .as_deref()
        .map_or(0, |k| export_bytes(k, cached, &targets, plan.bpt));
    let kv = match kv {
        Some(mut held) => {
            held.shrink_to(imported + need);
            Ok(held)
        }
        None => state.kv_budget.reserve(need).await,
    };
    Budgeted {
        kv,
        targets,
        trimmed,
    }
}

/// An engine worker of this model, in the tenant's fair turn, or 529 at once.
async fn take_worker(
    state: &AppState,
    principal: &Principal,
    plan: &Plan,
    kv: Result<crate::budget::KvReservation, ApiError>,
) -> Result<(crate::budget::KvReservation, crate::engines::EnginePermit), ApiError> {
    let kv = kv?;
    let share = crate::engines::Share::of(principal.tenant, &principal.policy);
    let permit = state.engines.acquire(&plan.info.id, share).await?;
    Ok((kv, permit))
}

/// Prefill, fabric writes (async calls driven with `block_on`), usage and `message_start`,
/// decoding, then the usage event's journal fsync, on one blocking thread: one hand-off
/// there and back (an fsync on a runtime worker would also hand that worker's core to
/// another thread while it waits). The engine worker is free again before the fsync. The
/// blocking thread and the tasks it spawns log in this request's span too.
async fn generate_off_runtime(work: Work, meter: Meter) -> Finished {
    let inflight = Generating::start();
    let rt = tokio::runtime::Handle::current();
    let span = tracing::Span::current();
    let state = work.state.clone();
    let finish = move || {
        // A panic in generation still answers (500) and records its (failed) usage.
        let done = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| generate(work, &rt)))
            .unwrap_or_else(|panic| Finished::internal_failure(panic_message(panic.as_ref())));
        drop(inflight);
        tracing::Span::current().record("output_tokens", done.output);
        let ev = meter.event(done.usage, done.output, done.status);
        rt.block_on(record_finished(&state, ev, done.unserved));
        done
    };
    match tokio::task::spawn_blocking(move || span.in_scope(finish)).await {
        Ok(done) => done,
        Err(e) => Finished::internal_failure(e),
    }
}

/// `cachet_gateway_engine_inflight` while a generation runs, however its thread ends.
struct Generating;

impl Generating {
    fn start() -> Self {
        metrics::ENGINE_INFLIGHT.inc();
        Self
    }
}

impl Drop for Generating {
    fn drop(&mut self) {
        metrics::ENGINE_INFLIGHT.dec();
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic without a message")
}

/// The usage event of this request, as the meter records it.
struct Meter {
    request_id: RequestId,
    principal: Arc<Principal>,
    model: String,
    started_at: DateTime<Utc>,
}

impl Meter {
    fn event(&self, u: TokenUsage, output: u64, status: UsageStatus) -> UsageEvent {
        UsageEvent {
            request_id: self.request_id,
            tenant_id: self.principal.tenant,
            workspace_id: self.principal.workspace,
            api_key_id: self.principal.key_id,
            model: self.model.clone(),
            input_tokens: u.input,
            cache_write_5m_tokens: u.write_5m,
            cache_write_1h_tokens: u.write_1h,
            cache_read_tokens: u.read,
            output_tokens: output,
            status,
            started_at: self.started_at,
            finished_at: Utc::now(),
        }
    }
}

/// The usage event goes to the meter before the response ends, so a client that has read
/// the whole response can rely on its ledger row being on its way.
async fn record_finished(state: &AppState, ev: UsageEvent, unserved: bool) {
    tracing::debug!(
        input = ev.input_tokens,
        cache_read = ev.cache_read_tokens,
        cache_write = ev.cache_write_5m_tokens + ev.cache_write_1h_tokens,
        output = ev.output_tokens,
        status = ev.status.as_str(),
        "request finished"
    );
    if unserved {
        tracing::warn!("the engine was unreachable; answered 529 and recorded no usage");
    } else if ev.status == UsageStatus::ClientDisconnected && state.config.internal_token.is_some()
    {
        // Our client is a gateway, which may be resuming this stream on another node: that
        // node's complete row must be the request's row, so ours waits (durably journaled).
        state
            .meter
            .record_durable_after(ev, state.config.resume_grace);
    } else {
        record(state, ev).await;
    }
}

/// Every role answers only once the usage is durable: fsynced to the meter's local journal
/// (one grouped fsync), so a process killed after answering has lost no ledger row; the
/// Postgres insert follows asynchronously and is replayed from the journal after a crash.
async fn record(state: &AppState, ev: UsageEvent) {
    let id = ev.request_id;
    if let Err(e) = state.meter.record_durable(ev).await {
        tracing::error!(request_id = %id, error = %e, "usage event could not be recorded");
    }
}
