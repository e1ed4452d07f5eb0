//! `vrtspike bench loader`: R loader processes (as R ranks would be) against one
//! cache server on generated or real data, timed per epoch; prints one JSON object
//! with samples/s of the last epoch (all ranks), the hit rate, data_time, the reads
//! that bypassed the cache, and the store's figures at the end (bytes reserved
//! against bytes of live records: its fragmentation).

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::cache::StatsReport;
use crate::config::Augment;
use crate::dataset::{DataError, DatasetIndex, IndexOptions};
use crate::pipeline::loader::{Loader, LoaderOptions};
use crate::pipeline::sample::{ClipIndex, ClipWindows, CropMode, SampleSpec};
use crate::pipeline::sampler::{DistributedSampler, Remainder, SamplerOptions};
use crate::pipeline::PipelineError;
use crate::testkit::process::{spawn_cache_server, ChildGuard};

/// Why the loader benchmark failed.
#[derive(Debug, thiserror::Error)]
pub enum LoaderBenchError {
    /// The dataset could not be opened.
    #[error(transparent)]
    Data(#[from] DataError),
    /// A loader failed.
    #[error(transparent)]
    Pipeline(#[from] PipelineError),
    /// A child process could not be run or failed.
    #[error("{what}: {message}")]
    Process {
        /// Which process.
        what: String,
        /// What happened.
        message: String,
    },
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
}

/// What one loader process measured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LoaderWorkerReport {
    /// Rank.
    pub rank: usize,
    /// Seconds per epoch.
    pub epoch_s: Vec<f64>,
    /// Samples in the last epoch.
    pub samples_last_epoch: u64,
    /// Hits and misses of the last epoch.
    pub hits_last_epoch: u64,
    /// Misses of the last epoch.
    pub misses_last_epoch: u64,
    /// Reads of the last epoch that the cache could not take (decoded from disk).
    #[serde(default)]
    pub bypass_last_epoch: u64,
    /// Reads of all epochs that the cache could not take.
    #[serde(default)]
    pub bypass_total: u64,
    /// Mean consumer wait per batch in the last epoch, ms.
    pub data_time_ms_last_epoch: f64,
}

/// Runs one loader process's epochs.
pub fn run_worker(o: &LoaderWorkerOptions) -> Result<LoaderWorkerReport> {
    let index = DatasetIndex::open(&o.root, &o.split, IndexOptions::default())?;
    let clips = ClipIndex::new(&index, ClipWindows::sliding(o.clip));
    let sampler = DistributedSampler::new(
        clips.clips.len(),
        SamplerOptions {
            world: o.ranks,
            rank: o.rank,
            shuffle: true,
            seed: o.seed,
            remainder: Remainder::Drop,
        },
    )?;
    let options = LoaderOptions {
        workers: o.workers,
        prefetch_batches: o.prefetch * o.workers,
        batch_size: o.batch,
        drop_last_batch: true,
        spec: SampleSpec {
            crop: CropMode::Random(o.crop),
            augment: Augment::all(false),
            bins: o.bins,
        },
        seed: o.seed,
        rank: o.rank,
        cache_address: o.address.clone(),
        client_name: format!("bench-rank{}", o.rank),
        skip_bad: false,
    };
    let mut loader = Loader::new(Arc::new(index), Arc::new(clips), sampler, options)?;
    let mut report = LoaderWorkerReport {
        rank: o.rank,
        epoch_s: Vec::new(),
        samples_last_epoch: 0,
        hits_last_epoch: 0,
        misses_last_epoch: 0,
        bypass_last_epoch: 0,
        bypass_total: 0,
        data_time_ms_last_epoch: 0.0,
    };
    for epoch in 0..o.epochs {
        let before = loader.stats();
        loader.set_epoch(epoch);
        let start = Instant::now();
        while let Some(batch) = loader.next_batch() {
            std::hint::black_box(batch?);
        }
        report.epoch_s.push(start.elapsed().as_secs_f64());
        let after = loader.stats();
        report.samples_last_epoch = after.samples - before.samples;
        report.hits_last_epoch = after.cache_hits - before.cache_hits;
        report.misses_last_epoch = after.cache_misses - before.cache_misses;
        report.bypass_last_epoch = after.cache_bypass - before.cache_bypass;
        report.bypass_total = after.cache_bypass;
        let batches = (after.batches - before.batches).max(1);
        report.data_time_ms_last_epoch =
            (after.data_time_s - before.data_time_s) * 1000.0 / batches as f64;
    }
    Ok(report)
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
    /// The store at the end (with a cache).
    pub store: Option<StoreFigures>,
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
        }
    }
}

