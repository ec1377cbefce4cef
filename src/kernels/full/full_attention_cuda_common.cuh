// Fused softmax attention on CUDA, FlashAttention-2 style (see
// full_attention_cuda.h for the arguments; the semantics are those of the CPU
// kernel in full_attention_cpu.cpp: additive mask with strides, key lengths,
// causal offset S - L, rows without a kept key give zeros and lse = -inf).
// This header holds what the forward (full_attention_forward_cuda.cu) and the
// backward (full_attention_backward_cuda.cu) share: tile configuration,
// shared-memory layouts, device helpers and host-side checks.
//
// Forward: one block (4 warps) per (tile of 64 queries, n·h), online softmax
// over key tiles staged in shared memory (K and V; 64 keys for
// float16/bfloat16, 32 for float32). float16/bfloat16 (full_forward_tc_kernel):
// each warp owns 16 query rows and keeps its Q rows (matrix_a fragments) and
// output accumulator (float fragments) in registers; S = Q·K^T goes through
// the warp's strip of shared memory for the row-wise softmax (running max m,
// sum l), P (rounded to the storage type) comes back as matrix_a fragments for
// O += P·V, and the accumulator is rescaled per row through a fragment of row
// indices (an accumulator fragment loaded from a 16×16 tile of its row
// numbers names each element's row, whatever the opaque layout). float32
// (full_forward_kernel): the same steps with SIMT products over shared-memory
// tiles and a shared-memory accumulator. At the end O /= l, lse = m + log l.
// Backward: one block per (key tile, n·h) with dK and dV accumulated over the
// query tiles that can see it: P is recomputed from the saved lse,
// dV += P^T·dO, dP = dO·V^T, dS = P∘(dP - delta)·scale, dK += dS^T·Q, and
// dQ += dS·K is added with atomicAdd into a float32 workspace, converted to
// the output dtype by a final pass (which also implements `accumulate`).
// float16/bfloat16 (full_backward_tc_kernel, 64 keys × 64 queries): each warp
// owns 16 keys and keeps their dK, dV rows in accumulator fragments, forming
// the transposed strips S^T, P^T, dP^T, dS^T in its own shared memory; float32
// (full_backward_kernel, 32 × 32): SIMT products with shared-memory
// accumulators.
// Matrix products: float16/bfloat16 use WMMA 16×16×16 tensor-core tiles
// (float accumulation; head dims are zero-padded to multiples of 16 in shared
// memory, so any E, M ≤ 128 works); float32 uses SIMT loops over the same
// shared-memory tiles. Scores and probabilities go through shared memory for
// the row-wise softmax (fragment layouts are opaque). P and dS are rounded to
// the storage dtype before their tensor-core products (as FlashAttention does).
// Limits: E, M in [1, 128] (kFullAttentionCudaMaxHeadDim).
//
// Cost: forward 4·N·H·L·S·max(E, M) flops (halved by causal), memory O(N·H·L)
// beyond inputs and outputs; backward 2.5× the flops plus the float32 dQ
// workspace (N·H·L·E).
// Shared memory (E = M = 128): forward 79 KiB (half types) / 114 KiB
// (float32), backward 121 KiB / 122 KiB: within the 163 KiB opt-in of sm_80
// as well as the 227 KiB of sm_90.
//
// Tested on the CPU by the emulator (tests/cuda_emu/test_full.cpp: against the
// CPU kernels in float64, all dtypes, awkward sizes, masks, key lengths,
// causal, empty rows, gradients, accumulate) and on a GPU by
// tests/cuda/test_cuda_full.cpp (against the CPU op).
#pragma once

#include "kernels/full/full_attention_cuda.h"

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/common/cuda_compat.cuh"
#include "kernels/common/smem_layout.cuh"

namespace fastattn::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;

