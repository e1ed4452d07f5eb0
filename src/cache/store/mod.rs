//! The store's bookkeeping: fixed-size slots carved from one byte range (one class
//! per record size), LRU eviction over unpinned records only, fill tickets and
//! counters. The server wraps it in a mutex and mirrors every record into the shared
//! [`Table`], where clients pin hits themselves; pins are read back from there.

use std::collections::HashMap;
use std::time::Instant;

use lru::LruCache;

use super::protocol::{ClientId, LeaseGrant, LeaseId, RequestError, TicketId};
use super::stats::{ClassStats, ClientStats, Counters, LatencyWindow, StatsReport};
use super::table::{self, SlotCode, Table, MAX_CONNECTIONS, MAX_KEY_BYTES};

/// Slots are page multiples, so records start page-aligned.
pub const SLOT_ALIGN: u64 = 4096;

type SlotIdx = usize;

#[derive(Debug)]
enum SlotState {
    Free,
    Filling { len: u64 },
    Ready { key: String, len: u64 },
}

#[derive(Debug)]
struct Slot {
    offset: u64,
    class: usize,
    generation: u32,
    state: SlotState,
}

/// All slots of one size, with the free list and the LRU of committed records.
#[derive(Debug)]
struct SlotClass {
    slot_bytes: u64,
    slots: Vec<SlotIdx>,
    free: Vec<SlotIdx>,
    /// Committed records, least recently entered first, with the clock when they
    /// entered; a record accessed since then gets a second chance.
    lru: LruCache<SlotIdx, u64>,
}

#[derive(Debug)]
struct Fill {
    key: String,
    client: ClientId,
    slot: Option<SlotIdx>,
    started: Instant,
}

#[derive(Debug)]
struct ClientRecord {
    name: String,
    pid: u32,
    /// This connection's pin bit and counter block in the table.
    bit: usize,
    counters: Counters,
    tickets: std::collections::HashSet<TicketId>,
}

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
    cap: u64,
    carved: u64,
    fixed_classes: bool,
    classes: Vec<SlotClass>,
    slots: Vec<Slot>,
    table: Table,
    /// Committed records by key.
    index: HashMap<String, SlotIdx>,
    /// Tombstones in the shared index; it is rebuilt when they pile up.
    index_tombstones: usize,
    /// Fills in flight by key, and their tickets.
    filling: HashMap<String, TicketId>,
    tickets: HashMap<TicketId, Fill>,
    clients: HashMap<ClientId, ClientRecord>,
    /// Pin bits not given to a connection.
    free_bits: Vec<usize>,
    totals: Counters,
    evictions: u64,
    fill_latency: LatencyWindow,
    next_id: u64,
    started: Instant,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("store_id", &self.store_id)
            .field("cap", &self.cap)
            .field("records", &self.index.len())
            .finish()
    }
}

/// `len` rounded up to the slot alignment.
pub fn slot_size_for(len: u64) -> u64 {
    len.div_ceil(SLOT_ALIGN) * SLOT_ALIGN
}

impl Store {
    /// A store of `cap` bytes whose records are mirrored in `table`. With `slot_bytes`
    /// given, records must fit those classes; without, a class is made for each new
    /// record size on its first fill.
    pub fn new(store_id: u64, cap: u64, slot_bytes: &[u64], table: Table) -> Store {
        let mut sizes: Vec<u64> = slot_bytes.iter().map(|&b| slot_size_for(b)).collect();
        sizes.sort_unstable();
        sizes.dedup();
        let mut store = Store {
            store_id,
            cap,
            carved: 0,
            fixed_classes: !sizes.is_empty(),
            classes: Vec::new(),
            slots: Vec::new(),
            table,
            index: HashMap::new(),
            index_tombstones: 0,
            filling: HashMap::new(),
            tickets: HashMap::new(),
            clients: HashMap::new(),
            free_bits: (0..MAX_CONNECTIONS).rev().collect(),
            totals: Counters::default(),
            evictions: 0,
            fill_latency: LatencyWindow::default(),
            next_id: 1,
            started: Instant::now(),
        };
        for size in sizes {
            store.add_class(size);
        }
        store
    }

