//! Each connection's own page of the store: its leases (the pins that keep records
//! from eviction), its counters (hits, and hits whose record was not what its
//! reader expected), a ring of the records it read and how far its
//! reader has got in the read order it announced (the planned policy). A client maps
//! its own page read-write and everything else of the store read-only; the server
//! maps every page and reads them when it evicts.
//!
//! A lease is one entry of the page, a word naming the entry, the slot and a
//! sequence number unique to the connection ([`LeaseWord`]): it belongs to exactly
//! one lease. Releasing swaps that exact word for zero, so a stale release (of a
//! lease released already, through the protocol or otherwise) finds another word, or
//! none, and is a no-op.
//!
//! The pin protocol: a client writes the entry, sets its bit in the page's bitmap
//! (sequentially consistent), fences, and only then reads the slot's state; the
//! server marks a slot Evicting, fences, then reads every live page's bitmap and
//! entries. One of the two always sees the other, so eviction never takes a record a
//! lease was granted on.

use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::Arc;

use super::table::{Backing, MAX_CONNECTIONS};

/// Leases one connection can hold at once.
pub const LEASES_PER_CONNECTION: usize = 64;
/// Reads a connection remembers for the server's LRU between two evictions.
pub const ACCESS_RING: usize = 256;
/// Words of one connection's page.
pub const PAGE_WORDS: usize = 512;

// Page words.
const P_OWNER: usize = 0;
const P_HITS: usize = 1;
const P_SEQ: usize = 2;
const P_RING_HEAD: usize = 3;
/// How far the connection's reader has got in the read order it announced (a step).
const P_PROGRESS: usize = 4;
/// Hits whose record's layout was not the one its reader expected (read from disk).
const P_MISMATCHES: usize = 5;
/// Bit i set: entry i holds a lease (alone on its cache line).
const P_BITMAP: usize = 8;
const P_LEASES: usize = 16;
const P_RING: usize = P_LEASES + LEASES_PER_CONNECTION + 48;
const _: () = assert!(P_RING + ACCESS_RING <= PAGE_WORDS);
const _: () = assert!(LEASES_PER_CONNECTION <= 64);
const _: () = assert!(PAGE_WORDS as u64 * 8 == super::table::PAGE);

/// One lease: entry index (8 bits), slot + 1 (24 bits), sequence number (32 bits).
/// Never zero. It is also the lease's id in the protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseWord(pub u64);

impl LeaseWord {
    fn new(entry: usize, slot: usize, seq: u32) -> LeaseWord {
        LeaseWord(((entry as u64) << 56) | ((slot as u64 + 1) << 32) | u64::from(seq))
    }

    /// The page entry it lives in (may be out of range in a word from a peer).
    pub fn entry(self) -> usize {
        (self.0 >> 56) as usize
    }

    /// The slot it pins; `None` for a word that names none.
    pub fn slot(self) -> Option<usize> {
        let plus_one = ((self.0 >> 32) & 0x00ff_ffff) as usize;
        plus_one.checked_sub(1)
    }
}

/// What a client counted in its own page, with no message to the server.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PageCounts {
    /// Hits taken straight from shared memory.
    pub hits: u64,
    /// Records found whose layout (header) was not what the reader expected: it
    /// read them from disk instead.
    pub layout_mismatches: u64,
}

/// Why a lease could not be taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeasesFull;

/// A connection's page: a view of its words. Clients hold their own; the server
/// views every page of its mapping.
#[derive(Debug, Clone, Copy)]
pub struct PinPage<'a> {
    words: &'a [AtomicU64],
}

