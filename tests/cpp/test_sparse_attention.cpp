// Block-sparse attention (`local`, `sparse-strided`, `sparse-fixed`) against
// dense masked softmax: every pattern and mode, forward and gradients
// (float64), causality, padding, awkward lengths, bad parameters, and the
// builders' interleaved layers.
//   ./build/fastattn_tests --gtest_filter='Sparse*:LocalAttention*'
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <set>

#include "expect_error.h"
#include "fastattn/fastattn.h"
#include "op_harness.h"

namespace fastattn {
namespace {

using testing::Inputs;
using testing::OpCase;

struct SparseCfg {
  std::string name;
  std::string pattern;
  std::vector<int64_t> params;
  int64_t N, H, L, S, E, M;
  bool causal = false;
  std::vector<int64_t> lengths;  // empty: no key lengths
  std::optional<double> temp;
};

OpCase make_case(const SparseCfg& c) {
  OpCase oc;
  oc.name = c.name;
  std::optional<torch::Tensor> lengths;
  if (!c.lengths.empty()) lengths = torch::tensor(c.lengths, torch::kLong);
  oc.make_inputs = [c](uint64_t seed) -> Inputs {
    torch::manual_seed(seed);
    return {torch::randn({c.N, c.H, c.L, c.E}, torch::kDouble),
            torch::randn({c.N, c.H, c.S, c.E}, torch::kDouble),
            torch::randn({c.N, c.H, c.S, c.M}, torch::kDouble)};
  };
  oc.op = [c, lengths](const Inputs& x) {
    return block_sparse_attention(x[0], x[1], x[2], c.pattern, c.params, lengths, c.causal, c.temp);
  };
  oc.reference = [c, lengths](const Inputs& x) {
    return reference::block_sparse_attention(x[0], x[1], x[2], c.pattern, c.params, lengths,
                                             c.causal, c.temp);
  };
  oc.f64_tol = 1e-12;
  // float32: inputs rounded to float32 (relative 6e-8), sums over at most S·E
  // products in float32; outputs are O(1). Same budget as full attention.
  oc.f32_tol = 2e-5;
  return oc;
}

class SparseAttentionCases : public ::testing::TestWithParam<SparseCfg> {};

// Under 1 thread the backward takes its one pass per head; under 7 (which
// divides no case's N·H and exceeds a quarter of it) its two passes per part.
TEST_P(SparseAttentionCases, MatchesDenseMaskedReference) {
  const int saved = at::get_num_threads();
  for (int threads : {1, 7}) {
    SCOPED_TRACE(std::to_string(threads) + " threads");
    at::set_num_threads(threads);
    testing::check_op(make_case(GetParam()));
  }
  at::set_num_threads(saved);
}

// which: 0 merged, 1 A1, 2 A2, 3 split heads.
INSTANTIATE_TEST_SUITE_P(
    SparsePatterns, SparseAttentionCases,
    ::testing::Values(
        SparseCfg{"local_bidir_97", "local", {16}, 2, 2, 97, 97, 16, 16},
        SparseCfg{"local_causal_97", "local", {16}, 2, 2, 97, 97, 16, 16, true},
        SparseCfg{"local_odd_window", "local", {7}, 1, 2, 40, 40, 9, 5},
        SparseCfg{"local_wide_window", "local", {300}, 1, 1, 97, 97, 8, 8, true},
        SparseCfg{"local_S_gt_L", "local", {9}, 1, 2, 30, 50, 8, 6},
        SparseCfg{"local_causal_S_gt_L", "local", {9}, 1, 2, 30, 50, 8, 6, true},
        SparseCfg{"local_causal_S_lt_L", "local", {9}, 1, 2, 50, 30, 8, 6, true},
        SparseCfg{"local_lengths", "local", {20}, 3, 2, 97, 97, 8, 8, false, {97, 40, 0}},
        SparseCfg{"local_temp", "local", {12}, 1, 1, 70, 70, 8, 8, true, {}, 0.7},
        // A key tile reached by more query tiles (of 64) than the backward
        // keeps in its slots (8): tiles leave their slot and come back, their
        // dQ written, then added to.
        SparseCfg{"local_window_over_many_tiles", "local", {700}, 1, 1, 760, 760, 8, 8},
        // The dense-attention engine's windows: offsets [-left, right].
        SparseCfg{"window_3_5", "window", {3, 5}, 1, 2, 97, 97, 8, 8},
        SparseCfg{"window_causal_S_lt_L", "window", {6, 2}, 1, 2, 50, 30, 8, 6, true},
        SparseCfg{"window_0_0_lengths", "window", {0, 0}, 3, 1, 40, 40, 4, 4, false, {40, 9, 0}},
        SparseCfg{"strided_merged_causal", "strided", {10, 0}, 2, 2, 97, 97, 16, 16, true},
        SparseCfg{"strided_merged_bidir", "strided", {10, 0}, 2, 2, 97, 97, 16, 16},
        SparseCfg{"strided_A1_causal", "strided", {10, 1}, 1, 2, 97, 97, 8, 8, true},
        SparseCfg{"strided_A2_causal", "strided", {10, 2}, 1, 2, 97, 97, 8, 8, true},
        SparseCfg{"strided_A2_bidir", "strided", {10, 2}, 1, 2, 97, 97, 8, 8},
        SparseCfg{"strided_split_causal", "strided", {10, 3}, 1, 3, 97, 97, 8, 8, true},
        SparseCfg{"strided_split_bidir", "strided", {7, 3}, 1, 4, 97, 97, 8, 8},
        SparseCfg{"strided_long_stride", "strided", {70, 0}, 1, 2, 300, 300, 8, 8, true},
        SparseCfg{"strided_tiny_stride", "strided", {3, 0}, 1, 1, 200, 200, 8, 8},
        SparseCfg{"strided_S_gt_L", "strided", {6, 0}, 1, 2, 40, 77, 8, 8, true},
        SparseCfg{"strided_S_lt_L", "strided", {6, 0}, 1, 2, 77, 40, 8, 8, true},
        SparseCfg{"strided_S_ne_L_bidir", "strided", {5, 0}, 1, 2, 41, 66, 8, 8},
        SparseCfg{"strided_lengths", "strided", {9, 0}, 3, 2, 97, 97, 8, 8, true, {97, 50, 0}},
        SparseCfg{"strided_stride_gt_L", "strided", {500, 0}, 1, 1, 60, 60, 8, 8, true},
        SparseCfg{"fixed_merged_causal", "fixed", {12, 3, 0, 0}, 2, 2, 97, 97, 16, 16, true},
        SparseCfg{"fixed_merged_bidir", "fixed", {12, 3, 0, 0}, 2, 2, 97, 97, 16, 16},
        SparseCfg{"fixed_A1_causal", "fixed", {12, 3, 1, 0}, 1, 2, 97, 97, 8, 8, true},
        SparseCfg{"fixed_A2_causal", "fixed", {12, 3, 2, 0}, 1, 2, 97, 97, 8, 8, true},
        SparseCfg{"fixed_A2_bidir", "fixed", {12, 3, 2, 0}, 1, 2, 97, 97, 8, 8},
        SparseCfg{"fixed_split", "fixed", {12, 3, 3, 0}, 1, 4, 97, 97, 8, 8, true},
        SparseCfg{"fixed_per_head", "fixed", {12, 3, 0, 1}, 1, 5, 97, 97, 8, 8, true},
        SparseCfg{"fixed_per_head_bidir", "fixed", {16, 4, 0, 1}, 1, 4, 130, 130, 8, 8},
        SparseCfg{"fixed_summary_eq_stride", "fixed", {8, 8, 0, 0}, 1, 1, 97, 97, 8, 8, true},
        SparseCfg{"fixed_big_blocks", "fixed", {100, 10, 0, 0}, 1, 2, 300, 300, 8, 8, true},
        SparseCfg{"fixed_S_gt_L", "fixed", {8, 2, 0, 0}, 1, 2, 40, 77, 8, 8, true},
        SparseCfg{"fixed_S_lt_L", "fixed", {8, 2, 0, 0}, 1, 2, 77, 40, 8, 8, true},
        SparseCfg{"fixed_S_ne_L_bidir", "fixed", {8, 2, 0, 1}, 1, 3, 41, 66, 8, 8},
        SparseCfg{"fixed_lengths", "fixed", {9, 2, 0, 0}, 3, 2, 97, 97, 8, 8, false, {97, 50, 0}},
        SparseCfg{"awkward_local_1025", "local", {100}, 1, 1, 1025, 1025, 16, 16, true},
        SparseCfg{"awkward_strided_1025", "strided", {32, 0}, 1, 1, 1025, 1025, 16, 16, true},
        SparseCfg{"awkward_fixed_1025", "fixed", {32, 4, 0, 0}, 1, 1, 1025, 1025, 16, 16}),
    [](const ::testing::TestParamInfo<SparseCfg>& info) { return info.param.name; });

// The patterns' dense masks against the definitions, written independently of
// reference::block_sparse_mask (the paper's examples, Child et al. 2019 fig. 3).
std::set<int64_t> kept(const torch::Tensor& mask, int64_t h, int64_t i) {
  std::set<int64_t> out;
  auto row = mask[h][i];
  for (int64_t j = 0; j < row.size(0); ++j)
    if (row[j].item<bool>()) out.insert(j);
  return out;
}

TEST(SparsePatterns, PaperExamples) {
  // strided, l = 5, query 28, causal: A1 = {23..28}, A2 = {3, 8, ..., 28}.
  auto a1 = reference::block_sparse_mask("strided", {5, 1}, true, 1, 40, 40);
  auto a2 = reference::block_sparse_mask("strided", {5, 2}, true, 1, 40, 40);
  EXPECT_EQ(kept(a1, 0, 28), (std::set<int64_t>{23, 24, 25, 26, 27, 28}));
  EXPECT_EQ(kept(a2, 0, 28), (std::set<int64_t>{3, 8, 13, 18, 23, 28}));
  // fixed, l = 6, c = 1, query 28, causal: A1 = {24..28}, A2 = {5, 11, 17, 23}.
  auto f1 = reference::block_sparse_mask("fixed", {6, 1, 1, 0}, true, 1, 40, 40);
  auto f2 = reference::block_sparse_mask("fixed", {6, 1, 2, 0}, true, 1, 40, 40);
  EXPECT_EQ(kept(f1, 0, 28), (std::set<int64_t>{24, 25, 26, 27, 28}));
  EXPECT_EQ(kept(f2, 0, 28), (std::set<int64_t>{5, 11, 17, 23}));
  // merged = union; split = A1 on head 0, A2 on head 1.
  auto m = reference::block_sparse_mask("strided", {5, 0}, true, 1, 40, 40);
  EXPECT_TRUE(m[0].equal(a1[0] | a2[0]));
  auto sp = reference::block_sparse_mask("fixed", {6, 1, 3, 0}, true, 2, 40, 40);
  EXPECT_TRUE(sp[0].equal(f1[0]));
  EXPECT_TRUE(sp[1].equal(f2[0]));
  // per-head summaries: l = 8, c = 2, head 1 uses residues {4, 5}.
  auto ph = reference::block_sparse_mask("fixed", {8, 2, 2, 1}, false, 2, 20, 20);
  EXPECT_EQ(kept(ph, 1, 0), (std::set<int64_t>{4, 5, 12, 13}));
  EXPECT_EQ(kept(ph, 0, 0), (std::set<int64_t>{6, 7, 14, 15}));
}

// Every pattern equals the fused full attention with the pattern's dense mask
// (forward and gradients, float64).
TEST(SparseAttention, EqualsFullAttentionWithDenseMask) {
  struct P {
    std::string pattern;
    std::vector<int64_t> params;
  };
  const std::vector<P> patterns = {{"local", {13}},          {"strided", {9, 0}},
                                   {"strided", {9, 1}},      {"strided", {9, 2}},
                                   {"strided", {9, 3}},      {"fixed", {10, 3, 0, 0}},
                                   {"fixed", {10, 3, 1, 0}}, {"fixed", {10, 3, 2, 0}},
                                   {"fixed", {10, 3, 3, 0}}, {"fixed", {10, 2, 0, 1}}};
  const int64_t N = 2, H = 4, L = 90, S = 90, E = 8;
  auto lengths = torch::tensor({90, 61}, torch::kLong);
  for (const auto& p : patterns) {
    for (bool causal : {false, true}) {
      SCOPED_TRACE(p.pattern + " " + std::to_string(&p - patterns.data()) +
                   " causal=" + std::to_string(causal));
      torch::manual_seed(5);
      auto q = torch::randn({N, H, L, E}, torch::kDouble).requires_grad_();
      auto k = torch::randn({N, H, S, E}, torch::kDouble).requires_grad_();
      auto v = torch::randn({N, H, S, E}, torch::kDouble).requires_grad_();
      auto keep = reference::block_sparse_mask(p.pattern, p.params, causal, H, L, S)
                      .unsqueeze(0)
                      .expand({N, H, L, S});
      auto out = block_sparse_attention(q, k, v, p.pattern, p.params, lengths, causal);
      auto full = full_attention(q, k, v, keep, lengths, false);
      EXPECT_LE(testing::max_abs_diff(out, full), 1e-12);
      auto w = torch::randn_like(out);
      auto g1 = torch::autograd::grad({(out * w).sum()}, {q, k, v});
      auto g2 = torch::autograd::grad({(full * w).sum()}, {q, k, v});
      for (int x = 0; x < 3; ++x) EXPECT_LE(testing::max_abs_diff(g1[x], g2[x]), 1e-11);
    }
  }
}

// The layers' (N, L, H, E) views, padded rows and heads broadcast with
// stride 0 are read and written in place (the kernel takes row strides), as
// the contiguous copies give: the identity order (local, several query and
// key tiles, S != L), the residue and summary orders (strided, fixed) that
// gather rows, two parts per head, causal, key lengths.
TEST(SparseAttention, ReadsAndWritesRowLayoutsInPlace) {
  using torch::Tensor;
  const auto lengths = torch::tensor({int64_t(150), int64_t(97)}, torch::kLong);
  const std::vector<std::pair<std::string, std::vector<int64_t>>> patterns = {
      {"local", {37}}, {"strided", {9, 0}}, {"fixed", {10, 3, 3, 0}}};
  for (const auto& [pattern, params] : patterns) {
    for (bool causal : {false, true}) {
      SCOPED_TRACE(pattern + " causal=" + std::to_string(causal));
      testing::check_row_layouts(
          [&](const Tensor& q, const Tensor& k, const Tensor& v) {
            return block_sparse_attention(q, k, v, pattern, params, lengths, causal);
          },
          2, 3, causal ? 150 : 130, 150, 8, 6);
    }
  }
}

// local equals full attention with a band mask built here from its definition.
TEST(LocalAttention, EqualsFullWithBandMask) {
  const int64_t L = 97, S = 97, w = 10;
  for (bool causal : {false, true}) {
    auto band = torch::zeros({L, S}, torch::kBool);
    for (int64_t i = 0; i < L; ++i)
      for (int64_t j = 0; j < S; ++j) {
        const int64_t d = j - i;
        band[i][j] = causal ? (d <= 0 && d > -w) : (d >= -w / 2 && d < w - w / 2);
      }
    torch::manual_seed(2);
    auto q = torch::randn({1, 2, L, 16}, torch::kDouble),
         k = torch::randn({1, 2, S, 16}, torch::kDouble),
         v = torch::randn({1, 2, S, 16}, torch::kDouble);
    auto attn = make_attention("local", {{"window", w}});
    auto mask = causal ? Mask::causal_mask() : Mask();
    auto out = attn->forward(q, k, v, mask);
    auto full = full_attention(q, k, v, band);
    EXPECT_LE(testing::max_abs_diff(out, full), 1e-12) << "causal=" << causal;
  }
}

// Causal variants never see the future: changing keys/values after position t
// leaves the outputs up to t unchanged, and their gradients there are zero.
TEST(SparseAttention, CausalNeverSeesTheFuture) {
  const std::vector<std::pair<std::string, ParamMap>> types = {
      {"local", {{"window", int64_t{9}}}},
      {"sparse-strided", {{"stride", int64_t{7}}}},
      {"sparse-strided", {{"stride", int64_t{7}}, {"mode", std::string("split")}}},
      {"sparse-fixed", {{"stride", int64_t{8}}, {"summary", int64_t{2}}}},
      {"sparse-fixed",
       {{"stride", int64_t{8}}, {"summary", int64_t{2}}, {"per_head_summary", true}}}};
  const int64_t L = 150, t = 71;
  for (const auto& [type, params] : types) {
    SCOPED_TRACE(type);
    auto attn = make_attention(type, params);
    torch::manual_seed(9);
    auto q = torch::randn({1, 4, L, 8}, torch::kDouble);
    auto k = torch::randn({1, 4, L, 8}, torch::kDouble).requires_grad_();
    auto v = torch::randn({1, 4, L, 8}, torch::kDouble).requires_grad_();
    using torch::indexing::Slice;
    auto out = attn->forward(q, k, v, Mask::causal_mask());
    auto k2 = k.detach().clone(), v2 = v.detach().clone();
    k2.index_put_({Slice(), Slice(), Slice(t + 1)},
                  torch::randn({1, 4, L - t - 1, 8}, torch::kDouble));
    v2.index_put_({Slice(), Slice(), Slice(t + 1)},
                  torch::randn({1, 4, L - t - 1, 8}, torch::kDouble));
    auto out2 = attn->forward(q, k2, v2, Mask::causal_mask());
    auto past = Slice(0, t + 1);
    EXPECT_TRUE(out.index({Slice(), Slice(), past}).equal(out2.index({Slice(), Slice(), past})));
    out.index({Slice(), Slice(), past}).sum().backward();
    EXPECT_EQ(k.grad().index({Slice(), Slice(), Slice(t + 1)}).abs().max().item<double>(), 0.0);
    EXPECT_EQ(v.grad().index({Slice(), Slice(), Slice(t + 1)}).abs().max().item<double>(), 0.0);
  }
}

// Padded keys change nothing and get zero gradients; rows without keys are
// zeros with zero gradients.
TEST(SparseAttention, PaddingRespected) {
  using torch::indexing::Slice;
  for (const char* type : {"local", "sparse-strided", "sparse-fixed"}) {
    SCOPED_TRACE(type);
    auto attn = make_attention(type, {});
    torch::manual_seed(4);
    auto q = torch::randn({2, 2, 97, 8}, torch::kDouble).requires_grad_();
    auto k = torch::randn({2, 2, 97, 8}, torch::kDouble).requires_grad_();
    auto v = torch::randn({2, 2, 97, 8}, torch::kDouble).requires_grad_();
    auto mask = Mask().with_key_lengths(torch::tensor({60, 0}, torch::kLong));
    auto out = attn->forward(q, k, v, mask);
    auto k2 = k.detach().clone(), v2 = v.detach().clone();
    k2.index_put_({0, Slice(), Slice(60)}, 100.0);
    v2.index_put_({0, Slice(), Slice(60)}, -7.0);
    EXPECT_TRUE(out[0].equal(attn->forward(q, k2, v2, mask)[0]));
    EXPECT_EQ(out[1].abs().max().item<double>(), 0.0);
    out.sum().backward();
    EXPECT_EQ(k.grad().index({0, Slice(), Slice(60)}).abs().max().item<double>(), 0.0);
    EXPECT_EQ(v.grad().index({0, Slice(), Slice(60)}).abs().max().item<double>(), 0.0);
    EXPECT_EQ(q.grad()[1].abs().max().item<double>(), 0.0);
    EXPECT_TRUE(torch::isfinite(q.grad()).all().item<bool>());
  }
}

TEST(SparseAttention, RegistryDefaultsAndModes) {
  // Default stride round(sqrt(L)); default summary min(8, l).
  auto s = std::dynamic_pointer_cast<SparseTransformerAttention>(make_attention("sparse-strided"));
  ASSERT_TRUE(s);
  EXPECT_EQ(s->pattern(97).second, (std::vector<int64_t>{10, 0}));
  auto f = std::dynamic_pointer_cast<SparseTransformerAttention>(
      make_attention("sparse-fixed", {{"stride", int64_t{128}}, {"mode", std::string("split")}}));
  EXPECT_EQ(f->pattern(1000).second, (std::vector<int64_t>{128, 8, 3, 0}));
  auto i = std::dynamic_pointer_cast<SparseTransformerAttention>(
      make_attention("sparse-fixed", {{"mode", std::string("interleaved")}, {"part", int64_t{2}}}));
  EXPECT_EQ(i->pattern(64).second, (std::vector<int64_t>{8, 8, 2, 0}));
  // The type equals the op with the same pattern.
  torch::manual_seed(1);
  auto q = torch::randn({1, 2, 97, 8}), k = torch::randn({1, 2, 97, 8}),
       v = torch::randn({1, 2, 97, 8});
  EXPECT_TRUE(s->forward(q, k, v, Mask::causal_mask())
                  .equal(block_sparse_attention(q, k, v, "strided", {10, 0}, std::nullopt, true)));
}

TEST(SparseAttention, BadParametersNameThem) {
  EXPECT_ERROR_CONTAINS(make_attention("local", {{"window", int64_t{0}}}), "window");
  EXPECT_ERROR_CONTAINS(make_attention("sparse-strided", {{"stride", int64_t{0}}}), "stride");
  EXPECT_ERROR_CONTAINS(make_attention("sparse-strided", {{"mode", std::string("diagonal")}}),
                        "mode", "merged");
  EXPECT_ERROR_CONTAINS(make_attention("sparse-strided", {{"part", int64_t{3}}}), "part");
  EXPECT_ERROR_CONTAINS(make_attention("sparse-strided", {{"part", int64_t{2}}}), "part",
                        "interleaved");
  EXPECT_ERROR_CONTAINS(make_attention("sparse-strided", {{"summary", int64_t{2}}}), "summary");
  EXPECT_ERROR_CONTAINS(
      make_attention("sparse-fixed", {{"stride", int64_t{4}}, {"summary", int64_t{5}}}), "summary",
      "stride");
  EXPECT_ERROR_CONTAINS(make_attention("sparse-fixed", {{"softmax_temp", -1.0}}), "softmax_temp");
  auto q = torch::randn({1, 1, 16, 4});
  // Default stride 4 for L = 16: a summary of 6 cannot fit.
  EXPECT_ERROR_CONTAINS(
      make_attention("sparse-fixed", {{"summary", int64_t{6}}})->forward(q, q, q, Mask()),
      "summary", "stride");
  EXPECT_ERROR_CONTAINS(
      make_attention("sparse-strided", {{"mode", std::string("split")}})->forward(q, q, q, Mask()),
      "split", "heads");
  EXPECT_ERROR_CONTAINS(make_attention("local")->forward(
                            q, q, q, Mask().with_attn_mask(torch::ones({16, 16}, torch::kBool))),
                        "attn_mask");
  EXPECT_ERROR_CONTAINS(block_sparse_attention(q, q, q, "diagonal", {1}), "pattern", "diagonal");
  EXPECT_ERROR_CONTAINS(block_sparse_attention(q, q, q, "strided", {4}), "params");
  EXPECT_ERROR_CONTAINS(block_sparse_attention(q, q, q, "strided", {4, 7}), "which");
  EXPECT_ERROR_CONTAINS(block_sparse_attention(q, q, q, "local", {4}, torch::tensor({17})),
                        "key_lengths");
}

// The builders give interleaved layers A1, A2, A1, ... (Child et al. eq. 6).
TEST(SparseAttention, BuilderInterleavesLayers) {
  auto encoder = EncoderBuilder()
                     .layers(3)
                     .heads(2)
                     .d_model(16)
                     .attention("sparse-strided",
                                {{"mode", std::string("interleaved")}, {"stride", int64_t{4}}})
                     .build();
  std::vector<int64_t> parts;
  for (const auto& item : encoder->named_modules()) {
    auto s = std::dynamic_pointer_cast<SparseTransformerAttention>(item.value());
    if (s) parts.push_back(s->pattern(16).second[1]);
  }
  EXPECT_EQ(parts, (std::vector<int64_t>{1, 2, 1}));
  auto y = encoder->forward(torch::randn({2, 21, 16}), Mask::causal_mask());
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{2, 21, 16}));
  auto decoder = DecoderBuilder()
                     .layers(2)
                     .heads(2)
                     .d_model(16)
                     .self_attention("sparse-fixed", {{"mode", std::string("interleaved")}})
                     .build();
  parts.clear();
  for (const auto& item : decoder->named_modules()) {
    auto s = std::dynamic_pointer_cast<SparseTransformerAttention>(item.value());
    if (s) parts.push_back(s->pattern(16).second[2]);
  }
  EXPECT_EQ(parts, (std::vector<int64_t>{1, 2}));
}

}  // namespace
}  // namespace fastattn
