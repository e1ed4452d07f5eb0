//! The launchers of a multi-node job keep one TCP link each to node 0's launcher
//! (a star), so the gang spans nodes. Node 0 listens on the master address (never
//! on every interface), on `--control-port` or a port the kernel picks, published
//! with the job's secret in the run directory ([`control`]); a launcher joins only
//! by proving it knows the secret ([`auth`]), and node 0 logs and closes any other
//! connection, naming its address. Until a connection has proved the secret it
//! costs node 0 little: a bounded line, one deadline for its whole handshake, and
//! at most [`MAX_PENDING_PER_ADDR`] handshakes in flight from one address
//! ([`MAX_PENDING`] in all); a connection past those is closed at once. Refusals
//! are logged at most once per [`REFUSAL_LOG_EVERY`] per address, with a count.
//!
//! Node 0 coordinates ([`wire`] has the lines): it waits until every node has
//! joined, then starts each attempt with `START <attempt> <port>` (rank 0's
//! rendezvous port, chosen free on node 0 for that attempt); the other nodes start
//! their ranks only then, so every node runs the same attempt and none restarts
//! alone. A rank failing on any node stops the ranks of every node at once
//! (`FAIL`/`HUNG`, forwarded by node 0), node 0 decides whether to restart, and
//! a node whose launcher gives up, is interrupted or dies (its link closes without
//! `DONE` or `QUIT`) ends the job on every node, naming it. Each launcher also
//! tells the others how its ranks stand (`VIEW`, from its own reading of their
//! heartbeats), so every node judges its own ranks against all the job's, and
//! names a stopped or hung rank of its own only (see [`crate::hang`]). Every
//! launcher beats on its links and names a node silent for `--peer-silence-s` as
//! lost ([`liveness`]): a link cut or a host gone quiet ends the job on every
//! node as a link closed does, naming the lost node (and records it beside the
//! ranks' heartbeats, `heartbeat/node<K>.lost`). Under elastic membership
//! (`--min-nodes`) a lost node other than node 0 ends nothing by itself: node 0
//! decides whether the job goes on without it (`MEMBERS`, then `START`), and a
//! link that closes is a lost node too. A node left out may link again (its
//! launcher started again): node 0 ends the attempt at a restart point
//! (`RESTART`) and takes it in (`MEMBERS` with it, which forgets how it left);
//! a second launcher of a linked node, or one before node 0 left it out, is
//! refused. Nodes and their links keep their first index throughout.

pub mod auth;
pub mod control;
pub mod liveness;
pub mod wire;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use control::Control;

use crate::relay::{RankReport, Relay};

/// How long a connection may take over its whole handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshakes in flight from one address, at most.
pub const MAX_PENDING_PER_ADDR: usize = 4;
/// Handshakes in flight in all, at most.
pub const MAX_PENDING: usize = 64;
/// How often node 0 logs the refusals of one address.
pub const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(5);

/// Something another node said, as this launcher must act on it: a line of the
/// protocol.
pub use wire::Message as PeerEvent;
pub use wire::NormalEnd;

/// Where this launcher meets the others.
#[derive(Debug, Clone)]
pub struct LinkSpec {
    /// This node.
    pub node_rank: u32,
    /// Nodes in the job.
    pub nnodes: u32,
    /// Node 0's address (`--master-addr`).
    pub master_addr: String,
    /// A fixed control port (`--control-port`), else node 0 picks one and
    /// publishes it in the control file.
    pub port: Option<u16>,
    /// The run directory's control file.
    pub control_file: PathBuf,
    /// The job's secret from the batch script (`VRTSPIKE_JOB_SECRET`).
    pub secret: Option<String>,
    /// How long the other nodes keep trying to reach node 0.
    pub timeout: Duration,
    /// How long a linked node may stay silent before it is lost
    /// (`--peer-silence-s`).
    pub silence: Duration,
    /// The run directory (a lost node is recorded in its heartbeat directory).
    pub run_dir: PathBuf,
    /// Elastic membership (`--min-nodes` below the nodes): a lost node other than
    /// node 0 is for node 0 to decide on, not an ending by itself.
    pub elastic: bool,
    /// This launcher's version and config digest (node 0 takes in only its like).
    pub identity: auth::Identity,
}

/// How long a write on a link may block (a peer that reads nothing for this long
/// is lost anyway, and a blocked write must not hold every link).
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// One open link.
struct Link {
    /// The node at the other end.
    node: u32,
    /// Tells this link from a later one of the same node (a node that came back).
    id: u64,
    stream: TcpStream,
}

#[derive(Default)]
struct Shared {
    /// Open links.
    links: Mutex<Vec<Link>>,
    /// The id of the next link.
    next_link: std::sync::atomic::AtomicU64,
    /// What the other nodes said, in order (but how their ranks stand).
    events: Mutex<Vec<PeerEvent>>,
    /// How each other node's rank stands, by rank: the last word.
    reports: Mutex<HashMap<u32, RankReport>>,
    /// When each linked node was last heard, and its host.
    heard: liveness::Heard,
    /// Where a lost node is recorded (`heartbeat/node<K>.lost`).
    run_dir: PathBuf,
    /// Elastic membership (see [`LinkSpec::elastic`]).
    elastic: bool,
}

impl Shared {
    /// Keeps `message`: a rank's report replaces the last of that rank; any
    /// other line is kept in order. A membership that lists a node forgets how it
    /// left before (it came back).
    fn push(&self, event: PeerEvent) {
        if let PeerEvent::Beat { node, host } = &event {
            self.heard.host(*node, host);
            return;
        }
        if let PeerEvent::Lost { node, cause } = &event {
            let written =
                vrtspike_contract::heartbeat::write_lost_node(&self.run_dir, *node, cause);
            if let Err(e) = written {
                tracing::warn!("recording lost node {node}: {e}");
            }
        }
        if let PeerEvent::View(report) = event {
            self.reports
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(report.rank, report);
            return;
        }
        let mut events = self.events.lock().unwrap_or_else(|p| p.into_inner());
        if let PeerEvent::Members { members, .. } = &event {
            events.retain(|earlier| departed(earlier).is_none_or(|node| !members.contains(&node)));
        }
        events.push(event);
    }

