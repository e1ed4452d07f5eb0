//! One rank's training run from start (or its last checkpoint) to `TRAIN.TOTAL_STEPS`:
//! builds data, model, optimizer and process group, then runs optimizer steps with
//! gradient accumulation, DDP gradient averaging, AMP, NaN/inf skipping, metrics,
//! memory samples, parameter-hash checks, validation, checkpoints and preemption.
//! Rank 0 writes `result.json` (and `train_summary.json`, which the launcher merges).

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use serde_json::{json, Value};
use tch::{nn, Device, Kind, Tensor};
use vrtspike_contract::summary::{RunSummary, TrainStatus};

use crate::config::{Config, DistBackend};
use crate::dataset::{DataError, DatasetIndex, IndexOptions};
use crate::dist::{Backend, Ddp, DdpOptions, GroupOptions, ProcessGroup, ReduceOp};
use crate::eval::quality::QualitySums;
use crate::pipeline::loader::{Batch, Loader, LoaderOptions};
use crate::pipeline::sample::ClipIndex;
use crate::pipeline::sampler::DistributedSampler;

use super::amp::{AmpMode, GradScaler};
use super::checkpoint::{self, TrainState};
use super::env::RankEnv;
use super::loss::charbonnier;
use super::metrics::MetricsSink;
use super::monitor::MemoryMonitor;
use super::optim::AdamW;
use super::preempt;
use super::schedule::CosineSchedule;
use super::step::{apply_update, StepResult};
use super::validate::Validator;
use super::TrainError;

/// The summary file rank 0 writes in the run directory.
pub const RESULT_FILE: &str = vrtspike_contract::rundir::RESULT_FILE;
/// The same summary under the name `vrtspike-launch` merges into `summary.json`.
pub const TRAIN_SUMMARY_FILE: &str = vrtspike_contract::rundir::TRAIN_SUMMARY_FILE;

/// Knobs of one invocation (not of the run config).
#[derive(Debug, Clone, Default)]
pub struct TrainOptions {
    /// Stop (with a checkpoint, as on preemption) once this many steps are done,
    /// without changing the schedule, which still spans `TRAIN.TOTAL_STEPS`.
    pub stop_after_steps: Option<u64>,
}

/// How a run ended.
#[derive(Debug, Clone)]
pub struct TrainOutcome {
    /// Steps done (all attempts).
    pub steps: u64,
    /// Reached `TRAIN.TOTAL_STEPS`.
    pub completed: bool,
    /// Stopped by a preemption request or `stop_after_steps`, with a checkpoint.
    pub preempted: bool,
    /// Mean loss over ranks of each step of this attempt: (step number, loss).
    pub losses: Vec<(u64, f64)>,
    /// The summary rank 0 wrote (the same on every rank).
    pub summary: RunSummary,
}

