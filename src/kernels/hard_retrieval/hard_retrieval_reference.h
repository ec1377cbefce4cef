// The plain reference of the hard retrieval kernels (hard_retrieval.h):
// scalar loops over the same argument structs, in float64, on one thread,
// one query and one key at a time (no tiles). Argmax mode only: sample mode's
// draws follow the kernels' key tiles (a weighted reservoir, two uniforms per
// tile), so the tests hold its statistics, not its draws, to the softmax
// (tests/cpp/test_hard_retrieval.cpp). tests/cpp/test_kernel_references.cpp
// holds the CPU kernels at every instruction-set level to it,
// tests/cuda_emu/test_hard_retrieval.cpp the CUDA kernels.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/common/softmax_reference.h"
#include "kernels/hard_retrieval/hard_retrieval.h"

namespace fastattn::kernels {

namespace hard_retrieval_detail {

inline bool keeps(const HardRetrievalParams<double>& p, int64_t n, int64_t h, int64_t i,
                  int64_t j) {
  const int64_t len = p.key_lengths ? p.key_lengths[n] : p.S;
  if (j >= len || (p.causal && j > i + p.S - p.L)) return false;
  return !p.keep || p.keep[n * p.keep_sn + h * p.keep_sh + i * p.keep_sl + j];
}

// The raw scores q_i·k_j of query i (unkept keys: -inf).
inline std::vector<double> scores(const HardRetrievalParams<double>& p, int64_t nh, int64_t i) {
  const int64_t n = nh / p.H, h = nh % p.H;
  std::vector<double> s(p.S, -std::numeric_limits<double>::infinity());
  const double* q = p.q_rows.row(p.q, nh, p.H, i);
  for (int64_t j = 0; j < p.S; ++j) {
    if (!keeps(p, n, h, i, j)) continue;
    s[j] = reference::dot(q, p.k_rows.row(p.k, nh, p.H, j), p.E);
  }
  return s;
}

}  // namespace hard_retrieval_detail

// Argmax mode (args.sample must be false): index_i = the lowest j of the
// largest raw score over the kept keys, out_i = v_{index_i}, zeros and -1
// without kept keys; lse and soft_out = softmax(scale·s) V where given.
inline void hard_retrieval_forward_reference(const HardRetrievalForwardArgs<double>& args) {
  using namespace hard_retrieval_detail;
  auto a = args;
  resolve_qkv_rows(a);
  const RowStrides out_rows = a.out_rows.resolved(a.H, a.L, a.M);
  for (int64_t nh = 0; nh < a.N * a.H; ++nh)
    for (int64_t i = 0; i < a.L; ++i) {
      const auto s = scores(a, nh, i);
      int64_t best = -1;
      for (int64_t j = 0; j < a.S; ++j)
        if (!std::isinf(s[j]) && (best < 0 || s[j] > s[best])) best = j;
      a.index[nh * a.L + i] = best;
      double* out = out_rows.row(a.out, nh, a.H, i);
      for (int64_t m = 0; m < a.M; ++m)
        out[m] = best < 0 ? 0.0 : a.v_rows.row(a.v, nh, a.H, best)[m];
      if (!a.lse) continue;
      std::vector<double> scaled(s);
      for (auto& x : scaled) x *= a.scale;
      const double lse = reference::log_sum_exp(scaled);
      a.lse[nh * a.L + i] = lse;
      if (!a.soft_out) continue;
      double* soft = a.soft_out + (nh * a.L + i) * a.M;
      for (int64_t m = 0; m < a.M; ++m) soft[m] = 0;
      for (int64_t j = 0; j < a.S; ++j) {
        if (std::isinf(s[j])) continue;
        const double p = std::exp(a.scale * s[j] - lse);
        for (int64_t m = 0; m < a.M; ++m) soft[m] += p * a.v_rows.row(a.v, nh, a.H, j)[m];
      }
    }
}

// delta_i = sum_j P_ij (grad_out_i·v_j), P_ij = exp(scale·s_ij - lse_i) from
// the given lse; 0 for a query without kept keys.
inline void hard_retrieval_delta_reference(const HardRetrievalDeltaArgs<double>& args) {
  using namespace hard_retrieval_detail;
  auto a = args;
  resolve_qkv_rows(a);
  const RowStrides g_rows = a.grad_out_rows.resolved(a.H, a.L, a.M);
  for (int64_t nh = 0; nh < a.N * a.H; ++nh)
    for (int64_t i = 0; i < a.L; ++i) {
      const auto s = scores(a, nh, i);
      const double lse = a.lse[nh * a.L + i];
      const double* g = g_rows.row(a.grad_out, nh, a.H, i);
      double delta = 0;
      for (int64_t j = 0; j < a.S; ++j) {
        if (std::isinf(s[j])) continue;
        const double* v = a.v_rows.row(a.v, nh, a.H, j);
        double gv = 0;
        for (int64_t m = 0; m < a.M; ++m) gv += g[m] * v[m];
        delta += std::exp(a.scale * s[j] - lse) * gv;
      }
      a.delta[nh * a.L + i] = delta;
    }
}

// grad_v[index_i] += grad_out_i (in increasing i), zeros elsewhere.
inline void hard_retrieval_grad_v_reference(const HardRetrievalGradVArgs<double>& a) {
  const RowStrides g_rows = a.grad_out_rows.resolved(a.H, a.L, a.M);
  const RowStrides v_rows = a.grad_v_rows.resolved(a.H, a.S, a.M);
  for (int64_t nh = 0; nh < a.NH; ++nh) {
    for (int64_t j = 0; j < a.S; ++j)
      for (int64_t m = 0; m < a.M; ++m) v_rows.row(a.grad_v, nh, a.H, j)[m] = 0;
    for (int64_t i = 0; i < a.L; ++i) {
      const int64_t j = a.index[nh * a.L + i];
      if (j < 0) continue;
      for (int64_t m = 0; m < a.M; ++m)
        v_rows.row(a.grad_v, nh, a.H, j)[m] += g_rows.row(a.grad_out, nh, a.H, i)[m];
    }
  }
}

}  // namespace fastattn::kernels
