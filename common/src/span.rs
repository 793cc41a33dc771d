//! The span every request runs in, opened at the edge: the HTTP middleware of each process
//! (the gateway's, a node's API, the router's) opens it with the request id before any work,
//! and authentication fills in the tenant and workspace once it resolves them (API keys, an
//! admin's or finance's token naming a tenant). Everything the request does after that logs
//! inside it, whichever crate writes the line (neon's habit: `tenant_id` on every handler's
//! span). Background loops log in spans of their own (`task`), never in a request's.

use tracing::Span;
use tracing::field::Empty;

use crate::{RequestId, TenantId, WorkspaceId};

/// A request's span: its id, method and route now; its tenant and workspace when auth knows
/// them ([`record_tenant`]).
pub fn request(rid: RequestId, method: &str, route: &str) -> Span {
    tracing::info_span!(
        "request",
        request_id = %rid,
        method,
        route,
        tenant_id = Empty,
        workspace_id = Empty,
        status = Empty,
        "otel.kind" = "server",
        // Set on a 5xx (`record_status`): a field must be declared to be recorded.
        "otel.status_code" = Empty,
    )
}

/// Record on `span` the HTTP status the request was answered with (a 5xx marks the span as
/// failed in an exported trace).
pub fn record_status(span: &Span, status: u16) {
    span.record("status", status);
    if status >= 500 {
        span.record("otel.status_code", "ERROR");
    }
}

/// Record on the current request's span the tenant (and workspace) the request acts for. Call
/// it where authentication resolves them, inside the handler (the span the middleware
/// entered is current there); outside a request span it does nothing.
pub fn record_tenant(tenant: TenantId, workspace: Option<WorkspaceId>) {
    let span = Span::current();
    span.record("tenant_id", tracing::field::display(tenant));
    if let Some(w) = workspace {
        span.record("workspace_id", tracing::field::display(w));
    }
}
