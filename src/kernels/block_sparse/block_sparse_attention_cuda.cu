// CUDA kernels of block-sparse softmax attention (see block_sparse_attention_cuda.h
// and, for the parts, orders and ranges, block_sparse_attention.h).
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
#include "kernels/block_sparse/block_sparse_attention_cuda.h"

#include "kernels/common/cuda_compat.cuh"

// Full unrolling of the loops over a thread's rows and register chunks keeps
// those arrays in registers (nvcc); the emulator's compiler needs no hint.
#if defined(__CUDACC__)
#define FA_BS_UNROLL _Pragma("unroll")
#else
#define FA_BS_UNROLL
#endif

#include <type_traits>

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

// Kept ordered keys of one query: [a, b] minus [x, y].
struct RowRange {
  int64_t a, b, x, y;
};

__device__ __forceinline__ bool in_range(const RowRange& r, int64_t jo) {
  return jo >= r.a && jo <= r.b && !(jo >= r.x && jo <= r.y);
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

__device__ __forceinline__ bool keep_mask(const BlockSparseCudaParams& a, int64_t n, int64_t h,
                                          int64_t qi, int64_t ko) {
  return a.keep == nullptr || a.keep[n * a.keep_sn + h * a.keep_sh + qi * a.keep_sl + ko];
}

// Copies `rows` rows of D elements (row r from src row index idx[r], -1: zeros)
// into dst with row stride ld, as floats. The whole block takes part.
template <typename T>
__device__ __forceinline__ void load_rows(float* dst, int ld, const T* src, const int64_t* idx,
                                          int rows, int64_t D) {
  for (int64_t x = threadIdx.x; x < rows * D; x += kThreads) {
    const int64_t r = x / D, c = x % D;
    const int64_t i = idx[r];
    dst[r * ld + c] = i >= 0 ? to_float(src[i * D + c]) : 0.f;
  }
}

__device__ __forceinline__ float dot(const float* x, const float* y, int64_t D) {
  float s = 0.f;
  for (int64_t e = 0; e < D; ++e) s += x[e] * y[e];
  return s;
}

// ---- forward -------------------------------------------------------------------

template <typename T, int DC>
__global__ void __launch_bounds__(kThreads) forward_kernel(BlockSparseForwardCudaArgs a, int part) {
  const int64_t q_tiles = cuda::ceil_div(a.L, kBq);
  const int64_t t = blockIdx.x % q_tiles, nh = blockIdx.x / q_tiles;
  const int64_t n = nh / a.H, h = nh % a.H;
  const PartView P = resolve(a.parts[part], a, h);
  if (P.skip) return;
  const int64_t E = a.E, M = a.M, L = a.L, S = a.S;
  const int64_t len = a.key_lengths ? a.key_lengths[n] : S;
  const T* q = static_cast<const T*>(a.q) + nh * L * E;
  const T* k = static_cast<const T*>(a.k) + nh * S * E;
  const T* v = static_cast<const T*>(a.v) + nh * S * M;

  FA_DYNAMIC_SHARED(unsigned char, smem);
  int64_t* kidx = reinterpret_cast<int64_t*>(smem);  // (kBk) original key, -1: none
  int64_t* qidx = kidx + kBk;                        // (kBq)
  float* qs = reinterpret_cast<float*>(qidx + kBq);  // (kBq, E)
  float* ks = qs + kBq * E;                          // (kBk, E + 1)
  float* vs = ks + kBk * (E + 1);                    // (kBk, M)

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x < kBq) {
    const int64_t tpos = t * kBq + threadIdx.x;
    qidx[threadIdx.x] = tpos < L ? query_of(P, tpos) : -1;
  }
  __syncthreads();
  load_rows(qs, static_cast<int>(E), q, qidx, kBq, E);

  int64_t qi[kRows];
  RowRange rg[kRows];
  float m[kRows], l[kRows], acc[kRows][DC];
  const bool first = P.flags & 1, last = P.flags & 2;
  FA_BS_UNROLL
  for (int rr = 0; rr < kRows; ++rr) {
    const int r = warp * kRows + rr;
    qi[rr] = qidx[r];
    rg[rr] = qi[rr] >= 0 ? range_of(P, a, t * kBq + r, qi[rr]) : RowRange{0, -1, 0, -1};
    m[rr] = -INFINITY;
    l[rr] = 0.f;
    FA_BS_UNROLL
    for (int u = 0; u < DC; ++u) {
      const int64_t c = lane + 32 * u;
      acc[rr][u] = 0.f;
      if (!first && qi[rr] >= 0 && c < M) acc[rr][u] = a.ws_acc[(nh * L + qi[rr]) * M + c];
    }
    if (!first && qi[rr] >= 0) {
      m[rr] = a.ws_ml[nh * L + qi[rr]];
      l[rr] = a.ws_ml[a.N * a.H * L + nh * L + qi[rr]];
    }
  }

  int64_t kb_lo, kb_hi;
  key_tiles_of(P, a, t, kb_lo, kb_hi);
  for (int64_t kb = kb_lo; kb <= kb_hi; ++kb) {
    const int64_t j0 = kb * kBk;
    __syncthreads();  // the previous tile is consumed
    if (threadIdx.x < kBk) {
      const int64_t jo = j0 + threadIdx.x;
      kidx[threadIdx.x] = jo < P.Sp ? key_of(P, jo) : -1;
    }
    __syncthreads();
    load_rows(ks, static_cast<int>(E + 1), k, kidx, kBk, E);
    load_rows(vs, static_cast<int>(M), v, kidx, kBk, M);
    __syncthreads();
    const int64_t jo = j0 + lane, ko = kidx[lane];
    FA_BS_UNROLL
    for (int rr = 0; rr < kRows; ++rr) {
      if (qi[rr] < 0 || rg[rr].b < j0 || rg[rr].a >= j0 + kBk) continue;  // warp-uniform
      const int r = warp * kRows + rr;
      const bool keep =
          ko >= 0 && ko < len && in_range(rg[rr], jo) && keep_mask(a, n, h, qi[rr], ko);
      const float s = keep ? dot(qs + r * E, ks + lane * (E + 1), E) * a.scale : -INFINITY;
      const float m_new = fmaxf(m[rr], warp_max(s));
      if (m_new == -INFINITY) continue;  // nothing kept so far in this row
      const float p = keep ? expf(s - m_new) : 0.f;
      const float alpha = expf(m[rr] - m_new);  // 0 while m was -inf
      l[rr] = l[rr] * alpha + warp_sum(p);
      m[rr] = m_new;
      FA_BS_UNROLL
      for (int u = 0; u < DC; ++u) acc[rr][u] *= alpha;
      for (int j = 0; j < 32; ++j) {
        const float pj = __shfl_sync(0xffffffffu, p, j);
        if (pj == 0.f) continue;  // warp-uniform
        FA_BS_UNROLL
        for (int u = 0; u < DC; ++u) {
          const int64_t c = lane + 32 * u;
          if (c < M) acc[rr][u] += pj * vs[j * M + c];
        }
      }
    }
  }

  FA_BS_UNROLL
  for (int rr = 0; rr < kRows; ++rr) {
    if (qi[rr] < 0) continue;
    const int64_t row = nh * L + qi[rr];
    if (last) {
      const float inv = l[rr] > 0.f ? 1.f / l[rr] : 0.f;
      FA_BS_UNROLL
      for (int u = 0; u < DC; ++u) {
        const int64_t c = lane + 32 * u;
        if (c >= M) continue;
        if (a.out_float)
          a.out_float[row * M + c] = acc[rr][u] * inv;
        else
          static_cast<T*>(a.out)[row * M + c] = from_float<T>(acc[rr][u] * inv);
      }
      if (lane == 0) a.lse[row] = l[rr] > 0.f ? m[rr] + logf(l[rr]) : -INFINITY;
    } else {
      FA_BS_UNROLL
      for (int u = 0; u < DC; ++u) {
        const int64_t c = lane + 32 * u;
        if (c < M) a.ws_acc[row * M + c] = acc[rr][u];
      }
      if (lane == 0) {
        a.ws_ml[row] = m[rr];
        a.ws_ml[a.N * a.H * L + row] = l[rr];
      }
    }
  }
}

