// clustered and improved-clustered attention: the attention rows are built
// densely here on small shapes from the same clustering and compared with the
// library (forward and gradients, through the op harness); improved with
// topk = S equals full attention; Proposition 2 of Vyas et al. 2020; error
// falls as clusters rise; clamping, padding, determinism, bad masks.
//   build/fastattn_tests --gtest_filter='Clustered*:ImprovedClustered*'
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include "attention_cases.h"
#include "expect_error.h"
#include "fastattn/clustered.h"
#include "fastattn/ops.h"
#include "fastattn/registry.h"
#include "op_harness.h"
#include "ops/cluster_members.h"

namespace fastattn {
namespace {

using testing::Inputs;
using testing::OpCase;

at::Generator generator(uint64_t seed) { return at::make_generator<at::CPUGeneratorImpl>(seed); }

using Rows = cases::ClusteredRows;

Rows dense_rows(const torch::Tensor& q, const torch::Tensor& k, const QueryClusters& cl,
                int64_t topk, const std::optional<torch::Tensor>& key_lengths) {
  return cases::clustered_rows(q, k, cl.assignments, cl.counts, topk, key_lengths);
}

double row_l1_max_excess(const Rows& r) {
  auto d_imp = (r.improved - r.full).abs().sum(-1);
  auto d_clu = (r.clustered - r.full).abs().sum(-1);
  return (d_imp - d_clu).max().item<double>();
}

struct Cfg {
  std::string name;
  int64_t N, H, L, S, E, M, C, topk;
  std::vector<int64_t> key_lengths;    // empty: none
  std::vector<int64_t> query_lengths;  // empty: none
  bool improved = true;
};

OpCase make_case(const Cfg& c) {
  OpCase oc;
  oc.name = c.name;
  oc.make_inputs = [c](uint64_t seed) -> Inputs {
    torch::manual_seed(seed);
    return {torch::randn({c.N, c.H, c.L, c.E}, torch::kDouble),
            torch::randn({c.N, c.H, c.S, c.E}, torch::kDouble),
            torch::randn({c.N, c.H, c.S, c.M}, torch::kDouble)};
  };
  std::optional<torch::Tensor> klen, qlen;
  if (!c.key_lengths.empty()) klen = torch::tensor(c.key_lengths, torch::kLong);
  if (!c.query_lengths.empty()) qlen = torch::tensor(c.query_lengths, torch::kLong);
  // One clustering for every call (it is piecewise constant in the queries).
  const auto cl = cluster_queries(oc.make_inputs(0)[0], qlen, c.C, 10, 63, true, generator(11));
  oc.op = [c, cl, klen](const Inputs& x) {
    return c.improved ? improved_clustered_attention(x[0], x[1], x[2], cl, c.topk, klen)
                      : clustered_attention(x[0], x[1], x[2], cl, klen);
  };
  oc.reference = [c, cl, klen](const Inputs& x) {
    auto r = dense_rows(x[0], x[1], cl, c.topk, klen);
    return torch::matmul(c.improved ? r.improved : r.clustered, x[2]);
  };
  oc.f64_tol = 1e-12;
  // float32: O(1) outputs from softmax-weighted sums of <= S terms, rounded
  // inputs; the top-k sets are the float64 ones (same clustering, no near ties).
  oc.f32_tol = 2e-5;
  return oc;
}

class ClusteredCases : public ::testing::TestWithParam<Cfg> {};

TEST_P(ClusteredCases, MatchesDenseRows) { testing::check_op(make_case(GetParam())); }

INSTANTIATE_TEST_SUITE_P(
    Shapes, ClusteredCases,
    ::testing::Values(
        Cfg{"clustered", 2, 2, 37, 29, 8, 5, 4, 3, {}, {}, false},
        Cfg{"clustered_lengths", 2, 2, 37, 29, 8, 5, 4, 3, {29, 11}, {37, 20}, false},
        Cfg{"improved", 2, 2, 37, 29, 8, 5, 4, 3},
        Cfg{"improved_lengths", 3, 1, 33, 40, 7, 6, 5, 6, {40, 3, 0}, {33, 9, 2}},
        Cfg{"improved_topk_gt_S", 1, 2, 20, 9, 4, 4, 3, 50},
        // Clusters of > 96 members: several blocks of queries per cluster.
        Cfg{"improved_large_clusters", 1, 1, 230, 50, 8, 6, 2, 7, {45}, {}},
        // Rows of whole 64-byte lines (E, M multiples of 16 floats): the
        // gradients' and outputs' rows are streamed (simd.h stream_scaled).
        Cfg{"clustered_line_rows", 2, 2, 41, 70, 16, 32, 4, 3, {70, 33}, {41, 30}, false},
        Cfg{"improved_line_rows", 2, 2, 41, 70, 16, 32, 4, 5, {70, 33}, {41, 30}}),
    [](const ::testing::TestParamInfo<Cfg>& info) { return info.param.name; });

TEST(ImprovedClustered, TopkSEqualsFull) {
  torch::manual_seed(1);
  auto q = torch::randn({2, 3, 50, 16}, torch::kDouble),
       k = torch::randn({2, 3, 40, 16}, torch::kDouble),
       v = torch::randn({2, 3, 40, 12}, torch::kDouble);
  for (bool lengths : {false, true}) {
    for (int64_t topk : {40, 1000}) {
      auto mask = Mask();
      std::optional<torch::Tensor> klen;
      if (lengths) {
        klen = torch::tensor({40, 17}, torch::kLong);
        mask = mask.with_key_lengths(*klen);
      }
      auto attn = make_attention("improved-clustered",
                                 {{"clusters", int64_t(5)}, {"topk", topk}, {"seed", int64_t(3)}});
      auto ref = reference::full_attention(q, k, v, std::nullopt, klen);
      EXPECT_LE(testing::max_abs_diff(attn->forward(q, k, v, mask), ref), 1e-12)
          << "lengths=" << lengths << " topk=" << topk;
      auto out32 =
          attn->forward(q.to(torch::kFloat), k.to(torch::kFloat), v.to(torch::kFloat), mask);
      EXPECT_LE(testing::max_abs_diff(out32, ref), 2e-5);
    }
  }
}

TEST(ImprovedClustered, Proposition2RowsNeverFartherThanClustered) {
  for (uint64_t seed : {1, 2, 3, 4}) {
    torch::manual_seed(seed);
    auto q = torch::randn({2, 2, 64, 8}, torch::kDouble) * 2;
    auto k = torch::randn({2, 2, 48, 8}, torch::kDouble);
    for (bool lengths : {false, true}) {
      std::optional<torch::Tensor> klen;
      if (lengths) klen = torch::tensor({48, 13}, torch::kLong);
      for (int64_t C : {1, 3, 8}) {
        for (int64_t topk : {1, 5, 16}) {
          auto cl = cluster_queries(q, std::nullopt, C, 10, 31, true, generator(seed));
          auto r = dense_rows(q, k, cl, topk, klen);
          EXPECT_LE(row_l1_max_excess(r), 1e-12)
              << "seed=" << seed << " C=" << C << " topk=" << topk << " lengths=" << lengths;
          // And strictly better in total for topk > 1 (with topk = 1 the two
          // rows are equally far: |m̂ - m| = |A^c_t - A_t| on the single key).
          if (topk > 1) {
            EXPECT_LT((r.improved - r.full).abs().sum().item<double>(),
                      (r.clustered - r.full).abs().sum().item<double>() - 1e-6);
          }
        }
      }
    }
  }
}

TEST(Clustered, ErrorFallsAsClustersRise) {
  torch::manual_seed(5);
  auto q = torch::randn({1, 4, 256, 16}), k = torch::randn({1, 4, 256, 16}),
       v = torch::randn({1, 4, 256, 16});
  auto full = full_attention(q, k, v);
  std::vector<double> errs;
  for (int64_t C : {2, 16, 128, 256}) {
    auto attn = make_attention("clustered", {{"clusters", C}, {"seed", int64_t(1)}});
    errs.push_back((attn->forward(q, k, v, Mask()) - full).abs().mean().item<double>());
  }
  EXPECT_GT(errs[0], errs[1]);
  EXPECT_GT(errs[1], errs[2]);
  // As many clusters as queries: every query is its own centroid, exactly full.
  EXPECT_LE(errs[3], 1e-6);
}

TEST(Clustered, SameSeedSameOutput) {
  torch::manual_seed(2);
  auto q = torch::randn({2, 2, 80, 8}), k = torch::randn({2, 2, 70, 8}),
       v = torch::randn({2, 2, 70, 8});
  for (const char* type : {"clustered", "improved-clustered"}) {
    auto p = ParamMap{{"clusters", int64_t(6)}, {"topk", int64_t(4)}, {"seed", int64_t(9)}};
    if (std::string(type) == "clustered") p.erase("topk");
    auto a = make_attention(type, p)->forward(q, k, v, Mask());
    auto b = make_attention(type, p)->forward(q, k, v, Mask());
    p["seed"] = int64_t(10);
    auto c = make_attention(type, p)->forward(q, k, v, Mask());
    EXPECT_TRUE(torch::equal(a, b)) << type;
    EXPECT_FALSE(torch::equal(a, c)) << type;
  }
}

// The registry operator checks the centroid values instead of the output
// for overflow: every output row must be one of them (or a padded query's
// zeros), taken once; improved-clustered (per-query top-k parts) has none.
TEST(Clustered, FiniteWitnessHoldsEveryOutputRow) {
  torch::manual_seed(4);
  auto q = torch::randn({2, 3, 40, 8}), k = torch::randn({2, 3, 25, 8}),
       v = torch::randn({2, 3, 25, 5});
  auto mask = Mask().with_query_lengths(torch::tensor({40, 31}));
  auto attn = make_attention("clustered", {{"clusters", int64_t(7)}, {"seed", int64_t(2)}});
  auto out = attn->forward(q, k, v, mask);
  auto w = attn->take_finite_witness();
  ASSERT_TRUE(w.defined());
  ASSERT_EQ(w.sizes(), (std::vector<int64_t>{2, 3, 7, 5}));
  EXPECT_FALSE(w.requires_grad());
  // Distance of each output row to its nearest witness row (or to zero).
  auto rows = torch::cat({w, torch::zeros({2, 3, 1, 5})}, 2);               // (N, H, C + 1, M)
  auto d = (out.unsqueeze(3) - rows.unsqueeze(2)).abs().amax(-1).amin(-1);  // (N, H, L)
  EXPECT_EQ(d.max().item<double>(), 0.0);
  EXPECT_FALSE(attn->take_finite_witness().defined());  // taken once
  auto improved = make_attention("improved-clustered", {{"clusters", int64_t(7)}});
  improved->forward(q, k, v, mask);
  EXPECT_FALSE(improved->take_finite_witness().defined());
}

TEST(Clustered, PaddedQueriesJoinNoClusterAndOutputZeros) {
  torch::manual_seed(3);
  auto q = torch::randn({2, 2, 30, 8}, torch::kDouble).requires_grad_();
  auto k = torch::randn({2, 2, 20, 8}, torch::kDouble),
       v = torch::randn({2, 2, 20, 8}, torch::kDouble);
  auto qlen = torch::tensor({30, 4}, torch::kLong);
  auto mask = Mask().with_query_lengths(qlen).with_key_lengths(torch::tensor({20, 7}));
  for (const char* type : {"clustered", "improved-clustered"}) {
    // 50 clusters > 30 and > 4 valid queries: clamped, every valid query alone.
    auto attn = make_attention(type, {{"clusters", int64_t(50)}, {"seed", int64_t(1)}});
    auto out = attn->forward(q, k, v, mask);
    using torch::indexing::Slice;
    EXPECT_EQ(out.index({1, Slice(), Slice(4, 30)}).abs().max().item<double>(), 0.0) << type;
    // One query per cluster: exact attention for the valid queries.
    auto ref = reference::full_attention(q, k, v, std::nullopt, torch::tensor({20, 7}));
    EXPECT_LE(testing::max_abs_diff(out.index({1, Slice(), Slice(0, 4)}),
                                    ref.index({1, Slice(), Slice(0, 4)})),
              1e-12)
        << type;
    auto g = torch::autograd::grad({out.sum()}, {q})[0];
    EXPECT_EQ(g.index({1, Slice(), Slice(4, 30)}).abs().max().item<double>(), 0.0) << type;
    EXPECT_GT(g.index({1, Slice(), Slice(0, 4)}).abs().max().item<double>(), 0.0) << type;
  }
}

TEST(Clustered, DropoutOnlyInTraining) {
  torch::manual_seed(4);
  auto q = torch::randn({1, 2, 40, 8}), k = torch::randn({1, 2, 40, 8}),
       v = torch::randn({1, 2, 40, 8});
  for (const char* type : {"clustered", "improved-clustered"}) {
    auto p = ParamMap{{"clusters", int64_t(5)}, {"attention_dropout", 0.5}, {"seed", int64_t(1)}};
    auto train = make_attention(type, p), eval = make_attention(type, p),
         plain = make_attention(type, {{"clusters", int64_t(5)}, {"seed", int64_t(1)}});
    eval->eval();
    auto a = train->forward(q, k, v, Mask()), b = eval->forward(q, k, v, Mask()),
         c = plain->forward(q, k, v, Mask());
    EXPECT_TRUE(torch::isfinite(a).all().item<bool>()) << type;
    EXPECT_FALSE(torch::allclose(a, c)) << type;
    EXPECT_LE(testing::max_abs_diff(b, c), 1e-5) << type;
  }
}

TEST(Clustered, RegistryAndBadMasks) {
  auto& reg = AttentionRegistry::global();
  ASSERT_TRUE(reg.contains("clustered"));
  ASSERT_TRUE(reg.contains("improved-clustered"));
  auto p = reg.validate("improved-clustered", {});
  EXPECT_EQ(p.get_int("clusters"), 100);
  EXPECT_EQ(p.get_int("iterations"), 10);
  EXPECT_EQ(p.get_int("bits"), 63);
  EXPECT_TRUE(p.get_bool("hash_bias"));
  EXPECT_EQ(p.get_int("topk"), 32);
  EXPECT_FALSE(p.has("seed"));
  EXPECT_ERROR_CONTAINS(make_attention("clustered", {{"bits", int64_t(65)}}), "bits");
  EXPECT_ERROR_CONTAINS(make_attention("clustered", {{"topk", int64_t(3)}}), "topk");
  auto q = torch::randn({1, 1, 5, 4});
  auto attn = make_attention("clustered");
  EXPECT_ERROR_CONTAINS(
      attn->forward(q, q, q, Mask::causal_mask()),
      "clustered: causal: got a causal mask, which clustered does not take (it is "
      "bidirectional only); use the type 'causal-improved-clustered'");
  EXPECT_ERROR_CONTAINS(
      attn->forward(q, q, q, Mask().with_attn_mask(torch::ones({5, 5}, torch::kBool))),
      "clustered: attn_mask: got a boolean attn_mask");
  // conditional-full wraps it.
  auto cond = make_attention("conditional-full:improved-clustered", {{"length_limit", int64_t(4)}});
  EXPECT_EQ(cond->forward(q, q, q, Mask()).sizes(), q.sizes());
}

// exact-topk against its dense definition: softmax over each query's top-k
// keys by exact score.
torch::Tensor dense_exact_topk(const Inputs& x, int64_t topk,
                               const std::optional<torch::Tensor>& key_lengths) {
  const int64_t N = x[0].size(0), S = x[1].size(2);
  auto scores = torch::matmul(x[0], x[1].transpose(-1, -2)) / std::sqrt(double(x[0].size(3)));
  auto keep = torch::ones({N, 1, 1, S}, torch::kBool);
  if (key_lengths) keep = torch::arange(S).view({1, 1, 1, S}).lt(key_lengths->view({N, 1, 1, 1}));
  auto masked = scores.detach().masked_fill(keep.logical_not(), -INFINITY);
  auto idx = std::get<1>(masked.topk(std::min(topk, S), -1));
  auto in_top = torch::zeros_like(keep.expand_as(scores)).scatter(-1, idx, true).logical_and(keep);
  auto dead = in_top.logical_not().all(-1, true);
  auto p =
      torch::softmax(scores.masked_fill(in_top.logical_not(), -INFINITY).masked_fill(dead, 0.0), -1)
          .masked_fill(dead, 0.0);
  return torch::matmul(p, x[2]);
}

TEST(ExactTopk, MatchesDenseDefinition) {
  for (int64_t topk : {1, 5, 40}) {
    for (bool lengths : {false, true}) {
      OpCase oc;
      oc.name = "exact_topk_" + std::to_string(topk) + (lengths ? "_lengths" : "");
      oc.make_inputs = [](uint64_t seed) -> Inputs {
        torch::manual_seed(seed);
        return {torch::randn({2, 2, 23, 6}, torch::kDouble),
                torch::randn({2, 2, 19, 6}, torch::kDouble),
                torch::randn({2, 2, 19, 5}, torch::kDouble)};
      };
      std::optional<torch::Tensor> klen;
      if (lengths) klen = torch::tensor({19, 4}, torch::kLong);
      oc.op = [topk, klen](const Inputs& x) {
        return exact_topk_attention(x[0], x[1], x[2], topk, klen);
      };
      oc.reference = [topk, klen](const Inputs& x) { return dense_exact_topk(x, topk, klen); };
      oc.f64_tol = 1e-12;
      oc.f32_tol = 2e-5;  // softmax-weighted sums of <= 19 O(1) terms in float32
      testing::check_op(oc);
    }
  }
}

TEST(ExactTopk, TopkSEqualsFullAndRegistry) {
  torch::manual_seed(6);
  auto q = torch::randn({2, 2, 30, 8}, torch::kDouble),
       k = torch::randn({2, 2, 25, 8}, torch::kDouble),
       v = torch::randn({2, 2, 25, 4}, torch::kDouble);
  auto klen = torch::tensor({25, 9}, torch::kLong);
  auto attn = make_attention("exact-topk", {{"topk", int64_t(100)}});
  EXPECT_LE(testing::max_abs_diff(attn->forward(q, k, v, Mask().with_key_lengths(klen)),
                                  reference::full_attention(q, k, v, std::nullopt, klen)),
            1e-12);
  EXPECT_EQ(AttentionRegistry::global().validate("exact-topk", {}).get_int("topk"), 32);
  EXPECT_ERROR_CONTAINS(attn->forward(q, q, q, Mask::causal_mask()),
                        "exact-topk: causal: got a causal mask, which exact-topk does not take (it "
                        "is bidirectional only)");
}

// The layers' (N, L, H, E) views, padded rows and heads broadcast with
// stride 0 are read and written in place (the kernels take row strides), as
// the contiguous copies give: clustered (hashing, centroid sums, the
// broadcast back), improved (centroid means, the centroids' pass, clusters of
// more than one block of members, the centroid gradients), exact top-k (one
// query per key set) and the causal improved form; key lengths.
TEST(Clustered, ReadsAndWritesRowLayoutsInPlace) {
  using torch::Tensor;
  const int64_t N = 2, H = 3, L = 230, S = 230, E = 8, M = 6;
  torch::manual_seed(8);
  const auto klen = torch::tensor({int64_t(230), int64_t(150)}, torch::kLong);
  const auto cl = cluster_queries(torch::randn({N, H, L, E}, torch::kDouble), std::nullopt, 2, 10,
                                  63, true, generator(3));
  const std::vector<std::pair<std::string, testing::QkvOp>> ops = {
      {"clustered", [&](const Tensor& q, const Tensor& k,
                        const Tensor& v) { return clustered_attention(q, k, v, cl, klen); }},
      {"improved",
       [&](const Tensor& q, const Tensor& k, const Tensor& v) {
         return improved_clustered_attention(q, k, v, cl, 7, klen);
       }},
      {"exact-topk", [&](const Tensor& q, const Tensor& k,
                         const Tensor& v) { return exact_topk_attention(q, k, v, 5, klen); }},
      {"causal-improved", [&](const Tensor& q, const Tensor& k, const Tensor& v) {
         return causal_improved_clustered_attention(q, k, v, cl, 7, 16, klen);
       }}};
  for (const auto& [name, op] : ops) {
    SCOPED_TRACE(name);
    testing::check_row_layouts(op, N, H, L, S, E, M);
  }
}

// The CPU kernels behind the centroids' mean and the broadcast back
// (ops/cluster_members.h) against ATen's index_add / index_select, float64:
// values and gradients, an empty cluster, padded rows (-1) and the layers'
// (N, L, H, E) views.
TEST(ClusterMembers, MatchIndexAddAndIndexSelect) {
  using torch::Tensor;
  const int64_t N = 2, H = 3, L = 41, C = 5, E = 7;
  torch::manual_seed(21);
  // Cluster 4 stays empty; the last rows of batch 1 are padding.
  auto a = torch::randint(0, C - 1, {N, H, L}, torch::kLong);
  a.select(0, 1).narrow(1, 30, L - 30).fill_(-1);
  auto counts = torch::zeros({N, H, C}, torch::kLong);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t l = 0; l < L; ++l) {
        const int64_t c = a[n][h][l].item<int64_t>();
        if (c >= 0) counts[n][h][c] += 1;
      }
  // Reference: a flat table with a zero / sink row for padding.
  const auto flat = torch::where(a.ge(0), torch::arange(N * H).view({N, H, 1}) * C + a,
                                 torch::full({}, N * H * C, torch::kLong))
                        .reshape({-1});
  auto ref_means = [&](const Tensor& x) {
    auto sums = torch::zeros({N * H * C + 1, E}, x.options())
                    .index_add(0, flat, x.contiguous().view({-1, E}));
    return sums.narrow(0, 0, N * H * C).view({N, H, C, E}) /
           counts.clamp_min(1).to(x.scalar_type()).unsqueeze(-1);
  };
  auto ref_spread = [&](const Tensor& t) {
    auto table = torch::cat({t.reshape({N * H * C, E}), torch::zeros({1, E}, t.options())});
    return table.index_select(0, flat).view({N, H, L, E});
  };
  for (bool views : {false, true}) {
    SCOPED_TRACE(views ? "views" : "contiguous");
    auto x = views ? torch::randn({N, L, H, E}, torch::kDouble).transpose(1, 2)
                   : torch::randn({N, H, L, E}, torch::kDouble);
    x.requires_grad_(true);
    auto t = torch::randn({N, H, C, E}, torch::kDouble).requires_grad_(true);
    auto means = ops::cluster_means(x, a, counts);
    auto spread = ops::spread_to_members(t, a, x);
    EXPECT_TRUE(torch::allclose(means, ref_means(x), 1e-12, 1e-12));
    EXPECT_TRUE(torch::allclose(spread, ref_spread(t), 1e-12, 1e-12));
    EXPECT_EQ(spread.transpose(1, 2).is_contiguous(), views);  // the layers' transpose is a view
    EXPECT_EQ(means.select(2, C - 1).abs().max().item<double>(), 0.0);
    const auto gm = torch::randn({N, H, C, E}, torch::kDouble),
               gs = torch::randn({N, H, L, E}, torch::kDouble);
    auto got = torch::autograd::grad({means, spread}, {x, t}, {gm, gs});
    auto want = torch::autograd::grad({ref_means(x), ref_spread(t)}, {x, t}, {gm, gs});
    EXPECT_TRUE(torch::allclose(got[0], want[0], 1e-12, 1e-12));
    EXPECT_TRUE(torch::allclose(got[1], want[1], 1e-12, 1e-12));
    EXPECT_EQ(got[0].transpose(1, 2).is_contiguous(), views);
  }
}

TEST(ImprovedClusteredOp, BadInputsNameTheArgument) {
  // The fused operator behind improved-clustered, called directly.
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fastattn::improved_clustered_attention", "")
          .typed<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                               const torch::Tensor&, const torch::Tensor&, int64_t,
                               const c10::optional<torch::Tensor>&, c10::optional<double>, double,
                               c10::optional<int64_t>)>();
  auto q = torch::randn({1, 2, 5, 4}), k = torch::randn({1, 2, 6, 4}),
       v = torch::randn({1, 2, 6, 3});
  auto a = torch::zeros({1, 2, 5}, torch::kLong);
  auto counts = torch::zeros({1, 2, 3}, torch::kLong);
  counts.select(2, 0).fill_(5);
  EXPECT_EQ(op.call(q, k, v, a, counts, 2, c10::nullopt, c10::nullopt, 0.0, c10::nullopt).sizes(),
            (std::vector<int64_t>{1, 2, 5, 3}));
  EXPECT_ERROR_CONTAINS(
      op.call(q, k, v, a, counts, 7, c10::nullopt, c10::nullopt, 0.0, c10::nullopt),
      "topk must be in [1, S] = [1, 6], got 7");
  EXPECT_ERROR_CONTAINS(
      op.call(q, k, v, a[0], counts, 2, c10::nullopt, c10::nullopt, 0.0, c10::nullopt),
      "assignments must have shape (N, H, L)");
  EXPECT_ERROR_CONTAINS(
      op.call(q, k, v, a + 3, counts, 2, c10::nullopt, c10::nullopt, 0.0, c10::nullopt),
      "assignments must be in [-1, C) = [-1, 3)");
  EXPECT_ERROR_CONTAINS(
      op.call(q, k, v, a, counts.to(torch::kInt), 2, c10::nullopt, c10::nullopt, 0.0, c10::nullopt),
      "counts must be int64");
  EXPECT_ERROR_CONTAINS(
      op.call(q, k, v, a, counts + 1, 2, c10::nullopt, c10::nullopt, 0.0, c10::nullopt),
      "counts must be the number of queries assigned to each cluster");
  EXPECT_ERROR_CONTAINS(
      op.call(q, k, v, a, counts.roll(1, 2), 2, c10::nullopt, c10::nullopt, 0.0, c10::nullopt),
      "they disagree with the assignments");
  EXPECT_ERROR_CONTAINS(
      op.call(q, k.narrow(3, 0, 3), v, a, counts, 2, c10::nullopt, c10::nullopt, 0.0, c10::nullopt),
      "k must agree with q");
}

