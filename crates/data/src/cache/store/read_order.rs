//! The planned policy's bookkeeping: what each reader announced it will read, step by
//! step, how far it has got, which connections read for it, and from all of that
//! each record's next use, which it keeps current in the store's
//! [`EvictionIndex`]. A training rank's order is a pure function of the seed, the
//! epoch and the sampler's settings, so it can tell the cache its future; from
//! these read orders the store evicts the record needed last (Belady's rule)
//! instead of the one used longest ago.
//!
//! A read order belongs to the connection that announced it (a rank's loader) and
//! goes with it: a rank that restarts, or a read order whose steps are all behind
//! its reader, leaves its records unneeded, and the store evicts those by LRU as
//! before. A use is past once the reader's progress (a word it writes into its own
//! pin page, no message) is beyond its step, or once one of the read order's reader
//! connections has read the record for it (so a record read early in the prefetch
//! window is not kept until the step is consumed). Read orders of one job step
//! together (its ranks meet at every all-reduce); jobs step at their own rates, so
//! uses compare by the time they are expected ([`pace`](super::pace)): the
//! steps ahead of the job's progress at the job's measured rate.
//!
//! The store learns of most reads late (clients record hits in their pin pages,
//! read when a record needs room), when the reader's progress may have passed the
//! read's step: a read uses up the read order's earliest use not used yet, past or
//! not, and past uses are dropped only once they are [`GRACE`] steps behind.
//!
//! Every change costs in proportion to what changed, never to the store: a read
//! order keeps its uses in step order with, for each use, where its record is used
//! next (so progress walks only the uses it passes, and a read moves one record to
//! its following use); a record's next use over every read order is recomputed
//! from the few read orders that name it. What read orders hold is bounded per
//! read order and, in bytes, over all of a server's ([`ReadOrders::budget`]).

use std::collections::HashMap;
use std::sync::Arc;

use super::super::ids::ClientId;
use super::super::protocol::{ReadOrderAnnouncement, RequestError};
use super::super::stats::ReadOrderStats;
use super::arena::SlotIdx;
use super::eviction::EvictionIndex;
use super::pace::{Micros, Pace, DEFAULT_RATE};

use super::super::announcement::{
    BYTES_PER_KEY, BYTES_PER_ORDER, BYTES_PER_ORDER_KEY, BYTES_PER_USE,
};
pub use super::super::announcement::{
    MAX_ORDER_KEYS, MAX_ORDER_READERS, MAX_ORDER_STEPS, MAX_ORDER_USES,
};

/// Steps a use stays after the reader's progress passed it, for a read the store
/// learns of late to use it up (rather than a use to come).
pub const GRACE: u64 = 4096;
/// What the read orders of one server may hold, by default (`--read-order-budget`).
pub const DEFAULT_BUDGET: u64 = 256 << 20;

/// No position.
const NONE: u32 = u32::MAX;

/// Where a record stands for the planned policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Standing {
    /// Some read order reads it, the soonest at this time on the store's clock.
    Needed {
        /// When it is expected.
        at: Micros,
    },
    /// No read order reads it again.
    Unneeded,
}

/// The connection that announces a read order.
#[derive(Debug, Clone)]
pub struct Announcer {
    /// Its id.
    pub client: ClientId,
    /// Its pin page, where its reader writes its progress.
    pub page: usize,
    /// The job it reads for (`""`: none; its pace is then its own).
    pub job: String,
}

/// A record by id, in the table of records that read orders name.
type KeyId = u32;
/// A read order by its place among the live ones.
type StreamIdx = u32;
/// A job's pace by its place among the live ones.
type PaceIdx = u32;

/// A record some read order names.
#[derive(Debug)]
struct KeyEntry {
    name: Arc<str>,
    /// The read orders that name it, with its index in each.
    named_by: Vec<(StreamIdx, u32)>,
    /// Its slot while it is cached.
    slot: Option<SlotIdx>,
}

/// The records read orders name, each once however many name it.
#[derive(Debug, Default)]
struct Keys {
    ids: HashMap<Arc<str>, KeyId>,
    entries: Vec<Option<KeyEntry>>,
    free: Vec<KeyId>,
    /// Bytes of the entries and names.
    bytes: u64,
}

impl Keys {
    fn id(&self, name: &str) -> Option<KeyId> {
        self.ids.get(name).copied()
    }

