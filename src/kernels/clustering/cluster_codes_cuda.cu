// CUDA kernels of Hamming K-means over hash codes (see clustering.h): the
// CPU kernel's algorithm step for step, so the assignments and counts are
// identical to cluster_codes_cpu's for every seed:
//  - the same splitmix64 stream per (n, h) (drawn by thread 0), the same
//    farthest-first seeding (the r-th tie in increasing query order),
//  - assignment to the nearest centroid by popcount(code ^ centroid), lowest
//    cluster index on ties; empty clusters re-seeded in increasing index
//    with the farthest query (lowest index on ties) among clusters with >= 2
//    members; centroid bit = strict majority of the members' bits; the same
//    stopping rule (stop after an assignment that changes nothing).
// Kernels, per (n, h) state in the workspace:
//   seed     one block per (n, h): farthest-first seeding
//            (inherently sequential in the C_eff centroids: per step one pass
//            over contiguous per-thread chunks of the queries, a block max,
//            a scan of the tie counts, the owner of the r-th tie picks it;
//            the chunks' codes and distances sit thread-major in the
//            workspace so each pass is coalesced and stays in L2);
//   assign   blocks of 256 threads over tiles of 1024 queries: nearest
//            centroid (centroids in shared memory), the per-tile member
//            counts and bit counts (shared atomics, rows padded to 65
//            counters against bank conflicts) stored per tile, no global
//            atomics, so every sum below is exact and order-free;
//   finalize one block per (n, h): the tiles' counts summed, empty clusters
//            re-seeded, counts written, convergence flagged, majority update.
// The single-block kernels run 256 threads below 1024 queries, 1024 from
// there. The launcher queues seed, then (assign, finalize) iterations + 1 times; a
// converged (n, h) skips the remaining launches via its done flag.
// Cost per (n, h): O(L·C_eff) popcounts for the seeding (one SM) and per
// assignment (spread over the SMs), O(L·64) shared atomics per update.
// Tested by tests/cuda_emu/test_clustering.cpp against cluster_codes_cpu.
#include "kernels/clustering/cluster_codes_cuda.h"

#include <climits>

#include "kernels/common/block_scan.cuh"
#include "kernels/common/cuda_compat.cuh"

