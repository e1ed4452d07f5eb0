// c10d shim: exposes libtorch's distributed engine (TCPStore + PrefixStore
// rendezvous, ProcessGroupGloo, ProcessGroupNCCL when built with
// VS_WITH_NCCL, PyTorch DDP's gradient Reducer, the CUDA caching allocator's
// statistics) through a C ABI
// for the Rust side (src/ddp/ffi.rs). No C++ exception crosses this
// boundary: every entry point catches and returns an owned error string
// (NULL on success) that the caller frees with vs_string_free.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "vs_errors.h"

#include <ATen/ATen.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/version.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/default_comm_hooks.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#ifdef VS_WITH_NCCL
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/NCCLUtils.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace {

// Backends the Rust side can ask for (mirrors `Backend` in src/ddp/ffi.rs).
constexpr int kBackendGloo = 0;
constexpr int kBackendNccl = 1;

// Reductions (mirrors `ReduceOp` in src/ddp/ffi.rs).
constexpr int kOpSum = 0;
constexpr int kOpAvg = 1;
constexpr int kOpMin = 2;
constexpr int kOpMax = 3;

using vs_shim::guarded;
using vs_shim::owned_copy;

bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1";
}

}  // namespace

// A process group and the store it rendezvoused through.
struct vs_group {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> backend;
  int backend_kind;
  int rank;
  int world;
  int device_index;
  std::chrono::milliseconds timeout;
  // Collectives this rank has entered; posted to the store before each one so
  // that a failed rank can tell which peers never reached it.
  uint64_t seq = 0;
  // The backend as a c10d::ProcessGroup (what the Reducer drives), made on
  // first use.
  c10::intrusive_ptr<c10d::ProcessGroup> process_group;
};

// PyTorch DDP's Reducer over one group's parameters (see vs_reducer_new).
// Hears of the gradient buckets a reducing backward pass launches (for the
// rank's heartbeat): `launched` 0 right before the bucket numbered `count` (in
// launch order, from 0) is handed to the communication hook, 1 right after, with
// `count` the buckets launched so far. Called on the autograd thread.
typedef void (*vs_bucket_fn)(void* ctx, int64_t count, int launched);

struct vs_reducer {
  std::unique_ptr<c10d::Reducer> reducer;
  bool static_graph = false;
  // Backward passes that reduced gradients so far.
  uint64_t synced_backwards = 0;
  // Buckets the current reducing backward pass launched, and who hears of them
  // (set with vs_reducer_watch for the pass; null otherwise).
  int64_t launched = 0;
  vs_bucket_fn on_bucket = nullptr;
  void* on_bucket_ctx = nullptr;
};

// What the linked libtorch offers on the CUDA side (mirrors `RawCudaRuntime`).
// Versions are 0 where unknown: libtorch's CUDA hooks answer only once
// libtorch_cuda.so is loaded and registered them.
struct vs_cuda_runtime {
  int hooks_registered;  // 1 when libtorch_cuda's hooks answer
  long cuda_built;       // CUDART_VERSION libtorch was built with (13000 = 13.0)
  long cudnn_built;      // cuDNN version libtorch was built with (91900 = 9.19.0)
  long cudnn_loaded;     // cuDNN version of the library loaded now
  int device_count;      // CUDA devices visible now
};

// One CUDA device (mirrors `RawCudaDevice`).
struct vs_cuda_device {
  char name[256];
  uint64_t total_memory;
  int major;
  int minor;
  int multiprocessors;
};

// CUDA caching allocator figures for one device, in bytes.
struct vs_cuda_mem_stats {
  int64_t allocated_current;
  int64_t allocated_peak;
  int64_t reserved_current;
  int64_t reserved_peak;
};

