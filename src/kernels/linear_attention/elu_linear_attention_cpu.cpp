// CPU kernels of the fused elu linear attention (see elu_linear_attention.h).
// Per (n, h) one work item; every product is a register-blocked tile gemm of
// kernels/common/gemm.h. Tiles (C rows): qf = phi(Q_c), kf = phi(K_c) with
// padded rows zeroed, their transposes, gn / gd (the output gradient scaled by
// the normaliser), and a C×C score tile.
#include "kernels/linear_attention/elu_linear_attention.h"

#include <algorithm>
#include <vector>

#include "kernels/common/isa_target.h"
#include "kernels/common/gemm.h"
#include "kernels/common/parallel.h"
#include "kernels/common/simd.h"
#include "kernels/feature_maps/elu.h"

FASTATTN_ISA_BEGIN
namespace {

template <typename T>
struct Scratch {
  std::vector<T> qf, kf;  // C × E
  std::vector<T> xt, yt;  // transposed tiles, max(E, M) × C
  std::vector<T> gn;      // C × M
  std::vector<T> gd;      // C
  std::vector<T> a;       // C × C
  std::vector<T> s, st;   // E × M states and transposes
  std::vector<T> z;       // E
  std::vector<T> ds, dz;  // E × M and E: key-state gradients (non-causal backward)
  void init(int64_t C, int64_t E, int64_t M) {
    const int64_t D = std::max(E, M);
    qf.resize(C * E);
    kf.resize(C * E);
    xt.resize(D * C);
    yt.resize(D * C);
    gn.resize(C * M);
    gd.resize(C);
    a.resize(C * C);
    s.resize(E * M);
    st.resize(E * M);
    z.resize(E);
  }
  void init_state_grads(int64_t E, int64_t M) {
    ds.assign(E * M, T(0));
    dz.assign(E, T(0));
  }
};

// out (rows × E) = phi(x) on the first `valid` rows, zeros below.
template <typename T>
void phi_rows(const T* x, int64_t rows, int64_t valid, int64_t E, T* out) {
  valid = std::clamp<int64_t>(valid, 0, rows);
  elu_plus_one(x, out, valid * E);
  std::fill(out + valid * E, out + rows * E, T(0));
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

// out (rows × E) += w[r] · z for every row r (w null: weight 1).
template <typename T>
void add_outer(const T* w, const T* z, int64_t rows, int64_t E, T* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const T wr = w ? w[r] : T(1);
    for (int64_t e = 0; e < E; ++e) out[r * E + e] += wr * z[e];
  }
}

// gn = g / den (rows × M), gd = -(g·out) / den (rows).
template <typename T>
void scaled_grads(const T* g, const T* out, const T* den, int64_t rows, int64_t M, T* gn, T* gd) {
  for (int64_t r = 0; r < rows; ++r) {
    const T inv = T(1) / den[r];
    for (int64_t m = 0; m < M; ++m) gn[r * M + m] = g[r * M + m] * inv;
    gd[r] = -simd_dot(g + r * M, out + r * M, M) * inv;
  }
}

// x (rows × E) = x ∘ phi'(pre) in place.
template <typename T>
void times_phi_prime(const T* pre, int64_t rows, int64_t E, T* x) {
  elu_plus_one_backward(pre, x, x, rows * E);
}

// The same from phi(pre) instead: phi'(x) = min(phi(x), 1) (x + 1 > 1 for
// x > 0, exp(x) <= 1 otherwise; NaN stays NaN), no exp.
template <typename T>
void times_phi_prime_from_phi(const T* phi, int64_t rows, int64_t E, T* x) {
  for (int64_t i = 0; i < rows * E; ++i) x[i] *= std::min(phi[i], T(1));
}

template <typename T>
int64_t valid_keys(const EluLinearParams<T>& p, int64_t nh) {
  return p.key_lengths ? std::clamp<int64_t>(p.key_lengths[nh / p.H], 0, p.S) : p.S;
}

// S = sum phi(k_j) v_j^T (E × M) and z = sum phi(k_j) over the valid keys.
template <typename T>
void key_state(const EluLinearParams<T>& p, const T* k, const T* v, int64_t len, Scratch<T>& w) {
  const int64_t C = p.chunk, E = p.E, M = p.M;
  std::fill(w.s.begin(), w.s.end(), T(0));
  std::fill(w.z.begin(), w.z.end(), T(0));
  for (int64_t j0 = 0; j0 < len; j0 += C) {
    const int64_t rows = std::min(C, len - j0);
    phi_rows(k + j0 * E, rows, rows, E, w.kf.data());
    transpose(w.kf.data(), rows, E, E, w.xt.data(), C);
    gemm(E, M, rows, w.xt.data(), C, v + j0 * M, M, w.s.data(), M, true);
    add_row_sum(w.kf.data(), rows, E, w.z.data());
  }
}

// ---- forward ------------------------------------------------------------

template <typename T>
void forward_causal(const EluLinearForwardArgs<T>& p, int64_t nh, Scratch<T>& w) {
  const int64_t L = p.L, E = p.E, M = p.M, C = p.chunk;
  const int64_t len = valid_keys(p, nh);
  const T* q = p.q + nh * L * E;
  const T* k = p.k + nh * L * E;
  const T* v = p.v + nh * L * M;
  T* out = p.out + nh * L * M;
  T* den = p.den + nh * L;
  std::fill(w.s.begin(), w.s.end(), T(0));
  std::fill(w.z.begin(), w.z.end(), T(0));
  for (int64_t i0 = 0; i0 < L; i0 += C) {
    const int64_t rows = std::min(C, L - i0);
    const bool first = i0 == 0;
    T* oc = out + i0 * M;
    phi_rows(q + i0 * E, rows, rows, E, w.qf.data());
    phi_rows(k + i0 * E, rows, len - i0, E, w.kf.data());
    transpose(w.kf.data(), rows, E, E, w.xt.data(), C);
    gemm(rows, rows, E, w.qf.data(), E, w.xt.data(), C, w.a.data(), C, false);
    keep_lower_triangle(w.a.data(), rows, C);
    if (!first) gemm(rows, M, E, w.qf.data(), E, w.s.data(), M, oc, M, false);
    gemm(rows, M, rows, w.a.data(), C, v + i0 * M, M, oc, M, !first);
    for (int64_t r = 0; r < rows; ++r) {
      T d = p.eps + simd_dot(w.qf.data() + r * E, w.z.data(), E);
      for (int64_t j = 0; j <= r; ++j) d += w.a[r * C + j];
      den[i0 + r] = d;
      const T inv = T(1) / d;
      for (int64_t m = 0; m < M; ++m) oc[r * M + m] *= inv;
    }
    if (i0 + rows < L && i0 < len) {
      gemm(E, M, rows, w.xt.data(), C, v + i0 * M, M, w.s.data(), M, true);
      add_row_sum(w.kf.data(), rows, E, w.z.data());
    }
  }
}

template <typename T>
void forward_full(const EluLinearForwardArgs<T>& p, int64_t nh, Scratch<T>& w) {
  const int64_t L = p.L, S = p.S, E = p.E, M = p.M, C = p.chunk;
  const T* q = p.q + nh * L * E;
  T* out = p.out + nh * L * M;
  T* den = p.den + nh * L;
  key_state(p, p.k + nh * S * E, p.v + nh * S * M, valid_keys(p, nh), w);
  for (int64_t i0 = 0; i0 < L; i0 += C) {
    const int64_t rows = std::min(C, L - i0);
    T* oc = out + i0 * M;
    phi_rows(q + i0 * E, rows, rows, E, w.qf.data());
    gemm(rows, M, E, w.qf.data(), E, w.s.data(), M, oc, M, false);
    for (int64_t r = 0; r < rows; ++r) {
      const T d = p.eps + simd_dot(w.qf.data() + r * E, w.z.data(), E);
      den[i0 + r] = d;
      const T inv = T(1) / d;
      for (int64_t m = 0; m < M; ++m) oc[r * M + m] *= inv;
    }
  }
}

// ---- backward -----------------------------------------------------------

template <typename T>
void backward_causal(const EluLinearBackwardArgs<T>& p, int64_t nh, Scratch<T>& w) {
  const int64_t L = p.L, E = p.E, M = p.M, C = p.chunk;
  const int64_t len = valid_keys(p, nh);
  const T* q = p.q + nh * L * E;
  const T* k = p.k + nh * L * E;
  const T* v = p.v + nh * L * M;
  const T* g = p.grad_out + nh * L * M;
  const T* out = p.out + nh * L * M;
  const T* den = p.den + nh * L;
  T* gq = p.grad_q + nh * L * E;
  T* gk = p.grad_k + nh * L * E;
  T* gv = p.grad_v + nh * L * M;
  T* a = w.a.data();

  // Forward pass: dQ from the prefix states S^T = sum v_j phi(k_j)^T (M × E), z.
  T* st = w.st.data();
  std::fill(w.st.begin(), w.st.end(), T(0));
  std::fill(w.z.begin(), w.z.end(), T(0));
  for (int64_t i0 = 0; i0 < L; i0 += C) {
    const int64_t rows = std::min(C, L - i0);
    const bool first = i0 == 0;
    const T* vc = v + i0 * M;
    T* gqc = gq + i0 * E;
    T* vt = w.xt.data();
    phi_rows(k + i0 * E, rows, len - i0, E, w.kf.data());
    scaled_grads(g + i0 * M, out + i0 * M, den + i0, rows, M, w.gn.data(), w.gd.data());
    transpose(vc, rows, M, M, vt, C);
    // B = gn V^T + gd 1^T, masked (j <= i).
    gemm(rows, rows, M, w.gn.data(), M, vt, C, a, C, false);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j <= r; ++j) a[r * C + j] += w.gd[r];
    keep_lower_triangle(a, rows, C);
    if (!first) gemm(rows, E, M, w.gn.data(), M, st, E, gqc, E, false);
    gemm(rows, E, rows, a, C, w.kf.data(), E, gqc, E, !first);
    if (!first) add_outer(w.gd.data(), w.z.data(), rows, E, gqc);
    times_phi_prime(q + i0 * E, rows, E, gqc);
    if (i0 + rows < L && i0 < len) {
      gemm(M, E, rows, vt, C, w.kf.data(), E, st, E, true);
      add_row_sum(w.kf.data(), rows, E, w.z.data());
    }
  }

