// K-means in Hamming space over hash codes (clustered attention, Vyas et al.
// 2020, sec. 3.2.2), one independent clustering per (n, h).
//
//  - Valid queries are l < lengths[n] (all L without lengths). Padded queries
//    are never assigned (assignment -1) and never counted.
//  - Clusters are clamped per batch element: C_eff = min(C, valid queries).
//    Clusters c >= C_eff stay empty (count 0, no query assigned).
//  - Initialisation (deterministic in `seed`): farthest-first seeding in
//    Hamming distance over the valid queries: the first centroid is a uniform
//    valid query, each next the unchosen query farthest from its nearest
//    centroid so far (uniform among ties). The C_eff initial centroids are
//    distinct queries. Farthest-first covers the codes (it is a
//    2-approximation of the k-center radius, the quantity that bounds the
//    attention error in Proposition 1), and it finds one seed in each of
//    well-separated groups, where random or k-means++ seeding often puts two
//    seeds in one group and none in another, which Lloyd does not repair.
//  - Lloyd iterations: assign each valid query to its nearest centroid by
//    popcount(code ^ centroid), lowest cluster index on ties; re-seed empty
//    clusters; centroid bit = majority of its members' bits (a tie gives 0).
//    `iterations` counts centroid updates; the returned assignment is the one
//    after the last update. Stops early at a fixed point.
//  - Empty clusters after an assignment are re-seeded, in increasing index,
//    with the valid query farthest from its own centroid among the clusters
//    that have >= 2 members (lowest query index on ties); that query moves to
//    the empty cluster and its code becomes the centroid. Since C_eff <= valid
//    queries, every cluster c < C_eff ends with >= 1 member.
//
// Cost per (n, h): O(L·C_eff) per assignment (8 byte-table rows of C_eff
// bytes per query from 1024 valid queries on, popcounts below), O(L) per
// centroid update (64 byte counters per cluster), O(L·C_eff) popcounts for
// the seeding.
// Memory O(L + 64·C) per thread. Parallel over N·H. Tested by tests/cpp/test_clustering.cpp
// (ClusterCodes.*).
#pragma once

#include <cstdint>

namespace fastattn::kernels {

// The arguments of both backends: the CPU kernel below and the CUDA launcher
// (cluster_codes_cuda.h).
struct ClusterParams {
  const int64_t* codes = nullptr;    // (N, H, L) contiguous, bit patterns of uint64 codes
  const int64_t* lengths = nullptr;  // (N,) valid queries per batch element in [0, L], or nullptr
  int64_t* assignments = nullptr;    // (N, H, L), written: cluster in [0, C_eff) or -1 (padding)
  int64_t* counts = nullptr;         // (N, H, C), written: members per cluster
  int64_t N = 0, H = 0, L = 0, C = 0;
  int64_t iterations = 0;  // centroid updates (Lloyd iterations), >= 0
  uint64_t seed = 0;       // initialisation; the same seed gives the same result
  int num_threads = 1;     // CPU
  // CUDA: cluster_codes_cuda_workspace_bytes(N, H, L, C) bytes (no
  // initialisation needed).
  void* workspace = nullptr;
};

void cluster_codes_cpu(const ClusterParams& p);

}  // namespace fastattn::kernels
