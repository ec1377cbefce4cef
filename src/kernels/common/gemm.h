// Register-blocked small matrix products for the attention kernels' tiles:
//   C (M x N, row stride ldc) = [C +] A (M x K, row stride lda) · B (K x N)
// B is either row-major (row stride ldb) or packed in panels of NR = 2·W
// columns (panel p holds rows 0..K-1 of columns [p·NR, p·NR + NR), K·NR
// contiguous values; see pack_panels). The micro-kernel keeps a 6 x NR block
// of C in registers (12 AVX2 accumulators) and streams A by broadcast and B by
// vector loads: thin products (K = 64) run near the FMA peak, which BLAS does
// not reach on such shapes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/common/isa_target.h"
#include "kernels/common/simd.h"

FASTATTN_ISA_BEGIN

// Vectors per micro-kernel row block: 4 where there are 32 vector registers
// (AVX-512: 6 x 4 accumulators, 4 B vectors and a broadcast), else 2 (AVX2's
// 16: 6 x 2 accumulators). On a Xeon with two 512-bit FMA ports the 6 x 4
// block ran thin products (K = 64 or 128) faster than 6 x 2, the broadcasts
// of A being shared by twice the FMAs (git show 5f604de:docs/benchmarks.md,
// "Full attention past SDPA on a Xeon with two 512-bit FMA ports").
#if FASTATTN_SIMD_AVX512
inline constexpr int kWideBlock = 4;
#else
inline constexpr int kWideBlock = 2;
#endif

// Columns of a packed panel: NV vectors.
template <typename T, int NV = 2>
constexpr int panel_width() {
  return NV * Simd<T>::W;
}

