//! Which rank stopped the job, from the ranks as the launcher sees them at one
//! moment ([`RankView`]): a rank whose liveness tick went stale is **stopped**
//! (SIGSTOP, a debugger, a wedged process: nothing of it runs); a rank that has
//! not moved (step, phase or collectives) for the hang timeout while another rank
//! got further is **hung** (alive, but stuck in a driver call, a D-state read, a
//! loop). The others are reported as waiting for it (in the collective the culprit
//! never entered or never completed), not as the cause. Inside the Reducer's
//! gradient all-reduce, which spans a whole backward pass and is entered before any
//! gradient exists, a rank that launched fewer gradient buckets is behind one that
//! launched more: a rank wedged in a backward kernel is named, not the peers that
//! wait for its buckets. Only this node's ranks are named here (see
//! [`RankView::local`]); another node's count only as a standard to compare with.

use std::fmt::Write as _;
use std::time::Duration;

use vrtspike_contract::heartbeat::{Collectives, Phase, Progress};

/// One rank as the launcher sees it at one moment.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RankView {
    /// Global rank.
    pub rank: u32,
    /// Its node.
    pub node: u32,
    /// Its last heartbeat of this attempt (`None`: none yet).
    pub progress: Option<Progress>,
    /// Its collectives (none before its process group exists).
    pub collectives: Collectives,
    /// How long since its step, phase or collectives last changed (or since the
    /// attempt started).
    pub still_for: Duration,
    /// How long since its liveness tick last changed; `None` before its first
    /// record.
    pub silent_for: Option<Duration>,
    /// The writer's pid (from its record).
    pub pid: Option<u32>,
    /// Its process state from `/proc` (`R`, `S`, `D`, `T`, ...) when it runs here.
    pub state: Option<char>,
    /// Whether it runs on this launcher's node, which judges it from its own
    /// reading of its ticks; another node's rank (as its launcher told) is only
    /// compared with, never named here.
    pub local: bool,
}

impl RankView {
    /// How far it got: its step and phase, then the collectives it entered, then
    /// the gradient buckets it launched inside the last.
    fn how_far(&self) -> (Option<Progress>, u64, u32) {
        (
            self.progress,
            self.collectives.entered,
            self.collectives.buckets,
        )
    }

    /// `phase forward at step 3, last all_reduce #127 done`, `phase backward at
    /// step 3, inside all_reduce #128, no gradient bucket launched`, or `phase
    /// start (no heartbeat yet)`.
    pub fn whereabouts(&self) -> String {
        match self.progress {
            Some(p) => {
                let in_backward = p.phase == Phase::Backward
                    && self.collectives.inside().is_some()
                    && self.collectives.buckets == 0;
                format!(
                    "phase {} at step {}, {}{}",
                    p.phase,
                    p.step,
                    self.collectives.describe(),
                    if in_backward {
                        ", no gradient bucket launched"
                    } else {
                        ""
                    }
                )
            }
            None => format!("phase {} (no heartbeat yet)", Phase::Start),
        }
    }

    /// ` (process state T, stopped)` for a rank of this node, else nothing.
    fn state_note(&self) -> String {
        match self.state {
            Some(state) => format!(" (process state {state}{})", state_name(state)),
            None => String::new(),
        }
    }
}

fn state_name(state: char) -> &'static str {
    match state {
        'T' => ", stopped",
        't' => ", stopped by a debugger",
        'D' => ", in uninterruptible I/O",
        'Z' => ", exited",
        _ => "",
    }
}

/// A rank whose tick has been still this long is called stopped, whichever rule
/// named it (and whom a failed rank waited for is judged by it, at most the stall
/// timeout): ten ticks missed.
pub const SILENT: Duration = Duration::from_secs(5);

/// What is wrong with the named rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HangKind {
    /// Its liveness tick stopped: the process does not run at all.
    Stopped,
    /// It ticks but has not moved while others got further.
    Hung,
}

