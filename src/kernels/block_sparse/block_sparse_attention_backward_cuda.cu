// The backward CUDA kernels of block-sparse attention (dQ, and dK / dV; SIMT
// and tensor cores), their launcher and block_sparse_attention_backward_cuda
// (block_sparse_attention_cuda.h); the design and what the kernels share:
// block_sparse_attention_cuda_common.cuh.
#include "kernels/block_sparse/block_sparse_attention_cuda_common.cuh"

namespace fastattn::cuda {
namespace {

// Head nh's grad_out, (L, M).
template <typename T>
__device__ __forceinline__ const T* grad_out_of(const BlockSparseBackwardCudaArgs& a, int64_t nh) {
  return static_cast<const T*>(a.grad_out) + nh * a.L * a.M;
}

// ---- backward: dQ (SIMT) ---------------------------------------------------------------

template <typename T, int DC>
__global__ void __launch_bounds__(kThreads)
    backward_dq_kernel(BlockSparseBackwardCudaArgs a, int part) {
  const HeadBlock<T> hb(a, part, cuda::ceil_div(a.L, kBq));
  const PartView& P = hb.P;
  if (P.skip) return;
  const int64_t t = hb.tile, nh = hb.nh, n = hb.n, h = hb.h, len = key_length(a, n);
  const int64_t E = a.E, M = a.M, L = a.L;
  const BackwardDqSmem sm = carve_smem<BackwardDqSmem>(E, M);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x < kBq) sm.qidx[threadIdx.x] = query_at(P, L, t * kBq + threadIdx.x);
  __syncthreads();
  load_rows(sm.qs, static_cast<int>(E), hb.q, sm.qidx, kBq, E);
  load_rows(sm.dos, static_cast<int>(M), grad_out_of<T>(a, nh), sm.qidx, kBq, M);

  int64_t qi[kRows];
  RowRange rg[kRows];
  float lse[kRows], delta[kRows], dq[kRows][DC];
  FA_UNROLL
  for (int rr = 0; rr < kRows; ++rr) {
    const int r = warp * kRows + rr;
    qi[rr] = sm.qidx[r];
    rg[rr] = range_or_none(P, a, t * kBq + r, qi[rr]);
    lse[rr] = qi[rr] >= 0 ? a.lse[nh * L + qi[rr]] : -INFINITY;
    delta[rr] = qi[rr] >= 0 ? a.delta[nh * L + qi[rr]] : 0.f;
    FA_UNROLL
    for (int u = 0; u < DC; ++u) dq[rr][u] = 0.f;
  }

  int64_t kb_lo, kb_hi;
  key_tiles_of(P, a, t, kb_lo, kb_hi);
  for (int64_t kb = kb_lo; kb <= kb_hi; ++kb) {
    const int64_t j0 = kb * kBk;
    stage_tile([&] { stage_key(P, j0, sm.kidx); },
               [&] {
                 load_rows(sm.ks, static_cast<int>(E + 1), hb.k, sm.kidx, kBk, E);
                 load_rows(sm.vs, static_cast<int>(M + 1), hb.v, sm.kidx, kBk, M);
               });
    const int64_t jo = j0 + lane, ko = sm.kidx[lane];
    FA_UNROLL
    for (int rr = 0; rr < kRows; ++rr) {
      if (lse[rr] == -INFINITY || misses_tile(rg[rr], j0)) continue;
      const int r = warp * kRows + rr;
      const bool keep = keeps(a, n, h, len, rg[rr], qi[rr], jo, ko);
      if (!__any_sync(0xffffffffu, keep)) continue;
      float ds = 0.f;
      if (keep) {
        const float p = expf(dot(sm.qs + r * E, sm.ks + lane * (E + 1), E) * a.scale - lse[rr]);
        const float dp = dot(sm.dos + r * M, sm.vs + lane * (M + 1), M);
        ds = p * (dp - delta[rr]) * a.scale;
      }
      for (int j = 0; j < 32; ++j) {
        const float dsj = __shfl_sync(0xffffffffu, ds, j);
        if (dsj == 0.f) continue;
        FA_UNROLL
        for (int u = 0; u < DC; ++u) {
          const int64_t c = lane + 32 * u;
          if (c < E) dq[rr][u] += dsj * sm.ks[j * (E + 1) + c];
        }
      }
    }
  }