namespace {

std::string progress_key(int rank) { return "progress/" + std::to_string(rank); }

// Posts "<op> #<seq>" for this rank. Best effort: a store that is gone (rank
// 0 died) must not mask the collective's own error.
void post_progress(vs_group* group, const char* op, uint64_t seq) {
  try {
    std::string text = std::string(op) + " #" + std::to_string(seq);
    group->store->set(progress_key(group->rank),
                      std::vector<uint8_t>(text.begin(), text.end()));
  } catch (...) {
  }
}

// Names the peers that never entered collective `seq`, from their posted
// progress; empty when the store cannot tell (it lives in rank 0).
std::string laggards(vs_group* group, uint64_t seq) {
  std::ostringstream out;
  try {
    bool first = true;
    for (int r = 0; r < group->world; ++r) {
      if (r == group->rank) continue;
      std::string last = "no collective";
      bool behind = true;
      if (group->store->check({progress_key(r)})) {
        auto bytes = group->store->get(progress_key(r));
        last.assign(bytes.begin(), bytes.end());
        auto hash = last.rfind('#');
        behind = hash == std::string::npos ||
                 std::stoull(last.substr(hash + 1)) < seq;
      }
      if (behind) {
        out << (first ? "" : "; ") << "rank " << r << " last entered " << last;
        first = false;
      }
    }
  } catch (...) {
    return "";
  }
  return out.str();
}

// Runs one collective: posts progress, runs `body`, and on failure appends
// the peers that never reached this collective.
template <typename F>
char* collective(vs_group* group, const char* op, F&& body) {
  const uint64_t seq = group->seq++;
  post_progress(group, op, seq);
  char* error = guarded(body);
  if (error == nullptr) return nullptr;
  std::string message(error);
  std::free(error);
  std::string behind = laggards(group, seq);
  if (!behind.empty()) {
    message += " (peers that never reached " + std::string(op) + " #" +
               std::to_string(seq) + ": " + behind + ")";
  }
  return owned_copy(message);
}

}  // namespace

extern "C" {

void vs_string_free(char* text) { std::free(text); }

int vs_nccl_compiled() {
#ifdef VS_WITH_NCCL
  return 1;
#else
  return 0;
#endif
}

// The libtorch version this shim was compiled against ("2.11.0"); owned.
char* vs_torch_version() { return owned_copy(TORCH_VERSION); }

// Fills `out` from libtorch's CUDA hooks; never fails (a hook that throws,
// because libtorch_cuda is not loaded or no driver is present, leaves 0).
void vs_cuda_runtime_info(vs_cuda_runtime* out) {
  std::memset(out, 0, sizeof(*out));
  const auto& hooks = at::detail::getCUDAHooks();
  try {
    out->cuda_built = hooks.versionCUDART();
    out->hooks_registered = 1;
  } catch (...) {
    return;
  }
  try {
    if (hooks.compiledWithCuDNN()) out->cudnn_built = hooks.versionCuDNN();
  } catch (...) {
  }
  try {
    if (hooks.compiledWithCuDNN()) out->cudnn_loaded = hooks.versionRuntimeCuDNN();
  } catch (...) {
  }
  try {
    out->device_count = hooks.getNumGPUs();
  } catch (...) {
  }
}

// The NCCL library version loaded at run time ("2.28.9"), into an owned
// string; an error when the shim has no NCCL or the library cannot answer.
char* vs_nccl_version(char** out) {
  *out = nullptr;
  return guarded([&] {
#ifdef VS_WITH_NCCL
    *out = owned_copy(c10d::getNcclVersion());
#else
    throw std::runtime_error("this build of the c10d shim has no NCCL");
#endif
  });
}

// Properties of CUDA device `device`.
char* vs_cuda_device_info(int device, vs_cuda_device* out) {
  std::memset(out, 0, sizeof(*out));
  return guarded([&] {
#ifdef VS_WITH_NCCL
    if (device < 0 || device >= static_cast<int>(c10::cuda::device_count())) {
      throw std::invalid_argument("no CUDA device " + std::to_string(device) +
                                  " (" + std::to_string(c10::cuda::device_count()) +
                                  " visible)");
    }
    const cudaDeviceProp* props =
        at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(device));
    std::strncpy(out->name, props->name, sizeof(out->name) - 1);
    out->total_memory = props->totalGlobalMem;
    out->major = props->major;
    out->minor = props->minor;
    out->multiprocessors = props->multiProcessorCount;
#else
    (void)device;
    throw std::runtime_error("this build of the c10d shim has no CUDA support");
#endif
  });
}

