// What the CPU (src/ops/reformer_attention.cpp) and CUDA
// (src/ops/cuda/reformer_cuda.cpp) registrations of the Reformer operators
// share: the op names, the input checks and the top-level no-grad entry.
#pragma once

#include <torch/torch.h>

#include <cstdint>

namespace fastattn::ops::reformer {

constexpr const char* kHashOp = "fastattn::lsh_hash";
constexpr const char* kOp = "fastattn::reformer_attention";
// Bound on bucket values (the CPU counting sort keeps a table of this many).
constexpr int64_t kMaxBuckets = int64_t(1) << 24;

// lsh_hash's x (N, H, L, E) and rotations (R, E, B2): shapes, dtypes
// (check_float_dtype, one for both), one device.
void check_hash_inputs(const torch::Tensor& x, const torch::Tensor& rotations);

// Checks q, v, buckets, key_lengths and chunk_size; returns the bucket bound
// (max bucket + 1) for the counting sort.
int64_t check_inputs(const torch::Tensor& q, const torch::Tensor& v, const torch::Tensor& buckets,
                     const c10::optional<torch::Tensor>& key_lengths, int64_t chunk_size);

// The chunk the kernels use: chunk_size clamped to the sequence (one chunk
// of L positions already covers every chunk_size >= L, and the kernels'
// buffers are sized by the chunk).
inline int64_t effective_chunk(int64_t chunk_size, int64_t L) {
  return chunk_size < L ? chunk_size : (L > 1 ? L : 1);
}

// The backward's extra arguments: grad_out and out (N, H, L, M), stats (N, H, L, 2).
void check_backward_inputs(const torch::Tensor& grad_out, const torch::Tensor& q,
                           const torch::Tensor& v, const torch::Tensor& out,
                           const torch::Tensor& stats);

// fastattn::reformer_attention without autograd: resolves softmax_temp and
// calls reformer_attention_forward through the dispatcher (CPU and CUDA).
torch::Tensor reformer_attention_no_grad(const torch::Tensor& q, const torch::Tensor& v,
                                         const torch::Tensor& buckets,
                                         const c10::optional<torch::Tensor>& key_lengths,
                                         int64_t chunk_size, bool causal, bool mask_self,
                                         c10::optional<double> softmax_temp);

}  // namespace fastattn::ops::reformer