namespace fastattn::cuda {
namespace {

// The single-block kernels (seed, finalize) run 1024 threads from
// kBigBlockFrom queries on, 256 below.
constexpr int64_t kBigBlockFrom = 1024;
constexpr int kAssignThreads = 256;
constexpr int64_t kTile = 1024;  // queries per assign block
constexpr int kOnesStride = 65;  // bit counters per cluster in shared memory (64 + padding)
constexpr int64_t kMaxSharedBytes = 48 * 1024;
constexpr int64_t kMaxSeedThreads = 1024;

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

__host__ __device__ inline int64_t align8(int64_t b) { return (b + 7) / 8 * 8; }
__host__ __device__ inline int64_t num_tiles(int64_t L) { return (L + kTile - 1) / kTile; }

// One (n, h)'s state in the workspace.
struct State {
  int* dist;       // (L): distance of each query to its centroid
  uint64_t* cent;  // (C): centroids
  int* cnt;        // (C): members per cluster
  int* ones;       // (C, 64): members with each bit set
  int* part_cnt;   // (tiles, C): the assign blocks' member counts
  int* part_ones;  // (tiles, C, 64): the assign blocks' bit counts
  int* flags;      // [changed, done]
  // Seeding, thread-major (thread t's i-th query at i·threads + t, so the
  // block's loads are coalesced): distance to the nearest centroid so far
  // (-1: chosen) and the query's code.
  int* seed_dist;        // (L + kMaxSeedThreads)
  uint64_t* seed_codes;  // (L + kMaxSeedThreads)
};

__host__ __device__ inline int64_t state_bytes(int64_t L, int64_t C) {
  const int64_t T = num_tiles(L);
  return align8(L * 4) + C * 8 + align8(C * 4) + C * 64 * 4 + align8(T * C * 4) + T * C * 64 * 4 +
         8 + (L + kMaxSeedThreads) * 8 + align8((L + kMaxSeedThreads) * 4);
}

__host__ __device__ inline State state_of(void* workspace, int64_t nh, int64_t L, int64_t C) {
  unsigned char* p = static_cast<unsigned char*>(workspace) + nh * state_bytes(L, C);
  const int64_t T = num_tiles(L);
  State s;
  s.dist = reinterpret_cast<int*>(p);
  p += align8(L * 4);
  s.cent = reinterpret_cast<uint64_t*>(p);
  p += C * 8;
  s.cnt = reinterpret_cast<int*>(p);
  p += align8(C * 4);
  s.ones = reinterpret_cast<int*>(p);
  p += C * 64 * 4;
  s.part_cnt = reinterpret_cast<int*>(p);
  p += align8(T * C * 4);
  s.part_ones = reinterpret_cast<int*>(p);
  p += T * C * 64 * 4;
  s.flags = reinterpret_cast<int*>(p);
  p += 8;
  s.seed_codes = reinterpret_cast<uint64_t*>(p);
  p += (L + kMaxSeedThreads) * 8;
  s.seed_dist = reinterpret_cast<int*>(p);
  return s;
}

__device__ inline void valid_sizes(const ClusterCodesCudaArgs& p, int64_t nh, int64_t* Lv,
                                   int64_t* Ce) {
  int64_t v = p.L;
  if (p.lengths) {
    v = p.lengths[nh / p.H];
    v = v < 0 ? 0 : (v > p.L ? p.L : v);
  }
  *Lv = v;
  *Ce = p.C < v ? p.C : v;
}

// Block-wide reductions over kWarps <= 32 warps (every thread gets the
// result): a warp step, one shared round read back by every warp, a second
// warp step. `red` holds kWarps entries; two barriers each, so calls may
// reuse `red`.
template <int kWarps>
__device__ int block_max_int(int x, int* red) {
  const int lane = threadIdx.x & 31;
  for (int o = 16; o > 0; o >>= 1) {
    const int y = __shfl_xor_sync(0xffffffffu, x, o);
    x = y > x ? y : x;
  }
  if (lane == 0) red[threadIdx.x >> 5] = x;
  __syncthreads();
  int r = lane < kWarps ? red[lane] : INT_MIN;
  for (int o = 16; o > 0; o >>= 1) {
    const int y = __shfl_xor_sync(0xffffffffu, r, o);
    r = y > r ? y : r;
  }
  __syncthreads();
  return r;
}

template <int kWarps>
__device__ unsigned long long block_max_u64(unsigned long long x, unsigned long long* red) {
  const int lane = threadIdx.x & 31;
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned long long y = __shfl_xor_sync(0xffffffffu, x, o);
    x = y > x ? y : x;
  }
  if (lane == 0) red[threadIdx.x >> 5] = x;
  __syncthreads();
  unsigned long long r = lane < kWarps ? red[lane] : 0ull;
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned long long y = __shfl_xor_sync(0xffffffffu, r, o);
    r = y > r ? y : r;
  }
  __syncthreads();
  return r;
}

// ---- seeding ------------------------------------------------------------------------

