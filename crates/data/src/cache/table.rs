//! The store's metadata in shared memory: a header, one descriptor per record (state,
//! offset, length, key) and a hash index of the committed records, all atomics, so
//! clients find cached records without a message to the server.
//!
//! The server alone writes here ([`TableWriter`], under its store mutex); clients
//! map this region read-only and only load from it ([`Table`]). Every load is
//! `Relaxed`, the only atomic access that works on read-only memory, with explicit
//! fences where order matters: a client reads a slot's state and then, after an
//! acquire fence, the record's key, offset and length, which the server wrote before
//! publishing the state with a release store. The pins that keep a record from
//! eviction live elsewhere, in each connection's own page ([`pins`](super::pins)).
//!
//! The lowest layer of the cache: it knows nothing of the store that drives it.

use std::ops::Deref;
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::Arc;

/// "VRTCACHE", little-endian.
pub const MAGIC: u64 = u64::from_le_bytes(*b"VRTCACHE");
/// Layout version; a client refuses a store of another version.
pub const VERSION: u64 = 2;
/// The most connections a server can be sized for (one page of pins each).
pub const MAX_CONNECTIONS: usize = crate::config::MAX_CACHE_CONNECTIONS as usize;
/// Connections a server serves at once when nothing sizes it
/// ([`default_connections`] sizes it for the node).
pub const MIN_CONNECTIONS: usize = 512;

/// Connection pages for a server on a node of `cores` cores: 8 a core (a few
/// jobs, each with a loader worker a core plus its rank's other connections), at
/// least [`MIN_CONNECTIONS`], at most [`MAX_CONNECTIONS`].
pub fn connections_for_cores(cores: usize) -> usize {
    cores
        .saturating_mul(8)
        .clamp(MIN_CONNECTIONS, MAX_CONNECTIONS)
}

/// [`connections_for_cores`] of this node's cores.
pub fn default_connections() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    connections_for_cores(cores)
}
/// Longest key a record can have.
pub const MAX_KEY_BYTES: usize = 160;
/// Fewest record descriptors a table has.
pub const MIN_SLOTS: u64 = 1024;
/// Most record descriptors a table has (at most 2^21: a lease word names one in 24 bits).
pub const MAX_SLOTS: u64 = 1 << 21;
/// Store bytes per descriptor when no record size is given.
pub const BYTES_PER_SLOT_ENTRY: u64 = 64 << 10;

/// The unit of the store's layout: records start on it, and each connection's pins
/// fill one (so a client can map its own pins, and nothing else, writable).
pub const PAGE: u64 = 4096;
/// Records start page-aligned and take whole pages.
pub const SLOT_ALIGN: u64 = PAGE;

/// The bytes a record of `len` bytes takes in the store (whole pages); `None` when
/// that does not fit in a u64 (only a peer's nonsense length does that).
pub fn extent_for(len: u64) -> Option<u64> {
    len.checked_next_multiple_of(SLOT_ALIGN)
}

const KEY_WORDS: usize = MAX_KEY_BYTES / 8;

// Header words.
const H_MAGIC: usize = 0;
const H_VERSION: usize = 1;
const H_ARENA: usize = 2;
const H_SLOTS: usize = 3;
const H_INDEX: usize = 4;
const H_CONNS: usize = 5;
const HEADER_WORDS: usize = (PAGE / 8) as usize;

// Descriptor words (192 bytes, three cache lines).
const SLOT_WORDS: usize = 24;
const S_STATE: usize = 0;
/// Record length in the low 48 bits, key length in the high 16.
const S_LEN: usize = 1;
const S_OFFSET: usize = 2;
const S_KEY: usize = 3;
const _: () = assert!(S_KEY + KEY_WORDS <= SLOT_WORDS);

const LEN_MASK: u64 = (1 << 48) - 1;

/// Index entry of a removed record (probing goes on past it).
const TOMBSTONE: u64 = u64::MAX;

