// Block-sparse attention CUDA kernels (src/kernels/block_sparse/
// block_sparse_attention_{forward,backward}_cuda.cu) run by the emulator
// against the plain reference (block_sparse_attention_reference.h) in float64
// on the same (dtype-rounded) inputs: every pattern family and
// mode, causal, S != L, key lengths with an empty batch, head dims that
// exercise each register-chunk count, forward (out, lse) and backward (dQ, dK,
// dV), in float32, float16 and bfloat16.
//   build-emu/fastattn_cuda_emu_tests --gtest_filter='CudaEmuBlockSparse*'
// Tolerances (|got - ref| <= atol + rtol·|ref|): float32 {2e-5, 2e-4}
// (float32 accumulation against float64); float16 {2e-3, 4e-3} and bfloat16
// {1.6e-2, 3e-2}: the output is rounded to the dtype (2^-11, 2^-8 relative);
// the gradients are float32 but use delta = rowsum(dO ∘ out) with the rounded
// out, as the operator does.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "kernels/block_sparse/block_sparse_attention_reference.h"
#include "kernels/block_sparse/block_sparse_attention_cuda.h"
#include "kernels/common/cuda_compat.cuh"

namespace fastattn::kernels {

// The CUDA launchers under test.
using cuda::block_sparse_attention_backward_cuda;
using cuda::block_sparse_attention_forward_cuda;
using cuda::BlockSparseBackwardCudaArgs;
using cuda::BlockSparseCudaParams;
using cuda::BlockSparseForwardCudaArgs;
using cuda::kBlockSparseCudaBk;
using cuda::kBlockSparseCudaBq;
namespace {

using cuda::from_float;
using cuda::to_float;

struct Case {
  std::string name;
  int pattern;  // kLocalPattern, kStridedPattern, kFixedPattern
  std::vector<int64_t> params;
  int64_t N, H, L, S, E, M;
  bool causal = false;
  std::vector<int64_t> lengths;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

struct Tol {
  double atol, rtol;
};
template <typename T>
Tol tol_for() {
  if (std::is_same<T, __half>::value) return {2e-3, 4e-3};
  if (std::is_same<T, __nv_bfloat16>::value) return {1.6e-2, 3e-2};
  return {2e-5, 2e-4};
}

template <typename T>
cuda::DType dtype_of() {
  if (std::is_same<T, __half>::value) return cuda::DType::kFloat16;
  if (std::is_same<T, __nv_bfloat16>::value) return cuda::DType::kBFloat16;
  return cuda::DType::kFloat32;
}

// Random values rounded to T: storage and the float64 copy.
template <typename T>
void random_rounded(size_t n, std::mt19937& gen, std::vector<T>& x, std::vector<double>& xd) {
  std::normal_distribution<float> dist;
  x.resize(n);
  xd.resize(n);
  for (size_t i = 0; i < n; ++i) {
    x[i] = from_float<T>(dist(gen));
    xd[i] = to_float(x[i]);
  }
}

void expect_close(const std::vector<double>& got, const std::vector<double>& ref, Tol tol,
                  const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isinf(ref[i]) && got[i] == ref[i]) continue;
    const double excess = std::fabs(got[i] - ref[i]) - (tol.atol + tol.rtol * std::fabs(ref[i]));
    if (!(excess <= worst)) {
      worst = std::isnan(excess) ? INFINITY : excess;
      at = i;
    }
  }
  EXPECT_LE(worst, 0.0) << what << ": element " << at << " is " << got[at] << ", want " << ref[at];
}

template <typename T>
void run_case(const Case& c) {
  SCOPED_TRACE(c.name);
  const int64_t N = c.N, H = c.H, L = c.L, S = c.S, E = c.E, M = c.M;
  std::mt19937 gen(1234);
  std::vector<T> q, k, v, go;
  std::vector<double> qd, kd, vd, god;
  random_rounded(N * H * L * E, gen, q, qd);
  random_rounded(N * H * S * E, gen, k, kd);
  random_rounded(N * H * S * M, gen, v, vd);
  random_rounded(N * H * L * M, gen, go, god);
  const double scale = 1.0 / std::sqrt(static_cast<double>(E));
  const auto parts = make_sparse_parts(c.pattern, c.params, c.causal, H);
  const int64_t* lengths = c.lengths.empty() ? nullptr : c.lengths.data();

  // The float64 reference.
  std::vector<double> out_ref(N * H * L * M), lse_ref(N * H * L);
  BlockSparseForwardArgs<double> f;
  f.q = qd.data();
  f.k = kd.data();
  f.v = vd.data();
  f.key_lengths = lengths;
  f.N = N, f.H = H, f.L = L, f.S = S, f.E = E, f.M = M;
  f.scale = scale;
  f.parts = parts.data();
  f.num_parts = static_cast<int>(parts.size());
  f.out = out_ref.data();
  f.lse = lse_ref.data();
  block_sparse_attention_forward_reference(f);

  // CUDA kernels, emulated.
  std::vector<SparsePlanLayout> lay;
  const auto plans = make_sparse_plans(parts, H, L, S, kBlockSparseCudaBq, kBlockSparseCudaBk);
  const auto buf =
      flatten_sparse_plans(plans, H, L, S, kBlockSparseCudaBq, kBlockSparseCudaBk, &lay);
  BlockSparseCudaParams p;
  p.dtype = dtype_of<T>();
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  p.key_lengths = lengths;
  p.N = N, p.H = H, p.L = L, p.S = S, p.E = E, p.M = M;
  p.scale = static_cast<float>(scale);
  p.num_parts = static_cast<int>(parts.size());
  for (int i = 0; i < p.num_parts; ++i) {
    const int64_t* b = buf.data();
    auto& pc = p.parts[i];
    pc.max_sp = lay[i].max_sp;
    pc.head_group = b + lay[i].head_group;
    pc.head_flags = b + lay[i].head_flags;
    pc.group_sp = b + lay[i].group_sp;
    pc.q_order = b + lay[i].q_order;
    pc.k_order = b + lay[i].k_order;
    pc.ranges = b + lay[i].ranges;
    pc.q_tile_kb = b + lay[i].q_tile_kb;
    pc.kt_ptr = b + lay[i].kt_ptr;
    pc.kt_q = b + lay[i].kt_q;
  }
  std::vector<T> out(N * H * L * M);
  std::vector<float> lse(N * H * L), ws_acc(N * H * L * M), ws_ml(2 * N * H * L);
  BlockSparseForwardCudaArgs fa;
  static_cast<BlockSparseCudaParams&>(fa) = p;
  fa.out = out.data();
  fa.lse = lse.data();
  fa.ws_acc = ws_acc.data();
  fa.ws_ml = ws_ml.data();
  block_sparse_attention_forward_cuda(fa, nullptr);
  std::vector<double> outd(out.size()), lsed(lse.begin(), lse.end());
  for (size_t i = 0; i < out.size(); ++i) outd[i] = to_float(out[i]);
  const Tol tol = tol_for<T>();
  expect_close(outd, out_ref, tol, "out");
  expect_close(lsed, lse_ref, {tol.atol, 1e-5}, "lse");

  // Backward: both sides from their own forward (delta = rowsum(dO ∘ out)).
  std::vector<double> delta_ref(N * H * L, 0.0);
  std::vector<float> delta(N * H * L, 0.f);
  for (int64_t r = 0; r < N * H * L; ++r)
    for (int64_t c = 0; c < M; ++c) {
      delta_ref[r] += god[r * M + c] * out_ref[r * M + c];
      delta[r] += static_cast<float>(god[r * M + c] * outd[r * M + c]);
    }
  std::vector<double> gq_ref(qd.size()), gk_ref(kd.size()), gv_ref(vd.size());
  BlockSparseBackwardArgs<double> b;
  static_cast<BlockSparseParams<double>&>(b) = f;
  b.grad_out = god.data();
  b.lse = lse_ref.data();
  b.delta = delta_ref.data();
  b.grad_q = gq_ref.data();
  b.grad_k = gk_ref.data();
  b.grad_v = gv_ref.data();
  block_sparse_attention_backward_reference(b);

  std::vector<float> gq(qd.size(), 0.f), gk(kd.size(), 0.f), gv(vd.size(), 0.f);
  BlockSparseBackwardCudaArgs ba;
  static_cast<BlockSparseCudaParams&>(ba) = p;
  ba.grad_out = go.data();
  ba.lse = lse.data();
  ba.delta = delta.data();
  ba.grad_q = gq.data();
  ba.grad_k = gk.data();
  ba.grad_v = gv.data();
  block_sparse_attention_backward_cuda(ba, nullptr);
  auto as_double = [](const std::vector<float>& x) {
    return std::vector<double>(x.begin(), x.end());
  };
  expect_close(as_double(gq), gq_ref, tol, "grad_q");
  expect_close(as_double(gk), gk_ref, tol, "grad_k");
  expect_close(as_double(gv), gv_ref, tol, "grad_v");
}

// which: 0 merged, 1 A1, 2 A2, 3 split heads.
std::vector<Case> cases() {
  return {
      {"local_bidir", kLocalPattern, {16}, 2, 2, 50, 50, 16, 16},
      {"local_causal_S_gt_L", kLocalPattern, {9}, 1, 2, 30, 50, 24, 20, true},
      {"local_causal_S_lt_L", kLocalPattern, {9}, 1, 1, 45, 33, 16, 8, true},
      {"local_lengths", kLocalPattern, {20}, 3, 1, 40, 40, 8, 8, false, {40, 17, 0}},
      {"local_wide_head_dims", kLocalPattern, {40}, 1, 1, 33, 33, 100, 64, true},
      {"strided_merged_causal", kStridedPattern, {10, 0}, 1, 2, 70, 70, 16, 16, true},
      {"strided_merged_bidir", kStridedPattern, {6, 0}, 1, 2, 60, 60, 16, 16},
      {"strided_A2_bidir_S_ne_L", kStridedPattern, {5, 2}, 1, 1, 41, 66, 8, 8},
      {"strided_split_causal", kStridedPattern, {7, 3}, 1, 3, 50, 50, 8, 8, true},
      {"strided_lengths", kStridedPattern, {9, 0}, 2, 1, 60, 60, 8, 8, true, {60, 23}},
      {"fixed_merged_causal_per_head", kFixedPattern, {10, 3, 0, 1}, 1, 3, 70, 70, 16, 16, true},
      {"fixed_merged_bidir", kFixedPattern, {12, 3, 0, 0}, 1, 2, 50, 50, 16, 16},
      {"fixed_A2_per_head_lengths",
       kFixedPattern,
       {8, 2, 2, 1},
       2,
       2,
       45,
       45,
       8,
       8,
       false,
       {45, 13}},
      {"fixed_split_S_lt_L", kFixedPattern, {8, 2, 3, 0}, 1, 2, 50, 35, 8, 8, true},
      {"length_one", kLocalPattern, {4}, 1, 2, 1, 1, 16, 16, true},
      {"no_keys", kStridedPattern, {4, 0}, 1, 2, 5, 0, 16, 16, true},
  };
}

class CudaEmuBlockSparse : public ::testing::TestWithParam<Case> {};

TEST_P(CudaEmuBlockSparse, Float32) { run_case<float>(GetParam()); }
// float16 / bfloat16 take the tensor-core (WMMA) kernels.
TEST_P(CudaEmuBlockSparse, Float16) { run_case<__half>(GetParam()); }
TEST_P(CudaEmuBlockSparse, BFloat16) { run_case<__nv_bfloat16>(GetParam()); }
// A GPU (or a build's code for it) before sm_80: bfloat16 takes the SIMT kernels.
TEST_P(CudaEmuBlockSparse, BFloat16Sm75) {
  const cuda::emu::ScopedArchitecture sm75(75, 75);
  run_case<__nv_bfloat16>(GetParam());
}

INSTANTIATE_TEST_SUITE_P(Patterns, CudaEmuBlockSparse, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.name;
                         });

TEST(CudaEmuBlockSparseLimits, LargestHeadDimFloat16) {
  run_case<__half>({"head_dim_256", kLocalPattern, {8}, 1, 1, 20, 20, 256, 200, true});
}

}  // namespace
}  // namespace fastattn::kernels
