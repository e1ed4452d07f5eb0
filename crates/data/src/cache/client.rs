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

use std::cell::Cell;
use std::io::Write;
use std::ops::Deref;
use std::os::unix::io::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ipc_channel::ipc::{self, IpcReceiver, IpcSender};
use ipc_channel::{IpcError, TryRecvError};
use tracing::warn;

use super::admission::{peer_of, Peer};
use super::fdpass;
use super::pins::LeaseWord;
use super::protocol::{
    ClientId, LeaseGrant, LeaseId, ReadOrderAnnouncement, Reply, Request, RequestError, TicketId,
};
use super::rendezvous::{self, Greeting};
use super::server::{read_frame, socket_addr};
use super::shm::{self, FillMap, Mapping, OwnPage, StoreFd};
use super::stats::StatsReport;
use super::table::{self, SlotCode, Table, MAX_KEY_BYTES};
use super::{CacheError, FillError};

/// Variable naming more uids whose cache servers a client trusts besides its own
/// (comma-separated), as `--allow-uid` does on the command line.
pub const ALLOW_UIDS_ENV: &str = "VRTSPIKE_CACHE_ALLOW_UIDS";

/// How long a client waits for any one reply before it gives up on the server.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(600);
/// How long a client has to connect and finish the handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How a client connects: whom it trusts, and how long it waits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientOptions {
    /// Uids whose servers this client talks to (its own is always one).
    pub trusted_uids: Vec<u32>,
    /// Longest wait for a reply (a get waits the server's fill wait on top).
    pub reply_timeout: Duration,
    /// Longest time to connect and finish the handshake.
    pub handshake_timeout: Duration,
    /// The job this client's figures count for ([`job_label`]).
    pub job: String,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            trusted_uids: vec![nix::unistd::geteuid().as_raw()],
            reply_timeout: REPLY_TIMEOUT,
            handshake_timeout: HANDSHAKE_TIMEOUT,
            job: job_label(),
        }
    }
}

/// The job this process's cache clients name in their hello, for the server's
/// per-job figures: what [`set_job_label`] set, else the run directory the
/// launcher gives its ranks (`VRTSPIKE_RUN_DIR`), else none (`""`).
pub fn job_label() -> String {
    if let Some(label) = JOB_LABEL.get() {
        return label.clone();
    }
    std::env::var(vrtspike_contract::env::RUN_DIR)
        .map(|dir| vrtspike_contract::rundir::RunLayout::new(dir).job_label())
        .unwrap_or_default()
}

/// Names the job of this process's cache clients (a rank sets its run
/// directory); the first call wins.
pub fn set_job_label(label: &str) {
    let _ = JOB_LABEL.set(label.to_string());
}

static JOB_LABEL: std::sync::OnceLock<String> = std::sync::OnceLock::new();

impl ClientOptions {
    /// The defaults, trusting also the uids of [`ALLOW_UIDS_ENV`].
    pub fn from_env() -> Result<ClientOptions, CacheError> {
        let mut options = ClientOptions::default();
        if let Ok(list) = std::env::var(ALLOW_UIDS_ENV) {
            options.trusted_uids.extend(parse_uids(&list)?);
        }
        Ok(options)
    }

    /// Also trusts `uids`.
    pub fn trusting(mut self, uids: &[u32]) -> ClientOptions {
        self.trusted_uids.extend_from_slice(uids);
        self
    }

    /// Waits at most `timeout` to connect and at most `timeout` for each reply.
    pub fn waiting(mut self, timeout: Duration) -> ClientOptions {
        self.reply_timeout = timeout;
        self.handshake_timeout = timeout;
        self
    }
}

/// Uids from a comma-separated list; an error names the entry that is not one.
pub fn parse_uids(list: &str) -> Result<Vec<u32>, CacheError> {
    list.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<u32>().map_err(|_| {
                CacheError::Protocol(format!("{ALLOW_UIDS_ENV}={list:?}: {s:?} is not a user id"))
            })
        })
        .collect()
}

/// Refuses a server whose process runs as a uid this client does not trust.
pub fn check_server(address: &str, server: Peer, trusted: &[u32]) -> Result<(), CacheError> {
    if trusted.contains(&server.uid) {
        return Ok(());
    }
    Err(CacheError::ForeignServer {
        address: address.to_string(),
        server_uid: server.uid,
        server_pid: server.pid,
        uid: nix::unistd::geteuid().as_raw(),
    })
}

