//! One request after validation: fabric lookup (waiting for another request's prefill of the
//! same blocks, `coalesce`) → admission → engine prefill (importing the cached prefix,
//! exporting new blocks) → fabric writes → usage → decode → meter.
//!
//! It runs in its own task, so a client that disconnects still gets its usage metered (with
//! `client_disconnected` and the tokens produced so far); the HTTP handler only turns
//! [`Event`]s into a JSON body or SSE.

use std::sync::Arc;

use billing::{UsageEvent, UsageStatus};
use cache_fabric::{ChainLink, EntryKind, PrefixKeys, PrefixRead, PutBlock};
use cachet_common::{RequestId, Scope, Ttl};
use chrono::{DateTime, Utc};
use engine::{
    ConnectorParams, ConnectorWrite, Engine, EngineError, GenerateRequest, Generation, KvBlock,
    KvPath, Sampling, StopReason, TextStream,
};
use tokio::sync::mpsc;

use crate::AppState;
use crate::admission::{Ask, Decision, RateHeaders};
use crate::api::types::{BreakpointReport, CacheReport, Usage};
use crate::coalesce::{Claim, Leader, Waited};
use crate::diagnostics;
use crate::error::{ApiError, ErrorCode};
use crate::metrics;
use crate::render::Prepared;
use crate::usage::{self, TokenUsage};
use control::tenants::Principal;

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
    let span = tracing::info_span!(
        "request",
        request_id = %job.request_id,
        tenant_id = %job.principal.tenant,
        workspace_id = %job.principal.workspace,
        model = %job.engine.info().id,
    );
    tokio::spawn(tracing::Instrument::instrument(drive(state, job, tx), span));
    rx
}

struct Prefilled {
    generation: Box<dyn Generation>,
    /// The chain links past the cached prefix, and their exported KV.
    links: Vec<ChainLink>,
    exported: Vec<KvBlock>,
    cached: usize,
}

