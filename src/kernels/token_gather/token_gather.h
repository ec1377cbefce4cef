// Token gather and its adjoint, the sort/unsort step of ClusterFormer
// (src/attention/clusterformer.cpp): every (n, h) slice of x takes its rows in
// the order of a per-batch index shared by all heads.
//   forward:  out[n, h, t, :] = x[n, h, index[n, t], :]   (zeros where index = -1)
//   backward: grad_x[n, h, l, :] = sum_{t: index[n, t] = l} grad_out[n, h, t, :]
// The backward is a scatter-add, so an index may repeat a token (ClusterFormer's
// key blocks hold every token twice). O(N·H·T·E) time, no extra memory; work
// items are the (n, h) slices, so the scatter-add never races.
// Tested by tests/cpp/test_clusterformer.cpp.
#pragma once

#include <cstdint>

#include "kernels/common/kernel_args.h"

namespace fastattn::kernels {

// The arguments of both backends (kernels/common/kernel_args.h): T = float or
// double for the CPU kernels below, void for the CUDA launchers
// (token_gather_cuda.h).
template <typename T>
struct TokenGatherArgs {
  const T* x = nullptr;            // forward: (N, H, L, E) contiguous
  const T* grad_out = nullptr;     // backward: (N, H, T, E) contiguous
  const int64_t* index = nullptr;  // (N, T) contiguous, each in [-1, L)
  // Forward: (N, H, T, E), written. CPU backward: grad_x (N, H, L, E), written.
  T* out = nullptr;
  // CUDA backward: grad_x (N, H, L, E) float32, zeroed by the caller; the
  // rows of grad_out are added into it (atomicAdd: an index may repeat a token).
  float* grad_x = nullptr;
  int64_t N = 0, H = 0, L = 0, T_ = 0, E = 0;  // T_: gathered rows per (n, h)
  int num_threads = 1;                         // CPU
  DType dtype = DType::kFloat32;               // CUDA: the element type of the void pointers
};

template <typename T>
void token_gather_forward_cpu(const TokenGatherArgs<T>& args);
template <typename T>
void token_gather_backward_cpu(const TokenGatherArgs<T>& args);

}  // namespace fastattn::kernels
