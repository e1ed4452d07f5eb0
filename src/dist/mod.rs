//! Distributed data parallelism through libtorch's own c10d engine, reached via
//! a small C++ shim (`shim/c10d_shim.cpp`, built by `build/shim.rs`): process
//! groups (Gloo/NCCL), DDP-style gradient averaging, CUDA allocator figures.

mod cuda_mem;
mod ddp;
mod error;
mod ffi;
mod group;
mod progress;

pub use cuda_mem::{
    cuda_memory_stats, empty_cuda_cache, reset_cuda_peak, set_cuda_autocast_bf16, CudaMemoryStats,
};
pub use ddp::{plan_buckets, Ddp, DdpOptions, BUCKET_BYTES, FIRST_BUCKET_BYTES};
pub use error::DistError;
pub use group::{nccl_available, Backend, CommStats, GroupOptions, ProcessGroup, ReduceOp};
pub use progress::CollectiveObserver;