/// A rank found stopped or hung, with the others as they were.
#[derive(Debug, Clone, PartialEq)]
pub struct Hang {
    /// Stopped or hung.
    pub kind: HangKind,
    /// The culprit.
    pub rank: RankView,
    /// The other ranks (of this node, and of others whose records are visible).
    pub others: Vec<RankView>,
}

/// The timeouts a verdict is made with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// A rank that has not moved for this long while another got further is hung.
    pub hang: Option<Duration>,
    /// A rank whose tick has not changed for this long is stopped.
    pub stall: Option<Duration>,
}

/// The stopped or hung rank of this node among `views` of a job of `world_size`
/// ranks, if one is (see the module doc): a stopped rank first (the longest silent,
/// then the lowest); else of this node's ranks still for the hang timeout, the one
/// furthest behind (then the longest still, then the lowest rank), when it is the
/// job's only rank or another rank (of any node) got further.
pub fn find_hang(views: &[RankView], timeouts: Timeouts, world_size: u32) -> Option<Hang> {
    let local: Vec<RankView> = views.iter().filter(|v| v.local).copied().collect();
    if let Some(stopped) = timeouts.stall.and_then(|stall| most_silent(&local, stall)) {
        return Some(Hang::of(HangKind::Stopped, stopped, views));
    }
    let timeout = timeouts.hang?;
    if views.iter().all(|v| v.progress.is_none()) {
        return None;
    }
    let mut candidates: Vec<&RankView> = local.iter().filter(|v| v.still_for >= timeout).collect();
    candidates.sort_by(|a, b| {
        (a.how_far(), std::cmp::Reverse(a.still_for), a.rank).cmp(&(
            b.how_far(),
            std::cmp::Reverse(b.still_for),
            b.rank,
        ))
    });
    let hung = candidates.into_iter().find(|candidate| {
        world_size == 1 || views.iter().any(|v| v.how_far() > candidate.how_far())
    })?;
    Some(Hang::of(kind_of(hung), hung, views))
}

/// Stopped when its tick has been still for [`SILENT`], else hung.
fn kind_of(view: &RankView) -> HangKind {
    match view.silent_for {
        Some(silent) if silent >= SILENT => HangKind::Stopped,
        _ => HangKind::Hung,
    }
}

/// The rank whose tick has been still the longest, if at least `stall`.
fn most_silent(views: &[RankView], stall: Duration) -> Option<&RankView> {
    views
        .iter()
        .filter(|v| v.silent_for.is_some_and(|s| s >= stall))
        .max_by(|a, b| {
            (a.silent_for, std::cmp::Reverse(a.rank))
                .cmp(&(b.silent_for, std::cmp::Reverse(b.rank)))
        })
}

/// Why rank `failed`, which exited with an error, did: another rank it was
/// waiting for, if the records say so. A rank that has not ticked for `silence`
/// is stopped; else a rank that never entered the collective `failed` was inside,
/// or is inside it too having launched fewer gradient buckets (and has been still
/// at least as long, and at least `silence`: a rank that has not moved since its
/// last word a moment ago is no culprit), is hung. `None`: its own failure.
pub fn culprit_of(failed: u32, views: &[RankView], silence: Duration) -> Option<Hang> {
    let victim = views.iter().find(|v| v.rank == failed)?;
    let others: Vec<RankView> = views.iter().filter(|v| v.rank != failed).copied().collect();
    if let Some(stopped) = most_silent(&others, silence) {
        return Some(Hang::of(HangKind::Stopped, stopped, views));
    }
    let waited_in = victim.collectives.inside()?;
    let behind = |v: &RankView| {
        v.collectives.entered <= waited_in
            || (v.collectives.inside() == Some(waited_in)
                && v.collectives.buckets < victim.collectives.buckets)
    };
    let laggard = others
        .iter()
        .filter(|v| behind(v) && v.still_for >= victim.still_for.max(silence))
        .min_by_key(|v| (v.how_far(), v.rank))?;
    Some(Hang::of(kind_of(laggard), laggard, views))
}

impl Hang {
    fn of(kind: HangKind, culprit: &RankView, views: &[RankView]) -> Hang {
        Hang {
            kind,
            rank: *culprit,
            others: views
                .iter()
                .filter(|v| v.rank != culprit.rank)
                .copied()
                .collect(),
        }
    }

