// Reformer LSH attention: the hashing op and the chunked attention op against
// their plain-ATen references (float64 tight, float32, gradients, finite
// differences), the `reformer` type against full shared-QK attention (one
// bucket, one round), rounds vs error, causality, padding, seeds, awkward
// lengths and bad parameters.
//   ./build/fastattn_tests --gtest_filter='Reformer*'
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <iostream>

#include "expect_error.h"
#include "fastattn/ops.h"
#include "fastattn/reformer.h"
#include "fastattn/registry.h"
#include "op_harness.h"

namespace fastattn {
namespace {

using testing::Inputs;
using testing::OpCase;

// ---- lsh_hash -----------------------------------------------------------------

TEST(ReformerHash, MatchesReference) {
  torch::manual_seed(3);
  for (auto dtype : {torch::kDouble, torch::kFloat}) {
    // Up to 256 columns over the 3 rounds packed (B2 <= 85), more by gemm.
    for (int64_t b2 : {0, 1, 3, 16, 21, 32, 100}) {
      auto x = torch::randn({2, 3, 97, 17}, dtype);
      auto rot = torch::randn({3, 17, b2}, dtype);
      auto got = lsh_hash(x, rot);
      ASSERT_EQ(got.sizes(), (std::vector<int64_t>{2, 3, 3, 97}));
      EXPECT_TRUE(got.equal(reference::lsh_hash(x, rot))) << "B2 = " << b2 << " " << dtype;
      EXPECT_GE(got.min().item<int64_t>(), 0);
      EXPECT_LT(got.max().item<int64_t>(), std::max<int64_t>(1, 2 * b2));
    }
  }
}

TEST(ReformerHash, TiesGoToTheFirstColumn) {
  // Repeated rotation columns: every largest projection (and every smallest)
  // appears twice; the first one wins, as torch.argmax picks it.
  torch::manual_seed(6);
  for (auto dtype : {torch::kDouble, torch::kFloat}) {
    for (int64_t half : {3, 10, 40}) {
      auto x = torch::randn({2, 3, 97, 17}, dtype);
      auto cols = torch::randn({3, 17, half}, dtype);
      auto rot = torch::cat({cols, cols}, -1);
      const auto got = lsh_hash(x, rot), want = reference::lsh_hash(x, rot);
      const int64_t b2 = 2 * half;
      // The first copy of the winning column (the reference's matmul may
      // round the two copies apart, so it is compared up to the copy).
      EXPECT_TRUE(got.remainder(b2).lt(half).all().item<bool>()) << half << " " << dtype;
      auto cls = [&](const torch::Tensor& t) {
        return t.div(b2, "floor") * half + t.remainder(b2).remainder(half);
      };
      EXPECT_TRUE(cls(got).equal(cls(want))) << half << " " << dtype;
    }
  }
}

TEST(ReformerHash, ReadsRowLayoutsInPlace) {
  // The layers' (N, L, H, E) buffers viewed as (N, H, L, E), rows padded:
  // hashed in place, the same buckets as the contiguous copy.
  torch::manual_seed(4);
  auto x = torch::randn({2, 97, 3, 20}, torch::kDouble).narrow(3, 0, 17).transpose(1, 2);
  auto rot = torch::randn({3, 17, 8}, torch::kDouble);
  ASSERT_FALSE(x.is_contiguous());
  EXPECT_TRUE(lsh_hash(x, rot).equal(lsh_hash(x.contiguous(), rot)));
}

TEST(ReformerHash, BadInputsNamed) {
  auto x = torch::randn({1, 1, 4, 8});
  EXPECT_ERROR_CONTAINS(lsh_hash(x, torch::randn({2, 7, 4})), "rotations", "(R, E, n_buckets / 2)");
  EXPECT_ERROR_CONTAINS(lsh_hash(x, torch::randn({2, 8, 4}, torch::kDouble)), "rotations", "Float");
  EXPECT_ERROR_CONTAINS(lsh_hash(x.view({4, 8}), torch::randn({2, 8, 4})), "x", "(N, H, L, E)");
}

// ---- reformer_attention vs its reference ------------------------------------------

struct OpCfg {
  std::string name;
  int64_t N, H, L, E, M, R, n_buckets, chunk;
  bool causal = false;
  bool mask_self = true;
  std::vector<int64_t> lengths;  // empty: none
  std::optional<double> temp;
};

OpCase make_case(const OpCfg& c) {
  OpCase oc;
  oc.name = c.name;
  // Buckets are integer inputs (not differentiated): any assignment is valid.
  torch::manual_seed(77);
  auto buckets = torch::randint(0, c.n_buckets, {c.N, c.H, c.R, c.L}, torch::kLong);
  std::optional<torch::Tensor> lengths;
  if (!c.lengths.empty()) lengths = torch::tensor(c.lengths, torch::kLong);
  oc.make_inputs = [c](uint64_t seed) -> Inputs {
    torch::manual_seed(seed);
    return {torch::randn({c.N, c.H, c.L, c.E}, torch::kDouble),
            torch::randn({c.N, c.H, c.L, c.M}, torch::kDouble)};
  };
  oc.op = [c, buckets, lengths](const Inputs& x) {
    return reformer_attention(x[0], x[1], buckets, lengths, c.chunk, c.causal, c.mask_self, c.temp);
  };
  oc.reference = [c, buckets, lengths](const Inputs& x) {
    return reference::reformer_attention(x[0], x[1], buckets, lengths, c.chunk, c.causal,
                                         c.mask_self, c.temp);
  };
  oc.f64_tol = 1e-12;
  // float32: inputs rounded to float32 (relative 6e-8), the key normalisation
  // and sums over at most 2·chunk keys per round in float32; outputs are O(1).
  oc.f32_tol = 2e-5;
  return oc;
}

// Shared-QK: the op reads q (both roles) and v; k is the harness's third
// input, which the op ignores (no gradient). Causal and not, padding, several
// chunks and rounds.
TEST(ReformerOp, ReadsAndWritesRowLayoutsInPlace) {
  using torch::Tensor;
  const int64_t N = 2, H = 3, L = 97;
  torch::manual_seed(6);
  auto buckets = torch::randint(0, 4, {N, H, 3, L}, torch::kLong);
  const auto lengths = torch::tensor({int64_t(97), int64_t(60)}, torch::kLong);
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "not causal");
    testing::check_row_layouts(
        [&](const Tensor& q, const Tensor&, const Tensor& v) {
          return reformer_attention(q, v, buckets, lengths, 8, causal);
        },
        N, H, L, L, 8, 6);
  }
}