// C[MR x NV·W] (+)= A[MR x K] · B[K x NV·W] with B rows ldb apart; with
// n < W (NV = 1), only the first n columns of B and C are read and written
// (masked vector loads and stores). TA: A is given transposed (K x MR, rows
// lda apart: A(i, k) at A[k·lda + i]).
template <typename T, int MR, int NV, bool TA = false>
inline void micro_kernel(int64_t K, const T* __restrict A, int64_t lda, const T* __restrict B,
                         int64_t ldb, T* __restrict C, int64_t ldc, bool accumulate,
                         int n = Simd<T>::W) {
  using S = Simd<T>;
  constexpr int W = S::W;
  const bool part = NV == 1 && n < W;
  const auto ld = [&](const T* p) { return part ? S::load_n(p, n) : S::load(p); };
  typename S::V c[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) c[i][v] = accumulate ? ld(C + i * ldc + v * W) : S::zero();
  for (int64_t k = 0; k < K; ++k) {
    typename S::V b[NV];
    for (int v = 0; v < NV; ++v) b[v] = ld(B + k * ldb + v * W);
    for (int i = 0; i < MR; ++i) {
      const auto a = S::set1(TA ? A[k * lda + i] : A[i * lda + k]);
      for (int v = 0; v < NV; ++v) c[i][v] = S::fma(a, b[v], c[i][v]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) {
      if (part) {
        S::store_n(C + i * ldc + v * W, c[i][v], n);
      } else {
        S::store(C + i * ldc + v * W, c[i][v]);
      }
    }
}

// Rows [0, M) of one column block, in groups of 6 and a remainder (n, TA: as
// micro_kernel's).
template <typename T, int NV, bool TA = false>
inline void column_block(int64_t M, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb,
                         T* C, int64_t ldc, bool accumulate, int n = Simd<T>::W) {
  const int64_t row_step = TA ? 1 : lda;  // A's step from one row of C to the next
  int64_t i = 0;
  for (; i + 6 <= M; i += 6)
    micro_kernel<T, 6, NV, TA>(K, A + i * row_step, lda, B, ldb, C + i * ldc, ldc, accumulate, n);
  const T* a = A + i * row_step;
  T* c = C + i * ldc;
  switch (M - i) {
    case 5:
      micro_kernel<T, 5, NV, TA>(K, a, lda, B, ldb, c, ldc, accumulate, n);
      break;
    case 4:
      micro_kernel<T, 4, NV, TA>(K, a, lda, B, ldb, c, ldc, accumulate, n);
      break;
    case 3:
      micro_kernel<T, 3, NV, TA>(K, a, lda, B, ldb, c, ldc, accumulate, n);
      break;
    case 2:
      micro_kernel<T, 2, NV, TA>(K, a, lda, B, ldb, c, ldc, accumulate, n);
      break;
    case 1:
      micro_kernel<T, 1, NV, TA>(K, a, lda, B, ldb, c, ldc, accumulate, n);
      break;
    default:
      break;
  }
}

// C = [C +] A · B, B row-major with row stride ldb. Fewer than W columns
// left take masked vectors (a scalar loop there made the AVX-512 level
// slower than AVX2 on 8-column tiles: causal linear attention's chunks).
// TA: A is given transposed (gemm_tn).
template <typename T, bool TA = false>
inline void gemm(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb,
                 T* C, int64_t ldc, bool accumulate) {
  constexpr int W = Simd<T>::W;
  int64_t j = 0;
  if constexpr (kWideBlock > 2) {
    for (; j + kWideBlock * W <= N; j += kWideBlock * W)
      column_block<T, kWideBlock, TA>(M, K, A, lda, B + j, ldb, C + j, ldc, accumulate);
    // Three vectors left: one block, not one of two and one of one, whose
    // broadcasts of A each feed few FMAs (112 columns: the transposed scores
    // of 100 queries over a key tile).
    if (N - j == 3 * W) {
      column_block<T, 3, TA>(M, K, A, lda, B + j, ldb, C + j, ldc, accumulate);
      return;
    }
  }
  for (; j + 2 * W <= N; j += 2 * W)
    column_block<T, 2, TA>(M, K, A, lda, B + j, ldb, C + j, ldc, accumulate);
  for (; j < N; j += W) {
    column_block<T, 1, TA>(M, K, A, lda, B + j, ldb, C + j, ldc, accumulate,
                           static_cast<int>(std::min<int64_t>(W, N - j)));
  }
}

// C (M x N) = [C +] A^T · B for A stored K x M (row stride lda): the sums
// over rows (states such as phi(K)^T V) without transposing A first; the
// micro-kernel's broadcasts then read consecutive values of one row of A.
template <typename T>
inline void gemm_tn(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B,
                    int64_t ldb, T* C, int64_t ldc, bool accumulate) {
  gemm<T, true>(M, N, K, A, lda, B, ldb, C, ldc, accumulate);
}

// C = [C +] A · B with B packed in panels of NV vectors (N a multiple of
// panel_width<T, NV>()).
template <typename T, int NV = 2>
inline void gemm_packed(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* Bp, T* C,
                        int64_t ldc, bool accumulate) {
  constexpr int NR = panel_width<T, NV>();
  for (int64_t j = 0; j < N; j += NR)
    column_block<T, NV>(M, K, A, lda, Bp + j * K, NR, C + j, ldc, accumulate);
}

#if FASTATTN_SIMD_AVX2
// out (8 x 8, row stride ldo) = X^T for an 8 x 8 float block (row stride ldx).
inline void transpose_8x8(const float* X, int64_t ldx, float* out, int64_t ldo) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(X + i * ldx);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(out + i * ldo, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(out + (i + 4) * ldo, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}
#endif

#if FASTATTN_SIMD_AVX512
// out (16 x 16, row stride ldo) = X^T for a 16 x 16 float block (row stride
// ldx): a 4 x 4 transpose within each 128-bit lane (as transpose_8x8's first
// two steps), then the 4 x 4 transpose of the lanes in two lane shuffles.
// A third fewer shuffles per value than 8 x 8 blocks and one load and store
// per 64-byte row (for the centroid backward's packing of K and V and its
// transposes of P and dS).
inline void transpose_16x16(const float* X, int64_t ldx, float* out, int64_t ldo) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(X + i * ldx);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  // r[4k + m], lane j: column 4j + m of rows 4k..4k+3.
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  // Column 4j + m gathers lane j of r[m], r[4 + m], r[8 + m], r[12 + m].
  for (int m = 0; m < 4; ++m) {
    const __m512 a02 = _mm512_shuffle_f32x4(r[m], r[4 + m], 0x88);  // lanes 0, 2 of each
    const __m512 a13 = _mm512_shuffle_f32x4(r[m], r[4 + m], 0xdd);  // lanes 1, 3
    const __m512 b02 = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0x88);
    const __m512 b13 = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0xdd);
    _mm512_storeu_ps(out + m * ldo, _mm512_shuffle_f32x4(a02, b02, 0x88));
    _mm512_storeu_ps(out + (4 + m) * ldo, _mm512_shuffle_f32x4(a13, b13, 0x88));
    _mm512_storeu_ps(out + (8 + m) * ldo, _mm512_shuffle_f32x4(a02, b02, 0xdd));
    _mm512_storeu_ps(out + (12 + m) * ldo, _mm512_shuffle_f32x4(a13, b13, 0xdd));
  }
}
#endif

