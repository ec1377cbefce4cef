// Entry points of the fused full-attention kernels for other operators of
// the library, and the argument checks and composite entries shared by the
// CPU (full_attention.cpp) and CUDA (cuda/full_attention_cuda.cpp)
// registrations (not part of the public API).
#pragma once

#include <torch/torch.h>

#include <optional>
#include <tuple>

#include "kernels/full/full_attention.h"
#include "ops/op_util.h"

namespace fastattn::ops {

// The backward of full_attention_lse_topk (key lengths only, not causal),
// added into grad_q, grad_k, grad_v (q's dtype and shapes; any row layout on
// the CPU, contiguous on CUDA):
// gradients of the loss with respect to out (grad_out) and lse (grad_lse).
// CPU or CUDA tensors; dropout_p, dropout_seed: the forward's attention
// dropout (CPU).
void full_attention_backward_accumulate(const torch::Tensor& grad_out,
                                        const torch::Tensor& grad_lse, const torch::Tensor& q,
                                        const torch::Tensor& k, const torch::Tensor& v,
                                        const torch::Tensor& out, const torch::Tensor& lse,
                                        const std::optional<torch::Tensor>& key_lengths,
                                        double softmax_temp, torch::Tensor& grad_q,
                                        torch::Tensor& grad_k, torch::Tensor& grad_v,
                                        double dropout_p = 0.0, int64_t dropout_seed = 0);

// full_attention_lse_topk's forward on the CPU (out, lse, top_idx), with
// attention dropout on out's weights (lse and the top-k from the undropped
// scores).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> full_attention_lse_topk_cpu(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
    const c10::optional<torch::Tensor>& key_lengths, double softmax_temp, int64_t topk,
    double dropout_p, int64_t dropout_seed);

#ifdef FASTATTN_WITH_CUDA
// Its CUDA implementation (cuda/full_attention_cuda.cpp).
void full_attention_backward_accumulate_cuda(const torch::Tensor& grad_out,
                                             const torch::Tensor& grad_lse, const torch::Tensor& q,
                                             const torch::Tensor& k, const torch::Tensor& v,
                                             const torch::Tensor& out, const torch::Tensor& lse,
                                             const std::optional<torch::Tensor>& key_lengths,
                                             double softmax_temp, torch::Tensor& grad_q,
                                             torch::Tensor& grad_k, torch::Tensor& grad_v);
#endif

// fastattn::full_attention's argument checks: q, k, v, attn_mask, key_lengths.
void check_full_attention_inputs(const torch::Tensor& q, const torch::Tensor& k,
                                 const torch::Tensor& v,
                                 const c10::optional<torch::Tensor>& attn_mask,
                                 const c10::optional<torch::Tensor>& key_lengths);
// full_attention_backward's: grad_out like out, grad_lse (if any) like lse.
void check_full_attention_grads(const torch::Tensor& grad_out, const torch::Tensor& out,
                                const torch::Tensor& lse,
                                const c10::optional<torch::Tensor>& grad_lse);
// full_attention_lse_topk's: q, k, v, key_lengths, topk in [0, S].
void check_lse_topk_inputs(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                           const c10::optional<torch::Tensor>& key_lengths, int64_t topk);

// The column indices of the k largest entries of each row of scores
// (..., S), k in [1, S], ordered as the first k of a stable descending sort
// (ties: lower index first; -inf entries are ordinary values), with no host
// synchronisation. The selected columns are all above the k-th largest value
// t and the lowest-index ones equal to t: on the CPU (any device) with ATen
// (t from topk, the columns by binary search of their running count), on
// CUDA by one kernel (radix select of t, ordered compaction); then the k are
// sorted.
torch::Tensor stable_topk_indices(const torch::Tensor& scores, int64_t k);

#ifdef FASTATTN_WITH_CUDA
// Its selection on CUDA (cuda/full_attention_cuda.cpp, the kernel of
// src/kernels/clustered_topk/stable_topk_cuda.cu): the k columns of each row
// of float32 scores (..., S) in increasing column order, int64.
torch::Tensor stable_topk_select_cuda(const torch::Tensor& scores, int64_t k);
#endif

// Full attention computed from the materialised float32 scores (N, H, L, S)
// with ATen (any device): out in q's dtype, lse float32 (-inf and zero
// output for rows without a kept key), the top-k indices (int64, topk in
// [0, S]; not causal then). Key lengths and the causal mask (offset S - L)
// only. The CUDA ops use it where the fused kernel would run too few blocks
// (N·H·ceil(L/64) below the SM count: the centroids of clustering, decoding
// one token), and for full_attention_lse_topk, whose top-k needs the scores
// anyway.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> full_attention_dense(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
    const c10::optional<torch::Tensor>& key_lengths, bool causal, double softmax_temp,
    int64_t topk);

// ---- kernel arguments (kernels/common/kernel_args.h), CPU and CUDA ------------

// q, k, v and key_lengths as the kernels read them (qkv_inputs), the mask
// additive in q's dtype and viewed (N, H, L, S).
struct FullAttentionInputs : QKVInputs {
  torch::Tensor mask;
};
FullAttentionInputs full_attention_inputs(const torch::Tensor& q, const torch::Tensor& k,
                                          const torch::Tensor& v,
                                          const c10::optional<torch::Tensor>& attn_mask,
                                          const c10::optional<torch::Tensor>& key_lengths);

// The arguments every full attention kernel takes.
template <typename T>
void fill_full_attention_args(kernels::FullAttentionParams<T>& a, const char* op,
                              const FullAttentionInputs& p, bool causal, double temp) {
  set_qkv_args(a, op, p);
  if (p.mask.defined()) {
    a.mask = kernel_data<T>(p.mask);
    a.mask_sn = p.mask.stride(0);
    a.mask_sh = p.mask.stride(1);
    a.mask_sl = p.mask.stride(2);
  }
  a.causal = causal;
  a.scale = static_cast<kernels::KernelScalar<T>>(temp);
}

}  // namespace fastattn::ops
