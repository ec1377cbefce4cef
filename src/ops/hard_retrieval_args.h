// The arguments of the hard_retrieval_attention operator, shared by its CPU
// (src/ops/hard_retrieval_attention.cpp) and CUDA
// (src/ops/cuda/hard_retrieval_cuda.cpp) registrations: input checks and the
// kernels' structs (kernels/common/kernel_args.h) (internal).
#pragma once

#include <torch/torch.h>

#include "kernels/hard_retrieval/hard_retrieval.h"
#include "ops/mask_util.h"
#include "ops/op_util.h"

namespace fastattn::ops {

// q, k, v (check_qkv), attn_mask (a bool keep mask) and key_lengths.
void check_hard_retrieval_inputs(const char* op, const torch::Tensor& q, const torch::Tensor& k,
                                 const torch::Tensor& v,
                                 const c10::optional<torch::Tensor>& attn_mask,
                                 const c10::optional<torch::Tensor>& key_lengths);

// The backward's extra checks: grad_out (N, H, L, M), index int64 (N, H, L)
// in [-1, S), lse (N, H, L) and soft_out (N, H, L, M) or empty, both of
// dtype stats_dtype(q) (op_util.h).
void check_hard_retrieval_backward(const char* op, const torch::Tensor& grad_out,
                                   const torch::Tensor& q, const torch::Tensor& k,
                                   const torch::Tensor& v, const torch::Tensor& index,
                                   const torch::Tensor& lse, const torch::Tensor& soft_out);

// q, k, v and key_lengths as the kernels read them (qkv_inputs), the keep
// mask as a bool (N, H, L, S) view.
struct HardRetrievalInputs : QKVInputs {
  torch::Tensor keep;
};

inline HardRetrievalInputs prepare_hard_retrieval(const torch::Tensor& q, const torch::Tensor& k,
                                                  const torch::Tensor& v,
                                                  const c10::optional<torch::Tensor>& attn_mask,
                                                  const c10::optional<torch::Tensor>& key_lengths) {
  HardRetrievalInputs p{qkv_inputs(q, k, v, key_lengths), {}};
  if (attn_mask) {
    p.keep = broadcast_mask(attn_mask->contiguous(), q.size(0), q.size(1), q.size(2), k.size(2));
  }
  return p;
}

// The arguments every hard_retrieval kernel takes.
template <typename T>
void fill_hard_retrieval_args(kernels::HardRetrievalParams<T>& a, const char* op,
                              const HardRetrievalInputs& p, bool causal, double temp) {
  set_qkv_args(a, op, p);
  if (p.keep.defined()) {
    a.keep = p.keep.data_ptr<bool>();
    a.keep_sn = p.keep.stride(0);
    a.keep_sh = p.keep.stride(1);
    a.keep_sl = p.keep.stride(2);
  }
  a.causal = causal;
  a.scale = static_cast<kernels::KernelScalar<T>>(temp);
}

}  // namespace fastattn::ops
