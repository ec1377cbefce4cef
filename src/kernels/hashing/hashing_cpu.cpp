// CPU kernel of sign-of-random-projection hashing (see hashing.h).
//
// The planes are packed transposed and padded to whole vectors, (E + 1, B_pad),
// so that each query accumulates all B projections in B_pad / W vector
// registers with one broadcast of x[e] per step; the signs become bits.
#include "kernels/hashing/hashing.h"

#include <algorithm>
#include <vector>

#include "kernels/common/parallel.h"
#include "kernels/common/simd.h"

namespace fastattn::kernels {
namespace {

constexpr int64_t kRowsPerItem = 256;

}  // namespace

template <typename T>
void hash_queries_cpu(const HashParams<T>& p) {
  using S = Simd<T>;
  const int64_t E = p.E;
  const int B = p.B;
  const int64_t B_pad = (B + S::W - 1) / S::W * S::W;
  // pt[e][b] = planes[b][e]; row E holds the biases; padding columns are 0.
  std::vector<T> pt(static_cast<size_t>((E + 1) * B_pad), T(0));
  for (int b = 0; b < B; ++b)
    for (int64_t e = 0; e <= E; ++e) pt[e * B_pad + b] = p.planes[b * (E + 1) + e];
  const int64_t items = (p.rows + kRowsPerItem - 1) / kRowsPerItem;
  struct Scratch {
    std::vector<T> acc;
  };
  parallel_items<Scratch>(
      items, p.num_threads, [&](Scratch& s) { s.acc.resize(B_pad); },
      [&](int64_t item, Scratch& s) {
        const int64_t r1 = std::min(p.rows, (item + 1) * kRowsPerItem);
        for (int64_t r = item * kRowsPerItem; r < r1; ++r) {
          const T* x = p.x + r * E;
          // Start from the biases, then add x[e] * w[:, e] for every e.
          std::copy(pt.begin() + E * B_pad, pt.begin() + (E + 1) * B_pad, s.acc.begin());
          for (int64_t b0 = 0; b0 < B_pad; b0 += S::W) {
            auto acc = S::load(s.acc.data() + b0);
            for (int64_t e = 0; e < E; ++e)
              acc = S::fma(S::set1(x[e]), S::load(pt.data() + e * B_pad + b0), acc);
            S::store(s.acc.data() + b0, acc);
          }
          uint64_t code = 0;
          for (int b = 0; b < B; ++b) code |= static_cast<uint64_t>(s.acc[b] > T(0)) << b;
          p.codes[r] = static_cast<int64_t>(code);
        }
      });
}

template void hash_queries_cpu<float>(const HashParams<float>&);
template void hash_queries_cpu<double>(const HashParams<double>&);

}  // namespace fastattn::kernels
