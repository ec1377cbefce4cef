// The forward CUDA kernels of block-sparse attention (SIMT and tensor cores),
// their launcher and block_sparse_attention_forward_cuda
// (block_sparse_attention_cuda.h); the design and what the kernels share:
// block_sparse_attention_cuda_common.cuh.
#include "kernels/block_sparse/block_sparse_attention_cuda_common.cuh"

namespace fastattn::cuda {
namespace {

// The running state (max, sum) of a row between parts: ws_ml holds the maxima,
// then the sums.
__device__ __forceinline__ void load_row_state(const BlockSparseForwardCudaArgs& a, int64_t row,
                                               float& m, float& l) {
  m = a.ws_ml[row];
  l = a.ws_ml[a.N * a.H * a.L + row];
}

// Row `row`'s end: its lse (the last part) or its running state (for the next).
__device__ __forceinline__ void store_row_state(const BlockSparseForwardCudaArgs& a, int64_t row,
                                                float m, float l, bool last) {
  if (last) {
    a.lse[row] = l > 0.f ? m + logf(l) : -INFINITY;
  } else {
    a.ws_ml[row] = m;
    a.ws_ml[a.N * a.H * a.L + row] = l;
  }
}

// Output element `at` (row·M + c) of the last part.
template <typename T>
__device__ __forceinline__ void store_out(const BlockSparseForwardCudaArgs& a, int64_t at,
                                          float x) {
  if (a.out_float)
    a.out_float[at] = x;
  else
    static_cast<T*>(a.out)[at] = from_float<T>(x);
}

// ---- forward (SIMT) ------------------------------------------------------------------

template <typename T, int DC>
__global__ void __launch_bounds__(kThreads) forward_kernel(BlockSparseForwardCudaArgs a, int part) {
  const HeadBlock<T> hb(a, part, cuda::ceil_div(a.L, kBq));
  const PartView& P = hb.P;
  if (P.skip) return;
  const int64_t t = hb.tile, nh = hb.nh, n = hb.n, h = hb.h, len = key_length(a, n);
  const int64_t E = a.E, M = a.M, L = a.L;
  const ForwardSmem sm = carve_smem<ForwardSmem>(E, M);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x < kBq) sm.qidx[threadIdx.x] = query_at(P, L, t * kBq + threadIdx.x);
  __syncthreads();
  load_rows(sm.qs, static_cast<int>(E), hb.q, sm.qidx, kBq, E);

  int64_t qi[kRows];
  RowRange rg[kRows];
  float m[kRows], l[kRows], acc[kRows][DC];
  const bool first = P.flags & 1, last = P.flags & 2;
  FA_UNROLL
  for (int rr = 0; rr < kRows; ++rr) {
    const int r = warp * kRows + rr;
    qi[rr] = sm.qidx[r];
    rg[rr] = range_or_none(P, a, t * kBq + r, qi[rr]);
    m[rr] = -INFINITY;
    l[rr] = 0.f;
    FA_UNROLL
    for (int u = 0; u < DC; ++u) {
      const int64_t c = lane + 32 * u;
      acc[rr][u] = 0.f;
      if (!first && qi[rr] >= 0 && c < M) acc[rr][u] = a.ws_acc[(nh * L + qi[rr]) * M + c];
    }
    if (!first && qi[rr] >= 0) load_row_state(a, nh * L + qi[rr], m[rr], l[rr]);
  }

