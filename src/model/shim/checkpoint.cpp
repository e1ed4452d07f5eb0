// Autograd shim, two custom functions. Activation checkpointing: one that runs a Rust
// callback without grad in the forward pass (keeping only its inputs) and runs
// it again with grad in the backward pass, with the RNG state (CPU and the
// CUDA devices of the inputs) and the autocast state of the forward restored,
// then back-propagates through the recomputed outputs (accumulating into the
// parameters the callback used, as PyTorch's reentrant checkpoint does) and
// returns the inputs' gradients. A backward hook: an identity whose backward pass
// calls a Rust callback when the gradient of its output is complete (profiles time
// and measure each part of the backward pass with it). Rust side: src/model/checkpoint/.
//
// No C++ exception crosses this boundary: entry points return an owned error
// string (NULL on success) freed with vs_ckpt_string_free. A failing callback
// reports through vs_ckpt_fail; in the backward pass that becomes an exception
// the autograd engine turns into the error of the caller's backward call.

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "vs_errors.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

extern "C" {
// Runs the closure `ctx` on `n` inputs; pushes outputs (vs_ckpt_push) or an
// error (vs_ckpt_fail) into `result`; returns 0 on success. `phase` is 0 in the
// forward pass, 1 in the backward recomputation.
typedef int (*vs_ckpt_call_fn)(void* ctx, int phase, at::Tensor* const* inputs,
                               size_t n, void* result);
// Releases the closure `ctx`; called exactly once.
typedef void (*vs_ckpt_drop_fn)(void* ctx);
// A backward hook's callback; must not throw or unwind.
typedef void (*vs_hook_fn)(void* ctx);
}