/// Prefill from the cached prefix; if the imported KV fails the engine's own check, recompute
/// everything rather than answer wrongly.
fn prefill(
    engine: &dyn Engine,
    tokens: &[u32],
    read: &PrefixRead,
    keys: Option<&PrefixKeys>,
    targets: &[usize],
    sampling: &Sampling,
    max_new_tokens: u32,
) -> Result<Prefilled, EngineError> {
    let attempt = |cached: usize, imported: Vec<KvBlock>| -> Result<Prefilled, EngineError> {
        // Links wholly inside the cached prefix are skipped, so targets at or before it add none.
        let links = keys
            .map(|k| usage::export_links(k, cached, targets))
            .unwrap_or_default();
        let exports = links
            .iter()
            .map(|l| engine::ExportSpec {
                hash: l.hash,
                start: l.start,
                end: l.end,
            })
            .collect();
        let mut generation = engine.start(GenerateRequest {
            tokens: tokens.to_vec(),
            imported,
            exports,
            sampling: sampling.clone(),
            max_new_tokens,
            connector: None,
        })?;
        let exported = generation.take_exports();
        Ok(Prefilled {
            generation,
            links,
            exported,
            cached,
        })
    };
    let imported: Vec<KvBlock> = read
        .links
        .iter()
        .zip(&read.blocks)
        .map(|(l, b)| KvBlock {
            hash: l.hash,
            start: l.start,
            end: l.end,
            data: b.data.clone(),
        })
        .collect();
    if imported.is_empty() {
        return attempt(0, imported);
    }
    match attempt(read.tokens, imported) {
        Err(e @ (EngineError::KvIntegrity { .. } | EngineError::InvalidImport(_))) => {
            tracing::error!(error = %e, "cached KV rejected by the engine; recomputing the prefix");
            metrics::KV_RECOMPUTES
                .with_label_values(&["integrity"])
                .inc();
            attempt(0, Vec::new())
        }
        other => other,
    }
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

fn put_blocks(exported: &[KvBlock], links: &[ChainLink]) -> Vec<PutBlock> {
    exported
        .iter()
        .map(|b| {
            let parent = links
                .iter()
                .find(|l| l.hash == b.hash)
                .and_then(|l| l.parent);
            PutBlock::new(b.hash, parent, (b.end - b.start) as u32, b.data.clone())
        })
        .collect()
}

async fn drive(state: AppState, job: Job, tx: mpsc::UnboundedSender<Event>) {
    let p = &job.principal;
    let scope = Scope {
        tenant: p.tenant,
        workspace: p.workspace,
    };
    let info = job.engine.info().clone();
    // An engine with its own KV connector (vLLM) loads and saves its KV with the node beside
    // it: no KV passes through here, so none is reserved, read or coalesced on.
    let connector = match &info.kv_path {
        KvPath::Connector { key_space } => Some(key_space.clone()),
        KvPath::Gateway => None,
    };
    let prep = job.prepared;
    let total = prep.rendered.tokens.len();
    let keys = prep.keys.map(Arc::new);

    let targets: Vec<usize> = prep
        .placed
        .iter()
        .filter(|p| p.cacheable)
        .map(|p| p.offset)
        .collect();

    // 0. The prompt's KV (at most the whole budget) is reserved before reading, and no more
    // is read: imported blocks live until the prefill ends (a cluster node's pulls in
    // buffers of their own; a local read's blocks may be evicted from the tier meanwhile).
    let bpt = info.kv.bytes_per_token() as u64;
    let mut kv = None;
    let mut upto = prep.upto;
    if keys.is_some() && connector.is_none() {
        // Imports and exports cover the prompt once, plus a partial tail block per breakpoint
        // that ends inside a block (written as an entry of its own).
        let most = (total + prep.placed.len() * info.block_size) as u64 * bpt;
        match state
            .kv_budget
            .reserve(most.min(state.kv_budget.total()))
            .await
        {
            Ok(r) => kv = Some(r),
            Err(e) => {
                let _ = tx.send(Event::Error(e));
                return;
            }
        }
        upto = upto.min((state.kv_budget.total() / bpt.max(1)) as usize);
    }

    // 1. The longest cached prefix, and why each later breakpoint had no entry.
    let mut read = match &keys {
        Some(k) if connector.is_some() => PrefixRead {
            tokens: state.fabric.stage_prefix(scope, k, upto, job.start).await,
            ..PrefixRead::default()
        },
        Some(k) => state.fabric.read_prefix(scope, k, upto, job.start).await,
        None => PrefixRead::default(),
    };
    // 1b. In-flight coalescing: if another request of this scope is computing our next
    // blocks, wait for its write and read them (bounded); else claim them ourselves.
    let mut flight = None;
    let mut coalesced_from = None;
    if let Some(k) = keys
        .as_ref()
        .filter(|_| state.config.coalesce && connector.is_none())
    {
        for _ in 0..3 {
            let links = usage::export_links(k, read.tokens, &targets);
            match state.inflight.claim(&info.id, &links, total - read.tokens) {
                Claim::Lead(l) => {
                    flight = Some(l);
                    break;
                }
                Claim::None => break,
                Claim::Follow(f) => {
                    if f.wait().await == Waited::Landed {
                        let again = state.fabric.read_prefix(scope, k, upto, job.start).await;
                        if again.tokens > read.tokens {
                            coalesced_from.get_or_insert(read.tokens);
                            read = again;
                        }
                    }
                }
            }
        }
    }
    let mut miss_reason: Vec<Option<String>> = vec![None; prep.placed.len()];
    if let Some(k) = &keys {
        for (i, pl) in prep.placed.iter().enumerate() {
            if pl.cacheable && pl.offset > read.tokens {
                miss_reason[i] = Some(
                    state
                        .fabric
                        .miss_reason(scope, k, pl.offset, job.start)
                        .await
                        .as_str()
                        .to_string(),
                );
            }
        }
    }

    // Cache diagnostics (the beta): compared with the named earlier message's fingerprint.
    let diagnosis = job.diagnose.as_ref().map(|d| {
        let r = &prep.rendered;
        let fp = diagnostics::Fingerprint {
            scope,
            model: info.id.clone(),
            tokens: r.tokens.as_slice().into(),
            tools_end: r.tool_ends.last().copied().unwrap_or(0),
            system_end: r.system_ends.last().copied().unwrap_or(0),
            cached_end: 0,
        };
        let reason = match &d.previous {
            Some(id) => {
                let prev = state.fingerprints.get(id);
                let gone = miss_reason.iter().flatten().next().cloned();
                diagnostics::cache_miss_reason(prev.as_ref(), &fp, read.tokens, gone.as_deref())
            }
            None => serde_json::Value::Null,
        };
        (d.message_id.clone(), fp, reason)
    });

    // 2. Admission on uncached input (reads never count) and reserved output.
    let ask = Ask {
        principal: p,
        input_tokens: (total - read.tokens) as u64,
        output_tokens: job.max_tokens as u64,
    };
    let (decision, ticket) = state.admission.admit(&ask).await;
    let rate = match decision {
        Decision::Allowed(h) => h,
        Decision::Denied {
            retry_after_secs,
            message,
            headers,
            ..
        } => {
            let mut e = ApiError::new(ErrorCode::RateLimit, message)
                .with_header("retry-after", &retry_after_secs.to_string());
            for (k, v) in &headers.0 {
                e = e.with_header(k, v);
            }
            let _ = tx.send(Event::Error(e));
            return;
        }
    };

    let meter = |u: TokenUsage, output: u64, status: UsageStatus| UsageEvent {
        request_id: job.request_id,
        tenant_id: p.tenant,
        workspace_id: p.workspace,
        api_key_id: p.key_id,
        model: info.id.clone(),
        input_tokens: u.input,
        cache_write_5m_tokens: u.write_5m,
        cache_write_1h_tokens: u.write_1h,
        cache_read_tokens: u.read,
        output_tokens: output,
        status,
        started_at: job.started_at,
        finished_at: Utc::now(),
    };

    // 3. The KV this request exports must fit the KV memory budget: breakpoints whose blocks
    // alone exceed all of it are not written; the rest is reserved (a bounded wait, or 529).
    // (The reservation already holds the imports.)
    let imported = if kv.is_some() {
        read.tokens as u64 * bpt
    } else {
        0
    };
    let (targets, trimmed) = fit_budget(
        keys.as_deref(),
        read.tokens,
        targets,
        bpt,
        kv.as_ref()
            .map_or(state.kv_budget.total(), |r| r.bytes())
            .saturating_sub(imported),
    );
    if !trimmed.is_empty() {
        metrics::KV_BUDGET_TRIMMED
            .with_label_values(&[info.id.as_str()])
            .inc_by(trimmed.len() as u64);
    }
    let need = keys
        .as_deref()
        .map_or(0, |k| export_bytes(k, read.tokens, &targets, bpt));
    let kv = match kv {
        Some(mut held) => {
            held.shrink_to(imported + need);
            Ok(held)
        }
        None => state.kv_budget.reserve(need).await,
    };

    // 4. An engine worker of this model, in the tenant's fair turn, or 529 at once.
    let share = crate::engines::Share::of(p.tenant, &p.policy);
    let held = match kv {
        Ok(kv) => state
            .engines
            .acquire(&info.id, share)
            .await
            .map(|permit| (kv, permit)),
        Err(e) => Err(e),
    };
    let (kv, permit) = match held {
        Ok(h) => h,
        Err(e) => {
            state
                .admission
                .refund_output(ticket, job.max_tokens as u64)
                .await;
            let _ = tx.send(Event::Error(e));
            return;
        }
    };
    metrics::ENGINE_INFLIGHT.inc();

    // 5–8 run on one blocking thread: prefill, the fabric writes (async calls driven with
    // `block_on`), usage and `message_start`, then decoding. One hand-off, not three.
    let work = Work {
        state: state.clone(),
        engine: job.engine.clone(),
        tokens: prep.rendered.tokens,
        placed: prep.placed,
        miss_reason,
        keys,
        read,
        targets,
        trimmed,
        kv: Some(kv),
        permit,
        sampling: job.sampling,
        scope,
        start: job.start,
        max_tokens: job.max_tokens,
        stops: job.stop_sequences,
        streaming: job.stream,
        rate,
        tx: tx.clone(),
        intent: job
            .stream
            .then(|| meter(TokenUsage::default(), 0, UsageStatus::Failed)),
        block_size: info.block_size,
        model: info.id.clone(),
        request_id: job.request_id,
        connector,
        flight,
        coalesced_from,
        diagnosis,
    };
    let rt = tokio::runtime::Handle::current();
    // The blocking thread and the tasks it spawns log in this request's span too.
    let span = tracing::Span::current();
    let outcome = tokio::task::spawn_blocking(move || span.in_scope(|| generate(work, &rt))).await;
    metrics::ENGINE_INFLIGHT.dec();
    let done = outcome.unwrap_or_else(|e| Finished {
        unserved: false,
        usage: TokenUsage::default(),
        output: 0,
        status: UsageStatus::Failed,
        last: Some(Event::Error(ApiError::internal(
            "generation task failed",
            e,
        ))),
    });
    // The usage event is handed to the meter before the response ends, so a client that has
    // read the whole response can rely on its ledger row being on its way.
    let ev = meter(done.usage, done.output, done.status);
    if done.unserved {
        tracing::warn!("the engine was unreachable; answered 529 and recorded no usage");
    } else if done.status == UsageStatus::ClientDisconnected
        && state.config.internal_token.is_some()
    {
        // Our client is a gateway, which may be resuming this stream on another node: that
        // node's complete row must be the request's row, so ours waits (durably journaled).
        state
            .meter
            .record_durable_after(ev, state.config.resume_grace);
    } else {
        record(&state, ev).await;
    }
    if let Some(last) = done.last {
        let _ = tx.send(last);
    }
    state
        .admission
        .refund_output(ticket, (job.max_tokens as u64).saturating_sub(done.output))
        .await;
}

/// How the blocking part ended, and the event that ends the response (sent after metering).
struct Finished {
    /// The engine could not be reached before it did any work (nothing to bill): no ledger
    /// row, so that a routing gateway's retry of this request id on another node is the
    /// request's one row (the ledger keeps the first row of a request id).
    unserved: bool,
    usage: TokenUsage,
    output: u64,
    status: UsageStatus,
    last: Option<Event>,
}

/// Everything the blocking part of a request needs.
struct Work {
    state: AppState,
    engine: Arc<dyn Engine>,
    tokens: Vec<u32>,
    placed: Vec<usage::Placed>,
    miss_reason: Vec<Option<String>>,
    keys: Option<Arc<PrefixKeys>>,
    read: PrefixRead,
    targets: Vec<usize>,
    /// Breakpoints left unwritten because their blocks alone exceed the KV budget.
    trimmed: Vec<usize>,
    /// This request's share of the KV budget: held until its blocks are written.
    kv: Option<crate::budget::KvReservation>,
    /// Its engine worker: offered to requests owed a turn between tokens, released at the end.
    permit: crate::engines::EnginePermit,
    sampling: Sampling,
    scope: Scope,
    start: tokio::time::Instant,
    max_tokens: u32,
    stops: Vec<String>,
    streaming: bool,
    rate: RateHeaders,
    tx: mpsc::UnboundedSender<Event>,
    /// A streamed request's usage event, journaled with its prompt usage before the 200.
    intent: Option<UsageEvent>,
    block_size: usize,
    model: String,
    request_id: RequestId,
    /// The key space of an engine with its own KV connector ([`KvPath::Connector`]).
    connector: Option<String>,
    /// This request's claim on the blocks it computes: landed once they are written, so
    /// requests waiting on them read them.
    flight: Option<Leader>,
    /// The cached prefix before waiting on another request's prefill, if that wait added
    /// to it (those breakpoints are reported `coalesced`).
    coalesced_from: Option<usize>,
    /// With cache diagnostics: this request's message id, its fingerprint (kept once its
    /// entries are written) and the miss reason to report.
    diagnosis: Option<(String, diagnostics::Fingerprint, serde_json::Value)>,
}

/// Prefill, write, report, decode. Returns the prompt usage, output tokens and how it ended.
fn generate(mut w: Work, rt: &tokio::runtime::Handle) -> Finished {
    let finished = |usage, output, status, last| Finished {
        unserved: false,
        usage,
        output,
        status,
        last,
    };
    let prefill_started = std::time::Instant::now();
    let started = match &w.connector {
        Some(space) => prefill_with_connector(&w, space, rt),
        None => prefill(
            w.engine.as_ref(),
            &w.tokens,
            &w.read,
            w.keys.as_deref(),
            &w.targets,
            &w.sampling,
            w.max_tokens,
        ),
    };
    let pre = match started {
        Ok(p) => p,
        Err(EngineError::Unavailable(why)) => {
            let err = Event::Error(engine_error(
                "prefill failed",
                EngineError::Unavailable(why),
            ));
            return Finished {
                unserved: true,
                ..finished(TokenUsage::default(), 0, UsageStatus::Failed, Some(err))
            };
        }
        Err(e) => {
            let err = Event::Error(engine_error("prefill failed", e));
            return finished(TokenUsage::default(), 0, UsageStatus::Failed, Some(err));
        }
    };
    // The imported blocks are in the engine now: let go of them (they may be all that still
    // holds a block the fabric has since evicted).
    w.read = PrefixRead::default();
    let took = prefill_started.elapsed();
    metrics::PREFILL_SECONDS
        .with_label_values(&[w.model.as_str()])
        .inc_by(took.as_secs_f64());
    w.state
        .inflight
        .observe(&w.model, w.tokens.len() - pre.cached, took);
    let (u, api_usage, report) = if w.connector.is_some() {
        connector_entries(&w, &pre, rt)
    } else {
        rt.block_on(write_entries(&w, &pre))
    };
    if let Some(f) = w.flight.take() {
        f.land();
    }
    // Written (or refused): the exported KV and its budget go before decoding starts.
    let Prefilled { generation, .. } = pre;
    drop(w.kv.take());
    let diagnostics = w.diagnosis.take().map(|(id, mut fp, reason)| {
        fp.cached_end = report
            .breakpoints
            .iter()
            .filter(|b| matches!(b.status.as_str(), "read" | "coalesced" | "written"))
            .map(|b| b.token_offset as usize)
            .max()
            .unwrap_or(0)
            .max(pre.cached);
        w.state.fingerprints.put(id, fp);
        serde_json::json!({ "cache_miss_reason": reason })
    });
    if let Some(mut ev) = w.intent.take() {
        (ev.input_tokens, ev.cache_write_5m_tokens) = (u.input, u.write_5m);
        (ev.cache_write_1h_tokens, ev.cache_read_tokens) = (u.write_1h, u.read);
        ev.finished_at = Utc::now();
        if let Err(e) = w.state.meter.open_stream(&ev) {
            // Served anyway: only a crash before the final event would lose this row.
            tracing::error!(error = %e, "could not journal the open stream");
        }
    }
    let Work {
        tx,
        rate,
        max_tokens,
        stops,
        streaming,
        mut permit,
        ..
    } = w;
    if tx
        .send(Event::Start {
            usage: api_usage,
            report,
            rate,
            diagnostics,
        })
        .is_err()
    {
        return finished(u, 0, UsageStatus::ClientDisconnected, None);
    }
    let mut stream = TextStream::new(generation, max_tokens, stops);
    let mut whole = String::new();
    loop {
        // Between two tokens: a request owed a turn takes this worker, and this generation
        // goes on in its own next turn.
        if let Err(e) = permit.yield_turn(rt) {
            let output = stream.output_tokens() as u64;
            return finished(u, output, UsageStatus::Failed, Some(Event::Error(e)));
        }
        match stream.next_delta() {
            Ok(Some(d)) if !streaming => whole.push_str(&d.text),
            Ok(Some(d)) => {
                if !d.text.is_empty() && tx.send(Event::Delta(d.text)).is_err() {
                    return finished(
                        u,
                        stream.output_tokens() as u64,
                        UsageStatus::ClientDisconnected,
                        None,
                    );
                }
            }
            Ok(None) => break,
            Err(e) => {
                let err = Event::Error(engine_error("decode failed", e));
                return finished(
                    u,
                    stream.output_tokens() as u64,
                    UsageStatus::Failed,
                    Some(err),
                );
            }
        }
    }
    let output = stream.output_tokens() as u64;
    if !whole.is_empty() && tx.send(Event::Delta(whole)).is_err() {
        return finished(u, output, UsageStatus::ClientDisconnected, None);
    }
    let stop_reason = stream.stop_reason().cloned().unwrap_or(StopReason::EndTurn);
    finished(
        u,
        output,
        UsageStatus::Completed,
        Some(Event::Done {
            stop_reason,
            output_tokens: output,
        }),
    )
}

/// An engine that cannot be reached (a vLLM server down or restarting) is an overload the
/// client may retry, said plainly; anything else is an internal error.
fn engine_error(stage: &str, e: EngineError) -> ApiError {
    match e {
        EngineError::Unavailable(why) => {
            metrics::ENGINE_UNAVAILABLE.inc();
            ApiError::overloaded(format!(
                "the model server is unavailable ({why}); retry shortly"
            ))
        }
        e => ApiError::from_service(stage, &e),
    }
}

/// The keys, writes and tag an engine's own connector needs for this request.
fn connector_params(w: &Work, key_space: &str) -> ConnectorParams {
    let mut scope = [0u8; 32];
    scope[..16].copy_from_slice(w.scope.tenant.as_uuid().as_bytes());
    scope[16..].copy_from_slice(w.scope.workspace.as_uuid().as_bytes());
    let writes = connector_writes(&w.placed, &w.targets, w.block_size);
    ConnectorParams {
        cache_salt: scope.iter().map(|b| format!("{b:02x}")).collect(),
        scope,
        keys: w
            .keys
            .as_ref()
            .map(|k| k.blocks.clone())
            .unwrap_or_default(),
        writes,
        tag: w.request_id.0.as_u128(),
        key_space: key_space.to_string(),
    }
}

/// One entry per breakpoint being written (`targets`), ending at the last full block before
/// it (a connector saves whole blocks); breakpoints in one block make one entry, with the
/// longer TTL, paid if either was. In block order; none for a breakpoint inside block 0.
fn connector_writes(
    placed: &[usage::Placed],
    targets: &[usize],
    block_size: usize,
) -> Vec<ConnectorWrite> {
    let bs = block_size.max(1);
    let mut writes: Vec<ConnectorWrite> = Vec::new();
    for pl in placed
        .iter()
        .filter(|p| p.cacheable && targets.contains(&p.offset))
    {
        let end_block = pl.offset / bs;
        if end_block == 0 {
            continue;
        }
        let (ttl, paid) = (pl.bp.ttl.duration(), !pl.bp.automatic);
        match writes.iter_mut().find(|x| x.end_block == end_block) {
            Some(x) => {
                x.ttl = x.ttl.max(ttl);
                x.paid |= paid;
            }
            None => writes.push(ConnectorWrite {
                end_block,
                ttl,
                paid,
            }),
        }
    }
    writes.sort_by_key(|x| x.end_block);
    writes
}

/// Whether the missing-report warning was logged (once per process: it repeats per request).
static MISSING_REPORT_LOGGED: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// How long the gateway waits for a connector's report once the first token is here (it is
/// sent before the first forward pass, so it has normally arrived long before).
const REPORT_WAIT: std::time::Duration = std::time::Duration::from_millis(200);

/// Start an engine with its own KV connector: it loads the cached prefix and saves the new
/// blocks itself; the cached prefix is what its connector reports it did not prefill.
fn prefill_with_connector(
    w: &Work,
    key_space: &str,
    rt: &tokio::runtime::Handle,
) -> Result<Prefilled, EngineError> {
    let params = w.keys.as_ref().map(|_| connector_params(w, key_space));
    let tag = params.as_ref().map(|p| p.tag);
    let generation = w.engine.start(GenerateRequest {
        tokens: w.tokens.clone(),
        imported: Vec::new(),
        exports: Vec::new(),
        sampling: w.sampling.clone(),
        max_new_tokens: w.max_tokens,
        connector: params,
    })?;
    let report = match tag {
        Some(tag) => rt.block_on(w.state.fabric.connector_report(tag, REPORT_WAIT)),
        None => None,
    };
    if tag.is_some() && report.is_none() {
        metrics::CONNECTOR_REPORTS
            .with_label_values(&["missing"])
            .inc();
        if MISSING_REPORT_LOGGED.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::debug!("no connector report");
        } else {
            tracing::warn!(
                model = %w.model,
                "the engine's KV connector sent no report: is vLLM running with CachetConnector? \
                 (said once; the metric cachet_gateway_connector_reports_total counts them)"
            );
        }
    }
    let cached = report.map_or(0, |r| {
        metrics::CONNECTOR_REPORTS
            .with_label_values(&["received"])
            .inc();
        if r.failed_tokens > 0 {
            metrics::KV_RECOMPUTES
                .with_label_values(&["connector_load"])
                .inc();
        }
        r.cached_tokens()
    });
    Ok(Prefilled {
        generation,
        links: Vec::new(),
        exported: Vec::new(),
        cached: cached.min(w.tokens.len().saturating_sub(1)),
    })
}

