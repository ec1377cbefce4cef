// The chunked (causal) linear product shared by the CUDA kernels of
// causal_linear_product and elu_linear_attention (included by their .cu files
// after cuda_compat.cuh; internal linkage, one copy per kernel source).
//
// One primitive: per head nh, for rows a_i of A (La × Wf), b_j of B and c_j of
// Cv (Lb × Wf and Lb × Wc),
//   kCausal:     o_i = sum_{j <= i} (a_i·b_j) c_j        (La == Lb)
//   kAntiCausal: o_i = sum_{j >= i} (a_i·b_j) c_j        (La == Lb)
//   kFull:       o_i = sum_j        (a_i·b_j) c_j
// Every forward and backward product of both ops is one of these: the causal
// product is P(Q, K, V) and its gradients dQ = P(dO, V, K), dV = P'(K, Q, dO),
// dK = P'(V, dO, Q) (P' anti-causal); the elu attention is the same on
// phi(Q), phi(K) and [V, 1] (a virtual ones column: the normaliser).
//
// Operands are read through a descriptor (storage dtype or float32
// workspace, width and row stride, an optional virtual ones column, elu+1
// applied on load, rows at or beyond the key length of the batch entry read as
// zero), so phi(Q), [V, 1] and masked keys are never materialised.
//
// Three passes over chunks of C rows (C = 16, 32 or 64; 64 in the ops), so the
// sequence is parallel too (N·H = 8 still gives thousands of blocks at long L):
//   1. chunk sums    P_c = B_c^T Cv_c (Wf × Wc, float32) into the workspace,
//                    one block per (chunk, column block of Cv, head);
//   2. scan          over the chunks of each head, one thread per state
//                    element: exclusive prefix (causal), exclusive suffix
//                    (anti-causal) or the total in slot 0 (full);
//   3. chunk output  O_c = A_c S_c + mask(A_c B_c^T) Cv_c, one block per
//                    (chunk, column block, head): the C × C scores and the
//                    C × BW output in registers (at most 4×4 and 4×5 per
//                    thread of a 16×16 block), A, B, S in 32-wide slices of
//                    shared memory.
// Column blocks are BW = 16·JC wide (JC = 1..5), as few and as narrow as
// cover Wc: 64 -> one of 64, 65 (the [V, 1] of the elu attention) -> one of
// 80, 129 -> two of 80. Shared memory below 48 KiB (static) for every C, JC.
// SIMT float32 arithmetic for every dtype (operands converted on load; the
// state always float32): the ops' products are 64-deep, where the tensor-core
// version (fa_wmma) is the next step for float16/bfloat16 speed.
//
// Cost per head: passes 1 and 3 do 2·L·Wf·Wc + 2·L·C·(Wf + Wc) flops (the
// C × C products whole, then masked; recomputed per column block of Cv);
// workspace ceil(Lb/C)·Wf·Wc floats per head (about L·Wf·Wc/64).
// Tested through the ops' emulation tests (tests/cuda_emu/test_causal_product.cpp,
// tests/cuda_emu/test_linear_attention.cpp).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/common/cuda_compat.cuh"

