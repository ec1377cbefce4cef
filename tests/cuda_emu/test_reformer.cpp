// The Reformer CUDA kernels (src/kernels/reformer/reformer_*_cuda.cu) under the
// emulator, against the plain reference (reformer_reference.h) in float64 on
// the same (rounded) inputs: lsh_hash (buckets equal except at near-ties of the projections),
// the forward (output and the float64 stats) and the backward (grad_q,
// grad_v) with the forward's output and stats, per dtype, over awkward sizes
// (L 1 .. 40; E 16, 24, 64, 256; M 0 .. 64; chunks 1 .. larger than L),
// several rounds, key_lengths (0 included), causal and mask_self on and off. float32
// runs the SIMT kernels, float16/bfloat16 the tensor-core (WMMA) ones.
// Tolerances (|got - ref| <= atol·max(1, max|ref|) + rtol·|ref|): float32
// 2e-5 / 2e-4, float16 2e-3 / 4e-3, bfloat16 1.6e-2 / 3e-2 (the rounding of
// the outputs and gradients in the storage type; arithmetic is float32).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/common/cuda_compat.cuh"
#include "kernels/reformer/reformer_reference.h"
#include "kernels/reformer/reformer_cuda.h"

namespace {

using fastattn::cuda::DType;
using fastattn::cuda::from_float;
using fastattn::cuda::to_float;
namespace k = fastattn::kernels;

template <typename T>
DType dtype_of();
template <>
DType dtype_of<float>() {
  return DType::kFloat32;
}
template <>
DType dtype_of<__half>() {
  return DType::kFloat16;
}
template <>
DType dtype_of<__nv_bfloat16>() {
  return DType::kBFloat16;
}

struct Tol {
  double atol, rtol;
};
template <typename T>
Tol tol() {
  if (std::is_same<T, __half>::value) return {2e-3, 4e-3};
  if (std::is_same<T, __nv_bfloat16>::value) return {1.6e-2, 3e-2};
  return {2e-5, 2e-4};
}

// Random values rounded to T: the storage and the float64 copy.
template <typename T>
struct Data {
  std::vector<T> dev;
  std::vector<double> ref;
};
template <typename T>
Data<T> random_data(size_t n, std::mt19937& gen, double scale = 1.0) {
  std::normal_distribution<double> dist(0.0, scale);
  Data<T> d;
  d.dev.resize(n);
  d.ref.resize(n);
  for (size_t i = 0; i < n; ++i) {
    d.dev[i] = from_float<T>(static_cast<float>(dist(gen)));
    d.ref[i] = to_float(d.dev[i]);
  }
  return d;
}

template <typename T>
std::vector<double> as_double(const std::vector<T>& x) {
  std::vector<double> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = to_float(x[i]);
  return y;
}

template <typename T>
void expect_close(const std::vector<double>& got, const std::vector<double>& ref,
                  const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  const Tol t = tol<T>();
  double scale = 1.0;
  for (double r : ref)
    if (std::isfinite(r)) scale = std::max(scale, std::abs(r));
  int bad = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isinf(ref[i])) {
      EXPECT_EQ(got[i], ref[i]) << what << " at " << i;
      continue;
    }
    const double err = std::abs(got[i] - ref[i]);
    if (!(err <= t.atol * scale + t.rtol * std::abs(ref[i])) && bad++ < 5) {
      ADD_FAILURE() << what << "[" << i << "] = " << got[i] << ", the float64 reference " << ref[i]
                    << " (error " << err << ")";
    }
  }
  EXPECT_EQ(bad, 0) << what << ": elements out of tolerance";
}

// ---- lsh_hash ---------------------------------------------------------------

