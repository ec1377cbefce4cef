// CUDA kernels of the per-cluster top-k attention of (improved) clustered
// attention (see clustered_topk.h for the semantics, which these follow
// exactly): for query l of cluster j = assignments[l],
//   out_l = mass_j · Σ_t softmax_t(scale · q_l·k_{idx[j,t]}) v_{idx[j,t]} (+ rest_j),
// keys at idx outside [0, key length) dropped, padded queries zero.
//
// Work is per cluster: a grouping kernel sorts each head's queries by
// cluster (stable: ascending query order inside a cluster; one block per
// (n, h), warps on contiguous segments, ranks by shuffles, no atomics). Then
// one block of 4 warps per (cluster, n·h): the cluster's keys and values are
// staged in shared memory as float (rows padded to E + 1 / M + 1 floats:
// lane j reads key j without bank conflicts) in chunks of 32 keys (one chunk
// for K <= 32, the common case: staged once for all members); each warp
// takes one member query at a time, lane j scoring key j of the chunk,
// online softmax across chunks, lanes over the value columns for P·V.
//   backward: per member, pass A (max, sum, Σ p·(g·v)) then pass B
//   (p, dS = p ∘ (m·g·v - m·rowdot)·scale, dQ = dS·K into the warp's row);
//   after each group of 4 members the block adds dK += Σ dSᵀq and
//   dV += Σ m·pᵀg to shared per-chunk accumulators, each thread owning
//   entries (no shared atomics; per-warp partial sums for the cluster's
//   scalars, added in warp order); a chunk's accumulators go to the float32
//   grad_k / grad_v by global atomicAdd once per staging (keys are shared
//   across clusters).
// Improved form: a weights kernel computes each cluster's p_t, mass and rest
// (in the workspace) first; the backward adds the rest's and the mass's
// gradients per key after the members.
// All arithmetic in float32; gradients of k and v accumulate in float32 by
// global atomics across clusters, so their last bits may vary between runs
// (everything else is deterministic).
// Cost: forward 2·N·H·L·K·(E + M) flops, backward about 3x that (the scores
// are recomputed in both passes), plus N·H·C·K·(E + M) for the weights.
// Tested by tests/cuda_emu/test_clustered_topk.cpp against the CPU kernels.
#include "kernels/clustered_topk/clustered_topk_cuda.h"

#include <stdexcept>

#include "kernels/common/block_scan.cuh"
#include "kernels/common/cuda_compat.cuh"

