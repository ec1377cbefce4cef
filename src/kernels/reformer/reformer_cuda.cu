// CUDA kernels of Reformer LSH attention (Kitaev et al. 2020), the GPU side
// of src/kernels/reformer/reformer_cpu.cpp with the same semantics (see
// reformer.h): float32, float16 and bfloat16 storage, float32 arithmetic,
// the running statistics of the round merge in float64 as on the CPU.
//
//  - lsh_hash: one block per (16 rows of x, n·h, round); a warp takes 4 rows,
//    each lane a column b of R_r (coalesced reads of the (E, B2) rotation),
//    keeps the first maximum and the first minimum of its columns, and a warp
//    reduction with the CPU's tie rule (lowest index among equal values)
//    picks argmax over [p ; -p] as `p[imax] >= -p[imin] ? imax : B2 + imin`.
//    Cost O(N·H·R·L·E·B2).
//  - forward: the per-round sort (stable, by (bucket, position), padding
//    excluded) is done by the op layer on the GPU with ATen and comes in as
//    `perm`. One launch per round; one block of 128 threads per (16-query
//    tile of a chunk, chunk, n·h). The block walks the chunk's window (chunks
//    c-1 and c of the sorted order) in tiles of 32 keys: keys gathered by the
//    permutation and L2-normalised in shared memory, a lane per key for the
//    scores (scale, causal, self -> -1e5), an online softmax per query row
//    (a warp per row), then the unnormalised P·V into a shared accumulator.
//    At the end every query row merges its round (row max m_r, sum l_r,
//    unnormalised output) into the running float64 stats and float32
//    workspace exactly as the CPU kernel does; a last kernel divides by the
//    sum and turns it into its log. Cost per round O(N·H·L·2·chunk·(E + M)).
//  - backward: one launch over (query tile, chunk, n·h, round): P recomputed
//    from the final stats, dP = dO·V^T, dS = P ∘ (dP - delta)·scale (0 at the
//    replaced self score); dQ (shared accumulator), dK and dV go into float32
//    workspaces by atomicAdd (a key row is in two chunk windows and a query
//    in one chunk per round: the CPU's even/odd passes are not needed). A
//    last kernel adds dK through the normalisation, dq += (dk - k (k·dk)) /
//    |q| (dk / eps where the norm is clamped), and converts to the storage
//    type.
// float16/bfloat16: the same blocks with the matrix products on tensor cores
// (fa_wmma 16x16x16, float accumulation): S = Q·K^T and P·V forward; S,
// dP = dO·V^T, dQ += dS·K, dK = dS^T·Q and dV = P^T·dO backward. The
// normalised keys, P and dS are rounded to the storage type for the
// products; the softmax statistics stay float. float32: SIMT float
// (register-blocked dot products, keys per lane). E, M <=
// kReformerCudaMaxHeadDim (shared-memory tiles: ~119 KB for the float32
// backward and ~138 KB for the tensor-core backward at 256).
//
// Tested under the emulator by tests/cuda_emu/test_reformer.cpp against the
// CPU kernels in float64; on a GPU by tests/cuda/test_cuda_reformer.cpp.
#include "kernels/common/cuda_compat.cuh"
#include "kernels/reformer/reformer_cuda.h"

