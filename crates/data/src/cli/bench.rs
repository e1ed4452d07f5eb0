//! `vrtspike bench cache` (the shared-memory cache benchmark) and `vrtspike bench
//! loader` (loader processes against one cache server): one JSON object each with
//! `--json`, and the hidden worker subcommands they run in their child processes.
//! None of them runs a model: `vrtspike bench` hands over to `vrtspike-cache` (see
//! `cache.rs`), so every process of a benchmark runs without libtorch; these are
//! that binary's `bench` too.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};

use super::cache::{hand_over, Where};
use crate::bench::cache::{self as cache_bench, BenchOptions, BenchReport};
use crate::bench::loader as loader_bench;
use crate::bench::policy as policy_bench;
use crate::bench::sign as sign_bench;
use crate::bench::store as store_bench;
use crate::config::CachePolicy;
use crate::util::bytes::parse_size;

/// The benchmarks.
#[derive(Subcommand)]
pub enum BenchCommand {
    /// Cache server under several processes x threads of random gets with eviction.
    Cache(CacheBenchArgs),
    /// One worker process of `bench cache` (run by it, not by hand).
    #[command(hide = true)]
    CacheWorker {
        /// The worker's options as JSON.
        #[arg(long)]
        options: String,
    },
    /// Loader processes (as ranks) against one cache server: samples/s, hit rate, data_time.
    Loader(LoaderBenchArgs),
    /// The store's eviction at a node's scale, in one process on a simulated clock:
    /// the time of a reserve when full, what the read orders hold per record.
    Store(StoreBenchArgs),
    /// The signature of a dataset of many files (what keys a node-shared cache
    /// server): the walk's time, and its fallback when the budget runs out.
    Sign(SignBenchArgs),
    /// One rank of `bench loader` (run by it, not by hand).
    #[command(hide = true)]
    LoaderWorker {
        /// The rank's options as JSON.
        #[arg(long)]
        options: String,
    },
}

/// `bench store`.
#[derive(Args)]
pub struct StoreBenchArgs {
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    /// Records the cap holds (of 1, 2 and 4 pages, on average).
    #[arg(long, default_value_t = 12_000)]
    slots: usize,
    /// Jobs; job j takes j + 1 steps a second.
    #[arg(long, default_value_t = 3)]
    jobs: usize,
    /// Ranks (read orders) per job.
    #[arg(long, default_value_t = 8)]
    ranks_per_job: usize,
    /// Records each read order names.
    #[arg(long, default_value_t = 100_000)]
    keys: usize,
    /// Reads in all.
    #[arg(long, default_value_t = 400_000)]
    reads: usize,
}

/// `bench sign`.
#[derive(Args)]
pub struct SignBenchArgs {
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    /// Files in the tree.
    #[arg(long, default_value_t = 100_000)]
    files: usize,
    /// Files per sequence folder.
    #[arg(long, default_value_t = 100)]
    per_folder: usize,
    /// Where the tree is written (a fresh folder under it, removed after); default
    /// the temp folder.
    #[arg(long)]
    under: Option<PathBuf>,
    /// Signatures after the first.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Walker threads (default: as a job signs).
    #[arg(long)]
    threads: Option<usize>,
    /// The budget of the last signature, in seconds (short, to show the fallback).
    #[arg(long, default_value_t = 0.05)]
    short_budget_s: f64,
}

/// `bench cache`.
#[derive(Args)]
pub struct CacheBenchArgs {
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    /// Worker processes.
    #[arg(long, default_value_t = 2)]
    processes: usize,
    /// Reader threads per worker process.
    #[arg(long, default_value_t = 4)]
    threads: usize,
    /// Store size.
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    cap: u64,
    /// Keys drawn from (0: 5/4 of the records that fit, so fills evict).
    #[arg(long, default_value_t = 0)]
    keys: u64,
    /// Seconds of random gets.
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Record height in pixels (RGB u8).
    #[arg(long, default_value_t = 720)]
    height: usize,
    /// Record width in pixels.
    #[arg(long, default_value_t = 1280)]
    width: usize,
    /// Crop side in pixels.
    #[arg(long, default_value_t = 256)]
    crop: usize,
    /// Verify the whole record's checksum every n-th read (1: every read); the
    /// header and the crop's row tags are checked on every read regardless.
    #[arg(long, default_value_t = 64)]
    verify_every: u64,
    /// Crops in the single-thread crop-read phase.
    #[arg(long, default_value_t = 4000)]
    crop_reads: usize,
}