  int64_t kb_lo, kb_hi;
  key_tiles_of(P, a, t, kb_lo, kb_hi);
  for (int64_t kb = kb_lo; kb <= kb_hi; ++kb) {
    const int64_t j0 = kb * kBk;
    stage_tile([&] { stage_key(P, j0, sm.kidx); },
               [&] {
                 load_rows(sm.ks, static_cast<int>(E + 1), hb.k, sm.kidx, kBk, E);
                 load_rows(sm.vs, static_cast<int>(M), hb.v, sm.kidx, kBk, M);
               });
    const int64_t jo = j0 + lane, ko = sm.kidx[lane];
    FA_UNROLL
    for (int rr = 0; rr < kRows; ++rr) {
      if (qi[rr] < 0 || misses_tile(rg[rr], j0)) continue;  // warp-uniform
      const int r = warp * kRows + rr;
      const bool keep = keeps(a, n, h, len, rg[rr], qi[rr], jo, ko);
      const float s = keep ? dot(sm.qs + r * E, sm.ks + lane * (E + 1), E) * a.scale : -INFINITY;
      const float m_new = fmaxf(m[rr], warp_max(s));
      if (m_new == -INFINITY) continue;  // nothing kept so far in this row
      const float p = keep ? expf(s - m_new) : 0.f;
      const float alpha = expf(m[rr] - m_new);  // 0 while m was -inf
      l[rr] = l[rr] * alpha + warp_sum(p);
      m[rr] = m_new;
      FA_UNROLL
      for (int u = 0; u < DC; ++u) acc[rr][u] *= alpha;
      for (int j = 0; j < 32; ++j) {
        const float pj = __shfl_sync(0xffffffffu, p, j);
        if (pj == 0.f) continue;  // warp-uniform
        FA_UNROLL
        for (int u = 0; u < DC; ++u) {
          const int64_t c = lane + 32 * u;
          if (c < M) acc[rr][u] += pj * sm.vs[j * M + c];
        }
      }
    }
  }

  FA_UNROLL
  for (int rr = 0; rr < kRows; ++rr) {
    if (qi[rr] < 0) continue;
    const int64_t row = nh * L + qi[rr];
    if (last) {
      const float inv = l[rr] > 0.f ? 1.f / l[rr] : 0.f;
      FA_UNROLL
      for (int u = 0; u < DC; ++u) {
        const int64_t c = lane + 32 * u;
        if (c < M) store_out<T>(a, row * M + c, acc[rr][u] * inv);
      }
    } else {
      FA_UNROLL
      for (int u = 0; u < DC; ++u) {
        const int64_t c = lane + 32 * u;
        if (c < M) a.ws_acc[row * M + c] = acc[rr][u];
      }
    }
    if (lane == 0) store_row_state(a, row, m[rr], l[rr], last);
  }
}

// ---- forward on tensor cores (float16, bfloat16) ------------------------------------
// One block of 2 warps per (n·h, tile of 32 ordered queries), 16 query rows per
// warp. Per key tile: S = Q·K^T by WMMA (16×16×16, float accumulation) into
// shared memory; the warp's rows are masked and softmaxed there (two lanes
// per row); P is rounded to T; O (float, in shared memory) is rescaled
// row-wise, loaded into accumulator fragments and O += P·V by WMMA. Head dims
// are zero-padded to multiples of 16 in shared memory.

template <typename T>
__device__ __forceinline__ void forward_wmma(const BlockSparseForwardCudaArgs& a, int part) {
  const HeadBlock<T> hb(a, part, cuda::ceil_div(a.L, kBq));
  const PartView& P = hb.P;
  if (P.skip) return;
  const int64_t t = hb.tile, nh = hb.nh, n = hb.n, h = hb.h, len = key_length(a, n);
  const int64_t E = a.E, M = a.M, L = a.L, Ep = round16(E), Mp = round16(M);
  const ForwardWmmaSmem<T> sm = carve_smem<ForwardWmmaSmem<T>>(Ep, Mp);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bool first = P.flags & 1, last = P.flags & 2;
  if (threadIdx.x < kBq) stage_query_row(P, a, t, sm);
  __syncthreads();
  load_rows_t(sm.qs, hb.q, sm.qidx, kBq, E, Ep);
  for (int64_t x = threadIdx.x; x < kBq * Mp; x += kWmmaThreads) {
    const int64_t r = x / Mp, c = x % Mp, i = sm.qidx[r];
    sm.os[x] = !first && i >= 0 && c < M ? a.ws_acc[(nh * L + i) * M + c] : 0.f;
  }
  // Row r = 16·warp + lane/2 belongs to lanes 2·(r mod 16) and +1 (half = lane % 2).
  const int r = warp * 16 + lane / 2, half = lane % 2;
  const int64_t qi = sm.qidx[r];
  const RowRange rg = sm.range(r);
  float m = -INFINITY, l = 0.f;
  if (!first && qi >= 0) load_row_state(a, nh * L + qi, m, l);

  int64_t kb_lo, kb_hi;
  key_tiles_of(P, a, t, kb_lo, kb_hi);
  for (int64_t kb = kb_lo; kb <= kb_hi; ++kb) {
    const int64_t j0 = kb * kBk;
    stage_tile([&] { stage_key(P, j0, sm.kidx); },
               [&] {
                 load_rows_t(sm.ks, hb.k, sm.kidx, kBk, E, Ep);
                 load_rows_t(sm.vs, hb.v, sm.kidx, kBk, M, Mp);
               });
    // S (this warp's 16 rows × 32 keys) = Q·K^T.
    wmma_tiles::band_scores(sm.ss + warp * 16 * kBk, sm.qs + warp * 16 * Ep,
                            static_cast<unsigned>(Ep), sm.ks, static_cast<unsigned>(Ep), Ep);
    __syncwarp();
    // Mask, online softmax: this lane's 16 keys of row r.
    float sv[16], tmax = -INFINITY;
    for (int u = 0; u < 16; ++u) {
      const int c = pair_col(lane, u);
      const int64_t jo = j0 + c, ko = sm.kidx[c];
      const bool keep = qi >= 0 && keeps(a, n, h, len, rg, qi, jo, ko);
      sv[u] = keep ? sm.ss[r * kBk + c] * a.scale : -INFINITY;
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
        sm.ps[r * kBk + pair_col(lane, u)] = from_float<T>(p);
      }
      m = m_new;
    } else {
      for (int u = 0; u < 16; ++u) sm.ps[r * kBk + pair_col(lane, u)] = from_float<T>(0.f);
    }
    psum += __shfl_xor_sync(0xffffffffu, psum, 1);
    l = l * alpha + psum;
    if (alpha != 1.f)
      for (int64_t x = half; x < Mp; x += 2) sm.os[r * Mp + (x + 2 * (lane >> 1)) % Mp] *= alpha;
    __syncwarp();
    // O (this warp's 16 rows) += P·V.
    wmma_tiles::band_mma_rows(sm.os + warp * 16 * Mp, static_cast<unsigned>(Mp),
                              sm.ps + warp * 16 * kBk, kBk, sm.vs, static_cast<unsigned>(Mp), Mp);
    __syncwarp();
  }

