// CPU kernels of fused softmax attention's forward and backward on bfloat16
// operands (see full_attention.h), compiled twice (CMakeLists.txt: the
// *_bf16.cpp sources): at the amx level with the products on AMX tiles, at
// avx512_bf16 with the same products by AVX512-BF16 dot products on the same
// packed operands. Chosen by the op layer for bfloat16 inputs when cpu_isa()
// is one of those two. The forward is described here, the backward at
// full_attention_backward_bf16.
//
// AMX (Intel's Advanced Matrix Extensions): eight tile registers of up to 16
// rows × 64 bytes; tdpbf16ps C += A·B takes A as 16 rows of 32 bfloat16, B
// as 16 rows of 16 bfloat16 pairs ("VNNI" layout: B row k holds the pairs
// (b[2k][n], b[2k+1][n]) of columns n = 0..15) and accumulates C, 16 × 16
// float32. Every tile here is configured 16 × 64 bytes; operands are padded
// with zeros to 32 along the reduction and to 32 rows / columns. At
// avx512_bf16 a "tile" is the same 16 × 64 bytes in memory and B row k is
// one vdpbf16ps operand: C row r's 16 columns += A's pair k of row r
// (broadcast) times it (block_product).
//
// Before the attention, K and V of every head are packed once into B tiles
// (a parallel pass; the packed copies are as large as K and V):
//   K, for S = Q·K^T: [key block of 16][E chunk of 32][pair k][key n] —
//     a tile row holds keys n's elements 2k, 2k+1: a 32-bit transpose of K;
//   V, for O = P·V: [key chunk of 32][column block of 16][pair k][column n]
//     — a tile row holds rows 2k and 2k+1 of V interleaved.
// Per work item (n, h, tile of up to kMaxQueryTile queries, copied into a
// zero-padded bfloat16 buffer), for each tile of kKeyTile keys:
//   S = Q·K^T in blocks of 32 × 32 (tiles 0-3 accumulate, 4-5 hold Q, 6-7
//   K), stored as float32; scale, mask, causal cut and the online softmax
//   in float32 (AVX-512, as the float32 kernel), P = exp(...) rounded to
//   bfloat16 (round to nearest even); O (float32, in the thread's buffer) is
//   rescaled by alpha, then O += P·V in 32 × 32 blocks loaded from and
//   stored back to that buffer. At the end out = bfloat16(O / l), lse = m +
//   log l in float32.
#include "kernels/full/full_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/common/bf16.h"
#include "kernels/common/isa_target.h"
#include "kernels/common/parallel.h"
#include "kernels/common/scratch.h"
#include "kernels/common/simd.h"
#include "kernels/common/softmax_rows.h"

#if FASTATTN_ISA_LEVEL != 3 && FASTATTN_ISA_LEVEL != 4
#error "full_attention_bf16.cpp is compiled at the avx512_bf16 (3) and amx (4) levels only"
#endif

FASTATTN_ISA_BEGIN
namespace {

constexpr int64_t kBlock = 32;          // rows and columns of a block of 2 × 2 tiles
constexpr int64_t kKeyTile = 128;       // keys per online-softmax step
constexpr int64_t kMaxQueryTile = 128;  // queries per work item (a multiple of kBlock)
constexpr int64_t kTileWords = 256;     // 32-bit words per tile (16 rows × 64 bytes)

// ldtilecfg's 64-byte operand: palette 1, tiles 0-7 of 16 rows × 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64);

inline void store_bf16(Bf16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}

// The pair (x[0], x[1]) of bfloat16 bits as one 32-bit word, zeros past n.
inline uint32_t pair_bits(const Bf16* x, int64_t i, int64_t n) {
  const uint32_t lo = i < n ? x[i].bits : 0, hi = i + 1 < n ? x[i + 1].bits : 0;
  return lo | hi << 16;
}

// The 16-bit lanes of lo and hi interleaved: the words lo[n] | hi[n] << 16.
inline __m512i interleave16(__m256i lo, __m256i hi) {
  return _mm512_or_si512(_mm512_cvtepu16_epi32(lo),
                         _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
}

// The 16 × 16 32-bit words at src (rows ld words apart) transposed into dst
// (rows 16 words apart): unpacks within 128-bit lanes, then lane shuffles.
inline void transpose16x16(const uint32_t* src, int64_t ld, uint32_t* dst) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * ld);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // r[4g + j]: rows 4g..4g+3 at columns j, j+4, j+8, j+12 (one per 128-bit lane).
  for (int g = 0; g < 16; g += 4) {
    r[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    r[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    r[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    r[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i v0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88);
    const __m512i w0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xdd);
    const __m512i v1 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88);
    const __m512i w1 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xdd);
    _mm512_storeu_si512(dst + j * 16, _mm512_shuffle_i32x4(v0, v1, 0x88));
    _mm512_storeu_si512(dst + (j + 8) * 16, _mm512_shuffle_i32x4(v0, v1, 0xdd));
    _mm512_storeu_si512(dst + (j + 4) * 16, _mm512_shuffle_i32x4(w0, w1, 0x88));
    _mm512_storeu_si512(dst + (j + 12) * 16, _mm512_shuffle_i32x4(w0, w1, 0xdd));
  }
}

