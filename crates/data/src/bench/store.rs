//! `vrtspike bench store`: the store's eviction at a node's scale, in one process
//! on a simulated clock (the store itself, no server): 12,000 records of mixed
//! sizes fill the cap; 24 read orders (3 jobs of 8 ranks, at 1, 2 and 3 steps a
//! second) of 100,000 records each are announced, then every rank reads its order
//! in time order. It reports what a reserve costs once the store is full (every
//! miss then evicts: p50, p99, max), what announcing costs, and what the read
//! orders hold per record they name.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::atomic::Ordering;
use std::time::Instant;

use serde::Serialize;

use super::histogram::Histogram;
use crate::cache::protocol::ReadOrderAnnouncement;
use crate::cache::store::pace::Clock;
use crate::cache::store::{ClientLabel, GetOutcome, Store};
use crate::cache::RequestError;
use crate::util::rng::SplitMix64;

/// What to run.
#[derive(Debug, Clone, Copy)]
pub struct StoreBenchOptions {
    /// Records the cap holds (of the mixed sizes, on average).
    pub slots: usize,
    /// Jobs, each at its own rate: job `j` takes `j + 1` steps a second.
    pub jobs: usize,
    /// Ranks (read orders) per job.
    pub ranks_per_job: usize,
    /// Records each read order names (one a step, a shuffled order of them all).
    pub keys: usize,
    /// Reads in all.
    pub reads: usize,
    /// Seed of the orders.
    pub seed: u64,
}

impl Default for StoreBenchOptions {
    fn default() -> Self {
        StoreBenchOptions {
            slots: 12_000,
            jobs: 3,
            ranks_per_job: 8,
            keys: 100_000,
            reads: 400_000,
            seed: 0,
        }
    }
}

/// Percentiles of a time, microseconds.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Micros {
    /// Samples.
    pub count: u64,
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest.
    pub max: f64,
}

impl From<&Histogram> for Micros {
    fn from(h: &Histogram) -> Micros {
        Micros {
            count: h.count(),
            p50: h.percentile(0.5),
            p99: h.percentile(0.99),
            max: h.max(),
        }
    }
}

/// The figures.
#[derive(Debug, Clone, Serialize)]
pub struct StoreBenchReport {
    /// `"vrtspike-store-eviction"`.
    pub bench: &'static str,
    /// Records the cap holds on average.
    pub slots: usize,
    /// The cap, bytes.
    pub cap_bytes: u64,
    /// Record sizes, pages of 4 KiB.
    pub record_pages: Vec<u64>,
    /// Read orders live.
    pub read_orders: usize,
    /// Records each names.
    pub keys_per_order: usize,
    /// A reserve once the store is full (each evicts).
    pub reserve_when_full_us: Micros,
    /// One read order's announcement.
    pub announce_ms: Micros,
    /// What the read orders hold, bytes.
    pub read_order_bytes: u64,
    /// The same per record named by a read order.
    pub bytes_per_order_key: f64,
    /// Reads that hit.
    pub hit_rate: f64,
    /// Evictions.
    pub evictions: u64,
}

/// Record `i`'s size in pages: 1, 2 or 4.
fn pages_of(i: usize) -> u64 {
    [1, 2, 4][i % 3]
}

/// One rank: its connection (announcer and reader), pin page, job and order.
struct Rank {
    client: u64,
    page: usize,
    rate: f64,
    order: Vec<u32>,
}

