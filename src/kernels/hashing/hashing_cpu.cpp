// CPU kernel of sign-of-random-projection hashing (see hashing.h).
//
// The planes are packed transposed and padded to groups of four vectors,
// (E + 1, B_pad), so that each query accumulates four vectors of projections
// at a time (four independent FMA chains) with one broadcast of x[e] per
// step, starting from the biases; the signs become bits.
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
  // Four accumulators per pass keep four independent FMA chains in flight
  // (one chain would be bound by the FMA latency).
  constexpr int64_t kGroup = 4 * S::W;
  const int64_t B_pad = (B + kGroup - 1) / kGroup * kGroup;
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
          for (int64_t b0 = 0; b0 < B_pad; b0 += kGroup) {
            const T* w = pt.data() + b0;
            auto a0 = S::load(w + E * B_pad), a1 = S::load(w + E * B_pad + S::W),
                 a2 = S::load(w + E * B_pad + 2 * S::W), a3 = S::load(w + E * B_pad + 3 * S::W);
            for (int64_t e = 0; e < E; ++e) {
              const auto xe = S::set1(x[e]);
              const T* we = w + e * B_pad;
              a0 = S::fma(xe, S::load(we), a0);
              a1 = S::fma(xe, S::load(we + S::W), a1);
              a2 = S::fma(xe, S::load(we + 2 * S::W), a2);
              a3 = S::fma(xe, S::load(we + 3 * S::W), a3);
            }
            S::store(s.acc.data() + b0, a0);
            S::store(s.acc.data() + b0 + S::W, a1);
            S::store(s.acc.data() + b0 + 2 * S::W, a2);
            S::store(s.acc.data() + b0 + 3 * S::W, a3);
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
