//! Where a new record goes: a placement, the range it takes, the records to evict for
//! it and the bytes to carve. Placements are made without changing anything; the
//! store carries one out only when every part of it can be done, so a request that
//! finds no room leaves the store as it was.
//!
//! First a free extent that holds the record (best fit), then the end of the carved
//! part (memory reserved on demand, up to the cap). When the store is full, the least
//! recently used unpinned record is the victim, and the range around it grows into
//! free neighbours, then the end of the carved part, then the older of its evictable
//! neighbours, until the record fits. Of the first few victims' placements the one
//! that evicts fewest records is carried out (the first that evicts its victim alone
//! ends the search).

use super::arena::{Arena, SlotIdx, Span};

/// Placements compared before one is chosen.
pub const CANDIDATES: usize = 8;

/// Where a record goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// The record's offset.
    pub start: u64,
    /// Committed records to evict first (the range holds them, free extents and
    /// the carved growth).
    pub evict: Vec<SlotIdx>,
    /// Bytes to carve at the end (memory to reserve) before the range is whole.
    pub grow: u64,
}

/// A free extent that holds `extent` bytes, or the end of the carved part.
pub fn without_eviction(arena: &Arena, extent: u64) -> Option<Placement> {
    if !arena.has_free_slot() {
        return None;
    }
    if let Some(start) = arena.best_fit(extent) {
        return Some(Placement {
            start,
            evict: Vec::new(),
            grow: 0,
        });
    }
    let tail = arena.tail(extent)?;
    Some(Placement {
        start: tail.start,
        evict: Vec::new(),
        grow: tail.grow,
    })
}

/// What may be evicted: a committed record that no one pins, with its last use
/// (smaller: older); `None` for anything else.
pub trait Evictable {
    /// The last use of `slot`'s record if it may be evicted.
    fn evictable(&self, slot: SlotIdx) -> Option<u64>;
}

/// The placements around the least recently used evictable records (`victims`, oldest
/// first), cheapest first: fewest records evicted, then the older victim. Growth
/// of the carved part is placed only with `may_grow`.
pub fn by_eviction(
    arena: &Arena,
    extent: u64,
    victims: impl Iterator<Item = SlotIdx>,
    evictable: &dyn Evictable,
    may_grow: bool,
) -> Vec<Placement> {
    let mut placements: Vec<Placement> = Vec::new();
    let candidates = victims
        .filter(|&v| evictable.evictable(v).is_some())
        .filter_map(|v| around(arena, v, extent, evictable, may_grow));
    for placement in candidates {
        // The oldest victim that goes alone: no placement can be cheaper.
        let alone = placement.evict.len() == 1;
        placements.push(placement);
        if alone || placements.len() == CANDIDATES {
            break;
        }
    }
    // A stable sort keeps the older victim first among equals.
    placements.sort_by_key(|placement| placement.evict.len());
    placements
}

/// What the range can grow into on one side.
#[derive(Debug, Clone, Copy)]
enum Step {
    Free {
        len: u64,
    },
    Grow {
        len: u64,
    },
    Evict {
        slot: SlotIdx,
        len: u64,
        last_use: u64,
    },
}

/// The range around `victim` grown until `extent` bytes fit; `None` if pinned
/// records, fills or the cap box it in first.
fn around(
    arena: &Arena,
    victim: SlotIdx,
    extent: u64,
    evictable: &dyn Evictable,
    may_grow: bool,
) -> Option<Placement> {
    let (offset, len) = arena.extent_of(victim)?;
    let (mut start, mut end, mut grow) = (offset, offset + len, 0);
    let mut evict = vec![victim];
    while end - start + grow < extent {
        let need = extent - (end - start + grow);
        let left = arena
            .span_before(start)
            .map(|(at, span)| (step(span, evictable), at));
        let right = match (end == arena.carved(), grow) {
            (false, _) => arena.span_at(end).map(|span| step(span, evictable)),
            (true, 0) if may_grow && arena.cap() > end => Some(Some(Step::Grow {
                len: need.min(arena.cap() - end),
            })),
            (true, _) => None,
        };
        let left_step = left.and_then(|(s, at)| s.map(|s| (s, at)));
        let right_step = right.flatten();
        match pick(left_step.map(|(s, _)| s), right_step) {
            Some(Side::Left) => {
                let (s, at) = left_step?;
                if let Step::Evict { slot, .. } = s {
                    evict.push(slot);
                }
                start = at;
            }
            Some(Side::Right) => match right_step? {
                Step::Grow { len } => grow = len,
                Step::Free { len } => end += len,
                Step::Evict { slot, len, .. } => {
                    evict.push(slot);
                    end += len;
                }
            },
            None => return None,
        }
    }
    Some(Placement { start, evict, grow })
}

fn step(span: Span, evictable: &dyn Evictable) -> Option<Step> {
    match span {
        Span::Free { len } => Some(Step::Free { len }),
        Span::Record { slot, len } => evictable.evictable(slot).map(|last_use| Step::Evict {
            slot,
            len,
            last_use,
        }),
    }
}

enum Side {
    Left,
    Right,
}

