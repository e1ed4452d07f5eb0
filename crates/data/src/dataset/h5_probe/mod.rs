//! Crash isolation for HDF5 session files: before this process first opens a
//! `.h5` file with libhdf5, a child process (`vrtspike h5-probe --serve`) opens it
//! the way [`open`] does, reads its first and last frames and
//! walks its chunk indexes. A child that dies (libhdf5 1.10.8 segfaults on some
//! corrupt files), hangs past a timeout or reports an error gives a [`DataError`](super::DataError)
//! naming the file, and this process never touches that file with libhdf5.
//!
//! One child serves every probe of a process (one spawn, about a quarter second with
//! libtorch loaded, then milliseconds per file) and exits after [`CHILD_IDLE`]
//! without a request. The child reads each file in a worker it forks, so a crashing
//! file kills the worker, not the child. A child that died anyway is replaced, and a
//! file that killed a child which had probed other files first is probed again in a
//! fresh one before it is called corrupt. Verdicts are cached per process, keyed by
//! path, size, mtime, ctime, inode and a CRC of the file's bytes (all of a file up to
//! 8 MiB, else its first and last MiB).
//!
//! Only a crash says the file is corrupt: a child or worker that died of a signal
//! a fault raises in the process itself (SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL,
//! SIGSYS, SIGTRAP). One killed from outside (the job's SIGTERM or SIGUSR2 while it
//! loads its libraries, SIGKILL from the OOM killer) says nothing about the file:
//! the file is probed again, up to [`PROBE_TRIES`] times, and then the check fails
//! with [`DataError::Unjudged`](super::DataError::Unjudged), which `DATA.SKIP_BAD_FRAMES` never skips (one rank
//! would then drop a healthy file the others keep). The child starts with the job's
//! signals blocked across `exec`, as every child of the job does
//! (`vrtspike_contract::signals`): it counts them from its first instruction, then
//! ignores them.
//!
//! The child executable, first match: [`set_probe_executable`]; the environment
//! variable `VRTSPIKE_H5_PROBE` (a path, or `off` to open files in-process without
//! a probe, giving up the isolation); the current executable when it is named
//! `vrtspike` or `vrtspike-cache` (both have the hidden `h5-probe`); a `vrtspike`
//! beside the current executable or in its parent folder (`target/debug/deps/`
//! test binaries find `target/debug/vrtspike`). Otherwise
//! opening a session is an error that says so. `VRTSPIKE_H5_PROBE_TIMEOUT_S` sets
//! the child's time limit per file (default 30 s). The library's own unit tests
//! open files in-process (no `vrtspike` binary is built for them).
//!
//! Left to chance: frames other than the first and last are read only by the
//! parent (a corrupt chunk *payload* is an HDF5 error there, not a crash); a file
//! changed between the probe and the open is opened unchecked; and a large file
//! changed only in its middle, in place within one mtime tick, keeps its verdict.
//!
//! In parts: the parent's verdict cache and probe loop (`prober`), its handle on a
//! serving child process (`child`), the child's side (`serve`: its loop and the
//! forked worker of each file), what both read from a process's end (`crash`) and
//! the lines between them (`wire`); this file holds the process-wide prober and
//! how it finds its executable.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use super::error::Result;
use super::h5::H5Session;

mod child;
mod crash;
mod prober;
mod serve;
mod wire;

pub use prober::Prober;
pub use serve::{probe_here, serve, serve_stdio, CHILD_IDLE};
pub use wire::GREETING;

/// Environment variable naming the probe executable (or `off`).
pub const ENV_EXECUTABLE: &str = "VRTSPIKE_H5_PROBE";

/// Environment variable with the child's time limit per file, in seconds.
pub const ENV_TIMEOUT: &str = "VRTSPIKE_H5_PROBE_TIMEOUT_S";

/// The child's default time limit per file (open and two frames).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// Probes of one file whose process was killed from outside before the check
/// gives up without a verdict (see the module doc).
pub const PROBE_TRIES: u32 = 3;

/// How a process checks session files before opening them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeMode {
    /// In a child process running this executable (`<exe> h5-probe --serve`).
    Child(PathBuf),
    /// Not at all: files are opened in-process (`VRTSPIKE_H5_PROBE=off`).
    InProcess,
    /// No probe executable was found; opening a session is an error saying so.
    Unavailable(String),
}

static EXECUTABLE: OnceLock<PathBuf> = OnceLock::new();
static GLOBAL: OnceLock<Prober> = OnceLock::new();

/// Names the probe executable for this process (before its first session is
/// opened); `false` when one was already set.
pub fn set_probe_executable(exe: PathBuf) -> bool {
    EXECUTABLE.set(exe).is_ok()
}

/// The process-wide prober [`open`] uses.
pub fn global() -> &'static Prober {
    GLOBAL.get_or_init(|| Prober::new(default_mode(), default_timeout()))
}

/// Checks `path` with the process-wide prober (see [`Prober::check`]).
pub fn check(path: &Path) -> Result<()> {
    global().check(path)
}

/// Opens the session file `path` ([`H5Session::open_unprobed`], chunk cache of
/// `chunk_cache_mb` MiB) once a probe child has read it without crashing
/// ([`check`]): how every reader of the dataset opens an HDF5 file.
pub fn open(path: &Path, chunk_cache_mb: u32) -> Result<H5Session> {
    check(path)?;
    H5Session::open_unprobed(path, chunk_cache_mb)
}

fn default_timeout() -> Duration {
    std::env::var(ENV_TIMEOUT)
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .map_or(DEFAULT_TIMEOUT, Duration::from_secs_f64)
}

/// The probe mode from [`set_probe_executable`], the environment and the
/// current executable's place (see the module doc).
pub fn default_mode() -> ProbeMode {
    if let Some(exe) = EXECUTABLE.get() {
        return ProbeMode::Child(exe.clone());
    }
    match std::env::var_os(ENV_EXECUTABLE) {
        Some(v) if v == "off" => return ProbeMode::InProcess,
        Some(v) if !v.is_empty() => return ProbeMode::Child(PathBuf::from(v)),
        _ => {}
    }
    if cfg!(test) {
        return ProbeMode::InProcess;
    }
    find_vrtspike()
}

fn find_vrtspike() -> ProbeMode {
    let current = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => return unavailable(&format!("the current executable is unknown ({e})")),
    };
    if current
        .file_name()
        .is_some_and(|n| n == "vrtspike" || n == "vrtspike-cache")
    {
        return ProbeMode::Child(current);
    }
    let dir = current.parent();
    let candidates = [dir, dir.and_then(Path::parent)];
    for dir in candidates.into_iter().flatten() {
        let exe = dir.join("vrtspike");
        if exe.is_file() {
            return ProbeMode::Child(exe);
        }
    }
    unavailable(&format!(
        "no vrtspike beside {} or in its parent folder",
        current.display()
    ))
}

fn unavailable(why: &str) -> ProbeMode {
    ProbeMode::Unavailable(format!(
        "no HDF5 probe executable ({why}); set {ENV_EXECUTABLE} to a vrtspike binary, or to `off` to open HDF5 files in-process (a corrupt file may then crash this process)"
    ))
}

/// The two files the tests probe, in `dir`: `good.h5` and `crashes.h5` (which the
/// fake probes crash on); neither is HDF5.
#[cfg(test)]
fn files(dir: &Path) -> (PathBuf, PathBuf) {
    let (good, bad) = (dir.join("good.h5"), dir.join("crashes.h5"));
    std::fs::write(&good, b"good").unwrap();
    std::fs::write(&bad, b"bad").unwrap();
    (good, bad)
}
