// The probe kernel of mma_probe_cuda.h: each lane loads its fragments of A, B
// and C at the positions mma_m16n8k16.cuh gives, multiplies, and stores its
// part of D at the positions given for D.
#include "kernels/common/mma_probe_cuda.h"

#include <stdexcept>
#include <string>

#include "kernels/common/mma_m16n8k16.cuh"

namespace fastattn::cuda {
namespace {

template <typename T>
__global__ void mma_probe_kernel(const T* a, const T* b, const float* c, float* d) {
  const int lane = static_cast<int>(threadIdx.x);
  MmaA<T> fa;
  MmaB<T> fb;
  MmaC fc;
  for (int i = 0; i < 8; ++i) fa.x[i] = a[mma_a_row(lane, i) * 16 + mma_a_col(lane, i)];
  for (int i = 0; i < 4; ++i) fb.x[i] = b[mma_b_row(lane, i) * 8 + mma_b_col(lane, i)];
  for (int i = 0; i < 4; ++i) fc.x[i] = c[mma_c_row(lane, i) * 8 + mma_c_col(lane, i)];
  mma_m16n8k16(fc, fa, fb, fc);
  for (int i = 0; i < 4; ++i) d[mma_c_row(lane, i) * 8 + mma_c_col(lane, i)] = fc.x[i];
}

template <typename T>
void launch(const void* a, const void* b, const float* c, float* d, cudaStream_t stream) {
  const int arch = FA_KERNEL_ARCH("mma_m16n8k16_probe", mma_probe_kernel<T>);
  if (arch < kMmaMinArch)
    throw std::runtime_error(
        "fastattn CUDA kernel mma_m16n8k16_probe: mma.sync m16n8k16 needs "
        "compute capability 8.0; the code for this device is for " +
        detail::arch_string(arch));
  FA_LAUNCH(dim3(1), dim3(32), 0, stream, mma_probe_kernel<T>)
  (static_cast<const T*>(a), static_cast<const T*>(b), c, d);
  FA_CHECK_LAUNCH("mma_m16n8k16_probe");
}

}  // namespace

void mma_m16n8k16_probe_cuda(DType dtype, const void* a, const void* b, const float* c, float* d,
                             cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat16:
      return launch<__half>(a, b, c, d, stream);
    case DType::kBFloat16:
      return launch<__nv_bfloat16>(a, b, c, d, stream);
    case DType::kFloat32:
      break;
  }
  throw std::invalid_argument(
      "fastattn CUDA kernel mma_m16n8k16_probe: a and b must be float16 or bfloat16, got float32");
}

}  // namespace fastattn::cuda
