//! The slot arena: the store's byte range carved, on demand, into fixed-size slots
//! of one class per slot size, each class with its free list, and what every slot
//! holds. It knows nothing of keys' whereabouts, pins or LRU order: the facade
//! asks it for a slot and tells it when a slot changes hands.

use super::super::protocol::RequestError;
use super::super::table::slot_size_for;

/// A slot's number: its entry in the shared table.
pub type SlotIdx = usize;
/// A slot class's number; stable for the store's life (classes are never removed).
pub type ClassIdx = usize;

/// What a slot holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SlotUse {
    /// Nothing.
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

/// Where a committed record lies, and which incarnation of its slot it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placed {
    /// Byte offset of the slot in the store.
    pub offset: u64,
    /// The record's length.
    pub len: u64,
    /// The slot's generation (bumped on each reservation).
    pub generation: u32,
}

#[derive(Debug)]
struct Slot {
    offset: u64,
    class: ClassIdx,
    generation: u32,
    used: SlotUse,
}

/// All slots of one size.
#[derive(Debug)]
struct SlotClass {
    slot_bytes: u64,
    slots: Vec<SlotIdx>,
    free: Vec<SlotIdx>,
}

/// One class as the stats see it.
#[derive(Debug, Clone, Copy)]
pub struct ClassView<'a> {
    /// Bytes per slot.
    pub slot_bytes: u64,
    /// Its slots, in carving order.
    pub slots: &'a [SlotIdx],
}

/// The slots of a store of `cap` bytes.
#[derive(Debug)]
pub struct SlotArena {
    cap: u64,
    carved: u64,
    /// Most slots the shared table has entries for.
    max_slots: usize,
    /// Whether the classes were given up front (no class is added later).
    fixed_classes: bool,
    classes: Vec<SlotClass>,
    slots: Vec<Slot>,
}

impl SlotArena {
    /// An arena of `cap` bytes with at most `max_slots` slots. With `slot_bytes`
    /// given, those are its classes for good; without, a class is added for each
    /// new record size.
    pub fn new(cap: u64, slot_bytes: &[u64], max_slots: usize) -> SlotArena {
        let mut sizes: Vec<u64> = slot_bytes.iter().map(|&b| slot_size_for(b)).collect();
        sizes.sort_unstable();
        sizes.dedup();
        SlotArena {
            cap,
            carved: 0,
            max_slots,
            fixed_classes: !sizes.is_empty(),
            classes: sizes.into_iter().map(SlotClass::new).collect(),
            slots: Vec::new(),
        }
    }

    /// The byte cap.
    pub fn cap(&self) -> u64 {
        self.cap
    }

    /// Bytes carved into slots so far.
    pub fn carved_bytes(&self) -> u64 {
        self.carved
    }

    /// Slots carved so far (slot numbers run from 0 to this).
    pub fn carved_slots(&self) -> usize {
        self.slots.len()
    }

    /// The smallest class whose slots hold `len` bytes, adding one if the classes
    /// are not fixed and the uncarved bytes hold such a slot.
    pub fn class_for(&mut self, key: &str, len: u64) -> Result<ClassIdx, RequestError> {
        let fitting = self
            .classes
            .iter()
            .enumerate()
            .filter(|(_, c)| c.slot_bytes >= len)
            .min_by_key(|(_, c)| c.slot_bytes);
        if let Some((ci, _)) = fitting {
            return Ok(ci);
        }
        let needed = slot_size_for(len);
        let uncarved = self.cap - self.carved;
        if self.fixed_classes || needed > uncarved {
            let largest_slot = if self.fixed_classes {
                self.classes.iter().map(|c| c.slot_bytes).max().unwrap_or(0)
            } else {
                uncarved
            };
            return Err(RequestError::RecordTooLarge {
                key: key.to_string(),
                len,
                largest_slot,
            });
        }
        self.classes.push(SlotClass::new(needed));
        Ok(self.classes.len() - 1)
    }

    /// Bytes per slot of class `ci`.
    pub fn slot_bytes(&self, ci: ClassIdx) -> u64 {
        self.classes[ci].slot_bytes
    }

