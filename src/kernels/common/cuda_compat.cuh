// The portability layer of fastattn's CUDA kernels (src/kernels/*/*_cuda.cu).
//
// Every kernel source includes this header first and is compiled two ways:
//   * by nvcc (CUDA language, when the build has nvcc) into the library, and
//   * by the host C++ compiler with FASTATTN_CUDA_EMULATION defined, into the
//     emulation tests (tests/cuda_emu/), where src/kernels/common/cuda_emulator.h
//     runs every thread block on the CPU: one fiber per CUDA thread, real
//     barriers, warp shuffles and WMMA tiles. That is how the kernels' logic is
//     tested on machines without a GPU (CI); the backend-comparison tests
//     (tests/cuda/) run the same kernels on a real GPU where there is one.
//
// So kernels use only what both sides provide:
//   * __global__, __device__, __host__, __forceinline__, __shared__ (static
//     arrays, no initialisers), FA_DYNAMIC_SHARED for dynamic shared memory,
//     threadIdx, blockIdx, blockDim, gridDim (x, y, z), dim3;
//   * __syncthreads(), __syncwarp(), __shfl_sync / __shfl_xor_sync /
//     __shfl_down_sync / __shfl_up_sync on int, unsigned, float, double, long long
//     with the full-warp mask 0xffffffff, __ballot_sync, __any_sync, __all_sync;
//   * atomicAdd (float, double, int, unsigned, unsigned long long), atomicMax /
//     atomicMin (int, unsigned long long), atomicCAS, atomicExch;
//   * float math: expf, exp2f, logf, log2f, log1pf, sqrtf, rsqrtf, fabsf, fmaxf,
//     fminf, floorf, ceilf, tanhf, powf, __expf, __logf, __fdividef, isinf,
//     isnan, isfinite, INFINITY, NAN; double math from <cmath>; __popc, __popcll,
//     __ffs, __ffsll, __clz, __clzll, __float_as_uint, __uint_as_float, __ldg;
//   * __half and __nv_bfloat16 storage with fastattn::cuda::to_float /
//     from_float (arithmetic always in float);
//   * tensor-core tiles through the WMMA API as fa_wmma:: (nvcuda::wmma on the
//     GPU): fragment<matrix_a|matrix_b, 16, 16, 16, __half|__nv_bfloat16,
//     row_major|col_major>, fragment<accumulator, 16, 16, 16, float>,
//     fill_fragment, load_matrix_sync, store_matrix_sync (mem_row_major |
//     mem_col_major), mma_sync. The element order inside a fragment is
//     unspecified (the emulator's differs from the GPU's): touch frag.x[i] only
//     with the same operation for every i (scaling, conversion), and go through
//     shared memory for anything row- or column-wise.
// Not available: inline PTX, cp.async, cooperative groups, CUB, cuBLAS, and any
// CUDA runtime call inside kernel sources (memory is allocated by the caller;
// launchers receive every buffer, workspace included, as a pointer).
//
// Launch with FA_LAUNCH(grid, block, shared_bytes, stream, kernel)(args...)
// (the kernel last, so template arguments with commas need no parentheses),
// then FA_CHECK_LAUNCH("name"), which throws std::runtime_error on a launch
// error. Dynamic shared memory above 48 KiB needs
// FA_SET_MAX_DYNAMIC_SHARED(bytes, kernel) before the launch. Kernel
// arguments are passed by value (plain structs of pointers and sizes).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/common/cuda_dtype.h"

#if defined(__CUDACC__)

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

namespace fa_wmma = nvcuda::wmma;

#define FA_LAUNCH(grid, block, shared_bytes, stream, ...) \
  __VA_ARGS__<<<(grid), (block), (shared_bytes), (stream)>>>
#define FA_DYNAMIC_SHARED(type, name)                           \
  extern __shared__ __align__(16) unsigned char fa_dyn_smem_[]; \
  type* name = reinterpret_cast<type*>(fa_dyn_smem_)
#define FA_CHECK_LAUNCH(what)                                                        \
  do {                                                                               \
    const cudaError_t fa_err_ = cudaGetLastError();                                  \
    if (fa_err_ != cudaSuccess)                                                      \
      throw std::runtime_error(std::string("fastattn CUDA kernel ") + (what) +       \
                               " failed to launch: " + cudaGetErrorString(fa_err_)); \
  } while (0)
#define FA_SET_MAX_DYNAMIC_SHARED(bytes, ...)                                               \
  do {                                                                                      \
    const cudaError_t fa_err_ = cudaFuncSetAttribute(                                       \
        __VA_ARGS__, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)); \
    if (fa_err_ != cudaSuccess)                                                             \
      throw std::runtime_error(std::string("fastattn: cannot give a CUDA kernel ") +        \
                               std::to_string(bytes) +                                      \
                               " bytes of shared memory: " + cudaGetErrorString(fa_err_));  \
  } while (0)

#else  // FASTATTN_CUDA_EMULATION: the host compiler, kernels run by the emulator

#include "kernels/common/cuda_emulator.h"

#endif

namespace fastattn::cuda {

// Storage <-> float conversions (all kernel arithmetic is in float).
__host__ __device__ __forceinline__ float to_float(float x) { return x; }
__host__ __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__host__ __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__host__ __device__ __forceinline__ T from_float(float x);
template <>
__host__ __device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__host__ __device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__host__ __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Whole-warp reductions (every lane gets the result).
__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

__host__ __device__ __forceinline__ int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

}  // namespace fastattn::cuda

// Runs `...` with `scalar_t` bound to the storage type of `dtype`
// (fastattn::cuda::DType): float, __half or __nv_bfloat16.
#define FA_DISPATCH_FLOAT_TYPES(dtype, what, ...)                            \
  [&] {                                                                      \
    switch (dtype) {                                                         \
      case ::fastattn::cuda::DType::kFloat32: {                              \
        using scalar_t = float;                                              \
        return __VA_ARGS__();                                                \
      }                                                                      \
      case ::fastattn::cuda::DType::kFloat16: {                              \
        using scalar_t = __half;                                             \
        return __VA_ARGS__();                                                \
      }                                                                      \
      case ::fastattn::cuda::DType::kBFloat16: {                             \
        using scalar_t = __nv_bfloat16;                                      \
        return __VA_ARGS__();                                                \
      }                                                                      \
    }                                                                        \
    throw std::runtime_error(std::string("fastattn CUDA kernel ") + (what) + \
                             ": unsupported dtype");                         \
  }()
