// Hashing (fastattn::hash_queries) against its ATen reference, and Hamming
// K-means (fastattn::cluster_codes): planted clusters, padding, clamping,
// re-seeding, determinism and bad inputs.
//   build/fastattn_tests --gtest_filter='HashQueries.*:ClusterCodes.*'
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <map>
#include <random>
#include <set>

#include "expect_error.h"
#include "fastattn/ops.h"

namespace fastattn {
namespace {

// Bits where the op and the float64 reference disagree must have |x·w + b|
// below `tol` (a sign that rounding may flip).
void expect_codes_match(const torch::Tensor& x, const torch::Tensor& planes, double tol) {
  auto codes = hash_queries(x, planes);
  auto x64 = x.to(torch::kDouble), p64 = planes.to(torch::kDouble);
  auto ref = reference::hash_queries(x64, p64);
  const int64_t E = x.size(3), B = planes.size(0);
  auto proj = torch::matmul(x64, p64.narrow(1, 0, E).t()) + p64.select(1, E);  // (N,H,L,B)
  auto shifts = torch::arange(B, torch::kLong);
  auto bits = codes.unsqueeze(-1).bitwise_right_shift(shifts).bitwise_and(1);
  auto ref_bits = ref.unsqueeze(-1).bitwise_right_shift(shifts).bitwise_and(1);
  auto wrong = bits.ne(ref_bits).logical_and(proj.abs() >= tol);
  EXPECT_EQ(wrong.sum().item<int64_t>(), 0) << "B=" << B << " dtype=" << x.scalar_type();
  // No bit above B is ever set.
  if (B < 64) {
    EXPECT_EQ(codes.bitwise_right_shift(B).abs().sum().item<int64_t>(), 0);
  }
}

TEST(HashQueries, MatchesReference) {
  torch::manual_seed(0);
  // 2·3·97 rows; 257 rows: the kernel's last block of rows has an odd one out.
  for (int64_t rows : {97, 257}) {
    for (int64_t B : {1, 7, 32, 40, 63, 64}) {  // plane groups of 1, 2, 3 and 4 vectors
      for (bool bias : {true, false}) {
        auto x = rows == 97 ? torch::randn({2, 3, 97, 17}, torch::kDouble)
                            : torch::randn({1, 1, 257, 17}, torch::kDouble);
        auto planes = torch::randn({B, 18}, torch::kDouble);
        if (!bias) planes.select(1, 17).zero_();
        // float64: the kernel's fma order differs from matmul's by ~1e-15.
        expect_codes_match(x, planes, 1e-12);
        // float32: inputs and sums of 17 products rounded to float32.
        expect_codes_match(x.to(torch::kFloat), planes.to(torch::kFloat), 1e-4);
      }
    }
  }
}

TEST(HashQueries, SixtyFourBitsUseTheSignBit) {
  torch::manual_seed(1);
  auto x = torch::randn({1, 2, 500, 8});
  auto codes = hash_queries(x, torch::randn({64, 9}));
  const auto negative = codes.lt(0).sum().item<int64_t>();
  EXPECT_GT(negative, 300);  // about half of 1000
  EXPECT_LT(negative, 700);
}

TEST(HashQueries, BiasAloneDecidesForZeroQueries) {
  auto planes = torch::randn({5, 4});
  planes.select(1, 3).copy_(torch::tensor({1.0, -1.0, 2.0, -0.5, 0.25}));
  auto codes = hash_queries(torch::zeros({1, 1, 3, 3}), planes);
  EXPECT_TRUE(codes.eq(0b10101).all().item<bool>()) << codes;
}

TEST(HashQueries, NonContiguousAndEmpty) {
  auto base = torch::randn({1, 40, 2, 8}, torch::kDouble);
  auto x = base.transpose(1, 2);
  auto planes = torch::randn({20, 9}, torch::kDouble);
  EXPECT_TRUE(torch::equal(hash_queries(x, planes), hash_queries(x.contiguous(), planes)));
  EXPECT_EQ(hash_queries(torch::randn({1, 2, 0, 8}), torch::randn({3, 9})).numel(), 0);
}

TEST(HashQueries, ReadsRowLayoutsInPlace) {
  // The layers' (N, L, H, E) buffers viewed as (N, H, L, E), with padded
  // rows, and a head broadcast with stride 0: read in place (the kernel takes
  // row strides), the same codes as the contiguous copy. L odd and more rows
  // than one work item, so row pairs and items cross head boundaries.
  torch::manual_seed(3);
  auto planes = torch::randn({37, 9}, torch::kDouble);
  for (auto dtype : {torch::kDouble, torch::kFloat}) {
    auto padded = torch::randn({2, 301, 3, 11}, dtype).narrow(3, 0, 8).transpose(1, 2);
    auto broadcast = torch::randn({2, 1, 301, 8}, dtype).expand({2, 3, 301, 8});
    for (const auto& x : {padded, broadcast}) {
      ASSERT_FALSE(x.is_contiguous());
      const auto p = planes.to(dtype);
      EXPECT_TRUE(torch::equal(hash_queries(x, p), hash_queries(x.contiguous(), p)));
    }
  }
}

TEST(HashQueries, BadInputsNameTheArgument) {
  auto x = torch::randn({1, 2, 5, 4});
  EXPECT_ERROR_CONTAINS(hash_queries(x[0], torch::randn({3, 5})), "x must have shape");
  EXPECT_ERROR_CONTAINS(hash_queries(x, torch::randn({3, 4})), "planes must have shape", "(B, 5)");
  EXPECT_ERROR_CONTAINS(hash_queries(x, torch::randn({65, 5})), "1 to 64", "65");
  EXPECT_ERROR_CONTAINS(hash_queries(x, torch::randn({3, 5}, torch::kDouble)), "planes must be");
  EXPECT_ERROR_CONTAINS(hash_queries(x.to(torch::kInt), torch::randn({3, 5})),
                        "float32, float64, float16 or bfloat16");
}

// ---- clustering ---------------------------------------------------------------

uint64_t random_code(std::mt19937_64& rng, int bits) {
  return bits == 64 ? rng() : rng() & ((uint64_t(1) << bits) - 1);
}

// G planted centres of `bits` random bits; every query is a centre with up to
// `flips` random bits flipped. Returns codes (N, H, L) and the planted groups.
std::pair<torch::Tensor, torch::Tensor> planted(int64_t N, int64_t H, int64_t L, int G, int bits,
                                                int flips, uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto codes = torch::empty({N, H, L}, torch::kLong);
  auto groups = torch::empty({N, H, L}, torch::kLong);
  auto c = codes.accessor<int64_t, 3>();
  auto g = groups.accessor<int64_t, 3>();
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t h = 0; h < H; ++h) {
      std::vector<uint64_t> centres;
      for (int i = 0; i < G; ++i) centres.push_back(random_code(rng, bits));
      for (int64_t l = 0; l < L; ++l) {
        const int grp = static_cast<int>(rng() % G);
        uint64_t x = centres[grp];
        for (int f = 0; f < flips; ++f) x ^= uint64_t(1) << (rng() % bits);
        c[n][h][l] = static_cast<int64_t>(x);
        g[n][h][l] = grp;
      }
    }
  }
  return {codes, groups};
}

