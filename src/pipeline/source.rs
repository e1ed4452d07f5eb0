//! Where a sample's records come from: the [`RecordSource`] interface, the disk
//! ([`DiskSource`], `DATA.USE_RAM_CACHE: false`) and the node cache
//! ([`CacheSource`]: a hit is a zero-copy lease, a miss is filled by decoding the
//! frame straight into the reserved room). When the cache cannot take or give a
//! record (no room while everything is pinned, no memory on the node, a fill that
//! did not finish in time: any refusal but a protocol error), the record is decoded
//! into the worker's own buffer instead and counted as a bypass: never a failed
//! batch.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::cache::{CacheClient, CacheError, FillTicket, Lease, Lookup};
use crate::dataset::index::DatasetIndex;
use crate::dataset::record::RecordView;

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
    client: CacheClient,
    counters: Arc<CacheCounters>,
    /// Where a record goes when the cache cannot take it.
    fallback: DiskSource,
}

impl CacheSource {
    /// A source over `client`, counting its hits and misses in `counters`.
    pub fn new(client: CacheClient, counters: Arc<CacheCounters>) -> CacheSource {
        CacheSource {
            client,
            counters,
            fallback: DiskSource::default(),
        }
    }
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
        Err(err) if err.is_bypassable() => Ok(None),
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
        let lease = match lookup(&self.client, &key)? {
            Some(Lookup::Hit(lease)) => {
                self.counters.hits.fetch_add(1, Ordering::Relaxed);
                Some(lease)
            }
            Some(Lookup::Miss(ticket)) => {
                self.counters.misses.fetch_add(1, Ordering::Relaxed);
                let lease = fill(index, seq, frame, ticket)?;
                if lease.is_some() {
                    let len = index.record_layout(seq, frame).byte_len() as u64;
                    self.counters.disk_bytes.fetch_add(len, Ordering::Relaxed);
                }
                lease
            }
            None => None,
        };
        match lease {
            Some(lease) => read(RecordView::parse(&lease, &key)?),
            None => {
                self.counters.bypass.fetch_add(1, Ordering::Relaxed);
                let len = index.record_layout(seq, frame).byte_len() as u64;
                self.counters.disk_bytes.fetch_add(len, Ordering::Relaxed);
                self.fallback.with_record(index, seq, frame, read)
            }
        }
    }
}
