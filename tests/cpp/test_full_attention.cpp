// Fused full attention vs its float64 reference: awkward shapes, every mask
// form, gradients, edge numerics and bad inputs.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <set>

#include "expect_error.h"
#include "fastattn/ops.h"
#include "kernels/common/cpu_isa.h"
#include "op_harness.h"
#include "ops/full_attention_internal.h"
#include "ops/row_dots.h"

namespace fastattn {
namespace {

using testing::Inputs;
using testing::OpCase;

enum class MaskKind { None, Bool, Additive };

struct FullCfg {
  std::string name;
  int64_t N, H, L, S, E, M;
  bool causal = false;
  std::vector<int64_t> lengths;  // empty: no key lengths
  MaskKind mask = MaskKind::None;
  std::optional<double> temp;
  bool mask_per_batch = false;  // (N, L, S) instead of (L, S)
};

OpCase make_case(const FullCfg& c) {
  OpCase oc;
  oc.name = c.name;
  // Masks and lengths are not differentiated: build them once per case.
  torch::manual_seed(1234);
  std::optional<torch::Tensor> mask, lengths;
  if (c.mask != MaskKind::None) {
    auto shape =
        c.mask_per_batch ? std::vector<int64_t>{c.N, c.L, c.S} : std::vector<int64_t>{c.L, c.S};
    auto keep = torch::rand(shape, torch::kDouble) > 0.3;
    // Keep the first key of each row so that a row is never empty by chance.
    keep.select(-1, 0).fill_(true);
    if (c.mask == MaskKind::Bool) {
      mask = keep;
    } else {
      mask = torch::randn(shape, torch::kDouble).masked_fill(keep.logical_not(), -INFINITY);
    }
  }
  if (!c.lengths.empty()) lengths = torch::tensor(c.lengths, torch::kLong);
  oc.make_inputs = [c](uint64_t seed) -> Inputs {
    torch::manual_seed(seed);
    return {torch::randn({c.N, c.H, c.L, c.E}, torch::kDouble),
            torch::randn({c.N, c.H, c.S, c.E}, torch::kDouble),
            torch::randn({c.N, c.H, c.S, c.M}, torch::kDouble)};
  };
  auto cast_mask = [mask](const torch::Tensor& like) -> std::optional<torch::Tensor> {
    if (!mask) return std::nullopt;
    return mask->is_floating_point() ? mask->to(like.scalar_type()) : *mask;
  };
  oc.op = [c, cast_mask, lengths](const Inputs& x) {
    return full_attention(x[0], x[1], x[2], cast_mask(x[0]), lengths, c.causal, c.temp);
  };
  oc.reference = [c, cast_mask, lengths](const Inputs& x) {
    return reference::full_attention(x[0], x[1], x[2], cast_mask(x[0]), lengths, c.causal, c.temp);
  };
  oc.f64_tol = 1e-12;
  // float32: inputs are rounded to float32 (relative 6e-8) and sums of up to
  // S·E products accumulate in float32; outputs are O(1).
  oc.f32_tol = 2e-5;
  return oc;
}

class FullAttentionCases : public ::testing::TestWithParam<FullCfg> {};

TEST_P(FullAttentionCases, MatchesReference) { testing::check_op(make_case(GetParam())); }

INSTANTIATE_TEST_SUITE_P(
    Shapes, FullAttentionCases,
    ::testing::Values(
        FullCfg{"tiny", 1, 1, 1, 1, 1, 1}, FullCfg{"batch2_heads3_97", 2, 3, 97, 97, 64, 64},
        FullCfg{"odd_dims_S_ne_L", 1, 2, 37, 130, 17, 33},
        FullCfg{"causal_97", 2, 2, 97, 97, 32, 32, true},
        FullCfg{"causal_L_gt_S", 1, 2, 50, 29, 8, 5, true},
        FullCfg{"causal_L_lt_S", 1, 2, 29, 50, 8, 5, true},
        FullCfg{"lengths", 3, 2, 40, 70, 16, 16, false, {70, 33, 1}},
        FullCfg{"lengths_zero_and_causal", 3, 1, 40, 40, 16, 8, true, {40, 0, 17}},
        FullCfg{"bool_mask", 2, 2, 45, 60, 16, 16, false, {}, MaskKind::Bool},
        FullCfg{"additive_mask_batch",
                2,
                2,
                45,
                60,
                16,
                16,
                false,
                {},
                MaskKind::Additive,
                std::nullopt,
                true},
        FullCfg{"everything", 2, 3, 61, 61, 24, 40, true, {61, 30}, MaskKind::Bool, 0.3},
        FullCfg{"temp", 1, 1, 20, 20, 8, 8, false, {}, MaskKind::None, 2.5},
        // One query per head (the kernel's decoding path), with
        // a value width off the vector width.
        FullCfg{"one_query_lengths", 3, 4, 1, 300, 16, 19, false, {300, 0, 7}},
        FullCfg{"one_query_wide", 2, 2, 1, 200, 64, 72},
        FullCfg{"one_query_causal_temp", 2, 2, 1, 90, 8, 8, true, {}, MaskKind::None, 0.7},
        // Few queries over many keys, no mask, not causal: the backward's
        // transposed products (clustered attention's centroids), with query
        // columns padded to a vector, a key tile cut by a length, odd widths,
        // 120 queries (its limit) and fewer heads than threads (split key
        // tiles); just past the limit, the general backward.
        FullCfg{"few_queries_many_keys", 2, 3, 100, 300, 64, 64, false, {300, 131}},
        FullCfg{"few_queries_odd_dims", 1, 4, 7, 150, 17, 33, false, {}, MaskKind::None, 0.4},
        FullCfg{"few_queries_limit_split", 1, 1, 120, 200, 16, 8},
        FullCfg{"past_few_queries", 1, 2, 121, 150, 16, 16}),
    [](const ::testing::TestParamInfo<FullCfg>& info) { return info.param.name; });

// ---- bfloat16 kernels (kernels/full/full_attention_bf16.cpp) -----------------
// At each of their levels this CPU supports: avx512_bf16 (dot products) and
// amx (tiles).

// Uses `isa` until the scope ends.
struct IsaGuard {
  kernels::CpuIsa saved = kernels::cpu_isa();
  explicit IsaGuard(kernels::CpuIsa isa) { kernels::set_cpu_isa(isa); }
  ~IsaGuard() { kernels::set_cpu_isa(saved); }
};

std::vector<kernels::CpuIsa> bf16_kernel_levels() {
  std::vector<kernels::CpuIsa> out;
  for (auto isa : {kernels::CpuIsa::kAvx512Bf16, kernels::CpuIsa::kAmx})
    if (kernels::cpu_isa_supported(isa)) out.push_back(isa);
  return out;
}

std::tuple<torch::Tensor, torch::Tensor> forward_op(const torch::Tensor& q, const torch::Tensor& k,
                                                    const torch::Tensor& v,
                                                    const c10::optional<torch::Tensor>& mask,
                                                    const c10::optional<torch::Tensor>& lengths,
                                                    bool causal, double temp) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fastattn::full_attention_forward", "")
                       .typed<std::tuple<torch::Tensor, torch::Tensor>(
                           const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                           const c10::optional<torch::Tensor>&, const c10::optional<torch::Tensor>&,
                           bool, double, double, int64_t)>();
  return op.call(q, k, v, mask, lengths, causal, temp, /*dropout_p=*/0.0, /*dropout_seed=*/0);
}

// Every shape above in bfloat16 at each bfloat16 kernel level, forward and
// backward, against float64 on the same (rounded) values. P and dS are
// rounded to bfloat16 before their products and the results once more:
// within 4 units of bfloat16 rounding (2^-8) of the largest value of each
// result (seen: under 2 units). A kernel that dropped a key tile or a tile's
// padding fails.
TEST_P(FullAttentionCases, Bfloat16KernelsMatchFloat64) {
  const auto levels = bf16_kernel_levels();
  if (levels.empty()) GTEST_SKIP() << "no AVX512-BF16 on this CPU";
  const auto oc = make_case(GetParam());
  Inputs b, d;
  for (const auto& t : oc.make_inputs(11)) {
    b.push_back(t.to(torch::kBFloat16));
    d.push_back(b.back().to(torch::kDouble).requires_grad_());
  }
  const auto ref = oc.reference(d);
  const auto grad_out = torch::randn_like(ref).to(torch::kBFloat16);
  ref.backward(grad_out.to(torch::kDouble));
  auto close = [](const torch::Tensor& got, const torch::Tensor& want) {
    const double scale = std::max(1.0, want.abs().max().item<double>());
    return testing::max_abs_diff(got.to(torch::kDouble), want) <= 4 * std::ldexp(1.0, -8) * scale;
  };
  for (auto isa : levels) {
    SCOPED_TRACE(kernels::cpu_isa_name(isa));
    IsaGuard guard(isa);
    Inputs x;
    for (const auto& t : b) x.push_back(t.detach().requires_grad_());
    const auto out = oc.op(x);
    ASSERT_EQ(out.scalar_type(), torch::kBFloat16);
    out.backward(grad_out);
    EXPECT_TRUE(close(out, ref.detach())) << "out";
    const char* names[] = {"grad q", "grad k", "grad v"};
    for (int i = 0; i < 3; ++i) {
      ASSERT_EQ(x[i].grad().scalar_type(), torch::kBFloat16);
      EXPECT_TRUE(close(x[i].grad(), d[i].grad())) << names[i];
    }
  }
}

// The operator's bfloat16 forward at each bfloat16 kernel level is that
// level's kernel, bit for bit, in the layers' (N, L, H, E) views (rows H·E
// apart) with a mask, key lengths and the causal cut; its lse (float32) is
// within 1e-4 of the float64 kernel's on the same values.
TEST(FullAttention, Bfloat16OperatorRunsTheBf16Kernel) {
  const auto levels = bf16_kernel_levels();
  if (levels.empty()) GTEST_SKIP() << "no AVX512-BF16 on this CPU";
  torch::manual_seed(5);
  const int64_t N = 2, H = 3, L = 150, S = 170, E = 40, M = 48;
  auto view = [&](int64_t rows, int64_t cols) {
    return torch::randn({N, rows, H, cols}).to(torch::kBFloat16).transpose(1, 2);
  };
  const auto q = view(L, E), k = view(S, E), v = view(S, M);
  auto mask = torch::randn({L, S}).masked_fill(torch::rand({L, S}) > 0.8, -INFINITY);
  mask.select(1, 0).fill_(0);
  const auto mask_b = mask.to(torch::kBFloat16);
  const auto lengths = torch::tensor({S, int64_t{77}}, torch::kLong);
  const double temp = 0.2;
  auto [out_d, lse_d] = forward_op(q.to(torch::kDouble), k.to(torch::kDouble), v.to(torch::kDouble),
                                   mask_b.to(torch::kDouble), lengths, true, temp);
  const auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const auto mask_full = mask_b.expand({N, H, L, S});
  auto bits = [](const torch::Tensor& t) {
    return reinterpret_cast<kernels::Bf16*>(t.data_ptr<at::BFloat16>());
  };
  for (auto isa : levels) {
    SCOPED_TRACE(kernels::cpu_isa_name(isa));
    IsaGuard guard(isa);
    auto [out, lse] = forward_op(q, k, v, mask_b, lengths, true, temp);
    ASSERT_EQ(lse.scalar_type(), torch::kFloat);
    auto out_k = torch::empty({N, H, L, M}, q.options());
    auto lse_k = torch::empty({N, H, L}, q.options().dtype(torch::kFloat));
    kernels::FullAttentionForwardArgs<kernels::Bf16> a;
    a.q = bits(qc);
    a.k = bits(kc);
    a.v = bits(vc);
    a.out = bits(out_k);
    a.lse = lse_k.data_ptr<float>();
    a.mask = bits(mask_b);
    a.mask_sn = mask_full.stride(0);
    a.mask_sh = mask_full.stride(1);
    a.mask_sl = mask_full.stride(2);
    a.key_lengths = lengths.data_ptr<int64_t>();
    a.N = N, a.H = H, a.L = L, a.S = S, a.E = E, a.M = M;
    a.causal = true;
    a.scale = static_cast<float>(temp);
    a.num_threads = 2;
    kernels::full_attention_forward_bf16(a);
    EXPECT_TRUE(torch::equal(out.contiguous(), out_k));
    EXPECT_TRUE(torch::equal(lse, lse_k));

    EXPECT_LE(testing::max_abs_diff(out.to(torch::kDouble), out_d),
              4 * std::ldexp(1.0, -8) * std::max(1.0, out_d.abs().max().item<double>()));
    const auto finite = torch::isfinite(lse_d);
    EXPECT_TRUE(torch::equal(finite, torch::isfinite(lse)));
    EXPECT_LE(testing::max_abs_diff(lse.to(torch::kDouble).masked_select(finite),
                                    lse_d.masked_select(finite)),
              1e-4 * (1 + lse_d.masked_select(finite).abs().max().item<double>()));
  }
}

// Where AMX and AVX512-BF16 are both at hand, the two kernels agree to
// float32 rounding of their sums before the bfloat16 result: within one
// bfloat16 unit of the largest value (they sum the same products in the same
// order; the tiles' internal order may differ).
TEST(FullAttention, Bf16KernelsOnTilesAndDotProductsAgree) {
  if (bf16_kernel_levels().size() < 2) GTEST_SKIP() << "needs AVX512-BF16 and AMX";
  torch::manual_seed(8);
  const auto q = torch::randn({1, 2, 200, 64}).to(torch::kBFloat16);
  const auto k = torch::randn({1, 2, 230, 64}).to(torch::kBFloat16);
  const auto v = torch::randn({1, 2, 230, 64}).to(torch::kBFloat16);
  torch::Tensor out[2];
  int i = 0;
  for (auto isa : bf16_kernel_levels()) {
    IsaGuard guard(isa);
    out[i++] = std::get<0>(forward_op(q, k, v, c10::nullopt, c10::nullopt, false, 0.125));
  }
  EXPECT_LE(testing::max_abs_diff(out[0].to(torch::kDouble), out[1].to(torch::kDouble)),
            std::ldexp(1.0, -8) * std::max(1.0, out[1].abs().max().item<double>()));
}

TEST(FullAttention, Bf16KernelsRefuseAnotherLevelTopkAndAccumulate) {
  const auto levels = bf16_kernel_levels();
  if (levels.empty()) GTEST_SKIP() << "no AVX512-BF16 on this CPU";
  kernels::FullAttentionForwardArgs<kernels::Bf16> a;
  kernels::FullAttentionBackwardArgs<kernels::Bf16> g;
  {
    IsaGuard guard(kernels::CpuIsa::kAvx512);
    EXPECT_THROW(kernels::full_attention_forward_bf16(a), std::logic_error);
    EXPECT_THROW(kernels::full_attention_backward_bf16(g), std::logic_error);
  }
  for (auto isa : levels) {
    SCOPED_TRACE(kernels::cpu_isa_name(isa));
    IsaGuard guard(isa);
    a.topk = 3;
    EXPECT_THROW(kernels::full_attention_forward_bf16(a), std::invalid_argument);
    g.accumulate = true;
    EXPECT_THROW(kernels::full_attention_backward_bf16(g), std::invalid_argument);
  }
}

TEST(FullAttention, LongSequenceFloat32MatchesFloat64Reference) {
  torch::manual_seed(3);
  auto q = torch::randn({1, 2, 1025, 64}, torch::kDouble);
  auto k = torch::randn({1, 2, 1025, 64}, torch::kDouble);
  auto v = torch::randn({1, 2, 1025, 64}, torch::kDouble);
  for (bool causal : {false, true}) {
    auto ref = reference::full_attention(q, k, v, std::nullopt, std::nullopt, causal);
    auto out = full_attention(q.to(torch::kFloat), k.to(torch::kFloat), v.to(torch::kFloat),
                              std::nullopt, std::nullopt, causal);
    EXPECT_LE(testing::max_abs_diff(out, ref), 2e-5) << "causal=" << causal;
  }
}

TEST(FullAttention, RowsWithoutKeysGiveZerosAndZeroGradients) {
  // Causal with L > S: the first L - S queries see no key; key length 0 too.
  auto q = torch::randn({2, 1, 9, 4}, torch::kDouble).requires_grad_();
  auto k = torch::randn({2, 1, 5, 4}, torch::kDouble).requires_grad_();
  auto v = torch::randn({2, 1, 5, 3}, torch::kDouble).requires_grad_();
  auto lengths = torch::tensor({5, 0}, torch::kLong);
  auto out = full_attention(q, k, v, std::nullopt, lengths, /*causal=*/true);
  EXPECT_TRUE(torch::isfinite(out).all().item<bool>());
  EXPECT_EQ(out.index({0, 0, torch::indexing::Slice(0, 4)}).abs().max().item<double>(), 0.0);
  EXPECT_EQ(out[1].abs().max().item<double>(), 0.0);
  out.sum().backward();
  for (const auto& g : {q.grad(), k.grad(), v.grad()})
    EXPECT_TRUE(torch::isfinite(g).all().item<bool>());
  EXPECT_EQ(q.grad()[1].abs().max().item<double>(), 0.0);
  EXPECT_EQ(q.grad().index({0, 0, torch::indexing::Slice(0, 4)}).abs().max().item<double>(), 0.0);
}

TEST(FullAttention, HugeScoresStayFinite) {
  // |q·k| up to ~1e6. Integer entries make every score exact in float32 in
  // any summation order, so the float64 reference is a fair bar on any CPU:
  // with random real entries a near tie between the two largest scores turns
  // float32's rounding of a 1e5-sized score into a percent of the output (one
  // seed in fifty), and ATen's randn differs by CPU. The second half of the
  // keys repeats the first, so every row's maximum is an exact tie.
  torch::manual_seed(0);
  auto q = torch::randint(-300, 301, {1, 1, 64, 16}).to(torch::kFloat);
  auto half = torch::randint(-300, 301, {1, 1, 32, 16}).to(torch::kFloat);
  auto k = torch::cat({half, half}, 2);
  auto v = torch::randn({1, 1, 64, 16});
  auto out = full_attention(q, k, v, std::nullopt, std::nullopt, false, 1.0);
  auto ref =
      reference::full_attention(q.to(torch::kDouble), k.to(torch::kDouble), v.to(torch::kDouble),
                                std::nullopt, std::nullopt, false, 1.0);
  EXPECT_TRUE(torch::isfinite(out).all().item<bool>());
  EXPECT_LE(testing::max_abs_diff(out, ref), 1e-5);
}

TEST(FullAttention, SameResultWithOneOrTwoThreads) {
  auto q = torch::randn({1, 1, 300, 32}), k = torch::randn({1, 1, 300, 32}),
       v = torch::randn({1, 1, 300, 32});
  const int saved = at::get_num_threads();
  at::set_num_threads(1);
  auto a = full_attention(q, k, v, std::nullopt, std::nullopt, true);
  at::set_num_threads(2);
  auto b = full_attention(q, k, v, std::nullopt, std::nullopt, true);
  at::set_num_threads(saved);
  EXPECT_TRUE(torch::equal(a, b));
}

TEST(FullAttention, NonContiguousInputs) {
  auto base = torch::randn({1, 30, 2, 16}, torch::kDouble);  // (N, L, H, E) viewed as (N,H,L,E)
  auto q = base.transpose(1, 2);
  ASSERT_FALSE(q.is_contiguous());
  auto out = full_attention(q, q, q);
  auto ref = reference::full_attention(q.contiguous(), q.contiguous(), q.contiguous());
  EXPECT_LE(testing::max_abs_diff(out, ref), 1e-12);
}

TEST(FullAttention, ReadsAndWritesRowLayoutsInPlace) {
  using torch::Tensor;
  // Causal with a mask and key lengths; S != L over several key tiles (the
  // backward splits them between threads when heads are few); one query per
  // head (the decoding path).
  auto mask = torch::rand({50, 50}) > 0.2;
  const auto lengths = torch::tensor({int64_t(50), int64_t(33)}, torch::kLong);
  testing::check_row_layouts(
      [&](const Tensor& q, const Tensor& k, const Tensor& v) {
        return full_attention(q, k, v, mask, lengths, /*causal=*/true);
      },
      2, 3, 50, 50, 8, 6);
  testing::check_row_layouts(
      [](const Tensor& q, const Tensor& k, const Tensor& v) {
        return full_attention(q, k, v, std::nullopt, std::nullopt, false, 0.3);
      },
      1, 2, 200, 300, 16, 12);
  testing::check_row_layouts(
      [](const Tensor& q, const Tensor& k, const Tensor& v) { return full_attention(q, k, v); }, 2,
      3, 1, 70, 8, 5);
}

// Bad input: the message names the argument.
TEST(FullAttention, BadInputsNameTheArgument) {
  auto q = torch::randn({1, 2, 5, 4}), k = torch::randn({1, 2, 6, 4}),
       v = torch::randn({1, 2, 6, 3});
  EXPECT_ERROR_CONTAINS(full_attention(q[0], k, v), "q must have shape");
  EXPECT_ERROR_CONTAINS(full_attention(q, k.narrow(3, 0, 3), v), "k must agree with q");
  EXPECT_ERROR_CONTAINS(full_attention(q, k, v.narrow(2, 0, 5)), "v must agree with k");
  EXPECT_ERROR_CONTAINS(full_attention(q, k.to(torch::kDouble), v), "one dtype");
  EXPECT_ERROR_CONTAINS(full_attention(q.to(torch::kInt), k, v),
                        "q must be float32, float64, float16 or bfloat16");
  EXPECT_ERROR_CONTAINS(full_attention(q, k, v, torch::ones({5, 5}, torch::kBool)), "attn_mask");
  EXPECT_ERROR_CONTAINS(full_attention(q, k, v, torch::ones({5, 6}, torch::kInt)), "attn_mask");
  EXPECT_ERROR_CONTAINS(full_attention(q, k, v, std::nullopt, torch::tensor({7}, torch::kLong)),
                        "key_lengths");
  EXPECT_ERROR_CONTAINS(full_attention(q, k, v, std::nullopt, torch::tensor({1.0})), "key_lengths");
  EXPECT_ERROR_CONTAINS(full_attention(q, k, v, std::nullopt, std::nullopt, false, -1.0),
                        "softmax_temp");
}

TEST(FullAttention, EmptyInputs) {
  auto out = full_attention(torch::randn({1, 2, 0, 4}), torch::randn({1, 2, 6, 4}),
                            torch::randn({1, 2, 6, 3}));
  EXPECT_EQ(out.sizes(), (std::vector<int64_t>{1, 2, 0, 3}));
  auto out2 = full_attention(torch::randn({1, 2, 5, 4}), torch::randn({1, 2, 0, 4}),
                             torch::randn({1, 2, 0, 3}));
  EXPECT_EQ(out2.abs().sum().item<double>(), 0.0);
}

// ---- full_attention_lse_topk --------------------------------------------------

// Reference lse of the kept scaled scores (-inf for a row without keys).
torch::Tensor reference_lse(const torch::Tensor& q, const torch::Tensor& k,
                            const std::optional<torch::Tensor>& lengths, double temp) {
  auto s = torch::matmul(q, k.transpose(-1, -2)) * temp;
  if (lengths) {
    auto drop = torch::arange(k.size(2)).view({1, 1, 1, -1}).ge(lengths->view({-1, 1, 1, 1}));
    s = s.masked_fill(drop, -INFINITY);
  }
  return torch::logsumexp(s, -1);
}

// out and lse both carry gradients: the case checks out + w·lse for a fixed
// random weight w, so a missing or wrong lse gradient shows.
TEST(FullAttentionLseTopk, OutAndLseMatchReferenceWithGradients) {
  for (bool with_lengths : {false, true}) {
    SCOPED_TRACE(with_lengths ? "key lengths" : "no key lengths");
    std::optional<torch::Tensor> lengths;
    if (with_lengths) lengths = torch::tensor({23, 9}, torch::kLong);
    torch::manual_seed(7);
    const auto w = torch::randn({2, 3, 19, 1}, torch::kDouble);
    OpCase oc;
    oc.name = "lse_topk";
    oc.make_inputs = [](uint64_t seed) -> Inputs {
      torch::manual_seed(seed);
      return {torch::randn({2, 3, 19, 8}, torch::kDouble),
              torch::randn({2, 3, 23, 8}, torch::kDouble),
              torch::randn({2, 3, 23, 5}, torch::kDouble)};
    };
    oc.op = [lengths, w](const Inputs& x) {
      auto [out, lse, idx] = full_attention_lse_topk(x[0], x[1], x[2], lengths, 0.4, 4);
      return out + w.to(out.scalar_type()) * lse.unsqueeze(-1);
    };
    oc.reference = [lengths, w](const Inputs& x) {
      auto out = reference::full_attention(x[0], x[1], x[2], std::nullopt, lengths, false, 0.4);
      return out + w * reference_lse(x[0], x[1], lengths, 0.4).unsqueeze(-1);
    };
    oc.f64_tol = 1e-12;
    oc.f32_tol = 2e-5;  // as full attention; lse is O(1) here
    testing::check_op(oc);
  }
}

TEST(FullAttentionLseTopk, TopIndicesAreTheBestKeptKeysInOrder) {
  torch::manual_seed(3);
  // S = 300 spans several key tiles of the kernel.
  auto q = torch::randn({2, 2, 11, 16}), k = torch::randn({2, 2, 300, 16}),
       v = torch::randn({2, 2, 300, 4});
  auto lengths = torch::tensor({300, 150}, torch::kLong);
  auto [out, lse, idx] = full_attention_lse_topk(q, k, v, lengths, std::nullopt, 7);
  ASSERT_EQ(idx.sizes(), (std::vector<int64_t>{2, 2, 11, 7}));
  auto s = torch::matmul(q.to(torch::kDouble), k.to(torch::kDouble).transpose(-1, -2));
  s = s.masked_fill(torch::arange(300).view({1, 1, 1, -1}).ge(lengths.view({-1, 1, 1, 1})),
                    -INFINITY);
  auto expected = std::get<1>(s.topk(7, -1));  // sorted, descending
  EXPECT_TRUE(torch::equal(idx, expected));
  // The same output as full_attention.
  EXPECT_LT((out - full_attention(q, k, v, std::nullopt, lengths)).abs().max().item<double>(),
            1e-6);
}

TEST(FullAttentionLseTopk, RowsWithFewerKeysAreCompletedAndLseIsMinusInfinity) {
  auto q = torch::randn({2, 1, 3, 4}), k = torch::randn({2, 1, 6, 4}),
       v = torch::randn({2, 1, 6, 2});
  auto lengths = torch::tensor({2, 0}, torch::kLong);
  auto [out, lse, idx] = full_attention_lse_topk(q, k, v, lengths, std::nullopt, 4);
  for (int64_t l = 0; l < 3; ++l) {
    // Element 0: its 2 kept keys first (in score order), then 2 and 3.
    auto row = idx[0][0][l];
    std::set<int64_t> first{row[0].item<int64_t>(), row[1].item<int64_t>()};
    EXPECT_EQ(first, (std::set<int64_t>{0, 1}));
    EXPECT_EQ(row[2].item<int64_t>(), 2);
    EXPECT_EQ(row[3].item<int64_t>(), 3);
    // Element 1 keeps no key: indices 0..3, lse -inf, zeros out.
    EXPECT_TRUE(torch::equal(idx[1][0][l], torch::arange(4)));
  }
  EXPECT_TRUE(torch::isinf(lse[1]).all().item<bool>());
  EXPECT_EQ(out[1].abs().sum().item<double>(), 0.0);
}

// The ATen selection used by the CUDA op (ops::stable_topk_indices) on the
// CPU: equal to the first k of a stable descending sort, on scores full of
// ties (small integers) and -inf entries, k from 1 to S.
TEST(FullAttentionLseTopk, StableTopkIndicesEqualAStableSort) {
  torch::manual_seed(11);
  for (int64_t S : {1, 7, 300}) {
    for (auto dtype : {torch::kFloat, torch::kDouble}) {
      auto scores = torch::randint(-3, 4, {2, 3, 5, S}).to(dtype);
      scores.masked_fill_(torch::rand({2, 3, 5, S}) < 0.2, -INFINITY);
      scores[0][0][0].fill_(-INFINITY);  // a row without a kept key
      scores[0][0][1].fill_(1.0);        // a row of equal scores
      const auto sorted = std::get<1>(scores.sort(/*stable=*/true, -1, /*descending=*/true));
      for (int64_t k : {int64_t(1), (S + 1) / 2, S}) {
        SCOPED_TRACE("S " + std::to_string(S) + " k " + std::to_string(k));
        const auto idx = fastattn::ops::stable_topk_indices(scores, k);
        EXPECT_TRUE(torch::equal(idx, sorted.narrow(-1, 0, k)));
      }
    }
  }
  EXPECT_THROW(fastattn::ops::stable_topk_indices(torch::zeros({2, 3}), 4), c10::Error);
}

// The dense form of full_attention_lse_topk_forward (the CUDA op's) against
// the fused CPU kernel in float64: out, lse (-inf for an element without
// keys) and indices.
// S = 2500: the products over slices of 1024 keys plus the rest. Small
// integers for q and k: exact scores in float32 and float64, with ties.
TEST(FullAttentionLseTopk, DenseFormMatchesTheFusedKernel) {
  for (int64_t S : {130, 2500})
    for (int64_t topk : {int64_t(0), int64_t(5), S}) {
      SCOPED_TRACE("S " + std::to_string(S) + " topk " + std::to_string(topk));
      torch::manual_seed(5);
      auto q = torch::randint(-2, 3, {3, 2, 9, 16}, torch::kDouble),
           k = torch::randint(-2, 3, {3, 2, S, 16}, torch::kDouble),
           v = torch::randn({3, 2, S, 6}, torch::kDouble);
      const auto lengths = torch::tensor({S, int64_t(0), int64_t(41)}, torch::kLong);
      auto [out, lse, idx] =
          fastattn::ops::full_attention_dense(q, k, v, lengths, false, 0.25, topk);
      auto [out_r, lse_r, idx_r] = full_attention_lse_topk(q, k, v, lengths, 0.25, topk);
      EXPECT_EQ(out.scalar_type(), torch::kDouble);
      EXPECT_EQ(lse.scalar_type(), torch::kFloat);
      EXPECT_LT((out - out_r).abs().max().item<double>(), 1e-5);
      EXPECT_TRUE(torch::isinf(lse[1]).all().item<bool>());
      EXPECT_EQ(out[1].abs().sum().item<double>(), 0.0);
      const auto kept = lse_r.isfinite();
      EXPECT_LT((lse.to(torch::kDouble) - lse_r).masked_select(kept).abs().max().item<double>(),
                1e-5);
      EXPECT_TRUE(torch::equal(idx, idx_r));
    }
}

TEST(FullAttentionLseTopk, DenseFormWithoutQueries) {
  auto q = torch::randn({2, 3, 0, 4}), k = torch::randn({2, 3, 9, 4}),
       v = torch::randn({2, 3, 9, 5});
  auto [out, lse, idx] = fastattn::ops::full_attention_dense(q, k, v, c10::nullopt, false, 1.0, 6);
  EXPECT_EQ(out.sizes(), (std::vector<int64_t>{2, 3, 0, 5}));
  EXPECT_EQ(lse.sizes(), (std::vector<int64_t>{2, 3, 0}));
  EXPECT_EQ(idx.sizes(), (std::vector<int64_t>{2, 3, 0, 6}));
}

// ... and with the causal mask (offset S - L: fewer, as many and more
// queries than keys; rows without a key give zeros).
TEST(FullAttentionLseTopk, DenseFormMatchesTheFusedKernelCausal) {
  torch::manual_seed(6);
  for (int64_t L : {3, 40, 55}) {
    SCOPED_TRACE("L " + std::to_string(L));
    auto q = torch::randn({2, 2, L, 8}, torch::kDouble),
         k = torch::randn({2, 2, 40, 8}, torch::kDouble),
         v = torch::randn({2, 2, 40, 5}, torch::kDouble);
    const auto lengths = torch::tensor({40, 17}, torch::kLong);
    auto out = std::get<0>(fastattn::ops::full_attention_dense(q, k, v, lengths, true, 0.5, 0));
    auto ref = full_attention(q, k, v, std::nullopt, lengths, /*causal=*/true, 0.5);
    EXPECT_LT((out - ref).abs().max().item<double>(), 1e-5);
  }
}

TEST(FullAttentionLseTopk, BadInputsNameTheArgument) {
  auto q = torch::randn({1, 2, 5, 4}), k = torch::randn({1, 2, 6, 4}),
       v = torch::randn({1, 2, 6, 3});
  EXPECT_ERROR_CONTAINS(full_attention_lse_topk(q, k, v, std::nullopt, std::nullopt, 7),
                        "topk must be in [0, S] = [0, 6], got 7");
  EXPECT_ERROR_CONTAINS(full_attention_lse_topk(q, k, v, std::nullopt, std::nullopt, -1), "topk");
  EXPECT_ERROR_CONTAINS(full_attention_lse_topk(q, k.narrow(3, 0, 3), v), "k must agree with q");
  EXPECT_ERROR_CONTAINS(
      full_attention_lse_topk(q, k, v, torch::tensor({7}, torch::kLong), std::nullopt, 1),
      "key_lengths");
}

// The softmax backward's delta = rowsum(a ∘ b) read in place: contiguous,
// the layers' (N, L, H, M) views, padded rows, a broadcast head, against
// ATen's (a * b).sum(-1) in float64 (and float32).
TEST(RowDots, MatchesAtenInEveryRowLayout) {
  torch::manual_seed(5);
  const int64_t N = 2, H = 3, L = 77, M = 9;
  auto base = torch::randn({N, L, H, M + 4}, torch::kDouble);
  const std::vector<torch::Tensor> layouts = {
      torch::randn({N, H, L, M}, torch::kDouble),
      torch::randn({N, L, H, M}, torch::kDouble).transpose(1, 2),
      base.narrow(3, 2, M).transpose(1, 2),
      torch::randn({N, 1, L, M}, torch::kDouble).expand({N, H, L, M})};
  for (const auto& a : layouts) {
    for (const auto& b : layouts) {
      for (auto dtype : {torch::kDouble, torch::kFloat}) {
        const auto x = a.to(dtype), y = b.to(dtype);
        const auto got = ops::row_dots(x, y);
        EXPECT_TRUE(got.is_contiguous());
        EXPECT_TRUE(torch::allclose(got, (x * y).sum(-1), dtype == torch::kDouble ? 1e-12 : 1e-5,
                                    dtype == torch::kDouble ? 1e-12 : 1e-5));
      }
    }
  }
}

}  // namespace
}  // namespace fastattn