// ---- forward on tensor cores (float16, bfloat16) ------------------------------------
// One block of 2 warps per (n·h, tile of 32 ordered queries), 16 query rows per
// warp. Per key tile: S = Q·K^T by WMMA (16×16×16, float accumulation) into
// shared memory; the warp's rows are masked and softmaxed there (two lanes
// per row); P is rounded to T; O (float, in shared memory) is rescaled
// row-wise, loaded into accumulator fragments and O += P·V by WMMA. Head dims
// are zero-padded to multiples of 16 in shared memory.

constexpr int kWmmaWarps = 2;
constexpr int kWmmaThreads = kWmmaWarps * 32;

__host__ __device__ __forceinline__ int64_t round16(int64_t x) { return (x + 15) / 16 * 16; }

// Shared-memory bytes of forward_wmma_kernel (+128 for aligning the base).
__host__ __device__ __forceinline__ size_t wmma_smem_bytes(int64_t Ep, int64_t Mp, int elem) {
  return 128 + (kBk + kBq) * sizeof(int64_t) + kBq * 4 * sizeof(int64_t) +
         (kBq * kBk + kBq * Mp) * sizeof(float) +
         static_cast<size_t>(kBq * Ep + kBk * Ep + kBk * Mp + kBq * kBk) * elem;
}

// The 16 columns of a (·, 32) shared tile that lane `lane` (row lane / 2 of
// its warp's band, half = lane % 2) handles: all even or all odd columns,
// rotated by the row so that the 32 lanes hit 32 different banks.
__device__ __forceinline__ int pair_col(int lane, int u) {
  return (2 * u + (lane & 1) + 2 * (lane >> 1)) & 31;
}

