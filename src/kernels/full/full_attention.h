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

#include "kernels/common/rows.h"

namespace fastattn::kernels {

// Queries per forward tile: each tile reads all of K and V.
inline constexpr int64_t kFullForwardQueryTile = 96;

template <typename T>
struct FullAttentionParams {
  const T* q = nullptr;               // (N, H, L, E), rows at q_rows
  const T* k = nullptr;               // (N, H, S, E), rows at k_rows
  const T* v = nullptr;               // (N, H, S, M), rows at v_rows
  RowStrides q_rows, k_rows, v_rows;  // kernels/common/rows.h; default: contiguous
  // Additive mask or nullptr: element (n, h, l, s) at
  // mask[n·mask_sn + h·mask_sh + l·mask_sl + s] (stride 0 on broadcast dims).
  const T* mask = nullptr;
  int64_t mask_sn = 0, mask_sh = 0, mask_sl = 0;
  const int64_t* key_lengths = nullptr;  // (N,) in [0, S], or nullptr for S
  int64_t N = 0, H = 0, L = 0, S = 0, E = 0, M = 0;
  bool causal = false;  // query i sees key j iff j <= i + (S - L)
  T scale = 1;          // softmax temperature applied to q·k
  int num_threads = 1;
};

template <typename T>
struct FullAttentionForwardArgs : FullAttentionParams<T> {
  T* out = nullptr;  // (N, H, L, M), rows at out_rows
  T* lse = nullptr;  // (N, H, L) contiguous: log-sum-exp of the kept scaled scores, -inf if none
  RowStrides out_rows;
  // Optional: the topk (>= 1, <= S) keys of each row with the highest kept
  // scores, by descending score (ties: lower index first), into
  // top_idx (N, H, L, topk); a row with fewer kept keys is completed with the
  // lowest indices not yet in it. Without a mask and not causal.
  int64_t topk = 0;
  int64_t* top_idx = nullptr;
};

template <typename T>
struct FullAttentionBackwardArgs : FullAttentionParams<T> {
  const T* grad_out = nullptr;  // (N, H, L, M), rows at grad_out_rows
  const T* lse = nullptr;       // (N, H, L) contiguous, from the forward
  // (N, H, L): rowsum(grad_out ∘ out), minus the gradient of the loss with
  // respect to the forward's lse where that is an output too.
  const T* delta = nullptr;
  T* grad_q = nullptr;      // (N, H, L, E), written
  T* grad_k = nullptr;      // (N, H, S, E), written
  T* grad_v = nullptr;      // (N, H, S, M), written; nullptr: not computed (saves a fifth)
  bool accumulate = false;  // add to grad_q, grad_k and grad_v instead of overwriting them
  RowStrides grad_out_rows, grad_q_rows, grad_k_rows, grad_v_rows;  // default: contiguous
};

template <typename T>
void full_attention_forward_cpu(const FullAttentionForwardArgs<T>& args);
template <typename T>
void full_attention_backward_cpu(const FullAttentionBackwardArgs<T>& args);

}  // namespace fastattn::kernels
