//! `vrtspike bench loader`: R loader processes (as R ranks would be) against one
//! cache server on generated or real data, timed per epoch; prints one JSON object
//! with samples/s of the last epoch (all ranks), the hit rate, data_time, the reads
//! that bypassed the cache, the bytes read from disk, the store's figures at the end
//! (bytes reserved against bytes of live records: its fragmentation) and the cache
//! server's own memory.
//!
//! The ranks announce their reads to the cache (`--policy planned`, with or without
//! the loader's prefetch) or not (`lru`). With `--lockstep` they move as training
//! ranks do, meeting after every batch (the all-reduce): each prints a line after a
//! batch and waits for the parent's word, which comes once every rank has printed
//! one. `--step-ms` is the time a training step would take after each batch (its
//! compute), so data_time over the step time is the loader's stall share at that
//! step rate.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::dump::{DumpError, SampleDump};
use super::worker::{ProcessError, Worker};
use crate::cache::StatsReport;
use crate::config::{Augment, CachePolicy};
use crate::dataset::{DataError, DatasetIndex, IndexOptions};
use crate::pipeline::loader::{Loader, LoaderOptions, LoaderStats};
use crate::pipeline::sample::{ClipIndex, ClipWindows, CropMode, SampleSpec};
use crate::pipeline::sampler::{DistributedSampler, Remainder, SamplerOptions};
use crate::pipeline::PipelineError;
use crate::testkit::process::spawn_cache_server;

/// Why the loader benchmark failed.
#[derive(Debug, thiserror::Error)]
pub enum LoaderBenchError {
    /// The dataset could not be opened.
    #[error(transparent)]
    Data(#[from] DataError),
    /// A loader failed.
    #[error(transparent)]
    Pipeline(#[from] PipelineError),
    /// The samples could not be written (`--dump-samples`).
    #[error(transparent)]
    Dump(#[from] DumpError),
    /// A child process could not be run or failed.
    #[error(transparent)]
    Process(#[from] ProcessError),
    /// The store refused a request of a simulation run in this process.
    #[error("the simulated store: {0}")]
    Store(String),
}

type Result<T, E = LoaderBenchError> = std::result::Result<T, E>;

/// What one loader process runs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LoaderWorkerOptions {
    /// Dataset root.
    pub root: PathBuf,
    /// Split folder.
    pub split: String,
    /// Cache server address (`None`: read from disk).
    pub address: Option<String>,
    /// This process's rank.
    pub rank: usize,
    /// Ranks in all.
    pub ranks: usize,
    /// Loader threads of this rank.
    pub workers: usize,
    /// Batches queued ahead per worker.
    pub prefetch: usize,
    /// Samples per batch.
    pub batch: usize,
    /// Epochs to run.
    pub epochs: u64,
    /// Frames per clip.
    pub clip: usize,
    /// Square crop in RGB pixels.
    pub crop: u32,
    /// Voxel bins.
    pub bins: u32,
    /// Seed.
    pub seed: u64,
    /// Announce the rank's reads to the cache (`Planned`) or not (`Lru`).
    #[serde(default)]
    pub policy: CachePolicy,
    /// With `Planned`: the loader's prefetch thread.
    #[serde(default)]
    pub cache_prefetch: bool,
    /// Meet the other ranks after every batch (the parent says when).
    #[serde(default)]
    pub lockstep: bool,
    /// A training step's compute after each batch, in milliseconds.
    #[serde(default)]
    pub step_ms: f64,
    /// Every flip and rotation of `DATA.AUGMENT` on (off: none).
    #[serde(default)]
    pub augment: bool,
    /// Write every sample into this folder ([`SampleDump`]).
    #[serde(default)]
    pub dump: Option<PathBuf>,
}

/// The line a lockstep rank prints after each batch (its report is the last line).
const BATCH_DONE: &str = "batch";

/// What one rank did in one epoch.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct EpochFigures {
    /// Wall seconds of the epoch.
    pub seconds: f64,
    /// Samples.
    pub samples: u64,
    /// Batches.
    pub batches: u64,
    /// Records found in the cache.
    pub hits: u64,
    /// Records not found (filled, or read from disk when the cache could not take them).
    pub misses: u64,
    /// Reads the cache could not take or give, decoded from disk.
    pub bypass: u64,
    /// Records the prefetch thread filled.
    pub prefetched: u64,
    /// Bytes decoded from disk.
    pub disk_bytes: u64,
    /// Seconds the consumer waited for batches.
    pub data_time_s: f64,
}

impl EpochFigures {
    fn between(before: &LoaderStats, after: &LoaderStats, seconds: f64) -> EpochFigures {
        EpochFigures {
            seconds,
            samples: after.samples - before.samples,
            batches: after.batches - before.batches,
            hits: after.cache_hits - before.cache_hits,
            misses: after.cache_misses - before.cache_misses,
            bypass: after.cache_bypass - before.cache_bypass,
            prefetched: after.cache_prefetched - before.cache_prefetched,
            disk_bytes: after.disk_bytes - before.disk_bytes,
            data_time_s: after.data_time_s - before.data_time_s,
        }
    }

    fn add(&mut self, o: &EpochFigures) {
        self.seconds += o.seconds;
        self.samples += o.samples;
        self.batches += o.batches;
        self.hits += o.hits;
        self.misses += o.misses;
        self.bypass += o.bypass;
        self.prefetched += o.prefetched;
        self.disk_bytes += o.disk_bytes;
        self.data_time_s += o.data_time_s;
    }
}

/// What one loader process measured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LoaderWorkerReport {
    /// Rank.
    pub rank: usize,
    /// Reads of all epochs that the cache could not take.
    pub bypass_total: u64,
    /// Every epoch's figures.
    pub epochs: Vec<EpochFigures>,
}

impl LoaderWorkerReport {
    /// The last epoch's figures (zero when none ran).
    fn last_epoch(&self) -> EpochFigures {
        self.epochs.last().copied().unwrap_or_default()
    }
}

/// Waits for the parent's word (lockstep) after telling it a batch is done.
fn meet_the_other_ranks(stdin: &mut impl BufRead) -> Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{BATCH_DONE}")
        .and_then(|()| out.flush())
        .map_err(|e| process_error("lockstep: telling the parent".into(), e))?;
    let mut line = String::new();
    match stdin.read_line(&mut line) {
        Ok(n) if n > 0 => Ok(()),
        Ok(_) => Err(process_error(
            "lockstep".into(),
            "the parent closed the barrier",
        )),
        Err(e) => Err(process_error("lockstep: waiting for the parent".into(), e)),
    }
}

