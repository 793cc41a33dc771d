//! What a generation works on (the request's [`Work`] by stage, what prefill left behind) and the
//! usage and cache report it ends with: below both ways of generating, the engine's own
//! (`generate`) and an engine with its own KV connector (`connector`).

use super::*;

pub(super) struct Prefilled {
    pub(super) generation: Box<dyn Generation>,
    /// The chain links past the cached prefix, and their exported KV.
    pub(super) links: Vec<ChainLink>,
    pub(super) exported: Vec<KvBlock>,
    pub(super) cached: usize,
}

/// A ready request's blocking part, by what each stage works from: prefill the [`Prompt`],
/// write its [`Entries`] (and free what is [`Held`] for that), then send the [`Answer`].
pub(super) struct Work {
    /// The process's fabric, meter, in-flight estimates and fingerprints.
    pub(super) state: AppState,
    pub(super) prompt: Prompt,
    pub(super) entries: Entries,
    pub(super) held: Held,
    pub(super) answer: Answer,
}

/// What prefill works from, and the prompt the usage counts.
pub(super) struct Prompt {
    pub(super) engine: Arc<dyn Engine>,
    pub(super) model: String,
    pub(super) tokens: Vec<u32>,
    pub(super) keys: Option<Arc<PrefixKeys>>,
    /// The cached prefix found; let go of once the engine has imported it.
    pub(super) read: PrefixRead,
    /// Token offsets of the breakpoints being written.
    pub(super) targets: Vec<usize>,
    pub(super) block_size: usize,
    pub(super) sampling: Sampling,
    pub(super) max_tokens: u32,
    /// The key space of an engine with its own KV connector ([`KvPath::Connector`]).
    pub(super) connector: Option<String>,
}

/// What the writes at the breakpoints work from.
pub(super) struct Entries {
    pub(super) scope: Scope,
    pub(super) placed: Vec<usage::Placed>,
    pub(super) miss_reason: Vec<Option<String>>,
    /// Breakpoints left unwritten because their blocks alone exceed the KV budget.
    pub(super) trimmed: Vec<usize>,
    /// The cached prefix before waiting on another request's prefill, if that wait added
    /// to it (those breakpoints are reported `coalesced`).
    pub(super) coalesced_from: Option<usize>,
    pub(super) start: tokio::time::Instant,
    pub(super) request_id: RequestId,
}

/// What the request holds: its KV budget and its claim on the blocks it computes until they
/// are written, its engine worker until it ends.
pub(super) struct Held {
    /// This request's share of the KV budget: held until its blocks are written.
    pub(super) kv: Option<crate::budget::KvReservation>,
    /// This request's claim on the blocks it computes: landed once they are written, so
    /// requests waiting on them read them.
    pub(super) flight: Option<Leader>,
    /// Its engine worker: offered to requests owed a turn between tokens, released at the end.
    pub(super) permit: crate::engines::EnginePermit,
}

/// How the answer goes out.
pub(super) struct Answer {
    pub(super) tx: mpsc::UnboundedSender<Event>,
    pub(super) rate: RateHeaders,
    pub(super) stops: Vec<String>,
    pub(super) streaming: bool,
    /// A streamed request's usage event, journaled with its prompt usage before the 200.
    pub(super) intent: Option<UsageEvent>,
    /// With cache diagnostics: this request's message id, its fingerprint (kept once its
    /// entries are written) and the miss reason to report.
    pub(super) diagnosis: Option<(String, diagnostics::Fingerprint, serde_json::Value)>,
}

/// One breakpoint's line in the cache report, counted in the breakpoint metric.
pub(super) fn breakpoint_report(
    pl: &usage::Placed,
    status: &str,
    reason: Option<String>,
) -> BreakpointReport {
    metrics::BREAKPOINTS.with_label_values(&[status]).inc();
    BreakpointReport {
        location: pl.bp.location.clone(),
        automatic: pl.bp.automatic,
        ttl: pl.bp.ttl_label(),
        token_offset: pl.offset as u64,
        status: status.into(),
        reason,
    }
}

/// Automatic caching's entries are best effort; explicit breakpoints are paid for; a cache
/// object's breakpoint is the object's hold (released when it is deleted).
pub(super) fn entry_kind(bp: &crate::wire::validate::Breakpoint) -> EntryKind {
    if bp.object {
        EntryKind::Object
    } else if bp.automatic {
        EntryKind::BestEffort
    } else {
        EntryKind::Paid
    }
}

/// The request's prompt usage (counted in the metrics) and its cache report.
pub(super) fn usage_and_report(
    p: &Prompt,
    cached: usize,
    written: &[(usize, Ttl)],
    reports: Vec<BreakpointReport>,
) -> (TokenUsage, Usage, CacheReport) {
    let total = p.tokens.len();
    let u = usage::compute(total, cached, written);
    for (class, n) in [
        ("input", u.input),
        ("write_5m", u.write_5m),
        ("write_1h", u.write_1h),
        ("read", u.read),
    ] {
        metrics::PROMPT_TOKENS
            .with_label_values(&[p.model.as_str(), class])
            .inc_by(n);
    }
    let api_usage = usage::anthropic(&u);
    let report = CacheReport {
        block_size: p.block_size as u64,
        prompt_tokens: total as u64,
        breakpoints: reports,
        cached_content: None,
    };
    (u, api_usage, report)
}
