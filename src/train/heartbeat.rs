//! This rank's heartbeat (the contract's `vrtspike_contract::heartbeat` record in
//! `<run dir>/heartbeat/rank<R>`): [`start`] opens it when a run is built and
//! starts the liveness thread, which advances the record's tick every
//! `TICK_INTERVAL` whatever the training thread does (a rank waiting in a
//! collective keeps ticking; a stopped or wedged process does not); the loop
//! calls [`beat`] with its step and phase (rewritten only when they change); and
//! the process group reports each collective it enters and completes through
//! [`observer`], and inside the Reducer's gradient all-reduce (one collective for
//! a whole backward pass) each gradient bucket it launches. The record of a thread's rank is per thread (the thread that runs
//! the training loop), so ranks run as threads of one test process keep their own
//! records.
//!
//! Test-only hook (for the launcher's hang and stopped-rank tests, never for real
//! runs): with `VRTSPIKE_TEST_HANG_AT_STEP=S` (and `VRTSPIKE_TEST_HANG_RANK=R`,
//! default 0, `VRTSPIKE_TEST_HANG_PHASE=P`, default `forward`), rank R hangs when
//! it enters phase P at step S in its first attempt (restart count 0): it sleeps
//! forever, or with `VRTSPIKE_TEST_HANG_HOW=stop` it stops itself with SIGSTOP (a
//! stopped process: no thread runs, no tick); with phase `allreduce` and `stop` it
//! stops inside the gradient all-reduce, after entering the collective. With phase
//! `backward` it hangs inside the backward pass, when backward reaches the loss
//! (with the Reducer: after entering its collective, before any gradient exists,
//! as a rank wedged in a backward kernel), or with `VRTSPIKE_TEST_HANG_BUCKET=J`
//! inside the Reducer's communication hook, as it is about to launch its gradient
//! bucket J (in launch order, from 0).

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use vrtspike_contract::heartbeat::{
    unix_ms_now, Beat, CollectiveOp, Collectives, HeartbeatWriter, Progress, TICK_INTERVAL,
};

pub use vrtspike_contract::heartbeat::Phase;

use super::env::RankEnv;
use crate::ddp::CollectiveObserver;

/// Test-only: the step at which a rank hangs (see the module doc).
pub const TEST_HANG_AT_STEP: &str = "VRTSPIKE_TEST_HANG_AT_STEP";
/// Test-only: the rank that hangs (default 0).
pub const TEST_HANG_RANK: &str = "VRTSPIKE_TEST_HANG_RANK";
/// Test-only: the phase in which it hangs (default `forward`).
pub const TEST_HANG_PHASE: &str = "VRTSPIKE_TEST_HANG_PHASE";
/// Test-only: how it hangs, `sleep` (default) or `stop` (SIGSTOP to itself).
pub const TEST_HANG_HOW: &str = "VRTSPIKE_TEST_HANG_HOW";
/// Test-only: with phase `backward`, the gradient bucket (in launch order) whose
/// launch it hangs in, inside the Reducer's communication hook.
pub const TEST_HANG_BUCKET: &str = "VRTSPIKE_TEST_HANG_BUCKET";

/// How the test hook hangs a rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HangHow {
    /// The training thread sleeps; the process ticks on.
    Sleep,
    /// The whole process stops (SIGSTOP).
    Stop,
}

/// Where and how the test hook hangs this rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct TestHang {
    at: Progress,
    how: HangHow,
    /// In phase backward: the bucket whose launch it hangs in (else when backward
    /// reaches the loss).
    bucket: Option<u32>,
}

impl TestHang {
    /// Hangs the calling thread (sleep) or the whole process (stop), for good.
    fn hang(&self, shared: &Shared, place: &str) {
        match self.how {
            HangHow::Sleep => {
                tracing::warn!(step = self.at.step, phase = %self.at.phase, "{TEST_HANG_AT_STEP}: this rank hangs {place} (test hook)");
                loop {
                    std::thread::sleep(Duration::from_secs(3600));
                }
            }
            HangHow::Stop => shared.stop_here(self.at, place),
        }
    }
}