TEST(ClusteredTopkAttention, BadInputsNameTheArgument) {
  auto q = torch::randn({1, 2, 5, 4}), k = torch::randn({1, 2, 6, 4}),
       v = torch::randn({1, 2, 6, 3});
  auto topk = torch::zeros({1, 2, 3, 2}, torch::kLong);
  auto mass = torch::ones({1, 2, 3});
  auto a = torch::zeros({1, 2, 5}, torch::kLong);
  EXPECT_ERROR_CONTAINS(clustered_topk_attention(q, k, v, topk[0], mass, a, std::nullopt, 1.0),
                        "topk must have shape");
  EXPECT_ERROR_CONTAINS(clustered_topk_attention(q, k, v, topk + 6, mass, a, std::nullopt, 1.0),
                        "[0, 6)");
  EXPECT_ERROR_CONTAINS(
      clustered_topk_attention(q, k, v, topk, mass.narrow(2, 0, 2), a, std::nullopt, 1.0),
      "mass must have shape");
  EXPECT_ERROR_CONTAINS(
      clustered_topk_attention(q, k, v, topk, mass.to(torch::kDouble), a, std::nullopt, 1.0),
      "mass must be");
  EXPECT_ERROR_CONTAINS(clustered_topk_attention(q, k, v, topk, mass, a + 3, std::nullopt, 1.0),
                        "[-1, 3)");
  EXPECT_ERROR_CONTAINS(
      clustered_topk_attention(q, k, v, topk, mass, a, torch::tensor({7}, torch::kLong), 1.0),
      "key_lengths");
  // Padded queries and a key length of 0 give zeros.
  auto out = clustered_topk_attention(q, k, v, topk, mass, a - 1, std::nullopt, 1.0);
  EXPECT_EQ(out.abs().max().item<double>(), 0.0);
  out = clustered_topk_attention(q, k, v, topk, mass, a, torch::tensor({0}, torch::kLong), 1.0);
  EXPECT_EQ(out.abs().max().item<double>(), 0.0);
}

