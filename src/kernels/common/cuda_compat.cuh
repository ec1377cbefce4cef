// The portability layer of fastattn's CUDA kernels (src/kernels/*/*_cuda.cu).
//
// Every kernel source includes this header first and is compiled two ways:
//   * by nvcc (CUDA language, when the build has nvcc) into the library, and
//   * by the host C++ compiler with FASTATTN_CUDA_EMULATION defined, into the
//     emulation tests (tests/cuda_emu/), where tests/cuda_emu/support/cuda_emulator.h
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
// Not available: inline PTX (except mma.sync m16n8k16, through
// mma_m16n8k16.cuh, which the emulator knows), cp.async, cooperative groups,
// CUB, cuBLAS, and any CUDA runtime call inside kernel sources (memory is
// allocated by the caller; launchers receive every buffer, workspace included,
// as a pointer).
//
// Tensor cores by architecture: WMMA tiles of __half need compute capability
// 7.0, of __nv_bfloat16 8.0. A kernel that uses them for T keeps its body in a
// __device__ function and runs it only `if constexpr (wmma_compiled<T>())`,
// which is false in the device code of older architectures (nvcc rejects
// bfloat16 fragments below sm_80). The launcher decides at run time with
// FA_USE_TENSOR_CORES(T, "name", kernel): true when the image of `kernel`
// that runs on the current device was compiled for an architecture with T's
// tiles; otherwise it launches its SIMT kernel (bfloat16 on sm_75 GPUs, or on
// any GPU with a build whose code for it predates sm_80). Both sides look at
// the same thing (the architecture the code was compiled for), so they agree.
//
// FA_UNROLL before a loop asks nvcc to unroll it fully (a thread's
// per-row or per-chunk arrays then stay in registers); the emulator's
// compiler needs no hint.
//
// Launch with FA_LAUNCH(grid, block, shared_bytes, stream, kernel)(args...)
// (the kernel last, so template arguments with commas need no parentheses),
// then FA_CHECK_LAUNCH("name"), which throws std::runtime_error on a launch
// error. Dynamic shared memory above 48 KiB needs
// FA_SET_MAX_DYNAMIC_SHARED(bytes, kernel) before the launch. Kernel
// arguments are passed by value (plain structs of pointers and sizes).
#pragma once

#if defined(__CUDACC__)
#define FA_UNROLL _Pragma("unroll")
#else
#define FA_UNROLL
#endif

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/common/cuda_dtype.h"

namespace fastattn::cuda::detail {

// "8.6" for 86.
inline std::string arch_string(int arch) {
  return std::to_string(arch / 10) + "." + std::to_string(arch % 10);
}

[[noreturn]] inline void throw_no_kernel_image(const char* what, int device_arch,
                                               const std::string& why) {
  throw std::runtime_error(
      std::string("fastattn CUDA kernel ") + what + ": this build has no code for the device" +
      (device_arch > 0 ? " (compute capability " + arch_string(device_arch) + ")" : "") + " (" +
      why + "); rebuild fastattn with its compute capability in TORCH_CUDA_ARCH_LIST");
}

}  // namespace fastattn::cuda::detail

#if defined(__CUDACC__)

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <map>
#include <mutex>
#include <utility>

namespace fa_wmma = nvcuda::wmma;

namespace fastattn::cuda::detail {

// Compute capability of the current device as 10·major + minor (0 if unknown).
inline int current_device_arch() {
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return 10 * major + minor;
}

// The architecture (10·major + minor, as __CUDA_ARCH__ / 10) that the image
// of `kernel` running on the current device was compiled for: the PTX target,
// capped by the machine code's (both name it; the cap keeps this right
// whichever a driver reports). Cached per kernel and device; throws when the
// build has no image for the device.
inline int kernel_arch(const void* kernel, const char* what) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    const cudaError_t err = cudaGetLastError();
    throw std::runtime_error(std::string("fastattn CUDA kernel ") + what +
                             ": no current device: " + cudaGetErrorString(err));
  }
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, int> cache;
  {
    std::lock_guard<std::mutex> lock(mutex);
    const auto it = cache.find({kernel, device});
    if (it != cache.end()) return it->second;
  }
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess) {
    const cudaError_t err = cudaGetLastError();
    throw_no_kernel_image(what, current_device_arch(), cudaGetErrorString(err));
  }
  const int arch = attr.ptxVersion < attr.binaryVersion ? attr.ptxVersion : attr.binaryVersion;
  std::lock_guard<std::mutex> lock(mutex);
  cache[{kernel, device}] = arch;
  return arch;
}

}  // namespace fastattn::cuda::detail

