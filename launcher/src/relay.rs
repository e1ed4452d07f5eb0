//! How the launchers of a job tell each other how their ranks stand: one rank's
//! report ([`RankReport`], as the launcher of its node sees it) and the [`Relay`]
//! that the hang watch (`crate::hang`) sends its node's reports through and hears
//! the other nodes' from. The peer links (`crate::peers`) are the relay, and carry
//! a report as a `VIEW` line; neither needs the other.

use std::sync::Arc;

use vrtspike_contract::heartbeat::{Collectives, Progress};

/// How one rank stands, as the launcher of its node sees it (a `VIEW` line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankReport {
    /// The attempt its record belongs to.
    pub attempt: u32,
    /// The rank.
    pub rank: u32,
    /// Its process, once known.
    pub pid: Option<u32>,
    /// Its step and phase (`None`: no heartbeat yet).
    pub progress: Option<Progress>,
    /// Its collectives.
    pub collectives: Collectives,
    /// Milliseconds since its step, phase or collectives last changed.
    pub still_ms: u64,
    /// Milliseconds since its liveness tick last changed (`None`: no tick yet).
    pub silent_ms: Option<u64>,
}

/// How a node's watch tells the other nodes how its ranks stand, and hears how
/// theirs do (the control link: `crate::peers`).
pub trait Relay: Send + Sync {
    /// Tells the other nodes how this node's ranks stand.
    fn send(&self, reports: &[RankReport]);
    /// How the other nodes' ranks stood in attempt `attempt` when their launchers
    /// last said.
    fn heard(&self, attempt: u32) -> Vec<RankReport>;
}

/// A shared [`Relay`].
#[derive(Clone)]
pub struct RelayHandle(pub Arc<dyn Relay>);

impl std::fmt::Debug for RelayHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RelayHandle")
    }
}
