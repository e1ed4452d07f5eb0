//! Starting and stopping the job's processes: each child gets its own process group
//! (so a signal reaches everything it started) and a parent-death signal (so even
//! `kill -9` of the launcher takes it down), with its output appended to a log file.
//! A `vrtspike` child starts with the job's signals blocked across `exec` (it
//! counts them from its first instruction, see `vrtspike_contract::signals`).

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use vrtspike_contract::child::{self, Spawned, Tie};
use vrtspike_contract::signals;

/// A child of the launcher, leader of its own process group.
#[derive(Debug)]
pub struct Supervised {
    /// What it is, for messages (`rank 1`, `cache server`).
    pub name: String,
    /// The process.
    child: Child,
    /// Where its stdout and stderr go.
    pub log: PathBuf,
    /// Length of the log when it started: its own output begins there.
    pub log_offset: u64,
    /// How it ended, once reaped.
    pub status: Option<ExitStatus>,
    /// What asks it to stop (SIGTERM; the cache server, which ignores the job's
    /// SIGTERM, gets SIGINT).
    stop_signal: Signal,
}

/// What a child is, as far as its start goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChildKind {
    /// The `vrtspike` binary: the job's signals stay blocked until it counts them.
    Vrtspike,
    /// Any other program (a `--rank-cmd` stand-in, a tool): nothing blocked.
    Other,
}

/// Appends the output of `command` to `log` and starts it in a new process group
/// that gets SIGKILL when the launcher's thread that spawned it dies.
///
/// Call this from the main thread: Linux sends the parent-death signal when the
/// spawning *thread* exits, not only the process.
pub fn spawn(
    name: String,
    command: &mut Command,
    log: &Path,
    kind: ChildKind,
) -> io::Result<Supervised> {
    if kind == ChildKind::Vrtspike {
        signals::block_across_exec(command);
    }
    let spawned = child::spawn_logged(command, log, Tie::DiesWithStarter)?;
    Ok(Supervised::adopt(name, spawned, log))
}

/// The command of a `vrtspike` helper the launcher runs to its end (the plan
/// check, the config facts, the cache server's stats): like every child of the
/// job it starts with the job's signals blocked across `exec`, so a SIGUSR2 or
/// SIGTERM sent to the whole job while it loads its libraries does not kill it,
/// and it ignores them once counted (`VRTSPIKE_JOB_HELPER`): it ends on its own,
/// and the launcher decides what the job does.
pub fn vrtspike_helper(vrtspike: &Path) -> Command {
    let mut command = Command::new(vrtspike);
    command.env(signals::HELPER_ENV, "1");
    signals::block_across_exec(&mut command);
    command
}

impl Supervised {
    /// A child started into `log` (`child::spawn_logged`), supervised from now on.
    pub fn adopt(name: String, spawned: Spawned, log: &Path) -> Supervised {
        Supervised {
            name,
            child: spawned.process,
            log: log.to_path_buf(),
            log_offset: spawned.log_offset,
            status: None,
            stop_signal: Signal::SIGTERM,
        }
    }

    /// Stops it with `signal` instead of SIGTERM.
    pub fn with_stop_signal(mut self, signal: Signal) -> Supervised {
        self.stop_signal = signal;
        self
    }

    /// The process id (also its process group id).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Reaps the child if it has exited; `Some` once it has.
    pub fn poll(&mut self) -> io::Result<Option<ExitStatus>> {
        if self.status.is_none() {
            self.status = self.child.try_wait()?;
        }
        Ok(self.status)
    }

    /// Whether it is still running (not yet reaped).
    pub fn running(&mut self) -> bool {
        !matches!(self.poll(), Ok(Some(_)))
    }

    /// Sends `signal` to the child's whole process group (if it still runs).
    pub fn signal_group(&mut self, signal: Signal) {
        if self.running() {
            // ESRCH is fine: the group may have just exited.
            let _ = killpg(Pid::from_raw(self.pid() as i32), signal);
        }
    }

    /// Sends `signal` to the child alone (not to what it started).
    pub fn signal_leader(&mut self, signal: Signal) {
        if self.running() {
            let _ = nix::sys::signal::kill(Pid::from_raw(self.pid() as i32), signal);
        }
    }
}

/// Stops a set of processes: its stop signal (SIGTERM) to every still-running
/// group, up to `grace` for them to exit, then SIGKILL to the rest, and reaps them
/// all. Returns the names of those that needed SIGKILL.
pub fn stop_all(procs: &mut [&mut Supervised], grace: Duration) -> Vec<String> {
    // With no grace the polite signal has no time to act: it would only race the
    // SIGKILL (a process it ended first would go unnamed among the killed).
    if !grace.is_zero() {
        for proc in procs.iter_mut() {
            let signal = proc.stop_signal;
            proc.signal_group(signal);
        }
    }
    let deadline = Instant::now() + grace;
    while procs.iter_mut().any(|p| p.running()) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut killed = Vec::new();
    for proc in procs.iter_mut() {
        if proc.running() {
            proc.signal_group(Signal::SIGKILL);
            killed.push(proc.name.clone());
            // A SIGKILLed process exits promptly; wait for it so nothing is left.
            let _ = proc.child.wait().map(|status| proc.status = Some(status));
        }
    }
    killed
}

