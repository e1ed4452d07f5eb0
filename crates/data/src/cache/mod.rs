//! The node-wide data cache: one server process holds the only RAM copy of the
//! dataset, in compact records in one shared-memory store with a byte cap; it
//! evicts the record whose next use is farthest in the order the ranks announced
//! (LRU for what no read order names), and every loader thread of every rank reads
//! records zero-copy under a lease.
//!
//! [`store`] is the bookkeeping, [`shm`] the memory, [`table`] the record
//! descriptors and index in shared memory (read-only to clients, who find hits there
//! without a message), [`pins`] each connection's own page of leases, [`server`]
//! and [`client`] the two ends of the control channel whose messages are in
//! [`protocol`]; [`address`] the default addresses, and [`own_server`] a job's own
//! server process as its starter holds it.

pub mod address;
pub mod admission;
pub mod announcement;
pub mod client;
pub mod fdpass;
pub mod handshake_dir;
pub mod ids;
pub mod own_server;
pub mod pins;
pub mod protocol;
pub mod rendezvous;
pub mod server;
pub mod shm;
pub mod stats;
pub mod store;
pub mod table;

pub use address::default_address;
pub use client::{CacheClient, ClientOptions, FillTicket, Lease, Lookup, Prefetch};
pub use protocol::RequestError;
pub use server::{spawn_server, Server, ServerConfig, ServerHandle};
pub use stats::StatsReport;

use crate::util::bytes::human;
use crate::util::meminfo::MeminfoError;

/// Environment variable that tells a rank where its node's cache server listens
/// (named by the launcher contract).
pub const ADDRESS_ENV: &str = vrtspike_contract::env::CACHE_ADDR;

