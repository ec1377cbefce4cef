// CUDA kernels of Reformer LSH attention (see reformer_cuda.cu and, for the
// semantics they reproduce, reformer.h). Data pointers are device pointers
// (host pointers under the emulator), type-erased: their element type is
// `dtype` where a comment says T.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/cuda_dtype.h"

namespace fastattn::kernels {

struct LshHashCudaArgs {
  const void* x = nullptr;          // (N, H, L, E) contiguous, T
  const void* rotations = nullptr;  // (R, E, B2) contiguous, T
  int64_t* buckets = nullptr;       // (N, H, R, L), written: values in [0, max(1, 2·B2))
  int64_t N = 0, H = 0, L = 0, E = 0, R = 0, B2 = 0;
  fastattn::cuda::DType dtype = fastattn::cuda::DType::kFloat32;
};

// Buckets as lsh_hash_cpu: argmax over [x·R_r ; -x·R_r], the first maximum
// (projections accumulated in float32).
void lsh_hash_cuda(const LshHashCudaArgs& a, cudaStream_t stream);

struct ReformerCudaParams {
  const void* q = nullptr;           // (N, H, L, E) contiguous, T: queries and (normalised) keys
  const void* v = nullptr;           // (N, H, L, M) contiguous, T
  const int64_t* perm = nullptr;     // (N, H, R, L): per round, the valid positions [0, len) sorted
                                     // by (bucket, position) in entries [0, len); the rest unused
  const int64_t* lengths = nullptr;  // (N,) in [0, L], or nullptr for L
  int64_t N = 0, H = 0, L = 0, E = 0, M = 0, R = 0;
  int64_t chunk = 32;     // chunk size in sorted positions, >= 1
  bool causal = false;    // drop keys j > i
  bool mask_self = true;  // self score -> -1e5
  float scale = 1.f;      // softmax temperature
  fastattn::cuda::DType dtype = fastattn::cuda::DType::kFloat32;
};

struct ReformerForwardCudaArgs : ReformerCudaParams {
  void* out = nullptr;         // (N, H, L, M), T, written (0 at padded positions)
  double* stats = nullptr;     // (N, H, L, 2), written: [max score, log sum exp(score - max)]
                               // over rounds and keys ([-inf, 0] at padding), as the CPU op
  float* workspace = nullptr;  // N·H·L·M floats (the running unnormalised output)
};

struct ReformerBackwardCudaArgs : ReformerCudaParams {
  const void* grad_out = nullptr;  // (N, H, L, M) contiguous, T
  const double* stats = nullptr;   // (N, H, L, 2) from the forward
  const float* delta = nullptr;    // (N, H, L): rowsum(grad_out ∘ out), in float32
  void* grad_q = nullptr;          // (N, H, L, E), T, written (both roles of q)
  void* grad_v = nullptr;          // (N, H, L, M), T, written
  float* workspace = nullptr;      // N·H·L·(2·E + M) floats (dq, dk, dv accumulators)
};

// Largest head dimensions E and M the attention kernels take (shared-memory tiles).
constexpr int64_t kReformerCudaMaxHeadDim = 256;

// Forward: zero/-inf initialisation, one launch per round (each query is in
// one chunk per round: the rounds merge into the running output and stats as
// on the CPU), then the normalisation.
void reformer_forward_cuda(const ReformerForwardCudaArgs& a, cudaStream_t stream);
// Backward: every (round, chunk, query tile) at once, float atomics into the
// workspace, then the key normalisation's gradient and the conversion.
void reformer_backward_cuda(const ReformerBackwardCudaArgs& a, cudaStream_t stream);

}  // namespace fastattn::kernels
