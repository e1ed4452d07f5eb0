//! Finding a stopped or hung rank (`--stall-timeout-s`, `--hang-timeout-s`): the
//! launcher reads each rank's heartbeat (the contract's `heartbeat` record: step,
//! phase, collectives entered and completed, liveness tick) about once a second
//! and notes when each rank last moved (inside the Reducer's backward, each
//! gradient bucket it launches is a move) and when its tick last changed. The verdict
//! ([`verdict`]) names the rank whose tick went stale (stopped), or the one still
//! for the hang timeout while another got further (hung: the rank that never
//! entered the collective the others wait in), with its phase, step and
//! collective; the launcher saves every rank's stacks ([`crate::stacks`]) and
//! fails the attempt, which stops the gang and restarts it from the last
//! checkpoint. Each launcher reads its own node's records only, and judges its own
//! ranks only, from its own reading of their ticks: a record on a shared file
//! system (NFS) reaches another node at writeback, about as late as a short stall
//! timeout, so a healthy remote rank would look stopped there. The other nodes'
//! ranks come from their launchers over the control link ([`Relay`]: how each
//! stands, sent about once a second) and count only to compare with: whether one
//! of this node's ranks is behind them, or whom a rank of this node that failed was
//! waiting for. A verdict goes to the other nodes (the peer links tell them, and
//! they save their own ranks' stacks). When a rank fails on its own first (its
//! collective timed out), the records say whether it was waiting for another rank:
//! that rank is named instead ([`HangWatch::culprit_of`]). Ranks that write no
//! heartbeat at all are not judged.

pub mod verdict;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vrtspike_contract::child;
use vrtspike_contract::heartbeat::{self, Beat, Collectives, Progress};

use crate::relay::{RankReport, Relay, RelayHandle};
use crate::spawn::Supervised;
use crate::stacks;
use crate::summary::Failure;
pub use verdict::{Hang, HangKind, RankView, Timeouts};

/// How hangs are found in one attempt.
#[derive(Debug, Clone)]
pub struct HangCheck {
    /// The verdict's timeouts.
    pub timeouts: Timeouts,
    /// Where the heartbeats are and the stacks go.
    pub run_dir: PathBuf,
    /// The attempt (restart count): records of other attempts are ignored.
    pub attempt: u32,
    /// Ranks in the job (all nodes).
    pub world_size: u32,
    /// Ranks on each node (a rank's node is rank / this).
    pub ranks_per_node: u32,
    /// The other nodes' ranks (a multi-node job).
    pub relay: Option<RelayHandle>,
}

impl HangCheck {
    /// The check of `--hang-timeout-s` and `--stall-timeout-s` (0 disables each
    /// verdict; the records are still read to name whom a failed rank waited for).
    pub fn new(
        hang_timeout_s: f64,
        stall_timeout_s: f64,
        run_dir: PathBuf,
        attempt: u32,
        (world_size, ranks_per_node): (u32, u32),
    ) -> HangCheck {
        let timeout = |secs: f64| (secs > 0.0).then(|| Duration::from_secs_f64(secs));
        HangCheck {
            timeouts: Timeouts {
                hang: timeout(hang_timeout_s),
                stall: timeout(stall_timeout_s),
            },
            run_dir,
            attempt,
            world_size,
            ranks_per_node: ranks_per_node.max(1),
            relay: None,
        }
    }

    /// The check, comparing this node's ranks with the other nodes' ones that
    /// `relay` tells of (and telling them of this node's).
    pub fn with_relay(mut self, relay: Arc<dyn Relay>) -> HangCheck {
        self.relay = Some(RelayHandle(relay));
        self
    }
}