template <typename T>
void check_hash(int64_t N, int64_t H, int64_t L, int64_t E, int64_t R, int64_t B2, int seed) {
  SCOPED_TRACE("N=" + std::to_string(N) + " H=" + std::to_string(H) + " L=" + std::to_string(L) +
               " E=" + std::to_string(E) + " R=" + std::to_string(R) + " B2=" + std::to_string(B2));
  std::mt19937 gen(seed);
  auto x = random_data<T>(N * H * L * E, gen);
  auto rot = random_data<T>(R * E * B2, gen);
  std::vector<int64_t> got(N * H * R * L, -7), want(N * H * R * L, -9);
  fastattn::cuda::LshHashCudaArgs a;
  a.x = x.dev.data();
  a.rotations = rot.dev.data();
  a.buckets = got.data();
  a.N = N, a.H = H, a.L = L, a.E = E, a.R = R, a.B2 = B2;
  a.dtype = dtype_of<T>();
  fastattn::cuda::lsh_hash_cuda(a, nullptr);
  k::LshHashArgs<double> c;
  c.x = x.ref.data();
  c.rotations = rot.ref.data();
  c.buckets = want.data();
  c.N = N, c.H = H, c.L = L, c.E = E, c.R = R, c.B2 = B2;
  k::lsh_hash_reference(c);
  int mismatches = 0;
  for (int64_t nh = 0; nh < N * H; ++nh)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t i = 0; i < L; ++i) {
        const int64_t g = got[(nh * R + r) * L + i], w = want[(nh * R + r) * L + i];
        ASSERT_GE(g, 0);
        ASSERT_LT(g, std::max<int64_t>(1, 2 * B2));
        if (g == w) continue;
        // Only a near-tie may differ: the chosen value within float32 rounding of the max.
        auto value = [&](int64_t b) {
          double p = 0;
          const int64_t col = b % B2;
          for (int64_t e = 0; e < E; ++e)
            p += x.ref[(nh * L + i) * E + e] * rot.ref[(r * E + e) * B2 + col];
          return b < B2 ? p : -p;
        };
        EXPECT_NEAR(value(g), value(w), 1e-4) << "bucket " << g << " vs the reference's " << w;
        ++mismatches;
      }
  EXPECT_LE(mismatches, 2) << "more near-ties than expected";
}

TEST(ReformerCudaEmu, LshHashMatchesCpu) {
  check_hash<float>(2, 3, 17, 16, 3, 4, 1);
  check_hash<float>(1, 1, 33, 24, 2, 40, 2);  // B2 > 32: several columns per lane
  check_hash<float>(1, 2, 5, 7, 1, 1, 3);
  check_hash<__half>(1, 2, 19, 16, 2, 8, 4);
  check_hash<__nv_bfloat16>(2, 1, 17, 24, 2, 33, 5);
}

// Small integer inputs: exact projections with many ties (equal columns,
// p[imax] == -p[imin], zero rows), which must follow the reference's rule
// exactly.
template <typename T>
void check_hash_ties(int64_t B2, int seed) {
  SCOPED_TRACE("ties B2=" + std::to_string(B2));
  const int64_t N = 1, H = 2, L = 23, E = 5, R = 3;
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> d(-1, 1);
  std::vector<T> x(N * H * L * E), rot(R * E * B2);
  std::vector<double> xr(x.size()), rr(rot.size());
  for (size_t i = 0; i < x.size(); ++i)
    xr[i] = i % 7 == 0 ? 0 : d(gen), x[i] = from_float<T>(xr[i]);
  for (size_t i = 0; i < rot.size(); ++i) rr[i] = d(gen), rot[i] = from_float<T>(rr[i]);
  std::vector<int64_t> got(N * H * R * L, -1), want(N * H * R * L, -2);
  fastattn::cuda::LshHashCudaArgs a;
  a.x = x.data();
  a.rotations = rot.data();
  a.buckets = got.data();
  a.N = N, a.H = H, a.L = L, a.E = E, a.R = R, a.B2 = B2;
  a.dtype = dtype_of<T>();
  fastattn::cuda::lsh_hash_cuda(a, nullptr);
  k::LshHashArgs<double> c;
  c.x = xr.data();
  c.rotations = rr.data();
  c.buckets = want.data();
  c.N = N, c.H = H, c.L = L, c.E = E, c.R = R, c.B2 = B2;
  k::lsh_hash_reference(c);
  EXPECT_EQ(got, want);
}

TEST(ReformerCudaEmu, LshHashTiesAsCpu) {
  check_hash_ties<float>(3, 1);
  check_hash_ties<float>(37, 2);
  check_hash_ties<__half>(4, 3);
  check_hash_ties<__nv_bfloat16>(2, 4);
}

TEST(ReformerCudaEmu, LshHashOneBucket) {
  std::vector<float> x(2 * 3 * 4, 1.f);
  std::vector<int64_t> got(2 * 5 * 3, -1);
  fastattn::cuda::LshHashCudaArgs a;
  a.x = x.data();
  a.rotations = nullptr;
  a.buckets = got.data();
  a.N = 2, a.H = 1, a.L = 3, a.E = 4, a.R = 5, a.B2 = 0;
  fastattn::cuda::lsh_hash_cuda(a, nullptr);
  for (int64_t b : got) EXPECT_EQ(b, 0);
}

// ---- attention ----------------------------------------------------------------

struct Case {
  int64_t N, H, L, E, M, R, chunk, n_buckets;
  std::vector<int64_t> lengths;  // empty: none
  bool causal, mask_self;
};