/// Runs a benchmark subcommand; `place` says where.
pub fn run(command: BenchCommand, place: Where) -> Result<()> {
    if place == Where::WithoutLibtorch {
        hand_over();
    }
    match command {
        BenchCommand::Loader(args) => run_loader_bench(args),
        BenchCommand::Store(args) => {
            let options = store_bench::StoreBenchOptions {
                slots: args.slots,
                jobs: args.jobs,
                ranks_per_job: args.ranks_per_job,
                keys: args.keys,
                reads: args.reads,
                ..Default::default()
            };
            emit(args.json, &store_bench::run(options)?)
        }
        BenchCommand::Sign(args) => {
            let report = sign_bench::run(&sign_bench::SignBenchOptions {
                files: args.files,
                per_folder: args.per_folder,
                under: args.under,
                repeats: args.repeats,
                threads: args.threads,
                short_budget: std::time::Duration::try_from_secs_f64(args.short_budget_s)
                    .context("--short-budget-s is not a number of seconds")?,
            })?;
            emit(args.json, &report)
        }
        BenchCommand::LoaderWorker { options } => run_loader_worker(&options),
        BenchCommand::Cache(args) => emit(args.json, &run_cache(&args)?),
        BenchCommand::CacheWorker { options } => {
            let o = serde_json::from_str(&options).context("parsing the worker's --options")?;
            print_json(&cache_bench::run_worker(&o)?)
        }
    }
}

/// Prints `report` as one JSON object, or as text.
fn emit(json: bool, report: &(impl serde::Serialize + std::fmt::Display)) -> Result<()> {
    match json {
        true => print_json(report)?,
        false => print!("{report}"),
    }
    Ok(())
}

/// Prints `report` as one line of JSON.
fn print_json(report: &impl serde::Serialize) -> Result<()> {
    println!("{}", serde_json::to_string(report)?);
    Ok(())
}

/// Runs the cache benchmark with these arguments.
pub fn run_cache(args: &CacheBenchArgs) -> Result<BenchReport> {
    let opts = BenchOptions {
        exe: std::env::current_exe().context("finding the vrtspike binary")?,
        processes: args.processes,
        threads: args.threads,
        cap_bytes: args.cap,
        keys: args.keys,
        seconds: args.seconds,
        height: args.height,
        width: args.width,
        crop: args.crop,
        verify_every: args.verify_every,
        crop_reads: args.crop_reads,
    };
    Ok(cache_bench::run(&opts)?)
}

impl CacheBenchArgs {
    /// A short, small run (the demo's synthetic load) of `seconds`.
    pub fn demo(seconds: f64) -> CacheBenchArgs {
        CacheBenchArgs {
            json: false,
            processes: 2,
            threads: 2,
            cap: 256 << 20,
            keys: 0,
            seconds,
            height: 720,
            width: 1280,
            crop: 256,
            verify_every: 1,
            crop_reads: 500,
        }
    }
}