template <typename T>
__device__ __forceinline__ void forward_wmma(const BlockSparseForwardCudaArgs& a, int part) {
  namespace wm = fa_wmma;
  const int64_t q_tiles = cuda::ceil_div(a.L, kBq);
  const int64_t t = blockIdx.x % q_tiles, nh = blockIdx.x / q_tiles;
  const int64_t n = nh / a.H, h = nh % a.H;
  const PartView P = resolve(a.parts[part], a, h);
  if (P.skip) return;
  const int64_t E = a.E, M = a.M, L = a.L, S = a.S;
  const int64_t Ep = round16(E), Mp = round16(M);
  const int64_t len = a.key_lengths ? a.key_lengths[n] : S;
  const T* q = static_cast<const T*>(a.q) + nh * L * E;
  const T* k = static_cast<const T*>(a.k) + nh * S * E;
  const T* v = static_cast<const T*>(a.v) + nh * S * M;

  FA_DYNAMIC_SHARED(unsigned char, smem_raw);
  unsigned char* smem =
      smem_raw + ((128 - reinterpret_cast<uintptr_t>(smem_raw) % 128) % 128);  // WMMA alignment
  int64_t* kidx = reinterpret_cast<int64_t*>(smem);                            // (kBk)
  int64_t* qidx = kidx + kBk;                                                  // (kBq)
  int64_t* qrg = qidx + kBq;                                                   // (kBq, 4)
  float* ss = reinterpret_cast<float*>(qrg + kBq * 4);                         // (kBq, kBk) scores
  float* os = ss + kBq * kBk;                   // (kBq, Mp) unnormalised output
  T* qs = reinterpret_cast<T*>(os + kBq * Mp);  // (kBq, Ep)
  T* ks = qs + kBq * Ep;                        // (kBk, Ep)
  T* vs = ks + kBk * Ep;                        // (kBk, Mp)
  T* ps = vs + kBk * Mp;                        // (kBq, kBk) probabilities

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bool first = P.flags & 1, last = P.flags & 2;
  if (threadIdx.x < kBq) {
    const int64_t tpos = t * kBq + threadIdx.x;
    const int64_t i = tpos < L ? query_of(P, tpos) : -1;
    qidx[threadIdx.x] = i;
    const RowRange r = i >= 0 ? range_of(P, a, tpos, i) : RowRange{0, -1, 0, -1};
    qrg[threadIdx.x * 4 + 0] = r.a;
    qrg[threadIdx.x * 4 + 1] = r.b;
    qrg[threadIdx.x * 4 + 2] = r.x;
    qrg[threadIdx.x * 4 + 3] = r.y;
  }
  __syncthreads();
  for (int64_t x = threadIdx.x; x < kBq * Ep; x += kWmmaThreads) {
    const int64_t r = x / Ep, e = x % Ep, i = qidx[r];
    qs[x] = i >= 0 && e < E ? q[i * E + e] : from_float<T>(0.f);
  }
  for (int64_t x = threadIdx.x; x < kBq * Mp; x += kWmmaThreads) {
    const int64_t r = x / Mp, c = x % Mp, i = qidx[r];
    os[x] = !first && i >= 0 && c < M ? a.ws_acc[(nh * L + i) * M + c] : 0.f;
  }
  // Row r = 16·warp + lane/2 belongs to lanes 2·(r mod 16) and +1 (half = lane % 2).
  const int r = warp * 16 + lane / 2, half = lane % 2;
  const int64_t qi = qidx[r];
  const RowRange rg{qrg[r * 4], qrg[r * 4 + 1], qrg[r * 4 + 2], qrg[r * 4 + 3]};
  float m = -INFINITY, l = 0.f;
  if (!first && qi >= 0) {
    m = a.ws_ml[nh * L + qi];
    l = a.ws_ml[a.N * a.H * L + nh * L + qi];
  }

  int64_t kb_lo, kb_hi;
  key_tiles_of(P, a, t, kb_lo, kb_hi);
  for (int64_t kb = kb_lo; kb <= kb_hi; ++kb) {
    const int64_t j0 = kb * kBk;
    __syncthreads();  // the previous tile is consumed
    if (threadIdx.x < kBk) {
      const int64_t jo = j0 + threadIdx.x;
      kidx[threadIdx.x] = jo < P.Sp ? key_of(P, jo) : -1;
    }
    __syncthreads();
    for (int64_t x = threadIdx.x; x < kBk * Ep; x += kWmmaThreads) {
      const int64_t c = x / Ep, e = x % Ep, j = kidx[c];
      ks[x] = j >= 0 && e < E ? k[j * E + e] : from_float<T>(0.f);
    }
    for (int64_t x = threadIdx.x; x < kBk * Mp; x += kWmmaThreads) {
      const int64_t c = x / Mp, e = x % Mp, j = kidx[c];
      vs[x] = j >= 0 && e < M ? v[j * M + e] : from_float<T>(0.f);
    }
    __syncthreads();
    // S (this warp's 16 rows × 32 keys) = Q·K^T.
    for (int ct = 0; ct < kBk / 16; ++ct) {
      wm::fragment<wm::accumulator, 16, 16, 16, float> acc;
      wm::fill_fragment(acc, 0.f);
      for (int64_t e0 = 0; e0 < Ep; e0 += 16) {
        wm::fragment<wm::matrix_a, 16, 16, 16, T, wm::row_major> fq;
        wm::fragment<wm::matrix_b, 16, 16, 16, T, wm::col_major> fk;
        wm::load_matrix_sync(fq, qs + warp * 16 * Ep + e0, static_cast<unsigned>(Ep));
        wm::load_matrix_sync(fk, ks + ct * 16 * Ep + e0, static_cast<unsigned>(Ep));
        wm::mma_sync(acc, fq, fk, acc);
      }
      wm::store_matrix_sync(ss + warp * 16 * kBk + ct * 16, acc, kBk, wm::mem_row_major);
    }
    __syncwarp();
    // Mask, online softmax: this lane's 16 keys of row r.
    float sv[16], tmax = -INFINITY;
    for (int u = 0; u < 16; ++u) {
      const int c = pair_col(lane, u);
      const int64_t jo = j0 + c, ko = kidx[c];
      const bool keep =
          qi >= 0 && ko >= 0 && ko < len && in_range(rg, jo) && keep_mask(a, n, h, qi, ko);
      sv[u] = keep ? ss[r * kBk + c] * a.scale : -INFINITY;
      tmax = fmaxf(tmax, sv[u]);
    }
    tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
    const float m_new = fmaxf(m, tmax);
    float alpha = 1.f, psum = 0.f;
    if (m_new != -INFINITY) {
      alpha = expf(m - m_new);  // 0 while m was -inf
      for (int u = 0; u < 16; ++u) {
        const float p = sv[u] == -INFINITY ? 0.f : expf(sv[u] - m_new);
        psum += p;
        ps[r * kBk + pair_col(lane, u)] = from_float<T>(p);
      }
      m = m_new;
    } else {
      for (int u = 0; u < 16; ++u) ps[r * kBk + pair_col(lane, u)] = from_float<T>(0.f);
    }
    psum += __shfl_xor_sync(0xffffffffu, psum, 1);
    l = l * alpha + psum;
    if (alpha != 1.f)
      for (int64_t x = half; x < Mp; x += 2) os[r * Mp + (x + 2 * (lane >> 1)) % Mp] *= alpha;
    __syncwarp();
    // O (this warp's 16 rows) += P·V.
    for (int64_t c0 = 0; c0 < Mp; c0 += 16) {
      wm::fragment<wm::accumulator, 16, 16, 16, float> acc;
      wm::load_matrix_sync(acc, os + warp * 16 * Mp + c0, static_cast<unsigned>(Mp),
                           wm::mem_row_major);
      for (int kk = 0; kk < kBk / 16; ++kk) {
        wm::fragment<wm::matrix_a, 16, 16, 16, T, wm::row_major> fp;
        wm::fragment<wm::matrix_b, 16, 16, 16, T, wm::row_major> fv;
        wm::load_matrix_sync(fp, ps + warp * 16 * kBk + kk * 16, kBk);
        wm::load_matrix_sync(fv, vs + kk * 16 * Mp + c0, static_cast<unsigned>(Mp));
        wm::mma_sync(acc, fp, fv, acc);
      }
      wm::store_matrix_sync(os + warp * 16 * Mp + c0, acc, static_cast<unsigned>(Mp),
                            wm::mem_row_major);
    }
    __syncwarp();
  }

  if (qi < 0) return;  // no barrier follows
  const int64_t row = nh * L + qi;
  if (last) {
    const float inv = l > 0.f ? 1.f / l : 0.f;
    for (int64_t c = half; c < M; c += 2) {
      if (a.out_float)
        a.out_float[row * M + c] = os[r * Mp + c] * inv;
      else
        static_cast<T*>(a.out)[row * M + c] = from_float<T>(os[r * Mp + c] * inv);
    }
    if (half == 0) a.lse[row] = l > 0.f ? m + logf(l) : -INFINITY;
  } else {
    for (int64_t c = half; c < M; c += 2) a.ws_acc[row * M + c] = os[r * Mp + c];
    if (half == 0) {
      a.ws_ml[row] = m;
      a.ws_ml[a.N * a.H * L + row] = l;
    }
  }
}

// The kernel: the body only where T has tensor cores (see cuda_compat.cuh).
template <typename T>
__global__ void __launch_bounds__(kWmmaThreads)
    forward_wmma_kernel(BlockSparseForwardCudaArgs a, int part) {
  if constexpr (cuda::wmma_compiled<T>()) {
    forward_wmma<T>(a, part);
  } else {
    FA_TRAP();
  }
}

// ---- backward: dQ ----------------------------------------------------------------