/// What the launcher tracks of one of its node's ranks.
#[derive(Debug, Clone, Copy)]
struct Track {
    rank: u32,
    /// Its pid, as this launcher started it.
    pid: u32,
    /// Its last record's step, phase and collectives, and since when they hold.
    moved: Option<(Progress, Collectives)>,
    since: Instant,
    /// Its last record's (pid, tick), and since when it holds.
    tick: Option<(u32, u64)>,
    tick_since: Instant,
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
    /// Watches this node's ranks, `local` (rank, pid), from `now`, the start of
    /// the attempt.
    pub fn new(check: HangCheck, local: &[(u32, u32)], now: Instant) -> HangWatch {
        let shortest = [check.timeouts.hang, check.timeouts.stall]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(Duration::from_secs(1));
        let interval = (shortest / 4).clamp(Duration::from_millis(20), Duration::from_secs(1));
        HangWatch {
            tracks: local
                .iter()
                .map(|&(rank, pid)| Track {
                    rank,
                    pid,
                    moved: None,
                    since: now,
                    tick: None,
                    tick_since: now,
                })
                .collect(),
            not_before_ms: heartbeat::unix_ms_now().saturating_sub(2000),
            interval,
            next_read: now,
            check,
        }
    }

    /// Notes rank `rank`'s record `beat` (of this attempt) seen at `now`.
    pub fn observe(&mut self, rank: u32, beat: Option<&Beat>, now: Instant) {
        let (Some(track), Some(beat)) = (self.tracks.iter_mut().find(|t| t.rank == rank), beat)
        else {
            return;
        };
        let moved = Some((beat.progress, beat.collectives));
        if moved != track.moved {
            track.moved = moved;
            track.since = now;
        }
        let tick = Some((beat.pid, beat.tick));
        if tick != track.tick {
            track.tick = tick;
            track.tick_since = now;
        }
    }

    /// The ranks as of `now`: this node's from its own reading of their records,
    /// the other nodes' as their launchers last said (at most about a second ago).
    /// Those are not aged: a rank's progress only grows, so a late word
    /// understates how far it got, how long it has been still and how long its
    /// tick has: another node's rank is never taken for stiller or further behind
    /// than its own launcher saw it.
    pub fn views(&self, now: Instant) -> Vec<RankView> {
        let mut views: Vec<RankView> = self
            .tracks
            .iter()
            .map(|t| RankView {
                rank: t.rank,
                node: t.rank / self.check.ranks_per_node,
                progress: t.moved.map(|(p, _)| p),
                collectives: t.moved.map(|(_, c)| c).unwrap_or_default(),
                still_for: now.saturating_duration_since(t.since),
                silent_for: t.tick.map(|_| now.saturating_duration_since(t.tick_since)),
                pid: Some(t.tick.map_or(t.pid, |(pid, _)| pid)),
                state: process_state(t.pid),
                local: true,
            })
            .collect();
        let heard = self
            .check
            .relay
            .as_ref()
            .map(|relay| relay.0.heard(self.check.attempt))
            .unwrap_or_default();
        for report in heard {
            if views.iter().all(|v| v.rank != report.rank) {
                views.push(self.remote_view(&report));
            }
        }
        views.sort_by_key(|v| v.rank);
        views
    }

    /// Another node's rank as its launcher last said.
    fn remote_view(&self, report: &RankReport) -> RankView {
        RankView {
            rank: report.rank,
            node: report.rank / self.check.ranks_per_node,
            progress: report.progress,
            collectives: report.collectives,
            still_for: Duration::from_millis(report.still_ms),
            silent_for: report.silent_ms.map(Duration::from_millis),
            pid: report.pid,
            state: None,
            local: false,
        }
    }

    /// How this node's ranks stand as of `now`, for the other nodes.
    fn reports(&self, now: Instant) -> Vec<RankReport> {
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        self.views(now)
            .iter()
            .filter(|v| v.local)
            .map(|v| RankReport {
                attempt: self.check.attempt,
                rank: v.rank,
                pid: v.pid,
                progress: v.progress,
                collectives: v.collectives,
                still_ms: ms(v.still_for),
                silent_ms: v.silent_for.map(ms),
            })
            .collect()
    }