    /// The failure's cause: `stopped: rank 1 (node 1) in phase forward at step 3,
    /// last all_reduce #127 done (no liveness tick for 10.2 s)` or `hang: rank 1
    /// in phase forward at step 3, ...`.
    pub fn cause(&self) -> String {
        let r = &self.rank;
        match self.kind {
            HangKind::Stopped => format!(
                "stopped: rank {} (node {}) in {} (no liveness tick for {:.1} s)",
                r.rank,
                r.node,
                r.whereabouts(),
                r.silent_for.unwrap_or_default().as_secs_f64()
            ),
            HangKind::Hung => format!("hang: rank {} in {}", r.rank, r.whereabouts()),
        }
    }

    /// The launcher's report: the culprit, how long, and the others, as waiting
    /// for it where they are inside a collective it has not completed.
    pub fn report(&self) -> String {
        let r = &self.rank;
        let mut text = match self.kind {
            HangKind::Stopped => format!(
                "rank {} (node {}{}) has not ticked for {:.1} s, in {}",
                r.rank,
                r.node,
                r.pid.map_or(String::new(), |p| format!(", pid {p}")),
                r.silent_for.unwrap_or_default().as_secs_f64(),
                r.whereabouts()
            ),
            HangKind::Hung => format!(
                "rank {} has not moved for {:.1} s, in {}",
                r.rank,
                r.still_for.as_secs_f64(),
                r.whereabouts()
            ),
        };
        text.push_str(&r.state_note());
        let (waiting, rest): (Vec<&RankView>, Vec<&RankView>) =
            self.others.iter().partition(|o| self.waits_for_culprit(o));
        if !waiting.is_empty() {
            text.push_str("; waiting for it:");
            for other in waiting {
                let _ = write!(
                    text,
                    " rank {} {} for {:.1} s;",
                    other.rank,
                    other.collectives.describe(),
                    other.still_for.as_secs_f64()
                );
            }
            text.pop();
        }
        if !rest.is_empty() {
            text.push_str("; the others:");
            for other in rest {
                let _ = write!(
                    text,
                    " rank {} in {} (still {:.1} s);",
                    other.rank,
                    other.whereabouts(),
                    other.still_for.as_secs_f64()
                );
            }
            text.pop();
        }
        text
    }

    /// Whether `other` sits in a collective the culprit never completed.
    fn waits_for_culprit(&self, other: &RankView) -> bool {
        other
            .collectives
            .inside()
            .is_some_and(|seq| self.rank.collectives.completed <= seq)
    }
}

#[cfg(test)]
mod tests {
    use vrtspike_contract::heartbeat::CollectiveOp;

    use super::*;

    const T: Timeouts = Timeouts {
        hang: Some(Duration::from_secs(10)),
        stall: Some(Duration::from_secs(5)),
    };

    fn at(step: u64, phase: Phase) -> Option<Progress> {
        Some(Progress { step, phase })
    }

    fn coll(entered: u64, completed: u64) -> Collectives {
        Collectives {
            entered,
            completed,
            last: Some(CollectiveOp::AllReduce),
            buckets: 0,
        }
    }

    fn buckets(mut c: Collectives, launched: u32) -> Collectives {
        c.buckets = launched;
        c
    }

    fn view(rank: u32, progress: Option<Progress>, still_s: u64) -> RankView {
        RankView {
            rank,
            node: 0,
            progress,
            collectives: Collectives::default(),
            still_for: Duration::from_secs(still_s),
            silent_for: progress.map(|_| Duration::from_millis(300)),
            pid: None,
            state: None,
            local: true,
        }
    }

    fn with(mut v: RankView, collectives: Collectives) -> RankView {
        v.collectives = collectives;
        v
    }

    fn silent(mut v: RankView, secs: u64) -> RankView {
        v.silent_for = Some(Duration::from_secs(secs));
        v
    }