// ---- causal-improved-clustered ----------------------------------------------

AttentionPtr make_causal(int64_t topk, int64_t local_context, int64_t clusters = 4,
                         int64_t seed = 5) {
  return make_attention(
      "causal-improved-clustered",
      {{"clusters", clusters}, {"topk", topk}, {"local_context", local_context}, {"seed", seed}});
}

// Changing keys and values after position t never changes the outputs at
// positions <= t, with and without key-length padding and query padding.
TEST(CausalImprovedClustered, FutureKeysNeverChangePastOutputs) {
  using torch::indexing::Slice;
  torch::manual_seed(7);
  const int64_t L = 41;
  auto q = torch::randn({2, 2, L, 6}, torch::kDouble),
       k = torch::randn({2, 2, L, 6}, torch::kDouble),
       v = torch::randn({2, 2, L, 5}, torch::kDouble);
  for (bool padded : {false, true}) {
    auto mask = Mask::causal_mask();
    if (padded) {
      mask = mask.with_key_lengths(torch::tensor({L, int64_t(23)}, torch::kLong))
                 .with_query_lengths(torch::tensor({L, int64_t(30)}, torch::kLong));
    }
    for (int64_t topk : {1, 3, 8}) {
      for (int64_t w : {1, 4, 7}) {
        auto base = make_causal(topk, w)->forward(q, k, v, mask);
        for (int64_t t : {0, 3, 9, 20, 33, 39}) {
          auto k2 = k.clone(), v2 = v.clone();
          // Future keys made very attractive to every centroid and query.
          k2.index_put_({Slice(), Slice(), Slice(t + 1, L)},
                        torch::randn({2, 2, L - t - 1, 6}, torch::kDouble) * 50);
          v2.index_put_({Slice(), Slice(), Slice(t + 1, L)},
                        torch::randn({2, 2, L - t - 1, 5}, torch::kDouble) * 50);
          auto out = make_causal(topk, w)->forward(q, k2, v2, mask);
          EXPECT_TRUE(torch::equal(out.index({Slice(), Slice(), Slice(0, t + 1)}),
                                   base.index({Slice(), Slice(), Slice(0, t + 1)})))
              << "padded=" << padded << " topk=" << topk << " w=" << w << " t=" << t;
        }
      }
    }
  }
}

