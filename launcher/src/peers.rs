//! The launchers of a multi-node job keep one TCP link each to node 0's launcher
//! (star, `--control-port`, default MASTER_PORT + 1), so the gang spans nodes: a
//! rank failing on one node stops the ranks of every node at once (instead of after
//! the collective timeout), and all nodes restart together or give up together.
//!
//! Lines on the wire: `FAIL <attempt> <node> <cause>` (that attempt failed on that
//! node: stop it and restart), `QUIT <node> <cause>` (that node left the job for
//! good: give up), `DONE <node>` (that node ended normally). Node 0 forwards every
//! line it receives to the other nodes. A link closing without DONE or QUIT means
//! that node's launcher died: QUIT.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// Something another node said, as this launcher must act on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerEvent {
    /// Attempt `attempt` failed on `node`.
    Failed {
        /// The attempt (restart count).
        attempt: u32,
        /// The node where it failed.
        node: u32,
        /// Why.
        cause: String,
    },
    /// `node` left the job for good.
    Quit {
        /// The node.
        node: u32,
        /// Why.
        cause: String,
    },
}

/// One line of the protocol, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Message {
    Fail {
        attempt: u32,
        node: u32,
        cause: String,
    },
    Quit {
        node: u32,
        cause: String,
    },
    Done {
        node: u32,
    },
}

impl Message {
    fn parse(line: &str) -> Option<Message> {
        let mut words = line.trim_end().splitn(2, ' ');
        let kind = words.next()?;
        let rest = words.next().unwrap_or("");
        let mut fields = rest.splitn(3, ' ');
        match kind {
            "FAIL" => Some(Message::Fail {
                attempt: fields.next()?.parse().ok()?,
                node: fields.next()?.parse().ok()?,
                cause: fields.next().unwrap_or("").to_string(),
            }),
            "QUIT" => {
                let mut fields = rest.splitn(2, ' ');
                Some(Message::Quit {
                    node: fields.next()?.parse().ok()?,
                    cause: fields.next().unwrap_or("").to_string(),
                })
            }
            "DONE" => Some(Message::Done {
                node: rest.trim().parse().ok()?,
            }),
            _ => None,
        }
    }

    fn line(&self) -> String {
        let flat = |cause: &str| cause.replace(['\n', '\r'], " ");
        match self {
            Message::Fail {
                attempt,
                node,
                cause,
            } => format!("FAIL {attempt} {node} {}\n", flat(cause)),
            Message::Quit { node, cause } => format!("QUIT {node} {}\n", flat(cause)),
            Message::Done { node } => format!("DONE {node}\n"),
        }
    }
}

#[derive(Default)]
struct Shared {
    /// Open links: (node at the other end, stream).
    links: Mutex<Vec<(u32, TcpStream)>>,
    /// What the other nodes said, in order.
    events: Mutex<Vec<PeerEvent>>,
}

impl Shared {
    fn push(&self, event: PeerEvent) {
        self.events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(event);
    }

    /// Sends `message` on every link except the one to `except`.
    fn send(&self, message: &Message, except: Option<u32>) {
        let line = message.line();
        let mut links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        for (node, stream) in links.iter_mut() {
            if Some(*node) != except {
                let _ = stream.write_all(line.as_bytes());
            }
        }
    }
}

/// This launcher's links to the other nodes' launchers (clones share them).
#[derive(Clone)]
pub struct PeerLinks {
    node_rank: u32,
    shared: Arc<Shared>,
}

