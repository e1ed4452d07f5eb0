//! Crash isolation for HDF5 session files: before this process first opens a
//! `.h5` file with libhdf5, a child process (`vrtspike h5-probe --serve`) opens it
//! the way [`open`] does, reads its first and last frames and
//! walks its chunk indexes. A child that dies (libhdf5 1.10.8 segfaults on some
//! corrupt files), hangs past a timeout or reports an error gives a [`DataError`]
//! naming the file, and this process never touches that file with libhdf5.
//!
//! One child serves every probe of a process (one spawn, about a quarter second
//! with libtorch loaded, then milliseconds per file) and exits after
//! [`CHILD_IDLE`] without a request. The child reads each file in a worker it forks,
//! so a crashing file kills the worker, not the child. A child that died anyway is
//! replaced, and a file that killed a child which had probed other files first is
//! probed again in a fresh one before it is called corrupt. Verdicts are cached per process, keyed
//! by path, size, mtime, ctime, inode and a CRC of the file's bytes (all of a
//! file up to 8 MiB, else its first and last MiB).
//!
//! Only a crash says the file is corrupt: a child or worker that died of a signal
//! a fault raises in the process itself (SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL,
//! SIGSYS, SIGTRAP). One killed from outside (the job's SIGTERM or SIGUSR2 while it
//! loads its libraries, SIGKILL from the OOM killer) says nothing about the file:
//! the file is probed again, up to [`PROBE_TRIES`] times, and then the check fails
//! with [`DataError::Unjudged`], which `DATA.SKIP_BAD_FRAMES` never skips (one rank
//! would then drop a healthy file the others keep). The child starts with the job's
//! signals blocked across `exec`, as every child of the job does
//! (`vrtspike_contract::signals`): it counts them from its first instruction, then
//! ignores them.
//!
//! The child executable, first match: [`set_probe_executable`]; the environment
//! variable `VRTSPIKE_H5_PROBE` (a path, or `off` to open files in-process without
//! a probe, giving up the isolation); the current executable when it is named
//! `vrtspike`; a `vrtspike` beside the current executable or in its parent folder
//! (`target/debug/deps/` test binaries find `target/debug/vrtspike`). Otherwise
//! opening a session is an error that says so. `VRTSPIKE_H5_PROBE_TIMEOUT_S` sets
//! the child's time limit per file (default 30 s). The library's own unit tests
//! open files in-process (no `vrtspike` binary is built for them).
//!
//! Left to chance: frames other than the first and last are read only by the
//! parent (a corrupt chunk *payload* is an HDF5 error there, not a crash); a file
//! changed between the probe and the open is opened unchecked; and a large file
//! changed only in its middle, in place within one mtime tick, keeps its verdict.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::error::{DataError, Result};
use super::h5::H5Session;

/// The first line a probe child writes, so a wrong executable is told apart from
/// a corrupt file.
pub const GREETING: &str = "vrtspike-h5-probe 1";

/// Environment variable naming the probe executable (or `off`).
pub const ENV_EXECUTABLE: &str = "VRTSPIKE_H5_PROBE";

/// Environment variable with the child's time limit per file, in seconds.
pub const ENV_TIMEOUT: &str = "VRTSPIKE_H5_PROBE_TIMEOUT_S";

/// The child's default time limit per file (open and two frames).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// A serving child exits after this long without a request.
pub const CHILD_IDLE: Duration = Duration::from_secs(30);

/// The parent reuses a child only if its last request is younger than this
/// (well inside [`CHILD_IDLE`], so it never writes to one that is exiting).
const REUSE_WITHIN: Duration = Duration::from_secs(20);

/// The chunk cache (MiB) of the child's open.
const PROBE_CHUNK_CACHE_MB: u32 = 4;

/// Frames larger than this are not read by the child (their metadata still is).
const MAX_PROBE_FRAME_BYTES: usize = 512 << 20;

/// Chunks per dataset whose index entries the child reads at most.
const MAX_PROBE_CHUNKS: usize = 1 << 20;

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

/// What a probe concluded about one file (cached per process).
type Verdict = std::result::Result<(), String>;

/// Files up to this size are fingerprinted whole; larger ones by their first and
/// last [`FINGERPRINT_SPAN`] bytes.
const FINGERPRINT_WHOLE: u64 = 8 << 20;

