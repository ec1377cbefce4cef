// Linear attention (Katharopoulos et al. 2020): the causal_linear_product
// operator against tril(Q K^T) V in float64 (forward, gradients vs autograd of
// the reference and by finite differences) over awkward shapes; the
// elu_feature_map operator against torch::elu(x) + 1; the fused
// elu_linear_attention operator against its dense reference; the `linear`
// and `causal-linear` types against dense references, with key-length
// padding; feature maps (FAVOR+ and RFF approximate their kernels better as
// the number of features grows, seeds, redraw); registry parameters and
// errors; large-norm inputs stay finite in float32.
//
//   build/fastattn_tests --gtest_filter='*CausalLinear*:*LinearAttention*:*FeatureMap*:*EluLinear*'
#include <gtest/gtest.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "expect_error.h"
#include "fastattn/attention.h"
#include "fastattn/feature_maps.h"
#include "fastattn/ops.h"
#include "fastattn/registry.h"
#include "op_harness.h"

namespace fastattn {
namespace {

using testing::Inputs;
using testing::OpCase;
using torch::Tensor;

// ---- causal_linear_product ----------------------------------------------------

struct ProductCfg {
  std::string name;
  int64_t N, H, L, F, M;
};

OpCase product_case(const ProductCfg& c) {
  OpCase oc;
  oc.name = c.name;
  oc.make_inputs = [c](uint64_t seed) -> Inputs {
    torch::manual_seed(seed);
    // q·k ~ N(0, 1) whatever F is.
    const double s = std::pow(static_cast<double>(c.F), -0.25);
    return {torch::randn({c.N, c.H, c.L, c.F}, torch::kDouble) * s,
            torch::randn({c.N, c.H, c.L, c.F}, torch::kDouble) * s,
            torch::randn({c.N, c.H, c.L, c.M}, torch::kDouble)};
  };
  oc.op = [](const Inputs& x) { return causal_linear_product(x[0], x[1], x[2]); };
  oc.reference = [](const Inputs& x) { return reference::causal_linear_product(x[0], x[1], x[2]); };
  // Row i sums i O(1) products: float64 keeps ~1e-15 relative of that sum,
  // float32 ~1e-7 per term with the chunked order differing from BLAS's.
  oc.f64_tol = 1e-11;
  oc.f32_tol = 2e-6 * std::max<int64_t>(8, c.L);
  return oc;
}

class CausalLinearProductCases : public ::testing::TestWithParam<ProductCfg> {};

TEST_P(CausalLinearProductCases, MatchesReference) {
  const auto oc = product_case(GetParam());
  SCOPED_TRACE(oc.name);
  testing::check_forward(oc);
  testing::check_gradients_vs_reference(oc, 0, 1e-9);
  testing::check_finite_differences(oc, 0, 3, 1e-6);
}

// Chunks are 64 rows: 97 and 1025 leave a partial chunk, 64 is exactly one.
INSTANTIATE_TEST_SUITE_P(Shapes, CausalLinearProductCases,
                         ::testing::Values(ProductCfg{"L1", 1, 1, 1, 1, 1},
                                           ProductCfg{"L1_wide", 2, 2, 1, 9, 5},
                                           ProductCfg{"one_chunk", 1, 1, 64, 8, 8},
                                           ProductCfg{"L97_F_ne_M", 2, 3, 97, 16, 24},
                                           ProductCfg{"L130_odd", 1, 2, 130, 33, 17},
                                           ProductCfg{"L97_64x64", 1, 2, 97, 64, 64},
                                           ProductCfg{"L1025_odd", 1, 2, 1025, 7, 5},
                                           ProductCfg{"L1025_F_gt_M", 1, 1, 1025, 40, 3}),
                         [](const ::testing::TestParamInfo<ProductCfg>& info) {
                           return info.param.name;
                         });

TEST(CausalLinearProduct, SameResultWithOneOrTwoThreads) {
  auto q = torch::randn({1, 3, 300, 16}), k = torch::randn({1, 3, 300, 16}),
       v = torch::randn({1, 3, 300, 8});
  const int saved = at::get_num_threads();
  at::set_num_threads(1);
  auto a = causal_linear_product(q, k, v);
  at::set_num_threads(2);
  auto b = causal_linear_product(q, k, v);
  at::set_num_threads(saved);
  EXPECT_TRUE(torch::equal(a, b));
}

TEST(CausalLinearProduct, NonContiguousInputs) {
  auto base = torch::randn({1, 70, 2, 16}, torch::kDouble);  // (N, L, H, F) viewed as (N,H,L,F)
  auto q = base.transpose(1, 2);
  ASSERT_FALSE(q.is_contiguous());
  auto out = causal_linear_product(q, q, q);
  auto ref = reference::causal_linear_product(q.contiguous(), q.contiguous(), q.contiguous());
  EXPECT_LE(testing::max_abs_diff(out, ref), 1e-11);
}

TEST(CausalLinearProduct, BadInputsNameTheArgument) {
  auto q = torch::randn({1, 2, 5, 4}), v = torch::randn({1, 2, 5, 3});
  EXPECT_ERROR_CONTAINS(
      causal_linear_product(q, torch::randn({1, 2, 6, 4}), torch::randn({1, 2, 6, 3})),
      "k must have the length L", "S == L");
  EXPECT_ERROR_CONTAINS(causal_linear_product(q, q, torch::randn({1, 2, 6, 3})),
                        "v must agree with k");
  EXPECT_ERROR_CONTAINS(causal_linear_product(q[0], q, v), "q must have shape");
  EXPECT_ERROR_CONTAINS(causal_linear_product(q, q.to(torch::kDouble), v), "one dtype");
  EXPECT_ERROR_CONTAINS(causal_linear_product(q.to(torch::kInt), q.to(torch::kInt), v),
                        "q must be float32, float64, float16 or bfloat16");
}

TEST(CausalLinearProduct, EmptyInputs) {
  auto out = causal_linear_product(torch::randn({1, 2, 0, 4}), torch::randn({1, 2, 0, 4}),
                                   torch::randn({1, 2, 0, 3}));
  EXPECT_EQ(out.sizes(), (std::vector<int64_t>{1, 2, 0, 3}));
}

// ---- elu_feature_map ---------------------------------------------------------------

TEST(EluFeatureMap, MatchesReference) {
  for (const auto& shape : std::vector<std::vector<int64_t>>{{1}, {7}, {2, 3, 37, 17}, {70000}}) {
    OpCase oc;
    oc.name = "elu_feature_map " + std::to_string(shape.back());
    oc.make_inputs = [shape](uint64_t seed) -> Inputs {
      torch::manual_seed(seed);
      return {torch::randn(shape, torch::kDouble) * 3};
    };
    oc.op = [](const Inputs& x) { return elu_feature_map(x[0]); };
    oc.reference = [](const Inputs& x) { return reference::elu_feature_map(x[0]); };
    oc.f64_tol = 1e-14;  // exp to ~1 ulp on values up to ~10
    oc.f32_tol = 4e-6;   // float32 exp, ~2 ulp of values up to ~10
    SCOPED_TRACE(oc.name);
    testing::check_op(oc);
  }
  // Exact values at and around 0, large inputs, NaN.
  auto x = torch::tensor(
      {0.0, -0.0, 1e-30, -1e-30, 50.0, -200.0, std::numeric_limits<double>::quiet_NaN()},
      torch::kDouble);
  auto y = elu_feature_map(x);
  auto ref = reference::elu_feature_map(x);
  EXPECT_LE(testing::max_abs_diff(y.narrow(0, 0, 6), ref.narrow(0, 0, 6)), 1e-15);
  EXPECT_TRUE(std::isnan(y[6].item<double>()));
  EXPECT_ERROR_CONTAINS(elu_feature_map(torch::ones({3}, torch::kInt)), "x must be float32");
}

// ---- elu_linear_attention (the fused elu map) ------------------------------------

struct EluLinearCfg {
  std::string name;
  int64_t N, H, L, S, E, M;
  bool causal;
  std::vector<int64_t> lengths;  // empty: none
  // Inputs laid out (N, L, H, E) and viewed as (N, H, L, E), as the layers
  // pass them: the kernels read them in place.
  bool heads_in_rows = false;
};

// x (N, H, L, E) copied into the (N, L, H, E) layout and viewed as (N, H, L, E).
Tensor in_heads_in_rows_layout(const Tensor& x) {
  return x.transpose(1, 2).contiguous().transpose(1, 2);
}

OpCase elu_linear_case(const EluLinearCfg& c) {
  OpCase oc;
  oc.name = c.name;
  std::optional<Tensor> lengths;
  if (!c.lengths.empty()) lengths = torch::tensor(c.lengths, torch::kLong);
  oc.make_inputs = [c](uint64_t seed) -> Inputs {
    torch::manual_seed(seed);
    Inputs x{torch::randn({c.N, c.H, c.L, c.E}, torch::kDouble),
             torch::randn({c.N, c.H, c.S, c.E}, torch::kDouble),
             torch::randn({c.N, c.H, c.S, c.M}, torch::kDouble)};
    if (c.heads_in_rows) {
      for (auto& t : x) t = in_heads_in_rows_layout(t);
    }
    return x;
  };
  oc.op = [c, lengths](const Inputs& x) {
    if (c.heads_in_rows) {
      EXPECT_FALSE(x[0].is_contiguous());
    }
    return elu_linear_attention(x[0], x[1], x[2], lengths, c.causal, 1e-6);
  };
  oc.reference = [c, lengths](const Inputs& x) {
    return reference::elu_linear_attention(x[0], x[1], x[2], lengths, c.causal, 1e-6);
  };
  // Outputs are weighted means of O(1) values with positive weights: float32
  // keeps ~1e-7 relative per term, summed in another order than BLAS's.
  oc.f64_tol = 1e-11;
  oc.f32_tol = 2e-5;
  return oc;
}

class EluLinearAttentionCases : public ::testing::TestWithParam<EluLinearCfg> {};

TEST_P(EluLinearAttentionCases, MatchesReference) {
  const auto oc = elu_linear_case(GetParam());
  SCOPED_TRACE(oc.name);
  testing::check_forward(oc);
  testing::check_gradients_vs_reference(oc, 0, 1e-9);
  testing::check_finite_differences(oc, 0, 3, 1e-6);
}

// Chunks are 64 rows: 97 and 1025 leave partial chunks; lengths end inside a
// chunk (40), on a boundary (64), at 0 and at S.
INSTANTIATE_TEST_SUITE_P(
    Shapes, EluLinearAttentionCases,
    ::testing::Values(
        EluLinearCfg{"causal_L1", 1, 1, 1, 1, 3, 2, true},
        EluLinearCfg{"causal_97_E_ne_M", 2, 3, 97, 97, 16, 24, true},
        EluLinearCfg{"causal_130_64x64", 1, 2, 130, 130, 64, 64, true},
        EluLinearCfg{"causal_1025_odd", 1, 1, 1025, 1025, 7, 5, true},
        EluLinearCfg{"causal_lengths", 4, 2, 150, 150, 9, 11, true, {150, 64, 40, 0}},
        EluLinearCfg{"full_L1_S1", 1, 1, 1, 1, 3, 2, false},
        EluLinearCfg{"full_S_ne_L", 2, 2, 37, 200, 16, 24, false},
        EluLinearCfg{"full_1025_odd", 1, 2, 1025, 70, 33, 17, false},
        EluLinearCfg{"full_lengths", 4, 1, 90, 130, 8, 5, false, {130, 64, 1, 0}},
        EluLinearCfg{"causal_heads_in_rows", 2, 3, 97, 97, 16, 24, true, {97, 40}, true},
        EluLinearCfg{"full_heads_in_rows", 2, 3, 37, 70, 7, 5, false, {70, 1}, true},
        // The non-causal passes go by blocks of rows (about 16 over the batch, whole chunks)
        // and groups of at most 16 heads: 6 query blocks of 128 rows and 5 key blocks, a length
        // inside one (517), 20 heads in two groups of 10; one entry: 9 query blocks of 128 rows
        // and 16 key blocks of 64, eight heads side by side.
        EluLinearCfg{"full_blocks_groups", 2, 20, 700, 600, 5, 3, false, {600, 517}, true},
        EluLinearCfg{"full_blocks_one_entry", 1, 8, 1025, 1000, 9, 7, false, {}, true}),
    [](const ::testing::TestParamInfo<EluLinearCfg>& info) { return info.param.name; });

TEST(EluLinearAttentionOp, MatchesTheComposedProductPath) {
  // The fused kernel computes what elu_feature_map + causal_linear_product on
  // [V, 1] + the normalisation computed before it (float32, L = 1000).
  auto q = torch::randn({1, 2, 1000, 32}), k = torch::randn({1, 2, 1000, 32}),
       v = torch::randn({1, 2, 1000, 16});
  auto prod = causal_linear_product(elu_feature_map(q), elu_feature_map(k),
                                    torch::cat({v, torch::ones({1, 2, 1000, 1})}, -1));
  auto composed = prod.narrow(-1, 0, 16) / (prod.narrow(-1, 16, 1) + 1e-6);
  auto fused = elu_linear_attention(q, k, v, std::nullopt, /*causal=*/true, 1e-6);
  EXPECT_LE(testing::max_abs_diff(fused, composed), 1e-5);
}

TEST(EluLinearAttentionOp, ReadsAndWritesRowLayoutsInPlace) {
  const auto lengths = torch::tensor({int64_t(50), int64_t(21)}, torch::kLong);
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "not causal");
    testing::check_row_layouts(
        [&](const Tensor& q, const Tensor& k, const Tensor& v) {
          return elu_linear_attention(q, k, v, lengths, causal);
        },
        2, 3, 50, 50, 8, 6);
  }
  // S != L, no lengths; one head (nothing to interleave).
  for (int64_t H : {4, 1}) {
    testing::check_row_layouts(
        [](const Tensor& q, const Tensor& k, const Tensor& v) {
          return elu_linear_attention(q, k, v, std::nullopt, false);
        },
        1, H, 30, 77, 5, 9);
  }
}

