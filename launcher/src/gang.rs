//! One attempt of the job: start this node's ranks, then watch them as a gang. The
//! first rank that exits non-zero or dies (or the cache server dying) stops all the
//! others (SIGTERM, grace, SIGKILL); a preemption request is passed to the ranks as
//! SIGUSR2 and they get `--preempt-timeout-s` to checkpoint and exit 0, a SIGTERM
//! the same within `--grace-s`. A rank found stopped or hung ([`crate::hang`])
//! fails the attempt like a crashed one, and so does another node's verdict (this
//! node then saves its ranks' stacks too). At a restart point node 0 asks for
//! (a returning node is taken in) the ranks are asked as on preemption to finish
//! the step under way, checkpoint and exit. A rank that fails while waiting in a
//! collective for a stopped or hung rank is reported as waiting for it, and that
//! rank as the cause. Ranks that all exit 0 after a stop request were preempted,
//! unless rank 0's summary of this attempt says they reached the end anyway (the
//! request came during the final validation or checkpoint): completed is completed.

use std::ffi::OsString;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result};
use nix::sys::signal::Signal;
use vrtspike_contract::child;
use vrtspike_contract::rundir::RunLayout;
use vrtspike_contract::summary::{RunSummary, TrainStatus};

use crate::echo::LogEcho;
use crate::hang::{self, HangCheck, HangWatch};
use crate::reattach::Keeper;
use crate::signals;
use crate::spawn::{self, ChildKind, Supervised};
use crate::summary::{ExitKind, Failure};

/// The signal a rank gets when the job is preempted.
pub const RANK_PREEMPT_SIGNAL: Signal = Signal::SIGUSR2;

/// How to start one rank.
#[derive(Debug, Clone)]
pub struct RankLaunch {
    /// Global rank.
    pub rank: u32,
    /// Program and arguments.
    pub program: PathBuf,
    /// Arguments.
    pub args: Vec<OsString>,
    /// Environment added to the launcher's.
    pub env: Vec<(String, String)>,
    /// Its log.
    pub log: PathBuf,
    /// `vrtspike` (the job's signals blocked until it counts them) or a stand-in.
    pub kind: ChildKind,
}

/// How the gang is supervised.
#[derive(Debug, Clone, Copy)]
pub struct GangSettings<'a> {
    /// This node (failures name it).
    pub node_rank: u32,
    /// SIGTERM to SIGKILL.
    pub grace: Duration,
    /// Time the ranks have to checkpoint and exit after preemption.
    pub preempt_timeout: Duration,
    /// Where the stacks go.
    pub run_dir: &'a std::path::Path,
    /// This attempt.
    pub attempt: u32,
}

/// How an attempt ended.
#[derive(Debug)]
pub struct AttemptEnd {
    /// Completed, preempted, failed or interrupted.
    pub outcome: ExitKind,
    /// The first failure, when it failed.
    pub failure: Option<Failure>,
    /// When the failure was seen (restart latency is measured from here).
    pub failed_at: Option<Instant>,
    /// Processes that needed SIGKILL after the grace period.
    pub killed_after_grace: Vec<String>,
    /// Whether the ranks had been asked to preempt before the attempt ended.
    pub preempting: bool,
    /// Whether the ranks were asked to stop at a restart point (node 0 takes a
    /// returning node in).
    pub restart_point: bool,
}

/// What the other nodes' launchers say to the gang while it runs.
#[derive(Clone, Copy)]
pub struct PeerWord<'a> {
    /// Something that stops the attempt at once (a failure elsewhere, a lost node).
    pub stop: &'a dyn Fn() -> Option<Failure>,
    /// Whether the attempt ends at a restart point (asked once).
    pub restart_point: &'a dyn Fn() -> bool,
}

/// What the ranks were asked before the attempt ended.
#[derive(Debug, Default, Clone, Copy)]
struct StopAsked {
    /// To preempt (a request of the job's, or a restart point).
    preempting: bool,
    /// To stop at a restart point.
    restart_point: bool,
}

/// The node's cache process the gang watches: the job's own server, or its
/// attach to the node-shared one.
pub struct CacheHold<'a> {
    /// The process; its end ends the attempt unless `keeper` replaces it.
    pub process: &'a mut Supervised,
    /// Node-shared: attaches again (starting a server if none runs) on its own
    /// thread when the attach ends, while the ranks go on (their loaders read from
    /// disk and connect to the new server) and the gang goes on watching them.
    pub keeper: Option<&'a Keeper>,
}

