// What the block-sparse attention CUDA kernels share
// (block_sparse_attention_forward_cuda.cu, block_sparse_attention_backward_cuda.cu;
// see block_sparse_attention_cuda.h and, for the parts, orders and ranges,
// block_sparse_attention.h): the tile shape, a part resolved for a head, the
// rows' ranges and masks, the shared-memory layouts of the kernels, the
// staging and WMMA helpers, and the launchers' checks.
//
// FlashAttention-style over the kept key tiles only. Per part, in the part's
// query and key orders (which make every pattern a contiguous range of key
// tiles per query tile):
//   forward  one block per (n·h, tile of 32 ordered queries), 4 warps of 8
//            query rows; per key tile in the tile's range: K, V to shared
//            memory, each lane scores one key (q·k from shared memory), row
//            mask from the ranges / key_lengths / keep mask, online softmax by
//            warp reductions, O += P·V with P broadcast by shuffles. The first
//            part of a head starts from nothing, the last normalises and writes
//            out and lse; between them the state (O, max, sum) waits in float32
//            workspaces.
//   backward a dQ kernel (same grid; P recomputed from the saved lse,
//            dS = P ∘ (dO·V^T - delta)·scale, dQ += dS·K) and a dK/dV kernel (one
//            block per (n·h, tile of 32 ordered keys), over the query tiles that
//            reach it: dV += P^T·dO, dK += dS^T·Q). Gradients accumulate in
//            float32 buffers (each launch writes disjoint rows, parts add).
// float16 / bfloat16: tensor cores (fa_wmma 16×16×16 tiles, float
// accumulation; 2 warps of 16 rows; P and dS rounded to the dtype before their
// products, masks and softmax elementwise in shared memory). float32: SIMT
// (4 warps of 8 rows, one key per lane, P broadcast by shuffles). Head dims up
// to 256 (zero-padded to multiples of 16 for the tensor cores).
// Cost: forward 4·E·(kept keys, padded to tiles of 32) flops per query;
// backward about 2.5× that, recomputing P twice.
// Tested by tests/cuda_emu/test_block_sparse.cpp (emulator against the CPU
// kernels in float64) and tests/cuda/test_cuda_block_sparse.cpp (GPU).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/block_sparse/block_sparse_attention_cuda.h"

#include "kernels/common/cuda_compat.cuh"
#include "kernels/common/smem_layout.cuh"