/// What can go wrong talking to, or starting, the cache.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// No server listens at the address.
    #[error("cannot connect to the cache server at {address:?}: {source} (is `vrtspike cache serve --address {address}` running?)")]
    Connect {
        /// The address tried.
        address: String,
        /// The socket error.
        source: std::io::Error,
    },
    /// The server belongs to another user, who has not allowed this one in.
    #[error("refused: the cache server at {address:?} belongs to uid {server_uid} and this process runs as uid {uid}; run as that user, or start the server with --allow-uid {uid}")]
    NotAllowed {
        /// The address.
        address: String,
        /// The server's user.
        server_uid: u32,
        /// This process's user.
        uid: u32,
    },
    /// The server's process runs as a user this client does not trust: anyone can
    /// bind an abstract socket name first, so nothing is read from it.
    #[error("refused: the cache server at {address:?} runs as uid {server_uid} (pid {server_pid}), not as this process's uid {uid}, so another user may hold the address; nothing was read from it. If that server is meant to serve you, trust it with --allow-uid {server_uid} (or VRTSPIKE_CACHE_ALLOW_UIDS={server_uid}) and start it with --allow-uid {uid}")]
    ForeignServer {
        /// The address.
        address: String,
        /// The server's user.
        server_uid: u32,
        /// The server's process.
        server_pid: i32,
        /// This process's user.
        uid: u32,
    },
    /// The server speaks another protocol version (another build's server): it is
    /// never attached to.
    #[error("the cache server at {address:?} speaks cache protocol version {server} and this build speaks version {client}: it is another build's server, so this process does not attach to it (a node-shared server of this build has an address of its own; stop the other with that build's `vrtspike cache shutdown --address {address}`, or give this job another address)")]
    ProtocolVersion {
        /// The address.
        address: String,
        /// The server's version.
        server: u32,
        /// This build's version.
        client: u32,
    },
    /// The server had too many handshakes in flight for as long as we retried.
    #[error("the cache server at {address:?} stayed busy with other handshakes for {waited_s} s")]
    Busy {
        /// The address.
        address: String,
        /// Seconds spent retrying.
        waited_s: u64,
    },
    /// The directory of the handshake sockets is unusable.
    #[error("cache handshake directory {path:?}: {message}")]
    HandshakeDir {
        /// The directory.
        path: std::path::PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The connection was made but the handshake failed.
    #[error("handshake with the cache server at {address:?} failed: {message}")]
    Handshake {
        /// The address.
        address: String,
        /// What failed.
        message: String,
    },
    /// The server went away.
    #[error("the cache server at {address:?} has gone away")]
    ServerGone {
        /// The address.
        address: String,
    },
    /// The server refused a request; the connection is still usable.
    #[error("cache {request} refused: {error}")]
    Refused {
        /// The request.
        request: &'static str,
        /// Why.
        error: RequestError,
    },
    /// No reply in time; the connection is out of step and unusable.
    #[error("no reply from the cache server to {request} within {waited_s} s")]
    Timeout {
        /// The request.
        request: &'static str,
        /// Seconds waited.
        waited_s: u64,
    },
    /// A connection that timed out before is used again.
    #[error("this cache connection lost a reply earlier and cannot be used; open a new one")]
    Broken,
    /// The control channel failed.
    #[error("cache channel failed during {op}: {message}")]
    Ipc {
        /// The operation.
        op: &'static str,
        /// The channel's error.
        message: String,
    },
    /// A reply made no sense.
    #[error("cache protocol error: {0}")]
    Protocol(String),
    /// The server granted a range outside the store.
    #[error("cache server granted bytes {offset}..+{len} outside the store of {store_len} bytes")]
    BadGrant {
        /// Granted offset.
        offset: u64,
        /// Granted length.
        len: u64,
        /// The store's size.
        store_len: u64,
    },
    /// A write past the reserved slot.
    #[error("write of {len} bytes at offset {offset} into the slot of {key:?} exceeds its reserved {slot_len} bytes")]
    WriteOutOfSlot {
        /// The key being filled.
        key: String,
        /// Write offset.
        offset: u64,
        /// Write length.
        len: u64,
        /// The slot's reserved length.
        slot_len: u64,
    },
    /// A write before a reservation.
    #[error("fill of {key:?}: reserve a slot before writing")]
    NotReserved {
        /// The key being filled.
        key: String,
    },
    /// The machine cannot hold the store.
    #[error("cache store needs {} ({requested} bytes) of shared memory but only {} ({available} bytes) can be had ({limit}); lower DATA.CACHE_SIZE_GB / --cap", human(*requested), human(*available))]
    ShmTooSmall {
        /// Bytes asked for.
        requested: u64,
        /// Bytes free.
        available: u64,
        /// Which limit binds.
        limit: String,
    },
    /// A system call on the store's shared memory failed.
    #[error("cache store shared memory: {op} failed: {source}")]
    Shm {
        /// The call.
        op: &'static str,
        /// The error.
        source: std::io::Error,
    },
    /// The cap cannot hold even one record of the given size.
    #[error("cache cap of {cap} bytes holds no record of {record_bytes} bytes; raise DATA.CACHE_SIZE_GB / --cap")]
    StoreTooSmall {
        /// The cap.
        cap: u64,
        /// The record that does not fit.
        record_bytes: u64,
    },
    /// The address is taken.
    #[error("cache address {address:?} is in use: another cache server of this run is running")]
    AddressInUse {
        /// The address.
        address: String,
    },
    /// The address is not usable as an abstract socket name.
    #[error("bad cache address {address:?}: expected 1 to 100 bytes")]
    BadAddress {
        /// The address.
        address: String,
    },
    /// Binding failed for another reason.
    #[error("cannot listen at cache address {address:?}: {source}")]
    Bind {
        /// The address.
        address: String,
        /// The socket error.
        source: std::io::Error,
    },
    /// Memory figures could not be read.
    #[error(transparent)]
    Meminfo(#[from] MeminfoError),
    /// The store's shared metadata is unusable.
    #[error(transparent)]
    Table(#[from] table::TableError),
    /// This process's registry of store mappings was poisoned by a panic elsewhere
    /// in the process.
    #[error(
        "this process's registry of cache store mappings was poisoned by a panic in another thread"
    )]
    Poisoned,
    /// The server stopped because a request panicked and its store may be
    /// half-updated.
    #[error(
        "the cache server at {address:?} stopped: its store is unusable after a panic ({cause})"
    )]
    StorePoisoned {
        /// The server's address.
        address: String,
        /// The panic, and the request it happened in.
        cause: String,
    },
}

/// A failed `get_or_fill`: the cache failed, or the caller's fill did.
#[derive(Debug, thiserror::Error)]
pub enum FillError<E> {
    /// The cache failed.
    #[error(transparent)]
    Cache(CacheError),
    /// The fill function failed (the fill was abandoned).
    #[error("{0}")]
    Fill(E),
}
