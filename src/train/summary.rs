//! The summary of a run that rank 0 writes as `result.json` and
//! `train_summary.json` (which `vrtspike-launch` merges into `summary.json`):
//! figures gathered over ranks, then the contract's typed [`RunSummary`].

use vrtspike_contract::summary::{RunSummary, TrainStatus};

use crate::ddp::ReduceOp;

use super::env::RankEnv;

use super::run::Run;
use super::TrainError;

/// The summary file rank 0 writes in the run directory.
pub const RESULT_FILE: &str = vrtspike_contract::rundir::RESULT_FILE;
/// The same summary under the name `vrtspike-launch` merges into `summary.json`.
pub const TRAIN_SUMMARY_FILE: &str = vrtspike_contract::rundir::TRAIN_SUMMARY_FILE;

/// Loader and memory figures over all ranks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RankTotals {
    /// Cache hits of every rank.
    pub cache_hits: f64,
    /// Cache misses of every rank.
    pub cache_misses: f64,
    /// Reads of every rank that the cache could not take (read from disk).
    pub cache_bypass: f64,
    /// Mean over ranks of the mean wait per batch, in milliseconds.
    pub data_time_ms: f64,
    /// The highest PSS of any rank, in MB.
    pub peak_pss_mb: f64,
}

/// Gathers [`RankTotals`]; every rank must call it.
pub fn gather(run: &mut Run<'_>) -> Result<RankTotals, TrainError> {
    let stats = run.data.loader.stats();
    let monitor = &mut run.sinks.monitor;
    let pss = monitor.sample().pss_mb.max(monitor.peak_pss_mb);
    let local = [
        stats.cache_hits as f64,
        stats.cache_misses as f64,
        stats.data_time_ms,
        stats.cache_bypass as f64,
    ];
    let sums = run.comm.all_reduce(&local, ReduceOp::Sum)?;
    let peak = run.comm.all_reduce(&[pss], ReduceOp::Max)?;
    let at = |v: &[f64], i: usize| v.get(i).copied().unwrap_or(f64::NAN);
    Ok(RankTotals {
        cache_hits: at(&sums, 0),
        cache_misses: at(&sums, 1),
        cache_bypass: at(&sums, 3),
        data_time_ms: at(&sums, 2) / run.env.world_size as f64,
        peak_pss_mb: at(&peak, 0),
    })
}

/// The summary of `run` (the same on every rank).
pub fn summary(run: &Run<'_>, totals: &RankTotals) -> RunSummary {
    let (state, attempt) = (&run.state, &run.attempt);
    let total = run.config.train.total_steps;
    let status = if state.step >= total {
        TrainStatus::Completed
    } else if attempt.preempted {
        TrainStatus::Preempted
    } else {
        TrainStatus::Stopped
    };
    let val = attempt.last_val.map(|v| v.sums.means());
    let reads = totals.cache_hits + totals.cache_misses;
    let attempt_samples = state.samples_seen - attempt.start_samples;
    let samples_per_s = if attempt.step_seconds > 0.0 {
        attempt_samples as f64 / attempt.step_seconds
    } else {
        0.0
    };
    RunSummary {
        status,
        steps: state.step,
        total_steps: total,
        world_size: run.env.world_size as u32,
        val_psnr: val.map(|v| v.0),
        val_ssim: val.map(|v| v.1),
        input_psnr: val.map(|v| v.2),
        val_step: attempt.last_val.map(|v| v.step),
        val_frames: attempt.last_val.map(|v| v.sums.frames),
        samples_per_s: Some(samples_per_s),
        samples_seen: state.samples_seen,
        cache_hit_rate: (reads > 0.0).then(|| totals.cache_hits / reads),
        cache_bypass: if totals.cache_bypass.is_finite() {
            totals.cache_bypass.max(0.0) as u64
        } else {
            0
        },
        data_time_ms: totals.data_time_ms,
        peak_pss_mb: totals.peak_pss_mb,
        skipped_steps: state.skipped_steps,
        final_loss: attempt
            .losses
            .iter()
            .rev()
            .map(|l| l.1)
            .find(|l| l.is_finite()),
        restarts: run.env.restart_count,
        amp: run.model.amp.name().to_string(),
        parameters: u64::try_from(run.model.parameter_count).unwrap_or(0),
        wall_s: attempt.started.elapsed().as_secs_f64(),
        train_s: attempt.step_seconds,
        cache_sharing: run.env.cache_sharing.clone(),
    }
}

/// Writes `summary` as both summary files of the run directory, each atomically.
pub fn write(env: &RankEnv, summary: &RunSummary) -> Result<(), TrainError> {
    let layout = env.layout();
    for path in [layout.result(), layout.train_summary()] {
        summary
            .write(&path)
            .map_err(|e| TrainError::io(&e.path, e.message))?;
    }
    Ok(())
}
