//! This rank's heartbeat (the contract's `vrtspike_contract::heartbeat` record in
//! `<run dir>/heartbeat/rank<R>`): [`start`] opens it when a run is built, and the
//! loop calls [`beat`] with its step and phase; the record is rewritten only when
//! they change, so a step costs a few small `pwrite`s. The writer is per thread
//! (the thread that runs the training loop), so ranks run as threads of one test
//! process keep their own records.
//!
//! Test-only hook (for the launcher's hang test, never for real runs): with
//! `VRTSPIKE_TEST_HANG_AT_STEP=S` (and `VRTSPIKE_TEST_HANG_RANK=R`, default 0,
//! `VRTSPIKE_TEST_HANG_PHASE=P`, default `forward`), rank R sleeps forever when it
//! enters phase P at step S in its first attempt (restart count 0).

use std::cell::RefCell;
use std::time::Duration;

use vrtspike_contract::heartbeat::{HeartbeatWriter, Progress};

pub use vrtspike_contract::heartbeat::Phase;

use super::env::RankEnv;

/// Test-only: the step at which a rank hangs (see the module doc).
pub const TEST_HANG_AT_STEP: &str = "VRTSPIKE_TEST_HANG_AT_STEP";
/// Test-only: the rank that hangs (default 0).
pub const TEST_HANG_RANK: &str = "VRTSPIKE_TEST_HANG_RANK";
/// Test-only: the phase in which it hangs (default `forward`).
pub const TEST_HANG_PHASE: &str = "VRTSPIKE_TEST_HANG_PHASE";

/// The open record of this thread's rank.
struct Heartbeat {
    writer: HeartbeatWriter,
    /// Test-only: where to hang.
    hang_at: Option<Progress>,
}

thread_local! {
    static HEARTBEAT: RefCell<Option<Heartbeat>> = const { RefCell::new(None) };
}

/// Opens this rank's record (replacing one this thread had) and beats `start`.
/// A record that cannot be created is logged and the run goes on without one.
pub fn start(env: &RankEnv) {
    let rank = u32::try_from(env.rank).unwrap_or(u32::MAX);
    let heartbeat = match HeartbeatWriter::create(&env.run_dir, rank, env.restart_count) {
        Ok(writer) => Some(Heartbeat {
            writer,
            hang_at: test_hang(env, &|name| std::env::var(name).ok()),
        }),
        Err(e) => {
            tracing::warn!(rank, error = %e, "no heartbeat: the launcher cannot tell if this rank hangs");
            None
        }
    };
    HEARTBEAT.with(|cell| *cell.borrow_mut() = heartbeat);
    beat(0, Phase::Start);
}

/// Records that this rank is at `step` (steps done) in `phase`.
pub fn beat(step: u64, phase: Phase) {
    let progress = Progress { step, phase };
    let hang = HEARTBEAT.with(|cell| {
        let mut slot = cell.borrow_mut();
        let heartbeat = slot.as_mut()?;
        if let Err(e) = heartbeat.writer.beat(progress) {
            tracing::warn!(error = %e, "heartbeat stopped: the launcher cannot tell if this rank hangs");
            *slot = None;
            return None;
        }
        heartbeat.hang_at.filter(|at| *at == progress)
    });
    if let Some(at) = hang {
        tracing::warn!(step = at.step, phase = %at.phase, "{TEST_HANG_AT_STEP}: this rank hangs here (test hook)");
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
}

/// The test hook's hang point for this rank, if the variables ask for one.
fn test_hang(env: &RankEnv, var: &dyn Fn(&str) -> Option<String>) -> Option<Progress> {
    let step = var(TEST_HANG_AT_STEP)?.trim().parse().ok()?;
    let rank: usize = var(TEST_HANG_RANK)
        .and_then(|r| r.trim().parse().ok())
        .unwrap_or(0);
    let phase = match var(TEST_HANG_PHASE) {
        Some(name) => Phase::parse(name.trim())?,
        None => Phase::Forward,
    };
    (env.rank == rank && env.restart_count == 0).then_some(Progress { step, phase })
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
    fn beats_land_in_the_run_dir_record() {
        let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let env = env_of(0, 1, tmp.path());
        start(&env);
        let read = || heartbeat::read(tmp.path(), 0).unwrap_or_else(|e| panic!("{e}"));
        let first = read().unwrap_or_else(|| panic!("no record after start"));
        assert_eq!(first.progress.phase, Phase::Start);
        assert_eq!(first.attempt, 1);
        beat(7, Phase::Backward);
        let later = read().unwrap_or_else(|| panic!("no record"));
        assert_eq!(
            later.progress,
            Progress {
                step: 7,
                phase: Phase::Backward
            }
        );
    }

    #[test]
    fn the_test_hook_hangs_only_its_rank_in_the_first_attempt() {
        let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let vars: HashMap<&str, &str> = [(TEST_HANG_AT_STEP, "3"), (TEST_HANG_RANK, "1")].into();
        let var = |name: &str| vars.get(name).map(|v| v.to_string());
        let at = Progress {
            step: 3,
            phase: Phase::Forward,
        };
        assert_eq!(test_hang(&env_of(1, 0, tmp.path()), &var), Some(at));
        assert_eq!(test_hang(&env_of(0, 0, tmp.path()), &var), None);
        assert_eq!(
            test_hang(&env_of(1, 1, tmp.path()), &var),
            None,
            "not after a restart"
        );
        assert_eq!(test_hang(&env_of(1, 0, tmp.path()), &|_| None), None);
    }
}
