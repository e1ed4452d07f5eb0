//! One attempt of the job: start this node's ranks, then watch them as a gang. The
//! first rank that exits non-zero or dies (or the cache server dying) stops all the
//! others (SIGTERM, grace, SIGKILL); a preemption request is passed to the ranks as
//! SIGUSR2 and they get time to checkpoint and exit 0. A rank found hung
//! ([`crate::hang`]) fails the attempt like a crashed one.

use std::ffi::OsString;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Command, ExitStatus};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use nix::sys::signal::Signal;

use crate::echo::LogEcho;
use crate::hang::{HangCheck, HangWatch};
use crate::signals;
use crate::spawn::{self, Supervised};
use crate::summary::{ExitKind, Failure};

/// Lines of a failed process's log kept in the failure report.
pub const LOG_TAIL_LINES: usize = 20;

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
}

/// How the gang is supervised.
#[derive(Debug, Clone, Copy)]
pub struct GangSettings {
    /// This node (failures name it).
    pub node_rank: u32,
    /// SIGTERM to SIGKILL.
    pub grace: Duration,
    /// Time the ranks have to checkpoint and exit after preemption.
    pub preempt_timeout: Duration,
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
}

/// Starts the ranks (rank 0's log echoed to the terminal when it runs here) and
/// supervises them until they all exit, one fails, or a signal ends the attempt.
pub fn run_attempt(
    launches: &[RankLaunch],
    cache_server: Option<&mut Supervised>,
    timing: GangSettings,
    peer_stop: &dyn Fn() -> Option<Failure>,
    hang: Option<HangCheck>,
) -> Result<AttemptEnd> {
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
        match spawn::spawn(format!("rank {}", launch.rank), &mut command, &launch.log) {
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
    let hang = hang.map(|check| {
        let ids: Vec<u32> = ranks.iter().map(|(rank, _)| *rank).collect();
        HangWatch::new(check, &ids, Instant::now())
    });
    let end = supervise(&mut ranks, cache_server, timing, peer_stop, hang);
    drop(echo);
    Ok(end)
}

fn supervise(
    ranks: &mut [(u32, Supervised)],
    cache_server: Option<&mut Supervised>,
    timing: GangSettings,
    peer_stop: &dyn Fn() -> Option<Failure>,
    mut hang: Option<HangWatch>,
) -> AttemptEnd {
    let mut preempting = false;
    let mut end = watch(
        ranks,
        cache_server,
        timing,
        peer_stop,
        &mut preempting,
        hang.as_mut(),
    );
    end.preempting = preempting;
    end
}

/// The supervision loop; sets `preempting` once the ranks got the preemption signal.
fn watch(
    ranks: &mut [(u32, Supervised)],
    mut cache_server: Option<&mut Supervised>,
    timing: GangSettings,
    peer_stop: &dyn Fn() -> Option<Failure>,
    preempting: &mut bool,
    mut hang: Option<&mut HangWatch>,
) -> AttemptEnd {
    let interrupts_before = signals::interrupts();
    let mut preempt_deadline: Option<Instant> = None;
    loop {
        if signals::interrupts() > interrupts_before {
            tracing::warn!("interrupted: stopping the ranks");
            return stop_gang(ranks, ExitKind::Interrupted, None, timing.grace);
        }
        if preempt_deadline.is_none() && signals::preempt_requests() > 0 {
            tracing::warn!(
                "preemption requested: asking the ranks to checkpoint and exit ({RANK_PREEMPT_SIGNAL}, up to {:.0} s)",
                timing.preempt_timeout.as_secs_f64()
            );
            for (_, rank) in ranks.iter_mut() {
                rank.signal_leader(RANK_PREEMPT_SIGNAL);
            }
            preempt_deadline = Some(Instant::now() + timing.preempt_timeout);
            *preempting = true;
        }
        for (rank, child) in ranks.iter_mut() {
            let status = match child.poll() {
                Ok(Some(status)) => status,
                Ok(None) => continue,
                Err(e) => {
                    tracing::error!("waiting for rank {rank}: {e}");
                    continue;
                }
            };
            if !status.success() {
                let failure = failure_of(timing.node_rank, Some(*rank), child, status);
                tracing::error!("{}: stopping the other ranks", failure.cause);
                return stop_gang(ranks, ExitKind::Failed, Some(failure), timing.grace);
            }
        }
        if let Some(server) = cache_server.as_deref_mut() {
            if let Ok(Some(status)) = server.poll() {
                let failure = failure_of(timing.node_rank, None, server, status);
                tracing::error!("{}: stopping the ranks", failure.cause);
                return stop_gang(ranks, ExitKind::Failed, Some(failure), timing.grace);
            }
        }
        if let Some(failure) = peer_stop() {
            tracing::error!("{}: stopping the ranks of this node", failure.cause);
            return stop_gang(ranks, ExitKind::Failed, Some(failure), timing.grace);
        }
        if let Some(watch) = hang.as_deref_mut().filter(|_| preempt_deadline.is_none()) {
            if let Some(found) = watch.poll(Instant::now()) {
                let failure = watch.fail(&found, ranks, timing.node_rank);
                tracing::error!("{}: stopping the ranks", failure.cause);
                return stop_gang(ranks, ExitKind::Failed, Some(failure), timing.grace);
            }
        }
        if ranks.iter_mut().all(|(_, c)| !c.running()) {
            let outcome = if preempt_deadline.is_some() {
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
            };
        }
        if preempt_deadline.is_some_and(|deadline| Instant::now() > deadline) {
            let failure = Failure {
                node: timing.node_rank,
                rank: None,
                process: "ranks".into(),
                pid: 0,
                exit_code: None,
                signal: None,
                cause: format!(
                    "the ranks did not checkpoint and exit within {:.0} s of the preemption request",
                    timing.preempt_timeout.as_secs_f64()
                ),
                log: String::new(),
                log_tail: Vec::new(),
                class: None,
            };
            tracing::error!("{}", failure.cause);
            return stop_gang(ranks, ExitKind::Failed, Some(failure), timing.grace);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Stops every rank still running and reports the attempt's end.
fn stop_gang(
    ranks: &mut [(u32, Supervised)],
    outcome: ExitKind,
    failure: Option<Failure>,
    grace: Duration,
) -> AttemptEnd {
    let failed_at = failure.as_ref().map(|_| Instant::now());
    let mut running: Vec<&mut Supervised> = ranks.iter_mut().map(|(_, c)| c).collect();
    let killed_after_grace = spawn::stop_all(&mut running, grace);
    if !killed_after_grace.is_empty() {
        tracing::warn!(
            "{} ignored SIGTERM for {:.1} s and got SIGKILL",
            killed_after_grace.join(", "),
            grace.as_secs_f64()
        );
    }
    AttemptEnd {
        outcome,
        failure,
        failed_at,
        killed_after_grace,
        preempting: false,
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
        node,
        rank,
        process: child.name.clone(),
        pid: child.pid(),
        exit_code: status.code(),
        signal: status.signal().map(spawn::signal_name),
        cause,
        log: child.log.display().to_string(),
        log_tail: spawn::log_tail(&child.log, child.log_offset, LOG_TAIL_LINES),
        class: None,
    }
}
