// A CUDA execution emulator for testing fastattn's kernels on the CPU.
//
// Compiled only into the emulation tests (FASTATTN_CUDA_EMULATION; included
// by cuda_compat.cuh when the compiler is not nvcc). A launch runs the grid's
// blocks one after another on the calling thread; inside a block every CUDA
// thread is a fiber (ucontext) with its own stack, so a thread's locals,
// __syncthreads(), warp shuffles, votes and WMMA tiles behave as on the GPU:
// a fiber runs until it reaches a barrier, and the barrier opens when every
// thread of the block (or warp) has reached it.
//
// Stricter than the GPU where that finds bugs: a thread that exits while
// others wait at a barrier, or barriers reached by only part of a block or
// warp, abort with a message naming the block and thread. Not modelled:
// concurrency between blocks (they run in order, so inter-block races go
// unseen), memory-model subtleties within a block (fibers switch only at
// barriers, so a missing __syncthreads between a shared-memory write and
// another thread's read is caught only when the reader runs first: the
// emulator runs the threads of each phase in reverse order on every other
// block to make that likelier), and timing.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>

// ---- execution-space keywords --------------------------------------------
#undef __global__
#undef __device__
#undef __host__
#undef __shared__
#undef __forceinline__
#undef __launch_bounds__
#undef __restrict__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__
// Shared memory: one copy per OS thread; blocks run one at a time.
#define __shared__ static thread_local

namespace fastattn::cuda::emu {

const uint3& thread_idx();
const uint3& block_idx();
const dim3& block_dim();
const dim3& grid_dim();
void* dynamic_shared();
void sync_threads();
void sync_warp();
// Exchanges one 64-bit value per lane of the caller's warp: every lane
// publishes `mine`, then reads lane `src` (its own value when src is out of
// range).
uint64_t warp_exchange(uint64_t mine, int src);
// Every lane's `mine` into out[lane] (0 for lanes beyond a partial warp).
void warp_gather(uint64_t mine, uint64_t out[32]);
// WMMA scratch of the caller's warp: 3 × 256 floats.
float* warp_scratch();
int lane_id();
[[noreturn]] void fail(const std::string& what);

using Body = std::function<void()>;
// Runs the grid. `kernel` identifies the kernel for the dynamic shared memory
// check: above 48 KiB a launch needs set_max_dynamic_shared for that kernel
// first (as cudaFuncSetAttribute on the GPU), and no block may have more than
// an H100's 227 KiB.
void launch(dim3 grid, dim3 block, size_t shared_bytes, const void* kernel, const Body& body);
void set_max_dynamic_shared_for(const void* kernel, size_t bytes);
template <typename F>
void set_max_dynamic_shared(size_t bytes, F* kernel) {
  set_max_dynamic_shared_for(reinterpret_cast<const void*>(kernel), bytes);
}

// The emulated GPU and build, as 10·major + minor: the device's compute
// capability and the architecture the kernels' code was compiled for (what
// FA_USE_TENSOR_CORES asks; 0: no code for the device). Both 90 by default;
// tests set them to take the SIMT paths of older GPUs (ScopedArchitecture).
int device_arch();
int kernel_arch();
void set_architecture(int device_arch, int kernel_arch);
struct ScopedArchitecture {
  ScopedArchitecture(int device, int kernel) : device_(device_arch()), kernel_(kernel_arch()) {
    set_architecture(device, kernel);
  }
  ~ScopedArchitecture() { set_architecture(device_, kernel_); }
  ScopedArchitecture(const ScopedArchitecture&) = delete;
  ScopedArchitecture& operator=(const ScopedArchitecture&) = delete;

 private:
  int device_, kernel_;
};

template <typename T>
uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle of a large type");
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <typename T>
T from_bits(uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}

inline void check_full_mask(unsigned mask, const char* what) {
  if (mask != 0xffffffffu)
    fail(std::string(what) + ": only the full-warp mask 0xffffffff is emulated");
}

template <typename Kernel>
struct Launcher {
  dim3 grid, block;
  size_t shared_bytes;
  Kernel kernel;
  template <typename... Args>
  void operator()(Args... args) const {
    Kernel k = kernel;
    launch(grid, block, shared_bytes, reinterpret_cast<const void*>(k),
           [k, args...]() { k(args...); });
  }
};
template <typename Kernel>
Launcher<Kernel> make_launcher(dim3 grid, dim3 block, size_t shared_bytes, Kernel kernel) {
  return Launcher<Kernel>{grid, block, shared_bytes, kernel};
}

}  // namespace fastattn::cuda::emu