TEST(EluLinearAttentionOp, SameResultWithOneOrTwoThreads) {
  // Outputs and gradients, contiguous and on the layers' views (the non-causal passes' blocks of
  // rows and their sums do not depend on the thread count).
  for (bool views : {false, true}) {
    auto make = [&](int64_t H, int64_t L, int64_t D) {
      auto x = torch::randn({2, H, L, D});
      return (views ? in_heads_in_rows_layout(x) : x).requires_grad_();
    };
    auto q = make(3, 300, 16), k = make(3, 700, 16), v = make(3, 700, 8);
    const auto lengths = torch::tensor({int64_t(700), int64_t(333)});
    for (bool causal : {false, true}) {
      SCOPED_TRACE(std::string(views ? "views" : "contiguous") + (causal ? " causal" : ""));
      auto kk = causal ? q : k, vv = causal ? make(3, 300, 8) : v;
      const auto len = causal ? std::optional<Tensor>() : std::optional<Tensor>(lengths);
      const int saved = at::get_num_threads();
      std::vector<std::vector<Tensor>> got;
      for (int threads : {1, 2}) {
        at::set_num_threads(threads);
        auto out = elu_linear_attention(q, kk, vv, len, causal);
        auto grads = torch::autograd::grad({out}, {q, kk, vv}, {torch::ones_like(out)});
        grads.insert(grads.begin(), out);
        got.push_back(grads);
      }
      at::set_num_threads(saved);
      for (size_t i = 0; i < got[0].size(); ++i)
        EXPECT_TRUE(torch::equal(got[0][i], got[1][i])) << "output/grad " << i;
    }
  }
}

