//! The control channel's messages. Every request gets exactly one reply, in order,
//! on the client's own reply channel; record bytes never travel here, only the
//! offsets of slots in the shared store that the client has mapped.
//!
//! The protocol sits above the [`stats`](super::stats) report it carries and the
//! [`ids`](super::ids) it names; neither of those looks back up here.

use ipc_channel::ipc::IpcSender;
use serde::{Deserialize, Serialize};

use super::stats::StatsReport;

pub use super::announcement::ReadOrderAnnouncement;
pub use super::ids::{ClientId, LeaseId, TicketId};

/// A request from a client.
#[derive(Debug, Serialize, Deserialize)]
pub enum Request {
    /// First message of a connection: who is asking, where to reply, and which
    /// store (if any) this process has already mapped.
    Hello {
        /// Label for stats and logs.
        name: String,
        /// The job it belongs to, for per-job figures (`""`: none).
        job: String,
        /// The client's process id.
        pid: u32,
        /// Id of the store this process already maps for this address.
        mapped_store: Option<u64>,
        /// Where the server sends replies.
        #[serde(deserialize_with = "reply_channel")]
        reply: IpcSender<Reply>,
    },
    /// Lease on `key` if cached; otherwise a fill ticket, or a wait for the fill in flight.
    Get {
        /// The record's key.
        key: String,
    },
    /// Lease on `key` if cached, `NotCached` otherwise; never fills.
    Peek {
        /// The record's key.
        key: String,
    },
    /// Reserve a slot of `len` bytes for a ticket from a miss.
    Reserve {
        /// The ticket from `Miss`.
        ticket: TicketId,
        /// Exact record length in bytes.
        len: u64,
    },
    /// The reserved slot is written: publish it and lease it to the filler.
    Commit {
        /// The ticket whose slot is written.
        ticket: TicketId,
    },
    /// Give up a fill; waiters on the key retry.
    Abort {
        /// The ticket to abandon.
        ticket: TicketId,
    },
    /// Release a lease (a lease's own drop does this in shared memory; this is the
    /// protocol's form, for tools and tests). Releases exactly that lease.
    Release {
        /// The lease to release.
        lease: LeaseId,
    },
    /// Drop a cached, unpinned record (for example after its file changed).
    Invalidate {
        /// The record's key.
        key: String,
    },
    /// Live statistics.
    Stats,
    /// Stop the server.
    Shutdown,
    /// What this connection's reader will read, in order (the planned policy): it
    /// replaces what the connection announced before. The reader writes how far it
    /// has got into its own pin page ([`PinPage::set_progress`](super::pins::PinPage::set_progress)).
    ReadOrder(ReadOrderAnnouncement),
    /// Fill `key` ahead of its announced use if it is worth it: a reserved extent of
    /// `len` bytes (`Reserved`, then write and commit as after a miss), `Done` when
    /// it is cached or being filled, `Declined` when making room would evict a
    /// record needed sooner (or no read order needs the key).
    Prefetch {
        /// The record's key.
        key: String,
        /// Exact record length in bytes.
        len: u64,
    },
}

/// Decodes the reply channel of a `Hello`. ipc-channel looks the channel up by an
/// index in the frame and panics when a corrupt frame names one that was not sent
/// with it; the panic becomes a decode error here, so a bad frame closes only its
/// own connection (with the usual clean-up) instead of killing the thread serving it.
fn reply_channel<'de, D>(deserializer: D) -> Result<IpcSender<Reply>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    let decoded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        IpcSender::<Reply>::deserialize(deserializer)
    }));
    decoded.unwrap_or_else(|_| {
        Err(serde::de::Error::custom(
            "hello: the frame names a reply channel that was not sent with it",
        ))
    })
}

impl Request {
    /// Short name of the request, for logs and errors.
    pub fn kind(&self) -> &'static str {
        match self {
            Request::Hello { .. } => "hello",
            Request::Get { .. } => "get",
            Request::Peek { .. } => "peek",
            Request::Reserve { .. } => "reserve",
            Request::Commit { .. } => "commit",
            Request::Abort { .. } => "abort",
            Request::Release { .. } => "release",
            Request::Invalidate { .. } => "invalidate",
            Request::Stats => "stats",
            Request::Shutdown => "shutdown",
            Request::ReadOrder(_) => "read order",
            Request::Prefetch { .. } => "prefetch",
        }
    }
}