  if (qi < 0) return;  // no barrier follows
  const int64_t row = nh * L + qi;
  if (last) {
    const float inv = l > 0.f ? 1.f / l : 0.f;
    for (int64_t c = half; c < M; c += 2) store_out<T>(a, row * M + c, sm.os[r * Mp + c] * inv);
  } else {
    for (int64_t c = half; c < M; c += 2) a.ws_acc[row * M + c] = sm.os[r * Mp + c];
  }
  if (half == 0) store_row_state(a, row, m, l, last);
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

// ---- launcher -----------------------------------------------------------------------

template <typename T>
struct ForwardLaunch {
  const BlockSparseForwardCudaArgs& a;
  int part;
  cudaStream_t stream;
  template <int DC>
  void operator()() const {
    launch_kernel(forward_kernel<T, DC>, cuda::ceil_div(a.L, kBq) * a.N * a.H, kThreads,
                  smem_bytes<ForwardSmem>(a.E, a.M), stream, "block_sparse_attention_forward", a,
                  part);
  }
};

// One part's forward: tensor cores for float16 / bfloat16 where the device's
// code has them, else SIMT (float32; bfloat16 before sm_80).
template <typename T>
void launch_forward(const BlockSparseForwardCudaArgs& a, int part, int dc, cudaStream_t stream) {
  if constexpr (cuda::wmma_min_arch<T>() > 0) {
    if (FA_USE_TENSOR_CORES(T, "block_sparse_attention_forward", forward_wmma_kernel<T>)) {
      launch_kernel(forward_wmma_kernel<T>, cuda::ceil_div(a.L, kBq) * a.N * a.H, kWmmaThreads,
                    smem_bytes<ForwardWmmaSmem<T>>(round16(a.E), round16(a.M)), stream,
                    "block_sparse_attention_forward (tensor cores)", a, part);
      return;
    }
  }
  if constexpr (!cuda::wmma_always<T>()) dispatch_chunks(dc, ForwardLaunch<T>{a, part, stream});
}

}  // namespace

void block_sparse_attention_forward_cuda(const BlockSparseForwardCudaArgs& a, cudaStream_t stream) {
  if (a.N * a.H == 0 || a.L == 0) return;
  const int dc = dim_chunks(a);
  FA_DISPATCH_FLOAT_TYPES(a.dtype, "block_sparse_attention_forward", [&] {
    for (int part = 0; part < a.num_parts; ++part) launch_forward<scalar_t>(a, part, dc, stream);
  });
}

}  // namespace fastattn::cuda
