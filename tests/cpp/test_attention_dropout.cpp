// Attention dropout fused in the full-attention kernels (issue 64): the keep
// mask of a counter-based generator (kernels/common/dropout.h), regenerated
// by the backward. Against the float64 reference given the same mask
// (reference::attention_dropout_keep), forward and gradients; the drop rate
// and scale; reproducibility under a seed and torch::manual_seed; masks
// independent across heads and batch items; p = 0 bit-identical to no
// dropout; the `full` module in training.
//
//   build/fastattn_tests --gtest_filter='AttentionDropout*'
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "expect_error.h"
#include "fastattn/clustered.h"
#include "fastattn/mask.h"
#include "fastattn/ops.h"
#include "fastattn/registry.h"

namespace fastattn {
namespace {

using torch::Tensor;

double max_err(const Tensor& a, const Tensor& b) { return (a - b).abs().max().item<double>(); }

struct Case {
  int64_t L, S;
  bool causal, lengths, mask;
};

using QKVFn = std::function<Tensor(const Tensor&, const Tensor&, const Tensor&)>;

// Random q (N, H, L, E), k, v (N, H, S, E | M) of dtype: `kernel`'s output
// and gradients (at a random output gradient) against `reference`'s on the
// same inputs in float64. Returns the reference's output and inputs.
std::pair<Tensor, std::vector<Tensor>> expect_matches_reference(
    const std::string& what, torch::ScalarType dtype, int64_t N, int64_t H, int64_t L, int64_t S,
    int64_t E, int64_t M, const QKVFn& kernel, const QKVFn& reference) {
  auto q = torch::randn({N, H, L, E}, dtype).requires_grad_(true);
  auto k = torch::randn({N, H, S, E}, dtype).requires_grad_(true);
  auto v = torch::randn({N, H, S, M}, dtype).requires_grad_(true);
  auto g = torch::randn({N, H, L, M}, dtype);
  auto out = kernel(q, k, v);
  auto grads = torch::autograd::grad({out}, {q, k, v}, {g});
  auto x = std::vector<Tensor>{q.detach().to(torch::kDouble).requires_grad_(true),
                               k.detach().to(torch::kDouble).requires_grad_(true),
                               v.detach().to(torch::kDouble).requires_grad_(true)};
  auto ref = reference(x[0], x[1], x[2]);
  auto ref_grads = torch::autograd::grad({ref}, x, {g.to(torch::kDouble)});
  const double tol = dtype == torch::kDouble ? 1e-12 : 2e-5;
  const std::string where = std::string(c10::toString(dtype)) + " " + what;
  EXPECT_LE(max_err(out.to(torch::kDouble), ref), tol) << where;
  for (int i = 0; i < 3; ++i)
    EXPECT_LE(max_err(grads[i].to(torch::kDouble), ref_grads[i]), 10 * tol)
        << where << " grad " << i;
  return {ref.detach(), x};
}

TEST(AttentionDropout, EqualsTheReferenceWithTheSameMask) {
  // Shapes past one query tile (192) and one key tile (128), a single query
  // (its own path), L != S, masks and rows without keys; float64 and float32.
  const std::vector<Case> cases = {{7, 9, false, false, false},    {7, 9, true, true, false},
                                   {1, 40, false, true, false},    {200, 150, false, false, true},
                                   {150, 260, true, false, false}, {9, 5, true, false, false}};
  const double p = 0.3, temp = 0.4;
  const int64_t seed = 1234567;
  torch::manual_seed(3);
  for (auto dtype : {torch::kDouble, torch::kFloat}) {
    for (const auto& c : cases) {
      const int64_t N = 2, H = 3;
      std::optional<Tensor> lengths, mask;
      if (c.lengths) lengths = torch::tensor({c.S, int64_t{0}}, torch::kLong);
      if (c.mask) mask = torch::rand({c.L, c.S}) > 0.2;
      // The reference in float64 with the kernels' mask.
      const auto keep = reference::attention_dropout_keep(seed, p, N, H, c.L, c.S);
      const std::string what = "L" + std::to_string(c.L) + " S" + std::to_string(c.S) +
                               (c.causal ? " causal" : "") + (c.lengths ? " lengths" : "") +
                               (c.mask ? " mask" : "");
      expect_matches_reference(
          what, dtype, N, H, c.L, c.S, 8, 5,
          [&](const Tensor& q, const Tensor& k, const Tensor& v) {
            return full_attention(q, k, v, mask, lengths, c.causal, temp, p, seed);
          },
          [&](const Tensor& q, const Tensor& k, const Tensor& v) {
            return reference::full_attention(q, k, v, mask, lengths, c.causal, temp, keep);
          });
    }
  }
}

TEST(AttentionDropout, DropRateAndScale) {
  // q = 0: every weight is 1/S, so out = V's rows weighted by keep/(1-p)/S;
  // with V the identity, out[i][j] = keep_ij / ((1 - p) S).
  const int64_t N = 2, H = 4, L = 256, S = 256;
  for (double p : {0.1, 0.5, 0.9}) {
    auto q = torch::zeros({N, H, L, 8}, torch::kDouble),
         k = torch::randn({N, H, S, 8}, torch::kDouble);
    auto v = torch::eye(S, torch::kDouble).expand({N, H, S, S});
    auto out = full_attention(q, k, v, std::nullopt, std::nullopt, false, 1.0, p, 99);
    const double value = 1.0 / ((1.0 - p) * S);
    auto kept = out.gt(0);
    // Every weight is 0 or exactly 1/((1-p) S).
    EXPECT_LE(max_err(out.masked_select(kept), torch::full({1}, value, torch::kDouble)), 1e-15);
    const double rate = kept.to(torch::kDouble).mean().item<double>();
    // N·H·L·S = 524288 draws: the rate within 5 standard deviations.
    const double sd = std::sqrt(p * (1 - p) / static_cast<double>(kept.numel()));
    EXPECT_NEAR(rate, 1 - p, 5 * sd) << "p = " << p;
  }
}

TEST(AttentionDropout, SeedsHeadsAndBatchItems) {
  const int64_t N = 2, H = 2, L = 64, S = 64;
  const double p = 0.5;
  auto q = torch::zeros({N, H, L, 4}, torch::kDouble),
       k = torch::randn({N, H, S, 4}, torch::kDouble);
  auto v = torch::eye(S, torch::kDouble).expand({N, H, S, S}).contiguous();
  auto run = [&](std::optional<int64_t> seed) {
    return full_attention(q, k, v, std::nullopt, std::nullopt, false, 1.0, p, seed).gt(0);
  };
  // The same seed, the same mask; another seed, another mask.
  EXPECT_TRUE(torch::equal(run(5), run(5)));
  EXPECT_FALSE(torch::equal(run(5), run(6)));
  // Without a seed: drawn from torch's generator, so manual_seed reproduces it.
  torch::manual_seed(11);
  auto a = run(std::nullopt);
  torch::manual_seed(11);
  EXPECT_TRUE(torch::equal(a, run(std::nullopt)));
  EXPECT_FALSE(torch::equal(a, run(std::nullopt)));
  // Heads and batch items draw independent masks: they agree on about
  // p^2 + (1-p)^2 = 1/2 of the weights, not all.
  auto m = run(7).to(torch::kDouble);
  for (auto [x, y] :
       std::vector<std::pair<Tensor, Tensor>>{{m[0][0], m[0][1]}, {m[0][0], m[1][0]}}) {
    const double agree = x.eq(y).to(torch::kDouble).mean().item<double>();
    EXPECT_NEAR(agree, 0.5, 0.05);
  }
  // Rows of one head: independent too.
  const double rows = m[0][0][0].eq(m[0][0][1]).to(torch::kDouble).mean().item<double>();
  EXPECT_NEAR(rows, 0.5, 0.25);
}

TEST(AttentionDropout, ZeroIsBitIdenticalToNoDropout) {
  torch::manual_seed(2);
  auto q = torch::randn({2, 2, 30, 8}), k = torch::randn({2, 2, 40, 8}),
       v = torch::randn({2, 2, 40, 8});
  EXPECT_TRUE(torch::equal(full_attention(q, k, v, std::nullopt, std::nullopt, true, 0.5, 0.0, 3),
                           full_attention(q, k, v, std::nullopt, std::nullopt, true, 0.5)));
}

TEST(AttentionDropout, BadProbabilitiesNameTheArgument) {
  auto q = torch::randn({1, 1, 3, 4});
  for (double p : {-0.1, 1.0, 2.0, std::nan("")})
    EXPECT_ERROR_CONTAINS(full_attention(q, q, q, std::nullopt, std::nullopt, false, 1.0, p),
                          "dropout_p must be in [0, 1)");
}

TEST(AttentionDropout, FullModuleTrainsWithTheFusedDropout) {
  // In training the `full` type drops with the operator's fused dropout (the
  // seed drawn from torch's generator); in evaluation it never drops.
  const int64_t N = 2, H = 2, L = 6, S = 7;
  torch::manual_seed(1);
  auto q = torch::randn({N, H, L, 4}, torch::kDouble),
       k = torch::randn({N, H, S, 4}, torch::kDouble),
       v = torch::randn({N, H, S, 3}, torch::kDouble);
  auto attn = make_attention("full", {{"attention_dropout", 0.25}, {"softmax_temp", 0.5}});
  attn->train();
  torch::manual_seed(7);
  auto out = attn->forward(q, k, v, Mask().with_causal(true));
  torch::manual_seed(7);
  const int64_t seed =
      torch::randint(0, int64_t{1} << 62, {1}, torch::TensorOptions().dtype(torch::kLong))
          .item<int64_t>();
  auto keep = reference::attention_dropout_keep(seed, 0.25, N, H, L, S);
  auto ref = reference::full_attention(q, k, v, std::nullopt, std::nullopt, true, 0.5, keep);
  EXPECT_LE(max_err(out, ref), 1e-12);
  attn->eval();
  EXPECT_LE(max_err(attn->forward(q, k, v, Mask().with_causal(true)),
                    reference::full_attention(q, k, v, std::nullopt, std::nullopt, true, 0.5)),
            1e-12);
}

// Block-sparse attention (local, sparse-strided, sparse-fixed): the kept
// weights drop as full attention's do, by the original query and key
// indices, in every part and key order (residue-major, summaries), so the
// reference is the dense masked softmax given the same mask.
struct SparseCase {
  std::string pattern;
  std::vector<int64_t> params;
  int64_t L, S;
  bool causal, lengths;
};

TEST(AttentionDropout, BlockSparseEqualsTheReferenceWithTheSameMask) {
  const std::vector<SparseCase> cases = {
      {"local", {5}, 40, 40, false, false},
      {"local", {64}, 300, 300, true, true},         // several query and key tiles
      {"strided", {6, 0}, 50, 50, true, false},      // merged: band + residues
      {"strided", {5, 3}, 41, 41, false, true},      // split heads
      {"fixed", {8, 2, 0, 1}, 70, 70, true, false},  // per-head summaries
      {"fixed", {6, 3, 2, 0}, 37, 29, false, true},  // summaries only, L != S
  };
  const double p = 0.3, temp = 0.45;
  const int64_t seed = 424242;
  torch::manual_seed(5);
  for (auto dtype : {torch::kDouble, torch::kFloat}) {
    for (const auto& c : cases) {
      const int64_t N = 2, H = 4;
      std::optional<Tensor> lengths;
      if (c.lengths) lengths = torch::tensor({c.S, c.S / 2}, torch::kLong);
      const auto keep = reference::attention_dropout_keep(seed, p, N, H, c.L, c.S);
      const std::string what = c.pattern + " L" + std::to_string(c.L) +
                               (c.causal ? " causal" : "") + (c.lengths ? " lengths" : "");
      auto [ref, x] = expect_matches_reference(
          what, dtype, N, H, c.L, c.S, 8, 6,
          [&](const Tensor& q, const Tensor& k, const Tensor& v) {
            return block_sparse_attention(q, k, v, c.pattern, c.params, lengths, c.causal, temp, p,
                                          seed);
          },
          [&](const Tensor& q, const Tensor& k, const Tensor& v) {
            return reference::block_sparse_attention(q, k, v, c.pattern, c.params, lengths,
                                                     c.causal, temp, keep);
          });
      // Dropout changed the output (the test would pass without it otherwise).
      auto undropped = reference::block_sparse_attention(x[0], x[1], x[2], c.pattern, c.params,
                                                         lengths, c.causal, temp);
      EXPECT_GT(max_err(ref, undropped), 1e-3) << what;
    }
  }
}

TEST(AttentionDropout, SparseTypesDropInTrainingOnly) {
  const int64_t N = 1, H = 2, L = 33;
  torch::manual_seed(4);
  auto q = torch::randn({N, H, L, 4}, torch::kDouble),
       k = torch::randn({N, H, L, 4}, torch::kDouble),
       v = torch::randn({N, H, L, 3}, torch::kDouble);
  for (const std::string type : {"local", "sparse-strided", "sparse-fixed"}) {
    auto attn = make_attention(type, {{"attention_dropout", 0.4}});
    attn->eval();
    const auto eval_out = attn->forward(q, k, v, Mask().with_causal(true));
    auto plain = make_attention(type, {});
    EXPECT_LE(max_err(eval_out, plain->forward(q, k, v, Mask().with_causal(true))), 0) << type;
    attn->train();
    torch::manual_seed(9);
    auto a = attn->forward(q, k, v, Mask().with_causal(true));
    torch::manual_seed(9);
    EXPECT_TRUE(torch::equal(a, attn->forward(q, k, v, Mask().with_causal(true)))) << type;
    EXPECT_GT(max_err(a, eval_out), 1e-2) << type;
    EXPECT_ERROR_CONTAINS(make_attention(type, {{"attention_dropout", 1.0}}), "attention_dropout");
  }
}

// Improved clustered attention: the members' top-k weights drop by the query
// rows' mask, the centroid's weights (its output and so its rest) by the
// centroid rows' (the seed's second stream); the masses stay undropped. The
// float64 reference composes that densely from the same masks.
Tensor improved_clustered_reference(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const QueryClusters& c, int64_t topk,
                                    const std::optional<Tensor>& lengths, double temp,
                                    const Tensor& keep_q, const Tensor& keep_c) {
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), S = k.size(2), C = c.counts.size(2);
  const auto a = c.assignments;
  auto member = torch::one_hot(a.clamp_min(0), C).to(torch::kDouble) *
                a.ge(0).unsqueeze(-1).to(torch::kDouble);  // (N, H, L, C)
  auto centroids = torch::matmul(member.transpose(-1, -2), q) /
                   c.counts.clamp_min(1).to(torch::kDouble).unsqueeze(-1);  // (N, H, C, E)
  auto valid = torch::ones({N, 1, 1, S}, torch::kBool);
  if (lengths) valid = torch::arange(S).view({1, 1, 1, S}).lt(lengths->view({N, 1, 1, 1}));
  const double inf = std::numeric_limits<double>::infinity();
  auto sc = (torch::matmul(centroids, k.transpose(-1, -2)) * temp).masked_fill(~valid, -inf);
  auto probs_c = torch::softmax(sc, -1);
  auto top = torch::zeros({N, H, C, S}, torch::kDouble)
                 .scatter(-1, std::get<1>(sc.detach().topk(topk, -1)), 1.0);
  auto mass = (probs_c * top).sum(-1, /*keepdim=*/true);                       // (N, H, C, 1)
  auto rest = torch::matmul(probs_c * keep_c * (1 - top), v);                  // (N, H, C, M)
  auto per_query = [&](const Tensor& x) { return torch::matmul(member, x); };  // zeros: padding
  auto top_q = per_query(top).gt(0.5) & valid;                                 // (N, H, L, S)
  auto sq = (torch::matmul(q, k.transpose(-1, -2)) * temp).masked_fill(~top_q, -inf);
  auto p_q = torch::softmax(sq, -1).nan_to_num(0.0);  // padded queries: no key
  return torch::matmul(p_q * keep_q, v) * per_query(mass) + per_query(rest);
}

TEST(AttentionDropout, ImprovedClusteredEqualsTheReferenceWithTheSameMasks) {
  const int64_t N = 2, H = 2, L = 150, S = 40, E = 8, M = 5, C = 4, topk = 6;
  const double p = 0.3, temp = 0.5;
  for (bool with_lengths : {false, true}) {
    torch::manual_seed(12);
    auto q = torch::randn({N, H, L, E}, torch::kDouble).requires_grad_(true);
    auto k = torch::randn({N, H, S, E}, torch::kDouble).requires_grad_(true);
    auto v = torch::randn({N, H, S, M}, torch::kDouble).requires_grad_(true);
    auto g = torch::randn({N, H, L, M}, torch::kDouble);
    QueryClusters c;
    c.assignments = torch::randint(0, C, {N, H, L}, torch::kLong);
    c.assignments.narrow(2, L - 5, 5).fill_(-1);  // padded queries
    c.counts =
        torch::one_hot(c.assignments.clamp_min(0), C).mul(c.assignments.ge(0).unsqueeze(-1)).sum(2);
    std::optional<Tensor> lengths;
    if (with_lengths) lengths = torch::tensor({S, S / 2}, torch::kLong);
    torch::manual_seed(21);
    auto out = improved_clustered_attention(q, k, v, c, topk, lengths, temp, p);
    auto grads = torch::autograd::grad({out}, {q, k, v}, {g});
    torch::manual_seed(21);  // the seed the operator drew
    const int64_t seed =
        torch::randint(0, int64_t{1} << 62, {1}, torch::TensorOptions().dtype(torch::kLong))
            .item<int64_t>();
    const int64_t centroid_seed =
        static_cast<int64_t>(static_cast<uint64_t>(seed) ^ 0xa0761d6478bd642full);
    auto keep_q = reference::attention_dropout_keep(seed, p, N, H, L, S);
    auto keep_c = reference::attention_dropout_keep(centroid_seed, p, N, H, C, S);
    auto x = std::vector<Tensor>{q.detach().requires_grad_(true), k.detach().requires_grad_(true),
                                 v.detach().requires_grad_(true)};
    auto ref =
        improved_clustered_reference(x[0], x[1], x[2], c, topk, lengths, temp, keep_q, keep_c);
    auto ref_grads = torch::autograd::grad({ref}, x, {g});
    const std::string what = with_lengths ? "key lengths" : "all keys";
    EXPECT_LE(max_err(out, ref), 1e-12) << what;
    for (int i = 0; i < 3; ++i)
      EXPECT_LE(max_err(grads[i], ref_grads[i]), 1e-11) << what << " grad " << i;
    auto ones = torch::ones_like(keep_q), ones_c = torch::ones_like(keep_c);
    auto undropped =
        improved_clustered_reference(x[0], x[1], x[2], c, topk, lengths, temp, ones, ones_c);
    EXPECT_GT(max_err(ref, undropped), 1e-2) << what;
    EXPECT_LE(max_err(improved_clustered_attention(q, k, v, c, topk, lengths, temp), undropped),
              1e-12)
        << what;
  }
}

// The per-cluster top-k kernel (exact-topk and causal-improved-clustered run
// it with one cluster per query; improved clustered's plain form with
// several members): query l's weights drop as full attention's row l.
TEST(AttentionDropout, ClusteredTopkEqualsTheReferenceWithTheSameMask) {
  const int64_t N = 2, H = 2, L = 20, S = 30, E = 8, M = 5, K = 6;
  const double p = 0.3, temp = 0.6;
  const int64_t seed = 99;
  for (const int64_t C : {L, int64_t{4}}) {
    torch::manual_seed(3);
    auto q = torch::randn({N, H, L, E}, torch::kDouble).requires_grad_(true);
    auto k = torch::randn({N, H, S, E}, torch::kDouble).requires_grad_(true);
    auto v = torch::randn({N, H, S, M}, torch::kDouble).requires_grad_(true);
    auto mass = (torch::rand({N, H, C}, torch::kDouble) + 0.5).requires_grad_(true);
    auto g = torch::randn({N, H, L, M}, torch::kDouble);
    auto idx = std::get<1>(torch::rand({N, H, C, S}).sort(-1)).narrow(-1, 0, K).contiguous();
    idx.select(2, 0).select(2, K - 1).fill_(-1);  // an empty slot
    auto a = C == L ? torch::arange(L).view({1, 1, L}).expand({N, H, L}).contiguous()
                    : torch::randint(0, C, {N, H, L}, torch::kLong);
    a.select(2, L - 1).fill_(-1);  // a padded query
    const auto lengths = torch::tensor({S, int64_t{20}}, torch::kLong);
    auto out = clustered_topk_attention(q, k, v, idx, mass, a, lengths, temp, p, seed);
    auto grads = torch::autograd::grad({out}, {q, k, v, mass}, {g});
    // The reference: each query's softmax over its cluster's kept keys, dropped
    // by the mask, times the cluster's mass.
    auto x =
        std::vector<Tensor>{q.detach().requires_grad_(true), k.detach().requires_grad_(true),
                            v.detach().requires_grad_(true), mass.detach().requires_grad_(true)};
    auto in_set = torch::zeros({N, H, C, S + 1}, torch::kDouble)
                      .scatter(-1, idx.clamp_min(-1).add(1), 1.0)
                      .narrow(-1, 1, S);  // slot -1 lands in column 0, cut off
    auto member = torch::one_hot(a.clamp_min(0), C).to(torch::kDouble) *
                  a.ge(0).unsqueeze(-1).to(torch::kDouble);  // (N, H, L, C)
    auto valid = torch::arange(S).view({1, 1, 1, S}).lt(lengths.view({N, 1, 1, 1}));
    auto keep = torch::matmul(member, in_set).gt(0.5) & valid;  // (N, H, L, S)
    auto scores = (torch::matmul(x[0], x[1].transpose(-1, -2)) * temp)
                      .masked_fill(~keep, -std::numeric_limits<double>::infinity());
    auto weights = torch::softmax(scores, -1).nan_to_num(0.0) *
                   reference::attention_dropout_keep(seed, p, N, H, L, S);
    auto ref = torch::matmul(weights, x[2]) * torch::matmul(member, x[3].unsqueeze(-1));
    auto ref_grads = torch::autograd::grad({ref}, x, {g});
    const std::string what = C == L ? "one query per cluster" : "clusters of several queries";
    EXPECT_LE(max_err(out, ref), 1e-12) << what;
    for (int i = 0; i < 4; ++i)
      EXPECT_LE(max_err(grads[i], ref_grads[i]), 1e-11) << what << " grad " << i;
    EXPECT_GT(max_err(out, clustered_topk_attention(q, k, v, idx, mass, a, lengths, temp)), 1e-2)
        << what;
  }
}

TEST(AttentionDropout, TopkTypesDropInTrainingOnly) {
  const int64_t N = 1, H = 2, L = 40;
  torch::manual_seed(4);
  auto q = torch::randn({N, H, L, 4}, torch::kDouble),
       k = torch::randn({N, H, L, 4}, torch::kDouble),
       v = torch::randn({N, H, L, 3}, torch::kDouble);
  const std::vector<std::pair<std::string, Mask>> types = {
      {"exact-topk", Mask()}, {"causal-improved-clustered", Mask().with_causal(true)}};
  for (const auto& [type, mask] : types) {
    // A fresh instance per call: a seeded clustering generator advances.
    auto run = [&, type = type, mask = mask](double p, bool training) {
      ParamMap params{{"attention_dropout", p}, {"topk", int64_t{8}}};
      if (type != "exact-topk") params["seed"] = int64_t{1};
      auto attn = make_attention(type, params);
      attn->train(training);
      return attn->forward(q, k, v, mask);
    };
    const auto plain = run(0.0, false);
    EXPECT_LE(max_err(run(0.4, false), plain), 0) << type;
    torch::manual_seed(9);
    auto a = run(0.4, true);
    torch::manual_seed(9);
    EXPECT_TRUE(torch::equal(a, run(0.4, true))) << type;
    EXPECT_GT(max_err(a, plain), 1e-2) << type;
  }
}

// Reformer: each (round, key) weight of a query drops on its own (the round's
// stream of the seed), as the softmax is over those pairs; the reference
// drops each round's share of a weight by that round's mask. Forward and
// gradients (q in both roles, v) against float64.
TEST(AttentionDropout, ReformerEqualsTheReferenceWithTheSameMasks) {
  struct ReformerCase {
    int64_t L, chunk, rounds, n_buckets;
    bool causal, lengths, mask_self;
  };
  const std::vector<ReformerCase> cases = {{40, 4, 3, 6, false, true, true},
                                           {70, 8, 2, 4, true, false, true},
                                           {33, 5, 1, 2, false, false, false},
                                           {130, 32, 4, 8, false, true, true}};
  const double p = 0.3, temp = 0.6;
  const int64_t seed = 777001, N = 2, H = 2, E = 6, M = 5;
  torch::manual_seed(6);
  for (auto dtype : {torch::kDouble, torch::kFloat}) {
    for (const auto& c : cases) {
      const std::string what = std::string(c10::toString(dtype)) + " L" + std::to_string(c.L) +
                               " R" + std::to_string(c.rounds) + (c.causal ? " causal" : "") +
                               (c.lengths ? " lengths" : "");
      auto q = torch::randn({N, H, c.L, E}, dtype).requires_grad_(true);
      auto v = torch::randn({N, H, c.L, M}, dtype).requires_grad_(true);
      auto g = torch::randn({N, H, c.L, M}, dtype);
      auto buckets = torch::randint(c.n_buckets, {N, H, c.rounds, c.L}, torch::kLong);
      std::optional<Tensor> lengths;
      if (c.lengths) lengths = torch::tensor({c.L, c.L / 3}, torch::kLong);
      auto out =
          reformer_attention(q, v, buckets, lengths, c.chunk, c.causal, c.mask_self, temp, p, seed);
      auto grads = torch::autograd::grad({out}, {q, v}, {g});
      auto qd = q.detach().to(torch::kDouble).requires_grad_(true);
      auto vd = v.detach().to(torch::kDouble).requires_grad_(true);
      auto ref = reference::reformer_attention(qd, vd, buckets, lengths, c.chunk, c.causal,
                                               c.mask_self, temp, std::make_pair(seed, p));
      auto ref_grads = torch::autograd::grad({ref}, {qd, vd}, {g.to(torch::kDouble)});
      const double tol = dtype == torch::kDouble ? 1e-12 : 2e-5;
      EXPECT_LE(max_err(out.to(torch::kDouble), ref), tol) << what;
      EXPECT_LE(max_err(grads[0].to(torch::kDouble), ref_grads[0]), 20 * tol) << what << " dq";
      EXPECT_LE(max_err(grads[1].to(torch::kDouble), ref_grads[1]), 20 * tol) << what << " dv";
      // Dropout changed the output.
      auto undropped = reference::reformer_attention(qd, vd, buckets, lengths, c.chunk, c.causal,
                                                     c.mask_self, temp);
      EXPECT_GT(max_err(ref, undropped), 1e-3) << what;
    }
  }
}

TEST(AttentionDropout, ReformerDropsInTrainingOnly) {
  const int64_t N = 1, H = 2, L = 48;
  torch::manual_seed(8);
  auto q = torch::randn({N, H, L, 4}, torch::kDouble),
       v = torch::randn({N, H, L, 3}, torch::kDouble);
  auto attn = make_attention("reformer", {{"attention_dropout", 0.4},
                                          {"seed", int64_t{3}},
                                          {"chunk_size", int64_t{8}},
                                          {"n_buckets", int64_t{4}}});
  auto plain = make_attention(
      "reformer", {{"seed", int64_t{3}}, {"chunk_size", int64_t{8}}, {"n_buckets", int64_t{4}}});
  attn->eval();
  EXPECT_LE(max_err(attn->forward(q, q, v, Mask()), plain->forward(q, q, v, Mask())), 0);
  attn->train();
  torch::manual_seed(9);
  auto a = attn->forward(q, q, v, Mask());
  EXPECT_GT(max_err(a, plain->forward(q, q, v, Mask())), 1e-2);
  EXPECT_ERROR_CONTAINS(make_attention("reformer", {{"attention_dropout", 1.0}}),
                        "attention_dropout");
}

}  // namespace
}  // namespace fastattn
