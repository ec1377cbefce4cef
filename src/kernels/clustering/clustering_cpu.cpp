// CPU kernel of Hamming K-means over hash codes (see clustering.h).
//
// Seeding: each farthest-first round relaxes every query's distance to its
// nearest centroid, taking the largest and counting its ties in the same
// pass (AVX2: 8 codes at a time, AVX-512: 16, popcounts by nibble table),
// then finds the chosen tie by vector compares.
//
// Assignment through byte tables: the distance of a code x to centroid c is
// the sum over its 8 bytes of popcount(x_b ^ c_b), so with
// tab[b][v][c] = popcount(v ^ byte b of centroid c) the distances of x to all
// centroids are the sum of the 8 rows tab[b][x_b][*]: 8 contiguous rows of
// C bytes added bytewise (max 64, no overflow), then an argmin (AVX2: over
// 16-bit keys distance·256 + column, no branch). The tables cost 8·256·C byte
// entries per assignment and are built only when the sequence is long enough
// to repay them; short sequences use plain popcounts. Both paths give the
// same assignment (exact distances, lowest index on ties).
//
// Centroid update: each member's code is spread into 64 byte counters (AVX2:
// byte j of a compare is 0xff where bit j is set, subtracted; AVX-512: the
// same from a mask register; portable: a 256-entry table maps a byte to 8
// bytes of 0/1, added with 64-bit adds); the byte counters of a cluster are
// flushed to 32-bit totals every 255 members.
//
// Assignments are incremental once few centroids move: a query whose
// centroid is the same code as in the last scan (and which that scan
// assigned) can only move to a centroid that changed, so it is compared
// with those alone. After the first update the Lloyd iterations move few
// centroids (100 clusters over 16384 codes: ~20, then ~6, ~2, none), and
// such an assignment costs O(L · moved) instead of O(L · C). The same
// clusters as full scans (the comparisons keep the lowest index on ties).
//
// Every level gives the portable level's clusters bit for bit
// (ClusterCodes.EveryCpuLevelGivesTheSameClusters). Measured: git show
// 5f604de:docs/benchmarks.md, "Clustering, top-k offers and the output
// cache" (the vector paths) and "Clustering and hashing, float32" (the
// incremental assignments).
#include "kernels/clustering/clustering.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "kernels/common/isa_target.h"
#include "kernels/common/parallel.h"
#include "kernels/common/simd.h"

FASTATTN_ISA_BEGIN
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

// Byte tables pay off from this many valid queries per table entry row (the
// tables hold 2048 rows of C bytes; the assignment reads 8 rows per query).
constexpr int64_t kTableMinQueries = 1024;
constexpr int64_t kTableAlign = 32;   // row length: C rounded up to a vector of bytes
constexpr uint8_t kPadDistance = 16;  // padding columns: 8 · 16 = 128 > any distance

// spread[v]: byte j is bit j of v (0 or 1).
constexpr std::array<uint64_t, 256> make_spread() {
  std::array<uint64_t, 256> s{};
  for (int v = 0; v < 256; ++v)
    for (int j = 0; j < 8; ++j) s[v] |= static_cast<uint64_t>((v >> j) & 1) << (8 * j);
  return s;
}
constexpr std::array<uint64_t, 256> kSpread = make_spread();

struct Scratch {
  std::vector<uint64_t> centroids;  // (C)
  std::vector<int> dist;            // (L): distance of each query to its centroid
  std::vector<int64_t> counts;      // (C)
  std::vector<int32_t> ones;        // (C, 64): members with each bit set
  std::vector<uint64_t> bytes;      // (C, 8): byte counters of the update
  std::vector<int32_t> pending;     // (C): members in the byte counters
  std::vector<uint8_t> tab;         // (8, 256, Cp): distance tables
  std::vector<uint8_t> row;         // (Cp): distances of one query
  std::vector<uint64_t> scanned;    // (C): the centroids of the last assignment
  std::vector<uint8_t> moved;       // (C): centroid c differs from scanned[c] (or was re-seeded)
  std::vector<int64_t> delta;       // the moved clusters, ascending
  std::vector<int32_t> cur;         // (L): assignments during an incremental one
};

