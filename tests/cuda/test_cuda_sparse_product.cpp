// Backend comparison of clustered_topk_attention and
// improved_clustered_attention: forward outputs and gradients (autograd of
// the public entry points, and the _backward op fed with the CUDA forward's
// own centroids / lse / top-k indices) per dtype against the CPU ops in
// float64 on the same rounded inputs, with tolerance_for(dtype).
// The improved forward's top-k selection is compared end to end only where
// it cannot flip on rounding (topk = S for float16 / bfloat16); its backward
// with topk < S in every dtype through the saved tensors.
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "cuda_compare.h"
#include "fastattn/ops.h"

namespace {

using namespace fastattn::testing;
using torch::Tensor;

// Random assignments in [-1, C - 1) (the last cluster empty) and their counts.
std::pair<Tensor, Tensor> random_clusters(int64_t N, int64_t H, int64_t L, int64_t C) {
  auto a = torch::randint(-1, C - 1, {N, H, L}, torch::kLong);
  auto counts = torch::zeros({N, H, C + 1}, torch::kLong)
                    .scatter_add_(2, a + 1, torch::ones_like(a))
                    .narrow(2, 1, C)
                    .contiguous();
  return {a, counts};
}

TEST(CudaSparseProduct, ClusteredTopkForwardAndGradients) {
  FASTATTN_SKIP_WITHOUT_CUDA();
  torch::manual_seed(3);
  const int64_t N = 2, H = 2, L = 45, S = 50, E = 24, M = 40, C = 5;
  for (auto dtype : cuda_dtypes()) {
    for (int64_t K : {7, 32, 70}) {
      for (bool lengths : {false, true}) {
        SCOPED_TRACE(std::string(c10::toString(dtype)) + " K " + std::to_string(K) +
                     (lengths ? " key_lengths" : ""));
        auto q = random_pair({N, H, L, E}, dtype), k = random_pair({N, H, S, E}, dtype),
             v = random_pair({N, H, S, M}, dtype), g = random_pair({N, H, L, M}, dtype);
        auto mass_d = (torch::rand({N, H, C}, torch::kDouble) * 0.8 + 0.2).to(dtype);
        const auto topk = torch::randint(0, S, {N, H, C, K}, torch::kLong);
        const auto [a, counts] = random_clusters(N, H, L, C);
        std::optional<Tensor> kl, kl_gpu;
        if (lengths) {
          kl = torch::tensor({S, int64_t{17}}, torch::kLong);
          kl_gpu = kl->cuda();
        }
        const double temp = 0.3;
        auto qg = q.gpu.clone().requires_grad_(true), kg = k.gpu.clone().requires_grad_(true),
             vg = v.gpu.clone().requires_grad_(true), mg = mass_d.cuda().requires_grad_(true);
        auto qc = q.cpu64.clone().requires_grad_(true), kc = k.cpu64.clone().requires_grad_(true),
             vc = v.cpu64.clone().requires_grad_(true),
             mc = mass_d.to(torch::kDouble).requires_grad_(true);
        auto og =
            fastattn::clustered_topk_attention(qg, kg, vg, topk.cuda(), mg, a.cuda(), kl_gpu, temp);
        auto oc = fastattn::clustered_topk_attention(qc, kc, vc, topk, mc, a, kl, temp);
        const auto tol = tolerance_for(dtype);
        expect_close(og, oc.detach(), tol, "out");
        og.backward(g.gpu);
        oc.backward(g.cpu64);
        expect_close(qg.grad(), qc.grad(), tol, "grad q");
        expect_close(kg.grad(), kc.grad(), tol, "grad k");
        expect_close(vg.grad(), vc.grad(), tol, "grad v");
        expect_close(mg.grad(), mc.grad(), {tol.atol * 10, tol.rtol}, "grad mass");
      }
    }
  }
}

using ImprovedFn = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                          int64_t, const c10::optional<Tensor>&, c10::optional<double>, double,
                          c10::optional<int64_t>);
using ImprovedForwardFn = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t,
    const c10::optional<Tensor>&, double, double, int64_t);
using ImprovedBackwardFn = std::tuple<Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, const c10::optional<Tensor>&,
    double, double, int64_t);

template <typename Fn>
auto op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

