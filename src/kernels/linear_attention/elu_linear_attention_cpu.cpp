// CPU kernels of the fused elu linear attention (see elu_linear_attention.h).
// Work items are (n, a group of heads) in the causal passes (for_each_item), (n, a group of heads,
// a block of rows) in the non-causal ones (for_each_block); every product is a register-blocked
// tile gemm of kernels/common/gemm.h. Tiles (C rows): qf = phi(Q_c), kf = phi(K_c) with padded rows
// zeroed, their transposes, gn / gd (the output gradient scaled by the normaliser), and a C×C score
// tile.
//
// bfloat16 operands (T = Bf16) are read and written by the kernels themselves, the arithmetic in
// float32 (F below): each chunk's rows are widened into float32 tiles as a pass needs them and the
// outputs computed in float32 tiles, rounded into their rows at the end of the chunk. The float32
// code runs unchanged on those tiles, so the results are the float32 kernels' on the widened
// inputs, rounded once, without the float32 copies of every operand (linear attention at
// L = 16384 wrote and read three times the bfloat16 data in those copies).
#include "kernels/linear_attention/elu_linear_attention.h"

#include <algorithm>
#include <type_traits>
#include <vector>

#include "kernels/common/bf16.h"
#include "kernels/common/isa_target.h"
#include "kernels/common/gemm.h"
#include "kernels/common/parallel.h"
#include "kernels/common/simd.h"
#include "kernels/feature_maps/elu.h"

FASTATTN_ISA_BEGIN
namespace {

// The state of one head carried across the chunks of a pass.
template <typename T>
struct HeadState {
  std::vector<T> s, st;   // E × M state and an M × E transpose
  std::vector<T> z;       // E
  std::vector<T> ds, dz;  // E × M and E: key-state gradients (non-causal backward)
  std::vector<T> xf, yf;  // C × E and C × M: the head's rows of a chunk (swept_rows)
};

template <typename T>
struct Scratch {
  std::vector<T> qf, kf;            // C × E
  std::vector<T> xt, yt;            // transposed tiles, max(E, M) × C
  std::vector<T> gn;                // C × M
  std::vector<T> gd;                // C (the forward: 1 / den)
  std::vector<T> a;                 // C × C
  std::vector<HeadState<T>> heads;  // one per head of the work item
  // C × max(E, M) each: output rows before they are stored (out or dQ, dK, dV: output_tile);
  // bfloat16 operands only: widened input rows (q, v, grad_out, out).
  std::vector<T> out_a, out_b, in_q, in_v, in_g, in_o;
  void init(int64_t C, int64_t E, int64_t M, int64_t G, bool widened) {
    const int64_t D = std::max(E, M);
    qf.resize(C * E);
    kf.resize(C * E);
    xt.resize(D * C);
    yt.resize(D * C);
    gn.resize(C * M);
    gd.resize(C);
    a.resize(C * C);
    out_a.resize(C * D);
    out_b.resize(C * D);
    if (widened) {
      for (auto* t : {&in_q, &in_v, &in_g, &in_o}) t->resize(C * D);
    }
    heads.resize(G);
    for (auto& h : heads) {
      h.s.resize(E * M);
      h.st.resize(E * M);
      h.z.resize(E);
      h.ds.resize(E * M);
      h.dz.resize(E);
      h.xf.resize(C * E);
      h.yf.resize(C * M);
    }
  }
};

template <typename T>
void zero(std::vector<T>& x) {
  std::fill(x.begin(), x.end(), T(0));
}

// ---- operands in the arithmetic's type F ---------------------------------------------------

// Rows of F values, ld apart.
template <typename F>
struct Rows {
  F* p;
  int64_t ld;
};

// Rows [0, rows) of x (cols entries, ld apart) as F rows: x itself when T is F; else (bfloat16)
// widened into tile.
template <typename T, typename F>
Rows<const F> widened(const T* x, int64_t ld, int64_t rows, int64_t cols, std::vector<F>& tile) {
  if constexpr (std::is_same_v<T, F>) {
    return {x, ld};
  } else {
    for (int64_t r = 0; r < rows; ++r) widen_bf16(x + r * ld, tile.data() + r * cols, cols);
    return {tile.data(), cols};
  }
}

// Where the arithmetic writes an output's rows (cols entries each): a tile (L1), stored into the
// rows (ld apart) by store_output once they are final. float32 rows are streamed past the caches
// (stream_scaled: every output row is written once, and a store that misses the caches reads its
// line first; measured: git show 5f604de:docs/benchmarks.md, "Linear attention's output rows
// streamed, a cheaper elu map"), bfloat16 rows rounded. The streamed rows are ordered by
// stream_fence() at the end of the work item.
template <typename F>
Rows<F> output_tile(int64_t cols, std::vector<F>& tile) {
  return {tile.data(), cols};
}
// Row r scaled by scale[r] on the way when scale is given (the forward's 1 / den).
template <typename T, typename F>
void store_output(Rows<F> tile, int64_t rows, int64_t cols, T* x, int64_t ld,
                  const F* scale = nullptr) {
  for (int64_t r = 0; r < rows; ++r) {
    F* t = tile.p + r * tile.ld;
    const F s = scale ? scale[r] : F(1);
    if constexpr (std::is_same_v<T, F>) {
      stream_scaled(t, s, x + r * ld, cols);
    } else {
      if (scale)
        for (int64_t c = 0; c < cols; ++c) t[c] *= s;
      narrow_bf16(t, x + r * ld, cols);
    }
  }
}
// *sum += sum_r |scale[r]| · sum_c |tile[r, c]| (float32 / float64; nothing when sum is null):
// at least each |stored value| = |scale[r] · tile[r, c]| as rounded, so an infinite or NaN value
// makes it so (an overflow of the sum itself only sends the check to the output). The forward's
// out_sums per head, from the tile in L1, instead of the registry operator's pass over the whole
// output, which the streamed rows have already taken past the caches.
template <typename T, typename F>
void add_stored_abs_sum(F* sum, Rows<F> tile, int64_t rows, int64_t cols, const F* scale) {
  if constexpr (std::is_same_v<T, F>) {
    if (!sum) return;
    F s = 0;
    for (int64_t r = 0; r < rows; ++r)
      s += std::abs(scale[r]) * simd_abs_sum(tile.p + r * tile.ld, cols);
    *sum += s;
  }
}

// Output rows are prefetched for writing only where they are not streamed.
template <typename T>
constexpr bool kPrefetchOutputs = !std::is_same_v<T, KernelScalar<T>>;

// out (rows × E) = phi(x) (rows x[r·ldx ...]) on the first `valid` rows,
// zeros below (bfloat16 rows widened into out first).
template <typename T, typename F>
void phi_rows(const T* x, int64_t ldx, int64_t rows, int64_t valid, int64_t E, F* out) {
  valid = std::clamp<int64_t>(valid, 0, rows);
  const F* in;
  int64_t ld = ldx;
  if constexpr (std::is_same_v<T, F>) {
    in = x;
  } else {
    for (int64_t r = 0; r < valid; ++r) widen_bf16(x + r * ldx, out + r * E, E);
    in = out;
    ld = E;
  }
  // One call over contiguous rows, else one per row, whatever the type: the same elements go
  // to elu_plus_one's vector and scalar parts as in the float32 kernel on a widened copy.
  if (ldx == E) {
    elu_plus_one(in, out, valid * E);
  } else {
    for (int64_t r = 0; r < valid; ++r) elu_plus_one(in + r * ld, out + r * E, E);
  }
  std::fill(out + valid * E, out + rows * E, F(0));
}

// Rows [from, to) of x (row stride ldx, E entries each) set to zero.
template <typename T>
void zero_rows(T* x, int64_t ldx, int64_t from, int64_t to, int64_t E) {
  for (int64_t r = from; r < to; ++r) std::fill(x + r * ldx, x + r * ldx + E, T(0));
}

// z (E) += sum of the rows of x (rows × E).
template <typename T>
void add_row_sum(const T* x, int64_t rows, int64_t E, T* z) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t e = 0; e < E; ++e) z[e] += x[r * E + e];
}

