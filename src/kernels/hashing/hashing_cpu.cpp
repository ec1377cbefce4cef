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
  // which the hardware prefetcher does not follow); otherwise r = i.
  const bool heads_inside = p.H > 1 && p.x_rows.sr >= 0 && xr.sh < xr.sr;
  const int64_t H = p.H;
  const int64_t items = (p.rows + kRowsPerItem - 1) / kRowsPerItem;
  struct Scratch {
    std::vector<T> acc;       // (R, B_pad)
    std::vector<int64_t> r;   // the item's code indices
    std::vector<const T*> x;  // and their rows
  };
  parallel_items<Scratch>(
      items, p.num_threads,
      [&](Scratch& s) {
        s.acc.resize(R * B_pad);
        s.r.resize(kRowsPerItem);
        s.x.resize(kRowsPerItem);
      },
      [&](int64_t item, Scratch& s) {
        const int64_t i0 = item * kRowsPerItem, i1 = std::min(p.rows, i0 + kRowsPerItem);
        // Code index and row of every i in [i0, i1): divisions once per item,
        // then counters (five divisions per row were a visible part of the
        // kernel on the layers' view).
        if (heads_inside) {
          int64_t n = i0 / (L * H), l = (i0 / H) % L, h = i0 % H;
          for (int64_t i = 0; i < i1 - i0; ++i) {
            s.r[i] = (n * H + h) * L + l;
            s.x[i] = p.x + n * xr.sn + h * xr.sh + l * xr.sr;
            if (++h == H) {
              h = 0;
              if (++l == L) l = 0, ++n;
            }
          }
        } else {
          int64_t nh = i0 / L, l = i0 % L;
          const T* base = xr.head(p.x, nh, H);
          for (int64_t i = 0; i < i1 - i0; ++i) {
            s.r[i] = i0 + i;
            s.x[i] = base + l * xr.sr;
            if (++l == L && i0 + i + 1 < i1) l = 0, base = xr.head(p.x, ++nh, H);
          }
        }
        // R rows at a time; the last group repeats its final row.
        const int64_t m = i1 - i0;
        for (int64_t i = 0; i < m; i += R) {
          const T* x[8];
          for (int64_t j = 0; j < R; ++j) x[j] = s.x[std::min(i + j, m - 1)];
          dirs.project(x, s.acc.data());
          for (int64_t j = 0; j < R && i + j < m; ++j)
            p.codes[s.r[i + j]] =
                static_cast<int64_t>(positive_bits(s.acc.data() + j * B_pad, B_pad));
        }
      });
}

FASTATTN_ISA_END

FASTATTN_CPU_KERNEL(hash_queries_cpu, HashParams)
