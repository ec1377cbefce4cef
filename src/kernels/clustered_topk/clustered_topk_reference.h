// The plain reference of the clustered top-k kernels (clustered_topk.h):
// scalar loops over the same argument structs, in float64, on one thread,
// one query at a time (no sort by cluster, no gathered panels, no blocks),
// both forms and the fused dropout (the same counter-based keep mask:
// kernels/common/dropout.h). tests/cpp/test_kernel_references.cpp holds the
// CPU kernels at every instruction-set level to it,
// tests/cuda_emu/test_clustered_topk.cpp the CUDA kernels.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/clustered_topk/clustered_topk.h"
#include "kernels/common/softmax_reference.h"

namespace fastattn::kernels {

namespace clustered_topk_detail {

using P = ClusteredTopkParams<double>;

using reference::dot;

// The dropout factor of key `key` in the row with key `row_key`.
inline double drop_factor(const P& a, uint64_t row_key, int64_t key) {
  return reference::dropout_factor(a.dropout_threshold, a.dropout_scale, row_key, key);
}

// Cluster c of head nh: its kept keys (slot t -> key index, -1 if dropped)
// and, in the improved form, the centroid's weights pc, their sum (the
// mass) and the centroid row's dropout factors zc.
struct Cluster {
  std::vector<int64_t> key;
  std::vector<double> pc, zc;
  double mass = 0;
};

inline Cluster cluster(const P& a, int64_t nh, int64_t c) {
  const int64_t len = a.key_lengths ? a.key_lengths[nh / a.H] : a.S;
  Cluster cl;
  cl.key.assign(a.K, -1);
  cl.pc.assign(a.K, 0.0);
  cl.zc.assign(a.K, 1.0);
  const uint64_t centroid_row =
      dropout_row_key(dropout_stream_seed(a.dropout_seed, kDropoutCentroidStream), nh, c);
  for (int64_t t = 0; t < a.K; ++t) {
    const int64_t j = a.topk[(nh * a.C + c) * a.K + t];
    if (j < 0 || j >= len) continue;
    cl.key[t] = j;
    cl.zc[t] = drop_factor(a, centroid_row, j);
  }
  if (!a.centroids) {
    cl.mass = a.mass[nh * a.C + c];
    return cl;
  }
  const double* cen = a.centroids + (nh * a.C + c) * a.E;
  for (int64_t t = 0; t < a.K; ++t) {
    if (cl.key[t] < 0) continue;
    const double* k = a.k_rows.row(a.k, nh, a.H, cl.key[t]);
    cl.pc[t] = std::exp(std::min(0.0, a.scale * dot(cen, k, a.E) - a.lse[nh * a.C + c]));
    cl.mass += cl.pc[t];
  }
  return cl;
}

// softmax_t(scale·q·k_t) over the cluster's kept keys (zeros without any).
inline std::vector<double> weights(const P& a, int64_t nh, const double* q, const Cluster& cl) {
  std::vector<double> s(a.K, -std::numeric_limits<double>::infinity());
  double mx = -std::numeric_limits<double>::infinity();
  for (int64_t t = 0; t < a.K; ++t) {
    if (cl.key[t] < 0) continue;
    s[t] = a.scale * dot(q, a.k_rows.row(a.k, nh, a.H, cl.key[t]), a.E);
    mx = std::max(mx, s[t]);
  }
  double sum = 0;
  for (auto& x : s) sum += (x = std::isinf(mx) || std::isinf(x) ? 0.0 : std::exp(x - mx));
  if (sum > 0)
    for (auto& x : s) x /= sum;
  return s;
}

}  // namespace clustered_topk_detail

// out_l = mass_j · Σ_t P_lt z_lt v_t (+ rest_j = out_c_j - Σ_t pc_t zc_t v_t in
// the improved form), j = assignments[l]; zeros for padded queries.
inline void clustered_topk_forward_reference(const ClusteredTopkForwardArgs<double>& args) {
  using namespace clustered_topk_detail;
  auto a = args;
  resolve_qkv_rows(a);
  const RowStrides out_rows = a.out_rows.resolved(a.H, a.L, a.M);
  for (int64_t nh = 0; nh < a.N * a.H; ++nh)
    for (int64_t l = 0; l < a.L; ++l) {
      double* out = out_rows.row(a.out, nh, a.H, l);
      std::fill(out, out + a.M, 0.0);
      const int64_t c = a.assignments[nh * a.L + l];
      if (c < 0) continue;
      const Cluster cl = cluster(a, nh, c);
      const auto p = weights(a, nh, a.q_rows.row(a.q, nh, a.H, l), cl);
      const uint64_t row = dropout_row_key(a.dropout_seed, nh, l);
      for (int64_t t = 0; t < a.K; ++t) {
        if (cl.key[t] < 0) continue;
        const double* v = a.v_rows.row(a.v, nh, a.H, cl.key[t]);
        const double w = cl.mass * p[t] * drop_factor(a, row, cl.key[t]) -
                         (a.centroids ? cl.pc[t] * cl.zc[t] : 0.0);
        for (int64_t m = 0; m < a.M; ++m) out[m] += w * v[m];
      }
      if (a.centroids)
        for (int64_t m = 0; m < a.M; ++m) out[m] += a.out_c[(nh * a.C + c) * a.M + m];
    }
}

// With g_l = grad_out_l, o_l = Σ_t P_lt z_lt v_t and m the cluster's mass:
//   grad_v_t += m P_lt z_lt g_l,  dS_lt = m·scale·P_lt (z_lt g_l·v_t - g_l·o_l),
//   grad_q_l = Σ_t dS_lt k_t,  grad_k_t += dS_lt q_l,  d m += g_l·o_l;
// the plain form's grad_mass is d m; the improved form's, with
// g_rest = Σ_l g_l over the members (= grad_out_c) and
// d pc_t = d m - zc_t g_rest·v_t, gs_t = pc_t d pc_t:
//   grad_lse = -Σ_t gs_t, grad_centroids = scale Σ_t gs_t k_t,
//   grad_k_t += scale gs_t c, grad_v_t -= pc_t zc_t g_rest.
inline void clustered_topk_backward_reference(const ClusteredTopkBackwardArgs<double>& args) {
  using namespace clustered_topk_detail;
  auto a = args;
  resolve_qkv_rows(a);
  resolve_grad_rows(a);
  const int64_t E = a.E, M = a.M, C = a.C;
  const bool improved = a.centroids != nullptr;
  for (int64_t nh = 0; nh < a.N * a.H; ++nh) {
    for (int64_t l = 0; l < a.L; ++l) std::fill_n(a.grad_q_rows.row(a.grad_q, nh, a.H, l), E, 0.0);
    for (int64_t j = 0; j < a.S; ++j) {
      std::fill_n(a.grad_k_rows.row(a.grad_k, nh, a.H, j), E, 0.0);
      std::fill_n(a.grad_v_rows.row(a.grad_v, nh, a.H, j), M, 0.0);
    }
    for (int64_t c = 0; c < C; ++c) {
      const Cluster cl = cluster(a, nh, c);
      std::vector<double> g_rest(M, 0.0);
      double g_mass = 0;
      for (int64_t l = 0; l < a.L; ++l) {
        if (a.assignments[nh * a.L + l] != c) continue;
        const double* q = a.q_rows.row(a.q, nh, a.H, l);
        const double* g = a.grad_out_rows.row(a.grad_out, nh, a.H, l);
        const auto p = weights(a, nh, q, cl);
        const uint64_t row = dropout_row_key(a.dropout_seed, nh, l);
        std::vector<double> z(a.K), gv(a.K, 0.0);
        double g_o = 0;
        for (int64_t t = 0; t < a.K; ++t) {
          if (cl.key[t] < 0) continue;
          z[t] = drop_factor(a, row, cl.key[t]);
          gv[t] = dot(g, a.v_rows.row(a.v, nh, a.H, cl.key[t]), M);
          g_o += p[t] * z[t] * gv[t];
        }
        g_mass += g_o;
        for (int64_t m = 0; m < M; ++m) g_rest[m] += g[m];
        double* gq = a.grad_q_rows.row(a.grad_q, nh, a.H, l);
        for (int64_t t = 0; t < a.K; ++t) {
          if (cl.key[t] < 0) continue;
          const double ds = cl.mass * a.scale * p[t] * (z[t] * gv[t] - g_o);
          const double* k = a.k_rows.row(a.k, nh, a.H, cl.key[t]);
          double* gk = a.grad_k_rows.row(a.grad_k, nh, a.H, cl.key[t]);
          double* gvr = a.grad_v_rows.row(a.grad_v, nh, a.H, cl.key[t]);
          for (int64_t e = 0; e < E; ++e) {
            gq[e] += ds * k[e];
            gk[e] += ds * q[e];
          }
          for (int64_t m = 0; m < M; ++m) gvr[m] += cl.mass * p[t] * z[t] * g[m];
        }
      }
      if (!improved) {
        a.grad_mass[nh * C + c] = g_mass;
        continue;
      }
      const double* cen = a.centroids + (nh * C + c) * E;
      double* gcen = a.grad_centroids + (nh * C + c) * E;
      std::fill_n(gcen, E, 0.0);
      std::copy(g_rest.begin(), g_rest.end(), a.grad_out_c + (nh * C + c) * M);
      double g_lse = 0;
      for (int64_t t = 0; t < a.K; ++t) {
        if (cl.key[t] < 0) continue;
        const double* v = a.v_rows.row(a.v, nh, a.H, cl.key[t]);
        const double gs = cl.pc[t] * (g_mass - cl.zc[t] * dot(g_rest.data(), v, M));
        g_lse -= gs;
        const double* k = a.k_rows.row(a.k, nh, a.H, cl.key[t]);
        double* gk = a.grad_k_rows.row(a.grad_k, nh, a.H, cl.key[t]);
        double* gvr = a.grad_v_rows.row(a.grad_v, nh, a.H, cl.key[t]);
        for (int64_t e = 0; e < E; ++e) {
          gcen[e] += a.scale * gs * k[e];
          gk[e] += a.scale * gs * cen[e];
        }
        for (int64_t m = 0; m < M; ++m) gvr[m] -= cl.pc[t] * cl.zc[t] * g_rest[m];
      }
      a.grad_lse[nh * C + c] = g_lse;
    }
  }
}

// centroids[c] = the mean (mean = false: the sum) of cluster c's member rows;
// zeros for an empty cluster.
inline void cluster_means_reference(const ClusterMeansArgs<double>& a) {
  const RowStrides q_rows = a.q_rows.resolved(a.H, a.L, a.E);
  for (int64_t nh = 0; nh < a.NH; ++nh)
    for (int64_t c = 0; c < a.C; ++c) {
      double* out = a.centroids + (nh * a.C + c) * a.E;
      std::fill_n(out, a.E, 0.0);
      int64_t members = 0;
      for (int64_t l = 0; l < a.L; ++l) {
        if (a.assignments[nh * a.L + l] != c) continue;
        ++members;
        const double* q = q_rows.row(a.q, nh, a.H, l);
        for (int64_t e = 0; e < a.E; ++e) out[e] += q[e];
      }
      if (a.mean && members > 0)
        for (int64_t e = 0; e < a.E; ++e) out[e] /= static_cast<double>(members);
    }
}

// dst_l (+)= table[a_l] (/ counts[a_l] with divide) for members; padded rows
// zeroed, or left alone when accumulating.
inline void spread_centroids_reference(const CentroidSpreadArgs<double>& a) {
  const RowStrides dst_rows = a.dst_rows.resolved(a.H, a.L, a.E);
  for (int64_t nh = 0; nh < a.NH; ++nh)
    for (int64_t l = 0; l < a.L; ++l) {
      double* dst = dst_rows.row(a.dst, nh, a.H, l);
      const int64_t c = a.assignments[nh * a.L + l];
      if (!a.accumulate) std::fill_n(dst, a.E, 0.0);
      if (c < 0) continue;
      const double d = a.divide ? static_cast<double>(a.counts[nh * a.C + c]) : 1.0;
      for (int64_t e = 0; e < a.E; ++e) dst[e] += a.table[(nh * a.C + c) * a.E + e] / d;
    }
}

}  // namespace fastattn::kernels
