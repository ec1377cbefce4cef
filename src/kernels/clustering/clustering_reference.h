// The plain reference of the Hamming K-means kernel (clustering.h): the same
// algorithm over the same argument struct, one (n, h) at a time on one
// thread, every assignment a full scan of every centroid by popcount (no byte
// tables, no incremental rescans, no vector code), written in the order the
// header's contract states it. The kernels' seeding draws from the same
// SplitMix64 stream per (n, h), so the result is the same bit for bit.
// tests/cpp/test_kernel_references.cpp holds the CPU kernel at every
// instruction-set level to it, tests/cuda_emu/test_clustering.cpp the CUDA
// kernel.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/clustering/clustering.h"

namespace fastattn::kernels {

namespace clustering_detail {

inline int hamming(uint64_t a, uint64_t b) { return __builtin_popcountll(a ^ b); }

// splitmix64 as the kernels draw it: next() % n for a uniform pick below n.
struct SplitMix64Reference {
  uint64_t state;
  uint64_t below(uint64_t n) {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return (z ^ (z >> 31)) % n;
  }
};

struct Clustering {
  std::vector<uint64_t> centroids;
  std::vector<int64_t> counts;
  std::vector<int> dist;  // of each query to its centroid
};

// Nearest centroid of every valid query (the lowest index on ties), then the
// empty clusters re-seeded in increasing index with the query farthest from
// its centroid among clusters of >= 2 members (the lowest query on ties).
// Returns whether an assignment changed.
inline bool assign(const uint64_t* codes, int64_t Lv, int64_t* a, Clustering& s) {
  const auto Ce = static_cast<int64_t>(s.centroids.size());
  bool changed = false;
  std::fill(s.counts.begin(), s.counts.end(), 0);
  for (int64_t l = 0; l < Lv; ++l) {
    int64_t best = 0;
    for (int64_t c = 1; c < Ce; ++c)
      if (hamming(codes[l], s.centroids[c]) < hamming(codes[l], s.centroids[best])) best = c;
    changed |= a[l] != best;
    a[l] = best;
    s.dist[l] = hamming(codes[l], s.centroids[best]);
    ++s.counts[best];
  }
  for (int64_t c = 0; c < Ce; ++c) {
    if (s.counts[c] > 0) continue;
    int64_t far = -1;
    for (int64_t l = 0; l < Lv; ++l)
      if (s.counts[a[l]] >= 2 && (far < 0 || s.dist[l] > s.dist[far])) far = l;
    --s.counts[a[far]];
    a[far] = c;
    s.counts[c] = 1;
    s.dist[far] = 0;
    s.centroids[c] = codes[far];
    changed = true;
  }
  return changed;
}

}  // namespace clustering_detail

inline void cluster_codes_reference(const ClusterParams& p) {
  using namespace clustering_detail;
  for (int64_t nh = 0; nh < p.N * p.H; ++nh) {
    const int64_t n = nh / p.H;
    const int64_t Lv = p.lengths ? std::clamp<int64_t>(p.lengths[n], 0, p.L) : p.L;
    const int64_t Ce = std::min(p.C, Lv);
    const auto* codes = reinterpret_cast<const uint64_t*>(p.codes + nh * p.L);
    int64_t* a = p.assignments + nh * p.L;
    for (int64_t l = 0; l < p.L; ++l) a[l] = -1;
    for (int64_t c = 0; c < p.C; ++c) p.counts[nh * p.C + c] = 0;
    if (Ce == 0) continue;

    // Farthest-first seeding: a uniform first query, then each time one
    // drawn uniformly among the unchosen queries farthest from their
    // nearest chosen one (chosen queries: distance -1).
    Clustering s{std::vector<uint64_t>(Ce), std::vector<int64_t>(Ce), std::vector<int>(Lv)};
    SplitMix64Reference rng{p.seed ^ (0xD1B54A32D192ED03ull * static_cast<uint64_t>(nh + 1))};
    std::vector<int> nearest(Lv, 1 << 30);
    auto pick = static_cast<int64_t>(rng.below(static_cast<uint64_t>(Lv)));
    for (int64_t j = 0; j < Ce; ++j) {
      s.centroids[j] = codes[pick];
      nearest[pick] = -1;
      if (j + 1 == Ce) break;
      for (int64_t l = 0; l < Lv; ++l)
        nearest[l] = std::min(nearest[l], hamming(codes[l], s.centroids[j]));
      const int farthest = *std::max_element(nearest.begin(), nearest.end());
      const auto ties = std::count(nearest.begin(), nearest.end(), farthest);
      auto r = static_cast<int64_t>(rng.below(static_cast<uint64_t>(ties)));
      for (pick = 0; nearest[pick] != farthest || r-- > 0; ++pick) {
      }
    }

    // Lloyd: `iterations` majority-vote updates, each followed by an
    // assignment; stops at a fixed point.
    assign(codes, Lv, a, s);
    for (int64_t it = 0; it < p.iterations; ++it) {
      for (int64_t c = 0; c < Ce; ++c) {
        uint64_t centroid = 0;
        for (int b = 0; b < 64; ++b) {
          int64_t ones = 0;
          for (int64_t l = 0; l < Lv; ++l) ones += a[l] == c && ((codes[l] >> b) & 1);
          if (2 * ones > s.counts[c]) centroid |= uint64_t{1} << b;
        }
        s.centroids[c] = centroid;
      }
      if (!assign(codes, Lv, a, s)) break;
    }
    std::copy(s.counts.begin(), s.counts.end(), p.counts + nh * p.C);
  }
}

}  // namespace fastattn::kernels
