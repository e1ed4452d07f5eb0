//! The cache server: one per node. It listens on an abstract Unix socket (nothing on
//! disk, gone with the process), hands each client the store's memfd and typed
//! channels, and serves each connection on its own thread over one locked store.
//! Hits on cached records never reach it: clients pin them in their own pin pages
//! themselves. Concurrent misses on a key wait for the first fill. When a
//! connection ends (the client closed it, or sent a frame that decodes to no
//! request: it gets no reply, the server cannot tell what it meant) its fills are
//! abandoned and their keys go to other readers; their extents stay taken and its
//! leases keep pinning until the client's rendezvous socket closes too (the client,
//! its writable fill maps and every lease it handed out are gone then), and only
//! then are the extents freed and its pin page cleared and reused.
//!
//! A panic in a request is caught on its connection's thread. It may have left the
//! store half-updated (the lock it held is poisoned), so the server does not go on
//! with it: the request gets a [`RequestError::StorePoisoned`] reply naming the
//! panic, so does every later request on any connection, the server logs it, stops
//! accepting connections, and [`Server::run`] returns [`CacheError::StorePoisoned`].
//!
//! A node-shared server ([`ServerConfig::linger`]) counts its connections, from
//! accept to the end of their clean-up, and stops once none has been open for the
//! linger; before its first client it waits [`ServerConfig::first_client_grace`]
//! (at least the linger) instead, so the job that started it has time to attach
//! on a loaded node, and a server nobody attaches to still does not stay.