namespace fastattn::cuda {
namespace {

constexpr int kWarps = 4;  // member queries in flight per cluster block
constexpr int kThreads = kWarps * 32;
constexpr int kChunk = 32;  // keys per staged chunk (one per lane)
constexpr int kGroupWarps = 16;
constexpr int kGroupThreads = kGroupWarps * 32;
constexpr int64_t kMaxShared = 227 * 1024;

__host__ __device__ inline int64_t align8(int64_t b) { return (b + 7) / 8 * 8; }

// Workspace carve-up (bytes, 8-aligned pieces).
struct Workspace {
  int* start;   // (NH, C + 1): members of cluster c are order[start[c] .. start[c + 1])
  int* order;   // (NH, L): valid queries sorted by cluster (stable)
  int* hist;    // (NH, kGroupWarps, C): per-warp counts, then cursors
  float* mass;  // (NH, C): improved form, the centroid mass
  float* pc;    // (NH, C, K): improved form, the centroid weights on the top keys
  float* rest;  // (NH, C, M): improved form, out_c - Σ p_t v_t
};

__host__ __device__ inline Workspace carve(void* base, int64_t NH, int64_t L, int64_t C, int64_t K,
                                           int64_t M, int64_t* bytes) {
  auto* p = static_cast<unsigned char*>(base);
  int64_t off = 0;
  Workspace w;
  w.start = reinterpret_cast<int*>(p + off);
  off += align8(NH * (C + 1) * 4);
  w.order = reinterpret_cast<int*>(p + off);
  off += align8(NH * L * 4);
  w.hist = reinterpret_cast<int*>(p + off);
  off += align8(NH * kGroupWarps * C * 4);
  w.mass = reinterpret_cast<float*>(p + off);
  off += align8(NH * C * 4);
  w.pc = reinterpret_cast<float*>(p + off);
  off += align8(NH * C * K * 4);
  w.rest = reinterpret_cast<float*>(p + off);
  off += align8(NH * C * M * 4);
  if (bytes) *bytes = off;
  return w;
}

// ---- grouping: queries sorted by cluster, stable ---------------------------------

// Rank of the lane's cluster c among the lower lanes with the same cluster,
// and whether no higher lane has it.
__device__ inline int lane_rank(int c, bool* last) {
  const int lane = threadIdx.x & 31;
  int rank = 0;
  bool is_last = true;
  for (int j = 0; j < 32; ++j) {
    const int cj = __shfl_sync(0xffffffffu, c, j);
    if (cj == c) {
      if (j < lane) ++rank;
      if (j > lane) is_last = false;
    }
  }
  *last = is_last;
  return rank;
}

__global__ void __launch_bounds__(kGroupThreads)
    group_kernel(const int64_t* assignments, int64_t L, int64_t C, Workspace w) {
  __shared__ int red[kGroupWarps];
  const int64_t nh = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t* as = assignments + nh * L;
  int* hist = w.hist + (nh * kGroupWarps + warp) * C;  // this warp's row
  int* hist_all = w.hist + nh * kGroupWarps * C;
  int* start = w.start + nh * (C + 1);
  int* order = w.order + nh * L;
  const int64_t seg = (L + kGroupWarps - 1) / kGroupWarps;
  const int64_t s0 = warp * seg < L ? warp * seg : L, s1 = s0 + seg < L ? s0 + seg : L;
  for (int64_t c = lane; c < C; c += 32) hist[c] = 0;
  __syncwarp();
  for (int64_t t0 = s0; t0 < s1; t0 += 32) {
    const int64_t l = t0 + lane;
    const int c = l < s1 ? static_cast<int>(as[l]) : -1;
    bool last;
    const int rank = lane_rank(c, &last);
    if (c >= 0 && last) hist[c] += rank + 1;
    __syncwarp();
  }
  __syncthreads();
  for (int64_t c = tid; c < C; c += kGroupThreads) {
    int run = 0;
    for (int v = 0; v < kGroupWarps; ++v) {
      const int t = hist_all[v * C + c];
      hist_all[v * C + c] = run;
      run += t;
    }
    start[c + 1] = run;
  }
  __syncthreads();
  const int64_t chunk = (C + kGroupThreads - 1) / kGroupThreads;
  const int64_t c0 = tid * chunk < C ? tid * chunk : C, c1 = c0 + chunk < C ? c0 + chunk : C;
  int mine = 0;
  for (int64_t c = c0; c < c1; ++c) mine += start[c + 1];
  int total;
  int run = block_exclusive_scan<kGroupWarps>(mine, red, &total);
  for (int64_t c = c0; c < c1; ++c) {
    run += start[c + 1];
    start[c + 1] = run;
  }
  if (tid == 0) start[0] = 0;
  __syncthreads();
  for (int64_t c = lane; c < C; c += 32) hist[c] += start[c];
  __syncwarp();
  for (int64_t t0 = s0; t0 < s1; t0 += 32) {
    const int64_t l = t0 + lane;
    const int c = l < s1 ? static_cast<int>(as[l]) : -1;
    bool last;
    const int rank = lane_rank(c, &last);
    if (c >= 0) order[hist[c] + rank] = static_cast<int>(l);
    __syncwarp();
    if (c >= 0 && last) hist[c] += rank + 1;
    __syncwarp();
  }
}

void launch_group(const int64_t* assignments, int64_t NH, int64_t L, int64_t C, const Workspace& w,
                  cudaStream_t stream) {
  FA_LAUNCH(dim3(static_cast<unsigned>(NH)), dim3(kGroupThreads), 0, stream, group_kernel)
  (assignments, L, C, w);
  FA_CHECK_LAUNCH("clustered_topk grouping");
}

// ---- cluster means ---------------------------------------------------------------

template <typename T>
__global__ void means_kernel(ClusterMeansCudaArgs a, Workspace w) {
  const int64_t c = blockIdx.x, nh = blockIdx.y;
  const int64_t E = a.E;
  const T* q = static_cast<const T*>(a.q) + nh * a.L * E;
  T* out = static_cast<T*>(a.centroids) + (nh * a.C + c) * E;
  const int b = w.start[nh * (a.C + 1) + c], e = w.start[nh * (a.C + 1) + c + 1];
  const int* order = w.order + nh * a.L;
  const int64_t cnt = a.counts[nh * a.C + c];
  const float inv = 1.f / static_cast<float>(cnt > 1 ? cnt : 1);
  for (int64_t x = threadIdx.x; x < E; x += blockDim.x) {
    float s = 0.f;
    for (int i = b; i < e; ++i) s += to_float(q[static_cast<int64_t>(order[i]) * E + x]);
    out[x] = from_float<T>(s * inv);
  }
}

// ---- improved form: centroid weights, mass and rest per cluster ------------------

template <typename T>
__global__ void __launch_bounds__(kThreads) weights_kernel(ClusteredTopkCudaArgs a, Workspace w) {
  const int64_t c = blockIdx.x, nh = blockIdx.y;
  const int64_t E = a.E, M = a.M, K = a.K, C = a.C;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t len = a.key_lengths ? a.key_lengths[nh / a.H] : a.S;
  const T* k = static_cast<const T*>(a.k) + nh * a.S * E;
  const T* v = static_cast<const T*>(a.v) + nh * a.S * M;
  const T* cen = static_cast<const T*>(a.centroids) + (nh * C + c) * E;
  const T* oc = static_cast<const T*>(a.out_c) + (nh * C + c) * M;
  const int64_t* idx = a.topk + (nh * C + c) * K;
  const float lse = a.lse[nh * C + c];
  float* pc = w.pc + (nh * C + c) * K;
  for (int64_t t = warp; t < K; t += kWarps) {
    const int64_t kk = idx[t];
    float p = 0.f;
    if (kk >= 0 && kk < len) {  // uniform in the warp
      float d = 0.f;
      for (int64_t x = lane; x < E; x += 32) d += to_float(cen[x]) * to_float(k[kk * E + x]);
      d = warp_sum(d);
      p = expf(fminf(a.scale * d - lse, 0.f));  // <= 0 but for rounding
    }
    if (lane == 0) pc[t] = p;
  }
  __syncthreads();
  if (warp == 0) {
    float m = 0.f;
    for (int64_t t = lane; t < K; t += 32) m += pc[t];
    m = warp_sum(m);
    if (lane == 0) w.mass[nh * C + c] = m;
  }
  float* rest = w.rest + (nh * C + c) * M;
  for (int64_t x = tid; x < M; x += kThreads) {
    float r = to_float(oc[x]);
    for (int64_t t = 0; t < K; ++t) {
      if (pc[t] == 0.f) continue;
      r -= pc[t] * to_float(v[idx[t] * M + x]);
    }
    rest[x] = r;
  }
}

// ---- staging of a chunk of the cluster's keys ------------------------------------

struct Smem {
  float *ks, *vs;       // (kChunk, E + 1), (kChunk, M + 1)
  float *dks, *dvs;     // backward: (kChunk, E + 1), (kChunk, M + 1)
  float *qs, *gs;       // (kWarps, E), (kWarps, M): the warps' query and grad_out rows
  float* acc;           // forward: (kWarps, M) output accumulators; backward: (kWarps, E) dQ
  float *ps, *ds;       // (kWarps, kChunk)
  float *grest, *gcen;  // backward: (kWarps, M), (kWarps, E): per-warp partial sums
  float* scal;          // backward: (2, kWarps): per-warp g_mass, g_lse
  int* kidx;            // (kChunk): key index of each chunk row, -1 if dropped
};

__host__ __device__ inline int64_t smem_floats(int64_t E, int64_t M, bool backward) {
  int64_t f = kChunk * (E + 1) + kChunk * (M + 1) + kWarps * E + kWarps * M + 2 * kWarps * kChunk;
  if (backward) f += kChunk * (E + 1) + kChunk * (M + 1) + kWarps * (E + 2 * M + E + 2);
  return f + kChunk;  // kidx
}

__device__ inline Smem carve_smem(float* base, int64_t E, int64_t M, bool backward) {
  Smem s;
  float* p = base;
  s.ks = p;
  p += kChunk * (E + 1);
  s.vs = p;
  p += kChunk * (M + 1);
  s.qs = p;
  p += kWarps * E;
  s.acc = p;
  p += backward ? kWarps * E : kWarps * M;
  s.ps = p;
  p += kWarps * kChunk;
  s.ds = p;
  p += kWarps * kChunk;
  if (backward) {
    s.dks = p;
    p += kChunk * (E + 1);
    s.dvs = p;
    p += kChunk * (M + 1);
    s.gs = p;
    p += kWarps * M;
    s.grest = p;
    p += kWarps * M;
    s.gcen = p;
    p += kWarps * E;
    s.scal = p;
    p += 2 * kWarps;
  } else {
    s.dks = s.dvs = s.gs = s.grest = s.gcen = s.scal = nullptr;
  }
  s.kidx = reinterpret_cast<int*>(p);
  return s;
}

// Loads chunk ch of the cluster's keys (rows of dropped keys are zeros,
// kidx -1) and zeroes the backward's accumulators. Block-wide, no barriers.
template <typename T>
__device__ void stage_chunk(const Smem& s, int ch, const int64_t* idx, int64_t K, int64_t len,
                            const T* k, const T* v, int64_t E, int64_t M, bool backward) {
  const int tid = threadIdx.x;
  if (tid < kChunk) {
    const int64_t t = static_cast<int64_t>(ch) * kChunk + tid;
    const int64_t kk = t < K ? idx[t] : -1;
    s.kidx[tid] = kk >= 0 && kk < len ? static_cast<int>(kk) : -1;
  }
  for (int64_t i = tid; i < kChunk * E; i += kThreads) {
    const int64_t j = i / E, x = i % E, t = static_cast<int64_t>(ch) * kChunk + j;
    const int64_t kk = t < K ? idx[t] : -1;
    s.ks[j * (E + 1) + x] = kk >= 0 && kk < len ? to_float(k[kk * E + x]) : 0.f;
    if (backward) s.dks[j * (E + 1) + x] = 0.f;
  }
  for (int64_t i = tid; i < kChunk * M; i += kThreads) {
    const int64_t j = i / M, x = i % M, t = static_cast<int64_t>(ch) * kChunk + j;
    const int64_t kk = t < K ? idx[t] : -1;
    s.vs[j * (M + 1) + x] = kk >= 0 && kk < len ? to_float(v[kk * M + x]) : 0.f;
    if (backward) s.dvs[j * (M + 1) + x] = 0.f;
  }
}

// Adds the staged chunk's dK / dV accumulators to the global float32
// gradients. Block-wide, no barriers.
__device__ void flush_chunk(const Smem& s, float* gk, float* gv, int64_t E, int64_t M) {
  for (int64_t i = threadIdx.x; i < kChunk * E; i += kThreads) {
    const int64_t j = i / E, x = i % E;
    const int kk = s.kidx[j];
    if (kk >= 0) atomicAdd(&gk[static_cast<int64_t>(kk) * E + x], s.dks[j * (E + 1) + x]);
  }
  for (int64_t i = threadIdx.x; i < kChunk * M; i += kThreads) {
    const int64_t j = i / M, x = i % M;
    const int kk = s.kidx[j];
    if (kk >= 0) atomicAdd(&gv[static_cast<int64_t>(kk) * M + x], s.dvs[j * (M + 1) + x]);
  }
}

// Lane's score of the warp's query against key `lane` of the staged chunk
// (-inf for a dropped key or an idle warp).
__device__ inline float lane_score(const Smem& s, const float* qrow, int64_t E, float scale,
                                   bool active) {
  const int lane = threadIdx.x & 31;
  if (!active || s.kidx[lane] < 0) return -INFINITY;
  const float* kr = s.ks + lane * (E + 1);
  float d = 0.f;
  for (int64_t x = 0; x < E; ++x) d += qrow[x] * kr[x];
  return d * scale;
}

// ---- forward ---------------------------------------------------------------------

template <typename T>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(ClusteredTopkForwardCudaArgs a, Workspace w) {
  FA_DYNAMIC_SHARED(float, smem);
  const int64_t c = blockIdx.x, nh = blockIdx.y;
  const int64_t E = a.E, M = a.M, K = a.K, C = a.C, L = a.L;
  const int b = w.start[nh * (C + 1) + c], e = w.start[nh * (C + 1) + c + 1];
  if (b == e) return;  // uniform
  const Smem s = carve_smem(smem, E, M, false);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t len = a.key_lengths ? a.key_lengths[nh / a.H] : a.S;
  const T* q = static_cast<const T*>(a.q) + nh * L * E;
  const T* k = static_cast<const T*>(a.k) + nh * a.S * E;
  const T* v = static_cast<const T*>(a.v) + nh * a.S * M;
  T* out = static_cast<T*>(a.out) + nh * L * M;
  const int64_t* idx = a.topk + (nh * C + c) * K;
  const bool improved = a.centroids != nullptr;
  const float m = improved ? w.mass[nh * C + c] : a.mass[nh * C + c];
  const float* rest = improved ? w.rest + (nh * C + c) * M : nullptr;
  const int nchunks = static_cast<int>((K + kChunk - 1) / kChunk);
  const int* order = w.order + nh * L;
  float* qrow = s.qs + warp * E;
  float* acc = s.acc + warp * M;
  float* ps = s.ps + warp * kChunk;
  int staged = -1;
  for (int i0 = b; i0 < e; i0 += kWarps) {
    const int i = i0 + warp;
    const bool active = i < e;
    const int64_t l = active ? order[i] : 0;
    if (active) {
      for (int64_t x = lane; x < E; x += 32) qrow[x] = to_float(q[l * E + x]);
      for (int64_t x = lane; x < M; x += 32) acc[x] = 0.f;
    }
    __syncwarp();
    float mx = -INFINITY, sum = 0.f;
    for (int ch = 0; ch < nchunks; ++ch) {
      if (ch != staged) {  // uniform over the block
        __syncthreads();
        stage_chunk(s, ch, idx, K, len, k, v, E, M, false);
        __syncthreads();
        staged = ch;
      }
      const float sc = lane_score(s, qrow, E, a.scale, active);
      const float nmx = fmaxf(mx, warp_max(sc));
      if (nmx == -INFINITY) continue;  // nothing kept so far (uniform in the warp)
      const float p = sc == -INFINITY ? 0.f : expf(sc - nmx);
      const float corr = mx == -INFINITY ? 0.f : expf(mx - nmx);
      sum = sum * corr + warp_sum(p);
      mx = nmx;
      ps[lane] = p;
      __syncwarp();
      for (int64_t x = lane; x < M; x += 32) {
        float o = acc[x] * corr;
        for (int j = 0; j < kChunk; ++j) o += ps[j] * s.vs[j * (M + 1) + x];
        acc[x] = o;
      }
      __syncwarp();
    }
    if (active) {
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      for (int64_t x = lane; x < M; x += 32) {
        float o = m * (acc[x] * inv);
        if (improved) o += rest[x];
        out[l * M + x] = from_float<T>(o);
      }
    }
    __syncwarp();
  }
}

// ---- backward --------------------------------------------------------------------

template <typename T>
__global__ void __launch_bounds__(kThreads)
    backward_kernel(ClusteredTopkBackwardCudaArgs a, Workspace w) {
  FA_DYNAMIC_SHARED(float, smem);
  const int64_t c = blockIdx.x, nh = blockIdx.y;
  const int64_t E = a.E, M = a.M, K = a.K, C = a.C, L = a.L, S = a.S;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const bool improved = a.centroids != nullptr;
  const int b = w.start[nh * (C + 1) + c], e = w.start[nh * (C + 1) + c + 1];
  if (b == e) {  // uniform: an empty cluster's gradients are zeros
    if (improved) {
      for (int64_t x = tid; x < E; x += kThreads) a.grad_centroids[(nh * C + c) * E + x] = 0.f;
      for (int64_t x = tid; x < M; x += kThreads) a.grad_out_c[(nh * C + c) * M + x] = 0.f;
      if (tid == 0) a.grad_lse[nh * C + c] = 0.f;
    } else if (tid == 0) {
      a.grad_mass[nh * C + c] = 0.f;
    }
    return;
  }
  const Smem s = carve_smem(smem, E, M, true);
  const int64_t len = a.key_lengths ? a.key_lengths[nh / a.H] : S;
  const T* q = static_cast<const T*>(a.q) + nh * L * E;
  const T* k = static_cast<const T*>(a.k) + nh * S * E;
  const T* v = static_cast<const T*>(a.v) + nh * S * M;
  const T* go = static_cast<const T*>(a.grad_out) + nh * L * M;
  float* gq = a.grad_q + nh * L * E;
  float* gk = a.grad_k + nh * S * E;
  float* gv = a.grad_v + nh * S * M;
  const int64_t* idx = a.topk + (nh * C + c) * K;
  const float m = improved ? w.mass[nh * C + c] : a.mass[nh * C + c];
  const int nchunks = static_cast<int>((K + kChunk - 1) / kChunk);
  const int* order = w.order + nh * L;
  float* qrow = s.qs + warp * E;
  float* grow = s.gs + warp * M;
  float* dq = s.acc + warp * E;
  float* ps = s.ps + warp * kChunk;
  float* dsw = s.ds + warp * kChunk;
  float* grest = s.grest + warp * M;
  float* gcen = s.gcen + warp * E;
  for (int64_t x = lane; x < M; x += 32) grest[x] = 0.f;
  for (int64_t x = lane; x < E; x += 32) gcen[x] = 0.f;
  float g_mass_w = 0.f, g_lse_w = 0.f;  // this warp's partial sums (every lane)
  int staged = -1;
  auto ensure = [&](int ch) {
    if (ch == staged) return;  // uniform over the block
    __syncthreads();
    if (staged >= 0) flush_chunk(s, gk, gv, E, M);
    __syncthreads();
    stage_chunk(s, ch, idx, K, len, k, v, E, M, true);
    __syncthreads();
    staged = ch;
  };
  // Lane's g·v_lane over the staged chunk.
  auto lane_gv = [&]() {
    const float* vr = s.vs + lane * (M + 1);
    float d = 0.f;
    for (int64_t x = 0; x < M; ++x) d += grow[x] * vr[x];
    return d;
  };
  for (int i0 = b; i0 < e; i0 += kWarps) {
    const int i = i0 + warp;
    const bool active = i < e;
    const int64_t l = active ? order[i] : 0;
    for (int64_t x = lane; x < E; x += 32) {  // an idle warp's rows are zeros
      qrow[x] = active ? to_float(q[l * E + x]) : 0.f;
      dq[x] = 0.f;
    }
    for (int64_t x = lane; x < M; x += 32) grow[x] = active ? to_float(go[l * M + x]) : 0.f;
    __syncwarp();
    // Pass A: row max, sum and Σ p·(g·v), online over the chunks.
    float mx = -INFINITY, sum = 0.f, rd = 0.f;
    for (int ch = 0; ch < nchunks; ++ch) {
      ensure(ch);
      const float sc = lane_score(s, qrow, E, a.scale, active);
      const float nmx = fmaxf(mx, warp_max(sc));
      if (nmx == -INFINITY) continue;
      const float p = sc == -INFINITY ? 0.f : expf(sc - nmx);
      const float corr = mx == -INFINITY ? 0.f : expf(mx - nmx);
      const float gvl = p != 0.f ? lane_gv() : 0.f;
      sum = sum * corr + warp_sum(p);
      rd = rd * corr + warp_sum(p * gvl);
      mx = nmx;
    }
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    const float row_dot = rd * inv;
    // Pass B: p, dS and dQ per warp; then dK += Σ_w dS_wᵀ q_w and
    // dV += Σ_w m·p_wᵀ g_w by the whole block, each thread owning entries
    // (no atomics; idle warps contribute zeros).
    for (int ch = 0; ch < nchunks; ++ch) {
      ensure(ch);
      float p = 0.f, ds = 0.f;
      if (mx != -INFINITY) {  // some key kept (uniform in the warp; false for idle warps)
        const float sc = lane_score(s, qrow, E, a.scale, active);
        p = sc == -INFINITY ? 0.f : expf(sc - mx) * inv;
        const float gvl = p != 0.f ? lane_gv() : 0.f;
        ds = p * (gvl - row_dot) * m * a.scale;
      }
      ps[lane] = m * p;
      dsw[lane] = ds;
      __syncwarp();
      if (mx != -INFINITY) {
        for (int64_t x = lane; x < E; x += 32) {
          float d = dq[x];
          for (int j = 0; j < kChunk; ++j) d += dsw[j] * s.ks[j * (E + 1) + x];
          dq[x] = d;
        }
      }
      __syncthreads();
      for (int64_t i = tid; i < kChunk * E; i += kThreads) {
        const int64_t j = i / E, x = i % E;
        float d = s.dks[j * (E + 1) + x];
        for (int w2 = 0; w2 < kWarps; ++w2) d += s.ds[w2 * kChunk + j] * s.qs[w2 * E + x];
        s.dks[j * (E + 1) + x] = d;
      }
      for (int64_t i = tid; i < kChunk * M; i += kThreads) {
        const int64_t j = i / M, x = i % M;
        float d = s.dvs[j * (M + 1) + x];
        for (int w2 = 0; w2 < kWarps; ++w2) d += s.ps[w2 * kChunk + j] * s.gs[w2 * M + x];
        s.dvs[j * (M + 1) + x] = d;
      }
      __syncthreads();
    }
    if (active) {
      for (int64_t x = lane; x < E; x += 32) gq[l * E + x] = dq[x];
      g_mass_w += row_dot;
      for (int64_t x = lane; x < M; x += 32) grest[x] += grow[x];
    }
    __syncwarp();
  }
  __syncthreads();
  if (staged >= 0) flush_chunk(s, gk, gv, E, M);  // nothing staged when K = 0
  if (lane == 0) s.scal[warp] = g_mass_w;
  __syncthreads();
  // The warps' partial sums, added in warp order (deterministic).
  float g_mass = 0.f;
  for (int w2 = 0; w2 < kWarps; ++w2) g_mass += s.scal[w2];
  for (int64_t x = tid; x < M; x += kThreads) {
    float r = 0.f;
    for (int w2 = 0; w2 < kWarps; ++w2) r += s.grest[w2 * M + x];
    s.grest[x] = r;  // row 0 becomes the total: rows are read above only by their own column
  }
  __syncthreads();
  if (!improved) {
    if (tid == 0) a.grad_mass[nh * C + c] = g_mass;
    return;
  }
  // rest = out_c - Σ p_t v_t, mass = Σ p_t, p_t = exp(scale·c·k_t - lse):
  // d p_t = g_mass - g_rest·v_t; d s_t = p_t · d p_t; d lse = -Σ d s_t;
  // d c = scale Σ d s_t k_t; d k_t += scale · d s_t · c; d v_t -= p_t g_rest.
  const T* cen = static_cast<const T*>(a.centroids) + (nh * C + c) * E;
  const float* pc = w.pc + (nh * C + c) * K;
  for (int64_t t = warp; t < K; t += kWarps) {
    const float p = pc[t];
    if (p == 0.f) continue;  // dropped (or underflowed) key: no contribution
    const int64_t kk = idx[t];
    float d = 0.f;
    for (int64_t x = lane; x < M; x += 32) {
      const float gr = s.grest[x];
      d += gr * to_float(v[kk * M + x]);
      atomicAdd(&gv[kk * M + x], -p * gr);
    }
    const float gs = (g_mass - warp_sum(d)) * p;
    for (int64_t x = lane; x < E; x += 32) {
      gcen[x] += a.scale * gs * to_float(k[kk * E + x]);
      atomicAdd(&gk[kk * E + x], a.scale * gs * to_float(cen[x]));
    }
    g_lse_w -= gs;
  }
  if (lane == 0) s.scal[kWarps + warp] = g_lse_w;
  __syncthreads();
  for (int64_t x = tid; x < E; x += kThreads) {
    float r = 0.f;
    for (int w2 = 0; w2 < kWarps; ++w2) r += s.gcen[w2 * E + x];
    a.grad_centroids[(nh * C + c) * E + x] = r;
  }
  for (int64_t x = tid; x < M; x += kThreads) a.grad_out_c[(nh * C + c) * M + x] = s.grest[x];
  if (tid == 0) {
    float r = 0.f;
    for (int w2 = 0; w2 < kWarps; ++w2) r += s.scal[kWarps + w2];
    a.grad_lse[nh * C + c] = r;
  }
}

// ---- centroid gradients to the members -------------------------------------------

__global__ void add_centroid_grads_kernel(AddCentroidGradsCudaArgs a) {
  const int64_t total = a.NH * a.L * a.E;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t x = i % a.E, row = i / a.E, nh = row / a.L;
    const int64_t c = a.assignments[row];
    if (c < 0) continue;
    const int64_t cnt = a.counts[nh * a.C + c];
    a.dst[i] += a.table[(nh * a.C + c) * a.E + x] / static_cast<float>(cnt > 1 ? cnt : 1);
  }
}

dim3 cluster_grid(int64_t C, int64_t NH) {
  if (C > 2147483647LL || NH > 65535)
    throw std::runtime_error("fastattn CUDA kernel clustered_topk: too many clusters or heads");
  return dim3(static_cast<unsigned>(C), static_cast<unsigned>(NH));
}

int64_t checked_shared(int64_t E, int64_t M, bool backward) {
  const int64_t bytes = clustered_topk_cuda_shared_bytes(E, M, backward);
  if (bytes > kMaxShared)
    throw std::runtime_error(
        "fastattn CUDA kernel clustered_topk: head dims E = " + std::to_string(E) +
        ", M = " + std::to_string(M) + " need " + std::to_string(bytes) +
        " bytes of shared memory, more than the 227 KiB of a block");
  return bytes;
}

}  // namespace

