//! The store's bookkeeping, a small facade over one part per job: the slot
//! [`arena`] (classes, carving, free lists), the [`lru`] with its second chance,
//! the record [`index`], the [`connections`] with their pin bits, single-flight
//! [`fills`], the [`stats`] counters and the [`reserve`]d memory under the
//! carved slots. The server wraps it in a mutex and every
//! record is mirrored into the shared [`Table`], where clients pin hits themselves;
//! pins are read back from there.
//!
//! Every operation first checks everything that can refuse it, then makes its
//! changes, none of which can fail: a refused request leaves the store as it was.

pub mod arena;
pub mod connections;
pub mod fills;
pub mod index;
pub mod lru;
mod report;
pub mod reserve;
pub mod stats;

use super::ids::{ClientId, LeaseId, TicketId};
use super::protocol::{LeaseGrant, RequestError};
use super::table::{self, SlotCode, Table, MAX_KEY_BYTES};
use arena::{ClassIdx, SlotArena, SlotIdx};
use connections::Connections;
use fills::{Fill, Fills};
use index::RecordIndex;
use lru::Lru;
use reserve::{NoReserve, Reservations, ReserveRefusal};
use stats::{Event, StoreStats};

pub use super::table::{slot_size_for, SLOT_ALIGN};

/// Outcome of a `get`.
#[derive(Debug, PartialEq, Eq)]
pub enum GetOutcome {
    /// Cached: pinned under a new lease.
    Hit(LeaseGrant),
    /// Not cached: the caller fills it with this ticket.
    Miss(TicketId),
    /// Another client is filling it: wait and ask again.
    Wait {
        /// The client filling it.
        filler: ClientId,
    },
}

/// The cache's bookkeeping.
pub struct Store {
    store_id: u64,
    table: Table,
    arena: SlotArena,
    lru: Lru,
    index: RecordIndex,
    connections: Connections,
    fills: Fills,
    stats: StoreStats,
    /// The memory under the carved slots.
    reservations: Reservations,
    /// The next connection or ticket id.
    next_id: u64,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("store_id", &self.store_id)
            .field("cap", &self.arena.cap())
            .field("records", &self.index.len())
            .finish()
    }
}

impl Store {
    /// A store of `cap` bytes whose records are mirrored in `table`. With `slot_bytes`
    /// given, records must fit those classes; without, a class is made for each new
    /// record size on its first fill. Each slot's bytes are reserved through
    /// `reservations` when the slot is carved, before it is handed out.
    pub fn new(
        store_id: u64,
        cap: u64,
        slot_bytes: &[u64],
        table: Table,
        reservations: Reservations,
    ) -> Store {
        Store {
            store_id,
            arena: SlotArena::new(cap, slot_bytes, table.slots()),
            table,
            lru: Lru::new(),
            index: RecordIndex::new(),
            connections: Connections::new(),
            fills: Fills::new(),
            stats: StoreStats::new(),
            reservations,
            next_id: 1,
        }
    }

    /// A store over a table on the heap (tests and single-process tools).
    pub fn on_heap(store_id: u64, cap: u64, slot_bytes: &[u64]) -> Store {
        Store::on_heap_reserving(store_id, cap, slot_bytes, Box::new(NoReserve))
    }

    /// A store over a table on the heap whose slots are reserved through `reserver`.
    pub fn on_heap_reserving(
        store_id: u64,
        cap: u64,
        slot_bytes: &[u64],
        reserver: Box<dyn reserve::PageReserver>,
    ) -> Store {
        let layout = table::Layout::for_store(cap, slot_bytes);
        let table = Table::on_heap(cap, layout.slots);
        let reservations = Reservations::new(reserver, 0);
        Store::new(store_id, cap, slot_bytes, table, reservations)
    }

    /// The byte cap.
    pub fn cap(&self) -> u64 {
        self.arena.cap()
    }

    /// The shared table.
    pub fn table(&self) -> &Table {
        &self.table
    }

