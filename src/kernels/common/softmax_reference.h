// What the plain references of the softmax kernels share
// (src/kernels/<kernel>/<kernel>_reference.h): float64 scalar loops, one
// thread. A reference states which keys a query keeps and their scores; the
// softmax, the fused dropout's factors and the gradients from the saved
// log-sum-exp are the same for full and block-sparse attention, hard
// retrieval's softmax parts and the others.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/common/dropout.h"
#include "kernels/common/rows.h"

namespace fastattn::kernels::reference {

inline double dot(const double* a, const double* b, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// log Σ exp(x) over the finite entries of s; -inf when there are none.
inline double log_sum_exp(const std::vector<double>& s) {
  double m = -std::numeric_limits<double>::infinity();
  for (double x : s) m = std::max(m, x);
  if (std::isinf(m)) return m;
  double sum = 0;
  for (double x : s)
    if (!std::isinf(x)) sum += std::exp(x - m);
  return m + std::log(sum);
}

// The factor of column `column` in the row keyed row_key of a fused dropout
// with this threshold: `scale` where kept, 0 where dropped; 1 without dropout
// (threshold 0).
inline double dropout_factor(uint32_t threshold, double scale, uint64_t row_key, int64_t column) {
  if (!threshold) return 1;
  return dropout_bits(row_key, column) >= threshold ? scale : 0.0;
}

// Weight (i, j) of head nh under the dropout fields of a kernel's
// parameters (full attention's rows: dropout_row_key(seed, nh, i)).
template <typename Params>
double dropout_factor(const Params& a, int64_t nh, int64_t i, int64_t j) {
  return dropout_factor(a.dropout_threshold, a.dropout_scale,
                        dropout_row_key(a.dropout_seed, nh, i), j);
}

// Softmax attention of every query over the keys `scores(nh, i)` keeps
// (scaled scores, -inf where not kept), for parameters with q/k/v rows
// resolved (resolve_qkv_rows) and dropout fields:
//   lse_i = log Σ_j exp(s_ij) (-inf without kept keys),
//   out_i = Σ_j exp(s_ij - lse_i) z_ij v_j (zeros without kept keys).
template <typename Params, typename Scores>
void softmax_attention_forward(const Params& a, const Scores& scores, double* out,
                               RowStrides out_rows, double* lse) {
  for (int64_t nh = 0; nh < a.N * a.H; ++nh)
    for (int64_t i = 0; i < a.L; ++i) {
      const std::vector<double> s = scores(nh, i);
      const double l = log_sum_exp(s);
      lse[nh * a.L + i] = l;
      double* o = out_rows.row(out, nh, a.H, i);
      std::fill_n(o, a.M, 0.0);
      for (int64_t j = 0; j < a.S; ++j) {
        if (std::isinf(s[j])) continue;
        const double w = std::exp(s[j] - l) * dropout_factor(a, nh, i, j);
        const double* v = a.v_rows.row(a.v, nh, a.H, j);
        for (int64_t m = 0; m < a.M; ++m) o[m] += w * v[m];
      }
    }
}

// Its gradients from the given lse and delta (rowsum(grad_out ∘ out)), for
// parameters with every row layout resolved (resolve_qkv_rows,
// resolve_grad_rows): with P_ij = exp(s_ij - lse_i),
//   dS_ij = P_ij (z_ij g_i·v_j - delta_i) scale,
//   grad_q_i = Σ_j dS_ij k_j, grad_k_j = Σ_i dS_ij q_i,
//   grad_v_j = Σ_i P_ij z_ij g_i (when a.grad_v is given);
// written, or added to with `accumulate`.
template <typename Params, typename Scores>
void softmax_attention_backward(const Params& a, const Scores& scores, double scale,
                                bool accumulate) {
  const int64_t E = a.E, M = a.M;
  for (int64_t nh = 0; nh < a.N * a.H; ++nh) {
    if (!accumulate) {
      for (int64_t i = 0; i < a.L; ++i)
        std::fill_n(a.grad_q_rows.row(a.grad_q, nh, a.H, i), E, 0.0);
      for (int64_t j = 0; j < a.S; ++j) {
        std::fill_n(a.grad_k_rows.row(a.grad_k, nh, a.H, j), E, 0.0);
        if (a.grad_v) std::fill_n(a.grad_v_rows.row(a.grad_v, nh, a.H, j), M, 0.0);
      }
    }
    for (int64_t i = 0; i < a.L; ++i) {
      const std::vector<double> s = scores(nh, i);
      const double lse = a.lse[nh * a.L + i], delta = a.delta[nh * a.L + i];
      const double* q = a.q_rows.row(a.q, nh, a.H, i);
      const double* g = a.grad_out_rows.row(a.grad_out, nh, a.H, i);
      double* gq = a.grad_q_rows.row(a.grad_q, nh, a.H, i);
      for (int64_t j = 0; j < a.S; ++j) {
        if (std::isinf(s[j])) continue;
        const double p = std::exp(s[j] - lse), z = dropout_factor(a, nh, i, j);
        const double* v = a.v_rows.row(a.v, nh, a.H, j);
        const double ds = p * (z * dot(g, v, M) - delta) * scale;
        const double* k = a.k_rows.row(a.k, nh, a.H, j);
        double* gk = a.grad_k_rows.row(a.grad_k, nh, a.H, j);
        for (int64_t e = 0; e < E; ++e) {
          gq[e] += ds * k[e];
          gk[e] += ds * q[e];
        }
        if (!a.grad_v) continue;
        double* gv = a.grad_v_rows.row(a.grad_v, nh, a.H, j);
        for (int64_t m = 0; m < M; ++m) gv[m] += p * z * g[m];
      }
    }
  }
}

}  // namespace fastattn::kernels::reference
