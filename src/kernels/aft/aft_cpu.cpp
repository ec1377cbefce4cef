// CPU kernels of AFT-simple's scans (see aft.h): vectors over the channels
// (kernels/common/simd.h), branch-free online softmax per channel.
#include "kernels/aft/aft.h"

#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "kernels/common/isa_target.h"
#include "kernels/common/parallel.h"
#include "kernels/common/simd.h"

FASTATTN_ISA_BEGIN

namespace {

// The last key row t sees (aft.h), -1 when none.
inline int64_t last_key(int64_t t, int64_t len, int64_t L, int64_t S, bool causal) {
  return causal ? std::min(t + (S - L), len - 1) : len - 1;
}

// Channels [c, c + n) of a row: a whole vector (n = W) or the row's tail.
template <typename T>
struct Lanes {
  using S = Simd<T>;
  using V = typename S::V;
  static V ld(const T* p, int n) { return n == S::W ? S::load(p) : S::load_n(p, n); }
  static void st(T* p, V v, int n) {
    if (n == S::W) {
      S::store(p, v);
    } else {
      S::store_n(p, v, n);
    }
  }
  // Calls f(c, n) over the channels of a row of E.
  template <typename F>
  static void each(int64_t E, F f) {
    for (int64_t c = 0; c < E; c += S::W) f(c, static_cast<int>(std::min<int64_t>(S::W, E - c)));
  }
  static V sigmoid(V x) {
    const V one = S::set1(T(1));
    return S::div(one, S::add(one, S::exp(S::sub(S::zero(), x))));
  }
  // A key: -inf (and anything below) as the lowest finite value, so that a
  // channel's running maximum is finite after its first key (NaN stays NaN).
  static V key(const T* p, int n) {
    return S::max(S::set1(std::numeric_limits<T>::lowest()), ld(p, n));
  }
};

// Head nh's key length and its q, k, v rows.
template <typename T>
std::tuple<int64_t, const T*, const T*, const T*> head_rows(const AftScanArgs<T>& a, int64_t nh) {
  return {a.key_lengths ? a.key_lengths[nh / a.H] : a.S, a.q + nh * a.L * a.E, a.k + nh * a.S * a.E,
          a.v + nh * a.S * a.E};
}

template <typename T>
struct ScanScratch {
  std::vector<T> x, y, z, w;
};

}  // namespace

template <typename T>
void aft_scan_forward_cpu(const AftScanArgs<T>& a) {
  using S = Simd<T>;
  using Ln = Lanes<T>;
  const int64_t L = a.L, S_ = a.S, E = a.E;
  const T inf = std::numeric_limits<T>::infinity();
  parallel_items<ScanScratch<T>>(
      a.N * a.H, a.num_threads,
      [&](ScanScratch<T>& w) {
        for (auto* b : {&w.x, &w.y, &w.z, &w.w}) b->resize(E);
      },
      [&](int64_t nh, ScanScratch<T>& w) {
        int64_t len;  // (not a structured binding: the lambdas below capture them)
        const T *q, *k, *v;
        std::tie(len, q, k, v) = head_rows(a, nh);
        T* out = a.out + nh * L * E;
        // a and lse only where asked for (the backward's statistics).
        T* avg = a.a ? a.a + nh * L * E : nullptr;
        T* lse = a.lse ? a.lse + nh * L * E : nullptr;
        // Per channel: running maximum, denominator and numerator relative to it.
        T *m = w.x.data(), *den = w.y.data(), *num = w.z.data(), *row_lse = w.w.data();
        std::fill(m, m + E, -inf);
        std::fill(den, den + E, T(0));
        std::fill(num, num + E, T(0));
        auto add_key = [&](int64_t s) {
          Ln::each(E, [&](int64_t c, int n) {
            const auto x = Ln::key(k + s * E + c, n), mv = Ln::ld(m + c, n);
            const auto nm = S::max(mv, x);
            const auto r = S::exp(S::sub(mv, nm)), e = S::exp(S::sub(x, nm));
            Ln::st(den + c, S::fma(Ln::ld(den + c, n), r, e), n);
            Ln::st(num + c, S::fma(Ln::ld(num + c, n), r, S::mul(e, Ln::ld(v + s * E + c, n))), n);
            Ln::st(m + c, nm, n);
          });
        };
        // Row t from the sums (den >= 1 once a key is in: its maximum adds exp(0)).
        auto emit = [&](int64_t t, const T* lse_row) {
          Ln::each(E, [&](int64_t c, int n) {
            const auto av = S::div(Ln::ld(num + c, n), Ln::ld(den + c, n));
            if (avg) Ln::st(avg + t * E + c, av, n);
            Ln::st(out + t * E + c, S::mul(Ln::sigmoid(Ln::ld(q + t * E + c, n)), av), n);
          });
          if (lse) std::copy(lse_row, lse_row + E, lse + t * E);
        };
        auto log_sums = [&] {
          if (!lse) return;
          for (int64_t c = 0; c < E; ++c) row_lse[c] = m[c] + std::log(den[c]);
        };
        auto empty_row = [&](int64_t t) {
          std::fill(out + t * E, out + (t + 1) * E, T(0));
          if (avg) std::fill(avg + t * E, avg + (t + 1) * E, T(0));
          if (lse) std::fill(lse + t * E, lse + (t + 1) * E, -inf);
        };
        if (!a.causal) {  // every row sees the same keys: one set of sums
          for (int64_t s = 0; s < len; ++s) add_key(s);
          log_sums();
          for (int64_t t = 0; t < L; ++t) len > 0 ? emit(t, row_lse) : empty_row(t);
          return;
        }
        int64_t next = 0;  // the first key not yet in the sums
        for (int64_t t = 0; t < L; ++t) {
          const int64_t lim = last_key(t, len, L, S_, true);
          if (lim < 0) {
            empty_row(t);
            continue;
          }
          const bool grew = next <= lim;
          for (; next <= lim; ++next) add_key(next);
          if (grew) log_sums();
          emit(t, row_lse);
        }
      });
}