/// The next message on `replies` within `timeout`. The wait is a `poll`, which a
/// signal handler interrupts whatever its `SA_RESTART` (a profiler's, a job
/// signal counted on this thread): nothing was read then, so it waits again for
/// what is left of `timeout` rather than losing the reply.
fn recv_within<T>(replies: &IpcReceiver<T>, timeout: Duration) -> Result<T, TryRecvError>
where
    T: for<'de> serde::Deserialize<'de> + serde::Serialize,
{
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match replies.try_recv_timeout(left) {
            Err(TryRecvError::IpcError(IpcError::Io(e)))
                if e.kind() == std::io::ErrorKind::Interrupted => {}
            other => return other,
        }
    }
}

/// Whether a socket read gave up at its timeout.
fn is_timeout(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

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
    /// Connects to the server at `address` with the [`ClientOptions::from_env`];
    /// `name` labels this client in stats. A server busy with other handshakes is
    /// asked again for up to 10 s.
    pub fn connect(address: &str, name: &str) -> Result<CacheClient, CacheError> {
        CacheClient::connect_with(address, name, &ClientOptions::from_env()?)
    }

    /// Connects to the server at `address` as `options` say.
    pub fn connect_with(
        address: &str,
        name: &str,
        options: &ClientOptions,
    ) -> Result<CacheClient, CacheError> {
        let started = Instant::now();
        let mut pause = Duration::from_millis(10);
        loop {
            if let Some((stream, oneshot)) = Self::rendezvous(address, options)? {
                return Self::handshake(address, name, stream, oneshot, options);
            }
            if started.elapsed() >= options.handshake_timeout {
                return Err(CacheError::Busy {
                    address: address.to_string(),
                    waited_s: started.elapsed().as_secs(),
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(500));
        }
    }

    /// Connects, checks the server's credentials before anything else, and says
    /// hello: the socket and the one-shot channel's name, or `None` when the server
    /// is busy.
    fn rendezvous(
        address: &str,
        options: &ClientOptions,
    ) -> Result<Option<(UnixStream, String)>, CacheError> {
        let connect_err = |source| CacheError::Connect {
            address: address.to_string(),
            source,
        };
        let mut stream = UnixStream::connect_addr(&socket_addr(address)?).map_err(connect_err)?;
        let server = peer_of(&stream).map_err(connect_err)?;
        check_server(address, server, &options.trusted_uids)?;
        stream
            .set_read_timeout(Some(options.handshake_timeout))
            .map_err(connect_err)?;
        let uid = nix::unistd::geteuid().as_raw();
        let not_allowed = || CacheError::NotAllowed {
            address: address.to_string(),
            server_uid: server.uid,
            uid,
        };
        // A server of another (trusted) user that closes on us has refused us.
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
            (Err(e), _) if is_timeout(&e) => {
                return Err(CacheError::Handshake {
                    address: address.to_string(),
                    message: format!(
                        "the server sent no greeting within {:.1} s",
                        options.handshake_timeout.as_secs_f64()
                    ),
                })
            }
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
        options: &ClientOptions,
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
                job: options.job.clone(),
                pid: std::process::id(),
                mapped_store,
                reply: reply_tx,
            })
            .map_err(|e| handshake_err(format!("hello: {e:?}")))?;
        stream
            .write_all(&[1])
            .map_err(|e| handshake_err(e.to_string()))?;
        let welcome = recv_within(&replies, options.handshake_timeout)
            .map_err(|e| handshake_err(format!("no welcome: {e:?}")))?;
        let welcome = Welcome::from_reply(welcome).map_err(handshake_err)?;
        let mapping = welcome.map(address, &stream).map_err(|e| match e {
            MapError::Handshake(message) => handshake_err(message),
            MapError::Cache(e) => e,
        })?;
        let table = mapping.table(welcome.arena_bytes)?;
        let own = mapping.own_page(&table.layout(), welcome.pin_page as usize)?;
        if own.page().owner() != welcome.client {
            return Err(handshake_err(format!(
                "pin page {} is not this connection's",
                welcome.pin_page
            )));
        }
        Ok(CacheClient {
            address: address.to_string(),
            id: welcome.client,
            requests,
            replies,
            mapping,
            table,
            arena_bytes: welcome.arena_bytes,
            own,
            shared_hits: Cell::new(0),
            pending_acks: Cell::new(0),
            broken: Cell::new(false),
            reply_timeout: options.reply_timeout,
            fill_wait: Duration::from_millis(welcome.fill_wait_ms),
            _rendezvous: stream,
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

    /// The request channel, for the fault injection of [`crate::testkit`].
    pub(crate) fn request_channel(&self) -> &IpcSender<Request> {
        &self.requests
    }

    fn recv(&self, request: &'static str, timeout: Duration) -> Result<Reply, CacheError> {
        match recv_within(&self.replies, timeout) {
            Ok(reply) => Ok(reply),
            Err(TryRecvError::IpcError(IpcError::Disconnected)) => Err(CacheError::ServerGone {
                address: self.address.clone(),
            }),
            Err(TryRecvError::Empty) => {
                self.broken.set(true);
                Err(CacheError::Timeout {
                    request,
                    waited_s: timeout.as_secs(),
                })
            }
            Err(TryRecvError::IpcError(e)) => {
                // The reply may still come: the next request would read it as its own.
                self.broken.set(true);
                Err(CacheError::Ipc {
                    op: request,
                    message: format!("{e:?}"),
                })
            }
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
    /// and tests. `Reply::Error` comes back as a reply, not as `Err`. A `Release`
    /// releases exactly the lease it names; the `Lease`'s own drop then finds it
    /// released and does nothing.
    pub fn call(&self, request: Request) -> Result<Reply, CacheError> {
        let kind = request.kind();
        // A get may wait the server's fill wait for another client's fill first.
        let timeout = match request {
            Request::Get { .. } => self.reply_timeout.saturating_add(self.fill_wait),
            _ => self.reply_timeout,
        };
        self.send(request)?;
        while self.pending_acks.get() > 0 {
            let ack = self.recv("abort", self.reply_timeout)?;
            self.pending_acks.set(self.pending_acks.get() - 1);
            if let Reply::Error(error) = ack {
                warn!("cache abort refused: {error}");
            }
        }
        self.recv(kind, timeout)
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

    /// A lease on a grant whose entry the server wrote in this connection's page.
    fn lease(&self, grant: LeaseGrant) -> Result<Lease<'_>, CacheError> {
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
    fn hit_in_shared_memory(&self, key: &str) -> Option<Lease<'_>> {
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
                fill: None,
                finished: false,
            })),
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
                let mut fill = FillTicket {
                    client: self,
                    ticket,
                    key: key.to_string(),
                    fill: None,
                    finished: false,
                };
                fill.fill = Some(self.mapping.fill_map(offset, len, self.arena_bytes)?);
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
    pin_page: u32,
    fill_wait_ms: u64,
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
                pin_page,
                fill_wait_ms,
                store_fd_follows,
            } => Ok(Welcome {
                client,
                store_id,
                store_len,
                arena_bytes,
                pin_page,
                fill_wait_ms,
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
    word: LeaseWord,
    offset: u64,
    len: u64,
    ptr: *const u8,
    /// Whether the get that returned this lease found the key being filled by another
    /// client and waited for that fill.
    waited: bool,
}

impl Lease<'_> {
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
            Reply::Reserved { offset, len, .. } => {
                let client = self.client;
                self.fill = Some(client.mapping.fill_map(offset, len, client.arena_bytes)?);
                Ok(())
            }
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

    /// Whether this connection is lost (the server went away, or a reply went
    /// missing and the channel is out of step): a new connection is needed.
    pub fn is_server_gone(&self) -> bool {
        matches!(self, CacheError::ServerGone { .. } | CacheError::Broken)
    }

    /// Whether the cache could not take or give this record but is otherwise
    /// working: a refusal other than a protocol error (no room, no memory, too
    /// large, a fill that did not finish in time, no lease left), after which the
    /// caller reads the record from disk.
    pub fn is_bypassable(&self) -> bool {
        match self {
            CacheError::Refused { error, .. } => !matches!(error, RequestError::Protocol(_)),
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A handler that does nothing, installed with `SA_RESTART` like the job's.
    extern "C" fn nothing(_: libc::c_int) {}

    /// Runs `wait` on a thread and sends SIGURG (with [`nothing`] as its handler)
    /// to that thread every millisecond until it returns or `send_after` passed,
    /// then sends 7 on `tx`.
    fn interrupted<F>(tx: &IpcSender<u32>, send_after: Duration, wait: F) -> Result<u32, String>
    where
        F: FnOnce() -> Result<u32, TryRecvError> + Send + 'static,
    {
        use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
        let action = SigAction::new(
            SigHandler::Handler(nothing),
            SaFlags::SA_RESTART,
            SigSet::empty(),
        );
        // SAFETY: the handler does nothing (async-signal-safe); SIGURG is ignored
        // by default, so no other test relies on its disposition.
        unsafe { sigaction(Signal::SIGURG, &action) }.expect("SIGURG handler");
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let waiter = std::thread::spawn(move || {
            // SAFETY: gettid has no arguments and cannot fail.
            let _ = tid_tx.send(unsafe { libc::gettid() });
            wait().map_err(|e| format!("{e:?}"))
        });
        let tid = tid_rx.recv().expect("the waiter's tid");
        let pid = std::process::id() as libc::pid_t;
        let start = Instant::now();
        while !waiter.is_finished() && start.elapsed() < send_after {
            // SAFETY: tgkill to a thread of this process that is alive (not
            // finished) with a signal whose handler does nothing.
            unsafe { libc::syscall(libc::SYS_tgkill, pid, tid, libc::SIGURG) };
            std::thread::sleep(Duration::from_millis(1));
        }
        // The waiter may have given up and dropped its receiver already.
        let _ = tx.send(7);
        waiter.join().expect("the waiter panicked")
    }

    #[test]
    fn a_reply_wait_interrupted_by_signal_handlers_still_gets_the_reply() {
        // The stimulus is real: a bare wait fails with EINTR under it.
        let (tx, rx) = ipc::channel::<u32>().expect("channel");
        let bare = interrupted(&tx, Duration::from_secs(20), move || {
            rx.try_recv_timeout(Duration::from_secs(60))
        });
        assert!(
            bare.as_ref().is_err_and(|e| e.contains("Interrupted")),
            "{bare:?}"
        );
        let (tx, rx) = ipc::channel::<u32>().expect("channel");
        let waited = interrupted(&tx, Duration::from_millis(300), move || {
            recv_within(&rx, Duration::from_secs(60))
        });
        assert_eq!(waited, Ok(7));
    }

    #[test]
    fn a_server_of_an_untrusted_uid_is_refused_naming_its_uid_and_pid() {
        let me = nix::unistd::geteuid().as_raw();
        let mine = Peer { uid: me, pid: 7 };
        check_server("addr", mine, &[me]).unwrap();
        let other = Peer {
            uid: me.wrapping_add(1000),
            pid: 4321,
        };
        let err = check_server("addr", other, &[me]).unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(err, CacheError::ForeignServer { server_uid, server_pid: 4321, .. } if server_uid == other.uid),
            "{err:?}"
        );
        assert!(text.contains(&format!("uid {}", other.uid)), "{text}");
        assert!(text.contains("pid 4321"), "{text}");
        assert!(text.contains("--allow-uid"), "{text}");
        check_server("addr", other, &[me, other.uid]).unwrap();
    }

    #[test]
    fn trusted_uids_come_from_a_list_and_a_bad_entry_is_named() {
        assert_eq!(parse_uids("1000, 1001,").unwrap(), vec![1000, 1001]);
        assert!(parse_uids("").unwrap().is_empty());
        let err = parse_uids("1000,bob").unwrap_err().to_string();
        assert!(
            err.contains("\"bob\"") && err.contains(ALLOW_UIDS_ENV),
            "{err}"
        );
        let options = ClientOptions::default()
            .trusting(&[5])
            .waiting(Duration::from_secs(2));
        assert_eq!(options.trusted_uids.len(), 2);
        assert_eq!(options.reply_timeout, Duration::from_secs(2));
    }

    #[test]
    fn only_refusals_other_than_protocol_errors_are_bypassed() {
        let refused = |error| CacheError::Refused {
            request: "reserve",
            error,
        };
        let full = RequestError::StoreFull {
            key: "k".into(),
            len: 1,
            pinned_bytes: 1,
            filling_bytes: 0,
            cap: 1,
        };
        assert!(refused(full).is_bypassable());
        assert!(refused(RequestError::TooManyLeases { max: 64 }).is_bypassable());
        assert!(!refused(RequestError::Protocol("bug".into())).is_bypassable());
        assert!(!CacheError::Broken.is_bypassable());
    }
}
