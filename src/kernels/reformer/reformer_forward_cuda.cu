// The forward CUDA kernels of Reformer LSH attention and their launchers
// (lsh_hash_cuda, the forward's first step, and reformer_forward_cuda): the
// bucket hashing, the per-round chunk-window attention (SIMT and tensor
// cores) with its merge into the running output and stats, and the final
// normalisation. See reformer_cuda_common.cuh for the design.
#include "kernels/reformer/reformer_cuda_common.cuh"

namespace fastattn::cuda {
namespace {

// ---- lsh_hash ----------------------------------------------------------------

constexpr int kHashRowsPerWarp = 4;
constexpr int kHashRows = kWarps * kHashRowsPerWarp;  // rows of x per block

// (v, i) replaces (bv, bi) when larger, or equal with a lower index.
__device__ __forceinline__ void arg_better_max(float& bv, int& bi, float v, int i) {
  if (v > bv || (v == bv && i < bi)) {
    bv = v;
    bi = i;
  }
}
__device__ __forceinline__ void arg_better_min(float& bv, int& bi, float v, int i) {
  if (v < bv || (v == bv && i < bi)) {
    bv = v;
    bi = i;
  }
}

template <typename T>
__global__ void lsh_hash_kernel(LshHashCudaArgs a, int64_t row_blocks) {
  const int64_t L = a.L, E = a.E, B2 = a.B2, R = a.R;
  int64_t item = blockIdx.x;
  const int64_t rb = item % row_blocks;
  item /= row_blocks;
  const int64_t nh = item % (a.N * a.H);
  const int64_t r = item / (a.N * a.H);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t l0 = rb * kHashRows + warp * kHashRowsPerWarp;
  const T* x = static_cast<const T*>(a.x) + nh * L * E;
  const T* rot = static_cast<const T*>(a.rotations) + r * E * B2;
  int64_t rows[kHashRowsPerWarp];
  for (int k = 0; k < kHashRowsPerWarp; ++k) rows[k] = l0 + k < L ? l0 + k : L - 1;  // clamped
  float vmax[kHashRowsPerWarp], vmin[kHashRowsPerWarp];
  int imax[kHashRowsPerWarp], imin[kHashRowsPerWarp];
  for (int k = 0; k < kHashRowsPerWarp; ++k) {
    vmax[k] = -INFINITY;
    vmin[k] = INFINITY;
    imax[k] = imin[k] = 0x7fffffff;
  }
  for (int64_t b0 = 0; b0 < B2; b0 += 32) {
    const int64_t b = b0 + lane;
    if (b < B2) {
      float acc[kHashRowsPerWarp] = {};
      for (int64_t e = 0; e < E; ++e) {
        const float w = to_float(rot[e * B2 + b]);
        for (int k = 0; k < kHashRowsPerWarp; ++k) acc[k] += to_float(x[rows[k] * E + e]) * w;
      }
      for (int k = 0; k < kHashRowsPerWarp; ++k) {
        arg_better_max(vmax[k], imax[k], acc[k], static_cast<int>(b));
        arg_better_min(vmin[k], imin[k], acc[k], static_cast<int>(b));
      }
    }
  }
  for (int k = 0; k < kHashRowsPerWarp; ++k) {
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, vmax[k], o);
      const int oi = __shfl_xor_sync(0xffffffffu, imax[k], o);
      arg_better_max(vmax[k], imax[k], ov, oi);
      const float nv = __shfl_xor_sync(0xffffffffu, vmin[k], o);
      const int ni = __shfl_xor_sync(0xffffffffu, imin[k], o);
      arg_better_min(vmin[k], imin[k], nv, ni);
    }
    if (lane == 0 && l0 + k < L) {
      a.buckets[(nh * R + r) * L + l0 + k] =
          vmax[k] >= -vmin[k] ? static_cast<int64_t>(imax[k]) : B2 + imin[k];
    }
  }
}

// ---- forward: shared pieces ----------------------------------------------------

// The running softmax statistics of the warp's query rows over the round's
// key tiles: row max m and sum l.
struct RowRunning {
  float m[kRowsPerWarp], l[kRowsPerWarp];
  __device__ __forceinline__ RowRunning() {
    for (int k = 0; k < kRowsPerWarp; ++k) {
      m[k] = -INFINITY;
      l[k] = 0.f;
    }
  }
};

