// Benchmark of Reformer LSH attention (Kitaev et al. 2020).
//
//   build/bench_reformer_attention [--threads T] [--max-len L] [--min-len L] [--reps R]
//                                  [--rounds R] [--causal]
//
// N=1, H=8, E=M=64, chunk_size=32, n_buckets=64, rounds=4 (default), float32.
// For L = min-len, 2·min-len, ..., max-len (defaults 1024 .. 65536): forward
// and forward+backward of the `reformer` type (median ms and ms per 1k
// tokens: flat across L means linear), the lsh_hash op alone, the peak RSS,
// and, where L <= 2048, the max absolute error of the op against its
// plain-ATen reference on the same buckets (head 0; a correctness check, not
// an approximation error). The peak RSS includes that reference (it
// materialises (R, L, L) per head): read memory growth from L >= 4096.
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstring>
#include <thread>

#include "bench_util.h"
#include "fastattn/ops.h"
#include "fastattn/reformer.h"
#include "fastattn/registry.h"

using fastattn::bench::time_median;

int main(int argc, char** argv) {
  int threads = static_cast<int>(std::thread::hardware_concurrency());
  int64_t min_len = 1024, max_len = 65536, rounds = 4;
  int reps = 3;
  bool causal = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--threads") && i + 1 < argc)
      threads = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--max-len") && i + 1 < argc)
      max_len = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--min-len") && i + 1 < argc)
      min_len = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc)
      reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--rounds") && i + 1 < argc)
      rounds = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--causal"))
      causal = true;
    else {
      std::fprintf(stderr,
                   "usage: %s [--threads T] [--min-len L] [--max-len L] [--reps R] [--rounds R] "
                   "[--causal]\n",
                   argv[0]);
      return 2;
    }
  }
  at::set_num_threads(threads);
  const int64_t H = 8, E = 64, chunk = 32, n_buckets = 64;
  std::printf("threads: %d; N=1 H=8 E=M=64 chunk_size=%lld n_buckets=%lld rounds=%lld %sfloat32\n",
              at::get_num_threads(), (long long)chunk, (long long)n_buckets, (long long)rounds,
              causal ? "causal " : "");
  std::printf("%-16s %6s %10s %10s %12s %12s %10s %10s\n", "what", "L", "fwd ms", "fwd ms/1k",
              "fwd+bwd ms", "f+b ms/1k", "rss MiB", "max err");
  const auto mask = fastattn::Mask().with_causal(causal);
  for (int64_t L = min_len; L <= max_len; L *= 2) {
    torch::manual_seed(0);
    auto q = torch::randn({1, H, L, E}), v = torch::randn({1, H, L, E});
    {
      torch::NoGradGuard no_grad;
      auto rot = torch::randn({rounds, E, n_buckets / 2});
      const double th = time_median([&] { fastattn::lsh_hash(q, rot); }, reps);
      std::printf("%-16s %6lld %10.2f %10.3f\n", "  lsh_hash", (long long)L, th * 1e3,
                  th * 1e3 / (L / 1024.0));
    }
    fastattn::ParamMap p{
        {"chunk_size", chunk}, {"n_buckets", n_buckets}, {"rounds", rounds}, {"seed", int64_t(0)}};
    auto attn = fastattn::make_attention("reformer", p);
    attn->eval();
    const double tf = time_median(
        [&] {
          torch::NoGradGuard no_grad;
          attn->forward(q, q, v, mask);
        },
        reps);
    auto qg = q.clone().requires_grad_(), vg = v.clone().requires_grad_();
    auto go = torch::randn({1, H, L, E});
    const double tb = time_median([&] { attn->forward(qg, qg, vg, mask).backward(go); }, reps);
    double err = -1;
    if (L <= 2048) {  // the reference holds (R, L, L) per head: check head 0 only
      torch::NoGradGuard no_grad;
      fastattn::ReformerOptions o;
      o.seed = 5;
      o.rounds = rounds;
      auto q0 = q.narrow(1, 0, 1), v0 = v.narrow(1, 0, 1);
      auto buckets = fastattn::ReformerAttention(o).hash(q0);
      auto out = fastattn::reformer_attention(q0, v0, buckets, std::nullopt, chunk, causal);
      auto ref = fastattn::reference::reformer_attention(
          q0.to(torch::kDouble), v0.to(torch::kDouble), buckets, std::nullopt, chunk, causal, true,
          std::nullopt);
      err = (out.to(torch::kDouble) - ref).abs().max().item<double>();
    }
    std::printf("%-16s %6lld %10.2f %10.3f %12.2f %12.3f %10.0f ", "reformer", (long long)L,
                tf * 1e3, tf * 1e3 / (L / 1024.0), tb * 1e3, tb * 1e3 / (L / 1024.0),
                fastattn::bench::peak_rss_mib());
    if (err >= 0)
      std::printf("%10.2e\n", err);
    else
      std::printf("%10s\n", "-");
    std::fflush(stdout);
  }
  return 0;
}