// d out_t / d (k_j, v_j) is exactly zero for every j > t.
TEST(CausalImprovedClustered, GradientOfPastOutputsIgnoresFutureKeys) {
  using torch::indexing::Slice;
  torch::manual_seed(8);
  const int64_t L = 29;
  auto q = torch::randn({2, 2, L, 6}, torch::kDouble).requires_grad_();
  auto k = torch::randn({2, 2, L, 6}, torch::kDouble).requires_grad_();
  auto v = torch::randn({2, 2, L, 4}, torch::kDouble).requires_grad_();
  for (bool padded : {false, true}) {
    auto mask = Mask::causal_mask();
    if (padded) mask = mask.with_key_lengths(torch::tensor({L, int64_t(17)}, torch::kLong));
    auto out = make_causal(3, 4)->forward(q, k, v, mask);
    for (int64_t t : {0, 5, 12, 27}) {
      auto g = torch::autograd::grad({out.index({Slice(), Slice(), t}).sum()}, {k, v},
                                     /*grad_outputs=*/{}, /*retain_graph=*/true);
      EXPECT_EQ(g[0].index({Slice(), Slice(), Slice(t + 1, L)}).abs().max().item<double>(), 0.0)
          << "padded=" << padded << " t=" << t;
      EXPECT_EQ(g[1].index({Slice(), Slice(), Slice(t + 1, L)}).abs().max().item<double>(), 0.0)
          << "padded=" << padded << " t=" << t;
      // The past does reach it.
      EXPECT_GT(g[1].index({Slice(), Slice(), Slice(0, t + 1)}).abs().max().item<double>(), 0.0);
    }
  }
}