  // Reversed pass: dK, dV from the suffix states R = sum phi(q_i) gn_i^T
  // (E × M) and r = sum phi(q_i) gd_i (E).
  T* rs = w.s.data();
  T* rt = w.st.data();
  T* r = w.z.data();
  std::fill(w.s.begin(), w.s.end(), T(0));
  std::fill(w.z.begin(), w.z.end(), T(0));
  const int64_t last = (L - 1) / C * C;
  for (int64_t i0 = last; i0 >= 0; i0 -= C) {
    const int64_t rows = std::min(C, L - i0);
    const int64_t valid = std::clamp<int64_t>(len - i0, 0, rows);
    const bool first = i0 == last;  // R, r are still zero
    const T* vc = v + i0 * M;
    T* gkc = gk + i0 * E;
    T* gvc = gv + i0 * M;
    T* qt = w.xt.data();   // phi(Q_c)^T (E × C)
    T* gnt = w.yt.data();  // gn^T (M × C)
    phi_rows(q + i0 * E, rows, rows, E, w.qf.data());
    scaled_grads(g + i0 * M, out + i0 * M, den + i0, rows, M, w.gn.data(), w.gd.data());
    transpose(w.qf.data(), rows, E, E, qt, C);
    if (valid > 0) {
      phi_rows(k + i0 * E, valid, valid, E, w.kf.data());
      transpose(w.gn.data(), rows, M, M, gnt, C);
      // dV_c = phi(K_c) R + (phi(K_c) phi(Q_c)^T masked i >= j) gn
      gemm(valid, rows, E, w.kf.data(), E, qt, C, a, C, false);
      keep_upper_triangle(a, valid, C);
      if (!first) gemm(valid, M, E, w.kf.data(), E, rs, M, gvc, M, false);
      gemm(valid, M, rows, a, C, w.gn.data(), M, gvc, M, !first);
      // dphi(K_c) = V_c R^T + 1 r^T + B' phi(Q_c), B'_ji = v_j·gn_i + gd_i (i >= j)
      gemm(valid, rows, M, vc, M, gnt, C, a, C, false);
      for (int64_t j = 0; j < valid; ++j)
        for (int64_t i = j; i < rows; ++i) a[j * C + i] += w.gd[i];
      keep_upper_triangle(a, valid, C);
      if (!first) {
        transpose(rs, E, M, M, rt, E);
        gemm(valid, E, M, vc, M, rt, E, gkc, E, false);
      }
      gemm(valid, E, rows, a, C, w.qf.data(), E, gkc, E, !first);
      if (!first) add_outer<T>(nullptr, r, valid, E, gkc);
      times_phi_prime_from_phi(w.kf.data(), valid, E, gkc);
    }
    std::fill(gkc + valid * E, gkc + rows * E, T(0));
    std::fill(gvc + valid * M, gvc + rows * M, T(0));
    if (i0 > 0) {
      gemm(E, M, rows, qt, C, w.gn.data(), M, rs, M, true);
      add_weighted_row_sum(w.qf.data(), w.gd.data(), rows, E, r);
    }
  }
}

