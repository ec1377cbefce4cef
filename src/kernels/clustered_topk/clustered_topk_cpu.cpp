// CPU kernels of the per-query top-k attention of improved clustered
// attention (see clustered_topk.h).
//
// All queries of a cluster share its K keys, so the work is done per cluster:
// the queries of each (n, h) are sorted by cluster (counting sort), the
// cluster's keys and values are gathered once (keys packed for the
// register-blocked products of kernels/common/gemm.h), and its members are
// processed in blocks of up to kRows queries as small dense products:
//   forward   S = Q·Kᵀ (rows x K), softmax per row, out = mass · P·V;
//   backward  recompute P; dV += mass · Pᵀ·G; dP = mass · G·Vᵀ;
//             dS = P ∘ (dP - rowsum(P ∘ dP)) · scale; dQ = dS·K; dK += dSᵀ·Q;
//             d mass += Σ P ∘ (G·Vᵀ).
// Keys at index >= key length are dropped (score -inf); K is padded to the
// panel width with dropped columns. In the improved form each cluster first
// computes its centroid's weights on the gathered keys, its mass and its rest
// (centroid_weights); the backward then adds the rest's and the masses'
// gradients to the keys, values, centroids, lse and centroid outputs.
#include "kernels/clustered_topk/clustered_topk.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/common/isa_target.h"
#include "kernels/common/dropout_rows.h"
#include "kernels/common/gemm.h"
#include "kernels/common/parallel.h"
#include "kernels/common/simd.h"
#include "kernels/common/softmax_rows.h"

FASTATTN_ISA_BEGIN
namespace {

constexpr int64_t kRows = 96;  // queries per block (a multiple of the micro-kernel's 6)

// Valid queries of one (n, h) sorted by cluster: members of cluster c are
// order[start[c] .. start[c + 1]).
struct ClusterOrder {
  std::vector<int64_t> start, order;
  void build(const int64_t* assignments, int64_t L, int64_t C) {
    start.assign(C + 1, 0);
    for (int64_t l = 0; l < L; ++l)
      if (assignments[l] >= 0) ++start[assignments[l] + 1];
    for (int64_t c = 0; c < C; ++c) start[c + 1] += start[c];
    order.resize(start[C]);
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t l = 0; l < L; ++l)
      if (assignments[l] >= 0) order[next[assignments[l]]++] = l;
  }
};

template <typename T>
struct Scratch {
  ClusterOrder groups;
  std::vector<T> kp;       // (Kp, E) keys of the cluster, packed panels of Kᵀ
  std::vector<T> ks;       // (Kp, E) keys, row-major (backward: dQ = dS·K)
  std::vector<T> vs;       // (Kp, M) values, row-major
  std::vector<T> vp;       // (Kp, M) values, packed panels of Vᵀ (backward)
  std::vector<char> keep;  // (Kp) key kept
  std::vector<T> q, s, o;  // (kRows, E), (kRows, Kp), (kRows, M)
  // Backward: (kRows, M), (kRows, E), (Kp, kRows), (Kp, E), (Kp, M).
  std::vector<T> g, dq, pt, dk, dv;
  // Improved form: centroid weights (Kp), the rest and its gradient (M).
  std::vector<T> pc, rest, grest;
  // Dropout: the centroid's keep factors (Kp: 0 or the scale), and the
  // backward's dropped P (kRows, Kp).
  std::vector<T> zc, pd;
};

// A head's rows (of keys, values or their gradients): row j at at + j·sr.
template <typename T>
struct HeadRows {
  T* at;
  int64_t sr;
  T* row(int64_t j) const { return at + j * sr; }
};

// Head nh of x laid out as r (kernels/common/rows.h).
template <typename T>
HeadRows<T> head_rows(T* x, const RowStrides& r, int64_t nh, int64_t H) {
  return {r.head(x, nh, H), r.sr};
}

// Zeroes the rows (cols entries) of x's queries in no cluster (assignment -1,
// padding): the only rows the kernels do not write.
template <typename T>
void zero_unassigned(HeadRows<T> x, const int64_t* assignments, int64_t L, int64_t cols) {
  for (int64_t l = 0; l < L; ++l)
    if (assignments[l] < 0) std::fill(x.row(l), x.row(l) + cols, T(0));
}