namespace fastattn::cuda {

// The kernels' shared argument structs and host helpers.
using namespace fastattn::kernels;

namespace {

using fastattn::cuda::ceil_div;
using fastattn::cuda::from_float;
using fastattn::cuda::to_float;
using fastattn::cuda::warp_max;
using fastattn::cuda::warp_sum;

constexpr int kThreads = 128;  // 4 warps
constexpr int kWarps = kThreads / 32;
constexpr int kBQ = 16;  // query rows per block (4 per warp)
constexpr int kRowsPerWarp = kBQ / kWarps;
constexpr int kBK = 32;  // keys per tile (one per lane)
constexpr float kNormEps = 1e-12f;
constexpr float kSelfScore = -1e5f;  // kReformerSelfScore

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

__global__ void fill_int64_kernel(int64_t* p, int64_t n, int64_t value) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p[i] = value;
}

__global__ void fill_float_kernel(float* p, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p[i] = 0.f;
}

int grid_for(int64_t n) {
  const int64_t b = ceil_div(n, kThreads);
  return static_cast<int>(b < 1 ? 1 : (b > 65536 ? 65536 : b));
}

// ---- attention: shared pieces ----------------------------------------------

__device__ __forceinline__ int64_t valid_length(const ReformerCudaParams& a, int64_t nh) {
  return a.lengths ? a.lengths[nh / a.H] : a.L;
}

// The window of chunk c: queries at sorted positions [t0, t0 + rows), keys at
// [k0, k0 + cols).
struct Window {
  int64_t t0, rows, k0, cols;
};
__device__ __forceinline__ Window window(int64_t c, int64_t chunk, int64_t len) {
  Window w;
  w.t0 = c * chunk;
  w.rows = chunk < len - w.t0 ? chunk : len - w.t0;
  w.k0 = c > 0 ? w.t0 - chunk : 0;
  w.cols = w.t0 + w.rows - w.k0;
  return w;
}

// Loads keys [kt, kt + kBK) of the window: positions into kpos (-1 past the
// window), the L2-normalised key rows into sk (stride E + 1, zeros past the
// window) and the value rows into sv (stride M + 1). Ends with a barrier.
template <typename T>
__device__ void load_key_tile(const ReformerCudaParams& a, const T* q, const T* v,
                              const int64_t* perm, const Window& w, int64_t kt, int64_t* kpos,
                              float* sk, float* sv) {
  const int E = static_cast<int>(a.E), M = static_cast<int>(a.M);
  const int tid = threadIdx.x;
  if (tid < kBK) kpos[tid] = kt + tid < w.cols ? perm[w.k0 + kt + tid] : -1;
  __syncthreads();
  for (int idx = tid; idx < kBK * E; idx += kThreads) {
    const int j = idx / E, e = idx % E;
    const int64_t p = kpos[j];
    sk[j * (E + 1) + e] = p >= 0 ? to_float(q[p * E + e]) : 0.f;
  }
  for (int idx = tid; idx < kBK * M; idx += kThreads) {
    const int j = idx / M, d = idx % M;
    const int64_t p = kpos[j];
    sv[j * (M + 1) + d] = p >= 0 ? to_float(v[p * M + d]) : 0.f;
  }
  __syncthreads();
  const int warp = tid / 32, lane = tid % 32;
  for (int j = warp; j < kBK; j += kWarps) {
    float* row = sk + j * (E + 1);
    float ss = 0.f;
    for (int e = lane; e < E; e += 32) ss += row[e] * row[e];
    ss = warp_sum(ss);
    const float inv = 1.f / fmaxf(sqrtf(ss), kNormEps);
    for (int e = lane; e < E; e += 32) row[e] *= inv;
  }
  __syncthreads();
}

// Loads query rows [qt0, qt0 + kBQ) of the chunk (rows past the chunk: -1
// and zeros) and D values per row of x into sx (stride D). No barrier.
template <typename T>
__device__ void load_query_rows(const T* x, int D, const int64_t* qpos, float* sx) {
  for (int idx = threadIdx.x; idx < kBQ * D; idx += kThreads) {
    const int i = idx / D, d = idx % D;
    const int64_t p = qpos[i];
    sx[idx] = p >= 0 ? to_float(x[p * D + d]) : 0.f;
  }
}

// d[k] = dot(x + (row0 + k)·ldx, y + lane·ldy) over n, for the warp's rows
// k < kRowsPerWarp (x rows broadcast, y: one row per lane).
__device__ __forceinline__ void warp_row_dots(const float* x, int ldx, const float* y, int ldy,
                                              int n, float (&d)[kRowsPerWarp]) {
  const int row0 = (threadIdx.x / 32) * kRowsPerWarp;
  const float* yl = y + (threadIdx.x % 32) * ldy;
  for (int k = 0; k < kRowsPerWarp; ++k) d[k] = 0.f;
  for (int e = 0; e < n; ++e) {
    const float w = yl[e];
    for (int k = 0; k < kRowsPerWarp; ++k) d[k] += x[(row0 + k) * ldx + e] * w;
  }
}

// The scaled and masked score from a dot product of query position qp and key
// position kp: -inf past the window or (causal) for a later key; the self
// score replaced by -1e5 when mask_self.
__device__ __forceinline__ float masked_score(const ReformerCudaParams& a, float dot, int64_t qp,
                                              int64_t kp) {
  if (kp < 0 || qp < 0) return -INFINITY;
  if (a.causal && kp > qp) return -INFINITY;
  if (a.mask_self && kp == qp) return kSelfScore;
  return dot * a.scale;
}

// Merges the warp's query rows of this round (row max m_run, sum l_run,
// unnormalised output rows o (stride ldo) in shared memory) into the running
// float64 stats and float32 output, exactly as reformer_forward_cpu does.
__device__ void merge_round(const ReformerForwardCudaArgs& a, int64_t nh, const int64_t* qpos,
                            const float (&m_run)[kRowsPerWarp], const float (&l_run)[kRowsPerWarp],
                            const float* sacc, int ldo) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t M = a.M, L = a.L;
  for (int k = 0; k < kRowsPerWarp; ++k) {
    const int i = warp * kRowsPerWarp + k;
    const int64_t p = qpos[i];
    if (p < 0) continue;  // uniform across the warp
    double* st = a.stats + 2 * (nh * L + p);
    float* out = a.workspace + (nh * L + p) * M;
    const float* o = sacc + i * ldo;
    const double m = m_run[k], s = l_run[k];
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
// key): scores from dots (unscaled), masked; updates m_run, l_run; writes p
// through put_p(i, p) and the rescale factor of the earlier tiles to salpha.
template <typename PutP>
__device__ __forceinline__ void softmax_tile(const ReformerCudaParams& a, const int64_t* qpos,
                                             int64_t kp, const float (&dots)[kRowsPerWarp],
                                             float (&m_run)[kRowsPerWarp],
                                             float (&l_run)[kRowsPerWarp], float* salpha,
                                             PutP put_p) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int k = 0; k < kRowsPerWarp; ++k) {
    const int i = warp * kRowsPerWarp + k;
    const float s = masked_score(a, dots[k], qpos[i], kp);
    const float m_new = fmaxf(m_run[k], warp_max(s));
    const bool none = m_new == -INFINITY;
    const float p = none ? 0.f : expf(s - m_new);
    const float alpha = none ? 1.f : expf(m_run[k] - m_new);
    l_run[k] = l_run[k] * alpha + warp_sum(p);
    m_run[k] = m_new;
    put_p(i, p);
    if (lane == 0) salpha[i] = alpha;
  }
}

