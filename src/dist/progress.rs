//! What a process group tells an observer about its collectives, for the
//! launcher's watch on stopped ranks: collectives are numbered from 0 in the order
//! every rank issues them, and the observer hears when this rank enters one and
//! when it completes it (the training rank writes both into its heartbeat, so a
//! rank that never entered the collective the others wait in can be named).

use vrtspike_contract::heartbeat::CollectiveOp;

/// Hears of a process group's collectives (set with
/// [`super::ProcessGroup::observe`]). Called on the thread that runs the
/// collective, right before it starts and right after it succeeds: keep it cheap.
pub trait CollectiveObserver: Send + Sync {
    /// This rank enters collective number `seq`, of kind `op`.
    fn entered(&self, op: CollectiveOp, seq: u64);
    /// This rank completed collective number `seq`.
    fn completed(&self, seq: u64);
}
