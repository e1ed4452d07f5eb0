//! What a client holds on a record: a [`Lease`], a pin on a cached record read
//! in place (taken straight from the shared index on a hit, with no message, or
//! from the server's grant), and a [`FillTicket`], the right to fill one key in the
//! extent the server reserved, mapped writable for that fill alone.

use std::ops::Deref;

use super::super::pins::LeaseWord;
use super::super::protocol::{LeaseGrant, LeaseId, Reply, Request, RequestError, TicketId};
use super::super::shm::FillMap;
use super::super::table::{self, SlotCode, MAX_KEY_BYTES};
use super::super::CacheError;
use super::CacheClient;

impl CacheClient {
    /// A lease on a grant whose entry the server wrote in this connection's page.
    pub(super) fn lease(&self, grant: LeaseGrant) -> Result<Lease<'_>, CacheError> {
        let word = LeaseWord(grant.lease);
        match self.range(grant.offset, grant.len) {
            Ok(ptr) => Ok(Lease {
                client: self,
                word,
                offset: grant.offset,
                len: grant.len,
                ptr,
                waited: false,
            }),
            Err(e) => {
                self.own.page().release(word);
                Err(e)
            }
        }
    }

    /// A record's bytes in the arena.
    fn range(&self, offset: u64, len: u64) -> Result<*const u8, CacheError> {
        if offset
            .checked_add(len)
            .is_none_or(|end| end > self.arena_bytes)
        {
            return Err(CacheError::BadGrant {
                offset,
                len,
                store_len: self.arena_bytes,
            });
        }
        self.mapping.range(offset, len)
    }

    /// A lease on `key` straight from the shared index, with no message: take a
    /// lease in this connection's page, then check that the slot is Ready and holds
    /// `key`; `None` sends the caller to the server (a miss, a fill in flight, an
    /// eviction racing with us, no lease left).
    pub(super) fn hit_in_shared_memory(&self, key: &str) -> Option<Lease<'_>> {
        if key.len() > MAX_KEY_BYTES {
            return None;
        }
        let page = self.own.page();
        for slot in self.table.candidates(table::key_hash(key)) {
            let word = page.take(slot).ok()?;
            let state = self.table.state(slot);
            let usable = state.is_some_and(|s| s.code == SlotCode::Ready)
                && page.owner() == self.id
                && self.table.key_is(slot, key);
            let (offset, len) = (self.table.offset(slot), self.table.record_len(slot));
            match usable.then(|| self.range(offset, len).ok()).flatten() {
                Some(ptr) => {
                    page.record_read(slot);
                    page.count_hit();
                    self.shared_hits.set(self.shared_hits.get() + 1);
                    return Some(Lease {
                        client: self,
                        word,
                        offset,
                        len,
                        ptr,
                        waited: false,
                    });
                }
                None => {
                    page.release(word);
                }
            }
        }
        None
    }
}

/// A pinned record: derefs to its bytes in shared memory, released when dropped.
pub struct Lease<'c> {
    client: &'c CacheClient,
    word: LeaseWord,
    offset: u64,
    len: u64,
    ptr: *const u8,
    /// Whether the get that returned this lease found the key being filled by another
    /// client and waited for that fill.
    waited: bool,
}

impl Lease<'_> {
    /// This lease, from a get that waited for another client's fill.
    pub(super) fn after_a_wait(mut self) -> Self {
        self.waited = true;
        self
    }

    /// The lease's id.
    pub fn id(&self) -> LeaseId {
        self.word.0
    }

    /// Whether the get that returned this lease found the key being filled by another
    /// client and waited for that fill (single flight), rather than finding it cached.
    pub fn waited_for_fill(&self) -> bool {
        self.waited
    }

    /// The record's offset in the store (for diagnostics).
    pub fn offset(&self) -> u64 {
        self.offset
    }
}

