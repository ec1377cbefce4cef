// Hard retrieval attention CUDA kernels (src/kernels/hard_retrieval/
// hard_retrieval_cuda.cu) run by the emulator against the plain reference
// (hard_retrieval_reference.h) in float64 on the same (dtype-rounded) inputs:
// argmax (with exact ties from integer inputs) and, against the CPU kernel,
// sampling (the same counter-based draws by key tile, so the same indices),
// bool keep masks with empty rows, key lengths with an empty batch, causal
// with S != L, several reservoir tiles (S > 128), the lse, and the
// straight-through backward (dQ, dK against the reference's delta and the
// full-attention backward's reference, dV against the reference's
// index-add), in float32, float16 and bfloat16.
//   build-emu/fastattn_cuda_emu_tests --gtest_filter='CudaEmuHardRetrieval*'
// Tolerances (|got - ref| <= atol + rtol·|ref|): float32 {2e-5, 2e-4}; float16
// {2e-3, 4e-3}, bfloat16 {1.6e-2, 3e-2} (float32 accumulation on rounded
// inputs; the gradients are float32). Indices are compared exactly; for
// random real inputs an argmax may differ only where the two scores are within
// float32 rounding of each other (checked).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "kernels/common/cuda_compat.cuh"
#include "kernels/full/full_attention_reference.h"
#include "kernels/hard_retrieval/hard_retrieval_reference.h"
#include "kernels/hard_retrieval/hard_retrieval_cuda.h"

namespace fastattn::cuda {
// Defined in hard_retrieval_cuda.cu (a __host__ __device__ function).
double hard_retrieval_uniform_cuda(uint64_t seed, uint64_t row, uint64_t tile, uint64_t draw);
}  // namespace fastattn::cuda

