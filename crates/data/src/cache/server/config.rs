//! How a cache server is set up ([`ServerConfig`]: address, cap, record size,
//! timeouts, memory headroom, who may connect, linger) and the checks before it
//! binds: a config that cannot work is refused with the setting at fault, and a
//! cap larger than the node's memory is refused (larger than what is free now:
//! a warning).

use std::time::Duration;

use tracing::warn;

use super::super::admission::HandshakeLimits;
use super::super::store::read_order::DEFAULT_BUDGET;
use super::super::table::{extent_for, SLOT_ALIGN};
use super::super::CacheError;
use crate::util::bytes::human;
use crate::util::meminfo;

/// Memory kept free on the node when a slot's memory is reserved: 512 MiB.
pub const DEFAULT_RESERVE_HEADROOM: u64 = 512 << 20;

/// How a server is set up.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Abstract socket name clients connect to (see [`default_address`](super::super::default_address)).
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
    /// Bytes the readers' announced read orders may hold in the server, over
    /// all of them; an announcement past it is refused (the reader's cache then
    /// evicts its records by LRU), one past it on its own while it is decoded.
    pub read_order_budget: u64,
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
            read_order_budget: DEFAULT_BUDGET,
        }
    }

    pub(super) fn validate(&self) -> Result<(), CacheError> {
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

/// Refuses a store larger than the node's whole memory (it could never be filled:
/// a typo); warns when it is larger than what is free now (it fills up to that,
/// then evicts). Nothing is reserved here: slots take memory as they are carved.
pub(super) fn check_cap_fits(store_bytes: u64) -> Result<(), CacheError> {
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