/// The sampler options of rank `rank` of `world` as training samples: shuffled with
/// `seed`, the uneven rest dropped.
pub(super) fn shuffled(world: usize, rank: usize, seed: u64) -> SamplerOptions {
    SamplerOptions {
        world,
        rank,
        shuffle: true,
        seed,
        remainder: Remainder::Drop,
    }
}

/// Runs one loader process's epochs.
pub fn run_worker(o: &LoaderWorkerOptions) -> Result<LoaderWorkerReport> {
    let index = DatasetIndex::open(&o.root, &o.split, IndexOptions::default())?;
    let clips = ClipIndex::new(&index, ClipWindows::sliding(o.clip));
    let sampler = DistributedSampler::new(clips.clips.len(), shuffled(o.ranks, o.rank, o.seed))?;
    let options = LoaderOptions {
        workers: o.workers,
        prefetch_batches: o.prefetch * o.workers,
        batch_size: o.batch,
        drop_last_batch: true,
        spec: SampleSpec {
            crop: CropMode::Random(o.crop),
            augment: Augment::all(o.augment),
            bins: o.bins,
        },
        seed: o.seed,
        rank: o.rank,
        cache_address: o.address.clone(),
        client_name: format!("bench-rank{}", o.rank),
        skip_bad: false,
        cache_policy: o.policy,
        cache_prefetch: o.cache_prefetch,
    };
    let mut loader = Loader::new(Arc::new(index), Arc::new(clips), sampler, options)?;
    let mut dump = match &o.dump {
        Some(dir) => Some(SampleDump::create(dir, o.rank)?),
        None => None,
    };
    let mut stdin = std::io::stdin().lock();
    let step = Duration::from_secs_f64(o.step_ms.max(0.0) / 1000.0);
    let mut epochs = Vec::new();
    for epoch in 0..o.epochs {
        let before = loader.stats();
        loader.set_epoch(epoch);
        let start = Instant::now();
        while let Some(batch) = loader.next_batch() {
            let batch = batch?;
            if let Some(dump) = &mut dump {
                dump.batch(&batch)?;
            }
            std::hint::black_box(batch);
            if !step.is_zero() {
                std::thread::sleep(step);
            }
            if o.lockstep {
                meet_the_other_ranks(&mut stdin)?;
            }
        }
        let seconds = start.elapsed().as_secs_f64();
        epochs.push(EpochFigures::between(&before, &loader.stats(), seconds));
    }
    Ok(LoaderWorkerReport {
        rank: o.rank,
        bypass_total: loader.stats().cache_bypass,
        epochs,
    })
}