/// Bytes fingerprinted at each end of a large file.
const FINGERPRINT_SPAN: u64 = 1 << 20;

/// A file's identity for the verdict cache: its metadata and a CRC of its bytes
/// (file times tick only every few milliseconds, so a file rewritten in place at
/// once keeps its size and times).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct FileKey {
    path: PathBuf,
    len: u64,
    mtime_ns: i128,
    ctime_ns: i128,
    dev: u64,
    ino: u64,
    crc: u32,
}

impl FileKey {
    fn of(path: &Path) -> Result<FileKey> {
        let meta = std::fs::metadata(path).map_err(|e| DataError::io(path, e))?;
        let ns = |s: i64, n: i64| i128::from(s) * 1_000_000_000 + i128::from(n);
        Ok(FileKey {
            path: path.to_path_buf(),
            len: meta.len(),
            mtime_ns: ns(meta.mtime(), meta.mtime_nsec()),
            ctime_ns: ns(meta.ctime(), meta.ctime_nsec()),
            dev: meta.dev(),
            ino: meta.ino(),
            crc: fingerprint(path, meta.len()).map_err(|e| DataError::io(path, e))?,
        })
    }
}

/// CRC-32 of the whole file when small, else of its first and last megabyte.
fn fingerprint(path: &Path, len: u64) -> std::io::Result<u32> {
    use std::io::{Read, Seek, SeekFrom};
    let mut file = std::fs::File::open(path)?;
    let mut hasher = crc32fast::Hasher::new();
    let mut buf = Vec::new();
    if len <= FINGERPRINT_WHOLE {
        file.read_to_end(&mut buf)?;
        hasher.update(&buf);
        return Ok(hasher.finalize());
    }
    for start in [0, len - FINGERPRINT_SPAN] {
        buf.clear();
        file.seek(SeekFrom::Start(start))?;
        (&mut file).take(FINGERPRINT_SPAN).read_to_end(&mut buf)?;
        hasher.update(&buf);
    }
    Ok(hasher.finalize())
}

/// Checks session files in child processes and remembers the verdicts.
#[derive(Debug)]
pub struct Prober {
    mode: ProbeMode,
    timeout: Duration,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    verdicts: HashMap<FileKey, Verdict>,
    child: Option<ProbeChild>,
    spawns: u32,
}

impl Prober {
    /// A prober with its own verdict cache and child.
    pub fn new(mode: ProbeMode, timeout: Duration) -> Prober {
        Prober {
            mode,
            timeout,
            state: Mutex::new(State::default()),
        }
    }

    /// How this prober checks files.
    pub fn mode(&self) -> &ProbeMode {
        &self.mode
    }

    /// How many children this prober has started.
    pub fn spawns(&self) -> u32 {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).spawns
    }

    /// `Ok` when `path` may be opened with libhdf5 in this process; otherwise an
    /// error naming the file and what the probe saw. Probes each file once.
    pub fn check(&self, path: &Path) -> Result<()> {
        let exe = match &self.mode {
            ProbeMode::InProcess => return Ok(()),
            ProbeMode::Unavailable(why) => return Err(DataError::format(path, why.clone())),
            ProbeMode::Child(exe) => exe,
        };
        let key = FileKey::of(path)?;
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let verdict = match state.verdicts.get(&key) {
            Some(verdict) => verdict.clone(),
            None => {
                let verdict = state.probe(exe, self.timeout, path)?;
                state.verdicts.insert(key, verdict.clone());
                verdict
            }
        };
        verdict.map_err(|message| DataError::format(path, message))
    }
}

