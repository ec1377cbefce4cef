// A one-warp kernel that runs mma_m16n8k16 (mma_m16n8k16.cuh) on matrices in
// memory: the check, on a GPU and in the emulator, that the fragment layouts
// written there are the hardware's (tests/cuda/test_cuda_mma.cpp,
// tests/cuda_emu/test_mma.cpp). Not an operator.
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/common/cuda_dtype.h"

namespace fastattn::cuda {

// d (16x8 float, row-major) = a (16x16, row-major) · b (16x8, row-major) + c
// (16x8 float, row-major); a and b of `dtype` (float16 or bfloat16), all in
// device memory. std::invalid_argument for float32; std::runtime_error where
// the device or the build's code for it is older than compute capability 8.0.
void mma_m16n8k16_probe_cuda(DType dtype, const void* a, const void* b, const float* c, float* d,
                             cudaStream_t stream);

}  // namespace fastattn::cuda