// The assignment partitions the valid queries exactly as the planted groups.
void expect_same_partition(const torch::Tensor& assignments, const torch::Tensor& groups,
                           const torch::Tensor& lengths) {
  auto a = assignments.accessor<int64_t, 3>();
  auto g = groups.accessor<int64_t, 3>();
  for (int64_t n = 0; n < assignments.size(0); ++n) {
    for (int64_t h = 0; h < assignments.size(1); ++h) {
      std::map<int64_t, int64_t> group_to_cluster, cluster_to_group;
      for (int64_t l = 0; l < lengths[n].item<int64_t>(); ++l) {
        auto [it1, new1] = group_to_cluster.emplace(g[n][h][l], a[n][h][l]);
        auto [it2, new2] = cluster_to_group.emplace(a[n][h][l], g[n][h][l]);
        ASSERT_EQ(it1->second, a[n][h][l]) << "group split, n=" << n << " h=" << h << " l=" << l;
        ASSERT_EQ(it2->second, g[n][h][l]) << "groups merged, n=" << n << " h=" << h << " l=" << l;
      }
    }
  }
}

TEST(ClusterCodes, RecoversPlantedClusters) {
  for (int bits : {63, 64, 32}) {
    for (uint64_t seed : {1, 2, 3}) {
      auto [codes, groups] = planted(2, 3, 300, 8, bits, 2, seed * 100 + bits);
      auto lengths = torch::tensor({300, 211}, torch::kLong);
      auto [a, counts] = cluster_codes(codes, lengths, 8, 10, seed);
      SCOPED_TRACE("bits=" + std::to_string(bits) + " seed=" + std::to_string(seed));
      expect_same_partition(a, groups, lengths);
    }
  }
}

