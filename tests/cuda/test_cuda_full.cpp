// Backend comparison of the full_attention operators: CUDA (float32, float16,
// bfloat16) against the CPU op in float64 on the same (rounded) inputs:
// forward and gradients through the public functions (autograd), the
// _backward op with a grad_lse, and full_attention_lse_topk's lse, top-k
// indices (exact integer scores, so ties follow the rule on both) and
// gradients. Tolerances: tolerance_for(dtype) (tests/cuda/cuda_compare.h).
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

// Bool mask (L, S) or (N, H, L, S) with ~20% dropped entries and a fully
// dropped first row.
Tensor random_keep_mask(torch::IntArrayRef shape) {
  auto keep = torch::rand(shape, torch::kDouble) > 0.2;
  keep.select(-2, 0).fill_(false);
  return keep;
}

void compare_full(torch::ScalarType dtype, Shape s, bool causal, int mask_dims, bool lengths,
                  std::optional<double> temp, const std::string& what) {
  SCOPED_TRACE(what + " " + std::string(c10::toString(dtype)));
  torch::manual_seed(7);
  auto q = random_pair({s.N, s.H, s.L, s.E}, dtype);
  auto k = random_pair({s.N, s.H, s.S, s.E}, dtype);
  auto v = random_pair({s.N, s.H, s.S, s.M}, dtype);
  auto go = random_pair({s.N, s.H, s.L, s.M}, dtype);
  std::optional<Tensor> mask_cpu, mask_gpu, len_cpu, len_gpu;
  if (mask_dims == 2) mask_cpu = random_keep_mask({s.L, s.S});
  if (mask_dims == 4) mask_cpu = random_keep_mask({s.N, s.H, s.L, s.S});
  if (mask_cpu) mask_gpu = mask_cpu->to(torch::kCUDA);
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
  auto out_g = fastattn::full_attention(qg, kg, vg, mask_gpu, len_gpu, causal, temp);
  auto out_c = fastattn::full_attention(qc, kc, vc, mask_cpu, len_cpu, causal, temp);
  EXPECT_EQ(out_g.scalar_type(), dtype);
  const auto tol = tolerance_for(dtype);
  expect_close(out_g, out_c, tol, "out");
  (out_g * go.gpu).sum().backward();
  (out_c * go.cpu64).sum().backward();
  expect_close(qg.grad(), qc.grad(), tol, "grad q");
  expect_close(kg.grad(), kc.grad(), tol, "grad k");
  expect_close(vg.grad(), vc.grad(), tol, "grad v");
}

TEST(CudaFullAttention, PlainShapes) {
  FASTATTN_SKIP_WITHOUT_CUDA();
  for (auto dtype : cuda_dtypes()) {
    compare_full(dtype, {2, 3, 97, 130, 64, 64}, false, 0, false, std::nullopt, "E=M=64");
    compare_full(dtype, {1, 2, 1, 300, 24, 40}, false, 0, false, std::nullopt, "one query");
    compare_full(dtype, {1, 1, 65, 1, 8, 8}, false, 0, false, 0.5, "one key");
    compare_full(dtype, {1, 2, 200, 150, 128, 128}, false, 0, false, std::nullopt, "E=M=128");
    compare_full(dtype, {1, 1, 70, 90, 128, 16}, false, 0, false, std::nullopt, "E=128, M=16");
  }
}

TEST(CudaFullAttention, MasksLengthsCausal) {
  FASTATTN_SKIP_WITHOUT_CUDA();
  for (auto dtype : cuda_dtypes()) {
    compare_full(dtype, {2, 2, 77, 100, 32, 32}, false, 2, false, std::nullopt, "mask (L,S)");
    compare_full(dtype, {2, 2, 77, 100, 32, 48}, false, 4, false, std::nullopt, "mask (N,H,L,S)");
    compare_full(dtype, {3, 2, 50, 129, 64, 64}, false, 0, true, std::nullopt, "key_lengths");
    compare_full(dtype, {1, 2, 100, 260, 64, 64}, true, 0, false, std::nullopt, "causal L<S");
    compare_full(dtype, {1, 2, 150, 70, 64, 64}, true, 0, false, std::nullopt, "causal L>S");
    compare_full(dtype, {3, 2, 129, 129, 64, 64}, true, 2, true, std::nullopt, "everything");
    // Few query blocks over S >= 4096 keys: the dense route (full_attention_dense).
    compare_full(dtype, {3, 2, 7, 4100, 64, 64}, false, 0, true, std::nullopt, "few queries");
    compare_full(dtype, {1, 2, 3, 4100, 32, 32}, true, 0, false, 0.3, "few queries causal");
  }
}