impl<'a> PinPage<'a> {
    /// The page over `words` (at least [`PAGE_WORDS`] long).
    pub fn new(words: &'a [AtomicU64]) -> PinPage<'a> {
        assert!(
            words.len() >= PAGE_WORDS,
            "a pin page has {PAGE_WORDS} words"
        );
        PinPage { words }
    }

    fn w(&self, i: usize) -> &AtomicU64 {
        &self.words[i]
    }

    // ---- the server's side ----

    /// Gives the page to client `owner` (0: nobody), empty: no lease, no hit, no
    /// recorded read.
    pub fn reset(&self, owner: u64) {
        for word in &self.words[..PAGE_WORDS] {
            word.store(0, Ordering::SeqCst);
        }
        self.w(P_OWNER).store(owner, Ordering::SeqCst);
    }

    /// Takes the page from its client, keeping its leases (they still pin): the
    /// client's shared-memory hits stop (it finds another owner) and the server
    /// answers its requests no more. Returns what it counted.
    pub fn retire(&self) -> PageCounts {
        self.w(P_OWNER).store(0, Ordering::SeqCst);
        PageCounts {
            hits: self.w(P_HITS).swap(0, Ordering::SeqCst),
            layout_mismatches: self.w(P_MISMATCHES).swap(0, Ordering::SeqCst),
        }
    }

    /// Whether any lease of this page pins `slot` (the server calls it after
    /// [`mark_evicting`](super::table::TableWriter::mark_evicting)'s fence).
    pub fn pins(&self, slot: usize) -> bool {
        self.leases().any(|lease| lease.slot() == Some(slot))
    }

    /// The leases held now.
    pub fn leases(&self) -> impl Iterator<Item = LeaseWord> + 'a {
        let words = self.words;
        let bitmap = words[P_BITMAP].load(Ordering::SeqCst);
        (0..LEASES_PER_CONNECTION)
            .filter(move |i| bitmap & (1 << i) != 0)
            .map(move |i| words[P_LEASES + i].load(Ordering::SeqCst))
            .filter(|&word| word != 0)
            .map(LeaseWord)
    }

    /// The reads recorded since `tail` (the server's cursor, moved to the end):
    /// slots below `slots`, the oldest lost if more than [`ACCESS_RING`] were made.
    /// Only a hint for the LRU: a faulty client can write nonsense here and cost
    /// itself nothing but a worse LRU order.
    pub fn drain_reads(&self, tail: &mut u64, slots: usize, out: &mut Vec<usize>) {
        let head = self.w(P_RING_HEAD).load(Ordering::Acquire);
        if head < *tail {
            *tail = head;
            return;
        }
        let from = (*tail).max(head.saturating_sub(ACCESS_RING as u64));
        for n in from..head {
            let entry = self.w(P_RING + (n % ACCESS_RING as u64) as usize);
            let slot = entry.load(Ordering::Relaxed).wrapping_sub(1);
            if slot < slots as u64 {
                out.push(slot as usize);
            }
        }
        *tail = head;
    }

    // ---- both sides ----

    /// The client this page belongs to (0: none).
    pub fn owner(&self) -> u64 {
        self.w(P_OWNER).load(Ordering::SeqCst)
    }

    /// What the page's client counted here.
    pub fn counts(&self) -> PageCounts {
        PageCounts {
            hits: self.w(P_HITS).load(Ordering::Relaxed),
            layout_mismatches: self.w(P_MISMATCHES).load(Ordering::Relaxed),
        }
    }

    /// Leases held now.
    pub fn lease_count(&self) -> usize {
        self.leases().count()
    }

