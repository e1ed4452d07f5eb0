//! The store's stats report: the figures of its parts, plus what clients did in the
//! shared table without a message (pins, hits), read from there.

use super::super::stats::{ClassStats, ClientStats, StatsReport};
use super::super::table::MAX_CONNECTIONS;
use super::arena::{ClassView, SlotUse};
use super::Store;

/// Bytes and leases over all classes.
#[derive(Debug, Default)]
struct Usage {
    bytes_used: u64,
    bytes_live: u64,
    pinned_bytes: u64,
    leases_held: usize,
    /// Slots pinned per connection bit.
    leases_by_bit: Vec<usize>,
}

impl Store {
    /// A snapshot of every counter; pins and hits made by clients directly in the
    /// shared table are read from there.
    pub fn stats(&self, server_pid: u32) -> StatsReport {
        let mut usage = Usage {
            leases_by_bit: vec![0; MAX_CONNECTIONS],
            ..Usage::default()
        };
        let classes = self
            .arena
            .classes()
            .into_iter()
            .map(|class| self.class_stats(class, &mut usage))
            .collect();
        let mut totals = self.stats.totals();
        let mut clients: Vec<ClientStats> = self
            .connections
            .iter()
            .map(|(id, c)| {
                let mut counters = self.stats.client(id);
                let shared_hits = self.table.connection_hits(c.bit);
                counters.hits += shared_hits;
                totals.hits += shared_hits;
                ClientStats {
                    id,
                    name: c.name.clone(),
                    pid: c.pid,
                    counters,
                    hit_rate: counters.hit_rate(),
                    leases_held: usage.leases_by_bit[c.bit],
                    fills_in_flight: self.fills.count_of(id),
                }
            })
            .collect();
        clients.sort_by_key(|c| c.id);
        StatsReport {
            server_pid,
            store_id: self.store_id,
            uptime_s: self.stats.uptime_s(),
            cap_bytes: self.arena.cap(),
            bytes_used: usage.bytes_used,
            bytes_live: usage.bytes_live,
            bytes_carved: self.arena.carved_bytes(),
            reserved_bytes: self.reservations.reserved_bytes(),
            reserve_refusals: self.reservations.refusals(),
            metadata_bytes: self.table.layout().meta_bytes(),
            slot_entries: self.table.slots(),
            pinned_bytes: usage.pinned_bytes,
            records: self.index.len(),
            evictions: self.stats.evictions(),
            fills_in_flight: self.fills.len(),
            leases_held: usage.leases_held,
            totals,
            hit_rate: totals.hit_rate(),
            fill_latency_ms: self.stats.fill_latency(),
            classes,
            clients,
        }
    }

    /// One class's figures, with its bytes and leases added to `usage`.
    fn class_stats(&self, class: ClassView<'_>, usage: &mut Usage) -> ClassStats {
        let mut cs = ClassStats {
            slot_bytes: class.slot_bytes,
            slots: class.slots.len(),
            ready: 0,
            pinned: 0,
            filling: 0,
        };
        for &slot in class.slots {
            match self.arena.slot_use(slot) {
                SlotUse::Free => {}
                SlotUse::Filling { len } => {
                    cs.filling += 1;
                    usage.bytes_live += len;
                }
                SlotUse::Ready { len, .. } => {
                    cs.ready += 1;
                    usage.bytes_live += len;
                    let pins = self.table.pin_count(slot) as usize;
                    if pins > 0 {
                        cs.pinned += 1;
                        usage.leases_held += pins;
                        for (_, c) in self.connections.iter() {
                            if self.table.is_pinned_by(slot, c.bit) {
                                usage.leases_by_bit[c.bit] += 1;
                            }
                        }
                    }
                }
            }
        }
        usage.bytes_used += (cs.ready + cs.filling) as u64 * class.slot_bytes;
        usage.pinned_bytes += cs.pinned as u64 * class.slot_bytes;
        cs
    }
}
