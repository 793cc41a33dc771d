//! What the meter records: one request's usage ([`UsageEvent`]) and how it ended, and the
//! JSON Lines form every local file of events (spool, journal, open streams) is read back in.
//! Below the meter and its files, so that none of them imports another for its types.

use cachet_common::{ApiKeyId, RequestId, TenantId, WorkspaceId};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

/// How a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UsageStatus {
    Completed,
    ClientDisconnected,
    Failed,
}

impl UsageStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            UsageStatus::Completed => "completed",
            UsageStatus::ClientDisconnected => "client_disconnected",
            UsageStatus::Failed => "failed",
        }
    }
}

/// One request's metered usage.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageEvent {
    pub request_id: RequestId,
    pub tenant_id: TenantId,
    pub workspace_id: WorkspaceId,
    pub api_key_id: ApiKeyId,
    pub model: String,
    pub input_tokens: u64,
    pub cache_write_5m_tokens: u64,
    pub cache_write_1h_tokens: u64,
    pub cache_read_tokens: u64,
    pub output_tokens: u64,
    pub status: UsageStatus,
    pub started_at: DateTime<Utc>,
    pub finished_at: DateTime<Utc>,
}

/// The events of a spool or open-stream journal (one JSON [`UsageEvent`] per line), as read
/// back after a crash.
#[derive(Debug, Default)]
pub struct EventLines {
    pub events: Vec<UsageEvent>,
    /// Lines read, unreadable ones included.
    pub lines: usize,
    /// Lines that are not an event (1-based), with why: a torn write, or damage.
    pub unreadable: Vec<(usize, String)>,
}

pub(crate) fn split_lines(bytes: &[u8]) -> impl Iterator<Item = &[u8]> {
    bytes
        .strip_suffix(b"\n")
        .unwrap_or(bytes)
        .split(|b| *b == b'\n')
        .filter(move |_| !bytes.is_empty())
}

/// Read a spool or journal's bytes: every line that is an event, whatever the others hold
/// (a torn last line, bytes that are not UTF-8, damage anywhere) — one bad line never costs
/// the others.
pub fn parse_event_lines(bytes: &[u8]) -> EventLines {
    let mut read = EventLines::default();
    for (i, line) in split_lines(bytes).enumerate() {
        read.lines += 1;
        match serde_json::from_slice(line) {
            Ok(e) => read.events.push(e),
            Err(err) => read.unreadable.push((i + 1, err.to_string())),
        }
    }
    read
}