int64_t clustered_topk_cuda_workspace_bytes(int64_t N, int64_t H, int64_t L, int64_t C, int64_t K,
                                            int64_t M) {
  int64_t bytes = 0;
  carve(nullptr, N * H, L, C, K, M, &bytes);
  return bytes;
}

int64_t clustered_topk_cuda_shared_bytes(int64_t E, int64_t M, bool backward) {
  return smem_floats(E, M, backward) * static_cast<int64_t>(sizeof(float));
}

void cluster_means_cuda(const ClusterMeansCudaArgs& a, cudaStream_t stream) {
  if (!a.mean) throw std::invalid_argument("fastattn CUDA kernel cluster_means: means only");
  const int64_t NH = a.NH;
  if (NH == 0 || a.C == 0 || a.E == 0) return;
  const Workspace w = carve(a.workspace, NH, a.L, a.C, 0, 0, nullptr);
  launch_group(a.assignments, NH, a.L, a.C, w, stream);
  FA_DISPATCH_FLOAT_TYPES(a.dtype, "cluster_means", [&] {
    FA_LAUNCH(cluster_grid(a.C, NH), dim3(64), 0, stream, means_kernel<scalar_t>)(a, w);
    FA_CHECK_LAUNCH("cluster_means");
  });
}

void clustered_topk_forward_cuda(const ClusteredTopkForwardCudaArgs& a, cudaStream_t stream) {
  const int64_t NH = a.N * a.H;
  if (NH == 0 || a.L == 0 || a.M == 0 || a.C == 0) return;
  const Workspace w = carve(a.workspace, NH, a.L, a.C, a.K, a.M, nullptr);
  if (!a.grouped) launch_group(a.assignments, NH, a.L, a.C, w, stream);
  const int64_t shared = checked_shared(a.E, a.M, false);
  const dim3 grid = cluster_grid(a.C, NH);
  FA_DISPATCH_FLOAT_TYPES(a.dtype, "clustered_topk_forward", [&] {
    if (a.centroids) {
      FA_LAUNCH(grid, dim3(kThreads), 0, stream, weights_kernel<scalar_t>)(a, w);
      FA_CHECK_LAUNCH("clustered_topk centroid weights");
    }
    FA_SET_MAX_DYNAMIC_SHARED(shared, forward_kernel<scalar_t>);
    FA_LAUNCH(grid, dim3(kThreads), static_cast<size_t>(shared), stream, forward_kernel<scalar_t>)
    (a, w);
    FA_CHECK_LAUNCH("clustered_topk_forward");
  });
}