class ReformerOpCases : public ::testing::TestWithParam<OpCfg> {};

TEST_P(ReformerOpCases, MatchesReference) { testing::check_op(make_case(GetParam())); }

INSTANTIATE_TEST_SUITE_P(
    Shapes, ReformerOpCases,
    ::testing::Values(
        OpCfg{"tiny", 1, 1, 1, 1, 1, 1, 1, 4}, OpCfg{"two_positions", 1, 1, 2, 3, 2, 2, 2, 1},
        OpCfg{"b2_h3_97_chunk8_r3", 2, 3, 97, 16, 12, 3, 8, 8},
        OpCfg{"causal_97", 2, 2, 97, 16, 16, 2, 4, 8, true},
        OpCfg{"no_self_mask_97", 1, 2, 97, 8, 8, 2, 4, 8, false, false},
        OpCfg{"causal_no_self_mask", 1, 2, 50, 8, 8, 3, 4, 5, true, false},
        OpCfg{"padded", 2, 2, 97, 8, 6, 2, 4, 5, false, true, {97, 60}},
        OpCfg{"padded_causal_zero_length", 3, 1, 40, 8, 6, 2, 4, 5, true, true, {40, 0, 7}},
        OpCfg{"odd_dims_temp", 1, 2, 50, 17, 33, 2, 6, 7, false, true, {}, 0.5},
        OpCfg{"chunk_ge_L", 1, 2, 37, 8, 8, 2, 4, 64},
        OpCfg{"one_bucket_many_rounds", 1, 1, 33, 8, 8, 4, 1, 4, true},
        OpCfg{"L1025_chunk32", 1, 2, 1025, 8, 8, 2, 16, 32},
        // Nine chunks: a run of eight, then an odd run of one chunk at the end.
        OpCfg{"nine_chunks_odd_last_run", 1, 2, 36, 8, 8, 2, 4, 4},
        // Padded to 17 chunks of 3 and 9 chunks: runs end at different places
        // per batch element.
        OpCfg{"padded_runs", 2, 1, 60, 8, 8, 2, 4, 3, false, true, {50, 27}}),
    [](const auto& info) { return info.param.name; });

