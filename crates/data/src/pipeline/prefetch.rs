//! The training loader's prefetch thread (`DATA.CACHE_PREFETCH`, with the planned
//! policy): it walks the rank's read order ahead of the batches already handed to
//! the workers and fills the records that are not cached, in order, each only if
//! the server finds room for it without evicting a record needed sooner: at most as
//! many steps ahead as the workers have in flight (so what it brings is needed
//! soon, and not pushed out again before its use by a read needed sooner), and never
//! further than this rank's share of the cap (the cap over the read orders live on
//! the server, which it asks every half second). A failed prefetch is logged and
//! ends the prefetch, never a batch.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TrySendError};

use crate::cache::{CacheClient, CacheError, Prefetch};

use super::read_order::{ReadOrder, ReadOrderSource, Record};
use super::source::CacheCounters;

/// Where the rank's consumer and dispatcher are, for the prefetch thread.
#[derive(Debug, Default)]
pub(super) struct Progress {
    /// Steps past the dispatched one the prefetch may fill.
    pub(super) lookahead: u64,
    /// The first step not yet handed to the workers.
    pub(super) dispatched: AtomicU64,
    /// The first step the consumer has not taken yet.
    pub(super) consumed: AtomicU64,
}

/// The prefetch thread and how to reach it.
pub(super) struct Prefetcher {
    /// New orders to follow; dropping it stops the thread.
    orders: Option<Sender<ReadOrder>>,
    /// Wakes the thread when the consumer moved.
    wake: Sender<()>,
    thread: Option<JoinHandle<()>>,
}

impl Prefetcher {
    pub(super) fn start(
        address: String,
        name: String,
        source: Arc<ReadOrderSource>,
        progress: Arc<Progress>,
        counters: Arc<CacheCounters>,
    ) -> Result<Prefetcher, CacheError> {
        let (orders, orders_rx) = crossbeam_channel::unbounded();
        let (wake, wake_rx) = crossbeam_channel::bounded(1);
        let thread = std::thread::Builder::new()
            .name("loader-prefetch".into())
            .spawn(move || {
                let client = match CacheClient::connect(&address, &name) {
                    Ok(client) => client,
                    Err(error) => {
                        tracing::warn!(%error, "the loader's prefetch thread cannot connect; no prefetch");
                        return;
                    }
                };
                let walk = Walk {
                    client: &client,
                    source: &source,
                    progress: &progress,
                    counters: &counters,
                };
                walk.run(&orders_rx, &wake_rx);
            })
            .map_err(|e| CacheError::Protocol(format!("cannot start the prefetch thread: {e}")))?;
        Ok(Prefetcher {
            orders: Some(orders),
            wake,
            thread: Some(thread),
        })
    }

    pub(super) fn follow(&self, order: ReadOrder) {
        if let Some(orders) = &self.orders {
            let _ = orders.send(order);
        }
    }

    pub(super) fn wake(&self) {
        match self.wake.try_send(()) {
            Ok(()) | Err(TrySendError::Full(())) | Err(TrySendError::Disconnected(())) => {}
        }
    }
}