// Merges the warp's query rows of this round (row max run.m, sum run.l,
// unnormalised output rows o (stride ldo) in shared memory) into the running
// float64 stats and float32 output, exactly as reformer_forward_cpu does.
__device__ void merge_round(const ReformerForwardCudaArgs& a, int64_t nh, const int64_t* qpos,
                            const RowRunning& run, const float* sacc, int ldo) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t M = a.M, L = a.L;
  for (int k = 0; k < kRowsPerWarp; ++k) {
    const int i = warp * kRowsPerWarp + k;
    const int64_t p = qpos[i];
    if (p < 0) continue;  // uniform across the warp
    double* st = a.stats + 2 * (nh * L + p);
    float* out = a.workspace + (nh * L + p) * M;
    const float* o = sacc + i * ldo;
    const double m = run.m[k], s = run.l[k];
    const double st0 = st[0], st1 = st[1];
    double new0, new1;
    float f_old, f_new;  // out = out·f_old + o·f_new
    if (st0 == -INFINITY) {
      new0 = m;
      new1 = s;
      f_old = 0.f;
      f_new = 1.f;
    } else if (m <= st0) {
      const double f = exp(m - st0);
      new0 = st0;
      new1 = st1 + f * s;
      f_old = 1.f;
      f_new = static_cast<float>(f);
    } else {
      const double f = exp(st0 - m);
      new0 = m;
      new1 = st1 * f + s;
      f_old = static_cast<float>(f);
      f_new = 1.f;
    }
    for (int64_t d = lane; d < M; d += 32) out[d] = out[d] * f_old + o[d] * f_new;
    __syncwarp();
    if (lane == 0) {
      st[0] = new0;
      st[1] = new1;
    }
  }
}

// Online-softmax step of the warp's query rows over one key tile (lane =
// key): scores from dots (unscaled), masked; updates run; writes p through
// put_p(i, p) and the rescale factor of the earlier tiles to salpha.
template <typename PutP>
__device__ __forceinline__ void softmax_tile(const ReformerCudaParams& a, const int64_t* qpos,
                                             int64_t kp, const float (&dots)[kRowsPerWarp],
                                             RowRunning& run, float* salpha, PutP put_p) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int k = 0; k < kRowsPerWarp; ++k) {
    const int i = warp * kRowsPerWarp + k;
    const float s = masked_score(a, dots[k], qpos[i], kp);
    const float m_new = fmaxf(run.m[k], warp_max(s));
    const bool none = m_new == -INFINITY;
    const float p = none ? 0.f : expf(s - m_new);
    const float alpha = none ? 1.f : expf(run.m[k] - m_new);
    run.l[k] = run.l[k] * alpha + warp_sum(p);
    run.m[k] = m_new;
    put_p(i, p);
    if (lane == 0) salpha[i] = alpha;
  }
}

// ---- forward ---------------------------------------------------------------

__global__ void forward_init_kernel(float* ws, double* stats, int64_t rows, int64_t M) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = first; i < rows * M; i += stride) ws[i] = 0.f;
  for (int64_t i = first; i < rows; i += stride) {
    stats[2 * i] = -INFINITY;
    stats[2 * i + 1] = 0.0;
  }
}

// Block: (query tile qt, chunk c, nh) of round r.
template <typename T>
__global__ void forward_round_kernel(ReformerForwardCudaArgs a, int64_t r, int64_t chunks,
                                     int64_t qtiles) {
  const int E = static_cast<int>(a.E), M = static_cast<int>(a.M);  // <= kReformerCudaMaxHeadDim
  const QueryTile t(a, chunks, qtiles, r);
  if (t.empty()) return;  // whole block
  const HeadInputs<T> in(a, t.nh);

  const SimtForwardSmem sm = carve_smem<SimtForwardSmem>(a.E, a.M);

  const int tid = threadIdx.x, lane = tid % 32;
  if (tid < kBQ) sm.qpos[tid] = t.query_pos(tid);
  for (int idx = tid; idx < kBQ * M; idx += kThreads) sm.sacc[idx] = 0.f;
  __syncthreads();
  load_query_rows(in.q, E, sm.qpos, sm.sq);

  RowRunning run;
  for (int64_t kt = 0; kt < t.w.cols; kt += kBK) {
    load_key_tile(a, in, t, kt, sm.kpos, sm.sk, sm.sv);  // barriers: sq is ready too
    const int64_t kp = sm.kpos[lane];
    float dots[kRowsPerWarp];
    warp_row_dots(sm.sq, E, sm.sk, E + 1, E, dots);
    softmax_tile(a, sm.qpos, kp, dots, run, sm.salpha,
                 [&](int i, float p) { sm.sp[i * kBK + lane] = p; });
    __syncthreads();
    for (int idx = tid; idx < kBQ * M; idx += kThreads) {
      const int i = idx / M, d = idx % M;
      sm.sacc[idx] =
          strided_dot<kBK>(sm.sacc[idx] * sm.salpha[i], sm.sp + i * kBK, 1, sm.sv + d, M + 1);
    }
    __syncthreads();
  }
  merge_round(a, t.nh, sm.qpos, run, sm.sacc, M);
}

