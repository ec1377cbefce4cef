// ClusterFormer (Wang et al. 2022): the gather_tokens op (sort / unsort)
// against torch::gather, sort then unsort is the identity, one cluster equals
// full attention, the block attention equals a dense reference with the
// equivalent block mask (forward, gradients, finite differences; order
// fixed), the two losses equal their formulas (and their gradients by finite
// differences), causal never sees later keys, padding, bad parameters, the
// centroid hand-off in a stack, and a tiny model that trains with its losses.
//   build/fastattn_tests --gtest_filter='ClusterFormer*:GatherTokens*'
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "expect_error.h"
#include "fastattn/clusterformer.h"
#include "fastattn/ops.h"
#include "fastattn/registry.h"
#include "fastattn/transformer.h"
#include "op_harness.h"

namespace fastattn {
namespace {

using testing::Inputs;
using testing::OpCase;

const auto kF64 = torch::TensorOptions().dtype(torch::kDouble);

// A random permutation of 0..L-1 per batch element: (N, L) int64.
torch::Tensor random_order(int64_t N, int64_t L) {
  std::vector<torch::Tensor> rows;
  for (int64_t n = 0; n < N; ++n) rows.push_back(torch::randperm(L, torch::kLong));
  return torch::stack(rows);
}

// Dense (N, L, L) keep mask of the sorted block pattern, from the definition:
// token j sits in sorted slot t_j (order[t_j] = j), block b_j = t_j / w;
// query i keeps key j iff b_j is b_i or b_i - 1, j is before the key length,
// and (causal) j <= i.
torch::Tensor dense_block_mask(const torch::Tensor& order, int64_t clusters,
                               const std::vector<int64_t>& key_lengths, bool causal) {
  const int64_t N = order.size(0), L = order.size(1), w = (L + clusters - 1) / clusters;
  auto keep = torch::zeros({N, L, L}, torch::kBool);
  auto acc = keep.accessor<bool, 3>();
  auto ord = order.accessor<int64_t, 2>();
  for (int64_t n = 0; n < N; ++n) {
    std::vector<int64_t> block(L);
    for (int64_t t = 0; t < L; ++t) block[ord[n][t]] = t / w;
    const int64_t len = key_lengths.empty() ? L : key_lengths[n];
    for (int64_t i = 0; i < L; ++i)
      for (int64_t j = 0; j < L; ++j)
        acc[n][i][j] =
            (block[j] == block[i] || block[j] == block[i] - 1) && j < len && (!causal || j <= i);
  }
  return keep;
}

// ---- gather_tokens ------------------------------------------------------------------

TEST(GatherTokens, MatchesTorchGatherWithGradients) {
  OpCase c;
  c.name = "gather_tokens N=2 H=3 L=7 E=5 T=11 (repeats and -1)";
  c.make_inputs = [](uint64_t seed) {
    torch::manual_seed(seed);
    auto x = torch::randn({2, 3, 7, 5}, kF64);
    auto index = torch::randint(-1, 7, {2, 11}, torch::kLong);
    return Inputs{x, index};
  };
  c.op = [](const Inputs& in) { return gather_tokens(in[0], in[1]); };
  c.reference = [](const Inputs& in) { return reference::gather_tokens(in[0], in[1]); };
  c.grad_inputs = {0};
  c.f32_tol = 1e-6;  // a copy: only the float32 rounding of |x| <~ 5 against float64
  testing::check_op(c);
}

TEST(GatherTokens, BadIndexIsNamed) {
  auto x = torch::randn({2, 1, 4, 3});
  EXPECT_ERROR_CONTAINS(gather_tokens(x, torch::tensor({{0, 4}, {1, 2}})), "index", "[-1, L)");
  EXPECT_ERROR_CONTAINS(gather_tokens(x, torch::zeros({3, 2}, torch::kLong)), "index", "(N, T)");
  EXPECT_ERROR_CONTAINS(gather_tokens(x, torch::zeros({2, 2})), "index", "int64");
}

// ---- sort / unsort ------------------------------------------------------------------

TEST(ClusterFormer, SortThenUnsortIsIdentity) {
  torch::manual_seed(1);
  const int64_t N = 3, H = 2, L = 97, E = 5;
  auto x = torch::randn({N, L, H * E}, kF64);
  auto cl = clusterformer_cluster(x, torch::randn({6, H * E}, kF64),
                                  torch::randn({H * E, H * E}, kF64), torch::tensor({97, 50, 1}));
  // order is a permutation, sorted by (cluster, position), padding last.
  for (int64_t n = 0; n < N; ++n) {
    auto o = cl.order[n];
    EXPECT_TRUE(std::get<0>(o.sort()).equal(torch::arange(L)));
    auto a = cl.assignments[n].index_select(0, o);
    EXPECT_TRUE((a.slice(0, 1) >= a.slice(0, 0, L - 1)).all().item<bool>());
    auto same = a.slice(0, 1) == a.slice(0, 0, L - 1);
    EXPECT_TRUE((same.logical_not() | (o.slice(0, 1) > o.slice(0, 0, L - 1))).all().item<bool>());
  }
  EXPECT_TRUE(cl.assignments[1].slice(0, 50).eq(6).all().item<bool>());
  EXPECT_TRUE(cl.assignments[1].slice(0, 0, 50).lt(6).all().item<bool>());
  auto q = x.view({N, L, H, E}).permute({0, 2, 1, 3}).contiguous();
  auto inverse = torch::empty_like(cl.order).scatter_(
      1, cl.order, torch::arange(L).view({1, L}).expand({N, L}).contiguous());
  auto back = gather_tokens(gather_tokens(q, cl.order), inverse);
  EXPECT_TRUE(back.equal(q));
}

// ---- the block attention ----------------------------------------------------------------

struct BlockCfg {
  std::string name;
  int64_t N, H, L, E, M, clusters;
  std::vector<int64_t> key_lengths;
  bool causal = false;
};

OpCase block_case(const BlockCfg& b) {
  OpCase c;
  c.name = b.name;
  c.make_inputs = [b](uint64_t seed) {
    torch::manual_seed(seed);
    return Inputs{torch::randn({b.N, b.H, b.L, b.E}, kF64),
                  torch::randn({b.N, b.H, b.L, b.E}, kF64),
                  torch::randn({b.N, b.H, b.L, b.M}, kF64), random_order(b.N, b.L)};
  };
  auto lengths = [b]() -> std::optional<torch::Tensor> {
    if (b.key_lengths.empty()) return std::nullopt;
    return torch::tensor(b.key_lengths, torch::kLong);
  };
  c.op = [b, lengths](const Inputs& in) {
    return clusterformer_block_attention(in[0], in[1], in[2], in[3], b.clusters, lengths(),
                                         b.causal);
  };
  c.reference = [b](const Inputs& in) {
    return reference::full_attention(in[0], in[1], in[2],
                                     dense_block_mask(in[3], b.clusters, b.key_lengths, b.causal));
  };
  c.grad_inputs = {0, 1, 2};
  c.f32_tol = 2e-5;  // float32 accumulation over <= 2w keys of unit-variance scores
  return c;
}

TEST(ClusterFormer, BlockAttentionEqualsDenseBlockMask) {
  for (const auto& b : std::vector<BlockCfg>{
           {"k=4 L=13 (padded last block)", 2, 2, 13, 3, 4, 4, {}, false},
           {"k=3 L=12 one head, S==L, E!=M", 1, 1, 12, 5, 2, 3, {}, false},
           {"k=5 L=23 key lengths", 2, 3, 23, 4, 4, 5, {23, 9}},
           {"k=4 L=17 causal", 2, 2, 17, 3, 3, 4, {}, true},
           {"k=3 L=19 causal + key lengths", 2, 1, 19, 4, 4, 3, {19, 7}, true},
           {"k=20 L=11 more clusters than tokens", 1, 2, 11, 3, 3, 20, {}, false},
       }) {
    testing::check_op(block_case(b));
  }
}

// The block view's dropout mask (full_attention's over (N·b, H, w, kw)) in
// original positions: (N, H, L, L), query i's weight of key j at block
// b_i's row r_i and key slot c (the previous block's rows first).
torch::Tensor dense_dropout_keep(const torch::Tensor& order, int64_t clusters, int64_t H,
                                 int64_t seed, double p) {
  const int64_t N = order.size(0), L = order.size(1), w = (L + clusters - 1) / clusters;
  const int64_t blocks = (L + w - 1) / w, kw = blocks > 1 ? 2 * w : w;
  const auto block_keep = reference::attention_dropout_keep(seed, p, N * blocks, H, w, kw);
  auto keep = torch::zeros({N, H, L, L}, torch::kDouble);
  auto bk = block_keep.accessor<double, 4>();
  auto acc = keep.accessor<double, 4>();
  auto ord = order.accessor<int64_t, 2>();
  for (int64_t n = 0; n < N; ++n) {
    std::vector<int64_t> slot(L);
    for (int64_t t = 0; t < L; ++t) slot[ord[n][t]] = t;
    for (int64_t i = 0; i < L; ++i) {
      const int64_t bi = slot[i] / w, ri = slot[i] % w;
      for (int64_t j = 0; j < L; ++j) {
        const int64_t bj = slot[j] / w, rj = slot[j] % w;
        int64_t c = -1;
        if (bj == bi) c = blocks > 1 ? w + rj : rj;
        if (bj == bi - 1) c = rj;
        if (c < 0) continue;
        for (int64_t h = 0; h < H; ++h) acc[n][h][i][j] = bk[n * blocks + bi][h][ri][c];
      }
    }
  }
  return keep;
}

TEST(ClusterFormer, BlockAttentionDropoutEqualsTheReferenceWithTheSameMask) {
  const double p = 0.3;
  const int64_t seed = 90210;
  torch::manual_seed(11);
  for (auto dtype : {torch::kDouble, torch::kFloat}) {
    for (const auto& b : std::vector<BlockCfg>{{"k=4 L=13", 2, 2, 13, 3, 4, 4, {}, false},
                                               {"k=5 L=23 lengths", 2, 3, 23, 4, 4, 5, {23, 9}},
                                               {"k=4 L=17 causal", 2, 2, 17, 3, 3, 4, {}, true},
                                               {"k=1 L=9", 1, 2, 9, 3, 3, 1, {}, false}}) {
      const std::string what = std::string(c10::toString(dtype)) + " " + b.name;
      auto q = torch::randn({b.N, b.H, b.L, b.E}, dtype).requires_grad_(true);
      auto k = torch::randn({b.N, b.H, b.L, b.E}, dtype).requires_grad_(true);
      auto v = torch::randn({b.N, b.H, b.L, b.M}, dtype).requires_grad_(true);
      auto g = torch::randn({b.N, b.H, b.L, b.M}, dtype);
      auto order = random_order(b.N, b.L);
      std::optional<torch::Tensor> lengths;
      if (!b.key_lengths.empty()) lengths = torch::tensor(b.key_lengths, torch::kLong);
      auto out = clusterformer_block_attention(q, k, v, order, b.clusters, lengths, b.causal,
                                               std::nullopt, p, seed);
      auto grads = torch::autograd::grad({out}, {q, k, v}, {g});
      std::vector<torch::Tensor> x;
      for (const auto& t : {q, k, v}) x.push_back(t.detach().to(kF64).requires_grad_(true));
      const auto mask = dense_block_mask(order, b.clusters, b.key_lengths, b.causal);
      auto ref =
          reference::full_attention(x[0], x[1], x[2], mask, std::nullopt, false, std::nullopt,
                                    dense_dropout_keep(order, b.clusters, b.H, seed, p));
      auto ref_grads = torch::autograd::grad({ref}, x, {g.to(kF64)});
      const double tol = dtype == torch::kDouble ? 1e-12 : 2e-5;
      EXPECT_LE((out.to(kF64) - ref).abs().max().item<double>(), tol) << what;
      for (int i = 0; i < 3; ++i)
        EXPECT_LE((grads[i].to(kF64) - ref_grads[i]).abs().max().item<double>(), 10 * tol)
            << what << " grad " << i;
      auto undropped = reference::full_attention(x[0], x[1], x[2], mask);
      EXPECT_GT((ref - undropped).abs().max().item<double>(), 1e-3) << what;
    }
  }
}

TEST(ClusterFormer, DropsInTrainingOnly) {
  torch::manual_seed(5);
  const int64_t N = 1, H = 2, L = 24, E = 4;
  auto q = torch::randn({N, H, L, E}), v = torch::randn({N, H, L, E});
  ParamMap params = {{"clusters", int64_t{3}}, {"seed", int64_t{1}}};
  auto plain = make_attention("clusterformer", params, {H, E, E});
  params["attention_dropout"] = 0.4;
  auto attn = make_attention("clusterformer", params, {H, E, E});
  attn->eval();
  plain->eval();
  EXPECT_TRUE(torch::equal(attn->forward(q, q, v, Mask()), plain->forward(q, q, v, Mask())));
  attn->train();
  plain->train();
  EXPECT_GT(
      (attn->forward(q, q, v, Mask()) - plain->forward(q, q, v, Mask())).abs().max().item<double>(),
      1e-2);
  params["attention_dropout"] = 1.0;
  EXPECT_ERROR_CONTAINS(make_attention("clusterformer", params, {H, E, E}), "attention_dropout");
}

TEST(ClusterFormer, OneClusterEqualsFullAttention) {
  torch::manual_seed(3);
  const int64_t N = 2, H = 3, L = 97, E = 5;
  AttentionDims dims;
  dims.heads = H;
  dims.query_dim = E;
  dims.value_dim = 7;
  auto attn =
      make_attention("clusterformer", {{"clusters", int64_t(1)}, {"seed", int64_t(0)}}, dims);
  auto q = torch::randn({N, H, L, E}, kF64), k = torch::randn({N, H, L, E}, kF64),
       v = torch::randn({N, H, L, 7}, kF64);
  auto lengths = torch::tensor({97, 40});
  for (const auto& mask : {Mask(), Mask::causal_mask(), Mask().with_key_lengths(lengths),
                           Mask::causal_mask().with_key_lengths(lengths)}) {
    SCOPED_TRACE(mask.to_string());
    auto out = attn->forward(q, k, v, mask);
    auto ref =
        reference::full_attention(q, k, v, std::nullopt, mask.key_lengths(), mask.is_causal());
    EXPECT_LT(testing::max_abs_diff(out, ref), 1e-10);
  }
}

// ---- the losses -------------------------------------------------------------------------

// L1 and L2 written with loops from their formulas (float64, differentiable).
std::pair<torch::Tensor, torch::Tensor> loss_formulas(const torch::Tensor& x,
                                                      const torch::Tensor& c,
                                                      const torch::Tensor& wc,
                                                      const std::vector<int64_t>& lengths) {
  const int64_t N = x.size(0), L = x.size(1), k = c.size(0);
  auto l1 = torch::zeros({}, kF64), l2 = torch::zeros({}, kF64);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t len = lengths.empty() ? L : lengths[n];
    auto z = x[n].slice(0, 0, len).matmul(wc);    // (len, D)
    auto u = torch::softmax(c.matmul(z.t()), 1);  // (k, len)
    auto cp = u.matmul(z);                        // (k, D)
    auto assign = u.argmax(0);
    auto s1 = torch::zeros({}, kF64);
    for (int64_t j = 0; j < len; ++j) s1 = s1 + x[n][j].dot(cp[assign[j].item<int64_t>()]);
    l1 = l1 - s1 / double(len) / double(N);
    auto s2 = cp[0].dot(cp[k - 1]);
    for (int64_t i = 1; i < k; ++i) s2 = s2 + cp[i].dot(cp[i - 1]);
    l2 = l2 - s2 / double(k) / double(N);
  }
  return {l1, l2};
}

TEST(ClusterFormer, LossesEqualTheirFormulasWithGradients) {
  for (const auto& lengths : {std::vector<int64_t>{}, std::vector<int64_t>{9, 4}}) {
    OpCase c;
    c.name = lengths.empty() ? "losses, no padding" : "losses, lengths {9, 4}";
    c.make_inputs = [](uint64_t seed) {
      torch::manual_seed(seed);
      return Inputs{torch::randn({2, 9, 6}, kF64), torch::randn({3, 6}, kF64),
                    torch::randn({6, 6}, kF64) * 0.5};
    };
    auto lens = [lengths]() -> std::optional<torch::Tensor> {
      if (lengths.empty()) return std::nullopt;
      return torch::tensor(lengths, torch::kLong);
    };
    // Both losses in one output, weighted differently so that each counts.
    c.op = [lens](const Inputs& in) {
      auto cl = clusterformer_cluster(in[0], in[1], in[2], lens());
      return torch::stack(
          {cl.clustering_loss, cl.sorting_loss, cl.clustering_loss * 0.3 + cl.sorting_loss * 0.7});
    };
    c.reference = [lengths](const Inputs& in) {
      auto [l1, l2] = loss_formulas(in[0], in[1], in[2], lengths);
      return torch::stack({l1, l2, l1 * 0.3 + l2 * 0.7});
    };
    c.f32_tol = 1e-4;  // sums of products of O(10) magnitudes in float32
    testing::check_op(c);
  }
}

TEST(ClusterFormer, PaddedTokensTakeNoPartInTheClustering) {
  torch::manual_seed(4);
  auto x = torch::randn({1, 10, 4}, kF64);
  auto c = torch::randn({3, 4}, kF64), wc = torch::randn({4, 4}, kF64);
  auto lengths = torch::tensor({6});
  auto a = clusterformer_cluster(x, c, wc, lengths);
  auto x2 = x.clone();
  x2.slice(1, 6).normal_();
  auto b = clusterformer_cluster(x2, c, wc, lengths);
  EXPECT_TRUE(a.order.equal(b.order));
  EXPECT_TRUE(a.updated_centroids.allclose(b.updated_centroids, 0, 0));
  EXPECT_EQ(a.clustering_loss.item<double>(), b.clustering_loss.item<double>());
  auto plain = clusterformer_cluster(x.slice(1, 0, 6), c, wc);
  EXPECT_LT(testing::max_abs_diff(plain.updated_centroids, a.updated_centroids), 1e-12);
}

// ---- the attention type ---------------------------------------------------------------------

AttentionDims dims_of(int64_t H, int64_t E) {
  AttentionDims d;
  d.heads = H;
  d.query_dim = E;
  d.value_dim = E;
  return d;
}

TEST(ClusterFormer, CausalNeverSeesLaterKeysOrValues) {
  torch::manual_seed(5);
  const int64_t N = 2, H = 2, L = 29, E = 4;
  auto attn = make_attention("clusterformer", {{"clusters", int64_t(4)}, {"seed", int64_t(1)}},
                             dims_of(H, E));
  auto q = torch::randn({N, H, L, E}, kF64);
  auto k = torch::randn({N, H, L, E}, kF64).requires_grad_(true);
  auto v = torch::randn({N, H, L, E}, kF64).requires_grad_(true);
  auto out = attn->forward(q, k, v, Mask::causal_mask());
  for (int64_t i : {0, 5, 17, 27}) {  // i < L - 1: some later position exists
    // Changing keys and values after i leaves out_i alone (the clustering
    // reads the queries only) ...
    auto k2 = k.detach().clone(), v2 = v.detach().clone();
    k2.slice(2, i + 1).normal_();
    v2.slice(2, i + 1).normal_();
    auto out2 = attn->forward(q, k2, v2, Mask::causal_mask());
    EXPECT_LT(testing::max_abs_diff(out.slice(2, 0, i + 1), out2.slice(2, 0, i + 1)), 1e-12) << i;
    // ... and out_i has zero gradient to them.
    auto [gk, gv] = [&] {
      auto g = torch::autograd::grad({out.select(2, i).sum()}, {k, v}, {}, true);
      return std::make_pair(g[0], g[1]);
    }();
    EXPECT_EQ(gk.slice(2, i + 1).abs().max().item<double>(), 0.0) << i;
    EXPECT_EQ(gv.slice(2, i + 1).abs().max().item<double>(), 0.0) << i;
    EXPECT_GT(gv.slice(2, 0, i + 1).abs().max().item<double>(), 0.0) << i;
  }
}

TEST(ClusterFormer, PaddingIsRespected) {
  torch::manual_seed(6);
  const int64_t N = 2, H = 2, L = 21, E = 3;
  auto attn = make_attention("clusterformer", {{"clusters", int64_t(3)}, {"seed", int64_t(2)}},
                             dims_of(H, E));
  auto q = torch::randn({N, H, L, E}, kF64), k = torch::randn({N, H, L, E}, kF64),
       v = torch::randn({N, H, L, E}, kF64);
  auto lengths = torch::tensor({21, 8});
  for (bool causal : {false, true}) {
    auto mask = Mask().with_key_lengths(lengths).with_causal(causal);
    auto out = attn->forward(q, k, v, mask);
    auto q2 = q.clone(), k2 = k.clone(), v2 = v.clone();
    for (auto* t : {&q2, &k2, &v2}) (*t)[1].slice(1, 8).normal_();
    auto out2 = attn->forward(q2, k2, v2, mask);
    EXPECT_TRUE(out[0].equal(out2[0]));
    EXPECT_LT(testing::max_abs_diff(out[1].slice(1, 0, 8), out2[1].slice(1, 0, 8)), 1e-12);
    EXPECT_TRUE(std::dynamic_pointer_cast<ClusterFormerAttention>(attn)
                    ->last_clustering()
                    .assignments[1]
                    .slice(0, 8)
                    .eq(3)
                    .all()
                    .item<bool>());
  }
}

TEST(ClusterFormer, BadParametersAndInputsAreNamed) {
  EXPECT_ERROR_CONTAINS(make_attention("clusterformer", {{"clusters", int64_t(0)}}), "clusters");
  EXPECT_ERROR_CONTAINS(make_attention("clusterformer", {{"centroid_mode", std::string("x")}}),
                        "centroid_mode");
  EXPECT_ERROR_CONTAINS(make_attention("clusterformer", {{"sorting_loss_weight", -1.0}}),
                        "sorting_loss_weight");
  EXPECT_ERROR_CONTAINS(make_attention("clusterformer", {{"clusterz", int64_t(2)}}), "clusterz");
  auto attn = make_attention("clusterformer", {}, dims_of(2, 4));
  auto q = torch::randn({1, 2, 6, 4});
  EXPECT_ERROR_CONTAINS(
      attn->forward(q, torch::randn({1, 2, 5, 4}), torch::randn({1, 2, 5, 4}), Mask()), "S == L");
  EXPECT_ERROR_CONTAINS(
      attn->forward(q, q, q, Mask().with_attn_mask(torch::ones({6, 6}, torch::kBool))),
      "clusterformer: attn_mask: got a boolean attn_mask of shape [6, 6], which clusterformer "
      "does not take");
  auto q3 = torch::randn({1, 3, 6, 4});
  EXPECT_ERROR_CONTAINS(attn->forward(q3, q3, q3, Mask()), "H·E = 8");
  EXPECT_ERROR_CONTAINS(
      clusterformer_cluster(torch::randn({1, 6, 4}), torch::randn({3, 5}), torch::randn({4, 4})),
      "centroids");
}

TEST(ClusterFormer, SameSeedSameParameters) {
  auto a = std::dynamic_pointer_cast<ClusterFormerAttention>(
      make_attention("clusterformer", {{"seed", int64_t(7)}}, dims_of(2, 4)));
  auto b = std::dynamic_pointer_cast<ClusterFormerAttention>(
      make_attention("clusterformer", {{"seed", int64_t(7)}}, dims_of(2, 4)));
  EXPECT_TRUE(a->centroids().equal(b->centroids()));
  EXPECT_TRUE(a->projection().equal(b->projection()));
  EXPECT_EQ(a->centroids().sizes(), (torch::IntArrayRef{8, 8}));
}

// ---- in a stack --------------------------------------------------------------------------------

std::vector<std::shared_ptr<ClusterFormerAttention>> clusterformers(torch::nn::Module& m) {
  std::vector<std::shared_ptr<ClusterFormerAttention>> out;
  for (const auto& mod : m.modules(false)) {
    if (auto cf = std::dynamic_pointer_cast<ClusterFormerAttention>(mod)) out.push_back(cf);
  }
  return out;
}

TEST(ClusterFormer, HandedModeChainsTheCentroidsOfAStack) {
  torch::manual_seed(8);
  for (const std::string mode : {"handed", "per-layer"}) {
    SCOPED_TRACE(mode);
    auto enc =
        EncoderBuilder()
            .layers(3)
            .heads(2)
            .d_model(8)
            .dropout(0.0)
            .attention("clusterformer",
                       {{"clusters", int64_t(3)}, {"centroid_mode", mode}, {"seed", int64_t(3)}})
            .build();
    auto y = enc->forward(torch::randn({2, 10, 8}));
    auto aux = take_auxiliary_losses(*enc);
    ASSERT_TRUE(aux.defined());
    EXPECT_FALSE(take_auxiliary_losses(*enc).defined());  // taken once
    (y.pow(2).mean() + aux).backward();
    auto cfs = clusterformers(*enc);
    ASSERT_EQ(cfs.size(), 3u);
    // The first layer's centroids always learn; later layers' own centroids
    // only in per-layer mode (handed: they cluster with the previous C').
    EXPECT_TRUE(cfs[0]->centroids().grad().defined());
    for (size_t i = 1; i < 3; ++i) {
      EXPECT_EQ(cfs[i]->centroids().grad().defined(), mode == "per-layer") << i;
      EXPECT_TRUE(cfs[i]->projection().grad().defined()) << i;
    }
  }
}

TEST(ClusterFormer, DecoderWithClusterFormerSelfAttention) {
  torch::manual_seed(9);
  auto dec = DecoderBuilder()
                 .layers(2)
                 .heads(2)
                 .d_model(8)
                 .dropout(0.0)
                 .self_attention("clusterformer", {{"clusters", int64_t(2)}})
                 .build();
  auto y = dec->forward(torch::randn({2, 9, 8}), torch::randn({2, 5, 8}));
  EXPECT_EQ(y.sizes(), (torch::IntArrayRef{2, 9, 8}));
  auto aux = take_auxiliary_losses(*dec);
  ASSERT_TRUE(aux.defined());
  EXPECT_TRUE(std::isfinite(aux.item<double>()));
}

TEST(ClusterFormer, TinyModelTrainsWithItsLosses) {
  // Toy task: every token must output the mean of the sequence's tokens (it
  // needs attention); a 2-layer encoder with clusterformer, Adam, 150 steps.
  torch::manual_seed(10);
  const int64_t D = 16, L = 24;
  auto enc = EncoderBuilder()
                 .layers(2)
                 .heads(2)
                 .d_model(D)
                 .dropout(0.0)
                 .attention("clusterformer", {{"clusters", int64_t(3)},
                                              {"clustering_loss_weight", 0.01},
                                              {"sorting_loss_weight", 0.01},
                                              {"seed", int64_t(4)}})
                 .build();
  auto head = torch::nn::Linear(D, D);
  std::vector<torch::Tensor> params = enc->parameters();
  for (auto& p : head->parameters()) params.push_back(p);
  torch::optim::Adam opt(params, torch::optim::AdamOptions(3e-3));
  auto batch = [&] {
    auto x = torch::randn({8, L, D});
    return std::make_pair(x, x.mean(1, true).expand({8, L, D}));
  };
  auto task_loss = [&](const torch::Tensor& x, const torch::Tensor& t) {
    return torch::mse_loss(head->forward(enc->forward(x)), t);
  };
  torch::manual_seed(11);
  auto [xe, te] = batch();
  double before;
  {
    torch::NoGradGuard g;
    before = task_loss(xe, te).item<double>();
    take_auxiliary_losses(*enc);
  }
  auto cfs = clusterformers(*enc);
  ASSERT_EQ(cfs.size(), 2u);
  for (int step = 0; step < 150; ++step) {
    auto [x, t] = batch();
    opt.zero_grad();
    auto loss = task_loss(x, t);
    auto aux = take_auxiliary_losses(*enc);
    ASSERT_TRUE(aux.defined());
    ASSERT_TRUE(std::isfinite(aux.item<double>())) << step;
    (loss + aux).backward();
    if (step == 0) {
      EXPECT_GT(cfs[0]->centroids().grad().abs().sum().item<double>(), 0.0);
      for (auto& cf : cfs) EXPECT_GT(cf->projection().grad().abs().sum().item<double>(), 0.0);
    }
    opt.step();
  }
  double after;
  {
    torch::NoGradGuard g;
    after = task_loss(xe, te).item<double>();
    take_auxiliary_losses(*enc);
  }
  EXPECT_LT(after, 0.5 * before) << "before " << before << " after " << after;
}

}  // namespace
}  // namespace fastattn
