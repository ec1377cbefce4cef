// CUDA kernels of hard retrieval attention (see hard_retrieval_cuda.h; the
// semantics are those of the CPU kernel, hard_retrieval.h).
//
// Forward: one block per (n·h, tile of 16 queries), 4 warps of 4 query rows.
// The scores of a reservoir tile of 128 keys (the CPU kernel's key tile, which
// numbers the random draws) go to shared memory: float32 by SIMT (keys stream
// through shared memory 32 at a time, one key per lane), float16 / bfloat16
// on tensor cores (fa_wmma: each warp scores 32 of the 128 keys for the 16
// queries, float accumulation);
// then each warp updates its rows: a running argmax of the raw kept scores
// (ties to the lowest j, warp reduction), and/or the online softmax (max,
// sum) and, when sampling, the CPU kernel's weighted-reservoir step with the
// same counter-based uniforms (SplitMix64 of (seed, n·H·L + i, tile, draw),
// reproduced here as __host__ __device__ code) and the inverse CDF inside the
// tile by a warp prefix sum. Same seed, same indices as the CPU kernel (up to
// a draw falling within float rounding of a boundary). The chosen value row
// is then copied.
// Backward (straight-through): the soft output P V and its lse by the
// block-sparse forward kernel in its dense form with the keep mask, delta =
// rowsum(dO ∘ P V) (one warp per row), dQ and dK by the block-sparse backward
// kernels (P recomputed from the forward's lse; dV not computed there), and dV
// as an index-add of grad_out rows (float atomics).
// The backward's products run on tensor cores for float16 / bfloat16 (the
// block-sparse kernels), SIMT for float32. Cost: forward
// 2·N·H·L·S·E flops (+ one exp per score when sampling or when the lse is
// needed); backward about 3× a dense attention forward.
// Tested by tests/cuda_emu/test_hard_retrieval.cpp (emulator against the CPU
// kernels in float64) and tests/cuda/test_cuda_hard_retrieval.cpp (GPU).
#include "kernels/hard_retrieval/hard_retrieval_cuda.h"

#include "kernels/block_sparse/block_sparse_attention_cuda.h"
#include "kernels/common/cuda_compat.cuh"

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
constexpr int kRows = 4;             // query rows per warp
constexpr int kBr = kWarps * kRows;  // queries per block
constexpr int kTile = 128;           // reservoir tile: the CPU kernel's kBc
constexpr int kSub = 32;             // keys per shared-memory load

__host__ __device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

// The sampler's uniform in [0, 1), as kernels::hard_retrieval_uniform (CPU).
__host__ __device__ double hard_retrieval_uniform_cuda(uint64_t seed, uint64_t row, uint64_t tile,
                                                       uint64_t draw) {
  const uint64_t h = splitmix64(splitmix64(splitmix64(seed) ^ row) ^ (tile * 2 + draw));
  return static_cast<double>(h >> 11) * 0x1.0p-53;
}