/// A slot's state code (low 32 bits of its state word; the generation is above).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotCode {
    /// Unused.
    Free = 0,
    /// Reserved for a fill; the filler writes it.
    Filling = 1,
    /// Holds a committed record.
    Ready = 2,
    /// The server is checking whether it can take it (see [`TableWriter::mark_evicting`]).
    Evicting = 3,
}

impl SlotCode {
    fn from_word(word: u64) -> Option<SlotCode> {
        match word & 0xffff_ffff {
            0 => Some(SlotCode::Free),
            1 => Some(SlotCode::Filling),
            2 => Some(SlotCode::Ready),
            3 => Some(SlotCode::Evicting),
            _ => None,
        }
    }
}

/// A slot's state word, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotState {
    /// Bumped each time the slot is reserved for a new record.
    pub generation: u32,
    /// What the slot holds.
    pub code: SlotCode,
}

impl SlotState {
    fn word(self) -> u64 {
        (u64::from(self.generation) << 32) | self.code as u64
    }
}

/// The key's hash, the same in every process (FNV-1a, then a 64-bit finalizer).
pub fn key_hash(key: &str) -> u64 {
    let mut h = vrtspike_contract::fnv::fnv1a_64(key.as_bytes());
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

/// The key's bytes packed into words as a slot stores them.
fn pack_key(key: &[u8]) -> [u64; KEY_WORDS] {
    let mut words = [0u64; KEY_WORDS];
    for (i, chunk) in key.chunks(8).enumerate().take(KEY_WORDS) {
        let mut bytes = [0u8; 8];
        bytes[..chunk.len()].copy_from_slice(chunk);
        words[i] = u64::from_le_bytes(bytes);
    }
    words
}

/// Where the metadata of a store with an arena of `arena_bytes` starts.
pub fn meta_offset_after(arena_bytes: u64) -> u64 {
    arena_bytes.div_ceil(PAGE) * PAGE
}

/// Sizes of the store's memfd: the record arena at offset 0, then the metadata
/// (header, descriptors, index), then one page of pins per connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Bytes of the record arena (the byte cap), at offset 0.
    pub arena_bytes: u64,
    /// Record descriptors (the most records the store holds at once).
    pub slots: usize,
    /// Index entries (a power of two, at least twice the slots).
    pub index_entries: usize,
    /// Connection pages (the most connections served at once).
    pub connections: usize,
}

impl Layout {
    /// The layout for a store of `cap` bytes: with a typical smallest record size
    /// given, `cap / record` descriptors; else `max(1024, cap / 64 KiB)`; at most
    /// [`MAX_SLOTS`].
    pub fn for_store(cap: u64, record_bytes: Option<u64>) -> Layout {
        let slots = match record_bytes.filter(|&b| b > 0).and_then(extent_for) {
            Some(record) => (cap / record).max(1),
            None => (cap / BYTES_PER_SLOT_ENTRY).max(MIN_SLOTS),
        }
        .min(MAX_SLOTS) as usize;
        Layout::new(cap, slots)
    }

    /// This layout with `connections` pages of pins (1 to [`MAX_CONNECTIONS`]).
    pub fn with_connections(self, connections: usize) -> Layout {
        Layout {
            connections: connections.clamp(1, MAX_CONNECTIONS),
            ..self
        }
    }

    fn new(arena_bytes: u64, slots: usize) -> Layout {
        Layout {
            arena_bytes,
            slots,
            index_entries: (2 * slots).next_power_of_two(),
            connections: MIN_CONNECTIONS,
        }
    }

    /// Where the metadata starts in the memfd (page-aligned).
    pub fn meta_offset(&self) -> u64 {
        meta_offset_after(self.arena_bytes)
    }

    fn slots_word(&self) -> usize {
        HEADER_WORDS
    }

    fn index_word(&self) -> usize {
        self.slots_word() + self.slots * SLOT_WORDS
    }

    fn words(&self) -> usize {
        self.index_word() + self.index_entries
    }

    /// Bytes of the metadata (not counted in the byte cap).
    pub fn meta_bytes(&self) -> u64 {
        (self.words() as u64 * 8).div_ceil(PAGE) * PAGE
    }

