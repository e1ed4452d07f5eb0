//! The per-rank loader: worker threads build batches of samples in parallel,
//! reading records through the node cache (hits are zero-copy leases; a miss is
//! filled by the worker decoding straight into the reserved slot) or from disk
//! (`DATA.USE_RAM_CACHE: false`). Batches come out in sampler order from a
//! bounded prefetch window; the loader reports data_time and the cache hit rate.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use crate::cache::protocol::ClientId;
use crate::cache::{CacheClient, CacheError};
use crate::config::CachePolicy;
use crate::dataset::index::DatasetIndex;

use super::announce::ReadOrderAnnouncer;
use super::draw::{draw_sample, has_clips, DrawRules, SamplePlace};
use super::error::{PipelineError, Result};
use super::read_order::ReadOrderSource;
use super::sample::{ClipIndex, Sample, SampleSpec};
use super::sampler::{DistributedSampler, SamplerState};
use super::source::{CacheCounters, CacheSource, DiskSource, RecordSource};

/// Whether a loader worker of this process was refused a connection (and said so).
static REFUSAL_TOLD: AtomicBool = AtomicBool::new(false);

/// Validation loaders use at most this many of the rank's workers (full frames,
/// batch 1: more would only hold more frames in memory).
pub const MAX_VAL_WORKERS: usize = 2;

/// The loader settings of one rank, resolved once by the train layer (see
/// `train::loader_settings`): `TOTAL_WORKERS` split over the node's ranks (capped by
/// the memory plan for `auto`), the prefetch factors and `DROP_LAST`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoaderBudget {
    /// Worker threads of this rank (at least 1).
    pub workers: usize,
    /// Training batches queued ahead per worker (`TRAIN_PREFETCH_FACTOR`).
    pub train_prefetch_factor: usize,
    /// Validation batches queued ahead per worker (`VAL_PREFETCH_FACTOR`).
    pub val_prefetch_factor: usize,
    /// Drop the last incomplete training batch (`DROP_LAST`).
    pub drop_last: bool,
}

impl LoaderBudget {
    /// The budget of a rank that gets `workers` threads, with the prefetch factors
    /// and `DROP_LAST` of `config`.
    pub fn new(config: &crate::config::Config, workers: usize) -> LoaderBudget {
        let dl = &config.dataloader;
        LoaderBudget {
            workers: workers.max(1),
            train_prefetch_factor: dl.train_prefetch_factor.max(1) as usize,
            val_prefetch_factor: dl.val_prefetch_factor.max(1) as usize,
            drop_last: dl.drop_last,
        }
    }
}

/// What a loader feeds: training (random crops, augmentation, full batches) or
/// validation (centre or full-frame crops, batch 1, nothing dropped).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// Training batches.
    Train,
    /// Validation clips.
    Validate,
}

/// How a rank loads.
#[derive(Debug, Clone)]
pub struct LoaderOptions {
    /// Worker threads of this rank.
    pub workers: usize,
    /// Batches in flight or ready, ahead of the consumer (prefetch factor x workers).
    pub prefetch_batches: usize,
    /// Samples per batch.
    pub batch_size: usize,
    /// Drop the last incomplete batch of an epoch.
    pub drop_last_batch: bool,
    /// How samples are cut.
    pub spec: SampleSpec,
    /// Seed of crops and augmentation (with epoch, rank and position).
    pub seed: u64,
    /// This rank (mixes into the sample seeds).
    pub rank: usize,
    /// Cache server address; `None` reads from disk.
    pub cache_address: Option<String>,
    /// Label of this rank's cache clients in the server's stats.
    pub client_name: String,
    /// Replace a clip that fails to load with the next one (counted, reported).
    pub skip_bad: bool,
    /// With a cache: announce this rank's reads to it (`Planned`, training) or not.
    pub cache_policy: CachePolicy,
    /// With `Planned`: fill records ahead of the workers (a thread of its own).
    pub cache_prefetch: bool,
}