#if FASTATTN_SIMD_AVX2
// Popcount of each byte, by a nibble table.
inline __m256i popcount_epi8(__m256i x) {
  const __m256i nib = _mm256_setr_epi8(0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4, 0, 1, 1, 2,
                                       1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4);
  const __m256i low = _mm256_set1_epi8(0x0f);
  const __m256i lo = _mm256_shuffle_epi8(nib, _mm256_and_si256(x, low));
  const __m256i hi = _mm256_shuffle_epi8(nib, _mm256_and_si256(_mm256_srli_epi16(x, 4), low));
  return _mm256_add_epi8(lo, hi);
}

// Popcount of each 64-bit lane: the sum of its 8 bytes' popcounts.
inline __m256i popcount_epi64(__m256i x) {
  return _mm256_sad_epu8(popcount_epi8(x), _mm256_setzero_si256());
}

// Hamming distances of codes[0, 8) to c, as 8 int32 in order.
inline __m256i hamming8(const uint64_t* codes, __m256i c) {
  auto ld = [&](int i) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + i)); };
  const __m256i a = popcount_epi64(_mm256_xor_si256(ld(0), c));  // int32 lanes a0 0 a1 0 ...
  const __m256i b = popcount_epi64(_mm256_xor_si256(ld(4), c));
  const __m256i ab = _mm256_or_si256(a, _mm256_slli_epi64(b, 32));  // a0 b0 a1 b1 ...
  return _mm256_permutevar8x32_epi32(ab, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
}
#endif

#if FASTATTN_SIMD_AVX512
// The same for codes[0, 16), as 16 int32 in order.
inline __m512i hamming16(const uint64_t* codes, __m512i c) {
  const __m512i nib =
      _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4));
  const __m512i low = _mm512_set1_epi8(0x0f);
  auto popcount64 = [&](__m512i x) {  // per 64-bit lane: the sum of its bytes' popcounts
    const __m512i lo = _mm512_shuffle_epi8(nib, _mm512_and_si512(x, low));
    const __m512i hi = _mm512_shuffle_epi8(nib, _mm512_and_si512(_mm512_srli_epi16(x, 4), low));
    return _mm512_sad_epu8(_mm512_add_epi8(lo, hi), _mm512_setzero_si512());
  };
  const __m256i a =
      _mm512_cvtepi64_epi32(popcount64(_mm512_xor_si512(_mm512_loadu_si512(codes), c)));
  const __m256i b =
      _mm512_cvtepi64_epi32(popcount64(_mm512_xor_si512(_mm512_loadu_si512(codes + 8), c)));
  return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}
#endif

// The largest distance after a relaxation, and how many queries have it.
struct Farthest {
  int value = -1;
  int64_t count = 0;
  void add(int d, int64_t n = 1) {
    if (d > value) {
      value = d;
      count = n;
    } else if (d == value) {
      count += n;
    }
  }
};

// dist[l] = min(dist[l], hamming(codes[l], centroid)) for l < Lv; returns the
// largest and its count (one pass: per lane, the largest so far and how many
// equal it).
Farthest relax_distances(const uint64_t* codes, int64_t Lv, uint64_t centroid, int* dist) {
  Farthest far;
  int64_t l = 0;
#if FASTATTN_SIMD_AVX512
  {
    const __m512i c = _mm512_set1_epi64(static_cast<long long>(centroid));
    __m512i m = _mm512_set1_epi32(-1), n = _mm512_setzero_si512();
    const __m512i one = _mm512_set1_epi32(1);
    for (; l + 16 <= Lv; l += 16) {
      int* p = dist + l;
      const __m512i d = _mm512_min_epi32(_mm512_loadu_si512(p), hamming16(codes + l, c));
      _mm512_storeu_si512(p, d);
      const __mmask16 gt = _mm512_cmpgt_epi32_mask(d, m), eq = _mm512_cmpeq_epi32_mask(d, m);
      n = _mm512_mask_mov_epi32(_mm512_mask_add_epi32(n, eq, n, one), gt, one);
      m = _mm512_max_epi32(m, d);
    }
    alignas(64) int lm[16], ln[16];
    _mm512_store_si512(lm, m);
    _mm512_store_si512(ln, n);
    for (int i = 0; i < 16; ++i) far.add(lm[i], ln[i]);
  }
#elif FASTATTN_SIMD_AVX2
  {
    const __m256i c = _mm256_set1_epi64x(static_cast<long long>(centroid));
    __m256i m = _mm256_set1_epi32(-1), n = _mm256_setzero_si256();
    const __m256i one = _mm256_set1_epi32(1);
    for (; l + 8 <= Lv; l += 8) {
      auto* p = reinterpret_cast<__m256i*>(dist + l);
      const __m256i d = _mm256_min_epi32(_mm256_loadu_si256(p), hamming8(codes + l, c));
      _mm256_storeu_si256(p, d);
      const __m256i gt = _mm256_cmpgt_epi32(d, m), eq = _mm256_cmpeq_epi32(d, m);
      n = _mm256_blendv_epi8(_mm256_sub_epi32(n, eq), one, gt);  // eq lanes are -1
      m = _mm256_max_epi32(m, d);
    }
    alignas(32) int lm[8], ln[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lm), m);
    _mm256_store_si256(reinterpret_cast<__m256i*>(ln), n);
    for (int i = 0; i < 8; ++i) far.add(lm[i], ln[i]);
  }
