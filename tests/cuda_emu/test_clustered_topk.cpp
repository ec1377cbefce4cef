// The clustered top-k kernels (src/kernels/clustered_topk/clustered_topk_cuda.cu)
// under the emulator against the plain references (clustered_topk_reference.h)
// in float64 on the same rounded inputs: forward and backward in the plain form (given
// masses) and the improved form (centroids, lse, centroid outputs), the
// cluster means and the centroid-gradient scatter.
// Covered: K = 0, 1, 7, 32 (one staged chunk) and 45, 70 (several chunks, with
// repeated key indices in the plain form); E in {16, 24, 64}, M in {8, 40};
// padded queries (assignment -1), empty clusters, key lengths dropping some
// or all (length 0) of a cluster's keys; every dtype.
// Tolerances: outputs stored in the dtype: tol_for<T>() (emu_test_util.h);
// gradients (float32 buffers, float32 arithmetic on the same rounded inputs):
// 2e-5 + 2e-4 relative.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>

#include "emu_test_util.h"
#include "kernels/clustered_topk/clustered_topk_reference.h"
#include "kernels/clustered_topk/clustered_topk_cuda.h"

namespace {

using namespace fastattn::emu_test;

struct Case {
  int64_t N, H, L, S, E, M, C, K;
  std::vector<int64_t> key_lengths;  // empty: none
  bool improved;
  uint32_t seed;
};

std::string describe(const Case& c) {
  return "N " + std::to_string(c.N) + " H " + std::to_string(c.H) + " L " + std::to_string(c.L) +
         " S " + std::to_string(c.S) + " E " + std::to_string(c.E) + " M " + std::to_string(c.M) +
         " C " + std::to_string(c.C) + " K " + std::to_string(c.K) +
         (c.key_lengths.empty() ? "" : " key_lengths") + (c.improved ? " improved" : " plain");
}

const Tol kGradTol{2e-5, 2e-4};

template <typename T>
void check_topk(const Case& cs) {
  SCOPED_TRACE(std::string(dtype_name<T>()) + " " + describe(cs));
  const int64_t N = cs.N, H = cs.H, L = cs.L, S = cs.S, E = cs.E, M = cs.M, C = cs.C, K = cs.K;
  const int64_t NH = N * H;
  std::mt19937 rng(cs.seed);
  auto q = random_buffer<T>(NH * L * E, rng);
  auto k = random_buffer<T>(NH * S * E, rng);
  auto v = random_buffer<T>(NH * S * M, rng);
  auto go = random_buffer<T>(NH * L * M, rng);
  const double scale = 1.0 / std::sqrt(static_cast<double>(E));
  // Top-k indices: distinct per cluster while K <= S, repeats beyond.
  std::vector<int64_t> topk(NH * C * K);
  for (int64_t j = 0; j < NH * C; ++j) {
    std::vector<int64_t> perm(S);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int64_t t = 0; t < K; ++t) topk[j * K + t] = t < S ? perm[t] : perm[rng() % S];
  }
  // Assignments in [-1, C - 1): the last cluster stays empty (C >= 2).
  std::vector<int64_t> assignments(NH * L);
  for (auto& x : assignments) x = static_cast<int64_t>(rng() % C) - 1;
  std::vector<int64_t> counts(NH * C, 0);
  for (int64_t i = 0; i < NH * L; ++i)
    if (assignments[i] >= 0) ++counts[(i / L) * C + assignments[i]];
  const int64_t* klen = cs.key_lengths.empty() ? nullptr : cs.key_lengths.data();

  // Plain form: masses. Improved form: centroids, their lse over the kept
  // keys (-inf without any) and outputs.
  std::vector<float> mass_f(NH * C);
  std::vector<double> mass_d(NH * C);
  for (int64_t i = 0; i < NH * C; ++i) {
    mass_f[i] = fastattn::cuda::to_float(
        fastattn::cuda::from_float<T>(0.2f + 0.8f * static_cast<float>(rng() % 1000) / 1000.f));
    mass_d[i] = mass_f[i];
  }
  auto cen = random_buffer<T>(NH * C * E, rng);
  auto oc = random_buffer<T>(NH * C * M, rng);
  std::vector<float> lse_f(NH * C);
  std::vector<double> lse_d(NH * C);
  for (int64_t nh = 0; nh < NH; ++nh) {
    const int64_t len = klen ? klen[nh / H] : S;
    for (int64_t c = 0; c < C; ++c) {
      double mx = -std::numeric_limits<double>::infinity(), sum = 0;
      std::vector<double> sc(len);
      for (int64_t s = 0; s < len; ++s) {
        double d = 0;
        for (int64_t x = 0; x < E; ++x)
          d += cen.ref[(nh * C + c) * E + x] * k.ref[(nh * S + s) * E + x];
        sc[s] = d * scale;
        mx = std::max(mx, sc[s]);
      }
      for (int64_t s = 0; s < len; ++s) sum += std::exp(sc[s] - mx);
      lse_f[nh * C + c] = static_cast<float>(len > 0 ? mx + std::log(sum) : mx);
      lse_d[nh * C + c] = lse_f[nh * C + c];
    }
  }

