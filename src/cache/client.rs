//! A client connection to the node's cache server. Reads are zero-copy: a hit is a
//! lease on a slot of the store, which this process maps once and shares between all
//! its connections; a miss is a ticket to fill a reserved slot in place. A hit on a
//! cached record sends no message: the client finds it in the shared index and sets
//! its own pin bit (see [`table`](super::table)); releasing clears the bit.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::io::Write;
use std::ops::Deref;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ipc_channel::ipc::{self, IpcReceiver, IpcSender};
use ipc_channel::{IpcError, TryRecvError};
use tracing::warn;

use super::admission::peer_of;
use super::fdpass;
use super::protocol::{ClientId, LeaseGrant, LeaseId, Reply, Request, RequestError, TicketId};
use super::rendezvous::{self, Greeting};
use super::server::{read_frame, socket_addr};
use super::shm::{self, Mapping, StoreFd};
use super::stats::StatsReport;
use super::table::{self, SlotCode, Table, MAX_CONNECTIONS, MAX_KEY_BYTES};
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
    /// The store's slot table and index, in the shared mapping.
    table: Table,
    /// Bytes of the record arena; every lease lies inside it.
    arena_bytes: u64,
    /// This connection's pin bit.
    pin_bit: usize,
    /// Leases this connection holds per slot; the pin bit is set while above 0.
    held: RefCell<HashMap<usize, u32>>,
    /// Hits this connection served from the shared index, with no message.
    shared_hits: Cell<u64>,
    /// Aborts sent whose acknowledgement has not been read yet.
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
    /// A server busy with other handshakes is asked again for up to 10 s.
    pub fn connect(address: &str, name: &str) -> Result<CacheClient, CacheError> {
        let started = Instant::now();
        let mut pause = Duration::from_millis(10);
        loop {
            if let Some((stream, oneshot)) = Self::rendezvous(address)? {
                return Self::handshake(address, name, stream, oneshot);
            }
            if started.elapsed() >= HANDSHAKE_TIMEOUT {
                return Err(CacheError::Busy {
                    address: address.to_string(),
                    waited_s: started.elapsed().as_secs(),
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(500));
        }
    }

    /// Connects and says hello: the socket and the one-shot channel's name, or
    /// `None` when the server is busy.
    fn rendezvous(address: &str) -> Result<Option<(UnixStream, String)>, CacheError> {
        let connect_err = |source| CacheError::Connect {
            address: address.to_string(),
            source,
        };
        let mut stream = UnixStream::connect_addr(&socket_addr(address)?).map_err(connect_err)?;
        stream
            .set_read_timeout(Some(HANDSHAKE_TIMEOUT))
            .map_err(connect_err)?;
        let server = peer_of(&stream).map_err(connect_err)?;
        let uid = nix::unistd::geteuid().as_raw();
        let not_allowed = || CacheError::NotAllowed {
            address: address.to_string(),
            server_uid: server.uid,
            uid,
        };
        // A server of another user that closes on us has refused us.
        let refused = |message: String| match server.uid == uid {
            true => CacheError::Handshake {
                address: address.to_string(),
                message,
            },
            false => not_allowed(),
        };
        // A server that refused us may have closed before the hello arrives.
        let said_hello = stream.write_all(&[rendezvous::HELLO]);
        let frame = read_frame(&mut stream);
        let greeting = match (frame, said_hello) {
            (Ok(frame), _) => Greeting::decode(&frame),
            (Err(e), Ok(())) | (Err(_), Err(e)) => {
                return Err(refused(format!("the server closed the connection: {e}")))
            }
        };
        match greeting {
            Some(Greeting::Channel(oneshot)) => Ok(Some((stream, oneshot))),
            Some(Greeting::Busy) => Ok(None),
            Some(Greeting::Refused) => Err(not_allowed()),
            None => Err(refused("the server's greeting made no sense".into())),
        }
    }

    /// The rest of the handshake, over the one-shot channel named `oneshot`.
    fn handshake(
        address: &str,
        name: &str,
        mut stream: UnixStream,
        oneshot: String,
    ) -> Result<CacheClient, CacheError> {
        let handshake_err = |message: String| CacheError::Handshake {
            address: address.to_string(),
            message,
        };
        let mapped_store = shm::mapped_store(address)?;
        let requests = IpcSender::<Request>::connect(oneshot)
            .map_err(|e| handshake_err(format!("connecting the request channel: {e}")))?;
        let (reply_tx, replies) =
            ipc::channel::<Reply>().map_err(|e| handshake_err(format!("reply channel: {e}")))?;
        requests
            .send(Request::Hello {
                name: name.to_string(),
                pid: std::process::id(),
                mapped_store,
                reply: reply_tx,
            })
            .map_err(|e| handshake_err(format!("hello: {e:?}")))?;
        stream
            .write_all(&[1])
            .map_err(|e| handshake_err(e.to_string()))?;
        let welcome = replies
            .try_recv_timeout(HANDSHAKE_TIMEOUT)
            .map_err(|e| handshake_err(format!("no welcome: {e:?}")))?;
        let welcome = Welcome::from_reply(welcome).map_err(handshake_err)?;
        let Welcome {
            client,
            arena_bytes,
            pin_bit,
            ..
        } = welcome;
        let mapping = welcome.map(address, &stream).map_err(|e| match e {
            MapError::Handshake(message) => handshake_err(message),
            MapError::Cache(e) => e,
        })?;
        let pin_bit = pin_bit as usize;
        if pin_bit >= MAX_CONNECTIONS {
            return Err(handshake_err(format!("pin bit {pin_bit} out of range")));
        }
        let table = mapping.table(arena_bytes)?;
        Ok(CacheClient {
            address: address.to_string(),
            id: client,
            requests,
            replies,
            mapping,
            table,
            arena_bytes,
            pin_bit,
            held: RefCell::new(HashMap::new()),
            shared_hits: Cell::new(0),
            pending_acks: Cell::new(0),
            broken: Cell::new(false),
        })
    }

    /// This connection's id in the server's stats.
    pub fn id(&self) -> ClientId {
        self.id
    }

    /// Hits this connection took straight from shared memory (no message); the rest
    /// of its hits went through the server (a fill in flight, a racing eviction).
    pub fn shared_hits(&self) -> u64 {
        self.shared_hits.get()
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
    ///
    /// A `Release` that succeeds clears this connection's pin on the lease's slot
    /// altogether, as if every lease it holds there were released.
    pub fn call(&self, request: Request) -> Result<Reply, CacheError> {
        let kind = request.kind();
        let released = match request {
            Request::Release { lease } => Some(table::decode_lease(lease).0),
            _ => None,
        };
        self.send(request)?;
        while self.pending_acks.get() > 0 {
            let ack = self.recv("abort")?;
            self.pending_acks.set(self.pending_acks.get() - 1);
            if let Reply::Error(error) = ack {
                warn!("cache abort refused: {error}");
            }
        }
        let reply = self.recv(kind)?;
        if let (Some(slot), Reply::Done) = (released, &reply) {
            self.held.borrow_mut().remove(&slot);
        }
        Ok(reply)
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

    /// A lease on a grant whose pin bit the server has set.
    fn lease(&self, grant: LeaseGrant) -> Result<Lease<'_>, CacheError> {
        let slot = table::decode_lease(grant.lease).0;
        *self.held.borrow_mut().entry(slot).or_insert(0) += 1;
        match self.range(grant.offset, grant.len) {
            Ok(ptr) => Ok(Lease {
                client: self,
                grant,
                slot,
                ptr,
                waited: false,
            }),
            Err(e) => {
                self.drop_hold(slot);
                Err(e)
            }
        }
    }

    /// A record's bytes in the arena.
    fn range(&self, offset: u64, len: u64) -> Result<*mut u8, CacheError> {
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

    /// One lease fewer on `slot`; the pin bit is cleared with the last.
    fn drop_hold(&self, slot: usize) {
        let mut held = self.held.borrow_mut();
        let Some(count) = held.get_mut(&slot) else {
            return; // released through the raw protocol already
        };
        *count -= 1;
        if *count == 0 {
            held.remove(&slot);
            self.table.unpin(slot, self.pin_bit);
        }
    }

    /// A lease on `key` straight from the shared index, with no message: pin, then
    /// check that the slot is Ready and holds `key`; `None` sends the caller to the
    /// server (a miss, a fill in flight, an eviction racing with us).
    fn hit_in_shared_memory(&self, key: &str) -> Option<Lease<'_>> {
        if key.len() > MAX_KEY_BYTES {
            return None;
        }
        let bit = self.pin_bit;
        for slot in self.table.candidates(table::key_hash(key)) {
            let holding = self.held.borrow().contains_key(&slot);
            if !holding {
                self.table.pin(slot, bit);
            }
            let state = self.table.state(slot);
            let usable = state.is_some_and(|s| s.code == SlotCode::Ready)
                && self.table.connection_owner(bit) == self.id
                && self.table.key_is(slot, key);
            let grant = state.filter(|_| usable).map(|s| LeaseGrant {
                lease: table::lease_id(slot, s.generation),
                offset: self.table.offset(slot),
                len: self.table.record_len(slot),
            });
            let ptr = grant.and_then(|g| self.range(g.offset, g.len).ok());
            match (grant, ptr) {
                (Some(grant), Some(ptr)) => {
                    *self.held.borrow_mut().entry(slot).or_insert(0) += 1;
                    self.table.touch(slot);
                    self.table.count_hit(bit);
                    self.shared_hits.set(self.shared_hits.get() + 1);
                    return Some(Lease {
                        client: self,
                        grant,
                        slot,
                        ptr,
                        waited: false,
                    });
                }
                _ => {
                    if !holding {
                        self.table.unpin(slot, bit);
                    }
                }
            }
        }
        None
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
            Reply::HitAfterWait(grant) => {
                let mut lease = self.lease(grant)?;
                lease.waited = true;
                Ok(Lookup::Hit(lease))
            }
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

    fn abort_later(&self, ticket: TicketId) {
        match self.send(Request::Abort { ticket }) {
            Ok(()) => self.pending_acks.set(self.pending_acks.get() + 1),
            Err(e) => warn!("cache abort of ticket {ticket} not sent: {e}"),
        }
    }
}

/// The server's welcome, taken apart.
#[derive(Debug, Clone, Copy)]
struct Welcome {
    client: ClientId,
    store_id: u64,
    store_len: u64,
    arena_bytes: u64,
    pin_bit: u32,
    store_fd_follows: bool,
}

/// A failure to map the store: of the handshake, or of the cache itself.
enum MapError {
    Handshake(String),
    Cache(CacheError),
}

impl From<CacheError> for MapError {
    fn from(e: CacheError) -> MapError {
        MapError::Cache(e)
    }
}

impl Welcome {
    fn from_reply(reply: Reply) -> Result<Welcome, String> {
        match reply {
            Reply::Welcome {
                client,
                store_id,
                store_len,
                arena_bytes,
                pin_bit,
                store_fd_follows,
            } => Ok(Welcome {
                client,
                store_id,
                store_len,
                arena_bytes,
                pin_bit,
                store_fd_follows,
            }),
            Reply::Error(error) => Err(error.to_string()),
            other => Err(format!("expected welcome, got {other:?}")),
        }
    }

    /// This process's mapping of the store: the one it has, or a new one of the
    /// memfd that follows on `stream`; checked against the announced sizes.
    fn map(&self, address: &str, stream: &UnixStream) -> Result<Arc<Mapping>, MapError> {
        let store = match self.store_fd_follows {
            true => Some(StoreFd {
                fd: fdpass::recv_fd(stream)
                    .map_err(|e| MapError::Handshake(format!("receiving the store: {e}")))?,
                len: self.store_len,
            }),
            false => None,
        };
        let mapping = shm::adopt(address, self.store_id, store)?;
        if mapping.len() as u64 != self.store_len || self.arena_bytes > self.store_len {
            return Err(MapError::Handshake(format!(
                "store of {} bytes (arena {}) mapped as {} bytes",
                self.store_len,
                self.arena_bytes,
                mapping.len()
            )));
        }
        Ok(mapping)
    }
}

/// A pinned record: derefs to its bytes in shared memory, released when dropped.
pub struct Lease<'c> {
    client: &'c CacheClient,
    grant: LeaseGrant,
    slot: usize,
    ptr: *mut u8,
    /// Whether the get waited for another client's fill of the key.
    waited: bool,
}

impl Lease<'_> {
    /// The lease's id.
    pub fn id(&self) -> LeaseId {
        self.grant.lease
    }

    /// Whether the get that returned this lease found the key being filled by another
    /// client and waited for that fill (single flight), rather than finding it cached.
    pub fn waited_for_fill(&self) -> bool {
        self.waited
    }

    /// The record's offset in the store (for diagnostics).
    pub fn offset(&self) -> u64 {
        self.grant.offset
    }
}

impl Deref for Lease<'_> {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr..ptr+len` lies inside the arena of the mapping (checked by
        // `CacheClient::range`), which outlives the client this lease borrows; the
        // record is committed and this connection's pin bit is set on its slot, so the
        // server hands the slot to no writer until the last lease on it is dropped.
        unsafe { std::slice::from_raw_parts(self.ptr, self.grant.len as usize) }
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        self.client.drop_hold(self.slot);
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
                let ptr = self.client.range(offset, len)?;
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