use std::any::Any;
use std::io::{Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::panic::{self, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ipc_channel::ipc::{IpcOneShotServer, IpcReceiver, IpcSender};
use ipc_channel::IpcError;
use tracing::{debug, error, info, warn};

use super::admission::{peer_of, Admission, Gate, HandshakeLimits, HandshakeSlot};
use super::fdpass;
use super::handshake_dir;
use super::protocol::{ClientId, Reply, Request, RequestError};
use super::rendezvous::{self, Greeting};
use super::shm::Segment;
use super::store::reserve::Reservations;
use super::store::{ClientLabel, GetOutcome, PrefetchOutcome, Store};
use super::table::{extent_for, Layout, SLOT_ALIGN};
use super::CacheError;
use crate::util::bytes::human;
use crate::util::meminfo;

/// Memory kept free on the node when a slot's memory is reserved: 512 MiB.
pub const DEFAULT_RESERVE_HEADROOM: u64 = 512 << 20;

/// How a server is set up.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Abstract socket name clients connect to (see [`default_address`](super::default_address)).
    pub address: String,
    /// Byte cap: the size of the store. Its memory is reserved as slots are carved,
    /// never more than this.
    pub cap_bytes: u64,
    /// Bytes of memory a new slot must leave free on the node (MemAvailable, or the
    /// cgroup's room); a slot that would eat into them is refused.
    pub reserve_headroom: u64,
    /// The typical smallest record: the store has a descriptor per this many bytes
    /// of the cap (`None`: one per 64 KiB, at least 1024). Records of any size up
    /// to the cap are stored either way.
    pub record_bytes: Option<u64>,
    /// How long a get waits for another client's fill of the same key.
    pub fill_wait_timeout: Duration,
    /// How long a connecting client has to finish the handshake.
    pub handshake_timeout: Duration,
    /// Users whose processes may connect (checked with `SO_PEERCRED` at accept);
    /// by default the server's own user only.
    pub allowed_uids: Vec<u32>,
    /// Handshakes in flight, in all and per client process.
    pub handshake_limits: HandshakeLimits,
    /// Stop once no connection has been open for this long (a node-shared server);
    /// `None`: run until told to stop.
    pub linger: Option<Duration>,
    /// With a linger: how long it waits for its first client.
    pub first_client_grace: Duration,
}

/// How long a lingering server waits for its first client by default.
pub const DEFAULT_FIRST_CLIENT_GRACE: Duration = Duration::from_secs(30);

impl ServerConfig {
    /// A server at `address` with a store of `cap_bytes`.
    pub fn new(address: impl Into<String>, cap_bytes: u64) -> ServerConfig {
        ServerConfig {
            address: address.into(),
            cap_bytes,
            reserve_headroom: DEFAULT_RESERVE_HEADROOM,
            record_bytes: None,
            fill_wait_timeout: Duration::from_secs(120),
            handshake_timeout: Duration::from_secs(10),
            allowed_uids: vec![nix::unistd::geteuid().as_raw()],
            handshake_limits: HandshakeLimits::default(),
            linger: None,
            first_client_grace: DEFAULT_FIRST_CLIENT_GRACE,
        }
    }

    fn validate(&self) -> Result<(), CacheError> {
        if self.address.is_empty() || self.address.len() > 100 {
            return Err(CacheError::BadAddress {
                address: self.address.clone(),
            });
        }
        if self.cap_bytes < SLOT_ALIGN {
            return Err(CacheError::StoreTooSmall {
                cap: self.cap_bytes,
                record_bytes: SLOT_ALIGN,
            });
        }
        if let Some(record) = self.record_bytes {
            let extent = extent_for(record).unwrap_or(u64::MAX);
            if record == 0 || extent > self.cap_bytes {
                return Err(CacheError::StoreTooSmall {
                    cap: self.cap_bytes,
                    record_bytes: record,
                });
            }
        }
        Ok(())
    }
}

pub(crate) fn socket_addr(address: &str) -> Result<SocketAddr, CacheError> {
    SocketAddr::from_abstract_name(address.as_bytes()).map_err(|_| CacheError::BadAddress {
        address: address.to_string(),
    })
}

/// Refuses a store larger than the node's whole memory (it could never be filled:
/// a typo); warns when it is larger than what is free now (it fills up to that,
/// then evicts). Nothing is reserved here: slots take memory as they are carved.
fn check_cap_fits(store_bytes: u64) -> Result<(), CacheError> {
    let total = meminfo::meminfo_bytes("MemTotal")?;
    if store_bytes > total {
        return Err(CacheError::ShmTooSmall {
            requested: store_bytes,
            available: total,
            limit: "MemTotal in /proc/meminfo: the node's whole memory".into(),
        });
    }
    let free = meminfo::shared_memory_available()?;
    if store_bytes > free.bytes {
        warn!(
            cap = %human(store_bytes),
            free = %human(free.bytes),
            limit = %free.limit,
            "the cache cap is larger than the memory free now; the store will fill up to what \
             can be reserved, then evict"
        );
    }
    Ok(())
}

/// State every connection thread shares.
struct Shared {
    store: Mutex<Store>,
    /// Signalled whenever a fill commits or is abandoned.
    fill_done: Condvar,
    segment: Arc<Segment>,
    store_id: u64,
    address: String,
    pid: u32,
    config: ServerConfig,
    shutdown: AtomicBool,
    /// Why the store is unusable: the first panic in a request, set once.
    poisoned_by: OnceLock<String>,
    /// Who may handshake, and how many at once.
    gate: Gate,
    /// Where this process's one-shot handshake sockets are made.
    handshake_dir: PathBuf,
    /// Connections open now, from accept to the end of their clean-up.
    connections: AtomicUsize,
    /// Connections admitted since the start.
    admitted: AtomicUsize,
}

impl Shared {
    /// The store, locked; refused for good once a request has panicked.
    fn store(&self) -> Result<MutexGuard<'_, Store>, RequestError> {
        self.check_poison()?;
        self.store
            .lock()
            .map_err(|_| self.poison("a request panicked while holding the store".into()))
    }

    /// `StorePoisoned` once a request has panicked.
    fn check_poison(&self) -> Result<(), RequestError> {
        match self.poisoned_by.get() {
            Some(cause) => Err(RequestError::StorePoisoned {
                cause: cause.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Marks the store unusable (the first cause stays): logs it, stops accepting
    /// connections and wakes the gets waiting for fills; returns the error that
    /// every request gets from now on.
    fn poison(&self, cause: String) -> RequestError {
        if self.poisoned_by.set(cause).is_ok() {
            error!(
                address = %self.address,
                cause = self.poisoned_by.get().map_or("", String::as_str),
                "the cache store may be half-updated after a panic: refusing every request and shutting down"
            );
            request_shutdown(self);
            self.fill_done.notify_all();
        }
        let cause = self.poisoned_by.get().cloned().unwrap_or_default();
        RequestError::StorePoisoned { cause }
    }
}

/// A bound server, ready to run.
pub struct Server {
    listener: UnixListener,
    shared: Arc<Shared>,
}

impl Server {
    /// Checks the config, binds the address, then creates and reserves the store.
    pub fn bind(config: ServerConfig) -> Result<Server, CacheError> {
        config.validate()?;
        let addr = socket_addr(&config.address)?;
        let listener = UnixListener::bind_addr(&addr).map_err(|source| {
            if source.kind() == std::io::ErrorKind::AddrInUse {
                CacheError::AddressInUse {
                    address: config.address.clone(),
                }
            } else {
                CacheError::Bind {
                    address: config.address.clone(),
                    source,
                }
            }
        })?;
        let handshake_dir = handshake_dir::prepare()?;
        let gate = Gate::new(config.allowed_uids.clone(), config.handshake_limits);
        let layout = Layout::for_store(config.cap_bytes, config.record_bytes);
        check_cap_fits(layout.total_bytes())?;
        let segment = Arc::new(Segment::create(layout.total_bytes())?);
        let headroom = config.reserve_headroom;
        let (table, pins) = segment.create_table(layout)?;
        let reserver = Box::new(segment.reserver(headroom));
        let meta_bytes = layout.total_bytes() - layout.meta_offset();
        let reservations = Reservations::new(reserver, meta_bytes);
        let pid = std::process::id();
        let store_id = (u64::from(pid) << 32) ^ rand::random::<u32>() as u64;
        let store = Store::new(store_id, config.cap_bytes, table, pins, reservations);
        info!(
            address = %config.address,
            cap = %human(config.cap_bytes),
            metadata = %human(meta_bytes),
            record_descriptors = layout.slots,
            "cache server ready"
        );
        Ok(Server {
            listener,
            shared: Arc::new(Shared {
                store: Mutex::new(store),
                fill_done: Condvar::new(),
                segment,
                store_id,
                address: config.address.clone(),
                pid,
                config,
                shutdown: AtomicBool::new(false),
                poisoned_by: OnceLock::new(),
                gate,
                handshake_dir,
                connections: AtomicUsize::new(0),
                admitted: AtomicUsize::new(0),
            }),
        })
    }

    /// The address clients connect to.
    pub fn address(&self) -> &str {
        &self.shared.address
    }

    /// Checks a new connection's peer and either starts its handshake on a thread
    /// of its own or answers it at once (refused, busy) and closes it.
    fn admit(&self, stream: UnixStream) {
        let peer = match peer_of(&stream) {
            Ok(peer) => peer,
            Err(e) => return warn!("cannot read a connecting peer's credentials: {e}"),
        };
        let slot = match self.shared.gate.admit(peer) {
            Admission::Admit(slot) => slot,
            Admission::Refused(peer) => {
                warn!(
                    uid = peer.uid,
                    pid = peer.pid,
                    "refused a connection from uid {} (pid {}): not an allowed user \
                     (start the server with --allow-uid {} to let it in)",
                    peer.uid,
                    peer.pid,
                    peer.uid
                );
                return answer_and_close(stream, &Greeting::Refused);
            }
            Admission::Busy(peer) => {
                debug!(
                    uid = peer.uid,
                    pid = peer.pid,
                    "too many handshakes in flight"
                );
                return answer_and_close(stream, &Greeting::Busy);
            }
        };
        let shared = Arc::clone(&self.shared);
        shared.connections.fetch_add(1, Ordering::SeqCst);
        shared.admitted.fetch_add(1, Ordering::SeqCst);
        let spawned = std::thread::Builder::new()
            .name("cache-conn".into())
            .spawn(move || {
                serve_connection(&shared, stream, slot);
                shared.connections.fetch_sub(1, Ordering::SeqCst);
            });
        if let Err(e) = spawned {
            self.shared.connections.fetch_sub(1, Ordering::SeqCst);
            warn!("cannot start a connection thread: {e}");
        }
    }

    /// With a linger: a thread that stops the server once no connection has been
    /// open for that long.
    fn start_linger_watch(&self) -> Result<(), CacheError> {
        let Some(linger) = self.shared.config.linger else {
            return Ok(());
        };
        let shared = Arc::clone(&self.shared);
        std::thread::Builder::new()
            .name("cache-linger".into())
            .spawn(move || linger_watch(&shared, linger))
            .map(drop)
            .map_err(|e| CacheError::Protocol(format!("cannot start the linger thread: {e}")))
    }

    /// Accepts connections until a shutdown request, or until a panic in a request
    /// has made the store unusable (an error then).
    pub fn run(self) -> Result<(), CacheError> {
        self.start_linger_watch()?;
        for stream in self.listener.incoming() {
            if self.shared.shutdown.load(Ordering::SeqCst) {
                break;
            }
            match stream {
                Ok(stream) => self.admit(stream),
                Err(e) => warn!("accept failed: {e}"),
            }
        }
        if let Some(cause) = self.shared.poisoned_by.get() {
            return Err(CacheError::StorePoisoned {
                address: self.shared.address.clone(),
                cause: cause.clone(),
            });
        }
        info!(address = %self.shared.address, "cache server stopped");
        Ok(())
    }
}

/// A server running on a thread of this process (tests, single-process tools).
/// Dropping it stops accepting; connected clients keep being served until they go.
pub struct ServerHandle {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<Result<(), CacheError>>>,
}

impl ServerHandle {
    /// The address clients connect to.
    pub fn address(&self) -> &str {
        &self.shared.address
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        request_shutdown(&self.shared);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Starts a server on a thread of this process.
pub fn spawn_server(config: ServerConfig) -> Result<ServerHandle, CacheError> {
    let server = Server::bind(config)?;
    let shared = Arc::clone(&server.shared);
    let thread = std::thread::Builder::new()
        .name("cache-server".into())
        .spawn(move || server.run())
        .map_err(|e| CacheError::Protocol(format!("cannot start the server thread: {e}")))?;
    Ok(ServerHandle {
        shared,
        thread: Some(thread),
    })
}

/// Stops the server once no connection has been open for `linger`.
fn linger_watch(shared: &Shared, linger: Duration) {
    let tick = (linger / 4).clamp(Duration::from_millis(10), Duration::from_millis(200));
    let mut idle_since = Some(Instant::now());
    while !shared.shutdown.load(Ordering::SeqCst) {
        std::thread::sleep(tick);
        if shared.connections.load(Ordering::SeqCst) > 0 {
            idle_since = None;
            continue;
        }
        let since = *idle_since.get_or_insert_with(Instant::now);
        let limit = match shared.admitted.load(Ordering::SeqCst) {
            0 => linger.max(shared.config.first_client_grace),
            _ => linger,
        };
        if since.elapsed() >= limit {
            info!(
                address = %shared.address,
                "no client for {:.1} s: the shared cache server stops",
                linger.as_secs_f64()
            );
            request_shutdown(shared);
            return;
        }
    }
}

fn request_shutdown(shared: &Shared) {
    shared.shutdown.store(true, Ordering::SeqCst);
    // Wake the accept loop so it sees the flag.
    if let Ok(addr) = socket_addr(&shared.address) {
        let _ = UnixStream::connect_addr(&addr);
    }
}

/// Writes one greeting without waiting (the socket's buffer takes it, or the peer
/// is not reading and loses it), then closes.
fn answer_and_close(mut stream: UnixStream, greeting: &Greeting) {
    if stream.set_nonblocking(true).is_ok() {
        let _ = write_frame(&mut stream, &greeting.encode());
    }
}

/// Length-prefixed frame on the rendezvous socket.
pub(crate) fn write_frame(stream: &mut UnixStream, bytes: &[u8]) -> std::io::Result<()> {
    let len = u32::try_from(bytes.len())
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "frame too long"))?;
    stream.write_all(&len.to_le_bytes())?;
    stream.write_all(bytes)
}

pub(crate) fn read_frame(stream: &mut UnixStream) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > 4096 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("frame of {len} bytes"),
        ));
    }
    let mut buf = vec![0u8; len];
    stream.read_exact(&mut buf)?;
    Ok(buf)
}