// topk >= S: every key j <= i is in the union, so it is full causal attention
// (any window, any clustering, with key lengths too).
TEST(CausalImprovedClustered, TopkSEqualsFullCausal) {
  torch::manual_seed(9);
  const int64_t L = 45;
  auto q = torch::randn({2, 3, L, 8}, torch::kDouble),
       k = torch::randn({2, 3, L, 8}, torch::kDouble),
       v = torch::randn({2, 3, L, 7}, torch::kDouble);
  for (bool lengths : {false, true}) {
    std::optional<torch::Tensor> klen;
    auto mask = Mask::causal_mask();
    if (lengths) {
      klen = torch::tensor({L, int64_t(19)}, torch::kLong);
      mask = mask.with_key_lengths(*klen);
    }
    auto ref = reference::full_attention(q, k, v, std::nullopt, klen, /*causal=*/true);
    for (int64_t topk : {L, int64_t(1000)}) {
      for (int64_t w : {1, 6, 45, 100}) {
        auto out = make_causal(topk, w)->forward(q, k, v, mask);
        EXPECT_LE(testing::max_abs_diff(out, ref), 1e-12)
            << "lengths=" << lengths << " topk=" << topk << " w=" << w;
      }
    }
    auto out32 = make_causal(L, 6)->forward(q.to(torch::kFloat), k.to(torch::kFloat),
                                            v.to(torch::kFloat), mask);
    EXPECT_LE(testing::max_abs_diff(out32, ref), 2e-5);  // sums of <= 45 O(1) terms in float32
  }
  // Small topk and a small window: not full attention, but finite.
  auto approx = make_causal(2, 3)->forward(q, k, v, Mask::causal_mask());
  EXPECT_TRUE(torch::isfinite(approx).all().item<bool>());
  EXPECT_GT(testing::max_abs_diff(
                approx, reference::full_attention(q, k, v, std::nullopt, std::nullopt, true)),
            1e-6);
}

