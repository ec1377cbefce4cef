// CUDA kernels of the fused elu linear attention (Katharopoulos et al. 2020,
// eq. 4-6 and 9): phi(x) = elu(x) + 1,
//   out_i = phi(q_i)^T sum_j phi(k_j) v_j^T / den_i,
//   den_i = phi(q_i)^T sum_j phi(k_j) + eps,
// over the keys j < key_lengths[n] (and j <= i when causal); den is saved in
// float32 for the backward.
//
// Every product is the chunked product of
// src/kernels/causal_product/chunked_product_cuda.cuh (chunk sums, a scan
// over chunks, chunk outputs: parallel over heads, chunks and 64-column
// blocks), which applies phi to q and k as it loads them, appends the ones
// column of [V, 1] virtually and zeroes keys beyond key_lengths, so neither
// phi(q), phi(k) nor [V, 1] is ever written:
//   forward:  num = P(phi(Q), phi(K), [V, 1])  (causal P, or the full sum);
//             den = num[:, M] + eps, out = num[:, :M] / den (a row pass);
//   backward: G = [g / den, -(g·out) / den]    (a row pass, float32);
//             dQ = P(G, [V, 1], phi(K)) ∘ phi'(Q),
//             dV = P'(phi(K), phi(Q), G[:, :M]),
//             dK = P'([V, 1], G, phi(Q)) ∘ phi'(K)
//   (P' anti-causal, or the full sum), the algebra of
//   elu_linear_attention_cpu.cpp with the normaliser as an extra value column.
// If a batch entry has no valid key, its output is zero whatever q, k, v, so
// its G is set to zero (den = eps would make g / den overflow nothing useful).
// SIMT float32 arithmetic for every dtype.
//
// Cost: forward 2·N·H·(L + S)·E·(M + 1) + C-wide intra-chunk terms when
// causal, backward about three times that; workspace N·H·L·(M + 1) +
// N·H·ceil(max(L, S)/C)·E·(M + 1) floats. Tested by
// tests/cuda_emu/test_linear_attention.cpp (emulator, against the CPU kernels
// in float64) and tests/cuda/test_cuda_linear_attention.cpp (GPU).
#include "kernels/common/cuda_compat.cuh"
#include "kernels/causal_product/chunked_product_cuda.cuh"
#include "kernels/linear_attention/elu_linear_attention_cuda.h"

namespace fastattn::cuda {
namespace {

constexpr int kRowThreads = 256;

ChunkOperand operand(const void* ptr, int64_t width, bool phi, bool ones, bool masked) {
  ChunkOperand o;
  o.ptr = ptr;
  o.width = width;
  o.ld = width;
  o.phi = phi;
  o.ones = ones;
  o.masked = masked;
  return o;
}

ChunkOperand float_operand(const float* ptr, int64_t width, int64_t ld) {
  ChunkOperand o;
  o.ptr = ptr;
  o.is_float = true;
  o.width = width;
  o.ld = ld;
  return o;
}

template <typename Args>
ChunkProblem base_problem(const Args& a) {
  ChunkProblem p;
  p.NH = a.N * a.H;
  p.H = a.H > 0 ? a.H : 1;
  p.key_lengths = a.key_lengths;
  p.chunk = static_cast<int>(a.chunk);
  p.state = a.workspace + a.N * a.H * a.L * (a.M + 1);
  return p;
}

// num (NH·L, M + 1) -> den = num[:, M] + eps, out = num[:, :M] / den.
template <typename T>
__global__ void __launch_bounds__(kRowThreads)
    finalize_forward_kernel(const float* num, T* out, float* den, int64_t rows, int64_t M,
                            float eps) {
  const int64_t W = M + 1, total = rows * W;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * kRowThreads + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * kRowThreads) {
    const int64_t r = idx / W, m = idx % W;
    const float d = num[r * W + M] + eps;
    if (m == M) {
      den[r] = d;
    } else {
      out[r * M + m] = from_float<T>(num[idx] / d);
    }
  }
}

// G (NH·L, M + 1) = [g / den, -(g·out) / den], zero for batch entries
// without keys. One warp per row.
template <typename T>
__global__ void __launch_bounds__(kRowThreads)
    scaled_grad_kernel(const T* g, const T* out, const float* den, const int64_t* key_lengths,
                       float* G, int64_t rows, int64_t L, int64_t H, int64_t S, int64_t M) {
  const int lane = threadIdx.x % 32;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * (kRowThreads / 32) + threadIdx.x / 32;
  if (r >= rows) return;  // whole warps
  const int64_t n = r / L / H;
  const int64_t len = key_lengths ? key_lengths[n] : S;
  float* gr = G + r * (M + 1);
  if (len <= 0) {
    for (int64_t m = lane; m <= M; m += 32) gr[m] = 0.f;
    return;
  }
  const float inv = 1.f / den[r];
  float dot = 0.f;
  for (int64_t m = lane; m < M; m += 32) {
    const float gm = to_float(g[r * M + m]);
    dot += gm * to_float(out[r * M + m]);
    gr[m] = gm * inv;
  }
  dot = warp_sum(dot);
  if (lane == 0) gr[M] = -dot * inv;
}

unsigned row_grid(int64_t total, int64_t per_block) {
  const int64_t b = ceil_div(total, per_block);
  return static_cast<unsigned>(b < (1 << 30) ? b : (1 << 30));
}

}  // namespace

