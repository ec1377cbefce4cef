// Benchmark of the block-sparse attention types: `local`, `sparse-strided`,
// `sparse-fixed` (Child et al. 2019).
//
//   build/bench_sparse_attention [--threads T] [--min-len L0] [--max-len L1] [--reps R]
//                                [--no-backward]
//
// N=1, H=8, E=M=64, float32, S = L, for L = L0, 2·L0, ..., L1 (default 1024 ...
// 65536). Rows, each causal and bidirectional:
//   local window=128;
//   sparse-strided stride=128 and sparse-fixed stride=128 summary=8 (merged),
//     each followed by `local` with the same mean number of attended keys per
//     query ("local same keys") and the ratio of the two forward times
//     (target: <= 2);
//   sparse-strided and sparse-fixed (summary 8) with the default stride
//     round(sqrt(L)) (cost should grow like L·sqrt(L): ms/1k tokens like
//     sqrt(L)).
// Columns: keys/q (mean attended keys per query, measured through the
// operator's log-sum-exp with zero queries), forward ms (median), ms per 1k
// tokens, forward+backward ms, and the max error against the dense masked
// reference where L <= 2048.
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "bench_util.h"
#include "fastattn/fastattn.h"

using fastattn::bench::time_median;

namespace {

// Mean number of kept keys per query of a pattern: with q = 0 every kept
// score is 0, so the operator's lse is log(count).
double keys_per_query(const std::string& pattern, const std::vector<int64_t>& params, bool causal,
                      int64_t H, int64_t L) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fastattn::block_sparse_attention_forward", "")
                       .typed<std::tuple<torch::Tensor, torch::Tensor>(
                           const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                           c10::string_view, c10::IntArrayRef, const c10::optional<torch::Tensor>&,
                           bool, double, double, int64_t)>();
  torch::NoGradGuard no_grad;
  auto z = torch::zeros({1, H, L, 1}, torch::kDouble);
  auto lse = std::get<1>(op.call(z, z, z, pattern, params, c10::nullopt, causal, 1.0, 0.0, 0));
  return lse.exp().mean().item<double>();
}

struct Timing {
  double fwd = 0, fb = -1, err = -1;
};

Timing run(const fastattn::AttentionPtr& attn, const torch::Tensor& q, const torch::Tensor& k,
           const torch::Tensor& v, bool causal, bool backward, int reps,
           const torch::Tensor& reference) {
  Timing t;
  const auto mask = causal ? fastattn::Mask::causal_mask() : fastattn::Mask();
  torch::Tensor out;
  t.fwd = time_median(
      [&] {
        torch::NoGradGuard no_grad;
        out = attn->forward(q, k, v, mask);
      },
      reps);
  if (reference.defined()) t.err = (out - reference).abs().max().item<double>();
  if (backward) {
    auto qg = q.clone().requires_grad_(), kg = k.clone().requires_grad_(),
         vg = v.clone().requires_grad_();
    auto go = torch::randn_like(q);
    t.fb = time_median([&] { attn->forward(qg, kg, vg, mask).backward(go); }, reps);
  }
  return t;
}

void print_row(const std::string& name, int64_t L, double keys, const Timing& t,
               double ratio = -1) {
  std::printf("%-34s %6lld %8.1f %10.2f %9.3f ", name.c_str(), (long long)L, keys, t.fwd * 1e3,
              t.fwd * 1e3 / (L / 1024.0));
  if (t.fb >= 0)
    std::printf("%11.2f ", t.fb * 1e3);
  else
    std::printf("%11s ", "-");
  if (t.err >= 0)
    std::printf("%9.1e ", t.err);
  else
    std::printf("%9s ", "-");
  if (ratio >= 0) std::printf("%6.2f", ratio);
  std::printf("\n");
}

}  // namespace

int main(int argc, char** argv) {
  int threads = static_cast<int>(std::thread::hardware_concurrency());
  int64_t min_len = 1024, max_len = 65536;
  int reps = 3;
  bool backward = true;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--threads") && i + 1 < argc)
      threads = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--min-len") && i + 1 < argc)
      min_len = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--max-len") && i + 1 < argc)
      max_len = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc)
      reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--no-backward"))
      backward = false;
    else {
      std::fprintf(stderr,
                   "usage: %s [--threads T] [--min-len L0] [--max-len L1] [--reps R] "
                   "[--no-backward]\n",
                   argv[0]);
      return 2;
    }
  }
  at::set_num_threads(threads);
  const int64_t H = 8, E = 64;
  std::printf("threads: %d; N=1 H=8 E=M=64 float32 S=L\n", at::get_num_threads());
  std::printf("%-34s %6s %8s %10s %9s %11s %9s %6s\n", "type", "L", "keys/q", "fwd ms", "ms/1k",
              "fwd+bwd ms", "max err", "ratio");
  using fastattn::make_attention;
  using fastattn::ParamMap;
  for (int64_t L = min_len; L <= max_len; L *= 2) {
    torch::manual_seed(0);
    auto q = torch::randn({1, H, L, E}), k = torch::randn({1, H, L, E}),
         v = torch::randn({1, H, L, E});
    const int64_t root = std::max<int64_t>(1, std::llround(std::sqrt(static_cast<double>(L))));
    for (bool causal : {true, false}) {
      const std::string tag = causal ? " causal" : " bidir";
      auto reference = [&](const std::string& pattern, const std::vector<int64_t>& params) {
        if (L > 2048) return torch::Tensor();
        torch::NoGradGuard no_grad;
        return fastattn::reference::block_sparse_attention(q, k, v, pattern, params, std::nullopt,
                                                           causal);
      };
      {
        auto attn = make_attention("local", {{"window", int64_t{128}}});
        print_row("local w=128" + tag, L, keys_per_query("local", {128}, causal, H, L),
                  run(attn, q, k, v, causal, backward, reps, reference("local", {128})));
      }
      struct Sparse {
        std::string type, label, pattern;
        std::vector<int64_t> params;
        ParamMap p;
        bool compare;
      };
      const std::vector<Sparse> cases = {
          {"sparse-strided",
           "sparse-strided l=128",
           "strided",
           {128, 0},
           {{"stride", int64_t{128}}},
           true},
          {"sparse-fixed",
           "sparse-fixed l=128 c=8",
           "fixed",
           {128, 8, 0, 0},
           {{"stride", int64_t{128}}, {"summary", int64_t{8}}},
           true},
          {"sparse-strided", "sparse-strided l=sqrt(L)", "strided", {root, 0}, {}, false},
          {"sparse-fixed",
           "sparse-fixed l=sqrt(L)",
           "fixed",
           {root, std::min<int64_t>(8, root), 0, 0},
           {},
           false}};
      for (const auto& c : cases) {
        const double keys = keys_per_query(c.pattern, c.params, causal, H, L);
        auto attn = make_attention(c.type, c.p);
        const Timing t = run(attn, q, k, v, causal, backward, reps, reference(c.pattern, c.params));
        print_row(c.label + tag, L, keys, t);
        if (!c.compare) continue;
        // local with the same mean number of attended keys per query.
        const int64_t w = std::max<int64_t>(1, std::llround(keys));
        auto local = make_attention("local", {{"window", w}});
        const Timing tl = run(local, q, k, v, causal, false, reps, torch::Tensor());
        print_row("  local same keys w=" + std::to_string(w) + tag, L,
                  keys_per_query("local", {w}, causal, H, L), tl, t.fwd / tl.fwd);
      }
    }
  }
  return 0;
}
