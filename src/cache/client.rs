//! A client connection to the node's cache server. Reads are zero-copy: a hit is a
//! lease on a slot of the store, which this process maps once and shares between all
//! its connections; a miss is a ticket to fill a reserved slot in place. Releases are
//! pipelined (their acknowledgements are read with the next reply).

use std::cell::Cell;
use std::io::Write;
use std::ops::Deref;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

use ipc_channel::ipc::{self, IpcReceiver, IpcSender};
use ipc_channel::{IpcError, TryRecvError};
use tracing::warn;

use super::protocol::{ClientId, LeaseGrant, LeaseId, Reply, Request, RequestError, TicketId};
use super::server::{read_frame, socket_addr};
use super::shm::{self, Mapping};
use super::stats::StatsReport;
use super::{CacheError, FillError};

/// How long a client waits for any one reply before it gives up on the server.
const REPLY_TIMEOUT: Duration = Duration::from_secs(600);
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// One connection to the cache server. Send but not Sync: open one per thread.
pub struct CacheClient {
    address: String,
    id: ClientId,
    requests: IpcSender<Request>,
    replies: IpcReceiver<Reply>,
    mapping: Arc<Mapping>,
    /// Releases sent whose acknowledgement has not been read yet.
    pending_acks: Cell<usize>,
    /// Set when a reply was lost (timeout): the channel is out of step for good.
    broken: Cell<bool>,
}