namespace fastattn::kernels {

// The CUDA launchers under test.
using cuda::hard_retrieval_backward_cuda;
using cuda::hard_retrieval_forward_cuda;
using cuda::HardRetrievalBackwardCudaArgs;
using cuda::HardRetrievalCudaParams;
using cuda::HardRetrievalForwardCudaArgs;

using cuda::hard_retrieval_uniform_cuda;

namespace {

using cuda::from_float;
using cuda::to_float;

struct Case {
  std::string name;
  int64_t N, H, L, S, E, M;
  bool causal = false;
  bool mask = false;             // a random (N, 1, L, S) keep mask, one row all false
  std::vector<int64_t> lengths;  // empty: none
  bool integer = false;          // inputs in {-1, 0, 1}: exact ties
  bool sample = false;
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

template <typename T>
void random_rounded(size_t n, std::mt19937& gen, bool integer, std::vector<T>& x,
                    std::vector<double>& xd) {
  std::normal_distribution<float> dist;
  std::uniform_int_distribution<int> small(-1, 1);
  x.resize(n);
  xd.resize(n);
  for (size_t i = 0; i < n; ++i) {
    x[i] = from_float<T>(integer ? static_cast<float>(small(gen)) : dist(gen));
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
  std::mt19937 gen(4321);
  std::vector<T> q, k, v, go;
  std::vector<double> qd, kd, vd, god;
  random_rounded(N * H * L * E, gen, c.integer, q, qd);
  random_rounded(N * H * S * E, gen, c.integer, k, kd);
  random_rounded(N * H * S * M, gen, false, v, vd);
  random_rounded(N * H * L * M, gen, false, go, god);
  // Keep mask (N, 1, L, S): about 70% kept, row 1 of batch 0 empty.
  std::unique_ptr<bool[]> keep;
  std::vector<double> additive;
  if (c.mask) {
    keep.reset(new bool[N * L * S]);
    additive.resize(N * L * S);
    std::bernoulli_distribution coin(0.7);
    for (int64_t x = 0; x < N * L * S; ++x) {
      const int64_t i = (x / S) % L;
      keep[x] = coin(gen) && !(x / (L * S) == 0 && i == 1);
      additive[x] = keep[x] ? 0.0 : -INFINITY;
    }
  }
  const int64_t* lengths = c.lengths.empty() ? nullptr : c.lengths.data();
  const double scale = 0.7;
  const uint64_t seed = 99;

  // CPU, float64.
  std::vector<double> out_ref(N * H * L * M), lse_ref(N * H * L);
  std::vector<int64_t> idx_ref(N * H * L);
  HardRetrievalForwardArgs<double> f;
  f.q = qd.data();
  f.k = kd.data();
  f.v = vd.data();
  if (keep) {
    f.keep = keep.get();
    f.keep_sn = L * S;
    f.keep_sl = S;
  }
  f.key_lengths = lengths;
  f.N = N, f.H = H, f.L = L, f.S = S, f.E = E, f.M = M;
  f.causal = c.causal;
  f.scale = scale;
  f.sample = c.sample;
  f.seed = seed;
  f.out = out_ref.data();
  f.index = idx_ref.data();
  f.lse = lse_ref.data();
  // Argmax mode: the plain reference; sample mode: the CPU kernel, whose
  // draws (by key tile) the CUDA kernel's follow.
  if (c.sample) {
    hard_retrieval_forward_cpu(f);
  } else {
    hard_retrieval_forward_reference(f);
  }

  // CUDA, emulated.
  std::vector<T> out(N * H * L * M);
  std::vector<int64_t> idx(N * H * L, -7);
  std::vector<float> lse(N * H * L);
  HardRetrievalCudaParams p;
  p.dtype = dtype_of<T>();
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  p.keep = f.keep;
  p.keep_sn = f.keep_sn;
  p.keep_sl = f.keep_sl;
  p.key_lengths = lengths;
  p.N = N, p.H = H, p.L = L, p.S = S, p.E = E, p.M = M;
  p.causal = c.causal;
  p.scale = static_cast<float>(scale);
  HardRetrievalForwardCudaArgs fa;
  static_cast<HardRetrievalCudaParams&>(fa) = p;
  fa.sample = c.sample;
  fa.seed = seed;
  fa.out = out.data();
  fa.index = idx.data();
  fa.lse = lse.data();
  hard_retrieval_forward_cuda(fa, nullptr);

  int64_t differ = 0;
  for (int64_t r = 0; r < N * H * L; ++r) {
    if (idx[r] == idx_ref[r]) continue;
    ++differ;
    if (c.sample || c.integer || idx[r] < 0 || idx_ref[r] < 0) {
      ADD_FAILURE() << "row " << r << ": index " << idx[r] << ", CPU " << idx_ref[r];
      continue;
    }
    // A near tie of real scores: the two raw scores must agree to float32 rounding.
    const int64_t nh = r / L;
    double s1 = 0, s2 = 0;
    for (int64_t e = 0; e < E; ++e) {
      s1 += qd[r * E + e] * kd[(nh * S + idx[r]) * E + e];
      s2 += qd[r * E + e] * kd[(nh * S + idx_ref[r]) * E + e];
    }
    EXPECT_NEAR(s1, s2, 1e-5 * E) << "row " << r;
  }
  EXPECT_LE(differ, 1);
  for (int64_t r = 0; r < N * H * L; ++r)
    for (int64_t x = 0; x < M; ++x) {
      const double want = idx[r] >= 0 ? to_float(v[(r / L * S + idx[r]) * M + x]) : 0.0;
      ASSERT_EQ(to_float(out[r * M + x]), want) << "row " << r;
    }
  const Tol tol = tol_for<T>();
  expect_close(std::vector<double>(lse.begin(), lse.end()), lse_ref, {tol.atol, 1e-5}, "lse");

  // Backward from the CPU's indices (so dV is comparable) and each side's lse.
  std::vector<double> delta_ref(N * H * L), gq_ref(qd.size()), gk_ref(kd.size()),
      gv_soft(vd.size()), gv_ref(vd.size());
  HardRetrievalDeltaArgs<double> d;
  static_cast<HardRetrievalParams<double>&>(d) = f;
  d.lse = lse_ref.data();
  d.grad_out = god.data();
  d.delta = delta_ref.data();
  hard_retrieval_delta_reference(d);
  FullAttentionBackwardArgs<double> b;
  b.q = qd.data();
  b.k = kd.data();
  b.v = vd.data();
  if (keep) {
    b.mask = additive.data();
    b.mask_sn = L * S;
    b.mask_sl = S;
  }
  b.key_lengths = lengths;
  b.N = N, b.H = H, b.L = L, b.S = S, b.E = E, b.M = M;
  b.causal = c.causal;
  b.scale = scale;
  b.grad_out = god.data();
  b.lse = lse_ref.data();
  b.delta = delta_ref.data();
  b.grad_q = gq_ref.data();
  b.grad_k = gk_ref.data();
  b.grad_v = gv_soft.data();
  full_attention_backward_reference(b);
  hard_retrieval_grad_v_reference(
      HardRetrievalGradVArgs<double>{god.data(), idx_ref.data(), gv_ref.data(), N * H, L, S, M, 1});

  std::vector<float> ws_out(N * H * L * M), ws_lse(N * H * L), ws_delta(N * H * L);
  std::vector<float> gq(qd.size(), 0.f), gk(kd.size(), 0.f), gv(vd.size(), 0.f);
  HardRetrievalBackwardCudaArgs ba;
  static_cast<HardRetrievalCudaParams&>(ba) = p;
  ba.grad_out = go.data();
  ba.index = idx_ref.data();
  ba.lse = lse.data();
  ba.ws_out = ws_out.data();
  ba.ws_lse = ws_lse.data();
  ba.ws_delta = ws_delta.data();
  ba.grad_q = gq.data();
  ba.grad_k = gk.data();
  ba.grad_v = gv.data();
  hard_retrieval_backward_cuda(ba, nullptr);
  expect_close(std::vector<double>(ws_delta.begin(), ws_delta.end()), delta_ref, tol, "delta");
  expect_close(std::vector<double>(gq.begin(), gq.end()), gq_ref, tol, "grad_q");
  expect_close(std::vector<double>(gk.begin(), gk.end()), gk_ref, tol, "grad_k");
  expect_close(std::vector<double>(gv.begin(), gv.end()), gv_ref, tol, "grad_v");
}

std::vector<Case> cases() {
  return {
      {"argmax_plain", 2, 2, 20, 37, 16, 8},
      {"argmax_ties", 1, 2, 24, 40, 4, 8, false, false, {}, true},
      {"argmax_mask_lengths", 2, 1, 17, 33, 24, 16, false, true, {33, 0}},
      {"argmax_causal_S_gt_L", 1, 2, 17, 40, 16, 16, true},
      {"argmax_two_tiles", 1, 1, 9, 200, 8, 40, true, false, {150}},
      {"sample_plain", 1, 2, 20, 37, 16, 8, false, false, {}, false, true},
      {"sample_mask_causal", 2, 1, 17, 33, 16, 24, true, true, {}, false, true},
      {"sample_three_tiles", 1, 1, 9, 300, 8, 8, false, false, {}, false, true},
      {"sample_causal_S_lt_L", 1, 1, 33, 20, 64, 33, true, false, {}, false, true},
      {"one_query", 1, 1, 1, 1, 16, 16, true, false, {}, false, true},
      {"no_keys", 1, 2, 5, 0, 16, 16, false, false, {}, false, true},
      // Zero-width values, as the recurrent layers use it to get indices only.
      {"zero_width_values", 2, 1, 3, 40, 16, 0, false, false, {40, 7}},
  };
}

class CudaEmuHardRetrieval : public ::testing::TestWithParam<Case> {};

TEST_P(CudaEmuHardRetrieval, Float32) { run_case<float>(GetParam()); }
// float16 / bfloat16 score on tensor cores (WMMA).
TEST_P(CudaEmuHardRetrieval, Float16) { run_case<__half>(GetParam()); }
TEST_P(CudaEmuHardRetrieval, BFloat16) { run_case<__nv_bfloat16>(GetParam()); }
// Before sm_80 bfloat16 scores with the SIMT loop (and its backward takes the
// block-sparse SIMT kernels).
TEST_P(CudaEmuHardRetrieval, BFloat16Sm75) {
  const cuda::emu::ScopedArchitecture sm75(75, 75);
  run_case<__nv_bfloat16>(GetParam());
}

INSTANTIATE_TEST_SUITE_P(Modes, CudaEmuHardRetrieval, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.name;
                         });

TEST(CudaEmuHardRetrievalRng, SameUniformsAsCpu) {
  for (uint64_t seed : {0ull, 1ull, 123456789ull, ~0ull})
    for (uint64_t row = 0; row < 50; row += 7)
      for (uint64_t tile = 0; tile < 3; ++tile)
        for (uint64_t draw = 0; draw < 2; ++draw)
          EXPECT_EQ(hard_retrieval_uniform_cuda(seed, row, tile, draw),
                    hard_retrieval_uniform(seed, row, tile, draw));
}

}  // namespace
}  // namespace fastattn::kernels