    fn get(&self, id: KeyId) -> Option<&KeyEntry> {
        self.entries.get(id as usize).and_then(Option::as_ref)
    }

    fn get_mut(&mut self, id: KeyId) -> Option<&mut KeyEntry> {
        self.entries.get_mut(id as usize).and_then(Option::as_mut)
    }

    /// `name`'s id, entered if new (with its slot if cached).
    fn intern(&mut self, name: &str, cached: &dyn Fn(&str) -> Option<SlotIdx>) -> KeyId {
        if let Some(id) = self.id(name) {
            return id;
        }
        let name: Arc<str> = Arc::from(name);
        let entry = KeyEntry {
            name: Arc::clone(&name),
            named_by: Vec::new(),
            slot: cached(&name),
        };
        self.bytes += BYTES_PER_KEY + name.len() as u64;
        let id = match self.free.pop() {
            Some(id) => {
                self.entries[id as usize] = Some(entry);
                id
            }
            None => {
                self.entries.push(Some(entry));
                (self.entries.len() - 1) as KeyId
            }
        };
        self.ids.insert(name, id);
        id
    }

    /// Drops `id` if no read order names it and it is not cached.
    fn release_if_unused(&mut self, id: KeyId) {
        let unused = self
            .get(id)
            .is_some_and(|e| e.named_by.is_empty() && e.slot.is_none());
        if !unused {
            return;
        }
        if let Some(entry) = self.entries[id as usize].take() {
            self.ids.remove(&entry.name);
            self.bytes -= BYTES_PER_KEY + entry.name.len() as u64;
            self.free.push(id);
        }
    }
}

/// One reader's announced uses.
#[derive(Debug)]
struct Stream {
    /// The announcing connection.
    client: ClientId,
    /// Its pin page, where its reader writes its progress.
    page: usize,
    /// The pace of its job, which its uses follow.
    pace: PaceIdx,
    /// The step of the first use.
    first_step: u64,
    /// Its records (its own index -> the table's id).
    keys: Vec<KeyId>,
    /// Per use, in step order: its record (own index), its step (from
    /// `first_step`), and the record's following use (`NONE`: none).
    use_key: Vec<u32>,
    use_step: Vec<u32>,
    next_same: Vec<u32>,
    /// Per record: its earliest use not used up, and its first use not used up at
    /// or after the progress (its next use).
    head: Vec<u32>,
    next_future: Vec<u32>,
    /// The first use at or after the progress.
    cursor: u32,
    /// The reader's progress as last read.
    now: u64,
    /// Connections that read for this read order.
    readers: Vec<ClientId>,
    /// Uses not used up (past ones within the grace included).
    pending: usize,
    /// What it holds, for the budget.
    bytes: u64,
}

impl Stream {
    fn step_of(&self, pos: u32) -> u64 {
        self.first_step + u64::from(self.use_step[pos as usize])
    }

    /// The first use at or after `step`.
    fn position_of(&self, step: u64) -> u32 {
        let rel = step.saturating_sub(self.first_step);
        let before = |&s: &u32| u64::from(s) < rel;
        self.use_step.partition_point(before) as u32
    }

    /// The progress moved to `now`: uses it passed are past. Returns the records
    /// whose next use changed (own indices; repeats possible).
    fn advance(&mut self, now: u64, changed: &mut Vec<u32>) {
        if now < self.now {
            self.rewind(now, changed);
            return;
        }
        let end = self.position_of(now);
        for pos in self.cursor..end {
            let k = self.use_key[pos as usize];
            if self.next_future[k as usize] == pos {
                // Its following use, if that is past too the walk meets it again.
                self.next_future[k as usize] = self.next_same[pos as usize];
                changed.push(k);
            }
        }
        self.cursor = end.max(self.cursor);
        self.now = now;
    }

    /// The progress went back (rare: a reader that restarted its count): every
    /// record's next use is looked for again.
    fn rewind(&mut self, now: u64, changed: &mut Vec<u32>) {
        self.now = now;
        self.cursor = self.position_of(now);
        for k in 0..self.keys.len() {
            let mut pos = self.head[k];
            while pos != NONE && pos < self.cursor {
                pos = self.next_same[pos as usize];
            }
            if self.next_future[k] != pos {
                self.next_future[k] = pos;
                changed.push(k as u32);
            }
        }
    }

