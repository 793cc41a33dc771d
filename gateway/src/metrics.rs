//! Prometheus metrics of the gateway (`cachet_gateway_*`).

use std::sync::LazyLock;

use cachet_common::metrics::{
    counter_vec, gauge_vec, histogram, histogram_vec, int_counter, int_counter_vec, int_gauge,
    int_gauge_vec,
};
use prometheus::{
    CounterVec, GaugeVec, Histogram, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
};

pub static HTTP_REQUESTS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_gateway_http_requests_total",
        "HTTP requests by route and status",
        &["route", "status"],
    )
});

pub static HTTP_SECONDS: LazyLock<HistogramVec> = LazyLock::new(|| {
    histogram_vec(
        "cachet_gateway_http_request_seconds",
        "Time to response headers by route",
        &["route"],
        &[
            0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
        ],
    )
});

pub static ERRORS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_gateway_errors_total",
        "Error responses by error type",
        &["type"],
    )
});

pub static PROMPT_TOKENS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_gateway_prompt_tokens_total",
        "Prompt tokens by billing class (input, write_5m, write_1h, read)",
        &["model", "class"],
    )
});

pub static CACHE_OBJECT_OPS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_gateway_cache_objects_total",
        "Cache object operations: created, refused (the fabric could not hold one), used \
             (a request named one), extended, deleted",
        &["op"],
    )
});

pub static TTFT_SLO: LazyLock<GaugeVec> = LazyLock::new(|| {
    gauge_vec(
        "cachet_gateway_ttft_slo_seconds",
        "The time-to-first-token target this process is configured with (cluster.ttft_slo_ms): \
         what the TTFT alert compares the measured p99 with",
        &[],
    )
});

pub static TIME_TO_FIRST_TOKEN: LazyLock<HistogramVec> = LazyLock::new(|| {
    histogram_vec(
        "cachet_gateway_time_to_first_token_seconds",
        "From a request's arrival to its answer's start (prefill done, `message_start` sent), \
         by model: what the TTFT SLO and its alert measure",
        &["model"],
        &[
            0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0,
        ],
    )
});

pub static PREFILL_SECONDS: LazyLock<CounterVec> = LazyLock::new(|| {
    counter_vec(
        "cachet_gateway_prefill_seconds_total",
        "Engine time spent prefilling prompts (importing the cached prefix, computing the rest)",
        &["model"],
    )
});

pub static COALESCED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_gateway_coalesced_waits_total",
        "Requests that waited for another request's prefill of their prefix, by how the wait ended (landed, leader_aborted, timed_out)",
        &["outcome"],
    )
});

pub static WRITES_NOT_HELD: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_gateway_cache_writes_not_held_total",
        "Breakpoints whose cache write the fabric did not hold, by reason (quota, capacity, not_admitted, kv_budget, ...)",
        &["reason"],
    )
});

pub static BREAKPOINTS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_gateway_breakpoints_total",
        "Breakpoints by outcome (read, written, below_minimum, not_written)",
        &["status"],
    )
});

pub static ADMISSION: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_gateway_admission_total",
        "Admission decisions by backend (redis, local fallback)",
        &["backend"],
    )
});

pub static ENGINE_INFLIGHT: LazyLock<IntGauge> = LazyLock::new(|| {
    int_gauge(
        "cachet_gateway_engine_inflight",
        "Generations holding an engine worker",
    )
});

pub static KV_RECOMPUTES: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_gateway_kv_recomputes_total",
        "Cached prefixes recomputed instead of imported, by reason",
        &["reason"],
    )
});

pub static CONNECTOR_REPORTS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_gateway_connector_reports_total",
        "Requests to an engine with its own KV connector (vLLM), by whether its report of \
             the tokens it loaded arrived (received) or not (missing: billed as uncached)",
        &["outcome"],
    )
});

pub static ENGINE_UNAVAILABLE: LazyLock<IntCounter> = LazyLock::new(|| {
    int_counter(
        "cachet_gateway_engine_unavailable_total",
        "Requests answered 529 (or ended with an error event) because a remote model server \
         could not be reached or stopped answering",
    )
});

pub static ROUTED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_gateway_routed_total",
        "Routing gateway decisions (forwarded, retried: a node failed and the next was \
             tried, failed: no node could serve, over_slo, over_tbt and no_nodes: answered 529 at once, \
             resumed: a stream whose node failed continued on another, resume_failed: it \
             could not and ended with an error event)",
        &["outcome"],
    )
});

pub static ENGINE_CACHE_BLOCKS: LazyLock<IntGauge> = LazyLock::new(|| {
    int_gauge(
        "cachet_gateway_engine_cache_blocks",
        "Blocks the routing gateway sees in the nodes' engines' own KV caches (the KV event stream)",
    )
});

pub static ROUTABLE_NODES: LazyLock<IntGauge> = LazyLock::new(|| {
    int_gauge(
        "cachet_gateway_routable_nodes",
        "Live nodes with an API the routing gateway can send requests to",
    )
});

pub static ADMISSION_REFUSALS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_gateway_admission_refusals_total",
        "Requests refused at admission, by the limit that refused them",
        &["limit"],
    )
});

pub static ADMIN_LOGINS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_gateway_admin_logins_total",
        "Admin console logins by outcome (ok, invalid, locked, throttled)",
        &["outcome"],
    )
});

pub static ADMIN_CHANGES_APPLIED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_gateway_admin_changes_applied_total",
        "Administrative changes this process applied from the change feed, by action",
        &["action"],
    )
});

pub static ADMIN_CHANGE_LAG: LazyLock<Histogram> = LazyLock::new(|| {
    histogram(
        "cachet_gateway_admin_change_lag_seconds",
        "Time from an administrative change's commit to this process applying it",
        &[0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0],
    )
});

