//! Checkpoints: one directory per step under `<run>/checkpoints/` holding the model
//! weights (`model.safetensors`), the AdamW moments (`optimizer.safetensors`) and
//! the rest (`state.json`: step, schedule, loss scaler, sampler cursor, seeds, the
//! fixed parameter group).
//! Written to a hidden temporary directory, synced, then renamed, so a crash never
//! leaves a half-written checkpoint under a real name. Directory names and which
//! checkpoint is the latest come from `vrtspike_contract::rundir`, which the
//! launcher's restart decision uses too.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tch::{nn, Tensor};
use vrtspike_contract::rundir::{self, CHECKPOINT_STATE_FILE as STATE_FILE};

use crate::pipeline::sampler::SamplerState;

use super::amp::GradScaler;
use super::optim::{AdamW, FixedGroupState};
use super::schedule::CosineSchedule;

/// Why a checkpoint could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A file operation failed.
    #[error("checkpoint {path}: {message}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What failed.
        message: String,
    },
    /// The checkpoint does not fit this run.
    #[error("checkpoint {path}: {message}")]
    Mismatch {
        /// The checkpoint directory.
        path: PathBuf,
        /// What differs.
        message: String,
    },
}

/// Everything but the tensors (`state.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    /// Optimizer steps completed (the next step to run).
    pub step: u64,
    /// AdamW updates applied (steps skipped for inf/NaN do not count).
    pub optimizer_steps: u64,
    /// Steps skipped because of inf/NaN loss or gradients.
    pub skipped_steps: u64,
    /// Samples trained on over all ranks.
    pub samples_seen: u64,
    /// Rank 0's sampler cursor (every rank is at the same epoch and position).
    pub sampler: SamplerState,
    /// The fp16 loss scaler.
    pub scaler: GradScaler,
    /// The schedule it was trained with (the rate is a function of `step`).
    pub schedule: ScheduleState,
    /// `TRAIN.SEED`: libtorch's generator is re-seeded from it and the step before
    /// every step, and the loader's crops come from it, epoch, rank and position.
    pub seed: u64,
    /// Ranks of the run that wrote it.
    pub world_size: usize,
    /// Training seconds before this checkpoint (all attempts).
    pub train_seconds: f64,
    /// The optimizer's fixed parameter group (`TRAIN.FIX_KEYS`): its parameter
    /// names, checked on resume, and its AdamW step count. Absent in checkpoints
    /// written before parameter groups existed (read as no fixed group).
    #[serde(default)]
    pub fixed_group: FixedGroupState,
}

/// The schedule's parameters as saved.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ScheduleState {
    /// Peak learning rate.
    pub peak_lr: f64,
    /// Final learning rate.
    pub min_lr: f64,
    /// Warm-up steps.
    pub warmup_steps: u64,
    /// Total steps.
    pub total_steps: u64,
}

impl From<CosineSchedule> for ScheduleState {
    fn from(s: CosineSchedule) -> Self {
        ScheduleState {
            peak_lr: s.peak_lr,
            min_lr: s.min_lr,
            warmup_steps: s.warmup_steps,
            total_steps: s.total_steps,
        }
    }
}

pub use crate::eval::checkpoint::MODEL_FILE;
const OPTIM_FILE: &str = "optimizer.safetensors";

fn io_err(path: &Path) -> impl Fn(String) -> CheckpointError + '_ {
    move |message| CheckpointError::Io {
        path: path.to_path_buf(),
        message,
    }
}

pub use vrtspike_contract::rundir::step_dir_name;

/// Writes a checkpoint of `step` into `dir` (the run's `checkpoints/`) atomically
/// and returns its path; keeps the newest `keep` checkpoints (0: all).
pub fn save(
    dir: &Path,
    vs: &nn::VarStore,
    optimizer: &AdamW,
    state: &TrainState,
    keep: u32,
) -> Result<PathBuf, CheckpointError> {
    std::fs::create_dir_all(dir).map_err(|e| io_err(dir)(e.to_string()))?;
    let target = dir.join(step_dir_name(state.step));
    if target.join(STATE_FILE).is_file() {
        return Ok(target);
    }
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        step_dir_name(state.step),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir(&tmp).map_err(|e| io_err(&tmp)(e.to_string()))?;
    crate::model::save_safetensors(vs, &tmp.join(MODEL_FILE))
        .map_err(|e| io_err(&tmp)(e.to_string()))?;
    let moments: Vec<(String, Tensor)> = optimizer
        .state_tensors()
        .into_iter()
        .map(|(n, t)| (n, t.to_device(tch::Device::Cpu).contiguous()))
        .collect();
    Tensor::write_safetensors(&moments, tmp.join(OPTIM_FILE))
        .map_err(|e| io_err(&tmp.join(OPTIM_FILE))(e.to_string()))?;
    let json = serde_json::to_vec_pretty(state).map_err(|e| io_err(&tmp)(e.to_string()))?;
    let state_path = tmp.join(STATE_FILE);
    let mut file =
        std::fs::File::create(&state_path).map_err(|e| io_err(&state_path)(e.to_string()))?;
    file.write_all(&json)
        .and_then(|_| file.sync_all())
        .map_err(|e| io_err(&state_path)(e.to_string()))?;
    for name in [MODEL_FILE, OPTIM_FILE] {
        let path = tmp.join(name);
        std::fs::File::open(&path)
            .and_then(|f| f.sync_all())
            .map_err(|e| io_err(&path)(e.to_string()))?;
    }
    std::fs::rename(&tmp, &target).map_err(|e| io_err(&target)(e.to_string()))?;
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    if keep > 0 {
        prune(dir, keep as usize);
    }
    Ok(target)
}

/// Complete checkpoints under `dir`, oldest first: (step, path).
pub fn list(dir: &Path) -> Vec<(u64, PathBuf)> {
    rundir::list_checkpoints(dir)
        .into_iter()
        .map(|c| (c.step, c.path))
        .collect()
}

/// The latest complete checkpoint under `dir` (the contract's highest step).
pub fn latest(dir: &Path) -> Option<PathBuf> {
    rundir::latest_checkpoint(dir).map(|c| c.path)
}

fn prune(dir: &Path, keep: usize) {
    let all = list(dir);
    for (_, path) in all.iter().take(all.len().saturating_sub(keep)) {
        if let Err(e) = std::fs::remove_dir_all(path) {
            tracing::warn!(path = %path.display(), error = %e, "cannot remove an old checkpoint");
        }
    }
}

/// Loads the checkpoint at `path` into `vs` and `optimizer`; returns its state.
pub fn load(
    path: &Path,
    vs: &nn::VarStore,
    optimizer: &mut AdamW,
) -> Result<TrainState, CheckpointError> {
    let state_path = path.join(STATE_FILE);
    let text =
        std::fs::read_to_string(&state_path).map_err(|e| io_err(&state_path)(e.to_string()))?;
    let state: TrainState =
        serde_json::from_str(&text).map_err(|e| io_err(&state_path)(e.to_string()))?;
    crate::model::load_safetensors(vs, &path.join(MODEL_FILE)).map_err(|e| {
        CheckpointError::Mismatch {
            path: path.to_path_buf(),
            message: e.to_string(),
        }
    })?;
    let moments = Tensor::read_safetensors(path.join(OPTIM_FILE))
        .map_err(|e| io_err(&path.join(OPTIM_FILE))(e.to_string()))?;
    optimizer
        .load_state(&moments, state.optimizer_steps, &state.fixed_group)
        .map_err(|e| CheckpointError::Mismatch {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
    Ok(state)
}
