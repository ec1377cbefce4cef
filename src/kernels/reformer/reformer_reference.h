// The plain reference of the Reformer kernels (reformer.h): scalar loops over
// the same argument structs, in float64, on one thread. Hashing is an argmax
// over [x·R ; -x·R] per round; attention lists, per query, every (round, key)
// pair its chunks give it and takes one softmax over them (no gathered
// windows, no running merge over rounds), with the fused dropout's keep mask
// (kernels/common/dropout.h). tests/cpp/test_kernel_references.cpp holds the
// CPU kernels at every instruction-set level to it,
// tests/cuda_emu/test_reformer.cpp the CUDA kernels.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/common/softmax_reference.h"
#include "kernels/reformer/reformer.h"

namespace fastattn::kernels {

// buckets[n, h, r, l] = the first index of the largest of the 2·B2 values
// [x_l·R_r ; -x_l·R_r] (0 with B2 = 0).
inline void lsh_hash_reference(const LshHashArgs<double>& a) {
  const RowStrides x_rows = a.x_rows.resolved(a.H, a.L, a.E);
  for (int64_t nh = 0; nh < a.N * a.H; ++nh)
    for (int64_t r = 0; r < a.R; ++r)
      for (int64_t l = 0; l < a.L; ++l) {
        const double* x = x_rows.row(a.x, nh, a.H, l);
        int64_t best = 0;
        double best_value = -std::numeric_limits<double>::infinity();
        for (int64_t b = 0; b < 2 * a.B2; ++b) {
          double p = 0;
          for (int64_t e = 0; e < a.E; ++e)
            p += x[e] * a.rotations[(r * a.E + e) * a.B2 + b % a.B2];
          if (b >= a.B2) p = -p;
          if (p > best_value) best = b, best_value = p;
        }
        a.buckets[(nh * a.R + r) * a.L + l] = best;
      }
}

namespace reformer_detail {

using P = ReformerParams<double>;

// One (round, key) pair of a query, with its score.
struct Pair {
  int64_t round, key;
  double score;
};

inline std::vector<double> unit_key(const P& a, int64_t nh, int64_t j) {
  const double* q = a.q_rows.row(a.q, nh, a.H, j);
  double ss = 0;
  for (int64_t e = 0; e < a.E; ++e) ss += q[e] * q[e];
  const double inv = 1 / std::max(std::sqrt(ss), 1e-12);
  std::vector<double> k(a.E);
  for (int64_t e = 0; e < a.E; ++e) k[e] = q[e] * inv;
  return k;
}

// Every query's pairs: per round the valid positions sorted by (bucket,
// position), chunks of `chunk`, chunk c's queries over chunks c - 1 and c
// (chunk 0 over itself); later keys dropped when causal; the self score
// kReformerSelfScore when mask_self.
inline std::vector<std::vector<Pair>> pairs(const P& a, int64_t nh) {
  const int64_t len = a.lengths ? a.lengths[nh / a.H] : a.L;
  std::vector<std::vector<Pair>> out(a.L);
  for (int64_t r = 0; r < a.R; ++r) {
    std::vector<int64_t> sorted(len);
    for (int64_t l = 0; l < len; ++l) sorted[l] = l;
    const int64_t* b = a.buckets + (nh * a.R + r) * a.L;
    std::stable_sort(sorted.begin(), sorted.end(),
                     [&](int64_t x, int64_t y) { return b[x] < b[y]; });
    for (int64_t p = 0; p < len; ++p) {
      const int64_t i = sorted[p], c = p / a.chunk;
      const double* q = a.q_rows.row(a.q, nh, a.H, i);
      for (int64_t s = std::max<int64_t>(c - 1, 0) * a.chunk; s < std::min(len, (c + 1) * a.chunk);
           ++s) {
        const int64_t j = sorted[s];
        if (a.causal && j > i) continue;
        double score = kReformerSelfScore;
        if (j != i || !a.mask_self) {
          const auto k = unit_key(a, nh, j);
          score = a.scale * reference::dot(q, k.data(), a.E);
        }
        out[i].push_back({r, j, score});
      }
    }
  }
  return out;
}

inline double drop_factor(const P& a, int64_t nh, int64_t i, const Pair& p) {
  return reference::dropout_factor(
      a.dropout_threshold, a.dropout_scale,
      dropout_row_key(reformer_round_seed(a.dropout_seed, p.round), nh, i), p.key);
}

}  // namespace reformer_detail

// out_i = Σ over i's pairs of softmax(score) z v_key; stats = [max score,
// log Σ exp(score - max)] ([-inf, 0] and zeros at padded positions).
inline void reformer_forward_reference(const ReformerForwardArgs<double>& args) {
  using namespace reformer_detail;
  auto a = args;
  a.q_rows = a.q_rows.resolved(a.H, a.L, a.E);
  a.v_rows = a.v_rows.resolved(a.H, a.L, a.M);
  const RowStrides out_rows = a.out_rows.resolved(a.H, a.L, a.M);
  for (int64_t nh = 0; nh < a.N * a.H; ++nh) {
    const auto all = pairs(a, nh);
    for (int64_t i = 0; i < a.L; ++i) {
      double* out = out_rows.row(a.out, nh, a.H, i);
      std::fill_n(out, a.M, 0.0);
      double* st = a.stats + (nh * a.L + i) * 2;
      st[0] = -std::numeric_limits<double>::infinity(), st[1] = 0;
      if (all[i].empty()) continue;
      for (const auto& p : all[i]) st[0] = std::max(st[0], p.score);
      double sum = 0;
      for (const auto& p : all[i]) sum += std::exp(p.score - st[0]);
      st[1] = std::log(sum);
      for (const auto& p : all[i]) {
        const double w = std::exp(p.score - st[0]) / sum * drop_factor(a, nh, i, p);
        const double* v = a.v_rows.row(a.v, nh, a.H, p.key);
        for (int64_t m = 0; m < a.M; ++m) out[m] += w * v[m];
      }
    }
  }
}

// With P = exp(score - max - logsum) from the given stats and delta:
//   dS = P (z g_i·v_key - delta_i) for every pair but a masked self one;
//   grad_q_i += scale Σ dS k_key (the query role),
//   dk_key += scale dS q_i, reaching q_key through k = q / max(|q|, 1e-12):
//   grad_q_key += (dk - k (k·dk)) / |q_key|;  grad_v_key += P z g_i.
inline void reformer_backward_reference(const ReformerBackwardArgs<double>& args) {
  using namespace reformer_detail;
  auto a = args;
  a.q_rows = a.q_rows.resolved(a.H, a.L, a.E);
  a.v_rows = a.v_rows.resolved(a.H, a.L, a.M);
  const RowStrides g_rows = a.grad_out_rows.resolved(a.H, a.L, a.M);
  const RowStrides gq_rows = a.grad_q_rows.resolved(a.H, a.L, a.E);
  const RowStrides gv_rows = a.grad_v_rows.resolved(a.H, a.L, a.M);
  const int64_t E = a.E, M = a.M;
  for (int64_t nh = 0; nh < a.N * a.H; ++nh) {
    const auto all = pairs(a, nh);
    std::vector<double> dk(a.L * E, 0.0);
    for (int64_t l = 0; l < a.L; ++l) {
      std::fill_n(gq_rows.row(a.grad_q, nh, a.H, l), E, 0.0);
      std::fill_n(gv_rows.row(a.grad_v, nh, a.H, l), M, 0.0);
    }
    for (int64_t i = 0; i < a.L; ++i) {
      const double* st = a.stats + (nh * a.L + i) * 2;
      const double* q = a.q_rows.row(a.q, nh, a.H, i);
      const double* g = g_rows.row(a.grad_out, nh, a.H, i);
      double* gq = gq_rows.row(a.grad_q, nh, a.H, i);
      for (const auto& p : all[i]) {
        const double w = std::exp(p.score - st[0] - st[1]), z = drop_factor(a, nh, i, p);
        const double* v = a.v_rows.row(a.v, nh, a.H, p.key);
        double* gv = gv_rows.row(a.grad_v, nh, a.H, p.key);
        double g_v = 0;
        for (int64_t m = 0; m < M; ++m) {
          g_v += g[m] * v[m];
          gv[m] += w * z * g[m];
        }
        if (p.key == i && a.mask_self) continue;  // a constant score
        const double ds = w * (z * g_v - a.delta[nh * a.L + i]) * a.scale;
        const auto k = unit_key(a, nh, p.key);
        for (int64_t e = 0; e < E; ++e) {
          gq[e] += ds * k[e];
          dk[p.key * E + e] += ds * q[e];
        }
      }
    }
    for (int64_t j = 0; j < a.L; ++j) {
      const auto k = unit_key(a, nh, j);
      const double* q = a.q_rows.row(a.q, nh, a.H, j);
      double ss = 0, kd = 0;
      for (int64_t e = 0; e < E; ++e) ss += q[e] * q[e], kd += k[e] * dk[j * E + e];
      const double norm = std::max(std::sqrt(ss), 1e-12);
      double* gq = gq_rows.row(a.grad_q, nh, a.H, j);
      for (int64_t e = 0; e < E; ++e) gq[e] += (dk[j * E + e] - k[e] * kd) / norm;
    }
  }
}

}  // namespace fastattn::kernels