impl State {
    /// Probes `path` in the serving child (spawned or replaced as needed). `Err`
    /// when no child could answer at all (not cached); the verdict otherwise.
    fn probe(&mut self, exe: &Path, timeout: Duration, path: &Path) -> Result<Verdict> {
        let mut killed_from_outside = 0;
        loop {
            let mut child = match self.child.take() {
                Some(c) if c.last_used.elapsed() < REUSE_WITHIN => c,
                _ => {
                    self.spawns += 1;
                    ProbeChild::spawn(exe, timeout, path)?
                }
            };
            let fresh = child.probed == 0;
            let unjudged = match child.ask(path, timeout) {
                Answer::Verdict(verdict) => {
                    self.child = Some(child);
                    return Ok(verdict);
                }
                Answer::Died(status) if !is_crash(status) => format!(
                    "its HDF5 probe process was killed by {} from outside",
                    how_it_ended(status)
                ),
                Answer::Unjudged(why) => {
                    self.child = Some(child);
                    why
                }
                Answer::Died(_) if !fresh => {
                    tracing::debug!(file = %path.display(), "h5 probe child died; probing again in a fresh one");
                    continue;
                }
                Answer::Died(status) => return Ok(Err(died_message(status))),
                Answer::TimedOut => return Ok(Err(timeout_message(timeout))),
                Answer::Garbled(line) => {
                    return Err(DataError::format(
                        path,
                        format!("the HDF5 probe {} answered {line:?}", exe.display()),
                    ))
                }
            };
            killed_from_outside += 1;
            if killed_from_outside >= PROBE_TRIES {
                return Err(DataError::Unjudged {
                    path: path.to_path_buf(),
                    why: format!(
                        "{unjudged} in each of {PROBE_TRIES} tries (not a verdict on the file: \
                         it was not opened, and DATA.SKIP_BAD_FRAMES does not skip it)"
                    ),
                });
            }
            tracing::warn!(file = %path.display(), "{unjudged}; probing the file again");
        }
    }
}

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
fn is_crash(status: ExitStatus) -> bool {
    use std::os::unix::process::ExitStatusExt;
    status
        .signal()
        .is_none_or(|sig| CRASH_SIGNALS.contains(&sig))
}

/// `SIGSEGV`, `signal 40` or `exit status 3`.
fn how_it_ended(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match status.signal() {
        Some(sig) => nix::sys::signal::Signal::try_from(sig)
            .map_or_else(|_| format!("signal {sig}"), |s| s.as_str().to_owned()),
        None => format!("exit status {}", status.code().unwrap_or(-1)),
    }
}

fn died_message(status: ExitStatus) -> String {
    format!(
        "reading it with libhdf5 crashed a probe process ({}, `vrtspike h5-probe`): the file is corrupt; it was not opened",
        how_it_ended(status)
    )
}

fn timeout_message(timeout: Duration) -> String {
    format!(
        "libhdf5 did not finish reading it within {:.0} s in a probe process (killed): the file is corrupt or its storage stalled; it was not opened ({ENV_TIMEOUT} raises the limit)",
        timeout.as_secs_f64()
    )
}

/// How one request to a child ended.
#[derive(Debug)]
enum Answer {
    Verdict(Verdict),
    /// The child's worker was killed from outside each time: no verdict.
    Unjudged(String),
    Died(ExitStatus),
    TimedOut,
    Garbled(String),
}

/// A serving probe child and the parent's end of its socket (its stdin and stdout).
#[derive(Debug)]
struct ProbeChild {
    child: Child,
    socket: BufReader<UnixStream>,
    probed: u32,
    last_used: Instant,
}

impl ProbeChild {
    /// Starts `<exe> h5-probe --serve` and waits for its greeting; errors name
    /// `path` (the file that needed it) and the executable.
    fn spawn(exe: &Path, timeout: Duration, path: &Path) -> Result<ProbeChild> {
        let fail = |what: String| {
            DataError::format(
                path,
                format!(
                    "cannot check it in an HDF5 probe process: {what} (set {ENV_EXECUTABLE} to a vrtspike binary)"
                ),
            )
        };
        let (ours, theirs) = UnixStream::pair().map_err(|e| fail(format!("socketpair: {e}")))?;
        let stdout = theirs
            .as_fd()
            .try_clone_to_owned()
            .map_err(|e| fail(format!("dup: {e}")))?;
        let mut command = Command::new(exe);
        command
            .args(["h5-probe", "--serve"])
            .stdin(Stdio::from(OwnedFd::from(theirs)))
            .stdout(Stdio::from(stdout))
            .stderr(Stdio::inherit());
        close_inherited_files(&mut command);
        block_job_signals(&mut command);
        let child = command
            .spawn()
            .map_err(|e| fail(format!("{}: {e}", exe.display())))?;
        let mut probe = ProbeChild {
            child,
            socket: BufReader::new(ours),
            probed: 0,
            last_used: Instant::now(),
        };
        match probe.read_line(timeout) {
            Ok(line) if line == GREETING => Ok(probe),
            Ok(line) => Err(fail(format!(
                "{} h5-probe greeted with {line:?}, not {GREETING:?} (not this vrtspike?)",
                exe.display()
            ))),
            Err(answer) => Err(fail(format!(
                "{} h5-probe did not start: {answer:?}",
                exe.display()
            ))),
        }
    }

