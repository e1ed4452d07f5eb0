//! The store's stats report: the figures of its parts, plus what clients did in
//! their pin pages without a message (leases, hits, layout mismatches), read from
//! there.

use std::collections::HashMap;

use super::super::stats::{ClientStats, JobStats, StatsReport};
use super::arena::SlotUse;
use super::Store;

/// Bytes and leases over all records.
#[derive(Debug, Default)]
struct Usage {
    bytes_used: u64,
    bytes_live: u64,
    pinned_bytes: u64,
    filling_bytes: u64,
}

impl Store {
    /// A snapshot of every counter; leases and hits that clients hold and count in
    /// their pin pages are read from there.
    pub fn stats(&self, server_pid: u32) -> StatsReport {
        let leases = self.leases_by_slot();
        let usage = self.usage(&leases);
        let mut totals = self.stats.totals();
        let mut clients: Vec<ClientStats> = self
            .connections
            .iter()
            .map(|(id, c)| {
                let page = self.pins.page(c.page);
                let mut counters = self.stats.client(id);
                let shared = page.counts();
                counters.add_page(shared);
                totals.add_page(shared);
                ClientStats {
                    id,
                    name: c.who.name.clone(),
                    pid: c.who.pid,
                    counters,
                    hit_rate: counters.hit_rate(),
                    leases_held: page.lease_count(),
                    fills_in_flight: self.fills.count_of(id),
                    job: c.who.job.clone(),
                }
            })
            .collect();
        clients.sort_by_key(|c| c.id);
        let jobs = self.job_stats(&clients);
        let free = self.arena.free_space();
        StatsReport {
            server_pid,
            store_id: self.store_id,
            uptime_s: self.stats.uptime_s(),
            cap_bytes: self.arena.cap(),
            bytes_used: usage.bytes_used,
            bytes_live: usage.bytes_live,
            bytes_carved: self.arena.carved(),
            free_bytes: free.bytes,
            free_extents: free.extents,
            largest_free: free.largest,
            reserved_bytes: self.reservations.reserved_bytes(),
            reserve_refusals: self.reservations.refusals(),
            full_refusals: self.stats.full_refusals(),
            metadata_bytes: self.table.layout().meta_bytes() + self.table.layout().pins_bytes(),
            slot_entries: self.table.slots(),
            connections: self.table.layout().connections,
            pinned_bytes: usage.pinned_bytes,
            filling_bytes: usage.filling_bytes,
            records: self.index.len(),
            evictions: self.stats.evictions(),
            fills_in_flight: self.fills.len(),
            leases_held: leases.values().sum(),
            retired_connections: self.connections.retired(),
            totals,
            hit_rate: totals.hit_rate(),
            fill_latency_ms: self.stats.fill_latency(),
            read_orders: self.read_orders.stats(),
            clients,
            jobs,
        }
    }

    /// Each job's counters, with what its connected `clients` count in shared
    /// memory and hold now; jobs with a client first, then by name.
    fn job_stats(&self, clients: &[ClientStats]) -> Vec<JobStats> {
        let mut jobs: Vec<JobStats> = self
            .stats
            .jobs()
            .iter()
            .map(|(job, counters)| JobStats {
                job: job.to_string(),
                clients: 0,
                counters: *counters,
                hit_rate: 0.0,
                leases_held: 0,
            })
            .collect();
        for client in clients {
            let Some(job) = jobs.iter_mut().find(|j| j.job == client.job) else {
                continue;
            };
            let own = self.stats.client(client.id);
            job.clients += 1;
            job.counters.hits += client.counters.hits - own.hits;
            job.counters.layout_mismatches +=
                client.counters.layout_mismatches - own.layout_mismatches;
            job.leases_held += client.leases_held;
        }
        for job in &mut jobs {
            job.hit_rate = job.counters.hit_rate();
        }
        jobs.sort_by(|a, b| (a.clients == 0, &a.job).cmp(&(b.clients == 0, &b.job)));
        jobs
    }

    /// Leases per slot over every live connection's page.
    fn leases_by_slot(&self) -> HashMap<usize, usize> {
        let mut leases = HashMap::new();
        for page in self.connections.live_pages() {
            for lease in self.pins.page(page).leases() {
                if let Some(slot) = lease.slot() {
                    *leases.entry(slot).or_insert(0) += 1;
                }
            }
        }
        leases
    }

    fn usage(&self, leases: &HashMap<usize, usize>) -> Usage {
        let mut usage = Usage::default();
        for (slot, used, extent) in self.arena.in_use() {
            usage.bytes_used += extent;
            match used {
                SlotUse::Free => {}
                SlotUse::Filling { len } => {
                    usage.bytes_live += len;
                    usage.filling_bytes += extent;
                }
                SlotUse::Ready { len, .. } => {
                    usage.bytes_live += len;
                    if leases.contains_key(&slot) {
                        usage.pinned_bytes += extent;
                    }
                }
            }
        }
        usage
    }
}
