//! The store's bookkeeping, a small facade over one part per job: the record
//! [`arena`] (extents of any size, carved on demand), the [`eviction`] order of
//! records (least recently used first, or with read orders the record needed last
//! first), the readers' announced [`read_order`]s and each job's [`pace`] (the
//! planned policy: evict the record needed last, prefetch ahead of use; the store's
//! side in `policy`), the
//! placements that make [`room`] for a record, the record [`index`], the
//! [`connections`] with their pin pages, single-flight [`fills`], the [`stats`]
//! counters and the [`reserve`]d memory under the carved bytes. The server wraps it
//! in a mutex; every record is mirrored into the shared [`TableWriter`], where
//! clients find hits themselves, and pins are read back from the connections' pin
//! pages ([`PinPages`]).
//!
//! Every operation first checks everything that can refuse it, then makes its
//! changes, none of which can fail: a refused request leaves the store's records,
//! extents and memory as they were (it may only have learnt of reads that clients
//! made, which refreshes the LRU order, and counted the refusal). One exception: a
//! commit refused because the filler's page has no room for the record's lease
//! ends the fill (its client gave the ticket up with the request), so other readers
//! of the key do not wait for the fill timeout.
//!
//! A connection that ends (its client closed it, or the server dropped it for a
//! frame that is no request) gives its fills' keys up at once, so other readers
//! take them over, but not their extents: the client may still hold a writable map
//! of them and write on. They are freed with its pin page, once the client's
//! rendezvous socket has closed too ([`Store::forget`]).

pub mod arena;
pub mod connections;
pub mod eviction;
pub mod fills;
pub mod index;
pub mod pace;
mod policy;
pub mod read_order;
mod report;
pub mod reserve;
pub mod room;
pub mod stats;

use super::ids::{ClientId, LeaseId, TicketId};
use super::pins::{LeaseWord, PinPage, PinPages, LEASES_PER_CONNECTION};
use super::protocol::{LeaseGrant, RequestError};
use super::table::{self, SlotCode, TableWriter, MAX_KEY_BYTES};
use arena::{Arena, Placed, SlotIdx, SlotUse};
pub use connections::ClientLabel;
use connections::Connections;
use eviction::{Bound, EvictionIndex};
use fills::{Fill, Fills};
use index::RecordIndex;
use pace::{Clock, Micros};
use policy::Incoming;
use read_order::ReadOrders;
use reserve::{NoReserve, Reservations, ReserveRefusal};
use room::{Evictable, Placement};
use stats::{Event, StoreStats};

pub use super::table::{extent_for, SLOT_ALIGN};
pub use policy::PrefetchOutcome;

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
    table: TableWriter,
    pins: PinPages,
    arena: Arena,
    /// The order records go in.
    eviction: EvictionIndex,
    /// The readers' announced read orders (none: plain LRU).
    read_orders: ReadOrders,
    /// The store's clock (the read orders' paces).
    clock: Clock,
    index: RecordIndex,
    connections: Connections,
    fills: Fills,
    stats: StoreStats,
    /// The memory under the carved bytes.
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

/// The store as the room search sees it: a record may go if it is committed,
/// no live pin page holds a lease on it and the record coming in may push it out.
struct Occupants<'a> {
    store: &'a Store,
    /// The time the ranks are taken at.
    now: Micros,
    /// What the record coming in may push out.
    bound: Bound,
}

impl Evictable for Occupants<'_> {
    fn evictable(&self, slot: SlotIdx) -> Option<u64> {
        let ready = matches!(self.store.arena.slot_use(slot), SlotUse::Ready { .. });
        if !ready || self.store.pinned(slot) {
            return None;
        }
        self.store.eviction.rank(slot, self.now, self.bound)
    }
}

impl Store {
    /// A store of `cap` bytes whose records are mirrored in `table`, pinned through
    /// `pins`; its bytes are reserved through `reservations` as they are carved.
    pub fn new(
        store_id: u64,
        cap: u64,
        table: TableWriter,
        pins: PinPages,
        reservations: Reservations,
    ) -> Store {
        let pages = pins.count();
        Store {
            store_id,
            arena: Arena::new(cap, table.slots()),
            table,
            pins,
            eviction: EvictionIndex::default(),
            read_orders: ReadOrders::default(),
            clock: Clock::real(),
            index: RecordIndex::default(),
            connections: Connections::new(pages),
            fills: Fills::default(),
            stats: StoreStats::new(),
            reservations,
            next_id: 1,
        }
    }

