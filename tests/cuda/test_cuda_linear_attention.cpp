// Backend comparison of the linear attention operators: causal_linear_product,
// elu_linear_attention (causal and not, key_lengths with a batch entry
// without keys, L != S) and elu_feature_map on CUDA (float32, float16,
// bfloat16) against the CPU ops in float64 on the same (rounded) inputs:
// forward and gradients through the public functions (autograd), plus the
// forward op's den (float32 on CUDA). Lengths are not multiples of the
// kernels' 64-row chunks. Tolerances: tolerance_for(dtype)
// (tests/cuda/cuda_compare.h).
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

#include "cuda_compare.h"
#include "fastattn/ops.h"

namespace {

using fastattn::testing::cuda_dtypes;
using fastattn::testing::expect_close;
using fastattn::testing::random_pair;
using fastattn::testing::tolerance_for;
using torch::Tensor;

struct Shape {
  int64_t N, H, L, S, E, M;
};

// expect_close, or for empty tensors (no keys) only the shapes.
void close_or_empty(const Tensor& got, const Tensor& ref, fastattn::testing::Tolerance tol,
                    const std::string& what) {
  ASSERT_TRUE(got.defined()) << what;
  if (ref.numel() == 0) {
    EXPECT_EQ(got.sizes(), ref.sizes()) << what;
    return;
  }
  expect_close(got, ref, tol, what);
}

void compare_causal_product(torch::ScalarType dtype, Shape s) {
  SCOPED_TRACE(std::string(c10::toString(dtype)) + " L=" + std::to_string(s.L) +
               " F=" + std::to_string(s.E) + " M=" + std::to_string(s.M));
  torch::manual_seed(11);
  // Scaled so the sums over up to L rows stay O(1..10).
  auto q = random_pair({s.N, s.H, s.L, s.E}, dtype, 0.3);
  auto k = random_pair({s.N, s.H, s.L, s.E}, dtype, 0.3);
  auto v = random_pair({s.N, s.H, s.L, s.M}, dtype);
  auto go = random_pair({s.N, s.H, s.L, s.M}, dtype);
  auto qg = q.gpu.clone().requires_grad_(), kg = k.gpu.clone().requires_grad_(),
       vg = v.gpu.clone().requires_grad_();
  auto qc = q.cpu64.clone().requires_grad_(), kc = k.cpu64.clone().requires_grad_(),
       vc = v.cpu64.clone().requires_grad_();
  auto out_g = fastattn::causal_linear_product(qg, kg, vg);
  auto out_c = fastattn::causal_linear_product(qc, kc, vc);
  EXPECT_EQ(out_g.scalar_type(), dtype);
  EXPECT_TRUE(out_g.is_cuda());
  const auto tol = tolerance_for(dtype);
  expect_close(out_g, out_c.detach(), tol, "out");
  out_g.backward(go.gpu);
  out_c.backward(go.cpu64);
  expect_close(qg.grad(), qc.grad(), tol, "grad_q");
  expect_close(kg.grad(), kc.grad(), tol, "grad_k");
  expect_close(vg.grad(), vc.grad(), tol, "grad_v");
}

TEST(CudaLinearAttention, CausalLinearProduct) {
  FASTATTN_SKIP_WITHOUT_CUDA();
  for (auto dtype : cuda_dtypes()) {
    compare_causal_product(dtype, {1, 2, 100, 100, 16, 24});
    compare_causal_product(dtype, {2, 2, 130, 130, 64, 64});
    compare_causal_product(dtype, {1, 1, 1, 1, 8, 80});
  }
}

void compare_elu(torch::ScalarType dtype, Shape s, bool causal, bool lengths) {
  SCOPED_TRACE(std::string(c10::toString(dtype)) + " L=" + std::to_string(s.L) + " S=" +
               std::to_string(s.S) + " E=" + std::to_string(s.E) + " M=" + std::to_string(s.M) +
               (causal ? " causal" : "") + (lengths ? " key_lengths" : ""));
  torch::manual_seed(13);
  auto q = random_pair({s.N, s.H, s.L, s.E}, dtype);
  auto k = random_pair({s.N, s.H, s.S, s.E}, dtype);
  auto v = random_pair({s.N, s.H, s.S, s.M}, dtype);
  auto go = random_pair({s.N, s.H, s.L, s.M}, dtype);
  std::optional<Tensor> len_cpu, len_gpu;
  if (lengths) {
    auto l = torch::full({s.N}, s.S, torch::kLong);
    if (s.N > 1) l[1] = 0;
    if (s.N > 2) l[2] = s.S / 2 + 1;
    len_cpu = l;
    len_gpu = l.to(torch::kCUDA);
  }
  auto qg = q.gpu.clone().requires_grad_(), kg = k.gpu.clone().requires_grad_(),
       vg = v.gpu.clone().requires_grad_();
  auto qc = q.cpu64.clone().requires_grad_(), kc = k.cpu64.clone().requires_grad_(),
       vc = v.cpu64.clone().requires_grad_();
  auto out_g = fastattn::elu_linear_attention(qg, kg, vg, len_gpu, causal);
  auto out_c = fastattn::elu_linear_attention(qc, kc, vc, len_cpu, causal);
  const auto tol = tolerance_for(dtype);
  close_or_empty(out_g, out_c.detach(), tol, "out");
  out_g.backward(go.gpu);
  out_c.backward(go.cpu64);
  close_or_empty(qg.grad(), qc.grad(), tol, "grad_q");
  close_or_empty(kg.grad(), kc.grad(), tol, "grad_k");
  close_or_empty(vg.grad(), vc.grad(), tol, "grad_v");

  // The forward op's den: float32 on CUDA, eps included.
  static auto fwd =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fastattn::elu_linear_attention_forward", "")
          .typed<std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                    const c10::optional<Tensor>&, bool, double)>();
  auto c10_opt = [](const std::optional<Tensor>& t) {
    return t ? c10::optional<Tensor>(*t) : c10::optional<Tensor>();
  };
  auto [o_g, den_g, state_g] = fwd.call(q.gpu, k.gpu, v.gpu, c10_opt(len_gpu), causal, 1e-6);
  auto [o_c, den_c, state_c] = fwd.call(q.cpu64, k.cpu64, v.cpu64, c10_opt(len_cpu), causal, 1e-6);
  EXPECT_EQ(den_g.scalar_type(), torch::kFloat);
  EXPECT_EQ(state_g.numel(), 0);  // the CUDA backward recomputes the key state
  close_or_empty(den_g, den_c, tolerance_for(torch::kFloat), "den");
}