void clustered_topk_backward_cuda(const ClusteredTopkBackwardCudaArgs& a, cudaStream_t stream) {
  const int64_t NH = a.N * a.H;
  if (NH == 0 || a.C == 0) return;
  const Workspace w = carve(a.workspace, NH, a.L, a.C, a.K, a.M, nullptr);
  launch_group(a.assignments, NH, a.L, a.C, w, stream);
  const int64_t shared = checked_shared(a.E, a.M, true);
  const dim3 grid = cluster_grid(a.C, NH);
  FA_DISPATCH_FLOAT_TYPES(a.dtype, "clustered_topk_backward", [&] {
    if (a.centroids) {
      FA_LAUNCH(grid, dim3(kThreads), 0, stream, weights_kernel<scalar_t>)(a, w);
      FA_CHECK_LAUNCH("clustered_topk centroid weights");
    }
    FA_SET_MAX_DYNAMIC_SHARED(shared, backward_kernel<scalar_t>);
    FA_LAUNCH(grid, dim3(kThreads), static_cast<size_t>(shared), stream, backward_kernel<scalar_t>)
    (a, w);
    FA_CHECK_LAUNCH("clustered_topk_backward");
  });
}

void add_centroid_grads_cuda(const AddCentroidGradsCudaArgs& a, cudaStream_t stream) {
  if (!a.divide || !a.accumulate)
    throw std::invalid_argument(
        "fastattn CUDA kernel add_centroid_grads: divide and accumulate only");
  const int64_t total = a.NH * a.L * a.E;
  if (total == 0 || a.C == 0) return;
  const int64_t blocks = ceil_div(total, 256);
  FA_LAUNCH(dim3(static_cast<unsigned>(blocks < 65535 ? blocks : 65535)), dim3(256), 0, stream,
            add_centroid_grads_kernel)
  (a);
  FA_CHECK_LAUNCH("add_centroid_grads");
}

}  // namespace fastattn::cuda