/// Starts the ranks (rank 0's log echoed to the terminal when it runs here) and
/// supervises them until they all exit, one fails, or a signal ends the attempt.
pub fn run_attempt(
    launches: &[RankLaunch],
    cache_server: Option<CacheHold<'_>>,
    timing: GangSettings,
    peers: PeerWord,
    hang: HangCheck,
) -> Result<AttemptEnd> {
    let started = SystemTime::now();
    let mut ranks: Vec<(u32, Supervised)> = Vec::with_capacity(launches.len());
    let mut echo = None;
    for launch in launches {
        if launch.rank == 0 {
            let offset = std::fs::metadata(&launch.log).map(|m| m.len()).unwrap_or(0);
            echo = Some(LogEcho::start(
                launch.log.clone(),
                offset,
                "[rank0] ".into(),
            ));
        }
        let mut command = Command::new(&launch.program);
        command.args(&launch.args).envs(launch.env.iter().cloned());
        let name = format!("rank {}", launch.rank);
        match spawn::spawn(name, &mut command, &launch.log, launch.kind) {
            Ok(child) => ranks.push((launch.rank, child)),
            Err(e) => {
                let mut started: Vec<&mut Supervised> = ranks.iter_mut().map(|(_, c)| c).collect();
                spawn::stop_all(&mut started, timing.grace);
                return Err(e).with_context(|| {
                    format!(
                        "starting rank {} ({})",
                        launch.rank,
                        launch.program.display()
                    )
                });
            }
        }
    }
    tracing::info!(
        "started ranks {}",
        ranks
            .iter()
            .map(|(rank, c)| format!("{rank} (pid {})", c.pid()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let ids: Vec<(u32, u32)> = ranks.iter().map(|(rank, c)| (*rank, c.pid())).collect();
    let hang = HangWatch::new(hang, &ids, Instant::now());
    let mut end = supervise(&mut ranks, cache_server, timing, peers, hang);
    if end.outcome == ExitKind::Preempted {
        let train_summary = RunLayout::new(timing.run_dir).train_summary();
        end.outcome = ending_after_stop(&train_summary, started);
    }
    drop(echo);
    Ok(end)
}

/// How an attempt ended whose ranks all exited 0 after a stop request (SIGUSR2 or
/// SIGTERM): `completed` when rank 0's summary written during this attempt (at or
/// after `started`) says the run reached `TRAIN.TOTAL_STEPS` (the request came too
/// late to stop anything: during the final validation or checkpoint), else
/// `preempted`. A summary from an earlier attempt, none (stand-in ranks, rank 0 on
/// another node not written yet) or one that does not read: `preempted`.
pub fn ending_after_stop(train_summary: &Path, started: SystemTime) -> ExitKind {
    let fresh = std::fs::metadata(train_summary)
        .and_then(|m| m.modified())
        .is_ok_and(|modified| modified >= started);
    if !fresh {
        return ExitKind::Preempted;
    }
    match RunSummary::read(train_summary) {
        Ok(summary) if summary.status == TrainStatus::Completed => {
            tracing::info!(
                "the ranks reached the last step ({} of {}) before the stop request could \
                 stop them: the job completed",
                summary.steps,
                summary.total_steps
            );
            ExitKind::Completed
        }
        Ok(_) => ExitKind::Preempted,
        Err(e) => {
            tracing::warn!("{e}: taking the attempt as preempted");
            ExitKind::Preempted
        }
    }
}

fn supervise(
    ranks: &mut [(u32, Supervised)],
    cache_server: Option<CacheHold<'_>>,
    timing: GangSettings,
    peers: PeerWord,
    mut hang: HangWatch,
) -> AttemptEnd {
    let mut asked = StopAsked::default();
    let keeper = cache_server.as_ref().and_then(|hold| hold.keeper);
    let mut end = watch(ranks, cache_server, timing, peers, &mut asked, &mut hang);
    // A restart point is not a preemption of the job's: a failure while the
    // ranks checkpoint for it restarts as any failure.
    end.preempting = asked.preempting && !asked.restart_point;
    end.restart_point = asked.restart_point;
    // A re-attach under way gives up with the attempt; the next one asks again.
    if let Some(keeper) = keeper {
        keeper.give_up();
    }
    end
}

/// Looks after the node's cache process: a node-shared server's attach that
/// ended is held again by the keeper in the background (the ranks read from
/// disk meanwhile), and the keeper's new hold replaces it. `Some` when the
/// process ended and nothing replaces it (the job's own server): the attempt fails.
fn cache_gone(hold: &mut CacheHold, node_rank: u32) -> Option<Failure> {
    if let Some(process) = hold.keeper.and_then(Keeper::take) {
        *hold.process = process;
    }
    let Ok(Some(status)) = hold.process.poll() else {
        return None;
    };
    let Some(keeper) = hold.keeper else {
        return Some(failure_of(node_rank, None, hold.process, status));
    };
    if !keeper.busy() {
        tracing::warn!(
            "the node-shared cache server went away (its attach {}): attaching again, or \
             starting one, in the background; the ranks read from disk meanwhile",
            spawn::describe(status)
        );
        keeper.ask();
    }
    None
}

/// When the ranks must be done after a stop request, and how the attempt ends
/// if they are not.
#[derive(Debug, Clone, Copy)]
struct StopDeadline {
    at: Instant,
    /// SIGTERM (within `--grace-s`) rather than a preemption request.
    terminated: bool,
}

/// Asks the ranks to stop in order when a preemption request (`--preempt-timeout-s`)
/// or a SIGTERM (`--grace-s`) arrived; returns the earliest deadline so far.
fn ask_to_stop(
    ranks: &mut [(u32, Supervised)],
    timing: &GangSettings,
    deadline: Option<StopDeadline>,
) -> Option<StopDeadline> {
    let now = Instant::now();
    let mut asked = Vec::new();
    if signals::preempt_requests() > 0 {
        asked.push(StopDeadline {
            at: now + timing.preempt_timeout,
            terminated: false,
        });
    }
    if signals::terminate_requests() > 0 {
        asked.push(StopDeadline {
            at: now + timing.grace,
            terminated: true,
        });
    }
    let new = asked
        .into_iter()
        .filter(|a| deadline.is_none_or(|d| d.terminated != a.terminated && a.at < d.at))
        .min_by_key(|a| a.at)?;
    let why = if new.terminated {
        "SIGTERM"
    } else {
        "preemption requested"
    };
    tracing::warn!(
        "{why}: asking the ranks to checkpoint and exit ({RANK_PREEMPT_SIGNAL}, up to {:.0} s)",
        new.at.saturating_duration_since(now).as_secs_f64()
    );
    for (_, rank) in ranks.iter_mut() {
        rank.signal_leader(RANK_PREEMPT_SIGNAL);
    }
    Some(new)
}

/// Asks the ranks to finish the step under way, checkpoint and exit (as on
/// preemption, within `--preempt-timeout-s`): the attempt ends at a restart point.
fn ask_restart_point(ranks: &mut [(u32, Supervised)], timing: &GangSettings) -> StopDeadline {
    tracing::info!(
        "restart point: asking the ranks to checkpoint after the step under way and exit \
         ({RANK_PREEMPT_SIGNAL}, up to {:.0} s), to take a returning node in",
        timing.preempt_timeout.as_secs_f64()
    );
    for (_, rank) in ranks.iter_mut() {
        rank.signal_leader(RANK_PREEMPT_SIGNAL);
    }
    StopDeadline {
        at: Instant::now() + timing.preempt_timeout,
        terminated: false,
    }
}

/// The supervision loop; notes in `stops` when the ranks got the preemption
/// signal, and whether for a restart point.
fn watch(
    ranks: &mut [(u32, Supervised)],
    mut cache_server: Option<CacheHold<'_>>,
    timing: GangSettings,
    peers: PeerWord,
    stops: &mut StopAsked,
    hang: &mut HangWatch,
) -> AttemptEnd {
    let interrupts_before = signals::interrupts();
    let mut deadline: Option<StopDeadline> = None;
    loop {
        if signals::interrupts() > interrupts_before {
            tracing::warn!("interrupted: stopping the ranks");
            return stop_gang(ranks, ExitKind::Interrupted, None, timing.grace);
        }
        if let Some(asked) = ask_to_stop(ranks, &timing, deadline) {
            deadline = Some(asked);
            stops.preempting = true;
        }
        if deadline.is_none() && (peers.restart_point)() {
            deadline = Some(ask_restart_point(ranks, &timing));
            *stops = StopAsked {
                preempting: true,
                restart_point: true,
            };
        }
        if let Some(failure) = failed_rank(ranks, &timing, hang) {
            tracing::error!("{}: stopping the other ranks", failure.cause);
            return stop_gang(ranks, ExitKind::Failed, Some(failure), timing.grace);
        }
        if let Some(failure) = cache_server
            .as_mut()
            .and_then(|hold| cache_gone(hold, timing.node_rank))
        {
            tracing::error!("{}: stopping the ranks", failure.cause);
            return stop_gang(ranks, ExitKind::Failed, Some(failure), timing.grace);
        }
        if let Some(failure) = (peers.stop)() {
            tracing::error!("{}: stopping the ranks of this node", failure.cause);
            // Another node named a stopped or hung rank: save this node's stacks too.
            if failure.stuck {
                hang::save_stacks(timing.run_dir, timing.attempt, ranks);
            }
            return stop_gang(ranks, ExitKind::Failed, Some(failure), timing.grace);
        }
        if let Some(found) = hang.poll(Instant::now()).filter(|_| deadline.is_none()) {
            let failure = hang.fail(&found, ranks, timing.node_rank);
            tracing::error!("{}: stopping the ranks", failure.cause);
            return stop_gang(ranks, ExitKind::Failed, Some(failure), timing.grace);
        }
        if ranks.iter_mut().all(|(_, c)| !c.running()) {
            let outcome = if deadline.is_some() {
                ExitKind::Preempted
            } else {
                ExitKind::Completed
            };
            return AttemptEnd {
                outcome,
                failure: None,
                failed_at: None,
                killed_after_grace: Vec::new(),
                preempting: false,
                restart_point: false,
            };
        }
        if let Some(missed) = deadline.filter(|d| Instant::now() > d.at) {
            return missed_deadline(ranks, &timing, missed);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The rank that failed (exited non-zero or died), as a failure. Of several seen
/// at once, one killed by a signal first (the others most likely failed because
/// it vanished), then the lowest. It is named as waiting for another rank when the
/// heartbeats say it was, and that rank, still running, as the cause.
fn failed_rank(
    ranks: &mut [(u32, Supervised)],
    timing: &GangSettings,
    watch: &mut HangWatch,
) -> Option<Failure> {
    let mut failed: Vec<(u32, ExitStatus)> = Vec::new();
    for (rank, child) in ranks.iter_mut() {
        match child.poll() {
            Ok(Some(status)) if !status.success() => failed.push((*rank, status)),
            Ok(_) => {}
            Err(e) => tracing::error!("waiting for rank {rank}: {e}"),
        }
    }
    let (rank, status) = failed
        .into_iter()
        .min_by_key(|(rank, status)| (status.signal().is_none(), *rank))?;
    let child = ranks.iter().find(|(r, _)| *r == rank).map(|(_, c)| c)?;
    let own = failure_of(timing.node_rank, Some(rank), child, status);
    let Some(found) = watch.culprit_of(rank, Instant::now()) else {
        return Some(own);
    };
    let culprit_exited = ranks
        .iter_mut()
        .any(|(r, c)| *r == found.rank.rank && !c.running());
    if culprit_exited {
        return Some(own);
    }
    let mut failure = watch.fail(&found, ranks, timing.node_rank);
    failure.cause = format!("{}; {} waiting for it", failure.cause, own.cause);
    Some(failure)
}

/// The ranks did not stop in time after a stop request: the attempt fails (a
/// preemption request) or is interrupted (SIGTERM).
fn missed_deadline(
    ranks: &mut [(u32, Supervised)],
    timing: &GangSettings,
    missed: StopDeadline,
) -> AttemptEnd {
    let (outcome, why, limit) = match missed.terminated {
        true => (ExitKind::Interrupted, "SIGTERM", timing.grace),
        false => (
            ExitKind::Failed,
            "the preemption request",
            timing.preempt_timeout,
        ),
    };
    let cause = format!(
        "the ranks did not checkpoint and exit within {:.0} s of {why}",
        limit.as_secs_f64()
    );
    // The job's ending reports the cause (logged once, there).
    let failure = Failure::of(timing.node_rank, "ranks".into(), cause);
    let asked = Asked {
        what: why,
        waited: limit,
    };
    let mut end = stop_ranks(ranks, outcome, Some(failure), Duration::ZERO, asked);
    if missed.terminated {
        // Stopped on request, not broken: no restart, and the summary says why.
        end.failed_at = None;
    }
    end
}

/// What the ranks were asked, and how long they had, before a SIGKILL.
struct Asked<'a> {
    what: &'a str,
    waited: Duration,
}

/// Stops every rank still running (SIGTERM, SIGKILL after `grace`) and reports
/// the attempt's end.
fn stop_gang(
    ranks: &mut [(u32, Supervised)],
    outcome: ExitKind,
    failure: Option<Failure>,
    grace: Duration,
) -> AttemptEnd {
    let asked = Asked {
        what: "SIGTERM",
        waited: grace,
    };
    stop_ranks(ranks, outcome, failure, grace, asked)
}

/// Stops every rank still running, after `asked` (a rank still running past
/// `grace` is SIGKILLed and named with what it ignored), and reports the
/// attempt's end.
fn stop_ranks(
    ranks: &mut [(u32, Supervised)],
    outcome: ExitKind,
    failure: Option<Failure>,
    grace: Duration,
    asked: Asked,
) -> AttemptEnd {
    let failed_at = failure.as_ref().map(|_| Instant::now());
    let mut running: Vec<&mut Supervised> = ranks.iter_mut().map(|(_, c)| c).collect();
    let killed_after_grace = spawn::stop_all(&mut running, grace);
    if !killed_after_grace.is_empty() {
        tracing::warn!(
            "{} ignored {} for {:.1} s and got SIGKILL",
            killed_after_grace.join(", "),
            asked.what,
            asked.waited.as_secs_f64()
        );
    }
    AttemptEnd {
        outcome,
        failure,
        failed_at,
        killed_after_grace,
        preempting: false,
        restart_point: false,
    }
}

/// The failure report of a process that ended with `status`.
pub fn failure_of(node: u32, rank: Option<u32>, child: &Supervised, status: ExitStatus) -> Failure {
    let cause = format!(
        "{} (pid {}) {}",
        child.name,
        child.pid(),
        spawn::describe(status)
    );
    Failure {
        rank,
        pid: child.pid(),
        exit_code: status.code(),
        signal: status.signal().map(spawn::signal_name),
        log: child.log.display().to_string(),
        log_tail: child::tail(&child.log, child.log_offset, child::TAIL_LINES),
        ..Failure::of(node, child.name.clone(), cause)
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime};

    use serde_json::json;

    use super::*;

    fn write_summary(dir: &Path, status: &str) -> PathBuf {
        let path = dir.join("train_summary.json");
        let text = json!({"status": status, "steps": 40, "total_steps": 40, "world_size": 2});
        let summary: RunSummary = serde_json::from_value(text).unwrap_or_else(|e| panic!("{e}"));
        summary.write(&path).unwrap_or_else(|e| panic!("{e}"));
        path
    }

    #[test]
    fn a_stop_request_that_came_after_the_last_step_leaves_the_job_completed() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let started = SystemTime::now() - Duration::from_secs(5);
        let path = write_summary(dir.path(), "completed");
        assert_eq!(ending_after_stop(&path, started), ExitKind::Completed);
        let path = write_summary(dir.path(), "preempted");
        assert_eq!(ending_after_stop(&path, started), ExitKind::Preempted);
    }

    #[test]
    fn without_a_summary_of_this_attempt_the_job_was_preempted() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let missing = dir.path().join("train_summary.json");
        assert_eq!(
            ending_after_stop(&missing, SystemTime::now()),
            ExitKind::Preempted
        );
        // An earlier attempt's `completed` (a requeued job that ran again).
        let path = write_summary(dir.path(), "completed");
        let later = SystemTime::now() + Duration::from_secs(60);
        assert_eq!(ending_after_stop(&path, later), ExitKind::Preempted);
        std::fs::write(&path, "{not json").unwrap_or_else(|e| panic!("{e}"));
        let earlier = SystemTime::now() - Duration::from_secs(60);
        assert_eq!(ending_after_stop(&path, earlier), ExitKind::Preempted);
    }
}
