// CUDA kernel of Hamming K-means over hash codes (see clustering.h): the
// CPU kernel's algorithm step for step, so the assignments and counts are
// identical to cluster_codes_cpu's for every seed:
//  - the same splitmix64 stream per (n, h) (drawn by thread 0), the same
//    farthest-first seeding (the r-th tie in increasing query order),
//  - assignment to the nearest centroid by popcount(code ^ centroid), lowest
//    cluster index on ties; empty clusters re-seeded in increasing index
//    with the farthest query (lowest index on ties) among clusters with >= 2
//    members; centroid bit = strict majority of the members' bits; the same
//    stopping rule.
// One block of 512 threads per (n, h): queries are strided over the threads
// (coalesced code reads); block reductions by warp shuffles and one shared
// round; the seeding's tie selection counts ties in contiguous per-thread
// chunks and scans the counts. Centroids, counts and bit counters (C·268
// bytes) live in shared memory when they fit in 48 KiB (C <= 183), else in
// the workspace; the per-query distances always in the workspace.
// Cost per (n, h): O(L·C_eff) popcounts per assignment and for the seeding,
// O(L·64) shared atomics per centroid update.
// Tested by tests/cuda_emu/test_clustering.cpp against cluster_codes_cpu.
#include "kernels/clustering/cluster_codes_cuda.h"

#include <climits>

#include "kernels/common/cuda_compat.cuh"

namespace fastattn::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kMaxSharedBytes = 48 * 1024;

struct SplitMix64 {
  uint64_t state;
  __device__ uint64_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  __device__ uint64_t below(uint64_t n) { return next() % n; }
};

// Per-(n, h) state bytes: centroids (C uint64), counts (C int), bit counters (C·64 int).
__host__ __device__ inline int64_t cluster_state_bytes(int64_t C) { return C * (8 + 4 + 256); }
// Per-(n, h) workspace bytes: distances (L int32, rounded to 8 bytes) + the state.
__host__ __device__ inline int64_t per_head_bytes(int64_t L, int64_t C) {
  return (L * 4 + 7) / 8 * 8 + cluster_state_bytes(C);
}

// Block-wide reductions (every thread gets the result); `red` holds kWarps
// entries. Two barriers each, so consecutive calls may reuse `red`.
__device__ int block_max_int(int x, int* red) {
  for (int o = 16; o > 0; o >>= 1) {
    const int y = __shfl_xor_sync(0xffffffffu, x, o);
    x = y > x ? y : x;
  }
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = x;
  __syncthreads();
  int r = red[0];
  for (int w = 1; w < kWarps; ++w) r = red[w] > r ? red[w] : r;
  __syncthreads();
  return r;
}

__device__ unsigned long long block_max_u64(unsigned long long x, unsigned long long* red) {
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned long long y = __shfl_xor_sync(0xffffffffu, x, o);
    x = y > x ? y : x;
  }
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = x;
  __syncthreads();
  unsigned long long r = red[0];
  for (int w = 1; w < kWarps; ++w) r = red[w] > r ? red[w] : r;
  __syncthreads();
  return r;
}

// Exclusive prefix sum of x over the block's threads in thread order; *total
// gets the sum.
__device__ int block_exclusive_scan(int x, int* red, int* total) {
  const int lane = threadIdx.x & 31;
  int incl = x;
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  if (lane == 31) red[threadIdx.x >> 5] = incl;
  __syncthreads();
  int before = 0, all = 0;
  for (int w = 0; w < kWarps; ++w) {
    if (w < static_cast<int>(threadIdx.x >> 5)) before += red[w];
    all += red[w];
  }
  __syncthreads();
  *total = all;
  return before + incl - x;
}