// Gathers the cluster's keys (and values) into the scratch; returns the
// padded K. Dropped and padding columns have zero rows and keep = 0.
template <typename T>
int64_t gather_cluster(const int64_t* idx, int64_t K, int64_t len, HeadRows<const T> k,
                       HeadRows<const T> v, int64_t E, int64_t M, bool want_v_packed,
                       Scratch<T>& w) {
  constexpr int64_t NR = panel_width<T>();
  const int64_t Kp = round_up(K, NR);
  w.ks.assign(Kp * E, T(0));
  w.vs.assign(Kp * M, T(0));
  w.keep.assign(Kp, 0);
  for (int64_t t = 0; t < K; ++t) {
    if (idx[t] < 0 || idx[t] >= len) continue;
    w.keep[t] = 1;
    std::copy(k.row(idx[t]), k.row(idx[t]) + E, w.ks.data() + t * E);
    std::copy(v.row(idx[t]), v.row(idx[t]) + M, w.vs.data() + t * M);
  }
  w.kp.resize(Kp * E);
  pack_transposed_panels(w.ks.data(), Kp, E, E, Kp, w.kp.data());
  if (want_v_packed) {
    w.vp.resize(Kp * M);
    pack_transposed_panels(w.vs.data(), Kp, M, M, Kp, w.vp.data());
  }
  return Kp;
}

// P = softmax(scale · Q·Kᵀ) over the kept columns for `rows` queries whose
// rows are gathered in w.q; P in w.s (row stride Kp). A row keeping no key is
// all zeros.
template <typename T>
void block_softmax(int64_t rows, int64_t Kp, int64_t E, T scale, Scratch<T>& w) {
  gemm_packed(rows, Kp, E, w.q.data(), E, w.kp.data(), w.s.data(), Kp, false);
  for (int64_t r = 0; r < rows; ++r) {
    T* row = w.s.data() + r * Kp;
    for (int64_t t = 0; t < Kp; ++t) row[t] = w.keep[t] ? row[t] * scale : neg_inf<T>();
    const T mx = row_max(row, Kp);
    if (mx == neg_inf<T>()) {
      std::fill(row, row + Kp, T(0));
      continue;
    }
    const T inv = T(1) / exp_shift_sum(row, Kp, mx);
    for (int64_t t = 0; t < Kp; ++t) row[t] *= inv;
  }
}

// Dropout of member l's weights on the cluster's keys idx[0, K): row (or
// its dropped copy in out) kept and scaled, or zeroed.
template <typename T>
void drop_member_row(const ClusteredTopkParams<T>& a, int64_t nh, int64_t l, const int64_t* idx,
                     const T* row, T* out) {
  dropped_copy_at(row, a.K, dropout_row_key(a.dropout_seed, nh, l), idx, a.dropout_threshold,
                  T(a.dropout_scale), out);
}

// Improved form: the centroid's weights on the cluster's gathered keys,
// w.pc[t] = exp(scale·c·k_t - lse) (0 for dropped keys); returns their sum,
// the mass. With want_rest, w.rest = out_c - Σ_t pc[t]·zc[t]·v_t, zc the
// centroid row's dropout factors (1 without dropout; kept in w.zc).
template <typename T>
T centroid_weights(const ClusteredTopkParams<T>& a, int64_t nh, int64_t c, const int64_t* idx,
                   int64_t Kp, bool want_rest, Scratch<T>& w) {
  const int64_t E = a.E, M = a.M;
  const T* cen = a.centroids + (nh * a.C + c) * E;
  const T lse = a.lse[nh * a.C + c];
  w.pc.assign(Kp, T(0));
  T mass = 0;
  for (int64_t t = 0; t < Kp; ++t) {
    if (!w.keep[t]) continue;  // also every key when lse = -inf (no kept key)
    // <= 0 in exact arithmetic (lse is the log-sum-exp over these keys and
    // more); rounding at large scores (|s| ~ 1e10) must not push it to +inf.
    w.pc[t] = std::exp(std::min(T(0), a.scale * simd_dot(cen, w.ks.data() + t * E, E) - lse));
    mass += w.pc[t];
  }
  w.zc.assign(Kp, T(1));
  if (a.dropout_threshold) {
    const uint64_t seed = dropout_stream_seed(a.dropout_seed, kDropoutCentroidStream);
    dropped_copy_at(w.zc.data(), a.K, dropout_row_key(seed, nh, c), idx, a.dropout_threshold,
                    T(a.dropout_scale), w.zc.data());
  }
  if (want_rest) {
    const T* oc = a.out_c + (nh * a.C + c) * M;
    w.rest.assign(oc, oc + M);
    for (int64_t t = 0; t < Kp; ++t) {
      const T f = w.pc[t] * w.zc[t];
      if (f == T(0)) continue;
      for (int64_t x = 0; x < M; ++x) w.rest[x] -= f * w.vs[t * M + x];
    }
  }
  return mass;
}