/// `vrtspike bench loader`: R loader processes against one cache server.
#[derive(Debug, Args)]
pub struct LoaderBenchArgs {
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Dataset root (folder layout or HDF5 sessions).
    #[arg(long)]
    pub root: PathBuf,
    /// Split folder.
    #[arg(long, default_value = "train")]
    pub split: String,
    /// Loader processes (ranks).
    #[arg(long, default_value_t = 2)]
    pub ranks: usize,
    /// Loader threads per rank.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Batches queued ahead per worker.
    #[arg(long, default_value_t = 2)]
    pub prefetch: usize,
    /// Samples per batch.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Epochs (the last one is reported).
    #[arg(long, default_value_t = 2)]
    pub epochs: u64,
    /// Frames per clip.
    #[arg(long, default_value_t = 6)]
    pub clip: usize,
    /// Square crop in RGB pixels.
    #[arg(long, default_value_t = 256)]
    pub crop: u32,
    /// Voxel bins.
    #[arg(long, default_value_t = 32)]
    pub bins: u32,
    /// Cache size in GiB.
    #[arg(long, default_value_t = 2.0)]
    pub cache_gb: f64,
    /// Cache size as a percentage of the split's compact size (over --cache-gb).
    #[arg(long)]
    pub cache_percent: Option<f64>,
    /// What the cache evicts: `planned` (the ranks announce their reads) or `lru`.
    #[arg(long, default_value = "planned", value_parser = parse_policy)]
    pub policy: CachePolicy,
    /// With `--policy planned`: no prefetch thread in the loaders.
    #[arg(long)]
    pub no_prefetch: bool,
    /// The ranks meet after every batch, as training ranks do at the all-reduce.
    #[arg(long)]
    pub lockstep: bool,
    /// A training step's compute after each batch, ms (the consumer sleeps).
    #[arg(long, default_value_t = 0.0)]
    pub step_ms: f64,
    /// Print the policy table instead: LRU, planned and Belady's offline bound at
    /// each of --table-caps (percent of the compact size) with each of --table-ranks
    /// ranks in lockstep (--policy, --cache-gb and --ranks are ignored).
    #[arg(long)]
    pub policy_table: bool,
    /// The table's rank counts.
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    pub table_ranks: Vec<usize>,
    /// The table's caps, percent of the compact size.
    #[arg(long, value_delimiter = ',', default_value = "5,10,25,50")]
    pub table_caps: Vec<f64>,
    /// Read from disk (no cache server).
    #[arg(long)]
    pub no_cache: bool,
    /// Random flips and rotations of the crops (DATA.AUGMENT: true); off by default.
    #[arg(long)]
    pub augment: bool,
    /// Write every sample the ranks hand out into this folder: per sample a file of
    /// its f32 values and a line of rank<R>.jsonl naming its place, crop and
    /// augmentation (for holding another reader of the data to them).
    #[arg(long, value_name = "DIR", conflicts_with = "policy_table")]
    pub dump_samples: Option<PathBuf>,
    /// Seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// Runs `vrtspike bench loader`.
pub fn run_loader_bench(args: LoaderBenchArgs) -> Result<()> {
    let template = loader_bench::LoaderWorkerOptions {
        root: args.root.clone(),
        split: args.split.clone(),
        address: None,
        rank: 0,
        ranks: args.ranks,
        workers: args.workers,
        prefetch: args.prefetch,
        batch: args.batch,
        epochs: args.epochs,
        clip: args.clip,
        crop: args.crop,
        bins: args.bins,
        seed: args.seed,
        policy: args.policy,
        cache_prefetch: args.policy == CachePolicy::Planned && !args.no_prefetch,
        lockstep: args.lockstep,
        step_ms: args.step_ms,
        augment: args.augment,
        dump: args.dump_samples.clone(),
    };
    let exe = std::env::current_exe().context("finding the vrtspike binary")?;
    if args.policy_table {
        let say = |line: &str| eprintln!("policy table: {line}");
        let table = policy_bench::run(&exe, &template, &args.table_ranks, &args.table_caps, &say)?;
        return emit(args.json, &table);
    }
    let cache = match (args.no_cache, args.cache_percent) {
        (true, _) => None,
        (false, Some(percent)) => {
            let bytes = loader_bench::split_bytes(&args.root, &args.split)?;
            Some((bytes as f64 * percent / 100.0) as u64)
        }
        (false, None) => Some((args.cache_gb * (1u64 << 30) as f64) as u64),
    };
    emit(args.json, &loader_bench::run(&exe, &template, cache)?)
}

/// `planned` or `lru`.
fn parse_policy(text: &str) -> Result<CachePolicy, String> {
    match text {
        "planned" => Ok(CachePolicy::Planned),
        "lru" => Ok(CachePolicy::Lru),
        other => Err(format!("{other:?}: expected planned or lru")),
    }
}

/// Runs one hidden `bench loader-worker` process.
pub fn run_loader_worker(options: &str) -> Result<()> {
    let o = serde_json::from_str(options).context("parsing the loader worker's --options")?;
    print_json(&loader_bench::run_worker(&o)?)
}