TEST(ReformerOp, BadInputsNamed) {
  auto q = torch::randn({1, 2, 10, 4}), v = torch::randn({1, 2, 10, 3});
  auto b = torch::zeros({1, 2, 2, 10}, torch::kLong);
  EXPECT_ERROR_CONTAINS(reformer_attention(q, v, b, std::nullopt, 0), "chunk_size", ">= 1", "0");
  EXPECT_ERROR_CONTAINS(reformer_attention(q, torch::randn({1, 2, 9, 3}), b), "v", "(N, H, L, M)");
  EXPECT_ERROR_CONTAINS(reformer_attention(q, v, b - 1), "buckets", "[0,");
  EXPECT_ERROR_CONTAINS(reformer_attention(q, v, b.to(torch::kInt)), "buckets", "int64");
  EXPECT_ERROR_CONTAINS(reformer_attention(q, v, b.narrow(3, 0, 9)), "buckets", "(N, H, R, L)");
  EXPECT_ERROR_CONTAINS(reformer_attention(q, v, b, torch::tensor({11})), "key_lengths");
  EXPECT_ERROR_CONTAINS(reformer_attention(q, v, b, std::nullopt, 4, false, true, -1.0),
                        "softmax_temp");
}

// ---- the `reformer` type ----------------------------------------------------------

AttentionPtr make_reformer(ParamMap p) { return make_attention("reformer", p); }

torch::Tensor normalised(const torch::Tensor& q) {
  return q / q.norm(2, -1, true).clamp_min(1e-12);
}

// Full shared-QK attention (keys = normalised queries) with the self score
// pushed to -1e5 and `keep` (L, L) as the other kept pairs, through the fused
// full attention op.
torch::Tensor shared_qk_full(const torch::Tensor& q, const torch::Tensor& v,
                             const torch::Tensor& keep, bool causal, bool mask_self = true) {
  const int64_t L = q.size(2);
  auto add = torch::zeros({L, L}, q.options()).masked_fill(keep.logical_not(), -INFINITY);
  if (mask_self) add = add.masked_fill(torch::eye(L, torch::kBool), -1e5);
  return full_attention(q, normalised(q), v, add, std::nullopt, causal);
}

