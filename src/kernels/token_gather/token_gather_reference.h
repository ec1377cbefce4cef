// The plain reference of the token-gather kernels (token_gather.h): scalar
// loops over the same argument struct, in float64, on one thread, without
// vector code or copies by memcpy, so that it reads as the definition.
// tests/cpp/test_kernel_references.cpp holds the CPU kernels at every
// instruction-set level to it, tests/cuda_emu/test_token_gather.cpp the CUDA
// kernels (under the emulator): a CPU bug fails as a CPU bug.
#pragma once

#include <cstdint>

#include "kernels/token_gather/token_gather.h"

namespace fastattn::kernels {

// out[n, h, t, :] = x[n, h, index[n, t], :], zeros where index[n, t] = -1.
inline void token_gather_forward_reference(const TokenGatherArgs<double>& a) {
  for (int64_t n = 0; n < a.N; ++n)
    for (int64_t h = 0; h < a.H; ++h)
      for (int64_t t = 0; t < a.T_; ++t) {
        const int64_t l = a.index[n * a.T_ + t];
        for (int64_t e = 0; e < a.E; ++e)
          a.out[((n * a.H + h) * a.T_ + t) * a.E + e] =
              l < 0 ? 0.0 : a.x[((n * a.H + h) * a.L + l) * a.E + e];
      }
}

// out = grad_x[n, h, l, :] = sum of grad_out[n, h, t, :] over t with
// index[n, t] = l (in increasing t).
inline void token_gather_backward_reference(const TokenGatherArgs<double>& a) {
  for (int64_t i = 0; i < a.N * a.H * a.L * a.E; ++i) a.out[i] = 0.0;
  for (int64_t n = 0; n < a.N; ++n)
    for (int64_t h = 0; h < a.H; ++h)
      for (int64_t t = 0; t < a.T_; ++t) {
        const int64_t l = a.index[n * a.T_ + t];
        if (l < 0) continue;
        for (int64_t e = 0; e < a.E; ++e)
          a.out[((n * a.H + h) * a.L + l) * a.E + e] +=
              a.grad_out[((n * a.H + h) * a.T_ + t) * a.E + e];
      }
}

}  // namespace fastattn::kernels