template <typename T, int DC>
__global__ void __launch_bounds__(kThreads)
    backward_dq_kernel(BlockSparseBackwardCudaArgs a, int part) {
  const int64_t q_tiles = cuda::ceil_div(a.L, kBq);
  const int64_t t = blockIdx.x % q_tiles, nh = blockIdx.x / q_tiles;
  const int64_t n = nh / a.H, h = nh % a.H;
  const PartView P = resolve(a.parts[part], a, h);
  if (P.skip) return;
  const int64_t E = a.E, M = a.M, L = a.L, S = a.S;
  const int64_t len = a.key_lengths ? a.key_lengths[n] : S;
  const T* q = static_cast<const T*>(a.q) + nh * L * E;
  const T* dout = static_cast<const T*>(a.grad_out) + nh * L * M;
  const T* k = static_cast<const T*>(a.k) + nh * S * E;
  const T* v = static_cast<const T*>(a.v) + nh * S * M;

  FA_DYNAMIC_SHARED(unsigned char, smem);
  int64_t* kidx = reinterpret_cast<int64_t*>(smem);  // (kBk)
  int64_t* qidx = kidx + kBk;                        // (kBq)
  float* qs = reinterpret_cast<float*>(qidx + kBq);  // (kBq, E)
  float* dos = qs + kBq * E;                         // (kBq, M)
  float* ks = dos + kBq * M;                         // (kBk, E + 1)
  float* vs = ks + kBk * (E + 1);                    // (kBk, M + 1)

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x < kBq) {
    const int64_t tpos = t * kBq + threadIdx.x;
    qidx[threadIdx.x] = tpos < L ? query_of(P, tpos) : -1;
  }
  __syncthreads();
  load_rows(qs, static_cast<int>(E), q, qidx, kBq, E);
  load_rows(dos, static_cast<int>(M), dout, qidx, kBq, M);

  int64_t qi[kRows];
  RowRange rg[kRows];
  float lse[kRows], delta[kRows], dq[kRows][DC];
  FA_BS_UNROLL
  for (int rr = 0; rr < kRows; ++rr) {
    const int r = warp * kRows + rr;
    qi[rr] = qidx[r];
    rg[rr] = qi[rr] >= 0 ? range_of(P, a, t * kBq + r, qi[rr]) : RowRange{0, -1, 0, -1};
    lse[rr] = qi[rr] >= 0 ? a.lse[nh * L + qi[rr]] : -INFINITY;
    delta[rr] = qi[rr] >= 0 ? a.delta[nh * L + qi[rr]] : 0.f;
    FA_BS_UNROLL
    for (int u = 0; u < DC; ++u) dq[rr][u] = 0.f;
  }

  int64_t kb_lo, kb_hi;
  key_tiles_of(P, a, t, kb_lo, kb_hi);
  for (int64_t kb = kb_lo; kb <= kb_hi; ++kb) {
    const int64_t j0 = kb * kBk;
    __syncthreads();
    if (threadIdx.x < kBk) {
      const int64_t jo = j0 + threadIdx.x;
      kidx[threadIdx.x] = jo < P.Sp ? key_of(P, jo) : -1;
    }
    __syncthreads();
    load_rows(ks, static_cast<int>(E + 1), k, kidx, kBk, E);
    load_rows(vs, static_cast<int>(M + 1), v, kidx, kBk, M);
    __syncthreads();
    const int64_t jo = j0 + lane, ko = kidx[lane];
    FA_BS_UNROLL
    for (int rr = 0; rr < kRows; ++rr) {
      if (lse[rr] == -INFINITY || rg[rr].b < j0 || rg[rr].a >= j0 + kBk) continue;
      const int r = warp * kRows + rr;
      const bool keep =
          ko >= 0 && ko < len && in_range(rg[rr], jo) && keep_mask(a, n, h, qi[rr], ko);
      if (!__any_sync(0xffffffffu, keep)) continue;
      float ds = 0.f;
      if (keep) {
        const float p = expf(dot(qs + r * E, ks + lane * (E + 1), E) * a.scale - lse[rr]);
        const float dp = dot(dos + r * M, vs + lane * (M + 1), M);
        ds = p * (dp - delta[rr]) * a.scale;
      }
      for (int j = 0; j < 32; ++j) {
        const float dsj = __shfl_sync(0xffffffffu, ds, j);
        if (dsj == 0.f) continue;
        FA_BS_UNROLL
        for (int u = 0; u < DC; ++u) {
          const int64_t c = lane + 32 * u;
          if (c < E) dq[rr][u] += dsj * ks[j * (E + 1) + c];
        }
      }
    }
  }

  FA_BS_UNROLL
  for (int rr = 0; rr < kRows; ++rr) {
    if (qi[rr] < 0 || lse[rr] == -INFINITY) continue;
    float* g = a.grad_q + (nh * L + qi[rr]) * E;
    FA_BS_UNROLL
    for (int u = 0; u < DC; ++u) {
      const int64_t c = lane + 32 * u;
      if (c < E) g[c] += dq[rr][u];
    }
  }
}

// ---- backward: dK, dV --------------------------------------------------------------