// out (cols x rows, row stride ldo) = X^T for X rows x cols (row stride
// ldx), by 8 x 8 blocks (AVX2 for float) and scalar edges.
template <typename T>
inline void transpose_by_8(const T* X, int64_t rows, int64_t cols, int64_t ldx, T* out,
                           int64_t ldo) {
  constexpr int64_t B = 8;
  for (int64_t r0 = 0; r0 < rows; r0 += B) {
    for (int64_t c0 = 0; c0 < cols; c0 += B) {
#if FASTATTN_SIMD_AVX2
      if constexpr (std::is_same_v<T, float>) {
        if (r0 + B <= rows && c0 + B <= cols) {
          transpose_8x8(X + r0 * ldx + c0, ldx, out + c0 * ldo + r0, ldo);
          continue;
        }
      }
#endif
      for (int64_t r = r0; r < std::min(rows, r0 + B); ++r)
        for (int64_t c = c0; c < std::min(cols, c0 + B); ++c) out[c * ldo + r] = X[r * ldx + c];
    }
  }
}

// out (cols x rows, row stride ldo) = X^T for X rows x cols (row stride
// ldx): float by 16 x 16 blocks where there are 512-bit vectors, the edges
// (and everything elsewhere) by transpose_by_8.
template <typename T>
inline void transpose(const T* X, int64_t rows, int64_t cols, int64_t ldx, T* out, int64_t ldo) {
#if FASTATTN_SIMD_AVX512
  if constexpr (std::is_same_v<T, float>) {
    const int64_t r16 = rows / 16 * 16, c16 = cols / 16 * 16;
    for (int64_t r0 = 0; r0 < r16; r0 += 16)
      for (int64_t c0 = 0; c0 < c16; c0 += 16)
        transpose_16x16(X + r0 * ldx + c0, ldx, out + c0 * ldo + r0, ldo);
    if (c16 < cols) transpose_by_8(X + c16, r16, cols - c16, ldx, out + c16 * ldo, ldo);
    if (r16 < rows) transpose_by_8(X + r16 * ldx, rows - r16, cols, ldx, out + r16, ldo);
    return;
  }
#endif
  transpose_by_8(X, rows, cols, ldx, out, ldo);
}

// Packs X^T into panels for gemm_packed: X is rows x cols (row stride ldx);
// the product's B = X^T is cols x rows, so panel p holds, for every column c
// of X, the rows [p·NR, p·NR + NR) of X: the transpose of X's rows p.. with
// row stride NR. Rows past `rows` are zero-filled up to padded_rows (a
// multiple of NR). out has cols · padded_rows values. Transposing by 8 x 8
// blocks reads X's rows in order; reading a column at a time (one value per
// row) stalled on each row's first touch (in full attention's backward with
// 100 queries, seen in its profile outside the products).
template <typename T, int NV = 2>
inline void pack_transposed_panels(const T* X, int64_t rows, int64_t cols, int64_t ldx,
                                   int64_t padded_rows, T* out) {
  constexpr int NR = panel_width<T, NV>();
  for (int64_t p = 0; p < padded_rows; p += NR) {
    T* panel = out + p * cols;
    const int64_t n = std::clamp<int64_t>(rows - p, 0, NR);
    if (n > 0) transpose(X + p * ldx, n, cols, ldx, panel, NR);
    if (n < NR)
      for (int64_t c = 0; c < cols; ++c) std::fill(panel + c * NR + n, panel + c * NR + NR, T(0));
  }
}

// Zeroes the strictly upper triangle (col > row) of a rows x rows tile.
template <typename T>
inline void keep_lower_triangle(T* a, int64_t rows, int64_t lda) {
  for (int64_t r = 0; r < rows; ++r) std::fill(a + r * lda + r + 1, a + r * lda + rows, T(0));
}

// Zeroes the strictly lower triangle (col < row) of a rows x rows tile.
template <typename T>
inline void keep_upper_triangle(T* a, int64_t rows, int64_t lda) {
  for (int64_t r = 0; r < rows; ++r) std::fill(a + r * lda, a + r * lda + r, T(0));
}

FASTATTN_ISA_END