size_t attention_shared_bytes(int64_t E, int64_t M, bool backward) {
  size_t floats = kBQ * E + kBK * (E + 1) + kBK * (M + 1) + kBQ * kBK + kBQ;
  if (!backward) {
    floats += kBQ * M;  // output accumulator
  } else {
    floats += kBQ * M + kBQ * kBK + kBQ * E + 2 * kBQ;  // dO, dS, dQ, hi, lo
  }
  return (kBQ + kBK) * sizeof(int64_t) + floats * sizeof(float);
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
  const int64_t L = a.L, C = a.chunk;
  int64_t item = blockIdx.x;
  const int64_t qt = item % qtiles;
  item /= qtiles;
  const int64_t c = item % chunks;
  const int64_t nh = item / chunks;
  const int64_t len = valid_length(a, nh);
  if (c * C >= len || qt * kBQ >= (C < len - c * C ? C : len - c * C)) return;  // whole block
  const Window w = window(c, C, len);
  const int64_t* perm = a.perm + (nh * a.R + r) * L;
  const T* q = static_cast<const T*>(a.q) + nh * L * E;
  const T* v = static_cast<const T*>(a.v) + nh * L * M;

  FA_DYNAMIC_SHARED(unsigned char, smem);
  int64_t* qpos = reinterpret_cast<int64_t*>(smem);
  int64_t* kpos = qpos + kBQ;
  float* sq = reinterpret_cast<float*>(kpos + kBK);
  float* sk = sq + kBQ * E;
  float* sv = sk + kBK * (E + 1);
  float* sp = sv + kBK * (M + 1);
  float* salpha = sp + kBQ * kBK;
  float* sacc = salpha + kBQ;

  const int tid = threadIdx.x, lane = tid % 32;
  const int64_t qt0 = qt * kBQ;  // first query row of the tile within the chunk
  if (tid < kBQ) qpos[tid] = qt0 + tid < w.rows ? perm[w.t0 + qt0 + tid] : -1;
  for (int idx = tid; idx < kBQ * M; idx += kThreads) sacc[idx] = 0.f;
  __syncthreads();
  load_query_rows(q, E, qpos, sq);

  float m_run[kRowsPerWarp], l_run[kRowsPerWarp];
  for (int k = 0; k < kRowsPerWarp; ++k) {
    m_run[k] = -INFINITY;
    l_run[k] = 0.f;
  }
  for (int64_t kt = 0; kt < w.cols; kt += kBK) {
    load_key_tile(a, q, v, perm, w, kt, kpos, sk, sv);  // barriers: sq is ready too
    const int64_t kp = kpos[lane];
    float dots[kRowsPerWarp];
    warp_row_dots(sq, E, sk, E + 1, E, dots);
    softmax_tile(a, qpos, kp, dots, m_run, l_run, salpha,
                 [&](int i, float p) { sp[i * kBK + lane] = p; });
    __syncthreads();
    for (int idx = tid; idx < kBQ * M; idx += kThreads) {
      const int i = idx / M, d = idx % M;
      const float* prow = sp + i * kBK;
      float acc = sacc[idx] * salpha[i];
      for (int j = 0; j < kBK; ++j) acc += prow[j] * sv[j * (M + 1) + d];
      sacc[idx] = acc;
    }
    __syncthreads();
  }
  merge_round(a, nh, qpos, m_run, l_run, sacc, M);
}

// ---- forward on tensor cores (float16 / bfloat16) ------------------------------

constexpr int kMaxPerLane = static_cast<int>(kReformerCudaMaxHeadDim / 32);

__host__ __device__ __forceinline__ int round16(int64_t x) {
  return static_cast<int>((x + 15) / 16 * 16);
}

// Shared memory of forward_round_wmma_kernel: positions, then T tiles Q
// (16 x Ep), K (32 x Ep), V (32 x Mp), P (16 x 32), then float tiles S
// (16 x 32), P·V (16 x Mp), the output accumulator (16 x Mp) and alpha (16).
// Every tile starts 32-byte aligned (WMMA pointers).
size_t wmma_shared_bytes(int64_t E, int64_t M) {
  const size_t Ep = round16(E), Mp = round16(M);
  return (kBQ + kBK) * sizeof(int64_t) + 2 * (kBQ * Ep + kBK * Ep + kBK * Mp + kBQ * kBK) +
         4 * (kBQ * kBK + 2 * kBQ * Mp + kBQ);
}