template <typename T>
void aft_scan_backward_cpu(const AftScanArgs<T>& a) {
  using S = Simd<T>;
  using Ln = Lanes<T>;
  const int64_t L = a.L, S_ = a.S, E = a.E;
  const T inf = std::numeric_limits<T>::infinity();
  parallel_items<ScanScratch<T>>(
      a.N * a.H, a.num_threads,
      [&](ScanScratch<T>& w) {
        for (auto* b : {&w.x, &w.y, &w.z}) b->resize(E);
      },
      [&](int64_t nh, ScanScratch<T>& w) {
        int64_t len;  // (not a structured binding: the lambdas below capture them)
        const T *q, *k, *v;
        std::tie(len, q, k, v) = head_rows(a, nh);
        const T* g = a.grad_out + nh * L * E;
        const T* avg = a.a_in + nh * L * E;
        const T* lse = a.lse_in + nh * L * E;
        T* gq = a.grad_q + nh * L * E;
        T* gk = a.grad_k + nh * S_ * E;
        T* gv = a.grad_v + nh * S_ * E;
        const auto one = S::set1(T(1));
        for (int64_t t = 0; t < L; ++t) {
          Ln::each(E, [&](int64_t c, int n) {
            const int64_t i = t * E + c;
            const auto sg = Ln::sigmoid(Ln::ld(q + i, n));
            const auto d = S::mul(Ln::ld(g + i, n), Ln::ld(avg + i, n));
            Ln::st(gq + i, S::mul(S::mul(d, sg), S::sub(one, sg)), n);
          });
        }
        std::fill(gk + len * E, gk + S_ * E, T(0));
        std::fill(gv + len * E, gv + S_ * E, T(0));
        // The sums over the rows added so far, relative to exp(-ref), ref the
        // lse of the last row added (+inf before any: the first row's factor
        // exp(lse - ref) is then 0).
        T *ref = w.x.data(), *r1 = w.y.data(), *r2 = w.z.data();
        std::fill(ref, ref + E, inf);
        std::fill(r1, r1 + E, T(0));
        std::fill(r2, r2 + E, T(0));
        int64_t t = L - 1;  // the next row to add, going down
        for (int64_t s = len - 1; s >= 0; --s) {
          for (; t >= 0 && last_key(t, len, L, S_, a.causal) >= s; --t) {
            Ln::each(E, [&](int64_t c, int n) {
              const int64_t i = t * E + c;
              const auto l = Ln::ld(lse + i, n);
              const auto da = S::mul(Ln::ld(g + i, n), Ln::sigmoid(Ln::ld(q + i, n)));
              const auto r = S::exp(S::sub(l, Ln::ld(ref + c, n)));
              Ln::st(r1 + c, S::fma(Ln::ld(r1 + c, n), r, da), n);
              Ln::st(r2 + c, S::fma(Ln::ld(r2 + c, n), r, S::mul(da, Ln::ld(avg + i, n))), n);
              Ln::st(ref + c, l, n);
            });
          }
          Ln::each(E, [&](int64_t c, int n) {
            const int64_t i = s * E + c;
            const auto e = S::exp(S::sub(Ln::key(k + i, n), Ln::ld(ref + c, n)));
            const auto s1 = Ln::ld(r1 + c, n);
            Ln::st(gv + i, S::mul(e, s1), n);
            Ln::st(gk + i, S::mul(e, S::sub(S::mul(Ln::ld(v + i, n), s1), Ln::ld(r2 + c, n))), n);
          });
        }
      });
}

FASTATTN_ISA_END

FASTATTN_CPU_KERNEL(aft_scan_forward_cpu, AftScanArgs)
FASTATTN_CPU_KERNEL(aft_scan_backward_cpu, AftScanArgs)