    /// Sends `path` and reads the child's verdict on it within `timeout`.
    fn ask(&mut self, path: &Path, timeout: Duration) -> Answer {
        let request = format!("{}\n", hex(path.as_os_str().as_bytes()));
        // UnixStream writes with MSG_NOSIGNAL: a dead child is an error, not SIGPIPE.
        if self.socket.get_mut().write_all(request.as_bytes()).is_err() {
            return self.died();
        }
        self.probed += 1;
        self.last_used = Instant::now();
        let line = match self.read_line(timeout) {
            Ok(line) => line,
            Err(answer) => return answer,
        };
        self.last_used = Instant::now();
        match serde_json::from_str::<Reply>(&line) {
            Ok(Reply {
                unjudged: Some(why),
                ..
            }) => Answer::Unjudged(why),
            Ok(Reply { error: None, .. }) => Answer::Verdict(Ok(())),
            Ok(Reply { error: Some(e), .. }) => Answer::Verdict(Err(e)),
            Err(_) => Answer::Garbled(line),
        }
    }

    /// One line from the child, or how it failed to give one.
    fn read_line(&mut self, timeout: Duration) -> std::result::Result<String, Answer> {
        let deadline = Instant::now() + timeout;
        let mut line = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || self.socket.get_ref().set_read_timeout(Some(left)).is_err() {
                return Err(self.kill());
            }
            match self.socket.read_until(b'\n', &mut line) {
                Ok(0) => return Err(self.died()),
                Ok(_) if line.ends_with(b"\n") => {
                    line.pop();
                    return Ok(String::from_utf8_lossy(&line).into_owned());
                }
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) if is_timeout(&e) => continue,
                Err(_) => return Err(self.died()),
            }
        }
    }

    /// The child's end, once it has exited on its own.
    fn died(&mut self) -> Answer {
        match self.child.wait() {
            Ok(status) => Answer::Died(status),
            Err(e) => Answer::Garbled(format!("(cannot wait for the probe process: {e})")),
        }
    }

    /// Kills a child that ran out of time.
    fn kill(&mut self) -> Answer {
        let _ = self.child.kill();
        let _ = self.child.wait();
        Answer::TimedOut
    }
}

impl Drop for ProbeChild {
    fn drop(&mut self) {
        // Closing the socket ends the child's loop; reap it if it is already gone.
        let _ = self.socket.get_ref().shutdown(std::net::Shutdown::Both);
        let _ = self.child.try_wait();
    }
}

/// Marks every descriptor above stdio close-on-exec in the child, so none
/// survives `exec` (std's own exec-error pipe keeps working until then). libhdf5
/// opens files without `O_CLOEXEC`: a child inheriting the parent's open session
/// files would hold their `flock` locks (and the parent's later opens of them would
/// fail with "unable to lock file") for as long as it serves.
fn close_inherited_files(command: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: sysconf is called here, in the parent, before any fork.
    let open_max = unsafe { libc::sysconf(libc::_SC_OPEN_MAX) }.clamp(1024, 1 << 16) as i32;
    // SAFETY: the hook runs in the forked child before exec and makes only
    // async-signal-safe system calls (close_range, fcntl) on plain integers.
    unsafe {
        command.pre_exec(move || {
            let all_above_stdio = (3u32, u32::MAX, libc::CLOSE_RANGE_CLOEXEC);
            let (first, last, flags) = all_above_stdio;
            if libc::syscall(libc::SYS_close_range, first, last, flags) != 0 {
                for fd in 3..open_max {
                    libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
                }
            }
            Ok(())
        });
    }
}

