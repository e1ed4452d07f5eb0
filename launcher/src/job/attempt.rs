//! One attempt of the job: the launch of every local rank (its environment, a
//! banner in its log), the gang run to the attempt's end (the hang watch, the cache
//! server held, the other nodes' word), and the attempt's record.

use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Result;
use vrtspike_contract::rundir::Checkpoint;

use super::membership::Membership;
use super::record::JobRecord;
use super::setup::{JobSetup, Supervision};
use crate::args::Args;
use crate::env_contract::{self, AttemptEnv};
use crate::gang::{self, GangSettings, RankLaunch};
use crate::hang;
use crate::peers::{PeerEvent, PeerLinks};
use crate::reattach::Keeper;
use crate::rundir::RunDir;
use crate::spawn::Supervised;
use crate::summary::{AttemptRecord, Failure};

/// The attempt to start: its number (restart count), rank 0's rendezvous port and
/// the nodes taking part.
#[derive(Debug, Clone)]
pub struct AttemptPlan {
    pub restart_count: u32,
    pub master_port: u16,
    pub membership: Membership,
}

/// One finished attempt, as the restart decision needs it.
pub struct Attempt {
    pub restart_count: u32,
    /// The step of the checkpoint it resumed from.
    pub resumed_step: Option<u64>,
    pub end: gang::AttemptEnd,
}

/// Starts the ranks of the attempt `plan` says, supervises them to its end with
/// the cache `server` held (again by `keeper`, a node-shared one that went away),
/// and adds it to `record` (the restart latency measured
/// from `last_failed_at`, when the attempt before it failed).
pub fn run(
    ctx: Supervision,
    plan: AttemptPlan,
    last_failed_at: Option<Instant>,
    record: &mut JobRecord,
    server: Option<&mut Supervised>,
    keeper: Option<&Keeper>,
) -> Result<Attempt> {
    let Supervision { setup, args, peers } = ctx;
    let restart_count = plan.restart_count;
    record.nnodes = plan.membership.nnodes();
    record.world_size = plan.membership.nnodes() * setup.ranks.per_node;
    let launches = launches(setup, args, &record.run_dir, &plan);
    let resumed_from = record.run_dir.latest_checkpoint();
    let resumed_name = resumed_from.as_ref().map(Checkpoint::name);
    for launch in &launches {
        banner(&launch.log, restart_count, resumed_name.as_deref());
    }
    if restart_count > 0 {
        let from = match &resumed_name {
            Some(name) => format!("from checkpoint {name}"),
            None => "from the start (no checkpoint yet)".to_string(),
        };
        let changed = record.membership_changes.last();
        match changed.filter(|c| c.attempt == restart_count) {
            Some(change) => tracing::info!(
                "attempt {restart_count} on {} node(s) after a membership change (no restart \
                 used), {from}",
                change.nodes_after
            ),
            None => {
                let used = record.restarts_used(restart_count);
                tracing::info!("restart {used} of {}, {from}", args.max_restarts);
            }
        }
    }
    let started = Instant::now();
    let restart_latency_s = last_failed_at.map(|at| at.elapsed().as_secs_f64());
    let local_ranks: Vec<u32> = launches.iter().map(|l| l.rank).collect();
    let peer_stop = || {
        let event = peers?.stop_reason(restart_count)?;
        Some(with_victims(peer_failure(&event), &event, &local_ranks))
    };
    let membership = plan.membership.clone();
    let node_rank = setup.topology.node_rank;
    let restart_point =
        || peers.is_some_and(|p| restart_point(p, node_rank, &membership, restart_count));
    let mut hang = hang::HangCheck::new(
        args.hang_timeout_s,
        args.stall_timeout_s,
        record.run_dir.path.clone(),
        restart_count,
        (record.world_size, record.local_world_size),
    );
    if let Some(links) = peers {
        hang = hang.with_relay(std::sync::Arc::new(links.clone()));
    }
    let timing = GangSettings {
        node_rank: setup.topology.node_rank,
        grace: Duration::from_secs_f64(args.grace_s),
        preempt_timeout: Duration::from_secs_f64(args.preempt_timeout_s),
        run_dir: &record.run_dir.path,
        attempt: restart_count,
    };
    let hold = server.map(|process| gang::CacheHold { process, keeper });
    let word = gang::PeerWord {
        stop: &peer_stop,
        restart_point: &restart_point,
    };
    let mut end = gang::run_attempt(&launches, hold, timing, word, hang)?;
    end.failure = end
        .failure
        .map(|f| f.with_rank_account(&record.run_dir.layout));
    if let Some(failure) = end.failure.as_ref().filter(|f| f.class.is_some()) {
        tracing::error!("rank failure cause: {}", failure.cause);
    }
    record.attempts.push(AttemptRecord {
        attempt: restart_count,
        duration_s: started.elapsed().as_secs_f64(),
        outcome: end.outcome,
        resumed_from: resumed_name,
        restart_latency_s,
        failure: end.failure.clone(),
        killed_after_grace: end.killed_after_grace.clone(),
    });
    Ok(Attempt {
        restart_count,
        resumed_step: resumed_from.map(|c| c.step),
        end,
    })
}