    /// Reads this node's ranks' records (never another node's: see the module
    /// doc).
    fn read_all(&mut self, now: Instant) {
        let ranks: Vec<u32> = self.tracks.iter().map(|t| t.rank).collect();
        for rank in ranks {
            let beat = match heartbeat::read(&self.check.run_dir, rank) {
                Ok(Some(beat))
                    if beat.attempt == self.check.attempt && beat.unix_ms >= self.not_before_ms =>
                {
                    Some(beat)
                }
                Ok(_) => None,
                Err(e) => {
                    tracing::debug!("{e}");
                    None
                }
            };
            self.observe(rank, beat.as_ref(), now);
        }
    }

    /// Reads the heartbeats when due (even with both verdicts off: a failed rank's
    /// culprit is judged from their history) and returns a stopped or hung rank,
    /// if any.
    pub fn poll(&mut self, now: Instant) -> Option<Hang> {
        if now < self.next_read {
            return None;
        }
        self.next_read = now + self.interval;
        self.read_all(now);
        if let Some(relay) = &self.check.relay {
            relay.0.send(&self.reports(now));
        }
        let timeouts = self.check.timeouts;
        if timeouts.hang.is_none() && timeouts.stall.is_none() {
            return None;
        }
        verdict::find_hang(&self.views(now), timeouts, self.check.world_size)
    }

    /// The rank that `failed` (exited with an error) was waiting for, if its
    /// records say so (see [`verdict::culprit_of`]).
    pub fn culprit_of(&mut self, failed: u32, now: Instant) -> Option<Hang> {
        self.read_all(now);
        let silence = self
            .check
            .timeouts
            .stall
            .map_or(verdict::SILENT, |stall| stall.min(verdict::SILENT));
        verdict::culprit_of(failed, &self.views(now), silence)
    }

    /// Reports `hang`, saves this node's ranks' stacks, and returns the failure
    /// (of this node, naming the culprit wherever it runs).
    pub fn fail(&self, hang: &Hang, ranks: &[(u32, Supervised)], node: u32) -> Failure {
        let timeout = match hang.kind {
            HangKind::Stopped => ("--stall-timeout-s", self.check.timeouts.stall),
            HangKind::Hung => ("--hang-timeout-s", self.check.timeouts.hang),
        };
        tracing::error!(
            "{}: {} ({} {:.0})",
            match hang.kind {
                HangKind::Stopped => "stopped",
                HangKind::Hung => "hang",
            },
            hang.report(),
            timeout.0,
            timeout.1.unwrap_or_default().as_secs_f64()
        );
        save_stacks(&self.check.run_dir, self.check.attempt, ranks);
        let culprit = ranks.iter().find(|(rank, _)| *rank == hang.rank.rank);
        let (pid, log, log_offset) = culprit
            .map_or((hang.rank.pid.unwrap_or(0), PathBuf::new(), 0), |(_, c)| {
                (c.pid(), c.log.clone(), c.log_offset)
            });
        Failure {
            rank: Some(hang.rank.rank),
            pid,
            log: log.display().to_string(),
            log_tail: child::tail(&log, log_offset, child::TAIL_LINES),
            stuck: true,
            ..Failure::of(node, format!("rank {}", hang.rank.rank), hang.cause())
        }
    }
}

/// Saves the stacks of this node's `ranks` for attempt `attempt` and logs where.
pub fn save_stacks(run_dir: &std::path::Path, attempt: u32, ranks: &[(u32, Supervised)]) {
    let pids: Vec<(u32, u32)> = ranks.iter().map(|(rank, c)| (*rank, c.pid())).collect();
    let saved = stacks::save_all(run_dir, attempt, &pids);
    tracing::error!("stacks of the ranks: {}", saved.join(", "));
}

/// The state letter of process `pid` (`R`, `S`, `T`, ...), from `/proc`.
fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(") ")?.1.chars().next()
}

#[cfg(test)]
mod tests {
    use vrtspike_contract::heartbeat::{CollectiveOp, HeartbeatWriter, Phase};

