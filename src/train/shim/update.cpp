// The optimizer step in a handful of multi-tensor kernels (tch 0.24 binds none of
// these): the global gradient norm as one `_foreach_norm` and one norm, every
// gradient scaled or zeroed in one call, AdamW as libtorch's fused kernel
// (`_fused_adamw_`, CUDA and CPU; its step counts and `found_inf` stay on the
// device) or PyTorch's multi-tensor form (`_foreach_*`, the step count on the host),
// and the fp16 loss scaler's unscale-and-check and scale update. Rust side:
// src/train/optim/kernels.rs.
//
// Tensors cross as tch's C tensor pointers (`at::Tensor*`); a list is an array of
// them and its length. No C++ exception crosses this boundary: every entry point
// returns an owned error string (NULL on success) freed with vs_update_string_free.

#include <cmath>
#include <cstdlib>
#include <vector>

#include "vs_errors.h"

#include <ATen/ATen.h>

namespace {

using vs_shim::guarded;

std::vector<at::Tensor> list(at::Tensor* const* tensors, size_t n) {
  std::vector<at::Tensor> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    out.push_back(*tensors[i]);
  }
  return out;
}

}  // namespace

extern "C" {

void vs_update_string_free(char* text) { std::free(text); }

// `*out` = the L2 norm of all `n` (> 0) tensors together, a 0-dim float tensor on
// their device: one `_foreach_norm`, then the norm of the per-tensor norms.
char* vs_update_total_norm(at::Tensor* const* tensors, size_t n, at::Tensor** out) {
  *out = nullptr;
  return guarded([&] {
    auto norms = at::_foreach_norm(list(tensors, n), 2);
    *out = new at::Tensor(at::linalg_vector_norm(at::stack(norms), 2));
  });
}

// Multiplies every tensor in place by the 0-dim `factor` (on their device).
char* vs_update_mul_(at::Tensor* const* tensors, size_t n, const at::Tensor* factor) {
  return guarded([&] { at::_foreach_mul_(list(tensors, n), *factor); });
}

// Zeroes every tensor in place.
char* vs_update_zero_(at::Tensor* const* tensors, size_t n) {
  return guarded([&] { at::_foreach_zero_(list(tensors, n)); });
}

// AdamW by libtorch's fused kernel over `n` parameters with their gradients and
// moments; `step` is the 0-dim float step count (already advanced for this update)
// every parameter's bias correction reads, on their device; when `found_inf` (0-dim
// float, 1 or 0) is not NULL and is 1 the kernel changes nothing.
char* vs_update_adamw_fused(at::Tensor* const* params, at::Tensor* const* grads,
                            at::Tensor* const* exp_avgs, at::Tensor* const* exp_avg_sqs,
                            size_t n, const at::Tensor* step, double lr, double beta1,
                            double beta2, double weight_decay, double eps,
                            const at::Tensor* found_inf) {
  return guarded([&] {
    std::vector<at::Tensor> steps(n, *step);
    std::optional<at::Tensor> inf;
    if (found_inf != nullptr) {
      inf = *found_inf;
    }
    at::_fused_adamw_(list(params, n), list(grads, n), list(exp_avgs, n), list(exp_avg_sqs, n),
                      {}, steps, lr, beta1, beta2, weight_decay, eps, /*amsgrad=*/false,
                      /*maximize=*/false, /*grad_scale=*/std::nullopt, inf);
  });
}

// AdamW in PyTorch's multi-tensor form (torch.optim.AdamW(foreach=True)), with the
// bias corrections of step count `step` (>= 1) computed on the host.
char* vs_update_adamw_foreach(at::Tensor* const* params, at::Tensor* const* grads,
                              at::Tensor* const* exp_avgs, at::Tensor* const* exp_avg_sqs,
                              size_t n, double step, double lr, double beta1, double beta2,
                              double weight_decay, double eps) {
  return guarded([&] {
    auto p = list(params, n);
    auto g = list(grads, n);
    auto m = list(exp_avgs, n);
    auto v = list(exp_avg_sqs, n);
    if (weight_decay != 0.0) {
      at::_foreach_mul_(p, 1.0 - lr * weight_decay);
    }
    at::_foreach_lerp_(m, g, 1.0 - beta1);
    at::_foreach_mul_(v, beta2);
    at::_foreach_addcmul_(v, g, g, 1.0 - beta2);
    const double bias1 = 1.0 - std::pow(beta1, step);
    const double bias2 = 1.0 - std::pow(beta2, step);
    auto denom = at::_foreach_sqrt(v);
    at::_foreach_div_(denom, std::sqrt(bias2));
    at::_foreach_add_(denom, eps);
    at::_foreach_addcdiv_(p, m, denom, -lr / bias1);
  });
}

// The fp16 scaler's unscale: every gradient times `inv_scale` (0-dim float), and
// `found_inf` (0-dim float) set to 1 when any of them holds an inf or a NaN.
char* vs_update_unscale_(at::Tensor* const* grads, size_t n, at::Tensor* found_inf,
                         const at::Tensor* inv_scale) {
  return guarded(
      [&] { at::_amp_foreach_non_finite_check_and_unscale_(list(grads, n), *found_inf, *inv_scale); });
}

// The fp16 scaler's update on the device: `scale` backs off on `found_inf`, else
// grows after `interval` good steps counted in `tracker` (0-dim int).
char* vs_update_scale_(at::Tensor* scale, at::Tensor* tracker, const at::Tensor* found_inf,
                       double growth, double backoff, int64_t interval) {
  return guarded(
      [&] { at::_amp_update_scale_(*scale, *tracker, *found_inf, growth, backoff, interval); });
}

}  // extern "C"