impl LoaderOptions {
    /// Options from the run config for `rank` with its resolved `budget`: training
    /// crops, augmentation, `TRAIN_PREFETCH_FACTOR` and `DROP_LAST`, or validation
    /// crops, batch 1, at most [`MAX_VAL_WORKERS`] workers and `VAL_PREFETCH_FACTOR`,
    /// as `purpose` says. `cache_address` is used only when `DATA.USE_RAM_CACHE` is true.
    pub fn from_config(
        config: &crate::config::Config,
        rank: usize,
        budget: &LoaderBudget,
        purpose: Purpose,
        cache_address: Option<String>,
    ) -> LoaderOptions {
        let train = purpose == Purpose::Train;
        let data = &config.data;
        let (workers, prefetch) = if train {
            (budget.workers, budget.train_prefetch_factor)
        } else {
            (
                budget.workers.min(MAX_VAL_WORKERS),
                budget.val_prefetch_factor,
            )
        };
        let crop = if train {
            super::sample::CropMode::Random(data.crop_size)
        } else {
            data.val_crop_size.map_or(
                super::sample::CropMode::Full,
                super::sample::CropMode::Center,
            )
        };
        LoaderOptions {
            workers,
            prefetch_batches: workers * prefetch,
            batch_size: if train {
                config.train.batch_size as usize
            } else {
                1
            },
            drop_last_batch: train && budget.drop_last,
            spec: SampleSpec {
                crop,
                augment: if train {
                    data.augment
                } else {
                    crate::config::Augment::all(false)
                },
                bins: data.spike_bins,
            },
            seed: config.train.seed,
            rank,
            cache_address: if data.use_ram_cache {
                cache_address
            } else {
                None
            },
            client_name: format!("rank{rank}"),
            skip_bad: data.skip_bad_frames,
            // Validation reads are no read order's: the cache keeps them only where no
            // training record needs the room.
            cache_policy: if train {
                data.cache_policy
            } else {
                CachePolicy::Lru
            },
            cache_prefetch: train && data.cache_prefetch,
        }
    }
}

impl LoaderOptions {
    /// How this rank's samples are drawn.
    pub fn draw_rules(&self) -> DrawRules {
        DrawRules {
            spec: self.spec,
            seed: self.seed,
            skip_bad: self.skip_bad,
        }
    }
}

/// A batch: samples of consecutive sampler positions.
#[derive(Debug, Clone)]
pub struct Batch {
    /// Epoch it belongs to.
    pub epoch: u64,
    /// Sampler position after its last sample (the resume point once consumed).
    pub end_position: usize,
    /// The samples, in sampler order.
    pub samples: Vec<Sample>,
}

/// Loader figures since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct LoaderStats {
    /// Batches handed to the consumer.
    pub batches: u64,
    /// Samples handed to the consumer.
    pub samples: u64,
    /// Total time the consumer waited for batches (data_time), in seconds.
    pub data_time_s: f64,
    /// Mean wait per batch, in milliseconds.
    pub data_time_ms: f64,
    /// Records found in the cache.
    pub cache_hits: u64,
    /// Records decoded and filled by this rank's workers.
    pub cache_misses: u64,
    /// Reads the cache could not take, decoded from disk into the worker's own
    /// buffer instead (the sample is served all the same).
    pub cache_bypass: u64,
    /// hits / (hits + misses) of this rank's reads.
    pub hit_rate: f64,
    /// Records the prefetch thread filled ahead of their use.
    pub cache_prefetched: u64,
    /// Bytes decoded from disk: misses, bypasses and prefetches.
    pub disk_bytes: u64,
    /// Clips replaced under `DATA.SKIP_BAD_FRAMES`.
    pub skipped: u64,
}

#[derive(Debug, Default)]
struct SharedCounters {
    reads: Arc<CacheCounters>,
    skipped: AtomicU64,
}

struct Task {
    seq_no: u64,
    epoch: u64,
    /// (sampler position, clip number)
    items: Vec<(usize, usize)>,
    end_position: usize,
}

type Done = (u64, Result<Batch>);

/// One rank's loader.
pub struct Loader {
    index: Arc<DatasetIndex>,
    sampler: DistributedSampler,
    options: LoaderOptions,
    tasks: Option<Sender<Task>>,
    done: Receiver<Done>,
    threads: Vec<JoinHandle<()>>,
    counters: Arc<SharedCounters>,
    next_seq_no: u64,
    next_to_yield: u64,
    ready: BTreeMap<u64, Result<Batch>>,
    consumed_position: usize,
    stats: LoaderStats,
    /// The planned policy's announcer (`None`: no cache, or LRU).
    announcer: Option<ReadOrderAnnouncer>,
    /// The clips and the workers' connections it announces for (to announce
    /// again when a restore changes how the current epoch is split).
    clips: Arc<ClipIndex>,
    readers: Vec<ClientId>,
}