namespace fastattn::cuda {
namespace {

enum class ChunkMode { kCausal, kAntiCausal, kFull };

// One operand of the product: (NH, rows, ld) storage, `width` columns used.
struct ChunkOperand {
  const void* ptr = nullptr;  // (NH, rows, ld): scalar_t, or float when is_float
  bool is_float = false;      // float32 storage (a workspace)
  int64_t width = 0;          // stored columns used (<= ld)
  int64_t ld = 0;             // row stride in elements
  bool ones = false;          // a virtual column `width` of ones (zero on masked rows)
  bool phi = false;           // elu(x) + 1 applied to the stored values
  bool masked = false;        // rows >= key_lengths[n] read as zero
  __host__ __device__ int64_t cols() const { return width + (ones ? 1 : 0); }
};

struct ChunkProblem {
  ChunkOperand a;         // (NH, La, Wf)
  ChunkOperand b;         // (NH, Lb, Wf)
  ChunkOperand c;         // (NH, Lb, Wc)
  int64_t NH = 0, H = 1;  // heads (N·H) and H, for key_lengths[nh / H]
  int64_t La = 0, Lb = 0;
  const int64_t* key_lengths = nullptr;  // (N,) or null: every row valid
  ChunkMode mode = ChunkMode::kCausal;
  void* out = nullptr;  // (NH, La, out_ld): scalar_t, or float when out_is_float
  bool out_is_float = false;
  int64_t out_ld = 0;          // row stride of out
  int64_t out_cols = 0;        // columns written (<= Wc)
  const void* dphi = nullptr;  // (NH, La, dphi_ld) scalar_t or null: out *= phi'(dphi)
  int64_t dphi_ld = 0;
  float* state = nullptr;  // (NH, max(1, ceil(Lb / C)), Wf, Wc) float32 workspace
  int chunk = 64;          // C: 16, 32 or 64
};

constexpr int kChunkThreads = 256;  // a 16 × 16 block
constexpr int kMaxJC = 5;           // column block widths 16·JC, JC = 1..5 (16..80 columns)
constexpr int kFBlock = 64;         // state rows per step of pass 1
constexpr int kSlice = 32;          // columns of A and B per shared-memory slice of pass 3

__device__ __forceinline__ float elu_plus_one_f(float x) { return x > 0.f ? x + 1.f : expf(x); }
// phi'(x) = 1 for x > 0, exp(x) otherwise (NaN stays NaN).
__device__ __forceinline__ float elu_plus_one_grad_f(float x) { return x > 0.f ? 1.f : expf(x); }

__device__ __forceinline__ int64_t valid_rows(const ChunkProblem& p, const ChunkOperand& o,
                                              int64_t nh, int64_t rows) {
  if (!o.masked || !p.key_lengths) return rows;
  const int64_t len = p.key_lengths[nh / p.H];
  return len < 0 ? 0 : (len < rows ? len : rows);
}

// Element (row, col) of operand o of head nh, as float (0 outside).
template <typename T>
__device__ __forceinline__ float load_operand(const ChunkOperand& o, int64_t nh, int64_t rows,
                                              int64_t valid, int64_t row, int64_t col) {
  if (row >= valid || col >= o.cols()) return 0.f;
  if (col == o.width) return 1.f;  // the ones column
  const int64_t at = (nh * rows + row) * o.ld + col;
  float x = o.is_float ? static_cast<const float*>(o.ptr)[at]
                       : to_float(static_cast<const T*>(o.ptr)[at]);
  return o.phi ? elu_plus_one_f(x) : x;
}

// Pass 1: P_c = B_c^T Cv_c for chunk blockIdx.x, Cv columns BW·blockIdx.y..
// (BW = 16·JC), head blockIdx.z. Thread (ty, tx) owns state rows f0 + ty + 16i
// (i < 4) and columns tx + 16j (j < JC).
template <typename T, int C, int JC>
__global__ void __launch_bounds__(kChunkThreads) chunk_sums_kernel(ChunkProblem p) {
  constexpr int BW = 16 * JC, LDB = kFBlock + 1, LD = BW + 1;
  __shared__ float bs[C * LDB];  // B_c, 64 columns of a slice
  __shared__ float cs[C * LD];   // Cv_c, the block's BW columns
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const int64_t nh = blockIdx.z, r0 = static_cast<int64_t>(blockIdx.x) * C;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * BW;
  const int64_t Wf = p.b.cols(), Wc = p.c.cols();
  const int64_t nc = ceil_div(p.Lb, C) > 0 ? ceil_div(p.Lb, C) : 1;
  const int64_t vb = valid_rows(p, p.b, nh, p.Lb), vc = valid_rows(p, p.c, nh, p.Lb);
  for (int idx = tid; idx < C * BW; idx += kChunkThreads) {
    const int r = idx / BW, m = idx % BW;
    cs[r * LD + m] = load_operand<T>(p.c, nh, p.Lb, vc, r0 + r, m0 + m);
  }
  float* state = p.state + (nh * nc + blockIdx.x) * Wf * Wc;
  for (int64_t f0 = 0; f0 < Wf; f0 += kFBlock) {
    for (int idx = tid; idx < C * kFBlock; idx += kChunkThreads) {
      const int r = idx / kFBlock, f = idx % kFBlock;
      bs[r * LDB + f] = load_operand<T>(p.b, nh, p.Lb, vb, r0 + r, f0 + f);
    }
    __syncthreads();
    float acc[4][JC] = {};
    for (int r = 0; r < C; ++r) {
      float bv[4], cv[JC];
      for (int i = 0; i < 4; ++i) bv[i] = bs[r * LDB + ty + 16 * i];
      for (int j = 0; j < JC; ++j) cv[j] = cs[r * LD + tx + 16 * j];
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < JC; ++j) acc[i][j] += bv[i] * cv[j];
    }
    for (int i = 0; i < 4; ++i) {
      const int64_t f = f0 + ty + 16 * i;
      if (f >= Wf) continue;
      for (int j = 0; j < JC; ++j) {
        const int64_t m = m0 + tx + 16 * j;
        if (m < Wc) state[f * Wc + m] = acc[i][j];
      }
    }
    __syncthreads();
  }
}

// Pass 2: per head and state element, the chunk sums turned into the state
// each chunk's output needs (one thread per element; nc_real chunks summed,
// the workspace has max(1, nc_real) slots).
__global__ void __launch_bounds__(kChunkThreads)
    chunk_scan_kernel(float* state, int64_t NH, int64_t elems, int64_t nc_real, ChunkMode mode) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * kChunkThreads + threadIdx.x;
  if (idx >= NH * elems) return;
  const int64_t nh = idx / elems, e = idx % elems;
  const int64_t slots = nc_real > 0 ? nc_real : 1;
  float* s = state + nh * slots * elems + e;
  // Groups of kGroup chunks: their loads are issued together (the chain of
  // dependent loads would otherwise be nc_real long).
  constexpr int kGroup = 8;
  const bool reverse = mode == ChunkMode::kAntiCausal;
  float run = 0.f;
  for (int64_t g0 = 0; g0 < nc_real; g0 += kGroup) {
    float t[kGroup];
    for (int u = 0; u < kGroup; ++u) {
      const int64_t c = reverse ? nc_real - 1 - (g0 + u) : g0 + u;
      t[u] = g0 + u < nc_real ? s[c * elems] : 0.f;
    }
    for (int u = 0; u < kGroup; ++u) {
      const int64_t c = reverse ? nc_real - 1 - (g0 + u) : g0 + u;
      if (mode != ChunkMode::kFull && g0 + u < nc_real) s[c * elems] = run;
      run += t[u];
    }
  }
  if (mode == ChunkMode::kFull) s[0] = run;
}

