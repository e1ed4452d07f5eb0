//! The store's counters: per client and in total, evictions, refusals and fill
//! latency. Hits that clients take in shared memory (and the layout mismatches they
//! find) are counted there, in their pin pages; they are added in here when a report is made and folded into the totals
//! when their client disconnects.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::super::ids::ClientId;
use super::super::pins::PageCounts;
use super::super::stats::{Counters, LatencyMs, LatencyWindow};

/// Something the store counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// A request served over the control channel.
    Request,
    /// A request refused.
    Error,
    /// A get or peek answered from the cache by the server.
    Hit,
    /// A get that gave a fill ticket.
    Miss,
    /// A get that waits for another client's fill.
    Wait,
    /// A fill committed `bytes` bytes.
    Fill {
        /// The record's length.
        bytes: u64,
    },
    /// A fill aborted or abandoned.
    FillAbandoned,
}

impl Event {
    fn add_to(self, c: &mut Counters) {
        match self {
            Event::Request => c.requests += 1,
            Event::Error => c.errors += 1,
            Event::Hit => c.hits += 1,
            Event::Miss => c.misses += 1,
            Event::Wait => c.waits += 1,
            Event::Fill { bytes } => {
                c.fills += 1;
                c.bytes_filled += bytes;
            }
            Event::FillAbandoned => c.fills_abandoned += 1,
        }
    }
}

/// Counters of the store and of each connected client.
#[derive(Debug)]
pub struct StoreStats {
    totals: Counters,
    per_client: HashMap<ClientId, Counters>,
    /// Each job's counters over its clients past and present (see [`Jobs`]).
    jobs: Jobs,
    evictions: u64,
    /// Reservations refused because no stretch of the store could be freed.
    refused_full: u64,
    fill_latency: LatencyWindow,
    started: Instant,
}

impl Default for StoreStats {
    fn default() -> Self {
        StoreStats::new()
    }
}

impl StoreStats {
    /// All zero, started now.
    pub fn new() -> StoreStats {
        StoreStats {
            totals: Counters::default(),
            per_client: HashMap::new(),
            jobs: Jobs::default(),
            evictions: 0,
            refused_full: 0,
            fill_latency: LatencyWindow::default(),
            started: Instant::now(),
        }
    }

    /// Starts counting for a new client of `job` (`""`: it named none).
    pub fn connected(&mut self, client: ClientId, job: &str) {
        self.per_client.insert(client, Counters::default());
        self.jobs.joined(client, job);
    }

    /// Stops counting for a client, folding what it counted in shared memory
    /// into the totals and its job's.
    pub fn disconnected(&mut self, client: ClientId, shared: PageCounts) {
        self.per_client.remove(&client);
        self.totals.add_page(shared);
        if let Some(job) = self.jobs.left(client) {
            job.add_page(shared);
        }
    }

    /// Counts `event` in the totals and, if it is connected, for `client` and its
    /// job.
    pub fn count(&mut self, client: ClientId, event: Event) {
        event.add_to(&mut self.totals);
        if let Some(c) = self.per_client.get_mut(&client) {
            event.add_to(c);
        }
        if let Some(job) = self.jobs.of_client(client) {
            event.add_to(job);
        }
    }

    /// Each job's counters over its past and present clients (without the
    /// shared-memory hits of the connected ones), and the job of each connected
    /// client.
    pub fn jobs(&self) -> &Jobs {
        &self.jobs
    }

    /// Counts a committed fill of `bytes` that took `latency` from miss to commit.
    pub fn fill_committed(&mut self, client: ClientId, bytes: u64, latency: Duration) {
        self.count(client, Event::Fill { bytes });
        self.fill_latency.push(latency.as_secs_f64() * 1e3);
    }

    /// Counts an eviction.
    pub fn evicted(&mut self) {
        self.evictions += 1;
    }

    /// Counts a reservation refused because the store could free no room.
    pub fn refused_full(&mut self) {
        self.refused_full += 1;
    }

    /// Reservations refused because the store could free no room.
    pub fn full_refusals(&self) -> u64 {
        self.refused_full
    }

    /// The totals over all clients, past and present (without the shared-memory
    /// hits of connected clients).
    pub fn totals(&self) -> Counters {
        self.totals
    }

    /// A connected client's counters (zero if unknown; without its shared-memory hits).
    pub fn client(&self, client: ClientId) -> Counters {
        self.per_client.get(&client).copied().unwrap_or_default()
    }

    /// Records evicted so far.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Fill latency over the recent fills.
    pub fn fill_latency(&self) -> LatencyMs {
        self.fill_latency.summary()
    }

    /// Seconds since the store started.
    pub fn uptime_s(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }
}

/// The jobs whose clients share the server (`DATA.CACHE_SHARING: node`): a job
/// is the label its clients give in their hello (the run directory). Jobs with no
/// client left are kept for their figures, the oldest dropped past
/// [`Jobs::MAX_ENDED`].
#[derive(Debug, Default)]
pub struct Jobs {
    counters: HashMap<String, Counters>,
    of_client: HashMap<ClientId, String>,
    /// Jobs with no connected client, the one that ended first at the front.
    ended: std::collections::VecDeque<String>,
}