/// A loader worker's connection to the cache server at `address`: none without an
/// address, nor when the server has no connection left for it (the worker reads
/// from disk; the first such worker of the process says so); an error when it
/// cannot connect otherwise.
fn connect_worker(
    address: Option<&str>,
    label: &str,
) -> std::result::Result<Option<CacheClient>, CacheError> {
    let Some(address) = address else {
        return Ok(None);
    };
    match CacheClient::connect(address, label) {
        Ok(client) => Ok(Some(client)),
        Err(err) if err.is_connection_refusal() => {
            if !REFUSAL_TOLD.swap(true, Ordering::Relaxed) {
                tracing::warn!(%err, address,
                    "a loader worker got no connection to the cache server (all its connections \
                     are taken): it reads from disk (`cache serve --connections` serves more; \
                     further refusals in this process are not logged)");
            }
            Ok(None)
        }
        Err(err) => Err(err),
    }
}

fn worker_loop<S: RecordSource>(
    mut source: S,
    index: &DatasetIndex,
    clips: &ClipIndex,
    options: &LoaderOptions,
    counters: &SharedCounters,
    tasks: Receiver<Task>,
    done: Sender<Done>,
) {
    let rules = options.draw_rules();
    for task in tasks {
        let mut samples = Vec::with_capacity(task.items.len());
        let mut failure = None;
        for &(position, clip) in &task.items {
            let place = SamplePlace {
                epoch: task.epoch,
                rank: options.rank,
                position,
                clip,
            };
            match draw_sample(index, clips, &rules, place, &mut source) {
                Ok(drawn) => {
                    counters
                        .skipped
                        .fetch_add(drawn.replaced as u64, Ordering::Relaxed);
                    samples.push(drawn.sample);
                }
                Err(err) => {
                    failure = Some(err);
                    break;
                }
            }
        }
        let result = match failure {
            Some(err) => Err(err),
            None => Ok(Batch {
                epoch: task.epoch,
                end_position: task.end_position,
                samples,
            }),
        };
        if done.send((task.seq_no, result)).is_err() {
            return;
        }
    }
}

impl Loader {
    /// Starts the worker threads (each with its own cache connection, made here so
    /// a missing server is reported now) for `sampler`'s rank.
    pub fn new(
        index: Arc<DatasetIndex>,
        clips: Arc<ClipIndex>,
        sampler: DistributedSampler,
        options: LoaderOptions,
    ) -> Result<Loader> {
        if options.workers == 0 || options.batch_size == 0 || options.prefetch_batches == 0 {
            return Err(PipelineError::Request(
                "loader needs at least one worker, batch size 1 and prefetch 1".into(),
            ));
        }
        has_clips(&index, &clips)?;
        let (task_tx, task_rx) = crossbeam_channel::unbounded::<Task>();
        let (done_tx, done_rx) = crossbeam_channel::unbounded::<Done>();
        let (ready_tx, ready_rx) =
            crossbeam_channel::bounded::<Result<Option<ClientId>>>(options.workers);
        let counters = Arc::new(SharedCounters::default());
        let mut threads = Vec::with_capacity(options.workers);
        for w in 0..options.workers {
            let (index, clips, options_w, counters) = (
                index.clone(),
                clips.clone(),
                options.clone(),
                counters.clone(),
            );
            let (tasks, done, ready) = (task_rx.clone(), done_tx.clone(), ready_tx.clone());
            let name = super::node_workers::worker_name(options.rank, w);
            let label = format!("{}/{name}", options.client_name);
            let handle = std::thread::Builder::new()
                .name(name.clone())
                .spawn(
                    move || match connect_worker(options_w.cache_address.as_deref(), &label) {
                        Ok(Some(client)) => {
                            let _ = ready.send(Ok(Some(client.id())));
                            let address = client.address().to_string();
                            let reads = counters.reads.clone();
                            let source = CacheSource::new(client, &address, &label, reads);
                            worker_loop(source, &index, &clips, &options_w, &counters, tasks, done);
                        }
                        Ok(None) => {
                            let _ = ready.send(Ok(None));
                            let source = DiskSource::default();
                            worker_loop(source, &index, &clips, &options_w, &counters, tasks, done);
                        }
                        Err(err) => {
                            let _ = ready.send(Err(err.into()));
                        }
                    },
                )
                .map_err(|e| PipelineError::Request(format!("cannot start loader thread: {e}")))?;
            threads.push(handle);
        }
        let mut loader = Loader {
            index,
            sampler,
            options,
            tasks: Some(task_tx),
            done: done_rx,
            threads,
            counters,
            next_seq_no: 0,
            next_to_yield: 0,
            ready: BTreeMap::new(),
            consumed_position: 0,
            stats: LoaderStats::default(),
            announcer: None,
            clips,
            readers: Vec::new(),
        };
        let mut readers = Vec::with_capacity(loader.options.workers);
        for _ in 0..loader.options.workers {
            match ready_rx.recv_timeout(Duration::from_secs(60)) {
                Ok(Ok(client)) => readers.extend(client),
                Ok(Err(err)) => return Err(err),
                Err(_) => return Err(PipelineError::Request("loader worker did not start".into())),
            }
        }
        loader.readers = readers;
        loader.announcer = loader.connect_announcer();
        loader.consumed_position = loader.sampler.position();
        Ok(loader)
    }

