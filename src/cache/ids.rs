//! The ids the cache server hands out: connections, leases, fill tickets. The
//! lowest layer of the cache's vocabulary: the protocol and the stats report use
//! them, and they use nothing.

/// A connection's id, unique for the server's lifetime.
pub type ClientId = u64;
/// A pin on a committed record (its slot and generation); released by clearing the
/// connection's pin bit, by `Release`, or by disconnecting.
pub type LeaseId = u64;
/// The right to fill one key after a miss.
pub type TicketId = u64;
