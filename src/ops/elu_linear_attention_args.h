// The kernel arguments of elu_linear_attention, prepared and filled in one
// place for its CPU op (src/ops/elu_linear_attention.cpp, T = float or
// double) and its CUDA op (src/ops/cuda/linear_attention_cuda.cpp, T = void):
// kernels/linear_attention/elu_linear_attention.h (internal).
#pragma once

#include <torch/torch.h>

#include "kernels/linear_attention/elu_linear_attention.h"
#include "ops/linear_attention_checks.h"
#include "ops/op_util.h"

namespace fastattn::ops {

// q, k, v as the kernels read them (the CPU ones any row layout, the CUDA
// ones contiguous) and key_lengths as int64 on q's device.
struct EluLinearInputs {
  torch::Tensor q, k, v, lengths;
};

inline EluLinearInputs prepare_elu_linear(const torch::Tensor& q, const torch::Tensor& k,
                                          const torch::Tensor& v,
                                          const c10::optional<torch::Tensor>& key_lengths) {
  auto layout = [&](const torch::Tensor& t) {
    return q.is_cuda() ? t.contiguous() : rows_contiguous(t);
  };
  EluLinearInputs p{layout(q), layout(k), layout(v), {}};
  if (key_lengths) p.lengths = key_lengths->to(q.device(), torch::kLong).contiguous();
  return p;
}

// The arguments common to the forward and backward kernels.
template <typename T, typename Args>
void fill_elu_linear_args(Args& a, const char* op, const EluLinearInputs& p, bool causal,
                          double eps, int64_t chunk) {
  set_qkv_args<T>(a, op, p.q, p.k, p.v);
  if (p.lengths.defined()) a.key_lengths = p.lengths.data_ptr<int64_t>();
  a.causal = causal;
  a.eps = static_cast<kernels::KernelScalar<T>>(eps);
  a.chunk = chunk;
}

}  // namespace fastattn::ops
