// CUDA kernel of the stable top-k column selection (see stable_topk_cuda.h).
// One block of 256 threads per row:
//   1. radix select of the k-th largest score t over order-preserving 32-bit
//      keys (-0 taken as +0, so equal floats have equal keys), four passes of
//      8 bits with per-warp shared histograms and a scan over the bins; it
//      also gives need, how many columns equal to t belong to the top k (k
//      minus those above t);
//   2. one pass over the row in column order (4 consecutive columns per
//      thread) keeping every column above t and the first `need` equal to t,
//      compacted by block-wide scans, until k are kept.
// Rows up to 24k columns are read once, as keys into shared memory (96 KiB),
// longer ones five times from global memory; no workspace. NaN keys order
// above +inf.
// Tested by tests/cuda_emu/test_stable_topk.cpp against a stable sort.
#include "kernels/clustered_topk/stable_topk_cuda.h"

#include "kernels/common/block_scan.cuh"
#include "kernels/common/cuda_compat.cuh"

namespace fastattn::cuda {
namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32, kBins = 256;
constexpr int kPer = 4;  // consecutive columns per thread in the compaction
static_assert(kThreads == kBins, "a thread per bin");
// Rows up to this many columns are read once into shared memory as keys
// (96 KiB: two blocks per SM), longer ones from global memory at each pass.
constexpr int64_t kMaxStaged = 24 * 1024;

// Larger float -> larger key; -0 and +0 share one.
__device__ __forceinline__ unsigned order_key(float x) {
  const unsigned u = __float_as_uint(x == 0.f ? 0.f : x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__global__ void __launch_bounds__(kThreads)
    stable_topk_select_kernel(StableTopkCudaArgs a, bool staged) {
  FA_DYNAMIC_SHARED(unsigned, staged_keys);  // staged: the row's S keys
  __shared__ int warp_hist[kWarps][kBins];   // one histogram per warp: fewer colliding atomics
  __shared__ int red[kWarps];
  __shared__ unsigned s_prefix;
  __shared__ long long s_rank;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int64_t S = a.S, k = a.k;
  const float* row = a.scores + static_cast<int64_t>(blockIdx.x) * S;
  int64_t* out = a.out + static_cast<int64_t>(blockIdx.x) * k;
  if (staged) {
    for (int64_t j = tid; j < S; j += kThreads) staged_keys[j] = order_key(row[j]);
    __syncthreads();
  }
  auto key_at = [&](int64_t j) { return staged ? staged_keys[j] : order_key(row[j]); };

  // 1. The key of the k-th largest: digit by digit from the top, `rank` the
  // rank still sought among the keys that share the prefix found so far.
  // Scores share their leading bits (sign, exponent), so a warp's lanes often
  // fall in one bin: the lanes in lane 0's bin are counted by one atomic.
  unsigned prefix = 0, mask = 0;
  int64_t rank = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = lane; b < kBins; b += 32) warp_hist[warp][b] = 0;
    __syncwarp();
    for (int64_t j0 = 0; j0 < S; j0 += kThreads) {  // whole warps in every iteration
      const int64_t j = j0 + tid;
      const unsigned u = j < S ? key_at(j) : 0u;
      const bool in = j < S && (u & mask) == prefix;
      const unsigned bin = (u >> shift) & 0xffu;
      const unsigned lead = __shfl_sync(0xffffffffu, bin, 0);
      const unsigned same = __ballot_sync(0xffffffffu, in && bin == lead);
      if (lane == 0 && same != 0u) atomicAdd(&warp_hist[warp][lead], __popc(same));
      if (in && bin != lead) atomicAdd(&warp_hist[warp][bin], 1);
    }
    __syncthreads();
    // Thread t takes bin 255 - t: its count, and by a scan the count of the
    // bins above it; the bin holding the rank-th largest key is the one
    // where that rank falls.
    const int b = kBins - 1 - tid;
    int count = 0, total = 0;
    for (int w = 0; w < kWarps; ++w) count += warp_hist[w][b];
    const int above = block_exclusive_scan<kWarps>(count, red, &total);
    if (above < rank && rank <= above + count) {
      s_prefix = prefix | (static_cast<unsigned>(b) << shift);
      s_rank = rank - above;
    }
    __syncthreads();
    prefix = s_prefix;  // rewritten only after three more barriers
    rank = s_rank;
    mask |= 0xffu << shift;
  }
  const int64_t need = rank;  // columns with key == prefix to keep, lowest first

  // 2. Ordered compaction, kPer consecutive columns per thread.
  int64_t kept = 0, equal_seen = 0;
  for (int64_t j0 = 0; j0 < S && kept < k; j0 += kThreads * kPer) {
    const int64_t jt = j0 + static_cast<int64_t>(tid) * kPer;
    unsigned key[kPer];
    int n_equal = 0;
    for (int e = 0; e < kPer; ++e) {
      key[e] = jt + e < S ? key_at(jt + e) : 0u;
      n_equal += jt + e < S && key[e] == prefix;
    }
    int equal_total = 0, kept_total = 0;
    int64_t equal_before = equal_seen + block_exclusive_scan<kWarps>(n_equal, red, &equal_total);
    bool keep[kPer];
    int n_keep = 0;
    for (int e = 0; e < kPer; ++e) {
      const bool valid = jt + e < S, equal = valid && key[e] == prefix;
      keep[e] = (valid && key[e] > prefix) || (equal && equal_before < need);
      equal_before += equal;
      n_keep += keep[e];
    }
    int64_t at = kept + block_exclusive_scan<kWarps>(n_keep, red, &kept_total);
    for (int e = 0; e < kPer; ++e)
      if (keep[e]) out[at++] = jt + e;
    kept += kept_total;
    equal_seen += equal_total;
  }
}

}  // namespace

void stable_topk_select_cuda(const StableTopkCudaArgs& a, cudaStream_t stream) {
  if (a.rows == 0 || a.k == 0) return;
  if (a.rows > 2147483647LL)
    throw std::runtime_error("fastattn CUDA kernel stable_topk_select: too many rows");
  const bool staged = a.S <= kMaxStaged;
  const size_t bytes = staged ? static_cast<size_t>(a.S) * sizeof(unsigned) : 0;
  if (bytes > 48 * 1024) FA_SET_MAX_DYNAMIC_SHARED(bytes, stable_topk_select_kernel);
  FA_LAUNCH(dim3(static_cast<unsigned>(a.rows)), dim3(kThreads), bytes, stream,
            stable_topk_select_kernel)
  (a, staged);
  FA_CHECK_LAUNCH("stable_topk_select");
}

}  // namespace fastattn::cuda
