// Fused linear attention with the elu feature map (Katharopoulos et al. 2020,
// eq. 4-6 and 9), the default map of the `linear` and `causal-linear` types:
//   phi(x) = elu(x) + 1,
//   out_i  = phi(q_i)^T sum_j phi(k_j) v_j^T / den_i,
//   den_i  = phi(q_i)^T sum_j phi(k_j) + eps,
// over the keys j < key_lengths[n] (and j <= i when causal). The feature map,
// the normaliser and the causal masking happen on tiles inside one kernel, so
// the only tensors it reads or writes are q, k, v, out and den (N, H, L); the
// composite path (elu_feature_map twice, a [V, 1] copy, causal_linear_product
// on M + 1 columns, a normalisation) made five extra passes over L×E data.
//
// Causal: chunks of C rows in order with a carried state S = sum phi(k_j) v_j^T
// (E×M) and z = sum phi(k_j) (E) of the earlier chunks:
//   A = phi(Q_c) phi(K_c)^T masked (j <= i);  num = phi(Q_c) S + A V_c;
//   den = phi(Q_c) z + rowsum(A) + eps;       S += phi(K_c)^T V_c, z += ...
// Non-causal: S, z over all valid keys first, then num = phi(Q) S per chunk; the forward may
// keep S and z for the backward (`state`), whose first pass is otherwise their recomputation.
//
// Backward (from out and den): with gn_i = g_i / den_i and gd_i = -(g_i·out_i)
// / den_i the product is that of causal_linear_product on [V, 1] with output
// gradient [gn, gd]; the kernels follow causal_product_cpu.cpp (a forward pass
// for dQ with the prefix state, a reversed pass for dK, dV with the suffix
// state R = sum phi(q_i) gn_i^T, r = sum phi(q_i) gd_i) and recompute phi on
// each tile; dQ = dphi(Q) ∘ phi'(Q), likewise dK. Padded keys get zero
// gradients. The non-causal backward does not read out: g_i·out_i =
// phi(q_i)·(S g_i) / den_i, and S g_i / den_i is already dQ's first product.
//
// Every (N, H, rows, cols) operand but den may have any row layout
// (kernels/common/rows.h): the layers' (N, L, H, E) projections are read and
// the output written in place.
//
// Extra memory: per thread a few C×max(E, M) tiles and E×M states; never
// L×E×M, never L×S. Tested by tests/cpp/test_linear_attention.cpp; timed by
// bench/bench_linear_attention.cpp.
#pragma once

#include <cstdint>

#include "kernels/common/kernel_args.h"

namespace fastattn::kernels {

// The arguments of both backends (kernels/common/kernel_args.h): T = float,
// double or Bf16 (bfloat16 operands, float32 arithmetic and den) for the CPU
// kernels below, void for the CUDA launchers
// (elu_linear_attention_cuda.h), which take contiguous operands only.
template <typename T>
struct EluLinearParams : QKVParams<T> {
  bool causal = false;  // needs S == L
  KernelScalar<T> eps = KernelScalar<T>(1e-6);
  int64_t chunk = 64;          // rows per chunk C (>= 1; CUDA: 16, 32 or 64)
  float* workspace = nullptr;  // CUDA: elu_linear_attention_cuda_workspace_floats(...)
};

template <typename T>
struct EluLinearForwardArgs : EluLinearParams<T> {
  T* out = nullptr;                // (N, H, L, M), written, rows at out_rows
  KernelScalar<T>* den = nullptr;  // (N, H, L) contiguous, written: the normaliser including eps
  // CPU, non-causal, optional: (N, H, E, M + 1) contiguous, written: the key state [S | z] of
  // every head, which the backward then reads instead of recomputing it.
  KernelScalar<T>* state = nullptr;
  // CPU, float32 / float64 only, optional: (N·H) contiguous, zeroed by the caller; head nh's entry
  // gets sum |out| over its rows as they are stored (the registry operator's overflow check reads
  // these instead of the output: finite only if every output value is).
  KernelScalar<T>* out_sums = nullptr;
  RowStrides out_rows;  // CPU
};

template <typename T>
struct EluLinearBackwardArgs : EluLinearParams<T> {
  const T* grad_out = nullptr;           // (N, H, L, M)
  const T* out = nullptr;                // (N, H, L, M), from the forward (causal only)
  const KernelScalar<T>* den = nullptr;  // (N, H, L) contiguous, from the forward
  // CPU, non-causal: the forward's key state (EluLinearForwardArgs::state), or null to recompute
  // it from k and v.
  const KernelScalar<T>* state = nullptr;
  T* grad_q = nullptr;  // (N, H, L, E), written
  T* grad_k = nullptr;  // (N, H, S, E), written
  T* grad_v = nullptr;  // (N, H, S, M), written
  // CPU: row layouts of the tensors above but den (default: contiguous).
  RowStrides grad_out_rows, out_rows, grad_q_rows, grad_k_rows, grad_v_rows;
};

template <typename T>
void elu_linear_attention_forward_cpu(const EluLinearForwardArgs<T>& args);
template <typename T>
void elu_linear_attention_backward_cpu(const EluLinearBackwardArgs<T>& args);

}  // namespace fastattn::kernels
