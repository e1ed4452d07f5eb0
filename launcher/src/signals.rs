//! The launcher's own signals, turned into counters the supervision loop polls:
//! a preemption request (the configured signal, default SIGUSR2, and SIGTERM) and an
//! interrupt (SIGINT). Handlers only bump atomics, which is async-signal-safe.

use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{Context, Result};

use crate::summary::ExitKind;
use nix::sys::signal::{self, SaFlags, SigAction, SigHandler, SigSet, Signal};

static PREEMPT_REQUESTS: AtomicU32 = AtomicU32::new(0);
static INTERRUPTS: AtomicU32 = AtomicU32::new(0);

extern "C" fn on_preempt(_: libc::c_int) {
    PREEMPT_REQUESTS.fetch_add(1, Ordering::SeqCst);
}

extern "C" fn on_interrupt(_: libc::c_int) {
    INTERRUPTS.fetch_add(1, Ordering::SeqCst);
}

/// Installs the handlers: `preempt` and SIGTERM request preemption, SIGINT
/// interrupts.
pub fn install(preempt: Signal) -> Result<()> {
    let preempt_action = SigAction::new(
        SigHandler::Handler(on_preempt),
        SaFlags::SA_RESTART,
        SigSet::empty(),
    );
    let interrupt_action = SigAction::new(
        SigHandler::Handler(on_interrupt),
        SaFlags::SA_RESTART,
        SigSet::empty(),
    );
    let mut plan = vec![
        (preempt, &preempt_action),
        (Signal::SIGTERM, &preempt_action),
    ];
    if preempt != Signal::SIGINT {
        plan.push((Signal::SIGINT, &interrupt_action));
    }
    for (sig, action) in plan {
        // SAFETY: both handlers only touch static atomics (async-signal-safe), and
        // they stay valid for the life of the process.
        unsafe { signal::sigaction(sig, action) }
            .with_context(|| format!("installing a handler for {sig}"))?;
    }
    Ok(())
}

/// Preemption requests received so far.
pub fn preempt_requests() -> u32 {
    PREEMPT_REQUESTS.load(Ordering::SeqCst)
}

/// Interrupts (SIGINT) received so far.
pub fn interrupts() -> u32 {
    INTERRUPTS.load(Ordering::SeqCst)
}

/// How the job should end because of a signal received so far: interrupted
/// (SIGINT wins), preempted, or `None` to go on.
pub fn requested_ending() -> Option<ExitKind> {
    if interrupts() > 0 {
        Some(ExitKind::Interrupted)
    } else if preempt_requests() > 0 {
        Some(ExitKind::Preempted)
    } else {
        None
    }
}