// Keys [b·16, b·16 + 16) of a head (rows ld apart, S keys, E values each)
// as the E chunks' B tiles of S = Q·K^T: a 32-bit transpose where the block
// is whole (and ld even: a whole number of words between rows), else word by
// word.
void pack_key_block(const Bf16* kh, int64_t ld, int64_t S, int64_t E, int64_t chunks, int64_t b,
                    uint32_t* dst) {
  for (int64_t c = 0; c < chunks; ++c) {
    uint32_t* t = dst + c * kTileWords;
    if (b * 16 + 16 <= S && c * 32 + 32 <= E && ld % 2 == 0) {
      transpose16x16(reinterpret_cast<const uint32_t*>(kh + b * 16 * ld + c * 32), ld / 2, t);
      continue;
    }
    for (int64_t n = 0; n < 16; ++n) {
      const int64_t key = b * 16 + n;
      for (int64_t k = 0; k < 16; ++k)
        t[k * 16 + n] = key < S ? pair_bits(kh + key * ld, c * 32 + 2 * k, E) : 0;
    }
  }
}

// Keys [kc·32, kc·32 + 32) of a head's V (rows ld apart, S rows of M values)
// as the column blocks' B tiles of O = P·V.
void pack_value_chunk(const Bf16* vh, int64_t ld, int64_t S, int64_t M, int64_t col_blocks,
                      int64_t kc, uint32_t* dst) {
  for (int64_t cb = 0; cb < col_blocks; ++cb) {
    uint32_t* t = dst + cb * kTileWords;
    for (int64_t k = 0; k < 16; ++k) {
      const int64_t r0 = kc * 32 + 2 * k;
      const Bf16* a = r0 < S ? vh + r0 * ld : nullptr;
      const Bf16* b = r0 + 1 < S ? vh + (r0 + 1) * ld : nullptr;
      if (b && cb * 16 + 16 <= M) {  // the two rows' 16 columns, interleaved
        _mm512_storeu_si512(
            t + k * 16,
            interleave16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + cb * 16)),
                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + cb * 16))));
        continue;
      }
      for (int64_t n = 0; n < 16; ++n) {
        const int64_t col = cb * 16 + n;
        const uint32_t lo = a && col < M ? a[col].bits : 0, hi = b && col < M ? b[col].bits : 0;
        t[k * 16 + n] = lo | hi << 16;
      }
    }
  }
}

// C (rows × 32 blocks of float32, ldc floats apart) = or += A · B for the
// 32 × 32 block at a (32 rows of `chunks` · 32 bfloat16, lda elements apart,
// lda even) and the B tiles b0 (columns 0-15) and b1 (16-31), each `chunks`
// tiles bstride words apart. accumulate: C's tiles are loaded first.
#if FASTATTN_ISA_LEVEL == 4
inline void block_product(const Bf16* a, int64_t lda, const uint32_t* b0, const uint32_t* b1,
                          int64_t bstride, int64_t chunks, float* c, int64_t ldc, bool accumulate) {
  const int64_t sa = lda * 2, sc = ldc * 4;
  if (accumulate) {
    _tile_loadd(0, c, sc);
    _tile_loadd(1, c + 16, sc);
    _tile_loadd(2, c + 16 * ldc, sc);
    _tile_loadd(3, c + 16 * ldc + 16, sc);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k = 0; k < chunks; ++k) {
    _tile_loadd(4, a + k * 32, sa);
    _tile_loadd(5, a + 16 * lda + k * 32, sa);
    _tile_loadd(6, b0 + k * bstride, 64);
    _tile_loadd(7, b1 + k * bstride, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, sc);
  _tile_stored(1, c + 16, sc);
  _tile_stored(2, c + 16 * ldc, sc);
  _tile_stored(3, c + 16 * ldc + 16, sc);
}
#else
// The same by vdpbf16ps, in groups of kRows rows of C held in registers
// (2 · kRows accumulators): per pair k of a chunk, B's rows k of b0 and b1
// are loaded once for the group and each row's pair word of A is a broadcast
// operand. Sums pair by pair, chunk by chunk, onto C; the tiles' order
// within a chunk is theirs, so the two levels may differ in float32 rounding.
inline void block_product(const Bf16* a, int64_t lda, const uint32_t* b0, const uint32_t* b1,
                          int64_t bstride, int64_t chunks, float* c, int64_t ldc, bool accumulate) {
  constexpr int kRows = 8;
  for (int64_t r0 = 0; r0 < kBlock; r0 += kRows) {
    __m512 acc[kRows][2];
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const float* cr = c + (r0 + r) * ldc;
      acc[r][0] = accumulate ? _mm512_loadu_ps(cr) : _mm512_setzero_ps();
      acc[r][1] = accumulate ? _mm512_loadu_ps(cr + 16) : _mm512_setzero_ps();
    }
    for (int64_t k = 0; k < chunks; ++k) {
      const uint32_t* t0 = b0 + k * bstride;
      const uint32_t* t1 = b1 + k * bstride;
      const Bf16* ak = a + r0 * lda + k * 32;
      for (int p = 0; p < 16; ++p) {
        const auto x0 = (__m512bh)_mm512_loadu_si512(t0 + p * 16);
        const auto x1 = (__m512bh)_mm512_loadu_si512(t1 + p * 16);
#pragma GCC unroll 8
        for (int r = 0; r < kRows; ++r) {
          uint32_t word;
          std::memcpy(&word, ak + r * lda + 2 * p, sizeof word);
          const auto w = (__m512bh)_mm512_set1_epi32(static_cast<int>(word));
          acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x0, w);
          acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x1, w);
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      float* cr = c + (r0 + r) * ldc;
      _mm512_storeu_ps(cr, acc[r][0]);
      _mm512_storeu_ps(cr + 16, acc[r][1]);
    }
  }
}
#endif

