//! The parent's handle on one serving probe child (`<exe> h5-probe --serve`):
//! started with the job's signals blocked and no inherited descriptor surviving
//! `exec` (libhdf5's open files keep their locks otherwise), greeted, asked about
//! one file at a time within a time limit, and killed when it runs out of it.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use super::super::error::{DataError, Result};
use super::prober::Verdict;
use super::wire::{hex, Reply, GREETING};
use super::ENV_EXECUTABLE;
use crate::util::is_timeout;

/// How one request to a child ended.
#[derive(Debug)]
pub(super) enum Answer {
    Verdict(Verdict),
    /// The child's worker was killed from outside each time: no verdict.
    Unjudged(String),
    Died(ExitStatus),
    TimedOut,
    Garbled(String),
}

/// A serving probe child and the parent's end of its socket (its stdin and stdout).
#[derive(Debug)]
pub(super) struct ProbeChild {
    child: Child,
    socket: BufReader<UnixStream>,
    /// The process that started it: a process forked from that one (a Python
    /// DataLoader worker) inherits the handle but must neither ask the child nor
    /// shut its socket, which the starter still uses.
    starter: u32,
    pub(super) probed: u32,
    pub(super) last_used: Instant,
}

impl ProbeChild {
    /// Whether this process started the child (not a process forked from the
    /// starter, which shares the socket).
    pub(super) fn is_ours(&self) -> bool {
        self.starter == std::process::id()
    }

    /// Starts `<exe> h5-probe --serve` and waits for its greeting; errors name
    /// `path` (the file that needed it) and the executable.
    pub(super) fn spawn(exe: &Path, timeout: Duration, path: &Path) -> Result<ProbeChild> {
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
            starter: std::process::id(),
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
    pub(super) fn ask(&mut self, path: &Path, timeout: Duration) -> Answer {
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
        if !self.is_ours() {
            // Inherited through a fork: only this process's copy of the socket goes.
            return;
        }
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
