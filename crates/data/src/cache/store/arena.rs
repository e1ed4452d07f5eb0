//! The record arena: the store's byte range, carved from its start as records need
//! it (the carved part has its memory reserved), into extents of whole pages, each
//! free or holding one record. A record's slot is its descriptor (an entry of the
//! shared table), which any extent can use. Free extents are merged with free
//! neighbours at once, so two free extents never touch; a record goes into the
//! smallest free extent that holds it (best fit). Keys, pins and the LRU are not
//! its business: the store chooses evictions ([`room`](super::room)) and tells it
//! which extents change hands.

use std::collections::{BTreeMap, BTreeSet};

use super::super::table::SLOT_ALIGN;

/// A slot's number: its descriptor in the shared table.
pub type SlotIdx = usize;

/// What a slot holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SlotUse {
    /// Nothing (the descriptor is unused).
    Free,
    /// A record of `len` bytes being written.
    Filling {
        /// The record's length.
        len: u64,
    },
    /// A committed record.
    Ready {
        /// Its key.
        key: String,
        /// Its length.
        len: u64,
    },
}

/// Where a record lies, and which incarnation of its slot it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placed {
    /// Byte offset of the record in the store.
    pub offset: u64,
    /// The record's length.
    pub len: u64,
    /// The slot's generation (bumped on each reservation).
    pub generation: u32,
}

/// What lies at an offset of the carved part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Span {
    /// Free bytes.
    Free {
        /// Bytes (whole pages).
        len: u64,
    },
    /// One record's extent.
    Record {
        /// Its slot.
        slot: SlotIdx,
        /// Bytes (whole pages).
        len: u64,
    },
}

impl Span {
    /// Its bytes.
    pub fn len(&self) -> u64 {
        match *self {
            Span::Free { len } | Span::Record { len, .. } => len,
        }
    }

    /// Whether it spans no byte (never, for a span of the arena).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[derive(Debug)]
struct Slot {
    offset: u64,
    extent: u64,
    generation: u32,
    used: SlotUse,
}

/// Where a record of some size fits at the end of the carved part: from `start`,
/// after carving `grow` more bytes (whose memory must be reserved first).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tail {
    /// Where the record would start.
    pub start: u64,
    /// Bytes to carve.
    pub grow: u64,
}

/// The free part of the carved bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FreeSpace {
    /// Free bytes.
    pub bytes: u64,
    /// Free extents.
    pub extents: usize,
    /// The largest one.
    pub largest: u64,
}

/// A slot given up: its record's key if it was committed, and its generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Released {
    /// The key of the committed record it held (`None` for a fill).
    pub key: Option<String>,
    /// The slot's generation.
    pub generation: u32,
}

/// The extents and slots of a store of `cap` bytes.
#[derive(Debug)]
pub struct Arena {
    /// Bytes records may use: the cap rounded down to whole pages.
    cap: u64,
    carved: u64,
    /// Every extent of `[0, carved)`, by offset.
    spans: BTreeMap<u64, Span>,
    /// The free extents by (length, offset).
    free_by_len: BTreeSet<(u64, u64)>,
    slots: Vec<Slot>,
    /// Slots whose descriptor is unused.
    free_slots: Vec<SlotIdx>,
    /// Most slots the shared table has descriptors for.
    max_slots: usize,
}

impl Arena {
    /// An arena of `cap` bytes with at most `max_slots` records at once.
    pub fn new(cap: u64, max_slots: usize) -> Arena {
        Arena {
            cap: cap / SLOT_ALIGN * SLOT_ALIGN,
            carved: 0,
            spans: BTreeMap::new(),
            free_by_len: BTreeSet::new(),
            slots: Vec::new(),
            free_slots: Vec::new(),
            max_slots,
        }
    }

    /// Bytes records may use (whole pages of the cap).
    pub fn cap(&self) -> u64 {
        self.cap
    }

