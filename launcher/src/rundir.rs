//! The run directory: where it is (given, `runs/slurm-<job id>` under SLURM, or
//! `runs/<date>-<time>`), its layout (`logs/`, `checkpoints/`), and the checkpoint
//! state the restart policy compares between attempts.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};

/// A created run directory.
#[derive(Debug, Clone)]
pub struct RunDir {
    /// Absolute path.
    pub path: PathBuf,
    /// Whether it existed before this launch (a resume).
    pub existed: bool,
}

impl RunDir {
    /// Creates (or reuses) the run directory and its `logs/` and `checkpoints/`.
    /// `given` is --run-dir; `slurm_job` names the default under SLURM.
    pub fn create(given: Option<&Path>, slurm_job: Option<&str>) -> Result<RunDir> {
        let path = match (given, slurm_job) {
            (Some(path), _) => path.to_path_buf(),
            (None, Some(job)) => PathBuf::from(format!("runs/slurm-{job}")),
            (None, None) => fresh_default(&utc_stamp(SystemTime::now())),
        };
        let existed = path.join("logs").is_dir();
        for sub in ["logs", "checkpoints"] {
            let dir = path.join(sub);
            std::fs::create_dir_all(&dir)
                .with_context(|| format!("creating the run directory {}", dir.display()))?;
        }
        let path = path
            .canonicalize()
            .with_context(|| format!("resolving the run directory {}", path.display()))?;
        Ok(RunDir { path, existed })
    }

    /// The log of global rank `rank`.
    pub fn rank_log(&self, rank: u32) -> PathBuf {
        self.path.join("logs").join(format!("rank{rank}.log"))
    }

    /// The log of this node's cache server.
    pub fn cache_log(&self, node_rank: u32) -> PathBuf {
        self.path
            .join("logs")
            .join(format!("cache.node{node_rank}.log"))
    }

    /// The summary this node's launcher writes (`summary.json` on node 0).
    pub fn summary_path(&self, node_rank: u32) -> PathBuf {
        if node_rank == 0 {
            self.path.join("summary.json")
        } else {
            self.path.join(format!("summary.node{node_rank}.json"))
        }
    }

    /// The figures rank 0 writes at the end of training (merged into the summary).
    pub fn train_summary_path(&self) -> PathBuf {
        self.path.join("train_summary.json")
    }

    /// The newest entry of `checkpoints/` (by modification time, then name).
    pub fn latest_checkpoint(&self) -> Option<CheckpointMark> {
        let entries = std::fs::read_dir(self.path.join("checkpoints")).ok()?;
        entries
            .flatten()
            .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
            .filter_map(|e| {
                let modified = e.metadata().ok()?.modified().ok()?;
                Some(CheckpointMark {
                    name: e.file_name().to_string_lossy().into_owned(),
                    modified,
                })
            })
            .max_by(|a, b| (a.modified, &a.name).cmp(&(b.modified, &b.name)))
    }
}

/// The newest checkpoint: enough to tell whether an attempt wrote a new one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointMark {
    /// File or directory name under `checkpoints/`.
    pub name: String,
    /// When it was last written.
    pub modified: SystemTime,
}

/// `runs/<stamp>`, or `runs/<stamp>-2`, ... when that exists already.
fn fresh_default(stamp: &str) -> PathBuf {
    let runs = PathBuf::from("runs");
    std::iter::once(runs.join(stamp))
        .chain((2..1000).map(|n| runs.join(format!("{stamp}-{n}"))))
        .find(|path| !path.exists())
        .unwrap_or_else(|| runs.join(stamp))
}

/// `YYYYMMDD-HHMMSS` in UTC.
pub fn utc_stamp(time: SystemTime) -> String {
    let secs = time
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (days, rest) = (secs / 86_400, secs % 86_400);
    let (year, month, day) = civil_from_days(days as i64);
    format!(
        "{year:04}{month:02}{day:02}-{:02}{:02}{:02}",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60
    )
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn utc_stamps() {
        assert_eq!(utc_stamp(UNIX_EPOCH), "19700101-000000");
        let t = UNIX_EPOCH + Duration::from_secs(1_709_210_096); // 2024-02-29 12:34:56
        assert_eq!(utc_stamp(t), "20240229-123456");
        let t = UNIX_EPOCH + Duration::from_secs(4_102_444_799); // 2099-12-31 23:59:59
        assert_eq!(utc_stamp(t), "20991231-235959");
    }

    #[test]
    fn layout_resume_flag_and_latest_checkpoint() {
        let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let given = tmp.path().join("run");
        let run = RunDir::create(Some(&given), None).unwrap_or_else(|e| panic!("{e:#}"));
        assert!(!run.existed);
        assert!(run.path.join("logs").is_dir() && run.path.join("checkpoints").is_dir());
        assert_eq!(run.latest_checkpoint(), None);
        std::fs::write(run.path.join("checkpoints/step_10"), b"a")
            .unwrap_or_else(|e| panic!("{e}"));
        std::thread::sleep(Duration::from_millis(20));
        std::fs::write(run.path.join("checkpoints/step_20"), b"b")
            .unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(run.path.join("checkpoints/.tmp"), b"c").unwrap_or_else(|e| panic!("{e}"));
        let latest = run.latest_checkpoint().map(|m| m.name);
        assert_eq!(latest.as_deref(), Some("step_20"));
        let again = RunDir::create(Some(&given), None).unwrap_or_else(|e| panic!("{e:#}"));
        assert!(again.existed);
        assert_eq!(again.summary_path(0), again.path.join("summary.json"));
        assert_eq!(again.summary_path(1), again.path.join("summary.node1.json"));
    }
}
