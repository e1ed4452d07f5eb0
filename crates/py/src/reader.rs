//! One process's reader of a Dataset (a DataLoader worker, or the main process
//! with `num_workers=0`): its own cache connection (made after the fork, in the
//! process that reads), the loader's sample drawing over it, and, with the planned
//! policy, the announcement of its rank's read order.
//!
//! Each reader announces its rank's order itself, from its own connection, when it
//! first reads a sample of an epoch (the training loader's `ReadOrderAnnouncer`,
//! with the reader's connection as the order's reader), and writes its progress as
//! it reads: a DataLoader's workers read interleaved batches of one order, so each
//! keeps the order of the whole rank with its own progress, and the cache's next
//! use of a record is the nearest over them. With `DATA.CACHE_PREFETCH` the first
//! worker's announcer also fills records ahead of the reads.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use vrtspike_data::cache::protocol::ClientId;
use vrtspike_data::cache::CacheClient;
use vrtspike_data::config::CachePolicy;
use vrtspike_data::dataset::index::DatasetIndex;
use vrtspike_data::dataset::record::RecordView;
use vrtspike_data::pipeline::announce::ReadOrderAnnouncer;
use vrtspike_data::pipeline::draw::{draw_sample, Drawn, SamplePlace};
use vrtspike_data::pipeline::read_order::ReadOrderSource;
use vrtspike_data::pipeline::sampler::DistributedSampler;
use vrtspike_data::pipeline::source::CacheCounters;
use vrtspike_data::pipeline::{CacheSource, DiskSource, PipelineError, RecordSource};

use crate::errors::Failure;
use crate::sampler::OrderKey;
use crate::settings::Opened;

/// Which DataLoader worker reads (`None` in the main process).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Worker {
    /// Its id, from 0.
    pub id: usize,
    /// Workers of the DataLoader.
    pub count: usize,
}

/// Where a reader's records come from.
enum Source {
    /// Straight from disk (no cache server for this Dataset).
    Disk(DiskSource),
    /// Through the node cache (from disk while its server is away).
    Cache(Box<CacheSource>),
}

impl RecordSource for Source {
    fn with_record<R>(
        &mut self,
        index: &DatasetIndex,
        seq: usize,
        frame: usize,
        read: &mut dyn FnMut(RecordView<'_>) -> Result<R, PipelineError>,
    ) -> Result<R, PipelineError> {
        match self {
            Source::Disk(disk) => disk.with_record(index, seq, frame, read),
            Source::Cache(cache) => cache.with_record(index, seq, frame, read),
        }
    }
}

/// The read order a reader announces, by the sampler settings it is for.
struct Announcing {
    key: OrderKey,
    /// `None` once the cache refused it (logged): the cache then evicts by LRU.
    announcer: Option<ReadOrderAnnouncer>,
}

/// What a reader has read so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReaderStats {
    /// Records found in the cache.
    pub hits: u64,
    /// Records filled into the cache by this reader.
    pub misses: u64,
    /// Records read from disk instead (no cache, or the cache could not take them).
    pub bypass: u64,
    /// Records prefetched ahead of their use.
    pub prefetched: u64,
    /// Bytes decoded from disk.
    pub disk_bytes: u64,
    /// Clips replaced under `DATA.SKIP_BAD_FRAMES`.
    pub replaced: u64,
    /// Whether it reads through a cache connection now.
    pub connected: bool,
}

/// One process's reader.
pub struct Reader {
    source: Source,
    address: Option<String>,
    label: String,
    /// Its connection's id (the read order's reader), when it connected at once.
    id: Option<ClientId>,
    counters: Arc<CacheCounters>,
    replaced: u64,
    announcing: Option<Announcing>,
}

impl Reader {
    /// A reader through the server at `address` (from disk when `None`), its
    /// connections labelled `label`. A server that does not answer leaves it
    /// reading from disk, trying again once a second (logged).
    pub fn open(address: Option<&str>, label: String) -> Reader {
        let counters = Arc::new(CacheCounters::default());
        let (source, id) = match address {
            None => (Source::Disk(DiskSource::default()), None),
            Some(address) => match CacheClient::connect(address, &label) {
                Ok(client) => {
                    let id = client.id();
                    let source = CacheSource::new(client, address, &label, counters.clone());
                    (Source::Cache(Box::new(source)), Some(id))
                }
                Err(error) => {
                    tracing::warn!(%error, address,
                        "this DataLoader worker cannot reach the cache server: reading from disk and connecting again");
                    let source = CacheSource::disconnected(address, &label, counters.clone());
                    (Source::Cache(Box::new(source)), None)
                }
            },
        };
        Reader {
            source,
            address: address.map(str::to_owned),
            label,
            id,
            counters,
            replaced: 0,
            announcing: None,
        }
    }