    /// A reader read record `k`: its earliest use not used up yet is (a read the
    /// store learns of after the reader moved on is still its own step's); uses
    /// more than [`GRACE`] steps behind are dropped first. Whether its next use
    /// changed.
    fn consume(&mut self, k: u32) -> bool {
        let k = k as usize;
        let horizon = self.now.saturating_sub(GRACE);
        let mut pos = self.head[k];
        while pos != NONE && self.step_of(pos) < horizon {
            pos = self.next_same[pos as usize];
            self.pending -= 1;
        }
        if pos == NONE {
            self.head[k] = NONE;
            return false;
        }
        self.head[k] = self.next_same[pos as usize];
        self.pending -= 1;
        if self.next_future[k] == pos {
            self.next_future[k] = self.next_same[pos as usize];
            return true;
        }
        false
    }
}

/// A job's pace and how many of its read orders are live.
#[derive(Debug)]
struct JobPace {
    job: String,
    pace: Pace,
    orders: usize,
}

/// Live things in numbered places, the places of gone ones reused.
#[derive(Debug)]
struct Places<T> {
    items: Vec<Option<T>>,
    free: Vec<u32>,
}

impl<T> Default for Places<T> {
    fn default() -> Self {
        Places {
            items: Vec::new(),
            free: Vec::new(),
        }
    }
}

impl<T> Places<T> {
    fn insert(&mut self, item: T) -> u32 {
        match self.free.pop() {
            Some(i) => {
                self.items[i as usize] = Some(item);
                i
            }
            None => {
                self.items.push(Some(item));
                (self.items.len() - 1) as u32
            }
        }
    }

    fn remove(&mut self, i: u32) -> Option<T> {
        let item = self.items.get_mut(i as usize)?.take();
        if item.is_some() {
            self.free.push(i);
        }
        item
    }

    fn get(&self, i: u32) -> Option<&T> {
        self.items.get(i as usize)?.as_ref()
    }

    fn get_mut(&mut self, i: u32) -> Option<&mut T> {
        self.items.get_mut(i as usize)?.as_mut()
    }

    fn iter(&self) -> impl Iterator<Item = (u32, &T)> {
        self.items
            .iter()
            .enumerate()
            .filter_map(|(i, t)| t.as_ref().map(|t| (i as u32, t)))
    }

    fn iter_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.items.iter_mut().filter_map(Option::as_mut)
    }
}

/// Every live read order.
#[derive(Debug)]
pub struct ReadOrders {
    keys: Keys,
    streams: Places<Stream>,
    /// Announcing connection -> its read order.
    by_client: HashMap<ClientId, StreamIdx>,
    /// Reader connection -> the connection whose read order it reads for.
    reader_of: HashMap<ClientId, ClientId>,
    paces: Places<JobPace>,
    /// Job -> its pace.
    pace_of: HashMap<String, PaceIdx>,
    /// The cached records' ids, by slot (those some read order names).
    slot_keys: HashMap<SlotIdx, KeyId>,
    /// What the read orders may hold, in bytes.
    budget: u64,
    /// What the planned policy did (its `live`, `pending_uses` and byte figures
    /// unused).
    counters: ReadOrderStats,
}

impl Default for ReadOrders {
    fn default() -> Self {
        ReadOrders {
            keys: Keys::default(),
            streams: Places::default(),
            by_client: HashMap::new(),
            reader_of: HashMap::new(),
            paces: Places::default(),
            pace_of: HashMap::new(),
            slot_keys: HashMap::new(),
            budget: DEFAULT_BUDGET,
            counters: ReadOrderStats::default(),
        }
    }
}

impl ReadOrders {
    /// Sets what the read orders may hold, in bytes.
    pub fn set_budget(&mut self, bytes: u64) {
        self.budget = bytes;
    }

    /// What the read orders may hold, in bytes.
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// What the read orders hold now, in bytes.
    pub fn bytes(&self) -> u64 {
        self.keys.bytes + self.streams.iter().map(|(_, s)| s.bytes).sum::<u64>()
    }

    /// Whether no read order is live (the store evicts by LRU alone then).
    pub fn is_empty(&self) -> bool {
        self.by_client.is_empty()
    }

    /// Read orders live now.
    pub fn len(&self) -> usize {
        self.by_client.len()
    }

    /// Uses not used up over every read order.
    pub fn pending_uses(&self) -> usize {
        self.streams.iter().map(|(_, s)| s.pending).sum()
    }

