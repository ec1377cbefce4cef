// CPU kernels of the elu feature map (see elu_feature_map.h).
#include "kernels/feature_maps/elu_feature_map.h"

#include <algorithm>

#include "kernels/common/isa_target.h"
#include "kernels/common/parallel.h"
#include "kernels/feature_maps/elu.h"

FASTATTN_ISA_BEGIN
namespace {

constexpr int64_t kBlock = 16384;  // elements per work item

template <typename T, bool Backward>
void run(const EluFeatureMapArgs<T>& a) {
  const int64_t blocks = (a.n + kBlock - 1) / kBlock;
  parallel_for_items(blocks, a.num_threads, [&](int64_t b) {
    const int64_t i0 = b * kBlock, n = std::min(a.n, i0 + kBlock) - i0;
    if constexpr (Backward) {
      elu_plus_one_backward(a.x + i0, a.grad_out + i0, a.out + i0, n);
    } else {
      elu_plus_one(a.x + i0, a.out + i0, n);
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

FASTATTN_ISA_END

FASTATTN_CPU_KERNEL(elu_feature_map_forward_cpu, EluFeatureMapArgs)
FASTATTN_CPU_KERNEL(elu_feature_map_backward_cpu, EluFeatureMapArgs)
