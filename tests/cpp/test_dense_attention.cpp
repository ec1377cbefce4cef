// The dense-attention engine (src/ops/dense_attention.h, issue 62): forward
// (out and lse) and backward against the float64 reference of its semantics
// (bottom-right alignment, causal, windows, key lengths, packed
// variable-length sequences), float32 and float64; and the composition
// plumbing the GPU route will use: a key set split into disjoint pieces,
// merged by logsumexp, with every piece's backward given the merged out and
// lse, has the whole's output and gradients.
//
//   build/fastattn_tests --gtest_filter='DenseAttention*'
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "expect_error.h"
#include "fastattn/attention.h"
#include "fastattn/hard_retrieval.h"
#include "fastattn/mask.h"
#include "fastattn/ops.h"
#include "fastattn/registry.h"
#include "ops/dense_attention.h"
#include "ops/engine_pieces.h"

namespace fastattn {
namespace {

using ops::DenseAttentionSpec;
using torch::Tensor;

struct Case {
  int64_t L, S;
  bool causal;
  int64_t left, right;
  bool lengths;
};

std::string case_name(const Case& c) {
  auto w = [](int64_t x) { return x < 0 ? std::string("inf") : std::to_string(x); };
  return "L" + std::to_string(c.L) + "S" + std::to_string(c.S) + (c.causal ? "_causal" : "") +
         "_w" + w(c.left) + "_" + w(c.right) + (c.lengths ? "_lengths" : "");
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (auto [L, S] :
       std::vector<std::pair<int64_t, int64_t>>{{7, 7}, {5, 70}, {70, 5}, {1, 9}, {66, 66}})
    for (bool causal : {false, true})
      for (auto [l, r] : std::vector<std::pair<int64_t, int64_t>>{
               {-1, -1}, {3, -1}, {-1, 2}, {2, 0}, {0, 0}, {40, 1}})
        for (bool lengths : {false, true}) out.push_back({L, S, causal, l, r, lengths});
  return out;
}

DenseAttentionSpec spec_of(const Case& c, int64_t N) {
  DenseAttentionSpec spec;
  spec.scale = 0.37;
  spec.causal = c.causal;
  spec.window_left = c.left;
  spec.window_right = c.right;
  if (c.lengths) {
    std::vector<int64_t> kl(N);
    for (int64_t n = 0; n < N; ++n) kl[n] = (c.S * (n + 1)) / (N + 1);  // includes 0 for S < 3
    spec.key_lengths = torch::tensor(kl, torch::kLong);
  }
  return spec;
}

double max_err(const Tensor& a, const Tensor& b) {
  // -inf in the same places counts as equal.
  auto both_inf = torch::isinf(a) & torch::isinf(b) & (a.sign() == b.sign());
  return (a.to(torch::kDouble) - b.to(torch::kDouble))
      .masked_fill(both_inf, 0.0)
      .abs()
      .max()
      .item<double>();
}

class DenseAttentionCases : public ::testing::TestWithParam<Case> {};

TEST_P(DenseAttentionCases, ForwardAndBackwardEqualTheReference) {
  const Case c = GetParam();
  const int64_t N = 2, H = 3, E = 5, M = 4;
  torch::manual_seed(7);
  auto q = torch::randn({N, H, c.L, E}, torch::kDouble),
       k = torch::randn({N, H, c.S, E}, torch::kDouble),
       v = torch::randn({N, H, c.S, M}, torch::kDouble);
  const auto spec = spec_of(c, N);
  auto [ref_out, ref_lse] = reference::dense_attention(q, k, v, spec);
  // Gradients of the reference through autograd, for a fixed output weight.
  auto g = torch::randn({N, H, c.L, M}, torch::kDouble);
  auto ql = q.clone().requires_grad_(true), kl = k.clone().requires_grad_(true),
       vl = v.clone().requires_grad_(true);
  auto [o_ref, l_ref] = reference::dense_attention(ql, kl, vl, spec);
  auto ref_grads = torch::autograd::grad({o_ref}, {ql, kl, vl}, {g});

  for (auto dtype : {torch::kDouble, torch::kFloat}) {
    const double tol = dtype == torch::kDouble ? 1e-12 : 2e-5;
    auto [out, lse] = ops::dense_attention_forward(q.to(dtype), k.to(dtype), v.to(dtype), spec);
    EXPECT_EQ(out.sizes(), (std::vector<int64_t>{N, H, c.L, M}));
    EXPECT_EQ(lse.sizes(), (std::vector<int64_t>{N, H, c.L}));
    EXPECT_LE(max_err(out, ref_out), tol) << "out, " << dtype;
    EXPECT_LE(max_err(lse, ref_lse), tol * 10) << "lse, " << dtype;
    auto [dq, dk, dv] = ops::dense_attention_backward(g.to(dtype), q.to(dtype), k.to(dtype),
                                                      v.to(dtype), out, lse, spec);
    EXPECT_LE(max_err(dq, ref_grads[0]), tol * 10) << "dq, " << dtype;
    EXPECT_LE(max_err(dk, ref_grads[1]), tol * 10) << "dk, " << dtype;
    EXPECT_LE(max_err(dv, ref_grads[2]), tol * 10) << "dv, " << dtype;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, DenseAttentionCases, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return case_name(info.param); });

TEST(DenseAttention, RowsWithoutKeysGiveZeroAndMinusInfinity) {
  // Causal with L > S: the first L - S queries sit before every key.
  torch::manual_seed(1);
  auto q = torch::randn({1, 2, 6, 3}, torch::kDouble),
       k = torch::randn({1, 2, 2, 3}, torch::kDouble),
       v = torch::randn({1, 2, 2, 4}, torch::kDouble);
  DenseAttentionSpec spec;
  spec.causal = true;
  auto [out, lse] = ops::dense_attention_forward(q, k, v, spec);
  EXPECT_TRUE(torch::equal(out.narrow(2, 0, 4), torch::zeros({1, 2, 4, 4}, torch::kDouble)));
  auto dead = lse.narrow(2, 0, 4);
  EXPECT_TRUE((torch::isinf(dead) & dead.lt(0)).all().item<bool>());
  EXPECT_TRUE(torch::isfinite(lse.narrow(2, 4, 2)).all().item<bool>());
}

// Packed sequences of (queries, keys): empty ones included.
struct PackedInputs {
  Tensor q, k, v, cu_q, cu_k;
};

PackedInputs packed_inputs(const std::vector<std::pair<int64_t, int64_t>>& lengths, int64_t H,
                           int64_t E, int64_t M) {
  std::vector<int64_t> cq{0}, ck{0};
  for (auto [l, s] : lengths) {
    cq.push_back(cq.back() + l);
    ck.push_back(ck.back() + s);
  }
  return {torch::randn({cq.back(), H, E}, torch::kDouble),
          torch::randn({ck.back(), H, E}, torch::kDouble),
          torch::randn({ck.back(), H, M}, torch::kDouble), torch::tensor(cq, torch::kLong),
          torch::tensor(ck, torch::kLong)};
}

TEST(DenseAttention, PackedSequencesEqualTheirOwnPaddedCalls) {
  torch::manual_seed(3);
  const auto in = packed_inputs({{3, 5}, {0, 4}, {6, 2}, {4, 0}, {65, 70}}, 2, 4, 3);
  for (bool causal : {false, true}) {
    for (auto [l, r] : std::vector<std::pair<int64_t, int64_t>>{{-1, -1}, {1, 0}, {3, 2}}) {
      DenseAttentionSpec spec;
      spec.scale = 0.5;
      spec.causal = causal;
      spec.window_left = l;
      spec.window_right = r;
      spec.cu_seqlens_q = in.cu_q;
      spec.cu_seqlens_k = in.cu_k;
      const std::string what = std::string(causal ? "causal" : "") + " window " +
                               std::to_string(l) + "," + std::to_string(r);
      auto [ref_out, ref_lse] = reference::dense_attention(in.q, in.k, in.v, spec);
      auto [out, lse] = ops::dense_attention_forward(in.q, in.k, in.v, spec);
      ASSERT_EQ(out.sizes(), ref_out.sizes());
      EXPECT_LE(max_err(out, ref_out), 1e-12) << what;
      EXPECT_LE(max_err(lse, ref_lse), 1e-12) << what;
      auto g = torch::randn_like(out);
      auto ql = in.q.clone().requires_grad_(true), kl = in.k.clone().requires_grad_(true),
           vl = in.v.clone().requires_grad_(true);
      auto ref = torch::autograd::grad({std::get<0>(reference::dense_attention(ql, kl, vl, spec))},
                                       {ql, kl, vl}, {g});
      auto [dq, dk, dv] = ops::dense_attention_backward(g, in.q, in.k, in.v, out, lse, spec);
      EXPECT_LE(max_err(dq, ref[0]), 1e-11) << what;
      EXPECT_LE(max_err(dk, ref[1]), 1e-11) << what;
      EXPECT_LE(max_err(dv, ref[2]), 1e-11) << what;
    }
  }
}

// The composition the GPU route uses: causal attention as two disjoint pieces
// (a window of the w keys up to the query, and the causal attention over the
// keys before it: the first S - w keys, whose bottom-right alignment puts
// query i at p - w), merged by logsumexp; each piece's backward gets the
// merged out and lse, and the pieces' gradients add up.
TEST(DenseAttention, PiecesMergedByLseHaveTheWholesOutputAndGradients) {
  torch::manual_seed(5);
  const int64_t N = 2, H = 2, L = 40, S = 40, E = 6, M = 5, w = 7;
  auto q = torch::randn({N, H, L, E}, torch::kDouble),
       k = torch::randn({N, H, S, E}, torch::kDouble),
       v = torch::randn({N, H, S, M}, torch::kDouble);
  DenseAttentionSpec whole;
  whole.scale = 0.4;
  whole.causal = true;
  DenseAttentionSpec band = whole;
  band.window_left = w - 1;
  const auto k_early = k.narrow(2, 0, S - w), v_early = v.narrow(2, 0, S - w);

  auto [o1, l1] = ops::dense_attention_forward(q, k, v, band);
  auto [o2, l2] = ops::dense_attention_forward(q, k_early, v_early, whole);
  auto [out, lse] = ops::merge_by_lse({o1, o2}, {l1, l2});
  auto [ref_out, ref_lse] = reference::dense_attention(q, k, v, whole);
  EXPECT_LE(max_err(out, ref_out), 1e-12);
  EXPECT_LE(max_err(lse, ref_lse), 1e-12);

  auto g = torch::randn_like(out);
  auto [dq1, dk1, dv1] = ops::dense_attention_backward(g, q, k, v, out, lse, band);
  auto [dq2, dk2, dv2] = ops::dense_attention_backward(g, q, k_early, v_early, out, lse, whole);
  auto dq = dq1 + dq2, dk = dk1.clone(), dv = dv1.clone();
  dk.narrow(2, 0, S - w).add_(dk2);
  dv.narrow(2, 0, S - w).add_(dv2);
  auto [dq_ref, dk_ref, dv_ref] = ops::dense_attention_backward(g, q, k, v, out, lse, whole);
  EXPECT_LE(max_err(dq, dq_ref), 1e-11);
  EXPECT_LE(max_err(dk, dk_ref), 1e-11);
  EXPECT_LE(max_err(dv, dv_ref), 1e-11);
  // ... and the reference's autograd gradients.
  auto ql = q.clone().requires_grad_(true), kl = k.clone().requires_grad_(true),
       vl = v.clone().requires_grad_(true);
  auto ref = torch::autograd::grad({std::get<0>(reference::dense_attention(ql, kl, vl, whole))},
                                   {ql, kl, vl}, {g});
  EXPECT_LE(max_err(dq, ref[0]), 1e-11);
  EXPECT_LE(max_err(dk, ref[1]), 1e-11);
  EXPECT_LE(max_err(dv, ref[2]), 1e-11);
  // Without the merged out and lse, a piece's own backward is not the whole's.
  auto [dq_own, dk_own, dv_own] = ops::dense_attention_backward(g, q, k, v, o1, l1, band);
  EXPECT_GT(max_err(dq_own + dq2, ref[0]), 1e-3);
}

TEST(DenseAttention, MergeOfPiecesWithoutKeys) {
  // A row no piece has keys for: out 0, lse -inf (not NaN).
  auto o = torch::zeros({1, 1, 2, 3}, torch::kDouble);
  auto l = torch::full({1, 1, 2}, -std::numeric_limits<double>::infinity(), torch::kDouble);
  auto o2 = torch::ones({1, 1, 2, 3}, torch::kDouble);
  auto l2 = l.clone();
  l2[0][0][1] = 0.5;
  auto [out, lse] = ops::merge_by_lse({o, o2}, {l, l2});
  EXPECT_TRUE(torch::equal(out[0][0][0], torch::zeros({3}, torch::kDouble)));
  EXPECT_TRUE(torch::equal(out[0][0][1], torch::ones({3}, torch::kDouble)));
  EXPECT_TRUE(std::isinf(lse[0][0][0].item<double>()));
  EXPECT_DOUBLE_EQ(lse[0][0][1].item<double>(), 0.5);
}

// The types composed on the engine (the route CUDA takes with float16 /
// bfloat16) give their own kernels' outputs and gradients: run on the CPU
// with the route forced (DenseEngineRoute::Always).
class DenseEngineRouteScope {
 public:
  explicit DenseEngineRouteScope(ops::DenseEngineRoute r) : saved_(ops::dense_engine_route()) {
    ops::set_dense_engine_route(r);
  }
  ~DenseEngineRouteScope() { ops::set_dense_engine_route(saved_); }

