//! The store's bookkeeping, without any I/O: fixed-size slots carved from one byte
//! range (one class per record size), LRU eviction over unpinned records only,
//! leases, fill tickets and counters. The server wraps it in a mutex; the bytes
//! themselves live in shared memory and are never touched here.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use lru::LruCache;

use super::protocol::{ClientId, LeaseGrant, LeaseId, RequestError, TicketId};
use super::stats::{ClassStats, ClientStats, Counters, LatencyWindow, StatsReport};

/// Slots are page multiples, so records start page-aligned.
pub const SLOT_ALIGN: u64 = 4096;

type SlotIdx = usize;

#[derive(Debug)]
enum SlotState {
    Free,
    Filling { len: u64 },
    Ready { key: String, len: u64, pins: u32 },
}

#[derive(Debug)]
struct Slot {
    offset: u64,
    class: usize,
    state: SlotState,
}

/// All slots of one size, with the free list and the LRU of unpinned records.
#[derive(Debug)]
struct SlotClass {
    slot_bytes: u64,
    slots: Vec<SlotIdx>,
    free: Vec<SlotIdx>,
    /// Ready records with no lease, least recently released first.
    unpinned: LruCache<SlotIdx, ()>,
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
    counters: Counters,
    leases: HashSet<LeaseId>,
    tickets: HashSet<TicketId>,
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
#[derive(Debug)]
pub struct Store {
    store_id: u64,
    cap: u64,
    carved: u64,
    fixed_classes: bool,
    classes: Vec<SlotClass>,
    slots: Vec<Slot>,
    /// Committed records by key.
    index: HashMap<String, SlotIdx>,
    /// Fills in flight by key, and their tickets.
    filling: HashMap<String, TicketId>,
    tickets: HashMap<TicketId, Fill>,
    leases: HashMap<LeaseId, (SlotIdx, ClientId)>,
    clients: HashMap<ClientId, ClientRecord>,
    totals: Counters,
    evictions: u64,
    fill_latency: LatencyWindow,
    next_id: u64,
    started: Instant,
}

/// `len` rounded up to the slot alignment.
pub fn slot_size_for(len: u64) -> u64 {
    len.div_ceil(SLOT_ALIGN) * SLOT_ALIGN
}

impl Store {
    /// A store of `cap` bytes. With `slot_bytes` given, records must fit those
    /// classes; without, a class is made for each new record size on its first fill.
    pub fn new(store_id: u64, cap: u64, slot_bytes: &[u64]) -> Store {
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
            index: HashMap::new(),
            filling: HashMap::new(),
            tickets: HashMap::new(),
            leases: HashMap::new(),
            clients: HashMap::new(),
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

    fn add_class(&mut self, slot_bytes: u64) -> usize {
        self.classes.push(SlotClass {
            slot_bytes,
            slots: Vec::new(),
            free: Vec::new(),
            unpinned: LruCache::unbounded(),
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

    /// Registers a connection.
    pub fn connect(&mut self, name: String, pid: u32) -> ClientId {
        let id = self.next_id();
        self.clients.insert(
            id,
            ClientRecord {
                name,
                pid,
                counters: Counters::default(),
                leases: HashSet::new(),
                tickets: HashSet::new(),
            },
        );
        id
    }

    /// Drops a connection: its leases are released and its fills abandoned.
    /// Returns the number of fills abandoned (waiters must be woken).
    pub fn disconnect(&mut self, client: ClientId) -> usize {
        let Some(record) = self.clients.remove(&client) else {
            return 0;
        };
        for lease in record.leases {
            if let Some((slot, _)) = self.leases.remove(&lease) {
                self.unpin(slot);
            }
        }
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

    /// Counts a refused request against the client.
    pub fn count_error(&mut self, client: ClientId) {
        self.totals.errors += 1;
        if let Some(c) = self.clients.get_mut(&client) {
            c.counters.errors += 1;
        }
    }

    fn lease(&mut self, client: ClientId, slot: SlotIdx) -> Result<LeaseGrant, RequestError> {
        let offset = self.slots[slot].offset;
        let len = match &mut self.slots[slot].state {
            SlotState::Ready { len, pins, .. } => {
                *pins += 1;
                *len
            }
            _ => {
                return Err(RequestError::Protocol(format!(
                    "slot {slot} holds no committed record"
                )))
            }
        };
        let class = self.slots[slot].class;
        self.classes[class].unpinned.pop(&slot);
        let lease = self.next_id();
        self.leases.insert(lease, (slot, client));
        self.client_mut(client)?.leases.insert(lease);
        Ok(LeaseGrant { lease, offset, len })
    }

    fn unpin(&mut self, slot: SlotIdx) {
        if let SlotState::Ready { pins, .. } = &mut self.slots[slot].state {
            *pins = pins.saturating_sub(1);
            if *pins == 0 {
                let class = self.slots[slot].class;
                self.classes[class].unpinned.put(slot, ());
            }
        }
    }

    /// Looks a key up: a lease, a fill ticket, or a wait for someone else's fill.
    pub fn get(&mut self, client: ClientId, key: &str) -> Result<GetOutcome, RequestError> {
        self.client_mut(client)?;
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
    pub fn peek(&mut self, client: ClientId, key: &str) -> Result<Option<LeaseGrant>, RequestError> {
        self.client_mut(client)?;
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
        self.slots[slot].state = SlotState::Filling { len };
        if let Some(fill) = self.tickets.get_mut(&ticket) {
            fill.slot = Some(slot);
        }
        Ok((self.slots[slot].offset, len))
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
        if self.cap - self.carved >= slot_bytes {
            let slot = self.slots.len();
            self.slots.push(Slot {
                offset: self.carved,
                class: ci,
                state: SlotState::Free,
            });
            self.carved += slot_bytes;
            self.classes[ci].slots.push(slot);
            return Ok(slot);
        }
        if let Some((slot, ())) = self.classes[ci].unpinned.pop_lru() {
            if let SlotState::Ready { key: old, .. } =
                std::mem::replace(&mut self.slots[slot].state, SlotState::Free)
            {
                self.index.remove(&old);
            }
            self.evictions += 1;
            return Ok(slot);
        }
        Err(RequestError::StoreFull {
            key: key.to_string(),
            len,
            slots: self.classes[ci].slots.len(),
            slot_bytes,
        })
    }

    /// Publishes a filled slot and leases it to the filler.
    pub fn commit(&mut self, client: ClientId, ticket: TicketId) -> Result<LeaseGrant, RequestError> {
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
        self.index.insert(fill.key.clone(), slot);
        self.slots[slot].state = SlotState::Ready {
            key: fill.key,
            len,
            pins: 0,
        };
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

    fn drop_fill(&mut self, ticket: TicketId) {
        let Some(fill) = self.tickets.remove(&ticket) else {
            return;
        };
        self.filling.remove(&fill.key);
        if let Some(slot) = fill.slot {
            self.slots[slot].state = SlotState::Free;
            let class = self.slots[slot].class;
            self.classes[class].free.push(slot);
        }
        self.totals.fills_abandoned += 1;
        if let Some(c) = self.clients.get_mut(&fill.client) {
            c.counters.fills_abandoned += 1;
        }
    }

    /// Releases a lease held by the client.
    pub fn release(&mut self, client: ClientId, lease: LeaseId) -> Result<(), RequestError> {
        match self.leases.get(&lease) {
            Some(&(slot, owner)) if owner == client => {
                self.leases.remove(&lease);
                self.client_mut(client)?.leases.remove(&lease);
                self.unpin(slot);
                Ok(())
            }
            _ => Err(RequestError::LeaseNotHeld { lease }),
        }
    }

    /// Drops a cached record that no one holds.
    pub fn invalidate(&mut self, key: &str) -> Result<(), RequestError> {
        let Some(&slot) = self.index.get(key) else {
            return Err(RequestError::UnknownKey {
                key: key.to_string(),
            });
        };
        if let SlotState::Ready { pins, .. } = self.slots[slot].state {
            if pins > 0 {
                return Err(RequestError::Pinned {
                    key: key.to_string(),
                    pins,
                });
            }
        }
        self.index.remove(key);
        let class = self.slots[slot].class;
        self.classes[class].unpinned.pop(&slot);
        self.classes[class].free.push(slot);
        self.slots[slot].state = SlotState::Free;
        Ok(())
    }

    /// Whether a fill of `key` is in flight.
    pub fn is_filling(&self, key: &str) -> bool {
        self.filling.contains_key(key)
    }

    /// A snapshot of every counter.
    pub fn stats(&self, server_pid: u32) -> StatsReport {
        let mut bytes_used = 0;
        let mut pinned_bytes = 0;
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
                        SlotState::Ready { pins, .. } => {
                            cs.ready += 1;
                            if pins > 0 {
                                cs.pinned += 1;
                            }
                        }
                    }
                }
                bytes_used += (cs.ready + cs.filling) as u64 * c.slot_bytes;
                pinned_bytes += cs.pinned as u64 * c.slot_bytes;
                cs
            })
            .collect();
        let mut clients: Vec<ClientStats> = self
            .clients
            .iter()
            .map(|(&id, c)| ClientStats {
                id,
                name: c.name.clone(),
                pid: c.pid,
                counters: c.counters,
                hit_rate: c.counters.hit_rate(),
                leases_held: c.leases.len(),
                fills_in_flight: c.tickets.len(),
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
            pinned_bytes,
            records: self.index.len(),
            evictions: self.evictions,
            fills_in_flight: self.tickets.len(),
            leases_held: self.leases.len(),
            totals: self.totals,
            hit_rate: self.totals.hit_rate(),
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
        let mut store = Store::new(1, 4 * MB, &[]);
        let c = store.connect("a".into(), 1);
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
        let mut store = Store::new(1, 3 * MB, &[MB]);
        let c = store.connect("a".into(), 1);
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
        let mut store = Store::new(1, 4 * MB, &[]);
        let a = store.connect("a".into(), 1);
        let b = store.connect("b".into(), 2);
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
        let mut store = Store::new(1, 2 * MB, &[MB]);
        let a = store.connect("a".into(), 1);
        let b = store.connect("b".into(), 2);
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
        let mut store = Store::new(1, 2 * MB, &[MB]);
        let a = store.connect("a".into(), 1);
        let b = store.connect("b".into(), 2);
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
        let mut store = Store::new(1, 8 * MB, &[]);
        let c = store.connect("a".into(), 1);
        fill(&mut store, c, "small", 5000);
        fill(&mut store, c, "big", MB + 1);
        fill(&mut store, c, "small2", 4000);
        let s = store.stats(0);
        let sizes: Vec<u64> = s.classes.iter().map(|c| c.slot_bytes).collect();
        assert_eq!(sizes, vec![8192, MB + SLOT_ALIGN]);
        assert_eq!(s.bytes_carved, 2 * 8192 + MB + SLOT_ALIGN);
    }
}
