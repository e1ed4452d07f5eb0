//! Precision switches that tch does not reach, through the model's shim
//! (`shim/kernels.cpp`): autocast in a chosen dtype (tch's `autocast` knows only
//! float16 on CUDA, does nothing where no GPU is visible and leaves autocast on if its
//! closure panics; bfloat16 is what the user's trainer and the reference's `--bf16`
//! run; training, `train::amp`, and the profiler run the model under
//! [`cuda_autocast`], whose guard restores the state before it on every exit; the
//! same on the CPU, [`cpu_autocast`], lets CPU tests reproduce what bf16 autocast does
//! to the model), and TF32 for matrix products and convolutions (on by default in
//! cuDNN; tests that compare CUDA with CPU turn it off).

use std::ffi::c_int;

/// `struct vs_autocast_prev`: CUDA autocast's state before an enter.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct RawAutocastPrev {
    enabled: c_int,
    bf16: c_int,
}

extern "C" {
    fn vs_autocast_enter(cuda: c_int, bf16: c_int, prev: *mut RawAutocastPrev) -> c_int;
    fn vs_autocast_exit(cuda: c_int, prev: *const RawAutocastPrev) -> c_int;
    fn vs_autocast_kind(cuda: c_int) -> c_int;
    fn vs_allow_tf32(on: c_int) -> c_int;
}

/// The device type whose autocast state a call reads or changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AutocastDevice {
    Cuda,
    Cpu,
}

impl AutocastDevice {
    fn code(self) -> c_int {
        c_int::from(self == AutocastDevice::Cuda)
    }
}

/// Allows (`true`) or forbids TF32 in CUDA matrix products (cuBLAS) and convolutions
/// (cuDNN), for the whole process; returns whether libtorch took the setting.
pub fn set_tf32(on: bool) -> bool {
    // SAFETY: a plain int argument; the shim catches every C++ exception.
    unsafe { vs_allow_tf32(c_int::from(on)) == 0 }
}

/// The dtype CUDA autocast computes in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AutocastDtype {
    /// bfloat16: the range of float32, no loss scaling needed.
    Bf16,
    /// float16: needs a loss scaler.
    Fp16,
}

/// Runs `f` with CUDA autocast on in `dtype`, then restores the state before it
/// (enabled, dtype, nesting; the cast cache is cleared when the outermost level
/// ends), also when `f` panics.
pub fn cuda_autocast<T>(dtype: AutocastDtype, f: impl FnOnce() -> T) -> T {
    let _guard = AutocastGuard::enter(AutocastDevice::Cuda, dtype);
    f()
}

/// [`cuda_autocast`] for the CPU's autocast (bfloat16 is what CPU autocast runs).
pub fn cpu_autocast<T>(dtype: AutocastDtype, f: impl FnOnce() -> T) -> T {
    let _guard = AutocastGuard::enter(AutocastDevice::Cpu, dtype);
    f()
}

/// One level of autocast on one device type, left on drop.
struct AutocastGuard {
    device: AutocastDevice,
    prev: Option<RawAutocastPrev>,
}

impl AutocastGuard {
    fn enter(device: AutocastDevice, dtype: AutocastDtype) -> AutocastGuard {
        let mut prev = RawAutocastPrev::default();
        let bf16 = c_int::from(dtype == AutocastDtype::Bf16);
        // SAFETY: `prev` is a valid out-pointer; the shim catches every C++ exception.
        let status = unsafe { vs_autocast_enter(device.code(), bf16, &mut prev) };
        if status != 0 {
            tracing::warn!(
                ?device,
                "libtorch refused to turn autocast on: running in float32"
            );
        }
        AutocastGuard {
            device,
            prev: (status == 0).then_some(prev),
        }
    }
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        if let Some(prev) = &self.prev {
            // SAFETY: `prev` was filled by the matching enter on this device type;
            // the shim catches every C++ exception.
            unsafe { vs_autocast_exit(self.device.code(), prev) };
        }
    }
}

/// The dtype autocast computes in on this thread on `device`, or `None` when it is
/// off (or in a dtype other than these two).
pub(crate) fn current_autocast(device: AutocastDevice) -> Option<AutocastDtype> {
    // SAFETY: a plain int argument; the shim catches every C++ exception.
    match unsafe { vs_autocast_kind(device.code()) } {
        1 => Some(AutocastDtype::Fp16),
        2 => Some(AutocastDtype::Bf16),
        _ => None,
    }
}

impl AutocastDtype {
    /// The tensor kind it computes in.
    pub fn kind(self) -> tch::Kind {
        match self {
            AutocastDtype::Bf16 => tch::Kind::BFloat16,
            AutocastDtype::Fp16 => tch::Kind::Half,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind() -> Option<AutocastDtype> {
        current_autocast(AutocastDevice::Cuda)
    }

    #[test]
    fn autocast_is_on_in_the_dtype_asked_and_restored_after() {
        use AutocastDtype::{Bf16, Fp16};
        assert_eq!(kind(), None, "autocast is off outside");
        assert_eq!(cuda_autocast(Bf16, kind), Some(Bf16));
        assert_eq!(cuda_autocast(Fp16, kind), Some(Fp16));
        let nested = cuda_autocast(Bf16, || (cuda_autocast(Fp16, kind), kind()));
        assert_eq!(
            nested,
            (Some(Fp16), Some(Bf16)),
            "the inner dtype ends with the inner call"
        );
        assert_eq!(kind(), None, "autocast is off again");
        let panicked = std::panic::catch_unwind(|| cuda_autocast(Bf16, || panic!("inside")));
        assert!(panicked.is_err());
        assert_eq!(kind(), None, "a panic inside leaves autocast off");
        // The CPU's autocast is a state of its own.
        let both = cpu_autocast(Bf16, || (current_autocast(AutocastDevice::Cpu), kind()));
        assert_eq!(both, (Some(Bf16), None));
        assert_eq!(current_autocast(AutocastDevice::Cpu), None);
    }
}