/// Describes how a process ended: `exited with code 3`, `was killed by SIGKILL`.
pub fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with code {code}"),
        (None, Some(sig)) => format!("was killed by {}", signal_name(sig)),
        _ => format!("ended with {status}"),
    }
}

/// `SIGKILL` for 9, or `signal 64` for a number nix does not name.
pub fn signal_name(number: i32) -> String {
    Signal::try_from(number)
        .map(|s| s.as_str().to_string())
        .unwrap_or_else(|_| format!("signal {number}"))
}

/// A stand-in `vrtspike` for tests of the launcher's helpers: a bash script (bash
/// keeps the signal mask it inherits; dash clears it) that answers `plan`, `config`
/// and `cache` with the JSON the launcher reads, saying `protected` (`true` when it
/// started with SIGUSR2 and SIGTERM blocked and `VRTSPIKE_JOB_HELPER=1`): in the
/// plan's warning, as `DATA.USE_RAM_CACHE`, and as the stats' `protected`.
#[cfg(test)]
pub(crate) fn mask_reporting_vrtspike(dir: &Path) -> PathBuf {
    let exe = dir.join("vrtspike");
    let script = r#"#!/bin/bash
mask=$(grep SigBlk /proc/$$/status | tr -dc '0-9a-f\n' | tail -c 17)
if (( (16#$mask & 0x4800) == 0x4800 )) && [[ "${VRTSPIKE_JOB_HELPER:-}" == 1 ]]; then ok=true; else ok=false; fi
case "$1" in
  plan) echo "{\"warnings\": [\"protected=$ok mask=$mask\"], \"misfits\": []}" ;;
  config) echo "{\"keys\": {\"DATA.USE_RAM_CACHE\": {\"value\": $ok}, \"DIST.TIMEOUT_S\": {\"value\": 30}, \"DATA.CACHE_SHARING\": {\"value\": \"job\"}, \"DATA.CACHE_SIZE_GB\": {\"value\": 1}, \"DATA.CACHE_CONNECTIONS\": {\"value\": \"auto\"}}}" ;;
  cache) echo "{\"protected\": $ok, \"mask\": \"$mask\"}" ;;
esac
"#;
    vrtspike_contract::child::write_executable(&exe, script).unwrap_or_else(|e| panic!("{e}"));
    exe
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn child_gets_own_group_and_is_stopped_with_sigkill_after_grace() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let log = dir.path().join("x.log");
        let mut cmd = Command::new("sh");
        cmd.args([
            "-c",
            "trap '' TERM; echo started; while :; do sleep 0.05; done",
        ]);
        let mut child = spawn("stubborn".into(), &mut cmd, &log, ChildKind::Other)
            .unwrap_or_else(|e| panic!("{e}"));
        let pgid = nix::unistd::getpgid(Some(Pid::from_raw(child.pid() as i32)))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(pgid.as_raw() as u32, child.pid());
        std::thread::sleep(Duration::from_millis(200));
        let started = Instant::now();
        let killed = stop_all(&mut [&mut child], Duration::from_millis(300));
        assert!(started.elapsed() >= Duration::from_millis(300));
        assert_eq!(killed, ["stubborn"]);
        let status = child.status.unwrap_or_else(|| panic!("not reaped"));
        assert_eq!(describe(status), "was killed by SIGKILL");
        assert_eq!(child::tail(&log, child.log_offset, 20), ["started"]);
    }

    #[test]
    fn a_vrtspike_child_starts_with_the_job_signals_blocked() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let log = dir.path().join("mask.log");
        // Not through sh: dash clears the mask it inherits.
        let mut cmd = Command::new("grep");
        cmd.args(["SigBlk", "/proc/self/status"]);
        let mut child = spawn("mask".into(), &mut cmd, &log, ChildKind::Vrtspike)
            .unwrap_or_else(|e| panic!("{e}"));
        let _ = child.child.wait();
        let line = std::fs::read_to_string(&log).unwrap_or_else(|e| panic!("{e}"));
        let blocked = line
            .split_whitespace()
            .nth(1)
            .and_then(|hex| u64::from_str_radix(hex, 16).ok())
            .unwrap_or_else(|| panic!("{line}"));
        let bit = |signal: i32| 1u64 << (signal - 1);
        assert_eq!(
            blocked & (bit(libc::SIGUSR2) | bit(libc::SIGTERM)),
            bit(libc::SIGUSR2) | bit(libc::SIGTERM),
            "{line}"
        );
    }
}