TEST(CudaFullAttention, BackwardOpWithGradLse) {
  FASTATTN_SKIP_WITHOUT_CUDA();
  static auto fwd =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fastattn::full_attention_forward", "")
          .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                            const c10::optional<Tensor>&,
                                            const c10::optional<Tensor>&, bool, double)>();
  static auto bwd =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fastattn::full_attention_backward", "")
          .typed<std::tuple<Tensor, Tensor, Tensor>(
              const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
              const Tensor&, const c10::optional<Tensor>&, const c10::optional<Tensor>&, bool,
              double, const c10::optional<Tensor>&)>();
  for (auto dtype : cuda_dtypes()) {
    SCOPED_TRACE(c10::toString(dtype));
    torch::manual_seed(3);
    const int64_t N = 2, H = 2, L = 45, S = 83, E = 32, M = 16;
    auto q = random_pair({N, H, L, E}, dtype), k = random_pair({N, H, S, E}, dtype),
         v = random_pair({N, H, S, M}, dtype), go = random_pair({N, H, L, M}, dtype),
         gl = random_pair({N, H, L}, dtype);
    auto len = torch::tensor({S, S / 3}, torch::kLong);
    const double temp = 0.2;
    auto [out_g, lse_g] =
        fwd.call(q.gpu, k.gpu, v.gpu, c10::nullopt, len.to(torch::kCUDA), false, temp);
    auto [out_c, lse_c] = fwd.call(q.cpu64, k.cpu64, v.cpu64, c10::nullopt, len, false, temp);
    EXPECT_EQ(lse_g.scalar_type(), torch::kFloat);  // lse is float32 on CUDA
    const auto tol = tolerance_for(dtype);
    expect_close(out_g, out_c, tol, "out");
    expect_close(lse_g, lse_c, tol, "lse");
    // The CPU backward gets the GPU's out (as float64) so both use one delta.
    auto out_g64 = out_g.to(torch::kCPU, torch::kDouble);
    auto [gq_g, gk_g, gv_g] = bwd.call(go.gpu, q.gpu, k.gpu, v.gpu, out_g, lse_g, c10::nullopt,
                                       len.to(torch::kCUDA), false, temp, gl.gpu);
    auto [gq_c, gk_c, gv_c] = bwd.call(go.cpu64, q.cpu64, k.cpu64, v.cpu64, out_g64, lse_c,
                                       c10::nullopt, len, false, temp, gl.cpu64);
    expect_close(gq_g, gq_c, tol, "grad q");
    expect_close(gk_g, gk_c, tol, "grad k");
    expect_close(gv_g, gv_c, tol, "grad v");
  }
}

TEST(CudaFullAttention, LseTopk) {
  FASTATTN_SKIP_WITHOUT_CUDA();
  for (auto dtype : cuda_dtypes()) {
    SCOPED_TRACE(c10::toString(dtype));
    torch::manual_seed(5);
    const int64_t N = 3, H = 2, C = 37, S = 150, E = 16, M = 24, topk = 20;
    // Small integers: exact scores on both backends, with many exact ties.
    auto qi = torch::randint(-2, 3, {N, H, C, E}, torch::kDouble);
    auto ki = torch::randint(-2, 3, {N, H, S, E}, torch::kDouble);
    auto v = random_pair({N, H, S, M}, dtype);
    auto go = random_pair({N, H, C, M}, dtype);
    auto gl = random_pair({N, H, C}, dtype);
    // Row 1: fewer keys than topk.
    auto len = torch::tensor({S, int64_t{11}, int64_t{90}}, torch::kLong);
    const double temp = 0.25;
    auto qg = qi.to(torch::kCUDA, dtype).requires_grad_(),
         kg = ki.to(torch::kCUDA, dtype).requires_grad_(), vg = v.gpu.clone().requires_grad_();
    auto qc = qi.clone().requires_grad_(), kc = ki.clone().requires_grad_(),
         vc = v.cpu64.clone().requires_grad_();
    auto [out_g, lse_g, idx_g] =
        fastattn::full_attention_lse_topk(qg, kg, vg, len.to(torch::kCUDA), temp, topk);
    auto [out_c, lse_c, idx_c] = fastattn::full_attention_lse_topk(qc, kc, vc, len, temp, topk);
    const auto tol = tolerance_for(dtype);
    expect_close(out_g, out_c, tol, "out");
    expect_close(lse_g, lse_c, tol, "lse");
    EXPECT_TRUE(torch::equal(idx_g.cpu(), idx_c)) << "top-k indices differ";
    ((out_g * go.gpu).sum() + (lse_g * gl.gpu.to(torch::kFloat)).sum()).backward();
    ((out_c * go.cpu64).sum() + (lse_c * gl.cpu64).sum()).backward();
    expect_close(qg.grad(), qc.grad(), tol, "grad q");
    expect_close(kg.grad(), kc.grad(), tol, "grad k");
    expect_close(vg.grad(), vc.grad(), tol, "grad v");
    // topk = 0 and topk = S.
    auto none = std::get<2>(fastattn::full_attention_lse_topk(qg.detach(), kg.detach(), vg.detach(),
                                                              std::nullopt, temp, 0));
    EXPECT_EQ(none.size(3), 0);
    auto all_g = std::get<2>(fastattn::full_attention_lse_topk(
        qg.detach(), kg.detach(), vg.detach(), len.to(torch::kCUDA), temp, S));
    auto all_c = std::get<2>(
        fastattn::full_attention_lse_topk(qc.detach(), kc.detach(), vc.detach(), len, temp, S));
    EXPECT_TRUE(torch::equal(all_g.cpu(), all_c)) << "topk = S";
  }
}

TEST(CudaFullAttention, RejectsLargeHeadDims) {
  FASTATTN_SKIP_WITHOUT_CUDA();
  auto q = torch::randn({1, 1, 4, 136}, torch::TensorOptions().device(torch::kCUDA));
  auto v = torch::randn({1, 1, 4, 8}, torch::TensorOptions().device(torch::kCUDA));
  EXPECT_THROW(fastattn::full_attention(q, q, v), c10::Error);
  auto q2 = torch::randn({1, 1, 4, 8}, torch::TensorOptions().device(torch::kCUDA));
  auto v2 = torch::randn({1, 1, 4, 129}, torch::TensorOptions().device(torch::kCUDA));
  EXPECT_THROW(fastattn::full_attention(q2, q2, v2), c10::Error);
}

}  // namespace