/// A rank's record and what it says, shared by the training thread, the liveness
/// thread and the process group's observer.
struct Shared {
    writer: HeartbeatWriter,
    beat: Mutex<Option<Beat>>,
    hang: Option<TestHang>,
    stopped: AtomicBool,
}

impl Shared {
    /// Changes the record with `change` and rewrites it; a record that cannot be
    /// written is logged once and dropped (the run goes on without it).
    fn update(&self, change: impl FnOnce(&mut Beat)) {
        let mut slot = self.beat.lock().unwrap_or_else(|p| p.into_inner());
        let Some(beat) = slot.as_mut() else { return };
        change(beat);
        if let Err(e) = self.writer.write(beat) {
            tracing::warn!(error = %e, "heartbeat stopped: the launcher cannot tell if this rank hangs");
            *slot = None;
        }
    }

    fn progress(&self) -> Option<Progress> {
        let slot = self.beat.lock().unwrap_or_else(|p| p.into_inner());
        slot.as_ref().map(|b| b.progress)
    }

    /// Test hook: stops this whole process (once).
    fn stop_here(&self, at: Progress, place: &str) {
        if self.stopped.swap(true, Ordering::SeqCst) {
            return;
        }
        tracing::warn!(step = at.step, phase = %at.phase, "{TEST_HANG_AT_STEP}: this rank stops itself {place} (test hook)");
        // SAFETY: raise with a valid signal; SIGSTOP stops every thread of the
        // process until SIGCONT or SIGKILL.
        unsafe { libc::raise(libc::SIGSTOP) };
    }
}

/// The process group's collectives, into the record.
struct Observer(Arc<Shared>);

impl CollectiveObserver for Observer {
    fn entered(&self, op: CollectiveOp, seq: u64) {
        self.0.update(|beat| {
            beat.collectives.entered = seq + 1;
            beat.collectives.last = Some(op);
            beat.collectives.buckets = 0;
        });
        let stop_in_allreduce = self.0.hang.filter(|h| {
            h.how == HangHow::Stop
                && h.at.phase == Phase::AllReduce
                && op == CollectiveOp::AllReduce
        });
        if let Some(hang) = stop_in_allreduce.filter(|h| self.0.progress() == Some(h.at)) {
            self.0
                .stop_here(hang.at, &format!("inside all_reduce #{seq}"));
        }
    }

    fn completed(&self, seq: u64) {
        self.0.update(|beat| beat.collectives.completed = seq + 1);
    }

    fn bucket_launching(&self, _seq: u64, index: u32) {
        let hang = self.0.hang.filter(|h| {
            h.at.phase == Phase::Backward
                && h.bucket == Some(index)
                && self.0.progress() == Some(h.at)
        });
        if let Some(hang) = hang {
            hang.hang(&self.0, &format!("as it launches gradient bucket {index}"));
        }
    }

    fn buckets_launched(&self, seq: u64, launched: u32) {
        self.0.update(|beat| {
            if beat.collectives.entered == seq + 1 {
                beat.collectives.buckets = launched;
            }
        });
    }
}

thread_local! {
    static HEARTBEAT: RefCell<Option<Arc<Shared>>> = const { RefCell::new(None) };
}

/// Opens this rank's record (replacing one this thread had), beats `start` and
/// starts its liveness thread. A record that cannot be created is logged and the
/// run goes on without one.
pub fn start(env: &RankEnv) {
    let rank = u32::try_from(env.rank).unwrap_or(u32::MAX);
    let shared = match HeartbeatWriter::create(&env.run_dir, rank) {
        Ok(writer) => Some(Arc::new(Shared {
            writer,
            beat: Mutex::new(Some(Beat {
                progress: Progress {
                    step: 0,
                    phase: Phase::Start,
                },
                unix_ms: unix_ms_now(),
                attempt: env.restart_count,
                pid: std::process::id(),
                tick: 0,
                collectives: Collectives::default(),
            })),
            hang: test_hang(env, &|name| std::env::var(name).ok()),
            stopped: AtomicBool::new(false),
        })),
        Err(e) => {
            tracing::warn!(rank, error = %e, "no heartbeat: the launcher cannot tell if this rank hangs");
            None
        }
    };
    if let Some(shared) = &shared {
        shared.update(|_| {});
        start_ticking(Arc::downgrade(shared));
    }
    HEARTBEAT.with(|cell| *cell.borrow_mut() = shared);
}

