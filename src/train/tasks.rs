//! What a run does between optimizer steps, each behind one small interface
//! ([`PeriodicTask`]): the `train` log line, memory samples, parameter-hash checks
//! over ranks, validation and checkpoints, in that order.

use std::time::Instant;

use serde_json::{json, Value};
use tch::{Device, Tensor};

use crate::cache::{CacheClient, CacheError};
use crate::ddp::ReduceOp;
use crate::eval::quality::QualitySums;
use crate::monitor::logline::{eta_seconds, format_eta, format_log_line, LogLine};
use crate::monitor::tensorboard::RgbImage;

use super::checkpoint;
use super::heartbeat::{self, Phase};
use super::report::StepReport;
use super::run::{Run, Validation};
use super::validate::Preview;
use super::TrainError;
use crate::util::readback;

/// Work a run does after some steps.
pub trait PeriodicTask {
    /// Whether it runs after the step of `report`.
    fn due(&self, report: &StepReport) -> bool;
    /// Runs it (on every rank: a task may use collectives).
    fn run(&mut self, run: &mut Run<'_>, report: &StepReport) -> Result<(), TrainError>;
    /// Runs once after the last step.
    fn finish(&mut self, _run: &mut Run<'_>) -> Result<(), TrainError> {
        Ok(())
    }
}

/// The tasks of a run from its `LOG` and `TRAIN` settings, in the order they run.
pub fn standard(run: &Run<'_>) -> Vec<Box<dyn PeriodicTask>> {
    let (log, tc) = (&run.config.log, &run.config.train);
    let mut tasks: Vec<Box<dyn PeriodicTask>> = vec![
        Box::new(LogTrain {
            every: log.log_every_steps,
            stop_at: run.stop_at,
            last: Marks::now(run),
            cache: CacheProbe::default(),
        }),
        Box::new(SampleMemory {
            every: log.mem_every_steps,
        }),
    ];
    if tc.param_check_every > 0 {
        tasks.push(Box::new(CheckParameters {
            every: tc.param_check_every,
            checked_at: None,
        }));
    }
    if run.data.validator.is_some() {
        tasks.push(Box::new(Validate {
            every: log.val_every_steps,
        }));
    }
    tasks.push(Box::new(Checkpoint {
        every: log.ckpt_every_steps,
    }));
    tasks
}

/// The `train` line of `metrics.jsonl`, rank 0's log line and the progress bar
/// (`LOG.LOG_EVERY_STEPS` and the last step of the attempt), averaged since the
/// previous line.
pub struct LogTrain {
    every: u64,
    stop_at: u64,
    /// Cumulative figures at the previous line.
    last: Marks,
    cache: CacheProbe,
}

/// Cumulative timers and counts read at each `train` line (their differences give
/// the window's).
#[derive(Debug, Default, Clone, Copy)]
struct Marks {
    step_seconds: f64,
    sync_seconds: f64,
    data_seconds: f64,
    /// Reads this rank's loader took from disk because the cache could not take them.
    cache_bypass: u64,
    /// Tensor values read back to the host (`util::readback`).
    host_reads: u64,
}

impl Marks {
    fn now(run: &Run<'_>) -> Marks {
        let loader = run.data.loader.stats();
        Marks {
            step_seconds: run.attempt.step_seconds,
            sync_seconds: run.comm.sync_seconds(),
            data_seconds: loader.data_time_s,
            cache_bypass: loader.cache_bypass,
            host_reads: readback::count(),
        }
    }
}

/// Milliseconds per step of `seconds` over `steps`.
fn per_step_ms(seconds: f64, steps: u64) -> f64 {
    1000.0 * seconds.max(0.0) / steps.max(1) as f64
}

impl PeriodicTask for LogTrain {
    fn due(&self, report: &StepReport) -> bool {
        report.step % self.every == 0 || report.step == self.stop_at
    }

