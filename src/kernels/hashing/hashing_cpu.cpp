// CPU kernel of sign-of-random-projection hashing (see hashing.h).
//
// The projections on the planes (biases as offsets) come R queries at a time
// from PackedDirections (projections.h, shared with Reformer's LSH); their
// signs become bits (a compare and movemask per vector).
#include "kernels/hashing/hashing.h"

#include <algorithm>
#include <type_traits>
#include <vector>

#include "kernels/common/isa_target.h"
#include "kernels/common/parallel.h"
#include "kernels/common/simd.h"
#include "kernels/hashing/projections.h"

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
  const int64_t E = p.E;
  const int B = p.B;
  PackedDirections<T> dirs(E, B);  // <= 64 columns: B <= 64
  for (int b = 0; b < B; ++b)
    for (int64_t e = 0; e <= E; ++e) dirs.set(b, e, p.planes[b * (E + 1) + e]);
  const int64_t B_pad = dirs.stride(), R = dirs.rows();
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
    std::vector<T> acc;  // (R, B_pad)
  };
  parallel_items<Scratch>(
      items, p.num_threads, [&](Scratch& s) { s.acc.resize(R * B_pad); },
      [&](int64_t item, Scratch& s) {
        const int64_t i0 = item * kRowsPerItem, i1 = std::min(p.rows, i0 + kRowsPerItem);
        // R rows at a time; the last group repeats its final row.
        for (int64_t i = i0; i < i1; i += R) {
          int64_t r[8];
          const T* x[8];
          for (int64_t j = 0; j < R; ++j) {
            r[j] = index(std::min(i + j, i1 - 1));
            x[j] = row(r[j]);
          }
          dirs.project(x, s.acc.data());
          for (int64_t j = 0; j < R && i + j < i1; ++j)
            p.codes[r[j]] = static_cast<int64_t>(positive_bits(s.acc.data() + j * B_pad, B_pad));
        }
      });
}

FASTATTN_ISA_END

FASTATTN_CPU_KERNEL(hash_queries_cpu, HashParams)