    /// Registers a connection; returns its id and its pin bit, or an error when all
    /// [`MAX_CONNECTIONS`](table::MAX_CONNECTIONS) bits are taken.
    pub fn connect(&mut self, name: String, pid: u32) -> Result<(ClientId, usize), RequestError> {
        let id = self.next_id;
        let bit = self.connections.connect(id, name, pid, &self.table)?;
        self.next_id += 1;
        self.stats.connected(id);
        Ok((id, bit))
    }

    /// Drops a connection: its pins are cleared, its shared counters folded into the
    /// totals and its fills abandoned. Returns the number of fills abandoned (waiters
    /// must be woken).
    pub fn disconnect(&mut self, client: ClientId) -> usize {
        let carved = self.arena.carved_slots();
        let Some(gone) = self.connections.disconnect(client, &self.table, carved) else {
            return 0;
        };
        self.stats.disconnected(client, gone.shared_hits);
        let abandoned = self.fills.abandon_all(client);
        for fill in &abandoned {
            self.given_up(fill);
        }
        abandoned.len()
    }

    /// Counts a request served over the control channel.
    pub fn count_request(&mut self, client: ClientId) {
        self.stats.count(client, Event::Request);
    }

    /// Counts a refused request against the client.
    pub fn count_error(&mut self, client: ClientId) {
        self.stats.count(client, Event::Error);
    }

    /// Looks a key up: a lease, a fill ticket, or a wait for someone else's fill.
    pub fn get(&mut self, client: ClientId, key: &str) -> Result<GetOutcome, RequestError> {
        self.connections.get(client)?;
        check_key(key)?;
        if let Some(grant) = self.hit(client, key)? {
            return Ok(GetOutcome::Hit(grant));
        }
        if let Some((ticket, fill)) = self.fills.of_key(key) {
            if fill.client == client {
                return Err(RequestError::AlreadyFilling {
                    key: key.to_string(),
                    ticket,
                });
            }
            let filler = fill.client;
            self.stats.count(client, Event::Wait);
            return Ok(GetOutcome::Wait { filler });
        }
        let ticket = self.next_id;
        self.fills.start(ticket, key, client)?;
        self.next_id += 1;
        self.stats.count(client, Event::Miss);
        Ok(GetOutcome::Miss(ticket))
    }

    /// A lease if the key is cached; `None` otherwise.
    pub fn peek(
        &mut self,
        client: ClientId,
        key: &str,
    ) -> Result<Option<LeaseGrant>, RequestError> {
        self.connections.get(client)?;
        check_key(key)?;
        self.hit(client, key)
    }

    /// A lease on `key`'s record if it is cached.
    fn hit(&mut self, client: ClientId, key: &str) -> Result<Option<LeaseGrant>, RequestError> {
        let Some(slot) = self.index.get(key) else {
            return Ok(None);
        };
        let grant = self.lease(client, slot)?;
        self.stats.count(client, Event::Hit);
        Ok(Some(grant))
    }

    /// Pins `slot`'s committed record for `client`.
    fn lease(&mut self, client: ClientId, slot: SlotIdx) -> Result<LeaseGrant, RequestError> {
        let bit = self.connections.get(client)?.bit;
        let Some(placed) = self.arena.ready(slot) else {
            return Err(RequestError::Protocol(format!(
                "slot {slot} holds no committed record"
            )));
        };
        self.table.pin(slot, bit);
        self.table.touch(slot);
        Ok(LeaseGrant {
            lease: table::lease_id(slot, placed.generation),
            offset: placed.offset,
            len: placed.len,
        })
    }

