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
//!
//! The server in parts: its settings and the checks before it binds (`config`),
//! one connection's life from the hello to the clean-up (`connection`), and the
//! answer to each request (`requests`); this file holds the state the connection
//! threads share, the accept loop and the linger.

use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{debug, error, info, warn};

use super::admission::{peer_of, Admission, Gate};
use super::handshake_dir;
use super::protocol::RequestError;
use super::rendezvous::{socket_addr, Greeting};
use super::shm::Segment;
use super::store::reserve::Reservations;
use super::store::Store;
use super::table::Layout;
use super::CacheError;
use crate::util::bytes::human;

mod config;
mod connection;
mod requests;

use config::check_cap_fits;
pub use config::{ServerConfig, DEFAULT_FIRST_CLIENT_GRACE, DEFAULT_RESERVE_HEADROOM};
use connection::{answer_and_close, serve_connection};

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
        let layout = Layout::for_store(config.cap_bytes, config.record_bytes)
            .with_connections(config.connections);
        check_cap_fits(layout.total_bytes())?;
        let segment = Arc::new(Segment::create(layout.total_bytes())?);
        let headroom = config.reserve_headroom;
        let (table, pins) = segment.create_table(layout)?;
        let reserver = Box::new(segment.reserver(headroom));
        let meta_bytes = layout.total_bytes() - layout.meta_offset();
        let reservations = Reservations::new(reserver, meta_bytes);
        let pid = std::process::id();
        let store_id = (u64::from(pid) << 32) ^ rand::random::<u32>() as u64;
        let mut store = Store::new(store_id, config.cap_bytes, table, pins, reservations);
        store.set_read_order_budget(config.read_order_budget);
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

#[cfg(test)]
mod tests {
    use super::*;

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
        // The address is free once the last copy of the listening socket is closed:
        // a child that another test of this process forks in these milliseconds (the
        // prober's fork test, any spawn before its exec) holds a copy until it execs
        // or exits, and a connection then still succeeds.
        let deadline = Instant::now() + Duration::from_secs(10);
        let addr = socket_addr(&address).unwrap();
        loop {
            match UnixStream::connect_addr(&addr) {
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => break,
                outcome => assert!(
                    Instant::now() < deadline,
                    "the address is still taken 10 s after the server stopped: {outcome:?}"
                ),
            }
            std::thread::sleep(Duration::from_millis(20));
        }
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
        let forever = Server::bind(ServerConfig::new(
            format!("vrtspike-test-forever-{}", std::process::id()),
            1 << 20,
        ))
        .unwrap();
        let shared = Arc::clone(&forever.shared);
        let thread = running(forever);
        std::thread::sleep(Duration::from_millis(500));
        assert!(!thread.is_finished(), "a server without linger stopped");
        request_shutdown(&shared);
        wait_finished(&thread, "did not stop when asked");
    }
}