    /// Whether `node` takes part in the job now: in node 0's latest membership
    /// (every node until one is said).
    fn is_member(&self, node: u32) -> bool {
        let events = self.events.lock().unwrap_or_else(|p| p.into_inner());
        is_member_in(&events, node)
    }

    /// Sends `message` on every link except the one to `except`.
    fn send(&self, message: &PeerEvent, except: Option<u32>) {
        self.send_where(message, |link| Some(link.node) != except);
    }

    /// Sends `message` on the one link `to`.
    fn send_on(&self, to: LinkEnd, message: &PeerEvent) {
        self.send_where(message, |link| link.node == to.node && link.id == to.id);
    }

    /// Sends `message` on the links `chosen` picks.
    fn send_where(&self, message: &PeerEvent, chosen: impl Fn(&Link) -> bool) {
        let line = message.line();
        let mut links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        for link in links.iter_mut().filter(|link| chosen(link)) {
            let _ = link.stream.write_all(line.as_bytes());
        }
    }

    /// Node 0's latest `MEMBERS` (`None`: every node takes part, as at the start).
    fn latest_members(&self) -> Option<PeerEvent> {
        let events = self.events.lock().unwrap_or_else(|p| p.into_inner());
        let mut latest = events.iter().rev();
        latest
            .find(|event| matches!(event, PeerEvent::Members { .. }))
            .cloned()
    }

    /// Whether `node` left the job (ended, quit or lost).
    fn has_left(&self, node: u32) -> bool {
        let events = self.events.lock().unwrap_or_else(|p| p.into_inner());
        events.iter().any(|event| departed(event) == Some(node))
    }

    /// A link to `node` starts: it counts as heard now. Returns its id.
    fn link(&self, node: u32, stream: TcpStream) -> u64 {
        let _ = stream.set_read_timeout(None);
        let _ = stream.set_write_timeout(Some(WRITE_TIMEOUT));
        self.heard.now(node);
        let id = self
            .next_link
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        links.push(Link { node, id, stream });
        id
    }

    /// Closes and forgets the links of `node` (`id`: only that one).
    fn unlink(&self, node: u32, id: Option<u64>) {
        let mut links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        links.retain(|link| {
            let this = link.node == node && id.is_none_or(|id| link.id == id);
            if this {
                let _ = link.stream.shutdown(std::net::Shutdown::Both);
            }
            !this
        });
    }

    fn linked(&self) -> Vec<u32> {
        let links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        links.iter().map(|link| link.node).collect()
    }
}

/// This launcher's links to the other nodes' launchers (clones share them).
#[derive(Clone)]
pub struct PeerLinks {
    node_rank: u32,
    nnodes: u32,
    shared: Arc<Shared>,
}

impl PeerLinks {
    /// Node 0 listens and publishes its control file; the others join it, trying
    /// for up to the spec's timeout.
    pub fn start(spec: &LinkSpec) -> Result<PeerLinks> {
        let shared = Arc::new(Shared {
            run_dir: spec.run_dir.clone(),
            elastic: spec.elastic,
            ..Shared::default()
        });
        if spec.node_rank == 0 {
            listen(spec, shared.clone())?;
        } else {
            // The handshake's reader, which may hold lines node 0 sent right after.
            let (stream, reader) = join(spec)?;
            let id = shared.link(0, stream);
            let read_shared = shared.clone();
            let link = LinkEnd { node: 0, id };
            std::thread::Builder::new()
                .name("peer-node0".into())
                .spawn(move || read_lines(reader, link, &read_shared, false))
                .context("starting the peer link thread")?;
        }
        liveness::spawn(spec.node_rank, spec.silence, shared.clone())
            .context("starting the peer liveness thread")?;
        Ok(PeerLinks {
            node_rank: spec.node_rank,
            nnodes: spec.nnodes,
            shared,
        })
    }

