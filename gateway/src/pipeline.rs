//! One request after validation: fabric lookup → admission → engine prefill (importing the
//! cached prefix, exporting new blocks) → fabric writes → usage → decode → meter.
//!
//! It runs in its own task, so a client that disconnects still gets its usage metered (with
//! `client_disconnected` and the tokens produced so far); the HTTP handler only turns
//! [`Event`]s into a JSON body or SSE.

use std::sync::Arc;

use billing::{UsageEvent, UsageStatus};
use cache_fabric::{ChainLink, PrefixKeys, PrefixRead, PutBlock};
use cachet_common::{RequestId, Scope, Ttl};
use chrono::{DateTime, Utc};
use engine::{
    Engine, EngineError, GenerateRequest, Generation, KvBlock, Sampling, StopReason, TextStream,
};
use tokio::sync::mpsc;

use crate::AppState;
use crate::admission::{Ask, Decision, RateHeaders};
use crate::api::types::{BreakpointReport, CacheCreation, CacheReport, Usage};
use crate::error::{ApiError, ErrorKind};
use crate::metrics;
use crate::render::Prepared;
use crate::tenants::Principal;
use crate::usage::{self, TokenUsage};

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
}

pub enum Event {
    Start {
        usage: Usage,
        report: CacheReport,
        rate: RateHeaders,
    },
    Delta(String),
    Done {
        stop_reason: StopReason,
        output_tokens: u64,
    },
    Error(ApiError),
}

/// Start a job; its events arrive on the returned channel.
pub fn spawn(state: AppState, job: Job) -> mpsc::Receiver<Event> {
    let (tx, rx) = mpsc::channel(64);
    let span = tracing::info_span!("request", request_id = %job.request_id, tenant_id = %job.principal.tenant);
    tokio::spawn(tracing::Instrument::instrument(drive(state, job, tx), span));
    rx
}

