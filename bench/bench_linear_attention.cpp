// Benchmark of linear attention (issue: linear attention, causal linear
// attention, feature maps).
//
//   build/bench_linear_attention [--threads T] [--max-len L] [--reps R]
//
// N=1, H=8, E=M=64, float32, elu feature map. For L = 1024, 2048, ..., max-len
// (65536 by default) prints the median wall time (one run above L = 16384) of:
// `linear` forward, `causal-linear` forward, `causal-linear` forward+backward,
// and the bare causal_linear_product operator forward and forward+backward
// with their GFLOP/s (flops as computed, per head 2·L·(2·F·M + C·(F+M)) forward and
// 2·L·(5·F·M + 3·C·(F+M)) backward, C its chunk), each also in ms per
// 1k tokens: a flat column shows linear scaling. Then a finiteness check of
// causal-linear in float32 at the longest length with unnormalised inputs
// (|x| ~ 100·sqrt(E)), and the process's peak resident memory (an L×L matrix
// at L = 65536 would be 16 GiB per head).
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "fastattn/attention.h"
#include "bench_util.h"
#include "fastattn/ops.h"
#include "fastattn/registry.h"

using fastattn::bench::now_s;
using fastattn::bench::peak_rss_mib;
using fastattn::bench::time_median;

int main(int argc, char** argv) {
  int threads = static_cast<int>(std::thread::hardware_concurrency());
  int64_t max_len = 65536;
  int reps = 3;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--threads") && i + 1 < argc)
      threads = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--max-len") && i + 1 < argc)
      max_len = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc)
      reps = std::max(1, std::atoi(argv[++i]));
    else {
      std::fprintf(stderr, "usage: %s [--threads T] [--max-len L] [--reps R]\n", argv[0]);
      return 2;
    }
  }
  at::set_num_threads(threads);
  std::printf("threads: %d, N=1 H=8 E=M=64 float32, feature map elu, median of %d\n",
              at::get_num_threads(), reps);
  const int64_t N = 1, H = 8, E = 64;
  fastattn::AttentionDims dims{H, E, E};
  auto linear = fastattn::make_attention("linear", {}, dims);
  auto causal = fastattn::make_attention("causal-linear", {}, dims);
  linear->eval();
  causal->eval();
  const auto causal_mask = fastattn::Mask::causal_mask();

  const double C = fastattn::kCausalLinearProductChunk;
  std::printf("%7s  %-34s %10s %11s %9s\n", "L", "what", "ms", "ms/1k tok", "GFLOP/s");
  auto report = [](int64_t L, const char* what, double t, double flops) {
    std::printf("%7lld  %-34s %10.2f %11.3f", static_cast<long long>(L), what, t * 1e3,
                t * 1e3 * 1000.0 / static_cast<double>(L));
    if (flops > 0) std::printf(" %9.1f", flops / t / 1e9);
    std::printf("\n");
    std::fflush(stdout);
  };
  for (int64_t L = 1024; L <= max_len; L *= 2) {
    auto q = torch::randn({N, H, L, E}), k = torch::randn({N, H, L, E}),
         v = torch::randn({N, H, L, E});
    auto w = torch::randn({N, H, L, E});
    const int r = L > 16384 ? 1 : reps;
    const double fwd_flops = 2.0 * N * H * L * (2.0 * E * E + C * (E + E));
    const double bwd_flops = 2.0 * N * H * L * (5.0 * E * E + 3 * C * (E + E));
    {
      torch::NoGradGuard no_grad;
      report(L, "linear fwd", time_median([&] { linear->forward(q, k, v, fastattn::Mask()); }, r),
             0);
      report(L, "causal-linear fwd", time_median([&] { causal->forward(q, k, v, causal_mask); }, r),
             0);
    }
    auto qg = q.clone().requires_grad_(), kg = k.clone().requires_grad_(),
         vg = v.clone().requires_grad_();
    report(L, "causal-linear fwd+bwd",
           time_median(
               [&] {
                 auto out = causal->forward(qg, kg, vg, causal_mask);
                 torch::autograd::grad({out}, {qg, kg, vg}, {w});  // w: the output gradient
               },
               r),
           0);
    auto qf = (torch::elu(q) + 1).requires_grad_(), kf = (torch::elu(k) + 1).requires_grad_();
    {
      torch::NoGradGuard no_grad;
      report(L, "causal_linear_product fwd",
             time_median([&] { fastattn::causal_linear_product(qf, kf, v); }, r), fwd_flops);
    }
    report(L, "causal_linear_product fwd+bwd",
           time_median(
               [&] {
                 auto out = fastattn::causal_linear_product(qf, kf, vg);
                 torch::autograd::grad({out}, {qf, kf, vg}, {w});
               },
               r),
           fwd_flops + bwd_flops);
  }

  {
    torch::NoGradGuard no_grad;
    const int64_t L = max_len;
    auto q = torch::randn({N, H, L, E}) * 100, k = torch::randn({N, H, L, E}) * 100,
         v = torch::randn({N, H, L, E}) * 100;
    auto out = causal->forward(q, k, v, causal_mask);
    const bool finite = torch::isfinite(out).all().item<bool>();
    std::printf("causal-linear float32 L=%lld, inputs ~ 100·randn: %s (max |out| %.3g)\n",
                static_cast<long long>(L), finite ? "finite" : "NOT FINITE",
                out.abs().max().item<double>());
    if (!finite) return 1;
  }
  std::printf("peak resident memory: %.0f MiB\n", peak_rss_mib());
  return 0;
}