    #[test]
    fn the_rank_behind_the_others_is_named() {
        // Rank 1 sleeps in its forward pass; rank 0 waits in the all-reduce.
        let views = [
            view(0, at(3, Phase::AllReduce), 11),
            view(1, at(3, Phase::Forward), 12),
        ];
        let hang = find_hang(&views, T, 2).unwrap_or_else(|| panic!("no hang found"));
        assert_eq!((hang.kind, hang.rank.rank), (HangKind::Hung, 1));
        assert_eq!(
            hang.cause(),
            "hang: rank 1 in phase forward at step 3, no collective yet"
        );
        assert_eq!(hang.others, [views[0]]);
        let report = hang.report();
        assert!(
            report.contains("rank 0 in phase allreduce at step 3"),
            "{report}"
        );
    }

    #[test]
    fn nothing_before_the_timeouts() {
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
        let views = [
            view(0, at(3, Phase::Forward), 1),
            silent(view(1, at(3, Phase::Forward), 1), 4),
        ];
        assert_eq!(find_hang(&views, T, 2), None, "a tick 4 s old is not 5");
    }

    #[test]
    fn a_stopped_rank_is_named_not_the_one_waiting_for_it_in_the_collective() {
        // Both entered all_reduce #128; rank 1 was stopped inside it, rank 0 waits.
        let waiting = with(view(0, at(5, Phase::AllReduce), 7), coll(129, 128));
        let mut stopped = with(
            silent(view(1, at(5, Phase::AllReduce), 7), 6),
            coll(129, 128),
        );
        stopped.state = Some('T');
        stopped.node = 1;
        let hang = find_hang(&[waiting, stopped], T, 2).unwrap_or_else(|| panic!("none"));
        assert_eq!((hang.kind, hang.rank.rank), (HangKind::Stopped, 1));
        assert!(
            hang.cause().starts_with(
                "stopped: rank 1 (node 1) in phase allreduce at step 5, inside all_reduce #128"
            ),
            "{}",
            hang.cause()
        );
        let report = hang.report();
        assert!(report.contains("process state T, stopped"), "{report}");
        assert!(
            report.contains("waiting for it: rank 0 inside all_reduce #128 for 7.0 s"),
            "{report}"
        );
        // Without the stall timeout nobody is further: no verdict from stillness.
        let no_stall = Timeouts { stall: None, ..T };
        assert_eq!(find_hang(&[waiting, stopped], no_stall, 2), None);
    }

    #[test]
    fn a_rank_named_by_the_hang_rule_that_does_not_tick_is_called_stopped() {
        let no_stall = Timeouts { stall: None, ..T };
        let views = [
            view(0, at(3, Phase::AllReduce), 11),
            silent(view(1, at(3, Phase::Forward), 12), 12),
        ];
        let hang = find_hang(&views, no_stall, 2).map(|h| (h.kind, h.rank.rank));
        assert_eq!(hang, Some((HangKind::Stopped, 1)));
    }

    #[test]
    fn a_rank_that_never_entered_the_collective_is_behind() {
        let waiting = with(view(0, at(5, Phase::AllReduce), 12), coll(129, 128));
        let stuck = with(view(1, at(5, Phase::AllReduce), 12), coll(128, 128));
        let hang = find_hang(&[waiting, stuck], T, 2).unwrap_or_else(|| panic!("none"));
        assert_eq!((hang.kind, hang.rank.rank), (HangKind::Hung, 1));
        assert!(
            hang.cause().contains("last all_reduce #127 done"),
            "{}",
            hang.cause()
        );
    }

