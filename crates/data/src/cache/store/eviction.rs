//! The order in which committed records go when room is needed, kept current as
//! records come in, are read and go, and as their next use changes, so a miss finds
//! its victims from the front of an ordered index: O(log n) a victim, no scan of
//! the store, no sort, nothing allocated in proportion to it.
//!
//! Records no read order needs go first, least recently used first (with no read
//! order live, that is plain LRU). Then records some read order needs, the one
//! needed last first (Belady's rule), a larger record counting for more: they are
//! ranked by the time to their next use times the room they take, so of two
//! records needed at the same time the larger goes first, and a record twice the
//! size goes before one needed a little later. Records of one size compare by
//! their next use alone; each size keeps its own ordered set and a victim is the
//! best of their fronts (a dataset's records come in a few sizes).
//!
//! A record's stamp (its last use: commit or read) is kept for every record, so a
//! record that loses its last announced use falls back into the LRU order by when
//! it was really used.

use std::collections::{btree_set, BTreeMap, BTreeSet};
use std::iter::{Peekable, Rev};

use super::arena::SlotIdx;
use super::pace::Micros;

/// Ranks at or above this belong to needed records.
const NEEDED: u64 = 1 << 63;
/// The largest weight a needed record's rank holds.
const MAX_WEIGHT: u64 = (1 << 62) - 1;

/// What a record coming in may push out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// Any record, in the order.
    All,
    /// Only records no read order needs.
    Unneeded,
    /// Records no read order needs, and those needed after this time.
    NeededAfter(Micros),
}

impl Bound {
    fn admits(self, next_use: Option<Micros>) -> bool {
        match (self, next_use) {
            (_, None) | (Bound::All, _) => true,
            (Bound::Unneeded, Some(_)) => false,
            (Bound::NeededAfter(at), Some(t)) => t > at,
        }
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Entry {
    /// Last use; 0: the slot holds no committed record.
    stamp: u64,
    /// The room it takes.
    extent: u64,
    /// When a read order needs it next.
    next_use: Option<Micros>,
}

/// Committed records in the order they go.
#[derive(Debug, Default)]
pub struct EvictionIndex {
    clock: u64,
    entries: Vec<Entry>,
    /// Records no read order needs: (stamp, slot), oldest first.
    unneeded: BTreeSet<(u64, SlotIdx)>,
    /// Records a read order needs, by extent: (next use, slot), soonest first.
    needed: BTreeMap<u64, BTreeSet<(Micros, SlotIdx)>>,
}

impl EvictionIndex {
    /// `slot` now holds a committed record of `extent` bytes, used now, next
    /// needed at `next_use` (`None`: by no read order).
    pub fn enter(&mut self, slot: SlotIdx, extent: u64, next_use: Option<Micros>) {
        self.remove(slot);
        if self.entries.len() <= slot {
            self.entries.resize(slot + 1, Entry::default());
        }
        self.clock += 1;
        self.entries[slot] = Entry {
            stamp: self.clock,
            extent,
            next_use,
        };
        self.insert(slot);
    }

    /// `slot`'s record was read: its last use is now.
    pub fn touch(&mut self, slot: SlotIdx) {
        let Some(entry) = self.committed(slot) else {
            return;
        };
        self.clock += 1;
        if entry.next_use.is_none() {
            self.unneeded.remove(&(entry.stamp, slot));
            self.unneeded.insert((self.clock, slot));
        }
        self.entries[slot].stamp = self.clock;
    }

    /// `slot`'s record is next needed at `next_use` (`None`: by no read order).
    pub fn set_next_use(&mut self, slot: SlotIdx, next_use: Option<Micros>) {
        let Some(entry) = self.committed(slot) else {
            return;
        };
        if entry.next_use == next_use {
            return;
        }
        self.withdraw(slot, entry);
        self.entries[slot].next_use = next_use;
        self.insert(slot);
    }

    /// Takes `slot` out (its record is gone).
    pub fn remove(&mut self, slot: SlotIdx) {
        if let Some(entry) = self.committed(slot) {
            self.withdraw(slot, entry);
            self.entries[slot] = Entry::default();
        }
    }

    /// When `slot`'s record was last used (larger: more recent), if committed.
    pub fn stamp(&self, slot: SlotIdx) -> Option<u64> {
        self.committed(slot).map(|e| e.stamp)
    }

    /// When `slot`'s record is next needed, if committed (`Some(None)`: by no read
    /// order).
    pub fn next_use(&self, slot: SlotIdx) -> Option<Option<Micros>> {
        self.committed(slot).map(|e| e.next_use)
    }

    /// The committed slots (in no particular order).
    pub fn slots(&self) -> impl Iterator<Item = SlotIdx> + '_ {
        let committed = |(slot, e): (usize, &Entry)| (e.stamp > 0).then_some(slot);
        self.entries.iter().enumerate().filter_map(committed)
    }

    /// Committed records.
    pub fn len(&self) -> usize {
        self.unneeded.len() + self.needed.values().map(BTreeSet::len).sum::<usize>()
    }

    /// Whether no record is committed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `slot`'s rank if a record coming in within `bound` may push it out, at
    /// `now`: smaller goes first (unneeded records by last use, then needed ones,
    /// the largest weight first).
    pub fn rank(&self, slot: SlotIdx, now: Micros, bound: Bound) -> Option<u64> {
        let entry = self.committed(slot)?;
        if !bound.admits(entry.next_use) {
            return None;
        }
        Some(match entry.next_use {
            None => entry.stamp.min(NEEDED - 1),
            Some(at) => NEEDED + (MAX_WEIGHT - weight(at, now, entry.extent)),
        })
    }

    /// The records a record coming in within `bound` may push out, the first to go
    /// first, at `now`.
    pub fn victims(&self, now: Micros, bound: Bound) -> Victims<'_> {
        let classes = match bound {
            Bound::Unneeded => Vec::new(),
            Bound::All | Bound::NeededAfter(_) => self
                .needed
                .iter()
                .map(|(&extent, set)| (extent, set.iter().rev().peekable()))
                .collect(),
        };
        Victims {
            unneeded: self.unneeded.iter(),
            classes,
            now,
            bound,
        }
    }