// The forward and backward ops, through the dispatcher.
std::tuple<Tensor, Tensor, Tensor> elu_forward_op(const Tensor& q, const Tensor& k, const Tensor& v,
                                                  const c10::optional<Tensor>& lengths,
                                                  bool causal) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fastattn::elu_linear_attention_forward", "")
          .typed<std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                    const c10::optional<Tensor>&, bool, double)>();
  return op.call(q, k, v, lengths, causal, 1e-6);
}
std::tuple<Tensor, Tensor, Tensor> elu_backward_op(const Tensor& g, const Tensor& q,
                                                   const Tensor& k, const Tensor& v,
                                                   const Tensor& out, const Tensor& den,
                                                   const c10::optional<Tensor>& lengths,
                                                   bool causal,
                                                   const c10::optional<Tensor>& state) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fastattn::elu_linear_attention_backward", "")
                       .typed<std::tuple<Tensor, Tensor, Tensor>(
                           const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                           const Tensor&, const Tensor&, const c10::optional<Tensor>&, bool, double,
                           const c10::optional<Tensor>&)>();
  return op.call(g, q, k, v, out, den, lengths, causal, 1e-6, state);
}

TEST(EluLinearAttentionOp, ForwardKeepsTheKeyStateTheBackwardReads) {
  // Non-causal: the forward's state is [S | z] = [phi(K)^T V | phi(K)^T 1]
  // over each sample's valid keys (float64 reference), and the backward
  // reading it gives what it gives recomputing it (None). The layers' views,
  // E != M, key lengths inside and on a chunk, 0; float32 and float64.
  const auto lengths = torch::tensor({int64_t(130), int64_t(64), int64_t(40), int64_t(0)});
  for (auto dtype : {torch::kDouble, torch::kFloat}) {
    SCOPED_TRACE(dtype == torch::kDouble ? "float64" : "float32");
    auto make = [&](int64_t S, int64_t D) {
      return in_heads_in_rows_layout(torch::randn({4, 3, S, D}, torch::kDouble)).to(dtype);
    };
    auto q = make(90, 9), k = make(130, 9), v = make(130, 11), g = make(90, 11);
    auto [out, den, state] = elu_forward_op(q, k, v, lengths, false);
    ASSERT_EQ(state.sizes(), (std::vector<int64_t>{4, 3, 9, 12}));
    ASSERT_EQ(state.scalar_type(), dtype);
    auto keep = (torch::arange(130).unsqueeze(0) < lengths.unsqueeze(1)).to(torch::kDouble);
    auto kf = reference::elu_feature_map(k.to(torch::kDouble)) * keep.view({4, 1, 130, 1});
    auto want = torch::cat(
        {torch::matmul(kf.transpose(-1, -2), v.to(torch::kDouble)), kf.sum(2).unsqueeze(-1)}, -1);
    EXPECT_LE(testing::max_abs_diff(state.to(torch::kDouble), want) /
                  (1 + want.abs().max().item<double>()),
              dtype == torch::kDouble ? 1e-14 : 1e-6);
    auto read = elu_backward_op(g, q, k, v, out, den, lengths, false, state);
    auto recomputed = elu_backward_op(g, q, k, v, out, den, lengths, false, c10::nullopt);
    EXPECT_TRUE(torch::equal(std::get<0>(read), std::get<0>(recomputed)));
    EXPECT_TRUE(torch::equal(std::get<1>(read), std::get<1>(recomputed)));
    EXPECT_TRUE(torch::equal(std::get<2>(read), std::get<2>(recomputed)));
    // A state it did not come from is read, not ignored: grad q follows S.
    auto other = elu_backward_op(g, q, k, v, out, den, lengths, false, state * 2);
    EXPECT_FALSE(torch::equal(std::get<0>(other), std::get<0>(recomputed)));
    // Causal: no state (0 elements), and a given one is checked, not read.
    auto [out_c, den_c, state_c] = elu_forward_op(q, q, g, c10::nullopt, true);
    EXPECT_EQ(state_c.numel(), 0);
  }
}

