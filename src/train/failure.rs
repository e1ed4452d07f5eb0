//! The rank's account of a failed run for the launcher: [`record`] writes the
//! contract's failure record (`logs/rank<R>.failure.json`: class, step, message) and
//! returns the exit code the rank should end with ([`EXIT_OUT_OF_MEMORY`] for an
//! out-of-memory, 1 otherwise).

use vrtspike_contract::failure::{FailureClass, RankFailure, EXIT_OUT_OF_MEMORY};

use super::env::RankEnv;
use super::TrainError;

/// The exit code of a rank that failed with any other error.
pub const EXIT_ERROR: i32 = 1;

/// Writes this rank's failure record for `error` (a failure to write it is logged,
/// not fatal: the exit code still carries the class) and returns the exit code.
pub fn record(env: &RankEnv, error: &TrainError) -> i32 {
    let (class, step, code) = match error {
        TrainError::OutOfMemory(oom) => (FailureClass::OutOfMemory, oom.step, EXIT_OUT_OF_MEMORY),
        _ => (FailureClass::Error, None, EXIT_ERROR),
    };
    let failure = RankFailure {
        rank: env.rank as u32,
        pid: std::process::id(),
        class,
        step,
        message: error.to_string().replace(['\n', '\r'], " "),
    };
    let path = env.layout().rank_failure(failure.rank);
    if let Err(e) = failure.write(&path) {
        tracing::warn!("{e}");
    }
    code
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::oom::{OomPhase, OutOfMemory};

    #[test]
    fn an_out_of_memory_is_recorded_with_its_class_and_exit_code() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("logs")).unwrap();
        let vars = |_: &str| None;
        let env = RankEnv::from_vars(&vars, Some(dir.path()), Some("cpu")).unwrap();
        let oom = OutOfMemory {
            phase: OomPhase::Validation,
            step: Some(4),
            stage: Some("stage 2".into()),
            shape: vec![1, 6, 3, 64, 64],
            device: "cpu".into(),
            detail: "DefaultCPUAllocator: not enough memory".into(),
            remedy: "a smaller DATA.VAL_TILE".into(),
        };
        let code = record(&env, &TrainError::OutOfMemory(Box::new(oom)));
        assert_eq!(code, EXIT_OUT_OF_MEMORY);
        let path = env.layout().rank_failure(0);
        let written = RankFailure::read_for(&path, std::process::id()).unwrap();
        assert_eq!(written.class, FailureClass::OutOfMemory);
        assert_eq!(written.step, Some(4));
        assert!(written.message.contains("(stage 2)"), "{}", written.message);
        let other = TrainError::io(&path, "disk full");
        assert_eq!(record(&env, &other), EXIT_ERROR);
        let written = RankFailure::read(&path).unwrap();
        assert_eq!(written.class, FailureClass::Error);
    }
}