    fn committed(&self, slot: SlotIdx) -> Option<Entry> {
        self.entries.get(slot).copied().filter(|e| e.stamp > 0)
    }

    fn insert(&mut self, slot: SlotIdx) {
        let e = self.entries[slot];
        match e.next_use {
            None => {
                self.unneeded.insert((e.stamp, slot));
            }
            Some(at) => {
                self.needed.entry(e.extent).or_default().insert((at, slot));
            }
        }
    }

    fn withdraw(&mut self, slot: SlotIdx, e: Entry) {
        match e.next_use {
            None => {
                self.unneeded.remove(&(e.stamp, slot));
            }
            Some(at) => {
                if let Some(set) = self.needed.get_mut(&e.extent) {
                    set.remove(&(at, slot));
                    if set.is_empty() {
                        self.needed.remove(&e.extent);
                    }
                }
            }
        }
    }
}

/// A needed record's weight at `now`: microseconds to its next use times the 4 KiB
/// pages it takes (larger: goes sooner), at most [`MAX_WEIGHT`].
fn weight(next_use: Micros, now: Micros, extent: u64) -> u64 {
    let us = next_use.saturating_sub(now) as f64;
    let pages = (extent as f64 / 4096.0).max(1.0);
    let w = us * pages;
    if w >= MAX_WEIGHT as f64 {
        MAX_WEIGHT
    } else {
        w as u64
    }
}

type ClassIter<'a> = Peekable<Rev<btree_set::Iter<'a, (Micros, SlotIdx)>>>;

/// The victims in order: see [`EvictionIndex::victims`].
pub struct Victims<'a> {
    unneeded: btree_set::Iter<'a, (u64, SlotIdx)>,
    /// Per extent, its needed records, the farthest next use first.
    classes: Vec<(u64, ClassIter<'a>)>,
    now: Micros,
    bound: Bound,
}