template <int kSeedThreads>
__global__ void __launch_bounds__(kSeedThreads) seed_kernel(ClusterCodesCudaArgs p) {
  constexpr int kWarps = kSeedThreads / 32;
  __shared__ int red[kWarps];
  __shared__ int s_pick, s_r;
  const int64_t nh = blockIdx.x, L = p.L, C = p.C;
  const int tid = threadIdx.x;
  int64_t Lv, Ce;
  valid_sizes(p, nh, &Lv, &Ce);
  const State st = state_of(p.workspace, nh, L, C);
  const uint64_t* codes = reinterpret_cast<const uint64_t*>(p.codes + nh * L);
  int64_t* a = p.assignments + nh * L;
  for (int64_t l = tid; l < L; l += kSeedThreads) a[l] = -1;
  for (int64_t c = tid; c < C; c += kSeedThreads) p.counts[nh * C + c] = 0;
  if (tid == 0) {
    st.flags[0] = 0;
    st.flags[1] = Ce == 0;  // nothing to cluster: done
  }
  if (Ce == 0) return;  // uniform

  // Thread t owns the contiguous queries [q0, q0 + n) (the ties are picked in
  // query order: a scan over the threads' tie counts finds the r-th), held
  // thread-major in the workspace: its i-th at i·kSeedThreads + t.
  SplitMix64 rng{p.seed ^ (0xD1B54A32D192ED03ull * static_cast<uint64_t>(nh + 1))};  // thread 0's
  const int64_t chunk = (Lv + kSeedThreads - 1) / kSeedThreads;
  const int64_t q0 = tid * chunk < Lv ? tid * chunk : Lv;
  const int64_t n = (q0 + chunk < Lv ? q0 + chunk : Lv) - q0;
  int* dist = st.seed_dist;
  uint64_t* mine = st.seed_codes;
  for (int64_t l = tid; l < Lv; l += kSeedThreads) {  // coalesced reads, scattered writes
    const int64_t at = (l % chunk) * kSeedThreads + l / chunk;
    mine[at] = codes[l];
    dist[at] = INT_MAX;
  }
  if (tid == 0) s_pick = static_cast<int>(rng.below(static_cast<uint64_t>(Lv)));
  __syncthreads();
  for (int64_t j = 0; j < Ce; ++j) {
    const int64_t pick = s_pick;
    const uint64_t centroid = codes[pick];
    if (tid == 0) st.cent[j] = centroid;
    if (j + 1 == Ce) break;  // uniform
    // Distances to the nearest centroid so far (-1: chosen), this thread's
    // largest and how many of its queries have it.
    int local = -1, local_n = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t at = i * kSeedThreads + tid;
      const int old = dist[at];
      const int h = __popcll(mine[at] ^ centroid);
      const int d = q0 + i == pick ? -1 : (h < old ? h : old);
      if (d != old) dist[at] = d;
      if (d > local) {
        local = d;
        local_n = 1;
      } else if (d == local) {
        ++local_n;
      }
    }
    const int best = block_max_int<kWarps>(local, red);
    const int own = local == best ? local_n : 0;
    int ties = 0;
    const int before = block_exclusive_scan<kWarps>(own, red, &ties);
    if (tid == 0) s_r = static_cast<int>(rng.below(static_cast<uint64_t>(ties)));
    __syncthreads();
    const int r = s_r;  // s_r is rewritten only after two more barriers
    if (r >= before && r < before + own) {
      int left = r - before;
      for (int64_t i = 0; i < n; ++i) {
        if (dist[i * kSeedThreads + tid] != best) continue;
        if (left-- == 0) {
          s_pick = static_cast<int>(q0 + i);
          break;
        }
      }
    }
    __syncthreads();
  }
}

// ---- assignment ---------------------------------------------------------------------