template <typename T, int DC>
__global__ void __launch_bounds__(kThreads)
    backward_dkv_kernel(BlockSparseBackwardCudaArgs a, int part, int64_t k_tiles) {
  const int64_t kb = blockIdx.x % k_tiles, nh = blockIdx.x / k_tiles;
  const int64_t n = nh / a.H, h = nh % a.H;
  const PartView P = resolve(a.parts[part], a, h);
  const int64_t j0 = kb * kBk;
  if (P.skip || j0 >= P.Sp) return;
  const int64_t E = a.E, M = a.M, L = a.L, S = a.S;
  const int64_t len = a.key_lengths ? a.key_lengths[n] : S;
  const T* q = static_cast<const T*>(a.q) + nh * L * E;
  const T* dout = static_cast<const T*>(a.grad_out) + nh * L * M;
  const T* k = static_cast<const T*>(a.k) + nh * S * E;
  const T* v = static_cast<const T*>(a.v) + nh * S * M;

  FA_DYNAMIC_SHARED(unsigned char, smem);
  int64_t* kidx = reinterpret_cast<int64_t*>(smem);       // (kBk)
  int64_t* qidx = kidx + kBk;                             // (kBq)
  int64_t* qrg = qidx + kBq;                              // (kBq, 4)
  float* qlse = reinterpret_cast<float*>(qrg + kBq * 4);  // (kBq)
  float* qdelta = qlse + kBq;                             // (kBq)
  float* ks = qdelta + kBq;                               // (kBk, E)
  float* vs = ks + kBk * E;                               // (kBk, M)
  float* qs = vs + kBk * M;                               // (kBq, E + 1)
  float* dos = qs + kBq * (E + 1);                        // (kBq, M + 1)

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x < kBk) {
    const int64_t jo = j0 + threadIdx.x;
    kidx[threadIdx.x] = jo < P.Sp ? key_of(P, jo) : -1;
  }
  __syncthreads();
  load_rows(ks, static_cast<int>(E), k, kidx, kBk, E);
  load_rows(vs, static_cast<int>(M), v, kidx, kBk, M);

  int64_t ko[kRows];
  float dk[kRows][DC], dv[kRows][DC];
  FA_BS_UNROLL
  for (int rr = 0; rr < kRows; ++rr) {
    const int64_t kx = kidx[warp * kRows + rr];
    ko[rr] = kx >= 0 && kx < len ? kx : -1;  // keys past the length are dropped everywhere
    FA_BS_UNROLL
    for (int u = 0; u < DC; ++u) dk[rr][u] = dv[rr][u] = 0.f;
  }

  // The query tiles that reach this key tile.
  const int64_t q_tiles = cuda::ceil_div(L, kBq);
  int64_t e_lo = 0, e_hi = q_tiles;
  if (P.kt_ptr) {
    e_lo = P.kt_ptr[kb];
    e_hi = P.kt_ptr[kb + 1];
  } else if (a.causal && !P.ranges) {
    const int64_t first_q = j0 - (S - L);  // queries i >= j - (S - L) see key j
    e_lo = first_q <= 0 ? 0 : (first_q >= L ? q_tiles : first_q / kBq);
  }
  for (int64_t e = e_lo; e < e_hi; ++e) {
    const int64_t t = P.kt_ptr ? P.kt_q[e] : e;
    __syncthreads();  // the previous query tile is consumed
    if (threadIdx.x < kBq) {
      const int64_t tpos = t * kBq + threadIdx.x;
      const int64_t i = tpos < L ? query_of(P, tpos) : -1;
      qidx[threadIdx.x] = i;
      const RowRange r = i >= 0 ? range_of(P, a, tpos, i) : RowRange{0, -1, 0, -1};
      qrg[threadIdx.x * 4 + 0] = r.a;
      qrg[threadIdx.x * 4 + 1] = r.b;
      qrg[threadIdx.x * 4 + 2] = r.x;
      qrg[threadIdx.x * 4 + 3] = r.y;
      qlse[threadIdx.x] = i >= 0 ? a.lse[nh * L + i] : -INFINITY;
      qdelta[threadIdx.x] = i >= 0 ? a.delta[nh * L + i] : 0.f;
    }
    __syncthreads();
    load_rows(qs, static_cast<int>(E + 1), q, qidx, kBq, E);
    load_rows(dos, static_cast<int>(M + 1), dout, qidx, kBq, M);
    __syncthreads();
    const int64_t i = qidx[lane];
    const RowRange rg{qrg[lane * 4], qrg[lane * 4 + 1], qrg[lane * 4 + 2], qrg[lane * 4 + 3]};
    const float lse = qlse[lane], delta = qdelta[lane];
    FA_BS_UNROLL
    for (int rr = 0; rr < kRows; ++rr) {
      if (ko[rr] < 0) continue;  // warp-uniform
      const int r = warp * kRows + rr;
      const bool keep =
          i >= 0 && lse != -INFINITY && in_range(rg, j0 + r) && keep_mask(a, n, h, i, ko[rr]);
      if (!__any_sync(0xffffffffu, keep)) continue;
      float p = 0.f, ds = 0.f;
      if (keep) {
        p = expf(dot(qs + lane * (E + 1), ks + r * E, E) * a.scale - lse);
        const float dp = dot(dos + lane * (M + 1), vs + r * M, M);
        ds = p * (dp - delta) * a.scale;
      }
      for (int j = 0; j < 32; ++j) {
        const float pj = __shfl_sync(0xffffffffu, p, j);
        const float dsj = __shfl_sync(0xffffffffu, ds, j);
        if (pj == 0.f && dsj == 0.f) continue;
        FA_BS_UNROLL
        for (int u = 0; u < DC; ++u) {
          const int64_t c = lane + 32 * u;
          if (c < M) dv[rr][u] += pj * dos[j * (M + 1) + c];
          if (c < E) dk[rr][u] += dsj * qs[j * (E + 1) + c];
        }
      }
    }
  }

  FA_BS_UNROLL
  for (int rr = 0; rr < kRows; ++rr) {
    if (ko[rr] < 0) continue;
    float* gk = a.grad_k + (nh * S + ko[rr]) * E;
    FA_BS_UNROLL
    for (int u = 0; u < DC; ++u) {
      const int64_t c = lane + 32 * u;
      if (c < E) gk[c] += dk[rr][u];
    }
    if (a.grad_v) {
      float* gv = a.grad_v + (nh * S + ko[rr]) * M;
      FA_BS_UNROLL
      for (int u = 0; u < DC; ++u) {
        const int64_t c = lane + 32 * u;
        if (c < M) gv[c] += dv[rr][u];
      }
    }
  }
}

// ---- backward on tensor cores (float16, bfloat16) -----------------------------------
// Same work split as the SIMT kernels, 2 warps of 16 rows, the three products
// of each tile by WMMA (S = Q·K^T, dP = dO·V^T, then dQ += dS·K, or in the key
// kernel S^T = K·Q^T, dP^T = V·dO^T, dV += P^T·dO, dK += dS^T·Q); the mask,
// P and dS elementwise in shared memory (two lanes per row, 16 columns each);
// P and dS rounded to T for the products; dQ / dK / dV accumulate as floats in
// shared memory.

