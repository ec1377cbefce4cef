// CUDA kernels of Reformer LSH attention (Kitaev et al. 2020), the GPU side
// of src/kernels/reformer/reformer_cpu.cpp with the same semantics (see
// reformer.h): float32, float16 and bfloat16 storage, float32 arithmetic,
// the running statistics of the round merge in float64 as on the CPU.
// This header holds what the two kernel files share: the configuration, the
// shared-memory layouts, the device helpers and the host-side checks.
//
//  - lsh_hash (reformer_forward_cuda.cu): one block per (16 rows of x, n·h,
//    round); a warp takes 4 rows, each lane a column b of R_r (coalesced
//    reads of the (E, B2) rotation), keeps the first maximum and the first
//    minimum of its columns, and a warp reduction with the CPU's tie rule
//    (lowest index among equal values) picks argmax over [p ; -p] as
//    `p[imax] >= -p[imin] ? imax : B2 + imin`. Cost O(N·H·R·L·E·B2).
//  - forward (reformer_forward_cuda.cu): the per-round sort (stable, by
//    (bucket, position), padding excluded) is done by the op layer on the GPU
//    with ATen and comes in as `perm`. One launch per round; one block of 128
//    threads per (16-query tile of a chunk, chunk, n·h). The block walks the
//    chunk's window (chunks c-1 and c of the sorted order) in tiles of 32
//    keys: keys gathered by the permutation and L2-normalised in shared
//    memory, a lane per key for the scores (scale, causal, self -> -1e5), an
//    online softmax per query row (a warp per row), then the unnormalised
//    P·V into a shared accumulator. At the end every query row merges its
//    round (row max m_r, sum l_r, unnormalised output) into the running
//    float64 stats and float32 workspace exactly as the CPU kernel does; a
//    last kernel divides by the sum and turns it into its log. Cost per round
//    O(N·H·L·2·chunk·(E + M)).
//  - backward (reformer_backward_cuda.cu): one launch over (query tile, chunk,
//    n·h, round): P recomputed from the final stats, dP = dO·V^T,
//    dS = P ∘ (dP - delta)·scale (0 at the replaced self score); dQ (shared
//    accumulator), dK and dV go into float32 workspaces by atomicAdd (a key
//    row is in two chunk windows and a query in one chunk per round: the
//    CPU's even/odd passes are not needed). A last kernel adds dK through the
//    normalisation, dq += (dk - k (k·dk)) / |q| (dk / eps where the norm is
//    clamped), and converts to the storage type.
// float16/bfloat16: the same blocks with the matrix products on tensor cores
// (fa_wmma 16x16x16, float accumulation): S = Q·K^T and P·V forward; S,
// dP = dO·V^T, dQ += dS·K, dK = dS^T·Q and dV = P^T·dO backward. The
// normalised keys, P and dS are rounded to the storage type for the
// products; the softmax statistics stay float. float32: SIMT float
// (register-blocked dot products, keys per lane). E, M <=
// kReformerCudaMaxHeadDim (shared-memory tiles, laid out by
// kernels/common/smem_layout.cuh: ~120 KB for the float32 backward and
// ~138 KB for the tensor-core backward at 256).
//
// Tested under the emulator by tests/cuda_emu/test_reformer.cpp against the
// CPU kernels in float64; on a GPU by tests/cuda/test_cuda_reformer.cpp.
#pragma once

#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/common/cuda_compat.cuh"
#include "kernels/common/smem_layout.cuh"
#include "kernels/reformer/reformer_cuda.h"

