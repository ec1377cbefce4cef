// What the CPU (src/ops/reformer_attention.cpp) and CUDA
// (src/ops/cuda/reformer_cuda.cpp) registrations of the Reformer operators
// share: the op names, the input checks, the kernels' structs filled
// (kernels/common/kernel_args.h) and the top-level no-grad entry.
#pragma once

#include <torch/torch.h>

#include <cstdint>

#include "kernels/reformer/reformer.h"
#include "ops/op_util.h"

namespace fastattn::ops::reformer {

inline constexpr char kHashOp[] = "fastattn::lsh_hash";
inline constexpr char kOp[] = "fastattn::reformer_attention";
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

// lsh_hash's struct from x (N, H, L, E) as the kernels read it (CPU: any row
// layout; CUDA: contiguous), rotations (R, E, B2) contiguous and the
// buckets (N, H, R, L) to write.
template <typename T>
void fill_lsh_hash_args(kernels::LshHashArgs<T>& a, const torch::Tensor& x,
                        const torch::Tensor& rotations, torch::Tensor& buckets) {
  a.x = kernel_data<T>(x);
  a.rotations = kernel_data<T>(rotations);
  a.buckets = buckets.data_ptr<int64_t>();
  a.N = x.size(0);
  a.H = x.size(1);
  a.L = x.size(2);
  a.E = x.size(3);
  a.R = rotations.size(0);
  a.B2 = rotations.size(2);
  if constexpr (std::is_void_v<T>) {
    a.dtype = kernel_dtype(kHashOp, "x", x);
  } else {
    a.x_rows = row_strides(x);
    a.num_threads = at::get_num_threads();
  }
}

// The attention kernels' common struct from q, v as they read them, the
// lengths (int64 on q's device; undefined: none), R rounds and the
// settings; the caller sets the buckets (CPU) or their order (CUDA).
template <typename T>
void fill_reformer_args(kernels::ReformerParams<T>& a, const torch::Tensor& q,
                        const torch::Tensor& v, const torch::Tensor& lengths, int64_t R,
                        int64_t chunk_size, bool causal, bool mask_self, double temp) {
  a.q = kernel_data<T>(q);
  a.v = kernel_data<T>(v);
  a.lengths = lengths.defined() ? lengths.data_ptr<int64_t>() : nullptr;
  a.N = q.size(0);
  a.H = q.size(1);
  a.L = q.size(2);
  a.E = q.size(3);
  a.M = v.size(3);
  a.R = R;
  a.chunk = effective_chunk(chunk_size, q.size(2));
  a.causal = causal;
  a.mask_self = mask_self;
  a.scale = static_cast<kernels::KernelScalar<T>>(temp);
  if constexpr (std::is_void_v<T>) {
    a.dtype = kernel_dtype(kOp, "q", q);
  } else {
    a.q_rows = row_strides(q);
    a.v_rows = row_strides(v);
    a.num_threads = at::get_num_threads();
  }
}

}  // namespace fastattn::ops::reformer