// z (E) += sum_r w[r] · x[r, :].
template <typename T>
void add_weighted_row_sum(const T* x, const T* w, int64_t rows, int64_t E, T* z) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t e = 0; e < E; ++e) z[e] += w[r] * x[r * E + e];
}

// out (rows × E, row stride ldo) += w[r] · z for every row r (w null: weight 1).
template <typename T>
void add_outer(const T* w, const T* z, int64_t rows, int64_t E, T* out, int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r) {
    const T wr = w ? w[r] : T(1);
    for (int64_t e = 0; e < E; ++e) out[r * ldo + e] += wr * z[e];
  }
}

// The output rows' gradients scaled by the normaliser: gn = g / den
// (rows × M), gd = -(g·out) / den (rows; not when out is null); g and out with row strides ldg,
// ldo.
template <typename T>
void scaled_grads(const T* g, int64_t ldg, const T* out, int64_t ldo, const T* den, int64_t rows,
                  int64_t M, T* gn, T* gd) {
  for (int64_t r = 0; r < rows; ++r) {
    const T inv = T(1) / den[r];
    for (int64_t m = 0; m < M; ++m) gn[r * M + m] = g[r * ldg + m] * inv;
    if (out) gd[r] = -simd_dot(g + r * ldg, out + r * ldo, M) * inv;
  }
}

// The non-causal gd = -(g·out) / den without out: with out_i = S^T phi(q_i) / den_i,
// g_i·out_i = phi(q_i)·(S g_i) / den_i, and u = gn S^T (rows × E, row stride ldu) holds
// S g_i / den_i, the first product of dQ. So gd_i = -phi(q_i)·u_i / den_i, a dot of E values in
// L1 where the other reads the 32 MiB output (L = 16384, 8 heads) back from memory.
template <typename T>
void den_grads_from_products(const T* qf, const T* u, int64_t ldu, const T* den, int64_t rows,
                             int64_t E, T* gd) {
  for (int64_t r = 0; r < rows; ++r) gd[r] = -simd_dot(qf + r * E, u + r * ldu, E) / den[r];
}

// x (rows × E, row stride ldx) = x ∘ phi'(pre) in place (pre's row stride ldp).
template <typename T>
void times_phi_prime(const T* pre, int64_t ldp, int64_t rows, int64_t E, T* x, int64_t ldx) {
  for (int64_t r = 0; r < rows; ++r)
    elu_plus_one_backward(pre + r * ldp, x + r * ldx, x + r * ldx, E);
}

// The same from phi(pre) (rows × E) instead: phi'(x) = min(phi(x), 1)
// (x + 1 > 1 for x > 0, exp(x) <= 1 otherwise; NaN stays NaN), no exp.
template <typename T>
void times_phi_prime_from_phi(const T* phi, int64_t rows, int64_t E, T* x, int64_t ldx) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t e = 0; e < E; ++e) x[r * ldx + e] *= std::min(phi[r * E + e], T(1));
}

template <typename T>
int64_t valid_keys(const EluLinearParams<T>& p, int64_t nh) {
  return p.key_lengths ? std::clamp<int64_t>(p.key_lengths[nh / p.H], 0, p.S) : p.S;
}

// Work items hold G consecutive heads, and every pass runs over the chunks of
// rows with the item's heads inside: in the layers' (N, L, H, E) layout a
// chunk's rows of G heads lie side by side (G·E contiguous entries per row
// instead of E H·E apart, which the hardware prefetcher does not follow; read
// per head, the strided backward was much slower than the contiguous one).
// Each head's arithmetic is the same whatever the grouping.

// Whether the rows of heads nh0 .. nh0 + G - 1 lie side by side (the layers' (N, L, H, E)
// views: head h + 1's row right after head h's), so that one sweep over the rows reads the
// chunk's memory in address order (swept_rows).
inline bool heads_side_by_side(const RowStrides& x, int64_t G, int64_t cols) {
  return G > 1 && x.sh == cols;
}