namespace fastattn::cuda {

// The kernels' shared argument structs and host helpers.
using namespace fastattn::kernels;

namespace {

using fastattn::cuda::ceil_div;
using fastattn::cuda::from_float;
using fastattn::cuda::to_float;
using fastattn::cuda::warp_max;
using fastattn::cuda::warp_sum;

constexpr int kThreads = 128;  // 4 warps
constexpr int kWarps = kThreads / 32;
constexpr int kBQ = 16;  // query rows per block (4 per warp)
constexpr int kRowsPerWarp = kBQ / kWarps;
constexpr int kBK = 32;  // keys per tile (one per lane)
constexpr float kNormEps = 1e-12f;
constexpr float kSelfScore = -1e5f;  // kReformerSelfScore
constexpr int kMaxPerLane = static_cast<int>(kReformerCudaMaxHeadDim / 32);

__host__ __device__ __forceinline__ int round16(int64_t x) {
  return static_cast<int>((x + 15) / 16 * 16);
}

// ---- element-wise kernels and host helpers -----------------------------------

// p[0, n) = value (grid-stride).
template <typename U>
__global__ void fill_kernel(U* p, int64_t n, U value) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p[i] = value;
}

// Blocks of kThreads for a grid-stride loop over n elements.
inline int grid_for(int64_t n) {
  const int64_t b = ceil_div(n, kThreads);
  return static_cast<int>(b < 1 ? 1 : (b > 65536 ? 65536 : b));
}

// Dynamic shared memory above the default 48 KiB must be allowed per kernel.
template <typename Kernel>
void allow_dynamic_shared(size_t bytes, Kernel* kernel) {
  if (bytes > 48 * 1024) FA_SET_MAX_DYNAMIC_SHARED(bytes, kernel);
}

inline void check_head_dims(const ReformerCudaParams& a, const char* what) {
  if (a.E < 1 || a.E > kReformerCudaMaxHeadDim || a.M < 0 || a.M > kReformerCudaMaxHeadDim)
    throw std::runtime_error(
        std::string("fastattn CUDA kernel ") + what +
        ": head dimensions must be 1 <= E <= " + std::to_string(kReformerCudaMaxHeadDim) +
        " and 0 <= M <= " + std::to_string(kReformerCudaMaxHeadDim) +
        ", got E = " + std::to_string(a.E) + ", M = " + std::to_string(a.M));
  if (a.chunk < 1)
    throw std::runtime_error(std::string("fastattn CUDA kernel ") + what +
                             ": chunk must be >= 1, got " + std::to_string(a.chunk));
}

// The attention launches' grid: one block per (query tile, chunk, n·h) of a
// round, times `rounds` (1: one launch per round).
struct AttentionGrid {
  int64_t chunks, qtiles;
  dim3 blocks;
  AttentionGrid(const ReformerCudaParams& a, int64_t rounds)
      : chunks(ceil_div(a.L, a.chunk)),
        qtiles(ceil_div(a.chunk < a.L ? a.chunk : a.L, kBQ)),
        blocks(static_cast<unsigned>(qtiles * chunks * a.N * a.H * rounds)) {}
};

// ---- shared-memory layouts (kernels/common/smem_layout.cuh) ------------------
// Constructed from a carver with the head dimensions a.E and a.M: the
// launcher's size (smem_bytes<Layout>(a.E, a.M)) and the kernel's pointers
// (carve_smem<Layout>(a.E, a.M)).

// The positions of the block's query tile and of the current key tile.
struct TilePositions {
  int64_t* qpos;  // (kBQ) query positions, -1 past the chunk
  int64_t* kpos;  // (kBK) key positions, -1 past the window
  template <typename Carver>
  __host__ __device__ explicit TilePositions(Carver& c)
      : qpos(c.template take<int64_t>(kBQ)), kpos(c.template take<int64_t>(kBK)) {}
};

// SIMT kernels (float32; bfloat16 without tensor cores): float tiles.
struct SimtTiles : TilePositions {
  float* sq;  // (kBQ, E) queries
  float* sk;  // (kBK, E + 1) normalised keys
  float* sv;  // (kBK, M + 1) values
  float* sp;  // (kBQ, kBK) probabilities
  template <typename Carver>
  __host__ __device__ SimtTiles(Carver& c, int64_t E, int64_t M)
      : TilePositions(c),
        sq(c.template take<float>(kBQ * E)),
        sk(c.template take<float>(kBK * (E + 1))),
        sv(c.template take<float>(kBK * (M + 1))),
        sp(c.template take<float>(kBQ * kBK)) {}
};

// forward_round_kernel.
struct SimtForwardSmem : SimtTiles {
  float* salpha;  // (kBQ) rescale factors of the earlier tiles
  float* sacc;    // (kBQ, M) unnormalised output
  template <typename Carver>
  __host__ __device__ SimtForwardSmem(Carver& c, int64_t E, int64_t M)
      : SimtTiles(c, E, M),
        salpha(c.template take<float>(kBQ)),
        sacc(c.template take<float>(kBQ * M)) {}
};

// backward_kernel.
struct SimtBackwardSmem : SimtTiles {
  float* sdelta;  // (kBQ)
  float* sdo;     // (kBQ, M) output gradient rows
  float* sds;     // (kBQ, kBK) dS
  float* sdq;     // (kBQ, E) dQ accumulator
  float* shi;     // (kBQ) final stats: max
  float* slo;     // (kBQ) final stats: log sum
  template <typename Carver>
  __host__ __device__ SimtBackwardSmem(Carver& c, int64_t E, int64_t M)
      : SimtTiles(c, E, M),
        sdelta(c.template take<float>(kBQ)),
        sdo(c.template take<float>(kBQ * M)),
        sds(c.template take<float>(kBQ * kBK)),
        sdq(c.template take<float>(kBQ * E)),
        shi(c.template take<float>(kBQ)),
        slo(c.template take<float>(kBQ)) {}
};

// forward_round_wmma_kernel: T tiles padded to Ep = round16(E), Mp = round16(M).
template <typename T>
struct WmmaForwardSmem : TilePositions {
  T* sqh;         // (kBQ, Ep) queries
  T* skh;         // (kBK, Ep) normalised keys
  T* svh;         // (kBK, Mp) values
  T* sph;         // (kBQ, kBK) probabilities
  float* ss;      // (kBQ, kBK) scores
  float* spv;     // (kBQ, Mp) P·V of the tile
  float* sacc;    // (kBQ, Mp) unnormalised output
  float* salpha;  // (kBQ) rescale factors of the earlier tiles
  template <typename Carver>
  __host__ __device__ WmmaForwardSmem(Carver& c, int64_t E, int64_t M)
      : TilePositions(c),
        sqh(c.template take<T>(kBQ * round16(E))),
        skh(c.template take<T>(kBK * round16(E))),
        svh(c.template take<T>(kBK * round16(M))),
        sph(c.template take<T>(kBQ * kBK)),
        ss(c.template take<float>(kBQ * kBK)),
        spv(c.template take<float>(kBQ * round16(M))),
        sacc(c.template take<float>(kBQ * round16(M))),
        salpha(c.template take<float>(kBQ)) {}
};

// backward_wmma_kernel: T tiles padded to Ep = round16(E), Mp = round16(M).
template <typename T>
struct WmmaBackwardSmem : TilePositions {
  T* sqh;         // (kBQ, Ep) queries
  T* sdoh;        // (kBQ, Mp) output gradient rows
  T* skh;         // (kBK, Ep) normalised keys
  T* svh;         // (kBK, Mp) values
  T* sph;         // (kBQ, kBK) P
  T* sdsh;        // (kBQ, kBK) dS
  float* ss;      // (kBQ, kBK) scores
  float* sdp;     // (kBQ, kBK) dP
  float* sdq;     // (kBQ, Ep) dQ accumulator
  float* sdk;     // (kBK, Ep) dK of the tile
  float* sdv;     // (kBK, Mp) dV of the tile
  float* shi;     // (kBQ) final stats: max
  float* slo;     // (kBQ) final stats: log sum
  float* sdelta;  // (kBQ)
  template <typename Carver>
  __host__ __device__ WmmaBackwardSmem(Carver& c, int64_t E, int64_t M)
      : TilePositions(c),
        sqh(c.template take<T>(kBQ * round16(E))),
        sdoh(c.template take<T>(kBQ * round16(M))),
        skh(c.template take<T>(kBK * round16(E))),
        svh(c.template take<T>(kBK * round16(M))),
        sph(c.template take<T>(kBQ * kBK)),
        sdsh(c.template take<T>(kBQ * kBK)),
        ss(c.template take<float>(kBQ * kBK)),
        sdp(c.template take<float>(kBQ * kBK)),
        sdq(c.template take<float>(kBQ * round16(E))),
        sdk(c.template take<float>(kBK * round16(E))),
        sdv(c.template take<float>(kBK * round16(M))),
        shi(c.template take<float>(kBQ)),
        slo(c.template take<float>(kBQ)),
        sdelta(c.template take<float>(kBQ)) {}
};

// ---- the block's work --------------------------------------------------------

__device__ __forceinline__ int64_t valid_length(const ReformerCudaParams& a, int64_t nh) {
  return a.lengths ? a.lengths[nh / a.H] : a.L;
}

// The window of chunk c: queries at sorted positions [t0, t0 + rows), keys at
// [k0, k0 + cols).
struct Window {
  int64_t t0, rows, k0, cols;
};
__device__ __forceinline__ Window window(int64_t c, int64_t chunk, int64_t len) {
  Window w;
  w.t0 = c * chunk;
  w.rows = chunk < len - w.t0 ? chunk : len - w.t0;
  w.k0 = c > 0 ? w.t0 - chunk : 0;
  w.cols = w.t0 + w.rows - w.k0;
  return w;
}

// The block's query tile: blockIdx.x = ((r·N·H + nh)·chunks + c)·qtiles + qt
// (r = 0 in a launch of one round, given as `round`; round < 0: r from
// blockIdx.x).
struct QueryTile {
  int64_t nh, r;
  int64_t qt0;          // first query row of the tile within the chunk
  Window w;             // of its chunk
  const int64_t* perm;  // the round's sorted positions of head nh
  __device__ __forceinline__ QueryTile(const ReformerCudaParams& a, int64_t chunks, int64_t qtiles,
                                       int64_t round) {
    int64_t item = blockIdx.x;
    const int64_t qt = item % qtiles;
    item /= qtiles;
    const int64_t c = item % chunks;
    item /= chunks;
    if (round < 0) {
      nh = item % (a.N * a.H);
      r = item / (a.N * a.H);
    } else {
      nh = item;
      r = round;
    }
    qt0 = qt * kBQ;
    // Past the valid length (c·chunk >= len) rows <= 0: the tile is empty too.
    w = window(c, a.chunk, valid_length(a, nh));
    perm = a.perm + (nh * a.R + r) * a.L;
  }
  // No query of the tile (the whole block returns).
  __device__ __forceinline__ bool empty() const { return qt0 >= w.rows; }
  // Position of query row i of the tile, -1 past the chunk.
  __device__ __forceinline__ int64_t query_pos(int i) const {
    return qt0 + i < w.rows ? perm[w.t0 + qt0 + i] : -1;
  }
  // Position of key j of the key tile at kt, -1 past the window.
  __device__ __forceinline__ int64_t key_pos(int64_t kt, int j) const {
    return kt + j < w.cols ? perm[w.k0 + kt + j] : -1;
  }
};

// The queries (and keys) and values of head nh.
template <typename T>
struct HeadInputs {
  const T* q;  // (L, E)
  const T* v;  // (L, M)
  __device__ __forceinline__ HeadInputs(const ReformerCudaParams& a, int64_t nh)
      : q(static_cast<const T*>(a.q) + nh * a.L * a.E),
        v(static_cast<const T*>(a.v) + nh * a.L * a.M) {}
};

// ---- SIMT tiles --------------------------------------------------------------

// Loads keys [kt, kt + kBK) of the window: positions into kpos (-1 past the
// window), the L2-normalised key rows into sk (stride E + 1, zeros past the
// window) and the value rows into sv (stride M + 1). Ends with a barrier.
template <typename T>
__device__ void load_key_tile(const ReformerCudaParams& a, const HeadInputs<T>& in,
                              const QueryTile& t, int64_t kt, int64_t* kpos, float* sk, float* sv) {
  const int E = static_cast<int>(a.E), M = static_cast<int>(a.M);
  const int tid = threadIdx.x;
  if (tid < kBK) kpos[tid] = t.key_pos(kt, tid);
  __syncthreads();
  for (int idx = tid; idx < kBK * E; idx += kThreads) {
    const int j = idx / E, e = idx % E;
    const int64_t p = kpos[j];
    sk[j * (E + 1) + e] = p >= 0 ? to_float(in.q[p * E + e]) : 0.f;
  }
  for (int idx = tid; idx < kBK * M; idx += kThreads) {
    const int j = idx / M, d = idx % M;
    const int64_t p = kpos[j];
    sv[j * (M + 1) + d] = p >= 0 ? to_float(in.v[p * M + d]) : 0.f;
  }
  __syncthreads();
  const int warp = tid / 32, lane = tid % 32;
  for (int j = warp; j < kBK; j += kWarps) {
    float* row = sk + j * (E + 1);
    float ss = 0.f;
    for (int e = lane; e < E; e += 32) ss += row[e] * row[e];
    ss = warp_sum(ss);
    const float inv = 1.f / fmaxf(sqrtf(ss), kNormEps);
    for (int e = lane; e < E; e += 32) row[e] *= inv;
  }
  __syncthreads();
}

// Loads query rows [qt0, qt0 + kBQ) of the chunk (rows past the chunk: -1
// and zeros) and D values per row of x into sx (stride D). No barrier.
template <typename T>
__device__ void load_query_rows(const T* x, int D, const int64_t* qpos, float* sx) {
  for (int idx = threadIdx.x; idx < kBQ * D; idx += kThreads) {
    const int i = idx / D, d = idx % D;
    const int64_t p = qpos[i];
    sx[idx] = p >= 0 ? to_float(x[p * D + d]) : 0.f;
  }
}

// d[k] = dot(x + (row0 + k)·ldx, y + lane·ldy) over n, for the warp's rows
// k < kRowsPerWarp (x rows broadcast, y: one row per lane).
__device__ __forceinline__ void warp_row_dots(const float* x, int ldx, const float* y, int ldy,
                                              int n, float (&d)[kRowsPerWarp]) {
  const int row0 = (threadIdx.x / 32) * kRowsPerWarp;
  const float* yl = y + (threadIdx.x % 32) * ldy;
  for (int k = 0; k < kRowsPerWarp; ++k) d[k] = 0.f;
  for (int e = 0; e < n; ++e) {
    const float w = yl[e];
    for (int k = 0; k < kRowsPerWarp; ++k) d[k] += x[(row0 + k) * ldx + e] * w;
  }
}

// acc + sum over j < n of x[j·ldx]·y[j·ldy], in order.
template <int n>
__device__ __forceinline__ float strided_dot(float acc, const float* x, int ldx, const float* y,
                                             int ldy) {
  for (int j = 0; j < n; ++j) acc += x[j * ldx] * y[j * ldy];
  return acc;
}

// The scaled and masked score from a dot product of query position qp and key
// position kp: -inf past the window or (causal) for a later key; the self
// score replaced by -1e5 when mask_self.
__device__ __forceinline__ float masked_score(const ReformerCudaParams& a, float dot, int64_t qp,
                                              int64_t kp) {
  if (kp < 0 || qp < 0) return -INFINITY;
  if (a.causal && kp > qp) return -INFINITY;
  if (a.mask_self && kp == qp) return kSelfScore;
  return dot * a.scale;
}

// ---- tensor-core tiles (float16 / bfloat16) ----------------------------------

using WmmaAccumulator = fa_wmma::fragment<fa_wmma::accumulator, 16, 16, 16, float>;

// acc += A·B over K (a multiple of 16), A (16 x K) row-major at a (stride
// lda). BLayout row_major: B (K x 16) row-major at b (stride ldb);
// col_major: B^T (16 x K) row-major at b, i.e. acc += A·(B^T)^T.
template <typename BLayout, typename T>
__device__ __forceinline__ void wmma_add_product(WmmaAccumulator& acc, const T* a, int lda,
                                                 const T* b, int ldb, int K) {
  namespace wmma = fa_wmma;
  constexpr bool kTransposed = std::is_same<BLayout, wmma::col_major>::value;
  for (int ks = 0; ks < K; ks += 16) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, BLayout> fb;
    wmma::load_matrix_sync(fa, a + ks, lda);
    wmma::load_matrix_sync(fb, b + (kTransposed ? ks : ks * ldb), ldb);
    wmma::mma_sync(acc, fa, fb, acc);
  }
}

