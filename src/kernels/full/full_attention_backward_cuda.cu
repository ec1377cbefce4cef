// The backward of the fused full-attention CUDA kernels: the SIMT kernel
// (float32; bfloat16 below sm_80), the tensor-core kernel (float16/bfloat16),
// the dQ workspace passes, their launchers and full_attention_backward_cuda.
// Design, cost and tests: full_attention_cuda_common.cuh.
#include "kernels/full/full_attention_cuda_common.cuh"

namespace fastattn::cuda {
namespace {

// The backward block's key tile: keys [j0, j0 + rows_k) of head b.nh, of
// which the first `cols` are within the key length (kept); gk, gv: their rows
// of dK and dV.
template <typename T>
struct BwdKeyTile {
  int64_t j0, rows_k, cols;
  T* gk;
  T* gv;
  __device__ __forceinline__ BwdKeyTile(const FullAttentionBackwardCudaArgs& a,
                                        const FullBlock<T>& b, int BC)
      : j0(b.start),
        rows_k(a.S - j0 < BC ? a.S - j0 : BC),
        cols(kept_keys(a, b.n, j0, BC)),
        gk(static_cast<T*>(a.grad_k) + (b.nh * a.S + j0) * a.E),
        gv(static_cast<T*>(a.grad_v) + (b.nh * a.S + j0) * a.M) {}

