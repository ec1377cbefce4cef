// Input checks of gather_tokens, shared by its CPU (src/ops/token_gather.cpp)
// and CUDA (src/ops/cuda/token_gather_cuda.cpp) registrations (internal).
#pragma once

#include <torch/torch.h>

namespace fastattn::ops {

constexpr const char* kGatherTokensOp = "fastattn::gather_tokens";

// index (N, T) int64 with values in [-1, L).
void check_gather_index(const torch::Tensor& index, int64_t N, int64_t L);
// `name` (N, H, L, E) of a supported floating dtype (check_float_dtype).
void check_gather_x(const char* name, const torch::Tensor& x);

}  // namespace fastattn::ops
