//! Where a sample's records come from: the [`RecordSource`] interface, the disk
//! ([`DiskSource`], `DATA.USE_RAM_CACHE: false`) and the node cache
//! ([`CacheSource`]: a hit is a zero-copy lease, a miss is filled by decoding the
//! frame straight into the reserved room). When the cache cannot take or give a
//! record (no room while everything is pinned, no memory on the node, a fill that
//! did not finish in time: any refusal but a protocol error), the record is decoded
//! into the worker's own buffer instead and counted as a bypass: never a failed
//! batch. So is a cached record whose header is not the layout the reader expects
//! of the frame (another build's record, or files changed under the same key),
//! counted as a layout mismatch in the server's stats too.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::cache::{CacheClient, CacheError, ClientOptions, FillTicket, Lease, Lookup};
use crate::dataset::index::DatasetIndex;
use crate::dataset::record::{RecordLayout, RecordView};

use super::error::Result;

/// Gives access to the compact record of a frame: from the node cache (zero-copy
/// lease) or decoded from disk.
pub trait RecordSource {
    /// Calls `read` with the record of frame `frame` of sequence `seq`.
    fn with_record<R>(
        &mut self,
        index: &DatasetIndex,
        seq: usize,
        frame: usize,
        read: &mut dyn FnMut(RecordView<'_>) -> Result<R>,
    ) -> Result<R>;
}

/// Reads every record from disk into one reused buffer (`DATA.USE_RAM_CACHE: false`).
#[derive(Debug, Default)]
pub struct DiskSource {
    buffer: Vec<u8>,
}

impl RecordSource for DiskSource {
    fn with_record<R>(
        &mut self,
        index: &DatasetIndex,
        seq: usize,
        frame: usize,
        read: &mut dyn FnMut(RecordView<'_>) -> Result<R>,
    ) -> Result<R> {
        let len = index.record_layout(seq, frame).byte_len();
        self.buffer.resize(len, 0);
        index.encode_into(seq, frame, &mut self.buffer)?;
        read(RecordView::parse(
            &self.buffer,
            &index.record_key(seq, frame),
        )?)
    }
}

/// Hits, misses and bypasses of the cache reads of one loader (all its workers).
#[derive(Debug, Default)]
pub struct CacheCounters {
    /// Records found in the cache.
    pub hits: AtomicU64,
    /// Records decoded from disk into the cache.
    pub misses: AtomicU64,
    /// Reads the cache could not take, decoded into a worker's own buffer.
    pub bypass: AtomicU64,
    /// Records the loader's prefetch thread filled ahead of their use.
    pub prefetched: AtomicU64,
    /// Bytes of records decoded from disk (misses, bypasses and prefetches).
    pub disk_bytes: AtomicU64,
}

/// Reads through the node cache with one worker's own connection.
pub struct CacheSource {
    /// The connection; `None` while the server is gone (records come from disk).
    client: Option<CacheClient>,
    /// Where to connect again, and as whom.
    address: String,
    name: String,
    /// When to try connecting again, or (connected) to look whether the server
    /// is still there.
    retry_at: Instant,
    counters: Arc<CacheCounters>,
    /// Where a record goes when the cache cannot take it.
    fallback: DiskSource,
    /// Whether a cached record of another layout than expected was logged.
    mismatch_warned: bool,
}

/// How often a loader without its server tries to reach one again.
const RECONNECT_EVERY: Duration = Duration::from_secs(1);

impl CacheSource {
    /// A source over `client` (connected to `address` as `name`), counting its hits
    /// and misses in `counters`. When the server goes away (a node-shared one
    /// killed, say), records come from disk and the source connects again, once a
    /// second, to whatever server then listens at `address`.
    pub fn new(
        client: CacheClient,
        address: &str,
        name: &str,
        counters: Arc<CacheCounters>,
    ) -> CacheSource {
        CacheSource {
            client: Some(client),
            retry_at: Instant::now(),
            ..CacheSource::disconnected(address, name, counters)
        }
    }

    /// A source with no connection yet (the first one failed, or the server was
    /// not up): records come from disk, counted as bypasses, and it connects to
    /// `address` as `name` once a second until a server answers.
    pub fn disconnected(address: &str, name: &str, counters: Arc<CacheCounters>) -> CacheSource {
        CacheSource {
            client: None,
            address: address.to_string(),
            name: name.to_string(),
            retry_at: Instant::now() + RECONNECT_EVERY,
            counters,
            fallback: DiskSource::default(),
            mismatch_warned: false,
        }
    }