struct Prefilled {
    generation: Box<dyn Generation>,
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
) -> Result<Prefilled, EngineError> {
    let attempt = |cached: usize, imported: Vec<KvBlock>| -> Result<Prefilled, EngineError> {
        let live: Vec<usize> = targets.iter().copied().filter(|&t| t > cached).collect();
        let exports = keys
            .map(|k| usage::export_links(k, cached, &live))
            .unwrap_or_default()
            .into_iter()
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
        })?;
        let exported = generation.take_exports();
        Ok(Prefilled {
            generation,
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

async fn drive(state: AppState, job: Job, tx: mpsc::Sender<Event>) {
    let p = &job.principal;
    let scope = Scope {
        tenant: p.tenant,
        workspace: p.workspace,
    };
    let info = job.engine.info().clone();
    let prep = job.prepared;
    let total = prep.rendered.tokens.len();
    let keys = prep.keys.map(Arc::new);

    // 1. The longest cached prefix, and why each later breakpoint had no entry.
    let read = match &keys {
        Some(k) => {
            state
                .fabric
                .read_prefix(scope, k, prep.upto, job.start)
                .await
        }
        None => PrefixRead::default(),
    };
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
            class,
            headers,
        } => {
            let mut e = ApiError::new(
                ErrorKind::RateLimit,
                format!("This request would exceed your rate limit of {}. Please retry after {retry_after_secs} seconds.", class.describe()),
            )
            .with_header("retry-after", &retry_after_secs.to_string());
            for (k, v) in &headers.0 {
                e = e.with_header(k, v);
            }
            let _ = tx.send(Event::Error(e)).await;
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

    // 3. An engine worker, or 529 at once.
    let permit = match state.engines.acquire().await {
        Ok(p) => p,
        Err(e) => {
            state
                .admission
                .refund_output(ticket, job.max_tokens as u64)
                .await;
            let _ = tx.send(Event::Error(e)).await;
            return;
        }
    };
    metrics::ENGINE_INFLIGHT.inc();

    // 4. Prefill.
    let targets: Vec<usize> = prep
        .placed
        .iter()
        .filter(|p| p.cacheable)
        .map(|p| p.offset)
        .collect();
    let engine = job.engine.clone();
    let tokens = Arc::new(prep.rendered.tokens);
    let (read, keys2, tokens2, targets2, sampling) = (
        read,
        keys.clone(),
        tokens.clone(),
        targets.clone(),
        job.sampling,
    );
    let pre = tokio::task::spawn_blocking(move || {
        let r = prefill(
            engine.as_ref(),
            &tokens2,
            &read,
            keys2.as_deref(),
            &targets2,
            &sampling,
        );
        (r, read)
    })
    .await;
    let (prefilled, read) = match pre {
        Ok((Ok(p), read)) => (p, read),
        Ok((Err(e), _)) => {
            return fail(
                &state,
                &tx,
                ApiError::internal("prefill failed", e),
                meter(TokenUsage::default(), 0, UsageStatus::Failed),
            )
            .await;
        }
        Err(e) => {
            return fail(
                &state,
                &tx,
                ApiError::internal("prefill task failed", e),
                meter(TokenUsage::default(), 0, UsageStatus::Failed),
            )
            .await;
        }
    };
    let cached = prefilled.cached;
    drop(read);

    // 5. Write each breakpoint past the cached prefix, in order.
    let mut written: Vec<(usize, Ttl)> = Vec::new();
    let mut reports = Vec::with_capacity(prep.placed.len());
    let links: Vec<ChainLink> = match &keys {
        Some(k) => usage::export_links(k, cached, &targets),
        None => Vec::new(),
    };
    let blocks = put_blocks(&prefilled.exported, &links);
    for (i, pl) in prep.placed.iter().enumerate() {
        let (status, reason) = if !pl.cacheable {
            ("below_minimum", None)
        } else if pl.offset <= cached {
            ("read", None)
        } else {
            let k = keys.as_ref().expect("cacheable breakpoint implies keys");
            match state
                .fabric
                .write_entry(
                    scope,
                    k,
                    pl.offset,
                    &blocks,
                    pl.bp.ttl.duration(),
                    job.start,
                )
                .await
            {
                Ok(()) => {
                    written.push((pl.offset, pl.bp.ttl));
                    ("written", miss_reason[i].clone())
                }
                Err(r) => ("not_written", Some(r.as_str().to_string())),
            }
        };
        metrics::BREAKPOINTS.with_label_values(&[status]).inc();
        reports.push(BreakpointReport {
            location: pl.bp.location.clone(),
            automatic: pl.bp.automatic,
            ttl: pl.bp.ttl.as_str().into(),
            token_offset: pl.offset as u64,
            status: status.into(),
            reason,
        });
    }

    // 6. Usage.
    let u = usage::compute(total, cached, &written);
    for (class, n) in [
        ("input", u.input),
        ("write_5m", u.write_5m),
        ("write_1h", u.write_1h),
        ("read", u.read),
    ] {
        metrics::PROMPT_TOKENS
            .with_label_values(&[info.id.as_str(), class])
            .inc_by(n);
    }
    let api_usage = Usage {
        input_tokens: u.input,
        cache_creation_input_tokens: u.writes(),
        cache_read_input_tokens: u.read,
        cache_creation: CacheCreation {
            ephemeral_5m_input_tokens: u.write_5m,
            ephemeral_1h_input_tokens: u.write_1h,
        },
        output_tokens: 0,
        service_tier: "standard".into(),
    };
    let report = CacheReport {
        block_size: info.block_size as u64,
        prompt_tokens: total as u64,
        breakpoints: reports,
    };
    if tx
        .send(Event::Start {
            usage: api_usage,
            report,
            rate,
        })
        .await
        .is_err()
    {
        metrics::ENGINE_INFLIGHT.dec();
        drop(permit);
        state
            .admission
            .refund_output(ticket, job.max_tokens as u64)
            .await;
        record(&state, meter(u, 0, UsageStatus::ClientDisconnected)).await;
        return;
    }

    // 7. Decode, streaming deltas; stop early if the client goes away.
    let (max_tokens, stops) = (job.max_tokens, job.stop_sequences);
    let tx2 = tx.clone();
    let decoded = tokio::task::spawn_blocking(move || {
        let mut stream = TextStream::new(prefilled.generation, max_tokens, stops);
        let mut disconnected = false;
        loop {
            match stream.next_delta() {
                Ok(Some(d)) => {
                    if !d.text.is_empty() && tx2.blocking_send(Event::Delta(d.text)).is_err() {
                        disconnected = true;
                        break;
                    }
                }
                Ok(None) => break,
                Err(e) => return (stream.output_tokens(), None, false, Some(e)),
            }
        }
        (
            stream.output_tokens(),
            stream.stop_reason().cloned(),
            disconnected,
            None,
        )
    })
    .await;
    drop(permit);
    metrics::ENGINE_INFLIGHT.dec();
    let (output, stop, disconnected, error) = match decoded {
        Ok(v) => v,
        Err(e) => (0, None, false, Some(EngineError::Internal(e.to_string()))),
    };
    state
        .admission
        .refund_output(
            ticket,
            (job.max_tokens as u64).saturating_sub(output as u64),
        )
        .await;
    let status = match (&error, disconnected) {
        (Some(_), _) => UsageStatus::Failed,
        (None, true) => UsageStatus::ClientDisconnected,
        (None, false) => UsageStatus::Completed,
    };
    let event = match (error, stop) {
        (Some(e), _) => Event::Error(ApiError::internal("decode failed", e)),
        (None, Some(stop_reason)) => Event::Done {
            stop_reason,
            output_tokens: output as u64,
        },
        (None, None) => Event::Done {
            stop_reason: StopReason::EndTurn,
            output_tokens: output as u64,
        },
    };
    let gone = tx.send(event).await.is_err();
    let status = if gone && status == UsageStatus::Completed && disconnected {
        UsageStatus::ClientDisconnected
    } else {
        status
    };
    record(&state, meter(u, output as u64, status)).await;
}

async fn fail(state: &AppState, tx: &mpsc::Sender<Event>, e: ApiError, ev: UsageEvent) {
    metrics::ENGINE_INFLIGHT.dec();
    let _ = tx.send(Event::Error(e)).await;
    record(state, ev).await;
}

async fn record(state: &AppState, ev: UsageEvent) {
    let id = ev.request_id;
    if let Err(e) = state.meter.record(ev).await {
        tracing::error!(request_id = %id, error = %e, "usage event could not be recorded");
    }
}
