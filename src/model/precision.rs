//! CUDA precision switches that tch does not reach, through the model's shim
//! (`shim/kernels.cpp`): autocast in a chosen dtype (tch's `autocast` knows only
//! float16, does nothing where no GPU is visible and leaves autocast on if its closure
//! panics; bfloat16 is what the user's trainer and the reference's `--bf16` run;
//! training, `train::amp`, and the profiler run the model under [`cuda_autocast`], whose
//! guard restores the state before it on every exit), and TF32 for
//! matrix products and convolutions (on by default in cuDNN; tests that compare CUDA
//! with CPU turn it off).

use std::ffi::c_int;

/// `struct vs_autocast_prev`: CUDA autocast's state before an enter.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct RawAutocastPrev {
    enabled: c_int,
    bf16: c_int,
}

extern "C" {
    fn vs_cuda_autocast_enter(bf16: c_int, prev: *mut RawAutocastPrev) -> c_int;
    fn vs_cuda_autocast_exit(prev: *const RawAutocastPrev) -> c_int;
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

/// Runs `f` with CUDA autocast on in `dtype`, then restores the state before it
/// (enabled, dtype, nesting; the cast cache is cleared when the outermost level
/// ends), also when `f` panics.
pub fn cuda_autocast<T>(dtype: AutocastDtype, f: impl FnOnce() -> T) -> T {
    let _guard = AutocastGuard::enter(dtype);
    f()
}

/// One level of CUDA autocast, left on drop.
struct AutocastGuard {
    prev: Option<RawAutocastPrev>,
}

impl AutocastGuard {
    fn enter(dtype: AutocastDtype) -> AutocastGuard {
        let mut prev = RawAutocastPrev::default();
        let bf16 = c_int::from(dtype == AutocastDtype::Bf16);
        // SAFETY: `prev` is a valid out-pointer; the shim catches every C++ exception.
        let status = unsafe { vs_cuda_autocast_enter(bf16, &mut prev) };
        if status != 0 {
            tracing::warn!("libtorch refused to turn CUDA autocast on: running in float32");
        }
        AutocastGuard {
            prev: (status == 0).then_some(prev),
        }
    }
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        if let Some(prev) = &self.prev {
            // SAFETY: `prev` was filled by the matching enter; the shim catches
            // every C++ exception.
            unsafe { vs_cuda_autocast_exit(prev) };
        }
    }
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
        let panicked = std::panic::catch_unwind(|| cuda_autocast(Bf16, || panic!("inside")));
        assert!(panicked.is_err());
        assert_eq!(kind(), None, "a panic inside leaves autocast off");
    }
}