// Tile blockIdx.x of (n, h) blockIdx.y: nearest centroids, changed flag, the
// tile's member and bit counts. kShared: centroids and counters in shared
// memory (C·(8 + 4 + 4·65) bytes), else the counters go straight to the
// tile's rows in the workspace (global atomics within the block).
template <bool kShared>
__global__ void __launch_bounds__(kAssignThreads) assign_kernel(ClusterCodesCudaArgs p) {
  FA_DYNAMIC_SHARED(unsigned char, smem);
  const int64_t tile = blockIdx.x, nh = blockIdx.y, L = p.L, C = p.C;
  const int tid = threadIdx.x;
  const State st = state_of(p.workspace, nh, L, C);
  if (st.flags[1]) return;  // converged (uniform)
  int64_t Lv, Ce;
  valid_sizes(p, nh, &Lv, &Ce);
  const int64_t l0 = tile * kTile, l1 = l0 + kTile < Lv ? l0 + kTile : Lv;
  int* part_cnt = st.part_cnt + tile * C;
  int* part_ones = st.part_ones + tile * C * 64;
  const uint64_t* cent = st.cent;
  int* cnt = part_cnt;
  int* ones = part_ones;
  int ones_stride = 64;
  if (kShared) {
    uint64_t* cs = reinterpret_cast<uint64_t*>(smem);
    cnt = reinterpret_cast<int*>(smem + C * 8);
    ones = cnt + C;
    ones_stride = kOnesStride;
    for (int64_t c = tid; c < Ce; c += kAssignThreads) cs[c] = st.cent[c];
    cent = cs;
  }
  for (int64_t c = tid; c < C; c += kAssignThreads) cnt[c] = 0;
  for (int64_t i = tid; i < C * ones_stride; i += kAssignThreads) ones[i] = 0;
  __syncthreads();
  const uint64_t* codes = reinterpret_cast<const uint64_t*>(p.codes + nh * L);
  int64_t* a = p.assignments + nh * L;
  bool changed = false;
  for (int64_t l = l0 + tid; l < l1; l += kAssignThreads) {
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
    st.dist[l] = best;
    atomicAdd(&cnt[best_c], 1);
    int* o = ones + best_c * ones_stride;
    for (uint64_t y = x; y; y &= y - 1) atomicAdd(&o[__ffsll(static_cast<long long>(y)) - 1], 1);
  }
  if (__any_sync(0xffffffffu, changed) && (tid & 31) == 0) st.flags[0] = 1;
  if (kShared) {
    __syncthreads();
    for (int64_t c = tid; c < C; c += kAssignThreads) part_cnt[c] = cnt[c];
    for (int64_t i = tid; i < C * 64; i += kAssignThreads)
      part_ones[i] = ones[(i / 64) * kOnesStride + i % 64];
  }
}

// ---- finalisation: re-seeding, counts, convergence, centroid update ---------------

// x[0] + x[stride] + ... (n terms), eight loads in flight at a time.
__device__ __forceinline__ int sum_tiles(const int* x, int64_t stride, int64_t n) {
  int s = 0;
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    int v[8];
    for (int u = 0; u < 8; ++u) v[u] = x[(t + u) * stride];
    for (int u = 0; u < 8; ++u) s += v[u];
  }
  for (; t < n; ++t) s += x[t * stride];
  return s;
}