/// Breakpoint statuses and usage when an engine's connector wrote the entries: a breakpoint
/// is written when the node now holds every full block before it (the connector saved them,
/// or they were there); the tokens after its last full block are input.
fn connector_entries(
    w: &Work,
    pre: &Prefilled,
    rt: &tokio::runtime::Handle,
) -> (TokenUsage, Usage, CacheReport) {
    let cached = pre.cached;
    let bs = w.block_size.max(1);
    let mut written: Vec<(usize, Ttl)> = Vec::new();
    let mut reports = Vec::with_capacity(w.placed.len());
    for pl in &w.placed {
        let aligned = pl.offset / bs * bs;
        let (status, reason) = if !pl.cacheable || aligned == 0 {
            ("below_minimum", None)
        } else if aligned <= cached {
            ("read", None)
        } else {
            let k = w.keys.as_ref().expect("cacheable breakpoint implies keys");
            let held = w.state.fabric.held_prefix(w.scope, k, aligned, w.start);
            if held >= aligned {
                written.push((aligned, pl.bp.ttl));
                // In a cluster its owners get copies too, off the answer's path.
                let (fabric, keys, scope, start) =
                    (w.state.fabric.clone(), k.clone(), w.scope, w.start);
                let (ttl, kind) = (pl.bp.ttl.duration(), entry_kind(pl.bp.automatic));
                rt.spawn(tracing::Instrument::in_current_span(async move {
                    if let Err(r) = fabric
                        .replicate_written(scope, &keys, aligned, ttl, start, kind)
                        .await
                    {
                        tracing::warn!(reason = r.as_str(), "replicating a connector's entry");
                    }
                }));
                ("written", None)
            } else {
                ("not_written", Some("not_saved".to_string()))
            }
        };
        reports.push(breakpoint_report(pl, status, reason));
    }
    usage_and_report(w, cached, &written, reports)
}