  std::vector<unsigned char> ws(
      fastattn::cuda::clustered_topk_cuda_workspace_bytes(N, H, L, C, K, M));
  auto fill = [&](fastattn::cuda::ClusteredTopkCudaArgs& a) {
    a.q = q.dev.data();
    a.k = k.dev.data();
    a.v = v.dev.data();
    a.topk = topk.data();
    a.assignments = assignments.data();
    a.key_lengths = klen;
    if (cs.improved) {
      a.centroids = cen.dev.data();
      a.lse = lse_f.data();
      a.out_c = oc.dev.data();
    } else {
      a.mass = mass_f.data();
    }
    a.N = N;
    a.H = H;
    a.L = L;
    a.S = S;
    a.E = E;
    a.M = M;
    a.C = C;
    a.K = K;
    a.scale = static_cast<float>(scale);
    a.dtype = dtype_of<T>();
    a.workspace = ws.data();
  };
  auto fill_cpu = [&](fastattn::kernels::ClusteredTopkParams<double>& a) {
    a.q = q.ref.data();
    a.k = k.ref.data();
    a.v = v.ref.data();
    a.topk = topk.data();
    a.assignments = assignments.data();
    a.key_lengths = klen;
    if (cs.improved) {
      a.centroids = cen.ref.data();
      a.lse = lse_d.data();
      a.out_c = oc.ref.data();
    } else {
      a.mass = mass_d.data();
    }
    a.N = N;
    a.H = H;
    a.L = L;
    a.S = S;
    a.E = E;
    a.M = M;
    a.C = C;
    a.K = K;
    a.scale = static_cast<double>(static_cast<float>(scale));
  };

  // Forward.
  std::vector<T> out(NH * L * M, fastattn::cuda::from_float<T>(0.f));
  fastattn::cuda::ClusteredTopkForwardCudaArgs fa;
  fill(fa);
  fa.out = out.data();
  fastattn::cuda::clustered_topk_forward_cuda(fa, nullptr);
  std::vector<double> out_ref(NH * L * M);
  fastattn::kernels::ClusteredTopkForwardArgs<double> fc;
  fill_cpu(fc);
  fc.out = out_ref.data();
  fastattn::kernels::clustered_topk_forward_reference(fc);
  expect_close(to_double(out), out_ref, tol_for<T>(), "out");
  // Again with the grouping that call left in the workspace (as
  // cluster_means_cuda leaves it for the improved op): the same output.
  std::vector<T> out_grouped(NH * L * M, fastattn::cuda::from_float<T>(0.f));
  fa.out = out_grouped.data();
  fa.grouped = true;
  fastattn::cuda::clustered_topk_forward_cuda(fa, nullptr);
  EXPECT_EQ(to_double(out_grouped), to_double(out)) << "forward on a grouped workspace";

  // Backward.
  std::vector<float> gq(NH * L * E, 0.f), gk(NH * S * E, 0.f), gv(NH * S * M, 0.f),
      gm(NH * C, -1.f), gcen(NH * C * E, -1.f), glse(NH * C, -1.f), goc(NH * C * M, -1.f);
  fastattn::cuda::ClusteredTopkBackwardCudaArgs ba;
  fill(ba);
  ba.grad_out = go.dev.data();
  ba.grad_q = gq.data();
  ba.grad_k = gk.data();
  ba.grad_v = gv.data();
  ba.grad_mass = gm.data();
  ba.grad_centroids = gcen.data();
  ba.grad_lse = glse.data();
  ba.grad_out_c = goc.data();
  fastattn::cuda::clustered_topk_backward_cuda(ba, nullptr);
  std::vector<double> rq(NH * L * E), rk(NH * S * E), rv(NH * S * M), rm(NH * C), rcen(NH * C * E),
      rlse(NH * C), roc(NH * C * M);
  fastattn::kernels::ClusteredTopkBackwardArgs<double> bc;
  fill_cpu(bc);
  bc.grad_out = go.ref.data();
  bc.grad_q = rq.data();
  bc.grad_k = rk.data();
  bc.grad_v = rv.data();
  bc.grad_mass = rm.data();
  bc.grad_centroids = rcen.data();
  bc.grad_lse = rlse.data();
  bc.grad_out_c = roc.data();
  fastattn::kernels::clustered_topk_backward_reference(bc);
  auto d = [](const std::vector<float>& x) { return std::vector<double>(x.begin(), x.end()); };
  expect_close(d(gq), rq, kGradTol, "grad_q");
  expect_close(d(gk), rk, kGradTol, "grad_k");
  expect_close(d(gv), rv, kGradTol, "grad_v");
  if (cs.improved) {
    expect_close(d(gcen), rcen, kGradTol, "grad_centroids");
    expect_close(d(glse), rlse, kGradTol, "grad_lse");
    expect_close(d(goc), roc, kGradTol, "grad_out_c");
  } else {
    expect_close(d(gm), rm, kGradTol, "grad_mass");
  }
}