    /// Where the connections' pin pages start (page-aligned).
    pub fn pins_offset(&self) -> u64 {
        self.meta_offset() + self.meta_bytes()
    }

    /// Bytes of all connections' pin pages.
    pub fn pins_bytes(&self) -> u64 {
        self.connections as u64 * PAGE
    }

    /// Bytes of the whole memfd: arena, metadata, pin pages.
    pub fn total_bytes(&self) -> u64 {
        self.pins_offset() + self.pins_bytes()
    }
}

/// Why a mapped region is not a usable table.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TableError {
    /// Wrong magic or version.
    #[error("the store's metadata has magic {magic:#x} version {version}; expected {MAGIC:#x} version {VERSION} (client and server of different builds?)")]
    Format {
        /// Magic found.
        magic: u64,
        /// Version found.
        version: u64,
    },
    /// Sizes that do not fit the mapping.
    #[error("the store's metadata does not fit its mapping: {0}")]
    Size(String),
}

/// Memory that backs a table and must outlive it.
pub trait Backing: Send + Sync {}
impl<T: Send + Sync> Backing for T {}

/// The metadata, seen as atomics: the read side, all `Relaxed` loads (see the
/// module doc), which is all a client can do with its read-only mapping.
pub struct Table {
    base: *const AtomicU64,
    layout: Layout,
    _backing: Arc<dyn Backing>,
}

// SAFETY: `base` points at atomics that `_backing` keeps alive for the table's whole
// life; atomics may be used from any thread.
unsafe impl Send for Table {}
// SAFETY: as above; every access through `&Table` is an atomic operation.
unsafe impl Sync for Table {}