// Pass 3: O_c = A_c S_c + mask(A_c B_c^T) Cv_c for chunk blockIdx.x of A,
// columns BW·blockIdx.y.. (BW = 16·JC), head blockIdx.z. Thread (ty, tx) owns
// output rows ty + 16r (r < C/16), columns tx + 16j (j < JC), and score
// columns tx + 16s.
template <typename T, int C, int JC>
__global__ void __launch_bounds__(kChunkThreads) chunk_output_kernel(ChunkProblem p) {
  constexpr int RC = C / 16, BW = 16 * JC;
  constexpr int LDS = kSlice + 1, LDC = BW + 1, LDP = C + 1;
  // Phase 1: as, bs (C × 32 slices), ss (32 × BW); phase 2: sc (C × C), cs (C × BW).
  constexpr int kPhase1 = 2 * C * LDS + kSlice * LDC, kPhase2 = C * LDP + C * LDC;
  __shared__ float smem[kPhase1 > kPhase2 ? kPhase1 : kPhase2];
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const int64_t nh = blockIdx.z, i0 = static_cast<int64_t>(blockIdx.x) * C;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * BW;
  const int64_t Wf = p.a.cols(), Wc = p.c.cols();
  const int64_t nc = ceil_div(p.Lb, C) > 0 ? ceil_div(p.Lb, C) : 1;
  const bool full = p.mode == ChunkMode::kFull;
  const int64_t va = valid_rows(p, p.a, nh, p.La), vb = valid_rows(p, p.b, nh, p.Lb);
  const int64_t vc = valid_rows(p, p.c, nh, p.Lb);
  const float* state = p.state + (nh * nc + (full ? 0 : blockIdx.x)) * Wf * Wc;

  float acc[RC][JC] = {};
  float sc[RC][RC] = {};
  float* as = smem;
  float* bs = smem + C * LDS;
  float* ss = smem + 2 * C * LDS;
  for (int64_t f0 = 0; f0 < Wf; f0 += kSlice) {
    for (int idx = tid; idx < C * kSlice; idx += kChunkThreads) {
      const int r = idx / kSlice, f = idx % kSlice;
      as[r * LDS + f] = load_operand<T>(p.a, nh, p.La, va, i0 + r, f0 + f);
      if (!full) bs[r * LDS + f] = load_operand<T>(p.b, nh, p.Lb, vb, i0 + r, f0 + f);
    }
    for (int idx = tid; idx < kSlice * BW; idx += kChunkThreads) {
      const int f = idx / BW, m = idx % BW;
      const int64_t gf = f0 + f, gm = m0 + m;
      ss[f * LDC + m] = gf < Wf && gm < Wc ? state[gf * Wc + gm] : 0.f;
    }
    __syncthreads();
    for (int f = 0; f < kSlice; ++f) {
      float av[RC], sv[JC];
      for (int r = 0; r < RC; ++r) av[r] = as[(ty + 16 * r) * LDS + f];
      for (int j = 0; j < JC; ++j) sv[j] = ss[f * LDC + tx + 16 * j];
      for (int r = 0; r < RC; ++r)
        for (int j = 0; j < JC; ++j) acc[r][j] += av[r] * sv[j];
      if (!full) {
        float bv[RC];
        for (int s = 0; s < RC; ++s) bv[s] = bs[(tx + 16 * s) * LDS + f];
        for (int r = 0; r < RC; ++r)
          for (int s = 0; s < RC; ++s) sc[r][s] += av[r] * bv[s];
      }
    }
    __syncthreads();
  }

  if (!full) {
    float* ps = smem;            // masked scores (C × C)
    float* cs = smem + C * LDP;  // Cv_c, the block's columns (C × BW)
    const bool causal = p.mode == ChunkMode::kCausal;
    for (int r = 0; r < RC; ++r)
      for (int s = 0; s < RC; ++s) {
        const int i = ty + 16 * r, j = tx + 16 * s;
        ps[i * LDP + j] = (causal ? j <= i : j >= i) ? sc[r][s] : 0.f;
      }
    for (int idx = tid; idx < C * BW; idx += kChunkThreads) {
      const int r = idx / BW, m = idx % BW;
      cs[r * LDC + m] = load_operand<T>(p.c, nh, p.Lb, vc, i0 + r, m0 + m);
    }
    __syncthreads();
    for (int j = 0; j < C; ++j) {
      float pv[RC], cv[JC];
      for (int r = 0; r < RC; ++r) pv[r] = ps[(ty + 16 * r) * LDP + j];
      for (int jc = 0; jc < JC; ++jc) cv[jc] = cs[j * LDC + tx + 16 * jc];
      for (int r = 0; r < RC; ++r)
        for (int jc = 0; jc < JC; ++jc) acc[r][jc] += pv[r] * cv[jc];
    }
  }

  for (int r = 0; r < RC; ++r) {
    const int64_t i = i0 + ty + 16 * r;
    if (i >= p.La) continue;
    for (int jc = 0; jc < JC; ++jc) {
      const int64_t m = m0 + tx + 16 * jc;
      if (m >= p.out_cols) continue;
      float o = acc[r][jc];
      if (p.dphi)
        o *= elu_plus_one_grad_f(
            to_float(static_cast<const T*>(p.dphi)[(nh * p.La + i) * p.dphi_ld + m]));
      const int64_t at = (nh * p.La + i) * p.out_ld + m;
      if (p.out_is_float) {
        static_cast<float*>(p.out)[at] = o;
      } else {
        static_cast<T*>(p.out)[at] = from_float<T>(o);
      }
    }
  }
}

