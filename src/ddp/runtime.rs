//! What the linked libtorch offers this process at run time: its version, whether
//! its CUDA library is loaded and registered its backend, the CUDA and cuDNN versions,
//! NCCL in the c10d shim, and the visible devices. `vrtspike info` prints it; a test
//! checks that the CUDA library is mapped whenever the build linked it.

use std::ffi::{c_char, c_int, CStr};
use std::path::PathBuf;

use serde::Serialize;

use super::ffi;

/// Whether the build linked `libtorch_cuda.so` (the libtorch it was built against
/// has one); set by `build/shim.rs`.
pub const LINKED_TORCH_CUDA: bool = option_env!("VRTSPIKE_LINKED_TORCH_CUDA").is_some();

/// How the c10d shim was built on the NCCL side (`compiled`, `disabled` by
/// `VRTSPIKE_NO_NCCL`, or `cpu-torch` for a libtorch without CUDA).
const SHIM_NCCL: &str = match option_env!("VRTSPIKE_SHIM_NCCL") {
    Some(state) => state,
    None => "unknown",
};

/// libtorch's CUDA library in this process.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum TorchCudaLib {
    /// Mapped from this path.
    Loaded { path: PathBuf },
    /// The build linked it, yet it is not mapped (a regression of the link).
    Missing,
    /// The libtorch of the build has no CUDA library.
    NotInBuild,
}

/// NCCL in the c10d shim.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum Nccl {
    /// Compiled in; `runtime` is the loaded library's version, or why it is unknown.
    Compiled { runtime: Result<String, String> },
    /// Not compiled in, and why.
    Absent { reason: String },
}

/// One visible CUDA device.
#[derive(Debug, Clone, Serialize)]
pub struct CudaDevice {
    /// Index as CUDA numbers it in this process.
    pub index: usize,
    /// The device's name ("NVIDIA H100 80GB HBM3").
    pub name: String,
    /// Its memory in bytes.
    pub total_memory: u64,
    /// Compute capability, major and minor ("9.0").
    pub compute_capability: String,
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
}

/// What libtorch offers this process.
#[derive(Debug, Clone, Serialize)]
pub struct TorchRuntime {
    /// libtorch's version ("2.11.0").
    pub torch_version: String,
    /// libtorch's CUDA library in this process.
    pub torch_cuda: TorchCudaLib,
    /// Whether libtorch's CUDA hooks answered (its CUDA backend is registered).
    pub cuda_backend_registered: bool,
    /// The CUDA runtime version libtorch was built for ("13.0").
    pub cuda_built: Option<String>,
    /// The cuDNN version libtorch was built with.
    pub cudnn_built: Option<String>,
    /// The cuDNN version of the library loaded now.
    pub cudnn_loaded: Option<String>,
    /// NCCL in the c10d shim.
    pub nccl: Nccl,
    /// The visible CUDA devices, or why they could not be listed.
    pub devices: Result<Vec<CudaDevice>, String>,
}

/// Reads what libtorch offers this process; never fails (what cannot be read is
/// reported as such).
pub fn torch_runtime() -> TorchRuntime {
    let mut raw = ffi::RawCudaRuntime::default();
    // SAFETY: `raw` is a valid out-pointer for the call; the shim catches every C++
    // exception and zeroes what it cannot read.
    unsafe { ffi::vs_cuda_runtime_info(&mut raw) };
    let registered = raw.hooks_registered != 0;
    TorchRuntime {
        torch_version: torch_version(),
        torch_cuda: torch_cuda_lib(),
        cuda_backend_registered: registered,
        cuda_built: registered.then(|| cuda_version(raw.cuda_built)),
        cudnn_built: (raw.cudnn_built > 0).then(|| cudnn_version(raw.cudnn_built)),
        cudnn_loaded: (raw.cudnn_loaded > 0).then(|| cudnn_version(raw.cudnn_loaded)),
        nccl: nccl(),
        devices: devices(raw.device_count),
    }
}

fn torch_version() -> String {
    // SAFETY: the shim returns an owned copy of a compile-time string.
    ffi::take_string(unsafe { ffi::vs_torch_version() })
}

fn torch_cuda_lib() -> TorchCudaLib {
    if !LINKED_TORCH_CUDA {
        return TorchCudaLib::NotInBuild;
    }
    match crate::util::maps::mapped_library("libtorch_cuda.so") {
        Ok(Some(path)) => TorchCudaLib::Loaded { path },
        Ok(None) | Err(_) => TorchCudaLib::Missing,
    }
}

