// Argument checks of the linear attention operators (causal_linear_product,
// elu_linear_attention, elu_feature_map), shared by their CPU entry points
// (src/ops/*.cpp) and CUDA ones (src/ops/cuda/*.cpp) so both say the same
// (internal).
#pragma once

#include <torch/torch.h>

#include <cmath>

#include "ops/mask_util.h"
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

// x of elu_feature_map (named `name`): defined, a kernel dtype of its device.
inline void check_elu_feature_map_input(const char* op, const char* name, const torch::Tensor& x) {
  TORCH_CHECK(x.defined(), op, ": ", name, " must be a defined tensor");
  check_float_dtype(op, name, x);
}

}  // namespace fastattn::ops
