//! The blocking part of a request: prefill (importing the cached prefix, exporting new
//! blocks), the fabric writes at its breakpoints, usage and `message_start`, then decoding.

use super::connector::{connector_entries, prefill_with_connector};
use super::work::{
    Answer, Entries, Prefilled, Prompt, Work, breakpoint_report, entry_kind, usage_and_report,
};
use super::*;

/// The cached prefix a fabric read found, as the engine imports it: each block's KV with the
/// token range its chain link covers.
pub fn imported_kv(read: &PrefixRead) -> Vec<KvBlock> {
    let blocks = read.links.iter().zip(&read.blocks);
    blocks
        .map(|(l, b)| KvBlock {
            hash: l.hash,
            start: l.start,
            end: l.end,
            data: b.data.clone(),
        })
        .collect()
}

/// Prefill from the cached prefix; if the imported KV fails the engine's own check, recompute
/// everything rather than answer wrongly.
pub(super) fn prefill(
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
    let imported = imported_kv(read);
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

pub(super) fn put_blocks(exported: &[KvBlock], links: &[ChainLink]) -> Vec<PutBlock> {
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

/// How the blocking part ended, and the event that ends the response (sent after metering).
pub(super) struct Finished {
    /// The engine could not be reached before it did any work (nothing to bill): no ledger
    /// row, so that a routing gateway's retry of this request id on another node is the
    /// request's one row (the ledger keeps the first row of a request id).
    pub(super) unserved: bool,
    pub(super) usage: TokenUsage,
    pub(super) output: u64,
    pub(super) status: UsageStatus,
    pub(super) last: Option<Event>,
}

impl Finished {
    fn ended(usage: TokenUsage, output: u64, status: UsageStatus, last: Option<Event>) -> Self {
        Self {
            unserved: false,
            usage,
            output,
            status,
            last,
        }
    }

    /// Generation failed inside Cachet (a panic): a 500, and a failed usage row.
    pub(super) fn internal_failure(cause: impl std::fmt::Display) -> Self {
        Self {
            unserved: false,
            usage: TokenUsage::default(),
            output: 0,
            status: UsageStatus::Failed,
            last: Some(Event::Error(ApiError::internal(
                "generation task failed",
                cause,
            ))),
        }
    }
}

/// The prompt's token classes on the request's pipeline span (an exported trace shows them).
fn record_prompt_usage(u: &TokenUsage) {
    let span = tracing::Span::current();
    span.record("input_tokens", u.input);
    span.record("cache_read_input_tokens", u.read);
    span.record("cache_creation_input_tokens", u.writes());
}

/// Prefill, write, report, decode. Returns the prompt usage, output tokens and how it ended.
pub(super) fn generate(w: Work, rt: &tokio::runtime::Handle) -> Finished {
    let Work {
        state,
        mut prompt,
        entries,
        mut held,
        mut answer,
    } = w;
    let pre = match start_prefill(&state, &mut prompt, &entries, rt) {
        Ok(pre) => pre,
        Err(failed) => return *failed,
    };
    let (u, api_usage, report) = if prompt.connector.is_some() {
        connector_entries(&state, &prompt, &entries, &pre, rt)
    } else {
        rt.block_on(write_entries(&state, &prompt, &entries, &pre))
    };
    record_prompt_usage(&u);
    if let Some(f) = held.flight.take() {
        f.land();
    }
    // Written (or refused): the exported KV and its budget go before decoding starts.
    let Prefilled {
        generation, cached, ..
    } = pre;
    drop(held.kv.take());
    let diagnostics = diagnose(&state, &mut answer, &report, cached);
    journal_open_stream(&state, &mut answer, &u);
    let Answer {
        tx,
        rate,
        stops,
        streaming,
        ..
    } = answer;
    if tx
        .send(Event::Start {
            usage: api_usage,
            report,
            rate,
            diagnostics,
        })
        .is_err()
    {
        return Finished::ended(u, 0, UsageStatus::ClientDisconnected, None);
    }
    metrics::TIME_TO_FIRST_TOKEN
        .with_label_values(&[prompt.model.as_str()])
        .observe(entries.start.elapsed().as_secs_f64());
    let stream = TextStream::new(generation, prompt.max_tokens, stops);
    decode(stream, &tx, streaming, held.permit, rt, u)
}

/// Prefill (through the connector where the engine has one), timed into the metrics and the
/// in-flight estimate; how the request ended where it failed.
fn start_prefill(
    state: &AppState,
    p: &mut Prompt,
    e: &Entries,
    rt: &tokio::runtime::Handle,
) -> Result<Prefilled, Box<Finished>> {
    let prefill_started = std::time::Instant::now();
    let started = match &p.connector {
        Some(space) => prefill_with_connector(state, p, e, space, rt),
        None => prefill(
            p.engine.as_ref(),
            &p.tokens,
            &p.read,
            p.keys.as_deref(),
            &p.targets,
            &p.sampling,
            p.max_tokens,
        ),
    };
    let pre = match started {
        Ok(pre) => pre,
        Err(err) => {
            // An engine that could not be reached did no work: nothing to bill.
            let unserved = matches!(err, EngineError::Unavailable(_));
            let err = Event::Error(engine_error("prefill failed", err));
            return Err(Box::new(Finished {
                unserved,
                ..Finished::ended(TokenUsage::default(), 0, UsageStatus::Failed, Some(err))
            }));
        }
    };
    // The imported blocks are in the engine now: let go of them (they may be all that still
    // holds a block the fabric has since evicted).
    p.read = PrefixRead::default();
    let took = prefill_started.elapsed();
    metrics::PREFILL_SECONDS
        .with_label_values(&[p.model.as_str()])
        .inc_by(took.as_secs_f64());
    state
        .inflight
        .observe(&p.model, p.tokens.len() - pre.cached, took);
    Ok(pre)
}

/// Where the request asked why it missed: its fingerprint kept (up to the prefix now
/// cached) for the next request to compare with, and the reason for `message_start`.
fn diagnose(
    state: &AppState,
    a: &mut Answer,
    report: &CacheReport,
    cached: usize,
) -> Option<serde_json::Value> {
    let (id, mut fp, reason) = a.diagnosis.take()?;
    fp.cached_end = report
        .breakpoints
        .iter()
        .filter(|b| matches!(b.status.as_str(), "read" | "coalesced" | "written"))
        .map(|b| b.token_offset as usize)
        .max()
        .unwrap_or(0)
        .max(cached);
    state.fingerprints.put(id, fp);
    Some(serde_json::json!({ "cache_miss_reason": reason }))
}

/// A stream's row journaled open with its prompt usage, so that a crash mid-answer still
/// bills what was served.
fn journal_open_stream(state: &AppState, a: &mut Answer, u: &TokenUsage) {
    if let Some(mut ev) = a.intent.take() {
        (ev.input_tokens, ev.cache_write_5m_tokens) = (u.input, u.write_5m);
        (ev.cache_write_1h_tokens, ev.cache_read_tokens) = (u.write_1h, u.read);
        ev.finished_at = Utc::now();
        if let Err(e) = state.meter.open_stream(&ev) {
            // Served anyway: only a crash before the final event would lose this row.
            tracing::error!(error = %e, "could not journal the open stream");
        }
    }
}

/// Decode to the end: each delta sent as it comes (streaming) or the whole text at the end,
/// the worker yielded between tokens to a request owed a turn.
fn decode(
    mut stream: TextStream,
    tx: &mpsc::UnboundedSender<Event>,
    streaming: bool,
    mut permit: crate::engines::EnginePermit,
    rt: &tokio::runtime::Handle,
    u: TokenUsage,
) -> Finished {
    let mut whole = String::new();
    loop {
        // Between two tokens: a request owed a turn takes this worker, and this generation
        // goes on in its own next turn.
        if let Err(e) = permit.yield_turn(rt) {
            let output = stream.output_tokens() as u64;
            return Finished::ended(u, output, UsageStatus::Failed, Some(Event::Error(e)));
        }
        match stream.next_delta() {
            Ok(Some(d)) if !streaming => whole.push_str(&d.text),
            Ok(Some(d)) => {
                if !d.text.is_empty() && tx.send(Event::Delta(d.text)).is_err() {
                    let output = stream.output_tokens() as u64;
                    return Finished::ended(u, output, UsageStatus::ClientDisconnected, None);
                }
            }
            Ok(None) => break,
            Err(e) => {
                let err = Event::Error(engine_error("decode failed", e));
                let output = stream.output_tokens() as u64;
                return Finished::ended(u, output, UsageStatus::Failed, Some(err));
            }
        }
    }
    let output = stream.output_tokens() as u64;
    if !whole.is_empty() && tx.send(Event::Delta(whole)).is_err() {
        return Finished::ended(u, output, UsageStatus::ClientDisconnected, None);
    }
    let stop_reason = stream.stop_reason().cloned().unwrap_or(StopReason::EndTurn);
    Finished::ended(
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
pub(super) fn engine_error(stage: &str, e: EngineError) -> ApiError {
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

/// Write each cacheable breakpoint past the cached prefix, in order; then the usage.
pub(super) async fn write_entries(
    state: &AppState,
    p: &Prompt,
    e: &Entries,
    pre: &Prefilled,
) -> (TokenUsage, Usage, CacheReport) {
    let cached = pre.cached;
    let mut written: Vec<(usize, Ttl)> = Vec::new();
    let mut reports = Vec::with_capacity(e.placed.len());
    let blocks = put_blocks(&pre.exported, &pre.links);
    // Where the last read or written entry ends: a breakpoint not held would have written the
    // tokens from there.
    let mut held_to = cached;
    let not_held = |reason: &'static str, offset: usize, held_to: usize| {
        let tokens = offset.saturating_sub(held_to) as u64;
        state.not_held.record(e.scope.tenant, reason, tokens);
        ("not_written", Some(reason.to_string()))
    };
    for (i, pl) in e.placed.iter().enumerate() {
        let (status, reason) = if !pl.cacheable {
            ("below_minimum", None)
        } else if pl.offset > cached && e.trimmed.contains(&pl.offset) {
            not_held("kv_budget", pl.offset, held_to)
        } else if pl.offset <= cached {
            match e.coalesced_from {
                Some(from) if pl.offset > from => ("coalesced", None),
                _ => ("read", None),
            }
        } else {
            let k = p.keys.as_ref().expect("cacheable breakpoint implies keys");
            let holding = Holding {
                ttl: pl.bp.held_for(),
                kind: entry_kind(&pl.bp),
            };
            let write = state
                .fabric
                .write_entry(e.scope, k, pl.offset, &blocks, holding, e.start);
            match write.await {
                Ok(()) => {
                    written.push((pl.offset, pl.bp.ttl));
                    held_to = pl.offset;
                    ("written", e.miss_reason[i].clone())
                }
                Err(r) => not_held(r.as_str(), pl.offset, held_to),
            }
        };
        reports.push(breakpoint_report(pl, status, reason));
    }
    usage_and_report(p, cached, &written, reports)
}