__host__ __device__ __forceinline__ size_t wmma_bwd_smem_bytes(int64_t Ep, int64_t Mp, int elem) {
  return 128 + (kBk + kBq * 5) * sizeof(int64_t) + 2 * kBq * sizeof(float) +
         (2 * kBq * kBk + kBq * (Ep + Mp)) * sizeof(float) +
         static_cast<size_t>(2 * kBq * Ep + 2 * kBq * Mp + 2 * kBq * kBk) * elem;
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

// Copies rows (index idx[r], -1: zeros) of D elements into dst (rows × Dp, T), zero-padded.
template <typename T>
__device__ __forceinline__ void load_rows_t(T* dst, const T* src, const int64_t* idx, int rows,
                                            int64_t D, int64_t Dp) {
  for (int64_t x = threadIdx.x; x < rows * Dp; x += kWmmaThreads) {
    const int64_t r = x / Dp, c = x % Dp, i = idx[r];
    dst[x] = i >= 0 && c < D ? src[i * D + c] : from_float<T>(0.f);
  }
}

template <typename T>
__device__ __forceinline__ void backward_dq_wmma(const BlockSparseBackwardCudaArgs& a, int part) {
  const int64_t q_tiles = cuda::ceil_div(a.L, kBq);
  const int64_t t = blockIdx.x % q_tiles, nh = blockIdx.x / q_tiles;
  const int64_t n = nh / a.H, h = nh % a.H;
  const PartView P = resolve(a.parts[part], a, h);
  if (P.skip) return;
  const int64_t E = a.E, M = a.M, L = a.L, S = a.S, Ep = round16(E), Mp = round16(M);
  const int64_t len = a.key_lengths ? a.key_lengths[n] : S;
  const T* q = static_cast<const T*>(a.q) + nh * L * E;
  const T* dout = static_cast<const T*>(a.grad_out) + nh * L * M;
  const T* k = static_cast<const T*>(a.k) + nh * S * E;
  const T* v = static_cast<const T*>(a.v) + nh * S * M;

  FA_DYNAMIC_SHARED(unsigned char, smem_raw);
  unsigned char* smem = smem_raw + ((128 - reinterpret_cast<uintptr_t>(smem_raw) % 128) % 128);
  int64_t* kidx = reinterpret_cast<int64_t*>(smem);       // (kBk)
  int64_t* qidx = kidx + kBk;                             // (kBq)
  int64_t* qrg = qidx + kBq;                              // (kBq, 4)
  float* qlse = reinterpret_cast<float*>(qrg + kBq * 4);  // (kBq)
  float* qdelta = qlse + kBq;                             // (kBq)
  float* ss = qdelta + kBq;                               // (kBq, kBk) S
  float* dps = ss + kBq * kBk;                            // (kBq, kBk) dP
  float* dq = dps + kBq * kBk;                            // (kBq, Ep)
  float* spare = dq + kBq * Ep;  // (kBq, Mp), unused: one smem size for both kernels
  T* qs = reinterpret_cast<T*>(spare + kBq * Mp);  // (kBq, Ep)
  T* ks = qs + kBq * Ep;                           // (kBk, Ep)
  T* dos = ks + kBk * Ep;                          // (kBq, Mp)
  T* vs = dos + kBq * Mp;                          // (kBk, Mp)
  T* dst = vs + kBk * Mp;                          // (kBq, kBk) dS

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x < kBq) {
    const int64_t tpos = t * kBq + threadIdx.x;
    const int64_t i = tpos < L ? query_of(P, tpos) : -1;
    qidx[threadIdx.x] = i;
    const RowRange r = i >= 0 ? range_of(P, a, tpos, i) : RowRange{0, -1, 0, -1};
    qrg[threadIdx.x * 4 + 0] = r.a;
    qrg[threadIdx.x * 4 + 1] = r.b;
    qrg[threadIdx.x * 4 + 2] = r.x;
    qrg[threadIdx.x * 4 + 3] = r.y;
    qlse[threadIdx.x] = i >= 0 ? a.lse[nh * L + i] : -INFINITY;
    qdelta[threadIdx.x] = i >= 0 ? a.delta[nh * L + i] : 0.f;
  }
  __syncthreads();
  load_rows_t(qs, q, qidx, kBq, E, Ep);
  load_rows_t(dos, dout, qidx, kBq, M, Mp);
  for (int64_t x = threadIdx.x; x < kBq * Ep; x += kWmmaThreads) dq[x] = 0.f;
  const int r = warp * 16 + lane / 2, half = lane % 2;
  const int64_t qi = qidx[r];
  const RowRange rg{qrg[r * 4], qrg[r * 4 + 1], qrg[r * 4 + 2], qrg[r * 4 + 3]};
  const float lse = qlse[r], delta = qdelta[r];

  int64_t kb_lo, kb_hi;
  key_tiles_of(P, a, t, kb_lo, kb_hi);
  for (int64_t kb = kb_lo; kb <= kb_hi; ++kb) {
    const int64_t j0 = kb * kBk;
    __syncthreads();
    if (threadIdx.x < kBk) {
      const int64_t jo = j0 + threadIdx.x;
      kidx[threadIdx.x] = jo < P.Sp ? key_of(P, jo) : -1;
    }
    __syncthreads();
    load_rows_t(ks, k, kidx, kBk, E, Ep);
    load_rows_t(vs, v, kidx, kBk, M, Mp);
    __syncthreads();
    wmma_tiles::band_scores(ss + warp * 16 * kBk, qs + warp * 16 * Ep, static_cast<unsigned>(Ep),
                            ks, static_cast<unsigned>(Ep), Ep);
    wmma_tiles::band_scores(dps + warp * 16 * kBk, dos + warp * 16 * Mp, static_cast<unsigned>(Mp),
                            vs, static_cast<unsigned>(Mp), Mp);
    __syncwarp();
    FA_BS_UNROLL
    for (int u = 0; u < 16; ++u) {
      const int c = pair_col(lane, u);
      const int64_t jo = j0 + c, ko = kidx[c];
      const bool keep = qi >= 0 && lse != -INFINITY && ko >= 0 && ko < len && in_range(rg, jo) &&
                        keep_mask(a, n, h, qi, ko);
      float ds = 0.f;
      if (keep) {
        const float p = expf(ss[r * kBk + c] * a.scale - lse);
        ds = p * (dps[r * kBk + c] - delta) * a.scale;
      }
      dst[r * kBk + c] = from_float<T>(ds);
    }
    __syncwarp();
    wmma_tiles::band_mma_rows(dq + warp * 16 * Ep, static_cast<unsigned>(Ep), dst + warp * 16 * kBk,
                              kBk, ks, static_cast<unsigned>(Ep), Ep);
    __syncwarp();
  }
  if (qi < 0 || lse == -INFINITY) return;  // no barrier follows
  float* g = a.grad_q + (nh * L + qi) * E;
  for (int64_t c = half; c < E; c += 2) g[c] += dq[r * Ep + c];
}

template <typename T>
__global__ void __launch_bounds__(kWmmaThreads)
    backward_dq_wmma_kernel(BlockSparseBackwardCudaArgs a, int part) {
  if constexpr (cuda::wmma_compiled<T>()) {
    backward_dq_wmma<T>(a, part);
  } else {
    FA_TRAP();
  }
}

