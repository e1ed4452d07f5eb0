//! `vrtspike bench cache`: a cache server in its own process, several worker
//! processes of several threads doing random gets over more keys than fit (so fills
//! evict), every read checked for tearing; then single-thread crop reads under a
//! lease against a plain memcpy measured in the same run.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use super::histogram::Histogram;
use super::worker::{ProcessError, Worker};
use crate::cache::store::extent_for;
use crate::cache::{CacheClient, CacheError, Lookup, RequestError, StatsReport};
use crate::testkit::process::spawn_cache_server;
use crate::testkit::record::{
    check_rows, copy_crop, template, verify_record, write_record, FrameShape,
};
use crate::util::bytes::human;

/// Errors of the benchmark driver and workers.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// The cache failed.
    #[error(transparent)]
    Cache(#[from] CacheError),
    /// A child process could not be run or failed.
    #[error(transparent)]
    Process(#[from] ProcessError),
    /// Options that cannot work.
    #[error("bad benchmark options: {0}")]
    Options(String),
}

/// What one worker process does.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkerOptions {
    /// The cache server's address.
    pub address: String,
    /// Reader threads in this process.
    pub threads: usize,
    /// Keys drawn uniformly from `0..keys`.
    pub keys: u64,
    /// Seconds to run.
    pub seconds: f64,
    /// Record shape.
    pub height: usize,
    /// Record shape.
    pub width: usize,
    /// Crop side in pixels.
    pub crop: usize,
    /// Seed of this process's key sequence.
    pub seed: u64,
    /// Verify the whole record's checksum on every n-th hit (1: every read).
    pub verify_every: u64,
}

impl WorkerOptions {
    fn shape(&self) -> FrameShape {
        FrameShape::rgb(self.height, self.width)
    }
}

/// What one worker process measured.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub struct WorkerReport {
    /// Gets completed.
    pub ops: u64,
    /// Hits.
    pub hits: u64,
    /// Misses (filled by this worker).
    pub misses: u64,
    /// Fills refused because every slot was pinned.
    pub store_full: u64,
    /// Reads that failed their integrity check.
    pub torn_reads: u64,
    /// Full-record checksum verifications done.
    pub verified: u64,
    /// Latency of gets that hit, µs (found the record cached).
    pub hit_latency: Histogram,
    /// Latency of gets that waited for another client's fill of the key (counted as
    /// hits in `hits`, like the server does, but not in `hit_latency`), µs.
    #[serde(default)]
    pub wait_latency: Histogram,
    /// Latency of the hits that went through the server (it waited for another
    /// client's fill of the key, or an eviction raced with the lookup), µs.
    #[serde(default)]
    pub server_hit_latency: Histogram,
    /// Seconds the threads ran.
    pub elapsed_s: f64,
}

impl WorkerReport {
    fn merge(&mut self, other: &WorkerReport) {
        self.ops += other.ops;
        self.hits += other.hits;
        self.misses += other.misses;
        self.store_full += other.store_full;
        self.torn_reads += other.torn_reads;
        self.verified += other.verified;
        self.hit_latency.merge(&other.hit_latency);
        self.server_hit_latency.merge(&other.server_hit_latency);
        self.wait_latency.merge(&other.wait_latency);
        self.elapsed_s = self.elapsed_s.max(other.elapsed_s);
    }
}

fn key_name(id: u64) -> String {
    format!("bench/{id}")
}