impl PeerLinks {
    /// Node 0 listens on `port`; the others connect to `master_addr:port`, trying
    /// for up to `timeout`.
    pub fn start(
        node_rank: u32,
        master_addr: &str,
        port: u16,
        timeout: Duration,
    ) -> Result<PeerLinks> {
        let shared = Arc::new(Shared::default());
        if node_rank == 0 {
            let listener = TcpListener::bind(("0.0.0.0", port)).with_context(|| {
                format!("listening for the other nodes' launchers on port {port} (--control-port)")
            })?;
            let accept_shared = shared.clone();
            std::thread::Builder::new()
                .name("peer-accept".into())
                .spawn(move || accept_loop(listener, accept_shared))
                .context("starting the peer link thread")?;
        } else {
            let stream = connect(master_addr, port, timeout)?;
            let _ = (&stream).write_all(format!("HELLO {node_rank}\n").as_bytes());
            let reader = stream.try_clone().context("cloning the link to node 0")?;
            shared
                .links
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((0, stream));
            let read_shared = shared.clone();
            std::thread::Builder::new()
                .name("peer-node0".into())
                .spawn(move || read_lines(BufReader::new(reader), 0, &read_shared, false))
                .context("starting the peer link thread")?;
        }
        Ok(PeerLinks { node_rank, shared })
    }

    /// Tells the other nodes that attempt `attempt` failed here.
    pub fn report_failure(&self, attempt: u32, cause: &str) {
        self.shared.send(
            &Message::Fail {
                attempt,
                node: self.node_rank,
                cause: cause.to_string(),
            },
            None,
        );
    }

    /// Tells the other nodes how this launcher ends: `Some(cause)` = it gives up.
    pub fn report_end(&self, gave_up: Option<&str>) {
        let message = match gave_up {
            Some(cause) => Message::Quit {
                node: self.node_rank,
                cause: cause.to_string(),
            },
            None => Message::Done {
                node: self.node_rank,
            },
        };
        self.shared.send(&message, None);
    }

    /// What the other nodes have said that stops attempt `attempt` here: a failure
    /// of that attempt elsewhere, or a node that quit.
    pub fn stop_reason(&self, attempt: u32) -> Option<PeerEvent> {
        let events = self.shared.events.lock().unwrap_or_else(|p| p.into_inner());
        events
            .iter()
            .find(|event| match event {
                PeerEvent::Failed { attempt: a, .. } => *a == attempt,
                PeerEvent::Quit { .. } => true,
            })
            .cloned()
    }

    /// A node that left the job for good, if any.
    pub fn quit(&self) -> Option<PeerEvent> {
        let events = self.shared.events.lock().unwrap_or_else(|p| p.into_inner());
        events
            .iter()
            .find(|event| matches!(event, PeerEvent::Quit { .. }))
            .cloned()
    }
}