    /// Whether it has a connection now (else records come from disk).
    pub fn is_connected(&self) -> bool {
        self.client.is_some()
    }

    /// The connection was lost: read from disk until a new one is made.
    fn lost(&mut self, error: &CacheError) {
        if self.client.take().is_some() {
            tracing::warn!(%error, address = %self.address,
                "the loader lost its cache server: reading from disk and connecting again");
        }
        self.retry_at = Instant::now() + RECONNECT_EVERY;
    }

    /// The record through the cache (from disk when the cache declines, or while
    /// there is no connection); [`Cached::Lost`] when the connection is lost.
    fn through_cache<R>(
        &mut self,
        index: &DatasetIndex,
        seq: usize,
        frame: usize,
        key: &str,
        read: &mut dyn FnMut(RecordView<'_>) -> Result<R>,
    ) -> Result<Cached<R>> {
        let CacheSource {
            client,
            counters,
            fallback,
            mismatch_warned,
            ..
        } = self;
        let Some(client) = client.as_ref() else {
            return from_disk(counters, fallback, index, seq, frame, read).map(Cached::Done);
        };
        let lease = match lookup(client, key) {
            Err(err) if err.is_server_gone() => return Ok(Cached::Lost(err)),
            Err(err) => return Err(err.into()),
            Ok(Some(Lookup::Hit(lease))) => {
                let expected = index.record_layout(seq, frame);
                if let Some(found) = layout_mismatch(&lease, key, expected) {
                    client.count_layout_mismatch();
                    if !std::mem::replace(mismatch_warned, true) {
                        tracing::warn!(key, ?expected, %found,
                            "a cached record is not laid out as this reader expects (another \
                             build's, or its files changed): reading it from disk (counted as a \
                             layout mismatch in `cache stats`; further ones are not logged)");
                    }
                    None
                } else {
                    counters.hits.fetch_add(1, Ordering::Relaxed);
                    Some(lease)
                }
            }
            Ok(Some(Lookup::Miss(ticket))) => {
                counters.misses.fetch_add(1, Ordering::Relaxed);
                let lease = fill(index, seq, frame, ticket)?;
                if lease.is_some() {
                    let len = index.record_layout(seq, frame).byte_len() as u64;
                    counters.disk_bytes.fetch_add(len, Ordering::Relaxed);
                }
                lease
            }
            Ok(None) => None,
        };
        match lease {
            Some(lease) => read(RecordView::parse(&lease, key)?).map(Cached::Done),
            None => from_disk(counters, fallback, index, seq, frame, read).map(Cached::Done),
        }
    }

    /// Once a second: a connection whose server has gone is dropped; without one,
    /// a new one is tried.
    fn reconnect_if_due(&mut self) {
        if Instant::now() < self.retry_at {
            return;
        }
        if let Some(client) = &self.client {
            if client.server_gone() {
                let gone = CacheError::ServerGone {
                    address: self.address.clone(),
                };
                self.lost(&gone);
            } else {
                self.retry_at = Instant::now() + RECONNECT_EVERY;
            }
            return;
        }
        let quick = ClientOptions::from_env().map(|o| o.waiting(RECONNECT_EVERY));
        match quick.and_then(|o| CacheClient::connect_with(&self.address, &self.name, &o)) {
            Ok(client) => {
                tracing::info!(address = %self.address, "the loader reached a cache server again");
                self.client = Some(client);
            }
            Err(_) => self.retry_at = Instant::now() + RECONNECT_EVERY,
        }
    }
}

/// How a cached record differs from the `expected` layout of its frame (its
/// header, or why it has none); `None` when it is that layout.
fn layout_mismatch(record: &[u8], key: &str, expected: RecordLayout) -> Option<String> {
    match RecordLayout::parse(record, key) {
        Ok(layout) if layout == expected => None,
        Ok(layout) => Some(format!("{layout:?}")),
        Err(error) => Some(error.to_string()),
    }
}

/// Record `frame` of `seq` from disk through `fallback`, counted as a bypass.
fn from_disk<R>(
    counters: &CacheCounters,
    fallback: &mut DiskSource,
    index: &DatasetIndex,
    seq: usize,
    frame: usize,
    read: &mut dyn FnMut(RecordView<'_>) -> Result<R>,
) -> Result<R> {
    counters.bypass.fetch_add(1, Ordering::Relaxed);
    let len = index.record_layout(seq, frame).byte_len() as u64;
    counters.disk_bytes.fetch_add(len, Ordering::Relaxed);
    fallback.with_record(index, seq, frame, read)
}

/// A read through the cache: done, or the connection was lost first.
enum Cached<R> {
    Done(R),
    Lost(CacheError),
}

/// Decodes frame `frame` of `seq` into the room reserved for `ticket` and commits
/// it; `None` when the cache cannot take the record (the fill is abandoned, so
/// waiters retry).
fn fill<'c>(
    index: &DatasetIndex,
    seq: usize,
    frame: usize,
    mut ticket: FillTicket<'c>,
) -> Result<Option<Lease<'c>>> {
    let len = index.record_layout(seq, frame).byte_len();
    match ticket.reserve(len as u64) {
        Ok(()) => {}
        Err(err) if err.is_server_gone() => return Ok(None),
        Err(err) if err.is_bypassable() => {
            tracing::debug!(error = %err, "the cache cannot take this record: reading it from disk");
            ticket.abort()?;
            return Ok(None);
        }
        Err(err) => return Err(err.into()),
    }
    if let Err(err) = index.encode_into(seq, frame, ticket.slot_mut()?) {
        ticket.abort()?;
        return Err(err.into());
    }
    match ticket.commit() {
        Ok(lease) => Ok(Some(lease)),
        Err(err) if err.is_bypassable() || err.is_server_gone() => Ok(None),
        Err(err) => Err(err.into()),
    }
}

/// A lookup, or `None` when the cache cannot give the record now (a refusal other
/// than a protocol error: see [`CacheError::is_bypassable`]).
fn lookup<'c>(
    client: &'c CacheClient,
    key: &str,
) -> std::result::Result<Option<Lookup<'c>>, CacheError> {
    match client.get(key) {
        Ok(lookup) => Ok(Some(lookup)),
        Err(err) if err.is_bypassable() => {
            tracing::debug!(error = %err, "the cache cannot give this record: reading it from disk");
            Ok(None)
        }
        Err(err) => Err(err),
    }
}