// min(n, 32) bfloat16 at p, the rest zero, without reading past them.
inline __m512i load_bf16_n(const Bf16* p, int64_t n) {
  return _mm512_maskz_loadu_epi16(n >= 32 ? ~__mmask32{0} : (__mmask32{1} << n) - 1, p);
}

// min(n, 16) bfloat16 at p, the rest zero, widened to float32.
inline __m512 widen16(const Bf16* p, int64_t n = 16) {
  const __m256i b = _mm256_maskz_loadu_epi16(n >= 16 ? __mmask16(0xffff) : (1u << n) - 1, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

// row[c] = row[c] · scale + mask[c] for c < limit, -inf from there to
// width (a multiple of 16); returns the row's max. The mask (bfloat16, no
// read past limit) may be null.
inline float prepare_row(float* row, const Bf16* mask, int64_t limit, int64_t width, float scale) {
  const __m512 sc = _mm512_set1_ps(scale), cut = _mm512_set1_ps(neg_inf<float>());
  __m512 mx = cut;
  for (int64_t c = 0; c < width; c += 16) {
    const int64_t n = std::clamp<int64_t>(limit - c, 0, 16);
    const auto keep = static_cast<__mmask16>((1u << n) - 1);
    __m512 x = _mm512_mul_ps(_mm512_loadu_ps(row + c), sc);
    if (mask) x = _mm512_add_ps(x, widen16(mask + c, n));
    x = _mm512_mask_blend_ps(keep, cut, x);
    _mm512_storeu_ps(row + c, x);
    mx = _mm512_max_ps(mx, x);
  }
  return Simd<float>::hmax(mx);
}

// 2^t, for P rounded to bfloat16 (8 significant bits): a degree-4
// polynomial on the fraction (relative error 2.7e-6, least squares weighted
// by 1/2^f on [-0.5, 0.5]) scaled by 2^n in one vscalefps; t below -125
// (-inf, NaN) gives 0 through the mask, never a subnormal, whose microcode
// assists made the causal forward slower than the full one. Nine
// instructions where Simd<float>::exp takes fifteen: the softmax, not the
// tiles, bounds this kernel (the products were under half of the forward;
// git show 5f604de:docs/benchmarks.md, "bfloat16 full attention on AMX
// tiles").
inline __m512 exp2_bf16(__m512 t) {
  const __mmask16 normal = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-125.0f), _CMP_GE_OQ);
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(0.00956051983579609f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.0559171228632387f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2402498165047564f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931219575470341f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.9999991904522163f));
  return _mm512_maskz_scalef_ps(normal, p, n);
}

// p[0, width) = bfloat16(exp(row · scale - shift)); returns the float32 sum.
inline float exp_to_bf16(const float* row, int64_t width, float shift, float scale, Bf16* p) {
  constexpr float kLog2e = 1.4426950408889634f;
  const __m512 sc = _mm512_set1_ps(scale * kLog2e), sh = _mm512_set1_ps(-shift * kLog2e);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t c = 0; c < width; c += 16) {
    const __m512 e = exp2_bf16(_mm512_fmadd_ps(_mm512_loadu_ps(row + c), sc, sh));
    store_bf16(p + c, e);
    sum = _mm512_add_ps(sum, e);
  }
  return Simd<float>::hsum(sum);
}

// This thread's tile configuration, loaded by configure() and released
// when the thread's scratch goes; nothing at avx512_bf16.
struct Tiles {
#if FASTATTN_ISA_LEVEL == 4
  bool configured = false;
  void configure() {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) {
      cfg.colsb[t] = 64;
      cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
    configured = true;
  }
  ~Tiles() {
    if (configured) _tile_release();
  }
#else
  void configure() {}
#endif
};

struct Scratch {
  std::vector<Bf16> q, p;   // the query tile (rows × Ep), P (rows × kKeyTile)
  std::vector<float> s, o;  // scores (rows × kKeyTile), O (rows × Mp)
  std::vector<float> m, l;  // running row max and sum
  Tiles tiles;
};

// rows × cols of a head (rows ld apart) into dst (rp × cp, zero-padded),
// and, when dst_t is given, transposed into dst_t (cp × rp).
void copy_padded(const Bf16* src, int64_t ld, int64_t rows, int64_t cols, int64_t rp, int64_t cp,
                 Bf16* dst, Bf16* dst_t) {
  for (int64_t r = 0; r < rp; ++r) {
    Bf16* d = dst + r * cp;
    if (r < rows) {
      std::copy(src + r * ld, src + r * ld + cols, d);
      std::fill(d + cols, d + cp, Bf16{0});
    } else {
      std::fill(d, d + cp, Bf16{0});
    }
  }
  if (!dst_t) return;
  for (int64_t c = 0; c < cp; ++c)
    for (int64_t r = 0; r < rp; ++r) dst_t[c * rp + r] = dst[r * cp + c];
}