/// A lookup's result: a lease on the cached record, or the ticket to fill it.
pub enum Lookup<'c> {
    /// Cached.
    Hit(Lease<'c>),
    /// Not cached; this client fills it.
    Miss(FillTicket<'c>),
}

impl CacheClient {
    /// Connects to the server at `address`; `name` labels this client in stats.
    pub fn connect(address: &str, name: &str) -> Result<CacheClient, CacheError> {
        let connect_err = |source| CacheError::Connect {
            address: address.to_string(),
            source,
        };
        let handshake_err = |message: String| CacheError::Handshake {
            address: address.to_string(),
            message,
        };
        let mut stream = UnixStream::connect_addr(&socket_addr(address)?).map_err(connect_err)?;
        stream
            .set_read_timeout(Some(HANDSHAKE_TIMEOUT))
            .map_err(connect_err)?;
        let oneshot = read_frame(&mut stream).map_err(|e| handshake_err(e.to_string()))?;
        let oneshot = String::from_utf8(oneshot).map_err(|e| handshake_err(e.to_string()))?;
        let requests = IpcSender::<Request>::connect(oneshot)
            .map_err(|e| handshake_err(format!("connecting the request channel: {e}")))?;
        let (reply_tx, replies) =
            ipc::channel::<Reply>().map_err(|e| handshake_err(format!("reply channel: {e}")))?;
        requests
            .send(Request::Hello {
                name: name.to_string(),
                pid: std::process::id(),
                mapped_store: shm::mapped_store(address),
                reply: reply_tx,
            })
            .map_err(|e| handshake_err(format!("hello: {e:?}")))?;
        stream
            .write_all(&[1])
            .map_err(|e| handshake_err(e.to_string()))?;
        let welcome = replies
            .try_recv_timeout(HANDSHAKE_TIMEOUT)
            .map_err(|e| handshake_err(format!("no welcome: {e:?}")))?;
        let Reply::Welcome {
            client,
            store_id,
            store_len,
            store,
        } = welcome
        else {
            return Err(handshake_err(format!("expected welcome, got {welcome:?}")));
        };
        let mapping = shm::adopt(address, store_id, store)?;
        if mapping.len() as u64 != store_len {
            return Err(handshake_err(format!(
                "store of {store_len} bytes mapped as {} bytes",
                mapping.len()
            )));
        }
        Ok(CacheClient {
            address: address.to_string(),
            id: client,
            requests,
            replies,
            mapping,
            pending_acks: Cell::new(0),
            broken: Cell::new(false),
        })
    }

    /// This connection's id in the server's stats.
    pub fn id(&self) -> ClientId {
        self.id
    }

    /// The server's address.
    pub fn address(&self) -> &str {
        &self.address
    }

    fn recv(&self, request: &'static str) -> Result<Reply, CacheError> {
        match self.replies.try_recv_timeout(REPLY_TIMEOUT) {
            Ok(reply) => Ok(reply),
            Err(TryRecvError::IpcError(IpcError::Disconnected)) => Err(CacheError::ServerGone {
                address: self.address.clone(),
            }),
            Err(TryRecvError::Empty) => {
                self.broken.set(true);
                Err(CacheError::Timeout {
                    request,
                    waited_s: REPLY_TIMEOUT.as_secs(),
                })
            }
            Err(TryRecvError::IpcError(e)) => Err(CacheError::Ipc {
                op: request,
                message: format!("{e:?}"),
            }),
        }
    }

    fn send(&self, request: Request) -> Result<(), CacheError> {
        if self.broken.get() {
            return Err(CacheError::Broken);
        }
        let kind = request.kind();
        self.requests.send(request).map_err(|e| match e {
            IpcError::Disconnected => CacheError::ServerGone {
                address: self.address.clone(),
            },
            IpcError::Io(io) if io.kind() == std::io::ErrorKind::BrokenPipe => {
                CacheError::ServerGone {
                    address: self.address.clone(),
                }
            }
            other => CacheError::Ipc {
                op: kind,
                message: other.to_string(),
            },
        })
    }

    /// Sends a raw request and returns its reply: the protocol as it is, for tools
    /// and tests. `Reply::Error` comes back as a reply, not as `Err`.
    pub fn call(&self, request: Request) -> Result<Reply, CacheError> {
        let kind = request.kind();
        self.send(request)?;
        while self.pending_acks.get() > 0 {
            let ack = self.recv("release")?;
            self.pending_acks.set(self.pending_acks.get() - 1);
            if let Reply::Error(error) = ack {
                warn!("cache release refused: {error}");
            }
        }
        self.recv(kind)
    }

    /// Like [`call`](Self::call), with `Reply::Error` turned into `Err`.
    fn request(&self, request: Request) -> Result<Reply, CacheError> {
        let kind = request.kind();
        match self.call(request)? {
            Reply::Error(error) => Err(CacheError::Refused {
                request: kind,
                error,
            }),
            reply => Ok(reply),
        }
    }

    fn unexpected(kind: &str, reply: Reply) -> CacheError {
        CacheError::Protocol(format!("unexpected reply to {kind}: {reply:?}"))
    }

    fn lease(&self, grant: LeaseGrant) -> Result<Lease<'_>, CacheError> {
        let ptr = self.mapping.range(grant.offset, grant.len)?;
        Ok(Lease {
            client: self,
            grant,
            ptr,
        })
    }

    /// A lease on `key` if cached, or the ticket to fill it. If another client is
    /// filling the key, this waits for that fill.
    pub fn get(&self, key: &str) -> Result<Lookup<'_>, CacheError> {
        match self.request(Request::Get {
            key: key.to_string(),
        })? {
            Reply::Hit(grant) => Ok(Lookup::Hit(self.lease(grant)?)),
            Reply::Miss { ticket } => Ok(Lookup::Miss(FillTicket {
                client: self,
                ticket,
                key: key.to_string(),
                slot: None,
                finished: false,
            })),
            other => Err(Self::unexpected("get", other)),
        }
    }

    /// A lease on `key`, filling it on a miss: `fill` writes the record's `len` bytes
    /// straight into the reserved slot. A failed fill is abandoned (other waiters
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
        match self.request(Request::Peek {
            key: key.to_string(),
        })? {
            Reply::Hit(grant) => Ok(Some(self.lease(grant)?)),
            Reply::NotCached => Ok(None),
            other => Err(Self::unexpected("peek", other)),
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

    /// Sends a release without waiting; its acknowledgement is read later.
    fn release_later(&self, lease: LeaseId) {
        match self.send(Request::Release { lease }) {
            Ok(()) => self.pending_acks.set(self.pending_acks.get() + 1),
            // A server that is gone has released everything already.
            Err(e) => warn!("cache release of lease {lease} not sent: {e}"),
        }
    }

    fn abort_later(&self, ticket: TicketId) {
        match self.send(Request::Abort { ticket }) {
            Ok(()) => self.pending_acks.set(self.pending_acks.get() + 1),
            Err(e) => warn!("cache abort of ticket {ticket} not sent: {e}"),
        }
    }
}

