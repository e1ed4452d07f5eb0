//! What a run does between optimizer steps, each behind one small interface
//! ([`PeriodicTask`]): the `train` log line, memory samples, parameter-hash checks
//! over ranks, validation and checkpoints, in that order.

use std::time::Instant;

use serde_json::{json, Value};
use tch::Tensor;

use crate::dist::ReduceOp;
use crate::eval::quality::QualitySums;

use super::checkpoint;
use super::heartbeat::{self, Phase};
use super::report::StepReport;
use super::run::{Run, Validation};
use super::TrainError;

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

/// The `train` line of `metrics.jsonl` and the progress bar (`LOG.LOG_EVERY_STEPS`
/// and the last step of the attempt), averaged since the previous line.
pub struct LogTrain {
    every: u64,
    stop_at: u64,
}

impl PeriodicTask for LogTrain {
    fn due(&self, report: &StepReport) -> bool {
        report.step % self.every == 0 || report.step == self.stop_at
    }

    fn run(&mut self, run: &mut Run<'_>, report: &StepReport) -> Result<(), TrainError> {
        let window = std::mem::take(&mut run.attempt.window);
        if run.env.rank != 0 {
            return Ok(());
        }
        let (stats, lr) = (run.data.loader.stats(), report.lr);
        let (samples_per_s, avg_loss) = (window.samples_per_s(), window.mean_loss());
        let grad_norm = report.grad_norm;
        run.sinks.metrics.write("train", json!({
            "step": report.step, "epoch": run.data.loader.state().epoch, "loss": avg_loss, "lr": lr,
            "input_loss": window.mean_input_loss(),
            "grad_norm": if grad_norm.is_finite() { json!(grad_norm) } else { Value::Null },
            "samples_per_s": samples_per_s, "data_time_ms": stats.data_time_ms,
            "cache_hit_rate": stats.hit_rate, "loss_scale": run.state.scaler.scale,
            "skipped_steps": run.state.skipped_steps,
        }));
        run.sinks.metrics.progress(
            report.step,
            format!(
                "loss {avg_loss:.4} lr {lr:.2e} {samples_per_s:.1} samples/s data {:.0} ms hit {:.0}%",
                stats.data_time_ms,
                100.0 * stats.hit_rate
            ),
        );
        Ok(())
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
    checked_at: Option<u64>,
}

impl PeriodicTask for CheckParameters {
    fn due(&self, report: &StepReport) -> bool {
        report.step % self.every == 0
    }

    fn run(&mut self, run: &mut Run<'_>, report: &StepReport) -> Result<(), TrainError> {
        if run.comm.check_parameters(report.step)? {
            self.checked_at = Some(report.step);
        }
        Ok(())
    }

    fn finish(&mut self, run: &mut Run<'_>) -> Result<(), TrainError> {
        if self.checked_at != Some(run.state.step) {
            run.comm.check_parameters(run.state.step)?;
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
        let mine = Vec::<f64>::try_from(&validator.run(run.model.model.as_ref())?.to_tensor())?;
        let all = run.comm.all_reduce(&mine, ReduceOp::Sum)?;
        let all = QualitySums::from_tensor(&Tensor::from_slice(&all));
        let (psnr, ssim, input) = all.means();
        if run.env.rank == 0 {
            run.sinks.metrics.write(
                "val",
                json!({"step": report.step, "val_psnr": psnr, "val_ssim": ssim, "input_psnr": input,
                "frames": all.frames, "val_s": started.elapsed().as_secs_f64()}),
            );
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
            mean_loss: 0.1,
            grad_norm: 1.0,
            samples: 2,
            input_loss: 0.2,
            finished,
            preempted,
        }
    }

    #[test]
    fn tasks_are_due_on_their_period_and_at_the_ends() {
        let log = LogTrain {
            every: 10,
            stop_at: 15,
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
