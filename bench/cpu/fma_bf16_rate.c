/* Arithmetic rate of one core: 512-bit float32 FMAs (vfmadd, 32 FLOP an
 * instruction) against AVX512-BF16 dot products (vdpbf16ps, 16 lanes of two
 * bfloat16 products each, 64 FLOP), on register operands only, with ACC
 * independent accumulators so that throughput, not latency, is measured
 * (docs/benchmarks.md, "Machines").
 * Not part of the build; needs a CPU with AVX512-BF16:
 *
 *   for a in 8 12 16; do gcc -O3 -mavx512f -mavx512bf16 -DACC=$a \
 *       bench/cpu/fma_bf16_rate.c -o /tmp/rate && /tmp/rate; done
 */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#ifndef ACC
#define ACC 12
#endif

static double seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
  const long iters = 200000000L / ACC;
  __m512 acc[ACC];
  __m512 check = _mm512_setzero_ps();

  for (int i = 0; i < ACC; i++) acc[i] = _mm512_set1_ps((float)i);
  const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80); /* pairs of 1.0 */
  double t = seconds();
  for (long k = 0; k < iters; k++) {
    for (int i = 0; i < ACC; i++) acc[i] = _mm512_dpbf16_ps(acc[i], a, a);
  }
  const double t_bf16 = seconds() - t;
  for (int i = 0; i < ACC; i++) check = _mm512_add_ps(check, acc[i]);

  for (int i = 0; i < ACC; i++) acc[i] = _mm512_set1_ps((float)i);
  const __m512 x = _mm512_set1_ps(1.0001f), y = _mm512_set1_ps(0.9999f);
  t = seconds();
  for (long k = 0; k < iters; k++) {
    for (int i = 0; i < ACC; i++) acc[i] = _mm512_fmadd_ps(x, y, acc[i]);
  }
  const double t_fma = seconds() - t;
  for (int i = 0; i < ACC; i++) check = _mm512_add_ps(check, acc[i]);

  const double n = (double)iters * ACC;
  printf("%d accumulators: vdpbf16ps %.2f G/s (%.0f GFLOP/s), vfmadd %.2f G/s (%.0f GFLOP/s)"
         " [checksum %g]\n",
         ACC, n / t_bf16 / 1e9, n * 64 / t_bf16 / 1e9, n / t_fma / 1e9, n * 32 / t_fma / 1e9,
         _mm512_reduce_add_ps(check));
  return 0;
}
