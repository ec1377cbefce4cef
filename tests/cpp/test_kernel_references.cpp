// The CPU kernels at every instruction-set level this CPU supports against
// their plain references (scalar float64 loops over the same argument
// struct, src/kernels/<kernel>/<kernel>_reference.h; the CUDA emulator tests
// use the same references): token gather exactly in float64 and float32 (a
// copy; sums in the reference's order), hashing bit for bit wherever a
// projection is not within rounding of 0, the Hamming K-means' assignments
// and counts exactly (the same seeded draws), clustered top-k (both forms,
// with and without dropout) and the cluster means, hard retrieval's picks exactly
// where the top two scores are apart, the sums of the causal product, the elu
// feature map and linear attention, hard retrieval's softmax parts and AFT's
// scan within rounding (float64: 1e-11, float32: 2e-5 of the largest value);
// contiguous and strided rows, key lengths, causal and not, one and three
// threads.
//   build/fastattn_tests --gtest_filter='KernelReference.*'
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/aft/aft_reference.h"
#include "kernels/block_sparse/block_sparse_attention_reference.h"
#include "kernels/causal_product/causal_product_reference.h"
#include "kernels/clustered_topk/clustered_topk_reference.h"
#include "kernels/clustering/clustering_reference.h"
#include "kernels/common/cpu_isa.h"
#include "kernels/feature_maps/elu_feature_map_reference.h"
#include "kernels/full/full_attention_reference.h"
#include "kernels/hard_retrieval/hard_retrieval_reference.h"
#include "kernels/hashing/hashing.h"
#include "kernels/hashing/hashing_reference.h"
#include "kernels/linear_attention/elu_linear_attention_reference.h"
#include "kernels/reformer/reformer_reference.h"
#include "kernels/token_gather/token_gather.h"
#include "kernels/token_gather/token_gather_reference.h"

