//! What happens between two attempts: after one, whether the job restarts from
//! the last checkpoint (the restart policy, the other nodes' word) or ends, and
//! why; before the next, whether an ending was asked for meanwhile (a signal, a
//! node that left), and the next attempt's number, rendezvous port and nodes
//! (node 0's word on several nodes: under `--min-nodes` it may go on without a
//! lost node, and takes a node that came back in again,
//! [`membership`](super::membership)).

use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use super::attempt::{peer_failure, Attempt, AttemptPlan};
use super::membership::{AfterLoss, Membership};
use super::record::{Ending, JobRecord};
use super::setup::Supervision;
use crate::peers::{liveness, PeerEvent, PeerLinks};
use crate::restart::{Decision, FailedAttempt, RestartPolicy};
use crate::signals;
use crate::summary::{ExitKind, LostNode, MembershipChange};

/// What follows an attempt.
pub enum Next {
    End(Ending),
    /// Another attempt; the failure's time measures the restart latency.
    Restart(Option<Instant>),
}

/// An ending asked for before the next attempt starts: a signal, or another
/// node leaving the job (then its failure is the job's first, if none was).
pub fn ending_before_attempt(record: &mut JobRecord, peers: Option<&PeerLinks>) -> Option<Ending> {
    if let Some(ending) = signals::requested_ending() {
        return Some((ending, None));
    }
    let event = peers.and_then(PeerLinks::quit)?;
    Some(left_ending(record, &event))
}

/// The ending of a job that `event`'s node left, its failure kept in `record`
/// ([`note_departure`]).
fn left_ending(record: &mut JobRecord, event: &PeerEvent) -> Ending {
    note_departure(record, event);
    let why = format!("node {} left the job", peer_failure(event).node);
    (left_kind(event), Some(why))
}

/// Keeps the failure of a node that left as the job's first failure, if none
/// was; a lost node is the cause even of a failure seen before it was found
/// lost (a rank that gave up waiting on it is its victim).
fn note_departure(record: &mut JobRecord, event: &PeerEvent) {
    let mut failure = peer_failure(event);
    if !matches!(event, PeerEvent::Lost { .. }) {
        record.first_failure.get_or_insert(failure);
        return;
    }
    match record.first_failure.take() {
        Some(earlier) if earlier.node == failure.node => failure = earlier,
        Some(earlier) => {
            failure.cause = format!(
                "{}; before it was found lost: {} (its victim, not the cause)",
                failure.cause, earlier.cause
            );
        }
        None => {}
    }
    record.first_failure = Some(failure);
}

/// How the job ends when a node left it: lost (silent: the job may go on
/// without it after a requeue) or failed (its launcher gave up or went away).
fn left_kind(event: &PeerEvent) -> ExitKind {
    match event {
        PeerEvent::Lost { .. } => ExitKind::NodeLost,
        _ => ExitKind::Failed,
    }
}

