//! The job's signals, the same for every process of a job. SLURM delivers a step's
//! signal to every process of the step (launcher, cache server, ranks, `h5-probe`
//! children), not only the one it was aimed at, so each process must survive them
//! from its first instruction:
//!
//! - **SIGUSR2**: a preemption warning. Ranks and the launcher treat it as the
//!   request to checkpoint and exit 0; every other process ignores it.
//! - **SIGTERM** (scancel, the end of the time limit, a launcher stopping its
//!   gang): ranks and the launcher stop in order (a checkpoint if time allows);
//!   the cache server and helpers that end with their parent, or that their parent
//!   runs to its end ([`HELPER_ENV`]), ignore it.
//!
//! Every child a process of the job starts from the `vrtspike` binary gets the job's
//! signals blocked across `exec` ([`block_in_child`]): the ranks, the cache server,
//! the HDF5 probe children and the launcher's helpers.
//!
//! How: [`preinit`] runs from the executable's `.preinit_array` (see
//! [`count_job_signals_from_the_first_instruction!`]), before any shared library's
//! constructor (libtorch's take a while), installs a handler that only counts
//! both signals and **blocks** them in the main thread, so every thread started
//! afterwards (libtorch's, OpenMP's, Gloo's, the loader's) inherits them blocked;
//! one that arrives meanwhile stays pending (a parent may also have blocked them
//! across `exec` with [`block_in_child`], which covers the dynamic loader's time).
//! Once the process knows its role it calls [`settle`]:
//!
//! - [`Disposition::Count`]: the signal stays blocked in every thread, and one
//!   thread of this module's own (`job-signals`) takes it with `sigtimedwait` and
//!   counts it: no handler ever runs on a thread that computes.
//! - [`Disposition::Ignore`] / [`Disposition::Default`]: ignore it, or fall back to
//!   the default action (a count taken meanwhile is then re-raised, so a tool that
//!   got SIGTERM while starting still ends), and unblock it in the calling thread.
//!
//! Why no handler may run on a computing thread: oneDNN's JIT f32 GEMM kernels
//! (libtorch 2.11 bundles oneDNN 3.10.2; `jit_avx512_common_gemm_f32`, the GEMM of
//! its `gemm:jit` convolutions, and the AVX2 one) point `rsp` at a workspace on the
//! heap when K is larger than their on-stack buffer. A signal delivered to that
//! thread then has the kernel write its frame (about 3 KiB with the AVX-512 state)
//! below that pointer: over the heap chunk before the workspace, whatever the
//! handler does. glibc aborts later ("corrupted size vs. prev_size"), far from the
//! write (issue 26; oneDNN issue 4845, fixed upstream after 3.11 by keeping `rsp`
//! on the stack).

use std::io;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

/// The signals of a job: counted from the first instruction.
pub const JOB_SIGNALS: [libc::c_int; 2] = [libc::SIGUSR2, libc::SIGTERM];

/// Set (to `1`) in the environment of a `vrtspike` helper that a process of the job
/// runs to its end (the launcher's plan check, config facts and cache stats): the
/// helper ignores both of the job's signals once it counts them, as its parent
/// decides what the job does. Spawn such helpers with [`block_in_child`] too.
pub const HELPER_ENV: &str = "VRTSPIKE_JOB_HELPER";

/// Whether this process is a job's helper (see [`HELPER_ENV`]).
pub fn is_job_helper(var: &dyn Fn(&str) -> Option<String>) -> bool {
    var(HELPER_ENV).is_some_and(|v| v == "1")
}

/// Signal numbers are below this on Linux (SIGRTMAX is 64).
const SLOTS: usize = 65;

static COUNTS: [AtomicU32; SLOTS] = [const { AtomicU32::new(0) }; SLOTS];

/// The job's signals settled as [`Disposition::Count`], one bit per signal number:
/// what the `job-signals` thread waits for.
static WATCHED: AtomicU64 = AtomicU64::new(0);

/// Whether the `job-signals` thread runs.
static WATCHER: Mutex<bool> = Mutex::new(false);

/// How long the `job-signals` thread waits before it reads [`WATCHED`] again (a
/// signal that arrives meanwhile stays pending: it is only counted later).
const WATCH_RECHECK: Duration = Duration::from_millis(200);

/// What a process does with one of the job's signals once it knows its role.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// Keep counting it (the process polls [`received`]).
    Count,
    /// Ignore it (a helper that ends with its parent).
    Ignore,
    /// The default action (a tool run by hand); one counted meanwhile is re-raised.
    Default,
}

/// The handler: it only bumps an atomic counter, which is async-signal-safe.
extern "C" fn count(signal: libc::c_int) {
    if let Some(slot) = usize::try_from(signal).ok().and_then(|s| COUNTS.get(s)) {
        slot.fetch_add(1, Ordering::SeqCst);
    }
}

/// How many times `signal` arrived while it was counted.
pub fn received(signal: libc::c_int) -> u32 {
    usize::try_from(signal)
        .ok()
        .and_then(|s| COUNTS.get(s))
        .map_or(0, |slot| slot.load(Ordering::SeqCst))
}

