//! Finding a hung rank (`--hang-timeout-s`): the launcher reads each rank's
//! heartbeat (the contract's `heartbeat` record: step and phase) about once a
//! second and notes when each rank last moved. A rank that has not moved for the
//! timeout while another rank got further (in data-parallel training the others
//! wait for it in the all-reduce of the same step), or the only rank of the job
//! when it has not moved for the timeout, is hung: the launcher of its node names
//! it, its phase and the others' steps, saves its node's stacks
//! ([`crate::stacks`]) and fails the attempt, which stops the gang and restarts it
//! from the last checkpoint. Other nodes' ranks count when their records are
//! visible (a shared run dir); ranks that write no heartbeat at all are not judged.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use vrtspike_contract::heartbeat::{self, Phase, Progress};

use crate::gang::LOG_TAIL_LINES;
use crate::spawn::{self, Supervised};
use crate::stacks;
use crate::summary::Failure;

/// How hangs are found in one attempt.
#[derive(Debug, Clone)]
pub struct HangCheck {
    /// A rank still for this long is hung.
    pub timeout: Duration,
    /// Where the heartbeats are and the stacks go.
    pub run_dir: PathBuf,
    /// The attempt (restart count): records of other attempts are ignored.
    pub attempt: u32,
    /// Ranks in the job (all nodes).
    pub world_size: u32,
}

impl HangCheck {
    /// The check of `--hang-timeout-s` (none when it is 0).
    pub fn new(
        timeout_s: f64,
        run_dir: PathBuf,
        attempt: u32,
        world_size: u32,
    ) -> Option<HangCheck> {
        (timeout_s > 0.0).then(|| HangCheck {
            timeout: Duration::from_secs_f64(timeout_s),
            run_dir,
            attempt,
            world_size,
        })
    }
}

/// One rank as the launcher sees it at one moment.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RankView {
    /// Global rank.
    pub rank: u32,
    /// Its last heartbeat of this attempt (`None`: none yet).
    pub progress: Option<Progress>,
    /// How long since its progress last changed (or since the attempt started).
    pub still_for: Duration,
}

/// A rank found hung, with the others as they were.
#[derive(Debug, Clone, PartialEq)]
pub struct Hang {
    /// The hung rank.
    pub rank: RankView,
    /// The other ranks (of this node, and of others whose records are visible).
    pub others: Vec<RankView>,
}

/// The hung rank among `views` of a job of `world_size` ranks, if one is (see the
/// module doc): of the ranks still for `timeout`, the one furthest behind (then
/// the longest still, then the lowest rank), when it is the job's only rank or
/// another rank got further.
pub fn find_hang(views: &[RankView], timeout: Duration, world_size: u32) -> Option<Hang> {
    if views.iter().all(|v| v.progress.is_none()) {
        return None;
    }
    let mut candidates: Vec<&RankView> = views.iter().filter(|v| v.still_for >= timeout).collect();
    candidates.sort_by(|a, b| {
        (a.progress, std::cmp::Reverse(a.still_for), a.rank).cmp(&(
            b.progress,
            std::cmp::Reverse(b.still_for),
            b.rank,
        ))
    });
    let hung = candidates.into_iter().find(|candidate| {
        world_size == 1 || views.iter().any(|v| v.progress > candidate.progress)
    })?;
    Some(Hang {
        rank: *hung,
        others: views
            .iter()
            .filter(|v| v.rank != hung.rank)
            .copied()
            .collect(),
    })
}

/// `phase forward at step 3`, or `start (no heartbeat yet)`.
fn describe(progress: Option<Progress>) -> String {
    match progress {
        Some(p) => format!("phase {} at step {}", p.phase, p.step),
        None => format!("phase {} (no heartbeat yet)", Phase::Start),
    }
}

impl Hang {
    /// The failure's cause: `hang: rank 1 in phase forward at step 3`.
    pub fn cause(&self) -> String {
        format!(
            "hang: rank {} in {}",
            self.rank.rank,
            describe(self.rank.progress)
        )
    }