/// The benchmark's result.
#[derive(Debug, Clone, Serialize)]
pub struct LoaderBenchReport {
    /// `"vrtspike-loader"`.
    pub bench: &'static str,
    /// Ranks (processes).
    pub ranks: usize,
    /// Loader threads per rank.
    pub workers_per_rank: usize,
    /// Frames per clip, crop side, epochs.
    pub clip: usize,
    /// Crop side.
    pub crop: u32,
    /// Epochs.
    pub epochs: u64,
    /// Through the cache or from disk.
    pub use_cache: bool,
    /// `planned` or `lru`.
    pub policy: CachePolicy,
    /// Whether the loaders prefetched (planned only).
    pub cache_prefetch: bool,
    /// Whether the ranks met after every batch.
    pub lockstep: bool,
    /// A step's compute after each batch, ms.
    pub step_ms: f64,
    /// Samples of the last epoch, all ranks.
    pub samples_last_epoch: u64,
    /// Samples/s of the last epoch, all ranks (samples / slowest rank's epoch time).
    pub samples_per_s: f64,
    /// Cache hit rate of the last epoch, all ranks.
    pub hit_rate: f64,
    /// Mean consumer wait per batch in the last epoch, ms (mean over ranks).
    pub data_time_ms: f64,
    /// Reads that the cache could not take, decoded from disk: last epoch, all ranks.
    pub bypass_last_epoch: u64,
    /// The same over all epochs.
    pub bypass_total: u64,
    /// Every epoch after the first (every epoch when there is one), all ranks: the
    /// cache warm, as in a long training.
    pub warm: EpochFigures,
    /// `warm`'s hits / (hits + misses).
    pub warm_hit_rate: f64,
    /// `warm`'s consumer wait over its wall time, mean over ranks: the share of a
    /// step the loader stalls it.
    pub warm_stall_share: f64,
    /// The store at the end (with a cache).
    pub store: Option<StoreFigures>,
    /// The cache server's own memory at the end (with a cache).
    pub server_memory: Option<ProcessMemory>,
    /// Seconds per epoch, per rank.
    pub epoch_s: Vec<Vec<f64>>,
}

/// The cache store's figures at the end of the benchmark: how much of the memory
/// it reserved holds live records (its fragmentation), and what it refused.
#[derive(Debug, Clone, Serialize)]
pub struct StoreFigures {
    /// Byte cap.
    pub cap_bytes: u64,
    /// Bytes of the store carved for records (their memory is reserved).
    pub carved_bytes: u64,
    /// Bytes of records committed or being filled.
    pub live_bytes: u64,
    /// `live_bytes / carved_bytes`: 1 means no fragmentation.
    pub live_share: f64,
    /// Records held.
    pub records: usize,
    /// Records evicted.
    pub evictions: u64,
    /// Requests the server refused (every kind).
    pub refused_requests: u64,
    /// Hit rate over the whole run, all clients.
    pub hit_rate: f64,
    /// Read orders announced, records prefetched, prefetches declined.
    pub read_orders_announced: u64,
    /// Records brought in ahead of their use.
    pub prefetched: u64,
    /// Prefetches the server declined.
    pub prefetch_declined: u64,
}

impl StoreFigures {
    fn of(report: &StatsReport) -> StoreFigures {
        StoreFigures {
            cap_bytes: report.cap_bytes,
            carved_bytes: report.bytes_carved,
            live_bytes: report.bytes_live,
            live_share: report.bytes_live as f64 / report.bytes_carved.max(1) as f64,
            records: report.records,
            evictions: report.evictions,
            refused_requests: report.totals.errors,
            hit_rate: report.hit_rate,
            read_orders_announced: report.read_orders.announced,
            prefetched: report.read_orders.prefetched,
            prefetch_declined: report.read_orders.prefetch_declined,
        }
    }
}

