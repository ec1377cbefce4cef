// cluster_codes_cuda (src/kernels/clustering/cluster_codes_cuda.cu) under the
// emulator: assignments and counts identical to the plain reference
// (clustering_reference.h) for the same seed. Covers random codes and codes drawn around a few
// prototypes, duplicated codes (fewer distinct codes than clusters: ties in the seeding and
// re-seeded empty clusters), lengths (0, 1, fewer valid queries than clusters, none), iterations 0,
// 1, 3, 20, C = 1 and C = 185 (cluster state in the workspace instead of shared memory), L = 1100
// (the CPU kernel's byte-table path), several assignment tiles with lengths.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "emu_test_util.h"
#include "kernels/clustering/cluster_codes_cuda.h"
#include "kernels/clustering/clustering_reference.h"

namespace {

enum class Codes { kRandom, kPrototypes, kFewDistinct };

void check_cluster(int64_t N, int64_t H, int64_t L, int64_t C, int64_t iterations,
                   std::vector<int64_t> lengths, Codes kind, uint64_t seed) {
  SCOPED_TRACE("N " + std::to_string(N) + " H " + std::to_string(H) + " L " + std::to_string(L) +
               " C " + std::to_string(C) + " it " + std::to_string(iterations) + " kind " +
               std::to_string(static_cast<int>(kind)) + " seed " + std::to_string(seed));
  std::mt19937_64 rng(seed * 7 + 3);
  std::vector<int64_t> codes(N * H * L);
  std::vector<uint64_t> protos(6);
  for (auto& p : protos) p = rng();
  for (auto& c : codes) {
    uint64_t x = rng();
    if (kind == Codes::kPrototypes) {
      x = protos[rng() % protos.size()];
      for (int f = 0; f < 4; ++f) x ^= 1ull << (rng() % 64);
    } else if (kind == Codes::kFewDistinct) {
      x = protos[rng() % 3];
    }
    c = static_cast<int64_t>(x);
  }
  const int64_t* len = lengths.empty() ? nullptr : lengths.data();
  std::vector<int64_t> a_gpu(N * H * L, 99), c_gpu(N * H * C, 99), a_cpu(N * H * L),
      c_cpu(N * H * C);
  std::vector<unsigned char> ws(fastattn::cuda::cluster_codes_cuda_workspace_bytes(N, H, L, C),
                                0xab);
  fastattn::cuda::ClusterCodesCudaArgs g;
  g.codes = codes.data();
  g.lengths = len;
  g.assignments = a_gpu.data();
  g.counts = c_gpu.data();
  g.workspace = ws.data();
  g.N = N;
  g.H = H;
  g.L = L;
  g.C = C;
  g.iterations = iterations;
  g.seed = seed;
  fastattn::cuda::cluster_codes_cuda(g, nullptr);
  fastattn::kernels::ClusterParams p;
  p.codes = codes.data();
  p.lengths = len;
  p.assignments = a_cpu.data();
  p.counts = c_cpu.data();
  p.N = N;
  p.H = H;
  p.L = L;
  p.C = C;
  p.iterations = iterations;
  p.seed = seed;
  fastattn::kernels::cluster_codes_reference(p);
  EXPECT_EQ(a_gpu, a_cpu);
  EXPECT_EQ(c_gpu, c_cpu);
}

TEST(ClusteredEmuClusterCodes, MatchesCpuRandomAndPrototypes) {
  check_cluster(1, 2, 37, 5, 3, {}, Codes::kRandom, 1);
  check_cluster(2, 1, 70, 8, 20, {}, Codes::kPrototypes, 2);
  check_cluster(1, 1, 33, 1, 3, {}, Codes::kPrototypes, 3);
  check_cluster(1, 1, 17, 4, 0, {}, Codes::kRandom, 4);
  check_cluster(1, 1, 17, 4, 1, {}, Codes::kPrototypes, 5);
}

TEST(ClusteredEmuClusterCodes, LengthsAndDuplicates) {
  // Lengths: 0 (nothing valid), 1, fewer valid queries than clusters, all.
  check_cluster(4, 2, 40, 6, 5, {0, 1, 4, 40}, Codes::kPrototypes, 6);
  // Three distinct codes for 7 clusters: seeding ties, re-seeded empty clusters.
  check_cluster(2, 1, 50, 7, 5, {50, 23}, Codes::kFewDistinct, 7);
  check_cluster(1, 1, 9, 9, 4, {}, Codes::kFewDistinct, 8);
}

TEST(ClusteredEmuClusterCodes, ManyClustersStateInWorkspace) {
  check_cluster(1, 1, 200, 185, 1, {}, Codes::kRandom, 9);
}

TEST(ClusteredEmuClusterCodes, SeveralAssignmentTilesWithLengths) {
  // Three tiles of 1024 queries, 1024-thread seeding and update blocks.
  check_cluster(2, 1, 2100, 6, 3, {2100, 1500}, Codes::kPrototypes, 11);
}

TEST(ClusteredEmuClusterCodes, SeedingTenQueriesPerThread) {
  // 1024-thread seeding with 10 and 9 queries per thread (thread-major in the
  // workspace), few distinct codes: ties in the farthest-first picks.
  check_cluster(2, 1, 10000, 9, 1, {10000, 8500}, Codes::kFewDistinct, 12);
}

TEST(ClusteredEmuClusterCodes, LongSequenceTablePath) {
  check_cluster(1, 1, 1100, 12, 4, {}, Codes::kPrototypes, 10);
}

}  // namespace