/// Counts `signal` as if it had arrived (tests, and a stop the process asks of
/// itself).
pub fn note(signal: libc::c_int) {
    count(signal);
}

/// Installs the counting handler for `signal` (`SA_RESTART`: interrupted system
/// calls go on).
pub fn count_signal(signal: libc::c_int) -> io::Result<()> {
    // SAFETY: `sigaction` is zero-initialised and then filled field by field; the
    // handler only touches static atomics (async-signal-safe) and lives as long as
    // the process.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = count as extern "C" fn(libc::c_int) as usize;
        action.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&mut action.sa_mask);
        if libc::sigaction(signal, &action, std::ptr::null_mut()) != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Sets `signal`'s action to ignore (`SIG_IGN`) or default (`SIG_DFL`).
fn set_plain(signal: libc::c_int, handler: libc::sighandler_t) -> io::Result<()> {
    // SAFETY: as in `count_signal`, with no handler code at all.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = handler;
        libc::sigemptyset(&mut action.sa_mask);
        if libc::sigaction(signal, &action, std::ptr::null_mut()) != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The set of `signals`.
fn set_of(signals: impl IntoIterator<Item = libc::c_int>) -> libc::sigset_t {
    // SAFETY: `sigset_t` is plain data; sigemptyset initialises it and sigaddset
    // only sets bits for valid signal numbers.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for signal in signals {
            libc::sigaddset(&mut set, signal);
        }
        set
    }
}

/// Blocks or unblocks `signals` in the calling thread.
fn mask_signals(how: libc::c_int, signals: &[libc::c_int]) -> io::Result<()> {
    let set = set_of(signals.iter().copied());
    // SAFETY: pthread_sigmask with a valid set and no old-set pointer; it is
    // async-signal-safe, so this may run in a forked child before exec.
    let rc = unsafe { libc::pthread_sigmask(how, &set, std::ptr::null_mut()) };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc));
    }
    Ok(())
}

/// Blocks or unblocks the job's signals in the calling thread.
fn mask(how: libc::c_int) -> io::Result<()> {
    mask_signals(how, &JOB_SIGNALS)
}

/// The bit of `signal` in [`WATCHED`] (0 for a number out of range).
fn watch_bit(signal: libc::c_int) -> u64 {
    u32::try_from(signal)
        .ok()
        .and_then(|s| 1u64.checked_shl(s))
        .unwrap_or(0)
}

/// The signals of [`WATCHED`].
fn watched_set() -> libc::sigset_t {
    let bits = WATCHED.load(Ordering::SeqCst);
    set_of(
        JOB_SIGNALS
            .into_iter()
            .filter(|s| bits & watch_bit(*s) != 0),
    )
}

/// The `job-signals` thread: takes the watched signals, pending for the process
/// because every thread blocks them, and counts them.
fn watch() {
    // Inherited blocked from the thread that started it; sigtimedwait needs them so.
    let _ = mask(libc::SIG_BLOCK);
    let recheck = libc::timespec {
        tv_sec: 0,
        tv_nsec: libc::c_long::try_from(WATCH_RECHECK.as_nanos()).unwrap_or(100_000_000),
    };
    loop {
        let set = watched_set();
        // SAFETY: a valid set and timeout, no siginfo wanted; this only takes a
        // pending signal off the queue (no handler runs).
        let signal = unsafe { libc::sigtimedwait(&set, std::ptr::null_mut(), &recheck) };
        // -1: the time-out (EAGAIN) or another signal (EINTR): look again.
        if signal > 0 {
            count(signal);
        }
    }
}

/// Starts the `job-signals` thread once.
fn start_watcher() -> io::Result<()> {
    let mut running = WATCHER.lock().unwrap_or_else(PoisonError::into_inner);
    if !*running {
        std::thread::Builder::new()
            .name("job-signals".into())
            .spawn(watch)?;
        *running = true;
    }
    Ok(())
}

/// For a `pre_exec` hook: the child starts its new program with the job's signals
/// blocked, so one that arrives while the dynamic loader maps its libraries stays
/// pending until the program settles it ([`settle`]). Only for programs that call
/// [`preinit`] and [`settle`] (a shell script would keep them blocked).
/// Async-signal-safe.
pub fn block_in_child() -> io::Result<()> {
    mask(libc::SIG_BLOCK)
}

/// Has the child of `command` start its new program with the job's signals
/// blocked ([`block_in_child`] as its `pre_exec` hook).
pub fn block_across_exec(command: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the hook runs in the forked child before exec and only calls
    // pthread_sigmask (async-signal-safe); it allocates nothing.
    unsafe {
        command.pre_exec(block_in_child);
    }
}

/// Installs the counting handler for the job's signals and blocks them in the
/// main thread, so every thread started later inherits them blocked (see the
/// module doc). Errors are ignored here (there is nowhere to report them this
/// early); [`settle`] sets both up again and reports.
pub extern "C" fn preinit(
    _argc: libc::c_int,
    _argv: *const *const libc::c_char,
    _envp: *const *const libc::c_char,
) {
    for signal in JOB_SIGNALS {
        let _ = count_signal(signal);
    }
    let _ = mask(libc::SIG_BLOCK);
}