    /// The launcher's report: the hung rank, how long, and where the others are.
    pub fn report(&self) -> String {
        let mut text = format!(
            "rank {} has not moved for {:.1} s, in {}",
            self.rank.rank,
            self.rank.still_for.as_secs_f64(),
            describe(self.rank.progress)
        );
        if !self.others.is_empty() {
            text.push_str("; the others:");
            for other in &self.others {
                let _ = write!(
                    text,
                    " rank {} in {} (still {:.1} s);",
                    other.rank,
                    describe(other.progress),
                    other.still_for.as_secs_f64()
                );
            }
            text.pop();
        }
        text
    }
}

/// What the launcher tracks of one rank.
#[derive(Debug, Clone, Copy)]
struct Track {
    rank: u32,
    /// Started by this launcher (another node's rank counts only once seen).
    local: bool,
    progress: Option<Progress>,
    since: Instant,
}

/// The hang watch of one attempt.
#[derive(Debug)]
pub struct HangWatch {
    check: HangCheck,
    tracks: Vec<Track>,
    /// Records older than the attempt (a run dir reused by a new launch) are stale.
    not_before_ms: u64,
    interval: Duration,
    next_read: Instant,
}

impl HangWatch {
    /// Watches the job's ranks from `now`, the start of the attempt; `local` are
    /// this node's.
    pub fn new(check: HangCheck, local: &[u32], now: Instant) -> HangWatch {
        let interval = (check.timeout / 4).clamp(Duration::from_millis(20), Duration::from_secs(1));
        let beyond = local.iter().copied().filter(|r| *r >= check.world_size);
        HangWatch {
            tracks: (0..check.world_size)
                .chain(beyond)
                .map(|rank| Track {
                    rank,
                    local: local.contains(&rank),
                    progress: None,
                    since: now,
                })
                .collect(),
            not_before_ms: heartbeat::unix_ms_now().saturating_sub(2000),
            interval,
            next_read: now,
            check,
        }
    }

    /// Notes `rank`'s progress seen at `now`.
    pub fn observe(&mut self, rank: u32, progress: Option<Progress>, now: Instant) {
        if let Some(track) = self.tracks.iter_mut().find(|t| t.rank == rank) {
            if progress.is_some() && progress != track.progress {
                track.progress = progress;
                track.since = now;
            }
        }
    }

    /// The ranks as of `now` (this node's, and others' once seen).
    pub fn views(&self, now: Instant) -> Vec<RankView> {
        self.tracks
            .iter()
            .filter(|t| t.local || t.progress.is_some())
            .map(|t| RankView {
                rank: t.rank,
                progress: t.progress,
                still_for: now.saturating_duration_since(t.since),
            })
            .collect()
    }

    /// Reads the heartbeats when due and returns a hung rank, if there is one.
    pub fn poll(&mut self, now: Instant) -> Option<Hang> {
        if now < self.next_read {
            return None;
        }
        self.next_read = now + self.interval;
        let ranks: Vec<u32> = self.tracks.iter().map(|t| t.rank).collect();
        for rank in ranks {
            let progress = match heartbeat::read(&self.check.run_dir, rank) {
                Ok(Some(beat))
                    if beat.attempt == self.check.attempt && beat.unix_ms >= self.not_before_ms =>
                {
                    Some(beat.progress)
                }
                Ok(_) => None,
                Err(e) => {
                    tracing::debug!("{e}");
                    None
                }
            };
            self.observe(rank, progress, now);
        }
        let hang = find_hang(&self.views(now), self.check.timeout, self.check.world_size)?;
        let local = self
            .tracks
            .iter()
            .any(|t| t.local && t.rank == hang.rank.rank);
        if !local {
            // Its own node's launcher names it and stops the job.
            tracing::debug!("another node's {}", hang.cause());
            return None;
        }
        Some(hang)
    }