/// Starts the child with the job's signals blocked across `exec`: a SIGTERM or
/// SIGUSR2 sent to the whole job while the child loads its libraries (libtorch's
/// take a while) stays pending until it counts them from its first instruction and
/// then ignores them (`vrtspike h5-probe`), instead of killing it.
fn block_job_signals(command: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the hook runs in the forked child before exec and only calls
    // pthread_sigmask (async-signal-safe); it allocates nothing.
    unsafe {
        command.pre_exec(vrtspike_contract::signals::block_in_child);
    }
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

/// The child's answer for one file: `error` is `None` when the file is usable;
/// `unjudged` says why there is no verdict (its worker was killed from outside).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Reply {
    error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    unjudged: Option<String>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    let text = text.as_bytes();
    if text.len() % 2 != 0 {
        return None;
    }
    text.chunks(2)
        .map(|pair| u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok())
        .collect()
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
    if current.file_name().is_some_and(|n| n == "vrtspike") {
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

/// What the child does for one file: everything [`open`] does with
/// libhdf5, the first and last frames, and every chunk index entry.
pub fn probe_here(path: &Path) -> Result<()> {
    let session = H5Session::open_unprobed(path, PROBE_CHUNK_CACHE_MB)?;
    session.walk_chunks(MAX_PROBE_CHUNKS)?;
    let bytes = session.record_layout().byte_len();
    if bytes > MAX_PROBE_FRAME_BYTES {
        return Ok(());
    }
    let mut record = vec![0u8; bytes];
    let last = session.frame_names.len().saturating_sub(1);
    for frame in [0, last] {
        session.read_frame_into(frame, &mut record)?;
    }
    Ok(())
}

/// [`probe_here`] in a forked worker of this serving child: a file that crashes
/// libhdf5 kills the worker, and the child reports it and goes on serving. Without
/// the worker each crash would cost the parent a fresh child, which first runs
/// libtorch_cuda's kernel registrations (a quarter second idle, seconds on a busy
/// machine). The reply's verdict: no error when the file is usable, else the
/// message; a worker killed from outside is forked again, and after
/// [`PROBE_TRIES`] such kills the reply says why there is no verdict. Where no
/// worker can be forked the child probes the file itself (a crash then ends the
/// child, which the parent handles as before).
fn probe_in_worker(path: &Path) -> Reply {
    let mut killed = String::new();
    for _ in 0..PROBE_TRIES {
        match worker_probe(path) {
            WorkerEnd::Answered(error) => {
                return Reply {
                    error,
                    unjudged: None,
                }
            }
            WorkerEnd::Killed(why) => killed = why,
        }
    }
    Reply {
        error: None,
        unjudged: Some(format!("{killed}, {PROBE_TRIES} times")),
    }
}

/// How one forked worker's probe ended.
enum WorkerEnd {
    /// A verdict: `None` when the file is usable, else the message (its own error,
    /// or the crash it caused).
    Answered(Option<String>),
    /// No verdict: the worker was killed from outside, or could not be waited for.
    Killed(String),
}

/// [`probe_here`] in one forked worker (see [`probe_in_worker`]).
fn worker_probe(path: &Path) -> WorkerEnd {
    use nix::unistd::{fork, ForkResult};
    use std::io::Read;
    let Ok((from_worker, to_server)) = nix::unistd::pipe() else {
        return WorkerEnd::Answered(probe_here(path).err().map(message_of));
    };
    // SAFETY: the serving child is single-threaded (`vrtspike h5-probe --serve` runs
    // nothing but this loop; libtorch starts no thread at load), so the worker
    // inherits no lock held by another thread; it only probes, writes to its pipe
    // and leaves with `_exit`.
    match unsafe { fork() } {
        Err(_) => WorkerEnd::Answered(probe_here(path).err().map(message_of)),
        Ok(ForkResult::Child) => {
            drop(from_worker);
            // A killed child (the parent's timeout) takes its worker with it.
            let _ = nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL);
            let reply = Reply {
                error: probe_here(path).err().map(message_of),
                unjudged: None,
            };
            let text = serde_json::to_string(&reply).unwrap_or_default();
            let written = std::fs::File::from(to_server).write_all(text.as_bytes());
            // SAFETY: `_exit` ends the worker at once, without running the exit
            // handlers and static destructors of the libraries it shares with the
            // child; it takes no pointer.
            unsafe { libc::_exit(i32::from(written.is_err())) }
        }
        Ok(ForkResult::Parent { child }) => {
            drop(to_server);
            let mut text = String::new();
            let read = std::fs::File::from(from_worker).read_to_string(&mut text);
            match (reap(child.as_raw()), read) {
                (Some(status), Ok(_)) if status.success() => {
                    WorkerEnd::Answered(match serde_json::from_str::<Reply>(&text) {
                        Ok(reply) => reply.error,
                        Err(_) => Some(format!("the probe worker answered {text:?}")),
                    })
                }
                (Some(status), _) if is_crash(status) => {
                    WorkerEnd::Answered(Some(died_message(status)))
                }
                (Some(status), _) => WorkerEnd::Killed(format!(
                    "its probe worker was killed by {} from outside",
                    how_it_ended(status)
                )),
                (None, _) => WorkerEnd::Killed("its probe worker could not be waited for".into()),
            }
        }
    }
}

/// Waits for the worker `pid` and returns how it ended.
fn reap(pid: libc::pid_t) -> Option<ExitStatus> {
    use std::os::unix::process::ExitStatusExt;
    let mut raw = 0;
    loop {
        // SAFETY: `raw` is a valid out-pointer for the duration of the call.
        let got = unsafe { libc::waitpid(pid, &mut raw, 0) };
        if got == pid {
            return Some(ExitStatus::from_raw(raw));
        }
        if got < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return None;
        }
    }
}