    use super::*;

    fn beat(step: u64, phase: Phase, tick: u64, entered: u64) -> Beat {
        Beat {
            progress: Progress { step, phase },
            unix_ms: heartbeat::unix_ms_now(),
            attempt: 0,
            pid: 7,
            tick,
            collectives: Collectives {
                entered,
                completed: entered.saturating_sub(1),
                last: Some(CollectiveOp::AllReduce),
                buckets: 0,
            },
        }
    }

    fn check(run_dir: PathBuf, world: u32) -> HangCheck {
        HangCheck::new(10.0, 5.0, run_dir, 0, (world, 2))
    }

    #[test]
    fn the_watch_times_stillness_and_silence_from_the_last_change() {
        let start = Instant::now();
        let mut watch = HangWatch::new(
            check(PathBuf::from("/nonexistent"), 2),
            &[(0, 1), (1, 2)],
            start,
        );
        let s = |secs| start + Duration::from_secs(secs);
        watch.observe(0, Some(&beat(1, Phase::AllReduce, 1, 9)), s(1));
        watch.observe(1, Some(&beat(1, Phase::Forward, 1, 8)), s(1));
        // Rank 0 waits in all_reduce #8 and ticks on; rank 1 is stopped.
        for t in 2..=6 {
            watch.observe(0, Some(&beat(1, Phase::AllReduce, t, 9)), s(t));
            watch.observe(1, Some(&beat(1, Phase::Forward, 1, 8)), s(t));
        }
        watch.observe(1, None, s(6)); // an unreadable record changes nothing
        let views = watch.views(s(6));
        assert_eq!(views[1].silent_for, Some(Duration::from_secs(5)));
        assert_eq!(views[0].silent_for, Some(Duration::ZERO));
        assert_eq!(views[1].still_for, Duration::from_secs(5));
        let hang = verdict::find_hang(&views, watch.check.timeouts, 2)
            .unwrap_or_else(|| panic!("no verdict"));
        assert_eq!((hang.kind, hang.rank.rank), (HangKind::Stopped, 1));
        let off = HangCheck::new(0.0, 0.0, PathBuf::new(), 0, (2, 2));
        assert_eq!(
            (off.timeouts.hang, off.timeouts.stall),
            (None, None),
            "0 disables both"
        );
        let mut quiet = HangWatch::new(off, &[(0, 1), (1, 2)], start);
        quiet.observe(1, Some(&beat(1, Phase::Forward, 1, 8)), s(1));
        assert_eq!(quiet.poll(s(600)), None, "no verdict when both are off");
    }

    fn write_to(dir: &std::path::Path, rank: u32, b: &Beat) {
        let writer = HeartbeatWriter::create(dir, rank).unwrap_or_else(|e| panic!("{e}"));
        writer.write(b).unwrap_or_else(|e| panic!("{e}"));
    }

    /// On NFS another node's record reaches this one at writeback (about 30 s): a
    /// healthy remote rank's tick looks stale. Node 0 must not judge it.
    #[test]
    fn another_node_s_records_in_a_shared_run_dir_are_never_judged() {
        let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        for rank in [0, 1] {
            write_to(tmp.path(), rank, &beat(4, Phase::AllReduce, 1, 5));
        }
        // Rank 2 (node 1) as a stale page of a shared file system shows it.
        write_to(tmp.path(), 2, &beat(4, Phase::Forward, 1, 4));
        let start = Instant::now();
        let s = |secs| start + Duration::from_secs(secs);
        let mut node0 =
            HangWatch::new(check(tmp.path().to_path_buf(), 4), &[(0, 1), (1, 2)], start);
        assert_eq!(node0.poll(s(0)), None);
        for rank in [0, 1] {
            write_to(tmp.path(), rank, &beat(4, Phase::AllReduce, 2, 5));
        }
        assert_eq!(node0.poll(s(6)), None, "a remote rank judged from a file");
        let seen: Vec<u32> = node0.views(s(6)).iter().map(|v| v.rank).collect();
        assert_eq!(seen, [0, 1], "only this node's records are read");
        assert_eq!(node0.culprit_of(0, s(7)), None);
    }