namespace {

__device__ __forceinline__ bool kept(const HardRetrievalCudaParams& a, int64_t n, int64_t h,
                                     int64_t i, int64_t j, int64_t kend) {
  if (j >= kend) return false;
  if (a.causal && j > i + a.S - a.L) return false;
  return a.keep == nullptr || a.keep[n * a.keep_sn + h * a.keep_sh + i * a.keep_sl + j];
}

template <typename T, bool TC>
__device__ __forceinline__ void forward_body(const HardRetrievalForwardCudaArgs& a) {
  const int64_t q_tiles = cuda::ceil_div(a.L, kBr);
  const int64_t t = blockIdx.x % q_tiles, nh = blockIdx.x / q_tiles;
  const int64_t n = nh / a.H, h = nh % a.H;
  const int64_t E = a.E, M = a.M, L = a.L, S = a.S, i0 = t * kBr;
  const T* q = static_cast<const T*>(a.q) + nh * L * E;
  const T* k = static_cast<const T*>(a.k) + nh * S * E;
  const T* v = static_cast<const T*>(a.v) + nh * S * M;
  const bool need_softmax = a.sample || a.lse != nullptr;

  // SIMT (float32, and bfloat16 without tensor cores): scores from qs, ks as
  // float. Tensor cores (float16 / bfloat16): qt, kt in T, zero-padded to Ep
  // columns; warp w scores keys [32w, 32w + 32) of the reservoir tile for all
  // 16 rows.
  constexpr bool kTC = TC;
  const int64_t Ep = (E + 15) / 16 * 16;
  FA_DYNAMIC_SHARED(unsigned char, smem_raw);
  unsigned char* smem =
      smem_raw + ((128 - reinterpret_cast<uintptr_t>(smem_raw) % 128) % 128);  // WMMA alignment
  float* sc = reinterpret_cast<float*>(smem);              // (kBr, kTile) raw scores
  unsigned char* kp = smem + kBr * kTile * sizeof(float);  // (kBr, kTile) kept
  float* qs = reinterpret_cast<float*>(kp + kBr * kTile);  // SIMT: (kBr, E)
  float* ks = qs + kBr * E;                                // SIMT: (kSub, E + 1)
  T* qt = reinterpret_cast<T*>(kp + kBr * kTile);          // TC: (kBr, Ep)
  T* kt = qt + kBr * Ep;                                   // TC: (kTile, Ep)

  if constexpr (kTC) {
    for (int64_t x = threadIdx.x; x < kBr * Ep; x += kThreads) {
      const int64_t r = x / Ep, e = x % Ep, i = i0 + r;
      qt[x] = i < L && e < E ? q[i * E + e] : from_float<T>(0.f);
    }
  } else {
    for (int64_t x = threadIdx.x; x < kBr * E; x += kThreads) {
      const int64_t r = x / E, i = i0 + r;
      qs[x] = i < L ? to_float(q[i * E + x % E]) : 0.f;
    }
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int64_t kend = a.key_lengths ? a.key_lengths[n] : S;
  if (a.causal) {
    const int64_t last = (i0 + kBr < L ? i0 + kBr : L) + S - L;  // past the last visible key
    if (last < kend) kend = last;
  }

  // Per row (the same in every lane of the warp).
  float m[kRows], w[kRows], best_score[kRows];
  int64_t best[kRows];
  bool locked[kRows];
  FA_UNROLL
  for (int rr = 0; rr < kRows; ++rr) {
    m[rr] = -INFINITY;
    w[rr] = 0.f;
    best_score[rr] = -INFINITY;
    best[rr] = -1;
    locked[rr] = false;
  }

  for (int64_t j0 = 0; j0 < kend; j0 += kTile) {
    if constexpr (kTC) {
      namespace wm = fa_wmma;
      __syncthreads();  // the previous tile is consumed
      for (int64_t x = threadIdx.x; x < kTile * Ep; x += kThreads) {
        const int64_t c = x / Ep, e = x % Ep, j = j0 + c;
        kt[x] = j < kend && e < E ? k[j * E + e] : from_float<T>(0.f);
      }
      __syncthreads();
      for (int ct = 0; ct < kSub / 16; ++ct) {
        wm::fragment<wm::accumulator, 16, 16, 16, float> acc;
        wm::fill_fragment(acc, 0.f);
        for (int64_t e0 = 0; e0 < Ep; e0 += 16) {
          wm::fragment<wm::matrix_a, 16, 16, 16, T, wm::row_major> fq;
          wm::fragment<wm::matrix_b, 16, 16, 16, T, wm::col_major> fk;
          wm::load_matrix_sync(fq, qt + e0, static_cast<unsigned>(Ep));
          wm::load_matrix_sync(fk, kt + (warp * kSub + ct * 16) * Ep + e0,
                               static_cast<unsigned>(Ep));
          wm::mma_sync(acc, fq, fk, acc);
        }
        wm::store_matrix_sync(sc + warp * kSub + ct * 16, acc, kTile, wm::mem_row_major);
      }
      for (int64_t x = threadIdx.x; x < kBr * kTile; x += kThreads) {
        const int64_t i = i0 + x / kTile;
        kp[x] = i < L && kept(a, n, h, i, j0 + x % kTile, kend) ? 1 : 0;
      }
      __syncthreads();
    } else {
      for (int sub = 0; sub < kTile / kSub; ++sub) {
        const int64_t js = j0 + sub * kSub;
        const bool any = js < kend;  // block-uniform
        __syncthreads();             // the previous keys are consumed
        if (any) {
          for (int64_t x = threadIdx.x; x < kSub * E; x += kThreads) {
            const int64_t c = x / E, j = js + c;
            ks[c * (E + 1) + x % E] = j < kend ? to_float(k[j * E + x % E]) : 0.f;
          }
        }
        __syncthreads();
        FA_UNROLL
        for (int rr = 0; rr < kRows; ++rr) {
          const int r = warp * kRows + rr;
          const int64_t i = i0 + r, j = js + lane;
          const bool keep = any && i < L && kept(a, n, h, i, j, kend);
          float s = 0.f;
          if (keep) {
            const float* qr = qs + r * E;
            const float* kr = ks + lane * (E + 1);
            for (int64_t e = 0; e < E; ++e) s += qr[e] * kr[e];
          }
          sc[r * kTile + sub * kSub + lane] = s;
          kp[r * kTile + sub * kSub + lane] = keep ? 1 : 0;
        }
      }
      __syncwarp();  // each warp reads only its own rows
    }
    const uint64_t tile = static_cast<uint64_t>(j0 / kTile);
    FA_UNROLL
    for (int rr = 0; rr < kRows; ++rr) {
      const int r = warp * kRows + rr;
      const int64_t i = i0 + r;
      if (i >= L) continue;  // warp-uniform
      float raw[4];
      bool kk[4];
      FA_UNROLL
      for (int u = 0; u < 4; ++u) {
        raw[u] = sc[r * kTile + 4 * lane + u];
        kk[u] = kp[r * kTile + 4 * lane + u] != 0;
      }
      if (!a.sample && !locked[rr]) {
        // The CPU rule, in increasing j: the first kept key, then any strictly
        // greater score. So a NaN first key stays; otherwise the lowest index
        // of the largest non-NaN score.
        int first = 1 << 30;
        FA_UNROLL
        for (int u = 3; u >= 0; --u)
          if (kk[u]) first = 4 * lane + u;
        for (int o = 16; o > 0; o >>= 1) {
          const int other = __shfl_xor_sync(0xffffffffu, first, o);
          first = other < first ? other : first;
        }
        if (first < kTile && best[rr] < 0 && isnan(sc[r * kTile + first])) {
          locked[rr] = true;
          best[rr] = j0 + first;
        } else {
          float cs = -INFINITY;
          int ci = -1;
          FA_UNROLL
          for (int u = 0; u < 4; ++u)
            if (kk[u] && !isnan(raw[u]) && (ci < 0 || raw[u] > cs)) {
              cs = raw[u];
              ci = 4 * lane + u;
            }
          for (int o = 16; o > 0; o >>= 1) {
            const float os = __shfl_xor_sync(0xffffffffu, cs, o);
            const int oi = __shfl_xor_sync(0xffffffffu, ci, o);
            if (oi >= 0 && (ci < 0 || os > cs || (os == cs && oi < ci))) {
              cs = os;
              ci = oi;
            }
          }
          if (ci >= 0 && (best[rr] < 0 || cs > best_score[rr])) {
            best[rr] = j0 + ci;
            best_score[rr] = cs;
          }
        }
      }
      if (!need_softmax) continue;
      float s[4], tmax = -INFINITY;
      FA_UNROLL
      for (int u = 0; u < 4; ++u) {
        s[u] = kk[u] ? raw[u] * a.scale : -INFINITY;
        tmax = fmaxf(tmax, s[u]);
      }
      const float m_new = fmaxf(m[rr], warp_max(tmax));
      if (m_new == -INFINITY) continue;  // nothing kept so far
      const float alpha = expf(m[rr] - m_new);
      float p[4], lane_sum = 0.f;
      FA_UNROLL
      for (int u = 0; u < 4; ++u) {
        p[u] = kk[u] ? expf(s[u] - m_new) : 0.f;
        lane_sum += p[u];
      }
      const float wt = warp_sum(lane_sum);
      w[rr] = w[rr] * alpha + wt;
      m[rr] = m_new;
      if (!a.sample || !(wt > 0.f)) continue;
      const uint64_t row_id = static_cast<uint64_t>(nh * L + i);
      // Reservoir step: this tile takes over with probability wt / w.
      const double u1 = hard_retrieval_uniform_cuda(a.seed, row_id, tile, 0);
      if (!(u1 * static_cast<double>(w[rr]) < static_cast<double>(wt))) continue;
      // Inverse CDF inside the tile; rounding falls back to the last kept key.
      const double target = hard_retrieval_uniform_cuda(a.seed, row_id, tile, 1) * wt;
      double incl = 0;
      FA_UNROLL
      for (int u = 0; u < 4; ++u) incl += static_cast<double>(p[u]);
      for (int o = 1; o < 32; o <<= 1) {
        const double y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
      }
      double cum = __shfl_up_sync(0xffffffffu, incl, 1);
      if (lane == 0) cum = 0;
      int hit = -1, last_pos = -1;
      FA_UNROLL
      for (int u = 0; u < 4; ++u) {
        if (!(p[u] > 0.f)) continue;
        last_pos = 4 * lane + u;
        cum += static_cast<double>(p[u]);
        if (hit < 0 && cum > target) hit = 4 * lane + u;
      }
      const unsigned hits = __ballot_sync(0xffffffffu, hit >= 0);
      const unsigned lasts = __ballot_sync(0xffffffffu, last_pos >= 0);
      int pick = -1;
      if (hits != 0) {
        pick = __shfl_sync(0xffffffffu, hit, __ffs(static_cast<int>(hits)) - 1);
      } else if (lasts != 0) {
        pick = __shfl_sync(0xffffffffu, last_pos, 31 - __clz(static_cast<int>(lasts)));
      }
      if (pick >= 0) best[rr] = j0 + pick;
    }
  }

  FA_UNROLL
  for (int rr = 0; rr < kRows; ++rr) {
    const int64_t i = i0 + warp * kRows + rr;
    if (i >= L) continue;
    const int64_t row = nh * L + i, idx = best[rr];
    if (lane == 0) {
      a.index[row] = idx;
      if (a.lse) a.lse[row] = w[rr] > 0.f ? m[rr] + logf(w[rr]) : -INFINITY;
    }
    T* out = static_cast<T*>(a.out) + row * M;
    for (int64_t c = lane; c < M; c += 32) out[c] = idx >= 0 ? v[idx * M + c] : from_float<T>(0.f);
  }
}

// The kernel; TC: the tensor-core variant of a half type, whose body exists
// only where T has tensor cores (see cuda_compat.cuh).
template <typename T, bool TC>
__global__ void __launch_bounds__(kThreads) forward_kernel(HardRetrievalForwardCudaArgs a) {
  if constexpr (!TC || cuda::wmma_compiled<T>()) {
    forward_body<T, TC>(a);
  } else {
    FA_TRAP();
  }
}

template <typename T, bool TC>
void launch_forward_as(const HardRetrievalForwardCudaArgs& a, cudaStream_t stream) {
  const int64_t blocks = cuda::ceil_div(a.L, kBr) * a.N * a.H;
  const int64_t Ep = (a.E + 15) / 16 * 16;
  const size_t smem =
      128 + kBr * kTile * (sizeof(float) + 1) +
      (TC ? (kBr + kTile) * Ep * sizeof(T) : (kBr * a.E + kSub * (a.E + 1)) * sizeof(float));
  FA_SET_MAX_DYNAMIC_SHARED(smem, forward_kernel<T, TC>);
  FA_LAUNCH(dim3(static_cast<unsigned>(blocks)), dim3(kThreads), smem, stream,
            forward_kernel<T, TC>)
  (a);
  FA_CHECK_LAUNCH("hard_retrieval_attention_forward");
}

// Tensor cores for the half types where the device's code has them, else SIMT.
template <typename T>
void launch_forward(const HardRetrievalForwardCudaArgs& a, cudaStream_t stream) {
  if constexpr (cuda::wmma_min_arch<T>() > 0) {
    if (FA_USE_TENSOR_CORES(T, "hard_retrieval_attention_forward", forward_kernel<T, true>)) {
      launch_forward_as<T, true>(a, stream);
      return;
    }
  }
  if constexpr (!cuda::wmma_always<T>()) launch_forward_as<T, false>(a, stream);
}

// delta = rowsum(grad_out ∘ out): one warp per row.
template <typename T>
__global__ void delta_kernel(const T* grad_out, const float* out, float* delta, int64_t rows,
                             int64_t M) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  float s = 0.f;
  if (row < rows)
    for (int64_t c = lane; c < M; c += 32) s += to_float(grad_out[row * M + c]) * out[row * M + c];
  s = warp_sum(s);
  if (row < rows && lane == 0) delta[row] = s;
}

// grad_v[n, h, index[row]] += grad_out[row] (one warp per row, float atomics).
template <typename T>
__global__ void grad_v_kernel(const T* grad_out, const int64_t* index, float* grad_v, int64_t L,
                              int64_t S, int64_t rows, int64_t M) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (row >= rows) return;
  const int64_t idx = index[row];
  if (idx < 0) return;
  float* dst = grad_v + ((row / L) * S + idx) * M;
  for (int64_t c = threadIdx.x % 32; c < M; c += 32)
    atomicAdd(dst + c, to_float(grad_out[row * M + c]));
}