/// One reader thread: random gets; hits are checked and cropped, misses filled.
fn reader_thread(
    opts: &WorkerOptions,
    body: &[u8],
    thread: usize,
) -> Result<WorkerReport, BenchError> {
    let shape = opts.shape();
    let client = CacheClient::connect(&opts.address, &format!("bench-{}-{thread}", opts.seed))?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(opts.seed * 1000 + thread as u64);
    let mut report = WorkerReport::default();
    let mut crop = vec![0u8; opts.crop * opts.crop * 3];
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(opts.seconds);
    while Instant::now() < deadline {
        let id = rng.random_range(0..opts.keys);
        let key = key_name(id);
        let shared_before = client.shared_hits();
        let t0 = Instant::now();
        let lookup = client.get(&key)?;
        let lease = match lookup {
            Lookup::Hit(lease) => {
                let us = t0.elapsed().as_secs_f64() * 1e6;
                if lease.waited_for_fill() {
                    report.wait_latency.record(us);
                } else {
                    report.hit_latency.record(us);
                    if client.shared_hits() == shared_before {
                        report.server_hit_latency.record(us);
                    }
                }
                report.hits += 1;
                lease
            }
            Lookup::Miss(mut ticket) => {
                report.misses += 1;
                match ticket.reserve(shape.record_bytes() as u64) {
                    Ok(()) => {}
                    Err(e) if matches!(e.refusal(), Some(RequestError::StoreFull { .. })) => {
                        report.store_full += 1;
                        continue;
                    }
                    Err(e) => return Err(e.into()),
                }
                let slot = ticket.slot_mut()?;
                write_record(shape, id, body, slot)
                    .map_err(|e| BenchError::Options(format!("record shape: {e}")))?;
                ticket.commit()?
            }
        };
        let y = rng.random_range(0..=shape.height - opts.crop);
        let x = rng.random_range(0..=shape.width - opts.crop);
        let rows_ok = check_rows(shape, id, &lease, y..y + opts.crop);
        copy_crop(shape, &lease, y, x, opts.crop, &mut crop);
        let full_ok = if report.ops % opts.verify_every == 0 {
            report.verified += 1;
            verify_record(shape, id, &lease)
        } else {
            Ok(())
        };
        if let Err(e) = rows_ok.and(full_ok) {
            tracing::error!("torn read of {key}: {e}");
            report.torn_reads += 1;
        }
        drop(lease);
        report.ops += 1;
    }
    report.elapsed_s = started.elapsed().as_secs_f64();
    Ok(report)
}

/// A worker process: `threads` reader threads, reports merged.
pub fn run_worker(opts: &WorkerOptions) -> Result<WorkerReport, BenchError> {
    if opts.crop == 0 || opts.crop > opts.height || opts.crop > opts.width || opts.keys == 0 {
        return Err(BenchError::Options(format!(
            "crop {} must fit {}x{} records and keys must be > 0",
            opts.crop, opts.height, opts.width
        )));
    }
    let body = template(opts.shape());
    let body = &body;
    let results: Vec<Result<WorkerReport, BenchError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..opts.threads)
            .map(|t| scope.spawn(move || reader_thread(opts, body, t)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(BenchError::Options("a reader thread panicked".into())))
            })
            .collect()
    });
    let mut total = WorkerReport::default();
    for result in results {
        total.merge(&result?);
    }
    Ok(total)
}

/// The whole benchmark's settings.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// The `vrtspike` binary that runs the server and workers.
    pub exe: PathBuf,
    /// Worker processes.
    pub processes: usize,
    /// Reader threads per worker process.
    pub threads: usize,
    /// Store size.
    pub cap_bytes: u64,
    /// Keys; 0: 5/4 of what fits.
    pub keys: u64,
    /// Seconds of random gets.
    pub seconds: f64,
    /// Record rows.
    pub height: usize,
    /// Record columns.
    pub width: usize,
    /// Crop side.
    pub crop: usize,
    /// Full checksum every n-th read.
    pub verify_every: u64,
    /// Crops in the single-thread crop-read phase.
    pub crop_reads: usize,
}

/// The figures `vrtspike bench cache --json` prints.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// Median latency of a get that hits (finds the record cached), µs.
    pub hit_p50_us: f64,
    /// 99th percentile of the same.
    pub hit_p99_us: f64,
    /// Largest.
    pub hit_max_us: f64,
    /// Gets that found their key being filled by another client and waited for it
    /// (single flight): hits in `hit_rate`, not in the hit latencies.
    pub waits: u64,
    /// Median latency of those, µs.
    pub wait_p50_us: f64,
    /// 99th percentile of those, µs.
    pub wait_p99_us: f64,
    /// 99th percentile over hits and waits together, µs.
    pub hit_or_wait_p99_us: f64,
    /// Hits that went through the server instead of shared memory.
    pub server_hits: u64,
    /// Median latency of those, µs.
    pub server_hit_p50_us: f64,
    /// 99th percentile of those, µs.
    pub server_hit_p99_us: f64,
    /// Gets per second, all processes and threads.
    pub ops_per_s: f64,
    /// Hits / gets.
    pub hit_rate: f64,
    /// Records the server evicted.
    pub evictions: u64,
    /// Reads that failed their integrity check (must be 0).
    pub torn_reads: u64,
    /// Reads whose whole-record checksum was verified.
    pub verified_reads: u64,
    /// Fills refused because every slot was pinned.
    pub store_full: u64,
    /// 256x256 crop copy out of a leased record, single thread, GB/s, from the median
    /// time of one crop (a crop during which the thread was descheduled does not
    /// count against the copy), with the record's pages mapped in this process.
    pub crop_read_gbps: f64,
    /// The same from the total time of all crops.
    pub crop_read_mean_gbps: f64,
    /// The same including the get and release of the lease, GB/s.
    pub crop_with_lease_gbps: f64,
    /// `crop_read_gbps` of the same crops read first, when this process maps the
    /// records' pages for the first time (the figures above are of the second read).
    pub crop_read_first_touch_gbps: f64,
    /// Plain single-thread memcpy of a 64 MiB buffer, GB/s.
    pub memcpy_gbps: f64,
    /// Worker processes.
    pub processes: usize,
    /// Reader threads per process.
    pub threads: usize,
    /// Keys drawn from.
    pub keys: u64,
    /// Records that fit the store.
    pub slots: u64,
    /// Bytes per record.
    pub record_bytes: u64,
    /// Store size.
    pub cap_bytes: u64,
    /// Seconds of the random-get phase.
    pub seconds: f64,
    /// The server's stats at the end.
    #[serde(skip)]
    pub server: Option<StatsReport>,
}