/// The rendezvous part of a handshake: the client's hello byte, a one-shot channel
/// named to it, its acknowledgement, and the first message on the channel (the
/// one-shot socket's files are removed then).
fn open_channel(
    shared: &Shared,
    stream: &mut UnixStream,
) -> Result<(IpcReceiver<Request>, Request), String> {
    let timeout = shared.config.handshake_timeout;
    stream
        .set_read_timeout(Some(timeout))
        .map_err(|e| e.to_string())?;
    let mut hello = [0u8; 1];
    stream
        .read_exact(&mut hello)
        .map_err(|e| format!("client said no hello: {e}"))?;
    if hello[0] != rendezvous::HELLO {
        return Err(format!("client said {:#x}, not hello", hello[0]));
    }
    let (oneshot, name) =
        IpcOneShotServer::<Request>::new().map_err(|e| format!("one-shot server: {e}"))?;
    let dir = &shared.handshake_dir;
    // The one-shot socket goes as soon as the client is connected, or failed to.
    let mut handshake_files = handshake_dir::OneshotFiles::new(&name, dir);
    if shared.gate.admits_others(nix::unistd::geteuid().as_raw()) {
        handshake_dir::open_oneshot_to_others(&name, dir).map_err(|e| e.to_string())?;
    }
    let greeting = Greeting::Channel(name.clone()).encode();
    write_frame(stream, &greeting).map_err(|e| format!("sending channel name: {e}"))?;
    let mut ack = [0u8; 1];
    stream
        .read_exact(&mut ack)
        .map_err(|e| format!("client did not finish the handshake: {e}"))?;
    let accepted = accept_within(oneshot, &name, timeout);
    handshake_files.remove();
    accepted
}