// One bucket, one round: the sorted order is the position order, so chunk c
// sees the positions of chunks c-1 and c; with chunk_size >= L that is full
// shared-QK attention without the self position.
TEST(ReformerAttention, OneBucketOneRoundIsSharedQKFull) {
  struct Cfg {
    int64_t L, chunk;
    bool causal;
  };
  for (const auto& cfg : {Cfg{97, 128, false}, Cfg{97, 97, true}, Cfg{97, 16, false},
                          Cfg{97, 16, true}, Cfg{1025, 1025, false}, Cfg{1025, 100, true}}) {
    SCOPED_TRACE("L=" + std::to_string(cfg.L) + " chunk=" + std::to_string(cfg.chunk) +
                 (cfg.causal ? " causal" : ""));
    torch::manual_seed(5);
    const int64_t N = 2, H = 2, E = 16, M = 12, L = cfg.L;
    auto q = torch::randn({N, H, L, E}, torch::kDouble).requires_grad_();
    auto v = torch::randn({N, H, L, M}, torch::kDouble).requires_grad_();
    auto pos = torch::arange(L);
    auto ci = torch::div(pos, cfg.chunk, "floor");
    auto dc = ci.view({L, 1}) - ci.view({1, L});
    auto keep = dc.eq(0).logical_or(dc.eq(1));
    auto attn = make_reformer({{"n_buckets", int64_t(1)},
                               {"rounds", int64_t(1)},
                               {"chunk_size", cfg.chunk},
                               {"seed", int64_t(0)}});
    auto mask = Mask().with_causal(cfg.causal);
    auto out = attn->forward(q, q, v, mask);
    auto q2 = q.detach().clone().requires_grad_(), v2 = v.detach().clone().requires_grad_();
    auto ref = shared_qk_full(q2, v2, keep, cfg.causal);
    EXPECT_LE(testing::max_abs_diff(out, ref), 1e-12);
    auto w = torch::randn_like(ref);
    auto g = torch::autograd::grad({(out * w).sum()}, {q, v});
    auto gr = torch::autograd::grad({(ref * w).sum()}, {q2, v2});
    EXPECT_LE(testing::max_abs_diff(g[0], gr[0]), 1e-10);
    EXPECT_LE(testing::max_abs_diff(g[1], gr[1]), 1e-10);
  }
}

TEST(ReformerAttention, UnmaskedSelfIsPlainSharedQK) {
  torch::manual_seed(6);
  const int64_t L = 64;
  auto q = torch::randn({1, 2, L, 8}, torch::kDouble),
       v = torch::randn({1, 2, L, 8}, torch::kDouble);
  auto attn = make_reformer(
      {{"n_buckets", int64_t(1)}, {"rounds", int64_t(2)}, {"chunk_size", L}, {"masked", false}});
  auto ref = shared_qk_full(q, v, torch::ones({L, L}, torch::kBool), false, /*mask_self=*/false);
  EXPECT_LE(testing::max_abs_diff(attn->forward(q, q, v, Mask()), ref), 1e-12);
}

// More rounds cover more of each query's keys: on average over seeds the
// error against full shared-QK attention never grows with the rounds.
TEST(ReformerAttention, MoreRoundsNeverRaiseTheErrorOnAverage) {
  const int64_t N = 1, H = 4, L = 256, E = 16;
  const std::vector<int64_t> rounds = {1, 2, 4, 8};
  std::vector<double> err(rounds.size(), 0.0);
  const int seeds = 8;
  for (int s = 0; s < seeds; ++s) {
    torch::manual_seed(100 + s);
    auto q = torch::randn({N, H, L, E}, torch::kDouble) * 2;
    auto v = torch::randn({N, H, L, E}, torch::kDouble);
    auto full = shared_qk_full(q, v, torch::ones({L, L}, torch::kBool), false);
    for (size_t r = 0; r < rounds.size(); ++r) {
      auto attn = make_reformer({{"n_buckets", int64_t(8)},
                                 {"rounds", rounds[r]},
                                 {"chunk_size", int64_t(16)},
                                 {"seed", int64_t(1000 + s)}});
      err[r] += (attn->forward(q, q, v, Mask()) - full).abs().mean().item<double>() / seeds;
    }
  }
  for (size_t r = 1; r < rounds.size(); ++r) {
    EXPECT_LE(err[r], err[r - 1]) << rounds[r] << " rounds vs " << rounds[r - 1];
  }
  std::cout << "mean abs error vs full shared-QK, rounds 1/2/4/8: " << err[0] << " " << err[1]
            << " " << err[2] << " " << err[3] << "\n";
}