// Long sequences (>= 1024 valid queries) take the byte-table assignment.
// At a fixed point (enough iterations) every valid query's cluster is the
// lowest-index nearest centroid, each centroid the majority of its members.
TEST(ClusterCodes, LongSequencesEndAtANearestCentroidFixedPoint) {
  for (int bits : {63, 64}) {
    for (int64_t C : {40, 70}) {
      SCOPED_TRACE("bits=" + std::to_string(bits) + " C=" + std::to_string(C));
      auto [codes, groups] = planted(2, 2, 2500, 60, bits, 4, 17 + bits + C);
      auto lengths = torch::tensor({2500, 1100}, torch::kLong);
      auto [a, counts] = cluster_codes(codes, lengths, C, 100, 5);
      auto ac = a.accessor<int64_t, 3>();
      auto cc = codes.accessor<int64_t, 3>();
      for (int64_t n = 0; n < 2; ++n) {
        for (int64_t h = 0; h < 2; ++h) {
          const int64_t len = lengths[n].item<int64_t>();
          std::vector<std::array<int64_t, 64>> ones(C);
          std::vector<int64_t> members(C, 0);
          for (auto& o : ones) o.fill(0);
          for (int64_t l = 0; l < len; ++l) {
            ASSERT_GE(ac[n][h][l], 0);
            ASSERT_LT(ac[n][h][l], C);
            ++members[ac[n][h][l]];
            for (int b = 0; b < 64; ++b) ones[ac[n][h][l]][b] += (uint64_t(cc[n][h][l]) >> b) & 1;
          }
          std::vector<uint64_t> centre(C, 0);
          for (int64_t c = 0; c < C; ++c) {
            ASSERT_GE(members[c], 1) << "empty cluster " << c;
            for (int b = 0; b < 64; ++b)
              if (2 * ones[c][b] > members[c]) centre[c] |= uint64_t(1) << b;
          }
          for (int64_t l = 0; l < len; ++l) {
            const uint64_t x = cc[n][h][l];
            int64_t best_c = 0;
            for (int64_t c = 1; c < C; ++c) {
              if (__builtin_popcountll(x ^ centre[c]) < __builtin_popcountll(x ^ centre[best_c]))
                best_c = c;
            }
            ASSERT_EQ(ac[n][h][l], best_c) << "n=" << n << " h=" << h << " l=" << l;
          }
        }
      }
    }
  }
}