std::string describe(const Case& c) {
  std::string s = "N=" + std::to_string(c.N) + " H=" + std::to_string(c.H) +
                  " L=" + std::to_string(c.L) + " E=" + std::to_string(c.E) +
                  " M=" + std::to_string(c.M) + " R=" + std::to_string(c.R) +
                  " chunk=" + std::to_string(c.chunk) + " buckets=" + std::to_string(c.n_buckets) +
                  (c.causal ? " causal" : "") + (c.mask_self ? " mask_self" : "") + " lengths=";
  for (auto l : c.lengths) s += std::to_string(l) + ",";
  return s;
}

// The op layer's permutation: per (n, h, r), positions [0, len) stably
// sorted by bucket, then the padded positions (unused).
std::vector<int64_t> make_perm(const Case& c, const std::vector<int64_t>& buckets) {
  std::vector<int64_t> perm(c.N * c.H * c.R * c.L);
  for (int64_t nh = 0; nh < c.N * c.H; ++nh) {
    const int64_t len = c.lengths.empty() ? c.L : c.lengths[nh / c.H];
    for (int64_t r = 0; r < c.R; ++r) {
      int64_t* p = perm.data() + (nh * c.R + r) * c.L;
      const int64_t* b = buckets.data() + (nh * c.R + r) * c.L;
      for (int64_t i = 0; i < c.L; ++i) p[i] = i;
      std::stable_sort(p, p + len, [&](int64_t x, int64_t y) { return b[x] < b[y]; });
    }
  }
  return perm;
}

template <typename T>
void check_attention(const Case& c, int seed) {
  SCOPED_TRACE(describe(c));
  std::mt19937 gen(seed);
  const int64_t NH = c.N * c.H;
  auto q = random_data<T>(NH * c.L * c.E, gen);
  auto v = random_data<T>(NH * c.L * c.M, gen);
  auto go = random_data<T>(NH * c.L * c.M, gen);
  std::vector<int64_t> buckets(NH * c.R * c.L);
  std::uniform_int_distribution<int64_t> bd(0, c.n_buckets - 1);
  for (auto& b : buckets) b = bd(gen);
  const auto perm = make_perm(c, buckets);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.E)) * 1.5;

  // The float64 reference.
  std::vector<double> out_ref(NH * c.L * c.M), stats_ref(NH * c.L * 2);
  auto fill_cpu = [&](k::ReformerParams<double>& p) {
    p.q = q.ref.data();
    p.v = v.ref.data();
    p.buckets = buckets.data();
    p.lengths = c.lengths.empty() ? nullptr : c.lengths.data();
    p.N = c.N, p.H = c.H, p.L = c.L, p.E = c.E, p.M = c.M, p.R = c.R;
    p.n_buckets = c.n_buckets;
    p.chunk = c.chunk;
    p.causal = c.causal;
    p.mask_self = c.mask_self;
    p.scale = static_cast<float>(scale);
  };
  k::ReformerForwardArgs<double> f;
  fill_cpu(f);
  f.out = out_ref.data();
  f.stats = stats_ref.data();
  k::reformer_forward_reference(f);

  // Emulated CUDA.
  auto fill_cuda = [&](fastattn::cuda::ReformerCudaParams& p) {
    p.q = q.dev.data();
    p.v = v.dev.data();
    p.perm = perm.data();
    p.lengths = c.lengths.empty() ? nullptr : c.lengths.data();
    p.N = c.N, p.H = c.H, p.L = c.L, p.E = c.E, p.M = c.M, p.R = c.R;
    p.chunk = c.chunk;
    p.causal = c.causal;
    p.mask_self = c.mask_self;
    p.scale = static_cast<float>(scale);
    p.dtype = dtype_of<T>();
  };
  std::vector<T> out(NH * c.L * c.M, from_float<T>(123.f));
  std::vector<double> stats(NH * c.L * 2, 99.0);
  std::vector<float> ws(NH * c.L * c.M, 77.f);
  fastattn::cuda::ReformerForwardCudaArgs a;
  fill_cuda(a);
  a.out = out.data();
  a.stats = stats.data();
  a.workspace = ws.data();
  fastattn::cuda::reformer_forward_cuda(a, nullptr);
  expect_close<T>(as_double(out), out_ref, "out");
  std::vector<double> st0(NH * c.L), st1(NH * c.L), st0_ref(NH * c.L), st1_ref(NH * c.L);
  for (int64_t i = 0; i < NH * c.L; ++i) {
    st0[i] = stats[2 * i], st1[i] = stats[2 * i + 1];
    st0_ref[i] = stats_ref[2 * i], st1_ref[i] = stats_ref[2 * i + 1];
  }
  // float16/bfloat16 run on tensor cores with the normalised keys rounded to T.
  expect_close<T>(st0, st0_ref, "stats max");
  expect_close<T>(st1, st1_ref, "stats log sum");

  // Backward: the reference with its own out/stats, CUDA with the emulated forward's.
  std::vector<double> delta_ref(NH * c.L), gq_ref(NH * c.L * c.E), gv_ref(NH * c.L * c.M);
  std::vector<float> delta(NH * c.L);
  for (int64_t i = 0; i < NH * c.L; ++i) {
    double s = 0, sd = 0;
    for (int64_t d = 0; d < c.M; ++d) {
      s += go.ref[i * c.M + d] * out_ref[i * c.M + d];
      sd += go.ref[i * c.M + d] * to_float(out[i * c.M + d]);
    }
    delta_ref[i] = s;
    delta[i] = static_cast<float>(sd);
  }
  k::ReformerBackwardArgs<double> b;
  fill_cpu(b);
  b.grad_out = go.ref.data();
  b.stats = stats_ref.data();
  b.delta = delta_ref.data();
  b.grad_q = gq_ref.data();
  b.grad_v = gv_ref.data();
  k::reformer_backward_reference(b);

  std::vector<T> gq(NH * c.L * c.E, from_float<T>(5.f)), gv(NH * c.L * c.M, from_float<T>(5.f));
  std::vector<float> bws(NH * c.L * (2 * c.E + c.M), 3.f);
  fastattn::cuda::ReformerBackwardCudaArgs g;
  fill_cuda(g);
  g.grad_out = go.dev.data();
  g.stats = stats.data();
  g.delta = delta.data();
  g.grad_q = gq.data();
  g.grad_v = gv.data();
  g.workspace = bws.data();
  fastattn::cuda::reformer_backward_cuda(g, nullptr);
  expect_close<T>(as_double(gq), gq_ref, "grad_q");
  expect_close<T>(as_double(gv), gv_ref, "grad_v");
}

