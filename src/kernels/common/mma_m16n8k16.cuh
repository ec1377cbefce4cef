// Warp-level tensor-core products whose fragment layouts are known:
// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32 (compute
// capability 8.0 on), D (16x8, float) = A (16x16) B (16x8) + C.
//
// WMMA (cuda_compat.cuh) leaves the order of a fragment's elements
// unspecified, so the kernels built on it go through shared memory for
// anything row-wise (the softmax of a score tile). The PTX ISA fixes the
// order of mma.sync's fragments ("Matrix Fragments for mma.m16n8k16 with
// floating point type"): a kernel can keep a product in registers and reduce
// its rows there (the four lanes of a quad hold one row's columns), which is
// the next step for the full-attention kernel (docs/cuda.md). With
// g = lane / 4 and t = lane % 4, element i of a lane's fragment is at
//   A:    row g + 8·((i / 2) % 2),  column 2t + i % 2 + 8·(i / 4)   (i < 8)
//   B:    row 2t + i % 2 + 8·(i / 2),  column g                      (i < 4; B is K x N)
//   C, D: row g + 8·(i / 2),  column 2t + i % 2                      (i < 4)
// and pairs (x[0], x[1]), (x[2], x[3]), ... of A and B are the 32-bit
// registers the instruction takes, the lower index in the low half.
//
// The emulator (FASTATTN_CUDA_EMULATION) multiplies the same layouts through
// the warp's scratch; tests/cuda_emu/test_mma.cpp checks it against a float64
// product and tests/cuda/test_cuda_mma.cpp checks the GPU's result of the
// same probe kernel (mma_probe_cuda.cu) against the same reference, so a
// layout assumed wrongly here fails there, not inside an attention kernel.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/common/cuda_compat.cuh"

namespace fastattn::cuda {

// The oldest compute capability with these instructions (10·major + minor).
constexpr int kMmaMinArch = 80;

template <typename T>
struct MmaA {
  alignas(16) T x[8];
};
template <typename T>
struct MmaB {
  alignas(8) T x[4];
};
struct MmaC {
  float x[4];
};

__host__ __device__ constexpr int mma_a_row(int lane, int i) {
  return lane / 4 + 8 * ((i / 2) % 2);
}
__host__ __device__ constexpr int mma_a_col(int lane, int i) {
  return 2 * (lane % 4) + i % 2 + 8 * (i / 4);
}
__host__ __device__ constexpr int mma_b_row(int lane, int i) {
  return 2 * (lane % 4) + i % 2 + 8 * (i / 2);
}
__host__ __device__ constexpr int mma_b_col(int lane, int /*i*/) { return lane / 4; }
__host__ __device__ constexpr int mma_c_row(int lane, int i) { return lane / 4 + 8 * (i / 2); }
__host__ __device__ constexpr int mma_c_col(int lane, int i) { return 2 * (lane % 4) + i % 2; }

template <typename T>
constexpr bool is_mma_type() {
  return std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value;
}

#if defined(__CUDACC__)

// d = a·b + c, by every lane of the warp together (converged); d may be c.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(MmaC& d, const MmaA<T>& a, const MmaB<T>& b,
                                             const MmaC& c) {
  static_assert(is_mma_type<T>(), "mma_m16n8k16: __half or __nv_bfloat16 operands");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t* ra = reinterpret_cast<const uint32_t*>(a.x);
  const uint32_t* rb = reinterpret_cast<const uint32_t*>(b.x);
  const float c0 = c.x[0], c1 = c.x[1], c2 = c.x[2], c3 = c.x[3];
// One instruction per operand type; only the type names differ.
#define FA_MMA_M16N8K16(type)                                                                     \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." type "." type                             \
               ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"       \
               : "=f"(d.x[0]), "=f"(d.x[1]), "=f"(d.x[2]), "=f"(d.x[3])                           \
               : "r"(ra[0]), "r"(ra[1]), "r"(ra[2]), "r"(ra[3]), "r"(rb[0]), "r"(rb[1]), "f"(c0), \
                 "f"(c1), "f"(c2), "f"(c3))
  if constexpr (std::is_same<T, __half>::value) {
    FA_MMA_M16N8K16("f16");
  } else {
    FA_MMA_M16N8K16("bf16");
  }
#undef FA_MMA_M16N8K16
#else
  // Code for an older GPU: the launcher must not run this (FA_KERNEL_ARCH).
  (void)d, (void)a, (void)b, (void)c;
  __trap();
#endif
}

#else  // FASTATTN_CUDA_EMULATION

template <typename T>
void mma_m16n8k16(MmaC& d, const MmaA<T>& a, const MmaB<T>& b, const MmaC& c) {
  static_assert(is_mma_type<T>(), "mma_m16n8k16: __half or __nv_bfloat16 operands");
  namespace e = ::fastattn::cuda::emu;
  if (e::kernel_arch() < kMmaMinArch)
    e::fail("mma.sync m16n8k16 in code for compute capability " +
            detail::arch_string(e::kernel_arch()) + " (it needs 8.0)");
  const dim3& bd = e::block_dim();
  if ((bd.x * bd.y * bd.z) % 32 != 0) e::fail("mma.sync m16n8k16 in a block of partial warps");
  float* s = e::warp_scratch();  // A 16x16 | B 16x8 | C 16x8, row-major
  const int lane = e::lane_id();
  e::sync_warp();
  for (int i = 0; i < 8; ++i) s[mma_a_row(lane, i) * 16 + mma_a_col(lane, i)] = to_float(a.x[i]);
  for (int i = 0; i < 4; ++i)
    s[256 + mma_b_row(lane, i) * 8 + mma_b_col(lane, i)] = to_float(b.x[i]);
  for (int i = 0; i < 4; ++i) s[384 + mma_c_row(lane, i) * 8 + mma_c_col(lane, i)] = c.x[i];
  e::sync_warp();
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const int r = mma_c_row(lane, i), col = mma_c_col(lane, i);
    float acc = s[384 + r * 8 + col];
    for (int k = 0; k < 16; ++k) acc += s[r * 16 + k] * s[256 + k * 8 + col];
    out[i] = acc;
  }
  e::sync_warp();
  for (int i = 0; i < 4; ++i) d.x[i] = out[i];
}

#endif

}  // namespace fastattn::cuda