void check_dims(const HardRetrievalCudaParams& a) {
  if (a.E > kHardRetrievalCudaMaxDim || a.M > kHardRetrievalCudaMaxDim)
    throw std::runtime_error(
        "fastattn CUDA hard_retrieval_attention: head dims E and M must be <= " +
        std::to_string(kHardRetrievalCudaMaxDim) + ", got E = " + std::to_string(a.E) +
        ", M = " + std::to_string(a.M));
}

}  // namespace

void hard_retrieval_forward_cuda(const HardRetrievalForwardCudaArgs& a, cudaStream_t stream) {
  if (a.N * a.H == 0 || a.L == 0) return;
  check_dims(a);
  FA_DISPATCH_FLOAT_TYPES(a.dtype, "hard_retrieval_attention_forward",
                          [&] { launch_forward<scalar_t>(a, stream); });
}

void hard_retrieval_backward_cuda(const HardRetrievalBackwardCudaArgs& a, cudaStream_t stream) {
  if (a.N * a.H == 0 || a.L == 0 || a.S == 0) return;
  check_dims(a);
  // The soft attention P V (dense, with the keep mask) and delta.
  BlockSparseCudaParams p;
  static_cast<QKVParams<void>&>(p) = a;  // the operands and sizes
  p.keep = a.keep;
  p.keep_sn = a.keep_sn;
  p.keep_sh = a.keep_sh;
  p.keep_sl = a.keep_sl;
  p.causal = a.causal;
  p.scale = a.scale;
  p.parts[0] = BlockSparsePartCuda{};
  p.parts[0].max_sp = a.S;
  p.num_parts = 1;
  BlockSparseForwardCudaArgs f;
  static_cast<BlockSparseCudaParams&>(f) = p;
  f.out_float = a.ws_out;
  f.lse = a.ws_lse;
  block_sparse_attention_forward_cuda(f, stream);
  const int64_t rows = a.N * a.H * a.L;
  const unsigned row_blocks = static_cast<unsigned>(cuda::ceil_div(rows, kWarps));
  FA_DISPATCH_FLOAT_TYPES(a.dtype, "hard_retrieval_attention_backward", [&] {
    FA_LAUNCH(dim3(row_blocks), dim3(kThreads), 0, stream, delta_kernel<scalar_t>)
    (static_cast<const scalar_t*>(a.grad_out), static_cast<const float*>(a.ws_out), a.ws_delta,
     rows, a.M);
    FA_CHECK_LAUNCH("hard_retrieval_attention_backward (delta)");
  });
  // dQ, dK from the saved lse.
  BlockSparseBackwardCudaArgs b;
  static_cast<BlockSparseCudaParams&>(b) = p;
  b.grad_out = a.grad_out;
  b.lse = a.lse;
  b.delta = a.ws_delta;
  b.grad_q = a.grad_q;
  b.grad_k = a.grad_k;
  b.grad_v = nullptr;
  block_sparse_attention_backward_cuda(b, stream);
  // dV: the index-add.
  FA_DISPATCH_FLOAT_TYPES(a.dtype, "hard_retrieval_attention_backward", [&] {
    FA_LAUNCH(dim3(row_blocks), dim3(kThreads), 0, stream, grad_v_kernel<scalar_t>)
    (static_cast<const scalar_t*>(a.grad_out), a.index, a.grad_v, a.L, a.S, rows, a.M);
    FA_CHECK_LAUNCH("hard_retrieval_attention_backward (dV)");
  });
}

}  // namespace fastattn::cuda
