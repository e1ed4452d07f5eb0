//! The store's metadata in shared memory: a header, one word block per connection
//! (owner, hit counter), a slot table (state, pin bits, length, key) and a hash index,
//! all atomics, so clients find and pin cached records without a message to the server.
//!
//! The server alone changes slot states and the index (under its store mutex);
//! clients only set and clear their own pin bit and bump their own counters. A hit
//! pins (read-modify-write) *then* loads the state, while eviction stores EVICTING
//! *then* loads the pins, all `SeqCst`: one of the two always sees the other.
//!
//! The lowest layer of the cache: it knows nothing of the store that drives it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// "VRTCACHE", little-endian.
pub const MAGIC: u64 = u64::from_le_bytes(*b"VRTCACHE");
/// Layout version; a client refuses a store of another version.
pub const VERSION: u64 = 1;
/// Connections a server can serve at once (one pin bit each).
pub const MAX_CONNECTIONS: usize = 512;
/// Longest key a record can have.
pub const MAX_KEY_BYTES: usize = 160;
/// Fewest slot entries a table has.
pub const MIN_SLOTS: u64 = 1024;
/// Most slot entries a table has (512 MiB of slot table).
pub const MAX_SLOTS: u64 = 1 << 21;
/// Store bytes per slot entry when no slot size is given.
pub const BYTES_PER_SLOT_ENTRY: u64 = 64 << 10;

const PAGE: u64 = 4096;
/// Slots are page multiples, so records start page-aligned.
pub const SLOT_ALIGN: u64 = PAGE;

/// `len` rounded up to the slot alignment: the size of the slot a record of `len`
/// bytes needs.
pub fn slot_size_for(len: u64) -> u64 {
    len.div_ceil(SLOT_ALIGN) * SLOT_ALIGN
}
const PIN_WORDS: usize = MAX_CONNECTIONS / 64;
const KEY_WORDS: usize = MAX_KEY_BYTES / 8;

// Header words.
const H_MAGIC: usize = 0;
const H_VERSION: usize = 1;
const H_ARENA: usize = 2;
const H_SLOTS: usize = 3;
const H_INDEX: usize = 4;
const H_CONNS: usize = 5;
/// The coarse clock, alone on its cache line.
const H_CLOCK: usize = 8;
const HEADER_WORDS: usize = (PAGE / 8) as usize;

// Per-connection words (one cache line each).
const CONN_WORDS: usize = 8;
const C_OWNER: usize = 0;
const C_HITS: usize = 1;

// Slot words (256 bytes each).
const SLOT_WORDS: usize = 32;
const S_STATE: usize = 0;
const S_PINS: usize = 1;
/// Record length in the low 48 bits, key length in the high 16.
const S_LEN: usize = S_PINS + PIN_WORDS;
const S_OFFSET: usize = S_LEN + 1;
const S_LAST_ACCESS: usize = S_OFFSET + 1;
const S_KEY: usize = S_LAST_ACCESS + 1;
const _: () = assert!(S_KEY + KEY_WORDS == SLOT_WORDS);

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
    /// The server is checking whether it can take it (see the module doc).
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

/// A lease id names a slot and the generation of the record it pinned.
pub fn lease_id(slot: usize, generation: u32) -> u64 {
    (u64::from(generation) << 32) | slot as u64
}

/// The slot and generation a lease id names.
pub fn decode_lease(lease: u64) -> (usize, u32) {
    ((lease & 0xffff_ffff) as usize, (lease >> 32) as u32)
}

/// The key's hash, the same in every process (FNV-1a, then a 64-bit finalizer).
pub fn key_hash(key: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in key.as_bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
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

/// Sizes of the metadata region, which follows the record arena in the memfd.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Bytes of the record arena (the byte cap), at offset 0.
    pub arena_bytes: u64,
    /// Slot entries.
    pub slots: usize,
    /// Index entries (a power of two, at least twice the slots).
    pub index_entries: usize,
}