  FA_UNROLL
  for (int rr = 0; rr < kRows; ++rr) {
    if (qi[rr] < 0 || lse[rr] == -INFINITY) continue;
    add_lane_cols(a.grad_q + (nh * L + qi[rr]) * E, dq[rr], E, lane);
  }
}

// ---- backward: dK, dV (SIMT) -----------------------------------------------------------

template <typename T, int DC>
__global__ void __launch_bounds__(kThreads)
    backward_dkv_kernel(BlockSparseBackwardCudaArgs a, int part, int64_t k_tiles) {
  const HeadBlock<T> hb(a, part, k_tiles);
  const PartView& P = hb.P;
  const int64_t kb = hb.tile, j0 = kb * kBk;
  if (P.skip || j0 >= P.Sp) return;
  const int64_t nh = hb.nh, n = hb.n, h = hb.h, len = key_length(a, n);
  const int64_t E = a.E, M = a.M, S = a.S;
  const T* dout = grad_out_of<T>(a, nh);
  const BackwardDkvSmem sm = carve_smem<BackwardDkvSmem>(E, M);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  stage_key(P, j0, sm.kidx);
  __syncthreads();
  load_rows(sm.ks, static_cast<int>(E), hb.k, sm.kidx, kBk, E);
  load_rows(sm.vs, static_cast<int>(M), hb.v, sm.kidx, kBk, M);

  int64_t ko[kRows];
  float dk[kRows][DC], dv[kRows][DC];
  FA_UNROLL
  for (int rr = 0; rr < kRows; ++rr) {
    const int64_t kx = sm.kidx[warp * kRows + rr];
    ko[rr] = kx >= 0 && kx < len ? kx : -1;  // keys past the length are dropped everywhere
    FA_UNROLL
    for (int u = 0; u < DC; ++u) dk[rr][u] = dv[rr][u] = 0.f;
  }

  int64_t e_lo, e_hi;
  query_tiles_of(P, a, kb, e_lo, e_hi);
  for (int64_t e = e_lo; e < e_hi; ++e) {
    const int64_t t = query_tile_at(P, e);
    stage_tile(
        [&] {
          if (threadIdx.x < kBq) stage_grad_row(P, a, t, nh, sm);
        },
        [&] {
          load_rows(sm.qs, static_cast<int>(E + 1), hb.q, sm.qidx, kBq, E);
          load_rows(sm.dos, static_cast<int>(M + 1), dout, sm.qidx, kBq, M);
        });
    const int64_t i = sm.qidx[lane];
    const RowRange rg = sm.range(lane);
    const float lse = sm.qlse[lane], delta = sm.qdelta[lane];
    FA_UNROLL
    for (int rr = 0; rr < kRows; ++rr) {
      if (ko[rr] < 0) continue;  // warp-uniform
      const int r = warp * kRows + rr;
      const bool keep =
          i >= 0 && lse != -INFINITY && in_range(rg, j0 + r) && keep_mask(a, n, h, i, ko[rr]);
      if (!__any_sync(0xffffffffu, keep)) continue;
      float p = 0.f, ds = 0.f;
      if (keep) {
        p = expf(dot(sm.qs + lane * (E + 1), sm.ks + r * E, E) * a.scale - lse);
        const float dp = dot(sm.dos + lane * (M + 1), sm.vs + r * M, M);
        ds = p * (dp - delta) * a.scale;
      }
      for (int j = 0; j < 32; ++j) {
        const float pj = __shfl_sync(0xffffffffu, p, j);
        const float dsj = __shfl_sync(0xffffffffu, ds, j);
        if (pj == 0.f && dsj == 0.f) continue;
        FA_UNROLL
        for (int u = 0; u < DC; ++u) {
          const int64_t c = lane + 32 * u;
          if (c < M) dv[rr][u] += pj * sm.dos[j * (M + 1) + c];
          if (c < E) dk[rr][u] += dsj * sm.qs[j * (E + 1) + c];
        }
      }
    }
  }

  FA_UNROLL
  for (int rr = 0; rr < kRows; ++rr) {
    if (ko[rr] < 0) continue;
    add_lane_cols(a.grad_k + (nh * S + ko[rr]) * E, dk[rr], E, lane);
    if (a.grad_v) add_lane_cols(a.grad_v + (nh * S + ko[rr]) * M, dv[rr], M, lane);
  }
}

// ---- backward on tensor cores (float16, bfloat16) -----------------------------------
// Same work split as the SIMT kernels, 2 warps of 16 rows, the three products
// of each tile by WMMA (S = Q·K^T, dP = dO·V^T, then dQ += dS·K, or in the key
// kernel S^T = K·Q^T, dP^T = V·dO^T, dV += P^T·dO, dK += dS^T·Q); the mask,
// P and dS elementwise in shared memory (two lanes per row, 16 columns each);
// P and dS rounded to T for the products; dQ / dK / dV accumulate as floats in
// shared memory.

template <typename T>
__device__ __forceinline__ void backward_dq_wmma(const BlockSparseBackwardCudaArgs& a, int part) {
  const HeadBlock<T> hb(a, part, cuda::ceil_div(a.L, kBq));
  const PartView& P = hb.P;
  if (P.skip) return;
  const int64_t t = hb.tile, nh = hb.nh, n = hb.n, h = hb.h, len = key_length(a, n);
  const int64_t E = a.E, M = a.M, L = a.L, Ep = round16(E), Mp = round16(M);
  const BackwardDqWmmaSmem<T> sm = carve_smem<BackwardDqWmmaSmem<T>>(Ep, Mp);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x < kBq) stage_grad_row(P, a, t, nh, sm);
  __syncthreads();
  load_rows_t(sm.qs, hb.q, sm.qidx, kBq, E, Ep);
  load_rows_t(sm.dos, grad_out_of<T>(a, nh), sm.qidx, kBq, M, Mp);
  for (int64_t x = threadIdx.x; x < kBq * Ep; x += kWmmaThreads) sm.dq[x] = 0.f;
  const int r = warp * 16 + lane / 2, half = lane % 2;
  const int64_t qi = sm.qidx[r];
  const RowRange rg = sm.range(r);
  const float lse = sm.qlse[r], delta = sm.qdelta[r];

