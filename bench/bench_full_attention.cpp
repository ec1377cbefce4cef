// Benchmark of the fused full-attention operator (issue: foundation).
//
//   build/bench_full_attention [--threads T] [--long L] [--skip-long]
//
// Prints, in one run: the GFLOP/s of at::matmul on a 1024³ product (the
// machine's BLAS yardstick), the fused forward and forward+backward at N=1,
// H=8, L=4096, E=M=64 (4·L²·E·H flops forward, 2.5× that backward), the same
// with causal masking, the plain-ATen reference for comparison, and a long
// forward (L=65536 by default) with the process's peak resident memory, which
// shows that no L×L matrix is ever allocated (one would be 16 GiB per head).
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

#include "bench_util.h"
#include "fastattn/ops.h"

using fastattn::bench::now_s;
using fastattn::bench::peak_rss_mib;
using fastattn::bench::time_median;

int main(int argc, char** argv) {
  int threads = static_cast<int>(std::thread::hardware_concurrency());
  int64_t long_len = 65536;
  bool skip_long = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--threads") && i + 1 < argc)
      threads = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--long") && i + 1 < argc)
      long_len = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--skip-long"))
      skip_long = true;
    else {
      std::fprintf(stderr, "usage: %s [--threads T] [--long L] [--skip-long]\n", argv[0]);
      return 2;
    }
  }
  at::set_num_threads(threads);
  torch::NoGradGuard no_grad;
  std::printf("threads: %d\n", at::get_num_threads());

  {
    auto a = torch::randn({1024, 1024}), b = torch::randn({1024, 1024});
    const double t = time_median([&] { torch::matmul(a, b); }, 10);
    std::printf("%-44s %9.2f ms %8.1f GFLOP/s\n", "at::matmul 1024^3", t * 1e3,
                2.0 * 1024 * 1024 * 1024 / t / 1e9);
  }

  const int64_t N = 1, H = 8, L = 4096, E = 64;
  auto q = torch::randn({N, H, L, E}), k = torch::randn({N, H, L, E}),
       v = torch::randn({N, H, L, E});
  const double fwd_flops = 4.0 * N * H * L * L * E;
  for (bool causal : {false, true}) {
    const double flops = causal ? fwd_flops / 2 : fwd_flops;
    const double t = time_median(
        [&] { fastattn::full_attention(q, k, v, std::nullopt, std::nullopt, causal); }, 5);
    std::printf("%-44s %9.2f ms %8.1f GFLOP/s\n",
                causal ? "fused forward L=4096 causal" : "fused forward L=4096", t * 1e3,
                flops / t / 1e9);
  }
  {
    torch::AutoGradMode grad(true);
    auto qg = q.clone().requires_grad_(), kg = k.clone().requires_grad_(),
         vg = v.clone().requires_grad_();
    auto go = torch::randn({N, H, L, E});
    for (bool causal : {false, true}) {
      const double flops = (causal ? 0.5 : 1.0) * fwd_flops * 3.5;
      const double t = time_median(
          [&] {
            auto out = fastattn::full_attention(qg, kg, vg, std::nullopt, std::nullopt, causal);
            out.backward(go);
          },
          3);
      std::printf("%-44s %9.2f ms %8.1f GFLOP/s\n",
                  causal ? "fused forward+backward L=4096 causal" : "fused forward+backward L=4096",
                  t * 1e3, flops / t / 1e9);
    }
  }
  {
    const double t = time_median([&] { fastattn::reference::full_attention(q, k, v); }, 3);
    std::printf("%-44s %9.2f ms %8.1f GFLOP/s\n", "reference (materialised) forward L=4096",
                t * 1e3, fwd_flops / t / 1e9);
  }
  if (!skip_long) {
    auto ql = torch::randn({1, H, long_len, E}), kl = torch::randn({1, H, long_len, E}),
         vl = torch::randn({1, H, long_len, E});
    const double rss0 = peak_rss_mib();
    const double t0 = now_s();
    auto out = fastattn::full_attention(ql, kl, vl, std::nullopt, std::nullopt, true);
    const double t = now_s() - t0;
    const double flops = 0.5 * 4.0 * H * double(long_len) * long_len * E;
    std::printf("%-44s %9.2f ms %8.1f GFLOP/s\n",
                ("fused forward L=" + std::to_string(long_len) + " causal").c_str(), t * 1e3,
                flops / t / 1e9);
    const double inputs_mib = 4.0 * H * long_len * E * 4 / (1 << 20);  // q, k, v, out
    std::printf(
        "peak RSS %.0f MiB before the long call, %.0f MiB after; inputs+output %.0f MiB; "
        "one L×L float matrix would be %.0f MiB per head\n",
        rss0, peak_rss_mib(), inputs_mib, double(long_len) * long_len * 4 / (1 << 20));
  }
  return 0;
}