// Connects to (rank 0: serves) the TCPStore at master_addr:port, checks that
// every rank joined within timeout_ms (naming the missing ranks if not), then
// builds the backend's process group. `prefix` namespaces this group's keys.
char* vs_group_new(int backend_kind, const char* master_addr, uint16_t port,
                   int rank, int world, int64_t timeout_ms, const char* prefix,
                   int device_index, vs_group** out) {
  *out = nullptr;
  return guarded([&] {
    if (world < 1 || rank < 0 || rank >= world) {
      throw std::invalid_argument("rank " + std::to_string(rank) +
                                  " out of range for world size " +
                                  std::to_string(world));
    }
    auto timeout = std::chrono::milliseconds(timeout_ms);
    std::string host(master_addr);
    c10d::TCPStoreOptions opts;
    opts.port = port;
    opts.isServer = rank == 0;
    opts.numWorkers = world;
    opts.waitWorkers = false;
    opts.timeout = timeout;
    c10::intrusive_ptr<c10d::Store> tcp;
    try {
      tcp = c10::make_intrusive<c10d::TCPStore>(host, opts);
    } catch (const std::exception& e) {
      std::string what = e.what();
      if (auto* ce = dynamic_cast<const c10::Error*>(&e)) {
        what = ce->what_without_backtrace();
      }
      throw std::runtime_error(
          (rank == 0 ? "could not serve the rendezvous store on port "
                     : "could not reach rank 0's rendezvous store at ") +
          (rank == 0 ? std::to_string(port)
                     : host + ":" + std::to_string(port)) +
          " within " + std::to_string(timeout_ms) + " ms: " + what);
    }
    auto store = c10::make_intrusive<c10d::PrefixStore>(
        std::string("vrtspike/") + prefix, tcp);

    // Join barrier with a named culprit: every rank posts its key, then waits
    // for all of them; on time-out it reports which ranks never posted.
    store->set("join/" + std::to_string(rank), std::vector<uint8_t>{1});
    std::vector<std::string> keys;
    for (int r = 0; r < world; ++r) keys.push_back("join/" + std::to_string(r));
    try {
      store->wait(keys, timeout);
    } catch (const std::exception&) {
      std::ostringstream missing;
      bool first = true;
      for (int r = 0; r < world; ++r) {
        if (!store->check({keys[r]})) {
          missing << (first ? "" : ", ") << r;
          first = false;
        }
      }
      throw std::runtime_error("rendezvous timed out after " +
                               std::to_string(timeout_ms) +
                               " ms: rank(s) [" + missing.str() +
                               "] of " + std::to_string(world) +
                               " did not join");
    }

    auto group = std::make_unique<vs_group>();
    group->store = store;
    group->backend_kind = backend_kind;
    group->rank = rank;
    group->world = world;
    group->device_index = device_index;
    group->timeout = timeout;
    auto pg_store = c10::make_intrusive<c10d::PrefixStore>("pg", store);
    if (backend_kind == kBackendGloo) {
      auto options = c10d::ProcessGroupGloo::Options::create(timeout);
      const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
      if (ifname != nullptr && *ifname != '\0') {
        options->devices.push_back(
            c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
      } else if (is_loopback(host)) {
        options->devices.push_back(
            c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
      } else {
        options->devices.push_back(
            c10d::ProcessGroupGloo::createDefaultDevice());
      }
      group->backend = c10::make_intrusive<c10d::ProcessGroupGloo>(
          pg_store, rank, world, options);
    } else if (backend_kind == kBackendNccl) {
#ifdef VS_WITH_NCCL
      if (device_index < 0 ||
          device_index >= static_cast<int>(c10::cuda::device_count())) {
        throw std::invalid_argument(
            "NCCL needs a CUDA device, but device " +
            std::to_string(device_index) + " is not among the " +
            std::to_string(c10::cuda::device_count()) + " visible");
      }
      c10::cuda::set_device(static_cast<c10::DeviceIndex>(device_index));
      auto options = c10d::ProcessGroupNCCL::Options::create();
      options->timeout = timeout;
      group->backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(
          pg_store, rank, world, options);
#else
      throw std::invalid_argument(
          "this build has no NCCL backend (the CUDA/NCCL headers were not "
          "found when the c10d shim was compiled)");
#endif
    } else {
      throw std::invalid_argument("unknown backend " +
                                  std::to_string(backend_kind));
    }
    *out = group.release();
  });
}

void vs_group_free(vs_group* group) {
  try {
    delete group;
  } catch (...) {
    // A destructor that throws has nothing left to report to; swallow.
  }
}

// All-reduces one tensor in place. Gloo has no AVG: it sums then divides.
char* vs_group_allreduce(vs_group* group, at::Tensor* tensor, int op) {
  return collective(group, "all_reduce", [&] {
    c10d::AllreduceOptions opts;
    opts.timeout = group->timeout;
    bool divide = false;
    switch (op) {
      case kOpSum: opts.reduceOp = c10d::ReduceOp::SUM; break;
      case kOpMin: opts.reduceOp = c10d::ReduceOp::MIN; break;
      case kOpMax: opts.reduceOp = c10d::ReduceOp::MAX; break;
      case kOpAvg:
        if (!at::isFloatingType(tensor->scalar_type())) {
          throw std::invalid_argument("average needs a floating-point tensor");
        }
        if (group->backend_kind == kBackendNccl) {
          opts.reduceOp = c10d::ReduceOp::AVG;
        } else {
          opts.reduceOp = c10d::ReduceOp::SUM;
          divide = true;
        }
        break;
      default:
        throw std::invalid_argument("unknown reduce op " + std::to_string(op));
    }
    std::vector<at::Tensor> tensors{*tensor};
    auto work = group->backend->allreduce(tensors, opts);
    work->wait(group->timeout);
    if (divide && group->world > 1) {
      tensor->div_(group->world);
    }
  });
}

// Broadcasts one tensor in place from `root`.
char* vs_group_broadcast(vs_group* group, at::Tensor* tensor, int root) {
  return collective(group, "broadcast", [&] {
    if (root < 0 || root >= group->world) {
      throw std::invalid_argument("root rank " + std::to_string(root) +
                                  " out of range for world size " +
                                  std::to_string(group->world));
    }
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    opts.timeout = group->timeout;
    std::vector<at::Tensor> tensors{*tensor};
    auto work = group->backend->broadcast(tensors, opts);
    work->wait(group->timeout);
  });
}

char* vs_group_barrier(vs_group* group) {
  return collective(group, "barrier", [&] {
    c10d::BarrierOptions opts;
    opts.timeout = group->timeout;
    if (group->backend_kind == kBackendNccl) {
      opts.device_ids = {group->device_index};
    }
    auto work = group->backend->barrier(opts);
    work->wait(group->timeout);
  });
}

// Gives `param` a zero gradient when it has none, so that every rank's
// gradient list has the same layout even if a parameter went unused.
char* vs_ensure_grad(at::Tensor* param) {
  return guarded([&] {
    if (!param->mutable_grad().defined()) {
      param->mutable_grad() = at::zeros_like(*param);
    }
  });
}

// Fills `out` for CUDA device `device`; `*available` is 0 (and `out` zeroed)
// when the build has no CUDA support or the device does not exist.
char* vs_cuda_memory_stats(int device, vs_cuda_mem_stats* out, int* available) {
  std::memset(out, 0, sizeof(*out));
  *available = 0;
  return guarded([&] {
#ifdef VS_WITH_NCCL
    if (device < 0 || device >= static_cast<int>(c10::cuda::device_count())) {
      return;
    }
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(
        static_cast<c10::DeviceIndex>(device));
    const auto agg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    out->allocated_current = stats.allocated_bytes[agg].current;
    out->allocated_peak = stats.allocated_bytes[agg].peak;
    out->reserved_current = stats.reserved_bytes[agg].current;
    out->reserved_peak = stats.reserved_bytes[agg].peak;
    *available = 1;
#else
    (void)device;
#endif
  });
}

// Starts the peak figures of CUDA device `device` anew from the current ones (a
// profile's peak per part); a no-op without CUDA or without the device.
char* vs_cuda_reset_peak(int device) {
  return guarded([&] {
#ifdef VS_WITH_NCCL
    if (device >= 0 && device < static_cast<int>(c10::cuda::device_count())) {
      c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(device));
    }
#else
    (void)device;
#endif
  });
}

// Returns the CUDA caching allocator's unused blocks to the driver; a no-op
// without CUDA.
char* vs_cuda_empty_cache() {
  return guarded([&] {
#ifdef VS_WITH_NCCL
    if (c10::cuda::device_count() > 0) {
      c10::cuda::CUDACachingAllocator::emptyCache();
    }
#endif
  });
}

}  // extern "C"

