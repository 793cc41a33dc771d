//! The meter: exactly one ledger row per request, never lost, never doubled.
//!
//! - Group commit: the writer task takes every event that is waiting (up to `batch_max`,
//!   after lingering `linger` for more) and
//!   inserts them with one `INSERT … SELECT FROM UNNEST(…) ON CONFLICT (request_id) DO
//!   NOTHING`. While one commit runs, the next batch accumulates.
//! - Spool: a batch Postgres does not take (connection refused, restart, timeout) is appended
//!   to a local JSON Lines file and fsynced; the writer then spools directly for
//!   `retry_interval` and replays the file (in chunks, idempotently) until Postgres takes it,
//!   then truncates it. A torn last line from a crash is skipped with a log line.
//! - A row Postgres rejects as invalid (a constraint) goes to `<spool>.rejected` for a person
//!   to look at, never silently dropped.
//! - If the writer task is gone, [`MeterHandle::record`] appends to the spool itself.
//! - Durability without the wait: [`MeterHandle::record_durable`] returns once the event is
//!   fsynced to the local usage journal (`journal`, group fsync); the insert above follows
//!   asynchronously, and the journal's events go to the spool when the meter next starts
//!   after a crash (decision 0020).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cachet_common::RequestId;
use sqlx::PgPool;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::event::split_lines;
pub use crate::event::{EventLines, UsageEvent, UsageStatus, parse_event_lines};
use crate::intents::Intents;
use crate::journal::Journal;
use crate::metrics;

#[derive(Clone, Debug)]
pub struct MeterConfig {
    pub batch_max: usize,
    pub queue_capacity: usize,
    pub spool_path: PathBuf,
    pub retry_interval: Duration,
    /// After the first event of a batch, wait this long for more before committing: bounds
    /// the commit rate (and Postgres CPU) at high load for a small delay in durability.
    pub linger: Duration,
    /// What to do with another database's files in the spool's directory (decision 0030).
    pub foreign: crate::database::Foreign,
}

