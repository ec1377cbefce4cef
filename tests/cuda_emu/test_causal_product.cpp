// The CUDA causal linear product kernels (src/kernels/causal_product/
// causal_product_cuda.cu) run by the emulator, against the plain reference
// (causal_product_reference.h) in float64 on the same rounded inputs: forward and all three
// gradients, every dtype, chunks 16/32/64, lengths that are not multiples of the chunk, head dims
// from 1 to 150 (column blocks 16 to 80 wide, more than one), M = 0. Tolerances in emu_test_util.h.
#include <gtest/gtest.h>

#include <random>

#include "emu_test_util.h"
#include "kernels/causal_product/causal_product_reference.h"
#include "kernels/causal_product/causal_product_cuda.h"

namespace {

using namespace fastattn::cuda;
using namespace fastattn::emu_test;

template <typename T>
void check_case(int64_t N, int64_t H, int64_t L, int64_t F, int64_t M, int64_t chunk,
                uint32_t seed) {
  SCOPED_TRACE(testing::Message() << dtype_name<T>() << " N=" << N << " H=" << H << " L=" << L
                                  << " F=" << F << " M=" << M << " chunk=" << chunk);
  std::mt19937 gen(seed);
  const int64_t NH = N * H;
  auto q = random_buffer<T>(NH * L * F, gen), k = random_buffer<T>(NH * L * F, gen);
  auto v = random_buffer<T>(NH * L * M, gen), go = random_buffer<T>(NH * L * M, gen);
  const DType dt = std::is_same<T, float>::value    ? DType::kFloat32
                   : std::is_same<T, __half>::value ? DType::kFloat16
                                                    : DType::kBFloat16;
  std::vector<float> ws(causal_product_cuda_workspace_floats(N, H, L, F, M, chunk), NAN);

  // Forward.
  std::vector<T> out = filled<T>(NH * L * M, NAN);
  CausalProductForwardCudaArgs fa;
  fa.q = q.dev.data();
  fa.k = k.dev.data();
  fa.v = v.dev.data();
  fa.out = out.data();
  fa.workspace = ws.data();
  fa.dtype = dt;
  fa.N = N, fa.H = H, fa.L = L, fa.F = F, fa.M = M, fa.chunk = chunk;
  causal_product_forward_cuda(fa, nullptr);
  std::vector<double> ref_out(NH * L * M);
  fastattn::kernels::CausalProductForwardArgs<double> ra;
  ra.q = q.ref.data();
  ra.k = k.ref.data();
  ra.v = v.ref.data();
  ra.N = N, ra.H = H, ra.L = L, ra.F = F, ra.M = M, ra.chunk = 7;
  ra.out = ref_out.data();
  fastattn::kernels::causal_product_forward_reference(ra);
  expect_close_scaled(out, ref_out, rel_tol<T>(), "out");

  // Backward.
  std::vector<T> gq = filled<T>(NH * L * F, NAN), gk = filled<T>(NH * L * F, NAN),
                 gv = filled<T>(NH * L * M, NAN);
  CausalProductBackwardCudaArgs ba;
  ba.q = q.dev.data();
  ba.k = k.dev.data();
  ba.v = v.dev.data();
  ba.grad_out = go.dev.data();
  ba.grad_q = gq.data();
  ba.grad_k = gk.data();
  ba.grad_v = gv.data();
  ba.workspace = ws.data();
  ba.dtype = dt;
  ba.N = N, ba.H = H, ba.L = L, ba.F = F, ba.M = M, ba.chunk = chunk;
  causal_product_backward_cuda(ba, nullptr);
  std::vector<double> rq(NH * L * F), rk(NH * L * F), rv(NH * L * M);
  fastattn::kernels::CausalProductBackwardArgs<double> rb;
  rb.q = q.ref.data();
  rb.k = k.ref.data();
  rb.v = v.ref.data();
  rb.grad_out = go.ref.data();
  rb.grad_q = rq.data();
  rb.grad_k = rk.data();
  rb.grad_v = rv.data();
  rb.N = N, rb.H = H, rb.L = L, rb.F = F, rb.M = M, rb.chunk = 5;
  fastattn::kernels::causal_product_backward_reference(rb);
  expect_close_scaled(gq, rq, rel_tol<T>(), "grad_q");
  expect_close_scaled(gk, rk, rel_tol<T>(), "grad_k");
  expect_close_scaled(gv, rv, rel_tol<T>(), "grad_v");
}

template <typename T>
void check_all_shapes() {
  check_case<T>(1, 2, 37, 16, 24, 16, 1);  // 3 chunks, the last partial
  check_case<T>(2, 1, 33, 24, 16, 32, 2);
  check_case<T>(1, 1, 70, 64, 64, 64, 3);  // 2 chunks of 64
  check_case<T>(1, 1, 17, 80, 72, 16, 4);  // two 64-column blocks, slices beyond 64
  check_case<T>(1, 1, 1, 1, 1, 16, 5);
  check_case<T>(1, 1, 45, 40, 150, 32, 6);  // column blocks of 48 (F) and 80 (M)
  check_case<T>(1, 1, 150, 8, 16, 16, 7);   // 10 chunks: the scan's groups of 8
  // Chunks of 64 (the ops').
  check_case<T>(1, 1, 130, 80, 150, 64, 8);  // state rows in two slices, two column blocks
  check_case<T>(2, 1, 65, 1, 3, 64, 9);      // one-column slices and blocks
}

TEST(CudaEmuCausalProduct, Float32) { check_all_shapes<float>(); }
TEST(CudaEmuCausalProduct, Float16) { check_all_shapes<__half>(); }
TEST(CudaEmuCausalProduct, BFloat16) { check_all_shapes<__nv_bfloat16>(); }

TEST(CudaEmuCausalProduct, EmptyValues) {
  // M = 0: out empty, grad_q and grad_k zero.
  check_case<float>(1, 2, 20, 8, 0, 16, 6);
}

}  // namespace