/// Write each cacheable breakpoint past the cached prefix, in order; then the usage.
async fn write_entries(w: &Work, pre: &Prefilled) -> (TokenUsage, Usage, CacheReport) {
    let cached = pre.cached;
    let mut written: Vec<(usize, Ttl)> = Vec::new();
    let mut reports = Vec::with_capacity(w.placed.len());
    let blocks = put_blocks(&pre.exported, &pre.links);
    for (i, pl) in w.placed.iter().enumerate() {
        let (status, reason) = if !pl.cacheable {
            ("below_minimum", None)
        } else if pl.offset > cached && w.trimmed.contains(&pl.offset) {
            ("not_written", Some("kv_budget".to_string()))
        } else if pl.offset <= cached {
            match w.coalesced_from {
                Some(from) if pl.offset > from => ("coalesced", None),
                _ => ("read", None),
            }
        } else {
            let k = w.keys.as_ref().expect("cacheable breakpoint implies keys");
            match w
                .state
                .fabric
                .write_entry(
                    w.scope,
                    k,
                    pl.offset,
                    &blocks,
                    pl.bp.ttl.duration(),
                    w.start,
                    entry_kind(pl.bp.automatic),
                )
                .await
            {
                Ok(()) => {
                    written.push((pl.offset, pl.bp.ttl));
                    ("written", w.miss_reason[i].clone())
                }
                Err(r) => ("not_written", Some(r.as_str().to_string())),
            }
        };
        reports.push(breakpoint_report(pl, status, reason));
    }
    usage_and_report(w, cached, &written, reports)
}

