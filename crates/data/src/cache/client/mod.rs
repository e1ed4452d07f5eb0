//! A client connection to the node's cache server. Reads are zero-copy: a hit is a
//! lease on a record of the store, which this process maps once, read-only, and
//! shares between all its connections; a miss is a ticket to fill a reserved extent
//! in place, mapped writable for that fill alone. A hit on a cached record sends no
//! message: the client finds it in the shared index and takes a lease in its own
//! page of pins (see [`pins`](super::pins)); dropping the lease releases exactly it.
//!
//! Before it reads a byte from the server, a client checks who the server is
//! (`SO_PEERCRED`): a server of a uid it does not trust (its own, plus any
//! `--allow-uid` / [`ALLOW_UIDS_ENV`]) is refused with an error naming that uid and
//! pid, since anyone can bind an abstract socket name first.
//!
//! The client in parts: how it connects and whom it trusts (`options`), the
//! rendezvous and handshake (`connect`), its requests and replies (`channel`), and
//! the leases and fill tickets it hands out (`lease`); this file holds the
//! connection and its operations.

use std::cell::Cell;
use std::os::unix::io::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

use ipc_channel::ipc::{IpcReceiver, IpcSender};

use super::protocol::{ClientId, ReadOrderAnnouncement, Reply, Request};
use super::shm::{Mapping, OwnPage};
use super::stats::StatsReport;
use super::table::{self, SlotCode, Table, MAX_KEY_BYTES};
use super::{CacheError, FillError};

mod channel;
mod connect;
mod lease;
mod options;

pub use lease::{FillTicket, Lease};
pub use options::{
    check_server, job_label, parse_uids, set_job_label, ClientOptions, ALLOW_UIDS_ENV,
    HANDSHAKE_TIMEOUT, REPLY_TIMEOUT,
};

/// One connection to the cache server. Send but not Sync: open one per thread.
pub struct CacheClient {
    address: String,
    id: ClientId,
    requests: IpcSender<Request>,
    replies: IpcReceiver<Reply>,
    mapping: Arc<Mapping>,
    /// The store's descriptors and index, in the read-only mapping.
    table: Table,
    /// Bytes of the record arena; every lease lies inside it.
    arena_bytes: u64,
    /// This connection's page of pins, mapped writable.
    own: OwnPage,
    /// Hits this connection served from the shared index, with no message.
    shared_hits: Cell<u64>,
    /// Aborts sent whose acknowledgement has not been read yet.
    pending_acks: Cell<usize>,
    /// Set when a reply was lost (timeout): the channel is out of step for good.
    broken: Cell<bool>,
    reply_timeout: Duration,
    /// How long the server lets a get wait for another client's fill.
    fill_wait: Duration,
    /// Held open for the connection's life: the server frees this connection's
    /// page of pins only once it closes (the client, and its leases, are gone).
    _rendezvous: UnixStream,
}

/// A prefetch's result (the planned policy).
pub enum Prefetch<'c> {
    /// Cached already, or being filled by someone.
    Present,
    /// The server keeps no room for it now: it would evict a record needed sooner.
    Declined,
    /// Room is reserved: write the record, then commit.
    Fill(FillTicket<'c>),
}

