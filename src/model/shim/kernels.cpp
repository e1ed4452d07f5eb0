// Kernel and precision switches of libtorch that tch does not reach: whether
// scaled_dot_product_attention may use cuDNN's attention kernel (a process-wide
// switch of at::globalContext(), as torch.backends.cuda.enable_cudnn_sdp is;
// Rust side src/model/sdp.rs), the dtype autocast computes in on CUDA or on the
// CPU (per thread) and TF32 (src/model/precision.rs). No C++ exception crosses this
// boundary.

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>

namespace {
// The device type of autocast's `cuda` (!= 0) or CPU state.
at::DeviceType autocast_device(int cuda) { return cuda != 0 ? at::kCUDA : at::kCPU; }
}  // namespace

extern "C" {

// Lets SDPA choose cuDNN's attention kernel (`on` != 0) or not; returns whether
// it could before, or -1 if libtorch refused.
int vs_sdp_use_cudnn(int on) {
  try {
    const bool was = at::globalContext().userEnabledCuDNNSDP();
    at::globalContext().setSDPUseCuDNN(on != 0);
    return was ? 1 : 0;
  } catch (...) {
    return -1;
  }
}

// The dtype autocast computes in on this thread on CUDA (`cuda` != 0) or the CPU: 0
// when autocast is off, 1 float16, 2 bfloat16, 3 another; -1 if libtorch refused.
int vs_autocast_kind(int cuda) {
  try {
    const auto device = autocast_device(cuda);
    if (!at::autocast::is_autocast_enabled(device)) return 0;
    const auto dtype = at::autocast::get_autocast_dtype(device);
    if (dtype == at::kHalf) return 1;
    if (dtype == at::kBFloat16) return 2;
    return 3;
  } catch (...) {
    return -1;
  }
}

// Autocast's state on one device type before an enter, restored by the matching
// exit.
struct vs_autocast_prev {
  int enabled;
  int bf16;
};

// Turns autocast on CUDA (`cuda` != 0) or the CPU on in bfloat16 (`bf16`) or
// float16, one nesting level deeper, saving the state before into `prev`; returns
// 0, or -1 if libtorch refused (then nothing changed).
int vs_autocast_enter(int cuda, int bf16, vs_autocast_prev* prev) {
  try {
    const auto device = autocast_device(cuda);
    prev->enabled = at::autocast::is_autocast_enabled(device) ? 1 : 0;
    prev->bf16 = at::autocast::get_autocast_dtype(device) == at::kBFloat16 ? 1 : 0;
    at::autocast::set_autocast_enabled(device, true);
    at::autocast::set_autocast_dtype(device, bf16 ? at::kBFloat16 : at::kHalf);
    at::autocast::increment_nesting();
    return 0;
  } catch (...) {
    return -1;
  }
}

// Leaves the nesting level `prev` was saved at on that device type: the outermost
// exit clears autocast's cast cache; the state before the enter comes back.
int vs_autocast_exit(int cuda, const vs_autocast_prev* prev) {
  try {
    const auto device = autocast_device(cuda);
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(device, prev->enabled != 0);
    at::autocast::set_autocast_dtype(device, prev->bf16 ? at::kBFloat16 : at::kHalf);
    return 0;
  } catch (...) {
    return -1;
  }
}

// Allows or forbids TF32 in cuBLAS matrix products and cuDNN convolutions for
// the process; returns 0, or -1 if libtorch refused.
int vs_allow_tf32(int on) {
  try {
    at::globalContext().setAllowTF32CuBLAS(on != 0);
    at::globalContext().setAllowTF32CuDNN(on != 0);
    return 0;
  } catch (...) {
    return -1;
  }
}

}  // extern "C"
