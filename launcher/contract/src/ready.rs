//! The readiness signal: the parent makes a pipe ([`ReadyPipe`]), hands the write
//! end to the child (its number in [`READY_FD`]), and waits on the read end; the
//! child calls [`notify`] once it is ready (the cache server: once bound). A byte
//! means ready; end-of-file before one means the child exited (or closed it) first.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// The variable naming the write end of the readiness pipe in the child.
pub const READY_FD: &str = "VRTSPIKE_READY_FD";

/// What the parent has seen on the pipe so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readiness {
    /// The child said it is ready.
    Ready,
    /// The child closed the pipe without saying so (it exited, most likely).
    Closed,
    /// Nothing yet.
    Pending,
}

/// The parent's end of a readiness pipe.
#[derive(Debug)]
pub struct ReadyPipe {
    read: File,
    /// The child's end, until [`ReadyPipe::close_child_end`].
    write: Option<OwnedFd>,
    seen: Readiness,
}

impl ReadyPipe {
    /// A new pipe; both ends close on exec until [`inherit_in_child`] clears the
    /// flag of the write end in the child.
    pub fn new() -> io::Result<ReadyPipe> {
        let mut fds: [libc::c_int; 2] = [-1, -1];
        // SAFETY: `fds` is a valid array of two ints for pipe2 to fill.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: pipe2 succeeded, so both descriptors are open and owned by nobody
        // else; each is wrapped exactly once.
        let (read, write) = unsafe { (File::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        Ok(ReadyPipe {
            read,
            write: Some(write),
            seen: Readiness::Pending,
        })
    }

    /// The write end's number (to pass to [`inherit_in_child`] and in [`READY_FD`]).
    pub fn child_fd(&self) -> Option<RawFd> {
        self.write.as_ref().map(AsRawFd::as_raw_fd)
    }

    /// Closes the parent's copy of the write end; call it once the child is
    /// started, so that the child's exit shows as end-of-file.
    pub fn close_child_end(&mut self) {
        self.write = None;
    }

    /// Waits up to `timeout` for the child's word.
    pub fn wait(&mut self, timeout: Duration) -> io::Result<Readiness> {
        if self.seen != Readiness::Pending {
            return Ok(self.seen);
        }
        let mut poll = libc::pollfd {
            fd: self.read.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let millis = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
        // SAFETY: `poll` is one valid pollfd on an open descriptor owned by `self`.
        let n = unsafe { libc::poll(&mut poll, 1, millis) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::Interrupted => Ok(Readiness::Pending),
                _ => Err(e),
            };
        }
        if n == 0 {
            return Ok(Readiness::Pending);
        }
        let mut byte = [0u8; 16];
        self.seen = match self.read.read(&mut byte) {
            Ok(0) => Readiness::Closed,
            Ok(_) => Readiness::Ready,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Readiness::Pending,
            Err(e) => return Err(e),
        };
        Ok(self.seen)
    }
}

/// Lets descriptor `fd` survive `exec`. Meant for a `pre_exec` hook in the child:
/// it only calls `fcntl`, which is async-signal-safe.
pub fn inherit_in_child(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor number has no memory effects; a bad number
    // only makes it fail with EBADF.
    if unsafe { libc::fcntl(fd, libc::F_SETFD, 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Why the child could not signal readiness.
#[derive(Debug, thiserror::Error)]
#[error("readiness pipe ({READY_FD}={value}): {message}")]
pub struct ReadyError {
    /// The variable's value.
    pub value: String,
    /// What failed.
    pub message: String,
}

static NOTIFIED: AtomicBool = AtomicBool::new(false);

/// Child side: tells the parent it is ready through the descriptor named by
/// [`READY_FD`] (looked up with `var`), then closes it. `Ok(false)` when no parent
/// asked (the variable is unset) or it was already done.
pub fn notify(var: &dyn Fn(&str) -> Option<String>) -> Result<bool, ReadyError> {
    let Some(value) = var(READY_FD) else {
        return Ok(false);
    };
    let error = |message: String| ReadyError {
        value: value.clone(),
        message,
    };
    let fd: RawFd = value
        .trim()
        .parse()
        .map_err(|_| error("expected a file descriptor number".into()))?;
    if fd < 3 {
        return Err(error("not a pipe descriptor (0, 1 and 2 are stdio)".into()));
    }
    if NOTIFIED.swap(true, Ordering::SeqCst) {
        return Ok(false);
    }
    // SAFETY: F_GETFD only checks that the descriptor is open.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        return Err(error(format!("{}", io::Error::last_os_error())));
    }
    // SAFETY: the parent passed this open descriptor for this one use; nothing
    // else in this process knows it, and NOTIFIED makes sure it is taken once.
    let mut pipe = unsafe { File::from_raw_fd(fd) };
    pipe.write_all(b"ready\n")
        .map_err(|e| error(format!("writing: {e}")))?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::CommandExt;
    use std::process::Command;

    use super::*;

    fn child(pipe: &ReadyPipe, script: &str) -> std::process::Child {
        let fd = pipe.child_fd().unwrap_or_else(|| panic!("no child end"));
        let mut command = Command::new("sh");
        command.args(["-c", script]).env(READY_FD, fd.to_string());
        // SAFETY: the hook only calls fcntl (async-signal-safe) and allocates nothing.
        unsafe {
            command.pre_exec(move || inherit_in_child(fd));
        }
        command.spawn().unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn a_child_that_writes_is_ready() {
        let mut pipe = ReadyPipe::new().unwrap_or_else(|e| panic!("{e}"));
        let mut kid = child(&pipe, "sleep 0.2; echo ready >&$VRTSPIKE_READY_FD; sleep 1");
        pipe.close_child_end();
        let first = pipe.wait(Duration::from_millis(10));
        assert_eq!(first.ok(), Some(Readiness::Pending));
        let mut seen = Readiness::Pending;
        for _ in 0..100 {
            seen = pipe
                .wait(Duration::from_millis(50))
                .unwrap_or_else(|e| panic!("{e}"));
            if seen != Readiness::Pending {
                break;
            }
        }
        assert_eq!(seen, Readiness::Ready);
        let _ = kid.kill();
        let _ = kid.wait();
    }

    #[test]
    fn a_child_that_exits_first_closes_the_pipe() {
        let mut pipe = ReadyPipe::new().unwrap_or_else(|e| panic!("{e}"));
        let mut kid = child(&pipe, "exit 3");
        pipe.close_child_end();
        let seen = pipe.wait(Duration::from_secs(10));
        assert_eq!(seen.ok(), Some(Readiness::Closed));
        let _ = kid.wait();
    }

    #[test]
    fn notify_checks_the_variable() {
        assert!(matches!(notify(&|_| None), Ok(false)));
        let bad = |_: &str| Some("x".to_string());
        assert!(notify(&bad).is_err_and(|e| e.to_string().contains(READY_FD)));
        let stdio = |_: &str| Some("1".to_string());
        assert!(notify(&stdio).is_err());
    }
}