// Rows rows[0..n) of src (D entries each) into dst, D apart.
template <typename T>
void gather_rows(HeadRows<const T> src, int64_t D, const int64_t* rows, int64_t n, T* dst) {
  for (int64_t r = 0; r < n; ++r) std::copy(src.row(rows[r]), src.row(rows[r]) + D, dst + r * D);
}

// A cluster of one query (exact-topk, causal-improved-clustered: one key set
// per query): the softmax weights of its K keys, read in place (no gather or
// packing), into p[0, K); dropped keys (-1, past len) get 0. Returns false
// when no key is kept (the row is zeros).
template <typename T>
bool single_query_weights(const T* qrow, const int64_t* idx, int64_t K, int64_t len,
                          HeadRows<const T> k, int64_t E, T scale, T* p) {
  T mx = neg_inf<T>();
  for (int64_t t = 0; t < K; ++t) {
    p[t] = idx[t] >= 0 && idx[t] < len ? scale * simd_dot(qrow, k.row(idx[t]), E) : neg_inf<T>();
    mx = std::max(mx, p[t]);
  }
  if (mx == neg_inf<T>()) {
    std::fill(p, p + K, T(0));
    return false;
  }
  T sum = 0;
  for (int64_t t = 0; t < K; ++t) sum += p[t] = p[t] == neg_inf<T>() ? T(0) : std::exp(p[t] - mx);
  const T inv = T(1) / sum;
  for (int64_t t = 0; t < K; ++t) p[t] *= inv;
  return true;
}

// out (M) = m · Σ_t p_t v_{idx[t]} (written); with dropout (a's), p_t
// dropped by query l's row of the mask.
template <typename T>
void single_query_forward(const ClusteredTopkParams<T>& a, int64_t nh, int64_t l, const T* qrow,
                          const int64_t* idx, int64_t K, int64_t len, HeadRows<const T> k,
                          HeadRows<const T> v, int64_t E, int64_t M, T scale, T m, T* p, T* out) {
  std::fill(out, out + M, T(0));
  if (!single_query_weights(qrow, idx, K, len, k, E, scale, p)) return;
  if (a.dropout_threshold) drop_member_row(a, nh, l, idx, p, p);
  for (int64_t t = 0; t < K; ++t) {
    if (p[t] == T(0)) continue;
    const T w = m * p[t];
    const T* vt = v.row(idx[t]);
    for (int64_t x = 0; x < M; ++x) out[x] += w * vt[x];
  }
}

