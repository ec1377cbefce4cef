// Entry points of the fused full-attention kernels for other operators of
// the library (not part of the public API).
#pragma once

#include <torch/torch.h>

#include <optional>

namespace fastattn::ops {

// The backward of full_attention_lse_topk (key lengths only, not causal),
// added into grad_q, grad_k, grad_v (contiguous, q's dtype and shapes):
// gradients of the loss with respect to out (grad_out) and lse (grad_lse).
void full_attention_backward_accumulate(const torch::Tensor& grad_out,
                                        const torch::Tensor& grad_lse, const torch::Tensor& q,
                                        const torch::Tensor& k, const torch::Tensor& v,
                                        const torch::Tensor& out, const torch::Tensor& lse,
                                        const std::optional<torch::Tensor>& key_lengths,
                                        double softmax_temp, torch::Tensor& grad_q,
                                        torch::Tensor& grad_k, torch::Tensor& grad_v);

}  // namespace fastattn::ops
