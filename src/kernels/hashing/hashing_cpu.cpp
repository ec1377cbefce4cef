// CPU kernel of sign-of-random-projection hashing (see hashing.h).
//
// The planes are packed transposed and padded to groups of up to four
// vectors, (E + 1, B_pad), so that R queries accumulate a group of
// projections each at a time (eight independent FMA chains: four vectors for
// two queries, two for four, one for eight, every plane vector loaded once
// for all) with one broadcast of x[e] per query and step, starting from the
// biases; the signs become bits (a compare and movemask per vector).
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

// Projections of R rows x[0..R) on VG vectors of planes (the columns of
// w, row stride B_pad, the biases in row E): R·VG independent FMA chains,
// each plane vector loaded once for all R rows; acc (R, B_pad) gets them.
template <typename T, int VG, int R>
void project(const T* const* x, int64_t E, const T* w, int64_t B_pad, T* acc) {
  using S = Simd<T>;
  using V = typename S::V;
  V a[R][VG];
  for (int v = 0; v < VG; ++v) {
    const V bias = S::load(w + E * B_pad + v * S::W);
    for (int r = 0; r < R; ++r) a[r][v] = bias;
  }
  for (int64_t e = 0; e < E; ++e) {
    V wv[VG];
    for (int v = 0; v < VG; ++v) {
      wv[v] = S::load(w + e * B_pad + v * S::W);
      // Kept in a register: GCC otherwise folds the load into each of the R
      // FMAs that use it, R loads per vector, and the loop waits on loads.
      if constexpr (S::W > 1) asm("" : "+v"(wv[v]));
    }
    for (int r = 0; r < R; ++r) {
      const V xe = S::set1(x[r][e]);
      for (int v = 0; v < VG; ++v) a[r][v] = S::fma(xe, wv[v], a[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < VG; ++v) S::store(acc + r * B_pad + v * S::W, a[r][v]);
}

// Codes of the rows of an item, R at a time (the last group repeats its
// final row), planes in groups of VG vectors.
template <typename T, int VG, int R, typename RowOf>
void hash_item(int64_t i0, int64_t i1, int64_t E, const T* pt, int64_t B_pad, RowOf row_of,
               int64_t* codes, T* acc) {
  constexpr int64_t kGroup = VG * Simd<T>::W;
  for (int64_t i = i0; i < i1; i += R) {
    int64_t r[R];
    const T* x[R];
    for (int j = 0; j < R; ++j) {
      r[j] = row_of.index(std::min(i + j, i1 - 1));
      x[j] = row_of.row(r[j]);
    }
    for (int64_t b0 = 0; b0 < B_pad; b0 += kGroup)
      project<T, VG, R>(x, E, pt + b0, B_pad, acc + b0);
    for (int j = 0; j < R && i + j < i1; ++j)
      codes[r[j]] = static_cast<int64_t>(positive_bits(acc + j * B_pad, B_pad));
  }
}

}  // namespace

template <typename T>
void hash_queries_cpu(const HashParams<T>& p) {
  constexpr int64_t W = Simd<T>::W;
  const int64_t E = p.E;
  const int B = p.B;
  // Plane vectors per group: as many as B needs, at most four; then as many
  // rows at once as keep eight FMA chains (32 bits at AVX-512: two vectors,
  // four rows, no padding to 64 planes).
  const int64_t VG = std::min<int64_t>(4, (B + W - 1) / W);
  const int64_t B_pad = (B + VG * W - 1) / (VG * W) * (VG * W);  // <= 64
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
  struct RowOf {
    bool heads_inside;
    int64_t H, L;
    RowStrides xr;
    const T* x;
    int64_t index(int64_t i) const {
      if (!heads_inside) return i;
      const int64_t n = i / (L * H), h = i % H, l = (i / H) % L;
      return (n * H + h) * L + l;
    }
    const T* row(int64_t r) const { return xr.head(x, r / L, H) + (r % L) * xr.sr; }
  };
  const RowOf row_of{p.H > 1 && p.x_rows.sr >= 0 && xr.sh < xr.sr, p.H, L, xr, p.x};
  const int64_t items = (p.rows + kRowsPerItem - 1) / kRowsPerItem;
  struct Scratch {
    std::vector<T> acc;  // (8, B_pad)
  };
  parallel_items<Scratch>(
      items, p.num_threads, [&](Scratch& s) { s.acc.resize(8 * B_pad); },
      [&](int64_t item, Scratch& s) {
        const int64_t i0 = item * kRowsPerItem, i1 = std::min(p.rows, i0 + kRowsPerItem);
        T* acc = s.acc.data();
        const T* w = pt.data();
        switch (VG) {
          case 1:
            return hash_item<T, 1, 8>(i0, i1, E, w, B_pad, row_of, p.codes, acc);
          case 2:
            return hash_item<T, 2, 4>(i0, i1, E, w, B_pad, row_of, p.codes, acc);
          case 3:
            return hash_item<T, 3, 2>(i0, i1, E, w, B_pad, row_of, p.codes, acc);
          default:
            return hash_item<T, 4, 2>(i0, i1, E, w, B_pad, row_of, p.codes, acc);
        }
      });
}

FASTATTN_ISA_END

FASTATTN_CPU_KERNEL(hash_queries_cpu, HashParams)
