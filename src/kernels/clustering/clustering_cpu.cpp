// CPU kernel of Hamming K-means over hash codes (see clustering.h).
#include "kernels/clustering/clustering.h"

#include <algorithm>
#include <limits>
#include <vector>

#include "kernels/common/parallel.h"

namespace fastattn::kernels {
namespace {

inline int hamming(uint64_t a, uint64_t b) { return __builtin_popcountll(a ^ b); }

// splitmix64: a small counter-based generator, enough for picking seeds.
struct SplitMix64 {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  uint64_t below(uint64_t n) { return next() % n; }  // n >= 1
};

struct Scratch {
  std::vector<uint64_t> centroids;  // (C)
  std::vector<int> dist;            // (L): distance of each query to its centroid
  std::vector<int64_t> counts;      // (C)
  std::vector<int32_t> ones;        // (C, 64): members with each bit set
  std::vector<char> chosen;         // (L)
};

// Farthest-first seeding of centroids[0, Ce) from codes[0, Lv): the first a
// uniform valid query, each next the query farthest from its nearest centroid
// so far (uniform among the ties; uniform among the unchosen queries when all
// distances are 0, i.e. fewer distinct codes than clusters).
void seed_centroids(const uint64_t* codes, int64_t Lv, int64_t Ce, SplitMix64& rng, Scratch& s) {
  s.chosen.assign(Lv, 0);
  int64_t l_pick = static_cast<int64_t>(rng.below(Lv));
  for (int64_t l = 0; l < Lv; ++l) s.dist[l] = std::numeric_limits<int>::max();
  for (int64_t j = 0; j < Ce; ++j) {
    s.chosen[l_pick] = 1;
    s.centroids[j] = codes[l_pick];
    if (j + 1 == Ce) break;
    // Update the distances and find the farthest unchosen queries in one pass;
    // reservoir sampling picks uniformly among the ties.
    const uint64_t centroid = codes[l_pick];
    int best = -1;
    uint64_t ties = 0;
    for (int64_t l = 0; l < Lv; ++l) {
      const int d = std::min(s.dist[l], hamming(codes[l], centroid));
      s.dist[l] = d;
      if (s.chosen[l]) continue;
      if (d > best) {
        best = d;
        ties = 1;
        l_pick = l;
      } else if (d == best && rng.below(++ties) == 0) {
        l_pick = l;
      }
    }
  }
}

// Assigns every valid query to its nearest centroid, then re-seeds empty
// clusters. Returns whether any assignment changed.
bool assign(const uint64_t* codes, int64_t Lv, int64_t Ce, int64_t* a, Scratch& s) {
  bool changed = false;
  std::fill(s.counts.begin(), s.counts.begin() + Ce, 0);
  const uint64_t* cent = s.centroids.data();
  for (int64_t l = 0; l < Lv; ++l) {
    const uint64_t x = codes[l];
    int best = std::numeric_limits<int>::max();
    int64_t best_c = 0;
    for (int64_t c = 0; c < Ce; ++c) {
      const int d = hamming(x, cent[c]);
      if (d < best) {
        best = d;
        best_c = c;
      }
    }
    changed |= a[l] != best_c;
    a[l] = best_c;
    s.dist[l] = best;
    ++s.counts[best_c];
  }
  for (int64_t c = 0; c < Ce; ++c) {
    if (s.counts[c] > 0) continue;
    int64_t far = -1;
    for (int64_t l = 0; l < Lv; ++l) {
      if (s.counts[a[l]] >= 2 && (far < 0 || s.dist[l] > s.dist[far])) far = l;
    }
    // far exists: Ce <= Lv and cluster c is empty, so some cluster has >= 2.
    --s.counts[a[far]];
    a[far] = c;
    s.counts[c] = 1;
    s.dist[far] = 0;
    s.centroids[c] = codes[far];
    changed = true;
  }
  return changed;
}

// Centroid bit = majority of the members' bits (every cluster has members).
void update(const uint64_t* codes, int64_t Lv, int64_t Ce, const int64_t* a, Scratch& s) {
  std::fill(s.ones.begin(), s.ones.begin() + Ce * 64, 0);
  for (int64_t l = 0; l < Lv; ++l) {
    int32_t* o = s.ones.data() + a[l] * 64;
    for (uint64_t x = codes[l]; x; x &= x - 1) ++o[__builtin_ctzll(x)];
  }
  for (int64_t c = 0; c < Ce; ++c) {
    const int32_t* o = s.ones.data() + c * 64;
    uint64_t centroid = 0;
    for (int b = 0; b < 64; ++b)
      centroid |= static_cast<uint64_t>(2 * int64_t(o[b]) > s.counts[c]) << b;
    s.centroids[c] = centroid;
  }
}

}  // namespace

void cluster_codes_cpu(const ClusterParams& p) {
  const int64_t L = p.L, C = p.C;
  parallel_items<Scratch>(
      p.N * p.H, p.num_threads,
      [&](Scratch& s) {
        s.centroids.resize(C);
        s.dist.resize(L);
        s.counts.resize(C);
        s.ones.resize(C * 64);
      },
      [&](int64_t nh, Scratch& s) {
        const int64_t n = nh / p.H;
        const int64_t Lv = p.lengths ? std::clamp<int64_t>(p.lengths[n], 0, L) : L;
        const int64_t Ce = std::min(C, Lv);
        const auto* codes = reinterpret_cast<const uint64_t*>(p.codes + nh * L);
        int64_t* a = p.assignments + nh * L;
        int64_t* counts = p.counts + nh * C;
        std::fill(a, a + L, -1);
        std::fill(counts, counts + C, 0);
        if (Ce == 0) return;
        // One stream per (n, h), independent of the thread that runs it.
        SplitMix64 rng{p.seed ^ (0xD1B54A32D192ED03ull * static_cast<uint64_t>(nh + 1))};
        seed_centroids(codes, Lv, Ce, rng, s);
        assign(codes, Lv, Ce, a, s);
        for (int64_t it = 0; it < p.iterations; ++it) {
          update(codes, Lv, Ce, a, s);
          if (!assign(codes, Lv, Ce, a, s)) break;  // fixed point: nothing changes any more
        }
        std::copy(s.counts.begin(), s.counts.begin() + Ce, counts);
      });
}

}  // namespace fastattn::kernels
