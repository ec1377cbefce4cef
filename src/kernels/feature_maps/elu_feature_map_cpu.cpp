// CPU kernels of the elu feature map (see elu_feature_map.h).
#include "kernels/feature_maps/elu_feature_map.h"

#include <algorithm>

#include "kernels/common/parallel.h"
#include "kernels/common/simd.h"

namespace fastattn::kernels {
namespace {

constexpr int64_t kBlock = 16384;  // elements per work item

// exp(min(x, 0)) with NaN propagated through max's second operand.
template <typename T>
inline typename Simd<T>::V exp_nonpositive(typename Simd<T>::V x) {
  using S = Simd<T>;
  return S::exp(S::sub(S::zero(), S::max(S::zero(), S::sub(S::zero(), x))));
}

template <typename T, bool Backward>
void run(const EluFeatureMapArgs<T>& a) {
  using S = Simd<T>;
  constexpr int W = S::W;
  struct None {};
  const int64_t blocks = (a.n + kBlock - 1) / kBlock;
  parallel_items<None>(
      blocks, a.num_threads, [](None&) {},
      [&](int64_t b, None&) {
        const int64_t i0 = b * kBlock, i1 = std::min(a.n, i0 + kBlock);
        auto one = [&](int64_t i) {  // i: a multiple of W, or the scalar tail with W = 1
          const auto x = S::load(a.x + i);
          const auto e = exp_nonpositive<T>(x);
          if constexpr (Backward) {
            S::store(a.out + i, S::mul(S::load(a.grad_out + i), e));
          } else {
            S::store(a.out + i, S::add(S::max(S::zero(), x), e));
          }
        };
        int64_t i = i0;
        for (; i + W <= i1; i += W) one(i);
        for (; i < i1; ++i) {  // tail: scalar
          const T x = a.x[i];
          const T e = std::exp(x < T(0) ? x : T(0));
          if constexpr (Backward) {
            a.out[i] = a.grad_out[i] * (x != x ? x : e);
          } else {
            a.out[i] = x > T(0) ? x + T(1) : (x != x ? x : e);
          }
        }
      });
}

}  // namespace

template <typename T>
void elu_feature_map_forward_cpu(const EluFeatureMapArgs<T>& a) {
  run<T, false>(a);
}
template <typename T>
void elu_feature_map_backward_cpu(const EluFeatureMapArgs<T>& a) {
  run<T, true>(a);
}

template void elu_feature_map_forward_cpu<float>(const EluFeatureMapArgs<float>&);
template void elu_feature_map_forward_cpu<double>(const EluFeatureMapArgs<double>&);
template void elu_feature_map_backward_cpu<float>(const EluFeatureMapArgs<float>&);
template void elu_feature_map_backward_cpu<double>(const EluFeatureMapArgs<double>&);

}  // namespace fastattn::kernels