// Rows [j0, j0 + rows) of heads nh0 .. nh0 + G - 1 into each head's tiles in one sweep in
// address order: xf = phi(x rows) (E entries), yf = y rows (M entries; none when y is null),
// widened to F. The rows of a chunk then stream from memory as contiguous rows do, where a pass
// per head reads pieces E entries long H·E apart, which the hardware prefetcher does not follow.
template <typename T, typename F>
void swept_rows(const EluLinearParams<T>& p, const T* x, RowStrides xs, const T* y, RowStrides ys,
                int64_t nh0, int64_t G, int64_t j0, int64_t rows, Scratch<F>& w) {
  const int64_t E = p.E, M = p.M;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < G; ++g) {
      auto& hs = w.heads[g];
      phi_rows(xs.row(x, nh0 + g, p.H, j0 + r), E, 1, 1, E, hs.xf.data() + r * E);
      if (!y) continue;
      const T* yr = ys.row(y, nh0 + g, p.H, j0 + r);
      if constexpr (std::is_same_v<T, F>) {
        std::copy_n(yr, M, hs.yf.data() + r * M);
      } else {
        widen_bf16(yr, hs.yf.data() + r * M, M);
      }
    }
  }
}

// S = sum phi(k_j) v_j^T (E × M) and z = sum phi(k_j) over keys [from, len), for heads
// nh0 .. nh0 + G - 1 (len depends on n only).
template <typename T, typename F>
void key_states(const EluLinearParams<T>& p, int64_t nh0, int64_t G, int64_t len, Scratch<F>& w,
                int64_t from = 0) {
  const int64_t C = p.chunk, E = p.E, M = p.M;
  const int64_t lk = p.k_rows.sr, lv = p.v_rows.sr;
  for (int64_t g = 0; g < G; ++g) {
    zero(w.heads[g].s);
    zero(w.heads[g].z);
  }
  const bool swept = heads_side_by_side(p.k_rows, G, E) && heads_side_by_side(p.v_rows, G, M);
  for (int64_t j0 = from; j0 < len; j0 += C) {
    const int64_t rows = std::min(C, len - j0);
    if (swept) {
      swept_rows(p, p.k, p.k_rows, p.v, p.v_rows, nh0, G, j0, rows, w);
      for (int64_t g = 0; g < G; ++g) {
        auto& hs = w.heads[g];
        gemm_tn(E, M, rows, hs.xf.data(), E, hs.yf.data(), M, hs.s.data(), M, true);
        add_row_sum(hs.xf.data(), rows, E, hs.z.data());
      }
      continue;
    }
    for (int64_t g = 0; g < G; ++g) {
      auto& hs = w.heads[g];
      const T* k = p.k_rows.head(p.k, nh0 + g, p.H) + j0 * lk;
      const T* v = p.v_rows.head(p.v, nh0 + g, p.H) + j0 * lv;
      const int64_t next = std::min(C, len - j0 - C);
      prefetch_rows(k + C * lk, next, E, lk);
      prefetch_rows(v + C * lv, next, M, lv);
      phi_rows(k, lk, rows, rows, E, w.kf.data());
      const auto vf = widened(v, lv, rows, M, w.in_v);
      gemm_tn(E, M, rows, w.kf.data(), E, vf.p, vf.ld, hs.s.data(), M, true);
      add_row_sum(w.kf.data(), rows, E, hs.z.data());
    }
  }
}

// ---- forward ------------------------------------------------------------

template <typename T, typename F>
void forward_causal(const EluLinearForwardArgs<T>& p, int64_t nh0, int64_t G, Scratch<F>& w) {
  const int64_t L = p.L, E = p.E, M = p.M, C = p.chunk;
  const int64_t len = valid_keys(p, nh0);
  const int64_t lq = p.q_rows.sr, lk = p.k_rows.sr, lv = p.v_rows.sr, lo = p.out_rows.sr;
  for (int64_t g = 0; g < G; ++g) {
    zero(w.heads[g].s);
    zero(w.heads[g].z);
  }
  for (int64_t i0 = 0; i0 < L; i0 += C) {
    const int64_t rows = std::min(C, L - i0);
    const bool first = i0 == 0;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t nh = nh0 + g;
      auto& hs = w.heads[g];
      const T* q = p.q_rows.head(p.q, nh, p.H) + i0 * lq;
      const T* k = p.k_rows.head(p.k, nh, p.H) + i0 * lk;
      const T* v = p.v_rows.head(p.v, nh, p.H) + i0 * lv;
      T* o = p.out_rows.head(p.out, nh, p.H) + i0 * lo;
      F* den = p.den + nh * L + i0;
      const int64_t next = std::min(C, L - i0 - C);
      prefetch_rows(q + C * lq, next, E, lq);
      prefetch_rows(k + C * lk, next, E, lk);
      prefetch_rows(v + C * lv, next, M, lv);
      if (kPrefetchOutputs<T>) prefetch_rows(o + C * lo, next, M, lo, /*write=*/true);
      phi_rows(q, lq, rows, rows, E, w.qf.data());
      phi_rows(k, lk, rows, len - i0, E, w.kf.data());
      const auto vc = widened(v, lv, rows, M, w.in_v);
      const auto oc = output_tile(M, w.out_a);
      transpose(w.kf.data(), rows, E, E, w.xt.data(), C);
      gemm(rows, rows, E, w.qf.data(), E, w.xt.data(), C, w.a.data(), C, false);
      keep_lower_triangle(w.a.data(), rows, C);
      if (!first) gemm(rows, M, E, w.qf.data(), E, hs.s.data(), M, oc.p, oc.ld, false);
      gemm(rows, M, rows, w.a.data(), C, vc.p, vc.ld, oc.p, oc.ld, !first);
      for (int64_t r = 0; r < rows; ++r) {
        F d = p.eps + simd_dot(w.qf.data() + r * E, hs.z.data(), E);
        for (int64_t j = 0; j <= r; ++j) d += w.a[r * C + j];
        den[r] = d;
        w.gd[r] = F(1) / d;
      }
      store_output(oc, rows, M, o, lo, w.gd.data());
      add_stored_abs_sum<T>(p.out_sums ? p.out_sums + nh : nullptr, oc, rows, M, w.gd.data());
      if (i0 + rows < L && i0 < len) {
        gemm(E, M, rows, w.xt.data(), C, vc.p, vc.ld, hs.s.data(), M, true);
        add_row_sum(w.kf.data(), rows, E, hs.z.data());
      }
    }
  }
}

