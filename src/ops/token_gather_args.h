// The arguments of gather_tokens, shared by its CPU (src/ops/token_gather.cpp)
// and CUDA (src/ops/cuda/token_gather_cuda.cpp) registrations: input checks
// and the kernels' struct (kernels/common/kernel_args.h) (internal).
#pragma once

#include <torch/torch.h>

#include "kernels/token_gather/token_gather.h"
#include "ops/op_util.h"

namespace fastattn::ops {

inline constexpr char kGatherTokensOp[] = "fastattn::gather_tokens";

// index (N, T) int64 with values in [-1, L).
void check_gather_index(const torch::Tensor& index, int64_t N, int64_t L);
// `name` (N, H, L, E) of a supported floating dtype (check_float_dtype).
void check_gather_x(const char* name, const torch::Tensor& x);

// The struct's sizes, index and backend fields for rows (N, H, rows, E) (x
// forward, grad_out backward, contiguous; its dtype `name`d in errors),
// index (N, T) int64 contiguous on rows' device and L tokens per sequence.
template <typename T>
void fill_token_gather_args(kernels::TokenGatherArgs<T>& a, const char* name,
                            const torch::Tensor& rows, const torch::Tensor& index, int64_t L) {
  a.index = index.data_ptr<int64_t>();
  a.N = rows.size(0);
  a.H = rows.size(1);
  a.L = L;
  a.T_ = index.size(1);
  a.E = rows.size(3);
  if constexpr (std::is_void_v<T>) {
    a.dtype = kernel_dtype(kGatherTokensOp, name, rows);
  } else {
    a.num_threads = at::get_num_threads();
  }
}

}  // namespace fastattn::ops
