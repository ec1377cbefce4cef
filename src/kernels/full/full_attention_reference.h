// The plain reference of the fused softmax attention kernels
// (full_attention.h): scalar loops over the same argument structs, in
// float64, on one thread, one query row at a time with its whole score row
// (no tiles, no online softmax), the additive mask, key lengths, causal
// alignment, the fused dropout's keep mask (kernels/common/dropout.h) and
// the top-k keys. tests/cpp/test_kernel_references.cpp holds the CPU kernels
// at every instruction-set level to it, tests/cuda_emu/test_full.cpp the
// CUDA kernels. (src/ops/full_attention_reference.cpp is the operator's
// reference over tensors; this one is the kernels'.)
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "kernels/common/dropout.h"
#include "kernels/full/full_attention.h"

namespace fastattn::kernels {

namespace full_attention_detail {

using P = FullAttentionParams<double>;

// The scaled, masked scores of query i (-inf where a key is not kept).
inline std::vector<double> scores(const P& a, int64_t nh, int64_t i) {
  const int64_t n = nh / a.H, h = nh % a.H;
  const int64_t len = a.key_lengths ? a.key_lengths[n] : a.S;
  std::vector<double> s(a.S, -std::numeric_limits<double>::infinity());
  const double* q = a.q_rows.row(a.q, nh, a.H, i);
  for (int64_t j = 0; j < a.S; ++j) {
    if (j >= len || (a.causal && j > i + a.S - a.L)) continue;
    const double* k = a.k_rows.row(a.k, nh, a.H, j);
    double d = 0;
    for (int64_t e = 0; e < a.E; ++e) d += q[e] * k[e];
    s[j] = a.scale * d + (a.mask ? a.mask[n * a.mask_sn + h * a.mask_sh + i * a.mask_sl + j] : 0.0);
  }
  return s;
}

inline double log_sum_exp(const std::vector<double>& s) {
  const double m = *std::max_element(s.begin(), s.end());
  if (std::isinf(m) && m < 0) return m;
  double sum = 0;
  for (double x : s) sum += std::exp(x - m);
  return m + std::log(sum);
}

// Weight (i, j)'s dropout factor: the scale where kept, 0 where dropped; 1
// without dropout.
inline double drop_factor(const P& a, int64_t nh, int64_t i, int64_t j) {
  if (!a.dropout_threshold) return 1;
  return dropout_bits(dropout_row_key(a.dropout_seed, nh, i), j) >= a.dropout_threshold
             ? a.dropout_scale
             : 0.0;
}

}  // namespace full_attention_detail

// out_i = Σ_j softmax(s_i)_j z_ij v_j (zeros without a kept key), lse_i =
// log Σ_j exp(s_ij) (-inf without one); top_idx where asked.
inline void full_attention_forward_reference(const FullAttentionForwardArgs<double>& args) {
  using namespace full_attention_detail;
  auto a = args;
  resolve_qkv_rows(a);
  const RowStrides out_rows = a.out_rows.resolved(a.H, a.L, a.M);
  for (int64_t nh = 0; nh < a.N * a.H; ++nh)
    for (int64_t i = 0; i < a.L; ++i) {
      const auto s = scores(a, nh, i);
      const double lse = log_sum_exp(s);
      a.lse[nh * a.L + i] = lse;
      double* out = out_rows.row(a.out, nh, a.H, i);
      std::fill_n(out, a.M, 0.0);
      for (int64_t j = 0; j < a.S; ++j) {
        if (std::isinf(s[j])) continue;
        const double p = std::exp(s[j] - lse) * drop_factor(a, nh, i, j);
        const double* v = a.v_rows.row(a.v, nh, a.H, j);
        for (int64_t m = 0; m < a.M; ++m) out[m] += p * v[m];
      }
      if (a.topk == 0) continue;
      // By descending score, ties to the lower index, unkept keys last (in
      // increasing index).
      std::vector<int64_t> order(a.S);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
        const bool kx = !std::isinf(s[x]), ky = !std::isinf(s[y]);
        if (kx != ky) return kx;
        return kx && s[x] > s[y];
      });
      std::copy_n(order.begin(), a.topk, a.top_idx + (nh * a.L + i) * a.topk);
    }
}

// With P_ij = exp(s_ij - lse_i) from the given lse and delta:
//   dS_ij = P_ij (z_ij g_i·v_j - delta_i),
//   grad_q_i = scale Σ_j dS_ij k_j, grad_k_j = scale Σ_i dS_ij q_i,
//   grad_v_j = Σ_i P_ij z_ij g_i (when grad_v is given);
// written, or added with accumulate.
inline void full_attention_backward_reference(const FullAttentionBackwardArgs<double>& args) {
  using namespace full_attention_detail;
  auto a = args;
  resolve_qkv_rows(a);
  resolve_grad_rows(a);
  const int64_t E = a.E, M = a.M;
  for (int64_t nh = 0; nh < a.N * a.H; ++nh) {
    if (!a.accumulate) {
      for (int64_t i = 0; i < a.L; ++i)
        std::fill_n(a.grad_q_rows.row(a.grad_q, nh, a.H, i), E, 0.0);
      for (int64_t j = 0; j < a.S; ++j) {
        std::fill_n(a.grad_k_rows.row(a.grad_k, nh, a.H, j), E, 0.0);
        if (a.grad_v) std::fill_n(a.grad_v_rows.row(a.grad_v, nh, a.H, j), M, 0.0);
      }
    }
    for (int64_t i = 0; i < a.L; ++i) {
      const auto s = scores(a, nh, i);
      const double lse = a.lse[nh * a.L + i], delta = a.delta[nh * a.L + i];
      const double* q = a.q_rows.row(a.q, nh, a.H, i);
      const double* g = a.grad_out_rows.row(a.grad_out, nh, a.H, i);
      double* gq = a.grad_q_rows.row(a.grad_q, nh, a.H, i);
      for (int64_t j = 0; j < a.S; ++j) {
        if (std::isinf(s[j])) continue;
        const double p = std::exp(s[j] - lse), z = drop_factor(a, nh, i, j);
        const double* v = a.v_rows.row(a.v, nh, a.H, j);
        double gv = 0;
        for (int64_t m = 0; m < M; ++m) gv += g[m] * v[m];
        const double ds = p * (z * gv - delta) * a.scale;
        const double* k = a.k_rows.row(a.k, nh, a.H, j);
        double* gk = a.grad_k_rows.row(a.grad_k, nh, a.H, j);
        for (int64_t e = 0; e < E; ++e) {
          gq[e] += ds * k[e];
          gk[e] += ds * q[e];
        }
        if (!a.grad_v) continue;
        double* gvr = a.grad_v_rows.row(a.grad_v, nh, a.H, j);
        for (int64_t m = 0; m < M; ++m) gvr[m] += p * z * g[m];
      }
    }
  }
}

}  // namespace fastattn::kernels