TEST(EluLinearAttentionOp, BadStateNamesTheArgument) {
  auto q = torch::randn({2, 2, 5, 4}), v = torch::randn({2, 2, 5, 3});
  auto [out, den, state] = elu_forward_op(q, q, v, c10::nullopt, false);
  EXPECT_ERROR_CONTAINS(
      elu_backward_op(v, q, q, v, out, den, c10::nullopt, false, torch::zeros({2, 2, 4, 3})),
      "state must be the forward's key state of shape (N, H, E, M + 1) = [2, 2, "
      "4, 4] or have 0 elements, got [2, 2, 4, 3]");
  EXPECT_ERROR_CONTAINS(elu_backward_op(v, q, q, v, out, den, c10::nullopt, false,
                                        torch::zeros({2, 2, 4, 4}, torch::kLong)),
                        "state must be a floating tensor, got Long");
  EXPECT_ERROR_CONTAINS(
      elu_backward_op(v, q, q, v, out, den, c10::nullopt, true, torch::zeros({1})),
      "state must be the forward's key state");
}

TEST(EluLinearAttentionOp, BadInputsNameTheArgument) {
  auto q = torch::randn({2, 2, 5, 4}), v = torch::randn({2, 2, 5, 3});
  EXPECT_ERROR_CONTAINS(elu_linear_attention(q, torch::randn({2, 2, 6, 4}),
                                             torch::randn({2, 2, 6, 3}), std::nullopt, true),
                        "S == L");
  EXPECT_ERROR_CONTAINS(elu_linear_attention(q, q, v, std::nullopt, false, 0.0), "eps must be");
  EXPECT_ERROR_CONTAINS(elu_linear_attention(q, q, v, torch::tensor({5, 6}), false), "key_lengths");
  EXPECT_ERROR_CONTAINS(elu_linear_attention(q, q, torch::randn({2, 2, 6, 3})),
                        "v must agree with k");
  EXPECT_ERROR_CONTAINS(elu_linear_attention(q, q.to(torch::kDouble), v), "one dtype");
}

// ---- dense references for the attention types -----------------------------------

// Normalised (phi(Q) phi(K)^T) V with the L×S matrix: keep (N, S) drops keys,
// causal keeps j <= i.
Tensor dense_linear(const Tensor& qf, const Tensor& kf, const Tensor& v,
                    const std::optional<Tensor>& keep, bool causal, double eps) {
  auto a = torch::matmul(qf, kf.transpose(-1, -2));  // (N, H, L, S)
  if (keep) a = a.masked_fill(keep->view({keep->size(0), 1, 1, -1}).logical_not(), 0.0);
  if (causal) a = torch::tril(a);
  return torch::matmul(a, v) / (a.sum(-1, /*keepdim=*/true) + eps);
}

struct TypeCfg {
  std::string name;
  std::string type;  // linear or causal-linear
  std::string feature_map;
  int64_t N, H, L, S, E, M;
  std::vector<int64_t> lengths;  // empty: none
};

OpCase type_case(const TypeCfg& c) {
  OpCase oc;
  oc.name = c.name;
  const bool causal = c.type == "causal-linear";
  const double eps = 1e-15;  // tiny: stabilised and plain favor then agree
  AttentionDims dims;
  dims.heads = c.H;
  dims.query_dim = c.E;
  dims.value_dim = c.M;
  ParamMap params{{"feature_map", c.feature_map}, {"eps", eps}, {"seed", int64_t{7}}};
  if (c.feature_map == "favor") params["n_features"] = int64_t{48};
  auto attn = make_attention(c.type, params, dims);
  attn->eval();
  std::shared_ptr<FeatureMap> fm =
      causal ? std::dynamic_pointer_cast<CausalLinearAttention>(attn)->feature_map()
             : std::dynamic_pointer_cast<LinearAttention>(attn)->feature_map();
  Mask mask = Mask().with_causal(causal);
  std::optional<Tensor> keep;
  if (!c.lengths.empty()) {
    mask = mask.with_key_lengths(torch::tensor(c.lengths, torch::kLong));
    keep = mask.key_keep(c.N, c.S);
  }
  oc.make_inputs = [c](uint64_t seed) -> Inputs {
    torch::manual_seed(seed);
    return {torch::randn({c.N, c.H, c.L, c.E}, torch::kDouble),
            torch::randn({c.N, c.H, c.S, c.E}, torch::kDouble),
            torch::randn({c.N, c.H, c.S, c.M}, torch::kDouble)};
  };
  oc.op = [attn, mask](const Inputs& x) { return attn->forward(x[0], x[1], x[2], mask); };
  oc.reference = [fm, keep, causal, eps](const Inputs& x) {
    return dense_linear(fm->forward(x[0]), fm->forward(x[1]), x[2], keep, causal, eps);
  };
  oc.f64_tol = 1e-10;
  // float32: outputs are weighted means of O(1) values; favor's exponentials
  // add a few ulp of relative error per weight.
  oc.f32_tol = 5e-5;
  return oc;
}

