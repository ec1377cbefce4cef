// Input checks of the hard_retrieval_attention operator, shared by its CPU and
// CUDA registrations (internal).
#pragma once

#include <torch/torch.h>

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

}  // namespace fastattn::ops