    /// A store over a table on the heap (tests and single-process tools), with a
    /// descriptor per `record_bytes` of the cap (or the default).
    pub fn on_heap(store_id: u64, cap: u64, record_bytes: Option<u64>) -> Store {
        Store::on_heap_reserving(store_id, cap, record_bytes, Box::new(NoReserve))
    }

    /// A store over a table on the heap whose bytes are reserved through `reserver`.
    pub fn on_heap_reserving(
        store_id: u64,
        cap: u64,
        record_bytes: Option<u64>,
        reserver: Box<dyn reserve::PageReserver>,
    ) -> Store {
        let layout = table::Layout::for_store(cap, record_bytes);
        let table = TableWriter::on_heap(cap, layout.slots);
        let reservations = Reservations::new(reserver, 0);
        let pins = PinPages::on_heap(layout.connections);
        Store::new(store_id, cap, table, pins, reservations)
    }

    /// Sets the store's clock (tests and simulations move a manual one).
    pub fn set_clock(&mut self, clock: Clock) {
        self.clock = clock;
    }

    /// Sets what the read orders may hold, in bytes.
    pub fn set_read_order_budget(&mut self, bytes: u64) {
        self.read_orders.set_budget(bytes);
    }

    /// The byte cap.
    pub fn cap(&self) -> u64 {
        self.arena.cap()
    }

    /// The shared table.
    pub fn table(&self) -> &TableWriter {
        &self.table
    }

