//! Engines with their own KV connector (vLLM): the keys, writes and tag sent with the
//! request, and the entries and usage read back from the connector's report.

use super::work::{Entries, Prefilled, Prompt, breakpoint_report, entry_kind, usage_and_report};
use super::*;

/// The keys, writes and tag an engine's own connector needs for this request.
pub(super) fn connector_params(p: &Prompt, e: &Entries, key_space: &str) -> ConnectorParams {
    let mut scope = [0u8; 32];
    scope[..16].copy_from_slice(e.scope.tenant.as_uuid().as_bytes());
    scope[16..].copy_from_slice(e.scope.workspace.as_uuid().as_bytes());
    let writes = connector_writes(&e.placed, &p.targets, p.block_size);
    ConnectorParams {
        cache_salt: scope.iter().map(|b| format!("{b:02x}")).collect(),
        scope,
        keys: p
            .keys
            .as_ref()
            .map(|k| k.blocks.clone())
            .unwrap_or_default(),
        writes,
        tag: e.request_id.0.as_u128(),
        key_space: key_space.to_string(),
    }
}

/// One entry per breakpoint being written (`targets`), ending at the last full block before
/// it (a connector saves whole blocks); breakpoints in one block make one entry, with the
/// longer TTL, paid if either was. In block order; none for a breakpoint inside block 0.
pub(super) fn connector_writes(
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
        let (ttl, paid) = (pl.bp.held_for(), !pl.bp.automatic);
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
pub(super) fn prefill_with_connector(
    state: &AppState,
    p: &Prompt,
    e: &Entries,
    key_space: &str,
    rt: &tokio::runtime::Handle,
) -> Result<Prefilled, EngineError> {
    let params = p.keys.as_ref().map(|_| connector_params(p, e, key_space));
    let tag = params.as_ref().map(|c| c.tag);
    let generation = p.engine.start(GenerateRequest {
        tokens: p.tokens.clone(),
        imported: Vec::new(),
        exports: Vec::new(),
        sampling: p.sampling.clone(),
        max_new_tokens: p.max_tokens,
        connector: params,
    })?;
    let report = match tag {
        Some(tag) => rt.block_on(state.fabric.connector_report(tag, REPORT_WAIT)),
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
                model = %p.model,
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
        cached: cached.min(p.tokens.len().saturating_sub(1)),
    })
}

/// Breakpoint statuses and usage when an engine's connector wrote the entries: a breakpoint
/// is written when the node now holds every full block before it (the connector saved them,
/// or they were there); the tokens after its last full block are input.
pub(super) fn connector_entries(
    state: &AppState,
    p: &Prompt,
    e: &Entries,
    pre: &Prefilled,
    rt: &tokio::runtime::Handle,
) -> (TokenUsage, Usage, CacheReport) {
    let cached = pre.cached;
    let bs = p.block_size.max(1);
    let mut written: Vec<(usize, Ttl)> = Vec::new();
    let mut reports = Vec::with_capacity(e.placed.len());
    for pl in &e.placed {
        let aligned = pl.offset / bs * bs;
        let (status, reason) = if !pl.cacheable || aligned == 0 {
            ("below_minimum", None)
        } else if aligned <= cached {
            ("read", None)
        } else {
            let k = p.keys.as_ref().expect("cacheable breakpoint implies keys");
            let held = state.fabric.held_prefix(e.scope, k, aligned, e.start);
            if held >= aligned {
                written.push((aligned, pl.bp.ttl));
                // In a cluster its owners get copies too, off the answer's path.
                let (fabric, keys, scope, start) =
                    (state.fabric.clone(), k.clone(), e.scope, e.start);
                let (ttl, kind) = (pl.bp.held_for(), entry_kind(&pl.bp));
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
    usage_and_report(p, cached, &written, reports)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::validate::{BlockRef, Breakpoint};

    fn placed(offset: usize, ttl: Ttl, automatic: bool) -> usage::Placed {
        usage::Placed {
            bp: Breakpoint {
                location: format!("system.{offset}"),
                block: BlockRef::System(0),
                ttl,
                automatic,
                hold: None,
                object: false,
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
