//! The run summary: the figures rank 0 writes at the end of every attempt
//! (`result.json` and `train_summary.json`) and the launcher reads back and merges
//! into its own `summary.json`. One serde struct on both sides, so a renamed or
//! retyped field is a compile error, not a silent `null`.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::json_file::{self, JsonFileError};

/// How a rank's training attempt ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TrainStatus {
    /// `TRAIN.TOTAL_STEPS` reached.
    Completed,
    /// Stopped with a checkpoint by a preemption request or `--stop-after-steps`.
    Preempted,
    /// Ended before either (should not be written; kept for old files).
    Stopped,
}

/// Rank 0's figures of one attempt. Required: `status`, `steps`, `total_steps`,
/// `world_size`; the others default when a writer leaves them out.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunSummary {
    /// How the attempt ended.
    pub status: TrainStatus,
    /// Steps done (all attempts).
    pub steps: u64,
    /// `TRAIN.TOTAL_STEPS`.
    pub total_steps: u64,
    /// Ranks in the job.
    pub world_size: u32,
    /// Mean validation PSNR of the last validation, dB.
    #[serde(default)]
    pub val_psnr: Option<f64>,
    /// Mean validation SSIM of the last validation.
    #[serde(default)]
    pub val_ssim: Option<f64>,
    /// PSNR of the blurred inputs over the same frames, dB.
    #[serde(default)]
    pub input_psnr: Option<f64>,
    /// The step of the last validation.
    #[serde(default)]
    pub val_step: Option<u64>,
    /// Frames of the last validation (all ranks).
    #[serde(default)]
    pub val_frames: Option<u64>,
    /// Samples per second of training steps in this attempt (all ranks).
    #[serde(default)]
    pub samples_per_s: Option<f64>,
    /// Samples trained on (all ranks, all attempts).
    #[serde(default)]
    pub samples_seen: u64,
    /// Cache hits over cache reads of the loaders (all ranks).
    #[serde(default)]
    pub cache_hit_rate: Option<f64>,
    /// Reads the cache could not take, served from disk instead (all ranks).
    #[serde(default)]
    pub cache_bypass: u64,
    /// Mean per-rank loader wait, ms.
    #[serde(default)]
    pub data_time_ms: f64,
    /// Largest Pss of one rank, MiB.
    #[serde(default)]
    pub peak_pss_mb: f64,
    /// Steps skipped for inf/NaN.
    #[serde(default)]
    pub skipped_steps: u64,
    /// Last finite mean loss.
    #[serde(default)]
    pub final_loss: Option<f64>,
    /// Restarts before this attempt.
    #[serde(default)]
    pub restarts: u32,
    /// Mixed-precision mode (`off`, `bf16`, `fp16`).
    #[serde(default)]
    pub amp: String,
    /// Trainable parameters.
    #[serde(default)]
    pub parameters: u64,
    /// Seconds of this attempt, start to end.
    #[serde(default)]
    pub wall_s: f64,
    /// Seconds of this attempt spent in training steps.
    #[serde(default)]
    pub train_s: f64,
    /// The cache server the ranks of rank 0's node read through, when they chose
    /// it themselves (no launcher: torchrun, srun); the launcher's `summary.json`
    /// says it as `cache.sharing` otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_sharing: Option<CacheSharing>,
}

/// Whose cache server a job reads through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SharingMode {
    /// The node-shared one of the user and dataset (`DATA.CACHE_SHARING: node`).
    Node,
    /// The job's own.
    Job,
}

/// Which cache server a job's ranks on a node read through: the node-shared one,
/// or one of the job's own (by its config, or fallen back to from a node-shared
/// address that was not the job's to use).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheSharing {
    /// The node-shared server, or the job's own.
    pub mode: SharingMode,
    /// The server's address.
    pub address: String,
    /// The node-shared address the job fell back from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fell_back_from: Option<String>,
    /// What was found there (the uid, or the two protocol versions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
}

/// A summary file that cannot be written or read.
pub type SummaryError = JsonFileError;

/// The record's name in errors.
const WHAT: &str = "run summary";

impl RunSummary {
    /// Writes it to `path` atomically (a temporary file, then a rename).
    pub fn write(&self, path: &Path) -> Result<(), SummaryError> {
        json_file::write_atomic(WHAT, self, path)
    }

    /// Reads the summary at `path`.
    pub fn read(path: &Path) -> Result<RunSummary, SummaryError> {
        json_file::read(WHAT, path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example() -> RunSummary {
        RunSummary {
            status: TrainStatus::Preempted,
            steps: 3,
            total_steps: 8,
            world_size: 2,
            val_psnr: Some(30.5),
            val_ssim: None,
            input_psnr: Some(28.0),
            val_step: Some(3),
            val_frames: Some(6),
            samples_per_s: Some(12.5),
            samples_seen: 12,
            cache_hit_rate: None,
            cache_bypass: 7,
            data_time_ms: 1.5,
            peak_pss_mb: 300.0,
            skipped_steps: 0,
            final_loss: Some(0.25),
            restarts: 1,
            amp: "off".into(),
            parameters: 1234,
            wall_s: 4.0,
            train_s: 2.0,
            cache_sharing: Some(CacheSharing {
                mode: SharingMode::Job,
                address: "vrtspike-cache-j".into(),
                fell_back_from: Some("vrtspike-cache-u0-d".into()),
                why: Some("runs as uid 65534".into()),
            }),
        }
    }

    #[test]
    fn written_and_read_back() {
        let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = tmp.path().join("result.json");
        example().write(&path).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(RunSummary::read(&path).ok(), Some(example()));
        let names: Vec<_> = std::fs::read_dir(tmp.path())
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names, ["result.json"], "no temporary file left");
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(text.contains("\"status\": \"preempted\""), "{text}");
        assert!(text.contains("\"val_ssim\": null"), "{text}");
    }

    #[test]
    fn optional_figures_may_be_left_out_but_not_the_status() {
        let short = r#"{"status": "completed", "steps": 3, "total_steps": 3, "world_size": 2}"#;
        let summary: RunSummary = serde_json::from_str(short).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(summary.status, TrainStatus::Completed);
        assert_eq!((summary.val_psnr, summary.samples_seen), (None, 0));
        assert_eq!(summary.cache_bypass, 0);
        let no_status = r#"{"steps": 3, "total_steps": 3, "world_size": 2}"#;
        let err = serde_json::from_str::<RunSummary>(no_status).map_err(|e| e.to_string());
        assert!(err.is_err_and(|e| e.contains("status")));
        let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let bad = tmp.path().join("bad.json");
        std::fs::write(&bad, "{not json").unwrap_or_else(|e| panic!("{e}"));
        let err = RunSummary::read(&bad).map_err(|e| e.to_string());
        assert!(err.is_err_and(|e| e.contains("bad.json")));
    }
}