impl Iterator for Victims<'_> {
    type Item = SlotIdx;

    fn next(&mut self) -> Option<SlotIdx> {
        if let Some(&(_, slot)) = self.unneeded.next() {
            return Some(slot);
        }
        let (now, bound) = (self.now, self.bound);
        let mut best: Option<(u64, usize)> = None;
        for (i, (extent, class)) in self.classes.iter_mut().enumerate() {
            let Some(&&(at, _)) = class.peek() else {
                continue;
            };
            if !bound.admits(Some(at)) {
                // Every later one of this size is needed sooner still.
                continue;
            }
            let w = weight(at, now, *extent);
            if best.is_none_or(|(bw, _)| w > bw) {
                best = Some((w, i));
            }
        }
        let (_, i) = best?;
        self.classes[i].1.next().map(|&(_, slot)| slot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(index: &EvictionIndex, now: Micros, bound: Bound) -> Vec<SlotIdx> {
        index.victims(now, bound).collect()
    }

    #[test]
    fn without_next_uses_it_is_lru() {
        let mut index = EvictionIndex::default();
        for slot in [2, 0, 1] {
            index.enter(slot, 4096, None);
        }
        assert_eq!(all(&index, 0, Bound::All), vec![2, 0, 1]);
        index.touch(2);
        index.touch(7); // not committed: ignored
        assert_eq!(all(&index, 0, Bound::All), vec![0, 1, 2]);
        assert!(index.stamp(2) > index.stamp(1));
        index.remove(0);
        index.remove(0);
        assert_eq!(all(&index, 0, Bound::All), vec![1, 2]);
        assert_eq!(
            (index.len(), index.stamp(0), index.stamp(7)),
            (2, None, None)
        );
    }

    #[test]
    fn unneeded_go_first_then_the_farthest_next_use() {
        let mut index = EvictionIndex::default();
        index.enter(0, 4096, Some(50));
        index.enter(1, 4096, None);
        index.enter(2, 4096, Some(900));
        index.enter(3, 4096, Some(10));
        index.enter(4, 4096, None);
        assert_eq!(all(&index, 0, Bound::All), vec![1, 4, 2, 0, 3]);
        assert_eq!(all(&index, 0, Bound::Unneeded), vec![1, 4]);
        assert_eq!(all(&index, 0, Bound::NeededAfter(40)), vec![1, 4, 2, 0]);
        // Ranks agree with the order, and say who may not go.
        let ranks: Vec<_> = [1, 4, 2, 0, 3]
            .iter()
            .map(|&s| index.rank(s, 0, Bound::All).unwrap())
            .collect();
        assert!(ranks.windows(2).all(|w| w[0] < w[1]), "{ranks:?}");
        assert_eq!(index.rank(3, 0, Bound::NeededAfter(40)), None);
        assert_eq!(index.rank(0, 0, Bound::Unneeded), None);
        assert!(index.rank(1, 0, Bound::Unneeded).is_some());
        // A next use that goes away puts the record back by its last use.
        index.set_next_use(0, None);
        assert_eq!(all(&index, 0, Bound::All), vec![0, 1, 4, 2, 3]);
        index.set_next_use(1, Some(5));
        assert_eq!(all(&index, 0, Bound::All), vec![0, 4, 2, 3, 1]);
    }

    #[test]
    fn a_larger_record_costs_more_room() {
        let mut index = EvictionIndex::default();
        // At now = 0: the small one is needed at 1000 ms, the large (4 pages) at
        // 400 ms: 1000 x 1 < 400 x 4, so the large one goes first.
        index.enter(0, 4096, Some(1_000_000));
        index.enter(1, 4 * 4096, Some(400_000));
        index.enter(2, 4 * 4096, Some(100_000));
        assert_eq!(all(&index, 0, Bound::All), vec![1, 0, 2]);
        // Later, with both nearer, the order follows the weights at that time.
        assert_eq!(all(&index, 300_000, Bound::All), vec![0, 1, 2]);
        // The bound is by time, not weight.
        assert_eq!(all(&index, 0, Bound::NeededAfter(500_000)), vec![0]);
    }

    #[test]
    fn the_order_matches_a_sort_of_the_ranks_on_random_changes() {
        let mut rng = crate::util::rng::SplitMix64::new(7);
        let mut index = EvictionIndex::default();
        for round in 0..2000u64 {
            let slot = (rng.next_u64() % 40) as usize;
            match rng.next_u64() % 5 {
                0 => index.remove(slot),
                1 => index.touch(slot),
                2 => index.set_next_use(slot, Some(rng.next_u64() % 1_000_000)),
                3 => index.set_next_use(slot, None),
                _ => {
                    let extent = 4096 * (1 + rng.next_u64() % 3);
                    let next = (rng.next_u64() % 2 == 0).then(|| rng.next_u64() % 1_000_000);
                    index.enter(slot, extent, next);
                }
            }
            let now = round * 100;
            let mut sorted: Vec<(u64, SlotIdx)> = index
                .slots()
                .map(|s| (index.rank(s, now, Bound::All).unwrap(), s))
                .collect();
            sorted.sort_unstable();
            let order: Vec<SlotIdx> = index.victims(now, Bound::All).collect();
            let ranks: Vec<u64> = order
                .iter()
                .map(|&s| index.rank(s, now, Bound::All).unwrap())
                .collect();
            let expected: Vec<u64> = sorted.iter().map(|&(r, _)| r).collect();
            assert_eq!(ranks, expected, "round {round}");
            assert_eq!(order.len(), index.len());
        }
    }
}
