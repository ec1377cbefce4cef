// Benchmark of hard retrieval attention per decoding step, after Table 2 of
// Xu et al., "Learning Hard Retrieval Decoder Attention for Transformers".
//
//   build/bench_hard_retrieval [--threads T] [--lengths 64,128,...] [--inner R]
//                              [--decode-lengths 40,150,...] [--batch B]
//
// One query per head over a cache of t keys (N=1, H=8, E=M=64; t = 64 ...
// 4096 by default), the cost of the attention op alone (no projections),
// in microseconds per step:
//   compare    scores = q·K^T                    (both)
//   normalise  softmax(scores / sqrt(E))         (soft)   | argmax   argmax(scores) (hard)
//   attend     P·V (a matmul)                    (soft)   | index    V[argmax]      (hard, a
//   gather)
// The staged columns use plain ATen calls (as the paper's PyTorch
// measurement did); "fused" is one call of this library's operator:
// full_attention (online softmax) and hard_retrieval_attention (argmax +
// gather in one pass). Each figure is the median over 7 runs of R calls.
// Every length also checks that the staged and fused results agree.
// Default 1 thread: a decoding step of this size is too small to share.
//
// Second table: end-to-end greedy decoding with the encoder-decoder of the
// hard-retrieval experiment (scripts/experiments/hard_retrieval.sh: 2 + 2
// layers, 4 heads, d_model 64, batch 32, random weights) on sources of n
// symbols (n = 40 ... 600), decoding n + 1 steps through the decoder's
// recurrent twin (TransductionTask::greedy_decode, every step run): soft (full
// attention everywhere) against hard (decoder self- and cross-attention
// hard-retrieval), ms per step with and without the encoding (the encoder is
// full attention in both), medians of 3 passes.
// The shared work per step (projections, feed-forward, head) does not depend
// on n, the attention's does, so the speed-up grows with n.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "bench_util.h"
#include "fastattn/ops.h"
#include "fastattn/experiments/train.h"

using fastattn::bench::time_median;