    /// The planned policy's figures: what it did so far, and the read orders live
    /// now.
    pub fn stats(&self) -> ReadOrderStats {
        ReadOrderStats {
            live: self.len(),
            pending_uses: self.pending_uses(),
            bytes: self.bytes(),
            budget_bytes: self.budget,
            ..self.counters
        }
    }

    /// Counts a prefetch given room (`true`) or declined.
    pub fn count_prefetch(&mut self, given_room: bool) {
        match given_room {
            true => self.counters.prefetched += 1,
            false => self.counters.prefetch_declined += 1,
        }
    }

    /// Counts a read of an unannounced record that got no room.
    pub fn count_unannounced_declined(&mut self) {
        self.counters.unannounced_declined += 1;
    }

    /// Replaces `owner`'s read order by `order`, its reader's progress `progress`,
    /// at `now`; `cached` finds a record's slot. A read order beyond the limits or
    /// the budget, or naming keys it does not list, is refused and the old one
    /// stays.
    pub fn announce(
        &mut self,
        owner: Announcer,
        order: ReadOrderAnnouncement,
        progress: u64,
        now: Micros,
        cached: &dyn Fn(&str) -> Option<SlotIdx>,
        index: &mut EvictionIndex,
    ) -> Result<(), RequestError> {
        check(&order)?;
        self.check_budget(owner.client, &order)?;
        self.forget(owner.client, index);
        for &reader in &order.readers {
            if let Some(other) = self.reader_of.insert(reader, owner.client) {
                let other = self.by_client.get(&other).copied();
                if let Some(s) = other.and_then(|i| self.streams.get_mut(i)) {
                    s.readers.retain(|&r| r != reader);
                }
            }
        }
        let pace = self.pace_for(&owner);
        let at = self.build(&owner, pace, order, cached);
        self.by_client.insert(owner.client, at);
        self.counters.announced += 1;
        // Its reader's progress, then every record it names at its next use.
        let mut changed = Vec::new();
        if let Some(s) = self.streams.get_mut(at) {
            s.now = s.first_step.min(progress);
            s.advance(progress, &mut changed);
        }
        self.observe_paces(now, index);
        let keys = self
            .streams
            .get(at)
            .map(|s| s.keys.clone())
            .unwrap_or_default();
        for id in keys {
            self.update(id, index);
        }
        Ok(())
    }

    /// The pace of `owner`'s job (its own without a job), counting one more read
    /// order.
    fn pace_for(&mut self, owner: &Announcer) -> PaceIdx {
        let job = match owner.job.as_str() {
            "" => format!("connection {}", owner.client),
            job => job.to_string(),
        };
        if let Some(&i) = self.pace_of.get(&job) {
            if let Some(p) = self.paces.get_mut(i) {
                p.orders += 1;
                return i;
            }
        }
        let i = self.paces.insert(JobPace {
            job: job.clone(),
            pace: Pace::default(),
            orders: 1,
        });
        self.pace_of.insert(job, i);
        i
    }

    /// Refuses a read order that would take the read orders past their budget.
    fn check_budget(
        &self,
        owner: ClientId,
        order: &ReadOrderAnnouncement,
    ) -> Result<(), RequestError> {
        let uses: u64 = order.steps.iter().map(|s| s.len() as u64).sum();
        let keys = order.keys.len() as u64;
        // Records no read order names yet take an entry of their own too.
        let new_keys: u64 = order
            .keys
            .iter()
            .filter(|k| self.keys.id(k).is_none())
            .map(|k| BYTES_PER_KEY + k.len() as u64)
            .sum();
        let wanted = BYTES_PER_ORDER
            + uses * BYTES_PER_USE
            + keys * BYTES_PER_ORDER_KEY
            + new_keys
            + 8 * order.readers.len() as u64;
        let replaced = self
            .by_client
            .get(&owner)
            .and_then(|&i| self.streams.get(i))
            .map_or(0, |s| s.bytes);
        let held = self.bytes().saturating_sub(replaced);
        if held.saturating_add(wanted) <= self.budget {
            return Ok(());
        }
        let mib = |b: u64| b as f64 / f64::from(1u32 << 20);
        Err(RequestError::BadReadOrder {
            problem: format!(
                "it needs up to {:.1} MiB ({uses} uses of {keys} records) and the server's read orders hold {:.1} MiB of their budget of {:.1} MiB (cache serve --read-order-budget)",
                mib(wanted),
                mib(held),
                mib(self.budget)
            ),
        })
    }

