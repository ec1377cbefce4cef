// The per-head sums of |out| that the CPU elu linear attention forward (float32, float64) adds up
// from its tiles as it stores its rows: the linear types' take_finite_witness(), which the
// registry operator's overflow check reads instead of the whole output. While an
// EluLinearOutputSums is alive on a thread, the forward operator run on that thread leaves its
// sums in it. They are not a fourth output of the operator's schema: they serve that check only,
// and a schema change would change every caller's results (Python unpacking, the fake and CUDA
// implementations) for it.
#pragma once

#include <utility>

#include <ATen/core/Tensor.h>

namespace fastattn::ops {

class EluLinearOutputSums {
 public:
  EluLinearOutputSums();
  ~EluLinearOutputSums();
  EluLinearOutputSums(const EluLinearOutputSums&) = delete;
  EluLinearOutputSums& operator=(const EluLinearOutputSums&) = delete;

  // The sums of the last forward run in this scope ((N, H), the statistics dtype), or an
  // undefined tensor where there were none (no call, CUDA, bfloat16 or float16 outputs, whose
  // rounding the float32 sums do not see).
  at::Tensor take() { return std::exchange(sums_, {}); }

  // For the operator: the innermost scope alive on this thread (null if none), and its sums.
  static EluLinearOutputSums* active();
  void set(at::Tensor sums) { sums_ = std::move(sums); }

 private:
  at::Tensor sums_;
  EluLinearOutputSums* outer_;
};

}  // namespace fastattn::ops