class LinearAttentionCases : public ::testing::TestWithParam<TypeCfg> {};

TEST_P(LinearAttentionCases, MatchesDenseReference) {
  const auto oc = type_case(GetParam());
  SCOPED_TRACE(oc.name);
  testing::check_forward(oc);
  testing::check_gradients_vs_reference(oc, 0, 1e-8);
  testing::check_finite_differences(oc, 0, 3, 1e-6);
}

INSTANTIATE_TEST_SUITE_P(
    Types, LinearAttentionCases,
    ::testing::Values(
        TypeCfg{"linear_elu", "linear", "elu", 2, 2, 37, 53, 16, 24},
        TypeCfg{"linear_elu_L1", "linear", "elu", 1, 1, 1, 1, 3, 2},
        TypeCfg{"linear_relu", "linear", "relu", 1, 2, 5, 31, 16, 3},
        TypeCfg{"linear_favor_lengths", "linear", "favor", 3, 2, 40, 70, 8, 5, {70, 33, 1}},
        TypeCfg{"linear_elu_lengths", "linear", "elu", 2, 1, 20, 30, 7, 9, {30, 12}},
        TypeCfg{"causal_elu_L1", "causal-linear", "elu", 1, 1, 1, 1, 3, 2},
        TypeCfg{"causal_elu_97", "causal-linear", "elu", 2, 2, 97, 97, 16, 16},
        TypeCfg{"causal_favor_130", "causal-linear", "favor", 1, 2, 130, 130, 8, 12},
        TypeCfg{"causal_elu_lengths", "causal-linear", "elu", 3, 1, 70, 70, 9, 5, {70, 40, 1}},
        TypeCfg{
            "linear_generalized_lengths", "linear", "generalized", 2, 2, 33, 41, 8, 6, {41, 20}},
        TypeCfg{"causal_generalized_97", "causal-linear", "generalized", 1, 2, 97, 97, 8, 5}),
    [](const ::testing::TestParamInfo<TypeCfg>& info) { return info.param.name; });

TEST(LinearAttention, PaddedKeysContributeNothing) {
  // Padding must not change (or overflow) anything, nor give NaN gradients:
  // huge padded keys, and zero padded keys beside large real keys (FAVOR+'s
  // key offset then puts the padding's exponent far above 0).
  for (const char* type : {"linear", "causal-linear"}) {
    for (const char* map : {"elu", "favor"}) {
      for (const auto& [key_scale, pad] :
           std::vector<std::pair<double, double>>{{1, 1e3}, {300, 0}}) {
        SCOPED_TRACE(std::string(type) + " " + map + " pad " + std::to_string(pad));
        const bool causal = std::string(type) == "causal-linear";
        AttentionDims dims{2, 8, 8};
        auto attn = make_attention(type, {{"feature_map", std::string(map)}}, dims);
        attn->eval();
        auto q = torch::randn({2, 2, 30, 8}, torch::kDouble);
        auto k = torch::randn({2, 2, 30, 8}, torch::kDouble) * key_scale;
        auto v = torch::randn({2, 2, 30, 8}, torch::kDouble);
        const int64_t len = 17;
        auto kp = k.clone(), vp = v.clone();
        kp.narrow(2, len, 30 - len).fill_(pad);
        vp.narrow(2, len, 30 - len).fill_(1e6);
        auto mask = Mask().with_causal(causal).with_key_lengths(torch::tensor({len, len}));
        kp.requires_grad_();
        vp.requires_grad_();
        auto out = attn->forward(q, kp, vp, mask);
        ASSERT_TRUE(torch::isfinite(out).all().item<bool>());
        // Gradients stay finite and are zero on the padding.
        out.sum().backward();
        for (const auto& g : {kp.grad(), vp.grad()}) {
          EXPECT_TRUE(torch::isfinite(g).all().item<bool>());
          EXPECT_EQ(g.narrow(2, len, 30 - len).abs().max().item<double>(), 0.0);
        }
        out = out.detach();
        if (causal) {
          // Rows before len see exactly the real keys up to themselves.
          auto ref = attn->forward(q.narrow(2, 0, len), k.narrow(2, 0, len), v.narrow(2, 0, len),
                                   Mask::causal_mask());
          EXPECT_LE(testing::max_abs_diff(out.narrow(2, 0, len), ref), 1e-9);
        } else {
          auto ref = attn->forward(q, k.narrow(2, 0, len), v.narrow(2, 0, len), Mask());
          EXPECT_LE(testing::max_abs_diff(out, ref), 1e-9);
        }
      }
    }
  }
}

TEST(LinearAttention, LargeNormInputsStayFiniteInFloat32) {
  // Unnormalised inputs (|x| ~ 100·sqrt(E)) at a moderate length; the
  // L = 65536 check is in bench/bench_linear_attention.cpp.
  for (const char* type : {"linear", "causal-linear"}) {
    for (const char* map : {"elu", "relu", "favor", "smoothed-rff"}) {
      SCOPED_TRACE(std::string(type) + " " + map);
      AttentionDims dims{2, 32, 32};
      auto attn = make_attention(type, {{"feature_map", std::string(map)}}, dims);
      attn->eval();
      auto q = torch::randn({1, 2, 4096, 32}) * 100;
      auto k = torch::randn({1, 2, 4096, 32}) * 100;
      auto v = torch::randn({1, 2, 4096, 32}) * 100;
      auto out = attn->forward(q, k, v, Mask().with_causal(std::string(type) == "causal-linear"));
      EXPECT_TRUE(torch::isfinite(out).all().item<bool>());
    }
  }
}

// ---- feature maps -----------------------------------------------------------------

