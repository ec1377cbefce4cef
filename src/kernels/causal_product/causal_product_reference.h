// The plain reference of the causal linear product kernels
// (causal_product.h): scalar loops over the same argument structs, in
// float64, on one thread, O(L²) per head (no chunks, no carried state), so
// that it reads as the definition. tests/cpp/test_kernel_references.cpp holds
// the CPU kernels at every instruction-set level to it,
// tests/cuda_emu/test_causal_product.cpp the CUDA kernels.
#pragma once

#include <cstdint>

#include "kernels/causal_product/causal_product.h"
#include "kernels/common/softmax_reference.h"

namespace fastattn::kernels {

// out_i = sum_{j <= i} (q_i·k_j) v_j.
inline void causal_product_forward_reference(const CausalProductForwardArgs<double>& a) {
  using reference::dot;
  for (int64_t nh = 0; nh < a.N * a.H; ++nh) {
    const double *q = a.q + nh * a.L * a.F, *k = a.k + nh * a.L * a.F, *v = a.v + nh * a.L * a.M;
    double* out = a.out + nh * a.L * a.M;
    for (int64_t i = 0; i < a.L; ++i) {
      for (int64_t m = 0; m < a.M; ++m) out[i * a.M + m] = 0;
      for (int64_t j = 0; j <= i; ++j) {
        const double w = dot(q + i * a.F, k + j * a.F, a.F);
        for (int64_t m = 0; m < a.M; ++m) out[i * a.M + m] += w * v[j * a.M + m];
      }
    }
  }
}

// With g = grad_out:
//   grad_q_i = sum_{j <= i} (g_i·v_j) k_j,
//   grad_k_j = sum_{i >= j} (g_i·v_j) q_i,
//   grad_v_j = sum_{i >= j} (q_i·k_j) g_i.
inline void causal_product_backward_reference(const CausalProductBackwardArgs<double>& a) {
  using reference::dot;
  const int64_t L = a.L, F = a.F, M = a.M;
  for (int64_t nh = 0; nh < a.N * a.H; ++nh) {
    const double *q = a.q + nh * L * F, *k = a.k + nh * L * F, *v = a.v + nh * L * M,
                 *g = a.grad_out + nh * L * M;
    double *gq = a.grad_q + nh * L * F, *gk = a.grad_k + nh * L * F, *gv = a.grad_v + nh * L * M;
    for (int64_t x = 0; x < L * F; ++x) gq[x] = gk[x] = 0;
    for (int64_t x = 0; x < L * M; ++x) gv[x] = 0;
    for (int64_t i = 0; i < L; ++i)
      for (int64_t j = 0; j <= i; ++j) {
        const double gv_ij = dot(g + i * M, v + j * M, M);
        const double qk_ij = dot(q + i * F, k + j * F, F);
        for (int64_t f = 0; f < F; ++f) {
          gq[i * F + f] += gv_ij * k[j * F + f];
          gk[j * F + f] += gv_ij * q[i * F + f];
        }
        for (int64_t m = 0; m < M; ++m) gv[j * M + m] += qk_ij * g[i * M + m];
      }
  }
}

}  // namespace fastattn::kernels