// ---------------------------------------------------------------------------
// Gradient reduction overlapped with backward: PyTorch DDP's c10d::Reducer
// (torch/csrc/distributed/c10d/reducer.hpp; Li et al., "PyTorch Distributed",
// VLDB 2020). Autograd hooks on each parameter's gradient accumulator mark it
// ready; a bucket's all-reduce starts once its last gradient exists, while
// backward goes on. The caller drives one iteration as Python's
// DistributedDataParallel does: vs_reducer_forward before each forward pass,
// vs_reducer_backward for its backward pass.

// Gradient compression codes (mirrors `GradCompression` in src/ddp/ffi.rs).
constexpr int kCompressNone = 0;
constexpr int kCompressFp16 = 1;
constexpr int kCompressBf16 = 2;

namespace {

// The group's backend wrapped as the c10d::ProcessGroup the Reducer takes.
c10::intrusive_ptr<c10d::ProcessGroup> process_group_of(vs_group* group) {
  if (!group->process_group) {
    auto pg = c10::make_intrusive<c10d::ProcessGroup>(group->store, group->rank, group->world);
    const bool nccl = group->backend_kind == kBackendNccl;
    const auto type = nccl ? c10d::ProcessGroup::BackendType::NCCL
                           : c10d::ProcessGroup::BackendType::GLOO;
    pg->setBackend(nccl ? c10::DeviceType::CUDA : c10::DeviceType::CPU, type, group->backend);
    pg->setDefaultBackend(type);
    group->process_group = pg;
  }
  return group->process_group;
}

// Averages a bucket: divides it by the world size, then sums it over the ranks
// in place (what libtorch's ALLREDUCE hook does, and the Reducer's own path
// without a hook; the hook classes libtorch builds in are not exported from
// libtorch_cpu, so the shim has its own).
class AverageHook
    : public c10d::CppCommHookInterface<c10::intrusive_ptr<c10d::ProcessGroup>> {
 public:
  explicit AverageHook(const c10::intrusive_ptr<c10d::ProcessGroup>& pg)
      : CppCommHookInterface(pg) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    std::vector<at::Tensor> tensors{bucket.getBufferRef()};
    tensors[0].div_(state_->getSize());
    return state_->allreduce(tensors)->getFuture();
  }
};

