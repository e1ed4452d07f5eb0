//! The job's record, and its summary: what the launcher knows about the job (the
//! node's place in it, every attempt, the first failure, the memory peaks, the
//! cache server's figures), written to `summary.json` at every exit, with the
//! ending reported and where to look at the run.

use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Result;

use super::membership::Membership;
use crate::args::Args;
use crate::peers::{NormalEnd, PeerLinks};
use crate::pss;
use crate::rundir::RunDir;
use crate::summary::{AttemptRecord, ExitKind, Failure, MembershipChange, Summary};

/// How the job ended, with the reason it gave up restarting, if it did.
pub type Ending = (ExitKind, Option<String>);

/// What the launcher knows about the job, gathered for the summary.
pub struct JobRecord {
    pub run_dir: RunDir,
    started: Instant,
    /// Wall-clock time of the launch (rank 0's figures must be newer).
    launched: SystemTime,
    pub nnodes: u32,
    pub node_rank: u32,
    pub world_size: u32,
    pub local_world_size: u32,
    /// Every attempt so far, in order.
    pub attempts: Vec<AttemptRecord>,
    /// The failure that started the restarts (or ended the job).
    pub first_failure: Option<Failure>,
    sampler: pss::PssSampler,
    /// The cache server's figures, asked for before it was stopped.
    pub cache_stats: Option<serde_json::Value>,
    /// The nodes taking part now (all of them unless `--min-nodes` left some out).
    pub membership: Membership,
    /// Every change of the membership, in order.
    pub membership_changes: Vec<MembershipChange>,
}

impl JobRecord {
    /// The record of a job that starts now (its memory sampled from now on).
    pub fn new(run_dir: RunDir, args: &Args) -> JobRecord {
        JobRecord {
            run_dir,
            started: Instant::now(),
            launched: SystemTime::now(),
            nnodes: args.nnodes.unwrap_or(1),
            node_rank: args.node_rank.unwrap_or(0),
            world_size: 0,
            local_world_size: 0,
            attempts: Vec::new(),
            first_failure: None,
            sampler: pss::PssSampler::start(
                std::process::id(),
                Duration::from_secs_f64(args.pss_interval_s),
            ),
            cache_stats: None,
            membership: Membership::all(args.nnodes.unwrap_or(1), args.node_rank.unwrap_or(0)),
            membership_changes: Vec::new(),
        }
    }

    /// Restarts of `--max-restarts` used by attempt `attempt`: the attempts
    /// after this node's first (0, or the one a returning node was taken in at)
    /// that neither a membership change nor a restart point (an attempt before
    /// that ended `preempted`: a returning node gone again before it was taken
    /// in) started.
    pub fn restarts_used(&self, attempt: u32) -> u32 {
        restarts_used(&self.attempts, &self.membership_changes, attempt)
    }

    /// Restarts of `--max-restarts` done in all.
    pub fn restarts_done(&self) -> u32 {
        self.attempts
            .last()
            .map_or(0, |last| self.restarts_used(last.attempt))
    }

    /// Seconds since the launch.
    pub fn elapsed_s(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// Writes the summary, tells the other nodes (`peers`) how this one ends,
    /// reports the ending, and returns the exit status.
    pub fn finish(self, result: Result<Ending>, peers: Option<&PeerLinks>) -> u8 {
        let (exit, error) = match result {
            Ok((kind, why)) => {
                let error = match (&self.first_failure, kind) {
                    (Some(failure), ExitKind::Failed | ExitKind::NodeLost) => Some(match why {
                        Some(why) => format!("{} ({why})", failure.cause),
                        None => failure.cause.clone(),
                    }),
                    _ => why,
                };
                (kind, error)
            }
            Err(e) => (ExitKind::Error, Some(format!("{e:#}"))),
        };
        let summary = Summary {
            exit,
            exit_code: exit.exit_code(),
            error: error.clone(),
            failure: self.first_failure.clone(),
            restarts: self.restarts_done(),
            attempts: self.attempts,
            membership_changes: self.membership_changes,
            run_dir: self.run_dir.path.display().to_string(),
            nnodes: self.nnodes,
            node_rank: self.node_rank,
            world_size: self.world_size,
            local_world_size: self.local_world_size,
            wall_s: self.started.elapsed().as_secs_f64(),
            memory: self.sampler.peaks(),
            cache: self.cache_stats,
        };
        if let Some(peers) = peers {
            peers.report_end(NormalEnd::of(exit).ok_or(error.as_deref().unwrap_or("failed")));
        }
        let summary_path = self.run_dir.layout.launcher_summary(self.node_rank);
        let train_summary = self.run_dir.layout.train_summary();
        if let Err(e) = summary.write(&summary_path, &train_summary, self.launched) {
            tracing::error!("{e:#}");
        }
        report_ending(exit, error.as_deref(), summary.failure.as_ref());
        for line in where_to_look(&self.run_dir.path, &summary_path) {
            say(&line);
        }
        exit.exit_code()
    }
}

/// Restarts of `--max-restarts` used by attempt `attempt`, given the attempts so
/// far and the membership changes (see [`JobRecord::restarts_used`]).
fn restarts_used(attempts: &[AttemptRecord], changes: &[MembershipChange], attempt: u32) -> u32 {
    let first = attempts.first().map_or(attempt, |a| a.attempt);
    let changed = |a: u32| changes.iter().any(|c| c.attempt == a);
    let after_stop = |a: u32| {
        let before = attempts.iter().find(|r| r.attempt + 1 == a);
        before.is_some_and(|r| r.outcome == ExitKind::Preempted)
    };
    let restarts = (first + 1..=attempt).filter(|a| !changed(*a) && !after_stop(*a));
    restarts.count() as u32
}

/// Logs how the job ended; a failed job's failing log's last lines go to stderr.
fn report_ending(exit: ExitKind, error: Option<&str>, failure: Option<&Failure>) {
    match (error, failure) {
        (Some(error), Some(failure)) if matches!(exit, ExitKind::Failed | ExitKind::NodeLost) => {
            match exit {
                ExitKind::NodeLost => tracing::error!("job stopped, a node lost: {error}"),
                _ => tracing::error!("job failed: {error}"),
            }
            if !failure.log.is_empty() {
                let mut report = format!(
                    "--- last {} lines of {} ---\n",
                    failure.log_tail.len(),
                    failure.log
                );
                for line in &failure.log_tail {
                    report.push_str(line);
                    report.push('\n');
                }
                report.push_str("---");
                eprintln!("{report}");
            }
        }
        (Some(error), _) => tracing::error!("{error}"),
        (None, _) => tracing::info!("job {}", exit.name()),
    }
}

/// Prints one line of the launcher's real output; a closed stdout (e.g. piped into
/// `head`) must not stop the launcher, so write errors are ignored.
pub fn say(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stdout().lock(), "{line}");
}