impl Layout {
    /// The layout for a store of `cap` bytes: with slot sizes given, one entry per
    /// slot of the smallest size that fits; else `max(1024, cap / 64 KiB)` entries,
    /// at most [`MAX_SLOTS`].
    pub fn for_store(cap: u64, slot_bytes: &[u64]) -> Layout {
        let slots = match slot_bytes.iter().filter(|&&b| b > 0).min() {
            Some(&smallest) => (cap / slot_size_for(smallest)).max(1),
            None => (cap / BYTES_PER_SLOT_ENTRY).max(MIN_SLOTS),
        }
        .min(MAX_SLOTS) as usize;
        Layout::new(cap, slots)
    }

    fn new(arena_bytes: u64, slots: usize) -> Layout {
        Layout {
            arena_bytes,
            slots,
            index_entries: (2 * slots).next_power_of_two(),
        }
    }

    /// Where the metadata starts in the memfd (page-aligned).
    pub fn meta_offset(&self) -> u64 {
        meta_offset_after(self.arena_bytes)
    }

    fn conns_word(&self) -> usize {
        HEADER_WORDS
    }

    fn slots_word(&self) -> usize {
        HEADER_WORDS + MAX_CONNECTIONS * CONN_WORDS
    }

    fn index_word(&self) -> usize {
        self.slots_word() + self.slots * SLOT_WORDS
    }

    fn words(&self) -> usize {
        self.index_word() + self.index_entries
    }

    /// Bytes of metadata (not counted in the byte cap).
    pub fn meta_bytes(&self) -> u64 {
        (self.words() as u64 * 8).div_ceil(PAGE) * PAGE
    }