// Workspace floats of a product with Lb rows of B, Wf × Wc states.
inline int64_t chunk_state_floats(int64_t NH, int64_t Lb, int64_t Wf, int64_t Wc, int chunk) {
  const int64_t nc = ceil_div(Lb, chunk);
  return NH * (nc > 0 ? nc : 1) * Wf * Wc;
}

template <typename T, int C, int JC>
void run_chunked_product_cj(const ChunkProblem& p, cudaStream_t stream) {
  const int64_t Wf = p.a.cols(), Wc = p.c.cols();
  const int64_t nc_real = ceil_div(p.Lb, C);
  const int64_t col_blocks = ceil_div(Wc, 16 * JC);
  if (nc_real > 0 && Wf > 0) {
    FA_LAUNCH(dim3(static_cast<unsigned>(nc_real), static_cast<unsigned>(col_blocks),
                   static_cast<unsigned>(p.NH)),
              dim3(kChunkThreads), 0, stream, chunk_sums_kernel<T, C, JC>)
    (p);
    FA_CHECK_LAUNCH("chunk_sums_kernel");
  }
  if (Wf > 0) {
    const int64_t elems = Wf * Wc;
    FA_LAUNCH(dim3(static_cast<unsigned>(ceil_div(p.NH * elems, kChunkThreads))),
              dim3(kChunkThreads), 0, stream, chunk_scan_kernel)
    (p.state, p.NH, elems, nc_real, p.mode);
    FA_CHECK_LAUNCH("chunk_scan_kernel");
  }
  FA_LAUNCH(dim3(static_cast<unsigned>(ceil_div(p.La, C)), static_cast<unsigned>(col_blocks),
                 static_cast<unsigned>(p.NH)),
            dim3(kChunkThreads), 0, stream, chunk_output_kernel<T, C, JC>)
  (p);
  FA_CHECK_LAUNCH("chunk_output_kernel");
}