namespace {

constexpr int kPhaseForward = 0;
constexpr int kPhaseBackward = 1;

using vs_shim::guarded;
using vs_shim::owned_copy;

// What one call of the callback produced.
struct CallResult {
  std::vector<at::Tensor> outputs;
  std::string error;
};

// RNG states to restore: the CPU generator's and one per CUDA device.
struct RngStates {
  at::Tensor cpu;
  std::vector<std::pair<at::Device, at::Tensor>> cuda;
};

at::Tensor generator_state(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_generator_state(at::Generator gen, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// The current states of the CPU generator and of every CUDA device in `devices`.
RngStates capture_rng(const std::vector<at::Device>& devices) {
  RngStates states;
  states.cpu = generator_state(at::detail::getDefaultCPUGenerator());
  for (const auto& device : devices) {
    states.cuda.emplace_back(
        device, generator_state(at::globalContext().defaultGenerator(device)));
  }
  return states;
}

void restore_rng(const RngStates& states) {
  set_generator_state(at::detail::getDefaultCPUGenerator(), states.cpu);
  for (const auto& [device, state] : states.cuda) {
    set_generator_state(at::globalContext().defaultGenerator(device), state);
  }
}

// The distinct CUDA devices of `tensors`.
std::vector<at::Device> cuda_devices(at::TensorList tensors) {
  std::vector<at::Device> out;
  for (const auto& t : tensors) {
    if (t.defined() && t.is_cuda()) {
      bool seen = false;
      for (const auto& d : out) {
        seen = seen || d == t.device();
      }
      if (!seen) {
        out.push_back(t.device());
      }
    }
  }
  return out;
}

// Autocast on/off and dtype for CUDA and CPU.
struct AutocastState {
  bool cuda_on = false;
  at::ScalarType cuda_dtype = at::kHalf;
  bool cpu_on = false;
  at::ScalarType cpu_dtype = at::kBFloat16;
};

AutocastState capture_autocast() {
  AutocastState s;
  s.cuda_on = at::autocast::is_autocast_enabled(at::kCUDA);
  s.cuda_dtype = at::autocast::get_autocast_dtype(at::kCUDA);
  s.cpu_on = at::autocast::is_autocast_enabled(at::kCPU);
  s.cpu_dtype = at::autocast::get_autocast_dtype(at::kCPU);
  return s;
}

void apply_autocast(const AutocastState& s) {
  at::autocast::set_autocast_enabled(at::kCUDA, s.cuda_on);
  at::autocast::set_autocast_dtype(at::kCUDA, s.cuda_dtype);
  at::autocast::set_autocast_enabled(at::kCPU, s.cpu_on);
  at::autocast::set_autocast_dtype(at::kCPU, s.cpu_dtype);
}

// For the recomputation: the forward's RNG and autocast state, the caller's
// restored on exit (like torch.random.fork_rng).
class ForwardStateScope {
 public:
  ForwardStateScope(const RngStates& rng, const AutocastState& autocast,
                    const std::vector<at::Device>& devices)
      : saved_rng_(capture_rng(devices)), saved_autocast_(capture_autocast()) {
    restore_rng(rng);
    apply_autocast(autocast);
  }
  ~ForwardStateScope() {
    try {
      restore_rng(saved_rng_);
      apply_autocast(saved_autocast_);
    } catch (...) {
      // Restoring a state just read cannot fail in practice; never throw here.
    }
  }
  ForwardStateScope(const ForwardStateScope&) = delete;
  ForwardStateScope& operator=(const ForwardStateScope&) = delete;

 private:
  RngStates saved_rng_;
  AutocastState saved_autocast_;
};

// A Rust closure the shim owns: `ctx`, the function that calls it and the one
// that releases it, exactly once, when this goes away (with the autograd node
// that holds it).
template <typename CallFn>
class RustClosure : public torch::CustomClassHolder {
 public:
  RustClosure(CallFn call, vs_ckpt_drop_fn drop, void* ctx)
      : call_(call), ctx_(ctx), drop_(drop) {}
  ~RustClosure() override {
    if (drop_ != nullptr) {
      drop_(ctx_);
    }
  }
  RustClosure(const RustClosure&) = delete;
  RustClosure& operator=(const RustClosure&) = delete;

 protected:
  CallFn call_;
  void* ctx_;

 private:
  vs_ckpt_drop_fn drop_;
};

// One checkpointed call: the Rust closure and the forward's RNG and autocast
// state.
class CallState : public RustClosure<vs_ckpt_call_fn> {
 public:
  using RustClosure::RustClosure;

  // Runs the closure on the first `real_inputs` of `inputs`; throws on failure.
  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs, int phase) {
    std::vector<at::Tensor*> ptrs;
    for (size_t i = 0; i < real_inputs && i < inputs.size(); ++i) {
      ptrs.push_back(const_cast<at::Tensor*>(&inputs[i]));
    }
    CallResult result;
    if (call_(ctx_, phase, ptrs.data(), ptrs.size(), &result) != 0) {
      const char* where = phase == kPhaseForward ? "forward pass" : "backward recomputation";
      throw std::runtime_error(std::string("checkpointed function failed in the ") + where +
                               ": " + result.error);
    }
    for (const auto& t : result.outputs) {
      if (!t.defined()) {
        throw std::runtime_error("checkpointed function returned an undefined tensor");
      }
    }
    if (result.outputs.empty()) {
      throw std::runtime_error("checkpointed function returned no tensor");
    }
    return std::move(result.outputs);
  }

  size_t real_inputs = 0;
  std::vector<at::Device> devices;
  RngStates rng;
  AutocastState autocast;
};

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<CallState> state,
                               at::TensorList inputs) {
    state->devices = cuda_devices(inputs);
    state->rng = capture_rng(state->devices);
    state->autocast = capture_autocast();
    std::vector<at::Tensor> detached;
    detached.reserve(inputs.size());
    for (const auto& t : inputs) {
      detached.push_back(t.detach());
    }
    variable_list outputs;
    {
      at::NoGradGuard no_grad;
      outputs = state->run(detached, kPhaseForward);
    }
    // An output that is an input (or shares its storage object) must be a new
    // tensor for autograd to give it this node as its history.
    for (auto& out : outputs) {
      for (const auto& in : detached) {
        if (out.unsafeGetTensorImpl() == in.unsafeGetTensorImpl()) {
          out = out.clone();
        }
      }
    }
    ctx->save_for_backward(inputs.vec());
    ctx->saved_data["state"] =
        c10::IValue::make_capsule(c10::intrusive_ptr<torch::CustomClassHolder>(state));
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto state =
        c10::static_intrusive_pointer_cast<CallState>(ctx->saved_data["state"].toCapsule());
    auto saved = ctx->get_saved_variables();
    std::vector<at::Tensor> leaves;
    leaves.reserve(saved.size());
    for (const auto& t : saved) {
      auto leaf = t.detach();
      leaf.requires_grad_(t.requires_grad());
      leaves.push_back(leaf);
    }
    variable_list outputs;
    {
      ForwardStateScope scope(state->rng, state->autocast, state->devices);
      at::AutoGradMode grad_on(true);
      outputs = state->run(leaves, kPhaseBackward);
    }
    if (outputs.size() != grads.size()) {
      throw std::runtime_error("checkpointed function returned " +
                               std::to_string(outputs.size()) +
                               " tensors in the recomputation, " +
                               std::to_string(grads.size()) + " in the forward pass");
    }
    variable_list with_grad;
    variable_list their_grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].requires_grad() && grads[i].defined()) {
        with_grad.push_back(outputs[i]);
        their_grads.push_back(grads[i]);
      }
    }
    if (!with_grad.empty()) {
      at::AutoGradMode grad_on(true);
      torch::autograd::backward(with_grad, their_grads);
    }
    variable_list result;
    result.reserve(leaves.size() + 1);
    result.emplace_back();  // the CallState argument
    for (const auto& leaf : leaves) {
      result.push_back(leaf.requires_grad() ? leaf.grad() : at::Tensor());
    }
    return result;
  }
};