    /// Pins `slot` under a new lease: the entry, then its bit, then a fence (see the
    /// module doc). Only the page's client calls it, or the server while serving
    /// that client's request (the client waits then), so no two take at once.
    pub fn take(&self, slot: usize) -> Result<LeaseWord, LeasesFull> {
        let bitmap = self.w(P_BITMAP).load(Ordering::SeqCst);
        let entry = (!bitmap).trailing_zeros() as usize;
        if entry >= LEASES_PER_CONNECTION {
            return Err(LeasesFull);
        }
        let seq = self.w(P_SEQ).fetch_add(1, Ordering::Relaxed) as u32;
        let lease = LeaseWord::new(entry, slot, seq);
        self.w(P_LEASES + entry).store(lease.0, Ordering::SeqCst);
        self.w(P_BITMAP).fetch_or(1 << entry, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        Ok(lease)
    }

    /// Releases exactly `lease`; false (and no change) if this page does not hold it
    /// (released already, or never granted).
    pub fn release(&self, lease: LeaseWord) -> bool {
        let entry = lease.entry();
        if entry >= LEASES_PER_CONNECTION || lease.slot().is_none() {
            return false;
        }
        let swapped = self.w(P_LEASES + entry).compare_exchange(
            lease.0,
            0,
            Ordering::SeqCst,
            Ordering::SeqCst,
        );
        if swapped.is_err() {
            return false;
        }
        self.w(P_BITMAP).fetch_and(!(1 << entry), Ordering::SeqCst);
        true
    }

    /// Counts one hit (the page's client).
    pub fn count_hit(&self) {
        self.w(P_HITS).fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one record whose layout was not what the reader expected (the page's
    /// client, which reads it from disk instead).
    pub fn count_layout_mismatch(&self) {
        self.w(P_MISMATCHES).fetch_add(1, Ordering::Relaxed);
    }

    /// The step the page's reader has reached in the read order it announced: uses at
    /// earlier steps are past (the client writes it; no message).
    pub fn set_progress(&self, step: u64) {
        self.w(P_PROGRESS).store(step, Ordering::Release);
    }

    /// The step written by [`set_progress`](Self::set_progress) (0 before any).
    pub fn progress(&self) -> u64 {
        self.w(P_PROGRESS).load(Ordering::Acquire)
    }

    /// Records a read of `slot` for the server's LRU (the page's client, or the
    /// server while serving it).
    pub fn record_read(&self, slot: usize) {
        let head = self.w(P_RING_HEAD).load(Ordering::Relaxed);
        let entry = P_RING + (head % ACCESS_RING as u64) as usize;
        self.w(entry).store(slot as u64 + 1, Ordering::Relaxed);
        self.w(P_RING_HEAD)
            .store(head.wrapping_add(1), Ordering::Release);
    }
}

/// Every connection's page, as the server maps them.
pub struct PinPages {
    base: *const AtomicU64,
    /// Pages there are.
    count: usize,
    _backing: Arc<dyn Backing>,
}

// SAFETY: `base` points at atomics that `_backing` keeps alive for the pages' whole
// life; atomics may be used from any thread.
unsafe impl Send for PinPages {}
// SAFETY: as above; every access through `&PinPages` is an atomic operation.
unsafe impl Sync for PinPages {}

impl std::fmt::Debug for PinPages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinPages").finish_non_exhaustive()
    }
}

impl PinPages {
    /// `count` zeroed pages on the heap (tests, single-process tools; at most
    /// [`MAX_CONNECTIONS`]).
    pub fn on_heap(count: usize) -> PinPages {
        let count = count.min(MAX_CONNECTIONS);
        let words: Box<[AtomicU64]> = (0..count * PAGE_WORDS).map(|_| AtomicU64::new(0)).collect();
        let base = words.as_ptr();
        PinPages {
            base,
            count,
            _backing: Arc::new(words),
        }
    }

    /// The `count` pages at `base`.
    ///
    /// # Safety
    /// `base` must be 8-byte aligned and point at `count` pages of
    /// [`PAGE_WORDS`] words each, readable and writable, that only atomics touch and
    /// that stay valid while `backing` lives.
    pub unsafe fn over(base: *const u8, count: usize, backing: Arc<dyn Backing>) -> PinPages {
        PinPages {
            base: base.cast(),
            count,
            _backing: backing,
        }
    }

    /// Pages there are.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Connection page `page` (below [`Self::count`]).
    pub fn page(&self, page: usize) -> PinPage<'_> {
        assert!(page < self.count, "pin page {page} out of range");
        // SAFETY: the page lies inside the pages (asserted) that `_backing` keeps
        // alive for `&self`'s lifetime, and holds only atomics (constructor contract).
        let words =
            unsafe { std::slice::from_raw_parts(self.base.add(page * PAGE_WORDS), PAGE_WORDS) };
        PinPage::new(words)
    }
}

