// The fused full-attention CUDA kernels (src/kernels/full/full_attention_*_cuda.cu)
// run by the emulator against the plain reference (full_attention_reference.h)
// in float64, per dtype, on the same rounded inputs: forward (out, lse) and backward (dQ, dK, dV),
// with additive masks (full and broadcast, -inf entries, fully masked rows), key lengths (including
// 0), causal with L < S and L > S (rows without keys), grad_lse folded into delta, accumulate, head
// dims 8..128 (padded to 16 on the tensor-core path) with E != M, lengths not multiples of the
// tiles.
//
// Tolerance: |got - ref| <= atol·max(1, max|ref|) + rtol·|ref| with
// (atol, rtol) = float32 (2e-5, 2e-4), float16 (2e-3, 4e-3),
// bfloat16 (1.6e-2, 3e-2): half types round P and dS before the tensor-core
// products and the outputs on store.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/common/cuda_compat.cuh"
#include "kernels/full/full_attention_reference.h"
#include "kernels/full/full_attention_cuda.h"

namespace {

using fastattn::cuda::DType;
using fastattn::cuda::from_float;
using fastattn::cuda::to_float;

constexpr double kInf = std::numeric_limits<double>::infinity();

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

template <typename T>
void tolerance(double& atol, double& rtol) {
  if (dtype_of<T>() == DType::kFloat32) {
    atol = 2e-5, rtol = 2e-4;
  } else if (dtype_of<T>() == DType::kFloat16) {
    atol = 2e-3, rtol = 4e-3;
  } else {
    atol = 1.6e-2, rtol = 3e-2;
  }
}

enum class MaskKind { kNone, kFull, kBroadcast };

struct Case {
  int64_t N, H, L, S, E, M;
  bool causal = false;
  MaskKind mask = MaskKind::kNone;
  bool lengths = false;
  bool grad_lse = false;
  bool accumulate = false;
  bool misaligned = false;
  double scale = 0.0;  // 0: 1/sqrt(E)
};

std::string describe(const Case& c) {
  return "N=" + std::to_string(c.N) + " H=" + std::to_string(c.H) + " L=" + std::to_string(c.L) +
         " S=" + std::to_string(c.S) + " E=" + std::to_string(c.E) + " M=" + std::to_string(c.M) +
         (c.causal ? " causal" : "") +
         (c.mask == MaskKind::kFull        ? " mask"
          : c.mask == MaskKind::kBroadcast ? " mask(L,S)"
                                           : "") +
         (c.lengths ? " key_lengths" : "") + (c.grad_lse ? " grad_lse" : "") +
         (c.accumulate ? " accumulate" : "") + (c.misaligned ? " misaligned" : "");
}

// Values rounded through T, as doubles.
template <typename T>
std::vector<double> random_values(size_t n, std::mt19937& rng, double scale) {
  std::normal_distribution<double> d(0.0, scale);
  std::vector<double> x(n);
  for (auto& v : x) v = to_float(from_float<T>(static_cast<float>(d(rng))));
  return x;
}

template <typename T>
std::vector<T> to_storage(const std::vector<double>& x) {
  std::vector<T> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = from_float<T>(static_cast<float>(x[i]));
  return y;
}

template <typename T>
void expect_close(const std::vector<T>& got, const std::vector<double>& ref,
                  const std::string& what) {
  double atol, rtol;
  tolerance<T>(atol, rtol);
  double maxref = 1.0;
  for (double r : ref) maxref = std::max(maxref, std::abs(r));
  ASSERT_EQ(got.size(), ref.size()) << what;
  int bad = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double g = to_float(got[i]);
    const double err = std::abs(g - ref[i]);
    if (!(err <= atol * maxref + rtol * std::abs(ref[i]))) {
      if (++bad <= 5) {
        ADD_FAILURE() << what << ": element " << i << " is " << g
                      << ", the float64 reference gives " << ref[i];
      }
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << ref.size() << " elements out of tolerance";
}

template <typename T>
void run_case(const Case& c, unsigned seed) {
  SCOPED_TRACE(describe(c));
  std::mt19937 rng(seed);
  const int64_t N = c.N, H = c.H, L = c.L, S = c.S, E = c.E, M = c.M;
  const double scale = c.scale > 0 ? c.scale : 1.0 / std::sqrt(static_cast<double>(E));
  const auto q = random_values<T>(N * H * L * E, rng, 1.0);
  const auto k = random_values<T>(N * H * S * E, rng, 1.0);
  const auto v = random_values<T>(N * H * S * M, rng, 1.0);
  const auto go = random_values<T>(N * H * L * M, rng, 1.0);

  // Mask (additive, -inf = dropped) and its strides.
  std::vector<double> mask;
  int64_t msn = 0, msh = 0, msl = 0;
  if (c.mask != MaskKind::kNone) {
    const int64_t rows = c.mask == MaskKind::kFull ? N * H * L : L;
    mask = random_values<T>(rows * S, rng, 0.5);
    std::uniform_real_distribution<double> u(0.0, 1.0);
    for (auto& x : mask)
      if (u(rng) < 0.15) x = -kInf;
    for (int64_t s = 0; s < S; ++s) mask[s] = -kInf;  // a fully masked row
    if (c.mask == MaskKind::kFull) {
      msn = H * L * S, msh = L * S, msl = S;
    } else {
      msl = S;
    }
  }
  std::vector<int64_t> lengths;
  if (c.lengths) {
    for (int64_t n = 0; n < N; ++n) {
      lengths.push_back(n % 3 == 0 ? S : n % 3 == 1 ? 0 : std::min<int64_t>(S, S / 2 + 1));
    }
  }

  // Reference forward (float64, the plain reference).
  std::vector<double> out_ref(N * H * L * M), lse_ref(N * H * L);
  {
    fastattn::kernels::FullAttentionForwardArgs<double> a;
    a.q = q.data(), a.k = k.data(), a.v = v.data();
    if (!mask.empty()) a.mask = mask.data(), a.mask_sn = msn, a.mask_sh = msh, a.mask_sl = msl;
    if (!lengths.empty()) a.key_lengths = lengths.data();
    a.N = N, a.H = H, a.L = L, a.S = S, a.E = E, a.M = M;
    a.causal = c.causal;
    a.scale = scale;
    a.out = out_ref.data();
    a.lse = lse_ref.data();
    fastattn::kernels::full_attention_forward_reference(a);
  }

  // CUDA forward.
  // misaligned: q, k, v one element into their buffers (no 16-byte vector loads).
  const size_t shift = c.misaligned ? 1 : 0;
  auto qt = to_storage<T>(q), kt = to_storage<T>(k), vt = to_storage<T>(v);
  qt.insert(qt.begin(), shift, from_float<T>(0.f));
  kt.insert(kt.begin(), shift, from_float<T>(0.f));
  vt.insert(vt.begin(), shift, from_float<T>(0.f));
  const auto mt = to_storage<T>(mask), got = to_storage<T>(go);
  std::vector<T> out(N * H * L * M, from_float<T>(123.f));
  std::vector<float> lse(N * H * L, 123.f);
  fastattn::cuda::FullAttentionCudaParams p;
  p.q = qt.data() + shift, p.k = kt.data() + shift, p.v = vt.data() + shift;
  if (!mask.empty()) p.mask = mt.data(), p.mask_sn = msn, p.mask_sh = msh, p.mask_sl = msl;
  if (!lengths.empty()) p.key_lengths = lengths.data();
  p.N = N, p.H = H, p.L = L, p.S = S, p.E = E, p.M = M;
  p.causal = c.causal;
  p.scale = static_cast<float>(scale);
  p.dtype = dtype_of<T>();
  {
    fastattn::cuda::FullAttentionForwardCudaArgs a;
    static_cast<fastattn::cuda::FullAttentionCudaParams&>(a) = p;
    a.out = out.data();
    a.lse = lse.data();
    fastattn::cuda::full_attention_forward_cuda(a, nullptr);
  }
  expect_close(out, out_ref, "out");
  {
    double atol, rtol;
    tolerance<T>(atol, rtol);
    int empty_rows = 0;
    for (size_t i = 0; i < lse_ref.size(); ++i) {
      if (lse_ref[i] == -kInf) {
        ++empty_rows;
        EXPECT_EQ(lse[i], -INFINITY) << "lse row " << i;
      } else {
        EXPECT_NEAR(lse[i], lse_ref[i], 4 * atol + rtol * std::abs(lse_ref[i])) << "lse row " << i;
      }
    }
    if (c.mask != MaskKind::kNone || (c.lengths && N > 1)) {
      EXPECT_GT(empty_rows, 0) << "the case should have rows without keys";
    }
  }

  // Backward: delta = rowsum(grad_out ∘ out) - grad_lse from the reference.
  std::vector<double> delta(N * H * L);
  std::vector<double> glse =
      c.grad_lse ? random_values<T>(N * H * L, rng, 1.0) : std::vector<double>(N * H * L, 0.0);
  for (int64_t r = 0; r < N * H * L; ++r) {
    double d = 0;
    for (int64_t m = 0; m < M; ++m) d += go[r * M + m] * out_ref[r * M + m];
    delta[r] = d - glse[r];
  }
  std::vector<double> gq_ref(N * H * L * E, 0.0), gk_ref(N * H * S * E, 0.0),
      gv_ref(N * H * S * M, 0.0);
  if (c.accumulate) {
    gq_ref = random_values<T>(gq_ref.size(), rng, 1.0);
    gk_ref = random_values<T>(gk_ref.size(), rng, 1.0);
    gv_ref = random_values<T>(gv_ref.size(), rng, 1.0);
  }
  auto gq = to_storage<T>(gq_ref), gk = to_storage<T>(gk_ref), gv = to_storage<T>(gv_ref);
  if (!c.accumulate) {  // must be overwritten
    std::fill(gq.begin(), gq.end(), from_float<T>(77.f));
    std::fill(gk.begin(), gk.end(), from_float<T>(77.f));
    std::fill(gv.begin(), gv.end(), from_float<T>(77.f));
  }
  {
    fastattn::kernels::FullAttentionBackwardArgs<double> a;
    a.q = q.data(), a.k = k.data(), a.v = v.data();
    if (!mask.empty()) a.mask = mask.data(), a.mask_sn = msn, a.mask_sh = msh, a.mask_sl = msl;
    if (!lengths.empty()) a.key_lengths = lengths.data();
    a.N = N, a.H = H, a.L = L, a.S = S, a.E = E, a.M = M;
    a.causal = c.causal;
    a.scale = scale;
    a.grad_out = go.data();
    a.lse = lse_ref.data();
    a.delta = delta.data();
    a.grad_q = gq_ref.data(), a.grad_k = gk_ref.data(), a.grad_v = gv_ref.data();
    a.accumulate = c.accumulate;
    fastattn::kernels::full_attention_backward_reference(a);
  }
  {
    std::vector<float> lse32(lse_ref.begin(), lse_ref.end()), delta32(delta.begin(), delta.end());
    std::vector<float> ws(N * H * L * E, 55.f);
    fastattn::cuda::FullAttentionBackwardCudaArgs a;
    static_cast<fastattn::cuda::FullAttentionCudaParams&>(a) = p;
    a.grad_out = got.data();
    a.lse = lse32.data();
    a.delta = delta32.data();
    a.grad_q = gq.data(), a.grad_k = gk.data(), a.grad_v = gv.data();
    a.dq_workspace = ws.data();
    a.accumulate = c.accumulate;
    fastattn::cuda::full_attention_backward_cuda(a, nullptr);
  }
  expect_close(gq, gq_ref, "grad_q");
  expect_close(gk, gk_ref, "grad_k");
  expect_close(gv, gv_ref, "grad_v");
}

template <typename T>
class FullAttentionCudaEmu : public ::testing::Test {};
using Dtypes = ::testing::Types<float, __half, __nv_bfloat16>;
TYPED_TEST_SUITE(FullAttentionCudaEmu, Dtypes);

TYPED_TEST(FullAttentionCudaEmu, PlainAwkwardSizes) {
  run_case<TypeParam>({1, 2, 17, 33, 16, 16}, 1);
  run_case<TypeParam>({2, 1, 1, 17, 24, 40}, 2);   // one query, E != M, not multiples of 16
  run_case<TypeParam>({1, 1, 70, 1, 8, 8}, 3);     // one key
  run_case<TypeParam>({1, 1, 65, 97, 64, 64}, 4);  // more than one tile each way
}

TYPED_TEST(FullAttentionCudaEmu, UnvectorisableLoads) {
  run_case<TypeParam>({1, 2, 20, 37, 12, 20}, 16);  // dims not multiples of 8
  Case c{1, 1, 40, 50, 32, 16};
  c.misaligned = true;
  run_case<TypeParam>(c, 17);
}

TYPED_TEST(FullAttentionCudaEmu, LargestHeadDim) {
  run_case<TypeParam>({1, 1, 33, 70, 128, 128}, 5);
  run_case<TypeParam>({1, 1, 20, 40, 128, 40}, 6);
}

TYPED_TEST(FullAttentionCudaEmu, Masks) {
  Case full{2, 2, 19, 37, 16, 24};
  full.mask = MaskKind::kFull;
  run_case<TypeParam>(full, 7);
  Case bcast{2, 2, 40, 70, 32, 16};
  bcast.mask = MaskKind::kBroadcast;
  bcast.scale = 0.7;
  run_case<TypeParam>(bcast, 8);
}

TYPED_TEST(FullAttentionCudaEmu, KeyLengthsAndEmptyRows) {
  Case c{3, 2, 21, 45, 16, 16};
  c.lengths = true;
  run_case<TypeParam>(c, 9);
  c.mask = MaskKind::kFull;
  run_case<TypeParam>(c, 10);
}

TYPED_TEST(FullAttentionCudaEmu, Causal) {
  Case fewer_queries{1, 2, 30, 75, 16, 32};  // L < S: offset 45
  fewer_queries.causal = true;
  run_case<TypeParam>(fewer_queries, 11);
  Case more_queries{1, 1, 80, 35, 32, 16};  // L > S: the first 45 rows see nothing
  more_queries.causal = true;
  run_case<TypeParam>(more_queries, 12);
  Case everything{3, 1, 50, 66, 16, 16};
  everything.causal = true;
  everything.lengths = true;
  everything.mask = MaskKind::kBroadcast;
  run_case<TypeParam>(everything, 13);
}

TYPED_TEST(FullAttentionCudaEmu, GradLseAndAccumulate) {
  Case c{2, 1, 23, 41, 16, 16};
  c.grad_lse = true;
  run_case<TypeParam>(c, 14);
  c.lengths = true;
  c.accumulate = true;
  run_case<TypeParam>(c, 15);
}

// A GPU before sm_80 (or a build whose code for the GPU predates it, as a
// 7.5-only build on an 8.6 device): bfloat16 takes the SIMT kernels with the
// half types' storage, float16 keeps its tensor cores (sm_70 on).
TYPED_TEST(FullAttentionCudaEmu, OlderArchitectures) {
  for (const auto& [device, code] : {std::pair{75, 75}, std::pair{86, 75}}) {
    SCOPED_TRACE("device " + std::to_string(device) + ", code " + std::to_string(code));
    const fastattn::cuda::emu::ScopedArchitecture arch(device, code);
    run_case<TypeParam>({1, 2, 17, 33, 16, 16}, 21);
    run_case<TypeParam>({1, 1, 65, 97, 64, 64}, 22);
    run_case<TypeParam>({1, 1, 33, 70, 128, 128}, 23);
    Case c{3, 1, 50, 66, 16, 24};
    c.causal = true;
    c.lengths = true;
    c.mask = MaskKind::kBroadcast;
    c.grad_lse = true;
    run_case<TypeParam>(c, 24);
    c.accumulate = true;
    run_case<TypeParam>(c, 25);
  }
}

// A build without code for the device: a clear error, not a failed launch.
TEST(FullAttentionCudaEmuArch, NoCodeForTheDevice) {
  const fastattn::cuda::emu::ScopedArchitecture arch(89, 0);
  std::vector<__nv_bfloat16> x(16, from_float<__nv_bfloat16>(0.f));
  std::vector<float> lse(1);
  fastattn::cuda::FullAttentionForwardCudaArgs a;
  a.q = a.k = a.v = x.data();
  a.out = x.data();
  a.lse = lse.data();
  a.N = a.H = a.L = a.S = 1;
  a.E = a.M = 16;
  a.dtype = DType::kBFloat16;
  try {
    fastattn::cuda::full_attention_forward_cuda(a, nullptr);
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("full_attention_forward: this build has no code for the "
                                         "device (compute capability 8.9)"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
