// The plain reference of hash_queries_cpu (hashing.h): scalar loops over the
// same argument struct, each projection summed in float64 in plane order, on
// one thread, without vector code. tests/cpp/test_kernel_references.cpp holds
// the CPU kernel at every instruction-set level to it, and
// tests/cuda_emu/test_hashing.cpp the CUDA kernel (under the emulator).
#pragma once

#include <cstdint>

#include "kernels/hashing/hashing.h"

namespace fastattn::kernels {

// x_r · w_b + bias_b in float64, for row r of the kernel's numbering (r =
// (n·H + h)·L + l; with x_rows at its default the rows follow one another).
template <typename T>
double hash_projection_reference(const HashParams<T>& p, int64_t r, int b) {
  const T* x = p.x_rows.sr >= 0 ? p.x_rows.row(p.x, r / p.L, p.H, r % p.L) : p.x + r * p.E;
  const T* plane = p.planes + b * (p.E + 1);
  double proj = static_cast<double>(plane[p.E]);
  for (int64_t e = 0; e < p.E; ++e)
    proj += static_cast<double>(x[e]) * static_cast<double>(plane[e]);
  return proj;
}

// codes[r]: bit b set iff the projection on plane b is > 0.
template <typename T>
void hash_queries_reference(const HashParams<T>& p) {
  for (int64_t r = 0; r < p.rows; ++r) {
    uint64_t code = 0;
    for (int b = 0; b < p.B; ++b)
      if (hash_projection_reference(p, r, b) > 0.0) code |= uint64_t{1} << b;
    p.codes[r] = static_cast<int64_t>(code);
  }
}

}  // namespace fastattn::kernels