  int64_t kb_lo, kb_hi;
  key_tiles_of(P, a, t, kb_lo, kb_hi);
  for (int64_t kb = kb_lo; kb <= kb_hi; ++kb) {
    const int64_t j0 = kb * kBk;
    stage_tile([&] { stage_key(P, j0, sm.kidx); },
               [&] {
                 load_rows_t(sm.ks, hb.k, sm.kidx, kBk, E, Ep);
                 load_rows_t(sm.vs, hb.v, sm.kidx, kBk, M, Mp);
               });
    wmma_tiles::band_scores(sm.ss + warp * 16 * kBk, sm.qs + warp * 16 * Ep,
                            static_cast<unsigned>(Ep), sm.ks, static_cast<unsigned>(Ep), Ep);
    wmma_tiles::band_scores(sm.dps + warp * 16 * kBk, sm.dos + warp * 16 * Mp,
                            static_cast<unsigned>(Mp), sm.vs, static_cast<unsigned>(Mp), Mp);
    __syncwarp();
    FA_UNROLL
    for (int u = 0; u < 16; ++u) {
      const int c = pair_col(lane, u);
      const int64_t jo = j0 + c, ko = sm.kidx[c];
      const bool keep = qi >= 0 && lse != -INFINITY && keeps(a, n, h, len, rg, qi, jo, ko);
      float ds = 0.f;
      if (keep) {
        const float p = expf(sm.ss[r * kBk + c] * a.scale - lse);
        ds = p * (sm.dps[r * kBk + c] - delta) * a.scale;
      }
      sm.dst[r * kBk + c] = from_float<T>(ds);
    }
    __syncwarp();
    wmma_tiles::band_mma_rows(sm.dq + warp * 16 * Ep, static_cast<unsigned>(Ep),
                              sm.dst + warp * 16 * kBk, kBk, sm.ks, static_cast<unsigned>(Ep), Ep);
    __syncwarp();
  }
  if (qi < 0 || lse == -INFINITY) return;  // no barrier follows
  add_half_cols(a.grad_q + (nh * L + qi) * E, sm.dq + r * Ep, E, half);
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
  const HeadBlock<T> hb(a, part, k_tiles);
  const PartView& P = hb.P;
  const int64_t kb = hb.tile, j0 = kb * kBk;
  if (P.skip || j0 >= P.Sp) return;
  const int64_t nh = hb.nh, n = hb.n, h = hb.h, len = key_length(a, n);
  const int64_t E = a.E, M = a.M, S = a.S, Ep = round16(E), Mp = round16(M);
  const T* dout = grad_out_of<T>(a, nh);
  const BackwardDkvWmmaSmem<T> sm = carve_smem<BackwardDkvWmmaSmem<T>>(Ep, Mp);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x < kBk) {
    const int64_t kx = key_at(P, j0 + threadIdx.x);
    sm.kidx[threadIdx.x] = kx >= 0 && kx < len ? kx : -1;  // keys past the length: dropped
  }
  __syncthreads();
  load_rows_t(sm.ks, hb.k, sm.kidx, kBk, E, Ep);
  load_rows_t(sm.vs, hb.v, sm.kidx, kBk, M, Mp);
  for (int64_t x = threadIdx.x; x < kBk * Ep; x += kWmmaThreads) sm.dk[x] = 0.f;
  for (int64_t x = threadIdx.x; x < kBk * Mp; x += kWmmaThreads) sm.dv[x] = 0.f;
  const int r = warp * 16 + lane / 2, half = lane % 2;  // key row r of the tile
  const int64_t jo = j0 + r, ko = sm.kidx[r];

  int64_t e_lo, e_hi;
  query_tiles_of(P, a, kb, e_lo, e_hi);
  for (int64_t e = e_lo; e < e_hi; ++e) {
    const int64_t t = query_tile_at(P, e);
    stage_tile(
        [&] {
          if (threadIdx.x < kBq) stage_grad_row(P, a, t, nh, sm);
        },
        [&] {
          load_rows_t(sm.qs, hb.q, sm.qidx, kBq, E, Ep);
          load_rows_t(sm.dos, dout, sm.qidx, kBq, M, Mp);
        });
    wmma_tiles::band_scores(sm.sts + warp * 16 * kBq, sm.ks + warp * 16 * Ep,
                            static_cast<unsigned>(Ep), sm.qs, static_cast<unsigned>(Ep), Ep);
    wmma_tiles::band_scores(sm.dpts + warp * 16 * kBq, sm.vs + warp * 16 * Mp,
                            static_cast<unsigned>(Mp), sm.dos, static_cast<unsigned>(Mp), Mp);
    __syncwarp();
    float ds[16];
    FA_UNROLL
    for (int u = 0; u < 16; ++u) {
      const int c = pair_col(lane, u);
      const int64_t i = sm.qidx[c];
      const float lse = sm.qlse[c];
      const RowRange rg = sm.range(c);
      const bool keep =
          ko >= 0 && i >= 0 && lse != -INFINITY && in_range(rg, jo) && keep_mask(a, n, h, i, ko);
      float p = 0.f;
      ds[u] = 0.f;
      if (keep) {
        p = expf(sm.sts[r * kBq + c] * a.scale - lse);
        ds[u] = p * (sm.dpts[r * kBq + c] - sm.qdelta[c]) * a.scale;
      }
      sm.pts[r * kBq + c] = from_float<T>(p);
    }
    __syncwarp();
    if (a.grad_v)
      wmma_tiles::band_mma_rows(sm.dv + warp * 16 * Mp, static_cast<unsigned>(Mp),
                                sm.pts + warp * 16 * kBq, kBq, sm.dos, static_cast<unsigned>(Mp),
                                Mp);
    __syncwarp();
    FA_UNROLL
    for (int u = 0; u < 16; ++u) sm.pts[r * kBq + pair_col(lane, u)] = from_float<T>(ds[u]);
    __syncwarp();
    wmma_tiles::band_mma_rows(sm.dk + warp * 16 * Ep, static_cast<unsigned>(Ep),
                              sm.pts + warp * 16 * kBq, kBq, sm.qs, static_cast<unsigned>(Ep), Ep);
    __syncwarp();
  }
  if (ko < 0) return;  // no barrier follows
  add_half_cols(a.grad_k + (nh * S + ko) * E, sm.dk + r * Ep, E, half);
  if (a.grad_v) add_half_cols(a.grad_v + (nh * S + ko) * M, sm.dv + r * Mp, M, half);
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