// Each Lloyd iteration's assignment, not only the last: with `t` iterations
// the result is the lowest-index nearest centroid of every valid query, the
// centroids being the majorities of the clusters after t - 1 iterations (the
// same seed runs the same first t - 1). The kernel compares most queries with
// the centroids that moved since the previous iteration only; a mistake in
// that bookkeeping shows here as a query left with a centroid that is no
// longer its nearest. Exceptions: re-seeded singletons (a cluster left empty
// takes one query), never more than the clusters the plain assignment leaves
// empty. Short (popcount) and long (byte-table) sequences, 16 (many ties),
// 63 and 64 bits.
TEST(ClusterCodes, EveryIterationAssignsTheLowestIndexNearestCentroid) {
  for (int64_t L : {600, 3000}) {
    for (int bits : {16, 63, 64}) {
      SCOPED_TRACE("L=" + std::to_string(L) + " bits=" + std::to_string(bits));
      // Loose groups (a third of the bits flipped): queries near several
      // centroids, which move between them for a few iterations.
      auto [codes, groups] = planted(1, 3, L, 25, bits, bits / 3, 31 + L + bits);
      const int64_t C = 40;
      auto cc = codes.accessor<int64_t, 3>();
      torch::Tensor before = std::get<0>(cluster_codes(codes, std::nullopt, C, 0, 9));
      int64_t moved_total = 0;
      for (int64_t t = 1; t <= 8; ++t) {
        const torch::Tensor after = std::get<0>(cluster_codes(codes, std::nullopt, C, t, 9));
        auto ab = before.accessor<int64_t, 3>();
        auto aa = after.accessor<int64_t, 3>();
        for (int64_t h = 0; h < 3; ++h) {
          std::vector<std::array<int64_t, 64>> ones(C);
          std::vector<int64_t> members(C, 0), got(C, 0);
          for (auto& o : ones) o.fill(0);
          for (int64_t l = 0; l < L; ++l) {
            ++members[ab[0][h][l]];
            ++got[aa[0][h][l]];
            for (int b = 0; b < 64; ++b) ones[ab[0][h][l]][b] += (uint64_t(cc[0][h][l]) >> b) & 1;
          }
          std::vector<uint64_t> centre(C, 0);
          for (int64_t c = 0; c < C; ++c)
            for (int b = 0; b < 64; ++b)
              if (2 * ones[c][b] > members[c]) centre[c] |= uint64_t(1) << b;
          std::vector<int64_t> nearest_count(C, 0);
          int64_t reseeded = 0;
          for (int64_t l = 0; l < L; ++l) {
            const uint64_t x = cc[0][h][l];
            int64_t best_c = 0;
            for (int64_t c = 1; c < C; ++c) {
              if (__builtin_popcountll(x ^ centre[c]) < __builtin_popcountll(x ^ centre[best_c]))
                best_c = c;
            }
            ++nearest_count[best_c];
            moved_total += aa[0][h][l] != ab[0][h][l];
            if (aa[0][h][l] == best_c) continue;
            ASSERT_EQ(got[aa[0][h][l]], 1)
                << "t=" << t << " h=" << h << " l=" << l << ": cluster " << aa[0][h][l]
                << " is not its nearest (" << best_c << ") and not a re-seeded singleton";
            ++reseeded;
          }
          const auto empty = std::count(nearest_count.begin(), nearest_count.end(), 0);
          EXPECT_LE(reseeded, empty) << "t=" << t << " h=" << h;
        }
        before = after;
      }
      EXPECT_GT(moved_total, 0) << "no iteration moved a query: the case tests nothing";
    }
  }
}

TEST(ClusterCodes, PaddingNeverAssignedAndClustersClamped) {
  torch::manual_seed(0);
  const int64_t L = 60, C = 10;
  auto codes = torch::randint(0, 1 << 30, {4, 2, L}, torch::kLong);
  auto lengths = torch::tensor({60, 7, 0, 23}, torch::kInt);
  auto [a, counts] = cluster_codes(codes, lengths, C, 5, 42);
  ASSERT_EQ(a.sizes(), (std::vector<int64_t>{4, 2, L}));
  ASSERT_EQ(counts.sizes(), (std::vector<int64_t>{4, 2, C}));
  for (int64_t n = 0; n < 4; ++n) {
    const int64_t len = lengths[n].item<int64_t>(), ce = std::min(C, len);
    using torch::indexing::Slice;
    auto valid = a.index({n, Slice(), Slice(0, len)});
    auto pad = a.index({n, Slice(), Slice(len, L)});
    EXPECT_TRUE(pad.eq(-1).all().item<bool>()) << "n=" << n;
    if (len > 0) {
      EXPECT_GE(valid.min().item<int64_t>(), 0);
      EXPECT_LT(valid.max().item<int64_t>(), ce);
    }
    // Every cluster below C_eff has members; the rest none; counts match.
    auto cn = counts[n];
    EXPECT_TRUE(cn.index({Slice(), Slice(0, ce)}).ge(1).all().item<bool>()) << "n=" << n;
    EXPECT_TRUE(cn.index({Slice(), Slice(ce, C)}).eq(0).all().item<bool>()) << "n=" << n;
    EXPECT_TRUE(cn.sum(-1).eq(len).all().item<bool>()) << "n=" << n;
    for (int64_t h = 0; h < 2; ++h) {
      auto recount = torch::bincount(valid[h], {}, C);
      if (len > 0) {
        EXPECT_TRUE(torch::equal(recount, cn[h])) << "n=" << n << " h=" << h;
      }
    }
  }
  // Clamped to 7 valid queries: 7 clusters of one member each.
  EXPECT_TRUE(counts.index({1, torch::indexing::Slice(), torch::indexing::Slice(0, 7)})
                  .eq(1)
                  .all()
                  .item<bool>());
}

