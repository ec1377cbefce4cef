// CPU kernels of the causal linear product (see causal_product.h).
//
// Forward, per (n, h), chunks c of C rows in order, S = sum over the earlier
// chunks of k_j v_j^T (F×M):
//   A   = Q_c K_c^T, zeroed above the diagonal        (C×C)
//   O_c = Q_c S + A V_c                                (S: F×M, prefix state)
//   S  += K_c^T V_c
// Backward, per (n, h):
//   forward pass:  B = dO_c V_c^T masked (j <= i); dQ_c = dO_c S^T + B K_c;
//                  S^T += V_c^T K_c  (S^T: M×F, prefix state)
//   reversed pass: R = sum over later chunks of q_i dO_i^T (F×M, suffix state)
//                  A' = K_c Q_c^T masked (i >= j); dV_c = K_c R + A' dO_c
//                  B' = V_c dO_c^T masked (i >= j); dK_c = V_c R^T + B' Q_c
//                  R += Q_c^T dO_c
// All products go through the register-blocked gemm of kernels/common/gemm.h;
// the transposed operands are copied into per-thread C-wide tiles.
#include "kernels/causal_product/causal_product.h"

#include <algorithm>
#include <vector>

#include "kernels/common/isa_target.h"
#include "kernels/common/gemm.h"
#include "kernels/common/parallel.h"

FASTATTN_ISA_BEGIN
namespace {

template <typename T>
struct ForwardScratch {
  std::vector<T> kt;  // K_c^T (F × C)
  std::vector<T> a;   // C × C
  std::vector<T> s;   // prefix state (F × M)
};

template <typename T>
struct BackwardScratch {
  std::vector<T> xt;  // a transposed (F or M) × C tile
  std::vector<T> yt;  // another one
  std::vector<T> a;   // C × C
  std::vector<T> s;   // state (F × M or M × F)
  std::vector<T> st;  // its transpose (reversed pass)
};

}  // namespace

template <typename T>
void causal_product_forward_cpu(const CausalProductForwardArgs<T>& a) {
  const int64_t NH = a.N * a.H, L = a.L, F = a.F, M = a.M;
  const int64_t C = std::max<int64_t>(1, a.chunk);
  if (NH == 0 || L == 0 || M == 0) return;
  parallel_items<ForwardScratch<T>>(
      NH, a.num_threads,
      [&](ForwardScratch<T>& w) {
        w.kt.resize(F * C);
        w.a.resize(C * C);
        w.s.resize(F * M);
      },
      [&](int64_t nh, ForwardScratch<T>& w) {
        const T* q = a.q + nh * L * F;
        const T* k = a.k + nh * L * F;
        const T* v = a.v + nh * L * M;
        T* out = a.out + nh * L * M;
        std::fill(w.s.begin(), w.s.end(), T(0));
        for (int64_t i0 = 0; i0 < L; i0 += C) {
          const int64_t rows = std::min(C, L - i0);
          const T* qc = q + i0 * F;
          const T* kc = k + i0 * F;
          const T* vc = v + i0 * M;
          T* oc = out + i0 * M;
          transpose(kc, rows, F, F, w.kt.data(), C);
          gemm(rows, rows, F, qc, F, w.kt.data(), C, w.a.data(), C, false);
          keep_lower_triangle(w.a.data(), rows, C);
          if (i0 == 0) {
            gemm(rows, M, rows, w.a.data(), C, vc, M, oc, M, false);
          } else {
            gemm(rows, M, F, qc, F, w.s.data(), M, oc, M, false);
            gemm(rows, M, rows, w.a.data(), C, vc, M, oc, M, true);
          }
          if (i0 + rows < L) gemm(F, M, rows, w.kt.data(), C, vc, M, w.s.data(), M, true);
        }
      });
}

