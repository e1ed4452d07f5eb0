//! The launcher's run directory: where it is (given, or the contract's default
//! name), created with its `logs/` and `checkpoints/`. The layout and the latest
//! checkpoint come from [`vrtspike_contract::rundir`], which the ranks use too.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use anyhow::{Context, Result};
use vrtspike_contract::rundir::{default_run_dir, Checkpoint, RunLayout};

/// A created run directory.
#[derive(Debug, Clone)]
pub struct RunDir {
    /// Absolute path.
    pub path: PathBuf,
    /// Its layout.
    pub layout: RunLayout,
}

impl RunDir {
    /// Creates (or reuses) the run directory and its `logs/` and `checkpoints/`.
    /// `given` is --run-dir; `slurm_job` names the default under SLURM.
    pub fn create(given: Option<&Path>, slurm_job: Option<&str>) -> Result<RunDir> {
        let path = match given {
            Some(path) => path.to_path_buf(),
            None => default_run_dir(slurm_job, SystemTime::now()),
        };
        let layout = RunLayout::new(&path);
        for dir in [layout.logs_dir(), layout.checkpoints_dir()] {
            std::fs::create_dir_all(&dir)
                .with_context(|| format!("creating the run directory {}", dir.display()))?;
        }
        let path = path
            .canonicalize()
            .with_context(|| format!("resolving the run directory {}", path.display()))?;
        Ok(RunDir {
            layout: RunLayout::new(&path),
            path,
        })
    }

    /// The latest complete checkpoint (the one the ranks resume from).
    pub fn latest_checkpoint(&self) -> Option<Checkpoint> {
        self.layout.latest_checkpoint()
    }
}

#[cfg(test)]
mod tests {
    use vrtspike_contract::rundir::CHECKPOINT_STATE_FILE;

    use super::*;

    #[test]
    fn layout_and_latest_checkpoint() {
        let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let given = tmp.path().join("run");
        let run = RunDir::create(Some(&given), None).unwrap_or_else(|e| panic!("{e:#}"));
        assert!(run.layout.logs_dir().is_dir() && run.layout.checkpoints_dir().is_dir());
        assert_eq!(run.latest_checkpoint(), None);
        for step in [20, 10] {
            let dir = run.layout.step_dir(step);
            std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
            std::fs::write(dir.join(CHECKPOINT_STATE_FILE), b"{}")
                .unwrap_or_else(|e| panic!("{e}"));
        }
        assert_eq!(run.latest_checkpoint().map(|c| c.step), Some(20));
        let again = RunDir::create(Some(&given), None).unwrap_or_else(|e| panic!("{e:#}"));
        assert_eq!(again.layout.root(), run.path);
    }
}
