//! The ids the cache server hands out: connections, leases, fill tickets. The
//! lowest layer of the cache's vocabulary: the protocol and the stats report use
//! them, and they use nothing.

/// A connection's id, unique for the server's lifetime.
pub type ClientId = u64;
/// A pin on a committed record: the lease's word in its connection's pin page
/// (entry, slot, a sequence number of the connection). Released by clearing that
/// word, by `Release`, or when the client's connection is gone for good.
pub type LeaseId = u64;
/// The right to fill one key after a miss.
pub type TicketId = u64;
