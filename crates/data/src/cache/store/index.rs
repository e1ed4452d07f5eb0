//! The index of committed records by key, kept in the server's memory and mirrored
//! into the shared table's hash index, where clients look hits up themselves. The
//! shared index is rebuilt when removals have left too many tombstones in it.

use std::collections::HashMap;

use super::super::table::{key_hash, TableWriter};
use super::arena::SlotIdx;

/// Committed records by key.
#[derive(Debug, Default)]
pub struct RecordIndex {
    by_key: HashMap<String, SlotIdx>,
    /// Tombstones in the shared index.
    tombstones: usize,
}

impl RecordIndex {
    /// The slot holding `key`'s record.
    pub fn get(&self, key: &str) -> Option<SlotIdx> {
        self.by_key.get(key).copied()
    }

    /// Committed records.
    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    /// Whether no record is committed.
    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }

    /// Publishes `key -> slot` here and in `table`.
    pub fn insert(&mut self, key: String, slot: SlotIdx, table: &TableWriter) {
        if table.index_insert(key_hash(&key), slot) {
            self.tombstones = self.tombstones.saturating_sub(1);
        }
        self.by_key.insert(key, slot);
    }

    /// Withdraws `key` here and in `table`; returns its slot.
    pub fn remove(&mut self, key: &str, table: &TableWriter) -> Option<SlotIdx> {
        let slot = self.by_key.remove(key)?;
        if table.index_remove(key_hash(key), slot) {
            self.tombstones += 1;
        }
        if self.tombstones > table.index_entries() / 4 {
            self.rebuild(table);
        }
        Some(slot)
    }

    /// Rewrites the shared index from the live records (clients that look meanwhile
    /// miss and ask the server).
    fn rebuild(&mut self, table: &TableWriter) {
        table.index_clear();
        for (key, &slot) in &self.by_key {
            table.index_insert(key_hash(key), slot);
        }
        self.tombstones = 0;
    }

    /// Tombstones left in the shared index.
    pub fn tombstones(&self) -> usize {
        self.tombstones
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys whose hashes share one home bucket of a 16-entry index, so removing any
    /// but the last of a chain leaves a tombstone.
    fn colliding_keys(n: usize) -> Vec<String> {
        let home = |k: &str| key_hash(k) as usize & 15;
        (0..10_000)
            .map(|i| format!("key/{i}"))
            .filter(|k| home(k) == home("key/0"))
            .take(n)
            .collect()
    }

    #[test]
    fn records_are_found_here_and_in_the_table() {
        let table = TableWriter::on_heap(1 << 20, 8); // 16 index entries
        let mut index = RecordIndex::default();
        index.insert("a".into(), 3, &table);
        assert_eq!(index.get("a"), Some(3));
        assert_eq!(table.candidates(key_hash("a")).collect::<Vec<_>>(), vec![3]);
        assert_eq!(index.remove("a", &table), Some(3));
        assert!(index.get("a").is_none() && index.is_empty());
        assert_eq!(table.candidates(key_hash("a")).count(), 0);
        assert_eq!(index.remove("a", &table), None);
    }

    #[test]
    fn too_many_tombstones_rebuild_the_shared_index() {
        let table = TableWriter::on_heap(1 << 20, 8); // 16 index entries: rebuild past 4
        let mut index = RecordIndex::default();
        let keys = colliding_keys(7);
        for (slot, key) in keys.iter().enumerate() {
            index.insert(key.clone(), slot, &table);
        }
        for key in &keys[..4] {
            index.remove(key, &table);
        }
        assert_eq!(index.tombstones(), 4);
        index.remove(&keys[4], &table);
        assert_eq!(
            index.tombstones(),
            0,
            "the fifth tombstone rebuilt the index"
        );
        for (slot, key) in keys.iter().enumerate().skip(5) {
            assert_eq!(
                table.candidates(key_hash(key)).collect::<Vec<_>>(),
                vec![slot]
            );
        }
        assert_eq!(index.len(), 2);
    }
}
