//! Live statistics of the cache server: totals, per slot class and per client, in
//! one serializable report that `vrtspike cache stats` prints as a table or JSON.
//! Plain data: the protocol carries it, the store fills it in; it depends on
//! neither (only on the counts a pin page holds).

use std::collections::VecDeque;
use std::fmt;

use serde::{Deserialize, Serialize};

use super::ids::ClientId;
use super::pins::PageCounts;

/// Counters kept per client and in total.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    /// Gets and peeks answered from the cache.
    pub hits: u64,
    /// Gets that found nothing and gave a fill ticket.
    pub misses: u64,
    /// Gets that waited for another client's fill of the same key.
    pub waits: u64,
    /// Fills committed.
    pub fills: u64,
    /// Fills aborted or abandoned by a disconnect.
    pub fills_abandoned: u64,
    /// Bytes committed by fills.
    pub bytes_filled: u64,
    /// Requests refused with an error.
    pub errors: u64,
    /// Requests served over the control channel (hits pinned in shared memory
    /// send none).
    #[serde(default)]
    pub requests: u64,
    /// Cached records whose layout (header) was not what their reader expected:
    /// the reader read them from disk instead (counted by the reader in its pin
    /// page).
    #[serde(default)]
    pub layout_mismatches: u64,
}

impl Counters {
    /// Adds what a client counted in its pin page (see [`PageCounts`]).
    pub fn add_page(&mut self, page: PageCounts) {
        self.hits += page.hits;
        self.layout_mismatches += page.layout_mismatches;
    }

    /// hits / (hits + misses), 0 when there was no lookup.
    pub fn hit_rate(&self) -> f64 {
        let lookups = self.hits + self.misses;
        if lookups == 0 {
            0.0
        } else {
            self.hits as f64 / lookups as f64
        }
    }
}

/// The planned policy's figures: the read orders the readers announced (see the
/// store's `read_order`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadOrderStats {
    /// Read orders live now (one per rank loader that announced its order).
    pub live: usize,
    /// Announced uses not used up yet, over every read order.
    pub pending_uses: usize,
    /// Bytes the read orders hold in the server.
    #[serde(default)]
    pub bytes: u64,
    /// What they may hold (`cache serve --read-order-budget`).
    #[serde(default)]
    pub budget_bytes: u64,
    /// Read orders announced since the server started.
    pub announced: u64,
    /// Records brought in ahead of their use.
    pub prefetched: u64,
    /// Prefetches declined: room only by evicting a record needed sooner.
    pub prefetch_declined: u64,
    /// Reads of records no read order names that got no room (everything evictable was
    /// needed by a read order) and were read without the cache.
    pub unannounced_declined: u64,
}

/// One client's view.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClientStats {
    /// Connection id.
    pub id: ClientId,
    /// Label the client gave.
    pub name: String,
    /// Its process id.
    pub pid: u32,
    /// Its counters.
    pub counters: Counters,
    /// hits / (hits + misses).
    pub hit_rate: f64,
    /// Leases it holds now.
    pub leases_held: usize,
    /// Fills it has in flight now.
    pub fills_in_flight: usize,
    /// The job it said it belongs to (`""`: none).
    #[serde(default)]
    pub job: String,
}

/// One job's view: every client that named it, past and present
/// (`DATA.CACHE_SHARING: node` puts several jobs on one server).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JobStats {
    /// The job as its clients name it (the run directory; `""`: clients that
    /// named none).
    pub job: String,
    /// Its clients connected now.
    pub clients: usize,
    /// Its counters over all its clients, past and present.
    pub counters: Counters,
    /// hits / (hits + misses).
    pub hit_rate: f64,
    /// Leases its clients hold now.
    pub leases_held: usize,
}

/// Fill latency (miss to commit) over the recent fills, in milliseconds.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct LatencyMs {
    /// Fills in the window.
    pub count: usize,
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest.
    pub max: f64,
}

/// A window of recent latencies.
#[derive(Debug, Default)]
pub struct LatencyWindow {
    samples: VecDeque<f64>,
}

impl LatencyWindow {
    const CAPACITY: usize = 4096;

    /// Records one latency in milliseconds.
    pub fn push(&mut self, ms: f64) {
        if self.samples.len() == Self::CAPACITY {
            self.samples.pop_front();
        }
        self.samples.push_back(ms);
    }

    /// Summary of the window.
    pub fn summary(&self) -> LatencyMs {
        let mut sorted: Vec<f64> = self.samples.iter().copied().collect();
        sorted.sort_by(f64::total_cmp);
        summarize_sorted(&sorted)
    }
}

