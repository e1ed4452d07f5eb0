//! `vrtspike plan --measure`: one training step of the config's model on a device,
//! with a batch of the real sample shape (`TRAIN.BATCH_SIZE` x `DATA.CLIP_LEN` frames
//! of `DATA.CROP_SIZE`, voxels of `MODEL.SPIKE.VOXEL_BINS` on the spike grid), forward,
//! Charbonnier loss, backward and an AdamW update, and the memory it took: on CUDA
//! the caching allocator's peak allocated and reserved bytes, on the CPU the rise of
//! the process's peak resident set (`VmHWM` of /proc/self/status).

use std::time::Instant;

use tch::{Device, Kind, Tensor};

use super::loss::charbonnier;
use super::run::build_model;
use crate::config::Config;

use crate::plan::{spike_crop, DatasetFacts, Measured};

/// A measurement that could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum MeasureError {
    /// The model could not be built or run.
    #[error(transparent)]
    Model(#[from] crate::model::ModelError),
    /// The model and optimizer could not be built as training builds them.
    #[error(transparent)]
    Train(#[from] super::TrainError),
    /// libtorch failed (out of memory, say).
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    /// The CUDA allocator's figures could not be read.
    #[error(transparent)]
    Dist(#[from] crate::ddp::DistError),
    /// The device has no allocator figures (no CUDA in this build, or no such device).
    #[error("{0}")]
    Unavailable(String),
}

/// `VmHWM` or `VmRSS` of this process in bytes.
fn proc_status_bytes(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix(field))?
        .trim_start_matches(':')
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// Resets `VmHWM` to the current resident set where the kernel allows it.
fn reset_peak_rss() {
    // Failure only leaves the old peak in place (the delta is then a lower bound).
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// Runs one training step of `config`'s model on `device` and reports its memory.
pub fn measure_step(
    config: &Config,
    device: Device,
    dataset: Option<&DatasetFacts>,
) -> Result<Measured, MeasureError> {
    let data = &config.data;
    let (b, l, crop) = (
        i64::from(config.train.batch_size),
        i64::from(data.clip_len),
        i64::from(data.crop_size),
    );
    let (rows, cols, _) = spike_crop(config, dataset);
    let batch_shape = vec![b, l, 3, crop, crop];
    // The bins the model takes (`DATA.SPIKE_BINS` must equal them to train at all).
    let bins = config.model.spike.voxel_bins;
    let voxel_shape = vec![b, l, bins, rows as i64, cols as i64];
    if let Device::Cuda(n) = device {
        if crate::ddp::cuda_memory_stats(n)?.is_none() {
            return Err(MeasureError::Unavailable(format!(
                "cuda:{n}: no CUDA allocator figures (no CUDA in this build or no such device)"
            )));
        }
        crate::ddp::empty_cuda_cache()?;
    }
    reset_peak_rss();
    let rss_before = proc_status_bytes("VmRSS").unwrap_or(0);
    let started = Instant::now();
    one_step(config, device, &batch_shape, &voxel_shape)?;
    let step_seconds = started.elapsed().as_secs_f64();
    let (source, peak_allocated, peak_reserved, name) = match device {
        Device::Cuda(n) => {
            tch::Cuda::synchronize(n as i64);
            let stats = crate::ddp::cuda_memory_stats(n)?.ok_or_else(|| {
                MeasureError::Unavailable(format!("cuda:{n}: allocator figures vanished"))
            })?;
            (
                "CUDA caching allocator peaks (allocated, reserved) since start".to_string(),
                stats.allocated_peak,
                Some(stats.reserved_peak),
                format!("cuda:{n}"),
            )
        }
        _ => {
            let peak = proc_status_bytes("VmHWM").unwrap_or(0);
            (
                "CPU: rise of the process's peak resident set (VmHWM of /proc/self/status) \
                 over the step, model build included"
                    .to_string(),
                peak.saturating_sub(rss_before),
                None,
                "cpu".to_string(),
            )
        }
    };
    Ok(Measured {
        device: name,
        source,
        batch_shape,
        voxel_shape,
        peak_allocated,
        peak_reserved,
        step_seconds,
    })
}

/// Builds the model and optimizer as training does and runs one step on random
/// inputs.
fn one_step(
    config: &Config,
    device: Device,
    batch_shape: &[i64],
    voxel_shape: &[i64],
) -> Result<(), MeasureError> {
    let tc = &config.train;
    let mut parts = build_model(config, device)?;
    let options = (Kind::Float, device);
    let blur = Tensor::f_rand(batch_shape, options)?;
    let sharp = Tensor::f_rand(batch_shape, options)?;
    let voxels = Tensor::f_rand(voxel_shape, options)?;
    let voxels = parts.model.uses_voxels().then_some(&voxels);
    parts.optimizer.zero_grad()?;
    let output = parts.amp.run(|| parts.model.forward(&blur, voxels, true))?;
    let loss = charbonnier(&output.to_kind(Kind::Float), &sharp, tc.charbonnier_eps);
    loss.f_backward()?;
    // A step past FIX_ITER, so every parameter group holds its optimizer state.
    parts.optimizer.step(tc.lr, tc.fix_iter, None)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn one_cpu_step_of_the_tiny_model_is_measured() {
        let config = Config::parse(
            "DATA:\n  CROP_SIZE: 32\n  CLIP_LEN: 2\n  SPIKE_BINS: 8\nTRAIN:\n  BATCH_SIZE: 2\n\
             MODEL:\n  ARCH: unet_spike\n  UNET: {CHANNELS: 8, LEVELS: 2}\n  SPIKE: {ENABLED: true, VOXEL_BINS: 8}\n",
            Path::new("tiny.yaml"),
        )
        .unwrap();
        let facts = DatasetFacts {
            compact_bytes: 0,
            frames: 1,
            height: 64,
            width: 128,
            spike_height: 16,
            spike_width: 64,
        };
        let m = measure_step(&config, Device::Cpu, Some(&facts)).unwrap();
        assert_eq!(m.device, "cpu");
        assert_eq!(m.batch_shape, [2, 2, 3, 32, 32]);
        // Spike crop: 32 x 16/64 = 8 rows, 32 x 64/128 = 16 columns.
        assert_eq!(m.voxel_shape, [2, 2, 8, 8, 16]);
        assert_eq!(m.peak_reserved, None);
        assert!(m.source.contains("VmHWM"), "{}", m.source);
        assert!(m.step_seconds > 0.0);
        assert!(proc_status_bytes("VmHWM").unwrap_or(0) > 0);
    }
}