/// Accepts the client's connection to the one-shot channel `name` within
/// `timeout`. The channel's accept has no timeout, and a client that acknowledged
/// without connecting would hold its handshake slot for good: when the time is up,
/// a watchdog connects itself, so the accept returns with a message that is not the
/// client's hello, and the handshake fails.
fn accept_within(
    oneshot: IpcOneShotServer<Request>,
    name: &str,
    timeout: Duration,
) -> Result<(IpcReceiver<Request>, Request), String> {
    let (done, wait) = std::sync::mpsc::channel::<()>();
    let wake_name = name.to_string();
    let watchdog = std::thread::Builder::new()
        .name("cache-accept-watch".into())
        .spawn(move || {
            if wait.recv_timeout(timeout) != Err(std::sync::mpsc::RecvTimeoutError::Timeout) {
                return false;
            }
            match IpcSender::<Request>::connect(wake_name) {
                Ok(wake) => wake.send(Request::Stats).is_ok(),
                Err(_) => false,
            }
        })
        .map_err(|e| format!("cannot start the accept watchdog: {e}"))?;
    let accepted = oneshot.accept();
    let _ = done.send(());
    let woken = watchdog.join().unwrap_or(false);
    match accepted {
        Ok((_, Request::Stats)) if woken => Err(format!(
            "the client acknowledged the channel but did not connect to it within {} s",
            timeout.as_secs_f64()
        )),
        Ok(pair) => Ok(pair),
        Err(e) => Err(format!("accept: {e:?}")),
    }
}

