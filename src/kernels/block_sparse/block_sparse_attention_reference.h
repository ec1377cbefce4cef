// The plain reference of the block-sparse kernels (block_sparse_attention.h):
// scalar loops over the same argument structs, in float64, on one thread.
// Each key is tested against each of the head's parts by the parts'
// definitions (no orders, ranges or tiles), and the kept keys of a query take
// one softmax, with the fused dropout's keep mask (as full attention's:
// kernels/common/dropout.h). tests/cpp/test_kernel_references.cpp holds the
// CPU kernels at every instruction-set level to it. (The operator's reference
// over tensors is src/ops/block_sparse_reference.cpp.)
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/block_sparse/block_sparse_attention.h"
#include "kernels/common/dropout.h"

namespace fastattn::kernels {

namespace block_sparse_detail {

inline int64_t floor_div(int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

// Whether part `pt` of head h keeps key j for the query at key position p.
inline bool part_keeps(const SparsePart& pt, int64_t h, int64_t p, int64_t j) {
  if (h < pt.head_begin || h >= pt.head_end) return false;
  const int64_t l = pt.stride;
  if (pt.kind == SparsePartKind::Band) return j - p >= pt.lo && j - p <= pt.hi;
  if (pt.causal && j > p) return false;
  switch (pt.kind) {
    case SparsePartKind::SameBlock:
      return floor_div(j, l) == floor_div(p, l);
    case SparsePartKind::Residue:
      return (j - p) % l == 0 && !(pt.exclude && std::abs(j - p) <= l);
    case SparsePartKind::Summary: {
      const int64_t group = pt.per_head ? h % std::max<int64_t>(1, l / pt.summary) : 0;
      const int64_t hi = l - pt.summary * group, lo = hi - pt.summary;
      return j % l >= lo && j % l < hi && !(pt.exclude && floor_div(j, l) == floor_div(p, l));
    }
    default:
      return false;
  }
}

// The scaled scores of query i (-inf where no part keeps the key, or past
// the key length).
inline std::vector<double> scores(const BlockSparseParams<double>& a, int64_t nh, int64_t i) {
  const int64_t h = nh % a.H, len = a.key_lengths ? a.key_lengths[nh / a.H] : a.S;
  const int64_t p = i + a.S - a.L;
  std::vector<double> s(a.S, -std::numeric_limits<double>::infinity());
  const double* q = a.q_rows.row(a.q, nh, a.H, i);
  for (int64_t j = 0; j < std::min(len, a.S); ++j) {
    bool kept = false;
    for (int x = 0; x < a.num_parts; ++x) kept = kept || part_keeps(a.parts[x], h, p, j);
    if (!kept) continue;
    const double* k = a.k_rows.row(a.k, nh, a.H, j);
    double d = 0;
    for (int64_t e = 0; e < a.E; ++e) d += q[e] * k[e];
    s[j] = a.scale * d;
  }
  return s;
}

inline double drop_factor(const BlockSparseParams<double>& a, int64_t nh, int64_t i, int64_t j) {
  if (!a.dropout_threshold) return 1;
  return dropout_bits(dropout_row_key(a.dropout_seed, nh, i), j) >= a.dropout_threshold
             ? a.dropout_scale
             : 0.0;
}

}  // namespace block_sparse_detail

// out_i = Σ_j softmax(s_i)_j z_ij v_j over the kept keys (zeros without
// one), lse_i (-inf without one).
inline void block_sparse_attention_forward_reference(const BlockSparseForwardArgs<double>& args) {
  using namespace block_sparse_detail;
  auto a = args;
  resolve_qkv_rows(a);
  const RowStrides out_rows = a.out_rows.resolved(a.H, a.L, a.M);
  for (int64_t nh = 0; nh < a.N * a.H; ++nh)
    for (int64_t i = 0; i < a.L; ++i) {
      const auto s = scores(a, nh, i);
      double m = -std::numeric_limits<double>::infinity(), sum = 0;
      for (double x : s) m = std::max(m, x);
      for (double x : s)
        if (!std::isinf(x)) sum += std::exp(x - m);
      const double lse = std::isinf(m) ? m : m + std::log(sum);
      a.lse[nh * a.L + i] = lse;
      double* out = out_rows.row(a.out, nh, a.H, i);
      std::fill_n(out, a.M, 0.0);
      for (int64_t j = 0; j < a.S; ++j) {
        if (std::isinf(s[j])) continue;
        const double w = std::exp(s[j] - lse) * drop_factor(a, nh, i, j);
        const double* v = a.v_rows.row(a.v, nh, a.H, j);
        for (int64_t x = 0; x < a.M; ++x) out[x] += w * v[x];
      }
    }
}

// As full attention's backward over the kept keys: with P from the given lse,
// dS = P (z g_i·v_j - delta_i) scale; grad_q_i = Σ dS k_j, grad_k_j = Σ dS q_i,
// grad_v_j = Σ P z g_i.
inline void block_sparse_attention_backward_reference(const BlockSparseBackwardArgs<double>& args) {
  using namespace block_sparse_detail;
  auto a = args;
  resolve_qkv_rows(a);
  resolve_grad_rows(a);
  const int64_t E = a.E, M = a.M;
  for (int64_t nh = 0; nh < a.N * a.H; ++nh) {
    for (int64_t i = 0; i < a.L; ++i) std::fill_n(a.grad_q_rows.row(a.grad_q, nh, a.H, i), E, 0.0);
    for (int64_t j = 0; j < a.S; ++j) {
      std::fill_n(a.grad_k_rows.row(a.grad_k, nh, a.H, j), E, 0.0);
      std::fill_n(a.grad_v_rows.row(a.grad_v, nh, a.H, j), M, 0.0);
    }
    for (int64_t i = 0; i < a.L; ++i) {
      const auto s = scores(a, nh, i);
      const double* q = a.q_rows.row(a.q, nh, a.H, i);
      const double* g = a.grad_out_rows.row(a.grad_out, nh, a.H, i);
      double* gq = a.grad_q_rows.row(a.grad_q, nh, a.H, i);
      for (int64_t j = 0; j < a.S; ++j) {
        if (std::isinf(s[j])) continue;
        const double w = std::exp(s[j] - a.lse[nh * a.L + i]), z = drop_factor(a, nh, i, j);
        const double* v = a.v_rows.row(a.v, nh, a.H, j);
        double g_v = 0;
        for (int64_t x = 0; x < M; ++x) g_v += g[x] * v[x];
        const double ds = w * (z * g_v - a.delta[nh * a.L + i]) * a.scale;
        const double* k = a.k_rows.row(a.k, nh, a.H, j);
        double* gk = a.grad_k_rows.row(a.grad_k, nh, a.H, j);
        double* gv = a.grad_v_rows.row(a.grad_v, nh, a.H, j);
        for (int64_t e = 0; e < E; ++e) {
          gq[e] += ds * k[e];
          gk[e] += ds * q[e];
        }
        for (int64_t x = 0; x < M; ++x) gv[x] += w * z * g[x];
      }
    }
  }
}

}  // namespace fastattn::kernels