// A `clusters` beyond the sequence sizes nothing: counts has min(C, L)
// columns and the assignments are those of C = L (no 2^40-column buffer).
TEST(ClusterCodes, HugeClusterCountClampedToTheSequence) {
  torch::manual_seed(1);
  const int64_t L = 9;
  auto codes = torch::randint(0, 1 << 30, {2, 2, L}, torch::kLong);
  auto lengths = torch::tensor({9, 4}, torch::kLong);
  auto [a_huge, c_huge] = cluster_codes(codes, lengths, int64_t(1) << 40, 5, 3);
  auto [a_l, c_l] = cluster_codes(codes, lengths, L, 5, 3);
  EXPECT_EQ(c_huge.sizes(), (std::vector<int64_t>{2, 2, L}));
  EXPECT_TRUE(torch::equal(a_huge, a_l));
  EXPECT_TRUE(torch::equal(c_huge, c_l));
  // Fewer clusters than positions keep their own count.
  EXPECT_EQ(std::get<1>(cluster_codes(codes, lengths, 3, 5, 3)).size(2), 3);
  // L = 0: one (empty) column.
  auto empty = torch::zeros({2, 2, 0}, torch::kLong);
  EXPECT_EQ(std::get<1>(cluster_codes(empty, std::nullopt, int64_t(1) << 40, 5, 3)).size(2), 1);
}

TEST(ClusterCodes, EmptyClustersAreReseeded) {
  // Only 3 distinct codes for 6 clusters: the extra clusters are re-seeded
  // with duplicates, so every cluster still has a member.
  auto codes = torch::tensor({5, 5, 5, 9, 9, 1 << 20, 5, 9}, torch::kLong).view({1, 1, 8});
  for (int64_t iters : {0, 1, 10}) {
    auto [a, counts] = cluster_codes(codes, std::nullopt, 6, iters, 3);
    EXPECT_TRUE(counts.ge(1).all().item<bool>()) << counts;
    EXPECT_EQ(counts.sum().item<int64_t>(), 8);
  }
}

TEST(ClusterCodes, SameSeedSameResultAnyThreadCount) {
  torch::manual_seed(5);
  auto codes = torch::randint(-(int64_t(1) << 62), int64_t(1) << 62, {2, 4, 333}, torch::kLong);
  const int saved = at::get_num_threads();
  at::set_num_threads(1);
  auto [a1, c1] = cluster_codes(codes, std::nullopt, 20, 10, 7);
  at::set_num_threads(2);
  auto [a2, c2] = cluster_codes(codes, std::nullopt, 20, 10, 7);
  auto [a3, c3] = cluster_codes(codes, std::nullopt, 20, 10, 8);
  at::set_num_threads(saved);
  EXPECT_TRUE(torch::equal(a1, a2));
  EXPECT_TRUE(torch::equal(c1, c2));
  EXPECT_FALSE(torch::equal(a1, a3));  // another seed, another initialisation
}