/// Handshake: after the client's hello byte, a fresh one-shot ipc server, its name
/// sent over the rendezvous socket; the client connects, sends Hello, then
/// acknowledges here, and the one-shot socket's directory is removed at once.
fn handshake(
    shared: &Shared,
    stream: &mut UnixStream,
) -> Result<(IpcReceiver<Request>, IpcSender<Reply>, ClientId), String> {
    let (requests, hello) = open_channel(shared, stream)?;
    let Request::Hello {
        name,
        job,
        pid,
        mapped_store,
        reply,
    } = hello
    else {
        return Err(format!("first message was {}, not hello", hello.kind()));
    };
    let connected = shared.store().and_then(|mut store| {
        store.connect_as(ClientLabel {
            name: name.clone(),
            job,
            pid,
        })
    });
    let (client, pin_page) = match connected {
        Ok(parts) => parts,
        Err(error) => {
            let message = format!("client {name:?} (pid {pid}) refused: {error}");
            let _ = reply.send(Reply::Error(error));
            return Err(message);
        }
    };
    let store_fd_follows = mapped_store != Some(shared.store_id);
    let welcome = Reply::Welcome {
        client,
        store_id: shared.store_id,
        store_len: shared.segment.len(),
        arena_bytes: shared.config.cap_bytes,
        pin_page: pin_page as u32,
        fill_wait_ms: u64::try_from(shared.config.fill_wait_timeout.as_millis())
            .unwrap_or(u64::MAX),
        store_fd_follows,
    };
    let sent = reply.send(welcome).map_err(|e| format!("welcome: {e:?}"));
    let sent = sent.and_then(|()| match store_fd_follows {
        true => fdpass::send_fd(stream, shared.segment.fd())
            .map_err(|e| format!("sending the store's memfd: {e}")),
        false => Ok(()),
    });
    if let Err(message) = sent {
        if let Ok(mut store) = shared.store() {
            store.disconnect(client);
            store.forget(client);
        }
        return Err(message);
    }
    debug!(client, %name, pid, "client connected");
    Ok((requests, reply, client))
}