/// A pinned record: derefs to its bytes in shared memory, released when dropped.
pub struct Lease<'c> {
    client: &'c CacheClient,
    grant: LeaseGrant,
    ptr: *mut u8,
}

impl Lease<'_> {
    /// The lease's id.
    pub fn id(&self) -> LeaseId {
        self.grant.lease
    }

    /// The record's offset in the store (for diagnostics).
    pub fn offset(&self) -> u64 {
        self.grant.offset
    }
}

impl Deref for Lease<'_> {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr..ptr+len` lies inside the mapping (checked by `Mapping::range`),
        // which outlives the client this lease borrows; the record is committed and
        // pinned by this lease, so the server hands its slot to no writer until the
        // lease is released in `drop`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.grant.len as usize) }
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        self.client.release_later(self.grant.lease);
    }
}

/// The right to fill one key after a miss: reserve, write, commit. Dropped without
/// a commit, the fill is abandoned and other clients waiting for the key retry.
pub struct FillTicket<'c> {
    client: &'c CacheClient,
    ticket: TicketId,
    key: String,
    slot: Option<(*mut u8, u64)>,
    finished: bool,
}

impl<'c> FillTicket<'c> {
    /// The key being filled.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Reserves a slot for a record of exactly `len` bytes.
    pub fn reserve(&mut self, len: u64) -> Result<(), CacheError> {
        match self.client.request(Request::Reserve {
            ticket: self.ticket,
            len,
        })? {
            Reply::Reserved { offset, len, .. } => {
                let ptr = self.client.mapping.range(offset, len)?;
                self.slot = Some((ptr, len));
                Ok(())
            }
            other => Err(CacheClient::unexpected("reserve", other)),
        }
    }

    fn slot(&self) -> Result<(*mut u8, u64), CacheError> {
        self.slot.ok_or_else(|| CacheError::NotReserved {
            key: self.key.clone(),
        })
    }

    /// The reserved slot's bytes, to write the record into.
    pub fn slot_mut(&mut self) -> Result<&mut [u8], CacheError> {
        let (ptr, len) = self.slot()?;
        // SAFETY: the range is inside the mapping (checked at reserve) and reserved
        // for this ticket alone until commit or abort; `&mut self` keeps this the
        // only live slice of it in this process.
        Ok(unsafe { std::slice::from_raw_parts_mut(ptr, len as usize) })
    }

    /// Writes `bytes` at `offset` in the slot; a write past the reserved length is
    /// refused and writes nothing.
    pub fn write_at(&mut self, offset: u64, bytes: &[u8]) -> Result<(), CacheError> {
        let (_, len) = self.slot()?;
        let end = offset.checked_add(bytes.len() as u64);
        if end.is_none_or(|end| end > len) {
            return Err(CacheError::WriteOutOfSlot {
                key: self.key.clone(),
                offset,
                len: bytes.len() as u64,
                slot_len: len,
            });
        }
        let slot = self.slot_mut()?;
        slot[offset as usize..offset as usize + bytes.len()].copy_from_slice(bytes);
        Ok(())
    }

    /// Publishes the record and returns a lease on it.
    pub fn commit(mut self) -> Result<Lease<'c>, CacheError> {
        self.finished = true;
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
        self.client
            .request(Request::Abort {
                ticket: self.ticket,
            })
            .map(drop)
    }
}

impl Drop for FillTicket<'_> {
    fn drop(&mut self) {
        if !self.finished {
            self.client.abort_later(self.ticket);
        }
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

/// Refusals keep their cause, so callers can match on it.
impl CacheError {
    /// The server's reason, when the server refused the request.
    pub fn refusal(&self) -> Option<&RequestError> {
        match self {
            CacheError::Refused { error, .. } => Some(error),
            _ => None,
        }
    }
}