/// Runs it.
pub fn run(options: StoreBenchOptions) -> Result<StoreBenchReport, RequestError> {
    let page = 4096u64;
    let mean_pages = (1 + 2 + 4) as f64 / 3.0;
    let cap = (options.slots as f64 * mean_pages) as u64 * page;
    let mut store = Store::on_heap(1, cap, Some(page));
    let (clock, now) = Clock::manual();
    store.set_clock(clock);
    store.set_read_order_budget(u64::MAX);
    let keys: Vec<String> = (0..options.keys)
        .map(|i| format!("seq{:03}/{i:07}", i % 997))
        .collect();
    let mut rng = SplitMix64::new(options.seed);
    let mut ranks = Vec::new();
    let mut announce = Histogram::default();
    for job in 0..options.jobs {
        for rank in 0..options.ranks_per_job {
            let label = ClientLabel {
                name: format!("job {job} rank {rank}"),
                job: format!("job{job}"),
                pid: 1,
                uid: 0,
            };
            let (client, page) = store.connect_as(label)?;
            let mut order: Vec<u32> = (0..options.keys as u32).collect();
            for i in (1..order.len()).rev() {
                order.swap(i, rng.below(i as u64 + 1) as usize);
            }
            let announcement = ReadOrderAnnouncement {
                first_step: 0,
                keys: keys.clone(),
                steps: order.iter().map(|&k| vec![k]).collect(),
                readers: vec![client],
            };
            let started = Instant::now();
            store.announce_read_order(client, announcement)?;
            announce.record(started.elapsed().as_secs_f64() * 1e6 / 1e3);
            ranks.push(Rank {
                client,
                page,
                rate: (job + 1) as f64,
                order,
            });
        }
    }
    // Every rank's next read, soonest first: (time in us, rank, step).
    let mut due: BinaryHeap<Reverse<(u64, usize, usize)>> =
        (0..ranks.len()).map(|r| Reverse((0, r, 0))).collect();
    let mut reserve = Histogram::default();
    let (mut hits, mut reads, mut filled) = (0u64, 0usize, 0u64);
    while reads < options.reads {
        let Some(Reverse((at, r, step))) = due.pop() else {
            break;
        };
        let rank = &ranks[r];
        if step >= rank.order.len() {
            continue;
        }
        now.store(at, Ordering::Relaxed);
        store.pin_page(rank.page).set_progress(step as u64);
        let key_index = rank.order[step] as usize;
        let key = &keys[key_index];
        let len = pages_of(key_index) * page;
        match store.get(rank.client, key)? {
            GetOutcome::Hit(grant) => {
                hits += 1;
                store.release(rank.client, grant.lease)?;
            }
            GetOutcome::Miss(ticket) => {
                let full = filled >= cap;
                let started = Instant::now();
                store.reserve(rank.client, ticket, len)?;
                if full {
                    reserve.record(started.elapsed().as_secs_f64() * 1e6);
                }
                filled += len;
                let grant = store.commit(rank.client, ticket)?;
                store.release(rank.client, grant.lease)?;
            }
            GetOutcome::Wait { .. } => {}
        }
        reads += 1;
        let next = ((step + 1) as f64 / rank.rate * 1e6) as u64;
        due.push(Reverse((next, r, step + 1)));
    }
    let stats = store.stats(std::process::id());
    let orders = ranks.len();
    Ok(StoreBenchReport {
        bench: "vrtspike-store-eviction",
        slots: options.slots,
        cap_bytes: cap,
        record_pages: vec![1, 2, 4],
        read_orders: orders,
        keys_per_order: options.keys,
        reserve_when_full_us: Micros::from(&reserve),
        announce_ms: Micros::from(&announce),
        read_order_bytes: stats.read_orders.bytes,
        bytes_per_order_key: stats.read_orders.bytes as f64 / (orders * options.keys).max(1) as f64,
        hit_rate: hits as f64 / reads.max(1) as f64,
        evictions: stats.evictions,
    })
}

impl std::fmt::Display for StoreBenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let r = &self.reserve_when_full_us;
        let a = &self.announce_ms;
        writeln!(
            f,
            "store of {} records of 1, 2 and 4 pages ({:.1} MiB), {} read orders of {} records",
            self.slots,
            self.cap_bytes as f64 / f64::from(1u32 << 20),
            self.read_orders,
            self.keys_per_order
        )?;
        writeln!(
            f,
            "reserve when full: p50 {:.1} us  p99 {:.1} us  max {:.1} us  ({} reserves, {} evictions)",
            r.p50, r.p99, r.max, r.count, self.evictions
        )?;
        writeln!(
            f,
            "announcing one read order: p50 {:.1} ms  max {:.1} ms",
            a.p50, a.max
        )?;
        write!(
            f,
            "read orders hold {:.1} MiB: {:.1} bytes per record named; hit rate {:.3}",
            self.read_order_bytes as f64 / f64::from(1u32 << 20),
            self.bytes_per_order_key,
            self.hit_rate
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_run_fills_evicts_and_reports() {
        let report = run(StoreBenchOptions {
            slots: 300,
            jobs: 2,
            ranks_per_job: 2,
            keys: 2000,
            reads: 6000,
            seed: 1,
        })
        .unwrap();
        assert!(report.evictions > 0, "{report}");
        assert!(report.reserve_when_full_us.count > 0);
        assert!(report.hit_rate > 0.0 && report.hit_rate < 1.0, "{report}");
        assert!(
            (20.0..200.0).contains(&report.bytes_per_order_key),
            "{report}"
        );
    }
}