// remaining: assignments still queued after this one; check: stop when the
// assignment changed nothing (not after the first, as in the CPU kernel).
template <int kFinalThreads>
__global__ void __launch_bounds__(kFinalThreads)
    finalize_kernel(ClusterCodesCudaArgs p, int64_t remaining, bool check) {
  constexpr int kWarps = kFinalThreads / 32;
  __shared__ unsigned long long red[kWarps];
  __shared__ int s_changed;
  const int64_t nh = blockIdx.x, L = p.L, C = p.C;
  const int tid = threadIdx.x;
  const State st = state_of(p.workspace, nh, L, C);
  if (st.flags[1]) return;  // converged (uniform)
  int64_t Lv, Ce;
  valid_sizes(p, nh, &Lv, &Ce);
  const int64_t Tv = (Lv + kTile - 1) / kTile;  // tiles holding valid queries
  for (int64_t c = tid; c < Ce; c += kFinalThreads) st.cnt[c] = sum_tiles(st.part_cnt + c, C, Tv);
  for (int64_t i = tid; i < Ce * 64; i += kFinalThreads)
    st.ones[i] = sum_tiles(st.part_ones + i, C * 64, Tv);
  if (tid == 0) s_changed = st.flags[0];
  __syncthreads();
  const uint64_t* codes = reinterpret_cast<const uint64_t*>(p.codes + nh * L);
  int64_t* a = p.assignments + nh * L;
  for (int64_t c = 0; c < Ce; ++c) {
    if (st.cnt[c] > 0) continue;  // uniform: read after a barrier
    unsigned long long key = 0;
    for (int64_t l = tid; l < Lv; l += kFinalThreads) {
      if (st.cnt[a[l]] < 2) continue;
      const unsigned long long k = (static_cast<unsigned long long>(st.dist[l] + 1) << 32) |
                                   (0xffffffffull - static_cast<unsigned long long>(l));
      key = k > key ? k : key;
    }
    key = block_max_u64<kWarps>(key, red);
    if (tid == 0) {
      const int64_t far = static_cast<int64_t>(0xffffffffull - (key & 0xffffffffull));
      const int64_t old = a[far];
      const uint64_t x = codes[far];
      --st.cnt[old];
      a[far] = c;
      st.cnt[c] = 1;
      st.dist[far] = 0;
      for (int b = 0; b < 64; ++b) {
        const int bit = static_cast<int>((x >> b) & 1u);
        st.ones[old * 64 + b] -= bit;
        st.ones[c * 64 + b] = bit;
      }
      s_changed = 1;
    }
    __syncthreads();
  }
  for (int64_t c = tid; c < Ce; c += kFinalThreads) p.counts[nh * C + c] = st.cnt[c];
  const bool changed = s_changed != 0;
  if (tid == 0) {
    st.flags[0] = 0;
    if ((check && !changed) || remaining == 0) st.flags[1] = 1;
  }
  if ((check && !changed) || remaining == 0) return;  // uniform
  // Thread i: bit i % 64 of centroid i / 64; a warp's ballot is one half of
  // a centroid (Ce·64 and the block are multiples of 32: whole warps).
  unsigned* halves = reinterpret_cast<unsigned*>(st.cent);  // little-endian halves
  for (int64_t i = tid; i < Ce * 64; i += kFinalThreads) {
    const unsigned bits =
        __ballot_sync(0xffffffffu, 2 * static_cast<int64_t>(st.ones[i]) > st.cnt[i / 64]);
    if ((tid & 31) == 0) halves[i / 32] = bits;
  }
}

template <int kBlock>
void launch_all(const ClusterCodesCudaArgs& a, cudaStream_t stream) {
  const int64_t NH = a.N * a.H;
  FA_LAUNCH(dim3(static_cast<unsigned>(NH)), dim3(kBlock), 0, stream, seed_kernel<kBlock>)(a);
  FA_CHECK_LAUNCH("cluster_codes seeding");
  if (a.L == 0) return;  // no queries: the seeding wrote -1s and zero counts
  const int64_t shared = a.C * (8 + 4 + 4 * kOnesStride);
  const bool in_shared = shared <= kMaxSharedBytes;
  const dim3 assign_grid(static_cast<unsigned>(num_tiles(a.L)), static_cast<unsigned>(NH));
  for (int64_t it = 0; it <= a.iterations; ++it) {
    if (in_shared) {
      FA_LAUNCH(assign_grid, dim3(kAssignThreads), static_cast<size_t>(shared), stream,
                assign_kernel<true>)
      (a);
    } else {
      FA_LAUNCH(assign_grid, dim3(kAssignThreads), 0, stream, assign_kernel<false>)(a);
    }
    FA_CHECK_LAUNCH("cluster_codes assignment");
    FA_LAUNCH(dim3(static_cast<unsigned>(NH)), dim3(kBlock), 0, stream, finalize_kernel<kBlock>)
    (a, a.iterations - it, it > 0);
    FA_CHECK_LAUNCH("cluster_codes update");
  }
}

}  // namespace

int64_t cluster_codes_cuda_workspace_bytes(int64_t N, int64_t H, int64_t L, int64_t C) {
  return N * H * state_bytes(L, C);
}

void cluster_codes_cuda(const ClusterCodesCudaArgs& a, cudaStream_t stream) {
  const int64_t NH = a.N * a.H;
  if (NH == 0 || a.C == 0) return;
  if (NH > 65535) throw std::runtime_error("fastattn CUDA kernel cluster_codes: N·H above 65535");
  if (a.L >= kBigBlockFrom) {
    launch_all<1024>(a, stream);
  } else {
    launch_all<256>(a, stream);
  }
}

}  // namespace fastattn::cuda
