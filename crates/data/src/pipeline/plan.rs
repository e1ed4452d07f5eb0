//! The training loader's side of the cache's planned policy (`DATA.CACHE_POLICY:
//! planned`). A rank's sample order is a pure function of the seed, the epoch and
//! the sampler's settings, so its loader can tell the cache server what it will
//! read: when it starts an epoch (or resumes mid-epoch) it announces the records of
//! the rest of that epoch and of the whole next one, step by step, naming its
//! worker connections as the plan's readers, and after every batch it writes how
//! far the consumer has got into its own pin page (no message). The server then
//! evicts the record needed last.
//!
//! With `DATA.CACHE_PREFETCH` a thread of the loader walks the plan ahead of the
//! batches already handed to the workers and fills the records that are not
//! cached, in order, each only if the server finds room for it without evicting a
//! record needed sooner: at most as many steps ahead as the workers have in flight
//! (so what it brings is needed soon, and not pushed out again before its use by a
//! read needed sooner), and never further than this rank's share of the cap (the
//! cap over the plans live on the server, which it asks every half second).
//!
//! Nothing here can fail a batch: a plan the server refuses, or a prefetch that
//! fails, is logged, and the cache goes on by LRU for what no plan names.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TrySendError};

use crate::cache::protocol::{ClientId, PlanAnnouncement};
use crate::cache::{CacheClient, CacheError, Prefetch};
use crate::dataset::index::DatasetIndex;

use super::sample::ClipIndex;
use super::sampler::DistributedSampler;
use super::source::CacheCounters;

/// A record: (sequence, frame).
type Record = (usize, usize);

/// The records a rank reads, step by step, from one step on.
#[derive(Debug, Clone)]
pub struct ReadOrder {
    /// The step of `steps[0]`.
    pub first_step: u64,
    /// Per step (a sampler position), its records in the order they are read.
    pub steps: Vec<Vec<Record>>,
}

impl ReadOrder {
    /// The records of step `step`, if this order covers it.
    fn at(&self, step: u64) -> Option<&[Record]> {
        let i = usize::try_from(step.checked_sub(self.first_step)?).ok()?;
        self.steps.get(i).map(Vec::as_slice)
    }

    /// The step after the last one covered.
    fn end(&self) -> u64 {
        self.first_step + self.steps.len() as u64
    }
}

/// How a rank's sampler positions become plan steps and records.
pub struct PlanSource {
    index: Arc<DatasetIndex>,
    clips: Arc<ClipIndex>,
    sampler: DistributedSampler,
    /// Positions of an epoch that are read (the rest of an incomplete last batch
    /// is dropped).
    read_per_epoch: usize,
    /// Each record's cache key, by sequence and frame.
    keys: Vec<Vec<String>>,
}

impl PlanSource {
    /// The plan of `sampler`'s rank over `clips` of `index`; `read_per_epoch`
    /// positions of each epoch are read.
    pub fn new(
        index: Arc<DatasetIndex>,
        clips: Arc<ClipIndex>,
        sampler: &DistributedSampler,
        read_per_epoch: usize,
    ) -> PlanSource {
        let keys = index
            .sequences
            .iter()
            .enumerate()
            .map(|(seq, s)| {
                (0..s.frames.len())
                    .map(|frame| index.record_key(seq, frame))
                    .collect()
            })
            .collect();
        PlanSource {
            index,
            clips,
            sampler: sampler.clone(),
            read_per_epoch,
            keys,
        }
    }

    /// The plan step of sampler position `position` of `epoch`: steps run on
    /// across epochs, the same on every rank (lockstep).
    pub fn step(&self, epoch: u64, position: usize) -> u64 {
        epoch * self.sampler.num_samples() as u64 + position as u64
    }

