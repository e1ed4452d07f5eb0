//! A batch to the device it trains or validates on, with one host copy: the
//! loader's samples are copied straight into page-locked host tensors (on a GPU
//! rank; plain ones on a CPU rank, where they are the batch), and each goes to the
//! GPU by a non-blocking copy on a side stream that the compute stream waits for
//! through an event. The trainer reads nothing back between steps, so the host is
//! ahead of the device: the copy of a micro-batch runs while the device still works
//! on the previous step. Shim: `src/train/shim/transfer.cpp`.

use std::ffi::{c_char, c_void};

use tch::{Device, Kind, TchError, Tensor};

use crate::pipeline::loader::Batch;
use crate::pipeline::BatchTensors;

use super::TrainError;

use super::optim::kernels::status;

extern "C" {
    fn vs_empty_pinned(sizes: *const i64, n: usize, out: *mut *mut c_void) -> *mut c_char;
    fn vs_copy_async(src: *const c_void, device_index: i64, out: *mut *mut c_void) -> *mut c_char;
}

/// A tensor the shim made, or its error.
fn shim_tensor(raw: *mut c_char, out: *mut c_void) -> Result<Tensor, TchError> {
    status(raw)?;
    // SAFETY: on success `out` is a tensor the shim allocated for the caller to own.
    Ok(unsafe { Tensor::from_ptr(out as *mut _) })
}

/// An uninitialised page-locked float32 host tensor of `dims` (needs a CUDA
/// build of libtorch with a device).
pub fn empty_pinned(dims: &[i64]) -> Result<Tensor, TchError> {
    let mut out: *mut c_void = std::ptr::null_mut();
    // SAFETY: `dims` is a live slice of `dims.len()` sizes; `out` a valid out-pointer.
    let status = unsafe { vs_empty_pinned(dims.as_ptr(), dims.len(), &mut out) };
    shim_tensor(status, out)
}

/// `host` on CUDA device `index`, copied on that device's side stream; the current
/// stream waits for the copy.
pub fn copy_async(host: &Tensor, index: usize) -> Result<Tensor, TchError> {
    let mut out: *mut c_void = std::ptr::null_mut();
    // SAFETY: `host` is a live tensor for the call; `out` a valid out-pointer.
    let status = unsafe { vs_copy_async(host.as_ptr() as *const c_void, index as i64, &mut out) };
    shim_tensor(status, out)
}

/// Blur, sharp and voxels of `batch` on `device` (see the module doc).
pub fn batch_to_device(
    batch: &Batch,
    device: Device,
) -> Result<(Tensor, Tensor, Tensor), TrainError> {
    let Device::Cuda(index) = device else {
        let plain = |dims: &[i64]| Tensor::f_empty(dims, (Kind::Float, Device::Cpu));
        return Ok(batch.to_host_tensors(&plain)?);
    };
    let (blur, sharp, voxels) = batch.to_host_tensors(&empty_pinned)?;
    Ok((
        copy_async(&blur, index)?,
        copy_async(&sharp, index)?,
        copy_async(&voxels, index)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataset::record::Rect;
    use crate::pipeline::sample::Sample;
    use crate::pipeline::transform::Dihedral;
    use crate::util::readback;

    fn batch() -> Batch {
        let sample = |seed: usize| {
            let values = |n: usize, salt: usize| -> Vec<f32> {
                (0..n).map(|i| (i * 31 + seed * 7 + salt) as f32).collect()
            };
            Sample {
                clip_len: 2,
                height: 4,
                width: 4,
                bins: 2,
                spike_height: 2,
                spike_width: 2,
                blur: values(2 * 3 * 4 * 4, 1),
                sharp: values(2 * 3 * 4 * 4, 2),
                voxel: values(2 * 2 * 2 * 2, 3),
                sequence: format!("SEQ{seed}"),
                frames: vec!["0".into(), "1".into()],
                crop: Rect {
                    y: 0,
                    x: 0,
                    h: 4,
                    w: 4,
                },
                transform: Dihedral {
                    transpose: false,
                    vflip: false,
                    hflip: false,
                },
            }
        };
        Batch {
            epoch: 0,
            end_position: 2,
            samples: vec![sample(0), sample(1)],
        }
    }

    /// On a CPU rank the batch is the host tensors, each sample's values in order.
    #[test]
    fn a_cpu_batch_is_its_one_host_copy() {
        let batch = batch();
        let (blur, sharp, voxels) = batch_to_device(&batch, Device::Cpu).unwrap();
        assert_eq!(blur.size(), [2, 2, 3, 4, 4]);
        assert_eq!(voxels.size(), [2, 2, 2, 2, 2]);
        let flat: Vec<f32> = batch.samples.iter().flat_map(|s| s.sharp.clone()).collect();
        assert_eq!(readback::values::<f32>(&sharp).unwrap(), flat);
        let blur_flat: Vec<f32> = batch.samples.iter().flat_map(|s| s.blur.clone()).collect();
        assert_eq!(readback::values::<f32>(&blur).unwrap(), blur_flat);
        // An allocator that does not make what was asked is an error, not a write
        // past a buffer.
        let wrong = |_: &[i64]| Tensor::f_empty([3], (Kind::Float, Device::Cpu));
        let err = batch.to_host_tensors(&wrong).unwrap_err().to_string();
        assert!(err.contains("not 192 float32 values"), "{err}");
        let double = |dims: &[i64]| Tensor::f_empty(dims, (Kind::Double, Device::Cpu));
        assert!(batch.to_host_tensors(&double).is_err());
    }
}