    /// A store over a table on the heap (tests and single-process tools).
    pub fn on_heap(store_id: u64, cap: u64, slot_bytes: &[u64]) -> Store {
        let layout = table::Layout::for_store(cap, slot_bytes);
        Store::new(store_id, cap, slot_bytes, Table::on_heap(cap, layout.slots))
    }

    fn add_class(&mut self, slot_bytes: u64) -> usize {
        self.classes.push(SlotClass {
            slot_bytes,
            slots: Vec::new(),
            free: Vec::new(),
            lru: LruCache::unbounded(),
        });
        self.classes.sort_by_key(|c| c.slot_bytes);
        // Keep slot -> class indices right after the sort.
        for (ci, class) in self.classes.iter().enumerate() {
            for &s in &class.slots {
                self.slots[s].class = ci;
            }
        }
        self.classes
            .iter()
            .position(|c| c.slot_bytes == slot_bytes)
            .unwrap_or(0)
    }

    fn next_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// The byte cap.
    pub fn cap(&self) -> u64 {
        self.cap
    }

    /// The shared table.
    pub fn table(&self) -> &Table {
        &self.table
    }

    /// Registers a connection; returns its id and its pin bit, or an error when all
    /// [`MAX_CONNECTIONS`] bits are taken.
    pub fn connect(&mut self, name: String, pid: u32) -> Result<(ClientId, usize), RequestError> {
        let Some(bit) = self.free_bits.pop() else {
            return Err(RequestError::TooManyConnections {
                max: MAX_CONNECTIONS,
            });
        };
        let id = self.next_id();
        self.table.claim_connection(bit, id);
        self.clients.insert(
            id,
            ClientRecord {
                name,
                pid,
                bit,
                counters: Counters::default(),
                tickets: Default::default(),
            },
        );
        Ok((id, bit))
    }

    /// Drops a connection: its pins are cleared, its shared counters folded into the
    /// totals and its fills abandoned. Returns the number of fills abandoned (waiters
    /// must be woken).
    pub fn disconnect(&mut self, client: ClientId) -> usize {
        let Some(record) = self.clients.remove(&client) else {
            return 0;
        };
        let hits = self.table.release_connection(record.bit, self.slots.len());
        self.totals.hits += hits;
        self.free_bits.push(record.bit);
        let abandoned = record.tickets.len();
        for ticket in record.tickets {
            self.drop_fill(ticket);
        }
        abandoned
    }

    fn client_mut(&mut self, client: ClientId) -> Result<&mut ClientRecord, RequestError> {
        self.clients
            .get_mut(&client)
            .ok_or_else(|| RequestError::Protocol(format!("client {client} is not connected")))
    }

    /// Counts a request served over the control channel.
    pub fn count_request(&mut self, client: ClientId) {
        self.totals.requests += 1;
        if let Some(c) = self.clients.get_mut(&client) {
            c.counters.requests += 1;
        }
    }

    /// Counts a refused request against the client.
    pub fn count_error(&mut self, client: ClientId) {
        self.totals.errors += 1;
        if let Some(c) = self.clients.get_mut(&client) {
            c.counters.errors += 1;
        }
    }

    fn lease(&mut self, client: ClientId, slot: SlotIdx) -> Result<LeaseGrant, RequestError> {
        let bit = self.client_mut(client)?.bit;
        let s = &self.slots[slot];
        let SlotState::Ready { len, .. } = s.state else {
            return Err(RequestError::Protocol(format!(
                "slot {slot} holds no committed record"
            )));
        };
        self.table.pin(slot, bit);
        self.table.touch(slot);
        Ok(LeaseGrant {
            lease: table::lease_id(slot, s.generation),
            offset: s.offset,
            len,
        })
    }

    fn check_key(key: &str) -> Result<(), RequestError> {
        if key.len() > MAX_KEY_BYTES {
            return Err(RequestError::KeyTooLong {
                key: key.to_string(),
                max: MAX_KEY_BYTES,
            });
        }
        Ok(())
    }

