//! The LRU of committed records, one per slot class, with a second chance: a record
//! enters stamped with the shared table's clock, and a victim whose last access
//! (clients stamp it in the table on every hit) is newer than its stamp, or that is
//! pinned, goes back in as the most recent instead of being taken.

use lru::LruCache;

use super::super::table::Table;
use super::arena::{ClassIdx, SlotIdx};

/// The committed records of every class, least recently entered first.
#[derive(Debug, Default)]
pub struct Lru {
    classes: Vec<LruCache<SlotIdx, u64>>,
}

impl Lru {
    /// An empty LRU.
    pub fn new() -> Lru {
        Lru::default()
    }

    fn class_mut(&mut self, ci: ClassIdx) -> &mut LruCache<SlotIdx, u64> {
        if self.classes.len() <= ci {
            self.classes.resize_with(ci + 1, LruCache::unbounded);
        }
        &mut self.classes[ci]
    }

    /// `slot` of class `ci` enters as the most recent, stamped `entered` (the clock
    /// when it did).
    pub fn enter(&mut self, ci: ClassIdx, slot: SlotIdx, entered: u64) {
        self.class_mut(ci).put(slot, entered);
    }

    /// Takes `slot` out (its record is gone some other way).
    pub fn remove(&mut self, ci: ClassIdx, slot: SlotIdx) {
        if let Some(class) = self.classes.get_mut(ci) {
            class.pop(&slot);
        }
    }

    /// Records of class `ci` in the LRU.
    pub fn len(&self, ci: ClassIdx) -> usize {
        self.classes.get(ci).map_or(0, LruCache::len)
    }

    /// Takes the least recently used unpinned record of class `ci` out of the LRU
    /// and marks its slot Evicting in `table` (see [`Table::try_evict`]). Records
    /// accessed since they entered, and pinned ones, go back in as the most recent;
    /// gives up after going round the whole LRU twice.
    pub fn victim(&mut self, ci: ClassIdx, table: &Table) -> Option<SlotIdx> {
        let class = self.classes.get_mut(ci)?;
        for _ in 0..2 * class.len() {
            let (slot, entered) = class.pop_lru()?;
            let accessed = table.last_access(slot) > entered;
            if accessed || !table.try_evict(slot) {
                class.put(slot, table.tick());
                continue;
            }
            return Some(slot);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::super::super::table::{SlotCode, SlotState};
    use super::*;

    /// A table whose first `n` slots hold committed records.
    fn ready_table(n: usize) -> Table {
        let table = Table::on_heap(1 << 20, 8);
        for slot in 0..n {
            table.write_record(slot, &format!("k{slot}"), 1);
            let state = SlotState {
                generation: 1,
                code: SlotCode::Ready,
            };
            table.set_state(slot, state);
        }
        table
    }

    fn filled(table: &Table, slots: &[SlotIdx]) -> Lru {
        let mut lru = Lru::new();
        for &slot in slots {
            lru.enter(0, slot, table.tick());
        }
        lru
    }

    #[test]
    fn the_least_recently_entered_goes_first() {
        let table = ready_table(3);
        let mut lru = filled(&table, &[2, 0, 1]);
        assert_eq!(lru.victim(0, &table), Some(2));
        assert_eq!(table.state(2).map(|s| s.code), Some(SlotCode::Evicting));
        assert_eq!(lru.victim(0, &table), Some(0));
        assert_eq!(lru.len(0), 1);
        assert_eq!(lru.victim(1, &table), None, "an empty class has no victim");
    }

    #[test]
    fn an_accessed_record_gets_a_second_chance() {
        let table = ready_table(3);
        let mut lru = filled(&table, &[0, 1, 2]);
        table.touch(0);
        assert_eq!(lru.victim(0, &table), Some(1));
        // 0 went back in as the most recent, behind 2.
        assert_eq!(lru.victim(0, &table), Some(2));
        assert_eq!(lru.victim(0, &table), Some(0));
    }

    #[test]
    fn pinned_records_are_never_taken() {
        let table = ready_table(2);
        let mut lru = filled(&table, &[0, 1]);
        table.pin(0, 5);
        table.pin(1, 6);
        assert_eq!(lru.victim(0, &table), None);
        assert_eq!(lru.len(0), 2, "pinned records stay in the LRU");
        assert_eq!(table.state(0).map(|s| s.code), Some(SlotCode::Ready));
        table.unpin(1, 6);
        assert_eq!(lru.victim(0, &table), Some(1));
        lru.remove(0, 0);
        assert_eq!(lru.len(0), 0);
    }
}