template <typename T>
__device__ __forceinline__ void backward_dkv_wmma(const BlockSparseBackwardCudaArgs& a, int part,
                                                  int64_t k_tiles) {
  const int64_t kb = blockIdx.x % k_tiles, nh = blockIdx.x / k_tiles;
  const int64_t n = nh / a.H, h = nh % a.H;
  const PartView P = resolve(a.parts[part], a, h);
  const int64_t j0 = kb * kBk;
  if (P.skip || j0 >= P.Sp) return;
  const int64_t E = a.E, M = a.M, L = a.L, S = a.S, Ep = round16(E), Mp = round16(M);
  const int64_t len = a.key_lengths ? a.key_lengths[n] : S;
  const T* q = static_cast<const T*>(a.q) + nh * L * E;
  const T* dout = static_cast<const T*>(a.grad_out) + nh * L * M;
  const T* k = static_cast<const T*>(a.k) + nh * S * E;
  const T* v = static_cast<const T*>(a.v) + nh * S * M;

  FA_DYNAMIC_SHARED(unsigned char, smem_raw);
  unsigned char* smem = smem_raw + ((128 - reinterpret_cast<uintptr_t>(smem_raw) % 128) % 128);
  int64_t* kidx = reinterpret_cast<int64_t*>(smem);       // (kBk)
  int64_t* qidx = kidx + kBk;                             // (kBq)
  int64_t* qrg = qidx + kBq;                              // (kBq, 4)
  float* qlse = reinterpret_cast<float*>(qrg + kBq * 4);  // (kBq)
  float* qdelta = qlse + kBq;                             // (kBq)
  float* sts = qdelta + kBq;                              // (kBk, kBq) S^T
  float* dpts = sts + kBk * kBq;                          // (kBk, kBq) dP^T
  float* dk = dpts + kBk * kBq;                           // (kBk, Ep)
  float* dv = dk + kBk * Ep;                              // (kBk, Mp)
  T* qs = reinterpret_cast<T*>(dv + kBk * Mp);            // (kBq, Ep)
  T* ks = qs + kBq * Ep;                                  // (kBk, Ep)
  T* dos = ks + kBk * Ep;                                 // (kBq, Mp)
  T* vs = dos + kBq * Mp;                                 // (kBk, Mp)
  T* pts = vs + kBk * Mp;                                 // (kBk, kBq) P^T, then dS^T

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x < kBk) {
    const int64_t jo = j0 + threadIdx.x;
    const int64_t kx = jo < P.Sp ? key_of(P, jo) : -1;
    kidx[threadIdx.x] = kx >= 0 && kx < len ? kx : -1;  // keys past the length: dropped
  }
  __syncthreads();
  load_rows_t(ks, k, kidx, kBk, E, Ep);
  load_rows_t(vs, v, kidx, kBk, M, Mp);
  for (int64_t x = threadIdx.x; x < kBk * Ep; x += kWmmaThreads) dk[x] = 0.f;
  for (int64_t x = threadIdx.x; x < kBk * Mp; x += kWmmaThreads) dv[x] = 0.f;
  const int r = warp * 16 + lane / 2, half = lane % 2;  // key row r of the tile
  const int64_t jo = j0 + r, ko = kidx[r];

  const int64_t q_tiles = cuda::ceil_div(L, kBq);
  int64_t e_lo = 0, e_hi = q_tiles;
  if (P.kt_ptr) {
    e_lo = P.kt_ptr[kb];
    e_hi = P.kt_ptr[kb + 1];
  } else if (a.causal && !P.ranges) {
    const int64_t first_q = j0 - (S - L);
    e_lo = first_q <= 0 ? 0 : (first_q >= L ? q_tiles : first_q / kBq);
  }
  for (int64_t e = e_lo; e < e_hi; ++e) {
    const int64_t t = P.kt_ptr ? P.kt_q[e] : e;
    __syncthreads();
    if (threadIdx.x < kBq) {
      const int64_t tpos = t * kBq + threadIdx.x;
      const int64_t i = tpos < L ? query_of(P, tpos) : -1;
      qidx[threadIdx.x] = i;
      const RowRange rr = i >= 0 ? range_of(P, a, tpos, i) : RowRange{0, -1, 0, -1};
      qrg[threadIdx.x * 4 + 0] = rr.a;
      qrg[threadIdx.x * 4 + 1] = rr.b;
      qrg[threadIdx.x * 4 + 2] = rr.x;
      qrg[threadIdx.x * 4 + 3] = rr.y;
      qlse[threadIdx.x] = i >= 0 ? a.lse[nh * L + i] : -INFINITY;
      qdelta[threadIdx.x] = i >= 0 ? a.delta[nh * L + i] : 0.f;
    }
    __syncthreads();
    load_rows_t(qs, q, qidx, kBq, E, Ep);
    load_rows_t(dos, dout, qidx, kBq, M, Mp);
    __syncthreads();
    wmma_tiles::band_scores(sts + warp * 16 * kBq, ks + warp * 16 * Ep, static_cast<unsigned>(Ep),
                            qs, static_cast<unsigned>(Ep), Ep);
    wmma_tiles::band_scores(dpts + warp * 16 * kBq, vs + warp * 16 * Mp, static_cast<unsigned>(Mp),
                            dos, static_cast<unsigned>(Mp), Mp);
    __syncwarp();
    float ds[16];
    FA_BS_UNROLL
    for (int u = 0; u < 16; ++u) {
      const int c = pair_col(lane, u);
      const int64_t i = qidx[c];
      const float lse = qlse[c];
      const RowRange rg{qrg[c * 4], qrg[c * 4 + 1], qrg[c * 4 + 2], qrg[c * 4 + 3]};
      const bool keep =
          ko >= 0 && i >= 0 && lse != -INFINITY && in_range(rg, jo) && keep_mask(a, n, h, i, ko);
      float p = 0.f;
      ds[u] = 0.f;
      if (keep) {
        p = expf(sts[r * kBq + c] * a.scale - lse);
        ds[u] = p * (dpts[r * kBq + c] - qdelta[c]) * a.scale;
      }
      pts[r * kBq + c] = from_float<T>(p);
    }
    __syncwarp();
    if (a.grad_v)
      wmma_tiles::band_mma_rows(dv + warp * 16 * Mp, static_cast<unsigned>(Mp),
                                pts + warp * 16 * kBq, kBq, dos, static_cast<unsigned>(Mp), Mp);
    __syncwarp();
    FA_BS_UNROLL
    for (int u = 0; u < 16; ++u) pts[r * kBq + pair_col(lane, u)] = from_float<T>(ds[u]);
    __syncwarp();
    wmma_tiles::band_mma_rows(dk + warp * 16 * Ep, static_cast<unsigned>(Ep), pts + warp * 16 * kBq,
                              kBq, qs, static_cast<unsigned>(Ep), Ep);
    __syncwarp();
  }
  if (ko < 0) return;  // no barrier follows
  float* gk = a.grad_k + (nh * S + ko) * E;
  for (int64_t c = half; c < E; c += 2) gk[c] += dk[r * Ep + c];
  if (a.grad_v) {
    float* gv = a.grad_v + (nh * S + ko) * M;
    for (int64_t c = half; c < M; c += 2) gv[c] += dv[r * Mp + c];
  }
}

template <typename T>
__global__ void __launch_bounds__(kWmmaThreads)
    backward_dkv_wmma_kernel(BlockSparseBackwardCudaArgs a, int part, int64_t k_tiles) {
  if constexpr (cuda::wmma_compiled<T>()) {
    backward_dkv_wmma<T>(a, part, k_tiles);
  } else {
    FA_TRAP();
  }
}