    /// Connection page `page` (tests play a client's part in shared memory with it).
    pub fn pin_page(&self, page: usize) -> PinPage<'_> {
        self.pins.page(page)
    }

    /// Registers a connection of this process's user with no job (tests and
    /// single-process tools); returns its id and its pin page, or an error when all
    /// its pin pages are taken.
    pub fn connect(&mut self, name: String, pid: u32) -> Result<(ClientId, usize), RequestError> {
        self.connect_as(ClientLabel {
            name,
            job: String::new(),
            pid,
            // SAFETY: geteuid has no preconditions and cannot fail.
            uid: unsafe { libc::geteuid() },
        })
    }

    /// [`connect`](Self::connect) for a client that names its job: its figures
    /// count for the job too (`vrtspike cache stats`, the job's summary).
    pub fn connect_as(&mut self, who: ClientLabel) -> Result<(ClientId, usize), RequestError> {
        let id = self.next_id;
        let pins = &self.pins;
        let job = who.job.clone();
        let page = self.connections.connect(id, who, |p| pins.page(p))?;
        self.next_id += 1;
        self.stats.connected(id, &job);
        Ok((id, page))
    }

    /// Ends a connection: its shared counters are folded into the totals and its
    /// fills abandoned (their keys free for other readers to fill); their extents
    /// stay taken, and its leases keep pinning, until [`forget`](Self::forget): the
    /// client may still write into its fills' maps. Returns the number of fills
    /// abandoned (waiters must be woken).
    pub fn disconnect(&mut self, client: ClientId) -> usize {
        self.read_orders.forget(client, &mut self.eviction);
        let pins = &self.pins;
        let Some(gone) = self.connections.disconnect(client, |p| pins.page(p)) else {
            return 0;
        };
        self.stats.disconnected(client, gone.shared);
        let abandoned = self.fills.abandon_all(client);
        for fill in &abandoned {
            self.stats.count(fill.client, Event::FillAbandoned);
        }
        abandoned.len()
    }

    /// The client of an ended connection is gone for good (its socket closed): its
    /// leases are released, its abandoned fills' extents freed, and its page is
    /// free for another connection.
    pub fn forget(&mut self, client: ClientId) -> bool {
        for slot in self.fills.take_orphans(client) {
            self.free_fill_extent(slot);
        }
        let pins = &self.pins;
        self.connections.forget(client, |p| pins.page(p))
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

    /// Pins `slot`'s committed record for `client`, in its page (the client waits
    /// for this reply, so it does not take a lease of its own meanwhile).
    fn lease(&mut self, client: ClientId, slot: SlotIdx) -> Result<LeaseGrant, RequestError> {
        let page = self.connections.get(client)?.page;
        let Some(placed) = self.arena.ready(slot) else {
            return Err(RequestError::Protocol(format!(
                "slot {slot} holds no committed record"
            )));
        };
        let lease = self
            .pins
            .page(page)
            .take(slot)
            .map_err(|_| RequestError::TooManyLeases {
                max: LEASES_PER_CONNECTION,
            })?;
        self.eviction.touch(slot);
        self.use_up_read(client, slot);
        Ok(LeaseGrant {
            lease: lease.0,
            offset: placed.offset,
            len: placed.len,
        })
    }

    /// Refuses a request that would end in a lease when `client`'s page has no
    /// room for one (its clients pin hits themselves, so a page fills up between
    /// a reserve and its commit too).
    fn check_lease_room(&self, client: ClientId) -> Result<(), RequestError> {
        let page = self.connections.get(client)?.page;
        if self.pins.page(page).lease_count() >= LEASES_PER_CONNECTION {
            return Err(RequestError::TooManyLeases {
                max: LEASES_PER_CONNECTION,
            });
        }
        Ok(())
    }

    /// Whether a lease of any live connection pins `slot`.
    fn pinned(&self, slot: SlotIdx) -> bool {
        self.connections
            .live_pages()
            .any(|p| self.pins.page(p).pins(slot))
    }

    /// Reserves room for a ticket's record of `len` bytes: a free extent, the end
    /// of the carved part, or what evicting unpinned records frees (least recently
    /// used first; with read orders, the record needed last first). Returns where to
    /// write it; `Declined` when the planned policy keeps no room for a record no
    /// read order names.
    pub fn reserve(
        &mut self,
        client: ClientId,
        ticket: TicketId,
        len: u64,
    ) -> Result<(u64, u64), RequestError> {
        let fill = self.fills.held(client, ticket)?;
        let key = fill.key.clone();
        self.check_lease_room(client)?;
        if fill.slot.is_some() {
            return Err(RequestError::TicketState {
                ticket,
                key,
                problem: "a slot is reserved already".into(),
            });
        }
        let extent = self.extent_of(&key, len)?;
        let incoming = self.demand(&key);
        let offset = self.place_fill(ticket, &key, len, extent, incoming)?;
        Ok((offset, len))
    }

    /// The extent a record of `len` bytes takes; an empty record, or one larger than
    /// the cap, is refused.
    fn extent_of(&self, key: &str, len: u64) -> Result<u64, RequestError> {
        if len == 0 {
            return Err(RequestError::EmptyRecord {
                key: key.to_string(),
            });
        }
        let cap = self.arena.cap();
        let too_large = || RequestError::RecordTooLarge {
            key: key.to_string(),
            len,
            cap,
        };
        extent_for(len).filter(|&e| e <= cap).ok_or_else(too_large)
    }

    /// Makes room (as `incoming` may) for `ticket`'s record of `len` bytes in an
    /// extent of `extent` and marks it filling; returns its offset.
    fn place_fill(
        &mut self,
        ticket: TicketId,
        key: &str,
        len: u64,
        extent: u64,
        incoming: Incoming,
    ) -> Result<u64, RequestError> {
        let (slot, placed) = self.make_room(key, len, extent, incoming)?;
        let state = table::SlotState {
            generation: placed.generation,
            code: SlotCode::Filling,
        };
        self.table.set_state(slot, state);
        self.fills.set_slot(ticket, slot);
        Ok(placed.offset)
    }

    /// Room for a record of `len` bytes in `extent` bytes, evicting only what
    /// `incoming` may push out, or the refusal.
    fn make_room(
        &mut self,
        key: &str,
        len: u64,
        extent: u64,
        incoming: Incoming,
    ) -> Result<(SlotIdx, Placed), RequestError> {
        self.learn_reads();
        let mut refused = None;
        if let Some(placement) = room::without_eviction(&self.arena, extent) {
            match self.carry_out(&placement, extent, len) {
                Ok(Some(placed)) => return Ok(placed),
                Ok(None) => {}
                Err(refusal) => refused = Some(refusal),
            }
        }
        self.refresh_read_orders();
        let (now, bound) = (self.clock.now(), incoming.bound());
        let occupants = Occupants {
            store: self,
            now,
            bound,
        };
        let may_grow = refused.is_none();
        let victims = self.eviction.victims(now, bound);
        let placements = room::by_eviction(&self.arena, extent, victims, &occupants, may_grow);
        for placement in &placements {
            match self.carry_out(placement, extent, len) {
                Ok(Some(placed)) => return Ok(placed),
                Ok(None) => {}
                Err(refusal) => refused = Some(refusal),
            }
        }
        if let Some(refusal) = refused {
            return Err(self.out_of_memory(key, len, refusal));
        }
        if !self.read_orders.is_empty() && incoming.is_restricted() {
            if incoming == Incoming::Unannounced {
                self.read_orders.count_unannounced_declined();
            }
            return Err(RequestError::Declined {
                key: key.to_string(),
            });
        }
        self.stats.refused_full();
        let (pinned_bytes, filling_bytes) = self.held_bytes();
        Err(RequestError::StoreFull {
            key: key.to_string(),
            len,
            pinned_bytes,
            filling_bytes,
            cap: self.arena.cap(),
        })
    }

    /// Folds the reads clients recorded in their pages into the LRU (and into
    /// the read orders they read for).
    fn learn_reads(&mut self) {
        let mut reads = Vec::new();
        let pins = &self.pins;
        let slots = self.table.slots();
        self.connections
            .drain_reads_by_client(slots, |p| pins.page(p), &mut reads);
        for (client, slot) in reads {
            self.eviction.touch(slot);
            self.use_up_read(client, slot);
        }
    }

    /// Carries a placement out if every part of it can be done: its records are marked
    /// evicting and none is pinned (else all are restored: `Ok(None)`), and the
    /// memory for its growth is reserved (else all are restored: the refusal).
    fn carry_out(
        &mut self,
        placement: &Placement,
        extent: u64,
        len: u64,
    ) -> Result<Option<(SlotIdx, Placed)>, ReserveRefusal> {
        let mut marked = Vec::with_capacity(placement.evict.len());
        for &slot in &placement.evict {
            let Some(before) = self.table.mark_evicting(slot) else {
                self.restore(&marked);
                return Ok(None);
            };
            marked.push((slot, before));
            if self.pinned(slot) {
                self.restore(&marked);
                return Ok(None);
            }
        }
        if placement.grow > 0 {
            if let Err(refusal) = self
                .reservations
                .reserve(self.arena.carved(), placement.grow)
            {
                self.restore(&marked);
                return Err(refusal);
            }
        }
        for &(slot, _) in &marked {
            self.evict(slot);
        }
        self.arena.grow(placement.grow);
        Ok(self.arena.occupy(placement.start, extent, len))
    }

    /// Puts slots marked Evicting back as they were.
    fn restore(&self, marked: &[(SlotIdx, table::SlotState)]) {
        for &(slot, before) in marked {
            self.table.set_state(slot, before);
        }
    }

    /// Takes an unpinned committed record (marked Evicting) out of the store.
    fn evict(&mut self, slot: SlotIdx) {
        if let Some(gone) = self.arena.release(slot) {
            if let Some(key) = gone.key {
                self.index.remove(&key, &self.table);
            }
            self.set_free(slot, gone.generation);
        }
        self.uncache(slot);
        self.stats.evicted();
    }

    fn set_free(&self, slot: SlotIdx, generation: u32) {
        let state = table::SlotState {
            generation,
            code: SlotCode::Free,
        };
        self.table.set_state(slot, state);
    }

    /// Bytes of pinned records and of fills in flight.
    fn held_bytes(&self) -> (u64, u64) {
        let (mut pinned, mut filling) = (0, 0);
        for (slot, used, extent) in self.arena.in_use() {
            match used {
                SlotUse::Filling { .. } => filling += extent,
                SlotUse::Ready { .. } if self.pinned(slot) => pinned += extent,
                _ => {}
            }
        }
        (pinned, filling)
    }

    /// The error for a fill whose memory could not be reserved.
    fn out_of_memory(&self, key: &str, len: u64, refusal: ReserveRefusal) -> RequestError {
        tracing::warn!(
            key,
            needed = refusal.needed,
            available = refusal.available,
            limit = %refusal.limit,
            reserved = self.reservations.reserved_bytes(),
            "cannot reserve memory for a cache record"
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

    /// Publishes a filled record and leases it to the filler.
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
        if let Err(refusal) = self.check_lease_room(client) {
            // The client gave its ticket and writable map up with this request: a
            // fill left in flight would keep every other reader of the key waiting
            // for the whole fill timeout. It ends here; the next reader fills.
            if let Some(fill) = self.fills.finish(ticket) {
                self.given_up(&fill);
            }
            return Err(refusal);
        }
        let placed = self
            .arena
            .publish(slot, key.clone())
            .ok_or_else(|| not_filling("its slot is not being filled"))?;
        // Nothing below can fail. Key, place and length first, then Ready, then the
        // index: a client that finds the slot through the index sees a whole record.
        self.fills.finish(ticket);
        self.table
            .write_record(slot, &key, placed.offset, placed.len);
        let state = table::SlotState {
            generation: placed.generation,
            code: SlotCode::Ready,
        };
        self.table.set_state(slot, state);
        let next_use = self.read_orders.cached(&key, slot);
        self.index.insert(key, slot, &self.table);
        let extent = self.arena.extent_of(slot).map_or(placed.len, |(_, e)| e);
        self.eviction.enter(slot, extent, next_use);
        self.stats
            .fill_committed(client, placed.len, started.elapsed());
        self.lease(client, slot)
    }

    /// Abandons a fill; its extent (if any) goes free.
    pub fn abort(&mut self, client: ClientId, ticket: TicketId) -> Result<(), RequestError> {
        self.fills.held(client, ticket)?;
        if let Some(fill) = self.fills.finish(ticket) {
            self.given_up(&fill);
        }
        Ok(())
    }

    /// Frees the extent of a fill that ended without a commit while its client
    /// is connected (it no longer writes: it aborted, or gave its map up to
    /// commit), and counts it.
    fn given_up(&mut self, fill: &Fill) {
        if let Some(slot) = fill.slot {
            self.free_fill_extent(slot);
        }
        self.stats.count(fill.client, Event::FillAbandoned);
    }

    /// Frees the extent of a fill that will never be committed.
    fn free_fill_extent(&mut self, slot: SlotIdx) {
        if let Some(gone) = self.arena.release(slot) {
            self.set_free(slot, gone.generation);
        }
    }

    /// Releases exactly the lease `lease` of the client (a lease's own drop does
    /// this in shared memory; this is the protocol's form, for tools and tests).
    pub fn release(&mut self, client: ClientId, lease: LeaseId) -> Result<(), RequestError> {
        let page = self.connections.get(client)?.page;
        match self.pins.page(page).release(LeaseWord(lease)) {
            true => Ok(()),
            false => Err(RequestError::LeaseNotHeld { lease }),
        }
    }

    /// Drops a cached record that no one holds.
    pub fn invalidate(&mut self, key: &str) -> Result<(), RequestError> {
        let Some(slot) = self.index.get(key) else {
            return Err(RequestError::UnknownKey {
                key: key.to_string(),
            });
        };
        let Some(before) = self.table.mark_evicting(slot) else {
            return Err(RequestError::Protocol(format!(
                "key {key:?}: its slot {slot} holds no committed record"
            )));
        };
        let pins = self.pin_count(slot);
        if pins > 0 {
            self.table.set_state(slot, before);
            return Err(RequestError::Pinned {
                key: key.to_string(),
                pins,
            });
        }
        if let Some(gone) = self.arena.release(slot) {
            self.set_free(slot, gone.generation);
        }
        self.index.remove(key, &self.table);
        self.uncache(slot);
        Ok(())
    }

    /// `slot`'s record is gone: out of the eviction order and the read orders.
    fn uncache(&mut self, slot: SlotIdx) {
        self.eviction.remove(slot);
        self.read_orders.uncached(slot);
    }

    /// Leases on `slot`, over every live connection.
    fn pin_count(&self, slot: SlotIdx) -> u32 {
        let leases = self
            .connections
            .live_pages()
            .flat_map(|p| self.pins.page(p).leases());
        leases.filter(|l| l.slot() == Some(slot)).count() as u32
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
mod tests;
