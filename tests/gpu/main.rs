//! The GPU test suite (`make test-gpu`; the GPU bundle carries its compiled binary):
//! NCCL with world 1, DDP on CUDA against the CPU, bf16 autocast of the tiny
//! VRT-Spike, the fp16 scaler, the CUDA allocator's figures, pinned host copies, an
//! out-of-memory as a clean error, the attention kernel for a learned bias, and the
//! binary's `info` and `profile --device cuda`.
//!
//! Not part of `make test` (`test = false` in Cargo.toml). Every test needs a CUDA
//! device and FAILS without one: a GPU suite that passes on a machine without a GPU
//! would prove nothing. Outside the source tree (the bundle), `VRTSPIKE_ROOT` names
//! the folder holding `configs/` and `VRTSPIKE_BIN` the `vrtspike` binary.

mod attention;
mod collectives;
mod memory;
mod model;
mod tools;

use std::path::PathBuf;

use tch::Device;

/// The first CUDA device; panics, failing the test, when there is none.
pub fn cuda() -> Device {
    let count = tch::Cuda::device_count();
    assert!(
        count > 0,
        "no CUDA device visible (tch::Cuda::device_count() = 0; libtorch_cuda mapped: {}): \
         the GPU suite needs a GPU; run it with `make test-gpu` on a GPU host",
        vrtspike::util::maps::mapped_library("libtorch_cuda.so")
            .ok()
            .flatten()
            .map_or("no".to_string(), |p| p.display().to_string())
    );
    Device::Cuda(0)
}

/// The folder holding `configs/`: `VRTSPIKE_ROOT`, else the source tree.
pub fn root() -> PathBuf {
    std::env::var_os("VRTSPIKE_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

/// The `vrtspike` binary: `VRTSPIKE_BIN`, else the one cargo built beside this test.
pub fn vrtspike_bin() -> PathBuf {
    std::env::var_os("VRTSPIKE_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_vrtspike")))
}

/// A TCP port free on loopback now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// Largest absolute difference between two tensors (moved to the CPU as f64).
pub fn max_abs_diff(a: &tch::Tensor, b: &tch::Tensor) -> f64 {
    let a = a.to_device(Device::Cpu).to_kind(tch::Kind::Double);
    let b = b.to_device(Device::Cpu).to_kind(tch::Kind::Double);
    (a - b).abs().max().double_value(&[])
}

/// Turns TF32 off for matrix products and convolutions, so CUDA and CPU results
/// compare at float32 precision.
pub fn strict_fp32() {
    tch::Cuda::cudnn_set_benchmark(false);
    assert!(
        vrtspike::model::precision::set_tf32(false),
        "libtorch refused to turn TF32 off"
    );
}