    fn run(&mut self, run: &mut Run<'_>, report: &StepReport) -> Result<(), TrainError> {
        let settled = run.settle()?;
        let window = std::mem::take(&mut run.attempt.window);
        let (marks, last) = (Marks::now(run), self.last);
        self.last = marks;
        if run.env.rank != 0 {
            return Ok(());
        }
        let steps = window.steps;
        let step_ms = per_step_ms(marks.step_seconds - last.step_seconds, steps);
        let data_ms = per_step_ms(marks.data_seconds - last.data_seconds, steps);
        let cache_bypass = marks.cache_bypass.saturating_sub(last.cache_bypass);
        let comm_ms = per_step_ms(marks.sync_seconds - last.sync_seconds, steps);
        let wall_per_step = window.started.elapsed().as_secs_f64() / steps.max(1) as f64;
        let eta_s = eta_seconds(report.step, run.config.train.total_steps, wall_per_step);
        let (stats, lr, epoch) = (
            run.data.loader.stats(),
            report.lr,
            run.data.loader.state().epoch,
        );
        // Samples over the time in steps: validation and checkpoints in the window
        // do not pull the training throughput down.
        let samples_per_s = window.samples as f64 / (step_ms * steps as f64 / 1000.0).max(1e-9);
        let avg_loss = window.mean_loss();
        let grad_norm = settled.last().map_or(f64::NAN, |s| s.grad_norm);
        let host_reads = marks.host_reads - last.host_reads;
        let evictions = self.cache.evictions(run.env.cache_addr.as_deref());
        run.sinks.metrics.write("train", json!({
            "step": report.step, "epoch": epoch, "loss": avg_loss, "lr": lr,
            "input_loss": window.mean_input_loss(),
            "grad_norm": if grad_norm.is_finite() { json!(grad_norm) } else { Value::Null },
            "samples_per_s": samples_per_s, "data_time_ms": data_ms, "step_time_ms": step_ms,
            "comm_time_ms": comm_ms, "cache_hit_rate": stats.hit_rate, "cache_evictions": evictions,
            "cache_bypass": cache_bypass,
            "loss_scale": run.state.scaler.scale, "skipped_steps": run.state.skipped_steps,
            "host_reads": host_reads,
        }));
        let losses = [("l_pix", avg_loss), ("l_input", window.mean_input_loss())];
        run.sinks.metrics.println(&format_log_line(&LogLine {
            epoch,
            iter: report.step,
            lr,
            eta_s,
            iter_time_s: step_ms / 1000.0,
            data_time_s: data_ms / 1000.0,
            cache_bypass,
            losses: &losses,
        }));
        let eta = eta_s.map_or_else(|| "?".to_string(), format_eta);
        let bypass = match cache_bypass {
            0 => String::new(),
            n => format!(" | bypass {n}"),
        };
        run.sinks.metrics.progress(
            report.step,
            format!(
                "eta {eta} | {samples_per_s:.1} samples/s | loss {avg_loss:.4} | data {data_ms:.0} ms | hit {:.0}%{bypass}",
                100.0 * stats.hit_rate
            ),
        );
        Ok(())
    }
}

/// Rank 0's connection to the node's cache server for its eviction count; without
/// a server, or after a failed request (warned once), there is none.
#[derive(Default)]
struct CacheProbe {
    client: Option<CacheClient>,
    failed: bool,
}

impl CacheProbe {
    /// Records the server has evicted so far.
    fn evictions(&mut self, address: Option<&str>) -> Option<u64> {
        let address = address?;
        if self.failed {
            return None;
        }
        if self.client.is_none() {
            match CacheClient::connect(address, "rank0-metrics") {
                Ok(client) => self.client = Some(client),
                Err(e) => return self.give_up(&e),
            }
        }
        match self.client.as_ref()?.stats() {
            Ok(report) => Some(report.evictions),
            Err(e) => self.give_up(&e),
        }
    }

    fn give_up(&mut self, error: &CacheError) -> Option<u64> {
        tracing::warn!(error = %error, "cache statistics unavailable: evictions not logged");
        self.failed = true;
        self.client = None;
        None
    }
}

/// A memory sample (`LOG.MEM_EVERY_STEPS`): logged on every rank, written by rank 0.
pub struct SampleMemory {
    every: u64,
}

impl PeriodicTask for SampleMemory {
    fn due(&self, report: &StepReport) -> bool {
        report.step % self.every == 0
    }