 private:
  ops::DenseEngineRoute saved_;
};

TEST(DenseAttention, TypesOnTheEngineEqualTheirOwnKernels) {
  struct TypeCase {
    std::string type;
    ParamMap params;
    bool causal = true;  // takes a causal mask
  };
  const std::vector<TypeCase> types = {
      {"full", {}},
      {"full", {{"softmax_temp", 0.3}}},
      {"local", {{"window", int64_t{5}}}},
      {"local", {{"window", int64_t{4}}, {"softmax_temp", 0.6}}},
      {"local", {{"window", int64_t{1}}}},
      {"sparse-strided", {{"stride", int64_t{3}}}},
      {"sparse-strided", {{"stride", int64_t{1}}}},
      {"sparse-strided", {{"stride", int64_t{4}}, {"mode", std::string("split")}}},
      {"sparse-strided", {{"stride", int64_t{2}}, {"mode", std::string("interleaved")}}},
      {"sparse-strided",
       {{"stride", int64_t{3}}, {"mode", std::string("interleaved")}, {"part", int64_t{2}}}},
      {"sparse-strided", {{"stride", int64_t{1} << 62}}},
      {"sparse-strided", {}},
      {"sparse-fixed", {{"stride", int64_t{4}}, {"summary", int64_t{2}}}},
      {"sparse-fixed",
       {{"stride", int64_t{4}}, {"summary", int64_t{1}}, {"per_head_summary", true}}},
      {"sparse-fixed",
       {{"stride", int64_t{5}},
        {"mode", std::string("split")},
        {"summary", int64_t{2}},
        {"per_head_summary", true}}},
      {"sparse-fixed", {{"stride", int64_t{3}}, {"mode", std::string("interleaved")}}},
      {"sparse-fixed",
       {{"stride", int64_t{4}},
        {"summary", int64_t{3}},
        {"mode", std::string("interleaved")},
        {"part", int64_t{2}}}},
      {"sparse-fixed", {{"stride", int64_t{1} << 62}, {"summary", int64_t{2}}}},
      {"sparse-fixed", {}},
      // training: the straight-through backward on the engine (evaluation
      // without training: the argmax, the same gradients)
      {"hard-retrieval", {{"seed", int64_t{7}}}},
      {"hard-retrieval", {{"seed", int64_t{7}}, {"train_mode", std::string("argmax")}}},
      {"hard-retrieval", {{"softmax_temp", 0.8}}},
      // the centroids' attention on the engine; improved: the members' top-k
      // part as packed sequences (without key lengths)
      {"clustered", {{"clusters", int64_t{3}}, {"seed", int64_t{5}}}, false},
      {"improved-clustered",
       {{"clusters", int64_t{3}}, {"topk", int64_t{4}}, {"seed", int64_t{5}}},
       false},
      {"improved-clustered",
       {{"clusters", int64_t{4}},
        {"topk", int64_t{20}},
        {"seed", int64_t{3}},
        {"softmax_temp", 0.4}},
       false},
      // each round's sorted chunks as packed sequences (without causal and
      // key lengths), the masked self as a piece of its own
      {"reformer", {{"chunk_size", int64_t{3}}, {"n_buckets", int64_t{4}}, {"seed", int64_t{2}}}},
      {"reformer",
       {{"chunk_size", int64_t{4}},
        {"rounds", int64_t{2}},
        {"masked", false},
        {"seed", int64_t{2}}}},
      {"reformer", {{"chunk_size", int64_t{1}}, {"rounds", int64_t{1}}, {"seed", int64_t{4}}}},
      {"reformer", {{"chunk_size", int64_t{64}}, {"seed", int64_t{4}}}},
      // the sorted blocks as packed sequences (without causal and key lengths)
      {"clusterformer", {{"clusters", int64_t{3}}, {"seed", int64_t{1}}}},
      {"clusterformer", {{"clusters", int64_t{5}}, {"seed", int64_t{2}}, {"softmax_temp", 0.3}}},
      {"clusterformer", {{"clusters", int64_t{1}}, {"seed", int64_t{3}}}},
  };
  torch::manual_seed(9);
  for (const auto& tc : types) {
    for (bool causal : {false, true}) {
      if (causal && !tc.causal) continue;
      for (bool lengths : {false, true}) {
        for (auto [L, S] : std::vector<std::pair<int64_t, int64_t>>{{11, 11}, {6, 13}, {13, 6}}) {
          if ((tc.type == "reformer" || tc.type == "clusterformer") && L != S) continue;
          const std::string what = tc.type + "#" + std::to_string(&tc - types.data()) +
                                   (causal ? " causal" : "") + (lengths ? " lengths" : "") + " L" +
                                   std::to_string(L) + " S" + std::to_string(S);
          Mask mask = Mask().with_causal(causal);
          if (lengths) mask = mask.with_key_lengths(torch::tensor({S, S / 2}, torch::kLong));
          auto q = torch::randn({2, 3, L, 4}, torch::kDouble).requires_grad_(true);
          auto k = torch::randn({2, 3, S, 4}, torch::kDouble).requires_grad_(true);
          auto v = torch::randn({2, 3, S, 3}, torch::kDouble).requires_grad_(true);
          auto g = torch::randn({2, 3, L, 3}, torch::kDouble);
          // 0: own kernels; 1: the engine; 2: the engine again (the sparse
          // types' cached plan)
          std::vector<Tensor> results[3];
          for (int engine = 0; engine < 3; ++engine) {
            DenseEngineRouteScope scope(engine ? ops::DenseEngineRoute::Always
                                               : ops::DenseEngineRoute::Never);
            // A fresh module per run: hard retrieval's seeded generator draws
            // the same samples.
            auto attn = make_attention(tc.type, tc.params, {3, 4, 3});
            attn->train(tc.type == "hard-retrieval" && tc.params.count("seed") > 0);
            auto out = attn->forward(q, k, v, mask);
            // (reformer's keys are its normalised queries: k is unused)
            auto grads = torch::autograd::grad({out}, {q, k, v}, {g}, c10::nullopt, false, true);
            for (int i = 0; i < 3; ++i)
              if (!grads[i].defined()) grads[i] = torch::zeros_like(i == 0 ? q : i == 1 ? k : v);
            results[engine] = {out.detach(), grads[0], grads[1], grads[2]};
          }
          for (int i = 0; i < 4; ++i)
            for (int engine = 1; engine < 3; ++engine)
              EXPECT_LE(max_err(results[engine][i], results[0][i]), 1e-12)
                  << what << " result " << i << " run " << engine;
        }
      }
    }
  }
}

// How many pieces give query i key j in head h: (H, L, S), from the pieces'
// own rules (windows; packed sequences, causal aligned bottom-right).
Tensor piece_cover(const std::vector<ops::EnginePiece>& pieces, int64_t H, int64_t L, int64_t S) {
  auto count = torch::zeros({H, L, S}, torch::kLong);
  auto a = count.accessor<int64_t, 3>();
  for (const auto& p : pieces) {
    std::vector<int64_t> heads = p.heads;
    if (heads.empty())
      for (int64_t h = 0; h < H; ++h) heads.push_back(h);
    for (int64_t h : heads) {
      if (p.padded) {
        for (int64_t i = 0; i < L; ++i)
          for (int64_t j = 0; j < S; ++j) {
            const int64_t pos = i + S - L;
            const bool keep = (!p.causal || j <= pos) &&
                              (p.window_left < 0 || j >= pos - p.window_left) &&
                              (p.window_right < 0 || j <= pos + p.window_right);
            a[h][i][j] += keep;
          }
        continue;
      }
      for (size_t b = 0; b + 1 < p.cu_q.size(); ++b) {
        const int64_t nq = p.cu_q[b + 1] - p.cu_q[b], nk = p.cu_k[b + 1] - p.cu_k[b];
        for (int64_t x = 0; x < nq; ++x)
          for (int64_t y = 0; y < nk; ++y)
            if (!p.causal || y <= x + nk - nq)
              a[h][p.q_rows[p.cu_q[b] + x]][p.k_rows[p.cu_k[b] + y]] += 1;
      }
    }
  }
  return count;
}

TEST(DenseAttention, PiecesCoverTheBlockSparsePatternOnce) {
  // The pieces of every strided / fixed pattern are disjoint and their union
  // is the block-sparse operator's pattern (reference::block_sparse_mask).
  int64_t checked = 0;
  for (auto [L, S] : std::vector<std::pair<int64_t, int64_t>>{{9, 9}, {5, 12}, {12, 5}, {1, 7}})
    for (int64_t H : {1, 2, 3, 4})
      for (bool causal : {false, true})
        for (int64_t which = 0; which < 4; ++which) {
          if (which == 3 && H < 2) continue;
          std::vector<std::pair<std::string, std::vector<int64_t>>> patterns;
          for (int64_t l : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{5}, int64_t{1} << 62})
            patterns.push_back({"strided", {l, which}});
          for (int64_t l : {int64_t{1}, int64_t{3}, int64_t{4}, int64_t{6}, int64_t{1} << 62})
            for (int64_t c : {int64_t{1}, int64_t{2}, int64_t{3}, l})
              for (int64_t per_head : {0, 1})
                if (c <= l) patterns.push_back({"fixed", {l, c, which, per_head}});
          for (const auto& [name, params] : patterns) {
            const auto pieces = ops::block_sparse_pieces(name, params, causal, H, L, S);
            const auto cover = piece_cover(pieces, H, L, S);
            const auto want =
                reference::block_sparse_mask(name, params, causal, H, L, S).to(torch::kLong);
            ASSERT_TRUE(torch::equal(cover, want))
                << name << " " << c10::IntArrayRef(params) << (causal ? " causal" : "") << " H" << H
                << " L" << L << " S" << S << ": max cover " << cover.max().item<int64_t>();
            ++checked;
          }
        }
  EXPECT_GT(checked, 1000);
}

TEST(DenseAttention, ImprovedClusteredWithPaddedQueriesOnTheEngine) {
  // Padded queries join no cluster: on the engine they form one last
  // sequence without keys (output 0, no gradient), as the fused operator.
  torch::manual_seed(6);
  auto q = torch::randn({2, 3, 10, 4}, torch::kDouble).requires_grad_(true);
  auto k = torch::randn({2, 3, 10, 4}, torch::kDouble).requires_grad_(true);
  auto v = torch::randn({2, 3, 10, 3}, torch::kDouble).requires_grad_(true);
  auto g = torch::randn({2, 3, 10, 3}, torch::kDouble);
  const Mask mask = Mask().with_query_lengths(torch::tensor({10, 6}, torch::kLong));
  std::vector<Tensor> r[2];
  for (int engine = 0; engine < 2; ++engine) {
    DenseEngineRouteScope scope(engine ? ops::DenseEngineRoute::Always
                                       : ops::DenseEngineRoute::Never);
    auto attn = make_attention(
        "improved-clustered",
        {{"clusters", int64_t{3}}, {"topk", int64_t{4}}, {"seed", int64_t{1}}}, {3, 4, 3});
    auto out = attn->forward(q, k, v, mask);
    auto grads = torch::autograd::grad({out}, {q, k, v}, {g});
    r[engine] = {out.detach(), grads[0], grads[1], grads[2]};
  }
  EXPECT_TRUE(r[1][0][1].narrow(1, 6, 4).eq(0).all().item<bool>());
  for (int i = 0; i < 4; ++i) EXPECT_LE(max_err(r[1][i], r[0][i]), 1e-12) << "result " << i;
}

TEST(DenseAttention, HardRetrievalArgmaxByScoreTilesEqualsTheKernel) {
  // Evaluation without gradients: the argmax by score tiles (matrix
  // products) against the hard-retrieval kernel, index and output, with
  // exact ties (a repeated key: the lowest index wins) and rows without keys.
  torch::manual_seed(4);
  for (auto dtype : {torch::kFloat, torch::kDouble})
    for (bool causal : {false, true})
      for (bool lengths : {false, true})
        for (auto [L, S] : std::vector<std::pair<int64_t, int64_t>>{{9, 9}, {4, 12}, {12, 4}}) {
          auto q = torch::randn({2, 3, L, 5}, dtype), k = torch::randn({2, 3, S, 5}, dtype),
               v = torch::randn({2, 3, S, 4}, dtype);
          k.narrow(2, S - 1, 1).copy_(k.narrow(2, 1, 1));  // ties with key 1
          Mask mask = Mask().with_causal(causal);
          if (lengths) mask = mask.with_key_lengths(torch::tensor({S, int64_t{0}}, torch::kLong));
          std::pair<Tensor, Tensor> r[2];
          for (int engine = 0; engine < 2; ++engine) {
            DenseEngineRouteScope scope(engine ? ops::DenseEngineRoute::Always
                                               : ops::DenseEngineRoute::Never);
            torch::NoGradGuard no_grad;
            auto attn = std::dynamic_pointer_cast<HardRetrievalAttention>(
                make_attention("hard-retrieval", {}, {3, 5, 4}));
            attn->eval();
            r[engine] = attn->forward_with_indices(q, k, v, mask);
          }
          const std::string what = std::string(c10::toString(dtype)) + (causal ? " causal" : "") +
                                   (lengths ? " lengths" : "") + " L" + std::to_string(L) + " S" +
                                   std::to_string(S);
          EXPECT_TRUE(torch::equal(r[1].second, r[0].second)) << what;
          EXPECT_TRUE(torch::equal(r[1].first, r[0].first)) << what;
          EXPECT_TRUE(r[1].second.eq(-1).any().item<bool>() == (lengths || (causal && L > S)))
              << what;
        }
}

TEST(DenseAttention, AutoRouteKeepsTheCpuKernels) {
  // Auto takes the engine only where it runs PyTorch's fused kernels.
  DenseEngineRouteScope scope(ops::DenseEngineRoute::Auto);
  DenseAttentionSpec spec;
  auto x = torch::randn({1, 1, 4, 8});
  EXPECT_FALSE(ops::types_use_dense_engine(x, x, spec));
  EXPECT_FALSE(ops::types_use_dense_engine(x.to(torch::kBFloat16), x, spec));
}

TEST(DenseAttention, BadSpecsNameTheArgument) {
  auto q = torch::randn({1, 1, 3, 2}), k = torch::randn({1, 1, 3, 2}),
       v = torch::randn({1, 1, 3, 2});
  DenseAttentionSpec spec;
  spec.window_left = -2;
  EXPECT_ERROR_CONTAINS(ops::dense_attention_forward(q, k, v, spec), "window_left");
  spec = {};
  spec.cu_seqlens_q = torch::tensor({0, 3}, torch::kLong);
  EXPECT_ERROR_CONTAINS(ops::dense_attention_forward(q[0][0], k[0][0], v[0][0], spec),
                        "cu_seqlens_k");
  spec.cu_seqlens_k = torch::tensor({0, 2}, torch::kLong);
  auto qp = torch::randn({3, 1, 2}), kp = torch::randn({3, 1, 2}), vp = torch::randn({3, 1, 2});
  EXPECT_ERROR_CONTAINS(ops::dense_attention_forward(qp, kp, vp, spec),
                        "cu_seqlens_k must start at 0 and end at the number of rows (3)");
  spec.cu_seqlens_k = torch::tensor({0, 3}, torch::kLong);
  spec.key_lengths = torch::tensor({3}, torch::kLong);
  EXPECT_ERROR_CONTAINS(ops::dense_attention_forward(qp, kp, vp, spec), "key_lengths");
}

}  // namespace
}  // namespace fastattn