// Rows of x (D values each) at positions pos[0, kRows) into dst (kRows x Dp)
// as T, zeros at position -1 and in the padding d >= D. No barrier.
template <int kRows, typename T>
__device__ __forceinline__ void load_rows_padded(const T* x, int D, int Dp, const int64_t* pos,
                                                 T* dst) {
  const T zero = from_float<T>(0.f);
  for (int idx = threadIdx.x; idx < kRows * Dp; idx += kThreads) {
    const int i = idx / Dp, d = idx % Dp;
    const int64_t p = pos[i];
    dst[idx] = p >= 0 && d < D ? x[p * D + d] : zero;
  }
}

// load_key_tile for the tensor cores: positions into kpos, the keys
// normalised in float (a warp per row) and stored as T into skh (kBK x Ep),
// the values into svh (kBK x Mp), zero padding. Ends with a barrier.
template <typename T>
__device__ __forceinline__ void load_key_tile_wmma(const ReformerCudaParams& a,
                                                   const HeadInputs<T>& in, const QueryTile& t,
                                                   int64_t kt, int64_t* kpos, T* skh, T* svh) {
  const int E = static_cast<int>(a.E), M = static_cast<int>(a.M);
  const int Ep = round16(E), Mp = round16(M);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  if (tid < kBK) kpos[tid] = t.key_pos(kt, tid);
  __syncthreads();
  for (int j = warp; j < kBK; j += kWarps) {
    const int64_t p = kpos[j];
    float x[kMaxPerLane];
    float sum = 0.f;
    for (int u = 0; u < kMaxPerLane; ++u) {
      const int e = lane + 32 * u;
      x[u] = p >= 0 && e < E ? to_float(in.q[p * E + e]) : 0.f;
      sum += x[u] * x[u];
    }
    const float inv = 1.f / fmaxf(sqrtf(warp_sum(sum)), kNormEps);
    for (int u = 0; u < kMaxPerLane; ++u) {
      const int e = lane + 32 * u;
      if (e < Ep) skh[j * Ep + e] = from_float<T>(x[u] * inv);
    }
  }
  load_rows_padded<kBK>(in.v, M, Mp, kpos, svh);
  __syncthreads();
}

}  // namespace
}  // namespace fastattn::cuda
