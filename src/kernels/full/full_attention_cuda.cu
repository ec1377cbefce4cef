// Fused softmax attention on CUDA, FlashAttention-2 style (see
// full_attention_cuda.h for the arguments; the semantics are those of the CPU
// kernel in full_attention_cpu.cpp: additive mask with strides, key lengths,
// causal offset S - L, rows without a kept key give zeros and lse = -inf).
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
#include "kernels/full/full_attention_cuda.h"

#include <cstdint>
#include <type_traits>

#include "kernels/common/cuda_compat.cuh"

namespace fastattn::cuda {
namespace {

#if defined(__CUDACC__)
#define FULL_UNROLL _Pragma("unroll")
#else
#define FULL_UNROLL
#endif

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

__host__ __device__ __forceinline__ size_t align128(size_t x) {
  return (x + 127) & ~static_cast<size_t>(127);
}
__host__ __device__ __forceinline__ int round16(int64_t x) {
  return static_cast<int>((x + 15) / 16 * 16);
}

// Shared-memory layout of the forward block (byte offsets, leading dims in
// elements). Ep, Mp: head dims rounded up to 16.
struct FwdLayout {
  int ldq, ldk, ldv, lds, ldp, ldo;
  size_t q, k, v, s, p, o, m, l, total;
};
template <typename T>
__host__ __device__ FwdLayout fwd_layout(int Ep, int Mp) {
  using C = FullCfg<T, false>;
  FwdLayout y;
  y.ldq = y.ldk = Ep + C::kPadT;
  y.ldv = Mp + C::kPadT;
  y.lds = C::kFwdBc + C::kPadF;
  y.ldp = C::kFwdBc + C::kPadT;
  y.ldo = Mp + C::kPadF;
  size_t at = 0;
  y.q = at, at = align128(at + sizeof(T) * C::kFwdBr * y.ldq);
  y.k = at, at = align128(at + sizeof(T) * C::kFwdBc * y.ldk);
  y.v = at, at = align128(at + sizeof(T) * C::kFwdBc * y.ldv);
  y.s = at, at = align128(at + sizeof(float) * C::kFwdBr * y.lds);
  y.p = at, at = align128(at + sizeof(T) * C::kFwdBr * y.ldp);
  y.o = at, at = align128(at + sizeof(float) * C::kFwdBr * y.ldo);
  y.m = at, at = align128(at + sizeof(float) * C::kFwdBr);
  y.l = at, at = align128(at + sizeof(float) * C::kFwdBr);
  y.total = at;
  return y;
}

// Backward block: Q and dO of the query tile, K and V of the key tile, S/P
// and dP (float, sharing their space with the dQ tile), P and dS in the
// storage type, dK and dV accumulators (float), the tile's lse and delta.
struct BwdLayout {
  int ldq, ldk, ldv, lddo, ldsf, ldp, lde, ldm;
  size_t q, dout, k, v, s, dp, dq, p, ds, dk, dv, lse, delta, total;
};
template <typename T>
__host__ __device__ BwdLayout bwd_layout(int Ep, int Mp) {
  using C = FullCfg<T, false>;
  BwdLayout y;
  y.ldq = y.ldk = Ep + C::kPadT;
  y.ldv = y.lddo = Mp + C::kPadT;
  y.ldsf = C::kBwdBc + C::kPadF;
  y.ldp = C::kBwdBc + C::kPadT;
  y.lde = Ep + C::kPadF;  // dK and the dQ tile
  y.ldm = Mp + C::kPadF;  // dV
  size_t at = 0;
  y.q = at, at = align128(at + sizeof(T) * C::kBwdBr * y.ldq);
  y.dout = at, at = align128(at + sizeof(T) * C::kBwdBr * y.lddo);
  y.k = at, at = align128(at + sizeof(T) * C::kBwdBc * y.ldk);
  y.v = at, at = align128(at + sizeof(T) * C::kBwdBc * y.ldv);
  // S/P and dP, or (later in each step) the dQ tile.
  const size_t sdp = 2 * align128(sizeof(float) * C::kBwdBr * y.ldsf);
  const size_t dq = align128(sizeof(float) * C::kBwdBr * y.lde);
  y.s = at;
  y.dp = at + sdp / 2;
  y.dq = at;
  at += sdp > dq ? sdp : dq;
  y.p = at, at = align128(at + sizeof(T) * C::kBwdBr * y.ldp);
  y.ds = at, at = align128(at + sizeof(T) * C::kBwdBr * y.ldp);
  y.dk = at, at = align128(at + sizeof(float) * C::kBwdBc * y.lde);
  y.dv = at, at = align128(at + sizeof(float) * C::kBwdBc * y.ldm);
  y.lse = at, at = align128(at + sizeof(float) * C::kBwdBr);
  y.delta = at, at = align128(at + sizeof(float) * C::kBwdBr);
  y.total = at;
  return y;
}

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

template <typename T>
__global__ void __launch_bounds__(kThreads)
    full_forward_kernel(FullAttentionForwardCudaArgs a, int Ep, int Mp, int64_t q_tiles) {
  using C = FullCfg<T, false>;
  constexpr int BR = C::kFwdBr, BC = C::kFwdBc, PER_LANE = BC / 32;
  const FwdLayout lay = fwd_layout<T>(Ep, Mp);
  FA_DYNAMIC_SHARED(unsigned char, smem);
  T* Qs = reinterpret_cast<T*>(smem + lay.q);
  T* Ks = reinterpret_cast<T*>(smem + lay.k);
  T* Vs = reinterpret_cast<T*>(smem + lay.v);
  float* Sf = reinterpret_cast<float*>(smem + lay.s);
  T* Ps = reinterpret_cast<T*>(smem + lay.p);
  float* Of = reinterpret_cast<float*>(smem + lay.o);
  float* m_s = reinterpret_cast<float*>(smem + lay.m);
  float* l_s = reinterpret_cast<float*>(smem + lay.l);

  const int64_t L = a.L, S = a.S, E = a.E, M = a.M, H = a.H;
  const int64_t item = blockIdx.x;
  const int64_t nh = item / q_tiles, n = nh / H, h = nh % H;
  const int64_t i0 = (item % q_tiles) * BR;
  const int64_t offset = S - L;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const T* qh = static_cast<const T*>(a.q) + nh * L * E;
  const T* kh = static_cast<const T*>(a.k) + nh * S * E;
  const T* vh = static_cast<const T*>(a.v) + nh * S * M;
  const T* mask = static_cast<const T*>(a.mask);
  const T zero = from_float<T>(0.f);

  const int64_t rows = L - i0 < BR ? L - i0 : BR;
  load_tile(Qs, lay.ldq, qh + i0 * E, rows, E, BR, Ep);
  for (int idx = tid; idx < BR * Mp; idx += kThreads) Of[(idx / Mp) * lay.ldo + idx % Mp] = 0.f;
  for (int r = tid; r < BR; r += kThreads) {
    m_s[r] = -INFINITY;
    l_s[r] = 0.f;
  }
  int64_t kend = a.key_lengths ? a.key_lengths[n] : S;
  if (a.causal && i0 + rows + offset < kend) kend = i0 + rows + offset;
  if (kend < 0) kend = 0;

  for (int64_t j0 = 0; j0 < kend; j0 += BC) {
    const int64_t cols = kend - j0 < BC ? kend - j0 : BC;
    __syncthreads();  // the previous tile's K, V and P are no longer read
    load_tile(Ks, lay.ldk, kh + j0 * E, cols, E, BC, Ep);
    load_tile(Vs, lay.ldv, vh + j0 * M, cols, M, BC, Mp);
    __syncthreads();
    block_mm<T, false, true, false>(Sf, lay.lds, Qs, lay.ldq, Ks, lay.ldk, BR, BC, Ep, false);
    __syncthreads();
    // Online softmax, one warp per row.
    for (int r = warp; r < BR; r += kWarps) {
      const int64_t i = i0 + r;
      const float m_old = m_s[r], l_old = l_s[r];
      const T* mrow = mask ? mask + n * a.mask_sn + h * a.mask_sh + i * a.mask_sl + j0 : nullptr;
      float x[PER_LANE];
      float mx = -INFINITY;
      for (int u = 0; u < PER_LANE; ++u) {
        const int c = lane + 32 * u;
        const bool keep = i < L && c < cols && (!a.causal || j0 + c <= i + offset);
        float s = -INFINITY;
        if (keep) {
          s = Sf[r * lay.lds + c] * a.scale;
          if (mrow) s += to_float(mrow[c]);
        }
        x[u] = s;
        mx = fmaxf(mx, s);
      }
      mx = warp_max(mx);
      const float m_new = fmaxf(m_old, mx);
      if (m_new == -INFINITY) {  // nothing kept so far in this row
        for (int u = 0; u < PER_LANE; ++u) Ps[r * lay.ldp + lane + 32 * u] = zero;
        continue;
      }
      float sum = 0.f;
      for (int u = 0; u < PER_LANE; ++u) {
        const float p = expf(x[u] - m_new);
        Ps[r * lay.ldp + lane + 32 * u] = from_float<T>(p);
        sum += p;
      }
      sum = warp_sum(sum);
      const float alpha = expf(m_old - m_new);  // 0 when m_old is -inf
      if (lane == 0) {
        m_s[r] = m_new;
        l_s[r] = l_old * alpha + sum;
      }
      if (alpha != 1.f) {
        for (int c = lane; c < Mp; c += 32) Of[r * lay.ldo + c] *= alpha;
      }
    }
    __syncthreads();
    block_mm<T, false, false, false>(Of, lay.ldo, Ps, lay.ldp, Vs, lay.ldv, BR, Mp, BC, true);
  }
  __syncthreads();
  T* out = static_cast<T*>(a.out) + (nh * L + i0) * M;
  for (int idx = tid; idx < rows * M; idx += kThreads) {
    const int r = idx / M, c = idx % M;
    const float l = l_s[r];
    out[idx] = from_float<T>(l > 0.f ? Of[r * lay.ldo + c] / l : 0.f);
  }
  for (int r = tid; r < rows; r += kThreads) {
    const float l = l_s[r];
    a.lse[nh * L + i0 + r] = l > 0.f ? m_s[r] + logf(l) : -INFINITY;
  }
}

// Tensor-core forward (float16/bfloat16): each warp owns 16 query rows of the
// block's 64 and keeps its Q tile (as matrix_a fragments) and its output
// accumulator (float fragments) in registers for the whole key loop; only S
// and P pass through shared memory (the warp's own rows, so warp barriers
// suffice between the product and the softmax). The per-row rescaling of the
// accumulator fragments needs each element's row: an accumulator fragment
// loaded from a 16×16 tile holding its row indices gives it, whatever the
// fragment layout (every accumulator fragment of a shape shares one layout).
// DF: the fragments of E and M that fit (4: dims <= 64, 8: dims <= 128).
struct FwdTcLayout {
  int ldq, ldk, ldv, lds, ldp;
  size_t q, k, v, s, p, rows, m, l, alpha, total;
};
template <typename T>
__host__ __device__ FwdTcLayout fwd_tc_layout(int Ep, int Mp) {
  using C = FullCfg<T>;
  FwdTcLayout y;
  y.ldq = y.ldk = Ep + C::kPadT;
  y.ldv = Mp + C::kPadT;
  y.lds = C::kFwdBc + C::kPadF;
  y.ldp = C::kFwdBc + C::kPadT;
  size_t at = 0;
  y.q = at, at = align128(at + sizeof(T) * C::kFwdBr * y.ldq);
  y.k = at, at = align128(at + sizeof(T) * C::kFwdBc * y.ldk);
  y.v = at, at = align128(at + sizeof(T) * C::kFwdBc * y.ldv);
  y.s = at, at = align128(at + sizeof(float) * C::kFwdBr * y.lds);
  y.p = at, at = align128(at + sizeof(T) * C::kFwdBr * y.ldp);
  y.rows = at, at = align128(at + sizeof(float) * 256);
  y.m = at, at = align128(at + sizeof(float) * C::kFwdBr);
  y.l = at, at = align128(at + sizeof(float) * C::kFwdBr);
  y.alpha = at, at = align128(at + sizeof(float) * C::kFwdBr);
  y.total = at;
  return y;
}

template <typename T, int DF>
__device__ __forceinline__ void full_forward_tc(const FullAttentionForwardCudaArgs& a, int Ep,
                                                int Mp, int64_t q_tiles) {
  using C = FullCfg<T>;
  constexpr int BR = C::kFwdBr, BC = C::kFwdBc, HALF = BC / 2;
  static_assert(BR == 16 * kWarps, "one 16-row strip per warp");
  static_assert(HALF == 32, "two lanes per row of a 64-key tile");
  constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;
  const float scale2 = a.scale * kLog2e;
  using AccFrag = fa_wmma::fragment<fa_wmma::accumulator, 16, 16, 16, float>;
  using AFrag = fa_wmma::fragment<fa_wmma::matrix_a, 16, 16, 16, T, fa_wmma::row_major>;
  const FwdTcLayout lay = fwd_tc_layout<T>(Ep, Mp);
  FA_DYNAMIC_SHARED(unsigned char, smem);
  T* Qs = reinterpret_cast<T*>(smem + lay.q);
  T* Ks = reinterpret_cast<T*>(smem + lay.k);
  T* Vs = reinterpret_cast<T*>(smem + lay.v);
  float* Sf = reinterpret_cast<float*>(smem + lay.s);
  T* Ps = reinterpret_cast<T*>(smem + lay.p);
  float* row_ids = reinterpret_cast<float*>(smem + lay.rows);
  float* m_s = reinterpret_cast<float*>(smem + lay.m);
  float* l_s = reinterpret_cast<float*>(smem + lay.l);
  float* alpha_s = reinterpret_cast<float*>(smem + lay.alpha);

  const int64_t L = a.L, S = a.S, E = a.E, M = a.M, H = a.H;
  const int64_t item = blockIdx.x;
  const int64_t nh = item / q_tiles, n = nh / H, h = nh % H;
  const int64_t i0 = (item % q_tiles) * BR;
  const int64_t offset = S - L;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int r0 = 16 * warp;  // this warp's rows of the tile
  const int ef = Ep / 16, mf = Mp / 16;
  const T* qh = static_cast<const T*>(a.q) + nh * L * E;
  const T* kh = static_cast<const T*>(a.k) + nh * S * E;
  const T* vh = static_cast<const T*>(a.v) + nh * S * M;
  const T* mask = static_cast<const T*>(a.mask);

  const int64_t rows = L - i0 < BR ? L - i0 : BR;
  load_tile(Qs, lay.ldq, qh + i0 * E, rows, E, BR, Ep);
  for (int idx = tid; idx < 256; idx += kThreads) row_ids[idx] = static_cast<float>(idx / 16);
  for (int r = tid; r < BR; r += kThreads) {
    m_s[r] = -INFINITY;
    l_s[r] = 0.f;
  }
  __syncthreads();
  AFrag qf[DF];
  AccFrag of[DF];
  // row_of[e]: the row (0..15) of element e of any accumulator fragment.
  constexpr int NE = AccFrag::num_elements;
  int row_of[NE];
  {
    AccFrag rowf;
    fa_wmma::load_matrix_sync(rowf, row_ids, 16, fa_wmma::mem_row_major);
    for (int e = 0; e < NE; ++e) row_of[e] = r0 + static_cast<int>(rowf.x[e]);
  }
  FULL_UNROLL
  for (int f = 0; f < DF; ++f) {
    if (f < ef) fa_wmma::load_matrix_sync(qf[f], Qs + r0 * lay.ldq + 16 * f, lay.ldq);
    fa_wmma::fill_fragment(of[f], 0.f);
  }
  int64_t kend = a.key_lengths ? a.key_lengths[n] : S;
  if (a.causal && i0 + rows + offset < kend) kend = i0 + rows + offset;
  if (kend < 0) kend = 0;
  float* Sw = Sf + r0 * lay.lds;  // the warp's strips of S and P
  T* Pw = Ps + r0 * lay.ldp;

  for (int64_t j0 = 0; j0 < kend; j0 += BC) {
    const int64_t cols = kend - j0 < BC ? kend - j0 : BC;
    __syncthreads();  // the previous tile's K and V are no longer read
    load_tile(Ks, lay.ldk, kh + j0 * E, cols, E, BC, Ep);
    load_tile(Vs, lay.ldv, vh + j0 * M, cols, M, BC, Mp);
    __syncthreads();
    // S strip (16 × BC) = Q strip · K^T
    FULL_UNROLL
    for (int c = 0; c < BC / 16; ++c) {
      AccFrag acc;
      fa_wmma::fill_fragment(acc, 0.f);
      FULL_UNROLL
      for (int f = 0; f < DF; ++f) {
        if (f < ef) {
          fa_wmma::fragment<fa_wmma::matrix_b, 16, 16, 16, T, fa_wmma::col_major> kb;
          fa_wmma::load_matrix_sync(kb, Ks + 16 * c * lay.ldk + 16 * f, lay.ldk);
          fa_wmma::mma_sync(acc, qf[f], kb, acc);
        }
      }
      fa_wmma::store_matrix_sync(Sw + 16 * c, acc, lay.lds, fa_wmma::mem_row_major);
    }
    __syncwarp();
    // Online softmax of the warp's rows in base 2 (m_s holds max·log2 e): two
    // lanes per row, 32 columns each, visited in a per-lane rotation so the 32
    // lanes read 32 different banks. `rescale` (the same in every lane) when
    // some row's running max moved.
    bool rescale;
    {
      const int rr = lane >> 1, hh = lane & 1;
      const int r = r0 + rr;
      const int64_t i = i0 + r;
      const float m_old = m_s[r], l_old = l_s[r];
      int64_t limit = i < L ? cols : 0;  // kept columns of this row: c < limit
      if (a.causal && i + offset - j0 + 1 < limit) limit = i + offset - j0 + 1;
      const T* mrow =
          mask && i < L ? mask + n * a.mask_sn + h * a.mask_sh + i * a.mask_sl + j0 : nullptr;
      const int rot = 2 * (rr >> 3) + hh;
      float x[HALF];
      float mx = -INFINITY;
      FULL_UNROLL
      for (int u = 0; u < HALF; ++u) {
        const int c = hh * HALF + ((u + rot) & (HALF - 1));
        float s = -INFINITY;
        if (c < limit) {
          s = Sw[rr * lay.lds + c] * scale2;
          if (mrow) s += to_float(mrow[c]) * kLog2e;
        }
        x[u] = s;
        mx = fmaxf(mx, s);
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      const float m_new = fmaxf(m_old, mx);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;  // rows with nothing kept: p = 0
      float sum = 0.f;
      FULL_UNROLL
      for (int u = 0; u < HALF; ++u) {
        const float p = exp2f(x[u] - m_use);
        Pw[rr * lay.ldp + hh * HALF + ((u + rot) & (HALF - 1))] = from_float<T>(p);
        sum += p;
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      const float alpha = m_new == -INFINITY ? 1.f : exp2f(m_old - m_new);  // 0 if m_old = -inf
      if (hh == 0) {
        m_s[r] = m_new;
        l_s[r] = l_old * alpha + sum;
        alpha_s[r] = alpha;
      }
      rescale = __any_sync(0xffffffffu, alpha != 1.f);
    }
    __syncwarp();
    // O strip = O strip · diag(alpha) + P strip · V
    if (rescale) {
      FULL_UNROLL
      for (int f = 0; f < DF; ++f) {
        for (int e = 0; e < NE; ++e) of[f].x[e] *= alpha_s[row_of[e]];
      }
    }
    FULL_UNROLL
    for (int c = 0; c < BC / 16; ++c) {
      AFrag pa;
      fa_wmma::load_matrix_sync(pa, Pw + 16 * c, lay.ldp);
      FULL_UNROLL
      for (int f = 0; f < DF; ++f) {
        if (f < mf) {
          fa_wmma::fragment<fa_wmma::matrix_b, 16, 16, 16, T, fa_wmma::row_major> vb;
          fa_wmma::load_matrix_sync(vb, Vs + 16 * c * lay.ldv + 16 * f, lay.ldv);
          fa_wmma::mma_sync(of[f], pa, vb, of[f]);
        }
      }
    }
  }
  // out = O / l (0 for rows without keys), through the warp's S strip.
  __syncwarp();
  if (lane < 16) {
    const float l = l_s[r0 + lane];
    alpha_s[r0 + lane] = l > 0.f ? 1.f / l : 0.f;
  }
  __syncwarp();
  T* out = static_cast<T*>(a.out) + (nh * L + i0 + r0) * M;
  const int64_t my_rows = rows - r0;  // may be <= 0
  FULL_UNROLL
  for (int f = 0; f < DF; ++f) {
    if (f < mf) {
      for (int e = 0; e < NE; ++e) of[f].x[e] *= alpha_s[row_of[e]];
      fa_wmma::store_matrix_sync(Sw, of[f], lay.lds, fa_wmma::mem_row_major);
      __syncwarp();
      for (int idx = lane; idx < 256; idx += 32) {
        const int rr = idx / 16, c = 16 * f + idx % 16;
        if (rr < my_rows && c < M) out[rr * M + c] = from_float<T>(Sw[rr * lay.lds + idx % 16]);
      }
      __syncwarp();
    }
  }
  if (lane < 16 && lane < my_rows) {
    const float l = l_s[r0 + lane];
    a.lse[nh * L + i0 + r0 + lane] = l > 0.f ? m_s[r0 + lane] * kLn2 + logf(l) : -INFINITY;
  }
}

// The kernel: the body only where T has tensor cores (see cuda_compat.cuh).
// Head dims <= 64 (DF = 4): at most 128 registers a thread, so that 4 blocks
// fit an SM's registers as they fit its shared memory (56 KiB each). On an
// H200, unbounded, bfloat16 took 161 registers (3 blocks/SM) against
// float16's 118 (4 blocks) and ran well behind it (measured: git show
// 5f604de:docs/benchmarks.md, "CUDA operators").
template <typename T, int DF>
__global__ void __launch_bounds__(kThreads, DF == 4 ? 4 : 1)
    full_forward_tc_kernel(FullAttentionForwardCudaArgs a, int Ep, int Mp, int64_t q_tiles) {
  if constexpr (wmma_compiled<T>()) {
    full_forward_tc<T, DF>(a, Ep, Mp, q_tiles);
  } else {
    FA_TRAP();
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    full_backward_kernel(FullAttentionBackwardCudaArgs a, int Ep, int Mp, int64_t k_tiles) {
  using C = FullCfg<T, false>;
  constexpr int BR = C::kBwdBr, BC = C::kBwdBc;
  const BwdLayout lay = bwd_layout<T>(Ep, Mp);
  FA_DYNAMIC_SHARED(unsigned char, smem);
  T* Qs = reinterpret_cast<T*>(smem + lay.q);
  T* dOs = reinterpret_cast<T*>(smem + lay.dout);
  T* Ks = reinterpret_cast<T*>(smem + lay.k);
  T* Vs = reinterpret_cast<T*>(smem + lay.v);
  float* Sf = reinterpret_cast<float*>(smem + lay.s);
  float* dPf = reinterpret_cast<float*>(smem + lay.dp);
  float* dQf = reinterpret_cast<float*>(smem + lay.dq);
  T* Ps = reinterpret_cast<T*>(smem + lay.p);
  T* dSs = reinterpret_cast<T*>(smem + lay.ds);
  float* dKf = reinterpret_cast<float*>(smem + lay.dk);
  float* dVf = reinterpret_cast<float*>(smem + lay.dv);
  float* lse_s = reinterpret_cast<float*>(smem + lay.lse);
  float* delta_s = reinterpret_cast<float*>(smem + lay.delta);

  const int64_t L = a.L, S = a.S, E = a.E, M = a.M, H = a.H;
  const int64_t item = blockIdx.x;
  const int64_t nh = item / k_tiles, n = nh / H, h = nh % H;
  const int64_t j0 = (item % k_tiles) * BC;
  const int64_t offset = S - L;
  const int tid = threadIdx.x;
  const int64_t rows_k = S - j0 < BC ? S - j0 : BC;  // this block's rows of dK, dV
  const int64_t len = a.key_lengths ? a.key_lengths[n] : S;
  T* gk = static_cast<T*>(a.grad_k) + (nh * S + j0) * E;
  T* gv = static_cast<T*>(a.grad_v) + (nh * S + j0) * M;
  const int64_t cols = len - j0 < BC ? (len - j0 > 0 ? len - j0 : 0) : BC;  // kept keys here

  if (cols > 0) {
    const T* qh = static_cast<const T*>(a.q) + nh * L * E;
    const T* doh = static_cast<const T*>(a.grad_out) + nh * L * M;
    const T* mask = static_cast<const T*>(a.mask);
    load_tile(Ks, lay.ldk, static_cast<const T*>(a.k) + (nh * S + j0) * E, cols, E, BC, Ep);
    load_tile(Vs, lay.ldv, static_cast<const T*>(a.v) + (nh * S + j0) * M, cols, M, BC, Mp);
    for (int idx = tid; idx < BC * Ep; idx += kThreads) dKf[(idx / Ep) * lay.lde + idx % Ep] = 0.f;
    for (int idx = tid; idx < BC * Mp; idx += kThreads) dVf[(idx / Mp) * lay.ldm + idx % Mp] = 0.f;
    // Queries that may see this tile: i >= j0 - offset when causal.
    int64_t i_start = a.causal && j0 - offset > 0 ? j0 - offset : 0;
    i_start = i_start / BR * BR;
    for (int64_t i0 = i_start; i0 < L; i0 += BR) {
      const int64_t rows = L - i0 < BR ? L - i0 : BR;
      __syncthreads();  // the previous step's tiles are no longer read
      load_tile(Qs, lay.ldq, qh + i0 * E, rows, E, BR, Ep);
      load_tile(dOs, lay.lddo, doh + i0 * M, rows, M, BR, Mp);
      for (int r = tid; r < BR; r += kThreads) {
        lse_s[r] = r < rows ? a.lse[nh * L + i0 + r] : -INFINITY;
        delta_s[r] = r < rows ? a.delta[nh * L + i0 + r] : 0.f;
      }
      __syncthreads();
      block_mm<T, false, true, false>(Sf, lay.ldsf, Qs, lay.ldq, Ks, lay.ldk, BR, BC, Ep, false);
      __syncthreads();
      // P = exp(S·scale + mask - lse), zero where dropped.
      for (int idx = tid; idx < BR * BC; idx += kThreads) {
        const int r = idx / BC, c = idx % BC;
        const int64_t i = i0 + r, j = j0 + c;
        const float lse = lse_s[r];
        float p = 0.f;
        if (r < rows && c < cols && (!a.causal || j <= i + offset) && lse != -INFINITY) {
          float s = Sf[r * lay.ldsf + c] * a.scale;
          if (mask) s += to_float(mask[n * a.mask_sn + h * a.mask_sh + i * a.mask_sl + j]);
          p = expf(s - lse);
        }
        Sf[r * lay.ldsf + c] = p;
        Ps[r * lay.ldp + c] = from_float<T>(p);
      }
      __syncthreads();
      // dV += P^T dO ; dP = dO V^T
      block_mm<T, true, false, false>(dVf, lay.ldm, Ps, lay.ldp, dOs, lay.lddo, BC, Mp, BR, true);
      block_mm<T, false, true, false>(dPf, lay.ldsf, dOs, lay.lddo, Vs, lay.ldv, BR, BC, Mp, false);
      __syncthreads();
      // dS = P ∘ (dP - delta) · scale
      for (int idx = tid; idx < BR * BC; idx += kThreads) {
        const int r = idx / BC, c = idx % BC;
        const float ds = Sf[r * lay.ldsf + c] * (dPf[r * lay.ldsf + c] - delta_s[r]) * a.scale;
        dSs[r * lay.ldp + c] = from_float<T>(ds);
      }
      __syncthreads();
      // dK += dS^T Q ; dQ tile = dS K (over S and dP, no longer read)
      block_mm<T, true, false, false>(dKf, lay.lde, dSs, lay.ldp, Qs, lay.ldq, BC, Ep, BR, true);
      block_mm<T, false, false, false>(dQf, lay.lde, dSs, lay.ldp, Ks, lay.ldk, BR, Ep, BC, false);
      __syncthreads();
      float* ws = a.dq_workspace + (nh * L + i0) * E;
      for (int idx = tid; idx < rows * E; idx += kThreads) {
        const int r = idx / E, c = idx % E;
        atomicAdd(ws + idx, dQf[r * lay.lde + c]);
      }
    }
    __syncthreads();
  }
  // Keys at or beyond the key length get zero gradients.
  for (int idx = tid; idx < rows_k * E; idx += kThreads) {
    const int r = idx / E, c = idx % E;
    const float g = r < cols ? dKf[r * lay.lde + c] : 0.f;
    gk[idx] = from_float<T>(a.accumulate ? to_float(gk[idx]) + g : g);
  }
  for (int idx = tid; idx < rows_k * M; idx += kThreads) {
    const int r = idx / M, c = idx % M;
    const float g = r < cols ? dVf[r * lay.ldm + c] : 0.f;
    gv[idx] = from_float<T>(a.accumulate ? to_float(gv[idx]) + g : g);
  }
}

// Tensor-core backward (float16/bfloat16): one block per (64 keys, n·h); each
// warp owns 16 of the keys and keeps their dK and dV rows in accumulator
// fragments for the whole loop over query tiles (64 queries). Per tile, the
// warp forms the transposed strips S^T = K_w·Q^T, P^T (from lse, through its
// strip of shared memory), dV_w += P^T·dO, dP^T = V_w·dO^T,
// dS^T = P^T∘(dP^T - delta)·scale, dK_w += dS^T·Q; then the block forms
// dQ = dS·K from every warp's dS^T strip and adds it to the float32
// workspace with atomicAdd.

struct BwdTcLayout {
  int ldq, ldk, ldv, lddo, ldst, ldpt, lde;
  size_t q, dout, k, v, st, dpt, dq, pt, dst, lse, delta, total;
};
template <typename T>
__host__ __device__ BwdTcLayout bwd_tc_layout(int Ep, int Mp) {
  using C = FullCfg<T>;
  constexpr int BR = C::kBwdBr, BC = C::kBwdBc;
  BwdTcLayout y;
  y.ldq = y.ldk = Ep + C::kPadT;
  y.ldv = y.lddo = Mp + C::kPadT;
  y.ldst = BR + C::kPadF;
  y.ldpt = BR + C::kPadT;
  y.lde = Ep + C::kPadF;
  size_t at = 0;
  y.q = at, at = align128(at + sizeof(T) * BR * y.ldq);
  y.dout = at, at = align128(at + sizeof(T) * BR * y.lddo);
  y.k = at, at = align128(at + sizeof(T) * BC * y.ldk);
  y.v = at, at = align128(at + sizeof(T) * BC * y.ldv);
  // S^T/P^T and dP^T (float), or (later in each step) the dQ tile.
  const size_t half = align128(sizeof(float) * BC * y.ldst);
  const size_t dq = align128(sizeof(float) * BR * y.lde);
  y.st = at;
  y.dpt = at + half;
  y.dq = at;
  at += 2 * half > dq ? 2 * half : dq;
  y.pt = at, at = align128(at + sizeof(T) * BC * y.ldpt);
  y.dst = at, at = align128(at + sizeof(T) * BC * y.ldpt);
  y.lse = at, at = align128(at + sizeof(float) * BR);
  y.delta = at, at = align128(at + sizeof(float) * BR);
  y.total = at;
  return y;
}

template <typename T, int DF>
__device__ __forceinline__ void full_backward_tc(const FullAttentionBackwardCudaArgs& a, int Ep,
                                                 int Mp, int64_t k_tiles) {
  using C = FullCfg<T>;
  constexpr int BR = C::kBwdBr, BC = C::kBwdBc;
  static_assert(BC == 16 * kWarps, "one 16-key strip per warp");
  constexpr float kLog2e = 1.4426950408889634f;
  const float scale2 = a.scale * kLog2e;
  using AccFrag = fa_wmma::fragment<fa_wmma::accumulator, 16, 16, 16, float>;
  using ARow = fa_wmma::fragment<fa_wmma::matrix_a, 16, 16, 16, T, fa_wmma::row_major>;
  using BRow = fa_wmma::fragment<fa_wmma::matrix_b, 16, 16, 16, T, fa_wmma::row_major>;
  using BCol = fa_wmma::fragment<fa_wmma::matrix_b, 16, 16, 16, T, fa_wmma::col_major>;
  const BwdTcLayout lay = bwd_tc_layout<T>(Ep, Mp);
  FA_DYNAMIC_SHARED(unsigned char, smem);
  T* Qs = reinterpret_cast<T*>(smem + lay.q);
  T* dOs = reinterpret_cast<T*>(smem + lay.dout);
  T* Ks = reinterpret_cast<T*>(smem + lay.k);
  T* Vs = reinterpret_cast<T*>(smem + lay.v);
  float* St = reinterpret_cast<float*>(smem + lay.st);
  float* dPt = reinterpret_cast<float*>(smem + lay.dpt);
  float* dQf = reinterpret_cast<float*>(smem + lay.dq);
  T* Pt = reinterpret_cast<T*>(smem + lay.pt);
  T* dSt = reinterpret_cast<T*>(smem + lay.dst);
  float* lse_s = reinterpret_cast<float*>(smem + lay.lse);
  float* delta_s = reinterpret_cast<float*>(smem + lay.delta);

  const int64_t L = a.L, S = a.S, E = a.E, M = a.M, H = a.H;
  const int64_t item = blockIdx.x;
  const int64_t nh = item / k_tiles, n = nh / H, h = nh % H;
  const int64_t j0 = (item % k_tiles) * BC;
  const int64_t offset = S - L;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int k0 = 16 * warp;  // this warp's keys within the tile
  const int ef = Ep / 16, mf = Mp / 16;
  const int64_t rows_k = S - j0 < BC ? S - j0 : BC;
  const int64_t len = a.key_lengths ? a.key_lengths[n] : S;
  const int64_t cols = len - j0 < BC ? (len - j0 > 0 ? len - j0 : 0) : BC;  // kept keys here
  T* gk = static_cast<T*>(a.grad_k) + (nh * S + j0) * E;
  T* gv = static_cast<T*>(a.grad_v) + (nh * S + j0) * M;
  if (cols == 0) {  // no kept key in this tile: zero gradients
    for (int idx = tid; idx < rows_k * E; idx += kThreads) {
      if (!a.accumulate) gk[idx] = from_float<T>(0.f);
    }
    for (int idx = tid; idx < rows_k * M; idx += kThreads) {
      if (!a.accumulate) gv[idx] = from_float<T>(0.f);
    }
    return;
  }
  const T* qh = static_cast<const T*>(a.q) + nh * L * E;
  const T* doh = static_cast<const T*>(a.grad_out) + nh * L * M;
  const T* mask = static_cast<const T*>(a.mask);
  load_tile(Ks, lay.ldk, static_cast<const T*>(a.k) + (nh * S + j0) * E, cols, E, BC, Ep);
  load_tile(Vs, lay.ldv, static_cast<const T*>(a.v) + (nh * S + j0) * M, cols, M, BC, Mp);
  AccFrag dk[DF], dv[DF];
  FULL_UNROLL
  for (int f = 0; f < DF; ++f) {
    fa_wmma::fill_fragment(dk[f], 0.f);
    fa_wmma::fill_fragment(dv[f], 0.f);
  }
  float* Stw = St + k0 * lay.ldst;  // the warp's strips
  float* dPtw = dPt + k0 * lay.ldst;
  T* Ptw = Pt + k0 * lay.ldpt;
  T* dStw = dSt + k0 * lay.ldpt;
  // Queries that may see this tile: i >= j0 - offset when causal.
  int64_t i_start = a.causal && j0 - offset > 0 ? j0 - offset : 0;
  i_start = i_start / BR * BR;
  for (int64_t i0 = i_start; i0 < L; i0 += BR) {
    const int64_t rows = L - i0 < BR ? L - i0 : BR;
    __syncthreads();  // the previous step's tiles (and the dQ tile) are no longer read
    load_tile(Qs, lay.ldq, qh + i0 * E, rows, E, BR, Ep);
    load_tile(dOs, lay.lddo, doh + i0 * M, rows, M, BR, Mp);
    for (int r = tid; r < BR; r += kThreads) {
      lse_s[r] = r < rows ? a.lse[nh * L + i0 + r] * kLog2e : -INFINITY;  // base 2
      delta_s[r] = r < rows ? a.delta[nh * L + i0 + r] : 0.f;
    }
    __syncthreads();
    // S^T strip (16 × BR) = K_w · Q^T ; dP^T strip = V_w · dO^T
    FULL_UNROLL
    for (int c = 0; c < BR / 16; ++c) {
      AccFrag acc;
      fa_wmma::fill_fragment(acc, 0.f);
      FULL_UNROLL
      for (int f = 0; f < DF; ++f) {
        if (f < ef) {
          ARow ka;
          BCol qb;
          fa_wmma::load_matrix_sync(ka, Ks + k0 * lay.ldk + 16 * f, lay.ldk);
          fa_wmma::load_matrix_sync(qb, Qs + 16 * c * lay.ldq + 16 * f, lay.ldq);
          fa_wmma::mma_sync(acc, ka, qb, acc);
        }
      }
      fa_wmma::store_matrix_sync(Stw + 16 * c, acc, lay.ldst, fa_wmma::mem_row_major);
      fa_wmma::fill_fragment(acc, 0.f);
      FULL_UNROLL
      for (int f = 0; f < DF; ++f) {
        if (f < mf) {
          ARow va;
          BCol dob;
          fa_wmma::load_matrix_sync(va, Vs + k0 * lay.ldv + 16 * f, lay.ldv);
          fa_wmma::load_matrix_sync(dob, dOs + 16 * c * lay.lddo + 16 * f, lay.lddo);
          fa_wmma::mma_sync(acc, va, dob, acc);
        }
      }
      fa_wmma::store_matrix_sync(dPtw + 16 * c, acc, lay.ldst, fa_wmma::mem_row_major);
    }
    __syncwarp();
    // P^T = exp(S^T·scale + mask^T - lse) (0 where dropped), dS^T = P^T∘(dP^T - delta)·scale
    for (int idx = lane; idx < 16 * BR; idx += 32) {
      const int rr = idx / BR, c = idx % BR;
      const int64_t j = j0 + k0 + rr, i = i0 + c;
      const float lse = lse_s[c];
      float p = 0.f;
      if (k0 + rr < cols && c < rows && (!a.causal || j <= i + offset) && lse != -INFINITY) {
        float s = Stw[rr * lay.ldst + c] * scale2;
        if (mask) s += to_float(mask[n * a.mask_sn + h * a.mask_sh + i * a.mask_sl + j]) * kLog2e;
        p = exp2f(s - lse);
      }
      Ptw[rr * lay.ldpt + c] = from_float<T>(p);
      dStw[rr * lay.ldpt + c] = from_float<T>(p * (dPtw[rr * lay.ldst + c] - delta_s[c]) * a.scale);
    }
    __syncwarp();
    // dV_w += P^T · dO ; dK_w += dS^T · Q
    FULL_UNROLL
    for (int c = 0; c < BR / 16; ++c) {
      ARow pa, dsa;
      fa_wmma::load_matrix_sync(pa, Ptw + 16 * c, lay.ldpt);
      fa_wmma::load_matrix_sync(dsa, dStw + 16 * c, lay.ldpt);
      FULL_UNROLL
      for (int f = 0; f < DF; ++f) {
        if (f < mf) {
          BRow dob;
          fa_wmma::load_matrix_sync(dob, dOs + 16 * c * lay.lddo + 16 * f, lay.lddo);
          fa_wmma::mma_sync(dv[f], pa, dob, dv[f]);
        }
        if (f < ef) {
          BRow qb;
          fa_wmma::load_matrix_sync(qb, Qs + 16 * c * lay.ldq + 16 * f, lay.ldq);
          fa_wmma::mma_sync(dk[f], dsa, qb, dk[f]);
        }
      }
    }
    __syncthreads();  // every dS^T strip written; S^T and dP^T no longer read
    // dQ tile (BR × Ep) = dS · K, dS = (dS^T)^T read column-major.
    block_mm<T, true, false, true>(dQf, lay.lde, dSt, lay.ldpt, Ks, lay.ldk, BR, Ep, BC, false);
    __syncthreads();
    float* ws = a.dq_workspace + (nh * L + i0) * E;
    for (int idx = tid; idx < rows * E; idx += kThreads) {
      const int r = idx / E, c = idx % E;
      atomicAdd(ws + idx, dQf[r * lay.lde + c]);
    }
  }
  __syncthreads();  // the dQ tile is no longer read: the strips stage dK and dV
  // dK, dV rows of the warp's keys (zero beyond the key length).
  const int64_t my_rows = rows_k - k0;  // may be <= 0
  FULL_UNROLL
  for (int f = 0; f < DF; ++f) {
    for (int which = 0; which < 2; ++which) {
      const bool is_k = which == 0;
      if (f >= (is_k ? ef : mf)) continue;
      fa_wmma::store_matrix_sync(Stw, is_k ? dk[f] : dv[f], lay.ldst, fa_wmma::mem_row_major);
      __syncwarp();
      const int64_t D = is_k ? E : M;
      T* g = is_k ? gk : gv;
      for (int idx = lane; idx < 256; idx += 32) {
        const int rr = idx / 16, c = 16 * f + idx % 16;
        if (rr < my_rows && c < D) {
          const float x = k0 + rr < cols ? Stw[rr * lay.ldst + idx % 16] : 0.f;
          T* dst = g + (k0 + rr) * D + c;
          *dst = from_float<T>(a.accumulate ? to_float(*dst) + x : x);
        }
      }
      __syncwarp();
    }
  }
}

template <typename T, int DF>
__global__ void __launch_bounds__(kThreads)
    full_backward_tc_kernel(FullAttentionBackwardCudaArgs a, int Ep, int Mp, int64_t k_tiles) {
  if constexpr (wmma_compiled<T>()) {
    full_backward_tc<T, DF>(a, Ep, Mp, k_tiles);
  } else {
    FA_TRAP();
  }
}

// ws = accumulate ? grad_q : 0 (before the backward kernel).
template <typename T>
__global__ void dq_init_kernel(float* ws, const T* gq, int64_t count, bool accumulate) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    ws[i] = accumulate ? to_float(gq[i]) : 0.f;
  }
}

// grad_q = ws in the storage dtype (after it).
template <typename T>
__global__ void dq_store_kernel(T* gq, const float* ws, int64_t count) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    gq[i] = from_float<T>(ws[i]);
  }
}

void check_dims(const FullAttentionCudaParams& a, const char* what) {
  if (a.E < 1 || a.E > kFullAttentionCudaMaxHeadDim || a.M < 1 ||
      a.M > kFullAttentionCudaMaxHeadDim) {
    throw std::runtime_error(std::string("fastattn CUDA kernel ") + what +
                             ": head dims E and M must be in [1, " +
                             std::to_string(kFullAttentionCudaMaxHeadDim) +
                             "], got E = " + std::to_string(a.E) + ", M = " + std::to_string(a.M));
  }
}

void check_grid(int64_t blocks, const char* what) {
  if (blocks > 0x7fffffff) {
    throw std::runtime_error(std::string("fastattn CUDA kernel ") + what + ": too many blocks (" +
                             std::to_string(blocks) + ")");
  }
}

dim3 elementwise_grid(int64_t count) {
  const int64_t blocks = ceil_div(count, 256);
  return dim3(static_cast<unsigned>(blocks < 4096 ? blocks : 4096));
}

// The forward kernel for T: tensor cores for the half types (fragment arrays
// sized for dims <= 64 or <= 128) where the device's code has them, else the
// SIMT kernel (float32; bfloat16 before sm_80).
template <typename T>
void launch_forward(const FullAttentionForwardCudaArgs& a, cudaStream_t stream) {
  const int Ep = round16(a.E), Mp = round16(a.M);
  const int64_t q_tiles = ceil_div(a.L, FullCfg<T>::kFwdBr);
  check_grid(a.N * a.H * q_tiles, "full_attention_forward");
  const dim3 grid(static_cast<unsigned>(a.N * a.H * q_tiles));
  if constexpr (FullCfg<T>::kTensorCores) {
    if (FA_USE_TENSOR_CORES(T, "full_attention_forward", full_forward_tc_kernel<T, 4>)) {
      const size_t bytes = fwd_tc_layout<T>(Ep, Mp).total;
      if (Ep <= 64 && Mp <= 64) {
        FA_SET_MAX_DYNAMIC_SHARED(bytes, full_forward_tc_kernel<T, 4>);
        FA_LAUNCH(grid, dim3(kThreads), bytes, stream, full_forward_tc_kernel<T, 4>)
        (a, Ep, Mp, q_tiles);
      } else {
        FA_SET_MAX_DYNAMIC_SHARED(bytes, full_forward_tc_kernel<T, 8>);
        FA_LAUNCH(grid, dim3(kThreads), bytes, stream, full_forward_tc_kernel<T, 8>)
        (a, Ep, Mp, q_tiles);
      }
      FA_CHECK_LAUNCH("full_attention_forward");
      return;
    }
  }
  if constexpr (!wmma_always<T>()) {
    const size_t bytes = fwd_layout<T>(Ep, Mp).total;
    FA_SET_MAX_DYNAMIC_SHARED(bytes, full_forward_kernel<T>);
    FA_LAUNCH(grid, dim3(kThreads), bytes, stream, full_forward_kernel<T>)(a, Ep, Mp, q_tiles);
    FA_CHECK_LAUNCH("full_attention_forward");
  }
}

// The backward's main kernel for T (tensor cores for the half types where
// the device's code has them, else SIMT).
template <typename T>
void launch_backward_main(const FullAttentionBackwardCudaArgs& a, cudaStream_t stream) {
  const int Ep = round16(a.E), Mp = round16(a.M);
  const dim3 block(kThreads);
  if constexpr (FullCfg<T>::kTensorCores) {
    if (FA_USE_TENSOR_CORES(T, "full_attention_backward", full_backward_tc_kernel<T, 4>)) {
      const int64_t k_tiles = ceil_div(a.S, FullCfg<T>::kBwdBc);
      check_grid(a.N * a.H * k_tiles, "full_attention_backward");
      const dim3 grid(static_cast<unsigned>(a.N * a.H * k_tiles));
      const size_t bytes = bwd_tc_layout<T>(Ep, Mp).total;
      if (Ep <= 64 && Mp <= 64) {
        FA_SET_MAX_DYNAMIC_SHARED(bytes, full_backward_tc_kernel<T, 4>);
        FA_LAUNCH(grid, block, bytes, stream, full_backward_tc_kernel<T, 4>)(a, Ep, Mp, k_tiles);
      } else {
        FA_SET_MAX_DYNAMIC_SHARED(bytes, full_backward_tc_kernel<T, 8>);
        FA_LAUNCH(grid, block, bytes, stream, full_backward_tc_kernel<T, 8>)(a, Ep, Mp, k_tiles);
      }
      FA_CHECK_LAUNCH("full_attention_backward");
      return;
    }
  }
  if constexpr (!wmma_always<T>()) {
    const int64_t k_tiles = ceil_div(a.S, FullCfg<T, false>::kBwdBc);
    check_grid(a.N * a.H * k_tiles, "full_attention_backward");
    const dim3 grid(static_cast<unsigned>(a.N * a.H * k_tiles));
    const size_t bytes = bwd_layout<T>(Ep, Mp).total;
    FA_SET_MAX_DYNAMIC_SHARED(bytes, full_backward_kernel<T>);
    FA_LAUNCH(grid, block, bytes, stream, full_backward_kernel<T>)(a, Ep, Mp, k_tiles);
    FA_CHECK_LAUNCH("full_attention_backward");
  }
}

}  // namespace

void full_attention_forward_cuda(const FullAttentionForwardCudaArgs& a, cudaStream_t stream) {
  if (a.N * a.H == 0 || a.L == 0) return;
  check_dims(a, "full_attention_forward");
  FA_DISPATCH_FLOAT_TYPES(a.dtype, "full_attention_forward",
                          [&] { launch_forward<scalar_t>(a, stream); });
}

void full_attention_backward_cuda(const FullAttentionBackwardCudaArgs& a, cudaStream_t stream) {
  const int64_t NH = a.N * a.H;
  if (NH == 0) return;
  check_dims(a, "full_attention_backward");
  FA_DISPATCH_FLOAT_TYPES(a.dtype, "full_attention_backward", [&] {
    const int64_t dq_count = NH * a.L * a.E;
    if (dq_count > 0) {
      FA_LAUNCH(elementwise_grid(dq_count), dim3(256), 0, stream, dq_init_kernel<scalar_t>)
      (a.dq_workspace, static_cast<const scalar_t*>(a.grad_q), dq_count, a.accumulate);
      FA_CHECK_LAUNCH("full_attention_backward (dQ init)");
    }
    if (a.S > 0) launch_backward_main<scalar_t>(a, stream);
    if (dq_count > 0) {
      FA_LAUNCH(elementwise_grid(dq_count), dim3(256), 0, stream, dq_store_kernel<scalar_t>)
      (static_cast<scalar_t*>(a.grad_q), a.dq_workspace, dq_count);
      FA_CHECK_LAUNCH("full_attention_backward (dQ store)");
    }
  });
}

}  // namespace fastattn::cuda