// Causal: values and keys after position t never change outputs up to t.
// (Which earlier keys a query sees can depend on later positions' buckets,
// as in Reformer; their values and key vectors never enter.)
TEST(ReformerAttention, CausalNeverSeesTheFuture) {
  torch::manual_seed(8);
  const int64_t N = 2, H = 2, L = 97, E = 8, M = 8, t = 40;
  auto q = torch::randn({N, H, L, E}, torch::kDouble).requires_grad_();
  auto v = torch::randn({N, H, L, M}, torch::kDouble).requires_grad_();
  ParamMap p{{"n_buckets", int64_t(4)}, {"chunk_size", int64_t(8)}, {"seed", int64_t(3)}};
  auto a1 = make_reformer(p), a2 = make_reformer(p);
  auto out = a1->forward(q, q, v, Mask::causal_mask());
  auto v2 = v.detach().clone();
  v2.narrow(2, t + 1, L - t - 1).normal_();
  auto out2 = a2->forward(q.detach(), q.detach(), v2, Mask::causal_mask());
  EXPECT_TRUE(out.narrow(2, 0, t + 1).detach().equal(out2.narrow(2, 0, t + 1)));
  EXPECT_FALSE(out.narrow(2, t + 1, L - t - 1).detach().equal(out2.narrow(2, t + 1, L - t - 1)));
  auto g = torch::autograd::grad({out.narrow(2, 0, t + 1).sum()}, {q, v});
  EXPECT_EQ(g[0].narrow(2, t + 1, L - t - 1).abs().max().item<double>(), 0.0);
  EXPECT_EQ(g[1].narrow(2, t + 1, L - t - 1).abs().max().item<double>(), 0.0);
  EXPECT_GT(g[0].narrow(2, 0, t + 1).abs().max().item<double>(), 0.0);
  // Position 0 sees only itself: its output is its value.
  EXPECT_LE(testing::max_abs_diff(out.select(2, 0), v.select(2, 0)), 1e-12);
}

// Padding: padded positions output zeros, get zero gradients, and the valid
// positions get what the unpadded sequence gets (same seed, same rotations).
TEST(ReformerAttention, PaddingRespected) {
  for (bool causal : {false, true}) {
    torch::manual_seed(9);
    const int64_t N = 2, H = 2, L = 97, E = 8, M = 6, len = 60;
    auto q = torch::randn({N, H, L, E}, torch::kDouble).requires_grad_();
    auto v = torch::randn({N, H, L, M}, torch::kDouble).requires_grad_();
    ParamMap p{{"n_buckets", int64_t(4)}, {"chunk_size", int64_t(8)}, {"seed", int64_t(4)}};
    auto mask = Mask().with_key_lengths(torch::tensor({L, len})).with_causal(causal);
    auto out = make_reformer(p)->forward(q, q, v, mask);
    auto pad = out.select(0, 1).narrow(1, len, L - len);
    EXPECT_EQ(pad.abs().max().item<double>(), 0.0);
    auto short_q = q.detach().narrow(2, 0, len), short_v = v.detach().narrow(2, 0, len);
    auto ref = make_reformer(p)->forward(short_q, short_q, short_v, Mask().with_causal(causal));
    EXPECT_LE(testing::max_abs_diff(out.select(0, 1).narrow(1, 0, len), ref.select(0, 1)), 1e-12);
    auto g = torch::autograd::grad({out.sum()}, {q, v});
    EXPECT_EQ(g[0].select(0, 1).narrow(1, len, L - len).abs().max().item<double>(), 0.0);
    EXPECT_EQ(g[1].select(0, 1).narrow(1, len, L - len).abs().max().item<double>(), 0.0);
    // Query lengths count as padding too (every position is a query and a key).
    auto out_q = make_reformer(p)->forward(
        q.detach(), q.detach(), v.detach(),
        Mask().with_query_lengths(torch::tensor({L, len})).with_causal(causal));
    EXPECT_LE(testing::max_abs_diff(out_q, out), 0.0);
  }
}