template <typename T>
void causal_product_backward_cpu(const CausalProductBackwardArgs<T>& a) {
  const int64_t NH = a.N * a.H, L = a.L, F = a.F, M = a.M;
  const int64_t C = std::max<int64_t>(1, a.chunk);
  if (NH == 0 || L == 0) return;
  if (M == 0) {  // out is empty: every gradient is zero
    std::fill(a.grad_q, a.grad_q + NH * L * F, T(0));
    std::fill(a.grad_k, a.grad_k + NH * L * F, T(0));
    return;
  }
  const int64_t D = std::max(F, M);
  parallel_items<BackwardScratch<T>>(
      NH, a.num_threads,
      [&](BackwardScratch<T>& w) {
        w.xt.resize(D * C);
        w.yt.resize(D * C);
        w.a.resize(C * C);
        w.s.resize(F * M);
        w.st.resize(F * M);
      },
      [&](int64_t nh, BackwardScratch<T>& w) {
        const T* q = a.q + nh * L * F;
        const T* k = a.k + nh * L * F;
        const T* v = a.v + nh * L * M;
        const T* go = a.grad_out + nh * L * M;
        T* gq = a.grad_q + nh * L * F;
        T* gk = a.grad_k + nh * L * F;
        T* gv = a.grad_v + nh * L * M;
        T* vt = w.xt.data();  // V_c^T (M × C)
        T* st = w.s.data();   // S^T = sum v_j k_j^T (M × F)

        // Forward pass: dQ.
        std::fill(w.s.begin(), w.s.end(), T(0));
        for (int64_t i0 = 0; i0 < L; i0 += C) {
          const int64_t rows = std::min(C, L - i0);
          const T* kc = k + i0 * F;
          const T* vc = v + i0 * M;
          const T* goc = go + i0 * M;
          T* gqc = gq + i0 * F;
          transpose(vc, rows, M, M, vt, C);
          gemm(rows, rows, M, goc, M, vt, C, w.a.data(), C, false);
          keep_lower_triangle(w.a.data(), rows, C);
          gemm(rows, F, M, goc, M, st, F, gqc, F, false);
          gemm(rows, F, rows, w.a.data(), C, kc, F, gqc, F, true);
          if (i0 + rows < L) gemm(M, F, rows, vt, C, kc, F, st, F, true);
        }

        // Reversed pass: dK and dV.
        T* qt = w.xt.data();   // Q_c^T (F × C)
        T* got = w.yt.data();  // dO_c^T (M × C)
        T* r = w.s.data();     // R = sum q_i dO_i^T (F × M)
        T* rt = w.st.data();   // R^T (M × F)
        std::fill(w.s.begin(), w.s.end(), T(0));
        const int64_t last = (L - 1) / C * C;
        for (int64_t i0 = last; i0 >= 0; i0 -= C) {
          const int64_t rows = std::min(C, L - i0);
          const T* qc = q + i0 * F;
          const T* kc = k + i0 * F;
          const T* vc = v + i0 * M;
          const T* goc = go + i0 * M;
          T* gkc = gk + i0 * F;
          T* gvc = gv + i0 * M;
          const bool first = i0 == last;  // R is still zero
          transpose(qc, rows, F, F, qt, C);
          transpose(goc, rows, M, M, got, C);
          // dV_c = K_c R + (K_c Q_c^T masked) dO_c
          gemm(rows, rows, F, kc, F, qt, C, w.a.data(), C, false);
          keep_upper_triangle(w.a.data(), rows, C);
          if (!first) gemm(rows, M, F, kc, F, r, M, gvc, M, false);
          gemm(rows, M, rows, w.a.data(), C, goc, M, gvc, M, !first);
          // dK_c = V_c R^T + (V_c dO_c^T masked) Q_c
          gemm(rows, rows, M, vc, M, got, C, w.a.data(), C, false);
          keep_upper_triangle(w.a.data(), rows, C);
          if (!first) {
            transpose(r, F, M, M, rt, F);
            gemm(rows, F, M, vc, M, rt, F, gkc, F, false);
          }
          gemm(rows, F, rows, w.a.data(), C, qc, F, gkc, F, !first);
          if (i0 > 0) gemm(F, M, rows, qt, C, goc, M, r, M, true);
        }
      });
}

FASTATTN_ISA_END

FASTATTN_CPU_KERNEL(causal_product_forward_cpu, CausalProductForwardArgs)
FASTATTN_CPU_KERNEL(causal_product_backward_cpu, CausalProductBackwardArgs)