/// Mean and percentiles of ascending samples (zeros when empty).
pub fn summarize_sorted(sorted: &[f64]) -> LatencyMs {
    if sorted.is_empty() {
        return LatencyMs::default();
    }
    LatencyMs {
        count: sorted.len(),
        mean: sorted.iter().sum::<f64>() / sorted.len() as f64,
        p50: percentile(sorted, 0.50),
        p99: percentile(sorted, 0.99),
        max: sorted[sorted.len() - 1],
    }
}

/// Nearest-rank percentile of ascending samples; `q` in [0, 1].
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Everything the server reports.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StatsReport {
    /// The server's process id.
    pub server_pid: u32,
    /// Id of the store.
    pub store_id: u64,
    /// Seconds since the server started.
    pub uptime_s: f64,
    /// Byte cap (the store's size).
    pub cap_bytes: u64,
    /// Bytes of extents holding or being filled with records (whole pages).
    pub bytes_used: u64,
    /// Bytes of the records themselves (committed and being filled): `bytes_used`
    /// less the rounding of each to whole pages.
    #[serde(default)]
    pub bytes_live: u64,
    /// Bytes carved from the store so far (their memory is reserved).
    pub bytes_carved: u64,
    /// Carved bytes that hold no record: the fragmentation, with `free_extents`.
    #[serde(default)]
    pub free_bytes: u64,
    /// Free extents of the carved bytes.
    #[serde(default)]
    pub free_extents: usize,
    /// The largest free extent.
    #[serde(default)]
    pub largest_free: u64,
    /// Bytes of memory reserved under the store: the carved slots and the metadata
    /// (the store takes memory as slots are carved, up to the cap).
    #[serde(default)]
    pub reserved_bytes: u64,
    /// Carvings refused because the machine had no memory to reserve for them.
    #[serde(default)]
    pub reserve_refusals: u64,
    /// Records refused because no room could be freed (everything that would have
    /// to go was pinned or being filled): their readers bypass the cache.
    #[serde(default)]
    pub full_refusals: u64,
    /// Bytes of shared metadata (descriptors, index, pin pages) beyond the cap.
    #[serde(default)]
    pub metadata_bytes: u64,
    /// Record descriptors (the most records the store can hold at once).
    #[serde(default)]
    pub slot_entries: usize,
    /// Pin pages: the most connections served at once (`--connections`,
    /// `DATA.CACHE_CONNECTIONS`).
    #[serde(default)]
    pub connections: usize,
    /// Bytes of records with at least one lease.
    pub pinned_bytes: u64,
    /// Bytes of records being filled.
    #[serde(default)]
    pub filling_bytes: u64,
    /// Committed records.
    pub records: usize,
    /// Records evicted to make room.
    pub evictions: u64,
    /// Fills in flight.
    pub fills_in_flight: usize,
    /// Leases held, all clients (retired connections' included).
    pub leases_held: usize,
    /// Connections that ended while their client still runs: their leases pin
    /// until it closes its connection.
    #[serde(default)]
    pub retired_connections: usize,
    /// Totals over all clients, past and present.
    pub totals: Counters,
    /// hits / (hits + misses) over all clients.
    pub hit_rate: f64,
    /// Fill latency, recent fills.
    pub fill_latency_ms: LatencyMs,
    /// The planned policy.
    #[serde(default)]
    pub read_orders: ReadOrderStats,
    /// Connected clients.
    pub clients: Vec<ClientStats>,
    /// Per job, the jobs with a client now first, then the ended ones kept.
    #[serde(default)]
    pub jobs: Vec<JobStats>,
}