// Rows r and r + 1 (float32, 16 keys each) as one B-tile row over queries:
// the 16 words (x[r][n] | x[r + 1][n] << 16) in bfloat16.
inline void store_pair_row(const float* x0, const float* x1, uint32_t* dst) {
  _mm512_storeu_si512(dst, interleave16((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x0)),
                                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x1))));
}

constexpr int64_t kBwdKeys = 64;      // keys per backward tile
constexpr int64_t kBwdQueries = 128;  // queries per step over a key tile

struct BackwardScratch {
  std::vector<float> s, dp;       // P and dS in float32 (kBwdQueries × kBwdKeys)
  std::vector<uint32_t> pp, dsp;  // P and dS as B tiles over queries
  std::vector<Bf16> ds;           // dS rows in bfloat16 (A of dQ)
  std::vector<float> dkt, dvt;    // dK^T (Ep × kBwdKeys), dV^T (Mp × kBwdKeys)
  Tiles tiles;
};

}  // namespace

// The backward (FlashAttention-2 order, as the float32 kernel) with the five
// products per (key tile, query step) on tiles:
//   S = Q·K^T and dP = dO·V^T   (A: Q, dO rows; B: K, V 32-bit transposed),
//   dV^T += dO^T·P, dK^T += Q^T·dS   (A: dO^T, Q^T; B: P, dS over queries),
//   dQ += dS·K   (A: dS rows; B: K's row pairs interleaved);
// P = exp(S·scale + mask - lse) and dS = P ∘ (dP - delta) · scale in float32.
void full_attention_backward_bf16(const FullAttentionBackwardArgs<Bf16>& args) {
  auto a = args;
  resolve_qkv_rows(a);
  resolve_grad_rows(a);
  const int64_t N = a.N, H = a.H, L = a.L, S = a.S, E = a.E, M = a.M;
  const int64_t NH = N * H;
  if (NH == 0 || L == 0 || S == 0) {
    zero_all_rows(a.grad_q, a.grad_q_rows, NH, H, L, E);
    zero_all_rows(a.grad_k, a.grad_k_rows, NH, H, S, E);
    if (a.grad_v) zero_all_rows(a.grad_v, a.grad_v_rows, NH, H, S, M);
    return;
  }
  const int64_t Ep = round_up(E, kBlock), Mp = round_up(M, kBlock), Sp = round_up(S, kBwdKeys);
  const int64_t Lp = round_up(L, kBlock);
  const int64_t e_chunks = Ep / 32, m_chunks = Mp / 32, e_blocks = Ep / 16;
  // Per head: K and V 32-bit transposed (B of S, dP), K's row pairs (B of
  // dQ), Q and dO padded (A of S, dP) and transposed (A of dK^T, dV^T).
  const int64_t wk = Sp * Ep / 2, wv = Sp * Mp / 2;
  ScratchArray<uint32_t> kt(static_cast<size_t>(NH * wk)), vt(static_cast<size_t>(NH * wv)),
      kpair(static_cast<size_t>(NH * wk));
  ScratchArray<Bf16> qr(static_cast<size_t>(NH * Lp * Ep)), qt(static_cast<size_t>(NH * Lp * Ep)),
      dor(static_cast<size_t>(NH * Lp * Mp)), dot(static_cast<size_t>(NH * Lp * Mp));
  {
    const int64_t chunks32 = Sp / kBlock;
    parallel_for_items(NH * (chunks32 + 1), a.num_threads, [&](int64_t item) {
      const int64_t nh = item / (chunks32 + 1), kc = item % (chunks32 + 1);
      if (kc == chunks32) {  // this head's queries and output gradients
        copy_padded(a.q_rows.head(a.q, nh, H), a.q_rows.sr, L, E, Lp, Ep, qr.get() + nh * Lp * Ep,
                    qt.get() + nh * Lp * Ep);
        copy_padded(a.grad_out_rows.head(a.grad_out, nh, H), a.grad_out_rows.sr, L, M, Lp, Mp,
                    dor.get() + nh * Lp * Mp, dot.get() + nh * Lp * Mp);
        return;
      }
      const Bf16* kh = a.k_rows.head(a.k, nh, H);
      const Bf16* vh = a.v_rows.head(a.v, nh, H);
      for (int64_t b = 2 * kc; b < 2 * kc + 2; ++b) {
        pack_key_block(kh, a.k_rows.sr, S, E, e_chunks, b,
                       kt.get() + nh * wk + b * e_chunks * kTileWords);
        pack_key_block(vh, a.v_rows.sr, S, M, m_chunks, b,
                       vt.get() + nh * wv + b * m_chunks * kTileWords);
      }
      pack_value_chunk(kh, a.k_rows.sr, S, E, e_blocks, kc,
                       kpair.get() + nh * wk + kc * e_blocks * kTileWords);
    });
  }

  const int64_t k_tiles = (S + kBwdKeys - 1) / kBwdKeys;
  const int64_t offset = S - L;
  const int64_t splits =
      std::min<int64_t>(k_tiles, std::max<int64_t>(1, (2 * a.num_threads + NH - 1) / NH));
  ScratchArray<float> dq_parts(static_cast<size_t>(NH * splits * Lp * Ep));
  const float scale = a.scale;
  constexpr float kLog2e = 1.4426950408889634f;

  parallel_items<BackwardScratch>(
      NH * splits, a.num_threads,
      [&](BackwardScratch& w) {
        w.s.resize(kBwdQueries * kBwdKeys);
        w.dp.resize(kBwdQueries * kBwdKeys);
        w.pp.resize(kBwdQueries * kBwdKeys / 2);
        w.dsp.resize(kBwdQueries * kBwdKeys / 2);
        w.ds.resize(kBwdQueries * kBwdKeys);
        w.dkt.resize(Ep * kBwdKeys);
        w.dvt.resize(Mp * kBwdKeys);
        w.tiles.configure();
      },
      [&](int64_t item, BackwardScratch& w) {
        const int64_t nh = item / splits, split = item % splits, n = nh / H, h = nh % H;
        const int64_t len = a.key_lengths ? a.key_lengths[n] : S;
        const Bf16* qrh = qr.get() + nh * Lp * Ep;
        const Bf16* qth = qt.get() + nh * Lp * Ep;
        const Bf16* dorh = dor.get() + nh * Lp * Mp;
        const Bf16* doth = dot.get() + nh * Lp * Mp;
        const uint32_t* kth = kt.get() + nh * wk;
        const uint32_t* vth = vt.get() + nh * wv;
        const uint32_t* kph = kpair.get() + nh * wk;
        const float* lse = a.lse + nh * L;
        const float* delta = a.delta + nh * L;
        float* dq = dq_parts.get() + (nh * splits + split) * Lp * Ep;
        std::fill(dq, dq + Lp * Ep, 0.0f);
        zero_key_grads_past(a, nh, len, kBwdKeys, split, splits);
        for (int64_t t = split; t * kBwdKeys < len; t += splits) {
          const int64_t j0 = t * kBwdKeys;
          const int64_t cols = std::min(kBwdKeys, len - j0);
          const int64_t width = round_up(cols, kBlock);
          std::fill(w.dkt.begin(), w.dkt.end(), 0.0f);
          std::fill(w.dvt.begin(), w.dvt.end(), 0.0f);
          const int64_t i_start =
              a.causal ? std::max<int64_t>(0, j0 - offset) / kBlock * kBlock : 0;
          for (int64_t i0 = i_start; i0 < L; i0 += kBwdQueries) {
            const int64_t rows = std::min(kBwdQueries, L - i0);
            const int64_t rp = round_up(rows, kBlock);
            // S and dP, 32 × 32 blocks.
            for (int64_t r0 = 0; r0 < rp; r0 += kBlock) {
              for (int64_t c0 = 0; c0 < width; c0 += kBlock) {
                const uint32_t* kb = kth + (j0 + c0) / 16 * e_chunks * kTileWords;
                block_product(qrh + (i0 + r0) * Ep, Ep, kb, kb + e_chunks * kTileWords, kTileWords,
                              e_chunks, w.s.data() + r0 * kBwdKeys + c0, kBwdKeys, false);
                const uint32_t* vb = vth + (j0 + c0) / 16 * m_chunks * kTileWords;
                block_product(dorh + (i0 + r0) * Mp, Mp, vb, vb + m_chunks * kTileWords, kTileWords,
                              m_chunks, w.dp.data() + r0 * kBwdKeys + c0, kBwdKeys, false);
              }
            }
            // P and dS in float32 (in place of S and dP); rows past L and
            // rows without a kept key give zeros.
            for (int64_t r = 0; r < rp; ++r) {
              const int64_t i = i0 + r;
              float* prow = w.s.data() + r * kBwdKeys;
              float* dsrow = w.dp.data() + r * kBwdKeys;
              if (r >= rows || lse[i] == neg_inf<float>()) {
                std::fill(prow, prow + width, 0.0f);
                std::fill(dsrow, dsrow + width, 0.0f);
                continue;
              }
              const int64_t limit =
                  a.causal ? std::clamp<int64_t>(i + offset + 1 - j0, 0, cols) : cols;
              float sc = scale * kLog2e;
              if (a.mask || limit != width) {
                const Bf16* mrow =
                    a.mask ? a.mask + n * a.mask_sn + h * a.mask_sh + i * a.mask_sl + j0 : nullptr;
                prepare_row(prow, mrow, limit, width, scale);
                sc = kLog2e;
              }
              const __m512 vsc = _mm512_set1_ps(sc), vsh = _mm512_set1_ps(-lse[i] * kLog2e);
              const __m512 vd = _mm512_set1_ps(delta[i]), vscale = _mm512_set1_ps(scale);
              for (int64_t c = 0; c < width; c += 16) {
                const __m512 pv = exp2_bf16(_mm512_fmadd_ps(_mm512_loadu_ps(prow + c), vsc, vsh));
                _mm512_storeu_ps(prow + c, pv);
                const __m512 g = _mm512_sub_ps(_mm512_loadu_ps(dsrow + c), vd);
                _mm512_storeu_ps(dsrow + c, _mm512_mul_ps(_mm512_mul_ps(pv, g), vscale));
              }
            }
            // P and dS as B tiles over queries ([32-query chunk][16-key
            // block][pair][key]), dS rows in bfloat16.
            const int64_t kb16 = width / 16;
            for (int64_t r = 0; r < rp; r += 2) {
              for (int64_t b = 0; b < kb16; ++b) {
                const int64_t at =
                    ((r / 32) * (kBwdKeys / 16) + b) * kTileWords + (r % 32) / 2 * 16;
                store_pair_row(w.s.data() + r * kBwdKeys + b * 16,
                               w.s.data() + (r + 1) * kBwdKeys + b * 16, w.pp.data() + at);
                store_pair_row(w.dp.data() + r * kBwdKeys + b * 16,
                               w.dp.data() + (r + 1) * kBwdKeys + b * 16, w.dsp.data() + at);
              }
            }
            for (int64_t r = 0; r < rp; ++r)
              for (int64_t c = 0; c < width; c += 16)
                store_bf16(w.ds.data() + r * kBwdKeys + c,
                           _mm512_loadu_ps(w.dp.data() + r * kBwdKeys + c));
            // dV^T += dO^T·P and dK^T += Q^T·dS over these queries.
            const int64_t qchunks = rp / 32, bstride = (kBwdKeys / 16) * kTileWords;
            for (int64_t c0 = 0; c0 < width; c0 += kBlock) {
              const uint32_t* pb = w.pp.data() + c0 / 16 * kTileWords;
              const uint32_t* db = w.dsp.data() + c0 / 16 * kTileWords;
              if (a.grad_v) {
                for (int64_t m0 = 0; m0 < Mp; m0 += kBlock)
                  block_product(doth + m0 * Lp + i0, Lp, pb, pb + kTileWords, bstride, qchunks,
                                w.dvt.data() + m0 * kBwdKeys + c0, kBwdKeys, true);
              }
              for (int64_t e0 = 0; e0 < Ep; e0 += kBlock)
                block_product(qth + e0 * Lp + i0, Lp, db, db + kTileWords, bstride, qchunks,
                              w.dkt.data() + e0 * kBwdKeys + c0, kBwdKeys, true);
            }
            // dQ += dS·K
            const uint32_t* kc = kph + j0 / 32 * e_blocks * kTileWords;
            for (int64_t r0 = 0; r0 < rp; r0 += kBlock)
              for (int64_t e0 = 0; e0 < Ep; e0 += kBlock)
                block_product(w.ds.data() + r0 * kBwdKeys, kBwdKeys, kc + e0 / 16 * kTileWords,
                              kc + (e0 / 16 + 1) * kTileWords, e_blocks * kTileWords, width / 32,
                              dq + (i0 + r0) * Ep + e0, Ep, true);
          }
          // dK and dV of this key tile, transposed back and rounded.
          Bf16* gk = a.grad_k_rows.head(a.grad_k, nh, H) + j0 * a.grad_k_rows.sr;
          for (int64_t c = 0; c < cols; ++c)
            for (int64_t e = 0; e < E; ++e)
              gk[c * a.grad_k_rows.sr + e].bits = bf16_bits(w.dkt[e * kBwdKeys + c]);
          if (a.grad_v) {
            Bf16* gv = a.grad_v_rows.head(a.grad_v, nh, H) + j0 * a.grad_v_rows.sr;
            for (int64_t c = 0; c < cols; ++c)
              for (int64_t m = 0; m < M; ++m)
                gv[c * a.grad_v_rows.sr + m].bits = bf16_bits(w.dvt[m * kBwdKeys + c]);
          }
        }
      });

  // dQ: the splits' parts summed, rounded once.
  parallel_for_items(NH, a.num_threads, [&](int64_t nh) {
    Bf16* dst = a.grad_q_rows.head(a.grad_q, nh, H);
    const float* part = dq_parts.get() + nh * splits * Lp * Ep;
    for (int64_t i = 0; i < L; ++i) {
      for (int64_t e = 0; e < E; ++e) {
        float sum = 0;
        for (int64_t sp = 0; sp < splits; ++sp) sum += part[sp * Lp * Ep + i * Ep + e];
        dst[i * a.grad_q_rows.sr + e].bits = bf16_bits(sum);
      }
    }
  });
}