#define threadIdx (::fastattn::cuda::emu::thread_idx())
#define blockIdx (::fastattn::cuda::emu::block_idx())
#define blockDim (::fastattn::cuda::emu::block_dim())
#define gridDim (::fastattn::cuda::emu::grid_dim())

#define FA_LAUNCH(grid, block, shared_bytes, stream, ...) \
  ::fastattn::cuda::emu::make_launcher((grid), (block), (shared_bytes), __VA_ARGS__)
#define FA_DYNAMIC_SHARED(type, name) \
  type* name = reinterpret_cast<type*>(::fastattn::cuda::emu::dynamic_shared())
#define FA_CHECK_LAUNCH(what) \
  do {                        \
  } while (0)
#define FA_SET_MAX_DYNAMIC_SHARED(bytes, ...) \
  ::fastattn::cuda::emu::set_max_dynamic_shared((bytes), __VA_ARGS__)

// ---- synchronisation, shuffles, votes --------------------------------------
inline void __syncthreads() { ::fastattn::cuda::emu::sync_threads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  ::fastattn::cuda::emu::check_full_mask(mask, "__syncwarp");
  ::fastattn::cuda::emu::sync_warp();
}
inline void __threadfence() {}
inline void __threadfence_block() {}

template <typename T>
T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
  namespace e = ::fastattn::cuda::emu;
  e::check_full_mask(mask, "__shfl_sync");
  const int lane = e::lane_id();
  const int src = (lane & ~(width - 1)) + (src_lane & (width - 1));
  return e::from_bits<T>(e::warp_exchange(e::to_bits(v), src));
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  namespace e = ::fastattn::cuda::emu;
  e::check_full_mask(mask, "__shfl_xor_sync");
  const int lane = e::lane_id();
  int src = lane ^ lane_mask;
  if ((src & ~(width - 1)) != (lane & ~(width - 1))) src = lane;
  return e::from_bits<T>(e::warp_exchange(e::to_bits(v), src));
}
template <typename T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  namespace e = ::fastattn::cuda::emu;
  e::check_full_mask(mask, "__shfl_down_sync");
  const int lane = e::lane_id();
  const int src =
      (lane % width) + static_cast<int>(delta) < width ? lane + static_cast<int>(delta) : lane;
  return e::from_bits<T>(e::warp_exchange(e::to_bits(v), src));
}
template <typename T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  namespace e = ::fastattn::cuda::emu;
  e::check_full_mask(mask, "__shfl_up_sync");
  const int lane = e::lane_id();
  const int src = (lane % width) >= static_cast<int>(delta) ? lane - static_cast<int>(delta) : lane;
  return e::from_bits<T>(e::warp_exchange(e::to_bits(v), src));
}
unsigned __ballot_sync(unsigned mask, int predicate);
inline int __any_sync(unsigned mask, int predicate) { return __ballot_sync(mask, predicate) != 0; }
inline int __all_sync(unsigned mask, int predicate) { return __ballot_sync(mask, !predicate) == 0; }

// ---- atomics (blocks and fibers run on one OS thread: plain updates) ------
template <typename T>
inline T fa_emu_atomic_add(T* p, T v) {
  const T old = *p;
  *p = old + v;
  return old;
}
inline float atomicAdd(float* p, float v) { return fa_emu_atomic_add(p, v); }
inline double atomicAdd(double* p, double v) { return fa_emu_atomic_add(p, v); }
inline int atomicAdd(int* p, int v) { return fa_emu_atomic_add(p, v); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return fa_emu_atomic_add(p, v); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  return fa_emu_atomic_add(p, v);
}
template <typename T>
inline T atomicMax(T* p, T v) {
  const T old = *p;
  if (v > old) *p = v;
  return old;
}
template <typename T>
inline T atomicMin(T* p, T v) {
  const T old = *p;
  if (v < old) *p = v;
  return old;
}
template <typename T>
inline T atomicCAS(T* p, T compare, T v) {
  const T old = *p;
  if (old == compare) *p = v;
  return old;
}
template <typename T>
inline T atomicExch(T* p, T v) {
  const T old = *p;
  *p = v;
  return old;
}

