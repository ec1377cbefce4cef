// The plain reference of the AFT-simple scan kernels (aft.h): scalar loops
// over the same argument struct, in float64, on one thread, O(L·S·E) per
// head (no scan, no running maximum), from eq. 2 of Zhai et al. 2021 with
// w = 0. The backward derives from q, k, v and grad_out alone (it reads
// neither a_in nor lse_in). tests/cpp/test_kernel_references.cpp holds the CPU
// kernels at every instruction-set level to it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kernels/aft/aft.h"

namespace fastattn::kernels {

namespace aft_detail {

// The last key position of query t, or -1 without keys.
inline int64_t last_key(const AftScanArgs<double>& p, int64_t n, int64_t t) {
  const int64_t len = p.key_lengths ? p.key_lengths[n] : p.S;
  return p.causal ? std::min(t + p.S - p.L, len - 1) : len - 1;
}

inline double sigmoid(double x) { return 1 / (1 + std::exp(-x)); }

// a and lse of query t, channel c, over the keys 0..last.
inline void softmax_average(const AftScanArgs<double>& p, int64_t nh, int64_t last, int64_t c,
                            double* a, double* lse) {
  const double* k = p.k + nh * p.S * p.E;
  const double* v = p.v + nh * p.S * p.E;
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t s = 0; s <= last; ++s) m = std::max(m, k[s * p.E + c]);
  if (last < 0) {
    *a = 0;
    *lse = m;
    return;
  }
  double num = 0, den = 0;
  for (int64_t s = 0; s <= last; ++s) {
    const double w = std::exp(k[s * p.E + c] - m);
    num += w * v[s * p.E + c];
    den += w;
  }
  *a = num / den;
  *lse = m + std::log(den);
}

}  // namespace aft_detail

// out_t = sigmoid(q_t) ⊙ a_t, a_t = sum_s exp(k_s) ⊙ v_s / sum_s exp(k_s)
// per channel over the keys of t; zeros (lse -inf) without keys. a and lse
// where given.
inline void aft_scan_forward_reference(const AftScanArgs<double>& p) {
  using namespace aft_detail;
  for (int64_t nh = 0; nh < p.N * p.H; ++nh)
    for (int64_t t = 0; t < p.L; ++t) {
      const int64_t last = last_key(p, nh / p.H, t);
      for (int64_t c = 0; c < p.E; ++c) {
        const int64_t x = (nh * p.L + t) * p.E + c;
        double a, lse;
        softmax_average(p, nh, last, c, &a, &lse);
        p.out[x] = sigmoid(p.q[x]) * a;
        if (p.a) p.a[x] = a;
        if (p.lse) p.lse[x] = lse;
      }
    }
}

// With da_t = grad_out_t ⊙ sigmoid(q_t) and P_ts = exp(k_s - lse_t):
//   grad_q_t = grad_out_t ⊙ a_t ⊙ sigmoid(q_t) (1 - sigmoid(q_t)),
//   grad_v_s = sum_t da_t P_ts,  grad_k_s = sum_t da_t (v_s - a_t) P_ts,
// over the queries t whose keys include s.
inline void aft_scan_backward_reference(const AftScanArgs<double>& p) {
  using namespace aft_detail;
  const int64_t E = p.E;
  for (int64_t nh = 0; nh < p.N * p.H; ++nh) {
    const double* k = p.k + nh * p.S * E;
    const double* v = p.v + nh * p.S * E;
    double* gk = p.grad_k + nh * p.S * E;
    double* gv = p.grad_v + nh * p.S * E;
    for (int64_t x = 0; x < p.S * E; ++x) gk[x] = gv[x] = 0;
    for (int64_t t = 0; t < p.L; ++t) {
      const int64_t last = last_key(p, nh / p.H, t);
      for (int64_t c = 0; c < E; ++c) {
        const int64_t x = (nh * p.L + t) * E + c;
        double a, lse;
        softmax_average(p, nh, last, c, &a, &lse);
        const double sq = sigmoid(p.q[x]);
        p.grad_q[x] = p.grad_out[x] * a * sq * (1 - sq);
        const double da = p.grad_out[x] * sq;
        for (int64_t s = 0; s <= last; ++s) {
          const double w = std::exp(k[s * E + c] - lse);
          gv[s * E + c] += da * w;
          gk[s * E + c] += da * (v[s * E + c] - a) * w;
        }
      }
    }
  }
}

}  // namespace fastattn::kernels