/// One breakpoint's line in the cache report, counted in the breakpoint metric.
fn breakpoint_report(pl: &usage::Placed, status: &str, reason: Option<String>) -> BreakpointReport {
    metrics::BREAKPOINTS.with_label_values(&[status]).inc();
    BreakpointReport {
        location: pl.bp.location.clone(),
        automatic: pl.bp.automatic,
        ttl: pl.bp.ttl.as_str().into(),
        token_offset: pl.offset as u64,
        status: status.into(),
        reason,
    }
}

/// Automatic caching's entries are best effort; explicit breakpoints are paid for.
fn entry_kind(automatic: bool) -> EntryKind {
    if automatic {
        EntryKind::BestEffort
    } else {
        EntryKind::Paid
    }
}

/// The request's prompt usage (counted in the metrics) and its cache report.
fn usage_and_report(
    w: &Work,
    cached: usize,
    written: &[(usize, Ttl)],
    reports: Vec<BreakpointReport>,
) -> (TokenUsage, Usage, CacheReport) {
    let total = w.tokens.len();
    let u = usage::compute(total, cached, written);
    for (class, n) in [
        ("input", u.input),
        ("write_5m", u.write_5m),
        ("write_1h", u.write_1h),
        ("read", u.read),
    ] {
        metrics::PROMPT_TOKENS
            .with_label_values(&[w.model.as_str(), class])
            .inc_by(n);
    }
    let api_usage = usage::anthropic(&u);
    let report = CacheReport {
        block_size: w.block_size as u64,
        prompt_tokens: total as u64,
        breakpoints: reports,
    };
    (u, api_usage, report)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::validate::{BlockRef, Breakpoint};

    fn placed(offset: usize, ttl: Ttl, automatic: bool) -> usage::Placed {
        usage::Placed {
            bp: Breakpoint {
                location: format!("system.{offset}"),
                block: BlockRef::System(0),
                ttl,
                automatic,
            },
            offset,
            cacheable: true,
        }
    }

    #[test]
    fn connector_writes_end_at_whole_blocks() {
        let p = vec![
            placed(100, Ttl::FiveMinutes, false), // inside block 0: nothing to save
            placed(300, Ttl::FiveMinutes, true),  // block 2, best effort …
            placed(380, Ttl::OneHour, false),     // … and block 2 again, paid, 1h: one entry
            placed(700, Ttl::FiveMinutes, false), // block 5
            placed(900, Ttl::FiveMinutes, false), // not being written (not a target)
        ];
        let w = connector_writes(&p, &[100, 300, 380, 700], 128);
        assert_eq!(
            w,
            vec![
                ConnectorWrite {
                    end_block: 2,
                    ttl: Ttl::OneHour.duration(),
                    paid: true,
                },
                ConnectorWrite {
                    end_block: 5,
                    ttl: Ttl::FiveMinutes.duration(),
                    paid: true,
                },
            ]
        );
    }
}