    /// The planned policy's announcer when reading through a cache with
    /// `CachePolicy::Planned`; a failure leaves the cache's LRU (logged).
    fn connect_announcer(&self) -> Option<ReadOrderAnnouncer> {
        let address = self.options.cache_address.as_deref()?;
        if self.options.cache_policy != CachePolicy::Planned {
            return None;
        }
        let dropped_batch = self
            .options
            .drop_last_batch
            .then_some(self.options.batch_size);
        let source = ReadOrderSource::new(
            self.index.clone(),
            self.clips.clone(),
            &self.sampler,
            dropped_batch,
        );
        let feed = ReadOrderAnnouncer::connect(
            address,
            &self.options.client_name,
            source,
            self.readers.clone(),
            // As many samples ahead of the workers as they have in flight.
            self.options
                .cache_prefetch
                .then_some((self.options.prefetch_batches * self.options.batch_size) as u64),
            self.counters.reads.clone(),
        );
        match feed {
            Ok(feed) => Some(feed),
            Err(error) => {
                tracing::warn!(%error, "cannot announce this rank's reads to the cache; it evicts by LRU");
                None
            }
        }
    }

    /// The dataset index it reads.
    pub fn index(&self) -> &DatasetIndex {
        &self.index
    }

    /// Starts `epoch` from its beginning (dropping what was prefetched of another).
    pub fn set_epoch(&mut self, epoch: u64) {
        self.drain();
        self.sampler.set_epoch(epoch);
        self.consumed_position = 0;
    }

    /// The sampler cursor as of the batches consumed so far (prefetched ones not
    /// counted): save it in a checkpoint.
    pub fn state(&self) -> SamplerState {
        let mut state = self.sampler.state();
        state.position = self.consumed_position;
        state
    }

    /// Continues from a saved cursor (of this world, or of another: see
    /// [`DistributedSampler::restore`]). The read order is announced again when the
    /// current epoch is split anew (its head taken by another world).
    pub fn restore(&mut self, state: &SamplerState) -> Result<()> {
        self.drain();
        self.sampler.restore(state)?;
        self.consumed_position = self.sampler.position();
        if self.announcer.is_some() && self.sampler.state().epoch_start > 0 {
            self.announcer = None;
            self.announcer = self.connect_announcer();
        }
        Ok(())
    }

    /// Waits for what is in flight and forgets it.
    fn drain(&mut self) {
        while self.next_to_yield < self.next_seq_no {
            if self.ready.remove(&self.next_to_yield).is_none() {
                match self.done.recv() {
                    Ok((seq_no, result)) => {
                        self.ready.insert(seq_no, result);
                        continue;
                    }
                    Err(_) => break,
                }
            }
            self.next_to_yield += 1;
        }
        self.ready.clear();
        self.next_to_yield = self.next_seq_no;
    }

    /// Sends the next batch of sampler positions to the workers; false at epoch end.
    fn dispatch_one(&mut self) -> bool {
        if let Some(announcer) = &mut self.announcer {
            announcer.dispatching(self.sampler.epoch(), self.sampler.position());
        }
        let mut items = Vec::with_capacity(self.options.batch_size);
        while items.len() < self.options.batch_size {
            match self.sampler.next_index() {
                Some(pair) => items.push(pair),
                None => break,
            }
        }
        if items.is_empty()
            || (self.options.drop_last_batch && items.len() < self.options.batch_size)
        {
            return false;
        }
        let task = Task {
            seq_no: self.next_seq_no,
            epoch: self.sampler.epoch(),
            items,
            end_position: self.sampler.position(),
        };
        let Some(tasks) = &self.tasks else {
            return false;
        };
        if tasks.send(task).is_err() {
            return false;
        }
        self.next_seq_no += 1;
        if let Some(announcer) = &self.announcer {
            announcer.dispatched(self.sampler.epoch(), self.sampler.position());
        }
        true
    }