fn serve_connection(shared: &Shared, mut stream: UnixStream, slot: HandshakeSlot) {
    if shared.shutdown.load(Ordering::SeqCst) {
        return;
    }
    let handshake = handshake(shared, &mut stream);
    drop(slot);
    let (requests, reply, client) = match handshake {
        Ok(parts) => parts,
        Err(message) => {
            if !shared.shutdown.load(Ordering::SeqCst) {
                warn!("handshake failed: {message}");
            }
            return;
        }
    };
    loop {
        let request = match requests.recv() {
            Ok(request) => request,
            Err(IpcError::Disconnected) => break,
            Err(e) => {
                warn!(client, "bad message, closing the connection: {e:?}");
                break;
            }
        };
        let shutdown = matches!(request, Request::Shutdown);
        let answer = handle(shared, client, request);
        if reply.send(answer).is_err() {
            break;
        }
        if shutdown {
            info!(client, "shutdown requested");
            request_shutdown(shared);
        }
    }
    // The client's requests go nowhere from now on (it sees the server gone).
    drop((requests, reply));
    let Ok(mut store) = shared.store() else {
        debug!(client, "client gone; no clean-up in a poisoned store");
        return;
    };
    let abandoned = store.disconnect(client);
    drop(store);
    if abandoned > 0 {
        shared.fill_done.notify_all();
        info!(
            client,
            abandoned, "connection ended; its fills were abandoned"
        );
    } else {
        debug!(client, "connection ended");
    }
    wait_until_closed(&mut stream);
    if let Ok(mut store) = shared.store() {
        store.forget(client);
        debug!(client, "client gone; its leases are released");
    }
}

/// Waits until the client closes its end of the rendezvous socket (it holds it for
/// its connection's whole life): its leases may pin until then.
fn wait_until_closed(stream: &mut UnixStream) {
    if stream.set_read_timeout(None).is_err() {
        return;
    }
    let mut buf = [0u8; 64];
    while matches!(stream.read(&mut buf), Ok(n) if n > 0) {}
}

fn handle(shared: &Shared, client: ClientId, request: Request) -> Reply {
    let kind = request.kind();
    let result = guarded(shared, client, kind, || serve(shared, client, request));
    result.unwrap_or_else(|error| {
        warn!(client, request = kind, "refused: {error}");
        if let Ok(mut store) = shared.store() {
            store.count_error(client);
        }
        Reply::Error(error)
    })
}

/// Runs `serve` (one `kind` request of `client`); a panic in it poisons the store.
fn guarded(
    shared: &Shared,
    client: ClientId,
    kind: &str,
    serve: impl FnOnce() -> Result<Reply, RequestError>,
) -> Result<Reply, RequestError> {
    panic::catch_unwind(AssertUnwindSafe(serve)).unwrap_or_else(|panic| {
        let message = panic_message(panic.as_ref());
        Err(shared.poison(format!(
            "the {kind} request of client {client} panicked: {message}"
        )))
    })
}

