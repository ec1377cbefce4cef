// token_gather_{forward,backward}_cuda (src/kernels/token_gather/) under the
// emulator against the plain reference (token_gather_reference.h, float64): the forward exactly (a
// copy), the backward (a scatter-add with repeated and -1 indices) within 1e-6 relative of float64
// for every dtype (grad_x is float32; inputs are the same rounded values). Sizes: E in {1, 24, 64},
// T larger and smaller than L.
#include <gtest/gtest.h>

#include <random>

#include "emu_test_util.h"
#include "kernels/token_gather/token_gather.h"
#include "kernels/token_gather/token_gather_cuda.h"
#include "kernels/token_gather/token_gather_reference.h"

namespace {

using namespace fastattn::emu_test;

template <typename T>
void check_gather(int64_t N, int64_t H, int64_t L, int64_t Tn, int64_t E, uint32_t seed) {
  SCOPED_TRACE(std::string(dtype_name<T>()) + " L " + std::to_string(L) + " T " +
               std::to_string(Tn) + " E " + std::to_string(E));
  std::mt19937 rng(seed);
  auto x = random_buffer<T>(N * H * L * E, rng);
  auto g = random_buffer<T>(N * H * Tn * E, rng);
  std::vector<int64_t> index(N * Tn);
  for (auto& i : index) i = static_cast<int64_t>(rng() % (L + 1)) - 1;  // -1 and repeats
  // Forward.
  std::vector<T> out(N * H * Tn * E, fastattn::cuda::from_float<T>(7.f));
  fastattn::cuda::TokenGatherCudaArgs a;
  a.x = x.dev.data();
  a.index = index.data();
  a.out = out.data();
  a.N = N;
  a.H = H;
  a.L = L;
  a.T_ = Tn;
  a.E = E;
  a.dtype = dtype_of<T>();
  fastattn::cuda::token_gather_forward_cuda(a, nullptr);
  std::vector<double> want(N * H * Tn * E);
  fastattn::kernels::TokenGatherArgs<double> c;
  c.x = x.ref.data();
  c.index = index.data();
  c.out = want.data();
  c.N = N;
  c.H = H;
  c.L = L;
  c.T_ = Tn;
  c.E = E;
  fastattn::kernels::token_gather_forward_reference(c);
  EXPECT_EQ(to_double(out), want);
  // Backward.
  std::vector<float> gx(N * H * L * E, 0.f);
  a.grad_out = g.dev.data();
  a.grad_x = gx.data();
  fastattn::cuda::token_gather_backward_cuda(a, nullptr);
  std::vector<double> gwant(N * H * L * E);
  c.grad_out = g.ref.data();
  c.out = gwant.data();
  fastattn::kernels::token_gather_backward_reference(c);
  expect_close(std::vector<double>(gx.begin(), gx.end()), gwant, {1e-6, 1e-6}, "grad_x");
}

template <typename T>
void sweep() {
  check_gather<T>(2, 3, 17, 40, 24, 1);
  check_gather<T>(1, 2, 33, 9, 64, 2);
  check_gather<T>(3, 1, 5, 12, 1, 3);
}

TEST(ClusteredEmuTokenGather, Float32) { sweep<float>(); }
TEST(ClusteredEmuTokenGather, Float16) { sweep<__half>(); }
TEST(ClusteredEmuTokenGather, BFloat16) { sweep<__nv_bfloat16>(); }

}  // namespace
