//! A batch as tensors for the model: the only part of the pipeline that touches
//! libtorch, kept in the trainer crate so that `vrtspike-data`'s pipeline (what the
//! loader benchmark's processes in `vrtspike-cache` run) builds without it. Each
//! sample's values are copied once, straight into the host tensors a caller's
//! allocator makes (the trainer's are page-locked on a GPU rank, see
//! `train::transfer`).

use vrtspike_data::pipeline::error::{PipelineError, Result};
use vrtspike_data::pipeline::loader::Batch;
use vrtspike_data::pipeline::sample::Sample;

/// Makes a host tensor of the given dims (float32, contiguous, on the CPU).
pub type HostAlloc<'a> = dyn Fn(&[i64]) -> std::result::Result<tch::Tensor, tch::TchError> + 'a;

/// A batch as the model's input tensors.
pub trait BatchTensors {
    /// Blur, sharp and voxels stacked as (B, L, 3, h, w), (B, L, 3, h, w) and
    /// (B, L, K, h_s, w_s) f32 tensors on `device`, through plain host memory.
    /// Samples of different shapes are an error.
    fn to_tensors(&self, device: tch::Device) -> Result<(tch::Tensor, tch::Tensor, tch::Tensor)>;

    /// [`BatchTensors::to_tensors`]' three tensors on the host, made by `alloc`
    /// (which must return a contiguous float32 CPU tensor of the dims asked), each
    /// sample's values copied into them once.
    fn to_host_tensors(
        &self,
        alloc: &HostAlloc<'_>,
    ) -> Result<(tch::Tensor, tch::Tensor, tch::Tensor)>;
}

impl BatchTensors for Batch {
    fn to_tensors(&self, device: tch::Device) -> Result<(tch::Tensor, tch::Tensor, tch::Tensor)> {
        let plain = |dims: &[i64]| tch::Tensor::f_empty(dims, (tch::Kind::Float, tch::Device::Cpu));
        let (blur, sharp, voxels) = self.to_host_tensors(&plain)?;
        if device == tch::Device::Cpu {
            return Ok((blur, sharp, voxels));
        }
        let to = |t: tch::Tensor| t.f_to_device(device).map_err(torch_error);
        Ok((to(blur)?, to(sharp)?, to(voxels)?))
    }

    fn to_host_tensors(
        &self,
        alloc: &HostAlloc<'_>,
    ) -> Result<(tch::Tensor, tch::Tensor, tch::Tensor)> {
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
        let stack = |get: &dyn Fn(&Sample) -> &Vec<f32>, shape: [usize; 4]| {
            let dims = [
                self.samples.len() as i64,
                shape[0] as i64,
                shape[1] as i64,
                shape[2] as i64,
                shape[3] as i64,
            ];
            let mut host = alloc(&dims).map_err(torch_error)?;
            let parts: Vec<&[f32]> = self.samples.iter().map(|s| get(s).as_slice()).collect();
            fill(&mut host, &parts)?;
            Ok::<_, PipelineError>(host)
        };
        Ok((
            stack(&|s| &s.blur, rgb)?,
            stack(&|s| &s.sharp, rgb)?,
            stack(&|s| &s.voxel, vox)?,
        ))
    }
}

fn torch_error(e: tch::TchError) -> PipelineError {
    PipelineError::Request(format!("libtorch: {e}"))
}

/// Copies `parts`, one after the other, into `host`, which must be a contiguous
/// float32 CPU tensor of exactly their length.
fn fill(host: &mut tch::Tensor, parts: &[&[f32]]) -> Result<()> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let fits = host.kind() == tch::Kind::Float
        && host.device() == tch::Device::Cpu
        && host.is_contiguous()
        && host.numel() == len;
    if !fits {
        return Err(PipelineError::Request(format!(
            "a batch's host tensor is {:?} {:?} on {:?} (contiguous: {}), not {len} float32 values on the CPU",
            host.kind(),
            host.size(),
            host.device(),
            host.is_contiguous()
        )));
    }
    if len == 0 {
        return Ok(());
    }
    let base = host.data_ptr() as *mut f32;
    let mut at = 0;
    for part in parts {
        // SAFETY: `host` is a contiguous float32 CPU tensor of `len` elements (checked
        // above), owned here and not shared, so `base + at .. base + at + part.len()`
        // lies inside its buffer (the parts' lengths sum to `len`) and nothing else
        // reads or writes it during the copy; `part` is a separate Rust slice.
        unsafe { std::ptr::copy_nonoverlapping(part.as_ptr(), base.add(at), part.len()) };
        at += part.len();
    }
    Ok(())
}