namespace {

// Microseconds per call of f, median over 7 runs of `inner` calls.
template <typename F>
double us_per_call(F f, int inner) {
  return time_median(
             [&] {
               for (int r = 0; r < inner; ++r) f();
             },
             7) /
         inner * 1e6;
}

std::vector<int64_t> parse_list(const char* s) {
  std::vector<int64_t> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(std::stoll(item));
  return out;
}

struct DecodeTiming {
  double ms_per_step;          // whole greedy decoding (encoding included) / steps
  double decoder_ms_per_step;  // the same without the encoding
};

// Greedy decoding (every step run) of a random encoder-decoder with
// `decoder_attention` as decoder self- and cross-attention, on `batch`
// sources of n symbols.
DecodeTiming time_decoding(const std::string& decoder_attention, int64_t n, int64_t batch) {
  fastattn::train::TransductionTaskOptions o;
  o.min_length = o.max_length = n;
  const fastattn::train::TransductionTask task(o);
  const nlohmann::json part = {{"layers", 2}, {"heads", 4}, {"d_model", 64}, {"dropout", 0.0}};
  nlohmann::json decoder = part;
  decoder["self_attention"] = decoder["cross_attention"] = {{"type", decoder_attention}};
  torch::manual_seed(0);
  auto module = task.make_model({{"encoder", part}, {"decoder", decoder}});
  auto& model = dynamic_cast<fastattn::train::Seq2SeqImpl&>(*module);
  model.eval();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  const auto b = task.sample(batch, gen);
  const int64_t steps = n + 1;
  const double total = time_median(
      [&] {
        task.greedy_decode(model, b.at("source"), b.at("source_lengths"), steps, "step",
                           /*stop_at_end=*/false);
      },
      3);
  const double encode =
      time_median([&] { model.encode(b.at("source"), b.at("source_lengths")); }, 3);
  return {total / steps * 1e3, (total - encode) / steps * 1e3};
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 1;
  int inner = 200;
  std::vector<int64_t> lengths = {64, 128, 256, 512, 1024, 2048, 4096};
  std::vector<int64_t> decode_lengths = {40, 150, 300, 600};
  int64_t batch = 32;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--threads") && i + 1 < argc) {
      threads = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--lengths") && i + 1 < argc) {
      lengths = parse_list(argv[++i]);
    } else if (!std::strcmp(argv[i], "--inner") && i + 1 < argc) {
      inner = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--decode-lengths") && i + 1 < argc) {
      decode_lengths = parse_list(argv[++i]);
    } else if (!std::strcmp(argv[i], "--batch") && i + 1 < argc) {
      batch = std::atoll(argv[++i]);
    } else {
      std::fprintf(stderr,
                   "usage: %s [--threads T] [--lengths 64,128,...] [--inner R] "
                   "[--decode-lengths 40,150,...] [--batch B]\n",
                   argv[0]);
      return 2;
    }
  }
  at::set_num_threads(threads);
  torch::NoGradGuard no_grad;
  const int64_t N = 1, H = 8, E = 64, M = 64;
  const double scale = 1.0 / std::sqrt(static_cast<double>(E));
  std::printf("threads: %d, N=%lld H=%lld E=M=%lld, float32, us per decoding step\n",
              at::get_num_threads(), static_cast<long long>(N), static_cast<long long>(H),
              static_cast<long long>(E));
  std::printf("%6s | %8s | %9s %8s %9s | %8s %8s %9s | %9s %9s | %s\n", "t", "compare", "softmax",
              "attend", "soft sum", "argmax", "index", "hard sum", "fused full", "fused hard",
              "check");
  bool all_ok = true;
  for (const int64_t t : lengths) {
    torch::manual_seed(t);
    auto q = torch::randn({N, H, 1, E}), K = torch::randn({N, H, t, E}),
         V = torch::randn({N, H, t, M});
    auto Kt = K.transpose(-1, -2).contiguous();  // (N, H, E, t): a cache kept transposed
    // Stage inputs, computed once so that each stage is timed alone.
    auto scores = torch::matmul(q, Kt);               // (N, H, 1, t)
    auto probs = torch::softmax(scores * scale, -1);  // (N, H, 1, t)
    auto idx = scores.argmax(-1, /*keepdim=*/true);   // (N, H, 1, 1)
    auto gather_idx = idx.expand({N, H, 1, M});

    const double compare = us_per_call([&] { torch::matmul(q, Kt); }, inner);
    const double softmax = us_per_call([&] { torch::softmax(scores * scale, -1); }, inner);
    const double attend = us_per_call([&] { torch::matmul(probs, V); }, inner);
    const double argmax = us_per_call([&] { scores.argmax(-1, true); }, inner);
    const double index = us_per_call([&] { V.gather(2, gather_idx); }, inner);
    const double fused_full = us_per_call([&] { fastattn::full_attention(q, K, V); }, inner);
    const double fused_hard =
        us_per_call([&] { fastattn::hard_retrieval_attention(q, K, V); }, inner);

    // The staged and fused forms must agree.
    auto [hard_out, hard_index] = fastattn::hard_retrieval_attention(q, K, V);
    const bool ok =
        torch::equal(hard_index, idx.squeeze(-1)) &&
        torch::equal(hard_out, V.gather(2, gather_idx)) &&
        torch::allclose(fastattn::full_attention(q, K, V), torch::matmul(probs, V), 1e-4, 1e-5);
    all_ok = all_ok && ok;
    std::printf("%6lld | %8.2f | %9.2f %8.2f %9.2f | %8.2f %8.2f %9.2f | %9.2f %9.2f | %s\n",
                static_cast<long long>(t), compare, softmax, attend, compare + softmax + attend,
                argmax, index, compare + argmax + index, fused_full, fused_hard,
                ok ? "ok" : "MISMATCH");
  }

  std::printf(
      "\ngreedy decoding, encoder-decoder 2+2 layers, 4 heads, d_model 64, batch %lld, "
      "n + 1 steps, ms per step\n",
      static_cast<long long>(batch));
  std::printf("%6s | %9s %9s %8s | %12s %12s %8s\n", "n", "soft", "hard", "speed-up",
              "soft decoder", "hard decoder", "speed-up");
  for (const int64_t n : decode_lengths) {
    const auto soft = time_decoding("full", n, batch);
    const auto hard = time_decoding("hard-retrieval", n, batch);
    std::printf("%6lld | %9.3f %9.3f %7.2fx | %12.3f %12.3f %7.2fx\n", static_cast<long long>(n),
                soft.ms_per_step, hard.ms_per_step, soft.ms_per_step / hard.ms_per_step,
                soft.decoder_ms_per_step, hard.decoder_ms_per_step,
                soft.decoder_ms_per_step / hard.decoder_ms_per_step);
  }
  return all_ok ? 0 : 1;
}