// Mean |estimate - exact| over a few seeds for m features.
double favor_softmax_error(int64_t m) {
  const int64_t E = 16, L = 32;
  torch::manual_seed(11);
  auto q = torch::randn({1, 1, L, E}, torch::kDouble) * 0.7;
  auto k = torch::randn({1, 1, L, E}, torch::kDouble) * 0.7;
  const double temp = 1.0 / std::sqrt(static_cast<double>(E));
  auto exact = torch::softmax(torch::matmul(q, k.transpose(-1, -2)) * temp, -1);
  double err = 0;
  const int seeds = 6;
  for (int s = 0; s < seeds; ++s) {
    FeatureMapOptions o;
    o.kind = "favor";
    o.query_dim = E;
    o.n_features = m;
    o.seed = 100 + s;
    auto fm = make_feature_map(o);
    auto a = torch::matmul(fm->forward_queries(q), fm->forward_keys(k).transpose(-1, -2));
    a = a / a.sum(-1, /*keepdim=*/true);
    err += (a - exact).abs().mean().item<double>() / seeds;
  }
  return err;
}

// Mean relative error of the generalized map with f = exp against its
// expectation: E_w[(e^{w·x} + c)(e^{w·y} + c)] = e^{|x+y|²/2} + c·(e^{|x|²/2}
// + e^{|y|²/2}) + c² for w ~ N(0, I), c the map's floor 1e-3 (temp = 1).
// With the default orthogonal draw this also checks that the orthogonal rows
// are unbiased: QR without the sign correction left the error at ~0.08 for
// any number of features.
double generalized_exp_error(int64_t m) {
  const int64_t E = 8, L = 16;
  torch::manual_seed(13);
  auto x = torch::randn({1, 1, L, E}, torch::kDouble) * 0.3;
  auto y = torch::randn({1, 1, L, E}, torch::kDouble) * 0.3;
  const double c = 1e-3;
  auto half_sq = [](const Tensor& t) { return t.pow(2).sum(-1) * 0.5; };
  auto exact = torch::exp(half_sq(x.unsqueeze(3) + y.unsqueeze(2))) +
               c * (torch::exp(half_sq(x)).unsqueeze(-1) + torch::exp(half_sq(y)).unsqueeze(-2)) +
               c * c;  // (1, 1, L, L)
  double err = 0;
  const int seeds = 6;
  for (int s = 0; s < seeds; ++s) {
    FeatureMapOptions o;
    o.kind = "generalized";
    o.kernel_fn = "exp";
    o.query_dim = E;
    o.n_features = m;
    o.softmax_temp = 1.0;
    o.seed = 200 + s;
    auto fm = make_feature_map(o);
    // phi(x)·phi(y) with phi = (f + c) / sqrt(m): the mean over features.
    auto est = torch::matmul(fm->forward(x), fm->forward(y).transpose(-1, -2));
    err += ((est - exact).abs() / exact).mean().item<double>() / seeds;
  }
  return err;
}

TEST(FeatureMap, GeneralizedApproximatesItsKernelBetterWithMoreFeatures) {
  const double e16 = generalized_exp_error(16), e256 = generalized_exp_error(256),
               e4096 = generalized_exp_error(4096);
  EXPECT_LT(e256, e16);
  EXPECT_LT(e4096, e256);
  EXPECT_LT(e4096, 0.05);
  // Every kernel function builds through the registry; an unknown one is an error.
  for (const auto& fn : kernel_function_names()) {
    auto attn = make_attention("linear",
                               {{"feature_map", std::string("generalized")},
                                {"kernel_fn", fn},
                                {"n_features", int64_t{32}}},
                               AttentionDims{2, 8, 8});
    auto out = attn->forward(torch::randn({1, 2, 10, 8}), torch::randn({1, 2, 12, 8}),
                             torch::randn({1, 2, 12, 8}), Mask());
    EXPECT_TRUE(torch::isfinite(out).all().item<bool>()) << fn;
  }
  EXPECT_ERROR_CONTAINS(make_attention("linear", {{"feature_map", std::string("generalized")},
                                                  {"kernel_fn", std::string("tanh")}}),
                        "kernel_fn");
}

double rff_rbf_error(int64_t m, bool orthogonal) {
  const int64_t E = 16, L = 32;
  torch::manual_seed(12);
  auto x = torch::randn({1, 1, L, E}, torch::kDouble);
  auto y = torch::randn({1, 1, L, E}, torch::kDouble);
  const double temp = 0.25;
  auto d2 = (x.unsqueeze(3) - y.unsqueeze(2)).pow(2).sum(-1);  // (1, 1, L, L)
  auto exact = torch::exp(-0.5 * temp * d2);
  double err = 0;
  const int seeds = 6;
  for (int s = 0; s < seeds; ++s) {
    FeatureMapOptions o;
    o.kind = "rff";
    o.query_dim = E;
    o.n_features = m;
    o.softmax_temp = temp;
    o.orthogonal = orthogonal;
    o.seed = 200 + s;
    auto fm = make_feature_map(o);
    auto est = torch::matmul(fm->forward(x), fm->forward(y).transpose(-1, -2));
    err += (est - exact).abs().mean().item<double>() / seeds;
  }
  return err;
}

TEST(FeatureMap, FavorApproximatesSoftmaxBetterWithMoreFeatures) {
  const double e16 = favor_softmax_error(16), e128 = favor_softmax_error(128),
               e1024 = favor_softmax_error(1024), e8192 = favor_softmax_error(8192);
  // Monte-Carlo error falls like 1/sqrt(m): 8x the features, ~2.8x less error
  // (and no plateau, which a biased estimator would show).
  EXPECT_LT(e128, 0.6 * e16) << e16 << " " << e128;
  EXPECT_LT(e1024, 0.6 * e128) << e128 << " " << e1024;
  EXPECT_LT(e8192, 0.6 * e1024) << e1024 << " " << e8192;
  EXPECT_LT(e8192, 0.1 * (1.0 / 32)) << "mean weight is 1/32";
}

TEST(FeatureMap, RffApproximatesRbfBetterWithMoreFeatures) {
  for (bool orthogonal : {false, true}) {
    SCOPED_TRACE(orthogonal ? "orthogonal" : "iid");
    const double e16 = rff_rbf_error(16, orthogonal), e128 = rff_rbf_error(128, orthogonal),
                 e1024 = rff_rbf_error(1024, orthogonal);
    EXPECT_LT(e128, 0.6 * e16) << e16 << " " << e128;
    EXPECT_LT(e1024, 0.6 * e128) << e128 << " " << e1024;
    EXPECT_LT(e1024, 0.03);
  }
}