/// A table in ordinary memory (tests).
struct HeapWords(#[allow(dead_code)] Box<[AtomicU64]>);

impl Table {
    /// Attaches to a table the server created in a mapping of `mapped_len` bytes whose
    /// metadata starts at `base` (`meta_offset` bytes into the mapping). The mapping
    /// may be read-only: nothing here writes.
    ///
    /// # Safety
    /// `base` must be 8-byte aligned, point `meta_offset` bytes into a mapping of
    /// `mapped_len` bytes that stays valid while `backing` lives, and that region must
    /// only be touched through atomics.
    pub unsafe fn attach(
        base: *const u8,
        meta_offset: u64,
        mapped_len: u64,
        backing: Arc<dyn Backing>,
    ) -> Result<Table, TableError> {
        let avail = mapped_len.saturating_sub(meta_offset);
        if avail < PAGE {
            return Err(TableError::Size(format!(
                "{mapped_len} bytes mapped, metadata at {meta_offset}"
            )));
        }
        let words: *const AtomicU64 = base.cast();
        // SAFETY: the header page lies inside the mapping (checked above) and the
        // caller guarantees alignment and lifetime; a relaxed load works on
        // read-only memory.
        let header = |i: usize| unsafe { (*words.add(i)).load(Ordering::Relaxed) };
        let magic = header(H_MAGIC);
        fence(Ordering::Acquire);
        let version = header(H_VERSION);
        if magic != MAGIC || version != VERSION {
            return Err(TableError::Format { magic, version });
        }
        let (arena, slots, index, conns) = (
            header(H_ARENA),
            header(H_SLOTS),
            header(H_INDEX),
            header(H_CONNS),
        );
        if slots > MAX_SLOTS || conns == 0 || conns > MAX_CONNECTIONS as u64 {
            return Err(TableError::Size(format!(
                "{slots} slots, {conns} connections"
            )));
        }
        let layout = Layout::new(arena, slots as usize).with_connections(conns as usize);
        if layout.index_entries as u64 != index
            || layout.meta_offset() != meta_offset
            || layout.total_bytes() > mapped_len
        {
            return Err(TableError::Size(format!(
                "arena {arena} B, {slots} slots, {index} index entries in {mapped_len} bytes"
            )));
        }
        Ok(Table {
            base: words,
            layout,
            _backing: backing,
        })
    }

    /// The word at `i` of the region.
    fn w(&self, i: usize) -> &AtomicU64 {
        assert!(i < self.layout.words(), "table word {i} out of range");
        // SAFETY: `i` is inside the region (asserted), which `_backing` keeps alive and
        // which holds only atomics (constructor contracts).
        unsafe { &*self.base.add(i) }
    }

    fn load(&self, i: usize) -> u64 {
        self.w(i).load(Ordering::Relaxed)
    }

    fn slot_word(&self, slot: usize, field: usize) -> usize {
        self.layout.slots_word() + slot * SLOT_WORDS + field
    }

    /// The table's sizes.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// Record descriptors.
    pub fn slots(&self) -> usize {
        self.layout.slots
    }

    /// A slot's state. Loads made after it see what the server wrote before it
    /// published this state (acquire).
    pub fn state(&self, slot: usize) -> Option<SlotState> {
        let word = self.load(self.slot_word(slot, S_STATE));
        fence(Ordering::Acquire);
        Some(SlotState {
            generation: (word >> 32) as u32,
            code: SlotCode::from_word(word)?,
        })
    }

    /// The record's offset in the arena.
    pub fn offset(&self, slot: usize) -> u64 {
        self.load(self.slot_word(slot, S_OFFSET))
    }

    /// The committed record's length.
    pub fn record_len(&self, slot: usize) -> u64 {
        self.load(self.slot_word(slot, S_LEN)) & LEN_MASK
    }

    /// Whether the slot's key is `key` (meaningful while the slot is pinned and Ready).
    pub fn key_is(&self, slot: usize, key: &str) -> bool {
        let bytes = key.as_bytes();
        if bytes.len() > MAX_KEY_BYTES {
            return false;
        }
        let stored_len = self.load(self.slot_word(slot, S_LEN)) >> 48;
        if stored_len != bytes.len() as u64 {
            return false;
        }
        let packed = pack_key(bytes);
        (0..bytes.len().div_ceil(8))
            .all(|i| self.load(self.slot_word(slot, S_KEY + i)) == packed[i])
    }

    fn index_entry(&self, i: usize) -> usize {
        self.layout.index_word() + i
    }

    /// Index entries.
    pub fn index_entries(&self) -> usize {
        self.layout.index_entries
    }

    /// Slots the index names for `hash`, in probe order (candidates only: the caller
    /// checks the key under a pin).
    pub fn candidates(&self, hash: u64) -> impl Iterator<Item = usize> + '_ {
        let mask = self.layout.index_entries - 1;
        let tag = hash >> 32;
        let start = hash as usize & mask;
        (0..self.layout.index_entries)
            .map(move |n| self.load(self.index_entry((start + n) & mask)))
            .take_while(|&e| e != 0)
            .filter(move |&e| e != TOMBSTONE && e >> 32 == tag)
            .map(|e| (e & 0xffff_ffff) as usize - 1)
            .filter(|&slot| slot < self.layout.slots)
    }
}

/// The write side of the table, the server's alone: it derefs to the read side.
pub struct TableWriter {
    table: Table,
}

impl Deref for TableWriter {
    type Target = Table;

    fn deref(&self) -> &Table {
        &self.table
    }
}

impl TableWriter {
    /// A fresh table on the heap, for tests and tools.
    pub fn on_heap(arena_bytes: u64, slots: usize) -> TableWriter {
        let layout = Layout::new(arena_bytes, slots);
        let words: Box<[AtomicU64]> = (0..layout.words()).map(|_| AtomicU64::new(0)).collect();
        let base = words.as_ptr();
        let writer = TableWriter {
            table: Table {
                base,
                layout,
                _backing: Arc::new(HeapWords(words)),
            },
        };
        writer.init_header();
        writer
    }

    /// Creates a fresh table over zeroed memory at `base` and writes its header.
    ///
    /// # Safety
    /// `base` must be 8-byte aligned, point at `layout.meta_bytes()` zeroed, writable
    /// bytes that only atomics touch, and stay valid while `backing` lives.
    pub unsafe fn create(
        base: *const u8,
        layout: Layout,
        backing: Arc<dyn Backing>,
    ) -> TableWriter {
        let writer = TableWriter {
            table: Table {
                base: base.cast(),
                layout,
                _backing: backing,
            },
        };
        writer.init_header();
        writer
    }