    /// The reads from `position` of `epoch` to the end of the next epoch.
    pub fn order_from(&self, epoch: u64, position: usize) -> ReadOrder {
        let mut steps = Vec::new();
        for (e, from) in [(epoch, position), (epoch + 1, 0)] {
            let order = self.sampler.epoch_indices(e);
            let read = order.len().min(self.read_per_epoch);
            for (p, &clip_no) in order.iter().enumerate().skip(from) {
                steps.push(match p < read {
                    true => self.clip_records(clip_no),
                    false => Vec::new(),
                });
            }
        }
        ReadOrder {
            first_step: self.step(epoch, position),
            steps,
        }
    }

    /// The records of clip `clip_no`, in the order a sample reads them.
    fn clip_records(&self, clip_no: usize) -> Vec<Record> {
        let clip = self.clips.clips[clip_no];
        (clip.start..clip.start + self.clips.len)
            .map(|frame| (clip.seq, frame))
            .collect()
    }

    /// `order` as the server takes it, with `readers` reading for it.
    pub fn announcement(&self, order: &ReadOrder, readers: &[ClientId]) -> PlanAnnouncement {
        let mut ids: Vec<Vec<Option<u32>>> = self
            .keys
            .iter()
            .map(|frames| vec![None; frames.len()])
            .collect();
        let mut keys = Vec::new();
        let steps = order
            .steps
            .iter()
            .map(|records| {
                records
                    .iter()
                    .map(|&(seq, frame)| {
                        *ids[seq][frame].get_or_insert_with(|| {
                            keys.push(self.keys[seq][frame].clone());
                            keys.len() as u32 - 1
                        })
                    })
                    .collect()
            })
            .collect();
        PlanAnnouncement {
            first_step: order.first_step,
            keys,
            steps,
            readers: readers.to_vec(),
        }
    }

    fn key(&self, (seq, frame): Record) -> &str {
        &self.keys[seq][frame]
    }

    fn record_len(&self, (seq, frame): Record) -> u64 {
        self.index.record_layout(seq, frame).byte_len() as u64
    }
}

/// Where the rank's consumer and dispatcher are, for the prefetch thread.
#[derive(Debug, Default)]
struct Progress {
    /// Steps past the dispatched one the prefetch may fill.
    lookahead: u64,
    /// The first step not yet handed to the workers.
    dispatched: AtomicU64,
    /// The first step the consumer has not taken yet.
    consumed: AtomicU64,
}

/// One rank's announcer of its plan (and its prefetch thread).
pub struct PlanFeed {
    source: Arc<PlanSource>,
    client: CacheClient,
    readers: Vec<ClientId>,
    /// The epoch whose plan was announced last.
    announced: Option<u64>,
    /// Set when the server refused a plan: no more are sent.
    given_up: bool,
    progress: Arc<Progress>,
    prefetch: Option<Prefetcher>,
}

impl PlanFeed {
    /// Connects the announcing connection (`name`/plan) to the server at `address`;
    /// `readers` are the loader's worker connections. With `prefetch` (`Some(n)`), a
    /// thread fills records up to `n` steps ahead of the workers, counting them in
    /// `counters`.
    pub fn connect(
        address: &str,
        name: &str,
        source: PlanSource,
        readers: Vec<ClientId>,
        prefetch: Option<u64>,
        counters: Arc<CacheCounters>,
    ) -> Result<PlanFeed, CacheError> {
        let client = CacheClient::connect(address, &format!("{name}/plan"))?;
        let source = Arc::new(source);
        let progress = Arc::new(Progress {
            lookahead: prefetch.unwrap_or(0).max(1),
            ..Progress::default()
        });
        let prefetch = match prefetch.is_some() {
            true => Some(Prefetcher::start(
                address.to_string(),
                format!("{name}/prefetch"),
                Arc::clone(&source),
                Arc::clone(&progress),
                counters,
            )?),
            false => None,
        };
        Ok(PlanFeed {
            source,
            client,
            readers,
            announced: None,
            given_up: false,
            progress,
            prefetch,
        })
    }