    /// Bytes of the whole memfd: arena, then metadata.
    pub fn total_bytes(&self) -> u64 {
        self.meta_offset() + self.meta_bytes()
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

/// The metadata region, seen as atomics. Cheap to share: every operation is on
/// atomics and takes `&self`.
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
    /// A fresh table on the heap, for tests and tools.
    pub fn on_heap(arena_bytes: u64, slots: usize) -> Table {
        let layout = Layout::new(arena_bytes, slots);
        let words: Box<[AtomicU64]> = (0..layout.words()).map(|_| AtomicU64::new(0)).collect();
        let base = words.as_ptr();
        let table = Table {
            base,
            layout,
            _backing: Arc::new(HeapWords(words)),
        };
        table.init_header();
        table
    }

    /// Creates a fresh table over zeroed memory at `base` and writes its header.
    ///
    /// # Safety
    /// `base` must be 8-byte aligned, point at `layout.meta_bytes()` zeroed bytes that
    /// only atomics touch, and stay valid while `backing` lives.
    pub unsafe fn create(base: *const u8, layout: Layout, backing: Arc<dyn Backing>) -> Table {
        let table = Table {
            base: base.cast(),
            layout,
            _backing: backing,
        };
        table.init_header();
        table
    }

    /// Attaches to a table the server created in a mapping of `mapped_len` bytes whose
    /// metadata starts at `base` (`meta_offset` bytes into the mapping).
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
        // caller guarantees alignment and lifetime.
        let header = |i: usize| unsafe { (*words.add(i)).load(Ordering::Acquire) };
        let (magic, version) = (header(H_MAGIC), header(H_VERSION));
        if magic != MAGIC || version != VERSION {
            return Err(TableError::Format { magic, version });
        }
        let (arena, slots, index, conns) = (
            header(H_ARENA),
            header(H_SLOTS),
            header(H_INDEX),
            header(H_CONNS),
        );
        if slots > MAX_SLOTS || conns != MAX_CONNECTIONS as u64 {
            return Err(TableError::Size(format!(
                "{slots} slots, {conns} connections"
            )));
        }
        let layout = Layout::new(arena, slots as usize);
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

    fn init_header(&self) {
        self.w(H_ARENA)
            .store(self.layout.arena_bytes, Ordering::Relaxed);
        self.w(H_SLOTS)
            .store(self.layout.slots as u64, Ordering::Relaxed);
        self.w(H_INDEX)
            .store(self.layout.index_entries as u64, Ordering::Relaxed);
        self.w(H_CONNS)
            .store(MAX_CONNECTIONS as u64, Ordering::Relaxed);
        self.w(H_CLOCK).store(1, Ordering::Relaxed);
        self.w(H_VERSION).store(VERSION, Ordering::Relaxed);
        self.w(H_MAGIC).store(MAGIC, Ordering::Release);
    }

    /// The word at `i` of the region.
    fn w(&self, i: usize) -> &AtomicU64 {
        assert!(i < self.layout.words(), "table word {i} out of range");
        // SAFETY: `i` is inside the region (asserted), which `_backing` keeps alive and
        // which holds only atomics (constructor contracts).
        unsafe { &*self.base.add(i) }
    }

    fn slot_word(&self, slot: usize, field: usize) -> &AtomicU64 {
        self.w(self.layout.slots_word() + slot * SLOT_WORDS + field)
    }

    fn conn_word(&self, conn: usize, field: usize) -> &AtomicU64 {
        self.w(self.layout.conns_word() + conn * CONN_WORDS + field)
    }

    /// The table's sizes.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// Slot entries.
    pub fn slots(&self) -> usize {
        self.layout.slots
    }

    // ---- clock ----

    /// The coarse clock (for LRU second chances).
    pub fn clock(&self) -> u64 {
        self.w(H_CLOCK).load(Ordering::Relaxed)
    }

    /// Advances the clock (server); returns the new value. A record entering the
    /// LRU now is stamped with it, so only accesses after a later tick look newer.
    pub fn tick(&self) -> u64 {
        self.w(H_CLOCK).fetch_add(1, Ordering::SeqCst) + 1
    }

    // ---- connections ----

    /// Gives connection bit `conn` to client `owner` with a zero hit counter (server).
    pub fn claim_connection(&self, conn: usize, owner: u64) {
        self.conn_word(conn, C_HITS).store(0, Ordering::SeqCst);
        self.conn_word(conn, C_OWNER).store(owner, Ordering::SeqCst);
    }

    /// Takes bit `conn` back (server): no owner, its pin bit cleared in the first
    /// `carved` slots; returns the hits it counted.
    pub fn release_connection(&self, conn: usize, carved: usize) -> u64 {
        self.conn_word(conn, C_OWNER).store(0, Ordering::SeqCst);
        let (word, bit) = (conn / 64, 1u64 << (conn % 64));
        for slot in 0..carved.min(self.layout.slots) {
            self.slot_word(slot, S_PINS + word)
                .fetch_and(!bit, Ordering::SeqCst);
        }
        self.conn_word(conn, C_HITS).swap(0, Ordering::SeqCst)
    }

    /// The client that owns bit `conn` (0: none).
    pub fn connection_owner(&self, conn: usize) -> u64 {
        self.conn_word(conn, C_OWNER).load(Ordering::SeqCst)
    }

    /// Hits counted in shared memory by connection `conn`.
    pub fn connection_hits(&self, conn: usize) -> u64 {
        self.conn_word(conn, C_HITS).load(Ordering::Relaxed)
    }

    /// Counts one hit of connection `conn` (only that connection's thread calls it).
    pub fn count_hit(&self, conn: usize) {
        self.conn_word(conn, C_HITS).fetch_add(1, Ordering::Relaxed);
    }

    // ---- slots ----

    /// A slot's state.
    pub fn state(&self, slot: usize) -> Option<SlotState> {
        let word = self.slot_word(slot, S_STATE).load(Ordering::SeqCst);
        Some(SlotState {
            generation: (word >> 32) as u32,
            code: SlotCode::from_word(word)?,
        })
    }

    /// Sets a slot's state (server).
    pub fn set_state(&self, slot: usize, state: SlotState) {
        self.slot_word(slot, S_STATE)
            .store(state.word(), Ordering::SeqCst);
    }

    /// Sets the fixed offset of a newly carved slot (server).
    pub fn set_offset(&self, slot: usize, offset: u64) {
        self.slot_word(slot, S_OFFSET)
            .store(offset, Ordering::Relaxed);
    }

    /// The slot's offset in the arena.
    pub fn offset(&self, slot: usize) -> u64 {
        self.slot_word(slot, S_OFFSET).load(Ordering::Relaxed)
    }

    /// The committed record's length.
    pub fn record_len(&self, slot: usize) -> u64 {
        self.slot_word(slot, S_LEN).load(Ordering::Relaxed) & LEN_MASK
    }

    /// Writes a record's key and length before it is published (server).
    pub fn write_record(&self, slot: usize, key: &str, len: u64) {
        let packed = pack_key(key.as_bytes());
        for (i, &word) in packed.iter().enumerate() {
            self.slot_word(slot, S_KEY + i)
                .store(word, Ordering::Relaxed);
        }
        let key_len = key.len().min(MAX_KEY_BYTES) as u64;
        self.slot_word(slot, S_LEN)
            .store((len & LEN_MASK) | (key_len << 48), Ordering::Relaxed);
    }

    /// Whether the slot's key is `key` (meaningful while the slot is pinned and Ready).
    pub fn key_is(&self, slot: usize, key: &str) -> bool {
        let bytes = key.as_bytes();
        if bytes.len() > MAX_KEY_BYTES {
            return false;
        }
        let stored_len = self.slot_word(slot, S_LEN).load(Ordering::Relaxed) >> 48;
        if stored_len != bytes.len() as u64 {
            return false;
        }
        let packed = pack_key(bytes);
        (0..bytes.len().div_ceil(8))
            .all(|i| self.slot_word(slot, S_KEY + i).load(Ordering::Relaxed) == packed[i])
    }

    /// The clock value of the slot's last access.
    pub fn last_access(&self, slot: usize) -> u64 {
        self.slot_word(slot, S_LAST_ACCESS).load(Ordering::Relaxed)
    }

    /// Marks the slot accessed now.
    pub fn touch(&self, slot: usize) {
        let now = self.clock();
        let word = self.slot_word(slot, S_LAST_ACCESS);
        if word.load(Ordering::Relaxed) < now {
            word.store(now, Ordering::Relaxed);
        }
    }

    /// Sets connection `conn`'s pin bit on `slot`.
    pub fn pin(&self, slot: usize, conn: usize) {
        self.slot_word(slot, S_PINS + conn / 64)
            .fetch_or(1 << (conn % 64), Ordering::SeqCst);
    }

    /// Clears connection `conn`'s pin bit on `slot`; returns whether it was set.
    pub fn unpin(&self, slot: usize, conn: usize) -> bool {
        let bit = 1u64 << (conn % 64);
        self.slot_word(slot, S_PINS + conn / 64)
            .fetch_and(!bit, Ordering::SeqCst)
            & bit
            != 0
    }

    /// Whether connection `conn` pins `slot`.
    pub fn is_pinned_by(&self, slot: usize, conn: usize) -> bool {
        self.slot_word(slot, S_PINS + conn / 64)
            .load(Ordering::SeqCst)
            & (1 << (conn % 64))
            != 0
    }

    /// Connections that pin `slot`.
    pub fn pin_count(&self, slot: usize) -> u32 {
        (0..PIN_WORDS)
            .map(|i| {
                self.slot_word(slot, S_PINS + i)
                    .load(Ordering::SeqCst)
                    .count_ones()
            })
            .sum()
    }

    /// Tries to take a Ready slot from its record (server, under the store lock):
    /// marks it Evicting, then looks at the pins; if any is set, the slot goes back to
    /// Ready and this returns false. On true the slot stays Evicting for the caller.
    pub fn try_evict(&self, slot: usize) -> bool {
        let Some(state) = self.state(slot) else {
            return false;
        };
        if state.code != SlotCode::Ready {
            return false;
        }
        self.set_state(
            slot,
            SlotState {
                code: SlotCode::Evicting,
                ..state
            },
        );
        if self.pin_count(slot) == 0 {
            return true;
        }
        self.set_state(slot, state);
        false
    }

    // ---- index ----

    fn index_entry(&self, i: usize) -> &AtomicU64 {
        self.w(self.layout.index_word() + i)
    }

    fn entry_for(hash: u64, slot: usize) -> u64 {
        ((hash >> 32) << 32) | (slot as u64 + 1)
    }

    /// Adds `hash -> slot` (server); returns whether it took a tombstone's place.
    pub fn index_insert(&self, hash: u64, slot: usize) -> bool {
        let mask = self.layout.index_entries - 1;
        let mut i = hash as usize & mask;
        for _ in 0..self.layout.index_entries {
            let entry = self.index_entry(i);
            let current = entry.load(Ordering::Relaxed);
            if current == 0 || current == TOMBSTONE {
                entry.store(Self::entry_for(hash, slot), Ordering::Release);
                return current == TOMBSTONE;
            }
            i = (i + 1) & mask;
        }
        // Unreachable while entries outnumber slots twice over; a full index only
        // costs clients their fast path for this key.
        false
    }

    /// Removes `hash -> slot` (server); returns whether it left a tombstone.
    pub fn index_remove(&self, hash: u64, slot: usize) -> bool {
        let mask = self.layout.index_entries - 1;
        let wanted = Self::entry_for(hash, slot);
        let mut i = hash as usize & mask;
        for _ in 0..self.layout.index_entries {
            let entry = self.index_entry(i);
            match entry.load(Ordering::Relaxed) {
                0 => return false,
                e if e == wanted => {
                    let next = self.index_entry((i + 1) & mask).load(Ordering::Relaxed);
                    let tomb = next != 0;
                    entry.store(if tomb { TOMBSTONE } else { 0 }, Ordering::Release);
                    return tomb;
                }
                _ => i = (i + 1) & mask,
            }
        }
        false
    }

    /// Empties the index (server, before re-inserting the live records).
    pub fn index_clear(&self) {
        for i in 0..self.layout.index_entries {
            self.index_entry(i).store(0, Ordering::Release);
        }
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
            .map(move |n| self.index_entry((start + n) & mask).load(Ordering::Acquire))
            .take_while(|&e| e != 0)
            .filter(move |&e| e != TOMBSTONE && e >> 32 == tag)
            .map(|e| (e & 0xffff_ffff) as usize - 1)
            .filter(|&slot| slot < self.layout.slots)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::time::{Duration, Instant};

    fn ready(table: &Table, slot: usize, key: &str) {
        table.write_record(slot, key, 100);
        table.set_state(
            slot,
            SlotState {
                generation: 1,
                code: SlotCode::Ready,
            },
        );
    }

    #[test]
    fn layout_sizes() {
        let l = Layout::for_store(1 << 30, &[]);
        assert_eq!(l.slots, 16384);
        assert_eq!(l.index_entries, 32768);
        assert_eq!(l.meta_offset(), 1 << 30);
        assert_eq!(l.meta_bytes() % PAGE, 0);
        assert!(l.meta_bytes() >= 16384 * 256 + 32768 * 8);
        assert_eq!(Layout::for_store(1 << 20, &[]).slots, MIN_SLOTS as usize);
        assert_eq!(Layout::for_store(512 << 10, &[64 << 10]).slots, 8);
        assert_eq!(
            Layout::for_store(u64::MAX / 2, &[]).slots,
            MAX_SLOTS as usize
        );
    }

    #[test]
    fn index_insert_lookup_remove_and_tombstones() {
        let table = Table::on_heap(1 << 20, 8); // 16 entries
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
        let table = Table::on_heap(1 << 20, 4); // 8 entries
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
    fn keys_and_pins() {
        let table = Table::on_heap(1 << 20, 4);
        ready(&table, 2, "seq/000123");
        assert!(table.key_is(2, "seq/000123"));
        assert!(!table.key_is(2, "seq/000124"));
        assert!(!table.key_is(2, "seq/00012"));
        let long = "x".repeat(MAX_KEY_BYTES);
        table.write_record(1, &long, 5);
        assert!(table.key_is(1, &long));
        assert_eq!(table.record_len(1), 5);
        table.pin(2, 0);
        table.pin(2, 511);
        assert_eq!(table.pin_count(2), 2);
        assert!(!table.try_evict(2), "a pinned slot is not taken");
        assert_eq!(table.state(2).map(|s| s.code), Some(SlotCode::Ready));
        assert!(table.unpin(2, 0));
        assert!(!table.unpin(2, 0), "a double unpin finds no bit");
        table.claim_connection(511, 42);
        table.count_hit(511);
        assert_eq!(table.connection_owner(511), 42);
        assert_eq!(table.release_connection(511, 4), 1);
        assert_eq!(table.pin_count(2), 0);
        assert!(table.try_evict(2));
        assert_eq!(table.state(2).map(|s| s.code), Some(SlotCode::Evicting));
        let (slot, generation) = decode_lease(lease_id(77, 9));
        assert_eq!((slot, generation), (77, 9));
    }

    /// One thread pins, checks the state and unpins; the other marks the slot
    /// Evicting, checks the pins and, when it wins, "overwrites" the record (a marker
    /// word) and restores it. A reader that holds the record must never see it
    /// overwritten: that would be a torn read through a broken pin protocol.
    #[test]
    fn pin_and_evict_race_never_both_win() {
        const VALID: u64 = 1;
        const OVERWRITTEN: u64 = 2;
        let table = Table::on_heap(1 << 20, 1);
        ready(&table, 0, "k");
        let record = AtomicU64::new(VALID);
        let stop = AtomicBool::new(false);
        let spin = |n: u32| {
            for _ in 0..n {
                std::hint::spin_loop();
            }
        };
        let (reads, evictions, torn) = std::thread::scope(|s| {
            let reader = s.spawn(|| {
                let (mut reads, mut torn) = (0u64, 0u64);
                while !stop.load(Ordering::Relaxed) {
                    table.pin(0, 3);
                    if table.state(0).map(|st| st.code) == Some(SlotCode::Ready) {
                        reads += 1;
                        let first = record.load(Ordering::SeqCst);
                        spin(20);
                        let last = record.load(Ordering::SeqCst);
                        if first != VALID || last != VALID {
                            torn += 1;
                        }
                    }
                    table.unpin(0, 3);
                }
                (reads, torn)
            });
            let evictor = s.spawn(|| {
                let mut evictions = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    if table.try_evict(0) {
                        evictions += 1;
                        record.store(OVERWRITTEN, Ordering::SeqCst);
                        spin(20);
                        record.store(VALID, Ordering::SeqCst);
                        table.set_state(
                            0,
                            SlotState {
                                generation: 1,
                                code: SlotCode::Ready,
                            },
                        );
                    }
                }
                evictions
            });
            let started = Instant::now();
            while started.elapsed() < Duration::from_millis(500) {
                std::thread::sleep(Duration::from_millis(10));
            }
            stop.store(true, Ordering::Relaxed);
            let (reads, torn) = reader.join().unwrap();
            (reads, evictor.join().unwrap(), torn)
        });
        assert_eq!(
            torn, 0,
            "a pinned reader saw its record taken ({reads} reads)"
        );
        assert!(
            reads > 1000 && evictions > 1000,
            "the race was not exercised: {reads} reads, {evictions} evictions"
        );
    }
}