void elu_linear_attention_forward_cuda(const EluLinearForwardCudaArgs& a, cudaStream_t stream) {
  const int64_t NH = a.N * a.H;
  if (NH == 0 || a.L == 0) return;
  FA_DISPATCH_FLOAT_TYPES(a.dtype, "elu_linear_attention_forward_cuda", [&] {
    float* num = a.workspace;  // (NH, L, M + 1)
    ChunkProblem p = base_problem(a);
    p.mode = a.causal ? ChunkMode::kCausal : ChunkMode::kFull;
    p.La = a.L;
    p.Lb = a.S;
    p.a = operand(a.q, a.E, true, false, false);
    p.b = operand(a.k, a.E, true, false, true);
    p.c = operand(a.v, a.M, false, true, true);
    p.out = num;
    p.out_is_float = true;
    p.out_ld = p.out_cols = a.M + 1;
    run_chunked_product<scalar_t>(p, stream);
    const int64_t total = NH * a.L * (a.M + 1);
    FA_LAUNCH(dim3(row_grid(total, kRowThreads)), dim3(kRowThreads), 0, stream,
              finalize_forward_kernel<scalar_t>)
    (num, static_cast<scalar_t*>(a.out), a.den, NH * a.L, a.M, a.eps);
    FA_CHECK_LAUNCH("finalize_forward_kernel");
  });
}

void elu_linear_attention_backward_cuda(const EluLinearBackwardCudaArgs& a, cudaStream_t stream) {
  const int64_t NH = a.N * a.H, M = a.M, E = a.E;
  if (NH == 0) return;
  FA_DISPATCH_FLOAT_TYPES(a.dtype, "elu_linear_attention_backward_cuda", [&] {
    float* G = a.workspace;  // (NH, L, M + 1)
    if (a.L > 0) {
      FA_LAUNCH(dim3(row_grid(NH * a.L, kRowThreads / 32)), dim3(kRowThreads), 0, stream,
                scaled_grad_kernel<scalar_t>)
      (static_cast<const scalar_t*>(a.grad_out), static_cast<const scalar_t*>(a.out), a.den,
       a.key_lengths, G, NH * a.L, a.L, a.H, a.S, M);
      FA_CHECK_LAUNCH("scaled_grad_kernel");
    }
    const ChunkMode fwd = a.causal ? ChunkMode::kCausal : ChunkMode::kFull;
    const ChunkMode rev = a.causal ? ChunkMode::kAntiCausal : ChunkMode::kFull;
    // dQ = P(G, [V, 1], phi(K)) ∘ phi'(Q)
    ChunkProblem p = base_problem(a);
    p.mode = fwd;
    p.La = a.L;
    p.Lb = a.S;
    p.a = float_operand(G, M + 1, M + 1);
    p.b = operand(a.v, M, false, true, true);
    p.c = operand(a.k, E, true, false, true);
    p.out = a.grad_q;
    p.out_ld = p.out_cols = E;
    p.dphi = a.q;
    p.dphi_ld = E;
    run_chunked_product<scalar_t>(p, stream);
    // dV = P'(phi(K), phi(Q), G[:, :M])
    p = base_problem(a);
    p.mode = rev;
    p.La = a.S;
    p.Lb = a.L;
    p.a = operand(a.k, E, true, false, true);
    p.b = operand(a.q, E, true, false, false);
    p.c = float_operand(G, M, M + 1);
    p.out = a.grad_v;
    p.out_ld = p.out_cols = M;
    run_chunked_product<scalar_t>(p, stream);
    // dK = P'([V, 1], G, phi(Q)) ∘ phi'(K)
    p = base_problem(a);
    p.mode = rev;
    p.La = a.S;
    p.Lb = a.L;
    p.a = operand(a.v, M, false, true, true);
    p.b = float_operand(G, M + 1, M + 1);
    p.c = operand(a.q, E, true, false, false);
    p.out = a.grad_k;
    p.out_ld = p.out_cols = E;
    p.dphi = a.k;
    p.dphi_ld = E;
    run_chunked_product<scalar_t>(p, stream);
  });
}

}  // namespace fastattn::cuda