/// Where a leased record lies in the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseGrant {
    /// The lease to release when done.
    pub lease: LeaseId,
    /// Byte offset of the slot in the store.
    pub offset: u64,
    /// Committed length of the record.
    pub len: u64,
}

/// The server's answer to `Hello`: the store to map (absent if the process maps it
/// already) and this connection's place in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Welcome {
    /// This connection's id.
    pub client: ClientId,
    /// Id of the server's store (changes when a server restarts).
    pub store_id: u64,
    /// Bytes in the store's memfd: the record arena, then the metadata.
    pub store_len: u64,
    /// Bytes of the record arena (the cap); the metadata follows, page-aligned.
    pub arena_bytes: u64,
    /// This connection's page of pins in the store (the only part of it the
    /// client maps writable, besides the record it fills).
    pub pin_page: u32,
    /// How long a get waits for another client's fill of the same key, in
    /// milliseconds (the client waits that long for the answer, and more).
    pub fill_wait_ms: u64,
    /// Whether the store's memfd follows on the rendezvous socket (as
    /// SCM_RIGHTS); not when the process maps the store already.
    pub store_fd_follows: bool,
}

/// A reply from the server.
#[derive(Debug, Serialize, Deserialize)]
pub enum Reply {
    /// Answer to `Hello`.
    Welcome(Welcome),
    /// The record is cached and now pinned for this client.
    Hit(LeaseGrant),
    /// The record was being filled by another client when asked for; this client
    /// waited for that fill (single flight) and now holds a lease on it.
    HitAfterWait(LeaseGrant),
    /// Not cached: this client fills it with the ticket.
    Miss {
        /// The fill's ticket.
        ticket: TicketId,
    },
    /// A slot is reserved; write `len` bytes at `offset`, then commit.
    Reserved {
        /// The fill's ticket.
        ticket: TicketId,
        /// Byte offset of the slot in the store.
        offset: u64,
        /// Reserved length (the record's exact length).
        len: u64,
    },
    /// The fill is published and leased to the filler.
    Committed(LeaseGrant),
    /// `Peek` found nothing.
    NotCached,
    /// A request that needs no data succeeded.
    Done,
    /// Live statistics.
    Stats(Box<StatsReport>),
    /// The server will not keep this record now (the planned policy): making room
    /// for it would evict a record needed sooner. Read it without the cache.
    Declined,
    /// The request was refused; the connection stays usable.
    Error(RequestError),
}