/// Words on the heap for tests.
#[cfg(test)]
pub fn heap_page() -> Vec<AtomicU64> {
    (0..PAGE_WORDS).map(|_| AtomicU64::new(0)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_is_one_entry_and_a_stale_release_is_a_no_op() {
        let words = heap_page();
        let page = PinPage::new(&words);
        page.reset(7);
        assert_eq!(page.owner(), 7);
        let first = page.take(3).unwrap();
        let second = page.take(3).unwrap();
        assert_ne!(first, second, "two leases of one slot are two entries");
        assert_eq!(
            (first.slot(), first.entry(), second.entry()),
            (Some(3), 0, 1)
        );
        assert!(page.pins(3) && !page.pins(4));
        assert!(page.release(first));
        assert!(!page.release(first), "a second release finds nothing");
        assert!(page.pins(3), "the other lease still pins");
        // The freed entry is taken again by a new lease of the same slot: the old
        // lease's release must not touch it.
        let third = page.take(3).unwrap();
        assert_eq!(third.entry(), first.entry());
        assert!(
            !page.release(first),
            "a stale release of the entry's old lease"
        );
        assert_eq!(page.lease_count(), 2);
        assert!(page.release(second) && page.release(third));
        assert!(!page.pins(3));
        assert_eq!(page.lease_count(), 0);
    }

    #[test]
    fn leases_run_out_and_words_from_a_peer_are_checked() {
        let words = heap_page();
        let page = PinPage::new(&words);
        let leases: Vec<LeaseWord> = (0..LEASES_PER_CONNECTION)
            .map(|i| page.take(i).unwrap())
            .collect();
        assert_eq!(page.take(99), Err(LeasesFull));
        assert!(page.release(leases[10]));
        assert_eq!(page.take(99).map(|l| l.entry()), Ok(10));
        for nonsense in [0, u64::MAX, 1 << 63, LeaseWord::new(63, 5, 1).0] {
            assert!(!page.release(LeaseWord(nonsense)), "{nonsense:#x}");
        }
        assert_eq!(LeaseWord(0).slot(), None);
        assert_eq!(LeaseWord(u64::MAX).entry(), 255);
    }

    #[test]
    fn a_retired_page_keeps_its_pins_and_a_reset_clears_them() {
        let words = heap_page();
        let page = PinPage::new(&words);
        page.reset(5);
        page.take(2).unwrap();
        page.count_hit();
        page.count_hit();
        page.count_layout_mismatch();
        let counted = PageCounts {
            hits: 2,
            layout_mismatches: 1,
        };
        assert_eq!(page.counts(), counted);
        assert_eq!(page.retire(), counted);
        assert_eq!((page.owner(), page.counts()), (0, PageCounts::default()));
        assert!(page.pins(2), "a retired page still pins");
        page.reset(6);
        assert!(!page.pins(2));
        assert_eq!(page.owner(), 6);
    }

    #[test]
    fn reads_are_drained_once_and_the_ring_keeps_the_latest() {
        let words = heap_page();
        let page = PinPage::new(&words);
        let (mut tail, mut out) = (0, Vec::new());
        page.record_read(4);
        page.record_read(9);
        page.drain_reads(&mut tail, 100, &mut out);
        assert_eq!(out, vec![4, 9]);
        out.clear();
        page.drain_reads(&mut tail, 100, &mut out);
        assert!(out.is_empty(), "drained already");
        for slot in 0..ACCESS_RING + 10 {
            page.record_read(slot);
        }
        page.drain_reads(&mut tail, 100, &mut out);
        assert_eq!(
            out.len(),
            90,
            "only slots below 100 of the last {ACCESS_RING}"
        );
        assert_eq!(out[0], 10);
        // A faulty client's head going backwards, or garbage slots: nothing breaks.
        words[P_RING_HEAD].store(3, Ordering::Relaxed);
        out.clear();
        page.drain_reads(&mut tail, 100, &mut out);
        assert!(out.is_empty());
        words[P_RING].store(u64::MAX, Ordering::Relaxed);
        words[P_RING_HEAD].store(u64::MAX, Ordering::Relaxed);
        page.drain_reads(&mut tail, 100, &mut out);
        assert!(out.iter().all(|&s| s < 100));
    }

    /// One thread pins, checks the state and unpins; the other marks the slot
    /// Evicting, checks the pins and, when it wins, "overwrites" the record (a marker
    /// word) and restores it. A reader that holds the record must never see it
    /// overwritten: that would be a torn read through a broken pin protocol.
    #[test]
    fn pin_and_evict_race_never_both_win() {
        use super::super::table::{SlotCode, SlotState, TableWriter};
        use std::sync::atomic::AtomicBool;
        use std::time::{Duration, Instant};
        const VALID: u64 = 1;
        const OVERWRITTEN: u64 = 2;
        let table = TableWriter::on_heap(1 << 20, 1);
        let ready = SlotState {
            generation: 1,
            code: SlotCode::Ready,
        };
        table.write_record(0, "k", 0, 1);
        table.set_state(0, ready);
        let words = heap_page();
        let page = PinPage::new(&words);
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
                    let lease = page.take(0).unwrap();
                    if table.state(0).map(|st| st.code) == Some(SlotCode::Ready) {
                        reads += 1;
                        let first = record.load(Ordering::SeqCst);
                        spin(20);
                        let last = record.load(Ordering::SeqCst);
                        if first != VALID || last != VALID {
                            torn += 1;
                        }
                    }
                    assert!(page.release(lease));
                }
                (reads, torn)
            });
            let evictor = s.spawn(|| {
                let mut evictions = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let Some(before) = table.mark_evicting(0) else {
                        continue;
                    };
                    if !page.pins(0) {
                        evictions += 1;
                        record.store(OVERWRITTEN, Ordering::SeqCst);
                        spin(20);
                        record.store(VALID, Ordering::SeqCst);
                    }
                    table.set_state(0, before);
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