    fn run(&mut self, run: &mut Run<'_>, report: &StepReport) -> Result<(), TrainError> {
        let sample = run.sinks.monitor.sample();
        tracing::debug!(rank = run.env.rank, step = report.step, ?sample, "memory");
        if run.env.rank == 0 {
            let mut fields = serde_json::to_value(&sample).unwrap_or(Value::Null);
            if let Value::Object(map) = &mut fields {
                map.insert("step".into(), json!(report.step));
                if let Device::Cuda(n) = run.env.device {
                    map.insert("device".into(), json!(n));
                }
            }
            run.sinks.metrics.write("memory", fields);
        }
        Ok(())
    }
}

/// Compares the ranks' parameter hashes (`TRAIN.PARAM_CHECK_EVERY`, and after the
/// last step when that was not a check step).
pub struct CheckParameters {
    every: u64,
    /// The last step checked, and the hash the ranks agreed on.
    checked_at: Option<(u64, u64)>,
}

impl PeriodicTask for CheckParameters {
    fn due(&self, report: &StepReport) -> bool {
        report.step % self.every == 0
    }

    fn run(&mut self, run: &mut Run<'_>, report: &StepReport) -> Result<(), TrainError> {
        if let Some(hash) = run.comm.check_parameters(report.step)? {
            self.checked_at = Some((report.step, hash));
        }
        Ok(())
    }

    /// Checks after the last step (unless that step was checked) and logs the
    /// hash every rank agreed on: the same line on every rank and node.
    fn finish(&mut self, run: &mut Run<'_>) -> Result<(), TrainError> {
        let step = run.state.step;
        let agreed = match self.checked_at {
            Some((at, hash)) if at == step => Some(hash),
            _ => run.comm.check_parameters(step)?,
        };
        if let Some(hash) = agreed {
            tracing::info!(
                rank = run.env.rank,
                step,
                "final parameters agree across ranks: hash {hash:016x}"
            );
        }
        Ok(())
    }
}

/// Validation over all ranks (`LOG.VAL_EVERY_STEPS` and `TRAIN.TOTAL_STEPS`).
pub struct Validate {
    every: u64,
}

impl PeriodicTask for Validate {
    fn due(&self, report: &StepReport) -> bool {
        report.step % self.every == 0 || report.finished
    }

    fn run(&mut self, run: &mut Run<'_>, report: &StepReport) -> Result<(), TrainError> {
        let Some(validator) = &mut run.data.validator else {
            return Ok(());
        };
        heartbeat::beat(report.step, Phase::Validation);
        let started = Instant::now();
        let keep = if run.env.rank == 0 && run.sinks.metrics.tensorboard().is_some() {
            PREVIEW_CLIPS
        } else {
            0
        };
        let (sums, previews) = validator
            .run(run.model.model.as_ref(), keep)
            .map_err(|e| super::oom::at_step(e, report.step))?;
        let all = run.comm.all_reduce(&sums.to_values(), ReduceOp::Sum)?;
        let all = QualitySums::from_values(&all);
        let (psnr, ssim, input) = all.means();
        if run.env.rank == 0 {
            run.sinks.metrics.write(
                "val",
                json!({"step": report.step, "val_psnr": psnr, "val_ssim": ssim, "input_psnr": input,
                "frames": all.frames, "val_s": started.elapsed().as_secs_f64()}),
            );
            write_previews(run, report.step, &previews);
            run.sinks.metrics.println(&format!(
                "step {}: val PSNR {psnr:.2} dB (input {input:.2} dB, {:+.2} dB), SSIM {ssim:.4}, {} frames",
                report.step,
                psnr - input,
                all.frames
            ));
        }
        run.attempt.last_val = Some(Validation {
            step: report.step,
            sums: all,
        });
        Ok(())
    }
}

/// Validation clips of rank 0 shown in TensorBoard (first frame, blur | output | sharp).
const PREVIEW_CLIPS: usize = 3;

/// Writes each preview as `val/images/clip<N>` (blur | output | sharp).
fn write_previews(run: &mut Run<'_>, step: u64, previews: &[Preview]) {
    let Some(tb) = run.sinks.metrics.tensorboard() else {
        return;
    };
    for (n, preview) in previews.iter().enumerate() {
        let panels: Option<Vec<RgbImage>> = [&preview.blur, &preview.output, &preview.sharp]
            .into_iter()
            .map(rgb_image)
            .collect();
        let image = panels.and_then(|p| RgbImage::side_by_side(&[&p[0], &p[1], &p[2]], 4));
        match image {
            Some(image) => tb.image(step as i64, &format!("val/images/clip{n}"), &image),
            None => tracing::debug!(
                clip = n,
                "validation preview of an unexpected shape skipped"
            ),
        }
    }
}

/// An image of a CHW float tensor in [0, 1] (1 or 3 channels); `None` otherwise.
fn rgb_image(t: &Tensor) -> Option<RgbImage> {
    let size = t.size();
    let [c, h, w] = size[..] else {
        return None;
    };
    let data = readback::values::<f32>(t).ok()?;
    RgbImage::from_chw(
        &data,
        c as usize,
        u32::try_from(h).ok()?,
        u32::try_from(w).ok()?,
    )
}

/// A checkpoint written by rank 0 (`LOG.CKPT_EVERY_STEPS`, the last step, and
/// before stopping early), then a barrier.
pub struct Checkpoint {
    every: u64,
}

impl PeriodicTask for Checkpoint {
    fn due(&self, report: &StepReport) -> bool {
        report.step % self.every == 0 || report.finished || report.preempted
    }