// TC: the tensor-core kernels' tiles (the default for the half types), else
// the SIMT kernels' (float32, and the half types where tensor cores are
// missing: bfloat16 below sm_80).
template <typename T, bool TC = !std::is_same<T, float>::value>
struct FullCfg {
  static constexpr bool kTensorCores = TC;
  static constexpr int kFwdBr = 64;  // queries per forward block (both kinds: one grid)
  static constexpr int kFwdBc = kTensorCores ? 64 : 32;  // keys per forward tile
  static constexpr int kBwdBr = kTensorCores ? 64 : 32;  // queries per backward step
  static constexpr int kBwdBc = kTensorCores ? 64 : 32;  // keys per backward block
  // Leading-dimension padding (elements) of storage-type and float tiles:
  // WMMA wants multiples of 8 (16-bit) and 4 (float); SIMT avoids bank
  // conflicts with odd strides.
  static constexpr int kPadT = kTensorCores ? 8 : 1;
  static constexpr int kPadF = kTensorCores ? 4 : 1;
};

__host__ __device__ __forceinline__ int round16(int64_t x) {
  return static_cast<int>((x + 15) / 16 * 16);
}

// ---------------------------------------------------------------------------
// Shared-memory layouts (smem_layout.cuh): one per kernel, constructed from
// (carver, Ep, Mp) with Ep, Mp the head dims rounded up to 16. Leading dims
// (ld*) are in elements. The launcher sizes the block with
// smem_bytes<Layout>(Ep, Mp), the kernel takes its pointers with
// carve_smem<Layout>(Ep, Mp).

// Two arrays of n floats each (`first`, then `second` at the next 128-byte
// boundary) whose space a third array of m floats (`other`, at `first`)
// reuses later in each step. The carver has no overlays: `second` is carved
// large enough for what `other` needs beyond `first`.
struct FloatPairOverlay {
  float* first;
  float* second;
  float* other;
  template <typename Carver>
  __host__ __device__ FloatPairOverlay(Carver& c, int64_t n, int64_t m) {
    const size_t half = align128(sizeof(float) * n), whole = align128(sizeof(float) * m);
    const size_t rest = (whole > 2 * half ? whole : 2 * half) - half;
    first = other = c.template take<float>(n);
    second = c.template take<float>(static_cast<int64_t>(rest / sizeof(float)));
  }
};

// What both forward layouts start with (C: the kernel's FullCfg): the Q tile,
// the K and V tiles, S (float) and P (storage type).
template <typename T, typename C>
struct FwdTiles {
  int ldq, ldk, ldv, lds, ldp;
  T *q, *k, *v;
  float* s;
  T* p;
  template <typename Carver>
  __host__ __device__ FwdTiles(Carver& c, int Ep, int Mp)
      : ldq(Ep + C::kPadT),
        ldk(Ep + C::kPadT),
        ldv(Mp + C::kPadT),
        lds(C::kFwdBc + C::kPadF),
        ldp(C::kFwdBc + C::kPadT),
        q(c.template take<T>(C::kFwdBr * ldq)),
        k(c.template take<T>(C::kFwdBc * ldk)),
        v(c.template take<T>(C::kFwdBc * ldv)),
        s(c.template take<float>(C::kFwdBr * lds)),
        p(c.template take<T>(C::kFwdBr * ldp)) {}
};

// The SIMT forward block: the forward tiles, the output accumulator O
// (float), the rows' running max m and sum l.
template <typename T>
struct FwdSmem : FwdTiles<T, FullCfg<T, false>> {
  using C = FullCfg<T, false>;
  int ldo;
  float *o, *m, *l;
  template <typename Carver>
  __host__ __device__ FwdSmem(Carver& c, int Ep, int Mp)
      : FwdTiles<T, C>(c, Ep, Mp),
        ldo(Mp + C::kPadF),
        o(c.template take<float>(C::kFwdBr * ldo)),
        m(c.template take<float>(C::kFwdBr)),
        l(c.template take<float>(C::kFwdBr)) {}
};

