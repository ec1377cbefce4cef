// The CPU kernels at every instruction-set level this CPU supports against
// their plain references (scalar float64 loops over the same argument
// struct, src/kernels/<kernel>/<kernel>_reference.h; the CUDA emulator tests
// use the same references): token gather exactly in float64 and float32 (a
// copy; sums in the reference's order), hashing bit for bit wherever a
// projection is not within rounding of 0, contiguous and strided rows, one
// and three threads.
//   build/fastattn_tests --gtest_filter='KernelReference.*'
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "kernels/common/cpu_isa.h"
#include "kernels/hashing/hashing.h"
#include "kernels/hashing/hashing_reference.h"
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

}  // namespace
}  // namespace fastattn