// One query per (n, h), no mask (token-by-token decoding over a cache): K
// and V are read once, in place, with no packing; q·k by vdpbf16ps (pairs of
// bfloat16 products summed in float32), the softmax in float32, out = Σ p v
// with V's rows widened in registers. The tiles would compute 32 query rows
// for one and pack all of K and V first.
void single_query_forward(const FullAttentionForwardArgs<Bf16>& a) {
  const int64_t H = a.H, S = a.S, E = a.E, M = a.M;
  const int64_t mv = (M + 15) / 16;
  parallel_items<std::vector<float>>(
      a.N * H, a.num_threads, [&](std::vector<float>& s) { s.resize(round_up(S, 16) + 16 * mv); },
      [&](int64_t nh, std::vector<float>& s) {
        const Bf16* q = a.q_rows.head(a.q, nh, H);
        const Bf16* kh = a.k_rows.head(a.k, nh, H);
        const Bf16* vh = a.v_rows.head(a.v, nh, H);
        Bf16* out = a.out_rows.head(a.out, nh, H);
        const int64_t lk = a.k_rows.sr, lv = a.v_rows.sr;
        const int64_t kend = a.key_lengths ? a.key_lengths[nh / H] : S;
        if (kend == 0) {
          std::fill(out, out + M, Bf16{0});
          a.lse[nh] = neg_inf<float>();
          return;
        }
        float* sc = s.data();
        for (int64_t j = 0; j < kend; ++j) {
          const Bf16* k = kh + j * lk;
          __m512 acc = _mm512_setzero_ps();
          for (int64_t c = 0; c < E; c += 32)
            acc = _mm512_dpbf16_ps(acc, (__m512bh)load_bf16_n(q + c, E - c),
                                   (__m512bh)load_bf16_n(k + c, E - c));
          sc[j] = a.scale * Simd<float>::hsum(acc);
        }
        const int64_t width = round_up(kend, 16);
        std::fill(sc + kend, sc + width, neg_inf<float>());
        const float m = row_max(sc, width);
        const float l = exp_shift_sum(sc, width, m);
        float* o = sc + round_up(S, 16);
        std::fill(o, o + 16 * mv, 0.0f);
        for (int64_t j = 0; j < kend; ++j) {
          const __m512 pj = _mm512_set1_ps(sc[j]);
          const Bf16* v = vh + j * lv;
          for (int64_t c = 0; c < M; c += 16)
            _mm512_storeu_ps(o + c,
                             _mm512_fmadd_ps(pj, widen16(v + c, M - c), _mm512_loadu_ps(o + c)));
        }
        for (int64_t c = 0; c < M; ++c) out[c].bits = bf16_bits(o[c] / l);
        a.lse[nh] = m + std::log(l);
      });
}

