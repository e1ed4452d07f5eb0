//! A whole training step timed the way the PyTorch peer
//! (`vrt_reference_step.py --optimizer`) times one, for `vrtspike profile
//! --optimizer`: forward under the run's autocast, the Charbonnier loss, backward,
//! then the update (gradient norm, clipping at `TRAIN.MAX_GRAD_NORM`, AdamW through
//! the chosen kernel, zeroed gradients), the model and optimizer built as training
//! builds them from the config, on random input of the profile's shape. One warm-up
//! step, then the median of the timed steps; the update alone is timed between two
//! device synchronisations inside each step.

use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;
use tch::{Device, Kind, Tensor};

use crate::config::Config;
use crate::model::profile::{random_input, sync, InputShape, MemoryProbe};

use super::amp::AmpMode;
use super::loss::f_charbonnier;
use super::optim::{grads, UpdateKernel};
use super::run::build_model;
use super::step::{apply_update, UpdateOptions};
use super::TrainError;

/// The input and the update of the timed steps.
#[derive(Debug, Clone, PartialEq)]
pub struct StepTimingOptions {
    /// The random input's shape.
    pub shape: InputShape,
    /// Timed steps (after one warm-up); at least 1.
    pub iters: usize,
    /// The forward pass under CUDA bf16 autocast.
    pub bf16: bool,
    /// How AdamW runs.
    pub kernel: UpdateKernel,
}

/// The timed steps of one kernel.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepTiming {
    /// The optimizer's kernel.
    pub optimizer: UpdateKernel,
    /// Timed steps.
    pub iters: usize,
    /// Median whole step (forward, backward, update), ms.
    pub step_ms: f64,
    /// Fastest step, ms.
    pub step_min_ms: f64,
    /// Median update (norm, clipping, AdamW, zeroing), ms.
    pub update_ms: f64,
    /// Parameter tensors the update covers.
    pub tensors: usize,
    /// Most memory in use over the timed steps (the probe's), bytes.
    pub peak_bytes: Option<u64>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Times training steps of `config`'s model and optimizer on `device`; `probe`
/// reads the device's memory.
pub fn time_steps(
    config: &Config,
    device: Device,
    options: &StepTimingOptions,
    probe: Arc<dyn MemoryProbe>,
) -> Result<StepTiming, TrainError> {
    if options.iters == 0 {
        return Err(TrainError::Config {
            key: "--iters".into(),
            message: "a step timing needs at least one timed step".into(),
        });
    }
    let mut parts = build_model(config, device)?;
    parts.amp = match (options.bf16, device.is_cuda()) {
        (true, true) => AmpMode::Bf16,
        (true, false) => {
            return Err(TrainError::Config {
                key: "--bf16".into(),
                message: "bfloat16 autocast runs on CUDA only".into(),
            })
        }
        (false, _) => AmpMode::Off,
    };
    parts.optimizer.set_kernel(options.kernel);
    let uses_voxels = parts.model.uses_voxels();
    let input = (Kind::Float, device);
    let (blur, voxels) = random_input(&config.model, uses_voxels, options.shape, input)?;
    let sharp = blur.f_rand_like()?;
    let voxels = voxels.as_ref();
    let tc = &config.train;
    let update = UpdateOptions {
        // A step past FIX_ITER, so every parameter group trains.
        step: tc.fix_iter,
        lr: tc.lr,
        max_grad_norm: tc.grad_clip(),
    };
    let no_inf = Tensor::f_zeros([], (Kind::Float, device))?;
    let (mut steps, mut updates) = (Vec::new(), Vec::new());
    for iter in 0..=options.iters {
        if iter == 1 {
            let _ = probe.take_peak();
        }
        sync(device);
        let started = Instant::now();
        let output = parts.amp.run(|| parts.model.forward(&blur, voxels, true))?;
        let loss = f_charbonnier(&output.f_to_kind(Kind::Float)?, &sharp, tc.charbonnier_eps)?;
        loss.f_backward()?;
        sync(device);
        let update_started = Instant::now();
        match options.kernel {
            UpdateKernel::Loop => {
                // The update before issue 34: the norm read back parameter by parameter.
                let trainable = parts.optimizer.trainable(update.step);
                match update.max_grad_norm {
                    Some(max) => grads::clip_per_parameter(&trainable, max)?,
                    None => grads::norm_per_parameter(&trainable)?,
                };
                parts.optimizer.step(update.lr, update.step, None)?;
            }
            UpdateKernel::Fused | UpdateKernel::Foreach => {
                apply_update(&mut parts.optimizer, &mut parts.scaler, &no_inf, update)?;
            }
        }
        parts.optimizer.zero_grad()?;
        sync(device);
        if iter > 0 {
            updates.push(update_started.elapsed().as_secs_f64() * 1e3);
            steps.push(started.elapsed().as_secs_f64() * 1e3);
        }
    }
    let step_min_ms = steps.iter().copied().fold(f64::INFINITY, f64::min);
    Ok(StepTiming {
        optimizer: options.kernel,
        iters: options.iters,
        step_ms: median(steps),
        step_min_ms,
        update_ms: median(updates),
        tensors: parts.optimizer.params().len(),
        peak_bytes: probe.take_peak(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::profile::RssProbe;

    const SHAPE: InputShape = InputShape {
        batch: 1,
        frames: 2,
        size: 32,
        spike_scale: 0.5,
    };

    #[test]
    fn every_kernel_times_a_whole_step_of_the_tiny_model() {
        let mut config = crate::model::tiny_vrt_spike();
        config.train.max_grad_norm = Some(0.1);
        let probe: Arc<dyn MemoryProbe> =
            Arc::new(RssProbe::start(std::time::Duration::from_millis(1)));
        for kernel in [
            UpdateKernel::Loop,
            UpdateKernel::Foreach,
            UpdateKernel::Fused,
        ] {
            let options = StepTimingOptions {
                shape: SHAPE,
                iters: 1,
                bf16: false,
                kernel,
            };
            let t = time_steps(&config, Device::Cpu, &options, probe.clone()).unwrap();
            assert_eq!(t.optimizer, kernel);
            assert!(t.update_ms > 0.0 && t.update_ms < t.step_ms, "{t:?}");
            assert!(t.step_min_ms <= t.step_ms);
            assert!(t.tensors > 100, "{t:?}");
            assert!(t.peak_bytes.is_some_and(|b| b > 0));
        }
        let bf16 = StepTimingOptions {
            shape: SHAPE,
            iters: 1,
            bf16: true,
            kernel: UpdateKernel::Fused,
        };
        let err = time_steps(&config, Device::Cpu, &bf16, probe).unwrap_err();
        assert!(err.to_string().contains("--bf16"), "{err}");
    }
}
