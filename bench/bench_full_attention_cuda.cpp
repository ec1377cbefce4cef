// Benchmark of the fused full-attention operator on CUDA against PyTorch's
// scaled_dot_product_attention (flash backend where PyTorch picks it).
//
//   build/bench_full_attention_cuda [--dtype bf16|fp16|fp32] [--lengths 1024,4096]
//                                   [--dims 64,128] [--heads 8] [--reps 20]
//
// N = 1, H = 8 by default, L = S; per (E = M, L, causal): median milliseconds
// of the forward and of forward+backward for fastattn::full_attention and
// at::scaled_dot_product_attention, TFLOP/s (forward 4·H·L²·E flops, backward
// 2.5× that, halved when causal), the ratio ours / SDPA, and the largest
// output difference between the two as a sanity check. Needs a CUDA device
// (prints a line and exits 0 without one) and LibTorch >= 2.0 for SDPA.
#include <torch/cuda.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "bench_util.h"
#include "fastattn/ops.h"

using fastattn::bench::time_median;

namespace {

std::vector<int64_t> parse_list(const char* s) {
  std::vector<int64_t> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(std::atoll(item.c_str()));
  return out;
}

template <typename F>
double time_ms(F f, int reps) {
  return 1e3 * time_median(
                   [&] {
                     f();
                     torch::cuda::synchronize();
                   },
                   reps);
}

}  // namespace

int main(int argc, char** argv) {
  torch::ScalarType dtype = torch::kBFloat16;
  std::vector<int64_t> lengths = {1024, 4096, 8192}, dims = {64, 128};
  int64_t heads = 8;
  int reps = 20;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--dtype") && i + 1 < argc) {
      const std::string d = argv[++i];
      dtype = d == "fp16" ? torch::kHalf : d == "fp32" ? torch::kFloat : torch::kBFloat16;
    } else if (!std::strcmp(argv[i], "--lengths") && i + 1 < argc) {
      lengths = parse_list(argv[++i]);
    } else if (!std::strcmp(argv[i], "--dims") && i + 1 < argc) {
      dims = parse_list(argv[++i]);
    } else if (!std::strcmp(argv[i], "--heads") && i + 1 < argc) {
      heads = std::atoll(argv[++i]);
    } else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) {
      reps = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr,
                   "usage: %s [--dtype bf16|fp16|fp32] [--lengths L,..] [--dims E,..] "
                   "[--heads H] [--reps R]\n",
                   argv[0]);
      return 2;
    }
  }
  if (!torch::cuda::is_available()) {
    std::printf("no CUDA device: nothing to measure\n");
    return 0;
  }
  torch::NoGradGuard no_grad_outer;
  std::printf("%-5s %-6s %-6s | %-28s | %-28s | %s\n", "E", "L", "causal",
              "forward ms (TFLOP/s) ours/sdpa", "fwd+bwd ms (TFLOP/s) ours/sdpa", "ratio f, f+b");
  for (int64_t E : dims) {
    for (int64_t L : lengths) {
      for (bool causal : {false, true}) {
        const auto opts = torch::TensorOptions().device(torch::kCUDA).dtype(dtype);
        auto q = torch::randn({1, heads, L, E}, opts), k = torch::randn({1, heads, L, E}, opts),
             v = torch::randn({1, heads, L, E}, opts), go = torch::randn({1, heads, L, E}, opts);
        const double fwd_flops = 4.0 * heads * L * L * E * (causal ? 0.5 : 1.0);
        const double ours_f = time_ms(
            [&] { fastattn::full_attention(q, k, v, std::nullopt, std::nullopt, causal); }, reps);
        auto qg = q.clone().requires_grad_(), kg = k.clone().requires_grad_(),
             vg = v.clone().requires_grad_();
        const double ours_fb = time_ms(
            [&] {
              torch::AutoGradMode grad(true);
              fastattn::full_attention(qg, kg, vg, std::nullopt, std::nullopt, causal).backward(go);
            },
            reps);
#if TORCH_VERSION_MAJOR >= 2
        const double sdpa_f =
            time_ms([&] { at::scaled_dot_product_attention(q, k, v, {}, 0.0, causal); }, reps);
        const double sdpa_fb = time_ms(
            [&] {
              torch::AutoGradMode grad(true);
              at::scaled_dot_product_attention(qg, kg, vg, {}, 0.0, causal).backward(go);
            },
            reps);
        const double diff =
            (fastattn::full_attention(q, k, v, std::nullopt, std::nullopt, causal)
                 .to(torch::kFloat) -
             at::scaled_dot_product_attention(q, k, v, {}, 0.0, causal).to(torch::kFloat))
                .abs()
                .max()
                .item<double>();
#else
        const double sdpa_f = 0, sdpa_fb = 0, diff = 0;
#endif
        auto tf = [](double flops, double ms) { return ms > 0 ? flops / (ms * 1e9) : 0.0; };
        std::printf(
            "%-5lld %-6lld %-6s | %7.3f (%5.1f) / %7.3f (%5.1f) | %7.3f (%5.1f) / %7.3f (%5.1f) | "
            "%.2f, %.2f  (max |diff| %.3g)\n",
            static_cast<long long>(E), static_cast<long long>(L), causal ? "yes" : "no", ours_f,
            tf(fwd_flops, ours_f), sdpa_f, tf(fwd_flops, sdpa_f), ours_fb,
            tf(3.5 * fwd_flops, ours_fb), sdpa_fb, tf(3.5 * fwd_flops, sdpa_fb),
            sdpa_f > 0 ? ours_f / sdpa_f : 0.0, sdpa_fb > 0 ? ours_fb / sdpa_fb : 0.0, diff);
      }
    }
  }
  return 0;
}