fn io_error(path: &Path, e: impl std::fmt::Display) -> TrainError {
    TrainError::Io {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

/// The process group and DDP wrapper, or nothing for a single rank.
struct Comm {
    group: Option<ProcessGroup>,
    ddp: Option<Ddp>,
}

impl Comm {
    fn all_reduce(&mut self, values: &[f64], op: ReduceOp) -> Result<Vec<f64>, TrainError> {
        let mut t = Tensor::from_slice(values);
        if let Some(group) = &mut self.group {
            group.all_reduce(&mut t, op)?;
        }
        Ok(Vec::<f64>::try_from(&t)?)
    }

    fn barrier(&mut self) -> Result<(), TrainError> {
        if let Some(group) = &mut self.group {
            group.barrier()?;
        }
        Ok(())
    }
}

/// The next training batch, starting the next epoch when one ends.
fn next_batch(loader: &mut Loader) -> Result<Batch, TrainError> {
    for _ in 0..2 {
        match loader.next_batch() {
            Some(batch) => return Ok(batch?),
            None => {
                let epoch = loader.state().epoch + 1;
                tracing::debug!(epoch, "new epoch");
                loader.set_epoch(epoch);
            }
        }
    }
    Err(DataError::Request(
        "the training loader yields no batch (fewer clips than the batch size?)".into(),
    )
    .into())
}

/// Seed of libtorch's generator for step `step` (so a resumed run draws the same numbers).
fn step_seed(seed: u64, step: u64) -> i64 {
    (seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ step.wrapping_mul(0xBF58_476D_1CE4_E5B9)) as i64
        & i64::MAX
}

/// Trains this rank (see the module doc). Every rank of the job must call it.
pub fn train(
    config: &Config,
    env: &RankEnv,
    options: &TrainOptions,
) -> Result<TrainOutcome, TrainError> {
    let started = Instant::now();
    let (rank, world) = (env.rank, env.world_size);
    let device = env.device;
    std::fs::create_dir_all(env.checkpoint_dir())
        .map_err(|e| io_error(&env.checkpoint_dir(), e))?;

    // Data.
    let root = config.data.root.clone().ok_or_else(|| TrainError::Config {
        key: "DATA.ROOT".into(),
        message: "not set: the dataset root (e.g. written by `vrtspike synth --out DIR`)".into(),
    })?;
    if !root.is_dir() {
        return Err(TrainError::Config {
            key: "DATA.ROOT".into(),
            message: format!(
                "the dataset root {} does not exist or is not a directory",
                root.display()
            ),
        });
    }
    let index_options = IndexOptions::from_config(&config.data);
    let train_index = Arc::new(DatasetIndex::open(&root, "train", index_options)?);
    let clip_len = config.data.clip_len as usize;
    let clips = Arc::new(ClipIndex::new(&train_index, clip_len, 1, false));
    let val_index = match DatasetIndex::open(&root, "test", index_options) {
        Ok(index) => Some(Arc::new(index)),
        Err(DataError::Missing { path, .. }) => {
            tracing::warn!(path = %path.display(), "no validation split: validation skipped");
            None
        }
        Err(e) => return Err(e.into()),
    };

    // Process group.
    let mut comm = Comm {
        group: None,
        ddp: None,
    };
    if env.distributed() {
        let backend = match (config.dist.backend, device.is_cuda()) {
            (DistBackend::Nccl, _) | (DistBackend::Auto, true) => Backend::Nccl,
            _ => Backend::Gloo,
        };
        let mut group_options = GroupOptions::for_rank(
            &env.contract,
            backend,
            std::time::Duration::from_secs(config.dist.timeout_s),
        )?;
        group_options.prefix = format!("train-attempt{}", env.restart_count);
        comm.group = Some(ProcessGroup::new(&group_options)?);
    }

    // Model and optimizer.
    tch::manual_seed(config.train.seed as i64);
    let vs = nn::VarStore::new(device);
    let model = crate::model::build(&vs.root(), &config.model)?;
    let mut named: Vec<(String, Tensor)> = vs
        .variables()
        .into_iter()
        .filter(|(_, t)| t.requires_grad())
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let params: Vec<Tensor> = named.into_iter().map(|(_, t)| t).collect();
    let parameter_count: i64 = params.iter().map(|p| p.numel() as i64).sum();
    let tc = &config.train;
    let mut optimizer = AdamW::new(
        params.iter().map(|p| p.shallow_clone()).collect(),
        tc.betas,
        tc.eps,
        tc.weight_decay,
    );
    let schedule = CosineSchedule::from_config(tc);
    let amp = AmpMode::from_config(tc, device);

    // Resume.
    let sampler = DistributedSampler::new(clips.clips.len(), world, rank, true, tc.seed, false)?;
    let fresh_state = TrainState {
        step: 0,
        optimizer_steps: 0,
        skipped_steps: 0,
        samples_seen: 0,
        sampler: sampler.state(),
        scaler: GradScaler::new(amp == AmpMode::Fp16),
        schedule: schedule.into(),
        seed: tc.seed,
        world_size: world,
        train_seconds: 0.0,
    };
    let latest = checkpoint::latest(&env.checkpoint_dir());
    let mut state = match &latest {
        Some(path) => {
            let state = checkpoint::load(path, &vs, &mut optimizer)?;
            if rank == 0 {
                tracing::info!(checkpoint = %path.display(), step = state.step, "resuming");
            }
            state
        }
        None => fresh_state,
    };
    // Every rank must resume from the same step (a run directory not shared by all
    // nodes would silently mix fresh and resumed optimizer state).
    let highest = comm.all_reduce(&[state.step as f64], ReduceOp::Max)?[0];
    let lowest = comm.all_reduce(&[state.step as f64], ReduceOp::Min)?[0];
    if highest != lowest {
        return Err(TrainError::Config {
            key: "run directory".into(),
            message: format!(
                "ranks resume from different steps ({lowest} to {highest}; this rank {} from {}): \
                 every node must see the same {}",
                rank,
                state.step,
                env.checkpoint_dir().display()
            ),
        });
    }
    if let Some(group) = &mut comm.group {
        comm.ddp = Some(Ddp::new(
            group,
            params.iter().map(|p| p.shallow_clone()).collect(),
            DdpOptions::default(),
        )?);
    }

    // Loaders.
    let loader_options = LoaderOptions::from_config(
        config,
        rank,
        env.local_world_size,
        true,
        env.cache_addr.clone(),
    );
    if config.data.use_ram_cache && env.cache_addr.is_none() && rank == 0 {
        tracing::warn!("no cache server (VRTSPIKE_CACHE_ADDR unset): reading from disk");
    }
    let mut loader = Loader::new(train_index.clone(), clips.clone(), sampler, loader_options)?;
    if latest.is_some() {
        let mut cursor = state.sampler;
        cursor.rank = rank;
        loader.restore(&cursor)?;
    }
    let mut validator = match val_index {
        Some(index) => Some(Validator::new(config, index, env, amp)?),
        None => None,
    };

    let total = tc.total_steps;
    let stop_at = options.stop_after_steps.map_or(total, |s| s.min(total));
    let log = &config.log;
    let mut sink = MetricsSink::new(&env.run_dir, rank == 0, state.step, total)
        .map_err(|e| io_error(&env.run_dir, e))?;
    let mut monitor = MemoryMonitor::new(match device {
        Device::Cuda(n) => Some(n),
        _ => None,
    });
    if let Err(e) = preempt::install() {
        tracing::warn!(error = %e, "cannot install the SIGUSR2 handler: preemption requests will kill this rank");
    }
    if rank == 0 {
        tracing::info!(
            world,
            params = parameter_count,
            clips = clips.clips.len(),
            val_clips = validator.as_ref().map_or(0, |v| v.clips()),
            start_step = state.step,
            total_steps = total,
            amp = amp.name(),
            device = ?device,
            "training"
        );
        sink.write(
            "event",
            json!({"event": "start", "step": state.step, "world_size": world, "restart_count": env.restart_count,
                   "resumed_from": latest.as_ref().map(|p| p.display().to_string()), "parameters": parameter_count}),
        );
    }

    let accum = tc.gradient_accumulation_steps as usize;
    let start_samples = state.samples_seen;
    let mut train_seconds = 0.0f64;
    let mut attempt_step_seconds = 0.0f64;
    let mut losses = Vec::new();
    let mut window = (Instant::now(), 0u64, 0.0f64, 0u64, 0.0f64);
    let mut last_val: Option<QualitySums> = None;
    let mut last_val_step = None;
    let mut preempted = false;
    let mut checked_at = None;

    while state.step < stop_at {
        let step_started = Instant::now();
        let step = state.step;
        let lr = schedule.lr_at(step);
        tch::manual_seed(step_seed(tc.seed, step));
        optimizer.zero_grad();
        let (mut local_loss, mut local_bad, mut bad_samples, mut local_samples) =
            (0.0f64, false, Vec::new(), 0usize);
        let mut input_loss = 0.0f64;
        for _ in 0..accum {
            let batch = next_batch(&mut loader)?;
            let (blur, sharp, voxels) = batch.to_tensors(device)?;
            let voxels = model.uses_voxels().then_some(&voxels);
            let output = amp.run(|| model.forward(&blur, voxels, true))?;
            let loss = charbonnier(&output.to_kind(Kind::Float), &sharp, tc.charbonnier_eps)
                / accum as f64;
            let value = loss.double_value(&[]);
            input_loss +=
                tch::no_grad(|| charbonnier(&blur, &sharp, tc.charbonnier_eps).double_value(&[]))
                    / accum as f64;
            local_samples += batch.samples.len();
            if value.is_finite() {
                local_loss += value;
                state.scaler.scale_loss(&loss).backward();
            } else {
                local_bad = true;
                bad_samples.extend(
                    batch
                        .samples
                        .iter()
                        .map(|s| format!("{}/{}", s.sequence, s.frames.join("+"))),
                );
            }
        }
        if let (Some(ddp), Some(group)) = (&mut comm.ddp, &mut comm.group) {
            ddp.sync_gradients(group)?;
        }
        let flags = [
            if local_bad { 0.0 } else { local_loss },
            f64::from(u8::from(local_bad)),
            f64::from(u8::from(preempt::requested())),
            local_samples as f64,
            input_loss,
        ];
        let reduced = comm.all_reduce(&flags, ReduceOp::Sum)?;
        let (loss_sum, bad_ranks, preempt_ranks, step_samples) =
            (reduced[0], reduced[1], reduced[2], reduced[3] as u64);
        window.4 += reduced[4] / world as f64;
        if local_bad {
            tracing::warn!(step = step + 1, rank, samples = ?bad_samples, "non-finite loss: the step is skipped on every rank, weights untouched");
        }
        let result = apply_update(
            &mut optimizer,
            &mut state.scaler,
            bad_ranks > 0.0,
            lr,
            tc.grad_clip(),
        );
        state.step += 1;
        state.samples_seen += step_samples;
        state.optimizer_steps = optimizer.steps();
        let good_ranks = world as f64 - bad_ranks;
        let mean_loss = if good_ranks > 0.0 {
            loss_sum / good_ranks
        } else {
            f64::NAN
        };
        losses.push((state.step, mean_loss));
        let grad_norm = match result {
            StepResult::Applied { grad_norm } => grad_norm,
            StepResult::Skipped { nonfinite_loss } => {
                state.skipped_steps += 1;
                if rank == 0 {
                    tracing::warn!(
                        step = state.step,
                        nonfinite_loss,
                        "step skipped: inf/NaN loss or gradients"
                    );
                    sink.write("event", json!({"event": "skipped_step", "step": state.step, "nonfinite_loss": nonfinite_loss,
                        "samples": bad_samples, "loss_scale": state.scaler.scale}));
                }
                f64::NAN
            }
        };
        let step_time = step_started.elapsed().as_secs_f64();
        train_seconds += step_time;
        attempt_step_seconds += step_time;
        window.1 += step_samples;
        window.2 += if mean_loss.is_finite() {
            mean_loss
        } else {
            0.0
        };
        window.3 += 1;

        if state.step % log.log_every_steps == 0 || state.step == stop_at {
            let elapsed = window.0.elapsed().as_secs_f64().max(1e-9);
            let stats = loader.stats();
            let samples_per_s = window.1 as f64 / elapsed;
            let avg_loss = window.2 / window.3.max(1) as f64;
            if rank == 0 {
                sink.write("train", json!({
                    "step": state.step, "epoch": loader.state().epoch, "loss": avg_loss, "lr": lr,
                    "input_loss": window.4 / window.3.max(1) as f64,
                    "grad_norm": if grad_norm.is_finite() { json!(grad_norm) } else { Value::Null },
                    "samples_per_s": samples_per_s, "data_time_ms": stats.data_time_ms,
                    "cache_hit_rate": stats.hit_rate, "loss_scale": state.scaler.scale,
                    "skipped_steps": state.skipped_steps,
                }));
                sink.progress(state.step, format!(
                    "loss {avg_loss:.4} lr {lr:.2e} {samples_per_s:.1} samples/s data {:.0} ms hit {:.0}%",
                    stats.data_time_ms,
                    100.0 * stats.hit_rate
                ));
            }
            window = (Instant::now(), 0, 0.0, 0, 0.0);
        }
        if state.step % log.mem_every_steps == 0 {
            let sample = monitor.sample();
            tracing::debug!(rank, step = state.step, ?sample, "memory");
            if rank == 0 {
                let mut fields = serde_json::to_value(&sample).unwrap_or(Value::Null);
                if let Value::Object(map) = &mut fields {
                    map.insert("step".into(), json!(state.step));
                }
                sink.write("memory", fields);
            }
        }
        if tc.param_check_every > 0 && state.step % tc.param_check_every == 0 {
            if let (Some(ddp), Some(group)) = (&comm.ddp, &mut comm.group) {
                ddp.check_parameters(group, state.step)?;
                checked_at = Some(state.step);
            }
        }
        let finished = state.step == total;
        preempted = !finished && (preempt_ranks > 0.0 || state.step == stop_at);
        if state.step % log.val_every_steps == 0 || finished {
            if let Some(v) = &mut validator {
                let t = Instant::now();
                let sums = v.run(model.as_ref())?;
                let all = QualitySums::from_tensor(&Tensor::from_slice(
                    &comm.all_reduce(&Vec::<f64>::try_from(&sums.to_tensor())?, ReduceOp::Sum)?,
                ));
                let (psnr, ssim, input) = all.means();
                if rank == 0 {
                    sink.write("val", json!({"step": state.step, "val_psnr": psnr, "val_ssim": ssim, "input_psnr": input,
                        "frames": all.frames, "val_s": t.elapsed().as_secs_f64()}));
                    sink.println(&format!(
                        "step {}: val PSNR {psnr:.2} dB (input {input:.2} dB, {:+.2} dB), SSIM {ssim:.4}, {} frames",
                        state.step,
                        psnr - input,
                        all.frames
                    ));
                }
                last_val = Some(all);
                last_val_step = Some(state.step);
            }
        }
        if state.step % log.ckpt_every_steps == 0 || finished || preempted {
            state.sampler = loader.state();
            state.sampler.rank = 0;
            state.train_seconds += train_seconds;
            train_seconds = 0.0;
            if rank == 0 {
                let path = checkpoint::save(
                    &env.checkpoint_dir(),
                    &vs,
                    &optimizer,
                    &state,
                    log.keep_checkpoints,
                )?;
                tracing::info!(step = state.step, path = %path.display(), "checkpoint saved");
                sink.write("event", json!({"event": "checkpoint", "step": state.step, "path": path.display().to_string()}));
            }
            comm.barrier()?;
        }
        if preempted {
            if rank == 0 {
                tracing::info!(
                    step = state.step,
                    "stopping after a checkpoint (preemption request or --stop-after-steps)"
                );
                sink.write("event", json!({"event": "preempted", "step": state.step}));
            }
            break;
        }
    }
    sink.finish();
    if tc.param_check_every > 0 && checked_at != Some(state.step) {
        if let (Some(ddp), Some(group)) = (&comm.ddp, &mut comm.group) {
            ddp.check_parameters(group, state.step)?;
        }
    }

    // Summary over ranks.
    let stats = loader.stats();
    let pss = monitor.sample().pss_mb.max(monitor.peak_pss_mb);
    let sums = comm.all_reduce(
        &[
            stats.cache_hits as f64,
            stats.cache_misses as f64,
            stats.data_time_ms,
        ],
        ReduceOp::Sum,
    )?;
    let peak = comm.all_reduce(&[pss], ReduceOp::Max)?;
    let reads = sums[0] + sums[1];
    let attempt_samples = state.samples_seen - start_samples;
    let means = last_val.map(|v| v.means());
    let status = if state.step >= total {
        TrainStatus::Completed
    } else if preempted {
        TrainStatus::Preempted
    } else {
        TrainStatus::Stopped
    };
    let final_loss = losses.iter().rev().map(|l| l.1).find(|l| l.is_finite());
    let summary = RunSummary {
        status,
        steps: state.step,
        total_steps: total,
        world_size: world as u32,
        val_psnr: means.map(|m| m.0),
        val_ssim: means.map(|m| m.1),
        input_psnr: means.map(|m| m.2),
        val_step: last_val_step,
        val_frames: last_val.map(|v| v.frames),
        samples_per_s: Some(if attempt_step_seconds > 0.0 {
            attempt_samples as f64 / attempt_step_seconds
        } else {
            0.0
        }),
        samples_seen: state.samples_seen,
        cache_hit_rate: (reads > 0.0).then(|| sums[0] / reads),
        data_time_ms: sums[2] / world as f64,
        peak_pss_mb: peak[0],
        skipped_steps: state.skipped_steps,
        final_loss,
        restarts: env.restart_count,
        amp: amp.name().to_string(),
        parameters: u64::try_from(parameter_count).unwrap_or(0),
        wall_s: started.elapsed().as_secs_f64(),
        train_s: attempt_step_seconds,
    };
    if rank == 0 {
        for path in [env.layout().result(), env.layout().train_summary()] {
            summary
                .write(&path)
                .map_err(|e| io_error(&e.path, e.message))?;
        }
    }
    Ok(TrainOutcome {
        steps: state.step,
        completed: state.step >= total,
        preempted,
        losses,
        summary,
    })
}