#endif
  for (; l < Lv; ++l) {
    const int d = std::min(dist[l], hamming(codes[l], centroid));
    dist[l] = d;
    far.add(d);
  }
  return far;
}

// The index of the (r+1)-th l < Lv with dist[l] == value (there is one).
int64_t find_equal(const int* dist, int64_t Lv, int value, int64_t r) {
  int64_t count = 0, l = 0;
#if FASTATTN_SIMD_AVX2
  const __m256i v = _mm256_set1_epi32(value);
  for (; l + 8 <= Lv; l += 8) {
    const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(dist + l));
    auto bits =
        static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(d, v))));
    const int n = __builtin_popcount(bits);
    if (r < count + n) {
      for (int64_t skip = r - count; skip > 0; --skip) bits &= bits - 1;
      return l + __builtin_ctz(bits);
    }
    count += n;
  }
#endif
  for (; l < Lv; ++l) {
    if (dist[l] != value) continue;
    if (count == r) return l;
    ++count;
  }
  return l;  // not reached
}

// (dist[l], cur[l]) = the smaller of itself and (hamming(codes[l], centroid),
// c) for l < Lv, comparing distances first and then indices: one moved
// centroid offered to every query.
void offer_centroid(const uint64_t* codes, int64_t Lv, uint64_t centroid, int32_t c, int* dist,
                    int32_t* cur) {
  int64_t l = 0;
#if FASTATTN_SIMD_AVX512
  {
    const __m512i cv = _mm512_set1_epi64(static_cast<long long>(centroid));
    const __m512i index = _mm512_set1_epi32(c);
    for (; l + 16 <= Lv; l += 16) {
      const __m512i d = hamming16(codes + l, cv);
      const __m512i old = _mm512_loadu_si512(dist + l), own = _mm512_loadu_si512(cur + l);
      const __mmask16 better =
          _mm512_cmplt_epi32_mask(d, old) |
          (_mm512_cmpeq_epi32_mask(d, old) & _mm512_cmpgt_epi32_mask(own, index));
      _mm512_mask_storeu_epi32(dist + l, better, d);
      _mm512_mask_storeu_epi32(cur + l, better, index);
    }
  }
#elif FASTATTN_SIMD_AVX2
  {
    const __m256i cv = _mm256_set1_epi64x(static_cast<long long>(centroid));
    const __m256i index = _mm256_set1_epi32(c);
    for (; l + 8 <= Lv; l += 8) {
      auto* pd = reinterpret_cast<__m256i*>(dist + l);
      auto* pc = reinterpret_cast<__m256i*>(cur + l);
      const __m256i d = hamming8(codes + l, cv);
      const __m256i old = _mm256_loadu_si256(pd), own = _mm256_loadu_si256(pc);
      const __m256i better = _mm256_or_si256(
          _mm256_cmpgt_epi32(old, d),
          _mm256_and_si256(_mm256_cmpeq_epi32(d, old), _mm256_cmpgt_epi32(own, index)));
      _mm256_storeu_si256(pd, _mm256_blendv_epi8(old, d, better));
      _mm256_storeu_si256(pc, _mm256_blendv_epi8(own, index, better));
    }
  }
#endif
  for (; l < Lv; ++l) {
    const int d = hamming(codes[l], centroid);
    if (d < dist[l] || (d == dist[l] && c < cur[l])) {
      dist[l] = d;
      cur[l] = c;
    }
  }
}

