//! A client's requests and replies over its control channel: one request at a
//! time, each reply awaited within a timeout (a wait a signal handler interrupts
//! goes on), a lost reply marks the connection broken for good, and a server's
//! refusal keeps its cause ([`CacheError::refusal`], what a caller may read past the
//! cache: [`CacheError::is_bypassable`]).

use std::time::{Duration, Instant};

use ipc_channel::ipc::{IpcReceiver, IpcSender};
use ipc_channel::{IpcError, TryRecvError};
use tracing::warn;

use super::super::protocol::{Reply, Request, RequestError, TicketId};
use super::super::CacheError;
use super::CacheClient;

/// The next message on `replies` within `timeout`. The wait is a `poll`, which a
/// signal handler interrupts whatever its `SA_RESTART` (a profiler's, a job
/// signal counted on this thread): nothing was read then, so it waits again for
/// what is left of `timeout` rather than losing the reply.
pub(super) fn recv_within<T>(replies: &IpcReceiver<T>, timeout: Duration) -> Result<T, TryRecvError>
where
    T: for<'de> serde::Deserialize<'de> + serde::Serialize,
{
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match replies.try_recv_timeout(left) {
            Err(TryRecvError::IpcError(IpcError::Io(e)))
                if e.kind() == std::io::ErrorKind::Interrupted => {}
            other => return other,
        }
    }
}

impl CacheClient {
    /// The request channel, for the fault injection of [`crate::testkit`].
    pub(crate) fn request_channel(&self) -> &IpcSender<Request> {
        &self.requests
    }

    fn recv(&self, request: &'static str, timeout: Duration) -> Result<Reply, CacheError> {
        match recv_within(&self.replies, timeout) {
            Ok(reply) => Ok(reply),
            Err(TryRecvError::IpcError(IpcError::Disconnected)) => Err(CacheError::ServerGone {
                address: self.address.clone(),
            }),
            Err(TryRecvError::Empty) => {
                self.broken.set(true);
                Err(CacheError::Timeout {
                    request,
                    waited_s: timeout.as_secs(),
                })
            }
            Err(TryRecvError::IpcError(e)) => {
                // The reply may still come: the next request would read it as its own.
                self.broken.set(true);
                Err(CacheError::Ipc {
                    op: request,
                    message: format!("{e:?}"),
                })
            }
        }
    }

    fn send(&self, request: Request) -> Result<(), CacheError> {
        if self.broken.get() {
            return Err(CacheError::Broken);
        }
        let kind = request.kind();
        self.requests.send(request).map_err(|e| match e {
            IpcError::Disconnected => CacheError::ServerGone {
                address: self.address.clone(),
            },
            IpcError::Io(io) if io.kind() == std::io::ErrorKind::BrokenPipe => {
                CacheError::ServerGone {
                    address: self.address.clone(),
                }
            }
            other => CacheError::Ipc {
                op: kind,
                message: other.to_string(),
            },
        })
    }

    /// Sends a raw request and returns its reply: the protocol as it is, for tools
    /// and tests. `Reply::Error` comes back as a reply, not as `Err`. A `Release`
    /// releases exactly the lease it names; the `Lease`'s own drop then finds it
    /// released and does nothing.
    pub fn call(&self, request: Request) -> Result<Reply, CacheError> {
        let kind = request.kind();
        // A get may wait the server's fill wait for another client's fill first.
        let timeout = match request {
            Request::Get { .. } => self.reply_timeout.saturating_add(self.fill_wait),
            _ => self.reply_timeout,
        };
        self.send(request)?;
        while self.pending_acks.get() > 0 {
            let ack = self.recv("abort", self.reply_timeout)?;
            self.pending_acks.set(self.pending_acks.get() - 1);
            if let Reply::Error(error) = ack {
                warn!("cache abort refused: {error}");
            }
        }
        self.recv(kind, timeout)
    }

    /// Like [`call`](Self::call), with `Reply::Error` turned into `Err`.
    pub(super) fn request(&self, request: Request) -> Result<Reply, CacheError> {
        let kind = request.kind();
        match self.call(request)? {
            Reply::Error(error) => Err(CacheError::Refused {
                request: kind,
                error,
            }),
            reply => Ok(reply),
        }
    }

    pub(super) fn unexpected(kind: &str, reply: Reply) -> CacheError {
        CacheError::Protocol(format!("unexpected reply to {kind}: {reply:?}"))
    }

    pub(super) fn abort_later(&self, ticket: TicketId) {
        match self.send(Request::Abort { ticket }) {
            Ok(()) => self.pending_acks.set(self.pending_acks.get() + 1),
            Err(e) => warn!("cache abort of ticket {ticket} not sent: {e}"),
        }
    }
}