    /// Bytes carved so far (their memory is reserved).
    pub fn carved(&self) -> u64 {
        self.carved
    }

    /// Whether a new record can have a descriptor without one being given up.
    pub fn has_free_slot(&self) -> bool {
        !self.free_slots.is_empty() || self.slots.len() < self.max_slots
    }

    /// The smallest free extent that holds `extent` bytes: its offset.
    pub fn best_fit(&self, extent: u64) -> Option<u64> {
        self.free_by_len
            .range((extent, 0)..)
            .next()
            .map(|&(_, offset)| offset)
    }

    /// Where a record of `extent` bytes fits at the end of the carved part (joining
    /// a free extent that ends there), if the cap has room.
    pub fn tail(&self, extent: u64) -> Option<Tail> {
        let start = match self.span_before(self.carved) {
            Some((offset, Span::Free { .. })) => offset,
            _ => self.carved,
        };
        let grow = (start + extent).saturating_sub(self.carved);
        (self.carved + grow <= self.cap).then_some(Tail { start, grow })
    }

    /// Carves `bytes` more (their memory is reserved by the caller), free.
    pub fn grow(&mut self, bytes: u64) {
        if bytes == 0 {
            return;
        }
        let offset = self.carved;
        self.carved += bytes;
        self.insert_free(offset, bytes);
    }

    /// The extent that ends at `offset`, with its start.
    pub fn span_before(&self, offset: u64) -> Option<(u64, Span)> {
        let (&start, &span) = self.spans.range(..offset).next_back()?;
        (start + span.len() == offset).then_some((start, span))
    }

    /// The extent that starts at `offset`.
    pub fn span_at(&self, offset: u64) -> Option<Span> {
        self.spans.get(&offset).copied()
    }

    /// Starts a fill of `len` bytes in an extent of `extent` bytes at `offset`, which
    /// must lie in one free extent: a slot (a new generation of one) and where it
    /// lies; `None` (and no change) if the range is not free or no slot is left.
    pub fn occupy(&mut self, offset: u64, extent: u64, len: u64) -> Option<(SlotIdx, Placed)> {
        let (&start, &span) = self.spans.range(..=offset).next_back()?;
        let Span::Free { len: free } = span else {
            return None;
        };
        let end = start + free;
        if offset + extent > end || !self.has_free_slot() {
            return None;
        }
        self.remove_free(start, free);
        if offset > start {
            self.insert_free_unmerged(start, offset - start);
        }
        if end > offset + extent {
            self.insert_free_unmerged(offset + extent, end - offset - extent);
        }
        let slot = match self.free_slots.pop() {
            Some(slot) => slot,
            None => {
                self.slots.push(Slot {
                    offset,
                    extent,
                    generation: 0,
                    used: SlotUse::Free,
                });
                self.slots.len() - 1
            }
        };
        self.spans
            .insert(offset, Span::Record { slot, len: extent });
        let s = &mut self.slots[slot];
        s.offset = offset;
        s.extent = extent;
        s.generation = s.generation.wrapping_add(1).max(1);
        s.used = SlotUse::Filling { len };
        let placed = Placed {
            offset,
            len,
            generation: s.generation,
        };
        Some((slot, placed))
    }

    /// Publishes a filled slot under `key`; `None` (and no change) if the slot is
    /// not being filled.
    pub fn publish(&mut self, slot: SlotIdx, key: String) -> Option<Placed> {
        let s = self.slots.get_mut(slot)?;
        let SlotUse::Filling { len } = s.used else {
            return None;
        };
        s.used = SlotUse::Ready { key, len };
        Some(Placed {
            offset: s.offset,
            len,
            generation: s.generation,
        })
    }

    /// Where the committed record in `slot` lies; `None` if it holds none.
    pub fn ready(&self, slot: SlotIdx) -> Option<Placed> {
        let s = self.slots.get(slot)?;
        match s.used {
            SlotUse::Ready { len, .. } => Some(Placed {
                offset: s.offset,
                len,
                generation: s.generation,
            }),
            _ => None,
        }
    }