/// The message a panic was raised with.
fn panic_message(panic: &(dyn Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic with no message")
}

fn serve(shared: &Shared, client: ClientId, request: Request) -> Result<Reply, RequestError> {
    shared.store()?.count_request(client);
    match request {
        Request::Get { key } => get_or_wait(shared, client, &key),
        Request::Peek { key } => shared
            .store()?
            .peek(client, &key)
            .map(|g| g.map_or(Reply::NotCached, Reply::Hit)),
        Request::Reserve { ticket, len } => match shared.store()?.reserve(client, ticket, len) {
            Ok((offset, len)) => Ok(Reply::Reserved {
                ticket,
                offset,
                len,
            }),
            // The planned policy's choice, not a failure: not logged or counted.
            Err(RequestError::Declined { .. }) => Ok(Reply::Declined),
            Err(error) => Err(error),
        },
        Request::ReadOrder(order) => shared
            .store()?
            .announce_read_order(client, order)
            .map(|()| Reply::Done),
        Request::Prefetch { key, len } => {
            let outcome = shared.store()?.prefetch(client, &key, len)?;
            Ok(match outcome {
                PrefetchOutcome::Present => Reply::Done,
                PrefetchOutcome::Declined => Reply::Declined,
                PrefetchOutcome::Reserved {
                    ticket,
                    offset,
                    len,
                } => Reply::Reserved {
                    ticket,
                    offset,
                    len,
                },
            })
        }
        Request::Commit { ticket } => {
            let grant = shared.store()?.commit(client, ticket);
            shared.fill_done.notify_all();
            grant.map(Reply::Committed)
        }
        Request::Abort { ticket } => {
            let done = shared.store()?.abort(client, ticket);
            shared.fill_done.notify_all();
            done.map(|()| Reply::Done)
        }
        Request::Release { lease } => shared.store()?.release(client, lease).map(|()| Reply::Done),
        Request::Invalidate { key } => shared.store()?.invalidate(&key).map(|()| Reply::Done),
        Request::Stats => Ok(Reply::Stats(Box::new(shared.store()?.stats(shared.pid)))),
        Request::Shutdown => Ok(Reply::Done),
        Request::Hello { .. } => Err(RequestError::Protocol(
            "hello after the handshake".to_string(),
        )),
    }
}

/// A get that waits (single flight) while another client fills the key.
fn get_or_wait(shared: &Shared, client: ClientId, key: &str) -> Result<Reply, RequestError> {
    let started = Instant::now();
    let timeout = shared.config.fill_wait_timeout;
    let mut store = shared.store()?;
    let mut waited = false;
    loop {
        match store.get(client, key)? {
            GetOutcome::Hit(grant) if waited => return Ok(Reply::HitAfterWait(grant)),
            GetOutcome::Hit(grant) => return Ok(Reply::Hit(grant)),
            GetOutcome::Miss(ticket) => return Ok(Reply::Miss { ticket }),
            GetOutcome::Wait { filler } => {
                waited = true;
                let waited = started.elapsed();
                if waited >= timeout {
                    return Err(RequestError::FillTimedOut {
                        key: key.to_string(),
                        filler,
                        waited_s: waited.as_secs(),
                    });
                }
                let filling =
                    |s: &mut Store| s.is_filling(key) && shared.poisoned_by.get().is_none();
                let (guard, _) = shared
                    .fill_done
                    .wait_timeout_while(store, timeout - waited, filling)
                    .map_err(|_| {
                        shared.poison("a request panicked while holding the store".into())
                    })?;
                shared.check_poison()?;
                store = guard;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bound(name: &str) -> Server {
        let address = format!("vrtspike-test-{name}-{}", std::process::id());
        Server::bind(ServerConfig::new(address, 1 << 20)).unwrap()
    }

    fn refused_as_poisoned(reply: Reply) -> String {
        match reply {
            Reply::Error(RequestError::StorePoisoned { cause }) => cause,
            other => panic!("expected a StorePoisoned refusal, got {other:?}"),
        }
    }

    #[test]
    fn a_panic_in_a_request_poisons_the_store_and_stops_the_server() {
        let server = bound("panic");
        let shared = Arc::clone(&server.shared);
        let client = shared.store().unwrap().connect("t".into(), 1).unwrap().0;
        assert!(matches!(
            handle(&shared, client, Request::Stats),
            Reply::Stats(_)
        ));
        let panicked = guarded(&shared, client, "get", || {
            let _store = shared.store()?;
            panic!("bug in the store");
        });
        let Err(RequestError::StorePoisoned { cause }) = panicked else {
            panic!("expected StorePoisoned, got {panicked:?}");
        };
        assert!(cause.contains("get request of client"), "{cause}");
        assert!(cause.contains("bug in the store"), "{cause}");
        assert!(shared.shutdown.load(Ordering::SeqCst));
        let later = refused_as_poisoned(handle(&shared, client, Request::Stats));
        assert_eq!(later, cause, "later requests name the first panic");
        match server.run() {
            Err(CacheError::StorePoisoned { cause: why, .. }) => assert_eq!(why, cause),
            other => panic!("expected the server to stop with StorePoisoned: {other:?}"),
        }
    }

    /// Runs a bound server on a thread; its end is the thread's.
    fn running(server: Server) -> JoinHandle<Result<(), CacheError>> {
        std::thread::spawn(move || server.run())
    }

    fn wait_finished(thread: &JoinHandle<Result<(), CacheError>>, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !thread.is_finished() {
            assert!(Instant::now() < deadline, "{what}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    #[test]
    fn a_lingering_server_stays_while_a_client_is_connected_then_stops() {
        let linger = Duration::from_millis(300);
        let address = format!("vrtspike-test-linger-{}", std::process::id());
        let mut config = ServerConfig::new(address.clone(), 1 << 20);
        config.linger = Some(linger);
        let thread = running(Server::bind(config).unwrap());
        let client = crate::cache::CacheClient::connect(&address, "job a").unwrap();
        std::thread::sleep(linger * 4);
        assert!(!thread.is_finished(), "stopped with a client connected");
        assert!(client.stats().is_ok());
        drop(client);
        wait_finished(&thread, "still running a minute after its last client left");
        assert!(thread.join().unwrap().is_ok());
        let gone = crate::cache::CacheClient::connect(&address, "late");
        assert!(
            matches!(gone, Err(CacheError::Connect { .. })),
            "the address is free again: {:?}",
            gone.err()
        );
    }

    #[test]
    fn a_lingering_server_nobody_attaches_to_stops_and_one_without_linger_does_not() {
        let address = format!("vrtspike-test-linger-alone-{}", std::process::id());
        let mut config = ServerConfig::new(address.clone(), 1 << 20);
        config.linger = Some(Duration::from_millis(100));
        config.first_client_grace = Duration::from_millis(1500);
        let thread = running(Server::bind(config).unwrap());
        std::thread::sleep(Duration::from_millis(500));
        assert!(
            !thread.is_finished(),
            "stopped within its first client's grace, past its linger"
        );
        wait_finished(&thread, "a server nobody attached to did not stop");
        let forever = bound("forever");
        let shared = Arc::clone(&forever.shared);
        let thread = running(forever);
        std::thread::sleep(Duration::from_millis(500));
        assert!(!thread.is_finished(), "a server without linger stopped");
        request_shutdown(&shared);
        wait_finished(&thread, "did not stop when asked");
    }

    #[test]
    fn a_store_lock_poisoned_elsewhere_is_refused_too() {
        let server = bound("lock");
        let shared = Arc::clone(&server.shared);
        let client = shared.store().unwrap().connect("t".into(), 1).unwrap().0;
        let poisoner = std::thread::spawn({
            let shared = Arc::clone(&shared);
            move || {
                let _store = shared.store.lock();
                panic!("poisoning the store lock");
            }
        });
        assert!(poisoner.join().is_err());
        let key = "k".to_string();
        let cause = refused_as_poisoned(handle(&shared, client, Request::Get { key }));
        assert!(cause.contains("holding the store"), "{cause}");
        assert!(shared.shutdown.load(Ordering::SeqCst));
    }
}