    /// Looks a key up: a lease, a fill ticket, or a wait for someone else's fill.
    pub fn get(&mut self, client: ClientId, key: &str) -> Result<GetOutcome, RequestError> {
        self.client_mut(client)?;
        Self::check_key(key)?;
        if let Some(&slot) = self.index.get(key) {
            let grant = self.lease(client, slot)?;
            self.totals.hits += 1;
            self.client_mut(client)?.counters.hits += 1;
            return Ok(GetOutcome::Hit(grant));
        }
        if let Some(&ticket) = self.filling.get(key) {
            let filler = self.tickets.get(&ticket).map(|f| f.client).unwrap_or(0);
            if filler == client {
                return Err(RequestError::AlreadyFilling {
                    key: key.to_string(),
                    ticket,
                });
            }
            self.totals.waits += 1;
            self.client_mut(client)?.counters.waits += 1;
            return Ok(GetOutcome::Wait { filler });
        }
        let ticket = self.next_id();
        self.tickets.insert(
            ticket,
            Fill {
                key: key.to_string(),
                client,
                slot: None,
                started: Instant::now(),
            },
        );
        self.filling.insert(key.to_string(), ticket);
        self.totals.misses += 1;
        let record = self.client_mut(client)?;
        record.counters.misses += 1;
        record.tickets.insert(ticket);
        Ok(GetOutcome::Miss(ticket))
    }

    /// A lease if the key is cached; `None` otherwise.
    pub fn peek(
        &mut self,
        client: ClientId,
        key: &str,
    ) -> Result<Option<LeaseGrant>, RequestError> {
        self.client_mut(client)?;
        Self::check_key(key)?;
        let Some(&slot) = self.index.get(key) else {
            return Ok(None);
        };
        let grant = self.lease(client, slot)?;
        self.totals.hits += 1;
        self.client_mut(client)?.counters.hits += 1;
        Ok(Some(grant))
    }

    fn check_ticket(&self, client: ClientId, ticket: TicketId) -> Result<(), RequestError> {
        match self.tickets.get(&ticket) {
            Some(fill) if fill.client == client => Ok(()),
            _ => Err(RequestError::TicketNotHeld { ticket }),
        }
    }

    /// Reserves a slot of the right class for a ticket: a free slot, else a new one
    /// carved from the store, else the least recently used unpinned record's.
    pub fn reserve(
        &mut self,
        client: ClientId,
        ticket: TicketId,
        len: u64,
    ) -> Result<(u64, u64), RequestError> {
        self.check_ticket(client, ticket)?;
        let key = self.tickets[&ticket].key.clone();
        if self.tickets[&ticket].slot.is_some() {
            return Err(RequestError::TicketState {
                ticket,
                key,
                problem: "a slot is reserved already".into(),
            });
        }
        if len == 0 {
            return Err(RequestError::EmptyRecord { key });
        }
        let class = self.class_for(&key, len)?;
        let slot = self.take_slot(class, &key, len)?;
        let s = &mut self.slots[slot];
        s.state = SlotState::Filling { len };
        s.generation = s.generation.wrapping_add(1).max(1);
        self.table.set_state(
            slot,
            table::SlotState {
                generation: s.generation,
                code: SlotCode::Filling,
            },
        );
        let offset = s.offset;
        if let Some(fill) = self.tickets.get_mut(&ticket) {
            fill.slot = Some(slot);
        }
        Ok((offset, len))
    }

    fn class_for(&mut self, key: &str, len: u64) -> Result<usize, RequestError> {
        if let Some(ci) = self.classes.iter().position(|c| c.slot_bytes >= len) {
            return Ok(ci);
        }
        let needed = slot_size_for(len);
        if self.fixed_classes || needed > self.cap - self.carved {
            let largest_slot = if self.fixed_classes {
                self.classes.last().map_or(0, |c| c.slot_bytes)
            } else {
                self.cap - self.carved
            };
            return Err(RequestError::RecordTooLarge {
                key: key.to_string(),
                len,
                largest_slot,
            });
        }
        Ok(self.add_class(needed))
    }

    fn take_slot(&mut self, ci: usize, key: &str, len: u64) -> Result<SlotIdx, RequestError> {
        if let Some(slot) = self.classes[ci].free.pop() {
            return Ok(slot);
        }
        let slot_bytes = self.classes[ci].slot_bytes;
        if self.cap - self.carved >= slot_bytes && self.slots.len() < self.table.slots() {
            let slot = self.slots.len();
            self.table.set_offset(slot, self.carved);
            self.slots.push(Slot {
                offset: self.carved,
                class: ci,
                generation: 0,
                state: SlotState::Free,
            });
            self.carved += slot_bytes;
            self.classes[ci].slots.push(slot);
            return Ok(slot);
        }
        if let Some(slot) = self.evict_one(ci) {
            return Ok(slot);
        }
        Err(RequestError::StoreFull {
            key: key.to_string(),
            len,
            slots: self.classes[ci].slots.len(),
            slot_bytes,
        })
    }