/// Node 0 before a restart: waits until every other node's launcher has said
/// something since the restart was decided (a live one beats every second at
/// most; a silent one is found lost within `--peer-silence-s`), so that the gang
/// never restarts short by accident; `Some` is the ending when one left instead.
fn ending_if_a_node_is_quiet(
    peers: &PeerLinks,
    silence: Duration,
    record: &mut JobRecord,
) -> Option<Ending> {
    let since = Instant::now();
    let deadline = since + silence + liveness::beat_interval(silence) * 4;
    let mut told = false;
    while !peers.all_heard_since(since) && Instant::now() < deadline {
        if peers.quit().is_some() || signals::requested_ending().is_some() {
            break;
        }
        if !told && since.elapsed() > liveness::beat_interval(silence) * 2 {
            tracing::warn!("a node is silent: no restart until it is heard or found lost");
            told = true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    if let Some(ending) = signals::requested_ending() {
        return Some((ending, None));
    }
    let event = peers.quit()?;
    Some(left_ending(record, &event))
}

/// The next attempt's number, rendezvous port and nodes: this node's own on one
/// node; on several, node 0 picks the port, decides the membership and tells the
/// others (`MEMBERS` when it changed, then `START`), and the others wait for it.
/// `Err` is how the job ends instead (node 0 ended it, or left this node out).
pub fn next_attempt(
    ctx: Supervision,
    record: &mut JobRecord,
) -> Result<std::result::Result<AttemptPlan, Ending>> {
    let Supervision { setup, args, peers } = ctx;
    // Node 0 numbers the attempts from 0; a node that came back runs from the
    // one it was taken in at.
    let restart_count = record.attempts.last().map_or(0, |a| a.attempt + 1);
    let pick = || match setup.topology.master_port {
        Some(port) => Ok(port),
        None => free_port(),
    };
    let Some(peers) = peers else {
        return Ok(Ok(AttemptPlan {
            restart_count,
            master_port: pick()?,
            membership: record.membership.clone(),
        }));
    };
    if setup.topology.node_rank == 0 {
        let silence = Duration::from_secs_f64(args.peer_silence_s);
        if let Some(ending) = ending_if_a_node_is_quiet(peers, silence, record) {
            return Ok(Err(ending));
        }
        if let Some(ending) = decide_membership(ctx, peers, record, restart_count) {
            return Ok(Err(ending));
        }
        take_in_returning(peers, record, restart_count);
        let master_port = pick()?;
        peers.announce_start(restart_count, master_port);
        return Ok(Ok(AttemptPlan {
            restart_count,
            master_port,
            membership: record.membership.clone(),
        }));
    }
    let timeout = Duration::from_secs_f64(args.peer_timeout_s);
    let interrupted = || signals::requested_ending().is_some();
    let mut restart_count = restart_count;
    let start = loop {
        let Some(start) = peers.wait_start(restart_count, timeout, &interrupted)? else {
            return Ok(Err(ending_without_node0(peers, record)));
        };
        let members = peers.members_for(start.attempt);
        let left_out = members.is_some_and(|m| !m.contains(&record.membership.me));
        if !(left_out && record.attempts.is_empty()) {
            break start;
        }
        // Started without this node (wait_start says it waits): the next one.
        restart_count = start.attempt + 1;
    };
    let restart_count = start.attempt;
    if let Some(members) = peers.members_for(restart_count) {
        let membership = record.membership.said(members);
        if membership.node_rank().is_none() {
            let why = "node 0 went on without this node (it found it lost)";
            return Ok(Err((ExitKind::NodeLost, Some(why.into()))));
        }
        if record.attempts.is_empty() && restart_count > 0 {
            // This node came back: it was not among the members before.
            let me = record.membership.me;
            let before = membership.members.iter().copied().filter(|n| *n != me);
            record.membership = record.membership.said(before.collect());
        }
        if membership != record.membership {
            note_change(peers, record, membership, restart_count);
        }
    }
    Ok(Ok(AttemptPlan {
        restart_count,
        master_port: start.port,
        membership: record.membership.clone(),
    }))
}

/// Node 0 before an attempt, under `--min-nodes`: the nodes that came back are
/// taken in when the global batch can be kept (the others are told), else they
/// wait (logged).
fn take_in_returning(peers: &PeerLinks, record: &mut JobRecord, attempt: u32) {
    let back = peers.returning();
    if back.is_empty() {
        return;
    }
    match record.membership.with_returns(&back) {
        Ok(membership) => {
            peers.announce_members(attempt, &membership.members);
            note_change(peers, record, membership, attempt);
        }
        // They heard the membership they are not in when they linked.
        Err(why) => tracing::warn!("node(s) {back:?} came back but wait: {why}"),
    }
}

/// Node 0 before an attempt, under `--min-nodes`: the lost nodes not decided on
/// yet are left out when enough remain (the others are told), else the job ends
/// (`Some`), naming the first lost node.
fn decide_membership(
    ctx: Supervision,
    peers: &PeerLinks,
    record: &mut JobRecord,
    attempt: u32,
) -> Option<Ending> {
    let losses = peers.undecided_losses();
    let first = losses.first()?.clone();
    let lost: Vec<u32> = losses.iter().map(|e| peer_failure(e).node).collect();
    let min_nodes = ctx.args.min_nodes.unwrap_or(record.membership.first_nnodes);
    match record.membership.after_losses(&lost, min_nodes) {
        AfterLoss::End(why) => {
            tracing::error!("no membership without node(s) {lost:?}: {why}");
            let (kind, _) = left_ending(record, &first);
            Some((kind, Some(why)))
        }
        AfterLoss::GoOn(membership) => {
            peers.announce_members(attempt, &membership.members);
            note_change(peers, record, membership, attempt);
            None
        }
    }
}

/// The nodes of `nodes` that `others` lacks, with their hosts.
fn missing_from(peers: &PeerLinks, nodes: &[u32], others: &[u32]) -> Vec<LostNode> {
    nodes
        .iter()
        .filter(|node| !others.contains(node))
        .map(|&node| LostNode {
            node,
            host: peers.host_of(node),
        })
        .collect()
}

/// `node 1 (host vn2), node 3 (host vn4)`.
fn node_names(nodes: &[LostNode]) -> String {
    let names: Vec<String> = nodes
        .iter()
        .map(|l| {
            format!(
                "node {} (host {})",
                l.node,
                l.host.as_deref().unwrap_or("unknown")
            )
        })
        .collect();
    names.join(", ")
}

/// Keeps a change of the membership in `record` (its summary lists it) and logs it.
fn note_change(peers: &PeerLinks, record: &mut JobRecord, next: Membership, attempt: u32) {
    let before = &record.membership.members;
    let lost = missing_from(peers, before, &next.members);
    let rejoined = missing_from(peers, &next.members, before);
    let resumed_step = record.run_dir.latest_checkpoint().map(|c| c.step);
    let change = MembershipChange {
        at_s: record.elapsed_s(),
        attempt,
        resumed_step,
        nodes_before: record.membership.nnodes(),
        nodes_after: next.nnodes(),
        members: next.members.clone(),
        lost,
        rejoined,
        accumulation: next.accumulation(),
    };
    let what = match (change.lost.is_empty(), change.rejoined.is_empty()) {
        (false, true) => format!(
            "{} of {} nodes go on without {}",
            change.nodes_after,
            change.nodes_before,
            node_names(&change.lost)
        ),
        (true, false) => format!(
            "{} rejoined: {} of {} nodes",
            node_names(&change.rejoined),
            change.nodes_after,
            record.membership.first_nnodes
        ),
        _ => format!(
            "{} nodes without {}, with {} back",
            change.nodes_after,
            node_names(&change.lost),
            node_names(&change.rejoined)
        ),
    };
    tracing::warn!(
        "membership change: {what} (--min-nodes): attempt {attempt} resumes from {} with nodes \
         {:?} renumbered 0..{}, gradient accumulation x{} to keep the global batch; not counted \
         against --max-restarts",
        resumed_step.map_or("the start (no checkpoint yet)".to_string(), |s| format!(
            "the checkpoint of step {s}"
        )),
        change.members,
        change.nodes_after,
        change.accumulation
    );
    record.membership = next;
    record.membership_changes.push(change);
}

/// How this node ends when node 0 starts no next attempt.
fn ending_without_node0(peers: &PeerLinks, record: &mut JobRecord) -> Ending {
    if let Some(ending) = signals::requested_ending() {
        return (ending, None);
    }
    // Under --min-nodes, node 0 ended on a loss it could not go on without: that
    // loss is the cause.
    if let Some(event) = peers.undecided_losses().first().filter(|_| peers.elastic()) {
        return left_ending(record, event);
    }
    if let Some(event) = peers.quit() {
        return left_ending(record, &event);
    }
    // A node that came back and was never taken in: the job ended without it.
    if let Some(how) = peers.ended_how(0).filter(|_| record.attempts.is_empty()) {
        tracing::info!(
            "node 0 ended the job ({}) before this node was taken in: nothing ran here",
            how.name()
        );
        return (how.exit_kind(), None);
    }
    let why = "node 0 ended the job while this node's attempt failed: no restart alone";
    (ExitKind::Failed, Some(why.to_string()))
}

/// After an attempt: the job's ending, or a restart (after the policy's delay).
pub fn after_attempt(ctx: Supervision, record: &mut JobRecord, attempt: Attempt) -> Next {
    let Supervision { setup, args, peers } = ctx;
    let Attempt {
        restart_count,
        resumed_step,
        end,
    } = attempt;
    if end.outcome == ExitKind::Interrupted {
        return Next::End((end.outcome, end.failure.map(|f| f.cause)));
    }
    // Stopped at a restart point, as asked, and no ending asked for since: the
    // next attempt takes the returning node in.
    if end.restart_point
        && end.outcome == ExitKind::Preempted
        && signals::requested_ending().is_none()
    {
        tracing::info!("the ranks stopped at the restart point: the membership changes");
        return Next::Restart(None);
    }
    let Some(failure) = end.failure else {
        return Next::End((end.outcome, None));
    };
    if record.first_failure.is_none() {
        record.first_failure = Some(failure.clone());
    }
    if let Some(peers) = peers.filter(|_| failure.node == setup.topology.node_rank) {
        peers.report_failure(restart_count, &failure.cause, failure.stuck);
    }
    if let Some(event) = peers.and_then(PeerLinks::quit) {
        return Next::End(left_ending(record, &event));
    }
    if end.preempting {
        let why = "it failed while checkpointing for a preemption";
        return Next::End((ExitKind::Failed, Some(why.into())));
    }
    // A request that came while the gang was being stopped: the last
    // checkpoint is on disk, so end as asked instead of restarting.
    if let Some(ending) = signals::requested_ending() {
        return Next::End((ending, None));
    }
    // Node 0 decides for the job; the others wait for its next START.
    if peers.is_some() && setup.topology.node_rank != 0 {
        tracing::warn!("{}; waiting for node 0 to restart the job", failure.cause);
        return Next::Restart(end.failed_at);
    }
    // A lost node under --min-nodes: a membership change before the next attempt
    // (decided there), not a restart of the budget.
    if peers.is_some_and(|p| !p.undecided_losses().is_empty()) {
        tracing::warn!("{}; deciding the membership without it", failure.cause);
        return Next::Restart(end.failed_at);
    }
    let ended = peers.map(PeerLinks::ended_nodes).unwrap_or_default();
    if !ended.is_empty() {
        let why = format!("node(s) {ended:?} already ended: no restart without them");
        return Next::End((ExitKind::Failed, Some(why)));
    }
    let previous_failure = record
        .attempts
        .iter()
        .rev()
        .nth(1)
        .and_then(|a| a.failure.as_ref());
    // Progress: a checkpoint of a higher step than the attempt started from.
    let made_progress = record.run_dir.latest_checkpoint().map(|c| c.step) > resumed_step;
    let policy = RestartPolicy {
        max_restarts: args.max_restarts,
        delay: Duration::from_secs_f64(args.restart_delay_s),
    };
    match policy.decide(&FailedAttempt {
        restarts_done: record.restarts_used(restart_count),
        failure: &failure,
        made_progress,
        previous_failure,
    }) {
        Decision::GiveUp(why) => Next::End((ExitKind::Failed, Some(why))),
        Decision::Restart(delay) => {
            tracing::warn!(
                "{}; restarting in {:.1} s",
                failure.cause,
                delay.as_secs_f64()
            );
            interruptible_sleep(delay);
            Next::Restart(end.failed_at)
        }
    }
}

/// A TCP port free right now (the ranks bind it moments later).
fn free_port() -> Result<u16> {
    let listener = std::net::TcpListener::bind(("0.0.0.0", 0)).context("finding a free port")?;
    Ok(listener.local_addr().context("finding a free port")?.port())
}

/// Sleeps, waking early on a signal the loop must handle.
fn interruptible_sleep(duration: Duration) {
    let until = Instant::now() + duration;
    while Instant::now() < until && signals::requested_ending().is_none() {
        std::thread::sleep(Duration::from_millis(20));
    }
}