/// The liveness thread: advances the tick until the record is dropped.
fn start_ticking(record: Weak<Shared>) {
    let spawned = std::thread::Builder::new()
        .name("heartbeat".into())
        .spawn(move || loop {
            std::thread::sleep(TICK_INTERVAL);
            let Some(shared) = record.upgrade() else {
                return;
            };
            shared.update(|beat| beat.tick += 1);
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "no liveness tick: a stopped rank will be taken for a slow one");
    }
}

/// The observer that writes the process group's collectives into this thread's
/// record (none without a record).
pub fn observer() -> Option<Arc<dyn CollectiveObserver>> {
    HEARTBEAT.with(|cell| {
        cell.borrow()
            .as_ref()
            .map(|shared| Arc::new(Observer(shared.clone())) as Arc<dyn CollectiveObserver>)
    })
}

/// Records that this rank is at `step` (steps done) in `phase`.
pub fn beat(step: u64, phase: Phase) {
    let progress = Progress { step, phase };
    let Some(shared) = HEARTBEAT.with(|cell| cell.borrow().clone()) else {
        return;
    };
    if shared.progress() != Some(progress) {
        shared.update(|beat| {
            beat.progress = progress;
            beat.unix_ms = unix_ms_now();
        });
    }
    let Some(hang) = shared.hang.filter(|h| h.at == progress) else {
        return;
    };
    match (hang.how, phase) {
        // Inside backward (see `in_backward` and `Observer`).
        (_, Phase::Backward) => {}
        // Inside the collective, once entered (see `Observer`).
        (HangHow::Stop, Phase::AllReduce) => {}
        _ => hang.hang(&shared, "here"),
    }
}

/// Test hook: `loss` as it is, or, where this rank hangs in phase backward when
/// backward reaches the loss (see the module doc), with that hang attached.
pub fn in_backward(loss: &tch::Tensor) -> Result<tch::Tensor, crate::model::ModelError> {
    let shared = HEARTBEAT.with(|cell| cell.borrow().clone());
    let hang = shared.as_ref().and_then(|s| {
        s.hang
            .filter(|h| h.at.phase == Phase::Backward && h.bucket.is_none())
            .filter(|h| s.progress() == Some(h.at))
    });
    match (shared, hang) {
        (Some(shared), Some(hang)) => crate::model::checkpoint::on_backward(loss, move || {
            hang.hang(&shared, "inside its backward pass")
        }),
        _ => Ok(loss.shallow_clone()),
    }
}