TEST(ReformerAttention, SameSeedSameOutput) {
  torch::manual_seed(10);
  auto q = torch::randn({1, 2, 200, 16}), v = torch::randn({1, 2, 200, 16});
  auto out1 =
      make_reformer({{"seed", int64_t(7)}, {"n_buckets", int64_t(8)}})->forward(q, q, v, Mask());
  auto out2 =
      make_reformer({{"seed", int64_t(7)}, {"n_buckets", int64_t(8)}})->forward(q, q, v, Mask());
  auto out3 =
      make_reformer({{"seed", int64_t(8)}, {"n_buckets", int64_t(8)}})->forward(q, q, v, Mask());
  EXPECT_TRUE(out1.equal(out2));
  EXPECT_FALSE(out1.equal(out3));
  // The keys argument is ignored (shared QK).
  auto out4 = make_reformer({{"seed", int64_t(7)}, {"n_buckets", int64_t(8)}})
                  ->forward(q, torch::randn_like(q), v, Mask());
  EXPECT_TRUE(out1.equal(out4));
}

// Default parameters on lengths that are not multiples of chunk_size: the
// type equals the reference op on the buckets the same seed draws.
TEST(ReformerAttention, AwkwardLengthsMatchReference) {
  for (int64_t L : {97, 1025}) {
    for (bool causal : {false, true}) {
      SCOPED_TRACE("L=" + std::to_string(L) + (causal ? " causal" : ""));
      torch::manual_seed(11);
      auto q = torch::randn({1, 2, L, 16}, torch::kDouble);
      auto v = torch::randn({1, 2, L, 16}, torch::kDouble);
      ReformerOptions o;
      o.seed = 12;
      o.n_buckets = 8;
      ReformerAttention a(o), b(o);
      auto out = a.forward(q, q, v, Mask().with_causal(causal));
      auto buckets = b.hash(q);
      EXPECT_EQ(buckets.sizes(), (std::vector<int64_t>{1, 2, 4, L}));
      auto ref = reference::reformer_attention(q, v, buckets, std::nullopt, 32, causal, true,
                                               std::nullopt);
      EXPECT_LE(testing::max_abs_diff(out, ref), 1e-12);
    }
  }
}

TEST(ReformerAttention, Float32CloseToFloat64) {
  torch::manual_seed(13);
  auto q = torch::randn({2, 2, 300, 32}, torch::kDouble),
       v = torch::randn({2, 2, 300, 32}, torch::kDouble);
  ParamMap p{{"seed", int64_t(1)}, {"n_buckets", int64_t(8)}};
  auto o64 = make_reformer(p)->forward(q, q, v, Mask());
  auto q32 = q.to(torch::kFloat), v32 = v.to(torch::kFloat);
  // The same seed draws the same rotations (float64, then cast); float32
  // rounding can flip a near-tie bucket, so compare through the reference
  // on the float32 buckets.
  ReformerOptions o;
  o.seed = 1;
  o.n_buckets = 8;
  auto buckets = ReformerAttention(o).hash(q32);
  auto o32 = make_reformer(p)->forward(q32, q32, v32, Mask());
  auto ref =
      reference::reformer_attention(q, v, buckets, std::nullopt, 32, false, true, std::nullopt);
  EXPECT_LE(testing::max_abs_diff(o32, ref), 2e-5);
  EXPECT_EQ(o64.sizes(), o32.sizes());
}