// Averages a bucket in a narrower float dtype (float16: libtorch's FP16_COMPRESS;
// bfloat16: its twin, which libtorch has only in Python,
// torch.distributed.algorithms.ddp_comm_hooks). Divides before the all-reduce so
// the sum cannot overflow, then writes the result back into the bucket in its own
// dtype.
class CompressHook
    : public c10d::CppCommHookInterface<c10::intrusive_ptr<c10d::ProcessGroup>> {
 public:
  CompressHook(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, at::ScalarType dtype)
      : CppCommHookInterface(pg), dtype_(dtype) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    auto compressed = bucket.getBufferRef().to(dtype_);
    compressed.div_(state_->getSize());
    std::vector<at::Tensor> tensors{compressed};
    auto reduced = state_->allreduce(tensors)->getFuture();
    at::Tensor target = bucket.getBufferRef();
    auto back = [target](c10::ivalue::Future& done) {
      auto result = done.value().toTensorVector();
      TORCH_CHECK(!result.empty(), "compressed all-reduce returned no tensor");
      target.copy_(result[0]);
      return c10::IValue(target);
    };
    return reduced->then(back, reduced->elementType());
  }

 private:
  at::ScalarType dtype_;
};

// Counts the buckets a backward pass launches and tells the reducer's watcher
// (vs_reducer_watch) before and after each, then hands the bucket to the hook
// that reduces it (AverageHook or CompressHook): every Reducer gets one.
class CountingHook : public c10d::CommHookInterface {
 public:
  CountingHook(std::unique_ptr<c10d::CommHookInterface> inner, vs_reducer* state)
      : inner_(std::move(inner)), state_(state) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    const int64_t before = state_->launched;
    if (state_->on_bucket != nullptr) state_->on_bucket(state_->on_bucket_ctx, before, 0);
    auto future = inner_->runHook(bucket);
    state_->launched = before + 1;
    if (state_->on_bucket != nullptr) state_->on_bucket(state_->on_bucket_ctx, before + 1, 1);
    return future;
  }

  at::Tensor parseHookResult(const c10::IValue& result) override {
    return inner_->parseHookResult(result);
  }

 private:
  std::unique_ptr<c10d::CommHookInterface> inner_;
  vs_reducer* state_;  // owns the Reducer that owns this hook: outlives it
};

}  // namespace