// The tensor-core forward block: the forward tiles (S and P as the warps'
// strips), a 16×16 tile of row indices, and per row the running max m, sum l
// and the last rescaling factor alpha.
template <typename T>
struct FwdTcSmem : FwdTiles<T, FullCfg<T>> {
  using C = FullCfg<T>;
  float *row_ids, *m, *l, *alpha;
  template <typename Carver>
  __host__ __device__ FwdTcSmem(Carver& c, int Ep, int Mp)
      : FwdTiles<T, C>(c, Ep, Mp),
        row_ids(c.template take<float>(256)),
        m(c.template take<float>(C::kFwdBr)),
        l(c.template take<float>(C::kFwdBr)),
        alpha(c.template take<float>(C::kFwdBr)) {}
};

// What both backward layouts start with (C: the kernel's FullCfg): Q and dO
// of the query tile, K and V of the key tile.
template <typename T, typename C>
struct BwdTiles {
  int ldq, ldk, ldv, lddo;
  T *q, *dout, *k, *v;
  template <typename Carver>
  __host__ __device__ BwdTiles(Carver& c, int Ep, int Mp)
      : ldq(Ep + C::kPadT),
        ldk(Ep + C::kPadT),
        ldv(Mp + C::kPadT),
        lddo(Mp + C::kPadT),
        q(c.template take<T>(C::kBwdBr * ldq)),
        dout(c.template take<T>(C::kBwdBr * lddo)),
        k(c.template take<T>(C::kBwdBc * ldk)),
        v(c.template take<T>(C::kBwdBc * ldv)) {}
};

// The SIMT backward block: the backward tiles, S/P and dP (float, sharing
// their space with the dQ tile), P and dS in the storage type, dK and dV
// accumulators (float), the query tile's lse and delta.
template <typename T>
struct BwdSmem : BwdTiles<T, FullCfg<T, false>> {
  using C = FullCfg<T, false>;
  int ldsf, ldp, lde, ldm;
  float *s, *dp, *dq;
  T *p, *ds;
  float *dk, *dv, *lse, *delta;
  template <typename Carver>
  __host__ __device__ BwdSmem(Carver& c, int Ep, int Mp)
      : BwdTiles<T, C>(c, Ep, Mp),
        ldsf(C::kBwdBc + C::kPadF),
        ldp(C::kBwdBc + C::kPadT),
        lde(Ep + C::kPadF),   // dK and the dQ tile
        ldm(Mp + C::kPadF) {  // dV
    // S/P and dP, or (later in each step) the dQ tile.
    const FloatPairOverlay sdp(c, C::kBwdBr * ldsf, C::kBwdBr * lde);
    s = sdp.first;
    dp = sdp.second;
    dq = sdp.other;
    p = c.template take<T>(C::kBwdBr * ldp);
    ds = c.template take<T>(C::kBwdBr * ldp);
    dk = c.template take<float>(C::kBwdBc * lde);
    dv = c.template take<float>(C::kBwdBc * ldm);
    lse = c.template take<float>(C::kBwdBr);
    delta = c.template take<float>(C::kBwdBr);
  }
};

// The tensor-core backward block: the backward tiles, the warps' strips of
// S^T/P^T and dP^T (float, sharing their space with the dQ tile), of P^T and
// dS^T (storage type), the query tile's lse and delta.
template <typename T>
struct BwdTcSmem : BwdTiles<T, FullCfg<T>> {
  using C = FullCfg<T>;
  int ldst, ldpt, lde;
  float *st, *dpt, *dq;
  T *pt, *dst;
  float *lse, *delta;
  template <typename Carver>
  __host__ __device__ BwdTcSmem(Carver& c, int Ep, int Mp)
      : BwdTiles<T, C>(c, Ep, Mp),
        ldst(C::kBwdBr + C::kPadF),
        ldpt(C::kBwdBr + C::kPadT),
        lde(Ep + C::kPadF) {
    // S^T/P^T and dP^T (float), or (later in each step) the dQ tile.
    const FloatPairOverlay sdp(c, C::kBwdBc * ldst, C::kBwdBr * lde);
    st = sdp.first;
    dpt = sdp.second;
    dq = sdp.other;
    pt = c.template take<T>(C::kBwdBc * ldpt);
    dst = c.template take<T>(C::kBwdBc * ldpt);
    lse = c.template take<float>(C::kBwdBr);
    delta = c.template take<float>(C::kBwdBr);
  }
};