TEST(ReformerAttention, BadParamsNamed) {
  EXPECT_ERROR_CONTAINS(make_reformer({{"n_buckets", int64_t(3)}}), "n_buckets", "even", "3");
  EXPECT_ERROR_CONTAINS(make_reformer({{"n_buckets", int64_t(0)}}), "n_buckets");
  EXPECT_ERROR_CONTAINS(make_reformer({{"chunk_size", int64_t(0)}}), "chunk_size");
  EXPECT_ERROR_CONTAINS(make_reformer({{"rounds", int64_t(0)}}), "rounds");
  EXPECT_ERROR_CONTAINS(make_reformer({{"rounds", kMaxReformerRounds + 1}}), "rounds", "1024");
  EXPECT_ERROR_CONTAINS(make_reformer({{"softmax_temp", 0.0}}), "softmax_temp");
  EXPECT_ERROR_CONTAINS(make_reformer({{"seed", int64_t(-1)}}), "seed");
  EXPECT_ERROR_CONTAINS(make_reformer({{"bits", int64_t(8)}}), "bits");
  auto attn = make_reformer({});
  auto q = torch::randn({1, 1, 10, 4}), v = torch::randn({1, 1, 10, 4});
  EXPECT_ERROR_CONTAINS(
      attn->forward(q, torch::randn({1, 1, 12, 4}), torch::randn({1, 1, 12, 4}), Mask()),
      "reformer", "S == L");
  EXPECT_ERROR_CONTAINS(
      attn->forward(q, q, v, Mask().with_attn_mask(torch::ones({10, 10}, torch::kBool))),
      "reformer: attn_mask: got a boolean attn_mask", "which reformer does not take");
}

// Sizes the inputs cannot use are clamped before anything is allocated: a
// chunk_size past L is one chunk of L (it used to size the kernel's buffers:
// 100000 ended the process in std::bad_alloc), an n_buckets past L is L
// rounded up to even (the rotation matrix had n_buckets / 2 columns).
TEST(ReformerAttention, HugeChunkAndBucketCountsClampedToTheSequence) {
  torch::manual_seed(14);
  const int64_t L = 9;
  auto q = torch::randn({1, 2, L, 4}, torch::kDouble),
       v = torch::randn({1, 2, L, 4}, torch::kDouble);
  for (bool causal : {false, true}) {
    auto mask = Mask().with_causal(causal);
    auto run = [&](int64_t chunk, int64_t buckets) {
      return make_reformer({{"seed", int64_t(5)}, {"chunk_size", chunk}, {"n_buckets", buckets}})
          ->forward(q, q, v, mask);
    };
    const auto ref = run(L, L + 1);
    EXPECT_TRUE(torch::equal(run(int64_t(1) << 62, L + 1), ref));
    EXPECT_TRUE(torch::equal(run(L, int64_t(1) << 24), ref));
    EXPECT_TRUE(torch::equal(run(100000, int64_t(1) << 24), ref));
    // Below L nothing changes: a smaller chunk gives another result.
    EXPECT_FALSE(torch::equal(run(2, L + 1), ref));
  }
  // The operator clamps the chunk too (its buffers were sized by it).
  auto buckets = torch::randint(0, 4, {1, 2, 3, L}, torch::kLong);
  EXPECT_TRUE(torch::equal(
      reformer_attention(q, v, buckets, std::nullopt, int64_t(1) << 40, false, true, std::nullopt),
      reformer_attention(q, v, buckets, std::nullopt, L, false, true, std::nullopt)));
}

TEST(ReformerAttention, Registered) {
  auto& reg = AttentionRegistry::global();
  ASSERT_TRUE(reg.contains("reformer"));
  auto attn = make_reformer({});
  EXPECT_EQ(attn->type_name(), "reformer");
  auto* r = dynamic_cast<ReformerAttention*>(attn.get());
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(r->options().chunk_size, 32);
  EXPECT_EQ(r->options().n_buckets, 64);
  EXPECT_EQ(r->options().rounds, 4);
  EXPECT_TRUE(r->options().masked);
  EXPECT_TRUE(reg.contains("conditional-full:reformer"));
}

}  // namespace
}  // namespace fastattn