  static __device__ __forceinline__ int64_t kept_keys(const FullAttentionBackwardCudaArgs& a,
                                                      int64_t n, int64_t j0, int BC) {
    const int64_t len = a.key_lengths ? a.key_lengths[n] : a.S;
    return len - j0 < BC ? (len - j0 > 0 ? len - j0 : 0) : BC;
  }
};

// The first query tile (tiles of BR) that may see keys from j0: i >= j0 -
// offset when causal.
template <int BR>
__device__ __forceinline__ int64_t first_query_tile(const FullAttentionCudaParams& a, int64_t j0,
                                                    int64_t offset) {
  const int64_t i_start = a.causal && j0 - offset > 0 ? j0 - offset : 0;
  return i_start / BR * BR;
}

// The query tile of the step from i0 (`rows` real queries of BR) into the
// layout's Q and dO tiles (every backward layout has q, ldq, dout, lddo, lse,
// delta), with its rows' lse (times log2 e when LSE_BASE2) and delta; -inf
// and 0 beyond `rows`. doh: dO of head b.nh.
template <int BR, bool LSE_BASE2, typename T, typename Smem>
__device__ __forceinline__ void load_query_tile(const Smem& sm, const FullBlock<T>& b,
                                                const FullAttentionBackwardCudaArgs& a,
                                                const T* doh, int64_t i0, int64_t rows, int Ep,
                                                int Mp) {
  constexpr float kLog2e = 1.4426950408889634f;
  load_tile(sm.q, sm.ldq, b.q + i0 * b.E, rows, b.E, BR, Ep);
  load_tile(sm.dout, sm.lddo, doh + i0 * b.M, rows, b.M, BR, Mp);
  const float* lse = a.lse + b.nh * b.L + i0;
  const float* delta = a.delta + b.nh * b.L + i0;
  for (int r = threadIdx.x; r < BR; r += kThreads) {
    sm.lse[r] = r < rows ? (LSE_BASE2 ? lse[r] * kLog2e : lse[r]) : -INFINITY;
    sm.delta[r] = r < rows ? delta[r] : 0.f;
  }
}

// The dQ tile (rows × E, leading dim ld) added into the float32 workspace at
// the step's queries.
template <typename T>
__device__ __forceinline__ void add_dq_tile(const FullAttentionBackwardCudaArgs& a,
                                            const FullBlock<T>& b, int64_t i0, int64_t rows,
                                            const float* dq, int ld) {
  const int64_t E = b.E;
  float* ws = a.dq_workspace + (b.nh * b.L + i0) * E;
  for (int idx = threadIdx.x; idx < rows * E; idx += kThreads) {
    const int r = idx / E, c = idx % E;
    atomicAdd(ws + idx, dq[r * ld + c]);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    full_backward_kernel(FullAttentionBackwardCudaArgs a, int Ep, int Mp, int64_t k_tiles) {
  using C = FullCfg<T, false>;
  constexpr int BR = C::kBwdBr, BC = C::kBwdBc;
  const BwdSmem<T> sm = carve_smem<BwdSmem<T>>(Ep, Mp);
  const FullBlock<T> b(a, k_tiles, BC);
  const BwdKeyTile<T> kt(a, b, BC);
  const int64_t L = b.L, E = b.E, M = b.M, j0 = kt.j0, cols = kt.cols;
  const int tid = threadIdx.x;

  if (cols > 0) {
    const T* doh = static_cast<const T*>(a.grad_out) + b.nh * L * M;
    load_kv_tile<BC>(sm, b, j0, cols, Ep, Mp);
    for (int idx = tid; idx < BC * Ep; idx += kThreads) sm.dk[(idx / Ep) * sm.lde + idx % Ep] = 0.f;
    for (int idx = tid; idx < BC * Mp; idx += kThreads) sm.dv[(idx / Mp) * sm.ldm + idx % Mp] = 0.f;
    for (int64_t i0 = first_query_tile<BR>(a, j0, b.offset); i0 < L; i0 += BR) {
      const int64_t rows = L - i0 < BR ? L - i0 : BR;
      __syncthreads();  // the previous step's tiles are no longer read
      load_query_tile<BR, false>(sm, b, a, doh, i0, rows, Ep, Mp);
      __syncthreads();
      block_mm<T, false, true, false>(sm.s, sm.ldsf, sm.q, sm.ldq, sm.k, sm.ldk, BR, BC, Ep, false);
      __syncthreads();
      // P = exp(S·scale + mask - lse), zero where dropped.
      for (int idx = tid; idx < BR * BC; idx += kThreads) {
        const int r = idx / BC, c = idx % BC;
        const int64_t i = i0 + r, j = j0 + c;
        const float lse = sm.lse[r];
        float p = 0.f;
        if (r < rows && c < cols && (!a.causal || j <= i + b.offset) && lse != -INFINITY) {
          float s = sm.s[r * sm.ldsf + c] * a.scale;
          if (b.mask) s += to_float(b.mask[b.n * a.mask_sn + b.h * a.mask_sh + i * a.mask_sl + j]);
          p = expf(s - lse);
        }
        sm.s[r * sm.ldsf + c] = p;
        sm.p[r * sm.ldp + c] = from_float<T>(p);
      }
      __syncthreads();
      // dV += P^T dO ; dP = dO V^T
      block_mm<T, true, false, false>(sm.dv, sm.ldm, sm.p, sm.ldp, sm.dout, sm.lddo, BC, Mp, BR,
                                      true);
      block_mm<T, false, true, false>(sm.dp, sm.ldsf, sm.dout, sm.lddo, sm.v, sm.ldv, BR, BC, Mp,
                                      false);
      __syncthreads();
      // dS = P ∘ (dP - delta) · scale
      for (int idx = tid; idx < BR * BC; idx += kThreads) {
        const int r = idx / BC, c = idx % BC;
        const float ds = sm.s[r * sm.ldsf + c] * (sm.dp[r * sm.ldsf + c] - sm.delta[r]) * a.scale;
        sm.ds[r * sm.ldp + c] = from_float<T>(ds);
      }
      __syncthreads();
      // dK += dS^T Q ; dQ tile = dS K (over S and dP, no longer read)
      block_mm<T, true, false, false>(sm.dk, sm.lde, sm.ds, sm.ldp, sm.q, sm.ldq, BC, Ep, BR, true);
      block_mm<T, false, false, false>(sm.dq, sm.lde, sm.ds, sm.ldp, sm.k, sm.ldk, BR, Ep, BC,
                                       false);
      __syncthreads();
      add_dq_tile(a, b, i0, rows, sm.dq, sm.lde);
    }
    __syncthreads();
  }
  // Keys at or beyond the key length get zero gradients.
  for (int idx = tid; idx < kt.rows_k * E; idx += kThreads) {
    const int r = idx / E, c = idx % E;
    const float g = r < cols ? sm.dk[r * sm.lde + c] : 0.f;
    kt.gk[idx] = from_float<T>(a.accumulate ? to_float(kt.gk[idx]) + g : g);
  }
  for (int idx = tid; idx < kt.rows_k * M; idx += kThreads) {
    const int r = idx / M, c = idx % M;
    const float g = r < cols ? sm.dv[r * sm.ldm + c] : 0.f;
    kt.gv[idx] = from_float<T>(a.accumulate ? to_float(kt.gv[idx]) + g : g);
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

// A warp's 16×16 tile dst = A·B^T, A and B 16 rows of nf·16 (<= DF·16)
// columns, row-major (B read as a column-major matrix_b).
template <typename T, int DF>
__device__ __forceinline__ void warp_tile_abt(float* dst, int ldd, const T* A, int lda, const T* B,
                                              int ldb, int nf) {
  using ARow = fa_wmma::fragment<fa_wmma::matrix_a, 16, 16, 16, T, fa_wmma::row_major>;
  using BCol = fa_wmma::fragment<fa_wmma::matrix_b, 16, 16, 16, T, fa_wmma::col_major>;
  fa_wmma::fragment<fa_wmma::accumulator, 16, 16, 16, float> acc;
  fa_wmma::fill_fragment(acc, 0.f);
  FA_UNROLL
  for (int f = 0; f < DF; ++f) {
    if (f < nf) {
      ARow fa;
      BCol fb;
      fa_wmma::load_matrix_sync(fa, A + 16 * f, lda);
      fa_wmma::load_matrix_sync(fb, B + 16 * f, ldb);
      fa_wmma::mma_sync(acc, fa, fb, acc);
    }
  }
  fa_wmma::store_matrix_sync(dst, acc, ldd, fa_wmma::mem_row_major);
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
  const BwdTcSmem<T> sm = carve_smem<BwdTcSmem<T>>(Ep, Mp);
  const FullBlock<T> b(a, k_tiles, BC);
  const BwdKeyTile<T> kt(a, b, BC);
  const int64_t L = b.L, E = b.E, M = b.M, j0 = kt.j0, cols = kt.cols;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int k0 = 16 * warp;  // this warp's keys within the tile
  const int ef = Ep / 16, mf = Mp / 16;
  if (cols == 0) {  // no kept key in this tile: zero gradients
    for (int idx = tid; idx < kt.rows_k * E; idx += kThreads) {
      if (!a.accumulate) kt.gk[idx] = from_float<T>(0.f);
    }
    for (int idx = tid; idx < kt.rows_k * M; idx += kThreads) {
      if (!a.accumulate) kt.gv[idx] = from_float<T>(0.f);
    }
    return;
  }
  const T* doh = static_cast<const T*>(a.grad_out) + b.nh * L * M;
  load_kv_tile<BC>(sm, b, j0, cols, Ep, Mp);
  AccFrag dk[DF], dv[DF];
  FA_UNROLL
  for (int f = 0; f < DF; ++f) {
    fa_wmma::fill_fragment(dk[f], 0.f);
    fa_wmma::fill_fragment(dv[f], 0.f);
  }
  float* Stw = sm.st + k0 * sm.ldst;  // the warp's strips
  float* dPtw = sm.dpt + k0 * sm.ldst;
  T* Ptw = sm.pt + k0 * sm.ldpt;
  T* dStw = sm.dst + k0 * sm.ldpt;
  for (int64_t i0 = first_query_tile<BR>(a, j0, b.offset); i0 < L; i0 += BR) {
    const int64_t rows = L - i0 < BR ? L - i0 : BR;
    __syncthreads();  // the previous step's tiles (and the dQ tile) are no longer read
    load_query_tile<BR, true>(sm, b, a, doh, i0, rows, Ep, Mp);  // lse in base 2
    __syncthreads();
    // S^T strip (16 × BR) = K_w · Q^T ; dP^T strip = V_w · dO^T
    FA_UNROLL
    for (int c = 0; c < BR / 16; ++c) {
      warp_tile_abt<T, DF>(Stw + 16 * c, sm.ldst, sm.k + k0 * sm.ldk, sm.ldk,
                           sm.q + 16 * c * sm.ldq, sm.ldq, ef);
      warp_tile_abt<T, DF>(dPtw + 16 * c, sm.ldst, sm.v + k0 * sm.ldv, sm.ldv,
                           sm.dout + 16 * c * sm.lddo, sm.lddo, mf);
    }
    __syncwarp();
    // P^T = exp(S^T·scale + mask^T - lse) (0 where dropped), dS^T = P^T∘(dP^T - delta)·scale
    for (int idx = lane; idx < 16 * BR; idx += 32) {
      const int rr = idx / BR, c = idx % BR;
      const int64_t j = j0 + k0 + rr, i = i0 + c;
      const float lse = sm.lse[c];
      float p = 0.f;
      if (k0 + rr < cols && c < rows && (!a.causal || j <= i + b.offset) && lse != -INFINITY) {
        float s = Stw[rr * sm.ldst + c] * scale2;
        if (b.mask) {
          s += to_float(b.mask[b.n * a.mask_sn + b.h * a.mask_sh + i * a.mask_sl + j]) * kLog2e;
        }
        p = exp2f(s - lse);
      }
      Ptw[rr * sm.ldpt + c] = from_float<T>(p);
      dStw[rr * sm.ldpt + c] = from_float<T>(p * (dPtw[rr * sm.ldst + c] - sm.delta[c]) * a.scale);
    }
    __syncwarp();
    // dV_w += P^T · dO ; dK_w += dS^T · Q
    FA_UNROLL
    for (int c = 0; c < BR / 16; ++c) {
      ARow pa, dsa;
      fa_wmma::load_matrix_sync(pa, Ptw + 16 * c, sm.ldpt);
      fa_wmma::load_matrix_sync(dsa, dStw + 16 * c, sm.ldpt);
      FA_UNROLL
      for (int f = 0; f < DF; ++f) {
        if (f < mf) {
          BRow dob;
          fa_wmma::load_matrix_sync(dob, sm.dout + 16 * c * sm.lddo + 16 * f, sm.lddo);
          fa_wmma::mma_sync(dv[f], pa, dob, dv[f]);
        }
        if (f < ef) {
          BRow qb;
          fa_wmma::load_matrix_sync(qb, sm.q + 16 * c * sm.ldq + 16 * f, sm.ldq);
          fa_wmma::mma_sync(dk[f], dsa, qb, dk[f]);
        }
      }
    }
    __syncthreads();  // every dS^T strip written; S^T and dP^T no longer read
    // dQ tile (BR × Ep) = dS · K, dS = (dS^T)^T read column-major.
    block_mm<T, true, false, true>(sm.dq, sm.lde, sm.dst, sm.ldpt, sm.k, sm.ldk, BR, Ep, BC, false);
    __syncthreads();
    add_dq_tile(a, b, i0, rows, sm.dq, sm.lde);
  }
  __syncthreads();  // the dQ tile is no longer read: the strips stage dK and dV
  // dK, dV rows of the warp's keys (zero beyond the key length).
  const int64_t my_rows = kt.rows_k - k0;  // may be <= 0
  FA_UNROLL
  for (int f = 0; f < DF; ++f) {
    for (int which = 0; which < 2; ++which) {
      const bool is_k = which == 0;
      if (f >= (is_k ? ef : mf)) continue;
      fa_wmma::store_matrix_sync(Stw, is_k ? dk[f] : dv[f], sm.ldst, fa_wmma::mem_row_major);
      __syncwarp();
      const int64_t D = is_k ? E : M;
      T* g = is_k ? kt.gk : kt.gv;
      for (int idx = lane; idx < 256; idx += 32) {
        const int rr = idx / 16, c = 16 * f + idx % 16;
        if (rr < my_rows && c < D) {
          const float x = k0 + rr < cols ? Stw[rr * sm.ldst + idx % 16] : 0.f;
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

dim3 elementwise_grid(int64_t count) {
  const int64_t blocks = ceil_div(count, 256);
  return dim3(static_cast<unsigned>(blocks < 4096 ? blocks : 4096));
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
      const size_t bytes = smem_bytes<BwdTcSmem<T>>(Ep, Mp);
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
    const size_t bytes = smem_bytes<BwdSmem<T>>(Ep, Mp);
    FA_SET_MAX_DYNAMIC_SHARED(bytes, full_backward_kernel<T>);
    FA_LAUNCH(grid, block, bytes, stream, full_backward_kernel<T>)(a, Ep, Mp, k_tiles);
    FA_CHECK_LAUNCH("full_attention_backward");
  }
}

}  // namespace

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
