// CPU kernels of the token gather and its scatter-add adjoint (see token_gather.h).
#include "kernels/token_gather/token_gather.h"

#include <algorithm>
#include <cstring>

#include "kernels/common/isa_target.h"
#include "kernels/common/parallel.h"

FASTATTN_ISA_BEGIN

template <typename T>
void token_gather_forward_cpu(const TokenGatherArgs<T>& a) {
  parallel_for_items(a.N * a.H, a.num_threads, [&](int64_t nh) {
    const int64_t n = nh / a.H;
    const int64_t* idx = a.index + n * a.T_;
    const T* src = a.x + nh * a.L * a.E;
    T* dst = a.out + nh * a.T_ * a.E;
    for (int64_t t = 0; t < a.T_; ++t) {
      const int64_t l = idx[t];
      if (l < 0) {
        std::fill(dst + t * a.E, dst + (t + 1) * a.E, T(0));
      } else {
        std::memcpy(dst + t * a.E, src + l * a.E, sizeof(T) * a.E);
      }
    }
  });
}

template <typename T>
void token_gather_backward_cpu(const TokenGatherArgs<T>& a) {
  parallel_for_items(a.N * a.H, a.num_threads, [&](int64_t nh) {
    const int64_t n = nh / a.H;
    const int64_t* idx = a.index + n * a.T_;
    const T* g = a.grad_out + nh * a.T_ * a.E;
    T* dst = a.out + nh * a.L * a.E;
    std::fill(dst, dst + a.L * a.E, T(0));
    for (int64_t t = 0; t < a.T_; ++t) {
      const int64_t l = idx[t];
      if (l < 0) continue;
      T* row = dst + l * a.E;
      const T* gr = g + t * a.E;
      for (int64_t e = 0; e < a.E; ++e) row[e] += gr[e];
    }
  });
}

FASTATTN_ISA_END

FASTATTN_CPU_KERNEL(token_gather_forward_cpu, TokenGatherArgs)
FASTATTN_CPU_KERNEL(token_gather_backward_cpu, TokenGatherArgs)
