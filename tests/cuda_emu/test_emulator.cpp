// The CUDA emulator itself (tests/cuda_emu/support/cuda_emulator.h): barriers,
// shared memory, warp shuffles and votes, WMMA tiles and its misuse checks,
// on small kernels written here.
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "kernels/common/cuda_compat.cuh"

namespace {

using fastattn::cuda::from_float;
using fastattn::cuda::to_float;
using fastattn::cuda::warp_max;
using fastattn::cuda::warp_sum;

// Block sum through shared memory, reversed in place between barriers.
__global__ void block_sum_kernel(const float* x, float* out, int n) {
  __shared__ float buf[256];
  const int t = threadIdx.x;
  const int i = blockIdx.x * blockDim.x + t;
  buf[t] = i < n ? x[i] : 0.f;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (t < s) buf[t] += buf[t + s];
    __syncthreads();
  }
  if (t == 0) out[blockIdx.x] = buf[0];
}

TEST(CudaEmulator, BlockReductionWithBarriers) {
  const int n = 1000, threads = 256, blocks = (n + threads - 1) / threads;
  std::vector<float> x(n), out(blocks, -1.f);
  for (int i = 0; i < n; ++i) x[i] = static_cast<float>(i % 7) - 3.f;
  FA_LAUNCH(dim3(blocks), dim3(threads), 0, nullptr, block_sum_kernel)(x.data(), out.data(), n);
  for (int b = 0; b < blocks; ++b) {
    double want = 0;
    for (int i = b * threads; i < std::min(n, (b + 1) * threads); ++i) want += x[i];
    EXPECT_FLOAT_EQ(out[b], static_cast<float>(want)) << "block " << b;
  }
}

// Warp reductions, shuffles and votes on a partial grid of 2D blocks.
__global__ void warp_kernel(const float* x, float* sums, float* maxes, int* down, unsigned* votes,
                            int* up) {
  const int linear = threadIdx.y * blockDim.x + threadIdx.x;
  const int lane = linear % 32, warp = linear / 32;
  const int g = blockIdx.x * 64 + linear;
  const float v = x[g];
  const float s = warp_sum(v), m = warp_max(v);
  const int d = __shfl_down_sync(0xffffffffu, lane * 10, 3);
  const int u = __shfl_up_sync(0xffffffffu, lane * 10, 5);
  const unsigned b = __ballot_sync(0xffffffffu, v > 0.f);
  down[g] = d;
  up[g] = u;
  if (lane == 0) {
    sums[blockIdx.x * 2 + warp] = s;
    maxes[blockIdx.x * 2 + warp] = m;
    votes[blockIdx.x * 2 + warp] = b;
  }
}

TEST(CudaEmulator, WarpShufflesAndVotes) {
  const int blocks = 3, n = blocks * 64;
  std::vector<float> x(n), sums(blocks * 2), maxes(blocks * 2);
  std::vector<int> down(n), up(n);
  std::vector<unsigned> votes(blocks * 2);
  for (int i = 0; i < n; ++i) x[i] = static_cast<float>((i * 37) % 23) - 11.f;
  FA_LAUNCH(dim3(blocks), dim3(16, 4), 0, nullptr, warp_kernel)
  (x.data(), sums.data(), maxes.data(), down.data(), votes.data(), up.data());
  for (int w = 0; w < blocks * 2; ++w) {
    float s = 0, m = -1e30f;
    unsigned b = 0;
    for (int l = 0; l < 32; ++l) {
      s += x[w * 32 + l];
      m = std::max(m, x[w * 32 + l]);
      if (x[w * 32 + l] > 0) b |= 1u << l;
    }
    EXPECT_FLOAT_EQ(sums[w], s);
    EXPECT_FLOAT_EQ(maxes[w], m);
    EXPECT_EQ(votes[w], b);
    for (int l = 0; l < 32; ++l) {
      EXPECT_EQ(down[w * 32 + l], (l + 3 < 32 ? l + 3 : l) * 10);
      EXPECT_EQ(up[w * 32 + l], (l >= 5 ? l - 5 : l) * 10);
    }
  }
}