void full_attention_forward_bf16(const FullAttentionForwardArgs<Bf16>& args) {
  auto a = args;
  resolve_qkv_rows(a);
  a.out_rows = a.out_rows.resolved(a.H, a.L, a.M);
  const int64_t N = a.N, H = a.H, L = a.L, S = a.S, E = a.E, M = a.M;
  const int64_t NH = N * H;
  if (NH == 0 || L == 0) return;
  if (L == 1 && !a.mask) {
    single_query_forward(a);
    return;
  }
  const int64_t Ep = round_up(E, kBlock), Mp = round_up(M, kBlock), Sp = round_up(S, kBlock);
  const int64_t chunks = Ep / 32, col_blocks = Mp / 16;
  // Packed K and V of every head, in tiles.
  const int64_t head_words_k = Sp * Ep / 2, head_words_v = Sp * Mp / 2;
  ScratchArray<uint32_t> kp(static_cast<size_t>(NH * head_words_k));
  ScratchArray<uint32_t> vp(static_cast<size_t>(NH * head_words_v));
  {
    const int64_t per_head = Sp / kBlock;
    parallel_for_items(NH * per_head, a.num_threads, [&](int64_t item) {
      const int64_t nh = item / per_head, kc = item % per_head;
      const Bf16* kh = a.k_rows.head(a.k, nh, H);
      const Bf16* vh = a.v_rows.head(a.v, nh, H);
      uint32_t* kdst = kp.get() + nh * head_words_k;
      for (int64_t b = 2 * kc; b < 2 * kc + 2; ++b)
        pack_key_block(kh, a.k_rows.sr, S, E, chunks, b, kdst + b * chunks * kTileWords);
      pack_value_chunk(vh, a.v_rows.sr, S, M, col_blocks, kc,
                       vp.get() + nh * head_words_v + kc * col_blocks * kTileWords);
    });
  }

  const int64_t q_tiles = (L + kMaxQueryTile - 1) / kMaxQueryTile;
  const int64_t br = round_up((L + q_tiles - 1) / q_tiles, kBlock);
  const int64_t offset = S - L;
  const float scale = a.scale;

  parallel_items<Scratch>(
      NH * q_tiles, a.num_threads,
      [&](Scratch& w) {
        w.q.assign(br * Ep, Bf16{0});
        w.p.assign(br * kKeyTile, Bf16{0});
        w.s.resize(br * kKeyTile);
        w.o.resize(br * Mp);
        w.m.resize(br);
        w.l.resize(br);
        w.tiles.configure();
      },
      [&](int64_t item, Scratch& w) {
        const int64_t nh = item / q_tiles, n = nh / H, h = nh % H;
        const int64_t i0 = (item % q_tiles) * br;
        const int64_t rows = std::min(br, L - i0);
        const int64_t rp = round_up(rows, kBlock);
        const int64_t lq = a.q_rows.sr;
        const Bf16* q = a.q_rows.head(a.q, nh, H) + i0 * lq;
        for (int64_t r = 0; r < rp; ++r) {
          Bf16* dst = w.q.data() + r * Ep;
          if (r < rows) {
            std::copy(q + r * lq, q + r * lq + E, dst);
            std::fill(dst + E, dst + Ep, Bf16{0});
          } else {
            std::fill(dst, dst + Ep, Bf16{0});
          }
        }
        const uint32_t* kh = kp.get() + nh * head_words_k;
        const uint32_t* vh = vp.get() + nh * head_words_v;
        int64_t kend = a.key_lengths ? a.key_lengths[n] : S;
        if (a.causal) kend = std::min(kend, i0 + rows + offset);
        std::fill(w.o.begin(), w.o.begin() + rp * Mp, 0.0f);
        std::fill(w.m.begin(), w.m.end(), neg_inf<float>());
        std::fill(w.l.begin(), w.l.end(), 0.0f);
        for (int64_t j0 = 0; j0 < kend; j0 += kKeyTile) {
          const int64_t cols = std::min(kKeyTile, kend - j0);
          const int64_t width = round_up(cols, kBlock);
          // S = Q·K^T
          for (int64_t r0 = 0; r0 < rp; r0 += kBlock) {
            for (int64_t c0 = 0; c0 < width; c0 += kBlock) {
              const uint32_t* b0 = kh + (j0 + c0) / 16 * chunks * kTileWords;
              block_product(w.q.data() + r0 * Ep, Ep, b0, b0 + chunks * kTileWords, kTileWords,
                            chunks, w.s.data() + r0 * kKeyTile + c0, kKeyTile, false);
            }
          }
          // The online softmax, P in bfloat16.
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t i = i0 + r;
            float* row = w.s.data() + r * kKeyTile;
            Bf16* prow = w.p.data() + r * kKeyTile;
            const int64_t limit =
                a.causal ? std::clamp<int64_t>(i + offset + 1 - j0, 0, cols) : cols;
            const bool plain = !a.mask && limit == width;
            float tile_max;
            if (plain) {
              tile_max = row_max(row, width) * scale;
            } else {
              const Bf16* mrow =
                  a.mask ? a.mask + n * a.mask_sn + h * a.mask_sh + i * a.mask_sl + j0 : nullptr;
              tile_max = prepare_row(row, mrow, limit, width, scale);
            }
            const float m_new = std::max(w.m[r], tile_max);
            if (m_new == neg_inf<float>()) {  // nothing kept so far in this row
              std::fill(prow, prow + width, Bf16{0});
              continue;
            }
            // 1 when the max held, 0 for the row's first kept keys (O and l
            // are still zero: no call, no rescale).
            const bool first = w.m[r] == neg_inf<float>();
            const float alpha = m_new == w.m[r] ? 1.0f : first ? 0.0f : std::exp(w.m[r] - m_new);
            const float sum = exp_to_bf16(row, width, m_new, plain ? scale : 1.0f, prow);
            w.l[r] = w.l[r] * alpha + sum;
            w.m[r] = m_new;
            if (alpha != 1.0f && !first) {
              float* orow = w.o.data() + r * Mp;
              for (int64_t c = 0; c < Mp; ++c) orow[c] *= alpha;
            }
          }
          // O += P·V
          const uint32_t* vchunk = vh + j0 / 32 * col_blocks * kTileWords;
          for (int64_t r0 = 0; r0 < rp; r0 += kBlock) {
            for (int64_t c0 = 0; c0 < Mp; c0 += kBlock) {
              const uint32_t* b0 = vchunk + c0 / 16 * kTileWords;
              block_product(w.p.data() + r0 * kKeyTile, kKeyTile, b0, b0 + kTileWords,
                            col_blocks * kTileWords, width / 32, w.o.data() + r0 * Mp + c0, Mp,
                            true);
            }
          }
        }
        const int64_t lo = a.out_rows.sr;
        Bf16* out = a.out_rows.head(a.out, nh, H) + i0 * lo;
        float* lse = a.lse + nh * L + i0;
        for (int64_t r = 0; r < rows; ++r) {
          const float l = w.l[r];
          const float inv = l > 0.0f ? 1.0f / l : 0.0f;
          const float* orow = w.o.data() + r * Mp;
          Bf16* dst = out + r * lo;
          int64_t c = 0;
          for (; c + 16 <= M; c += 16)
            store_bf16(dst + c, _mm512_mul_ps(_mm512_loadu_ps(orow + c), _mm512_set1_ps(inv)));
          for (; c < M; ++c) dst[c].bits = bf16_bits(orow[c] * inv);
          lse[r] = l > 0.0f ? w.m[r] + std::log(l) : neg_inf<float>();
        }
      });
}

