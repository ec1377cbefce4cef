// Benchmark of ClusterFormer (Wang et al. 2022) against the fused full
// attention, reformer (4 rounds, chunk 32) and improved-clustered attention.
//
//   build/bench_clusterformer [--threads T] [--max-len L] [--full-max-len L] [--reps R]
//
// N=1, H=8, E=M=64, float32, S = L. For L = 1024, 2048, ..., max-len (default
// 16384): `clusterformer` with k = round(sqrt(L)) clusters (its clustering
// losses included in the backward), `full` (fused; up to full-max-len,
// default 16384), `reformer` (rounds=4) and `improved-clustered` (clusters=100,
// topk=32): median forward and forward+backward time, and the peak resident
// memory added by a forward+backward (VmHWM after the case minus VmRSS before it; the peak is
// reset per case through /proc/self/clear_refs).
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>

#include "bench_util.h"
#include "fastattn/attention.h"
#include "fastattn/registry.h"

using fastattn::bench::time_median;

namespace {

double status_mib(const char* field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const size_t n = std::strlen(field);
  while (std::getline(f, line))
    if (line.compare(0, n, field) == 0) return std::stod(line.substr(n)) / 1024.0;
  return -1;
}

// Resets VmHWM to the current RSS (Linux >= 4.0); false where not allowed.
bool reset_peak() {
  std::ofstream f("/proc/self/clear_refs");
  if (!f) return false;
  f << "5";
  return static_cast<bool>(f);
}

}  // namespace

int main(int argc, char** argv) {
  int threads = static_cast<int>(std::thread::hardware_concurrency());
  int64_t max_len = 16384, full_max_len = 16384;
  int reps = 3;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--threads") && i + 1 < argc)
      threads = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--max-len") && i + 1 < argc)
      max_len = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--full-max-len") && i + 1 < argc)
      full_max_len = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc)
      reps = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: %s [--threads T] [--max-len L] [--full-max-len L] [--reps R]\n",
                   argv[0]);
      return 2;
    }
  }
  at::set_num_threads(threads);
  std::printf(
      "threads: %d; N=1 H=8 E=M=64 float32; clusterformer k=round(sqrt(L)); improved-clustered "
      "clusters=100 topk=32\n",
      at::get_num_threads());
  std::printf("%-20s %6s %5s %10s %12s %12s %14s\n", "type", "L", "k", "fwd ms", "fwd+bwd ms",
              "f+b ms/1k", "f+b peak MiB");
  const int64_t H = 8, E = 64;
  fastattn::AttentionDims dims;
  dims.heads = H;
  dims.query_dim = E;
  dims.value_dim = E;
  for (int64_t L = 1024; L <= max_len; L *= 2) {
    torch::manual_seed(0);
    auto q = torch::randn({1, H, L, E}), k = torch::randn({1, H, L, E}),
         v = torch::randn({1, H, L, E}), go = torch::randn({1, H, L, E});
    const int64_t kc = std::llround(std::sqrt(static_cast<double>(L)));
    for (const char* type : {"clusterformer", "full", "reformer", "improved-clustered"}) {
      const std::string t = type;
      if (t == "full" && L > full_max_len) continue;
      fastattn::ParamMap p;
      if (t == "clusterformer") p = {{"clusters", kc}, {"seed", int64_t(0)}};
      if (t == "improved-clustered")
        p = {{"clusters", int64_t(100)}, {"topk", int64_t(32)}, {"seed", int64_t(0)}};
      if (t == "reformer") p = {{"rounds", int64_t(4)}, {"seed", int64_t(0)}};
      auto attn = fastattn::make_attention(type, p, dims);
      const double tf = time_median(
          [&] {
            torch::NoGradGuard no_grad;
            attn->forward(q, k, v, fastattn::Mask());
            attn->take_auxiliary_loss();
          },
          reps);
      auto qg = q.clone().requires_grad_(), kg = k.clone().requires_grad_(),
           vg = v.clone().requires_grad_();
      auto fwd_bwd = [&] {
        auto out = attn->forward(qg, kg, vg, fastattn::Mask());
        auto aux = attn->take_auxiliary_loss();
        if (aux.defined()) {
          torch::autograd::backward({out, aux}, {go, torch::ones_like(aux)});
        } else {
          out.backward(go);
        }
      };
      fwd_bwd();  // warm-up (allocations, parameter gradients)
      const double rss = status_mib("VmRSS:");
      const bool reset = reset_peak();
      fwd_bwd();
      const double peak = reset ? status_mib("VmHWM:") - rss : -1;
      const double tb = time_median(fwd_bwd, reps);
      std::printf("%-20s %6lld %5lld %10.2f %12.2f %12.3f ", type, (long long)L,
                  (long long)(t == "clusterformer" ? kc : 0), tf * 1e3, tb * 1e3,
                  tb * 1e3 / (L / 1024.0));
      if (peak >= 0)
        std::printf("%14.1f\n", peak);
      else
        std::printf("%14s\n", "-");
      std::fflush(stdout);
    }
  }
  return 0;
}