// As forward_round_kernel, with S = Q·K^T and P·V as 16x16x16 WMMA products:
// the keys are normalised in float and rounded to T, and so are the
// probabilities before the value product (their sums stay float).
template <typename T>
__device__ __forceinline__ void forward_round_wmma(const ReformerForwardCudaArgs& a, int64_t r,
                                                   int64_t chunks, int64_t qtiles) {
  namespace wmma = fa_wmma;
  const int E = static_cast<int>(a.E), M = static_cast<int>(a.M);  // <= kReformerCudaMaxHeadDim
  const int Ep = round16(E), Mp = round16(M);
  const int64_t L = a.L, C = a.chunk;
  int64_t item = blockIdx.x;
  const int64_t qt = item % qtiles;
  item /= qtiles;
  const int64_t c = item % chunks;
  const int64_t nh = item / chunks;
  const int64_t len = valid_length(a, nh);
  if (c * C >= len || qt * kBQ >= (C < len - c * C ? C : len - c * C)) return;  // whole block
  const Window w = window(c, C, len);
  const int64_t* perm = a.perm + (nh * a.R + r) * L;
  const T* q = static_cast<const T*>(a.q) + nh * L * E;
  const T* v = static_cast<const T*>(a.v) + nh * L * M;

  FA_DYNAMIC_SHARED(unsigned char, smem);
  int64_t* qpos = reinterpret_cast<int64_t*>(smem);
  int64_t* kpos = qpos + kBQ;
  T* sqh = reinterpret_cast<T*>(kpos + kBK);
  T* skh = sqh + kBQ * Ep;
  T* svh = skh + kBK * Ep;
  T* sph = svh + kBK * Mp;
  float* ss = reinterpret_cast<float*>(sph + kBQ * kBK);
  float* spv = ss + kBQ * kBK;
  float* sacc = spv + kBQ * Mp;
  float* salpha = sacc + kBQ * Mp;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const T zero = from_float<T>(0.f);
  const int64_t qt0 = qt * kBQ;
  if (tid < kBQ) qpos[tid] = qt0 + tid < w.rows ? perm[w.t0 + qt0 + tid] : -1;
  for (int idx = tid; idx < kBQ * Mp; idx += kThreads) sacc[idx] = 0.f;
  __syncthreads();
  for (int idx = tid; idx < kBQ * Ep; idx += kThreads) {
    const int i = idx / Ep, e = idx % Ep;
    const int64_t p = qpos[i];
    sqh[idx] = p >= 0 && e < E ? q[p * E + e] : zero;
  }

  float m_run[kRowsPerWarp], l_run[kRowsPerWarp];
  for (int k = 0; k < kRowsPerWarp; ++k) {
    m_run[k] = -INFINITY;
    l_run[k] = 0.f;
  }
  for (int64_t kt = 0; kt < w.cols; kt += kBK) {
    if (tid < kBK) kpos[tid] = kt + tid < w.cols ? perm[w.k0 + kt + tid] : -1;
    __syncthreads();
    // Keys: a warp per row, normalised in float, stored as T (zero padding).
    for (int j = warp; j < kBK; j += kWarps) {
      const int64_t p = kpos[j];
      float x[kMaxPerLane];
      float sum = 0.f;
      for (int t = 0; t < kMaxPerLane; ++t) {
        const int e = lane + 32 * t;
        x[t] = p >= 0 && e < E ? to_float(q[p * E + e]) : 0.f;
        sum += x[t] * x[t];
      }
      const float inv = 1.f / fmaxf(sqrtf(warp_sum(sum)), kNormEps);
      for (int t = 0; t < kMaxPerLane; ++t) {
        const int e = lane + 32 * t;
        if (e < Ep) skh[j * Ep + e] = from_float<T>(x[t] * inv);
      }
    }
    for (int idx = tid; idx < kBK * Mp; idx += kThreads) {
      const int j = idx / Mp, d = idx % Mp;
      const int64_t p = kpos[j];
      svh[idx] = p >= 0 && d < M ? v[p * M + d] : zero;
    }
    __syncthreads();
    // S (16 x 32) = Q·K^T: warps 0 and 1 take 16 keys each.
    if (warp < kBK / 16) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.f);
      for (int ks = 0; ks < Ep; ks += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb;
        wmma::load_matrix_sync(fa, sqh + ks, Ep);
        wmma::load_matrix_sync(fb, skh + warp * 16 * Ep + ks, Ep);
        wmma::mma_sync(acc, fa, fb, acc);
      }
      wmma::store_matrix_sync(ss + warp * 16, acc, kBK, wmma::mem_row_major);
    }
    __syncthreads();
    const int64_t kp = kpos[lane];
    float dots[kRowsPerWarp];
    for (int k = 0; k < kRowsPerWarp; ++k) dots[k] = ss[(warp * kRowsPerWarp + k) * kBK + lane];
    softmax_tile(a, qpos, kp, dots, m_run, l_run, salpha,
                 [&](int i, float p) { sph[i * kBK + lane] = from_float<T>(p); });
    __syncthreads();
    // P·V (16 x Mp): a warp per 16 columns.
    for (int t = warp; t < Mp / 16; t += kWarps) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.f);
      for (int ks = 0; ks < kBK; ks += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> fb;
        wmma::load_matrix_sync(fa, sph + ks, kBK);
        wmma::load_matrix_sync(fb, svh + ks * Mp + t * 16, Mp);
        wmma::mma_sync(acc, fa, fb, acc);
      }
      wmma::store_matrix_sync(spv + t * 16, acc, Mp, wmma::mem_row_major);
    }
    __syncthreads();
    for (int idx = tid; idx < kBQ * Mp; idx += kThreads)
      sacc[idx] = sacc[idx] * salpha[idx / Mp] + spv[idx];
    __syncthreads();
  }
  merge_round(a, nh, qpos, m_run, l_run, sacc, Mp);
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