fn memcpy_gbps() -> f64 {
    let len = 64 << 20;
    let src = vec![1u8; len];
    let mut dst = vec![0u8; len];
    dst.copy_from_slice(&src); // fault the pages in first
    let rounds = 8;
    let t0 = Instant::now();
    for _ in 0..rounds {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
    }
    (len * rounds) as f64 / t0.elapsed().as_secs_f64() / 1e9
}

/// One pass of crop reads: the copy times and the whole pass's time.
struct CropPass {
    latency: Histogram,
    crop_bytes: usize,
    crops: usize,
    copy_s: f64,
    all_s: f64,
}

impl CropPass {
    fn median_gbps(&self) -> f64 {
        self.crop_bytes as f64 / self.latency.percentile(0.50).max(1e-6) / 1e3
    }

    fn mean_gbps(&self) -> f64 {
        (self.crops * self.crop_bytes) as f64 / self.copy_s.max(1e-12) / 1e9
    }

    fn with_lease_gbps(&self) -> f64 {
        (self.crops * self.crop_bytes) as f64 / self.all_s.max(1e-12) / 1e9
    }
}

/// `opts.crop_reads` crops (the same ones on every call) out of the `cached`
/// records, one thread, each under its own lease.
fn crop_pass(
    driver: &CacheClient,
    cached: &[u64],
    shape: FrameShape,
    opts: &BenchOptions,
) -> Result<CropPass, BenchError> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut crop = vec![0u8; opts.crop * opts.crop * 3];
    let mut pass = CropPass {
        latency: Histogram::default(),
        crop_bytes: crop.len(),
        crops: opts.crop_reads,
        copy_s: 0.0,
        all_s: 0.0,
    };
    let t_all = Instant::now();
    for _ in 0..opts.crop_reads {
        let id = cached[rng.random_range(0..cached.len())];
        let lease = driver.peek(&key_name(id))?.ok_or_else(|| {
            BenchError::Options(format!("{} was evicted with no load running", key_name(id)))
        })?;
        let y = rng.random_range(0..=shape.height - opts.crop);
        let x = rng.random_range(0..=shape.width - opts.crop);
        let t0 = Instant::now();
        copy_crop(shape, &lease, y, x, opts.crop, &mut crop);
        std::hint::black_box(&mut crop);
        let took = t0.elapsed().as_secs_f64();
        pass.copy_s += took;
        pass.latency.record(took * 1e6);
    }
    pass.all_s = t_all.elapsed().as_secs_f64();
    Ok(pass)
}

impl std::fmt::Display for BenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let r = self;
        writeln!(
            f,
            "cache bench: {} processes x {} threads, {} keys over {} slots of {} ({} cap), {:.1} s",
            r.processes,
            r.threads,
            r.keys,
            r.slots,
            human(r.record_bytes),
            human(r.cap_bytes),
            r.seconds
        )?;
        writeln!(
            f,
            "  gets/s {:.0}  hit rate {:.1}%  evictions {}  torn reads {} ({} fully verified)",
            r.ops_per_s,
            100.0 * r.hit_rate,
            r.evictions,
            r.torn_reads,
            r.verified_reads
        )?;
        writeln!(
            f,
            "  hit latency µs: p50 {:.0}  p99 {:.0}  max {:.0}  ({} through the server)",
            r.hit_p50_us, r.hit_p99_us, r.hit_max_us, r.server_hits
        )?;
        writeln!(
            f,
            "  waits for another client's fill: {}  µs p50 {:.0}  p99 {:.0}",
            r.waits, r.wait_p50_us, r.wait_p99_us
        )?;
        writeln!(
        f,
        "  crop read {:.2} GB/s median ({:.2} mean, {:.2} with lease get/release; {:.2} at the first touch of the pages)  memcpy {:.2} GB/s",
        r.crop_read_gbps, r.crop_read_mean_gbps, r.crop_with_lease_gbps, r.crop_read_first_touch_gbps, r.memcpy_gbps
    )?;
        Ok(())
    }
}