// One warp: C (16×16, float) = A (16×16) · B^T with B given row-major as
// (n, k), i.e. matrix_b in col_major, plus a scaled accumulator.
template <typename T>
__global__ void wmma_kernel(const T* a, const T* b, float* c) {
  fa_wmma::fragment<fa_wmma::matrix_a, 16, 16, 16, T, fa_wmma::row_major> fa;
  fa_wmma::fragment<fa_wmma::matrix_b, 16, 16, 16, T, fa_wmma::col_major> fb;
  fa_wmma::fragment<fa_wmma::accumulator, 16, 16, 16, float> acc;
  fa_wmma::load_matrix_sync(acc, c, 16, fa_wmma::mem_row_major);
  for (int i = 0; i < acc.num_elements; ++i) acc.x[i] *= 2.f;
  fa_wmma::load_matrix_sync(fa, a, 16);
  fa_wmma::load_matrix_sync(fb, b, 16);
  fa_wmma::mma_sync(acc, fa, fb, acc);
  fa_wmma::store_matrix_sync(c, acc, 16, fa_wmma::mem_row_major);
}

template <typename T>
void check_wmma() {
  std::vector<T> a(256), b(256);
  std::vector<float> af(256), bf(256), c(256);
  for (int i = 0; i < 256; ++i) {
    a[i] = from_float<T>(static_cast<float>((i * 13) % 9) - 4.f);
    b[i] = from_float<T>(static_cast<float>((i * 7) % 5) - 2.f);
    af[i] = to_float(a[i]);
    bf[i] = to_float(b[i]);
    c[i] = static_cast<float>(i % 3);
  }
  const std::vector<float> c0 = c;
  FA_LAUNCH(dim3(1), dim3(32), 0, nullptr, wmma_kernel<T>)(a.data(), b.data(), c.data());
  for (int r = 0; r < 16; ++r)
    for (int col = 0; col < 16; ++col) {
      float want = 2.f * c0[r * 16 + col];
      for (int k = 0; k < 16; ++k) want += af[r * 16 + k] * bf[col * 16 + k];
      EXPECT_FLOAT_EQ(c[r * 16 + col], want) << r << ", " << col;
    }
}

TEST(CudaEmulator, WmmaTiles) {
  check_wmma<__half>();
  check_wmma<__nv_bfloat16>();
}

// Dynamic shared memory, one block of 3 partial warps.
__global__ void dynamic_shared_kernel(int* out) {
  FA_DYNAMIC_SHARED(int, buf);
  buf[threadIdx.x] = static_cast<int>(threadIdx.x) * 2;
  __syncthreads();
  out[threadIdx.x] = buf[blockDim.x - 1 - threadIdx.x];
}

TEST(CudaEmulator, DynamicSharedMemory) {
  const int n = 70;
  std::vector<int> out(n);
  FA_LAUNCH(dim3(1), dim3(n), n * sizeof(int), nullptr, dynamic_shared_kernel)(out.data());
  for (int i = 0; i < n; ++i) EXPECT_EQ(out[i], (n - 1 - i) * 2);
}

__global__ void big_shared_kernel(int* out) {
  FA_DYNAMIC_SHARED(int, buf);
  buf[threadIdx.x] = 7;
  __syncthreads();
  out[threadIdx.x] = buf[threadIdx.x];
}

TEST(CudaEmulatorDeathTest, LargeDynamicSharedMemoryNeedsTheAttribute) {
  std::vector<int> out(32);
  const size_t bytes = 64 * 1024;
  EXPECT_DEATH(FA_LAUNCH(dim3(1), dim3(32), bytes, nullptr, big_shared_kernel)(out.data()),
               "FA_SET_MAX_DYNAMIC_SHARED first");
  EXPECT_DEATH(FA_SET_MAX_DYNAMIC_SHARED(300 * 1024, big_shared_kernel), "227 KiB");
  FA_SET_MAX_DYNAMIC_SHARED(bytes, big_shared_kernel);
  FA_LAUNCH(dim3(1), dim3(32), bytes, nullptr, big_shared_kernel)(out.data());
  EXPECT_EQ(out[31], 7);
}

__global__ void divergent_barrier_kernel(int* out) {
  if (threadIdx.x == 0) return;  // exits while the others wait
  __syncthreads();
  out[threadIdx.x] = 1;
}

TEST(CudaEmulatorDeathTest, BarrierNotReachedByEveryThreadAborts) {
  std::vector<int> out(64);
  EXPECT_DEATH(FA_LAUNCH(dim3(1), dim3(64), 0, nullptr, divergent_barrier_kernel)(out.data()),
               "deadlock: __syncthreads");
}

}  // namespace
