//! The served models and their engine workers, shared fairly.
//!
//! - **A lane per model.** Each model has `workers` generation slots of its own for each
//!   server that runs it (a vLLM upstream's instances each batch their own), so a model's
//!   requests never wait behind another model's (a flood of long SmolLM2 streams leaves
//!   `sim-tiny` untouched).
//! - **Weighted fair queuing within a model.** A request that finds every slot of its model
//!   busy waits in its tenant's queue. When a slot frees, the waiting request with the
//!   smallest *start tag* goes next (start-time fair queuing: a request's tag is the later of
//!   the lane's virtual time and its tenant's previous finish tag, which then grows by
//!   `1 / weight`). While several tenants wait, each gets turns in proportion to its weight
//!   (the tenant policy's `engine_weight`), however many requests it queued; a tenant that
//!   comes back after idling starts at the current virtual time, neither ahead nor behind.
//! - **A cap per tenant.** `max_concurrent` in the tenant policy bounds a tenant's
//!   generations running at once on a model; its further requests wait even with slots free.
//! - **Turns between tokens.** A generation holds its slot only while it is owed it: between
//!   two tokens it hands the slot to a waiting request of a tenant that holds fewer slots
//!   (by weight) and waits for its own next turn ([`EnginePermit::yield_turn`]), as real
//!   engines schedule per iteration. A tenant with many long generations therefore delays
//!   another tenant's request by about one token, not one generation. At most
//!   [`parked_max`] generations of a model wait mid-way at once (each keeps its working
//!   state, which the memory bounds count).
//! - **A bounded queue.** At most `queue` requests wait per model. When it is full, the
//!   tenant holding the most places gives up its newest one (answered 529) to a newcomer of a
//!   tenant holding fewer; otherwise the newcomer is answered 529 at once. One tenant's flood
//!   fills the queue only with places no one else asks for.
//!
//! A permit is handed to a waiter through its channel, so a waiter that gives up (its task
//! cancelled) returns the slot when the channel drops the permit.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cachet_common::TenantId;
use engine::Engine;
use tokio::sync::oneshot;

use crate::error::ApiError;
use crate::metrics;

/// How a tenant shares a model's workers (from its policy).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Share {
    pub tenant: TenantId,
    /// Turns while waiting, relative to other tenants' weights (at least 1).
    pub weight: u32,
    /// Generations running at once on one model, at most.
    pub max_concurrent: Option<u32>,
}

impl Share {
    /// A tenant's share from its policy.
    pub fn of(tenant: TenantId, policy: &control::tenants::policy::Policy) -> Self {
        Self {
            tenant,
            weight: policy.engine_weight.clamp(1, 100) as u32,
            max_concurrent: policy.max_concurrent.map(|m| m.max(1) as u32),
        }
    }
}

pub struct EnginePool {
    engines: Vec<Arc<dyn Engine>>,
    by_id: HashMap<String, usize>,
    /// One lane per engine, in the same order.
    lanes: Vec<Arc<Lane>>,
}

/// How many of a model's generations may wait mid-way for their next turn at once, with
/// `workers` slots: a quarter of them, at least one. Each keeps its working state (the
/// reference engine: its context's KV) while it waits, so a process holds at most
/// `workers + parked_max(workers)` generations.
pub fn parked_max(workers: usize) -> usize {
    workers.div_ceil(4).max(1)
}

/// One model's workers and its waiting requests.
struct Lane {
    model: String,
    workers: usize,
    queue: usize,
    state: Mutex<LaneState>,
    /// Requests waiting (new ones and parked generations), read without the lock between
    /// tokens: a generation looks at the lock only when someone waits.
    waiting_now: AtomicUsize,
}

#[derive(Default)]
struct LaneState {
    busy: usize,
    /// New requests waiting (bounded by the lane's `queue`).
    waiting: usize,
    /// Generations waiting mid-way for their next turn (bounded by [`parked_max`]).
    parked: usize,
    /// The start tag of the request dispatched last.
    vtime: f64,
    /// Arrival order, the tie-break between equal start tags.
    seq: u64,
    tenants: HashMap<TenantId, TenantLane>,
}