TEST(CudaLinearAttention, EluLinearAttention) {
  FASTATTN_SKIP_WITHOUT_CUDA();
  for (auto dtype : cuda_dtypes()) {
    for (bool causal : {false, true}) {
      compare_elu(dtype, {1, 2, 100, 100, 16, 24}, causal, false);
      compare_elu(dtype, {3, 2, 97, 97, 64, 64}, causal, true);
      compare_elu(dtype, {2, 1, 65, 65, 24, 128}, causal, true);
    }
    compare_elu(dtype, {3, 2, 70, 150, 32, 16}, false, true);  // L != S
    compare_elu(dtype, {1, 2, 40, 0, 8, 8}, false, false);     // no keys
  }
}

TEST(CudaLinearAttention, EluFeatureMap) {
  FASTATTN_SKIP_WITHOUT_CUDA();
  for (auto dtype : cuda_dtypes()) {
    SCOPED_TRACE(c10::toString(dtype));
    torch::manual_seed(17);
    auto x = random_pair({3, 5, 77}, dtype, 3.0);
    auto g = random_pair({3, 5, 77}, dtype);
    auto xg = x.gpu.clone().requires_grad_();
    auto xc = x.cpu64.clone().requires_grad_();
    auto yg = fastattn::elu_feature_map(xg);
    auto yc = fastattn::elu_feature_map(xc);
    const auto tol = tolerance_for(dtype);
    expect_close(yg, yc.detach(), tol, "phi");
    yg.backward(g.gpu);
    yc.backward(g.cpu64);
    expect_close(xg.grad(), xc.grad(), tol, "grad_x");
    // A non-contiguous input.
    auto xt = x.gpu.transpose(0, 2);
    expect_close(fastattn::elu_feature_map(xt), fastattn::elu_feature_map(x.cpu64.transpose(0, 2)),
                 tol, "phi of a transposed view");
  }
}

TEST(CudaLinearAttention, RejectsWhatTheCpuRejects) {
  FASTATTN_SKIP_WITHOUT_CUDA();
  auto q = torch::randn({1, 2, 5, 4}, torch::kCUDA), v = torch::randn({1, 2, 5, 3}, torch::kCUDA);
  EXPECT_THROW(fastattn::causal_linear_product(q, torch::randn({1, 2, 6, 4}, torch::kCUDA),
                                               torch::randn({1, 2, 6, 3}, torch::kCUDA)),
               c10::Error);
  EXPECT_THROW(fastattn::elu_linear_attention(q.to(torch::kDouble), q.to(torch::kDouble),
                                              v.to(torch::kDouble)),
               c10::Error);  // float64 is not a CUDA kernel dtype
  EXPECT_THROW(fastattn::elu_feature_map(q.to(torch::kDouble)), c10::Error);
  EXPECT_THROW(fastattn::elu_linear_attention(q, q, v, torch::full({1}, 9, torch::kLong)),
               c10::Error);  // key_lengths beyond S
}

}  // namespace
