// Minimal SIMD layer for fastattn's CPU kernels: one vector type per scalar
// type with the few operations the kernels need (load/store, fma, div, max, exp,
// horizontal reductions), for the level the translation unit is compiled for
// (kernels/common/isa_target.h): AVX-512 (16 floats / 8 doubles), AVX2+FMA
// (8 / 4), or a scalar fallback of width 1 with the same interface, so every
// kernel has one code path.
//
// exp: Cody-Waite range reduction and a polynomial (float: degree 6, relative
// error ~2 ulp; double: degree 11, ~1 ulp). Inputs below the underflow limit,
// -inf included, give exactly 0.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/common/isa_target.h"

FASTATTN_ISA_BEGIN

template <typename T>
struct Simd;

#if FASTATTN_SIMD_AVX512

template <>
struct Simd<float> {
  using V = __m512;
  static constexpr int W = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  // The first n < W lanes (the others 0 / untouched; no access past them).
  static V load_n(const float* p, int n) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
  }
  static void store_n(float* p, V v, int n) {
    _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v);
  }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }  // a*b + c
  static V max(V a, V b) { return _mm512_max_ps(a, b); }            // b where either is NaN
  static V min(V a, V b) { return _mm512_min_ps(a, b); }            // b where either is NaN
  static float hsum(V v) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static float hmax(V v) {
    __m256 h = _mm256_max_ps(_mm512_castps512_ps256(v),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // exp_poly's pieces: clamp, round to an integer, 2^n · p, 0 below lo.
  static V clamp(V x, V lo, V hi) { return _mm512_min_ps(_mm512_max_ps(x, lo), hi); }
  static V fnma(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a*b
  static V round(V x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  // One instruction for what AVX2 builds from nine (n is an integer in
  // [-126, 128]; 2^128 itself is not a float, p · 2^n is), in every exp;
  // it sped up full attention's forward on a Xeon (git show
  // 5f604de:docs/benchmarks.md, "Full attention past SDPA on a Xeon with two
  // 512-bit FMA ports").
  static V times_pow2(V p, V n) { return _mm512_scalef_ps(p, n); }
  static V zero_below(V x, V lo, V y) {  // also where x is -inf
    return _mm512_maskz_mov_ps(static_cast<__mmask16>(~_mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ)), y);
  }
  static V exp(V x);
  static V exp_nonpositive(V x);  // x <= 0 or NaN: no upper clamp
};

template <>
struct Simd<double> {
  using V = __m512d;
  static constexpr int W = 8;
  static V zero() { return _mm512_setzero_pd(); }
  static V set1(double x) { return _mm512_set1_pd(x); }
  static V load(const double* p) { return _mm512_loadu_pd(p); }
  static void store(double* p, V v) { _mm512_storeu_pd(p, v); }
  static V load_n(const double* p, int n) {
    return _mm512_maskz_loadu_pd(static_cast<__mmask8>((1u << n) - 1), p);
  }
  static void store_n(double* p, V v, int n) {
    _mm512_mask_storeu_pd(p, static_cast<__mmask8>((1u << n) - 1), v);
  }
  static V add(V a, V b) { return _mm512_add_pd(a, b); }
  static V sub(V a, V b) { return _mm512_sub_pd(a, b); }
  static V mul(V a, V b) { return _mm512_mul_pd(a, b); }
  static V div(V a, V b) { return _mm512_div_pd(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_pd(a, b, c); }
  static V max(V a, V b) { return _mm512_max_pd(a, b); }
  static V min(V a, V b) { return _mm512_min_pd(a, b); }
  static double hsum(V v) {
    __m256d h = _mm256_add_pd(_mm512_castpd512_pd256(v), _mm512_extractf64x4_pd(v, 1));
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(h), _mm256_extractf128_pd(h, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
  }
  static double hmax(V v) {
    __m256d h = _mm256_max_pd(_mm512_castpd512_pd256(v), _mm512_extractf64x4_pd(v, 1));
    __m128d s = _mm_max_pd(_mm256_castpd256_pd128(h), _mm256_extractf128_pd(h, 1));
    return _mm_cvtsd_f64(_mm_max_sd(s, _mm_unpackhi_pd(s, s)));
  }
  static V exp(V x) {  // lane by lane, as at the AVX2 level
    alignas(64) double a[8];
    _mm512_store_pd(a, x);
    for (double& e : a) e = std::exp(e);
    return _mm512_load_pd(a);
  }
  static V exp_nonpositive(V x) { return exp(x); }
};

#elif FASTATTN_SIMD_AVX2

template <>
struct Simd<float> {
  using V = __m256;
  static constexpr int W = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  // The first n < W lanes (the others 0 / untouched; no access past them).
  static __m256i lanes(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static V load_n(const float* p, int n) { return _mm256_maskload_ps(p, lanes(n)); }
  static void store_n(float* p, V v, int n) { _mm256_maskstore_ps(p, lanes(n), v); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }  // a*b + c
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V min(V a, V b) { return _mm256_min_ps(a, b); }
  static float hsum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static float hmax(V v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // exp_poly's pieces: clamp, round to an integer, 2^n · p, 0 below lo.
  static V clamp(V x, V lo, V hi) { return _mm256_min_ps(_mm256_max_ps(x, lo), hi); }
  static V fnma(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a*b
  static V round(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V times_pow2(V p, V n) {
    // 2^n by building the exponent; n in [-126, 128] after the clamp, so
    // split it in two halves to stay in range.
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i n1 = _mm256_srai_epi32(ni, 1);
    const __m256i n2 = _mm256_sub_epi32(ni, n1);
    const V s1 =
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, _mm256_set1_epi32(127)), 23));
    const V s2 =
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
  }
  static V zero_below(V x, V lo, V y) {  // also where x is -inf
    return _mm256_andnot_ps(_mm256_cmp_ps(x, lo, _CMP_LT_OQ), y);
  }
  static V exp(V x);
  static V exp_nonpositive(V x);  // x <= 0 or NaN: no upper clamp
};

template <>
struct Simd<double> {
  using V = __m256d;
  static constexpr int W = 4;
  static V zero() { return _mm256_setzero_pd(); }
  static V set1(double x) { return _mm256_set1_pd(x); }
  static V load(const double* p) { return _mm256_loadu_pd(p); }
  static void store(double* p, V v) { _mm256_storeu_pd(p, v); }
  static __m256i lanes(int n) {
    return _mm256_cmpgt_epi64(_mm256_set1_epi64x(n), _mm256_setr_epi64x(0, 1, 2, 3));
  }
  static V load_n(const double* p, int n) { return _mm256_maskload_pd(p, lanes(n)); }
  static void store_n(double* p, V v, int n) { _mm256_maskstore_pd(p, lanes(n), v); }
  static V add(V a, V b) { return _mm256_add_pd(a, b); }
  static V sub(V a, V b) { return _mm256_sub_pd(a, b); }
  static V mul(V a, V b) { return _mm256_mul_pd(a, b); }
  static V div(V a, V b) { return _mm256_div_pd(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_pd(a, b, c); }
  static V max(V a, V b) { return _mm256_max_pd(a, b); }
  static V min(V a, V b) { return _mm256_min_pd(a, b); }
  static double hsum(V v) {
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
  }
  static double hmax(V v) {
    __m128d s = _mm_max_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    return _mm_cvtsd_f64(_mm_max_sd(s, _mm_unpackhi_pd(s, s)));
  }
  static V exp(V x) {
    // Exact to ~1 ulp is what the float64 gradient checks need: use the
    // library exp lane by lane (double paths are for checking, not speed).
    alignas(32) double a[4];
    _mm256_store_pd(a, x);
    for (double& e : a) e = std::exp(e);
    return _mm256_load_pd(a);
  }
  static V exp_nonpositive(V x) { return exp(x); }
};

#else  // portable scalar fallback

template <typename T>
struct ScalarSimd {
  using V = T;
  static constexpr int W = 1;
  static V zero() { return T(0); }
  static V set1(T x) { return x; }
  static V load(const T* p) { return *p; }
  static void store(T* p, V v) { *p = v; }
  static V load_n(const T* p, int n) { return n > 0 ? *p : T(0); }
  static void store_n(T* p, V v, int n) {
    if (n > 0) *p = v;
  }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V mul(V a, V b) { return a * b; }
  static V div(V a, V b) { return a / b; }
  static V fma(V a, V b, V c) { return a * b + c; }
  static V max(V a, V b) { return a > b ? a : b; }
  static V min(V a, V b) { return a < b ? a : b; }
  static T hsum(V v) { return v; }
  static T hmax(V v) { return v; }
  static V exp(V x) { return std::exp(x); }
  static V exp_nonpositive(V x) { return std::exp(x); }
};
template <>
struct Simd<float> : ScalarSimd<float> {};
template <>
struct Simd<double> : ScalarSimd<double> {};

#endif

#if FASTATTN_SIMD_AVX2  // AVX2 and AVX-512
// exp of float vectors: Cody-Waite range reduction and a degree-6 polynomial,
// from the vector type's pieces (clamp, round, fnma, times_pow2, zero_below).
// NonPositive: for x <= 0 only (the elu feature map's exp(min(x, 0))), no
// clamp from above.
template <typename S, bool NonPositive = false>
inline typename S::V exp_poly(typename S::V x) {
  using V = typename S::V;
  const V lo = S::set1(-87.33654f), hi = S::set1(88.72283f);
  const V xc = NonPositive ? S::max(x, lo) : S::clamp(x, lo, hi);
  const V n = S::round(S::mul(xc, S::set1(1.44269504088896341f)));
  V r = S::fnma(n, S::set1(0.693359375f), xc);
  r = S::fnma(n, S::set1(-2.12194440e-4f), r);
  V p = S::set1(1.9875691500e-4f);
  p = S::fma(p, r, S::set1(1.3981999507e-3f));
  p = S::fma(p, r, S::set1(8.3334519073e-3f));
  p = S::fma(p, r, S::set1(4.1665795894e-2f));
  p = S::fma(p, r, S::set1(1.6666665459e-1f));
  p = S::fma(p, r, S::set1(5.0000001201e-1f));
  p = S::fma(p, S::mul(r, r), S::add(r, S::set1(1.0f)));
  return S::zero_below(x, lo, S::times_pow2(p, n));
}
inline Simd<float>::V Simd<float>::exp(V x) { return exp_poly<Simd<float>>(x); }
inline Simd<float>::V Simd<float>::exp_nonpositive(V x) { return exp_poly<Simd<float>, true>(x); }
#endif

// a·b over n values: one vector accumulator and a scalar tail (summation
// order differs from a sequential loop by rounding only).
template <typename T>
inline T simd_dot(const T* a, const T* b, int64_t n) {
  using S = Simd<T>;
  auto acc = S::zero();
  int64_t i = 0;
  for (; i + S::W <= n; i += S::W) acc = S::fma(S::load(a + i), S::load(b + i), acc);
  T s = S::hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// sum_i |x[i]| over n values, four vector accumulators: NaN when any value is NaN, inf when any
// is infinite (or when the sum overflows).
template <typename T>
inline T simd_abs_sum(const T* x, int64_t n) {
  using S = Simd<T>;
  constexpr int W = S::W;
  // |v| as max(v, -v): NaN stays NaN (max returns its second operand then).
  typename S::V acc[4] = {S::zero(), S::zero(), S::zero(), S::zero()};
  int64_t i = 0;
  for (; i + 4 * W <= n; i += 4 * W) {
    for (int a = 0; a < 4; ++a) {
      const auto v = S::load(x + i + a * W);
      acc[a] = S::add(acc[a], S::max(v, S::sub(S::zero(), v)));
    }
  }
  for (; i + W <= n; i += W) {
    const auto v = S::load(x + i);
    acc[0] = S::add(acc[0], S::max(v, S::sub(S::zero(), v)));
  }
  T s = S::hsum(S::add(S::add(acc[0], acc[1]), S::add(acc[2], acc[3])));
  for (; i < n; ++i) s += std::abs(x[i]);
  return s;
}

// dst[0, n) = src[0, n) by vectors, inline: for short rows (a gathered row
// of E values), where std::copy's call to memmove costs more than the copy.
template <typename T>
inline void copy_values(const T* src, T* dst, int64_t n) {
  using S = Simd<T>;
  int64_t i = 0;
  for (; i + S::W <= n; i += S::W) S::store(dst + i, S::load(src + i));
  for (; i < n; ++i) dst[i] = src[i];
}

// dst[0, n) = scale · src[0, n) for rows written once and not read again
// soon: on whole aligned 64-byte lines of float32 at AVX-512, non-temporal
// stores, which skip reading the lines they replace (the centroid backward's
// dK and dV rows, 100 queries over 16384 keys). Writers call
// stream_fence() before their rows are read by another thread.
template <typename T>
inline void stream_scaled(const T* src, T scale, T* dst, int64_t n) {
#if FASTATTN_SIMD_AVX512
  if constexpr (std::is_same_v<T, float>) {
    if (n % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 64 == 0) {
      const __m512 s = _mm512_set1_ps(scale);
      for (int64_t i = 0; i < n; i += 16)
        _mm512_stream_ps(dst + i, _mm512_mul_ps(s, _mm512_loadu_ps(src + i)));
      return;
    }
  }
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = scale * src[i];
}

// dst[0, n) = 0, the same way.
template <typename T>
inline void stream_zero(T* dst, int64_t n) {
#if FASTATTN_SIMD_AVX512
  if constexpr (std::is_same_v<T, float>) {
    if (n % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 64 == 0) {
      for (int64_t i = 0; i < n; i += 16) _mm512_stream_ps(dst + i, _mm512_setzero_ps());
      return;
    }
  }
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = T(0);
}

inline void stream_fence() {
#if FASTATTN_SIMD_AVX512
  _mm_sfence();
#endif
}

FASTATTN_ISA_END