    fn store(&self, i: usize, value: u64, order: Ordering) {
        self.table.w(i).store(value, order);
    }

    fn init_header(&self) {
        let layout = self.table.layout;
        self.store(H_ARENA, layout.arena_bytes, Ordering::Relaxed);
        self.store(H_SLOTS, layout.slots as u64, Ordering::Relaxed);
        self.store(H_INDEX, layout.index_entries as u64, Ordering::Relaxed);
        self.store(H_CONNS, layout.connections as u64, Ordering::Relaxed);
        self.store(H_VERSION, VERSION, Ordering::Relaxed);
        self.store(H_MAGIC, MAGIC, Ordering::Release);
    }

    /// Sets a slot's state (release: what was written before is seen by whoever
    /// reads this state).
    pub fn set_state(&self, slot: usize, state: SlotState) {
        let i = self.table.slot_word(slot, S_STATE);
        self.store(i, state.word(), Ordering::SeqCst);
    }

    /// Writes a record's key, place and length before it is published.
    pub fn write_record(&self, slot: usize, key: &str, offset: u64, len: u64) {
        let packed = pack_key(key.as_bytes());
        for (i, &word) in packed.iter().enumerate() {
            self.store(
                self.table.slot_word(slot, S_KEY + i),
                word,
                Ordering::Relaxed,
            );
        }
        let key_len = key.len().min(MAX_KEY_BYTES) as u64;
        let len_word = (len & LEN_MASK) | (key_len << 48);
        self.store(
            self.table.slot_word(slot, S_LEN),
            len_word,
            Ordering::Relaxed,
        );
        self.store(
            self.table.slot_word(slot, S_OFFSET),
            offset,
            Ordering::Relaxed,
        );
    }

    /// Marks a Ready slot Evicting and returns the state it had (`None`, and no
    /// change, if it was not Ready). Then a sequentially consistent fence: the
    /// caller checks the pins next, and a client pins (then fences) before it reads
    /// the state, so either the client sees Evicting or the caller sees the pin.
    pub fn mark_evicting(&self, slot: usize) -> Option<SlotState> {
        let state = self.table.state(slot)?;
        if state.code != SlotCode::Ready {
            return None;
        }
        self.set_state(
            slot,
            SlotState {
                code: SlotCode::Evicting,
                ..state
            },
        );
        fence(Ordering::SeqCst);
        Some(state)
    }

    fn entry_for(hash: u64, slot: usize) -> u64 {
        ((hash >> 32) << 32) | (slot as u64 + 1)
    }

    /// Adds `hash -> slot`; returns whether it took a tombstone's place.
    pub fn index_insert(&self, hash: u64, slot: usize) -> bool {
        let mask = self.table.layout.index_entries - 1;
        let mut i = hash as usize & mask;
        for _ in 0..self.table.layout.index_entries {
            let at = self.table.index_entry(i);
            let current = self.table.load(at);
            if current == 0 || current == TOMBSTONE {
                self.store(at, Self::entry_for(hash, slot), Ordering::Release);
                return current == TOMBSTONE;
            }
            i = (i + 1) & mask;
        }
        // Unreachable while entries outnumber slots twice over; a full index only
        // costs clients their fast path for this key.
        false
    }

    /// Removes `hash -> slot`; returns whether it left a tombstone.
    pub fn index_remove(&self, hash: u64, slot: usize) -> bool {
        let mask = self.table.layout.index_entries - 1;
        let wanted = Self::entry_for(hash, slot);
        let mut i = hash as usize & mask;
        for _ in 0..self.table.layout.index_entries {
            let at = self.table.index_entry(i);
            match self.table.load(at) {
                0 => return false,
                e if e == wanted => {
                    let next = self.table.load(self.table.index_entry((i + 1) & mask));
                    let tomb = next != 0;
                    self.store(at, if tomb { TOMBSTONE } else { 0 }, Ordering::Release);
                    return tomb;
                }
                _ => i = (i + 1) & mask,
            }
        }
        false
    }