// One backward hook: the Rust callback.
class HookState : public RustClosure<vs_hook_fn> {
 public:
  using RustClosure::RustClosure;

  void fire() { call_(ctx_); }
};

// The identity in the forward pass; its backward calls the hook and passes the
// gradient through unchanged. The output shares the input's storage and version
// counter but is not a view of it (a view made in a custom function could not be
// changed in place), so in-place changes downstream behave as without the hook.
struct BackwardHook : public torch::autograd::Function<BackwardHook> {
  static at::Tensor forward(AutogradContext* ctx, c10::intrusive_ptr<HookState> state,
                            const at::Tensor& input) {
    ctx->saved_data["state"] =
        c10::IValue::make_capsule(c10::intrusive_ptr<torch::CustomClassHolder>(state));
    return input.detach();
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto state =
        c10::static_intrusive_pointer_cast<HookState>(ctx->saved_data["state"].toCapsule());
    state->fire();
    return {at::Tensor(), grads[0]};
  }
};

// A `State` that owns `ctx`; null (with `ctx` released) if it cannot be made.
template <typename State, typename CallFn>
c10::intrusive_ptr<State> adopt(CallFn call, vs_ckpt_drop_fn drop, void* ctx) {
  try {
    return c10::make_intrusive<State>(call, drop, ctx);
  } catch (...) {
    drop(ctx);
    return {};
  }
}

}  // namespace

extern "C" {

void vs_ckpt_string_free(char* text) { std::free(text); }

void vs_ckpt_free_array(at::Tensor** array) { std::free(array); }

int vs_ckpt_grad_enabled() { return at::GradMode::is_enabled() ? 1 : 0; }

// Appends a copy of `tensor` to the outputs of `result` (a CallResult).
int vs_ckpt_push(void* result, const at::Tensor* tensor) {
  try {
    static_cast<CallResult*>(result)->outputs.push_back(*tensor);
    return 0;
  } catch (...) {
    return 1;
  }
}

// Records why the callback failed.
void vs_ckpt_fail(void* result, const char* message, size_t len) {
  try {
    static_cast<CallResult*>(result)->error.assign(message, len);
  } catch (...) {
  }
}

// Runs `call(ctx, ...)` on `inputs` as a checkpointed function. Takes ownership
// of `ctx` (released through `drop`, also on failure). On success `*outputs` is
// a malloc'd array (freed with vs_ckpt_free_array) of `*n_outputs` new'd
// tensors the caller owns.
char* vs_checkpoint(vs_ckpt_call_fn call, vs_ckpt_drop_fn drop, void* ctx,
                    const at::Tensor* const* inputs, size_t n_inputs, at::Tensor*** outputs,
                    size_t* n_outputs) {
  *outputs = nullptr;
  *n_outputs = 0;
  auto state = adopt<CallState>(call, drop, ctx);
  if (!state) {
    return owned_copy("checkpoint: out of memory");
  }
  return guarded([&] {
    std::vector<at::Tensor> in;
    in.reserve(n_inputs + 1);
    bool any_grad = false;
    for (size_t i = 0; i < n_inputs; ++i) {
      in.push_back(*inputs[i]);
      any_grad = any_grad || in.back().requires_grad();
    }
    state->real_inputs = n_inputs;
    // Parameters inside the closure need the node even when no input requires
    // grad: an empty anchor input that does makes it part of the graph.
    if (at::GradMode::is_enabled() && !any_grad) {
      in.push_back(at::empty({0}, at::TensorOptions().dtype(at::kFloat)).requires_grad_(true));
    }
    auto outs = CheckpointFunction::apply(std::move(state), at::TensorList(in));
    auto* array = static_cast<at::Tensor**>(std::malloc(sizeof(at::Tensor*) * outs.size()));
    if (array == nullptr) {
      throw std::runtime_error("checkpoint: out of memory");
    }
    for (size_t i = 0; i < outs.size(); ++i) {
      array[i] = new at::Tensor(std::move(outs[i]));
    }
    *outputs = array;
    *n_outputs = outs.size();
  });
}

// `*output` = the identity of `input` whose backward pass calls `call(ctx)`. Takes
// ownership of `ctx` (released through `drop`, also on failure).
char* vs_backward_hook(vs_hook_fn call, vs_ckpt_drop_fn drop, void* ctx, const at::Tensor* input,
                       at::Tensor** output) {
  *output = nullptr;
  auto state = adopt<HookState>(call, drop, ctx);
  if (!state) {
    return owned_copy("backward hook: out of memory");
  }
  return guarded(
      [&] { *output = new at::Tensor(BackwardHook::apply(std::move(state), *input)); });
}

}  // extern "C"
