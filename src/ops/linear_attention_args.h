// The arguments of the linear attention operators (causal_linear_product,
// elu_linear_attention, elu_feature_map), shared by their CPU entry points
// (src/ops/*.cpp) and CUDA ones (src/ops/cuda/*.cpp): the checks, so both
// say the same, and the kernels' argument structs prepared and filled in one
// place (T = float or double for the CPU kernels, void for the CUDA ones:
// kernels/common/kernel_args.h) (internal).
#pragma once

#include <torch/torch.h>

#include <cmath>

#include "ops/mask_util.h"
#include "kernels/causal_product/causal_product.h"
#include "kernels/feature_maps/elu_feature_map.h"
#include "kernels/linear_attention/elu_linear_attention.h"
#include "ops/op_util.h"

namespace fastattn::ops {

// q, k (N, H, L, F), v (N, H, L, M): check_qkv plus S == L.
inline void check_causal_product_inputs(const char* op, const torch::Tensor& q,
                                        const torch::Tensor& k, const torch::Tensor& v) {
  check_qkv(op, q, k, v);
  TORCH_CHECK(k.size(2) == q.size(2), op,
              ": k must have the length L of q (causal linear attention needs S == L), got q ",
              q.sizes(), " and k ", k.sizes());
}

// grad_out of the causal product: the output's shape (N, H, L, M).
inline void check_causal_product_grad(const char* op, const torch::Tensor& grad_out,
                                      const torch::Tensor& q, const torch::Tensor& v) {
  const std::vector<int64_t> out_shape{q.size(0), q.size(1), q.size(2), v.size(3)};
  TORCH_CHECK(grad_out.sizes() == c10::IntArrayRef(out_shape), op,
              ": grad_out must have the output's shape ", c10::IntArrayRef(out_shape), ", got ",
              grad_out.sizes());
}

// q (N, H, L, E), k (N, H, S, E), v (N, H, S, M), key_lengths (N,), S == L
// when causal, eps finite > 0.
inline void check_elu_linear_inputs(const char* op, const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v,
                                    const c10::optional<torch::Tensor>& key_lengths, bool causal,
                                    double eps) {
  check_qkv(op, q, k, v);
  check_masks(op, q, k.size(2), std::nullopt, to_std(key_lengths));
  TORCH_CHECK(!causal || k.size(2) == q.size(2), op,
              ": causal attention needs as many keys as queries (S == L), got q ", q.sizes(),
              " and k ", k.sizes());
  TORCH_CHECK(std::isfinite(eps) && eps > 0, op, ": eps must be a finite number > 0, got ", eps);
}

// The backward's grad_out and out (N, H, L, M) and den (N, H, L).
inline void check_elu_linear_grad(const char* op, const torch::Tensor& grad_out,
                                  const torch::Tensor& out, const torch::Tensor& den,
                                  const torch::Tensor& q, const torch::Tensor& v) {
  const std::vector<int64_t> out_shape{q.size(0), q.size(1), q.size(2), v.size(3)};
  TORCH_CHECK(grad_out.sizes() == c10::IntArrayRef(out_shape), op,
              ": grad_out must have the output's shape ", c10::IntArrayRef(out_shape), ", got ",
              grad_out.sizes());
  TORCH_CHECK(out.sizes() == c10::IntArrayRef(out_shape), op, ": out must have the output's shape ",
              c10::IntArrayRef(out_shape), ", got ", out.sizes());
  TORCH_CHECK(den.sizes() == c10::IntArrayRef(out_shape).slice(0, 3), op,
              ": den must have shape (N, H, L) = ", c10::IntArrayRef(out_shape).slice(0, 3),
              ", got ", den.sizes());
}

// The backward's optional key state from the forward: None or 0 elements
// (recompute it), else (N, H, E, M + 1) floating on q's device. True when
// there is one to use.
inline bool check_elu_linear_state(const char* op, const c10::optional<torch::Tensor>& state,
                                   const torch::Tensor& q, const torch::Tensor& v) {
  if (!state || !state->defined() || state->numel() == 0) return false;
  const std::vector<int64_t> shape{q.size(0), q.size(1), q.size(3), v.size(3) + 1};
  TORCH_CHECK(state->sizes() == c10::IntArrayRef(shape), op,
              ": state must be the forward's key state of shape (N, H, E, M + 1) = ",
              c10::IntArrayRef(shape), " or have 0 elements, got ", state->sizes());
  TORCH_CHECK(state->is_floating_point(), op, ": state must be a floating tensor, got ",
              state->scalar_type());
  TORCH_CHECK(state->device() == q.device(), op, ": state must be on q's device ", q.device(),
              ", got ", state->device());
  return true;
}

// x of elu_feature_map (named `name`): defined, a kernel dtype of its device.
inline void check_elu_feature_map_input(const char* op, const char* name, const torch::Tensor& x) {
  TORCH_CHECK(x.defined(), op, ": ", name, " must be a defined tensor");
  check_float_dtype(op, name, x);
}

// ---- kernel arguments ------------------------------------------------------

// causal_linear_product's forward and backward structs from its inputs (as
// the kernels read them: contiguous).
template <typename T>
void fill_causal_product_args(kernels::CausalProductParams<T>& a, const char* op,
                              const torch::Tensor& q, const torch::Tensor& k,
                              const torch::Tensor& v, int64_t chunk) {
  a.q = kernel_data<T>(q);
  a.k = kernel_data<T>(k);
  a.v = kernel_data<T>(v);
  a.N = q.size(0);
  a.H = q.size(1);
  a.L = q.size(2);
  a.F = q.size(3);
  a.M = v.size(3);
  a.chunk = chunk;
  if constexpr (std::is_void_v<T>) {
    a.dtype = kernel_dtype(op, "q", q);
  } else {
    a.num_threads = at::get_num_threads();
  }
}

// elu_feature_map's struct: x, grad_out (backward; undefined: forward) and
// out, all contiguous and of one dtype.
template <typename T>
void fill_elu_feature_map_args(kernels::EluFeatureMapArgs<T>& a, const char* op,
                               const torch::Tensor& x, const torch::Tensor& grad_out,
                               const torch::Tensor& out) {
  a.x = kernel_data<T>(x);
  if (grad_out.defined()) a.grad_out = kernel_data<T>(grad_out);
  a.out = kernel_data<T>(out);
  a.n = x.numel();
  if constexpr (std::is_void_v<T>) {
    a.dtype = kernel_dtype(op, "x", x);
  } else {
    a.num_threads = at::get_num_threads();
  }
}

// elu_linear_attention's arguments common to its forward and backward kernels.
template <typename T>
void fill_elu_linear_args(kernels::EluLinearParams<T>& a, const char* op, const QKVInputs& p,
                          bool causal, double eps, int64_t chunk) {
  set_qkv_args(a, op, p);
  a.causal = causal;
  a.eps = static_cast<kernels::KernelScalar<T>>(eps);
  a.chunk = chunk;
}

}  // namespace fastattn::ops