// ---------------------------------------------------------------------------
// Device helpers.

// A block of a grid of N·H × `tiles` blocks (blockIdx.x = nh·tiles + tile):
// its head, the first row of its tile (queries in the forward, keys in the
// backward; `tile_rows` a tile), the head's Q, K, V and the sizes L, S, E, M
// (read once, for the helpers below).
template <typename T>
struct FullBlock {
  int64_t L, S, E, M;
  int64_t nh, n, h;
  int64_t start;   // the tile's first row
  int64_t offset;  // S - L: query i sees key j <= i + offset when causal
  const T* q;      // (L, E) of head nh
  const T* k;      // (S, E)
  const T* v;      // (S, M)
  const T* mask;   // the whole mask, or nullptr
  __device__ __forceinline__ FullBlock(const FullAttentionCudaParams& a, int64_t tiles,
                                       int tile_rows)
      : L(a.L),
        S(a.S),
        E(a.E),
        M(a.M),
        nh(static_cast<int64_t>(blockIdx.x) / tiles),
        n(nh / a.H),
        h(nh % a.H),
        start((static_cast<int64_t>(blockIdx.x) % tiles) * tile_rows),
        offset(a.S - a.L),
        q(static_cast<const T*>(a.q) + nh * a.L * a.E),
        k(static_cast<const T*>(a.k) + nh * a.S * a.E),
        v(static_cast<const T*>(a.v) + nh * a.S * a.M),
        mask(static_cast<const T*>(a.mask)) {}
};

// C (R×Cn float, leading dim ldc) = [C +] A·B over the whole block, where A is
// R×K (row-major A[r·lda + k], or column-major A[k·lda + r] when ACOL) and B is
// K×Cn (B[k·ldb + c], or B[c·ldb + k] when BCOL). R, Cn, K are multiples of 16.
// TC (tensor-core kernels): WMMA tiles dealt round-robin to the warps; SIMT
// kernels: one output element per thread at a time. No barrier inside:
// callers synchronise.
template <typename T, bool ACOL, bool BCOL, bool TC>
__device__ __forceinline__ void block_mm(float* C, int ldc, const T* A, int lda, const T* B,
                                         int ldb, int R, int Cn, int K, bool accumulate) {
  if constexpr (TC) {
    using LA = typename std::conditional<ACOL, fa_wmma::col_major, fa_wmma::row_major>::type;
    using LB = typename std::conditional<BCOL, fa_wmma::col_major, fa_wmma::row_major>::type;
    const int warp = static_cast<int>(threadIdx.x) / 32;
    const int tiles_c = Cn / 16, tiles = (R / 16) * tiles_c;
    for (int t = warp; t < tiles; t += kWarps) {
      const int r0 = (t / tiles_c) * 16, c0 = (t % tiles_c) * 16;
      fa_wmma::fragment<fa_wmma::accumulator, 16, 16, 16, float> acc;
      if (accumulate) {
        fa_wmma::load_matrix_sync(acc, C + r0 * ldc + c0, ldc, fa_wmma::mem_row_major);
      } else {
        fa_wmma::fill_fragment(acc, 0.f);
      }
      for (int k0 = 0; k0 < K; k0 += 16) {
        fa_wmma::fragment<fa_wmma::matrix_a, 16, 16, 16, T, LA> fa;
        fa_wmma::fragment<fa_wmma::matrix_b, 16, 16, 16, T, LB> fb;
        fa_wmma::load_matrix_sync(fa, ACOL ? A + k0 * lda + r0 : A + r0 * lda + k0, lda);
        fa_wmma::load_matrix_sync(fb, BCOL ? B + c0 * ldb + k0 : B + k0 * ldb + c0, ldb);
        fa_wmma::mma_sync(acc, fa, fb, acc);
      }
      fa_wmma::store_matrix_sync(C + r0 * ldc + c0, acc, ldc, fa_wmma::mem_row_major);
    }
  } else {
    for (int idx = threadIdx.x; idx < R * Cn; idx += kThreads) {
      const int r = idx / Cn, c = idx % Cn;
      float s = accumulate ? C[r * ldc + c] : 0.f;
      for (int k = 0; k < K; ++k) {
        const float x = to_float(ACOL ? A[k * lda + r] : A[r * lda + k]);
        const float y = to_float(BCOL ? B[c * ldb + k] : B[k * ldb + c]);
        s += x * y;
      }
      C[r * ldc + c] = s;
    }
  }
}

