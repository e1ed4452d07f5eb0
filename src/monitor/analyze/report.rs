//! What the analyser reports: the symptom table's limits ([`Thresholds`]), the
//! figures it reads from a run (time split, memory, the slowest stage, restarts)
//! and its findings, gathered in a [`Diagnosis`] (serialised as `vrtspike analyze
//! --json` prints it).

use serde::Serialize;

/// The symptom table's limits.
#[derive(Debug, Clone, Serialize)]
pub struct Thresholds {
    /// GPU utilisation below this (percent) points at the loader.
    pub gpu_util_pct: f64,
    /// A forward pass above this (ms) points at the model.
    pub forward_ms: f64,
    /// A cache hit rate below this points at the cache.
    pub hit_rate: f64,
    /// A data wait above this (ms per step) points at the loader.
    pub data_time_ms: f64,
    /// Validation above this share of the wall time is worth thinning.
    pub val_share: f64,
    /// Pss growth over the measured steps above this share of its mean is a leak.
    pub leak_growth: f64,
    /// Host or device memory past this share of the total leaves little headroom.
    pub memory_used: f64,
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds {
            gpu_util_pct: 50.0,
            forward_ms: 1500.0,
            hit_rate: 0.60,
            data_time_ms: 10.0,
            val_share: 0.20,
            leak_growth: 0.10,
            memory_used: 0.90,
        }
    }
}

/// What a finding is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Area {
    /// Data loading.
    Loader,
    /// The model's own compute.
    Model,
    /// The shared-memory cache.
    Cache,
    /// Gradient synchronisation.
    Communication,
    /// Validation passes.
    Validation,
    /// Memory headroom.
    Memory,
    /// Memory that grows with steps.
    Leak,
    /// Restarts of the job.
    Restarts,
    /// Skipped (non-finite) steps.
    Stability,
}

/// One row of the diagnosis table.
#[derive(Debug, Clone, Serialize)]
pub struct Finding {
    /// The part at fault.
    pub area: Area,
    /// What was seen.
    pub symptom: String,
    /// The figure, formatted.
    pub measured: String,
    /// The limit it crossed.
    pub limit: String,
    /// The concrete change to try.
    pub change: String,
}

/// Where a training step's time goes (means per optimizer step).
#[derive(Debug, Clone, Default, Serialize)]
pub struct TimeSplit {
    /// Wall time per step outside validation, ms.
    pub step_ms: Option<f64>,
    /// Waiting for data per step, ms (the window's wait for batches).
    pub data_ms: Option<f64>,
    /// Gradient synchronisation per step, ms (when the metrics record it).
    pub comm_ms: Option<f64>,
    /// The rest of the step: forward, backward, optimizer, checkpoints, ms.
    pub compute_ms: Option<f64>,
    /// Seconds of training measured between metrics lines.
    pub train_s: f64,
    /// Seconds of validation.
    pub validation_s: f64,
    /// Validation's share of train + validation time.
    pub validation_share: Option<f64>,
}

/// Memory figures: peaks, headroom and the Pss trend.
#[derive(Debug, Clone, Default, Serialize)]
pub struct MemoryReport {
    /// Largest process Pss, MiB.
    pub peak_pss_mb: Option<f64>,
    /// Least-squares slope of Pss over steps, MiB per 1,000 steps.
    pub pss_slope_mb_per_1k_steps: Option<f64>,
    /// Pss growth predicted by the slope over the measured steps, MiB.
    pub pss_growth_mb: Option<f64>,
    /// Largest host memory in use, GiB, and the host's total.
    pub system_used_gb: Option<f64>,
    /// Host memory, GiB.
    pub system_total_gb: Option<f64>,
    /// Largest device memory in use (NVML), GiB.
    pub gpu_used_gb: Option<f64>,
    /// Device memory, GiB.
    pub gpu_total_gb: Option<f64>,
    /// Largest CUDA allocator reservation, GiB.
    pub gpu_reserved_gb: Option<f64>,
}

/// The slowest stage (from the profile, else from the time split).
#[derive(Debug, Clone, Serialize)]
pub struct Stage {
    /// Its name.
    pub name: String,
    /// Its time, ms.
    pub ms: f64,
}

/// A restart of the job.
#[derive(Debug, Clone, Serialize)]
pub struct Restart {
    /// Step it resumed at.
    pub step: f64,
    /// The launcher's restart count.
    pub restart_count: u64,
}

/// The whole diagnosis.
#[derive(Debug, Clone, Serialize)]
pub struct Diagnosis {
    /// Steps done (summary, else the last metrics line).
    pub steps: Option<f64>,
    /// Time split.
    pub time: TimeSplit,
    /// The slowest stage.
    pub slowest_stage: Option<Stage>,
    /// Forward pass time from the profile, ms.
    pub forward_ms: Option<f64>,
    /// Mean GPU utilisation, percent.
    pub gpu_util_pct: Option<f64>,
    /// Memory.
    pub memory: MemoryReport,
    /// Cache hit rate (summary, else the last metrics line).
    pub cache_hit_rate: Option<f64>,
    /// Cache evictions (the cache server's statistics).
    pub cache_evictions: Option<u64>,
    /// Restarts, from the metrics' start events.
    pub restarts: Vec<Restart>,
    /// Failure causes from the summary and the logs.
    pub restart_causes: Vec<String>,
    /// Steps skipped for non-finite losses or gradients.
    pub skipped_steps: u64,
    /// Findings, most important first.
    pub findings: Vec<Finding>,
    /// The limits used.
    pub thresholds: Thresholds,
}
