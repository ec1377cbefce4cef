// Block-wide exclusive prefix sum for CUDA kernels (included after
// cuda_compat.cuh; internal linkage, one copy per kernel source): the
// clustering seeding's tie counts, the stable top-k selection's compaction.
#pragma once

#include "kernels/common/cuda_compat.cuh"

namespace fastattn::cuda {
namespace {

// Exclusive prefix sum of x over the block's threads (kWarps <= 32 full warps)
// in thread order; *total gets the sum. `red` holds kWarps entries; two
// barriers, so calls may reuse `red`.
template <int kWarps>
__device__ int block_exclusive_scan(int x, int* red, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int incl = x;
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  if (lane == 31) red[warp] = incl;
  __syncthreads();
  const int t = lane < kWarps ? red[lane] : 0;
  int ti = t;  // inclusive scan of the warp totals across the lanes
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, ti, o);
    if (lane >= o) ti += y;
  }
  *total = __shfl_sync(0xffffffffu, ti, 31);
  const int before = __shfl_sync(0xffffffffu, ti - t, warp);
  __syncthreads();
  return before + incl - x;
}

}  // namespace
}  // namespace fastattn::cuda
