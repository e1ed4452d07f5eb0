//! Where a sample's records come from: the [`RecordSource`] interface, the disk
//! ([`DiskSource`], `DATA.USE_RAM_CACHE: false`) and the node cache
//! ([`CacheSource`]: a hit is a zero-copy lease, a miss is filled by decoding the
//! frame straight into the reserved slot; when the node has no memory left for a new
//! slot, the record is decoded into the worker's own buffer instead).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::cache::{CacheClient, CacheError, FillTicket, Lease, Lookup, RequestError};
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

/// Hits and misses of the cache reads of one loader (all its workers).
#[derive(Debug, Default)]
pub struct CacheCounters {
    /// Records found in the cache.
    pub hits: AtomicU64,
    /// Records decoded from disk into the cache.
    pub misses: AtomicU64,
    /// Reads the cache could not take, decoded into a worker's own buffer.
    pub bypass: AtomicU64,
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

/// Whether the server refused a slot because the node has no memory for it.
fn out_of_memory(err: &CacheError) -> bool {
    matches!(
        err,
        CacheError::Refused {
            error: RequestError::OutOfMemory { .. },
            ..
        }
    )
}

/// Decodes frame `frame` of `seq` into the slot of `ticket` and commits it; `None`
/// when the node had no memory for the slot (the fill is abandoned, so waiters retry).
fn fill<'c>(
    index: &DatasetIndex,
    seq: usize,
    frame: usize,
    mut ticket: FillTicket<'c>,
) -> Result<Option<Lease<'c>>> {
    let len = index.record_layout(seq, frame).byte_len();
    match ticket.reserve(len as u64) {
        Ok(()) => {}
        Err(err) if out_of_memory(&err) => {
            tracing::debug!(error = %err, "no memory for a cache slot: decoding uncached");
            ticket.abort()?;
            return Ok(None);
        }
        Err(err) => return Err(err.into()),
    }
    if let Err(err) = index.encode_into(seq, frame, ticket.slot_mut()?) {
        ticket.abort()?;
        return Err(err.into());
    }
    Ok(Some(ticket.commit()?))
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
        let lease = match self.client.get(&key)? {
            Lookup::Hit(lease) => {
                self.counters.hits.fetch_add(1, Ordering::Relaxed);
                lease
            }
            Lookup::Miss(ticket) => {
                self.counters.misses.fetch_add(1, Ordering::Relaxed);
                match fill(index, seq, frame, ticket)? {
                    Some(lease) => lease,
                    None => {
                        self.counters.bypass.fetch_add(1, Ordering::Relaxed);
                        return self.fallback.with_record(index, seq, frame, read);
                    }
                }
            }
        };
        read(RecordView::parse(&lease, &key)?)
    }
}
