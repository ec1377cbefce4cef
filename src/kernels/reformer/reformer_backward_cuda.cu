// The backward CUDA kernels of Reformer LSH attention and their launcher
// (reformer_backward_cuda): the chunk-window gradients of every round at once
// (SIMT and tensor cores) into float32 workspaces, then the key
// normalisation's gradient and the conversion. See reformer_cuda_common.cuh
// for the design.
#include "kernels/reformer/reformer_cuda_common.cuh"

namespace fastattn::cuda {
namespace {

// ---- backward: shared pieces ---------------------------------------------------

// The operands of head nh in the backward: q and v, grad_out and the
// float32 accumulators of dq, dk and dv in the workspace.
template <typename T>
struct BackwardOperands : HeadInputs<T> {
  const T* go;  // (L, M)
  float* gq;    // (L, E)
  float* gk;    // (L, E)
  float* gv;    // (L, M)
  __device__ __forceinline__ BackwardOperands(const ReformerBackwardCudaArgs& a, int64_t nh)
      : HeadInputs<T>(a, nh),
        go(static_cast<const T*>(a.grad_out) + nh * a.L * a.M),
        gq(a.workspace + nh * a.L * a.E),
        gk(a.workspace + a.N * a.H * a.L * a.E + nh * a.L * a.E),
        gv(a.workspace + 2 * a.N * a.H * a.L * a.E + nh * a.L * a.M) {}
};

// The tile's query positions into qpos and per query row the final stats
// (shi: max, slo: log sum) and delta, zeros past the chunk. No barrier.
__device__ __forceinline__ void load_query_stats(const ReformerBackwardCudaArgs& a,
                                                 const QueryTile& t, int64_t* qpos, float* shi,
                                                 float* slo, float* sdelta) {
  const int tid = threadIdx.x;
  if (tid < kBQ) {
    const int64_t p = t.query_pos(tid);
    qpos[tid] = p;
    if (p >= 0) {
      const double* st = a.stats + 2 * (t.nh * a.L + p);
      shi[tid] = static_cast<float>(st[0]);
      slo[tid] = static_cast<float>(st[1]);
      sdelta[tid] = a.delta[t.nh * a.L + p];
    } else {
      shi[tid] = slo[tid] = sdelta[tid] = 0.f;
    }
  }
}

// The warp's query rows against key kp (lane = key) of a tile: P recomputed
// from the final stats and dS = P ∘ (dP - delta)·scale, 0 at the replaced
// self score. dot(k, i) is row i's unscaled score dot product, dp(k, i) its
// dP (k: the row within the warp); put(i, p, ds) stores the results.
template <typename Dot, typename DP, typename Put>
__device__ __forceinline__ void grad_scores_tile(const ReformerCudaParams& a, const int64_t* qpos,
                                                 int64_t kp, const float* shi, const float* slo,
                                                 const float* sdelta, Dot dot, DP dp, Put put) {
  const int warp = threadIdx.x / 32;
  for (int k = 0; k < kRowsPerWarp; ++k) {
    const int i = warp * kRowsPerWarp + k;
    const int64_t qp = qpos[i];
    const float s = masked_score(a, dot(k, i), qp, kp);
    const float p = s == -INFINITY ? 0.f : expf((s - shi[i]) - slo[i]);
    float ds = p * (dp(k, i) - sdelta[i]) * a.scale;
    if (a.mask_self && kp == qp) ds = 0.f;  // the replaced self score is a constant
    put(i, p, ds);
  }
}

// g[pos[i]·D + d] += src[i·ld + d] (float atomics) for the rows i < kRows
// with a position (>= 0) and d < D.
template <int kRows>
__device__ __forceinline__ void scatter_add_rows(float* g, int D, const float* src, int ld,
                                                 const int64_t* pos) {
  for (int idx = threadIdx.x; idx < kRows * D; idx += kThreads) {
    const int i = idx / D, d = idx % D;
    const int64_t p = pos[i];
    if (p >= 0) atomicAdd(g + p * D + d, src[i * ld + d]);
  }
}

// SIMT key-tile gradient: g[kpos[j]·D + d] += (W^T·X)[j][d] for the keys j
// with a position, W (kBQ x kBK) the tile's dS or P, X (kBQ x D) the queries
// or dO.
__device__ __forceinline__ void scatter_key_gradient(float* g, int D, const float* w,
                                                     const float* x, const int64_t* kpos) {
  for (int idx = threadIdx.x; idx < kBK * D; idx += kThreads) {
    const int j = idx / D, d = idx % D;
    const int64_t p = kpos[j];
    if (p < 0) continue;
    atomicAdd(g + p * D + d, strided_dot<kBQ>(0.f, w + j, kBK, x + d, D));
  }
}

// ---- backward --------------------------------------------------------------

// Block: (query tile qt, chunk c, nh, round r).
template <typename T>
__global__ void backward_kernel(ReformerBackwardCudaArgs a, int64_t chunks, int64_t qtiles) {
  const int E = static_cast<int>(a.E), M = static_cast<int>(a.M);  // <= kReformerCudaMaxHeadDim
  const QueryTile t(a, chunks, qtiles, -1);
  if (t.empty()) return;  // whole block
  const BackwardOperands<T> in(a, t.nh);

  const SimtBackwardSmem sm = carve_smem<SimtBackwardSmem>(a.E, a.M);

  const int tid = threadIdx.x, lane = tid % 32;
  load_query_stats(a, t, sm.qpos, sm.shi, sm.slo, sm.sdelta);
  for (int idx = tid; idx < kBQ * E; idx += kThreads) sm.sdq[idx] = 0.f;
  __syncthreads();
  load_query_rows(in.q, E, sm.qpos, sm.sq);
  load_query_rows(in.go, M, sm.qpos, sm.sdo);

  for (int64_t kt = 0; kt < t.w.cols; kt += kBK) {
    load_key_tile(a, in, t, kt, sm.kpos, sm.sk, sm.sv);  // barriers: sq, sdo are ready too
    const int64_t kp = sm.kpos[lane];
    float dots[kRowsPerWarp], dps[kRowsPerWarp];
    warp_row_dots(sm.sq, E, sm.sk, E + 1, E, dots);
    warp_row_dots(sm.sdo, M, sm.sv, M + 1, M, dps);  // dP = dO·V^T
    grad_scores_tile(
        a, sm.qpos, kp, sm.shi, sm.slo, sm.sdelta, [&](int k, int) { return dots[k]; },
        [&](int k, int) { return dps[k]; },
        [&](int i, float p, float ds) {
          sm.sp[i * kBK + lane] = p;
          sm.sds[i * kBK + lane] = ds;
        });
    __syncthreads();
    // dQ += dS·K (as queries)
    for (int idx = tid; idx < kBQ * E; idx += kThreads) {
      const int i = idx / E, e = idx % E;
      sm.sdq[idx] += strided_dot<kBK>(0.f, sm.sds + i * kBK, 1, sm.sk + e, E + 1);
    }
    // dK += dS^T·Q (as normalised keys), dV += P^T·dO: scattered by atomics.
    scatter_key_gradient(in.gk, E, sm.sds, sm.sq, sm.kpos);
    scatter_key_gradient(in.gv, M, sm.sp, sm.sdo, sm.kpos);
    __syncthreads();
  }
  scatter_add_rows<kBQ>(in.gq, E, sm.sdq, E, sm.qpos);
}

// One warp per position: grad_q = dq + the key gradient through
// k = q / max(|q|, eps); grad_v = dv; both converted to T.
template <typename T>
__global__ void backward_finish_kernel(ReformerBackwardCudaArgs a, int64_t rows) {
  const int64_t E = a.E, M = a.M, L = a.L;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int64_t nh = row / L, i = row % L;
  const float* dq = a.workspace + row * E;
  const float* dk = a.workspace + rows * E + row * E;
  const float* dv = a.workspace + 2 * rows * E + row * M;
  const T* q = static_cast<const T*>(a.q) + row * E;
  T* grad_q = static_cast<T*>(a.grad_q) + row * E;
  T* grad_v = static_cast<T*>(a.grad_v) + row * M;
  for (int64_t d = lane; d < M; d += 32) grad_v[d] = from_float<T>(dv[d]);
  if (i >= valid_length(a, nh)) {
    for (int64_t e = lane; e < E; e += 32) grad_q[e] = from_float<T>(dq[e]);
    return;
  }
  float ss = 0.f;
  for (int64_t e = lane; e < E; e += 32) {
    const float x = to_float(q[e]);
    ss += x * x;
  }
  const float norm = sqrtf(warp_sum(ss));
  const float inv = 1.f / fmaxf(norm, kNormEps);
  float dot = 0.f;
  for (int64_t e = lane; e < E; e += 32) dot += to_float(q[e]) * inv * dk[e];
  dot = warp_sum(dot);
  for (int64_t e = lane; e < E; e += 32) {
    const float k = to_float(q[e]) * inv;
    const float g = norm > kNormEps ? (dk[e] - k * dot) * inv : dk[e] * inv;
    grad_q[e] = from_float<T>(dq[e] + g);
  }
}

// ---- backward on tensor cores (float16 / bfloat16) ----------------------------

// As backward_kernel, with the five products of a key tile as WMMA products:
// S = Q·K^T and dP = dO·V^T (one warp per 16 x 16 tile), dQ += dS·K (kept in
// shared memory), dK = dS^T·Q and dV = P^T·dO (then scattered by atomics).
// The normalised keys, P and dS are rounded to T for the products.
template <typename T>
__device__ __forceinline__ void backward_wmma(const ReformerBackwardCudaArgs& a, int64_t chunks,
                                              int64_t qtiles) {
  namespace wmma = fa_wmma;
  const int E = static_cast<int>(a.E), M = static_cast<int>(a.M);  // <= kReformerCudaMaxHeadDim
  const int Ep = round16(E), Mp = round16(M);
  const QueryTile t(a, chunks, qtiles, -1);
  if (t.empty()) return;  // whole block
  const BackwardOperands<T> in(a, t.nh);

  const WmmaBackwardSmem<T> sm = carve_smem<WmmaBackwardSmem<T>>(a.E, a.M);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  load_query_stats(a, t, sm.qpos, sm.shi, sm.slo, sm.sdelta);
  for (int idx = tid; idx < kBQ * Ep; idx += kThreads) sm.sdq[idx] = 0.f;
  __syncthreads();
  load_rows_padded<kBQ>(in.q, E, Ep, sm.qpos, sm.sqh);
  load_rows_padded<kBQ>(in.go, M, Mp, sm.qpos, sm.sdoh);

  for (int64_t kt = 0; kt < t.w.cols; kt += kBK) {
    load_key_tile_wmma(a, in, t, kt, sm.kpos, sm.skh, sm.svh);  // barriers: sqh, sdoh ready too
    {  // S = Q·K^T (warps 0, 1) and dP = dO·V^T (warps 2, 3), 16 keys each
      const bool scores = warp < 2;
      const int half = warp % 2, D = scores ? Ep : Mp;
      const T* xa = scores ? sm.sqh : sm.sdoh;
      const T* xb = (scores ? sm.skh : sm.svh) + half * 16 * D;
      WmmaAccumulator acc;
      wmma::fill_fragment(acc, 0.f);
      wmma_add_product<wmma::col_major>(acc, xa, D, xb, D, D);
      wmma::store_matrix_sync((scores ? sm.ss : sm.sdp) + half * 16, acc, kBK, wmma::mem_row_major);
    }
    __syncthreads();
    const int64_t kp = sm.kpos[lane];
    grad_scores_tile(
        a, sm.qpos, kp, sm.shi, sm.slo, sm.sdelta,
        [&](int, int i) { return sm.ss[i * kBK + lane]; },
        [&](int, int i) { return sm.sdp[i * kBK + lane]; },
        [&](int i, float p, float ds) {
          sm.sph[i * kBK + lane] = from_float<T>(p);
          sm.sdsh[i * kBK + lane] = from_float<T>(ds);
        });
    __syncthreads();
    // dQ (16 x Ep) += dS·K, accumulated in shared memory (one warp per tile).
    for (int u = warp; u < Ep / 16; u += kWarps) {
      WmmaAccumulator acc;
      wmma::load_matrix_sync(acc, sm.sdq + u * 16, Ep, wmma::mem_row_major);
      wmma_add_product<wmma::row_major>(acc, sm.sdsh, kBK, sm.skh + u * 16, Ep, kBK);
      wmma::store_matrix_sync(sm.sdq + u * 16, acc, Ep, wmma::mem_row_major);
    }
    // dK (32 x Ep) = dS^T·Q and dV (32 x Mp) = P^T·dO: 16 x 16 tiles over the warps.
    const int nk = 2 * (Ep / 16), nv = 2 * (Mp / 16);
    for (int u = warp; u < nk + nv; u += kWarps) {
      const bool keys = u < nk;
      const int v = keys ? u : u - nk, D = keys ? Ep : Mp;
      const int jt = v % 2, ct = v / 2;  // key half, column tile
      WmmaAccumulator acc;
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major> fa;  // (dS or P)^T
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> fb;  // Q or dO
      wmma::fill_fragment(acc, 0.f);
      wmma::load_matrix_sync(fa, (keys ? sm.sdsh : sm.sph) + jt * 16, kBK);
      wmma::load_matrix_sync(fb, (keys ? sm.sqh : sm.sdoh) + ct * 16, D);
      wmma::mma_sync(acc, fa, fb, acc);
      wmma::store_matrix_sync((keys ? sm.sdk : sm.sdv) + jt * 16 * D + ct * 16, acc, D,
                              wmma::mem_row_major);
    }
    __syncthreads();
    scatter_add_rows<kBK>(in.gk, E, sm.sdk, Ep, sm.kpos);
    scatter_add_rows<kBK>(in.gv, M, sm.sdv, Mp, sm.kpos);
    __syncthreads();
  }
  scatter_add_rows<kBQ>(in.gq, E, sm.sdq, Ep, sm.qpos);
}

template <typename T>
__global__ void backward_wmma_kernel(ReformerBackwardCudaArgs a, int64_t chunks, int64_t qtiles) {
  if constexpr (cuda::wmma_compiled<T>()) {
    backward_wmma<T>(a, chunks, qtiles);
  } else {
    FA_TRAP();
  }
}

// The backward's main launch: tensor cores for float16 / bfloat16 where the
// device's code has them, else SIMT (float32; bfloat16 before sm_80).
template <typename T>
void launch_backward(const ReformerBackwardCudaArgs& a, const AttentionGrid& g,
                     cudaStream_t stream) {
  if constexpr (cuda::wmma_min_arch<T>() > 0) {
    if (FA_USE_TENSOR_CORES(T, "reformer_backward", backward_wmma_kernel<T>)) {
      const size_t smem = smem_bytes<WmmaBackwardSmem<T>>(a.E, a.M);
      allow_dynamic_shared(smem, backward_wmma_kernel<T>);
      FA_LAUNCH(g.blocks, dim3(kThreads), smem, stream, backward_wmma_kernel<T>)
      (a, g.chunks, g.qtiles);
      FA_CHECK_LAUNCH("reformer_backward (tensor cores)");
      return;
    }
  }
  if constexpr (!cuda::wmma_always<T>()) {
    const size_t smem = smem_bytes<SimtBackwardSmem>(a.E, a.M);
    allow_dynamic_shared(smem, backward_kernel<T>);
    FA_LAUNCH(g.blocks, dim3(kThreads), smem, stream, backward_kernel<T>)(a, g.chunks, g.qtiles);
    FA_CHECK_LAUNCH("reformer_backward");
  }
}

}  // namespace

void reformer_backward_cuda(const ReformerBackwardCudaArgs& a, cudaStream_t stream) {
  check_head_dims(a, "reformer_backward");
  const int64_t NH = a.N * a.H, rows = NH * a.L;
  if (rows == 0) return;
  const int64_t ws = rows * (2 * a.E + a.M);
  FA_LAUNCH(dim3(grid_for(ws)), dim3(kThreads), 0, stream, fill_kernel<float>)
  (a.workspace, ws, 0.f);
  FA_CHECK_LAUNCH("reformer_backward (zero)");
  const AttentionGrid g(a, a.R);
  FA_DISPATCH_FLOAT_TYPES(a.dtype, "reformer_backward", [&] {
    if (a.R > 0) launch_backward<scalar_t>(a, g, stream);
    FA_LAUNCH(dim3(static_cast<unsigned>(ceil_div(rows, kWarps))), dim3(kThreads), 0, stream,
              backward_finish_kernel<scalar_t>)
    (a, rows);
    FA_CHECK_LAUNCH("reformer_backward (finish)");
  });
}

}  // namespace fastattn::cuda