/// Where to look at the run once it ends: rank 0's TensorBoard events, the plot
/// (or how to draw it) and the summary.
fn where_to_look(run_dir: &Path, summary: &Path) -> Vec<String> {
    let mut lines = Vec::new();
    let tb = run_dir.join("tb");
    if tb.is_dir() {
        lines.push(format!(
            "tensorboard: {} (tensorboard --logdir {})",
            tb.display(),
            tb.display()
        ));
    }
    let plot = run_dir.join("plot.png");
    if plot.is_file() {
        lines.push(format!("plot: {}", plot.display()));
    } else {
        lines.push(format!("plot: vrtspike plot {}", run_dir.display()));
    }
    lines.push(format!("summary: {}", summary.display()));
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attempt(attempt: u32, outcome: ExitKind) -> AttemptRecord {
        AttemptRecord {
            attempt,
            duration_s: 1.0,
            outcome,
            resumed_from: None,
            restart_latency_s: None,
            failure: None,
            killed_after_grace: Vec::new(),
        }
    }

    fn change_at(attempt: u32) -> MembershipChange {
        MembershipChange {
            at_s: 1.0,
            attempt,
            resumed_step: None,
            nodes_before: 2,
            nodes_after: 1,
            members: vec![0],
            lost: Vec::new(),
            rejoined: Vec::new(),
            accumulation: 2,
        }
    }

    #[test]
    fn restarts_count_only_the_attempts_the_budget_paid_for() {
        use ExitKind::{Completed, Failed, Preempted};
        // Before any attempt, and the first attempt: none.
        assert_eq!(restarts_used(&[], &[], 0), 0);
        assert_eq!(restarts_used(&[attempt(0, Completed)], &[], 0), 0);
        // Two failures, then a third attempt: two restarts.
        let failing = [attempt(0, Failed), attempt(1, Failed)];
        assert_eq!(restarts_used(&failing, &[], 2), 2);
        // A membership change starts attempt 1 (a node lost): not a restart; a
        // failure of attempt 1 then is.
        let lost = [attempt(0, Failed), attempt(1, Failed)];
        assert_eq!(restarts_used(&lost[..1], &[change_at(1)], 1), 0);
        assert_eq!(restarts_used(&lost, &[change_at(1)], 2), 1);
        // An attempt stopped at a restart point (preempted) to take a node in, and
        // the change that took it in: neither counts.
        let taken_in = [attempt(0, Failed), attempt(1, Preempted)];
        assert_eq!(restarts_used(&taken_in, &[change_at(1)], 2), 0);
        // Gone again before it was taken in: the attempt after the stop is free
        // even without a change.
        assert_eq!(restarts_used(&taken_in, &[], 2), 1);
        // A node that came back runs from the attempt it was taken in at (3): its
        // first attempt is no restart, a failure after it is.
        let back = [attempt(3, Failed)];
        assert_eq!(restarts_used(&[], &[], 3), 0);
        assert_eq!(restarts_used(&back, &[], 3), 0);
        assert_eq!(restarts_used(&back, &[], 4), 1);
    }

    #[test]
    fn the_end_report_names_what_exists() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let summary = dir.path().join("summary.json");
        let lines = where_to_look(dir.path(), &summary);
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(lines[0].starts_with("plot: vrtspike plot "), "{lines:?}");
        std::fs::create_dir(dir.path().join("tb")).unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(dir.path().join("plot.png"), b"png").unwrap_or_else(|e| panic!("{e}"));
        let lines = where_to_look(dir.path(), &summary);
        assert!(lines[0].starts_with("tensorboard: "), "{lines:?}");
        assert!(lines[1].ends_with("plot.png"), "{lines:?}");
        assert!(lines[2].ends_with("summary.json"), "{lines:?}");
    }
}