/// A process's memory from `/proc/<pid>/smaps_rollup`, MB.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct ProcessMemory {
    /// Proportional set size.
    pub pss_mb: f64,
    /// Its share of shared memory (shmem, memfd): the cached data it holds.
    pub pss_shmem_mb: f64,
    /// Its private and file-backed pages (heap, binary, libraries): the process's
    /// own overhead, `pss_mb - pss_shmem_mb`.
    pub overhead_mb: f64,
    /// Resident set size.
    pub rss_mb: f64,
}

impl ProcessMemory {
    /// The figures of process `pid`, `None` if it cannot be read.
    pub fn of(pid: u32) -> Option<ProcessMemory> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
        let kb = |name: &str| {
            text.lines()
                .find_map(|line| line.strip_prefix(name))
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|n| n.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        let (pss, shmem) = (kb("Pss:"), kb("Pss_Shmem:"));
        Some(ProcessMemory {
            pss_mb: pss / 1024.0,
            pss_shmem_mb: shmem / 1024.0,
            overhead_mb: (pss - shmem) / 1024.0,
            rss_mb: kb("Rss:") / 1024.0,
        })
    }
}

/// The compact size of every record of a split, bytes.
pub fn split_bytes(root: &std::path::Path, split: &str) -> Result<u64> {
    Ok(DatasetIndex::open(root, split, IndexOptions::default())?.compact_bytes())
}

fn process_error(what: String, e: impl std::fmt::Display) -> LoaderBenchError {
    ProcessError::new(what, e).into()
}

/// A rank process, and its report once it printed it.
struct Rank {
    rank: usize,
    worker: Worker,
    report: Option<LoaderWorkerReport>,
}

impl Rank {
    fn start(exe: &std::path::Path, o: &LoaderWorkerOptions) -> Result<Rank> {
        let name = format!("loader rank {}", o.rank);
        let worker = Worker::start(exe, "loader-worker", name, o)?;
        Ok(Rank {
            rank: o.rank,
            worker,
            report: None,
        })
    }

    /// Reads the rank's next line: `true` after a batch (lockstep), `false` once it
    /// printed its report.
    fn next(&mut self) -> Result<bool> {
        let line = self.worker.line()?;
        if line == BATCH_DONE {
            return Ok(true);
        }
        self.report = Some(self.worker.report(&line)?);
        Ok(false)
    }

    fn finish(self) -> Result<LoaderWorkerReport> {
        self.worker.finish()?;
        let rank = self.rank;
        (self.report).ok_or_else(|| process_error(format!("loader rank {rank}"), "no report"))
    }
}

/// Runs the ranks to their end: in lockstep, a round is every running rank's
/// batch, then the word to go on.
fn run_ranks(ranks: &mut [Rank]) -> Result<()> {
    let mut running: Vec<usize> = (0..ranks.len()).collect();
    while !running.is_empty() {
        let mut waiting = Vec::new();
        for &r in &running {
            if ranks[r].next()? {
                waiting.push(r);
            }
        }
        for &r in &waiting {
            ranks[r].worker.tell("go")?;
        }
        running = waiting;
    }
    Ok(())
}

/// Runs the benchmark: a cache server process of `cache_bytes` (unless `None`)
/// and `template.ranks` loader processes of the binary `exe`.
pub fn run(
    exe: &std::path::Path,
    template: &LoaderWorkerOptions,
    cache_bytes: Option<u64>,
) -> Result<LoaderBenchReport> {
    let mut server = None;
    let mut template = template.clone();
    if let Some(cap) = cache_bytes {
        let address = crate::cache::default_address(&format!(
            "loaderbench-{}-{}",
            std::process::id(),
            rand::random::<u32>()
        ));
        let started = spawn_cache_server(exe, &address, cap, None)
            .map_err(|e| process_error("cache server".into(), e))?;
        server = Some(started);
        template.address = Some(address);
    }
    let mut ranks = Vec::new();
    for rank in 0..template.ranks {
        let mut o = template.clone();
        o.rank = rank;
        ranks.push(Rank::start(exe, &o)?);
    }
    run_ranks(&mut ranks)?;
    let mut reports = Vec::new();
    for r in ranks {
        reports.push(r.finish()?);
    }
    let (store, server_memory) = match &server {
        Some((child, client)) => {
            let stats = client
                .stats()
                .map_err(|e| process_error("cache server stats".into(), e))?;
            (
                Some(StoreFigures::of(&stats)),
                ProcessMemory::of(child.0.id()),
            )
        }
        None => (None, None),
    };
    Ok(summarize(
        &template,
        cache_bytes.is_some(),
        reports,
        store,
        server_memory,
    ))
}