// ---- backward --------------------------------------------------------------

// Block: (query tile qt, chunk c, nh, round r).
template <typename T>
__global__ void backward_kernel(ReformerBackwardCudaArgs a, int64_t chunks, int64_t qtiles) {
  const int E = static_cast<int>(a.E), M = static_cast<int>(a.M);  // <= kReformerCudaMaxHeadDim
  const int64_t L = a.L, C = a.chunk;
  int64_t item = blockIdx.x;
  const int64_t qt = item % qtiles;
  item /= qtiles;
  const int64_t c = item % chunks;
  item /= chunks;
  const int64_t nh = item % (a.N * a.H);
  const int64_t r = item / (a.N * a.H);
  const int64_t len = valid_length(a, nh);
  if (c * C >= len || qt * kBQ >= (C < len - c * C ? C : len - c * C)) return;  // whole block
  const Window w = window(c, C, len);
  const int64_t* perm = a.perm + (nh * a.R + r) * L;
  const T* q = static_cast<const T*>(a.q) + nh * L * E;
  const T* v = static_cast<const T*>(a.v) + nh * L * M;
  const T* go = static_cast<const T*>(a.grad_out) + nh * L * M;
  float* gq = a.workspace + nh * L * E;
  float* gk = a.workspace + a.N * a.H * L * E + nh * L * E;
  float* gv = a.workspace + 2 * a.N * a.H * L * E + nh * L * M;

  FA_DYNAMIC_SHARED(unsigned char, smem);
  int64_t* qpos = reinterpret_cast<int64_t*>(smem);
  int64_t* kpos = qpos + kBQ;
  float* sq = reinterpret_cast<float*>(kpos + kBK);
  float* sk = sq + kBQ * E;
  float* sv = sk + kBK * (E + 1);
  float* sp = sv + kBK * (M + 1);
  float* sdelta = sp + kBQ * kBK;
  float* sdo = sdelta + kBQ;
  float* sds = sdo + kBQ * M;
  float* sdq = sds + kBQ * kBK;
  float* shi = sdq + kBQ * E;
  float* slo = shi + kBQ;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t qt0 = qt * kBQ;
  if (tid < kBQ) {
    const int64_t p = qt0 + tid < w.rows ? perm[w.t0 + qt0 + tid] : -1;
    qpos[tid] = p;
    if (p >= 0) {
      const double* st = a.stats + 2 * (nh * L + p);
      shi[tid] = static_cast<float>(st[0]);
      slo[tid] = static_cast<float>(st[1]);
      sdelta[tid] = a.delta[nh * L + p];
    } else {
      shi[tid] = slo[tid] = sdelta[tid] = 0.f;
    }
  }
  for (int idx = tid; idx < kBQ * E; idx += kThreads) sdq[idx] = 0.f;
  __syncthreads();
  load_query_rows(q, E, qpos, sq);
  load_query_rows(go, M, qpos, sdo);

  for (int64_t kt = 0; kt < w.cols; kt += kBK) {
    load_key_tile(a, q, v, perm, w, kt, kpos, sk, sv);  // barriers: sq, sdo are ready too
    const int64_t kp = kpos[lane];
    float dots[kRowsPerWarp], dps[kRowsPerWarp];
    warp_row_dots(sq, E, sk, E + 1, E, dots);
    warp_row_dots(sdo, M, sv, M + 1, M, dps);  // dP = dO·V^T
    for (int k = 0; k < kRowsPerWarp; ++k) {
      const int i = warp * kRowsPerWarp + k;
      const int64_t qp = qpos[i];
      const float s = masked_score(a, dots[k], qp, kp);
      const float p = s == -INFINITY ? 0.f : expf((s - shi[i]) - slo[i]);
      float ds = p * (dps[k] - sdelta[i]) * a.scale;
      if (a.mask_self && kp == qp) ds = 0.f;  // the replaced self score is a constant
      sp[i * kBK + lane] = p;
      sds[i * kBK + lane] = ds;
    }
    __syncthreads();
    // dQ += dS·K (as queries)
    for (int idx = tid; idx < kBQ * E; idx += kThreads) {
      const int i = idx / E, e = idx % E;
      const float* dsrow = sds + i * kBK;
      float acc = 0.f;
      for (int j = 0; j < kBK; ++j) acc += dsrow[j] * sk[j * (E + 1) + e];
      sdq[idx] += acc;
    }
    // dK += dS^T·Q (as normalised keys), dV += P^T·dO: scattered by atomics.
    for (int idx = tid; idx < kBK * E; idx += kThreads) {
      const int j = idx / E, e = idx % E;
      const int64_t p = kpos[j];
      if (p < 0) continue;
      float acc = 0.f;
      for (int i = 0; i < kBQ; ++i) acc += sds[i * kBK + j] * sq[i * E + e];
      atomicAdd(gk + p * E + e, acc);
    }
    for (int idx = tid; idx < kBK * M; idx += kThreads) {
      const int j = idx / M, d = idx % M;
      const int64_t p = kpos[j];
      if (p < 0) continue;
      float acc = 0.f;
      for (int i = 0; i < kBQ; ++i) acc += sp[i * kBK + j] * sdo[i * M + d];
      atomicAdd(gv + p * M + d, acc);
    }
    __syncthreads();
  }
  for (int idx = tid; idx < kBQ * E; idx += kThreads) {
    const int64_t p = qpos[idx / E];
    if (p >= 0) atomicAdd(gq + p * E + idx % E, sdq[idx]);
  }
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

// Shared memory of backward_wmma_kernel: positions; T tiles Q (16 x Ep), dO
// (16 x Mp), K (32 x Ep), V (32 x Mp), P and dS (16 x 32); float tiles S and
// dP (16 x 32), dQ (16 x Ep), dK (32 x Ep), dV (32 x Mp), then hi, lo, delta
// (16 each). Every tile starts 32-byte aligned.
size_t wmma_backward_shared_bytes(int64_t E, int64_t M) {
  const size_t Ep = round16(E), Mp = round16(M);
  return (kBQ + kBK) * sizeof(int64_t) +
         2 * (kBQ * Ep + kBQ * Mp + kBK * Ep + kBK * Mp + 2 * kBQ * kBK) +
         4 * (2 * kBQ * kBK + kBQ * Ep + kBK * Ep + kBK * Mp + 3 * kBQ);
}

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
  const int64_t L = a.L, C = a.chunk;
  int64_t item = blockIdx.x;
  const int64_t qt = item % qtiles;
  item /= qtiles;
  const int64_t c = item % chunks;
  item /= chunks;
  const int64_t nh = item % (a.N * a.H);
  const int64_t r = item / (a.N * a.H);
  const int64_t len = valid_length(a, nh);
  if (c * C >= len || qt * kBQ >= (C < len - c * C ? C : len - c * C)) return;  // whole block
  const Window w = window(c, C, len);
  const int64_t* perm = a.perm + (nh * a.R + r) * L;
  const T* q = static_cast<const T*>(a.q) + nh * L * E;
  const T* v = static_cast<const T*>(a.v) + nh * L * M;
  const T* go = static_cast<const T*>(a.grad_out) + nh * L * M;
  float* gq = a.workspace + nh * L * E;
  float* gk = a.workspace + a.N * a.H * L * E + nh * L * E;
  float* gv = a.workspace + 2 * a.N * a.H * L * E + nh * L * M;

  FA_DYNAMIC_SHARED(unsigned char, smem);
  int64_t* qpos = reinterpret_cast<int64_t*>(smem);
  int64_t* kpos = qpos + kBQ;
  T* sqh = reinterpret_cast<T*>(kpos + kBK);
  T* sdoh = sqh + kBQ * Ep;
  T* skh = sdoh + kBQ * Mp;
  T* svh = skh + kBK * Ep;
  T* sph = svh + kBK * Mp;
  T* sdsh = sph + kBQ * kBK;
  float* ss = reinterpret_cast<float*>(sdsh + kBQ * kBK);
  float* sdp = ss + kBQ * kBK;
  float* sdq = sdp + kBQ * kBK;
  float* sdk = sdq + kBQ * Ep;
  float* sdv = sdk + kBK * Ep;
  float* shi = sdv + kBK * Mp;
  float* slo = shi + kBQ;
  float* sdelta = slo + kBQ;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const T zero = from_float<T>(0.f);
  const int64_t qt0 = qt * kBQ;
  if (tid < kBQ) {
    const int64_t p = qt0 + tid < w.rows ? perm[w.t0 + qt0 + tid] : -1;
    qpos[tid] = p;
    if (p >= 0) {
      const double* st = a.stats + 2 * (nh * L + p);
      shi[tid] = static_cast<float>(st[0]);
      slo[tid] = static_cast<float>(st[1]);
      sdelta[tid] = a.delta[nh * L + p];
    } else {
      shi[tid] = slo[tid] = sdelta[tid] = 0.f;
    }
  }
  for (int idx = tid; idx < kBQ * Ep; idx += kThreads) sdq[idx] = 0.f;
  __syncthreads();
  for (int idx = tid; idx < kBQ * Ep; idx += kThreads) {
    const int i = idx / Ep, e = idx % Ep;
    const int64_t p = qpos[i];
    sqh[idx] = p >= 0 && e < E ? q[p * E + e] : zero;
  }
  for (int idx = tid; idx < kBQ * Mp; idx += kThreads) {
    const int i = idx / Mp, d = idx % Mp;
    const int64_t p = qpos[i];
    sdoh[idx] = p >= 0 && d < M ? go[p * M + d] : zero;
  }

  for (int64_t kt = 0; kt < w.cols; kt += kBK) {
    if (tid < kBK) kpos[tid] = kt + tid < w.cols ? perm[w.k0 + kt + tid] : -1;
    __syncthreads();
    for (int j = warp; j < kBK; j += kWarps) {  // keys: normalised in float, stored as T
      const int64_t p = kpos[j];
      float x[kMaxPerLane];
      float sum = 0.f;
      for (int t = 0; t < kMaxPerLane; ++t) {
        const int e = lane + 32 * t;
        x[t] = p >= 0 && e < E ? to_float(q[p * E + e]) : 0.f;
        sum += x[t] * x[t];
      }
      const float inv = 1.f / fmaxf(sqrtf(warp_sum(sum)), kNormEps);
      for (int t = 0; t < kMaxPerLane; ++t) {
        const int e = lane + 32 * t;
        if (e < Ep) skh[j * Ep + e] = from_float<T>(x[t] * inv);
      }
    }
    for (int idx = tid; idx < kBK * Mp; idx += kThreads) {
      const int j = idx / Mp, d = idx % Mp;
      const int64_t p = kpos[j];
      svh[idx] = p >= 0 && d < M ? v[p * M + d] : zero;
    }
    __syncthreads();
    {  // S = Q·K^T (warps 0, 1) and dP = dO·V^T (warps 2, 3), 16 keys each
      const bool scores = warp < 2;
      const int half = warp % 2, D = scores ? Ep : Mp;
      const T* xa = scores ? sqh : sdoh;
      const T* xb = (scores ? skh : svh) + half * 16 * D;
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.f);
      for (int ks = 0; ks < D; ks += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb;
        wmma::load_matrix_sync(fa, xa + ks, D);
        wmma::load_matrix_sync(fb, xb + ks, D);
        wmma::mma_sync(acc, fa, fb, acc);
      }
      wmma::store_matrix_sync((scores ? ss : sdp) + half * 16, acc, kBK, wmma::mem_row_major);
    }
    __syncthreads();
    const int64_t kp = kpos[lane];
    for (int k = 0; k < kRowsPerWarp; ++k) {
      const int i = warp * kRowsPerWarp + k;
      const int64_t qp = qpos[i];
      const float s = masked_score(a, ss[i * kBK + lane], qp, kp);
      const float p = s == -INFINITY ? 0.f : expf((s - shi[i]) - slo[i]);
      float ds = p * (sdp[i * kBK + lane] - sdelta[i]) * a.scale;
      if (a.mask_self && kp == qp) ds = 0.f;  // the replaced self score is a constant
      sph[i * kBK + lane] = from_float<T>(p);
      sdsh[i * kBK + lane] = from_float<T>(ds);
    }
    __syncthreads();
    // dQ (16 x Ep) += dS·K, accumulated in shared memory (one warp per tile).
    for (int t = warp; t < Ep / 16; t += kWarps) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::load_matrix_sync(acc, sdq + t * 16, Ep, wmma::mem_row_major);
      for (int ks = 0; ks < kBK; ks += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> fb;
        wmma::load_matrix_sync(fa, sdsh + ks, kBK);
        wmma::load_matrix_sync(fb, skh + ks * Ep + t * 16, Ep);
        wmma::mma_sync(acc, fa, fb, acc);
      }
      wmma::store_matrix_sync(sdq + t * 16, acc, Ep, wmma::mem_row_major);
    }
    // dK (32 x Ep) = dS^T·Q and dV (32 x Mp) = P^T·dO: 16 x 16 tiles over the warps.
    const int nk = 2 * (Ep / 16), nv = 2 * (Mp / 16);
    for (int t = warp; t < nk + nv; t += kWarps) {
      const bool keys = t < nk;
      const int u = keys ? t : t - nk, D = keys ? Ep : Mp;
      const int jt = u % 2, ct = u / 2;  // key half, column tile
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major> fa;  // (dS or P)^T
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> fb;  // Q or dO
      wmma::fill_fragment(acc, 0.f);
      wmma::load_matrix_sync(fa, (keys ? sdsh : sph) + jt * 16, kBK);
      wmma::load_matrix_sync(fb, (keys ? sqh : sdoh) + ct * 16, D);
      wmma::mma_sync(acc, fa, fb, acc);
      wmma::store_matrix_sync((keys ? sdk : sdv) + jt * 16 * D + ct * 16, acc, D,
                              wmma::mem_row_major);
    }
    __syncthreads();
    for (int idx = tid; idx < kBK * E; idx += kThreads) {
      const int j = idx / E, e = idx % E;
      const int64_t p = kpos[j];
      if (p >= 0) atomicAdd(gk + p * E + e, sdk[j * Ep + e]);
    }
    for (int idx = tid; idx < kBK * M; idx += kThreads) {
      const int j = idx / M, d = idx % M;
      const int64_t p = kpos[j];
      if (p >= 0) atomicAdd(gv + p * M + d, sdv[j * Mp + d]);
    }
    __syncthreads();
  }
  for (int idx = tid; idx < kBQ * E; idx += kThreads) {
    const int i = idx / E, e = idx % E;
    const int64_t p = qpos[i];
    if (p >= 0) atomicAdd(gq + p * E + e, sdq[i * Ep + e]);
  }
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
void launch_backward(const ReformerBackwardCudaArgs& a, dim3 grid, int64_t chunks, int64_t qtiles,
                     cudaStream_t stream) {
  if constexpr (cuda::wmma_min_arch<T>() > 0) {
    if (FA_USE_TENSOR_CORES(T, "reformer_backward", backward_wmma_kernel<T>)) {
      const size_t smem = wmma_backward_shared_bytes(a.E, a.M);
      if (smem > 48 * 1024) FA_SET_MAX_DYNAMIC_SHARED(smem, backward_wmma_kernel<T>);
      FA_LAUNCH(grid, dim3(kThreads), smem, stream, backward_wmma_kernel<T>)(a, chunks, qtiles);
      FA_CHECK_LAUNCH("reformer_backward (tensor cores)");
      return;
    }
  }
  if constexpr (!cuda::wmma_always<T>()) {
    const size_t smem = attention_shared_bytes(a.E, a.M, true);
    if (smem > 48 * 1024) FA_SET_MAX_DYNAMIC_SHARED(smem, backward_kernel<T>);
    FA_LAUNCH(grid, dim3(kThreads), smem, stream, backward_kernel<T>)(a, chunks, qtiles);
    FA_CHECK_LAUNCH("reformer_backward");
  }
}

