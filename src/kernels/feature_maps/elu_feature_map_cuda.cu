// CUDA kernels of the elu feature map of linear attention, elementwise over
// any contiguous tensor:
//   phi(x)  = x + 1 for x > 0, exp(x) otherwise   (= elu(x) + 1)
//   phi'(x) = 1 for x > 0, exp(x) otherwise
// NaN inputs give NaN outputs. A grid-stride loop, float32 arithmetic; O(n),
// memory bound. Tested by tests/cuda_emu/test_feature_maps.cpp (emulator,
// against the CPU kernels in float64) and tests/cuda/test_cuda_linear_attention.cpp.
#include "kernels/common/cuda_compat.cuh"
#include "kernels/feature_maps/elu_feature_map_cuda.h"

namespace fastattn::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T, bool Backward>
__global__ void __launch_bounds__(kThreads)
    elu_feature_map_kernel(const T* x, const T* g, T* out, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const float v = to_float(x[i]);
    if (Backward) {
      out[i] = from_float<T>(to_float(g[i]) * (v > 0.f ? 1.f : expf(v)));
    } else {
      out[i] = from_float<T>(v > 0.f ? v + 1.f : expf(v));
    }
  }
}

template <bool Backward>
void run(const EluFeatureMapCudaArgs& a, cudaStream_t stream, const char* what) {
  if (a.n <= 0) return;
  const int64_t blocks = ceil_div(a.n, kThreads);
  const unsigned grid = static_cast<unsigned>(blocks < (1 << 20) ? blocks : (1 << 20));
  FA_DISPATCH_FLOAT_TYPES(a.dtype, what, [&] {
    FA_LAUNCH(dim3(grid), dim3(kThreads), 0, stream, elu_feature_map_kernel<scalar_t, Backward>)
    (static_cast<const scalar_t*>(a.x), static_cast<const scalar_t*>(a.grad_out),
     static_cast<scalar_t*>(a.out), a.n);
    FA_CHECK_LAUNCH(what);
  });
}

}  // namespace

void elu_feature_map_forward_cuda(const EluFeatureMapCudaArgs& a, cudaStream_t stream) {
  run<false>(a, stream, "elu_feature_map_forward_cuda");
}

void elu_feature_map_backward_cuda(const EluFeatureMapCudaArgs& a, cudaStream_t stream) {
  run<true>(a, stream, "elu_feature_map_backward_cuda");
}

}  // namespace fastattn::cuda