    /// Empties the index (before re-inserting the live records).
    pub fn index_clear(&self) {
        for i in 0..self.table.layout.index_entries {
            self.store(self.table.index_entry(i), 0, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ready(table: &TableWriter, slot: usize, key: &str) {
        table.write_record(slot, key, 4096 * slot as u64, 100);
        table.set_state(
            slot,
            SlotState {
                generation: 1,
                code: SlotCode::Ready,
            },
        );
    }

    #[test]
    fn connections_are_sized_for_the_node() {
        assert_eq!(connections_for_cores(1), MIN_CONNECTIONS);
        assert_eq!(connections_for_cores(96), 768);
        assert_eq!(connections_for_cores(usize::MAX), MAX_CONNECTIONS);
        assert!(default_connections() >= MIN_CONNECTIONS);
        assert_eq!(
            Layout::for_store(1 << 20, None).connections,
            MIN_CONNECTIONS
        );
        assert_eq!(
            Layout::for_store(1 << 20, None)
                .with_connections(0)
                .connections,
            1
        );
    }

    #[test]
    fn layout_sizes() {
        let l = Layout::for_store(1 << 30, None);
        assert_eq!(l.slots, 16384);
        assert_eq!(l.index_entries, 32768);
        assert_eq!(l.meta_offset(), 1 << 30);
        assert_eq!(l.meta_bytes() % PAGE, 0);
        assert!(l.meta_bytes() >= 16384 * 192 + 32768 * 8);
        assert_eq!(l.pins_offset(), l.meta_offset() + l.meta_bytes());
        assert_eq!(l.total_bytes(), l.pins_offset() + 512 * PAGE);
        assert_eq!(Layout::for_store(1 << 20, None).slots, MIN_SLOTS as usize);
        assert_eq!(Layout::for_store(512 << 10, Some(64 << 10)).slots, 8);
        assert_eq!(Layout::for_store(512 << 10, Some(u64::MAX)).slots, 1024);
        assert_eq!(
            Layout::for_store(u64::MAX / 2, None).slots,
            MAX_SLOTS as usize
        );
    }

    #[test]
    fn extents_are_whole_pages_and_never_overflow() {
        assert_eq!(extent_for(1), Some(PAGE));
        assert_eq!(extent_for(PAGE), Some(PAGE));
        assert_eq!(extent_for(PAGE + 1), Some(2 * PAGE));
        assert_eq!(extent_for(u64::MAX), None);
        assert_eq!(extent_for(u64::MAX - 100), None);
        assert_eq!(extent_for(u64::MAX - PAGE), Some(u64::MAX - (PAGE - 1)));
    }

    #[test]
    fn index_insert_lookup_remove_and_tombstones() {
        let table = TableWriter::on_heap(1 << 20, 8); // 16 entries
        let (a, b) = (key_hash("a"), key_hash("b"));
        assert!(!table.index_insert(a, 3));
        assert!(!table.index_insert(b, 5));
        assert_eq!(table.candidates(a).collect::<Vec<_>>(), vec![3]);
        assert_eq!(table.candidates(b).collect::<Vec<_>>(), vec![5]);
        assert_eq!(table.candidates(key_hash("c")).count(), 0);
        // Same home bucket, different tags: both found through the chain; removing
        // the first leaves a tombstone the probe steps over, which a later insert reuses.
        let h1 = 0x1111_1111_0000_0002u64;
        let h2 = 0x2222_2222_0000_0002u64;
        table.index_insert(h1, 0);
        table.index_insert(h2, 1);
        assert!(
            table.index_remove(h1, 0),
            "a chained entry leaves a tombstone"
        );
        assert_eq!(table.candidates(h2).collect::<Vec<_>>(), vec![1]);
        assert_eq!(table.candidates(h1).count(), 0);
        assert!(table.index_insert(h1, 7), "the tombstone is reused");
        assert_eq!(table.candidates(h1).collect::<Vec<_>>(), vec![7]);
        // Removing the end of a chain empties the entry outright.
        assert!(!table.index_remove(h2, 1));
        assert!(!table.index_remove(h2, 1), "gone already");
    }

    #[test]
    fn index_probe_wraps_around_the_end() {
        let table = TableWriter::on_heap(1 << 20, 4); // 8 entries
        let last = 7u64; // home bucket 7, the last entry
        let hashes: Vec<u64> = (1..=3).map(|t| (t << 32) | last).collect();
        for (slot, &h) in hashes.iter().enumerate() {
            table.index_insert(h, slot);
        }
        for (slot, &h) in hashes.iter().enumerate() {
            assert_eq!(table.candidates(h).collect::<Vec<_>>(), vec![slot]);
        }
        table.index_clear();
        assert_eq!(table.candidates(hashes[2]).count(), 0);
    }

    #[test]
    fn records_and_eviction_marks() {
        let table = TableWriter::on_heap(1 << 20, 4);
        ready(&table, 2, "seq/000123");
        assert!(table.key_is(2, "seq/000123"));
        assert!(!table.key_is(2, "seq/000124"));
        assert!(!table.key_is(2, "seq/00012"));
        assert_eq!((table.offset(2), table.record_len(2)), (8192, 100));
        let long = "x".repeat(MAX_KEY_BYTES);
        table.write_record(1, &long, 0, 5);
        assert!(table.key_is(1, &long));
        assert_eq!(table.record_len(1), 5);
        let before = table.mark_evicting(2).unwrap();
        assert_eq!(before.code, SlotCode::Ready);
        assert_eq!(table.state(2).map(|s| s.code), Some(SlotCode::Evicting));
        assert!(
            table.mark_evicting(2).is_none(),
            "only a Ready slot is marked"
        );
        assert!(
            table.mark_evicting(3).is_none(),
            "a free slot is not marked"
        );
        table.set_state(2, before);
        assert_eq!(table.state(2), Some(before));
    }

    /// The header is what a client checks before it trusts the sizes.
    #[test]
    fn a_client_attaches_only_to_a_table_of_its_version_that_fits() {
        // Sized for 700 connections: the client learns it from the header.
        let layout = Layout::for_store(1 << 20, None).with_connections(700);
        assert_eq!(layout.pins_bytes(), 700 * PAGE);
        let mut memory = vec![0u64; (layout.total_bytes() / 8) as usize];
        let base = memory.as_mut_ptr().cast::<u8>();
        let meta = layout.meta_offset();
        let backing: Arc<dyn Backing> = Arc::new(());
        // SAFETY: `memory` is aligned, zeroed, large enough and outlives the tables
        // below (dropped at the end of the test); only atomics touch it.
        let writer =
            unsafe { TableWriter::create(base.add(meta as usize), layout, backing.clone()) };
        writer.index_insert(key_hash("k"), 3);
        let attach = |len: u64| {
            // SAFETY: as above; `len` never exceeds `memory`.
            unsafe { Table::attach(base.add(meta as usize), meta, len, backing.clone()) }
        };
        let reader = attach(layout.total_bytes()).unwrap();
        assert_eq!(reader.layout(), layout);
        assert_eq!(
            reader.candidates(key_hash("k")).collect::<Vec<_>>(),
            vec![3]
        );
        assert!(matches!(
            attach(layout.total_bytes() - PAGE),
            Err(TableError::Size(_))
        ));
        writer.store(H_CONNS, 0, Ordering::Relaxed);
        assert!(matches!(
            attach(layout.total_bytes()),
            Err(TableError::Size(_))
        ));
        writer.store(H_CONNS, 700, Ordering::Relaxed);
        writer.store(H_VERSION, 1, Ordering::Relaxed);
        assert!(matches!(
            attach(layout.total_bytes()),
            Err(TableError::Format { version: 1, .. })
        ));
        drop((reader, writer));
        drop(memory);
    }
}