TEST(FeatureMap, OrthogonalProjectionHasOrthogonalBlocks) {
  auto gen = at::detail::createCPUGenerator(3);
  auto w = random_projection(40, 16, true, gen);  // blocks of 16, 16, 8 rows
  ASSERT_EQ(w.sizes(), (std::vector<int64_t>{40, 16}));
  auto b = w.narrow(0, 16, 16);
  auto g = torch::matmul(b, b.t());
  EXPECT_LE((g - torch::diag(torch::diag(g))).abs().max().item<double>(), 1e-10);
}

TEST(FeatureMap, OutputDims) {
  FeatureMapOptions o;
  o.query_dim = 10;
  for (const auto& [kind, dim] : std::vector<std::pair<std::string, int64_t>>{
           {"elu", 10}, {"relu", 10}, {"favor", 10}, {"rff", 10}, {"smoothed-rff", 11}}) {
    o.kind = kind;
    auto fm = make_feature_map(o);
    EXPECT_EQ(fm->output_dim(), dim) << kind;
    EXPECT_EQ(fm->forward(torch::randn({2, 3, 5, 10})).sizes(),
              (std::vector<int64_t>{2, 3, 5, dim}))
        << kind;
    EXPECT_EQ(fm->name(), kind);
  }
}

TEST(FeatureMap, SameSeedSameOutputAndRedrawControl) {
  AttentionDims dims{1, 8, 8};
  auto q = torch::randn({1, 1, 12, 8}), k = torch::randn({1, 1, 12, 8}),
       v = torch::randn({1, 1, 12, 8});
  auto build = [&](int64_t seed, int64_t redraw) {
    return make_attention(
        "linear", {{"feature_map", std::string("favor")}, {"seed", seed}, {"redraw", redraw}},
        dims);
  };
  auto a = build(5, 1), b = build(5, 1), c = build(6, 1);
  a->eval();
  b->eval();
  c->eval();
  const auto out = a->forward(q, k, v, Mask());
  EXPECT_TRUE(torch::equal(out, b->forward(q, k, v, Mask())));
  EXPECT_FALSE(torch::allclose(out, c->forward(q, k, v, Mask())));
  // Evaluation never redraws.
  EXPECT_TRUE(torch::equal(out, a->forward(q, k, v, Mask())));
  // redraw = 1: every training forward draws anew, reproducibly per seed.
  a->train();
  b->train();
  auto t1 = a->forward(q, k, v, Mask()), t2 = a->forward(q, k, v, Mask());
  EXPECT_FALSE(torch::allclose(t1, out));
  EXPECT_FALSE(torch::allclose(t1, t2));
  EXPECT_TRUE(torch::equal(t1, b->forward(q, k, v, Mask())));
  // redraw = 2: the first training forward keeps the matrix, the second redraws.
  auto d = build(5, 2);
  d->train();
  EXPECT_TRUE(torch::equal(d->forward(q, k, v, Mask()), out));
  EXPECT_FALSE(torch::allclose(d->forward(q, k, v, Mask()), out));
  // redraw = 0: never.
  auto e = build(5, 0);
  e->train();
  e->forward(q, k, v, Mask());
  EXPECT_TRUE(torch::equal(e->forward(q, k, v, Mask()), out));
}

TEST(FeatureMap, RandomMatrixIsABufferThatSavesWithTheModel) {
  FeatureMapOptions o;
  o.kind = "favor";
  o.query_dim = 8;
  o.n_features = 12;
  auto fm = make_feature_map(o);
  auto buffers = fm->named_buffers();
  ASSERT_TRUE(buffers.contains("omega"));
  EXPECT_EQ(buffers["omega"].sizes(), (std::vector<int64_t>{8, 12}));
}

// ---- registry -----------------------------------------------------------------------

TEST(LinearAttention, BuildsThroughTheRegistryWithItsParams) {
  AttentionDims dims{4, 32, 16};
  for (const char* type : {"linear", "causal-linear"}) {
    auto attn = make_attention(type,
                               {{"feature_map", std::string("favor")},
                                {"n_features", int64_t{48}},
                                {"eps", 1e-5},
                                {"seed", int64_t{3}},
                                {"redraw", int64_t{0}}},
                               dims);
    EXPECT_EQ(attn->type_name(), type);
    std::shared_ptr<FeatureMap> fm =
        std::string(type) == "linear"
            ? std::dynamic_pointer_cast<LinearAttention>(attn)->feature_map()
            : std::dynamic_pointer_cast<CausalLinearAttention>(attn)->feature_map();
    ASSERT_TRUE(fm);
    EXPECT_EQ(fm->name(), "favor");
    EXPECT_EQ(fm->output_dim(), 48);
    EXPECT_EQ(fm->redraw_every(), 0);
    auto out = attn->forward(torch::randn({2, 4, 10, 32}), torch::randn({2, 4, 10, 32}),
                             torch::randn({2, 4, 10, 16}),
                             Mask().with_causal(std::string(type) == "causal-linear"));
    EXPECT_EQ(out.sizes(), (std::vector<int64_t>{2, 4, 10, 16}));
  }
  // Defaults: elu.
  auto def = std::dynamic_pointer_cast<LinearAttention>(make_attention("linear"));
  ASSERT_TRUE(def);
  EXPECT_EQ(def->feature_map()->name(), "elu");
  // Through the conditional-full decorator.
  EXPECT_TRUE(AttentionRegistry::global().contains("conditional-full:causal-linear"));
}

