//! The cache server: one per node. It listens on an abstract Unix socket (nothing on
//! disk, gone with the process), hands each client the store's memfd and typed
//! channels, and serves each connection on its own thread over one locked store.
//! Hits on cached records never reach it: clients pin them in the shared slot table
//! themselves. Concurrent misses on a key wait for the first fill; a client that
//! disconnects or dies gets its pin bit cleared everywhere and its fills abandoned.

use std::io::{Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ipc_channel::ipc::{IpcOneShotServer, IpcSender};
use ipc_channel::IpcError;
use tracing::{debug, info, warn};

use super::protocol::{ClientId, Reply, Request, RequestError};
use super::shm::Segment;
use super::store::{GetOutcome, Store, SLOT_ALIGN};
use super::table::Layout;
use super::CacheError;
use crate::util::bytes::human;

/// How a server is set up.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Abstract socket name clients connect to (see [`default_address`]).
    pub address: String,
    /// Byte cap: the size of the store, reserved at start.
    pub cap_bytes: u64,
    /// Slot sizes; empty: one class per record size, made on its first fill.
    pub slot_bytes: Vec<u64>,
    /// How long a get waits for another client's fill of the same key.
    pub fill_wait_timeout: Duration,
    /// How long a connecting client has to finish the handshake.
    pub handshake_timeout: Duration,
}

impl ServerConfig {
    /// A server at `address` with a store of `cap_bytes`.
    pub fn new(address: impl Into<String>, cap_bytes: u64) -> ServerConfig {
        ServerConfig {
            address: address.into(),
            cap_bytes,
            slot_bytes: Vec::new(),
            fill_wait_timeout: Duration::from_secs(120),
            handshake_timeout: Duration::from_secs(10),
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
                slot_bytes: SLOT_ALIGN,
            });
        }
        if let Some(&largest) = self.slot_bytes.iter().max() {
            let slot = super::store::slot_size_for(largest);
            if slot > self.cap_bytes {
                return Err(CacheError::StoreTooSmall {
                    cap: self.cap_bytes,
                    slot_bytes: slot,
                });
            }
        }
        Ok(())
    }
}

/// The address for a run: `vrtspike-cache-<run id>`.
pub fn default_address(run_id: &str) -> String {
    format!("vrtspike-cache-{run_id}")
}

pub(crate) fn socket_addr(address: &str) -> Result<SocketAddr, CacheError> {
    SocketAddr::from_abstract_name(address.as_bytes()).map_err(|_| CacheError::BadAddress {
        address: address.to_string(),
    })
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
}