/// Registers [`preinit`] in the executable's `.preinit_array`, which the dynamic
/// loader runs before the constructors of every shared library. Use it once, in a
/// binary crate (the section is honoured only in executables).
#[macro_export]
macro_rules! count_job_signals_from_the_first_instruction {
    () => {
        #[used]
        #[link_section = ".preinit_array"]
        static VRTSPIKE_COUNT_JOB_SIGNALS: extern "C" fn(
            ::libc::c_int,
            *const *const ::libc::c_char,
            *const *const ::libc::c_char,
        ) = $crate::signals::preinit;
    };
}

/// Settles what this process does with SIGUSR2 and SIGTERM once it knows its role
/// (see the module doc). Call it from the main thread before starting threads:
/// a thread that already runs keeps the mask it had (the preinit's: both blocked).
/// Without the preinit (a library user), threads started before this call keep the
/// signals unblocked and count them with the handler.
pub fn settle(usr2: Disposition, term: Disposition) -> io::Result<()> {
    let mut watched = Vec::new();
    let mut delivered = Vec::new();
    for (signal, disposition) in [(libc::SIGUSR2, usr2), (libc::SIGTERM, term)] {
        match disposition {
            Disposition::Count => {
                count_signal(signal)?;
                watched.push(signal);
            }
            Disposition::Ignore => {
                set_plain(signal, libc::SIG_IGN)?;
                delivered.push(signal);
            }
            Disposition::Default => {
                set_plain(signal, libc::SIG_DFL)?;
                if received(signal) > 0 {
                    // SAFETY: raise with a valid signal number; its default action
                    // is what a process without a handler would have met (once
                    // unblocked below).
                    unsafe { libc::raise(signal) };
                }
                delivered.push(signal);
            }
        }
    }
    for signal in &delivered {
        WATCHED.fetch_and(!watch_bit(*signal), Ordering::SeqCst);
    }
    if !watched.is_empty() {
        mask_signals(libc::SIG_BLOCK, &watched)?;
        for signal in &watched {
            WATCHED.fetch_or(watch_bit(*signal), Ordering::SeqCst);
        }
        start_watcher()?;
    }
    mask_signals(libc::SIG_UNBLOCK, &delivered)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pending(signal: libc::c_int) -> bool {
        // SAFETY: sigpending fills a zero-initialised set; sigismember reads it.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigpending(&mut set);
            libc::sigismember(&set, signal) == 1
        }
    }

    #[test]
    fn counted_signals_are_survived_and_counted() {
        count_signal(libc::SIGUSR2).unwrap_or_else(|e| panic!("{e}"));
        let before = received(libc::SIGUSR2);
        // SAFETY: raise to this process; the handler only counts.
        unsafe { libc::raise(libc::SIGUSR2) };
        assert_eq!(received(libc::SIGUSR2), before + 1);
        note(libc::SIGUSR2);
        assert_eq!(received(libc::SIGUSR2), before + 2);
    }

    #[test]
    fn a_signal_blocked_across_exec_stays_pending_through_the_preinit() {
        // In a child process: blocking is per thread, and the test harness runs
        // other tests in this process.
        // SAFETY: fork in a test; the child only makes async-signal-safe calls
        // (sigmask, kill, sigpending, sigaction) before _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let before = received(libc::SIGTERM);
            let ok = block_in_child().is_ok()
                // SAFETY: kill to ourselves with a blocked signal: it stays pending.
                && unsafe { libc::kill(libc::getpid(), libc::SIGTERM) } == 0
                && pending(libc::SIGTERM);
            preinit(0, std::ptr::null(), std::ptr::null());
            // Still blocked, so neither delivered nor lost.
            let kept = pending(libc::SIGTERM) && received(libc::SIGTERM) == before;
            // Unblocked, it reaches the counting handler the preinit installed.
            let counted = mask(libc::SIG_UNBLOCK).is_ok() && received(libc::SIGTERM) == before + 1;
            let code = match (ok, kept, counted) {
                (true, true, true) => 0,
                (false, _, _) => 1,
                (_, false, _) => 2,
                _ => 3,
            };
            // SAFETY: _exit ends the forked child without running the parent's
            // atexit handlers.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waitpid on our own child with a valid status pointer.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(libc::WIFEXITED(status), "the child died of the signal");
        let why = [
            "",
            "not pending before the preinit",
            "the preinit delivered or lost it",
            "not counted once unblocked",
        ];
        let code = libc::WEXITSTATUS(status);
        assert_eq!(code, 0, "{}", why.get(code as usize).unwrap_or(&"?"));
    }

    #[test]
    fn watch_bits_are_one_per_signal() {
        assert_eq!(watch_bit(libc::SIGUSR2), 1 << 12);
        assert_eq!(watch_bit(libc::SIGTERM), 1 << 15);
        assert_eq!(watch_bit(-1), 0);
        assert_eq!(watch_bit(64), 0);
    }
}