fn process_error(what: String, e: impl std::fmt::Display) -> LoaderBenchError {
    LoaderBenchError::Process {
        what,
        message: e.to_string(),
    }
}

/// Runs the benchmark: a cache server process (unless `cache_gb` is `None`) and
/// `template.ranks` loader processes of the binary `exe`.
pub fn run(
    exe: &std::path::Path,
    template: &LoaderWorkerOptions,
    cache_gb: Option<f64>,
) -> Result<LoaderBenchReport> {
    let mut server = None;
    let mut template = template.clone();
    if let Some(gb) = cache_gb {
        let address = crate::cache::default_address(&format!("loaderbench-{}", std::process::id()));
        let cap = (gb * (1u64 << 30) as f64) as u64;
        let started = spawn_cache_server(exe, &address, cap, None)
            .map_err(|e| process_error("cache server".into(), e))?;
        server = Some(started);
        template.address = Some(address);
    }
    let mut children = Vec::new();
    for rank in 0..template.ranks {
        let mut o = template.clone();
        o.rank = rank;
        let json = serde_json::to_string(&o).map_err(|e| process_error("options".into(), e))?;
        let child = Command::new(exe)
            .args(["bench", "loader-worker", "--options", &json])
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| process_error(format!("starting loader rank {rank}"), e))?;
        children.push(ChildGuard(child));
    }
    let mut reports = Vec::new();
    for (rank, child) in children.iter_mut().enumerate() {
        let mut out = String::new();
        if let Some(stdout) = child.0.stdout.as_mut() {
            stdout
                .read_to_string(&mut out)
                .map_err(|e| process_error(format!("reading rank {rank}"), e))?;
        }
        let status = child
            .0
            .wait()
            .map_err(|e| process_error(format!("waiting for rank {rank}"), e))?;
        if !status.success() {
            return Err(process_error(format!("loader rank {rank}"), status));
        }
        let report: LoaderWorkerReport = serde_json::from_str(out.trim())
            .map_err(|e| process_error(format!("rank {rank} report {out:?}"), e))?;
        reports.push(report);
    }
    let last = reports
        .iter()
        .filter_map(|r| r.epoch_s.last().copied())
        .fold(0.0, f64::max);
    let store = match &server {
        Some((_, client)) => {
            Some(StoreFigures::of(&client.stats().map_err(|e| {
                process_error("cache server stats".into(), e)
            })?))
        }
        None => None,
    };
    let samples: u64 = reports.iter().map(|r| r.samples_last_epoch).sum();
    let hits: u64 = reports.iter().map(|r| r.hits_last_epoch).sum();
    let reads: u64 = hits + reports.iter().map(|r| r.misses_last_epoch).sum::<u64>();
    Ok(LoaderBenchReport {
        bench: "vrtspike-loader",
        ranks: template.ranks,
        workers_per_rank: template.workers,
        clip: template.clip,
        crop: template.crop,
        epochs: template.epochs,
        use_cache: cache_gb.is_some(),
        samples_last_epoch: samples,
        samples_per_s: if last > 0.0 {
            samples as f64 / last
        } else {
            0.0
        },
        hit_rate: if reads > 0 {
            hits as f64 / reads as f64
        } else {
            0.0
        },
        data_time_ms: reports
            .iter()
            .map(|r| r.data_time_ms_last_epoch)
            .sum::<f64>()
            / reports.len().max(1) as f64,
        bypass_last_epoch: reports.iter().map(|r| r.bypass_last_epoch).sum(),
        bypass_total: reports.iter().map(|r| r.bypass_total).sum(),
        store,
        epoch_s: reports.into_iter().map(|r| r.epoch_s).collect(),
    })
}