    /// Slots of class `ci` carved so far.
    pub fn class_len(&self, ci: ClassIdx) -> usize {
        self.classes[ci].slots.len()
    }

    /// A free slot of class `ci`, taken off its free list.
    pub fn take_free(&mut self, ci: ClassIdx) -> Option<SlotIdx> {
        self.classes[ci].free.pop()
    }

    /// The offset the next slot of class `ci` would be carved at (its memory is
    /// reserved there before [`carve`](Self::carve)); `None` when neither the bytes
    /// nor the table's entries allow one.
    pub fn next_carve(&self, ci: ClassIdx) -> Option<u64> {
        let slot_bytes = self.classes[ci].slot_bytes;
        let room = self.cap - self.carved >= slot_bytes && self.slots.len() < self.max_slots;
        room.then_some(self.carved)
    }

    /// A new slot of class `ci` carved from the uncarved bytes, with its offset;
    /// `None` when neither the bytes nor the table's entries allow one.
    pub fn carve(&mut self, ci: ClassIdx) -> Option<(SlotIdx, u64)> {
        let slot_bytes = self.classes[ci].slot_bytes;
        self.next_carve(ci)?;
        let (slot, offset) = (self.slots.len(), self.carved);
        self.slots.push(Slot {
            offset,
            class: ci,
            generation: 0,
            used: SlotUse::Free,
        });
        self.carved += slot_bytes;
        self.classes[ci].slots.push(slot);
        Some((slot, offset))
    }

    /// Starts a fill of `len` bytes in a slot just taken (free, carved or evicted):
    /// a new generation; returns where it lies.
    pub fn begin_fill(&mut self, slot: SlotIdx, len: u64) -> Placed {
        let s = &mut self.slots[slot];
        s.used = SlotUse::Filling { len };
        s.generation = s.generation.wrapping_add(1).max(1);
        Placed {
            offset: s.offset,
            len,
            generation: s.generation,
        }
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

    /// Takes a committed record out of its slot for the slot to be reused at once
    /// (eviction): the slot is Free but not on the free list. Returns the key.
    pub fn evict(&mut self, slot: SlotIdx) -> Option<String> {
        let s = self.slots.get_mut(slot)?;
        match std::mem::replace(&mut s.used, SlotUse::Free) {
            SlotUse::Ready { key, .. } => Some(key),
            other => {
                s.used = other;
                None
            }
        }
    }

    /// Empties a slot and puts it on its class's free list; returns its generation.
    pub fn free(&mut self, slot: SlotIdx) -> u32 {
        let s = &mut self.slots[slot];
        s.used = SlotUse::Free;
        self.classes[s.class].free.push(slot);
        s.generation
    }

    /// The class of `slot`.
    pub fn class_of(&self, slot: SlotIdx) -> ClassIdx {
        self.slots[slot].class
    }

    /// What `slot` holds.
    pub fn slot_use(&self, slot: SlotIdx) -> &SlotUse {
        &self.slots[slot].used
    }

    /// The classes, smallest slots first.
    pub fn classes(&self) -> Vec<ClassView<'_>> {
        let mut views: Vec<ClassView<'_>> = self
            .classes
            .iter()
            .map(|c| ClassView {
                slot_bytes: c.slot_bytes,
                slots: &c.slots,
            })
            .collect();
        views.sort_by_key(|v| v.slot_bytes);
        views
    }
}