template <typename T>
void backward_full(const EluLinearBackwardArgs<T>& p, int64_t nh, Scratch<T>& w) {
  const int64_t L = p.L, S = p.S, E = p.E, M = p.M, C = p.chunk;
  const int64_t len = valid_keys(p, nh);
  const T* q = p.q + nh * L * E;
  const T* k = p.k + nh * S * E;
  const T* v = p.v + nh * S * M;
  const T* g = p.grad_out + nh * L * M;
  const T* out = p.out + nh * L * M;
  const T* den = p.den + nh * L;
  T* gq = p.grad_q + nh * L * E;
  T* gk = p.grad_k + nh * S * E;
  T* gv = p.grad_v + nh * S * M;

  // The forward's key state; S^T for dQ = gn S^T + gd z^T.
  key_state(p, k, v, len, w);
  transpose(w.s.data(), E, M, M, w.st.data(), E);
  // Query pass: dQ, and dS = sum phi(q_i) gn_i^T, dz = sum phi(q_i) gd_i.
  w.init_state_grads(E, M);
  T* ds = w.ds.data();
  T* dz = w.dz.data();
  for (int64_t i0 = 0; i0 < L; i0 += C) {
    const int64_t rows = std::min(C, L - i0);
    T* gqc = gq + i0 * E;
    phi_rows(q + i0 * E, rows, rows, E, w.qf.data());
    scaled_grads(g + i0 * M, out + i0 * M, den + i0, rows, M, w.gn.data(), w.gd.data());
    gemm(rows, E, M, w.gn.data(), M, w.st.data(), E, gqc, E, false);
    add_outer(w.gd.data(), w.z.data(), rows, E, gqc);
    times_phi_prime_from_phi(w.qf.data(), rows, E, gqc);
    transpose(w.qf.data(), rows, E, E, w.xt.data(), C);
    gemm(E, M, rows, w.xt.data(), C, w.gn.data(), M, ds, M, true);
    add_weighted_row_sum(w.qf.data(), w.gd.data(), rows, E, dz);
  }
  // Key pass: dV = phi(K) dS, dphi(K) = V dS^T + 1 dz^T.
  transpose(ds, E, M, M, w.st.data(), E);
  for (int64_t j0 = 0; j0 < S; j0 += C) {
    const int64_t rows = std::min(C, S - j0);
    const int64_t valid = std::clamp<int64_t>(len - j0, 0, rows);
    T* gkc = gk + j0 * E;
    T* gvc = gv + j0 * M;
    if (valid > 0) {
      phi_rows(k + j0 * E, valid, valid, E, w.kf.data());
      gemm(valid, M, E, w.kf.data(), E, ds, M, gvc, M, false);
      gemm(valid, E, M, v + j0 * M, M, w.st.data(), E, gkc, E, false);
      add_outer<T>(nullptr, dz, valid, E, gkc);
      times_phi_prime_from_phi(w.kf.data(), valid, E, gkc);
    }
    std::fill(gkc + valid * E, gkc + rows * E, T(0));
    std::fill(gvc + valid * M, gvc + rows * M, T(0));
  }
}

