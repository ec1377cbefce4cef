// Pattern and input checks shared by the block_sparse_attention operator
// (CPU and CUDA registrations) and its reference, and its no-grad composite
// (internal).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fastattn::ops {

// Validates a block-sparse pattern ("local" {window}, "strided" {stride,
// which}, "fixed" {stride, summary, which, per_head_summary}) for H heads;
// throws naming the parameter. Returns the kernels::SparsePattern.
int check_sparse_pattern(const char* op, const std::string& pattern,
                         const std::vector<int64_t>& params, int64_t H);

// The operator's input checks: q, k, v (check_qkv), key_lengths
// (check_masks) and the pattern. Returns the kernels::SparsePattern.
int check_block_sparse_inputs(const char* op, const torch::Tensor& q, const torch::Tensor& k,
                              const torch::Tensor& v, const std::string& pattern,
                              const std::vector<int64_t>& params,
                              const c10::optional<torch::Tensor>& key_lengths);

// The backward's extra checks: grad_out shaped like out, lse (N, H, L).
void check_block_sparse_backward(const char* op, const torch::Tensor& grad_out,
                                 const torch::Tensor& out, const torch::Tensor& lse);

}  // namespace fastattn::ops