// [S | z] of heads nh0 .. nh0 + G - 1 to and from `state` ((N·H) × E × (M + 1), row e of a head
// S's row e and z_e); grads: [dS | dz] instead.
template <typename F>
void save_key_states(const Scratch<F>& w, int64_t nh0, int64_t G, int64_t E, int64_t M, F* state,
                     bool grads = false) {
  for (int64_t g = 0; g < G; ++g) {
    F* x = state + (nh0 + g) * E * (M + 1);
    const auto& hs = w.heads[g];
    const F* s = grads ? hs.ds.data() : hs.s.data();
    const F* z = grads ? hs.dz.data() : hs.z.data();
    for (int64_t e = 0; e < E; ++e) {
      std::copy_n(s + e * M, M, x + e * (M + 1));
      x[e * (M + 1) + M] = z[e];
    }
  }
}
template <typename F>
void load_key_states(const F* state, int64_t nh0, int64_t G, int64_t E, int64_t M, Scratch<F>& w,
                     bool grads = false) {
  for (int64_t g = 0; g < G; ++g) {
    const F* x = state + (nh0 + g) * E * (M + 1);
    auto& hs = w.heads[g];
    F* s = grads ? hs.ds.data() : hs.s.data();
    F* z = grads ? hs.dz.data() : hs.z.data();
    for (int64_t e = 0; e < E; ++e) {
      std::copy_n(x + e * (M + 1), M, s + e * M);
      z[e] = x[e * (M + 1) + M];
    }
  }
}

// The non-causal forward's query rows [from, to) of heads nh0 .. nh0 + G - 1, from the key
// states in w.heads; sums (G, or null) += add_stored_abs_sum of each head's rows.
template <typename T, typename F>
void forward_rows(const EluLinearForwardArgs<T>& p, int64_t nh0, int64_t G, int64_t from,
                  int64_t to, F* sums, Scratch<F>& w) {
  const int64_t L = p.L, E = p.E, M = p.M, C = p.chunk;
  const int64_t lq = p.q_rows.sr, lo = p.out_rows.sr;
  const bool swept = heads_side_by_side(p.q_rows, G, E);
  for (int64_t i0 = from; i0 < to; i0 += C) {
    const int64_t rows = std::min(C, to - i0);
    if (swept) swept_rows<T>(p, p.q, p.q_rows, nullptr, p.q_rows, nh0, G, i0, rows, w);
    for (int64_t g = 0; g < G; ++g) {
      const int64_t nh = nh0 + g;
      const auto& hs = w.heads[g];
      T* o = p.out_rows.head(p.out, nh, p.H) + i0 * lo;
      F* den = p.den + nh * L + i0;
      const int64_t next = std::min(C, to - i0 - C);
      if (kPrefetchOutputs<T>) prefetch_rows(o + C * lo, next, M, lo, /*write=*/true);
      const F* qf = hs.xf.data();
      if (!swept) {
        const T* q = p.q_rows.head(p.q, nh, p.H) + i0 * lq;
        prefetch_rows(q + C * lq, next, E, lq);
        phi_rows(q, lq, rows, rows, E, w.qf.data());
        qf = w.qf.data();
      }
      const auto oc = output_tile(M, w.out_a);
      gemm(rows, M, E, qf, E, hs.s.data(), M, oc.p, oc.ld, false);
      for (int64_t r = 0; r < rows; ++r) {
        const F d = p.eps + simd_dot(qf + r * E, hs.z.data(), E);
        den[r] = d;
        w.gd[r] = F(1) / d;
      }
      store_output(oc, rows, M, o, lo, w.gd.data());
      add_stored_abs_sum<T>(sums ? sums + g : nullptr, oc, rows, M, w.gd.data());
    }
  }
}

// ---- backward -----------------------------------------------------------

// Rows i0, i0 + 1, ... of every backward operand of head nh (den's too),
// and their row strides.
template <typename T>
struct ChunkRows {
  using F = KernelScalar<T>;
  const T *q, *k, *v, *g, *out;
  const F* den;
  T *gq, *gk, *gv;
  int64_t lq, lk, lv, lg, lo, lgq, lgk, lgv;
  ChunkRows(const EluLinearBackwardArgs<T>& p, int64_t nh, int64_t i0)
      : lq(p.q_rows.sr),
        lk(p.k_rows.sr),
        lv(p.v_rows.sr),
        lg(p.grad_out_rows.sr),
        lo(p.out_rows.sr),
        lgq(p.grad_q_rows.sr),
        lgk(p.grad_k_rows.sr),
        lgv(p.grad_v_rows.sr) {
    q = p.q_rows.head(p.q, nh, p.H) + i0 * lq;
    k = p.k_rows.head(p.k, nh, p.H) + i0 * lk;
    v = p.v_rows.head(p.v, nh, p.H) + i0 * lv;
    g = p.grad_out_rows.head(p.grad_out, nh, p.H) + i0 * lg;
    out = p.out_rows.head(p.out, nh, p.H) + i0 * lo;
    den = p.den + nh * p.L + i0;
    gq = p.grad_q_rows.head(p.grad_q, nh, p.H) + i0 * lgq;
    gk = p.grad_k_rows.head(p.grad_k, nh, p.H) + i0 * lgk;
    gv = p.grad_v_rows.head(p.grad_v, nh, p.H) + i0 * lgv;
  }
  // Asks for `rows` rows `step` rows on (negative: back) of what a query
  // pass reads (q, g, out unless not `with_out`) and writes (gq).
  void prefetch_queries(int64_t step, int64_t rows, int64_t E, int64_t M,
                        bool with_out = true) const {
    prefetch_rows(q + step * lq, rows, E, lq);
    prefetch_rows(g + step * lg, rows, M, lg);
    if (with_out) prefetch_rows(out + step * lo, rows, M, lo);
    if (kPrefetchOutputs<T>) prefetch_rows(gq + step * lgq, rows, E, lgq, /*write=*/true);
  }
  // The same for the keys' side: k, v read, gk, gv written when `write`.
  void prefetch_keys(int64_t step, int64_t rows, int64_t E, int64_t M, bool write) const {
    prefetch_rows(k + step * lk, rows, E, lk);
    prefetch_rows(v + step * lv, rows, M, lv);
    if (!write || !kPrefetchOutputs<T>) return;
    prefetch_rows(gk + step * lgk, rows, E, lgk, true);
    prefetch_rows(gv + step * lgv, rows, M, lgv, true);
  }
  // scaled_grads of the chunk's first `rows` output rows (gd too unless not `with_out`).
  void scale_grads(int64_t rows, int64_t M, Scratch<F>& w, bool with_out = true) const {
    const auto gf = widened(g, lg, rows, M, w.in_g);
    const auto of = with_out ? widened(out, lo, rows, M, w.in_o) : Rows<const F>{nullptr, 0};
    scaled_grads(gf.p, gf.ld, of.p, of.ld, den, rows, M, w.gn.data(), w.gd.data());
  }
};