    /// Gives up what `slot` holds (a record or a fill): its extent goes free,
    /// merged with free neighbours, and its descriptor back to the unused ones.
    /// `None` if it holds nothing.
    pub fn release(&mut self, slot: SlotIdx) -> Option<Released> {
        let s = self.slots.get_mut(slot)?;
        let key = match std::mem::replace(&mut s.used, SlotUse::Free) {
            SlotUse::Free => return None,
            SlotUse::Filling { .. } => None,
            SlotUse::Ready { key, .. } => Some(key),
        };
        let (offset, extent, generation) = (s.offset, s.extent, s.generation);
        self.spans.remove(&offset);
        self.insert_free(offset, extent);
        self.free_slots.push(slot);
        Some(Released { key, generation })
    }

    /// What `slot` holds (`Free` for a number never handed out).
    pub fn slot_use(&self, slot: SlotIdx) -> &SlotUse {
        self.slots.get(slot).map_or(&SlotUse::Free, |s| &s.used)
    }

    /// The offset and bytes of the extent of `slot`, while it holds something.
    pub fn extent_of(&self, slot: SlotIdx) -> Option<(u64, u64)> {
        let s = self.slots.get(slot)?;
        (s.used != SlotUse::Free).then_some((s.offset, s.extent))
    }

    /// The slots that hold a record or a fill, with what they hold and their extent.
    pub fn in_use(&self) -> impl Iterator<Item = (SlotIdx, &SlotUse, u64)> + '_ {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.used != SlotUse::Free)
            .map(|(i, s)| (i, &s.used, s.extent))
    }

    /// The free part of the carved bytes.
    pub fn free_space(&self) -> FreeSpace {
        FreeSpace {
            bytes: self.free_by_len.iter().map(|&(len, _)| len).sum(),
            extents: self.free_by_len.len(),
            largest: self.free_by_len.last().map_or(0, |&(len, _)| len),
        }
    }

    /// Adds a free extent, merged with the free extents on either side.
    fn insert_free(&mut self, mut offset: u64, mut len: u64) {
        if let Some((start, Span::Free { len: before })) = self.span_before(offset) {
            self.remove_free(start, before);
            offset = start;
            len += before;
        }
        if let Some(Span::Free { len: after }) = self.span_at(offset + len) {
            self.remove_free(offset + len, after);
            len += after;
        }
        self.insert_free_unmerged(offset, len);
    }

    fn insert_free_unmerged(&mut self, offset: u64, len: u64) {
        self.spans.insert(offset, Span::Free { len });
        self.free_by_len.insert((len, offset));
    }

    fn remove_free(&mut self, offset: u64, len: u64) {
        self.spans.remove(&offset);
        self.free_by_len.remove(&(len, offset));
    }

    /// Checks the arena's invariants (tests): extents tile the carved part, free
    /// ones never touch, the length index matches.
    #[cfg(test)]
    pub fn check(&self) {
        let mut at = 0;
        let mut previous_free = false;
        for (&offset, span) in &self.spans {
            assert_eq!(offset, at, "extents must tile the carved bytes");
            let free = matches!(span, Span::Free { .. });
            assert!(
                !(free && previous_free),
                "two free extents touch at {offset}"
            );
            if let Span::Free { len } = *span {
                assert!(self.free_by_len.contains(&(len, offset)));
            }
            previous_free = free;
            at += span.len();
        }
        assert_eq!(at, self.carved);
        let free_spans = self
            .spans
            .values()
            .filter(|s| matches!(s, Span::Free { .. }));
        assert_eq!(free_spans.count(), self.free_by_len.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: u64 = SLOT_ALIGN;

    #[test]
    fn records_are_carved_at_the_end_then_placed_in_the_best_free_fit() {
        let mut arena = Arena::new(10 * P + 100, 100);
        assert_eq!(arena.cap(), 10 * P, "whole pages of the cap");
        assert_eq!(
            arena.tail(3 * P),
            Some(Tail {
                start: 0,
                grow: 3 * P
            })
        );
        let place = |arena: &mut Arena, extent: u64| {
            let tail = arena.tail(extent).unwrap();
            arena.grow(tail.grow);
            arena.occupy(tail.start, extent, extent - 10).unwrap().0
        };
        let a = place(&mut arena, 3 * P);
        let b = place(&mut arena, 2 * P);
        let c = place(&mut arena, 4 * P);
        arena.check();
        assert_eq!(arena.carved(), 9 * P);
        assert_eq!(arena.tail(2 * P), None, "one page left of the cap");
        assert_eq!(arena.release(a).map(|r| r.key), Some(None), "a fill");
        assert!(arena.release(a).is_none(), "released already");
        arena.release(c);
        arena.check();
        // Free now: a's 3 pages at 0 and c's 4 at 5P.
        assert_eq!(arena.best_fit(2 * P), Some(0), "the smaller fit");
        assert_eq!(arena.best_fit(4 * P), Some(5 * P));
        assert_eq!(arena.best_fit(6 * P), None);
        let free = arena.free_space();
        assert_eq!((free.bytes, free.extents, free.largest), (7 * P, 2, 4 * P));
        let (d, placed) = arena.occupy(P, 2 * P, 5).unwrap();
        assert_eq!(placed.offset, P);
        assert_eq!(arena.span_at(0), Some(Span::Free { len: P }));
        assert!(arena.occupy(0, 2 * P, 5).is_none(), "not free all the way");
        arena.check();
        arena.release(b);
        arena.release(d);
        arena.check();
        assert_eq!(arena.free_space().extents, 1, "everything merged again");
    }

    #[test]
    fn a_free_extent_at_the_end_joins_the_tail() {
        let mut arena = Arena::new(10 * P, 100);
        arena.grow(4 * P);
        let (a, _) = arena.occupy(0, 2 * P, 1).unwrap();
        assert_eq!(
            arena.tail(5 * P),
            Some(Tail {
                start: 2 * P,
                grow: 3 * P
            })
        );
        arena.release(a);
        assert_eq!(
            arena.tail(10 * P),
            Some(Tail {
                start: 0,
                grow: 6 * P
            })
        );
        assert_eq!(arena.tail(11 * P), None);
    }

    #[test]
    fn a_slot_goes_filling_ready_and_free_with_a_new_generation_each_time() {
        let mut arena = Arena::new(4 * P, 1);
        arena.grow(4 * P);
        let (slot, placed) = arena.occupy(0, P, 10).unwrap();
        assert_eq!(placed.generation, 1);
        assert!(!arena.has_free_slot(), "one descriptor only");
        assert!(arena.occupy(P, P, 10).is_none(), "no descriptor left");
        assert!(arena.ready(slot).is_none());
        assert_eq!(arena.publish(slot, "k".into()), Some(placed));
        assert!(arena.publish(slot, "k".into()).is_none(), "not filling");
        assert_eq!(arena.ready(slot), Some(placed));
        assert_eq!(arena.extent_of(slot), Some((0, P)));
        let gone = arena.release(slot).unwrap();
        assert_eq!((gone.key.as_deref(), gone.generation), (Some("k"), 1));
        assert_eq!(arena.slot_use(slot), &SlotUse::Free);
        assert_eq!(arena.extent_of(slot), None);
        let (again, placed) = arena.occupy(2 * P, 2 * P, 10).unwrap();
        assert_eq!((again, placed.generation), (slot, 2));
        assert_eq!(arena.in_use().count(), 1);
        assert_eq!(arena.slot_use(99), &SlotUse::Free);
    }
}