// The single query's gradients: grad_q's row written, grad_k and grad_v's
// rows added to in place; returns d mass = Σ_t pd_t (g·v_t), pd the weights
// the forward used (p, or p dropped by query l's row of the mask, into pd).
template <typename T>
T single_query_backward(const ClusteredTopkParams<T>& a, int64_t nh, int64_t l, const T* qrow,
                        const T* grow, const int64_t* idx, int64_t K, int64_t len,
                        HeadRows<const T> k, HeadRows<const T> v, int64_t E, int64_t M, T scale,
                        T m, T* p, T* pd, T* gv, T* gq_row, HeadRows<T> gk, HeadRows<T> gvals) {
  std::fill(gq_row, gq_row + E, T(0));
  if (!single_query_weights(qrow, idx, K, len, k, E, scale, p)) return T(0);
  if (a.dropout_threshold)
    drop_member_row(a, nh, l, idx, p, pd);
  else
    pd = p;
  T row_dot = 0;
  for (int64_t t = 0; t < K; ++t) {
    gv[t] = p[t] == T(0) ? T(0) : simd_dot(grow, v.row(idx[t]), M);
    row_dot += pd[t] * gv[t];
  }
  for (int64_t t = 0; t < K; ++t) {
    if (p[t] == T(0)) continue;
    const T ds = (pd[t] * gv[t] - p[t] * row_dot) * m * scale;
    const T* kt = k.row(idx[t]);
    T* dk = gk.row(idx[t]);
    for (int64_t x = 0; x < E; ++x) {
      gq_row[x] += ds * kt[x];
      dk[x] += ds * qrow[x];
    }
    const T w = m * pd[t];
    T* dv = gvals.row(idx[t]);
    for (int64_t x = 0; x < M; ++x) dv[x] += w * grow[x];
  }
  return row_dot;
}

}  // namespace

template <typename T>
void clustered_topk_forward_cpu(const ClusteredTopkForwardArgs<T>& args) {
  ClusteredTopkForwardArgs<T> a = args;
  resolve_qkv_rows(a);
  a.out_rows = a.out_rows.resolved(a.H, a.L, a.M);
  const int64_t H = a.H, L = a.L, S = a.S, E = a.E, M = a.M, C = a.C, K = a.K;
  constexpr int64_t NR = panel_width<T>();
  const int64_t Kp_max = round_up(K, NR);
  parallel_items<Scratch<T>>(
      a.N * H, a.num_threads,
      [&](Scratch<T>& w) {
        w.q.resize(kRows * E);
        w.s.resize(kRows * Kp_max);
        w.o.resize(kRows * M);
      },
      [&](int64_t nh, Scratch<T>& w) {
        const int64_t len = a.key_lengths ? a.key_lengths[nh / H] : S;
        const auto q = head_rows(a.q, a.q_rows, nh, H);
        const auto k = head_rows(a.k, a.k_rows, nh, H);
        const auto v = head_rows(a.v, a.v_rows, nh, H);
        const auto out = head_rows(a.out, a.out_rows, nh, H);
        // Every member's row is written below; padded queries' stay zero.
        zero_unassigned(out, a.assignments + nh * L, L, M);
        w.groups.build(a.assignments + nh * L, L, C);
        const bool improved = a.centroids != nullptr;
        for (int64_t c = 0; c < C; ++c) {
          const int64_t b = w.groups.start[c], e = w.groups.start[c + 1];
          if (b == e) continue;
          if (e - b == 1 && !improved) {
            const int64_t l = w.groups.order[b];
            single_query_forward(a, nh, l, q.row(l), a.topk + (nh * C + c) * K, K, len, k, v, E, M,
                                 a.scale, a.mass[nh * C + c], w.s.data(), out.row(l));
            continue;
          }
          const int64_t* idx = a.topk + (nh * C + c) * K;
          const int64_t Kp = gather_cluster(idx, K, len, k, v, E, M, false, w);
          const T m = improved ? centroid_weights(a, nh, c, idx, Kp, true, w) : a.mass[nh * C + c];
          for (int64_t r0 = b; r0 < e; r0 += kRows) {
            const int64_t rows = std::min(kRows, e - r0);
            const int64_t* members = w.groups.order.data() + r0;
            gather_rows(q, E, members, rows, w.q.data());
            block_softmax(rows, Kp, E, a.scale, w);
            if (a.dropout_threshold) {  // the weights of the output (mass stays undropped)
              for (int64_t r = 0; r < rows; ++r) {
                T* row = w.s.data() + r * Kp;
                drop_member_row(a, nh, members[r], idx, row, row);
              }
            }
            gemm(rows, M, Kp, w.s.data(), Kp, w.vs.data(), M, w.o.data(), M, false);
            for (int64_t r = 0; r < rows; ++r) {
              T* dst = out.row(members[r]);
              const T* src = w.o.data() + r * M;
              if (improved) {
                for (int64_t x = 0; x < M; ++x) dst[x] = m * src[x] + w.rest[x];
              } else {
                for (int64_t x = 0; x < M; ++x) dst[x] = m * src[x];
              }
            }
          }
        }
      });
}