fn nccl() -> Nccl {
    if !ffi::nccl_compiled() {
        let reason = match SHIM_NCCL {
            "disabled" => "built with VRTSPIKE_NO_NCCL (Gloo only)",
            "cpu-torch" => "the libtorch of the build has no CUDA",
            _ => "the c10d shim was built without the CUDA/NCCL headers",
        };
        return Nccl::Absent {
            reason: reason.to_string(),
        };
    }
    let mut text: *mut c_char = std::ptr::null_mut();
    // SAFETY: `text` is a valid out-pointer; the shim catches every C++ exception.
    let status = unsafe { ffi::vs_nccl_version(&mut text) };
    let runtime = ffi::take_error(status).map(|()| ffi::take_string(text));
    Nccl::Compiled { runtime }
}

fn devices(count: c_int) -> Result<Vec<CudaDevice>, String> {
    (0..count.max(0)).map(device).collect()
}

fn device(index: c_int) -> Result<CudaDevice, String> {
    let mut raw = ffi::RawCudaDevice::default();
    // SAFETY: `raw` is a valid out-pointer; the shim checks the index and catches
    // every C++ exception.
    let status = unsafe { ffi::vs_cuda_device_info(index, &mut raw) };
    ffi::take_error(status)?;
    // SAFETY: the shim zeroed `name` and copied at most 255 bytes into it, so it is
    // NUL-terminated within the array.
    let name = unsafe { CStr::from_ptr(raw.name.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    Ok(CudaDevice {
        index: usize::try_from(index).unwrap_or(0),
        name,
        total_memory: raw.total_memory,
        compute_capability: format!("{}.{}", raw.major, raw.minor),
        multiprocessors: u32::try_from(raw.multiprocessors).unwrap_or(0),
    })
}

/// CUDART_VERSION (13000) as "13.0".
fn cuda_version(raw: std::ffi::c_long) -> String {
    format!("{}.{}", raw / 1000, (raw % 1000) / 10)
}

/// cuDNN's version number (91900 since 9.0: major*10000 + minor*100 + patch) as
/// "9.19.0".
fn cudnn_version(raw: std::ffi::c_long) -> String {
    if raw >= 90000 {
        format!("{}.{}.{}", raw / 10000, (raw % 10000) / 100, raw % 100)
    } else {
        format!("{}.{}.{}", raw / 1000, (raw % 1000) / 100, raw % 100)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_read_as_people_write_them() {
        assert_eq!(cuda_version(13000), "13.0");
        assert_eq!(cuda_version(12080), "12.8");
        assert_eq!(cudnn_version(91900), "9.19.0");
        assert_eq!(cudnn_version(8902), "8.9.2");
    }

    /// The regression this guards: nothing in the binary calls libtorch_cuda, so the
    /// linker's `--as-needed` dropped it and libtorch never registered CUDA. Runs on
    /// any machine: a library is mapped whether or not a GPU is present.
    #[test]
    fn this_binary_has_libtorch_cuda_mapped_and_registered() {
        let runtime = torch_runtime();
        if !LINKED_TORCH_CUDA {
            assert!(matches!(runtime.torch_cuda, TorchCudaLib::NotInBuild));
            return;
        }
        for lib in ["libtorch_cuda.so", "libc10_cuda.so"] {
            let mapped = crate::util::maps::mapped_library(lib).expect("read maps");
            assert!(mapped.is_some(), "{lib} is linked but not mapped");
        }
        assert!(matches!(runtime.torch_cuda, TorchCudaLib::Loaded { .. }));
        assert!(
            runtime.cuda_backend_registered,
            "libtorch_cuda is mapped but its CUDA hooks did not answer"
        );
        assert!(runtime.cuda_built.is_some());
    }

    #[test]
    fn nccl_state_matches_the_build() {
        let runtime = torch_runtime();
        match (SHIM_NCCL, &runtime.nccl) {
            ("compiled", Nccl::Compiled { runtime }) => {
                let version = runtime.as_ref().expect("NCCL answers without a GPU");
                assert!(version.starts_with("2."), "NCCL version {version}");
            }
            (state, Nccl::Absent { reason }) if state != "compiled" => {
                assert!(!reason.is_empty());
            }
            (state, nccl) => panic!("the build says NCCL {state}, the shim says {nccl:?}"),
        }
    }

    #[test]
    fn a_missing_device_is_an_error_naming_it() {
        let count = tch::Cuda::device_count();
        let index = c_int::try_from(count).unwrap_or(c_int::MAX);
        let err = device(index).expect_err("no such device");
        assert!(err.contains(&index.to_string()), "{err}");
    }
}
