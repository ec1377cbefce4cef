// CUDA kernels of hard retrieval attention (see hard_retrieval_cuda.cu and,
// for the semantics, hard_retrieval.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/hard_retrieval/hard_retrieval.h"

namespace fastattn::cuda {

// Largest head dims E and M the kernels take.
constexpr int64_t kHardRetrievalCudaMaxDim = 256;

// The arguments shared with the CPU kernels (hard_retrieval.h), T = void:
// q, k, v, out, grad_out contiguous of `dtype` (E, M <=
// kHardRetrievalCudaMaxDim); lse float32.
using HardRetrievalCudaParams = kernels::HardRetrievalParams<void>;
using HardRetrievalForwardCudaArgs = kernels::HardRetrievalForwardArgs<void>;

// The CUDA backward (straight-through: dQ and dK of the soft attention, dV by
// an index-add), which the CPU op composes from other kernels.
struct HardRetrievalBackwardCudaArgs : HardRetrievalCudaParams {
  const void* grad_out = nullptr;  // (N, H, L, M) dtype, contiguous
  const int64_t* index = nullptr;  // (N, H, L) from the forward, -1: none
  const float* lse = nullptr;      // (N, H, L) from the forward
  // Workspaces (float32): the soft output P V (N, H, L, M), its lse (N, H, L)
  // and delta = rowsum(grad_out ∘ P V) (N, H, L).
  float* ws_out = nullptr;
  float* ws_lse = nullptr;
  float* ws_delta = nullptr;
  // float32, zero-initialised by the caller; the kernels add into them.
  float* grad_q = nullptr;  // (N, H, L, E)
  float* grad_k = nullptr;  // (N, H, S, E)
  float* grad_v = nullptr;  // (N, H, S, M)
};

void hard_retrieval_forward_cuda(const HardRetrievalForwardCudaArgs& a, cudaStream_t stream);
void hard_retrieval_backward_cuda(const HardRetrievalBackwardCudaArgs& a, cudaStream_t stream);

}  // namespace fastattn::cuda