/// A lookup's result: a lease on the cached record, or the ticket to fill it.
pub enum Lookup<'c> {
    /// Cached.
    Hit(Lease<'c>),
    /// Not cached; this client fills it.
    Miss(FillTicket<'c>),
}

impl CacheClient {
    /// This connection's id in the server's stats.
    pub fn id(&self) -> ClientId {
        self.id
    }

    /// Hits this connection took straight from shared memory (no message); the rest
    /// of its hits went through the server (a fill in flight, a racing eviction).
    pub fn shared_hits(&self) -> u64 {
        self.shared_hits.get()
    }

    /// Whether the server has gone (its end of this connection's rendezvous
    /// socket closed), found without a message: a client that only takes hits in
    /// shared memory learns of it no other way. One `poll` with no wait.
    pub fn server_gone(&self) -> bool {
        let mut fd = libc::pollfd {
            fd: self._rendezvous.as_raw_fd(),
            events: libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: one valid pollfd for a socket this client owns, for the call's
        // duration; a zero timeout does not block.
        let ready = unsafe { libc::poll(&mut fd, 1, 0) };
        ready > 0 && fd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
    }

    /// The server's address.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// A lease on `key` if cached, or the ticket to fill it. If another client is
    /// filling the key, this waits for that fill.
    pub fn get(&self, key: &str) -> Result<Lookup<'_>, CacheError> {
        if let Some(lease) = self.hit_in_shared_memory(key) {
            return Ok(Lookup::Hit(lease));
        }
        match self.request(Request::Get {
            key: key.to_string(),
        })? {
            Reply::Hit(grant) => Ok(Lookup::Hit(self.lease(grant)?)),
            Reply::HitAfterWait(grant) => Ok(Lookup::Hit(self.lease(grant)?.after_a_wait())),
            Reply::Miss { ticket } => Ok(Lookup::Miss(FillTicket::new(self, ticket, key))),
            other => Err(Self::unexpected("get", other)),
        }
    }

    /// A lease on `key`, filling it on a miss: `fill` writes the record's `len` bytes
    /// straight into the reserved extent. A failed fill is abandoned (other waiters
    /// retry) and its error returned.
    pub fn get_or_fill<E>(
        &self,
        key: &str,
        len: usize,
        fill: impl FnOnce(&mut [u8]) -> Result<(), E>,
    ) -> Result<Lease<'_>, FillError<E>> {
        match self.get(key).map_err(FillError::Cache)? {
            Lookup::Hit(lease) => Ok(lease),
            Lookup::Miss(mut ticket) => {
                ticket.reserve(len as u64).map_err(FillError::Cache)?;
                let slot = ticket.slot_mut().map_err(FillError::Cache)?;
                fill(slot).map_err(FillError::Fill)?;
                ticket.commit().map_err(FillError::Cache)
            }
        }
    }

    /// A lease on `key` if it is cached; never fills.
    pub fn peek(&self, key: &str) -> Result<Option<Lease<'_>>, CacheError> {
        if let Some(lease) = self.hit_in_shared_memory(key) {
            return Ok(Some(lease));
        }
        match self.request(Request::Peek {
            key: key.to_string(),
        })? {
            Reply::Hit(grant) => Ok(Some(self.lease(grant)?)),
            Reply::NotCached => Ok(None),
            other => Err(Self::unexpected("peek", other)),
        }
    }

    /// The store's byte cap.
    pub fn cap_bytes(&self) -> u64 {
        self.arena_bytes
    }

    /// Whether `key` is cached now, from the shared table (no message, no lease:
    /// it may be evicted right after).
    pub fn is_cached(&self, key: &str) -> bool {
        key.len() <= MAX_KEY_BYTES
            && self.table.candidates(table::key_hash(key)).any(|slot| {
                let ready = self
                    .table
                    .state(slot)
                    .is_some_and(|s| s.code == SlotCode::Ready);
                ready && self.table.key_is(slot, key)
            })
    }

    /// Tells the server what this connection's reader will read, in order (the
    /// planned policy); it replaces what it announced before. Then report progress
    /// with [`set_read_progress`](Self::set_read_progress).
    pub fn announce_read_order(&self, order: ReadOrderAnnouncement) -> Result<(), CacheError> {
        self.request(Request::ReadOrder(order)).map(drop)
    }

    /// The step the reader of this connection's read order has reached: uses at earlier
    /// steps are past. Written into this connection's pin page (no message).
    pub fn set_read_progress(&self, step: u64) {
        self.own.page().set_progress(step);
    }

    /// Counts a record this connection got whose layout was not what its reader
    /// expected (the reader reads it from disk instead): written into this
    /// connection's pin page (no message), shown by `cache stats` as a layout
    /// mismatch.
    pub fn count_layout_mismatch(&self) {
        self.own.page().count_layout_mismatch();
    }

    /// Room to fill `key`'s record of `len` bytes ahead of its announced use, if the
    /// server finds it worth it (see [`Prefetch`]).
    pub fn prefetch(&self, key: &str, len: u64) -> Result<Prefetch<'_>, CacheError> {
        let reply = self.request(Request::Prefetch {
            key: key.to_string(),
            len,
        })?;
        match reply {
            Reply::Done => Ok(Prefetch::Present),
            Reply::Declined => Ok(Prefetch::Declined),
            Reply::Reserved {
                ticket,
                offset,
                len,
            } => {
                // The ticket first: if the mapping fails, its drop gives it back.
                let mut fill = FillTicket::new(self, ticket, key);
                fill.map_extent(offset, len)?;
                Ok(Prefetch::Fill(fill))
            }
            other => Err(Self::unexpected("prefetch", other)),
        }
    }

    /// Drops a cached record that no one holds.
    pub fn invalidate(&self, key: &str) -> Result<(), CacheError> {
        self.request(Request::Invalidate {
            key: key.to_string(),
        })
        .map(drop)
    }

    /// Live statistics of the server.
    pub fn stats(&self) -> Result<StatsReport, CacheError> {
        match self.request(Request::Stats)? {
            Reply::Stats(report) => Ok(*report),
            other => Err(Self::unexpected("stats", other)),
        }
    }

    /// Asks the server to stop.
    pub fn shutdown_server(&self) -> Result<(), CacheError> {
        self.request(Request::Shutdown).map(drop)
    }
}

impl std::fmt::Debug for CacheClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CacheClient")
            .field("address", &self.address)
            .field("id", &self.id)
            .finish()
    }
}
