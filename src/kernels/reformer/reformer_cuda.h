// CUDA kernels of Reformer LSH attention (see reformer_cuda_common.cuh,
// reformer_forward_cuda.cu and reformer_backward_cuda.cu and, for the
// semantics they reproduce, reformer.h). Data pointers are device pointers
// (host pointers under the emulator), type-erased: their element type is
// `dtype` where a comment says T.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/reformer/reformer.h"

namespace fastattn::cuda {

// The arguments shared with the CPU kernels (reformer.h), T = void.
using LshHashCudaArgs = kernels::LshHashArgs<void>;
using ReformerCudaParams = kernels::ReformerParams<void>;
using ReformerForwardCudaArgs = kernels::ReformerForwardArgs<void>;
using ReformerBackwardCudaArgs = kernels::ReformerBackwardArgs<void>;

// Buckets as lsh_hash_cpu: argmax over [x·R_r ; -x·R_r], the first maximum
// (projections accumulated in float32).
void lsh_hash_cuda(const LshHashCudaArgs& a, cudaStream_t stream);

// Largest head dimensions E and M the attention kernels take (shared-memory tiles).
constexpr int64_t kReformerCudaMaxHeadDim = 256;

// Forward: zero/-inf initialisation, one launch per round (each query is in
// one chunk per round: the rounds merge into the running output and stats as
// on the CPU), then the normalisation.
void reformer_forward_cuda(const ReformerForwardCudaArgs& a, cudaStream_t stream);
// Backward: every (round, chunk, query tile) at once, float atomics into the
// workspace, then the key normalisation's gradient and the conversion.
void reformer_backward_cuda(const ReformerBackwardCudaArgs& a, cudaStream_t stream);

}  // namespace fastattn::cuda