    /// Builds `owner`'s read order (its uses in step order with each record's
    /// following use) in a place of its own; returns the place.
    fn build(
        &mut self,
        owner: &Announcer,
        pace: PaceIdx,
        order: ReadOrderAnnouncement,
        cached: &dyn Fn(&str) -> Option<SlotIdx>,
    ) -> StreamIdx {
        let ReadOrderAnnouncement {
            first_step,
            keys,
            steps,
            readers,
        } = order;
        let uses: usize = steps.iter().map(Vec::len).sum();
        let mut use_key = Vec::with_capacity(uses);
        let mut use_step = Vec::with_capacity(uses);
        let mut last_step = vec![NONE; keys.len()];
        for (i, step_keys) in steps.iter().enumerate() {
            for &k in step_keys {
                // A record named twice in one step is used once.
                if last_step[k as usize] != i as u32 {
                    last_step[k as usize] = i as u32;
                    use_key.push(k);
                    use_step.push(i as u32);
                }
            }
        }
        let mut next_same = vec![NONE; use_key.len()];
        let mut head = vec![NONE; keys.len()];
        for pos in (0..use_key.len()).rev() {
            let k = use_key[pos] as usize;
            next_same[pos] = head[k];
            head[k] = pos as u32;
        }
        let bytes = BYTES_PER_ORDER
            + use_key.len() as u64 * BYTES_PER_USE
            + keys.len() as u64 * BYTES_PER_ORDER_KEY
            + 8 * readers.len() as u64;
        let at = self.streams.insert(Stream {
            client: owner.client,
            page: owner.page,
            pace,
            first_step,
            keys: Vec::new(),
            pending: use_key.len(),
            next_future: head.clone(),
            head,
            use_key,
            use_step,
            next_same,
            cursor: 0,
            now: first_step,
            readers,
            bytes,
        });
        let mut ids = Vec::with_capacity(keys.len());
        for (k, name) in keys.iter().enumerate() {
            let id = self.keys.intern(name, cached);
            if let Some(entry) = self.keys.get_mut(id) {
                entry.named_by.push((at, k as u32));
                if let Some(slot) = entry.slot {
                    self.slot_keys.insert(slot, id);
                }
            }
            ids.push(id);
        }
        if let Some(s) = self.streams.get_mut(at) {
            s.keys = ids;
        }
        at
    }

    /// Connection `client` ended: its read order goes (its records become unneeded
    /// unless another read order reads them), and it reads for no read order any
    /// more.
    pub fn forget(&mut self, client: ClientId, index: &mut EvictionIndex) {
        if let Some(at) = self.by_client.remove(&client) {
            if let Some(stream) = self.streams.remove(at) {
                self.drop_stream(at, stream, index);
            }
        }
        if let Some(owner) = self.reader_of.remove(&client) {
            let owner = self.by_client.get(&owner).copied();
            if let Some(stream) = owner.and_then(|i| self.streams.get_mut(i)) {
                stream.readers.retain(|&r| r != client);
            }
        }
    }

    /// What a read order that went leaves: its readers, its records' entries,
    /// its job's pace if it was the job's last.
    fn drop_stream(&mut self, at: StreamIdx, stream: Stream, index: &mut EvictionIndex) {
        for reader in &stream.readers {
            if self.reader_of.get(reader) == Some(&stream.client) {
                self.reader_of.remove(reader);
            }
        }
        for &id in &stream.keys {
            if let Some(entry) = self.keys.get_mut(id) {
                entry.named_by.retain(|&(s, _)| s != at);
            }
            self.update(id, index);
            self.keys.release_if_unused(id);
        }
        let last = self.paces.get_mut(stream.pace).is_some_and(|p| {
            p.orders -= 1;
            p.orders == 0
        });
        if last {
            if let Some(p) = self.paces.remove(stream.pace) {
                self.pace_of.remove(&p.job);
            }
        }
    }

    /// Reads every reader's progress (`progress` of a pin page) at `now`: uses it
    /// passed are past, and each job's pace is measured.
    pub fn refresh(
        &mut self,
        progress: impl Fn(usize) -> u64,
        now: Micros,
        index: &mut EvictionIndex,
    ) {
        let mut changed = Vec::new();
        let mut ids = Vec::new();
        for stream in self.streams.iter_mut() {
            let step = progress(stream.page);
            if step == stream.now {
                continue;
            }
            changed.clear();
            stream.advance(step, &mut changed);
            ids.extend(changed.iter().map(|&k| stream.keys[k as usize]));
        }
        if !self.observe_paces(now, index) {
            for id in ids {
                self.update(id, index);
            }
        }
    }