    fn run(&mut self, run: &mut Run<'_>, report: &StepReport) -> Result<(), TrainError> {
        heartbeat::beat(report.step, Phase::Checkpoint);
        run.settle()?;
        let state = &mut run.state;
        state.sampler = run.data.loader.state();
        state.sampler.rank = 0;
        state.train_seconds += std::mem::take(&mut run.attempt.unsaved_seconds);
        if run.env.rank == 0 {
            let path = checkpoint::save(
                &run.env.checkpoint_dir(),
                &run.model.vs,
                &run.model.optimizer,
                state,
                run.config.log.keep_checkpoints,
            )?;
            tracing::info!(step = report.step, path = %path.display(), "checkpoint saved");
            run.sinks.metrics.write(
                "event",
                json!({"event": "checkpoint", "step": report.step, "path": path.display().to_string()}),
            );
        }
        run.comm.barrier()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(step: u64, finished: bool, preempted: bool) -> StepReport {
        StepReport {
            step,
            lr: 1e-3,
            samples: 2,
            finished,
            preempted,
        }
    }

    #[test]
    fn tasks_are_due_on_their_period_and_at_the_ends() {
        let log = LogTrain {
            every: 10,
            stop_at: 15,
            last: Marks::default(),
            cache: CacheProbe::default(),
        };
        assert!(log.due(&report(10, false, false)));
        assert!(!log.due(&report(11, false, false)));
        assert!(
            log.due(&report(15, false, true)),
            "the last step of the attempt"
        );
        let memory = SampleMemory { every: 4 };
        assert!(memory.due(&report(8, false, false)) && !memory.due(&report(9, false, false)));
        let check = CheckParameters {
            every: 3,
            checked_at: None,
        };
        assert!(check.due(&report(6, false, false)) && !check.due(&report(7, true, false)));
        let validate = Validate { every: 100 };
        assert!(validate.due(&report(200, false, false)));
        assert!(
            !validate.due(&report(7, false, true)),
            "not before stopping early"
        );
        assert!(
            validate.due(&report(7, true, false)),
            "at TRAIN.TOTAL_STEPS"
        );
        let ckpt = Checkpoint { every: 50 };
        assert!(ckpt.due(&report(50, false, false)));
        assert!(!ckpt.due(&report(51, false, false)));
        assert!(ckpt.due(&report(51, false, true)), "before stopping early");
        assert!(ckpt.due(&report(53, true, false)), "at TRAIN.TOTAL_STEPS");
    }
}
