// The CUDA elu linear attention kernels (src/kernels/linear_attention/
// elu_linear_attention_cuda.cu) run by the emulator, against the plain
// reference (elu_linear_attention_reference.h) in float64 on the same rounded
// inputs: out, den and the three gradients,
// causal and not, key_lengths (none, partial, zero, full), L != S, chunks
// 16/32/64, lengths not multiples of the chunk, M + 1 = 65 and 129 (one and
// two column blocks), L = 0 and S = 0. Both backwards get the GPU forward's out and den. Tolerances
// in emu_test_util.h.
#include <gtest/gtest.h>

#include <random>

#include "emu_test_util.h"
#include "kernels/linear_attention/elu_linear_attention_reference.h"
#include "kernels/linear_attention/elu_linear_attention_cuda.h"

namespace {

using namespace fastattn::cuda;
using namespace fastattn::emu_test;

struct Case {
  int64_t N, H, L, S, E, M;
  bool causal;
  std::vector<int64_t> lengths;  // empty: none
  int64_t chunk;
};

template <typename T>
void check_case(const Case& c, uint32_t seed) {
  SCOPED_TRACE(testing::Message() << dtype_name<T>() << " N=" << c.N << " H=" << c.H << " L=" << c.L
                                  << " S=" << c.S << " E=" << c.E << " M=" << c.M
                                  << " causal=" << c.causal << " lengths=" << c.lengths.size()
                                  << " chunk=" << c.chunk);
  std::mt19937 gen(seed);
  const int64_t NH = c.N * c.H, L = c.L, S = c.S, E = c.E, M = c.M;
  auto q = random_buffer<T>(NH * L * E, gen), k = random_buffer<T>(NH * S * E, gen);
  auto v = random_buffer<T>(NH * S * M, gen), go = random_buffer<T>(NH * L * M, gen);
  const DType dt = std::is_same<T, float>::value    ? DType::kFloat32
                   : std::is_same<T, __half>::value ? DType::kFloat16
                                                    : DType::kBFloat16;
  const int64_t* kl = c.lengths.empty() ? nullptr : c.lengths.data();
  const float eps = 1e-6f;
  std::vector<float> ws(elu_linear_attention_cuda_workspace_floats(c.N, c.H, L, S, E, M, c.chunk),
                        NAN);

  std::vector<T> out = filled<T>(NH * L * M, NAN);
  std::vector<float> den(NH * L, NAN);
  EluLinearForwardCudaArgs fa;
  fa.q = q.dev.data();
  fa.k = k.dev.data();
  fa.v = v.dev.data();
  fa.key_lengths = kl;
  fa.out = out.data();
  fa.den = den.data();
  fa.workspace = ws.data();
  fa.dtype = dt;
  fa.N = c.N, fa.H = c.H, fa.L = L, fa.S = S, fa.E = E, fa.M = M;
  fa.causal = c.causal;
  fa.eps = eps;
  fa.chunk = c.chunk;
  elu_linear_attention_forward_cuda(fa, nullptr);

  fastattn::kernels::EluLinearForwardArgs<double> ra;
  std::vector<double> rout(NH * L * M), rden(NH * L);
  ra.q = q.ref.data();
  ra.k = k.ref.data();
  ra.v = v.ref.data();
  ra.key_lengths = kl;
  ra.N = c.N, ra.H = c.H, ra.L = L, ra.S = S, ra.E = E, ra.M = M;
  ra.causal = c.causal;
  ra.eps = eps;
  ra.chunk = 7;
  ra.out = rout.data();
  ra.den = rden.data();
  fastattn::kernels::elu_linear_attention_forward_reference(ra);
  expect_close_scaled(out, rout, rel_tol<T>(), "out");
  // den is float32 whatever the dtype (its inputs were rounded the same way).
  expect_close_scaled(den, rden, 1e-5, "den");

  // Backward, both from the GPU forward's out and den.
  std::vector<double> out_d(out.size()), den_d(den.begin(), den.end());
  for (size_t i = 0; i < out.size(); ++i) out_d[i] = to_float(out[i]);
  std::vector<T> gq = filled<T>(NH * L * E, NAN), gk = filled<T>(NH * S * E, NAN),
                 gv = filled<T>(NH * S * M, NAN);
  EluLinearBackwardCudaArgs ba;
  ba.q = q.dev.data();
  ba.k = k.dev.data();
  ba.v = v.dev.data();
  ba.key_lengths = kl;
  ba.grad_out = go.dev.data();
  ba.out = out.data();
  ba.den = den.data();
  ba.grad_q = gq.data();
  ba.grad_k = gk.data();
  ba.grad_v = gv.data();
  ba.workspace = ws.data();
  ba.dtype = dt;
  ba.N = c.N, ba.H = c.H, ba.L = L, ba.S = S, ba.E = E, ba.M = M;
  ba.causal = c.causal;
  ba.eps = eps;
  ba.chunk = c.chunk;
  elu_linear_attention_backward_cuda(ba, nullptr);

  fastattn::kernels::EluLinearBackwardArgs<double> rb;
  std::vector<double> rq(NH * L * E), rk(NH * S * E), rv(NH * S * M);
  rb.q = q.ref.data();
  rb.k = k.ref.data();
  rb.v = v.ref.data();
  rb.key_lengths = kl;
  rb.N = c.N, rb.H = c.H, rb.L = L, rb.S = S, rb.E = E, rb.M = M;
  rb.causal = c.causal;
  rb.eps = eps;
  rb.chunk = 5;
  rb.grad_out = go.ref.data();
  rb.out = out_d.data();
  rb.den = den_d.data();
  rb.grad_q = rq.data();
  rb.grad_k = rk.data();
  rb.grad_v = rv.data();
  fastattn::kernels::elu_linear_attention_backward_reference(rb);
  expect_close_scaled(gq, rq, rel_tol<T>(), "grad_q");
  expect_close_scaled(gk, rk, rel_tol<T>(), "grad_k");
  expect_close_scaled(gv, rv, rel_tol<T>(), "grad_v");
}

template <typename T>
void check_all(bool causal) {
  uint32_t seed = causal ? 100 : 200;
  const int64_t S2 = causal ? 37 : 29;
  check_case<T>({1, 2, 37, 37, 16, 24, causal, {}, 16}, seed++);
  check_case<T>({2, 2, 37, S2, 24, 16, causal, {20, 0}, 16}, seed++);  // padded, and no keys
  check_case<T>({2, 1, 33, causal ? 33 : 50, 16, 64, causal, {33, 5}, 32}, seed++);  // M+1 = 65
  check_case<T>({1, 1, 70, 70, 32, 16, causal, {70}, 64}, seed++);
  check_case<T>({1, 1, 1, 1, 1, 1, causal, {}, 16}, seed++);
  check_case<T>({1, 1, 20, 20, 8, 128, causal, {}, 16}, seed++);         // M + 1 = 129: two blocks
  check_case<T>({2, 1, 150, 150, 8, 8, causal, {150, 77}, 16}, seed++);  // 10 chunks
  // Chunks of 64 (the ops').
  check_case<T>({2, 1, 150, causal ? 150 : 130, 64, 64, causal, {150, 77}, 64}, seed++);
  check_case<T>({1, 1, 40, 40, 80, 130, causal, {}, 64}, seed++);  // two slices, two blocks
}

TEST(CudaEmuEluLinearAttention, CausalFloat32) { check_all<float>(true); }
TEST(CudaEmuEluLinearAttention, CausalFloat16) { check_all<__half>(true); }
TEST(CudaEmuEluLinearAttention, CausalBFloat16) { check_all<__nv_bfloat16>(true); }
TEST(CudaEmuEluLinearAttention, FullFloat32) { check_all<float>(false); }
TEST(CudaEmuEluLinearAttention, FullFloat16) { check_all<__half>(false); }
TEST(CudaEmuEluLinearAttention, FullBFloat16) { check_all<__nv_bfloat16>(false); }

TEST(CudaEmuEluLinearAttention, EmptySides) {
  check_case<float>({1, 2, 0, 9, 8, 8, false, {}, 16}, 300);   // no queries: zero dK, dV
  check_case<float>({1, 2, 9, 0, 8, 8, false, {}, 16}, 301);   // no keys: out 0, den eps
  check_case<float>({1, 1, 20, 20, 8, 0, true, {}, 16}, 302);  // M = 0: den only
}

}  // namespace
