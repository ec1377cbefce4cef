// CUDA kernels of hard retrieval attention (see hard_retrieval_cuda.cu and,
// for the semantics, hard_retrieval.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/cuda_dtype.h"

namespace fastattn::kernels {

// Largest head dims E and M the kernels take.
constexpr int64_t kHardRetrievalCudaMaxDim = 256;

struct HardRetrievalCudaParams {
  cuda::DType dtype = cuda::DType::kFloat32;  // of q, k, v, out, grad_out
  const void* q = nullptr;                    // (N, H, L, E) contiguous
  const void* k = nullptr;                    // (N, H, S, E) contiguous
  const void* v = nullptr;                    // (N, H, S, M) contiguous
  // Bool keep mask or nullptr: element (n, h, i, j) at
  // keep[n·keep_sn + h·keep_sh + i·keep_sl + j] (stride 0 on broadcast dims).
  const bool* keep = nullptr;
  int64_t keep_sn = 0, keep_sh = 0, keep_sl = 0;
  const int64_t* key_lengths = nullptr;              // (N,) in [0, S], or nullptr for S
  int64_t N = 0, H = 0, L = 0, S = 0, E = 0, M = 0;  // E, M <= kHardRetrievalCudaMaxDim
  bool causal = false;                               // query i keeps key j iff j <= i + (S - L)
  float scale = 1.f;                                 // softmax temperature (sample mode and lse)
};

struct HardRetrievalForwardCudaArgs : HardRetrievalCudaParams {
  bool sample = false;       // true: sample from the softmax; false: argmax of the raw scores
  uint64_t seed = 0;         // sample mode: the draws are a pure function of (seed, n, h, i)
  void* out = nullptr;       // (N, H, L, M) dtype: the retrieved value rows (zeros if none)
  int64_t* index = nullptr;  // (N, H, L): the retrieved key, -1 when none is kept
  float* lse = nullptr;      // (N, H, L) float32 or nullptr: log-sum-exp of the kept scaled
                             // scores, -inf if none
};

// Straight-through backward: dQ, dK of soft attention P V (P from the saved
// lse) for the same grad_out, and dV = the index-add of grad_out rows.
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

}  // namespace fastattn::kernels