impl Drop for Prefetcher {
    fn drop(&mut self) {
        self.orders = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// How long the prefetch thread waits for the consumer before it looks again.
const IDLE_WAIT: Duration = Duration::from_millis(20);
/// How often the prefetch thread asks how many read orders share the cache.
const SHARE_EVERY: Duration = Duration::from_millis(500);

/// This rank's share of the cap: the cap over the read orders live on the server (the
/// ranks of the node, as a rule), asked for again every [`SHARE_EVERY`].
#[derive(Debug, Default)]
struct Share {
    bytes: u64,
    asked: Option<Instant>,
}

impl Share {
    fn of(&mut self, client: &CacheClient) -> u64 {
        if self.asked.is_none_or(|at| at.elapsed() >= SHARE_EVERY) {
            let orders = match client.stats() {
                Ok(report) => report.read_orders.live.max(1),
                Err(error) => {
                    tracing::debug!(%error, "prefetch: no stats; the whole cap is this rank's");
                    1
                }
            };
            self.bytes = client.cap_bytes() / orders as u64;
            self.asked = Some(Instant::now());
        }
        self.bytes
    }
}

/// Why a walk over the read order stopped.
enum Stop {
    /// Nothing more to do until the consumer moves.
    Wait,
    /// The workers overtook the walk: walk again from where they are.
    Again,
    /// The cache failed: prefetch no more.
    Quit,
}

/// The prefetch thread's walk over the read order.
struct Walk<'a> {
    client: &'a CacheClient,
    source: &'a ReadOrderSource,
    progress: &'a Progress,
    counters: &'a CacheCounters,
}

impl Walk<'_> {
    fn run(&self, orders: &Receiver<ReadOrder>, wake: &Receiver<()>) {
        let mut order: Option<ReadOrder> = None;
        let mut share = Share::default();
        loop {
            // Take the newest order; stop when the loader is gone.
            loop {
                match orders.try_recv() {
                    Ok(newer) => order = Some(newer),
                    Err(crossbeam_channel::TryRecvError::Empty) => break,
                    Err(crossbeam_channel::TryRecvError::Disconnected) => return,
                }
            }
            if let Some(order) = &order {
                let budget = share.of(self.client);
                match self.ahead(order, budget) {
                    Stop::Quit => return,
                    Stop::Again => continue,
                    Stop::Wait => {}
                }
            }
            match wake.recv_timeout(IDLE_WAIT) {
                Ok(()) | Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
    }

    /// Fills, in order, the records of the next steps the workers have not been
    /// given yet (up to the lookahead), as long as the records from the consumer's
    /// step on (those the workers read now included) fit the cap; stops at the
    /// first the server declines (everything it could evict is needed sooner).
    fn ahead(&self, order: &ReadOrder, budget: u64) -> Stop {
        let mut seen = HashSet::new();
        let mut ahead_bytes = 0u64;
        let consumed = self.progress.consumed.load(Ordering::Acquire);
        let dispatched = self.progress.dispatched.load(Ordering::Acquire);
        let end = order.end().min(dispatched + self.progress.lookahead);
        for step in consumed.max(order.first_step)..end {
            for &record in order.at(step).unwrap_or(&[]) {
                if !seen.insert(record) {
                    continue;
                }
                let len = self.source.record_len(record);
                ahead_bytes += len;
                if ahead_bytes > budget {
                    return Stop::Wait;
                }
                if step < dispatched {
                    // The workers read it: it takes room, the prefetch leaves it.
                    continue;
                }
                let key = self.source.key(record);
                if self.client.is_cached(key) {
                    continue;
                }
                match self.fill(record, key, len) {
                    Ok(true) => {}
                    Ok(false) => return Stop::Wait,
                    Err(error) => {
                        tracing::warn!(%error, "the loader's prefetch stopped");
                        return Stop::Quit;
                    }
                }
                if self.progress.dispatched.load(Ordering::Acquire) > step {
                    return Stop::Again;
                }
            }
        }
        Stop::Wait
    }

    /// Prefetches one record: `Ok(false)` when the server declines it.
    fn fill(&self, (seq, frame): Record, key: &str, len: u64) -> Result<bool, CacheError> {
        let mut ticket = match self.client.prefetch(key, len)? {
            Prefetch::Present => return Ok(true),
            Prefetch::Declined => return Ok(false),
            Prefetch::Fill(ticket) => ticket,
        };
        if let Err(error) = self
            .source
            .index
            .encode_into(seq, frame, ticket.slot_mut()?)
        {
            // The workers meet the same error and report it: skip the record here.
            tracing::debug!(%error, key, "prefetch: cannot decode; skipped");
            ticket.abort()?;
            return Ok(true);
        }
        drop(ticket.commit()?);
        self.counters.prefetched.fetch_add(1, Ordering::Relaxed);
        self.counters.disk_bytes.fetch_add(len, Ordering::Relaxed);
        Ok(true)
    }
}
