// The forward of the fused full-attention CUDA kernels: the SIMT kernel
// (float32; bfloat16 below sm_80), the tensor-core kernel (float16/bfloat16),
// their launcher and full_attention_forward_cuda. Design, cost and tests:
// full_attention_cuda_common.cuh.
#include "kernels/full/full_attention_cuda_common.cuh"

namespace fastattn::cuda {
namespace {

// The keys [0, end) that the `rows` queries from i0 of batch n may see (key
// length, causal limit of the tile's last row).
template <typename T>
__device__ __forceinline__ int64_t query_tile_key_end(const FullAttentionCudaParams& a,
                                                      const FullBlock<T>& b, int64_t i0,
                                                      int64_t rows) {
  int64_t kend = a.key_lengths ? a.key_lengths[b.n] : b.S;
  if (a.causal && i0 + rows + b.offset < kend) kend = i0 + rows + b.offset;
  if (kend < 0) kend = 0;
  return kend;
}

// The running max (-inf) and sum (0) of the BR rows.
template <int BR>
__device__ __forceinline__ void init_row_stats(float* m, float* l) {
  for (int r = threadIdx.x; r < BR; r += kThreads) {
    m[r] = -INFINITY;
    l[r] = 0.f;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    full_forward_kernel(FullAttentionForwardCudaArgs a, int Ep, int Mp, int64_t q_tiles) {
  using C = FullCfg<T, false>;
  constexpr int BR = C::kFwdBr, BC = C::kFwdBc, PER_LANE = BC / 32;
  const FwdSmem<T> sm = carve_smem<FwdSmem<T>>(Ep, Mp);
  const FullBlock<T> b(a, q_tiles, BR);
  const int64_t L = b.L, E = b.E, M = b.M, i0 = b.start;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const T zero = from_float<T>(0.f);

  const int64_t rows = L - i0 < BR ? L - i0 : BR;
  load_tile(sm.q, sm.ldq, b.q + i0 * E, rows, E, BR, Ep);
  for (int idx = tid; idx < BR * Mp; idx += kThreads) sm.o[(idx / Mp) * sm.ldo + idx % Mp] = 0.f;
  init_row_stats<BR>(sm.m, sm.l);
  const int64_t kend = query_tile_key_end(a, b, i0, rows);

  for (int64_t j0 = 0; j0 < kend; j0 += BC) {
    const int64_t cols = kend - j0 < BC ? kend - j0 : BC;
    __syncthreads();  // the previous tile's K, V and P are no longer read
    load_kv_tile<BC>(sm, b, j0, cols, Ep, Mp);
    __syncthreads();
    block_mm<T, false, true, false>(sm.s, sm.lds, sm.q, sm.ldq, sm.k, sm.ldk, BR, BC, Ep, false);
    __syncthreads();
    // Online softmax, one warp per row.
    for (int r = warp; r < BR; r += kWarps) {
      const int64_t i = i0 + r;
      const float m_old = sm.m[r], l_old = sm.l[r];
      const T* mrow =
          b.mask ? b.mask + b.n * a.mask_sn + b.h * a.mask_sh + i * a.mask_sl + j0 : nullptr;
      float x[PER_LANE];
      float mx = -INFINITY;
      for (int u = 0; u < PER_LANE; ++u) {
        const int c = lane + 32 * u;
        const bool keep = i < L && c < cols && (!a.causal || j0 + c <= i + b.offset);
        float s = -INFINITY;
        if (keep) {
          s = sm.s[r * sm.lds + c] * a.scale;
          if (mrow) s += to_float(mrow[c]);
        }
        x[u] = s;
        mx = fmaxf(mx, s);
      }
      mx = warp_max(mx);
      const float m_new = fmaxf(m_old, mx);
      if (m_new == -INFINITY) {  // nothing kept so far in this row
        for (int u = 0; u < PER_LANE; ++u) sm.p[r * sm.ldp + lane + 32 * u] = zero;
        continue;
      }
      float sum = 0.f;
      for (int u = 0; u < PER_LANE; ++u) {
        const float p = expf(x[u] - m_new);
        sm.p[r * sm.ldp + lane + 32 * u] = from_float<T>(p);
        sum += p;
      }
      sum = warp_sum(sum);
      const float alpha = expf(m_old - m_new);  // 0 when m_old is -inf
      if (lane == 0) {
        sm.m[r] = m_new;
        sm.l[r] = l_old * alpha + sum;
      }
      if (alpha != 1.f) {
        for (int c = lane; c < Mp; c += 32) sm.o[r * sm.ldo + c] *= alpha;
      }
    }
    __syncthreads();
    block_mm<T, false, false, false>(sm.o, sm.ldo, sm.p, sm.ldp, sm.v, sm.ldv, BR, Mp, BC, true);
  }
  __syncthreads();
  T* out = static_cast<T*>(a.out) + (b.nh * L + i0) * M;
  for (int idx = tid; idx < rows * M; idx += kThreads) {
    const int r = idx / M, c = idx % M;
    const float l = sm.l[r];
    out[idx] = from_float<T>(l > 0.f ? sm.o[r * sm.ldo + c] / l : 0.f);
  }
  for (int r = tid; r < rows; r += kThreads) {
    const float l = sm.l[r];
    a.lse[b.nh * L + i0 + r] = l > 0.f ? sm.m[r] + logf(l) : -INFINITY;
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
  const FwdTcSmem<T> sm = carve_smem<FwdTcSmem<T>>(Ep, Mp);
  const FullBlock<T> b(a, q_tiles, BR);
  const int64_t L = b.L, E = b.E, M = b.M, i0 = b.start;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int r0 = 16 * warp;  // this warp's rows of the tile
  const int ef = Ep / 16, mf = Mp / 16;

  const int64_t rows = L - i0 < BR ? L - i0 : BR;
  load_tile(sm.q, sm.ldq, b.q + i0 * E, rows, E, BR, Ep);
  for (int idx = tid; idx < 256; idx += kThreads) sm.row_ids[idx] = static_cast<float>(idx / 16);
  init_row_stats<BR>(sm.m, sm.l);
  __syncthreads();
  AFrag qf[DF];
  AccFrag of[DF];
  // row_of[e]: the row (0..15) of element e of any accumulator fragment.
  constexpr int NE = AccFrag::num_elements;
  int row_of[NE];
  {
    AccFrag rowf;
    fa_wmma::load_matrix_sync(rowf, sm.row_ids, 16, fa_wmma::mem_row_major);
    for (int e = 0; e < NE; ++e) row_of[e] = r0 + static_cast<int>(rowf.x[e]);
  }
  FA_UNROLL
  for (int f = 0; f < DF; ++f) {
    if (f < ef) fa_wmma::load_matrix_sync(qf[f], sm.q + r0 * sm.ldq + 16 * f, sm.ldq);
    fa_wmma::fill_fragment(of[f], 0.f);
  }
  const int64_t kend = query_tile_key_end(a, b, i0, rows);
  float* Sw = sm.s + r0 * sm.lds;  // the warp's strips of S and P
  T* Pw = sm.p + r0 * sm.ldp;

  for (int64_t j0 = 0; j0 < kend; j0 += BC) {
    const int64_t cols = kend - j0 < BC ? kend - j0 : BC;
    __syncthreads();  // the previous tile's K and V are no longer read
    load_kv_tile<BC>(sm, b, j0, cols, Ep, Mp);
    __syncthreads();
    // S strip (16 × BC) = Q strip · K^T
    FA_UNROLL
    for (int c = 0; c < BC / 16; ++c) {
      AccFrag acc;
      fa_wmma::fill_fragment(acc, 0.f);
      FA_UNROLL
      for (int f = 0; f < DF; ++f) {
        if (f < ef) {
          fa_wmma::fragment<fa_wmma::matrix_b, 16, 16, 16, T, fa_wmma::col_major> kb;
          fa_wmma::load_matrix_sync(kb, sm.k + 16 * c * sm.ldk + 16 * f, sm.ldk);
          fa_wmma::mma_sync(acc, qf[f], kb, acc);
        }
      }
      fa_wmma::store_matrix_sync(Sw + 16 * c, acc, sm.lds, fa_wmma::mem_row_major);
    }
    __syncwarp();
    // Online softmax of the warp's rows in base 2 (m holds max·log2 e): two
    // lanes per row, 32 columns each, visited in a per-lane rotation so the 32
    // lanes read 32 different banks. `rescale` (the same in every lane) when
    // some row's running max moved.
    bool rescale;
    {
      const int rr = lane >> 1, hh = lane & 1;
      const int r = r0 + rr;
      const int64_t i = i0 + r;
      const float m_old = sm.m[r], l_old = sm.l[r];
      int64_t limit = i < L ? cols : 0;  // kept columns of this row: c < limit
      if (a.causal && i + b.offset - j0 + 1 < limit) limit = i + b.offset - j0 + 1;
      const T* mrow = b.mask && i < L
                          ? b.mask + b.n * a.mask_sn + b.h * a.mask_sh + i * a.mask_sl + j0
                          : nullptr;
      const int rot = 2 * (rr >> 3) + hh;
      float x[HALF];
      float mx = -INFINITY;
      FA_UNROLL
      for (int u = 0; u < HALF; ++u) {
        const int c = hh * HALF + ((u + rot) & (HALF - 1));
        float s = -INFINITY;
        if (c < limit) {
          s = Sw[rr * sm.lds + c] * scale2;
          if (mrow) s += to_float(mrow[c]) * kLog2e;
        }
        x[u] = s;
        mx = fmaxf(mx, s);
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      const float m_new = fmaxf(m_old, mx);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;  // rows with nothing kept: p = 0
      float sum = 0.f;
      FA_UNROLL
      for (int u = 0; u < HALF; ++u) {
        const float p = exp2f(x[u] - m_use);
        Pw[rr * sm.ldp + hh * HALF + ((u + rot) & (HALF - 1))] = from_float<T>(p);
        sum += p;
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      const float alpha = m_new == -INFINITY ? 1.f : exp2f(m_old - m_new);  // 0 if m_old = -inf
      if (hh == 0) {
        sm.m[r] = m_new;
        sm.l[r] = l_old * alpha + sum;
        sm.alpha[r] = alpha;
      }
      rescale = __any_sync(0xffffffffu, alpha != 1.f);
    }
    __syncwarp();
    // O strip = O strip · diag(alpha) + P strip · V
    if (rescale) {
      FA_UNROLL
      for (int f = 0; f < DF; ++f) {
        for (int e = 0; e < NE; ++e) of[f].x[e] *= sm.alpha[row_of[e]];
      }
    }
    FA_UNROLL
    for (int c = 0; c < BC / 16; ++c) {
      AFrag pa;
      fa_wmma::load_matrix_sync(pa, Pw + 16 * c, sm.ldp);
      FA_UNROLL
      for (int f = 0; f < DF; ++f) {
        if (f < mf) {
          fa_wmma::fragment<fa_wmma::matrix_b, 16, 16, 16, T, fa_wmma::row_major> vb;
          fa_wmma::load_matrix_sync(vb, sm.v + 16 * c * sm.ldv + 16 * f, sm.ldv);
          fa_wmma::mma_sync(of[f], pa, vb, of[f]);
        }
      }
    }
  }
  // out = O / l (0 for rows without keys), through the warp's S strip.
  __syncwarp();
  if (lane < 16) {
    const float l = sm.l[r0 + lane];
    sm.alpha[r0 + lane] = l > 0.f ? 1.f / l : 0.f;
  }
  __syncwarp();
  T* out = static_cast<T*>(a.out) + (b.nh * L + i0 + r0) * M;
  const int64_t my_rows = rows - r0;  // may be <= 0
  FA_UNROLL
  for (int f = 0; f < DF; ++f) {
    if (f < mf) {
      for (int e = 0; e < NE; ++e) of[f].x[e] *= sm.alpha[row_of[e]];
      fa_wmma::store_matrix_sync(Sw, of[f], sm.lds, fa_wmma::mem_row_major);
      __syncwarp();
      for (int idx = lane; idx < 256; idx += 32) {
        const int rr = idx / 16, c = 16 * f + idx % 16;
        if (rr < my_rows && c < M) out[rr * M + c] = from_float<T>(Sw[rr * sm.lds + idx % 16]);
      }
      __syncwarp();
    }
  }
  if (lane < 16 && lane < my_rows) {
    const float l = sm.l[r0 + lane];
    a.lse[b.nh * L + i0 + r0 + lane] = l > 0.f ? sm.m[r0 + lane] * kLn2 + logf(l) : -INFINITY;
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
      const size_t bytes = smem_bytes<FwdTcSmem<T>>(Ep, Mp);
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
    const size_t bytes = smem_bytes<FwdSmem<T>>(Ep, Mp);
    FA_SET_MAX_DYNAMIC_SHARED(bytes, full_forward_kernel<T>);
    FA_LAUNCH(grid, dim3(kThreads), bytes, stream, full_forward_kernel<T>)(a, Ep, Mp, q_tiles);
    FA_CHECK_LAUNCH("full_attention_forward");
  }
}

}  // namespace

void full_attention_forward_cuda(const FullAttentionForwardCudaArgs& a, cudaStream_t stream) {
  if (a.N * a.H == 0 || a.L == 0) return;
  check_dims(a, "full_attention_forward");
  FA_DISPATCH_FLOAT_TYPES(a.dtype, "full_attention_forward",
                          [&] { launch_forward<scalar_t>(a, stream); });
}

}  // namespace fastattn::cuda
