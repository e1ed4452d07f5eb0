//! The CUDA caching allocator's figures (allocated/reserved, current and peak)
//! with their reset, and `emptyCache`, which tch lacks. Without CUDA support in the build or a
//! visible device they are `None` and a no-op, never an error.

use std::ffi::c_int;

use super::error::DistError;
use super::ffi;

/// The caching allocator's memory on one device, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CudaMemoryStats {
    /// Bytes held by live tensors now.
    pub allocated_current: u64,
    /// Most bytes held by live tensors since start.
    pub allocated_peak: u64,
    /// Bytes reserved from the driver now (live + cached).
    pub reserved_current: u64,
    /// Most bytes reserved from the driver since start.
    pub reserved_peak: u64,
}

/// Allocator figures of CUDA device `device`, or `None` on a CPU-only run
/// (no CUDA in this build, or no such device).
pub fn cuda_memory_stats(device: usize) -> Result<Option<CudaMemoryStats>, DistError> {
    let Ok(device) = c_int::try_from(device) else {
        return Ok(None);
    };
    let mut raw = ffi::RawCudaMemStats::default();
    let mut available: c_int = 0;
    // SAFETY: both out-pointers are valid for the call; the shim catches every
    // C++ exception and checks the device index itself.
    let status = unsafe { ffi::vs_cuda_memory_stats(device, &mut raw, &mut available) };
    ffi::take_error(status).map_err(DistError::Cuda)?;
    if available == 0 {
        return Ok(None);
    }
    let bytes = |v: i64| u64::try_from(v).unwrap_or(0);
    Ok(Some(CudaMemoryStats {
        allocated_current: bytes(raw.allocated_current),
        allocated_peak: bytes(raw.allocated_peak),
        reserved_current: bytes(raw.reserved_current),
        reserved_peak: bytes(raw.reserved_peak),
    }))
}

/// Starts the peak figures of CUDA device `device` anew from the current ones (a
/// profile's peak per part); a no-op on a CPU-only run.
pub fn reset_cuda_peak(device: usize) -> Result<(), DistError> {
    let Ok(device) = c_int::try_from(device) else {
        return Ok(());
    };
    // SAFETY: a plain int argument; the shim checks the index and catches every
    // C++ exception.
    let status = unsafe { ffi::vs_cuda_reset_peak(device) };
    ffi::take_error(status).map_err(DistError::Cuda)
}

/// Returns the caching allocator's unused blocks to the driver (before
/// validation, say); a no-op without CUDA.
pub fn empty_cuda_cache() -> Result<(), DistError> {
    // SAFETY: no arguments; the shim catches every C++ exception.
    let status = unsafe { ffi::vs_cuda_empty_cache() };
    ffi::take_error(status).map_err(DistError::Cuda)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_only_run_has_no_stats_and_empty_cache_is_harmless() {
        empty_cuda_cache().expect("empty cache never fails");
        let stats = cuda_memory_stats(0).expect("query");
        if tch::Cuda::device_count() == 0 {
            assert_eq!(stats, None);
        } else if let Some(stats) = stats {
            assert!(stats.allocated_peak >= stats.allocated_current);
            assert!(stats.reserved_current >= stats.allocated_current);
        }
        assert_eq!(cuda_memory_stats(usize::MAX).expect("query"), None);
    }
}