// The vector paths (AVX2: seeding by 8 codes at a time, the table
// assignment's argmin over 16-bit keys, the centroid update's byte counters;
// AVX-512: the update's mask expansion) give exactly the portable level's
// clusters. Codes of three kinds (uniform, few distinct values: ties and
// empty clusters everywhere, planted groups), from below to above the byte
// tables' 1024 queries, with lengths, and up to 300 clusters (two blocks of
// table columns).
TEST(ClusterCodes, EveryCpuLevelGivesTheSameClusters) {
  const auto levels = supported_cpu_capabilities();
  if (levels.size() < 2) GTEST_SKIP() << "only the default level runs here";
  const std::string saved = cpu_capability();
  torch::manual_seed(11);
  const int64_t big = int64_t(1) << 62;
  for (int64_t L : {700, 1500, 4099}) {
    auto uniform = torch::randint(-big, big, {2, 2, L}, torch::kLong);
    auto few = torch::randint(0, 5, {2, 2, L}, torch::kLong);
    auto centres = torch::randint(-big, big, {12}, torch::kLong);
    auto planted =
        centres.index({torch::randint(0, 12, {2, 2, L}, torch::kLong)})
            .bitwise_xor(torch::ones({2, 2, L}, torch::kLong)
                             .bitwise_left_shift(torch::randint(0, 63, {2, 2, L}, torch::kLong)));
    const auto lengths = torch::tensor({L, L / 2 + 1});
    for (const auto& codes : {uniform, few, planted}) {
      for (int64_t C : {1, 7, 100, 300}) {
        for (int64_t iterations : {0, 3, 10}) {
          set_cpu_capability("default");
          auto [a0, c0] = cluster_codes(codes, lengths, C, iterations, 5);
          for (const auto& level : levels) {
            set_cpu_capability(level);
            auto [a, c] = cluster_codes(codes, lengths, C, iterations, 5);
            EXPECT_TRUE(torch::equal(a, a0) && torch::equal(c, c0))
                << level << " L=" << L << " C=" << C << " iterations=" << iterations;
          }
        }
      }
    }
  }
  set_cpu_capability(saved);
}

TEST(ClusterCodes, IterationsLowerTheHammingCost) {
  // Lloyd iterations never increase the within-cluster cost (members to the
  // majority centroid) on random codes.
  torch::manual_seed(9);
  auto codes = torch::randint(0, int64_t(1) << 40, {1, 1, 500}, torch::kLong);
  auto cost = [&](const torch::Tensor& a) {
    int64_t total = 0;
    auto ac = a.accessor<int64_t, 3>();
    auto cc = codes.accessor<int64_t, 3>();
    std::map<int64_t, std::vector<uint64_t>> members;
    for (int64_t l = 0; l < 500; ++l) members[ac[0][0][l]].push_back(uint64_t(cc[0][0][l]));
    for (auto& [c, m] : members) {
      uint64_t centre = 0;
      for (int b = 0; b < 64; ++b) {
        size_t ones = 0;
        for (auto x : m) ones += (x >> b) & 1;
        if (2 * ones > m.size()) centre |= uint64_t(1) << b;
      }
      for (auto x : m) total += __builtin_popcountll(x ^ centre);
    }
    return total;
  };
  auto a0 = std::get<0>(cluster_codes(codes, std::nullopt, 16, 0, 1));
  auto a10 = std::get<0>(cluster_codes(codes, std::nullopt, 16, 10, 1));
  EXPECT_LT(cost(a10), cost(a0));
}

TEST(ClusterCodes, BadInputsNameTheArgument) {
  auto codes = torch::zeros({2, 1, 5}, torch::kLong);
  EXPECT_ERROR_CONTAINS(cluster_codes(codes[0], std::nullopt, 2, 1, 0), "codes must have shape");
  EXPECT_ERROR_CONTAINS(cluster_codes(codes.to(torch::kInt), std::nullopt, 2, 1, 0),
                        "codes must be int64");
  EXPECT_ERROR_CONTAINS(cluster_codes(codes, std::nullopt, 0, 1, 0), "clusters must be >= 1");
  EXPECT_ERROR_CONTAINS(cluster_codes(codes, std::nullopt, 2, -1, 0), "iterations must be in [0, ");
  // Unbounded counts never ended where the majority update cycles.
  EXPECT_ERROR_CONTAINS(cluster_codes(codes, std::nullopt, 2, kMaxClusterIterations + 1, 0),
                        "iterations", "1000");
  EXPECT_ERROR_CONTAINS(cluster_codes(codes, torch::tensor({1, 6}), 2, 1, 0), "lengths must be in",
                        "[0, 5]");
  EXPECT_ERROR_CONTAINS(cluster_codes(codes, torch::tensor({1}), 2, 1, 0),
                        "lengths must have shape");
  EXPECT_ERROR_CONTAINS(cluster_codes(codes, torch::tensor({1.0, 2.0}), 2, 1, 0),
                        "lengths must be an integer tensor");
}

}  // namespace
}  // namespace fastattn