/// Refusals keep their cause, so callers can match on it.
impl CacheError {
    /// The server's reason, when the server refused the request.
    pub fn refusal(&self) -> Option<&RequestError> {
        match self {
            CacheError::Refused { error, .. } => Some(error),
            _ => None,
        }
    }

    /// Whether this connection is lost (the server went away, or a reply went
    /// missing and the channel is out of step): a new connection is needed.
    pub fn is_server_gone(&self) -> bool {
        matches!(self, CacheError::ServerGone { .. } | CacheError::Broken)
    }

    /// Whether the server refused this connection because every one of its
    /// connections (pin pages) is taken: the caller reads from disk instead.
    pub fn is_connection_refusal(&self) -> bool {
        matches!(
            self,
            CacheError::Refused {
                error: RequestError::TooManyConnections { .. },
                ..
            }
        )
    }

    /// Whether what answered at the address is not a server this process can use:
    /// another user's process ([`CacheError::ForeignServer`]), another build's
    /// server ([`CacheError::ProtocolVersion`]), or one with no connection left. A
    /// job with a node-shared address falls back to a server of its own then.
    pub fn is_not_ours(&self) -> bool {
        matches!(
            self,
            CacheError::ForeignServer { .. } | CacheError::ProtocolVersion { .. }
        ) || self.is_connection_refusal()
    }

    /// Whether the cache could not take or give this record but is otherwise
    /// working: a refusal other than a protocol error (no room, no memory, too
    /// large, a fill that did not finish in time, no lease left), after which the
    /// caller reads the record from disk.
    pub fn is_bypassable(&self) -> bool {
        match self {
            CacheError::Refused { error, .. } => !matches!(error, RequestError::Protocol(_)),
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ipc_channel::ipc;

    /// A handler that does nothing, installed with `SA_RESTART` like the job's.
    extern "C" fn nothing(_: libc::c_int) {}

    /// Runs `wait` on a thread and sends SIGURG (with [`nothing`] as its handler)
    /// to that thread every millisecond until it returns or `send_after` passed,
    /// then sends 7 on `tx`.
    fn interrupted<F>(tx: &IpcSender<u32>, send_after: Duration, wait: F) -> Result<u32, String>
    where
        F: FnOnce() -> Result<u32, TryRecvError> + Send + 'static,
    {
        use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
        let action = SigAction::new(
            SigHandler::Handler(nothing),
            SaFlags::SA_RESTART,
            SigSet::empty(),
        );
        // SAFETY: the handler does nothing (async-signal-safe); SIGURG is ignored
        // by default, so no other test relies on its disposition.
        unsafe { sigaction(Signal::SIGURG, &action) }.expect("SIGURG handler");
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let waiter = std::thread::spawn(move || {
            // SAFETY: gettid has no arguments and cannot fail.
            let _ = tid_tx.send(unsafe { libc::gettid() });
            wait().map_err(|e| format!("{e:?}"))
        });
        let tid = tid_rx.recv().expect("the waiter's tid");
        let pid = std::process::id() as libc::pid_t;
        let start = Instant::now();
        while !waiter.is_finished() && start.elapsed() < send_after {
            // SAFETY: tgkill to a thread of this process that is alive (not
            // finished) with a signal whose handler does nothing.
            unsafe { libc::syscall(libc::SYS_tgkill, pid, tid, libc::SIGURG) };
            std::thread::sleep(Duration::from_millis(1));
        }
        // The waiter may have given up and dropped its receiver already.
        let _ = tx.send(7);
        waiter.join().expect("the waiter panicked")
    }

    #[test]
    fn a_reply_wait_interrupted_by_signal_handlers_still_gets_the_reply() {
        // The stimulus is real: a bare wait fails with EINTR under it.
        let (tx, rx) = ipc::channel::<u32>().expect("channel");
        let bare = interrupted(&tx, Duration::from_secs(20), move || {
            rx.try_recv_timeout(Duration::from_secs(60))
        });
        assert!(
            bare.as_ref().is_err_and(|e| e.contains("Interrupted")),
            "{bare:?}"
        );
        let (tx, rx) = ipc::channel::<u32>().expect("channel");
        let waited = interrupted(&tx, Duration::from_millis(300), move || {
            recv_within(&rx, Duration::from_secs(60))
        });
        assert_eq!(waited, Ok(7));
    }

    #[test]
    fn only_refusals_other_than_protocol_errors_are_bypassed() {
        let refused = |error| CacheError::Refused {
            request: "reserve",
            error,
        };
        let full = RequestError::StoreFull {
            key: "k".into(),
            len: 1,
            pinned_bytes: 1,
            filling_bytes: 0,
            cap: 1,
        };
        assert!(refused(full).is_bypassable());
        assert!(refused(RequestError::TooManyLeases { max: 64 }).is_bypassable());
        assert!(!refused(RequestError::Protocol("bug".into())).is_bypassable());
        assert!(!CacheError::Broken.is_bypassable());
    }
}
