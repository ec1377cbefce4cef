// Fused softmax attention on the CPU: FlashAttention-style tiling with an
// online softmax (forward) and per-tile recomputation from the saved row
// log-sum-exp (backward). Never materialises the L×S matrix: extra memory is
// per-thread tiles (each key tile is packed where it is used), plus per-split
// dQ copies in backward when there are fewer heads than threads.
//
// Cost: forward 4·N·H·L·S·E flops (E = M), backward 2.5× that.
// Tested by tests/cpp/test_full_attention.cpp; timed by bench/bench_full_attention.cpp.
#pragma once

#include <cstdint>

#include "kernels/common/kernel_args.h"

namespace fastattn::kernels {

// Queries per forward tile: each tile reads all of K and V.
inline constexpr int64_t kFullForwardQueryTile = 192;

// The arguments of both backends (kernels/common/kernel_args.h): T = float or
// double for the CPU kernels below, void for the CUDA launchers
// (full_attention_cuda.h: contiguous operands, E and M <=
// kFullAttentionCudaMaxHeadDim, float32 lse and delta).
template <typename T>
struct FullAttentionParams : QKVParams<T> {
  // Additive mask or nullptr: element (n, h, l, s) at
  // mask[n·mask_sn + h·mask_sh + l·mask_sl + s] (stride 0 on broadcast dims).
  const T* mask = nullptr;
  int64_t mask_sn = 0, mask_sh = 0, mask_sl = 0;
  bool causal = false;        // query i sees key j iff j <= i + (S - L)
  KernelScalar<T> scale = 1;  // softmax temperature applied to q·k
  // Attention dropout, fused (CPU float / double): weight (i, j) of head
  // nh = n·H + h is kept iff dropout_bits(dropout_row_key(dropout_seed, nh,
  // i), j) >= dropout_threshold (kernels/common/dropout.h; 0: no dropout)
  // and then scaled by dropout_scale = 1 / (1 - p); lse stays the undropped
  // softmax's. The backward regenerates the same mask from the same seed.
  uint32_t dropout_threshold = 0;
  uint64_t dropout_seed = 0;
  KernelScalar<T> dropout_scale = 1;
};

template <typename T>
struct FullAttentionForwardArgs : FullAttentionParams<T> {
  T* out = nullptr;  // (N, H, L, M), rows at out_rows; zeros for rows without a kept key
  // (N, H, L) contiguous: log-sum-exp of the kept scaled scores, -inf if none.
  KernelScalar<T>* lse = nullptr;
  RowStrides out_rows;  // CPU
  // CPU, optional: the topk (>= 1, <= S) keys of each row with the highest kept
  // scores, by descending score (ties: lower index first), into
  // top_idx (N, H, L, topk); a row with fewer kept keys is completed with the
  // lowest indices not yet in it. Without a mask and not causal.
  int64_t topk = 0;
  int64_t* top_idx = nullptr;
};

template <typename T>
struct FullAttentionBackwardArgs : FullAttentionParams<T> {
  const T* grad_out = nullptr;           // (N, H, L, M), rows at grad_out_rows
  const KernelScalar<T>* lse = nullptr;  // (N, H, L) contiguous, from the forward
  // (N, H, L): rowsum(grad_out ∘ out), minus the gradient of the loss with
  // respect to the forward's lse where that is an output too.
  const KernelScalar<T>* delta = nullptr;
  T* grad_q = nullptr;  // (N, H, L, E), written
  T* grad_k = nullptr;  // (N, H, S, E), written
  // (N, H, S, M), written; CPU: nullptr, not computed (saves a fifth).
  T* grad_v = nullptr;
  bool accumulate = false;  // add to grad_q, grad_k and grad_v instead of overwriting them
  RowStrides grad_out_rows, grad_q_rows, grad_k_rows, grad_v_rows;  // CPU; default: contiguous
  float* dq_workspace = nullptr;  // CUDA: (N, H, L, E) float32 scratch (dQ accumulated atomically)
};

template <typename T>
void full_attention_forward_cpu(const FullAttentionForwardArgs<T>& args);
template <typename T>
void full_attention_backward_cpu(const FullAttentionBackwardArgs<T>& args);

// The forward on bfloat16 q, k, v (and mask, out), float32 lse, with the
// products on bfloat16 units (full_attention_bf16.cpp): AMX tiles at the amx
// level, AVX512-BF16 dot products at avx512_bf16; S = Q·K^T in float32, the
// online softmax in float32, P rounded to bfloat16 for O += P·V, O in
// float32 until it is written. Only where cpu_isa() is one of those two
// (else std::logic_error); topk must be 0.
void full_attention_forward_bf16(const FullAttentionForwardArgs<Bf16>& args);
// Its backward on bfloat16 q, k, v, grad_out (and mask), float32 lse and
// delta, bfloat16 gradients; the same level condition; accumulate must be
// false.
void full_attention_backward_bf16(const FullAttentionBackwardArgs<Bf16>& args);

}  // namespace fastattn::kernels
