// CPU kernels of AFT-simple's scans (see aft.h).
#include "kernels/aft/aft.h"

#include <cmath>
#include <limits>
#include <vector>

#include "kernels/common/isa_target.h"
#include "kernels/common/parallel.h"

FASTATTN_ISA_BEGIN

namespace {

// The last key row t sees (aft.h), -1 when none.
inline int64_t last_key(int64_t t, int64_t len, int64_t L, int64_t S, bool causal) {
  return causal ? std::min(t + (S - L), len - 1) : len - 1;
}

template <typename T>
int64_t key_length(const AftScanArgs<T>& a, int64_t n) {
  return a.key_lengths ? a.key_lengths[n] : a.S;
}

template <typename T>
inline T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

template <typename T>
struct ScanScratch {
  std::vector<T> x, y, z;  // forward: max, denominator, numerator; backward: ref, R1, R2
  std::vector<char> has;
};

}  // namespace

template <typename T>
void aft_scan_forward_cpu(const AftScanArgs<T>& a) {
  const int64_t L = a.L, S = a.S, E = a.E;
  const T inf = std::numeric_limits<T>::infinity();
  parallel_items<ScanScratch<T>>(
      a.N * a.H, a.num_threads,
      [&](ScanScratch<T>& w) {
        w.x.resize(E);
        w.y.resize(E);
        w.z.resize(E);
      },
      [&](int64_t nh, ScanScratch<T>& w) {
        const int64_t len = key_length(a, nh / a.H);
        const T* q = a.q + nh * L * E;
        const T* k = a.k + nh * S * E;
        const T* v = a.v + nh * S * E;
        T* out = a.out + nh * L * E;
        T* avg = a.a + nh * L * E;
        T* lse = a.lse + nh * L * E;
        T *m = w.x.data(), *den = w.y.data(), *num = w.z.data();
        std::fill(m, m + E, -inf);
        std::fill(den, den + E, T(0));
        std::fill(num, num + E, T(0));
        int64_t next = 0;  // the first key not yet in the sums
        for (int64_t t = 0; t < L; ++t) {
          for (const int64_t lim = last_key(t, len, L, S, a.causal); next <= lim; ++next) {
            const T* kr = k + next * E;
            const T* vr = v + next * E;
            for (int64_t c = 0; c < E; ++c) {
              const T x = kr[c];
              if (x == -inf) continue;  // weight 0
              if (x > m[c]) {
                const T r = std::exp(m[c] - x);
                den[c] = den[c] * r + T(1);
                num[c] = num[c] * r + vr[c];
                m[c] = x;
              } else {
                const T e = std::exp(x - m[c]);
                den[c] += e;
                num[c] += e * vr[c];
              }
            }
          }
          const T* qr = q + t * E;
          for (int64_t c = 0; c < E; ++c) {
            const bool some = den[c] > T(0);
            const T av = some ? num[c] / den[c] : T(0);
            avg[t * E + c] = av;
            lse[t * E + c] = some ? m[c] + std::log(den[c]) : -inf;
            out[t * E + c] = sigmoid(qr[c]) * av;
          }
        }
      });
}

template <typename T>
void aft_scan_backward_cpu(const AftScanArgs<T>& a) {
  const int64_t L = a.L, S = a.S, E = a.E;
  const T inf = std::numeric_limits<T>::infinity();
  parallel_items<ScanScratch<T>>(
      a.N * a.H, a.num_threads,
      [&](ScanScratch<T>& w) {
        w.x.resize(E);
        w.y.resize(E);
        w.z.resize(E);
        w.has.resize(E);
      },
      [&](int64_t nh, ScanScratch<T>& w) {
        const int64_t len = key_length(a, nh / a.H);
        const T* q = a.q + nh * L * E;
        const T* k = a.k + nh * S * E;
        const T* v = a.v + nh * S * E;
        const T* g = a.grad_out + nh * L * E;
        const T* avg = a.a_in + nh * L * E;
        const T* lse = a.lse_in + nh * L * E;
        T* gq = a.grad_q + nh * L * E;
        T* gk = a.grad_k + nh * S * E;
        T* gv = a.grad_v + nh * S * E;
        for (int64_t i = 0; i < L * E; ++i) {
          const T sg = sigmoid(q[i]);
          gq[i] = g[i] * avg[i] * sg * (T(1) - sg);
        }
        std::fill(gk + len * E, gk + S * E, T(0));
        std::fill(gv + len * E, gv + S * E, T(0));
        T *ref = w.x.data(), *r1 = w.y.data(), *r2 = w.z.data();
        char* has = w.has.data();
        std::fill(has, has + E, char(0));
        int64_t t = L - 1;  // the next row to add, going down
        for (int64_t s = len - 1; s >= 0; --s) {
          for (; t >= 0 && last_key(t, len, L, S, a.causal) >= s; --t) {
            const T* qr = q + t * E;
            for (int64_t c = 0; c < E; ++c) {
              const T l = lse[t * E + c];
              if (l == -inf) continue;
              const T da = g[t * E + c] * sigmoid(qr[c]);
              const T daa = da * avg[t * E + c];
              if (!has[c]) {
                has[c] = 1;
                r1[c] = da;
                r2[c] = daa;
              } else {
                const T r = std::exp(l - ref[c]);
                r1[c] = r1[c] * r + da;
                r2[c] = r2[c] * r + daa;
              }
              ref[c] = l;
            }
          }
          const T* kr = k + s * E;
          const T* vr = v + s * E;
          for (int64_t c = 0; c < E; ++c) {
            if (!has[c]) {
              gk[s * E + c] = T(0);
              gv[s * E + c] = T(0);
              continue;
            }
            const T e = std::exp(kr[c] - ref[c]);
            gv[s * E + c] = e * r1[c];
            gk[s * E + c] = e * (vr[c] * r1[c] - r2[c]);
          }
        }
      });
}

FASTATTN_ISA_END

FASTATTN_CPU_KERNEL(aft_scan_forward_cpu, AftScanArgs)
FASTATTN_CPU_KERNEL(aft_scan_backward_cpu, AftScanArgs)