    /// The sample at `place`; with an `order` (the vrtspike sampler's) and the
    /// planned policy, the rank's read order is announced first (once an epoch) and
    /// this reader's progress written after.
    pub fn draw(
        &mut self,
        opened: &Opened,
        place: SamplePlace,
        order: Option<OrderKey>,
        worker: Option<Worker>,
    ) -> Result<Drawn, Failure> {
        if let Some(announcer) = order.and_then(|key| self.announcer(opened, key, worker)) {
            announcer.dispatching(place.epoch, place.position);
            announcer.dispatched(place.epoch, place.position + 1);
        }
        let drawn = draw_sample(
            &opened.index,
            &opened.clips,
            &opened.rules(),
            place,
            &mut self.source,
        )?;
        self.replaced += drawn.replaced as u64;
        let announced = self.announcing.as_ref().filter(|a| Some(a.key) == order);
        if let Some(announcer) = announced.and_then(|a| a.announcer.as_ref()) {
            announcer.consumed(place.epoch, place.position + 1);
        }
        Ok(drawn)
    }

    /// The announcer of `key`'s read order, connected when first needed (`None`
    /// without a cache, under LRU, or once the cache refused it).
    fn announcer(
        &mut self,
        opened: &Opened,
        key: OrderKey,
        worker: Option<Worker>,
    ) -> Option<&mut ReadOrderAnnouncer> {
        let address = self.address.as_deref()?;
        if opened.loader.cache_policy != CachePolicy::Planned {
            return None;
        }
        if self.announcing.as_ref().is_none_or(|a| a.key != key) {
            let announcer = connect_announcer(
                opened,
                key,
                worker,
                address,
                &self.label,
                self.id,
                &self.counters,
            );
            self.announcing = Some(Announcing { key, announcer });
        }
        self.announcing.as_mut().and_then(|a| a.announcer.as_mut())
    }

    /// What this reader has read so far.
    pub fn stats(&self) -> ReaderStats {
        let c = &self.counters;
        ReaderStats {
            hits: c.hits.load(Ordering::Relaxed),
            misses: c.misses.load(Ordering::Relaxed),
            bypass: c.bypass.load(Ordering::Relaxed),
            prefetched: c.prefetched.load(Ordering::Relaxed),
            disk_bytes: c.disk_bytes.load(Ordering::Relaxed),
            replaced: self.replaced,
            connected: matches!(&self.source, Source::Cache(cache) if cache.is_connected()),
        }
    }
}

/// The announcer of `key`'s read order over `opened`'s clips, the prefetch thread
/// with it for the first worker under `DATA.CACHE_PREFETCH`; `None` (logged) when
/// the sampler settings make no sampler or the cache cannot be reached.
fn connect_announcer(
    opened: &Opened,
    key: OrderKey,
    worker: Option<Worker>,
    address: &str,
    label: &str,
    reader: Option<ClientId>,
    counters: &Arc<CacheCounters>,
) -> Option<ReadOrderAnnouncer> {
    let sampler = match DistributedSampler::new(opened.clips.clips.len(), key.options()) {
        Ok(sampler) => sampler,
        Err(error) => {
            tracing::warn!(%error, "no read order to announce: the cache evicts by LRU");
            return None;
        }
    };
    // Every position of the rank's epoch is read (the DataLoader's batching, and
    // whether it drops an incomplete last batch, is not known here).
    let source = ReadOrderSource::new(opened.index.clone(), opened.clips.clone(), &sampler, None);
    let first = worker.is_none_or(|w| w.id == 0);
    let prefetch = (opened.loader.cache_prefetch && first).then(|| {
        let workers = worker.map_or(1, |w| w.count.max(1));
        let config = &opened.config;
        let factor = config.dataloader.train_prefetch_factor.max(1) as u64;
        factor * workers as u64 * config.train.batch_size.max(1) as u64
    });
    let connected = ReadOrderAnnouncer::connect(
        address,
        label,
        source,
        reader.into_iter().collect(),
        prefetch,
        counters.clone(),
    );
    match connected {
        Ok(announcer) => Some(announcer),
        Err(error) => {
            tracing::warn!(%error, "cannot announce this reader's read order; the cache evicts by LRU");
            None
        }
    }
}