template <typename T>
void clustered_topk_backward_cpu(const ClusteredTopkBackwardArgs<T>& args) {
  ClusteredTopkBackwardArgs<T> a = args;
  resolve_qkv_rows(a);
  resolve_grad_rows(a);
  const int64_t H = a.H, L = a.L, S = a.S, E = a.E, M = a.M, C = a.C, K = a.K;
  constexpr int64_t NR = panel_width<T>();
  const int64_t Kp_max = round_up(K, NR);
  parallel_items<Scratch<T>>(
      a.N * H, a.num_threads,
      [&](Scratch<T>& w) {
        w.q.resize(kRows * E);
        w.s.resize(kRows * Kp_max);
        w.o.resize(kRows * Kp_max);  // G·Vᵀ
        w.g.resize(kRows * M);
        w.dq.resize(kRows * E);
        w.pt.resize(Kp_max * kRows);
        w.dk.resize(Kp_max * E);
        w.dv.resize(Kp_max * M);
        if (a.dropout_threshold) w.pd.resize(kRows * Kp_max);
      },
      [&](int64_t nh, Scratch<T>& w) {
        const int64_t len = a.key_lengths ? a.key_lengths[nh / H] : S;
        const auto q = head_rows(a.q, a.q_rows, nh, H);
        const auto k = head_rows(a.k, a.k_rows, nh, H);
        const auto v = head_rows(a.v, a.v_rows, nh, H);
        const auto g = head_rows(a.grad_out, a.grad_out_rows, nh, H);
        const auto gq = head_rows(a.grad_q, a.grad_q_rows, nh, H);
        const auto gk = head_rows(a.grad_k, a.grad_k_rows, nh, H);
        const auto gv = head_rows(a.grad_v, a.grad_v_rows, nh, H);
        const bool improved = a.centroids != nullptr;
        zero_unassigned(gq, a.assignments + nh * L, L, E);
        for (int64_t j = 0; j < S; ++j) {  // the keys' gradients are sums over clusters
          stream_zero(gk.row(j), E);
          stream_zero(gv.row(j), M);
        }
        stream_fence();
        if (improved) {
          std::fill(a.grad_centroids + nh * C * E, a.grad_centroids + (nh + 1) * C * E, T(0));
          std::fill(a.grad_lse + nh * C, a.grad_lse + (nh + 1) * C, T(0));
          std::fill(a.grad_out_c + nh * C * M, a.grad_out_c + (nh + 1) * C * M, T(0));
        } else {
          std::fill(a.grad_mass + nh * C, a.grad_mass + (nh + 1) * C, T(0));
        }
        w.groups.build(a.assignments + nh * L, L, C);
        for (int64_t c = 0; c < C; ++c) {
          const int64_t b = w.groups.start[c], e = w.groups.start[c + 1];
          if (b == e) continue;
          const int64_t* idx = a.topk + (nh * C + c) * K;
          if (e - b == 1 && !improved) {
            const int64_t l = w.groups.order[b];
            a.grad_mass[nh * C + c] = single_query_backward(
                a, nh, l, q.row(l), g.row(l), idx, K, len, k, v, E, M, a.scale, a.mass[nh * C + c],
                w.s.data(), w.pd.data(), w.o.data(), gq.row(l), gk, gv);
            continue;
          }
          const int64_t Kp = gather_cluster(idx, K, len, k, v, E, M, true, w);
          const T m = improved ? centroid_weights(a, nh, c, idx, Kp, false, w) : a.mass[nh * C + c];
          std::fill(w.dk.begin(), w.dk.begin() + Kp * E, T(0));
          std::fill(w.dv.begin(), w.dv.begin() + Kp * M, T(0));
          if (improved) w.grest.assign(M, T(0));
          T g_mass = 0;
          for (int64_t r0 = b; r0 < e; r0 += kRows) {
            const int64_t rows = std::min(kRows, e - r0);
            const int64_t* members = w.groups.order.data() + r0;
            gather_rows(q, E, members, rows, w.q.data());
            gather_rows(g, M, members, rows, w.g.data());
            if (improved) {  // the rest reaches every member: its gradient sums theirs
              for (int64_t r = 0; r < rows; ++r)
                for (int64_t x = 0; x < M; ++x) w.grest[x] += w.g[r * M + x];
            }
            block_softmax(rows, Kp, E, a.scale, w);
            // With dropout, the output's weights Pd = P ∘ Z / (1 - p) (the
            // forward's mask, regenerated): d mass = Σ Pd ∘ gv, dS = (Pd ∘ gv
            // - P·row_dot)·m·scale, dV += m·Pdᵀ·G.
            const T* pw = w.s.data();
            if (a.dropout_threshold) {
              for (int64_t r = 0; r < rows; ++r) {
                T* pd = w.pd.data() + r * Kp;
                drop_member_row(a, nh, members[r], idx, w.s.data() + r * Kp, pd);
                std::fill(pd + K, pd + Kp, T(0));
              }
              pw = w.pd.data();
            }
            // gv_t = G·Vᵀ; d mass = Σ Pd ∘ gv; dP = m · gv.
            gemm_packed(rows, Kp, M, w.g.data(), M, w.vp.data(), w.o.data(), Kp, false);
            for (int64_t r = 0; r < rows; ++r) {
              const T* p = w.s.data() + r * Kp;
              const T* pd = pw + r * Kp;
              T* dp = w.o.data() + r * Kp;
              T row_dot = 0;
              for (int64_t t = 0; t < Kp; ++t) row_dot += pd[t] * dp[t];
              g_mass += row_dot;
              // dS = (Pd ∘ m·gv - P·m·row_dot) · scale, written over gv.
              const T f = m * a.scale;
              if (pd == p) {
                for (int64_t t = 0; t < Kp; ++t) dp[t] = p[t] * (dp[t] - row_dot) * f;
              } else {
                for (int64_t t = 0; t < Kp; ++t) dp[t] = (pd[t] * dp[t] - p[t] * row_dot) * f;
              }
            }
            // dV += m · Pdᵀ·G (m applied to G's copy below via Pdᵀ scaling).
            transpose(pw, rows, Kp, Kp, w.pt.data(), rows);
            for (int64_t x = 0; x < Kp * rows; ++x) w.pt[x] *= m;
            gemm(Kp, M, rows, w.pt.data(), rows, w.g.data(), M, w.dv.data(), M, true);
            // dQ = dS·K, scattered to the members.
            gemm(rows, E, Kp, w.o.data(), Kp, w.ks.data(), E, w.dq.data(), E, false);
            for (int64_t r = 0; r < rows; ++r)
              std::copy(w.dq.data() + r * E, w.dq.data() + r * E + E, gq.row(members[r]));
            // dK += dSᵀ·Q.
            transpose(w.o.data(), rows, Kp, Kp, w.pt.data(), rows);
            gemm(Kp, E, rows, w.pt.data(), rows, w.q.data(), E, w.dk.data(), E, true);
          }
          if (improved) {
            // rest = out_c - Σ p_t z_t v_t, mass = Σ p_t, p_t = exp(scale·c·k_t - lse),
            // z_t the centroid row's dropout factor (1 without): d p_t = g_mass -
            // z_t g_rest·v_t; d s_t = p_t · d p_t; d lse = -Σ d s_t;
            // d c = scale Σ d s_t k_t; d k_t += scale · d s_t · c; d v_t -= p_t z_t g_rest.
            const T* cen = a.centroids + (nh * C + c) * E;
            T* gcen = a.grad_centroids + (nh * C + c) * E;
            std::copy(w.grest.begin(), w.grest.end(), a.grad_out_c + (nh * C + c) * M);
            T g_lse = 0;
            for (int64_t t = 0; t < Kp; ++t) {
              if (w.pc[t] == T(0)) continue;
              const T* vt = w.vs.data() + t * M;
              const T z = w.zc[t], pz = w.pc[t] * z;
              T gr = 0;
              for (int64_t x = 0; x < M; ++x) {
                gr += w.grest[x] * vt[x];
                w.dv[t * M + x] -= pz * w.grest[x];
              }
              const T gs = (g_mass - z * gr) * w.pc[t];
              g_lse -= gs;
              for (int64_t x = 0; x < E; ++x) {
                gcen[x] += a.scale * gs * w.ks[t * E + x];
                w.dk[t * E + x] += a.scale * gs * cen[x];
              }
            }
            a.grad_lse[nh * C + c] = g_lse;
          } else {
            a.grad_mass[nh * C + c] = g_mass;
          }
          for (int64_t t = 0; t < K; ++t) {
            if (!w.keep[t]) continue;
            T* dk_row = gk.row(idx[t]);
            T* dv_row = gv.row(idx[t]);
            for (int64_t x = 0; x < E; ++x) dk_row[x] += w.dk[t * E + x];
            for (int64_t x = 0; x < M; ++x) dv_row[x] += w.dv[t * M + x];
          }
        }
      });
}