// ---- intrinsics missing from the host's math library -----------------------
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __clzll(long long x) {
  return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x));
}
inline unsigned __float_as_uint(float x) {
  unsigned u;
  std::memcpy(&u, &x, 4);
  return u;
}
inline float __uint_as_float(unsigned u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
inline int __float_as_int(float x) {
  int u;
  std::memcpy(&u, &x, 4);
  return u;
}
inline float __int_as_float(int u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
template <typename T>
inline T __ldg(const T* p) {
  return *p;
}
using std::isfinite;
using std::isinf;
using std::isnan;

// ---- WMMA (16×16×16 tiles; a fragment's element order is the emulator's own)
namespace fa_wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

// Lane l holds elements 8l .. 8l+7 of the tile in row-major order.
template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && K == 16, "the emulator has 16x16x16 WMMA tiles only");
  static constexpr int num_elements = 8;
  T x[8];
};

namespace detail {
inline int first_element() { return 8 * ::fastattn::cuda::emu::lane_id(); }
// Offset of logical element (r, c) of a 16×16 tile stored with leading dim ldm.
inline size_t offset(int r, int c, unsigned ldm, bool row_major) {
  return row_major ? static_cast<size_t>(r) * ldm + c : static_cast<size_t>(c) * ldm + r;
}
}  // namespace detail

// Tiles of T exist from sm_70 (__half) or sm_80 (__nv_bfloat16) on: code
// "compiled" for an older emulated architecture must not load them (the
// launchers take their SIMT kernels there).
template <typename T>
void check_tile_architecture() {
  const int need = std::is_same<T, __nv_bfloat16>::value ? 80 : 70;
  const int arch = ::fastattn::cuda::emu::kernel_arch();
  if (arch < need)
    ::fastattn::cuda::emu::fail("a WMMA tile of a type that code for compute capability " +
                                std::to_string(arch / 10) + "." + std::to_string(arch % 10) +
                                " does not have");
}

template <typename Use, typename T, typename Layout>
void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout>& f, const T* p, unsigned ldm) {
  static_assert(!std::is_same<Use, accumulator>::value, "accumulator loads take a layout");
  check_tile_architecture<T>();
  ::fastattn::cuda::emu::sync_warp();
  const bool rm = std::is_same<Layout, row_major>::value;
  for (int i = 0; i < 8; ++i) {
    const int e = detail::first_element() + i;
    f.x[i] = p[detail::offset(e / 16, e % 16, ldm, rm)];
  }
  ::fastattn::cuda::emu::sync_warp();
}
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p,
                             unsigned ldm, layout_t layout) {
  ::fastattn::cuda::emu::sync_warp();
  for (int i = 0; i < 8; ++i) {
    const int e = detail::first_element() + i;
    f.x[i] = p[detail::offset(e / 16, e % 16, ldm, layout == mem_row_major)];
  }
  ::fastattn::cuda::emu::sync_warp();
}
inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f,
                              unsigned ldm, layout_t layout) {
  ::fastattn::cuda::emu::sync_warp();
  for (int i = 0; i < 8; ++i) {
    const int e = detail::first_element() + i;
    p[detail::offset(e / 16, e % 16, ldm, layout == mem_row_major)] = f.x[i];
  }
  ::fastattn::cuda::emu::sync_warp();
}
template <typename Use, typename T, typename Layout, typename V>
void fill_fragment(fragment<Use, 16, 16, 16, T, Layout>& f, V v) {
  for (int i = 0; i < 8; ++i) f.x[i] = static_cast<T>(v);
}

inline float element_to_float(float x) { return x; }
inline float element_to_float(__half x) { return __half2float(x); }
inline float element_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// d = a·b + c (float accumulation), the warp together.
template <typename T, typename LA, typename LB>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d,
              const fragment<matrix_a, 16, 16, 16, T, LA>& a,
              const fragment<matrix_b, 16, 16, 16, T, LB>& b,
              const fragment<accumulator, 16, 16, 16, float>& c) {
  namespace e = ::fastattn::cuda::emu;
  float* s = e::warp_scratch();  // a (16×16), b (16×16), c (16×16), row-major
  e::sync_warp();
  const int first = detail::first_element();
  for (int i = 0; i < 8; ++i) {
    s[first + i] = element_to_float(a.x[i]);
    s[256 + first + i] = element_to_float(b.x[i]);
    s[512 + first + i] = c.x[i];
  }
  e::sync_warp();
  float out[8];
  for (int i = 0; i < 8; ++i) {
    const int r = (first + i) / 16, col = (first + i) % 16;
    float acc = s[512 + first + i];
    for (int k = 0; k < 16; ++k) acc += s[r * 16 + k] * s[256 + k * 16 + col];
    out[i] = acc;
  }
  e::sync_warp();
  for (int i = 0; i < 8; ++i) d.x[i] = out[i];
}

}  // namespace fa_wmma