    /// Reserves a slot of the right class for a ticket: a free slot, else a new one
    /// carved from the store, else the least recently used unpinned record's.
    pub fn reserve(
        &mut self,
        client: ClientId,
        ticket: TicketId,
        len: u64,
    ) -> Result<(u64, u64), RequestError> {
        let fill = self.fills.held(client, ticket)?;
        let key = fill.key.clone();
        if fill.slot.is_some() {
            return Err(RequestError::TicketState {
                ticket,
                key,
                problem: "a slot is reserved already".into(),
            });
        }
        if len == 0 {
            return Err(RequestError::EmptyRecord { key });
        }
        let class = self.arena.class_for(&key, len)?;
        let slot = self.take_slot(class, &key, len)?;
        let placed = self.arena.begin_fill(slot, len);
        let state = table::SlotState {
            generation: placed.generation,
            code: SlotCode::Filling,
        };
        self.table.set_state(slot, state);
        self.fills.set_slot(ticket, slot);
        Ok((placed.offset, len))
    }

    /// A slot of class `ci`: a free one, a newly carved one (its memory reserved
    /// first), or an evicted one. When the memory for a new slot cannot be had and
    /// nothing can be evicted, the refusal is the error.
    fn take_slot(&mut self, ci: ClassIdx, key: &str, len: u64) -> Result<SlotIdx, RequestError> {
        if let Some(slot) = self.arena.take_free(ci) {
            return Ok(slot);
        }
        let mut refused = None;
        if let Some(offset) = self.arena.next_carve(ci) {
            match self.reservations.reserve(offset, self.arena.slot_bytes(ci)) {
                Ok(()) => {
                    if let Some((slot, offset)) = self.arena.carve(ci) {
                        self.table.set_offset(slot, offset);
                        return Ok(slot);
                    }
                }
                Err(refusal) => refused = Some(refusal),
            }
        }
        if let Some(slot) = self.lru.victim(ci, &self.table) {
            if let Some(evicted) = self.arena.evict(slot) {
                self.index.remove(&evicted, &self.table);
            }
            self.stats.evicted();
            return Ok(slot);
        }
        if let Some(refusal) = refused {
            return Err(self.out_of_memory(key, len, refusal));
        }
        Err(RequestError::StoreFull {
            key: key.to_string(),
            len,
            slots: self.arena.class_len(ci),
            slot_bytes: self.arena.slot_bytes(ci),
        })
    }

    /// The error for a fill whose slot's memory could not be reserved.
    fn out_of_memory(&self, key: &str, len: u64, refusal: ReserveRefusal) -> RequestError {
        tracing::warn!(
            key,
            needed = refusal.needed,
            available = refusal.available,
            limit = %refusal.limit,
            reserved = self.reservations.reserved_bytes(),
            "cannot reserve memory for a new cache slot"
        );
        RequestError::OutOfMemory {
            key: key.to_string(),
            len,
            needed: refusal.needed,
            available: refusal.available,
            limit: refusal.limit,
            reserved: self.reservations.reserved_bytes(),
        }
    }

    /// Publishes a filled slot and leases it to the filler.
    pub fn commit(
        &mut self,
        client: ClientId,
        ticket: TicketId,
    ) -> Result<LeaseGrant, RequestError> {
        let fill = self.fills.held(client, ticket)?;
        let (key, started) = (fill.key.clone(), fill.started);
        let not_filling = |problem: &str| RequestError::TicketState {
            ticket,
            key: key.clone(),
            problem: problem.into(),
        };
        let slot = fill
            .slot
            .ok_or_else(|| not_filling("commit before reserve"))?;
        self.connections.get(client)?;
        let placed = self
            .arena
            .publish(slot, key.clone())
            .ok_or_else(|| not_filling("its slot is not being filled"))?;
        // Nothing below can fail. Key and length first, then Ready, then the index:
        // a client that finds the slot through the index sees a whole record.
        self.fills.finish(ticket);
        let entered = self.table.tick();
        self.table.write_record(slot, &key, placed.len);
        let state = table::SlotState {
            generation: placed.generation,
            code: SlotCode::Ready,
        };
        self.table.set_state(slot, state);
        self.index.insert(key, slot, &self.table);
        self.lru.enter(self.arena.class_of(slot), slot, entered);
        self.stats
            .fill_committed(client, placed.len, started.elapsed());
        self.lease(client, slot)
    }