// The forward's round launches: tensor cores for float16 / bfloat16 where the
// device's code has them, else SIMT.
template <typename T>
void launch_rounds(const ReformerForwardCudaArgs& a, dim3 grid, int64_t chunks, int64_t qtiles,
                   cudaStream_t stream) {
  if constexpr (cuda::wmma_min_arch<T>() > 0) {
    if (FA_USE_TENSOR_CORES(T, "reformer_forward", forward_round_wmma_kernel<T>)) {
      const size_t smem = wmma_shared_bytes(a.E, a.M);
      if (smem > 48 * 1024) FA_SET_MAX_DYNAMIC_SHARED(smem, forward_round_wmma_kernel<T>);
      for (int64_t r = 0; r < a.R; ++r) {
        FA_LAUNCH(grid, dim3(kThreads), smem, stream, forward_round_wmma_kernel<T>)
        (a, r, chunks, qtiles);
        FA_CHECK_LAUNCH("reformer_forward (round, tensor cores)");
      }
      return;
    }
  }
  if constexpr (!cuda::wmma_always<T>()) {
    const size_t smem = attention_shared_bytes(a.E, a.M, false);
    if (smem > 48 * 1024) FA_SET_MAX_DYNAMIC_SHARED(smem, forward_round_kernel<T>);
    for (int64_t r = 0; r < a.R; ++r) {
      FA_LAUNCH(grid, dim3(kThreads), smem, stream, forward_round_kernel<T>)(a, r, chunks, qtiles);
      FA_CHECK_LAUNCH("reformer_forward (round)");
    }
  }
}

