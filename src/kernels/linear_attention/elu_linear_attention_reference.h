// The plain reference of the fused elu linear attention kernels
// (elu_linear_attention.h): scalar loops over the same argument structs, in
// float64, on one thread, straight from the definition
//   out_i = sum_j (phi(q_i)·phi(k_j)) v_j / den_i,
//   den_i = sum_j phi(q_i)·phi(k_j) + eps,
// over the keys j < key_lengths[n] (and j <= i when causal), O(L·S) per head:
// no chunks, no carried state, no tiles. The backward derives from q, k, v
// and grad_out, or, where the arguments carry them, with the forward's den
// and (causal) out, which the kernels read: a GPU's out is rounded to its
// dtype, and its backward's gradients follow that out (never the state).
// tests/cpp/test_kernel_references.cpp holds the CPU kernels at every instruction-set level to it,
// tests/cuda_emu/test_linear_attention.cpp the CUDA kernels.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/common/softmax_reference.h"
#include "kernels/feature_maps/elu_feature_map_reference.h"
#include "kernels/linear_attention/elu_linear_attention.h"

namespace fastattn::kernels {

namespace elu_linear_detail {

// Whether query i of item n attends to key j.
inline bool keeps(const EluLinearParams<double>& p, int64_t n, int64_t i, int64_t j) {
  const int64_t len = p.key_lengths ? p.key_lengths[n] : p.S;
  return j < len && (!p.causal || j <= i);
}

// phi of row r of an (N, H, R, C) operand at `rows`.
inline std::vector<double> phi_row(const double* x, RowStrides rows, int64_t nh, int64_t H,
                                   int64_t r, int64_t C) {
  const double* row = rows.row(x, nh, H, r);
  std::vector<double> out(C);
  for (int64_t c = 0; c < C; ++c) out[c] = elu_feature_reference(row[c]);
  return out;
}

using reference::dot;

inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  return dot(a.data(), b.data(), static_cast<int64_t>(a.size()));
}

}  // namespace elu_linear_detail

// out (at out_rows), den, and where given the key state [S | z] (non-causal)
// and the per-head sums of |out|.
inline void elu_linear_attention_forward_reference(const EluLinearForwardArgs<double>& args) {
  using namespace elu_linear_detail;
  auto a = args;
  resolve_qkv_rows(a);
  const RowStrides out_rows = a.out_rows.resolved(a.H, a.L, a.M);
  for (int64_t nh = 0; nh < a.N * a.H; ++nh) {
    const int64_t n = nh / a.H;
    if (a.out_sums) a.out_sums[nh] = 0;
    if (a.state && !a.causal) {
      double* st = a.state + nh * a.E * (a.M + 1);
      for (int64_t x = 0; x < a.E * (a.M + 1); ++x) st[x] = 0;
      for (int64_t j = 0; j < a.S; ++j) {
        if (!keeps(a, n, 0, j)) continue;
        const auto pk = phi_row(a.k, a.k_rows, nh, a.H, j, a.E);
        const double* v = a.v_rows.row(a.v, nh, a.H, j);
        for (int64_t e = 0; e < a.E; ++e) {
          for (int64_t m = 0; m < a.M; ++m) st[e * (a.M + 1) + m] += pk[e] * v[m];
          st[e * (a.M + 1) + a.M] += pk[e];
        }
      }
    }
    for (int64_t i = 0; i < a.L; ++i) {
      const auto pq = phi_row(a.q, a.q_rows, nh, a.H, i, a.E);
      std::vector<double> num(a.M, 0.0);
      double den = a.eps;
      for (int64_t j = 0; j < a.S; ++j) {
        if (!keeps(a, n, i, j)) continue;
        const double w = dot(pq, phi_row(a.k, a.k_rows, nh, a.H, j, a.E));
        const double* v = a.v_rows.row(a.v, nh, a.H, j);
        for (int64_t m = 0; m < a.M; ++m) num[m] += w * v[m];
        den += w;
      }
      a.den[nh * a.L + i] = den;
      double* out = out_rows.row(a.out, nh, a.H, i);
      for (int64_t m = 0; m < a.M; ++m) {
        out[m] = num[m] / den;
        if (a.out_sums) a.out_sums[nh] += std::abs(out[m]);
      }
    }
  }
}

