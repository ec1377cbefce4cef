// bfloat16 rows to float32 and back, for the CPU kernels that read and write
// bfloat16 operands themselves (computing in float32) instead of running on
// float32 copies: widening is exact (the 16 bits become the high half of a
// float32), narrowing rounds to nearest even as torch's conversion and
// vcvtneps2bf16 do; a NaN stays a quiet NaN of the same sign. Vector loops at
// the avx2 and avx512 levels, integer arithmetic only (no AVX512-BF16 needed),
// with a scalar tail.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/common/isa_target.h"
#include "kernels/common/kernel_args.h"

FASTATTN_ISA_BEGIN

inline float bf16_value(Bf16 x) {
  const uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

// dst[0, n) = src[0, n) widened.
inline void widen_bf16(const Bf16* src, float* dst, int64_t n) {
  int64_t i = 0;
#if FASTATTN_SIMD_AVX512
  for (; i + 16 <= n; i += 16) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
  }
#elif FASTATTN_SIMD_AVX2
  for (; i + 8 <= n; i += 8) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16)));
  }
#endif
  for (; i < n; ++i) dst[i] = bf16_value(src[i]);
}

// dst[0, n) = src[0, n) rounded (bf16_bits).
inline void narrow_bf16(const float* src, Bf16* dst, int64_t n) {
  int64_t i = 0;
#if FASTATTN_SIMD_AVX512
  const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff),
                quiet = _mm512_set1_epi32(0x40);
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(src + i);
    const __m512i u = _mm512_castps_si512(x), hi = _mm512_srli_epi32(u, 16);
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(bias, _mm512_and_si512(hi, one))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                              _mm512_or_si512(hi, quiet));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(r));
  }
#elif FASTATTN_SIMD_AVX2
  const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff),
                quiet = _mm256_set1_epi32(0x40);
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(src + i);
    const __m256i u = _mm256_castps_si256(x), hi = _mm256_srli_epi32(u, 16);
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(bias, _mm256_and_si256(hi, one))), 16);
    r = _mm256_blendv_epi8(r, _mm256_or_si256(hi, quiet),
                           _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    // 16-bit words r0..r3 r0..r3 | r4..r7 r4..r7, then the two low quarters together.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_castsi256_si128(packed));
  }
#endif
  for (; i < n; ++i) dst[i].bits = bf16_bits(src[i]);
}

FASTATTN_ISA_END