TEST(CudaSparseProduct, ImprovedClusteredEndToEnd) {
  FASTATTN_SKIP_WITHOUT_CUDA();
  torch::manual_seed(4);
  static auto improved = op<ImprovedFn>("fastattn::improved_clustered_attention");
  const int64_t N = 2, H = 2, L = 60, S = 40, E = 32, M = 24, C = 6;
  for (auto dtype : cuda_dtypes()) {
    for (int64_t topk : {S, int64_t{9}}) {
      if (topk < S && dtype != torch::kFloat) continue;  // the selection may flip on rounding
      for (bool lengths : {false, true}) {
        SCOPED_TRACE(std::string(c10::toString(dtype)) + " topk " + std::to_string(topk) +
                     (lengths ? " key_lengths" : ""));
        auto q = random_pair({N, H, L, E}, dtype), k = random_pair({N, H, S, E}, dtype),
             v = random_pair({N, H, S, M}, dtype), g = random_pair({N, H, L, M}, dtype);
        const auto [a, counts] = random_clusters(N, H, L, C);
        c10::optional<Tensor> kl, kl_gpu;
        if (lengths) {
          kl = torch::tensor({int64_t{23}, S}, torch::kLong);
          kl_gpu = kl->cuda();
        }
        auto qg = q.gpu.clone().requires_grad_(true), kg = k.gpu.clone().requires_grad_(true),
             vg = v.gpu.clone().requires_grad_(true);
        auto qc = q.cpu64.clone().requires_grad_(true), kc = k.cpu64.clone().requires_grad_(true),
             vc = v.cpu64.clone().requires_grad_(true);
        auto og = improved.call(qg, kg, vg, a.cuda(), counts.cuda(), topk, kl_gpu, c10::nullopt,
                                0.0, c10::nullopt);
        auto oc = improved.call(qc, kc, vc, a, counts, topk, kl, c10::nullopt, 0.0, c10::nullopt);
        const auto tol = tolerance_for(dtype);
        expect_close(og, oc.detach(), tol, "out");
        og.backward(g.gpu);
        oc.backward(g.cpu64);
        expect_close(qg.grad(), qc.grad(), tol, "grad q");
        expect_close(kg.grad(), kc.grad(), tol, "grad k");
        expect_close(vg.grad(), vc.grad(), tol, "grad v");
      }
    }
  }
}

TEST(CudaSparseProduct, ImprovedClusteredBackwardFromCudaForward) {
  FASTATTN_SKIP_WITHOUT_CUDA();
  torch::manual_seed(5);
  static auto forward = op<ImprovedForwardFn>("fastattn::improved_clustered_attention_forward");
  static auto backward = op<ImprovedBackwardFn>("fastattn::improved_clustered_attention_backward");
  const int64_t N = 1, H = 3, L = 70, S = 64, E = 64, M = 64, C = 7, topk = 32;
  for (auto dtype : cuda_dtypes()) {
    SCOPED_TRACE(c10::toString(dtype));
    auto q = random_pair({N, H, L, E}, dtype), k = random_pair({N, H, S, E}, dtype),
         v = random_pair({N, H, S, M}, dtype), g = random_pair({N, H, L, M}, dtype);
    const auto [a, counts] = random_clusters(N, H, L, C);
    const double temp = 0.125;
    const auto [out, cen, lse, out_c, idx] = forward.call(
        q.gpu, k.gpu, v.gpu, a.cuda(), counts.cuda(), topk, c10::nullopt, temp, 0.0, 0);
    const auto [gq, gk, gv] = backward.call(g.gpu, q.gpu, k.gpu, v.gpu, a.cuda(), counts.cuda(),
                                            cen, lse, out_c, idx, c10::nullopt, temp, 0.0, 0);
    auto d = [](const Tensor& t) { return t.to(torch::kCPU, torch::kDouble); };
    const auto [rq, rk, rv] =
        backward.call(g.cpu64, q.cpu64, k.cpu64, v.cpu64, a, counts, d(cen), d(lse), d(out_c),
                      idx.cpu(), c10::nullopt, temp, 0.0, 0);
    const auto tol = tolerance_for(dtype);
    expect_close(gq, rq, tol, "grad q");
    expect_close(gk, rk, tol, "grad k");
    expect_close(gv, rv, tol, "grad v");
    // The centroids are the members' means.
    const auto [rout, rcen, rlse, rout_c, ridx] =
        forward.call(q.cpu64, k.cpu64, v.cpu64, a, counts, topk, c10::nullopt, temp, 0.0, 0);
    expect_close(cen, rcen, tol, "centroids");
  }
}

}  // namespace
