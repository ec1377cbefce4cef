// Attention dropout's keep mask from a counter-based generator (issue 64):
// whether weight (i, j) of head nh is kept is a pure function of (seed, nh,
// i, j), so the backward regenerates the forward's mask instead of storing
// it (memory stays O(L)), any tiling or thread count gives the same mask,
// and a seed drawn from torch's generator makes a run reproducible.
//
//   row key  r = mix64(seed, nh, i)                  (once per row)
//   bits     u = h32(h32(j + lo(r)) ^ hi(r))         (per weight; lowbias32)
//   kept     u >= threshold,  threshold = round(p · 2^32)
//
// h32 is a 32-bit integer hash (two multiplies, three xor-shifts): the loops
// over j (kernels/common/dropout_rows.h, inside the kernels' instruction-set
// regions) compile to vector integer code. The rate a row keeps is
// 1 - threshold / 2^32, p to within 2^-32. Plain C++, no LibTorch.
#pragma once

#include <cmath>
#include <cstdint>

namespace fastattn::kernels {

// The threshold of dropout probability p in [0, 1): 0 keeps every weight.
inline uint32_t dropout_threshold(double p) {
  if (!(p > 0)) return 0;
  const double t = std::nearbyint(p * 4294967296.0);
  return t >= 4294967295.0 ? 4294967295u : static_cast<uint32_t>(t);
}

inline uint64_t dropout_mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

// The key of row i of head nh (nh = n·H + h) under seed.
inline uint64_t dropout_row_key(uint64_t seed, int64_t nh, int64_t i) {
  const uint64_t a = dropout_mix64(seed + 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(nh + 1));
  return dropout_mix64(a ^ (0xd1b54a32d192ed03ull * static_cast<uint64_t>(i + 1)));
}

inline uint32_t dropout_hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// The random bits of column j of a row with key row_key.
inline uint32_t dropout_bits(uint64_t row_key, int64_t j) {
  const uint32_t lo = static_cast<uint32_t>(row_key), hi = static_cast<uint32_t>(row_key >> 32);
  return dropout_hash32(dropout_hash32(static_cast<uint32_t>(j) + lo) ^ hi);
}

// The seed of a second mask under one dropout seed (improved clustered
// attention's centroid rows beside its query rows): another stream of the
// same generator, independent of the first.
constexpr uint64_t kDropoutCentroidStream = 0xa0761d6478bd642full;
inline uint64_t dropout_stream_seed(uint64_t seed, uint64_t stream) { return seed ^ stream; }

// u >= v for unsigned u, v is dropout_signed(u) >= dropout_signed(v): a
// signed comparison, which vector units have (an unsigned one made GCC 12
// leave the loops scalar).
inline int32_t dropout_signed(uint32_t u) { return static_cast<int32_t>(u ^ 0x80000000u); }

}  // namespace fastattn::kernels