/// The test hook's hang point for this rank, if the variables ask for one.
fn test_hang(env: &RankEnv, var: &dyn Fn(&str) -> Option<String>) -> Option<TestHang> {
    let step = var(TEST_HANG_AT_STEP)?.trim().parse().ok()?;
    let rank: usize = var(TEST_HANG_RANK)
        .and_then(|r| r.trim().parse().ok())
        .unwrap_or(0);
    let phase = match var(TEST_HANG_PHASE) {
        Some(name) => Phase::parse(name.trim())?,
        None => Phase::Forward,
    };
    let how = match var(TEST_HANG_HOW).as_deref().map(str::trim) {
        None | Some("sleep") => HangHow::Sleep,
        Some("stop") => HangHow::Stop,
        Some(_) => return None,
    };
    let bucket = var(TEST_HANG_BUCKET).and_then(|b| b.trim().parse().ok());
    (env.rank == rank && env.restart_count == 0).then_some(TestHang {
        at: Progress { step, phase },
        how,
        bucket,
    })
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use vrtspike_contract::heartbeat;

    use super::*;

    fn env_of(rank: usize, restart_count: u32, run_dir: &std::path::Path) -> RankEnv {
        let mut env = RankEnv::from_vars(&|_| None, Some(run_dir), Some("cpu"))
            .unwrap_or_else(|e| panic!("{e}"));
        env.rank = rank;
        env.restart_count = restart_count;
        env
    }

    #[test]
    fn beats_collectives_and_ticks_land_in_the_run_dir_record() {
        let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let env = env_of(0, 1, tmp.path());
        start(&env);
        let read = || {
            heartbeat::read(tmp.path(), 0)
                .unwrap_or_else(|e| panic!("{e}"))
                .unwrap_or_else(|| panic!("no record"))
        };
        let first = read();
        assert_eq!(first.progress.phase, Phase::Start);
        assert_eq!(first.attempt, 1);
        beat(7, Phase::Backward);
        let later = read();
        assert_eq!(
            later.progress,
            Progress {
                step: 7,
                phase: Phase::Backward
            }
        );
        let observer = observer().unwrap_or_else(|| panic!("no observer"));
        observer.entered(CollectiveOp::AllReduce, 41);
        assert_eq!(read().collectives.describe(), "inside all_reduce #41");
        observer.buckets_launched(41, 2);
        assert_eq!(
            read().collectives.describe(),
            "inside all_reduce #41 (2 gradient buckets launched)"
        );
        observer.buckets_launched(40, 5);
        assert_eq!(read().collectives.buckets, 2, "an older collective's count");
        observer.completed(41);
        assert_eq!(read().collectives.describe(), "last all_reduce #41 done");
        observer.entered(CollectiveOp::AllReduce, 42);
        assert_eq!(
            read().collectives.buckets,
            0,
            "counted anew in each collective"
        );
        // The liveness thread ticks while this thread does nothing.
        let tick = read().tick;
        std::thread::sleep(TICK_INTERVAL * 3);
        assert!(read().tick > tick, "the tick did not advance");
    }

    #[test]
    fn the_test_hook_hangs_only_its_rank_in_the_first_attempt() {
        let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let mut vars: HashMap<&str, &str> =
            [(TEST_HANG_AT_STEP, "3"), (TEST_HANG_RANK, "1")].into();
        let at = Progress {
            step: 3,
            phase: Phase::Forward,
        };
        let sleep = Some(TestHang {
            at,
            how: HangHow::Sleep,
            bucket: None,
        });
        {
            let var = |name: &str| vars.get(name).map(|v| v.to_string());
            assert_eq!(test_hang(&env_of(1, 0, tmp.path()), &var), sleep);
            assert_eq!(test_hang(&env_of(0, 0, tmp.path()), &var), None);
            assert_eq!(
                test_hang(&env_of(1, 1, tmp.path()), &var),
                None,
                "not after a restart"
            );
        }
        assert_eq!(test_hang(&env_of(1, 0, tmp.path()), &|_| None), None);
        vars.insert(TEST_HANG_HOW, "stop");
        vars.insert(TEST_HANG_PHASE, "allreduce");
        let var = |name: &str| vars.get(name).map(|v| v.to_string());
        let stop = test_hang(&env_of(1, 0, tmp.path()), &var);
        assert_eq!(
            stop.map(|h| (h.at.phase, h.how)),
            Some((Phase::AllReduce, HangHow::Stop))
        );
        vars.insert(TEST_HANG_PHASE, "backward");
        vars.insert(TEST_HANG_BUCKET, "2");
        let var = |name: &str| vars.get(name).map(|v| v.to_string());
        let in_bucket = test_hang(&env_of(1, 0, tmp.path()), &var);
        assert_eq!(
            in_bucket.map(|h| (h.at.phase, h.bucket)),
            Some((Phase::Backward, Some(2)))
        );
    }
}