    /// Called before the sample at `position` of `epoch` goes to the workers: the
    /// first time in an epoch, the plan from there on is announced.
    pub fn dispatching(&mut self, epoch: u64, position: usize) {
        if self.announced != Some(epoch) && !self.given_up {
            self.announce(epoch, position);
        }
    }

    /// The samples before `position` of `epoch` are with the workers.
    pub fn dispatched(&self, epoch: u64, position: usize) {
        let step = self.source.step(epoch, position);
        self.progress.dispatched.store(step, Ordering::Release);
    }

    fn announce(&mut self, epoch: u64, position: usize) {
        let order = self.source.order_from(epoch, position);
        let plan = self.source.announcement(&order, &self.readers);
        self.client.set_plan_progress(order.first_step);
        self.progress
            .consumed
            .store(order.first_step, Ordering::Release);
        match self.client.announce_plan(plan) {
            Ok(()) => {
                self.announced = Some(epoch);
                if let Some(prefetch) = &self.prefetch {
                    prefetch.follow(order);
                }
            }
            Err(error) => {
                tracing::warn!(%error, epoch, "the cache refused this rank's read plan; it evicts by LRU");
                self.given_up = true;
            }
        }
    }

    /// The consumer has taken every sample before `position` of `epoch`.
    pub fn consumed(&self, epoch: u64, position: usize) {
        let step = self.source.step(epoch, position);
        self.client.set_plan_progress(step);
        self.progress.consumed.store(step, Ordering::Release);
        if let Some(prefetch) = &self.prefetch {
            prefetch.wake();
        }
    }
}

/// The prefetch thread and how to reach it.
struct Prefetcher {
    /// New orders to follow; dropping it stops the thread.
    orders: Option<Sender<ReadOrder>>,
    /// Wakes the thread when the consumer moved.
    wake: Sender<()>,
    thread: Option<JoinHandle<()>>,
}

impl Prefetcher {
    fn start(
        address: String,
        name: String,
        source: Arc<PlanSource>,
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

    fn follow(&self, order: ReadOrder) {
        if let Some(orders) = &self.orders {
            let _ = orders.send(order);
        }
    }

    fn wake(&self) {
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
/// How often the prefetch thread asks how many plans share the cache.
const SHARE_EVERY: Duration = Duration::from_millis(500);

/// This rank's share of the cap: the cap over the plans live on the server (the
/// ranks of the node, as a rule), asked for again every [`SHARE_EVERY`].
#[derive(Debug, Default)]
struct Share {
    bytes: u64,
    asked: Option<Instant>,
}

impl Share {
    fn of(&mut self, client: &CacheClient) -> u64 {
        if self.asked.is_none_or(|at| at.elapsed() >= SHARE_EVERY) {
            let plans = match client.stats() {
                Ok(report) => report.plan.plans.max(1),
                Err(error) => {
                    tracing::debug!(%error, "prefetch: no stats; the whole cap is this rank's");
                    1
                }
            };
            self.bytes = client.cap_bytes() / plans as u64;
            self.asked = Some(Instant::now());
        }
        self.bytes
    }
}

/// Why a walk over the plan stopped.
enum Stop {
    /// Nothing more to do until the consumer moves.
    Wait,
    /// The workers overtook the walk: walk again from where they are.
    Again,
    /// The cache failed: prefetch no more.
    Quit,
}

/// The prefetch thread's walk over the plan.
struct Walk<'a> {
    client: &'a CacheClient,
    source: &'a PlanSource,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_order_covers_the_rest_of_the_epoch_and_the_next_one() {
        let order = ReadOrder {
            first_step: 10,
            steps: vec![vec![(0, 1)], vec![], vec![(1, 2), (1, 3)]],
        };
        assert_eq!(order.at(9), None);
        assert_eq!(order.at(10), Some(&[(0, 1)][..]));
        assert_eq!(order.at(12), Some(&[(1, 2), (1, 3)][..]));
        assert_eq!(order.at(13), None);
        assert_eq!(order.end(), 13);
    }
}
