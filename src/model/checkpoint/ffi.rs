//! Raw bindings to the checkpoint shim (`src/model/shim/checkpoint.cpp`). Tensors
//! cross as tch's C tensor pointers (`at::Tensor*`); a failing entry point returns a
//! malloc'd C string (null on success) that [`take_error`] turns into a `String` and
//! frees. Nothing here is safe to call directly.

use std::ffi::{c_char, c_int, c_void, CStr};

/// `vs_ckpt_call_fn`: runs closure `ctx` in `phase` on `n` input tensors, reporting
/// outputs with [`vs_ckpt_push`] or an error with [`vs_ckpt_fail`] into `result`;
/// returns 0 on success.
pub(super) type CallFn = extern "C" fn(
    ctx: *mut c_void,
    phase: c_int,
    inputs: *const *mut c_void,
    n: usize,
    result: *mut c_void,
) -> c_int;

/// `vs_ckpt_drop_fn`: releases closure `ctx`; the shim calls it exactly once.
pub(super) type DropFn = extern "C" fn(ctx: *mut c_void);

/// `vs_hook_fn`: a backward hook's callback on closure `ctx`; must not unwind.
pub(super) type HookFn = extern "C" fn(ctx: *mut c_void);

/// `phase` of a [`CallFn`] call in the forward pass.
pub(super) const PHASE_FORWARD: c_int = 0;

extern "C" {
    pub(super) fn vs_ckpt_string_free(text: *mut c_char);
    pub(super) fn vs_ckpt_free_array(array: *mut *mut c_void);
    pub(super) fn vs_ckpt_grad_enabled() -> c_int;
    pub(super) fn vs_ckpt_push(result: *mut c_void, tensor: *const c_void) -> c_int;
    pub(super) fn vs_ckpt_fail(result: *mut c_void, message: *const c_char, len: usize);
    pub(super) fn vs_checkpoint(
        call: CallFn,
        drop: DropFn,
        ctx: *mut c_void,
        inputs: *const *const c_void,
        n_inputs: usize,
        outputs: *mut *mut *mut c_void,
        n_outputs: *mut usize,
    ) -> *mut c_char;
    pub(super) fn vs_backward_hook(
        call: HookFn,
        drop: DropFn,
        ctx: *mut c_void,
        input: *const c_void,
        output: *mut *mut c_void,
    ) -> *mut c_char;
}

/// Converts a shim status into `Err(message)`, freeing the shim's string.
pub(super) fn take_error(status: *mut c_char) -> Result<(), String> {
    if status.is_null() {
        return Ok(());
    }
    // SAFETY: a non-null status is a NUL-terminated string the shim malloc'd for
    // us; it is copied out before being freed.
    let message = unsafe { CStr::from_ptr(status) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: `status` came from the shim's malloc and is freed exactly once.
    unsafe { vs_ckpt_string_free(status) };
    Err(message)
}
