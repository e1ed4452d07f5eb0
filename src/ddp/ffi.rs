//! Raw bindings to the c10d shim (`shim/c10d_shim.cpp`). Every fallible call
//! returns a malloc'd C string (null on success) that [`take_error`] turns into
//! a Rust `String` and frees; nothing here is safe to call directly.

use std::ffi::{c_char, c_int, c_void, CStr};

/// Opaque handle to the shim's process group (`struct vs_group`).
#[repr(C)]
pub(crate) struct RawGroup {
    _private: [u8; 0],
}

/// What the shim's Reducer calls before (`launched` 0) and after (1) handing a
/// gradient bucket to its communication hook, with the buckets launched so far in
/// the pass (`vs_bucket_fn`).
pub(crate) type BucketFn = extern "C" fn(ctx: *mut c_void, count: i64, launched: c_int);

/// Opaque handle to the shim's gradient Reducer (`struct vs_reducer`).
#[repr(C)]
pub(crate) struct RawReducer {
    _private: [u8; 0],
}

/// `struct vs_cuda_mem_stats`: CUDA caching allocator figures in bytes.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct RawCudaMemStats {
    pub allocated_current: i64,
    pub allocated_peak: i64,
    pub reserved_current: i64,
    pub reserved_peak: i64,
}

/// `struct vs_cuda_runtime`: what the linked libtorch offers on the CUDA side.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct RawCudaRuntime {
    pub hooks_registered: c_int,
    pub cuda_built: std::ffi::c_long,
    pub cudnn_built: std::ffi::c_long,
    pub cudnn_loaded: std::ffi::c_long,
    pub device_count: c_int,
}

/// `struct vs_cuda_device`: one CUDA device's properties.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawCudaDevice {
    pub name: [c_char; 256],
    pub total_memory: u64,
    pub major: c_int,
    pub minor: c_int,
    pub multiprocessors: c_int,
}

impl Default for RawCudaDevice {
    fn default() -> Self {
        Self {
            name: [0; 256],
            total_memory: 0,
            major: 0,
            minor: 0,
            multiprocessors: 0,
        }
    }
}

/// Backend codes understood by `vs_group_new`.
pub(crate) const BACKEND_GLOO: c_int = 0;
pub(crate) const BACKEND_NCCL: c_int = 1;

/// Reduce-op codes understood by `vs_group_allreduce`.
pub(crate) const OP_SUM: c_int = 0;
pub(crate) const OP_AVG: c_int = 1;
pub(crate) const OP_MIN: c_int = 2;
pub(crate) const OP_MAX: c_int = 3;

extern "C" {
    pub(crate) fn vs_string_free(text: *mut c_char);
    pub(crate) fn vs_nccl_compiled() -> c_int;
    pub(crate) fn vs_torch_version() -> *mut c_char;
    pub(crate) fn vs_cuda_runtime_info(out: *mut RawCudaRuntime);
    pub(crate) fn vs_nccl_version(out: *mut *mut c_char) -> *mut c_char;
    pub(crate) fn vs_cuda_device_info(device: c_int, out: *mut RawCudaDevice) -> *mut c_char;
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn vs_group_new(
        backend: c_int,
        master_addr: *const c_char,
        port: u16,
        rank: c_int,
        world: c_int,
        timeout_ms: i64,
        prefix: *const c_char,
        device_index: c_int,
        out: *mut *mut RawGroup,
    ) -> *mut c_char;
    pub(crate) fn vs_group_free(group: *mut RawGroup);
    pub(crate) fn vs_group_allreduce(
        group: *mut RawGroup,
        tensor: *mut c_void,
        op: c_int,
    ) -> *mut c_char;
    pub(crate) fn vs_group_broadcast(
        group: *mut RawGroup,
        tensor: *mut c_void,
        root: c_int,
    ) -> *mut c_char;
    pub(crate) fn vs_group_barrier(group: *mut RawGroup) -> *mut c_char;
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn vs_reducer_new(
        group: *mut RawGroup,
        params: *const *mut c_void,
        n: usize,
        first_bucket_bytes: i64,
        bucket_bytes: i64,
        compression: c_int,
        static_graph: c_int,
        out: *mut *mut RawReducer,
    ) -> *mut c_char;
    pub(crate) fn vs_reducer_free(reducer: *mut RawReducer);
    pub(crate) fn vs_reducer_forward(reducer: *mut RawReducer, count: c_int) -> *mut c_char;
    pub(crate) fn vs_reducer_watch(
        reducer: *mut RawReducer,
        on_bucket: Option<BucketFn>,
        ctx: *mut c_void,
    );
    pub(crate) fn vs_reducer_backward(
        group: *mut RawGroup,
        reducer: *mut RawReducer,
        loss: *mut c_void,
        sync: c_int,
        exposed_ns: *mut i64,
    ) -> *mut c_char;
    pub(crate) fn vs_ensure_grad(param: *mut c_void) -> *mut c_char;
    pub(crate) fn vs_cuda_memory_stats(
        device: c_int,
        out: *mut RawCudaMemStats,
        available: *mut c_int,
    ) -> *mut c_char;
    pub(crate) fn vs_cuda_empty_cache() -> *mut c_char;
    pub(crate) fn vs_cuda_reset_peak(device: c_int) -> *mut c_char;
}

/// Converts a shim status into `Err(message)`, freeing the shim's string.
pub(crate) fn take_error(status: *mut c_char) -> Result<(), String> {
    if status.is_null() {
        return Ok(());
    }
    Err(take_string(status))
}

/// Takes ownership of a string the shim malloc'd (null gives an empty string).
pub(crate) fn take_string(text: *mut c_char) -> String {
    if text.is_null() {
        return String::new();
    }
    // SAFETY: a non-null `text` is a NUL-terminated string the shim malloc'd for
    // us; it is copied out before being freed.
    let owned = unsafe { CStr::from_ptr(text) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: `text` came from the shim's malloc and is freed exactly once.
    unsafe { vs_string_free(text) };
    owned
}

/// Whether this build compiled the NCCL backend and the CUDA allocator calls.
pub fn nccl_compiled() -> bool {
    // SAFETY: a pure query of a compile-time constant.
    unsafe { vs_nccl_compiled() != 0 }
}
