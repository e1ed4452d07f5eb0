//! What a process group tells an observer about its collectives, for the
//! launcher's watch on stopped ranks: collectives are numbered from 0 in the order
//! every rank issues them, and the observer hears when this rank enters one and
//! when it completes it (the training rank writes both into its heartbeat, so a
//! rank that never entered the collective the others wait in can be named). The
//! Reducer's gradient all-reduce is one collective for a whole backward pass, so
//! inside it the observer also hears of each gradient bucket this rank launches:
//! a rank wedged in backward has launched fewer than its peers waiting for them.

use vrtspike_contract::heartbeat::CollectiveOp;

/// Hears of a process group's collectives (set with
/// [`super::ProcessGroup::observe`]). Called on the thread that runs the
/// collective, right before it starts and right after it succeeds: keep it cheap.
pub trait CollectiveObserver: Send + Sync {
    /// This rank enters collective number `seq`, of kind `op`.
    fn entered(&self, op: CollectiveOp, seq: u64);
    /// This rank completed collective number `seq`.
    fn completed(&self, seq: u64);
    /// Inside collective `seq` (the Reducer's gradient all-reduce within a
    /// backward pass), this rank is about to launch its gradient bucket number
    /// `index` (in launch order, from 0). Called on the autograd thread.
    fn bucket_launching(&self, _seq: u64, _index: u32) {}
    /// Inside collective `seq`, this rank has launched `launched` gradient buckets.
    /// Called on the autograd thread.
    fn buckets_launched(&self, _seq: u64, _launched: u32) {}
}