template <typename T, typename F>
void backward_causal(const EluLinearBackwardArgs<T>& p, int64_t nh0, int64_t G, Scratch<F>& w) {
  const int64_t L = p.L, E = p.E, M = p.M, C = p.chunk;
  const int64_t len = valid_keys(p, nh0);
  F* a = w.a.data();

  // Forward pass: dQ from the prefix states S^T = sum v_j phi(k_j)^T (M × E), z.
  for (int64_t g = 0; g < G; ++g) {
    zero(w.heads[g].st);
    zero(w.heads[g].z);
  }
  for (int64_t i0 = 0; i0 < L; i0 += C) {
    const int64_t rows = std::min(C, L - i0);
    const bool first = i0 == 0;
    for (int64_t g = 0; g < G; ++g) {
      auto& hs = w.heads[g];
      const ChunkRows<T> c(p, nh0 + g, i0);
      F* st = hs.st.data();
      F* vt = w.xt.data();
      const int64_t next = std::min(C, L - i0 - C);
      c.prefetch_queries(C, next, E, M);
      c.prefetch_keys(C, next, E, M, /*write=*/false);
      phi_rows(c.k, c.lk, rows, len - i0, E, w.kf.data());
      c.scale_grads(rows, M, w);
      const auto q = widened(c.q, c.lq, rows, E, w.in_q);  // for phi'(q)
      const auto v = widened(c.v, c.lv, rows, M, w.in_v);
      const auto gq = output_tile(E, w.out_a);
      transpose(v.p, rows, M, v.ld, vt, C);
      // B = gn V^T + gd 1^T, masked (j <= i).
      gemm(rows, rows, M, w.gn.data(), M, vt, C, a, C, false);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j <= r; ++j) a[r * C + j] += w.gd[r];
      keep_lower_triangle(a, rows, C);
      if (!first) gemm(rows, E, M, w.gn.data(), M, st, E, gq.p, gq.ld, false);
      gemm(rows, E, rows, a, C, w.kf.data(), E, gq.p, gq.ld, !first);
      if (!first) add_outer(w.gd.data(), hs.z.data(), rows, E, gq.p, gq.ld);
      times_phi_prime(q.p, q.ld, rows, E, gq.p, gq.ld);
      store_output(gq, rows, E, c.gq, c.lgq);
      if (i0 + rows < L && i0 < len) {
        gemm(M, E, rows, vt, C, w.kf.data(), E, st, E, true);
        add_row_sum(w.kf.data(), rows, E, hs.z.data());
      }
    }
  }

  // Reversed pass: dK, dV from the suffix states R = sum phi(q_i) gn_i^T
  // (E × M) and r = sum phi(q_i) gd_i (E).
  for (int64_t g = 0; g < G; ++g) {
    zero(w.heads[g].s);
    zero(w.heads[g].z);
  }
  const int64_t last = (L - 1) / C * C;
  for (int64_t i0 = last; i0 >= 0; i0 -= C) {
    const int64_t rows = std::min(C, L - i0);
    const int64_t valid = std::clamp<int64_t>(len - i0, 0, rows);
    const bool first = i0 == last;  // R, r are still zero
    for (int64_t g = 0; g < G; ++g) {
      auto& hs = w.heads[g];
      const ChunkRows<T> c(p, nh0 + g, i0);
      F* rs = hs.s.data();
      F* rt = hs.st.data();
      F* r = hs.z.data();
      F* qt = w.xt.data();   // phi(Q_c)^T (E × C)
      F* gnt = w.yt.data();  // gn^T (M × C)
      if (i0 > 0) {
        c.prefetch_queries(-C, C, E, M);
        c.prefetch_keys(-C, C, E, M, /*write=*/true);
      }
      phi_rows(c.q, c.lq, rows, rows, E, w.qf.data());
      c.scale_grads(rows, M, w);
      transpose(w.qf.data(), rows, E, E, qt, C);
      const auto gk = output_tile(E, w.out_a);
      const auto gv = output_tile(M, w.out_b);
      if (valid > 0) {
        const auto v = widened(c.v, c.lv, valid, M, w.in_v);
        phi_rows(c.k, c.lk, valid, valid, E, w.kf.data());
        transpose(w.gn.data(), rows, M, M, gnt, C);
        // dV_c = phi(K_c) R + (phi(K_c) phi(Q_c)^T masked i >= j) gn
        gemm(valid, rows, E, w.kf.data(), E, qt, C, a, C, false);
        keep_upper_triangle(a, valid, C);
        if (!first) gemm(valid, M, E, w.kf.data(), E, rs, M, gv.p, gv.ld, false);
        gemm(valid, M, rows, a, C, w.gn.data(), M, gv.p, gv.ld, !first);
        // dphi(K_c) = V_c R^T + 1 r^T + B' phi(Q_c), B'_ji = v_j·gn_i + gd_i (i >= j)
        gemm(valid, rows, M, v.p, v.ld, gnt, C, a, C, false);
        for (int64_t j = 0; j < valid; ++j)
          for (int64_t i = j; i < rows; ++i) a[j * C + i] += w.gd[i];
        keep_upper_triangle(a, valid, C);
        if (!first) {
          transpose(rs, E, M, M, rt, E);
          gemm(valid, E, M, v.p, v.ld, rt, E, gk.p, gk.ld, false);
        }
        gemm(valid, E, rows, a, C, w.qf.data(), E, gk.p, gk.ld, !first);
        if (!first) add_outer<F>(nullptr, r, valid, E, gk.p, gk.ld);
        times_phi_prime_from_phi(w.kf.data(), valid, E, gk.p, gk.ld);
      }
      zero_rows(gk.p, gk.ld, valid, rows, E);
      zero_rows(gv.p, gv.ld, valid, rows, M);
      store_output(gk, rows, E, c.gk, c.lgk);
      store_output(gv, rows, M, c.gv, c.lgv);
      if (i0 > 0) {
        gemm(E, M, rows, qt, C, w.gn.data(), M, rs, M, true);
        add_weighted_row_sum(w.qf.data(), w.gd.data(), rows, E, r);
      }
    }
  }
}