    /// The next batch of the current epoch, or `None` at its end (then call
    /// [`Self::set_epoch`]). Blocks while workers are behind; that wait is data_time.
    pub fn next_batch(&mut self) -> Option<Result<Batch>> {
        while self.next_seq_no - self.next_to_yield < self.options.prefetch_batches as u64 {
            if !self.dispatch_one() {
                break;
            }
        }
        if self.next_to_yield == self.next_seq_no {
            return None;
        }
        let start = Instant::now();
        let result = loop {
            if let Some(result) = self.ready.remove(&self.next_to_yield) {
                break result;
            }
            match self.done.recv() {
                Ok((seq_no, result)) => {
                    self.ready.insert(seq_no, result);
                }
                Err(_) => break Err(PipelineError::Request("loader workers stopped".into())),
            }
        };
        self.next_to_yield += 1;
        self.stats.data_time_s += start.elapsed().as_secs_f64();
        if let Ok(batch) = &result {
            self.consumed_position = batch.end_position;
            self.stats.batches += 1;
            self.stats.samples += batch.samples.len() as u64;
            if let Some(announcer) = &self.announcer {
                announcer.consumed(batch.epoch, batch.end_position);
            }
        }
        // Keep the window full.
        while self.next_seq_no - self.next_to_yield < self.options.prefetch_batches as u64 {
            if !self.dispatch_one() {
                break;
            }
        }
        Some(result)
    }

    /// Figures since the loader started.
    pub fn stats(&self) -> LoaderStats {
        let mut stats = self.stats;
        stats.cache_hits = self.counters.reads.hits.load(Ordering::Relaxed);
        stats.cache_misses = self.counters.reads.misses.load(Ordering::Relaxed);
        stats.cache_bypass = self.counters.reads.bypass.load(Ordering::Relaxed);
        stats.cache_prefetched = self.counters.reads.prefetched.load(Ordering::Relaxed);
        stats.disk_bytes = self.counters.reads.disk_bytes.load(Ordering::Relaxed);
        stats.skipped = self.counters.skipped.load(Ordering::Relaxed);
        let reads = stats.cache_hits + stats.cache_misses;
        stats.hit_rate = if reads > 0 {
            stats.cache_hits as f64 / reads as f64
        } else {
            0.0
        };
        stats.data_time_ms = if stats.batches > 0 {
            stats.data_time_s * 1000.0 / stats.batches as f64
        } else {
            0.0
        };
        stats
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        // The prefetch thread first: it decodes as the workers do.
        self.announcer = None;
        self.tasks = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_follow_the_budget_and_config() {
        let config = crate::config::Config::parse(
            "DATA:\n  USE_RAM_CACHE: false\n  VAL_CROP_SIZE: null\nDATALOADER:\n  TOTAL_WORKERS: 8\n  TRAIN_PREFETCH_FACTOR: 3\nTRAIN:\n  BATCH_SIZE: 4\n",
            std::path::Path::new("t.yaml"),
        )
        .unwrap();
        let budget = LoaderBudget::new(&config, 4);
        assert_eq!(
            (budget.train_prefetch_factor, budget.val_prefetch_factor),
            (3, 2)
        );
        assert!(budget.drop_last);
        let train =
            LoaderOptions::from_config(&config, 1, &budget, Purpose::Train, Some("addr".into()));
        assert_eq!(
            (train.workers, train.prefetch_batches, train.batch_size),
            (4, 12, 4)
        );
        assert!(train.drop_last_batch);
        assert_eq!(
            train.cache_address, None,
            "USE_RAM_CACHE: false reads from disk"
        );
        assert_eq!(train.spec.crop, super::super::sample::CropMode::Random(256));
        let val = LoaderOptions::from_config(&config, 1, &budget, Purpose::Validate, None);
        assert_eq!(val.spec.crop, super::super::sample::CropMode::Full);
        assert_eq!(
            (val.workers, val.prefetch_batches, val.batch_size),
            (2, 4, 1)
        );
        assert!(!val.drop_last_batch);
        let keep = config
            .with_overrides(&["DATALOADER.DROP_LAST=false".into()])
            .unwrap();
        let budget = LoaderBudget::new(&keep, 4);
        let train = LoaderOptions::from_config(&keep, 1, &budget, Purpose::Train, None);
        assert!(!train.drop_last_batch);
        assert_eq!(val.spec.augment, crate::config::Augment::all(false));
    }
}
