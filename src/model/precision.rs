//! CUDA precision switches that tch does not reach, through the model's shim
//! (`shim/kernels.cpp`): autocast in a chosen dtype (tch's `autocast` turns libtorch's
//! CUDA autocast on in its default float16; bfloat16, what the user's trainer and the
//! reference's `--bf16` run, needs the dtype switched and switched back afterwards;
//! training, `train::amp`, and the profiler run the model under it), and TF32 for
//! matrix products and convolutions (on by default in cuDNN; tests that compare CUDA
//! with CPU turn it off).

use std::ffi::c_int;

extern "C" {
    fn vs_cuda_autocast_bf16(on: c_int) -> c_int;
    fn vs_cuda_autocast_kind() -> c_int;
    fn vs_allow_tf32(on: c_int) -> c_int;
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

/// Runs `f` with CUDA autocast on in `dtype`, then restores the previous state
/// (autocast nesting and dtype).
pub fn cuda_autocast<T>(dtype: AutocastDtype, f: impl FnOnce() -> T) -> T {
    // SAFETY: a plain int argument; the shim catches every C++ exception.
    let was_bf16 = unsafe { vs_cuda_autocast_bf16(c_int::from(dtype == AutocastDtype::Bf16)) };
    let out = tch::autocast(true, f);
    if was_bf16 >= 0 {
        // SAFETY: as above.
        unsafe { vs_cuda_autocast_bf16(was_bf16) };
    }
    out
}

/// The dtype CUDA autocast computes in on this thread, or `None` when it is off (or
/// in a dtype other than these two).
pub fn current_cuda_autocast() -> Option<AutocastDtype> {
    // SAFETY: no arguments; the shim catches every C++ exception.
    match unsafe { vs_cuda_autocast_kind() } {
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
        current_cuda_autocast()
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
    }
}