/// Free bytes first, then growth of the carved part, then the older record.
fn pick(left: Option<Step>, right: Option<Step>) -> Option<Side> {
    let rank = |s: &Step| match *s {
        Step::Free { .. } => (0, 0),
        Step::Grow { .. } => (1, 0),
        Step::Evict { last_use, .. } => (2, last_use),
    };
    match (left, right) {
        (None, None) => None,
        (Some(_), None) => Some(Side::Left),
        (None, Some(_)) => Some(Side::Right),
        (Some(l), Some(r)) if rank(&l) <= rank(&r) => Some(Side::Left),
        (Some(_), Some(_)) => Some(Side::Right),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::super::super::table::SLOT_ALIGN;
    use super::*;

    const P: u64 = SLOT_ALIGN;

    /// Records by slot with their last use; absent: pinned (not evictable).
    struct Uses(HashMap<SlotIdx, u64>);

    impl Evictable for Uses {
        fn evictable(&self, slot: SlotIdx) -> Option<u64> {
            self.0.get(&slot).copied()
        }
    }

    /// An arena of `cap` pages holding records of the given pages, back to back.
    fn packed(cap: u64, pages: &[u64]) -> (Arena, Vec<SlotIdx>) {
        let mut arena = Arena::new(cap * P, 100);
        let total: u64 = pages.iter().sum();
        arena.grow(total * P);
        let mut at = 0;
        let slots = pages
            .iter()
            .map(|&n| {
                let (slot, _) = arena.occupy(at, n * P, n * P).unwrap();
                arena.publish(slot, format!("k{slot}"));
                at += n * P;
                slot
            })
            .collect();
        (arena, slots)
    }

    #[test]
    fn without_eviction_takes_the_best_fit_then_the_tail() {
        let (mut arena, slots) = packed(20, &[3, 2, 4]);
        assert_eq!(
            without_eviction(&arena, 5 * P),
            Some(Placement {
                start: 9 * P,
                evict: vec![],
                grow: 5 * P
            })
        );
        arena.release(slots[1]);
        assert_eq!(
            without_eviction(&arena, 2 * P).map(|p| p.start),
            Some(3 * P)
        );
        assert_eq!(without_eviction(&arena, 12 * P), None, "past the cap");
    }

    /// The four records of the test below, least recently used first.
    fn victims_again(s: &[SlotIdx]) -> impl Iterator<Item = SlotIdx> {
        vec![s[1], s[2], s[0], s[3]].into_iter()
    }

    #[test]
    fn a_larger_record_evicts_the_victim_and_its_older_neighbour() {
        // Records of 2, 2, 2, 2 pages filling an 8-page cap; the victim is slot 1.
        let (arena, s) = packed(8, &[2, 2, 2, 2]);
        let uses = Uses(HashMap::from([(s[0], 5), (s[1], 1), (s[2], 3), (s[3], 9)]));
        let placements = by_eviction(&arena, 3 * P, victims_again(&s), &uses, true);
        // Around s[1]: its neighbours s[0] (used 5) and s[2] (used 3): s[2] goes.
        assert_eq!(
            placements[0],
            Placement {
                start: 2 * P,
                evict: vec![s[1], s[2]],
                grow: 0
            }
        );
        assert!(placements.iter().all(|p| p.evict.len() == 2));
        assert_eq!(placements.len(), 4, "every victim's placement is weighed");
        // A record that fits the oldest victim's extent evicts it alone, and no
        // other placement is looked for.
        let placements = by_eviction(&arena, 2 * P, victims_again(&s), &uses, true);
        assert_eq!(
            placements,
            vec![Placement {
                start: 2 * P,
                evict: vec![s[1]],
                grow: 0
            }]
        );
    }

    #[test]
    fn free_neighbours_and_growth_come_before_evicting_more() {
        let (mut arena, s) = packed(10, &[2, 2, 2]);
        arena.release(s[0]);
        let uses = Uses(HashMap::from([(s[1], 1), (s[2], 2)]));
        let placements = by_eviction(&arena, 4 * P, [s[1]].into_iter(), &uses, true);
        assert_eq!(
            placements,
            vec![Placement {
                start: 0,
                evict: vec![s[1]],
                grow: 0
            }]
        );
        // s[2] at the end: the carved part grows after it instead of evicting s[1].
        let placements = by_eviction(&arena, 4 * P, [s[2]].into_iter(), &uses, true);
        assert_eq!(
            placements,
            vec![Placement {
                start: 4 * P,
                evict: vec![s[2]],
                grow: 2 * P
            }]
        );
        let placements = by_eviction(&arena, 4 * P, [s[2]].into_iter(), &uses, false);
        assert_eq!(
            placements[0].evict,
            vec![s[2], s[1]],
            "no growth: the neighbour goes"
        );
    }

    #[test]
    fn pinned_records_box_a_victim_in() {
        let (arena, s) = packed(6, &[2, 2, 2]);
        // s[0] and s[2] pinned: around s[1] nothing can grow.
        let uses = Uses(HashMap::from([(s[1], 1)]));
        assert!(by_eviction(&arena, 3 * P, [s[1], s[0]].into_iter(), &uses, true).is_empty());
        // The cheapest of several placements first: s[2] alone fits at the end with
        // growth.
        let (arena, s) = packed(7, &[2, 2, 2]);
        let uses = Uses(HashMap::from([(s[0], 1), (s[1], 2), (s[2], 3)]));
        let placements = by_eviction(&arena, 3 * P, s.clone().into_iter(), &uses, true);
        assert_eq!(
            placements[0],
            Placement {
                start: 4 * P,
                evict: vec![s[2]],
                grow: P
            }
        );
        assert_eq!(placements.len(), 3);
    }
}
