//! Distributed data parallelism through libtorch's own c10d engine, reached via
//! a small C++ shim (`shim/c10d_shim.cpp`, built by `build/shim.rs`): process
//! groups (Gloo/NCCL), gradient averaging (PyTorch DDP's Reducer overlapped with
//! backward, or flat buckets after it), CUDA allocator figures, and
//! what the linked libtorch offers at run time (versions, CUDA, NCCL, devices).

mod cuda_mem;
mod error;
mod ffi;
mod flat;
mod group;
mod progress;
mod reducer;
mod runtime;

pub use cuda_mem::{cuda_memory_stats, empty_cuda_cache, reset_cuda_peak, CudaMemoryStats};
pub use error::DistError;
pub use flat::{
    bucket_groups, check_parameters, parameter_hash, Ddp, DdpOptions, BUCKET_BYTES,
    FIRST_BUCKET_BYTES,
};
pub use group::{nccl_available, Backend, CommStats, GroupOptions, ProcessGroup, ReduceOp};
pub use progress::CollectiveObserver;
pub use reducer::{GradCompression, GradReducer, GradSync, ReducerOptions};
pub use runtime::{torch_runtime, CudaDevice, Nccl, TorchCudaLib, TorchRuntime, LINKED_TORCH_CUDA};