std::vector<Case> cases(bool improved) {
  return {
      {1, 2, 37, 29, 16, 8, 5, 7, {}, improved, 1},
      {2, 1, 33, 45, 24, 40, 4, 32, {45, 17}, improved, 2},
      {1, 1, 20, 50, 64, 8, 3, 45, {}, improved, 3},
      {2, 1, 17, 30, 16, 40, 3, 1, {30, 0}, improved, 4},
      // Two chunks, the second partly dropped by the key length.
      {1, 1, 13, 50, 16, 8, 2, 45, {38}, improved, 7},
  };
}

template <typename T>
void sweep(bool improved) {
  for (const auto& c : cases(improved)) check_topk<T>(c);
}

TEST(ClusteredEmuTopk, PlainFloat32) {
  sweep<float>(false);
  // More keys than S: repeated indices, three chunks.
  check_topk<float>({1, 1, 11, 20, 16, 8, 2, 70, {13}, false, 5});
  // No keys at all (K = 0): zero outputs and gradients.
  check_topk<float>({1, 2, 9, 6, 16, 8, 3, 0, {}, false, 6});
}
TEST(ClusteredEmuTopk, PlainFloat16) { sweep<__half>(false); }
TEST(ClusteredEmuTopk, PlainBFloat16) { sweep<__nv_bfloat16>(false); }
TEST(ClusteredEmuTopk, ImprovedFloat32) { sweep<float>(true); }
TEST(ClusteredEmuTopk, ImprovedFloat16) { sweep<__half>(true); }
TEST(ClusteredEmuTopk, ImprovedBFloat16) { sweep<__nv_bfloat16>(true); }

template <typename T>
void check_means(int64_t N, int64_t H, int64_t L, int64_t C, int64_t E, uint32_t seed) {
  SCOPED_TRACE(std::string(dtype_name<T>()) + " L " + std::to_string(L) + " C " +
               std::to_string(C) + " E " + std::to_string(E));
  const int64_t NH = N * H;
  std::mt19937 rng(seed);
  auto q = random_buffer<T>(NH * L * E, rng);
  std::vector<int64_t> assignments(NH * L), counts(NH * C, 0);
  for (auto& x : assignments) x = static_cast<int64_t>(rng() % C) - 1;
  for (int64_t i = 0; i < NH * L; ++i)
    if (assignments[i] >= 0) ++counts[(i / L) * C + assignments[i]];
  std::vector<unsigned char> ws(
      fastattn::cuda::clustered_topk_cuda_workspace_bytes(N, H, L, C, 0, 0));
  std::vector<T> cen(NH * C * E);
  fastattn::cuda::ClusterMeansCudaArgs a;
  a.q = q.dev.data();
  a.assignments = assignments.data();
  a.counts = counts.data();
  a.centroids = cen.data();
  a.NH = NH;
  a.H = H;
  a.L = L;
  a.C = C;
  a.E = E;
  a.dtype = dtype_of<T>();
  a.workspace = ws.data();
  fastattn::cuda::cluster_means_cuda(a, nullptr);
  std::vector<double> want(NH * C * E);
  fastattn::kernels::cluster_means_reference(fastattn::kernels::ClusterMeansArgs<double>{
      q.ref.data(), assignments.data(), counts.data(), want.data(), NH, L, C, E, 1});
  expect_close(to_double(cen), want, tol_for<T>(), "centroids");

  // grad_q += table[a_l] / count.
  std::vector<float> table(NH * C * E), gq(NH * L * E);
  std::normal_distribution<float> nd;
  for (auto& x : table) x = nd(rng);
  for (auto& x : gq) x = nd(rng);
  std::vector<double> table_d(table.begin(), table.end()), gq_d(gq.begin(), gq.end());
  fastattn::cuda::AddCentroidGradsCudaArgs g;
  g.dst = gq.data();
  g.table = table.data();
  g.assignments = assignments.data();
  g.counts = counts.data();
  g.NH = NH;
  g.H = H;
  g.L = L;
  g.C = C;
  g.E = E;
  fastattn::cuda::add_centroid_grads_cuda(g, nullptr);
  fastattn::kernels::spread_centroids_reference(fastattn::kernels::CentroidSpreadArgs<double>{
      gq_d.data(), table_d.data(), assignments.data(), counts.data(), NH, L, C, E, 1});
  expect_close(std::vector<double>(gq.begin(), gq.end()), gq_d, {1e-6, 1e-6}, "grad_q");
}

TEST(ClusteredEmuTopk, ClusterMeansAndCentroidGrads) {
  check_means<float>(2, 2, 37, 5, 24, 1);
  check_means<__half>(1, 2, 70, 9, 16, 2);
  check_means<__nv_bfloat16>(1, 1, 600, 3, 64, 3);  // several segments per grouping warp
}

}  // namespace
