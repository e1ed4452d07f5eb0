//! The planned policy's bookkeeping: what each reader announced it will read, step by
//! step, how far it has got, and which connections read for it. A training rank's
//! order is a pure function of the seed, the epoch and the sampler's settings, so it
//! can tell the cache its future; from these read orders the store knows each
//! record's next use and evicts the record needed last (Belady's rule) instead of the
//! one used longest ago.
//!
//! A read order belongs to the connection that announced it (a rank's loader) and
//! goes with it: a rank that restarts, or a read order whose steps are all behind its
//! reader, leaves its records unneeded, and the store evicts those by LRU as before.
//! A use is past once the reader's progress (a word it writes into its own pin page,
//! no message) is beyond its step, or once one of the read order's reader connections
//! has read the record for it (so a record read early in the prefetch window is not
//! kept until the step is consumed). Readers of different read orders move in
//! lockstep (the ranks of one job meet at every all-reduce), so uses of different
//! read orders compare by how far ahead of their own reader's progress they lie.
//!
//! The store learns of most reads late (clients record hits in their pin pages,
//! read when a record needs room), when the reader's progress may have passed the
//! read's step: a read uses up the read order's earliest use not used yet, past or not,
//! and past uses are dropped only once they are [`GRACE`] steps behind.

use std::collections::{HashMap, VecDeque};

use super::super::ids::ClientId;
use super::super::protocol::{ReadOrderAnnouncement, RequestError};
use super::super::stats::ReadOrderStats;
use super::super::table::MAX_KEY_BYTES;

/// Most uses one read order may announce (two epochs of a million clips of 6 frames
/// fit).
pub const MAX_ORDER_USES: usize = 1 << 24;
/// Most records one read order may name.
pub const MAX_ORDER_KEYS: usize = 1 << 22;
/// Most reader connections one read order may name.
pub const MAX_ORDER_READERS: usize = 1024;
/// Steps a use stays after the reader's progress passed it, for a read the store
/// learns of late to use it up (rather than a use to come).
pub const GRACE: u64 = 4096;

/// Where a record stands for the planned policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Standing {
    /// Some read order reads it `distance` steps ahead of that read order's reader
    /// (the nearest such use over every read order).
    Needed {
        /// Steps between the reader's progress and the use.
        distance: u64,
    },
    /// No read order reads it again.
    Unneeded,
}

/// Eviction ranks: smaller goes first. Unneeded records by their LRU stamp, then
/// needed ones, the farthest next use first.
const NEEDED: u64 = 1 << 63;
const MAX_DISTANCE: u64 = (1 << 62) - 1;

impl Standing {
    /// The record's eviction rank, given its LRU `stamp` (smaller: older).
    pub fn rank(self, stamp: u64) -> u64 {
        match self {
            Standing::Unneeded => stamp.min(NEEDED - 1),
            Standing::Needed { distance } => NEEDED + (MAX_DISTANCE - distance.min(MAX_DISTANCE)),
        }
    }

    /// The rank below which every record is needed later than a use `distance`
    /// steps ahead (or not at all).
    pub fn later_than(distance: u64) -> u64 {
        Standing::Needed { distance }.rank(0)
    }

    /// Whether a record of this rank is needed by no read order.
    pub fn rank_is_unneeded(rank: u64) -> bool {
        rank < NEEDED
    }
}

/// One reader's announced uses.
#[derive(Debug)]
struct Stream {
    /// The announcing connection's pin page, where its reader writes its progress.
    page: usize,
    /// The reader's progress as last read: uses at earlier steps are past.
    now: u64,
    /// Pending uses per record, steps ascending.
    uses: HashMap<String, VecDeque<u64>>,
    /// Connections that read for this read order.
    readers: Vec<ClientId>,
    /// Uses still pending (some past ones are dropped only when looked at).
    pending: usize,
}

impl Stream {
    /// The record's uses not used up yet, those more than [`GRACE`] steps behind
    /// the reader dropped.
    fn pending_uses(&mut self, key: &str) -> Option<&mut VecDeque<u64>> {
        let horizon = self.now.saturating_sub(GRACE);
        let steps = self.uses.get_mut(key)?;
        while steps.front().is_some_and(|&step| step < horizon) {
            steps.pop_front();
            self.pending -= 1;
        }
        if steps.is_empty() {
            self.uses.remove(key);
            return None;
        }
        self.uses.get_mut(key)
    }

    /// The record's first use at or after the reader's progress.
    fn next_use(&mut self, key: &str) -> Option<u64> {
        let now = self.now;
        let steps = self.pending_uses(key)?;
        steps.iter().copied().find(|&step| step >= now)
    }

    /// A reader read the record: the earliest use not used up yet is (a read the
    /// store learns of after the reader moved on is still its own step's).
    fn consume(&mut self, key: &str) {
        let Some(steps) = self.pending_uses(key) else {
            return;
        };
        steps.pop_front();
        let empty = steps.is_empty();
        self.pending -= 1;
        if empty {
            self.uses.remove(key);
        }
    }
}

