// CPU kernel of sign-of-random-projection hashing (see hashing.h).
//
// The planes are packed transposed and padded to groups of four vectors,
// (E + 1, B_pad), so that two queries accumulate four vectors of projections
// each at a time (eight independent FMA chains, every plane vector loaded
// once for both) with one broadcast of x[e] per query and step, starting from
// the biases; the signs become bits (a compare and movemask per vector).
#include "kernels/hashing/hashing.h"

#include <algorithm>
#include <type_traits>
#include <vector>

#include "kernels/common/isa_target.h"
#include "kernels/common/parallel.h"
#include "kernels/common/simd.h"

FASTATTN_ISA_BEGIN
namespace {

constexpr int64_t kRowsPerItem = 256;

// Bits b < B_pad (<= 64) set where acc[b] > 0; padding columns hold 0.
template <typename T>
inline uint64_t positive_bits(const T* acc, int64_t B_pad) {
#if FASTATTN_SIMD_AVX2
  if constexpr (std::is_same_v<T, float>) {
    uint64_t code = 0;
    for (int64_t b0 = 0; b0 < B_pad; b0 += 8) {
      const __m256 gt = _mm256_cmp_ps(_mm256_loadu_ps(acc + b0), _mm256_setzero_ps(), _CMP_GT_OQ);
      code |= static_cast<uint64_t>(_mm256_movemask_ps(gt)) << b0;
    }
    return code;
  }
#endif
  uint64_t code = 0;
  for (int64_t b = 0; b < B_pad; ++b) code |= static_cast<uint64_t>(acc[b] > T(0)) << b;
  return code;
}

}  // namespace

template <typename T>
void hash_queries_cpu(const HashParams<T>& p) {
  using S = Simd<T>;
  using V = typename S::V;
  const int64_t E = p.E;
  const int B = p.B;
  // Four vectors of planes per pass, for two rows at once: eight independent
  // FMA chains, each plane vector loaded once for both rows.
  constexpr int64_t kGroup = 4 * S::W;
  const int64_t B_pad = (B + kGroup - 1) / kGroup * kGroup;  // <= 64
  // pt[e][b] = planes[b][e]; row E holds the biases; padding columns are 0.
  std::vector<T> pt(static_cast<size_t>((E + 1) * B_pad), T(0));
  for (int b = 0; b < B; ++b)
    for (int64_t e = 0; e <= E; ++e) pt[e * B_pad + b] = p.planes[b * (E + 1) + e];
  const RowStrides xr = p.x_rows.resolved(1, p.rows, E);  // sr = E when not given
  const int64_t L = p.x_rows.sr >= 0 ? p.L : p.rows;
  // Rows in memory order: with the heads within a row ((N, L, H, E) viewed
  // as (N, H, L, E)) the i-th row read is head i % H of position i / H (a
  // head at a time would read 1 of every H rows, 2 per 4 KiB page at H = 8,
  // twice as slow at L = 16384); otherwise r = i.
  const bool heads_inside = p.H > 1 && p.x_rows.sr >= 0 && xr.sh < xr.sr;
  const int64_t H = p.H;
  const auto index = [&](int64_t i) {
    if (!heads_inside) return i;
    const int64_t n = i / (L * H), h = i % H, l = (i / H) % L;
    return (n * H + h) * L + l;
  };
  const auto row = [&](int64_t r) { return xr.head(p.x, r / L, H) + (r % L) * xr.sr; };
  const int64_t items = (p.rows + kRowsPerItem - 1) / kRowsPerItem;
  struct Scratch {
    std::vector<T> acc;  // (2, B_pad)
  };
  parallel_items<Scratch>(
      items, p.num_threads, [&](Scratch& s) { s.acc.resize(2 * B_pad); },
      [&](int64_t item, Scratch& s) {
        const int64_t r1 = std::min(p.rows, (item + 1) * kRowsPerItem);
        for (int64_t i = item * kRowsPerItem; i < r1; i += 2) {
          // The second row repeats the first when the item has an odd row out.
          const bool pair = i + 1 < r1;
          const int64_t r = index(i), r_next = pair ? index(i + 1) : r;
          const T* x0 = row(r);
          const T* x1 = row(r_next);
          for (int64_t b0 = 0; b0 < B_pad; b0 += kGroup) {
            const T* w = pt.data() + b0;
            V a[4], c[4];
            for (int v = 0; v < 4; ++v) a[v] = c[v] = S::load(w + E * B_pad + v * S::W);
            for (int64_t e = 0; e < E; ++e) {
              const V xa = S::set1(x0[e]), xc = S::set1(x1[e]);
              const T* we = w + e * B_pad;
              for (int v = 0; v < 4; ++v) {
                const V wv = S::load(we + v * S::W);
                a[v] = S::fma(xa, wv, a[v]);
                c[v] = S::fma(xc, wv, c[v]);
              }
            }
            for (int v = 0; v < 4; ++v) {
              S::store(s.acc.data() + b0 + v * S::W, a[v]);
              S::store(s.acc.data() + B_pad + b0 + v * S::W, c[v]);
            }
          }
          p.codes[r] = static_cast<int64_t>(positive_bits(s.acc.data(), B_pad));
          if (pair)
            p.codes[r_next] = static_cast<int64_t>(positive_bits(s.acc.data() + B_pad, B_pad));
        }
      });
}

FASTATTN_ISA_END

FASTATTN_CPU_KERNEL(hash_queries_cpu, HashParams)