template <typename T, typename Args, typename Body>
void for_each_head(const Args& p, Body body) {
  const int64_t NH = p.N * p.H;
  if (NH == 0 || p.L == 0) return;
  const int64_t C = std::max<int64_t>(1, p.chunk);
  Args q = p;
  q.chunk = C;
  parallel_items<Scratch<T>>(
      NH, p.num_threads, [&](Scratch<T>& w) { w.init(C, p.E, p.M); },
      [&](int64_t nh, Scratch<T>& w) { body(q, nh, w); });
}

}  // namespace

template <typename T>
void elu_linear_attention_forward_cpu(const EluLinearForwardArgs<T>& p) {
  for_each_head<T>(p, [](const EluLinearForwardArgs<T>& a, int64_t nh, Scratch<T>& w) {
    if (a.causal) {
      forward_causal(a, nh, w);
    } else {
      forward_full(a, nh, w);
    }
  });
}

template <typename T>
void elu_linear_attention_backward_cpu(const EluLinearBackwardArgs<T>& p) {
  // No queries: nothing reaches the keys and values.
  if (p.L == 0) {
    std::fill(p.grad_k, p.grad_k + p.N * p.H * p.S * p.E, T(0));
    std::fill(p.grad_v, p.grad_v + p.N * p.H * p.S * p.M, T(0));
    return;
  }
  for_each_head<T>(p, [](const EluLinearBackwardArgs<T>& a, int64_t nh, Scratch<T>& w) {
    if (a.causal) {
      backward_causal(a, nh, w);
    } else {
      backward_full(a, nh, w);
    }
  });
}

FASTATTN_ISA_END

FASTATTN_CPU_KERNEL(elu_linear_attention_forward_cpu, EluLinearForwardArgs)
FASTATTN_CPU_KERNEL(elu_linear_attention_backward_cpu, EluLinearBackwardArgs)
