//! The run directory: its default name (`runs/slurm-<job>` under SLURM, else
//! `runs/<date>-<time>`), its layout (`logs/rank<R>.log`, `logs/cache.node<N>.log`,
//! `checkpoints/step_<N>/`, `metrics.jsonl`, `config.resolved.yaml`, the summary files), and which
//! checkpoint is the latest: the highest step whose directory is complete. The
//! launcher's restart decision and the trainer's resume both ask [`latest_checkpoint`].

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// The ranks' and the cache server's logs.
pub const LOGS_DIR: &str = "logs";
/// One directory per checkpoint.
pub const CHECKPOINTS_DIR: &str = "checkpoints";
/// Rank 0's training figures, one JSON object a line.
pub const METRICS_FILE: &str = "metrics.jsonl";
/// Rank 0's run summary ([`crate::summary::RunSummary`]).
pub const RESULT_FILE: &str = "result.json";
/// The same summary under the name the launcher merges into `summary.json`.
pub const TRAIN_SUMMARY_FILE: &str = "train_summary.json";
/// Rank 0's copy of the resolved config that ran (`BASE` chain and `--set` applied).
pub const CONFIG_RESOLVED_FILE: &str = "config.resolved.yaml";
/// The file written last into a checkpoint directory: without it, it is incomplete.
pub const CHECKPOINT_STATE_FILE: &str = "state.json";
/// Node 0's launcher's control link: address, port and the job's secret (mode 0600).
pub const CONTROL_FILE: &str = "control.json";
/// Rendezvous ports that rank 0 publishes when no launcher chose one (srun), and
/// the node-shared cache server's address local rank 0 publishes (torchrun, srun).
pub const RENDEZVOUS_DIR: &str = "rendezvous";

/// The paths of one run directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunLayout {
    root: PathBuf,
}

impl RunLayout {
    /// The layout under `root`.
    pub fn new(root: impl Into<PathBuf>) -> RunLayout {
        RunLayout { root: root.into() }
    }

    /// The run directory itself.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The job as a shared cache server's per-job figures name it: the run
    /// directory as an absolute path (the launcher and its ranks, whatever their
    /// working directories, name it alike).
    pub fn job_label(&self) -> String {
        std::path::absolute(&self.root)
            .unwrap_or_else(|_| self.root.clone())
            .display()
            .to_string()
    }

    /// `logs/`.
    pub fn logs_dir(&self) -> PathBuf {
        self.root.join(LOGS_DIR)
    }

    /// The log of global rank `rank`.
    pub fn rank_log(&self, rank: u32) -> PathBuf {
        self.logs_dir().join(format!("rank{rank}.log"))
    }

    /// The failure record global rank `rank` writes before it exits with an error
    /// ([`crate::failure::RankFailure`]).
    pub fn rank_failure(&self, rank: u32) -> PathBuf {
        self.logs_dir().join(format!("rank{rank}.failure.json"))
    }

    /// The log of node `node_rank`'s cache server.
    pub fn cache_log(&self, node_rank: u32) -> PathBuf {
        self.logs_dir().join(format!("cache.node{node_rank}.log"))
    }

    /// `checkpoints/`.
    pub fn checkpoints_dir(&self) -> PathBuf {
        self.root.join(CHECKPOINTS_DIR)
    }

    /// The directory of step `step`'s checkpoint.
    pub fn step_dir(&self, step: u64) -> PathBuf {
        self.checkpoints_dir().join(step_dir_name(step))
    }

    /// `metrics.jsonl`.
    pub fn metrics(&self) -> PathBuf {
        self.root.join(METRICS_FILE)
    }

    /// Rank 0's `config.resolved.yaml`.
    pub fn resolved_config(&self) -> PathBuf {
        self.root.join(CONFIG_RESOLVED_FILE)
    }

    /// Rank 0's `result.json`.
    pub fn result(&self) -> PathBuf {
        self.root.join(RESULT_FILE)
    }

    /// Rank 0's `train_summary.json`.
    pub fn train_summary(&self) -> PathBuf {
        self.root.join(TRAIN_SUMMARY_FILE)
    }

    /// The summary node `node_rank`'s launcher writes (`summary.json` on node 0).
    pub fn launcher_summary(&self, node_rank: u32) -> PathBuf {
        if node_rank == 0 {
            self.root.join("summary.json")
        } else {
            self.root.join(format!("summary.node{node_rank}.json"))
        }
    }

    /// Node 0's launcher's control file (multi-node jobs).
    pub fn control_file(&self) -> PathBuf {
        self.root.join(CONTROL_FILE)
    }

    /// The port rank 0 of the job named `tag` publishes (`rendezvous/<tag>.port`).
    pub fn rendezvous_port(&self, tag: &str) -> PathBuf {
        self.root.join(RENDEZVOUS_DIR).join(format!("{tag}.port"))
    }

    /// The node-shared cache server's address that local rank 0 of the job named
    /// `tag` publishes for the other local ranks (`rendezvous/<tag>.cache-addr`).
    pub fn shared_cache_address(&self, tag: &str) -> PathBuf {
        self.root
            .join(RENDEZVOUS_DIR)
            .join(format!("{tag}.cache-addr"))
    }

