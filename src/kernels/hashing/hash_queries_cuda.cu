// CUDA kernel of sign-of-random-projection hashing (see hashing.h): bit b of
// row r's code is 1 iff bias_b + Σ_e x[r, e]·w_b[e] > 0, accumulated in float
// from the bias with one fmaf per e in increasing e (the CPU float kernel's
// order, so the codes are bit-identical to it away from projections within
// rounding of 0).
//
// One warp per row (grid-stride): lane j owns bits j and j + 32; the row is
// read 32 elements at a time (coalesced) and broadcast by shuffles; the
// planes sit transposed in shared memory, (E + 1, 64) floats, when they fit
// in 48 KiB (E <= 190), else they are read from global memory (cached).
// The bits are gathered with two ballots. Cost N·H·L·B·E multiply-adds.
// Tested by tests/cuda_emu/test_hashing.cpp against hash_queries_cpu.
#include "kernels/hashing/hash_queries_cuda.h"

#include "kernels/common/cuda_compat.cuh"

namespace fastattn::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int64_t kMaxSharedBytes = 48 * 1024;

template <typename T, bool kShared>
__global__ void hash_queries_kernel(HashQueriesCudaArgs a) {
  FA_DYNAMIC_SHARED(float, pt);  // kShared: (E + 1, 64) planes transposed, zero-padded
  const int64_t E = a.E;
  const int B = a.B;
  const T* x = static_cast<const T*>(a.x);
  const T* planes = static_cast<const T*>(a.planes);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (kShared) {
    for (int64_t i = tid; i < (E + 1) * 64; i += blockDim.x) {
      const int64_t e = i / 64, b = i % 64;
      pt[i] = b < B ? to_float(planes[b * (E + 1) + e]) : 0.f;
    }
    __syncthreads();
  }
  const int b0 = lane, b1 = lane + 32;
  auto w = [&](int64_t e, int b) -> float {
    if (kShared) return pt[e * 64 + b];
    return b < B ? to_float(planes[b * (E + 1) + e]) : 0.f;
  };
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + warp; r < a.rows; r += stride) {
    const T* xr = x + r * E;
    float acc0 = w(E, b0), acc1 = w(E, b1);
    for (int64_t e0 = 0; e0 < E; e0 += 32) {
      const float mine = e0 + lane < E ? to_float(xr[e0 + lane]) : 0.f;
      const int n = static_cast<int>(E - e0 < 32 ? E - e0 : 32);
      for (int j = 0; j < n; ++j) {
        const float xe = __shfl_sync(0xffffffffu, mine, j);
        acc0 = fmaf(xe, w(e0 + j, b0), acc0);
        acc1 = fmaf(xe, w(e0 + j, b1), acc1);
      }
    }
    const unsigned lo = __ballot_sync(0xffffffffu, b0 < B && acc0 > 0.f);
    const unsigned hi = __ballot_sync(0xffffffffu, b1 < B && acc1 > 0.f);
    if (lane == 0)
      a.codes[r] =
          static_cast<int64_t>(static_cast<uint64_t>(lo) | (static_cast<uint64_t>(hi) << 32));
  }
}

}  // namespace

void hash_queries_cuda(const HashQueriesCudaArgs& a, cudaStream_t stream) {
  if (a.rows == 0) return;
  const int64_t blocks64 = ceil_div(a.rows, kWarps);
  const unsigned blocks = static_cast<unsigned>(blocks64 < 4096 ? blocks64 : 4096);
  const int64_t shared = (a.E + 1) * 64 * static_cast<int64_t>(sizeof(float));
  FA_DISPATCH_FLOAT_TYPES(a.dtype, "hash_queries", [&] {
    if (shared <= kMaxSharedBytes) {
      FA_LAUNCH(dim3(blocks), dim3(32 * kWarps), static_cast<size_t>(shared), stream,
                hash_queries_kernel<scalar_t, true>)
      (a);
    } else {
      FA_LAUNCH(dim3(blocks), dim3(32 * kWarps), 0, stream, hash_queries_kernel<scalar_t, false>)
      (a);
    }
    FA_CHECK_LAUNCH("hash_queries");
  });
}

}  // namespace fastattn::cuda