TEST(CausalImprovedClustered, RegistryAndBadParams) {
  auto& reg = AttentionRegistry::global();
  ASSERT_TRUE(reg.contains("causal-improved-clustered"));
  auto p = reg.validate("causal-improved-clustered", {});
  EXPECT_EQ(p.get_int("clusters"), 100);
  EXPECT_EQ(p.get_int("iterations"), 10);
  EXPECT_EQ(p.get_int("bits"), 63);
  EXPECT_TRUE(p.get_bool("hash_bias"));
  EXPECT_EQ(p.get_int("topk"), 32);
  EXPECT_EQ(p.get_int("local_context"), 32);
  EXPECT_FALSE(p.has("seed"));
  EXPECT_ERROR_CONTAINS(make_attention("causal-improved-clustered", {{"topk", int64_t(0)}}),
                        "topk");
  EXPECT_ERROR_CONTAINS(
      make_attention("causal-improved-clustered", {{"local_context", int64_t(0)}}),
      "local_context");
  EXPECT_ERROR_CONTAINS(make_attention("causal-improved-clustered", {{"bits", int64_t(65)}}),
                        "bits");
  EXPECT_ERROR_CONTAINS(make_attention("causal-improved-clustered", {{"clusters", int64_t(0)}}),
                        "clusters");
  EXPECT_ERROR_CONTAINS(make_attention("causal-improved-clustered", {{"softmax_temp", -1.0}}),
                        "softmax_temp");
  EXPECT_ERROR_CONTAINS(make_attention("causal-improved-clustered", {{"attention_dropout", 1.0}}),
                        "attention_dropout");
  auto q = torch::randn({1, 1, 5, 4});
  auto attn = make_attention("causal-improved-clustered");
  EXPECT_ERROR_CONTAINS(attn->forward(q, q, q, Mask()),
                        "causal-improved-clustered: causal: got no causal mask, which "
                        "causal-improved-clustered does not take (it is causal only); use the "
                        "type 'improved-clustered'");
  EXPECT_ERROR_CONTAINS(
      attn->forward(q, torch::randn({1, 1, 6, 4}), torch::randn({1, 1, 6, 4}), Mask::causal_mask()),
      "S == L");
  EXPECT_ERROR_CONTAINS(
      attn->forward(q, q, q, Mask::causal_mask().with_attn_mask(torch::ones({5, 5}, torch::kBool))),
      "causal-improved-clustered: attn_mask: got a boolean attn_mask of shape [5, 5], which "
      "causal-improved-clustered does not take (it takes only the causal mask and key_lengths)");
}

