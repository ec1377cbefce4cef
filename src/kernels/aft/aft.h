// AFT-simple on the CPU (Zhai et al. 2021, "An Attention Free Transformer",
// eq. 2 with w = 0): per batch item, head and channel c, the output at
// position t is
//
//   out_t = sigmoid(q_t) ⊙ a_t,   a_t = Σ_{s ∈ keys(t)} exp(k_s) ⊙ v_s / Σ_{s ∈ keys(t)} exp(k_s)
//
// element-wise in the channels (q, k, v have the same width E). keys(t) is
// the prefix s <= lim(t) = min(t + S - L, len - 1) under causal (fastattn's
// causal alignment: the last L of S positions), else s < len; len is the
// item's key length (S without key lengths). lim(t) never decreases with t,
// so one pass over the keys per (n, h), with a running maximum per channel
// (an online softmax per channel), gives every row: O(S·E) exps, O(L·E)
// memory. A row without keys gives zeros (a = 0, lse = -inf). A key of
// -inf counts as the lowest finite value (the kernels are branch-free over
// vectors of channels: the running maximum must be finite after one key).
//
// The backward runs the keys in reverse. With P_ts = exp(k_s - lse_t) and
// da_t = dout_t ⊙ sigmoid(q_t):
//   dv_s = exp(k_s) Σ_{t: lim(t) >= s} da_t exp(-lse_t)
//   dk_s = exp(k_s) Σ_{t: lim(t) >= s} da_t (v_s - a_t) exp(-lse_t)
//   dq_t = dout_t ⊙ a_t ⊙ sigmoid(q_t) (1 - sigmoid(q_t))
// The rows with lim(t) >= s are a suffix of t; the sums are kept relative to
// the lse of the last row added (which bounds k_s), so every exponent is <= 0.
// Tested by tests/cpp/test_aft.cpp.
#pragma once

#include <cstdint>

#include "kernels/common/kernel_args.h"

namespace fastattn::kernels {

template <typename T>
struct AftScanArgs {
  const T* q = nullptr;                  // (N, H, L, E) contiguous
  const T* k = nullptr;                  // (N, H, S, E) contiguous
  const T* v = nullptr;                  // (N, H, S, E) contiguous
  const int64_t* key_lengths = nullptr;  // (N) in [0, S], or nullptr (all S)
  bool causal = false;
  int64_t N = 0, H = 0, L = 0, S = 0, E = 0;
  int num_threads = 1;
  // Forward: out (N, H, L, E), written; a and lse (N, H, L, E) written when
  // given (the backward's statistics; nullptr: not computed).
  T* out = nullptr;
  T* a = nullptr;
  T* lse = nullptr;
  // Backward: grad_out, a and lse from the forward in; grad_q, grad_k,
  // grad_v (the shapes of q, k, v) written.
  const T* grad_out = nullptr;
  const T* a_in = nullptr;
  const T* lse_in = nullptr;
  T* grad_q = nullptr;
  T* grad_k = nullptr;
  T* grad_v = nullptr;
};

template <typename T>
void aft_scan_forward_cpu(const AftScanArgs<T>& args);
template <typename T>
void aft_scan_backward_cpu(const AftScanArgs<T>& args);

}  // namespace fastattn::kernels