// The non-causal backward's query rows [from, to) of heads nh0 .. nh0 + G - 1, from the key
// states [S | z] in w.heads: dQ, and the rows' dS = sum phi(q_i) gn_i^T, dz = sum phi(q_i) gd_i
// into w.heads. It does not read out (den_grads_from_products).
template <typename T, typename F>
void backward_query_rows(const EluLinearBackwardArgs<T>& p, int64_t nh0, int64_t G, int64_t from,
                         int64_t to, Scratch<F>& w) {
  const int64_t E = p.E, M = p.M, C = p.chunk;
  for (int64_t g = 0; g < G; ++g) {  // S^T for dQ = gn S^T + gd z^T
    auto& hs = w.heads[g];
    transpose(hs.s.data(), E, M, M, hs.st.data(), E);
    zero(hs.ds);
    zero(hs.dz);
  }
  const bool swept =
      heads_side_by_side(p.q_rows, G, E) && heads_side_by_side(p.grad_out_rows, G, M);
  for (int64_t i0 = from; i0 < to; i0 += C) {
    const int64_t rows = std::min(C, to - i0);
    if (swept) {
      // phi(q) into xf, gn into yf, head by head along each row (swept_rows).
      swept_rows<T>(p, p.q, p.q_rows, p.grad_out, p.grad_out_rows, nh0, G, i0, rows, w);
      for (int64_t g = 0; g < G; ++g) {
        F* gn = w.heads[g].yf.data();
        const F* den = p.den + (nh0 + g) * p.L + i0;
        for (int64_t r = 0; r < rows; ++r) {
          const F inv = F(1) / den[r];
          for (int64_t m = 0; m < M; ++m) gn[r * M + m] *= inv;
        }
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      auto& hs = w.heads[g];
      const ChunkRows<T> c(p, nh0 + g, i0);
      const F *qf = hs.xf.data(), *gn = hs.yf.data();
      if (!swept) {
        c.prefetch_queries(C, std::min(C, to - i0 - C), E, M, /*with_out=*/false);
        phi_rows(c.q, c.lq, rows, rows, E, w.qf.data());
        c.scale_grads(rows, M, w, /*with_out=*/false);
        qf = w.qf.data();
        gn = w.gn.data();
      } else if (kPrefetchOutputs<T>) {
        prefetch_rows(c.gq + C * c.lgq, std::min(C, to - i0 - C), E, c.lgq, /*write=*/true);
      }
      F* gd = w.gd.data();
      const auto gq = output_tile(E, w.out_a);
      gemm(rows, E, M, gn, M, hs.st.data(), E, gq.p, gq.ld, false);
      den_grads_from_products(qf, gq.p, gq.ld, c.den, rows, E, gd);
      add_outer(gd, hs.z.data(), rows, E, gq.p, gq.ld);
      times_phi_prime_from_phi(qf, rows, E, gq.p, gq.ld);
      store_output(gq, rows, E, c.gq, c.lgq);
      gemm_tn(E, M, rows, qf, E, gn, M, hs.ds.data(), M, true);
      add_weighted_row_sum(qf, gd, rows, E, hs.dz.data());
    }
  }
}

// Its key rows [from, to), from [dS | dz] in w.heads: dV = phi(K) dS, dphi(K) = V dS^T + 1 dz^T
// (zero past the valid keys).
template <typename T, typename F>
void backward_key_rows(const EluLinearBackwardArgs<T>& p, int64_t nh0, int64_t G, int64_t from,
                       int64_t to, Scratch<F>& w) {
  const int64_t E = p.E, M = p.M, C = p.chunk;
  const int64_t len = valid_keys(p, nh0);
  for (int64_t g = 0; g < G; ++g) {
    auto& hs = w.heads[g];
    transpose(hs.ds.data(), E, M, M, hs.st.data(), E);
  }
  const bool swept = heads_side_by_side(p.k_rows, G, E) && heads_side_by_side(p.v_rows, G, M);
  for (int64_t j0 = from; j0 < to; j0 += C) {
    const int64_t rows = std::min(C, to - j0);
    const int64_t valid = std::clamp<int64_t>(len - j0, 0, rows);
    if (swept && valid > 0) swept_rows(p, p.k, p.k_rows, p.v, p.v_rows, nh0, G, j0, valid, w);
    for (int64_t g = 0; g < G; ++g) {
      const auto& hs = w.heads[g];
      const ChunkRows<T> c(p, nh0 + g, j0);
      const int64_t next = std::min(C, to - j0 - C);
      if (!swept) {
        c.prefetch_keys(C, next, E, M, /*write=*/true);
      } else if (kPrefetchOutputs<T>) {
        prefetch_rows(c.gk + C * c.lgk, next, E, c.lgk, /*write=*/true);
        prefetch_rows(c.gv + C * c.lgv, next, M, c.lgv, /*write=*/true);
      }
      const auto gk = output_tile(E, w.out_a);
      const auto gv = output_tile(M, w.out_b);
      if (valid > 0) {
        Rows<const F> v{hs.yf.data(), M};
        const F* kf = hs.xf.data();
        if (!swept) {
          v = widened(c.v, c.lv, valid, M, w.in_v);
          phi_rows(c.k, c.lk, valid, valid, E, w.kf.data());
          kf = w.kf.data();
        }
        gemm(valid, M, E, kf, E, hs.ds.data(), M, gv.p, gv.ld, false);
        gemm(valid, E, M, v.p, v.ld, hs.st.data(), E, gk.p, gk.ld, false);
        add_outer<F>(nullptr, hs.dz.data(), valid, E, gk.p, gk.ld);
        times_phi_prime_from_phi(kf, valid, E, gk.p, gk.ld);
      }
      zero_rows(gk.p, gk.ld, valid, rows, E);
      zero_rows(gv.p, gv.ld, valid, rows, M);
      store_output(gk, rows, E, c.gk, c.lgk);
      store_output(gv, rows, M, c.gv, c.lgv);
    }
  }
}

// The row layouts left at their defaults made explicit.
template <typename T>
void resolve_rows(EluLinearForwardArgs<T>& p) {
  resolve_qkv_rows(p);
  p.out_rows = p.out_rows.resolved(p.H, p.L, p.M);
}
template <typename T>
void resolve_rows(EluLinearBackwardArgs<T>& p) {
  resolve_qkv_rows(p);
  p.grad_out_rows = p.grad_out_rows.resolved(p.H, p.L, p.M);
  p.out_rows = p.out_rows.resolved(p.H, p.L, p.M);
  p.grad_q_rows = p.grad_q_rows.resolved(p.H, p.L, p.E);
  p.grad_k_rows = p.grad_k_rows.resolved(p.H, p.S, p.E);
  p.grad_v_rows = p.grad_v_rows.resolved(p.H, p.S, p.M);
}

// Heads per work item: the fewest groups g per batch entry that keep the
// threads evenly busy (N·g a multiple of the thread count, or at least four
// items per thread), each of ceil(H / g) heads.
inline int64_t heads_per_item(int64_t N, int64_t H, int threads) {
  for (int64_t g = 1; g < H; ++g) {
    if ((N * g) % threads == 0 || N * g >= 4 * threads) return (H + g - 1) / g;
  }
  return 1;
}

// p with its row layouts resolved and a chunk of at least one row.
template <typename Args>
Args resolved(const Args& p) {
  Args q = p;
  q.chunk = std::max<int64_t>(1, p.chunk);
  resolve_rows(q);
  return q;
}

// body(args with resolved layouts and chunk, nh0, G, scratch) per work item:
// heads nh0 .. nh0 + G - 1 of one batch entry.
template <typename T, typename Args, typename Body>
void for_each_item(const Args& p, Body body) {
  if (p.N * p.H == 0 || p.L == 0) return;
  const Args q = resolved(p);
  const int64_t G = heads_per_item(p.N, p.H, std::max(1, p.num_threads));
  const int64_t groups = (p.H + G - 1) / G;
  using F = KernelScalar<T>;
  parallel_items<Scratch<F>>(
      p.N * groups, p.num_threads,
      [&](Scratch<F>& w) { w.init(q.chunk, p.E, p.M, G, !std::is_same_v<T, F>); },
      [&](int64_t item, Scratch<F>& w) {
        const int64_t n = item / groups, h0 = item % groups * G;
        body(q, n * p.H + h0, std::min(G, p.H - h0), w);
        stream_fence();  // the item's streamed output rows (store_output)
      });
}

// ---- the non-causal passes by blocks of rows ----------------------------
//
// The non-causal forward and backward split each pass by rows instead of heads: a work item is
// (n, a group of up to kBlockHeads heads, a block of rows), and the states summed over the keys
// ([S | z]; the backward's [dS | dz] over the queries) are added up over the blocks between the
// passes. On the layers' (N, L, H, E) views an item's rows of its heads lie side by side, and
// swept_rows reads them in address order, a stream the hardware prefetcher follows (measured:
// git show 5f604de:docs/benchmarks.md, "The non-causal linear kernels by blocks of rows"), where
// the items of a few heads each over all rows read a part of every row. The blocks depend on N
// and the rows only, never on the thread count: the sums, and so the results, are the same with
// any number of threads.

// Heads per item: all H up to 16 (their state and chunk tiles, 80 KiB a head at E = M = 64, stay
// in L2), else as few groups of at most 16 as there can be.
inline constexpr int64_t kBlockHeads = 16;

// The items of one pass over `rows` rows.
struct Blocks {
  int64_t R;       // rows per block: whole chunks, about 16 blocks over the batch
  int64_t blocks;  // per batch entry (at least one)
  int64_t G;       // heads per group
  int64_t groups;  // per batch entry
  Blocks(int64_t N, int64_t H, int64_t rows, int64_t C) {
    const int64_t chunks = (rows + C - 1) / C;
    const int64_t per_entry =
        std::clamp<int64_t>((16 + N - 1) / N, 1, std::max<int64_t>(1, chunks));
    R = std::max<int64_t>(1, (chunks + per_entry - 1) / per_entry) * C;
    blocks = std::max<int64_t>(1, (rows + R - 1) / R);
    groups = (H + kBlockHeads - 1) / kBlockHeads;
    G = (H + groups - 1) / groups;
    groups = (H + G - 1) / G;
  }
  // Where head h of entry n puts its values of block b in a per-block buffer (N, blocks, H).
  int64_t slot(int64_t n, int64_t b, int64_t H, int64_t h) const {
    return (n * blocks + b) * H + h;
  }
};

// body(n, h0, G, from, to, scratch) for every item: heads n·H + h0 .. + G - 1, rows [from, to)
// of `rows`, with scratch for G heads.
template <typename T, typename Args, typename Body>
void for_each_block(const Args& q, int64_t rows, Body body) {
  using F = KernelScalar<T>;
  const Blocks k(q.N, q.H, rows, q.chunk);
  parallel_items<Scratch<F>>(
      q.N * k.groups * k.blocks, q.num_threads,
      [&](Scratch<F>& w) { w.init(q.chunk, q.E, q.M, k.G, !std::is_same_v<T, F>); },
      [&](int64_t item, Scratch<F>& w) {
        const int64_t b = item % k.blocks, rest = item / k.blocks;
        const int64_t n = rest / k.groups, h0 = rest % k.groups * k.G, from = b * k.R;
        body(n, h0, std::min(k.G, q.H - h0), from, std::min(rows, from + k.R), w);
        stream_fence();
      });
}

// The sum over the blocks of `rows` rows of what block(n, h0, G, from, to, scratch) leaves in
// the scratch's heads ([S | z], or [dS | dz] with grads), for every head: into `out` (layout of
// save_key_states), added up in block order.
template <typename T, typename Args, typename Block>
void summed_over_blocks(const Args& q, int64_t rows, bool grads, KernelScalar<T>* out,
                        Block block) {
  using F = KernelScalar<T>;
  const int64_t H = q.H, D = q.E * (q.M + 1);
  const Blocks k(q.N, H, rows, q.chunk);
  // One block per entry: straight into out.
  std::vector<F> part(k.blocks > 1 ? q.N * k.blocks * H * D : 0);
  for_each_block<T>(
      q, rows, [&](int64_t n, int64_t h0, int64_t G, int64_t from, int64_t to, Scratch<F>& w) {
        block(n * H + h0, G, from, to, w);
        F* x =
            part.empty() ? out + (n * H + h0) * D : part.data() + k.slot(n, from / k.R, H, h0) * D;
        save_key_states(w, 0, G, q.E, q.M, x, grads);
      });
  if (part.empty()) return;
  for (int64_t n = 0; n < q.N; ++n) {
    F* x = out + n * H * D;
    std::copy_n(part.data() + k.slot(n, 0, H, 0) * D, H * D, x);
    for (int64_t b = 1; b < k.blocks; ++b) {
      const F* y = part.data() + k.slot(n, b, H, 0) * D;
      for (int64_t i = 0; i < H * D; ++i) x[i] += y[i];
    }
  }
}

// [S | z] of every head summed over the key blocks.
template <typename T, typename Args>
void summed_key_states(const Args& q, KernelScalar<T>* states) {
  using F = KernelScalar<T>;
  summed_over_blocks<T>(q, q.S, false, states,
                        [&](int64_t nh0, int64_t G, int64_t from, int64_t to, Scratch<F>& w) {
                          key_states(q, nh0, G, std::min(valid_keys(q, nh0), to), w, from);
                        });
}

template <typename T>
void forward_by_blocks(const EluLinearForwardArgs<T>& p) {
  using F = KernelScalar<T>;
  const auto q = resolved(p);
  const int64_t H = q.H;
  std::vector<F> own;
  F* states = q.state;
  if (!states) {
    own.resize(q.N * H * q.E * (q.M + 1));
    states = own.data();
  }
  summed_key_states<T>(q, states);
  // out_sums per block, added up in block order after the pass.
  const Blocks k(q.N, H, q.L, q.chunk);
  std::vector<F> sums(q.out_sums ? q.N * k.blocks * H : 0, F(0));
  for_each_block<T>(q, q.L,
                    [&](int64_t n, int64_t h0, int64_t G, int64_t from, int64_t to, Scratch<F>& w) {
                      load_key_states(states, n * H + h0, G, q.E, q.M, w);
                      F* s = sums.empty() ? nullptr : sums.data() + k.slot(n, from / k.R, H, h0);
                      forward_rows(q, n * H + h0, G, from, to, s, w);
                    });
  for (int64_t n = 0; n < q.N && !sums.empty(); ++n)
    for (int64_t b = 0; b < k.blocks; ++b)
      for (int64_t h = 0; h < H; ++h) q.out_sums[n * H + h] += sums[k.slot(n, b, H, h)];
}

template <typename T>
void backward_by_blocks(const EluLinearBackwardArgs<T>& p) {
  using F = KernelScalar<T>;
  const auto q = resolved(p);
  const int64_t H = q.H, D = q.E * (q.M + 1);
  // The forward's key states (kept by it, else recomputed).
  std::vector<F> own, grads(q.N * H * D);
  const F* states = q.state;
  if (!states) {
    own.resize(q.N * H * D);
    summed_key_states<T>(q, own.data());
    states = own.data();
  }
  summed_over_blocks<T>(q, q.L, true, grads.data(),
                        [&](int64_t nh0, int64_t G, int64_t from, int64_t to, Scratch<F>& w) {
                          load_key_states(states, nh0, G, q.E, q.M, w);
                          backward_query_rows(q, nh0, G, from, to, w);
                        });
  for_each_block<T>(q, q.S,
                    [&](int64_t n, int64_t h0, int64_t G, int64_t from, int64_t to, Scratch<F>& w) {
                      load_key_states(grads.data(), n * H + h0, G, q.E, q.M, w, /*grads=*/true);
                      backward_key_rows(q, n * H + h0, G, from, to, w);
                    });
}

}  // namespace

