//! Preemption: SIGUSR2 (what `vrtspike-launch` forwards on a preemption request,
//! and what batch systems send before a kill) sets a flag; the training loop folds
//! it into its per-step all-reduce so every rank agrees on the same step, saves a
//! checkpoint there and exits 0 so the job can be requeued.

use std::sync::atomic::{AtomicBool, Ordering};

static REQUESTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    REQUESTED.store(true, Ordering::SeqCst);
}

/// Installs the SIGUSR2 handler.
pub fn install() -> Result<(), nix::Error> {
    use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
    let action = SigAction::new(
        SigHandler::Handler(on_signal),
        SaFlags::SA_RESTART,
        SigSet::empty(),
    );
    // SAFETY: the handler only stores to a static atomic, which is async-signal-safe.
    unsafe { sigaction(Signal::SIGUSR2, &action) }?;
    Ok(())
}

/// Whether this process was asked to stop.
pub fn requested() -> bool {
    REQUESTED.load(Ordering::SeqCst)
}

/// Sets the flag as the signal would (tests, and a step budget).
pub fn request() {
    REQUESTED.store(true, Ordering::SeqCst);
}