impl MeterConfig {
    pub fn with_spool(spool_path: PathBuf) -> Self {
        Self {
            batch_max: 2048,
            queue_capacity: 65_536,
            spool_path,
            retry_interval: Duration::from_millis(500),
            linger: Duration::from_millis(2),
            foreign: crate::database::Foreign::KeepAside,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum MeterError {
    #[error("spool i/o failed: {0}")]
    Spool(#[from] std::io::Error),
    #[error(transparent)]
    Directory(#[from] crate::database::ClaimError),
}

impl cachet_common::error::ServiceError for MeterError {
    fn error_code(&self) -> cachet_common::error::ErrorCode {
        cachet_common::error::ErrorCode::Api
    }
}

/// The append-only local spool.
struct Spool {
    path: PathBuf,
    lock: std::sync::Mutex<()>,
    events: AtomicU64,
}

impl Spool {
    fn open(path: PathBuf) -> std::io::Result<Self> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        let events = match std::fs::read(&path) {
            Ok(bytes) => {
                // A crash mid-append leaves a torn last line without its newline: end it, so
                // the next event appended starts a line of its own instead of joining it.
                if bytes.last().is_some_and(|b| *b != b'\n') {
                    std::fs::OpenOptions::new()
                        .append(true)
                        .open(&path)?
                        .write_all(b"\n")?;
                }
                split_lines(&bytes).count() as u64
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
            Err(e) => return Err(e),
        };
        metrics::SPOOL_EVENTS.set(events as i64);
        Ok(Self {
            path,
            lock: std::sync::Mutex::new(()),
            events: AtomicU64::new(events),
        })
    }

    fn append_to(path: &Path, events: &[UsageEvent]) -> std::io::Result<()> {
        let mut buf = Vec::with_capacity(events.len() * 320);
        for e in events {
            serde_json::to_writer(&mut buf, e).map_err(std::io::Error::other)?;
            buf.push(b'\n');
        }
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        f.write_all(&buf)?;
        f.sync_data()
    }

    fn append(&self, events: &[UsageEvent]) -> std::io::Result<()> {
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        Self::append_to(&self.path, events)?;
        let n = self.events.fetch_add(events.len() as u64, Ordering::SeqCst) + events.len() as u64;
        metrics::SPOOL_EVENTS.set(n as i64);
        metrics::EVENTS
            .with_label_values(&["spooled"])
            .inc_by(events.len() as u64);
        Ok(())
    }

    /// Every readable event of the spool, and how many lines were read.
    fn read_all(&self) -> std::io::Result<EventLines> {
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let bytes = match std::fs::read(&self.path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(EventLines::default()),
            Err(e) => return Err(e),
        };
        let read = parse_event_lines(&bytes);
        for (line, err) in &read.unreadable {
            tracing::error!(line, %err, "skipping unreadable spool line (torn write?)");
        }
        Ok(read)
    }

    /// Drop the first `n` lines (the ones just replayed), keeping anything appended since.
    fn consume(&self, n: usize) -> std::io::Result<()> {
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let bytes = match std::fs::read(&self.path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(e),
        };
        let rest: Vec<&[u8]> = split_lines(&bytes).skip(n).collect();
        let tmp = self.path.with_extension("tmp");
        {
            let mut f = std::fs::File::create(&tmp)?;
            for l in &rest {
                f.write_all(l)?;
                f.write_all(b"\n")?;
            }
            f.sync_data()?;
        }
        std::fs::rename(&tmp, &self.path)?;
        self.events.store(rest.len() as u64, Ordering::SeqCst);
        metrics::SPOOL_EVENTS.set(rest.len() as i64);
        Ok(())
    }
}

/// Where usage events go. Cheap to clone.
#[derive(Clone)]
pub struct MeterHandle {
    tx: mpsc::Sender<Queued>,
    spool: Arc<Spool>,
    intents: Arc<Intents>,
    journal: Arc<Journal>,
    pending: Arc<AtomicU64>,
    /// Events waiting out [`MeterHandle::record_durable_after`]'s delay.
    deferred: Arc<AtomicU64>,
    /// The meter's shutdown: deferred events are handed over at once when it fires.
    shutdown: CancellationToken,
}

impl MeterHandle {
    /// Hand one event to the meter. Waits (backpressure) if the queue is full; appends to the
    /// spool directly if the writer is gone. An error means the event could not be kept.
    pub async fn record(&self, event: UsageEvent) -> Result<(), MeterError> {
        self.send(event, None).await
    }

    /// Like [`MeterHandle::record`], but returns only once the event is durable: fsynced to
    /// the local usage journal (grouped with other requests' events), so a process killed
    /// after this returns loses nothing; the Postgres insert follows asynchronously and the
    /// journal is replayed into the ledger after a crash. If the journal cannot be written,
    /// waits for the commit instead ([`MeterHandle::record_committed`]).
    pub async fn record_durable(&self, event: UsageEvent) -> Result<(), MeterError> {
        let at = match self.journal.append(&event).await {
            Ok(at) => at,
            Err(e) => {
                metrics::EVENTS.with_label_values(&["journal_failed"]).inc();
                tracing::error!(request_id = %event.request_id, error = %e, "usage journal unavailable; waiting for the ledger commit");
                return self.record_committed(event).await;
            }
        };
        self.intents.close(event.request_id);
        tracing::debug!(request_id = %event.request_id, status = event.status.as_str(), "usage journaled");
        let journal = self.journal.clone();
        self.send(event, Some(Box::new(move || journal.committed(at))))
            .await
    }

    /// Returns only once the event is committed to Postgres or fsynced to the spool. Costs
    /// the group commit's latency (`linger` plus one insert).
    pub async fn record_committed(&self, event: UsageEvent) -> Result<(), MeterError> {
        let committed = self.hand_over(event).await?;
        committed.await;
        Ok(())
    }

    /// Hand `event` to the writer (or the spool); the future it returns ends once the event
    /// is committed or spooled, and closes its stream in the open-stream journal.
    async fn hand_over(
        &self,
        event: UsageEvent,
    ) -> Result<impl std::future::Future<Output = ()> + use<>, MeterError> {
        let id = event.request_id;
        let (ack, done) = tokio::sync::oneshot::channel::<()>();
        self.send(
            event,
            Some(Box::new(move || {
                let _ = ack.send(());
            })),
        )
        .await?;
        let intents = self.intents.clone();
        Ok(async move {
            // A dropped ack means the writer stopped with the event in hand; its drain
            // commits or spools everything it holds before it exits.
            let _ = done.await;
            intents.close(id);
        })
    }

    /// Record `event` durably after `delay`, unless the meter stops first (then at once).
    /// Meanwhile its stream stays in the open-stream journal, so a crash still leaves a row.
    /// For a stream another node may finish under the same request id: the ledger keeps a
    /// request's first row, so the other node's complete row, if it comes, is the one kept.
    pub fn record_durable_after(&self, event: UsageEvent, delay: Duration) {
        let h = self.clone();
        h.deferred.fetch_add(1, Ordering::SeqCst);
        metrics::DEFERRED.inc();
        tokio::spawn(async move {
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = h.shutdown.cancelled() => {}
            }
            let id = event.request_id;
            let sent = h.hand_over(event).await;
            // Handed over (or spooled): the meter's drain no longer waits for it.
            h.deferred.fetch_sub(1, Ordering::SeqCst);
            metrics::DEFERRED.dec();
            match sent {
                Ok(committed) => committed.await,
                Err(e) => {
                    tracing::error!(request_id = %id, error = %e, "deferred usage event could not be kept; the journal replays it")
                }
            }
        });
    }

    /// A streamed response is about to answer 200: journal `event` (its prompt usage, no
    /// output yet) durably, so a crash before its final [`MeterHandle::record_durable`]
    /// still leaves a ledger row (status `failed`) when the meter next starts. Blocking
    /// (one fsync): call it from the generation's own thread.
    pub fn open_stream(&self, event: &UsageEvent) -> Result<(), MeterError> {
        self.intents.open(event)?;
        Ok(())
    }

    async fn send(&self, event: UsageEvent, ack: Option<Ack>) -> Result<(), MeterError> {
        self.pending.fetch_add(1, Ordering::SeqCst);
        if let Err(mpsc::error::SendError((event, ack))) = self.tx.send((event, ack)).await {
            let spool = self.spool.clone();
            let res = tokio::task::spawn_blocking(move || spool.append(&[event]))
                .await
                .map_err(|e| std::io::Error::other(e.to_string()))?;
            self.pending.fetch_sub(1, Ordering::SeqCst);
            res?;
            if let Some(ack) = ack {
                ack();
            }
        }
        Ok(())
    }

    /// Events handed over but not yet committed or spooled.
    pub fn pending(&self) -> u64 {
        self.pending.load(Ordering::SeqCst)
    }

    /// Events waiting in the spool for Postgres.
    pub fn spooled(&self) -> u64 {
        self.spool.events.load(Ordering::SeqCst)
    }

    /// Wait until every event handed over is in Postgres (tests, shutdown).
    pub async fn settled(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self.pending() == 0 && self.spooled() == 0 {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }
}

/// What to do once an event is committed or spooled: wake a waiting sender, or tell the
/// journal its copy is no longer needed.
type Ack = Box<dyn FnOnce() + Send>;

/// An event on its way to the writer, with whom to tell once it is in the ledger or spool.
type Queued = (UsageEvent, Option<Ack>);

/// The writer task.
pub struct Meter {
    pool: PgPool,
    config: MeterConfig,
    rx: mpsc::Receiver<Queued>,
    spool: Arc<Spool>,
    pending: Arc<AtomicU64>,
    deferred: Arc<AtomicU64>,
    degraded_until: Option<Instant>,
    next_replay: Instant,
}

impl Meter {
    /// Start the meter; it stops (after draining and committing or spooling everything)
    /// when `shutdown` is cancelled. Its directory is first made this database's
    /// ([`crate::database::claim`]): another database's files are never replayed here.
    pub async fn start(
        pool: PgPool,
        config: MeterConfig,
        shutdown: CancellationToken,
    ) -> Result<(MeterHandle, tokio::task::JoinHandle<()>), MeterError> {
        let database = crate::database::identity(&pool)
            .await
            .map_err(crate::database::ClaimError::Identity)?;
        crate::database::claim(&config.spool_path, database, config.foreign)?;
        let spool = Arc::new(Spool::open(config.spool_path.clone())?);
        // What the last run left, into the spool (replayed idempotently like any spooled
        // event): first the events it journaled (answered, maybe not yet inserted), then the
        // streams a crash cut, as `failed`, unless the journal holds their final event (the
        // open-stream file keeps closed streams' lines until it is compacted). Journal
        // first: the ledger keeps a request's first row.
        let (journal, recovered) = Journal::open(&config.spool_path)?;
        let (intents, cut) = Intents::recover(config.spool_path.with_extension("open"))?;
        let journaled: std::collections::HashSet<RequestId> =
            recovered.events.iter().map(|e| e.request_id).collect();
        let cut: Vec<UsageEvent> = cut
            .into_iter()
            .filter(|e| !journaled.contains(&e.request_id))
            .collect();
        if !recovered.events.is_empty() {
            tracing::warn!(
                events = recovered.events.len(),
                "usage events recovered from the journal; replaying them into the ledger"
            );
            spool.append(&recovered.events)?;
        }
        if !cut.is_empty() {
            tracing::warn!(
                events = cut.len(),
                "streams cut by the last stop recovered from the open-stream journal"
            );
            spool.append(&cut)?;
        }
        intents.clear()?;
        recovered.discard()?;
        let (tx, rx) = mpsc::channel(config.queue_capacity);
        let pending = Arc::new(AtomicU64::new(0));
        let deferred = Arc::new(AtomicU64::new(0));
        let handle = MeterHandle {
            tx,
            spool: spool.clone(),
            intents: Arc::new(intents),
            journal: Arc::new(journal),
            pending: pending.clone(),
            deferred: deferred.clone(),
            shutdown: shutdown.clone(),
        };
        let meter = Meter {
            pool,
            config,
            rx,
            spool,
            pending,
            deferred,
            degraded_until: None,
            next_replay: Instant::now(),
        };
        let task = tokio::spawn(tracing::Instrument::instrument(
            meter.run(shutdown),
            tracing::info_span!("background", task = "meter"),
        ));
        Ok((handle, task))
    }

    async fn run(mut self, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(self.config.retry_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                ev = self.rx.recv() => match ev {
                    Some(first) => {
                        if !self.config.linger.is_zero() && self.rx.len() + 1 < self.config.batch_max {
                            tokio::time::sleep(self.config.linger).await;
                        }
                        let mut batch = vec![first];
                        while batch.len() < self.config.batch_max {
                            match self.rx.try_recv() {
                                Ok(e) => batch.push(e),
                                Err(_) => break,
                            }
                        }
                        self.commit_acked(batch).await;
                    }
                    None => break,
                },
                _ = tick.tick() => {
                    if self.spool.events.load(Ordering::SeqCst) > 0 && Instant::now() >= self.next_replay {
                        self.replay().await;
                    }
                }
            }
        }
        // Deferred events are handed over as the shutdown fires: wait for them (briefly),
        // then drain: everything handed over is committed or spooled before we return.
        let wait = Instant::now() + Duration::from_secs(5);
        while self.deferred.load(Ordering::SeqCst) > 0 && Instant::now() < wait {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        self.rx.close();
        let mut rest = Vec::new();
        while let Some(e) = self.rx.recv().await {
            rest.push(e);
        }
        while !rest.is_empty() {
            let n = rest.len().min(self.config.batch_max.max(1));
            let chunk: Vec<Queued> = rest.drain(..n).collect();
            self.commit_acked(chunk).await;
        }
        if self.spool.events.load(Ordering::SeqCst) > 0 {
            self.degraded_until = None;
            self.replay().await;
        }
    }

    /// Commit (or spool) a batch, then tell the waiting senders.
    async fn commit_acked(&mut self, batch: Vec<Queued>) {
        let (events, acks): (Vec<UsageEvent>, Vec<_>) = batch.into_iter().unzip();
        self.commit(events).await;
        for ack in acks.into_iter().flatten() {
            ack();
        }
    }

    async fn commit(&mut self, batch: Vec<UsageEvent>) {
        let n = batch.len() as u64;
        let degraded = self.degraded_until.is_some_and(|t| Instant::now() < t);
        if !degraded {
            let started = Instant::now();
            match insert(&self.pool, &batch).await {
                Ok(inserted) => {
                    metrics::BATCH_SECONDS.observe(started.elapsed().as_secs_f64());
                    metrics::EVENTS
                        .with_label_values(&["committed"])
                        .inc_by(inserted);
                    metrics::EVENTS
                        .with_label_values(&["duplicate"])
                        .inc_by(n - inserted);
                    self.pending.fetch_sub(n, Ordering::SeqCst);
                    return;
                }
                Err(e) if is_permanent(&e) => {
                    tracing::error!(error = %e, events = n, "ledger batch rejected; retrying row by row");
                    self.commit_rows(batch).await;
                    self.pending.fetch_sub(n, Ordering::SeqCst);
                    return;
                }
                Err(e) => {
                    metrics::COMMIT_FAILURES.inc();
                    tracing::warn!(error = %e, events = n, "postgres unavailable; spooling usage events");
                    self.degraded_until = Some(Instant::now() + self.config.retry_interval);
                    self.next_replay = Instant::now() + self.config.retry_interval;
                }
            }
        }
        self.spool_batch(batch).await;
        self.pending.fetch_sub(n, Ordering::SeqCst);
    }

    async fn commit_rows(&mut self, batch: Vec<UsageEvent>) {
        for ev in batch {
            match insert(&self.pool, std::slice::from_ref(&ev)).await {
                Ok(_) => metrics::EVENTS.with_label_values(&["committed"]).inc(),
                Err(e) if is_permanent(&e) => {
                    tracing::error!(error = %e, request_id = %ev.request_id, "ledger row rejected; kept in the rejected file");
                    let path = self.spool.path.with_extension("rejected");
                    let res =
                        tokio::task::spawn_blocking(move || Spool::append_to(&path, &[ev])).await;
                    if !matches!(res, Ok(Ok(()))) {
                        tracing::error!("could not write the rejected-events file");
                    }
                }
                Err(_) => self.spool_batch(vec![ev]).await,
            }
        }
    }

    async fn spool_batch(&mut self, batch: Vec<UsageEvent>) {
        let spool = self.spool.clone();
        loop {
            let b = batch.clone();
            let s = spool.clone();
            match tokio::task::spawn_blocking(move || s.append(&b)).await {
                Ok(Ok(())) => return,
                // Neither Postgres nor the disk takes it: keep retrying rather than drop it.
                other => {
                    tracing::error!(?other, "cannot write the usage spool; retrying");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    if let Ok(inserted) = insert(&self.pool, &batch).await {
                        metrics::EVENTS
                            .with_label_values(&["committed"])
                            .inc_by(inserted);
                        return;
                    }
                }
            }
        }
    }

    async fn replay(&mut self) {
        let spool = self.spool.clone();
        let (events, total_lines) =
            match tokio::task::spawn_blocking(move || spool.read_all()).await {
                Ok(Ok(read)) => (read.events, read.lines),
                other => {
                    tracing::error!(?other, "cannot read the usage spool");
                    return;
                }
            };
        for chunk in events.chunks(self.config.batch_max.max(1)) {
            match insert(&self.pool, chunk).await {
                Ok(inserted) => {
                    metrics::EVENTS
                        .with_label_values(&["replayed"])
                        .inc_by(inserted);
                }
                Err(e) if is_permanent(&e) => self.commit_rows(chunk.to_vec()).await,
                Err(e) => {
                    tracing::info!(error = %e, "postgres still unavailable; spool kept");
                    self.next_replay = Instant::now() + self.config.retry_interval;
                    self.degraded_until = Some(Instant::now() + self.config.retry_interval);
                    return;
                }
            }
        }
        let spool = self.spool.clone();
        match tokio::task::spawn_blocking(move || spool.consume(total_lines)).await {
            Ok(Ok(())) => {
                tracing::info!(events = events.len(), "usage spool replayed into postgres");
                self.degraded_until = None;
            }
            other => tracing::error!(
                ?other,
                "replayed the spool but could not truncate it; replay is idempotent"
            ),
        }
    }
}

/// A database-side rejection of the rows themselves, as opposed to Postgres being away.
fn is_permanent(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => {
            // Class 23 (integrity) and 22 (data) are about the rows; anything else
            // (shutdown 57P01, too many connections 53300, …) is transient.
            db.code()
                .is_some_and(|c| c.starts_with("23") || c.starts_with("22"))
        }
        _ => false,
    }
}

async fn insert(pool: &PgPool, batch: &[UsageEvent]) -> Result<u64, sqlx::Error> {
    // One array a column, bound to UNNEST.
    let column = |f: fn(&UsageEvent) -> Uuid| batch.iter().map(f).collect::<Vec<Uuid>>();
    let tokens = |f: fn(&UsageEvent) -> u64| batch.iter().map(|e| to_i64(f(e))).collect::<Vec<_>>();
    let at = |f: fn(&UsageEvent) -> chrono::DateTime<chrono::Utc>| {
        batch.iter().map(f).collect::<Vec<_>>()
    };
    let model: Vec<&str> = batch.iter().map(|e| e.model.as_str()).collect();
    let status: Vec<&str> = batch.iter().map(|e| e.status.as_str()).collect();
    let res = sqlx::query(
        "INSERT INTO usage_events (request_id, tenant_id, workspace_id, api_key_id, model, input_tokens, \
         cache_write_5m_tokens, cache_write_1h_tokens, cache_read_tokens, output_tokens, status, started_at, finished_at) \
         SELECT * FROM UNNEST($1::uuid[], $2::uuid[], $3::uuid[], $4::uuid[], $5::text[], $6::int8[], $7::int8[], \
         $8::int8[], $9::int8[], $10::int8[], $11::text[], $12::timestamptz[], $13::timestamptz[]) \
         ON CONFLICT (request_id) DO NOTHING",
    )
    .bind(column(|e| e.request_id.0))
    .bind(column(|e| e.tenant_id.as_uuid()))
    .bind(column(|e| e.workspace_id.as_uuid()))
    .bind(column(|e| e.api_key_id.as_uuid()))
    .bind(&model)
    .bind(tokens(|e| e.input_tokens))
    .bind(tokens(|e| e.cache_write_5m_tokens))
    .bind(tokens(|e| e.cache_write_1h_tokens))
    .bind(tokens(|e| e.cache_read_tokens))
    .bind(tokens(|e| e.output_tokens))
    .bind(&status)
    .bind(at(|e| e.started_at))
    .bind(at(|e| e.finished_at))
    .execute(pool)
    .await?;
    Ok(res.rows_affected())
}

fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::intents::tests::{Dir, event};

    /// A crash mid-append tears the last line; the events appended after the restart are
    /// still read, and so is every event around a line that is not even UTF-8.
    #[test]
    fn a_torn_or_damaged_spool_line_costs_only_itself() {
        let dir = Dir::new();
        let path = dir.path().join("spool.jsonl");
        let (a, b, c) = (event(), event(), event());
        Spool::append_to(&path, std::slice::from_ref(&a)).unwrap();
        // The crash: half of b's line, no newline.
        let line = serde_json::to_vec(&b).unwrap();
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        f.write_all(&line[..line.len() / 2]).unwrap();
        f.write_all(&[0xff, 0xfe]).unwrap();
        drop(f);
        let spool = Spool::open(path.clone()).unwrap();
        spool.append(std::slice::from_ref(&c)).unwrap();
        let read = spool.read_all().unwrap();
        let ids: Vec<_> = read.events.iter().map(|e| e.request_id).collect();
        assert_eq!(ids, vec![a.request_id, c.request_id]);
        assert_eq!(read.lines, 3);
        assert_eq!(read.unreadable.len(), 1);
        // Consuming what was read keeps what came after it.
        let d = event();
        spool.append(std::slice::from_ref(&d)).unwrap();
        spool.consume(read.lines).unwrap();
        let rest = spool.read_all().unwrap();
        assert_eq!(rest.events.len(), 1);
        assert_eq!(rest.events[0].request_id, d.request_id);
    }

    #[test]
    fn event_lines_parse_whatever_bytes_they_are_given() {
        assert_eq!(parse_event_lines(b"").lines, 0);
        assert_eq!(parse_event_lines(b"\n").lines, 1);
        let r = parse_event_lines(b"{\n\xff\n\n");
        assert_eq!((r.lines, r.events.len(), r.unreadable.len()), (3, 0, 3));
    }
}
