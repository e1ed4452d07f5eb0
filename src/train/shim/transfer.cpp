// A batch's way to the GPU without a second host copy or a stall of the compute
// stream: page-locked host tensors allocated directly (libtorch's caching host
// allocator; `pin_memory()` would copy, and its device argument is deprecated), and
// a non-blocking copy on one side stream per device, which the compute stream waits
// for through an event, so the copy runs while the device still works on what was
// queued before it. Device-generic c10 stream and event calls: no CUDA headers.
// Rust side: src/train/transfer.rs. No C++ exception crosses this boundary: every
// entry point returns an owned error string (NULL on success) freed with
// vs_update_string_free (update.cpp).

#include <array>
#include <cstdint>
#include <mutex>
#include <optional>

#include "vs_errors.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

namespace {

using vs_shim::guarded;

constexpr size_t kMaxDevices = 64;

// One side stream per CUDA device, taken from libtorch's pool on first use (one, so
// the caching allocator keeps the batches' blocks in one stream's pool).
c10::Stream side_stream(const c10::impl::VirtualGuardImpl& impl, c10::Device device) {
  static std::mutex lock;
  static std::array<std::optional<c10::Stream>, kMaxDevices> streams;
  const auto index = static_cast<size_t>(device.index());
  TORCH_CHECK(index < kMaxDevices, "CUDA device ", device.index(), " beyond ", kMaxDevices);
  std::lock_guard<std::mutex> guard(lock);
  if (!streams[index].has_value()) {
    streams[index] = impl.getStreamFromGlobalPool(device, /*isHighPriority=*/false);
  }
  return *streams[index];
}

}  // namespace

extern "C" {

// `*out` = an uninitialised page-locked float32 host tensor of `n` dims `sizes`.
char* vs_empty_pinned(const int64_t* sizes, size_t n, at::Tensor** out) {
  *out = nullptr;
  return guarded([&] {
    auto options = at::TensorOptions().dtype(at::kFloat).pinned_memory(true);
    *out = new at::Tensor(at::empty(at::IntArrayRef(sizes, n), options));
  });
}

// `*out` = `src` (a host tensor, page-locked for the copy not to block) copied to
// CUDA device `device_index` on that device's side stream; the device's current
// stream waits for the copy (an event), and the result's memory is kept from reuse
// until the current stream is done with it.
char* vs_copy_async(const at::Tensor* src, int64_t device_index, at::Tensor** out) {
  *out = nullptr;
  return guarded([&] {
    const c10::Device device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device_index));
    const c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    const c10::Stream compute = impl.getStream(device);
    const c10::Stream side = side_stream(impl, device);
    c10::Event copied(c10::DeviceType::CUDA);
    at::Tensor result;
    {
      const c10::StreamGuard on_side(side);
      result = src->to(device, /*non_blocking=*/true);
      copied.record(side);
    }
    copied.block(compute);
    result.record_stream(compute);
    *out = new at::Tensor(std::move(result));
  });
}

}  // extern "C"