/// Every live read order.
#[derive(Debug, Default)]
pub struct ReadOrders {
    /// By the connection that announced it.
    streams: HashMap<ClientId, Stream>,
    /// Reader connection -> the read order it reads for.
    reader_of: HashMap<ClientId, ClientId>,
    /// What the planned policy did (its `live` and `pending_uses` unused).
    counters: ReadOrderStats,
}

impl ReadOrders {
    /// No read order.
    pub fn new() -> ReadOrders {
        ReadOrders::default()
    }

    /// Whether no read order is live (the store evicts by LRU alone then).
    pub fn is_empty(&self) -> bool {
        self.streams.is_empty()
    }

    /// Read orders live now.
    pub fn len(&self) -> usize {
        self.streams.len()
    }

    /// Uses still pending over every read order.
    pub fn pending_uses(&self) -> usize {
        self.streams.values().map(|s| s.pending).sum()
    }

    /// The planned policy's figures: what it did so far, and the read orders live
    /// now.
    pub fn stats(&self) -> ReadOrderStats {
        ReadOrderStats {
            live: self.len(),
            pending_uses: self.pending_uses(),
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

    /// Replaces `owner`'s read order by `order`; `page` is `owner`'s pin page (its
    /// progress). A read order beyond the limits, or naming keys it does not list, is
    /// refused and the old one stays.
    pub fn announce(
        &mut self,
        owner: ClientId,
        page: usize,
        order: ReadOrderAnnouncement,
    ) -> Result<(), RequestError> {
        check(&order)?;
        self.forget(owner);
        let ReadOrderAnnouncement {
            first_step,
            keys,
            steps,
            readers,
        } = order;
        let mut uses: HashMap<String, VecDeque<u64>> = HashMap::with_capacity(keys.len());
        let mut pending = 0;
        for (i, step_keys) in steps.iter().enumerate() {
            let step = first_step.saturating_add(i as u64);
            for &k in step_keys {
                let key = &keys[k as usize];
                let steps = match uses.get_mut(key.as_str()) {
                    Some(steps) => steps,
                    None => uses.entry(key.clone()).or_default(),
                };
                if steps.back() != Some(&step) {
                    steps.push_back(step);
                    pending += 1;
                }
            }
        }
        for &reader in &readers {
            if let Some(other) = self.reader_of.insert(reader, owner) {
                if let Some(stream) = self.streams.get_mut(&other) {
                    stream.readers.retain(|&r| r != reader);
                }
            }
        }
        self.streams.insert(
            owner,
            Stream {
                page,
                now: 0,
                uses,
                readers,
                pending,
            },
        );
        self.counters.announced += 1;
        Ok(())
    }

    /// Connection `client` ended: its read order goes (its records become unneeded
    /// unless another read order reads them), and it reads for no read order any
    /// more.
    pub fn forget(&mut self, client: ClientId) {
        if let Some(stream) = self.streams.remove(&client) {
            for reader in stream.readers {
                if self.reader_of.get(&reader) == Some(&client) {
                    self.reader_of.remove(&reader);
                }
            }
        }
        if let Some(owner) = self.reader_of.remove(&client) {
            if let Some(stream) = self.streams.get_mut(&owner) {
                stream.readers.retain(|&r| r != client);
            }
        }
    }

    /// Reads every reader's progress (`progress` of a pin page).
    pub fn refresh(&mut self, progress: impl Fn(usize) -> u64) {
        for stream in self.streams.values_mut() {
            stream.now = progress(stream.page);
        }
    }

    /// Connection `reader` read `key`'s record: if it reads for a read order, the
    /// record's next use in that read order is used up.
    pub fn read(&mut self, reader: ClientId, key: &str) {
        let Some(owner) = self.reader_of.get(&reader) else {
            return;
        };
        if let Some(stream) = self.streams.get_mut(owner) {
            stream.consume(key);
        }
    }

    /// `key`'s next use over every read order.
    pub fn standing(&mut self, key: &str) -> Standing {
        let mut nearest = None;
        for stream in self.streams.values_mut() {
            if let Some(step) = stream.next_use(key) {
                let distance = step - stream.now;
                nearest = Some(nearest.map_or(distance, |d: u64| d.min(distance)));
            }
        }
        match nearest {
            Some(distance) => Standing::Needed { distance },
            None => Standing::Unneeded,
        }
    }
}

/// Refuses a read order beyond the limits or naming keys it does not list.
fn check(order: &ReadOrderAnnouncement) -> Result<(), RequestError> {
    let bad = |problem: String| Err(RequestError::BadReadOrder { problem });
    if order.keys.len() > MAX_ORDER_KEYS {
        return bad(format!(
            "{} keys, at most {MAX_ORDER_KEYS}",
            order.keys.len()
        ));
    }
    if order.readers.len() > MAX_ORDER_READERS {
        return bad(format!(
            "{} readers, at most {MAX_ORDER_READERS}",
            order.readers.len()
        ));
    }
    if let Some(key) = order.keys.iter().find(|k| k.len() > MAX_KEY_BYTES) {
        return bad(format!(
            "key {key:?} is {} bytes long; keys are at most {MAX_KEY_BYTES} bytes",
            key.len()
        ));
    }
    let uses: usize = order.steps.iter().map(Vec::len).sum();
    if uses > MAX_ORDER_USES {
        return bad(format!("{uses} uses, at most {MAX_ORDER_USES}"));
    }
    let keys = order.keys.len();
    for (i, step) in order.steps.iter().enumerate() {
        if let Some(&k) = step.iter().find(|&&k| k as usize >= keys) {
            return bad(format!(
                "step {} names key {k} of a list of {keys}",
                order.first_step.saturating_add(i as u64)
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(
        first_step: u64,
        keys: &[&str],
        steps: &[&[u32]],
        readers: &[ClientId],
    ) -> ReadOrderAnnouncement {
        ReadOrderAnnouncement {
            first_step,
            keys: keys.iter().map(|k| k.to_string()).collect(),
            steps: steps.iter().map(|s| s.to_vec()).collect(),
            readers: readers.to_vec(),
        }
    }

    #[test]
    fn the_nearest_use_over_orders_counts_and_reads_use_up_the_earliest() {
        let mut orders = ReadOrders::new();
        // Read order of connection 1 (page 0): a at 10 and 13, b at 11; connection 2's
        // (page 1): b at 100.
        orders
            .announce(1, 0, order(10, &["a", "b"], &[&[0], &[1], &[], &[0]], &[5]))
            .unwrap();
        orders
            .announce(2, 1, order(100, &["b"], &[&[0]], &[]))
            .unwrap();
        let progress = |now: [u64; 2]| move |page: usize| now[page];
        orders.refresh(progress([10, 99]));
        assert_eq!(orders.standing("a"), Standing::Needed { distance: 0 });
        assert_eq!(orders.standing("b"), Standing::Needed { distance: 1 });
        assert_eq!(orders.standing("c"), Standing::Unneeded);
        orders.refresh(progress([12, 99]));
        assert_eq!(orders.standing("a"), Standing::Needed { distance: 1 });
        assert_eq!(
            orders.standing("b"),
            Standing::Needed { distance: 1 },
            "order 2's"
        );
        // Reader 5's read of a at step 10, learnt only now: it uses up step 10's
        // use, not step 13's.
        orders.read(5, "a");
        assert_eq!(orders.standing("a"), Standing::Needed { distance: 1 });
        orders.read(5, "a");
        assert_eq!(orders.standing("a"), Standing::Unneeded);
        // A read by a connection that reads for no read order changes nothing.
        orders.read(9, "b");
        assert_eq!(orders.standing("b"), Standing::Needed { distance: 1 });
        orders.forget(2);
        assert_eq!(
            orders.standing("b"),
            Standing::Unneeded,
            "order 1's use at 11 is past"
        );
        assert_eq!(orders.len(), 1);
        assert_eq!(orders.pending_uses(), 1, "b's past use, within the grace");
        // Far past, it goes.
        orders.refresh(progress([12 + GRACE, 0]));
        assert_eq!(orders.standing("b"), Standing::Unneeded);
        assert_eq!(orders.pending_uses(), 0);
    }

    #[test]
    fn ranks_put_unneeded_records_first_then_the_farthest_use() {
        let unneeded_old = Standing::Unneeded.rank(3);
        let unneeded_new = Standing::Unneeded.rank(9);
        let far = Standing::Needed { distance: 50 }.rank(1);
        let near = Standing::Needed { distance: 2 }.rank(100);
        assert!(unneeded_old < unneeded_new && unneeded_new < far && far < near);
        assert!(Standing::rank_is_unneeded(unneeded_new) && !Standing::rank_is_unneeded(far));
        assert!(far < Standing::later_than(2) && near >= Standing::later_than(2));
    }

    #[test]
    fn a_bad_read_order_is_refused_and_the_old_one_stays() {
        let mut orders = ReadOrders::new();
        orders
            .announce(1, 0, order(0, &["a"], &[&[0]], &[]))
            .unwrap();
        let err = orders
            .announce(1, 0, order(7, &["a"], &[&[0, 1]], &[]))
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("step 7 names key 1 of a list of 1"),
            "{err}"
        );
        let long = "k".repeat(MAX_KEY_BYTES + 1);
        let err = orders
            .announce(1, 0, order(0, &[&long], &[&[0]], &[]))
            .unwrap_err();
        assert!(err.to_string().contains("at most"), "{err}");
        assert_eq!(orders.standing("a"), Standing::Needed { distance: 0 });
    }

    #[test]
    fn a_reader_moved_to_another_read_order_reads_for_that_one() {
        let mut orders = ReadOrders::new();
        orders
            .announce(1, 0, order(0, &["a"], &[&[0]], &[7]))
            .unwrap();
        orders
            .announce(2, 1, order(0, &["a"], &[&[], &[0]], &[7]))
            .unwrap();
        orders.read(7, "a");
        // Order 2's use went; order 1's stays.
        orders.forget(1);
        assert_eq!(orders.standing("a"), Standing::Unneeded);
        orders.forget(7);
        orders.forget(2);
        assert!(orders.is_empty());
    }
}