    /// Abandons a fill; its slot (if any) goes back to the free list.
    pub fn abort(&mut self, client: ClientId, ticket: TicketId) -> Result<(), RequestError> {
        self.fills.held(client, ticket)?;
        if let Some(fill) = self.fills.finish(ticket) {
            self.given_up(&fill);
        }
        Ok(())
    }

    /// Frees the slot of a fill that ended without a commit, and counts it.
    fn given_up(&mut self, fill: &Fill) {
        if let Some(slot) = fill.slot {
            self.free_slot(slot);
        }
        self.stats.count(fill.client, Event::FillAbandoned);
    }

    /// Empties `slot` here and in the table, onto its class's free list.
    fn free_slot(&mut self, slot: SlotIdx) {
        let generation = self.arena.free(slot);
        let state = table::SlotState {
            generation,
            code: SlotCode::Free,
        };
        self.table.set_state(slot, state);
    }

    /// Releases a lease held by the client (clients release by clearing their pin bit
    /// themselves; this is the protocol's explicit form, for tools and tests).
    pub fn release(&mut self, client: ClientId, lease: LeaseId) -> Result<(), RequestError> {
        let bit = self.connections.get(client)?.bit;
        let (slot, generation) = table::decode_lease(lease);
        let held = self
            .arena
            .ready(slot)
            .is_some_and(|p| p.generation == generation);
        if held && self.table.unpin(slot, bit) {
            Ok(())
        } else {
            Err(RequestError::LeaseNotHeld { lease })
        }
    }

    /// Drops a cached record that no one holds.
    pub fn invalidate(&mut self, key: &str) -> Result<(), RequestError> {
        let Some(slot) = self.index.get(key) else {
            return Err(RequestError::UnknownKey {
                key: key.to_string(),
            });
        };
        if !self.table.try_evict(slot) {
            return Err(RequestError::Pinned {
                key: key.to_string(),
                pins: self.table.pin_count(slot),
            });
        }
        self.index.remove(key, &self.table);
        self.lru.remove(self.arena.class_of(slot), slot);
        self.free_slot(slot);
        Ok(())
    }

    /// Whether a fill of `key` is in flight.
    pub fn is_filling(&self, key: &str) -> bool {
        self.fills.is_filling(key)
    }
}