/// Why the server refused a request. The server logs it and keeps serving, except
/// after [`StorePoisoned`](RequestError::StorePoisoned).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum RequestError {
    /// Release of a lease this client does not hold (double release, or a made-up id).
    #[error("lease {lease} is not held by this client (released already, or never granted)")]
    LeaseNotHeld {
        /// The lease named in the request.
        lease: LeaseId,
    },
    /// A ticket this client does not hold.
    #[error(
        "fill ticket {ticket} is not held by this client (committed, aborted, or never granted)"
    )]
    TicketNotHeld {
        /// The ticket named in the request.
        ticket: TicketId,
    },
    /// Commit before Reserve, or a second Reserve.
    #[error("fill ticket {ticket} for key {key:?}: {problem}")]
    TicketState {
        /// The ticket named in the request.
        ticket: TicketId,
        /// Its key.
        key: String,
        /// What was out of order.
        problem: String,
    },
    /// The key is not cached.
    #[error("key {key:?} is not cached")]
    UnknownKey {
        /// The key named in the request.
        key: String,
    },
    /// The record is pinned and cannot be invalidated now.
    #[error("key {key:?} is pinned by {pins} lease(s)")]
    Pinned {
        /// The key named in the request.
        key: String,
        /// Leases holding it.
        pins: u32,
    },
    /// The record is larger than the whole store.
    #[error("record {key:?} of {len} bytes is larger than the whole cache ({cap} bytes); raise DATA.CACHE_SIZE_GB")]
    RecordTooLarge {
        /// The record's key.
        key: String,
        /// Its length.
        len: u64,
        /// Bytes records may use (the cap in whole pages).
        cap: u64,
    },
    /// A zero-length record.
    #[error("record {key:?}: a record must be at least 1 byte")]
    EmptyRecord {
        /// The record's key.
        key: String,
    },
    /// No stretch of the store can be freed for the record now: what would have to
    /// go is pinned by readers or being filled.
    #[error("no room for {key:?} ({len} bytes) now: of the cache's {cap} bytes, {pinned_bytes} are pinned by readers and {filling_bytes} are being filled, and no stretch of the rest holds it; the record is read from disk instead (raise DATA.CACHE_SIZE_GB for fewer of these)")]
    StoreFull {
        /// The record's key.
        key: String,
        /// Its length.
        len: u64,
        /// Bytes of records pinned now.
        pinned_bytes: u64,
        /// Bytes of records being filled now.
        filling_bytes: u64,
        /// Bytes records may use.
        cap: u64,
    },
    /// The machine has no memory for a new slot and no record can be evicted to
    /// make room: the caller reads the record from disk instead.
    #[error("no memory for a slot for {key:?} ({len} bytes): {needed} bytes needed but {available} available ({limit}); the store holds {reserved} bytes reserved; free memory on the node or lower DATA.CACHE_SIZE_GB")]
    OutOfMemory {
        /// The record's key.
        key: String,
        /// Its length.
        len: u64,
        /// Bytes the new slot needed (with the headroom kept free).
        needed: u64,
        /// Bytes that could be had.
        available: u64,
        /// Which limit refused it.
        limit: String,
        /// Bytes the store had reserved when it was refused.
        reserved: u64,
    },
    /// The same client asked for a key it is filling itself.
    #[error("key {key:?} is already being filled by this client (ticket {ticket})")]
    AlreadyFilling {
        /// The key.
        key: String,
        /// The client's own ticket for it.
        ticket: TicketId,
    },
    /// Waited too long for another client's fill of the key.
    #[error("key {key:?}: the fill by client {filler} did not finish within {waited_s} s")]
    FillTimedOut {
        /// The key.
        key: String,
        /// The client filling it.
        filler: ClientId,
        /// Seconds waited.
        waited_s: u64,
    },
    /// Every connection slot of the server is taken.
    #[error("the cache server serves at most {max} connections at once; close some clients")]
    TooManyConnections {
        /// The limit.
        max: usize,
    },
    /// The connection holds as many leases as it can.
    #[error("this connection holds {max} leases already, the most one connection can; drop some, or open another connection")]
    TooManyLeases {
        /// The limit.
        max: usize,
    },
    /// A key longer than a slot can store.
    #[error("key {key:?} is {} bytes long; keys are at most {max} bytes", key.len())]
    KeyTooLong {
        /// The key named in the request.
        key: String,
        /// The limit.
        max: usize,
    },
    /// A request panicked in the server, maybe half-way through an update of the
    /// store: the server refuses every request from then on and shuts down.
    #[error("the cache server's store is unusable after a panic ({cause}); the server is shutting down and refuses every request: restart it")]
    StorePoisoned {
        /// The panic, and the request it happened in.
        cause: String,
    },
    /// The planned policy will not keep this record now: room for it would evict a
    /// record needed sooner (the server answers [`Reply::Declined`]; the reader
    /// reads it without the cache).
    #[error(
        "the cache keeps no room for {key:?} now: every record it could evict is needed sooner"
    )]
    Declined {
        /// The record's key.
        key: String,
    },
    /// A read order that names more than the server keeps, or keys it does not list.
    #[error("read order refused: {problem}")]
    BadReadOrder {
        /// What is wrong with it.
        problem: String,
    },
    /// A request that makes no sense at this point of the protocol.
    #[error("protocol error: {0}")]
    Protocol(String),
}

#[cfg(test)]
mod tests {
    use ipc_channel::ipc::IpcMessage;

    use super::*;

    #[test]
    fn a_hello_naming_a_channel_it_lacks_is_a_decode_error() {
        // Found by tests/parsers_prop: the 5-byte frame of a Hello (empty name, pid
        // 0, no store, reply channel 0) sent without its channel panicked in
        // ipc-channel's decoder, killing the server thread of that connection.
        let frame = vec![0u8, 0, 0, 0, 0];
        assert!(IpcMessage::from_data(frame).to::<Request>().is_err());
        // The decoder's thread state is clean afterwards: a good frame still decodes.
        let get = IpcMessage::from_data(vec![1, 1, b'k'])
            .to::<Request>()
            .unwrap();
        assert!(matches!(get, Request::Get { key } if key == "k"));
    }
}
