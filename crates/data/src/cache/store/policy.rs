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
use super::eviction::Bound;
use super::pace::Micros;
use super::read_order::{Announcer, Standing};
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
    /// Brought in ahead of its use (a prefetch), expected at `at`: only records
    /// needed later than that, or not at all, may go.
    Ahead {
        /// When its use is expected, on the store's clock.
        at: Micros,
    },
}

impl Incoming {
    /// What it may push out, as the eviction index bounds it.
    pub(super) fn bound(self) -> Bound {
        match self {
            Incoming::Demand => Bound::All,
            Incoming::Unannounced => Bound::Unneeded,
            Incoming::Ahead { at } => Bound::NeededAfter(at),
        }
    }

    /// Whether this record gets room only at the expense of records the policy
    /// ranks below it (a refusal is then the policy's decline, not a full store).
    pub(super) fn is_restricted(self) -> bool {
        self != Incoming::Demand
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
    /// made before are counted against the old read order first. Its readers must
    /// be connections of the announcing client's job and user (a connection that
    /// has ended is left out).
    pub fn announce_read_order(
        &mut self,
        client: ClientId,
        mut order: ReadOrderAnnouncement,
    ) -> Result<(), RequestError> {
        let announcer = self.connections.get(client)?.clone();
        self.check_readers(&announcer.who, &mut order)?;
        self.learn_reads();
        let progress = self.pins.page(announcer.page).progress();
        let now = self.clock.now();
        let owner = Announcer {
            client,
            page: announcer.page,
            job: announcer.who.job.clone(),
        };
        let index = &self.index;
        let cached = |key: &str| index.get(key);
        self.read_orders
            .announce(owner, order, progress, now, &cached, &mut self.eviction)
    }

    /// Refuses readers of another job or user; drops those no longer connected.
    fn check_readers(
        &self,
        who: &super::ClientLabel,
        order: &mut ReadOrderAnnouncement,
    ) -> Result<(), RequestError> {
        let mut readers = Vec::with_capacity(order.readers.len());
        for &reader in &order.readers {
            let Ok(connection) = self.connections.get(reader) else {
                continue;
            };
            let other = &connection.who;
            if other.job != who.job || other.uid != who.uid {
                return Err(RequestError::BadReadOrder {
                    problem: format!(
                        "reader connection {reader} ({:?}) is of job {:?} and uid {}, not of the announcing connection's job {:?} and uid {}",
                        other.name, other.job, other.uid, who.job, who.uid
                    ),
                });
            }
            readers.push(reader);
        }
        order.readers = readers;
        Ok(())
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
        let Standing::Needed { at } = self.read_orders.standing(key) else {
            self.read_orders.count_prefetch(false);
            return Ok(PrefetchOutcome::Declined);
        };
        let ticket = self.next_id;
        self.fills.start(ticket, key, client)?;
        self.next_id += 1;
        match self.place_fill(ticket, key, len, extent, Incoming::Ahead { at }) {
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

    /// Reads every read order's reader progress from its pin page (uses it passed
    /// are past; each job's pace is measured).
    pub(super) fn refresh_read_orders(&mut self) {
        if self.read_orders.is_empty() {
            return;
        }
        let pins = &self.pins;
        let now = self.clock.now();
        self.read_orders
            .refresh(|page| pins.page(page).progress(), now, &mut self.eviction);
    }

    /// Connection `client` read `slot`'s record: a use of the read order it reads for
    /// is used up.
    pub(super) fn use_up_read(&mut self, client: ClientId, slot: SlotIdx) {
        if self.read_orders.is_empty() {
            return;
        }
        if let SlotUse::Ready { key, .. } = self.arena.slot_use(slot) {
            self.read_orders.read(client, key, &mut self.eviction);
        }
    }
}

#[cfg(test)]
#[path = "policy_tests.rs"]
mod tests;
