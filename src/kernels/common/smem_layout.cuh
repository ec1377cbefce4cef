// One way to lay out a CUDA block's dynamic shared memory (included after
// cuda_compat.cuh). A kernel's layout is a struct of typed pointers whose
// constructor, a template on the carver, takes the arrays one after another;
// the same constructor gives the launcher the size (with an SmemCounter) and
// the kernel its pointers (with an SmemCarver), so the two cannot disagree:
//
//   template <typename T>
//   struct ForwardSmem {
//     T* q;      // (kBr, ldq)
//     float* s;  // (kBr, lds)
//     template <typename Carver>
//     __host__ __device__ ForwardSmem(Carver& c, int ldq, int lds)
//         : q(c.template take<T>(kBr * ldq)), s(c.template take<float>(kBr * lds)) {}
//   };
//   launcher: const size_t bytes = smem_bytes<ForwardSmem<T>>(ldq, lds);
//   kernel:   const ForwardSmem<T> sm = carve_smem<ForwardSmem<T>>(ldq, lds);
//
// Every array starts at a 128-byte boundary of the block's dynamic shared
// memory, which FA_DYNAMIC_SHARED declares 128-byte aligned (WMMA loads and
// stores need 32 bytes; 128 keeps arrays apart in the banks' cache lines).
// Two classes, not one with a null base for counting: the kernel's pointers
// must be plain arithmetic on the shared array for nvcc to keep them in the
// shared address space and fold the offsets. A carver that built them from an
// integer address, realigned its base at run time, or chose between the base
// and null (`base ? base + at : nullptr`) cost generic loads (no ld.shared, no
// wmma.load.shared), lost vector loads and took up to 50 more registers a
// thread in the full-attention, block-sparse and Reformer kernels (PTX and
// ptxas -v for sm_90).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/common/cuda_compat.cuh"

namespace fastattn::cuda {

__host__ __device__ __forceinline__ size_t align128(size_t x) {
  return (x + 127) & ~static_cast<size_t>(127);
}

// Counts a layout's bytes: the launcher's size (its pointers are null).
class SmemCounter {
 public:
  template <typename U>
  __host__ __device__ U* take(int64_t count) {
    at_ = align128(at_ + sizeof(U) * static_cast<size_t>(count));
    return nullptr;
  }
  __host__ __device__ size_t bytes() const { return at_; }

 private:
  size_t at_ = 0;
};

// Carves the block's dynamic shared memory `raw`: the kernel's pointers.
class SmemCarver {
 public:
  __host__ __device__ explicit SmemCarver(unsigned char* raw) : base_(raw) {}
  template <typename U>
  __host__ __device__ U* take(int64_t count) {
    U* p = reinterpret_cast<U*>(base_ + at_);
    at_ = align128(at_ + sizeof(U) * static_cast<size_t>(count));
    return p;
  }

 private:
  unsigned char* base_;
  size_t at_ = 0;
};

// The dynamic shared memory that Layout(carver, args...) takes.
template <typename Layout, typename... A>
size_t smem_bytes(A... args) {
  SmemCounter c;
  const Layout layout(c, args...);
  (void)layout;
  return c.bytes();
}

// Layout(carver, args...) in the block's dynamic shared memory.
template <typename Layout, typename... A>
__device__ __forceinline__ Layout carve_smem(A... args) {
  FA_DYNAMIC_SHARED(unsigned char, raw);
  SmemCarver c(raw);
  return Layout(c, args...);
}

}  // namespace fastattn::cuda