// With g = grad_out, A_ij = phi(q_i)·phi(k_j) over the kept pairs and
// out_i, den_i as in the forward:
//   grad_q_i = phi'(q_i) ∘ sum_j phi(k_j) (g_i·v_j - g_i·out_i) / den_i,
//   grad_k_j = phi'(k_j) ∘ sum_i phi(q_i) (g_i·v_j - g_i·out_i) / den_i,
//   grad_v_j = sum_i A_ij g_i / den_i;
// padded keys get zeros.
inline void elu_linear_attention_backward_reference(const EluLinearBackwardArgs<double>& args) {
  using namespace elu_linear_detail;
  auto a = args;
  resolve_qkv_rows(a);
  resolve_grad_rows(a);
  a.out_rows = a.out_rows.resolved(a.H, a.L, a.M);
  const int64_t E = a.E, M = a.M;
  for (int64_t nh = 0; nh < a.N * a.H; ++nh) {
    const int64_t n = nh / a.H;
    for (int64_t i = 0; i < a.L; ++i)
      for (int64_t e = 0; e < E; ++e) a.grad_q_rows.row(a.grad_q, nh, a.H, i)[e] = 0;
    for (int64_t j = 0; j < a.S; ++j) {
      for (int64_t e = 0; e < E; ++e) a.grad_k_rows.row(a.grad_k, nh, a.H, j)[e] = 0;
      for (int64_t m = 0; m < M; ++m) a.grad_v_rows.row(a.grad_v, nh, a.H, j)[m] = 0;
    }
    for (int64_t i = 0; i < a.L; ++i) {
      const auto pq = phi_row(a.q, a.q_rows, nh, a.H, i, E);
      const double* g = a.grad_out_rows.row(a.grad_out, nh, a.H, i);
      // out_i and den_i: recomputed, or the forward's where given (as the
      // kernels read them: den always, out when causal).
      std::vector<double> out(M, 0.0);
      double den = a.eps;
      for (int64_t j = 0; j < a.S; ++j) {
        if (!keeps(a, n, i, j)) continue;
        const double w = dot(pq, phi_row(a.k, a.k_rows, nh, a.H, j, E));
        for (int64_t m = 0; m < M; ++m) out[m] += w * a.v_rows.row(a.v, nh, a.H, j)[m];
        den += w;
      }
      for (auto& o : out) o /= den;
      if (a.den) den = a.den[nh * a.L + i];
      if (a.causal && a.out) std::copy_n(a.out_rows.row(a.out, nh, a.H, i), M, out.begin());
      const double g_out = dot(g, out.data(), M);
      double* gq = a.grad_q_rows.row(a.grad_q, nh, a.H, i);
      const double* qi = a.q_rows.row(a.q, nh, a.H, i);
      for (int64_t j = 0; j < a.S; ++j) {
        if (!keeps(a, n, i, j)) continue;
        const auto pk = phi_row(a.k, a.k_rows, nh, a.H, j, E);
        const double* kj = a.k_rows.row(a.k, nh, a.H, j);
        const double c = (dot(g, a.v_rows.row(a.v, nh, a.H, j), M) - g_out) / den;
        const double w = dot(pq, pk) / den;
        double* gk = a.grad_k_rows.row(a.grad_k, nh, a.H, j);
        for (int64_t e = 0; e < E; ++e) {
          gq[e] += pk[e] * c * elu_feature_slope_reference(qi[e]);
          gk[e] += pq[e] * c * elu_feature_slope_reference(kj[e]);
        }
        double* gv = a.grad_v_rows.row(a.grad_v, nh, a.H, j);
        for (int64_t m = 0; m < M; ++m) gv[m] += w * g[m];
      }
    }
  }
}

}  // namespace fastattn::kernels
