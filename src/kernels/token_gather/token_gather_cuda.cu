// CUDA kernels of the token gather (ClusterFormer's sort / unsort, see
// token_gather.h):
//   forward:  out[n, h, t, :] = x[n, h, index[n, t], :]   (zeros where index = -1)
//   backward: grad_x[n, h, l, :] += grad_out[n, h, t, :] for index[n, t] = l
// One thread per output element (grid-stride, coalesced along E). The
// backward adds with float32 atomicAdd into a zeroed float32 buffer, since
// an index may repeat a token (ClusterFormer's key blocks hold every token
// twice), so the order of the additions, and the last bits of a repeated
// token's gradient, may vary between runs. O(N·H·T·E) both ways.
// Tested by tests/cuda_emu/test_token_gather.cpp against the CPU kernels.
#include "kernels/token_gather/token_gather_cuda.h"

#include "kernels/common/cuda_compat.cuh"

namespace fastattn::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535;

template <typename T>
__global__ void gather_forward_kernel(TokenGatherCudaArgs a) {
  const T* x = static_cast<const T*>(a.x);
  T* out = static_cast<T*>(a.out);
  const int64_t total = a.N * a.H * a.T_ * a.E;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = i % a.E, row = i / a.E;  // row = (n·H + h)·T + t
    const int64_t t = row % a.T_, nh = row / a.T_, n = nh / a.H;
    const int64_t l = a.index[n * a.T_ + t];
    out[i] = l < 0 ? from_float<T>(0.f) : x[(nh * a.L + l) * a.E + e];
  }
}

template <typename T>
__global__ void gather_backward_kernel(TokenGatherCudaArgs a) {
  const T* g = static_cast<const T*>(a.grad_out);
  const int64_t total = a.N * a.H * a.T_ * a.E;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = i % a.E, row = i / a.E;
    const int64_t t = row % a.T_, nh = row / a.T_, n = nh / a.H;
    const int64_t l = a.index[n * a.T_ + t];
    if (l >= 0) atomicAdd(&a.grad_x[(nh * a.L + l) * a.E + e], to_float(g[i]));
  }
}

unsigned grid_for(int64_t total) {
  const int64_t b = ceil_div(total, kThreads);
  return static_cast<unsigned>(b < kMaxBlocks ? b : kMaxBlocks);
}

}  // namespace

void token_gather_forward_cuda(const TokenGatherCudaArgs& a, cudaStream_t stream) {
  const int64_t total = a.N * a.H * a.T_ * a.E;
  if (total == 0) return;
  FA_DISPATCH_FLOAT_TYPES(a.dtype, "gather_tokens", [&] {
    FA_LAUNCH(dim3(grid_for(total)), dim3(kThreads), 0, stream, gather_forward_kernel<scalar_t>)(a);
    FA_CHECK_LAUNCH("gather_tokens");
  });
}

void token_gather_backward_cuda(const TokenGatherCudaArgs& a, cudaStream_t stream) {
  const int64_t total = a.N * a.H * a.T_ * a.E;
  if (total == 0) return;
  FA_DISPATCH_FLOAT_TYPES(a.dtype, "gather_tokens_backward", [&] {
    FA_LAUNCH(dim3(grid_for(total)), dim3(kThreads), 0, stream, gather_backward_kernel<scalar_t>)
    (a);
    FA_CHECK_LAUNCH("gather_tokens_backward");
  });
}

}  // namespace fastattn::cuda