    /// Reports `hang`, saves every rank's stacks, and returns the failure.
    pub fn fail(&self, hang: &Hang, ranks: &[(u32, Supervised)], node: u32) -> Failure {
        tracing::error!(
            "hang: {} (--hang-timeout-s {:.0})",
            hang.report(),
            self.check.timeout.as_secs_f64()
        );
        let pids: Vec<(u32, u32)> = ranks.iter().map(|(rank, c)| (*rank, c.pid())).collect();
        let saved = stacks::save_all(&self.check.run_dir, self.check.attempt, &pids);
        tracing::error!("stacks of the ranks: {}", saved.join(", "));
        let (pid, log, log_offset) = ranks
            .iter()
            .find(|(rank, _)| *rank == hang.rank.rank)
            .map_or((0, PathBuf::new(), 0), |(_, c)| {
                (c.pid(), c.log.clone(), c.log_offset)
            });
        Failure {
            node,
            rank: Some(hang.rank.rank),
            process: format!("rank {}", hang.rank.rank),
            pid,
            exit_code: None,
            signal: None,
            cause: hang.cause(),
            log: log.display().to_string(),
            log_tail: spawn::log_tail(&log, log_offset, LOG_TAIL_LINES),
            class: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(10);

    fn at(step: u64, phase: Phase) -> Option<Progress> {
        Some(Progress { step, phase })
    }

    fn view(rank: u32, progress: Option<Progress>, still_s: u64) -> RankView {
        RankView {
            rank,
            progress,
            still_for: Duration::from_secs(still_s),
        }
    }

    #[test]
    fn the_rank_behind_the_others_is_named() {
        // Rank 1 sleeps in its forward pass; rank 0 waits in the all-reduce.
        let views = [
            view(0, at(3, Phase::AllReduce), 11),
            view(1, at(3, Phase::Forward), 12),
        ];
        let hang = find_hang(&views, T, 2).unwrap_or_else(|| panic!("no hang found"));
        assert_eq!(hang.rank.rank, 1);
        assert_eq!(hang.cause(), "hang: rank 1 in phase forward at step 3");
        assert_eq!(hang.others, [views[0]]);
        let report = hang.report();
        assert!(
            report.contains("rank 0 in phase allreduce at step 3"),
            "{report}"
        );
    }

    #[test]
    fn nothing_before_the_timeout() {
        let views = [
            view(0, at(3, Phase::AllReduce), 9),
            view(1, at(3, Phase::Forward), 9),
        ];
        assert_eq!(find_hang(&views, T, 2), None);
        // The rank ahead being still does not make it the hung one.
        let views = [
            view(0, at(3, Phase::AllReduce), 30),
            view(1, at(3, Phase::Forward), 2),
        ];
        assert_eq!(find_hang(&views, T, 2), None);
    }

    #[test]
    fn ranks_together_in_a_long_phase_are_not_hung() {
        // A long validation on every rank: nobody got further.
        let views = [
            view(0, at(50, Phase::Validation), 40),
            view(1, at(50, Phase::Validation), 40),
        ];
        assert_eq!(find_hang(&views, T, 2), None);
    }

    #[test]
    fn the_only_rank_of_a_job_is_hung_when_still_for_the_timeout() {
        assert_eq!(find_hang(&[view(0, at(8, Phase::Data), 9)], T, 1), None);
        // The only rank of its node in a bigger job may be waiting for another node.
        assert_eq!(
            find_hang(&[view(3, at(8, Phase::AllReduce), 60)], T, 4),
            None
        );
        let hang = find_hang(&[view(0, at(8, Phase::Data), 10)], T, 1);
        assert_eq!(
            hang.map(|h| h.cause()).as_deref(),
            Some("hang: rank 0 in phase data at step 8")
        );
    }

    #[test]
    fn a_rank_without_heartbeat_is_judged_only_beside_ranks_with_one() {
        // No heartbeats at all: a program that writes none (not judged).
        assert_eq!(
            find_hang(&[view(0, None, 99), view(1, None, 99)], T, 2),
            None
        );
        let views = [view(0, at(0, Phase::Start), 20), view(1, None, 20)];
        let hang = find_hang(&views, T, 2).unwrap_or_else(|| panic!("no hang found"));
        assert_eq!(hang.rank.rank, 1);
        assert!(
            hang.cause().contains("no heartbeat yet"),
            "{}",
            hang.cause()
        );
    }

    #[test]
    fn of_several_behind_the_furthest_behind_is_named() {
        let views = [
            view(0, at(7, Phase::AllReduce), 20),
            view(1, at(7, Phase::Backward), 20),
            view(2, at(7, Phase::Data), 15),
            view(3, at(7, Phase::AllReduce), 20),
        ];
        let hang = find_hang(&views, T, 4).map(|h| h.rank.rank);
        assert_eq!(hang, Some(2));
    }

    #[test]
    fn the_watch_times_stillness_from_the_last_change() {
        let start = Instant::now();
        let check = HangCheck::new(10.0, PathBuf::from("/nonexistent"), 0, 2)
            .unwrap_or_else(|| panic!("disabled"));
        let mut watch = HangWatch::new(check, &[0, 1], start);
        let s = |secs| start + Duration::from_secs(secs);
        watch.observe(0, at(1, Phase::Data), s(1));
        watch.observe(1, at(1, Phase::Data), s(1));
        watch.observe(0, at(1, Phase::AllReduce), s(2));
        watch.observe(1, at(1, Phase::Forward), s(2));
        watch.observe(1, at(1, Phase::Forward), s(5)); // unchanged: still since 2
        watch.observe(1, None, s(6)); // an unreadable record changes nothing
        assert_eq!(find_hang(&watch.views(s(11)), T, 2), None);
        let hang = find_hang(&watch.views(s(12)), T, 2).map(|h| h.rank);
        assert_eq!(hang, Some(view(1, at(1, Phase::Forward), 10)));
        assert!(
            HangCheck::new(0.0, PathBuf::new(), 0, 2).is_none(),
            "0 disables"
        );
    }

    #[test]
    fn other_nodes_ranks_count_once_seen_and_are_named_by_their_own_node() {
        let start = Instant::now();
        let check = HangCheck::new(10.0, PathBuf::from("/nonexistent"), 0, 4)
            .unwrap_or_else(|| panic!("disabled"));
        // This node runs ranks 2 and 3.
        let mut watch = HangWatch::new(check, &[2, 3], start);
        let s = |secs| start + Duration::from_secs(secs);
        let ranks = |w: &HangWatch| w.views(s(1)).iter().map(|v| v.rank).collect::<Vec<_>>();
        assert_eq!(
            ranks(&watch),
            [2, 3],
            "unseen ranks of other nodes are left out"
        );
        watch.observe(0, at(4, Phase::Forward), s(1));
        assert_eq!(ranks(&watch), [0, 2, 3]);
        watch.observe(2, at(4, Phase::AllReduce), s(1));
        watch.observe(3, at(4, Phase::AllReduce), s(1));
        // Rank 0 (node 0) is behind: hung, but its own node's launcher names it.
        let hang = find_hang(&watch.views(s(12)), T, 4).map(|h| h.rank.rank);
        assert_eq!(hang, Some(0));
    }

    #[test]
    fn polling_reads_the_records_and_names_only_this_nodes_ranks() {
        let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let write = |rank: u32, progress: Option<Progress>| {
            let mut writer = heartbeat::HeartbeatWriter::create(tmp.path(), rank, 0)
                .unwrap_or_else(|e| panic!("{e}"));
            let progress = progress.unwrap_or_else(|| panic!("no progress"));
            writer.beat(progress).unwrap_or_else(|e| panic!("{e}"));
        };
        write(0, at(4, Phase::Forward));
        for rank in 1..4 {
            write(rank, at(4, Phase::AllReduce));
        }
        let start = Instant::now();
        let s = |secs| start + Duration::from_secs(secs);
        let watch_of = |local: &[u32]| {
            let check = HangCheck::new(10.0, tmp.path().to_path_buf(), 0, 4);
            HangWatch::new(check.unwrap_or_else(|| panic!("disabled")), local, start)
        };
        let mut node0 = watch_of(&[0, 1]);
        let mut node1 = watch_of(&[2, 3]);
        for watch in [&mut node0, &mut node1] {
            assert_eq!(watch.poll(s(0)), None);
            assert_eq!(
                watch.views(s(0)).len(),
                4,
                "a shared run dir shows every rank"
            );
        }
        assert_eq!(node1.poll(s(12)), None, "rank 0 is node 0's to name");
        let hang = node0.poll(s(12)).unwrap_or_else(|| panic!("no hang found"));
        assert_eq!(hang.cause(), "hang: rank 0 in phase forward at step 4");
        assert_eq!(hang.others.len(), 3);
    }
}