/// Refuses a key longer than a slot can store.
fn check_key(key: &str) -> Result<(), RequestError> {
    if key.len() > MAX_KEY_BYTES {
        return Err(RequestError::KeyTooLong {
            key: key.to_string(),
            max: MAX_KEY_BYTES,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::table::MAX_CONNECTIONS;

    const MB: u64 = 1 << 20;

    fn fill(store: &mut Store, client: ClientId, key: &str, len: u64) -> LeaseGrant {
        let GetOutcome::Miss(ticket) = store.get(client, key).unwrap() else {
            panic!("expected a miss for {key}");
        };
        store.reserve(client, ticket, len).unwrap();
        store.commit(client, ticket).unwrap()
    }

    #[test]
    fn miss_fill_then_hit() {
        let mut store = Store::on_heap(1, 4 * MB, &[]);
        let c = store.connect("a".into(), 1).unwrap().0;
        let grant = fill(&mut store, c, "k", 1000);
        assert_eq!(grant.len, 1000);
        store.release(c, grant.lease).unwrap();
        let GetOutcome::Hit(hit) = store.get(c, "k").unwrap() else {
            panic!("expected a hit");
        };
        assert_eq!(hit.offset, grant.offset);
        let s = store.stats(0);
        assert_eq!((s.totals.hits, s.totals.misses, s.totals.fills), (1, 1, 1));
        assert_eq!(s.classes[0].slot_bytes, SLOT_ALIGN);
    }

    #[test]
    fn eviction_takes_lru_and_never_a_pinned_slot() {
        // Room for exactly 3 slots of 1 MiB.
        let mut store = Store::on_heap(1, 3 * MB, &[MB]);
        let c = store.connect("a".into(), 1).unwrap().0;
        let pinned = fill(&mut store, c, "pinned", MB);
        let old = fill(&mut store, c, "old", MB);
        store.release(c, old.lease).unwrap();
        let newer = fill(&mut store, c, "newer", MB);
        store.release(c, newer.lease).unwrap();
        // A fourth record evicts the least recently released unpinned one: "old".
        let fourth = fill(&mut store, c, "fourth", MB);
        assert_eq!(fourth.offset, old.offset);
        assert!(store.peek(c, "old").unwrap().is_none());
        assert!(store.peek(c, "pinned").unwrap().is_some());
        // Now everything is pinned: no slot can be taken.
        let n = store.peek(c, "newer").unwrap().unwrap();
        let GetOutcome::Miss(t) = store.get(c, "fifth").unwrap() else {
            panic!("expected a miss");
        };
        let err = store.reserve(c, t, MB).unwrap_err();
        assert!(matches!(err, RequestError::StoreFull { .. }), "{err}");
        assert!(err.to_string().contains("fifth"));
        let s = store.stats(0);
        assert_eq!(s.evictions, 1);
        assert!(s.bytes_used <= s.cap_bytes);
        assert_eq!(s.pinned_bytes, 3 * MB);
        let _ = (pinned, n);
    }

    #[test]
    fn memory_is_reserved_per_carved_slot_and_a_refusal_evicts_or_fails_cleanly() {
        // A cap of 4 slots, but memory for 2 only.
        let budget = Box::new(reserve::BudgetReserver { budget: 2 * MB });
        let mut store = Store::on_heap_reserving(1, 4 * MB, &[MB], budget);
        let c = store.connect("a".into(), 1).unwrap().0;
        assert_eq!(store.stats(0).reserved_bytes, 0, "nothing before a fill");
        let first = fill(&mut store, c, "first", 10);
        store.release(c, first.lease).unwrap();
        let pinned = fill(&mut store, c, "pinned", 10);
        let s = store.stats(0);
        assert_eq!((s.reserved_bytes, s.reserve_refusals), (2 * MB, 0));
        // No memory for a third slot: the unpinned record's slot is reused.
        let third = fill(&mut store, c, "third", 10);
        assert_eq!(third.offset, first.offset);
        let s = store.stats(0);
        assert_eq!(
            (s.reserved_bytes, s.reserve_refusals, s.evictions),
            (2 * MB, 1, 1)
        );
        // Both slots pinned, no memory for another: a named error, nothing changed.
        let GetOutcome::Miss(t) = store.get(c, "fourth").unwrap() else {
            panic!("expected a miss");
        };
        let err = store.reserve(c, t, 10).unwrap_err();
        let RequestError::OutOfMemory {
            ref key,
            needed,
            available,
            reserved,
            ..
        } = err
        else {
            panic!("expected OutOfMemory, got {err:?}");
        };
        assert_eq!(
            (key.as_str(), needed, available, reserved),
            ("fourth", MB, 0, 2 * MB)
        );
        assert!(err.to_string().contains("DATA.CACHE_SIZE_GB"), "{err}");
        let s = store.stats(0);
        assert_eq!(
            (s.bytes_carved, s.reserve_refusals, s.records),
            (2 * MB, 2, 2)
        );
        // The ticket is still held: once a record is released, the fill goes on.
        store.release(c, third.lease).unwrap();
        assert_eq!(store.reserve(c, t, 10).unwrap().0, third.offset);
        let _ = pinned;
    }

    #[test]
    fn concurrent_miss_waits_then_hits() {
        let mut store = Store::on_heap(1, 4 * MB, &[]);
        let a = store.connect("a".into(), 1).unwrap().0;
        let b = store.connect("b".into(), 2).unwrap().0;
        let GetOutcome::Miss(t) = store.get(a, "k").unwrap() else {
            panic!()
        };
        assert_eq!(store.get(b, "k").unwrap(), GetOutcome::Wait { filler: a });
        assert!(matches!(
            store.get(a, "k"),
            Err(RequestError::AlreadyFilling { .. })
        ));
        store.reserve(a, t, 10).unwrap();
        store.commit(a, t).unwrap();
        assert!(matches!(store.get(b, "k").unwrap(), GetOutcome::Hit(_)));
    }

    #[test]
    fn disconnect_releases_leases_and_abandons_fills() {
        let mut store = Store::on_heap(1, 2 * MB, &[MB]);
        let a = store.connect("a".into(), 1).unwrap().0;
        let b = store.connect("b".into(), 2).unwrap().0;
        fill(&mut store, a, "held", MB);
        let GetOutcome::Miss(t) = store.get(a, "half").unwrap() else {
            panic!()
        };
        store.reserve(a, t, MB).unwrap();
        assert_eq!(store.disconnect(a), 1);
        let s = store.stats(0);
        assert_eq!(s.pinned_bytes, 0);
        assert_eq!(s.fills_in_flight, 0);
        assert_eq!(s.totals.fills_abandoned, 1);
        // The abandoned key is a fresh miss for b, and both slots are usable.
        assert!(matches!(store.get(b, "half").unwrap(), GetOutcome::Miss(_)));
        fill(&mut store, b, "x", MB);
    }

    #[test]
    fn bad_requests_are_errors() {
        let mut store = Store::on_heap(1, 2 * MB, &[MB]);
        let a = store.connect("a".into(), 1).unwrap().0;
        let b = store.connect("b".into(), 2).unwrap().0;
        let grant = fill(&mut store, a, "k", 100);
        store.release(a, grant.lease).unwrap();
        assert_eq!(
            store.release(a, grant.lease),
            Err(RequestError::LeaseNotHeld { lease: grant.lease })
        );
        let g2 = store.peek(a, "k").unwrap().unwrap();
        assert!(store.release(b, g2.lease).is_err(), "b released a's lease");
        assert!(matches!(
            store.commit(a, 999),
            Err(RequestError::TicketNotHeld { ticket: 999 })
        ));
        let GetOutcome::Miss(t) = store.get(a, "big").unwrap() else {
            panic!()
        };
        assert!(matches!(
            store.commit(a, t),
            Err(RequestError::TicketState { .. })
        ));
        assert!(matches!(
            store.reserve(a, t, 2 * MB),
            Err(RequestError::RecordTooLarge { .. })
        ));
        assert!(matches!(
            store.reserve(a, t, 0),
            Err(RequestError::EmptyRecord { .. })
        ));
        assert!(matches!(
            store.invalidate("nope"),
            Err(RequestError::UnknownKey { .. })
        ));
        assert!(matches!(
            store.invalidate("k"),
            Err(RequestError::Pinned { pins: 1, .. })
        ));
    }

    #[test]
    fn classes_per_record_size() {
        let mut store = Store::on_heap(1, 8 * MB, &[]);
        let c = store.connect("a".into(), 1).unwrap().0;
        fill(&mut store, c, "small", 5000);
        fill(&mut store, c, "big", MB + 1);
        fill(&mut store, c, "small2", 4000);
        let s = store.stats(0);
        let sizes: Vec<u64> = s.classes.iter().map(|c| c.slot_bytes).collect();
        assert_eq!(sizes, vec![8192, MB + SLOT_ALIGN]);
        assert_eq!(s.bytes_carved, 2 * 8192 + MB + SLOT_ALIGN);
    }

    #[test]
    fn connections_beyond_the_pin_bits_are_refused_until_one_leaves() {
        let mut store = Store::on_heap(1, MB, &[]);
        let ids: Vec<ClientId> = (0..MAX_CONNECTIONS)
            .map(|i| store.connect(format!("c{i}"), 1).unwrap().0)
            .collect();
        let err = store.connect("one too many".into(), 1).unwrap_err();
        assert_eq!(
            err,
            RequestError::TooManyConnections {
                max: MAX_CONNECTIONS
            }
        );
        assert!(err.to_string().contains("512"), "{err}");
        store.disconnect(ids[7]);
        let (_, bit) = store.connect("late".into(), 1).unwrap();
        assert!(bit < MAX_CONNECTIONS);
    }
}