template <typename T>
struct BackwardLaunch {
  const BlockSparseBackwardCudaArgs& a;
  int part;
  cudaStream_t stream;
  template <int DC>
  void operator()() const {
    const int64_t nh = a.N * a.H;
    launch_kernel(backward_dq_kernel<T, DC>, cuda::ceil_div(a.L, kBq) * nh, kThreads,
                  smem_bytes<BackwardDqSmem>(a.E, a.M), stream,
                  "block_sparse_attention_backward (dQ)", a, part);
    const int64_t k_tiles = cuda::ceil_div(a.parts[part].max_sp, kBk);
    if (k_tiles == 0) return;
    launch_kernel(backward_dkv_kernel<T, DC>, k_tiles * nh, kThreads,
                  smem_bytes<BackwardDkvSmem>(a.E, a.M), stream,
                  "block_sparse_attention_backward (dK, dV)", a, part, k_tiles);
  }
};

// One part's backward: tensor cores for float16 / bfloat16 where the
// device's code has them, else SIMT.
template <typename T>
void launch_backward(const BlockSparseBackwardCudaArgs& a, int part, int dc, cudaStream_t stream) {
  if constexpr (cuda::wmma_min_arch<T>() > 0) {
    if (FA_USE_TENSOR_CORES(T, "block_sparse_attention_backward", backward_dq_wmma_kernel<T>)) {
      const int64_t nh = a.N * a.H, Ep = round16(a.E), Mp = round16(a.M);
      launch_kernel(backward_dq_wmma_kernel<T>, cuda::ceil_div(a.L, kBq) * nh, kWmmaThreads,
                    smem_bytes<BackwardDqWmmaSmem<T>>(Ep, Mp), stream,
                    "block_sparse_attention_backward (dQ, tensor cores)", a, part);
      const int64_t k_tiles = cuda::ceil_div(a.parts[part].max_sp, kBk);
      if (k_tiles == 0) return;
      launch_kernel(backward_dkv_wmma_kernel<T>, k_tiles * nh, kWmmaThreads,
                    smem_bytes<BackwardDkvWmmaSmem<T>>(Ep, Mp), stream,
                    "block_sparse_attention_backward (dK, dV, tensor cores)", a, part, k_tiles);
      return;
    }
  }
  if constexpr (!cuda::wmma_always<T>()) dispatch_chunks(dc, BackwardLaunch<T>{a, part, stream});
}

}  // namespace

void block_sparse_attention_backward_cuda(const BlockSparseBackwardCudaArgs& a,
                                          cudaStream_t stream) {
  if (a.N * a.H == 0 || a.L == 0 || a.S == 0) return;
  const int dc = dim_chunks(a);
  FA_DISPATCH_FLOAT_TYPES(a.dtype, "block_sparse_attention_backward", [&] {
    for (int part = 0; part < a.num_parts; ++part) launch_backward<scalar_t>(a, part, dc, stream);
  });
}

}  // namespace fastattn::cuda