template <typename T>
void cluster_means_cpu(const ClusterMeansArgs<T>& args) {
  ClusterMeansArgs<T> a = args;
  a.q_rows = a.q_rows.resolved(a.H, a.L, a.E);
  const int64_t L = a.L, C = a.C, E = a.E;
  parallel_for_items(a.NH, a.num_threads, [&](int64_t nh) {
    T* cen = a.centroids + nh * C * E;
    std::fill(cen, cen + C * E, T(0));
    const T* q = a.q_rows.head(a.q, nh, a.H);
    for (int64_t l = 0; l < L; ++l) {
      prefetch_ahead(q, l, L, E, a.q_rows.sr);
      const int64_t c = a.assignments[nh * L + l];
      if (c < 0) continue;
      const T* src = q + l * a.q_rows.sr;
      for (int64_t x = 0; x < E; ++x) cen[c * E + x] += src[x];
    }
    if (!a.mean) return;
    for (int64_t c = 0; c < C; ++c) {
      const T inv = T(1) / static_cast<T>(std::max<int64_t>(1, a.counts[nh * C + c]));
      for (int64_t x = 0; x < E; ++x) cen[c * E + x] *= inv;
    }
  });
}

template <typename T>
void spread_centroids_cpu(const CentroidSpreadArgs<T>& args) {
  CentroidSpreadArgs<T> a = args;
  a.dst_rows = a.dst_rows.resolved(a.H, a.L, a.E);
  const int64_t L = a.L, C = a.C, E = a.E;
  parallel_for_items(a.NH, a.num_threads, [&](int64_t nh) {
    T* head = a.dst_rows.head(a.dst, nh, a.H);
    for (int64_t l = 0; l < L; ++l) {
      if (a.accumulate) prefetch_ahead(head, l, L, E, a.dst_rows.sr, /*write=*/true);
      const int64_t c = a.assignments[nh * L + l];
      T* dst = head + l * a.dst_rows.sr;
      if (c < 0) {
        if (!a.accumulate) std::fill(dst, dst + E, T(0));
        continue;
      }
      const T* src = a.table + (nh * C + c) * E;
      const T inv =
          a.divide ? T(1) / static_cast<T>(std::max<int64_t>(1, a.counts[nh * C + c])) : T(1);
      if (a.accumulate) {
        for (int64_t x = 0; x < E; ++x) dst[x] += inv * src[x];
      } else {
        stream_scaled(src, inv, dst, E);
      }
    }
    stream_fence();
  });
}

FASTATTN_ISA_END

FASTATTN_CPU_KERNEL(cluster_means_cpu, ClusterMeansArgs)
FASTATTN_CPU_KERNEL(spread_centroids_cpu, CentroidSpreadArgs)
FASTATTN_CPU_KERNEL(clustered_topk_forward_cpu, ClusteredTopkForwardArgs)
FASTATTN_CPU_KERNEL(clustered_topk_backward_cpu, ClusteredTopkBackwardArgs)