// ---- forward on tensor cores (float16 / bfloat16) ------------------------------

// As forward_round_kernel, with S = Q·K^T and P·V as 16x16x16 WMMA products:
// the keys are normalised in float and rounded to T, and so are the
// probabilities before the value product (their sums stay float).
template <typename T>
__device__ __forceinline__ void forward_round_wmma(const ReformerForwardCudaArgs& a, int64_t r,
                                                   int64_t chunks, int64_t qtiles) {
  namespace wmma = fa_wmma;
  const int E = static_cast<int>(a.E), M = static_cast<int>(a.M);  // <= kReformerCudaMaxHeadDim
  const int Ep = round16(E), Mp = round16(M);
  const QueryTile t(a, chunks, qtiles, r);
  if (t.empty()) return;  // whole block
  const HeadInputs<T> in(a, t.nh);

  const WmmaForwardSmem<T> sm = carve_smem<WmmaForwardSmem<T>>(a.E, a.M);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  if (tid < kBQ) sm.qpos[tid] = t.query_pos(tid);
  for (int idx = tid; idx < kBQ * Mp; idx += kThreads) sm.sacc[idx] = 0.f;
  __syncthreads();
  load_rows_padded<kBQ>(in.q, E, Ep, sm.qpos, sm.sqh);

  RowRunning run;
  for (int64_t kt = 0; kt < t.w.cols; kt += kBK) {
    load_key_tile_wmma(a, in, t, kt, sm.kpos, sm.skh, sm.svh);  // barriers: sqh is ready too
    // S (16 x 32) = Q·K^T: warps 0 and 1 take 16 keys each.
    if (warp < kBK / 16) {
      WmmaAccumulator acc;
      wmma::fill_fragment(acc, 0.f);
      wmma_add_product<wmma::col_major>(acc, sm.sqh, Ep, sm.skh + warp * 16 * Ep, Ep, Ep);
      wmma::store_matrix_sync(sm.ss + warp * 16, acc, kBK, wmma::mem_row_major);
    }
    __syncthreads();
    const int64_t kp = sm.kpos[lane];
    float dots[kRowsPerWarp];
    for (int k = 0; k < kRowsPerWarp; ++k) dots[k] = sm.ss[(warp * kRowsPerWarp + k) * kBK + lane];
    softmax_tile(a, sm.qpos, kp, dots, run, sm.salpha,
                 [&](int i, float p) { sm.sph[i * kBK + lane] = from_float<T>(p); });
    __syncthreads();
    // P·V (16 x Mp): a warp per 16 columns.
    for (int u = warp; u < Mp / 16; u += kWarps) {
      WmmaAccumulator acc;
      wmma::fill_fragment(acc, 0.f);
      wmma_add_product<wmma::row_major>(acc, sm.sph, kBK, sm.svh + u * 16, Mp, kBK);
      wmma::store_matrix_sync(sm.spv + u * 16, acc, Mp, wmma::mem_row_major);
    }
    __syncthreads();
    for (int idx = tid; idx < kBQ * Mp; idx += kThreads)
      sm.sacc[idx] = sm.sacc[idx] * sm.salpha[idx / Mp] + sm.spv[idx];
    __syncthreads();
  }
  merge_round(a, t.nh, sm.qpos, run, sm.sacc, Mp);
}

// The kernel: the body only where T has tensor cores (see cuda_compat.cuh).
template <typename T>
__global__ void forward_round_wmma_kernel(ReformerForwardCudaArgs a, int64_t r, int64_t chunks,
                                          int64_t qtiles) {
  if constexpr (cuda::wmma_compiled<T>()) {
    forward_round_wmma<T>(a, r, chunks, qtiles);
  } else {
    FA_TRAP();
  }
}