extern "C" {

// Overwrites every rank's `params` with rank 0's (as DDP does at construction)
// and builds a Reducer over them: PyTorch DDP's buckets (the first capped at
// `first_bucket_bytes`, the rest at `bucket_bytes`; rebuilt after the first
// reducing iteration in the order gradients arrived), gradients as bucket views,
// every parameter expected to get a gradient. `static_graph` is DDP's
// static_graph=True: the hooks a parameter fires per backward are counted in the
// first iteration, which lets reentrant activation checkpointing (a parameter's
// accumulator firing once per recomputed block) work. `compression` picks the
// communication hook.
char* vs_reducer_new(vs_group* group, at::Tensor* const* params, size_t n,
                     int64_t first_bucket_bytes, int64_t bucket_bytes, int compression,
                     int static_graph, vs_reducer** out) {
  *out = nullptr;
  return collective(group, "broadcast", [&] {
    if (n == 0) throw std::invalid_argument("the Reducer needs at least one parameter");
    if (compression != kCompressNone && compression != kCompressFp16 &&
        compression != kCompressBf16) {
      throw std::invalid_argument("unknown gradient compression " + std::to_string(compression));
    }
    std::vector<at::Tensor> tensors;
    tensors.reserve(n);
    for (size_t i = 0; i < n; ++i) tensors.push_back(*params[i]);
    auto pg = process_group_of(group);
    {
      at::NoGradGuard no_grad;
      c10d::broadcast_coalesced(pg, tensors, 250u << 20, 0);
    }
    const std::vector<size_t> caps{static_cast<size_t>(first_bucket_bytes),
                                   static_cast<size_t>(bucket_bytes)};
    auto [indices, limits] = c10d::compute_bucket_assignment_by_size(
        tensors, caps, std::vector<bool>(n, false));
    // The last parameters' gradients come first in backward: reduce their buckets first.
    std::reverse(indices.begin(), indices.end());
    std::vector<int64_t> per_bucket(limits.rbegin(), limits.rend());
    auto state = std::make_unique<vs_reducer>();
    state->reducer = std::make_unique<c10d::Reducer>(
        tensors, std::move(indices), pg, std::vector<bool>(n, false), bucket_bytes,
        /*find_unused_parameters=*/false, /*gradient_as_bucket_view=*/true,
        std::unordered_map<size_t, std::string>{}, first_bucket_bytes,
        /*skip_all_reduce_unused_params=*/false, /*use_python_reducer=*/false,
        std::move(per_bucket));
    if (static_graph != 0) {
      state->reducer->set_static_graph();
      state->static_graph = true;
    }
    std::unique_ptr<c10d::CommHookInterface> hook;
    if (compression == kCompressFp16) {
      hook = std::make_unique<CompressHook>(pg, at::kHalf);
    } else if (compression == kCompressBf16) {
      hook = std::make_unique<CompressHook>(pg, at::kBFloat16);
    } else {
      hook = std::make_unique<AverageHook>(pg);
    }
    state->reducer->register_comm_hook(std::make_unique<CountingHook>(std::move(hook), state.get()));
    *out = state.release();
  });
}

void vs_reducer_free(vs_reducer* reducer) {
  try {
    delete reducer;
  } catch (...) {
    // ~Reducer is noexcept(false); nothing is left to report to.
  }
}

// Sets who hears of the buckets the next reducing backward passes launch
// (`on_bucket` with `ctx`), or nobody (null): the caller sets it for one pass and
// clears it before `ctx` goes.
void vs_reducer_watch(vs_reducer* reducer, vs_bucket_fn on_bucket, void* ctx) {
  reducer->on_bucket = on_bucket;
  reducer->on_bucket_ctx = on_bucket == nullptr ? nullptr : ctx;
}

// Before a forward pass with grad: rebuilds the buckets once gradients arrived in
// a reducing iteration (a broadcast from rank 0, on every rank at the same
// step), then, with `count`, counts the pass as one of the Reducer's iterations
// (the caller counts every pass from the first reducing one on).
char* vs_reducer_forward(vs_reducer* reducer, int count) {
  return guarded([&] {
    reducer->reducer->rebuild_buckets();
    if (count != 0) reducer->reducer->prepare_for_forward();
  });
}

// Back-propagates `loss`. With `sync`, the Reducer averages every parameter's
// gradient over the ranks while backward runs and before this returns (in the
// static graph's first iteration, once backward is done); without, gradients
// accumulate locally (DDP's no_sync). `*exposed_ns` is the communication
// backward did not hide: from the last gradient's arrival (the Reducer's
// backward stats) to the return; the whole pass in the static graph's first
// iteration, whose all-reduces all wait for backward's end; 0 without `sync`.
char* vs_reducer_backward(vs_group* group, vs_reducer* reducer, at::Tensor* loss, int sync,
                          int64_t* exposed_ns) {
  *exposed_ns = 0;
  if (sync == 0) {
    return guarded([&] { torch::autograd::backward({*loss}); });
  }
  return collective(group, "all_reduce", [&] {
    const auto started = std::chrono::steady_clock::now();
    reducer->launched = 0;
    reducer->reducer->prepare_for_backward({});
    torch::autograd::backward({*loss});
    reducer->synced_backwards += 1;
    int64_t last_ready = 0;
    if (reducer->static_graph && reducer->synced_backwards == 1) {
      reducer->reducer->delay_all_reduce();
    } else {
      for (int64_t t : reducer->reducer->get_backward_stats()) last_ready = std::max(last_ready, t);
    }
    const int64_t total = std::chrono::duration_cast<std::chrono::nanoseconds>(
                              std::chrono::steady_clock::now() - started)
                              .count();
    *exposed_ns = std::max<int64_t>(0, total - last_ready);
  });
}

}  // extern "C"