// Farthest-first seeding of centroids[0, Ce) from codes[0, Lv): the first a
// uniform valid query, each next the query farthest from its nearest centroid
// so far (uniform among the ties; uniform among the unchosen queries when all
// distances are 0, i.e. fewer distinct codes than clusters). A chosen query
// has distance -1, below every unchosen one.
void seed_centroids(const uint64_t* codes, int64_t Lv, int64_t Ce, SplitMix64& rng, Scratch& s) {
  int* dist = s.dist.data();
  std::fill(dist, dist + Lv, std::numeric_limits<int>::max());
  int64_t pick = static_cast<int64_t>(rng.below(Lv));
  for (int64_t j = 0; j < Ce; ++j) {
    const uint64_t centroid = codes[pick];
    s.centroids[j] = centroid;
    dist[pick] = -1;
    if (j + 1 == Ce) break;
    const Farthest far = relax_distances(codes, Lv, centroid, dist);
    pick = find_equal(dist, Lv, far.value,
                      static_cast<int64_t>(rng.below(static_cast<uint64_t>(far.count))));
  }
}

// ---- assignment ---------------------------------------------------------------

void build_tables(const uint64_t* cent, int64_t Ce, int64_t Cp, uint8_t* tab) {
  for (int b = 0; b < 8; ++b) {
    uint8_t cb[kTableAlign];
    for (int64_t c0 = 0; c0 < Cp; c0 += kTableAlign) {
      for (int64_t i = 0; i < kTableAlign; ++i) {
        cb[i] = c0 + i < Ce ? static_cast<uint8_t>(cent[c0 + i] >> (8 * b)) : 0;
      }
      const int64_t valid = std::clamp<int64_t>(Ce - c0, 0, kTableAlign);
#if FASTATTN_SIMD_AVX2
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb));
      alignas(32) uint8_t pad_mask[kTableAlign];
      for (int64_t i = 0; i < kTableAlign; ++i) pad_mask[i] = i < valid ? 0 : 0xff;
      const __m256i pm = _mm256_load_si256(reinterpret_cast<const __m256i*>(pad_mask));
      const __m256i padv = _mm256_set1_epi8(static_cast<char>(kPadDistance));
      for (int v = 0; v < 256; ++v) {
        const __m256i x = _mm256_xor_si256(c, _mm256_set1_epi8(static_cast<char>(v)));
        const __m256i d = _mm256_blendv_epi8(popcount_epi8(x), padv, pm);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(tab + (b * 256 + v) * Cp + c0), d);
      }
#else
      for (int v = 0; v < 256; ++v) {
        uint8_t* row = tab + (b * 256 + v) * Cp + c0;
        for (int64_t i = 0; i < kTableAlign; ++i) {
          row[i] = i < valid ? static_cast<uint8_t>(__builtin_popcount(v ^ cb[i])) : kPadDistance;
        }
      }
#endif
    }
  }
}

// The nearest table column to code x and its distance (the lowest column on
// ties). The distances of x are the bytewise sums of 8 table rows; the vector
// path never stores them: each sum s of column c (in blocks of 256 columns)
// becomes the 16-bit key s·256 + (c mod 256), whose minimum names the lowest
// column at the smallest distance (padding columns: s = 128). The portable
// path writes the distances to row.
inline std::pair<int64_t, int> nearest_by_table(uint64_t x, const uint8_t* tab, int64_t Cp,
                                                uint8_t* row) {
  const uint8_t* r[8];
  for (int b = 0; b < 8; ++b) r[b] = tab + (b * 256 + ((x >> (8 * b)) & 0xff)) * Cp;
#if FASTATTN_SIMD_AVX2
  (void)row;
  const __m256i iota = _mm256_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16,
                                        17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
  int64_t best_c = 0;
  int best = 256;
  for (int64_t b0 = 0; b0 < Cp; b0 += 256) {
    const int64_t b1 = std::min<int64_t>(Cp, b0 + 256);
    __m256i m = _mm256_set1_epi16(-1);
    for (int64_t c0 = b0; c0 < b1; c0 += kTableAlign) {
      auto ld = [&](int b) {
        return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r[b] + c0));
      };
      const __m256i s = _mm256_add_epi8(
          _mm256_add_epi8(_mm256_add_epi8(ld(0), ld(1)), _mm256_add_epi8(ld(2), ld(3))),
          _mm256_add_epi8(_mm256_add_epi8(ld(4), ld(5)), _mm256_add_epi8(ld(6), ld(7))));
      const __m256i col = _mm256_add_epi8(iota, _mm256_set1_epi8(static_cast<char>(c0 - b0)));
      m = _mm256_min_epu16(m, _mm256_unpacklo_epi8(col, s));
      m = _mm256_min_epu16(m, _mm256_unpackhi_epi8(col, s));
    }
    const __m128i h = _mm_min_epu16(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
    const int key = _mm_cvtsi128_si32(_mm_minpos_epu16(h)) & 0xffff;
    if ((key >> 8) < best) {
      best = key >> 8;
      best_c = b0 + (key & 0xff);
    }
  }
  return {best_c, best};