struct TenantLane {
    running: usize,
    /// The finish tag of this tenant's newest queued request.
    last_finish: f64,
    weight: f64,
    max_concurrent: usize,
    queue: VecDeque<Waiter>,
}

struct Waiter {
    start: f64,
    seq: u64,
    enqueued: Instant,
    /// A generation that gave its slot away mid-way (not a new request): never displaced,
    /// and not counted against the queue.
    resume: bool,
    tx: oneshot::Sender<Result<EnginePermit, ApiError>>,
}

/// A generation slot of one model, held by one tenant's request; released on drop.
pub struct EnginePermit {
    lane: Arc<Lane>,
    tenant: TenantId,
    /// False once its slot was handed to another request ([`EnginePermit::yield_turn`]).
    live: bool,
}

impl Drop for EnginePermit {
    fn drop(&mut self) {
        if self.live {
            self.lane.release(self.tenant);
        }
    }
}

impl EnginePermit {
    fn new(lane: Arc<Lane>, tenant: TenantId) -> Self {
        Self {
            lane,
            tenant,
            live: true,
        }
    }

    /// Between two tokens: if a waiting request of a tenant holding fewer of this model's
    /// slots (by weight) is owed a turn, hand it this slot and block until this
    /// generation's own next turn (a blocking thread's call: it waits on `rt`). Returns at
    /// once when no one is owed a turn, which is nearly free (one atomic load). An error
    /// means the pool closed while this generation waited.
    pub fn yield_turn(&mut self, rt: &tokio::runtime::Handle) -> Result<(), ApiError> {
        if self.lane.waiting_now.load(Ordering::Relaxed) == 0 {
            return Ok(());
        }
        let Some(rx) = Lane::hand_over(&self.lane, self.tenant) else {
            return Ok(());
        };
        // The slot is the other request's now: this permit no longer releases it.
        self.live = false;
        let next = rt
            .block_on(rx)
            .unwrap_or_else(|_| Err(ApiError::overloaded("Overloaded: the engine pool closed")))?;
        *self = next;
        Ok(())
    }
}

impl std::fmt::Debug for EnginePermit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EnginePermit")
            .field("model", &self.lane.model)
            .field("tenant", &self.tenant)
            .finish()
    }
}

impl EnginePool {
    /// `workers` generation slots per model and server of it ([`Engine::instances`]); at
    /// most `queue` requests wait per model.
    pub fn new(engines: Vec<Arc<dyn Engine>>, workers: usize, queue: usize) -> Self {
        let by_id = engines
            .iter()
            .enumerate()
            .map(|(i, e)| (e.info().id.clone(), i))
            .collect();
        let lanes = engines
            .iter()
            .map(|e| {
                metrics::serving(&e.info().id);
                Arc::new(Lane {
                    model: e.info().id.clone(),
                    workers: workers.max(1) * e.instances().max(1),
                    queue,
                    state: Mutex::new(LaneState::default()),
                    waiting_now: AtomicUsize::new(0),
                })
            })
            .collect();
        Self {
            engines,
            by_id,
            lanes,
        }
    }

    pub fn get(&self, model: &str) -> Option<&Arc<dyn Engine>> {
        self.by_id.get(model).map(|&i| &self.engines[i])
    }

    pub fn all(&self) -> &[Arc<dyn Engine>] {
        &self.engines
    }

    /// A generation slot of `model` for `share`'s tenant: at once if one is free (and the
    /// tenant is under its cap), else after waiting its fair turn; 529 if the model's queue
    /// is full (or this request's place in it is given to another tenant).
    pub async fn acquire(&self, model: &str, share: Share) -> Result<EnginePermit, ApiError> {
        let Some(lane) = self.by_id.get(model).map(|&i| self.lanes[i].clone()) else {
            return Err(ApiError::internal(
                "no engine lane",
                format!("model {model} is not served here"),
            ));
        };
        let rx = match Lane::enter(&lane, share) {
            Entered::Granted(p) => return Ok(p),
            Entered::Refused(e) => return Err(e),
            Entered::Queued(rx) => rx,
        };
        rx.await
            .unwrap_or_else(|_| Err(ApiError::overloaded("Overloaded: the engine pool closed")))
    }
}