TEST(CausalImprovedClustered, SameSeedSameOutput) {
  torch::manual_seed(10);
  auto q = torch::randn({2, 2, 80, 8}), k = torch::randn({2, 2, 80, 8}),
       v = torch::randn({2, 2, 80, 8});
  auto a = make_causal(4, 5, 6, 9)->forward(q, k, v, Mask::causal_mask());
  auto b = make_causal(4, 5, 6, 9)->forward(q, k, v, Mask::causal_mask());
  auto c = make_causal(4, 5, 6, 10)->forward(q, k, v, Mask::causal_mask());
  EXPECT_TRUE(torch::equal(a, b));
  EXPECT_FALSE(torch::equal(a, c));
}

// causal-improved-clustered from its definition, densely: per cluster c and
// block b the top-k keys j < b·w by centroid score (a direct top-k, not the
// running one), then per query a softmax over that set with j <= i - w and
// the window i - w + 1 .. i, as an (N, H, L, S) keep mask.
torch::Tensor dense_causal_improved(const Inputs& x, const QueryClusters& cl, int64_t topk,
                                    int64_t w, const std::optional<torch::Tensor>& key_lengths) {
  const int64_t N = x[0].size(0), H = x[0].size(1), L = x[0].size(2), S = x[1].size(2),
                C = cl.counts.size(2);
  auto keep_len = torch::ones({N, 1, 1, S}, torch::kBool);
  if (key_lengths) {
    keep_len = torch::arange(S).view({1, 1, 1, S}).lt(key_lengths->view({N, 1, 1, 1}));
  }
  auto centroids = cluster_centroids(x[0].detach(), cl);                // (N, H, C, E)
  auto cs = torch::matmul(centroids, x[1].detach().transpose(-1, -2));  // (N, H, C, S)
  cs = cs.masked_fill(keep_len.logical_not(), -INFINITY);
  auto keep = torch::zeros({N, H, L, S}, torch::kBool);
  auto a = cl.assignments.clamp_min(0);
  for (int64_t i = 0; i < L; ++i) {
    const int64_t b = i / w;
    auto row = keep.select(2, i);  // (N, H, S)
    for (int64_t j = std::max<int64_t>(0, i - w + 1); j <= i; ++j) row.select(2, j).fill_(true);
    if (b * w == 0) continue;
    auto prefix = cs.narrow(3, 0, b * w);  // (N, H, C, b·w)
    auto idx = std::get<1>(prefix.topk(std::min(topk, b * w), -1));
    auto in_set = torch::zeros({N, H, C, S}, torch::kBool).scatter(-1, idx, true);
    in_set = in_set.logical_and(torch::arange(S).le(i - w));
    auto mine = in_set.gather(2, a.select(2, i).view({N, H, 1, 1}).expand({N, H, 1, S}));
    row.logical_or_(mine.squeeze(2));
  }
  keep = keep.logical_and(keep_len);
  auto scores = torch::matmul(x[0], x[1].transpose(-1, -2)) / std::sqrt(double(x[0].size(3)));
  auto dead = keep.logical_not().all(-1, true);
  auto p =
      torch::softmax(scores.masked_fill(keep.logical_not(), -INFINITY).masked_fill(dead, 0.0), -1)
          .masked_fill(dead, 0.0) *
      cl.assignments.ge(0).unsqueeze(-1);
  return torch::matmul(p, x[2]);
}