    /// Takes the least recently used unpinned record of class `ci`: a record accessed
    /// since it entered the LRU goes back in as the most recent (second chance), a
    /// pinned one too; gives up after going round the whole LRU twice.
    fn evict_one(&mut self, ci: usize) -> Option<SlotIdx> {
        let rounds = 2 * self.classes[ci].lru.len();
        for _ in 0..rounds {
            let (slot, entered) = self.classes[ci].lru.pop_lru()?;
            let accessed = self.table.last_access(slot) > entered;
            if accessed || !self.table.try_evict(slot) {
                let entered = self.table.tick();
                self.classes[ci].lru.put(slot, entered);
                continue;
            }
            self.unindex(slot);
            self.slots[slot].state = SlotState::Free;
            self.evictions += 1;
            return Some(slot);
        }
        None
    }

    /// Removes a slot's record from both indexes.
    fn unindex(&mut self, slot: SlotIdx) {
        if let SlotState::Ready { key, .. } = &self.slots[slot].state {
            self.index.remove(key);
            if self.table.index_remove(table::key_hash(key), slot) {
                self.index_tombstones += 1;
            }
        }
        if self.index_tombstones > self.table.index_entries() / 4 {
            self.rebuild_index();
        }
    }

    /// Rewrites the shared index from the live records (clients that look meanwhile
    /// miss and ask the server).
    fn rebuild_index(&mut self) {
        self.table.index_clear();
        for (key, &slot) in &self.index {
            self.table.index_insert(table::key_hash(key), slot);
        }
        self.index_tombstones = 0;
    }

    /// Publishes a filled slot and leases it to the filler.
    pub fn commit(
        &mut self,
        client: ClientId,
        ticket: TicketId,
    ) -> Result<LeaseGrant, RequestError> {
        self.check_ticket(client, ticket)?;
        let fill = &self.tickets[&ticket];
        let Some(slot) = fill.slot else {
            return Err(RequestError::TicketState {
                ticket,
                key: fill.key.clone(),
                problem: "commit before reserve".into(),
            });
        };
        let Some(fill) = self.tickets.remove(&ticket) else {
            return Err(RequestError::TicketNotHeld { ticket });
        };
        let len = match self.slots[slot].state {
            SlotState::Filling { len, .. } => len,
            _ => 0,
        };
        self.filling.remove(&fill.key);
        // Key and length first, then Ready, then the index: a client that finds the
        // slot through the index sees a whole record.
        let entered = self.table.tick();
        self.table.write_record(slot, &fill.key, len);
        self.table.set_state(
            slot,
            table::SlotState {
                generation: self.slots[slot].generation,
                code: SlotCode::Ready,
            },
        );
        if self.table.index_insert(table::key_hash(&fill.key), slot) {
            self.index_tombstones = self.index_tombstones.saturating_sub(1);
        }
        let class = self.slots[slot].class;
        self.classes[class].lru.put(slot, entered);
        self.index.insert(fill.key.clone(), slot);
        self.slots[slot].state = SlotState::Ready { key: fill.key, len };
        self.fill_latency
            .push(fill.started.elapsed().as_secs_f64() * 1e3);
        self.totals.fills += 1;
        self.totals.bytes_filled += len;
        let record = self.client_mut(client)?;
        record.tickets.remove(&ticket);
        record.counters.fills += 1;
        record.counters.bytes_filled += len;
        self.lease(client, slot)
    }

    /// Abandons a fill; its slot (if any) goes back to the free list.
    pub fn abort(&mut self, client: ClientId, ticket: TicketId) -> Result<(), RequestError> {
        self.check_ticket(client, ticket)?;
        self.client_mut(client)?.tickets.remove(&ticket);
        self.drop_fill(ticket);
        Ok(())
    }

    fn free_slot(&mut self, slot: SlotIdx) {
        let s = &mut self.slots[slot];
        s.state = SlotState::Free;
        self.table.set_state(
            slot,
            table::SlotState {
                generation: s.generation,
                code: SlotCode::Free,
            },
        );
        let class = s.class;
        self.classes[class].free.push(slot);
    }