__global__ void __launch_bounds__(kThreads) cluster_codes_kernel(ClusterCodesCudaArgs p,
                                                                 bool state_in_shared) {
  FA_DYNAMIC_SHARED(unsigned char, smem);
  __shared__ int red_i[kWarps];
  __shared__ unsigned long long red_u[kWarps];
  __shared__ int s_pick, s_changed;
  const int64_t nh = blockIdx.x;
  const int64_t L = p.L, C = p.C;
  const int tid = threadIdx.x;
  const int64_t n = nh / p.H;
  int64_t Lv = L;
  if (p.lengths) {
    Lv = p.lengths[n];
    Lv = Lv < 0 ? 0 : (Lv > L ? L : Lv);
  }
  const int64_t Ce = C < Lv ? C : Lv;
  const uint64_t* codes = reinterpret_cast<const uint64_t*>(p.codes + nh * L);
  int64_t* a = p.assignments + nh * L;
  int64_t* counts_out = p.counts + nh * C;
  unsigned char* ws = static_cast<unsigned char*>(p.workspace) + nh * per_head_bytes(L, C);
  int* dist = reinterpret_cast<int*>(ws);
  unsigned char* state = state_in_shared ? smem : ws + (L * 4 + 7) / 8 * 8;
  uint64_t* cent = reinterpret_cast<uint64_t*>(state);
  int* cnt = reinterpret_cast<int*>(state + C * 8);
  int* ones = cnt + C;

  for (int64_t l = tid; l < L; l += kThreads) a[l] = -1;
  for (int64_t c = tid; c < C; c += kThreads) counts_out[c] = 0;
  if (Ce == 0) return;  // uniform: the whole block leaves

  // ---- farthest-first seeding -------------------------------------------------
  SplitMix64 rng{p.seed ^ (0xD1B54A32D192ED03ull * static_cast<uint64_t>(nh + 1))};  // thread 0's
  for (int64_t l = tid; l < Lv; l += kThreads) dist[l] = INT_MAX;
  if (tid == 0) s_pick = static_cast<int>(rng.below(static_cast<uint64_t>(Lv)));
  __syncthreads();
  const int64_t chunk = (Lv + kThreads - 1) / kThreads;
  const int64_t c0 = tid * chunk, c1 = (tid + 1) * chunk < Lv ? (tid + 1) * chunk : Lv;
  for (int64_t j = 0; j < Ce; ++j) {
    const int64_t pick = s_pick;
    const uint64_t centroid = codes[pick];
    if (tid == 0) cent[j] = centroid;
    if (j + 1 == Ce) break;
    int local = -1;
    for (int64_t l = tid; l < Lv; l += kThreads) {
      int d = dist[l];
      const int h = __popcll(codes[l] ^ centroid);
      d = l == pick ? -1 : (h < d ? h : d);
      dist[l] = d;
      local = d > local ? d : local;
    }
    const int best = block_max_int(local, red_i);  // its barriers publish dist
    int mine = 0;
    for (int64_t l = c0; l < c1; ++l) mine += dist[l] == best;
    int ties = 0;
    const int before = block_exclusive_scan(mine, red_i, &ties);
    if (tid == 0) s_pick = static_cast<int>(rng.below(static_cast<uint64_t>(ties)));
    __syncthreads();
    const int r = s_pick;
    __syncthreads();
    if (r >= before && r < before + mine) {
      int left = r - before;
      for (int64_t l = c0; l < c1; ++l) {
        if (dist[l] != best) continue;
        if (left-- == 0) {
          s_pick = static_cast<int>(l);
          break;
        }
      }
    }
    __syncthreads();
  }
  __syncthreads();

  // ---- assignment (+ re-seeding of empty clusters); returns "changed" -----------
  auto assign = [&]() -> bool {
    for (int64_t c = tid; c < Ce; c += kThreads) cnt[c] = 0;
    if (tid == 0) s_changed = 0;
    __syncthreads();
    bool changed = false;
    for (int64_t l = tid; l < Lv; l += kThreads) {
      const uint64_t x = codes[l];
      int best = INT_MAX;
      int64_t best_c = 0;
      for (int64_t c = 0; c < Ce; ++c) {
        const int d = __popcll(x ^ cent[c]);
        if (d < best) {
          best = d;
          best_c = c;
        }
      }
      changed |= a[l] != best_c;
      a[l] = best_c;
      dist[l] = best;
      atomicAdd(&cnt[best_c], 1);
    }
    if (changed) s_changed = 1;
    __syncthreads();
    for (int64_t c = 0; c < Ce; ++c) {
      if (cnt[c] > 0) continue;  // uniform: read after a barrier
      unsigned long long key = 0;
      for (int64_t l = tid; l < Lv; l += kThreads) {
        if (cnt[a[l]] < 2) continue;
        const unsigned long long k =
            (static_cast<unsigned long long>(dist[l] + 1) << 32) | (0xffffffffull - static_cast<unsigned long long>(l));
        key = k > key ? k : key;
      }
      key = block_max_u64(key, red_u);
      if (tid == 0) {
        const int64_t far = static_cast<int64_t>(0xffffffffull - (key & 0xffffffffull));
        --cnt[a[far]];
        a[far] = c;
        cnt[c] = 1;
        dist[far] = 0;
        cent[c] = codes[far];
        s_changed = 1;
      }
      __syncthreads();
    }
    const bool any = s_changed != 0;
    __syncthreads();
    return any;
  };

  // ---- centroid update: bit = strict majority of the members' bits ---------------
  auto update = [&]() {
    for (int64_t i = tid; i < Ce * 64; i += kThreads) ones[i] = 0;
    __syncthreads();
    for (int64_t l = tid; l < Lv; l += kThreads) {
      uint64_t x = codes[l];
      int* o = ones + a[l] * 64;
      while (x) {
        const int b = __ffsll(static_cast<long long>(x)) - 1;
        x &= x - 1;
        atomicAdd(&o[b], 1);
      }
    }
    __syncthreads();
    for (int64_t c = tid; c < Ce; c += kThreads) {
      uint64_t centroid = 0;
      for (int b = 0; b < 64; ++b)
        centroid |= static_cast<uint64_t>(2 * static_cast<int64_t>(ones[c * 64 + b]) > cnt[c]) << b;
      cent[c] = centroid;
    }
    __syncthreads();
  };

  assign();
  for (int64_t it = 0; it < p.iterations; ++it) {
    update();
    if (!assign()) break;
  }
  for (int64_t c = tid; c < Ce; c += kThreads) counts_out[c] = cnt[c];
}

}  // namespace

int64_t cluster_codes_cuda_workspace_bytes(int64_t N, int64_t H, int64_t L, int64_t C) {
  return N * H * per_head_bytes(L, C);
}

void cluster_codes_cuda(const ClusterCodesCudaArgs& a, cudaStream_t stream) {
  if (a.N * a.H == 0) return;
  if (a.N * a.H > 2147483647LL)
    throw std::runtime_error("fastattn CUDA kernel cluster_codes: too many (n, h) pairs");
  const int64_t state = cluster_state_bytes(a.C);
  const bool in_shared = state <= kMaxSharedBytes;
  FA_LAUNCH(dim3(static_cast<unsigned>(a.N * a.H)), dim3(kThreads),
            in_shared ? static_cast<size_t>(state) : 0, stream, cluster_codes_kernel)(a, in_shared);
  FA_CHECK_LAUNCH("cluster_codes");
}

}  // namespace fastattn::cuda