    /// The latest complete checkpoint of this run.
    pub fn latest_checkpoint(&self) -> Option<Checkpoint> {
        latest_checkpoint(&self.checkpoints_dir())
    }
}

/// A complete checkpoint directory.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Checkpoint {
    /// Optimizer steps done when it was written.
    pub step: u64,
    /// Its directory.
    pub path: PathBuf,
}

impl Checkpoint {
    /// Its directory name (`step_00000040`).
    pub fn name(&self) -> String {
        step_dir_name(self.step)
    }
}

/// The directory name of step `step`'s checkpoint.
pub fn step_dir_name(step: u64) -> String {
    format!("step_{step:08}")
}

/// The step of a checkpoint directory name (`step_<N>`), if it is one.
pub fn parse_step_dir_name(name: &str) -> Option<u64> {
    name.strip_prefix("step_")?.parse().ok()
}

/// The complete checkpoints under `dir` (a run's `checkpoints/`), lowest step first.
pub fn list_checkpoints(dir: &Path) -> Vec<Checkpoint> {
    let mut found: Vec<Checkpoint> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let step = parse_step_dir_name(entry.file_name().to_str()?)?;
            let path = entry.path();
            path.join(CHECKPOINT_STATE_FILE)
                .is_file()
                .then_some(Checkpoint { step, path })
        })
        .collect();
    found.sort();
    found
}

/// The complete checkpoint with the highest step under `dir`.
pub fn latest_checkpoint(dir: &Path) -> Option<Checkpoint> {
    list_checkpoints(dir).pop()
}

/// The default run directory: `runs/slurm-<job>` under SLURM, else a fresh
/// `runs/<stamp>` (`runs/<stamp>-2`, ... when that exists).
pub fn default_run_dir(slurm_job: Option<&str>, now: SystemTime) -> PathBuf {
    let runs = PathBuf::from("runs");
    if let Some(job) = slurm_job {
        return runs.join(format!("slurm-{job}"));
    }
    let stamp = utc_stamp(now);
    std::iter::once(runs.join(&stamp))
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

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian (Howard
/// Hinnant's civil-from-days).
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
    fn default_names() {
        let now = UNIX_EPOCH + Duration::from_secs(1_709_210_096);
        assert_eq!(
            default_run_dir(Some("77"), now),
            PathBuf::from("runs/slurm-77")
        );
        let fresh = default_run_dir(None, now);
        assert!(fresh.starts_with("runs"), "{}", fresh.display());
        assert!(fresh.to_string_lossy().contains("20240229-123456"));
    }

    #[test]
    fn layout_paths() {
        let run = RunLayout::new("/r");
        assert_eq!(run.rank_log(3), PathBuf::from("/r/logs/rank3.log"));
        assert_eq!(run.cache_log(1), PathBuf::from("/r/logs/cache.node1.log"));
        assert_eq!(
            run.step_dir(40),
            PathBuf::from("/r/checkpoints/step_00000040")
        );
        assert_eq!(run.metrics(), PathBuf::from("/r/metrics.jsonl"));
        assert_eq!(
            run.resolved_config(),
            PathBuf::from("/r/config.resolved.yaml")
        );
        assert_eq!(run.launcher_summary(0), PathBuf::from("/r/summary.json"));
        assert_eq!(
            run.launcher_summary(2),
            PathBuf::from("/r/summary.node2.json")
        );
        assert_eq!(run.control_file(), PathBuf::from("/r/control.json"));
        assert_eq!(
            run.rendezvous_port("slurm-7.0"),
            PathBuf::from("/r/rendezvous/slurm-7.0.port")
        );
        assert_eq!(parse_step_dir_name("step_00000040"), Some(40));
        assert_eq!(parse_step_dir_name(".step_00000040.tmp-3"), None);
    }

    #[test]
    fn latest_is_the_highest_complete_step_not_the_newest_file() {
        let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let run = RunLayout::new(tmp.path());
        assert_eq!(run.latest_checkpoint(), None);
        let complete = |step: u64| {
            let dir = run.step_dir(step);
            std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
            std::fs::write(dir.join(CHECKPOINT_STATE_FILE), b"{}")
                .unwrap_or_else(|e| panic!("{e}"));
        };
        complete(20);
        std::thread::sleep(Duration::from_millis(20));
        complete(10); // written later, but an earlier step
        std::fs::create_dir_all(run.step_dir(30)).unwrap_or_else(|e| panic!("{e}")); // incomplete
        std::fs::create_dir_all(run.checkpoints_dir().join(".step_00000040.tmp-1"))
            .unwrap_or_else(|e| panic!("{e}"));
        let latest = run.latest_checkpoint();
        assert_eq!(latest.as_ref().map(|c| c.step), Some(20));
        assert_eq!(latest.map(|c| c.name()).as_deref(), Some("step_00000020"));
        let steps: Vec<u64> = list_checkpoints(&run.checkpoints_dir())
            .iter()
            .map(|c| c.step)
            .collect();
        assert_eq!(steps, [10, 20]);
    }
}