// ---- launchers ----------------------------------------------------------------------

int dim_chunks(const BlockSparseCudaParams& a) {
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

template <typename T>
struct ForwardLaunch {
  const BlockSparseForwardCudaArgs& a;
  int part;
  cudaStream_t stream;
  template <int DC>
  void operator()() const {
    const int64_t blocks = cuda::ceil_div(a.L, kBq) * a.N * a.H;
    const size_t smem =
        (kBk + kBq) * sizeof(int64_t) + (kBq * a.E + kBk * (a.E + 1) + kBk * a.M) * sizeof(float);
    FA_SET_MAX_DYNAMIC_SHARED(smem, forward_kernel<T, DC>);
    FA_LAUNCH(dim3(static_cast<unsigned>(blocks)), dim3(kThreads), smem, stream,
              forward_kernel<T, DC>)
    (a, part);
    FA_CHECK_LAUNCH("block_sparse_attention_forward");
  }
};

template <typename T>
struct BackwardLaunch {
  const BlockSparseBackwardCudaArgs& a;
  int part;
  cudaStream_t stream;
  template <int DC>
  void operator()() const {
    const int64_t nh = a.N * a.H;
    const int64_t q_blocks = cuda::ceil_div(a.L, kBq) * nh;
    const size_t smem_q = (kBk + kBq) * sizeof(int64_t) +
                          (kBq * (a.E + a.M) + kBk * (a.E + 1) + kBk * (a.M + 1)) * sizeof(float);
    FA_SET_MAX_DYNAMIC_SHARED(smem_q, backward_dq_kernel<T, DC>);
    FA_LAUNCH(dim3(static_cast<unsigned>(q_blocks)), dim3(kThreads), smem_q, stream,
              backward_dq_kernel<T, DC>)
    (a, part);
    FA_CHECK_LAUNCH("block_sparse_attention_backward (dQ)");
    const int64_t max_sp = a.parts[part].max_sp;
    const int64_t k_tiles = cuda::ceil_div(max_sp, kBk);
    if (k_tiles == 0) return;
    const size_t smem_k =
        (kBk + kBq * 5) * sizeof(int64_t) +
        (2 * kBq + kBk * (a.E + a.M) + kBq * (a.E + 1) + kBq * (a.M + 1)) * sizeof(float);
    FA_SET_MAX_DYNAMIC_SHARED(smem_k, backward_dkv_kernel<T, DC>);
    FA_LAUNCH(dim3(static_cast<unsigned>(k_tiles * nh)), dim3(kThreads), smem_k, stream,
              backward_dkv_kernel<T, DC>)
    (a, part, k_tiles);
    FA_CHECK_LAUNCH("block_sparse_attention_backward (dK, dV)");
  }
};

// One part's forward: tensor cores for float16 / bfloat16 where the device's
// code has them, else SIMT (float32; bfloat16 before sm_80).
template <typename T>
void launch_forward(const BlockSparseForwardCudaArgs& a, int part, int dc, cudaStream_t stream) {
  if constexpr (cuda::wmma_min_arch<T>() > 0) {
    if (FA_USE_TENSOR_CORES(T, "block_sparse_attention_forward", forward_wmma_kernel<T>)) {
      const int64_t blocks = cuda::ceil_div(a.L, kBq) * a.N * a.H;
      const size_t smem = wmma_smem_bytes(round16(a.E), round16(a.M), sizeof(T));
      FA_SET_MAX_DYNAMIC_SHARED(smem, forward_wmma_kernel<T>);
      FA_LAUNCH(dim3(static_cast<unsigned>(blocks)), dim3(kWmmaThreads), smem, stream,
                forward_wmma_kernel<T>)
      (a, part);
      FA_CHECK_LAUNCH("block_sparse_attention_forward (tensor cores)");
      return;
    }
  }
  if constexpr (!cuda::wmma_always<T>()) dispatch_chunks(dc, ForwardLaunch<T>{a, part, stream});
}

// One part's backward: tensor cores for float16 / bfloat16 where the
// device's code has them, else SIMT.
template <typename T>
void launch_backward(const BlockSparseBackwardCudaArgs& a, int part, int dc, cudaStream_t stream) {
  if constexpr (cuda::wmma_min_arch<T>() > 0) {
    if (FA_USE_TENSOR_CORES(T, "block_sparse_attention_backward", backward_dq_wmma_kernel<T>)) {
      const int64_t nh = a.N * a.H;
      const size_t smem = wmma_bwd_smem_bytes(round16(a.E), round16(a.M), sizeof(T));
      FA_SET_MAX_DYNAMIC_SHARED(smem, backward_dq_wmma_kernel<T>);
      FA_LAUNCH(dim3(static_cast<unsigned>(cuda::ceil_div(a.L, kBq) * nh)), dim3(kWmmaThreads),
                smem, stream, backward_dq_wmma_kernel<T>)
      (a, part);
      FA_CHECK_LAUNCH("block_sparse_attention_backward (dQ, tensor cores)");
      const int64_t k_tiles = cuda::ceil_div(a.parts[part].max_sp, kBk);
      if (k_tiles == 0) return;
      FA_SET_MAX_DYNAMIC_SHARED(smem, backward_dkv_wmma_kernel<T>);
      FA_LAUNCH(dim3(static_cast<unsigned>(k_tiles * nh)), dim3(kWmmaThreads), smem, stream,
                backward_dkv_wmma_kernel<T>)
      (a, part, k_tiles);
      FA_CHECK_LAUNCH("block_sparse_attention_backward (dK, dV, tensor cores)");
      return;
    }
  }
  if constexpr (!cuda::wmma_always<T>()) dispatch_chunks(dc, BackwardLaunch<T>{a, part, stream});
}

}  // namespace

void block_sparse_attention_forward_cuda(const BlockSparseForwardCudaArgs& a, cudaStream_t stream) {
  if (a.N * a.H == 0 || a.L == 0) return;
  const int dc = dim_chunks(a);
  FA_DISPATCH_FLOAT_TYPES(a.dtype, "block_sparse_attention_forward", [&] {
    for (int part = 0; part < a.num_parts; ++part) launch_forward<scalar_t>(a, part, dc, stream);
  });
}

void block_sparse_attention_backward_cuda(const BlockSparseBackwardCudaArgs& a,
                                          cudaStream_t stream) {
  if (a.N * a.H == 0 || a.L == 0 || a.S == 0) return;
  const int dc = dim_chunks(a);
  FA_DISPATCH_FLOAT_TYPES(a.dtype, "block_sparse_attention_backward", [&] {
    for (int part = 0; part < a.num_parts; ++part) launch_backward<scalar_t>(a, part, dc, stream);
  });
}

}  // namespace fastattn::cuda