impl RecordSource for CacheSource {
    fn with_record<R>(
        &mut self,
        index: &DatasetIndex,
        seq: usize,
        frame: usize,
        read: &mut dyn FnMut(RecordView<'_>) -> Result<R>,
    ) -> Result<R> {
        let key = index.record_key(seq, frame);
        self.reconnect_if_due();
        match self.through_cache(index, seq, frame, &key, read)? {
            Cached::Done(value) => Ok(value),
            Cached::Lost(error) => {
                self.lost(&error);
                from_disk(&self.counters, &mut self.fallback, index, seq, frame, read)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{spawn_server, ServerConfig};
    use crate::dataset::IndexOptions;
    use crate::synth::{self, SynthOptions};

    #[test]
    fn a_disconnected_source_reads_from_disk_until_a_server_answers() {
        let dir = tempfile::tempdir().unwrap();
        let options = SynthOptions {
            train_seqs: 1,
            test_seqs: 0,
            frames: 2,
            height: 32,
            width: 48,
            seed: 1,
        };
        synth::generate_folder(dir.path(), &options, &|_| {}).unwrap();
        let index =
            DatasetIndex::open_folder(dir.path(), "train", IndexOptions::default()).unwrap();
        let address = crate::cache::default_address(&format!(
            "source-test-{}-{}",
            std::process::id(),
            rand::random::<u32>()
        ));
        let counters = Arc::new(CacheCounters::default());
        let mut source = CacheSource::disconnected(&address, "test", counters.clone());
        let len = |source: &mut CacheSource| {
            source
                .with_record(&index, 0, 0, &mut |view| Ok(view.blur().len()))
                .unwrap()
        };
        let expected = len(&mut source);
        assert!(!source.is_connected());
        assert_eq!(counters.bypass.load(Ordering::Relaxed), 1, "read from disk");
        let _server = spawn_server(ServerConfig::new(&address, 16 << 20)).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !source.is_connected() {
            assert!(Instant::now() < deadline, "never connected to {address}");
            std::thread::sleep(Duration::from_millis(50));
            assert_eq!(len(&mut source), expected);
        }
        assert_eq!(len(&mut source), expected);
        assert!(
            counters.misses.load(Ordering::Relaxed) + counters.hits.load(Ordering::Relaxed) >= 1,
            "a read went through the cache once connected"
        );
    }
}