impl SlotClass {
    fn new(slot_bytes: u64) -> SlotClass {
        SlotClass {
            slot_bytes,
            slots: Vec::new(),
            free: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::super::table::SLOT_ALIGN;
    use super::*;

    const MB: u64 = 1 << 20;

    #[test]
    fn fixed_classes_pick_the_smallest_fit_and_refuse_larger_records() {
        let mut arena = SlotArena::new(8 * MB, &[MB, 5000, MB], 100);
        let small = arena.class_for("a", 100).unwrap();
        assert_eq!(arena.slot_bytes(small), 2 * SLOT_ALIGN);
        let big = arena.class_for("b", 9000).unwrap();
        assert_eq!(arena.slot_bytes(big), MB);
        let err = arena.class_for("huge", MB + 1).unwrap_err();
        assert_eq!(
            err,
            RequestError::RecordTooLarge {
                key: "huge".into(),
                len: MB + 1,
                largest_slot: MB
            }
        );
        assert_eq!(arena.classes().len(), 2);
    }

    #[test]
    fn open_classes_are_added_per_size_while_bytes_remain() {
        let mut arena = SlotArena::new(3 * MB, &[], 100);
        let b = arena.class_for("b", 10).unwrap();
        assert_eq!(arena.slot_bytes(b), SLOT_ALIGN);
        let a = arena.class_for("a", MB + 1).unwrap();
        assert_eq!(arena.slot_bytes(a), MB + SLOT_ALIGN);
        assert_ne!(a, b);
        assert_eq!(arena.class_for("a2", MB).unwrap(), a, "the fit is reused");
        assert_eq!(arena.class_for("b2", 10).unwrap(), b, "the smallest fit");
        assert_eq!(
            arena.class_for("c", 5000).unwrap(),
            a,
            "a class that fits is used before a new one is made"
        );
        arena.carve(a).unwrap();
        arena.carve(a).unwrap();
        // 3 MiB - 2 * (1 MiB + 4 KiB) left: not enough for a 2 MiB class.
        let err = arena.class_for("c", 2 * MB).unwrap_err();
        assert!(
            matches!(err, RequestError::RecordTooLarge { largest_slot, .. }
            if largest_slot == 3 * MB - 2 * (MB + SLOT_ALIGN))
        );
        let sizes: Vec<u64> = arena.classes().iter().map(|c| c.slot_bytes).collect();
        assert_eq!(sizes, vec![SLOT_ALIGN, MB + SLOT_ALIGN], "sorted by size");
    }

    #[test]
    fn carving_stops_at_the_cap_and_at_the_table_entries() {
        let mut arena = SlotArena::new(3 * MB, &[MB], 100);
        let offsets: Vec<u64> = (0..3).map(|_| arena.carve(0).unwrap().1).collect();
        assert_eq!(offsets, vec![0, MB, 2 * MB]);
        assert_eq!(arena.next_carve(0), None);
        assert!(arena.carve(0).is_none(), "past the cap");
        assert_eq!((arena.carved_bytes(), arena.carved_slots()), (3 * MB, 3));
        let mut few = SlotArena::new(3 * MB, &[MB], 2);
        assert_eq!(few.next_carve(0), Some(0));
        assert!(few.carve(0).is_some() && few.carve(0).is_some());
        assert_eq!(few.next_carve(0), None);
        assert!(few.carve(0).is_none(), "past the table's entries");
    }

    #[test]
    fn a_slot_goes_free_filling_ready_and_back() {
        let mut arena = SlotArena::new(MB, &[SLOT_ALIGN], 100);
        let (slot, offset) = arena.carve(0).unwrap();
        assert!(arena.take_free(0).is_none());
        assert!(arena.publish(slot, "k".into()).is_none(), "not filling");
        let placed = arena.begin_fill(slot, 10);
        assert_eq!(
            (placed.offset, placed.len, placed.generation),
            (offset, 10, 1)
        );
        assert!(arena.ready(slot).is_none());
        assert_eq!(arena.publish(slot, "k".into()), Some(placed));
        assert_eq!(arena.ready(slot), Some(placed));
        assert_eq!(arena.evict(slot).as_deref(), Some("k"));
        assert_eq!(arena.slot_use(slot), &SlotUse::Free);
        assert!(
            arena.take_free(0).is_none(),
            "an evicted slot is reused at once"
        );
        assert_eq!(arena.begin_fill(slot, 20).generation, 2);
        assert!(arena.evict(slot).is_none(), "a filling slot is not evicted");
        assert_eq!(arena.free(slot), 2);
        assert_eq!(arena.take_free(0), Some(slot));
    }
}