template <typename T>
void run_cases() {
  const std::vector<Case> cases = {
      {1, 1, 17, 16, 24, 2, 4, 4, {}, false, true},
      {2, 1, 33, 24, 16, 3, 8, 3, {33, 20}, true, true},
      {1, 2, 40, 64, 64, 1, 32, 2, {}, true, false},    // two query tiles, two key tiles
      {2, 1, 5, 16, 16, 2, 2, 2, {0, 5}, false, true},  // an empty sequence
      {1, 1, 1, 16, 8, 2, 4, 1, {}, false, true},       // L = 1: only the masked self
      {1, 1, 20, 16, 16, 2, 50, 3, {}, false, false},   // chunk > L
      {1, 1, 9, 16, 16, 2, 1, 3, {7}, true, true},      // chunk 1
      {1, 1, 9, 16, 0, 2, 4, 2, {}, false, true},       // M = 0
      {1, 1, 18, 256, 24, 1, 8, 2, {}, true, true},     // the largest E
  };
  int seed = 10;
  for (const auto& c : cases) check_attention<T>(c, seed++);
}

TEST(ReformerCudaEmu, HeadDimensionLimitIsAnError) {
  fastattn::cuda::ReformerForwardCudaArgs a;
  a.N = a.H = a.L = a.R = 1;
  a.E = fastattn::cuda::kReformerCudaMaxHeadDim + 1;
  a.M = 8;
  EXPECT_THROW(fastattn::cuda::reformer_forward_cuda(a, nullptr), std::runtime_error);
  fastattn::cuda::ReformerBackwardCudaArgs b;
  b.N = b.H = b.L = b.R = 1;
  b.E = 8;
  b.M = fastattn::cuda::kReformerCudaMaxHeadDim + 1;
  EXPECT_THROW(fastattn::cuda::reformer_backward_cuda(b, nullptr), std::runtime_error);
}

TEST(ReformerCudaEmu, AttentionFloat32) { run_cases<float>(); }
TEST(ReformerCudaEmu, AttentionFloat16) { run_cases<__half>(); }
TEST(ReformerCudaEmu, AttentionBFloat16) { run_cases<__nv_bfloat16>(); }
// Before sm_80 bfloat16 takes the SIMT kernels; float16 keeps its tensor cores.
TEST(ReformerCudaEmu, AttentionBFloat16Sm75) {
  const fastattn::cuda::emu::ScopedArchitecture sm75(75, 75);
  run_cases<__nv_bfloat16>();
}

}  // namespace