// dst[r·ld + c] for r < rows_tile, c < cols_tile (a multiple of 16) from
// src[r·D + c] (rows < rows_valid, c < D), zero elsewhere. 16-byte vectors
// when D, ld and src allow it.
template <typename T>
__device__ __forceinline__ void load_tile(T* dst, int ld, const T* src, int64_t rows_valid,
                                          int64_t D, int rows_tile, int cols_tile) {
  constexpr int VEC = 16 / sizeof(T);
  if (D % VEC == 0 && (ld * sizeof(T)) % 16 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0) {
    const int vc = cols_tile / VEC;
    const int64_t vd = D / VEC;
    for (int idx = threadIdx.x; idx < rows_tile * vc; idx += kThreads) {
      const int r = idx / vc, c = idx % vc;
      uint4 val{0u, 0u, 0u, 0u};
      if (r < rows_valid && c < vd) val = reinterpret_cast<const uint4*>(src + r * D)[c];
      reinterpret_cast<uint4*>(dst + r * ld)[c] = val;
    }
    return;
  }
  const T zero = from_float<T>(0.f);
  for (int idx = threadIdx.x; idx < rows_tile * cols_tile; idx += kThreads) {
    const int r = idx / cols_tile, c = idx % cols_tile;
    dst[r * ld + c] = (r < rows_valid && c < D) ? src[r * D + c] : zero;
  }
}

// The tile of BC keys from key j0 (`cols` of them real, the rest zero) into
// the layout's K and V (every layout has k, ldk, v, ldv).
template <int BC, typename T, typename Smem>
__device__ __forceinline__ void load_kv_tile(const Smem& sm, const FullBlock<T>& b, int64_t j0,
                                             int64_t cols, int Ep, int Mp) {
  load_tile(sm.k, sm.ldk, b.k + j0 * b.E, cols, b.E, BC, Ep);
  load_tile(sm.v, sm.ldv, b.v + j0 * b.M, cols, b.M, BC, Mp);
}

// ---------------------------------------------------------------------------
// Host side.

inline void check_dims(const FullAttentionCudaParams& a, const char* what) {
  if (a.E < 1 || a.E > kFullAttentionCudaMaxHeadDim || a.M < 1 ||
      a.M > kFullAttentionCudaMaxHeadDim) {
    throw std::runtime_error(std::string("fastattn CUDA kernel ") + what +
                             ": head dims E and M must be in [1, " +
                             std::to_string(kFullAttentionCudaMaxHeadDim) +
                             "], got E = " + std::to_string(a.E) + ", M = " + std::to_string(a.M));
  }
}

inline void check_grid(int64_t blocks, const char* what) {
  if (blocks > 0x7fffffff) {
    throw std::runtime_error(std::string("fastattn CUDA kernel ") + what + ": too many blocks (" +
                             std::to_string(blocks) + ")");
  }
}

}  // namespace
}  // namespace fastattn::cuda
