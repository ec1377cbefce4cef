// Causal linear product on the CPU (Katharopoulos et al. 2020, eq. 9 without
// the normaliser): out_i = sum_{j<=i} (q_i·k_j) v_j for q, k feature-mapped.
//
// Chunked: within a chunk of C rows a masked (Q K^T) V product, across chunks a
// carried F×M state S = sum of k_j v_j^T over the earlier chunks. The backward
// is the same idea run twice: dQ from dO and the prefix states (forward in L),
// dK and dV from a reversed pass that carries the suffix state sum q_i dO_i^T.
// Never an L×F×M tensor: extra memory is, per thread, one F×M state (two in
// the backward), C×C and C×(F+M) tiles.
//
// Cost: forward 2·N·H·L·(C·(F+M) + 2·F·M) flops, backward
// 2·N·H·L·(3·C·(F+M) + 5·F·M) (the C×C products are computed whole and
// masked; 2.75× the forward at C = F = M = 64): linear in L.
// Tested by tests/cpp/test_linear_attention.cpp; timed by
// bench/bench_linear_attention.cpp.
#pragma once

#include <cstdint>

#include "kernels/common/kernel_args.h"

namespace fastattn::kernels {

// The arguments of both backends (kernels/common/kernel_args.h): T = float or
// double for the CPU kernels below, void for the CUDA launchers
// (causal_product_cuda.h).
template <typename T>
struct CausalProductParams {
  const T* q = nullptr;  // (N, H, L, F) contiguous
  const T* k = nullptr;  // (N, H, L, F) contiguous
  const T* v = nullptr;  // (N, H, L, M) contiguous
  int64_t N = 0, H = 0, L = 0, F = 0, M = 0;
  int64_t chunk = 64;             // rows per chunk C (>= 1; CUDA: 16, 32 or 64); any L
  int num_threads = 1;            // CPU
  DType dtype = DType::kFloat32;  // CUDA: the element type of the void pointers
  float* workspace = nullptr;     // CUDA: causal_product_cuda_workspace_floats(...) floats
};

template <typename T>
struct CausalProductForwardArgs : CausalProductParams<T> {
  T* out = nullptr;  // (N, H, L, M), written
};

template <typename T>
struct CausalProductBackwardArgs : CausalProductParams<T> {
  const T* grad_out = nullptr;  // (N, H, L, M) contiguous
  T* grad_q = nullptr;          // (N, H, L, F), written
  T* grad_k = nullptr;          // (N, H, L, F), written
  T* grad_v = nullptr;          // (N, H, L, M), written
};

template <typename T>
void causal_product_forward_cpu(const CausalProductForwardArgs<T>& args);
template <typename T>
void causal_product_backward_cpu(const CausalProductBackwardArgs<T>& args);

}  // namespace fastattn::kernels