    /// Each job's progress (its leading reader's) at `now`; when a job's pace is
    /// re-anchored every cached record is ranked again. Whether that happened.
    fn observe_paces(&mut self, now: Micros, index: &mut EvictionIndex) -> bool {
        let mut progress = vec![None; self.paces.items.len()];
        for (_, stream) in self.streams.iter() {
            let p: &mut Option<u64> = &mut progress[stream.pace as usize];
            *p = Some(p.map_or(stream.now, |p| p.max(stream.now)));
        }
        let (mut known, mut sum) = (0usize, 0.0);
        for (_, job) in self.paces.iter() {
            if let Some(rate) = job.pace.measured() {
                known += 1;
                sum += rate;
            }
        }
        let fallback = match known {
            0 => DEFAULT_RATE,
            n => sum / n as f64,
        };
        let mut moved = false;
        for (i, job) in self.paces.items.iter_mut().enumerate() {
            if let (Some(job), Some(step)) = (job.as_mut(), progress[i]) {
                moved |= job.pace.observe(now, step, fallback);
            }
        }
        if moved {
            let ids: Vec<KeyId> = self.slot_keys.values().copied().collect();
            for id in ids {
                self.update(id, index);
            }
        }
        moved
    }

    /// Connection `reader` read `key`'s record: if it reads for a read order, the
    /// record's next use in that read order is used up.
    pub fn read(&mut self, reader: ClientId, key: &str, index: &mut EvictionIndex) {
        let Some(owner) = self.reader_of.get(&reader) else {
            return;
        };
        let (Some(&at), Some(id)) = (self.by_client.get(owner), self.keys.id(key)) else {
            return;
        };
        let own = self
            .keys
            .get(id)
            .and_then(|e| e.named_by.iter().find(|&&(s, _)| s == at).map(|&(_, k)| k));
        let (Some(k), Some(stream)) = (own, self.streams.get_mut(at)) else {
            return;
        };
        if stream.consume(k) {
            self.update(id, index);
        }
    }

    /// `key`'s next use over every read order.
    pub fn standing(&self, key: &str) -> Standing {
        match self.keys.id(key).and_then(|id| self.next_use(id)) {
            Some(at) => Standing::Needed { at },
            None => Standing::Unneeded,
        }
    }

    /// `key` is now cached in `slot`: its next use, for the eviction index.
    pub fn cached(&mut self, key: &str, slot: SlotIdx) -> Option<Micros> {
        let id = self.keys.id(key)?;
        self.keys.get_mut(id)?.slot = Some(slot);
        self.slot_keys.insert(slot, id);
        self.next_use(id)
    }

    /// `slot`'s record is no longer cached.
    pub fn uncached(&mut self, slot: SlotIdx) {
        if let Some(id) = self.slot_keys.remove(&slot) {
            if let Some(entry) = self.keys.get_mut(id) {
                entry.slot = None;
            }
            self.keys.release_if_unused(id);
        }
    }

    /// Record `id`'s next use over every read order: the soonest expected.
    fn next_use(&self, id: KeyId) -> Option<Micros> {
        let entry = self.keys.get(id)?;
        let mut soonest: Option<Micros> = None;
        for &(at, k) in &entry.named_by {
            let Some(stream) = self.streams.get(at) else {
                continue;
            };
            let pos = stream.next_future[k as usize];
            if pos == NONE {
                continue;
            }
            let Some(job) = self.paces.get(stream.pace) else {
                continue;
            };
            let t = job.pace.time_of(stream.step_of(pos));
            soonest = Some(soonest.map_or(t, |s| s.min(t)));
        }
        soonest
    }

    /// Puts record `id`'s next use into the eviction index if it is cached.
    fn update(&self, id: KeyId, index: &mut EvictionIndex) {
        if let Some(slot) = self.keys.get(id).and_then(|e| e.slot) {
            index.set_next_use(slot, self.next_use(id));
        }
    }
}

/// Refuses a read order beyond the limits, naming a record twice, or naming keys it
/// does not list.
fn check(order: &ReadOrderAnnouncement) -> Result<(), RequestError> {
    order
        .check()
        .map_err(|problem| RequestError::BadReadOrder { problem })
}

#[cfg(test)]
#[path = "read_order_tests.rs"]
mod tests;