pub static CONNECTIONS_OPEN: LazyLock<IntGauge> =
    LazyLock::new(|| int_gauge("cachet_gateway_connections_open", "Open client connections"));

pub static CONNECTIONS_REFUSED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_gateway_connections_refused_total",
        "Connections closed at accept (server_full, client_limit, accept_error)",
        &["reason"],
    )
});

pub static CONNECTION_TIMEOUTS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_gateway_connection_timeouts_total",
        "Connections or requests ended by a server timeout (write_stall, body_read)",
        &["kind"],
    )
});

pub static AUTH_LOOKUPS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_gateway_auth_total",
        "API key resolutions: cached, stale (served, refreshed in the background), lookup (Postgres asked), refused_db_down",
        &["result"],
    )
});

pub static PREFILL_RATE: LazyLock<GaugeVec> = LazyLock::new(|| {
    gauge_vec(
        "cachet_gateway_prefill_tokens_per_second",
        "Measured prefill rate of this process's engines per model (a moving average over \
             prefills of at least 64 uncached tokens)",
        &["model"],
    )
});

pub static CONDUCTOR_PREFILL_RATE: LazyLock<GaugeVec> = LazyLock::new(|| {
    gauge_vec(
        "cachet_gateway_conductor_prefill_tokens_per_second",
        "The routing gateway's prefill estimate per node and model: the node's measured \
             rate, else the model's profile",
        &["node", "model"],
    )
});

pub static CONDUCTOR_TBT: LazyLock<GaugeVec> = LazyLock::new(|| {
    gauge_vec(
        "cachet_gateway_conductor_tbt_seconds",
        "The routing gateway's last time-between-tokens estimate per node and model: the \
             node's measured line at the batch a new request would join (nodes whose engine \
             measures it)",
        &["node", "model"],
    )
});

pub static CONDUCTOR_TRANSFER_RATE: LazyLock<GaugeVec> = LazyLock::new(|| {
    gauge_vec(
        "cachet_gateway_conductor_transfer_bytes_per_second",
        "The routing gateway's transfer estimate per node: the node's measured pull \
             bandwidth, else cluster.transfer_bytes_per_sec",
        &["node"],
    )
});

pub static ENGINE_WAITS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_gateway_engine_acquires_total",
        "Requests for a model's engine worker, by outcome (immediate, queued: served after \
             waiting its fair turn, resumed: a generation that gave its worker away between \
             tokens got it back, refused: 529 with the queue full, displaced: its place \
             given to a tenant with fewer waiting)",
        &["model", "outcome"],
    )
});

pub static ENGINE_TURNS_GIVEN: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_gateway_engine_turns_given_total",
        "Generations that handed their engine worker, between two tokens, to a waiting \
             request of a tenant holding fewer of the model's workers (they resume in their \
             next turn: cachet_gateway_engine_acquires_total{outcome=\"resumed\"})",
        &["model"],
    )
});

pub static ENGINE_QUEUE: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    int_gauge_vec(
        "cachet_gateway_engine_queue_depth",
        "Requests waiting for a model's engine worker, per tenant",
        &["model", "tenant"],
    )
});

pub static ENGINE_WAIT_SECONDS: LazyLock<CounterVec> = LazyLock::new(|| {
    counter_vec(
        "cachet_gateway_engine_wait_seconds_total",
        "Time requests waited for a model's engine worker, per tenant (with \
             cachet_gateway_engine_acquires_total: the mean wait)",
        &["model", "tenant"],
    )
});

/// Models served by this process (the model label of the per-tenant series).
static MODELS: LazyLock<std::sync::Mutex<std::collections::BTreeSet<String>>> =
    LazyLock::new(Default::default);

/// Note a served model, so a deleted tenant's series of it can be dropped.
pub fn serving(model: &str) {
    MODELS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(model.to_string());
}

/// Drop a deleted tenant's per-tenant series.
pub fn forget_tenant(tenant: cachet_common::TenantId) {
    let t = tenant.to_string();
    for model in MODELS.lock().unwrap_or_else(|p| p.into_inner()).iter() {
        let _ = ENGINE_QUEUE.remove_label_values(&[model.as_str(), t.as_str()]);
        let _ = ENGINE_WAIT_SECONDS.remove_label_values(&[model.as_str(), t.as_str()]);
    }
}

pub static KV_BUDGET_TOTAL: LazyLock<IntGauge> = LazyLock::new(|| {
    int_gauge(
        "cachet_gateway_kv_budget_bytes",
        "The KV memory budget: bytes of KV requests may hold at once between engine and fabric",
    )
});

/// The serving process's configured memory bounds, one series a setting: their sum is what
/// the process's RSS should stay within (the binary's `memory::check` sets them at start).
pub static MEMORY_BOUND_BYTES: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    int_gauge_vec(
        "cachet_memory_bound_bytes",
        "Configured memory bounds of this process, by the setting that bounds each consumer",
        &["setting"],
    )
});

pub static KV_BUDGET_USED: LazyLock<IntGauge> = LazyLock::new(|| {
    int_gauge(
        "cachet_gateway_kv_budget_used_bytes",
        "Bytes of the KV memory budget reserved by requests in flight",
    )
});

pub static KV_BUDGET_WAITS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_gateway_kv_budget_reservations_total",
        "KV budget reservations by outcome (immediate, waited, refused: 529 after the wait)",
        &["outcome"],
    )
});

pub static KV_BUDGET_TRIMMED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_gateway_kv_budget_trimmed_breakpoints_total",
        "Breakpoints not written because their blocks alone exceed the whole KV budget",
        &["model"],
    )
});