impl Jobs {
    /// Ended jobs whose figures are kept.
    pub const MAX_ENDED: usize = 64;

    fn joined(&mut self, client: ClientId, job: &str) {
        self.ended.retain(|j| j != job);
        self.counters.entry(job.to_string()).or_default();
        self.of_client.insert(client, job.to_string());
    }

    /// Client `client` left: its job's counters, to fold what it counted in.
    fn left(&mut self, client: ClientId) -> Option<&mut Counters> {
        let job = self.of_client.remove(&client)?;
        if !self.of_client.values().any(|j| *j == job) {
            self.ended.push_back(job.clone());
            while self.ended.len() > Self::MAX_ENDED {
                if let Some(old) = self.ended.pop_front() {
                    self.counters.remove(&old);
                }
            }
        }
        self.counters.get_mut(&job)
    }

    fn of_client(&mut self, client: ClientId) -> Option<&mut Counters> {
        let job = self.of_client.get(&client)?;
        self.counters.get_mut(job)
    }

    /// The job of connected client `client`.
    #[cfg(test)]
    fn job_of(&self, client: ClientId) -> Option<&str> {
        self.of_client.get(&client).map(String::as_str)
    }

    /// Every job kept, with its counters.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Counters)> + '_ {
        self.counters.iter().map(|(j, c)| (j.as_str(), c))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_count_in_the_totals_and_for_connected_clients_only() {
        let mut stats = StoreStats::new();
        stats.connected(1, "job a");
        stats.count(1, Event::Hit);
        stats.count(1, Event::Miss);
        stats.count(2, Event::Error); // not connected: totals only
        stats.fill_committed(1, 100, Duration::from_millis(3));
        let mine = stats.client(1);
        assert_eq!((mine.hits, mine.misses, mine.errors), (1, 1, 0));
        assert_eq!((mine.fills, mine.bytes_filled), (1, 100));
        let totals = stats.totals();
        assert_eq!((totals.hits, totals.errors, totals.fills), (1, 1, 1));
        assert_eq!(stats.fill_latency().count, 1);
        assert!((stats.fill_latency().max - 3.0).abs() < 1e-9);
    }

    /// What a pin page with `n` hits and nothing else counted holds.
    fn hits(n: u64) -> PageCounts {
        PageCounts {
            hits: n,
            layout_mismatches: 0,
        }
    }

    #[test]
    fn a_disconnect_keeps_the_totals_and_adds_the_shared_hits() {
        let mut stats = StoreStats::new();
        stats.connected(1, "job a");
        stats.count(1, Event::Wait);
        stats.count(1, Event::FillAbandoned);
        stats.disconnected(1, hits(5));
        stats.count(1, Event::FillAbandoned);
        assert_eq!(stats.client(1), Counters::default());
        let totals = stats.totals();
        assert_eq!(
            (totals.hits, totals.waits, totals.fills_abandoned),
            (5, 1, 2)
        );
        stats.connected(2, "job a");
        let shared = PageCounts {
            hits: 3,
            layout_mismatches: 2,
        };
        stats.disconnected(2, shared);
        let totals = stats.totals();
        assert_eq!((totals.hits, totals.layout_mismatches), (8, 2));
        let job = stats.jobs().iter().find(|(j, _)| *j == "job a");
        assert_eq!(job.map(|(_, c)| c.layout_mismatches), Some(2));
        stats.evicted();
        assert_eq!(stats.evictions(), 1);
    }

    #[test]
    fn a_jobs_counters_outlive_its_clients_and_old_ended_jobs_go() {
        let mut stats = StoreStats::new();
        stats.connected(1, "a");
        stats.connected(2, "a");
        stats.connected(3, "b");
        stats.count(1, Event::Miss);
        stats.fill_committed(2, 10, Duration::from_millis(1));
        stats.count(3, Event::Hit);
        stats.disconnected(1, hits(4));
        stats.disconnected(2, hits(0));
        let jobs: HashMap<&str, Counters> = stats.jobs().iter().map(|(j, c)| (j, *c)).collect();
        let a = jobs["a"];
        assert_eq!((a.hits, a.misses, a.fills, a.bytes_filled), (4, 1, 1, 10));
        assert_eq!(jobs["b"].hits, 1);
        assert_eq!(stats.jobs().job_of(3), Some("b"));
        assert_eq!(stats.jobs().job_of(1), None);
        for n in 0..Jobs::MAX_ENDED as u64 {
            stats.connected(10 + n, &format!("later {n}"));
            stats.disconnected(10 + n, hits(0));
        }
        let kept: Vec<&str> = stats.jobs().iter().map(|(j, _)| j).collect();
        assert!(!kept.contains(&"a"), "the oldest ended job goes: {kept:?}");
        assert!(kept.contains(&"b"), "a job with a client stays: {kept:?}");
        assert_eq!(kept.len(), Jobs::MAX_ENDED + 1);
    }
}
