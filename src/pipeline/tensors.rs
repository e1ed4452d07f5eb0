//! A batch as tensors for the model: the only part of the pipeline that touches
//! libtorch, kept in the trainer crate so that `vrtspike-data`'s pipeline (what the
//! loader benchmark's processes in `vrtspike-cache` run) builds without it.

use vrtspike_data::pipeline::error::{PipelineError, Result};
use vrtspike_data::pipeline::loader::Batch;
use vrtspike_data::pipeline::sample::Sample;

/// A batch as the model's input tensors.
pub trait BatchTensors {
    /// Blur, sharp and voxels stacked as (B, L, 3, h, w), (B, L, 3, h, w) and
    /// (B, L, K, h_s, w_s) f32 tensors on `device`; on CUDA through pinned host memory
    /// with a non-blocking copy. Samples of different shapes are an error.
    fn to_tensors(&self, device: tch::Device) -> Result<(tch::Tensor, tch::Tensor, tch::Tensor)>;
}

impl BatchTensors for Batch {
    fn to_tensors(&self, device: tch::Device) -> Result<(tch::Tensor, tch::Tensor, tch::Tensor)> {
        let first = self
            .samples
            .first()
            .ok_or_else(|| PipelineError::Request("empty batch".into()))?;
        let (rgb, vox) = (first.rgb_shape(), first.voxel_shape());
        if self
            .samples
            .iter()
            .any(|s| s.rgb_shape() != rgb || s.voxel_shape() != vox)
        {
            return Err(PipelineError::Request("batch mixes sample shapes".into()));
        }
        let b = self.samples.len() as i64;
        let stack =
            |get: &dyn Fn(&Sample) -> &Vec<f32>, shape: [usize; 4]| -> Result<tch::Tensor> {
                let mut flat = Vec::with_capacity(self.samples.len() * get(first).len());
                for s in &self.samples {
                    flat.extend_from_slice(get(s));
                }
                let dims = [
                    b,
                    shape[0] as i64,
                    shape[1] as i64,
                    shape[2] as i64,
                    shape[3] as i64,
                ];
                let torch = |e: tch::TchError| PipelineError::Request(format!("libtorch: {e}"));
                let host = tch::Tensor::f_from_slice(&flat)
                    .and_then(|t| t.f_view(dims))
                    .map_err(torch)?;
                if device.is_cuda() {
                    host.f_pin_memory(device)
                        .and_then(|p| p.f_to_device_(device, tch::Kind::Float, true, false))
                        .map_err(torch)
                } else {
                    Ok(host)
                }
            };
        Ok((
            stack(&|s| &s.blur, rgb)?,
            stack(&|s| &s.sharp, rgb)?,
            stack(&|s| &s.voxel, vox)?,
        ))
    }
}