enum Entered {
    Granted(EnginePermit),
    Queued(oneshot::Receiver<Result<EnginePermit, ApiError>>),
    Refused(ApiError),
}

/// The waiter owed the next slot: the smallest start tag (then the earliest arrival) among the
/// tenants under their cap that `also` admits; its start tag and tenant.
fn next_waiter(
    st: &LaneState,
    also: impl Fn(&TenantId, &TenantLane) -> bool,
) -> Option<(f64, TenantId)> {
    st.tenants
        .iter()
        .filter(|(id, t)| t.running < t.max_concurrent && also(id, t))
        .filter_map(|(id, t)| t.queue.front().map(|w| (w.start, w.seq, *id)))
        .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)))
        .map(|(start, _, id)| (start, id))
}

fn lock(m: &Mutex<LaneState>) -> std::sync::MutexGuard<'_, LaneState> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Lane {
    fn enter(lane: &Arc<Lane>, share: Share) -> Entered {
        let mut guard = lock(&lane.state);
        let st = &mut *guard;
        let vtime = st.vtime;
        let t = st
            .tenants
            .entry(share.tenant)
            .or_insert_with(|| TenantLane {
                running: 0,
                last_finish: vtime,
                weight: 1.0,
                max_concurrent: usize::MAX,
                queue: VecDeque::new(),
            });
        t.weight = f64::from(share.weight.max(1));
        t.max_concurrent = share
            .max_concurrent
            .map_or(usize::MAX, |m| m.max(1) as usize);
        // Whenever a slot is free, every waiter is one its tenant's cap holds back: a
        // request under its own cap takes the slot without passing anyone eligible.
        if st.busy < lane.workers && t.running < t.max_concurrent && t.queue.is_empty() {
            // Served at once, it still takes its turn's worth of virtual time.
            let start = vtime.max(t.last_finish);
            t.last_finish = start + 1.0 / t.weight;
            st.vtime = start;
            t.running += 1;
            st.busy += 1;
            metrics::ENGINE_WAITS
                .with_label_values(&[lane.model.as_str(), "immediate"])
                .inc();
            return Entered::Granted(EnginePermit::new(lane.clone(), share.tenant));
        }
        if st.waiting >= lane.queue {
            Self::prune(st);
        }
        if st.waiting >= lane.queue
            && let Err(e) = Self::make_room(lane, st, share.tenant)
        {
            return Entered::Refused(e);
        }
        st.seq += 1;
        let seq = st.seq;
        let (tx, rx) = oneshot::channel();
        let t = st
            .tenants
            .get_mut(&share.tenant)
            .expect("the tenant's entry was made above");
        let start = vtime.max(t.last_finish);
        t.last_finish = start + 1.0 / t.weight;
        t.queue.push_back(Waiter {
            start,
            seq,
            enqueued: Instant::now(),
            resume: false,
            tx,
        });
        let depth = t.queue.len();
        st.waiting += 1;
        lane.publish(st);
        metrics::ENGINE_QUEUE
            .with_label_values(&[lane.model.as_str(), &share.tenant.to_string()])
            .set(depth as i64);
        Entered::Queued(rx)
    }

    /// Forget waiters that gave up.
    fn prune(st: &mut LaneState) {
        let (mut gone, mut parked_gone) = (0, 0);
        for t in st.tenants.values_mut() {
            t.queue.retain(|w| {
                let closed = w.tx.is_closed();
                if closed && w.resume {
                    parked_gone += 1;
                } else if closed {
                    gone += 1;
                }
                !closed
            });
        }
        st.waiting -= gone;
        st.parked -= parked_gone;
    }

    /// Mirror the number waiting for the lock-free check between tokens.
    fn publish(&self, st: &LaneState) {
        self.waiting_now
            .store(st.waiting + st.parked, Ordering::Relaxed);
    }

    /// `tenant`'s generation offers its slot between two tokens: the waiting request owed
    /// it most (the smallest start tag among tenants holding fewer slots by weight, under
    /// their caps) takes it, and the generation waits at the front of its tenant's queue
    /// for its next turn. `None`: no one is owed a turn (or enough generations already
    /// wait mid-way), keep going.
    fn hand_over(
        lane: &Arc<Lane>,
        tenant: TenantId,
    ) -> Option<oneshot::Receiver<Result<EnginePermit, ApiError>>> {
        let mut guard = lock(&lane.state);
        let st = &mut *guard;
        if st.parked >= parked_max(lane.workers) {
            return None;
        }
        let (mine, my_weight) = st
            .tenants
            .get(&tenant)
            .map(|t| (t.running as f64, t.weight))?;
        loop {
            let (start, id) = next_waiter(st, |id, t| {
                *id != tenant && (t.running + 1) as f64 / t.weight < mine / my_weight
            })?;
            let w = lane.pop_front(st, id);
            if w.tx.is_closed() {
                lane.publish(st);
                continue;
            }
            st.tenants.get_mut(&id).expect("found above").running += 1;
            st.vtime = st.vtime.max(start);
            lane.note_dispatch(&id, &w);
            if let Err(Ok(mut p)) = w.tx.send(Ok(EnginePermit::new(lane.clone(), id))) {
                // It gave up in between: undo, and look for another.
                p.live = false;
                st.tenants.get_mut(&id).expect("found above").running -= 1;
                lane.publish(st);
                continue;
            }
            // The slot moved from `tenant` to `id`; `tenant`'s generation waits first in
            // its tenant's line, at the current virtual time.
            metrics::ENGINE_TURNS_GIVEN
                .with_label_values(&[lane.model.as_str()])
                .inc();
            st.seq += 1;
            let seq = st.seq;
            let vtime = st.vtime;
            let me = st.tenants.get_mut(&tenant).expect("it holds a slot");
            me.running -= 1;
            let (tx, rx) = oneshot::channel();
            me.queue.push_front(Waiter {
                start: vtime,
                seq,
                enqueued: Instant::now(),
                resume: true,
                tx,
            });
            st.parked += 1;
            lane.publish(st);
            return Some(rx);
        }
    }

    /// Take the first waiter of `id`'s queue, counted out of the lane's waiting (or paused)
    /// requests.
    fn pop_front(&self, st: &mut LaneState, id: TenantId) -> Waiter {
        let t = st.tenants.get_mut(&id).expect("the tenant has a waiter");
        let w = t.queue.pop_front().expect("the tenant has a waiter");
        metrics::ENGINE_QUEUE
            .with_label_values(&[self.model.as_str(), &id.to_string()])
            .set(t.queue.len() as i64);
        if w.resume {
            st.parked -= 1;
        } else {
            st.waiting -= 1;
        }
        w
    }

    /// A waiter gets its slot: how long it waited, by outcome.
    fn note_dispatch(&self, id: &TenantId, w: &Waiter) {
        metrics::ENGINE_WAIT_SECONDS
            .with_label_values(&[self.model.as_str(), &id.to_string()])
            .inc_by(w.enqueued.elapsed().as_secs_f64());
        metrics::ENGINE_WAITS
            .with_label_values(&[
                self.model.as_str(),
                if w.resume { "resumed" } else { "queued" },
            ])
            .inc();
    }

    /// The queue is full: take the newest place of the tenant holding the most, if it holds
    /// more than `tenant` would after joining; else refuse `tenant`'s request.
    fn make_room(lane: &Lane, st: &mut LaneState, tenant: TenantId) -> Result<(), ApiError> {
        let mine = st.tenants.get(&tenant).map_or(0, |t| t.queue.len());
        let heaviest = st
            .tenants
            .iter()
            .filter(|(id, _)| **id != tenant)
            .max_by_key(|(_, t)| t.queue.len())
            .map(|(id, t)| (*id, t.queue.len()));
        // A generation waiting mid-way for its turn (at a queue's front) is not a place to
        // give away.
        let takeable = |id: &TenantId| {
            st.tenants
                .get(id)
                .and_then(|t| t.queue.back())
                .is_some_and(|w| !w.resume)
        };
        match heaviest {
            Some((other, n)) if n > mine + 1 && takeable(&other) => {
                let t = st.tenants.get_mut(&other).expect("found above");
                if let Some(w) = t.queue.pop_back() {
                    t.last_finish -= 1.0 / t.weight;
                    st.waiting -= 1;
                    metrics::ENGINE_WAITS
                        .with_label_values(&[lane.model.as_str(), "displaced"])
                        .inc();
                    let _ = w.tx.send(Err(lane.full(
                        "its place in the queue went to a tenant with fewer requests waiting",
                    )));
                }
                Ok(())
            }
            _ => {
                metrics::ENGINE_WAITS
                    .with_label_values(&[lane.model.as_str(), "refused"])
                    .inc();
                Err(lane.full("this tenant already holds its share of the queue"))
            }
        }
    }

    fn full(&self, why: &str) -> ApiError {
        ApiError::overloaded(format!(
            "Overloaded: all {} workers of model {} are busy and {} requests already wait; {why}",
            self.workers, self.model, self.queue
        ))
    }

    /// A slot comes back: hand it to the next waiter in fair order.
    fn release(self: &Arc<Self>, tenant: TenantId) {
        let mut unclaimed = Vec::new();
        {
            let mut guard = lock(&self.state);
            let st = &mut *guard;
            st.busy = st.busy.saturating_sub(1);
            if let Some(t) = st.tenants.get_mut(&tenant) {
                t.running = t.running.saturating_sub(1);
            }
            while st.busy < self.workers {
                let Some((start, id)) = next_waiter(st, |_, _| true) else {
                    break;
                };
                let w = self.pop_front(st, id);
                if w.tx.is_closed() {
                    continue;
                }
                st.tenants.get_mut(&id).expect("found above").running += 1;
                st.busy += 1;
                st.vtime = st.vtime.max(start);
                self.note_dispatch(&id, &w);
                let permit = EnginePermit::new(self.clone(), id);
                // A waiter gone since the check hands the permit back when it drops, after
                // the lock is released.
                if let Err(Ok(p)) = w.tx.send(Ok(permit)) {
                    unclaimed.push(p);
                }
            }
            self.publish(st);
            // Tenants with nothing running or waiting leave the lane (they rejoin at the
            // virtual time then current).
            st.tenants
                .retain(|_, t| t.running > 0 || !t.queue.is_empty());
        }
        drop(unclaimed);
    }

    #[cfg(test)]
    fn counts(&self) -> (usize, usize) {
        let st = lock(&self.state);
        (st.busy, st.waiting)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lane(workers: usize, queue: usize) -> Arc<Lane> {
        Arc::new(Lane {
            model: "m".into(),
            workers,
            queue,
            state: Mutex::new(LaneState::default()),
            waiting_now: AtomicUsize::new(0),
        })
    }

    fn share(tenant: TenantId, weight: u32) -> Share {
        Share {
            tenant,
            weight,
            max_concurrent: None,
        }
    }

    fn granted(e: Entered) -> EnginePermit {
        match e {
            Entered::Granted(p) => p,
            _ => panic!("not granted at once"),
        }
    }

    fn queued(e: Entered) -> oneshot::Receiver<Result<EnginePermit, ApiError>> {
        match e {
            Entered::Queued(rx) => rx,
            Entered::Granted(_) => panic!("granted, not queued"),
            Entered::Refused(e) => panic!("refused: {}", e.body().error.message),
        }
    }

    /// Which queued requests have their permit, in the order given.
    fn ready(rxs: &mut [(char, oneshot::Receiver<Result<EnginePermit, ApiError>>)]) -> Vec<char> {
        rxs.iter_mut()
            .filter_map(|(c, rx)| match rx.try_recv() {
                Ok(Ok(p)) => {
                    std::mem::forget(p); // keeps its slot
                    Some(*c)
                }
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_newcomer_goes_before_a_flooding_tenant_s_backlog() {
        let l = lane(2, 64);
        let (a, b) = (TenantId::new(), TenantId::new());
        let held: Vec<_> = (0..2)
            .map(|_| granted(Lane::enter(&l, share(a, 1))))
            .collect();
        let mut waiting: Vec<_> = (0..10)
            .map(|_| ('a', queued(Lane::enter(&l, share(a, 1)))))
            .collect();
        waiting.push(('b', queued(Lane::enter(&l, share(b, 1)))));
        // One of A's generations ends: B's one request goes before A's ten.
        let mut it = held.into_iter();
        drop(it.next());
        assert_eq!(ready(&mut waiting), vec!['b']);
    }

    #[test]
    fn turns_follow_the_weights_while_both_wait() {
        let l = lane(1, 256);
        let (a, b) = (TenantId::new(), TenantId::new());
        let first = granted(Lane::enter(&l, share(a, 1)));
        let mut rxs: Vec<(char, _)> = Vec::new();
        for _ in 0..30 {
            rxs.push(('a', queued(Lane::enter(&l, share(a, 1)))));
            rxs.push(('b', queued(Lane::enter(&l, share(b, 2)))));
        }
        // Serve 30 turns one at a time: B (weight 2) gets two for each of A's.
        let mut order = Vec::new();
        let mut current = Some(first);
        for _ in 0..30 {
            drop(current.take());
            let next = rxs
                .iter_mut()
                .find_map(|(c, rx)| rx.try_recv().ok().map(|p| (*c, p.unwrap())));
            let (c, p) = next.expect("a slot was handed on");
            order.push(c);
            current = Some(p);
        }
        let bs = order.iter().filter(|c| **c == 'b').count();
        assert_eq!(bs, 20, "{order:?}");
    }

    #[test]
    fn a_tenant_s_cap_holds_its_requests_back_while_others_run() {
        let l = lane(4, 64);
        let (a, b) = (TenantId::new(), TenantId::new());
        let capped = Share {
            max_concurrent: Some(1),
            ..share(a, 1)
        };
        let _running = granted(Lane::enter(&l, capped));
        let mut rx = queued(Lane::enter(&l, capped));
        // Slots are free, but A is at its cap; B still gets one at once.
        let _b = granted(Lane::enter(&l, share(b, 1)));
        assert!(rx.try_recv().is_err());
        drop(_running);
        assert!(
            rx.try_recv().unwrap().is_ok(),
            "A's next runs once its first ends"
        );
    }

    #[test]
    fn a_full_queue_gives_the_flooder_s_newest_place_to_another_tenant() {
        let l = lane(1, 4);
        let (a, b) = (TenantId::new(), TenantId::new());
        let _held = granted(Lane::enter(&l, share(a, 1)));
        let mut rxs: Vec<_> = (0..4)
            .map(|_| queued(Lane::enter(&l, share(a, 1))))
            .collect();
        // A fifth of A's is refused: A holds the whole queue.
        assert!(matches!(Lane::enter(&l, share(a, 1)), Entered::Refused(_)));
        // B's first takes A's newest place; A's displaced request is answered 529.
        let _b = queued(Lane::enter(&l, share(b, 1)));
        let last = rxs.pop().unwrap();
        let displaced = last.blocking_recv().unwrap().unwrap_err();
        assert!(displaced.body().error.message.contains("Overloaded"));
        assert_eq!(l.counts(), (1, 4));
    }

    #[test]
    fn a_waiter_that_gives_up_returns_its_slot() {
        let l = lane(1, 8);
        let (a, b) = (TenantId::new(), TenantId::new());
        let held = granted(Lane::enter(&l, share(a, 1)));
        let gone = queued(Lane::enter(&l, share(b, 1)));
        let mut next = queued(Lane::enter(&l, share(a, 1)));
        drop(gone);
        drop(held);
        // B's abandoned place is skipped; A's next request runs.
        let running = next.try_recv().unwrap().unwrap();
        assert_eq!(l.counts(), (1, 0));
        drop(running);
        assert_eq!(l.counts(), (0, 0), "and its slot comes back when it ends");
    }

    #[test]
    fn a_flooder_s_generation_hands_its_slot_to_a_newcomer_between_tokens() {
        let l = lane(2, 64);
        let (a, b) = (TenantId::new(), TenantId::new());
        let _held: Vec<_> = (0..2)
            .map(|_| granted(Lane::enter(&l, share(a, 1))))
            .collect();
        let mut backlog: Vec<_> = (0..3)
            .map(|_| ('a', queued(Lane::enter(&l, share(a, 1)))))
            .collect();
        let mut newcomer = queued(Lane::enter(&l, share(b, 1)));
        let mut parked = Lane::hand_over(&l, a).expect("B holds no slot: it is owed one");
        let b_runs = newcomer.try_recv().unwrap().unwrap();
        assert!(
            parked.try_recv().is_err(),
            "A's generation waits for its turn"
        );
        assert_eq!(
            l.counts(),
            (2, 3),
            "no slot was added, A's backlog still waits"
        );
        // B's request ends: A's paused generation goes on before A's new requests.
        drop(b_runs);
        let _resumed = parked.try_recv().unwrap().unwrap();
        assert!(ready(&mut backlog).is_empty());
    }

    #[test]
    fn no_turn_is_owed_to_a_tenant_holding_as_many_slots_or_to_oneself() {
        let l = lane(2, 64);
        let (a, b) = (TenantId::new(), TenantId::new());
        let _a = granted(Lane::enter(&l, share(a, 1)));
        let _b = granted(Lane::enter(&l, share(b, 1)));
        let _b_waits = queued(Lane::enter(&l, share(b, 1)));
        let _a_waits = queued(Lane::enter(&l, share(a, 1)));
        // B holds one slot as A does: taking A's would make B hold more.
        assert!(Lane::hand_over(&l, a).is_none());
        assert!(Lane::hand_over(&l, b).is_none());
        // With weight 3, B is owed a second slot while A holds one.
        let l = lane(2, 64);
        let _a1 = granted(Lane::enter(&l, share(a, 1)));
        let _a2 = granted(Lane::enter(&l, share(a, 1)));
        let _b1 = queued(Lane::enter(&l, share(b, 3)));
        let _b2 = queued(Lane::enter(&l, share(b, 3)));
        assert!(Lane::hand_over(&l, a).is_some());
        assert!(
            Lane::hand_over(&l, a).is_none(),
            "A holds one now, B's weight gives it 1/3"
        );
    }

    #[test]
    fn at_most_a_quarter_of_the_workers_wait_mid_way() {
        let l = lane(4, 64);
        assert_eq!(parked_max(4), 1);
        let (a, b) = (TenantId::new(), TenantId::new());
        let _held: Vec<_> = (0..4)
            .map(|_| granted(Lane::enter(&l, share(a, 1))))
            .collect();
        let _b: Vec<_> = (0..2)
            .map(|_| queued(Lane::enter(&l, share(b, 1))))
            .collect();
        let _parked = Lane::hand_over(&l, a).expect("a first hand-over");
        assert!(
            Lane::hand_over(&l, a).is_none(),
            "one generation already waits mid-way"
        );
    }

    #[test]
    fn a_waiting_generation_is_never_displaced_from_a_full_queue() {
        let l = lane(8, 1);
        let (a, b, c, d) = (
            TenantId::new(),
            TenantId::new(),
            TenantId::new(),
            TenantId::new(),
        );
        let _held: Vec<_> = (0..8)
            .map(|_| granted(Lane::enter(&l, share(a, 1))))
            .collect();
        let mut parked = Vec::new();
        let mut b_running = Vec::new();
        for _ in 0..2 {
            let mut rx = queued(Lane::enter(&l, share(b, 1)));
            parked.push(Lane::hand_over(&l, a).expect("B is owed a slot"));
            b_running.push(rx.try_recv().unwrap().unwrap());
        }
        // A's two paused generations wait at the front of its line; C fills the one place.
        let _c = queued(Lane::enter(&l, share(c, 1)));
        // D finds the queue full: A holds the most places, but they are paused generations,
        // not places to give away, so D is refused and A's stay.
        assert!(matches!(Lane::enter(&l, share(d, 1)), Entered::Refused(_)));
        assert!(parked.iter_mut().all(|rx| rx.try_recv().is_err()));
        assert_eq!(l.counts(), (8, 1));
    }

    #[test]
    fn yield_turn_blocks_until_the_generation_s_next_turn() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let l = lane(2, 8);
        let (a, b) = (TenantId::new(), TenantId::new());
        let _other = granted(Lane::enter(&l, share(a, 1)));
        let mut long = granted(Lane::enter(&l, share(a, 1)));
        // No one waits: the call returns at once and the slot stays.
        long.yield_turn(rt.handle()).unwrap();
        let short = queued(Lane::enter(&l, share(b, 1)));
        let handle = rt.handle().clone();
        let generation = std::thread::spawn(move || {
            long.yield_turn(&handle).unwrap();
            long
        });
        let b_permit = short
            .blocking_recv()
            .expect("the generation handed over its slot")
            .unwrap();
        assert!(!generation.is_finished(), "it waits while B holds the slot");
        drop(b_permit);
        let long = generation.join().unwrap();
        assert_eq!(l.counts(), (2, 0), "the generation holds its slot again");
        drop(long);
        assert_eq!(l.counts(), (1, 0));
    }

    #[tokio::test]
    async fn models_never_wait_behind_each_other() {
        let pool = EnginePool::new(
            vec![
                Arc::new(engine::sim::SimEngine::new(
                    engine::sim::SimProfile::tiny(),
                    0.0,
                )),
                Arc::new(engine::sim::SimEngine::new(
                    engine::sim::SimProfile::llama_8b(),
                    0.0,
                )),
            ],
            1,
            8,
        );
        let ids: Vec<String> = pool.all().iter().map(|e| e.info().id.clone()).collect();
        let a = TenantId::new();
        let _busy = pool.acquire(&ids[0], share(a, 1)).await.unwrap();
        // The first model's only worker is taken; the second model's is free.
        let other = tokio::time::timeout(
            std::time::Duration::from_secs(5),
            pool.acquire(&ids[1], share(a, 1)),
        )
        .await;
        assert!(matches!(other, Ok(Ok(_))));
    }

    /// A model run by two servers (as a vLLM upstream with two instances).
    struct TwoServers(engine::sim::SimEngine);

    impl Engine for TwoServers {
        fn info(&self) -> &engine::ModelInfo {
            self.0.info()
        }
        fn render(&self, prompt: &engine::Prompt) -> Result<engine::Rendered, engine::EngineError> {
            self.0.render(prompt)
        }
        fn start(
            &self,
            req: engine::GenerateRequest,
        ) -> Result<Box<dyn engine::Generation>, engine::EngineError> {
            self.0.start(req)
        }
        fn nominal_prefill_per_token(&self) -> std::time::Duration {
            self.0.nominal_prefill_per_token()
        }
        fn instances(&self) -> usize {
            2
        }
    }

    #[tokio::test]
    async fn a_model_gets_its_workers_for_each_server_of_it() {
        let pool = EnginePool::new(
            vec![Arc::new(TwoServers(engine::sim::SimEngine::new(
                engine::sim::SimProfile::tiny(),
                0.0,
            )))],
            1,
            8,
        );
        let id = pool.all()[0].info().id.clone();
        let a = TenantId::new();
        let wait = std::time::Duration::from_millis(200);
        let first = tokio::time::timeout(wait, pool.acquire(&id, share(a, 1))).await;
        let second = tokio::time::timeout(wait, pool.acquire(&id, share(a, 1))).await;
        assert!(matches!(first, Ok(Ok(_))) && matches!(second, Ok(Ok(_))));
        // Two servers, one worker each: the third waits.
        let third = tokio::time::timeout(wait, pool.acquire(&id, share(a, 1))).await;
        assert!(third.is_err(), "a third generation must wait for a slot");
    }
}