// The fused elu kernel's overflow witness: per head, the sum of |out| over
// the values it stored (float64 reference), for the registry operator's check
// to read instead of the output; NaN or inf in any stored value shows in its
// head's sum. Both types, the layers' views, E != M (a vector tail), key
// lengths; bfloat16 and other feature maps leave none; taken once.
TEST(LinearAttention, FiniteWitnessSumsEveryStoredValue) {
  torch::manual_seed(8);
  for (const char* type : {"linear", "causal-linear"}) {
    const bool causal = std::string(type) == "causal-linear";
    for (auto dtype : {torch::kDouble, torch::kFloat}) {
      SCOPED_TRACE(std::string(type) + (dtype == torch::kDouble ? " float64" : " float32"));
      // 300 rows: the non-causal forward's sums come from 5 blocks of rows per entry.
      auto make = [&](int64_t D) {
        return in_heads_in_rows_layout(torch::randn({2, 3, 300, D}, torch::kDouble)).to(dtype);
      };
      auto q = make(9), k = make(9), v = make(21);
      auto mask = Mask().with_causal(causal).with_key_lengths(torch::tensor({300, 37}));
      auto attn = make_attention(type);
      auto out = attn->forward(q, k, v, mask);
      auto w = attn->take_finite_witness();
      ASSERT_TRUE(w.defined());
      ASSERT_EQ(w.sizes(), (std::vector<int64_t>{2, 3}));
      ASSERT_EQ(w.scalar_type(), dtype);
      auto want = out.to(torch::kDouble).abs().sum({2, 3});
      EXPECT_LE(testing::max_abs_diff(w.to(torch::kDouble), want) / want.max().item<double>(),
                dtype == torch::kDouble ? 1e-13 : 1e-5);
      EXPECT_FALSE(attn->take_finite_witness().defined());
      // A NaN query row and an infinite value reach their heads' sums only.
      auto qn = q.clone(), vn = v.clone();
      qn.select(0, 0).select(0, 1).select(0, 5).fill_(NAN);
      vn.select(0, 1).select(0, 2).select(0, 3).select(0, 4).fill_(INFINITY);
      attn->forward(qn, k, vn, mask);
      auto finite = torch::isfinite(attn->take_finite_witness());
      auto expected = torch::ones({2, 3}, torch::kBool);
      expected[0][1] = false;
      expected[1][2] = false;
      EXPECT_TRUE(torch::equal(finite, expected)) << finite;
    }
    auto attn = make_attention(type);
    auto q = torch::randn({1, 2, 8, 4});
    attn->forward(q.to(torch::kBFloat16), q.to(torch::kBFloat16), q.to(torch::kBFloat16),
                  Mask().with_causal(causal));
    EXPECT_FALSE(attn->take_finite_witness().defined());  // rounding to bfloat16 not seen
    auto relu =
        make_attention(type, {{"feature_map", std::string("relu")}}, AttentionDims{2, 4, 4});
    relu->forward(q, q, q, Mask().with_causal(causal));
    EXPECT_FALSE(relu->take_finite_witness().defined());
  }
}

// The registry operator still refuses an overflow the witness shows (q·k
// past float32's range: NaN output from finite inputs), and still accepts
// a finite output whose witness sum overflows (640 values of 1e36 a head:
// the check then reads the output).
TEST(LinearAttention, RegistryOperatorOverflowCheckReadsTheWitness) {
  auto op = c10::Dispatcher::singleton()
                .findSchemaOrThrow("fastattn::attention", "")
                .typed<Tensor(std::string, const Tensor&, const Tensor&, const Tensor&, bool,
                              const c10::optional<Tensor>&, const c10::optional<Tensor>&,
                              std::string, bool)>();
  for (const char* type : {"linear", "causal-linear"}) {
    SCOPED_TRACE(type);
    const bool causal = std::string(type) == "causal-linear";
    auto q = torch::rand({1, 2, 40, 8}) * 1e20;
    EXPECT_ERROR_CONTAINS(op.call(type, q, q, q, causal, c10::nullopt, c10::nullopt, "{}", false),
                          "overflowed");
    // E = 1, phi <= 2 on [0, 1): numerators below 2 · 40 · 2 · 1e36, while
    // a head's 640 output values of 1e36 sum past float32's range.
    auto small = torch::rand({1, 2, 40, 1});
    auto v = torch::full({1, 2, 40, 16}, 1e36f);
    auto attn = make_attention(type);
    attn->forward(small, small, v, Mask().with_causal(causal));
    EXPECT_FALSE(std::isfinite(attn->take_finite_witness().sum().item<double>()));
    auto out = op.call(type, small, small, v, causal, c10::nullopt, c10::nullopt, "{}", false);
    EXPECT_TRUE(torch::isfinite(out).all().item<bool>());
  }
}

TEST(LinearAttention, BadParametersNameThem) {
  EXPECT_ERROR_CONTAINS(make_attention("linear", {{"feature_map", std::string("nope")}}),
                        "feature_map", "favor");
  EXPECT_ERROR_CONTAINS(make_attention("linear", {{"eps", 0.0}}), "eps");
  EXPECT_ERROR_CONTAINS(make_attention("linear", {{"n_features", int64_t{0}}}), "n_features");
  EXPECT_ERROR_CONTAINS(make_attention("linear", {{"n_features", int64_t{16}}}), "n_features",
                        "elu");
  EXPECT_ERROR_CONTAINS(make_attention("causal-linear", {{"feature_map", std::string("rff")},
                                                         {"n_features", int64_t{7}}}),
                        "n_features", "even");
  EXPECT_ERROR_CONTAINS(make_attention("linear", {{"redraw", int64_t{-1}}}), "redraw");
  EXPECT_ERROR_CONTAINS(make_attention("linear", {{"seed", int64_t{-2}}}), "seed");
  EXPECT_ERROR_CONTAINS(make_attention("linear", {{"smoothing", -1.0}}), "smoothing");
}

TEST(LinearAttention, UnsupportedMasksAreErrors) {
  auto q = torch::randn({1, 2, 6, 8}), k = torch::randn({1, 2, 9, 8}),
       v = torch::randn({1, 2, 9, 4});
  AttentionDims dims{2, 8, 4};
  auto lin = make_attention("linear", {}, dims);
  auto causal = make_attention("causal-linear", {}, dims);
  EXPECT_ERROR_CONTAINS(lin->forward(q, k, v, Mask::causal_mask()), "causal-linear");
  EXPECT_ERROR_CONTAINS(
      lin->forward(q, k, v, Mask().with_attn_mask(torch::ones({6, 9}, torch::kBool))), "attn_mask");
  EXPECT_ERROR_CONTAINS(causal->forward(q, k, v, Mask::causal_mask()), "S == L", "[1, 2, 6, 8]",
                        "[1, 2, 9, 8]");
  EXPECT_ERROR_CONTAINS(causal->forward(q, q, q.narrow(3, 0, 4), Mask()), "causal mask");
}

}  // namespace
}  // namespace fastattn