template <typename T>
void elu_linear_attention_forward_cpu(const EluLinearForwardArgs<T>& p) {
  using F = KernelScalar<T>;
  if (!p.causal) {
    if (p.N * p.H > 0 && p.L > 0) forward_by_blocks(p);
    return;
  }
  for_each_item<T>(p, [](const EluLinearForwardArgs<T>& a, int64_t nh0, int64_t G, Scratch<F>& w) {
    forward_causal(a, nh0, G, w);
  });
}

template <typename T>
void elu_linear_attention_backward_cpu(const EluLinearBackwardArgs<T>& p) {
  // No queries: nothing reaches the keys and values.
  if (p.L == 0) {
    auto z = p;
    resolve_rows(z);
    zero_all_rows(p.grad_k, z.grad_k_rows, p.N * p.H, p.H, p.S, p.E);
    zero_all_rows(p.grad_v, z.grad_v_rows, p.N * p.H, p.H, p.S, p.M);
    return;
  }
  if (!p.causal) {
    if (p.N * p.H > 0) backward_by_blocks(p);
    return;
  }
  using F = KernelScalar<T>;
  for_each_item<T>(p, [](const EluLinearBackwardArgs<T>& a, int64_t nh0, int64_t G, Scratch<F>& w) {
    backward_causal(a, nh0, G, w);
  });
}

FASTATTN_ISA_END

FASTATTN_CPU_KERNEL_WITH_BF16(elu_linear_attention_forward_cpu, EluLinearForwardArgs)
FASTATTN_CPU_KERNEL_WITH_BF16(elu_linear_attention_backward_cpu, EluLinearBackwardArgs)