fn connect(addr: &str, port: u16, timeout: Duration) -> Result<TcpStream> {
    let started = Instant::now();
    loop {
        match TcpStream::connect((addr, port)) {
            Ok(stream) => return Ok(stream),
            Err(e) if started.elapsed() > timeout => {
                bail!("cannot reach node 0's launcher at {addr}:{port} (--control-port) within {:.0} s: {e}", timeout.as_secs_f64())
            }
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    for stream in listener.incoming().flatten() {
        let shared = shared.clone();
        let _ = std::thread::Builder::new()
            .name("peer-link".into())
            .spawn(move || {
                let mut reader = match stream.try_clone() {
                    Ok(clone) => BufReader::new(clone),
                    Err(_) => return,
                };
                let mut hello = String::new();
                let node = match reader.read_line(&mut hello) {
                    Ok(_) => hello
                        .trim()
                        .strip_prefix("HELLO ")
                        .and_then(|n| n.parse::<u32>().ok()),
                    Err(_) => None,
                };
                let Some(node) = node else {
                    tracing::warn!(
                        "ignoring a connection that did not introduce itself as a launcher"
                    );
                    return;
                };
                shared
                    .links
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push((node, stream));
                read_lines(reader, node, &shared, true);
            });
    }
}

/// Reads a link until it closes; `forward` (node 0) passes each line on to the
/// other nodes.
fn read_lines(reader: BufReader<TcpStream>, from: u32, shared: &Shared, forward: bool) {
    let mut ended = false;
    for line in reader.lines() {
        let Ok(line) = line else { break };
        let Some(message) = Message::parse(&line) else {
            continue;
        };
        match &message {
            Message::Fail {
                attempt,
                node,
                cause,
            } => shared.push(PeerEvent::Failed {
                attempt: *attempt,
                node: *node,
                cause: cause.clone(),
            }),
            Message::Quit { node, cause } => {
                if *node == from {
                    ended = true;
                }
                shared.push(PeerEvent::Quit {
                    node: *node,
                    cause: cause.clone(),
                })
            }
            Message::Done { node } => {
                if *node == from {
                    ended = true;
                }
            }
        }
        if forward {
            shared.send(&message, Some(from));
        }
    }
    if !ended {
        let message = Message::Quit {
            node: from,
            cause: format!("the launcher of node {from} went away"),
        };
        if let Message::Quit { node, cause } = &message {
            shared.push(PeerEvent::Quit {
                node: *node,
                cause: cause.clone(),
            });
        }
        if forward {
            shared.send(&message, Some(from));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip() {
        for message in [
            Message::Fail {
                attempt: 2,
                node: 1,
                cause: "rank 3 (pid 9) exited with code 3".into(),
            },
            Message::Quit {
                node: 0,
                cause: "no restart left".into(),
            },
            Message::Done { node: 4 },
        ] {
            assert_eq!(Message::parse(&message.line()), Some(message.clone()));
        }
        assert_eq!(Message::parse("NOPE 1"), None);
        assert_eq!(Message::parse("FAIL x 1 y"), None);
        let multi = Message::Quit {
            node: 1,
            cause: "a\nb".into(),
        };
        assert_eq!(multi.line(), "QUIT 1 a b\n");
    }

    #[test]
    fn failures_reach_every_node_through_node_0() {
        let port = {
            let l = TcpListener::bind(("127.0.0.1", 0)).unwrap_or_else(|e| panic!("{e}"));
            l.local_addr().unwrap_or_else(|e| panic!("{e}")).port()
        };
        let timeout = Duration::from_secs(5);
        let node0 =
            PeerLinks::start(0, "127.0.0.1", port, timeout).unwrap_or_else(|e| panic!("{e:#}"));
        let node1 =
            PeerLinks::start(1, "127.0.0.1", port, timeout).unwrap_or_else(|e| panic!("{e:#}"));
        let node2 =
            PeerLinks::start(2, "127.0.0.1", port, timeout).unwrap_or_else(|e| panic!("{e:#}"));
        let linked = || node0.shared.links.lock().map(|l| l.len()).unwrap_or(0) == 2;
        let deadline = Instant::now() + timeout;
        while !linked() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(linked());

        node1.report_failure(0, "rank 2 exited with code 3");
        let wait = |links: &PeerLinks| {
            let deadline = Instant::now() + timeout;
            loop {
                if let Some(event) = links.stop_reason(0) {
                    return Some(event);
                }
                if Instant::now() > deadline {
                    return None;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        };
        let expected = PeerEvent::Failed {
            attempt: 0,
            node: 1,
            cause: "rank 2 exited with code 3".into(),
        };
        assert_eq!(wait(&node0), Some(expected.clone()));
        assert_eq!(wait(&node2), Some(expected));
        // The sender does not hear its own failure back, and attempt 1 is untouched.
        assert_eq!(node1.stop_reason(0), None);
        assert_eq!(node2.stop_reason(1), None);

        // Node 2 ends normally, then node 1's launcher vanishes.
        node2.report_end(None);
        if let Ok(links) = node1.shared.links.lock() {
            for (_, stream) in links.iter() {
                let _ = stream.shutdown(std::net::Shutdown::Both);
            }
        }
        let deadline = Instant::now() + timeout;
        while node0.quit().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        match node0.quit() {
            Some(PeerEvent::Quit { node: 1, cause }) => {
                assert!(cause.contains("went away"), "{cause}")
            }
            other => panic!("node 0 saw {other:?}"),
        }
    }
}