namespace fastattn {
namespace {

using kernels::CpuIsa;

struct LevelGuard {
  CpuIsa saved = kernels::cpu_isa();
  ~LevelGuard() { kernels::set_cpu_isa(saved); }
};

std::vector<double> normal(size_t n, std::mt19937& rng) {
  std::normal_distribution<double> d;
  std::vector<double> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// Values that float32 holds exactly, so both dtypes see the same inputs.
std::vector<double> float_valued(std::vector<double> v) {
  for (auto& x : v) x = static_cast<float>(x);
  return v;
}

template <typename T>
std::vector<T> as(const std::vector<double>& v) {
  return std::vector<T>(v.begin(), v.end());
}

template <typename T>
kernels::TokenGatherArgs<T> gather_args(int64_t N, int64_t H, int64_t L, int64_t Tn, int64_t E,
                                        const int64_t* index) {
  kernels::TokenGatherArgs<T> a;
  a.index = index;
  a.N = N, a.H = H, a.L = L, a.T_ = Tn, a.E = E;
  return a;
}

TEST(KernelReference, TokenGather) {
  LevelGuard guard;
  std::mt19937 rng(7);
  const int64_t shapes[][5] = {{2, 3, 17, 40, 24}, {1, 2, 33, 9, 64}, {3, 1, 5, 12, 1}};
  for (const auto& s : shapes) {
    const int64_t N = s[0], H = s[1], L = s[2], Tn = s[3], E = s[4];
    SCOPED_TRACE("N " + std::to_string(N) + " H " + std::to_string(H) + " L " + std::to_string(L) +
                 " T " + std::to_string(Tn) + " E " + std::to_string(E));
    const auto x = float_valued(normal(N * H * L * E, rng));
    const auto g = float_valued(normal(N * H * Tn * E, rng));
    std::vector<int64_t> index(N * Tn);
    for (auto& i : index) i = static_cast<int64_t>(rng() % (L + 1)) - 1;  // -1 and repeats
    std::vector<double> want(N * H * Tn * E), gwant(N * H * L * E);
    auto r = gather_args<double>(N, H, L, Tn, E, index.data());
    r.x = x.data();
    r.out = want.data();
    kernels::token_gather_forward_reference(r);
    r.grad_out = g.data();
    r.out = gwant.data();
    kernels::token_gather_backward_reference(r);
    for (CpuIsa isa : kernels::supported_cpu_isas()) {
      kernels::set_cpu_isa(isa);
      for (int threads : {1, 3}) {
        SCOPED_TRACE(std::string(kernels::cpu_isa_name(isa)) + ", threads " +
                     std::to_string(threads));
        std::vector<double> out(want.size(), 7.0), gout(gwant.size(), 7.0);
        auto a = gather_args<double>(N, H, L, Tn, E, index.data());
        a.num_threads = threads;
        a.x = x.data();
        a.out = out.data();
        kernels::token_gather_forward_cpu(a);
        EXPECT_EQ(out, want) << "forward, float64";
        a.grad_out = g.data();
        a.out = gout.data();
        kernels::token_gather_backward_cpu(a);
        EXPECT_EQ(gout, gwant) << "backward, float64";
        const auto xf = as<float>(x), gf = as<float>(g);
        std::vector<float> outf(want.size(), 7.f), goutf(gwant.size(), 7.f);
        auto af = gather_args<float>(N, H, L, Tn, E, index.data());
        af.num_threads = threads;
        af.x = xf.data();
        af.out = outf.data();
        kernels::token_gather_forward_cpu(af);
        EXPECT_EQ(std::vector<double>(outf.begin(), outf.end()), want) << "forward, float32";
        af.grad_out = gf.data();
        af.out = goutf.data();
        kernels::token_gather_backward_cpu(af);
        for (size_t i = 0; i < gwant.size(); ++i)
          ASSERT_NEAR(goutf[i], gwant[i], 1e-6 * (1 + std::abs(gwant[i]))) << "backward " << i;
      }
    }
  }
}

// Codes of the kernel against the reference's, bit by bit, where the
// float64 projection is farther than `margin` from 0.
template <typename T>
void expect_codes(const kernels::HashParams<T>& p, const std::vector<int64_t>& got, double margin) {
  std::vector<int64_t> want(p.rows);
  auto r = p;
  r.codes = want.data();
  kernels::hash_queries_reference(r);
  int64_t checked = 0;
  for (int64_t row = 0; row < p.rows; ++row) {
    const auto diff = static_cast<uint64_t>(got[row] ^ want[row]);
    for (int b = 0; b < 64; ++b) {
      if (b >= p.B) {
        ASSERT_EQ((static_cast<uint64_t>(got[row]) >> b) & 1u, 0u) << "row " << row << " bit " << b;
        continue;
      }
      if (std::abs(kernels::hash_projection_reference(p, row, b)) <= margin) continue;
      ASSERT_EQ((diff >> b) & 1u, 0u) << "row " << row << " bit " << b;
      ++checked;
    }
  }
  EXPECT_GT(checked, p.rows * p.B / 2);
}

template <typename T>
void check_hash(int64_t N, int64_t H, int64_t L, int64_t E, int B, bool strided, int threads,
                std::mt19937& rng) {
  SCOPED_TRACE(std::string(sizeof(T) == 8 ? "float64" : "float32") + " N " + std::to_string(N) +
               " H " + std::to_string(H) + " L " + std::to_string(L) + " E " + std::to_string(E) +
               " B " + std::to_string(B) + (strided ? " strided" : "") + " threads " +
               std::to_string(threads));
  // Strided: the layers' (N, L, H, E) projections read as (N, H, L, E).
  const auto x = as<T>(normal(N * H * L * E, rng));
  const auto planes = as<T>(normal(B * (E + 1), rng));
  kernels::HashParams<T> p;
  p.x = x.data();
  p.planes = planes.data();
  p.rows = N * H * L;
  p.E = E;
  p.B = B;
  p.num_threads = threads;
  if (strided) {
    p.x_rows = kernels::RowStrides{L * H * E, E, H * E};
    p.H = H;
    p.L = L;
  }
  std::vector<int64_t> got(p.rows, -7);
  p.codes = got.data();
  kernels::hash_queries_cpu(p);
  expect_codes(p, got, sizeof(T) == 8 ? 1e-9 : 1e-4 * std::sqrt(static_cast<double>(E + 1)));
}

TEST(KernelReference, HashQueries) {
  LevelGuard guard;
  std::mt19937 rng(11);
  for (CpuIsa isa : kernels::supported_cpu_isas()) {
    kernels::set_cpu_isa(isa);
    SCOPED_TRACE(kernels::cpu_isa_name(isa));
    for (bool strided : {false, true})
      for (int threads : {1, 3}) {
        check_hash<double>(2, 3, 17, 16, 17, strided, threads, rng);
        check_hash<float>(2, 3, 17, 16, 17, strided, threads, rng);
        check_hash<float>(1, 4, 33, 40, 64, strided, threads, rng);
        check_hash<double>(1, 1, 9, 1, 1, strided, threads, rng);
      }
  }
}

// |got - want| <= tol·max(1, max |want|) everywhere; tol by got's type, or
// given (float64 buffers of a float32 kernel).
template <typename T>
void expect_near_all(const std::vector<T>& got, const std::vector<double>& want, const char* what,
                     double tol = sizeof(T) == 8 ? 1e-11 : 2e-5) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 1;
  for (double w : want) scale = std::max(scale, std::abs(w));
  for (size_t i = 0; i < want.size(); ++i)
    ASSERT_LE(std::abs(static_cast<double>(got[i]) - want[i]), tol * scale)
        << what << " [" << i << "]: got " << got[i] << ", the reference " << want[i];
}

// fn(threads) at every instruction-set level, with 1 and 3 threads.
void at_every_level(const std::function<void(int)>& fn) {
  LevelGuard guard;
  for (CpuIsa isa : kernels::supported_cpu_isas()) {
    kernels::set_cpu_isa(isa);
    for (int threads : {1, 3}) {
      SCOPED_TRACE(std::string(kernels::cpu_isa_name(isa)) + ", threads " +
                   std::to_string(threads));
      fn(threads);
    }
  }
}

std::string dtype_name(size_t size) { return size == 8 ? "float64" : "float32"; }

// ---- causal product -----------------------------------------------------------

template <typename T>
void check_causal_product(int64_t N, int64_t H, int64_t L, int64_t F, int64_t M, int64_t chunk,
                          int threads, std::mt19937& rng) {
  SCOPED_TRACE(dtype_name(sizeof(T)) + " L " + std::to_string(L) + " F " + std::to_string(F) +
               " M " + std::to_string(M) + " chunk " + std::to_string(chunk));
  const auto q = float_valued(normal(N * H * L * F, rng)), k = float_valued(normal(q.size(), rng));
  const auto v = float_valued(normal(N * H * L * M, rng)), g = float_valued(normal(v.size(), rng));
  std::vector<double> out(v.size()), gq(q.size()), gk(q.size()), gv(v.size());
  kernels::CausalProductBackwardArgs<double> r;
  r.q = q.data(), r.k = k.data(), r.v = v.data(), r.grad_out = g.data();
  r.N = N, r.H = H, r.L = L, r.F = F, r.M = M;
  r.grad_q = gq.data(), r.grad_k = gk.data(), r.grad_v = gv.data();
  kernels::CausalProductForwardArgs<double> rf;
  static_cast<kernels::CausalProductParams<double>&>(rf) = r;
  rf.out = out.data();
  kernels::causal_product_forward_reference(rf);
  kernels::causal_product_backward_reference(r);

  const auto qt = as<T>(q), kt = as<T>(k), vt = as<T>(v), gt = as<T>(g);
  std::vector<T> o(v.size(), T(7)), oq(q.size(), T(7)), ok(q.size(), T(7)), ov(v.size(), T(7));
  kernels::CausalProductBackwardArgs<T> a;
  a.q = qt.data(), a.k = kt.data(), a.v = vt.data(), a.grad_out = gt.data();
  a.N = N, a.H = H, a.L = L, a.F = F, a.M = M, a.chunk = chunk, a.num_threads = threads;
  a.grad_q = oq.data(), a.grad_k = ok.data(), a.grad_v = ov.data();
  kernels::CausalProductForwardArgs<T> af;
  static_cast<kernels::CausalProductParams<T>&>(af) = a;
  af.out = o.data();
  kernels::causal_product_forward_cpu(af);
  kernels::causal_product_backward_cpu(a);
  expect_near_all(o, out, "out");
  expect_near_all(oq, gq, "grad_q");
  expect_near_all(ok, gk, "grad_k");
  expect_near_all(ov, gv, "grad_v");
}

TEST(KernelReference, CausalProduct) {
  std::mt19937 rng(13);
  at_every_level([&](int threads) {
    for (int64_t chunk : {1, 7, 64}) {
      check_causal_product<double>(2, 2, 37, 16, 24, chunk, threads, rng);
      check_causal_product<float>(2, 2, 37, 16, 24, chunk, threads, rng);
    }
    check_causal_product<float>(1, 1, 130, 33, 65, 64, threads, rng);
    check_causal_product<double>(1, 3, 1, 1, 1, 64, threads, rng);
  });
}

// ---- elu feature map -------------------------------------------------------------

TEST(KernelReference, EluFeatureMap) {
  std::mt19937 rng(17);
  auto x = float_valued(normal(1000, rng));
  for (auto& e : x) e *= 8;  // far into both branches
  x.push_back(0.0);
  x.push_back(-0.0);
  x.push_back(-100.0);  // exp underflows in float32
  const auto g = float_valued(normal(x.size(), rng));
  const int64_t n = static_cast<int64_t>(x.size());
  std::vector<double> want(n), gwant(n);
  kernels::EluFeatureMapArgs<double> r;
  r.x = x.data(), r.grad_out = g.data(), r.n = n, r.out = want.data();
  kernels::elu_feature_map_forward_reference(r);
  r.out = gwant.data();
  kernels::elu_feature_map_backward_reference(r);
  at_every_level([&](int threads) {
    auto run = [&](auto zero) {
      using T = decltype(zero);
      const auto xt = as<T>(x), gt = as<T>(g);
      std::vector<T> out(n, T(7)), gout(n, T(7));
      kernels::EluFeatureMapArgs<T> a;
      a.x = xt.data(), a.grad_out = gt.data(), a.n = n, a.num_threads = threads;
      a.out = out.data();
      kernels::elu_feature_map_forward_cpu(a);
      a.out = gout.data();
      kernels::elu_feature_map_backward_cpu(a);
      SCOPED_TRACE(dtype_name(sizeof(T)));
      expect_near_all(out, want, "phi");
      expect_near_all(gout, gwant, "grad");
    };
    run(0.0);
    run(0.0f);
  });
}

// ---- elu linear attention --------------------------------------------------------

template <typename T>
void check_elu_linear(int64_t N, int64_t H, int64_t L, int64_t S, int64_t E, int64_t M, bool causal,
                      bool lengths, bool strided, bool keep_state, int threads, std::mt19937& rng) {
  SCOPED_TRACE(dtype_name(sizeof(T)) + " L " + std::to_string(L) + " S " + std::to_string(S) +
               " E " + std::to_string(E) + " M " + std::to_string(M) + (causal ? " causal" : "") +
               (lengths ? " key lengths" : "") + (strided ? " strided" : "") +
               (keep_state ? " state" : ""));
  const auto q = float_valued(normal(N * H * L * E, rng)),
             k = float_valued(normal(N * H * S * E, rng));
  const auto v = float_valued(normal(N * H * S * M, rng)),
             g = float_valued(normal(N * H * L * M, rng));
  std::vector<int64_t> len(N);
  for (auto& l : len) l = static_cast<int64_t>(rng() % (S + 1));
  // Strided: the layers' (N, R, H, C) tensors read as (N, H, R, C).
  auto rows = [&](int64_t R, int64_t C) {
    return strided ? kernels::RowStrides{R * H * C, C, H * C} : kernels::RowStrides{};
  };
  auto fill = [&](auto& p, const auto& qq, const auto& kk, const auto& vv) {
    p.q = qq.data(), p.k = kk.data(), p.v = vv.data();
    p.q_rows = rows(L, E), p.k_rows = rows(S, E), p.v_rows = rows(S, M);
    p.key_lengths = lengths ? len.data() : nullptr;
    p.N = N, p.H = H, p.L = L, p.S = S, p.E = E, p.M = M, p.causal = causal;
  };
  std::vector<double> out(N * H * L * M), den(N * H * L), state(N * H * E * (M + 1)), sums(N * H),
      gq(q.size()), gk(k.size()), gv(v.size());
  kernels::EluLinearForwardArgs<double> rf;
  fill(rf, q, k, v);
  rf.out = out.data(), rf.den = den.data(), rf.out_rows = rows(L, M);
  rf.state = causal ? nullptr : state.data();
  rf.out_sums = sums.data();
  kernels::elu_linear_attention_forward_reference(rf);
  kernels::EluLinearBackwardArgs<double> rb;
  fill(rb, q, k, v);
  rb.grad_out = g.data(), rb.grad_out_rows = rows(L, M);
  rb.grad_q = gq.data(), rb.grad_k = gk.data(), rb.grad_v = gv.data();
  rb.grad_q_rows = rows(L, E), rb.grad_k_rows = rows(S, E), rb.grad_v_rows = rows(S, M);
  kernels::elu_linear_attention_backward_reference(rb);

  using Acc = kernels::KernelScalar<T>;
  const auto qt = as<T>(q), kt = as<T>(k), vt = as<T>(v), gt = as<T>(g);
  std::vector<T> o(out.size(), T(7)), oq(q.size(), T(7)), ok(k.size(), T(7)), ov(v.size(), T(7));
  std::vector<Acc> d(den.size(), Acc(7)), st(state.size(), Acc(7)), su(sums.size(), Acc(0));
  kernels::EluLinearForwardArgs<T> af;
  fill(af, qt, kt, vt);
  af.num_threads = threads;
  af.out = o.data(), af.den = d.data(), af.out_rows = rows(L, M);
  af.state = keep_state ? st.data() : nullptr;
  af.out_sums = su.data();
  kernels::elu_linear_attention_forward_cpu(af);
  expect_near_all(o, out, "out");
  expect_near_all(d, den, "den");
  expect_near_all(su, sums, "out_sums");
  if (keep_state) expect_near_all(st, state, "state");
  kernels::EluLinearBackwardArgs<T> ab;
  fill(ab, qt, kt, vt);
  ab.num_threads = threads;
  ab.grad_out = gt.data(), ab.grad_out_rows = rows(L, M);
  ab.out = o.data(), ab.out_rows = rows(L, M), ab.den = d.data();
  ab.state = keep_state ? st.data() : nullptr;
  ab.grad_q = oq.data(), ab.grad_k = ok.data(), ab.grad_v = ov.data();
  ab.grad_q_rows = rows(L, E), ab.grad_k_rows = rows(S, E), ab.grad_v_rows = rows(S, M);
  kernels::elu_linear_attention_backward_cpu(ab);
  expect_near_all(oq, gq, "grad_q");
  expect_near_all(ok, gk, "grad_k");
  expect_near_all(ov, gv, "grad_v");
}

TEST(KernelReference, EluLinearAttention) {
  std::mt19937 rng(19);
  at_every_level([&](int threads) {
    for (bool strided : {false, true})
      for (bool lengths : {false, true}) {
        check_elu_linear<double>(2, 2, 37, 37, 16, 24, true, lengths, strided, false, threads, rng);
        check_elu_linear<float>(2, 2, 70, 70, 8, 5, true, lengths, strided, false, threads, rng);
        for (bool keep_state : {false, true}) {
          check_elu_linear<double>(2, 3, 21, 45, 16, 24, false, lengths, strided, keep_state,
                                   threads, rng);
          check_elu_linear<float>(1, 2, 9, 70, 33, 17, false, lengths, strided, keep_state, threads,
                                  rng);
        }
      }
  });
}

// ---- hard retrieval ---------------------------------------------------------------

template <typename T>
void check_hard_retrieval(int64_t N, int64_t H, int64_t L, int64_t S, int64_t E, int64_t M,
                          bool causal, bool lengths, bool masked, bool strided, int threads,
                          std::mt19937& rng) {
  SCOPED_TRACE(dtype_name(sizeof(T)) + " L " + std::to_string(L) + " S " + std::to_string(S) +
               " E " + std::to_string(E) + " M " + std::to_string(M) + (causal ? " causal" : "") +
               (lengths ? " key lengths" : "") + (masked ? " keep mask" : "") +
               (strided ? " strided" : ""));
  const auto q = float_valued(normal(N * H * L * E, rng)),
             k = float_valued(normal(N * H * S * E, rng));
  const auto v = float_valued(normal(N * H * S * M, rng)),
             g = float_valued(normal(N * H * L * M, rng));
  std::vector<int64_t> len(N);
  for (auto& l : len) l = static_cast<int64_t>(rng() % (S + 1));
  std::unique_ptr<bool[]> keep(new bool[N * L * S]);  // (N, 1, L, S): shared by the heads
  for (int64_t i = 0; i < N * L * S; ++i) keep[i] = rng() % 4 != 0;
  auto rows = [&](int64_t R, int64_t C) {
    return strided ? kernels::RowStrides{R * H * C, C, H * C} : kernels::RowStrides{};
  };
  auto fill = [&](auto& p, const auto& qq, const auto& kk, const auto& vv) {
    p.q = qq.data(), p.k = kk.data(), p.v = vv.data();
    p.q_rows = rows(L, E), p.k_rows = rows(S, E), p.v_rows = rows(S, M);
    p.key_lengths = lengths ? len.data() : nullptr;
    p.N = N, p.H = H, p.L = L, p.S = S, p.E = E, p.M = M, p.causal = causal, p.scale = 0.3;
    if (masked) p.keep = keep.get(), p.keep_sn = L * S, p.keep_sh = 0, p.keep_sl = S;
  };
  std::vector<double> out(N * H * L * M), lse(N * H * L), soft(out.size()), delta(lse.size());
  std::vector<int64_t> index(lse.size());
  kernels::HardRetrievalForwardArgs<double> rf;
  fill(rf, q, k, v);
  rf.out = out.data(), rf.out_rows = rows(L, M), rf.index = index.data();
  rf.lse = lse.data(), rf.soft_out = soft.data();
  kernels::hard_retrieval_forward_reference(rf);
  kernels::HardRetrievalDeltaArgs<double> rd;
  fill(rd, q, k, v);
  rd.lse = lse.data(), rd.grad_out = g.data(), rd.grad_out_rows = rows(L, M);
  rd.delta = delta.data();
  kernels::hard_retrieval_delta_reference(rd);

  const auto qt = as<T>(q), kt = as<T>(k), vt = as<T>(v), gt = as<T>(g);
  std::vector<T> o(out.size(), T(7)), so(soft.size(), T(7)), dl(delta.size(), T(7));
  std::vector<T> ls(lse.size(), T(7));
  std::vector<int64_t> idx(index.size(), -7);
  kernels::HardRetrievalForwardArgs<T> af;
  fill(af, qt, kt, vt);
  af.num_threads = threads;
  af.out = o.data(), af.out_rows = rows(L, M), af.index = idx.data();
  af.lse = ls.data(), af.soft_out = so.data();
  kernels::hard_retrieval_forward_cpu(af);
  // The pick: exact where the reference's two best scores are apart by more
  // than rounding; the retrieved row is then v's row, exactly.
  int64_t checked = 0;
  auto ref = rf;
  kernels::resolve_qkv_rows(ref);
  for (int64_t nh = 0; nh < N * H; ++nh)
    for (int64_t i = 0; i < L; ++i) {
      const auto s = kernels::hard_retrieval_detail::scores(ref, nh, i);
      double second = -INFINITY;
      for (int64_t j = 0; j < S; ++j)
        if (j != index[nh * L + i]) second = std::max(second, s[j]);
      const int64_t x = nh * L + i;
      if (index[x] >= 0 && s[index[x]] - second <= (sizeof(T) == 8 ? 1e-9 : 1e-3)) continue;
      ASSERT_EQ(idx[x], index[x]) << "index of query " << i << " of head " << nh;
      ++checked;
      const auto out_row = rows(L, M).resolved(H, L, M);
      for (int64_t m = 0; m < M; ++m)
        ASSERT_EQ(static_cast<double>(out_row.row(o.data(), nh, H, i)[m]),
                  out_row.row(out.data(), nh, H, i)[m])
            << "out of query " << i << " of head " << nh;
    }
  EXPECT_GT(checked, N * H * L / 2);
  for (size_t i = 0; i < lse.size(); ++i) {
    if (std::isinf(lse[i])) {
      ASSERT_TRUE(std::isinf(ls[i]) && ls[i] < 0) << "lse " << i << ": " << ls[i];
      ls[i] = 0, lse[i] = 0;  // compared below with the finite ones
    }
  }
  expect_near_all(ls, lse, "lse");
  expect_near_all(so, soft, "soft_out");
  // delta from each side's own lse.
  for (size_t i = 0; i < lse.size(); ++i)
    if (idx[i] < 0) ls[i] = -INFINITY;
  kernels::HardRetrievalDeltaArgs<T> ad;
  fill(ad, qt, kt, vt);
  ad.num_threads = threads;
  ad.lse = ls.data(), ad.grad_out = gt.data(), ad.grad_out_rows = rows(L, M);
  ad.delta = dl.data();
  kernels::hard_retrieval_delta_cpu(ad);
  expect_near_all(dl, delta, "delta");

  // grad_v from the reference's picks.
  std::vector<double> gv(v.size());
  kernels::HardRetrievalGradVArgs<double> rv;
  rv.grad_out = g.data(), rv.index = index.data(), rv.grad_v = gv.data();
  rv.NH = N * H, rv.L = L, rv.S = S, rv.M = M, rv.H = H;
  rv.grad_out_rows = rows(L, M), rv.grad_v_rows = rows(S, M);
  kernels::hard_retrieval_grad_v_reference(rv);
  std::vector<T> ogv(v.size(), T(7));
  kernels::HardRetrievalGradVArgs<T> av;
  av.grad_out = gt.data(), av.index = index.data(), av.grad_v = ogv.data();
  av.NH = N * H, av.L = L, av.S = S, av.M = M, av.H = H, av.num_threads = threads;
  av.grad_out_rows = rows(L, M), av.grad_v_rows = rows(S, M);
  kernels::hard_retrieval_grad_v_cpu(av);
  expect_near_all(ogv, gv, "grad_v");
}

TEST(KernelReference, HardRetrieval) {
  std::mt19937 rng(23);
  at_every_level([&](int threads) {
    for (bool strided : {false, true})
      for (bool masked : {false, true}) {
        check_hard_retrieval<double>(2, 2, 37, 45, 16, 24, false, true, masked, strided, threads,
                                     rng);
        check_hard_retrieval<float>(2, 2, 37, 45, 16, 24, true, false, masked, strided, threads,
                                    rng);
        check_hard_retrieval<float>(1, 3, 70, 9, 33, 5, true, true, masked, strided, threads, rng);
        check_hard_retrieval<double>(1, 1, 9, 130, 8, 70, false, false, masked, strided, threads,
                                     rng);
      }
  });
}

// ---- Hamming K-means --------------------------------------------------------------

// Random codes, codes near a few prototypes, or only three distinct codes
// (ties in the seeding, re-seeded empty clusters).
void check_clustering(int64_t N, int64_t H, int64_t L, int64_t C, int64_t iterations,
                      std::vector<int64_t> lengths, int kind, int threads, uint64_t seed) {
  SCOPED_TRACE("N " + std::to_string(N) + " H " + std::to_string(H) + " L " + std::to_string(L) +
               " C " + std::to_string(C) + " iterations " + std::to_string(iterations) + " kind " +
               std::to_string(kind) + " seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::vector<uint64_t> protos(6);
  for (auto& p : protos) p = rng();
  std::vector<int64_t> codes(N * H * L);
  for (auto& c : codes) {
    uint64_t x = rng();
    if (kind == 1) {
      x = protos[rng() % protos.size()];
      for (int f = 0; f < 4; ++f) x ^= 1ull << (rng() % 64);
    } else if (kind == 2) {
      x = protos[rng() % 3];
    }
    c = static_cast<int64_t>(x);
  }
  kernels::ClusterParams p;
  p.codes = codes.data();
  p.lengths = lengths.empty() ? nullptr : lengths.data();
  p.N = N, p.H = H, p.L = L, p.C = C, p.iterations = iterations, p.seed = seed;
  std::vector<int64_t> a(N * H * L, 99), counts(N * H * C, 99), ra(a.size()), rc(counts.size());
  p.assignments = ra.data(), p.counts = rc.data();
  kernels::cluster_codes_reference(p);
  p.assignments = a.data(), p.counts = counts.data(), p.num_threads = threads;
  kernels::cluster_codes_cpu(p);
  EXPECT_EQ(a, ra) << "assignments";
  EXPECT_EQ(counts, rc) << "counts";
}

TEST(KernelReference, ClusterCodes) {
  at_every_level([&](int threads) {
    check_clustering(1, 2, 37, 5, 3, {}, 0, threads, 1);
    check_clustering(2, 1, 70, 8, 20, {}, 1, threads, 2);
    check_clustering(1, 1, 33, 1, 3, {}, 1, threads, 3);
    check_clustering(1, 1, 17, 4, 0, {}, 0, threads, 4);
    check_clustering(4, 2, 40, 6, 5, {0, 1, 4, 40}, 1, threads, 6);
    check_clustering(2, 1, 50, 7, 5, {50, 23}, 2, threads, 7);
    check_clustering(1, 1, 9, 9, 4, {}, 2, threads, 8);
    check_clustering(1, 1, 200, 100, 6, {}, 1, threads, 9);
    // From 1024 valid queries the kernel assigns by byte tables, and from the
    // second assignment rescans only where centroids moved.
    check_clustering(2, 1, 1500, 12, 6, {1500, 1100}, 1, threads, 10);
  });
}

// ---- clustered top-k ----------------------------------------------------------------

// Plain form (given masses) or improved (centroids, lse, out_c), with or
// without dropout; padded queries, empty clusters, empty and out-of-length
// top-k slots.
template <typename T>
void check_clustered_topk(int64_t N, int64_t H, int64_t L, int64_t S, int64_t E, int64_t M,
                          int64_t C, int64_t K, bool improved, double dropout, bool strided,
                          int threads, std::mt19937& rng) {
  SCOPED_TRACE(dtype_name(sizeof(T)) + " L " + std::to_string(L) + " S " + std::to_string(S) +
               " C " + std::to_string(C) + " K " + std::to_string(K) +
               (improved ? " improved" : " plain") + " dropout " + std::to_string(dropout) +
               (strided ? " strided" : ""));
  using Acc = kernels::KernelScalar<T>;
  const auto q = float_valued(normal(N * H * L * E, rng)),
             k = float_valued(normal(N * H * S * E, rng));
  const auto v = float_valued(normal(N * H * S * M, rng)),
             g = float_valued(normal(N * H * L * M, rng));
  const auto cen = float_valued(normal(N * H * C * E, rng)),
             oc = float_valued(normal(N * H * C * M, rng));
  std::vector<int64_t> len(N), assign(N * H * L), topk(N * H * C * K);
  for (auto& l : len) l = static_cast<int64_t>(S / 2 + rng() % (S - S / 2 + 1));
  for (auto& x : assign) x = static_cast<int64_t>(rng() % (C + 1)) - 1;  // -1: padded
  std::vector<int64_t> keys(S);
  for (int64_t c = 0; c < N * H * C; ++c) {  // K distinct keys, some slots empty
    for (int64_t j = 0; j < S; ++j) keys[j] = j;
    std::shuffle(keys.begin(), keys.end(), rng);
    for (int64_t t = 0; t < K; ++t) topk[c * K + t] = rng() % 5 == 0 ? -1 : keys[t];
  }
  std::vector<double> mass(N * H * C), lse(N * H * C);
  for (auto& m : mass) m = static_cast<float>(0.2 + (rng() % 1000) / 1000.0);
  const double scale = 0.4;
  for (int64_t nh = 0; nh < N * H; ++nh)  // lse over every key: the clamp at 0 never acts
    for (int64_t c = 0; c < C; ++c) {
      double mx = -INFINITY, sum = 0;
      std::vector<double> s(S);
      for (int64_t j = 0; j < S; ++j) {
        s[j] = 0;
        for (int64_t e = 0; e < E; ++e)
          s[j] += scale * cen[(nh * C + c) * E + e] * k[(nh * S + j) * E + e];
        mx = std::max(mx, s[j]);
      }
      for (double x : s) sum += std::exp(x - mx);
      lse[nh * C + c] = static_cast<float>(mx + std::log(sum) + 0.01);
    }
  auto rows = [&](int64_t R, int64_t Cn) {
    return strided ? kernels::RowStrides{R * H * Cn, Cn, H * Cn} : kernels::RowStrides{};
  };
  // k and v of the kernels' strided case: the reference reads the same layout.
  auto fill = [&](auto& p, const auto& qq, const auto& kk, const auto& vv, const auto& cc,
                  const auto& ll, const auto& mm, const auto& oo) {
    p.q = qq.data(), p.k = kk.data(), p.v = vv.data();
    p.q_rows = rows(L, E), p.k_rows = rows(S, E), p.v_rows = rows(S, M);
    p.key_lengths = len.data();
    p.N = N, p.H = H, p.L = L, p.S = S, p.E = E, p.M = M, p.C = C, p.K = K, p.scale = scale;
    p.topk = topk.data(), p.assignments = assign.data();
    if (improved) {
      p.centroids = cc.data(), p.lse = ll.data(), p.out_c = oo.data();
    } else {
      p.mass = mm.data();
    }
    p.dropout_threshold = kernels::dropout_threshold(dropout);
    p.dropout_seed = 1234567;
    p.dropout_scale = 1 / (1 - dropout);
  };
  std::vector<double> out(N * H * L * M), gq(q.size()), gk(k.size()), gv(v.size()),
      gmass(mass.size()), gcen(cen.size()), glse(lse.size()), goc(oc.size());
  kernels::ClusteredTopkForwardArgs<double> rf;
  fill(rf, q, k, v, cen, lse, mass, oc);
  rf.out = out.data(), rf.out_rows = rows(L, M);
  kernels::clustered_topk_forward_reference(rf);
  kernels::ClusteredTopkBackwardArgs<double> rb;
  fill(rb, q, k, v, cen, lse, mass, oc);
  rb.grad_out = g.data(), rb.grad_out_rows = rows(L, M);
  rb.grad_q = gq.data(), rb.grad_k = gk.data(), rb.grad_v = gv.data();
  rb.grad_q_rows = rows(L, E), rb.grad_k_rows = rows(S, E), rb.grad_v_rows = rows(S, M);
  rb.grad_mass = gmass.data(), rb.grad_centroids = gcen.data(), rb.grad_lse = glse.data();
  rb.grad_out_c = goc.data();
  kernels::clustered_topk_backward_reference(rb);

  const auto qt = as<T>(q), kt = as<T>(k), vt = as<T>(v), gt = as<T>(g), ct = as<T>(cen),
             ot = as<T>(oc);
  const auto lt = as<Acc>(lse), mt = as<Acc>(mass);
  std::vector<T> o(out.size(), T(7));
  std::vector<Acc> oq(q.size(), Acc(7)), ok(k.size(), Acc(7)), ov(v.size(), Acc(7)),
      om(mass.size(), Acc(7)), ocen(cen.size(), Acc(7)), olse(lse.size(), Acc(7)),
      ooc(oc.size(), Acc(7));
  kernels::ClusteredTopkForwardArgs<T> af;
  fill(af, qt, kt, vt, ct, lt, mt, ot);
  af.num_threads = threads;
  af.out = o.data(), af.out_rows = rows(L, M);
  kernels::clustered_topk_forward_cpu(af);
  expect_near_all(o, out, "out");
  kernels::ClusteredTopkBackwardArgs<T> ab;
  fill(ab, qt, kt, vt, ct, lt, mt, ot);
  ab.num_threads = threads;
  ab.grad_out = gt.data(), ab.grad_out_rows = rows(L, M);
  ab.grad_q = oq.data(), ab.grad_k = ok.data(), ab.grad_v = ov.data();
  ab.grad_q_rows = rows(L, E), ab.grad_k_rows = rows(S, E), ab.grad_v_rows = rows(S, M);
  ab.grad_mass = om.data(), ab.grad_centroids = ocen.data(), ab.grad_lse = olse.data();
  ab.grad_out_c = ooc.data();
  kernels::clustered_topk_backward_cpu(ab);
  expect_near_all(oq, gq, "grad_q");
  expect_near_all(ok, gk, "grad_k");
  expect_near_all(ov, gv, "grad_v");
  if (improved) {
    expect_near_all(ocen, gcen, "grad_centroids");
    expect_near_all(olse, glse, "grad_lse");
    expect_near_all(ooc, goc, "grad_out_c");
  } else {
    expect_near_all(om, gmass, "grad_mass");
  }
}

TEST(KernelReference, ClusteredTopk) {
  std::mt19937 rng(31);
  at_every_level([&](int threads) {
    for (bool improved : {false, true})
      for (double dropout : {0.0, 0.3}) {
        check_clustered_topk<double>(2, 2, 40, 37, 16, 24, 5, 9, improved, dropout, false, threads,
                                     rng);
        check_clustered_topk<float>(1, 3, 200, 70, 33, 17, 3, 32, improved, dropout, true, threads,
                                    rng);
        // One member per cluster (the plain form's single-query path).
        check_clustered_topk<double>(1, 1, 4, 20, 8, 8, 6, 5, improved, dropout, true, threads,
                                     rng);
      }
  });
}

// Cluster means (and sums) and their spread back to the members.
TEST(KernelReference, ClusterMeansAndSpread) {
  std::mt19937 rng(37);
  const int64_t N = 2, H = 3, L = 41, C = 6, E = 20;
  const auto q = float_valued(normal(N * H * L * E, rng)), table = normal(N * H * C * E, rng);
  std::vector<int64_t> assign(N * H * L), counts(N * H * C, 0);
  for (int64_t x = 0; x < N * H * L; ++x) {
    assign[x] = x % 7 == 0 ? -1 : static_cast<int64_t>(rng() % (C - 1));  // padded; C-1 empty
    if (assign[x] >= 0) ++counts[x / L * C + assign[x]];
  }
  at_every_level([&](int threads) {
    for (bool strided : {false, true})
      for (bool mean : {false, true}) {
        SCOPED_TRACE(std::string(strided ? "strided" : "contiguous") + (mean ? " means" : " sums"));
        kernels::ClusterMeansArgs<double> a;
        a.q = q.data(), a.assignments = assign.data(), a.counts = counts.data();
        a.NH = N * H, a.L = L, a.C = C, a.E = E, a.H = H, a.mean = mean;
        if (strided) a.q_rows = kernels::RowStrides{L * H * E, E, H * E};
        std::vector<double> want(N * H * C * E), got(want.size(), 7.0);
        a.centroids = want.data();
        kernels::cluster_means_reference(a);
        a.centroids = got.data(), a.num_threads = threads;
        kernels::cluster_means_cpu(a);
        expect_near_all(got, want, "centroids");
      }
    for (bool divide : {false, true})
      for (bool accumulate : {false, true}) {
        SCOPED_TRACE(std::string(divide ? "divide" : "") + (accumulate ? " accumulate" : ""));
        kernels::CentroidSpreadArgs<double> a;
        a.table = table.data(), a.assignments = assign.data(), a.counts = counts.data();
        a.NH = N * H, a.L = L, a.C = C, a.E = E, a.H = H, a.divide = divide;
        a.accumulate = accumulate;
        a.dst_rows = kernels::RowStrides{L * H * E, E, H * E};
        std::vector<double> want = normal(N * H * L * E, rng), got = want;
        a.dst = want.data();
        kernels::spread_centroids_reference(a);
        a.dst = got.data(), a.num_threads = threads;
        kernels::spread_centroids_cpu(a);
        expect_near_all(got, want, "members");
      }
  });
}

// ---- full attention -----------------------------------------------------------------

// Inputs with an additive mask (some -inf, shared by the heads), key lengths,
// causal alignment with L != S, dropout, strided rows; the top-k keys without
// a mask and not causal; the backward from the reference's lse and delta,
// overwriting and accumulating.
template <typename T>
void check_full(int64_t N, int64_t H, int64_t L, int64_t S, int64_t E, int64_t M, bool causal,
                bool masked, double dropout, bool strided, int64_t topk, int threads,
                std::mt19937& rng) {
  SCOPED_TRACE(dtype_name(sizeof(T)) + " L " + std::to_string(L) + " S " + std::to_string(S) +
               " E " + std::to_string(E) + " M " + std::to_string(M) + (causal ? " causal" : "") +
               (masked ? " mask" : "") + " dropout " + std::to_string(dropout) +
               (strided ? " strided" : "") + " topk " + std::to_string(topk));
  using Acc = kernels::KernelScalar<T>;
  const auto q = float_valued(normal(N * H * L * E, rng)),
             k = float_valued(normal(N * H * S * E, rng));
  const auto v = float_valued(normal(N * H * S * M, rng)),
             g = float_valued(normal(N * H * L * M, rng));
  auto mask = float_valued(normal(N * L * S, rng));
  for (auto& x : mask)
    if (rng() % 5 == 0) x = -INFINITY;
  std::vector<int64_t> len(N);
  for (auto& l : len) l = static_cast<int64_t>(rng() % (S + 1));
  auto rows = [&](int64_t R, int64_t C) {
    return strided ? kernels::RowStrides{R * H * C, C, H * C} : kernels::RowStrides{};
  };
  auto fill = [&](auto& p, const auto& qq, const auto& kk, const auto& vv, const auto& mm) {
    p.q = qq.data(), p.k = kk.data(), p.v = vv.data();
    p.q_rows = rows(L, E), p.k_rows = rows(S, E), p.v_rows = rows(S, M);
    p.key_lengths = len.data();
    p.N = N, p.H = H, p.L = L, p.S = S, p.E = E, p.M = M, p.causal = causal, p.scale = 0.3;
    if (masked) p.mask = mm.data(), p.mask_sn = L * S, p.mask_sh = 0, p.mask_sl = S;
    p.dropout_threshold = kernels::dropout_threshold(dropout);
    p.dropout_seed = 987654321;
    p.dropout_scale = 1 / (1 - dropout);
  };
  std::vector<double> out(N * H * L * M), lse(N * H * L), delta(lse.size());
  std::vector<int64_t> top(N * H * L * std::max<int64_t>(topk, 1), -1);
  kernels::FullAttentionForwardArgs<double> rf;
  fill(rf, q, k, v, mask);
  rf.out = out.data(), rf.out_rows = rows(L, M), rf.lse = lse.data();
  rf.topk = topk, rf.top_idx = top.data();
  kernels::full_attention_forward_reference(rf);
  const auto out_rows = rows(L, M).resolved(H, L, M), g_rows = out_rows;
  for (int64_t nh = 0; nh < N * H; ++nh)
    for (int64_t i = 0; i < L; ++i) {
      double d = 0;
      for (int64_t m = 0; m < M; ++m)
        d += g_rows.row(g.data(), nh, H, i)[m] * out_rows.row(out.data(), nh, H, i)[m];
      delta[nh * L + i] = d;
    }
  // Gradients onto these values: overwritten, or added to with accumulate.
  const auto base_q = normal(q.size(), rng), base_k = normal(k.size(), rng),
             base_v = normal(v.size(), rng);
  for (bool accumulate : {false, true}) {
    SCOPED_TRACE(accumulate ? "accumulate" : "overwrite");
    auto gq = base_q, gk = base_k, gv = base_v;
    kernels::FullAttentionBackwardArgs<double> rb;
    fill(rb, q, k, v, mask);
    rb.grad_out = g.data(), rb.grad_out_rows = rows(L, M), rb.lse = lse.data();
    rb.delta = delta.data(), rb.accumulate = accumulate;
    rb.grad_q = gq.data(), rb.grad_k = gk.data(), rb.grad_v = gv.data();
    rb.grad_q_rows = rows(L, E), rb.grad_k_rows = rows(S, E), rb.grad_v_rows = rows(S, M);
    kernels::full_attention_backward_reference(rb);

    const auto qt = as<T>(q), kt = as<T>(k), vt = as<T>(v), gt = as<T>(g), mt = as<T>(mask);
    const auto lt = as<Acc>(lse), dt = as<Acc>(delta);
    auto oq = as<T>(base_q), ok = as<T>(base_k), ov = as<T>(base_v);
    kernels::FullAttentionBackwardArgs<T> ab;
    fill(ab, qt, kt, vt, mt);
    ab.num_threads = threads;
    ab.grad_out = gt.data(), ab.grad_out_rows = rows(L, M), ab.lse = lt.data();
    ab.delta = dt.data(), ab.accumulate = accumulate;
    ab.grad_q = oq.data(), ab.grad_k = ok.data(), ab.grad_v = ov.data();
    ab.grad_q_rows = rows(L, E), ab.grad_k_rows = rows(S, E), ab.grad_v_rows = rows(S, M);
    kernels::full_attention_backward_cpu(ab);
    expect_near_all(oq, gq, "grad_q");
    expect_near_all(ok, gk, "grad_k");
    expect_near_all(ov, gv, "grad_v");
  }

  const auto qt = as<T>(q), kt = as<T>(k), vt = as<T>(v), mt = as<T>(mask);
  std::vector<T> o(out.size(), T(7));
  std::vector<Acc> ls(lse.size(), Acc(7));
  std::vector<int64_t> otop(top.size(), -7);
  kernels::FullAttentionForwardArgs<T> af;
  fill(af, qt, kt, vt, mt);
  af.num_threads = threads;
  af.out = o.data(), af.out_rows = rows(L, M), af.lse = ls.data();
  af.topk = topk, af.top_idx = otop.data();
  kernels::full_attention_forward_cpu(af);
  expect_near_all(o, out, "out");
  for (size_t i = 0; i < lse.size(); ++i) {
    if (!std::isinf(lse[i])) continue;
    ASSERT_TRUE(std::isinf(ls[i]) && ls[i] < 0) << "lse " << i << ": " << ls[i];
    ls[i] = 0, lse[i] = 0;
  }
  expect_near_all(ls, lse, "lse");
  if (topk > 0 && sizeof(T) == 8) EXPECT_EQ(otop, top) << "top_idx";
}

TEST(KernelReference, FullAttention) {
  std::mt19937 rng(41);
  at_every_level([&](int threads) {
    for (bool strided : {false, true})
      for (double dropout : {0.0, 0.25}) {
        check_full<double>(2, 2, 37, 45, 16, 24, true, true, dropout, strided, 0, threads, rng);
        check_full<float>(1, 3, 70, 21, 33, 17, true, false, dropout, strided, 0, threads, rng);
        check_full<double>(2, 1, 9, 200, 8, 40, false, true, dropout, strided, 0, threads, rng);
        check_full<float>(1, 2, 250, 250, 64, 64, false, false, dropout, strided, 0, threads, rng);
      }
    check_full<double>(2, 2, 21, 45, 16, 8, false, false, 0.0, false, 7, threads, rng);
  });
}

// ---- block-sparse attention ------------------------------------------------------------

template <typename T>
void check_block_sparse(int pattern, const std::vector<int64_t>& params, int64_t N, int64_t H,
                        int64_t L, int64_t S, int64_t E, int64_t M, bool causal, double dropout,
                        bool strided, int threads, std::mt19937& rng) {
  std::string ps;
  for (auto x : params) ps += " " + std::to_string(x);
  SCOPED_TRACE(dtype_name(sizeof(T)) + " pattern " + std::to_string(pattern) + ps + " L " +
               std::to_string(L) + " S " + std::to_string(S) + (causal ? " causal" : "") +
               " dropout " + std::to_string(dropout) + (strided ? " strided" : ""));
  const auto parts = kernels::make_sparse_parts(pattern, params, causal, H);
  const auto q = float_valued(normal(N * H * L * E, rng)),
             k = float_valued(normal(N * H * S * E, rng));
  const auto v = float_valued(normal(N * H * S * M, rng)),
             g = float_valued(normal(N * H * L * M, rng));
  std::vector<int64_t> len(N);
  for (auto& l : len) l = static_cast<int64_t>(S / 2 + rng() % (S - S / 2 + 1));
  auto rows = [&](int64_t R, int64_t C) {
    return strided ? kernels::RowStrides{R * H * C, C, H * C} : kernels::RowStrides{};
  };
  auto fill = [&](auto& p, const auto& qq, const auto& kk, const auto& vv) {
    p.q = qq.data(), p.k = kk.data(), p.v = vv.data();
    p.q_rows = rows(L, E), p.k_rows = rows(S, E), p.v_rows = rows(S, M);
    p.key_lengths = len.data();
    p.N = N, p.H = H, p.L = L, p.S = S, p.E = E, p.M = M, p.scale = 0.3;
    p.parts = parts.data(), p.num_parts = static_cast<int>(parts.size());
    p.dropout_threshold = kernels::dropout_threshold(dropout);
    p.dropout_seed = 777;
    p.dropout_scale = 1 / (1 - dropout);
  };
  std::vector<double> out(N * H * L * M), lse(N * H * L), delta(lse.size()), gq(q.size()),
      gk(k.size()), gv(v.size());
  kernels::BlockSparseForwardArgs<double> rf;
  fill(rf, q, k, v);
  rf.out = out.data(), rf.out_rows = rows(L, M), rf.lse = lse.data();
  kernels::block_sparse_attention_forward_reference(rf);
  const auto o_rows = rows(L, M).resolved(H, L, M);
  for (int64_t nh = 0; nh < N * H; ++nh)
    for (int64_t i = 0; i < L; ++i) {
      double d = 0;
      for (int64_t m = 0; m < M; ++m)
        d += o_rows.row(g.data(), nh, H, i)[m] * o_rows.row(out.data(), nh, H, i)[m];
      delta[nh * L + i] = d;
    }
  kernels::BlockSparseBackwardArgs<double> rb;
  fill(rb, q, k, v);
  rb.grad_out = g.data(), rb.grad_out_rows = rows(L, M), rb.lse = lse.data();
  rb.delta = delta.data();
  rb.grad_q = gq.data(), rb.grad_k = gk.data(), rb.grad_v = gv.data();
  rb.grad_q_rows = rows(L, E), rb.grad_k_rows = rows(S, E), rb.grad_v_rows = rows(S, M);
  kernels::block_sparse_attention_backward_reference(rb);

  const auto qt = as<T>(q), kt = as<T>(k), vt = as<T>(v), gt = as<T>(g);
  std::vector<T> o(out.size(), T(7)), ls(lse.size(), T(7)), oq(q.size(), T(7)), ok(k.size(), T(7)),
      ov(v.size(), T(7));
  kernels::BlockSparseForwardArgs<T> af;
  fill(af, qt, kt, vt);
  af.num_threads = threads;
  af.out = o.data(), af.out_rows = rows(L, M), af.lse = ls.data();
  kernels::block_sparse_attention_forward_cpu(af);
  expect_near_all(o, out, "out");
  auto lse_finite = lse;
  for (size_t i = 0; i < lse.size(); ++i) {
    if (!std::isinf(lse[i])) continue;
    ASSERT_TRUE(std::isinf(ls[i]) && ls[i] < 0) << "lse " << i << ": " << ls[i];
    ls[i] = 0, lse_finite[i] = 0;
  }
  expect_near_all(ls, lse_finite, "lse");
  const auto lt = as<T>(lse), dt = as<T>(delta);
  kernels::BlockSparseBackwardArgs<T> ab;
  fill(ab, qt, kt, vt);
  ab.num_threads = threads;
  ab.grad_out = gt.data(), ab.grad_out_rows = rows(L, M), ab.lse = lt.data();
  ab.delta = dt.data();
  ab.grad_q = oq.data(), ab.grad_k = ok.data(), ab.grad_v = ov.data();
  ab.grad_q_rows = rows(L, E), ab.grad_k_rows = rows(S, E), ab.grad_v_rows = rows(S, M);
  kernels::block_sparse_attention_backward_cpu(ab);
  expect_near_all(oq, gq, "grad_q");
  expect_near_all(ok, gk, "grad_k");
  expect_near_all(ov, gv, "grad_v");
}

TEST(KernelReference, BlockSparse) {
  std::mt19937 rng(47);
  struct Pattern {
    int kind;
    std::vector<int64_t> params;
  };
  const std::vector<Pattern> patterns = {
      {kernels::kLocalPattern, {7}},          {kernels::kWindowPattern, {5, 2}},
      {kernels::kStridedPattern, {6, 0}},     {kernels::kStridedPattern, {6, 1}},
      {kernels::kStridedPattern, {5, 2}},     {kernels::kStridedPattern, {6, 3}},
      {kernels::kFixedPattern, {8, 2, 0, 0}}, {kernels::kFixedPattern, {8, 2, 0, 1}},
      {kernels::kFixedPattern, {6, 3, 1, 0}}, {kernels::kFixedPattern, {6, 2, 2, 1}},
      {kernels::kFixedPattern, {9, 3, 3, 0}}};
  at_every_level([&](int threads) {
    for (const auto& p : patterns)
      for (bool causal : {false, true}) {
        check_block_sparse<double>(p.kind, p.params, 2, 4, 37, 45, 16, 24, causal, 0.0, false,
                                   threads, rng);
        check_block_sparse<float>(p.kind, p.params, 1, 3, 70, 70, 33, 17, causal, 0.2, true,
                                  threads, rng);
        check_block_sparse<double>(p.kind, p.params, 1, 2, 50, 20, 8, 8, causal, 0.2, true, threads,
                                   rng);
      }
  });
}

// ---- Reformer -----------------------------------------------------------------------

template <typename T>
void check_lsh_hash(int64_t N, int64_t H, int64_t L, int64_t E, int64_t R, int64_t B2, int threads,
                    std::mt19937& rng) {
  SCOPED_TRACE(dtype_name(sizeof(T)) + " E " + std::to_string(E) + " R " + std::to_string(R) +
               " B2 " + std::to_string(B2));
  const auto x = float_valued(normal(N * H * L * E, rng));
  const auto rot = float_valued(normal(R * E * B2, rng));
  kernels::LshHashArgs<double> r;
  r.x = x.data(), r.rotations = rot.data(), r.N = N, r.H = H, r.L = L, r.E = E, r.R = R;
  r.B2 = B2;
  std::vector<int64_t> want(N * H * R * L), got(want.size(), -7);
  r.buckets = want.data();
  kernels::lsh_hash_reference(r);
  const auto xt = as<T>(x), rt = as<T>(rot);
  kernels::LshHashArgs<T> a;
  a.x = xt.data(), a.rotations = rt.data(), a.N = N, a.H = H, a.L = L, a.E = E, a.R = R;
  a.B2 = B2, a.num_threads = threads, a.buckets = got.data();
  kernels::lsh_hash_cpu(a);
  // Exact where the best of the 2·B2 projections leads the second by more
  // than rounding.
  int64_t checked = 0;
  for (int64_t nh = 0; nh < N * H; ++nh)
    for (int64_t rr = 0; rr < R; ++rr)
      for (int64_t l = 0; l < L; ++l) {
        std::vector<double> p;
        for (int64_t b = 0; b < B2; ++b) {
          double d = 0;
          for (int64_t e = 0; e < E; ++e) d += x[(nh * L + l) * E + e] * rot[(rr * E + e) * B2 + b];
          p.push_back(d);
          p.push_back(-d);
        }
        std::sort(p.begin(), p.end());
        if (p.size() >= 2 && p[p.size() - 1] - p[p.size() - 2] <= (sizeof(T) == 8 ? 1e-9 : 1e-4))
          continue;
        const int64_t x_ = (nh * R + rr) * L + l;
        ASSERT_EQ(got[x_], want[x_]) << "head " << nh << " round " << rr << " position " << l;
        ++checked;
      }
  EXPECT_GT(checked, N * H * R * L / 2);
}

template <typename T>
void check_reformer(int64_t N, int64_t H, int64_t L, int64_t E, int64_t M, int64_t R,
                    int64_t n_buckets, int64_t chunk, bool causal, bool mask_self, double dropout,
                    bool strided, int threads, std::mt19937& rng) {
  SCOPED_TRACE(dtype_name(sizeof(T)) + " L " + std::to_string(L) + " R " + std::to_string(R) +
               " buckets " + std::to_string(n_buckets) + " chunk " + std::to_string(chunk) +
               (causal ? " causal" : "") + (mask_self ? " mask_self" : "") + " dropout " +
               std::to_string(dropout) + (strided ? " strided" : ""));
  using Acc = kernels::KernelScalar<T>;
  const auto q = float_valued(normal(N * H * L * E, rng)),
             v = float_valued(normal(N * H * L * M, rng));
  const auto g = float_valued(normal(N * H * L * M, rng));
  std::vector<int64_t> buckets(N * H * R * L), len(N);
  for (auto& b : buckets) b = static_cast<int64_t>(rng() % n_buckets);
  for (auto& l : len) l = static_cast<int64_t>(rng() % (L + 1));
  auto rows = [&](int64_t C) {
    return strided ? kernels::RowStrides{L * H * C, C, H * C} : kernels::RowStrides{};
  };
  auto fill = [&](auto& p, const auto& qq, const auto& vv) {
    p.q = qq.data(), p.v = vv.data(), p.q_rows = rows(E), p.v_rows = rows(M);
    p.buckets = buckets.data(), p.n_buckets = n_buckets, p.lengths = len.data();
    p.N = N, p.H = H, p.L = L, p.E = E, p.M = M, p.R = R, p.chunk = chunk;
    p.causal = causal, p.mask_self = mask_self, p.scale = 0.7;
    p.dropout_threshold = kernels::dropout_threshold(dropout);
    p.dropout_seed = 4242;
    p.dropout_scale = 1 / (1 - dropout);
  };
  std::vector<double> out(N * H * L * M), stats(N * H * L * 2), delta(N * H * L), gq(q.size()),
      gv(v.size());
  kernels::ReformerForwardArgs<double> rf;
  fill(rf, q, v);
  rf.out = out.data(), rf.out_rows = rows(M), rf.stats = stats.data();
  kernels::reformer_forward_reference(rf);
  const auto o_rows = rows(M).resolved(H, L, M);
  for (int64_t nh = 0; nh < N * H; ++nh)
    for (int64_t i = 0; i < L; ++i) {
      double d = 0;
      for (int64_t m = 0; m < M; ++m)
        d += o_rows.row(g.data(), nh, H, i)[m] * o_rows.row(out.data(), nh, H, i)[m];
      delta[nh * L + i] = d;
    }
  kernels::ReformerBackwardArgs<double> rb;
  fill(rb, q, v);
  rb.grad_out = g.data(), rb.grad_out_rows = rows(M), rb.stats = stats.data();
  rb.delta = delta.data(), rb.grad_q = gq.data(), rb.grad_v = gv.data();
  rb.grad_q_rows = rows(E), rb.grad_v_rows = rows(M);
  kernels::reformer_backward_reference(rb);

  const auto qt = as<T>(q), vt = as<T>(v), gt = as<T>(g);
  const auto dt = as<Acc>(delta);
  std::vector<T> o(out.size(), T(7)), oq(q.size(), T(7)), ov(v.size(), T(7));
  std::vector<double> st(stats.size(), 7.0);
  kernels::ReformerForwardArgs<T> af;
  fill(af, qt, vt);
  af.num_threads = threads;
  af.out = o.data(), af.out_rows = rows(M), af.stats = st.data();
  kernels::reformer_forward_cpu(af);
  expect_near_all(o, out, "out");
  for (size_t i = 0; i < stats.size(); i += 2) {
    if (std::isinf(stats[i])) {
      ASSERT_TRUE(std::isinf(st[i]) && st[i] < 0) << "stats " << i / 2 << ": " << st[i];
      st[i] = stats[i] = 0;
    }
  }
  expect_near_all(st, stats, "stats", sizeof(T) == 8 ? 1e-11 : 2e-5);
  kernels::ReformerBackwardArgs<T> ab;
  fill(ab, qt, vt);
  ab.num_threads = threads;
  ab.grad_out = gt.data(), ab.grad_out_rows = rows(M), ab.stats = stats.data();
  ab.delta = dt.data(), ab.grad_q = oq.data(), ab.grad_v = ov.data();
  ab.grad_q_rows = rows(E), ab.grad_v_rows = rows(M);
  kernels::reformer_backward_cpu(ab);
  expect_near_all(oq, gq, "grad_q");
  expect_near_all(ov, gv, "grad_v");
}

TEST(KernelReference, Reformer) {
  std::mt19937 rng(43);
  at_every_level([&](int threads) {
    check_lsh_hash<double>(2, 2, 33, 16, 3, 4, threads, rng);
    check_lsh_hash<float>(1, 3, 70, 40, 2, 16, threads, rng);
    check_lsh_hash<double>(1, 1, 9, 8, 2, 0, threads, rng);
    for (bool causal : {false, true})
      for (double dropout : {0.0, 0.2}) {
        check_reformer<double>(2, 2, 37, 16, 24, 2, 4, 5, causal, true, dropout, false, threads,
                               rng);
        check_reformer<float>(1, 3, 70, 33, 17, 3, 8, 8, causal, true, dropout, true, threads, rng);
        check_reformer<double>(1, 1, 20, 8, 8, 1, 1, 32, causal, false, dropout, true, threads,
                               rng);
      }
  });
}

// ---- AFT-simple's scan ------------------------------------------------------------

template <typename T>
void check_aft(int64_t N, int64_t H, int64_t L, int64_t S, int64_t E, bool causal, bool lengths,
               int threads, std::mt19937& rng) {
  SCOPED_TRACE(dtype_name(sizeof(T)) + " L " + std::to_string(L) + " S " + std::to_string(S) +
               " E " + std::to_string(E) + (causal ? " causal" : "") +
               (lengths ? " key lengths" : ""));
  auto q = float_valued(normal(N * H * L * E, rng)), k = float_valued(normal(N * H * S * E, rng));
  for (auto& x : k) x = static_cast<float>(4 * x);  // exponents apart
  const auto v = float_valued(normal(k.size(), rng)), g = float_valued(normal(q.size(), rng));
  std::vector<int64_t> len(N);
  for (auto& l : len) l = static_cast<int64_t>(rng() % (S + 1));
  std::vector<double> out(q.size()), a(q.size()), lse(q.size()), gq(q.size()), gk(k.size()),
      gv(k.size());
  kernels::AftScanArgs<double> r;
  r.q = q.data(), r.k = k.data(), r.v = v.data(), r.key_lengths = lengths ? len.data() : nullptr;
  r.causal = causal, r.N = N, r.H = H, r.L = L, r.S = S, r.E = E;
  r.out = out.data(), r.a = a.data(), r.lse = lse.data();
  kernels::aft_scan_forward_reference(r);
  r.grad_out = g.data(), r.grad_q = gq.data(), r.grad_k = gk.data(), r.grad_v = gv.data();
  kernels::aft_scan_backward_reference(r);

  const auto qt = as<T>(q), kt = as<T>(k), vt = as<T>(v), gt = as<T>(g);
  std::vector<T> o(q.size(), T(7)), oa(q.size(), T(7)), ol(q.size(), T(7)), oq(q.size(), T(7)),
      ok(k.size(), T(7)), ov(k.size(), T(7));
  kernels::AftScanArgs<T> p;
  p.q = qt.data(), p.k = kt.data(), p.v = vt.data(), p.key_lengths = r.key_lengths;
  p.causal = causal, p.N = N, p.H = H, p.L = L, p.S = S, p.E = E, p.num_threads = threads;
  p.out = o.data(), p.a = oa.data(), p.lse = ol.data();
  kernels::aft_scan_forward_cpu(p);
  p.grad_out = gt.data(), p.a_in = oa.data(), p.lse_in = ol.data();
  p.grad_q = oq.data(), p.grad_k = ok.data(), p.grad_v = ov.data();
  kernels::aft_scan_backward_cpu(p);
  expect_near_all(o, out, "out");
  expect_near_all(oa, a, "a");
  for (size_t i = 0; i < lse.size(); ++i) {
    if (!std::isinf(lse[i])) continue;
    ASSERT_TRUE(std::isinf(ol[i]) && ol[i] < 0) << "lse " << i << ": " << ol[i];
    ol[i] = 0, lse[i] = 0;
  }
  expect_near_all(ol, lse, "lse");
  expect_near_all(oq, gq, "grad_q");
  expect_near_all(ok, gk, "grad_k");
  expect_near_all(ov, gv, "grad_v");
}

TEST(KernelReference, AftScan) {
  std::mt19937 rng(29);
  at_every_level([&](int threads) {
    for (bool causal : {false, true})
      for (bool lengths : {false, true}) {
        check_aft<double>(2, 2, 23, 23, 16, causal, lengths, threads, rng);
        check_aft<float>(2, 3, 9, 31, 20, causal, lengths, threads, rng);
        check_aft<double>(1, 1, 31, 9, 3, causal, lengths, threads, rng);
      }
  });
}

}  // namespace
}  // namespace fastattn