#else
  int best = 255;
  for (int64_t c = 0; c < Cp; ++c) {
    row[c] = static_cast<uint8_t>(r[0][c] + r[1][c] + r[2][c] + r[3][c] + r[4][c] + r[5][c] +
                                  r[6][c] + r[7][c]);
    best = std::min<int>(best, row[c]);
  }
  int64_t c = 0;
  while (row[c] != best) ++c;
  return {c, best};
#endif
}

// Nearest centroid of x among cent[0, Ce) by plain popcounts (the lowest index on ties).
inline std::pair<int64_t, int> nearest_by_popcount(uint64_t x, const uint64_t* cent, int64_t Ce) {
  int best = std::numeric_limits<int>::max();
  int64_t best_c = 0;
  for (int64_t c = 0; c < Ce; ++c) {
    const int d = hamming(x, cent[c]);
    if (d < best) {
      best = d;
      best_c = c;
    }
  }
  return {best_c, best};
}

// Incremental assignment while at most one cluster in this many moved: a
// vector pass over the queries per moved centroid, and a full scan for the
// queries whose own centroid moved (about 1 in C / |moved|), against a full
// scan by the tables for every query, which at C = 100 costs tens of times
// a moved centroid's pass per query.
constexpr int64_t kIncrementalPerMoved = 4;

// Assigns every valid query to its nearest centroid (the lowest index on
// ties), then re-seeds empty clusters; returns whether any assignment
// changed. `full`: scan every centroid for every query (the first
// assignment). Otherwise the clusters whose centroid moved since the last
// assignment (or that were re-seeded there) are listed, and if they are few,
// a query whose own centroid stayed keeps it unless a moved centroid is
// nearer (or as near with a lower index): the last assignment made its
// centroid the lowest-index nearest among the others, which did not move.
// dist[l] stays the distance to its centroid either way.
bool assign(const uint64_t* codes, int64_t Lv, int64_t Ce, int64_t* a, Scratch& s, bool full) {
  const uint64_t* cent = s.centroids.data();
  s.delta.clear();
  if (!full) {
    for (int64_t c = 0; c < Ce; ++c) {
      s.moved[c] = s.moved[c] || cent[c] != s.scanned[c];
      if (s.moved[c]) s.delta.push_back(c);
    }
  }
  const auto moved = static_cast<int64_t>(s.delta.size());
  const bool incremental =
      !full && moved * kIncrementalPerMoved <= Ce && Ce <= std::numeric_limits<int32_t>::max();
  if (incremental && moved == 0) return false;  // a fixed point: nothing can change
  bool changed = false;
  std::fill(s.counts.begin(), s.counts.begin() + Ce, 0);
  auto place = [&](int64_t l, int64_t c, int d) {
    changed |= a[l] != c;
    a[l] = c;
    s.dist[l] = d;
    ++s.counts[c];
  };
  // A full scan of one query: by the byte tables when they pay.
  const bool tables = Lv >= kTableMinQueries;
  const int64_t Cp = (Ce + kTableAlign - 1) / kTableAlign * kTableAlign;
  if (tables) {
    s.tab.resize(static_cast<size_t>(8 * 256 * Cp));
    s.row.resize(static_cast<size_t>(Cp));
    build_tables(cent, Ce, Cp, s.tab.data());
  }
  auto nearest = [&](uint64_t x) {
    return tables ? nearest_by_table(x, s.tab.data(), Cp, s.row.data())
                  : nearest_by_popcount(x, cent, Ce);
  };
  if (incremental) {
    // A query whose own centroid moved: scanned in full (its distance to it
    // is stale); then every query offered each moved centroid (a no-op for
    // those, whose scan saw them).
    int32_t* cur = s.cur.data();
    for (int64_t l = 0; l < Lv; ++l) {
      if (s.moved[a[l]]) {
        const auto [c, d] = nearest(codes[l]);
        cur[l] = static_cast<int32_t>(c);
        s.dist[l] = d;
      } else {
        cur[l] = static_cast<int32_t>(a[l]);
      }
    }
    for (const int64_t c : s.delta)
      offer_centroid(codes, Lv, cent[c], static_cast<int32_t>(c), s.dist.data(), cur);
    for (int64_t l = 0; l < Lv; ++l) place(l, cur[l], s.dist[l]);
  } else {
    for (int64_t l = 0; l < Lv; ++l) {
      const auto [c, d] = nearest(codes[l]);
      place(l, c, d);
    }
  }
  std::copy(cent, cent + Ce, s.scanned.begin());
  std::fill(s.moved.begin(), s.moved.begin() + Ce, uint8_t{0});
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
    s.moved[c] = 1;  // its member was not assigned by a scan
    changed = true;
  }
  return changed;
}