namespace fastattn::cuda {

// The kernels' shared argument structs and host helpers.
using namespace fastattn::kernels;

namespace {

using cuda::from_float;
using cuda::to_float;
using cuda::warp_max;
using cuda::warp_sum;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRows = 8;  // rows per warp
constexpr int kBq = static_cast<int>(kBlockSparseCudaBq);
constexpr int kBk = static_cast<int>(kBlockSparseCudaBk);
static_assert(kWarps * kRows == kBq && kBq == kBk && kBk == 32, "tile shape");

// The tensor-core kernels: 2 warps of 16 rows.
constexpr int kWmmaWarps = 2;
constexpr int kWmmaThreads = kWmmaWarps * 32;

__host__ __device__ __forceinline__ int64_t round16(int64_t x) { return (x + 15) / 16 * 16; }

// ---- patterns: parts, orders, ranges ---------------------------------------------------

// Kept ordered keys of one query: [a, b] minus [x, y].
struct RowRange {
  int64_t a, b, x, y;
};

__device__ __forceinline__ bool in_range(const RowRange& r, int64_t jo) {
  return jo >= r.a && jo <= r.b && !(jo >= r.x && jo <= r.y);
}

// Whether a row of range r keeps none of key tile j0 .. j0 + kBk - 1.
__device__ __forceinline__ bool misses_tile(const RowRange& r, int64_t j0) {
  return r.b < j0 || r.a >= j0 + kBk;
}

// One part resolved for the head group of this block.
struct PartView {
  bool skip;               // the part does not cover this head
  int flags;               // bit 0 first part of the head, bit 1 last
  int64_t Sp;              // keys in the part's order
  const int64_t* q_order;  // (L) or null
  const int64_t* k_order;  // (Sp) or null
  const int64_t* ranges;   // (L, 4) or null
  const int64_t* q_tile_kb;
  const int64_t* kt_ptr;
  const int64_t* kt_q;
};

__device__ __forceinline__ PartView resolve(const BlockSparsePartCuda& p,
                                            const BlockSparseCudaParams& a, int64_t h) {
  PartView v;
  const int64_t g = p.head_group ? p.head_group[h] : 0;
  v.skip = g < 0;
  const int64_t gg = g < 0 ? 0 : g;
  v.flags = p.head_flags ? static_cast<int>(p.head_flags[h]) : 3;
  v.Sp = p.group_sp ? p.group_sp[gg] : a.S;
  v.q_order = p.q_order ? p.q_order + gg * a.L : nullptr;
  v.k_order = p.k_order ? p.k_order + gg * a.S : nullptr;
  v.ranges = p.ranges ? p.ranges + gg * a.L * 4 : nullptr;
  const int64_t q_tiles = cuda::ceil_div(a.L, kBq), k_tiles = cuda::ceil_div(a.S, kBk);
  v.q_tile_kb = p.q_tile_kb ? p.q_tile_kb + gg * q_tiles * 2 : nullptr;
  v.kt_ptr = p.kt_ptr ? p.kt_ptr + gg * (k_tiles + 1) : nullptr;
  v.kt_q = p.kt_q;
  return v;
}

__device__ __forceinline__ int64_t query_of(const PartView& p, int64_t tpos) {
  return p.q_order ? p.q_order[tpos] : tpos;
}
__device__ __forceinline__ int64_t key_of(const PartView& p, int64_t jo) {
  return p.k_order ? p.k_order[jo] : jo;
}
// The query of ordered query tpos, -1 past the L queries.
__device__ __forceinline__ int64_t query_at(const PartView& p, int64_t L, int64_t tpos) {
  return tpos < L ? query_of(p, tpos) : -1;
}
// The key of ordered key jo, -1 past the part's keys.
__device__ __forceinline__ int64_t key_at(const PartView& p, int64_t jo) {
  return jo < p.Sp ? key_of(p, jo) : -1;
}

// The range of ordered query tpos (query index qi).
__device__ __forceinline__ RowRange range_of(const PartView& p, const BlockSparseCudaParams& a,
                                             int64_t tpos, int64_t qi) {
  RowRange r;
  if (p.ranges) {
    const int64_t* x = p.ranges + tpos * 4;
    r.a = x[0];
    r.b = x[1];
    r.x = x[2];
    r.y = x[3];
  } else {
    r.a = 0;
    r.b = a.causal ? (qi + a.S - a.L < a.S - 1 ? qi + a.S - a.L : a.S - 1) : a.S - 1;
    r.x = 0;
    r.y = -1;
  }
  return r;
}
// The same, no keys where there is no query (qi < 0).
__device__ __forceinline__ RowRange range_or_none(const PartView& p, const BlockSparseCudaParams& a,
                                                  int64_t tpos, int64_t qi) {
  return qi >= 0 ? range_of(p, a, tpos, qi) : RowRange{0, -1, 0, -1};
}

// Key tiles [lo, hi] of query tile t.
__device__ __forceinline__ void key_tiles_of(const PartView& p, const BlockSparseCudaParams& a,
                                             int64_t t, int64_t& lo, int64_t& hi) {
  if (p.q_tile_kb) {
    lo = p.q_tile_kb[t * 2];
    hi = p.q_tile_kb[t * 2 + 1];
    return;
  }
  lo = 0;
  hi = cuda::ceil_div(p.Sp, kBk) - 1;
  if (a.causal && !p.ranges) {
    const int64_t last = (t * kBq + kBq < a.L ? t * kBq + kBq : a.L) - 1 + a.S - a.L;
    if (last < 0)
      hi = -1;
    else if (last / kBk < hi)
      hi = last / kBk;
  }
}

// The query tiles that reach key tile kb: entries [lo, hi) of query_tile_at.
__device__ __forceinline__ void query_tiles_of(const PartView& p, const BlockSparseCudaParams& a,
                                               int64_t kb, int64_t& lo, int64_t& hi) {
  const int64_t q_tiles = cuda::ceil_div(a.L, kBq);
  lo = 0;
  hi = q_tiles;
  if (p.kt_ptr) {
    lo = p.kt_ptr[kb];
    hi = p.kt_ptr[kb + 1];
  } else if (a.causal && !p.ranges) {
    const int64_t first_q = kb * kBk - (a.S - a.L);  // queries i >= j - (S - L) see key j
    lo = first_q <= 0 ? 0 : (first_q >= a.L ? q_tiles : first_q / kBq);
  }
}
__device__ __forceinline__ int64_t query_tile_at(const PartView& p, int64_t e) {
  return p.kt_ptr ? p.kt_q[e] : e;
}

__device__ __forceinline__ bool keep_mask(const BlockSparseCudaParams& a, int64_t n, int64_t h,
                                          int64_t qi, int64_t ko) {
  return a.keep == nullptr || a.keep[n * a.keep_sn + h * a.keep_sh + qi * a.keep_sl + ko];
}

// Whether query qi (range rg) of head (n, h) keeps ordered key jo, key ko (-1:
// none; keys from len on are past the batch's length).
__device__ __forceinline__ bool keeps(const BlockSparseCudaParams& a, int64_t n, int64_t h,
                                      int64_t len, const RowRange& rg, int64_t qi, int64_t jo,
                                      int64_t ko) {
  return ko >= 0 && ko < len && in_range(rg, jo) && keep_mask(a, n, h, qi, ko);
}

// ---- a block's head -----------------------------------------------------------------

// The block's tile (among `tiles` per head: a query tile, or in the dK/dV
// kernels a key tile), its head nh = n·H + h, the part resolved for h and the
// head's operands.
template <typename T>
struct HeadBlock {
  int64_t tile, nh, n, h;
  PartView P;
  const T* q;  // (L, E)
  const T* k;  // (S, E)
  const T* v;  // (S, M)
  __device__ HeadBlock(const BlockSparseCudaParams& a, int part, int64_t tiles)
      : tile(blockIdx.x % tiles),
        nh(blockIdx.x / tiles),
        n(nh / a.H),
        h(nh % a.H),
        P(resolve(a.parts[part], a, h)),
        q(static_cast<const T*>(a.q) + nh * a.L * a.E),
        k(static_cast<const T*>(a.k) + nh * a.S * a.E),
        v(static_cast<const T*>(a.v) + nh * a.S * a.M) {}
};

__device__ __forceinline__ int64_t key_length(const BlockSparseCudaParams& a, int64_t n) {
  return a.key_lengths ? a.key_lengths[n] : a.S;
}

// ---- shared-memory layouts ---------------------------------------------------------
// One struct per kernel (smem_layout.cuh): the launcher's size is
// smem_bytes<Layout>(...), the kernel's pointers carve_smem<Layout>(...).

// The next `count` elements of U from carver c (either kind).
template <typename U, typename C>
__host__ __device__ __forceinline__ U* take(C& c, int64_t count) {
  return c.template take<U>(count);
}

// The arrays every layout starts with: the tile's original key and query
// indices (-1: none).
struct TileIndexSmem {
  int64_t* kidx;  // (kBk)
  int64_t* qidx;  // (kBq)
  template <typename C>
  __host__ __device__ explicit TileIndexSmem(C& c)
      : kidx(take<int64_t>(c, kBk)), qidx(take<int64_t>(c, kBq)) {}
};

// With the query rows' ranges (stage_query_row).
struct QueryRowsSmem : TileIndexSmem {
  int64_t* qrg;  // (kBq, 4) a, b, x, y per row
  template <typename C>
  __host__ __device__ explicit QueryRowsSmem(C& c)
      : TileIndexSmem(c), qrg(take<int64_t>(c, kBq * 4)) {}
  __device__ __forceinline__ RowRange range(int r) const {
    return RowRange{qrg[r * 4], qrg[r * 4 + 1], qrg[r * 4 + 2], qrg[r * 4 + 3]};
  }
};

// The backward's: with the rows' lse and delta (stage_grad_row).
struct GradRowsSmem : QueryRowsSmem {
  float* qlse;    // (kBq)
  float* qdelta;  // (kBq)
  template <typename C>
  __host__ __device__ explicit GradRowsSmem(C& c)
      : QueryRowsSmem(c), qlse(take<float>(c, kBq)), qdelta(take<float>(c, kBq)) {}
};

// forward_kernel (SIMT): Q, K, V as floats; K's rows padded (a lane per key).
struct ForwardSmem : TileIndexSmem {
  float* qs;  // (kBq, E)
  float* ks;  // (kBk, E + 1)
  float* vs;  // (kBk, M)
  template <typename C>
  __host__ __device__ ForwardSmem(C& c, int64_t E, int64_t M)
      : TileIndexSmem(c),
        qs(take<float>(c, kBq * E)),
        ks(take<float>(c, kBk * (E + 1))),
        vs(take<float>(c, kBk * M)) {}
};

// forward_wmma_kernel: Ep, Mp are E, M rounded up to 16.
template <typename T>
struct ForwardWmmaSmem : QueryRowsSmem {
  float* ss;  // (kBq, kBk) scores
  float* os;  // (kBq, Mp) unnormalised output
  T* qs;      // (kBq, Ep)
  T* ks;      // (kBk, Ep)
  T* vs;      // (kBk, Mp)
  T* ps;      // (kBq, kBk) probabilities
  template <typename C>
  __host__ __device__ ForwardWmmaSmem(C& c, int64_t Ep, int64_t Mp)
      : QueryRowsSmem(c),
        ss(take<float>(c, kBq * kBk)),
        os(take<float>(c, kBq * Mp)),
        qs(take<T>(c, kBq * Ep)),
        ks(take<T>(c, kBk * Ep)),
        vs(take<T>(c, kBk * Mp)),
        ps(take<T>(c, kBq * kBk)) {}
};

// backward_dq_kernel (SIMT): K's and V's rows padded (a lane per key).
struct BackwardDqSmem : TileIndexSmem {
  float* qs;   // (kBq, E)
  float* dos;  // (kBq, M)
  float* ks;   // (kBk, E + 1)
  float* vs;   // (kBk, M + 1)
  template <typename C>
  __host__ __device__ BackwardDqSmem(C& c, int64_t E, int64_t M)
      : TileIndexSmem(c),
        qs(take<float>(c, kBq * E)),
        dos(take<float>(c, kBq * M)),
        ks(take<float>(c, kBk * (E + 1))),
        vs(take<float>(c, kBk * (M + 1))) {}
};

// backward_dkv_kernel (SIMT): Q's and dO's rows padded (a lane per query).
struct BackwardDkvSmem : GradRowsSmem {
  float* ks;   // (kBk, E)
  float* vs;   // (kBk, M)
  float* qs;   // (kBq, E + 1)
  float* dos;  // (kBq, M + 1)
  template <typename C>
  __host__ __device__ BackwardDkvSmem(C& c, int64_t E, int64_t M)
      : GradRowsSmem(c),
        ks(take<float>(c, kBk * E)),
        vs(take<float>(c, kBk * M)),
        qs(take<float>(c, kBq * (E + 1))),
        dos(take<float>(c, kBq * (M + 1))) {}
};

// backward_dq_wmma_kernel.
template <typename T>
struct BackwardDqWmmaSmem : GradRowsSmem {
  float* ss;   // (kBq, kBk) S
  float* dps;  // (kBq, kBk) dP
  float* dq;   // (kBq, Ep)
  T* qs;       // (kBq, Ep)
  T* ks;       // (kBk, Ep)
  T* dos;      // (kBq, Mp)
  T* vs;       // (kBk, Mp)
  T* dst;      // (kBq, kBk) dS
  template <typename C>
  __host__ __device__ BackwardDqWmmaSmem(C& c, int64_t Ep, int64_t Mp)
      : GradRowsSmem(c),
        ss(take<float>(c, kBq * kBk)),
        dps(take<float>(c, kBq * kBk)),
        dq(take<float>(c, kBq * Ep)),
        qs(take<T>(c, kBq * Ep)),
        ks(take<T>(c, kBk * Ep)),
        dos(take<T>(c, kBq * Mp)),
        vs(take<T>(c, kBk * Mp)),
        dst(take<T>(c, kBq * kBk)) {}
};

// backward_dkv_wmma_kernel.
template <typename T>
struct BackwardDkvWmmaSmem : GradRowsSmem {
  float* sts;   // (kBk, kBq) S^T
  float* dpts;  // (kBk, kBq) dP^T
  float* dk;    // (kBk, Ep)
  float* dv;    // (kBk, Mp)
  T* qs;        // (kBq, Ep)
  T* ks;        // (kBk, Ep)
  T* dos;       // (kBq, Mp)
  T* vs;        // (kBk, Mp)
  T* pts;       // (kBk, kBq) P^T, then dS^T
  template <typename C>
  __host__ __device__ BackwardDkvWmmaSmem(C& c, int64_t Ep, int64_t Mp)
      : GradRowsSmem(c),
        sts(take<float>(c, kBk * kBq)),
        dpts(take<float>(c, kBk * kBq)),
        dk(take<float>(c, kBk * Ep)),
        dv(take<float>(c, kBk * Mp)),
        qs(take<T>(c, kBq * Ep)),
        ks(take<T>(c, kBk * Ep)),
        dos(take<T>(c, kBq * Mp)),
        vs(take<T>(c, kBk * Mp)),
        pts(take<T>(c, kBk * kBq)) {}
};

// ---- staging tiles in shared memory ---------------------------------------------------

// Stages the next tile: after a barrier (the previous tile is consumed),
// index() writes the tile's indices; after another, load() copies its rows;
// a last one makes them visible.
template <typename Index, typename Load>
__device__ __forceinline__ void stage_tile(Index&& index, Load&& load) {
  __syncthreads();
  index();
  __syncthreads();
  load();
  __syncthreads();
}

// Thread x < kBk: the key of key x of the tile from ordered key j0.
__device__ __forceinline__ void stage_key(const PartView& p, int64_t j0, int64_t* kidx) {
  if (threadIdx.x < kBk) kidx[threadIdx.x] = key_at(p, j0 + threadIdx.x);
}

// Thread x < kBq (the caller checks): row x of query tile t, its query (-1:
// none) and range. Returns the query.
__device__ __forceinline__ int64_t stage_query_row(const PartView& p,
                                                   const BlockSparseCudaParams& a, int64_t t,
                                                   const QueryRowsSmem& sm) {
  const int64_t tpos = t * kBq + threadIdx.x;
  const int64_t i = query_at(p, a.L, tpos);
  sm.qidx[threadIdx.x] = i;
  const RowRange r = range_or_none(p, a, tpos, i);
  sm.qrg[threadIdx.x * 4 + 0] = r.a;
  sm.qrg[threadIdx.x * 4 + 1] = r.b;
  sm.qrg[threadIdx.x * 4 + 2] = r.x;
  sm.qrg[threadIdx.x * 4 + 3] = r.y;
  return i;
}
// The same with the row's lse and delta (head nh).
__device__ __forceinline__ void stage_grad_row(const PartView& p,
                                               const BlockSparseBackwardCudaArgs& a, int64_t t,
                                               int64_t nh, const GradRowsSmem& sm) {
  const int64_t i = stage_query_row(p, a, t, sm);
  sm.qlse[threadIdx.x] = i >= 0 ? a.lse[nh * a.L + i] : -INFINITY;
  sm.qdelta[threadIdx.x] = i >= 0 ? a.delta[nh * a.L + i] : 0.f;
}

// Copies `rows` rows of D elements (row r from src row index idx[r], -1: zeros)
// into dst with row stride ld, as floats. The whole block (SIMT) takes part.
template <typename T>
__device__ __forceinline__ void load_rows(float* dst, int ld, const T* src, const int64_t* idx,
                                          int rows, int64_t D) {
  for (int64_t x = threadIdx.x; x < rows * D; x += kThreads) {
    const int64_t r = x / D, c = x % D;
    const int64_t i = idx[r];
    dst[r * ld + c] = i >= 0 ? to_float(src[i * D + c]) : 0.f;
  }
}

// Copies rows (index idx[r], -1: zeros) of D elements into dst (rows × Dp, T),
// zero-padded. The whole block (tensor cores) takes part.
template <typename T>
__device__ __forceinline__ void load_rows_t(T* dst, const T* src, const int64_t* idx, int rows,
                                            int64_t D, int64_t Dp) {
  for (int64_t x = threadIdx.x; x < rows * Dp; x += kWmmaThreads) {
    const int64_t r = x / Dp, c = x % Dp, i = idx[r];
    dst[x] = i >= 0 && c < D ? src[i * D + c] : from_float<T>(0.f);
  }
}

__device__ __forceinline__ float dot(const float* x, const float* y, int64_t D) {
  float s = 0.f;
  for (int64_t e = 0; e < D; ++e) s += x[e] * y[e];
  return s;
}

// g[c] += x[u] for this lane's columns c = lane + 32·u < D.
template <int DC>
__device__ __forceinline__ void add_lane_cols(float* g, const float (&x)[DC], int64_t D, int lane) {
  FA_UNROLL
  for (int u = 0; u < DC; ++u) {
    const int64_t c = lane + 32 * u;
    if (c < D) g[c] += x[u];
  }
}

// g[c] += x[c] for this lane's half of the D columns (c = half, half + 2, ...).
__device__ __forceinline__ void add_half_cols(float* g, const float* x, int64_t D, int half) {
  for (int64_t c = half; c < D; c += 2) g[c] += x[c];
}

// ---- tensor-core tiles ----------------------------------------------------------------

// The 16 columns of a (·, 32) shared tile that lane `lane` (row lane / 2 of
// its warp's band, half = lane % 2) handles: all even or all odd columns,
// rotated by the row so that the 32 lanes hit 32 different banks.
__device__ __forceinline__ int pair_col(int lane, int u) {
  return (2 * u + (lane & 1) + 2 * (lane >> 1)) & 31;
}

namespace wmma_tiles {
// acc(16×16 tiles of a 16-row band, float in shared, ld) += A (16×32, T, lda) · B (32 × cols, T)
// where B is row-major (ldb). cols is a multiple of 16.
template <typename T>
__device__ __forceinline__ void band_mma_rows(float* acc, unsigned ld, const T* A, unsigned lda,
                                              const T* B, unsigned ldb, int64_t cols) {
  namespace wm = fa_wmma;
  for (int64_t c0 = 0; c0 < cols; c0 += 16) {
    wm::fragment<wm::accumulator, 16, 16, 16, float> f;
    wm::load_matrix_sync(f, acc + c0, ld, wm::mem_row_major);
    for (int kk = 0; kk < 32; kk += 16) {
      wm::fragment<wm::matrix_a, 16, 16, 16, T, wm::row_major> fa;
      wm::fragment<wm::matrix_b, 16, 16, 16, T, wm::row_major> fb;
      wm::load_matrix_sync(fa, A + kk, lda);
      wm::load_matrix_sync(fb, B + kk * ldb + c0, ldb);
      wm::mma_sync(f, fa, fb, f);
    }
    wm::store_matrix_sync(acc + c0, f, ld, wm::mem_row_major);
  }
}
// out (16×32 float, ld 32) = A (16 × D, T row-major, lda) · B^T where B is (32 × D) row-major
// (ldb).
template <typename T>
__device__ __forceinline__ void band_scores(float* out, const T* A, unsigned lda, const T* B,
                                            unsigned ldb, int64_t D) {
  namespace wm = fa_wmma;
  for (int ct = 0; ct < 2; ++ct) {
    wm::fragment<wm::accumulator, 16, 16, 16, float> f;
    wm::fill_fragment(f, 0.f);
    for (int64_t e0 = 0; e0 < D; e0 += 16) {
      wm::fragment<wm::matrix_a, 16, 16, 16, T, wm::row_major> fa;
      wm::fragment<wm::matrix_b, 16, 16, 16, T, wm::col_major> fb;
      wm::load_matrix_sync(fa, A + e0, lda);
      wm::load_matrix_sync(fb, B + ct * 16 * ldb + e0, ldb);
      wm::mma_sync(f, fa, fb, f);
    }
    wm::store_matrix_sync(out + ct * 16, f, 32, wm::mem_row_major);
  }
}
}  // namespace wmma_tiles

// ---- launchers ----------------------------------------------------------------------

// The register chunks per lane per row (of 32 columns) for head dims E, M;
// throws above kBlockSparseCudaMaxDim.
inline int dim_chunks(const BlockSparseCudaParams& a) {
  const int64_t d = a.E > a.M ? a.E : a.M;
  if (d > kBlockSparseCudaMaxDim)
    throw std::runtime_error("fastattn CUDA block_sparse_attention: head dims E and M must be <= " +
                             std::to_string(kBlockSparseCudaMaxDim) +
                             ", got E = " + std::to_string(a.E) + ", M = " + std::to_string(a.M));
  const int64_t c = cuda::ceil_div(d, 32);
  return c <= 1 ? 1 : c <= 2 ? 2 : c <= 4 ? 4 : 8;
}

// Calls f.operator()<DC>() for the chunk count dc (registers per lane per row).
template <typename F>
void dispatch_chunks(int dc, F&& f) {
  switch (dc) {
    case 1:
      f.template operator()<1>();
      break;
    case 2:
      f.template operator()<2>();
      break;
    case 4:
      f.template operator()<4>();
      break;
    default:
      f.template operator()<8>();
      break;
  }
}

// Launches kernel(args...) on `blocks` blocks of `threads` with `smem` bytes
// of dynamic shared memory; `what` names it in errors.
template <typename... P, typename... A>
void launch_kernel(void (*kernel)(P...), int64_t blocks, int threads, size_t smem,
                   cudaStream_t stream, const char* what, A... args) {
  FA_SET_MAX_DYNAMIC_SHARED(smem, kernel);
  FA_LAUNCH(dim3(static_cast<unsigned>(blocks)), dim3(threads), smem, stream, kernel)(args...);
  FA_CHECK_LAUNCH(what);
}

}  // namespace
}  // namespace fastattn::cuda
