//! The order in which committed records were last used, oldest first: a record is
//! stamped when it is committed and again when it is read. Clients record their
//! reads in their own pin pages (no message); the server folds those in before it
//! picks what to evict, so a record read by anyone since another one is kept longer.

use std::collections::BTreeSet;

use super::arena::SlotIdx;

/// Committed records by last use.
#[derive(Debug, Default)]
pub struct Recency {
    clock: u64,
    /// (stamp, slot), oldest first.
    order: BTreeSet<(u64, SlotIdx)>,
    /// Each slot's stamp; 0: not in the order.
    stamps: Vec<u64>,
}

impl Recency {
    /// No record.
    pub fn new() -> Recency {
        Recency::default()
    }

    /// `slot` (now committed, or just read) becomes the most recent.
    pub fn enter(&mut self, slot: SlotIdx) {
        self.remove(slot);
        if self.stamps.len() <= slot {
            self.stamps.resize(slot + 1, 0);
        }
        self.clock += 1;
        self.stamps[slot] = self.clock;
        self.order.insert((self.clock, slot));
    }

    /// `slot` was read: the most recent, if it is in the order.
    pub fn touch(&mut self, slot: SlotIdx) {
        if self.stamp(slot).is_some() {
            self.enter(slot);
        }
    }

    /// Takes `slot` out (its record is gone).
    pub fn remove(&mut self, slot: SlotIdx) {
        if let Some(stamp) = self.stamp(slot) {
            self.order.remove(&(stamp, slot));
            self.stamps[slot] = 0;
        }
    }

    /// When `slot` was last used (larger: more recent); `None` if not in the order.
    pub fn stamp(&self, slot: SlotIdx) -> Option<u64> {
        self.stamps.get(slot).copied().filter(|&s| s > 0)
    }

    /// The records, least recently used first.
    pub fn oldest_first(&self) -> impl Iterator<Item = SlotIdx> + '_ {
        self.order.iter().map(|&(_, slot)| slot)
    }

    /// Records in the order.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// Whether no record is in the order.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_move_a_record_to_the_back() {
        let mut r = Recency::new();
        for slot in [2, 0, 1] {
            r.enter(slot);
        }
        assert_eq!(r.oldest_first().collect::<Vec<_>>(), vec![2, 0, 1]);
        r.touch(2);
        r.touch(7); // not in the order: ignored
        assert_eq!(r.oldest_first().collect::<Vec<_>>(), vec![0, 1, 2]);
        assert!(r.stamp(2) > r.stamp(1));
        r.remove(0);
        r.remove(0);
        assert_eq!(r.oldest_first().collect::<Vec<_>>(), vec![1, 2]);
        assert_eq!((r.len(), r.stamp(0), r.stamp(7)), (2, None, None));
    }
}