#define FA_KERNEL_ARCH(what, ...) \
  ::fastattn::cuda::detail::kernel_arch(reinterpret_cast<const void*>(__VA_ARGS__), (what))
#define FA_TRAP() __trap()

#define FA_LAUNCH(grid, block, shared_bytes, stream, ...) \
  __VA_ARGS__<<<(grid), (block), (shared_bytes), (stream)>>>
#define FA_DYNAMIC_SHARED(type, name)                            \
  extern __shared__ __align__(128) unsigned char fa_dyn_smem_[]; \
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

#include "cuda_emulator.h"

namespace fastattn::cuda::detail {
// The emulated build's architecture for every kernel (emu::set_architecture).
inline int kernel_arch(const char* what) {
  const int arch = ::fastattn::cuda::emu::kernel_arch();
  if (arch <= 0)
    throw_no_kernel_image(what, ::fastattn::cuda::emu::device_arch(),
                          "no kernel image is available for execution on the device");
  return arch;
}
}  // namespace fastattn::cuda::detail

#define FA_KERNEL_ARCH(what, ...) ::fastattn::cuda::detail::kernel_arch(what)
#define FA_TRAP() ::fastattn::cuda::emu::fail("a tensor-core kernel ran without tensor cores")

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

// The architecture (10·major + minor) whose tensor cores take WMMA tiles of
// T: 70 for __half, 80 for __nv_bfloat16; 0 for types without tiles.
template <typename T>
__host__ __device__ constexpr int wmma_min_arch() {
  return std::is_same<T, __nv_bfloat16>::value ? 80 : std::is_same<T, __half>::value ? 70 : 0;
}

// Whether the code being compiled has T's WMMA tiles: the device code of an
// architecture from wmma_min_arch<T>() on, the host pass and the emulator.
template <typename T>
__host__ __device__ constexpr bool wmma_compiled() {
#if defined(__CUDA_ARCH__)
  return wmma_min_arch<T>() > 0 && __CUDA_ARCH__ >= 10 * wmma_min_arch<T>();
#else
  return wmma_min_arch<T>() > 0;
#endif
}

// The oldest architecture the build compiles device code for (CMake passes
// it, cmake/cuda_arch.cmake); 0 where unknown (the emulator: every path).
#if defined(FASTATTN_CUDA_MIN_ARCH)
constexpr int kMinBuildArch = FASTATTN_CUDA_MIN_ARCH;
#else
constexpr int kMinBuildArch = 0;
#endif

// Whether every architecture of the build has T's tiles: then launchers
// need no SIMT path for T (nor instantiate one) and ask nothing at run time.
template <typename T>
constexpr bool wmma_always() {
  return wmma_min_arch<T>() > 0 && kMinBuildArch >= wmma_min_arch<T>();
}

// Host side: whether code compiled for `kernel_arch` has T's tiles.
template <typename T>
inline bool use_tensor_cores(int kernel_arch) {
  return wmma_min_arch<T>() > 0 && kernel_arch >= wmma_min_arch<T>();
}

}  // namespace fastattn::cuda

// Host side, before launching a kernel that has a tensor-core path for T and
// a SIMT one: whether the tensor-core kernel `...` (the one to be launched) can
// use tensor cores on the current device; a constant true where every
// architecture of the build has them (wmma_always), so the SIMT launch that
// follows is compiled only `if constexpr (!wmma_always<T>())`. Throws when
// the build has no code for the device.
#define FA_USE_TENSOR_CORES(T, what, ...) \
  (::fastattn::cuda::wmma_always<T>() ||  \
   ::fastattn::cuda::use_tensor_cores<T>(FA_KERNEL_ARCH(what, __VA_ARGS__)))

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
