// Benchmark of clustered and improved-clustered attention (Vyas et al. 2020).
//
//   build/bench_clustered_attention [--threads T] [--max-len L] [--reps R]
//
// N=1, H=8, E=M=64, clusters=100, bits=63, iterations=10, topk=32, float32.
// For L = 1024, 2048, ..., max-len (default 16384; S = L): forward and
// forward+backward of `clustered` and `improved-clustered` (median ms and ms
// per 1k tokens), the hashing and clustering ops alone, and, where L <= 4096,
// the max absolute error against the fused full attention.
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "bench_util.h"
#include "fastattn/ops.h"
#include "fastattn/registry.h"

using fastattn::bench::time_median;

int main(int argc, char** argv) {
  int threads = static_cast<int>(std::thread::hardware_concurrency());
  int64_t max_len = 16384;
  int reps = 3;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--threads") && i + 1 < argc)
      threads = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--max-len") && i + 1 < argc)
      max_len = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc)
      reps = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: %s [--threads T] [--max-len L] [--reps R]\n", argv[0]);
      return 2;
    }
  }
  at::set_num_threads(threads);
  std::printf("threads: %d; N=1 H=8 E=M=64 clusters=100 bits=63 iterations=10 topk=32 float32\n",
              at::get_num_threads());
  std::printf("%-20s %6s %10s %10s %12s %12s %10s\n", "type", "L", "fwd ms", "fwd ms/1k",
              "fwd+bwd ms", "f+b ms/1k", "max err");
  const int64_t H = 8, E = 64;
  for (int64_t L = 1024; L <= max_len; L *= 2) {
    torch::manual_seed(0);
    auto q = torch::randn({1, H, L, E}), k = torch::randn({1, H, L, E}),
         v = torch::randn({1, H, L, E});
    {
      torch::NoGradGuard no_grad;
      auto planes = torch::randn({63, E + 1});
      torch::Tensor codes;
      const double th = time_median([&] { codes = fastattn::hash_queries(q, planes); }, reps);
      const double tc =
          time_median([&] { fastattn::cluster_codes(codes, std::nullopt, 100, 10, 1); }, reps);
      std::printf("%-20s %6lld %10.2f %10.3f\n", "  hash_queries", (long long)L, th * 1e3,
                  th * 1e3 / (L / 1024.0));
      std::printf("%-20s %6lld %10.2f %10.3f\n", "  cluster_codes", (long long)L, tc * 1e3,
                  tc * 1e3 / (L / 1024.0));
    }
    torch::Tensor full;
    if (L <= 4096) {
      torch::NoGradGuard no_grad;
      full = fastattn::full_attention(q, k, v);
    }
    for (const char* type : {"clustered", "improved-clustered"}) {
      fastattn::ParamMap p{{"clusters", int64_t(100)},
                           {"bits", int64_t(63)},
                           {"iterations", int64_t(10)},
                           {"seed", int64_t(0)}};
      if (std::string(type) == "improved-clustered") p["topk"] = int64_t(32);
      auto attn = fastattn::make_attention(type, p);
      attn->eval();
      torch::Tensor out;
      const double tf = time_median(
          [&] {
            torch::NoGradGuard no_grad;
            out = attn->forward(q, k, v, fastattn::Mask());
          },
          reps);
      auto qg = q.clone().requires_grad_(), kg = k.clone().requires_grad_(),
           vg = v.clone().requires_grad_();
      auto go = torch::randn({1, H, L, E});
      const double tb =
          time_median([&] { attn->forward(qg, kg, vg, fastattn::Mask()).backward(go); }, reps);
      const double err = full.defined() ? (out - full).abs().max().item<double>() : -1;
      std::printf("%-20s %6lld %10.2f %10.3f %12.2f %12.3f ", type, (long long)L, tf * 1e3,
                  tf * 1e3 / (L / 1024.0), tb * 1e3, tb * 1e3 / (L / 1024.0));
      if (err >= 0)
        std::printf("%10.4f\n", err);
      else
        std::printf("%10s\n", "-");
    }
    if (full.defined()) {
      torch::NoGradGuard no_grad;
      const double t = time_median([&] { fastattn::full_attention(q, k, v); }, reps);
      std::printf("%-20s %6lld %10.2f %10.3f\n", "  full (fused)", (long long)L, t * 1e3,
                  t * 1e3 / (L / 1024.0));
    }
  }
  return 0;
}