    /// Node 0: waits until every other node has joined (or one left, or
    /// `interrupted` says stop); an error names the nodes that never joined.
    pub fn wait_for_nodes(&self, timeout: Duration, interrupted: &dyn Fn() -> bool) -> Result<()> {
        let started = Instant::now();
        loop {
            let linked = self.shared.linked();
            let missing: Vec<u32> = (1..self.nnodes).filter(|n| !linked.contains(n)).collect();
            if missing.is_empty() {
                tracing::info!(
                    "all {} nodes joined in {:.2} s",
                    self.nnodes,
                    started.elapsed().as_secs_f64()
                );
                return Ok(());
            }
            if self.quit().is_some() || interrupted() {
                return Ok(());
            }
            if started.elapsed() > timeout {
                bail!(
                    "node(s) {missing:?} of {} did not join node 0's launcher within {:.0} s (--peer-timeout-s)",
                    self.nnodes,
                    timeout.as_secs_f64()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Node 0: tells the other nodes to start attempt `attempt` with rank 0's
    /// store on `port`.
    pub fn announce_start(&self, attempt: u32, port: u16) {
        self.shared.send(&PeerEvent::Start { attempt, port }, None);
    }

    /// Another node: the attempt node 0 starts next, from `attempt` on, and its
    /// rendezvous port (`Ok(None)`: node 0 quit or ended instead, or
    /// `interrupted` said stop). A node that came back waits for attempt 0 and
    /// gets the one node 0 takes it in at; while node 0's membership leaves it
    /// out it waits as long as node 0 is linked (node 0 gone ends the wait), not
    /// `timeout`.
    pub fn wait_start(
        &self,
        attempt: u32,
        timeout: Duration,
        interrupted: &dyn Fn() -> bool,
    ) -> Result<Option<StartWord>> {
        let started = Instant::now();
        let mut told = false;
        loop {
            if let Some(start) = self.started(attempt) {
                return Ok(Some(start));
            }
            if self.quit().is_some() || self.ended(0) || interrupted() {
                return Ok(None);
            }
            let left_out = !self.shared.is_member(self.node_rank);
            if left_out && !told {
                tracing::info!(
                    "node 0's membership leaves this node out for now: waiting to be taken in \
                     for as long as node 0 is linked (--peer-timeout-s does not apply)"
                );
                told = true;
            }
            if started.elapsed() > timeout && !left_out {
                bail!(
                    "node 0 did not start attempt {attempt} within {:.0} s (--peer-timeout-s)",
                    timeout.as_secs_f64()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn started(&self, attempt: u32) -> Option<StartWord> {
        let events = self.shared.events.lock().unwrap_or_else(|p| p.into_inner());
        events.iter().find_map(|event| match event {
            PeerEvent::Start { attempt: a, port } if *a >= attempt => Some(StartWord {
                attempt: *a,
                port: *port,
            }),
            _ => None,
        })
    }

    /// Tells the other nodes that attempt `attempt` failed here (`hung`: a rank
    /// was found stopped or hung: they save their stacks too).
    pub fn report_failure(&self, attempt: u32, cause: &str, hung: bool) {
        self.shared.send(
            &PeerEvent::Fail {
                attempt,
                node: self.node_rank,
                hung,
                cause: cause.to_string(),
            },
            None,
        );
    }

    /// Tells the other nodes how this node's ranks stand (they compare their own
    /// ranks with them).
    pub fn relay_reports(&self, reports: &[RankReport]) {
        for report in reports {
            self.shared.send(&PeerEvent::View(*report), None);
        }
    }

    /// How the other nodes' ranks stood in attempt `attempt` when their launchers
    /// last said.
    pub fn reports(&self, attempt: u32) -> Vec<RankReport> {
        let reports = self
            .shared
            .reports
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        reports
            .values()
            .filter(|s| s.attempt == attempt)
            .copied()
            .collect()
    }

    /// Tells the other nodes how this launcher ends: normally, or it gives up
    /// (`Err(cause)`).
    pub fn report_end(&self, end: std::result::Result<NormalEnd, &str>) {
        let node = self.node_rank;
        let message = match end {
            Ok(how) => PeerEvent::Done { node, how },
            Err(cause) => PeerEvent::Quit {
                node,
                cause: cause.to_string(),
            },
        };
        self.shared.send(&message, None);
    }

    /// What the other nodes have said that stops attempt `attempt` here: a failure
    /// of that attempt elsewhere, a node that quit, a lost node (but one a
    /// membership of node 0's left out already), or node 0's membership for a
    /// later attempt.
    pub fn stop_reason(&self, attempt: u32) -> Option<PeerEvent> {
        let events = self.shared.events.lock().unwrap_or_else(|p| p.into_inner());
        events
            .iter()
            .find(|event| match event {
                PeerEvent::Fail { attempt: a, .. } => *a == attempt,
                PeerEvent::Members { attempt: a, .. } => *a > attempt,
                PeerEvent::Quit { node, .. } | PeerEvent::Lost { node, .. } => {
                    is_member_in(&events, *node)
                }
                PeerEvent::Start { .. }
                | PeerEvent::Restart { .. }
                | PeerEvent::Done { .. }
                | PeerEvent::View(_)
                | PeerEvent::Beat { .. } => false,
            })
            .cloned()
    }

    /// A member node that left the job for good (it quit, its link closed, or it
    /// was silent for too long: lost), if any. Under elastic membership a lost
    /// node other than node 0 is not one: node 0 decides
    /// ([`PeerLinks::undecided_losses`]); nor is a node left out (it may come back).
    pub fn quit(&self) -> Option<PeerEvent> {
        let elastic = self.shared.elastic;
        let events = self.shared.events.lock().unwrap_or_else(|p| p.into_inner());
        events
            .iter()
            .find(|event| match event {
                PeerEvent::Quit { node, .. } => is_member_in(&events, *node),
                PeerEvent::Lost { node, .. } => {
                    (!elastic || *node == 0) && is_member_in(&events, *node)
                }
                _ => false,
            })
            .cloned()
    }

    /// The lost nodes no membership of node 0's has left out yet, with their
    /// `LOST` lines, in the order they were found.
    pub fn undecided_losses(&self) -> Vec<PeerEvent> {
        let events = self.shared.events.lock().unwrap_or_else(|p| p.into_inner());
        events
            .iter()
            .filter(|event| match event {
                PeerEvent::Lost { node, .. } => is_member_in(&events, *node),
                _ => false,
            })
            .cloned()
            .collect()
    }

    /// Node 0: the nodes that came back (linked again after a membership left
    /// them out) and are waiting to be taken in, in order.
    pub fn returning(&self) -> Vec<u32> {
        let mut back: Vec<u32> = self
            .shared
            .linked()
            .into_iter()
            .filter(|node| !self.shared.is_member(*node))
            .collect();
        back.sort_unstable();
        back.dedup();
        back
    }

    /// Node 0: ends attempt `attempt` at a restart point on every node (a
    /// returning node is taken in at the next).
    pub fn announce_restart(&self, attempt: u32) {
        let message = PeerEvent::Restart { attempt };
        self.shared.push(message.clone());
        self.shared.send(&message, None);
    }

    /// Whether node 0 ended attempt `attempt` at a restart point.
    pub fn restart_asked(&self, attempt: u32) -> bool {
        let events = self.shared.events.lock().unwrap_or_else(|p| p.into_inner());
        events
            .iter()
            .any(|event| matches!(event, PeerEvent::Restart { attempt: a } if *a == attempt))
    }

    /// Node 0: the membership from attempt `attempt` on, kept here and told to the
    /// other nodes (before that attempt's `START`).
    pub fn announce_members(&self, attempt: u32, members: &[u32]) {
        let message = PeerEvent::Members {
            attempt,
            members: members.to_vec(),
        };
        self.shared.push(message.clone());
        self.shared.send(&message, None);
    }

    /// Node 0's latest membership for attempt `attempt` (`None`: the job's first).
    pub fn members_for(&self, attempt: u32) -> Option<Vec<u32>> {
        let events = self.shared.events.lock().unwrap_or_else(|p| p.into_inner());
        events.iter().rev().find_map(|event| match event {
            PeerEvent::Members {
                attempt: a,
                members,
            } if *a <= attempt => Some(members.clone()),
            _ => None,
        })
    }

    /// Whether the job runs under elastic membership ([`LinkSpec::elastic`]).
    pub fn elastic(&self) -> bool {
        self.shared.elastic
    }

    /// The host `node` said it runs on (`None`: it never said); this node's own.
    pub fn host_of(&self, node: u32) -> Option<String> {
        if node == self.node_rank {
            return Some(liveness::this_host());
        }
        self.shared.heard.host_of(node)
    }

    /// Whether every other linked node has said something since `since` (nodes
    /// that left aside): a beat comes every [`liveness::beat_interval`] from a
    /// live launcher.
    pub fn all_heard_since(&self, since: Instant) -> bool {
        let unheard = self.shared.heard.unheard_since(since);
        unheard.iter().all(|node| self.shared.has_left(*node))
    }

    /// Whether `node` said it ended normally.
    pub fn ended(&self, node: u32) -> bool {
        self.ended_how(node).is_some()
    }

    /// How `node` said it ended normally, if it did.
    pub fn ended_how(&self, node: u32) -> Option<NormalEnd> {
        let events = self.shared.events.lock().unwrap_or_else(|p| p.into_inner());
        events.iter().find_map(|event| match event {
            PeerEvent::Done { node: n, how } if *n == node => Some(*how),
            _ => None,
        })
    }

    /// The nodes that ended normally (a restart would wait for their ranks forever).
    pub fn ended_nodes(&self) -> Vec<u32> {
        (0..self.nnodes).filter(|n| self.ended(*n)).collect()
    }
}

/// The hang watch tells the other nodes how this node's ranks stand, and hears
/// theirs, over the links.
impl Relay for PeerLinks {
    fn send(&self, reports: &[RankReport]) {
        self.relay_reports(reports);
    }

    fn heard(&self, attempt: u32) -> Vec<RankReport> {
        self.reports(attempt)
    }
}

/// Node 0's word on the next attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StartWord {
    /// The attempt (restart count).
    pub attempt: u32,
    /// Rank 0's rendezvous port for it.
    pub port: u16,
}

/// Whether `node` is in the latest membership among `events` (every node is
/// until one is said).
fn is_member_in(events: &[PeerEvent], node: u32) -> bool {
    events
        .iter()
        .rev()
        .find_map(|event| match event {
            PeerEvent::Members { members, .. } => Some(members.contains(&node)),
            _ => None,
        })
        .unwrap_or(true)
}

/// The node `event` says left the job (quit, lost or ended), if it says one did.
fn departed(event: &PeerEvent) -> Option<u32> {
    match event {
        PeerEvent::Quit { node, .. }
        | PeerEvent::Lost { node, .. }
        | PeerEvent::Done { node, .. } => Some(*node),
        _ => None,
    }
}

/// The local address `master_addr` names, with `port`: node 0 listens there only.
fn listen_addr(master_addr: &str, port: u16) -> Result<TcpListener> {
    let addrs: Vec<SocketAddr> = (master_addr, port)
        .to_socket_addrs()
        .with_context(|| format!("resolving the master address {master_addr:?} (--master-addr)"))?
        .collect();
    let mut last = None;
    for addr in &addrs {
        match TcpListener::bind(addr) {
            Ok(listener) => return Ok(listener),
            Err(e) => last = Some(format!("{addr}: {e}")),
        }
    }
    bail!(
        "node 0 cannot listen on the master address {master_addr:?} ({}): it must be an \
         address of this node that the other nodes reach (--master-addr)",
        last.unwrap_or_else(|| "it resolves to nothing".into())
    )
}

/// Node 0: binds the control port on the master address, publishes it with the
/// secret, and accepts the other launchers on a thread.
fn listen(spec: &LinkSpec, shared: Arc<Shared>) -> Result<()> {
    let listener = listen_addr(&spec.master_addr, spec.port.unwrap_or(0))?;
    let local = listener
        .local_addr()
        .context("reading the control port node 0 bound")?;
    let secret = match &spec.secret {
        Some(secret) => secret.clone(),
        None => auth::random_hex(32).context("making the job's secret")?,
    };
    Control {
        addr: local.ip().to_string(),
        port: local.port(),
        secret: secret.clone(),
        pid: std::process::id(),
    }
    .write(&spec.control_file)?;
    tracing::info!(
        "control link on {local} (published in {})",
        spec.control_file.display()
    );
    let gate = Gate {
        secret,
        identity: spec.identity.clone(),
        nnodes: spec.nnodes,
        ..Gate::default()
    };
    std::thread::Builder::new()
        .name("peer-accept".into())
        .spawn(move || accept_loop(listener, shared, gate))
        .context("starting the peer link thread")?;
    Ok(())
}

/// Another node: joins node 0's launcher, reading its port and the secret from
/// the control file unless given, trying until the timeout.
fn join(spec: &LinkSpec) -> Result<(TcpStream, BufReader<TcpStream>)> {
    let started = Instant::now();
    loop {
        let last_error = match try_join(spec) {
            Ok(stream) => return Ok(stream),
            Err(e) if matches!(e.downcast_ref(), Some(auth::AuthError::Unlike(_))) => {
                return Err(e.context("joining node 0's launcher"));
            }
            Err(e) => format!("{e:#}"),
        };
        if started.elapsed() > spec.timeout {
            bail!(
                "cannot join node 0's launcher at {} within {:.0} s (--peer-timeout-s): {last_error}",
                spec.master_addr,
                spec.timeout.as_secs_f64()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn try_join(spec: &LinkSpec) -> Result<(TcpStream, BufReader<TcpStream>)> {
    let published = match (spec.port, &spec.secret) {
        (Some(_), Some(_)) => None,
        _ => Some(Control::read(&spec.control_file).context(
            "node 0's control file (share the run dir, or give --control-port and VRTSPIKE_JOB_SECRET)",
        )?),
    };
    let port = spec.port.or(published.as_ref().map(|c| c.port));
    let secret = spec.secret.clone().or(published.map(|c| c.secret));
    let (Some(port), Some(secret)) = (port, secret) else {
        bail!("no control port or secret");
    };
    let addr = (spec.master_addr.as_str(), port)
        .to_socket_addrs()
        .with_context(|| format!("resolving {}", spec.master_addr))?
        .next()
        .with_context(|| format!("{} resolves to nothing", spec.master_addr))?;
    let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
        .with_context(|| format!("connecting to {addr}"))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
    auth::join(
        &mut reader,
        &secret,
        spec.node_rank,
        &spec.identity,
        deadline,
    )
    .with_context(|| format!("at {addr}"))?;
    Ok((stream, reader))
}

/// Handshakes in flight, in all and by address.
#[derive(Default)]
struct Pending {
    total: usize,
    by_addr: HashMap<IpAddr, usize>,
}

/// When an address's refusals were last logged, and how many since.
type RefusalLog = HashMap<IpAddr, (Option<Instant>, u64)>;

/// Node 0's gate: the handshakes in flight, when each address's refusals were
/// last logged, and what a launcher must prove (the secret, node 0's identity,
/// a node index below the job's nodes).
#[derive(Clone, Default)]
struct Gate {
    pending: Arc<Mutex<Pending>>,
    logged: Arc<Mutex<RefusalLog>>,
    secret: String,
    identity: auth::Identity,
    nnodes: u32,
}

/// A handshake's place at the gate, given back when dropped.
struct PendingSlot {
    gate: Gate,
    addr: IpAddr,
}

impl Drop for PendingSlot {
    fn drop(&mut self) {
        let mut pending = self.gate.pending.lock().unwrap_or_else(|p| p.into_inner());
        pending.total = pending.total.saturating_sub(1);
        if let Some(count) = pending.by_addr.get_mut(&self.addr) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                pending.by_addr.remove(&self.addr);
            }
        }
    }
}

impl Gate {
    /// A place for a handshake from `addr`, or why there is none.
    fn enter(&self, addr: IpAddr) -> Result<PendingSlot, String> {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let from_addr = pending.by_addr.get(&addr).copied().unwrap_or(0);
        if from_addr >= MAX_PENDING_PER_ADDR {
            return Err(format!(
                "{from_addr} handshakes from this address in flight already"
            ));
        }
        if pending.total >= MAX_PENDING {
            return Err(format!("{MAX_PENDING} handshakes in flight already"));
        }
        pending.total += 1;
        *pending.by_addr.entry(addr).or_default() += 1;
        Ok(PendingSlot {
            gate: self.clone(),
            addr,
        })
    }

    /// Logs the refusal of `peer` (at most once per [`REFUSAL_LOG_EVERY`] per
    /// address, counting the others).
    fn refused(&self, peer: SocketAddr, why: &str) {
        let mut logged = self.logged.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let recent = |at: &Option<Instant>| at.is_some_and(|at| now - at < REFUSAL_LOG_EVERY);
        if logged.len() > 4096 {
            logged.retain(|_, (at, _)| recent(at));
        }
        let (at, unlogged) = logged.entry(peer.ip()).or_insert((None, 0));
        if recent(at) {
            *unlogged += 1;
            return;
        }
        let others = match *unlogged {
            0 => String::new(),
            n => format!(
                " ({n} more refused from {} since the last report)",
                peer.ip()
            ),
        };
        tracing::warn!("refused a control connection from {peer}: {why}{others}");
        (*at, *unlogged) = (Some(now), 0);
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>, gate: Gate) {
    for stream in listener.incoming().flatten() {
        let Ok(peer) = stream.peer_addr() else {
            continue;
        };
        let slot = match gate.enter(peer.ip()) {
            Ok(slot) => slot,
            Err(why) => {
                gate.refused(peer, &why);
                continue;
            }
        };
        let (shared, gate) = (shared.clone(), gate.clone());
        let spawned = std::thread::Builder::new()
            .name("peer-link".into())
            .spawn(move || admit(stream, peer, slot, &gate, &shared));
        if let Err(e) = spawned {
            tracing::warn!("no thread for a control connection from {peer}: {e}");
        }
    }
}

/// Node 0: the handshake of one connection (holding its place at the gate), then
/// its lines until it closes.
fn admit(stream: TcpStream, peer: SocketAddr, slot: PendingSlot, gate: &Gate, shared: &Shared) {
    let nnodes = gate.nnodes;
    let refuse = |why: &str| gate.refused(peer, why);
    let Ok(clone) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(clone);
    let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
    let node = match auth::accept(&mut reader, &gate.secret, &gate.identity, deadline) {
        Ok(node) => node,
        Err(e) => return refuse(&e.to_string()),
    };
    drop(slot);
    if node == 0 || node >= nnodes {
        return refuse(&format!("node {node} is not among nodes 1..{nnodes}"));
    }
    if let Err(why) = may_join(shared, node) {
        return refuse(&why);
    }
    let returning = !shared.is_member(node);
    if !returning {
        tracing::info!("node {node} joined from {peer}");
    } else {
        tracing::warn!(
            "node {node} came back from {peer} (host {}): it is taken in at the next restart \
             point (its ranks' next checkpoint) at which the nodes can keep the global batch",
            shared.heard.host_of(node).as_deref().unwrap_or("unknown")
        );
    }
    let id = shared.link(node, stream);
    if let Some(members) = shared.latest_members().filter(|_| returning) {
        // It waits to be taken in: it hears the membership it is not in yet.
        shared.send_on(LinkEnd { node, id }, &members);
    }
    read_lines(reader, LinkEnd { node, id }, shared, true);
}

/// Whether node `node` may link now: not while it is linked already, nor, once
/// it left, while it is still a member (it comes back only after node 0 went on
/// without it, under `--min-nodes`).
fn may_join(shared: &Shared, node: u32) -> std::result::Result<(), String> {
    if shared.linked().contains(&node) {
        return Err(format!(
            "node {node} is linked already (a member of the job): a second launcher of it is \
             refused"
        ));
    }
    if !shared.has_left(node) {
        return Ok(());
    }
    if !shared.elastic {
        return Err(format!(
            "node {node} left the job, which ends: a node comes back only under --min-nodes"
        ));
    }
    if shared.is_member(node) {
        return Err(format!(
            "node {node} left the job and node 0 has not yet gone on without it: it can come \
             back once the job has (try again)"
        ));
    }
    Ok(())
}

/// The node at the other end of a link, and the link's id.
#[derive(Debug, Clone, Copy)]
struct LinkEnd {
    node: u32,
    id: u64,
}

/// Reads a link until it closes, noting when it was last heard; `forward` (node
/// 0) passes each line but beats on to the other nodes. A link that closes
/// without `DONE` or `QUIT` (and was not found lost) is that node's launcher going
/// away: under elastic membership node 0 takes it as lost (the job may go on
/// without it, and it may come back).
fn read_lines(reader: BufReader<TcpStream>, link: LinkEnd, shared: &Shared, forward: bool) {
    let from = link.node;
    let mut ended = false;
    for line in reader.lines() {
        let Ok(line) = line else { break };
        shared.heard.now(from);
        let Some(message) = PeerEvent::parse(&line) else {
            tracing::warn!("node {from} said something unknown: {line:?}");
            continue;
        };
        if let PeerEvent::Quit { node, .. } | PeerEvent::Done { node, .. } = &message {
            ended |= *node == from;
        }
        let beat = matches!(message, PeerEvent::Beat { .. });
        shared.push(message.clone());
        if forward && !beat {
            shared.send(&message, Some(from));
        }
    }
    shared.unlink(from, Some(link.id));
    if !ended && !shared.has_left(from) {
        let message = match (forward && shared.elastic, shared.heard.host_of(from)) {
            (true, host) => {
                let cause = format!(
                    "node {from} (host {}): its launcher went away (link closed): lost",
                    host.as_deref().unwrap_or("unknown")
                );
                tracing::error!("{cause}");
                PeerEvent::Lost { node: from, cause }
            }
            (false, _) => PeerEvent::Quit {
                node: from,
                cause: format!("the launcher of node {from} went away"),
            },
        };
        shared.push(message.clone());
        if forward {
            shared.send(&message, Some(from));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::auth::AuthError;
    use super::*;

    fn control_file(run_dir: &Path) -> PathBuf {
        vrtspike_contract::rundir::RunLayout::new(run_dir).control_file()
    }

    fn spec(node_rank: u32, run_dir: &Path) -> LinkSpec {
        LinkSpec {
            node_rank,
            nnodes: 3,
            master_addr: "127.0.0.1".into(),
            port: None,
            control_file: control_file(run_dir),
            secret: None,
            timeout: Duration::from_secs(10),
            silence: Duration::from_secs(30),
            run_dir: run_dir.to_path_buf(),
            elastic: false,
            identity: auth::Identity::of(b"TRAIN: {}"),
        }
    }

    fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn nodes_join_through_the_control_file_and_hear_each_other_through_node_0() {
        let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let node0 = PeerLinks::start(&spec(0, tmp.path())).unwrap_or_else(|e| panic!("{e:#}"));
        let control = Control::read(&control_file(tmp.path())).unwrap_or_else(|e| panic!("{e:#}"));
        assert!(
            control.port > 0 && control.secret.len() == 64,
            "{control:?}"
        );
        let node1 = PeerLinks::start(&spec(1, tmp.path())).unwrap_or_else(|e| panic!("{e:#}"));
        let node2 = PeerLinks::start(&spec(2, tmp.path())).unwrap_or_else(|e| panic!("{e:#}"));
        node0
            .wait_for_nodes(Duration::from_secs(10), &|| false)
            .unwrap_or_else(|e| panic!("{e:#}"));

        node0.announce_start(0, 40123);
        let start = node2.wait_start(0, Duration::from_secs(10), &|| false);
        let port = start.ok().flatten().map(|s| (s.attempt, s.port));
        assert_eq!(port, Some((0, 40123)));

        node1.report_failure(0, "rank 2 exited with code 3", false);
        let expected = PeerEvent::Fail {
            attempt: 0,
            node: 1,
            hung: false,
            cause: "rank 2 exited with code 3".into(),
        };
        for links in [&node0, &node2] {
            wait_for("the failure", || links.stop_reason(0).is_some());
            assert_eq!(links.stop_reason(0), Some(expected.clone()));
        }
        // The sender does not hear its own failure back, and attempt 1 is untouched.
        assert_eq!(node1.stop_reason(0), None);
        assert_eq!(node2.stop_reason(1), None);

        // Node 2 ends normally, then node 1's launcher vanishes.
        node2.report_end(Ok(NormalEnd::Preempted));
        wait_for("node 2's end", || node0.ended(2));
        assert_eq!(node0.ended_nodes(), [2]);
        assert_eq!(node0.ended_how(2), Some(NormalEnd::Preempted));
        assert_eq!(node0.ended_how(1), None);
        if let Ok(links) = node1.shared.links.lock() {
            for link in links.iter() {
                let _ = link.stream.shutdown(std::net::Shutdown::Both);
            }
        }
        wait_for("node 1's departure", || node0.quit().is_some());
        match node0.quit() {
            Some(PeerEvent::Quit { node: 1, cause }) => {
                assert!(cause.contains("went away"), "{cause}")
            }
            other => panic!("node 0 saw {other:?}"),
        }
    }

    #[test]
    fn a_silent_node_is_named_lost_on_every_node_and_a_beating_one_is_not() {
        let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let silence = Duration::from_millis(800);
        let quick = |node| LinkSpec {
            silence,
            ..spec(node, tmp.path())
        };
        let node0 = PeerLinks::start(&quick(0)).unwrap_or_else(|e| panic!("{e:#}"));
        let node2 = PeerLinks::start(&quick(2)).unwrap_or_else(|e| panic!("{e:#}"));
        // Node 1: a launcher that joins, says its host once and goes silent (its
        // link stays open, as a cut link or a stopped process leaves it).
        let (mut quiet, mut reader) = raw_join(tmp.path(), 1).unwrap_or_else(|e| panic!("{e}"));
        let beat = PeerEvent::Beat {
            node: 1,
            host: "vn2".into(),
        };
        quiet
            .write_all(beat.line().as_bytes())
            .unwrap_or_else(|e| panic!("{e}"));
        let joined = Instant::now();
        node0
            .wait_for_nodes(Duration::from_secs(10), &|| false)
            .unwrap_or_else(|e| panic!("{e:#}"));
        // Both real launchers stay alive for several silences.
        std::thread::sleep(silence / 2);
        assert!(node0.quit().is_none(), "{:?}", node0.quit());
        wait_for("node 1's loss", || node0.quit().is_some());
        let named_after = joined.elapsed();
        assert!(
            named_after >= silence && named_after < silence * 4,
            "named after {named_after:?}"
        );
        match node0.quit() {
            Some(PeerEvent::Lost { node: 1, cause }) => assert!(
                cause.starts_with("node 1 (host vn2) silent for ") && cause.ends_with(" s: lost"),
                "{cause}"
            ),
            other => panic!("node 0 saw {other:?}"),
        }
        // Node 2 hears node 0's word (not its own verdict on node 1, which it has
        // no link to), and stops its attempt for it.
        wait_for("the loss at node 2", || node2.stop_reason(0).is_some());
        assert!(matches!(
            node2.stop_reason(0),
            Some(PeerEvent::Lost { node: 1, .. })
        ));
        // Node 0 closed node 1's link: node 1 reads its end.
        let mut rest = String::new();
        quiet
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap_or_else(|e| panic!("{e}"));
        let read = std::io::Read::read_to_string(&mut reader, &mut rest);
        assert!(read.is_ok(), "the link stayed open: {read:?}");
        assert!(rest.contains("BEAT 0 "), "node 0 beat on the link: {rest}");
        // The nodes that beat are heard again; the lost one is no longer waited for.
        std::thread::sleep(silence * 2);
        let since = Instant::now();
        assert!(!node0.all_heard_since(since) && !node2.all_heard_since(since));
        wait_for("fresh beats", || {
            node0.all_heard_since(since) && node2.all_heard_since(since)
        });
        assert_eq!(node0.shared.linked(), [2]);
        let events = node0
            .shared
            .events
            .lock()
            .map(|e| e.clone())
            .unwrap_or_default();
        assert_eq!(
            events.len(),
            1,
            "one loss, no beats kept, no 'went away' after it: {events:?}"
        );
    }

    #[test]
    fn under_elastic_membership_node_0_decides_on_a_lost_node_and_the_others_follow() {
        let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let silence = Duration::from_millis(800);
        let elastic = |node| LinkSpec {
            silence,
            elastic: true,
            ..spec(node, tmp.path())
        };
        let node0 = PeerLinks::start(&elastic(0)).unwrap_or_else(|e| panic!("{e:#}"));
        let node2 = PeerLinks::start(&elastic(2)).unwrap_or_else(|e| panic!("{e:#}"));
        // Node 1 joins and goes silent.
        let (_quiet, _reader) = raw_join(tmp.path(), 1).unwrap_or_else(|e| panic!("{e}"));
        node0
            .wait_for_nodes(Duration::from_secs(10), &|| false)
            .unwrap_or_else(|e| panic!("{e:#}"));
        wait_for("the loss at node 2", || node2.stop_reason(0).is_some());
        // The loss stops the running attempt everywhere, but ends nothing by itself:
        // node 0 decides, the others wait for its word.
        for links in [&node0, &node2] {
            assert!(matches!(
                links.stop_reason(0),
                Some(PeerEvent::Lost { node: 1, .. })
            ));
            assert_eq!(links.quit(), None);
            assert!(links.elastic());
        }
        assert_eq!(node0.undecided_losses().len(), 1);
        // It is recorded beside the ranks' heartbeats.
        let lost = vrtspike_contract::heartbeat::read_lost_nodes(tmp.path())
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(lost.iter().map(|l| l.0).collect::<Vec<_>>(), [1]);
        // Node 0 goes on with nodes 0 and 2 from attempt 1.
        assert_eq!(node2.members_for(1), None);
        node0.announce_members(1, &[0, 2]);
        node0.announce_start(1, 40124);
        let start = node2.wait_start(1, Duration::from_secs(10), &|| false);
        let port = start.ok().flatten().map(|s| (s.attempt, s.port));
        assert_eq!(port, Some((1, 40124)));
        assert_eq!(node2.members_for(1), Some(vec![0, 2]));
        assert_eq!(node2.members_for(0), None, "attempt 0 had every node");
        for links in [&node0, &node2] {
            assert!(links.undecided_losses().is_empty());
            assert_eq!(links.stop_reason(1), None, "the decided loss stops no more");
        }
        // An attempt older than the membership is stopped by it.
        assert!(matches!(
            node2.stop_reason(0),
            Some(PeerEvent::Members { attempt: 1, .. })
        ));
    }

    /// Node `node` as a bare client of node 0's control link, after the handshake:
    /// the link and its reader.
    fn raw_join(run_dir: &Path, node: u32) -> Result<(TcpStream, BufReader<TcpStream>), AuthError> {
        let io = |e: &dyn std::fmt::Display| AuthError::Io(e.to_string());
        let control = Control::read(&control_file(run_dir)).map_err(|e| io(&e))?;
        let stream = TcpStream::connect(("127.0.0.1", control.port)).map_err(|e| io(&e))?;
        let mut reader = BufReader::new(stream.try_clone().map_err(|e| io(&e))?);
        let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
        let identity = spec(node, run_dir).identity;
        auth::join(&mut reader, &control.secret, node, &identity, deadline)?;
        Ok((stream, reader))
    }

    /// Node `node` as a bare client: joined (`Err`: refused), then left to go
    /// silent or be closed.
    fn bare_join(run_dir: &Path, node: u32) -> Result<TcpStream, AuthError> {
        let (stream, mut reader) = raw_join(run_dir, node)?;
        // Node 0 refuses after the handshake by closing: read what it said.
        stream
            .set_read_timeout(Some(Duration::from_millis(300)))
            .map_err(|e| AuthError::Io(e.to_string()))?;
        let mut first = String::new();
        match reader.read_line(&mut first) {
            Ok(0) => Err(AuthError::Refused("closed".into())),
            _ => Ok(stream),
        }
    }

    #[test]
    fn a_lost_node_comes_back_only_once_node_0_went_on_without_it() {
        let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let elastic = |node| LinkSpec {
            silence: Duration::from_secs(2),
            elastic: true,
            ..spec(node, tmp.path())
        };
        let node0 = PeerLinks::start(&elastic(0)).unwrap_or_else(|e| panic!("{e:#}"));
        let node2 = PeerLinks::start(&elastic(2)).unwrap_or_else(|e| panic!("{e:#}"));
        let node1 = bare_join(tmp.path(), 1).unwrap_or_else(|e| panic!("{e}"));
        node0
            .wait_for_nodes(Duration::from_secs(10), &|| false)
            .unwrap_or_else(|e| panic!("{e:#}"));
        // A second launcher of a linked node (still a member) is refused.
        assert!(
            bare_join(tmp.path(), 1).is_err(),
            "a second node 1 was linked"
        );
        // Node 1's launcher goes away: under --min-nodes node 0 takes it as lost.
        drop(node1);
        wait_for("node 1's loss", || !node0.undecided_losses().is_empty());
        assert!(matches!(
            node0.undecided_losses().first(),
            Some(PeerEvent::Lost { node: 1, cause }) if cause.contains("went away")
        ));
        assert_eq!(node0.quit(), None);
        // Lost but not left out yet: refused (it may try again).
        assert!(
            bare_join(tmp.path(), 1).is_err(),
            "joined before node 0 decided"
        );
        node0.announce_members(1, &[0, 2]);
        node0.announce_start(1, 40125);
        assert!(node0.returning().is_empty());
        // Left out: it may come back, and waits to be taken in; it hears first the
        // membership it is not in.
        let (back, mut reader) = raw_join(tmp.path(), 1).unwrap_or_else(|e| panic!("{e}"));
        let _ = back.set_read_timeout(Some(Duration::from_secs(5)));
        let mut first = String::new();
        let _ = reader.read_line(&mut first);
        assert_eq!(first, "MEMBERS 1 0,2\n");
        wait_for("node 1 back", || node0.returning() == [1]);
        assert_eq!(node0.stop_reason(1), None, "a returning node stops nothing");
        assert!(!node2.restart_asked(1));
        node0.announce_restart(1);
        wait_for("the restart point at node 2", || node2.restart_asked(1));
        // Taken in from attempt 2: its past loss is forgotten everywhere.
        node0.announce_members(2, &[0, 1, 2]);
        wait_for("the membership at node 2", || {
            node2.members_for(2).is_some()
        });
        assert!(node0.returning().is_empty());
        for links in [&node0, &node2] {
            assert_eq!(links.stop_reason(2), None);
            assert!(links.undecided_losses().is_empty());
        }
        // Lost again, it is a member's loss again.
        drop((back, reader));
        wait_for("node 1 lost again", || node0.stop_reason(2).is_some());
        assert_eq!(node0.undecided_losses().len(), 1);
    }

    #[test]
    fn a_connection_without_the_secret_is_refused_and_cannot_stop_the_job() {
        let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let node0 = PeerLinks::start(&spec(0, tmp.path())).unwrap_or_else(|e| panic!("{e:#}"));
        let control = Control::read(&control_file(tmp.path())).unwrap_or_else(|e| panic!("{e:#}"));
        // A stranger who can reach the port says QUIT without a handshake.
        let mut stranger =
            TcpStream::connect(("127.0.0.1", control.port)).unwrap_or_else(|e| panic!("{e}"));
        let _ = stranger.write_all(b"HELLO 1 abc 00\nQUIT 1 bye\nFAIL 0 1 boom\n");
        let mut rest = String::new();
        let _ = std::io::Read::read_to_string(&mut stranger, &mut rest);
        assert!(!rest.contains("WELCOME"), "{rest}");
        // Another job's launcher (another secret) is refused as well.
        let mut other = spec(1, tmp.path());
        other.port = Some(control.port);
        other.secret = Some("not-the-secret".into());
        other.timeout = Duration::from_millis(300);
        let err = PeerLinks::start(&other).err().map(|e| format!("{e:#}"));
        assert!(
            err.as_deref().is_some_and(|e| e.contains("secret")),
            "{err:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(node0.quit(), None);
        assert_eq!(node0.stop_reason(0), None);
        assert!(node0.shared.linked().is_empty());
    }

    #[test]
    fn handshakes_in_flight_are_capped_per_address_and_in_all() {
        let gate = Gate::default();
        let ip = |last: u8| IpAddr::from([10, 0, 0, last]);
        let held: Vec<PendingSlot> = (0..MAX_PENDING_PER_ADDR)
            .map(|_| gate.enter(ip(1)).unwrap_or_else(|e| panic!("{e}")))
            .collect();
        let refused = gate.enter(ip(1)).err().unwrap_or_default();
        assert!(refused.contains("from this address"), "{refused}");
        assert!(gate.enter(ip(2)).is_ok(), "another address still gets in");
        drop(held);
        let all: Vec<PendingSlot> = (0..MAX_PENDING)
            .map(|i| gate.enter(ip(10 + (i / MAX_PENDING_PER_ADDR) as u8)))
            .collect::<Result<_, _>>()
            .unwrap_or_else(|e| panic!("{e}"));
        let refused = gate.enter(ip(250)).err().unwrap_or_default();
        assert!(refused.contains("64 handshakes"), "{refused}");
        drop(all);
        assert!(gate.enter(ip(1)).is_ok(), "places come back");
    }

    #[test]
    fn node_0_listens_only_on_the_master_address() {
        let err = listen_addr("192.0.2.1", 0).err().map(|e| format!("{e:#}"));
        assert!(
            err.as_deref().is_some_and(|e| e.contains("--master-addr")),
            "{err:?}"
        );
        let listener = listen_addr("127.0.0.1", 0).unwrap_or_else(|e| panic!("{e:#}"));
        let ip = listener.local_addr().map(|a| a.ip().to_string()).ok();
        assert_eq!(ip.as_deref(), Some("127.0.0.1"));
    }
}