// One warp per position: out = acc / sum, stats[1] = log(sum).
template <typename T>
__global__ void forward_finish_kernel(ReformerForwardCudaArgs a, int64_t rows) {
  const int64_t M = a.M;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  double* st = a.stats + 2 * row;
  T* out = static_cast<T*>(a.out) + row * M;
  const float* acc = a.workspace + row * M;
  const double st0 = st[0], st1 = st[1];
  const float inv = st0 == -INFINITY ? 0.f : static_cast<float>(1.0 / st1);
  for (int64_t d = lane; d < M; d += 32) out[d] = from_float<T>(acc[d] * inv);
  __syncwarp();
  if (lane == 0 && st0 != -INFINITY) st[1] = log(st1);
}

// The forward's round launches: tensor cores for float16 / bfloat16 where the
// device's code has them, else SIMT.
template <typename T>
void launch_rounds(const ReformerForwardCudaArgs& a, const AttentionGrid& g, cudaStream_t stream) {
  if constexpr (cuda::wmma_min_arch<T>() > 0) {
    if (FA_USE_TENSOR_CORES(T, "reformer_forward", forward_round_wmma_kernel<T>)) {
      const size_t smem = smem_bytes<WmmaForwardSmem<T>>(a.E, a.M);
      allow_dynamic_shared(smem, forward_round_wmma_kernel<T>);
      for (int64_t r = 0; r < a.R; ++r) {
        FA_LAUNCH(g.blocks, dim3(kThreads), smem, stream, forward_round_wmma_kernel<T>)
        (a, r, g.chunks, g.qtiles);
        FA_CHECK_LAUNCH("reformer_forward (round, tensor cores)");
      }
      return;
    }
  }
  if constexpr (!cuda::wmma_always<T>()) {
    const size_t smem = smem_bytes<SimtForwardSmem>(a.E, a.M);
    allow_dynamic_shared(smem, forward_round_kernel<T>);
    for (int64_t r = 0; r < a.R; ++r) {
      FA_LAUNCH(g.blocks, dim3(kThreads), smem, stream, forward_round_kernel<T>)
      (a, r, g.chunks, g.qtiles);
      FA_CHECK_LAUNCH("reformer_forward (round)");
    }
  }
}

}  // namespace

void lsh_hash_cuda(const LshHashCudaArgs& a, cudaStream_t stream) {
  const int64_t NH = a.N * a.H, total = NH * a.R * a.L;
  if (total == 0) return;
  if (a.B2 == 0) {  // one bucket
    FA_LAUNCH(dim3(grid_for(total)), dim3(kThreads), 0, stream, fill_kernel<int64_t>)
    (a.buckets, total, int64_t(0));
    FA_CHECK_LAUNCH("lsh_hash (fill)");
    return;
  }
  const int64_t row_blocks = ceil_div(a.L, kHashRows);
  const int64_t blocks = row_blocks * NH * a.R;
  FA_DISPATCH_FLOAT_TYPES(a.dtype, "lsh_hash", [&] {
    FA_LAUNCH(dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0, stream,
              lsh_hash_kernel<scalar_t>)
    (a, row_blocks);
    FA_CHECK_LAUNCH("lsh_hash");
  });
}

void reformer_forward_cuda(const ReformerForwardCudaArgs& a, cudaStream_t stream) {
  check_head_dims(a, "reformer_forward");
  const int64_t NH = a.N * a.H, rows = NH * a.L;
  if (rows == 0) return;
  FA_LAUNCH(dim3(grid_for(rows * a.M)), dim3(kThreads), 0, stream, forward_init_kernel)
  (a.workspace, a.stats, rows, a.M);
  FA_CHECK_LAUNCH("reformer_forward (init)");
  const AttentionGrid g(a, 1);
  FA_DISPATCH_FLOAT_TYPES(a.dtype, "reformer_forward", [&] {
    launch_rounds<scalar_t>(a, g, stream);
    FA_LAUNCH(dim3(static_cast<unsigned>(ceil_div(rows, kWarps))), dim3(kThreads), 0, stream,
              forward_finish_kernel<scalar_t>)
    (a, rows);
    FA_CHECK_LAUNCH("reformer_forward (finish)");
  });
}

}  // namespace fastattn::cuda