impl fmt::Display for StatsReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let t = &self.totals;
        writeln!(
            f,
            "cache server pid {}  store {:#x}  up {:.1} s",
            self.server_pid, self.store_id, self.uptime_s
        )?;
        writeln!(
            f,
            "bytes used {:.3} / reserved {:.3} / cap {:.3} GiB ({:.1}% used)  pinned {:.3} GiB  records {}",
            gib(self.bytes_used),
            gib(self.reserved_bytes),
            gib(self.cap_bytes),
            100.0 * self.bytes_used as f64 / self.cap_bytes.max(1) as f64,
            gib(self.pinned_bytes),
            self.records
        )?;
        writeln!(
            f,
            "records {:.3} GiB in {:.3} GiB of extents; free {:.3} GiB in {} extents (largest {:.3} GiB)",
            gib(self.bytes_live),
            gib(self.bytes_used),
            gib(self.free_bytes),
            self.free_extents,
            gib(self.largest_free)
        )?;
        if self.reserve_refusals + self.full_refusals > 0 {
            writeln!(
                f,
                "refused: {} for no memory on the node, {} for no room (pinned or filling)",
                self.reserve_refusals, self.full_refusals
            )?;
        }
        writeln!(
            f,
            "metadata {:.1} MiB for {} record descriptors and {} connections  requests {}",
            self.metadata_bytes as f64 / (1u64 << 20) as f64,
            self.slot_entries,
            self.connections,
            t.requests
        )?;
        writeln!(
            f,
            "hits {}  misses {}  hit rate {:.2}%  waits {}  evictions {}  errors {}  layout mismatches {}",
            t.hits,
            t.misses,
            100.0 * self.hit_rate,
            t.waits,
            self.evictions,
            t.errors,
            t.layout_mismatches
        )?;
        let l = &self.fill_latency_ms;
        writeln!(
            f,
            "fills {} (abandoned {}, in flight {})  fill latency ms: mean {:.2} p50 {:.2} p99 {:.2} max {:.2}",
            t.fills, t.fills_abandoned, self.fills_in_flight, l.mean, l.p50, l.p99, l.max
        )?;
        let p = &self.read_orders;
        let mib = |b: u64| b as f64 / f64::from(1u32 << 20);
        if p.live > 0 || p.announced > 0 {
            writeln!(
                f,
                "read orders {} ({} announced, {} uses pending, {:.1} of {:.1} MiB)  prefetched {}  declined: {} prefetches, {} unannounced reads",
                p.live, p.announced, p.pending_uses, mib(p.bytes), mib(p.budget_bytes), p.prefetched, p.prefetch_declined, p.unannounced_declined
            )?;
        }
        if self.retired_connections > 0 {
            writeln!(
                f,
                "retired connections (their clients still hold leases): {}",
                self.retired_connections
            )?;
        }
        if self.jobs.iter().any(|j| !j.job.is_empty()) {
            writeln!(
                f,
                "{:>7} {:>10} {:>10} {:>8} {:>12} {:>7}  job",
                "clients", "hits", "misses", "hit%", "MiB filled", "leases"
            )?;
            for j in &self.jobs {
                writeln!(
                    f,
                    "{:>7} {:>10} {:>10} {:>7.2}% {:>12.1} {:>7}  {}",
                    j.clients,
                    j.counters.hits,
                    j.counters.misses,
                    100.0 * j.hit_rate,
                    j.counters.bytes_filled as f64 / (1u64 << 20) as f64,
                    j.leases_held,
                    if j.job.is_empty() {
                        "(no job named)"
                    } else {
                        &j.job
                    }
                )?;
            }
        }
        if !self.clients.is_empty() {
            writeln!(
                f,
                "{:>5} {:>8} {:<24} {:>10} {:>10} {:>8} {:>7} {:>6}",
                "id", "pid", "client", "hits", "misses", "hit%", "leases", "fills"
            )?;
            for c in &self.clients {
                writeln!(
                    f,
                    "{:>5} {:>8} {:<24} {:>10} {:>10} {:>7.2}% {:>7} {:>6}",
                    c.id,
                    c.pid,
                    c.name,
                    c.counters.hits,
                    c.counters.misses,
                    100.0 * c.hit_rate,
                    c.leases_held,
                    c.fills_in_flight
                )?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_by_nearest_rank() {
        let sorted: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&sorted, 0.5), 50.0);
        assert_eq!(percentile(&sorted, 0.99), 99.0);
        assert_eq!(percentile(&sorted, 1.0), 100.0);
        assert_eq!(percentile(&[], 0.5), 0.0);
    }

    #[test]
    fn window_keeps_the_most_recent() {
        let mut w = LatencyWindow::default();
        for i in 0..(LatencyWindow::CAPACITY + 10) {
            w.push(i as f64);
        }
        let s = w.summary();
        assert_eq!(s.count, LatencyWindow::CAPACITY);
        assert_eq!(s.max, (LatencyWindow::CAPACITY + 9) as f64);
    }

    #[test]
    fn hit_rate_of_nothing_is_zero() {
        assert_eq!(Counters::default().hit_rate(), 0.0);
        let c = Counters {
            hits: 3,
            misses: 1,
            ..Counters::default()
        };
        assert_eq!(c.hit_rate(), 0.75);
    }
}
