//! The probe child's side (`vrtspike h5-probe --serve`): it greets, then answers
//! each requested file with a verdict, read in a worker it forks per file so that a
//! file that crashes libhdf5 kills the worker, not the child; a worker killed from
//! outside is forked again, and after [`PROBE_TRIES`] such kills the answer says
//! there is no verdict. It exits after [`CHILD_IDLE`] without a request.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStringExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::ExitStatus;
use std::time::Duration;

use super::super::error::{DataError, Result};
use super::super::h5::H5Session;
use super::crash::{died_message, how_it_ended, is_crash};
use super::wire::{unhex, Reply, GREETING};
use super::PROBE_TRIES;
use crate::util::is_timeout;

/// A serving child exits after this long without a request.
pub const CHILD_IDLE: Duration = Duration::from_secs(30);

/// The chunk cache (MiB) of the child's open.
const PROBE_CHUNK_CACHE_MB: u32 = 4;

/// Frames larger than this are not read by the child (their metadata still is).
const MAX_PROBE_FRAME_BYTES: usize = 512 << 20;

/// Chunks per dataset whose index entries the child reads at most.
const MAX_PROBE_CHUNKS: usize = 1 << 20;

/// What the child does for one file: everything [`open`](super::open) does with
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
/// `input` (a hex-encoded path) writes one JSON reply line; returns at the
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
    use super::super::files;
    use super::super::wire::hex;
    use super::*;
    use std::os::unix::ffi::OsStrExt;

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
}