    /// One end of an in-memory control link between two watches.
    struct LinkEnd {
        mine: Arc<std::sync::Mutex<Vec<RankReport>>>,
        theirs: Arc<std::sync::Mutex<Vec<RankReport>>>,
    }

    impl Relay for LinkEnd {
        fn send(&self, reports: &[RankReport]) {
            let mut theirs = self.theirs.lock().unwrap_or_else(|p| p.into_inner());
            theirs.retain(|s| reports.iter().all(|n| n.rank != s.rank));
            theirs.extend_from_slice(reports);
        }
        fn heard(&self, attempt: u32) -> Vec<RankReport> {
            let mine = self.mine.lock().unwrap_or_else(|p| p.into_inner());
            mine.iter()
                .filter(|s| s.attempt == attempt)
                .copied()
                .collect()
        }
    }

    fn link() -> (Arc<dyn Relay>, Arc<dyn Relay>) {
        let (a, b) = (Arc::default(), Arc::default());
        let end = |mine: &Arc<_>, theirs: &Arc<_>| {
            Arc::new(LinkEnd {
                mine: Arc::clone(mine),
                theirs: Arc::clone(theirs),
            }) as Arc<dyn Relay>
        };
        (end(&a, &b), end(&b, &a))
    }

    /// Each node judges its own ranks from its own reading of their ticks and
    /// compares them with the others' as their launchers tell: node 1 names its
    /// stopped rank 2 with node 0's ranks waiting for it; node 0 names nobody, but
    /// knows whom its rank 0 waited for.
    #[test]
    fn each_node_names_its_own_rank_and_hears_the_others_over_the_link() {
        let (dir0, dir1) = (tempfile::tempdir(), tempfile::tempdir());
        let (dir0, dir1) = (
            dir0.unwrap_or_else(|e| panic!("{e}")),
            dir1.unwrap_or_else(|e| panic!("{e}")),
        );
        let (end0, end1) = link();
        let start = Instant::now();
        let s = |secs| start + Duration::from_secs(secs);
        let check0 = check(dir0.path().to_path_buf(), 4).with_relay(end0);
        let check1 = check(dir1.path().to_path_buf(), 4).with_relay(end1);
        let mut node0 = HangWatch::new(check0, &[(0, 1), (1, 2)], start);
        let mut node1 = HangWatch::new(check1, &[(2, 3), (3, 4)], start);
        let tick = |t: u64| {
            for rank in [0, 1] {
                write_to(dir0.path(), rank, &beat(4, Phase::AllReduce, t, 5));
            }
            write_to(dir1.path(), 3, &beat(4, Phase::AllReduce, t, 5));
        };
        write_to(dir1.path(), 2, &beat(4, Phase::Forward, 1, 4));
        tick(1);
        assert_eq!((node0.poll(s(0)), node1.poll(s(0))), (None, None));
        tick(2);
        assert_eq!(node0.poll(s(6)), None, "rank 2 is node 1's to name");
        let seen: Vec<u32> = node0.views(s(6)).iter().map(|v| v.rank).collect();
        assert_eq!(
            seen,
            [0, 1, 2, 3],
            "the other node's ranks, from its launcher"
        );
        let hang = node1
            .poll(s(6))
            .unwrap_or_else(|| panic!("node 1 named nobody"));
        assert_eq!(
            (hang.kind, hang.rank.rank, hang.rank.node),
            (HangKind::Stopped, 2, 1)
        );
        assert!(
            hang.report()
                .contains("waiting for it: rank 0 inside all_reduce #4"),
            "{}",
            hang.report()
        );
        let victim = node0.culprit_of(0, s(8)).map(|h| h.rank.rank);
        assert_eq!(victim, Some(2), "rank 0's timeout is rank 2's doing");
    }
}
