//! Who may start a handshake with the server, decided at accept before anything
//! else happens: the peer's credentials (`SO_PEERCRED`) must name an allowed uid
//! (the server's own, plus any `--allow-uid`), and the handshakes in flight are
//! bounded in all and per peer process, so a flood of connects cannot exhaust the
//! server's threads or temp directories.

use std::collections::HashMap;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};

use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};

/// The process at the other end of a Unix socket, as the kernel reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    /// Its user id.
    pub uid: u32,
    /// Its process id (at connect time).
    pub pid: i32,
}

/// The credentials of the process at the other end of `stream`.
pub fn peer_of(stream: &UnixStream) -> std::io::Result<Peer> {
    let cred = getsockopt(stream, PeerCredentials)?;
    Ok(Peer {
        uid: cred.uid(),
        pid: cred.pid(),
    })
}

/// Limits on handshakes in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HandshakeLimits {
    /// In all.
    pub total: usize,
    /// Per peer process.
    pub per_peer: usize,
}

impl Default for HandshakeLimits {
    fn default() -> Self {
        HandshakeLimits {
            total: 64,
            per_peer: 16,
        }
    }
}

/// What the server does with a new connection.
#[derive(Debug)]
pub enum Admission {
    /// Handshake with it; the slot is held until the handshake ends.
    Admit(HandshakeSlot),
    /// Another user: closed at once.
    Refused(Peer),
    /// Too many handshakes in flight (in all, or of this process): closed with a
    /// word to retry.
    Busy(Peer),
}

#[derive(Debug, Default)]
struct InFlight {
    total: usize,
    per_peer: HashMap<i32, usize>,
}

/// The gate at accept: allowed uids and handshake counts.
#[derive(Debug, Clone)]
pub struct Gate {
    allowed_uids: Arc<Vec<u32>>,
    limits: HandshakeLimits,
    in_flight: Arc<Mutex<InFlight>>,
}

impl Gate {
    /// A gate that lets in `allowed_uids`, at most `limits` handshakes at once.
    pub fn new(allowed_uids: Vec<u32>, limits: HandshakeLimits) -> Gate {
        Gate {
            allowed_uids: Arc::new(allowed_uids),
            limits,
            in_flight: Arc::new(Mutex::new(InFlight::default())),
        }
    }

    /// Whether any allowed uid is not `own`'s (the handshake's files must then be
    /// reachable by other users).
    pub fn admits_others(&self, own: u32) -> bool {
        self.allowed_uids.iter().any(|&uid| uid != own)
    }

    /// Decides on a peer.
    pub fn admit(&self, peer: Peer) -> Admission {
        if !self.allowed_uids.contains(&peer.uid) {
            return Admission::Refused(peer);
        }
        let Ok(mut counts) = self.in_flight.lock() else {
            return Admission::Busy(peer);
        };
        let mine = counts.per_peer.get(&peer.pid).copied().unwrap_or(0);
        if counts.total >= self.limits.total || mine >= self.limits.per_peer {
            return Admission::Busy(peer);
        }
        counts.total += 1;
        counts.per_peer.insert(peer.pid, mine + 1);
        Admission::Admit(HandshakeSlot {
            pid: peer.pid,
            in_flight: Arc::clone(&self.in_flight),
        })
    }

    /// Handshakes in flight now.
    pub fn in_flight(&self) -> usize {
        self.in_flight.lock().map_or(0, |c| c.total)
    }
}

/// One handshake in flight; its place is given back when dropped.
#[derive(Debug)]
pub struct HandshakeSlot {
    pid: i32,
    in_flight: Arc<Mutex<InFlight>>,
}

impl Drop for HandshakeSlot {
    fn drop(&mut self) {
        // A poisoned count cannot be corrected; the gate then answers Busy.
        let Ok(mut counts) = self.in_flight.lock() else {
            return;
        };
        counts.total = counts.total.saturating_sub(1);
        if let Some(n) = counts.per_peer.get_mut(&self.pid) {
            *n -= 1;
            if *n == 0 {
                counts.per_peer.remove(&self.pid);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(uid: u32, pid: i32) -> Peer {
        Peer { uid, pid }
    }

    #[test]
    fn other_users_are_refused_unless_allowed() {
        let gate = Gate::new(vec![1000, 1001], HandshakeLimits::default());
        assert!(matches!(gate.admit(peer(1000, 5)), Admission::Admit(_)));
        assert!(matches!(gate.admit(peer(1001, 5)), Admission::Admit(_)));
        assert!(matches!(
            gate.admit(peer(0, 5)),
            Admission::Refused(Peer { uid: 0, pid: 5 })
        ));
        assert!(gate.admits_others(1000));
        assert!(!Gate::new(vec![7], HandshakeLimits::default()).admits_others(7));
    }

    #[test]
    fn handshakes_in_flight_are_bounded_in_all_and_per_process() {
        let limits = HandshakeLimits {
            total: 3,
            per_peer: 2,
        };
        let gate = Gate::new(vec![1], limits);
        let a1 = gate.admit(peer(1, 10));
        let _a2 = gate.admit(peer(1, 10));
        assert!(matches!(gate.admit(peer(1, 10)), Admission::Busy(_)));
        let b1 = gate.admit(peer(1, 11));
        assert!(matches!(b1, Admission::Admit(_)));
        assert!(
            matches!(gate.admit(peer(1, 12)), Admission::Busy(_)),
            "total"
        );
        assert_eq!(gate.in_flight(), 3);
        drop(a1);
        assert_eq!(gate.in_flight(), 2);
        assert!(matches!(gate.admit(peer(1, 10)), Admission::Admit(_)));
        drop(b1);
        assert!(matches!(gate.admit(peer(1, 12)), Admission::Admit(_)));
    }

    #[test]
    fn the_peer_of_a_socket_pair_is_this_process() {
        let (a, _b) = UnixStream::pair().unwrap();
        let me = peer_of(&a).unwrap();
        assert_eq!(me.uid, nix::unistd::geteuid().as_raw());
        assert_eq!(me.pid, std::process::id() as i32);
    }
}
