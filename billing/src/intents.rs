//! The open-stream journal: a streamed response's prompt usage, made durable before its
//! first byte, so a process killed mid-stream still leaves the request's ledger row.
//!
//! A streamed request answers `200` at `message_start`, long before it ends and its usage
//! event is recorded. [`Intents::open`] appends the event as it stands then (prompt usage,
//! no output yet) to a local JSON Lines file and fsyncs it; [`Intents::close`] forgets it
//! once the final event is durable. When the meter starts, every intent still in the file
//! is a stream cut by a crash: it goes to the spool with status `failed` and the output
//! tokens it had when journaled (none), and the usual `ON CONFLICT (request_id) DO NOTHING`
//! replay makes it a no-op wherever the final row did reach the ledger.
//!
//! The file only grows by one line per stream; it is rewritten from the open set (temp
//! file, fsync, rename) once it holds many more lines than open streams.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use cachet_common::RequestId;

use crate::event::{UsageEvent, UsageStatus};
use crate::metrics;

/// Rewrite the file once it holds at least this many lines and four times the open streams.
const COMPACT_AT_LINES: usize = 4096;

pub(crate) struct Intents {
    path: PathBuf,
    inner: Mutex<Inner>,
}

struct Inner {
    file: std::fs::File,
    /// Open streams and their journal lines.
    open: HashMap<RequestId, Vec<u8>>,
    lines: usize,
}

fn line(ev: &UsageEvent) -> std::io::Result<Vec<u8>> {
    let mut buf = serde_json::to_vec(ev).map_err(std::io::Error::other)?;
    buf.push(b'\n');
    Ok(buf)
}

impl Intents {
    /// Take over the journal at `path`: returns it emptied, with the streams a crash cut
    /// (as `failed` events) for the caller to make durable before anything else is journaled.
    pub(crate) fn recover(path: PathBuf) -> std::io::Result<(Self, Vec<UsageEvent>)> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        let cut = read(&path)?;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)?;
        let me = Self {
            path,
            inner: Mutex::new(Inner {
                file,
                open: HashMap::new(),
                lines: 0,
            }),
        };
        let cut = cut
            .into_iter()
            .map(|mut e| {
                e.status = UsageStatus::Failed;
                e
            })
            .collect();
        Ok((me, cut))
    }

    /// Empty the journal once the recovered events are durable elsewhere (before any stream
    /// is opened).
    pub(crate) fn clear(&self) -> std::io::Result<()> {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        debug_assert!(g.open.is_empty(), "cleared after streams were opened");
        g.file.set_len(0)?;
        g.lines = 0;
        g.file.sync_data()
    }

    /// Journal `event` (a stream about to answer 200) durably. Blocking: fsyncs.
    pub(crate) fn open(&self, event: &UsageEvent) -> std::io::Result<()> {
        let l = line(event)?;
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        g.file.write_all(&l)?;
        g.file.sync_data()?;
        g.lines += 1;
        g.open.insert(event.request_id, l);
        metrics::OPEN_STREAMS.set(g.open.len() as i64);
        Ok(())
    }

    /// The stream's final event is durable: forget its intent. Cheap for requests never opened.
    pub(crate) fn close(&self, id: RequestId) {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if g.open.remove(&id).is_none() {
            return;
        }
        metrics::OPEN_STREAMS.set(g.open.len() as i64);
        if g.lines >= COMPACT_AT_LINES
            && g.lines >= 4 * g.open.len()
            && let Err(e) = self.compact(&mut g)
        {
            tracing::error!(error = %e, path = %self.path.display(), "compacting the open-stream journal failed");
        }
    }

    fn compact(&self, g: &mut Inner) -> std::io::Result<()> {
        let tmp = self.path.with_extension("tmp");
        {
            let mut f = std::fs::File::create(&tmp)?;
            for l in g.open.values() {
                f.write_all(l)?;
            }
            f.sync_data()?;
        }
        std::fs::rename(&tmp, &self.path)?;
        g.file = std::fs::OpenOptions::new().append(true).open(&self.path)?;
        g.lines = g.open.len();
        Ok(())
    }
}

fn read(path: &Path) -> std::io::Result<Vec<UsageEvent>> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let read = crate::event::parse_event_lines(&bytes);
    // Only the last line can be torn (a crash mid-append): its stream never answered.
    for (line, err) in &read.unreadable {
        tracing::warn!(line, %err, "skipping unreadable open-stream line");
    }
    Ok(read.events)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use cachet_common::{ApiKeyId, TenantId, WorkspaceId};

    /// A fresh directory under the system's temp dir (removed when the test passes).
    pub(crate) struct Dir(PathBuf);
    impl Dir {
        pub(crate) fn new() -> Self {
            let d = std::env::temp_dir().join(format!("cachet-intents-{}", RequestId::new()));
            std::fs::create_dir_all(&d).unwrap();
            Self(d)
        }
        pub(crate) fn path(&self) -> &Path {
            &self.0
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    pub(crate) fn event() -> UsageEvent {
        let now = chrono::Utc::now();
        UsageEvent {
            request_id: RequestId::new(),
            tenant_id: TenantId::new(),
            workspace_id: WorkspaceId::new(),
            api_key_id: ApiKeyId::new(),
            model: "m".into(),
            input_tokens: 10,
            cache_write_5m_tokens: 64,
            cache_write_1h_tokens: 0,
            cache_read_tokens: 0,
            output_tokens: 0,
            status: UsageStatus::Completed,
            started_at: now,
            finished_at: now,
        }
    }

    #[test]
    fn only_streams_left_open_come_back_after_a_crash() {
        let dir = Dir::new();
        let path = dir.path().join("open-streams.jsonl");
        let (j, cut) = Intents::recover(path.clone()).unwrap();
        assert!(cut.is_empty());
        let (a, b) = (event(), event());
        j.open(&a).unwrap();
        j.open(&b).unwrap();
        j.close(a.request_id);
        drop(j); // the crash: nothing else runs
        let (j, cut) = Intents::recover(path.clone()).unwrap();
        assert_eq!(
            cut.len(),
            2,
            "the journal is append-only between compactions"
        );
        assert!(cut.iter().all(|e| e.status == UsageStatus::Failed));
        j.clear().unwrap();
        let (_, cut) = Intents::recover(path).unwrap();
        assert!(cut.is_empty(), "cleared once recovered");
    }

    #[test]
    fn compaction_keeps_exactly_the_open_streams() {
        let dir = Dir::new();
        let path = dir.path().join("open-streams.jsonl");
        let (j, _) = Intents::recover(path.clone()).unwrap();
        let keep = event();
        j.open(&keep).unwrap();
        for _ in 0..COMPACT_AT_LINES + 10 {
            let e = event();
            j.open(&e).unwrap();
            j.close(e.request_id);
        }
        let lines = std::fs::read_to_string(&path).unwrap().lines().count();
        assert!(lines < 20, "{lines} lines after compaction");
        drop(j);
        // The open stream survives compaction; lines of streams closed since the last
        // compaction may come back too, harmlessly (their final rows win on replay).
        let (_, cut) = Intents::recover(path).unwrap();
        assert_eq!(cut.len(), lines);
        assert!(cut.iter().any(|e| e.request_id == keep.request_id));
    }
}