TEST(CausalImprovedClustered, MatchesDenseDefinition) {
  for (int64_t topk : {1, 4}) {
    for (int64_t w : {1, 5}) {
      for (bool lengths : {false, true}) {
        OpCase oc;
        oc.name = "causal_improved_topk" + std::to_string(topk) + "_w" + std::to_string(w) +
                  (lengths ? "_lengths" : "");
        oc.make_inputs = [](uint64_t seed) -> Inputs {
          torch::manual_seed(seed);
          return {torch::randn({2, 2, 23, 6}, torch::kDouble),
                  torch::randn({2, 2, 23, 6}, torch::kDouble),
                  torch::randn({2, 2, 23, 5}, torch::kDouble)};
        };
        std::optional<torch::Tensor> klen, qlen;
        if (lengths) {
          klen = torch::tensor({int64_t(23), int64_t(9)}, torch::kLong);
          qlen = torch::tensor({int64_t(23), int64_t(15)}, torch::kLong);
        }
        const auto cl = cluster_queries(oc.make_inputs(0)[0], qlen, 3, 10, 63, true, generator(4));
        oc.op = [=](const Inputs& x) {
          return causal_improved_clustered_attention(x[0], x[1], x[2], cl, topk, w, klen);
        };
        oc.reference = [=](const Inputs& x) { return dense_causal_improved(x, cl, topk, w, klen); };
        oc.f64_tol = 1e-12;
        oc.f32_tol = 2e-5;  // softmax-weighted sums of <= 9 O(1) terms in float32
        testing::check_op(oc);
      }
    }
  }
}

}  // namespace
}  // namespace fastattn