    fn drop_fill(&mut self, ticket: TicketId) {
        let Some(fill) = self.tickets.remove(&ticket) else {
            return;
        };
        self.filling.remove(&fill.key);
        if let Some(slot) = fill.slot {
            self.free_slot(slot);
        }
        self.totals.fills_abandoned += 1;
        if let Some(c) = self.clients.get_mut(&fill.client) {
            c.counters.fills_abandoned += 1;
        }
    }

    /// Releases a lease held by the client (clients release by clearing their pin bit
    /// themselves; this is the protocol's explicit form, for tools and tests).
    pub fn release(&mut self, client: ClientId, lease: LeaseId) -> Result<(), RequestError> {
        let bit = self.client_mut(client)?.bit;
        let (slot, generation) = table::decode_lease(lease);
        let held = self.slots.get(slot).is_some_and(|s| {
            s.generation == generation && matches!(s.state, SlotState::Ready { .. })
        });
        if held && self.table.unpin(slot, bit) {
            Ok(())
        } else {
            Err(RequestError::LeaseNotHeld { lease })
        }
    }

    /// Drops a cached record that no one holds.
    pub fn invalidate(&mut self, key: &str) -> Result<(), RequestError> {
        let Some(&slot) = self.index.get(key) else {
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
        self.unindex(slot);
        let class = self.slots[slot].class;
        self.classes[class].lru.pop(&slot);
        self.free_slot(slot);
        Ok(())
    }

    /// Whether a fill of `key` is in flight.
    pub fn is_filling(&self, key: &str) -> bool {
        self.filling.contains_key(key)
    }

    /// A snapshot of every counter; pins and hits made by clients directly in the
    /// shared table are read from there.
    pub fn stats(&self, server_pid: u32) -> StatsReport {
        let mut bytes_used = 0;
        let mut pinned_bytes = 0;
        let mut leases_held = 0;
        let mut leases_by_bit = vec![0usize; MAX_CONNECTIONS];
        let classes = self
            .classes
            .iter()
            .map(|c| {
                let mut cs = ClassStats {
                    slot_bytes: c.slot_bytes,
                    slots: c.slots.len(),
                    ready: 0,
                    pinned: 0,
                    filling: 0,
                };
                for &s in &c.slots {
                    match self.slots[s].state {
                        SlotState::Free => {}
                        SlotState::Filling { .. } => cs.filling += 1,
                        SlotState::Ready { .. } => {
                            cs.ready += 1;
                            let pins = self.table.pin_count(s) as usize;
                            if pins > 0 {
                                cs.pinned += 1;
                                leases_held += pins;
                                for c in self.clients.values() {
                                    if self.table.is_pinned_by(s, c.bit) {
                                        leases_by_bit[c.bit] += 1;
                                    }
                                }
                            }
                        }
                    }
                }
                bytes_used += (cs.ready + cs.filling) as u64 * c.slot_bytes;
                pinned_bytes += cs.pinned as u64 * c.slot_bytes;
                cs
            })
            .collect();
        let mut totals = self.totals;
        let mut clients: Vec<ClientStats> = self
            .clients
            .iter()
            .map(|(&id, c)| {
                let mut counters = c.counters;
                let shared_hits = self.table.connection_hits(c.bit);
                counters.hits += shared_hits;
                totals.hits += shared_hits;
                ClientStats {
                    id,
                    name: c.name.clone(),
                    pid: c.pid,
                    counters,
                    hit_rate: counters.hit_rate(),
                    leases_held: leases_by_bit[c.bit],
                    fills_in_flight: c.tickets.len(),
                }
            })
            .collect();
        clients.sort_by_key(|c| c.id);
        StatsReport {
            server_pid,
            store_id: self.store_id,
            uptime_s: self.started.elapsed().as_secs_f64(),
            cap_bytes: self.cap,
            bytes_used,
            bytes_carved: self.carved,
            metadata_bytes: self.table.layout().meta_bytes(),
            slot_entries: self.table.slots(),
            pinned_bytes,
            records: self.index.len(),
            evictions: self.evictions,
            fills_in_flight: self.tickets.len(),
            leases_held,
            totals,
            hit_rate: totals.hit_rate(),
            fill_latency_ms: self.fill_latency.summary(),
            classes,
            clients,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