/// An error's message without the file name the parent adds back.
fn message_of(err: DataError) -> String {
    match err {
        DataError::Format { message, .. } => message,
        DataError::Missing { why, .. } => format!("missing ({why})"),
        DataError::Io { source, .. } => source.to_string(),
        DataError::Request(message) => message,
        DataError::Unjudged { why, .. } => why,
    }
}

/// The child's loop (`vrtspike h5-probe --serve`): greets, then for each line of
/// `input` (a hex-encoded path) writes one JSON [`Reply`] line; returns at the
/// end of `input` or when a read times out (idle).
pub fn serve(input: impl BufRead, mut output: impl Write) -> std::io::Result<()> {
    writeln!(output, "{GREETING}")?;
    output.flush()?;
    for line in input.lines() {
        let line = match line {
            Ok(line) => line,
            Err(e) if is_timeout(&e) => return Ok(()),
            Err(e) => return Err(e),
        };
        let reply = match unhex(line.trim()) {
            Some(bytes) => probe_in_worker(Path::new(&std::ffi::OsString::from_vec(bytes))),
            None => Reply {
                error: Some(format!("bad probe request {line:?}")),
                unjudged: None,
            },
        };
        let reply = serde_json::to_string(&reply).map_err(std::io::Error::other)?;
        writeln!(output, "{reply}")?;
        output.flush()?;
    }
    Ok(())
}