impl Shared {
    fn store(&self) -> MutexGuard<'_, Store> {
        // The store has no invariant a panicking thread could break half-way through
        // a request that matters more than serving everyone else.
        self.store.lock().unwrap_or_else(|e| e.into_inner())
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
        let layout = Layout::for_store(config.cap_bytes, &config.slot_bytes);
        let segment = Arc::new(Segment::create(layout.total_bytes())?);
        let table = segment.create_table(layout)?;
        let pid = std::process::id();
        let store_id = (u64::from(pid) << 32) ^ rand::random::<u32>() as u64;
        let store = Store::new(store_id, config.cap_bytes, &config.slot_bytes, table);
        info!(
            address = %config.address,
            cap = %human(config.cap_bytes),
            metadata = %human(layout.meta_bytes()),
            slot_entries = layout.slots,
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
            }),
        })
    }

    /// The address clients connect to.
    pub fn address(&self) -> &str {
        &self.shared.address
    }

    /// Accepts connections until a shutdown request.
    pub fn run(self) -> Result<(), CacheError> {
        for stream in self.listener.incoming() {
            if self.shared.shutdown.load(Ordering::SeqCst) {
                break;
            }
            match stream {
                Ok(stream) => {
                    let shared = Arc::clone(&self.shared);
                    let spawned = std::thread::Builder::new()
                        .name("cache-conn".into())
                        .spawn(move || serve_connection(&shared, stream));
                    if let Err(e) = spawned {
                        warn!("cannot start a connection thread: {e}");
                    }
                }
                Err(e) => warn!("accept failed: {e}"),
            }
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

fn request_shutdown(shared: &Shared) {
    shared.shutdown.store(true, Ordering::SeqCst);
    // Wake the accept loop so it sees the flag.
    if let Ok(addr) = socket_addr(&shared.address) {
        let _ = UnixStream::connect_addr(&addr);
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

/// Handshake: a fresh one-shot ipc server per connection, its name sent over the
/// rendezvous socket; the client connects, sends Hello, then acknowledges here.
fn handshake(
    shared: &Shared,
    mut stream: UnixStream,
) -> Result<
    (
        ipc_channel::ipc::IpcReceiver<Request>,
        IpcSender<Reply>,
        ClientId,
    ),
    String,
> {
    let (oneshot, name) =
        IpcOneShotServer::<Request>::new().map_err(|e| format!("one-shot server: {e}"))?;
    write_frame(&mut stream, name.as_bytes()).map_err(|e| format!("sending channel name: {e}"))?;
    stream
        .set_read_timeout(Some(shared.config.handshake_timeout))
        .map_err(|e| e.to_string())?;
    let mut ack = [0u8; 1];
    stream
        .read_exact(&mut ack)
        .map_err(|e| format!("client did not finish the handshake: {e}"))?;
    let (requests, hello) = oneshot.accept().map_err(|e| format!("accept: {e:?}"))?;
    let Request::Hello {
        name,
        pid,
        mapped_store,
        reply,
    } = hello
    else {
        return Err(format!("first message was {}, not hello", hello.kind()));
    };
    let connected = shared.store().connect(name.clone(), pid);
    let (client, pin_bit) = match connected {
        Ok(parts) => parts,
        Err(error) => {
            let message = format!("client {name:?} (pid {pid}) refused: {error}");
            let _ = reply.send(Reply::Error(error));
            return Err(message);
        }
    };
    let store = (mapped_store != Some(shared.store_id)).then(|| shared.segment.share());
    let welcome = Reply::Welcome {
        client,
        store_id: shared.store_id,
        store_len: shared.segment.len(),
        arena_bytes: shared.config.cap_bytes,
        pin_bit: pin_bit as u32,
        store,
    };
    if let Err(e) = reply.send(welcome) {
        shared.store().disconnect(client);
        return Err(format!("welcome: {e:?}"));
    }
    debug!(client, %name, pid, "client connected");
    Ok((requests, reply, client))
}

fn serve_connection(shared: &Shared, stream: UnixStream) {
    if shared.shutdown.load(Ordering::SeqCst) {
        return;
    }
    let (requests, reply, client) = match handshake(shared, stream) {
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
    let abandoned = shared.store().disconnect(client);
    if abandoned > 0 {
        shared.fill_done.notify_all();
        info!(client, abandoned, "client gone; its fills were abandoned");
    } else {
        debug!(client, "client gone");
    }
}

fn handle(shared: &Shared, client: ClientId, request: Request) -> Reply {
    let kind = request.kind();
    shared.store().count_request(client);
    let result = match request {
        Request::Get { key } => get_or_wait(shared, client, &key),
        Request::Peek { key } => shared
            .store()
            .peek(client, &key)
            .map(|g| g.map_or(Reply::NotCached, Reply::Hit)),
        Request::Reserve { ticket, len } => {
            shared
                .store()
                .reserve(client, ticket, len)
                .map(|(offset, len)| Reply::Reserved {
                    ticket,
                    offset,
                    len,
                })
        }
        Request::Commit { ticket } => {
            let grant = shared.store().commit(client, ticket);
            shared.fill_done.notify_all();
            grant.map(Reply::Committed)
        }
        Request::Abort { ticket } => {
            let done = shared.store().abort(client, ticket);
            shared.fill_done.notify_all();
            done.map(|()| Reply::Done)
        }
        Request::Release { lease } => shared.store().release(client, lease).map(|()| Reply::Done),
        Request::Invalidate { key } => shared.store().invalidate(&key).map(|()| Reply::Done),
        Request::Stats => Ok(Reply::Stats(Box::new(shared.store().stats(shared.pid)))),
        Request::Shutdown => Ok(Reply::Done),
        Request::Hello { .. } => Err(RequestError::Protocol(
            "hello after the handshake".to_string(),
        )),
    };
    result.unwrap_or_else(|error| {
        warn!(client, request = kind, "refused: {error}");
        shared.store().count_error(client);
        Reply::Error(error)
    })
}

/// A get that waits (single flight) while another client fills the key.
fn get_or_wait(shared: &Shared, client: ClientId, key: &str) -> Result<Reply, RequestError> {
    let started = Instant::now();
    let timeout = shared.config.fill_wait_timeout;
    let mut store = shared.store();
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
                let (guard, _) = shared
                    .fill_done
                    .wait_timeout_while(store, timeout - waited, |s| s.is_filling(key))
                    .unwrap_or_else(|e| e.into_inner());
                store = guard;
            }
        }
    }
}
