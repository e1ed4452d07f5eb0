//! How a probe process's end is read: a crash (a signal a fault raises in the
//! process itself, or an error exit) is a verdict on the file it was reading; a
//! kill from outside (the job's signals, the OOM killer) is none. And the messages
//! that name each end.

use std::process::ExitStatus;
use std::time::Duration;

use super::ENV_TIMEOUT;

/// Signals a fault raises in the process itself: a crash there is a verdict on the
/// file it was reading.
const CRASH_SIGNALS: [libc::c_int; 7] = [
    libc::SIGSEGV,
    libc::SIGBUS,
    libc::SIGABRT,
    libc::SIGFPE,
    libc::SIGILL,
    libc::SIGSYS,
    libc::SIGTRAP,
];

/// Whether a probe process that ended with `status` crashed (or exited with an
/// error) rather than being killed from outside.
pub(super) fn is_crash(status: ExitStatus) -> bool {
    use std::os::unix::process::ExitStatusExt;
    status
        .signal()
        .is_none_or(|sig| CRASH_SIGNALS.contains(&sig))
}

/// `SIGSEGV`, `signal 40` or `exit status 3`.
pub(super) fn how_it_ended(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match status.signal() {
        Some(sig) => nix::sys::signal::Signal::try_from(sig)
            .map_or_else(|_| format!("signal {sig}"), |s| s.as_str().to_owned()),
        None => format!("exit status {}", status.code().unwrap_or(-1)),
    }
}

pub(super) fn died_message(status: ExitStatus) -> String {
    format!(
        "reading it with libhdf5 crashed a probe process ({}, `vrtspike h5-probe`): the file is corrupt; it was not opened",
        how_it_ended(status)
    )
}

pub(super) fn timeout_message(timeout: Duration) -> String {
    format!(
        "libhdf5 did not finish reading it within {:.0} s in a probe process (killed): the file is corrupt or its storage stalled; it was not opened ({ENV_TIMEOUT} raises the limit)",
        timeout.as_secs_f64()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crash_signals_are_verdicts_and_others_are_not() {
        use std::os::unix::process::ExitStatusExt;
        let killed_by = |sig: i32| ExitStatus::from_raw(sig);
        assert!(is_crash(killed_by(libc::SIGSEGV)) && is_crash(killed_by(libc::SIGBUS)));
        for outside in [libc::SIGTERM, libc::SIGUSR2, libc::SIGKILL, libc::SIGINT] {
            assert!(!is_crash(killed_by(outside)), "signal {outside}");
        }
        assert!(
            is_crash(ExitStatus::from_raw(3 << 8)),
            "an exit status is its own"
        );
    }
}