/// [`serve`] on this process's stdin and stdout, exiting after [`CHILD_IDLE`]
/// without a request when stdin is a socket (as the parent sets it up).
pub fn serve_stdio() -> std::io::Result<()> {
    let stdin = std::io::stdin().as_fd().try_clone_to_owned()?;
    let socket = UnixStream::from(stdin);
    let input: Box<dyn BufRead> = if socket.set_read_timeout(Some(CHILD_IDLE)).is_ok() {
        Box::new(BufReader::new(socket))
    } else {
        Box::new(std::io::stdin().lock())
    };
    serve(input, std::io::stdout().lock())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A fake probe executable: a shell script that greets with `greeting`, logs
    /// each request to `requests.log`, and runs `on_request` (with `$line` set).
    fn fake_probe(dir: &Path, greeting: &str, on_request: &str) -> PathBuf {
        let exe = dir.join("fake-vrtspike");
        let log = dir.join("requests.log");
        let script = format!(
            "#!/bin/sh\necho '{greeting}'\nwhile read line; do\n  echo \"$line\" >> '{}'\n  {on_request}\ndone\n",
            log.display()
        );
        std::fs::write(&exe, script).unwrap();
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
        exe
    }

    /// Answers every request as usable, except files named `crashes*`, on which
    /// it dies by SIGSEGV as libhdf5 does.
    const CRASHES_ON_CRASHES: &str =
        "case \"$line\" in *63726173686573*) kill -SEGV $$ ;; esac\n  echo '{\"error\":null}'";

    fn requests(dir: &Path, file: &Path) -> usize {
        let wanted = hex(file.as_os_str().as_bytes());
        std::fs::read_to_string(dir.join("requests.log"))
            .unwrap_or_default()
            .lines()
            .filter(|l| *l == wanted)
            .count()
    }

    fn files(dir: &Path) -> (PathBuf, PathBuf) {
        let (good, bad) = (dir.join("good.h5"), dir.join("crashes.h5"));
        std::fs::write(&good, b"good").unwrap();
        std::fs::write(&bad, b"bad").unwrap();
        (good, bad)
    }

    #[test]
    fn a_crashing_child_is_a_named_error_and_later_files_still_open() {
        let dir = tempfile::tempdir().unwrap();
        let (good, bad) = files(dir.path());
        let exe = fake_probe(dir.path(), GREETING, CRASHES_ON_CRASHES);
        let prober = Prober::new(ProbeMode::Child(exe), Duration::from_secs(20));
        let err = prober.check(&bad).unwrap_err().to_string();
        assert!(
            err.contains("crashes.h5") && err.contains("SIGSEGV") && err.contains("corrupt"),
            "{err}"
        );
        prober.check(&good).unwrap();
        // A fresh child's crash is final: probed once, and the verdict is cached.
        assert!(prober.check(&bad).is_err());
        prober.check(&good).unwrap();
        assert_eq!(
            (requests(dir.path(), &bad), requests(dir.path(), &good)),
            (1, 1)
        );
    }

    #[test]
    fn a_crash_after_other_files_is_confirmed_in_a_fresh_child() {
        let dir = tempfile::tempdir().unwrap();
        let (good, bad) = files(dir.path());
        let exe = fake_probe(dir.path(), GREETING, CRASHES_ON_CRASHES);
        let prober = Prober::new(ProbeMode::Child(exe), Duration::from_secs(20));
        prober.check(&good).unwrap();
        let err = prober.check(&bad).unwrap_err().to_string();
        assert!(err.contains("SIGSEGV"), "{err}");
        assert_eq!(requests(dir.path(), &bad), 2);
        // A changed file is probed again.
        std::fs::write(&good, b"changed").unwrap();
        prober.check(&good).unwrap();
        assert_eq!(requests(dir.path(), &good), 2);
    }

    /// One line of `/proc/<pid>/status` of a process started the probe child's way:
    /// a bash script (bash keeps the mask it inherits) answering with its own line.
    #[test]
    fn the_child_starts_with_the_job_signals_blocked() {
        let dir = tempfile::tempdir().unwrap();
        let (good, _) = files(dir.path());
        let exe = dir.path().join("mask-probe");
        let script = format!(
            "#!/bin/bash\necho '{GREETING}'\nwhile read line; do\n  mask=$(grep SigBlk /proc/$$/status | tr -dc '0-9a-f' | tail -c 16)\n  echo \"{{\\\"error\\\":\\\"mask=$mask\\\"}}\"\ndone\n"
        );
        std::fs::write(&exe, script).unwrap();
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
        let prober = Prober::new(ProbeMode::Child(exe), Duration::from_secs(20));
        let err = prober.check(&good).unwrap_err().to_string();
        let mask = err
            .rsplit("mask=")
            .next()
            .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
            .unwrap_or_else(|| panic!("{err}"));
        let bit = |signal: i32| 1u64 << (signal - 1);
        let job = bit(libc::SIGUSR2) | bit(libc::SIGTERM);
        assert_eq!(mask & job, job, "{err}");
    }

    /// A child killed from outside (the job's signal, the OOM killer: SIGKILL here,
    /// which no mask holds back) says nothing about the file: probed again.
    #[test]
    fn a_child_killed_from_outside_is_no_verdict_and_the_file_is_probed_again() {
        let dir = tempfile::tempdir().unwrap();
        let (good, _) = files(dir.path());
        let marker = dir.path().join("killed-once");
        let once = format!(
            "if [ ! -e '{}' ]; then touch '{}'; kill -KILL $$; fi\n  echo '{{\"error\":null}}'",
            marker.display(),
            marker.display()
        );
        let exe = fake_probe(dir.path(), GREETING, &once);
        let prober = Prober::new(ProbeMode::Child(exe), Duration::from_secs(20));
        prober.check(&good).unwrap();
        assert_eq!((requests(dir.path(), &good), prober.spawns()), (2, 2));
    }

    #[test]
    fn a_child_killed_from_outside_every_time_gives_no_verdict_and_is_never_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let (good, _) = files(dir.path());
        let exe = fake_probe(dir.path(), GREETING, "kill -KILL $$");
        let prober = Prober::new(ProbeMode::Child(exe), Duration::from_secs(20));
        let err = prober.check(&good).unwrap_err();
        assert!(!err.judges_the_data(), "{err}");
        let text = err.to_string();
        assert!(
            text.contains("good.h5") && text.contains("SIGKILL") && text.contains("not a verdict"),
            "{text}"
        );
        let tries = PROBE_TRIES as usize;
        assert_eq!(requests(dir.path(), &good), tries);
        // Not cached: the next check probes again.
        assert!(prober.check(&good).is_err());
        assert_eq!(requests(dir.path(), &good), 2 * tries);
        // The same when the child's worker is what was killed each time.
        let dir = tempfile::tempdir().unwrap();
        let (good, _) = files(dir.path());
        let answer = r#"echo '{"error":null,"unjudged":"its probe worker was killed by SIGTERM from outside, 3 times"}'"#;
        let exe = fake_probe(dir.path(), GREETING, answer);
        let prober = Prober::new(ProbeMode::Child(exe), Duration::from_secs(20));
        let err = prober.check(&good).unwrap_err();
        assert!(matches!(err, DataError::Unjudged { .. }), "{err}");
        assert_eq!(requests(dir.path(), &good), tries);
    }

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

    #[test]
    fn a_hanging_child_is_killed_and_named() {
        let dir = tempfile::tempdir().unwrap();
        let (good, _) = files(dir.path());
        let exe = fake_probe(dir.path(), GREETING, "exec sleep 60");
        let prober = Prober::new(ProbeMode::Child(exe), Duration::from_millis(500));
        let start = Instant::now();
        let err = prober.check(&good).unwrap_err().to_string();
        assert!(
            err.contains("good.h5") && err.contains("did not finish") && err.contains(ENV_TIMEOUT),
            "{err}"
        );
        assert!(start.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn the_childs_error_is_named_with_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let (good, _) = files(dir.path());
        let answer = r#"echo '{"error":"dataset '"'"'blur'"'"' is missing"}'"#;
        let exe = fake_probe(dir.path(), GREETING, answer);
        let prober = Prober::new(ProbeMode::Child(exe), Duration::from_secs(20));
        let err = prober.check(&good).unwrap_err().to_string();
        assert_eq!(
            err,
            format!("{}: dataset 'blur' is missing", good.display())
        );
    }

    #[test]
    fn a_wrong_executable_or_none_is_a_named_error() {
        let dir = tempfile::tempdir().unwrap();
        let (good, _) = files(dir.path());
        let exe = fake_probe(dir.path(), "some other tool 2.0", "echo '{\"error\":null}'");
        let prober = Prober::new(ProbeMode::Child(exe), Duration::from_secs(20));
        let err = prober.check(&good).unwrap_err().to_string();
        assert!(err.contains("good.h5") && err.contains("greeted"), "{err}");
        assert!(err.contains(ENV_EXECUTABLE), "{err}");
        let missing = Prober::new(
            ProbeMode::Child(dir.path().join("no-such-exe")),
            Duration::from_secs(20),
        );
        let err = missing.check(&good).unwrap_err().to_string();
        assert!(
            err.contains("good.h5") && err.contains("no-such-exe"),
            "{err}"
        );
        let none = Prober::new(unavailable("test"), Duration::from_secs(20));
        let err = none.check(&good).unwrap_err().to_string();
        assert!(
            err.contains("good.h5") && err.contains(ENV_EXECUTABLE),
            "{err}"
        );
    }

    #[test]
    fn serve_answers_each_request_with_a_verdict() {
        let dir = tempfile::tempdir().unwrap();
        let (good, _) = files(dir.path());
        let input = format!("{}\nzz\n", hex(good.as_os_str().as_bytes()));
        let mut output = Vec::new();
        serve(input.as_bytes(), &mut output).unwrap();
        let output = String::from_utf8(output).unwrap();
        let lines: Vec<&str> = output.lines().collect();
        assert_eq!(lines[0], GREETING);
        let reply: Reply = serde_json::from_str(lines[1]).unwrap();
        assert!(reply.error.unwrap().contains("cannot open as HDF5"));
        let reply: Reply = serde_json::from_str(lines[2]).unwrap();
        assert!(reply.error.unwrap().contains("bad probe request"));
    }

    #[test]
    fn paths_survive_the_hex_encoding() {
        let bytes = b"/tmp/a b\n\xff.h5";
        assert_eq!(unhex(&hex(bytes)).unwrap(), bytes);
        assert_eq!(unhex("abc"), None);
        assert_eq!(unhex("zz"), None);
    }
}