FASTATTN_ISA_END

// The public entry points, defined once (in the avx512_bf16 compile): the
// level's checks, then its kernel.
#if FASTATTN_ISA_LEVEL == 3
namespace fastattn::kernels {
#if FASTATTN_CPU_ISA_MAX >= 4
namespace isa_amx {
void full_attention_forward_bf16(const FullAttentionForwardArgs<Bf16>& args);
void full_attention_backward_bf16(const FullAttentionBackwardArgs<Bf16>& args);
}  // namespace isa_amx
#endif
namespace {
// The amx level's kernels at amx, the avx512_bf16 ones there, else std::logic_error.
bool on_tiles(const char* name) {
  const CpuIsa isa = cpu_isa();
  if (isa == CpuIsa::kAmx) return true;
  if (isa == CpuIsa::kAvx512Bf16) return false;
  throw std::logic_error(std::string(name) + ": the cpu capability is " + cpu_isa_name(isa) +
                         ", not avx512_bf16 or amx");
}
}  // namespace

void full_attention_forward_bf16(const FullAttentionForwardArgs<Bf16>& args) {
  const bool tiles = on_tiles("full_attention_forward_bf16");
  if (args.topk != 0)
    throw std::invalid_argument("full_attention_forward_bf16: topk must be 0, got " +
                                std::to_string(args.topk));
#if FASTATTN_CPU_ISA_MAX >= 4
  if (tiles) return isa_amx::full_attention_forward_bf16(args);
#endif
  (void)tiles;
  isa_avx512_bf16::full_attention_forward_bf16(args);
}

void full_attention_backward_bf16(const FullAttentionBackwardArgs<Bf16>& args) {
  const bool tiles = on_tiles("full_attention_backward_bf16");
  if (args.accumulate)
    throw std::invalid_argument("full_attention_backward_bf16: accumulate is not supported");
#if FASTATTN_CPU_ISA_MAX >= 4
  if (tiles) return isa_amx::full_attention_backward_bf16(args);
#endif
  (void)tiles;
  isa_avx512_bf16::full_attention_backward_bf16(args);
}
}  // namespace fastattn::kernels
#endif
