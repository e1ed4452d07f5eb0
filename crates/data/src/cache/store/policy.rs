//! The store's side of the planned policy: read orders announced by connections, the
//! prefetch of a record ahead of its use, and the order in which records may go when
//! room is made for another one. With no read order live the order is the LRU's,
//! unchanged. With read orders: records no read order needs first (least recently
//! used first), then the record whose next use is farthest; a record coming in ahead
//! of its use (a prefetch) may only evict records needed later than itself, and a
//! record no read order names (validation, inference, tools) only records no read
//! order needs. None of this is on the hit path: clients find hits in the shared
//! table without a message, and the read orders are looked at only when a record
//! needs room.

use super::super::ids::{ClientId, TicketId};
use super::super::protocol::{ReadOrderAnnouncement, RequestError};
use super::arena::{SlotIdx, SlotUse};
use super::read_order::Standing;
use super::{check_key, Store};

/// What a record coming in may push out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Incoming {
    /// Read now and named by a read order (or no read order is live): any unpinned
    /// record may go, the one needed last first.
    Demand,
    /// Read now but named by no live read order: only records no read order needs may
    /// go.
    Unannounced,
    /// Brought in `distance` steps ahead of its use (a prefetch): only records
    /// needed later than that, or not at all, may go.
    Ahead {
        /// Steps between its reader's progress and the use.
        distance: u64,
    },
}

impl Incoming {
    /// Whether a record of eviction rank `rank` may go for this one.
    fn may_evict(self, rank: u64) -> bool {
        match self {
            Incoming::Demand => true,
            Incoming::Unannounced => Standing::rank_is_unneeded(rank),
            Incoming::Ahead { distance } => rank < Standing::later_than(distance),
        }
    }

    /// Whether this record gets room only at the expense of records the policy
    /// ranks below it (a refusal is then the policy's decline, not a full store).
    pub(super) fn is_restricted(self) -> bool {
        self != Incoming::Demand
    }
}

/// The records that may go for one incoming record, in the order they should.
#[derive(Debug)]
pub(super) struct EvictionOrder {
    /// Eviction rank by slot (`None`: may not go).
    ranks: Vec<Option<u64>>,
    /// The slots that may go, the first to go first.
    victims: Vec<SlotIdx>,
}

impl EvictionOrder {
    /// `slot`'s rank if it may go (smaller goes first).
    pub(super) fn rank(&self, slot: SlotIdx) -> Option<u64> {
        self.ranks.get(slot).copied().flatten()
    }

    /// The slots that may go, the first to go first.
    pub(super) fn victims(&self) -> impl Iterator<Item = SlotIdx> + '_ {
        self.victims.iter().copied()
    }
}

/// The outcome of a prefetch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefetchOutcome {
    /// Cached already, or being filled.
    Present,
    /// Not worth it now: no read order needs the record, or room for it would evict a
    /// record needed sooner.
    Declined,
    /// Room reserved: write `len` bytes at `offset`, then commit `ticket`.
    Reserved {
        /// The fill's ticket.
        ticket: TicketId,
        /// Byte offset of the room in the store.
        offset: u64,
        /// The record's length.
        len: u64,
    },
}

impl Store {
    /// Replaces `client`'s read order (see [`ReadOrderAnnouncement`]). Reads clients
    /// made before are counted against the old read order first.
    pub fn announce_read_order(
        &mut self,
        client: ClientId,
        order: ReadOrderAnnouncement,
    ) -> Result<(), RequestError> {
        let page = self.connections.get(client)?.page;
        self.learn_reads();
        self.read_orders.announce(client, page, order)
    }

    /// Brings `key`'s record of `len` bytes in ahead of its announced use if room
    /// can be had without evicting a record needed sooner.
    pub fn prefetch(
        &mut self,
        client: ClientId,
        key: &str,
        len: u64,
    ) -> Result<PrefetchOutcome, RequestError> {
        self.connections.get(client)?;
        check_key(key)?;
        if self.index.get(key).is_some() || self.fills.is_filling(key) {
            return Ok(PrefetchOutcome::Present);
        }
        let extent = self.extent_of(key, len)?;
        self.learn_reads();
        self.refresh_read_orders();
        let Standing::Needed { distance } = self.read_orders.standing(key) else {
            self.read_orders.count_prefetch(false);
            return Ok(PrefetchOutcome::Declined);
        };
        let ticket = self.next_id;
        self.fills.start(ticket, key, client)?;
        self.next_id += 1;
        match self.place_fill(ticket, key, len, extent, Incoming::Ahead { distance }) {
            Ok(offset) => {
                self.read_orders.count_prefetch(true);
                Ok(PrefetchOutcome::Reserved {
                    ticket,
                    offset,
                    len,
                })
            }
            Err(error) => {
                self.fills.finish(ticket);
                match error {
                    RequestError::Declined { .. } => {
                        self.read_orders.count_prefetch(false);
                        Ok(PrefetchOutcome::Declined)
                    }
                    error => Err(error),
                }
            }
        }
    }

    /// What a record read now may push out: anything if a read order names it (or no
    /// read order is live), else only records no read order needs.
    pub(super) fn demand(&mut self, key: &str) -> Incoming {
        if self.read_orders.is_empty() {
            return Incoming::Demand;
        }
        self.refresh_read_orders();
        match self.read_orders.standing(key) {
            Standing::Needed { .. } => Incoming::Demand,
            Standing::Unneeded => Incoming::Unannounced,
        }
    }

    /// Reads every read order's reader progress from its pin page.
    fn refresh_read_orders(&mut self) {
        let pins = &self.pins;
        self.read_orders.refresh(|page| pins.page(page).progress());
    }

    /// The order in which committed records may go for `incoming`, or `None` when
    /// no read order is live (the LRU's order then).
    pub(super) fn eviction_order(&mut self, incoming: Incoming) -> Option<EvictionOrder> {
        if self.read_orders.is_empty() {
            return None;
        }
        self.refresh_read_orders();
        let mut ranks = vec![None; self.arena.slot_count()];
        let mut ranked = Vec::new();
        for (slot, used, _) in self.arena.in_use() {
            let SlotUse::Ready { key, .. } = used else {
                continue;
            };
            let Some(stamp) = self.recency.stamp(slot) else {
                continue;
            };
            let rank = self.read_orders.standing(key).rank(stamp);
            if incoming.may_evict(rank) {
                ranks[slot] = Some(rank);
                ranked.push((rank, slot));
            }
        }
        ranked.sort_unstable();
        Some(EvictionOrder {
            ranks,
            victims: ranked.into_iter().map(|(_, slot)| slot).collect(),
        })
    }

    /// Connection `client` read `slot`'s record: a use of the read order it reads for
    /// is used up.
    pub(super) fn use_up_read(&mut self, client: ClientId, slot: SlotIdx) {
        if self.read_orders.is_empty() {
            return;
        }
        if let SlotUse::Ready { key, .. } = self.arena.slot_use(slot) {
            self.read_orders.read(client, key);
        }
    }
}

#[cfg(test)]
#[path = "policy_tests.rs"]
mod tests;