    /// The Reducer's backward is one collective, entered before any gradient: a
    /// rank wedged in a backward kernel (still ticking) and its peer waiting for
    /// its buckets are in the same collective, the same phase; the buckets each
    /// launched tell them apart.
    #[test]
    fn a_rank_wedged_inside_backward_is_named_not_its_peer() {
        let waiting = with(
            view(0, at(5, Phase::Backward), 12),
            buckets(coll(129, 128), 4),
        );
        let mut wedged = with(
            view(1, at(5, Phase::Backward), 13),
            buckets(coll(129, 128), 1),
        );
        let hang = find_hang(&[waiting, wedged], T, 2).unwrap_or_else(|| panic!("none"));
        assert_eq!((hang.kind, hang.rank.rank), (HangKind::Hung, 1));
        assert_eq!(
            hang.cause(),
            "hang: rank 1 in phase backward at step 5, inside all_reduce #128 \
             (1 gradient bucket launched)"
        );
        assert!(
            hang.report().contains(
                "waiting for it: rank 0 inside all_reduce #128 (4 gradient buckets launched)"
            ),
            "{}",
            hang.report()
        );
        // None launched yet: wedged before its first bucket.
        wedged.collectives = coll(129, 128);
        let hang = find_hang(&[waiting, wedged], T, 2).unwrap_or_else(|| panic!("none"));
        assert!(
            hang.cause().ends_with("no gradient bucket launched"),
            "{}",
            hang.cause()
        );
        // Rank 0's collective timed out: rank 1 is the one it waited for.
        let victim = culprit_of(0, &[waiting, wedged], Duration::from_secs(5));
        assert_eq!(
            victim.map(|h| (h.kind, h.rank.rank)),
            Some((HangKind::Hung, 1))
        );
        // Another node's rank whose last word (a moment ago) is behind is no
        // culprit: it has not been still for long.
        let mut remote = view(2, None, 0);
        remote.local = false;
        let mut victim = waiting;
        victim.still_for = Duration::ZERO;
        assert_eq!(
            culprit_of(0, &[victim, remote], Duration::from_secs(5)),
            None
        );
        // Both launched every bucket: nobody is behind.
        wedged.collectives = buckets(coll(129, 128), 4);
        assert_eq!(find_hang(&[waiting, wedged], T, 2), None);
        assert_eq!(
            culprit_of(0, &[waiting, wedged], Duration::from_secs(5)),
            None
        );
    }

    /// Another node's rank is named by its own launcher, from its own ticks: here
    /// it only counts to compare with.
    #[test]
    fn another_node_s_rank_is_compared_with_never_named_here() {
        let mut remote_stopped = silent(view(2, at(3, Phase::Forward), 30), 30);
        remote_stopped.local = false;
        let waiting = view(0, at(3, Phase::AllReduce), 20);
        assert_eq!(find_hang(&[waiting, remote_stopped], T, 4), None);
        // A rank of this node behind a rank of another is named.
        let mut remote_ahead = view(2, at(3, Phase::AllReduce), 20);
        remote_ahead.local = false;
        let behind = view(0, at(3, Phase::Forward), 20);
        let hang = find_hang(&[behind, remote_ahead], T, 4).map(|h| h.rank.rank);
        assert_eq!(hang, Some(0));
    }

    #[test]
    fn ranks_together_in_a_long_phase_are_not_hung() {
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
            Some("hang: rank 0 in phase data at step 8, no collective yet")
        );
    }

    #[test]
    fn a_rank_without_heartbeat_is_judged_only_beside_ranks_with_one() {
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
        assert_eq!(find_hang(&views, T, 4).map(|h| h.rank.rank), Some(2));
    }

    #[test]
    fn a_rank_that_timed_out_waiting_names_the_one_it_waited_for() {
        let victim = with(view(0, at(5, Phase::AllReduce), 30), coll(129, 128));
        let laggard = with(view(1, at(5, Phase::Forward), 31), coll(128, 128));
        let silence = Duration::from_secs(5);
        let hang = culprit_of(0, &[victim, laggard], silence).unwrap_or_else(|| panic!("none"));
        assert_eq!((hang.kind, hang.rank.rank), (HangKind::Hung, 1));
        // A stopped rank is named whatever the victim was doing.
        let stopped = silent(laggard, 20);
        let hang = culprit_of(0, &[victim, stopped], silence).map(|h| h.kind);
        assert_eq!(hang, Some(HangKind::Stopped));
        // A rank that failed on its own (not inside a collective): nobody else.
        let mut alone = victim;
        alone.collectives = coll(129, 129);
        assert_eq!(culprit_of(0, &[alone, laggard], silence), None);
    }
}