// ---- centroid update --------------------------------------------------------------

// Adds cluster c's byte counters to its 32-bit totals and clears them.
inline void flush_bytes(int64_t c, Scratch& s) {
  uint64_t* w = s.bytes.data() + c * 8;
  int32_t* o = s.ones.data() + c * 64;
  for (int b = 0; b < 8; ++b) {
    for (int j = 0; j < 8; ++j) o[8 * b + j] += static_cast<int32_t>((w[b] >> (8 * j)) & 0xff);
    w[b] = 0;
  }
  s.pending[c] = 0;
}

// Adds bit j of x to byte j of the 64 byte counters w (8 words).
inline void add_bits(uint64_t x, uint64_t* w) {
#if FASTATTN_SIMD_AVX512
  // Byte j of the mask register's expansion is 0xff (= -1) where bit j is set.
  auto* p = reinterpret_cast<__m512i*>(w);
  _mm512_storeu_si512(p, _mm512_sub_epi8(_mm512_loadu_si512(p), _mm512_movm_epi8(x)));
#elif FASTATTN_SIMD_AVX2
  // Each half of x broadcast, byte j/8 of it moved to byte j, then tested against bit j % 8.
  const __m256i sel = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2,
                                       2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ull));
  auto* p = reinterpret_cast<__m256i*>(w);
  for (int half = 0; half < 2; ++half) {
    const __m256i v = _mm256_set1_epi32(static_cast<int>(x >> (32 * half)));
    const __m256i m = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(v, sel), bit), bit);
    _mm256_storeu_si256(p + half, _mm256_sub_epi8(_mm256_loadu_si256(p + half), m));
  }
#else
  for (int b = 0; b < 8; ++b) w[b] += kSpread[(x >> (8 * b)) & 0xff];
#endif
}

// Centroid bit = majority of the members' bits (every cluster has members).
void update(const uint64_t* codes, int64_t Lv, int64_t Ce, const int64_t* a, Scratch& s) {
  std::fill(s.ones.begin(), s.ones.begin() + Ce * 64, 0);
  std::fill(s.bytes.begin(), s.bytes.begin() + Ce * 8, 0);
  std::fill(s.pending.begin(), s.pending.begin() + Ce, 0);
  for (int64_t l = 0; l < Lv; ++l) {
    const int64_t c = a[l];
    const uint64_t x = codes[l];
    add_bits(x, s.bytes.data() + c * 8);
    if (++s.pending[c] == 255) flush_bytes(c, s);
  }
  for (int64_t c = 0; c < Ce; ++c) {
    flush_bytes(c, s);
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
        s.bytes.resize(C * 8);
        s.pending.resize(C);
        s.scanned.resize(C);
        s.moved.resize(C);
        s.cur.resize(L);
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
        std::fill(s.moved.begin(), s.moved.end(), uint8_t{0});
        assign(codes, Lv, Ce, a, s, /*full=*/true);
        for (int64_t it = 0; it < p.iterations; ++it) {
          update(codes, Lv, Ce, a, s);
          if (!assign(codes, Lv, Ce, a, s, /*full=*/false)) break;  // fixed point
        }
        std::copy(s.counts.begin(), s.counts.begin() + Ce, counts);
      });
}

FASTATTN_ISA_END

FASTATTN_CPU_KERNEL_PLAIN(cluster_codes_cpu, ClusterParams)
