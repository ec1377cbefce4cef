// CPU kernels of the per-query top-k attention of improved clustered
// attention (see clustered_topk.h). Per (n, h), per query: K dot products
// with the cluster's keys, a softmax over the kept ones, a weighted sum of
// the values; the backward recomputes the softmax.
#include "kernels/sparse_product/clustered_topk.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/common/parallel.h"
#include "kernels/common/simd.h"

namespace fastattn::kernels {
namespace {

template <typename T>
inline T dot(const T* a, const T* b, int64_t n) {
  using S = Simd<T>;
  auto acc = S::zero();
  int64_t i = 0;
  for (; i + S::W <= n; i += S::W) acc = S::fma(S::load(a + i), S::load(b + i), acc);
  T r = S::hsum(acc);
  for (; i < n; ++i) r += a[i] * b[i];
  return r;
}

// y += alpha · x
template <typename T>
inline void axpy(T alpha, const T* x, T* y, int64_t n) {
  using S = Simd<T>;
  const auto al = S::set1(alpha);
  int64_t i = 0;
  for (; i + S::W <= n; i += S::W) S::store(y + i, S::fma(al, S::load(x + i), S::load(y + i)));
  for (; i < n; ++i) y[i] += alpha * x[i];
}

// Normalised softmax weights p[0, K) of query `q` over the keys idx[0, K);
// keys at index >= len get 0. Returns false when no key is kept.
template <typename T>
bool topk_softmax(const T* q, const T* k, const int64_t* idx, int64_t K, int64_t E, int64_t len,
                  T scale, T* p) {
  T mx = -std::numeric_limits<T>::infinity();
  for (int64_t t = 0; t < K; ++t) {
    if (idx[t] < len) {
      p[t] = scale * dot(q, k + idx[t] * E, E);
      mx = std::max(mx, p[t]);
    }
  }
  if (mx == -std::numeric_limits<T>::infinity()) return false;
  T sum = 0;
  for (int64_t t = 0; t < K; ++t) {
    p[t] = idx[t] < len ? std::exp(p[t] - mx) : T(0);
    sum += p[t];
  }
  const T inv = T(1) / sum;
  for (int64_t t = 0; t < K; ++t) p[t] *= inv;
  return true;
}

template <typename T>
struct Scratch {
  std::vector<T> p, dp, o;
};

}  // namespace

template <typename T>
void clustered_topk_forward_cpu(const ClusteredTopkForwardArgs<T>& a) {
  const int64_t H = a.H, L = a.L, S = a.S, E = a.E, M = a.M, C = a.C, K = a.K;
  parallel_items<Scratch<T>>(
      a.N * H, a.num_threads, [&](Scratch<T>& w) { w.p.resize(K); },
      [&](int64_t nh, Scratch<T>& w) {
        const int64_t len = a.key_lengths ? a.key_lengths[nh / H] : S;
        const T* k = a.k + nh * S * E;
        const T* v = a.v + nh * S * M;
        for (int64_t l = 0; l < L; ++l) {
          T* out = a.out + (nh * L + l) * M;
          std::fill(out, out + M, T(0));
          const int64_t j = a.assignments[nh * L + l];
          if (j < 0) continue;
          const int64_t* idx = a.topk + (nh * C + j) * K;
          if (!topk_softmax(a.q + (nh * L + l) * E, k, idx, K, E, len, a.scale, w.p.data()))
            continue;
          const T m = a.mass[nh * C + j];
          for (int64_t t = 0; t < K; ++t) {
            if (w.p[t] != T(0)) axpy(m * w.p[t], v + idx[t] * M, out, M);
          }
        }
      });
}

template <typename T>
void clustered_topk_backward_cpu(const ClusteredTopkBackwardArgs<T>& a) {
  const int64_t H = a.H, L = a.L, S = a.S, E = a.E, M = a.M, C = a.C, K = a.K;
  parallel_items<Scratch<T>>(
      a.N * H, a.num_threads,
      [&](Scratch<T>& w) {
        w.p.resize(K);
        w.dp.resize(K);
        w.o.resize(M);
      },
      [&](int64_t nh, Scratch<T>& w) {
        const int64_t len = a.key_lengths ? a.key_lengths[nh / H] : S;
        const T* k = a.k + nh * S * E;
        const T* v = a.v + nh * S * M;
        T* gk = a.grad_k + nh * S * E;
        T* gv = a.grad_v + nh * S * M;
        T* gm = a.grad_mass + nh * C;
        std::fill(gk, gk + S * E, T(0));
        std::fill(gv, gv + S * M, T(0));
        std::fill(gm, gm + C, T(0));
        for (int64_t l = 0; l < L; ++l) {
          const T* q = a.q + (nh * L + l) * E;
          const T* g = a.grad_out + (nh * L + l) * M;
          T* gq = a.grad_q + (nh * L + l) * E;
          std::fill(gq, gq + E, T(0));
          const int64_t j = a.assignments[nh * L + l];
          if (j < 0) continue;
          const int64_t* idx = a.topk + (nh * C + j) * K;
          if (!topk_softmax(q, k, idx, K, E, len, a.scale, w.p.data())) continue;
          const T m = a.mass[nh * C + j];
          // out = m · o with o = Σ p_t v_t: d mass = g·o; d p_t = m · g·v_t.
          T g_dot_o = 0, p_dot_dp = 0;
          for (int64_t t = 0; t < K; ++t) {
            if (w.p[t] == T(0)) {
              w.dp[t] = 0;
              continue;
            }
            const T gv_t = dot(g, v + idx[t] * M, M);
            g_dot_o += w.p[t] * gv_t;
            w.dp[t] = m * gv_t;
            p_dot_dp += w.p[t] * w.dp[t];
            axpy(m * w.p[t], g, gv + idx[t] * M, M);
          }
          gm[j] += g_dot_o;
          for (int64_t t = 0; t < K; ++t) {
            if (w.p[t] == T(0)) continue;
            const T ds = w.p[t] * (w.dp[t] - p_dot_dp) * a.scale;
            axpy(ds, k + idx[t] * E, gq, E);
            axpy(ds, q, gk + idx[t] * E, E);
          }
        }
      });
}

template void clustered_topk_forward_cpu<float>(const ClusteredTopkForwardArgs<float>&);
template void clustered_topk_forward_cpu<double>(const ClusteredTopkForwardArgs<double>&);
template void clustered_topk_backward_cpu<float>(const ClusteredTopkBackwardArgs<float>&);
template void clustered_topk_backward_cpu<double>(const ClusteredTopkBackwardArgs<double>&);

}  // namespace fastattn::kernels
