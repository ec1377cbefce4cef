// The stable top-k selection CUDA kernel (src/kernels/clustered_topk/
// stable_topk_cuda.cu) run by the emulator, against std::stable_sort: the
// first k columns of a stable descending sort, in increasing column order.
// Rows full of ties (small integers, -0 beside +0), -inf entries (dropped
// keys), all-equal and all -inf rows, k = 1 and k = S, S below and above the
// block's 256 columns and its 1024 per compaction step, not multiples of them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/clustered_topk/stable_topk_cuda.h"

namespace {

std::vector<int64_t> reference(const std::vector<float>& s, int64_t rows, int64_t S, int64_t k) {
  std::vector<int64_t> out;
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<int64_t> idx(S);
    std::iota(idx.begin(), idx.end(), 0);
    const float* row = s.data() + r * S;
    std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return row[a] > row[b]; });
    idx.resize(k);
    std::sort(idx.begin(), idx.end());
    out.insert(out.end(), idx.begin(), idx.end());
  }
  return out;
}

void check(int64_t rows, int64_t S, int64_t k, uint32_t seed) {
  SCOPED_TRACE(testing::Message() << "rows " << rows << " S " << S << " k " << k);
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> small(-3, 3);
  std::uniform_real_distribution<float> u01(0.f, 1.f);
  std::vector<float> s(rows * S);
  for (int64_t i = 0; i < rows * S; ++i) {
    const float x = static_cast<float>(small(gen)) * (u01(gen) < 0.5f ? 1.f : 0.25f);
    s[i] = u01(gen) < 0.15f ? -INFINITY : (x == 0.f && u01(gen) < 0.5f ? -0.f : x);
  }
  if (rows > 1) std::fill(s.begin() + S, s.begin() + 2 * S, -INFINITY);  // no kept key
  if (rows > 2) std::fill(s.begin() + 2 * S, s.begin() + 3 * S, 1.5f);   // all equal
  if (rows > 3)  // distinct values: no ties at all
    for (int64_t j = 0; j < S; ++j) s[3 * S + j] = std::sin(static_cast<float>(j) * 1.7f);
  std::vector<int64_t> out(rows * k, -1);
  fastattn::cuda::StableTopkCudaArgs a;
  a.scores = s.data();
  a.out = out.data();
  a.rows = rows;
  a.S = S;
  a.k = k;
  fastattn::cuda::stable_topk_select_cuda(a, nullptr);
  EXPECT_EQ(out, reference(s, rows, S, k));
}

TEST(CudaEmuStableTopk, MatchesAStableSort) {
  uint32_t seed = 1;
  for (int64_t S : {1, 7, 256, 300, 1000, 2500})
    for (int64_t k : {int64_t(1), std::min<int64_t>(S, 32), (S + 1) / 2, S}) check(5, S, k, seed++);
  check(4, 25000, 32, seed++);  // above the 24k columns staged in shared memory
}

}  // namespace
