//! Preemption: SIGUSR2 (SLURM's warning before a preemption or the time limit,
//! which it sends to every process of the job, and what `vrtspike-launch` forwards
//! on a request) and SIGTERM (scancel, the end of the time limit, a launcher
//! stopping its gang) ask the rank to stop in order. The `vrtspike` binary counts
//! both from its first instruction (`vrtspike_contract::signals`, so a rank still
//! loading libtorch survives them too). Both stay blocked in every thread of the
//! rank and one thread of the contract's takes them: a handler run on a thread
//! inside oneDNN's GEMM, whose `rsp` may point into the heap there, would write its
//! signal frame over the heap (issue 26). The training loop folds the request into
//! its per-step all-reduce so every rank agrees on the same step, saves a
//! checkpoint there and exits 0 so the job can be requeued. A rank that cannot
//! agree (a peer is gone) fails its collective and exits with an error.

use std::sync::atomic::{AtomicBool, Ordering};

use vrtspike_contract::signals;

static REQUESTED: AtomicBool = AtomicBool::new(false);

/// Counts SIGUSR2 and SIGTERM as stop requests (the binary settles them this way
/// for `train`; a library user calls this, ideally before starting threads: see
/// `vrtspike_contract::signals::settle`). Pending ones are counted now.
pub fn install() -> std::io::Result<()> {
    signals::settle(signals::Disposition::Count, signals::Disposition::Count)
}

/// Whether this process was asked to stop (by a signal or [`request`]).
pub fn requested() -> bool {
    REQUESTED.load(Ordering::SeqCst)
        || signals::received(libc::SIGUSR2) > 0
        || signals::received(libc::SIGTERM) > 0
}

/// Sets the flag as the signal would (tests, and a step budget).
pub fn request() {
    REQUESTED.store(true, Ordering::SeqCst);
}