// Column blocks of 16·JC columns: as few blocks of at most 80 columns as
// cover Wc, as narrow as they can be (Wc = 65: one block of 80; 129: two of 80).
template <typename T, int C>
void run_chunked_product_c(const ChunkProblem& p, cudaStream_t stream) {
  const int64_t Wc = p.c.cols();
  if (p.NH == 0 || p.La == 0 || Wc == 0 || p.out_cols == 0) return;
  const int64_t blocks = ceil_div(Wc, 16 * kMaxJC);
  switch (ceil_div(ceil_div(Wc, blocks), 16)) {
    case 1:
      return run_chunked_product_cj<T, C, 1>(p, stream);
    case 2:
      return run_chunked_product_cj<T, C, 2>(p, stream);
    case 3:
      return run_chunked_product_cj<T, C, 3>(p, stream);
    case 4:
      return run_chunked_product_cj<T, C, 4>(p, stream);
    default:
      return run_chunked_product_cj<T, C, 5>(p, stream);
  }
}

// Runs the product (out fully written: rows < La, columns < out_cols).
template <typename T>
void run_chunked_product(const ChunkProblem& p, cudaStream_t stream) {
  if (p.NH > 65535)  // heads are the grid's z dimension
    throw std::runtime_error("fastattn CUDA chunked product: at most 65535 (batch × heads), got " +
                             std::to_string(p.NH));
  switch (p.chunk) {
    case 16:
      return run_chunked_product_c<T, 16>(p, stream);
    case 32:
      return run_chunked_product_c<T, 32>(p, stream);
    case 64:
      return run_chunked_product_c<T, 64>(p, stream);
  }
  throw std::runtime_error("fastattn CUDA chunked product: chunk must be 16, 32 or 64, got " +
                           std::to_string(p.chunk));
}

}  // namespace
}  // namespace fastattn::cuda