void check_head_dims(const ReformerCudaParams& a, const char* what) {
  if (a.E < 1 || a.E > kReformerCudaMaxHeadDim || a.M < 0 || a.M > kReformerCudaMaxHeadDim)
    throw std::runtime_error(
        std::string("fastattn CUDA kernel ") + what +
        ": head dimensions must be 1 <= E <= " + std::to_string(kReformerCudaMaxHeadDim) +
        " and 0 <= M <= " + std::to_string(kReformerCudaMaxHeadDim) +
        ", got E = " + std::to_string(a.E) + ", M = " + std::to_string(a.M));
  if (a.chunk < 1)
    throw std::runtime_error(std::string("fastattn CUDA kernel ") + what +
                             ": chunk must be >= 1, got " + std::to_string(a.chunk));
}

}  // namespace

void lsh_hash_cuda(const LshHashCudaArgs& a, cudaStream_t stream) {
  const int64_t NH = a.N * a.H, total = NH * a.R * a.L;
  if (total == 0) return;
  if (a.B2 == 0) {  // one bucket
    FA_LAUNCH(dim3(grid_for(total)), dim3(kThreads), 0, stream, fill_int64_kernel)
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
  const int64_t chunks = ceil_div(a.L, a.chunk);
  const int64_t qtiles = ceil_div(a.chunk < a.L ? a.chunk : a.L, kBQ);
  FA_DISPATCH_FLOAT_TYPES(a.dtype, "reformer_forward", [&] {
    launch_rounds<scalar_t>(a, dim3(static_cast<unsigned>(qtiles * chunks * NH)), chunks, qtiles,
                            stream);
    FA_LAUNCH(dim3(static_cast<unsigned>(ceil_div(rows, kWarps))), dim3(kThreads), 0, stream,
              forward_finish_kernel<scalar_t>)
    (a, rows);
    FA_CHECK_LAUNCH("reformer_forward (finish)");
  });
}

void reformer_backward_cuda(const ReformerBackwardCudaArgs& a, cudaStream_t stream) {
  check_head_dims(a, "reformer_backward");
  const int64_t NH = a.N * a.H, rows = NH * a.L;
  if (rows == 0) return;
  const int64_t ws = rows * (2 * a.E + a.M);
  FA_LAUNCH(dim3(grid_for(ws)), dim3(kThreads), 0, stream, fill_float_kernel)(a.workspace, ws);
  FA_CHECK_LAUNCH("reformer_backward (zero)");
  const int64_t chunks = ceil_div(a.L, a.chunk);
  const int64_t qtiles = ceil_div(a.chunk < a.L ? a.chunk : a.L, kBQ);
  FA_DISPATCH_FLOAT_TYPES(a.dtype, "reformer_backward", [&] {
    if (a.R > 0) {
      launch_backward<scalar_t>(a, dim3(static_cast<unsigned>(qtiles * chunks * NH * a.R)), chunks,
                                qtiles, stream);
    }
    FA_LAUNCH(dim3(static_cast<unsigned>(ceil_div(rows, kWarps))), dim3(kThreads), 0, stream,
              backward_finish_kernel<scalar_t>)
    (a, rows);
    FA_CHECK_LAUNCH("reformer_backward (finish)");
  });
}

}  // namespace fastattn::cuda