/// Runs the whole benchmark.
pub fn run(opts: &BenchOptions) -> Result<BenchReport, BenchError> {
    let shape = FrameShape::rgb(opts.height, opts.width);
    let record_bytes = shape.record_bytes() as u64;
    let slots = opts.cap_bytes / extent_for(record_bytes).unwrap_or(u64::MAX);
    if slots == 0 {
        return Err(BenchError::Options(format!(
            "a cap of {} bytes holds no {record_bytes}-byte record",
            opts.cap_bytes
        )));
    }
    let keys = if opts.keys == 0 {
        slots * 5 / 4 + 1
    } else {
        opts.keys
    };
    let address = crate::cache::default_address(&format!(
        "bench-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    let (_server, driver) =
        spawn_cache_server(&opts.exe, &address, opts.cap_bytes, Some(record_bytes))
            .map_err(|e| ProcessError::new("cache server", e))?;
    let body = template(shape);

    // Warm: fill every slot once, so the timed phase runs at steady eviction pressure.
    for id in 0..slots.min(keys) {
        let lease = driver
            .get_or_fill(&key_name(id), record_bytes as usize, |slot| {
                write_record(shape, id, &body, slot)
            })
            .map_err(|e| BenchError::Options(format!("warm-up fill: {e}")))?;
        drop(lease);
    }

    let worker = WorkerOptions {
        address: address.clone(),
        threads: opts.threads,
        keys,
        seconds: opts.seconds,
        height: opts.height,
        width: opts.width,
        crop: opts.crop,
        seed: 0,
        verify_every: opts.verify_every.max(1),
    };
    let mut workers = Vec::new();
    for p in 0..opts.processes {
        let options = WorkerOptions {
            seed: p as u64 + 1,
            ..worker.clone()
        };
        let name = format!("bench worker {p}");
        workers.push(Worker::start(&opts.exe, "cache-worker", name, &options)?);
    }
    let mut total = WorkerReport::default();
    for w in workers {
        total.merge(&w.only_report()?);
    }

    // Crop reads, one thread, the store otherwise idle, over the records cached now
    // (so every get is a hit): the copy alone, and the copy with get and release.
    let mut cached = Vec::new();
    for id in 0..keys {
        if driver.peek(&key_name(id))?.is_some() {
            cached.push(id);
        }
    }
    if cached.is_empty() {
        return Err(BenchError::Options("nothing cached after the run".into()));
    }
    // The same crops twice: first as this process first touches the records' pages
    // (they were written by other processes, or through a fill's own mapping), then
    // with the pages mapped, as they are in a process that has read them before.
    let first_touch = crop_pass(&driver, &cached, shape, opts)?;
    let warm = crop_pass(&driver, &cached, shape, opts)?;
    let memcpy = memcpy_gbps();
    let server_stats = driver.stats()?;
    let _ = driver.shutdown_server();

    let gets = total.hits + total.misses;
    Ok(BenchReport {
        hit_p50_us: total.hit_latency.percentile(0.50),
        hit_p99_us: total.hit_latency.percentile(0.99),
        hit_max_us: total.hit_latency.max(),
        waits: total.wait_latency.count(),
        wait_p50_us: total.wait_latency.percentile(0.50),
        wait_p99_us: total.wait_latency.percentile(0.99),
        hit_or_wait_p99_us: {
            let mut both = total.hit_latency.clone();
            both.merge(&total.wait_latency);
            both.percentile(0.99)
        },
        server_hits: total.server_hit_latency.count(),
        server_hit_p50_us: total.server_hit_latency.percentile(0.50),
        server_hit_p99_us: total.server_hit_latency.percentile(0.99),
        ops_per_s: total.ops as f64 / total.elapsed_s.max(1e-9),
        hit_rate: if gets == 0 {
            0.0
        } else {
            total.hits as f64 / gets as f64
        },
        evictions: server_stats.evictions,
        torn_reads: total.torn_reads,
        verified_reads: total.verified,
        store_full: total.store_full,
        crop_read_gbps: warm.median_gbps(),
        crop_read_mean_gbps: warm.mean_gbps(),
        crop_with_lease_gbps: warm.with_lease_gbps(),
        crop_read_first_touch_gbps: first_touch.median_gbps(),
        memcpy_gbps: memcpy,
        processes: opts.processes,
        threads: opts.threads,
        keys,
        slots,
        record_bytes,
        cap_bytes: opts.cap_bytes,
        seconds: opts.seconds,
        server: Some(server_stats),
    })
}