/// Whether attempt `attempt` ends at a restart point: on node 0, when a node came
/// back that `membership` can take in (the other nodes are told); on the
/// others, when node 0 said so.
fn restart_point(peers: &PeerLinks, node_rank: u32, membership: &Membership, attempt: u32) -> bool {
    if node_rank != 0 {
        return peers.restart_asked(attempt);
    }
    let back = peers.returning();
    if back.is_empty() || membership.with_returns(&back).is_err() {
        return false;
    }
    peers.announce_restart(attempt);
    true
}

/// The launch of every local rank of the attempt `plan` says.
fn launches(
    setup: &JobSetup,
    args: &Args,
    run_dir: &RunDir,
    plan: &AttemptPlan,
) -> Vec<RankLaunch> {
    let env = |name: &str| std::env::var(name).ok();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    // Renumbered by the membership (the caller checked this node takes part).
    let membership = &plan.membership;
    let topology = crate::cluster::Topology {
        nnodes: membership.nnodes(),
        node_rank: membership.node_rank().unwrap_or(setup.topology.node_rank),
        ..setup.topology.clone()
    };
    let attempt_env = AttemptEnv {
        topology: &topology,
        ranks: setup.ranks,
        master_port: plan.master_port,
        restart_count: plan.restart_count,
        max_restarts: args.max_restarts,
        cache_addr: setup.cache.enabled.then_some(setup.cache.address.as_str()),
        run_dir: &run_dir.path,
        threads_per_rank: env_contract::threads_per_rank(cores, setup.ranks.per_node),
        accumulation: membership.accumulation(),
    };
    (0..setup.ranks.per_node)
        .map(|local| {
            let rank = attempt_env.global_rank(local);
            RankLaunch {
                rank,
                program: setup.rank_program.clone(),
                args: setup.rank_args.clone(),
                env: attempt_env.vars(local, &env),
                log: run_dir.layout.rank_log(rank),
                kind: setup.rank_kind,
            }
        })
        .collect()
}

/// The failure report of something another node's launcher said.
pub fn peer_failure(event: &PeerEvent) -> Failure {
    let (node, cause, stuck) = match event {
        PeerEvent::Fail {
            node, cause, hung, ..
        } => (*node, cause.clone(), *hung),
        PeerEvent::Quit { node, cause } | PeerEvent::Lost { node, cause } => {
            (*node, cause.clone(), false)
        }
        PeerEvent::Beat { node, .. } => (*node, "is alive".to_string(), false),
        PeerEvent::Done { node, how } => (*node, format!("ended ({})", how.name()), false),
        PeerEvent::Start { .. } => (0, "started an attempt".to_string(), false),
        PeerEvent::Members { attempt, members } => (
            0,
            format!("changed the membership to nodes {members:?} from attempt {attempt}"),
            false,
        ),
        PeerEvent::View(s) => (0, format!("told how rank {} stands", s.rank), false),
        PeerEvent::Restart { attempt } => (
            0,
            format!("ended attempt {attempt} at a restart point"),
            false,
        ),
    };
    let cause = match event {
        // Its cause names the node and its host already.
        PeerEvent::Lost { .. } => cause,
        _ => format!("node {node}: {cause}"),
    };
    let failure = Failure::of(node, format!("node {node}"), cause);
    Failure { stuck, ..failure }
}

/// A lost node's failure names this node's ranks as its victims: they wait on it
/// (in a collective, for a batch), they are not the cause.
fn with_victims(mut failure: Failure, event: &PeerEvent, ranks: &[u32]) -> Failure {
    if matches!(event, PeerEvent::Lost { .. }) && !ranks.is_empty() {
        let ranks: Vec<String> = ranks.iter().map(u32::to_string).collect();
        failure.cause = format!(
            "{}; rank(s) {} here waited on it (its victims), stopped",
            failure.cause,
            ranks.join(", ")
        );
    }
    failure
}

/// Marks the start of an attempt in a rank's log.
fn banner(log: &Path, restart_count: u32, resumed_from: Option<&str>) {
    use std::io::Write;
    if let Ok((mut file, _)) = vrtspike_contract::child::open_append(log) {
        let _ = writeln!(
            file,
            "=== vrtspike-launch: attempt {restart_count} at {} UTC, checkpoint: {} ===",
            vrtspike_contract::rundir::utc_stamp(SystemTime::now()),
            resumed_from.unwrap_or("none")
        );
    }
}