impl Deref for Lease<'_> {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr..ptr+len` lies inside the arena of the read-only mapping
        // (checked by `CacheClient::range`), which outlives the client this lease
        // borrows; the record is committed and this lease's entry in the
        // connection's page pins it, so the server hands its extent to no writer
        // until the entry is released (at the lease's drop, or when the client is
        // gone: never while this borrow lives).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len as usize) }
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        // A no-op if this exact lease was released already (through the protocol).
        self.client.own.page().release(self.word);
    }
}

/// The right to fill one key after a miss: reserve, write, commit. Dropped without
/// a commit, the fill is abandoned and other clients waiting for the key retry.
pub struct FillTicket<'c> {
    client: &'c CacheClient,
    ticket: TicketId,
    key: String,
    /// The reserved extent, mapped writable until the commit.
    fill: Option<FillMap>,
    finished: bool,
}

impl<'c> FillTicket<'c> {
    /// `client`'s ticket `ticket` to fill `key`, its extent not mapped yet.
    pub(super) fn new(client: &'c CacheClient, ticket: TicketId, key: &str) -> FillTicket<'c> {
        FillTicket {
            client,
            ticket,
            key: key.to_string(),
            fill: None,
            finished: false,
        }
    }

    /// Maps the extent the server reserved for this fill, writable.
    pub(super) fn map_extent(&mut self, offset: u64, len: u64) -> Result<(), CacheError> {
        let client = self.client;
        self.fill = Some(client.mapping.fill_map(offset, len, client.arena_bytes)?);
        Ok(())
    }

    /// The key being filled.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Reserves room for a record of exactly `len` bytes and maps it writable.
    pub fn reserve(&mut self, len: u64) -> Result<(), CacheError> {
        match self.client.request(Request::Reserve {
            ticket: self.ticket,
            len,
        })? {
            Reply::Reserved { offset, len, .. } => self.map_extent(offset, len),
            Reply::Declined => Err(CacheError::Refused {
                request: "reserve",
                error: RequestError::Declined {
                    key: self.key.clone(),
                },
            }),
            other => Err(CacheClient::unexpected("reserve", other)),
        }
    }

    /// The reserved record's bytes, to write the record into.
    pub fn slot_mut(&mut self) -> Result<&mut [u8], CacheError> {
        match &mut self.fill {
            Some(fill) => Ok(fill.bytes_mut()),
            None => Err(CacheError::NotReserved {
                key: self.key.clone(),
            }),
        }
    }

    /// Writes `bytes` at `offset` in the record; a write past the reserved length is
    /// refused and writes nothing.
    pub fn write_at(&mut self, offset: u64, bytes: &[u8]) -> Result<(), CacheError> {
        let key = self.key.clone();
        let slot = self.slot_mut()?;
        let slot_len = slot.len() as u64;
        let end = offset.checked_add(bytes.len() as u64);
        if end.is_none_or(|end| end > slot_len) {
            return Err(CacheError::WriteOutOfSlot {
                key,
                offset,
                len: bytes.len() as u64,
                slot_len,
            });
        }
        slot[offset as usize..offset as usize + bytes.len()].copy_from_slice(bytes);
        Ok(())
    }

    /// Publishes the record and returns a lease on it. The writable mapping of its
    /// extent goes first: a committed record is read-only to every client.
    pub fn commit(mut self) -> Result<Lease<'c>, CacheError> {
        self.finished = true;
        self.fill = None;
        match self.client.request(Request::Commit {
            ticket: self.ticket,
        })? {
            Reply::Committed(grant) => self.client.lease(grant),
            other => Err(CacheClient::unexpected("commit", other)),
        }
    }

    /// Abandons the fill now.
    pub fn abort(mut self) -> Result<(), CacheError> {
        self.finished = true;
        self.fill = None;
        self.client
            .request(Request::Abort {
                ticket: self.ticket,
            })
            .map(drop)
    }
}

impl Drop for FillTicket<'_> {
    fn drop(&mut self) {
        self.fill = None;
        if !self.finished {
            self.client.abort_later(self.ticket);
        }
    }
}