impl std::fmt::Display for LoaderBenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let report = self;
        writeln!(
        f,
        "loader: {} ranks x {} workers, clip {}, crop {}: {:.2} samples/s (last epoch), hit rate {:.3}, data_time {:.1} ms, bypass {} (all epochs {})",
        report.ranks, report.workers_per_rank, report.clip, report.crop, report.samples_per_s, report.hit_rate, report.data_time_ms,
        report.bypass_last_epoch, report.bypass_total
    )?;
        let w = &report.warm;
        writeln!(
        f,
        "warm epochs ({:?}{}{}): hit rate {:.3}, {:.1} MB from disk, {} prefetched, stall {:.2}% of the step time ({} ms a step)",
        report.policy,
        if report.cache_prefetch { " + prefetch" } else { "" },
        if report.lockstep { ", lockstep" } else { "" },
        report.warm_hit_rate,
        w.disk_bytes as f64 / 1e6,
        w.prefetched,
        100.0 * report.warm_stall_share,
        report.step_ms
    )?;
        if let Some(store) = &report.store {
            writeln!(
        f,
            "store: {} of {} carved bytes hold live records ({:.1}%), {} records, {} evictions, {} refused requests",
            store.live_bytes, store.carved_bytes, 100.0 * store.live_share, store.records, store.evictions, store.refused_requests
        )?;
        }
        if let Some(m) = &report.server_memory {
            writeln!(
                f,
                "cache server: Pss {:.1} MB = {:.1} MB of cached data + {:.1} MB of its own",
                m.pss_mb, m.pss_shmem_mb, m.overhead_mb
            )?;
        }
        Ok(())
    }
}

fn summarize(
    template: &LoaderWorkerOptions,
    use_cache: bool,
    reports: Vec<LoaderWorkerReport>,
    store: Option<StoreFigures>,
    server_memory: Option<ProcessMemory>,
) -> LoaderBenchReport {
    let lasts: Vec<EpochFigures> = reports.iter().map(LoaderWorkerReport::last_epoch).collect();
    let last = lasts.iter().map(|e| e.seconds).fold(0.0, f64::max);
    let samples: u64 = lasts.iter().map(|e| e.samples).sum();
    let hits: u64 = lasts.iter().map(|e| e.hits).sum();
    let reads: u64 = hits + lasts.iter().map(|e| e.misses).sum::<u64>();
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    let mut warm = EpochFigures::default();
    let mut stall = 0.0;
    for r in &reports {
        let mut mine = EpochFigures::default();
        let skip = usize::from(r.epochs.len() > 1);
        for e in &r.epochs[skip..] {
            mine.add(e);
        }
        stall += ratio(mine.data_time_s, mine.seconds);
        warm.add(&mine);
    }
    LoaderBenchReport {
        bench: "vrtspike-loader",
        ranks: template.ranks,
        workers_per_rank: template.workers,
        clip: template.clip,
        crop: template.crop,
        epochs: template.epochs,
        use_cache,
        policy: template.policy,
        cache_prefetch: template.cache_prefetch,
        lockstep: template.lockstep,
        step_ms: template.step_ms,
        samples_last_epoch: samples,
        samples_per_s: ratio(samples as f64, last),
        hit_rate: ratio(hits as f64, reads as f64),
        data_time_ms: lasts
            .iter()
            .map(|e| e.data_time_s * 1000.0 / e.batches.max(1) as f64)
            .sum::<f64>()
            / reports.len().max(1) as f64,
        bypass_last_epoch: lasts.iter().map(|e| e.bypass).sum(),
        bypass_total: reports.iter().map(|r| r.bypass_total).sum(),
        warm_hit_rate: ratio(warm.hits as f64, (warm.hits + warm.misses) as f64),
        warm_stall_share: stall / reports.len().max(1) as f64,
        warm,
        store,
        server_memory,
        epoch_s: reports
            .iter()
            .map(|r| r.epochs.iter().map(|e| e.seconds).collect())
            .collect(),
    }
}
