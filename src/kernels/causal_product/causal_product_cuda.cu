// CUDA kernels of the causal linear product (Katharopoulos et al. 2020, eq. 9
// without the normaliser): out_i = sum_{j<=i} (q_i·k_j) v_j, q, k (N,H,L,F),
// v (N,H,L,M), and its gradients
//   dQ = P(dO, V, K),  dV = P'(K, Q, dO),  dK = P'(V, dO, Q)
// with P the causal product and P' the anti-causal one (sum over j >= i).
// Each is the three-pass chunked product of chunked_product_cuda.cuh: chunk
// sums k^T v in parallel over chunks, a scan of the F×M states over chunks,
// then every chunk's output (masked C×C product plus the carried state) in
// parallel: parallel over heads, chunks and 64-column blocks, so N·H = 8
// already fills an H100 at L >= 2k. SIMT float32 arithmetic and float32
// states for all dtypes (the tensor-core version is future work).
//
// Cost: forward 2·N·H·L·(F·M + C·(F+M)) flops (passes 1 and 3), backward
// three times that; float32 workspace N·H·ceil(L/C)·F·M (the chunk states).
// Tested by tests/cuda_emu/test_causal_product.cpp (emulator, against the
// CPU kernels in float64) and tests/cuda/test_cuda_linear_attention.cpp (GPU).
#include "kernels/common/cuda_compat.cuh"
#include "kernels/causal_product/causal_product_cuda.h"
#include "kernels/causal_product/chunked_product_cuda.cuh"

namespace fastattn::cuda {
namespace {

ChunkOperand plain(const void* ptr, int64_t width) {
  ChunkOperand o;
  o.ptr = ptr;
  o.width = width;
  o.ld = width;
  return o;
}

template <typename Args>
ChunkProblem base_problem(const Args& a) {
  ChunkProblem p;
  p.NH = a.N * a.H;
  p.H = a.H > 0 ? a.H : 1;
  p.La = p.Lb = a.L;
  p.state = a.workspace;
  p.chunk = static_cast<int>(a.chunk);
  return p;
}

// One product o = P(x, y, z) (mode) into out (L × width of z).
template <typename T, typename Args>
void product(const Args& a, ChunkMode mode, const void* x, const void* y, int64_t wxy,
             const void* z, int64_t wz, void* out, cudaStream_t stream) {
  ChunkProblem p = base_problem(a);
  p.mode = mode;
  p.a = plain(x, wxy);
  p.b = plain(y, wxy);
  p.c = plain(z, wz);
  p.out = out;
  p.out_ld = wz;
  p.out_cols = wz;
  run_chunked_product<T>(p, stream);
}

}  // namespace

void causal_product_forward_cuda(const CausalProductForwardCudaArgs& a, cudaStream_t stream) {
  FA_DISPATCH_FLOAT_TYPES(a.dtype, "causal_product_forward_cuda", [&] {
    product<scalar_t>(a, ChunkMode::kCausal, a.q, a.k, a.F, a.v, a.M, a.out, stream);
  });
}

void causal_product_backward_cuda(const CausalProductBackwardCudaArgs& a, cudaStream_t stream) {
  FA_DISPATCH_FLOAT_TYPES(a.dtype, "causal_product_backward_cuda", [&] {
    // With M = 0 the products over M are empty sums: zeros (the state stays unread).
    product<scalar_t>(a, ChunkMode::kCausal, a.grad_out, a.v, a.M, a.k, a.F, a.grad_q, stream);
    product<scalar_t>(a, ChunkMode::kAntiCausal, a.k, a.q, a.F, a.grad_out, a.M, a.grad_v, stream);
    product<scalar_t>(a, ChunkMode::kAntiCausal, a.v, a.grad_out, a.M, a.q, a.F, a.grad_k, stream);
  });
}

}  // namespace fastattn::cuda
