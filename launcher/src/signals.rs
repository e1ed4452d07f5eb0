//! The launcher's own signals, turned into counters the supervision loop polls.
//! SIGUSR2 and SIGTERM are counted from the launcher's first instruction (the
//! contract's `signals`, registered in `main.rs`), because SLURM sends them to
//! every process of the job at once:
//!
//! - a preemption request: SIGUSR2, or `--preempt-signal` (the ranks get
//!   `--preempt-timeout-s` to checkpoint and exit 0);
//! - a stop: SIGTERM (scancel, the end of the time limit): the same orderly stop,
//!   inside `--grace-s`;
//! - an interrupt: SIGINT (the ranks are stopped at once).
//!
//! Handlers only bump atomics, which is async-signal-safe.

use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{Context, Result};
use nix::sys::signal::{self, SaFlags, SigAction, SigHandler, SigSet, Signal};
use vrtspike_contract::signals::{self as job, Disposition};

use crate::summary::ExitKind;

static INTERRUPTS: AtomicU32 = AtomicU32::new(0);
/// `--preempt-signal` when it is not SIGUSR2 or SIGTERM (0: none).
static EXTRA_PREEMPT: AtomicU32 = AtomicU32::new(0);

extern "C" fn on_interrupt(_: libc::c_int) {
    INTERRUPTS.fetch_add(1, Ordering::SeqCst);
}

/// Keeps counting SIGUSR2 and SIGTERM, counts `preempt` too, and makes SIGINT an
/// interrupt.
pub fn install(preempt: Signal) -> Result<()> {
    job::settle(Disposition::Count, Disposition::Count)
        .context("installing the handlers of SIGUSR2 and SIGTERM")?;
    let number = preempt as libc::c_int;
    if !job::JOB_SIGNALS.contains(&number) {
        job::count_signal(number).with_context(|| format!("installing a handler for {preempt}"))?;
        EXTRA_PREEMPT.store(number as u32, Ordering::SeqCst);
    }
    if preempt != Signal::SIGINT {
        let action = SigAction::new(
            SigHandler::Handler(on_interrupt),
            SaFlags::SA_RESTART,
            SigSet::empty(),
        );
        // SAFETY: the handler only touches a static atomic (async-signal-safe), and
        // it stays valid for the life of the process.
        unsafe { signal::sigaction(Signal::SIGINT, &action) }
            .context("installing a handler for SIGINT")?;
    }
    Ok(())
}

/// Preemption requests received so far (SIGUSR2 and `--preempt-signal`).
pub fn preempt_requests() -> u32 {
    let extra = EXTRA_PREEMPT.load(Ordering::SeqCst) as libc::c_int;
    let extra = if extra == 0 { 0 } else { job::received(extra) };
    job::received(libc::SIGUSR2) + extra
}

/// Stop requests received so far (SIGTERM).
pub fn terminate_requests() -> u32 {
    job::received(libc::SIGTERM)
}

/// Interrupts (SIGINT) received so far.
pub fn interrupts() -> u32 {
    INTERRUPTS.load(Ordering::SeqCst)
}

/// How the job should end because of a signal received so far: interrupted
/// (SIGINT wins), preempted (a preemption request or SIGTERM), or `None` to go on.
pub fn requested_ending() -> Option<ExitKind> {
    if interrupts() > 0 {
        Some(ExitKind::Interrupted)
    } else if preempt_requests() > 0 || terminate_requests() > 0 {
        Some(ExitKind::Preempted)
    } else {
        None
    }
}
